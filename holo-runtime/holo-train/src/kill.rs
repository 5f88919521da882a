//! A debug hook for crash tests: `HOLO_KILL_AT=NAME[@N]` kills the process with SIGKILL the `N`-th time
//! (default the first) it reaches the named point, so that a test can stop a run at an exact place
//! inside a checkpoint write, which a signal sent from outside hits only by chance.
//!
//! The points ([`point`]) are, in the order a save reaches them ([`checkpoint::save`]):
//! - `checkpoint:staging`: the temporary folder created, still empty;
//! - `checkpoint:weights`: the weights or adapters written into it;
//! - `checkpoint:critic`: PPO's value model written;
//! - `checkpoint:optimizer`: the optimizer's moments written;
//! - `checkpoint:state`: every file written, the folder not yet renamed into place;
//! - `checkpoint:renamed`: renamed into place, the older checkpoints not yet removed;
//! - `checkpoint:removing`: a checkpoint being removed (beyond `save_total_limit`, or abandoned by a
//!   rollback) renamed to a temporary folder, not yet deleted;
//!
//! and, while a resumed run cuts its files back to the checkpoint's step, after the new text is written
//! beside the file and before it replaces it:
//! - `metrics:staged` (`metrics.jsonl`, [`MetricsLog::resume`]);
//! - `records:staged` (`rollouts.jsonl`, `eval_rollouts.jsonl`, [`RunDir::keep_records_until`]).
//!
//! The variable is read once; without it a point costs one comparison. On a hit the process writes
//! `HOLO_KILL_AT: killed at NAME (N)` to stderr and sends itself SIGKILL (elsewhere than Unix it aborts):
//! no destructor, flush or exit handler runs, as when the machine's owner kills it. `tests/kill/` and
//! `scripts/kill-trials.sh` drive it.
//!
//! [`checkpoint::save`]: super::checkpoint::save
//! [`MetricsLog::resume`]: super::metrics::MetricsLog::resume
//! [`RunDir::keep_records_until`]: super::checkpoint::RunDir::keep_records_until

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The variable that names the point.
pub const VARIABLE: &str = "HOLO_KILL_AT";

/// Kills the process here when `HOLO_KILL_AT` names `name` and this is the occurrence it asks for.
pub fn point(name: &str) {
    static TARGET: OnceLock<Option<(String, u64)>> = OnceLock::new();
    static REACHED: AtomicU64 = AtomicU64::new(0);
    let target = TARGET.get_or_init(|| parse(&std::env::var(VARIABLE).ok()?));
    let Some((wanted, occurrence)) = target else {
        return;
    };
    if wanted != name || REACHED.fetch_add(1, Ordering::SeqCst) + 1 != *occurrence {
        return;
    }
    eprintln!("{VARIABLE}: killed at {name} ({occurrence})");
    kill_self();
}

/// `NAME` or `NAME@N` (N ≥ 1); anything else names no point.
fn parse(value: &str) -> Option<(String, u64)> {
    let (name, occurrence) = match value.rsplit_once('@') {
        Some((name, n)) => (name, n.parse().ok().filter(|&n| n >= 1)?),
        None => (value, 1),
    };
    (!name.is_empty()).then(|| (name.to_string(), occurrence))
}

#[cfg(unix)]
fn kill_self() -> ! {
    // SAFETY: kill(2) and getpid(2) touch no memory of this process.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    // SIGKILL cannot be caught; this runs only if the signal could not be sent.
    std::process::abort()
}

#[cfg(not(unix))]
fn kill_self() -> ! {
    std::process::abort()
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn a_point_is_named_with_an_optional_occurrence() {
        assert_eq!(
            parse("checkpoint:weights"),
            Some(("checkpoint:weights".into(), 1))
        );
        assert_eq!(
            parse("checkpoint:state@3"),
            Some(("checkpoint:state".into(), 3))
        );
        assert_eq!(parse("checkpoint:state@0"), None);
        assert_eq!(parse("checkpoint:state@x"), None);
        assert_eq!(parse(""), None);
    }
}
