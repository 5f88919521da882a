//! `holo init-model`: a random-initialised model folder in Hugging Face format, built offline.
//!
//! The folder holds what `transformers.AutoModelForCausalLM.from_pretrained` and
//! `AutoTokenizer.from_pretrained` read, and what this runtime loads:
//!
//! - `config.json` ([`ModelConfig::to_json`]);
//! - `model.safetensors`: every weight under its Hugging Face name, f32; matrices and embeddings drawn
//!   from normal(0, 0.02) (transformers' `initializer_range`), biases zero, RMSNorm weights one; the
//!   draws come from ChaCha8 seeded with `--seed`, so a seed always gives the same bytes;
//! - `tokenizer.json`: a Qwen2-style byte-level BPE tokenizer (Qwen2's pre-tokenizer regex, NFC, 509
//!   learned tokens over the 256 byte symbols, then `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` as
//!   ids 509, 510, 511), trained with the `tokenizers` crate on a fixed synthetic corpus (arithmetic
//!   questions and answers, ChatML-like role lines, word salad). It mirrors
//!   `../shared/peers/build_tiny_qwen2.py`; the corpus is generated here, so the learned merges differ
//!   from the Python one's. The tokenizer does not depend on `--seed`: every folder shares one
//!   vocabulary;
//! - `tokenizer_config.json` in the form of Qwen2.5's (a ChatML `chat_template` inline, `eos_token`
//!   `<|im_end|>`, `pad_token` `<|endoftext|>`, no BOS) and `generation_config.json` (EOS ids of
//!   `<|im_end|>` and `<|endoftext|>`).
//!
//! Presets (the vocabulary is the offline tokenizer's, 512 ids, whatever the preset, unless `--vocab`
//! pads it with added tokens to a real family's size):
//!
//! | preset | arch        | hidden | intermediate | layers | heads / kv heads × head dim | tied | rope θ |
//! |--------|-------------|--------|--------------|--------|-----------------------------|------|--------|
//! | tiny   | qwen2       | 64     | 128          | 2      | 4 / 2 × 16                  | yes  | 1e6    |
//! | tiny   | qwen3       | 64     | 128          | 2      | 4 / 2 × 32                  | yes  | 1e6    |
//! | tiny   | llama       | 64     | 128          | 2      | 4 / 2 × 16                  | no   | 5e5    |
//! | tiny   | mistral, ministral | 64 | 128       | 2      | 4 / 2 × 16                  | no   | 1e6    |
//! | tiny   | smollm3     | 64     | 128          | 2      | 4 / 2 × 16                  | yes  | 5e6    |
//! | tiny   | olmo2, olmo3 | 64    | 128          | 2      | 4 / 2 × 16                  | no   | 5e5    |
//! | tiny   | gemma2      | 64     | 128          | 2      | 4 / 2 × 32                  | yes  | 1e4    |
//! | tiny   | gemma3_text | 64     | 128          | 2      | 4 / 2 × 32                  | yes  | 1e6    |
//! | tiny   | phi3        | 64     | 128          | 2      | 4 / 2 × 16 (8 rotated)      | no   | 1e4    |
//! | tiny   | qwen3_5_text | 64    | 128          | 2      | 4 / 2 × 32 (8 rotated)      | yes  | 1e7    |
//! | tiny   | qwen3_moe   | 64     | 4 experts × 32, 2 per token | 2 | 4 / 2 × 32            | no   | 1e6    |
//! | tiny   | qwen3_5_moe_text | 64 | 4 experts × 32, 2 per token, shared 32 | 2 | 4 / 2 × 32 (8 rotated) | no | 1e7 |
//! | tiny   | gpt_oss     | 64     | 4 experts × 32, 2 per token | 2 | 4 / 2 × 16            | no   | 1.5e5, YaRN ×32 |
//!
//! The tiny models carry what sets their family apart at sizes tests reach: windows of 8 positions on
//! every layer (mistral) or every other one (ministral, olmo3, gemma2, gemma3_text), RoPE left out of
//! smollm3's second layer; gemma2 has Gemma 2's soft-caps (attention 50, logits 30). `small` has the
//! decoder shapes of Qwen2.5-0.5B, Qwen3-0.6B, SmolLM2-135M, Mistral-7B, Ministral-8B, SmolLM3-3B,
//! OLMo-2-1B, Olmo-3-7B, gemma-2-2b, gemma-3-1b, Phi-4-mini and Qwen3.5-0.8B
//! (`preset_config`), with their windows and RoPE layouts, except the vocabulary: theirs are 32k–262k
//! ids, ours 512, so the embedding and the LM head are far smaller than the real models'; the decoder
//! layers, which dominate the cost per token, are the same. `qwen3_moe`'s `small` is two of
//! Qwen3-30B-A3B's 48 layers (128 experts of 768, 8 per token): the real model does not fit;
//! `qwen3_5_moe_text`'s `small` is four of Qwen3.5-35B-A3B's 40 (three linear, one full; 256 experts of
//! 512, 8 per token, a shared expert of 512), its tiny model a linear layer then a full one;
//! `gpt_oss`'s `small` is two of gpt-oss-20b's 24 (a windowed layer of 128 positions and a full one,
//! 32 experts of 2880, 4 per token), its tiny model windows every other layer at 8 positions; both
//! have attention biases, sinks and gpt-oss's YaRN. Norms start as the identity (ones, or zeros for
//! Gemma's `1 + w`). `--layers N` ([`InitOptions::layers`]) writes N decoder layers in the preset's
//! pattern instead of its count ([`with_layers`]).

