//! `GET /metrics`: the server's counters and the scheduler's state in Prometheus' text format (0.0.4).

use std::fmt::Write as _;

use axum::http::header;

use super::*;

/// The metrics page: the server's own counters for any sampler, and the local model's scheduler (queue,
/// batch, keys and values, tokens) when the sampler is one.
pub(super) async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let mut page = Page::default();
    let counters = &state.counters;
    page.family(
        "holo_requests_total",
        "counter",
        "HTTP requests answered, by status.",
    );
    for (status, count) in counters.requests() {
        page.sample(
            "holo_requests_total",
            &format!("{{status=\"{status}\"}}"),
            count as f64,
        );
    }
    page.single(
        "holo_prompt_tokens_total",
        "counter",
        "Prompt tokens of the answered requests (each prompt once, as `usage` counts them).",
        counters.prompt_tokens() as f64,
    );
    page.single(
        "holo_generation_tokens_total",
        "counter",
        "Tokens sampled for the answered requests.",
        counters.completion_tokens() as f64,
    );
    let times = counters.times();
    page.family(
        "holo_request_queue_seconds",
        "summary",
        "Time from a request's arrival until the sampler started it (samplers that say when).",
    );
    page.sample("holo_request_queue_seconds_sum", "", times.queue_seconds);
    page.sample("holo_request_queue_seconds_count", "", times.queued as f64);
    page.family(
        "holo_request_duration_seconds",
        "summary",
        "Time from a request's arrival until its response was sent.",
    );
    page.sample("holo_request_duration_seconds_sum", "", times.total_seconds);
    page.sample(
        "holo_request_duration_seconds_count",
        "",
        times.requests as f64,
    );
    page.single(
        "holo_open_connections",
        "gauge",
        "HTTP connections open now.",
        state.connections.open() as f64,
    );
    page.family(
        "holo_weight_version",
        "gauge",
        "The version of the weights each served model samples with (the base: 0, then one more per \
         replacement; an adapter: its loads under that name).",
    );
    for (model, version) in state.weights.versions() {
        let model = model.replace('\\', "\\\\").replace('"', "\\\"");
        page.sample(
            "holo_weight_version",
            &format!("{{model=\"{model}\"}}"),
            version as f64,
        );
    }
    let scheduler = state
        .weights
        .scheduler()
        .or_else(|| state.scheduler.clone());
    if let Some(stats) = &scheduler {
        page.single(
            "holo_num_requests_waiting",
            "gauge",
            "Sequences queued for the batch, not admitted yet.",
            stats.waiting() as f64,
        );
        page.single(
            "holo_num_requests_running",
            "gauge",
            "Sequences in the batch (prefilling or decoding).",
            stats.running() as f64,
        );
        page.single(
            "holo_kv_cache_bytes",
            "gauge",
            "Bytes the running batch's caches hold: keys and values, and linear-attention states.",
            stats.kv_bytes() as f64,
        );
        page.single(
            "holo_scheduler_generated_tokens_total",
            "counter",
            "Tokens the scheduler has sampled (requests in flight included).",
            stats.generated_tokens() as f64,
        );
        page.single(
            "holo_scheduler_prefilled_tokens_total",
            "counter",
            "Prompt tokens the model has run: a prompt prefilled once for the n samples of a request \
             counts once, tokens read from the prefix cache not at all.",
            stats.prefilled_tokens() as f64,
        );
        page.single(
            "holo_generation_tokens_per_second",
            "gauge",
            "Tokens sampled per second over the scheduler's last second of work (0 when idle).",
            stats.tokens_per_second(),
        );
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        page.text,
    )
        .into_response()
}

#[derive(Default)]
struct Page {
    text: String,
}

impl Page {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.text, "# HELP {name} {help}");
        let _ = writeln!(self.text, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &str, value: f64) {
        let _ = writeln!(self.text, "{name}{labels} {value}");
    }

    fn single(&mut self, name: &str, kind: &str, help: &str, value: f64) {
        self.family(name, kind, help);
        self.sample(name, "", value);
    }
}
