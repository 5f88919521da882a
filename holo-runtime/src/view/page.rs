//! The page: one self-contained HTML file, its style, script and data inlined.
//!
//! The data is one JSON object in a `<script type="application/json">` element, which the script parses
//! once. Every `<` in it is written `\u003c` (the same string to a JSON parser), so no text in a rollout
//! (`</script>`, `<!--`) can end the element early.

use std::collections::HashMap;

use serde::Serialize;
use serde_json::{Map, Value};
use tokenizers::Tokenizer;

use super::data::{Skipped, Source};
use crate::holophore::token_texts;
use crate::loom::RolloutRecord;

const TEMPLATE: &str = include_str!("page.html");
const STYLE: &str = include_str!("style.css");
const SCRIPT: &str = include_str!("script.js");

/// How the page shows token ids.
pub enum Tokens<'a> {
    /// As their text, decoded with this tokenizer (the one the rollouts were recorded with).
    Decoded(&'a Tokenizer),
    /// As ids only, with the reason shown in the page.
    IdsOnly(String),
}

/// The log-probabilities of the trained tokens under a policy model, which tooltips show beside the
/// sampler's ([`super::policy`]).
pub struct Policy {
    /// What the page calls the model: its path.
    pub name: String,
    pub temperature: f64,
    /// Per rollout of the source (its files in order, each file's rollouts in order), per context: the
    /// trained tokens' log-probabilities in order, `None` for a context without trained tokens.
    pub logprobs: Vec<Vec<Option<Vec<f32>>>>,
}

/// What the page says of the policy.
#[derive(Serialize)]
struct PolicyInfo<'a> {
    name: &'a str,
    temperature: f64,
}

/// The JSON the script reads.
#[derive(Serialize)]
struct Data<'a> {
    title: String,
    run_folder: bool,
    files: Vec<&'a str>,
    rollouts: Vec<PageRollout<'a>>,
    skipped: &'a [Skipped],
    metrics: Option<&'a [Map<String, Value>]>,
    /// Distinct token texts; `texts` of each rollout indexes into it. `None` without a tokenizer.
    pieces: Option<Vec<String>>,
    /// Why tokens are shown as ids, when they are.
    ids_only: Option<String>,
    policy: Option<PolicyInfo<'a>>,
}

#[derive(Serialize)]
struct PageRollout<'a> {
    /// Index into `files`.
    file: usize,
    line: usize,
    #[serde(flatten)]
    record: &'a RolloutRecord,
    /// The seed in decimal: a u64 is past the integers a JavaScript number holds exactly.
    seed_text: String,
    /// Per context, its tokens' texts as indices into `pieces` (`null` for a context without tokens).
    #[serde(skip_serializing_if = "Option::is_none")]
    texts: Option<Vec<Option<Vec<u32>>>>,
    /// Per context, the policy's log-probability of each trained token ([`Policy`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    policy: Option<&'a [Option<Vec<f32>>]>,
}

/// Token texts interned: the page carries each distinct text once however often it occurs, and each
/// token as an index.
#[derive(Default)]
struct Pieces {
    table: Vec<String>,
    index: HashMap<String, u32>,
}

impl Pieces {
    fn intern(&mut self, text: String) -> u32 {
        if let Some(&at) = self.index.get(&text) {
            return at;
        }
        let at = self.table.len() as u32;
        self.table.push(text.clone());
        self.index.insert(text, at);
        at
    }

    /// Each context's token texts ([`token_texts`]: decoded incrementally, so a character split over
    /// two tokens shows once, whole).
    fn contexts(&mut self, tokenizer: &Tokenizer, record: &RolloutRecord) -> Vec<Option<Vec<u32>>> {
        record
            .contexts
            .iter()
            .map(|context| {
                let tokens = context.tokens.as_ref()?;
                let texts = token_texts(tokenizer, &tokens.ids);
                Some(texts.into_iter().map(|text| self.intern(text)).collect())
            })
            .collect()
    }
}

