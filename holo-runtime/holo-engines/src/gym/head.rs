//! The policy's address from NeMo Gym's head server: `GET /global_config_dict_yaml` answers the run's
//! global configuration as a JSON string holding YAML (OmegaConf's `to_yaml`), whose top-level
//! `policy_base_url` and `policy_model_name` name the OpenAI-compatible server the rollouts sample
//! from (NeMo RL points them at its vLLM servers).

use std::collections::BTreeMap;
use std::time::Duration;

/// What the head server says of the policy.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Policy {
    pub base_url: Option<String>,
    pub model_name: Option<String>,
}

/// Reads the policy's address from the head server at `head_url` (`http://host:port`), waiting at
/// most `timeout` for its answer.
pub async fn policy(head_url: &str, timeout: Duration) -> Result<Policy, String> {
    let url = format!("{}/global_config_dict_yaml", head_url.trim_end_matches('/'));
    let failed = |message: String| format!("the NeMo Gym head server at {url}: {message}");
    let client = reqwest::Client::builder()
        .timeout(timeout)
        .connect_timeout(timeout)
        .no_proxy()
        .build()
        .map_err(|error| failed(format!("cannot build an HTTP client: {error}")))?;
    let answer = client
        .get(&url)
        .send()
        .await
        .map_err(|error| failed(format!("cannot reach it ({})", chain(&error))))?;
    let status = answer.status();
    let body = answer
        .text()
        .await
        .map_err(|error| failed(format!("its answer was cut short ({error})")))?;
    if !status.is_success() {
        return Err(failed(format!("answered {status}: {body}")));
    }
    let yaml: String = serde_json::from_str(&body)
        .map_err(|error| failed(format!("the answer is not a JSON string ({error})")))?;
    let scalars = top_level_scalars(&yaml);
    let take = |key: &str| -> Result<Option<String>, String> {
        match scalars.get(key) {
            None | Some(Ok(None)) => Ok(None),
            Some(Ok(Some(value))) => Ok(Some(value.clone())),
            Some(Err(message)) => Err(failed(format!("`{key}`: {message}"))),
        }
    };
    Ok(Policy {
        base_url: take("policy_base_url")?,
        model_name: take("policy_model_name")?,
    })
}

/// The top-level `key: value` entries of a YAML document as OmegaConf writes them: each value a plain,
/// single-quoted or double-quoted scalar (`null` and `~` read as `None`), or an error for values that
/// are not one line of text (nested mappings, lists, block scalars).
pub fn top_level_scalars(yaml: &str) -> BTreeMap<String, Result<Option<String>, String>> {
    let mut entries = BTreeMap::new();
    for line in yaml.lines() {
        if line.starts_with([' ', '\t', '-', '#']) || line.trim().is_empty() {
            continue;
        }
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        let scalar = if value.is_empty() {
            Err("is a mapping or a list, not a string".to_string())
        } else if let Some(quoted) = value.strip_prefix('\'') {
            quoted
                .strip_suffix('\'')
                .map(|inner| Some(inner.replace("''", "'")))
                .ok_or_else(|| format!("unterminated quoted value {value}"))
        } else if value.starts_with('"') {
            serde_json::from_str::<String>(value)
                .map(Some)
                .map_err(|_| format!("a double-quoted value this reader cannot read: {value}"))
        } else if value.starts_with(['|', '>', '[', '{', '&', '*', '!']) {
            Err(format!("`{value}` is not a one-line string"))
        } else if matches!(value, "null" | "~") {
            Ok(None)
        } else {
            Ok(Some(value.to_string()))
        };
        entries.insert(key.trim().to_string(), scalar);
    }
    entries
}

fn chain(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_top_level_scalars_omegaconf_writes() {
        // As the head server of nemo-gym 0.7.0 wrote it for a test configuration.
        let yaml = "head_server:\n  host: 127.0.0.1\n  port: 18911\npolicy_base_url: http://127.0.0.1:18912/v1\n\
                    policy_api_key: dummy\npolicy_model_name: /tmp/some model:x/tiny\nquoted: 'it''s'\n\
                    number_text: '123'\nescaped: \"a\\tb\"\nnothing: null\nholo_agent:\n  responses_api_agents:\n\
                    config_paths:\n- cfg.yaml\nblock: |\n  text\n";
        let scalars = top_level_scalars(yaml);
        let value = |key: &str| scalars[key].clone();
        assert_eq!(
            value("policy_base_url"),
            Ok(Some("http://127.0.0.1:18912/v1".into()))
        );
        assert_eq!(
            value("policy_model_name"),
            Ok(Some("/tmp/some model:x/tiny".into()))
        );
        assert_eq!(value("quoted"), Ok(Some("it's".into())));
        assert_eq!(value("number_text"), Ok(Some("123".into())));
        assert_eq!(value("escaped"), Ok(Some("a\tb".into())));
        assert_eq!(value("nothing"), Ok(None));
        assert!(value("holo_agent").is_err());
        assert!(value("block").is_err());
        assert!(!scalars.contains_key("host"));
    }
}
