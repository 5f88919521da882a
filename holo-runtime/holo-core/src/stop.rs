//! Stop strings and text decoded a token at a time: what every sampler that ends a completion at a
//! stop string shares (the local model's engine, `holo serve`'s streams, the Tinker sampler), so that
//! each cuts where the others cut.

use aho_corasick::automaton::{Automaton, StateID};
use aho_corasick::nfa::contiguous::NFA;
use aho_corasick::Anchored;
use tokenizers::Tokenizer;

/// The stop string that ends first among those that end in `text[new..]` (the earliest start among
/// those ending together), and where it starts: with `new` the length of the text already searched,
/// the matches the new text completes. Each stop string is searched only where it could hold a new
/// byte (from `new - (its length - 1)`, moved back to a character boundary), so a search costs the
/// stop strings' length once plus the new text per stop string, not the whole text; a stop string
/// longer than the text is skipped. Empty stop strings never match.
pub fn first_stop<'s>(text: &str, new: usize, stops: &'s [String]) -> Option<(usize, &'s String)> {
    let new = new.min(text.len());
    stops
        .iter()
        .filter(|stop| !stop.is_empty() && stop.len() <= text.len())
        .filter_map(|stop| {
            let from = floor_char_boundary(text, new.saturating_sub(stop.len() - 1));
            text[from..].find(stop.as_str()).map(|at| (from + at, stop))
        })
        .min_by_key(|(at, stop)| (*at + stop.len(), *at))
}

/// The largest character boundary of `text` at or before `index` (at most its length).
pub fn floor_char_boundary(text: &str, index: usize) -> usize {
    let mut index = index.min(text.len());
    while !text.is_char_boundary(index) {
        index -= 1;
    }
    index
}

/// Text decoded one token at a time, as `Tokenizer::decode` (special tokens skipped) decodes the whole
/// sequence: tokenizers' stream decoder, which holds back a token that ends inside a character.
#[derive(Debug, Default)]
pub struct StreamedText {
    window: Vec<u32>,
    prefix: String,
    prefix_index: usize,
    text: String,
}

impl StreamedText {
    /// Adds `token`; the text it completes, if any. An error means the decoder cannot go on (a tokenizer
    /// whose decoding of a sequence does not extend that of its prefix).
    pub fn push(&mut self, tokenizer: &Tokenizer, token: u32) -> Result<Option<&str>, String> {
        let piece = tokenizers::tokenizer::step_decode_stream(
            tokenizer,
            vec![token],
            true,
            &mut self.window,
            &mut self.prefix,
            &mut self.prefix_index,
        )
        .map_err(|error| format!("cannot decode token {token}: {error}"))?;
        Ok(piece.map(|piece| {
            self.text.push_str(&piece);
            &self.text[self.text.len() - piece.len()..]
        }))
    }

    pub fn text(&self) -> &str {
        &self.text
    }
}

/// Stop strings matched as a text grows: an Aho-Corasick automaton over their bytes, built once, whose
/// state is carried from piece to piece, so that each new byte is looked at once whatever the number and
/// length of the stop strings (the cost of a step is its new text). Empty stop strings never match.
#[derive(Clone)]
pub struct StopMatcher {
    /// Shared by the matchers of one request's choices ([`Clone`] copies the state only).
    automaton: std::sync::Arc<NFA>,
    state: StateID,
}

impl StopMatcher {
    /// `None` when no stop string can match (all empty), or the automaton cannot be built.
    pub fn new(stops: &[String]) -> Option<Self> {
        let patterns: Vec<&str> = stops
            .iter()
            .map(String::as_str)
            .filter(|stop| !stop.is_empty())
            .collect();
        if patterns.is_empty() {
            return None;
        }
        let automaton = NFA::new(patterns).ok()?;
        let state = automaton.start_state(Anchored::No).ok()?;
        Some(StopMatcher {
            automaton: std::sync::Arc::new(automaton),
            state,
        })
    }

    /// Adds `piece` to the text; whether a stop string ends inside it.
    pub fn feed(&mut self, piece: &str) -> bool {
        for &byte in piece.as_bytes() {
            self.state = self.automaton.next_state(Anchored::No, self.state, byte);
            if self.automaton.is_match(self.state) {
                return true;
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Searching each new piece of a growing text finds the stop a search of the whole text finds,
        /// when the piece that completes it arrives, and nothing before.
        #[test]
        fn incremental_stop_search_equals_the_whole_search(
            pieces in proptest::collection::vec("[abé]{0,4}", 1..12),
            stops in proptest::collection::vec("[abé]{0,5}", 0..4),
        ) {
            let mut text = String::new();
            let mut searched = 0;
            for piece in &pieces {
                text.push_str(piece);
                let incremental = first_stop(&text, searched, &stops);
                searched = text.len();
                let whole = first_stop(&text, 0, &stops);
                match incremental {
                    Some(found) => {
                        proptest::prop_assert_eq!(Some(found), whole);
                        break;
                    }
                    None => proptest::prop_assert_eq!(whole, None),
                }
            }
        }
    }

    /// The first stop to end in `text`, the obvious way: every end position in order.
    fn naive_first_stop<'s>(text: &str, stops: &'s [String]) -> Option<(usize, &'s String)> {
        (1..=text.len()).find_map(|end| {
            stops
                .iter()
                .filter(|stop| {
                    !stop.is_empty() && text.as_bytes()[..end].ends_with(stop.as_bytes())
                })
                .max_by_key(|stop| stop.len())
                .map(|stop| (end - stop.len(), stop))
        })
    }

    proptest::proptest! {
        /// The automaton fed piece by piece says a stop string has ended exactly at the first piece after
        /// which the text so far holds one.
        #[test]
        fn the_stop_matcher_fires_where_the_text_first_holds_a_stop(
            pieces in proptest::collection::vec("[abé]{0,4}", 1..12),
            stops in proptest::collection::vec("[abé]{0,5}", 0..4),
        ) {
            let mut matcher = StopMatcher::new(&stops);
            let mut text = String::new();
            for piece in &pieces {
                text.push_str(piece);
                let fired = matcher.as_mut().is_some_and(|matcher| matcher.feed(piece));
                let holds = stops.iter().any(|stop| !stop.is_empty() && text.contains(stop.as_str()));
                proptest::prop_assert_eq!(fired, holds, "after {:?}", text);
                if holds {
                    break;
                }
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn the_whole_search_is_the_naive_one(
            text in "[abé]{0,12}",
            stops in proptest::collection::vec("[abé]{0,5}", 0..4),
        ) {
            proptest::prop_assert_eq!(first_stop(&text, 0, &stops), naive_first_stop(&text, &stops));
        }
    }
}
