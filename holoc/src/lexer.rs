//! The lexer: source text → tokens for the parser, with the layout pass that turns space-indented bodies
//! into `Indent`/`Dedent` tokens and applies the whitespace rules of docs/holoware.md.
//!
//! Lexing is line-oriented: a whole-line `#` comment disappears with its newline, a tag never spans lines,
//! and a line that holds only structural tags (roles, context markers, samplers, closing tags and
//! holotypes) consumes its own indentation and newline; a line with a variable or text keeps them. Each line is lexed by two logos lexers:
//! `TextLex` for text and `TagLex` between `<|` and `|>`.

use logos::Logos;

use crate::ast::{ContextMarker, Role};
use crate::diagnostics::{Code, Diagnostic};
use crate::span::LineIndex;

/// The deepest nesting of bodies the layout pass accepts; it bounds recursion in every later stage.
pub const MAX_NESTING: usize = 64;

/// A token of the parser's input. Text is already unescaped and has the whitespace rules applied.
#[derive(Debug, Clone, PartialEq)]
pub enum Token {
    Text(String),
    Indent,
    Dedent,
    TagOpen,
    TagClose,
    Pipe,
    Fence,
    Eq,
    Colon,
    Slash,
    Role(Role),
    Context(ContextMarker),
    Ident(String),
    Word(String),
    Number(String),
    Str(String),
}

/// `(start, token, end)` with byte offsets, the shape lalrpop's external lexers produce.
pub type SpannedToken = (usize, Token, usize);

#[derive(Logos, Debug, Clone, Copy, PartialEq)]
enum TextLex {
    #[token("<|")]
    TagOpen,
    #[token("\\<|")]
    EscapedTagOpen,
    #[regex(r"[^<\\]+")]
    Run,
    #[token("<")]
    Lt,
    #[token("\\")]
    Backslash,
}

#[derive(Logos, Debug, Clone, Copy, PartialEq)]
#[logos(skip r"[ \t]+")]
enum TagLex {
    #[token("|>")]
    Close,
    #[token("|")]
    Pipe,
    #[token("<>")]
    Fence,
    #[token("=")]
    Eq,
    #[token(":")]
    Colon,
    #[token("/")]
    Slash,
    #[token("x_x", priority = 10)]
    System,
    #[token("o_o", priority = 10)]
    User,
    #[token("@_@", priority = 10)]
    Assistant,
    #[regex(r"\+\+\+|===|---|\^\^\^|###|@@@|\*\*\*|%%%", priority = 10)]
    Context,
    #[regex("[A-Za-z_][A-Za-z0-9_]*", priority = 5)]
    Ident,
    #[regex(r"[+-]?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?", priority = 5)]
    Number,
    #[regex(r#""([^"\\]|\\.)*""#)]
    DoubleQuoted,
    #[regex(r"'[^']*'")]
    SingleQuoted,
    #[regex(r#""([^"\\]|\\.)*\\?"#)]
    UnterminatedDouble,
    #[regex(r"'[^']*")]
    UnterminatedSingle,
    #[regex(r#"[^\s|"'=<>:/]+"#, priority = 1)]
    Word,
}

/// How a tag affects the layout of its line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TagClass {
    /// Roles, context markers, samplers and closing tags: render no text of their own.
    Structural,
    /// A capitalised head: a holotype, which opens a body when the next line is indented, and is
    /// structural for the newline rule.
    Holotype,
    /// Variables and anything malformed: renders text in place.
    Value,
}

enum Item {
    Text {
        start: usize,
        end: usize,
        text: String,
    },
    Tag {
        tokens: Vec<SpannedToken>,
        class: TagClass,
    },
}

impl Item {
    fn is_blank_text(&self) -> bool {
        matches!(self, Item::Text { text, .. } if text.trim().is_empty())
    }
}

/// What a line of the source is, before its content is lexed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineKind {
    /// Nothing but spaces and tabs.
    Blank,
    /// A whole-line `#` comment.
    Comment,
    Content,
}

/// One line of the source as the layout pass read it: the view that tools rewriting the source (the
/// formatter) need to keep its meaning. The layout fields (`depth` to `tokens`) are set for content lines
/// only.
#[derive(Debug, Clone)]
pub struct Line {
    /// Offset of the first byte of the line (after a byte-order mark on the first line).
    pub start: usize,
    /// Offset of the first character after the indentation.
    pub content: usize,
    /// Offset of the line end, excluding `\r\n` / `\n`.
    pub end: usize,
    pub has_newline: bool,
    pub kind: LineKind,
    /// How many bodies enclose the line, after those that it ends.
    pub depth: usize,
    /// The indentation of the innermost enclosing body's lines (0 at top level): a text line's
    /// indentation beyond it is text.
    pub base: usize,
    /// Whether the line is a text line (text or a value tag: its indentation and newline are text), as
    /// opposed to a line of only structural and holotype tags.
    pub text: bool,
    /// Whether the line holds exactly one holotype tag and nothing else: such a line opens a body when the
    /// next content line is indented more.
    pub lone_holotype: bool,
    /// The indentation of the body's lines, when the line opens a body.
    pub body_indent: Option<usize>,
    /// The tokens of the line's tags (and text), as a range of [`Lexed::tokens`].
    pub tokens: std::ops::Range<usize>,
}

