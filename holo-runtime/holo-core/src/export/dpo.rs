//! Preference pairs in TRL's conversational preference format: `{"prompt": [...], "chosen": [...],
//! "rejected": [...]}`, both replies from the same row's group (one data row at one training step), the
//! chosen one with the higher total reward.

use std::fmt;

use serde::Serialize;

use super::filter::{completed, groups};
use super::{conversations, missing_tokens, ChatMessage, Conversation, Rollout};

#[derive(Debug, Clone, PartialEq)]
pub struct DpoOptions {
    /// The least reward margin of a pair; `None`: any margin above 0.
    pub min_margin: Option<f64>,
    /// The most pairs of one group.
    pub pairs_per_row: usize,
    /// Add the token ids and loss masks.
    pub tokens: bool,
}

/// One line of the DPO file.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DpoExample {
    pub prompt: Vec<ChatMessage>,
    pub chosen: Vec<ChatMessage>,
    pub rejected: Vec<ChatMessage>,
    /// The tools offered (TRL's `tools` column, which `DPOTrainer` hands to the chat template).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<serde_json::Value>,
    #[serde(flatten)]
    pub tokens: Option<DpoTokens>,
}

/// The pair in token space. `prompt_ids`, `chosen_ids` and `rejected_ids` are the names TRL's
/// `DataCollatorForPreference` reads; the loss masks mark, within `chosen_ids` / `rejected_ids`, the
/// tokens the model sampled (1) apart from tool results and other text the environment wrote (0).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DpoTokens {
    pub prompt_ids: Vec<u32>,
    pub chosen_ids: Vec<u32>,
    pub rejected_ids: Vec<u32>,
    pub chosen_loss_mask: Vec<u8>,
    pub rejected_loss_mask: Vec<u8>,
}

/// How many rollouts and candidate pairs each step dropped, and the pairs written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DpoReport {
    pub rollouts: usize,
    pub failed: usize,
    /// Completed rollouts without exactly one trained context in which the model wrote something: a pair
    /// compares two replies to one prompt.
    pub not_one_context: usize,
    /// Rollouts with no other rollout of their group at the margin.
    pub no_pair_with_margin: usize,
    /// Pairs at the margin whose two prompts differ.
    pub prompt_mismatch: usize,
    /// Pairs at the margin beyond `pairs_per_row`.
    pub beyond_pairs_per_row: usize,
    pub pairs: usize,
}

impl fmt::Display for DpoReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} rollouts: {} failed, {} without exactly one trained context with a sample, {} with no \
             pair at --min-margin; pairs skipped: {} with different prompts, {} beyond --pairs-per-row; \
             {} pairs",
            self.rollouts,
            self.failed,
            self.not_one_context,
            self.no_pair_with_margin,
            self.prompt_mismatch,
            self.beyond_pairs_per_row,
            self.pairs
        )
    }
}

/// A completed rollout with its one trained conversation.
struct Candidate {
    rollout: Rollout,
    conversation: Conversation,
}

/// A `--min-margin` that can pair anything: above 0 (a pair needs a better reply), not NaN.
pub fn check_min_margin(min_margin: Option<f64>) -> Result<(), String> {
    match min_margin {
        Some(margin) if margin.is_nan() || margin <= 0.0 => Err(format!(
            "--min-margin must be above 0 (a pair needs a better reply), got {margin}"
        )),
        _ => Ok(()),
    }
}

/// The DPO pairs of `rollouts` (as read, in file order), group by group. Within a group the pairs at the
/// margin go largest margin first (best against worst), ties in rollout order; a pair whose prompts differ
/// is skipped, and at most `pairs_per_row` are written. An error for a margin that is not above 0, and when
/// `tokens` is asked for and a paired rollout has no token records.
pub fn export(
    rollouts: Vec<Rollout>,
    options: &DpoOptions,
) -> Result<(Vec<DpoExample>, DpoReport), String> {
    check_min_margin(options.min_margin)?;
    let min_margin = options.min_margin;
    let mut report = DpoReport {
        rollouts: rollouts.len(),
        ..DpoReport::default()
    };
    let (rollouts, failed) = completed(rollouts);
    report.failed = failed;
    let mut examples = Vec::new();
    for group in groups(rollouts) {
        let mut candidates = Vec::new();
        for rollout in group {
            let mut found = conversations(&rollout.record);
            if found.len() == 1 {
                let conversation = found.remove(0);
                candidates.push(Candidate {
                    rollout,
                    conversation,
                });
            } else {
                report.not_one_context += 1;
            }
        }
        let pairs = pairs_at_margin(&candidates, min_margin);
        let mut paired = vec![false; candidates.len()];
        for &(a, b) in &pairs {
            paired[a] = true;
            paired[b] = true;
        }
        report.no_pair_with_margin += paired.iter().filter(|&&paired| !paired).count();
        let mut written = 0;
        for (chosen, rejected) in pairs {
            let (chosen, rejected) = (&candidates[chosen], &candidates[rejected]);
            if !same_prompt(&chosen.conversation, &rejected.conversation) {
                report.prompt_mismatch += 1;
            } else if written == options.pairs_per_row {
                report.beyond_pairs_per_row += 1;
            } else {
                examples.push(example(chosen, rejected, options.tokens)?);
                written += 1;
            }
        }
    }
    report.pairs = examples.len();
    Ok((examples, report))
}

