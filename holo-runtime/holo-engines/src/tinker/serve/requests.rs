//! The request bodies the `tinker` SDK 0.38.0 sends (field for field its pydantic models, as
//! `model_dump(exclude_none=True)` writes them), read strictly: a field this server does not know is
//! refused rather than ignored, and every value is checked before any work is queued, the error naming
//! the field. The `forward_backward` body is protobuf ([`forward_backward`]).

use std::collections::BTreeMap;

use prost::Message;
use serde::Deserialize;
use serde_json::Value;

use super::losses::{LossFn, Setting};
use super::worker::{Datum, Stop};
use crate::tinker::proto;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientConfig {
    pub sdk_version: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    pub tags: Vec<String>,
    #[serde(default)]
    pub user_metadata: Option<BTreeMap<String, Value>>,
    pub sdk_version: String,
    #[serde(default)]
    pub project_id: Option<String>,
    #[serde(default)]
    pub display_name: Option<String>,
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionRef {
    pub session_id: String,
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
}

/// `POST /api/v1/sessions/{id}/finish`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FinishSession {
    #[serde(default)]
    pub reason: Option<Value>,
    #[serde(default)]
    pub detail: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraConfig {
    pub rank: usize,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default = "yes")]
    pub train_unembed: bool,
    #[serde(default = "yes")]
    pub train_mlp: bool,
    #[serde(default = "yes")]
    pub train_attn: bool,
}

fn yes() -> bool {
    true
}

/// `optimizer_config`: AdamW is the one served.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerConfig {
    #[serde(rename = "type")]
    pub kind: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateModel {
    pub session_id: String,
    pub model_seq_id: u64,
    pub base_model: String,
    #[serde(default)]
    pub user_metadata: Option<BTreeMap<String, Value>>,
    /// Without one the SDK asks for full fine-tuning, which this server does not do.
    #[serde(default)]
    pub lora_config: Option<LoraConfig>,
    #[serde(default)]
    pub optimizer_config: Option<OptimizerConfig>,
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelRef {
    pub model_id: String,
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
}

/// `weights_info`: a checkpoint's `tinker://` path.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightsInfo {
    pub tinker_path: String,
}

/// The SDK's `AdamParams`, with its defaults.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdamParams {
    #[serde(default = "AdamParams::learning_rate")]
    pub learning_rate: f64,
    #[serde(default = "AdamParams::beta1")]
    pub beta1: f64,
    #[serde(default = "AdamParams::beta2")]
    pub beta2: f64,
    #[serde(default = "AdamParams::eps")]
    pub eps: f64,
    #[serde(default)]
    pub weight_decay: f64,
    #[serde(default)]
    pub grad_clip_norm: f64,
}

impl AdamParams {
    fn learning_rate() -> f64 {
        1e-4
    }
    fn beta1() -> f64 {
        0.9
    }
    fn beta2() -> f64 {
        0.95
    }
    fn eps() -> f64 {
        1e-12
    }

