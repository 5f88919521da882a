//! The formatter behind `holoc fmt`: one canonical layout for a `.hol` file.
//!
//! Most of a `.hol` file is text that the model reads byte for byte, so the formatter changes only what the
//! language defines as layout (docs/holoware.md, sections 2.5 and 4):
//!
//! - inside tags: no space after `<|` or before `|>`, none around `=`, `:` and `|` or after `<>` and `/`, one
//!   space between arguments; names, numbers and quoted strings stay exactly as written;
//! - bodies are indented four spaces deeper than their opening tag; a text line keeps the indentation it
//!   has beyond its body's, because that is text;
//! - a line of structural and holotype tags is indented to its body, its tags one space apart, and loses
//!   trailing spaces (its indentation, spacing and newline are not text);
//! - a comment is indented like the body it sits in, without trailing spaces;
//! - blank lines that the checker trims: none at the start or end of the file or right after a role switch
//!   or context marker, exactly one before a role switch or context marker that starts a new block (none
//!   between consecutive ones, nor at the start of a body); every other blank line is text and stays;
//! - LF line ends, no byte-order mark, and a newline at the end of the file (unless the last line is text
//!   inside a body, where a newline would be content).
//!
//! A file that does not lex or parse is not formatted: [`format()`] returns its diagnostics. Every result is
//! checked before it is returned: the formatted text must lex to the same tokens as the original, up to the
//! newlines the checker trims at message boundaries, so it lowers to the same IR; otherwise [`format()`]
//! refuses with [`Error::MeaningChanged`] rather than return a file that means something else.

use std::fmt;

use crate::diagnostics::Diagnostic;
use crate::lexer::{self, Line, LineKind, SpannedToken, Token};
use crate::parser;
use crate::span::LineIndex;

/// Columns of indentation per body level.
pub const INDENT: usize = 4;

/// Why a file was not formatted.
#[derive(Debug)]
pub enum Error {
    /// The file does not lex or parse; these are its diagnostics, as `holoc check` reports them.
    Invalid(Vec<Diagnostic>),
    /// The canonical layout would change what the file means, from this position of the original on: a
    /// bug in the formatter, reported instead of rewriting the file.
    MeaningChanged { line: u32, col: u32 },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Invalid(diagnostics) => write!(
                f,
                "the file has {} error{}",
                diagnostics.len(),
                if diagnostics.len() == 1 { "" } else { "s" }
            ),
            Error::MeaningChanged { line, col } => write!(
                f,
                "{}:{}: formatting would change what the file means here, so it was left as it is \
                 (a bug in holoc fmt; please report it with the file)",
                line, col
            ),
        }
    }
}

/// The canonical layout of `source`, a `.hol` file that lexes and parses. Idempotent: formatting the
/// result again returns it unchanged.
pub fn format(source: &str) -> Result<String, Error> {
    let index = LineIndex::new(source);
    let lexed = lexer::lex(source, &index);
    if !lexed.diagnostics.is_empty() {
        return Err(Error::Invalid(lexed.diagnostics));
    }
    parser::parse(lexed.tokens.clone(), &index).map_err(Error::Invalid)?;
    let formatted = Printer::new(source, &lexed.lines, &lexed.tokens).print();
    verify(source, &lexed.tokens, &index, &formatted)?;
    Ok(formatted)
}

/// How the blank lines between two content lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Blanks {
    /// They are text: kept, every one.
    Keep,
    /// The checker trims them: none.
    Drop,
    /// The checker trims them: runs of them become one blank line; with `insert`, one is added when there
    /// is none. Runs before the file's first line and after its last are dropped.
    Single { insert: bool },
}

struct Printer<'a> {
    source: &'a str,
    lines: &'a [Line],
    tokens: &'a [SpannedToken],
    /// Indices of the content lines.
    content: Vec<usize>,
    /// For each line that ends bodies, the line that opened the outermost of them.
    closed_opener: Vec<Option<usize>>,
    /// Columns of indentation beyond its body that a tag-only line needs, so that the same bodies open and
    /// close as in the original (see [`Printer::slack`]).
    slack: Vec<usize>,
}