use std::collections::HashSet;
use std::fmt;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use super::config::{
    Arch, ClampedSwiGlu, Experts, LayerSpec, LinearAttention, ModelConfig, NormPlacement, QkNorm,
    RopeScaling, Variant,
};

/// The special tokens, in Qwen2.5's order; they take the last three ids.
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
/// Ids of the whole vocabulary, special tokens included.
pub const VOCAB_SIZE: usize = 512;
/// Qwen2's pre-tokenizer regex (transformers' `tokenization_qwen2.py`).
pub const PRETOKENIZE_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// ChatML without a default system prompt (Qwen2.5's, less tools), as in `build_tiny_qwen2.py`.
pub const CHAT_TEMPLATE: &str = "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";
/// transformers' `initializer_range`.
pub const INIT_STD: f64 = 0.02;
/// The seed of the tokenizer's training corpus (independent of the weights' seed).
const CORPUS_SEED: u64 = 0;
/// Files written, in the order they are written.
pub const FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "model.safetensors",
];

/// The size of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// A few hundred thousand parameters, for tests.
    Tiny,
    /// The decoder shapes of Qwen2.5-0.5B (qwen2) or SmolLM2-135M (llama), for benchmarks.
    Small,
}

impl FromStr for Preset {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        match name {
            "tiny" => Ok(Preset::Tiny),
            "small" => Ok(Preset::Small),
            other => Err(format!("unknown preset {other:?}; expected tiny or small")),
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Preset::Tiny => "tiny",
            Preset::Small => "small",
        })
    }
}

/// The families `holo init-model` writes, by `model_type`.
pub const ARCHS: [Arch; 15] = [
    Arch::Qwen2,
    Arch::Qwen3,
    Arch::Llama,
    Arch::Mistral,
    Arch::Ministral,
    Arch::SmolLm3,
    Arch::Olmo2,
    Arch::Olmo3,
    Arch::Gemma2,
    Arch::Gemma3,
    Arch::Phi3,
    Arch::Qwen3_5,
    Arch::Qwen3_5Moe,
    Arch::Qwen3Moe,
    Arch::GptOss,
];

/// A family by its `model_type` (`qwen2`, `qwen3`, `llama`, …), for command-line parsers.
pub fn parse_arch(name: &str) -> Result<Arch, String> {
    ARCHS
        .into_iter()
        .find(|arch| arch.model_type() == name)
        .ok_or_else(|| {
            let names: Vec<&str> = ARCHS.iter().map(|arch| arch.model_type()).collect();
            format!(
                "unknown architecture {name:?}; expected one of {}",
                names.join(", ")
            )
        })
}

/// What to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitOptions {
    pub arch: Arch,
    pub preset: Preset,
    /// Seeds the weights (not the tokenizer).
    pub seed: u64,
    /// Write into a folder that is not empty, replacing the files this writes (others are left).
    pub force: bool,
    /// The vocabulary's size when larger than the offline tokenizer's 512 ids: the tokenizer is padded
    /// with added tokens `<|extra_N|>` up to it (the embeddings and output head grow to match), so a
    /// benchmark meets a real family's output-head and log-softmax costs (Qwen: 151,936).
    pub vocab: Option<usize>,
    /// The decoder layers' count instead of the preset's (at least 1), in the preset's pattern: a few
    /// of a large model's layers at its real width, for benchmarks on a machine the whole model does
    /// not fit.
    pub layers: Option<usize>,
}

/// Why no model folder was written.
#[derive(Debug)]
pub enum InitError {
    /// The command was used wrongly (the folder is not empty, or is a file).
    Usage(String),
    /// Reading or writing a file failed.
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    /// Building the tokenizer failed.
    Tokenizer(String),
}

impl InitError {
    /// The process exit status: 2 for a usage error, 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            InitError::Usage(_) => 2,
            InitError::Io { .. } | InitError::Tokenizer(_) => 1,
        }
    }

    fn io(path: &Path) -> impl FnOnce(std::io::Error) -> InitError + '_ {
        move |error| InitError::Io {
            path: path.to_path_buf(),
            error,
        }
    }
}

impl fmt::Display for InitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InitError::Usage(message) => f.write_str(message),
            InitError::Io { path, error } => write!(f, "{}: {error}", path.display()),
            InitError::Tokenizer(message) => write!(f, "building the tokenizer: {message}"),
        }
    }
}

impl std::error::Error for InitError {}

/// What was written.
#[derive(Debug, Clone)]
pub struct InitSummary {
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub preset: Preset,
    pub seed: u64,
    pub parameters: usize,
}

impl fmt::Display for InitSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        write!(
            f,
            "wrote a random {} {} model to {} (seed {}): {} parameters, vocab {}, hidden {}, {} layers, \
             {} heads / {} kv heads, {} embeddings; files: {}",
            c.arch,
            self.preset,
            self.dir.display(),
            self.seed,
            self.parameters,
            c.vocab_size,
            c.hidden_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads,
            if c.tie_word_embeddings { "tied" } else { "untied" },
            FILES.join(", "),
        )
    }
}

