//! Gated DeltaNet's token mixing on the CPU (Qwen3.5's linear-attention layers): the causal depthwise
//! convolution and the gated delta rule, both over each row's real tokens from and into its states, and
//! the delta rule as one differentiable operation with its backward written out.
//!
//! The rule runs recurrently, token by token, for prefill and training alike (transformers' reference
//! and the fla kernels chunk the sequence to turn it into matrix products for GPUs): per token and value
//! head it reads and writes a `key_dim × value_dim` state a few times, a few percent of the layer's
//! projections on a CPU, and it is exact at every length. Each value head of each row is a series of its
//! own, spread over candle's thread pool.
//!
//! For a series with queries `q`, keys `k` (both L2-normalised, the queries scaled by `1/√key_dim`),
//! values `v`, log decays `g ≤ 0` and write strengths `β`, from state `S` (`key_dim × value_dim`):
//!
//! ```text
//! S' = exp(g_t) · S        δ = β_t · (v_t − S'ᵀ k_t)        S = S' + k_t δᵀ        o_t = Sᵀ q_t
//! ```

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Shape, Tensor};

use super::kernel::{contiguous, for_each_chunk, for_each_chunk_pair, Real, Result};

/// How many tokens' states the backward recomputes and keeps at once (it keeps one state every this many
/// tokens from its forward).
const SPAN: usize = 64;

/// The sizes of a call: `series` independent sequences of `len` tokens.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    series: usize,
    len: usize,
    key_dim: usize,
    value_dim: usize,
}

/// One series' inputs, each token's entries consecutive.
struct Series<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    g: &'a [T],
    beta: &'a [T],
}

/// One token of the rule: decays `state`, writes the token, returns `δ` and `S'ᵀ k` in `scratch`
/// (`[δ | kv]`, `2 · value_dim`), and writes `o = Sᵀ q` into `out`.
#[allow(clippy::too_many_arguments)]
fn token<T: Real>(
    state: &mut [T],
    (q, k, v): (&[T], &[T], &[T]),
    g: T,
    beta: T,
    value_dim: usize,
    scratch: &mut [T],
    out: &mut [T],
) {
    let decay = g.exp();
    let (delta, kv) = scratch.split_at_mut(value_dim);
    kv.fill(T::ZERO);
    for (row, &ki) in state.chunks_exact_mut(value_dim).zip(k) {
        for (s, kv) in row.iter_mut().zip(kv.iter_mut()) {
            *s *= decay;
            *kv += *s * ki;
        }
    }
    for ((delta, &kv), &v) in delta.iter_mut().zip(kv.iter()).zip(v) {
        *delta = beta * (v - kv);
    }
    out.fill(T::ZERO);
    for ((row, &ki), &qi) in state.chunks_exact_mut(value_dim).zip(k).zip(q) {
        for ((s, &delta), o) in row.iter_mut().zip(delta.iter()).zip(out.iter_mut()) {
            *s += ki * delta;
            *o += *s * qi;
        }
    }
}

/// The rule over one series from `state` (updated in place), skipping the tokens `real` marks 0 (their
/// output is 0 and the state stays).
fn series_forward<T: Real>(
    inputs: &Series<T>,
    sizes: Sizes,
    real: Option<&[u8]>,
    state: &mut [T],
    out: &mut [T],
) {
    let (dk, dv) = (sizes.key_dim, sizes.value_dim);
    let mut scratch = vec![T::ZERO; 2 * dv];
    for t in 0..sizes.len {
        let out = &mut out[t * dv..][..dv];
        if real.is_some_and(|real| real[t] == 0) {
            out.fill(T::ZERO);
            continue;
        }
        let vectors = (
            &inputs.q[t * dk..][..dk],
            &inputs.k[t * dk..][..dk],
            &inputs.v[t * dv..][..dv],
        );
        token(
            state,
            vectors,
            inputs.g[t],
            inputs.beta[t],
            dv,
            &mut scratch,
            out,
        );
    }
}

