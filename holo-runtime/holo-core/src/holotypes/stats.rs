//! [`ToolStats`]: counts of tool runs shared by the rollouts of a run, for metrics.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counts of tool runs (for now: `CodeExecutor`'s code runs), shared by every rollout that has it in
/// its [`Resources`](crate::Resources). The trainer logs the counts of each generation as
/// `tools/calls`, `tools/failed` and `tools/timed_out`.
#[derive(Debug, Default)]
pub struct ToolStats {
    calls: AtomicU64,
    failed: AtomicU64,
    timed_out: AtomicU64,
}

/// A reading of [`ToolStats`]; subtract two readings for what happened in between.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ToolCounts {
    pub calls: u64,
    /// Runs that did not succeed: a non-zero exit (an exception), a signal (a limit), a timeout, or
    /// code that could not run.
    pub failed: u64,
    /// Runs stopped at the timeout (also counted in `failed`).
    pub timed_out: u64,
}

impl ToolStats {
    /// Counts one run.
    pub fn record(&self, succeeded: bool, timed_out: bool) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if !succeeded {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        if timed_out {
            self.timed_out.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn counts(&self) -> ToolCounts {
        ToolCounts {
            calls: self.calls.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            timed_out: self.timed_out.load(Ordering::Relaxed),
        }
    }
}

impl std::ops::Sub for ToolCounts {
    type Output = ToolCounts;

    fn sub(self, earlier: ToolCounts) -> ToolCounts {
        ToolCounts {
            calls: self.calls.saturating_sub(earlier.calls),
            failed: self.failed.saturating_sub(earlier.failed),
            timed_out: self.timed_out.saturating_sub(earlier.timed_out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_differences() {
        let stats = ToolStats::default();
        stats.record(true, false);
        let before = stats.counts();
        stats.record(false, false);
        stats.record(false, true);
        assert_eq!(
            stats.counts() - before,
            ToolCounts {
                calls: 2,
                failed: 2,
                timed_out: 1
            }
        );
    }
}
