//! Giving freed memory back to the system.
//!
//! Allocators keep the memory a large request freed (a 20 MB body parsed and refused, the keys and
//! values of a large batch) for reuse, so a server's resident size stays at its peak. [`release`] asks
//! them to return what they hold free: glibc's (`malloc_trim(0)`), and the program's global allocator
//! when it is another one that said how ([`on_release`]; the `holo` binary's mimalloc does).

use std::sync::OnceLock;

static GLOBAL_ALLOCATOR_RELEASE: OnceLock<fn()> = OnceLock::new();

/// Registers how the program's global allocator returns its free memory, for [`release`] to call; the
/// first registration stands.
pub fn on_release(release: fn()) {
    let _ = GLOBAL_ALLOCATOR_RELEASE.set(release);
}

/// Returns the allocators' free memory to the system; costs a walk over their free lists, so call it
/// after large requests or when work ends, not per allocation.
pub fn release() {
    if let Some(release) = GLOBAL_ALLOCATOR_RELEASE.get() {
        release();
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only reorganises the allocator's free lists; it is thread-safe.
    unsafe {
        libc::malloc_trim(0);
    }
}
