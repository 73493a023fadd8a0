//! [`CountingAllocator`]: the system allocator, counting its calls, for tests that a path
//! allocates nothing once warm.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

static CALLS: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, counting `alloc` and `realloc` calls from every thread. A test
/// binary installs it (`#[global_allocator] static A: CountingAllocator =
/// CountingAllocator;`) and keeps the counting to one test (tests run on parallel threads).
pub struct CountingAllocator;

impl CountingAllocator {
    /// Allocation calls so far in this process.
    pub fn calls() -> usize {
        CALLS.load(Ordering::SeqCst)
    }
}

unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        CALLS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        CALLS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
