//! A memory plan before loading: the peak resident memory of a `holo train` or `holo sft` run,
//! predicted term by term from the model's sizes (`config.json` and the safetensors headers, never the
//! weights) and the run's options, so that a run that cannot fit is refused in a second instead of
//! being killed minutes later (the first complaint in TRL's and verl's trackers: memory "tuned by trial
//! and error").
//!
//! A run passes through phases that hold different things: loading (the base and the trained copy),
//! generation (the sampler's keys and values), scoring (old and reference log-probabilities),
//! training (a micro-batch's activations, the head's logits, the gradients), under recomputation the
//! backward of the layers one at a time (after the head's), and the optimizer's update.
//! From the second step on, AdamW's state lives through all of them, so each phase after loading counts
//! it: the plan is the run's steady state, whose peak is the largest phase. [`terms`] says how each
//! term follows from the code; `benches/memory_plan.py` measures the prediction against peak RSS.
//!
//! The plan is printed at the start, written to the run folder as `memory_plan.json`, and checked
//! against the memory available ([`limit`]) under `memory_check` ([`fit`]).

pub mod fit;
pub mod limit;
pub mod model;
pub mod terms;

use std::path::Path;

use candle_core::DType;
use serde_json::json;

use self::limit::{Available, GIB};
pub use self::limit::{MemoryCheck, MEMORY_CHECK_VALUES};
pub use self::model::Sizes;
use super::config::{Algorithm, GrpoConfig};
use super::sft::config::SftConfig;
use holo_model::model::{LoraConfig, LOGITS_BUDGET};

/// Tokens a chat template adds around a prompt's text (role markers, the generation prompt), counted
/// beside the rows' own bytes in [`prompt_tokens`].
pub const TEMPLATE_TOKENS: usize = 16;

/// What a plan is computed from.
#[derive(Debug, Clone, PartialEq)]
pub struct Inputs {
    pub sizes: Sizes,
    /// Bytes of one weight in the training type (4 for f32, 2 for bf16).
    pub dtype_bytes: u64,
    /// The adapters, when LoRA is trained instead of every weight.
    pub lora: Option<LoraConfig>,
    /// Sequences per micro-batch (`per_device_train_batch_size`).
    pub micro_batch: usize,
    /// Micro-batches per optimizer step (`gradient_accumulation_steps`).
    pub accumulation: usize,
    /// Sequences sampled at once (`generation_batch_size`); 0 for a run that does not sample.
    pub generation_batch: usize,
    /// Completions sampled per prompt: the step of the generation batch's values.
    pub group: usize,
    /// Tokens of a prompt, at most.
    pub prompt_tokens: usize,
    /// Tokens sampled after it, at most.
    pub completion_tokens: usize,
    /// Tokens of a sequence the loss trains.
    pub trained_tokens: usize,
    /// Activation recomputation (`gradient_checkpointing`).
    pub recompute: bool,
    /// A frozen reference model (`beta` > 0).
    pub reference: bool,
    /// Log-probabilities computed without gradient before training (old policy or reference).
    pub scores: bool,
    /// PPO's value model: a second trained copy of the policy.
    pub critic: bool,
    /// The training head's logits held at once (`LOGITS_BUDGET`).
    pub head_budget: usize,
    /// `max_off_policy_steps`: generations drawn ahead of the steps, by snapshots of the weights.
    pub ahead: u64,
    /// Bytes of the model folder's `tokenizer.json`.
    pub tokenizer_bytes: u64,
    /// The base loaded with its projections kept as a GGUF file's blocks (`--quantized`): they weigh
    /// their blocks' bytes ([`Sizes::blocks`]), and a training pass expands one at a time.
    pub quantized: bool,
}

impl Inputs {
    /// A GRPO (or PPO) run of `config` on the model of `sizes` in `dtype`, with prompts of at most
    /// `prompt_tokens` tokens.
    pub fn grpo(
        sizes: Sizes,
        config: &GrpoConfig,
        dtype: DType,
        prompt_tokens: usize,
        tokenizer_bytes: u64,
    ) -> Inputs {
        let training = &config.training;
        let generate_every = config.steps_per_generation() * config.num_iterations;
        Inputs {
            sizes,
            dtype_bytes: dtype.size_in_bytes() as u64,
            lora: training.lora(),
            micro_batch: training.per_device_train_batch_size,
            accumulation: training.gradient_accumulation_steps,
            generation_batch: config.generation_batch_size(),
            group: config.num_generations.max(1),
            prompt_tokens,
            completion_tokens: config.max_completion_length,
            trained_tokens: config.max_completion_length,
            recompute: config.gradient_checkpointing,
            reference: config.uses_reference(),
            // `Local::score`: the old policy's log-probabilities unless each generation is used by one
            // optimizer step, and the reference's.
            scores: config.uses_reference()
                || !training
                    .gradient_accumulation_steps
                    .is_multiple_of(generate_every)
                || config.algorithm == Algorithm::Ppo,
            critic: config.algorithm == Algorithm::Ppo,
            head_budget: LOGITS_BUDGET,
            ahead: config.max_off_policy_steps,
            tokenizer_bytes,
            quantized: false,
        }
    }

