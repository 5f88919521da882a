//! LoRA adapters put on a model ([`Model::with_lora`]) where PEFT 0.21 puts them: the projections a
//! [`LoraConfig`] targets, the expert stacks and routers it names as target parameters, each at the
//! rank and alpha its patterns give, under PEFT's tensor names; and on the output head when `lm_head` is
//! a target module (never under `"all-linear"`, which leaves the head out as PEFT's does). On a model
//! whose head is tied to its embeddings, the adapter is on the head's product only, as PEFT's wrapped
//! `lm_head` is: the input embeddings stay the base ones.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use rand::{Rng, SeedableRng};

use super::*;
use crate::config::Arch;

/// PEFT's key of the output head's module, and the target module that names it.
const HEAD: &str = "lm_head";

/// PEFT's key of the input embeddings' module.
const EMBEDDINGS: &str = "model.embed_tokens";

/// What a target parameter names in a mixture layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Parameter {
    Stack(ExpertStack),
    /// The router's weight (`mlp.gate.weight`, gpt-oss's `mlp.router.weight`), adapted as PEFT's
    /// `ParamWrapper` adapts a matrix: `W + scale · B A`, which is LoRA on the router's product.
    Router,
}

impl Model {
    /// `config` as PEFT resolves it on this model ([`LoraConfig::resolved`]): `"all-linear"` as the
    /// model's projections, and a fused mixture's module names (a regular expression's, by
    /// [`LoraConfig::named`]) as target parameters. What the adapters of [`Model::with_lora`] are, and
    /// what `adapter_config.json` says of them.
    pub fn resolved_lora(&self, config: &LoraConfig) -> Result<LoraConfig> {
        let (modules, parameters) = self.peft_names();
        config
            .named(self.config.arch, &modules, &parameters)
            .resolved(self.config.arch, &self.projection_names())
            .map_err(candle_core::Error::Msg)
    }

