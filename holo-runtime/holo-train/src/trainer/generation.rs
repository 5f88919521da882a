//! A generation batch of the [`Trainer`]'s loop: rows drawn from the stream (the curriculum's, DAPO's
//! refills) or a feed's batch, rollouts through the Loom with the backend's sampler, advantages, the
//! completions the loss trains on; and the rollouts of an evaluation.

use std::collections::BTreeMap;

use indicatif::ProgressBar;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::backend::Backend;
use super::{Trainer, EVAL, SAMPLING, SHUFFLE};
use crate::advantages::{self, nanmean};
use crate::batch;
use crate::config::Algorithm;
use crate::curriculum::Stream;
use crate::erl;
use crate::error::TrainError;
use crate::feed::Given;
use crate::metrics::{completion_metrics, print_completions};
use crate::rollouts::{evaluation_metrics, Rollouts};
use crate::run::mix;
use crate::sampling::Training;
use crate::state::{Buffer, TrainerState};
use holo_core::interpreter::Row;
use holo_core::loom::{RolloutRecord, RolloutSource, Summary};

impl<S: RolloutSource, B: Backend> Trainer<S, B> {
    /// One generation batch: rollouts, rewards, advantages, and what the backend adds for the loss
    /// ([`Backend::score`]), shuffled. Returns it with the metrics TRL logs at generation.
    pub(super) fn generate(
        &mut self,
        runtime: &tokio::runtime::Runtime,
        stream: &Stream<'_>,
        state: &mut TrainerState,
        step: u64,
        progress: &ProgressBar,
    ) -> Result<(Buffer, BTreeMap<String, f64>), TrainError> {
        let config = self.config.clone();
        let group = config.num_generations;
        let generation = state.generations;
        let stats = self.source.tool_stats();
        let tools_before = stats.as_ref().map(|stats| stats.counts());
        let (records, mut metrics, groups, given) = match self.feed.as_mut() {
            Some(feed) => {
                let fed = feed.next(runtime, step)?;
                (fed.records, fed.metrics, fed.groups, fed.advantages)
            }
            None => {
                let (records, metrics) = self.draw(runtime, stream, state, step, progress)?;
                (records, metrics, Vec::new(), Vec::new())
            }
        };
        let tools = stats
            .zip(tools_before)
            .map(|(stats, before)| stats.counts() - before);

        let rewards = batch::rewards(&records, config.reward_weights.as_ref());
        let mut scored = if groups.is_empty() {
            advantages::advantages(
                &rewards,
                group,
                config.scale_rewards,
                config.multi_objective_aggregation,
            )
        } else {
            advantages::grouped_advantages(
                &rewards,
                &groups,
                config.scale_rewards,
                config.multi_objective_aggregation,
            )
        };
        for (advantage, given) in scored.advantages.iter_mut().zip(&given) {
            match given {
                Some(Given::Sequence(value)) => *advantage = *value,
                // What the printed completions show; the loss takes the tokens' own.
                Some(Given::Tokens(values)) => {
                    *advantage = advantages::nanmean(values.iter().map(|&value| value as f64))
                }
                None => {}
            }
        }
        metrics.extend(scored.metrics);
        self.example = records
            .iter()
            .find(|record| record.error.is_none())
            .and_then(last_reply);
        let (mut completions, mut internalized) = if config.erl {
            let split = erl::split(&records, group, &config).map_err(TrainError::Input)?;
            metrics.extend(split.metrics);
            (split.completions, split.internalized)
        } else {
            let mut completions = batch::completions(
                &records,
                &scored.advantages,
                config.mask_truncated_completions,
            );
            for (completion, given) in completions.iter_mut().zip(&given) {
                if let Some(Given::Tokens(values)) = given {
                    completion.token_advantages = Some(values.clone());
                }
            }
            (completions, Vec::new())
        };
        if let Some(memory) = self.source.reflection_memory() {
            // What this generation's rollouts remembered becomes visible to the next one.
            memory.commit();
            metrics.insert("erl/memory_size".into(), memory.len() as f64);
        }
        completion_metrics(&records, &completions, &mut metrics);
        if let Some(tools) = tools {
            // Counts over the generation: code runs, those that failed (an exception, a limit, a
            // timeout, code that could not run), and those stopped at the timeout.
            metrics.insert("tools/calls".into(), tools.calls as f64);
            metrics.insert("tools/failed".into(), tools.failed as f64);
            metrics.insert("tools/timed_out".into(), tools.timed_out as f64);
        }
        state.num_input_tokens_seen += completions
            .iter()
            .flat_map(|c| &c.sequences)
            .map(|s| s.ids.len() as u64)
            .sum::<u64>();
        let items = |second: bool| -> f64 {
            completions
                .iter()
                .filter(|c| c.second_loss == second)
                .map(|c| c.mask as f64 * c.len() as f64)
                .sum()
        };
        let (num_items_in_batch, second_num_items) = (items(false), items(true));

        self.backend
            .score(&config, &mut completions, &mut metrics)?;
        let ppo = config.algorithm == Algorithm::Ppo;
        // PPO draws a permutation per epoch itself, and keeps each completion beside its reward.
        let scores = if ppo {
            // A failed rollout has no reward component (`batch::rewards`), so its total is NaN.
            advantages::weighted_totals(&rewards)
                .into_iter()
                .map(|score| score as f32)
                .collect()
        } else {
            let shuffle = mix(mix(config.training.seed ^ SHUFFLE) ^ generation);
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(shuffle);
            completions.shuffle(&mut rng);
            internalized.shuffle(&mut rng);
            Vec::new()
        };
        if config.log_completions {
            print_completions(
                &records,
                &scored.advantages,
                config.num_completions_to_print,
                step,
            );
        }
        Ok((
            Buffer {
                completions,
                num_items_in_batch,
                second_num_items,
                internalized,
                step,
                scores,
            },
            metrics,
        ))
    }

