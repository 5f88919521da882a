//! Constrained decoding: a [`Constraint`] compiled by llguidance against the model's vocabulary, and
//! each constrained row's parser, which says at every step which tokens may come next.
//!
//! A constrained row is drawn on the host (never by `draw.rs`): its logits are masked (every token the
//! grammar does not allow set to `-inf`) and the token is drawn from what is left, with the row's own
//! temperature, top-k and top-p, so the log-probabilities recorded are those of the masked distribution
//! the token was actually drawn from. The end-of-turn tokens are allowed only where the grammar accepts
//! the text so far, so a row that ends its turn holds a sentence of the grammar.
//!
//! Training replays a constrained row's sampled tokens through the same parser ([`Grammar::replay`]):
//! what it allowed at each position ([`Allowed`]) masks the training head's logits there, so that the
//! trainer's log-probabilities are the masked distribution's, as the sampler's were. Replaying costs a
//! parser step per token; storing the masks instead would cost a bit per vocabulary entry per token
//! (19 KB a token at Qwen's 151,936) in every record.

use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use holo_core::json::json_layout;
use holo_core::{Allowed, Constraint};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use tokenizers::Tokenizer;

use super::model::Result;

/// Compiles constraints for one model: its tokenizer's tokens as bytes, its logits' width and its
/// end-of-turn tokens. The token trie is built at the first compile (a fraction of a second for a
/// 150k-token vocabulary) and shared by clones.
#[derive(Clone)]
pub struct Grammars {
    shared: Arc<Shared>,
}

struct Shared {
    tokenizer: Tokenizer,
    vocab: usize,
    end_of_turn: Vec<u32>,
    factory: OnceLock<std::result::Result<ParserFactory, String>>,
}

impl fmt::Debug for Grammars {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grammars")
            .field("vocab", &self.shared.vocab)
            .field("end_of_turn", &self.shared.end_of_turn)
            .finish_non_exhaustive()
    }
}

impl Grammars {
    /// Grammars over `tokenizer`'s tokens, for logits of `vocab` entries, ended by `end_of_turn`.
    pub fn new(tokenizer: Tokenizer, vocab: usize, end_of_turn: Vec<u32>) -> Grammars {
        Grammars {
            shared: Arc::new(Shared {
                tokenizer,
                vocab,
                end_of_turn,
                factory: OnceLock::new(),
            }),
        }
    }

