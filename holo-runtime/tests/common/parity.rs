//! Comparing our numbers with the reference implementation's committed fixtures (TRL's GRPO and SFT).

use serde_json::Value;

/// Asserts `ours` is within `tolerance` of `theirs`, relative to `|theirs|` but never to less than `floor`
/// (so that a value near 0 is not held to an impossible relative bound).
pub fn close(what: &str, ours: f64, theirs: f64, tolerance: f64, floor: f64) {
    let bound = tolerance * theirs.abs().max(floor);
    assert!(
        (ours - theirs).abs() <= bound,
        "{what}: ours {ours}, TRL {theirs} (|Δ| {:e} > {bound:e})",
        (ours - theirs).abs()
    );
}

/// Asserts a gradient (flattened) matches the fixture's summary of the reference's: its L2 norm (to 1e-5
/// of the norm, at least of `norm_floor`), its sum and its first entries (each to 1e-5 of the norm).
pub fn gradient_matches(what: &str, param: &str, grad: &[f32], expected: &Value, norm_floor: f64) {
    let norm = grad.iter().map(|g| (*g as f64).powi(2)).sum::<f64>().sqrt();
    let theirs_norm = expected["l2_norm"].as_f64().unwrap();
    close(
        &format!("{what}: ‖∇{param}‖"),
        norm,
        theirs_norm,
        1e-5,
        norm_floor,
    );
    let sum: f64 = grad.iter().map(|g| *g as f64).sum();
    let theirs_sum = expected["sum"].as_f64().unwrap();
    close(
        &format!("{what}: Σ∇{param}"),
        sum,
        theirs_sum,
        1e-5,
        theirs_norm,
    );
    let head = expected["head"].as_array().expect("an array");
    for (j, (ours, theirs)) in grad.iter().zip(head).enumerate() {
        // Each entry relative to the gradient's norm: a small entry of a large gradient carries only the
        // rounding of the large terms summed into it.
        let theirs = theirs.as_f64().expect("a number");
        close(
            &format!("{what}: ∇{param}[{j}]"),
            *ours as f64,
            theirs,
            1e-5,
            theirs_norm,
        );
    }
}
