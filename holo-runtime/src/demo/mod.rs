//! `holo demo`: a model that visibly learns, offline, on a CPU, in a few minutes.
//!
//! 1. **A model**: a random Llama folder ([`init_model`], the offline 512-token tokenizer and ChatML)
//!    in `RUN_DIR/warmup/`.
//! 2. **Problems** ([`data`]): additions of a two-digit and a one-digit number; [`HELD_OUT`] pairs of
//!    operands are held out (in both orders) for evaluation, the others make the training pool; both are
//!    written as rows of `hol/arithmetic.hol` (`RUN_DIR/problems/train.jsonl` and `heldout.jsonl`, for
//!    `holo eval`).
//! 3. **A supervised warm-up** ([`warmup`]): SFT steps (minus the mean log-probability) of a
//!    teacher's reply (`<answer>68</answer>` and the end of turn), on token sequences recorded through
//!    `hol/arithmetic.hol` exactly as its rollouts are. The teacher ([`data::Teacher`]) is sloppy: it
//!    forgets the carry of half the sums that carry (`47+8` → `45`), so imitating it caps the model's
//!    accuracy, as imitating imperfect demonstrations does. The weights go to `RUN_DIR/warmup/`, a
//!    model folder.
//! 4. **GRPO** ([`Trainer`]) from the warmed-up weights on `hol/arithmetic.hol` (a numeric-answer and a
//!    format reward: the reward knows the right sum) over the training pool, evaluating on the held-out
//!    problems at the start and every few steps: `metrics.jsonl`, TensorBoard events, rollouts, the
//!    last checkpoint and PNG plots in `RUN_DIR`. Rewarded for right answers, the model learns to carry
//!    where its teacher did not.
//! 5. **A table** ([`Report`]): per evaluation, the held-out accuracy (the fraction of held-out
//!    rollouts whose answer is right, `eval/rewards/math_answer/mean`), the held-out pass@G (the
//!    fraction of held-out problems with a right answer among their G rollouts), the held-out mean
//!    reward and the KL to the warmed-up weights.
//!
//! Every random choice derives from the seed: a seed always writes the same metrics (less `step_time`).

pub mod data;
pub mod warmup;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use candle_core::Device;
use rand::seq::IndexedRandom;

use crate::holophore::Holophore;
use crate::holotypes;
use crate::interpreter::{Holoware, Row};
use crate::local::init::{init_model, InitOptions, Preset};
use crate::local::Arch;
use crate::loom::{Interpreted, RolloutRecord};
use crate::train::report::plot;
use crate::train::run::{progress_bar, Trainable};
use crate::train::{checkpoint, GrpoConfig, Policy, RunOptions, Trainer, TrainingArguments};
use crate::Resources;

/// The environment, compiled into the binary so that the demo runs from any folder.
pub const HOLOWARE: &str = include_str!("../../../hol/arithmetic.hol");
/// Its name in messages and records.
pub const HOLOWARE_NAME: &str = "hol/arithmetic.hol";
/// The first operand's range: two digits.
pub const FIRST: std::ops::RangeInclusive<u32> = 10..=99;
/// The second operand's range: one digit.
pub const SECOND: std::ops::RangeInclusive<u32> = 0..=9;
/// Held-out pairs of operands.
pub const HELD_OUT: usize = 100;
/// The reward component that says whether the answer is right.
pub const ANSWER: &str = "math_answer";

/// What one demo does.
#[derive(Debug, Clone, PartialEq)]
pub struct DemoOptions {
    /// Seeds the weights, the split, the warm-up batches and GRPO.
    pub seed: u64,
    /// The run folder (must not exist, or be empty).
    pub out: PathBuf,
    /// The model's architecture: Llama by default, whose untied embeddings learn the sums far more
    /// reliably at this size than Qwen2's tied ones (measured: 1 seed in 3 learns with Qwen2).
    pub arch: Arch,
    /// The model's size.
    pub preset: Preset,
    pub warmup: warmup::Budget,
    /// Whom the warm-up imitates.
    pub teacher: data::Teacher,
    /// GRPO's optimizer steps.
    pub grpo_steps: u64,
    /// Evaluate every this many GRPO steps (and at the start and the end).
    pub eval_steps: u64,
    /// Held-out problems.
    pub heldout: usize,
    /// Progress bars on stderr (drawn only on a terminal).
    pub progress: bool,
}