    /// An SFT run of `config` on `(count, tokens)` examples of at most `tokens` tokens: micro-batches of
    /// at most `count` sequences of that many tokens or `max_length`, whichever is less, every token
    /// trained; nothing sampled.
    pub fn sft(
        sizes: Sizes,
        config: &SftConfig,
        dtype: DType,
        tokenizer_bytes: u64,
        (count, tokens): (usize, usize),
    ) -> Inputs {
        let training = &config.training;
        let length = config.max_length.map_or(tokens, |max| max.min(tokens));
        Inputs {
            sizes,
            dtype_bytes: dtype.size_in_bytes() as u64,
            lora: training.lora(),
            micro_batch: training.per_device_train_batch_size.min(count.max(1)),
            accumulation: training.gradient_accumulation_steps,
            generation_batch: 0,
            group: 1,
            prompt_tokens: 0,
            completion_tokens: length,
            trained_tokens: length,
            recompute: config.gradient_checkpointing,
            reference: false,
            scores: false,
            critic: false,
            head_budget: LOGITS_BUDGET,
            ahead: 0,
            tokenizer_bytes,
            quantized: false,
        }
    }
}

/// The tokens of the longest prompt `rows` can make, bounded from above: every byte of the row's text
/// values a token (a byte-level tokenizer never makes more), and [`TEMPLATE_TOKENS`] for the template.
pub fn prompt_tokens<'a>(rows: impl IntoIterator<Item = &'a holo_core::interpreter::Row>) -> usize {
    let text = |value: &serde_json::Value| match value {
        serde_json::Value::String(text) => text.len(),
        other => other.to_string().len(),
    };
    rows.into_iter()
        .map(|row| row.values().map(text).sum::<usize>())
        .max()
        .unwrap_or(0)
        + TEMPLATE_TOKENS
}

/// The examples of the JSONL file at `path` (its lines that are not blank) and the tokens of the longest,
/// bounded from above as [`prompt_tokens`] bounds a prompt: its line's bytes (text or token ids) and
/// [`TEMPLATE_TOKENS`].
pub fn example_tokens(path: &Path) -> std::io::Result<(usize, usize)> {
    use std::io::BufRead;
    let (mut count, mut longest) = (0, 0);
    for line in std::io::BufReader::new(std::fs::File::open(path)?).lines() {
        let line = line?;
        if !line.trim().is_empty() {
            count += 1;
            longest = longest.max(line.len());
        }
    }
    Ok((count, longest + TEMPLATE_TOKENS))
}

/// A term: its name, its bytes for a run, and what it is.
type TermOf = (&'static str, fn(&Inputs) -> u64, &'static str);

/// The terms of a plan, in the order the table shows them.
const TERMS: [TermOf; 19] = [
    (
        "runtime",
        |_| terms::RUNTIME,
        "the binary, thread pools, rows",
    ),
    ("tokenizer", terms::tokenizer, "the tokenizer's tables"),
    ("weights", terms::weights, "the trained model's weights"),
    (
        "loading copy",
        |inputs| match inputs.lora {
            Some(_) => 0,
            None => terms::weights(inputs),
        },
        "the base beside its trained copy while loading",
    ),
    (
        "reference",
        terms::reference,
        "the frozen reference (beta > 0)",
    ),
    (
        "critic",
        |inputs| {
            if !inputs.critic {
                return 0;
            }
            let base = if inputs.lora.is_none() {
                terms::weights(inputs)
            } else {
                0
            };
            base + terms::gradients(inputs) + terms::optimizer(inputs) + terms::activations(inputs)
        },
        "PPO's value model, trained beside the policy",
    ),
    (
        "optimizer",
        terms::optimizer,
        "AdamW's moments and f32 masters",
    ),
    (
        "gradients",
        terms::gradients,
        "the trained weights' gradients",
    ),
    (
        "activations",
        terms::activations,
        "a micro-batch's activations kept through its backward",
    ),
    (
        "head",
        terms::head,
        "the output head's logits and gradients",
    ),
    (
        "head adapter",
        terms::head_adapter,
        "the head beside its adapter's columns, [W, B]",
    ),
    ("layer", terms::layer, "one recomputed layer's backward"),
    (
        "expansion",
        terms::expansion,
        "a projection's blocks expanded for one product",
    ),
    ("update", terms::update, "an optimizer step's temporaries"),
    ("kv cache", terms::cache, "the sampler's keys and values"),
    (
        "sampling",
        terms::sampling,
        "decoding's logits, one prefill layer",
    ),
    (
        "scoring",
        terms::scoring,
        "old and reference log-probabilities",
    ),
    (
        "snapshots",
        terms::snapshots,
        "the weights the generations drawn ahead sample with",
    ),
    (
        "drawing",
        terms::drawing,
        "the sampler drawing ahead while the steps train",
    ),
];

