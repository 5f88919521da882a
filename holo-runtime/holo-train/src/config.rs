//! The trainers' configurations: [`GrpoConfig`] (TRL's `GRPOConfig` option names, defaults and meanings) and
//! [`SftConfig`](super::sft::SftConfig), each with LoRA's options under TRL's `ModelConfig` names. What every
//! trainer has (the length of the run, checkpoints, AdamW, the schedule, LoRA) is one struct,
//! [`TrainingArguments`], flattened into each configuration's keys and checked in one place
//! ([`TrainingArguments::validate`]).
//!
//! A configuration comes from a TOML file (keys are the option names) and from command-line overrides
//! (`--num-generations 4`: the same names in kebab case; [`super::builder`]), the overrides winning. Every key is checked
//! before any work starts: an unknown key is named with the closest known one, a bad value with the values
//! the key allows, and the place it came from (the file's line, or the flag).

use holo_core::tools::ToolFormat;
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub(crate) use super::options::{check_router_aux_loss_coef, error, shared_allowed_values};
pub use super::options::{
    ConfigError, Inert, LrSchedulerType, SaveStrategy, TrainingArguments, TrainingConfig,
};

/// Chat-template arguments (TRL's `chat_template_kwargs`): a JSON object, from a TOML table or from JSON
/// text (a command-line flag). Anything but an object is refused, as is `null` (TOML cannot write it; leave
/// the key out).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(transparent)]
pub struct ChatTemplateKwargs(pub serde_json::Map<String, serde_json::Value>);

impl ChatTemplateKwargs {
    /// The arguments as template variables.
    pub fn variables(&self) -> BTreeMap<String, minijinja::Value> {
        holo_core::chat::template_kwargs(&serde_json::Value::Object(self.0.clone()))
            .unwrap_or_default()
    }
}

impl<'de> Deserialize<'de> for ChatTemplateKwargs {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        fn has_null(value: &serde_json::Value) -> bool {
            match value {
                serde_json::Value::Null => true,
                serde_json::Value::Array(items) => items.iter().any(has_null),
                serde_json::Value::Object(map) => map.values().any(has_null),
                _ => false,
            }
        }
        let json = match serde_json::Value::deserialize(deserializer)? {
            serde_json::Value::String(text) => serde_json::from_str(&text).map_err(|error| {
                D::Error::custom(format!(
                    "not valid JSON ({error}); give an object such as {{\"enable_thinking\": false}}"
                ))
            })?,
            other => other,
        };
        holo_core::chat::template_kwargs(&json).map_err(D::Error::custom)?;
        let serde_json::Value::Object(map) = json else {
            unreachable!("template_kwargs accepts only objects")
        };
        if let Some(key) = map.iter().find(|(_, v)| has_null(v)).map(|(k, _)| k) {
            return Err(D::Error::custom(format!(
                "`{key}` holds null, which a TOML configuration cannot keep; leave it out"
            )));
        }
        Ok(ChatTemplateKwargs(map))
    }
}

/// How the per-token losses of a batch are reduced to one number (TRL's `loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossType {
    /// Each completion's mean token loss, averaged over completions.
    Grpo,
    /// Token losses summed over the micro-batch, divided by its trained tokens.
    Bnpo,
    /// Token losses summed, divided by completions × `max_completion_length` (Dr. GRPO).
    DrGrpo,
    /// Token losses summed, divided by the trained tokens of the whole generation batch (DAPO; TRL's
    /// default).
    Dapo,
    /// Clipped importance-sampling weights times the log-probability (CISPO, MiniMax-M1).
    Cispo,
    /// A soft, sigmoid-gated trust region instead of hard clipping (SAPO).
    Sapo,
    /// Sequence sums of token losses, averaged over completions (LUSPO).
    Luspo,
    /// Gamma-weighted sequence importance sampling (VESPO).
    Vespo,
    /// prime-rl's default loss: the policy gradient through the importance ratio to the sampler's own
    /// log-probabilities, with the tokens whose probability moved past a trust region (DPPO's binary
    /// total-variation mask, by the advantage's sign) left out, plus a squared log-ratio penalty
    /// (Kimi K2.5's); token losses summed over the step's trained tokens as `dapo`'s.
    Dppo,
}

/// Where importance ratios are taken (TRL's `importance_sampling_level`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ImportanceSamplingLevel {
    /// One ratio per token.
    Token,
    /// One ratio per completion: the exponential of its mean token log-ratio (GSPO).
    Sequence,
}

/// How rewards are scaled into advantages (TRL's `scale_rewards`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleRewards {
    /// Divide by the standard deviation of the completion's group.
    Group,
    /// Divide by the standard deviation of the whole batch.
    Batch,
    /// Only subtract the group mean.
    None,
}

/// How several reward components become one advantage (TRL's `multi_objective_aggregation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MultiObjectiveAggregation {
    /// Weighted sum of the components, then normalized.
    SumThenNormalize,
    /// Each component normalized within its group, then the weighted sum normalized over the batch.
    NormalizeThenSum,
}

/// How a sampler whose log-probabilities differ from the trainer's is corrected (TRL's
/// `vllm_importance_sampling_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ImportanceSamplingMode {
    /// Per-token ratios clamped to `[clip_min, clip_max]`.
    TokenTruncate,
    /// Per-token ratios outside `[clip_min, clip_max]` set to 0.
    TokenMask,
    /// One ratio per completion (product over its tokens), clamped.
    SequenceTruncate,
    /// One ratio per completion, set to 0 outside the bounds.
    SequenceMask,
}

impl ImportanceSamplingMode {
    pub fn is_sequence(self) -> bool {
        matches!(self, Self::SequenceMask | Self::SequenceTruncate)
    }

    pub fn truncates(self) -> bool {
        matches!(self, Self::TokenTruncate | Self::SequenceTruncate)
    }
}

