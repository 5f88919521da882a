//! Document symbols: the outline of a file. Each context marker holds the roles, samplers and holotypes
//! up to the next one; a holotype with a body holds the body's.

use lsp_types as lsp;

use super::Document;
use crate::ast::{Head, Node};
use crate::span::Span;

#[allow(deprecated)] // `DocumentSymbol::deprecated` must be written, as `None`.
fn symbol(
    document: &Document,
    name: String,
    kind: lsp::SymbolKind,
    span: Span,
    children: Vec<lsp::DocumentSymbol>,
) -> lsp::DocumentSymbol {
    let range = document.lines.range(&document.text, span);
    let full = children.iter().fold(range, |range, child| lsp::Range {
        start: range.start.min(child.range.start),
        end: range.end.max(child.range.end),
    });
    lsp::DocumentSymbol {
        name,
        detail: None,
        kind,
        tags: None,
        deprecated: None,
        range: full,
        selection_range: range,
        children: (!children.is_empty()).then_some(children),
    }
}

fn symbols(document: &Document, nodes: &[Node]) -> Vec<lsp::DocumentSymbol> {
    let mut out: Vec<lsp::DocumentSymbol> = Vec::new();
    // The children of the last context marker, while one is open at this level.
    let mut context: Option<(String, Span, Vec<lsp::DocumentSymbol>)> = None;
    for node in nodes {
        let Node::Tag(tag) = node else { continue };
        let made = match &tag.node.head {
            Head::Context(marker) => {
                if let Some((name, span, children)) = context.take() {
                    out.push(symbol(
                        document,
                        name,
                        lsp::SymbolKind::NAMESPACE,
                        span,
                        children,
                    ));
                }
                let kind = if marker.node.trained() {
                    "trained"
                } else {
                    "untrained"
                };
                context = Some((
                    format!("{} {kind} context", marker.node.marker),
                    tag.span,
                    Vec::new(),
                ));
                continue;
            }
            Head::Role { role, binding } => {
                let sampler = binding.is_some() || !tag.node.args.is_empty();
                let (name, kind) = match binding {
                    Some(binding) => (
                        format!("{}:{}", role.node.glyph(), binding.node),
                        lsp::SymbolKind::FUNCTION,
                    ),
                    None if sampler => (
                        format!("{} sampler", role.node.glyph()),
                        lsp::SymbolKind::FUNCTION,
                    ),
                    None => (
                        format!("{} {}", role.node.glyph(), role.node.name()),
                        lsp::SymbolKind::EVENT,
                    ),
                };
                symbol(document, name, kind, tag.span, Vec::new())
            }
            Head::Holotype(name) => {
                let children = tag
                    .node
                    .body
                    .as_ref()
                    .map(|body| symbols(document, &body.nodes))
                    .unwrap_or_default();
                let span = tag
                    .node
                    .body
                    .as_ref()
                    .and_then(|body| body.close)
                    .map_or(tag.span, |close| tag.span.to(close));
                symbol(
                    document,
                    name.node.clone(),
                    lsp::SymbolKind::CLASS,
                    span,
                    children,
                )
            }
            Head::Value(_) | Head::Close(_) => continue,
        };
        match &mut context {
            Some((_, _, children)) => children.push(made),
            None => out.push(made),
        }
    }
    if let Some((name, span, children)) = context {
        out.push(symbol(
            document,
            name,
            lsp::SymbolKind::NAMESPACE,
            span,
            children,
        ));
    }
    out
}

pub(super) fn document_symbols(document: &Document) -> lsp::DocumentSymbolResponse {
    let nodes = document.tree().map_or(&[][..], |tree| &tree.nodes);
    lsp::DocumentSymbolResponse::Nested(symbols(document, nodes))
}
