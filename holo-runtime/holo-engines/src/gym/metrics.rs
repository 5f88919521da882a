//! `POST /aggregate_metrics`: the statistics of the rewards and reward components of the verify
//! responses a run collected, in the shape of NeMo Gym's `AggregateMetrics` (the keys its
//! `RewardProfiler` writes); see "Metrics" in the [module documentation](super).

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use super::row::RowError;

/// One verify response as the aggregation reads it.
struct Scored {
    task: u64,
    repeat: u64,
    /// `reward` first, then each component, by name.
    values: Vec<(String, f64)>,
}

/// The `AggregateMetrics` of a `{"verify_responses": [...]}` body: `agent_metrics` (over every
/// response), `key_metrics` (their means), `group_level_metrics` (per `_ng_task_index`) and
/// `repeat_level_metrics` (per `_ng_rollout_index`). Responses with `mask_sample: true` are left out of
/// the statistics, as NeMo Gym leaves them out.
pub fn aggregate(body: &Map<String, Value>) -> Result<Value, RowError> {
    let responses = match body.get("verify_responses") {
        Some(Value::Array(responses)) => responses,
        _ => {
            return Err(RowError {
                loc: vec!["body".into(), "verify_responses".into()],
                message: "must be a list of verify responses".into(),
            })
        }
    };
    let mut scored = Vec::with_capacity(responses.len());
    let mut masked = 0;
    for (index, response) in responses.iter().enumerate() {
        let at = |field: Option<&str>, message: &str| RowError {
            loc: ["body".into(), "verify_responses".into(), index.into()]
                .into_iter()
                .chain(field.map(Value::from))
                .collect(),
            message: message.into(),
        };
        let Some(response) = response.as_object() else {
            return Err(at(None, "must be an object"));
        };
        if response.get("mask_sample") == Some(&Value::Bool(true)) {
            masked += 1;
            continue;
        }
        let reward = response
            .get("reward")
            .and_then(Value::as_f64)
            .ok_or_else(|| at(Some("reward"), "must be a number"))?;
        let mut values = vec![("reward".to_string(), reward)];
        match response.get("reward_components") {
            None | Some(Value::Null) => {}
            Some(Value::Object(components)) => {
                for (name, value) in components {
                    let value = value.as_f64().ok_or_else(|| {
                        at(
                            Some("reward_components"),
                            &format!("`{name}` must be a number"),
                        )
                    })?;
                    values.push((name.clone(), value));
                }
            }
            Some(_) => return Err(at(Some("reward_components"), "must be an object")),
        }
        let index_of = |name: &str| response.get(name).and_then(Value::as_u64).unwrap_or(0);
        scored.push(Scored {
            task: index_of("_ng_task_index"),
            repeat: index_of("_ng_rollout_index"),
            values,
        });
    }
    if scored.is_empty() {
        let mut agent = Map::new();
        if masked > 0 {
            agent.insert("num_masked".into(), json!(masked));
        }
        return Ok(json!({
            "group_level_metrics": [],
            "agent_metrics": agent,
            "key_metrics": agent,
            "repeat_level_metrics": [],
        }));
    }
    let mut agent = statistics(scored.iter());
    let repeats: BTreeMap<u64, Vec<&Scored>> = group(&scored, |one| one.repeat);
    agent.insert("num_repeats".into(), json!(repeats.len()));
    if masked > 0 {
        agent.insert("num_masked".into(), json!(masked));
    }
    let key: Map<String, Value> = agent
        .iter()
        .filter(|(name, _)| name.starts_with("mean/") || name.as_str() == "num_masked")
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect();
    let groups: Vec<Value> = group(&scored, |one| one.task)
        .into_iter()
        .map(|(task, members)| {
            let mut metrics = Map::new();
            metrics.insert("_ng_task_index".into(), json!(task));
            metrics.extend(statistics(members.iter().copied()));
            metrics.insert("num_rollouts".into(), json!(members.len()));
            Value::Object(metrics)
        })
        .collect();
    let repeat_level: Vec<Value> = repeats
        .into_iter()
        .map(|(repeat, members)| {
            let mut metrics = Map::new();
            metrics.insert("_ng_rollout_index".into(), json!(repeat));
            metrics.insert("sample_count".into(), json!(members.len()));
            metrics.extend(statistics(members.iter().copied()));
            Value::Object(metrics)
        })
        .collect();
    Ok(json!({
        "group_level_metrics": groups,
        "agent_metrics": agent,
        "key_metrics": key,
        "repeat_level_metrics": repeat_level,
    }))
}

