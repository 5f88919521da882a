//! An OpenAI-compatible HTTP server for any [`Sampler`]: `holo serve`.
//!
//! ```no_run
//! use holo_model::{LocalModel, LocalOptions};
//! use holo_serve::{ServeConfig, ServedModel, Server};
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let model = LocalModel::load("models/Qwen2.5-0.5B-Instruct", LocalOptions::default())?;
//! let served = ServedModel::local("qwen", model);
//! let server = Server::bind("127.0.0.1:8000", served, ServeConfig::default()).await?;
//! println!("serving on http://{}", server.local_addr());
//! server.run().await?;
//! # Ok(())
//! # }
//! ```
//!
//! Any other sampler is served with [`ServedModel::new`] (a tokenizer and chat template of your choice) or
//! [`ServedModel::from_dir`] (those of a Hugging Face model folder).
//!
//! [`Server::bind`] binds a [`tokio::net::TcpListener`] (port 0 picks a free port; [`Server::local_addr`]
//! says which); [`Server::run`] serves until the process ends, [`Server::run_until`] until a future
//! completes (graceful: requests in flight are answered), and [`Server::spawn`] runs it as a task whose
//! [`ServerHandle::shutdown`] stops it.
//!
//! # Endpoints
//!
//! | route | answer |
//! |---|---|
//! | `GET /health` | `200 {"status": "ok"}` |
//! | `GET /metrics` | Prometheus text: requests by status, prompt and generation tokens, queue and request times, open connections; with the local model, its queue, batch, keys-and-values bytes, tokens sampled and tokens per second (see [`metrics`](self#metrics)) |
//! | `GET /v1/models` | `{"object": "list", "data": [{"id", "object": "model", "created", "owned_by": "holo", "root", "parent": null, "max_model_len", "weight_version"}]}`, then the loaded adapters (`parent`: the served id, `root`: their path) |
//! | `GET /v1/models/{id}` | that model object, or 404 |
//! | `POST /v1/completions` | a `text_completion` (below) |
//! | `POST /v1/chat/completions` | a `chat.completion` (below) |
//! | `POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter` | vLLM's: a LoRA adapter loaded or unloaded by name (see *Weight updates*) |
//! | `POST /update_weights_from_disk` | SGLang's: the base weights replaced from safetensors (see *Weight updates*) |
//! | anything else | 404 (unknown route) or 405 (wrong method), as an OpenAI error |
//!
//! Every prompt reaches the sampler as [`Prompt::Tokens`]: the server tokenizes, the sampler never sees text.
//!
//! # Connections
//!
//! The server runs its own accept loop over hyper (HTTP/1.1, keep-alive):
//! - at most [`ServeConfig::max_connections`] connections are open at once (`holo serve
//!   --max-connections`, default 512); further clients wait in the listen backlog until one closes;
//! - a connection that has not sent a whole request head within [`ServeConfig::keep_alive_timeout`]
//!   (`--keep-alive-timeout`, default 5 s, uvicorn's keep-alive) of opening or of its previous response
//!   is closed: idle keep-alive sockets and slow headers alike;
//! - a body that has not fully arrived [`ServeConfig::timeout`] after its head (`--timeout`, default
//!   60 s) is answered 408 `request_timeout` and the connection closed; a client that reads nothing of
//!   its response for that long is disconnected (a streamed request is then cancelled as when a client
//!   leaves);
//! - when the process runs out of file descriptors, accepting is retried as connections close (with a
//!   backoff of up to a second) and logged (target `holo::serve`), instead of failing in a loop.
//!
//! Each request writes one access-log line, a `tracing` event at `INFO` with target `holo::access`
//! (`holo serve` prints them on stderr unless `--no-access-log`): `id` (the answer's id), `method`, `path`,
//! `status`, `prompt_tokens`, `completion_tokens`, `queue_ms` (until the sampler started the request's
//! first sample; the local model reports when a sequence joins its batch, other samplers by their first
//! token, `-` when neither), `total_ms` (until the last byte of the response) and `finished` (`false`
//! when the client left first).
//!
//! ## Metrics
//!
//! `GET /metrics` (Prometheus text format 0.0.4): `holo_requests_total{status}`,
//! `holo_prompt_tokens_total`, `holo_generation_tokens_total` (counted when a request ends), the
//! summaries `holo_request_queue_seconds` and `holo_request_duration_seconds` (`_sum`, `_count`), and the
//! gauge `holo_open_connections`. With the local model ([`ServedModel::local`]), also the gauges
//! `holo_num_requests_waiting`, `holo_num_requests_running` (sequences, as vLLM's), `holo_kv_cache_bytes`
//! and `holo_generation_tokens_per_second` (over the scheduler's last second of work), and the counters
//! `holo_scheduler_generated_tokens_total` (requests in flight included) and
//! `holo_scheduler_prefilled_tokens_total` (prompt tokens the model ran: the `n` samples of a prompt
//! share one prefill, and a prefix the cache holds is not run again).
//!
//! # Request fields
//!
//! A field set to `null` is the same as a field left out. Fields this list does not name are ignored (as vLLM
//! does); fields whose effect the server cannot honour are refused unless they hold their neutral value (see
//! *Refused fields*).
//!
//! Both endpoints:
//! - `model`: the served id ([`ServedModel::id`]) or a loaded adapter's name when given; another id is a
//!   404 `model_not_found` (OpenAI's and vLLM's status for an unknown model). Omitted: the served model.
//! - `max_tokens` (≥ 1; 0 on completions with `echo`); chat also `max_completion_tokens`, which wins over `max_tokens`. Default: 16 on
//!   completions (OpenAI's and vLLM's default); on chat, the rest of the context
//!   (`max_model_len - prompt tokens`) when [`ServedModel::max_model_len`] is known, else the sampler's
//!   default. With a known `max_model_len`, a prompt plus `max_tokens` longer than it is a 400.
//! - `temperature` (finite, ≥ 0), `top_p` (in (0, 1]), `top_k` (vLLM: an integer ≥ 1; `-1` or `0` turn it
//!   off).
//! - `stop`: a string or a list of strings (none empty; at most 128 strings of 16 KiB in all, a 400
//!   beyond: each sample keeps its own automaton of them — vLLM has no limit, OpenAI allows 4). The
//!   local model matches them with an Aho-Corasick automaton fed each new byte once, so a token costs its
//!   own text, whatever the stop strings' number and length. The text of a choice ends *before* the stop string
//!   that ended it (OpenAI's behaviour) unless `include_stop_str_in_output` (vLLM) is true; the choice's
//!   `stop_reason` (vLLM) is that string, or `null` when the model ended its turn or ran out of tokens.
//! - `seed`: any integer that fits 64 bits (a negative one is read as its two's complement). With `n`
//!   samples per prompt, sample 0 uses `seed` itself and sample `j > 0` a seed derived from `(seed, j)`
//!   (splitmix64, 63 bits), so `n` samples differ, the same request always gives the same choices, and
//!   every prompt of a request gets the same seeds. Without `seed`, each sample gets a fresh seed from the
//!   server's own generator (so `n` samples differ whatever the sampler does with an unseeded request).
//! - `n` (1 to 128): samples per prompt; each is one request of the batch. The local model prefills a
//!   prompt once for all its samples admitted together (up to its `max_num_seqs`; the counter
//!   `holo_scheduler_prefilled_tokens_total` shows it). `best_of` other than `n` is refused.
//! - `return_tokens_as_token_ids` (vLLM): logprob tokens are written `"token_id:N"` instead of their text.
//! - `return_token_ids` (vLLM): each choice carries `token_ids` (the sampled ids); completions choices also
//!   carry `prompt_token_ids`, chat answers carry a top-level `prompt_token_ids`.
//! - `add_special_tokens` (vLLM): whether tokenizing the prompt adds the tokenizer's special tokens (its
//!   post-processor's BOS/EOS). Default `true` for completions, `false` for chat (the template writes them),
//!   as in vLLM.
//! - `stream`: `true` streams the answer (see *Streaming*); `stream_options` (only with `stream`):
//!   `include_usage`, and vLLM's `continuous_usage_stats`.
//! - `logit_bias` (OpenAI's: `{"token id": bias}`, biases from -100 to 100, ids in the vocabulary): added
//!   to those tokens' logits before each draw; the local model then reports the log-probabilities of the
//!   biased distribution it drew from.
//! - vLLM's `min_tokens` (at most `max_tokens`): no end-of-turn token, stop token or stop string ends a
//!   choice before it has that many tokens (the local model masks the ending tokens until then);
//!   `stop_token_ids` (ids in the vocabulary): tokens that end a choice as its end-of-turn token does
//!   (`finish_reason` `"stop"`, `stop_reason` `null`, the token kept in `token_ids`); `ignore_eos`: the
//!   end-of-turn tokens do not end a choice, which runs to `max_tokens`. A sampler that cannot honour
//!   one of these, or a constraint, refuses the request ([`SampleParams::beyond_sampling`]).
//! - Structured output (see *Structured output*): `response_format`, and vLLM's `guided_json`,
//!   `guided_regex`, `guided_choice`, `guided_grammar`, `structured_outputs`.
//!
//! `POST /v1/completions`:
//! - `prompt` (required): a string, a list of strings, a list of token ids, or a list of token-id lists.
//!   Strings are tokenized with the tokenizer; token ids must be below the tokenizer's vocabulary size. An
//!   empty prompt (no tokens) is a 400, and so is a request for more than 4096 samples (prompts × `n`).
//! - `logprobs`: an integer 0 to 20 (vLLM's default `max_logprobs`; more is a 400). The choice's
//!   `logprobs` is then `{"tokens", "token_logprobs", "text_offset", "top_logprobs"}`: one entry per
//!   sampled token, its text (or `token_id:N`), its log-probability as the sampler reported it, the
//!   character offset (in Unicode code points, as Python counts them) where the token's text starts in the
//!   choice's text, and `{token: logprob}` of the sampled token and the `logprobs` most likely tokens at
//!   its position (up to `logprobs + 1` entries, as OpenAI and vLLM write them). The alternatives are
//!   [`Completion::top_logprobs`] ([`SampleParams::top_logprobs`] asks the sampler for them); with
//!   `logprobs` > 0 and a sampler that reports none (the `openai` sampler), `top_logprobs` is `null`.
//!   The local model's log-probabilities, the sampled token's and the alternatives', are those of the
//!   model's own distribution (the softmax of its logits at temperature 1, before `temperature`,
//!   `top_p` and `top_k`), as vLLM's default `logprobs_mode` (`raw_logprobs`) reports them.
//! - `echo: true`: each choice's `text` starts with its prompt (a prompt given as text is itself, one given
//!   as token ids its tokens' text), and with `logprobs` the choice's `logprobs` cover the prompt's tokens
//!   then the completion's: the prompt's first token has `null` in `token_logprobs` and `top_logprobs`
//!   (nothing precedes it), every other prompt token its log-probability given the tokens before it and
//!   its position's `logprobs` most likely tokens, and `text_offset`s run on from the prompt into the
//!   completion (vLLM's behaviour, and OpenAI's). `max_tokens: 0` then only scores the prompt (no token
//!   is sampled, `finish_reason` `"length"`), which is what lm-evaluation-harness' `local-completions`
//!   needs for log-likelihoods. The sampler is asked for [`SampleParams::prompt_logprobs`]: the local
//!   model runs such a prompt whole (the prefix cache unread, as vLLM does) and turns every position's
//!   logits into these, a few positions at a time; the `n` samples of the prompt share that one prefill.
//!   Samplers that cannot score a prompt (the `openai` one) refuse it. Streamed, a choice's first chunk
//!   is its prompt (with its `logprobs`), then its completion's chunks follow with offsets that run on.
//! - `prompt_logprobs` (vLLM's; 0 to 20; also on chat): each choice's `prompt_logprobs` is, for its
//!   prompt, `null` (the first token) then per token `{"ID": {"logprob", "rank", "decoded_token"}, …}`:
//!   the prompt's token first, with its rank in the model's distribution (how many tokens are at least
//!   as likely, itself included: 1 is the most likely, as vLLM counts), then the `prompt_logprobs` most
//!   likely tokens with ranks 1, 2, … (the prompt's token once). Log-probabilities are the model's at
//!   temperature 1, `-inf` as `-9999.0`; `decoded_token` is the token's own text. With `echo` and
//!   `logprobs` too, the prompt is scored once and each block keeps its own number of alternatives.
//!   Refused with `stream` unless 0 (vLLM sends none in streams); `-1` (the whole vocabulary) is
//!   refused, as is any count beyond vLLM's default `max_logprobs`.
//!
//! `POST /v1/chat/completions`:
//! - `messages` (required, not empty): objects with a string `role` and a `content` that is a string,
//!   `null`, or a list of `{"type": "text", "text": ...}` parts (joined with newlines, as vLLM does for
//!   string templates). Other fields of a message (`name`, `tool_call_id`, ...) are passed to the template
//!   as they are, in their order; `tool_calls` as *Tools* says.
//! - They are rendered with [`ServedModel::template`] exactly as transformers' `apply_chat_template` renders
//!   them, with `add_generation_prompt` (default `true`), `continue_final_message` (vLLM; default `false`)
//!   and `chat_template_kwargs` (vLLM; extra template variables such as `enable_thinking`). A template that
//!   raises, or an invalid combination, is a 400 naming the reason.
//! - `logprobs: true` gives the choice a `logprobs: {"content": [{"token", "logprob", "bytes",
//!   "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}`; `top_logprobs` (0 to 20, more is a 400)
//!   entries per position, in vLLM's order: the sampled token first, then the most likely others (so
//!   with a sampled token that is the most likely, the `top_logprobs` most likely tokens). Empty when
//!   `top_logprobs` is 0 or the sampler reports no alternatives. `bytes` are the token's own bytes (a byte-level BPE token that holds part of
//!   a UTF-8 character has its raw bytes here, while `token` shows the replacement character).
//! - The answer's `choices[i].message` is `{"role": "assistant", "content": text}`; with tool calls (see
//!   *Tools*) `{"role": "assistant", "content": text or null, "tool_calls": [...]}` and `finish_reason`
//!   `"tool_calls"`.
//! - `tools`, `tool_choice`, `parallel_tool_calls`: see *Tools*.
//! - `prompt_logprobs` (vLLM's, not streamed): as on completions, once for the rendered conversation,
//!   as the answer's top-level `prompt_logprobs`.
//! - `include_reasoning` (vLLM's; default `true`): see *Reasoning*.
//!
//! Both answers carry `id`, `object`, `created`, `model` (the id or adapter the request named),
//! `weight_version` (see *Weight updates*), `choices` (prompt-major: prompt `p`, sample `j`
//! is choice `p * n + j`) with `index`, `finish_reason` (`"length"` when `max_tokens` ran out,
//! `"tool_calls"` when the reply's tool calls were read (chat), else `"stop"`) and `stop_reason`, and
//! `usage {prompt_tokens, completion_tokens, total_tokens}` (each prompt's tokens counted once, every
//! choice's sampled tokens); with a reasoning parser on chat, also vLLM's `completion_tokens_details:
//! {reasoning_tokens}` (see *Reasoning*).
//!
//! A choice's `logprobs` is `null` when not asked for, or when the sampler reported no token ids or no
//! log-probabilities for it. A log-probability of `-inf` is written as `-9999.0` (vLLM's convention; JSON
//! has no infinity).
//!
//! ## Streaming
//!
//! With `"stream": true` the answer is a `text/event-stream` of `data: {chunk}` events ending with
//! `data: [DONE]`, as OpenAI's and vLLM's are. Every chunk carries the answer's `id`, `object`
//! (`text_completion`, or `chat.completion.chunk`), `created`, `model` and one choice:
//! - completions: `{"index", "text", "logprobs", "finish_reason", "stop_reason"}`, `text` and `logprobs`
//!   holding what is new since the choice's last chunk (`text_offset` counts from the start of the
//!   choice's text); with `echo`, the choice's first chunk holds its prompt;
//! - chat: first `{"index", "delta": {"role": "assistant", "content": ""}}` for every choice, then
//!   `{"index", "delta": {"content"}, "logprobs": {"content": [...]}, "finish_reason", "stop_reason"}`.
//!
//! A choice's last chunk has its `finish_reason` (`null` before). With `return_token_ids`, each chunk has
//! the choice's new `token_ids`; the prompt's ids come with a choice's first chunk (completions) or the
//! answer's first chunk (chat). With `stream_options.include_usage` every chunk has `"usage": null` and a
//! last chunk with no choices has the request's usage; with `continuous_usage_stats` as well, each chunk's
//! `usage` is its choice's so far. Joined, a choice's chunks are the choice of the same request not
//! streamed (the test suite checks this).
//!
//! Tokens stream as the sampler samples them when it reports them
//! ([`Sampler::sample_streaming`]: the local model does), otherwise all at once when the choice is done.
//! Text is decoded incrementally: a token that holds part of a character waits for the rest, and with
//! stop strings the last (longest stop − 1) bytes wait until no stop string can start there, so a stop
//! string never shows. An error once the stream has started (the sampler failed) is a last
//! `data: {"error": {...}}` event before `[DONE]`; anything wrong with the request is an ordinary error
//! response. A client that disconnects tells the sampler, which stops sampling for it (the local model
//! drops the row at its next step).
//!
//! ## Structured output
//!
//! A request may hold its reply to a language, by constrained decoding with llguidance (the engine of
//! llama.cpp's, vLLM's and SGLang's structured output): at every step the local model masks the tokens
//! that cannot continue a reply in the language, and allows its end-of-turn tokens only where the reply so
//! far is complete. A reply that ends its turn (`finish_reason: "stop"`) is therefore always in the
//! language, whatever the weights; one cut by `max_tokens` (`"length"`) or a stop string may not be.
//! - `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON object),
//!   or `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}` (JSON that
//!   validates against `schema`; the schema is enforced whatever `strict` says). Other types and other
//!   keys are a 400.
//! - vLLM's `guided_json` (a schema, as an object or as its JSON text), `guided_regex` (the whole reply
//!   matches), `guided_choice` (a non-empty list of strings: the reply is one of them), `guided_grammar`
//!   (a Lark grammar as llguidance reads it: rules from `start`, `%json {schema}` inside, `<[id]>` for a
//!   token by id), and `structured_outputs` with one of `json`, `regex`, `choice`, `grammar`,
//!   `json_object`.
//!
//! At most one of these per request (two are a 400 naming the second). JSON replies take Python's
//! `json.dumps` layout (`", "` and `": "`, no other whitespace) unless the schema sets llguidance's
//! `x-guidance` options; `$ref`s must point inside the schema (`#/...`). With the local model
//! ([`ServedModel::grammars`]) the constraint is compiled before sampling, so a schema, regex or grammar
//! that llguidance refuses is a 400 naming the field and the reason; another sampler refuses
//! constraints it cannot enforce ([`Constraint`](holo_core::Constraint)). Constrained rows are drawn on
//! the host (their logits are read back on a GPU), the parser advanced a token at a time.
//!
//! The log-probabilities reported for a constrained reply (`logprobs`, `top_logprobs`) are those of the
//! masked distribution the tokens were drawn from: the model's softmax over the tokens the grammar allows
//! (a token the grammar forces has log-probability 0), not the unmasked model's.
//!
//! ## Tools
//!
//! `/v1/chat/completions` takes OpenAI's `tools` (`[{"type": "function", "function": {"name",
//! "description", "parameters", "strict"}}]`; other keys, a missing or repeated name, are a 400) and hands
//! them to the chat template as its `tools` argument, as transformers' `apply_chat_template(tools=...)`
//! does: the model sees them as it was trained to. A template that never mentions `tools` refuses them (a
//! 400: they would not reach the model). The model's reply is read in its family's call format
//! ([`holo_core::tools::ToolFormat`]): `hermes` (Qwen 2.5 and 3, Hermes: `<tool_call>{json}</tool_call>`),
//! `llama3_json` (Llama 3.1 to 3.3), `mistral` (`[TOOL_CALLS]`), `openai` (gpt-oss's harmony format: a
//! call is a message to `functions.NAME`, see *Reasoning*), taken from the template's markers or named
//! by `holo serve --tool-call-parser` ([`ServedModel::tool_parser`]); tools with neither are a 400 that
//! says to name one.
//!
//! - `tool_choice`: `"auto"` (the default with tools: the reply is read for calls), `"none"` (tools are
//!   rendered, the reply is text), `"required"` (the reply is one call or more, or exactly one with
//!   `parallel_tool_calls: false`), or `{"type": "function", "function": {"name"}}` (one call of that
//!   function). `required` and a named function are held to the format by a grammar (see *Structured
//!   output*): the reply is then a well-formed call whose arguments validate against the function's
//!   `parameters`, whatever the weights. They cannot be combined with a structured-output field.
//! - A reply that holds calls becomes `message.tool_calls`: `[{"id": "call_…", "type": "function",
//!   "function": {"name", "arguments"}}]` (`arguments` is the JSON text of an object), `content` the text
//!   before the calls (`null` when none), `finish_reason` `"tool_calls"`. A reply in which what starts a
//!   call is not a well-formed one is returned as text, as vLLM's parsers return it (with `openai`, a
//!   call whose arguments are not the JSON of an object leaves the reply without calls, where vLLM
//!   passes their text on).
//! - Streamed, text that may start a call is held back until the reply is done (with `mistral`, whose
//!   marker is a special token that streamed text does not show, all of it); a reply with calls
//!   then sends, as OpenAI does, per call a chunk with `delta.tool_calls: [{"index", "id", "type",
//!   "function": {"name", "arguments": ""}}]` and one with `delta.tool_calls: [{"index", "function":
//!   {"arguments"}}]` (the whole arguments at once), and a last chunk with an empty `delta` and
//!   `finish_reason` `"tool_calls"`. With `openai` (harmony), where a call is a message of its own,
//!   calls stream as they are written, as vLLM streams them: the opening chunk once the message's
//!   header is written, then `function.arguments` deltas as its content is written (less a tail that
//!   may still turn into an end marker), the model's text as it wrote it; a call whose arguments turn
//!   out not to be the JSON of an object has then been streamed (as vLLM streams it) though the answer
//!   ends with `finish_reason` `"stop"`, as the whole answer holds no calls. Stop strings, which cut
//!   the reply's text, hold harmony's calls until the reply is done.
//! - The history: an assistant message's `tool_calls` reach the template with each call's `arguments`
//!   as the object its JSON text holds, and its `content: null` as `""` (as vLLM hands them to templates,
//!   which write arguments with `tojson` and test content as a string); `tool` messages (`tool_call_id`,
//!   `content`) pass as they are. Arguments that are not the JSON of an object are a 400 naming the
//!   message.
//!
//! ## Reasoning
//!
//! With [`ServedModel::reasoning_parser`] (`holo serve --reasoning-parser`, vLLM's names: `qwen3`,
//! `deepseek_r1`, `openai_gptoss`), a chat reply's reasoning is split out of its content as vLLM's
//! parsers split it, and the message carries it as `reasoning` (current vLLM's field; its older
//! `reasoning_content` is not written), `null` when there is none:
//! - the text before `</think>` is the reasoning (from after the `<think>` that opens the reply, when
//!   it opens with one), the text after it the content (`null` when empty). Qwen3's templates put
//!   `<think>` into the prompt, so its replies hold only `</think>`;
//! - a reply with no `</think>` was cut inside its reasoning: all of it is reasoning, `content` is
//!   `null`;
//! - `qwen3` with `chat_template_kwargs.enable_thinking` false (the template writes an empty think block
//!   into the prompt): every reply is content;
//! - tool calls are read from the content only (a call written inside the reasoning is not one);
//! - structured output (`response_format`, `guided_json`, `guided_regex`, `guided_choice`) starts
//!   after the reasoning, as vLLM starts its grammar: the reply is any text up to and with `</think>`
//!   (llguidance's lazy lexeme), up to four whitespace characters, then a sentence of the constraint,
//!   which is the content. Without thinking (`enable_thinking: false`), and for a client's Lark grammar
//!   (`guided_grammar`, which cannot be nested in another) or a forced tool call, the grammar holds the
//!   reply from its first token: it is all content;
//! - `include_reasoning: false` leaves the reasoning out (`null`), and with it the per-token
//!   `logprobs` and `token_ids` that would show it, as vLLM does.
//!
//! Streamed, each chunk's `delta` holds the reasoning new since the last chunk as `reasoning` and the
//! content as `content`: the reasoning comes first, a tail that may begin a marker waits for the next
//! token (so `</think>` cut across tokens never shows), and the content follows once `</think>` has
//! come. Joined, a choice's deltas are the non-streamed reasoning and content. The markers are read in
//! the text, so a tokenizer that spells them with several tokens works as one with a token each; one
//! that makes them special tokens (skipped in the text) does not. Without a parser, replies are left
//! whole and messages have no `reasoning`.
//!
//! `openai_gptoss` reads a gpt-oss reply in OpenAI's harmony format by its channels, as vLLM does
//! (openai-harmony's parser, then vLLM's sorting; [`holo_core::tools::harmony`]), from the reply's
//! tokens decoded with their special tokens (`<|channel|>`, `<|message|>`, `<|end|>`, `<|call|>`,
//! `<|return|>`, which the text lacks): its `analysis` messages are the reasoning; its `final`
//! messages and preambles (`commentary` to no one) the content; with tools and the `openai` tool-call
//! parser, its messages to `functions.NAME` (on any channel) the tool calls; each kind's non-empty
//! messages joined with newlines; a reply cut inside a message ends it there. The same reading, less
//! the reasoning (vLLM drops the analysis), applies with only `--tool-call-parser openai` or a template
//! that writes harmony's calls. Streamed, the deltas are the channels of the reply so far (a tail that
//! may begin an end marker waits; the header words never show), so joined they are the non-streamed
//! reasoning and content (where vLLM's deltas leave out the newline between two messages); tool calls
//! follow the content whole, as with the other formats, where vLLM streams their arguments as they come.
//! With stop strings, which cut the text and not the channels, a choice sends nothing before it
//! ends. Structured output (`response_format`, `guided_json`, `guided_regex`, `guided_choice`,
//! `structured_outputs`) holds the reply's `final` message, as vLLM starts its grammar once
//! `<|channel|>final<|message|>` is written: the reply is any number of `analysis` messages
//! (`<|channel|>analysis<|message|>…<|end|><|start|>assistant`, their text free but for `<|`), then
//! `<|channel|>final<|message|>`, a sentence of the constraint and `<|return|>`
//! ([`holo_core::tools::harmony::after_analysis`]), so the analysis is the reasoning and the content
//! is the constrained text alone. Where vLLM leaves the model free before that header, preambles and
//! calls are not allowed there (they would be content or calls, not the answer), so every constrained
//! reply is a harmony message that openai-harmony's parser reads; only `max_tokens` bounds how many
//! analysis messages come first, as in vLLM. The same holds with only `--tool-call-parser openai`,
//! less the reasoning (vLLM, without a reasoning parser, holds the reply from its first token, which
//! then is no harmony message). A client's Lark grammar (`guided_grammar`, which
//! cannot be nested in another) holds the reply from its first token, so it is all content; a forced
//! call's grammar writes the call's harmony message. A sampler that reports no tokens leaves its text
//! as the content.
//!
//! With a reasoning parser, `usage.completion_tokens_details.reasoning_tokens` counts the reasoning's
//! tokens as vLLM counts them, summed over the choices: with `qwen3` and `deepseek_r1` the tokens that
//! end before `</think>` (all of a reply cut inside its reasoning, none without thinking); with
//! `openai_gptoss` those after which harmony's parser is inside the content of an `analysis` message or
//! of a call (`commentary` to a recipient), from its `<|message|>` to its last token. Streamed, the
//! last usage chunk has them, and with `continuous_usage_stats` every chunk those so far.
//!
//! ## Refused fields
//!
//! Refused with a 400 `unsupported_parameter` unless absent, `null` or neutral: on `/v1/chat/completions`
//! `echo` (`false`), `suffix`
//! (`""`), `best_of` (equal to `n`), `presence_penalty`, `frequency_penalty`, `min_p` (`0`),
//! `repetition_penalty` (`1`), `bad_words` (`[]`), on `/v1/completions` `tools` (`[]`) and `tool_choice`
//! (`"none"`), `guided_whitespace_pattern`, `logits_processors`, `prompt_embeds`
//! (anything but `null`).
//!
//! # Sampling
//!
//! Each request's samples (a prompt × `n`) go to the sampler in one [`Sampler::sample_streaming`] call, on a
//! blocking thread (so a sampler that computes inside `poll` does not stall the HTTP side), as soon as the
//! request is parsed: calls of different requests run at once, and the sampler decides how to batch them.
//! The local model schedules every sequence of every call in one continuously batched engine
//! ([`holo_model::schedule`]): a request joins the running batch at the next decoding step, whatever
//! else runs. The server passes the tokens the sampler reports to streamed requests and sends each result
//! back. A request whose client has gone is not sampled, and the sampler hears of one that goes while it
//! samples ([`TokenSink::wanted`], [`TokenSink::token`]). A panicking sampler fails that request with a
//! 500 and the server goes on. A sampler whose queue is full ([`SamplerError::Overloaded`]) answers 429
//! with `Retry-After`.
//!
//! # Weight updates
//!
//! A local model served with [`ServedModel::local_with_updates`] (what `holo serve` does) takes new
//! weights while it serves, so that a trainer can sample its latest policy here:
//!
//! - `POST /v1/load_lora_adapter` `{"lora_name", "lora_path", "load_inplace"}` (vLLM's route and body): the
//!   PEFT adapter folder at `lora_path` (`adapter_config.json` and `adapter_model.safetensors`, as `holo
//!   export` and the trainer's LoRA checkpoints write them) is put on the base weights now served; requests
//!   whose `model` is `lora_name` sample with it. `200` with vLLM's plain-text `Success: LoRA adapter
//!   'NAME' added successfully.` A name already loaded is vLLM's 400 unless `load_inplace` is `true`, which
//!   replaces it. Refused as vLLM refuses: a missing name or path (400 `InvalidUserInput`), a path without
//!   the two files (404 `NotFoundError`), an adapter that does not fit (400 `BadRequestError`, naming the
//!   cause: a target module the model lacks, a tensor whose shape is not the rank the config's `r` or
//!   `rank_pattern` gives it, a tensor the config does not describe, DoRA, biases, `modules_to_save`, a
//!   `target_modules` regular expression that matches no projection). rsLoRA's scaling, PEFT's
//!   `rank_pattern` and `alpha_pattern`, `target_modules` as a regular expression the whole module name
//!   must match, and `target_parameters` (a mixture's expert stacks and router) are honoured.
//! - `POST /v1/unload_lora_adapter` `{"lora_name"}`: `200` `Success: LoRA adapter 'NAME' removed
//!   successfully.`, or 404 `NotFoundError` `The lora adapter 'NAME' cannot be found.`
//! - `POST /update_weights_from_disk` `{"model_path"}` (SGLang's route and body; vLLM has no HTTP route for
//!   it outside its development mode's `/collective_rpc`): the base weights replaced by those of a
//!   `.safetensors` file or a model folder (its `model*.safetensors` files) of the same architecture. Every
//!   tensor must be the served model's, by name and shape; a missing, extra or reshaped one is a 400
//!   `{"success": false, "message"}` naming it, and nothing changes. `200 {"success": true, "message",
//!   "weight_version"}`. Adapters loaded before keep the base they were loaded on.
//!
//! Each set of weights (the base, each adapter) samples as its own local model, with its own scheduler
//! and prefix cache: keys and values computed under one set are never read under another, and a request
//! samples to its end with the weights it started with (a load only changes what later requests get).
//! Sequences of different adapters are therefore not batched together. Adapters run unmerged, as the
//! trainer runs them, so their log-probabilities are the trainer's to rounding. A server of another
//! sampler refuses these routes (400).
//!
//! **Versions.** The base weights are version 0, then one more per replacement; an adapter is version 1
//! when its name is first loaded, then one more per load under that name (unloading does not reset it).
//! Every answer of `/v1/completions` and `/v1/chat/completions` that named its weights carries the
//! version they sampled with in the header `x-holo-weight-version` ([`WEIGHT_VERSION_HEADER`]) and in the
//! body's `weight_version` (each streamed chunk's too); the load routes answer with the new version in
//! the header; `/v1/models` lists each model's; `/metrics` has the gauge `holo_weight_version{model}`.
//!
//! # Errors
//!
//! Every error is `{"error": {"message", "type", "param", "code"}}`:
//!
//! | case | status | `type` | `code` |
//! |---|---|---|---|
//! | body not JSON (the message has serde's line and column), not an object, a field of the wrong type or range (`param` names it) | 400 | `invalid_request_error` | `invalid_json`, `invalid_value`, `missing_field` |
//! | a refused field, `echo: true` on chat | 400 | `invalid_request_error` | `unsupported_parameter` |
//! | the prompt does not fit `max_model_len` | 400 | `invalid_request_error` | `context_length_exceeded` |
//! | the chat template fails | 400 | `invalid_request_error` | `chat_template_error` |
//! | unknown `model` | 404 | `invalid_request_error` | `model_not_found` |
//! | unknown route / wrong method | 404 / 405 | `invalid_request_error` | `not_found` / `method_not_allowed` |
//! | body over [`ServeConfig::max_body_bytes`] | 413 | `invalid_request_error` | `body_too_large` |
//! | [`SamplerError::Rejected`] | 400 | `invalid_request_error` | `sampler_rejected` |
//! | [`SamplerError::Unavailable`], or the server shutting down | 503 | `server_error` | `sampler_unavailable` |
//! | [`SamplerError::Malformed`], a sampler panic, a result missing | 500 | `server_error` | `sampler_error` |
//! | [`SamplerError::Overloaded`] (with `Retry-After: 1`) | 429 | `invalid_request_error` | `server_overloaded` |
//!
//! When several samples of one request fail, the first failure (in choice order) is reported.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Extension, Path as UrlPath, State};
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokenizers::Tokenizer;
use tokio::net::{TcpListener, ToSocketAddrs};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use holo_core::chat::{ChatTemplate, RenderOptions};
use holo_core::machine::{Completion, Finish};
use holo_core::sampler::{Prompt, Request, SampleParams, Sampler, SamplerError, TokenSink};
use holo_core::tools::ToolFormat;

