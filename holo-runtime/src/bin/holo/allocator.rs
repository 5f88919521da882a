//! `holo`'s allocator: mimalloc, and when it gives freed memory back to the system.
//!
//! Every tensor operation allocates its output, a few hundred kilobytes to megabytes each: glibc's malloc
//! maps, zeroes and unmaps fresh pages for most of them (a fifth of a small model's training step went to
//! page faults); mimalloc reuses freed memory. It still returns ("purges") memory left free for a second
//! or more, which a training step does to its largest buffers: a 0.5B model's gradients (1.9 GB) are
//! freed after the optimizer step and allocated again seconds later, in pages the kernel has to map and
//! zero again (3.54 → 3.98 s a step). Training commands therefore return freed memory only when asked
//! ([`keep_freed_memory`]): at the start of each training pass, after the generation and the scores
//! before it and before the last step's gradients are freed (holo-train's `trainer/local.rs`), the
//! memory those freed (the sampler's keys, values and logits) goes back to the system, and the
//! gradients' memory stays for the pass's gradients. Kept for good instead (a purge delay of never),
//! the generation's freed memory stayed resident through training beside the pass's own, whose
//! tensors of other sizes did not always reuse it: 50 to 270 MiB above the memory plan on LoRA runs
//! (benches/README.md, "The memory plan against measured peaks"). A server keeps mimalloc's default
//! and returns memory after large requests (`holo_runtime::trim::release`).

use libmimalloc_sys::{mi_collect, mi_option_set, mi_option_t};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay` in mimalloc.h's `mi_option_e` (libmimalloc-sys names no constant for it):
/// milliseconds before freed memory is returned to the system, −1 for never.
// Only the training and serving commands (features `train`, `local`) keep freed memory.
#[cfg_attr(not(feature = "train"), allow(dead_code))]
const PURGE_DELAY: mi_option_t = 15;

/// Lets `holo_runtime::trim::release` return mimalloc's free memory too.
pub fn install() {
    holo_runtime::trim::on_release(|| {
        // SAFETY: mi_collect only walks and returns the allocator's free memory; it is thread-safe.
        unsafe { mi_collect(true) }
    });
}

/// The purge delay of the training commands, in milliseconds: a day, so that freed memory is returned
/// when `holo_runtime::trim::release` asks (a forced `mi_collect` purges what was freed since, marked for
/// a later purge) and otherwise kept. A delay of never (−1) marks nothing, and no later call could
/// return that memory.
#[cfg_attr(not(feature = "train"), allow(dead_code))]
const WHEN_ASKED: i64 = 24 * 60 * 60 * 1000;

/// Freed memory stays with the process for reuse until [`install`]'s release returns it, instead of
/// being returned after mimalloc's purge delay (see the module's documentation), unless
/// `MIMALLOC_PURGE_DELAY` says otherwise.
#[cfg_attr(not(feature = "train"), allow(dead_code))]
pub fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: setting an option is a store mimalloc reads on its next purge; it is thread-safe.
        unsafe { mi_option_set(PURGE_DELAY, WHEN_ASKED as _) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The purge delay in force, in milliseconds (−1: never).
    fn purge_delay() -> i64 {
        // SAFETY: reading an option is thread-safe.
        unsafe { libmimalloc_sys::mi_option_get(PURGE_DELAY) as i64 }
    }

    #[test]
    fn the_option_set_is_mimallocs_purge_delay() {
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
            eprintln!("skipped: MIMALLOC_PURGE_DELAY is set, so the default cannot be checked");
            return;
        }
        // mimalloc 3's default purge delay (options.c), which no option next to it shares: the index
        // names the purge delay.
        assert_eq!(purge_delay(), 1000);
        keep_freed_memory();
        assert_eq!(purge_delay(), WHEN_ASKED);
    }
}
