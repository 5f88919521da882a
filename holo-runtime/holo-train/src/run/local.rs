//! The model folder trained in process ([`Policy`]), the weights a run trains and their optimizer
//! ([`Trainable`]), and the run folder opened onto them ([`open`], [`restore`]): the candle side of
//! [`super`], which the local backend and SFT use.

use std::path::{Path, PathBuf};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use tokenizers::Tokenizer;

use super::{check_same_config, open_with, Opened, TrainError};
use crate::checkpoint::{self, RunDir, TrainerState, Weights};
use crate::config::TrainingConfig;
use crate::export::RunInfo;
use crate::optim::{self, AdamW};
use crate::ppo::critic::Critic;
use holo_core::chat::ChatTemplate;
use holo_model::model::Targets;
use holo_model::{dispatch, files as model_files, Model};

/// A model folder loaded for training: weights in a training precision (by default the device's,
/// [`dispatch::training_dtype`]: f32 on the CPU, bf16 on CUDA), tokenizer, chat template.
pub struct Policy {
    pub dir: PathBuf,
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    pub end_of_turn: Vec<u32>,
}

impl Policy {
    /// Loads `dir` on `device` in its training precision.
    pub fn load(dir: &Path, device: &Device) -> Result<Self, TrainError> {
        Policy::load_as(dir, device, dispatch::training_dtype(device.location()))
    }

    /// Loads `dir` on `device` with weights of type `dtype`: f32, or bf16 (whose gradients are bf16 too;
    /// AdamW updates them through f32 master copies; LoRA adapters stay f32, [`dispatch::adapter_dtype`]).
    pub fn load_as(dir: &Path, device: &Device, dtype: DType) -> Result<Self, TrainError> {
        let fail = |error: model_files::LoadError| {
            TrainError::Input(format!("--model `{}`: {error}", dir.display()))
        };
        let model = model_files::load_model(dir, dtype, device).map_err(fail)?;
        Policy::with_model(dir, model)
    }

    /// Loads the GGUF file `dir` in f32 on the CPU with its layers' projections kept as the file's
    /// quantized blocks ([`holo_model::gguf::Blocks::Keep`]): a frozen base that LoRA trains over
    /// (QLoRA; full fine-tuning refuses it) and that the in-process sampler samples from as `--quantized`
    /// sampling does.
    pub fn load_quantized(dir: &Path, device: &Device) -> Result<Self, TrainError> {
        if !holo_model::gguf::is_gguf(dir) {
            return Err(TrainError::Input(format!(
                "--quantized keeps a GGUF file's blocks, and `{}` is not a `.gguf` file",
                dir.display()
            )));
        }
        let model = holo_model::gguf::load_quantized(dir, DType::F32, device)
            .map_err(|error| TrainError::Input(format!("--model `{}`: {error}", dir.display())))?;
        Policy::with_model(dir, model)
    }

    /// The policy of `model`, loaded from `dir`, with `dir`'s tokenizer and chat template.
    fn with_model(dir: &Path, model: Model) -> Result<Self, TrainError> {
        let fail = |error: model_files::LoadError| {
            TrainError::Input(format!("--model `{}`: {error}", dir.display()))
        };
        let tokenizer = model_files::load_tokenizer(dir).map_err(fail)?;
        let template = model_files::load_template(dir).map_err(fail)?;
        let end_of_turn = model_files::end_of_turn_ids(dir, &model.config, &tokenizer, &template)
            .map_err(fail)?;
        Ok(Policy {
            dir: dir.to_path_buf(),
            model,
            tokenizer,
            template,
            end_of_turn,
        })
    }
}

/// The weights a run trains (every weight, or LoRA adapters beside the frozen base), and their optimizer.
pub struct Trainable {
    /// The model whose trained weights are [`Var`]s.
    pub model: Model,
    /// The trained weights or adapters, by name.
    pub vars: Vec<(String, Var)>,
    pub optimizer: AdamW,
    /// PEFT's `adapter_config.json` of a LoRA run.
    adapter_config: Option<serde_json::Value>,
    /// The base model folder, as an absolute path (written in the run for `holo export`).
    pub model_dir: PathBuf,
    /// PPO's value model, trained by the same optimizer ([`Trainable::with_critic`]).
    pub critic: Option<Critic>,
    /// The load-balancing loss's weight for a mixture-of-experts model (`router_aux_loss_coef`, or the
    /// model config's); 0 without experts.
    pub router_aux_loss_coef: f64,
}