fn group(scored: &[Scored], key: impl Fn(&Scored) -> u64) -> BTreeMap<u64, Vec<&Scored>> {
    let mut groups: BTreeMap<u64, Vec<&Scored>> = BTreeMap::new();
    for one in scored {
        groups.entry(key(one)).or_default().push(one);
    }
    groups
}

/// `mean/NAME`, `max/NAME`, `min/NAME`, `median/NAME` and (over two values or more) `std/NAME`, the
/// sample standard deviation as pandas computes it, of the reward and of each component, over the
/// responses that have it.
fn statistics<'a>(scored: impl Iterator<Item = &'a Scored>) -> Map<String, Value> {
    let mut by_name: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut order: Vec<&str> = Vec::new();
    for one in scored {
        for (name, value) in &one.values {
            let values = by_name.entry(name).or_insert_with(|| {
                order.push(name);
                Vec::new()
            });
            values.push(*value);
        }
    }
    // `reward` first (every response has it), then the components by name.
    order.sort_by_key(|name| (*name != "reward", *name));
    let mut metrics = Map::new();
    for name in order {
        let mut values = by_name.remove(name).expect("collected above");
        values.sort_by(f64::total_cmp);
        let n = values.len() as f64;
        let mean = values.iter().sum::<f64>() / n;
        let middle = values.len() / 2;
        let median = if values.len().is_multiple_of(2) {
            (values[middle - 1] + values[middle]) / 2.0
        } else {
            values[middle]
        };
        metrics.insert(format!("mean/{name}"), json!(mean));
        metrics.insert(format!("max/{name}"), json!(values[values.len() - 1]));
        metrics.insert(format!("min/{name}"), json!(values[0]));
        metrics.insert(format!("median/{name}"), json!(median));
        if values.len() >= 2 {
            let variance = values
                .iter()
                .map(|value| (value - mean).powi(2))
                .sum::<f64>()
                / (n - 1.0);
            metrics.insert(format!("std/{name}"), json!(variance.sqrt()));
        }
    }
    metrics
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewards_and_components_are_summarized_overall_per_task_and_per_repeat() {
        let responses: Vec<Value> = (0..2u64)
            .flat_map(|task| {
                (0..2u64).map(move |repeat| {
                    json!({"_ng_task_index": task, "_ng_rollout_index": repeat,
                           "reward": ((task + repeat) % 2) as f64,
                           "reward_components": {"short": 0.5 * repeat as f64}})
                })
            })
            .chain([json!({"reward": 9.0, "mask_sample": true})])
            .collect();
        let body = json!({"verify_responses": responses});
        let metrics = aggregate(body.as_object().unwrap()).unwrap();
        let agent = &metrics["agent_metrics"];
        assert_eq!(agent["mean/reward"], 0.5);
        assert_eq!(agent["median/reward"], 0.5);
        assert!((agent["std/reward"].as_f64().unwrap() - 0.577_350_269_189_625_7).abs() < 1e-12);
        assert_eq!(agent["mean/short"], 0.25);
        assert_eq!(agent["max/short"], 0.5);
        assert_eq!(agent["num_repeats"], 2);
        assert_eq!(agent["num_masked"], 1);
        assert_eq!(
            metrics["key_metrics"],
            json!({"mean/reward": 0.5, "mean/short": 0.25, "num_masked": 1})
        );
        let groups = metrics["group_level_metrics"].as_array().unwrap();
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[1]["_ng_task_index"], 1);
        assert_eq!(groups[1]["num_rollouts"], 2);
        assert_eq!(groups[1]["mean/reward"], 0.5);
        let repeats = metrics["repeat_level_metrics"].as_array().unwrap();
        assert_eq!(repeats[1]["_ng_rollout_index"], 1);
        assert_eq!(repeats[1]["mean/short"], 0.5);
        assert_eq!(repeats[1]["sample_count"], 2);
    }

    #[test]
    fn a_response_without_a_numeric_reward_is_named() {
        let body = json!({"verify_responses": [{"reward": 1.0}, {"reward": "high"}]});
        let error = aggregate(body.as_object().unwrap()).unwrap_err();
        assert_eq!(
            error.to_string(),
            "verify_responses[1].reward: must be a number"
        );
        let empty = json!({"verify_responses": []});
        assert_eq!(
            aggregate(empty.as_object().unwrap()).unwrap()["agent_metrics"],
            json!({})
        );
    }
}
