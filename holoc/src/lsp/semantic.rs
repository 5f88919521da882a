//! Semantic tokens: colours from the lexer's own tokens, so that an editor colours a tag exactly as the
//! compiler reads it. Lines with lexical errors have no tokens; the rest of the file is still coloured.

use lsp_types as lsp;

use super::Document;
use crate::lexer::{self, LineKind, Token};
use crate::span::LineIndex;

/// The token types, in the order of the legend: a token's type is its index here.
const TYPES: [lsp::SemanticTokenType; 9] = [
    lsp::SemanticTokenType::KEYWORD,
    lsp::SemanticTokenType::CLASS,
    lsp::SemanticTokenType::VARIABLE,
    lsp::SemanticTokenType::PARAMETER,
    lsp::SemanticTokenType::STRING,
    lsp::SemanticTokenType::NUMBER,
    lsp::SemanticTokenType::OPERATOR,
    lsp::SemanticTokenType::COMMENT,
    lsp::SemanticTokenType::PROPERTY,
];

#[derive(Clone, Copy)]
enum Kind {
    Keyword,
    Class,
    Variable,
    Parameter,
    Str,
    Number,
    Operator,
    Comment,
    Property,
}

pub(super) fn legend() -> lsp::SemanticTokensLegend {
    lsp::SemanticTokensLegend {
        token_types: TYPES.to_vec(),
        token_modifiers: Vec::new(),
    }
}

pub(super) fn tokens(document: &Document) -> lsp::SemanticTokensResult {
    let text = &document.text;
    let index = LineIndex::new(text);
    let lexed = lexer::lex(text, &index);
    // (start, end, kind) in source order.
    let mut spans: Vec<(usize, usize, Kind)> = Vec::new();
    for line in &lexed.lines {
        if line.kind == LineKind::Comment {
            spans.push((line.content, line.end, Kind::Comment));
        }
    }
    let tokens = &lexed.tokens;
    let mut at = 0;
    while at < tokens.len() {
        if tokens[at].1 != Token::TagOpen {
            at += 1;
            continue;
        }
        let close = tokens[at..]
            .iter()
            .position(|(_, token, _)| *token == Token::TagClose)
            .map_or(tokens.len() - 1, |close| at + close);
        let tag = &tokens[at..=close];
        let holotype_head = matches!(&tag.get(1), Some((_, Token::Ident(name), _)) if name.starts_with(|c: char| c.is_ascii_uppercase()));
        for (position, (start, token, end)) in tag.iter().enumerate() {
            let next = tag.get(position + 1).map(|(_, token, _)| token);
            let previous = position.checked_sub(1).map(|previous| &tag[previous].1);
            let kind = match token {
                Token::Role(_) | Token::Context(_) => Kind::Keyword,
                Token::Ident(_) | Token::Word(_) => match (previous, next) {
                    (Some(Token::Fence), _) => Kind::Property,
                    (_, Some(Token::Eq)) => Kind::Parameter,
                    (Some(Token::Slash), _) => Kind::Class,
                    _ if position == 1 && holotype_head => Kind::Class,
                    _ => Kind::Variable,
                },
                Token::Str(_) => Kind::Str,
                Token::Number(_) => Kind::Number,
                Token::Text(_) | Token::Indent | Token::Dedent => continue,
                _ => Kind::Operator,
            };
            spans.push((*start, *end, kind));
        }
        at = close + 1;
    }
    spans.sort_by_key(|&(start, ..)| start);

    let mut data = Vec::with_capacity(spans.len());
    let mut previous = lsp::Position::new(0, 0);
    for (start, end, kind) in spans {
        let from = document.lines.position(text, start);
        let to = document.lines.position(text, end);
        if to.line != from.line {
            continue;
        }
        let delta_line = from.line - previous.line;
        let delta_start = if delta_line == 0 {
            from.character - previous.character
        } else {
            from.character
        };
        data.push(lsp::SemanticToken {
            delta_line,
            delta_start,
            length: to.character - from.character,
            token_type: kind as u32,
            token_modifiers_bitset: 0,
        });
        previous = from;
    }
    lsp::SemanticTokensResult::Tokens(lsp::SemanticTokens {
        result_id: None,
        data,
    })
}
