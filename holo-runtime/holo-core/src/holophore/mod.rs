//! The [`Holophore`]: a [`Recorder`] that builds each context of a rollout in token space, exactly as the
//! model sees it and as training consumes it.
//!
//! A context is a sequence of [`Fragment`]s, each `(role, token ids, trainable, logprobs)`:
//!
//! - **frames** ([`FragmentKind::Frame`]): the text the chat template puts around message contents (role
//!   headers, footers, BOS, a default system prompt, the generation prompt), tokenized once when the
//!   Holophore is built; never trainable;
//! - **prompt text** ([`FragmentKind::Prompt`]): what [`Recorder::text`] appends. Text is buffered and
//!   tokenized once, lazily: when the message closes, when a completion follows it in the same message, or
//!   when [`Holophore::prompt_ids`] hands the context to a sampler (so what the sampler saw is what is
//!   recorded). Never trainable;
//! - **sampled tokens** ([`FragmentKind::Sampled`]): a completion's [`Completion::tokens`], appended verbatim
//!   with its logprobs; trainable when the context is trained. A completion without tokens (a text-only
//!   sampler) is tokenized from its text ([`FragmentKind::Retokenized`]): trainable, but flagged, and without
//!   logprobs unless the sampler gave exactly one per re-tokenized token.
//!
//! # Frames
//!
//! [`Holophore::new`] derives the frames by rendering probe conversations whose contents are unique markers
//! through the [`ChatTemplate`], and cutting the output at the markers:
//!
//! - `opening[r]`: the text before the content of a conversation that starts with role `r` — BOS, a default
//!   system prompt the template adds when the first message is not a system message, and `r`'s header;
//! - `gap[a][b]`: the text between a message of role `a` and the next message of role `b` (`a`'s footer and
//!   `b`'s header, tokenized as one string, as the template renders them);
//! - `closing[r]`: the text after the last message when it has role `r` (its footer);
//! - `generation[a]`: the text after the last message (role `a`) with `add_generation_prompt`: `a`'s footer
//!   and the generation prompt; `opening[assistant]` when a context starts with the model's turn.
//!
//! Every frame is checked with three-message probes over all role orders: frames suffice for templates
//! whose frames depend only on the roles of a message and of its neighbour: ChatML, Qwen2.5-style default
//! system prompts, a BOS token at the start (the parity fixtures cover these three); Llama-3-style headers
//! have the same shape. Templates that transform contents (`| trim`) render the markers unchanged, so such
//! transformations are not applied: contents are recorded as given.
//!
//! # Re-rendered contexts
//!
//! Templates whose frames depend on more than the roles are rendered whole instead: those whose frames depend
//! on the position of a message or on its content, that raise on some role order, or whose generation prompt
//! differs from the header of an assistant turn inside the conversation. Qwen3's template drops the `<think>`
//! blocks of assistant turns before the last user message (and with `enable_thinking=false` its generation
//! prompt ends in an empty think block); Gemma 3's has no system role (the system message is folded into the
//! first user turn) and requires user/assistant alternation. Then every sample request renders the context's
//! messages with the template (`add_generation_prompt`, or `continue_final_message` when the model continues
//! an assistant message), as transformers' `apply_chat_template` would, and:
//!
//! - when the rendering extends the text the context's tokens stand for (its earlier renderings and the
//!   decoded sampled tokens), only the new text is tokenized and appended (one [`FragmentKind::Prompt`]
//!   fragment): the context grows as in frame mode;
//! - when it does not (Qwen3 at the second user turn: the first turn's thinking is gone from the rendering),
//!   the context is **split**: the context so far ends after its last completion (with the footer the
//!   template renders there, when that extends it), and a new context of the same kind starts with the whole
//!   rendering tokenized as its prompt. Each context is trained exactly as the model saw it; sampled tokens are
//!   never re-tokenized, and earlier turns appear in the new context only as prompt, as the template renders
//!   them. [`Context::source`] and [`Context::completions`] say which of the holoware's contexts, and which of
//!   its completions, each recorded context holds.
//!
//! A template that raises on a sample request's conversation (Gemma 3 on two user messages in a row) leaves the
//! error in [`Holophore::errors`], and the rollout fails naming it.
//!
//! # Native tool calls
//!
//! [`Recorder::offer_tools`] hands the tools to the template (`tools`, as transformers'
//! `apply_chat_template(..., tools=...)`); from then on the Holophore renders contexts whole, as above,
//! since the tools change the conversation from its first turn. [`Recorder::tool_calls`] marks the last
//! assistant message as making calls, rendered with its `tool_calls` ([`ToolTurn::Calls`]), and
//! [`Recorder::tool_result`] appends a `tool` message ([`ToolTurn::Result`]). Both reach the tokens only
//! through the next rendering: when it extends what the model saw (the template writes the calls as the
//! model wrote them), the results are appended as prompt; when it does not (other JSON spacing, Qwen3
//! dropping an empty think block, gpt-oss's template writing a call's recipient before its channel), the
//! context is split. Tool messages are prompt, never trained. Calls go to the template with their ids
//! (`tool_calls[].id`, and a result's `tool_call_id`: Mistral's templates write them), and a harmony
//! reply's reasoning as the calling turn's `thinking` (gpt-oss's template writes it as an `analysis`
//! message while no final answer follows). [`Recorder::written`] gives the last completion decoded with
//! its special tokens, where the formats whose markers are special tokens read their calls.
//!
//! # Template arguments
//!
//! [`Holophore::with_template_kwargs`] renders every probe and context with extra template variables
//! (transformers' `apply_chat_template(**kwargs)`, vLLM's `chat_template_kwargs`), such as Qwen3's
//! `enable_thinking`.
//!
//! Parity with `apply_chat_template(messages, tokenize=True)` holds when tokenizing the rendered string in
//! pieces (frames, contents) gives the same ids as tokenizing it whole — true whenever the frames are cut at
//! special tokens or at pre-tokenizer boundaries, as for ChatML and Llama-3 with ordinary contents. A content
//! that starts or ends with whitespace that a frame's whitespace would merge with is the usual exception;
//! then the Holophore's ids are still what the sampler saw, which is what training needs.
//!
//! # End of turn
//!
//! When a sampler's tokens end with the special tokens a frame starts with (a completion ending in
//! `<|im_end|>`, the model's end of turn), the frame that follows does not repeat them: they stay in the
//! sampled fragment, trainable, so the model learns to end its turn. Only special tokens (added tokens marked
//! special) are merged this way.
//!
//! # Exports
//!
//! Per [`Context`]: [`Context::ids`], [`Context::loss_mask`] (1 exactly on sampled tokens of trained
//! contexts), [`Context::logprobs`] (aligned to the ids, 0 where not sampled), [`Context::messages`] (the
//! messages view); per rollout [`Holophore::rewards`] and [`Holophore::reward`]; for the next sample request,
//! [`Holophore::prompt_ids`]. Contexts are closed (their final footer appended) by the next
//! [`Recorder::begin_context`] and by [`Holophore::finish`].
//!
//! [`Holophore::render`] (and [`render_contexts`] for exported ids and masks, such as the Loom's JSONL)
//! shows a rollout as the model saw it, token by token, with the loss mask highlighted: `holo dry --model`.
//! [`Holophore::from_dir`] builds a Holophore from a model folder (`tokenizer.json` and the chat template).

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use minijinja::Value;
use tokenizers::Tokenizer;