impl Line {
    /// Indentation width in columns; a tab counts as one column (tabs in body indentation are errors).
    pub fn width(&self) -> usize {
        self.content - self.start
    }
}

struct Level {
    /// Indentation of the body's lines.
    indent: usize,
    /// Indentation of the line holding the opening tag.
    opener_indent: usize,
}

pub struct Lexed {
    pub tokens: Vec<SpannedToken>,
    pub diagnostics: Vec<Diagnostic>,
    /// Every line of the source, in order.
    pub lines: Vec<Line>,
}

/// Lexes a whole source file. Lexical errors are collected, one per offending line; a line with an
/// error contributes no tokens.
pub fn lex(source: &str, index: &LineIndex) -> Lexed {
    Layout::new(source, index).run()
}

fn split_lines(source: &str) -> Vec<Line> {
    let mut lines = Vec::new();
    let mut offset = 0;
    for raw in source.split_inclusive('\n') {
        let mut start = offset;
        offset += raw.len();
        if start == 0 && raw.starts_with('\u{feff}') {
            start += '\u{feff}'.len_utf8();
        }
        let has_newline = raw.ends_with('\n');
        let mut end = offset - usize::from(has_newline);
        if source[start..end].ends_with('\r') {
            end -= 1;
        }
        let text = &source[start..end];
        let rest = text.trim_start_matches([' ', '\t']);
        let content = end - rest.len();
        let kind = if rest.trim().is_empty() {
            LineKind::Blank
        } else if rest.starts_with('#') {
            LineKind::Comment
        } else {
            LineKind::Content
        };
        lines.push(Line {
            start,
            content,
            end,
            has_newline,
            kind,
            depth: 0,
            base: 0,
            text: false,
            lone_holotype: false,
            body_indent: None,
            tokens: 0..0,
        });
    }
    lines
}

struct Layout<'s> {
    source: &'s str,
    index: &'s LineIndex<'s>,
    lines: Vec<Line>,
    levels: Vec<Level>,
    blank_lines: usize,
    tokens: Vec<SpannedToken>,
    diagnostics: Vec<Diagnostic>,
    reported_tab: bool,
    reported_nesting: bool,
}

impl<'s> Layout<'s> {
    fn new(source: &'s str, index: &'s LineIndex<'s>) -> Self {
        Layout {
            source,
            index,
            lines: split_lines(source),
            levels: Vec::new(),
            blank_lines: 0,
            tokens: Vec::new(),
            diagnostics: Vec::new(),
            reported_tab: false,
            reported_nesting: false,
        }
    }

    fn run(mut self) -> Lexed {
        let mut next_content = vec![None; self.lines.len()];
        let mut following = None;
        for (i, line) in self.lines.iter().enumerate().rev() {
            next_content[i] = following;
            if line.kind == LineKind::Content {
                following = Some(i);
            }
        }
        for (i, next) in next_content.into_iter().enumerate() {
            match self.lines[i].kind {
                LineKind::Comment => {}
                LineKind::Blank => {
                    if self.lines[i].has_newline {
                        self.blank_lines += 1;
                    }
                }
                LineKind::Content => self.content_line(i, next),
            }
        }
        let end = self.source.len();
        // Blank lines at the end of the file follow the bodies still open, as they do everywhere else.
        for _ in 0..self.levels.len() {
            self.tokens.push((end, Token::Dedent, end));
        }
        self.flush_blank_lines(end);
        Lexed {
            tokens: self.tokens,
            diagnostics: self.diagnostics,
            lines: self.lines,
        }
    }

