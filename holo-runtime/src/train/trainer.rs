//! The training loop: generation batches through the Loom, advantages, micro-batches, optimizer steps,
//! evaluation, checkpoints and metrics. See the [module documentation](super) for the order of events.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Tensor, Var};
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::advantages::{self, nanmean};
use super::batch::{self, Completion, Sequence};
use super::checkpoint::{Buffer, RunDir, TrainerState};
use super::config::{GrpoConfig, TrainingConfig};
use super::erl;
use super::loss;
use super::metrics::MetricsLog;
use super::run::{self, mix, Policy, RunOptions, TrainError, Trainable, Window};
use super::sampling::Training;
use super::score;
use super::sft::{self, SftLossType};
use crate::holophore::Holophore;
use crate::holotypes::{ReflectionMemory, ToolStats};
use crate::interpreter::Row;
use crate::local::{Limits, LocalModel, LocalOptions, Model};
use crate::loom::{Loom, LoomConfig, RolloutRecord, RolloutSource, Summary};
use crate::machine::Rollout;
use crate::sampler::Sampler;

/// What a finished run did.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    pub steps: u64,
    /// The metrics of the last step.
    pub last: BTreeMap<String, f64>,
    /// Each evaluation's metrics by step.
    pub evaluations: Vec<(u64, BTreeMap<String, f64>)>,
    pub run_dir: PathBuf,
}

/// Borrows a rollout source for one Loom.
struct Borrowed<'a, S>(&'a S);

impl<S: RolloutSource> RolloutSource for Borrowed<'_, S> {
    fn check(&self, row: &Row) -> Result<(), String> {
        self.0.check(row)
    }

    fn start(&self, row: &Row) -> Result<Box<dyn Rollout + Send>, String> {
        self.0.start(row)
    }

    fn tool_stats(&self) -> Option<Arc<ToolStats>> {
        self.0.tool_stats()
    }

    fn reflection_memory(&self) -> Option<Arc<ReflectionMemory>> {
        self.0.reflection_memory()
    }
}

/// Seed salts, so that data order, sampling, shuffling and evaluation draw independent streams.
const DATA: u64 = 1;
const SAMPLING: u64 = 2;
const SHUFFLE: u64 = 3;
const EVAL: u64 = 4;
const DROPOUT: u64 = 5;

/// GRPO training of a local model on rollouts from a [`RolloutSource`]; see the [module
/// documentation](super).
pub struct Trainer<S> {
    source: S,
    config: GrpoConfig,
    /// The trained weights and their optimizer.
    trained: Trainable,
    reference: Option<Model>,
    sampler: LocalModel,
    /// A sampler of the caller's instead of `sampler`, and its model's context when known.
    external: Option<(Box<dyn Sampler>, Option<usize>)>,
    holophore: Holophore,
    run: RunDir,
    options: RunOptions,
}

impl<S: RolloutSource> Trainer<S> {
    /// Prepares the weights to train (every weight, or LoRA adapters), the reference model when `beta`
    /// > 0, and the in-process sampler sharing the trained weights.
    pub fn new(
        source: S,
        policy: Policy,
        config: GrpoConfig,
        options: RunOptions,
    ) -> Result<Self, TrainError> {
        config
            .validate()
            .map_err(|error| TrainError::Input(error.to_string()))?;
        let base = policy.model;
        let trained = Trainable::new(&base, &policy.dir, &config)?;
        // The frozen starting point: the base weights (LoRA trains beside them, so they are shared).
        let reference = (config.beta != 0.0).then(|| base.detached());
        drop(base);
        let holophore = Holophore::new(
            std::sync::Arc::new(policy.tokenizer.clone()),
            std::sync::Arc::new(policy.template.clone()),
        )
        .map_err(|error| {
            TrainError::Input(format!("--model `{}`: {error}", policy.dir.display()))
        })?;
        let model = &trained.model;
        let sampler = LocalModel::new(
            model.detached(),
            policy.tokenizer,
            policy.template,
            policy.end_of_turn,
            LocalOptions {
                device: model.device().clone(),
                limits: Limits {
                    max_num_seqs: config.generation_batch_size().max(1),
                    ..Limits::default()
                },
                default_max_tokens: config.max_completion_length,
                seed: config.seed,
                ..LocalOptions::default()
            },
        );
        if let Some(memory) = source.reflection_memory() {
            memory.set_capacity(if config.enable_memory {
                config.memory_size
            } else {
                0
            });
        }
        Ok(Trainer {
            source,
            config,
            trained,
            reference,
            sampler,
            external: None,
            holophore,
            run: RunDir::new(options.out.clone()),
            options,
        })
    }