mod chat;
mod choices;
mod completions;
mod error;
mod fields;
mod listen;
mod log;
mod metrics;
mod reasoning;
mod sampling;
mod stream;
mod structured;
mod tools;
mod weights;

use chat::*;
use choices::*;
use completions::*;
use error::*;
use fields::*;
use listen::{BodyTimeout, Connections};
use log::{Counters, Tally};
pub use reasoning::ReasoningParser;
use reasoning::{Harmony, Reading};
use sampling::*;
use tools::*;
pub use weights::WEIGHT_VERSION_HEADER;
use weights::{Target, Weights};

/// A model as the server exposes it: the sampler that completes token prompts, and the tokenizer and chat
/// template that turn requests into token prompts and sampled tokens into logprob entries.
pub struct ServedModel {
    /// The id clients name in `model` and `/v1/models` lists.
    pub id: String,
    pub sampler: Arc<dyn Sampler>,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    /// The context length (prompt + completion), when known; used to refuse prompts that do not fit and
    /// to default chat `max_tokens`.
    pub max_model_len: Option<u32>,
    /// The local model's scheduler, whose queue, batch and cache `/metrics` reports.
    pub scheduler: Option<Arc<holo_model::SchedulerStats>>,
    /// What compiles the sampler's constraints, when the server can check them before sampling (the
    /// local model's); a constraint the sampler cannot enforce is refused by the sampler either way.
    pub grammars: Option<holo_model::Grammars>,
    /// The format the model writes tool calls in (`holo serve --tool-call-parser`); `None` takes the
    /// one the chat template renders them in ([`ToolFormat::detect`]), if it says.
    pub tool_parser: Option<ToolFormat>,
    /// How the model marks its reasoning (`holo serve --reasoning-parser`): with one, a chat reply's
    /// reasoning is split out of its `content` into `reasoning` (see *Reasoning*); `None` leaves
    /// replies whole.
    pub reasoning_parser: Option<ReasoningParser>,
    /// The local model new weights are built from, when the server takes them (see *Weight
    /// updates*); `None` refuses the update routes.
    pub updatable: Option<holo_model::LocalModel>,
}

