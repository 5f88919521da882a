//! What the editor knows of holotypes and sampler arguments: the built-ins' documentation, and the
//! parameters of a document's holotypes (the crate's own, found by the scan, or the runtime's).

use super::Document;

/// The runtime's built-in holotypes: what each does, and its parameters with their defaults
/// (docs/holoware.md, section 3.8).
pub(crate) const BUILTIN_DOCS: &[(&str, &str, &str)] = &[
    (
        "ToolRunner",
        "Repeats its body until the model gives an answer or `max_turns` turns have passed.",
        "`max_turns` (8), `var` (`turn`), `answer` (`answer`)",
    ),
    (
        "ToolSchema",
        "Writes the JSON schemas of the environment's registered tools; with `parser=`, offers them to \
         the model's chat template as `tools` instead (native tool calls).",
        "`parser` (none: text tools; `auto`: the template's format, or `hermes`, `llama3_json`, `mistral`, `openai`)",
    ),
    (
        "ToolExecutor",
        "Runs the tool call found in the turn's variable and writes the result, or the error, inside \
         `<result>` tags; with native tools, runs every call of the turn and appends each result as a \
         `tool` message.",
        "`answer` (`answer`); one positional word, the variable of the turn (`turn`)",
    ),
    (
        "CodeExecutor",
        "Runs the code of the last `<code>` block of the turn in a sandbox (own namespaces, an \
         unprivileged user, a read-only view of the system, no network, resource limits, a timeout) and \
         writes what it printed inside `<output>` tags.",
        "`timeout` (5), `python` (`python3`), `max_output` (4096), `answer` (`answer`), `memory` (MiB, \
         1024), `processes` (16), `cpu_seconds` (10), `file_size` (MiB, 16), `open_files` (256), \
         `work_size` (MiB, 64); one positional word, the variable of the turn (`turn`)",
    ),
    (
        "ExactAnswer",
        "Reward `exact_answer`: 1 when the `<answer>` of `var` equals the data row's `target` column.",
        "`var` (`answer`), `target` (`expected`), `tag` (`answer`), `weight` (1), `name`, `pass` (`true`: the component pass@k counts, where the file has several answer checks)",
    ),
    (
        "MathAnswer",
        "Reward `math_answer`: 1 when the `<answer>` of `var` equals the `target` column as a number.",
        "`var` (`answer`), `target` (`expected`), `tag` (`answer`), `untagged` (`whole`; `last_number` reads the last number of a reply without the tag), `weight` (1), `name`, `pass` (`true`: the component pass@k counts, where the file has several answer checks)",
    ),
    (
        "FormatReward",
        "Reward `format`: 1 when `var` has each of the `tags` as `<tag>...</tag>`.",
        "`var` (`answer`), `tags` (`answer`), `weight` (1), `name`",
    ),
    (
        "LengthPenalty",
        "Reward `length_penalty`: a penalty for `var` longer than `max` characters.",
        "`var` (`answer`), `max` (1000), `weight` (1), `name`",
    ),
    (
        "Retry",
        "ERL's gate: runs its body (reflection and second attempt) when the reward `score` is below `threshold`.",
        "`score` (or one positional word: the reward component), `threshold` (1)",
    ),
    (
        "Feedback",
        "Writes the feedback recorded for a reward component (why it got its value).",
        "one positional word or `score`: the reward component",
    ),
    (
        "Score",
        "Writes the value recorded for a reward component.",
        "one positional word or `score`: the reward component",
    ),
    (
        "Memory",
        "Writes the most recent reflections of ERL's cross-episode memory.",
        "`top_k` (3), `empty` (`None available.`)",
    ),
    (
        "Remember",
        "At the end, queues the variable it names for ERL's memory when the reward `score` is above `threshold`.",
        "one positional word: the variable; `score`, `threshold` (0)",
    ),
];

/// What a sampler's generation arguments mean (docs/holoware.md, section 3.3).
pub(crate) const SAMPLER_DOCS: [(&str, &str); 11] = [
    ("max_tokens", "the most tokens to sample: an integer >= 1"),
    (
        "temperature",
        "sampling temperature: a number >= 0; 0 samples greedily",
    ),
    ("top_p", "nucleus sampling: a number, 0 < p <= 1"),
    (
        "top_k",
        "sample among the k likeliest tokens: an integer >= 0; 0 disables it",
    ),
    ("stop", "a stop string (repeatable): `stop=\"</tool>\"`"),
    ("json", "`json=object`: the sampled text is a JSON object"),
    (
        "json_schema",
        "the sampled text is JSON valid under this schema: `json_schema='{\"type\": \"object\"}'`; a bare name reads the schema from that variable when the sampler runs: `json_schema=schema`",
    ),
    (
        "json_schema_file",
        "the sampled text is JSON valid under the schema in this file, read when the file is checked (a path relative to the .hol file's folder): `json_schema_file=\"schemas/plan.json\"`",
    ),
    (
        "regex",
        "the regular expression matches the whole sampled text: `regex=\"(yes|no)\"`; a bare name reads the regular expression from that variable when the sampler runs: `regex=pattern`",
    ),
    (
        "choice",
        "the sampled text is one of these (repeatable): `choice=yes choice=no`",
    ),
    (
        "grammar",
        "the sampled text is a sentence of this Lark grammar (llguidance's): `grammar=\"start: /[0-9]+/\"`; a bare name reads the grammar from that variable when the sampler runs: `grammar=rules`",
    ),
];

/// The keyword parameters of holotype `name`: the crate's own when it implements it, else the built-in's.
pub(crate) fn holotype_params(document: &Document, name: &str) -> Option<Vec<String>> {
    let options = &document.options;
    if let Some(declared) = options
        .scan
        .as_ref()
        .and_then(|scan| scan.holotypes.get(name))
    {
        return declared.params.clone();
    }
    options.builtin_holotypes.get(name).cloned().flatten()
}

/// The parameter `param` of holotype `name` when `name` is the runtime's built-in there (the crate does
/// not implement a holotype of that name) and the checker checks its values.
pub(crate) fn builtin_param(
    document: &Document,
    name: &str,
    param: &str,
) -> Option<&'static crate::builtins::Param> {
    let options = &document.options;
    let shadowed = options
        .scan
        .as_ref()
        .is_some_and(|scan| scan.holotypes.contains_key(name));
    if shadowed || !options.check_builtin_arguments {
        return None;
    }
    crate::builtins::builtin(name)?
        .params
        .iter()
        .find(|candidate| candidate.name == param)
}