/// Every option of a training run; see the [module documentation](self). Field names are TRL's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GrpoConfig {
    /// The options every trainer has (transformers' `TrainingArguments`), flattened into this
    /// configuration's keys.
    #[serde(flatten, deserialize_with = "grpo_training")]
    pub training: TrainingArguments,

    // --- Length of the run, logging, checkpoints ---
    /// Seeds the data order; `seed` when unset.
    pub data_seed: Option<u64>,
    /// Shuffle the rows each epoch.
    pub shuffle_dataset: bool,
    /// Evaluate on the held-out rows every this many steps (and at the end); none without it.
    pub eval_steps: Option<u64>,
    /// Evaluate before the first step too.
    pub eval_on_start: bool,
    /// Print completions of each step (with `num_completions_to_print` of them) and keep them in the run.
    pub log_completions: bool,
    pub num_completions_to_print: Option<usize>,

    // --- Batches ---
    /// Micro-batches one generation is split into; `gradient_accumulation_steps` when unset.
    pub steps_per_generation: Option<usize>,
    /// Completions generated at once (`per_device_train_batch_size × steps_per_generation` when unset).
    pub generation_batch_size: Option<usize>,
    /// Rollouts per prompt (G).
    pub num_generations: usize,
    /// Rollouts per held-out prompt; `num_generations` when unset.
    pub num_generations_eval: Option<usize>,
    /// Optimizer passes over each generation batch (μ); above 1, ratios are taken against the
    /// log-probabilities of the weights that sampled.
    pub num_iterations: usize,
    /// The most tokens of one sample (caps each sampler tag's `max_tokens`).
    pub max_completion_length: usize,
    /// Activation recomputation: one layer's activations alive at a time in the backward pass (`--recompute`).
    pub gradient_checkpointing: bool,
    /// Bounded staleness (asynchronous GRPO): the generations sampled ahead of the one being trained,
    /// on a thread of their own, by a snapshot of the weights as they were when each was started (or by
    /// the rollout servers). A generation is started when the one `k` before it is taken up, so the
    /// weights that sample it are at most `k` generations older than those that train on it (`k`
    /// optimizer steps under TRL's default `steps_per_generation = gradient_accumulation_steps`); no
    /// generation is ever discarded. The sampler's log-probabilities are corrected for as a server's are
    /// (`vllm_importance_sampling_correction`). 0 is the synchronous loop.
    pub max_off_policy_steps: u64,
    /// Routing replay for mixture-of-experts models: the in-process sampler records the experts each
    /// token was routed to, and the trainer's passes route the same tokens through the same experts
    /// (the router's weights still computed and trained), so that the trained log-probabilities of
    /// sampled tokens are those of the experts that sampled them. `routing/replay_differ` reports how
    /// often the trainer's own router would have chosen otherwise.
    pub routing_replay: bool,
    /// The load-balancing loss of a mixture-of-experts model (transformers' `aux_loss`), added to the
    /// loss with this weight, divided by the micro-batches of a step, as TRL adds it
    /// (`router_aux_loss_coef`). Unset takes the model config's `router_aux_loss_coef` (0.001 for
    /// Qwen3-MoE and gpt-oss); 0 adds none; set on a model without experts, the run is refused.
    pub router_aux_loss_coef: Option<f64>,

    // --- Sampling ---
    pub temperature: f64,
    pub top_p: f64,
    /// 0 disables top-k.
    pub top_k: u32,
    /// Extra arguments of the model's chat template (transformers' `apply_chat_template(**kwargs)`), such
    /// as Qwen3's `enable_thinking`: a table in the TOML file, a JSON object on the command line
    /// (`--chat-template-kwargs '{"enable_thinking": false}'`).
    pub chat_template_kwargs: Option<ChatTemplateKwargs>,
    /// The format native tool calls are read in where a holoware leaves it open
    /// (`<|ToolSchema parser=auto|>`), by vLLM's `--tool-call-parser` names: `hermes`, `llama3_json`,
    /// `mistral` or `openai` (gpt-oss's harmony). Unset: the format the model's chat template writes.
    pub tool_call_parser: Option<String>,

    // --- The algorithm ---
    /// `grpo` (group-relative advantages, no value model) or `ppo` (a value model and GAE; its options
    /// are TRL's `PPOConfig`'s, below).
    pub algorithm: Algorithm,

    // --- The loss ---
    pub loss_type: LossType,
    pub importance_sampling_level: ImportanceSamplingLevel,
    pub scale_rewards: ScaleRewards,
    pub multi_objective_aggregation: MultiObjectiveAggregation,
    /// Weight of each reward component by name; a component not named keeps the weight the holoware
    /// gave it.
    pub reward_weights: Option<BTreeMap<String, f64>>,
    /// KL coefficient (k3 estimator, against a frozen copy of the starting weights).
    pub beta: f64,
    /// Lower clipping bound: ratios below `1 - epsilon` are clipped.
    pub epsilon: f64,
    /// Upper clipping bound (`epsilon` when unset); for `cispo`, the cap on the ratio itself.
    pub epsilon_high: Option<f64>,
    /// Two-sided clipping: ratios above `delta` are capped in the unclipped term too.
    pub delta: Option<f64>,
    /// Give completions that ran out of tokens no loss.
    pub mask_truncated_completions: bool,
    /// Entropy bonus: the loss minus this times the mean entropy of the trained tokens.
    pub entropy_coef: f64,
    /// Train only the tokens whose entropy is in this top fraction of the batch (1 trains all).
    pub top_entropy_quantile: f64,
    pub sapo_temperature_neg: f64,
    pub sapo_temperature_pos: f64,
    pub vespo_k_pos: f64,
    pub vespo_lambda_pos: f64,
    pub vespo_k_neg: f64,
    pub vespo_lambda_neg: f64,
    /// `dppo`: a token with a positive advantage is left out of the policy term when its probability
    /// rose above the sampler's by more than this (prime-rl's `dppo_mask_high`)...
    pub dppo_mask_high: f64,
    /// ... one with a negative advantage, when it fell below by more than this (`dppo_mask_low`).
    pub dppo_mask_low: f64,
    /// `dppo`: the advantages' weight (prime-rl's `adv_tau`).
    pub adv_tau: f64,
    /// `dppo`: the weight of the squared log-ratio to the sampler (prime-rl's `kl_tau`).
    pub kl_tau: f64,
    /// Drop completions with a negative advantage whose mean KL to the sampler exceeds this (off-policy
    /// sequence masking).
    pub off_policy_mask_threshold: Option<f64>,
    /// Multiply the KL term by the importance ratio.
    pub use_bias_correction_kl: bool,
    /// Correct for a sampler whose log-probabilities differ from the trainer's (a server, bf16 sampling).
    /// The trainer's own f32 model needs none and gets none.
    pub vllm_importance_sampling_correction: bool,
    pub vllm_importance_sampling_mode: ImportanceSamplingMode,
    pub vllm_importance_sampling_clip_max: Option<f64>,
    pub vllm_importance_sampling_clip_min: Option<f64>,

    // --- PPO (`algorithm = "ppo"`; TRL's `PPOConfig` names and defaults, [`super::ppo`]) ---
    /// Passes over each generation batch.
    pub num_ppo_epochs: usize,
    /// Mini-batches (one optimizer step each) per pass; each is `gradient_accumulation_steps`
    /// micro-batches of `per_device_train_batch_size` rollouts.
    pub num_mini_batches: usize,
    /// Weight of the per-token KL penalty to the reference model in the rewards.
    pub kl_coef: f64,
    pub kl_estimator: KlEstimator,
    /// Clipping of the policy ratio.
    pub cliprange: f64,
    /// Clipping of the value prediction around the value at sampling.
    pub cliprange_value: f64,
    /// Weight of the value loss.
    pub vf_coef: f64,
    /// GAE's discount.
    pub gamma: f64,
    /// GAE's λ.
    pub lam: f64,
    /// Whiten the per-token rewards over the batch before GAE.
    pub whiten_rewards: bool,
    /// Subtracted from the reward of a rollout that ran out of tokens.
    pub missing_eos_penalty: Option<f64>,
    /// The value model's folder (a causal LM, or a sequence classifier with one label whose `score`
    /// head is kept); unset: a copy of the policy with a new head.
    pub value_model: Option<String>,

    // --- Experiential RL (`hol/erl.hol`; erl-trainer's names where it has them) ---
    /// Train with ERL's semantics: each rollout's first trained context (the first attempt) is trained
    /// with the reward component `erl_first_reward`, its later ones (the reflection and the second attempt)
    /// with `erl_second_reward`; successful second attempts are distilled into the first prompt.
    pub erl: bool,
    /// 1: one joint GRPO loss, a row's first and second attempts normalized as one group; 2: two GRPO
    /// losses, first attempts normalized in their groups and second attempts over the batch, added with
    /// `erl_rl_coef`.
    pub erl_algorithm: u8,
    pub erl_first_reward: String,
    pub erl_second_reward: String,
    /// Weight of the reflection and second-attempt loss under `erl_algorithm = 2`.
    pub erl_rl_coef: f64,
    /// Keep reflections that led to a success in the run's memory (`<|Memory|>` reads it).
    pub enable_memory: bool,
    /// Reflections the memory keeps, oldest evicted first.
    pub memory_size: usize,
    /// Add the cross-entropy of successful second attempts under the first attempt's prompt.
    pub enable_internalization: bool,
    /// Weight of that cross-entropy.
    pub internalization_coef: f64,

    // --- Curriculum and dynamic sampling ([`super::curriculum`]) ---
    /// A numeric column of the training rows: its distinct values are levels, served lowest first.
    pub difficulty_column: Option<String>,
    /// Groups whose moving mean reward decides when a level advances.
    pub curriculum_window: usize,
    /// The moving mean reward (over the level's last `curriculum_window` groups) at which the next
    /// level starts.
    pub curriculum_threshold: f64,
    /// Serve the rows of every level reached so far (true), or the current level's only (false: a
    /// model trained on the hard rows alone can forget the easy ones).
    pub curriculum_cumulative: bool,
    /// DAPO's dynamic sampling: groups whose rewards are all equal are dropped and refilled with the
    /// groups of further rows.
    pub dynamic_sampling: bool,
    /// verl's `max_num_gen_batches`: the most draws (the first included) one generation batch may take
    /// under `dynamic_sampling`; then it is completed with dropped groups.
    pub max_num_gen_batches: usize,

    // --- Guard rails ([`super::guard`]) ---
    /// Stop when `eval/reward` has not improved for this many evaluations (transformers'
    /// `EarlyStoppingCallback`).
    pub early_stopping_patience: Option<u64>,
    /// The least rise of `eval/reward` that counts as an improvement.
    pub early_stopping_threshold: f64,
    /// Roll back when a step's `kl` exceeds this.
    pub rollback_kl: Option<f64>,
    /// Roll back when the moving mean training reward falls more than this below its best.
    pub rollback_reward_drop: Option<f64>,
    /// Generating steps the training reward's moving mean is taken over.
    pub rollback_window: usize,
    /// Each rollback multiplies the learning rate by this.
    pub rollback_lr_factor: f64,
    /// Rollbacks a run may take; the next trip stops it.
    pub max_rollbacks: u64,
    /// Say so when this many generating steps in a row had no group whose rewards differ
    /// (`frac_reward_zero_std` 1: every advantage is 0, nothing is learned); 0 never says.
    pub no_signal_steps: u64,
    /// End the run (saved, as early stopping ends it) when `no_signal_steps` is reached.
    pub stop_on_no_signal: bool,

    // --- Model-written code ---
    /// The `[sandbox]` table: limits of the sandbox that runs model-written code.
    pub sandbox: SandboxConfig,
}