    /// The rollouts of one generation batch, grouped: `prompts_per_generation` rows of the stream, `G`
    /// rollouts each. Under `dynamic_sampling` (DAPO), groups whose rewards are all equal are dropped and
    /// the stream's next rows drawn in their place, up to `max_num_gen_batches` draws in all; a batch
    /// still short is completed with dropped groups, first dropped first. Each draw takes a generation
    /// number of its own (its sampling seed). The curriculum takes every group's mean reward, and may
    /// move to its next level for the next batch.
    fn draw(
        &self,
        runtime: &tokio::runtime::Runtime,
        stream: &Stream<'_>,
        state: &mut TrainerState,
        step: u64,
        progress: &ProgressBar,
    ) -> Result<(Vec<RolloutRecord>, BTreeMap<String, f64>), TrainError> {
        let config = &self.config;
        let (group, wanted) = (config.num_generations, config.prompts_per_generation());
        let draws_allowed = if config.dynamic_sampling {
            config.max_num_gen_batches
        } else {
            1
        };
        let mut metrics = state
            .curriculum
            .as_ref()
            .map(|curriculum| stream.metrics(curriculum))
            .unwrap_or_default();
        let (mut kept, mut dropped) = (Vec::new(), Vec::new());
        let (mut group_means, mut all_totals) = (Vec::new(), Vec::new());
        let mut draws = 0;
        while kept.len() < wanted * group && draws < draws_allowed {
            // A row already in the batch is not drawn again for it.
            let exclude: Vec<usize> = kept
                .iter()
                .step_by(group)
                .map(|record: &RolloutRecord| record.row_index)
                .collect();
            let rows = stream.next(state, wanted - kept.len() / group, &exclude);
            let seed = mix(mix(config.training.seed ^ SAMPLING) ^ state.generations);
            state.generations += 1;
            draws += 1;
            let (records, _) = self.rollouts(
                runtime,
                &rows,
                group,
                seed,
                step,
                "rollouts.jsonl",
                progress,
            )?;
            let totals = advantages::weighted_totals(&batch::rewards(
                &records,
                config.reward_weights.as_ref(),
            ));
            for (records, totals) in records.chunks(group).zip(totals.chunks(group)) {
                group_means.push(nanmean(totals.iter().copied()));
                all_totals.extend_from_slice(totals);
                if !config.dynamic_sampling || advantages::spread(totals) {
                    kept.extend_from_slice(records);
                } else {
                    dropped.push(records.to_vec());
                }
            }
        }
        let short = wanted - kept.len() / group;
        if config.dynamic_sampling {
            metrics.insert("dynamic_sampling/dropped".into(), dropped.len() as f64);
            metrics.insert("dynamic_sampling/refills".into(), (draws - 1) as f64);
            metrics.insert("dynamic_sampling/short".into(), short as f64);
            metrics.insert("dynamic_sampling/reward".into(), nanmean(all_totals));
            if short > 0 {
                progress.suspend(|| eprintln!(
                    "step {step}: dynamic sampling found {} groups with a reward spread in {draws} draws (max_num_gen_batches); {short} without one complete the batch",
                    wanted - short
                ));
            }
        }
        kept.extend(dropped.into_iter().take(short).flatten());
        if let Some(curriculum) = state.curriculum.as_mut() {
            let (mean, advance) = stream.observe(curriculum, &group_means);
            metrics.insert("curriculum/mean_reward".into(), mean);
            if let Some(advance) = advance {
                progress.suspend(|| eprintln!("{advance} (after step {step})"));
            }
        }
        Ok((kept, metrics))
    }

