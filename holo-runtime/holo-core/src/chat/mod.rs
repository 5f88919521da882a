//! Chat rendering: a model's own `chat_template`, rendered the way Hugging Face transformers'
//! `tokenizer.apply_chat_template(messages, tokenize=False, ...)` renders it.
//!
//! [`ChatTemplate::from_dir`] loads the template of a model folder:
//!
//! - `chat_template.jinja` (and `additional_chat_templates/*.jinja`, named after their file) when present: like
//!   transformers, these files take priority over the template inside `tokenizer_config.json`;
//! - otherwise `chat_template` from `tokenizer_config.json`, either a string or the list-of-named-templates form
//!   `[{"name": "default", "template": "..."}, {"name": "tool_use", ...}]`. With several templates, rendering
//!   picks `tool_use` when tools are given and the model has one, else `default` (transformers' rule), unless
//!   [`RenderOptions::template`] names one;
//! - the special tokens of `tokenizer_config.json`: every top-level key ending in `_token` whose value is a
//!   string or an `AddedToken` object (`{"content": "<s>", ...}`), and the named tokens of an
//!   `extra_special_tokens` object — exactly the names transformers v5 passes to the template. A token that is
//!   `null` or absent is undefined in the template (it prints as nothing).
//!
//! The template sees what transformers gives it: `messages` (maps with `role` and `content`),
//! `add_generation_prompt`, the special tokens, `tools` and `documents` (`none` unless given),
//! `raise_exception(message)` (fails the render with that message), `strftime_now(format)` (local time, or
//! [`RenderOptions::now`]), `namespace`, `dict`, and any [`RenderOptions::variables`] (they override special
//! tokens, as transformers' keyword arguments do).
//!
//! The minijinja environment is configured like transformers' Jinja environment: `trim_blocks`,
//! `lstrip_blocks`, no trailing newline kept, loop controls (`{% break %}`, `{% continue %}`), no auto-escaping,
//! transformers' `tojson` (`json.dumps` with `ensure_ascii=False`, `indent`, `separators`, `sort_keys`), the
//! Python string, list and dict methods of `minijinja_contrib::pycompat`, values printed as Python prints them
//! (`True`, `None`, `['a', 1]`, `2.0`), whitespace as Python's `str.strip()`/`str.split()` see it, and
//! `{% generation %}` blocks (transformers' assistant-mask extension) rendered as their content;
//! [`ChatTemplate::render_tracked`] also returns where each block's output lies, as transformers'
//! `return_assistant_tokens_mask` records it.
//!
//! `continue_final_message` follows transformers: the final message's content gets a marker appended, the
//! conversation is rendered, and the output is cut where the marker starts (and right-stripped when the template
//! trimmed the message), so the output ends right after the final message's content.
//!
//! Fallbacks for models without a template: [`ChatTemplate::chatml`] and [`ChatTemplate::plain`].
//!
//! ```
//! use holo_core::chat::{ChatTemplate, RenderOptions};
//! use holo_core::{ChatMessage, Role};
//!
//! // A model folder: ChatTemplate::from_dir("models/Qwen2.5-0.5B-Instruct")?
//! let template = ChatTemplate::chatml();
//! let messages = [ChatMessage { role: Role::User, content: "Hi".into() }];
//! let prompt = template.render(&messages, &RenderOptions::generation())?;
//! assert_eq!(prompt, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
//! # Ok::<(), holo_core::chat::ChatTemplateError>(())
//! ```

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use chrono::NaiveDateTime;
use minijinja::value::ValueKind;
use minijinja::{Environment, Error, ErrorKind};

use crate::sampler::ChatMessage;

pub use minijinja::Value;

/// The file transformers reads the model's template from, when present.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// What errors name the built-in templates' source by.
const CHATML_FILE: &str = "<chatml>";
const PLAIN_FILE: &str = "<plain>";
/// The folder of additional named templates (`NAME.jinja`).
pub const CHAT_TEMPLATE_DIR: &str = "additional_chat_templates";
/// The tokenizer configuration file.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// The variable that makes `{% generation %}` blocks mark their output ([`ChatTemplate::render_tracked`]).
const TRACK_GENERATION: &str = "__holo_track_generation";
/// What a tracked `{% generation %}` block's output starts and ends with, removed after rendering.
const GENERATION_START: &str = "\u{E000}holo:generation\u{E001}";
const GENERATION_END: &str = "\u{E000}holo:endgeneration\u{E001}";