/// How a weight starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Init {
    /// normal(0, [`INIT_STD`]).
    Normal,
    Zeros,
    Ones,
    /// The logarithm of a uniform draw in [0.01, 16]: Gated DeltaNet's decay rates (`A_log`), as
    /// transformers initialises them.
    LogUniform,
}

/// One weight of the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
}

impl ParamSpec {
    fn new(name: String, shape: Vec<usize>, init: Init) -> Self {
        ParamSpec { name, shape, init }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Layer `layer`'s attention window, RoPE, linear attention and experts in `preset`: what sets the
/// families' layers apart, at sizes the tiny models' tests reach: windows of 8 positions on every
/// other layer (the real checkpoints' patterns otherwise), RoPE left out of SmolLM3's every other
/// layer (its checkpoints: every fourth).
fn layer_spec(arch: Arch, preset: Preset, layer: usize) -> LayerSpec {
    let tiny = preset == Preset::Tiny;
    let window = match arch {
        _ if tiny => 8,
        Arch::Olmo3 | Arch::Gemma2 => 4096,
        Arch::Gemma3 => 512,
        Arch::GptOss => 128,
        _ => 32768,
    };
    // Whether `layer` is the last of each group of `tiny` (tiny models) or `small` layers.
    let last_of = |tiny_group: usize, group: usize| {
        (layer + 1).is_multiple_of(if tiny { tiny_group } else { group })
    };
    let windowed = match arch {
        Arch::Mistral => tiny,
        Arch::Ministral | Arch::Gemma2 | Arch::GptOss => layer.is_multiple_of(2),
        Arch::Olmo3 => !last_of(2, 4),
        Arch::Gemma3 => !last_of(2, 6),
        _ => false,
    };
    LayerSpec {
        window: windowed.then_some(window),
        rope: arch != Arch::SmolLm3 || !last_of(2, 4),
        // Qwen3.5's linear attention on three layers of four (the tiny model: every other).
        linear: arch.is_qwen3_5() && !last_of(2, 4),
        experts: matches!(arch, Arch::Qwen3Moe | Arch::Qwen3_5Moe | Arch::GptOss),
    }
}

/// `config` (a `preset` one) with `layers` decoder layers instead of its own count, in the preset's
/// pattern (windows, RoPE-free and linear-attention layers), so a benchmark can run a few of a large
/// model's layers at its real width.
pub fn with_layers(mut config: ModelConfig, preset: Preset, layers: usize) -> ModelConfig {
    config.num_hidden_layers = layers;
    config.layers = (0..layers)
        .map(|layer| layer_spec(config.arch, preset, layer))
        .collect();
    config
}

/// The configuration of a preset. `bos`/`eos` are token ids of the tokenizer.
pub fn preset_config(
    arch: Arch,
    preset: Preset,
    vocab_size: usize,
    bos: u32,
    eos: u32,
) -> ModelConfig {
    // (hidden, intermediate, layers, heads, kv heads, head dim, max positions, rope theta, rms eps,
    // tied)
    let (hidden, intermediate, layers, heads, kv_heads, head_dim, max_positions, theta, eps, tied) =
        match (arch, preset) {
            (Arch::Qwen2, Preset::Tiny) => (64, 128, 2, 4, 2, 16, 2048, 1e6, 1e-6, true),
            // Heads wider than hidden / heads, as Qwen3's are.
            (Arch::Qwen3, Preset::Tiny) => (64, 128, 2, 4, 2, 32, 2048, 1e6, 1e-6, true),
            (Arch::Llama, Preset::Tiny) => (64, 128, 2, 4, 2, 16, 2048, 5e5, 1e-5, false),
            // Qwen2.5-0.5B.
            (Arch::Qwen2, Preset::Small) => (896, 4864, 24, 14, 2, 64, 32768, 1e6, 1e-6, true),
            // Qwen3-0.6B.
            (Arch::Qwen3, Preset::Small) => (1024, 3072, 28, 16, 8, 128, 40960, 1e6, 1e-6, true),
            // SmolLM2-135M.
            (Arch::Llama, Preset::Small) => (576, 1536, 30, 9, 3, 64, 8192, 1e5, 1e-5, true),
            (Arch::Mistral | Arch::Ministral, Preset::Tiny) => {
                (64, 128, 2, 4, 2, 16, 2048, 1e6, 1e-5, false)
            }
            (Arch::SmolLm3, Preset::Tiny) => (64, 128, 2, 4, 2, 16, 2048, 5e6, 1e-6, true),
            // Mistral-7B-v0.3 (no sliding window).
            (Arch::Mistral, Preset::Small) => {
                (4096, 14336, 32, 32, 8, 128, 32768, 1e6, 1e-5, false)
            }
            // Ministral-8B.
            (Arch::Ministral, Preset::Small) => {
                (4096, 12288, 36, 32, 8, 128, 32768, 1e8, 1e-5, false)
            }
            // SmolLM3-3B.
            (Arch::SmolLm3, Preset::Small) => (2048, 11008, 36, 16, 4, 128, 65536, 5e6, 1e-6, true),
            (Arch::Olmo2 | Arch::Olmo3, Preset::Tiny) => {
                (64, 128, 2, 4, 2, 16, 2048, 5e5, 1e-6, false)
            }
            // Heads wider than hidden / heads, as Gemma 3's are (256 over 1152).
            (Arch::Gemma3, Preset::Tiny) => (64, 128, 2, 4, 2, 32, 2048, 1e6, 1e-6, true),
            (Arch::Gemma2, Preset::Tiny) => (64, 128, 2, 4, 2, 32, 2048, 1e4, 1e-6, true),
            // gemma-2-2b: 256-wide heads over 2304, 8 over 4.
            (Arch::Gemma2, Preset::Small) => (2304, 9216, 26, 8, 4, 256, 8192, 1e4, 1e-6, true),
            // OLMo-2-0425-1B.
            (Arch::Olmo2, Preset::Small) => (2048, 8192, 16, 16, 16, 128, 4096, 5e5, 1e-6, false),
            // Olmo-3-7B.
            (Arch::Olmo3, Preset::Small) => (4096, 11008, 32, 32, 32, 128, 65536, 5e5, 1e-6, false),
            // gemma-3-1b.
            (Arch::Gemma3, Preset::Small) => (1152, 6912, 26, 4, 1, 256, 32768, 1e6, 1e-6, true),
            (Arch::Phi3, Preset::Tiny) => (64, 128, 2, 4, 2, 16, 2048, 1e4, 1e-5, false),
            // Phi-4-mini.
            (Arch::Phi3, Preset::Small) => (3072, 8192, 32, 24, 8, 128, 131072, 1e4, 1e-5, true),
            (Arch::Qwen3_5, Preset::Tiny) => (64, 128, 2, 4, 2, 32, 2048, 1e7, 1e-6, true),
            // Qwen3.5-0.8B's published decoder: 24 layers of width 1024, 8 heads over 2 of 256.
            (Arch::Qwen3_5, Preset::Small) => (1024, 3584, 24, 8, 2, 256, 262144, 1e7, 1e-6, true),
            // Every layer's feed-forward is a mixture: there is no dense intermediate size.
            (Arch::Qwen3_5Moe, Preset::Tiny) => (64, 0, 2, 4, 2, 32, 2048, 1e7, 1e-6, false),
            // Four of Qwen3.5-35B-A3B's 40 decoder layers (three linear, one full): 2048 wide, 16 heads
            // over 2 of 256, 256 experts of 512 with 8 per token and a shared expert of 512 (3.2 B
            // parameters, 13 GB in f32). Each layer computes per token what the real model's do.
            (Arch::Qwen3_5Moe, Preset::Small) => (2048, 0, 4, 16, 2, 256, 262144, 1e7, 1e-6, false),
            (Arch::Qwen3Moe, Preset::Tiny) => (64, 128, 2, 4, 2, 32, 2048, 1e6, 1e-6, false),
            // Two of Qwen3-30B-A3B's 48 decoder layers: 2048 wide, 32 heads over 4 of 128, 128 experts
            // of 768 with 8 per token (1.2 B parameters, 4.8 GB in f32; the real model's 48 would be
            // 29 B). Each layer computes per token what the real model's do.
            (Arch::Qwen3Moe, Preset::Small) => (2048, 6144, 2, 32, 4, 128, 40960, 1e6, 1e-6, false),
            // The intermediate size is each expert's.
            (Arch::GptOss, Preset::Tiny) => (64, 32, 2, 4, 2, 16, 131072, 1.5e5, 1e-5, false),
            // Two of gpt-oss-20b's 24 decoder layers (a windowed one, then a full one): 2880 wide,
            // 64 heads over 8 of 64, 32 experts of 2880 with 4 per token (1.6 B parameters beside the
            // embeddings; the real model's 24 would be 21 B).
            (Arch::GptOss, Preset::Small) => (2880, 2880, 2, 64, 8, 64, 131072, 1.5e5, 1e-5, false),
        };
    let tiny = preset == Preset::Tiny;
    let layer_specs = (0..layers)
        .map(|layer| layer_spec(arch, preset, layer))
        .collect();
    let variant = Variant {
        query_pre_attn_scalar: arch.is_gemma().then_some(head_dim as f64),
        // Phi-4-mini rotates three quarters of each head, the tiny model half; Qwen3.5 a quarter.
        rotary_dim: match arch {
            Arch::Phi3 if tiny => Some(head_dim / 2),
            Arch::Phi3 => Some(head_dim * 3 / 4),
            Arch::Qwen3_5 | Arch::Qwen3_5Moe => Some(head_dim / 4),
            _ => None,
        },
        ..Variant::of(arch)
    };
    ModelConfig {
        arch,
        vocab_size,
        hidden_size: hidden,
        intermediate_size: intermediate,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim,
        max_position_embeddings: max_positions,
        rms_norm_eps: eps,
        rope_theta: theta,
        rope_scaling: match arch {
            Arch::GptOss => crate::config::gpt_oss_yarn(),
            _ => RopeScaling::None,
        },
        tie_word_embeddings: tied,
        qkv_bias: matches!(arch, Arch::Qwen2 | Arch::GptOss),
        o_bias: arch == Arch::GptOss,
        mlp_bias: false,
        variant,
        layers: layer_specs,
        // Qwen3-MoE: `tiny` four experts of 32, two per token, renormalised; `small` two of Qwen3-30B-A3B's
        // layers, 128 experts of 768, eight per token. gpt-oss: `tiny` four experts, two per token;
        // `small` gpt-oss-20b's 32, four per token, with its clamped SwiGLU. Qwen3.5's mixture: `tiny`
        // four experts of 32, two per token, and a shared expert of 32; `small` Qwen3.5-35B-A3B's.
        experts: matches!(arch, Arch::Qwen3Moe | Arch::Qwen3_5Moe | Arch::GptOss).then(|| {
            let gpt_oss = arch == Arch::GptOss;
            let (count, per_token, intermediate_size) = match (arch, tiny) {
                (Arch::Qwen3_5Moe, false) => (256, 8, 512),
                (Arch::GptOss, true) => (4, 2, intermediate),
                (Arch::GptOss, false) => (32, 4, intermediate),
                (_, true) => (4, 2, 32),
                (_, false) => (128, 8, 768),
            };
            Experts {
                count,
                per_token,
                intermediate_size,
                normalize: !gpt_oss,
                aux_loss_coef: 0.001,
                aux_loss: false,
                softmax_over_chosen: gpt_oss,
                clamped: gpt_oss.then_some(ClampedSwiGlu {
                    alpha: 1.702,
                    limit: 7.0,
                }),
                shared: (arch == Arch::Qwen3_5Moe).then_some(intermediate_size),
            }
        }),
        linear_attention: arch.is_qwen3_5().then_some(match (arch, tiny) {
            (_, true) => LinearAttention {
                key_heads: 2,
                value_heads: 4,
                key_head_dim: 16,
                value_head_dim: 16,
                conv_kernel: 4,
            },
            // Qwen3.5-35B-A3B's: two value heads per key head.
            (Arch::Qwen3_5Moe, false) => LinearAttention {
                key_heads: 16,
                value_heads: 32,
                key_head_dim: 128,
                value_head_dim: 128,
                conv_kernel: 4,
            },
            (_, false) => LinearAttention {
                key_heads: 16,
                value_heads: 16,
                key_head_dim: 128,
                value_head_dim: 128,
                conv_kernel: 4,
            },
        }),
        bos_token_id: Some(bos),
        eos_token_ids: vec![eos],
    }
}

/// Every weight of a checkpoint of `config`, under its Hugging Face name, in module order.
pub fn parameter_specs(config: &ModelConfig) -> Vec<ParamSpec> {
    let hidden = config.hidden_size;
    let q_out = config.num_attention_heads * config.head_dim;
    let kv_out = config.num_key_value_heads * config.head_dim;
    let intermediate = config.intermediate_size;
    let mut specs = vec![ParamSpec::new(
        "model.embed_tokens.weight".into(),
        vec![config.vocab_size, hidden],
        Init::Normal,
    )];
    for layer in 0..config.num_hidden_layers {
        let prefix = format!("model.layers.{layer}");
        let mut linear = |name: &str, out: usize, input: usize, bias: bool| {
            specs.push(ParamSpec::new(
                format!("{prefix}.{name}.weight"),
                vec![out, input],
                Init::Normal,
            ));
            if bias {
                specs.push(ParamSpec::new(
                    format!("{prefix}.{name}.bias"),
                    vec![out],
                    Init::Zeros,
                ));
            }
        };
        let spec = config.layers[layer];
        // The query projection carries the output gate too, where the family has one.
        let query_width = q_out * if config.variant.attention_gate { 2 } else { 1 };
        let mut extra = Vec::new();
        match (spec.linear, config.linear_attention) {
            (true, Some(sizes)) => {
                let (channels, value_width) =
                    (sizes.conv_dim(), sizes.value_heads * sizes.value_head_dim);
                linear("linear_attn.in_proj_qkv", channels, hidden, false);
                linear("linear_attn.in_proj_z", value_width, hidden, false);
                linear("linear_attn.in_proj_b", sizes.value_heads, hidden, false);
                linear("linear_attn.in_proj_a", sizes.value_heads, hidden, false);
                extra.extend([
                    (
                        "linear_attn.conv1d.weight",
                        vec![channels, 1, sizes.conv_kernel],
                        Init::Normal,
                    ),
                    ("linear_attn.dt_bias", vec![sizes.value_heads], Init::Ones),
                    (
                        "linear_attn.A_log",
                        vec![sizes.value_heads],
                        Init::LogUniform,
                    ),
                    (
                        "linear_attn.norm.weight",
                        vec![sizes.value_head_dim],
                        Init::Ones,
                    ),
                ]);
                linear("linear_attn.out_proj", hidden, value_width, false);
            }
            _ if config.variant.fused_projections => {
                let qkv = q_out + 2 * kv_out;
                linear("self_attn.qkv_proj", qkv, hidden, config.qkv_bias);
                linear("self_attn.o_proj", hidden, q_out, config.o_bias);
            }
            _ => {
                linear("self_attn.q_proj", query_width, hidden, config.qkv_bias);
                linear("self_attn.k_proj", kv_out, hidden, config.qkv_bias);
                linear("self_attn.v_proj", kv_out, hidden, config.qkv_bias);
                linear("self_attn.o_proj", hidden, q_out, config.o_bias);
            }
        }

        if let (true, Some(experts), Arch::GptOss) = (spec.experts, config.experts, config.arch) {
            // transformers' stacks, multiplied from the left: gate and up interleaved by column.
            let (count, inner) = (experts.count, experts.intermediate_size);
            linear("mlp.router", count, hidden, true);
            extra.extend([
                (
                    "mlp.experts.gate_up_proj",
                    vec![count, hidden, 2 * inner],
                    Init::Normal,
                ),
                (
                    "mlp.experts.gate_up_proj_bias",
                    vec![count, 2 * inner],
                    Init::Zeros,
                ),
                (
                    "mlp.experts.down_proj",
                    vec![count, inner, hidden],
                    Init::Normal,
                ),
                (
                    "mlp.experts.down_proj_bias",
                    vec![count, hidden],
                    Init::Zeros,
                ),
            ]);
        } else if let (true, Some(experts)) = (spec.experts, config.experts) {
            linear("mlp.gate", experts.count, hidden, false);
            let inner = experts.intermediate_size;
            for e in 0..experts.count {
                linear(&format!("mlp.experts.{e}.gate_proj"), inner, hidden, false);
                linear(&format!("mlp.experts.{e}.up_proj"), inner, hidden, false);
                linear(&format!("mlp.experts.{e}.down_proj"), hidden, inner, false);
            }
            if let Some(inner) = experts.shared {
                linear("mlp.shared_expert.gate_proj", inner, hidden, false);
                linear("mlp.shared_expert.up_proj", inner, hidden, false);
                linear("mlp.shared_expert.down_proj", hidden, inner, false);
                linear("mlp.shared_expert_gate", 1, hidden, false);
            }
        } else if config.variant.fused_projections {
            linear(
                "mlp.gate_up_proj",
                2 * intermediate,
                hidden,
                config.mlp_bias,
            );
        } else {
            linear("mlp.gate_proj", intermediate, hidden, config.mlp_bias);
            linear("mlp.up_proj", intermediate, hidden, config.mlp_bias);
        }
        if !spec.experts {
            linear("mlp.down_proj", hidden, intermediate, config.mlp_bias);
        }
        if config.variant.attention_sinks {
            extra.push((
                "self_attn.sinks",
                vec![config.num_attention_heads],
                Init::Normal,
            ));
        }
        for (name, shape, init) in extra {
            specs.push(ParamSpec::new(format!("{prefix}.{name}"), shape, init));
        }
        // Norms start as the identity: weights of one, or of zero where they are offsets from one.
        let unit = match config.variant.norm_offset {
            true => Init::Zeros,
            false => Init::Ones,
        };
        let (q_width, k_width) = match config.variant.qk_norm {
            QkNorm::None => (0, 0),
            QkNorm::Head => (config.head_dim, config.head_dim),
            QkNorm::Projection => (q_out, kv_out),
        };
        if config.variant.qk_norm != QkNorm::None && !spec.linear {
            for (norm, width) in [("self_attn.q_norm", q_width), ("self_attn.k_norm", k_width)] {
                specs.push(ParamSpec::new(
                    format!("{prefix}.{norm}.weight"),
                    vec![width],
                    unit,
                ));
            }
        }
        let placement = config.variant.norms;
        for (norm, present) in [
            ("input_layernorm", placement != NormPlacement::Post),
            ("post_attention_layernorm", true),
            (
                "pre_feedforward_layernorm",
                placement == NormPlacement::Sandwich,
            ),
            (
                "post_feedforward_layernorm",
                placement != NormPlacement::Pre,
            ),
        ] {
            if present {
                specs.push(ParamSpec::new(
                    format!("{prefix}.{norm}.weight"),
                    vec![hidden],
                    unit,
                ));
            }
        }
    }
    specs.push(ParamSpec::new(
        "model.norm.weight".into(),
        vec![hidden],
        match config.variant.norm_offset {
            true => Init::Zeros,
            false => Init::Ones,
        },
    ));
    if !config.tie_word_embeddings {
        specs.push(ParamSpec::new(
            "lm_head.weight".into(),
            vec![config.vocab_size, hidden],
            Init::Normal,
        ));
    }
    specs
}

/// Writes a random-initialised model folder into `dir` (created if needed).
pub fn init_model(dir: &Path, options: &InitOptions) -> Result<InitSummary, InitError> {
    if options.layers == Some(0) {
        return Err(InitError::Usage(
            "--layers 0: a model needs at least one decoder layer".into(),
        ));
    }
    prepare_dir(dir, options.force)?;

    let mut tokenizer = build_tokenizer()?;
    if let Some(vocab) = options.vocab {
        pad_vocabulary(&mut tokenizer, vocab)?;
    }
    let id = |token: &str| {
        tokenizer
            .token_to_id(token)
            .ok_or_else(|| InitError::Tokenizer(format!("{token} is not in the vocabulary")))
    };
    let (endoftext, im_end) = (id("<|endoftext|>")?, id("<|im_end|>")?);
    let vocab_size = tokenizer.get_vocab_size(true);
    let mut config = preset_config(options.arch, options.preset, vocab_size, endoftext, im_end);
    if let Some(layers) = options.layers {
        config = with_layers(config, options.preset, layers);
    }

    let tokenizer_json = tokenizer
        .to_string(true)
        .map_err(|error| InitError::Tokenizer(error.to_string()))?;
    write_atomic(&dir.join("tokenizer.json"), |file| {
        file.write_all(tokenizer_json.as_bytes())?;
        file.write_all(b"\n")
    })?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &tokenizer_config(&tokenizer, &config),
    )?;
    write_json(&dir.join("config.json"), &config.to_json())?;
    write_json(
        &dir.join("generation_config.json"),
        &json!({
            "bos_token_id": endoftext,
            "eos_token_id": [im_end, endoftext],
            "pad_token_id": endoftext,
        }),
    )?;
    let specs = parameter_specs(&config);
    write_atomic(&dir.join("model.safetensors"), |file| {
        write_safetensors(file, &specs, options.seed)
    })?;
    Ok(InitSummary {
        dir: dir.to_path_buf(),
        parameters: specs.iter().map(ParamSpec::numel).sum(),
        config,
        preset: options.preset,
        seed: options.seed,
    })
}

fn prepare_dir(dir: &Path, force: bool) -> Result<(), InitError> {
    match std::fs::metadata(dir) {
        Ok(metadata) if !metadata.is_dir() => Err(InitError::Usage(format!(
            "{} exists and is not a directory",
            dir.display()
        ))),
        Ok(_) => {
            let mut entries = std::fs::read_dir(dir).map_err(InitError::io(dir))?;
            if !force && entries.next().is_some() {
                Err(InitError::Usage(format!(
                    "{} exists and is not empty; pass --force to write the model files into it \
                     (replacing {})",
                    dir.display(),
                    FILES.join(", ")
                )))
            } else {
                Ok(())
            }
        }
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(dir).map_err(InitError::io(dir))
        }
        Err(error) => Err(InitError::Io {
            path: dir.to_path_buf(),
            error,
        }),
    }
}