    /// PEFT's names of what LoRA can adapt here: the modules (each layer's projections and router, and
    /// the output head) and the parameters (a mixture's expert stacks and router weight).
    fn peft_names(&self) -> (Vec<String>, Vec<String>) {
        let mut modules = Vec::new();
        let mut parameters = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            for (name, _) in Self::linears(layer) {
                if !name.starts_with("mlp.experts.") {
                    modules.push(format!("model.layers.{i}.{name}"));
                }
            }
            if let FeedForward::Experts(_) = &layer.mlp {
                for stack in ExpertStack::ALL {
                    parameters.push(format!("model.layers.{i}.mlp.experts.{}", stack.name()));
                }
                parameters.push(format!(
                    "model.layers.{i}.mlp.{}.weight",
                    self.router_name()
                ));
            }
        }
        modules.push(HEAD.to_string());
        (modules, parameters)
    }

    /// The short names of the projections LoRA can adapt by module name (not a mixture's router or
    /// experts), in layer order.
    fn projection_names(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for layer in &self.layers {
            for (name, _) in Self::linears(layer)
                .into_iter()
                .filter(|(name, _)| adaptable(name))
            {
                let short = name.rsplit('.').next().unwrap_or(&name).to_string();
                if !names.contains(&short) {
                    names.push(short);
                }
            }
        }
        names
    }

    /// A copy with LoRA adapters on the target projections of every layer, on the target expert stacks
    /// of every mixture ([`ExpertLora`]) and on its router where the target parameters name them, as
    /// PEFT resolves `config` ([`Model::resolved_lora`]), and its base weights frozen (detached); returns
    /// the adapters' [`Var`]s under PEFT's names. Each adapter takes its rank and alpha from the
    /// patterns where a key matches its PEFT name ([`LoraConfig::size_at`]). `A` is drawn as PEFT does
    /// (Kaiming-uniform, bound `1/sqrt(in)`), `B` is zero; both in f32 over a bf16 or f16 base
    /// ([`dispatch::adapter_dtype`]).
    pub fn with_lora(&self, config: &LoraConfig) -> Result<(Model, Vec<(String, Var)>)> {
        let config = &self.resolved_lora(config)?;
        if config.rank == 0 || config.rank_pattern.entries().iter().any(|(_, r)| *r == 0) {
            candle_core::bail!("LoRA rank must be at least 1");
        }
        config
            .targets
            .check()
            .and_then(|()| config.rank_pattern.check())
            .and_then(|()| config.alpha_pattern.check())
            .map_err(candle_core::Error::Msg)?;
        if !(0.0..1.0).contains(&config.dropout) {
            candle_core::bail!("LoRA dropout must be in [0, 1), got {}", config.dropout);
        }
        self.check_targets(config)?;
        let parameters = self.target_parameters(config)?;
        self.sampling_only(false)?;
        let mut model = self.detached();
        // A GGUF file's head blocks serve sampling only; the trained model's logits, sampled or not,
        // come from the dense head (the tied embeddings, or `lm_head`) its adapter adapts, so that the
        // sampler and the trainer score tokens alike.
        model.quantized_head = None;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(config.seed);
        let (dtype, device) = (dispatch::adapter_dtype(self.dtype()), self.device().clone());
        // PEFT's `nn.Linear(in, rows)` for A: Kaiming-uniform, bound 1/sqrt(in).
        let mut draw = |rows: usize, in_dim: usize| -> Result<Var> {
            let bound = 1.0 / (in_dim as f64).sqrt();
            let a: Vec<f32> = (0..rows * in_dim)
                .map(|_| rng.random_range(-bound..bound) as f32)
                .collect();
            Var::from_tensor(&Tensor::from_vec(a, (rows, in_dim), &device)?.to_dtype(dtype)?)
        };
        let size = |key: &str| config.size_at(key).map_err(candle_core::Error::Msg);
        let mut vars = Vec::new();
        let seed = Arc::new(AtomicU64::new(0));
        for (i, layer) in model.layers.iter_mut().enumerate() {
            for (name, linear) in Self::linears_mut(&mut layer.mixer, &mut layer.mlp) {
                let key = format!("model.layers.{i}.{name}");
                let router = ["mlp.gate", "mlp.router"].contains(&name.as_str());
                let adapted = match router {
                    true => parameters.contains(&Parameter::Router),
                    false => adaptable(&name) && targets(&config.targets, &key),
                };
                if !adapted {
                    continue;
                }
                // PEFT's key of a parameter is its own name, of a module the module's.
                let (rank, alpha) = match router {
                    true => size(&format!("{key}.weight"))?,
                    false => size(&key)?,
                };
                let &[out_dim, in_dim] = linear.weight.dims() else {
                    candle_core::bail!("{key} is not a matrix");
                };
                let a = draw(rank, in_dim)?;
                let b = Var::zeros((out_dim, rank), dtype, &device)?;
                let prefix = format!("base_model.model.{key}");
                linear.lora = Some(Lora {
                    a: a.as_tensor().clone(),
                    b: b.as_tensor().clone(),
                    scale: alpha / rank as f64,
                    // PEFT's adapters on parameters take no dropout (refused above when asked).
                    dropout: (config.dropout > 0.0 && !router).then(|| Dropout {
                        p: config.dropout,
                        id: vars.len() as u64,
                        seed: Arc::clone(&seed),
                    }),
                });
                vars.push((format!("{prefix}.lora_A.weight"), a));
                vars.push((format!("{prefix}.lora_B.weight"), b));
            }
            let FeedForward::Experts(mixture) = &mut layer.mlp else {
                continue;
            };
            let count = mixture.experts.len();
            let Some(expert) = mixture.experts.first() else {
                continue;
            };
            let &[hidden, inner] = expert.down_proj.weight.dims() else {
                candle_core::bail!("layer {i}'s experts are not matrices");
            };
            let stacks: Vec<ExpertStack> = ExpertStack::ALL
                .into_iter()
                .filter(|stack| parameters.contains(&Parameter::Stack(*stack)))
                .collect();
            for (&stack, prefix) in stacks.iter().zip(expert_prefixes(i, stacks.len())) {
                let (in_dim, out_dim) = match stack {
                    ExpertStack::GateUp => (hidden, 2 * inner),
                    ExpertStack::Down => (inner, hidden),
                };
                let (rank, alpha) =
                    size(&format!("model.layers.{i}.mlp.experts.{}", stack.name()))?;
                let a = draw(count * rank, in_dim)?;
                let b = Var::zeros((out_dim, rank * count), dtype, &device)?;
                mixture.adapters.push(ExpertLora {
                    stack,
                    a: a.as_tensor().clone(),
                    b: b.as_tensor().clone(),
                    scale: alpha / rank as f64,
                });
                vars.push((format!("{prefix}.lora_A.weight"), a));
                vars.push((format!("{prefix}.lora_B.weight"), b));
            }
        }
        if targets(&config.targets, HEAD) {
            let (rank, alpha) = size(HEAD)?;
            let (vocab, hidden) = model.head_weight().dims2()?;
            let a = draw(rank, hidden)?;
            let b = Var::zeros((vocab, rank), dtype, &device)?;
            model.head_lora = Some(Lora {
                a: a.as_tensor().clone(),
                b: b.as_tensor().clone(),
                scale: alpha / rank as f64,
                dropout: (config.dropout > 0.0).then(|| Dropout {
                    p: config.dropout,
                    id: vars.len() as u64,
                    seed: Arc::clone(&seed),
                }),
            });
            vars.push((format!("{HEAD_ADAPTER}.lora_A.weight"), a));
            vars.push((format!("{HEAD_ADAPTER}.lora_B.weight"), b));
        }
        Ok((model, vars))
    }

    /// An error naming a target module that adapts no projection of this model.
    fn check_targets(&self, config: &LoraConfig) -> Result<()> {
        let keys: Vec<String> = self
            .layers
            .iter()
            .enumerate()
            .flat_map(|(i, layer)| {
                Self::linears(layer)
                    .into_iter()
                    .filter(|(name, _)| adaptable(name))
                    .map(move |(name, _)| format!("model.layers.{i}.{name}"))
            })
            .chain([HEAD.to_string()])
            .collect();
        let names = match &config.targets {
            Targets::Names(names) => names,
            // PEFT's words when nothing matches.
            Targets::Regex(regex) if !keys.iter().any(|key| config.targets.matches(key)) => {
                candle_core::bail!(
                    "Target modules {regex:?} not found in the base model: the regular expression \
                     matches the whole name of none of this {} model's projections ({}, …, {HEAD})",
                    self.config.arch,
                    keys[0]
                )
            }
            // PEFT adapts an embedding layer the expression matches; the loader adapts none.
            Targets::Regex(regex) if config.targets.matches(EMBEDDINGS) => {
                candle_core::bail!(
                    "the LoRA target modules {regex:?} match the input embeddings \
                     ({EMBEDDINGS}), which PEFT adapts and this loader does not; leave them out"
                )
            }
            Targets::Regex(_) => return Ok(()),
        };
        let Some(unknown) = names.iter().find(|&name| {
            !keys
                .iter()
                .any(|key| targets(&Targets::names(&[name]), key))
        }) else {
            return Ok(());
        };
        if self.config.experts.is_some()
            && [
                "gate_proj",
                "up_proj",
                "down_proj",
                "gate_up_proj",
                "gate",
                "router",
            ]
            .iter()
            .any(|mlp| unknown == mlp || unknown.ends_with(&format!(".{mlp}")))
        {
            candle_core::bail!(
                "LoRA target module {unknown:?} on this {} model: its experts are stacked \
                 parameters and its router no linear module, so PEFT wraps no module by that name; \
                 adapt them with target parameters (mlp.experts.gate_up_proj, mlp.experts.down_proj, \
                 mlp.{}.weight) and the attention with target modules (q_proj, k_proj, v_proj, o_proj)",
                self.config.arch,
                self.router_name()
            );
        }
        candle_core::bail!(
            "unknown LoRA target {unknown:?}; the projections of this {} model are {} (and the \
             output head, lm_head)",
            self.config.arch,
            self.projection_names().join(", ")
        );
    }

    /// What `config`'s target parameters name, each once; an error for a name that is none of them,
    /// on a model without experts, and beside dropout.
    fn target_parameters(&self, config: &LoraConfig) -> Result<Vec<Parameter>> {
        if config.parameters.is_empty() {
            return Ok(Vec::new());
        }
        if self.config.experts.is_none() {
            candle_core::bail!(
                "LoRA target parameters {:?}: this {} model has no experts; they adapt a \
                 mixture-of-experts model's expert stacks and router",
                config.parameters,
                self.config.arch
            );
        }
        let router = format!("mlp.{}.weight", self.router_name());
        let mut named = Vec::new();
        for target in &config.parameters {
            let parameter = match ExpertStack::named(target) {
                Some(stack) => Parameter::Stack(stack),
                // PEFT matches a parameter's full name or a dotted suffix of it; the suffix must
                // name the router (a bare `weight` would be every matrix's).
                None if target.contains('.')
                    && (router == *target || router.ends_with(&format!(".{target}"))) =>
                {
                    Parameter::Router
                }
                None => candle_core::bail!(
                    "unknown LoRA target parameter {target:?}; this {} model's are \
                     mlp.experts.gate_up_proj, mlp.experts.down_proj and {router}",
                    self.config.arch
                ),
            };
            if !named.contains(&parameter) {
                named.push(parameter);
            }
        }
        if config.dropout > 0.0 {
            candle_core::bail!(
                "LoRA dropout {} with target parameters {:?}: PEFT's adapters on parameters take no \
                 dropout (the input of a parameter's product is not the module's); set it to 0{}",
                config.dropout,
                config.parameters,
                match self.config.arch {
                    Arch::Qwen3Moe => {
                        " (on qwen3_moe, PEFT turns the expert and router module names, \
                         all-linear's among them, into target parameters)"
                    }
                    _ => "",
                }
            );
        }
        Ok(named)
    }

    /// The router's module name in a mixture layer (`gate`, gpt-oss's `router`).
    fn router_name(&self) -> &'static str {
        match self.config.arch {
            Arch::GptOss => "router",
            _ => "gate",
        }
    }
}