/// What transformers appends to the final message for `continue_final_message`.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// The ChatML template ([`ChatTemplate::chatml`]).
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// The plain-text template ([`ChatTemplate::plain`]).
pub const PLAIN_TEMPLATE: &str = "{% for message in messages %}\
{{ message['role'] | capitalize + ': ' + message['content'] + '\\n\\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}";

/// Why a template could not be loaded or rendered. Every variant names the file the template came from
/// (`tokenizer_config.json`, `chat_template.jinja`, or `<chatml>`/`<plain>` for the built-in ones).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatTemplateError {
    /// A file could not be read.
    Io { file: PathBuf, message: String },
    /// `tokenizer_config.json` is not valid JSON or has a field of the wrong shape.
    Config { file: PathBuf, message: String },
    /// The model folder has no chat template (neither `chat_template.jinja` nor `chat_template` in
    /// `tokenizer_config.json`); fall back to [`ChatTemplate::chatml`] or [`ChatTemplate::plain`].
    Missing { file: PathBuf },
    /// The template does not parse.
    Syntax {
        file: String,
        line: Option<usize>,
        message: String,
    },
    /// The template called `raise_exception(message)`.
    Raised { file: String, message: String },
    /// Rendering failed (an undefined attribute, a type error, ...).
    Render {
        file: String,
        line: Option<usize>,
        message: String,
    },
    /// The request cannot be rendered: an empty conversation, `continue_final_message` with
    /// `add_generation_prompt`, a final message the template does not reproduce, an unknown template name.
    Invalid { file: String, message: String },
}

impl ChatTemplateError {
    /// The file the template came from.
    pub fn file(&self) -> String {
        match self {
            ChatTemplateError::Io { file, .. }
            | ChatTemplateError::Config { file, .. }
            | ChatTemplateError::Missing { file } => file.display().to_string(),
            ChatTemplateError::Syntax { file, .. }
            | ChatTemplateError::Raised { file, .. }
            | ChatTemplateError::Render { file, .. }
            | ChatTemplateError::Invalid { file, .. } => file.clone(),
        }
    }
}

fn at_line(line: &Option<usize>) -> String {
    line.map(|line| format!(" (line {line})"))
        .unwrap_or_default()
}

impl fmt::Display for ChatTemplateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChatTemplateError::Io { file, message } => {
                write!(f, "{}: cannot read: {message}", file.display())
            }
            ChatTemplateError::Config { file, message } => {
                write!(f, "{}: {message}", file.display())
            }
            ChatTemplateError::Missing { file } => write!(
                f,
                "{}: no chat template (no `chat_template` and no {CHAT_TEMPLATE_FILE} beside it)",
                file.display()
            ),
            ChatTemplateError::Syntax {
                file,
                line,
                message,
            } => {
                write!(
                    f,
                    "{file}{}: chat template syntax error: {message}",
                    at_line(line)
                )
            }
            ChatTemplateError::Raised { file, message } => {
                write!(
                    f,
                    "{file}: the chat template raised an exception: {message}"
                )
            }
            ChatTemplateError::Render {
                file,
                line,
                message,
            } => {
                write!(
                    f,
                    "{file}{}: cannot render the chat template: {message}",
                    at_line(line)
                )
            }
            ChatTemplateError::Invalid { file, message } => write!(f, "{file}: {message}"),
        }
    }
}

impl std::error::Error for ChatTemplateError {}

/// How to render a conversation.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    /// End with the header that starts an assistant turn.
    pub add_generation_prompt: bool,
    /// End right after the final message's content, so that the model continues it (incompatible with
    /// `add_generation_prompt`).
    pub continue_final_message: bool,
    /// Tool schemas (`tools` in the template); `none` when not given. Build them with [`json_value`] to keep
    /// the key order of the JSON text, as Python dicts do.
    pub tools: Option<Vec<Value>>,
    /// Documents for retrieval-augmented templates (`documents`); `none` when not given.
    pub documents: Option<Vec<Value>>,
    /// Extra template variables (transformers' keyword arguments, e.g. `enable_thinking`); they override
    /// special tokens of the same name.
    pub variables: BTreeMap<String, Value>,
    /// The local time `strftime_now` formats; the current local time when `None`.
    pub now: Option<NaiveDateTime>,
    /// Which named template to use (for models with several); transformers' choice when `None`.
    pub template: Option<String>,
}