impl DemoOptions {
    /// The budget the README's command runs (about 10 minutes on 2 cores).
    pub fn full(seed: u64, out: PathBuf) -> Self {
        DemoOptions {
            seed,
            out,
            arch: Arch::Llama,
            preset: Preset::Tiny,
            // At 3e-3 the warm-up's end depended on the last bits of the arithmetic: a change of
            // rounding in the output head left seeds 1 and 2 at a loss of 0.21 and 0.19 (held-out
            // accuracy 0.07, where GRPO cannot start) instead of 0.07 and 0.06. At 2e-3 both builds end
            // at 0.03–0.06 on seeds 0–2.
            warmup: warmup::Budget {
                steps: 1000,
                batch_size: 64,
                learning_rate: 2e-3,
            },
            teacher: data::Teacher { forget_carry: 0.5 },
            grpo_steps: 300,
            eval_steps: 50,
            heldout: HELD_OUT,
            progress: true,
        }
    }

    /// A run of a few seconds that goes through every stage (for tests and a first look).
    pub fn quick(seed: u64, out: PathBuf) -> Self {
        DemoOptions {
            warmup: warmup::Budget {
                steps: 10,
                batch_size: 16,
                learning_rate: 2e-3,
            },
            grpo_steps: 2,
            eval_steps: 1,
            heldout: 8,
            ..DemoOptions::full(seed, out)
        }
    }

    /// GRPO's options (TRL's names).
    pub fn grpo_config(&self) -> GrpoConfig {
        GrpoConfig {
            training: TrainingArguments {
                max_steps: self.grpo_steps as i64,
                seed: self.seed,
                save_steps: self.grpo_steps.max(1),
                per_device_train_batch_size: 64,
                learning_rate: 1e-4,
                ..GrpoConfig::default().training
            },
            eval_steps: Some(self.eval_steps.max(1)),
            eval_on_start: true,
            num_generations: 8,
            max_completion_length: 16,
            gradient_checkpointing: false,
            temperature: 1.0,
            beta: 0.04,
            ..GrpoConfig::default()
        }
    }
}

/// Why the demo stopped.
#[derive(Debug)]
pub enum DemoError {
    /// The options or the run folder are wrong; nothing was trained.
    Input(String),
    /// A stage failed.
    Failed(String),
}

impl fmt::Display for DemoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DemoError::Input(message) | DemoError::Failed(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for DemoError {}

/// One evaluation: a line of the table.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    pub step: u64,
    /// The fraction of held-out rollouts whose answer is right.
    pub accuracy: f64,
    /// The fraction of held-out problems with a right answer among their G rollouts.
    pub pass_at_g: f64,
    /// The held-out rollouts' mean total reward.
    pub reward: f64,
    /// The training step's KL to the warmed-up weights (none at the start).
    pub kl: Option<f64>,
}

/// What a demo did.
#[derive(Debug, Clone)]
pub struct Report {
    pub run_dir: PathBuf,
    pub parameters: usize,
    pub train_problems: usize,
    pub heldout_problems: usize,
    /// Rollouts per held-out problem (G).
    pub group: usize,
    /// The mean warm-up loss over its last tenth of steps.
    pub warmup_loss: f64,
    pub evaluations: Vec<Evaluation>,
    pub plots: usize,
    /// The chart of the held-out accuracy.
    pub accuracy_plot: PathBuf,
    pub warmup_seconds: f64,
    pub grpo_seconds: f64,
}

