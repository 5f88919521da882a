//! What a sampled text must match (a [`Constraint`], a sampler tag's or a request's), what it allowed
//! at a position ([`Allowed`]), and the runs of a context drawn under one ([`Constrained`]): plain data
//! that the samplers enforce, the Holophore records and the trainer replays.

use std::fmt;
use std::sync::Arc;

use holoc::ir::ConstraintArgument;
use serde::{Deserialize, Serialize};

/// A language the completion must belong to. The local model masks, at every step, the tokens that
/// cannot continue a sentence of it, and allows its end-of-turn tokens only where a sentence is complete,
/// so that a completion that ends its turn is always in the language (one cut by `max_tokens` or a stop
/// string may not be). The log-probabilities it reports are those of the masked distribution.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Constraint {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON that validates against a JSON schema (OpenAI's `json_schema`, vLLM's `guided_json`).
    JsonSchema(serde_json::Value),
    /// Text that the regular expression matches whole (vLLM's `guided_regex`).
    Regex(String),
    /// One of these texts exactly (vLLM's `guided_choice`).
    Choice(Vec<String>),
    /// A context-free grammar in the Lark syntax that llguidance reads (vLLM's `guided_grammar`):
    /// its `start` rule, with `%json {schema}` for embedded JSON and `<[id]>` for a token by id.
    Lark(String),
}

impl Constraint {
    /// The name clients know it by, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Constraint::JsonObject => "a JSON object",
            Constraint::JsonSchema(_) => "a JSON schema",
            Constraint::Regex(_) => "a regular expression",
            Constraint::Choice(_) => "a choice",
            Constraint::Lark(_) => "a Lark grammar",
        }
    }

    /// The constraint of a sampler tag's `json_schema=name`, `regex=name` or `grammar=name`
    /// ([`holoc::ir::Sample::constraint_variable`]) whose variable holds `value` (`None`: no value),
    /// inside `fence` when the tag has one, lowered as holoc lowers the same text written in the tag; or
    /// why it cannot be, naming the variable.
    pub fn of_variable(
        argument: ConstraintArgument,
        variable: &str,
        value: Option<&str>,
        fence: Option<&str>,
    ) -> Result<Constraint, String> {
        let name = argument.name();
        let value = value.ok_or_else(|| {
            format!("`{variable}`, the sampler's {name}, has no value: the data row lacks it")
        })?;
        argument
            .constraint(value, fence)
            .map(|written| Constraint::from(&written))
            .map_err(|problem| {
                format!(
                    "`{variable}`, the sampler's {name}, is not {}: {problem}",
                    argument.what()
                )
            })
    }
}

/// The tokens a [`Constraint`] allowed at one position of a completion: a bit per entry of the model's
/// logits. The trainer masks its logits there with it, as the sampler masked them
/// (holo-model's `Grammar::replay` gives them).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Allowed {
    /// Bit `id % 32` of word `id / 32` is set where token `id` is allowed.
    words: Arc<[u32]>,
    len: usize,
}

impl fmt::Debug for Allowed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let count: u32 = self.words.iter().map(|word| word.count_ones()).sum();
        write!(f, "Allowed({count} of {} tokens)", self.len)
    }
}

impl Allowed {
    /// The set of `len` tokens whose bits `words` holds (bit `id % 32` of word `id / 32`).
    pub fn from_words(words: &[u32], len: usize) -> Allowed {
        let mut words = words[..len.div_ceil(32).min(words.len())].to_vec();
        words.resize(len.div_ceil(32), 0);
        Allowed {
            words: words.into(),
            len,
        }
    }

    /// The tokens `ids` out of `len`.
    pub fn of(ids: &[u32], len: usize) -> Allowed {
        let mut words = vec![0u32; len.div_ceil(32)];
        for &id in ids.iter().filter(|&&id| (id as usize) < len) {
            words[id as usize / 32] |= 1 << (id % 32);
        }
        Allowed {
            words: words.into(),
            len,
        }
    }

    /// Whether `self` and `other` share one copy of their bits (a clone, or one interned).
    pub fn shares_bits(&self, other: &Allowed) -> bool {
        Arc::ptr_eq(&self.words, &other.words)
    }

    /// Whether token `id` is allowed (an id past the set's tokens is not).
    pub fn contains(&self, id: usize) -> bool {
        id < self.len && self.words[id / 32] & (1 << (id % 32)) != 0
    }
}

/// A sampler tag's constraint as holoc checked it. A schema's text was checked to parse; were it not
/// JSON, the schema `false` stands for it, which allows nothing and which every sampler refuses.
impl From<&holoc::ir::Constraint> for Constraint {
    fn from(constraint: &holoc::ir::Constraint) -> Constraint {
        use holoc::ir::Constraint as Written;
        match constraint {
            Written::JsonObject => Constraint::JsonObject,
            Written::JsonSchema(text) => Constraint::JsonSchema(
                serde_json::from_str(text).unwrap_or(serde_json::Value::Bool(false)),
            ),
            Written::Regex(regex) => Constraint::Regex(regex.clone()),
            Written::Choice(choices) => Constraint::Choice(choices.clone()),
            Written::Grammar(grammar) => Constraint::Lark(grammar.clone()),
        }
    }
}

/// Sampled tokens `start..start + len` of a context, drawn under `constraint` from its start: the
/// tokens the constraint allowed at each of these positions are those its parser allows after the
/// tokens before them in the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Constrained {
    pub start: usize,
    pub len: usize,
    pub constraint: Constraint,
}