impl fmt::Debug for ServedModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServedModel")
            .field("id", &self.id)
            .field("template", &self.template)
            .field("max_model_len", &self.max_model_len)
            .finish_non_exhaustive()
    }
}

/// Why a model folder could not be prepared for serving.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadError(pub String);

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LoadError {}

impl ServedModel {
    /// A served model with no known context length.
    pub fn new(
        id: impl Into<String>,
        sampler: Arc<dyn Sampler>,
        tokenizer: Tokenizer,
        template: ChatTemplate,
    ) -> Self {
        ServedModel {
            id: id.into(),
            sampler,
            tokenizer,
            template,
            max_model_len: None,
            scheduler: None,
            grammars: None,
            tool_parser: None,
            reasoning_parser: None,
            updatable: None,
        }
    }

    /// A [`LocalModel`](holo_model::LocalModel) with its own tokenizer, chat template and context length
    /// (`max_position_embeddings`).
    pub fn local(id: impl Into<String>, model: holo_model::LocalModel) -> Self {
        ServedModel {
            id: id.into(),
            tokenizer: model.tokenizer().clone(),
            template: model.template().clone(),
            max_model_len: u32::try_from(model.config().max_position_embeddings).ok(),
            scheduler: Some(model.scheduler_stats()),
            grammars: Some(model.grammars().clone()),
            tool_parser: None,
            reasoning_parser: None,
            updatable: None,
            sampler: Arc::new(model),
        }
    }

