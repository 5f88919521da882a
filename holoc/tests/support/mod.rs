//! Helpers shared by the formatter's tests.

use holoc::diagnostics::Diagnostic;
use holoc::{compile, Options, Output};

/// The IR of a compiled file as JSON without source positions: spans removed and each input's uses
/// counted, so that a file and its formatted form can be compared.
pub fn meaning(output: &Output) -> Option<serde_json::Value> {
    fn strip(value: &mut serde_json::Value) {
        match value {
            serde_json::Value::Object(map) => {
                map.remove("span");
                if let Some(uses) = map.get_mut("uses") {
                    let count = uses.as_array().map_or(0, Vec::len);
                    *uses = count.into();
                }
                map.values_mut().for_each(strip);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(strip),
            _ => {}
        }
    }
    let mut value = serde_json::to_value(output.program.as_ref()?).expect("the IR serializes");
    strip(&mut value);
    Some(value)
}

/// The diagnostics of a compiled file without positions: code and message, in order.
pub fn diagnostics(output: &Output) -> Vec<String> {
    diagnostics_of(&output.diagnostics)
}

pub fn diagnostics_of(diagnostics: &[Diagnostic]) -> Vec<String> {
    diagnostics
        .iter()
        .map(|diagnostic| format!("{}: {}", diagnostic.code, diagnostic.message))
        .collect()
}

/// Formats `source` and checks the formatter's two promises when it succeeds: formatting the result again
/// changes nothing, and the result compiles to the same IR as the original (or, when the original has
/// semantic errors, to the same diagnostics). Returns the formatted text, or `None` when the file does not
/// lex or parse.
pub fn format_checked(source: &str) -> Option<String> {
    let formatted = match holoc::fmt::format(source) {
        Ok(formatted) => formatted,
        Err(holoc::fmt::Error::Invalid(diagnostics)) => {
            let original = compile(source.as_bytes(), &Options::default());
            assert!(
                original.document.is_none(),
                "only files that do not parse are refused"
            );
            assert_eq!(
                diagnostics_of(&diagnostics),
                diagnostics_of(&original.diagnostics),
                "fmt reports what check reports"
            );
            return None;
        }
        Err(error) => panic!("{error}\n--- source:\n{source}"),
    };
    let again = holoc::fmt::format(&formatted)
        .unwrap_or_else(|error| panic!("{error}\n--- formatted:\n{formatted}"));
    assert_eq!(
        again, formatted,
        "not idempotent\n--- source:\n{source}\n--- formatted once:\n{formatted}"
    );
    let original = compile(source.as_bytes(), &Options::default());
    let result = compile(formatted.as_bytes(), &Options::default());
    assert_eq!(
        meaning(&result),
        meaning(&original),
        "the IR changed\n--- source:\n{source}\n--- formatted:\n{formatted}"
    );
    assert_eq!(
        diagnostics(&result),
        diagnostics(&original),
        "the diagnostics changed\n--- source:\n{source}\n--- formatted:\n{formatted}"
    );
    Some(formatted)
}
