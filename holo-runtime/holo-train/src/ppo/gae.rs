//! PPO's advantages, as TRL's `PPOTrainer.train` computes them (its steps 4–6), on each rollout's
//! trained tokens in order: the tokens of every trained context of the rollout, one after another.
//! Prompts and tool output between turns are not steps: GAE runs over the sampled tokens only.
//!
//! - [`token_rewards`]: `−kl_coef · KL` to the reference on every token, plus the rollout's reward on
//!   its last trained token.
//! - [`whiten`]: TRL's `masked_whiten` over every token of the batch (the unbiased variance).
//! - [`gae`]: generalized advantage estimation, `V = 0` after the last token; returns are advantages
//!   plus values.
//!
//! One difference from TRL, on purpose: TRL puts the reward of a rollout that ended with its stop token
//! one position *after* that token (on padding, whose value it also trains), so that the stop token's
//! advantage carries `λ ·` the reward; here the reward is on the last sampled token, the episode's last
//! action, and the state after it is terminal. The two agree for rollouts that fill their length.

use super::KlEstimator;

/// The per-token KL estimate between the sampling policy (`logprobs`) and the reference (TRL's `k1`:
/// `log π − log π_ref`; `k3`: `(r − 1) − log r` with `r = π_ref / π`).
pub fn kl(logprobs: &[f32], reference: &[f32], estimator: KlEstimator) -> Vec<f32> {
    logprobs
        .iter()
        .zip(reference)
        .map(|(&logprob, &reference)| {
            let log_ratio = reference - logprob;
            match estimator {
                KlEstimator::K1 => -log_ratio,
                KlEstimator::K3 => log_ratio.exp() - 1.0 - log_ratio,
            }
        })
        .collect()
}

/// A rollout's per-token rewards: `−kl_coef · kl` on each token (no penalty without a reference), and
/// `score` added on the last. Returns the rewards and the non-score part.
pub fn token_rewards(
    score: f32,
    kl: Option<&[f32]>,
    kl_coef: f32,
    len: usize,
) -> (Vec<f32>, Vec<f32>) {
    let non_score: Vec<f32> = match kl {
        Some(kl) => kl.iter().map(|&kl| -kl_coef * kl).collect(),
        None => vec![0.0; len],
    };
    let mut rewards = non_score.clone();
    if let Some(last) = rewards.last_mut() {
        *last += score;
    }
    (rewards, non_score)
}

/// The mean and the unbiased variance of the tokens of the rows marked `valid` (0 variance for fewer
/// than 2 tokens, where TRL divides by zero).
pub fn mean_var(rows: &[Vec<f32>], valid: &[bool]) -> (f64, f64) {
    let tokens = || {
        rows.iter()
            .zip(valid)
            .filter(|(_, &valid)| valid)
            .flat_map(|(row, _)| row.iter().map(|&x| x as f64))
    };
    let count = tokens().count();
    if count == 0 {
        return (0.0, 0.0);
    }
    let mean = tokens().sum::<f64>() / count as f64;
    if count < 2 {
        return (mean, 0.0);
    }
    let squares = tokens().map(|x| (x - mean).powi(2)).sum::<f64>();
    (mean, squares / (count - 1) as f64)
}

/// TRL's `masked_whiten` over the tokens of the `valid` rows: `(x − mean) / sqrt(var + 1e-8)`, the mean
/// added back unless `shift_mean`. The other rows become zeros (TRL fills padding with 0 after
/// whitening).
pub fn whiten(rows: &mut [Vec<f32>], valid: &[bool], shift_mean: bool) {
    let (mean, var) = mean_var(rows, valid);
    let scale = 1.0 / (var + 1e-8).sqrt();
    for (row, &valid) in rows.iter_mut().zip(valid) {
        for x in row.iter_mut() {
            *x = if !valid {
                0.0
            } else if shift_mean {
                ((*x as f64 - mean) * scale) as f32
            } else {
                ((*x as f64 - mean) * scale + mean) as f32
            };
        }
    }
}