    /// [`ServedModel::local`] taking new weights while it serves (see *Weight updates*): LoRA adapters
    /// and full weights are built over `model` and sampled with its options.
    pub fn local_with_updates(id: impl Into<String>, model: holo_model::LocalModel) -> Self {
        ServedModel {
            updatable: Some(model.clone()),
            ..ServedModel::local(id, model)
        }
    }

    /// The tokenizer (`tokenizer.json`), chat template ([`ChatTemplate::from_dir`], ChatML when the folder
    /// has none) and context length (`max_position_embeddings` of `config.json`, when present) of a Hugging
    /// Face model folder, served with `sampler`.
    pub fn from_dir(
        dir: &Path,
        id: impl Into<String>,
        sampler: Arc<dyn Sampler>,
    ) -> Result<Self, LoadError> {
        let tokenizer_file = dir.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&tokenizer_file).map_err(|error| {
            LoadError(format!(
                "{}: cannot load: {error}",
                tokenizer_file.display()
            ))
        })?;
        let template = ChatTemplate::from_dir_or(dir, ChatTemplate::chatml())
            .map_err(|error| LoadError(error.to_string()))?;
        let config_file = dir.join("config.json");
        let max_model_len = match std::fs::read_to_string(&config_file) {
            Ok(text) => {
                let config: Value = serde_json::from_str(&text).map_err(|error| {
                    LoadError(format!("{}: invalid JSON: {error}", config_file.display()))
                })?;
                config
                    .get("max_position_embeddings")
                    .and_then(Value::as_u64)
                    .and_then(|len| u32::try_from(len).ok())
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => None,
            Err(error) => {
                return Err(LoadError(format!(
                    "{}: cannot read: {error}",
                    config_file.display()
                )))
            }
        };
        Ok(ServedModel {
            max_model_len,
            ..ServedModel::new(id, sampler, tokenizer, template)
        })
    }
}

