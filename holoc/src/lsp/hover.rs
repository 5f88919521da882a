//! Hover: what a tag, holotype, argument or variable is. Built-in holotypes show their documentation and
//! parameters; a crate's own show their Rust declaration and `impl Holotype`, found by the crate scan.

use lsp_types as lsp;

use super::target::{target_at, Target, Variables};
use super::Document;
use crate::ast::Role;
use crate::sema::SAMPLER_ARGUMENTS;

/// The runtime's built-in holotypes: what each does, and its parameters with their defaults
/// (docs/holoware.md, section 3.8).
pub(crate) const BUILTIN_DOCS: &[(&str, &str, &str)] = &[
    (
        "ToolRunner",
        "Repeats its body until the model gives an answer or `max_turns` turns have passed.",
        "`max_turns` (8), `var` (`turn`), `answer` (`answer`)",
    ),
    (
        "ToolSchema",
        "Writes the JSON schemas of the environment's registered tools.",
        "no arguments",
    ),
    (
        "ToolExecutor",
        "Runs the tool call found in the turn's variable and writes the result, or the error, inside \
         `<result>` tags.",
        "`answer` (`answer`); one positional word, the variable of the turn (`turn`)",
    ),
    (
        "CodeExecutor",
        "Runs the code of the last `<code>` block of the turn in a sandbox (own namespaces, an \
         unprivileged user, a read-only view of the system, no network, resource limits, a timeout) and \
         writes what it printed inside `<output>` tags.",
        "`timeout` (5), `python` (`python3`), `max_output` (4096), `answer` (`answer`), `memory` (MiB, \
         1024), `processes` (16), `cpu_seconds` (10), `file_size` (MiB, 16), `open_files` (256), \
         `work_size` (MiB, 64); one positional word, the variable of the turn (`turn`)",
    ),
    (
        "ExactAnswer",
        "Reward `exact_answer`: 1 when the `<answer>` of `var` equals the data row's `target` column.",
        "`var` (`answer`), `target` (`expected`), `tag` (`answer`), `weight` (1), `name`",
    ),
    (
        "MathAnswer",
        "Reward `math_answer`: 1 when the `<answer>` of `var` equals the `target` column as a number.",
        "`var` (`answer`), `target` (`expected`), `tag` (`answer`), `untagged` (`whole`; `last_number` reads the last number of a reply without the tag), `weight` (1), `name`",
    ),
    (
        "FormatReward",
        "Reward `format`: 1 when `var` has each of the `tags` as `<tag>...</tag>`.",
        "`var` (`answer`), `tags` (`answer`), `weight` (1), `name`",
    ),
    (
        "LengthPenalty",
        "Reward `length_penalty`: a penalty for `var` longer than `max` characters.",
        "`var` (`answer`), `max` (1000), `weight` (1), `name`",
    ),
    (
        "Retry",
        "ERL's gate: runs its body (reflection and second attempt) when the reward `score` is below `threshold`.",
        "`score` (or one positional word: the reward component), `threshold` (1)",
    ),
    (
        "Feedback",
        "Writes the feedback recorded for a reward component (why it got its value).",
        "one positional word or `score`: the reward component",
    ),
    (
        "Score",
        "Writes the value recorded for a reward component.",
        "one positional word or `score`: the reward component",
    ),
    (
        "Memory",
        "Writes the most recent reflections of ERL's cross-episode memory.",
        "`top_k` (3), `empty` (`None available.`)",
    ),
    (
        "Remember",
        "At the end, queues the variable it names for ERL's memory when the reward `score` is above `threshold`.",
        "one positional word: the variable; `score`, `threshold` (0)",
    ),
];

/// What a sampler's generation arguments mean (docs/holoware.md, section 3.3).
pub(crate) const SAMPLER_DOCS: [(&str, &str); 5] = [
    ("max_tokens", "the most tokens to sample: an integer >= 1"),
    (
        "temperature",
        "sampling temperature: a number >= 0; 0 samples greedily",
    ),
    ("top_p", "nucleus sampling: a number, 0 < p <= 1"),
    (
        "top_k",
        "sample among the k likeliest tokens: an integer >= 0; 0 disables it",
    ),
    ("stop", "a stop string (repeatable): `stop=\"</tool>\"`"),
];

pub(super) fn hover(document: &Document, position: lsp::Position) -> Option<lsp::Hover> {
    let tree = document.output.document.as_ref()?;
    let offset = document.lines.offset(&document.text, position);
    let target = target_at(&tree.nodes, offset)?;
    let text = match &target {
        Target::Role { role, sampler } => role_doc(*role, *sampler),
        Target::Context(marker) => {
            if marker.trained() {
                format!(
                    "`{}`: starts a **trained** context; the tokens sampled in it are trained on.",
                    marker.marker
                )
            } else {
                format!(
                    "`{}`: starts an **untrained** context; it is sampled and rewarded, but not trained on.",
                    marker.marker
                )
            }
        }
        Target::Holotype(name) => holotype_doc(document, &name.node),
        Target::Binding(name) => variable_doc(document, &name.node),
        Target::Variable { name, .. } => variable_doc(document, name),
        Target::Argument { holotype, name } => argument_doc(document, *holotype, &name.node),
        Target::Fence(name) => format!(
            "fence `<>{0}`: the runtime writes `<{0}>`, the model generates until it writes `</{0}>`, \
             and the binding receives the text inside.",
            name.node
        ),
    };
    let span = match &target {
        Target::Binding(name) | Target::Holotype(name) | Target::Fence(name) => Some(name.span),
        Target::Argument { name, .. } => Some(name.span),
        Target::Variable { span, .. } => Some(*span),
        Target::Role { .. } | Target::Context(_) => None,
    };
    Some(lsp::Hover {
        contents: lsp::HoverContents::Markup(lsp::MarkupContent {
            kind: lsp::MarkupKind::Markdown,
            value: text,
        }),
        range: span.map(|span| document.lines.range(&document.text, span)),
    })
}