    /// Samples rollouts with `sampler` (an OpenAI-compatible server, a bf16 copy) instead of the trained
    /// model in process. Its weights are its own: keep them in step with the trained ones (export and
    /// reload), or the rollouts drift off-policy. Its log-probabilities (at the run's temperature) are
    /// corrected for as TRL corrects vLLM's (`vllm_importance_sampling_correction` and its mode and
    /// bounds); `context` is its model's context length, when known.
    pub fn with_sampler(mut self, sampler: Box<dyn Sampler>, context: Option<usize>) -> Self {
        self.external = Some((sampler, context));
        self
    }

    pub fn config(&self) -> &GrpoConfig {
        &self.config
    }

    /// The model being trained (its weights are [`Var`]s).
    pub fn model(&self) -> &Model {
        &self.trained.model
    }

    /// The trained weights or adapters, by name.
    pub fn vars(&self) -> &[(String, Var)] {
        &self.trained.vars
    }

    /// The optimizer steps of a run over `rows` rows.
    pub fn total_steps(&self, rows: usize) -> u64 {
        let config = &self.config;
        if config.max_steps > 0 {
            return config.max_steps as u64;
        }
        let prompts = config.prompts_per_generation().max(1);
        let generations = (config.num_train_epochs * rows as f64 / prompts as f64).ceil() as u64;
        let micro =
            generations * config.steps_per_generation() as u64 * config.num_iterations as u64;
        micro
            .div_ceil(config.gradient_accumulation_steps as u64)
            .max(1)
    }

