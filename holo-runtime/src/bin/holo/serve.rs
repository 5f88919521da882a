//! `holo serve`: a local model folder over an OpenAI-compatible HTTP API.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::{runtime, LocalArgs, EXIT_FAILURES, EXIT_USAGE};

pub fn run(
    model_dir: PathBuf,
    host: String,
    port: u16,
    max_batch: u32,
    batch_wait_ms: u64,
    served_model_name: Option<String>,
    local: LocalArgs,
) -> ExitCode {
    serve(
        &model_dir,
        &host,
        port,
        holo_runtime::serve::ServeConfig {
            max_batch: max_batch as usize,
            batch_wait: std::time::Duration::from_millis(batch_wait_ms),
            ..Default::default()
        },
        served_model_name,
        &local,
    )
}

/// `holo serve`: loads the model folder and serves it until the process is interrupted.
/// A folder without a chat template is served with ChatML for chat requests: say so, since a model
/// trained on another format would then see prompts it was not trained on.
fn note_builtin_template(dir: &Path, model: &holo_runtime::local::LocalModel) {
    if model.template().is_builtin() {
        eprintln!(
            "note: {} has no chat template (no `chat_template` in tokenizer_config.json, no \
             chat_template.jinja): chat requests are rendered with ChatML",
            dir.display()
        );
    }
}

fn serve(
    model_dir: &Path,
    host: &str,
    port: u16,
    config: holo_runtime::serve::ServeConfig,
    served_model_name: Option<String>,
    local: &LocalArgs,
) -> ExitCode {
    use holo_runtime::local::LocalModel;
    use holo_runtime::serve::{ServedModel, Server};

    let options = match local.options(config.max_batch) {
        Ok(options) => options,
        Err(code) => return code,
    };
    let model = match LocalModel::load(model_dir, options) {
        Ok(model) => model,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    note_builtin_template(model_dir, &model);
    let id = served_model_name.unwrap_or_else(|| model_dir.display().to_string());
    let served = ServedModel::local(id.clone(), model);
    let runtime = match runtime() {
        Ok(runtime) => runtime,
        Err(code) => return code,
    };
    runtime.block_on(async {
        let server = match Server::bind((host, port), served, config).await {
            Ok(server) => server,
            Err(error) => {
                eprintln!("error: cannot listen on {host}:{port}: {error}");
                return ExitCode::from(EXIT_FAILURES);
            }
        };
        eprintln!(
            "serving `{id}` on http://{} (OpenAI API under /v1); Ctrl-C stops",
            server.local_addr()
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