/// The page for `source`: the HTML, ready to write or serve; with `policy`, tooltips show its
/// log-probabilities too.
pub fn render(source: &Source, tokens: &Tokens<'_>, policy: Option<&Policy>) -> String {
    let mut pieces = Pieces::default();
    let mut rollouts = Vec::with_capacity(source.rollout_count());
    for (file, rollouts_file) in source.files.iter().enumerate() {
        for rollout in &rollouts_file.rollouts {
            let texts = match tokens {
                Tokens::Decoded(tokenizer) => Some(pieces.contexts(tokenizer, &rollout.record)),
                Tokens::IdsOnly(_) => None,
            };
            let policy = policy
                .and_then(|policy| policy.logprobs.get(rollouts.len()))
                .map(Vec::as_slice);
            rollouts.push(PageRollout {
                file,
                line: rollout.line,
                record: &rollout.record,
                seed_text: rollout.record.seed.to_string(),
                texts,
                policy,
            });
        }
    }
    let data = Data {
        title: source.path.display().to_string(),
        run_folder: source.is_run_folder(),
        files: source.files.iter().map(|file| file.name.as_str()).collect(),
        rollouts,
        skipped: &source.skipped,
        metrics: source.metrics.as_deref(),
        pieces: matches!(tokens, Tokens::Decoded(_)).then_some(pieces.table),
        ids_only: match tokens {
            Tokens::Decoded(_) => None,
            Tokens::IdsOnly(reason) => Some(reason.clone()),
        },
        policy: policy.map(|policy| PolicyInfo {
            name: &policy.name,
            temperature: policy.temperature,
        }),
    };
    let json = serde_json::to_string(&data).expect("page data is plain JSON");
    fill(&script_safe(&json))
}

/// JSON text that can sit inside a `<script>` element: `<` written as the escape `\u003c`, which is only
/// legal (and only needed) inside JSON strings, where it means the same character.
fn script_safe(json: &str) -> String {
    json.replace('<', "\\u003c")
}

/// The template with the style, script and data in their places. The data goes in last, so that nothing
/// in it is read as a placeholder.
fn fill(data: &str) -> String {
    TEMPLATE
        .replacen("/*{{style}}*/", STYLE, 1)
        .replacen("/*{{script}}*/", SCRIPT, 1)
        .replacen("{{data}}", data, 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::fixtures::{record, rollouts};
    use crate::view::data::RolloutsFile;

    fn source(records: Vec<RolloutRecord>) -> Source {
        Source {
            path: "rollouts.jsonl".into(),
            files: vec![RolloutsFile {
                name: "rollouts.jsonl".into(),
                rollouts: rollouts(records),
            }],
            metrics: None,
            skipped: Vec::new(),
        }
    }

    /// The JSON between the data element's tags.
    fn embedded(page: &str) -> &str {
        let start = page.find("id=\"holo-data\">").unwrap() + "id=\"holo-data\">".len();
        &page[start..start + page[start..].find("</script>").unwrap()]
    }

    #[test]
    fn text_that_would_close_the_script_stays_inside_the_data() {
        let answer = "</script><script>alert(1)</script><!--";
        let page = render(
            &source(vec![record(0, 0, 1.0, answer)]),
            &Tokens::IdsOnly("no tokenizer".into()),
            None,
        );
        let json = embedded(&page);
        assert!(!json.contains('<'), "{json}");
        let data: Value = serde_json::from_str(json).unwrap();
        let sampled = &data["rollouts"][0]["contexts"][0]["messages"][1]["parts"][0]["text"];
        assert_eq!(sampled, answer);
    }

    #[test]
    fn the_page_is_self_contained() {
        let page = render(
            &source(vec![record(0, 0, 1.0, "42")]),
            &Tokens::IdsOnly("no tokenizer".into()),
            None,
        );
        for placeholder in ["{{style}}", "{{script}}", "{{data}}"] {
            assert!(!page.contains(placeholder), "{placeholder} left");
        }
        for remote in ["src=", "href=\"http", "@import", "url("] {
            assert!(!page.contains(remote), "the page loads `{remote}`");
        }
    }

    #[test]
    fn token_texts_are_interned_once() {
        let mut pieces = Pieces::default();
        let texts: Vec<u32> = ["a", "b", "a", "a"]
            .into_iter()
            .map(|text| pieces.intern(text.into()))
            .collect();
        assert_eq!(texts, [0, 1, 0, 0]);
        assert_eq!(pieces.table, ["a", "b"]);
    }
}
