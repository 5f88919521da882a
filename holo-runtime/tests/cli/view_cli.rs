//! `holo view` end to end, on the committed run fixture (`scripts/view_fixture.sh`: two GRPO steps of the
//! tiny Qwen2, with completed, truncated and failed rollouts, and evaluations): the page's data, its
//! default name, bad input, `--serve`, and the page itself rendered by a real browser (Debian's
//! `chromium`, headless; `scripts/install_chromium.sh` installs it; without it that test says it skipped).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use crate::common::tempdir::Dir;
use crate::common::{holo_command, repo};
use serde_json::Value;

fn fixtures() -> PathBuf {
    repo().join("holo-runtime/tests/fixtures")
}

fn run_fixture() -> PathBuf {
    fixtures().join("view/run")
}

fn model() -> PathBuf {
    fixtures().join("models/qwen2")
}

fn holo(args: &[&str]) -> Output {
    holo_command(args).output().unwrap()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// The records of a JSONL file, as the page numbers them (blank lines skipped).
fn records(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

/// The fixture's rollouts in the page's order: rollouts.jsonl, then eval_rollouts.jsonl.
fn fixture_rollouts() -> Vec<Value> {
    let mut all = records(&run_fixture().join("rollouts.jsonl"));
    all.extend(records(&run_fixture().join("eval_rollouts.jsonl")));
    all
}

fn status(record: &Value) -> &'static str {
    if !record["error"].is_null() {
        "failed"
    } else if record["truncated"] == true {
        "truncated"
    } else {
        "completed"
    }
}

fn trained_tokens(record: &Value) -> usize {
    record["contexts"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|context| context["tokens"]["loss_mask"].as_array())
        .flatten()
        .filter(|bit| *bit == 1)
        .count()
}

/// Writes the page of `path` (with `args`) into `out`, and returns the data the page embeds.
fn view(path: &Path, out: &Path, args: &[&str]) -> Value {
    let mut all = vec!["view", s(path), "--out", s(out)];
    all.extend_from_slice(args);
    let output = holo(&all);
    assert!(output.status.success(), "holo view: {}", stderr(&output));
    embedded(&std::fs::read_to_string(out).unwrap())
}

/// The JSON in the page's data element.
fn embedded(page: &str) -> Value {
    let open = "<script type=\"application/json\" id=\"holo-data\">";
    let start = page.find(open).expect("a data element") + open.len();
    let end = start + page[start..].find("</script>").unwrap();
    serde_json::from_str(&page[start..end]).unwrap()
}

#[test]
fn the_fixture_has_every_status_tokens_steps_and_metrics() {
    let rollouts = fixture_rollouts();
    for wanted in ["completed", "truncated", "failed"] {
        assert!(
            rollouts.iter().any(|record| status(record) == wanted),
            "no {wanted} rollout: rerun scripts/view_fixture.sh"
        );
    }
    assert!(rollouts.iter().all(|record| trained_tokens(record) > 0));
    assert!(records(&run_fixture().join("metrics.jsonl")).len() >= 2);
}

#[test]
fn a_run_folder_becomes_one_page_with_its_rollouts_metrics_and_token_texts() {
    let dir = Dir::new("view-run");
    let out = dir.path().join("page.html");
    let data = view(&run_fixture(), &out, &["--model", s(&model())]);
    let page = std::fs::read_to_string(&out).unwrap();
    let rollouts = data["rollouts"].as_array().unwrap();
    assert_eq!(rollouts.len(), fixture_rollouts().len());
    assert_eq!(
        data["files"],
        serde_json::json!(["rollouts.jsonl", "eval_rollouts.jsonl"])
    );
    assert_eq!(data["run_folder"], true);
    assert_eq!(
        data["metrics"].as_array().unwrap().len(),
        records(&run_fixture().join("metrics.jsonl")).len()
    );
    // Each token's text, decoded with the model's tokenizer: a context's texts joined are its text.
    let pieces: Vec<&str> = data["pieces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|piece| piece.as_str().unwrap())
        .collect();
    let first = &rollouts[0];
    let texts = first["texts"][0].as_array().unwrap();
    assert_eq!(
        texts.len(),
        first["contexts"][0]["tokens"]["ids"]
            .as_array()
            .unwrap()
            .len()
    );
    let joined: String = texts
        .iter()
        .map(|at| pieces[at.as_u64().unwrap() as usize])
        .collect();
    let question = first["row"]["question"].as_str().unwrap();
    assert!(joined.contains(question), "{joined:?} lacks {question:?}");
    assert!(data["ids_only"].is_null());
    assert_eq!(
        first["seed_text"],
        first["seed"].to_string(),
        "the seed, exact in JavaScript"
    );
    // Self-contained: nothing to fetch.
    for remote in ["<script src", "<link", "http://", "https://"] {
        assert!(!page.contains(remote), "the page refers to `{remote}`");
    }
}

#[test]
fn without_a_tokenizer_tokens_are_ids_and_the_page_says_why() {
    let dir = Dir::new("view-ids");
    let out = dir.path().join("page.html");
    let data = view(&run_fixture().join("rollouts.jsonl"), &out, &[]);
    assert!(data["pieces"].is_null());
    assert!(data["ids_only"].as_str().unwrap().contains("--model"));
    assert_eq!(data["run_folder"], false);
    assert!(data["metrics"].is_null());
}

/// The fixture's first step was sampled by the committed model itself, its second after an update:
/// under that model, the policy's log-probabilities equal the sampler's on the first and differ on the
/// second.
#[test]
fn the_policy_log_probabilities_match_the_sampler_where_it_sampled() {
    let dir = Dir::new("view-policy");
    let out = dir.path().join("page.html");
    let data = view(
        &run_fixture(),
        &out,
        &["--model", s(&model()), "--policy", s(&model())],
    );
    assert_eq!(data["policy"]["temperature"], 1.0, "the run's temperature");
    let files: Vec<&str> = data["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap())
        .collect();
    let (mut same, mut moved) = (0.0f64, 0.0f64);
    let mut compared = 0;
    for rollout in data["rollouts"].as_array().unwrap() {
        let first_weights = match (
            files[rollout["file"].as_u64().unwrap() as usize],
            rollout["step"].as_u64(),
        ) {
            ("rollouts.jsonl", Some(1)) | ("eval_rollouts.jsonl", Some(0)) => true,
            (_, Some(2)) => false,
            other => panic!("unexpected rollout {other:?}"),
        };
        for (context, policy) in rollout["contexts"]
            .as_array()
            .unwrap()
            .iter()
            .zip(rollout["policy"].as_array().unwrap())
        {
            let Some(policy) = policy.as_array() else {
                continue;
            };
            let tokens = &context["tokens"];
            let sampled: Vec<f64> = tokens["logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .zip(tokens["loss_mask"].as_array().unwrap())
                .filter(|(_, bit)| **bit == 1)
                .map(|(logprob, _)| logprob.as_f64().unwrap())
                .collect();
            assert_eq!(policy.len(), sampled.len(), "one value per trained token");
            for (policy, sampled) in policy.iter().zip(&sampled) {
                let difference = (policy.as_f64().unwrap() - sampled).abs();
                compared += 1;
                if first_weights {
                    same = same.max(difference);
                } else {
                    moved = moved.max(difference);
                }
            }
        }
    }
    assert!(compared > 200, "{compared} tokens compared");
    assert!(
        same < 1e-4,
        "the sampling weights give the sampler's log-probs: {same}"
    );
    assert!(moved > 1e-3, "after an update the policy differs: {moved}");
}

/// Rollouts of a constrained holoware (`train/constrained.hol`, by `holo eval` with the committed model):
/// under the same model the policy scores its constrained tokens under their masks, replayed as the
/// trainer replays them, so they equal the sampler's log-probabilities (over the whole vocabulary they
/// would be lower).
#[test]
fn the_policy_scores_constrained_tokens_under_their_masks() {
    let dir = Dir::new("view-constrained");
    let rollouts = dir.path().join("rollouts.jsonl");
    let output = holo(&[
        "eval",
        s(&fixtures().join("train/constrained.hol")),
        "--sampler",
        "local",
        "--model",
        s(&model()),
        "--data",
        s(&fixtures().join("train/rows.jsonl")),
        "-n",
        "2",
        "--out",
        s(&rollouts),
    ]);
    assert!(output.status.success(), "holo eval: {}", stderr(&output));
    let out = dir.path().join("page.html");
    let data = view(
        &rollouts,
        &out,
        &["--model", s(&model()), "--policy", s(&model())],
    );
    let mut compared = 0;
    for rollout in data["rollouts"].as_array().unwrap() {
        for (context, policy) in rollout["contexts"]
            .as_array()
            .unwrap()
            .iter()
            .zip(rollout["policy"].as_array().unwrap())
        {
            let tokens = &context["tokens"];
            assert!(!tokens["constraints"].as_array().unwrap().is_empty());
            let sampled = tokens["logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .zip(tokens["loss_mask"].as_array().unwrap())
                .filter(|(_, bit)| **bit == 1);
            for (policy, (sampled, _)) in policy.as_array().unwrap().iter().zip(sampled) {
                let difference = (policy.as_f64().unwrap() - sampled.as_f64().unwrap()).abs();
                assert!(difference < 1e-4, "{difference}");
                compared += 1;
            }
        }
    }
    assert!(compared > 50, "{compared} tokens compared");
}

#[test]
fn a_policy_that_cannot_load_is_a_usage_error_before_anything_is_written() {
    let dir = Dir::new("view-bad-policy");
    let out = dir.path().join("page.html");
    let missing = dir.path().join("no-model");
    let output = holo(&[
        "view",
        s(&run_fixture()),
        "--out",
        s(&out),
        "--policy",
        s(&missing),
    ]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert!(stderr(&output).contains("--policy"), "{}", stderr(&output));
    assert!(!out.exists());
}

#[test]
fn a_run_folder_decodes_tokens_with_the_model_its_run_json_names() {
    let dir = Dir::new("view-run-json");
    let run = dir.path().join("run");
    std::fs::create_dir(&run).unwrap();
    for file in ["rollouts.jsonl", "metrics.jsonl"] {
        std::fs::copy(run_fixture().join(file), run.join(file)).unwrap();
    }
    let run_json = |model: &Path| {
        let info = serde_json::json!({ "model": model.canonicalize().unwrap_or(model.into()) });
        std::fs::write(run.join("run.json"), info.to_string()).unwrap();
    };
    run_json(&model());
    let out = dir.path().join("page.html");
    let data = view(&run, &out, &[]);
    assert!(data["pieces"].is_array(), "{}", data["ids_only"]);
    run_json(&dir.path().join("gone"));
    let output = holo(&["view", s(&run), "--out", s(&out)]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("tokens are shown as ids"),
        "{}",
        stderr(&output)
    );
    assert!(embedded(&std::fs::read_to_string(&out).unwrap())["pieces"].is_null());
}

#[test]
fn the_default_output_is_path_dot_html() {
    let dir = Dir::new("view-default");
    let file = dir.path().join("rollouts.jsonl");
    std::fs::copy(run_fixture().join("rollouts.jsonl"), &file).unwrap();
    let output = holo(&["view", s(&file)]);
    assert!(output.status.success(), "{}", stderr(&output));
    let page = dir.path().join("rollouts.jsonl.html");
    assert!(stderr(&output).contains(s(&page)), "{}", stderr(&output));
    assert!(embedded(&std::fs::read_to_string(page).unwrap())["rollouts"].is_array());
}

#[test]
fn lines_that_are_not_rollouts_are_named_skipped_and_counted_in_the_page() {
    let dir = Dir::new("view-bad");
    let file = dir.path().join("mixed.jsonl");
    let good = std::fs::read_to_string(run_fixture().join("rollouts.jsonl")).unwrap();
    let mut lines: Vec<&str> = good.lines().take(3).collect();
    lines.insert(1, "{\"row_index\": 1}");
    lines.insert(3, "not json");
    std::fs::write(&file, lines.join("\n")).unwrap();
    let out = dir.path().join("page.html");
    let mut command = holo_command(&["view", s(&file), "--out", s(&out)]);
    let output = command.output().unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    let err = stderr(&output);
    assert!(
        err.contains(":2: column") && err.contains(":4: column"),
        "{err}"
    );
    assert!(err.contains("2 lines skipped"), "{err}");
    let data = embedded(&std::fs::read_to_string(&out).unwrap());
    assert_eq!(data["rollouts"].as_array().unwrap().len(), 3);
    let skipped: Vec<u64> = data["skipped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|skipped| skipped["line"].as_u64().unwrap())
        .collect();
    assert_eq!(skipped, [2, 4]);
    let lines: Vec<u64> = data["rollouts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|rollout| rollout["line"].as_u64().unwrap())
        .collect();
    assert_eq!(lines, [1, 3, 5]);
}

#[test]
fn nothing_to_show_is_a_usage_error_and_an_unwritable_page_a_failure() {
    let dir = Dir::new("view-errors");
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "\n\n").unwrap();
    let junk = dir.path().join("junk.jsonl");
    std::fs::write(&junk, "[1]\n{}\n").unwrap();
    let cases = [
        (empty.clone(), "is empty"),
        (junk.clone(), "none of the 2 lines"),
        (dir.path().join("missing.jsonl"), "no such file"),
        (dir.path().to_path_buf(), "run folder"),
    ];
    for (path, message) in cases {
        let output = holo(&["view", s(&path)]);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{path:?}: {}",
            stderr(&output)
        );
        assert!(
            stderr(&output).contains(message),
            "{path:?}: {}",
            stderr(&output)
        );
    }
    assert!(
        !dir.path().join("empty.jsonl.html").exists(),
        "no blank page"
    );
    let unwritable = dir.path().join("no/such/folder/page.html");
    let output = holo(&["view", s(&run_fixture()), "--out", s(&unwritable)]);
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("cannot write"),
        "{}",
        stderr(&output)
    );
    let output = holo(&["view", s(&run_fixture()), "--model", s(dir.path())]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert!(stderr(&output).contains("--model"), "{}", stderr(&output));
}

/// One HTTP/1.1 GET on a fresh connection: the status line and the body.
fn get(address: &str, path: &str) -> (String, String) {
    let mut stream = TcpStream::connect(address).unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nhost: {address}\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_string(), body.to_string())
}

#[test]
fn serve_answers_with_the_same_page_on_loopback() {
    let dir = Dir::new("view-serve");
    let out = dir.path().join("page.html");
    view(&run_fixture(), &out, &["--model", s(&model())]);
    let mut child = holo_command(&["view", s(&run_fixture()), "--model", s(&model()), "--serve"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The address is printed once the listener is bound (EOF, and a failed test, if it exits first).
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let served = (|| {
        let address = line.trim().strip_prefix("http://")?.strip_suffix('/')?;
        assert!(address.starts_with("127.0.0.1:"), "{line}");
        Some((get(address, "/"), get(address, "/other")))
    })();
    child.kill().unwrap();
    child.wait().unwrap();
    let ((status, body), (missing, _)) = served.unwrap_or_else(|| panic!("printed {line:?}"));
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(
        body == std::fs::read_to_string(&out).unwrap(),
        "served page differs from the written one"
    );
    assert_eq!(missing, "HTTP/1.1 404 Not Found");
}

/// Headless chromium on `page#fragment`, with its own profile folder in `dir`; `extra` is `--dump-dom`
/// or `--screenshot=FILE`. Bounded: `--virtual-time-budget` ends the page's time once it is idle, and
/// `timeout` ends a browser that hangs.
fn browse(chromium: &Path, dir: &Path, page: &Path, fragment: &str, extra: &str) -> Output {
    let output = Command::new("timeout")
        .arg("120")
        .arg(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--hide-scrollbars",
            "--window-size=1400,1600",
            "--virtual-time-budget=5000",
        ])
        .arg(format!("--user-data-dir={}", dir.join("profile").display()))
        .arg(extra)
        .arg(format!("file://{}#{fragment}", page.display()))
        .output()
        .unwrap();
    assert!(output.status.success(), "chromium: {}", stderr(&output));
    output
}

/// The rendered document up to its scripts (whose source would match what the tests look for).
fn dump(chromium: &Path, dir: &Path, page: &Path, fragment: &str) -> String {
    let mut dom =
        String::from_utf8(browse(chromium, dir, page, fragment, "--dump-dom").stdout).unwrap();
    let scripts = dom
        .find("<script")
        .unwrap_or_else(|| panic!("no page in {dom:.2000}"));
    dom.truncate(scripts);
    assert!(dom.contains("id=\"list-items\""), "no page in {dom:.2000}");
    dom
}

/// The values of `attribute` on the elements whose class attribute starts with `class`, in order.
fn attribute_values(dom: &str, class: &str, attribute: &str) -> Vec<String> {
    let open = format!("class=\"{class}");
    dom.match_indices(&open)
        .map(|(at, _)| {
            let tag_end = at + dom[at..].find('>').unwrap();
            let tag = &dom[at..tag_end];
            let key = format!("{attribute}=\"");
            let start = tag
                .find(&key)
                .unwrap_or_else(|| panic!("no {attribute} in {tag}"))
                + key.len();
            tag[start..start + tag[start..].find('"').unwrap()].to_string()
        })
        .collect()
}

/// `text` as the browser serializes it in an element.
fn html_text(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The text of the element with id `id` (no nested elements).
fn text_of<'a>(dom: &'a str, id: &str) -> &'a str {
    let open = format!("id=\"{id}\"");
    let start = dom.find(&open).unwrap();
    let start = start + dom[start..].find('>').unwrap() + 1;
    &dom[start..start + dom[start..].find('<').unwrap()]
}

#[test]
fn chromium_renders_the_page_lists_highlights_and_filters() {
    let Some(chromium) = crate::common::components::chromium() else {
        return;
    };
    let dir = Dir::new("view-chromium");
    let page = dir.path().join("run.html");
    view(&run_fixture(), &page, &["--model", s(&model())]);
    let rollouts = fixture_rollouts();
    let total = rollouts.len();

    // Unfiltered: every rollout is listed (the fixture fits one screen), in file order.
    let dom = dump(&chromium, dir.path(), &page, "");
    let listed = attribute_values(&dom, "item", "data-i");
    assert_eq!(
        listed,
        (0..total).map(|i| i.to_string()).collect::<Vec<_>>()
    );
    assert_eq!(
        text_of(&dom, "count"),
        format!("{total} of {total} rollouts")
    );

    // The filter read from the fragment: only the failed rollouts.
    let failed: Vec<String> = (0..total)
        .filter(|&i| status(&rollouts[i]) == "failed")
        .map(|i| i.to_string())
        .collect();
    let dom = dump(&chromium, dir.path(), &page, "status=failed");
    assert_eq!(attribute_values(&dom, "item", "data-i"), failed);
    assert!(attribute_values(&dom, "item", "data-status")
        .iter()
        .all(|status| status == "failed"));
    assert_eq!(
        text_of(&dom, "count"),
        format!("{} of {total} rollouts", failed.len())
    );

    // A selected failed rollout: its error, and its trained tokens one by one, highlighted.
    let selected = &failed[0];
    let record = &rollouts[selected.parse::<usize>().unwrap()];
    let dom = dump(
        &chromium,
        dir.path(),
        &page,
        &format!("status=failed&sel={selected}"),
    );
    let message = record["error"]["message"].as_str().unwrap();
    assert!(dom.contains("class=\"error\""), "no error shown");
    assert!(dom.contains(&html_text(message)), "{message} not shown");
    let trained = attribute_values(&dom, "tok trained", "data-k");
    assert_eq!(trained.len(), trained_tokens(record));
    assert!(dom.contains("class=\"item selected\""));
    assert!(
        dom.contains(&format!("seed {}", record["seed"])),
        "the seed, exactly"
    );

    // The search and the reward sort: the completed rollouts of one eval question, best first.
    let question = rollouts.last().unwrap()["row"]["question"]
        .as_str()
        .unwrap();
    let fragment = format!(
        "q={}&sort=reward-desc",
        question.replace(' ', "%20").replace('+', "%2B")
    );
    let dom = dump(&chromium, dir.path(), &page, &fragment);
    let found: Vec<usize> = attribute_values(&dom, "item", "data-i")
        .iter()
        .map(|i| i.parse().unwrap())
        .collect();
    let want = rollouts
        .iter()
        .filter(|record| record["row"]["question"] == question)
        .count();
    assert_eq!(found.len(), want, "{fragment}");
    let rewards: Vec<f64> = found
        .iter()
        .map(|&i| rollouts[i]["reward"].as_f64().unwrap())
        .collect();
    assert!(
        rewards.windows(2).all(|pair| pair[0] >= pair[1]),
        "{rewards:?}"
    );

    // The selected rollout's group side by side: the rollouts of its file's row at its step.
    let dom = dump(
        &chromium,
        dir.path(),
        &page,
        &format!("sel={selected}&group=1"),
    );
    let group = records(&run_fixture().join("rollouts.jsonl"))
        .iter()
        .filter(|other| {
            other["row_index"] == record["row_index"] && other["step"] == record["step"]
        })
        .count();
    assert!(group > 1);
    assert_eq!(dom.matches("<div class=\"member").count(), group);

    // The completions of one training step.
    let dom = dump(&chromium, dir.path(), &page, "tab=steps&at=2");
    let at_step_2 = records(&run_fixture().join("rollouts.jsonl"))
        .iter()
        .filter(|record| record["step"] == 2)
        .count();
    assert!(at_step_2 > 0);
    assert_eq!(dom.matches("<tr data-i=").count(), at_step_2);

    // A run folder's metric curves, one chart per numeric metric.
    let dom = dump(&chromium, dir.path(), &page, "tab=metrics");
    let charts = attribute_values(&dom, "chart", "data-metric");
    assert!(charts.iter().any(|name| name == "loss"), "{charts:?}");
    assert!(
        charts.iter().any(|name| name == "eval/reward"),
        "{charts:?}"
    );

    // A line that is not a record: counted on the page, not a blank page.
    let mixed = dir.path().join("mixed.jsonl");
    let good = std::fs::read_to_string(run_fixture().join("rollouts.jsonl")).unwrap();
    std::fs::write(&mixed, format!("{good}{{\"truncated\": true\n")).unwrap();
    let mixed_page = dir.path().join("mixed.html");
    view(&mixed, &mixed_page, &[]);
    let dom = dump(&chromium, dir.path(), &mixed_page, "");
    assert!(
        dom.contains("1 line skipped (not records)"),
        "no count of skipped lines"
    );
    assert!(
        dom.contains("Tokens are shown as ids"),
        "no word on the missing tokenizer"
    );
    let ids = attribute_values(&dom, "item", "data-i");
    assert_eq!(
        ids.len(),
        records(&run_fixture().join("rollouts.jsonl")).len()
    );

    // The screenshot, for a person to look at: the failed rollout's tokens.
    let screenshot = dir.path().join("failed.png");
    browse(
        &chromium,
        dir.path(),
        &page,
        &format!("status=failed&sel={selected}"),
        &format!("--screenshot={}", screenshot.display()),
    );
    let png = std::fs::read(&screenshot).unwrap();
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    eprintln!("screenshot: {} ({} bytes)", screenshot.display(), png.len());
}