/// What the server accepts, and how long it waits for a client (see *Connections* in the
/// [module documentation](self)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServeConfig {
    /// The largest request body (default 64 MiB).
    pub max_body_bytes: usize,
    /// Connections open at once at most (default 512); more wait in the listen backlog until one closes.
    pub max_connections: usize,
    /// How long a connection may go without sending a whole request head: idle between requests, or
    /// slow to send its headers (default 5 s, uvicorn's keep-alive timeout).
    pub keep_alive_timeout: Duration,
    /// How long a request body may take to arrive after its head (then 408), and how long a client may
    /// read nothing of its response (then it is disconnected); default 60 s.
    pub timeout: Duration,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            max_body_bytes: 64 << 20,
            max_connections: 512,
            keep_alive_timeout: Duration::from_secs(5),
            timeout: Duration::from_secs(60),
        }
    }
}

/// A bound server, not yet serving; see the [module documentation](self).
pub struct Server {
    listener: TcpListener,
    addr: SocketAddr,
    state: Arc<AppState>,
    jobs: mpsc::UnboundedReceiver<Job>,
    config: ServeConfig,
}

impl fmt::Debug for Server {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Server")
            .field("addr", &self.addr)
            .field("model", &self.state.id)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Server {
    /// Binds `addr` (`"127.0.0.1:0"` for a free port) for `model`.
    pub async fn bind(
        addr: impl ToSocketAddrs,
        model: ServedModel,
        config: ServeConfig,
    ) -> io::Result<Server> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let ServedModel {
            id,
            sampler,
            mut tokenizer,
            template,
            max_model_len,
            scheduler,
            grammars,
            tool_parser,
            reasoning_parser,
            updatable,
        } = model;
        let sources: String = template
            .template_names()
            .iter()
            .filter_map(|name| template.source(name))
            .collect();
        let tool_format = tool_parser.or_else(|| ToolFormat::detect(&sources));
        let template_takes_tools = sources.contains("tools");
        // Prompts are sent whole: a tokenizer.json that pads or truncates must not do it here.
        tokenizer.with_padding(None);
        tokenizer
            .with_truncation(None)
            .map_err(|error| io::Error::other(format!("tokenizer: {error}")))?;
        let (sender, jobs) = mpsc::unbounded_channel();
        let vocab = Vocab::new(&tokenizer);
        let state = Arc::new(AppState {
            max_prompt_bytes: max_model_len.map(|len| {
                let longest = (0..vocab.size)
                    .map(|id| vocab.bytes(id).len())
                    .max()
                    .unwrap_or(1);
                // A token stands for at most `longest` bytes of normalised text, and normalisation
                // (NFKC and the like) shrinks text by at most 4 bytes to 1.
                (len as usize)
                    .saturating_mul(longest.max(1))
                    .saturating_mul(4)
            }),
            vocab,
            weights: Weights::new(id.clone(), sampler, updatable),
            id,
            tokenizer,
            template,
            max_model_len,
            created: unix_time(),
            jobs: sender,
            seeds: AtomicU64::new(clock_nonce()),
            ids: AtomicU64::new(0),
            nonce: clock_nonce() as u32,
            connections: Arc::new(Connections::new(config.max_connections)),
            counters: Counters::default(),
            scheduler,
            grammars,
            tool_format,
            template_takes_tools,
            reasoning_parser,
            config: config.clone(),
        });
        Ok(Server {
            listener,
            addr,
            state,
            jobs,
            config,
        })
    }