use crate::chat::{ChatTemplate, ChatTemplateError, RenderOptions};
use crate::constraint::Constrained;
use crate::machine::{
    feedback_of, reward_of, set_feedback, set_reward, Completion, Finish, Recorder, TemplateArg,
};
use crate::sampler::ChatMessage;
use crate::tools::{ToolFormat, ToolReply};
use crate::Role;

mod arguments;
mod tools;

pub use crate::tools::ToolTurn;

const ROLES: [Role; 3] = [Role::System, Role::User, Role::Assistant];

fn index(role: Role) -> usize {
    match role {
        Role::System => 0,
        Role::User => 1,
        Role::Assistant => 2,
    }
}

/// Why a Holophore could not be built for a chat template.
#[derive(Debug)]
pub enum HolophoreError {
    /// A probe conversation failed to render (the template raised, e.g. on a role order it refuses).
    Render {
        probe: String,
        error: ChatTemplateError,
    },
    /// The template's frames are not a function of the roles alone.
    Unsupported(String),
    /// The tokenizer failed on a frame.
    Tokenizer(String),
    /// A model folder's tokenizer or chat template could not be loaded ([`Holophore::from_dir`]).
    Model(String),
}

impl fmt::Display for HolophoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HolophoreError::Render { probe, error } => {
                write!(f, "chat template probe {probe} failed: {error}")
            }
            HolophoreError::Unsupported(message) => {
                write!(f, "chat template not supported by the holophore: {message}")
            }
            HolophoreError::Tokenizer(message) => write!(f, "tokenizer: {message}"),
            HolophoreError::Model(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for HolophoreError {}

/// What a fragment holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FragmentKind {
    /// Chat-template text around contents.
    Frame,
    /// Prompt text ([`Recorder::text`]).
    Prompt,
    /// A completion's tokens, verbatim.
    Sampled,
    /// A completion given as text only, tokenized by the Holophore.
    Retokenized,
}

/// A run of tokens of one kind in one message.
#[derive(Debug, Clone, PartialEq)]
pub struct Fragment {
    pub role: Role,
    pub kind: FragmentKind,
    pub ids: Vec<u32>,
    /// Whether the loss covers these tokens: sampled tokens of a trained context.
    pub trainable: bool,
    /// The sampler's log-probability of each token, for sampled fragments that have them.
    pub logprobs: Option<Vec<f32>>,
}

/// A message of the messages view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The role; a `tool` message (`tool` is [`ToolTurn::Result`]) has [`Role::User`], the side of the
    /// conversation it is on.
    pub role: Role,
    pub content: String,
    /// What the message is to native tool calls, if anything.
    pub tool: Option<ToolTurn>,
}

/// One context: what one sequence of sample requests saw.
#[derive(Debug, Clone, PartialEq)]
pub struct Context {
    pub trained: bool,
    pub fragments: Vec<Fragment>,
    /// The holoware's context this one records (0-based, in the order they began): the same for the
    /// contexts a split makes of one (see "Re-rendered contexts" in the [module documentation](self)).
    pub source: usize,
    /// Which completions of the holoware's context (numbered from 0 in the order they came) this context
    /// holds as sampled tokens; earlier ones appear in it as prompt only.
    pub completions: Range<usize>,
    messages: Vec<Message>,
    /// Prompt text not yet tokenized (of the last message).
    pending_text: String,
    /// Whether the final footer has been appended.
    closed: bool,
    /// Re-rendered contexts: the text the ids stand for (the renderings and the decoded sampled tokens).
    rendered: String,
    /// Re-rendered contexts: the number of messages and the length of the last one's content right after
    /// the last completion (where a split ends the context).
    mark: (usize, usize),
    /// The experts a mixture-of-experts sampler routed each token through, by position (see
    /// [`Completion::routes`]); shorter than the ids, or empty, where none were recorded.
    routes: Vec<Vec<u32>>,
    /// The runs of sampled tokens drawn under a constraint ([`Completion::constraint`]), in order.
    pub constraints: Vec<Constrained>,
}

impl Context {
    fn new(trained: bool, source: usize, first_completion: usize) -> Self {
        Context {
            trained,
            fragments: Vec::new(),
            source,
            completions: first_completion..first_completion,
            messages: Vec::new(),
            pending_text: String::new(),
            closed: false,
            rendered: String::new(),
            mark: (0, 0),
            routes: Vec::new(),
            constraints: Vec::new(),
        }
    }

    /// The experts the sampler routed each token through, aligned with [`Context::ids`] (empty where
    /// not recorded); `None` when no token's were.
    pub fn routes(&self) -> Option<Vec<Vec<u32>>> {
        if self.routes.iter().all(Vec::is_empty) {
            return None;
        }
        let mut routes = self.routes.clone();
        routes.resize(self.ids().len(), Vec::new());
        Some(routes)
    }

    /// The token ids of the context.
    pub fn ids(&self) -> Vec<u32> {
        self.fragments
            .iter()
            .flat_map(|f| f.ids.iter().copied())
            .collect()
    }

    /// 1 on each trainable (sampled, trained-context) token, 0 elsewhere; aligned with [`Context::ids`].
    pub fn loss_mask(&self) -> Vec<u8> {
        self.fragments
            .iter()
            .flat_map(|f| std::iter::repeat_n(u8::from(f.trainable), f.ids.len()))
            .collect()
    }

