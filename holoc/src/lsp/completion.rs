//! Completion inside tags, read from the text before the cursor so that it works while the tag is still
//! unfinished: tag heads (roles, context markers, holotypes, variables), the arguments a holotype or a
//! sampler takes, and variable names after `@_@:`, `|` and `var=`.

use lsp_types as lsp;

use super::catalog::{holotype_params, BUILTIN_DOCS, SAMPLER_DOCS};
use super::target::Variables;
use super::Document;
use crate::ast::{ContextMarker, Role};

fn item(label: &str, kind: lsp::CompletionItemKind, detail: String) -> lsp::CompletionItem {
    lsp::CompletionItem {
        label: label.to_string(),
        kind: Some(kind),
        detail: Some(detail),
        ..lsp::CompletionItem::default()
    }
}

/// Every variable the document names (bound by a sampler or inserted), with what it is.
fn variables(document: &Document) -> Vec<lsp::CompletionItem> {
    let Some(tree) = document.tree() else {
        return Vec::new();
    };
    let variables = Variables::of(&tree.nodes);
    let mut names: Vec<&str> = variables.bindings.keys().copied().collect();
    names.extend(
        variables
            .uses
            .keys()
            .filter(|name| !variables.bindings.contains_key(*name)),
    );
    names
        .into_iter()
        .map(|name| {
            let detail = match variables.bindings.get(name) {
                Some(spans) => format!("variable bound on line {}", spans[0].start.line),
                None => "input: a column of the data".to_string(),
            };
            item(name, lsp::CompletionItemKind::VARIABLE, detail)
        })
        .collect()
}

fn holotypes(document: &Document) -> Vec<lsp::CompletionItem> {
    let mut items = Vec::new();
    if let Some(scan) = &document.options.scan {
        for (name, declared) in &scan.holotypes {
            items.push(item(
                name,
                lsp::CompletionItemKind::CLASS,
                format!("holotype of this crate ({})", declared.file.display()),
            ));
        }
    }
    for name in document.options.builtin_holotypes.keys() {
        if items.iter().any(|item| item.label == *name) {
            continue;
        }
        let summary = BUILTIN_DOCS
            .iter()
            .find(|(builtin, ..)| builtin == name)
            .map_or("built-in holotype", |(_, summary, _)| summary);
        items.push(item(
            name,
            lsp::CompletionItemKind::CLASS,
            summary.to_string(),
        ));
    }
    items
}

fn heads(document: &Document) -> Vec<lsp::CompletionItem> {
    let mut items: Vec<lsp::CompletionItem> = [Role::System, Role::User, Role::Assistant]
        .into_iter()
        .map(|role| {
            item(
                role.glyph(),
                lsp::CompletionItemKind::KEYWORD,
                format!("{} message", role.name()),
            )
        })
        .collect();
    items.push(item(
        ContextMarker::TRAINED,
        lsp::CompletionItemKind::KEYWORD,
        "trained context".to_string(),
    ));
    items.push(item(
        ContextMarker::UNTRAINED[0],
        lsp::CompletionItemKind::KEYWORD,
        "untrained context".to_string(),
    ));
    items.extend(holotypes(document));
    items.extend(variables(document));
    items
}

fn arguments(names: &[(String, String)]) -> Vec<lsp::CompletionItem> {
    names
        .iter()
        .map(|(name, detail)| lsp::CompletionItem {
            insert_text: Some(format!("{name}=")),
            ..item(name, lsp::CompletionItemKind::PROPERTY, detail.clone())
        })
        .collect()
}

pub(super) fn complete(document: &Document, position: lsp::Position) -> lsp::CompletionResponse {
    let text = &document.text;
    let offset = document.lines.offset(text, position);
    let line_start = text[..offset].rfind('\n').map_or(0, |at| at + 1);
    let before = &text[line_start..offset];
    let items = match before.rfind("<|") {
        Some(open) if !before[open..].contains("|>") && !before[..open].ends_with('\\') => {
            in_tag(document, &before[open + 2..])
        }
        _ => Vec::new(),
    };
    lsp::CompletionResponse::Array(items)
}

/// Completions after `inside`, the text of an open tag up to the cursor.
fn in_tag(document: &Document, inside: &str) -> Vec<lsp::CompletionItem> {
    let inside = inside.trim_start();
    let Some(head_end) = inside.find([' ', '\t']) else {
        // Still in the head.
        return if inside.contains([':', '|']) {
            variables(document)
        } else {
            heads(document)
        };
    };
    let head = &inside[..head_end];
    let word = inside.rsplit([' ', '\t']).next().unwrap_or("");
    if let Some((key, _)) = word.split_once('=') {
        return if key == "var" {
            variables(document)
        } else {
            Vec::new()
        };
    }
    if word.starts_with("<>") {
        return Vec::new();
    }
    if head.starts_with(Role::Assistant.glyph()) {
        let names: Vec<(String, String)> = SAMPLER_DOCS
            .iter()
            .map(|(name, doc)| (name.to_string(), doc.to_string()))
            .collect();
        return arguments(&names);
    }
    if head.starts_with(|c: char| c.is_ascii_uppercase()) {
        let params = holotype_params(document, head).unwrap_or_default();
        let names: Vec<(String, String)> = params
            .into_iter()
            .map(|param| (param, format!("argument of {head}")))
            .collect();
        return arguments(&names);
    }
    Vec::new()
}