    /// `constraint` compiled, or why it cannot be (a schema, regex or grammar llguidance refuses, with
    /// its reason).
    pub fn compile(&self, constraint: &Constraint) -> std::result::Result<Grammar, String> {
        let factory = self
            .shared
            .factory
            .get_or_init(|| build_factory(&self.shared))
            .as_ref()
            .map_err(Clone::clone)?;
        let grammar = match constraint {
            Constraint::JsonObject => TopLevelGrammar::from_json_schema(json_layout(
                serde_json::json!({"type": "object"}),
            )),
            Constraint::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(json_layout(schema.clone()))
            }
            Constraint::Regex(regex) => TopLevelGrammar::from_regex(regex),
            Constraint::Choice(choices) => {
                if choices.is_empty() {
                    return Err("a choice needs at least one text".into());
                }
                let alternatives: Vec<String> =
                    choices.iter().map(|text| regex_literal(text)).collect();
                TopLevelGrammar::from_regex(&alternatives.join("|"))
            }
            Constraint::Lark(grammar) => TopLevelGrammar::from_lark(grammar.clone()),
        };
        let parser = factory
            .create_parser(grammar)
            .map_err(|error| error.to_string())?;
        let mut matcher = Matcher::new(Ok(parser));
        // A grammar that allows nothing at its start (an empty language) is refused here rather than
        // failing its rows.
        let allowed = matcher.compute_mask().map_err(|error| error.to_string())?;
        if allowed.is_zero() {
            return Err("the grammar allows no text at all".into());
        }
        Ok(Grammar {
            start: Arc::new(Mutex::new(matcher)),
            end_of_turn: self.shared.end_of_turn.clone(),
        })
    }

    /// Compiles every sampler constraint of `holoware` against the vocabulary, before any rollout: one
    /// llguidance refuses (a Lark grammar's mistake, a schema feature it lacks) is an error that names
    /// its tag's `file.hol:line:col`, where holoc's checks could not see it.
    pub fn check(
        &self,
        holoware: &holo_core::interpreter::Holoware,
    ) -> std::result::Result<(), String> {
        for (location, constraint) in holoware.constraints() {
            if let Err(error) = self.compile(&constraint) {
                return Err(format!(
                    "{location}: the sampler's constraint, {}, does not compile: {error}",
                    constraint.kind()
                ));
            }
        }
        Ok(())
    }

    /// [`Grammars::check`] for the constraints that data rows give a holoware's samplers (a
    /// `json_schema=name`, `regex=name` or `grammar=name` whose variable is an input,
    /// [`Holoware::row_constraints`](holo_core::interpreter::Holoware::row_constraints)), before any
    /// rollout, each distinct one compiled once. Every row that gives one the sampler cannot use (a
    /// value that is no schema, regex or grammar, or one llguidance refuses) is named, by the label it
    /// comes with, and the tag's `file.hol:line:col`: the messages, in the rows' order.
    pub fn check_rows<'r, L: fmt::Display>(
        &self,
        holoware: &holo_core::interpreter::Holoware,
        rows: impl IntoIterator<Item = (L, &'r holo_core::interpreter::Row)>,
    ) -> std::result::Result<(), Vec<String>> {
        // Each distinct constraint with why it does not compile, if it does not: a refused schema that
        // many rows share is compiled once too.
        let mut compiled: Vec<(Constraint, Option<String>)> = Vec::new();
        let mut refused = Vec::new();
        for (label, row) in rows {
            let row_constraints = match holoware.row_constraints(row) {
                Ok(row_constraints) => row_constraints,
                Err(error) => {
                    refused.push(format!("{label}: {error}"));
                    continue;
                }
            };
            for (location, constraint) in row_constraints {
                let known = compiled.iter().position(|(known, _)| *known == constraint);
                let index = known.unwrap_or_else(|| {
                    let why = self.compile(&constraint).err();
                    compiled.push((constraint, why));
                    compiled.len() - 1
                });
                let (constraint, why) = &compiled[index];
                if let Some(why) = why {
                    refused.push(format!(
                        "{label}: {location}: the sampler's constraint, {}, does not compile: {why}",
                        constraint.kind()
                    ));
                    break;
                }
            }
        }
        if refused.is_empty() {
            Ok(())
        } else {
            Err(refused)
        }
    }
}

/// `text` as a regular expression that matches it alone.
fn regex_literal(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// The trie of the tokenizer's tokens, and llguidance's factory over it. llguidance's reading of a
/// `tokenizer.json` asserts on forms it does not expect: a panic there is an error here.
fn build_factory(shared: &Shared) -> std::result::Result<ParserFactory, String> {
    let json = shared
        .tokenizer
        .to_string(false)
        .map_err(|error| format!("cannot write the tokenizer as JSON: {error}"))?;
    let json: serde_json::Value = serde_json::from_str(&json)
        .map_err(|error| format!("cannot read the tokenizer's JSON: {error}"))?;
    let words = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json))
        .map_err(|_| "llguidance cannot read this tokenizer's tokens".to_string())?
        .map_err(|error| format!("llguidance cannot read this tokenizer's tokens: {error}"))?;
    let mut words: Vec<Vec<u8>> = words.into_iter().take(shared.vocab).collect();
    // Logits wider than the tokenizer (padded embeddings) end in tokens no text spells: named
    // special tokens that no grammar allows.
    while words.len() < shared.vocab {
        let mut name = format!(".<[{}]>", words.len()).into_bytes();
        name[0] = TokTrie::SPECIAL_TOKEN_MARKER;
        words.push(name);
    }
    let Some(&eos) = shared.end_of_turn.first() else {
        return Err("the model has no end-of-turn token to end a constrained reply with".into());
    };
    let info = TokRxInfo::new(shared.vocab as u32, eos);
    let trie = TokTrie::from(&info, &words).with_eos_tokens(&shared.end_of_turn);
    let env: TokEnv = Arc::new(Vocabulary {
        trie,
        tokenizer: shared.tokenizer.clone(),
    });
    let mut factory = ParserFactory::new_simple(&env).map_err(|error| error.to_string())?;
    // Grammar warnings and errors reach the client in the error message, not on stderr.
    factory.quiet();
    Ok(factory)
}

