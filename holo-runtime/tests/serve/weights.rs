//! `holo serve` taking new weights while it serves: LoRA adapters loaded and unloaded by name with vLLM's
//! routes and bodies, the base weights replaced from safetensors, and the weight version of every answer.
//! A tiny random model served by the binary; adapters written here in PEFT's layout.

#[cfg(feature = "cli")]
use super::*;
#[cfg(feature = "cli")]
use common::served::{tiny_model, Served};

/// The `openai` package against a server with the adapter `policy` loaded: `/v1/models` (id, parent,
/// version) and a scoring request on the adapter with its raw response's version header.
#[cfg(feature = "cli")]
const PYTHON_ADAPTER: &str = r#"
import json, sys
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
out = {"models": [[m.id, m.model_dump().get("parent"), m.model_dump().get("weight_version")]
                  for m in client.models.list().data]}
raw = client.completions.with_raw_response.create(
    model="policy", prompt=json.loads(sys.argv[3]), max_tokens=0, echo=True, logprobs=0
)
out["header"] = raw.headers.get("x-holo-weight-version")
out["completion"] = raw.parse().model_dump()
print(json.dumps(out))
"#;

/// Writes a PEFT adapter folder for the model folder `base`: rank `rank` on `targets`, `A` as PEFT
/// draws it and `B` drawn at random (not PEFT's zeros), so that the adapter changes the model.
#[cfg(feature = "cli")]
fn write_adapter(base: &Path, out: &Path, rank: usize, targets: &[&str], seed: u64) {
    use holo_runtime::local::model::{LoraConfig, Targets};
    use rand::{Rng, SeedableRng};

    let model = holo_runtime::local::files::load_model(
        base,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let config = LoraConfig {
        rank,
        alpha: 2.0 * rank as f64,
        targets: Targets::names(targets),
        seed,
        dropout: 0.0,
        parameters: Vec::new(),
        ..Default::default()
    };
    let (_, vars) = model.with_lora(&config).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut tensors = std::collections::HashMap::new();
    for (name, var) in vars {
        let tensor = if name.contains("lora_B") {
            let values: Vec<f32> = (0..var.elem_count())
                .map(|_| rng.random_range(-0.5..0.5))
                .collect();
            candle_core::Tensor::from_vec(values, var.dims(), &candle_core::Device::Cpu).unwrap()
        } else {
            var.as_tensor().clone()
        };
        tensors.insert(name, tensor);
    }
    std::fs::create_dir_all(out).unwrap();
    candle_core::safetensors::save(&tensors, out.join("adapter_model.safetensors")).unwrap();
    let adapter_config = json!({
        "peft_type": "LORA",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": 2.0 * rank as f64,
        "target_modules": targets,
        "bias": "none",
        "use_rslora": false,
        "use_dora": false,
        "modules_to_save": null,
    });
    std::fs::write(
        out.join("adapter_config.json"),
        serde_json::to_string_pretty(&adapter_config).unwrap(),
    )
    .unwrap();
}

/// A server's answers, with the weight version header.
#[cfg(feature = "cli")]
struct Weighted {
    client: reqwest::Client,
    base: String,
}

#[cfg(feature = "cli")]
impl Weighted {
    /// POST `body` to `path`: the status, the `x-holo-weight-version` header, the body (JSON, or a
    /// string for vLLM's plain-text answers).
    async fn post(&self, path: &str, body: Value) -> (u16, Option<u64>, Value) {
        let response = self
            .client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_string())
            .timeout(Duration::from_secs(60))
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let version = response
            .headers()
            .get(holo_runtime::serve::WEIGHT_VERSION_HEADER)
            .map(|value| value.to_str().unwrap().parse().unwrap());
        let text = response.text().await.unwrap();
        let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, version, value)
    }

    /// The log-probabilities `model` gives the prompt's tokens after the first (echo, `max_tokens: 0`),
    /// and the version it reports in the header and the body (which must agree).
    async fn score(&self, model: &str, prompt: &[u32]) -> (Vec<f32>, u64) {
        let (status, version, answer) = self
            .post(
                "/v1/completions",
                json!({"model": model, "prompt": prompt, "max_tokens": 0, "echo": true, "logprobs": 0}),
            )
            .await;
        assert_eq!(status, 200, "{answer:#}");
        assert_eq!(answer["model"], model);
        assert_eq!(Some(answer["weight_version"].as_u64().unwrap()), version);
        let logprobs = answer["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()[1..]
            .iter()
            .map(|value| value.as_f64().unwrap() as f32)
            .collect();
        (logprobs, version.unwrap())
    }

    async fn get(&self, path: &str) -> String {
        let response = self
            .client
            .get(format!("{}{path}", self.base))
            .timeout(Duration::from_secs(60))
            .send()
            .await
            .unwrap();
        response.text().await.unwrap()
    }
}

