//! The sizes a memory plan needs of a model, read before its weights: the shapes from `config.json`
//! ([`ModelConfig`]) and the parameter counts from the safetensors files' headers (the exact count of
//! any family the loader reads, experts and fused projections included), or from the shapes for a
//! folder whose weights are elsewhere; of a GGUF file, the config its loader reads and the counts of
//! its header's tensors.

use std::io::Read;
use std::path::{Path, PathBuf};

use holo_model::config::{ModelConfig, NormPlacement, QkNorm};
use holo_model::gguf::{Gguf, KeptBlocks};
use holo_model::model::{targets, ExpertStack, LoraConfig};

/// The output head's module name, as LoRA's targets name it.
const HEAD: &str = "lm_head";

/// A model's sizes, in elements.
#[derive(Debug, Clone, PartialEq)]
pub struct Sizes {
    pub config: ModelConfig,
    /// Every weight.
    pub parameters: u64,
    /// Each weight's name and element count (empty when read from the shapes alone).
    pub tensors: Vec<(String, u64)>,
    /// Of a GGUF file, what `--quantized` keeps as the file's blocks; `None` for a folder.
    pub blocks: Option<KeptBlocks>,
}

impl Sizes {
    /// The sizes of the model folder or GGUF file `path` and the bytes of its tokenizer's JSON (a
    /// folder's `tokenizer.json`; of a GGUF file, what its loader builds, [`Gguf::tokenizer_json_bytes`]),
    /// reading `config.json` and the safetensors headers, or the GGUF header, only (of a GGUF file,
    /// what `--quantized` keeps as its blocks too, [`Gguf::kept_blocks`]).
    pub fn read(path: &Path) -> Result<(Sizes, u64), String> {
        let fail = |error: String| format!("--model `{}`: {error}", path.display());
        if holo_model::gguf::is_gguf(path) {
            let gguf = Gguf::open(path).map_err(|error| fail(error.to_string()))?;
            let config = gguf.config().map_err(|error| fail(error.to_string()))?;
            let tokenizer = gguf
                .tokenizer_json_bytes()
                .map_err(|error| fail(error.to_string()))?;
            let tensors = gguf.tensor_elements();
            let blocks = gguf
                .kept_blocks()
                .map_err(|error| fail(error.to_string()))?;
            let sizes = Sizes {
                parameters: tensors.iter().map(|(_, count)| count).sum(),
                config,
                tensors,
                blocks: Some(blocks),
            };
            return Ok((sizes, tokenizer));
        }
        if path.is_file() {
            return Err(fail(
                "a memory plan reads a model folder's config.json or a GGUF file; set \
                 `memory_check = \"off\"` to train from another single file"
                    .into(),
            ));
        }
        let config = ModelConfig::from_file(&path.join("config.json"))
            .map_err(|error| fail(error.to_string()))?;
        let mut tensors = Vec::new();
        for file in safetensors_files(path).map_err(fail)? {
            tensors.extend(header_sizes(&file).map_err(fail)?);
        }
        let sizes = if tensors.is_empty() {
            Sizes::of_config(config)
        } else {
            Sizes {
                parameters: tensors.iter().map(|(_, count)| count).sum(),
                config,
                tensors,
                blocks: None,
            }
        };
        let tokenizer = std::fs::metadata(path.join("tokenizer.json")).map_or(0, |m| m.len());
        Ok((sizes, tokenizer))
    }

    /// The sizes a decoder of `config`'s shapes has (no per-tensor list), as `init-model` writes it:
    /// embeddings, each layer's token mixer (attention, or Gated DeltaNet's projections, convolution,
    /// decay parameters and norm), its feed-forward (the MLP, or the router, every expert's MLP and a
    /// shared expert with its gate) and norms, the final norm, and the head unless tied.
    pub fn of_config(config: ModelConfig) -> Sizes {
        let c = &config;
        let (hidden, vocab) = (c.hidden_size as u64, c.vocab_size as u64);
        let layers: u64 = (0..c.num_hidden_layers)
            .map(|i| {
                let projections: u64 = projections(c, i)
                    .iter()
                    .map(|(_, inputs, outputs)| inputs * outputs)
                    .sum();
                // Gemma 3's sandwich has four norms a layer, the others two.
                let norms = match c.variant.norms {
                    NormPlacement::Sandwich => 4,
                    NormPlacement::Pre | NormPlacement::Post => 2,
                };
                projections + extras(c, i) + experts_weights(c, i) + norms * hidden
            })
            .sum();
        let head = if c.tie_word_embeddings {
            0
        } else {
            vocab * hidden
        };
        Sizes {
            parameters: vocab * hidden + layers + hidden + head,
            config,
            tensors: Vec::new(),
            blocks: None,
        }
    }