    /// The sampler's logprob of each sampled token, 0 elsewhere (and where the sampler gave none).
    pub fn logprobs(&self) -> Vec<f32> {
        let mut out = Vec::new();
        for fragment in &self.fragments {
            match &fragment.logprobs {
                Some(logprobs) => out.extend_from_slice(logprobs),
                None => out.extend(std::iter::repeat_n(0.0, fragment.ids.len())),
            }
        }
        out
    }

    /// The sampled token ids in order (both [`FragmentKind::Sampled`] and [`FragmentKind::Retokenized`]).
    pub fn sampled_ids(&self) -> Vec<u32> {
        self.fragments
            .iter()
            .filter(|f| matches!(f.kind, FragmentKind::Sampled | FragmentKind::Retokenized))
            .flat_map(|f| f.ids.iter().copied())
            .collect()
    }

    /// The messages view: role and text content of each message, in order.
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// The messages view as sampler chat messages.
    pub fn chat_messages(&self) -> Vec<ChatMessage> {
        self.messages
            .iter()
            .map(|m| ChatMessage {
                role: m.role,
                content: m.content.clone(),
            })
            .collect()
    }

    /// Whether some completion of this context was re-tokenized from text.
    pub fn retokenized(&self) -> bool {
        self.fragments
            .iter()
            .any(|f| f.kind == FragmentKind::Retokenized)
    }

    /// Whether the context's final footer has been appended.
    pub fn is_closed(&self) -> bool {
        self.closed
    }
}

/// The frames of a chat template, tokenized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frames {
    pub opening: [Vec<u32>; 3],
    pub gap: [[Vec<u32>; 3]; 3],
    pub closing: [Vec<u32>; 3],
    pub generation: [Vec<u32>; 3],
}

impl Frames {
    /// The tokens every assistant message starts with, wherever it is in a context: the longest common
    /// suffix of the frames that open one (`generation[*]`, `opening[assistant]`), e.g.
    /// `<|im_start|>assistant\n` for ChatML. Counting it in a token prompt counts the assistant turns
    /// ([`crate::Scripted`] does). Empty when the template marks no assistant header.
    pub fn assistant_header(&self) -> Vec<u32> {
        let frames = [
            &self.generation[0],
            &self.generation[1],
            &self.generation[2],
            &self.opening[index(Role::Assistant)],
        ];
        let shortest = frames.iter().map(|f| f.len()).min().unwrap_or(0);
        let common = (0..shortest)
            .take_while(|&k| {
                let id = frames[0][frames[0].len() - 1 - k];
                frames.iter().all(|f| f[f.len() - 1 - k] == id)
            })
            .count();
        frames[0][frames[0].len() - common..].to_vec()
    }
}

/// Records a rollout in token space; see the module documentation.
pub struct Holophore {
    tokenizer: Arc<Tokenizer>,
    /// The frames, or `None` when contexts are re-rendered at each sample request.
    frames: Option<Arc<Frames>>,
    /// The template and its arguments, for re-rendered contexts.
    rendering: Arc<Rendering>,
    special: Arc<HashSet<u32>>,
    contexts: Vec<Context>,
    /// How many of the holoware's contexts have begun.
    sources: usize,
    /// The role of the message that starts with the next content.
    pending: Option<Role>,
    rewards: Vec<(String, f64, f64)>,
    feedback: Vec<(String, String)>,
    errors: Vec<String>,
    /// The format of the native tool calls offered ([`Recorder::offer_tools`]), if any.
    tool_format: Option<ToolFormat>,
    /// The format a holoware that leaves it open reads calls in ([`Holophore::with_tool_format`]).
    default_tool_format: Option<ToolFormat>,
    /// While a context renders with template arguments of its own ([`Recorder::template_arguments`]):
    /// the run's rendering and frames, which the next context goes back to.
    restore: Option<(Arc<Rendering>, Option<Arc<Frames>>)>,
    /// The last completion's text and the tokens it stands for, less a special end-of-turn token
    /// ([`Recorder::written`]).
    last_written: Option<(String, Vec<u32>)>,
}

impl fmt::Debug for Holophore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Holophore")
            .field("contexts", &self.contexts)
            .field("pending", &self.pending)
            .field("rewards", &self.rewards)
            .field("feedback", &self.feedback)
            .field("errors", &self.errors)
            .finish_non_exhaustive()
    }
}

fn marker(i: usize) -> String {
    format!("HOLOPHOREMARKER{i}X")
}

struct Probe {
    /// Text before the first content, between consecutive contents, and after the last one.
    pieces: Vec<String>,
}

/// What re-rendered contexts render with.
struct Rendering {
    template: Arc<ChatTemplate>,
    /// `add_generation_prompt` and the template arguments.
    generation: RenderOptions,
    /// `continue_final_message` and the template arguments.
    continuation: RenderOptions,
    /// No generation prompt, and the template arguments.
    closing: RenderOptions,
    /// [`Holophore::assistant_header`].
    header: Vec<u32>,
}

impl Rendering {
    fn new(template: Arc<ChatTemplate>, variables: &BTreeMap<String, Value>) -> Self {
        let with = |options: RenderOptions| RenderOptions {
            variables: variables.clone(),
            ..options
        };
        Rendering {
            template,
            generation: with(RenderOptions::generation()),
            continuation: with(RenderOptions::continuation()),
            closing: with(RenderOptions::default()),
            header: Vec::new(),
        }
    }

    /// The same rendering with each of its options changed by `change`, and `header` as the assistant
    /// header (native tools, a context's own template arguments).
    fn changed(
        &self,
        change: impl Fn(&RenderOptions) -> RenderOptions,
        header: Vec<u32>,
    ) -> Rendering {
        Rendering {
            template: Arc::clone(&self.template),
            generation: change(&self.generation),
            continuation: change(&self.continuation),
            closing: change(&self.closing),
            header,
        }
    }

    fn render(&self, messages: &[Message], options: &RenderOptions) -> Result<String, String> {
        let values = messages.iter().map(tools::message_value).collect();
        self.template
            .render_values(values, options)
            .map_err(|error| error.to_string())
    }
}

