//! Experiential RL (ERL; Shi et al. 2026, "Experiential Reinforcement Learning"): a first attempt, and when
//! it fails, a reflection on it and a second attempt guided by the reflection; reflections that led to a
//! success go to a memory that later reflections read. `hol/erl.hol` is the episode; these are its
//! holotypes:
//!
//! - [`Retry`] `score=first threshold=1`: the gate. Its body (the reflection and the second attempt) runs
//!   when the reward component `first` is below the threshold, else it is skipped.
//! - [`Feedback`] `first` and [`Score`] `first`: write the feedback and the value recorded for a reward
//!   component (by a reward holotype reached earlier) into the prompt.
//! - [`Memory`] `top_k=3`: writes the most recent reflections of the [`ReflectionMemory`].
//! - [`Remember`] `reflection score=second threshold=0`: when the rollout ends with `second` above the
//!   threshold, the text of the variable `reflection` goes to the memory.
//!
//! The memory is a resource every rollout of a run shares. So that it does not depend on which rollout
//! finishes first, reflections remembered during a batch of rollouts wait until the driver calls
//! [`ReflectionMemory::commit`] after the batch (the trainer does after each generation): every rollout of
//! a batch reads the memory as it was when the batch started.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use crate::holotype::{Args, Cx, Enter, Holotype, HolotypeError};

/// A reflection in the memory, with the reward of the second attempt it led to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reflection {
    pub text: String,
    pub reward: f64,
}

#[derive(Debug, Default)]
struct MemoryState {
    capacity: usize,
    /// Oldest first.
    entries: VecDeque<Reflection>,
    /// Remembered since the last commit.
    pending: Vec<Reflection>,
}

/// ERL's cross-episode memory: at most `capacity` reflections, the oldest evicted first (ERL's FIFO;
/// `memory_size`), read most recent first. Give it to the rollouts as a resource; see the [module
/// documentation](self) for when remembered reflections become visible.
#[derive(Debug)]
pub struct ReflectionMemory {
    state: Mutex<MemoryState>,
}

impl Default for ReflectionMemory {
    /// ERL's default size, 50 reflections.
    fn default() -> Self {
        ReflectionMemory::new(50)
    }
}

