//! Supervised fine-tuning examples in TRL's conversational formats: `{"messages": [...]}`, or
//! `{"prompt": [...], "completion": [...]}`. Each trained context of a kept rollout is one example, with
//! every turn of a multi-turn rollout (TRL's `assistant_only_loss` learns only the assistant turns).

use std::fmt;

use serde::Serialize;

use super::filter::{at_least, completed, groups, top_k};
use super::{conversations, missing_tokens, ChatMessage, Conversation, Rollout};

#[derive(Debug, Clone, Default, PartialEq)]
pub struct SftOptions {
    /// Keep the rollouts whose total reward is at least this.
    pub min_reward: Option<f64>,
    /// Keep at most this many rollouts of each row's group, the best.
    pub top_k: Option<usize>,
    /// `prompt` / `completion` instead of `messages`.
    pub prompt_completion: bool,
    /// Add the token ids and the loss mask.
    pub tokens: bool,
}

/// One line of the SFT file.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum SftExample {
    Messages {
        messages: Vec<ChatMessage>,
        /// The tools offered (TRL's `tools` column, which `SFTTrainer` hands to the chat template).
        #[serde(skip_serializing_if = "Vec::is_empty")]
        tools: Vec<serde_json::Value>,
        #[serde(flatten)]
        tokens: Option<SftTokens>,
    },
    PromptCompletion {
        prompt: Vec<ChatMessage>,
        completion: Vec<ChatMessage>,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        tools: Vec<serde_json::Value>,
        #[serde(flatten)]
        tokens: Option<SftTokens>,
    },
}

/// A pre-tokenized example as TRL's `SFTTrainer` takes it: with an `input_ids` column it uses the ids as
/// they are, and learns where `assistant_masks` is 1 (a mask it applies whatever `completion_only_loss`
/// says, unlike `completion_mask`): exactly the tokens the model sampled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SftTokens {
    pub input_ids: Vec<u32>,
    pub assistant_masks: Vec<u8>,
}

/// How many rollouts each step dropped, and the examples written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SftReport {
    pub rollouts: usize,
    pub failed: usize,
    pub below_min_reward: usize,
    pub beyond_top_k: usize,
    /// Kept rollouts without a trained context in which the model wrote something.
    pub nothing_sampled: usize,
    pub examples: usize,
}

impl fmt::Display for SftReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} rollouts: {} failed, {} below --min-reward, {} beyond --top-k, {} with nothing sampled \
             in a trained context; {} examples",
            self.rollouts,
            self.failed,
            self.below_min_reward,
            self.beyond_top_k,
            self.nothing_sampled,
            self.examples
        )
    }
}

/// The SFT examples of `rollouts` (as read, in file order): completed rollouts with a total reward of at
/// least `min_reward`, the `top_k` best of each row's group, each trained context one example, in group
/// order, best first. An error when `tokens` is asked for and a kept rollout has no token records.
pub fn export(
    rollouts: Vec<Rollout>,
    options: &SftOptions,
) -> Result<(Vec<SftExample>, SftReport), String> {
    let mut report = SftReport {
        rollouts: rollouts.len(),
        ..SftReport::default()
    };
    let (rollouts, failed) = completed(rollouts);
    report.failed = failed;
    let rollouts = match options.min_reward {
        Some(min_reward) => {
            let (kept, dropped) = at_least(rollouts, min_reward);
            report.below_min_reward = dropped;
            kept
        }
        None => rollouts,
    };
    let grouped = groups(rollouts);
    let (rollouts, beyond) = top_k(grouped, options.top_k.unwrap_or(usize::MAX));
    report.beyond_top_k = beyond;
    let mut examples = Vec::new();
    for rollout in &rollouts {
        let found = conversations(&rollout.record);
        if found.is_empty() {
            report.nothing_sampled += 1;
        }
        for conversation in found {
            examples.push(example(conversation, options, rollout)?);
        }
    }
    report.examples = examples.len();
    Ok((examples, report))
}