fn probe(
    template: &ChatTemplate,
    roles: &[Role],
    generation: bool,
    variables: &BTreeMap<String, Value>,
) -> Result<Probe, HolophoreError> {
    let messages: Vec<ChatMessage> = roles
        .iter()
        .enumerate()
        .map(|(i, &role)| ChatMessage {
            role,
            content: marker(i),
        })
        .collect();
    let name = format!(
        "[{}]{}",
        roles
            .iter()
            .map(|r| r.name())
            .collect::<Vec<_>>()
            .join(", "),
        if generation {
            " + generation prompt"
        } else {
            ""
        }
    );
    let options = RenderOptions {
        variables: variables.clone(),
        ..if generation {
            RenderOptions::generation()
        } else {
            RenderOptions::default()
        }
    };
    let text = template
        .render(&messages, &options)
        .map_err(|error| HolophoreError::Render {
            probe: name.clone(),
            error,
        })?;
    let mut pieces = Vec::new();
    let mut rest = text.as_str();
    for i in 0..roles.len() {
        let m = marker(i);
        let Some(at) = rest.find(&m) else {
            return Err(HolophoreError::Unsupported(format!(
                "probe {name}: the content of message {i} is not rendered verbatim"
            )));
        };
        pieces.push(rest[..at].to_string());
        rest = &rest[at + m.len()..];
        if rest.contains(&m) {
            return Err(HolophoreError::Unsupported(format!(
                "probe {name}: the content of message {i} is rendered twice"
            )));
        }
    }
    pieces.push(rest.to_string());
    Ok(Probe { pieces })
}

fn same(what: &str, expected: &str, got: &str) -> Result<(), HolophoreError> {
    if expected == got {
        Ok(())
    } else {
        Err(HolophoreError::Unsupported(format!(
            "{what}: {got:?} where {expected:?} was derived"
        )))
    }
}

/// The frame texts of a chat template (before tokenization).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameTexts {
    pub opening: [String; 3],
    pub gap: [[String; 3]; 3],
    pub closing: [String; 3],
    pub generation: [String; 3],
}

impl FrameTexts {
    /// Derives and checks the frames of `template`; see the module documentation.
    pub fn derive(template: &ChatTemplate) -> Result<Self, HolophoreError> {
        FrameTexts::derive_with(template, &BTreeMap::new())
    }

    /// [`FrameTexts::derive`] with template arguments (`enable_thinking`, ...) in every probe.
    pub fn derive_with(
        template: &ChatTemplate,
        variables: &BTreeMap<String, Value>,
    ) -> Result<Self, HolophoreError> {
        let probe =
            |roles: &[Role], generation: bool| probe(template, roles, generation, variables);
        let mut opening: [String; 3] = Default::default();
        let mut closing: [String; 3] = Default::default();
        let mut generation: [String; 3] = Default::default();
        let mut gap: [[String; 3]; 3] = Default::default();
        for a in ROLES {
            let p = probe(&[a], false)?;
            opening[index(a)] = p.pieces[0].clone();
            closing[index(a)] = p.pieces[1].clone();
            let g = probe(&[a], true)?;
            same(
                &format!("opening of [{}] with generation prompt", a.name()),
                &opening[index(a)],
                &g.pieces[0],
            )?;
            generation[index(a)] = g.pieces[1].clone();
        }
        for a in ROLES {
            for b in ROLES {
                let p = probe(&[a, b], false)?;
                let what = format!("[{}, {}]", a.name(), b.name());
                same(
                    &format!("opening of {what}"),
                    &opening[index(a)],
                    &p.pieces[0],
                )?;
                same(
                    &format!("closing of {what}"),
                    &closing[index(b)],
                    &p.pieces[2],
                )?;
                gap[index(a)][index(b)] = p.pieces[1].clone();
            }
        }
        for a in ROLES {
            same(
                &format!(
                    "generation prompt after {} (vs. an assistant turn after it)",
                    a.name()
                ),
                &gap[index(a)][index(Role::Assistant)],
                &generation[index(a)],
            )?;
            for b in ROLES {
                for c in ROLES {
                    let p = probe(&[a, b, c], false)?;
                    let what = format!("[{}, {}, {}]", a.name(), b.name(), c.name());
                    same(
                        &format!("opening of {what}"),
                        &opening[index(a)],
                        &p.pieces[0],
                    )?;
                    same(
                        &format!("first gap of {what}"),
                        &gap[index(a)][index(b)],
                        &p.pieces[1],
                    )?;
                    same(
                        &format!("second gap of {what}"),
                        &gap[index(b)][index(c)],
                        &p.pieces[2],
                    )?;
                    same(
                        &format!("closing of {what}"),
                        &closing[index(c)],
                        &p.pieces[3],
                    )?;
                }
            }
        }
        Ok(FrameTexts {
            opening,
            gap,
            closing,
            generation,
        })
    }
}

fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, HolophoreError> {
    if text.is_empty() {
        return Ok(Vec::new());
    }
    tokenizer
        .encode(text, false)
        .map(|encoding| encoding.get_ids().to_vec())
        .map_err(|error| HolophoreError::Tokenizer(error.to_string()))
}

fn tokenize_frames(tokenizer: &Tokenizer, texts: &FrameTexts) -> Result<Frames, HolophoreError> {
    let enc = |text: &String| encode(tokenizer, text);
    let map3 = |texts: &[String; 3]| -> Result<[Vec<u32>; 3], HolophoreError> {
        Ok([enc(&texts[0])?, enc(&texts[1])?, enc(&texts[2])?])
    };
    Ok(Frames {
        opening: map3(&texts.opening)?,
        gap: [
            map3(&texts.gap[0])?,
            map3(&texts.gap[1])?,
            map3(&texts.gap[2])?,
        ],
        closing: map3(&texts.closing)?,
        generation: map3(&texts.generation)?,
    })
}

/// The assistant header of a re-rendered template: what the generation prompt after a user message and
/// an assistant turn after a user message inside a conversation both start with, less the user message's
/// footer (`<|im_start|>assistant\n` for Qwen3, `<start_of_turn>model\n` for Gemma 3). A template that
/// cannot render a user message with a generation prompt is refused here.
fn rendered_header(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    variables: &BTreeMap<String, Value>,
) -> Result<Vec<u32>, HolophoreError> {
    let generation = probe(template, &[Role::User], true, variables)?;
    let Ok(turns) = probe(
        template,
        &[Role::User, Role::Assistant, Role::User],
        false,
        variables,
    ) else {
        return Ok(Vec::new());
    };
    let closing = probe(template, &[Role::User], false, variables)
        .map(|p| p.pieces[1].clone())
        .unwrap_or_default();
    let (a, b) = (&generation.pieces[1], &turns.pieces[1]);
    let common: usize = a
        .chars()
        .zip(b.chars())
        .take_while(|(x, y)| x == y)
        .map(|(x, _)| x.len_utf8())
        .sum();
    let header = &a[..common];
    let header = header.strip_prefix(closing.as_str()).unwrap_or(header);
    encode(tokenizer, header)
}

