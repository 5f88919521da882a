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
/// of the norm, at least of `norm_floor`), its sum, its first entries and the entries at the fixture's
/// seeded random positions over the whole tensor (`sample`; each entry to 1e-5 of the norm).
pub fn gradient_matches(what: &str, param: &str, grad: &[f32], expected: &Value, norm_floor: f64) {
    gradient_matches_within(what, param, grad, expected, norm_floor, 1e-5);
}

/// [`gradient_matches`] with `tolerance` in place of its 1e-5.
pub fn gradient_matches_within(
    what: &str,
    param: &str,
    grad: &[f32],
    expected: &Value,
    norm_floor: f64,
    tolerance: f64,
) {
    let norm = grad.iter().map(|g| (*g as f64).powi(2)).sum::<f64>().sqrt();
    let theirs_norm = expected["l2_norm"].as_f64().unwrap();
    close(
        &format!("{what}: ‖∇{param}‖"),
        norm,
        theirs_norm,
        tolerance,
        norm_floor,
    );
    let sum: f64 = grad.iter().map(|g| *g as f64).sum();
    let theirs_sum = expected["sum"].as_f64().unwrap();
    close(
        &format!("{what}: Σ∇{param}"),
        sum,
        theirs_sum,
        tolerance,
        theirs_norm,
    );
    let head = expected["head"].as_array().expect("an array");
    let sample = &expected["sample"];
    let positions = sample["positions"]
        .as_array()
        .unwrap_or_else(|| panic!("{what}: ∇{param} has no sample: regenerate the fixture"));
    let values = sample["values"].as_array().expect("an array");
    assert_eq!(positions.len(), values.len(), "{what}: ∇{param}");
    let head = head.iter().enumerate();
    let sampled = positions.iter().zip(values).map(|(position, value)| {
        let position = position.as_u64().expect("a position") as usize;
        assert!(position < grad.len(), "{what}: ∇{param}[{position}]");
        (position, value)
    });
    for (j, theirs) in head.chain(sampled) {
        // Each entry relative to the gradient's norm: a small entry of a large gradient carries only the
        // rounding of the large terms summed into it.
        let theirs = theirs.as_f64().expect("a number");
        close(
            &format!("{what}: ∇{param}[{j}]"),
            grad[j] as f64,
            theirs,
            tolerance,
            theirs_norm,
        );
    }
}
