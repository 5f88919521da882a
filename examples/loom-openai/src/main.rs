//! An embedder's program: rolls a `.hol` file out over a data file against an OpenAI-compatible server
//! (vLLM, SGLang, llama.cpp, `holo serve`), writing each rollout as a line of JSONL on stdout and the
//! summary on stderr.
//!
//! ```text
//! cargo run -p loom-openai -- hol/qa.hol examples/data/capitals.jsonl http://127.0.0.1:8000 MODEL
//! ```
//!
//! Its point is what it leaves out: `holo-runtime` with `default-features = false` is the environments'
//! layer alone (holotypes, the interpreter, the Loom, the samplers over HTTP), without candle, the
//! trainers, the server or other engines' protocols; `.ci/run` builds it and checks that none of them is
//! in its dependency tree.

use std::error::Error;
use std::io;
use std::path::Path;
use std::sync::Arc;

use holo_runtime::holotypes::{self, Tools};
use holo_runtime::interpreter::{read_rows, Holoware};
use holo_runtime::loom::{Jsonl, Loom, LoomConfig};
use holo_runtime::{OpenAi, OpenAiConfig, Resources};

const USAGE: &str = "usage: loom-openai HOLOWARE DATA.jsonl BASE_URL MODEL";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [holoware, data, base_url, model] = args.as_slice() else {
        eprintln!("{USAGE}");
        std::process::exit(2);
    };
    if let Err(error) = run(Path::new(holoware), Path::new(data), base_url, model) {
        eprintln!("error: {error}");
        std::process::exit(1);
    }
}

fn run(holoware: &Path, data: &Path, base_url: &str, model: &str) -> Result<(), Box<dyn Error>> {
    let holoware = Holoware::open(holoware, Arc::new(holotypes::registry()))?;
    let mut rows = Vec::new();
    for (line, row) in read_rows(data)? {
        let row = row.map_err(|error| format!("{}:{line}: {error}", data.display()))?;
        holoware
            .check_row(&row)
            .map_err(|error| format!("{}:{line}: {error}", data.display()))?;
        rows.push((rows.len(), row));
    }
    let mut resources = Resources::default();
    resources.insert(Tools::new().with_calculator());
    holoware.check_holotypes(&resources)?;
    let loom = Loom::interpreted(Arc::new(holoware), resources, LoomConfig::default());
    let sampler = OpenAi::new(OpenAiConfig::new(base_url, model))?;
    let runtime = tokio::runtime::Runtime::new()?;
    let summary = runtime.block_on(loom.run(&rows, &sampler, &mut Jsonl(io::stdout())))?;
    eprintln!(
        "{} rollouts, mean reward {:?}",
        summary.rollouts, summary.mean_reward
    );
    Ok(())
}
