//! Hover: what a tag, holotype, argument or variable is. Built-in holotypes show their documentation and
//! parameters; a crate's own show their Rust declaration and `impl Holotype`, found by the crate scan.

use lsp_types as lsp;

use super::catalog::{builtin_param, holotype_params, BUILTIN_DOCS, SAMPLER_DOCS};
use super::target::{target_at, Target, Variables};
use super::Document;
use crate::ast::Role;
use crate::sema::SAMPLER_ARGUMENTS;

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
    let params = holotype_params(document, holotype);
    match params {
        Some(params) if params.iter().any(|param| param == name) => {
            match builtin_param(document, holotype, name) {
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