    fn content_line(&mut self, i: usize, next: Option<usize>) {
        let line = &self.lines[i];
        let (start, content, end, has_newline) =
            (line.start, line.content, line.end, line.has_newline);
        let width = line.width();
        if !self.levels.is_empty() && self.has_tab(start, content) {
            return;
        }

        if let Some(ended) = self.close_levels(width, start) {
            if width > ended.opener_indent {
                let span = self.index.span(start, content);
                self.diagnostics.push(
                    Diagnostic::new(
                        Code::InconsistentIndentation,
                        "this line's indentation does not match any enclosing level",
                        span,
                        format!(
                            "indented {width} columns, but the body before it is indented {} and its tag {}",
                            ended.indent, ended.opener_indent
                        ),
                    )
                    .with_help(format!(
                        "indent this line {} columns to continue the body, or {} to end it",
                        ended.indent, ended.opener_indent
                    )),
                );
                return;
            }
        }
        self.flush_blank_lines(start);

        let Some(items) = self.lex_line(content, end) else {
            return;
        };
        let base = self.levels.last().map_or(0, |level| level.indent);
        let significant: Vec<&Item> = items.iter().filter(|item| !item.is_blank_text()).collect();
        // Holotypes write their own text, trailing newline included if they want one, so a line of
        // holotype tags consumes its newline like a line of roles or samplers.
        let structural = significant.iter().all(|item| {
            matches!(
                item,
                Item::Tag {
                    class: TagClass::Structural | TagClass::Holotype,
                    ..
                }
            )
        });
        let lone_holotype = matches!(
            significant.as_slice(),
            [Item::Tag {
                class: TagClass::Holotype,
                ..
            }]
        );
        let opens_body = lone_holotype && next.is_some_and(|j| self.lines[j].width() > width);

        let first_token = self.tokens.len();
        if structural || opens_body {
            for item in items {
                if let Item::Tag { tokens, .. } = item {
                    self.tokens.extend(tokens);
                }
            }
        } else {
            if content > start + base {
                self.push_text(
                    start + base,
                    content,
                    self.source[start + base..content].to_string(),
                );
            }
            for item in items {
                match item {
                    Item::Text { start, end, text } => self.push_text(start, end, text),
                    Item::Tag { tokens, .. } => self.tokens.extend(tokens),
                }
            }
            if has_newline {
                self.push_text(end, end, "\n".to_string());
            }
        }
        let line = &mut self.lines[i];
        line.depth = self.levels.len();
        line.base = base;
        line.text = !(structural || opens_body);
        line.lone_holotype = lone_holotype;
        line.tokens = first_token..self.tokens.len();

        if opens_body {
            let next = &self.lines[next.expect("opens_body implies a next line")];
            let (body_start, body_content, body_indent) = (next.start, next.content, next.width());
            if self.levels.len() >= MAX_NESTING {
                if !self.reported_nesting {
                    self.reported_nesting = true;
                    let span = self.index.span(content, end);
                    self.diagnostics.push(
                        Diagnostic::new(
                            Code::NestingTooDeep,
                            format!("bodies are nested more than {MAX_NESTING} levels deep"),
                            span,
                            "this body is too deep",
                        )
                        .with_help("split the holoware, or flatten the nesting of its holotypes"),
                    );
                }
                return;
            }
            self.has_tab(body_start, body_content);
            self.lines[i].body_indent = Some(body_indent);
            self.tokens.push((end, Token::Indent, end));
            self.levels.push(Level {
                indent: body_indent,
                opener_indent: width,
            });
        }
    }

    /// Pops every body the line at `width` ends, emitting `Dedent`s; returns the outermost level closed.
    fn close_levels(&mut self, width: usize, at: usize) -> Option<Level> {
        let mut ended = None;
        while self.levels.last().is_some_and(|level| width < level.indent) {
            ended = self.levels.pop();
            self.tokens.push((at, Token::Dedent, at));
        }
        ended
    }

    /// Whether the indentation `start..content` of a body line holds a tab; reports the first one.
    fn has_tab(&mut self, start: usize, content: usize) -> bool {
        let Some(tab) = self.source[start..content].find('\t') else {
            return false;
        };
        if !self.reported_tab {
            self.reported_tab = true;
            let at = start + tab;
            self.diagnostics.push(
                Diagnostic::new(
                    Code::TabIndentation,
                    "tab in body indentation",
                    self.index.span(at, at + 1),
                    "this is a tab",
                )
                .with_help("indent bodies with spaces only"),
            );
        }
        true
    }

    fn flush_blank_lines(&mut self, at: usize) {
        if self.blank_lines > 0 {
            let text = "\n".repeat(self.blank_lines);
            self.blank_lines = 0;
            self.push_text(at, at, text);
        }
    }

    fn push_text(&mut self, start: usize, end: usize, text: String) {
        if let Some((_, Token::Text(previous), previous_end)) = self.tokens.last_mut() {
            previous.push_str(&text);
            *previous_end = (*previous_end).max(end);
            return;
        }
        self.tokens.push((start, Token::Text(text), end));
    }