#[cfg(feature = "cli")]
fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

#[cfg(feature = "cli")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_and_weights_load_while_serving_with_versions() {
    use std::process::Command;

    let dir = tiny_model("weights");
    let adapters = dir.join("adapters");
    let (first, second) = (adapters.join("first"), adapters.join("second"));
    write_adapter(&dir, &first, 4, &["q_proj", "v_proj"], 1);
    write_adapter(&dir, &second, 4, &["q_proj", "v_proj"], 2);
    let served = Served::start(
        Command::new(env!("CARGO_BIN_EXE_holo"))
            .args(["serve", dir.to_str().unwrap(), "--port", "0"])
            .args(["--served-model-name", "tiny", "--no-access-log"]),
    );
    let server = Weighted {
        client: reqwest::Client::builder().no_proxy().build().unwrap(),
        base: served.base.clone(),
    };
    let probe: Vec<u32> = vec![5, 17, 3, 42, 8, 99, 23, 61];

    let (base, version) = server.score("tiny", &probe).await;
    assert_eq!(version, 0);

    // vLLM's load: plain-text success, the adapter listed with its parent, sampled by its name.
    let (status, version, answer) = server
        .post(
            "/v1/load_lora_adapter",
            json!({"lora_name": "policy", "lora_path": first}),
        )
        .await;
    assert_eq!((status, version), (200, Some(1)), "{answer:#}");
    assert_eq!(answer, "Success: LoRA adapter 'policy' added successfully.");
    let models: Value = serde_json::from_str(&server.get("/v1/models").await).unwrap();
    let listed: Vec<(&str, &Value)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|model| (model["id"].as_str().unwrap(), &model["parent"]))
        .collect();
    assert_eq!(listed, [("tiny", &Value::Null), ("policy", &json!("tiny"))]);
    let (adapted, version) = server.score("policy", &probe).await;
    assert_eq!(version, 1);
    assert!(
        max_difference(&base, &adapted) > 1e-2,
        "the adapter changed nothing: {base:?} vs {adapted:?}"
    );
    // The base is untouched.
    assert_eq!(server.score("tiny", &probe).await, (base.clone(), 0));

    // A second load of the name is vLLM's 400 unless `load_inplace`, which replaces it.
    let (status, _, answer) = server
        .post(
            "/v1/load_lora_adapter",
            json!({"lora_name": "policy", "lora_path": second}),
        )
        .await;
    assert_eq!(status, 400, "{answer:#}");
    assert_eq!(answer["error"]["type"], "InvalidUserInput");
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True."),
        "{answer:#}"
    );
    let (status, version, _) = server
        .post(
            "/v1/load_lora_adapter",
            json!({"lora_name": "policy", "lora_path": second, "load_inplace": true}),
        )
        .await;
    assert_eq!((status, version), (200, Some(2)));
    let (reloaded, version) = server.score("policy", &probe).await;
    assert_eq!(version, 2);
    assert!(max_difference(&adapted, &reloaded) > 1e-2);
    // The official `openai` client names the adapter as its model and sees its parent and version.
    let probe_json = serde_json::to_string(&probe).unwrap();
    if let Some(out) =
        super::python_client::run_python(&["openai"], PYTHON_ADAPTER, &served.base, &[&probe_json])
            .await
    {
        assert_eq!(
            out["models"],
            json!([["tiny", null, 0], ["policy", "tiny", 2]])
        );
        assert_eq!(out["header"], "2");
        assert_eq!(out["completion"]["model"], "policy");
        assert_eq!(out["completion"]["weight_version"], 2);
        let logprobs: Vec<f32> = out["completion"]["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()[1..]
            .iter()
            .map(|value| value.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(logprobs, reloaded);
    }

    // Refusals name their cause and change nothing.
    let refused = |status: u16, kind: &'static str, says: &'static str| {
        move |(got, _, answer): (u16, Option<u64>, Value)| {
            assert_eq!(got, status, "{answer:#}");
            assert_eq!(answer["error"]["type"], kind, "{answer:#}");
            let message = answer["error"]["message"].as_str().unwrap().to_string();
            assert!(message.contains(says), "{message}");
        }
    };
    refused(400, "InvalidUserInput", "Both 'lora_name' and 'lora_path'")(
        server
            .post("/v1/load_lora_adapter", json!({"lora_name": "x"}))
            .await,
    );
    refused(404, "NotFoundError", "adapter_config.json")(
        server
            .post(
                "/v1/load_lora_adapter",
                json!({"lora_name": "x", "lora_path": dir.join("nothing")}),
            )
            .await,
    );
    let odd_target = adapters.join("odd");
    write_adapter(&dir, &odd_target, 4, &["q_proj"], 3);
    let config = odd_target.join("adapter_config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("\"q_proj\"", "\"c_attn\"")).unwrap();
    refused(400, "BadRequestError", "unknown LoRA target \"c_attn\"")(
        server
            .post(
                "/v1/load_lora_adapter",
                json!({"lora_name": "x", "lora_path": odd_target}),
            )
            .await,
    );
    let wrong_rank = adapters.join("rank");
    write_adapter(&dir, &wrong_rank, 4, &["q_proj"], 4);
    let config = wrong_rank.join("adapter_config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("\"r\": 4", "\"r\": 8")).unwrap();
    refused(400, "BadRequestError", "but `r` = 8 on this model gives")(
        server
            .post(
                "/v1/load_lora_adapter",
                json!({"lora_name": "x", "lora_path": wrong_rank}),
            )
            .await,
    );
    // PEFT's `rank_pattern` gives `q_proj` the rank its tensors have: the adapter loads.
    let mut patterned: Value = serde_json::from_str(&text).unwrap();
    patterned["r"] = json!(8);
    patterned["rank_pattern"] = json!({"q_proj": 4});
    std::fs::write(&config, patterned.to_string()).unwrap();
    let (status, _, answer) = server
        .post(
            "/v1/load_lora_adapter",
            json!({"lora_name": "patterned", "lora_path": wrong_rank}),
        )
        .await;
    assert_eq!(status, 200, "{answer:#}");
    let (status, _, answer) = server
        .post("/v1/unload_lora_adapter", json!({"lora_name": "patterned"}))
        .await;
    assert_eq!(status, 200, "{answer:#}");
    let (status, _, answer) = server
        .post(
            "/v1/completions",
            json!({"model": "x", "prompt": probe, "max_tokens": 1}),
        )
        .await;
    assert_eq!(status, 404, "{answer:#}");
    assert_eq!(answer["error"]["code"], "model_not_found");

    // Greedy replies on the base, then on the adapter: the adapter's must not reuse the keys and
    // values the base cached for the same prompt (checked against the merged model below).
    let generate = |model: &'static str| {
        let server = &server;
        async move {
            let (status, _, answer) = server
                .post(
                    "/v1/completions",
                    json!({
                        "model": model, "prompt": [5, 17, 3, 42], "max_tokens": 8, "temperature": 0.0,
                        "ignore_eos": true, "return_token_ids": true, "logprobs": 0,
                    }),
                )
                .await;
            assert_eq!(status, 200, "{answer:#}");
            let choice = &answer["choices"][0];
            let logprobs: Vec<f32> = choice["logprobs"]["token_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|value| value.as_f64().unwrap() as f32)
                .collect();
            (choice["token_ids"].clone(), logprobs)
        }
    };
    generate("tiny").await;
    let (adapter_tokens, adapter_logprobs) = generate("policy").await;

    // The adapter merged into the base, loaded as full weights: the base now gives what the adapter
    // gave, to rounding, under version 1.
    let merged = dir.join("merged");
    holo_runtime::train::export::merge_adapter(&second, &dir, &merged).unwrap();
    let (status, version, answer) = server
        .post("/update_weights_from_disk", json!({"model_path": merged}))
        .await;
    assert_eq!((status, version), (200, Some(1)), "{answer:#}");
    assert_eq!(answer["success"], true);
    assert_eq!(answer["weight_version"], 1);
    let (replaced, version) = server.score("tiny", &probe).await;
    assert_eq!(version, 1);
    let gap = max_difference(&replaced, &reloaded);
    assert!(
        gap <= 1e-4,
        "merged weights {replaced:?} vs the adapter {reloaded:?}: {gap}"
    );
    let (merged_tokens, merged_logprobs) = generate("tiny").await;
    assert_eq!(merged_tokens, adapter_tokens);
    assert!(max_difference(&merged_logprobs, &adapter_logprobs) <= 1e-4);
    // A file of other shapes is refused by tensor name, and the weights stay.
    let other = dir.join("other.safetensors");
    let mut tensors =
        candle_core::safetensors::load(merged.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    tensors.remove("model.norm.weight");
    candle_core::safetensors::save(&tensors, &other).unwrap();
    let (status, version, answer) = server
        .post("/update_weights_from_disk", json!({"model_path": other}))
        .await;
    assert_eq!((status, version), (400, None), "{answer:#}");
    assert_eq!(answer["success"], false);
    assert!(
        answer["message"]
            .as_str()
            .unwrap()
            .contains("has no tensor model.norm.weight"),
        "{answer:#}"
    );
    assert_eq!(server.score("tiny", &probe).await, (replaced, 1));

    let metrics = server.get("/metrics").await;
    assert!(
        metrics.contains("holo_weight_version{model=\"tiny\"} 1\n")
            && metrics.contains("holo_weight_version{model=\"policy\"} 2\n"),
        "{metrics}"
    );

    // Unloading: vLLM's answers; the name is then unknown, and loading it again goes on counting.
    let (status, _, answer) = server
        .post("/v1/unload_lora_adapter", json!({"lora_name": "policy"}))
        .await;
    assert_eq!(status, 200);
    assert_eq!(
        answer,
        "Success: LoRA adapter 'policy' removed successfully."
    );
    refused(
        404,
        "NotFoundError",
        "The lora adapter 'policy' cannot be found.",
    )(
        server
            .post("/v1/unload_lora_adapter", json!({"lora_name": "policy"}))
            .await,
    );
    let (status, _, _) = server
        .post(
            "/v1/completions",
            json!({"model": "policy", "prompt": probe, "max_tokens": 1}),
        )
        .await;
    assert_eq!(status, 404);
    let (status, version, _) = server
        .post(
            "/v1/load_lora_adapter",
            json!({"lora_name": "policy", "lora_path": first}),
        )
        .await;
    assert_eq!((status, version), (200, Some(3)));
    // Loaded over the replaced base, the first adapter gives neither what it gave before nor the base.
    let (again, version) = server.score("policy", &probe).await;
    assert_eq!(version, 3);
    assert!(max_difference(&again, &adapted) > 1e-3);
}

