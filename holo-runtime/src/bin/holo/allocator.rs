//! `holo`'s allocator: mimalloc, and when it gives freed memory back to the system.
//!
//! Every tensor operation allocates its output, a few hundred kilobytes to megabytes each: glibc's malloc
//! maps, zeroes and unmaps fresh pages for most of them (a fifth of a small model's training step went to
//! page faults); mimalloc reuses freed memory. It still returns ("purges") memory left free for a second
//! or more, which a training step does to its largest buffers: a 0.5B model's gradients (1.4 GB) are
//! freed after the optimizer step and allocated again seconds later, in pages the kernel has to map and
//! zero again. Training commands therefore keep freed memory ([`keep_freed_memory`]): the resident size
//! stays at the step's peak, which it reaches every step anyway. A server keeps mimalloc's default and
//! returns memory after large requests (`holo_runtime::trim::release`).

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

/// Freed memory stays with the process for reuse instead of being returned after mimalloc's purge delay
/// (see the module's documentation), unless `MIMALLOC_PURGE_DELAY` says otherwise.
#[cfg_attr(not(feature = "train"), allow(dead_code))]
pub fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: setting an option is a store mimalloc reads on its next purge; it is thread-safe.
        unsafe { mi_option_set(PURGE_DELAY, -1) }
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
        assert_eq!(purge_delay(), -1);
    }
}