/// The tokenizer as llguidance sees it: the trie of token bytes, and tokenization of the literal texts
/// a grammar holds.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, bytes: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(bytes, |text| {
            self.tokenizer
                .encode(text, false)
                .map(|encoding| encoding.get_ids().to_vec())
                // The trie's greedy tokenization stands in where the tokenizer fails.
                .unwrap_or_else(|_| self.trie.greedy_tokenize(text.as_bytes()))
        })
    }
}

/// A compiled constraint; each row that samples under it starts its own parser from it.
#[derive(Clone)]
pub struct Grammar {
    start: Arc<Mutex<Matcher>>,
    /// The tokens the grammar allows where a sentence is complete, which end it.
    end_of_turn: Vec<u32>,
}

impl fmt::Debug for Grammar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Grammar")
    }
}

/// The same compiled grammar (the one a request's rows share).
impl PartialEq for Grammar {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.start, &other.start)
    }
}

impl Grammar {
    /// What the grammar allowed at each position of `tokens`, a row drawn under it from its start:
    /// the masks its sampler drew them under. Tokens the grammar does not allow (a sampler that did not
    /// enforce it) are an error.
    pub fn replay(&self, tokens: &[u32]) -> Result<Vec<Allowed>> {
        let mut row = self.start();
        tokens
            .iter()
            .map(|&token| {
                let allowed = row.allowed()?;
                if !allowed.is_allowed(token) {
                    return Err(candle_core::Error::Msg(format!(
                        "constrained decoding: token {token} was sampled where the constraint does not \
                         allow it"
                    )));
                }
                row.advance(token)?;
                Ok(Allowed::from_words(allowed.as_slice(), allowed.len()))
            })
            .collect()
    }

    /// A parser at the grammar's start, for one row.
    pub(super) fn start(&self) -> Constrained {
        let matcher = self
            .start
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .deep_clone();
        Constrained {
            matcher,
            end_of_turn: self.end_of_turn.clone(),
        }
    }
}

/// One row's parser: where the row's text is in the grammar.
pub(super) struct Constrained {
    matcher: Matcher,
    end_of_turn: Vec<u32>,
}

impl Constrained {
    /// The tokens the grammar allows next (the end-of-turn tokens only where the grammar accepts the
    /// text so far).
    fn allowed(&mut self) -> Result<SimpleVob> {
        self.matcher
            .compute_mask_or_eos()
            .map_err(|error| candle_core::Error::Msg(format!("constrained decoding: {error}")))
    }

    /// Whether the text so far is a sentence of the grammar (it may go on).
    pub(super) fn accepts(&mut self) -> Result<bool> {
        self.matcher
            .is_accepting()
            .map_err(|error| candle_core::Error::Msg(format!("constrained decoding: {error}")))
    }

    /// `logits` with every token the grammar does not allow next at `-inf`.
    pub(super) fn mask(&mut self, logits: &[f32]) -> Result<Vec<f32>> {
        let allowed = self.allowed()?;
        let masked: Vec<f32> = logits
            .iter()
            .enumerate()
            .map(|(id, &logit)| match allowed.is_allowed(id as TokenId) {
                true => logit,
                false => f32::NEG_INFINITY,
            })
            .collect();
        if masked.iter().all(|logit| *logit == f32::NEG_INFINITY) {
            return Err(candle_core::Error::Msg(
                "constrained decoding: the grammar allows no token here".into(),
            ));
        }
        Ok(masked)
    }

    /// Moves the parser past `token`. An end-of-turn token is not part of the text: it ends the row
    /// (or, with `ignore_eos`, leaves the parser where it is, complete, allowing only more of them).
    pub(super) fn advance(&mut self, token: u32) -> Result<()> {
        if self.end_of_turn.contains(&token) {
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|error| candle_core::Error::Msg(format!("constrained decoding: {error}")))
    }
}

#[cfg(test)]
mod tests {
    use holo_core::machine::{Completion, Finish};
    use holo_core::sampler::{Prompt, Request, SampleParams};
    use serde_json::{json, Value};

    use super::*;
    use crate::LocalModel;

    use crate::testing::random_local_model;

    /// `count` replies under `constraint`, sampled at temperature 1 with seeds 0, 1, …
    fn replies(model: &LocalModel, constraint: Constraint, count: u64) -> Vec<Completion> {
        replies_of(model, constraint, count, 96)
    }