impl Holophore {
    /// A Holophore for a model's tokenizer and chat template: derives and tokenizes the frames once, or
    /// re-renders contexts when the template's frames depend on more than the roles (see the module
    /// documentation).
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        template: Arc<ChatTemplate>,
    ) -> Result<Self, HolophoreError> {
        Holophore::with_template_kwargs(tokenizer, template, BTreeMap::new())
    }

    /// [`Holophore::new`] rendering with template arguments (transformers' `apply_chat_template(**kwargs)`,
    /// e.g. `enable_thinking`; [`crate::chat::parse_template_kwargs`] reads them from JSON).
    pub fn with_template_kwargs(
        tokenizer: Arc<Tokenizer>,
        template: Arc<ChatTemplate>,
        kwargs: BTreeMap<String, Value>,
    ) -> Result<Self, HolophoreError> {
        let mut rendering = Rendering::new(Arc::clone(&template), &kwargs);
        let frames = match FrameTexts::derive_with(&template, &kwargs) {
            Ok(texts) => Some(Arc::new(tokenize_frames(&tokenizer, &texts)?)),
            Err(HolophoreError::Unsupported(_) | HolophoreError::Render { .. }) => {
                rendering.header = rendered_header(&tokenizer, &template, &kwargs)?;
                None
            }
            Err(error) => return Err(error),
        };
        let special = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect();
        Ok(Holophore {
            tokenizer,
            frames,
            rendering: Arc::new(rendering),
            special: Arc::new(special),
            contexts: Vec::new(),
            sources: 0,
            pending: None,
            rewards: Vec::new(),
            feedback: Vec::new(),
            errors: Vec::new(),
            tool_format: None,
            default_tool_format: None,
            restore: None,
            last_written: None,
        })
    }

    /// Reads native tool calls in `format` where a holoware leaves the format open
    /// (`<|ToolSchema parser=auto|>`), instead of the one the chat template writes: a run's
    /// `tool_call_parser`, as vLLM's `--tool-call-parser` names it for a server.
    pub fn with_tool_format(mut self, format: ToolFormat) -> Self {
        self.default_tool_format = Some(format);
        self
    }

    /// A Holophore for a model folder: its `tokenizer.json`, and its chat template and special tokens
    /// ([`ChatTemplate::from_dir`]: `chat_template.jinja` or `tokenizer_config.json`).
    pub fn from_dir(dir: impl AsRef<std::path::Path>) -> Result<Self, HolophoreError> {
        Holophore::from_dir_with(dir, BTreeMap::new())
    }

    /// [`Holophore::from_dir`] with template arguments ([`Holophore::with_template_kwargs`]).
    pub fn from_dir_with(
        dir: impl AsRef<std::path::Path>,
        kwargs: BTreeMap<String, Value>,
    ) -> Result<Self, HolophoreError> {
        let dir = dir.as_ref();
        let file = dir.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&file).map_err(|error| {
            HolophoreError::Model(format!("cannot load `{}`: {error}", file.display()))
        })?;
        let template = ChatTemplate::from_dir(dir).map_err(|error| {
            HolophoreError::Model(format!("cannot load the chat template: {error}"))
        })?;
        Holophore::with_template_kwargs(Arc::new(tokenizer), Arc::new(template), kwargs)
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// A fresh Holophore for another rollout, sharing the tokenizer, the template and the frames.
    pub fn fork(&self) -> Self {
        Holophore {
            tokenizer: Arc::clone(&self.tokenizer),
            frames: self.frames.clone(),
            rendering: Arc::clone(&self.rendering),
            special: Arc::clone(&self.special),
            contexts: Vec::new(),
            sources: 0,
            pending: None,
            rewards: Vec::new(),
            feedback: Vec::new(),
            errors: Vec::new(),
            tool_format: None,
            default_tool_format: self.default_tool_format,
            restore: None,
            last_written: None,
        }
    }

    /// The tokenized frames; `None` when the template's contexts are re-rendered at each sample request.
    pub fn frames(&self) -> Option<&Frames> {
        self.frames.as_deref()
    }

    /// The template arguments every rendering gets.
    pub fn template_kwargs(&self) -> &BTreeMap<String, Value> {
        &self.rendering.generation.variables
    }

    /// The tokens every assistant message starts with, wherever it is in a context
    /// ([`Frames::assistant_header`]; for re-rendered templates, the header of an assistant turn inside a
    /// conversation that the generation prompt also starts with). Counting it in a token prompt counts the
    /// assistant turns ([`crate::Scripted`] does). Empty when the template marks no assistant header.
    pub fn assistant_header(&self) -> Vec<u32> {
        match &self.frames {
            Some(frames) => frames.assistant_header(),
            None => self.rendering.header.clone(),
        }
    }

    /// The contexts so far; the last one stays open (without its final footer) until [`Holophore::finish`].
    pub fn contexts(&self) -> &[Context] {
        &self.contexts
    }

    /// Reward components in the order they were first recorded: name, value, weight.
    pub fn rewards(&self) -> &[(String, f64, f64)] {
        &self.rewards
    }

    /// Feedback on reward components in the order it was first recorded: name, text.
    pub fn feedback(&self) -> &[(String, String)] {
        &self.feedback
    }

    /// The rollout's reward: the weighted sum of its components.
    pub fn reward(&self) -> f64 {
        self.rewards.iter().map(|(_, v, w)| v * w).sum::<f64>() + 0.0
    }

    /// Closes the last context (tokenizes pending text, appends the final footer) and returns the contexts.
    pub fn finish(&mut self) -> &[Context] {
        self.close_context();
        &self.contexts
    }

    /// The token prompt of the next sample request: the current context so far and, when a new assistant
    /// message starts (a message was begun and has no content yet, or the current message is not the
    /// assistant's), the generation prompt; the next completion then goes to that new assistant message. When the current message is an assistant message with
    /// content (a prefill such as `<think>`), the model continues it. Pending prompt text is tokenized now,
    /// once, so that the recorded context is what the sampler sees.
    pub fn prompt_ids(&mut self) -> Vec<u32> {
        let Some(frames) = self.frames.clone() else {
            return self.rendered_prompt();
        };
        self.flush_text();
        let current = self
            .contexts
            .last()
            .filter(|c| !c.closed)
            .and_then(|c| c.messages.last().map(|m| m.role));
        let continues = self.pending.is_none() && current == Some(Role::Assistant);
        let mut ids = match self.contexts.last() {
            Some(context) if !context.closed => context.ids(),
            _ => Vec::new(),
        };
        if continues {
            return ids;
        }
        let frame = match current {
            Some(previous) => &frames.generation[index(previous)],
            None => &frames.opening[index(Role::Assistant)],
        };
        let skip = self.overlap(frame);
        ids.extend_from_slice(&frame[skip..]);
        ids
    }

    /// How many leading tokens of `frame` the last sampled fragment of the current context already ends
    /// with (special tokens only).
    fn overlap(&self, frame: &[u32]) -> usize {
        let Some(context) = self.contexts.last() else {
            return 0;
        };
        let Some(last) = context.fragments.last() else {
            return 0;
        };
        if !matches!(last.kind, FragmentKind::Sampled | FragmentKind::Retokenized) {
            return 0;
        }
        let max = frame.len().min(last.ids.len());
        (1..=max)
            .rev()
            .find(|&k| {
                last.ids.ends_with(&frame[..k])
                    && frame[..k].iter().all(|id| self.special.contains(id))
            })
            .unwrap_or(0)
    }

    /// Tokenizes `text`. The tokenizer's models fail only on characters they cannot encode (no byte
    /// fallback, no unknown token); then nothing is recorded for the text and the error is kept in
    /// [`Holophore::errors`] rather than panicking in a rollout.
    fn tokenize(&mut self, text: &str) -> Vec<u32> {
        match encode(&self.tokenizer, text) {
            Ok(ids) => ids,
            Err(error) => {
                self.errors
                    .push(format!("the tokenizer failed: {error} (text {text:?})"));
                Vec::new()
            }
        }
    }

    /// Tokenizer failures, and chat-template errors of re-rendered contexts, met while recording; empty
    /// when every token is exact.
    pub fn errors(&self) -> &[String] {
        &self.errors
    }

    /// Tokenizes the buffered prompt text of the current context's last message.
    fn flush_text(&mut self) {
        let Some(context) = self.contexts.last_mut() else {
            return;
        };
        if context.pending_text.is_empty() {
            return;
        }
        let text = std::mem::take(&mut context.pending_text);
        let ids = self.tokenize(&text);
        let context = self.contexts.last_mut().expect("a context exists");
        let role = context.messages.last().map_or(Role::System, |m| m.role);
        context.fragments.push(Fragment {
            role,
            kind: FragmentKind::Prompt,
            ids,
            trainable: false,
            logprobs: None,
        });
    }

    fn push_frame(&mut self, role: Role, frame: &[u32]) {
        let skip = self.overlap(frame);
        let ids = frame[skip..].to_vec();
        if ids.is_empty() {
            return;
        }
        let context = self.contexts.last_mut().expect("a context exists");
        context.fragments.push(Fragment {
            role,
            kind: FragmentKind::Frame,
            ids,
            trainable: false,
            logprobs: None,
        });
    }

    /// Re-rendered contexts: the token prompt of the next sample request (see the module documentation).
    fn rendered_prompt(&mut self) -> Vec<u32> {
        if self.contexts.last().is_none_or(|c| c.closed) {
            self.contexts.push(Context::new(true, self.sources, 0));
            self.sources += 1;
        }
        let rendering = Arc::clone(&self.rendering);
        let context = self.contexts.last().expect("a context exists");
        let current = context.messages.last().map(|m| m.role);
        let continues = self.pending.is_none() && current == Some(Role::Assistant);
        let options = if continues {
            &rendering.continuation
        } else {
            &rendering.generation
        };
        let text = match rendering.render(&context.messages, options) {
            Ok(text) => text,
            Err(error) => {
                self.errors.push(error);
                return context.ids();
            }
        };
        let role = current.unwrap_or(Role::System);
        if let Some(suffix) = text.strip_prefix(context.rendered.as_str()) {
            let ids = self.tokenize(suffix);
            let context = self.contexts.last_mut().expect("a context exists");
            push_prompt(context, role, ids);
            context.rendered = text;
        } else if context.sampled_ids().is_empty() {
            // Nothing sampled yet: the context is this rendering.
            let ids = self.tokenize(&text);
            let context = self.contexts.last_mut().expect("a context exists");
            context.fragments.clear();
            context.routes.clear();
            push_prompt(context, role, ids);
            context.rendered = text;
        } else {
            // The rendering rewrites what the model saw: the context ends after its last completion and
            // a new one starts with this rendering.
            self.end_piece();
            let ids = self.tokenize(&text);
            let previous = self.contexts.last().expect("a context exists");
            let mut context =
                Context::new(previous.trained, previous.source, previous.completions.end);
            context.messages = previous.messages.clone();
            push_prompt(&mut context, role, ids);
            context.rendered = text;
            // The messages past the last completion belong to the new context only.
            let last = self.contexts.last_mut().expect("a context exists");
            let (count, len) = last.mark;
            last.messages.truncate(count);
            if let Some(message) = last.messages.last_mut() {
                message.content.truncate(len);
            }
            self.contexts.push(context);
        }
        self.contexts.last().expect("a context exists").ids()
    }

    /// Re-rendered contexts: closes the last context where its last completion ended, with the footer the
    /// template renders after the messages up to there (when that extends the context).
    fn end_piece(&mut self) {
        let context = self.contexts.last().expect("a context exists");
        let (count, len) = context.mark;
        let mut messages = context.messages[..count.min(context.messages.len())].to_vec();
        if let Some(message) = messages.last_mut() {
            message.content.truncate(len);
        }
        self.append_closing(&messages);
        self.contexts.last_mut().expect("a context exists").closed = true;
    }

    /// Re-rendered contexts: appends what the template renders after `messages` (no generation prompt)
    /// beyond the last context's text, when the rendering extends it.
    fn append_closing(&mut self, messages: &[Message]) {
        let rendering = Arc::clone(&self.rendering);
        let context = self.contexts.last().expect("a context exists");
        if messages.is_empty() {
            return;
        }
        let text = match rendering.render(messages, &rendering.closing) {
            Ok(text) => text,
            Err(error) => {
                // Only a context with nothing sampled loses more than its footer.
                if context.sampled_ids().is_empty() {
                    self.errors.push(error);
                }
                return;
            }
        };
        let Some(suffix) = text.strip_prefix(context.rendered.as_str()) else {
            return;
        };
        let role = messages.last().map_or(Role::System, |m| m.role);
        let ids = self.tokenize(suffix);
        let context = self.contexts.last_mut().expect("a context exists");
        if !ids.is_empty() {
            context.fragments.push(Fragment {
                role,
                kind: FragmentKind::Frame,
                ids,
                trainable: false,
                logprobs: None,
            });
        }
        context.rendered = text;
    }

    /// Appends the final footer of the last context, if it is open.
    fn close_context(&mut self) {
        if self.frames.is_none() {
            if let Some(context) = self.contexts.last().filter(|c| !c.closed) {
                let messages = context.messages.clone();
                self.append_closing(&messages);
                self.contexts.last_mut().expect("a context exists").closed = true;
            }
            return;
        }
        self.flush_text();
        let Some(context) = self.contexts.last() else {
            return;
        };
        if context.closed {
            return;
        }
        if let (Some(last), Some(frames)) =
            (context.messages.last().map(|m| m.role), self.frames.clone())
        {
            self.push_frame(last, &frames.closing[index(last)]);
        }
        self.contexts.last_mut().expect("a context exists").closed = true;
    }

    /// The message content goes to: the pending one (opened now, with its frame), the current one, or an
    /// implicit system message at the start of a context (as [`crate::Transcript`] does).
    fn open_for_content(&mut self) -> Role {
        if self.contexts.last().is_none_or(|c| c.closed) {
            self.contexts.push(Context::new(true, self.sources, 0));
            self.sources += 1;
        }
        let context = self.contexts.last().expect("a context exists");
        let current = context.messages.last().map(|m| m.role);
        let role = match (self.pending.take(), current) {
            (Some(role), _) => role,
            (None, None) => Role::System,
            (None, Some(role)) => return role,
        };
        // A template rendered whole has no frames: its text comes from the rendering.
        if let Some(frames) = self.frames.clone() {
            self.flush_text();
            let frame = match current {
                Some(previous) => &frames.gap[index(previous)][index(role)],
                None => &frames.opening[index(role)],
            };
            self.push_frame(role, frame);
        }
        self.contexts
            .last_mut()
            .expect("a context exists")
            .messages
            .push(Message {
                role,
                content: String::new(),
                tool: None,
            });
        role
    }
}