/// The modules that LoRA adapters `vars` (PEFT's names) adapt, by their short names, in module order.
fn adapted_modules(vars: &[(String, Var)]) -> Vec<String> {
    let mut modules: Vec<String> = Vec::new();
    for (name, _) in vars {
        let module = name.split(".lora_").next().unwrap_or(name);
        // The experts' and routers' adapters are PEFT's `target_parameters`, not modules.
        if module.contains(".mlp.experts")
            || module.ends_with(".mlp.gate")
            || module.ends_with(".mlp.router")
        {
            continue;
        }
        let short = module.rsplit('.').next().unwrap_or(module).to_string();
        if !modules.contains(&short) {
            modules.push(short);
        }
    }
    modules
}

/// The prefix of the value model's weights among the optimizer's parameters.
const CRITIC_PREFIX: &str = "value_model.";

impl Trainable {
    /// The weights of `base` (loaded from `dir`) that `config` trains: every weight, or LoRA adapters when
    /// `use_peft`.
    pub fn new(base: &Model, dir: &Path, config: &impl TrainingConfig) -> Result<Self, TrainError> {
        // As TRL: the option, or the model config's own coefficient; `output_router_logits` is not
        // read (TRL turns it on for training whenever the coefficient is not 0).
        let router_aux_loss_coef = match (base.config.experts, config.router_aux_loss_coef()) {
            (Some(experts), coef) => coef.unwrap_or(experts.aux_loss_coef),
            (None, Some(coef)) if coef != 0.0 => {
                return Err(TrainError::Input(format!(
                "`router_aux_loss_coef` is {coef}, but `{}` is not a mixture-of-experts model, so \
                     there is no load-balancing loss to weigh; leave it unset",
                dir.display()
            )))
            }
            (None, _) => 0.0,
        };
        let model_dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        let (model, vars, adapter_config) = match config.training().lora() {
            Some(lora) => {
                let (model, vars) = base.with_lora(&lora)?;
                let mut adapter =
                    checkpoint::adapter_config(config, &model_dir.display().to_string());
                // PEFT names the modules adapted, which for a fused model are not the targets asked
                // for (Phi-3's `qkv_proj` for `q_proj`), and writes its configuration as it resolved
                // it: on Qwen3-MoE the experts' and router's module names as target parameters, with
                // the fused stack's rank and alpha in the patterns.
                // A regular expression PEFT writes as it is (on a fused mixture it has become the
                // names it matched).
                let resolved = base.resolved_lora(&lora)?;
                adapter["target_modules"] = match &resolved.targets {
                    Targets::Regex(regex) => regex.clone().into(),
                    Targets::Names(_) => adapted_modules(&vars).into(),
                };
                if !resolved.parameters.is_empty() {
                    adapter["target_parameters"] = resolved.parameters.into();
                }
                adapter["rank_pattern"] = serde_json::json!(resolved.rank_pattern);
                adapter["alpha_pattern"] = serde_json::json!(resolved.alpha_pattern);
                (model, vars, Some(adapter))
            }
            None => {
                let (model, vars) = base.trainable()?;
                (model, vars, None)
            }
        };
        let optimizer = AdamW::new(vars.clone(), config);
        Ok(Trainable {
            model,
            vars,
            optimizer,
            adapter_config,
            model_dir,
            critic: None,
            router_aux_loss_coef,
        })
    }

    /// Trains `critic` beside the policy: one optimizer over both (one gradient norm, as TRL's PPO
    /// optimizes the policy and the value model as one module); checkpoints hold its weights in
    /// `value_model.safetensors`.
    pub fn with_critic(mut self, critic: Critic, config: &impl TrainingConfig) -> Self {
        let params = self
            .vars
            .iter()
            .cloned()
            .chain(
                critic
                    .vars
                    .iter()
                    .map(|(name, var)| (format!("{CRITIC_PREFIX}{name}"), var.clone())),
            )
            .collect();
        self.optimizer = AdamW::new(params, config);
        self.critic = Some(critic);
        self
    }

    /// One gradient slot per optimized weight, empty.
    pub fn no_grads(&self) -> Vec<Option<Tensor>> {
        vec![None; self.optimizer.params().len()]
    }

    /// Adds a micro-batch's gradients (`store`) to `sums`.
    pub fn accumulate(
        &self,
        sums: &mut [Option<Tensor>],
        store: &GradStore,
    ) -> candle_core::Result<()> {
        for ((_, var), slot) in self.optimizer.params().iter().zip(sums.iter_mut()) {
            if let Some(grad) = store.get(var.as_tensor()) {
                *slot = Some(match slot.take() {
                    Some(sum) => (sum + grad)?,
                    None => grad.clone(),
                });
            }
        }
        Ok(())
    }