/// The `[sandbox]` table of a training configuration: the limits of the [sandbox](holo_core::sandbox)
/// that `CodeExecutor` runs the model's code in. A `CodeExecutor` tag's own arguments (`timeout=10`)
/// override them for that tag.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxConfig {
    /// Wall-clock seconds per run.
    pub timeout: f64,
    /// CPU seconds per process.
    pub cpu_seconds: u64,
    /// MiB of address space per process.
    pub memory_mb: u64,
    /// Processes and threads at once.
    pub processes: u64,
    /// MiB: the largest file a process may write.
    pub file_size_mb: u64,
    /// Open files per process.
    pub open_files: u64,
    /// MiB of the writable work folder.
    pub work_size_mb: u64,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        let limits = holo_core::sandbox::Limits::default();
        SandboxConfig {
            timeout: limits.timeout.as_secs_f64(),
            cpu_seconds: limits.cpu_seconds,
            memory_mb: limits.memory >> 20,
            processes: limits.processes,
            file_size_mb: limits.file_size >> 20,
            open_files: limits.open_files,
            work_size_mb: limits.work_size >> 20,
        }
    }
}

impl SandboxConfig {
    /// The limits, checked.
    pub fn limits(&self) -> Result<holo_core::sandbox::Limits, String> {
        if !(self.timeout > 0.0 && self.timeout <= 86_400.0) {
            return Err(format!(
                "sandbox limit `timeout` must be a number of seconds above 0 (at most 86400), found {}",
                self.timeout
            ));
        }
        let limits = holo_core::sandbox::Limits {
            timeout: std::time::Duration::from_secs_f64(self.timeout),
            cpu_seconds: self.cpu_seconds,
            memory: self.memory_mb.saturating_mul(1 << 20),
            processes: self.processes,
            file_size: self.file_size_mb.saturating_mul(1 << 20),
            open_files: self.open_files,
            work_size: self.work_size_mb.saturating_mul(1 << 20),
        };
        limits.validate()?;
        Ok(limits)
    }
}