impl ReflectionMemory {
    pub fn new(capacity: usize) -> Self {
        ReflectionMemory {
            state: Mutex::new(MemoryState {
                capacity,
                ..MemoryState::default()
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, MemoryState> {
        // A panic elsewhere cannot leave the state half-written: every change is one push or pop.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// How many reflections it keeps; 0 turns the memory off (ERL's `enable_memory = false`).
    pub fn capacity(&self) -> usize {
        self.state().capacity
    }

    /// Changes the capacity, evicting the oldest reflections beyond it.
    pub fn set_capacity(&self, capacity: usize) {
        let mut state = self.state();
        state.capacity = capacity;
        while state.entries.len() > capacity {
            state.entries.pop_front();
        }
    }

    /// The reflections it holds.
    pub fn len(&self) -> usize {
        self.state().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `k` most recent reflections, most recent first.
    pub fn recent(&self, k: usize) -> Vec<String> {
        self.state()
            .entries
            .iter()
            .rev()
            .take(k)
            .map(|entry| entry.text.clone())
            .collect()
    }

    /// Queues a reflection; it joins the memory at the next [`ReflectionMemory::commit`].
    pub fn remember(&self, text: &str, reward: f64) {
        self.state().pending.push(Reflection {
            text: text.to_string(),
            reward,
        });
    }

    /// Adds the queued reflections, in an order that depends only on their texts and rewards (not on
    /// which rollout finished first), evicting the oldest beyond the capacity. Returns how many were
    /// queued.
    pub fn commit(&self) -> usize {
        let mut state = self.state();
        let mut pending = std::mem::take(&mut state.pending);
        pending.sort_by(|a, b| {
            a.text
                .cmp(&b.text)
                .then_with(|| a.reward.total_cmp(&b.reward))
        });
        let added = pending.len();
        for reflection in pending {
            state.entries.push_back(reflection);
        }
        while state.entries.len() > state.capacity {
            state.entries.pop_front();
        }
        added
    }

    /// Drops the queued reflections (those of evaluation rollouts, which must not teach the run).
    pub fn discard_pending(&self) {
        self.state().pending.clear();
    }

    /// The reflections it holds, oldest first (for checkpoints).
    pub fn entries(&self) -> Vec<Reflection> {
        self.state().entries.iter().cloned().collect()
    }

    /// Replaces the reflections it holds (from a checkpoint), keeping the newest `capacity`.
    pub fn restore(&self, entries: Vec<Reflection>) {
        let mut state = self.state();
        state.entries = entries.into();
        state.pending.clear();
        while state.entries.len() > state.capacity {
            state.entries.pop_front();
        }
    }
}

fn memory_resource(args: &Args, holotype: &str) -> Result<Arc<ReflectionMemory>, HolotypeError> {
    args.resources.get::<ReflectionMemory>().ok_or_else(|| {
        HolotypeError::new(format!(
            "{holotype} needs the run's reflection memory: give the rollouts a `holo_runtime::holotypes::ReflectionMemory` resource (holo train, eval and dry do)"
        ))
    })
}

/// The reward component a tag names: its first positional word, or `score=`.
fn component(args: &Args, holotype: &str) -> Result<String, HolotypeError> {
    match (args.positional_name(holotype)?, args.name("score")?) {
        (Some(name), _) | (None, Some(name)) => Ok(name.to_string()),
        (None, None) => Err(HolotypeError::new(format!(
            "{holotype} needs the name of a reward component, as in `<|{holotype} first|>`"
        ))),
    }
}

fn recorded(cx: &Cx<'_>, name: &str, holotype: &str) -> Result<f64, HolotypeError> {
    cx.recorded_reward(name).ok_or_else(|| {
        HolotypeError::new(format!(
            "{holotype}: no reward `{name}` was recorded before this tag; put the reward holotype with `name={name}` before it"
        ))
    })
}

/// ERL's gate: runs its body (the reflection and the second attempt) when the reward component `score=`
/// (recorded by a reward holotype before the tag) is below `threshold=` (default 1); otherwise skips it.
pub struct Retry {
    score: String,
    threshold: f64,
}

impl Holotype for Retry {
    const PARAMS: &'static [&'static str] = &["score", "threshold"];

    fn new(args: &Args) -> Result<Self, HolotypeError> {
        Ok(Retry {
            score: component(args, "Retry")?,
            threshold: args.float("threshold")?.unwrap_or(1.0),
        })
    }

    fn enter(&mut self, cx: &mut Cx<'_>) -> Result<Enter, HolotypeError> {
        let value = recorded(cx, &self.score, "Retry")?;
        Ok(if value < self.threshold {
            Enter::Run
        } else {
            Enter::Skip
        })
    }
}

/// Writes the feedback recorded for a reward component (`<|Feedback first|>`), or nothing when its
/// holotype gave none (ERL's empty feedback).
pub struct Feedback {
    score: String,
}

impl Holotype for Feedback {
    const PARAMS: &'static [&'static str] = &["score"];

    fn new(args: &Args) -> Result<Self, HolotypeError> {
        Ok(Feedback {
            score: component(args, "Feedback")?,
        })
    }

    fn enter(&mut self, cx: &mut Cx<'_>) -> Result<Enter, HolotypeError> {
        recorded(cx, &self.score, "Feedback")?;
        let text = cx.recorded_feedback(&self.score).unwrap_or("").to_string();
        cx.inject(&text);
        Ok(Enter::Run)
    }
}

/// Writes the value recorded for a reward component (`<|Score first|>`), as `0`, `1` or `0.5`.
pub struct Score {
    score: String,
}

impl Holotype for Score {
    const PARAMS: &'static [&'static str] = &["score"];

    fn new(args: &Args) -> Result<Self, HolotypeError> {
        Ok(Score {
            score: component(args, "Score")?,
        })
    }

    fn enter(&mut self, cx: &mut Cx<'_>) -> Result<Enter, HolotypeError> {
        let value = recorded(cx, &self.score, "Score")?;
        cx.inject(&value.to_string());
        Ok(Enter::Run)
    }
}

/// Writes the `top_k=` (default 3) most recent reflections of the memory, most recent first, separated by
/// blank lines; `empty=` (default `None available.`) when it holds none.
pub struct Memory {
    memory: Arc<ReflectionMemory>,
    top_k: usize,
    empty: String,
}

impl Holotype for Memory {
    const PARAMS: &'static [&'static str] = &["top_k", "empty"];

    fn new(args: &Args) -> Result<Self, HolotypeError> {
        args.no_positional("Memory")?;
        Ok(Memory {
            memory: memory_resource(args, "Memory")?,
            top_k: args.count("top_k")?.unwrap_or(3) as usize,
            empty: args.text("empty")?.unwrap_or("None available.").to_string(),
        })
    }

    fn enter(&mut self, cx: &mut Cx<'_>) -> Result<Enter, HolotypeError> {
        let recent = self.memory.recent(self.top_k);
        if recent.is_empty() {
            cx.inject(&self.empty);
        } else {
            cx.inject(&recent.join("\n\n"));
        }
        Ok(Enter::Run)
    }
}

/// When the rollout ends with the reward component `score=` above `threshold=` (default 0), queues the
/// text of the variable it names (`<|Remember reflection score=second|>`) for the memory.
pub struct Remember {
    memory: Arc<ReflectionMemory>,
    variable: String,
    score: String,
    threshold: f64,
}

impl Holotype for Remember {
    const PARAMS: &'static [&'static str] = &["score", "threshold"];

    fn new(args: &Args) -> Result<Self, HolotypeError> {
        let variable = args.positional_name("Remember")?.ok_or_else(|| {
            HolotypeError::new(
                "Remember needs the variable to remember, as in `<|Remember reflection score=second|>`",
            )
        })?;
        let score = args.name("score")?.ok_or_else(|| {
            HolotypeError::new("Remember needs `score=`: the reward component that decides")
        })?;
        Ok(Remember {
            memory: memory_resource(args, "Remember")?,
            variable: variable.to_string(),
            score: score.to_string(),
            threshold: args.float("threshold")?.unwrap_or(0.0),
        })
    }

    fn end(&mut self, cx: &mut Cx<'_>) -> Result<(), HolotypeError> {
        let (Some(value), Some(text)) = (cx.recorded_reward(&self.score), cx.var(&self.variable))
        else {
            return Ok(());
        };
        if value > self.threshold {
            self.memory.remember(text, value);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_commits_in_an_order_independent_of_arrival_and_evicts_the_oldest() {
        let memory = ReflectionMemory::new(3);
        memory.remember("old", 1.0);
        assert_eq!(memory.commit(), 1);
        for text in ["c", "a", "b"] {
            memory.remember(text, 1.0);
        }
        assert!(
            memory.recent(5) == ["old"],
            "nothing is visible before the commit"
        );
        memory.commit();
        assert_eq!(memory.recent(5), ["c", "b", "a"]);
        let other = ReflectionMemory::new(3);
        other.remember("old", 1.0);
        other.commit();
        for text in ["b", "c", "a"] {
            other.remember(text, 1.0);
        }
        other.commit();
        assert_eq!(other.entries(), memory.entries());
    }

    #[test]
    fn a_memory_of_capacity_zero_keeps_nothing_and_discarded_reflections_never_arrive() {
        let memory = ReflectionMemory::new(0);
        memory.remember("a", 1.0);
        memory.commit();
        assert!(memory.is_empty());
        let memory = ReflectionMemory::new(2);
        memory.remember("eval", 1.0);
        memory.discard_pending();
        memory.commit();
        assert!(memory.is_empty());
        memory.restore(vec![
            Reflection {
                text: "x".into(),
                reward: 1.0,
            },
            Reflection {
                text: "y".into(),
                reward: 1.0,
            },
            Reflection {
                text: "z".into(),
                reward: 1.0,
            },
        ]);
        assert_eq!(memory.recent(3), ["z", "y"]);
    }
}