    /// The bound address (the actual port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves until the process ends (or the listener fails).
    pub async fn run(self) -> io::Result<()> {
        self.run_until(std::future::pending()).await
    }

    /// Serves until `shutdown` completes, then stops accepting connections and returns once the requests
    /// in flight are answered.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> io::Result<()> {
        let Server {
            listener,
            state,
            jobs,
            config,
            ..
        } = self;
        let dispatcher = tokio::spawn(dispatch(jobs));
        let app = router(Arc::clone(&state), config.max_body_bytes);
        let result = listen::serve(listener, app, state, shutdown).await;
        // The router (and with it every job sender) is gone: the dispatcher waits for the samples in
        // flight and ends.
        let _ = dispatcher.await;
        result
    }

    /// Serves on a new task; [`ServerHandle::shutdown`] stops it.
    pub fn spawn(self) -> ServerHandle {
        let addr = self.addr;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(self.run_until(async move {
            let _ = stopped.await;
        }));
        ServerHandle {
            addr,
            stop: Some(stop),
            task,
        }
    }
}

/// A server running on a task (from [`Server::spawn`]). Dropping the handle stops the server too.
#[derive(Debug)]
pub struct ServerHandle {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<io::Result<()>>,
}

impl ServerHandle {
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, the base URL clients use (add `/v1` for the OpenAI SDKs).
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting connections, answers the requests in flight, and returns how serving ended.
    pub async fn shutdown(mut self) -> io::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match (&mut self.task).await {
            Ok(result) => result,
            Err(error) => Err(io::Error::other(format!("the server task failed: {error}"))),
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// State and routes

struct AppState {
    /// The base model's name.
    id: String,
    /// The weights requests can name, and their versions.
    weights: Weights,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    max_model_len: Option<u32>,
    vocab: Vocab,
    /// Texts longer than this many bytes cannot fit `max_model_len` (see [`AppState::tokenize`]).
    max_prompt_bytes: Option<usize>,
    created: u64,
    jobs: mpsc::UnboundedSender<Job>,
    /// splitmix64 state for the seeds of unseeded samples.
    seeds: AtomicU64,
    /// Counter for response ids.
    ids: AtomicU64,
    nonce: u32,
    connections: Arc<Connections>,
    counters: Counters,
    scheduler: Option<Arc<holo_model::SchedulerStats>>,
    grammars: Option<holo_model::Grammars>,
    /// The format replies' tool calls are read in, when known (see [`ServedModel::tool_parser`]).
    tool_format: Option<ToolFormat>,
    /// Whether the chat template mentions `tools` at all (if not, tools given to it would vanish).
    template_takes_tools: bool,
    reasoning_parser: Option<ReasoningParser>,
    config: ServeConfig,
}

impl AppState {
    /// A new answer id, which the request's log line reports.
    fn response_id(&self, prefix: &str, tally: &Tally) -> String {
        let count = self.ids.fetch_add(1, Ordering::Relaxed);
        let id = format!("{prefix}-{:08x}{count:016x}", self.nonce);
        tally.id(&id);
        id
    }

    fn fresh_seed(&self) -> u64 {
        let state = self
            .seeds
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        splitmix64(state) & (i64::MAX as u64)
    }

    /// The seed of sample `j` of a request (see the module documentation).
    fn sample_seed(&self, seed: Option<u64>, j: u32) -> u64 {
        match seed {
            Some(seed) if j == 0 => seed,
            Some(seed) => splitmix64(seed ^ splitmix64(u64::from(j))) & (i64::MAX as u64),
            None => self.fresh_seed(),
        }
    }

    /// The weights the request's `model` names (the base when absent); the answer will report their
    /// version.
    fn target(&self, fields: &Fields, tally: &Tally) -> Result<Target, ApiError> {
        let model = match fields.get("model") {
            None => None,
            Some(Value::String(model)) => Some(model.as_str()),
            Some(other) => {
                return Err(ApiError::invalid(
                    "model",
                    format!("`model` must be a string, got {}", describe(other)),
                ))
            }
        };
        let target = self.weights.target(model)?;
        tally.weight_version(target.version);
        Ok(target)
    }

    /// The ids of `text`; a text too long to fit the context in any tokenization is refused before
    /// tokenizing (which costs time and memory in proportion to its length).
    fn tokenize(
        &self,
        text: &str,
        add_special_tokens: bool,
        param: &str,
    ) -> Result<Vec<u32>, ApiError> {
        if let (Some(limit), Some(len)) = (self.max_prompt_bytes, self.max_model_len) {
            if text.len() > limit {
                return Err(ApiError::invalid(
                    param,
                    format!(
                        "This model's maximum context length is {len} tokens. However, `{param}` has {} \
                         bytes, more than any {len} tokens can spell ({limit} bytes). Please reduce it.",
                        text.len()
                    ),
                )
                .code("context_length_exceeded"));
            }
        }
        self.tokenizer
            .encode(text, add_special_tokens)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|error| {
                ApiError::invalid(param, format!("cannot tokenize `{param}`: {error}"))
            })
    }

    /// Checks what the sampler would refuse, so that it is a 400 naming its key before anything is
    /// sampled: token ids outside the vocabulary, and a constraint the sampler's grammars (when the
    /// server knows them) cannot compile.
    fn check_sampling(&self, common: &Common) -> Result<(), ApiError> {
        let params = &common.params;
        let size = self.vocab.size;
        let biased: Vec<u32> = params.logit_bias.iter().map(|&(id, _)| id).collect();
        for (key, ids) in [
            ("logit_bias", biased.as_slice()),
            ("stop_token_ids", params.stop_token_ids.as_slice()),
        ] {
            let id = ids.iter().find(|&&id| id >= size);
            if let Some(id) = id {
                return Err(ApiError::invalid(
                    key,
                    format!("`{key}` holds token id {id}, outside the vocabulary (size {size})"),
                ));
            }
        }
        self.check_constraint(common)
    }

    /// Compiles the request's constraint where the server knows the sampler's grammars.
    fn check_constraint(&self, common: &Common) -> Result<(), ApiError> {
        let (Some(grammars), Some(constraint), Some(key)) = (
            &self.grammars,
            &common.params.constraint,
            common.constraint_key,
        ) else {
            return Ok(());
        };
        grammars.compile(constraint).map(drop).map_err(|error| {
            ApiError::invalid(
                key,
                format!(
                    "`{key}` asks for {} that cannot be enforced: {error}",
                    constraint.kind()
                ),
            )
        })
    }

    /// Sends the request's samples to the sampler; sample `i` is choice `i` of the events.
    fn submit(
        &self,
        target: &Target,
        requests: Vec<Request>,
        stream: bool,
        tally: &Tally,
    ) -> Result<mpsc::UnboundedReceiver<Event>, ApiError> {
        let (events, receiver) = mpsc::unbounded_channel();
        let outlet = Outlet {
            events,
            stream,
            tally: tally.clone(),
        };
        let sampler = Arc::clone(&target.sampler);
        self.jobs
            .send(Job {
                requests,
                outlet,
                sampler,
            })
            .map_err(|_| {
                ApiError::from_sampler(SamplerError::Unavailable(
                    "the server is shutting down".into(),
                ))
            })?;
        Ok(receiver)
    }

    /// Sends the request's samples to the sampler, then waits for all of them: each sample's result,
    /// with its prompt log-probabilities when it asked for them ([`SampleParams::prompt_logprobs`]); a
    /// sampler that did not report them asked fails the request.
    async fn generate_scored(
        &self,
        target: &Target,
        requests: Vec<Request>,
        tally: &Tally,
    ) -> Result<Vec<(Completion, Option<PromptLogprobs>)>, ApiError> {
        let count = requests.len();
        let asked: Vec<bool> = requests
            .iter()
            .map(|request| request.params.prompt_logprobs.is_some())
            .collect();
        let mut events = self.submit(target, requests, false, tally)?;
        let mut results: Vec<Option<Result<Completion, SamplerError>>> =
            (0..count).map(|_| None).collect();
        let mut scored: Vec<Option<PromptLogprobs>> = vec![None; count];
        let mut missing = count;
        while missing > 0 {
            match events.recv().await {
                Some(Event::Done { choice, result }) => {
                    if results[choice].replace(result).is_none() {
                        missing -= 1;
                    }
                }
                Some(Event::Prompt {
                    choice,
                    scored: got,
                }) => scored[choice] = Some(got),
                Some(Event::Token { .. }) => {}
                None => break,
            }
        }
        results
            .into_iter()
            .zip(scored)
            .zip(asked)
            .map(|((result, scored), asked)| match (result, scored) {
                (Some(Ok(_)), None) if asked => {
                    Err(ApiError::from_sampler(SamplerError::Malformed(
                        "the sampler reported no prompt log-probabilities".into(),
                    )))
                }
                (Some(result), scored) => result
                    .map(|completion| (completion, scored))
                    .map_err(ApiError::from_sampler),
                (None, _) => Err(ApiError::from_sampler(SamplerError::Unavailable(
                    "the sampler stopped before answering".into(),
                ))),
            })
            .collect()
    }

    /// The prompt length and the `max_tokens` to sample with, checked against `max_model_len`.
    fn budget(
        &self,
        prompt_len: usize,
        requested: Option<u32>,
        default: Option<u32>,
        which: &str,
    ) -> Result<Option<u32>, ApiError> {
        let Some(limit) = self.max_model_len else {
            return Ok(requested.or(default));
        };
        let limit = limit as usize;
        let too_long = |completion: usize| {
            ApiError::invalid(
                which,
                format!(
                    "This model's maximum context length is {limit} tokens. However, you requested {} tokens \
                     ({prompt_len} in the prompt, {completion} for the completion). Please reduce the prompt \
                     or `max_tokens`.",
                    prompt_len + completion
                ),
            )
            .code("context_length_exceeded")
        };
        if prompt_len >= limit {
            return Err(too_long(requested.or(default).unwrap_or(1) as usize));
        }
        let room = (limit - prompt_len) as u32;
        match requested.or(default) {
            Some(max_tokens) if max_tokens > room => Err(too_long(max_tokens as usize)),
            Some(max_tokens) => Ok(Some(max_tokens)),
            None => Ok(Some(room)),
        }
    }
}

fn router(state: Arc<AppState>, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics::metrics))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*id}", get(one_model))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/load_lora_adapter", post(weights::load_lora_adapter))
        .route(
            "/v1/unload_lora_adapter",
            post(weights::unload_lora_adapter),
        )
        .route(
            "/update_weights_from_disk",
            post(weights::update_weights_from_disk),
        )
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

