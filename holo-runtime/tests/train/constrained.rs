//! Constrained decoding in rollouts, trained under the masked distribution: every reply of a random
//! model held to a JSON schema, a regex, a choice or a grammar, written in the tag or read from a
//! variable, validates; the trainer's log-probabilities of those tokens are the sampler's (importance
//! ratios of 1, `sampling/mismatch_kl` of 0), which they are not when the masks are left out of
//! training. The same holds for native tool calls held to their format over
//! several turns (`train/tool_calls.hol`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::Device;
use holo_runtime::holophore::Holophore;
use holo_runtime::holotypes;
use holo_runtime::interpreter::{Holoware, Row};
use holo_runtime::local::{LocalModel, LocalOptions};
use holo_runtime::loom::{Interpreted, Loom, LoomConfig, RolloutRecord, RolloutSource};
use holo_runtime::train::config::ImportanceSamplingMode;
use holo_runtime::train::{
    batch, importance_sampling, replay, score, GrpoConfig, Policy, RunOptions, Trainer,
    TrainingArguments,
};
use holo_runtime::{Constraint, Resources, Rollout, Sampler};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn model_dir() -> PathBuf {
    fixtures().join("models/qwen2")
}

fn holoware() -> Arc<Holoware> {
    Arc::new(
        Holoware::open(
            &fixtures().join("train/constrained.hol"),
            Arc::new(holotypes::registry()),
        )
        .unwrap(),
    )
}

/// The holoware `source`, as if read from the file `name`.
fn written(name: &str, source: &str) -> Arc<Holoware> {
    let registry = Arc::new(holotypes::registry());
    Arc::new(Holoware::load(name, source.as_bytes(), registry).unwrap())
}

fn rows() -> Vec<(usize, Row)> {
    std::fs::read_to_string(fixtures().join("train/rows.jsonl"))
        .unwrap()
        .lines()
        .enumerate()
        .map(|(i, line)| (i, serde_json::from_str(line).unwrap()))
        .collect()
}

/// Four rollouts of each row, sampled by `model` at temperature 1 and recorded in token space.
fn rollouts(model: &LocalModel) -> Vec<RolloutRecord> {
    loom_rollouts(model, holoware(), Resources::default(), &rows())
}

/// Four rollouts of each of `rows` of `holoware`, sampled by `model` at temperature 1 and recorded in
/// token space.
fn loom_rollouts(
    model: &LocalModel,
    holoware: Arc<Holoware>,
    resources: Resources,
    rows: &[(usize, Row)],
) -> Vec<RolloutRecord> {
    loom_rollouts_on(model, model, holoware, resources, rows)
}

/// [`loom_rollouts`] of `rows`, each row checked first as a run checks it before its rollouts
/// ([`Interpreted::check`]); the source is returned for more checks.
fn checked_rollouts(
    model: &LocalModel,
    holoware: Arc<Holoware>,
    rows: &[(usize, Row)],
) -> (Interpreted, Vec<RolloutRecord>) {
    let source = Interpreted {
        holoware: Arc::clone(&holoware),
        resources: Resources::default(),
    };
    for (_, row) in rows {
        source.check(row).unwrap();
    }
    (
        source,
        loom_rollouts(model, holoware, Resources::default(), rows),
    )
}

/// [`loom_rollouts`] drawn by `sampler`, recorded with `model`'s tokenizer and chat template.
fn loom_rollouts_on(
    model: &LocalModel,
    sampler: &dyn Sampler,
    holoware: Arc<Holoware>,
    resources: Resources,
    rows: &[(usize, Row)],
) -> Vec<RolloutRecord> {
    let holophore = Holophore::new(
        Arc::new(model.tokenizer().clone()),
        Arc::new(model.template().clone()),
    )
    .unwrap();
    let loom = Loom::interpreted(
        holoware,
        resources,
        LoomConfig {
            rollouts_per_row: 4,
            seed: 11,
            ..LoomConfig::default()
        },
    )
    .with_holophore(holophore);
    let mut records: Vec<RolloutRecord> = Vec::new();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(loom.run(rows, sampler, &mut records))
        .unwrap();
    records
}

/// The sampled texts of a record's one context, in order.
fn replies(record: &RolloutRecord) -> Vec<String> {
    record.contexts[0]
        .messages
        .iter()
        .flat_map(|message| &message.parts)
        .filter(|part| part.sampled)
        .map(|part| part.text.clone())
        .collect()
}