/// One context as an example of the shape `options` asks for.
pub fn example(
    conversation: Conversation,
    options: &SftOptions,
    rollout: &Rollout,
) -> Result<SftExample, String> {
    let tokens = if options.tokens {
        let tokens = conversation.tokens.ok_or_else(|| missing_tokens(rollout))?;
        Some(SftTokens {
            input_ids: tokens.ids,
            assistant_masks: tokens.loss_mask,
        })
    } else {
        None
    };
    Ok(if options.prompt_completion {
        SftExample::PromptCompletion {
            prompt: conversation.prompt,
            completion: conversation.completion,
            tools: conversation.tools,
            tokens,
        }
    } else {
        let mut messages = conversation.prompt;
        messages.extend(conversation.completion);
        SftExample::Messages {
            messages,
            tools: conversation.tools,
            tokens,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::fixtures::{failed, record, rollouts};
    use crate::loom::TokensRecord;
    use serde_json::json;

    fn options() -> SftOptions {
        SftOptions::default()
    }

    #[test]
    fn messages_shape_is_trls_conversational_format() {
        let (examples, report) =
            export(rollouts(vec![record(0, 0, 1.0, "42")]), &options()).unwrap();
        assert_eq!(report.examples, 1);
        assert_eq!(
            serde_json::to_value(&examples[0]).unwrap(),
            json!({"messages": [
                {"role": "user", "content": "question 0"},
                {"role": "assistant", "content": "42"},
            ]})
        );
    }

    #[test]
    fn prompt_completion_shape_splits_at_the_first_sampled_turn() {
        let options = SftOptions {
            prompt_completion: true,
            ..options()
        };
        let (examples, _) = export(rollouts(vec![record(0, 0, 1.0, "42")]), &options).unwrap();
        assert_eq!(
            serde_json::to_value(&examples[0]).unwrap(),
            json!({
                "prompt": [{"role": "user", "content": "question 0"}],
                "completion": [{"role": "assistant", "content": "42"}],
            })
        );
    }

    #[test]
    fn tokens_add_input_ids_and_assistant_masks() {
        let mut with_tokens = record(0, 0, 1.0, "42");
        with_tokens.contexts[0].tokens = Some(TokensRecord {
            ids: vec![5, 6, 7],
            loss_mask: vec![0, 1, 1],
            logprobs: vec![0.0; 3],
            retokenized: false,
            routes: None,
            constraints: Vec::new(),
        });
        let options = SftOptions {
            tokens: true,
            ..options()
        };
        let (examples, _) = export(rollouts(vec![with_tokens]), &options).unwrap();
        let value = serde_json::to_value(&examples[0]).unwrap();
        assert_eq!(value["input_ids"], json!([5, 6, 7]));
        assert_eq!(value["assistant_masks"], json!([0, 1, 1]));
        assert_eq!(value["messages"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn tokens_without_token_records_is_an_error_naming_the_line() {
        let options = SftOptions {
            tokens: true,
            ..options()
        };
        let error = export(rollouts(vec![record(4, 2, 1.0, "42")]), &options).unwrap_err();
        assert!(error.starts_with("line 1 (row 4, rollout 2)"), "{error}");
    }

    #[test]
    fn filters_drop_failed_low_and_beyond_top_k_and_count_them() {
        let options = SftOptions {
            min_reward: Some(0.5),
            top_k: Some(1),
            ..options()
        };
        let mut unsampled = record(2, 0, 1.0, "x");
        unsampled.contexts[0].messages.truncate(1);
        let (examples, report) = export(
            rollouts(vec![
                failed(record(0, 0, 5.0, "failed")),
                record(0, 1, 0.2, "low"),
                record(0, 2, 1.0, "tie, first"),
                record(0, 3, 1.0, "tie, second"),
                record(1, 0, 0.7, "other row"),
                unsampled,
            ]),
            &options,
        )
        .unwrap();
        let answers: Vec<String> = examples
            .iter()
            .map(|example| match example {
                SftExample::Messages { messages, .. } => messages[1].content.clone(),
                SftExample::PromptCompletion { .. } => unreachable!(),
            })
            .collect();
        assert_eq!(answers, ["tie, first", "other row"]);
        assert_eq!(
            report,
            SftReport {
                rollouts: 6,
                failed: 1,
                below_min_reward: 1,
                beyond_top_k: 1,
                nothing_sampled: 1,
                examples: 2,
            }
        );
    }

    #[test]
    fn each_trained_context_is_its_own_example() {
        let mut two = record(0, 0, 1.0, "first");
        let mut second = two.contexts[0].clone();
        second.messages[1].parts[0].text = "second".into();
        two.contexts.push(second);
        let (examples, report) = export(rollouts(vec![two]), &options()).unwrap();
        assert_eq!(report.examples, 2);
        assert_eq!(examples.len(), 2);
    }
}