async fn health() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

async fn list_models(State(state): State<Arc<AppState>>) -> Response {
    let data = state
        .weights
        .model_objects(state.created, state.max_model_len);
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn one_model(State(state): State<Arc<AppState>>, UrlPath(id): UrlPath<String>) -> Response {
    let objects = state
        .weights
        .model_objects(state.created, state.max_model_len);
    match objects
        .into_iter()
        .find(|object| object["id"] == id.as_str())
    {
        Some(object) => Json(object).into_response(),
        None => ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "The model `{id}` does not exist; this server serves `{}`.",
                state.id
            ),
        )
        .code("model_not_found")
        .into_response(),
    }
}

async fn not_found(method: Method, uri: Uri) -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!(
            "no route {method} {}; routes: GET /health, GET /metrics, GET /v1/models, POST /v1/completions, \
             POST /v1/chat/completions, POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter, \
             POST /update_weights_from_disk",
            uri.path()
        ),
    )
    .code("not_found")
    .into_response()
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{method} is not allowed on {}", uri.path()),
    )
    .code("method_not_allowed")
    .into_response()
}

async fn completions(
    State(state): State<Arc<AppState>>,
    Extension(tally): Extension<Tally>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let response = complete(&state, &tally, body)
        .await
        .unwrap_or_else(IntoResponse::into_response);
    versioned(response, &tally)
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    Extension(tally): Extension<Tally>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let response = chat(&state, &tally, body)
        .await
        .unwrap_or_else(IntoResponse::into_response);
    versioned(response, &tally)
}