    /// Trains on `rows` (`(index, row)`: the index names the row in the records), evaluating on
    /// `eval_rows` every `eval_steps`. Blocks until the last step.
    pub fn train(
        &mut self,
        rows: &[(usize, Row)],
        eval_rows: &[(usize, Row)],
    ) -> Result<TrainSummary, TrainError> {
        let config = self.config.clone();
        if self.sampler_correction()
            && config.loss_type == super::config::LossType::Vespo
            && config.vllm_importance_sampling_mode.is_sequence()
        {
            return Err(TrainError::Input(
                "`vllm_importance_sampling_mode`: VESPO weighs sequences itself and takes only token_truncate or token_mask".into(),
            ));
        }
        let prompts = config.prompts_per_generation();
        if rows.len() < prompts {
            return Err(TrainError::Input(format!(
                "the data has {} rows; one generation batch needs {prompts} distinct prompts (generation_batch_size / num_generations)",
                rows.len()
            )));
        }
        for (rows, what) in [(rows, "training"), (eval_rows, "evaluation")] {
            for (index, row) in rows {
                self.source.check(row).map_err(|message| {
                    TrainError::Input(format!("{what} row {}: {message}", index + 1))
                })?;
            }
        }
        let total = self.total_steps(rows.len());
        let (mut state, mut metrics_log) = self.open_run()?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;

        let progress = run::progress_bar(self.options.progress, total, "step");
        progress.set_position(state.global_step);
        let mut summary = TrainSummary {
            steps: state.global_step,
            last: BTreeMap::new(),
            evaluations: Vec::new(),
            run_dir: self.run.path.clone(),
        };
        if config.eval_on_start && state.global_step == 0 && !eval_rows.is_empty() {
            let metrics = self.evaluate(&runtime, eval_rows, 0)?;
            metrics_log.log(0, &metrics)?;
            summary.evaluations.push((0, metrics));
        }
        let generate_every = (config.steps_per_generation() * config.num_iterations) as u64;
        let accumulation = config.gradient_accumulation_steps as u64;
        while state.global_step < total {
            let started = Instant::now();
            let step = state.global_step + 1;
            let mut window = Window::default();
            let mut grads = self.trained.no_grads();
            for _ in 0..accumulation {
                if state.micro_step % generate_every == 0 || state.buffer.is_none() {
                    let (buffer, generated) = self.generate(&runtime, rows, &mut state, step)?;
                    window.extend(generated);
                    state.buffer = Some(buffer);
                }
                let buffer = state.buffer.as_ref().expect("generated above");
                let slot = (state.micro_step % config.steps_per_generation() as u64) as usize;
                let steps = config.steps_per_generation();
                let micro = Buffer::slot(&buffer.completions, slot, steps);
                // LoRA dropout masks: a function of the seed and the micro-batch (never 0, which is off).
                self.trained
                    .model
                    .set_dropout_seed(mix(mix(config.seed ^ DROPOUT) ^ state.micro_step) | 1);
                let (value, micro_grads, metrics) = self.micro_step(micro, buffer)?;
                window.loss += value;
                window.extend(metrics);
                self.trained.accumulate(&mut grads, &micro_grads)?;
                let internalized = Buffer::slot(&buffer.internalized, slot, steps);
                if !internalized.is_empty() {
                    let total = buffer
                        .internalized
                        .iter()
                        .map(|s| s.trained.len())
                        .sum::<usize>();
                    let (value, internal_grads, metrics) =
                        self.internalization_step(internalized, total)?;
                    window.loss += value;
                    window.extend(metrics);
                    self.trained.accumulate(&mut grads, &internal_grads)?;
                }
                state.micro_step += 1;
                if state.micro_step % generate_every == 0 {
                    state.buffer = None;
                }
            }
            let (grad_norm, learning_rate) =
                self.trained
                    .step(&mut grads, &config, state.global_step, total)?;
            // The sampler shares the weights; its cached prefixes belong to the old ones.
            self.sampler.prefix_cache().clear();
            state.global_step = step;

            let mut metrics = window.means();
            metrics.insert("loss".into(), window.loss);
            metrics.insert("grad_norm".into(), grad_norm);
            metrics.insert("learning_rate".into(), learning_rate);
            metrics.insert("num_tokens".into(), state.num_input_tokens_seen as f64);
            metrics.insert(
                "epoch".into(),
                state.data_position as f64 / rows.len() as f64,
            );
            metrics.insert("step_time".into(), started.elapsed().as_secs_f64());
            let last_step = step == total;
            if let Some(every) = config.eval_steps {
                if (step % every == 0 || last_step) && !eval_rows.is_empty() {
                    let evaluation = self.evaluate(&runtime, eval_rows, step)?;
                    metrics.extend(evaluation.clone());
                    summary.evaluations.push((step, evaluation));
                }
            }
            metrics_log.log(step, &metrics)?;
            progress.set_message(format!(
                "reward {:.3}{}",
                metrics.get("reward").copied().unwrap_or(f64::NAN),
                metrics
                    .get("kl")
                    .map_or(String::new(), |kl| format!(", kl {kl:.4}")),
            ));
            progress.set_position(step);
            if step % config.save_steps == 0 || last_step {
                let saved = self.save(&mut state)?;
                if self.options.progress {
                    progress.suspend(|| eprintln!("saved {}", saved.display()));
                }
            }
            summary.steps = step;
            summary.last = metrics;
        }
        progress.finish_and_clear();
        Ok(summary)
    }

