//! A scripted sampler for the trainer's tests on `hol/arithmetic.hol`: it finds the row's question in
//! the prompt and answers `<answer>N</answer>`, right or wrong as the test's policy says; the rewards
//! are then 1.2 (right) or 0.2 (wrong, but in the tags).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use holo_core::interpreter::{Holoware, Row};
use holo_core::loom::Interpreted;
use holo_core::sampler::{Prompt, Request, SampleFuture, Sampler, SamplerError};
use holo_core::{holotypes, Completion, Finish, Resources};
use tokenizers::Tokenizer;

use super::repo;

/// The reward of a right answer and of a wrong one.
pub const RIGHT: f64 = 1.2;
pub const WRONG: f64 = 0.2;

/// Whether the student answers the `count`-th request (0-based, over the run) for `question` right.
pub type Policy = dyn Fn(&str, usize) -> bool + Send + Sync;

pub struct Student {
    tokenizer: Tokenizer,
    /// `(question, expected)` of every row it may be asked.
    questions: Vec<(String, String)>,
    policy: Box<Policy>,
    asked: Mutex<HashMap<String, usize>>,
}

impl Student {
    pub fn new(
        rows: &[&[(usize, Row)]],
        policy: impl Fn(&str, usize) -> bool + Send + Sync + 'static,
    ) -> Self {
        let questions = rows
            .iter()
            .flat_map(|rows| rows.iter())
            .map(|(_, row)| {
                (
                    row["question"].as_str().unwrap().to_string(),
                    row["expected"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        Student {
            tokenizer: Tokenizer::from_file(model_dir().join("tokenizer.json")).unwrap(),
            questions,
            policy: Box::new(policy),
            asked: Mutex::new(HashMap::new()),
        }
    }

    fn reply(&self, request: &Request) -> Result<Completion, SamplerError> {
        let Prompt::Tokens(ids) = &request.prompt else {
            return Err(SamplerError::Rejected("the trainer sends tokens".into()));
        };
        let prompt = self.tokenizer.decode(ids, false).unwrap();
        // The longest question the prompt holds (`What is 1+1?` is in `What is 11+1?`).
        let (question, expected) = self
            .questions
            .iter()
            .filter(|(question, _)| prompt.contains(question.as_str()))
            .max_by_key(|(question, _)| question.len())
            .expect("a question of the rows");
        let count = {
            let mut asked = self.asked.lock().unwrap();
            let count = asked.entry(question.clone()).or_default();
            *count += 1;
            *count - 1
        };
        let answer = if (self.policy)(question, count) {
            expected.clone()
        } else {
            format!("{expected}0")
        };
        let text = format!("<answer>{answer}</answer>");
        let tokens = self
            .tokenizer
            .encode(text.as_str(), false)
            .unwrap()
            .get_ids()
            .to_vec();
        Ok(Completion {
            text,
            logprobs: vec![-0.5; tokens.len()],
            tokens,
            finish: Finish::EndOfTurn,
            ..Completion::default()
        })
    }
}

impl Sampler for Student {
    fn sample<'a>(&'a self, batch: &'a [Request]) -> SampleFuture<'a> {
        Box::pin(async move { batch.iter().map(|request| self.reply(request)).collect() })
    }
}

pub fn model_dir() -> PathBuf {
    repo().join("holo-runtime/tests/fixtures/models/qwen2")
}

/// `hol/arithmetic.hol` as a rollout source.
pub fn arithmetic() -> Interpreted {
    let holoware = Arc::new(
        Holoware::open(
            &repo().join("hol/arithmetic.hol"),
            Arc::new(holotypes::registry()),
        )
        .unwrap(),
    );
    Interpreted {
        holoware,
        resources: Resources::default(),
    }
}

/// Rows `What is A+B?` for each `(a, b)`, with `extra` columns, numbered from `first`.
pub fn rows(first: usize, sums: &[(u32, u32)], extra: serde_json::Value) -> Vec<(usize, Row)> {
    sums.iter()
        .enumerate()
        .map(|(index, (a, b))| {
            let mut row = serde_json::json!({
                "question": format!("What is {a}+{b}?"),
                "expected": (a + b).to_string(),
            });
            for (key, value) in extra.as_object().unwrap() {
                row[key] = value.clone();
            }
            (first + index, row.as_object().unwrap().clone())
        })
        .collect()
}

/// The records of `rollouts.jsonl` in a run folder.
pub fn records(out: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("rollouts.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}
