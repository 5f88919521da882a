//! Tinker's wire, as the `tinker` SDK 0.25.0 speaks it and SkyRL 0.4.0's server answers it: the JSON
//! bodies of the service's endpoints (serde types, field for field the SDK's pydantic models), and the
//! protobuf side ([`super::proto`]): a `forward_backward` request built from our completions, and the
//! `forward_backward` and `sample` results decoded.
//!
//! Protobuf tensors carry raw little-endian bytes: token ids as `int32` in prompt chunks and sampled
//! sequences, loss inputs as `float32` or `int64` [`proto::Tensor`]s, per-datum outputs concatenated in a
//! [`proto::BatchedTensor`] with `int64` byte offsets.

use std::collections::BTreeMap;

use prost::Message;
use serde::{Deserialize, Serialize};

use super::proto;

/// The SDK version this client speaks, sent where the SDK sends its own.
pub const SDK_VERSION: &str = "0.25.0";

/// `POST /api/v1/client/config` and `create_session` carry the SDK's version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClientConfigRequest {
    pub sdk_version: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CreateSessionRequest {
    pub tags: Vec<String>,
    pub user_metadata: BTreeMap<String, String>,
    pub sdk_version: String,
    #[serde(rename = "type")]
    pub kind: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CreateSessionResponse {
    pub session_id: String,
    #[serde(default)]
    pub info_message: Option<String>,
    #[serde(default)]
    pub warning_message: Option<String>,
    #[serde(default)]
    pub error_message: Option<String>,
    /// How many bits of a sampling seed the service draws with, where it says (`holo tinker-serve`).
    #[serde(default)]
    pub sampling_seed_bits: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionHeartbeatRequest {
    pub session_id: String,
    #[serde(rename = "type")]
    pub kind: String,
}

/// The LoRA scale's numerator: Tinker fixes `alpha` at 32 whatever the rank ([`LoraConfig`] has no
/// field for it).
pub const LORA_ALPHA: f64 = 32.0;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    pub rank: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CreateModelRequest {
    pub session_id: String,
    pub model_seq_id: u64,
    pub base_model: String,
    pub lora_config: LoraConfig,
    #[serde(rename = "type")]
    pub kind: String,
}

/// The reply of every operation: the future to retrieve its result with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FutureResponse {
    pub request_id: String,
}

/// `create_model`'s result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CreateModelResult {
    pub model_id: String,
}

/// AdamW's settings for one `optim_step`. `grad_clip_norm` 0 is no clipping.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdamParams {
    pub learning_rate: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub grad_clip_norm: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimStepRequest {
    pub adam_params: AdamParams,
    pub model_id: String,
    pub seq_id: u64,
    #[serde(rename = "type")]
    pub kind: String,
}

/// `optim_step`'s result: SkyRL reports `skyrl.ai/grad_norm` and `skyrl.ai/learning_rate`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OptimStepResult {
    #[serde(default)]
    pub metrics: Option<BTreeMap<String, f64>>,
}

/// `save_weights` (a training checkpoint: weights and optimizer state) and `save_weights_for_sampler`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SaveWeightsRequest {
    pub model_id: String,
    pub path: String,
    pub seq_id: u64,
    #[serde(rename = "type")]
    pub kind: String,
}

/// Their result: the checkpoint's `tinker://` path.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SaveWeightsResult {
    pub path: Option<String>,
}

/// `load_weights`: a training checkpoint into a new model, as its first request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadWeightsRequest {
    pub model_id: String,
    pub path: String,
    pub optimizer: bool,
    pub seq_id: u64,
    #[serde(rename = "type")]
    pub kind: String,
}

/// `unload_model`: frees a model's adapter on the service (a rollback leaves the model it abandons).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnloadModelRequest {
    pub model_id: String,
    #[serde(rename = "type")]
    pub kind: String,
}

/// A model input of token chunks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelInput {
    pub chunks: Vec<EncodedText>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EncodedText {
    pub tokens: Vec<u32>,
    #[serde(rename = "type")]
    pub kind: String,
}

impl ModelInput {
    pub fn tokens(tokens: Vec<u32>) -> Self {
        ModelInput {
            chunks: vec![EncodedText {
                tokens,
                kind: "encoded_text".into(),
            }],
        }
    }
}

/// Sampling parameters; `top_k` −1 is the whole vocabulary; `stop` are token ids.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    pub max_tokens: u32,
    pub seed: Option<u64>,
    pub stop: Vec<u32>,
    pub temperature: f64,
    pub top_k: i64,
    pub top_p: f64,
}