#[test]
fn every_constrained_reply_of_a_random_model_validates() {
    let model = LocalModel::load(model_dir(), LocalOptions::default()).unwrap();
    let records = rollouts(&model);
    assert_eq!(records.len(), 4 * rows().len());
    for record in &records {
        assert!(record.error.is_none(), "{:?}", record.error);
        assert!(!record.truncated);
        let replies = replies(record);
        let [plan, bags, sure, total] = replies.as_slice() else {
            panic!("{replies:?}")
        };
        let plan: serde_json::Value = serde_json::from_str(plan).unwrap();
        let plan = plan.as_object().unwrap();
        assert_eq!(plan.len(), 2, "{plan:?}");
        assert!(["Paris", "Lima", "Oslo"].contains(&plan["city"].as_str().unwrap()));
        assert!(
            (1..=7).contains(&plan["days"].as_i64().unwrap()),
            "{plan:?}"
        );
        assert!(
            (1..=2).contains(&bags.len()) && bags.bytes().all(|b| b.is_ascii_digit()),
            "{bags:?}"
        );
        assert!(
            ["yes", "no", "not quite"].contains(&sure.as_str()),
            "{sure:?}"
        );
        // In the fence: the digits, then the closing tag that ended the sample.
        let digits = total.strip_suffix("</answer>").unwrap();
        assert!(
            (1..=3).contains(&digits.len()) && digits.bytes().all(|b| b.is_ascii_digit()),
            "{total:?}"
        );
        // The record says which sampled tokens each constraint drew, for the trainer to replay.
        let tokens = record.contexts[0].tokens.as_ref().unwrap();
        let kinds: Vec<&str> = tokens
            .constraints
            .iter()
            .map(|run| run.constraint.kind())
            .collect();
        assert_eq!(
            kinds,
            [
                "a JSON schema",
                "a regular expression",
                "a choice",
                "a Lark grammar"
            ]
        );
        for run in &tokens.constraints {
            assert!(tokens.loss_mask[run.start..run.start + run.len]
                .iter()
                .all(|&mask| mask == 1));
        }
        assert!(matches!(
            tokens.constraints[2].constraint,
            Constraint::Choice(ref choices) if choices.len() == 3
        ));
    }
}

/// Every constraint a fence wraps (`holoc`'s `Constraint::fenced`) is a grammar llguidance compiles.
#[test]
fn fenced_constraints_compile() {
    let model = LocalModel::load(model_dir(), LocalOptions::default()).unwrap();
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../holoc/tests/inputs/ok/fenced_constraints.hol");
    let holoware = Holoware::open(&path, Arc::new(holotypes::registry())).unwrap();
    let constraints = holoware.constraints();
    assert_eq!(constraints.len(), 6);
    for (location, constraint) in constraints {
        assert!(matches!(constraint, Constraint::Lark(_)), "{location}");
        if let Err(error) = model.grammars().compile(&constraint) {
            panic!("{location}: {constraint:?}: {error}");
        }
    }
}

/// Fenced samplers whose constraint decides where the fence ends: a Lark grammar nested in `<>pair`,
/// and JSON whose one string is `</note>`, the fence's own closing tag, which the stop string `</note>`
/// would cut after `{"tag": "`. Each binds the text inside its fence, which the last message shows.
const FENCED: &str = r#"<|+++|>
<|o_o|>
A pair, then a note.
<|@_@:pair <>pair grammar="start: KEY \"=\" VALUE\nKEY: /[a-z]/\nVALUE: /[0-9]{1,2}/ # one or two digits"|>
<|@_@:note <>note json_schema='{"type": "object", "properties": {"tag": {"enum": ["</note>"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["tag", "n"], "additionalProperties": false}'|>
<|o_o|>
<|pair|> and <|note|>
"#;