/// The pairs `(chosen, rejected)` of a group sorted best first whose reward margin is above 0 and at least
/// `min_margin`, largest margin first; equal margins keep the order of the indices.
fn pairs_at_margin(candidates: &[Candidate], min_margin: Option<f64>) -> Vec<(usize, usize)> {
    let reward = |index: usize| candidates[index].rollout.record.reward;
    let mut pairs: Vec<(usize, usize, f64)> = Vec::new();
    for chosen in 0..candidates.len() {
        for rejected in chosen + 1..candidates.len() {
            let margin = reward(chosen) - reward(rejected);
            if margin > 0.0 && min_margin.is_none_or(|least| margin >= least) {
                pairs.push((chosen, rejected, margin));
            }
        }
    }
    // Stable: equal margins stay in index order.
    pairs.sort_by(|a, b| b.2.total_cmp(&a.2));
    pairs.into_iter().map(|(a, b, _)| (a, b)).collect()
}

/// Both replies answer the same prompt: the same messages and, when recorded, the same prompt tokens.
fn same_prompt(a: &Conversation, b: &Conversation) -> bool {
    let tokens_agree = match (&a.tokens, &b.tokens) {
        (Some(a), Some(b)) => a.prompt_ids() == b.prompt_ids(),
        _ => true,
    };
    a.prompt == b.prompt && a.tools == b.tools && tokens_agree
}

