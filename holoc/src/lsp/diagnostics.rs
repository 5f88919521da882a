//! Diagnostics as `holoc check` reports them, in the protocol's form: the primary label's span is the
//! range, the label, notes and help follow the message, and secondary labels are related information.

use lsp_server::{Message, Notification};
use lsp_types as lsp;

use super::Document;
use crate::diagnostics::Severity;

/// The document's diagnostics, in the order `holoc check` prints them.
pub(super) fn of(document: &Document) -> Vec<lsp::Diagnostic> {
    let text = &document.output.source;
    document
        .output
        .diagnostics
        .iter()
        .map(|diagnostic| {
            let primary = diagnostic.labels.iter().find(|label| label.primary);
            let mut message = diagnostic.message.clone();
            if let Some(label) = primary.filter(|label| !label.message.is_empty()) {
                message.push_str(&format!("\n{}", label.message));
            }
            for note in &diagnostic.notes {
                message.push_str(&format!("\nnote: {note}"));
            }
            if let Some(help) = &diagnostic.help {
                message.push_str(&format!("\nhelp: {help}"));
            }
            let related: Vec<lsp::DiagnosticRelatedInformation> = diagnostic
                .labels
                .iter()
                .filter(|label| !label.primary)
                .map(|label| lsp::DiagnosticRelatedInformation {
                    location: lsp::Location {
                        uri: document.uri.clone(),
                        range: document.lines.range(text, label.span),
                    },
                    message: label.message.clone(),
                })
                .collect();
            lsp::Diagnostic {
                range: document.lines.range(text, diagnostic.span()),
                severity: Some(match diagnostic.severity {
                    Severity::Error => lsp::DiagnosticSeverity::ERROR,
                    Severity::Warning => lsp::DiagnosticSeverity::WARNING,
                }),
                code: Some(lsp::NumberOrString::String(
                    diagnostic.code.id().to_string(),
                )),
                source: Some("holoc".to_string()),
                message,
                related_information: (!related.is_empty()).then_some(related),
                ..lsp::Diagnostic::default()
            }
        })
        .collect()
}

/// The `textDocument/publishDiagnostics` notification for a document.
pub(super) fn publish(uri: &lsp::Uri, diagnostics: Vec<lsp::Diagnostic>) -> Message {
    Message::Notification(Notification::new(
        "textDocument/publishDiagnostics".to_string(),
        lsp::PublishDiagnosticsParams {
            uri: uri.clone(),
            diagnostics,
            version: None,
        },
    ))
}
