//! `holo gym`: a holoware as a NeMo Gym agent server (`POST /run`, `POST /aggregate_metrics`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use holo_runtime::engines::gym::{head, Columns, Environment, GymConfig, GymServer};
use holo_runtime::holophore::Holophore;
use holo_runtime::holotypes::CodeSandbox;
use holo_runtime::{OpenAi, OpenAiConfig};

use crate::{load, EXIT_FAILURES, EXIT_USAGE};

/// How a NeMo Gym row becomes the holoware's data row, for `holo gym --help`.
pub const ROWS_HELP: &str = "\
Rows (the body of POST /run):
  responses_create_params.input       the last user message's text (or input itself, a string) goes
                                      to the --input-column column (default `question`)
  responses_create_params.instructions
    and system/developer messages     go to the `system` column, joined by blank lines
  verifier_metadata.KEY               each key is a column (`expected`, ...); so is every other field
                                      of the row that is not NeMo Gym's own (agent_ref, _ng_*, ...)
  temperature, top_p                  replace the parameters of every sample of the rollout
  max_output_tokens                   caps every sample's max_tokens
A row the holoware cannot run (a missing input, a field of the wrong type) is answered 422 with
FastAPI's {\"detail\": [{\"loc\": [...], \"msg\": ...}]} naming the field; a policy that fails, 502
naming its URL; a holotype that fails, 500.

The answer: the row with `response` (a Responses API object: one assistant message per sampled turn
with prompt_token_ids, generation_token_ids and generation_log_probs exactly as sampled, and the
holoware's messages between turns), `reward` and `reward_components`. docs/scale-out.md has the NeMo
Gym configuration and commands.";

#[derive(Args)]
pub struct GymArgs {
    /// The environment.
    pub file: PathBuf,
    /// The port to serve on (the `port` of the agent's entry in the NeMo Gym configuration); 0 picks
    /// a free one (printed on stderr).
    #[arg(long)]
    pub port: u16,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// The policy: an OpenAI-compatible server (vLLM, SGLang, `holo serve`), `http://host:port` with
    /// or without `/v1`. Default: `policy_base_url` of the head server's configuration.
    #[arg(long)]
    pub policy_url: Option<String>,
    /// The policy's model folder (`tokenizer.json` and chat template): prompts are sent as token ids
    /// and every sampled token is recorded. Default: `policy_model_name` of the head server's
    /// configuration, when it is such a folder.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The model id the policy serves. Default: `policy_model_name` when the head server gave the
    /// policy, else --model as given (as vLLM and `holo serve` name it).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// NeMo Gym's head server, asked for the policy (GET /global_config_dict_yaml) when --policy-url
    /// or --model is not given.
    #[arg(long, default_value = "http://127.0.0.1:11000")]
    pub head_url: String,
    /// The column the last user message's text goes to.
    #[arg(long, default_value = "question")]
    pub input_column: String,
    /// The run seed; every rollout's seed is derived from it, `_ng_task_index` and
    /// `_ng_rollout_index`.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Requests to the policy in flight at once, over all rollouts.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub concurrency: u32,
    /// Retries of a failed policy request (connection refused, 5xx, timeout) before the rollout is
    /// answered 502.
    #[arg(long, default_value_t = 6)]
    pub policy_retries: u32,
    /// Seconds one policy request may take.
    #[arg(long, default_value_t = 600.0, value_parser = crate::serve::positive_seconds)]
    pub policy_timeout: f64,
    /// Seconds one rollout (a /run) may take; then it is answered 504.
    #[arg(long, default_value_t = 1800.0, value_parser = crate::serve::positive_seconds)]
    pub rollout_timeout: f64,
    /// Run model-written code (CodeExecutor) without a sandbox where this machine cannot sandbox it.
    #[arg(long)]
    pub allow_unsandboxed_code: bool,
}

/// The seconds the head server has to answer.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

pub fn run(args: GymArgs) -> ExitCode {
    let holoware = match load(&args.file) {
        Ok(holoware) => holoware,
        Err(code) => return code,
    };
    let mut resources = crate::resources();
    if let Err(code) = crate::prepare_rollouts(
        &holoware,
        &mut resources,
        CodeSandbox {
            allow_unsandboxed: args.allow_unsandboxed_code,
            ..CodeSandbox::default()
        },
    ) {
        return code;
    }
    let runtime = match crate::server_runtime() {
        Ok(runtime) => runtime,
        Err(code) => return code,
    };
    runtime.block_on(async move {
        let policy = match policy(&args).await {
            Ok(policy) => policy,
            Err(message) => return usage(message),
        };
        let holophore = match Holophore::from_dir(&policy.model_dir) {
            Ok(holophore) => holophore,
            Err(error) => {
                return usage(format!(
                    "{}: `{}`: {error}",
                    policy.model_from,
                    policy.model_dir.display()
                ))
            }
        };
        let sampler = match OpenAi::new(OpenAiConfig {
            max_concurrency: args.concurrency as usize,
            max_retries: args.policy_retries,
            request_timeout: Duration::from_secs_f64(args.policy_timeout),
            ..OpenAiConfig::new(policy.url.clone(), policy.model.clone())
        }) {
            Ok(sampler) => sampler,
            Err(error) => return usage(format!("{}: {error}", policy.url_from)),
        };
        let environment = Environment {
            holoware,
            resources,
            holophore,
            policy: Arc::new(sampler),
            policy_url: policy.url.clone(),
            model: policy.model.clone(),
        };
        let config = GymConfig {
            columns: Columns {
                input: args.input_column.clone(),
                ..Columns::default()
            },
            seed: args.seed,
            rollout_timeout: Duration::from_secs_f64(args.rollout_timeout),
            ..GymConfig::default()
        };
        let server =
            match GymServer::bind((args.host.as_str(), args.port), environment, config).await {
                Ok(server) => server,
                Err(error) => {
                    eprintln!(
                        "error: cannot listen on {}:{}: {error}",
                        args.host, args.port
                    );
                    return ExitCode::from(EXIT_FAILURES);
                }
            };
        eprintln!(
            "serving {} as a NeMo Gym agent on http://{} (POST /run, POST /aggregate_metrics); \
             policy `{}` at {} ({}); Ctrl-C stops",
            args.file.display(),
            server.local_addr(),
            policy.model,
            policy.url,
            policy.url_from,
        );
        match server.run().await {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("error: {error}");
                ExitCode::from(EXIT_FAILURES)
            }
        }
    })
}