fn example(chosen: &Candidate, rejected: &Candidate, tokens: bool) -> Result<DpoExample, String> {
    let tokens = if tokens {
        let chosen_tokens = chosen
            .conversation
            .tokens
            .as_ref()
            .ok_or_else(|| missing_tokens(&chosen.rollout))?;
        let rejected_tokens = rejected
            .conversation
            .tokens
            .as_ref()
            .ok_or_else(|| missing_tokens(&rejected.rollout))?;
        Some(DpoTokens {
            prompt_ids: chosen_tokens.prompt_ids().to_vec(),
            chosen_ids: chosen_tokens.completion_ids().to_vec(),
            rejected_ids: rejected_tokens.completion_ids().to_vec(),
            chosen_loss_mask: chosen_tokens.completion_loss_mask().to_vec(),
            rejected_loss_mask: rejected_tokens.completion_loss_mask().to_vec(),
        })
    } else {
        None
    };
    Ok(DpoExample {
        prompt: chosen.conversation.prompt.clone(),
        chosen: chosen.conversation.completion.clone(),
        rejected: rejected.conversation.completion.clone(),
        tools: chosen.conversation.tools.clone(),
        tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::fixtures::{failed, record, rollouts};
    use crate::loom::TokensRecord;
    use serde_json::json;

    fn options() -> DpoOptions {
        DpoOptions {
            min_margin: None,
            pairs_per_row: 1,
            tokens: false,
        }
    }

    fn replies(examples: &[DpoExample]) -> Vec<(String, String)> {
        examples
            .iter()
            .map(|e| (e.chosen[0].content.clone(), e.rejected[0].content.clone()))
            .collect()
    }

    #[test]
    fn a_pair_is_trls_conversational_preference_format() {
        let (examples, report) = export(
            rollouts(vec![record(0, 0, 0.0, "bad"), record(0, 1, 1.0, "good")]),
            &options(),
        )
        .unwrap();
        assert_eq!(report.pairs, 1);
        assert_eq!(
            serde_json::to_value(&examples[0]).unwrap(),
            json!({
                "prompt": [{"role": "user", "content": "question 0"}],
                "chosen": [{"role": "assistant", "content": "good"}],
                "rejected": [{"role": "assistant", "content": "bad"}],
            })
        );
    }

    #[test]
    fn best_against_worst_first_then_by_margin() {
        let group = || {
            rollouts(vec![
                record(0, 0, 0.0, "worst"),
                record(0, 1, 3.0, "best"),
                record(0, 2, 1.0, "middle"),
            ])
        };
        let (examples, report) = export(group(), &options()).unwrap();
        assert_eq!(replies(&examples), [("best".into(), "worst".into())]);
        assert_eq!(report.beyond_pairs_per_row, 2);
        let all = DpoOptions {
            pairs_per_row: 10,
            ..options()
        };
        let (examples, _) = export(group(), &all).unwrap();
        assert_eq!(
            replies(&examples),
            [
                ("best".into(), "worst".into()),
                ("best".into(), "middle".into()),
                ("middle".into(), "worst".into()),
            ]
        );
    }

    #[test]
    fn margin_and_groups_limit_pairs() {
        let mut other_step = record(0, 2, 5.0, "other step");
        other_step.step = Some(1);
        let options = DpoOptions {
            min_margin: Some(0.5),
            pairs_per_row: 10,
            ..options()
        };
        let (examples, report) = export(
            rollouts(vec![
                record(0, 0, 1.0, "a"),
                record(0, 1, 1.2, "b"),
                other_step,
                record(1, 0, 1.0, "tie"),
                record(1, 1, 1.0, "tie"),
                failed(record(1, 2, 0.0, "failed")),
            ]),
            &options,
        )
        .unwrap();
        assert!(examples.is_empty());
        assert_eq!(
            report,
            DpoReport {
                rollouts: 6,
                failed: 1,
                no_pair_with_margin: 5,
                ..DpoReport::default()
            }
        );
    }

    #[test]
    fn pairs_with_different_prompts_are_skipped_and_counted() {
        let mut odd = record(0, 1, 0.0, "bad");
        odd.contexts[0].messages[0].parts[0].text = "another question".into();
        let (examples, report) = export(
            rollouts(vec![
                record(0, 0, 1.0, "good"),
                odd,
                record(0, 2, 0.5, "ok"),
            ]),
            &options(),
        )
        .unwrap();
        assert_eq!(replies(&examples), [("good".into(), "ok".into())]);
        assert_eq!(report.prompt_mismatch, 2);
        assert_eq!(report.beyond_pairs_per_row, 0);
    }

    #[test]
    fn rollouts_with_several_trained_contexts_are_not_paired() {
        let mut two = record(0, 1, 0.0, "bad");
        two.contexts.push(two.contexts[0].clone());
        let (examples, report) =
            export(rollouts(vec![record(0, 0, 1.0, "good"), two]), &options()).unwrap();
        assert!(examples.is_empty());
        assert_eq!(report.not_one_context, 1);
        assert_eq!(report.no_pair_with_margin, 1);
    }

    #[test]
    fn tokens_split_at_the_first_trained_token() {
        let with_tokens = |rollout: usize, reward: f64, ids: Vec<u32>, mask: Vec<u8>| {
            let mut r = record(0, rollout, reward, "x");
            r.contexts[0].tokens = Some(TokensRecord {
                logprobs: vec![0.0; ids.len()],
                ids,
                loss_mask: mask,
                retokenized: false,
                routes: None,
                constraints: Vec::new(),
            });
            r
        };
        let options = DpoOptions {
            tokens: true,
            ..options()
        };
        let (examples, _) = export(
            rollouts(vec![
                with_tokens(0, 1.0, vec![1, 2, 3, 4, 5], vec![0, 0, 1, 0, 1]),
                with_tokens(1, 0.0, vec![1, 2, 9], vec![0, 0, 1]),
            ]),
            &options,
        )
        .unwrap();
        let value = serde_json::to_value(&examples[0]).unwrap();
        assert_eq!(value["prompt_ids"], json!([1, 2]));
        assert_eq!(value["chosen_ids"], json!([3, 4, 5]));
        assert_eq!(value["chosen_loss_mask"], json!([1, 0, 1]));
        assert_eq!(value["rejected_ids"], json!([9]));
        assert_eq!(value["rejected_loss_mask"], json!([1]));
    }

    #[test]
    fn a_margin_not_above_zero_is_refused() {
        for margin in [0.0, -1.0, f64::NAN] {
            let options = DpoOptions {
                min_margin: Some(margin),
                ..options()
            };
            let error = export(Vec::new(), &options).unwrap_err();
            assert!(error.contains("--min-margin"), "{error}");
        }
    }
}