impl<'a> Printer<'a> {
    fn new(source: &'a str, lines: &'a [Line], tokens: &'a [SpannedToken]) -> Self {
        let content: Vec<usize> = (0..lines.len())
            .filter(|&i| lines[i].kind == LineKind::Content)
            .collect();
        let mut closed_opener = vec![None; lines.len()];
        let mut openers: Vec<usize> = Vec::new();
        for &i in &content {
            if openers.len() > lines[i].depth {
                closed_opener[i] = Some(openers[lines[i].depth]);
                openers.truncate(lines[i].depth);
            }
            if lines[i].body_indent.is_some() {
                openers.push(i);
            }
        }
        let mut printer = Printer {
            source,
            lines,
            tokens,
            content,
            closed_opener,
            slack: vec![0; lines.len()],
        };
        printer.slack();
        printer
    }

    /// Indentation beyond the body's that line `i` has in the output.
    fn extra(&self, i: usize) -> usize {
        let line = &self.lines[i];
        if line.text {
            line.width() - line.base
        } else {
            self.slack[i]
        }
    }

    /// Tag-only lines are indented to their body, unless a later line constrains them. A line that ends
    /// bodies may not be indented more than the line that opened the outermost of them (H0009), so that
    /// opener keeps as much indentation as the line needs; and a lone holotype that opens no body must be
    /// indented at least as much as the next line, or it would open one. Both constraints point backwards,
    /// so one pass from the end settles them; the original indentation always satisfies them.
    fn slack(&mut self) {
        for k in (0..self.content.len()).rev() {
            let i = self.content[k];
            let extra = self.extra(i);
            if let Some(opener) = self.closed_opener[i] {
                self.slack[opener] = self.slack[opener].max(extra);
            } else if let Some(&previous) = k.checked_sub(1).and_then(|k| self.content.get(k)) {
                let line = &self.lines[previous];
                if line.lone_holotype && line.body_indent.is_none() {
                    self.slack[previous] = self.slack[previous].max(extra);
                }
            }
        }
    }