    /// The embeddings' elements (`vocab × hidden`), which the output head shares when tied.
    pub fn embedding(&self) -> u64 {
        (self.config.vocab_size * self.config.hidden_size) as u64
    }

    /// The largest weight's elements.
    pub fn largest(&self) -> u64 {
        self.tensors
            .iter()
            .map(|(_, count)| *count)
            .max()
            .unwrap_or_else(|| self.embedding())
    }

    /// The elements of LoRA's adapters, `rank × (in + out)` for every projection `lora` targets (a
    /// fused projection when any of its parts is named, as the loader adapts it) and for the output
    /// head when it names `lm_head`, after PEFT's resolution (`all-linear`, a fused mixture's module
    /// names as target parameters), each at the rank its pattern gives; 0 for a configuration the
    /// loader will refuse.
    pub fn adapters(&self, lora: &LoraConfig) -> u64 {
        let c = &self.config;
        let head = self
            .head_rank(lora)
            .map_or(0, |rank| rank * (c.hidden_size + c.vocab_size) as u64);
        let Some(resolved) = self.resolved(lora) else {
            return 0;
        };
        let rank = |key: &str| {
            resolved
                .size_at(key)
                .map_or(resolved.rank, |(rank, _)| rank) as u64
        };
        let mut elements = 0;
        for (i, adapted) in self.adapted(lora).into_iter().enumerate() {
            elements += adapted
                .iter()
                .map(|(inputs, outputs, rank)| rank * (inputs + outputs))
                .sum::<u64>();
            if is_mixture(c, i) {
                elements += self.expert_adapters(&resolved, i, &rank);
            }
        }
        elements + head
    }

    /// Each layer's projections that `lora` adapts as modules, as `(inputs, outputs, rank)`, after
    /// PEFT's resolution; none for a configuration the loader will refuse.
    pub fn adapted(&self, lora: &LoraConfig) -> Vec<Vec<(u64, u64, u64)>> {
        let c = &self.config;
        let Some(lora) = self.resolved(lora) else {
            return vec![Vec::new(); c.num_hidden_layers];
        };
        let rank = |key: &str| lora.size_at(key).map_or(lora.rank, |(rank, _)| rank) as u64;
        (0..c.num_hidden_layers)
            .map(|i| {
                projections(c, i)
                    .into_iter()
                    .filter_map(|(name, inputs, outputs)| {
                        let key = format!("model.layers.{i}.{name}");
                        targets(&lora.targets, &key).then(|| (inputs, outputs, rank(&key)))
                    })
                    .collect()
            })
            .collect()
    }

    /// `lora` as PEFT resolves it on this model (`Model::resolved_lora`): `all-linear` as the short
    /// names of every layer's projections, as the loader's `projection_names` lists them (a
    /// linear-attention layer's, a shared expert's among them), and a fused mixture's module names as
    /// target parameters; `None` where the loader refuses it.
    fn resolved(&self, lora: &LoraConfig) -> Option<LoraConfig> {
        let c = &self.config;
        let mut names: Vec<String> = Vec::new();
        for i in 0..c.num_hidden_layers {
            for (name, _, _) in projections(c, i) {
                let short = name.rsplit('.').next().unwrap_or(name).to_string();
                if !names.contains(&short) {
                    names.push(short);
                }
            }
        }
        let (modules, parameters) = self.peft_names();
        lora.named(c.arch, &modules, &parameters)
            .resolved(c.arch, &names)
            .ok()
    }

