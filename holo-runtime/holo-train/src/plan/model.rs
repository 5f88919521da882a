//! The sizes a memory plan needs of a model, read before its weights: the shapes from `config.json`
//! ([`ModelConfig`]) and the parameter counts from the safetensors files' headers (the exact count of
//! any family the loader reads, experts and fused projections included), or from the shapes for a
//! folder whose weights are elsewhere (a GGUF file).

use std::io::Read;
use std::path::{Path, PathBuf};

use holo_model::config::ModelConfig;
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
}

impl Sizes {
    /// The sizes of the model folder or GGUF file `path`, reading `config.json` and the safetensors
    /// headers only.
    pub fn read(path: &Path) -> Result<Sizes, String> {
        let fail = |error: String| format!("--model `{}`: {error}", path.display());
        if path.is_file() {
            return Err(fail(
                "a memory plan reads a model folder's config.json; set `memory_check = \"off\"` \
                 to train from a single file"
                    .into(),
            ));
        }
        let config = ModelConfig::from_file(&path.join("config.json"))
            .map_err(|error| fail(error.to_string()))?;
        let mut tensors = Vec::new();
        for file in safetensors_files(path).map_err(fail)? {
            tensors.extend(header_sizes(&file).map_err(fail)?);
        }
        Ok(if tensors.is_empty() {
            Sizes::of_config(config)
        } else {
            Sizes {
                parameters: tensors.iter().map(|(_, count)| count).sum(),
                config,
                tensors,
            }
        })
    }

    /// The sizes a dense decoder of `config`'s shapes has (no per-tensor list): embeddings, each
    /// layer's projections (an expert's MLP per expert) and norms, the final norm, and the head
    /// unless tied.
    pub fn of_config(config: ModelConfig) -> Sizes {
        let c = &config;
        let (hidden, vocab) = (c.hidden_size as u64, c.vocab_size as u64);
        let queries = (c.num_attention_heads * c.head_dim) as u64;
        let keys = (c.num_key_value_heads * c.head_dim) as u64;
        let biases =
            if c.qkv_bias { queries + 2 * keys } else { 0 } + if c.o_bias { hidden } else { 0 };
        let attention = hidden * (queries + 2 * keys) + queries * hidden + biases;
        let mlp = match &c.experts {
            Some(experts) => {
                experts.count as u64 * 3 * hidden * experts.intermediate_size as u64
                    + experts.count as u64 * hidden
            }
            None => 3 * hidden * c.intermediate_size as u64,
        };
        let layer = attention + mlp + 2 * hidden;
        let head = if c.tie_word_embeddings {
            0
        } else {
            vocab * hidden
        };
        Sizes {
            parameters: vocab * hidden + c.num_hidden_layers as u64 * layer + hidden + head,
            config,
            tensors: Vec::new(),
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
        let hidden = c.hidden_size as u64;
        let head = self
            .head_rank(lora)
            .map_or(0, |rank| rank * (hidden + c.vocab_size as u64));
        let queries = (c.num_attention_heads * c.head_dim) as u64;
        let keys = (c.num_key_value_heads * c.head_dim) as u64;
        let inner = c.intermediate_size as u64;
        // (module name in the layer, inputs, outputs) of one layer's projections, as the loader names
        // them; the MLP's only on a layer without experts (a mixture's are target parameters).
        let projections = |experts: bool| -> Vec<(&'static str, u64, u64)> {
            let mut projections = match c.variant.fused_projections {
                true => vec![
                    ("self_attn.qkv_proj", hidden, queries + 2 * keys),
                    ("self_attn.o_proj", queries, hidden),
                    ("mlp.gate_up_proj", hidden, 2 * inner),
                ],
                false => vec![
                    ("self_attn.q_proj", hidden, queries),
                    ("self_attn.k_proj", hidden, keys),
                    ("self_attn.v_proj", hidden, keys),
                    ("self_attn.o_proj", queries, hidden),
                    ("mlp.gate_proj", hidden, inner),
                    ("mlp.up_proj", hidden, inner),
                ],
            };
            projections.push(("mlp.down_proj", inner, hidden));
            projections.retain(|(name, _, _)| !experts || !name.starts_with("mlp."));
            projections
        };
        let names: Vec<String> = projections(false)
            .iter()
            .map(|(name, _, _)| name.rsplit('.').next().unwrap_or(name).to_string())
            .collect();
        let (modules, parameters) = self.peft_names(&projections);
        let Ok(lora) = lora
            .named(c.arch, &modules, &parameters)
            .resolved(c.arch, &names)
        else {
            return 0;
        };
        let rank = |key: &str| lora.size_at(key).map_or(lora.rank, |(rank, _)| rank) as u64;
        let mut elements = 0;
        for i in 0..c.num_hidden_layers {
            let experts = c.layers.get(i).is_some_and(|layer| layer.experts);
            for (name, inputs, outputs) in projections(experts) {
                let key = format!("model.layers.{i}.{name}");
                if targets(&lora.targets, &key) {
                    elements += rank(&key) * (inputs + outputs);
                }
            }
            if experts {
                elements += self.expert_adapters(&lora, i, &rank);
            }
        }
        elements + head
    }

    /// PEFT's names of what LoRA can adapt, as the loader's `Model::peft_names` lists them: the modules
    /// (each layer's `projections`, a mixture layer's router, the output head) and the parameters (a
    /// mixture layer's expert stacks and router weight), which a regular expression is matched against.
    fn peft_names(
        &self,
        projections: &dyn Fn(bool) -> Vec<(&'static str, u64, u64)>,
    ) -> (Vec<String>, Vec<String>) {
        let c = &self.config;
        let router = match c.experts {
            Some(experts) if experts.clamped.is_some() => "router",
            _ => "gate",
        };
        let (mut modules, mut parameters) = (Vec::new(), Vec::new());
        for i in 0..c.num_hidden_layers {
            let experts = c.layers.get(i).is_some_and(|layer| layer.experts);
            for (name, _, _) in projections(experts) {
                modules.push(format!("model.layers.{i}.{name}"));
            }
            if experts {
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
        let router = if experts.clamped.is_some() {
            "router"
        } else {
            "gate"
        };
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
}