    /// [`replies`] of at most `max_tokens` tokens.
    fn replies_of(
        model: &LocalModel,
        constraint: Constraint,
        count: u64,
        max_tokens: u32,
    ) -> Vec<Completion> {
        let params = SampleParams {
            max_tokens: Some(max_tokens),
            constraint: Some(constraint),
            ..SampleParams::default()
        };
        replies_with(model, params, count)
    }

    /// `count` replies with `params`, sampled at temperature 1 with seeds 0, 1, …
    fn replies_with(model: &LocalModel, params: SampleParams, count: u64) -> Vec<Completion> {
        let requests: Vec<Request> = (0..count)
            .map(|seed| Request {
                prompt: Prompt::Text("Answer:".into()),
                params: SampleParams {
                    temperature: Some(1.0),
                    seed: Some(seed),
                    ..params.clone()
                },
            })
            .collect();
        model
            .sample_blocking(&requests)
            .into_iter()
            .map(|result| result.unwrap())
            .collect()
    }

    fn ended(completion: &Completion) {
        assert_eq!(completion.finish, Finish::EndOfTurn, "{completion:?}");
        assert!(
            completion
                .logprobs
                .iter()
                .all(|lp| lp.is_finite() && *lp <= 0.0),
            "{completion:?}"
        );
    }