    /// Opens the run folder (see [`run::open`]) with its rollout files: new ones, or those of the
    /// resumed run cut back to its checkpoint.
    fn open_run(&mut self) -> Result<(TrainerState, MetricsLog), TrainError> {
        let opened = run::open(
            &self.run,
            self.options.resume,
            &self.config,
            &mut self.trained,
        )?;
        let dir = &self.run.path;
        for file in ["rollouts.jsonl", "eval_rollouts.jsonl"] {
            if opened.resumed {
                keep_records_until(&dir.join(file), opened.state.global_step)?;
            } else {
                std::fs::File::create(dir.join(file))?;
            }
        }
        if let (true, Some(memory)) = (opened.resumed, self.source.reflection_memory()) {
            memory.restore(opened.state.memory.clone());
        }
        Ok((opened.state, opened.metrics))
    }

    /// Writes a checkpoint of `state`, with ERL's memory as it is now.
    fn save(&self, state: &mut TrainerState) -> Result<PathBuf, TrainError> {
        state.memory = self
            .source
            .reflection_memory()
            .map(|memory| memory.entries())
            .unwrap_or_default();
        self.trained.save(&self.run, state, &self.config)
    }

    /// The next `prompts_per_generation` distinct rows of the data stream (each epoch a fresh
    /// permutation), advancing `state.data_position`.
    fn next_rows<'r>(
        &self,
        rows: &'r [(usize, Row)],
        state: &mut TrainerState,
    ) -> Vec<&'r (usize, Row)> {
        let wanted = self.config.prompts_per_generation();
        let mut picked: Vec<&(usize, Row)> = Vec::with_capacity(wanted);
        let mut epoch_order: Option<(u64, Vec<usize>)> = None;
        while picked.len() < wanted {
            let epoch = state.data_position / rows.len() as u64;
            let offset = (state.data_position % rows.len() as u64) as usize;
            if epoch_order.as_ref().is_none_or(|(e, _)| *e != epoch) {
                let mut order: Vec<usize> = (0..rows.len()).collect();
                if self.config.shuffle_dataset {
                    let seed = mix(mix(self.config.data_seed() ^ DATA) ^ epoch);
                    order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
                }
                epoch_order = Some((epoch, order));
            }
            let order = &epoch_order.as_ref().expect("set above").1;
            let candidate = &rows[order[offset]];
            state.data_position += 1;
            // Across an epoch boundary a row may come again; a group of its own twice would be the same
            // rollouts twice.
            if !picked.iter().any(|row| row.0 == candidate.0) {
                picked.push(candidate);
            }
        }
        picked
    }

    /// One generation batch: rollouts, rewards, advantages, and the log-probabilities the loss needs,
    /// shuffled. Returns it with the metrics TRL logs at generation.
    fn generate(
        &mut self,
        runtime: &tokio::runtime::Runtime,
        rows: &[(usize, Row)],
        state: &mut TrainerState,
        step: u64,
    ) -> Result<(Buffer, BTreeMap<String, f64>), TrainError> {
        let config = self.config.clone();
        let group = config.num_generations;
        let picked: Vec<(usize, Row)> = self.next_rows(rows, state).into_iter().cloned().collect();
        let generation = state.generations;
        state.generations += 1;
        let seed = mix(mix(config.seed ^ SAMPLING) ^ generation);
        let stats = self.source.tool_stats();
        let tools_before = stats.as_ref().map(|stats| stats.counts());
        let (records, _) = self.rollouts(runtime, &picked, group, seed, step, "rollouts.jsonl")?;
        let tools = stats
            .zip(tools_before)
            .map(|(stats, before)| stats.counts() - before);

        let rewards = batch::rewards(&records, config.reward_weights.as_ref());
        let scored = advantages::advantages(
            &rewards,
            group,
            config.scale_rewards,
            config.multi_objective_aggregation,
        );
        let mut metrics = scored.metrics;
        let (mut completions, mut internalized) = if config.erl {
            let split = erl::split(&records, group, &config).map_err(TrainError::Input)?;
            metrics.extend(split.metrics);
            (split.completions, split.internalized)
        } else {
            let completions = records
                .iter()
                .zip(&scored.advantages)
                .map(|(record, &advantage)| {
                    let masked = record.error.is_some()
                        || (record.truncated && config.mask_truncated_completions);
                    Completion {
                        sequences: batch::sequences(record),
                        advantage: advantage as f32,
                        mask: if masked { 0.0 } else { 1.0 },
                        truncated: record.truncated,
                        old_logprobs: None,
                        ref_logprobs: None,
                        is_ratio: None,
                        second_loss: false,
                    }
                })
                .collect();
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

        let batch_size = config.per_device_train_batch_size;
        let generate_every = config.steps_per_generation() * config.num_iterations;
        let correction = self.sampler_correction();
        // Log-probabilities of the policy as it sampled: without dropout.
        self.trained.model.set_dropout_seed(0);
        if !config
            .gradient_accumulation_steps
            .is_multiple_of(generate_every)
            || correction
        {
            let old = score::logprobs(
                &self.trained.model,
                &completions,
                config.temperature,
                batch_size,
            )?;
            for (completion, old) in completions.iter_mut().zip(old) {
                completion.old_logprobs = Some(old);
            }
        }
        if correction {
            importance_sampling(&config, &mut completions, &mut metrics);
        }
        if let Some(reference) = &self.reference {
            let logprobs =
                score::logprobs(reference, &completions, config.temperature, batch_size)?;
            for (completion, logprobs) in completions.iter_mut().zip(logprobs) {
                completion.ref_logprobs = Some(logprobs);
            }
        }
        let shuffle = mix(mix(config.seed ^ SHUFFLE) ^ generation);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(shuffle);
        completions.shuffle(&mut rng);
        internalized.shuffle(&mut rng);
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
            },
            metrics,
        ))
    }

    /// Whether the sampler's log-probabilities need TRL's importance-sampling correction. The in-process
    /// sampler is the trained f32 model itself: like TRL without vLLM, it needs none.
    fn sampler_correction(&self) -> bool {
        self.external.is_some() && self.config.vllm_importance_sampling_correction
    }

    /// Runs `G` rollouts of each row through the Loom with the training sampler, appends them (with
    /// `step`) to `file` in the run folder, and returns them grouped: row by row, rollouts in order.
    fn rollouts(
        &self,
        runtime: &tokio::runtime::Runtime,
        rows: &[(usize, Row)],
        group: usize,
        seed: u64,
        step: u64,
        file: &str,
    ) -> Result<(Vec<RolloutRecord>, Summary), TrainError> {
        let loom = Loom::new(
            Borrowed(&self.source),
            LoomConfig {
                rollouts_per_row: group,
                seed,
                concurrency: (rows.len() * group).max(1),
                progress: false,
                timing: false,
                dataset: None,
            },
        )
        .with_holophore(self.holophore.fork());
        let sampler = match &self.external {
            Some((sampler, context)) => Training::new(sampler.as_ref(), &self.config, *context),
            None => Training::new(
                &self.sampler as &dyn Sampler,
                &self.config,
                Some(self.trained.model.config.max_position_embeddings),
            ),
        };
        let mut jsonl = Vec::new();
        let summary = runtime.block_on(loom.run(rows, &sampler, &mut jsonl))?;
        let mut records: Vec<RolloutRecord> = jsonl
            .split(|&byte| byte == b'\n')
            .filter(|line| !line.is_empty())
            .map(serde_json::from_slice)
            .collect::<Result<_, _>>()
            .map_err(io::Error::other)?;
        let position: BTreeMap<usize, usize> = rows
            .iter()
            .enumerate()
            .map(|(position, (index, _))| (*index, position))
            .collect();
        records.sort_by_key(|record| (position[&record.row_index], record.rollout_index));
        let mut out = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(self.run.path.join(file))?;
        let mut lines = Vec::new();
        for record in &mut records {
            record.step = Some(step);
            serde_json::to_writer(&mut lines, record).map_err(io::Error::other)?;
            lines.push(b'\n');
        }
        out.write_all(&lines)?;
        out.flush()?;
        Ok((records, summary))
    }

    /// Loss and gradients of one micro-batch: one loss, or (ERL's `erl_algorithm = 2`) the first loss
    /// plus `erl_rl_coef` times the second, each aggregated over its own completions.
    fn micro_step(
        &self,
        micro: &[Completion],
        buffer: &Buffer,
    ) -> Result<(f64, candle_core::backprop::GradStore, BTreeMap<String, f64>), TrainError> {
        // The first loss's completions, then the second's: each takes its slice of the token tensors.
        let mut completions = micro.to_vec();
        completions.sort_by_key(|completion| completion.second_loss);
        let split = completions.partition_point(|completion| !completion.second_loss);
        let (first, second) = completions.split_at(split);
        let first_tokens: usize = first.iter().map(Completion::len).sum();
        let second_tokens: usize = second.iter().map(Completion::len).sum();
        let correction = self.sampler_correction();
        let mut metrics = BTreeMap::new();
        let (value, grads) = score::backward(
            &self.trained.model,
            &completions,
            self.config.temperature,
            self.config.gradient_checkpointing,
            self.config.entropy_coef != 0.0,
            |head| {
                let mut total: Option<Tensor> = None;
                for (part, offset, tokens, items, weight, prefix) in [
                    (first, 0, first_tokens, buffer.num_items_in_batch, 1.0, ""),
                    (
                        second,
                        first_tokens,
                        second_tokens,
                        buffer.second_num_items,
                        self.config.erl_rl_coef,
                        "erl/",
                    ),
                ] {
                    if part.is_empty() {
                        continue;
                    }
                    let inputs = loss::Inputs {
                        completions: part,
                        num_items_in_batch: items,
                        sampler_correction: correction,
                    };
                    let computed = loss::compute(
                        &self.config,
                        &inputs,
                        &head.logprobs.narrow(0, offset, tokens)?,
                        &head.entropies.narrow(0, offset, tokens)?,
                    )?;
                    metrics.extend(
                        computed
                            .metrics
                            .into_iter()
                            .map(|(name, value)| (format!("{prefix}{name}"), value)),
                    );
                    let weighted = (computed.loss * weight)?;
                    total = Some(match total {
                        Some(sum) => (sum + weighted)?,
                        None => weighted,
                    });
                }
                match total {
                    Some(total) => Ok(total),
                    None => Tensor::zeros((), head.logprobs.dtype(), head.logprobs.device()),
                }
            },
        )?;
        let value = value
            .to_dtype(candle_core::DType::F64)?
            .to_scalar::<f64>()?;
        Ok((value, grads, metrics))
    }

    /// ERL's internalization on one micro-batch's share of the generation's internalized sequences:
    /// `internalization_coef` × the summed negative log-likelihood (temperature 1) of their trained
    /// tokens over `total`, the trained tokens of all of them, so that the micro-batches add up to the
    /// mean cross-entropy of the generation.
    fn internalization_step(
        &self,
        sequences: &[Sequence],
        total: usize,
    ) -> Result<(f64, candle_core::backprop::GradStore, BTreeMap<String, f64>), TrainError> {
        let sequences: Vec<&Sequence> = sequences.iter().collect();
        let micro = sft::loss::micro_batch(
            &self.trained.model,
            &sequences,
            total,
            SftLossType::Nll,
            self.config.gradient_checkpointing,
        )?;
        let coef = self.config.internalization_coef;
        let tokens: usize = sequences.iter().map(|s| s.trained.len()).sum();
        // The micro-batch's mean cross-entropy: its loss is its summed NLL over `total`.
        let cross_entropy = micro.loss * total as f64 / tokens.max(1) as f64;
        let mut grads = micro.grads;
        if coef != 1.0 {
            for (_, var) in &self.trained.vars {
                if let Some(grad) = grads.remove(var.as_tensor()) {
                    grads.insert(var.as_tensor(), (grad * coef)?);
                }
            }
        }
        let metrics = BTreeMap::from([("erl/internalization_loss".to_string(), cross_entropy)]);
        Ok((micro.loss * coef, grads, metrics))
    }

    /// Rollouts of the held-out rows with the current weights (the same seed at every evaluation, so
    /// that only the weights change): `eval/reward`, `eval/pass@1`, `eval/pass@G`, each component's mean.
    fn evaluate(
        &self,
        runtime: &tokio::runtime::Runtime,
        rows: &[(usize, Row)],
        step: u64,
    ) -> Result<BTreeMap<String, f64>, TrainError> {
        let group = self.config.num_generations_eval();
        let seed = mix(self.config.seed ^ EVAL);
        let (records, summary) =
            self.rollouts(runtime, rows, group, seed, step, "eval_rollouts.jsonl")?;
        if let Some(memory) = self.source.reflection_memory() {
            // Held-out rows must not teach the run: what their rollouts remembered is dropped.
            memory.discard_pending();
        }
        let mut metrics = BTreeMap::new();
        metrics.insert(
            "eval/reward".to_string(),
            summary.mean_reward.unwrap_or(f64::NAN),
        );
        for (k, value) in &summary.pass_at_k {
            metrics.insert(format!("eval/pass@{k}"), *value);
        }
        for component in &summary.components {
            metrics.insert(
                format!("eval/rewards/{}/mean", component.name),
                component.mean,
            );
        }
        let lengths: Vec<f64> = records
            .iter()
            .map(|record| {
                batch::sequences(record)
                    .iter()
                    .map(|s| s.trained.len() as f64)
                    .sum()
            })
            .collect();
        metrics.insert(
            "eval/completions/mean_length".into(),
            nanmean(lengths.iter().copied()),
        );
        metrics.insert("eval/failed".into(), summary.failed as f64);
        Ok(metrics)
    }
}