    /// Refuses values AdamW cannot take, naming them.
    pub fn check(&self) -> Result<(), String> {
        let fields = [
            ("learning_rate", self.learning_rate),
            ("beta1", self.beta1),
            ("beta2", self.beta2),
            ("eps", self.eps),
            ("weight_decay", self.weight_decay),
            ("grad_clip_norm", self.grad_clip_norm),
        ];
        for (name, value) in fields {
            if !value.is_finite() || value < 0.0 {
                return Err(format!(
                    "adam_params.{name}: {value} is not a finite number >= 0"
                ));
            }
        }
        for (name, value) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if value >= 1.0 {
                return Err(format!("adam_params.{name}: {value} is not below 1"));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimStep {
    pub adam_params: AdamParams,
    pub model_id: String,
    #[serde(default)]
    pub seq_id: Option<u64>,
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SaveWeights {
    pub model_id: String,
    #[serde(default)]
    pub path: Option<String>,
    #[serde(default)]
    pub seq_id: Option<u64>,
    #[serde(default)]
    pub ttl_seconds: Option<u64>,
    #[serde(default)]
    pub overwrite: bool,
    #[serde(default)]
    pub user_metadata: Option<BTreeMap<String, String>>,
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SaveWeightsForSampler {
    pub model_id: String,
    #[serde(default)]
    pub path: Option<String>,
    #[serde(default)]
    pub sampling_session_seq_id: Option<u64>,
    /// `snapshot` (the weights as they are now) is the kind served.
    #[serde(default)]
    pub kind: Option<String>,
    #[serde(default)]
    pub seq_id: Option<u64>,
    #[serde(default)]
    pub ttl_seconds: Option<u64>,
    #[serde(default)]
    pub user_metadata: Option<BTreeMap<String, String>>,
    #[serde(rename = "type", default)]
    pub request_type: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadWeights {
    #[serde(default)]
    pub model_id: Option<String>,
    #[serde(default)]
    pub seq_id: Option<u64>,
    #[serde(default)]
    pub session_id: Option<String>,
    #[serde(default)]
    pub model_seq_id: Option<u64>,
    #[serde(default)]
    pub base_model: Option<String>,
    #[serde(default)]
    pub user_metadata: Option<BTreeMap<String, Value>>,
    pub path: String,
    pub optimizer: bool,
    #[serde(default)]
    pub optimizer_config: Option<OptimizerConfig>,
    #[serde(default)]
    pub weights_access_token: Option<String>,
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSamplingSession {
    pub session_id: String,
    pub sampling_session_seq_id: u64,
    #[serde(default)]
    pub base_model: Option<String>,
    #[serde(default)]
    pub model_path: Option<String>,
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EncodedText {
    pub tokens: Vec<i64>,
    #[serde(rename = "type")]
    pub kind: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelInput {
    pub chunks: Vec<Value>,
}

impl ModelInput {
    /// The token ids of an input of `encoded_text` chunks.
    pub fn tokens(&self, field: &str, vocab: usize) -> Result<Vec<u32>, String> {
        let mut tokens = Vec::new();
        for (index, chunk) in self.chunks.iter().enumerate() {
            let field = format!("{field}.chunks[{index}]");
            let chunk: EncodedText = serde_json::from_value(chunk.clone()).map_err(|error| {
                format!("{field}: only encoded_text chunks are served ({error})")
            })?;
            if chunk.kind != "encoded_text" {
                return Err(format!(
                    "{field}: `{}` chunks are not served (only encoded_text)",
                    chunk.kind
                ));
            }
            for token in chunk.tokens {
                tokens.push(token_id(token, vocab, &field)?);
            }
        }
        Ok(tokens)
    }
}

fn token_id(token: i64, vocab: usize, field: &str) -> Result<u32, String> {
    if token < 0 || token as u64 >= vocab as u64 {
        return Err(format!(
            "{field}: token {token} is outside the vocabulary (0..{vocab})"
        ));
    }
    Ok(token as u32)
}

/// `stop`: a string, strings, or token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Strings(Vec<String>),
    Tokens(Vec<i64>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingParams {
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub stop: Option<StopField>,
    #[serde(default = "one")]
    pub temperature: f64,
    #[serde(default = "all")]
    pub top_k: i64,
    #[serde(default = "one")]
    pub top_p: f64,
}

fn one() -> f64 {
    1.0
}

fn all() -> i64 {
    -1
}

impl SamplingParams {
    pub fn stop(&self, vocab: usize) -> Result<Stop, String> {
        Ok(match &self.stop {
            None => Stop::EndOfTurn,
            Some(StopField::One(text)) => Stop::Strings(vec![text.clone()]),
            // `[]` reads as either list: no stop at all, not even the end of turn.
            Some(StopField::Strings(texts)) if texts.is_empty() => Stop::Tokens(Vec::new()),
            Some(StopField::Strings(texts)) => Stop::Strings(texts.clone()),
            Some(StopField::Tokens(tokens)) => Stop::Tokens(
                tokens
                    .iter()
                    .map(|&token| token_id(token, vocab, "sampling_params.stop"))
                    .collect::<Result<_, _>>()?,
            ),
        })
    }

    pub fn check(&self) -> Result<(), String> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!(
                "sampling_params.temperature: {} is not a finite number >= 0",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!(
                "sampling_params.top_p: {} is not in (0, 1]",
                self.top_p
            ));
        }
        if self.top_k == 0 || self.top_k < -1 {
            return Err(format!(
                "sampling_params.top_k: {} is neither -1 (every token) nor >= 1",
                self.top_k
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SampleRequest {
    #[serde(default = "one_sample")]
    pub num_samples: u64,
    pub prompt: ModelInput,
    pub sampling_params: SamplingParams,
    #[serde(default)]
    pub base_model: Option<String>,
    #[serde(default)]
    pub model_path: Option<String>,
    #[serde(default)]
    pub sampling_session_id: Option<String>,
    #[serde(default)]
    pub seq_id: Option<u64>,
    #[serde(default)]
    pub prompt_logprobs: Option<bool>,
    #[serde(default)]
    pub topk_prompt_logprobs: u64,
    #[serde(default)]
    pub topk_sample_logprobs: u64,
    #[serde(default)]
    pub target_prompt_logprobs: Option<Value>,
    #[serde(default)]
    pub prompt_alt_tokens_k: u64,
    #[serde(default)]
    pub prompt_logprobs_last_n: Option<u64>,
    #[serde(default)]
    pub record_stability_info: Option<bool>,
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
}

fn one_sample() -> u64 {
    1
}

impl SampleRequest {
    /// Refuses what the sampler does not compute, rather than answering without it.
    pub fn check_served(&self) -> Result<(), String> {
        let refused = [
            ("topk_prompt_logprobs", self.topk_prompt_logprobs != 0),
            (
                "target_prompt_logprobs",
                self.target_prompt_logprobs.is_some(),
            ),
            ("prompt_alt_tokens_k", self.prompt_alt_tokens_k != 0),
            (
                "record_stability_info",
                self.record_stability_info == Some(true),
            ),
        ];
        match refused.iter().find(|(_, asked)| *asked) {
            Some((field, _)) => Err(format!("{field}: not served by holo tinker-serve")),
            None => Ok(()),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetrieveFuture {
    pub request_id: String,
    #[serde(default)]
    pub allow_metadata_only: bool,
}

/// A decoded `forward_backward` request.
#[derive(Debug)]
pub struct ForwardBackward {
    pub model_id: String,
    /// 0 when the client sent none.
    pub seq_id: u64,
    pub data: Vec<Datum>,
    pub loss: LossFn,
    pub forward_only: bool,
}

/// Reads a protobuf `ForwardBackwardRequest`, checking every datum against `vocab` and `context`.
pub fn forward_backward(
    body: &[u8],
    vocab: usize,
    context: usize,
) -> Result<ForwardBackward, String> {
    let request = proto::ForwardBackwardRequest::decode(body)
        .map_err(|error| format!("body: not a ForwardBackwardRequest ({error})"))?;
    // The SDK writes numbers to both maps and strings to the second only, which servers prefer.
    let config: BTreeMap<String, Setting> = if request.loss_fn_config_v2.is_empty() {
        request
            .loss_fn_config
            .iter()
            .map(|(key, &value)| (key.clone(), Setting::Number(value)))
            .collect()
    } else {
        request
            .loss_fn_config_v2
            .iter()
            .map(|(key, value)| {
                let setting = match &value.value {
                    Some(proto::loss_config_value::Value::Number(number)) => {
                        Setting::Number(*number)
                    }
                    Some(proto::loss_config_value::Value::Text(text)) => {
                        Setting::Text(text.clone())
                    }
                    None => return Err(format!("loss_fn_config.{key}: no value")),
                };
                Ok((key.clone(), setting))
            })
            .collect::<Result<_, String>>()?
    };
    let loss = LossFn::parse(&request.loss_fn, &config)?;
    if request.data.is_empty() {
        return Err("data: no datum".into());
    }
    let data = request
        .data
        .iter()
        .enumerate()
        .map(|(index, datum)| read_datum(datum, &format!("data[{index}]"), loss, vocab, context))
        .collect::<Result<_, _>>()?;
    Ok(ForwardBackward {
        model_id: request.model_id,
        seq_id: request.seq_id.max(0) as u64,
        data,
        loss,
        forward_only: request.forward_only,
    })
}

fn read_datum(
    datum: &proto::Datum,
    field: &str,
    loss: LossFn,
    vocab: usize,
    context: usize,
) -> Result<Datum, String> {
    if !datum.model_input_spans.is_empty() || !datum.loss_fn_input_spans.is_empty() {
        return Err(format!(
            "{field}: provenance spans (StableReinforce) are not served"
        ));
    }
    let mut input = Vec::new();
    for (index, chunk) in datum.model_input.iter().enumerate() {
        let at = format!("{field}.model_input.chunks[{index}]");
        match &chunk.chunk {
            Some(proto::chunk::Chunk::EncodedText(text)) => {
                if text.tokens.len() % 4 != 0 {
                    return Err(format!("{at}: tokens are not whole int32 values"));
                }
                for bytes in text.tokens.chunks_exact(4) {
                    let token = i32::from_le_bytes(bytes.try_into().expect("4 bytes"));
                    input.push(token_id(i64::from(token), vocab, &at)?);
                }
            }
            Some(_) => return Err(format!("{at}: only encoded_text chunks are served")),
            None => return Err(format!("{at}: an empty chunk")),
        }
    }
    let n = input.len();
    if n == 0 {
        return Err(format!("{field}.model_input: no token"));
    }
    if n > context {
        return Err(format!(
            "{field}.model_input: {n} tokens, beyond the model's context of {context}"
        ));
    }
    let wanted: Vec<&str> = std::iter::once("target_tokens")
        .chain(loss.inputs().iter().copied())
        .collect();
    if let Some(extra) = datum
        .loss_fn_inputs
        .keys()
        .find(|key| !wanted.contains(&key.as_str()))
    {
        return Err(format!(
            "{field}.loss_fn_inputs.{extra}: not an input of this loss (it reads {})",
            wanted.join(", ")
        ));
    }
    let tensor = |name: &str| -> Result<(&[u8], i32), String> {
        let tensor = datum.loss_fn_inputs.get(name).ok_or_else(|| {
            format!(
                "{field}.loss_fn_inputs.{name}: missing (this loss reads {})",
                wanted.join(", ")
            )
        })?;
        let at = format!("{field}.loss_fn_inputs.{name}");
        let Some(proto::tensor::Encoding::Dense(bytes)) = &tensor.encoding else {
            return Err(format!("{at}: only dense tensors are served"));
        };
        if !tensor.shape.is_empty() && tensor.shape != [n as i64] {
            return Err(format!(
                "{at}: shape {:?}, but model_input has {n} tokens (shape [{n}] expected)",
                tensor.shape
            ));
        }
        Ok((bytes.as_slice(), tensor.dtype))
    };
    let (bytes, dtype) = tensor("target_tokens")?;
    let at = format!("{field}.loss_fn_inputs.target_tokens");
    if dtype != proto::DType::DtypeInt64 as i32 || bytes.len() != n * 8 {
        return Err(format!(
            "{at}: {n} int64 values expected ({} bytes of dtype {dtype})",
            bytes.len()
        ));
    }
    let targets = bytes
        .chunks_exact(8)
        .map(|b| {
            token_id(
                i64::from_le_bytes(b.try_into().expect("8 bytes")),
                vocab,
                &at,
            )
        })
        .collect::<Result<Vec<u32>, String>>()?;
    let floats = loss
        .inputs()
        .iter()
        .map(|name| {
            let (bytes, dtype) = tensor(name)?;
            let at = format!("{field}.loss_fn_inputs.{name}");
            if dtype != proto::DType::DtypeFloat32 as i32 || bytes.len() != n * 4 {
                return Err(format!(
                    "{at}: {n} float32 values expected ({} bytes of dtype {dtype})",
                    bytes.len()
                ));
            }
            let values: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect();
            if let Some(bad) = values.iter().position(|v| !v.is_finite()) {
                return Err(format!("{at}[{bad}]: {} is not finite", values[bad]));
            }
            Ok(values)
        })
        .collect::<Result<_, String>>()?;
    Ok(Datum {
        input,
        targets,
        floats,
    })
}
