//! The parser: lexer tokens → [`crate::ast::Document`], through the lalrpop grammar in `grammar.lalrpop`, then
//! the pass that attaches explicit closing tags `<|/Name|>` to the bodies they end.

use lalrpop_util::{lalrpop_mod, ParseError};

use crate::ast::{Document, Head, Node};
use crate::diagnostics::{Code, Diagnostic};
use crate::lexer::{SpannedToken, Token};
use crate::span::LineIndex;

lalrpop_mod!(
    #[allow(clippy::all, clippy::pedantic, unused_parens)]
    grammar
);

/// Parses a token stream that lexed without errors. A syntax error is reported alone: it ends parsing.
pub fn parse(tokens: Vec<SpannedToken>, index: &LineIndex) -> Result<Document, Vec<Diagnostic>> {
    let end = tokens.last().map_or(0, |(_, _, end)| *end);
    let nodes = grammar::DocumentParser::new()
        .parse(index, tokens.into_iter().map(Ok::<_, ()>))
        .map_err(|error| vec![syntax_error(error, end, index)])?;
    let mut diagnostics = Vec::new();
    let nodes = attach_closing_tags(nodes, &mut diagnostics);
    if diagnostics.is_empty() {
        Ok(Document { nodes })
    } else {
        Err(diagnostics)
    }
}

fn syntax_error(error: ParseError<usize, Token, ()>, eof: usize, index: &LineIndex) -> Diagnostic {
    let (start, end, found, expected) = match error {
        ParseError::UnrecognizedToken {
            token: (start, token, end),
            expected,
        } => (start, end, describe(&token), expected),
        ParseError::ExtraToken {
            token: (start, token, end),
        } => (start, end, describe(&token), Vec::new()),
        ParseError::UnrecognizedEof { location, expected } => (
            location,
            location,
            "the end of the file".to_string(),
            expected,
        ),
        ParseError::InvalidToken { location } => (
            location,
            location,
            "an invalid token".to_string(),
            Vec::new(),
        ),
        ParseError::User { .. } => (eof, eof, "an error".to_string(), Vec::new()),
    };
    let mut expected: Vec<&str> = expected
        .iter()
        .filter_map(|name| expectation(name))
        .collect();
    expected.dedup();
    let label = match expected.as_slice() {
        [] => "unexpected here".to_string(),
        [one] => format!("expected {one}"),
        [init @ .., last] => format!("expected {} or {last}", init.join(", ")),
    };
    Diagnostic::new(
        Code::Syntax,
        format!("unexpected {found} in a tag"),
        index.span(start, end),
        label,
    )
    .with_help("a tag is `<|head args...|>`; see docs/holoware.md for the grammar")
}

fn describe(token: &Token) -> String {
    match token {
        Token::Text(_) => "text".to_string(),
        Token::Indent | Token::Dedent => "indentation".to_string(),
        Token::TagOpen => "`<|`".to_string(),
        Token::TagClose => "`|>`".to_string(),
        Token::Pipe => "`|`".to_string(),
        Token::Fence => "`<>`".to_string(),
        Token::Eq => "`=`".to_string(),
        Token::Colon => "`:`".to_string(),
        Token::Slash => "`/`".to_string(),
        Token::Role(role) => format!("role `{}`", role.glyph()),
        Token::Context(marker) => format!("context marker `{}`", marker.marker),
        Token::Ident(name) | Token::Word(name) => format!("name `{name}`"),
        Token::Number(number) => format!("number `{number}`"),
        Token::Str(text) => format!("string {text:?}"),
    }
}

/// Readable names for lalrpop's expected terminals, in the grammar's spelling.
fn expectation(terminal: &str) -> Option<&'static str> {
    Some(match terminal.trim_matches('"') {
        "ident" => "a name",
        "word" => "a name",
        "number" => "a number",
        "string" => "a quoted string",
        "role" => "a role (`o_o`, `x_x`, `@_@`)",
        "context" => "a context marker (`+++`, `===`)",
        "<|" => "`<|`",
        "|>" => "`|>`",
        "|" => "`|`",
        "<>" => "`<>`",
        "=" => "`=`",
        ":" => "`:`",
        "/" => "`/`",
        "\\\"|>\\\"" => "`|>`",
        _ => return None,
    })
}

/// Moves each closing tag onto the body it ends; a closing tag that ends no body is an error.
fn attach_closing_tags(nodes: Vec<Node>, diagnostics: &mut Vec<Diagnostic>) -> Vec<Node> {
    let mut out: Vec<Node> = Vec::with_capacity(nodes.len());
    for node in nodes {
        let mut tag = match node {
            Node::Tag(tag) => tag,
            text => {
                out.push(text);
                continue;
            }
        };
        if let Some(body) = tag.node.body.take() {
            let nodes = attach_closing_tags(body.nodes, diagnostics);
            tag.node.body = Some(crate::ast::Body { nodes, ..body });
        }
        let Head::Close(name) = &tag.node.head else {
            out.push(Node::Tag(tag));
            continue;
        };
        if let Some(arg) = tag.node.args.first() {
            diagnostics.push(
                Diagnostic::new(
                    Code::UnexpectedArguments,
                    "a closing tag takes no arguments",
                    arg.span,
                    "unexpected argument",
                )
                .with_help(format!("write `<|/{}|>`", name.node)),
            );
        }
        let previous = out.iter_mut().rev().find(|node| match node {
            Node::Text(text) => !text.node.trim().is_empty(),
            Node::Tag(_) => true,
        });
        let opened = match previous {
            Some(Node::Tag(previous)) => match (&previous.node.head, &mut previous.node.body) {
                (Head::Holotype(opener), Some(body)) if body.close.is_none() => {
                    Some((opener, body))
                }
                _ => None,
            },
            _ => None,
        };
        match opened {
            Some((opener, body)) if opener.node == name.node => body.close = Some(tag.span),
            Some((opener, _)) => diagnostics.push(
                Diagnostic::new(
                    Code::MismatchedClosingTag,
                    format!(
                        "closing tag `{}` follows the body of `{}`",
                        name.node, opener.node
                    ),
                    name.span,
                    format!("expected `{}`", opener.node),
                )
                .with_secondary(opener.span, "the body that ends here was opened here")
                .with_help(
                    "bodies end where the indentation returns to the opening tag's column; \
                     check the indentation of the body you meant to close",
                ),
            ),
            None => diagnostics.push(
                Diagnostic::new(
                    Code::StrayClosingTag,
                    format!("closing tag `{}` does not end a body", name.node),
                    tag.span,
                    "no indented body ends here",
                )
                .with_help(format!(
                    "bodies are delimited by indentation: indent the lines after `<|{}|>`, and put \
                     `<|/{}|>` on its own line right after them at the opening tag's column, or remove it",
                    name.node, name.node
                )),
            ),
        }
    }
    out
}