/// Writes `path` through a temporary file beside it, renamed into place once complete.
fn write_atomic(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>,
) -> Result<(), InitError> {
    let name = path
        .file_name()
        .and_then(|name| name.to_str())
        .unwrap_or("file");
    let temporary = path.with_file_name(format!(".{name}.tmp"));
    let result = (|| {
        let mut file = BufWriter::with_capacity(1 << 20, File::create(&temporary)?);
        write(&mut file)?;
        file.into_inner()
            .map_err(|error| error.into_error())?
            .sync_all()?;
        std::fs::rename(&temporary, path)
    })();
    result.map_err(|error| {
        let _ = std::fs::remove_file(&temporary);
        InitError::Io {
            path: path.to_path_buf(),
            error,
        }
    })
}

fn write_json(path: &Path, value: &Value) -> Result<(), InitError> {
    let mut text = serde_json::to_string_pretty(value).expect("JSON values serialize");
    text.push('\n');
    write_atomic(path, |file| file.write_all(text.as_bytes()))
}

/// `tokenizer_config.json` as Qwen2.5's (which transformers 4 and 5 both read).
fn tokenizer_config(tokenizer: &Tokenizer, config: &ModelConfig) -> Value {
    let added: serde_json::Map<String, Value> = SPECIAL_TOKENS
        .iter()
        .map(|token| {
            let id = tokenizer
                .token_to_id(token)
                .expect("special tokens are in the vocabulary");
            (
                id.to_string(),
                json!({
                    "content": token,
                    "lstrip": false,
                    "normalized": false,
                    "rstrip": false,
                    "single_word": false,
                    "special": true,
                }),
            )
        })
        .collect();
    json!({
        "add_prefix_space": false,
        "added_tokens_decoder": added,
        "additional_special_tokens": SPECIAL_TOKENS,
        "bos_token": null,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": false,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": config.max_position_embeddings,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": false,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": null,
    })
}