/// `asample`: `num_samples` completions of `prompt` by the sampler weights at `model_path`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleRequest {
    pub num_samples: u32,
    pub prompt: ModelInput,
    pub sampling_params: SamplingParams,
    pub model_path: String,
    pub prompt_logprobs: bool,
    #[serde(rename = "type")]
    pub kind: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RetrieveFutureRequest {
    pub request_id: String,
}

/// A JSON answer of `retrieve_future` that is not a result: the hosted service's `try_again` (the
/// result is not ready; ask again) or a failed request's `error`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct FutureStatus {
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    #[serde(default)]
    pub error: Option<String>,
    #[serde(default)]
    pub category: Option<String>,
}

/// The loss Tinker computes on the service (`forward_backward`'s `loss_fn`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LossFn {
    /// `-Σ exp(logp − logp_sampler) · A` over the target tokens.
    ImportanceSampling,
    /// PPO's clipped surrogate, the ratio clipped to `[low, high]`.
    Ppo { low: f64, high: f64 },
}

impl LossFn {
    pub fn name(&self) -> &'static str {
        match self {
            LossFn::ImportanceSampling => "importance_sampling",
            LossFn::Ppo { .. } => "ppo",
        }
    }

    fn config(&self) -> std::collections::HashMap<String, f64> {
        match *self {
            LossFn::ImportanceSampling => Default::default(),
            LossFn::Ppo { low, high } => [
                ("clip_low_threshold".to_string(), low),
                ("clip_high_threshold".to_string(), high),
            ]
            .into(),
        }
    }
}

/// One training example of an RL loss: the model reads `tokens[..n-1]` and predicts `tokens[1..]`;
/// `logprobs` and `advantages` are aligned with the targets (0 where a target is not trained).
#[derive(Debug, Clone, PartialEq)]
pub struct Datum {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub advantages: Vec<f32>,
}

impl Datum {
    /// Targets (and so output positions) of the datum.
    pub fn targets(&self) -> usize {
        self.tokens.len().saturating_sub(1)
    }
}

fn int32_bytes(values: &[u32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&value| (value as i32).to_le_bytes())
        .collect()
}

fn float32_tensor(values: &[f32]) -> proto::Tensor {
    proto::Tensor {
        dtype: proto::DType::DtypeFloat32 as i32,
        shape: vec![values.len() as i64],
        encoding: Some(proto::tensor::Encoding::Dense(
            values
                .iter()
                .flat_map(|value| value.to_le_bytes())
                .collect(),
        )),
    }
}

fn int64_tensor(values: &[u32]) -> proto::Tensor {
    proto::Tensor {
        dtype: proto::DType::DtypeInt64 as i32,
        shape: vec![values.len() as i64],
        encoding: Some(proto::tensor::Encoding::Dense(
            values
                .iter()
                .flat_map(|&value| i64::from(value).to_le_bytes())
                .collect(),
        )),
    }
}

/// The protobuf body of `forward_backward` (`application/x-protobuf`).
pub fn forward_backward_body(model_id: &str, seq_id: u64, data: &[Datum], loss: LossFn) -> Vec<u8> {
    let data = data
        .iter()
        .map(|datum| {
            let n = datum.targets();
            let mut inputs = std::collections::HashMap::new();
            inputs.insert(
                "target_tokens".to_string(),
                int64_tensor(&datum.tokens[1..]),
            );
            inputs.insert("logprobs".to_string(), float32_tensor(&datum.logprobs[..n]));
            inputs.insert(
                "advantages".to_string(),
                float32_tensor(&datum.advantages[..n]),
            );
            proto::Datum {
                model_input: vec![proto::Chunk {
                    chunk: Some(proto::chunk::Chunk::EncodedText(proto::EncodedTextChunk {
                        tokens: int32_bytes(&datum.tokens[..n]),
                    })),
                }],
                loss_fn_inputs: inputs,
                ..Default::default()
            }
        })
        .collect();
    proto::ForwardBackwardRequest {
        model_id: model_id.to_string(),
        seq_id: seq_id as i32,
        data,
        loss_fn: loss.name().to_string(),
        loss_fn_config: loss.config(),
        forward_only: false,
        // Numbers only, in the map SDK 0.25.0 (and SkyRL's server) reads.
        loss_fn_config_v2: Default::default(),
    }
    .encode_to_vec()
}

