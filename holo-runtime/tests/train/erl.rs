//! Experiential RL through the real trainer: `hol/erl.hol` on three rows answered by a tutor sampler
//! whose replies depend only on the prompt, so that which attempt fails, what the reflection sees, which
//! tokens carry which advantage and what is internalized are all known.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::Device;
use holo_runtime::holotypes::{self, ReflectionMemory};
use holo_runtime::interpreter::{Holoware, Row};
use holo_runtime::loom::{Interpreted, RolloutRecord};
use holo_runtime::sampler::{Prompt, Request, SampleFuture, Sampler, SamplerError};
use holo_runtime::train::batch::Sequence;
use holo_runtime::train::{erl, GrpoConfig, Policy, RunOptions, Trainer, TrainingArguments};
use holo_runtime::{Completion, Finish, Resources};
use tokenizers::Tokenizer;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .into()
}

fn model_dir() -> PathBuf {
    repo().join("holo-runtime/tests/fixtures/models/qwen2")
}

/// The question, the first attempt's reply, and the second attempt's.
const SCRIPT: [(&str, &str, &str); 3] = [
    (
        "What is 47+8?",
        "<answer>45</answer>",
        "<answer>55</answer>",
    ),
    (
        "What is 12+30?",
        "<answer>42</answer>",
        "<answer>42</answer>",
    ),
    (
        "What is 19+6?",
        "<answer>15</answer>",
        "<answer>15</answer>",
    ),
];
const EXPECTED: [&str; 3] = ["55", "42", "25"];
const REFLECTION: &str = "Remember the carry.";

/// Answers from [`SCRIPT`] by reading the prompt, in token space with a fixed log-probability.
struct Tutor {
    tokenizer: Tokenizer,
}

impl Tutor {
    fn reply(&self, request: &Request) -> Result<Completion, SamplerError> {
        let Prompt::Tokens(ids) = &request.prompt else {
            return Err(SamplerError::Rejected("the trainer sends tokens".into()));
        };
        let prompt = self.tokenizer.decode(ids, false).unwrap();
        let (_, first, second) = SCRIPT
            .iter()
            .find(|(question, ..)| prompt.contains(question))
            .expect("a scripted question");
        let text = if prompt.contains("Reflection and Improvement Plan") {
            second
        } else if prompt.contains("analyzing a failed attempt") {
            REFLECTION
        } else {
            first
        };
        let tokens = self
            .tokenizer
            .encode(text, false)
            .unwrap()
            .get_ids()
            .to_vec();
        Ok(Completion {
            text: text.to_string(),
            logprobs: vec![-0.5; tokens.len()],
            tokens,
            finish: Finish::EndOfTurn,
            ..Completion::default()
        })
    }
}

impl Sampler for Tutor {
    fn sample<'a>(&'a self, batch: &'a [Request]) -> SampleFuture<'a> {
        Box::pin(async move { batch.iter().map(|request| self.reply(request)).collect() })
    }
}

fn rows() -> Vec<(usize, Row)> {
    SCRIPT
        .iter()
        .zip(EXPECTED)
        .enumerate()
        .map(|(index, ((question, ..), expected))| {
            let row = serde_json::json!({"question": question, "expected": expected});
            (index, row.as_object().unwrap().clone())
        })
        .collect()
}

fn config(steps: i64) -> GrpoConfig {
    GrpoConfig {
        training: TrainingArguments {
            max_steps: steps,
            per_device_train_batch_size: 6,
            learning_rate: 1e-3,
            save_steps: 1,
            ..GrpoConfig::default().training
        },
        num_generations: 2,
        max_completion_length: 16,
        vllm_importance_sampling_correction: false,
        erl: true,
        ..GrpoConfig::default()
    }
}