fn role_doc(role: Role, sampler: bool) -> String {
    if sampler {
        let arguments: Vec<String> = SAMPLER_DOCS
            .iter()
            .map(|(name, doc)| format!("- `{name}`: {doc}"))
            .collect();
        format!(
            "`{}` **sampler**: the model writes the assistant's text here, to the end of its turn or \
             inside a `<>fence`; `@_@:name` binds the text to `name`.\n\nGeneration arguments:\n{}",
            role.glyph(),
            arguments.join("\n")
        )
    } else {
        format!(
            "`{}`: role switch, starts a new **{}** message.",
            role.glyph(),
            role.name()
        )
    }
}

/// The documentation of a holotype: a crate's own declaration, else the built-in's, else why it is unknown.
pub(crate) fn holotype_doc(document: &Document, name: &str) -> String {
    if let Some(declared) = super::definition::crate_holotype(document, name) {
        let params = match &declared.params {
            Some(params) if params.is_empty() => "no keyword arguments".to_string(),
            Some(params) => format!(
                "`PARAMS`: {}",
                params
                    .iter()
                    .map(|param| format!("`{param}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            None => {
                "`PARAMS` not written as a list of literals: rustc checks the arguments".to_string()
            }
        };
        return format!(
            "```rust\n{}\n```\n\nholotype of this crate, in `{}`\n\n{params}",
            declared.signature,
            declared.file.display()
        );
    }
    if let Some((_, summary, params)) = BUILTIN_DOCS.iter().find(|(builtin, ..)| *builtin == name) {
        return format!(
            "```rust\nholo_runtime::holotypes::{name}\n```\n\n{summary}\n\nArguments: {params}"
        );
    }
    format!("holotype `{name}`: not a built-in, and no `impl Holotype for {name}` was found in the crate")
}

fn variable_doc(document: &Document, name: &str) -> String {
    let Some(tree) = document.tree() else {
        return format!("variable `{name}`");
    };
    let variables = Variables::of(&tree.nodes);
    let lines = |spans: &mut dyn Iterator<Item = u32>| {
        spans
            .map(|line| line.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let uses = variables.uses.get(name).map_or(&[][..], Vec::as_slice);
    let used = if uses.is_empty() {
        "never inserted".to_string()
    } else {
        format!(
            "inserted on line {}",
            lines(&mut uses.iter().map(|(span, _)| span.start.line))
        )
    };
    match variables.bindings.get(name) {
        Some(bindings) => format!(
            "variable `{name}`: **bound** by the sampler{} on line {}; {used}",
            if bindings.len() == 1 { "" } else { "s" },
            lines(&mut bindings.iter().map(|span| span.start.line))
        ),
        None => {
            let need = if uses.iter().any(|(_, sole)| *sole) {
                "**required input**: every data row must have this column"
            } else {
                "**optional input**: every use has an alternative"
            };
            format!("variable `{name}`: {need}; {used}")
        }
    }
}

fn argument_doc(document: &Document, holotype: Option<&str>, name: &str) -> String {
    let Some(holotype) = holotype else {
        return match SAMPLER_DOCS.iter().find(|(argument, _)| *argument == name) {
            Some((_, doc)) => format!("sampler argument `{name}`: {doc}"),
            None => format!(
                "`{name}` is not a sampler argument; they are {}",
                SAMPLER_ARGUMENTS.join(", ")
            ),
        };
    };
    let params = super::completion::holotype_params(document, holotype);
    match params {
        Some(params) if params.iter().any(|param| param == name) => {
            match super::completion::builtin_param(document, holotype, name) {
                Some(param) => format!(
                    "argument `{name}` of the built-in `{holotype}`: {}",
                    param.accepts.description()
                ),
                None => format!("argument `{name}` of holotype `{holotype}`"),
            }
        }
        Some(params) => format!(
            "`{holotype}` has no parameter `{name}`; it takes {}",
            if params.is_empty() {
                "none".to_string()
            } else {
                params.join(", ")
            }
        ),
        None => format!("argument `{name}` of holotype `{holotype}`"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builtins::BUILTINS;

    /// Every built-in holotype the checker knows has its documentation here.
    #[test]
    fn every_builtin_is_documented() {
        let documented: Vec<&str> = BUILTIN_DOCS.iter().map(|(name, ..)| *name).collect();
        let builtins: Vec<&str> = BUILTINS.iter().map(|builtin| builtin.name).collect();
        assert_eq!(documented, builtins);
        let sampler: Vec<&str> = SAMPLER_DOCS.iter().map(|(name, _)| *name).collect();
        assert_eq!(sampler, SAMPLER_ARGUMENTS);
    }
}
