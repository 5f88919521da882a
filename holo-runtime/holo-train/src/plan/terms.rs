//! Each term of a memory plan in bytes, from what the code allocates. The counts of values per token
//! are read off the passes as written (see each function); [`RUNTIME`] and [`GRAPH_VALUES`]'s
//! coefficients were then checked against measured peaks (`benches/memory_plan.py`).

use holo_model::config::{LayerSpec, LinearAttention, QkNorm};

use super::Inputs;

/// What `holo` holds besides the model: the binary, the Tokio and candle thread pools and their stacks,
/// the holoware, the rows, the records and the plots at the end. Measured: a `tiny` model's whole run
/// (0.1M parameters, 512 tokens) peaks at 73 MiB, 8 of them the model's terms (77 MiB when the
/// allocator kept what the generation freed, `holo`'s `allocator.rs`).
pub const RUNTIME: u64 = 65 << 20;

/// What one parsed tokenizer holds per byte of `tokenizer.json`, as a fraction: its vocabulary's maps,
/// merges and the added tokens' trie, measured with the `tokenizers` package on `init-model --vocab
/// 151936`'s 28 MiB file (50 MiB resident once parsed; 102 MiB at the peak of parsing, while loading).
pub const TOKENIZER_PER_FILE_BYTE: (u64, u64) = (9, 5);

/// The tokenizers a run holds: a GRPO or PPO run three copies of the policy's, the Holophore's
/// (`Local::new` clones it), the in-process sampler's and its grammars' (`LocalModel::new` clones it);
/// an SFT run, which samples nothing, the policy's alone.
pub fn tokenizer(inputs: &Inputs) -> u64 {
    let copies = if inputs.generation_batch > 0 { 3 } else { 1 };
    let (numerator, denominator) = TOKENIZER_PER_FILE_BYTE;
    copies * inputs.tokenizer_bytes * numerator / denominator
}

/// The values one token keeps per decoder layer while autograd holds the training pass's graph, counted
/// from the differentiable forward (`DecoderLayer::forward` with `Ops::Differentiable`; RoPE and the
/// attention's softmax are single operations on the CPU, `kernels/rope.rs` and `kernels/softmax.rs`),
/// per `hidden`, per key/value width and per `intermediate` element, for a layer of softmax attention
/// and a dense MLP: the input, the RMSNorm's square, normalised and scaled tensors (3), the query
/// projection and its bias (2), the rotated queries (1), the keys and values repeated to every head
/// (2), the attention's output, its transpose and `o_proj` (3), the residual (1), the second norm (3),
/// `down_proj` and the residual (2): 18 × hidden; the keys' and values' projections and biases, the
/// rotated keys: 5 × kv width; `gate_proj`, `up_proj`, the SiLU and the gated product: 4 ×
/// intermediate. Of the 18, [`ATTENTION_VALUES`]' 8 are the attention's; the other 10 every layer keeps
/// whatever mixes its tokens. `mixer_values` and `feed_forward_values` add what the other layer
/// kinds keep.
pub const GRAPH_VALUES: (u64, u64, u64) = (18, 5, 4);

/// The values per `hidden` and per key/value width of [`GRAPH_VALUES`] that softmax attention keeps:
/// the query projection and bias, the rotated queries, the repeated keys and values, the output, its
/// transpose and `o_proj` (8); the keys' and values' projections, biases and rotated keys (5).
pub const ATTENTION_VALUES: (u64, u64) = (8, 5);

/// The values of one (query, key) pair of one head kept by the graph: the scores, scaled, masked, and
/// the softmax's result.
pub const GRAPH_PAIR_VALUES: u64 = 4;

/// The sizes every term is computed from.
struct Widths {
    hidden: u64,
    /// Keys' (and values') width of a softmax-attention layer.
    kv: u64,
    /// The widest feed-forward a token goes through: the dense MLP's, or its chosen experts' and the
    /// shared expert's.
    inner: u64,
    heads: u64,
    layers: u64,
    vocab: u64,
}

fn widths(inputs: &Inputs) -> Widths {
    let c = &inputs.sizes.config;
    let mixture = c.experts.map_or(0, |experts| {
        (experts.per_token * experts.intermediate_size + experts.shared.unwrap_or(0)) as u64
    });
    Widths {
        hidden: c.hidden_size as u64,
        kv: (c.num_key_value_heads * c.head_dim) as u64,
        inner: layer_specs(inputs)
            .map(|spec| match spec.experts && c.experts.is_some() {
                true => mixture,
                false => c.intermediate_size as u64,
            })
            .max()
            .unwrap_or(0),
        heads: c.num_attention_heads as u64,
        layers: c.num_hidden_layers as u64,
        vocab: c.vocab_size as u64,
    }
}

/// Each layer's kind, in layer order.
fn layer_specs(inputs: &Inputs) -> impl Iterator<Item = LayerSpec> + '_ {
    let c = &inputs.sizes.config;
    (0..c.num_hidden_layers).map(|i| c.layers.get(i).copied().unwrap_or(LayerSpec::FULL))
}

/// The linear-attention sizes of a layer of kind `spec`, when it is Gated DeltaNet.
fn linear(inputs: &Inputs, spec: LayerSpec) -> Option<LinearAttention> {
    inputs.sizes.config.linear_attention.filter(|_| spec.linear)
}