    #[test]
    fn every_reply_of_a_random_model_validates_against_its_schema() {
        let model = random_local_model();
        let schema = json!({
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "rain": {"type": "boolean"},
                "note": {"type": "string", "maxLength": 5},
            },
            "required": ["city", "days", "rain", "note"],
            "additionalProperties": false,
        });
        for completion in replies(&model, Constraint::JsonSchema(schema), 12) {
            ended(&completion);
            let reply: Value = serde_json::from_str(&completion.text).unwrap();
            let object = reply.as_object().unwrap();
            assert_eq!(object.len(), 4, "{reply}");
            assert!(["Paris", "Tokyo", "Lima"].contains(&reply["city"].as_str().unwrap()));
            assert!(
                (1..=7).contains(&reply["days"].as_i64().unwrap()),
                "{reply}"
            );
            assert!(reply["rain"].is_boolean(), "{reply}");
            assert!(
                reply["note"].as_str().unwrap().chars().count() <= 5,
                "{reply}"
            );
            // Python's layout: the separators and nothing else between tokens.
            assert!(
                completion.text.starts_with("{\"city\": \""),
                "{}",
                completion.text
            );
        }
    }

    #[test]
    fn regexes_choices_and_lark_grammars_hold_every_reply() {
        let model = random_local_model();
        for completion in replies(&model, Constraint::Regex("(yes|no) [0-9]{1,3}".into()), 8) {
            ended(&completion);
            let (word, number) = completion.text.split_once(' ').unwrap();
            assert!(["yes", "no"].contains(&word), "{}", completion.text);
            assert!((1..=3).contains(&number.len()), "{}", completion.text);
            assert!(
                number.bytes().all(|b| b.is_ascii_digit()),
                "{}",
                completion.text
            );
        }
        let choices = vec!["alpha".to_string(), "beta (2)".into(), "a.b|c".into()];
        for completion in replies(&model, Constraint::Choice(choices.clone()), 8) {
            ended(&completion);
            assert!(choices.contains(&completion.text), "{}", completion.text);
        }
        let lark = "start: \"(\" pair (\", \" pair)? \")\"\npair: KEY \"=\" %json {\"type\": \"integer\", \"minimum\": 0, \"maximum\": 99}\nKEY: /[a-z]/\n";
        for completion in replies(&model, Constraint::Lark(lark.into()), 8) {
            ended(&completion);
            let text = &completion.text;
            let inner = text
                .strip_prefix('(')
                .and_then(|t| t.strip_suffix(')'))
                .unwrap();
            for pair in inner.split(", ") {
                let (key, value) = pair.split_once('=').unwrap();
                assert!(
                    key.len() == 1 && key.as_bytes()[0].is_ascii_lowercase(),
                    "{text}"
                );
                assert!(value.parse::<u32>().unwrap() <= 99, "{text}");
            }
        }
    }

    /// Where the grammar leaves one token, the masked distribution gives it probability 1: the
    /// log-probabilities reported are the masked distribution's, not the model's.
    #[test]
    fn a_forced_token_has_log_probability_zero() {
        let model = random_local_model();
        let tokenizer = model.tokenizer();
        let x = tokenizer.token_to_id("x").unwrap();
        let end = tokenizer.token_to_id("<|im_end|>").unwrap();
        for completion in replies(&model, Constraint::Regex("x".into()), 3) {
            assert_eq!(completion.tokens, [x, end]);
            assert_eq!(completion.logprobs, [0.0, 0.0]);
            assert_eq!(completion.text, "x");
        }
    }

    /// Under a constraint the grammar decides where the text ends: a stop string inside text the
    /// grammar is still in (the fence's closing tag as a JSON string's content) does not end the row;
    /// the one the grammar ends with does, and the reply is the whole sentence.
    #[test]
    fn a_stop_string_ends_a_constrained_reply_only_where_its_grammar_accepts() {
        let model = random_local_model();
        let schema = json_layout(json!({
            "type": "object",
            "properties": {"tag": {"enum": ["</answer>"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["tag", "n"],
            "additionalProperties": false,
        }));
        let params = SampleParams {
            max_tokens: Some(64),
            stop: vec!["</answer>".into()],
            constraint: Some(Constraint::Lark(format!(
                "start: %json {schema} \"</answer>\"\n"
            ))),
            ..SampleParams::default()
        };
        for completion in replies_with(&model, params, 4) {
            assert_eq!(
                completion.finish,
                Finish::Stop("</answer>".into()),
                "{completion:?}"
            );
            let json = completion.text.strip_suffix("</answer>").unwrap();
            let reply: Value = serde_json::from_str(json).unwrap();
            assert_eq!(reply["tag"], "</answer>", "{reply}");
            // The row's last token ends the text: nothing was sampled past the stop.
            let decoded = model.tokenizer().decode(&completion.tokens, true).unwrap();
            assert_eq!(decoded, completion.text);
        }
    }

    /// The grammars of `tool_choice: "required"` hold every reply to well-formed calls of the
    /// functions given, in the family's own format.
    #[test]
    fn forced_tool_calls_parse_back_in_every_format() {
        use holo_core::tools::{Function, ToolFormat};

        let model = random_local_model();
        let functions = [
            Function {
                name: "get_weather".into(),
                parameters: json!({
                    "type": "object",
                    "properties": {"city": {"enum": ["Paris", "Lima"]}},
                    "required": ["city"],
                    "additionalProperties": false,
                }),
            },
            Function {
                name: "ping".into(),
                parameters: json!({"type": "object", "properties": {}, "additionalProperties": false}),
            },
        ];
        for format in [ToolFormat::Hermes, ToolFormat::Llama3Json] {
            for parallel in [false, true] {
                let grammar = format.grammar(&functions, parallel, |_| None).unwrap();
                // The test tokenizer spells `<tool_call>` in 7 tokens: a call is some 45.
                let mut ended_turns = 0;
                for completion in replies_of(&model, Constraint::Lark(grammar), 6, 250) {
                    // Noise may go on calling past any budget when more calls are allowed.
                    if parallel && completion.finish == Finish::Length {
                        continue;
                    }
                    ended(&completion);
                    ended_turns += 1;
                    let reply = format
                        .parse(&completion.text)
                        .unwrap_or_else(|| panic!("{format:?}: no calls in {:?}", completion.text));
                    assert!(parallel || reply.calls.len() == 1, "{reply:?}");
                    for call in reply.calls {
                        match call.name.as_str() {
                            "get_weather" => assert!(["Paris", "Lima"]
                                .contains(&call.arguments["city"].as_str().unwrap())),
                            "ping" => assert_eq!(call.arguments, json!({})),
                            other => panic!("{other}"),
                        }
                    }
                }
                assert!(ended_turns > 0, "{format:?}: no reply ended its turn");
            }
        }
    }

    /// With `ignore_eos` a complete reply goes on with end-of-turn tokens, the only ones its grammar
    /// allows, to its length.
    #[test]
    fn a_complete_reply_that_ignores_its_end_repeats_it() {
        let model = random_local_model();
        let tokenizer = model.tokenizer();
        let x = tokenizer.token_to_id("x").unwrap();
        let end = tokenizer.token_to_id("<|im_end|>").unwrap();
        let request = Request {
            prompt: Prompt::Text("Answer:".into()),
            params: SampleParams {
                max_tokens: Some(3),
                ignore_eos: true,
                constraint: Some(Constraint::Regex("x".into())),
                ..SampleParams::default()
            },
        };
        let completion = model.sample_blocking(&[request]).pop().unwrap().unwrap();
        assert_eq!(completion.tokens, [x, end, end]);
        assert_eq!(
            (completion.text.as_str(), &completion.finish),
            ("x", &Finish::Length)
        );
    }

    /// Schemas from data rows compile before any rollout: each row that gives one llguidance refuses,
    /// or no schema, is named with its tag.
    #[test]
    fn schemas_from_rows_compile_before_any_rollout() {
        use holo_core::interpreter::{Holoware, Row};

        let model = random_local_model();
        let source = b"<|o_o|>\nAnswer.\n<|@_@:answer <>answer json_schema=schema|>\n";
        let registry = std::sync::Arc::new(holo_core::holotypes::registry());
        let holoware = Holoware::load("schema.hol", source, registry).unwrap();
        let row =
            |schema: Value| -> Row { serde_json::from_value(json!({"schema": schema})).unwrap() };
        let good = [
            row(json!({"type": "integer"})),
            row(json!({"enum": ["a", "b"]})),
        ];
        let labelled = |rows: &[&Row]| -> Vec<(String, Row)> {
            rows.iter()
                .enumerate()
                .map(|(index, row)| (format!("rows.jsonl:{}", index + 1), (*row).clone()))
                .collect()
        };
        let check = |rows: &[&Row]| {
            let rows = labelled(rows);
            model
                .grammars()
                .check_rows(&holoware, rows.iter().map(|(label, row)| (label, row)))
        };
        check(&[&good[0], &good[1]]).unwrap();
        let refused = row(json!({"$ref": "https://example.com/schema.json"}));
        let not_schema = row(json!("[1]"));
        let errors = check(&[&good[0], &refused, &not_schema, &refused]).unwrap_err();
        assert_eq!(errors.len(), 3, "{errors:?}");
        // The refused schema is named at each row that gives it.
        for (error, line) in [(&errors[0], 2), (&errors[2], 4)] {
            assert!(
                error.starts_with(&format!(
                    "rows.jsonl:{line}: schema.hol:3:1: the sampler's constraint, a Lark grammar, does not compile"
                )),
                "{error}"
            );
        }
        assert!(
            errors[1].starts_with(
                "rows.jsonl:3: schema.hol:3:1: `schema`, the sampler's json_schema, is not"
            ),
            "{}",
            errors[1]
        );

        // A row's grammar (`grammar=rules`) is compiled as its schema is.
        let source = b"<|o_o|>\nAnswer.\n<|@_@:answer grammar=rules|>\n";
        let registry = std::sync::Arc::new(holo_core::holotypes::registry());
        let holoware = Holoware::load("rules.hol", source, registry).unwrap();
        let rows: Vec<Row> = ["start: /[0-9]+/", "start: undefined_rule"]
            .map(|rules| serde_json::from_value(json!({ "rules": rules })).unwrap())
            .to_vec();
        let errors = model
            .grammars()
            .check_rows(&holoware, rows.iter().enumerate())
            .unwrap_err();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].starts_with(
                "1: rules.hol:3:1: the sampler's constraint, a Lark grammar, does not compile"
            ) && errors[0].contains("undefined_rule"),
            "{}",
            errors[0]
        );
    }

    #[test]
    fn a_grammar_llguidance_refuses_is_an_error_that_says_why() {
        let model = random_local_model();
        let error = model
            .grammars()
            .compile(&Constraint::Lark("start: undefined_rule".into()))
            .unwrap_err();
        assert!(error.contains("undefined_rule"), "{error}");
        let error = model
            .grammars()
            .compile(&Constraint::JsonSchema(
                json!({"type": "object", "$ref": "https://example.com/s.json"}),
            ))
            .unwrap_err();
        assert!(error.contains("$ref") || error.contains("ref"), "{error}");
        let error = model
            .grammars()
            .compile(&Constraint::Regex("(".into()))
            .unwrap_err();
        assert!(!error.is_empty());
    }
}