/// Where the policy is and what it serves, and which option or configuration key said so.
struct Policy {
    url: String,
    url_from: String,
    model: String,
    model_dir: PathBuf,
    model_from: String,
}

/// The policy from the options, completed from the head server's configuration.
async fn policy(args: &GymArgs) -> Result<Policy, String> {
    let from_head = |key: &str| format!("{key} of the head server at {}", args.head_url);
    let head = if args.policy_url.is_none() || args.model.is_none() {
        let head = head::policy(&args.head_url, HEAD_TIMEOUT)
            .await
            .map_err(|message| {
                format!("{message} (it gives the policy when --policy-url or --model is not given)")
            })?;
        Some(head)
    } else {
        None
    };
    let (url, url_from) = match (&args.policy_url, &head) {
        (Some(url), _) => (url.clone(), "--policy-url".to_string()),
        (None, Some(head)) => (
            head.base_url.clone().ok_or_else(|| {
                format!(
                    "the head server at {} has no `policy_base_url`; give --policy-url",
                    args.head_url
                )
            })?,
            from_head("policy_base_url"),
        ),
        (None, None) => unreachable!("the head server is asked without --policy-url"),
    };
    let head_model = head.as_ref().and_then(|head| head.model_name.clone());
    let (model_dir, model_from) = match (&args.model, &head_model) {
        (Some(dir), _) => (dir.clone(), "--model".to_string()),
        (None, Some(name)) if PathBuf::from(name).join("tokenizer.json").is_file() => {
            (PathBuf::from(name), from_head("policy_model_name"))
        }
        (None, Some(name)) => {
            return Err(format!(
                "the policy `{name}` ({}) is not a model folder with a tokenizer.json here; give \
                 --model DIR (the policy's tokenizer and chat template)",
                from_head("policy_model_name")
            ))
        }
        (None, None) => {
            return Err(format!(
                "the head server at {} has no `policy_model_name`; give --model DIR",
                args.head_url
            ))
        }
    };
    let model = args
        .served_model_name
        .clone()
        .or(head_model)
        .unwrap_or_else(|| model_dir.display().to_string());
    Ok(Policy {
        url,
        url_from,
        model,
        model_dir,
        model_from,
    })
}

fn usage(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {message}");
    ExitCode::from(EXIT_USAGE)
}