/// The gradients of one series from a zero state: `grads` holds per token `[∂q | ∂k | ∂v | ∂g | ∂β]`.
fn series_backward<T: Real>(inputs: &Series<T>, sizes: Sizes, upstream: &[T], grads: &mut [T]) {
    let (len, dk, dv) = (sizes.len, sizes.key_dim, sizes.value_dim);
    let width = 2 * dk + dv + 2;
    let size = dk * dv;
    // The state before every SPAN-th token.
    let spans = len.div_ceil(SPAN);
    let mut starts = vec![T::ZERO; spans * size];
    let mut state = vec![T::ZERO; size];
    let mut scratch = vec![T::ZERO; 2 * dv];
    let mut discard = vec![T::ZERO; dv];
    for t in 0..len {
        if t % SPAN == 0 {
            starts[(t / SPAN) * size..][..size].copy_from_slice(&state);
        }
        let vectors = (
            &inputs.q[t * dk..][..dk],
            &inputs.k[t * dk..][..dk],
            &inputs.v[t * dv..][..dv],
        );
        token(
            &mut state,
            vectors,
            inputs.g[t],
            inputs.beta[t],
            dv,
            &mut scratch,
            &mut discard,
        );
    }
    // ∂L/∂S after the current token, carried backwards.
    let mut d_state = vec![T::ZERO; size];
    let mut d_decayed = vec![T::ZERO; size];
    // The states before each token of a span, and after the last.
    let mut before = vec![T::ZERO; (SPAN + 1) * size];
    let mut d_delta = vec![T::ZERO; dv];
    for span in (0..spans).rev() {
        let first = span * SPAN;
        let last = (first + SPAN).min(len);
        before[..size].copy_from_slice(&starts[span * size..][..size]);
        for t in first..last {
            let (done, rest) = before.split_at_mut((t - first + 1) * size);
            let next = &mut rest[..size];
            next.copy_from_slice(&done[(t - first) * size..]);
            let vectors = (
                &inputs.q[t * dk..][..dk],
                &inputs.k[t * dk..][..dk],
                &inputs.v[t * dv..][..dv],
            );
            token(
                next,
                vectors,
                inputs.g[t],
                inputs.beta[t],
                dv,
                &mut scratch,
                &mut discard,
            );
        }
        for t in (first..last).rev() {
            let (q, k, v) = (
                &inputs.q[t * dk..][..dk],
                &inputs.k[t * dk..][..dk],
                &inputs.v[t * dv..][..dv],
            );
            let (g, beta) = (inputs.g[t], inputs.beta[t]);
            let decay = g.exp();
            let previous = &before[(t - first) * size..][..size];
            let after = &before[(t - first + 1) * size..][..size];
            let d_out = &upstream[t * dv..][..dv];
            let grads = &mut grads[t * width..][..width];
            let (d_q, rest) = grads.split_at_mut(dk);
            let (d_k, rest) = rest.split_at_mut(dk);
            let (d_v, rest) = rest.split_at_mut(dv);
            // o = Sᵀ q: ∂q = S ∂o, ∂S += q ∂oᵀ.
            for (i, (d_q, &qi)) in d_q.iter_mut().zip(q).enumerate() {
                let row = &after[i * dv..][..dv];
                let mut sum = T::ZERO;
                for ((&s, &d), ds) in row.iter().zip(d_out).zip(&mut d_state[i * dv..][..dv]) {
                    sum += s * d;
                    *ds += qi * d;
                }
                *d_q = sum;
            }
            // S = S' + k δᵀ, with S' = exp(g) S_prev and δ = β (v − S'ᵀ k).
            let kv: Vec<T> = (0..dv)
                .map(|j| {
                    let mut sum = T::ZERO;
                    for (i, &ki) in k.iter().enumerate() {
                        sum += decay * previous[i * dv + j] * ki;
                    }
                    sum
                })
                .collect();
            d_delta.fill(T::ZERO);
            for (i, (d_k, &ki)) in d_k.iter_mut().zip(k).enumerate() {
                let mut sum = T::ZERO;
                for (j, (&ds, dd)) in d_state[i * dv..][..dv]
                    .iter()
                    .zip(d_delta.iter_mut())
                    .enumerate()
                {
                    sum += ds * beta * (v[j] - kv[j]);
                    *dd += ds * ki;
                }
                *d_k = sum;
            }
            let mut d_beta = T::ZERO;
            for (j, d_v) in d_v.iter_mut().enumerate() {
                d_beta += d_delta[j] * (v[j] - kv[j]);
                *d_v = beta * d_delta[j];
            }
            // S'ᵀ k: ∂S' += k ∂kvᵀ with ∂kv = −β ∂δ; ∂k += S' ∂kv.
            d_decayed.copy_from_slice(&d_state);
            let mut d_g = T::ZERO;
            for (i, (d_k, &ki)) in d_k.iter_mut().zip(k).enumerate() {
                let mut sum = T::ZERO;
                for j in 0..dv {
                    let decayed = decay * previous[i * dv + j];
                    let d_kv = -(beta * d_delta[j]);
                    sum += decayed * d_kv;
                    let entry = &mut d_decayed[i * dv + j];
                    *entry += ki * d_kv;
                    d_g += decayed * *entry;
                }
                *d_k += sum;
            }
            rest[0] = d_g;
            rest[1] = d_beta;
            for (ds, &dd) in d_state.iter_mut().zip(d_decayed.iter()) {
                *ds = decay * dd;
            }
        }
    }
}