/// GRPOConfig's [`TrainingArguments`]: transformers' defaults with a learning rate of 1e-6.
fn grpo_training_defaults() -> TrainingArguments {
    TrainingArguments {
        learning_rate: 1e-6,
        ..TrainingArguments::default()
    }
}

fn grpo_training<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<TrainingArguments, D::Error> {
    TrainingArguments::deserialize_over(grpo_training_defaults(), deserializer)
}

impl Default for GrpoConfig {
    fn default() -> Self {
        GrpoConfig {
            training: grpo_training_defaults(),
            data_seed: None,
            shuffle_dataset: true,
            eval_steps: None,
            eval_on_start: false,
            log_completions: false,
            num_completions_to_print: None,
            steps_per_generation: None,
            generation_batch_size: None,
            num_generations: 8,
            num_generations_eval: None,
            num_iterations: 1,
            max_completion_length: 512,
            gradient_checkpointing: true,
            max_off_policy_steps: 0,
            routing_replay: false,
            router_aux_loss_coef: None,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            chat_template_kwargs: None,
            tool_call_parser: None,
            algorithm: Algorithm::Grpo,
            loss_type: LossType::Dapo,
            importance_sampling_level: ImportanceSamplingLevel::Token,
            scale_rewards: ScaleRewards::Group,
            multi_objective_aggregation: MultiObjectiveAggregation::SumThenNormalize,
            reward_weights: None,
            beta: 0.0,
            epsilon: 0.2,
            epsilon_high: None,
            delta: None,
            mask_truncated_completions: false,
            entropy_coef: 0.0,
            top_entropy_quantile: 1.0,
            num_ppo_epochs: 4,
            num_mini_batches: 1,
            kl_coef: 0.05,
            kl_estimator: KlEstimator::K1,
            cliprange: 0.2,
            cliprange_value: 0.2,
            vf_coef: 0.1,
            gamma: 1.0,
            lam: 0.95,
            whiten_rewards: false,
            missing_eos_penalty: None,
            value_model: None,
            erl: false,
            erl_algorithm: 1,
            erl_first_reward: "first".into(),
            erl_second_reward: "second".into(),
            erl_rl_coef: 1.0,
            enable_memory: true,
            memory_size: 50,
            enable_internalization: true,
            internalization_coef: 1.0,
            difficulty_column: None,
            curriculum_window: 16,
            curriculum_threshold: 0.8,
            curriculum_cumulative: true,
            dynamic_sampling: false,
            max_num_gen_batches: 10,
            early_stopping_patience: None,
            early_stopping_threshold: 0.0,
            rollback_kl: None,
            rollback_reward_drop: None,
            rollback_window: 8,
            rollback_lr_factor: 0.5,
            max_rollbacks: 3,
            no_signal_steps: 3,
            stop_on_no_signal: false,
            sapo_temperature_neg: 1.05,
            sapo_temperature_pos: 1.0,
            vespo_k_pos: 2.0,
            vespo_lambda_pos: 3.0,
            vespo_k_neg: 3.0,
            vespo_lambda_neg: 2.0,
            dppo_mask_high: 0.2,
            dppo_mask_low: 0.2,
            adv_tau: 1.0,
            kl_tau: 1e-3,
            off_policy_mask_threshold: None,
            use_bias_correction_kl: true,
            vllm_importance_sampling_correction: true,
            vllm_importance_sampling_mode: ImportanceSamplingMode::SequenceMask,
            vllm_importance_sampling_clip_max: Some(3.0),
            vllm_importance_sampling_clip_min: None,
            sandbox: SandboxConfig::default(),
        }
    }
}