impl Recorder for Holophore {
    fn begin_context(&mut self, trained: bool) {
        self.close_context();
        self.restore_rendering();
        self.pending = None;
        self.contexts.push(Context::new(trained, self.sources, 0));
        self.sources += 1;
    }

    fn begin_message(&mut self, role: Role) {
        self.pending = Some(role);
    }

    fn text(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        self.open_for_content();
        let rendered = self.frames.is_none();
        let context = self.contexts.last_mut().expect("a context exists");
        if !rendered {
            context.pending_text.push_str(text);
        }
        if let Some(message) = context.messages.last_mut() {
            message.content.push_str(text);
        }
    }

    fn completion(&mut self, completion: &Completion) {
        // Re-rendered: the prompt the sampler saw is in the context (rendering it again adds nothing when
        // `prompt_ids` gave it).
        if self.frames.is_none() {
            self.rendered_prompt();
        }
        // A completion always belongs to an assistant message: the pending one, the current one, or a new
        // one (as `prompt_ids` announced to the sampler).
        let current = self
            .contexts
            .last()
            .filter(|c| !c.closed)
            .and_then(|c| c.messages.last().map(|m| m.role));
        if self.pending.is_some() || current != Some(Role::Assistant) {
            self.pending = Some(Role::Assistant);
        }
        let role = self.open_for_content();
        self.flush_text();
        let (kind, ids) = if completion.tokens.is_empty() && !completion.text.is_empty() {
            (FragmentKind::Retokenized, self.tokenize(&completion.text))
        } else {
            (FragmentKind::Sampled, completion.tokens.clone())
        };
        let logprobs = (!completion.logprobs.is_empty() && completion.logprobs.len() == ids.len())
            .then(|| completion.logprobs.clone());
        let mut written = ids.as_slice();
        if completion.finish == Finish::EndOfTurn {
            if let Some((last, before)) = written.split_last() {
                if self.special.contains(last) {
                    written = before;
                }
            }
        }
        self.last_written =
            (kind == FragmentKind::Sampled).then(|| (completion.text.clone(), written.to_vec()));
        let decoded = match (self.frames.is_none(), kind) {
            (false, _) => String::new(),
            (true, FragmentKind::Sampled) => self
                .tokenizer
                .decode(&ids, false)
                .unwrap_or_else(|_| completion.text.clone()),
            (true, _) => completion.text.clone(),
        };
        let context = self.contexts.last_mut().expect("a context exists");
        if let Some(message) = context.messages.last_mut() {
            message.content.push_str(&completion.text);
        }
        context.completions.end += 1;
        context.rendered.push_str(&decoded);
        context.mark = (
            context.messages.len(),
            context.messages.last().map_or(0, |m| m.content.len()),
        );
        if ids.is_empty() {
            return;
        }
        // The routes cover the prompt the sampler read, which is the context so far, then the sampled
        // tokens it read back.
        let prompt = context.ids().len();
        if let (FragmentKind::Sampled, Some(constraint)) = (kind, &completion.constraint) {
            context.constraints.push(Constrained {
                start: prompt,
                len: ids.len(),
                constraint: constraint.clone(),
            });
        }
        if kind == FragmentKind::Sampled && completion.routes.len() <= prompt + ids.len() {
            let recorded = completion.routes.iter().enumerate();
            for (position, routes) in recorded.filter(|(_, routes)| !routes.is_empty()) {
                if context.routes.len() <= position {
                    context.routes.resize(position + 1, Vec::new());
                }
                context.routes[position] = routes.clone();
            }
        }
        context.fragments.push(Fragment {
            role,
            kind,
            ids,
            trainable: context.trained,
            logprobs,
        });
    }