/// The parts of a call's inputs, as the series read them.
struct Inputs<'a, T> {
    qk: &'a [T],
    v: &'a [T],
    gb: &'a [T],
}

/// One series' inputs, copied out of the packed layouts.
struct Owned<T> {
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    g: Vec<T>,
    beta: Vec<T>,
}

impl<T: Real> Owned<T> {
    fn series(&self) -> Series<'_, T> {
        Series {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            g: &self.g,
            beta: &self.beta,
        }
    }
}

impl<T: Real> Inputs<'_, T> {
    /// Series `index`'s inputs, copied out of the packed layouts (queries and keys side by side per
    /// token, log decay and strength side by side).
    fn series(&self, index: usize, sizes: Sizes) -> Owned<T> {
        let (len, dk, dv) = (sizes.len, sizes.key_dim, sizes.value_dim);
        let qk = &self.qk[index * len * 2 * dk..][..len * 2 * dk];
        let gb = &self.gb[index * len * 2..][..len * 2];
        let (mut q, mut k) = (Vec::with_capacity(len * dk), Vec::with_capacity(len * dk));
        for token in qk.chunks_exact(2 * dk) {
            q.extend_from_slice(&token[..dk]);
            k.extend_from_slice(&token[dk..]);
        }
        Owned {
            q,
            k,
            v: self.v[index * len * dv..][..len * dv].to_vec(),
            g: gb.iter().step_by(2).copied().collect(),
            beta: gb.iter().skip(1).step_by(2).copied().collect(),
        }
    }
}

/// The delta rule from a zero state as one operation: inputs `qk` `[S, T, 2 · key_dim]` (queries then
/// keys), `v` `[S, T, value_dim]`, `gb` `[S, T, 2]` (log decay, strength); output `[S, T, value_dim]`.
struct Rule;

fn sizes_of(qk: &Layout, v: &Layout) -> Result<Sizes> {
    let (series, len, two_dk) = qk.shape().dims3()?;
    let value_dim = v.shape().dims3()?.2;
    Ok(Sizes {
        series,
        len,
        key_dim: two_dk / 2,
        value_dim,
    })
}