impl RenderOptions {
    /// Options for a prompt the model answers: `add_generation_prompt = true`.
    pub fn generation() -> Self {
        RenderOptions {
            add_generation_prompt: true,
            ..Default::default()
        }
    }

    /// Options for a prompt whose final (assistant) message the model continues.
    pub fn continuation() -> Self {
        RenderOptions {
            continue_final_message: true,
            ..Default::default()
        }
    }
}

/// A conversation rendered with the spans of its `{% generation %}` blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    pub text: String,
    /// The byte ranges of `text` each `{% generation %}` block wrote, in order (transformers'
    /// `generation_indices`, which count characters).
    pub generation: Vec<std::ops::Range<usize>>,
}

/// Messages as the template values [`ChatTemplate::render_values`] takes (maps of `role` and `content`).
pub fn message_values(messages: &[ChatMessage]) -> Vec<Value> {
    messages
        .iter()
        .map(|message| {
            Value::from_pairs([
                ("role", Value::from(message.role.name())),
                ("content", Value::from(message.content.as_str())),
            ])
        })
        .collect()
}

/// Parses JSON text into a template value, keeping the key order of objects (as Python's `json.loads` does).
pub fn json_value(text: &str) -> Result<Value, serde_json::Error> {
    serde_json::from_str(text)
}

/// Template arguments (transformers' `apply_chat_template(**kwargs)`, vLLM's `chat_template_kwargs`, such
/// as Qwen3's `enable_thinking`) from JSON text: an object, whose keys become template variables
/// ([`RenderOptions::variables`]). Anything else is refused, saying what was given.
pub fn parse_template_kwargs(text: &str) -> Result<BTreeMap<String, Value>, String> {
    let json: serde_json::Value =
        serde_json::from_str(text).map_err(|error| format!("not valid JSON: {error}"))?;
    template_kwargs(&json)
}

/// [`parse_template_kwargs`] of a parsed JSON value.
pub fn template_kwargs(json: &serde_json::Value) -> Result<BTreeMap<String, Value>, String> {
    let serde_json::Value::Object(map) = json else {
        let kind = match json {
            serde_json::Value::Null => "null",
            serde_json::Value::Bool(_) => "a boolean",
            serde_json::Value::Number(_) => "a number",
            serde_json::Value::String(_) => "a string",
            serde_json::Value::Array(_) => "an array",
            serde_json::Value::Object(_) => "an object",
        };
        return Err(format!(
            "must be a JSON object such as {{\"enable_thinking\": false}}, got {kind}"
        ));
    };
    map.iter()
        .map(|(key, value)| {
            json_value(&value.to_string())
                .map(|value| (key.clone(), value))
                .map_err(|error| format!("`{key}`: {error}"))
        })
        .collect()
}

struct Named {
    name: String,
    /// The template's key in the environment, also what errors name.
    file: String,
    source: String,
}

/// A chat template ready to render conversations. Cheap to clone.
#[derive(Clone)]
pub struct ChatTemplate {
    inner: Arc<Inner>,
}

struct Inner {
    env: Environment<'static>,
    templates: Vec<Named>,
    special_tokens: BTreeMap<String, String>,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("templates", &self.template_names())
            .field("file", &self.inner.templates.first().map(|t| &t.file))
            .field("special_tokens", &self.inner.special_tokens)
            .finish()
    }
}

impl ChatTemplate {
    /// Loads the chat template and special tokens of a model folder (see the module documentation).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, ChatTemplateError> {
        let dir = dir.as_ref();
        let config_path = dir.join(TOKENIZER_CONFIG_FILE);
        let config: Option<serde_json::Value> = if config_path.is_file() {
            let text = read(&config_path)?;
            Some(
                serde_json::from_str(&text).map_err(|error| ChatTemplateError::Config {
                    file: config_path.clone(),
                    message: format!("invalid JSON: {error}"),
                })?,
            )
        } else {
            None
        };

