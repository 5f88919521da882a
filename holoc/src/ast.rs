//! The syntax tree of a `.hol` file, as written. Every node is spanned.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::span::{Span, Spanned};

#[derive(Debug, Clone, PartialEq)]
pub struct Document {
    pub nodes: Vec<Node>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    /// Literal text, after escapes and the whitespace rules.
    Text(Spanned<String>),
    Tag(Spanned<Tag>),
}

/// A chat role. `x_x` is system, `o_o` user, `@_@` assistant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    /// The emoticon that writes the role in a `.hol` file.
    pub fn glyph(self) -> &'static str {
        match self {
            Role::System => "x_x",
            Role::User => "o_o",
            Role::Assistant => "@_@",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// A context marker: `+++` starts a trained context; `===` and its aliases an untrained one.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct ContextMarker {
    pub marker: &'static str,
}

impl ContextMarker {
    pub const TRAINED: &'static str = "+++";
    pub const UNTRAINED: [&'static str; 7] = ["===", "---", "^^^", "###", "@@@", "***", "%%%"];

    /// `marker` must be one of the markers the lexer recognises.
    pub fn from_marker(marker: &str) -> Self {
        let marker = std::iter::once(Self::TRAINED)
            .chain(Self::UNTRAINED)
            .find(|known| *known == marker)
            .expect("the lexer only produces known context markers");
        ContextMarker { marker }
    }

    pub fn trained(self) -> bool {
        self.marker == Self::TRAINED
    }
}

impl fmt::Debug for ContextMarker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.trained() {
            "trained"
        } else {
            "untrained"
        };
        write!(f, "{} ({kind})", self.marker)
    }
}

/// `<|head args...|>` with an optional indented body.
#[derive(Debug, Clone, PartialEq)]
pub struct Tag {
    pub head: Head,
    pub args: Vec<Spanned<Arg>>,
    pub body: Option<Body>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Head {
    /// `o_o`, `x_x`, `@_@`, optionally with a binding: `@_@:name`.
    Role {
        role: Spanned<Role>,
        binding: Option<Spanned<String>>,
    },
    /// `+++`, `===`, ...
    Context(Spanned<ContextMarker>),
    /// `/Name`: the explicit end of the body of `Name`.
    Close(Spanned<String>),
    /// A capitalised name: a holotype.
    Holotype(Spanned<String>),
    /// Variables and quoted defaults separated by `|`; the first present one is inserted.
    Value(Vec<Spanned<Alternative>>),
}

#[derive(Debug, Clone, PartialEq)]
pub enum Alternative {
    Variable(String),
    Literal(String),
}

#[derive(Debug, Clone, PartialEq)]
pub enum Arg {
    /// `name=value`
    Keyword {
        name: Spanned<String>,
        value: Spanned<Value>,
    },
    /// `<>name`
    Fence(Spanned<String>),
    /// A bare value.
    Positional(Value),
}

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// An unquoted word (identifiers included).
    Word(String),
    Number(String),
    /// A quoted string, escapes resolved.
    Str(String),
}

impl Value {
    /// The value as the text it stands for.
    pub fn text(&self) -> &str {
        match self {
            Value::Word(text) | Value::Number(text) | Value::Str(text) => text,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Body {
    pub nodes: Vec<Node>,
    /// The explicit closing tag `<|/Name|>` after the body, if written.
    pub close: Option<Span>,
}

/// Whether `name` is an identifier: ASCII letters, digits and `_`, not starting with a digit.
pub fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Whether `name` can name a variable: an identifier that does not start with an uppercase letter.
pub fn is_variable_name(name: &str) -> bool {
    is_identifier(name) && !name.starts_with(|c: char| c.is_ascii_uppercase())
}

impl Head {
    /// A head of names separated by `|`: one capitalised name is a holotype, anything else a value.
    pub fn from_alternatives(first: Spanned<Alternative>, rest: Vec<Spanned<Alternative>>) -> Head {
        match (&first.node, rest.is_empty()) {
            (Alternative::Variable(name), true)
                if name.starts_with(|c: char| c.is_ascii_uppercase()) =>
            {
                Head::Holotype(Spanned::new(name.clone(), first.span))
            }
            _ => Head::Value(std::iter::once(first).chain(rest).collect()),
        }
    }
}

/// `name` with every character that cannot appear in an identifier replaced by `_`, lowercased, and
/// prefixed with `_` when it would start with a digit: `my-env` → `my_env`, `1st` → `_1st`.
pub fn to_snake_identifier(name: &str) -> String {
    let mut out: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    if !out.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_') {
        out.insert(0, '_');
    }
    out
}