/// What one token's token mixer keeps in a layer's graph, in values.
///
/// Softmax attention: [`ATTENTION_VALUES`], and where the family has them, its q/k norms over each head
/// (square, normalised, scaled: 3 × the queries' and keys' widths), a partial rotation (the rotated
/// part's copy and rotation, and the concatenation: 1 + 2 × the rotated fraction of each), and Qwen3.5's
/// output gate (the query projection's second half, the queries and the gate copied out, the gate's
/// sigmoid of 4 operations and the gated product: 8 × the queries' width).
///
/// Gated DeltaNet (`model/delta.rs`, training's path from a zero state): the projections (channels,
/// the gate `z`, the strengths and decays), the padding mask's products, the convolution's input with
/// its `kernel - 1` zero columns, its `kernel` products, `kernel - 1` sums and SiLU (`3 + 2 × kernel`
/// per channel); the queries and keys copied out, L2-normalised (square, quotient) and the queries
/// scaled (7 per key width), repeated to the value heads and laid out per series and concatenated for
/// the rule (2 to 6 per repeated width), the values copied and laid out; the rule's output, its copy,
/// the gate's SiLU, the norm (3) and the gated product (10 per value width in all); the strengths'
/// sigmoid and the decays' softplus and scale (22 per value head); and `out_proj` (1 × hidden). The
/// rule itself keeps nothing per token beyond its inputs and output: holo runs it recurrently, not in
/// chunks, and its backward recomputes the states from one kept every 64 tokens (`kernels/delta.rs`),
/// a transient of the layer's backward.
fn mixer_values(inputs: &Inputs, spec: LayerSpec) -> u64 {
    let c = &inputs.sizes.config;
    let hidden = c.hidden_size as u64;
    if let Some(linear) = linear(inputs, spec) {
        let channels = linear.conv_dim() as u64;
        let keys = (linear.key_heads * linear.key_head_dim) as u64;
        let heads = linear.value_heads as u64;
        let repeated = heads * linear.key_head_dim as u64;
        let values = heads * linear.value_head_dim as u64;
        let repeats = if linear.value_heads > linear.key_heads {
            2
        } else {
            0
        };
        return channels * (3 + 2 * linear.conv_kernel as u64)
            + 7 * keys
            + (4 + repeats) * repeated
            + 10 * values
            + 22 * heads
            + hidden;
    }
    let (per_hidden, per_kv) = ATTENTION_VALUES;
    let queries = (c.num_attention_heads * c.head_dim) as u64;
    let kv = (c.num_key_value_heads * c.head_dim) as u64;
    let norms = match c.variant.qk_norm {
        QkNorm::None => 0,
        QkNorm::Head | QkNorm::Projection => 3 * (queries + kv),
    };
    let partial = match c.variant.rotary_dim {
        Some(rotated) if rotated < c.head_dim => {
            (queries + kv) * (c.head_dim + 2 * rotated) as u64 / c.head_dim as u64
        }
        _ => 0,
    };
    let gate = if c.variant.attention_gate {
        8 * queries
    } else {
        0
    };
    per_hidden * hidden + per_kv * kv + norms + partial + gate
}

/// What one token's feed-forward keeps in a layer's graph beyond the 10 × hidden every layer keeps, in
/// values: a dense MLP's 4 per intermediate element; a mixture's the same over its chosen experts' widths,
/// the router's logits and softmax (2 per expert), and per chosen expert the token's row gathered, the
/// expert's output, weighted and concatenated for the sum (4 × hidden), the sum's zeros and result
/// (2 × hidden); and a shared expert's MLP (4 per its width, its output) with its gate's logit, sigmoid
/// (5) and gated product and the sum with the experts' (3 × hidden in all).
fn feed_forward_values(inputs: &Inputs, spec: LayerSpec) -> u64 {
    let c = &inputs.sizes.config;
    let hidden = c.hidden_size as u64;
    let per_inner = GRAPH_VALUES.2;
    let Some(experts) = c.experts.filter(|_| spec.experts) else {
        return per_inner * c.intermediate_size as u64;
    };
    let chosen = experts.per_token as u64;
    let routed = per_inner * chosen * experts.intermediate_size as u64
        + 2 * experts.count as u64
        + (4 * chosen + 2) * hidden;
    let shared = experts
        .shared
        .map_or(0, |inner| per_inner * inner as u64 + 3 * hidden + 5);
    routed + shared
}

/// The values one token keeps in the graph of a layer of kind `spec`: the 10 × hidden of
/// [`GRAPH_VALUES`] every layer keeps, its token mixer's and its feed-forward's.
fn token_values(inputs: &Inputs, spec: LayerSpec) -> u64 {
    let (per_hidden, _, _) = GRAPH_VALUES;
    let around = (per_hidden - ATTENTION_VALUES.0) * inputs.sizes.config.hidden_size as u64;
    around + mixer_values(inputs, spec) + feed_forward_values(inputs, spec)
}

