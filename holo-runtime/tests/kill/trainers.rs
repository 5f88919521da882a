//! The four trainers' runs on the committed tiny Qwen2, each a test that runs its trials: GRPO (every
//! weight, a checkpoint each step, the generation batch spread over two steps so that checkpoints hold
//! it), PPO (a value model in the checkpoints), ERL (its reflection memory in the checkpoints) and SFT
//! (LoRA adapters with dropout).

use std::path::Path;

use crate::common::{fixture, sft_args, tiny_grpo};
use crate::trial::{scenarios, trials, Recipe};

/// `holo train` on `holoware` for 6 steps with the options the RL trainers share, then `extra`.
fn train_args(holoware: &str, out: &Path, extra: &[&str]) -> Vec<String> {
    tiny_grpo(holoware, out, 6, extra)
}

/// The kill points of a save without and with a value model.
const SAVE_POINTS: &[&str] = &[
    "checkpoint:staging",
    "checkpoint:weights",
    "checkpoint:optimizer",
    "checkpoint:state",
    "checkpoint:renamed",
    "checkpoint:removing",
];
const SAVE_POINTS_WITH_CRITIC: &[&str] = &[
    "checkpoint:staging",
    "checkpoint:weights",
    "checkpoint:critic",
    "checkpoint:optimizer",
    "checkpoint:state",
    "checkpoint:renamed",
    "checkpoint:removing",
];
/// A resumed RL run cuts `metrics.jsonl` back, then each of its two rollout files.
const RL_RESUME_POINTS: &[(&str, u64)] = &[("metrics:staged", 1), ("records:staged", 2)];

#[test]
fn grpo_killed_at_any_moment_resumes_to_the_same_run() {
    trials(&Recipe {
        name: "grpo",
        args: |out| {
            train_args(
                "short.hol",
                out,
                &["--num-iterations", "2", "--save-steps", "1"],
            )
        },
        steps: 6,
        save_steps: 1,
        keep: 2,
        save_points: SAVE_POINTS,
        resume_points: RL_RESUME_POINTS,
        rollouts: true,
    });
}

/// Asynchronous GRPO: a checkpoint keeps the generation drawn ahead of it, sampled by weights it no
/// longer holds; the resumed run trains on it.
#[test]
fn grpo_ahead_killed_at_any_moment_resumes_to_the_same_run() {
    trials(&Recipe {
        name: "grpo-ahead",
        args: |out| {
            train_args(
                "short.hol",
                out,
                &["--max-off-policy-steps", "1", "--save-steps", "1"],
            )
        },
        steps: 6,
        save_steps: 1,
        keep: 2,
        save_points: SAVE_POINTS,
        resume_points: RL_RESUME_POINTS,
        rollouts: true,
    });
}

#[test]
fn ppo_killed_at_any_moment_resumes_to_the_same_run() {
    trials(&Recipe {
        name: "ppo",
        args: |out| {
            train_args(
                "short.hol",
                out,
                &[
                    "--algorithm",
                    "ppo",
                    "--num-mini-batches",
                    "2",
                    "--num-ppo-epochs",
                    "2",
                    "--kl-coef",
                    "0.05",
                    "--save-steps",
                    "2",
                ],
            )
        },
        steps: 6,
        save_steps: 2,
        keep: 2,
        save_points: SAVE_POINTS_WITH_CRITIC,
        resume_points: RL_RESUME_POINTS,
        rollouts: true,
    });
}

#[test]
fn erl_killed_at_any_moment_resumes_to_the_same_run() {
    trials(&Recipe {
        name: "erl",
        args: |out| {
            train_args(
                "erl.hol",
                out,
                &[
                    "--erl",
                    "true",
                    "--erl-algorithm",
                    "2",
                    "--num-iterations",
                    "2",
                    "--save-steps",
                    "1",
                ],
            )
        },
        steps: 6,
        save_steps: 1,
        keep: 2,
        save_points: SAVE_POINTS,
        resume_points: RL_RESUME_POINTS,
        rollouts: true,
    });
}

#[test]
fn sft_killed_at_any_moment_resumes_to_the_same_run() {
    trials(&Recipe {
        name: "sft",
        // Five examples in batches of 2, two per step: 2 steps an epoch, 3 epochs.
        args: |out| {
            sft_args(
                Path::new(&fixture("sft/train.jsonl")),
                out,
                &[
                    "--use-peft",
                    "--lora-r",
                    "4",
                    "--lora-dropout",
                    "0.1",
                    "--save-total-limit",
                    "2",
                ],
            )
        },
        steps: 6,
        save_steps: 2,
        keep: 2,
        save_points: SAVE_POINTS,
        resume_points: &[("metrics:staged", 1)],
        rollouts: false,
    });
}

/// Kills at fixed points, each a case that failed before the fix it names:
/// - before the first checkpoint (`checkpoint:staging@1`): `--resume` refused a run without a checkpoint
///   and a new run refused the folder; a resume now starts the run over, evaluating at step 0 as a new
///   run does (`eval_on_start`);
/// - after the last checkpoint was renamed into place, before the oldest was removed
///   (`checkpoint:renamed@6`): the resumed run, having nothing left to do, kept one checkpoint more than
///   `save_total_limit`; a resume now removes it;
/// - while a checkpoint is removed (`checkpoint:removing`), in the run and again in its resume: the
///   removal renames the folder first, so a cut-short one leaves no `checkpoint-N` missing files;
/// - a resume killed while it cuts back its own files (`metrics:staged`, `records:staged`).
#[test]
fn kills_that_found_defects_resume_to_the_same_run() {
    scenarios(
        &Recipe {
            name: "grpo-cases",
            args: |out| {
                train_args(
                    "short.hol",
                    out,
                    &[
                        "--num-iterations",
                        "2",
                        "--save-steps",
                        "1",
                        "--eval-on-start",
                        "true",
                    ],
                )
            },
            steps: 6,
            save_steps: 1,
            keep: 2,
            save_points: SAVE_POINTS,
            resume_points: RL_RESUME_POINTS,
            rollouts: true,
        },
        &[
            &[("checkpoint:staging", 1)],
            &[("checkpoint:renamed", 6)],
            &[("checkpoint:removing", 1), ("checkpoint:removing", 1)],
            &[
                ("checkpoint:state", 2),
                ("metrics:staged", 1),
                ("records:staged", 2),
            ],
        ],
    );
}