/// PEFT's module names of layer `layer`'s `adapted` expert adapters, in [`ExpertStack::ALL`]'s order.
/// PEFT wraps the module once per parameter, the first parameter innermost, so each earlier adapter
/// sits one `base_layer` deeper: `mlp.experts.base_layer` (`gate_up_proj`) and `mlp.experts`
/// (`down_proj`) for both.
pub(super) fn expert_prefixes(layer: usize, adapted: usize) -> Vec<String> {
    (0..adapted)
        .map(|k| {
            format!(
                "base_model.model.model.layers.{layer}.mlp.experts{}",
                ".base_layer".repeat(adapted - 1 - k)
            )
        })
        .collect()
}

/// Whether LoRA can adapt the projection `name` (in its layer) as a module: not a mixture's router or
/// experts.
fn adaptable(name: &str) -> bool {
    name != "mlp.gate" && name != "mlp.router" && !name.starts_with("mlp.experts.")
}

#[cfg(test)]
mod tests {
    use candle_core::DType;

    use crate::config::Arch;
    use crate::model::{LoraConfig, Targets};
    use crate::testing::{config, random_model};

    fn lora(targets: &[&str], dropout: f64) -> LoraConfig {
        LoraConfig {
            targets: Targets::names(targets),
            dropout,
            ..LoraConfig::default()
        }
    }