/// Pads `tokenizer` with added tokens `<|extra_N|>` (not special: they decode to their text) until it
/// has `vocab` ids; refuses a `vocab` below its size.
fn pad_vocabulary(tokenizer: &mut Tokenizer, vocab: usize) -> Result<(), InitError> {
    let size = tokenizer.get_vocab_size(true);
    if vocab < size {
        return Err(InitError::Usage(format!(
            "--vocab {vocab}: the offline tokenizer already has {size} ids; give {size} or more"
        )));
    }
    tokenizer
        .add_tokens((0..vocab - size).map(|n| AddedToken::from(format!("<|extra_{n}|>"), false)))
        .map_err(|error| InitError::Tokenizer(error.to_string()))?;
    match tokenizer.get_vocab_size(true) {
        padded if padded == vocab => Ok(()),
        padded => Err(InitError::Tokenizer(format!(
            "padding the vocabulary to {vocab} gave {padded} ids"
        ))),
    }
}

/// The offline Qwen2-style byte-level BPE tokenizer (see the module documentation).
pub fn build_tokenizer() -> Result<Tokenizer, InitError> {
    let error = |error: tokenizers::Error| InitError::Tokenizer(error.to_string());
    let split = Split::new(
        SplitPattern::Regex(PRETOKENIZE_REGEX.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(error)?;
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_normalizer(Some(NFC)).map_err(error)?;
    tokenizer
        .with_pre_tokenizer(Some(Sequence::new(vec![
            split.into(),
            ByteLevel::new(false, true, false).into(),
        ])))
        .with_post_processor(Some(ByteLevel::new(false, false, false)))
        .with_decoder(Some(ByteLevelDecoder::new(false, false, false)));
    let learned = VOCAB_SIZE - SPECIAL_TOKENS.len();
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(learned)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect::<HashSet<char>>())
        .build()
        .into();
    tokenizer
        .train(
            &mut trainer,
            synthetic_corpus(CORPUS_SEED, 4000).into_iter(),
        )
        .map_err(error)?;
    if tokenizer.get_vocab_size(true) != learned {
        return Err(InitError::Tokenizer(format!(
            "the corpus gave {} tokens, {learned} wanted",
            tokenizer.get_vocab_size(true)
        )));
    }
    tokenizer
        .add_special_tokens(SPECIAL_TOKENS.map(|token| AddedToken::from(token, true)))
        .map_err(error)?;
    Ok(tokenizer)
}

/// The tokenizer's training text: `n` rounds of an arithmetic fact, a question with its answer, a
/// ChatML-like exchange without the special tokens, and a line of word salad.
fn synthetic_corpus(seed: u64, n: usize) -> Vec<String> {
    const WORDS: &str = "what is the answer sum of plus minus times equals please compute result think \
        step by so we get first then add subtract number digits you are a helpful assistant user system \
        reason reasoning final correct wrong check verify multiply divide product difference total carry \
        borrow tens ones hundred thousand zero one two three four five six seven eight nine ten eleven \
        twelve twenty thirty forty fifty sixty seventy eighty ninety question problem solve solution \
        because therefore let us start with and the next value equal greater less than math arithmetic \
        integer positive negative even odd count boxed format output only write";
    let words: Vec<&str> = WORDS.split_whitespace().collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut lines = Vec::with_capacity(4 * n);
    for _ in 0..n {
        let a: i64 = rng.random_range(0..=99);
        let b: i64 = rng.random_range(0..=99);
        let (op, result) = match rng.random_range(0..3) {
            0 => ('+', a + b),
            1 => ('-', a - b),
            _ => ('*', a * b),
        };
        lines.push(format!("{a}{op}{b}={result}"));
        lines.push(format!("What is {a}{op}{b}? The answer is {result}."));
        lines.push(format!(
            "system\nYou are a helpful assistant.\nuser\nWhat is {a}{op}{b}?\nassistant\n{result}"
        ));
        let count = rng.random_range(3..=12);
        let salad: Vec<&str> = (0..count)
            .map(|_| words[rng.random_range(0..words.len())])
            .collect();
        lines.push(salad.join(" "));
    }
    lines
}

/// Streams a safetensors file (header, then each tensor's f32 little-endian bytes in `specs` order), so
/// that even the `small` preset never holds more than one tensor in memory.
fn write_safetensors(out: &mut impl Write, specs: &[ParamSpec], seed: u64) -> std::io::Result<()> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0usize;
    for spec in specs {
        let end = offset + 4 * spec.numel();
        header.insert(
            spec.name.clone(),
            json!({"dtype": "F32", "shape": spec.shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut header = serde_json::to_string(&Value::Object(header)).expect("JSON values serialize");
    // The data starts 8-aligned, as the safetensors crate writes it.
    while !header.len().is_multiple_of(8) {
        header.push(' ');
    }
    out.write_all(&(header.len() as u64).to_le_bytes())?;
    out.write_all(header.as_bytes())?;

    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut buffer = Vec::with_capacity(4 * 16384);
    for spec in specs {
        let mut remaining = spec.numel();
        let mut normal = Normal::default();
        while remaining > 0 {
            let chunk = remaining.min(16384);
            buffer.clear();
            for _ in 0..chunk {
                let value = match spec.init {
                    Init::Normal => (normal.sample(&mut rng) * INIT_STD) as f32,
                    Init::Zeros => 0.0,
                    Init::Ones => 1.0,
                    Init::LogUniform => (0.01 + rng.random::<f64>() * (16.0 - 0.01)).ln() as f32,
                };
                buffer.extend_from_slice(&value.to_le_bytes());
            }
            out.write_all(&buffer)?;
            remaining -= chunk;
        }
    }
    Ok(())
}

/// Standard normal draws by the Box–Muller transform (both values of each pair are used).
#[derive(Default)]
struct Normal {
    spare: Option<f64>,
}

impl Normal {
    fn sample(&mut self, rng: &mut impl Rng) -> f64 {
        if let Some(value) = self.spare.take() {
            return value;
        }
        // 1 - [0, 1) is in (0, 1], so the logarithm is finite.
        let radius = (-2.0 * (1.0 - rng.random::<f64>()).ln()).sqrt();
        let angle = std::f64::consts::TAU * rng.random::<f64>();
        self.spare = Some(radius * angle.sin());
        radius * angle.cos()
    }
}
