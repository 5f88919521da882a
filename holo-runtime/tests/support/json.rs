//! Reading numbers out of JSON fixtures and comparing them.

use serde_json::Value;

/// A JSON array of token ids.
pub fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|id| id.as_u64().unwrap() as u32)
        .collect()
}

/// A JSON array of numbers, as f32.
pub fn floats(value: &Value) -> Vec<f32> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// The largest absolute difference of two equally long vectors.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Asserts that two JSON values are equal, except that floating-point numbers may differ by 1e-5
/// (sampling log-probabilities depend, by float rounding only, on which sequences shared a batch).
pub fn assert_close(a: &Value, b: &Value, what: &str) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            assert_eq!(
                x.keys().collect::<Vec<_>>(),
                y.keys().collect::<Vec<_>>(),
                "{what}"
            );
            for (key, value) in x {
                assert_close(value, &y[key], &format!("{what}.{key}"));
            }
        }
        (Value::Array(x), Value::Array(y)) => {
            assert_eq!(x.len(), y.len(), "{what}");
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                assert_close(p, q, &format!("{what}[{i}]"));
            }
        }
        (Value::Number(x), Value::Number(y)) if x.is_f64() || y.is_f64() => {
            let (p, q) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            assert!((p - q).abs() <= 1e-5, "{what}: {p} vs {q}");
        }
        _ => assert_eq!(a, b, "{what}"),
    }
}