/// `forward_backward`'s result: per datum, its named outputs (`logprobs` and `elementwise_loss` for the
/// RL losses), and the service's metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ForwardBackwardResult {
    pub outputs: Vec<BTreeMap<String, Vec<f32>>>,
    pub metrics: BTreeMap<String, f64>,
}

fn chunks<const N: usize>(bytes: &[u8], what: &str) -> Result<Vec<[u8; N]>, String> {
    if !bytes.len().is_multiple_of(N) {
        return Err(format!(
            "{what}: {} bytes is not a whole number of {N}-byte values",
            bytes.len()
        ));
    }
    Ok(bytes
        .chunks_exact(N)
        .map(|chunk| chunk.try_into().expect("chunks_exact"))
        .collect())
}

/// Decodes a `ForwardBackwardOutput`.
pub fn forward_backward_result(bytes: &[u8]) -> Result<ForwardBackwardResult, String> {
    let output = proto::ForwardBackwardOutput::decode(bytes)
        .map_err(|error| format!("not a ForwardBackwardOutput: {error}"))?;
    let mut result = ForwardBackwardResult {
        outputs: Vec::new(),
        metrics: output.metrics.into_iter().collect(),
    };
    for record in output.loss_fn_outputs {
        let start = result.outputs.len();
        result
            .outputs
            .extend((0..record.num_datums.max(0)).map(|_| BTreeMap::new()));
        for (name, tensor) in record.fields {
            let offsets: Vec<usize> = chunks::<8>(&tensor.offsets, &format!("`{name}` offsets"))?
                .into_iter()
                .map(|bytes| i64::from_le_bytes(bytes) as usize)
                .collect();
            if offsets.len() != record.num_datums as usize + 1 {
                return Err(format!(
                    "`{name}`: {} offsets for {} datums",
                    offsets.len(),
                    record.num_datums
                ));
            }
            for (index, window) in offsets.windows(2).enumerate() {
                let (from, to) = (window[0], window[1]);
                let bytes = tensor.data.get(from..to).ok_or_else(|| {
                    format!(
                        "`{name}`: bytes {from}..{to} of {} in all",
                        tensor.data.len()
                    )
                })?;
                let values = match proto::DType::try_from(tensor.dtype) {
                    Ok(proto::DType::DtypeFloat32) => chunks::<4>(bytes, &format!("`{name}`"))?
                        .into_iter()
                        .map(f32::from_le_bytes)
                        .collect(),
                    Ok(proto::DType::DtypeInt64) => chunks::<8>(bytes, &format!("`{name}`"))?
                        .into_iter()
                        .map(|bytes| i64::from_le_bytes(bytes) as f32)
                        .collect(),
                    _ => return Err(format!("`{name}`: dtype {} is not read", tensor.dtype)),
                };
                result.outputs[start + index].insert(name.clone(), values);
            }
        }
    }
    Ok(result)
}

/// A sampled sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledSequence {
    pub tokens: Vec<u32>,
    /// One per token (empty when the service gave none).
    pub logprobs: Vec<f32>,
    /// It ended at `max_tokens` (otherwise at a stop token, which it includes).
    pub length: bool,
}

/// Decodes a `SampleResponse`'s sequences.
pub fn sample_result(bytes: &[u8]) -> Result<Vec<SampledSequence>, String> {
    let response = proto::SampleResponse::decode(bytes)
        .map_err(|error| format!("not a SampleResponse: {error}"))?;
    response
        .sequences
        .into_iter()
        .map(|sequence| {
            let tokens: Vec<u32> = chunks::<4>(&sequence.tokens, "sampled tokens")?
                .into_iter()
                .map(|bytes| i32::from_le_bytes(bytes) as u32)
                .collect();
            let logprobs: Vec<f32> = match &sequence.logprobs {
                Some(bytes) => chunks::<4>(bytes, "sampled logprobs")?
                    .into_iter()
                    .map(f32::from_le_bytes)
                    .collect(),
                None => Vec::new(),
            };
            if !logprobs.is_empty() && logprobs.len() != tokens.len() {
                return Err(format!(
                    "{} logprobs for {} sampled tokens",
                    logprobs.len(),
                    tokens.len()
                ));
            }
            Ok(SampledSequence {
                tokens,
                logprobs,
                length: sequence.stop_reason == proto::StopReason::Length as i32,
            })
        })
        .collect()
}