/// Each layer's kind and what its LoRA adapters add to a token's values (`Linear::forward_parts`): per
/// adapted projection, `x Aᵀ` (its rank), the product with `Bᵀ`, its scaling and the sum with the
/// base's output (3 × its outputs). The experts' adapters are not counted.
fn layers(inputs: &Inputs) -> Vec<(LayerSpec, u64)> {
    let adapted = match &inputs.lora {
        Some(lora) => inputs.sizes.adapted(lora),
        None => Vec::new(),
    };
    layer_specs(inputs)
        .enumerate()
        .map(|(i, spec)| {
            let adapter = adapted.get(i).map_or(0, |projections| {
                projections
                    .iter()
                    .map(|(_, outputs, rank)| 3 * outputs + rank)
                    .sum()
            });
            (spec, adapter)
        })
        .collect()
}

/// The weights, in the training type; under `--quantized`, the projections kept as the file's blocks
/// at their blocks' bytes instead, and the output head's blocks beside its dense tensor (the sampler's
/// logits read them), the rest dequantized to the training type.
pub fn weights(inputs: &Inputs) -> u64 {
    match blocks(inputs) {
        Some(kept) => {
            (inputs.sizes.parameters - kept.projections) * inputs.dtype_bytes
                + kept.projection_bytes
                + kept.head_bytes
        }
        None => inputs.sizes.parameters * inputs.dtype_bytes,
    }
}

/// What a `--quantized` run keeps as the GGUF file's blocks; `None` for any other run.
fn blocks(inputs: &Inputs) -> Option<holo_model::gguf::KeptBlocks> {
    inputs.sizes.blocks.filter(|_| inputs.quantized)
}

/// Under `--quantized`, the largest projection's blocks expanded to f32 (`kernels/blocks.rs`): each
/// product of a training or scoring pass, forward (`x · Wᵀ`) and backward (`∂y · W`, the written-out
/// backward's and autograd's alike), expands its matrix and drops it after that product, so one
/// expansion is alive at a time, beside whatever that phase holds.
pub fn expansion(inputs: &Inputs) -> u64 {
    blocks(inputs).map_or(0, |kept| kept.largest * 4)
}

/// The frozen reference of a run with `beta` > 0: the base weights kept beside the trained copy
/// (`Trainable::new` copies every weight into a `Var`; the reference is the base itself). LoRA's base is
/// shared by the trained model and the reference: nothing more.
pub fn reference(inputs: &Inputs) -> u64 {
    if inputs.reference && inputs.lora.is_none() {
        weights(inputs)
    } else {
        0
    }
}

/// The elements trained: every weight, or the adapters.
pub fn trained(inputs: &Inputs) -> u64 {
    match &inputs.lora {
        Some(lora) => inputs.sizes.adapters(lora),
        None => inputs.sizes.parameters,
    }
}

/// Under `max_off_policy_steps = k`, the snapshots of the trained weights (the adapters under LoRA)
/// that the generations drawn ahead sample with: one per generation started and not yet drawn, at most
/// `k + 1`.
pub fn snapshots(inputs: &Inputs) -> u64 {
    match inputs.ahead {
        0 => 0,
        k => (k + 1) * trained(inputs) * trained_bytes(inputs),
    }
}

/// Under `max_off_policy_steps`, the keys, values and decoding buffers of the thread that draws ahead,
/// alive while the steps score and train.
pub fn drawing(inputs: &Inputs) -> u64 {
    match inputs.ahead {
        0 => 0,
        _ => cache(inputs) + sampling(inputs),
    }
}

/// The bytes of one trained element: the weights' type, or f32 for adapters over a half-precision base
/// (`dispatch::adapter_dtype`).
fn trained_bytes(inputs: &Inputs) -> u64 {
    match inputs.lora {
        Some(_) => inputs.dtype_bytes.max(4),
        None => inputs.dtype_bytes,
    }
}

/// The gradients of the trained elements, in their type; with several micro-batches a step holds their
/// sum and the next micro-batch's gradients at once (`Trainable::accumulate`).
pub fn gradients(inputs: &Inputs) -> u64 {
    let once = trained(inputs) * trained_bytes(inputs);
    if inputs.accumulation > 1 {
        2 * once
    } else {
        once
    }
}

/// AdamW's state: two f32 moments per trained element, and an f32 master copy of each narrower weight
/// (`optim.rs`). It is created by the first step and lives for the rest of the run.
pub fn optimizer(inputs: &Inputs) -> u64 {
    let elements = trained(inputs);
    let masters = if trained_bytes(inputs) < 4 {
        elements * 4
    } else {
        0
    };
    2 * elements * 4 + masters
}

/// The one-tensor-at-a-time temporaries of an optimizer step: none for f32 on the CPU (updated in place,
/// `update_host`); for narrower weights the gradient widened to f32 and candle's update (moments,
/// square root, quotient, decayed weight: 6 tensors) of the largest trained weight.
pub fn update(inputs: &Inputs) -> u64 {
    if trained_bytes(inputs) >= 4 {
        return 0;
    }
    let largest = match &inputs.lora {
        Some(_) => 0,
        None => inputs.sizes.largest(),
    };
    7 * largest * 4
}

/// The tokens of one micro-batch's pass: its sequences as padded rows of prompt and completion.
fn rows(inputs: &Inputs) -> (u64, u64) {
    (
        inputs.micro_batch as u64,
        (inputs.prompt_tokens + inputs.completion_tokens) as u64,
    )
}