    /// PEFT's names of what LoRA can adapt, as the loader's `Model::peft_names` lists them: the modules
    /// (each layer's [`projections`], a mixture layer's router, the output head) and the parameters (a
    /// mixture layer's expert stacks and router weight), which a regular expression is matched against.
    fn peft_names(&self) -> (Vec<String>, Vec<String>) {
        let c = &self.config;
        let router = router_name(c);
        let (mut modules, mut parameters) = (Vec::new(), Vec::new());
        for i in 0..c.num_hidden_layers {
            for (name, _, _) in projections(c, i) {
                modules.push(format!("model.layers.{i}.{name}"));
            }
            if is_mixture(c, i) {
                modules.push(format!("model.layers.{i}.mlp.{router}"));
                for stack in ExpertStack::ALL {
                    parameters.push(format!("model.layers.{i}.mlp.experts.{}", stack.name()));
                }
                parameters.push(format!("model.layers.{i}.mlp.{router}.weight"));
            }
        }
        modules.push(HEAD.to_string());
        (modules, parameters)
    }

    /// The rank of the output head's adapter when `lora` names `lm_head` (`Model::with_lora`). PEFT's
    /// resolution leaves that name as it is and never adds it (`all-linear` is the layers'
    /// projections), so the configuration as written answers.
    pub fn head_rank(&self, lora: &LoraConfig) -> Option<u64> {
        if !targets(&lora.targets, HEAD) {
            return None;
        }
        Some(lora.size_at(HEAD).map_or(lora.rank, |(rank, _)| rank) as u64)
    }

    /// The elements of mixture layer `i`'s adapters on target parameters: per expert stack,
    /// `rank × experts × (in + out)` (PEFT's `A` `[E·r, in]` and `B` `[out, r·E]`), and for the router
    /// `rank × (hidden + experts)`.
    fn expert_adapters(&self, lora: &LoraConfig, i: usize, rank: &dyn Fn(&str) -> u64) -> u64 {
        let c = &self.config;
        let Some(experts) = c.experts else {
            return 0;
        };
        let (hidden, inner) = (c.hidden_size as u64, experts.intermediate_size as u64);
        let count = experts.count as u64;
        let router = router_name(c);
        let mut stacks: Vec<ExpertStack> = Vec::new();
        let mut elements = 0;
        for target in &lora.parameters {
            match ExpertStack::named(target) {
                Some(stack) if !stacks.contains(&stack) => {
                    stacks.push(stack);
                    let sides = match stack {
                        ExpertStack::GateUp => hidden + 2 * inner,
                        ExpertStack::Down => inner + hidden,
                    };
                    let key = format!("model.layers.{i}.mlp.experts.{}", stack.name());
                    elements += rank(&key) * count * sides;
                }
                Some(_) => {}
                None => {
                    let key = format!("model.layers.{i}.mlp.{router}.weight");
                    if key.ends_with(&format!(".{target}")) {
                        elements += rank(&key) * (hidden + count);
                    }
                }
            }
        }
        elements
    }
}

/// Whether layer `i` of `c` routes its tokens to experts.
fn is_mixture(c: &ModelConfig, i: usize) -> bool {
    c.experts.is_some() && c.layers.get(i).is_some_and(|layer| layer.experts)
}

/// A mixture's router's module name: gpt-oss's `router`, the others' `gate`.
fn router_name(c: &ModelConfig) -> &'static str {
    match c.experts {
        Some(experts) if experts.clamped.is_some() => "router",
        _ => "gate",
    }
}

