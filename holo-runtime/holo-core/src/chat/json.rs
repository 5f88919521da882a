//! tojson: transformers' filter, `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//! sort_keys=False)`.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

use super::*;

// tojson: transformers' filter, `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
// sort_keys=False)`.

pub(super) struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

pub(super) fn tojson(
    value: &Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    separators: Option<Value>,
    kwargs: Kwargs,
) -> Result<String, Error> {
    let pick = |positional: Option<Value>, name: &str| -> Result<Option<Value>, Error> {
        let keyword: Option<Value> = kwargs.get(name)?;
        Ok(keyword.or(positional))
    };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let indent = match pick(indent, "indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_str(), v.as_i64()) {
            (Some(text), _) => Some(text.to_string()),
            (None, Some(width)) => Some(" ".repeat(width.max(0) as usize)),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an int or a string",
                ))
            }
        },
    };
    let (item_separator, key_separator) = match pick(separators, "separators")? {
        Some(pair) if !pair.is_none() => {
            let parts: Vec<String> = pair
                .try_iter()?
                .map(|part| part.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be strings",
                    )
                })?;
            match <[String; 2]>::try_from(parts) {
                Ok([item, key]) => (item, key),
                Err(_) => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair",
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let sort_keys = kwargs
        .get::<Option<Value>>("sort_keys")?
        .is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let style = JsonStyle {
        ensure_ascii,
        indent,
        item_separator,
        key_separator,
        sort_keys,
    };
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(out)
}

pub(super) fn not_serializable(value: &Value) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!(
            "tojson: object of type {} is not JSON serializable",
            value.kind()
        ),
    )
}

pub(super) fn write_json(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    level: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => match f64_of(value) {
            Some(float) if float.is_nan() => out.push_str("NaN"),
            Some(float) if float.is_infinite() => {
                out.push_str(if float > 0.0 { "Infinity" } else { "-Infinity" })
            }
            Some(float) => out.push_str(&py_float_repr(float)),
            None => out.push_str(&value.to_string()),
        },
        ValueKind::String => {
            write_json_str(out, value.as_str().unwrap_or_default(), style.ensure_ascii)
        }
        ValueKind::Seq => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, style, level, ('[', ']'), items.len(), |out, index| {
                write_json(out, &items[index], style, level + 1)
            })?;
        }
        ValueKind::Map => {
            let mut items: Vec<(Value, Value)> = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                items.push((key, item));
            }
            if style.sort_keys {
                items.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(out, style, level, ('{', '}'), items.len(), |out, index| {
                let (key, item) = &items[index];
                let key = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or_default().to_string(),
                    ValueKind::None => "null".into(),
                    ValueKind::Bool => if key.is_true() { "true" } else { "false" }.into(),
                    ValueKind::Number => py_str(key),
                    _ => {
                        return Err(Error::new(
                            ErrorKind::InvalidOperation,
                            format!(
                                "tojson: keys must be str, int, float, bool or None, not {}",
                                key.kind()
                            ),
                        ))
                    }
                };
                write_json_str(out, &key, style.ensure_ascii);
                out.push_str(&style.key_separator);
                write_json(out, item, style, level + 1)
            })?;
        }
        _ => return Err(not_serializable(value)),
    }
    Ok(())
}

pub(super) fn write_container(
    out: &mut String,
    style: &JsonStyle,
    level: usize,
    (open, close): (char, char),
    len: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    let newline = |level: usize| {
        style
            .indent
            .as_ref()
            .map(|indent| format!("\n{}", indent.repeat(level)))
    };
    let inner = newline(level + 1);
    if let Some(inner) = &inner {
        out.push_str(inner);
    }
    for index in 0..len {
        if index > 0 {
            out.push_str(&style.item_separator);
            if let Some(inner) = &inner {
                out.push_str(inner);
            }
        }
        item(out, index)?;
    }
    if let Some(outer) = newline(level) {
        out.push_str(&outer);
    }
    out.push(close);
    Ok(())
}

/// A JSON string the way Python's `json` module writes it.
pub(super) fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                write!(out, "\\u{:04x}", c as u32).ok();
            }
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    write!(out, "\\u{unit:04x}").ok();
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}