/// The graph of one decoder layer of kind `spec` for one micro-batch, in values: [`token_values`] and
/// its `adapter`'s per token and, for softmax attention, [`GRAPH_PAIR_VALUES`] per (query, key) pair
/// and head.
fn layer_values(inputs: &Inputs, (spec, adapter): (LayerSpec, u64)) -> u64 {
    let w = widths(inputs);
    let (count, width) = rows(inputs);
    let pairs = match linear(inputs, spec) {
        Some(_) => 0,
        None => GRAPH_PAIR_VALUES * w.heads * count * width * width,
    };
    count * width * (token_values(inputs, spec) + adapter) + pairs
}

/// The activations one micro-batch keeps through its backward, in the weights' type: with the graph
/// kept, every layer's; with recomputation (`gradient_checkpointing`), each layer's input
/// (`Model::backward_recomputed_with_head`). Both keep the embeddings, the final norm and the trained
/// positions' hidden states.
pub fn activations(inputs: &Inputs) -> u64 {
    let w = widths(inputs);
    let (count, width) = rows(inputs);
    let tokens = count * width;
    let values = if inputs.recompute {
        tokens * w.layers * w.hidden
    } else {
        layers(inputs)
            .into_iter()
            .map(|layer| layer_values(inputs, layer))
            .sum()
    };
    (values + 4 * tokens * w.hidden) * inputs.dtype_bytes
}

/// The one layer whose backward runs at a time, beside the activations: alive after the head's backward
/// is done, so the plan counts it in a phase of its own ("backward"), not beside the head. A layer with a
/// backward written out (`backward.rs`: f32 or f64, softmax attention without a gate or sinks, a dense
/// MLP) recomputed from its input holds its values and their gradients (2 × its values); one through
/// candle's autograd (Gated DeltaNet, Qwen3.5's gated attention, mixtures, half precision) holds its
/// values and their gradients as autograd makes them, each a tensor of zeros the gradient is added into
/// (3 × its values, measured 3.4 on the tiny Qwen3.5). Without recomputation every layer's backward is
/// autograd's over the kept graph, whose values the activations count: its gradients (2 × the largest
/// layer's values).
pub fn layer(inputs: &Inputs) -> u64 {
    let largest = |values: &dyn Fn((LayerSpec, u64)) -> u64| {
        layers(inputs).into_iter().map(values).max().unwrap_or(0) * inputs.dtype_bytes
    };
    match inputs.recompute {
        true => largest(&|layer| {
            let copies = if written_backward(inputs, layer.0) {
                2
            } else {
                3
            };
            copies * layer_values(inputs, layer)
        }),
        false => largest(&|layer| 2 * layer_values(inputs, layer)),
    }
}

/// Whether a layer of kind `spec` has its backward written out (`DecoderLayer::has_backward`).
fn written_backward(inputs: &Inputs, spec: LayerSpec) -> bool {
    let c = &inputs.sizes.config;
    let mixture = spec.experts && c.experts.is_some();
    inputs.dtype_bytes >= 4
        && !spec.linear
        && !mixture
        && !c.variant.attention_gate
        && !c.variant.attention_sinks
}

/// The trained tokens of one micro-batch.
fn trained_tokens(inputs: &Inputs) -> u64 {
    (inputs.micro_batch * inputs.trained_tokens) as u64
}

/// The rank of the output head's adapter, when LoRA trains one (`lm_head` among its targets).
fn head_rank(inputs: &Inputs) -> Option<u64> {
    inputs
        .lora
        .as_ref()
        .and_then(|lora| inputs.sizes.head_rank(lora))
}

/// The elements of the concatenated head a head adapter trains, `[W, B]` `[vocab, hidden + rank]`: its
/// copy, and each of its gradients, is this many elements of the adapters' type.
fn adapted_head(inputs: &Inputs) -> u64 {
    let w = widths(inputs);
    head_rank(inputs).map_or(0, |rank| w.vocab * (w.hidden + rank))
}

/// A pass over the output head with its adapter (`Model::head_operands`): PEFT's `x Wᵀ + scale · (x Aᵀ)
/// Bᵀ` as one product of concatenated operands, the head with `B`'s columns beside it `[W, B]` `[vocab,
/// hidden + rank]` and the trained tokens' `[x, scale · x Aᵀ]` `[N, hidden + rank]`, in the adapters'
/// type; over a narrower base, the head's weight and the hidden states widened to f32 first. The head's
/// graph holds them until the micro-batch's backward returns (under recomputation the loss keeps it
/// while the layers are recomputed), so the plan counts them in the training and the backward phases;
/// the old policy's scores make them again ([`scoring`]). Their gradients are the [`head`]'s.
pub fn head_adapter(inputs: &Inputs) -> u64 {
    let Some(rank) = head_rank(inputs) else {
        return 0;
    };
    let w = widths(inputs);
    let bytes = trained_bytes(inputs);
    let tokens = trained_tokens(inputs);
    let widened = if inputs.dtype_bytes < bytes {
        (w.vocab + tokens) * w.hidden * bytes
    } else {
        0
    };
    (w.vocab + tokens) * (w.hidden + rank) * bytes + widened
}

