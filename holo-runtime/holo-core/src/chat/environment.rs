//! The environment: transformers' Jinja environment, in minijinja.

use std::fmt;

use minijinja::value::ValueKind;
use minijinja::{Environment, Error, ErrorKind, State, UndefinedBehavior, Value};

use super::*;

// The environment: transformers' Jinja environment, in minijinja.

pub(super) fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .keep_trailing_newline(false)
        .build();
    match syntax {
        Ok(syntax) => env.set_syntax(syntax),
        // Only custom delimiters can fail to build.
        Err(error) => unreachable!("default delimiters: {error}"),
    }
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
    env.set_formatter(|out, _state, value| {
        out.write_str(&py_str(value))
            .map_err(|_| Error::new(ErrorKind::WriteFailure, "cannot write"))
    });
    env.set_unknown_method_callback(py_methods);
    env.add_filter("tojson", tojson);
    env.add_filter("trim", |value: &Value, chars: Option<&str>| -> String {
        let text = py_str(value);
        match chars {
            Some(chars) => text.trim_matches(|c| chars.contains(c)).to_string(),
            None => py_strip(&text).to_string(),
        }
    });
    env.add_filter("string", |value: &Value| py_str(value));
    env.add_filter("holo_generation", |state: &State, body: String| -> String {
        if state
            .lookup(TRACK_GENERATION)
            .is_some_and(|track| track.is_true())
        {
            format!("{GENERATION_START}{body}{GENERATION_END}")
        } else {
            body
        }
    });
    // Jinja's tests, which ask Python: `none is iterable` is false, a string is a sequence.
    env.add_test("iterable", |value: &Value| match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Number | ValueKind::Invalid => false,
        ValueKind::Plain => value.try_iter().is_ok(),
        _ => true,
    });
    env.add_test("sequence", |value: &Value| {
        matches!(
            value.kind(),
            ValueKind::Undefined
                | ValueKind::String
                | ValueKind::Bytes
                | ValueKind::Seq
                | ValueKind::Map
        )
    });
    env.add_function(
        "raise_exception",
        |message: Option<&Value>| -> Result<Value, Error> {
            let message = message.map(py_str).unwrap_or_default();
            Err(Error::new(ErrorKind::InvalidOperation, message.clone())
                .with_source(Raised(message)))
        },
    );
    env
}

/// The error `raise_exception` fails a render with.
#[derive(Debug)]
pub(super) struct Raised(String);

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

pub(super) fn raised_message(error: &Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(current) = source {
        if let Some(raised) = current.downcast_ref::<Raised>() {
            return Some(raised.0.clone());
        }
        source = current.source();
    }
    None
}

/// Rewrites `{% generation %}` / `{% endgeneration %}` (transformers' assistant-mask extension, unknown to
/// minijinja) into `{% filter holo_generation %}` / `{% endfilter %}`: block tags with the same whitespace
/// handling, whose filter marks the block's output when [`ChatTemplate::render_tracked`] asks.
pub(super) fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            break;
        };
        let inner = &tag[2..end];
        let (open, body) = match inner.strip_prefix(['-', '+']) {
            Some(body) => (&inner[..1], body),
            None => ("", inner),
        };
        let (body, close) = match body.strip_suffix(['-', '+']) {
            Some(stripped) => (stripped, &body[body.len() - 1..]),
            None => (body, ""),
        };
        let replacement = match body.trim() {
            "generation" => Some("filter holo_generation"),
            "endgeneration" => Some("endfilter"),
            _ => None,
        };
        match replacement {
            Some(keyword) => write!(out, "{{%{open} {keyword} {close}%}}").unwrap_or(()),
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}
