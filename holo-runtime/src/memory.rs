//! Giving freed memory back to the system.
//!
//! glibc's allocator keeps the memory a large request freed (a 20 MB body parsed and refused, the keys and
//! values of a large batch) in its arenas for reuse, so a server's resident size stays at its peak.
//! [`release`] asks it to return what it holds free (`malloc_trim(0)`); elsewhere it does nothing.

/// Returns the allocator's free memory to the system (glibc); costs a walk over the free lists, so call
/// it after large requests or when work ends, not per allocation.
pub fn release() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only reorganises the allocator's free lists; it is thread-safe.
    unsafe {
        libc::malloc_trim(0);
    }
}