    /// Lexes the part of a line after its indentation into text and tags. Reports the line's first
    /// lexical error and returns `None` for it.
    fn lex_line(&mut self, from: usize, to: usize) -> Option<Vec<Item>> {
        let line = &self.source[from..to];
        let mut items = Vec::new();
        let mut text = String::new();
        let mut text_start = from;
        let mut lexer = TextLex::lexer(line);
        if line.starts_with("\\#") {
            text.push('#');
            lexer.bump(2);
        }
        while let Some(token) = lexer.next() {
            let span = lexer.span();
            match token {
                Ok(TextLex::Run | TextLex::Lt | TextLex::Backslash) => text.push_str(lexer.slice()),
                Ok(TextLex::EscapedTagOpen) => text.push_str("<|"),
                Ok(TextLex::TagOpen) => {
                    if !text.is_empty() {
                        items.push(Item::Text {
                            start: text_start,
                            end: from + span.start,
                            text: std::mem::take(&mut text),
                        });
                    }
                    let mut tag_lexer = lexer.morph::<TagLex>();
                    let tag = self.lex_tag(&mut tag_lexer, from, from + span.start, to);
                    lexer = tag_lexer.morph();
                    items.push(tag?);
                    text_start = from + lexer.span().end;
                }
                Err(()) => unreachable!("TextLex accepts every character"),
            }
        }
        if !text.is_empty() {
            items.push(Item::Text {
                start: text_start,
                end: to,
                text,
            });
        }
        Some(items)
    }

    fn lex_tag(
        &mut self,
        lexer: &mut logos::Lexer<'s, TagLex>,
        base: usize,
        open: usize,
        line_end: usize,
    ) -> Option<Item> {
        let mut tokens = vec![(open, Token::TagOpen, open + 2)];
        while let Some(token) = lexer.next() {
            let span = lexer.span();
            let (start, end) = (base + span.start, base + span.end);
            let slice = lexer.slice();
            let token = match token {
                Ok(TagLex::Close) => {
                    tokens.push((start, Token::TagClose, end));
                    let class = classify(&tokens);
                    return Some(Item::Tag { tokens, class });
                }
                Ok(TagLex::Pipe) => Token::Pipe,
                Ok(TagLex::Fence) => Token::Fence,
                Ok(TagLex::Eq) => Token::Eq,
                Ok(TagLex::Colon) => Token::Colon,
                Ok(TagLex::Slash) => Token::Slash,
                Ok(TagLex::System) => Token::Role(Role::System),
                Ok(TagLex::User) => Token::Role(Role::User),
                Ok(TagLex::Assistant) => Token::Role(Role::Assistant),
                Ok(TagLex::Context) => Token::Context(ContextMarker::from_marker(slice)),
                Ok(TagLex::Ident) => Token::Ident(slice.to_string()),
                Ok(TagLex::Number) => Token::Number(slice.to_string()),
                Ok(TagLex::Word) => Token::Word(slice.to_string()),
                Ok(TagLex::DoubleQuoted) => Token::Str(unescape(&slice[1..slice.len() - 1])),
                Ok(TagLex::SingleQuoted) => Token::Str(slice[1..slice.len() - 1].to_string()),
                Ok(TagLex::UnterminatedDouble | TagLex::UnterminatedSingle) => {
                    let quote = &slice[..1];
                    self.diagnostics.push(
                        Diagnostic::new(
                            Code::UnbalancedQuote,
                            "unbalanced quote inside a tag",
                            self.index.span(start, start + 1),
                            format!("this {quote} is never closed"),
                        )
                        .with_secondary(self.index.span(open, open + 2), "in this tag")
                        .with_help(format!(
                            "close the string with {quote} before the end of the line"
                        )),
                    );
                    return None;
                }
                Err(()) => {
                    let found = slice.chars().next().unwrap_or(' ');
                    self.diagnostics.push(
                        Diagnostic::new(
                            Code::UnexpectedCharacter,
                            format!("unexpected character `{found}` inside a tag"),
                            self.index.span(start, start + found.len_utf8()),
                            "not allowed here",
                        )
                        .with_secondary(self.index.span(open, open + 2), "in this tag")
                        .with_help("quote values that contain punctuation: key=\"...\""),
                    );
                    return None;
                }
            };
            tokens.push((start, token, end));
        }
        self.diagnostics.push(
            Diagnostic::new(
                Code::UnclosedTag,
                "unclosed tag",
                self.index.span(open, line_end),
                "this tag is not closed by `|>` on its line",
            )
            .with_help("close the tag with `|>`, or write `\\<|` for a literal `<|` in text"),
        );
        None
    }
}

fn classify(tokens: &[SpannedToken]) -> TagClass {
    match tokens.get(1).map(|(_, token, _)| token) {
        Some(Token::Role(_) | Token::Context(_) | Token::Slash) => TagClass::Structural,
        Some(Token::Ident(name)) if name.starts_with(|c: char| c.is_ascii_uppercase()) => {
            TagClass::Holotype
        }
        _ => TagClass::Value,
    }
}

/// Resolves the escapes of a double-quoted string: `\"`, `\\`, `\n`, `\t`; any other backslash is kept.
fn unescape(quoted: &str) -> String {
    let mut out = String::with_capacity(quoted.len());
    let mut chars = quoted.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some(escaped @ ('"' | '\\')) => out.push(escaped),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    out
}
