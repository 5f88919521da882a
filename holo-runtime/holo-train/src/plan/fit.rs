//! Whether a plan fits the memory available, and when it does not, what does: the option that sets the
//! overflowing phase's largest term, at the largest value whose whole plan fits.

use std::fmt;

use super::{gib, Inputs, Plan};

/// A plan that does not fit, with what to change.
#[derive(Debug, Clone, PartialEq)]
pub struct Overflow {
    /// The predicted peak and the memory available, in bytes.
    pub needs: u64,
    pub available: u64,
    /// The phase at the peak and its largest term that an option sets (or its largest term).
    pub phase: &'static str,
    pub term: (&'static str, u64),
    /// The option (`per_device_train_batch_size`), its value now, and the largest value that fits.
    pub knob: Option<(&'static str, usize, Option<usize>)>,
    /// What else would shrink the plan, when no value of the option fits.
    pub advice: Vec<String>,
}

impl fmt::Display for Overflow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (needs, available) = (gib(self.needs), gib(self.available));
        let (term, bytes) = self.term;
        let cause = format!("{}: {term} {}", self.phase, gib(bytes));
        match self.knob {
            Some((key, now, Some(fits))) => write!(
                f,
                "memory plan: `--{flag} {fits}` fits; {now} needs {needs} of {available} ({cause})",
                flag = key.replace('_', "-")
            ),
            Some((key, now, None)) => write!(
                f,
                "memory plan: the run needs {needs} of {available} ({cause}), and no `--{flag}` below {now} fits{}",
                advice(&self.advice),
                flag = key.replace('_', "-")
            ),
            None => write!(
                f,
                "memory plan: the run needs {needs} of {available} ({cause}){}",
                advice(&self.advice)
            ),
        }
    }
}

fn advice(advice: &[String]) -> String {
    if advice.is_empty() {
        String::new()
    } else {
        format!("; {}", advice.join(", or "))
    }
}

/// The option that sets a phase's growing terms, how to put a value of it into the inputs, and the
/// step its values take.
struct Knob {
    key: &'static str,
    terms: &'static [&'static str],
    get: fn(&Inputs) -> usize,
    set: fn(&mut Inputs, usize),
    step: fn(&Inputs) -> usize,
}

const MICRO_BATCH: Knob = Knob {
    key: "per_device_train_batch_size",
    terms: &["activations", "head", "layer", "scoring"],
    get: |inputs| inputs.micro_batch,
    set: |inputs, value| inputs.micro_batch = value,
    step: |_| 1,
};

const GENERATION_BATCH: Knob = Knob {
    key: "generation_batch_size",
    terms: &["kv cache", "sampling"],
    get: |inputs| inputs.generation_batch,
    set: |inputs, value| inputs.generation_batch = value,
    // Whole groups, and whole micro-batches of them.
    step: |inputs| lcm(inputs.group.max(1), inputs.micro_batch.max(1)),
};

fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    a / gcd(a, b) * b
}

/// `Ok` when the plan of `inputs` peaks within `available` bytes; else what overflows and what fits.
pub fn check(inputs: &Inputs, available: u64) -> Result<(), Overflow> {
    let plan = Plan::of(inputs);
    let (phase, needs) = plan.peak();
    if needs <= available {
        return Ok(());
    }
    let knob = match phase {
        "training" | "backward" | "scoring" => Some(MICRO_BATCH),
        "generation" => Some(GENERATION_BATCH),
        _ => None,
    };
    let held = plan
        .phases()
        .into_iter()
        .find(|(name, _, _)| *name == phase)
        .map(|(_, held, _)| held)
        .unwrap_or_default();
    let largest = |names: &mut dyn Iterator<Item = &&'static str>| {
        names
            .map(|name| (*name, plan.term(name)))
            .max_by_key(|(_, bytes)| *bytes)
    };
    let term = knob
        .as_ref()
        .and_then(|knob| largest(&mut knob.terms.iter().filter(|name| held.contains(name))))
        .or_else(|| largest(&mut held.iter()))
        .unwrap_or(("weights", 0));
    let knob = knob.map(|knob| {
        let now = (knob.get)(inputs);
        let step = (knob.step)(inputs);
        let fits = (1..=now / step)
            .rev()
            .map(|count| count * step)
            .filter(|&value| value < now)
            .find(|&value| {
                let mut smaller = inputs.clone();
                (knob.set)(&mut smaller, value);
                Plan::of(&smaller).peak().1 <= available
            });
        (knob.key, now, fits)
    });
    let mut advice = Vec::new();
    if !matches!(knob, Some((_, _, Some(_)))) {
        if inputs.lora.is_none() {
            advice.push("train LoRA adapters (`--use-peft`)".to_string());
        }
        if !inputs.recompute && plan.term("activations") > 0 {
            advice.push("recompute activations (`--gradient-checkpointing`)".to_string());
        }
        if inputs.completion_tokens > 1 && phase != "loading" && phase != "update" {
            advice
                .push("shorten the sequences (`max_completion_length`, `max_length`)".to_string());
        }
    }
    Err(Overflow {
        needs,
        available,
        phase,
        term,
        knob,
        advice,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::tests::inputs;

    /// Too little memory for the micro-batch: the largest batch whose whole plan fits is named, with
    /// what the asked one needs.
    #[test]
    fn an_overflowing_micro_batch_names_the_largest_that_fits() {
        let mut run = inputs();
        run.micro_batch = 8;
        let peak = |micro_batch| {
            let mut run = run.clone();
            run.micro_batch = micro_batch;
            Plan::of(&run).peak()
        };
        assert_eq!(peak(8).0, "backward");
        // Room for 6 sequences, not 7.
        let available = peak(6).1;
        assert!(peak(7).1 > available);
        let overflow = check(&run, available).unwrap_err();
        assert_eq!(
            overflow.knob,
            Some(("per_device_train_batch_size", 8, Some(6)))
        );
        let message = overflow.to_string();
        assert!(
            message.starts_with(&format!(
                "memory plan: `--per-device-train-batch-size 6` fits; 8 needs {} of {}",
                gib(peak(8).1),
                gib(available)
            )),
            "{message}"
        );
        assert!(message.contains("(backward: activations"), "{message}");
        assert_eq!(check(&run, peak(8).1), Ok(()));
    }

    /// When the fixed terms alone overflow no batch fits, and the message says what else would.
    #[test]
    fn fixed_terms_that_overflow_get_advice() {
        let run = inputs();
        let overflow = check(&run, 1 << 20).unwrap_err();
        assert_eq!(
            overflow.knob,
            Some(("per_device_train_batch_size", 2, None))
        );
        let message = overflow.to_string();
        assert!(
            message.contains("no `--per-device-train-batch-size` below 2 fits"),
            "{message}"
        );
        assert!(message.contains("`--use-peft`"), "{message}");
    }

    /// A generation batch that overflows is cut in whole groups of whole micro-batches.
    #[test]
    fn a_generation_batch_shrinks_by_whole_groups() {
        let mut run = inputs();
        run.generation_batch = 4096;
        run.completion_tokens = 512;
        run.trained_tokens = 512;
        run.micro_batch = 1;
        let plan = Plan::of(&run);
        assert_eq!(plan.peak().0, "generation");
        let mut smaller = run.clone();
        smaller.generation_batch = 1024;
        let available = Plan::of(&smaller).peak().1;
        let overflow = check(&run, available).unwrap_err();
        assert_eq!(overflow.term.0, "kv cache");
        assert_eq!(
            overflow.knob,
            Some(("generation_batch_size", 4096, Some(1024)))
        );
    }
}