fn rule_forward<T: Real>(inputs: &Inputs<T>, sizes: Sizes) -> Vec<T> {
    let per_series = sizes.len * sizes.value_dim;
    let mut out = vec![T::ZERO; sizes.series * per_series];
    let cost = sizes.len * sizes.key_dim * sizes.value_dim * 3;
    for_each_chunk(&mut out, per_series, cost, |index, out| {
        let owned = inputs.series(index, sizes);
        let mut state = vec![T::ZERO; sizes.key_dim * sizes.value_dim];
        series_forward(&owned.series(), sizes, None, &mut state, out);
    });
    out
}

fn rule_backward<T: Real>(inputs: &Inputs<T>, sizes: Sizes, upstream: &[T]) -> Vec<T> {
    let width = 2 * sizes.key_dim + sizes.value_dim + 2;
    let per_series = sizes.len * width;
    let mut grads = vec![T::ZERO; sizes.series * per_series];
    let cost = sizes.len * sizes.key_dim * sizes.value_dim * 12;
    let per_upstream = sizes.len * sizes.value_dim;
    for_each_chunk(&mut grads, per_series, cost, |index, grads| {
        let owned = inputs.series(index, sizes);
        let upstream = &upstream[index * per_upstream..][..per_upstream];
        series_backward(&owned.series(), sizes, upstream, grads);
    });
    grads
}

impl CustomOp3 for Rule {
    fn name(&self) -> &'static str {
        "gated-delta-rule"
    }

    fn cpu_fwd(
        &self,
        qk: &CpuStorage,
        qk_layout: &Layout,
        v: &CpuStorage,
        v_layout: &Layout,
        gb: &CpuStorage,
        gb_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let sizes = sizes_of(qk_layout, v_layout)?;
        let shape = Shape::from((sizes.series, sizes.len, sizes.value_dim));
        macro_rules! run {
            ($t:ty, $variant:ident) => {{
                let inputs = Inputs::<$t> {
                    qk: contiguous(qk, qk_layout, "the delta rule")?,
                    v: contiguous(v, v_layout, "the delta rule")?,
                    gb: contiguous(gb, gb_layout, "the delta rule")?,
                };
                CpuStorage::$variant(rule_forward(&inputs, sizes))
            }};
        }
        let out = match qk.dtype() {
            DType::F32 => run!(f32, F32),
            DType::F64 => run!(f64, F64),
            other => candle_core::bail!("the delta rule in {other:?}"),
        };
        Ok((out, shape))
    }

    fn bwd(
        &self,
        qk: &Tensor,
        v: &Tensor,
        gb: &Tensor,
        _out: &Tensor,
        upstream: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (series, len, two_dk) = qk.dims3()?;
        let sizes = Sizes {
            series,
            len,
            key_dim: two_dk / 2,
            value_dim: v.dim(2)?,
        };
        let width = two_dk + sizes.value_dim + 2;
        macro_rules! run {
            ($t:ty) => {{
                let (qk, v, gb) = (
                    qk.flatten_all()?.to_vec1::<$t>()?,
                    v.flatten_all()?.to_vec1::<$t>()?,
                    gb.flatten_all()?.to_vec1::<$t>()?,
                );
                let upstream = upstream.contiguous()?.flatten_all()?.to_vec1::<$t>()?;
                let inputs = Inputs {
                    qk: &qk,
                    v: &v,
                    gb: &gb,
                };
                Tensor::from_vec(
                    rule_backward(&inputs, sizes, &upstream),
                    (series, len, width),
                    &Device::Cpu,
                )?
            }};
        }
        let grads = match qk.dtype() {
            DType::F32 => run!(f32),
            DType::F64 => run!(f64),
            other => candle_core::bail!("the delta rule's backward in {other:?}"),
        };
        Ok((
            Some(grads.narrow(2, 0, two_dk)?),
            Some(grads.narrow(2, two_dk, sizes.value_dim)?),
            Some(grads.narrow(2, two_dk + sizes.value_dim, 2)?),
        ))
    }
}

