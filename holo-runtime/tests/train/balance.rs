//! The load-balancing loss of mixture-of-experts models against transformers'
//! (`scripts/balance_fixtures.py`): TRL's shape of a loss, `0.1 · Σ log p(trained tokens) + 0.5 ·
//! aux_loss`, over three sequences (two sharing a prefix), on the committed Qwen3-MoE and gpt-oss
//! fixtures in f64: its value, the `aux_loss` the trainer reports, and the gradients of every router and
//! of weights below them, with the whole graph kept and with layers recomputed.

use candle_core::{DType, Device};
use holo_runtime::local::files::load_model;
use holo_runtime::train::batch::Sequence;
use holo_runtime::train::pack::pack;
use holo_runtime::train::score::{self, Pass};
use serde_json::Value;

fn check(name: &str) {
    let folder = crate::common::fixtures().join("models").join(name);
    let fixture: Value =
        serde_json::from_str(&std::fs::read_to_string(folder.join("balance.json")).unwrap())
            .unwrap();
    let sequences: Vec<Sequence> = fixture["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|sequence| {
            let ids = crate::common::json::ids(&sequence["ids"]);
            let first = sequence["first_trained"].as_u64().unwrap() as usize;
            Sequence {
                trained: (first..ids.len()).collect(),
                sampling_logprobs: vec![f32::NAN; ids.len() - first],
                ids,
                routes: None,
                constraints: Default::default(),
            }
        })
        .collect();
    let refs: Vec<&Sequence> = sequences.iter().collect();
    let base = load_model(&folder, DType::F64, &Device::Cpu).expect("fixture model");
    let (model, vars) = base.trainable().unwrap();
    // The two sequences that share a prefix are packed as one tree: each shared token stands for both.
    assert_eq!(
        pack(&refs, &model).unwrap().ids.dims()[0],
        2,
        "{name}: packed as trees"
    );

    let coef = fixture["coef"].as_f64().unwrap();
    let weight = fixture["logprob_weight"].as_f64().unwrap();
    let expected_aux = fixture["aux_loss"].as_f64().unwrap();
    let expected_loss = fixture["loss"].as_f64().unwrap();
    for recompute in [false, true] {
        let mut aux = None;
        let pass = Pass {
            recompute,
            entropy_gradient: false,
            balance: coef,
        };
        let (value, grads) = score::backward_sequences(&model, &refs, 1.0, pass, |head| {
            aux = head.balance;
            head.logprobs.sum_all()? * weight
        })
        .unwrap();
        let aux = aux.expect("the trainer reports the load-balancing loss");
        // transformers sums the loss's counts and probabilities in f32.
        assert!(
            (aux - expected_aux).abs() < 1e-6 * expected_aux,
            "{name}, recompute {recompute}: aux_loss {aux}, transformers {expected_aux}"
        );
        let value = value.to_scalar::<f64>().unwrap();
        assert!(
            (value - expected_loss).abs() < 1e-6 * expected_loss.abs(),
            "{name}, recompute {recompute}: loss {value}, transformers {expected_loss}"
        );
        for (weight, expected) in fixture["gradients"].as_object().unwrap() {
            let var = vars
                .iter()
                .find(|(name, _)| name == weight)
                .unwrap_or_else(|| panic!("{name}: no trained weight {weight}"))
                .1
                .clone();
            let grad: Vec<f64> = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{name}: no gradient of {weight}"))
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let norm = grad.iter().map(|g| g * g).sum::<f64>().sqrt();
            match expected.get("values") {
                Some(values) => {
                    let values = crate::common::json::floats(values);
                    assert_eq!(values.len(), grad.len(), "{name}: {weight}");
                    for (i, (&ours, &theirs)) in grad.iter().zip(&values).enumerate() {
                        assert!(
                            (ours - theirs as f64).abs() < 1e-5 * norm.max(1e-3),
                            "{name}, recompute {recompute}: {weight}[{i}] {ours}, transformers \
                             {theirs} (norm {norm})"
                        );
                    }
                }
                None => {
                    let theirs = expected["norm"].as_f64().unwrap();
                    assert!(
                        (norm - theirs).abs() < 1e-5 * theirs,
                        "{name}, recompute {recompute}: |∇{weight}| {norm}, transformers {theirs}"
                    );
                    let sum: f64 = grad.iter().sum();
                    let theirs = expected["sum"].as_f64().unwrap();
                    assert!(
                        (sum - theirs).abs() < 1e-5 * norm,
                        "{name}, recompute {recompute}: Σ∇{weight} {sum}, transformers {theirs}"
                    );
                }
            }
        }
    }
}

#[test]
fn qwen3_moe_load_balancing_loss_is_transformers() {
    check("qwen3_moe");
}

#[test]
fn gpt_oss_load_balancing_loss_is_transformers() {
    check("gpt_oss");
}