impl Report {
    /// The table of evaluations, with a header.
    pub fn table(&self) -> String {
        let g = self.group;
        let mut text = format!(
            "{:>4}  {:>17}  {:>13}  {:>14}  {:>8}\n",
            "step",
            "held-out accuracy",
            format!("pass@{g}"),
            "held-out reward",
            "KL"
        );
        for evaluation in &self.evaluations {
            text.push_str(&format!(
                "{:>4}  {:>17.3}  {:>13.3}  {:>14.3}  {:>8}\n",
                evaluation.step,
                evaluation.accuracy,
                evaluation.pass_at_g,
                evaluation.reward,
                evaluation
                    .kl
                    .map_or_else(|| "-".to_string(), |kl| format!("{kl:.4}")),
            ));
        }
        text
    }

    /// Held-out accuracy after the warm-up and at the end.
    pub fn accuracy(&self) -> Option<(f64, f64)> {
        Some((
            self.evaluations.first()?.accuracy,
            self.evaluations.last()?.accuracy,
        ))
    }
}

/// Runs the demo (see the [module documentation](self)), telling `say` what each stage does.
pub fn run(options: &DemoOptions, say: &mut dyn FnMut(String)) -> Result<Report, DemoError> {
    let input = DemoError::Input;
    let failed = DemoError::Failed;
    let out = &options.out;
    if std::fs::read_dir(out).is_ok_and(|mut entries| entries.next().is_some()) {
        return Err(input(format!(
            "`{}` is not empty; remove it or pass another --out",
            out.display()
        )));
    }
    if !(0.0..=1.0).contains(&options.teacher.forget_carry) {
        return Err(input(format!(
            "the teacher forgets the carry with probability {}; it must be in [0, 1]",
            options.teacher.forget_carry
        )));
    }
    let problems = data::split(FIRST, SECOND, options.heldout, options.seed).map_err(input)?;
    write_rows(&out.join("problems"), &problems)
        .map_err(|error| failed(format!("cannot write the problems: {error}")))?;
    let holoware = Arc::new(
        Holoware::load(
            HOLOWARE_NAME,
            HOLOWARE.as_bytes(),
            Arc::new(holotypes::registry()),
        )
        .map_err(|error| failed(error.to_string()))?,
    );

    let started = Instant::now();
    let model_dir = out.join("warmup");
    let init = init_model(
        &model_dir,
        &InitOptions {
            arch: options.arch,
            preset: options.preset,
            seed: options.seed,
            force: false,
            vocab: None,
            layers: None,
        },
    )
    .map_err(|error| failed(error.to_string()))?;
    say(format!(
        "a random {} of {} parameters ({}); {} training problems, {} held out",
        options.arch,
        init.parameters,
        model_dir.display(),
        problems.train.len(),
        problems.heldout.len()
    ));
    say(format!(
        "warm-up: {} supervised steps of {} problems",
        options.warmup.steps, options.warmup.batch_size
    ));
    let config = options.grpo_config();
    let warmup_loss = warm_up(options, &problems.train, &holoware, &model_dir)?;
    let warmup_seconds = started.elapsed().as_secs_f64();
    say(format!(
        "warm-up done in {warmup_seconds:.0} s (loss {warmup_loss:.3}); GRPO: {} steps of {} problems × {} rollouts on {HOLOWARE_NAME}, held-out evaluation every {} steps",
        options.grpo_steps,
        config.prompts_per_generation(),
        config.num_generations,
        options.eval_steps
    ));

    let started = Instant::now();
    let policy = Policy::load(&model_dir, &Device::Cpu).map_err(|e| failed(e.to_string()))?;
    let source = Interpreted {
        holoware: Arc::clone(&holoware),
        resources: Resources::default(),
    };
    let run_options = RunOptions {
        out: out.clone(),
        resume: false,
        progress: options.progress,
    };
    let mut trainer = Trainer::new(source, policy, config.clone(), run_options)
        .map_err(|error| failed(error.to_string()))?;
    let rows = |problems: &[data::Problem]| -> Vec<(usize, Row)> {
        problems
            .iter()
            .map(data::Problem::row)
            .enumerate()
            .collect()
    };
    let summary = trainer
        .train(&rows(&problems.train), &rows(&problems.heldout))
        .map_err(|error| failed(error.to_string()))?;
    let grpo_seconds = started.elapsed().as_secs_f64();
    let plots = plot::plot_run(out).map_err(failed)?;
    let accuracy_plot = plots
        .iter()
        .find(|path| path.ends_with("eval_rewards_math_answer_mean.png"))
        .cloned()
        .ok_or_else(|| {
            failed(format!(
                "no chart of `eval/rewards/{ANSWER}/mean` in the run"
            ))
        })?;

    let pass = pass_at_group(&out.join("eval_rollouts.jsonl")).map_err(failed)?;
    let metrics =
        crate::train::metrics::read_metrics(&out.join("metrics.jsonl")).map_err(failed)?;
    let kl: BTreeMap<u64, f64> = metrics
        .iter()
        .filter_map(|(step, values)| Some((*step, *values.get("kl")?)))
        .collect();
    let evaluations = summary
        .evaluations
        .iter()
        .map(|(step, values)| {
            let value = |key: &str| values.get(key).copied().unwrap_or(f64::NAN);
            Evaluation {
                step: *step,
                accuracy: value(&format!("eval/rewards/{ANSWER}/mean")),
                pass_at_g: pass.get(step).copied().unwrap_or(f64::NAN),
                reward: value("eval/reward"),
                kl: kl.get(step).copied(),
            }
        })
        .collect();
    Ok(Report {
        run_dir: out.clone(),
        parameters: init.parameters,
        train_problems: problems.train.len(),
        heldout_problems: problems.heldout.len(),
        group: config.num_generations_eval(),
        warmup_loss,
        evaluations,
        plots: plots.len(),
        accuracy_plot,
        warmup_seconds,
        grpo_seconds,
    })
}