/// The answer with the version of the weights it sampled with, once the request named them.
fn versioned(mut response: Response, tally: &Tally) -> Response {
    if let Some(version) = tally.weight_versioned() {
        weights::set_version(&mut response, version);
    }
    response
}

// ---------------------------------------------------------------------------------------------------
// Small helpers

fn splitmix64(value: u64) -> u64 {
    let mut z = value.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_secs())
        .unwrap_or(0)
}

fn clock_nonce() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_nanos() as u64)
        .unwrap_or(0);
    splitmix64(nanos ^ (u64::from(std::process::id()) << 32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_alphabet_is_gpt2s() {
        let alphabet = byte_level_alphabet();
        assert_eq!(alphabet.len(), 256);
        assert_eq!(alphabet[&'Ġ'], b' ');
        assert_eq!(alphabet[&'Ċ'], b'\n');
        assert_eq!(alphabet[&'a'], b'a');
        assert_eq!(alphabet[&'Ā'], 0);
    }

    #[test]
    fn text_offsets_follow_the_lossy_decoding() {
        let e_acute = "é".as_bytes();
        let pieces = [
            b"ab".to_vec(),
            e_acute[..1].to_vec(),
            e_acute[1..].to_vec(),
            b"c".to_vec(),
            vec![0xC4],
            b"J".to_vec(),
            Vec::new(),
            b"in".to_vec(),
        ];
        // "abéc�Jin": é starts at 2 (both of its pieces), c at 3, the lone 0xC4 is � at 4, J at 5.
        assert_eq!(text_offsets(&pieces), [0, 2, 2, 3, 4, 5, 6, 6]);
        assert_eq!(text_offsets(&[]), Vec::<usize>::new());
    }

    #[test]
    fn derived_seeds_are_stable_and_distinct() {
        let seeds: Vec<u64> = (1..5u64)
            .map(|j| splitmix64(42 ^ splitmix64(j)) & (i64::MAX as u64))
            .collect();
        let again: Vec<u64> = (1..5u64)
            .map(|j| splitmix64(42 ^ splitmix64(j)) & (i64::MAX as u64))
            .collect();
        assert_eq!(seeds, again);
        let mut unique = seeds.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), seeds.len());
    }
}