/// `(module name in the layer, inputs, outputs)` of layer `i`'s projections that LoRA adapts as
/// modules, as the loader names them (`Model::linears`, less a mixture's router and experts, which are
/// target parameters): softmax attention's (a gated query projection twice as wide, Qwen3.5's) or
/// Gated DeltaNet's (`linear_attn.in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, `out_proj`),
/// then a dense layer's MLP, or a mixture's shared expert and its gate (`mlp.shared_expert.gate_proj`,
/// …, `mlp.shared_expert_gate`).
fn projections(c: &ModelConfig, i: usize) -> Vec<(&'static str, u64, u64)> {
    let hidden = c.hidden_size as u64;
    let queries = (c.num_attention_heads * c.head_dim) as u64;
    let keys = (c.num_key_value_heads * c.head_dim) as u64;
    let linear = c
        .linear_attention
        .filter(|_| c.layers.get(i).is_some_and(|layer| layer.linear));
    let fused = c.variant.fused_projections;
    let mut projections = match linear {
        Some(linear) => {
            let values = (linear.value_heads * linear.value_head_dim) as u64;
            let heads = linear.value_heads as u64;
            vec![
                ("linear_attn.in_proj_qkv", hidden, linear.conv_dim() as u64),
                ("linear_attn.in_proj_z", hidden, values),
                ("linear_attn.in_proj_b", hidden, heads),
                ("linear_attn.in_proj_a", hidden, heads),
                ("linear_attn.out_proj", values, hidden),
            ]
        }
        None => {
            // Qwen3.5's query projection carries each head's output gate beside its query.
            let projected = if c.variant.attention_gate {
                2 * queries
            } else {
                queries
            };
            let mut attention = match fused {
                true => vec![("self_attn.qkv_proj", hidden, projected + 2 * keys)],
                false => vec![
                    ("self_attn.q_proj", hidden, projected),
                    ("self_attn.k_proj", hidden, keys),
                    ("self_attn.v_proj", hidden, keys),
                ],
            };
            attention.push(("self_attn.o_proj", queries, hidden));
            attention
        }
    };
    match c.experts.filter(|_| is_mixture(c, i)) {
        Some(experts) => {
            if let Some(shared) = experts.shared {
                let shared = shared as u64;
                projections.extend([
                    ("mlp.shared_expert.gate_proj", hidden, shared),
                    ("mlp.shared_expert.up_proj", hidden, shared),
                    ("mlp.shared_expert.down_proj", shared, hidden),
                    ("mlp.shared_expert_gate", hidden, 1),
                ]);
            }
        }
        None => {
            let inner = c.intermediate_size as u64;
            match fused {
                true => projections.push(("mlp.gate_up_proj", hidden, 2 * inner)),
                false => projections.extend([
                    ("mlp.gate_proj", hidden, inner),
                    ("mlp.up_proj", hidden, inner),
                ]),
            }
            projections.push(("mlp.down_proj", inner, hidden));
        }
    }
    projections
}

/// Layer `i`'s weights besides its [`projections`]' matrices, its experts and its layer norms: a dense
/// MLP's biases; attention's biases, q/k norms and sinks, or Gated DeltaNet's convolution
/// `[channels, 1, kernel]`, `dt_bias` and `A_log` (one per value head) and its norm over a value head.
fn extras(c: &ModelConfig, i: usize) -> u64 {
    let mlp = match c.mlp_bias && !is_mixture(c, i) {
        true => (2 * c.intermediate_size + c.hidden_size) as u64,
        false => 0,
    };
    let linear = c
        .linear_attention
        .filter(|_| c.layers.get(i).is_some_and(|layer| layer.linear));
    if let Some(linear) = linear {
        return mlp
            + (linear.conv_dim() * linear.conv_kernel
                + 2 * linear.value_heads
                + linear.value_head_dim) as u64;
    }
    let queries = (c.num_attention_heads * c.head_dim) as u64;
    let keys = (c.num_key_value_heads * c.head_dim) as u64;
    let biases = if c.qkv_bias { queries + 2 * keys } else { 0 }
        + if c.o_bias { c.hidden_size as u64 } else { 0 };
    let norms = match c.variant.qk_norm {
        QkNorm::None => 0,
        QkNorm::Head => 2 * c.head_dim as u64,
        QkNorm::Projection => queries + keys,
    };
    let sinks = if c.variant.attention_sinks {
        c.num_attention_heads as u64
    } else {
        0
    };
    mlp + biases + norms + sinks
}

/// Mixture layer `i`'s router and experts (each expert's gate, up and down projections; gpt-oss's with
/// their biases and the router's); 0 on a dense layer, whose MLP is among its [`projections`].
fn experts_weights(c: &ModelConfig, i: usize) -> u64 {
    let Some(experts) = c.experts.filter(|_| is_mixture(c, i)) else {
        return 0;
    };
    let (hidden, inner, count) = (
        c.hidden_size as u64,
        experts.intermediate_size as u64,
        experts.count as u64,
    );
    let biases = match experts.clamped {
        Some(_) => count * (2 * inner + hidden) + count,
        None => 0,
    };
    count * 3 * hidden * inner + count * hidden + biases
}

/// The safetensors files of a model folder, in name order.
fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let entries = std::fs::read_dir(dir).map_err(|error| format!("cannot read: {error}"))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "safetensors"))
        .collect();
    files.sort();
    Ok(files)
}

