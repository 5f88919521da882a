//! Positions as the protocol counts them: 0-based lines and UTF-16 code units within a line, converted
//! from and to the byte offsets and spans of the front end; and `file:` URIs from and to paths.

use std::path::{Path, PathBuf};

use lsp_types as lsp;

use crate::span::Span;

/// The offsets where the lines of one text start.
pub(crate) struct Lines {
    starts: Vec<usize>,
}

impl Lines {
    pub(crate) fn new(text: &str) -> Self {
        let starts = std::iter::once(0)
            .chain(text.match_indices('\n').map(|(at, _)| at + 1))
            .collect();
        Lines { starts }
    }

    /// The position of byte `offset` of `text` (clamped to the text, and back to a character boundary).
    pub(crate) fn position(&self, text: &str, offset: usize) -> lsp::Position {
        let mut offset = offset.min(text.len());
        while !text.is_char_boundary(offset) {
            offset -= 1;
        }
        let line = self.starts.partition_point(|&start| start <= offset) - 1;
        let character: usize = text[self.starts[line]..offset]
            .chars()
            .map(char::len_utf16)
            .sum();
        lsp::Position::new(line as u32, character as u32)
    }

    /// The byte offset of `position` in `text`; a position past the end of its line is the line's end.
    pub(crate) fn offset(&self, text: &str, position: lsp::Position) -> usize {
        let Some(&start) = self.starts.get(position.line as usize) else {
            return text.len();
        };
        let end = self
            .starts
            .get(position.line as usize + 1)
            .map_or(text.len(), |&next| next - 1);
        let mut units = 0;
        for (at, c) in text[start..end].char_indices() {
            if units >= position.character as usize {
                return start + at;
            }
            units += c.len_utf16();
        }
        end
    }

    pub(crate) fn range(&self, text: &str, span: Span) -> lsp::Range {
        lsp::Range {
            start: self.position(text, span.start.offset as usize),
            end: self.position(text, span.end.offset as usize),
        }
    }
}

/// The path of a `file:` URI, percent-decoded.
pub(crate) fn uri_to_path(uri: &lsp::Uri) -> Option<PathBuf> {
    let rest = uri.as_str().strip_prefix("file://")?;
    let bytes = rest.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        let hex = |i: usize| bytes.get(i).and_then(|b| (*b as char).to_digit(16));
        match (bytes[at], hex(at + 1), hex(at + 2)) {
            (b'%', Some(high), Some(low)) => {
                decoded.push((high * 16 + low) as u8);
                at += 3;
            }
            (byte, _, _) => {
                decoded.push(byte);
                at += 1;
            }
        }
    }
    let path = String::from_utf8(decoded).ok()?;
    // `file:///C:/x` on Windows names `C:/x`.
    let path = match path.as_bytes() {
        [b'/', drive, b':', ..] if drive.is_ascii_alphabetic() => path[1..].to_string(),
        _ => path,
    };
    Some(PathBuf::from(path))
}

/// The `file:` URI of an absolute path, percent-encoding what a URI path cannot hold.
pub(crate) fn path_to_uri(path: &Path) -> Option<lsp::Uri> {
    let path = path.to_str()?.replace('\\', "/");
    let mut uri = String::from("file://");
    if !path.starts_with('/') {
        uri.push('/');
    }
    for byte in path.bytes() {
        if byte.is_ascii_alphanumeric() || b"/-._~:".contains(&byte) {
            uri.push(byte as char);
        } else {
            uri.push_str(&format!("%{byte:02X}"));
        }
    }
    uri.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf16_positions_round_trip() {
        let text = "é🙂x\nab\n";
        let lines = Lines::new(text);
        let x = text.find('x').unwrap();
        assert_eq!(lines.position(text, x), lsp::Position::new(0, 3));
        assert_eq!(lines.offset(text, lsp::Position::new(0, 3)), x);
        assert_eq!(lines.position(text, text.len()), lsp::Position::new(2, 0));
        assert_eq!(lines.offset(text, lsp::Position::new(1, 9)), text.len() - 1);
        assert_eq!(lines.offset(text, lsp::Position::new(7, 0)), text.len());
    }

    #[test]
    fn file_uris() {
        let path = Path::new("/tmp/my env/a#b.hol");
        let uri = path_to_uri(path).unwrap();
        assert_eq!(uri.as_str(), "file:///tmp/my%20env/a%23b.hol");
        assert_eq!(uri_to_path(&uri).unwrap(), path);
    }
}