/// The phases of a run and the terms each holds.
const PHASES: [(&str, &[&str]); 6] = [
    // The reference is the base itself, which the loading copy counts.
    (
        "loading",
        &["runtime", "tokenizer", "weights", "loading copy"],
    ),
    // The last step's gradients live until the next training pass starts (holo-train's
    // `trainer/local.rs`: the allocator keeps their memory for that pass's gradients).
    (
        "generation",
        &[
            "runtime",
            "tokenizer",
            "weights",
            "reference",
            "critic",
            "optimizer",
            "gradients",
            "kv cache",
            "sampling",
            "snapshots",
        ],
    ),
    (
        "scoring",
        &[
            "runtime",
            "tokenizer",
            "weights",
            "reference",
            "critic",
            "optimizer",
            "gradients",
            "scoring",
            "expansion",
            "snapshots",
            "drawing",
        ],
    ),
    (
        "training",
        &[
            "runtime",
            "tokenizer",
            "weights",
            "reference",
            "critic",
            "optimizer",
            "gradients",
            "activations",
            "head",
            "head adapter",
            "expansion",
            "snapshots",
            "drawing",
        ],
    ),
    (
        "backward",
        &[
            "runtime",
            "tokenizer",
            "weights",
            "reference",
            "critic",
            "optimizer",
            "gradients",
            "activations",
            "layer",
            "head adapter",
            "expansion",
            "snapshots",
            "drawing",
        ],
    ),
    (
        "update",
        &[
            "runtime",
            "tokenizer",
            "weights",
            "reference",
            "critic",
            "optimizer",
            "gradients",
            "update",
            "snapshots",
            "drawing",
        ],
    ),
];

/// A run's predicted memory, by term and by phase.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Each term's name, bytes and what it is.
    pub terms: Vec<(&'static str, u64, &'static str)>,
}

impl Plan {
    pub fn of(inputs: &Inputs) -> Plan {
        Plan {
            terms: TERMS
                .iter()
                .map(|(name, bytes, what)| (*name, bytes(inputs), *what))
                .collect(),
        }
    }

    /// The bytes of the term `name`.
    pub fn term(&self, name: &str) -> u64 {
        self.terms
            .iter()
            .find(|(term, _, _)| *term == name)
            .map_or(0, |(_, bytes, _)| *bytes)
    }