    /// `lm_head` adapts the output head under PEFT's names and shapes; `"all-linear"` leaves it out, as
    /// PEFT's does. With dropout, the head's adapter drops its inputs in training passes once the seed
    /// is set, and only then.
    #[test]
    fn the_head_is_adapted_when_named_only() {
        let base = random_model(&config(Arch::Qwen2), DType::F32);
        let (vocab, hidden) = (base.config.vocab_size, base.config.hidden_size);
        let (model, vars) = base.with_lora(&lora(&["all-linear"], 0.0)).unwrap();
        assert!(model.head_lora.is_none());
        assert!(vars.iter().all(|(name, _)| !name.contains("lm_head")));
        let (model, vars) = base.with_lora(&lora(&["lm_head"], 0.0)).unwrap();
        assert!(model.head_lora.is_some());
        let shapes: Vec<(&str, Vec<usize>)> = vars
            .iter()
            .map(|(name, var)| (name.as_str(), var.dims().to_vec()))
            .collect();
        assert_eq!(
            shapes,
            [
                ("base_model.model.lm_head.lora_A.weight", vec![8, hidden]),
                ("base_model.model.lm_head.lora_B.weight", vec![vocab, 8]),
            ]
        );
        let (dropped, _) = base.with_lora(&lora(&["lm_head"], 0.5)).unwrap();
        assert!(dropped.has_dropout());
        let hidden_states = crate::testing::sines((5, hidden), 0.3, DType::F32);
        let targets =
            candle_core::Tensor::new(&[1u32, 2, 3, 4, 5], hidden_states.device()).unwrap();
        // `B` is zero when drawn: moved, so that the adapter's input shows in the scores.
        let b = dropped.head_lora.as_ref().unwrap().b.clone();
        let moved = crate::testing::sines(b.dims2().unwrap(), 0.7, DType::F32);
        let dropped = {
            let mut model = dropped;
            model.head_lora.as_mut().unwrap().b = moved;
            model
        };
        let scores = |seed| {
            dropped.set_dropout_seed(seed);
            dropped.head_scores(&hidden_states, &targets, 1.0).unwrap()
        };
        let (off, first, again) = (scores(0), scores(11), scores(11));
        assert_eq!(crate::testing::max_difference(&first, &again), 0.0);
        assert!(crate::testing::max_difference(&off, &first) > 1e-3);
    }
}