        // Template files take priority over the config's template, as in transformers.
        let mut templates = Vec::new();
        let default_file = dir.join(CHAT_TEMPLATE_FILE);
        if default_file.is_file() {
            templates.push((
                "default".to_string(),
                default_file.display().to_string(),
                read(&default_file)?,
            ));
        }
        let extra_dir = dir.join(CHAT_TEMPLATE_DIR);
        if extra_dir.is_dir() {
            let entries = std::fs::read_dir(&extra_dir).map_err(|error| ChatTemplateError::Io {
                file: extra_dir.clone(),
                message: error.to_string(),
            })?;
            let mut files: Vec<PathBuf> = entries
                .filter_map(|entry| entry.ok().map(|entry| entry.path()))
                .filter(|path| path.extension().is_some_and(|ext| ext == "jinja") && path.is_file())
                .collect();
            files.sort();
            for path in files {
                let name = path
                    .file_stem()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned();
                templates.push((name, path.display().to_string(), read(&path)?));
            }
        }
        if templates.is_empty() {
            match config
                .as_ref()
                .and_then(|config| config.get("chat_template"))
            {
                None | Some(serde_json::Value::Null) => {}
                Some(serde_json::Value::String(source)) => templates.push((
                    "default".into(),
                    config_path.display().to_string(),
                    source.clone(),
                )),
                Some(serde_json::Value::Array(list)) => {
                    for (index, entry) in list.iter().enumerate() {
                        let name = entry.get("name").and_then(|v| v.as_str());
                        let source = entry.get("template").and_then(|v| v.as_str());
                        let (Some(name), Some(source)) = (name, source) else {
                            return Err(ChatTemplateError::Config {
                                file: config_path,
                                message: format!(
                                    "`chat_template[{index}]` must be an object with string `name` and `template`"
                                ),
                            });
                        };
                        let file = format!("{} (template \"{name}\")", config_path.display());
                        templates.push((name.to_string(), file, source.to_string()));
                    }
                }
                Some(_) => {
                    return Err(ChatTemplateError::Config {
                        file: config_path,
                        message:
                            "`chat_template` must be a string or a list of {\"name\", \"template\"}"
                                .into(),
                    })
                }
            }
        }
        if templates.is_empty() {
            return Err(ChatTemplateError::Missing { file: config_path });
        }
        let special_tokens = match &config {
            Some(config) => special_tokens(config, &config_path)?,
            None => BTreeMap::new(),
        };
        Self::build(templates, special_tokens)
    }

    /// Loads a model folder's template, or uses `fallback` (keeping the folder's special tokens) when the
    /// folder has none. Other errors (unreadable files, syntax errors) are still errors.
    pub fn from_dir_or(
        dir: impl AsRef<Path>,
        fallback: ChatTemplate,
    ) -> Result<Self, ChatTemplateError> {
        match Self::from_dir(dir.as_ref()) {
            Err(ChatTemplateError::Missing { file }) => {
                let mut tokens = fallback.inner.special_tokens.clone();
                if file.is_file() {
                    let config = serde_json::from_str(&read(&file)?).map_err(|error| {
                        ChatTemplateError::Config {
                            file: file.clone(),
                            message: format!("invalid JSON: {error}"),
                        }
                    })?;
                    tokens.extend(special_tokens(&config, &file)?);
                }
                fallback.with_special_tokens(tokens)
            }
            other => other,
        }
    }

    /// A template from its source. `file` is what errors name.
    pub fn from_source(
        source: impl Into<String>,
        file: impl Into<String>,
        special_tokens: BTreeMap<String, String>,
    ) -> Result<Self, ChatTemplateError> {
        Self::build(
            vec![("default".into(), file.into(), source.into())],
            special_tokens,
        )
    }

    /// The ChatML fallback: each message is `<|im_start|>{role}\n{content}<|im_end|>\n`; the generation prompt
    /// is `<|im_start|>assistant\n`. Its `eos_token` is `<|im_end|>`.
    pub fn chatml() -> Self {
        let tokens = BTreeMap::from([("eos_token".to_string(), "<|im_end|>".to_string())]);
        Self::builtin(CHATML_TEMPLATE, CHATML_FILE, tokens)
    }

    /// The plain-text fallback, for base models: each message is `{Role}: {content}` followed by a blank line
    /// (`"System: ...\n\n"`, `"User: ...\n\n"`, `"Assistant: ...\n\n"`); the generation prompt is `Assistant:`
    /// (no space: the model's first token carries it). No special tokens.
    pub fn plain() -> Self {
        Self::builtin(PLAIN_TEMPLATE, PLAIN_FILE, BTreeMap::new())
    }

    fn builtin(source: &str, file: &str, tokens: BTreeMap<String, String>) -> Self {
        match Self::from_source(source, file, tokens) {
            Ok(template) => template,
            // The built-in templates are constants covered by tests.
            Err(error) => unreachable!("built-in template {file}: {error}"),
        }
    }

    /// The same templates with other special tokens.
    pub fn with_special_tokens(
        &self,
        special_tokens: BTreeMap<String, String>,
    ) -> Result<Self, ChatTemplateError> {
        let templates = self
            .inner
            .templates
            .iter()
            .map(|t| (t.name.clone(), t.file.clone(), t.source.clone()))
            .collect();
        Self::build(templates, special_tokens)
    }

    fn build(
        templates: Vec<(String, String, String)>,
        special_tokens: BTreeMap<String, String>,
    ) -> Result<Self, ChatTemplateError> {
        let mut env = environment();
        let mut named = Vec::with_capacity(templates.len());
        for (name, file, source) in templates {
            let prepared = rewrite_generation_tags(&source);
            env.add_template_owned(file.clone(), prepared)
                .map_err(|error| ChatTemplateError::Syntax {
                    file: file.clone(),
                    line: error.line(),
                    message: error
                        .detail()
                        .map(str::to_string)
                        .unwrap_or_else(|| error.to_string()),
                })?;
            named.push(Named { name, file, source });
        }
        Ok(ChatTemplate {
            inner: Arc::new(Inner {
                env,
                templates: named,
                special_tokens,
            }),
        })
    }

    /// Whether this is one of the built-in templates ([`ChatTemplate::chatml`], [`ChatTemplate::plain`]),
    /// for example the fallback of [`ChatTemplate::from_dir_or`] for a folder without a template.
    pub fn is_builtin(&self) -> bool {
        self.inner
            .templates
            .first()
            .is_some_and(|template| [CHATML_FILE, PLAIN_FILE].contains(&template.file.as_str()))
    }

    /// The names of the templates (`default`, `tool_use`, ...).
    pub fn template_names(&self) -> Vec<&str> {
        self.inner
            .templates
            .iter()
            .map(|t| t.name.as_str())
            .collect()
    }

    /// The source of a named template.
    pub fn source(&self, name: &str) -> Option<&str> {
        self.inner
            .templates
            .iter()
            .find(|t| t.name == name)
            .map(|t| t.source.as_str())
    }

    /// The special tokens passed to the template (`bos_token`, `eos_token`, ...).
    pub fn special_tokens(&self) -> &BTreeMap<String, String> {
        &self.inner.special_tokens
    }

    /// A special token by name (`"eos_token"`).
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.inner.special_tokens.get(name).map(String::as_str)
    }

    fn select(&self, options: &RenderOptions) -> Result<&Named, ChatTemplateError> {
        let templates = &self.inner.templates;
        let invalid = |message: String| ChatTemplateError::Invalid {
            file: templates
                .first()
                .map(|t| t.file.clone())
                .unwrap_or_default(),
            message,
        };
        let by_name = |name: &str| templates.iter().find(|t| t.name == name);
        if let Some(name) = &options.template {
            return by_name(name).ok_or_else(|| {
                invalid(format!(
                    "no chat template named {name:?} (has {:?})",
                    self.template_names()
                ))
            });
        }
        if templates.len() == 1 {
            return Ok(&templates[0]);
        }
        if options.tools.is_some() {
            if let Some(template) = by_name("tool_use") {
                return Ok(template);
            }
        }
        by_name("default").ok_or_else(|| {
            invalid(format!(
                "several chat templates and none named \"default\"; choose one of {:?}",
                self.template_names()
            ))
        })
    }

    /// Renders a conversation.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        options: &RenderOptions,
    ) -> Result<String, ChatTemplateError> {
        self.render_values(message_values(messages), options)
    }

    /// Renders a conversation and records the output of each `{% generation %}` block, as transformers'
    /// `apply_chat_template(..., return_assistant_tokens_mask=True)` does (and, like it, refuses
    /// `continue_final_message`). A template without such blocks gives no spans. Messages are template
    /// values, as for [`ChatTemplate::render_values`].
    pub fn render_tracked(
        &self,
        messages: Vec<Value>,
        options: &RenderOptions,
    ) -> Result<Rendered, ChatTemplateError> {
        if options.continue_final_message {
            return Err(ChatTemplateError::Invalid {
                file: self.select(options)?.file.clone(),
                message: "continue_final_message is not compatible with assistant masks".into(),
            });
        }
        let mut tracked = options.clone();
        tracked
            .variables
            .insert(TRACK_GENERATION.into(), Value::from(true));
        let marked = self.render_values(messages, &tracked)?;
        let mut text = String::with_capacity(marked.len());
        let mut generation = Vec::new();
        // Depth of the blocks open: a block inside another is part of the outer one's span.
        let (mut depth, mut begin) = (0usize, 0usize);
        let mut rest = marked.as_str();
        loop {
            let start = rest.find(GENERATION_START);
            let end = rest.find(GENERATION_END);
            let (at, opens) = match (start, end) {
                (Some(s), Some(e)) => (s.min(e), s < e),
                (Some(s), None) => (s, true),
                (None, Some(e)) => (e, false),
                (None, None) => break,
            };
            text.push_str(&rest[..at]);
            if opens {
                if depth == 0 {
                    begin = text.len();
                }
                depth += 1;
                rest = &rest[at + GENERATION_START.len()..];
            } else {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    generation.push(begin..text.len());
                }
                rest = &rest[at + GENERATION_END.len()..];
            }
        }
        text.push_str(rest);
        Ok(Rendered { text, generation })
    }

    /// Whether the template (the one `options` selects) has `{% generation %}` blocks, which
    /// assistant masks need (TRL's `has_generation_markers`).
    pub fn has_generation_blocks(&self, options: &RenderOptions) -> bool {
        self.select(options).is_ok_and(|template| {
            let source = &template.source;
            let mut rest = source.as_str();
            while let Some(start) = rest.find("{%") {
                let tag = &rest[start + 2..];
                let Some(end) = tag.find("%}") else { break };
                let inner = tag[..end].trim_start_matches('-').trim_end_matches('-');
                if inner.trim() == "generation" {
                    return true;
                }
                rest = &tag[end..];
            }
            false
        })
    }

    /// Renders messages given as template values (maps with `role`, `content` and any other field a template
    /// reads, such as `tool_calls`), for roles and shapes [`ChatMessage`] does not have.
    pub fn render_values(
        &self,
        mut messages: Vec<Value>,
        options: &RenderOptions,
    ) -> Result<String, ChatTemplateError> {
        let template = self.select(options)?;
        let invalid = |message: &str| ChatTemplateError::Invalid {
            file: template.file.clone(),
            message: message.into(),
        };
        if messages.is_empty() {
            return Err(invalid(
                "cannot apply a chat template to an empty conversation",
            ));
        }
        let mut final_content = None;
        if options.continue_final_message {
            if options.add_generation_prompt {
                return Err(invalid(
                    "continue_final_message and add_generation_prompt are not compatible: the first continues \
                     the final message, the second starts a new assistant message",
                ));
            }
            if !template.source.contains("content") {
                return Err(invalid(
                    "continue_final_message is set but the chat template never reads `content`",
                ));
            }
            let Some(last) = messages.last_mut() else {
                return Err(invalid(
                    "cannot apply a chat template to an empty conversation",
                ));
            };
            let content = last
                .get_attr("content")
                .ok()
                .and_then(|c| c.as_str().map(str::to_string));
            let Some(content) = content else {
                return Err(invalid(
                    "continue_final_message is set but the final message has no string content",
                ));
            };
            *last = with_field(
                last,
                "content",
                Value::from(format!("{content}{CONTINUE_TAG}")),
            )
            .map_err(|message| invalid(&message))?;
            final_content = Some(content);
        }

        let rendered = self.render_raw(template, messages, options)?;

        let Some(final_content) = final_content else {
            return Ok(rendered);
        };
        let tag = CONTINUE_TAG.trim_end();
        if !rendered.contains(py_strip(&final_content)) {
            return Err(invalid(
                "continue_final_message is set but the final message does not appear in the rendered chat: \
                 the chat template removes part of it",
            ));
        }
        let Some(at) = rendered.rfind(tag) else {
            return Err(invalid(
                "continue_final_message: the rendered chat lost the final message's marker",
            ));
        };
        Ok(if rendered[at..].starts_with(CONTINUE_TAG) {
            rendered[..at].to_string()
        } else {
            // The template trimmed the message's trailing whitespace (and the tag's).
            py_rstrip(&rendered[..at]).to_string()
        })
    }

    fn render_raw(
        &self,
        template: &Named,
        messages: Vec<Value>,
        options: &RenderOptions,
    ) -> Result<String, ChatTemplateError> {
        let mut context: BTreeMap<String, Value> = self
            .inner
            .special_tokens
            .iter()
            .map(|(name, token)| (name.clone(), Value::from(token.as_str())))
            .collect();
        for (name, value) in &options.variables {
            context.insert(name.clone(), value.clone());
        }
        context.insert("messages".into(), Value::from(messages));
        context.insert(
            "add_generation_prompt".into(),
            Value::from(options.add_generation_prompt),
        );
        context.insert(
            "tools".into(),
            options
                .tools
                .clone()
                .map(Value::from)
                .unwrap_or(Value::from(())),
        );
        context.insert(
            "documents".into(),
            options
                .documents
                .clone()
                .map(Value::from)
                .unwrap_or(Value::from(())),
        );
        let now = options.now;
        context.insert(
            "strftime_now".into(),
            Value::from_function(move |format: &str| -> Result<String, Error> {
                let now = now.unwrap_or_else(|| chrono::Local::now().naive_local());
                let mut out = String::new();
                write!(out, "{}", now.format(format)).map_err(|_| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        format!("strftime_now: invalid format {format:?}"),
                    )
                })?;
                Ok(out)
            }),
        );

        let compiled = self
            .inner
            .env
            .get_template(&template.file)
            .map_err(|error| ChatTemplateError::Render {
                file: template.file.clone(),
                line: None,
                message: error.to_string(),
            })?;
        compiled
            .render(Value::from(context))
            .map_err(|error| match raised_message(&error) {
                Some(message) => ChatTemplateError::Raised {
                    file: template.file.clone(),
                    message,
                },
                None => ChatTemplateError::Render {
                    file: template.file.clone(),
                    line: error.line(),
                    message: render_error_message(&error),
                },
            })
    }
}