/// The problems as rows of [`HOLOWARE`], one JSON object per line: `dir/train.jsonl`, `dir/heldout.jsonl`.
fn write_rows(dir: &Path, problems: &data::Problems) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (file, set) in [
        ("train.jsonl", &problems.train),
        ("heldout.jsonl", &problems.heldout),
    ] {
        let mut text = String::new();
        for problem in set {
            text.push_str(&serde_json::Value::Object(problem.row()).to_string());
            text.push('\n');
        }
        std::fs::write(dir.join(file), text)?;
    }
    Ok(())
}

/// The supervised warm-up of the model in `model_dir`, its weights written back there.
fn warm_up(
    options: &DemoOptions,
    problems: &[data::Problem],
    holoware: &Arc<Holoware>,
    model_dir: &Path,
) -> Result<f64, DemoError> {
    let failed = DemoError::Failed;
    let policy = Policy::load(model_dir, &Device::Cpu).map_err(|e| failed(e.to_string()))?;
    let end_of_turn = *policy
        .end_of_turn
        .first()
        .ok_or_else(|| failed("the model has no end-of-turn token".into()))?;
    let holophore = Holophore::new(Arc::new(policy.tokenizer), Arc::new(policy.template))
        .map_err(|error| failed(error.to_string()))?;
    let budget = &options.warmup;
    let mut trained = Trainable::new(&policy.model, model_dir, &budget.config(options.seed))
        .map_err(|error| failed(error.to_string()))?;
    let bar = progress_bar(options.progress, budget.steps, "warm-up step");
    let teacher = options.teacher;
    let loss = warmup::train(
        &mut trained,
        budget,
        options.seed,
        |rng| {
            let drawn: Vec<data::Problem> = problems
                .choose_multiple(rng, budget.batch_size)
                .copied()
                .collect();
            drawn
                .iter()
                .map(|problem| {
                    let (reply, right) = teacher.reply(problem, rng);
                    let recorded = warmup::sequence(
                        holoware,
                        &holophore,
                        &problem.row(),
                        &reply,
                        end_of_turn,
                    )?;
                    check_rewards(&recorded.rewards, right, &problem.question(), &reply)?;
                    Ok(recorded.sequence)
                })
                .collect()
        },
        |step, loss| {
            bar.set_position(step);
            bar.set_message(format!("loss {loss:.3}"));
        },
    )
    .map_err(failed)?;
    bar.finish_and_clear();
    checkpoint::save_tensors(
        &model_dir.join("model.safetensors"),
        trained
            .vars
            .iter()
            .map(|(name, var)| (name.clone(), var.as_tensor().clone()))
            .collect(),
    )
    .map_err(|error| failed(format!("cannot write the warmed-up model: {error}")))?;
    Ok(loss)
}