    fn template_arguments(&mut self, arguments: &[(&str, TemplateArg<'_>)]) -> Result<(), String> {
        self.apply_template_arguments(arguments)
    }

    fn offer_tools(
        &mut self,
        tools: &[serde_json::Value],
        format: Option<ToolFormat>,
    ) -> Result<ToolFormat, String> {
        self.offer_native_tools(tools, format)
    }

    fn tool_format(&self) -> Option<ToolFormat> {
        self.tool_format
    }

    fn tool_calls(&mut self, reply: &ToolReply) {
        self.mark_tool_calls(reply);
    }

    fn tool_result(&mut self, name: &str, id: Option<&str>, content: &str) {
        self.push_tool_result(name, id, content);
    }

    fn written(&self, text: &str) -> Option<String> {
        let (written, ids) = self.last_written.as_ref()?;
        if written != text {
            return None;
        }
        self.tokenizer.decode(ids, false).ok()
    }

    fn reward(&mut self, name: &str, value: f64, weight: f64) {
        set_reward(&mut self.rewards, name, value, weight);
    }

    fn feedback(&mut self, name: &str, text: &str) {
        set_feedback(&mut self.feedback, name, text);
    }

    fn recorded_reward(&self, name: &str) -> Option<f64> {
        reward_of(&self.rewards, name)
    }

    fn recorded_feedback(&self, name: &str) -> Option<&str> {
        feedback_of(&self.feedback, name)
    }
}

/// Appends prompt tokens of a re-rendered context.
fn push_prompt(context: &mut Context, role: Role, ids: Vec<u32>) {
    if !ids.is_empty() {
        context.fragments.push(Fragment {
            role,
            kind: FragmentKind::Prompt,
            ids,
            trainable: false,
            logprobs: None,
        });
    }
}

/// The text of each token of `ids`, decoded incrementally (special tokens included), so that the texts
/// joined are the decoded sequence. A token that ends inside a multi-byte character (or that a decoder
/// cleans up with its neighbour) gets an empty text, and the next token carries the characters.
pub fn token_texts(tokenizer: &Tokenizer, ids: &[u32]) -> Vec<String> {
    let decode = |ids: &[u32]| tokenizer.decode(ids, false).unwrap_or_default();
    let mut texts = vec![String::new(); ids.len()];
    // `ids[prefix..read]` is decoded already; it is decoded again as context for the next tokens.
    let (mut prefix, mut read) = (0, 0);
    for i in 0..ids.len() {
        let before = decode(&ids[prefix..read]);
        let now = decode(&ids[prefix..=i]);
        let complete = !now.ends_with('\u{fffd}') || i + 1 == ids.len();
        if complete && now.len() >= before.len() && now.starts_with(&before) {
            texts[i] = now[before.len()..].to_string();
            prefix = read;
            read = i + 1;
        } else if i + 1 == ids.len() {
            texts[i] = decode(&ids[read..]);
        }
    }
    texts
}

/// A context's tokens as text, showing what would be trained token by token: with `color`, each token of
/// the loss mask on a green background (alternating two shades, so token boundaries show) and special
/// tokens dimmed; without, every run of trained tokens between `⟦` and `⟧`. `mask` is aligned with `ids`
/// (missing entries count as 0).
pub fn render_tokens(tokenizer: &Tokenizer, ids: &[u32], mask: &[u8], color: bool) -> String {
    let texts = token_texts(tokenizer, ids);
    let trained = |i: usize| mask.get(i).is_some_and(|&m| m != 0);
    let mut out = String::new();
    if !color {
        let mut open = false;
        for (i, text) in texts.iter().enumerate() {
            if text.is_empty() {
                continue;
            }
            if trained(i) != open {
                out.push(if open { '⟧' } else { '⟦' });
                open = !open;
            }
            out.push_str(text);
        }
        if open {
            out.push('⟧');
        }
        return out;
    }
    let special: HashSet<u32> = tokenizer
        .get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, token)| token.special)
        .map(|(id, _)| id)
        .collect();
    let mut shade = false;
    for (i, text) in texts.iter().enumerate() {
        if text.is_empty() {
            continue;
        }
        if trained(i) {
            let style = if shade { "1;30;102" } else { "1;30;42" };
            shade = !shade;
            out.push_str(&format!("\x1b[{style}m{text}\x1b[0m"));
        } else if special.contains(&ids[i]) {
            out.push_str(&format!("\x1b[2m{text}\x1b[0m"));
        } else {
            out.push_str(text);
        }
    }
    out
}