fn render_error_message(error: &Error) -> String {
    let mut message = match error.detail() {
        Some(detail) => format!("{}: {detail}", error.kind()),
        None => error.kind().to_string(),
    };
    let mut source = std::error::Error::source(error);
    while let Some(inner) = source {
        write!(message, ": {inner}").ok();
        source = inner.source();
    }
    message
}

fn read(path: &Path) -> Result<String, ChatTemplateError> {
    std::fs::read_to_string(path).map_err(|error| ChatTemplateError::Io {
        file: path.to_path_buf(),
        message: error.to_string(),
    })
}

/// The special tokens transformers v5 passes to a chat template: the top-level `*_token` keys whose value is a
/// string or an AddedToken object, and the named tokens of an `extra_special_tokens` object.
fn special_tokens(
    config: &serde_json::Value,
    file: &Path,
) -> Result<BTreeMap<String, String>, ChatTemplateError> {
    let Some(config) = config.as_object() else {
        return Err(ChatTemplateError::Config {
            file: file.to_path_buf(),
            message: "the tokenizer configuration must be a JSON object".into(),
        });
    };
    fn token(value: &serde_json::Value) -> Option<&str> {
        match value {
            serde_json::Value::String(token) => Some(token),
            serde_json::Value::Object(added) => {
                added.get("content").and_then(|content| content.as_str())
            }
            _ => None,
        }
    }
    let mut tokens = BTreeMap::new();
    for (key, value) in config {
        if key.ends_with("_token") {
            if let Some(content) = token(value) {
                tokens.insert(key.clone(), content.to_string());
            } else if value.is_object() {
                return Err(ChatTemplateError::Config {
                    file: file.to_path_buf(),
                    message: format!("`{key}` is an object without a string `content`"),
                });
            }
        }
    }
    if let Some(serde_json::Value::Object(extra)) = config.get("extra_special_tokens") {
        for (key, value) in extra {
            if let Some(content) = token(value) {
                tokens.insert(key.clone(), content.to_string());
            }
        }
    }
    Ok(tokens)
}