/// A request in flight finishes on the weights it started with: a long greedy generation on the
/// adapter, streamed, with the adapter replaced once its first tokens have arrived, gives the tokens the
/// same request gave before, and every chunk reports the version it started with.
#[cfg(feature = "cli")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_flight_keeps_its_weights() {
    use std::process::Command;

    let dir = tiny_model("inflight");
    let (first, second) = (dir.join("first"), dir.join("second"));
    write_adapter(&dir, &first, 4, &["q_proj", "v_proj"], 5);
    write_adapter(&dir, &second, 4, &["q_proj", "v_proj"], 6);
    let served = Served::start(
        Command::new(env!("CARGO_BIN_EXE_holo"))
            .args(["serve", dir.to_str().unwrap(), "--port", "0"])
            .args(["--served-model-name", "tiny", "--no-access-log"]),
    );
    let server = Weighted {
        client: reqwest::Client::builder().no_proxy().build().unwrap(),
        base: served.base.clone(),
    };
    let (status, _, _) = server
        .post(
            "/v1/load_lora_adapter",
            json!({"lora_name": "policy", "lora_path": first}),
        )
        .await;
    assert_eq!(status, 200);
    let request = json!({
        "model": "policy", "prompt": [5, 17, 3], "max_tokens": 300, "temperature": 0.0,
        "ignore_eos": true, "return_token_ids": true,
    });
    let (status, _, alone) = server.post("/v1/completions", request.clone()).await;
    assert_eq!(status, 200);

    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let mut response = server
        .client
        .post(format!("{}/v1/completions", server.base))
        .header("content-type", "application/json")
        .body(streamed.to_string())
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut body = String::new();
    while !body.contains("\n\n") {
        let chunk = response.chunk().await.unwrap().expect("a first event");
        body.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let (status, version, _) = server
        .post(
            "/v1/load_lora_adapter",
            json!({"lora_name": "policy", "lora_path": second, "load_inplace": true}),
        )
        .await;
    assert_eq!((status, version), (200, Some(2)));
    while let Some(chunk) = response.chunk().await.unwrap() {
        body.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let chunks = sse_payloads(&body);
    assert!(chunks.iter().all(|chunk| chunk["weight_version"] == 1));
    let during = join_choice(&chunks, 0, false);
    assert_eq!(during["token_ids"], alone["choices"][0]["token_ids"]);
    let (_, version, after) = server.post("/v1/completions", request).await;
    assert_eq!(version, Some(2));
    assert_ne!(
        after["choices"][0]["token_ids"],
        alone["choices"][0]["token_ids"]
    );
}