#[test]
fn fenced_grammars_decide_where_their_fence_ends() {
    let model = LocalModel::load(model_dir(), LocalOptions::default()).unwrap();
    let holoware = written("fenced.hol", FENCED);
    let rows = [(0, serde_json::from_str::<Row>("{}").unwrap())];
    let records = loom_rollouts(&model, holoware, Resources::default(), &rows);
    assert_eq!(records.len(), 4);
    for record in &records {
        assert!(record.error.is_none(), "{:?}", record.error);
        let replies = replies(record);
        let [pair, note] = replies.as_slice() else {
            panic!("{replies:?}")
        };
        let pair = pair.strip_suffix("</pair>").unwrap();
        let (key, value) = pair.split_once('=').unwrap();
        assert!(
            key.len() == 1 && key.as_bytes()[0].is_ascii_lowercase(),
            "{pair:?}"
        );
        assert!(
            (1..=2).contains(&value.len()) && value.bytes().all(|b| b.is_ascii_digit()),
            "{pair:?}"
        );
        let note = note.strip_suffix("</note>").unwrap();
        let json: serde_json::Value = serde_json::from_str(note).unwrap();
        assert_eq!(json["tag"], "</note>", "{note}");
        // The bindings hold the text inside each fence.
        let last = record.contexts[0].messages.last().unwrap();
        let shown: String = last.parts.iter().map(|part| part.text.as_str()).collect();
        assert_eq!(shown.trim_end(), format!("{pair} and {note}"));
        let tokens = record.contexts[0].tokens.as_ref().unwrap();
        let kinds: Vec<&str> = tokens
            .constraints
            .iter()
            .map(|run| run.constraint.kind())
            .collect();
        assert_eq!(kinds, ["a Lark grammar", "a Lark grammar"]);
    }
    // On policy, the trainer scores both fences' tokens under their masks as the sampler drew them.
    let (ratios, kl) = ratios(&model, &records, true);
    assert!(
        ratios.iter().all(|ratio| (ratio - 1.0).abs() < 1e-4),
        "{ratios:?}"
    );
    assert!(kl < 1e-8, "{kl}");
}

/// `FENCED`'s samplers with room for their replies (`holo serve`'s default `max_tokens` for completions
/// is OpenAI's 16).
const SERVED_FENCED: &str = r#"<|+++|>
<|o_o|>
A pair, then a note.
<|@_@:pair <>pair max_tokens=32 grammar="start: KEY \"=\" VALUE\nKEY: /[a-z]/\nVALUE: /[0-9]{1,2}/"|>
<|@_@:note <>note max_tokens=48 json_schema='{"type": "object", "properties": {"tag": {"enum": ["</note>"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["tag", "n"], "additionalProperties": false}'|>
"#;

/// `SERVED_FENCED` sampled by `holo serve` through the `openai` sampler, which does not send a fence's
/// closing tag as a stop string when the grammar is the fence's (a server that checks stop strings on
/// the text, as vLLM does, would cut the JSON string `"</note>"` there): each reply ends at its tag,
/// where the grammar ends it, without the end of sequence the server's grammar forced after the tag,
/// so the records are the local model's and the trainer scores them under their masks with ratios of 1.
#[cfg(feature = "cli")]
#[test]
fn a_served_fenced_reply_ends_where_its_grammar_ends_it() {
    use holo_runtime::{OpenAi, OpenAiConfig};

    let served = crate::common::served::Served::start(
        std::process::Command::new(env!("CARGO_BIN_EXE_holo"))
            .args(["serve", model_dir().to_str().unwrap(), "--port", "0"])
            .args(["--served-model-name", "qwen2", "--no-access-log"]),
    );
    let sampler = OpenAi::new(OpenAiConfig {
        proxy_from_env: false,
        max_retries: 0,
        api_key_env: "HOLO_CONSTRAINED_TEST_NO_SUCH_VAR".into(),
        ..OpenAiConfig::new(served.base.clone(), "qwen2")
    })
    .unwrap();
    let model = LocalModel::load(model_dir(), LocalOptions::default()).unwrap();
    let holoware = written("fenced.hol", SERVED_FENCED);
    let rows = [(0, serde_json::from_str::<Row>("{}").unwrap())];
    let records = loom_rollouts_on(&model, &sampler, holoware, Resources::default(), &rows);
    assert_eq!(records.len(), 4);
    for record in &records {
        assert!(record.error.is_none(), "{:?}", record.error);
        let replies = replies(record);
        let note = replies[1]
            .strip_suffix("</note>")
            .unwrap_or_else(|| panic!("{replies:?}"));
        let json: serde_json::Value = serde_json::from_str(note).unwrap();
        assert_eq!(json["tag"], "</note>", "{note}");
        let tokens = record.contexts[0].tokens.as_ref().unwrap();
        // Each run is its reply through the closing tag, and nothing after it.
        let runs: Vec<String> = tokens
            .constraints
            .iter()
            .map(|run| {
                let sampled = &tokens.ids[run.start..run.start + run.len];
                model.tokenizer().decode(sampled, false).unwrap()
            })
            .collect();
        assert_eq!(runs, replies, "{runs:?}");
    }
    let (ratios, kl) = ratios(&model, &records, true);
    assert!(
        ratios.iter().all(|ratio| (ratio - 1.0).abs() < 1e-4),
        "{ratios:?}"
    );
    assert!(kl < 1e-8, "{kl}");
}