/// Each tensor's name and element count from a safetensors file's header (its first 8 bytes give the
/// header's length; the tensors' data is not read).
fn header_sizes(file: &Path) -> Result<Vec<(String, u64)>, String> {
    let name = file.display();
    let mut reader = std::fs::File::open(file).map_err(|error| format!("{name}: {error}"))?;
    let mut length = [0u8; 8];
    reader
        .read_exact(&mut length)
        .map_err(|_| format!("{name}: not a safetensors file"))?;
    let length = u64::from_le_bytes(length);
    if length > 100 << 20 {
        return Err(format!("{name}: a header of {length} bytes"));
    }
    let mut header = vec![0u8; length as usize];
    reader
        .read_exact(&mut header)
        .map_err(|error| format!("{name}: {error}"))?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|error| format!("{name}: {error}"))?;
    Ok(header
        .into_iter()
        .filter(|(tensor, _)| tensor != "__metadata__")
        .map(|(tensor, info)| {
            let count = info["shape"]
                .as_array()
                .map_or(0, |shape| shape.iter().filter_map(|d| d.as_u64()).product());
            (tensor, count)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use holo_model::config::{Arch, Experts, LayerSpec};
    use holo_model::model::Targets;

    /// The mixture's expert adapters, by hand: two mixture layers of 4 experts around a dense one,
    /// both stacks at rank 4; the dense layer has none, and adapting only attention counts only
    /// attention.
    #[test]
    fn expert_adapters_are_counted_per_mixture_layer_and_stack() {
        let mut config = holo_model::testing::config(Arch::Qwen3Moe);
        let experts = Experts {
            count: 4,
            per_token: 2,
            intermediate_size: 8,
            normalize: true,
            aux_loss_coef: 0.001,
            aux_loss: false,
            softmax_over_chosen: false,
            clamped: None,
            shared: None,
        };
        config.experts = Some(experts);
        let dense = config.layers[0];
        let mixture = LayerSpec {
            experts: true,
            ..dense
        };
        config.layers = vec![mixture, dense, mixture];
        config.num_hidden_layers = 3;
        let mixtures = 2;
        let (hidden, inner) = (config.hidden_size as u64, experts.intermediate_size as u64);
        let sizes = Sizes::of_config(config);
        let attention_only = LoraConfig {
            rank: 4,
            targets: Targets::names(&["q_proj"]),
            ..LoraConfig::default()
        };
        let with_experts = LoraConfig {
            parameters: vec![
                "mlp.experts.gate_up_proj".into(),
                "mlp.experts.down_proj".into(),
            ],
            ..attention_only.clone()
        };
        let per_stack_pair = (hidden + 2 * inner) + (inner + hidden);
        assert_eq!(
            sizes.adapters(&with_experts) - sizes.adapters(&attention_only),
            4 * experts.count as u64 * per_stack_pair * mixtures
        );
        // `all-linear` as PEFT converts it on Qwen3-MoE: the attention everywhere, the router and
        // both stacks on the mixture layers (`gate_up_proj` at twice the rank), and nothing on the
        // dense layer's MLP; a pattern's rank on one layer's `q_proj`.
        let c = &sizes.config;
        let queries = (c.num_attention_heads * c.head_dim) as u64;
        let kv = (c.num_key_value_heads * c.head_dim) as u64;
        let attention = 2 * (hidden + queries) + 2 * (hidden + kv);
        let all_linear = LoraConfig {
            targets: Targets::names(&["all-linear"]),
            rank_pattern: [("layers.1.self_attn.q_proj".to_string(), 6)]
                .into_iter()
                .collect(),
            ..attention_only.clone()
        };
        let count = experts.count as u64;
        let router = hidden + count;
        let stacks = 8 * count * (hidden + 2 * inner) + 4 * count * (inner + hidden);
        assert_eq!(
            sizes.adapters(&all_linear),
            4 * attention * 3 + 2 * (hidden + queries) + (4 * router + stacks) * mixtures
        );
        // What the loader's adapters hold, element for element, for names, `all-linear` and regular
        // expressions (which PEFT, and the loader, turn into the names they match on Qwen3-MoE: the
        // expert stacks among them).
        let model = holo_model::testing::random_model(&sizes.config, candle_core::DType::F32);
        let regex = |pattern: &str| LoraConfig {
            targets: Targets::Regex(pattern.into()),
            ..attention_only.clone()
        };
        for lora in [
            attention_only.clone(),
            with_experts,
            all_linear,
            regex(r".*\.(q_proj|v_proj)"),
            // Two of the expressions `tests/fixtures/train/peft_targets.json` has from PEFT.
            regex(r"model\.layers\.0\.(self_attn\.q_proj|mlp\.experts\.(gate|up)_proj)"),
            regex(r".*\.mlp\.(gate|experts\.down_proj)"),
        ] {
            let (_, vars) = model.with_lora(&lora).unwrap();
            let held: usize = vars.iter().map(|(_, var)| var.elem_count()).sum();
            assert_eq!(sizes.adapters(&lora), held as u64, "{:?}", lora.targets);
        }
    }

    /// Without safetensors headers, the sizes from the shapes are what `init-model` writes, weight for
    /// weight, for every family at both presets: Gated DeltaNet's layers, gated queries, q/k norms,
    /// shared experts, gpt-oss's biases and sinks, Gemma 3's four norms a layer.
    #[test]
    fn the_sizes_of_a_config_are_what_init_model_writes() {
        use holo_model::init::{parameter_specs, preset_config, Preset, ARCHS};
        for arch in ARCHS {
            for preset in [Preset::Tiny, Preset::Small] {
                let config = preset_config(arch, preset, 512, 1, 2);
                let written: usize = parameter_specs(&config)
                    .iter()
                    .map(|spec| spec.numel())
                    .sum();
                let planned = Sizes::of_config(config).parameters;
                assert_eq!(planned, written as u64, "{arch} {preset:?}");
            }
        }
    }

    /// Qwen3.5's adapters, dense and mixture, are the loader's element for element: on linear-attention
    /// layers (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, `out_proj`) and on the gated
    /// attention's twice-wide `q_proj`, on the dense MLP or the shared expert and its gate, on the
    /// expert stacks and the router as target parameters, by names, `all-linear`, regular expressions
    /// and rank patterns.
    #[test]
    fn qwen3_5_adapters_are_the_loaders() {
        use holo_model::init::{preset_config, Preset};
        let lora = |targets: Targets| LoraConfig {
            rank: 4,
            targets,
            ..LoraConfig::default()
        };
        for arch in [Arch::Qwen3_5, Arch::Qwen3_5Moe] {
            let config = preset_config(arch, Preset::Tiny, 96, 1, 2);
            let sizes = Sizes::of_config(config);
            let model = holo_model::testing::random_model(&sizes.config, candle_core::DType::F32);
            let mut runs = vec![
                lora(Targets::names(&["q_proj", "v_proj"])),
                lora(Targets::names(&["in_proj_qkv", "out_proj", "o_proj"])),
                lora(Targets::names(&["all-linear"])),
                lora(Targets::names(&["gate_proj", "up_proj", "down_proj"])),
                lora(Targets::names(&["in_proj_z", "q_proj", "lm_head"])),
                lora(Targets::Regex(r".*\.linear_attn\.in_proj_[ab]".into())),
                LoraConfig {
                    rank_pattern: [("layers.1.self_attn.q_proj".to_string(), 6)]
                        .into_iter()
                        .collect(),
                    ..lora(Targets::names(&["all-linear"]))
                },
            ];
            if arch == Arch::Qwen3_5Moe {
                runs.push(lora(Targets::names(&["shared_expert_gate", "q_proj"])));
                runs.push(LoraConfig {
                    parameters: vec![
                        "mlp.experts.gate_up_proj".into(),
                        "mlp.experts.down_proj".into(),
                        "mlp.gate.weight".into(),
                    ],
                    ..lora(Targets::names(&["all-linear"]))
                });
                runs.push(lora(Targets::Regex(r".*\.shared_expert\..*".into())));
            }
            for run in runs {
                let (_, vars) = model.with_lora(&run).unwrap();
                let held: usize = vars.iter().map(|(_, var)| var.elem_count()).sum();
                assert!(held > 0, "{arch} {:?}", run.targets);
                assert_eq!(
                    sizes.adapters(&run),
                    held as u64,
                    "{arch} {:?} {:?}",
                    run.targets,
                    run.parameters
                );
            }
        }
    }
}