/// The output head of one micro-batch (`model/output.rs`): below [`Inputs::head_budget`] elements, the
/// whole logits in f32 held by the graph, and in the backward the logits' gradient as candle's autograd
/// adds it into its store (zeros, the gradient, their sum: three more `[N, vocab]` tensors), and the
/// product's half-precision logits and gradient for a narrower model; beyond the budget, the custom
/// operation's block of logits at a time, its gradient written over it (`logits_gradient`, in place).
///
/// With every weight trained, the head's weight gradient `[vocab, hidden]` is at most three at once, the
/// one the step keeps (the [`gradients`] term) and two more: the product's gradient (whole, or the
/// blocks concatenated once) beside autograd's zeros and their sum, which its store keeps
/// (`GradStore::or_insert`, then `add`). Whole, that comes after the logits' own gradient is summed
/// (the logits, the gradient's copy, autograd's zeros and sum: four `[N, vocab]` at once), when the
/// logits and that sum are left; in blocks, the blocks of the head's gradient grow beside a block of
/// logits and are freed when the operation returns. The embeddings' gradient, later
/// (`backward_recomputed_with_head` ends with the lookup), is autograd's zeros with the looked-up rows
/// added and, for a tied head, those rows beside the head's gradient and their sum: again at most two
/// beyond the one kept, with the head's tensors gone.
///
/// A head adapter's concatenated head ([`head_adapter`]) has its gradient twice at once, after the
/// logits' (in blocks beside their concatenation, or whole the product's beside autograd's sum of it;
/// then that sum beside the gradient autograd's concatenation hands back to the frozen head, `W`'s
/// columns).
pub fn head(inputs: &Inputs) -> u64 {
    let w = widths(inputs);
    let logits = trained_tokens(inputs) * w.vocab;
    let held = logits.min(inputs.head_budget as u64);
    let narrow = if inputs.dtype_bytes < 4 {
        2 * held * inputs.dtype_bytes
    } else {
        0
    };
    // Whole: the logits, and autograd's zeros, gradient and sum; in blocks: a block, then its gradient
    // in its place.
    let whole = logits <= held;
    let copies = if whole { 4 } else { 1 };
    // A head adapter's concatenated head gets its gradient after the logits' own: whole, the product's
    // gradient and autograd's sum of it beside the logits and their gradient; in blocks, the blocks of
    // gradient gathered beside the last block's gradient, then beside their concatenation. The larger
    // of the two moments is the head's.
    let adapted = adapted_head(inputs) * trained_bytes(inputs);
    let logits_and_adapter = match (adapted, whole) {
        (0, _) => copies * held * 4,
        (_, true) => (copies * held * 4).max(2 * held * 4 + 2 * adapted),
        (_, false) => (copies * held * 4 + adapted).max(2 * adapted),
    };
    if inputs.lora.is_some() {
        return logits_and_adapter + narrow;
    }
    let gradient = w.vocab * w.hidden * inputs.dtype_bytes;
    let logits_and_gradient = match whole {
        true => (copies * held * 4).max(2 * held * 4 + 2 * gradient),
        false => (held * 4 + gradient).max(2 * gradient),
    };
    logits_and_gradient + narrow
}

/// The sampler's keys and values for the whole generation batch at full length: per token, a key and a
/// value of every softmax-attention layer's key/value heads in the weights' type, with the eighth more
/// (and 16 columns) each sequence's cache keeps for the steps to come (`model/cache.rs`); and per
/// sequence, each Gated DeltaNet layer's states, whatever the length: the convolution's last
/// `kernel - 1` inputs and the rule's `key_dim × value_dim` per value head, in f32 over a half-precision
/// model (`delta::state_dtype`).
pub fn cache(inputs: &Inputs) -> u64 {
    let w = widths(inputs);
    let length = (inputs.prompt_tokens + inputs.completion_tokens) as u64;
    let columns = (length + length / 8).next_multiple_of(16);
    let per_sequence: u64 = layer_specs(inputs)
        .map(|spec| match linear(inputs, spec) {
            Some(linear) => {
                let states = linear.conv_dim() * (linear.conv_kernel - 1)
                    + linear.value_heads * linear.key_head_dim * linear.value_head_dim;
                states as u64 * inputs.dtype_bytes.max(4)
            }
            None => columns * 2 * w.kv * inputs.dtype_bytes,
        })
        .sum();
    inputs.generation_batch as u64 * per_sequence
}

/// What a decoding step and a prefill chunk hold beside the cache: the batch's logits in f32 with the
/// sampler's probabilities, and one layer's activations of the prefill (at most the scheduler's 2,048
/// tokens a step).
pub fn sampling(inputs: &Inputs) -> u64 {
    if inputs.generation_batch == 0 {
        return 0;
    }
    let w = widths(inputs);
    let logits = 3 * inputs.generation_batch as u64 * w.vocab * 4;
    let prefill = (inputs.generation_batch * inputs.prompt_tokens).min(2048) as u64;
    let layer = prefill * (4 * w.hidden + 3 * w.inner) * inputs.dtype_bytes;
    logits + layer
}

