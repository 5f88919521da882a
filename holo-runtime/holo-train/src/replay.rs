//! Constrained runs replayed: what each constraint allowed at each token it drew, recomputed by its
//! parser from the tokens themselves, so that the loss scores them under the masked distribution the
//! sampler drew them from (the head's masks, [`holo_model::Model::constrained_head_scores`]).
//!
//! Replaying costs one parser step per constrained token at each step; recording the masks instead
//! would cost a bit per vocabulary entry per token in every record (19 KB a token at Qwen's 151,936).
//! The masks of a generation are kept while it trains, one copy of each distinct set: most positions
//! of a constrained run allow what others do (every character of a JSON string, every digit of a
//! number), so a generation holds far fewer copies than it has constrained tokens.

use std::collections::HashSet;

use holo_core::{Allowed, Constraint};
use holo_model::{Grammar, Grammars};

use super::batch::{Completion, Sequence};
use super::error::TrainError;

/// Sets each constrained sequence's masks ([`super::batch::Constraints::allowed`]) from its runs,
/// compiling each distinct constraint once. A constraint the model cannot compile, or a token it does
/// not allow (a sampler that did not enforce it), is an error that says which.
pub fn replay(grammars: &Grammars, completions: &mut [Completion]) -> Result<(), TrainError> {
    replay_sequences(
        grammars,
        completions.iter_mut().flat_map(|c| &mut c.sequences),
    )
}

/// [`replay`] on sequences outside a completion (`holo view`'s policy scores).
pub fn replay_sequences<'a>(
    grammars: &Grammars,
    sequences: impl IntoIterator<Item = &'a mut Sequence>,
) -> Result<(), TrainError> {
    let mut compiled: Vec<(Constraint, Grammar)> = Vec::new();
    let mut distinct: HashSet<Allowed> = HashSet::new();
    for sequence in sequences {
        if sequence.constraints.is_empty() || !sequence.constraints.allowed.is_empty() {
            continue;
        }
        let mut masks = Vec::with_capacity(sequence.constraints.runs.len());
        for run in &sequence.constraints.runs {
            let grammar = match compiled.iter().find(|(c, _)| *c == run.constraint) {
                Some((_, grammar)) => grammar.clone(),
                None => {
                    let grammar = grammars.compile(&run.constraint).map_err(|error| {
                        TrainError::Input(format!(
                            "cannot compile {}: {error}",
                            run.constraint.kind()
                        ))
                    })?;
                    compiled.push((run.constraint.clone(), grammar.clone()));
                    grammar
                }
            };
            let tokens = sequence
                .ids
                .get(run.start..run.start + run.len)
                .ok_or_else(|| {
                    TrainError::Input(format!(
                        "a constrained run ends at {} in a sequence of {} tokens",
                        run.start + run.len,
                        sequence.ids.len()
                    ))
                })?;
            let replayed = grammar.replay(tokens).map_err(|error| {
                TrainError::Input(format!("replaying {}: {error}", run.constraint.kind()))
            })?;
            masks.push(
                replayed
                    .into_iter()
                    .map(|mask| match distinct.get(&mask) {
                        Some(kept) => kept.clone(),
                        None => {
                            distinct.insert(mask.clone());
                            mask
                        }
                    })
                    .collect(),
            );
        }
        sequence.constraints.replayed(&sequence.trained, masks);
    }
    Ok(())
}
