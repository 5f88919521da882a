//! Tinker's built-in losses, as its documentation defines them: each is a sum over every target token of
//! every datum (no mean: the client weighs tokens through `weights` or `advantages`), with `p` the
//! trained policy's probability of the target token and `q` the sampler's (`logprobs` input):
//!
//! | `loss_fn` | inputs besides `target_tokens` | per-token loss | `loss_fn_config` |
//! |---|---|---|---|
//! | `cross_entropy` | `weights` | `−w · log p` | — |
//! | `importance_sampling` | `logprobs`, `advantages` | `−(p / q) · A` | — |
//! | `ppo` | `logprobs`, `advantages` | `−min(r · A, clip(r, lo, hi) · A)`, `r = p / q` | `clip_low_threshold` (0.8), `clip_high_threshold` (1.2) |
//! | `cispo` | `logprobs`, `advantages` | `−sg(clip(r, lo, hi)) · log p · A` | `clip_low_threshold` (0.0), `clip_high_threshold` (4.0) |
//! | `dro` | `logprobs`, `advantages` | `−(log p · A − β/2 · (log p − log q)²)` | `beta` (required) |
//!
//! `sg` stops the gradient. CISPO's defaults are the one-sided clip tinker-cookbook documents. DRO is
//! Direct Reward Optimization (Richemond et al., 2024) as Tinker's documentation writes it; neither the
//! documentation nor the SDK gives `beta` a default (other servers of the API disagree on one: TuFT
//! took 1.0, then 0.01), so a request must say it. A KL penalty against a reference is not a server
//! loss in Tinker: the cookbook folds it into the advantages before `forward_backward`.

use std::collections::BTreeMap;

use candle_core::{Result, Tensor};

/// A `loss_fn_config` value: the SDK writes numbers to both config maps and strings to the second only.
#[derive(Debug, Clone, PartialEq)]
pub enum Setting {
    Number(f64),
    Text(String),
}

/// One of the served losses, with its settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LossFn {
    CrossEntropy,
    ImportanceSampling,
    Ppo { low: f64, high: f64 },
    Cispo { low: f64, high: f64 },
    Dro { beta: f64 },
}

/// The losses served, by the names the SDK sends.
pub const NAMES: [&str; 5] = [
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
];

const CLIP_KEYS: [&str; 2] = ["clip_low_threshold", "clip_high_threshold"];

const DRO_KEYS: [&str; 1] = ["beta"];

impl LossFn {
    /// The loss `name` with `config`; an unknown loss, an unknown key, a text value, thresholds out of
    /// order and a missing or negative `beta` are refused, naming them.
    pub fn parse(
        name: &str,
        config: &BTreeMap<String, Setting>,
    ) -> std::result::Result<Self, String> {
        let keys: &[&str] = match name {
            "cross_entropy" | "importance_sampling" => &[],
            "ppo" | "cispo" => &CLIP_KEYS,
            "dro" => &DRO_KEYS,
            other => {
                return Err(format!(
                    "loss_fn: `{other}` is not served (served: {})",
                    NAMES.join(", ")
                ))
            }
        };
        let mut numbers = BTreeMap::new();
        for (key, value) in config {
            if !keys.contains(&key.as_str()) {
                let takes = if keys.is_empty() {
                    "takes no settings".to_string()
                } else {
                    format!("takes {}", keys.join(", "))
                };
                return Err(format!(
                    "loss_fn_config: `{key}` is not a setting of `{name}` (it {takes})"
                ));
            }
            match value {
                Setting::Number(number) if number.is_finite() => {
                    numbers.insert(key.as_str(), *number);
                }
                Setting::Number(number) => {
                    return Err(format!("loss_fn_config.{key}: {number} is not finite"))
                }
                Setting::Text(text) => {
                    return Err(format!(
                        "loss_fn_config.{key}: a number is expected, not the text `{text}`"
                    ))
                }
            }
        }
        let clip = |(low, high): (f64, f64)| {
            let low = numbers.get(CLIP_KEYS[0]).copied().unwrap_or(low);
            let high = numbers.get(CLIP_KEYS[1]).copied().unwrap_or(high);
            match 0.0 <= low && low <= high {
                true => Ok((low, high)),
                false => Err(format!(
                    "loss_fn_config: clip_low_threshold {low} and clip_high_threshold {high} must \
                     satisfy 0 <= low <= high"
                )),
            }
        };
        Ok(match name {
            "cross_entropy" => LossFn::CrossEntropy,
            "importance_sampling" => LossFn::ImportanceSampling,
            "ppo" => {
                let (low, high) = clip((0.8, 1.2))?;
                LossFn::Ppo { low, high }
            }
            "cispo" => {
                let (low, high) = clip((0.0, 4.0))?;
                LossFn::Cispo { low, high }
            }
            _ => match numbers.get("beta") {
                Some(&beta) if beta >= 0.0 => LossFn::Dro { beta },
                Some(beta) => return Err(format!("loss_fn_config.beta: {beta} is below 0")),
                None => {
                    return Err(
                        "loss_fn_config: `dro` needs `beta`, the weight of its quadratic \
                                penalty (Tinker documents no default)"
                            .into(),
                    )
                }
            },
        })
    }

