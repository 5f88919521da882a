//! Source positions. Every AST node, IR op and diagnostic carries a [`Span`] so errors can point at the
//! exact bytes of the `.hol` file.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A position in a source file: byte offset plus 1-based line and column (columns count characters).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
pub struct Pos {
    pub offset: u32,
    pub line: u32,
    pub col: u32,
}

/// A half-open range `[start, end)` of a source file.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Span {
    pub start: Pos,
    pub end: Pos,
}

impl Span {
    pub fn range(&self) -> std::ops::Range<usize> {
        self.start.offset as usize..self.end.offset as usize
    }

    /// The smallest span covering both.
    pub fn to(self, other: Span) -> Span {
        Span {
            start: self.start.min(other.start),
            end: self.end.max(other.end),
        }
    }
}

impl fmt::Debug for Span {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "@ {}:{}-{}:{}",
            self.start.line, self.start.col, self.end.line, self.end.col
        )
    }
}

/// A value with the span of source it came from. Debug prints `value @ l:c-l:c` so snapshots stay
/// readable.
#[derive(Clone, PartialEq, Eq, Serialize)]
pub struct Spanned<T> {
    pub node: T,
    pub span: Span,
}

impl<T> Spanned<T> {
    pub fn new(node: T, span: Span) -> Self {
        Spanned { node, span }
    }
}

impl<T: fmt::Debug> fmt::Debug for Spanned<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.node, f)?;
        write!(f, " {:?}", self.span)
    }
}

/// Maps byte offsets of one source text to line and column.
#[derive(Debug, Clone)]
pub struct LineIndex<'s> {
    source: &'s str,
    line_starts: Vec<usize>,
}

impl<'s> LineIndex<'s> {
    pub fn new(source: &'s str) -> Self {
        let line_starts = std::iter::once(0)
            .chain(source.match_indices('\n').map(|(i, _)| i + 1))
            .collect();
        LineIndex {
            source,
            line_starts,
        }
    }

    pub fn pos(&self, offset: usize) -> Pos {
        let offset = offset.min(self.source.len());
        let line = self.line_starts.partition_point(|&start| start <= offset) - 1;
        let line_start = self.line_starts[line];
        let col = self.source[line_start..offset].chars().count();
        Pos {
            offset: offset as u32,
            line: line as u32 + 1,
            col: col as u32 + 1,
        }
    }

    pub fn span(&self, start: usize, end: usize) -> Span {
        Span {
            start: self.pos(start),
            end: self.pos(end),
        }
    }
}
