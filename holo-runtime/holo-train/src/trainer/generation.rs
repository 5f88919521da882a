//! A generation batch of the [`Trainer`]'s loop: rows drawn from the stream (the curriculum's, DAPO's
//! refills) or a feed's batch, rollouts through the Loom with the backend's sampler, advantages, the
//! completions the loss trains on; and the rollouts of an evaluation.

use std::collections::BTreeMap;

use indicatif::ProgressBar;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::backend::Backend;
use super::{Trainer, EVAL, EVAL_FILE, SAMPLING, SHUFFLE, TRAINING_FILE};
use crate::advantages::{self, nanmean};
use crate::batch;
use crate::checkpoint::RunDir;
use crate::config::Algorithm;
use crate::config::GrpoConfig;
use crate::curriculum::Stream;
use crate::erl;
use crate::error::TrainError;
use crate::feed::Given;
use crate::metrics::{completion_metrics, print_completions};
use crate::rollouts::{self, evaluation_metrics, Failures, Rollouts};
use crate::run::mix;
use crate::sampling::Training;
use crate::state::{Buffer, Drawn, TrainerState};
use holo_core::holophore::Holophore;
use holo_core::interpreter::Row;
use holo_core::loom::{RolloutRecord, RolloutSource};
use holo_core::sampler::Sampler;

impl<S: RolloutSource, B: Backend> Trainer<S, B> {
    /// One generation batch, drawn now: from the feed, or rollouts through the Loom with the backend's
    /// sampler ([`Drawer::draw`]); then [`Trainer::take_up`].
    pub(super) fn generate(
        &mut self,
        runtime: &tokio::runtime::Runtime,
        stream: &Stream<'_>,
        state: &mut TrainerState,
        step: u64,
        progress: &ProgressBar,
    ) -> Result<(Buffer, BTreeMap<String, f64>), TrainError> {
        if let Some(feed) = self.feed.as_mut() {
            let fed = feed.next(runtime, step)?;
            let drawn = Drawn {
                records: fed.records,
                metrics: fed.metrics,
                generation: state.generations,
                ..Drawn::default()
            };
            return self.take_up(drawn, fed.groups, fed.advantages, state, step);
        }
        let (sampler, context) = self.backend.sampler();
        let mut drawn = self
            .drawer(stream)
            .draw(runtime, sampler, context, state, step, progress)?;
        if let Some(error) = self.backend.sampler_error() {
            // The rollouts file keeps what the sampler failed.
            self.append(&mut drawn, step)?;
            return Err(TrainError::Source(error));
        }
        self.record(drawn, state, step)
    }

    /// Appends a generation's rollouts to the run's rollouts file, with the `step` that trains them.
    fn append(&self, drawn: &mut Drawn, step: u64) -> Result<(), TrainError> {
        rollouts::append(&self.run, TRAINING_FILE, step, &mut drawn.records)?;
        rollouts::append(&self.run, TRAINING_FILE, step, &mut drawn.unused)
    }

    /// A generation drawn by the trainer itself (now, or ahead of this step): its rollouts appended to
    /// the run's rollouts file with the `step` that trains them, then [`Trainer::take_up`].
    pub(super) fn record(
        &mut self,
        mut drawn: Drawn,
        state: &mut TrainerState,
        step: u64,
    ) -> Result<(Buffer, BTreeMap<String, f64>), TrainError> {
        self.append(&mut drawn, step)?;
        self.take_up(drawn, Vec::new(), Vec::new(), state, step)
    }

    /// What drawing a generation reads of this trainer.
    pub(super) fn drawer<'a>(&'a self, stream: &'a Stream<'a>) -> Drawer<'a, S> {
        Drawer {
            source: &*self.source,
            holophore: &self.holophore,
            config: &self.config,
            failures: &self.failures,
            run: &self.run,
            stream,
        }
    }

    /// A generation batch taken up for training: rewards, advantages (normalized within `groups`, or
    /// `num_generations`, unless `given`), and what the backend adds for the loss
    /// ([`Backend::score`]), shuffled. Returns it with the metrics TRL logs at generation.
    fn take_up(
        &mut self,
        drawn: Drawn,
        groups: Vec<usize>,
        given: Vec<Option<Given>>,
        state: &mut TrainerState,
        step: u64,
    ) -> Result<(Buffer, BTreeMap<String, f64>), TrainError> {
        let config = self.config.clone();
        let group = config.num_generations;
        let Drawn {
            records,
            mut metrics,
            generation,
            ..
        } = drawn;
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
            let remembered = memory.commit();
            if remembered > 0 && config.max_off_policy_steps > 0 {
                // The generations drawn meanwhile read the memory before this commit.
                return Err(TrainError::Input(format!(
                    "`max_off_policy_steps` is {}, but the rollouts remember reflections (ERL's \
                     holotypes), which the generations drawn ahead would read out of order; set it \
                     to 0 (synchronous)",
                    config.max_off_policy_steps
                )));
            }
            metrics.insert("erl/memory_size".into(), memory.len() as f64);
        }
        completion_metrics(&records, &completions, &mut metrics);
        staleness_metrics(&records, step, &mut metrics);
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
}

/// What drawing a generation's rollouts reads: borrowed from the [`Trainer`] when it draws between its
/// steps, or by the thread that draws ahead of them (`max_off_policy_steps`, [`super::ahead`]).
pub(super) struct Drawer<'a, S> {
    pub(super) source: &'a S,
    pub(super) holophore: &'a Holophore,
    pub(super) config: &'a GrpoConfig,
    pub(super) failures: &'a Failures,
    pub(super) run: &'a RunDir,
    pub(super) stream: &'a Stream<'a>,
}

