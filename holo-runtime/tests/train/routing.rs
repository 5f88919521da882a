//! Routing replay through `holo train` on the mixture-of-experts fixture: the rollouts carry the
//! sampler's routes, the trainer replays them and reports how often its routers would differ; the option
//! is refused where there is nothing to replay.

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::common::tempdir::Dir;
use crate::common::{fixtures, holo_output, qa_rows, qa_train};

fn fixture(name: &str) -> PathBuf {
    fixtures().join("models").join(name)
}

fn lines(path: &Path) -> Vec<Value> {
    fs::read_to_string(path)
        .unwrap_or_else(|error| panic!("{}: {error}", path.display()))
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

fn train(model: &Path, data: &Path, out: &Path) -> std::process::Output {
    let mut args = qa_train(model, data, out, 2);
    args.extend(["--entropy-coef", "0.1", "--routing-replay", "true"].map(String::from));
    holo_output(&args)
}

#[test]
fn holo_train_replays_the_samplers_routes() {
    let work = Dir::new("routing");
    let data = qa_rows(work.path(), 8);

    let run = work.path().join("run");
    let output = train(&fixture("qwen3_moe"), &data, &run);
    assert!(
        output.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    // Two mixture layers of three experts per token each.
    let width = 2 * 3;
    let mut recorded = 0;
    for rollout in lines(&run.join("rollouts.jsonl")) {
        // The in-process sampler's rollouts of step n were sampled by the weights of n − 1 updates.
        let version = rollout["step"].as_u64().unwrap() - 1;
        let sampled: Vec<&Value> = rollout["contexts"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|context| context["messages"].as_array().unwrap())
            .flat_map(|message| message["parts"].as_array().unwrap())
            .filter(|part| part["sampled"] == true)
            .collect();
        assert!(!sampled.is_empty());
        for part in sampled {
            assert_eq!(part["weight_version"].as_u64(), Some(version), "{part}");
        }
        for context in rollout["contexts"].as_array().unwrap() {
            let tokens = &context["tokens"];
            let ids = tokens["ids"].as_array().unwrap();
            let routes = tokens["routes"]
                .as_array()
                .unwrap_or_else(|| panic!("a context without routes: {context}"));
            assert_eq!(routes.len(), ids.len());
            for token in routes {
                let experts = token.as_array().unwrap();
                assert!(experts.is_empty() || experts.len() == width, "{token}");
                assert!(experts.iter().all(|e| e.as_u64().unwrap() < 8), "{token}");
                recorded += usize::from(!experts.is_empty());
            }
        }
    }
    assert!(recorded > 0, "no routes recorded");
    // The sampler is the trainer's own f32 model: its routers choose as the trainer's do.
    let steps: Vec<Value> = lines(&run.join("metrics.jsonl"))
        .into_iter()
        .filter(|line| line.get("routing/replay_differ").is_some())
        .collect();
    assert_eq!(steps.len(), 2, "routing/replay_differ at each step");
    for step in steps {
        assert_eq!(step["routing/replay_differ"].as_f64(), Some(0.0), "{step}");
        // The load-balancing loss, added with the config's `router_aux_loss_coef` (0.001) as TRL
        // adds it (3, the experts per token, when the routers spread tokens evenly).
        let aux = step["aux_loss"]
            .as_f64()
            .unwrap_or_else(|| panic!("no aux_loss: {step}"));
        assert!(aux.is_finite() && aux > 0.0, "{step}");
    }

    // A dense model has nothing to replay.
    let output = train(&fixture("qwen3"), &data, &work.path().join("dense"));
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("`routing_replay`") && stderr.contains("no mixture of experts"),
        "{stderr}"
    );
}

/// `router_aux_loss_coef` on a model without experts is refused before training, as TRL refuses it.
#[test]
fn a_load_balancing_coefficient_for_a_dense_model_is_refused() {
    let work = Dir::new("balance-dense");
    let data = qa_rows(work.path(), 1);
    let out = work.path().join("run");
    let mut args = qa_train(&fixture("qwen3"), &data, &out, 1);
    args.extend(["--router-aux-loss-coef", "0.01"].map(String::from));
    let output = holo_output(&args);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("`router_aux_loss_coef`") && stderr.contains("not a mixture-of-experts"),
        "{stderr}"
    );
    assert!(
        !out.join("metrics.jsonl").exists(),
        "refused before training"
    );
}