/// Trains `config` on [`rows`] with the tutor; returns the run folder and the memory.
fn train(name: &str, config: GrpoConfig) -> (PathBuf, Arc<ReflectionMemory>) {
    let out = std::env::temp_dir().join(format!("holo-erl-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let holoware = Arc::new(
        Holoware::open(&repo().join("hol/erl.hol"), Arc::new(holotypes::registry())).unwrap(),
    );
    let mut resources = Resources::default();
    resources.insert(ReflectionMemory::default());
    let memory = resources.get::<ReflectionMemory>().unwrap();
    let source = Interpreted {
        holoware,
        resources,
    };
    let policy = Policy::load(&model_dir(), &Device::Cpu).unwrap();
    let tutor = Tutor {
        tokenizer: Tokenizer::from_file(model_dir().join("tokenizer.json")).unwrap(),
    };
    let options = RunOptions {
        out: out.clone(),
        resume: false,
        progress: false,
    };
    let mut trainer = Trainer::new(source, policy, config, options)
        .unwrap()
        .with_sampler(Box::new(tutor), Some(2048));
    trainer.train(&rows(), &[]).unwrap();
    (out, memory)
}

fn records(out: &Path, step: u64) -> Vec<RolloutRecord> {
    let mut records: Vec<RolloutRecord> = std::fs::read_to_string(out.join("rollouts.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .filter(|record: &RolloutRecord| record.step == Some(step))
        .collect();
    records.sort_by_key(|record| (record.row_index, record.rollout_index));
    records
}

fn metrics(out: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

fn trained_ids(sequence: &Sequence) -> Vec<u32> {
    sequence.trained.iter().map(|&p| sequence.ids[p]).collect()
}

fn context_text(record: &RolloutRecord, context: usize) -> String {
    record.contexts[context]
        .messages
        .iter()
        .flat_map(|message| &message.parts)
        .map(|part| part.text.as_str())
        .collect()
}

#[test]
fn erl_trains_each_phase_on_its_reward_and_internalizes_successful_retries() {
    let config = config(2);
    let (out, memory) = train("joint", config.clone());
    let tokenizer = Tokenizer::from_file(model_dir().join("tokenizer.json")).unwrap();
    let ids = |text: &str| tokenizer.encode(text, false).unwrap().get_ids().to_vec();

    let first = records(&out, 1);
    assert_eq!(first.len(), 6);
    for record in &first {
        let trained = record.contexts.iter().filter(|c| c.trained).count();
        match record.row_index {
            // The first attempt failed and the retry succeeded.
            0 => {
                assert_eq!(trained, 3);
                assert_eq!(record.rewards["first"], 0.0);
                assert_eq!(record.rewards["second"], 1.0);
                assert_eq!(record.feedback["first"], "The answer 45 is incorrect.");
                let reflection = context_text(record, 1);
                assert!(
                    reflection.contains("The answer 45 is incorrect."),
                    "{reflection}"
                );
                assert!(reflection.contains("None available."), "{reflection}");
                let retry = context_text(record, 2);
                assert!(
                    retry.contains(REFLECTION) && !retry.contains("45"),
                    "{retry}"
                );
            }
            // The first attempt passed: no retry, no `second`.
            1 => {
                assert_eq!(trained, 1);
                assert!(!record.rewards.contains_key("second"));
            }
            // Both attempts failed.
            _ => {
                assert_eq!(trained, 3);
                assert_eq!(record.rewards["second"], 0.0);
            }
        }
    }

    let split = erl::split(&first, 2, &config).unwrap();
    // Rows 0 and 2: three completions per rollout; row 1: one.
    assert_eq!(split.completions.len(), 3 + 3 + 1 + 1 + 3 + 3);
    let std = (1.0f64 / 3.0).sqrt(); // of the pool 0, 0, 1, 1
    let expected = [
        // row 0: y1 below the pooled mean, Δ and y2 above
        -0.5 / (std + 1e-4),
        0.5 / (std + 1e-4),
        0.5 / (std + 1e-4),
    ];
    let replies = [
        ids("<answer>45</answer>"),
        ids(REFLECTION),
        ids("<answer>55</answer>"),
    ];
    for rollout in 0..2 {
        for phase in 0..3 {
            let completion = &split.completions[rollout * 3 + phase];
            assert!(
                (completion.advantage as f64 - expected[phase]).abs() < 1e-5,
                "row 0, rollout {rollout}, phase {phase}: {}",
                completion.advantage
            );
            assert_eq!(completion.mask, 1.0);
            assert_eq!(trained_ids(&completion.sequences[0]), replies[phase]);
        }
    }
    // Rows 1 and 2 have no spread in their pools: nothing to learn from them.
    assert!(split.completions[6..].iter().all(|c| c.advantage == 0.0));

    // Exactly the retry's sampled ids, under the first context's prompt.
    assert_eq!(split.internalized.len(), 2);
    for (sequence, record) in split.internalized.iter().zip(&first[..2]) {
        assert_eq!(trained_ids(sequence), ids("<answer>55</answer>"));
        let first_context = record.contexts[0].tokens.as_ref().unwrap();
        let prompt = sequence.trained[0];
        assert_eq!(sequence.ids[..prompt], first_context.ids[..prompt]);
        let start = first_context
            .loss_mask
            .iter()
            .position(|&m| m != 0)
            .unwrap();
        assert_eq!(
            prompt, start,
            "the prompt ends where the first attempt began"
        );
    }

    let logged = metrics(&out);
    assert_eq!(logged[0]["erl/internalized"], 2.0);
    assert_eq!(logged[0]["erl/retry_ratio"], 4.0 / 6.0);
    assert_eq!(logged[0]["erl/improved_ratio"], 0.5);
    assert_eq!(logged[0]["reward"], 1.0 / 3.0, "the first attempts' reward");
    let cross_entropy = logged[0]["erl/internalization_loss"].as_f64().unwrap();
    assert!(cross_entropy.is_finite() && cross_entropy > 0.0);
    assert_eq!(logged[0]["erl/memory_size"], 2.0);

    // The two successful reflections went to the memory after the first generation; the second
    // generation's reflections read them.
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("checkpoint-1/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["memory"].as_array().unwrap().len(), 2);
    assert_eq!(state["memory"][0]["text"], REFLECTION);
    let second = records(&out, 2);
    let reflection = context_text(&second[0], 1);
    assert!(
        reflection.contains(&format!("{REFLECTION}\n\n{REFLECTION}")),
        "{reflection}"
    );
    assert_eq!(memory.len(), 4);
    std::fs::remove_dir_all(out).unwrap();
}

#[test]
fn the_ablation_toggles_and_algorithm_two_change_what_is_trained() {
    let config = GrpoConfig {
        erl_algorithm: 2,
        enable_memory: false,
        enable_internalization: false,
        ..config(1)
    };
    let (out, memory) = train("separate", config.clone());
    let logged = metrics(&out);
    assert_eq!(logged[0]["erl/memory_size"], 0.0);
    assert!(memory.is_empty());
    assert_eq!(logged[0]["erl/internalized"], 0.0);
    assert!(logged[0].get("erl/internalization_loss").is_none());
    // The second loss ran, with metrics of its own.
    assert!(logged[0]["erl/entropy"].is_number(), "{}", logged[0]);

    let split = erl::split(&records(&out, 1), 2, &config).unwrap();
    assert!(split.internalized.is_empty());
    // Each row's two first attempts agree, so none has an advantage.
    for completion in split.completions.iter().filter(|c| !c.second_loss) {
        assert_eq!(completion.advantage, 0.0);
    }
    // Second attempts over the batch: row 0's two successes against row 2's two failures.
    let second: Vec<f32> = split
        .completions
        .iter()
        .filter(|c| c.second_loss)
        .map(|c| c.advantage)
        .collect();
    assert_eq!(second.len(), 8);
    assert!(second[..4].iter().all(|&a| a > 0.8), "{second:?}");
    assert!(second[4..].iter().all(|&a| a < -0.8), "{second:?}");
    std::fs::remove_dir_all(out).unwrap();
}

#[test]
fn a_holoware_without_the_first_reward_is_refused_naming_what_it_has() {
    let records = vec![serde_json::from_value::<RolloutRecord>(serde_json::json!({
        "row_index": 0, "rollout_index": 0, "seed": 0, "row": {},
        "contexts": [], "rewards": {"math_answer": 1.0}, "weights": {"math_answer": 1.0},
        "reward": 1.0, "samples": 1, "error": null
    }))
    .unwrap()];
    let error = erl::split(&records, 1, &config(1)).unwrap_err();
    assert!(
        error.contains("erl_first_reward") && error.contains("math_answer"),
        "{error}"
    );
}