impl<S: RolloutSource> Drawer<'_, S> {
    /// The rollouts of one generation batch, grouped: `prompts_per_generation` rows of the stream, `G`
    /// rollouts each. Under `dynamic_sampling` (DAPO), groups whose rewards are all equal are dropped and
    /// the stream's next rows drawn in their place, up to `max_num_gen_batches` draws in all; a batch
    /// still short is completed with dropped groups, first dropped first. Each draw takes a generation
    /// number of its own (its sampling seed). The curriculum takes every group's mean reward, and may
    /// move to its next level for the next batch.
    pub(super) fn draw(
        &self,
        runtime: &tokio::runtime::Runtime,
        sampler: &dyn Sampler,
        context: Option<usize>,
        state: &mut TrainerState,
        step: u64,
        progress: &ProgressBar,
    ) -> Result<Drawn, TrainError> {
        let (config, stream) = (self.config, self.stream);
        let sampler = Training::new(sampler, config, context);
        let generation = state.generations;
        let stats = self.source.tool_stats();
        let tools_before = stats.as_ref().map(|stats| stats.counts());
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
            let records = self.rollouts(runtime, &sampler, &rows, group, seed, step, progress)?;
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
        let mut dropped = dropped.into_iter();
        kept.extend(dropped.by_ref().take(short).flatten());
        if let Some(curriculum) = state.curriculum.as_mut() {
            let (mean, advance) = stream.observe(curriculum, &group_means);
            metrics.insert("curriculum/mean_reward".into(), mean);
            if let Some(advance) = advance {
                progress.suspend(|| eprintln!("{advance} (after step {step})"));
            }
        }
        if let Some(tools) = stats
            .zip(tools_before)
            .map(|(stats, before)| stats.counts() - before)
        {
            // Counts over the generation: code runs, those that failed (an exception, a limit, a
            // timeout, code that could not run), and those stopped at the timeout.
            metrics.insert("tools/calls".into(), tools.calls as f64);
            metrics.insert("tools/failed".into(), tools.failed as f64);
            metrics.insert("tools/timed_out".into(), tools.timed_out as f64);
        }
        Ok(Drawn {
            records: kept,
            unused: dropped.flatten().collect(),
            metrics,
            generation,
            position: state.position(),
        })
    }

    /// Runs `G` rollouts of each row through the Loom with `sampler`, and returns them grouped: row by
    /// row, rollouts in order. A batch in which every rollout failed stops the run, its rollouts
    /// appended to the rollouts file first (the error points there).
    #[allow(clippy::too_many_arguments)]
    fn rollouts(
        &self,
        runtime: &tokio::runtime::Runtime,
        sampler: &dyn Sampler,
        rows: &[(usize, Row)],
        group: usize,
        seed: u64,
        step: u64,
        progress: &ProgressBar,
    ) -> Result<Vec<RolloutRecord>, TrainError> {
        let rollouts = Rollouts {
            source: self.source,
            holophore: self.holophore,
            sampler,
        };
        let (mut records, _) = rollouts.run(runtime, rows, group, seed)?;
        if let Err(error) = self.failures.check(&records, step, TRAINING_FILE, progress) {
            rollouts::append(self.run, TRAINING_FILE, step, &mut records)?;
            return Err(error);
        }
        Ok(records)
    }
}

impl<S: RolloutSource, B: Backend> Trainer<S, B> {
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
        let (sampler, context) = self.backend.sampler();
        let rollouts = Rollouts {
            source: &*self.source,
            holophore: &self.holophore,
            sampler: &Training::new(sampler, &self.config, context),
        };
        let (mut records, summary) = rollouts.run(runtime, rows, group, seed)?;
        rollouts::append(&self.run, EVAL_FILE, step, &mut records)?;
        if let Some(error) = self.backend.sampler_error() {
            return Err(TrainError::Source(error));
        }
        self.failures.check(&records, step, EVAL_FILE, progress)?;
        if let Some(memory) = self.source.reflection_memory() {
            // Held-out rows must not teach the run: what their rollouts remembered is dropped.
            memory.discard_pending();
        }
        Ok(evaluation_metrics(&records, &summary))
    }
}

/// How far behind the weights that train on `records` at `step` (those after `step - 1` optimizer
/// steps) were the weights that sampled them, in optimizer steps, over the sampled parts that say
/// ([`PartRecord::weight_version`](holo_core::loom::PartRecord), the trainer's numbering on servers
/// too: the rollout servers' pool translates theirs): `async/staleness` (mean) and
/// `async/staleness_max`.
fn staleness_metrics(records: &[RolloutRecord], step: u64, metrics: &mut BTreeMap<String, f64>) {
    let trained = step.saturating_sub(1);
    let behind: Vec<f64> = records
        .iter()
        .flat_map(|record| &record.contexts)
        .flat_map(|context| &context.messages)
        .flat_map(|message| &message.parts)
        .filter(|part| part.sampled)
        .filter_map(|part| part.weight_version)
        .map(|version| trained.saturating_sub(version) as f64)
        .collect();
    if let Some(max) = behind.iter().copied().reduce(f64::max) {
        metrics.insert("async/staleness".into(), nanmean(behind.iter().copied()));
        metrics.insert("async/staleness_max".into(), max);
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