/// The values of GRPO's enumerated options.
fn grpo_allowed_values(key: &str) -> Option<&'static [&'static str]> {
    Some(match key {
        "loss_type" => &[
            "grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo", "dppo",
        ],
        "importance_sampling_level" => &["token", "sequence"],
        "algorithm" => &["grpo", "ppo"],
        "kl_estimator" => &["k1", "k3"],
        "scale_rewards" => &["group", "batch", "none"],
        "multi_objective_aggregation" => &["sum_then_normalize", "normalize_then_sum"],
        "vllm_importance_sampling_mode" => &[
            "token_truncate",
            "token_mask",
            "sequence_truncate",
            "sequence_mask",
        ],
        _ => return shared_allowed_values(key),
    })
}

impl GrpoConfig {
    /// The format named by `tool_call_parser`, if set.
    pub fn tool_format(&self) -> Result<Option<ToolFormat>, ConfigError> {
        let Some(name) = &self.tool_call_parser else {
            return Ok(None);
        };
        match ToolFormat::from_name(name) {
            Some(format) => Ok(Some(format)),
            None => Err(error(
                "tool_call_parser",
                format!(
                    "unknown format `{name}`: hermes, llama3_json, mistral or openai (vLLM's names)"
                ),
            )),
        }
    }

    /// Completions generated at once.
    pub fn generation_batch_size(&self) -> usize {
        self.generation_batch_size
            .unwrap_or(self.training.per_device_train_batch_size * self.steps_per_generation())
    }

    /// Micro-batches one generation is split into.
    pub fn steps_per_generation(&self) -> usize {
        match (self.steps_per_generation, self.generation_batch_size) {
            (Some(steps), _) => steps,
            (None, Some(size)) => size / self.training.per_device_train_batch_size.max(1),
            (None, None) if self.algorithm == Algorithm::Ppo => {
                self.training.gradient_accumulation_steps * self.num_mini_batches
            }
            (None, None) => self.training.gradient_accumulation_steps,
        }
    }

    /// Prompts (data rows) per generation.
    pub fn prompts_per_generation(&self) -> usize {
        self.generation_batch_size() / self.num_generations.max(1)
    }

    pub fn epsilon_high(&self) -> f64 {
        self.epsilon_high.unwrap_or(self.epsilon)
    }

    pub fn num_generations_eval(&self) -> usize {
        self.num_generations_eval.unwrap_or(self.num_generations)
    }

    /// The data seed.
    pub fn data_seed(&self) -> u64 {
        self.data_seed.unwrap_or(self.training.seed)
    }

    /// Whether the run keeps a frozen reference model: GRPO's `beta` or PPO's `kl_coef` is not 0.
    pub fn uses_reference(&self) -> bool {
        match self.algorithm {
            Algorithm::Grpo => self.beta != 0.0,
            Algorithm::Ppo => self.kl_coef != 0.0,
        }
    }

    /// Whether a trip of `rollback_kl` or `rollback_reward_drop` rolls the run back.
    pub fn rolls_back(&self) -> bool {
        self.rollback_kl.is_some() || self.rollback_reward_drop.is_some()
    }

    /// The curriculum's, dynamic sampling's and the guard rails' options.
    fn validate_schedule(&self) -> Result<(), ConfigError> {
        if self
            .difficulty_column
            .as_ref()
            .is_some_and(|column| column.trim().is_empty())
        {
            return Err(error("difficulty_column", "must name a column of the rows"));
        }
        if self.curriculum_window == 0 {
            return Err(error("curriculum_window", "must be at least 1 group"));
        }
        if !self.curriculum_threshold.is_finite() {
            return Err(error("curriculum_threshold", "must be a finite number"));
        }
        if self.max_num_gen_batches == 0 {
            return Err(error(
                "max_num_gen_batches",
                "must be at least 1 (the first draw counts)",
            ));
        }
        if self.max_off_policy_steps > 0 {
            let refused = if self.algorithm == Algorithm::Ppo {
                Some("PPO's value model trains on each generation as it is sampled")
            } else if self.erl {
                Some("ERL's second attempts read a reflection memory that each generation's training commits")
            } else if self.rolls_back() {
                Some("a rollback would have to discard the generations sampled ahead of it")
            } else {
                None
            };
            if let Some(why) = refused {
                return Err(error(
                    "max_off_policy_steps",
                    format!("must be 0 here (synchronous): {why}"),
                ));
            }
        }
        if self.dynamic_sampling && self.erl {
            return Err(error(
                "dynamic_sampling",
                "cannot be combined with erl: ERL pools a row's first and second attempts into one group",
            ));
        }
        if let Some(patience) = self.early_stopping_patience {
            if patience == 0 {
                return Err(error("early_stopping_patience", "must be at least 1"));
            }
            if self.eval_steps.is_none() {
                return Err(error(
                    "early_stopping_patience",
                    "needs eval_steps: early stopping watches eval/reward",
                ));
            }
        }
        if !(self.early_stopping_threshold >= 0.0 && self.early_stopping_threshold.is_finite()) {
            return Err(error(
                "early_stopping_threshold",
                "must be a finite number of at least 0",
            ));
        }
        if let Some(bound) = self.rollback_kl {
            if !(bound > 0.0 && bound.is_finite()) {
                return Err(error("rollback_kl", "must be a finite number above 0"));
            }
            if !self.uses_reference() {
                return Err(error(
                    "rollback_kl",
                    "needs a reference model to measure the KL against: beta > 0 (GRPO) or kl_coef > 0 (PPO)",
                ));
            }
        }
        if let Some(drop) = self.rollback_reward_drop {
            if !(drop > 0.0 && drop.is_finite()) {
                return Err(error(
                    "rollback_reward_drop",
                    "must be a finite number above 0",
                ));
            }
        }
        if self.rollback_window == 0 {
            return Err(error("rollback_window", "must be at least 1 step"));
        }
        if !(self.rollback_lr_factor > 0.0 && self.rollback_lr_factor <= 1.0) {
            return Err(error("rollback_lr_factor", "must be in (0, 1]"));
        }
        if self.rolls_back() && self.training.save_strategy == SaveStrategy::No {
            return Err(error(
                "save_strategy",
                "must be \"steps\" with rollback_kl or rollback_reward_drop: a rollback restores a checkpoint",
            ));
        }
        if self.rolls_back() && self.training.save_only_model {
            return Err(error(
                "save_only_model",
                "must be false with rollback_kl or rollback_reward_drop: a rollback restores a checkpoint's optimizer state with its weights",
            ));
        }
        if self.rolls_back() && self.training.save_total_limit == Some(1) {
            return Err(error(
                "save_total_limit",
                "must be at least 2 with rollback_kl or rollback_reward_drop: the newest checkpoint holds the weights a trip blames, a rollback restores the one before",
            ));
        }
        Ok(())
    }
}