    /// The tags of content line `i`, each as its tokens from `<|` to `|>`.
    fn tags(&self, i: usize) -> Vec<&'a [SpannedToken]> {
        let tokens = &self.tokens[self.lines[i].tokens.clone()];
        let mut tags = Vec::new();
        let mut open = None;
        for (at, (_, token, _)) in tokens.iter().enumerate() {
            match token {
                Token::TagOpen => open = Some(at),
                Token::TagClose => {
                    if let Some(start) = open.take() {
                        tags.push(&tokens[start..=at]);
                    }
                }
                _ => {}
            }
        }
        tags
    }

    /// Whether content line `i` holds only tags and its first (`first`) or last tag is a role switch or a
    /// context marker: a message boundary, around which the checker trims newlines.
    fn boundary_at(&self, i: usize, first: bool) -> bool {
        if self.lines[i].text {
            return false;
        }
        let tags = self.tags(i);
        let tag = if first { tags.first() } else { tags.last() };
        tag.is_some_and(|tag| is_boundary(tag))
    }

    fn blanks(&self, previous: Option<usize>, next: Option<usize>) -> Blanks {
        let (Some(previous), Some(next)) = (previous, next) else {
            return Blanks::Single { insert: false };
        };
        let after_boundary =
            self.boundary_at(previous, false) && self.closed_opener[next].is_none();
        let before_boundary = self.boundary_at(next, true);
        if after_boundary || (before_boundary && self.lines[previous].body_indent.is_some()) {
            Blanks::Drop
        } else if before_boundary {
            Blanks::Single { insert: true }
        } else {
            Blanks::Keep
        }
    }

    fn print(&self) -> String {
        let mut out = String::with_capacity(self.source.len() + self.source.len() / 8);
        // Bodies open around the current line: (indentation of their lines in the source, in the output).
        let mut levels: Vec<(usize, usize)> = Vec::new();
        let mut gap_start = 0;
        let mut previous = None;
        let last_content = self.content.last().copied();
        for k in 0..=self.content.len() {
            let next = self.content.get(k).copied();
            let gap_end = next.unwrap_or(self.lines.len());
            let next_depth = next.map_or(0, |i| self.lines[i].depth);
            self.gap(
                &mut out,
                gap_start..gap_end,
                self.blanks(previous, next),
                (previous.is_none(), next.is_none()),
                &levels,
                next_depth,
            );
            let Some(i) = next else { break };
            let line = &self.lines[i];
            levels.truncate(line.depth);
            let base = levels.last().map_or(0, |&(_, output)| output);
            let width = base + self.extra(i);
            if line.text {
                out.push_str(&" ".repeat(base));
                out.push_str(&self.source[line.start + line.base..line.content]);
                let mut at = line.content;
                for tag in self.tags(i) {
                    out.push_str(&self.source[at..tag[0].0]);
                    out.push_str(&canonical_tag(self.source, tag));
                    at = tag[tag.len() - 1].2;
                }
                out.push_str(&self.source[at..line.end]);
            } else {
                out.push_str(&" ".repeat(width));
                let tags: Vec<String> = self
                    .tags(i)
                    .into_iter()
                    .map(|tag| canonical_tag(self.source, tag))
                    .collect();
                out.push_str(&tags.join(" "));
            }
            // The last line of a body, if it is text, ends the body's text: a newline there is content.
            let newline_is_content = line.text && line.depth > 0;
            if line.has_newline || !(newline_is_content && Some(i) == last_content) {
                out.push('\n');
            }
            if let Some(indent) = line.body_indent {
                levels.push((indent, width + INDENT));
            }
            previous = Some(i);
            gap_start = i + 1;
        }
        out
    }

    /// Writes the blank and comment lines `range` that lie between two content lines.
    fn gap(
        &self,
        out: &mut String,
        range: std::ops::Range<usize>,
        blanks: Blanks,
        (at_start, at_end): (bool, bool),
        levels: &[(usize, usize)],
        next_depth: usize,
    ) {
        let lines = &self.lines[range];
        let first_comment = lines.iter().position(|line| line.kind == LineKind::Comment);
        let last_comment = lines
            .iter()
            .rposition(|line| line.kind == LineKind::Comment);
        if blanks == (Blanks::Single { insert: true })
            && !lines.iter().any(|line| line.kind == LineKind::Blank)
        {
            out.push('\n');
        }
        let mut previous_blank = false;
        for (at, line) in lines.iter().enumerate() {
            if line.kind == LineKind::Blank {
                let write = match blanks {
                    Blanks::Keep => line.has_newline,
                    Blanks::Drop => false,
                    Blanks::Single { .. } => {
                        let leading = at_start && first_comment.is_none_or(|c| at < c);
                        let trailing = at_end && last_comment.is_none_or(|c| at > c);
                        !previous_blank && !leading && !trailing
                    }
                };
                if write {
                    out.push('\n');
                }
                previous_blank = true;
                continue;
            }
            previous_blank = false;
            // A comment belongs to the deepest body its indentation reaches, and at least to the body of
            // the line it precedes.
            let width = line.width();
            let depth = levels
                .iter()
                .take_while(|&&(indent, _)| indent <= width)
                .count()
                .max(next_depth);
            let indent = depth.checked_sub(1).map_or(0, |level| levels[level].1);
            out.push_str(&" ".repeat(indent));
            out.push_str(self.source[line.content..line.end].trim_end());
            out.push('\n');
        }
    }
}