/// Checks that the environment rewards the teacher's `reply` to `question` as the demo expects: every
/// component in full, less the answer's when the teacher was wrong. A failure means that
/// [`HOLOWARE`] and the demo's data disagree.
fn check_rewards(
    rewards: &BTreeMap<String, f64>,
    right: bool,
    question: &str,
    reply: &str,
) -> Result<(), String> {
    let expected = |name: &str| if name == ANSWER && !right { 0.0 } else { 1.0 };
    match rewards
        .iter()
        .find(|(name, value)| **value != expected(name))
    {
        None if rewards.contains_key(ANSWER) => Ok(()),
        None => Err(format!("`{HOLOWARE_NAME}` has no `{ANSWER}` reward")),
        Some((name, value)) => Err(format!(
            "`{HOLOWARE_NAME}` gives {reply:?} to {question:?} {value} for `{name}`, not {}",
            expected(name)
        )),
    }
}

/// Per evaluation step, the fraction of held-out problems with a right answer (the [`ANSWER`]
/// component at 1) among their rollouts in `path` (the trainer's `eval_rollouts.jsonl`).
pub fn pass_at_group(path: &Path) -> Result<BTreeMap<u64, f64>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|error| format!("cannot read `{}`: {error}", path.display()))?;
    let mut problems: BTreeMap<u64, BTreeSet<usize>> = BTreeMap::new();
    let mut solved: BTreeMap<u64, BTreeSet<usize>> = BTreeMap::new();
    for (number, line) in text.lines().enumerate() {
        let record: RolloutRecord = serde_json::from_str(line)
            .map_err(|error| format!("{}:{}: {error}", path.display(), number + 1))?;
        let step = record.step.unwrap_or(0);
        problems.entry(step).or_default().insert(record.row_index);
        if record.rewards.get(ANSWER) == Some(&1.0) {
            solved.entry(step).or_default().insert(record.row_index);
        }
    }
    Ok(problems
        .into_iter()
        .map(|(step, rows)| {
            let right = solved.get(&step).map_or(0, BTreeSet::len);
            (step, right as f64 / rows.len() as f64)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rewards(answer: f64, format: f64) -> BTreeMap<String, f64> {
        BTreeMap::from([(ANSWER.to_string(), answer), ("format".to_string(), format)])
    }

    #[test]
    fn the_teachers_replies_must_earn_what_the_demo_expects() {
        assert!(check_rewards(&rewards(1.0, 1.0), true, "q", "r").is_ok());
        assert!(check_rewards(&rewards(0.0, 1.0), false, "q", "r").is_ok());
        let error = check_rewards(
            &rewards(1.0, 1.0),
            false,
            "What is 47+8?",
            "<answer>45</answer>",
        )
        .unwrap_err();
        assert!(error.contains("`math_answer`, not 0"), "{error}");
        let error = check_rewards(&rewards(1.0, 0.0), true, "q", "r").unwrap_err();
        assert!(error.contains("`format`, not 1"), "{error}");
        let error = check_rewards(&BTreeMap::new(), true, "q", "r").unwrap_err();
        assert!(error.contains("no `math_answer` reward"), "{error}");
    }
}