    /// The float inputs the loss reads, besides `target_tokens`.
    pub fn inputs(&self) -> &'static [&'static str] {
        match self {
            LossFn::CrossEntropy => &["weights"],
            _ => &["logprobs", "advantages"],
        }
    }

    /// The per-token loss `[N]` (differentiable through `logprobs`, the policy's `log p` of each target)
    /// from `inputs`, the float inputs of [`LossFn::inputs`] in order, flattened like `logprobs`.
    pub fn per_token(&self, logprobs: &Tensor, inputs: &[Tensor]) -> Result<Tensor> {
        match *self {
            LossFn::CrossEntropy => (logprobs * &inputs[0])?.neg(),
            LossFn::ImportanceSampling => {
                let ratio = (logprobs - &inputs[0])?.exp()?;
                (ratio * &inputs[1])?.neg()
            }
            LossFn::Ppo { low, high } => {
                let ratio = (logprobs - &inputs[0])?.exp()?;
                let advantages = &inputs[1];
                let unclipped = (&ratio * advantages)?;
                let clipped = (ratio.clamp(low, high)? * advantages)?;
                unclipped.minimum(&clipped)?.neg()
            }
            LossFn::Cispo { low, high } => {
                let ratio = (logprobs - &inputs[0])?.exp()?;
                let weight = ratio.clamp(low, high)?.detach();
                ((weight * logprobs)? * &inputs[1])?.neg()
            }
            LossFn::Dro { beta } => dro(logprobs, &inputs[0], &inputs[1], beta),
        }
    }
}