/// Whether a tag (its tokens from `<|` to `|>`) is a role switch or a context marker.
fn is_boundary(tag: &[SpannedToken]) -> bool {
    matches!(
        tag,
        [_, (_, Token::Context(_), _), ..] | [_, (_, Token::Role(_), _), (_, Token::TagClose, _)]
    )
}

/// A tag in canonical spacing, every token as written.
fn canonical_tag(source: &str, tag: &[SpannedToken]) -> String {
    let mut out = String::new();
    let mut previous: Option<&Token> = None;
    for (start, token, end) in tag {
        let glued = matches!(
            token,
            Token::TagClose | Token::Eq | Token::Colon | Token::Pipe
        ) || previous.is_none_or(|previous| {
            matches!(
                previous,
                Token::TagOpen
                    | Token::Eq
                    | Token::Colon
                    | Token::Pipe
                    | Token::Fence
                    | Token::Slash
            )
        });
        if !glued {
            out.push(' ');
        }
        out.push_str(&source[*start..*end]);
        previous = Some(token);
    }
    out
}

/// A token as the checker sees it: a text with the newlines it trims removed, or any other token.
#[derive(PartialEq)]
enum Piece<'a> {
    Text(&'a str),
    Token(&'a Token),
}

/// The tokens of a file as the checker sees them: the newlines it trims (at the start and end of the
/// file, and around role switches and context markers) removed, and texts left empty dropped. Each token
/// comes with its offset in the source.
fn meaning(tokens: &[SpannedToken]) -> Vec<(Piece<'_>, usize)> {
    let boundary_before = |at: usize| {
        tokens[at - 1].1 == Token::TagClose
            && tokens[..at]
                .iter()
                .rposition(|(_, token, _)| *token == Token::TagOpen)
                .is_some_and(|open| is_boundary(&tokens[open..at]))
    };
    let boundary_after = |at: usize| {
        tokens[at].1 == Token::TagOpen
            && tokens[at..]
                .iter()
                .position(|(_, token, _)| *token == Token::TagClose)
                .is_some_and(|close| is_boundary(&tokens[at..=at + close]))
    };
    let mut out = Vec::with_capacity(tokens.len());
    for (at, (start, token, _)) in tokens.iter().enumerate() {
        let Token::Text(text) = token else {
            out.push((Piece::Token(token), *start));
            continue;
        };
        let mut text = text.as_str();
        if at == 0 || boundary_before(at) {
            text = text.trim_start_matches('\n');
        }
        if at + 1 == tokens.len() || boundary_after(at + 1) {
            text = text.trim_end_matches('\n');
        }
        if !text.is_empty() {
            out.push((Piece::Text(text), *start));
        }
    }
    out
}

/// Checks that `formatted` means what `source` (lexed to `tokens`) means. Its tokens equal the original's
/// up to newlines trimmed from texts and texts left empty, and the original parses; the grammar takes a text
/// anywhere a node may stand, and trimming newlines never makes a text blank or not, which is all the
/// closing-tag pass looks at, so the formatted file parses too and needs no second parse.
fn verify(
    source: &str,
    tokens: &[SpannedToken],
    index: &LineIndex,
    formatted: &str,
) -> Result<(), Error> {
    let formatted_index = LineIndex::new(formatted);
    let relexed = lexer::lex(formatted, &formatted_index);
    let before = meaning(tokens);
    let after = meaning(&relexed.tokens);
    let differs = before
        .iter()
        .zip(&after)
        .position(|((a, _), (b, _))| a != b)
        .or((before.len() != after.len()).then_some(before.len().min(after.len())));
    let offset = match differs {
        None if relexed.diagnostics.is_empty() => return Ok(()),
        None => 0,
        Some(at) => before.get(at).map_or(source.len(), |&(_, offset)| offset),
    };
    let pos = index.pos(offset);
    Err(Error::MeaningChanged {
        line: pos.line,
        col: pos.col,
    })
}
