//! RoPE in `config.json`: base and scaling (transformers 4's `rope_theta` and `rope_scaling`,
//! transformers 5's `rope_parameters`, per layer type where the family has them), the rotated fraction,
//! and their writing back.

use serde_json::Value;

use super::{Arch, ConfigError, RopeScaling};

/// Whether `partial_rotary_factor` is given (top-level or in `rope_parameters`).
pub(super) fn states_rotary_factor(json: &Value) -> bool {
    let given = |value: Option<&Value>| value.is_some_and(|value| !value.is_null());
    given(json.get("partial_rotary_factor"))
        || given(
            json.get("rope_parameters")
                .and_then(|parameters| parameters.get("partial_rotary_factor")),
        )
}

/// A RoPE: its base and scaling.
pub(super) type Rope = (f64, RopeScaling);

/// How many of each head's dimensions RoPE rotates: `partial_rotary_factor` (top-level or in
/// `rope_parameters`) × `head_dim`, `None` for all of them.
pub(super) fn rotary_dim(json: &Value, head_dim: usize) -> Result<Option<usize>, ConfigError> {
    let factor = json
        .get("rope_parameters")
        .and_then(|parameters| parameters.get("partial_rotary_factor"))
        .or_else(|| json.get("partial_rotary_factor"))
        .filter(|value| !value.is_null());
    let Some(factor) = factor else {
        return Ok(None);
    };
    let factor = factor
        .as_f64()
        .filter(|f| *f > 0.0 && *f <= 1.0)
        .ok_or_else(|| {
            ConfigError(format!(
                "`partial_rotary_factor` must be a number in (0, 1], found {factor}"
            ))
        })?;
    let dim = (head_dim as f64 * factor) as usize;
    if !dim.is_multiple_of(2) || dim == 0 {
        return Err(ConfigError(format!(
            "`partial_rotary_factor` {factor} rotates {dim} of {head_dim} dimensions: RoPE needs an even number"
        )));
    }
    Ok((dim != head_dim).then_some(dim))
}

/// YaRN's parameters with the defaults of transformers' `_compute_yarn_parameters`: the original context
/// from the scaling, the config, or `max_position_embeddings`; `factor` from the context's growth when
/// null; the attention factor, unless given, `0.1 ln factor + 1` (or the ratio of two such, with
/// `mscale` and `mscale_all_dim`); `beta_fast` 32 and `beta_slow` 1 when absent or zero; `truncate`
/// true when absent (a null is false, as transformers reads it).
fn yarn(scaling: &Value, config: &Value) -> Result<RopeScaling, ConfigError> {
    let present = |key: &str| scaling.get(key).filter(|value| !value.is_null());
    let number = |key: &str| -> Result<Option<f64>, ConfigError> {
        present(key)
            .map(|value| {
                value.as_f64().ok_or_else(|| {
                    ConfigError(format!(
                        "rope scaling \"yarn\": `{key}` must be a number, found {value}"
                    ))
                })
            })
            .transpose()
    };
    let original = present("original_max_position_embeddings")
        .or_else(|| config.get("original_max_position_embeddings"))
        .or_else(|| config.get("max_position_embeddings"))
        .filter(|value| !value.is_null());
    let original = match original {
        None => {
            return Err(ConfigError(
                "rope scaling \"yarn\" needs `original_max_position_embeddings` (or \
                 `max_position_embeddings`)"
                    .into(),
            ))
        }
        Some(value) => match value.as_u64() {
            Some(original) if original >= 1 => original as usize,
            _ => {
                return Err(ConfigError(format!(
                    "rope scaling \"yarn\": `original_max_position_embeddings` must be a positive \
                     integer, found {value}"
                )))
            }
        },
    };
    if scaling.get("factor").is_none() {
        return Err(ConfigError(
            "rope scaling \"yarn\" needs a numeric `factor`".into(),
        ));
    }
    let factor = match number("factor")? {
        Some(factor) => factor,
        None => {
            let context = config
                .get("max_position_embeddings")
                .and_then(Value::as_u64)
                .unwrap_or(original as u64);
            context as f64 / original as f64
        }
    };
    if !(factor > 0.0 && factor.is_finite()) {
        return Err(ConfigError(format!(
            "rope scaling \"yarn\": `factor` must be a positive number, found {factor}"
        )));
    }
    let mscale = |scale: f64, m: f64| match scale <= 1.0 {
        true => 1.0,
        false => 0.1 * m * scale.ln() + 1.0,
    };
    let attention_factor = match (
        number("attention_factor")?,
        number("mscale")?,
        number("mscale_all_dim")?,
    ) {
        (Some(given), _, _) => given,
        (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
            mscale(factor, m) / mscale(factor, all)
        }
        _ => mscale(factor, 1.0),
    };
    let beta = |key: &str, default: f64| -> Result<f64, ConfigError> {
        Ok(number(key)?.filter(|beta| *beta != 0.0).unwrap_or(default))
    };
    let truncate = match scaling.get("truncate") {
        None => true,
        Some(Value::Null) => false,
        Some(value) => value.as_bool().ok_or_else(|| {
            ConfigError(format!(
                "rope scaling \"yarn\": `truncate` must be true or false, found {value}"
            ))
        })?,
    };
    Ok(RopeScaling::Yarn {
        factor,
        beta_fast: beta("beta_fast", 32.0)?,
        beta_slow: beta("beta_slow", 1.0)?,
        original_max_position_embeddings: original,
        truncate,
        attention_factor,
    })
}