/// The delta rule from a zero state over every token (training, and passes without a cache): `q`, `k`
/// `[S, T, key_dim]`, `v` `[S, T, value_dim]`, `g`, `beta` `[S, T]`, f32 or f64 on the CPU; output
/// `[S, T, value_dim]`, with a backward when `differentiable`.
pub(crate) fn rule(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    differentiable: bool,
) -> Result<Tensor> {
    let qk = Tensor::cat(&[q, k], 2)?.contiguous()?;
    let gb = Tensor::stack(&[g, beta], 2)?.contiguous()?;
    let v = v.contiguous()?;
    match differentiable {
        true => qk.apply_op3(&v, &gb, Rule),
        false => qk.apply_op3_no_bwd(&v, &gb, &Rule),
    }
}

/// The values of a contiguous tensor, read where they are.
fn slice<'a, T: candle_core::WithDType>(
    guard: &'a candle_core::StorageRef<'_>,
    layout: &Layout,
    what: &str,
) -> Result<&'a [T]> {
    match &**guard {
        candle_core::Storage::Cpu(storage) => contiguous(storage, layout, what),
        _ => candle_core::bail!("{what} on the CPU only"),
    }
}

/// One buffer `[outputs | states]` as two contiguous views shaped `out_shape` and `state_shape`: the
/// next step reads the states where they are, without a copy.
fn split(
    both: Tensor,
    outputs: usize,
    out_shape: &[usize],
    state_shape: &[usize],
) -> Result<(Tensor, Tensor)> {
    let states = both.elem_count() - outputs;
    Ok((
        both.narrow(0, 0, outputs)?.reshape(out_shape)?,
        both.narrow(0, outputs, states)?.reshape(state_shape)?,
    ))
}

/// The delta rule over the real tokens of each series from its state (sampling): as [`rule`], with
/// `states` `[S, key_dim, value_dim]` and `real` (`S · T` flags, 0 for padding, whose output is 0 and
/// which leaves the state as it was). Returns the output and the states after the last real token.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rule_from(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    states: &Tensor,
    real: &[u8],
) -> Result<(Tensor, Tensor)> {
    let (series, len, key_dim) = q.dims3()?;
    let value_dim = v.dim(2)?;
    let sizes = Sizes {
        series,
        len,
        key_dim,
        value_dim,
    };
    if real.len() != series * len {
        candle_core::bail!(
            "{} real-token flags for {series} × {len} tokens",
            real.len()
        );
    }
    if len == 0 {
        return Ok((v.clone(), states.clone()));
    }
    let (outputs, size) = (len * value_dim, key_dim * value_dim);
    let tensors = [q, k, v, g, beta, states].map(Tensor::contiguous);
    let [q, k, v, g, beta, states] = tensors;
    let (q, k, v, g, beta, states) = (q?, k?, v?, g?, beta?, states?);
    macro_rules! run {
        ($t:ty) => {{
            let (q_guard, q_layout) = q.storage_and_layout();
            let (k_guard, k_layout) = k.storage_and_layout();
            let (v_guard, v_layout) = v.storage_and_layout();
            let (g_guard, g_layout) = g.storage_and_layout();
            let (beta_guard, beta_layout) = beta.storage_and_layout();
            let (states_guard, states_layout) = states.storage_and_layout();
            let what = "the delta rule";
            let q: &[$t] = slice(&q_guard, q_layout, what)?;
            let k: &[$t] = slice(&k_guard, k_layout, what)?;
            let v: &[$t] = slice(&v_guard, v_layout, what)?;
            let g: &[$t] = slice(&g_guard, g_layout, what)?;
            let beta: &[$t] = slice(&beta_guard, beta_layout, what)?;
            let states: &[$t] = slice(&states_guard, states_layout, what)?;
            let mut both = vec![<$t>::ZERO; series * (outputs + size)];
            let (out, state) = both.split_at_mut(series * outputs);
            let cost = len * size * 3;
            for_each_chunk_pair((state, size), (out, outputs), cost, |index, state, out| {
                state.copy_from_slice(&states[index * size..][..size]);
                let series = Series {
                    q: &q[index * len * key_dim..][..len * key_dim],
                    k: &k[index * len * key_dim..][..len * key_dim],
                    v: &v[index * outputs..][..outputs],
                    g: &g[index * len..][..len],
                    beta: &beta[index * len..][..len],
                };
                series_forward(
                    &series,
                    sizes,
                    Some(&real[index * len..][..len]),
                    state,
                    out,
                );
            });
            Tensor::from_vec(both, series * (outputs + size), &Device::Cpu)?
        }};
    }
    let both = match q.dtype() {
        DType::F32 => run!(f32),
        DType::F64 => run!(f64),
        other => candle_core::bail!("the delta rule in {other:?}"),
    };
    split(
        both,
        series * outputs,
        &[series, len, value_dim],
        &[series, key_dim, value_dim],
    )
}