    /// Runs `G` rollouts of each row through the Loom with the backend's sampler, appends them (with
    /// `step`) to `file` in the run folder, and returns them grouped: row by row, rollouts in order.
    /// An error the sampler kept, and a batch in which every rollout failed, stop the run.
    #[allow(clippy::too_many_arguments)]
    fn rollouts(
        &self,
        runtime: &tokio::runtime::Runtime,
        rows: &[(usize, Row)],
        group: usize,
        seed: u64,
        step: u64,
        file: &str,
        progress: &ProgressBar,
    ) -> Result<(Vec<RolloutRecord>, Summary), TrainError> {
        let (sampler, context) = self.backend.sampler();
        let sampler = Training::new(sampler, &self.config, context);
        let rollouts = Rollouts {
            source: &self.source,
            holophore: &self.holophore,
            sampler: &sampler,
            run: &self.run,
        };
        let (records, summary) = rollouts.run(runtime, rows, group, seed, step, file)?;
        if let Some(error) = self.backend.sampler_error() {
            return Err(TrainError::Source(error));
        }
        self.failures.check(&records, step, file, progress)?;
        Ok((records, summary))
    }

    /// Rollouts of the held-out rows with the current weights (the same seed at every evaluation, so
    /// that only the weights change): `eval/reward`, `eval/pass@1`, `eval/pass@G`, each component's mean.
    pub(super) fn evaluate(
        &self,
        runtime: &tokio::runtime::Runtime,
        rows: &[(usize, Row)],
        step: u64,
        progress: &ProgressBar,
    ) -> Result<BTreeMap<String, f64>, TrainError> {
        let group = self.config.num_generations_eval();
        let seed = mix(self.config.training.seed ^ EVAL);
        let (records, summary) = self.rollouts(
            runtime,
            rows,
            group,
            seed,
            step,
            "eval_rollouts.jsonl",
            progress,
        )?;
        if let Some(memory) = self.source.reflection_memory() {
            // Held-out rows must not teach the run: what their rollouts remembered is dropped.
            memory.discard_pending();
        }
        Ok(evaluation_metrics(&records, &summary))
    }
}

/// The last text `record`'s model sampled, cut to 200 characters: what the terminal shows of a batch.
fn last_reply(record: &RolloutRecord) -> Option<String> {
    let text = record.sampled().next_back()?.trim();
    let mut cut: String = text.chars().take(200).collect();
    if cut.len() < text.len() {
        cut.push('…');
    }
    Some(cut)
}