/// A RoPE as transformers 5 writes it in `rope_parameters`.
pub(super) fn rope_json((theta, scaling): &Rope) -> Value {
    let mut json = match scaling {
        RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings,
            attention_factor,
        } => serde_json::json!({
            "rope_type": "longrope",
            "short_factor": short_factor,
            "long_factor": long_factor,
            "original_max_position_embeddings": original_max_position_embeddings,
            "attention_factor": attention_factor,
        }),
        RopeScaling::Yarn {
            factor,
            beta_fast,
            beta_slow,
            original_max_position_embeddings,
            truncate,
            attention_factor,
        } => serde_json::json!({
            "rope_type": "yarn",
            "factor": factor,
            "beta_fast": beta_fast,
            "beta_slow": beta_slow,
            "original_max_position_embeddings": original_max_position_embeddings,
            "truncate": truncate,
            "attention_factor": attention_factor,
        }),
        RopeScaling::None => serde_json::json!({"rope_type": "default"}),
        RopeScaling::Linear { factor } => {
            serde_json::json!({"rope_type": "linear", "factor": factor})
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => serde_json::json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_position_embeddings,
        }),
    };
    json["rope_theta"] = (*theta).into();
    json
}

/// The RoPE of the full-attention layers and, when it differs, of the windowed ones. transformers 5
/// folds base and scaling into `rope_parameters`, per layer type for Gemma 3 and OLMo 3
/// (`full_attention`, `sliding_attention`); transformers 4 keeps `rope_theta` and `rope_scaling` apart,
/// with Gemma 3's `rope_local_base_freq` beside them. Missing bases default as transformers' config
/// classes default them.
pub(super) fn ropes(arch: Arch, json: &Value) -> Result<(Rope, Option<Rope>), ConfigError> {
    let (global_default, local_default) = match arch {
        Arch::Gemma3 => (1_000_000.0, 10_000.0),
        Arch::Olmo3 => (500_000.0, 500_000.0),
        Arch::GptOss => (150_000.0, 150_000.0),
        _ => (10_000.0, 10_000.0),
    };
    let number = |value: Option<&Value>, key: &str, default: f64| -> Result<f64, ConfigError> {
        match value.filter(|value| !value.is_null()) {
            None => Ok(default),
            Some(value) => value
                .as_f64()
                .ok_or_else(|| ConfigError(format!("`{key}` must be a number, found {value}"))),
        }
    };
    let parameters = json.get("rope_parameters").filter(|value| !value.is_null());
    let per_type = parameters.filter(|parameters| {
        parameters.get("full_attention").is_some() || parameters.get("sliding_attention").is_some()
    });
    if let Some(per_type) = per_type {
        let rope = |kind: &str, default: f64| -> Result<Rope, ConfigError> {
            match per_type.get(kind).filter(|value| !value.is_null()) {
                None => Ok((default, RopeScaling::None)),
                Some(parameters) => Ok((
                    number(
                        parameters.get("rope_theta"),
                        &format!("rope_parameters.{kind}.rope_theta"),
                        default,
                    )?,
                    rope_scaling(parameters, json)?,
                )),
            }
        };
        let global = rope("full_attention", global_default)?;
        let local = rope("sliding_attention", local_default)?;
        return Ok((global.clone(), (local != global).then_some(local)));
    }
    let theta = match parameters.and_then(|parameters| parameters.get("rope_theta")) {
        Some(theta) => number(Some(theta), "rope_parameters.rope_theta", global_default)?,
        None => number(json.get("rope_theta"), "rope_theta", global_default)?,
    };
    let scaling = match parameters.or(json.get("rope_scaling").filter(|value| !value.is_null())) {
        None if arch == Arch::GptOss => gpt_oss_yarn(),
        None => RopeScaling::None,
        Some(scaling) => rope_scaling(scaling, json)?,
    };
    let local = match arch {
        Arch::Gemma3 => Some((
            number(
                json.get("rope_local_base_freq"),
                "rope_local_base_freq",
                local_default,
            )?,
            RopeScaling::None,
        )),
        // transformers 5 reads a transformers 4 `rope_theta` into the full-attention layers only.
        Arch::Olmo3 => Some((local_default, RopeScaling::None)),
        _ => None,
    };
    let global = (theta, scaling);
    Ok((global.clone(), local.filter(|local| *local != global)))
}