/// One context of a rollout, rendered by [`render_contexts`].
#[derive(Debug, Clone, Copy)]
pub struct TokenView<'a> {
    pub trained: bool,
    pub ids: &'a [u32],
    pub loss_mask: &'a [u8],
}

/// A rollout as token-level text: per context a header `=== context I (trained|untrained): N tokens, M
/// trained` and its [`render_tokens`] text, then one line per reward component (`reward NAME = VALUE`,
/// with `(weight W)` when W is not 1) and per feedback (`feedback NAME: TEXT`), as [`crate::Transcript`]
/// prints them.
pub fn render_contexts(
    tokenizer: &Tokenizer,
    contexts: &[TokenView<'_>],
    rewards: &[(String, f64, f64)],
    feedback: &[(String, String)],
    color: bool,
) -> String {
    let mut out = String::new();
    for (index, context) in contexts.iter().enumerate() {
        let kind = if context.trained {
            "trained"
        } else {
            "untrained"
        };
        let trained = context.loss_mask.iter().filter(|&&m| m != 0).count();
        let header = format!(
            "=== context {index} ({kind}): {} tokens, {trained} trained",
            context.ids.len()
        );
        if color {
            out.push_str(&format!("\x1b[2m{header}\x1b[0m\n"));
        } else {
            out.push_str(&header);
            out.push('\n');
        }
        out.push_str(&render_tokens(
            tokenizer,
            context.ids,
            context.loss_mask,
            color,
        ));
        if !out.ends_with('\n') {
            out.push('\n');
        }
    }
    for (name, value, weight) in rewards {
        let line = if *weight == 1.0 {
            format!("reward {name} = {value}")
        } else {
            format!("reward {name} = {value} (weight {weight})")
        };
        if color {
            out.push_str(&format!("\x1b[35m{line}\x1b[0m\n"));
        } else {
            out.push_str(&line);
            out.push('\n');
        }
    }
    for (name, text) in feedback {
        let line = format!("feedback {name}: {text}");
        if color {
            out.push_str(&format!("\x1b[35m{line}\x1b[0m\n"));
        } else {
            out.push_str(&line);
            out.push('\n');
        }
    }
    out
}

impl Holophore {
    /// The rollout as token-level text ([`render_contexts`]); call [`Holophore::finish`] first to include
    /// the last context's final footer.
    pub fn render(&self, color: bool) -> String {
        let views: Vec<(bool, Vec<u32>, Vec<u8>)> = self
            .contexts
            .iter()
            .map(|context| (context.trained, context.ids(), context.loss_mask()))
            .collect();
        let views: Vec<TokenView<'_>> = views
            .iter()
            .map(|(trained, ids, mask)| TokenView {
                trained: *trained,
                ids,
                loss_mask: mask,
            })
            .collect();
        render_contexts(
            &self.tokenizer,
            &views,
            &self.rewards,
            &self.feedback,
            color,
        )
    }
}