/// A sampler whose schema is each row's `schema` column (`json_schema=schema`), inside a fence.
const ROW_SCHEMA: &str = "<|+++|>\n<|o_o|>\nAnswer.\n<|@_@:answer <>answer json_schema=schema|>\n";

#[test]
fn each_row_holds_its_replies_to_its_own_schema() {
    let model = LocalModel::load(model_dir(), LocalOptions::default()).unwrap();
    let holoware = written("schema.hol", ROW_SCHEMA);
    let row = |schema: serde_json::Value| {
        serde_json::from_value::<Row>(serde_json::json!({"schema": schema})).unwrap()
    };
    // A schema as a JSON column or as its text.
    let rows = [
        (0, row(serde_json::json!({"enum": ["</answer>", "ok"]}))),
        (
            1,
            row(r#"{"type": "integer", "minimum": 3, "maximum": 5}"#.into()),
        ),
        (
            2,
            row(serde_json::json!({"$ref": "https://example.com/schema.json"})),
        ),
    ];
    let (source, records) = checked_rollouts(&model, holoware, &rows);
    assert_eq!(records.len(), 12);
    for record in &records {
        if record.row_index == 2 {
            // JSON, but no schema llguidance compiles: the request fails, naming the tag.
            let error = record.error.as_ref().unwrap();
            assert!(error.message.starts_with("schema.hol:4:1: "), "{error:?}");
            continue;
        }
        assert!(record.error.is_none(), "{:?}", record.error);
        let replies = replies(record);
        let json = replies[0].strip_suffix("</answer>").unwrap();
        let reply: serde_json::Value = serde_json::from_str(json).unwrap();
        match record.row_index {
            0 => assert!(reply == "</answer>" || reply == "ok", "{reply}"),
            _ => assert!((3..=5).contains(&reply.as_i64().unwrap()), "{reply}"),
        }
    }
    // A row whose column is no schema is refused before any rollout of it, naming the tag.
    let error = source.check(&row(serde_json::json!([1, 2]))).unwrap_err();
    assert_eq!(
        error,
        "schema.hol:4:1: `schema`, the sampler's json_schema, is not a JSON schema: a schema is a JSON \
         object or a boolean"
    );
}

/// Samplers whose regular expression is each row's `pattern` column (`regex=pattern`) and whose grammar
/// is the text an earlier sampler chose (`grammar=rules`), each inside a fence.
const ROW_REGEX: &str = r#"<|+++|>
<|o_o|>
Answer.
<|@_@:code <>code regex=pattern|>
<|@_@:rules choice='start: "yes" | "no"' choice='start: /[0-9]{2}/'|>
<|@_@:sentence <>sentence grammar=rules|>
"#;

#[test]
fn regexes_and_grammars_from_variables_hold_their_replies() {
    let model = LocalModel::load(model_dir(), LocalOptions::default()).unwrap();
    let holoware = written("regex.hol", ROW_REGEX);
    let row = |pattern: &str| {
        serde_json::from_value::<Row>(serde_json::json!({ "pattern": pattern })).unwrap()
    };
    let rows = [(0, row("[a-c]{2}")), (1, row("(yes|no)"))];
    let (source, records) = checked_rollouts(&model, holoware, &rows);
    assert_eq!(records.len(), 8);
    let mut chosen = std::collections::BTreeSet::new();
    for record in &records {
        assert!(record.error.is_none(), "{:?}", record.error);
        let replies = replies(record);
        let [code, rules, sentence] = replies.as_slice() else {
            panic!("{replies:?}")
        };
        let code = code.strip_suffix("</code>").unwrap();
        match record.row_index {
            0 => assert!(
                code.len() == 2 && code.bytes().all(|b| (b'a'..=b'c').contains(&b)),
                "{code:?}"
            ),
            _ => assert!(code == "yes" || code == "no", "{code:?}"),
        }
        let sentence = sentence.strip_suffix("</sentence>").unwrap();
        if rules.contains("yes") {
            assert!(sentence == "yes" || sentence == "no", "{sentence:?}");
        } else {
            assert_eq!(rules, "start: /[0-9]{2}/");
            assert!(
                sentence.len() == 2 && sentence.bytes().all(|b| b.is_ascii_digit()),
                "{sentence:?}"
            );
        }
        chosen.insert(rules.clone());
        let tokens = record.contexts[0].tokens.as_ref().unwrap();
        let kinds: Vec<&str> = tokens
            .constraints
            .iter()
            .map(|run| run.constraint.kind())
            .collect();
        assert_eq!(kinds, ["a Lark grammar", "a choice", "a Lark grammar"]);
    }
    // Sampled, not forced: both grammars were chosen.
    assert_eq!(chosen.len(), 2, "{chosen:?}");
    // On policy, the trainer scores the tokens under the masks of the constraints the variables gave.
    let (ratios, kl) = ratios(&model, &records, true);
    assert!(
        ratios.iter().all(|ratio| (ratio - 1.0).abs() < 1e-4),
        "{ratios:?}"
    );
    assert!(kl < 1e-8, "{kl}");
    // A row whose column is no regular expression is refused before any rollout of it, naming the tag.
    let error = source.check(&row("(")).unwrap_err();
    assert!(
        error.starts_with(
            "regex.hol:4:1: `pattern`, the sampler's regex, is not a regular expression: "
        ),
        "{error}"
    );
}

/// The importance ratios `exp(trainer − sampler)` of one on-policy step's trained tokens, per token,
/// and `sampling/mismatch_kl`, with the trainer's log-probabilities computed with the constraints'
/// masks (`masked`) or over the whole vocabulary.
fn ratios(model: &LocalModel, records: &[RolloutRecord], masked: bool) -> (Vec<f32>, f64) {
    let mut completions = batch::completions(records, &vec![1.0; records.len()], false);
    if masked {
        replay::replay(model.grammars(), &mut completions).unwrap();
    }
    let old = score::logprobs(model.model(), &completions, 1.0, 8).unwrap();
    for (completion, old) in completions.iter_mut().zip(old) {
        completion.old_logprobs = Some(old);
    }
    let config = GrpoConfig {
        vllm_importance_sampling_mode: ImportanceSamplingMode::TokenTruncate,
        vllm_importance_sampling_clip_min: None,
        vllm_importance_sampling_clip_max: Some(1e9),
        ..GrpoConfig::default()
    };
    let mut metrics = BTreeMap::new();
    importance_sampling(&config, &mut completions, &mut metrics);
    let ratios = completions
        .iter()
        .flat_map(|completion| completion.is_ratio.clone().unwrap())
        .collect();
    (ratios, metrics["sampling/mismatch_kl"])
}

#[test]
fn an_on_policy_step_on_constrained_tokens_has_ratios_of_one() {
    let model = LocalModel::load(model_dir(), LocalOptions::default()).unwrap();
    let records = rollouts(&model);
    let (masked, masked_kl) = ratios(&model, &records, true);
    let (whole, whole_kl) = ratios(&model, &records, false);
    let farthest = |ratios: &[f32]| {
        ratios
            .iter()
            .map(|ratio| (ratio - 1.0).abs())
            .fold(0.0f32, f32::max)
    };
    // The sampler and the trainer run the same f32 weights by different kernels (a KV cache against
    // one pass): they agree to rounding.
    assert!(farthest(&masked) < 1e-4, "{}", farthest(&masked));
    assert!(masked_kl < 1e-8, "{masked_kl}");
    // Over the whole vocabulary the trainer gives every constrained token less than the sampler did.
    assert!(farthest(&whole) > 0.1, "{}", farthest(&whole));
    assert!(whole_kl > 1e-3, "{whole_kl}");
}

/// A generation's replayed masks hold one copy of each distinct set of allowed tokens: at 19 KB a
/// token at a real vocabulary, a copy per constrained token would weigh on every step.
#[test]
fn replayed_masks_keep_one_copy_of_each_distinct_set() {
    let model = LocalModel::load(model_dir(), LocalOptions::default()).unwrap();
    let records = rollouts(&model);
    let mut completions = batch::completions(&records, &vec![1.0; records.len()], false);
    replay::replay(model.grammars(), &mut completions).unwrap();
    let masks: Vec<&holo_runtime::Allowed> = completions
        .iter()
        .flat_map(|completion| &completion.sequences)
        .flat_map(|sequence| sequence.constraints.allowed.iter().flatten())
        .collect();
    let mut copies: Vec<&holo_runtime::Allowed> = Vec::new();
    for mask in &masks {
        match copies.iter().find(|kept| kept == &mask) {
            Some(kept) => assert!(kept.shares_bits(mask), "an equal set held twice"),
            None => copies.push(mask),
        }
    }
    // Most positions allow what others do (the digits of a number, the characters of a string).
    assert!(
        copies.len() * 4 < masks.len(),
        "{} copies for {} constrained tokens",
        copies.len(),
        masks.len()
    );
    eprintln!(
        "{} distinct sets for {} constrained tokens",
        copies.len(),
        masks.len()
    );
}

/// The held tool calls of `train/tool_calls.hol` (two turns, each a regex's call of the calculator,
/// its result a `tool` message between them), sampled by the random Qwen3 with Qwen3's template: on
/// policy, the trainer scores every turn under its masks with ratios of 1 against the sampler, in every
/// context.
#[test]
fn held_tool_calls_on_policy_have_ratios_of_one() {
    let dir = crate::common::tempdir::Dir::new("constrained-tool-calls");
    let model_dir = crate::common::qwen3_with_tools(dir.path(), Some(2048));
    let model = LocalModel::load(&model_dir, LocalOptions::default()).unwrap();
    let holoware = Arc::new(
        Holoware::open(
            &fixtures().join("train/tool_calls.hol"),
            Arc::new(holotypes::registry()),
        )
        .unwrap(),
    );
    let mut resources = Resources::default();
    resources.insert(holotypes::Tools::new().with_calculator());
    let rows: Vec<(usize, Row)> = ["What is 6*7?", "What is 2+8?"]
        .iter()
        .enumerate()
        .map(|(i, query)| {
            let row = serde_json::json!({"query": query, "expected": "0"});
            (i, serde_json::from_value(row).unwrap())
        })
        .collect();
    let records = loom_rollouts(&model, holoware, resources, &rows);
    assert_eq!(records.len(), 8);
    for record in &records {
        assert!(record.error.is_none(), "{:?}", record.error);
        let runs: usize = record
            .contexts
            .iter()
            .map(|context| context.tokens.as_ref().unwrap().constraints.len())
            .sum();
        assert_eq!(runs, 2);
    }
    let (masked, masked_kl) = ratios(&model, &records, true);
    let (whole, _) = ratios(&model, &records, false);
    let farthest = |ratios: &[f32]| {
        ratios
            .iter()
            .map(|ratio| (ratio - 1.0).abs())
            .fold(0.0f32, f32::max)
    };
    assert!(!masked.is_empty());
    assert!(farthest(&masked) < 1e-4, "{}", farthest(&masked));
    assert!(masked_kl < 1e-8, "{masked_kl}");
    // Without the masks, the calls' forced tokens are far from the sampler's probability of 1.
    assert!(farthest(&whole) > 0.1, "{}", farthest(&whole));
}

/// `holo train`'s loop on the constrained holoware, with a sampler of the caller's (an f32 copy of the
/// policy): the correction's `sampling/mismatch_kl` is 0 on the first, on-policy, step.
#[test]
fn a_training_run_on_a_constrained_holoware() {
    let out = std::env::temp_dir().join(format!("holo-train-constrained-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let holoware = holoware();
    let resources = Resources::default();
    let source = move |row: &Row| -> Result<Box<dyn Rollout + Send>, String> {
        let rollout = holoware
            .start_with(row, &resources)
            .map_err(|error| error.to_string())?;
        Ok(Box::new(rollout))
    };
    let config = GrpoConfig {
        training: TrainingArguments {
            max_steps: 1,
            per_device_train_batch_size: 8,
            learning_rate: 1e-3,
            ..GrpoConfig::default().training
        },
        num_generations: 4,
        max_completion_length: 48,
        ..GrpoConfig::default()
    };
    let sampler = LocalModel::load(model_dir(), LocalOptions::default()).unwrap();
    let summary = Trainer::new(
        source,
        Policy::load(&model_dir(), &Device::Cpu).unwrap(),
        config,
        RunOptions {
            out: out.clone(),
            resume: false,
            progress: false,
        },
    )
    .unwrap()
    .with_sampler(Box::new(sampler), Some(2048))
    .train(&rows(), &[])
    .unwrap();
    assert_eq!(summary.steps, 1);
    let metrics = &summary.last;
    assert!(
        metrics["sampling/mismatch_kl"] < 1e-8,
        "{}",
        metrics["sampling/mismatch_kl"]
    );
    assert!(metrics["loss"].is_finite());
    std::fs::remove_dir_all(&out).unwrap();
}