/// TRL's completion metrics: lengths (trained tokens per rollout), the truncated fraction, the lengths
/// of the rollouts that ended on their own.
fn completion_metrics(
    records: &[RolloutRecord],
    completions: &[Completion],
    metrics: &mut BTreeMap<String, f64>,
) {
    let lengths: Vec<f64> = completions.iter().map(|c| c.len() as f64).collect();
    let stats = |values: &[f64]| {
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (nanmean(values.iter().copied()), min, max)
    };
    let (mean, min, max) = stats(&lengths);
    metrics.insert("completions/mean_length".into(), mean);
    metrics.insert("completions/min_length".into(), min);
    metrics.insert("completions/max_length".into(), max);
    let truncated = completions.iter().filter(|c| c.truncated).count();
    metrics.insert(
        "completions/clipped_ratio".into(),
        truncated as f64 / completions.len().max(1) as f64,
    );
    let mut terminated: Vec<f64> = completions
        .iter()
        .zip(&lengths)
        .filter(|(c, _)| !c.truncated)
        .map(|(_, &length)| length)
        .collect();
    if terminated.is_empty() {
        terminated.push(0.0);
    }
    let (mean, min, max) = stats(&terminated);
    metrics.insert("completions/mean_terminated_length".into(), mean);
    metrics.insert("completions/min_terminated_length".into(), min);
    metrics.insert("completions/max_terminated_length".into(), max);
    let failed = records.iter().filter(|r| r.error.is_some()).count();
    metrics.insert(
        "rollouts/failed_ratio".into(),
        failed as f64 / records.len().max(1) as f64,
    );
}