/// gpt-oss's RoPE when its config states none (`GptOssConfig.__post_init__`): YaRN over 32 times its
/// 4,096 original positions.
pub(crate) fn gpt_oss_yarn() -> RopeScaling {
    let scaling = serde_json::json!({
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": false,
        "original_max_position_embeddings": 4096,
    });
    // Every key yarn reads is in `scaling`, so no model config is consulted.
    rope_scaling(&scaling, &Value::Null).expect("gpt-oss's default YaRN is well-formed")
}

fn rope_scaling(scaling: &Value, config: &Value) -> Result<RopeScaling, ConfigError> {
    let kind = scaling
        .get("rope_type")
        .or_else(|| scaling.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let number = |key: &str| -> Result<f64, ConfigError> {
        scaling
            .get(key)
            .and_then(Value::as_f64)
            .ok_or_else(|| ConfigError(format!("rope scaling {kind:?} needs a numeric `{key}`")))
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: number("factor")?,
        }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: number("factor")?,
            low_freq_factor: number("low_freq_factor")?,
            high_freq_factor: number("high_freq_factor")?,
            original_max_position_embeddings: scaling
                .get("original_max_position_embeddings")
                .or_else(|| config.get("original_max_position_embeddings"))
                .and_then(Value::as_u64)
                .ok_or_else(|| {
                    ConfigError(
                        "rope scaling \"llama3\" needs `original_max_position_embeddings`".into(),
                    )
                })? as usize,
        }),
        "longrope" | "su" => {
            let factors = |key: &str| -> Result<Vec<f64>, ConfigError> {
                scaling
                    .get(key)
                    .and_then(Value::as_array)
                    .and_then(|values| values.iter().map(Value::as_f64).collect())
                    .ok_or_else(|| {
                        ConfigError(format!(
                            "rope scaling \"longrope\" needs a list of numbers `{key}`"
                        ))
                    })
            };
            let original = scaling
                .get("original_max_position_embeddings")
                .or_else(|| config.get("original_max_position_embeddings"))
                .and_then(Value::as_u64)
                .ok_or_else(|| {
                    ConfigError(
                        "rope scaling \"longrope\" needs `original_max_position_embeddings`".into(),
                    )
                })? as usize;
            // transformers' `_compute_longrope_parameters`: the factor is the context's growth, and
            // the attention factor, unless given, √(1 + ln factor / ln original).
            let max_positions = config
                .get("max_position_embeddings")
                .and_then(Value::as_u64)
                .unwrap_or(original as u64) as f64;
            let factor = scaling
                .get("factor")
                .and_then(Value::as_f64)
                .unwrap_or(max_positions / original as f64);
            let attention_factor = match scaling.get("attention_factor").and_then(Value::as_f64) {
                Some(given) => given,
                None if factor <= 1.0 => 1.0,
                None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
            };
            Ok(RopeScaling::LongRope {
                short_factor: factors("short_factor")?,
                long_factor: factors("long_factor")?,
                original_max_position_embeddings: original,
                attention_factor,
            })
        }
        "yarn" => yarn(scaling, config),
        other => Err(ConfigError(format!(
            "unsupported rope scaling type {other:?}; supported: default, linear, llama3, longrope, yarn"
        ))),
    }
}