impl TrainingConfig for GrpoConfig {
    const NAME: &'static str = "GRPOConfig";
    const UNSET_KEYS: &'static [&'static str] = &[
        "data_seed",
        "memory_limit",
        "save_total_limit",
        "eval_steps",
        "num_completions_to_print",
        "steps_per_generation",
        "generation_batch_size",
        "num_generations_eval",
        "reward_weights",
        "chat_template_kwargs",
        "tool_call_parser",
        "epsilon_high",
        "delta",
        "off_policy_mask_threshold",
        "vllm_importance_sampling_clip_min",
        "lora_target_modules",
        "lora_target_parameters",
        "difficulty_column",
        "early_stopping_patience",
        "rollback_kl",
        "rollback_reward_drop",
        "missing_eos_penalty",
        "value_model",
        "router_aux_loss_coef",
    ];
    const RESUMABLE_KEYS: &'static [&'static str] = &[
        "save_steps",
        "memory_check",
        "memory_limit",
        "save_total_limit",
        "save_strategy",
        "save_only_model",
        "log_completions",
        "num_completions_to_print",
    ];

    fn allowed_values(key: &str) -> Option<&'static [&'static str]> {
        grpo_allowed_values(key)
    }

    fn training(&self) -> &TrainingArguments {
        &self.training
    }

    fn router_aux_loss_coef(&self) -> Option<f64> {
        self.router_aux_loss_coef
    }

    fn inert(&self) -> Vec<Inert> {
        let mut inert = self.training.inert();
        let mut add = |when: bool, keys: &'static [&'static str], reason: &'static str| {
            if when {
                inert.push(Inert { keys, reason });
            }
        };
        add(
            self.algorithm == Algorithm::Grpo,
            &[
                "num_ppo_epochs",
                "num_mini_batches",
                "kl_coef",
                "kl_estimator",
                "cliprange",
                "cliprange_value",
                "vf_coef",
                "gamma",
                "lam",
                "whiten_rewards",
                "missing_eos_penalty",
                "value_model",
            ],
            "PPO's options do nothing under `algorithm = \"grpo\"` (GRPO's KL weight is `beta`, its clip \
             `epsilon`); set algorithm = \"ppo\" to train with PPO",
        );
        add(
            self.algorithm == Algorithm::Grpo && self.beta == 0.0,
            &["use_bias_correction_kl"],
            "with `beta = 0` there is no KL term to correct",
        );
        add(
            self.loss_type != LossType::Sapo,
            &["sapo_temperature_neg", "sapo_temperature_pos"],
            "SAPO's temperatures do nothing unless `loss_type = \"sapo\"`",
        );
        add(
            self.loss_type != LossType::Vespo,
            &[
                "vespo_k_pos",
                "vespo_lambda_pos",
                "vespo_k_neg",
                "vespo_lambda_neg",
            ],
            "VESPO's options do nothing unless `loss_type = \"vespo\"`",
        );
        add(
            self.loss_type != LossType::Dppo,
            &["dppo_mask_high", "dppo_mask_low", "adv_tau", "kl_tau"],
            "prime-rl's options do nothing unless `loss_type = \"dppo\"`",
        );
        add(
            self.loss_type == LossType::Dppo,
            &[
                "epsilon",
                "epsilon_high",
                "delta",
                "importance_sampling_level",
                "vllm_importance_sampling_correction",
                "vllm_importance_sampling_mode",
                "vllm_importance_sampling_clip_max",
                "vllm_importance_sampling_clip_min",
                "off_policy_mask_threshold",
            ],
            "`loss_type = \"dppo\"` takes its token ratios to the sampler's own log-probabilities and \
             bounds them with `dppo_mask_low`/`dppo_mask_high`: TRL's clipping, sequence-level ratios and \
             importance-sampling correction do not apply",
        );
        add(
            !self.vllm_importance_sampling_correction && self.loss_type != LossType::Dppo,
            &[
                "vllm_importance_sampling_mode",
                "vllm_importance_sampling_clip_max",
                "vllm_importance_sampling_clip_min",
            ],
            "the importance-sampling correction's options do nothing without \
             `vllm_importance_sampling_correction = true`",
        );
        add(
            self.difficulty_column.is_none(),
            &["curriculum_window", "curriculum_threshold", "curriculum_cumulative"],
            "the curriculum's options do nothing without `difficulty_column` (the data column of levels)",
        );
        add(
            !self.dynamic_sampling,
            &["max_num_gen_batches"],
            "`max_num_gen_batches` bounds dynamic sampling; it does nothing without `dynamic_sampling = true`",
        );
        add(
            !self.erl,
            &[
                "erl_algorithm",
                "erl_first_reward",
                "erl_second_reward",
                "erl_rl_coef",
                "enable_internalization",
                "internalization_coef",
            ],
            "Experiential RL's options do nothing without `erl = true`",
        );
        add(
            !self.enable_memory,
            &["memory_size"],
            "`memory_size` does nothing with `enable_memory = false`",
        );
        add(
            self.early_stopping_patience.is_none(),
            &["early_stopping_threshold"],
            "`early_stopping_threshold` does nothing without `early_stopping_patience`",
        );
        add(
            self.rollback_kl.is_none() && self.rollback_reward_drop.is_none(),
            &["rollback_window", "rollback_lr_factor", "max_rollbacks"],
            "the rollback's options do nothing without `rollback_kl` or `rollback_reward_drop`",
        );
        add(
            self.no_signal_steps == 0,
            &["stop_on_no_signal"],
            "`stop_on_no_signal` does nothing with `no_signal_steps = 0`",
        );
        add(
            !self.log_completions,
            &["num_completions_to_print"],
            "`num_completions_to_print` does nothing without `log_completions = true`",
        );
        inert
    }

    /// One per step, or (PPO) one per mini-batch of each epoch of each update.
    fn optimizer_steps(&self, steps: u64) -> u64 {
        match self.algorithm {
            Algorithm::Grpo => steps,
            Algorithm::Ppo => steps * (self.num_ppo_epochs * self.num_mini_batches) as u64,
        }
    }

    /// Checks every value and the constraints between them (TRL's `__post_init__` and trainer checks).
    fn validate(&self) -> Result<(), ConfigError> {
        self.training.validate()?;
        self.validate_schedule()?;
        check_router_aux_loss_coef(self.router_aux_loss_coef)?;
        self.tool_format()?;
        self.sandbox
            .limits()
            .map_err(|message| error("sandbox", message))?;
        let positive = |key: &str, value: usize| {
            if value == 0 {
                Err(error(key, "must be at least 1"))
            } else {
                Ok(())
            }
        };
        positive("num_iterations", self.num_iterations)?;
        positive("max_completion_length", self.max_completion_length)?;
        if let Some(steps) = self.steps_per_generation {
            positive("steps_per_generation", steps)?;
        }
        if self.steps_per_generation.is_some() && self.generation_batch_size.is_some() {
            return Err(error(
                "generation_batch_size",
                "`generation_batch_size` and `steps_per_generation` cannot both be set",
            ));
        }
        if let Some(size) = self.generation_batch_size {
            if size == 0 || !size.is_multiple_of(self.training.per_device_train_batch_size) {
                return Err(error(
                    "generation_batch_size",
                    format!(
                        "must be a positive multiple of per_device_train_batch_size ({})",
                        self.training.per_device_train_batch_size
                    ),
                ));
            }
        }
        if self.algorithm == Algorithm::Ppo {
            validate_ppo(self)?;
        } else if self.num_generations < 2 {
            return Err(error(
                "num_generations",
                format!(
                    "GRPO needs at least 2 generations per prompt to compute advantages, got {}",
                    self.num_generations
                ),
            ));
        }
        if !self
            .generation_batch_size()
            .is_multiple_of(self.num_generations)
        {
            return Err(error(
                "num_generations",
                format!(
                    "the generation batch ({} completions = per_device_train_batch_size × steps_per_generation) must be divisible by num_generations ({})",
                    self.generation_batch_size(),
                    self.num_generations
                ),
            ));
        }
        if self.num_generations_eval == Some(0) {
            return Err(error("num_generations_eval", "must be at least 1"));
        }
        if self.eval_steps == Some(0) {
            return Err(error("eval_steps", "must be at least 1"));
        }
        let finite = |key: &str, value: f64| {
            if value.is_finite() {
                Ok(())
            } else {
                Err(error(key, "must be a finite number"))
            }
        };
        for (key, value) in [
            ("beta", self.beta),
            ("entropy_coef", self.entropy_coef),
            ("sapo_temperature_neg", self.sapo_temperature_neg),
            ("sapo_temperature_pos", self.sapo_temperature_pos),
            ("vespo_k_pos", self.vespo_k_pos),
            ("vespo_lambda_pos", self.vespo_lambda_pos),
            ("vespo_k_neg", self.vespo_k_neg),
            ("vespo_lambda_neg", self.vespo_lambda_neg),
        ] {
            finite(key, value)?;
        }
        for (key, value) in [
            ("dppo_mask_high", self.dppo_mask_high),
            ("dppo_mask_low", self.dppo_mask_low),
            ("adv_tau", self.adv_tau),
            ("kl_tau", self.kl_tau),
        ] {
            if !(value >= 0.0 && value.is_finite()) {
                return Err(error(key, "must be a finite number of at least 0"));
            }
        }
        if !matches!(self.erl_algorithm, 1 | 2) {
            return Err(error(
                "erl_algorithm",
                format!(
                    "must be 1 (one joint update) or 2 (two updates), got {}",
                    self.erl_algorithm
                ),
            ));
        }
        for (key, value) in [
            ("erl_rl_coef", self.erl_rl_coef),
            ("internalization_coef", self.internalization_coef),
        ] {
            if !(value >= 0.0 && value.is_finite()) {
                return Err(error(key, "must be a finite number of at least 0"));
            }
        }
        for (key, name) in [
            ("erl_first_reward", &self.erl_first_reward),
            ("erl_second_reward", &self.erl_second_reward),
        ] {
            if name.trim().is_empty() {
                return Err(error(key, "must name a reward component"));
            }
        }
        if self.erl_first_reward == self.erl_second_reward {
            return Err(error(
                "erl_second_reward",
                "must differ from erl_first_reward: the two attempts are scored apart",
            ));
        }
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            return Err(error(
                "temperature",
                "must be above 0 (training needs the log-probabilities of a sampling distribution)",
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(error("top_p", "must be in (0, 1]"));
        }
        if self.beta < 0.0 {
            return Err(error("beta", "must be at least 0"));
        }
        if !(self.epsilon >= 0.0 && self.epsilon.is_finite()) {
            return Err(error("epsilon", "must be a finite number at least 0"));
        }
        if let Some(high) = self.epsilon_high {
            if !(high >= 0.0 && high.is_finite()) {
                return Err(error("epsilon_high", "must be a finite number at least 0"));
            }
        }
        if let Some(delta) = self.delta {
            if !(delta > 1.0 && delta.is_finite()) {
                return Err(error("delta", "must be above 1 (it caps the ratio)"));
            }
        }
        if !(self.top_entropy_quantile > 0.0 && self.top_entropy_quantile <= 1.0) {
            return Err(error("top_entropy_quantile", "must be in (0, 1]"));
        }
        if let Some(weights) = &self.reward_weights {
            if let Some((name, _)) = weights.iter().find(|(_, weight)| !weight.is_finite()) {
                return Err(error(
                    "reward_weights",
                    format!("the weight of {name:?} is not finite"),
                ));
            }
        }
        if let (Some(low), Some(high)) = (
            self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max,
        ) {
            if low >= high {
                return Err(error(
                    "vllm_importance_sampling_clip_min",
                    format!("must be below vllm_importance_sampling_clip_max ({high})"),
                ));
            }
        }
        if self.vllm_importance_sampling_correction
            && self.vllm_importance_sampling_mode.truncates()
            && self.vllm_importance_sampling_clip_min.is_none()
            && self.vllm_importance_sampling_clip_max.is_none()
        {
            return Err(error(
                "vllm_importance_sampling_mode",
                "the truncate modes need vllm_importance_sampling_clip_min or vllm_importance_sampling_clip_max",
            ));
        }
        Ok(())
    }
}

