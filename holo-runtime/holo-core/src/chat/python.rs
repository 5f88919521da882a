//! Python semantics: how Python strips, splits and prints what templates handle.

use minijinja::value::ValueKind;
use minijinja::{Error, ErrorKind, State, Value};

use super::*;

// Python semantics.

/// Python's `str.isspace()` for one character: Rust's whitespace plus the four ASCII separators
/// U+001C..U+001F, which Python also strips and splits on.
pub(super) fn py_is_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.strip()` without arguments.
pub(super) fn py_strip(s: &str) -> &str {
    s.trim_matches(py_is_space)
}

/// Python's `str.rstrip()` without arguments.
pub(super) fn py_rstrip(s: &str) -> &str {
    s.trim_end_matches(py_is_space)
}

/// Python's `str.split()` without a separator: runs of whitespace separate, no empty strings.
pub(super) fn py_split_whitespace(s: &str, maxsplit: Option<i64>) -> Vec<Value> {
    let mut parts = Vec::new();
    let mut rest = s.trim_start_matches(py_is_space);
    let mut splits = 0;
    while !rest.is_empty() {
        if maxsplit.is_some_and(|max| max >= 0 && splits >= max) {
            parts.push(Value::from(rest));
            break;
        }
        match rest.find(py_is_space) {
            Some(end) => {
                parts.push(Value::from(&rest[..end]));
                rest = rest[end..].trim_start_matches(py_is_space);
                splits += 1;
            }
            None => {
                parts.push(Value::from(rest));
                break;
            }
        }
    }
    parts
}

/// Python's `str.splitlines(keepends)`.
pub(super) fn py_splitlines(s: &str, keepends: bool) -> Vec<Value> {
    let is_break = |c: char| {
        matches!(
            c,
            '\n' | '\r' | '\u{b}' | '\u{c}' | '\u{1c}'
                ..='\u{1e}' | '\u{85}' | '\u{2028}' | '\u{2029}'
        )
    };
    let mut lines = Vec::new();
    let mut start = 0;
    let mut chars = s.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        if is_break(c) {
            let mut end = at + c.len_utf8();
            if c == '\r' {
                if let Some((_, '\n')) = chars.peek() {
                    chars.next();
                    end += 1;
                }
            }
            lines.push(Value::from(if keepends {
                &s[start..end]
            } else {
                &s[start..at]
            }));
            start = end;
        }
    }
    if start < s.len() {
        lines.push(Value::from(&s[start..]));
    }
    lines
}

/// Python methods on values: `minijinja_contrib::pycompat`, with Python's notion of whitespace for the
/// argument-less `strip`/`lstrip`/`rstrip`/`split` and for `splitlines`.
pub(super) fn py_methods(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        let no_chars = match args {
            [] => true,
            [arg] => arg.is_none(),
            _ => false,
        };
        match method {
            "strip" if no_chars => return Ok(Value::from(py_strip(s))),
            "lstrip" if no_chars => return Ok(Value::from(s.trim_start_matches(py_is_space))),
            "rstrip" if no_chars => return Ok(Value::from(py_rstrip(s))),
            "split" if args.is_empty() || args[0].is_none() => {
                let maxsplit = match args.get(1) {
                    Some(max) => Some(max.as_i64().ok_or_else(|| {
                        Error::new(
                            ErrorKind::InvalidOperation,
                            "split: maxsplit must be an integer",
                        )
                    })?),
                    None => None,
                };
                return Ok(Value::from(py_split_whitespace(s, maxsplit)));
            }
            "splitlines" => {
                let keepends = args.first().is_some_and(Value::is_true);
                return Ok(Value::from(py_splitlines(s, keepends)));
            }
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// `str(value)` in Python, which is what Jinja prints: `True`, `None`, `2.0`, `['a', 1]`; undefined prints as
/// nothing.
pub(super) fn py_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => value.as_str().unwrap_or_default().to_string(),
        _ => py_repr(value),
    }
}

/// `repr(value)` in Python.
pub(super) fn py_repr(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => "Undefined".into(),
        ValueKind::None => "None".into(),
        ValueKind::Bool => if value.is_true() { "True" } else { "False" }.into(),
        ValueKind::Number => match f64_of(value) {
            Some(float) => py_float_repr(float),
            None => value.to_string(),
        },
        ValueKind::String => py_repr_str(value.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            let items: Vec<String> = value
                .try_iter()
                .map(|it| it.map(|v| py_repr(&v)).collect())
                .unwrap_or_default();
            if value.is_tuple() {
                if items.len() == 1 {
                    format!("({},)", items[0])
                } else {
                    format!("({})", items.join(", "))
                }
            } else {
                format!("[{}]", items.join(", "))
            }
        }
        ValueKind::Map => {
            let items: Vec<String> = value
                .try_iter()
                .map(|keys| {
                    keys.map(|key| {
                        let item = value.get_item(&key).unwrap_or_default();
                        format!("{}: {}", py_repr(&key), py_repr(&item))
                    })
                    .collect()
                })
                .unwrap_or_default();
            format!("{{{}}}", items.join(", "))
        }
        _ => value.to_string(),
    }
}

/// The float inside a number value, `None` for integers.
pub(super) fn f64_of(value: &Value) -> Option<f64> {
    if value.is_integer() {
        None
    } else {
        f64::try_from(value.clone()).ok()
    }
}

/// `repr(float)` in Python: the shortest digits that round-trip, positional for exponents in -4..16, else
/// scientific with a signed two-digit exponent (`1e+16`, `1.5e-07`).
pub(super) fn py_float_repr(float: f64) -> String {
    if float.is_nan() {
        return "nan".into();
    }
    if float.is_infinite() {
        return if float > 0.0 { "inf" } else { "-inf" }.into();
    }
    let sci = format!("{float:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exponent) {
        if exponent >= 0 {
            let point = exponent as usize + 1;
            if digits.len() <= point {
                format!("{sign}{digits}{}.0", "0".repeat(point - digits.len()))
            } else {
                format!("{sign}{}.{}", &digits[..point], &digits[point..])
            }
        } else {
            format!("{sign}0.{}{digits}", "0".repeat((-exponent - 1) as usize))
        }
    } else {
        let tail = if digits.len() > 1 {
            format!(".{}", &digits[1..])
        } else {
            String::new()
        };
        let exp_sign = if exponent < 0 { '-' } else { '+' };
        format!(
            "{sign}{}{tail}e{exp_sign}{:02}",
            &digits[..1],
            exponent.abs()
        )
    }
}

/// Whether Python's `str.isprintable()` holds for a character (an approximation without Unicode tables:
/// control, format, separator other than space, and private-use characters are not printable).
pub(super) fn py_printable(c: char) -> bool {
    let code = c as u32;
    !(c.is_control()
        || matches!(code, 0xad | 0x600..=0x605 | 0x61c | 0x6dd | 0x70f | 0x180e | 0x200b..=0x200f
            | 0x202a..=0x202e | 0x2060..=0x2064 | 0x2066..=0x206f | 0xfeff | 0xfff9..=0xfffb
            | 0xe0001 | 0xe0020..=0xe007f)
        || (c.is_whitespace() && c != ' ')
        || matches!(code, 0xe000..=0xf8ff | 0xf0000..=0x10ffff))
}

/// `repr(str)` in Python.
pub(super) fn py_repr_str(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !py_printable(c) => {
                let code = c as u32;
                if code < 0x100 {
                    write!(out, "\\x{code:02x}").ok();
                } else if code < 0x10000 {
                    write!(out, "\\u{code:04x}").ok();
                } else {
                    write!(out, "\\U{code:08x}").ok();
                }
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}
