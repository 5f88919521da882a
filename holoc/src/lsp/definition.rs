//! Go to definition: from a variable to the samplers that bind it, and from a holotype to its
//! `impl Holotype` in the crate's Rust code, where the crate scan found it.

use std::path::PathBuf;

use lsp_types as lsp;

use super::position::path_to_uri;
use super::target::{target_at, Target, Variables};
use super::Document;

/// A holotype the crate implements, located in its Rust source.
pub(crate) struct CrateHolotype {
    pub(crate) file: PathBuf,
    /// 0-based line and UTF-16 column of the name in `impl Holotype for Name`.
    pub(crate) line: u32,
    pub(crate) column: u32,
    /// The type's declaration line, when the same file has it, and the `impl` line.
    pub(crate) signature: String,
    pub(crate) params: Option<Vec<String>>,
}

/// Whether `line` names `name` as a whole word right after `keyword`; returns the byte column of `name`.
fn names_after(line: &str, keyword: &str, name: &str) -> Option<usize> {
    let at = line.find(keyword)? + keyword.len();
    let rest = &line[at..];
    let start = at + rest.len() - rest.trim_start().len();
    let after = line[start..].strip_prefix(name)?;
    let whole = !after.starts_with(|c: char| c.is_alphanumeric() || c == '_');
    whole.then_some(start)
}

/// The crate's own holotype `name`, from the document's crate scan and its source file.
pub(crate) fn crate_holotype(document: &Document, name: &str) -> Option<CrateHolotype> {
    let declared = document.options.scan.as_ref()?.holotypes.get(name)?;
    let text = std::fs::read_to_string(&declared.file).ok()?;
    let (line, impl_line, column) = text.lines().enumerate().find_map(|(number, line)| {
        names_after(line, "Holotype for", name).map(|column| (number, line, column))
    })?;
    let declaration = ["struct", "enum", "union", "type"]
        .iter()
        .find_map(|keyword| {
            text.lines()
                .find(|line| names_after(line, &format!("{keyword} "), name).is_some())
        });
    let mut signature = String::new();
    if let Some(declaration) = declaration {
        signature.push_str(declaration.trim());
        signature.push('\n');
    }
    signature.push_str(impl_line.trim().trim_end_matches('{').trim_end());
    Some(CrateHolotype {
        file: declared.file.clone(),
        line: line as u32,
        column: impl_line[..column]
            .chars()
            .map(char::len_utf16)
            .sum::<usize>() as u32,
        signature,
        params: declared.params.clone(),
    })
}

pub(super) fn definition(
    document: &Document,
    position: lsp::Position,
) -> Option<lsp::GotoDefinitionResponse> {
    let tree = document.output.document.as_ref()?;
    let offset = document.lines.offset(&document.text, position);
    let name = match target_at(&tree.nodes, offset)? {
        Target::Variable { name, .. } => name,
        Target::Binding(name) => name.node.as_str(),
        Target::Holotype(name) => {
            let found = crate_holotype(document, &name.node)?;
            let position = lsp::Position::new(found.line, found.column);
            return Some(lsp::GotoDefinitionResponse::Scalar(lsp::Location {
                uri: path_to_uri(&found.file)?,
                range: lsp::Range::new(
                    position,
                    lsp::Position::new(found.line, found.column + name.node.len() as u32),
                ),
            }));
        }
        _ => return None,
    };
    let variables = Variables::of(&tree.nodes);
    let locations: Vec<lsp::Location> = variables
        .bindings
        .get(name)?
        .iter()
        .map(|span| lsp::Location {
            uri: document.uri.clone(),
            range: document.lines.range(&document.text, *span),
        })
        .collect();
    Some(lsp::GotoDefinitionResponse::Array(locations))
}