/// DRO's per-token loss `−(log p · A − β/2 · (log p − log q)²)`, `logprobs` the policy's `log p`,
/// `sampled` the sampler's `log q`.
fn dro(logprobs: &Tensor, sampled: &Tensor, advantages: &Tensor, beta: f64) -> Result<Tensor> {
    let penalty = (logprobs - sampled)?.sqr()?.affine(0.5 * beta, 0.0)?;
    (logprobs * advantages)?.sub(&penalty)?.neg()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn config(pairs: &[(&str, Setting)]) -> BTreeMap<String, Setting> {
        pairs
            .iter()
            .map(|(key, value)| (key.to_string(), value.clone()))
            .collect()
    }

    #[test]
    fn settings_are_checked_by_name() {
        assert_eq!(
            LossFn::parse("ppo", &config(&[])),
            Ok(LossFn::Ppo {
                low: 0.8,
                high: 1.2
            })
        );
        assert_eq!(
            LossFn::parse(
                "cispo",
                &config(&[("clip_high_threshold", Setting::Number(2.0))])
            ),
            Ok(LossFn::Cispo {
                low: 0.0,
                high: 2.0
            })
        );
        let error = LossFn::parse("ppo", &config(&[("beta", Setting::Number(0.1))])).unwrap_err();
        assert!(
            error.contains("`beta` is not a setting of `ppo`"),
            "{error}"
        );
        let error = LossFn::parse(
            "cross_entropy",
            &config(&[("clip_low_threshold", Setting::Number(0.1))]),
        )
        .unwrap_err();
        assert!(error.contains("takes no settings"), "{error}");
        assert_eq!(
            LossFn::parse("dro", &config(&[("beta", Setting::Number(0.05))])),
            Ok(LossFn::Dro { beta: 0.05 })
        );
        let error = LossFn::parse("dro", &config(&[])).unwrap_err();
        assert!(error.contains("`dro` needs `beta`"), "{error}");
        let error = LossFn::parse("dro", &config(&[("beta", Setting::Number(-1.0))])).unwrap_err();
        assert!(error.contains("beta: -1 is below 0"), "{error}");
        let error = LossFn::parse(
            "dro",
            &config(&[
                ("beta", Setting::Number(0.1)),
                ("clip_low_threshold", Setting::Number(0.1)),
            ]),
        )
        .unwrap_err();
        assert!(
            error.contains("`clip_low_threshold` is not a setting of `dro` (it takes beta)"),
            "{error}"
        );
        let error = LossFn::parse("gspo", &config(&[])).unwrap_err();
        assert!(error.contains("`gspo` is not served"), "{error}");
        let error = LossFn::parse(
            "ppo",
            &config(&[("clip_low_threshold", Setting::Text("low".into()))]),
        )
        .unwrap_err();
        assert!(error.contains("not the text `low`"), "{error}");
        let error = LossFn::parse(
            "ppo",
            &config(&[("clip_low_threshold", Setting::Number(1.5))]),
        )
        .unwrap_err();
        assert!(error.contains("low <= high"), "{error}");
    }

    /// Values and gradients against the formulas written out by hand.
    #[test]
    fn per_token_values_and_gradients() -> Result<()> {
        let device = Device::Cpu;
        let lp = [-0.5f32, -1.0, -2.0];
        let q = [-0.7f32, -1.0, -1.0];
        let a = [1.0f32, -2.0, 0.5];
        let policy = Var::new(&lp[..], &device)?;
        let sampler = Tensor::new(&q[..], &device)?;
        let advantages = Tensor::new(&a[..], &device)?;
        let inputs = [sampler, advantages];
        let close = |got: Vec<f32>, want: Vec<f64>| {
            for (g, w) in got.iter().zip(&want) {
                assert!((*g as f64 - w).abs() < 1e-5, "{got:?} != {want:?}");
            }
        };
        let ratio: Vec<f64> = (0..3).map(|i| ((lp[i] - q[i]) as f64).exp()).collect();

        let loss = LossFn::ImportanceSampling.per_token(policy.as_tensor(), &inputs)?;
        close(
            loss.to_vec1()?,
            (0..3).map(|i| -ratio[i] * a[i] as f64).collect(),
        );
        let grads = loss.sum_all()?.backward()?;
        close(
            grads.get(policy.as_tensor()).unwrap().to_vec1()?,
            (0..3).map(|i| -ratio[i] * a[i] as f64).collect(),
        );

        // PPO with [0.9, 1.1]: token 0 (r = 1.22, A > 0) is clipped and has no gradient; token 2
        // (r = 0.37, A > 0) keeps the unclipped term, the smaller.
        let ppo = LossFn::Ppo {
            low: 0.9,
            high: 1.1,
        };
        let loss = ppo.per_token(policy.as_tensor(), &inputs)?;
        close(
            loss.to_vec1()?,
            vec![-1.1, -ratio[1] * -2.0, -ratio[2] * 0.5],
        );
        let grads = loss.sum_all()?.backward()?;
        close(
            grads.get(policy.as_tensor()).unwrap().to_vec1()?,
            vec![0.0, -ratio[1] * -2.0, -ratio[2] * 0.5],
        );

        // CISPO: the clipped ratio is a constant weight on log p.
        let cispo = LossFn::Cispo {
            low: 0.9,
            high: 1.1,
        };
        let weight = [1.1, 1.0, 0.9];
        let loss = cispo.per_token(policy.as_tensor(), &inputs)?;
        close(
            loss.to_vec1()?,
            (0..3)
                .map(|i| -weight[i] * lp[i] as f64 * a[i] as f64)
                .collect(),
        );
        let grads = loss.sum_all()?.backward()?;
        close(
            grads.get(policy.as_tensor()).unwrap().to_vec1()?,
            (0..3).map(|i| -weight[i] * a[i] as f64).collect(),
        );

        // DRO, against its objective and derivative in f64: d/d(log p) of −(log p · A − β/2 · δ²),
        // δ = log p − log q, is −(A − β · δ).
        let beta = 0.3;
        let delta: Vec<f64> = (0..3).map(|i| lp[i] as f64 - q[i] as f64).collect();
        let loss = LossFn::Dro { beta }.per_token(policy.as_tensor(), &inputs)?;
        close(
            loss.to_vec1()?,
            (0..3)
                .map(|i| -(lp[i] as f64 * a[i] as f64 - 0.5 * beta * delta[i] * delta[i]))
                .collect(),
        );
        let grads = loss.sum_all()?.backward()?;
        close(
            grads.get(policy.as_tensor()).unwrap().to_vec1()?,
            (0..3).map(|i| -(a[i] as f64 - beta * delta[i])).collect(),
        );

        let weights = Tensor::new(&[1.0f32, 0.0, 2.0], &device)?;
        let loss = LossFn::CrossEntropy.per_token(policy.as_tensor(), &[weights])?;
        close(loss.to_vec1()?, vec![0.5, 0.0, 4.0]);
        Ok(())
    }
}