    /// The optimizer step that follows `completed` of `total`: `grads` clipped to `max_grad_norm`, one
    /// AdamW update at the scheduled learning rate. Returns the gradients' norm before clipping and the
    /// learning rate.
    pub fn step(
        &mut self,
        grads: &[Option<Tensor>],
        config: &impl TrainingConfig,
        completed: u64,
        total: u64,
        lr_factor: f64,
    ) -> candle_core::Result<(f64, f64)> {
        let grad_norm = optim::grad_norm(grads)?;
        let clip = optim::clip_coefficient(grad_norm, config.training().max_grad_norm);
        let learning_rate = optim::learning_rate(config, completed, total) * lr_factor;
        self.optimizer.step(grads, learning_rate, clip)?;
        Ok((grad_norm, learning_rate))
    }

    /// The trained weights as a checkpoint writes them: every weight, or LoRA adapters with PEFT's
    /// `adapter_config.json`.
    pub fn weights(&self) -> Weights<'_> {
        match &self.adapter_config {
            Some(adapter_config) => Weights::Adapters {
                vars: &self.vars,
                adapter_config: adapter_config.clone(),
            },
            None => Weights::Full(&self.vars),
        }
    }

    /// Writes the checkpoint of `state` (weights or adapters, the optimizer's moments, the state and the
    /// configuration), keeping the newest `save_total_limit`.
    pub fn save(
        &self,
        run: &RunDir,
        state: &TrainerState,
        config: &impl TrainingConfig,
    ) -> Result<PathBuf, TrainError> {
        let weights = self.weights();
        let training = config.training();
        Ok(checkpoint::save(
            run,
            &weights,
            self.critic.as_ref().map(|critic| critic.vars.as_slice()),
            (!training.save_only_model).then(|| self.optimizer.state()),
            state,
            config,
            config.training().save_total_limit,
        )?)
    }
}

/// Opens the run folder: a new run (refusing a folder that holds one; `config.toml` and `run.json` are
/// written), or, with `resume`, the newest checkpoint of the run in it, made with the same configuration,
/// whose weights and optimizer state are restored into `trainable`.
/// Checkpoints beyond `save_total_limit` that a kill left are removed on resume.
pub fn open<C: TrainingConfig>(
    run: &RunDir,
    resume: bool,
    config: &C,
    trainable: &mut Trainable,
) -> Result<Opened, TrainError> {
    let model = trainable.model_dir.clone();
    let opened = open_with(
        run,
        resume,
        config,
        |dir| RunInfo { model }.write(dir),
        |newest| restore(newest, config, trainable, &run.path),
    )?;
    if opened.resumed {
        // A run killed between a save and the removal of the oldest checkpoint left one more than
        // `save_total_limit`, which a resumed run with no step left to save would keep.
        run.prune(config.training().save_total_limit)?;
    }
    Ok(opened)
}

/// Restores the checkpoint in `checkpoint_dir` of the run in `run_dir` into `trainable` (its weights
/// and the optimizer's moments), refusing one made with another configuration (naming the first key
/// that differs). Returns its state.
pub fn restore<C: TrainingConfig>(
    checkpoint_dir: &Path,
    config: &C,
    trainable: &mut Trainable,
    run_dir: &Path,
) -> Result<TrainerState, TrainError> {
    let loaded = checkpoint::load::<C>(checkpoint_dir).map_err(TrainError::Input)?;
    check_same_config(config, &loaded.config, run_dir)?;
    checkpoint::restore(&trainable.vars, &loaded.weights).map_err(TrainError::Input)?;
    if let Some(critic) = &trainable.critic {
        let saved = loaded.critic.as_ref().ok_or_else(|| {
            TrainError::Input(format!(
                "{}: no value_model.safetensors (the run's value model)",
                checkpoint_dir.display()
            ))
        })?;
        checkpoint::restore(&critic.vars, saved).map_err(TrainError::Input)?;
    }
    let optimizer = loaded.optimizer.as_ref().ok_or_else(|| {
        TrainError::Input(format!(
            "{}: the checkpoint holds the weights without the optimizer's state (it was saved with \
             `save_only_model = true`), so the run cannot go on exactly from it; start a new run from \
             its weights instead",
            checkpoint_dir.display()
        ))
    })?;
    trainable
        .optimizer
        .load_state(config.optimizer_steps(loaded.state.global_step), optimizer)?;
    Ok(loaded.state)
}
