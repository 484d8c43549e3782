//! Giving freed memory back to the operating system, whichever allocator
//! the process uses.
//!
//! The libraries do not choose the allocator; the binary does. It names
//! how its allocator returns freed pages with [`set_memory_releaser`];
//! without one, [`release_freed_memory`] trims glibc's heap (where the
//! process allocates through glibc) or does nothing.

use std::sync::OnceLock;

static RELEASER: OnceLock<fn()> = OnceLock::new();

/// Name how this process's allocator returns the pages it holds freed (the
/// `sieve` binary: jemalloc's purge of every arena). The first call wins;
/// later ones are ignored.
pub fn set_memory_releaser(releaser: fn()) {
    let _ = RELEASER.set(releaser);
}

/// Give the memory freed so far back to the operating system: the
/// releaser set with [`set_memory_releaser`], or glibc's `malloc_trim`.
pub fn release_freed_memory() {
    if let Some(releaser) = RELEASER.get() {
        releaser();
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap memory to the system; it
    // takes no pointers and is safe to call at any time, from any thread.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    static CALLS: AtomicUsize = AtomicUsize::new(0);

    fn count() {
        CALLS.fetch_add(1, Ordering::SeqCst);
    }

    #[test]
    fn the_releaser_set_is_the_one_called() {
        set_memory_releaser(count);
        let before = CALLS.load(Ordering::SeqCst);
        release_freed_memory();
        release_freed_memory();
        assert_eq!(CALLS.load(Ordering::SeqCst), before + 2);
    }
}