/// TRL's importance-sampling correction for a sampler whose log-probabilities differ from the
/// trainer's: `exp(old − sampling)` per token (or summed per completion), clamped or masked to
/// `[clip_min, clip_max]`; and the `sampling/*` metrics.
pub fn importance_sampling(
    config: &GrpoConfig,
    completions: &mut [Completion],
    metrics: &mut BTreeMap<String, f64>,
) {
    let mode = config.vllm_importance_sampling_mode;
    let (low, high) = (
        config.vllm_importance_sampling_clip_min,
        config.vllm_importance_sampling_clip_max,
    );
    let mut differences = Vec::new();
    let mut ratios = Vec::new();
    for completion in completions.iter_mut() {
        let sampling = completion.sampling_logprobs();
        let old = completion.old_logprobs.clone().unwrap_or_default();
        // In f32, as TRL computes it.
        let diffs: Vec<f32> = old
            .iter()
            .zip(&sampling)
            .map(|(&old, &sampled)| {
                let diff = (old - sampled) * completion.mask;
                if diff.is_nan() {
                    0.0
                } else {
                    diff
                }
            })
            .collect();
        if completion.mask != 0.0 {
            differences.extend(
                old.iter()
                    .zip(&sampling)
                    .map(|(&old, &sampled)| (old - sampled).abs() as f64)
                    .filter(|difference| !difference.is_nan()),
            );
        }
        let raw: Vec<f64> = if mode.is_sequence() {
            vec![diffs.iter().sum::<f32>().exp() as f64]
        } else {
            diffs.iter().map(|diff| diff.exp() as f64).collect()
        };
        let corrected: Vec<f32> = raw
            .iter()
            .map(|&ratio| {
                let value = if mode.truncates() {
                    let ratio = low.map_or(ratio, |low| ratio.max(low));
                    high.map_or(ratio, |high| ratio.min(high))
                } else if low.is_some_and(|low| ratio < low)
                    || high.is_some_and(|high| ratio > high)
                {
                    0.0
                } else {
                    ratio
                };
                value as f32
            })
            .collect();
        if mode.is_sequence() || completion.mask != 0.0 {
            ratios.extend(corrected.iter().map(|&r| r as f64));
        }
        completion.is_ratio = Some(corrected);
    }
    let fold = |values: &[f64], f: fn(f64, f64) -> f64, empty: f64| {
        values.iter().copied().reduce(f).unwrap_or(empty)
    };
    metrics.insert(
        "sampling/sampling_logp_difference/mean".into(),
        if differences.is_empty() {
            0.0
        } else {
            nanmean(differences.iter().copied())
        },
    );
    metrics.insert(
        "sampling/sampling_logp_difference/max".into(),
        fold(&differences, f64::max, 0.0),
    );
    metrics.insert(
        "sampling/importance_sampling_ratio/min".into(),
        fold(&ratios, f64::min, 0.0),
    );
    metrics.insert(
        "sampling/importance_sampling_ratio/mean".into(),
        if ratios.is_empty() {
            0.0
        } else {
            nanmean(ratios.iter().copied())
        },
    );
    metrics.insert(
        "sampling/importance_sampling_ratio/max".into(),
        fold(&ratios, f64::max, 0.0),
    );
}