/// Generalized advantage estimation over one rollout's tokens: `δ_t = r_t + γ V_{t+1} − V_t` (with
/// `V = 0` after the last token), `A_t = δ_t + γ λ A_{t+1}`. Returns the advantages and the returns
/// `A + V`.
pub fn gae(rewards: &[f32], values: &[f32], gamma: f64, lam: f64) -> (Vec<f32>, Vec<f32>) {
    let len = rewards.len();
    let mut advantages = vec![0.0f32; len];
    let mut last = 0.0f64;
    for t in (0..len).rev() {
        let next = if t + 1 < len {
            values[t + 1] as f64
        } else {
            0.0
        };
        let delta = rewards[t] as f64 + gamma * next - values[t] as f64;
        last = delta + gamma * lam * last;
        advantages[t] = last as f32;
    }
    let returns = advantages
        .iter()
        .zip(values)
        .map(|(advantage, value)| advantage + value)
        .collect();
    (advantages, returns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gae_with_lambda_one_and_no_discount_is_the_reward_to_go_minus_the_value() {
        let rewards = [0.1, -0.2, 1.0];
        let values = [0.5, 0.25, 0.75];
        let (advantages, returns) = gae(&rewards, &values, 1.0, 1.0);
        let to_go = [0.9f32, 0.8, 1.0];
        for t in 0..3 {
            assert!((advantages[t] - (to_go[t] - values[t])).abs() < 1e-6);
            assert!((returns[t] - to_go[t]).abs() < 1e-6);
        }
    }

    #[test]
    fn gae_with_lambda_zero_is_the_one_step_td_error() {
        let rewards = [0.0, 2.0];
        let values = [1.0, 0.5];
        let (advantages, _) = gae(&rewards, &values, 0.9, 0.0);
        assert!((advantages[0] - (0.9 * 0.5 - 1.0)).abs() < 1e-6);
        assert!((advantages[1] - (2.0 - 0.5)).abs() < 1e-6);
    }

    #[test]
    fn the_reward_lands_on_the_last_token_and_the_penalty_on_every_one() {
        let (rewards, non_score) = token_rewards(1.0, Some(&[0.5, -0.5, 0.25]), 0.1, 3);
        assert_eq!(non_score, vec![-0.05, 0.05, -0.025]);
        assert_eq!(rewards, vec![-0.05, 0.05, 0.975]);
        assert_eq!(token_rewards(2.0, None, 0.1, 2).0, vec![0.0, 2.0]);
    }

    #[test]
    fn whitening_skips_masked_rows_and_uses_the_unbiased_variance() {
        let mut rows = vec![vec![1.0, 2.0], vec![9.0], vec![3.0]];
        whiten(&mut rows, &[true, false, true], true);
        // Tokens 1, 2, 3: mean 2, unbiased variance 1.
        assert!((rows[0][0] + 1.0).abs() < 1e-6 && rows[0][1].abs() < 1e-6);
        assert_eq!(rows[1], vec![0.0]);
        assert!((rows[2][0] - 1.0).abs() < 1e-6);
        let mut kept = vec![vec![1.0, 3.0]];
        whiten(&mut kept, &[true], false);
        // (x − 2) / √2 + 2
        assert!((kept[0][0] - (2.0 - 1.0 / 2f32.sqrt())).abs() < 1e-5);
    }

    #[test]
    fn k1_and_k3_estimate_the_kl_from_the_same_log_ratio() {
        let k1 = kl(&[-1.0], &[-1.5], KlEstimator::K1);
        let k3 = kl(&[-1.0], &[-1.5], KlEstimator::K3);
        assert!((k1[0] - 0.5).abs() < 1e-6);
        assert!((k3[0] - ((-0.5f32).exp() - 1.0 + 0.5)).abs() < 1e-6);
    }
}