/// The causal depthwise convolution of each row's real tokens, continuing from its last inputs, then
/// SiLU (sampling): `mixed` `[B, T, C]`, `weight` `[C, K]`, `states` `[B, C, K - 1]` (the row's last
/// `K - 1` inputs, oldest first), `real` (`B · T` flags). Padding's output is 0 and it is not an input.
/// Returns the output and the states after the last real token.
pub(crate) fn conv_from(
    mixed: &Tensor,
    weight: &Tensor,
    states: &Tensor,
    real: &[u8],
) -> Result<(Tensor, Tensor)> {
    let (batch, len, channels) = mixed.dims3()?;
    let kernel = weight.dim(1)?;
    let kept = kernel - 1;
    if real.len() != batch * len {
        candle_core::bail!("{} real-token flags for {batch} × {len} tokens", real.len());
    }
    if len == 0 || kept == 0 {
        candle_core::bail!("a convolution of width {kernel} over {len} tokens");
    }
    let (outputs, size) = (len * channels, channels * kept);
    let (mixed, weight, states) = (
        mixed.contiguous()?,
        weight.contiguous()?,
        states.contiguous()?,
    );
    macro_rules! run {
        ($t:ty) => {{
            let (mixed_guard, mixed_layout) = mixed.storage_and_layout();
            let (weight_guard, weight_layout) = weight.storage_and_layout();
            let (states_guard, states_layout) = states.storage_and_layout();
            let what = "the convolution";
            let mixed: &[$t] = slice(&mixed_guard, mixed_layout, what)?;
            let weight: &[$t] = slice(&weight_guard, weight_layout, what)?;
            let states: &[$t] = slice(&states_guard, states_layout, what)?;
            let mut both = vec![<$t>::ZERO; batch * (outputs + size)];
            let (out, state) = both.split_at_mut(batch * outputs);
            for_each_chunk_pair(
                (state, size),
                (out, outputs),
                outputs * kernel,
                |row, state, out| {
                    state.copy_from_slice(&states[row * size..][..size]);
                    for t in 0..len {
                        if real[row * len + t] == 0 {
                            continue;
                        }
                        let input = &mixed[(row * len + t) * channels..][..channels];
                        let out = &mut out[t * channels..][..channels];
                        for (c, (&x, out)) in input.iter().zip(out.iter_mut()).enumerate() {
                            let taps = &weight[c * kernel..][..kernel];
                            let history = &mut state[c * kept..][..kept];
                            let mut sum = taps[kept] * x;
                            for (&tap, &earlier) in taps.iter().zip(history.iter()) {
                                sum += tap * earlier;
                            }
                            *out = sum / (<$t>::ONE + (-sum).exp());
                            if kept > 0 {
                                history.copy_within(1.., 0);
                                history[kept - 1] = x;
                            }
                        }
                    }
                },
            );
            Tensor::from_vec(both, batch * (outputs + size), &Device::Cpu)?
        }};
    }
    let both = match mixed.dtype() {
        DType::F32 => run!(f32),
        DType::F64 => run!(f64),
        other => candle_core::bail!("the convolution in {other:?}"),
    };
    split(
        both,
        batch * outputs,
        &[batch, len, channels],
        &[batch, channels, kept],
    )
}