    /// Each phase's name, terms and total bytes.
    pub fn phases(&self) -> Vec<(&'static str, &'static [&'static str], u64)> {
        PHASES
            .iter()
            .map(|(phase, held)| (*phase, *held, held.iter().map(|term| self.term(term)).sum()))
            .collect()
    }

    /// The largest phase: the predicted peak resident memory, and its phase.
    pub fn peak(&self) -> (&'static str, u64) {
        self.phases()
            .into_iter()
            .map(|(phase, _, bytes)| (phase, bytes))
            .max_by_key(|(_, bytes)| *bytes)
            .expect("phases")
    }

    /// The plan as a short table: each term that is not zero, the phases, the peak against `available`.
    pub fn table(&self, available: Option<&Available>) -> String {
        let mut text = String::from("memory plan (peak resident memory, by term):\n");
        for (name, bytes, what) in &self.terms {
            if *bytes > 0 {
                text.push_str(&format!("  {name:<13}{:>10}  {what}\n", gib(*bytes)));
            }
        }
        let (peak_phase, peak) = self.peak();
        let phases: Vec<String> = self
            .phases()
            .iter()
            .map(|(phase, _, bytes)| format!("{phase} {}", gib(*bytes)))
            .collect();
        text.push_str(&format!("  phases: {}\n", phases.join(", ")));
        text.push_str(&format!("  peak {} ({peak_phase})", gib(peak)));
        if let Some(available) = available {
            text.push_str(&format!(
                " of {} available ({})",
                gib(available.bytes),
                available.source
            ));
        }
        text
    }

    /// The plan as `memory_plan.json` holds it: the inputs' main figures, every term, the phases, the
    /// peak and the memory available.
    pub fn json(&self, inputs: &Inputs, available: Option<&Available>) -> serde_json::Value {
        let (peak_phase, peak) = self.peak();
        json!({
            "inputs": {
                "parameters": inputs.sizes.parameters,
                "trained_parameters": terms::trained(inputs),
                "dtype_bytes": inputs.dtype_bytes,
                "lora_rank": inputs.lora.as_ref().map(|lora| lora.rank),
                "lora_target_modules": inputs.lora.as_ref().map(|lora| lora.targets.clone()),
                "per_device_train_batch_size": inputs.micro_batch,
                "gradient_accumulation_steps": inputs.accumulation,
                "generation_batch_size": inputs.generation_batch,
                "prompt_tokens": inputs.prompt_tokens,
                "completion_tokens": inputs.completion_tokens,
                "gradient_checkpointing": inputs.recompute,
                "reference": inputs.reference,
                "head_budget": inputs.head_budget,
                "quantized": inputs.quantized,
            },
            "terms": self.terms.iter().map(|(name, bytes, what)| {
                json!({"name": name, "bytes": bytes, "what": what})
            }).collect::<Vec<_>>(),
            "phases": self.phases().iter().map(|(phase, held, bytes)| {
                json!({"name": phase, "terms": held, "bytes": bytes})
            }).collect::<Vec<_>>(),
            "peak": {"phase": peak_phase, "bytes": peak},
            "available": available.map(|available| json!({
                "bytes": available.bytes,
                "source": available.source,
            })),
        })
    }
}

/// `bytes` in GiB or MiB, for people.
pub fn gib(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.1} GiB", bytes as f64 / GIB)
    } else {
        format!("{:.0} MiB", bytes as f64 / (1 << 20) as f64)
    }
}

/// A plan to write into the run folder once the run has opened it (`Trainer::with_memory_plan`,
/// `SftTrainer::with_memory_plan`).
#[derive(Debug, Clone, PartialEq)]
pub struct Planned(serde_json::Value);

impl Planned {
    /// Writes `dir/memory_plan.json`.
    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let text = serde_json::to_string_pretty(&self.0).map_err(std::io::Error::other)?;
        std::fs::write(dir.join("memory_plan.json"), text + "\n")
    }
}