/// Which algorithm trains the policy (`algorithm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Group-relative advantages, no value model ([`crate::advantages`], [`crate::loss`]).
    Grpo,
    /// A value model and GAE ([`crate::ppo`]).
    Ppo,
}

/// The estimator of the KL penalty in PPO's rewards (TRL's `kl_estimator`; see
/// <http://joschu.net/blog/kl-approx.html>).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlEstimator {
    /// `log π − log π_ref`: unbiased.
    K1,
    /// `(r − 1) − log r`, `r = π_ref / π`: unbiased, lower variance, never negative.
    K3,
}

/// Checks PPO's options and what PPO changes in the others.
fn validate_ppo(config: &GrpoConfig) -> Result<(), ConfigError> {
    for (key, value) in [
        ("num_ppo_epochs", config.num_ppo_epochs),
        ("num_mini_batches", config.num_mini_batches),
        ("num_generations", config.num_generations),
    ] {
        if value == 0 {
            return Err(error(key, "must be at least 1"));
        }
    }
    for (key, value) in [
        ("kl_coef", config.kl_coef),
        ("cliprange", config.cliprange),
        ("cliprange_value", config.cliprange_value),
        ("vf_coef", config.vf_coef),
    ] {
        if !(value >= 0.0 && value.is_finite()) {
            return Err(error(key, "must be a finite number of at least 0"));
        }
    }
    for (key, value) in [("gamma", config.gamma), ("lam", config.lam)] {
        if !(0.0..=1.0).contains(&value) {
            return Err(error(key, "must be in [0, 1]"));
        }
    }
    if let Some(penalty) = config.missing_eos_penalty {
        if !(penalty >= 0.0 && penalty.is_finite()) {
            return Err(error(
                "missing_eos_penalty",
                "must be a finite number of at least 0 (it is subtracted)",
            ));
        }
    }
    if config
        .value_model
        .as_ref()
        .is_some_and(|dir| dir.trim().is_empty())
    {
        return Err(error("value_model", "must name a model folder"));
    }
    if config.num_iterations != 1 {
        return Err(error(
            "num_iterations",
            "is GRPO's; PPO passes over each batch num_ppo_epochs times",
        ));
    }
    let batch = config.training.per_device_train_batch_size
        * config.training.gradient_accumulation_steps
        * config.num_mini_batches;
    if config.generation_batch_size() != batch {
        return Err(error(
            if config.generation_batch_size.is_some() {
                "generation_batch_size"
            } else {
                "steps_per_generation"
            },
            format!(
                "PPO's batch is per_device_train_batch_size × gradient_accumulation_steps × num_mini_batches = {batch} rollouts; leave generation_batch_size and steps_per_generation unset"
            ),
        ));
    }
    if config.erl {
        return Err(error("erl", "ERL trains with GRPO (algorithm = \"grpo\")"));
    }
    if config.dynamic_sampling && config.num_generations < 2 {
        return Err(error(
            "dynamic_sampling",
            "needs num_generations ≥ 2: it drops groups whose rewards are all equal",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_call_parser_names_a_format_holowares_read() {
        let with = |name: &str| GrpoConfig {
            tool_call_parser: Some(name.into()),
            ..GrpoConfig::default()
        };
        assert_eq!(GrpoConfig::default().tool_format(), Ok(None));
        assert_eq!(with("hermes").tool_format(), Ok(Some(ToolFormat::Hermes)));
        assert_eq!(
            with("llama3_json").tool_format(),
            Ok(Some(ToolFormat::Llama3Json))
        );
        assert_eq!(with("mistral").tool_format(), Ok(Some(ToolFormat::Mistral)));
        assert_eq!(with("openai").tool_format(), Ok(Some(ToolFormat::Harmony)));
        let error = with("qwen").validate().unwrap_err();
        assert_eq!(error.key.as_deref(), Some("tool_call_parser"));
        assert!(error.message.contains("unknown format `qwen`"), "{error}");
    }
}
