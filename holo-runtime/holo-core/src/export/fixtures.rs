//! Rollout records for the tests of the exports and of what reads rollouts (`holo view`).

use super::Rollout;
use crate::loom::{ContextRecord, Failure, MessageRecord, PartRecord, RolloutRecord, Stage};
use crate::Role;

/// A message of plain (`sampled` false) and sampled parts.
pub fn message(role: Role, parts: &[(&str, bool)]) -> MessageRecord {
    MessageRecord {
        role,
        parts: parts
            .iter()
            .map(|&(text, sampled)| PartRecord {
                text: text.to_string(),
                sampled,
                weight_version: None,
            })
            .collect(),
        tool: None,
    }
}

/// A completed one-turn rollout of `row` answering `answer` with total reward `reward`.
pub fn record(row: usize, rollout: usize, reward: f64, answer: &str) -> RolloutRecord {
    RolloutRecord {
        dataset: None,
        row_index: row,
        rollout_index: rollout,
        seed: 0,
        row: Default::default(),
        contexts: vec![ContextRecord {
            trained: true,
            messages: vec![
                message(Role::User, &[(&format!("question {row}"), false)]),
                message(Role::Assistant, &[(answer, true)]),
            ],
            tokens: None,
            tools: Vec::new(),
        }],
        rewards: Default::default(),
        weights: Default::default(),
        feedback: Default::default(),
        reward,
        samples: 1,
        truncated: false,
        step: None,
        error: None,
        timing: None,
    }
}

pub fn failed(mut record: RolloutRecord) -> RolloutRecord {
    record.error = Some(Failure {
        stage: Stage::Sampler,
        message: "connection refused".into(),
    });
    record
}

/// Records as read from lines 1, 2, … of a file.
pub fn rollouts(records: Vec<RolloutRecord>) -> Vec<Rollout> {
    records
        .into_iter()
        .enumerate()
        .map(|(index, record)| Rollout {
            line: index + 1,
            record,
        })
        .collect()
}