/// Drops the records of steps after `step` from a rollouts file (a resumed run writes them again).
fn keep_records_until(path: &Path, step: u64) -> io::Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let mut kept = String::with_capacity(text.len());
    for line in text.split_inclusive('\n') {
        if !line.ends_with('\n') {
            break;
        }
        let record_step = serde_json::from_str::<serde_json::Value>(line)
            .ok()
            .and_then(|value| value.get("step").and_then(serde_json::Value::as_u64));
        if record_step.is_some_and(|record_step| record_step <= step) {
            kept.push_str(line);
        }
    }
    let staging = path.with_extension("jsonl.resume");
    std::fs::write(&staging, kept)?;
    std::fs::rename(staging, path)
}

/// Prints a generation's completions (`limit` of them, all without one) with their rewards and
/// advantages, as TRL's `log_completions` does.
fn print_completions(
    records: &[RolloutRecord],
    advantages: &[f64],
    limit: Option<usize>,
    step: u64,
) {
    let mut err = io::stderr().lock();
    let _ = writeln!(err, "── completions of step {step} ──");
    for (record, advantage) in records
        .iter()
        .zip(advantages)
        .take(limit.unwrap_or(usize::MAX))
    {
        let sampled: Vec<&str> = record
            .contexts
            .iter()
            .flat_map(|context| &context.messages)
            .flat_map(|message| &message.parts)
            .filter(|part| part.sampled)
            .map(|part| part.text.as_str())
            .collect();
        let _ = writeln!(
            err,
            "row {} #{}: reward {:.3}, advantage {advantage:+.3}: {:?}",
            record.row_index,
            record.rollout_index,
            record.reward,
            sampled.join(" ⏎ ")
        );
    }
}