/// The plan of a run before its weights are loaded: printed on stderr and checked against the memory
/// available under `check`. A run that fits (or runs anyway) gets the plan to write into its folder
/// when it opens it; one refused gets the message, and its plan is written to `out` at once, for the
/// figures behind the refusal, unless `out` holds another run that this one (not `resume`) would not
/// start over (that run keeps its plan). A GGUF file is planned from its header (the config its loader
/// reads, its tensors' counts, its vocabulary); another single file has no `config.json` to plan from:
/// the plan is skipped with a note.
pub fn before_loading(
    model: &Path,
    check: MemoryCheck,
    limit_gib: Option<f64>,
    (out, resume): (&Path, bool),
    inputs: impl FnOnce(Sizes, u64) -> Inputs,
) -> Result<Option<Planned>, String> {
    if check == MemoryCheck::Off {
        return Ok(None);
    }
    if !model.is_dir() && !holo_model::gguf::is_gguf(model) {
        eprintln!(
            "note: no memory plan for a model file that is neither a folder nor GGUF \
             (`memory_check` skipped)"
        );
        return Ok(None);
    }
    let (sizes, tokenizer_bytes) = Sizes::read(model)?;
    let inputs = inputs(sizes, tokenizer_bytes);
    let plan = Plan::of(&inputs);
    let available = limit::available(limit_gib);
    eprintln!("{}", plan.table(available.as_ref()));
    let planned = Planned(plan.json(&inputs, available.as_ref()));
    let Some(available) = available else {
        eprintln!(
            "note: the memory available could not be read; set `memory_limit` to check the plan"
        );
        return Ok(Some(planned));
    };
    match fit::check(&inputs, available.bytes) {
        Ok(()) => Ok(Some(planned)),
        Err(overflow) if check == MemoryCheck::Warn => {
            eprintln!("warning: {overflow} (memory_check = \"warn\": running anyway)");
            Ok(Some(planned))
        }
        Err(overflow) => {
            if resume || !out.join(super::metrics::METRICS_FILE).exists() {
                planned.write(out).map_err(|error| {
                    format!(
                        "writing {}: {error}",
                        out.join("memory_plan.json").display()
                    )
                })?;
            }
            Err(format!(
                "{overflow}; set memory_check = \"warn\" (or \"off\") to run anyway"
            ))
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use holo_model::config::Arch;

    /// The tiny Qwen2 shapes with 2 sequences of 10 prompt and 6 completion tokens per micro-batch, 8
    /// sampled at once, f32, every weight trained, no reference.
    pub(crate) fn inputs() -> Inputs {
        let mut config = holo_model::testing::config(Arch::Qwen2);
        config.vocab_size = 512;
        config.hidden_size = 64;
        config.intermediate_size = 128;
        config.num_hidden_layers = 2;
        config.num_attention_heads = 4;
        config.num_key_value_heads = 2;
        config.head_dim = 16;
        config.tie_word_embeddings = true;
        config.qkv_bias = true;
        config.o_bias = false;
        Inputs {
            sizes: Sizes::of_config(config),
            dtype_bytes: 4,
            lora: None,
            micro_batch: 2,
            accumulation: 1,
            generation_batch: 8,
            group: 4,
            prompt_tokens: 10,
            completion_tokens: 6,
            trained_tokens: 6,
            recompute: false,
            reference: false,
            scores: false,
            critic: false,
            head_budget: LOGITS_BUDGET,
            ahead: 0,
            tokenizer_bytes: 0,
            quantized: false,
        }
    }

    /// The peak is the largest phase, each phase the sum of its terms.
    #[test]
    fn the_peak_is_the_largest_phase() {
        let plan = Plan::of(&inputs());
        let held = |terms: &[&str]| -> u64 { terms.iter().map(|term| plan.term(term)).sum() };
        let kept = [
            "runtime",
            "weights",
            "optimizer",
            "gradients",
            "activations",
        ];
        let training = held(&kept) + plan.term("head");
        // One layer's gradients outweigh the head's logits here.
        let backward = held(&kept) + plan.term("layer");
        assert!(backward > training);
        assert_eq!(plan.peak(), ("backward", backward));
        let json = plan.json(&inputs(), None);
        assert_eq!(json["peak"]["bytes"], backward);
        assert_eq!(json["terms"].as_array().unwrap().len(), TERMS.len());
    }

    #[test]
    fn a_prompt_is_bounded_by_its_rows_bytes() {
        let row = |text: &str| {
            let mut row = holo_core::interpreter::Row::new();
            row.insert("question".into(), text.into());
            row.insert("expected".into(), 42.into());
            row
        };
        let rows = [row("What is 1+2?"), row("Hi")];
        assert_eq!(prompt_tokens(&rows), 12 + 2 + TEMPLATE_TOKENS);
    }

    /// An SFT example is bounded by its line, `max_length` truncates it, and a micro-batch holds no
    /// more examples than there are.
    #[test]
    fn an_example_is_bounded_by_its_line_and_max_length() {
        let path =
            std::env::temp_dir().join(format!("holo-plan-examples-{}.jsonl", std::process::id()));
        std::fs::write(
            &path,
            "{\"text\": \"ab\"}\n\n{\"text\": \"a longer one\"}\n",
        )
        .unwrap();
        let longest = example_tokens(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(longest, (2, 24 + TEMPLATE_TOKENS));
        let sizes = inputs().sizes;
        let mut config = SftConfig::default();
        assert_eq!(config.max_length, Some(1024));
        let sft = Inputs::sft(sizes.clone(), &config, DType::F32, 0, longest);
        assert_eq!(
            (
                sft.completion_tokens,
                sft.trained_tokens,
                sft.generation_batch
            ),
            (40, 40, 0)
        );
        // Two examples: micro-batches of 8 hold 2.
        assert_eq!(sft.micro_batch, 2);
        config.max_length = Some(30);
        let sft = Inputs::sft(sizes, &config, DType::F32, 0, longest);
        assert_eq!(sft.trained_tokens, 30);
    }
}