/// A copy of a map value with one field replaced, keeping the key order.
fn with_field(map: &Value, field: &str, value: Value) -> Result<Value, String> {
    if map.kind() != ValueKind::Map {
        return Err("continue_final_message is set but the final message is not a map".into());
    }
    let keys = map.try_iter().map_err(|error| error.to_string())?;
    let mut value = Some(value);
    let mut pairs = Vec::new();
    for key in keys {
        if key.as_str() == Some(field) {
            pairs.push((key, value.take().unwrap_or_default()));
        } else {
            let item = map.get_item(&key).map_err(|error| error.to_string())?;
            pairs.push((key, item));
        }
    }
    if let Some(value) = value {
        pairs.push((Value::from(field), value));
    }
    Ok(Value::from_pairs(pairs))
}

mod environment;
pub mod folder;
mod json;
mod python;

use environment::*;
use json::*;
use python::*;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        for (float, expected) in [
            (1.0, "1.0"),
            (2.5, "2.5"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (1e-5, "1e-05"),
            (-0.0, "-0.0"),
            (123456789012345678.0, "1.2345678901234568e+17"),
            (-3.25, "-3.25"),
        ] {
            assert_eq!(py_float_repr(float), expected, "{float}");
        }
    }

    #[test]
    fn python_whitespace() {
        assert_eq!(py_strip("\u{1f} a \u{3000}"), "a");
        let split: Vec<String> = py_split_whitespace("  a b\u{1c}c  ", None)
            .iter()
            .map(|v| v.to_string())
            .collect();
        assert_eq!(split, ["a", "b", "c"]);
        let split: Vec<String> = py_split_whitespace("a b  c ", Some(1))
            .iter()
            .map(|v| v.to_string())
            .collect();
        assert_eq!(split, ["a", "b  c "]);
        let lines: Vec<String> = py_splitlines("a\r\nb\u{2028}c\n", false)
            .iter()
            .map(|v| v.to_string())
            .collect();
        assert_eq!(lines, ["a", "b", "c"]);
    }

    #[test]
    fn repr_of_strings() {
        assert_eq!(py_repr_str("it's"), "\"it's\"");
        assert_eq!(py_repr_str("a'\"b\n"), "'a\\'\"b\\n'");
        assert_eq!(py_repr_str("é\u{200d}"), "'é\\u200d'");
    }

    #[test]
    fn generation_tags_become_blocks() {
        assert_eq!(
            rewrite_generation_tags("{%- generation -%}x{% endgeneration %}{% if a %}{% endif %}"),
            "{%- filter holo_generation -%}x{% endfilter %}{% if a %}{% endif %}"
        );
    }

    #[test]
    fn tracked_rendering_finds_each_generation_block() {
        let source = "{% for m in messages %}{{ m.role }}:{% if m.role == 'assistant' %}\
            {% generation %}{{ m.content }};{% endgeneration %}{% else %}{{ m.content }};{% endif %}\
            {% endfor %}";
        let template =
            ChatTemplate::from_source(source, "t.jinja", BTreeMap::new()).expect("template");
        let message = |role, content: &str| ChatMessage {
            role,
            content: content.into(),
        };
        let messages = [
            message(crate::Role::User, "hi"),
            message(crate::Role::Assistant, "yo"),
            message(crate::Role::User, "é?"),
            message(crate::Role::Assistant, "ok"),
        ];
        let options = RenderOptions::default();
        let rendered = template
            .render_tracked(message_values(&messages), &options)
            .unwrap();
        assert_eq!(rendered.text, "user:hi;assistant:yo;user:é?;assistant:ok;");
        assert_eq!(
            rendered.text,
            template.render(&messages, &options).unwrap(),
            "untracked rendering writes the same text"
        );
        let spans: Vec<&str> = rendered
            .generation
            .iter()
            .map(|span| &rendered.text[span.clone()])
            .collect();
        assert_eq!(spans, ["yo;", "ok;"]);
        assert!(template.has_generation_blocks(&options));
        assert!(!ChatTemplate::chatml().has_generation_blocks(&options));
        let plain = ChatTemplate::chatml()
            .render_tracked(message_values(&messages), &options)
            .unwrap();
        assert!(plain.generation.is_empty());
    }
}