/// The log-probabilities of the old policy or the reference (`score::sequence_logprobs`): a forward
/// without graph, one layer's activations at a time, and the head's logits without gradient, with a
/// head adapter's concatenated operands ([`head_adapter`]).
pub fn scoring(inputs: &Inputs) -> u64 {
    if !inputs.scores {
        return 0;
    }
    let w = widths(inputs);
    let (count, width) = rows(inputs);
    let tokens = count * width;
    let layer = tokens * (4 * w.hidden + 3 * w.inner) + 3 * w.heads * count * width * width;
    let logits = (trained_tokens(inputs) * w.vocab).min(inputs.head_budget as u64);
    layer * inputs.dtype_bytes + logits * 4 + head_adapter(inputs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::tests::inputs;
    use crate::plan::Sizes;
    use holo_model::model::Targets;

    /// The tiny Qwen2 shapes (`testing::config`-like: hidden 64, intermediate 128, 2 layers, 4 heads, 2
    /// key/value heads × 16, vocabulary 512, tied), counted by hand.
    #[test]
    fn each_term_is_its_hand_count() {
        let mut run = inputs();
        // 512 × 64 embeddings + 2 layers × (64 × (64 + 2 × 32) + 64 × 64 + 3 × 64 × 128, the q, k and v
        // biases 64 + 2 × 32, the norms 2 × 64) + the final norm 64.
        let parameters = 32_768 + 2 * (8_192 + 4_096 + 24_576 + 128 + 128) + 64;
        assert_eq!(parameters, 107_072);
        assert_eq!(run.sizes.parameters, parameters);
        assert_eq!(weights(&run), parameters * 4);
        assert_eq!(reference(&run), 0);
        assert_eq!(gradients(&run), parameters * 4);
        assert_eq!(optimizer(&run), parameters * 8);
        assert_eq!(update(&run), 0);
        // A 1,000-byte tokenizer.json: three copies of 1.8 bytes a byte; one when nothing samples.
        run.tokenizer_bytes = 1_000;
        assert_eq!(tokenizer(&run), 5_400);
        run.generation_batch = 0;
        assert_eq!(tokenizer(&run), 1_800);
        run.generation_batch = 8;
        // 2 rows of 10 + 6 tokens; per token and layer 18 × 64 + 5 × 32 + 4 × 128 = 1,824 values;
        // per layer 4 × 4 heads × 2 rows × 16² pairs.
        let values = 32 * 1_824 + 4 * 4 * 2 * 256;
        assert_eq!(activations(&run), (2 * values + 4 * 32 * 64) * 4);
        // Autograd's backward over the kept graph: one layer's gradients at a time.
        assert_eq!(layer(&run), 2 * values * 4);
        // 2 × 6 trained tokens × 512 logits and their gradient as autograd adds it (4 of 24 KiB), or
        // after that the logits and the sum (2) beside the tied head's gradient twice more than the
        // one kept (the product's, autograd's zeros; 128 KiB each): the latter here.
        assert_eq!(head(&run), 2 * 12 * 512 * 4 + 2 * 512 * 64 * 4);
        // 8 sequences × 32 columns (16 + 2, rounded up to 16) × key and value × 2 layers × 32.
        assert_eq!(cache(&run), 8 * 32 * 2 * 2 * 32 * 4);
        assert_eq!(
            sampling(&run),
            3 * 8 * 512 * 4 + 80 * (4 * 64 + 3 * 128) * 4
        );
        assert_eq!(scoring(&run), 0);
        assert_eq!((snapshots(&run), drawing(&run)), (0, 0));
        // Two generations drawn ahead: three copies of the weights at most, and the sampler beside
        // the steps.
        run.ahead = 2;
        assert_eq!(snapshots(&run), 3 * parameters * 4);
        assert_eq!(drawing(&run), cache(&run) + sampling(&run));
        run.ahead = 0;

        run.recompute = true;
        assert_eq!(activations(&run), (32 * 2 * 64 + 4 * 32 * 64) * 4);
        assert_eq!(layer(&run), 2 * values * 4);
        run.reference = true;
        run.scores = true;
        assert_eq!(reference(&run), parameters * 4);
        assert_eq!(
            scoring(&run),
            (32 * (4 * 64 + 3 * 128) + 3 * 4 * 2 * 256) * 4 + 12 * 512 * 4
        );
        run.accumulation = 2;
        assert_eq!(gradients(&run), 2 * parameters * 4);

        // LoRA of rank 4 on q_proj and v_proj: 2 layers × 4 × ((64 + 64) + (64 + 32)); its base is the
        // reference, its head frozen.
        run.lora = Some(holo_model::model::LoraConfig {
            rank: 4,
            targets: Targets::names(&["q_proj", "v_proj"]),
            ..Default::default()
        });
        let adapters = 2 * 4 * (128 + 96);
        assert_eq!(trained(&run), adapters);
        run.ahead = 1;
        assert_eq!(snapshots(&run), 2 * adapters * 4);
        run.ahead = 0;
        assert_eq!(reference(&run), 0);
        assert_eq!(optimizer(&run), adapters * 8);
        assert_eq!(head(&run), 4 * 12 * 512 * 4);

        // bf16: masters, the widened update of the largest weight (the embeddings), half-precision
        // logits beside the f32 ones.
        run.lora = None;
        run.accumulation = 1;
        run.dtype_bytes = 2;
        assert_eq!(optimizer(&run), parameters * 12);
        assert_eq!(update(&run), 7 * 32_768 * 4);
        assert_eq!(
            head(&run),
            2 * 12 * 512 * 4 + 2 * 512 * 64 * 2 + 2 * 12 * 512 * 2
        );
    }

    /// A LoRA adapter on the output head (rank 8 by its pattern, the layers' at 4): its elements are
    /// trained, a pass holds the concatenated head `[W, B]` and tokens `[x, scale · x Aᵀ]`, the head's
    /// backward that head's gradient twice, and the old policy's scores make the operands again; over
    /// a bf16 base the adapters are f32 and the head and hidden states are widened first.
    #[test]
    fn a_head_adapter_holds_the_head_beside_its_columns() {
        let mut run = inputs();
        run.lora = Some(holo_model::model::LoraConfig {
            rank: 4,
            targets: Targets::names(&["q_proj", "v_proj", "lm_head"]),
            rank_pattern: [("lm_head".to_string(), 8)].into_iter().collect(),
            ..Default::default()
        });
        // 2 layers × 4 × ((64 + 64) + (64 + 32)), and 8 × (64 + 512) for the head.
        assert_eq!(trained(&run), 2 * 4 * (128 + 96) + 8 * (64 + 512));
        // 512 vocabulary rows and 2 × 6 trained tokens, each 64 + 8 wide.
        let operands = (512 + 12) * 72;
        assert_eq!(head_adapter(&run), operands * 4);
        // The whole logits and their gradient beside the adapted head's gradient twice, more than the
        // logits' four copies; in blocks of 1,000 logits, the adapted head's gradient twice, more than
        // a block's gradient beside the gradient gathered.
        let gradient = 512 * 72 * 4;
        assert_eq!(head(&run), 2 * 12 * 512 * 4 + 2 * gradient);
        run.head_budget = 1_000;
        assert_eq!(head(&run), 2 * gradient);
        // 200 sequences' blocks of 200,000 logits: a block's gradient beside the gradient gathered is
        // more.
        run.micro_batch = 200;
        run.head_budget = 200_000;
        assert_eq!(head(&run), 200_000 * 4 + gradient);
        run.micro_batch = 2;
        run.head_budget = holo_model::model::LOGITS_BUDGET;
        assert_eq!(scoring(&run), 0);
        run.scores = true;
        assert_eq!(
            scoring(&run),
            (32 * (4 * 64 + 3 * 128) + 3 * 4 * 2 * 256) * 4 + 12 * 512 * 4 + operands * 4
        );
        let plan = crate::plan::Plan::of(&run);
        for (phase, held, _) in plan.phases() {
            let expected = ["training", "backward"].contains(&phase);
            assert_eq!(held.contains(&"head adapter"), expected, "{phase}");
        }

        run.dtype_bytes = 2;
        let widened = (512 + 12) * 64 * 4;
        assert_eq!(head_adapter(&run), operands * 4 + widened);
        assert_eq!(
            head(&run),
            2 * 12 * 512 * 4 + 2 * gradient + 2 * 12 * 512 * 2
        );

        // Without `lm_head` (`all-linear` leaves it out) there is no head adapter.
        run.lora = Some(holo_model::model::LoraConfig {
            rank: 4,
            targets: Targets::names(&["all-linear"]),
            ..Default::default()
        });
        assert_eq!(
            (head_adapter(&run), head(&run) - 4 * 12 * 512 * 4),
            (0, 2 * 12 * 512 * 2)
        );
    }

    /// `--quantized` over the tiny Qwen2's Q8_0 file: the projections (2 layers of q and o 64 × 64, k and
    /// v 32 × 64, gate, up and down 64 × 128: 73,728 weights) at Q8_0's 34 bytes per 32 instead of
    /// f32's 4 a weight, the tied embeddings' blocks (512 × 64) beside their f32, and one MLP matrix
    /// (64 × 128) expanded to f32 in the passes; the same file loaded dequantized plans every weight in
    /// f32 and expands nothing.
    #[test]
    fn a_quantized_base_weighs_its_blocks() {
        let mut run = inputs();
        run.lora = Some(holo_model::model::LoraConfig {
            rank: 4,
            targets: Targets::names(&["all-linear"]),
            ..Default::default()
        });
        let projections = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128);
        assert_eq!(projections, 73_728);
        run.sizes.blocks = Some(holo_model::gguf::KeptBlocks {
            projections,
            projection_bytes: projections / 32 * 34,
            largest: 64 * 128,
            head_bytes: 512 * 64 / 32 * 34,
        });
        assert_eq!(weights(&run), 107_072 * 4);
        assert_eq!(expansion(&run), 0);
        let dense = crate::plan::Plan::of(&run);
        run.quantized = true;
        assert_eq!(weights(&run), (107_072 - 73_728) * 4 + 78_336 + 34_816);
        assert_eq!(expansion(&run), 64 * 128 * 4);
        let plan = crate::plan::Plan::of(&run);
        for ((phase, held, bytes), (_, _, dense)) in plan.phases().into_iter().zip(dense.phases()) {
            let expands = ["scoring", "training", "backward"].contains(&phase);
            assert_eq!(held.contains(&"expansion"), expands, "{phase}");
            let expansion = if expands { 64 * 128 * 4 } else { 0 };
            assert_eq!(
                bytes + 73_728 * 4,
                dense + 78_336 + 34_816 + expansion,
                "{phase}"
            );
        }
    }

    /// Beyond the head's budget only a block of logits is held (its gradient written over it), beside
    /// the blocks of a trained head's gradient; then their concatenation beside autograd's zeros and
    /// sum: twice the head's gradient beside the one kept, the larger for blocks of 1,000 logits, not
    /// for blocks of 100,000.
    #[test]
    fn the_head_holds_its_budget_beyond_it() {
        let mut run = inputs();
        run.head_budget = 1_000;
        assert_eq!(head(&run), 2 * 512 * 64 * 4);
        run.head_budget = 100_000;
        run.micro_batch = 200;
        assert_eq!(head(&run), 100_000 * 4 + 512 * 64 * 4);
    }

    /// Qwen3.5's tiny shapes (hidden 64, 2 layers: Gated DeltaNet then gated attention, 4 heads and 2
    /// key/value heads of 32 rotated over 8, q/k norms; linear attention of 2 key heads and 4 value
    /// heads of 16, kernel 4), counted by hand from the layers' code; then its mixture's (4 experts of
    /// 32, 2 per token, a shared expert of 32).
    #[test]
    fn qwen3_5_layers_are_counted_by_kind() {
        use holo_model::config::Arch;
        use holo_model::init::{preset_config, Preset};
        let mut run = inputs();
        run.sizes = Sizes::of_config(preset_config(Arch::Qwen3_5, Preset::Tiny, 512, 1, 2));
        // Linear attention: 128 channels × (3 + 2 × 4), 7 × 32 key width, 6 × 64 repeated, 10 × 64
        // values, 22 × 4 value heads, out_proj 64; around it 10 × 64, the MLP 4 × 128.
        let linear = 128 * 11 + 7 * 32 + 6 * 64 + 10 * 64 + 22 * 4 + 64;
        assert_eq!(linear, 2_808);
        let linear_token = 10 * 64 + linear + 4 * 128;
        // Gated attention: 8 × 64 + 5 × 64, the norms 3 × (128 + 64), the quarter rotated
        // (128 + 64) × 48 / 32, the gate 8 × 128.
        let attention = 8 * 64 + 5 * 64 + 3 * 192 + 192 * 48 / 32 + 8 * 128;
        let attention_token = 10 * 64 + attention + 4 * 128;
        // 2 rows of 16 tokens; softmax attention's 4 heads × 2 rows × 16² pairs, 4 values each.
        let pairs = 4 * 4 * 2 * 256;
        assert_eq!(
            activations(&run),
            (32 * linear_token + 32 * attention_token + pairs + 4 * 32 * 64) * 4
        );
        let largest = (32 * linear_token).max(32 * attention_token + pairs);
        assert_eq!(largest, 32 * attention_token + pairs);
        assert_eq!(layer(&run), 2 * largest * 4);
        // Recomputed, both layers' backward is autograd's: the values and their gradients, each
        // gradient beside the zeros it is added into.
        run.recompute = true;
        assert_eq!(layer(&run), 3 * largest * 4);
        // LoRA of rank 4 on `in_proj_z` (64 outputs) and `q_proj` (256: queries and gate): per token
        // and adapted projection `x Aᵀ`, its product with `Bᵀ`, scaled, added (3 × outputs + rank).
        run.recompute = false;
        let full = activations(&run);
        run.lora = Some(holo_model::model::LoraConfig {
            rank: 4,
            targets: holo_model::model::Targets::names(&["in_proj_z", "q_proj"]),
            ..Default::default()
        });
        assert_eq!(
            activations(&run) - full,
            32 * ((3 * 64 + 4) + (3 * 256 + 4)) * 4
        );
        run.lora = None;
        // 8 sequences: the attention layer's keys and values over 32 columns, the linear layer's
        // states (128 channels × 3 inputs, 4 heads × 16 × 16).
        assert_eq!(cache(&run), 8 * (32 * 2 * 64 * 4 + (128 * 3 + 4 * 256) * 4));

        // The mixture: the chosen experts' 4 × 2 × 32, the router's 2 × 4, (4 × 2 + 2) × 64 for
        // gathering, weighting and summing, the shared expert's 4 × 32 and 3 × 64 + 5.
        let mut run = inputs();
        run.sizes = Sizes::of_config(preset_config(Arch::Qwen3_5Moe, Preset::Tiny, 512, 1, 2));
        let mixture = 4 * 2 * 32 + 2 * 4 + 10 * 64 + 4 * 32 + 3 * 64 + 5;
        assert_eq!(
            activations(&run),
            (32 * (10 * 64 + linear + mixture)
                + 32 * (10 * 64 + attention + mixture)
                + pairs
                + 4 * 32 * 64)
                * 4
        );
        // The prefill's layer in sampling goes through 2 experts of 32 and the shared expert of 32.
        assert_eq!(
            sampling(&run),
            3 * 8 * 512 * 4 + 80 * (4 * 64 + 3 * (2 * 32 + 32)) * 4
        );
    }
}
