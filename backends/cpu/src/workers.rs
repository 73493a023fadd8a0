//! A fixed pool of worker threads that runs one borrowed job at a time, handing out task
//! indices from a counter. Dispatch allocates nothing (a mutex, two condvars and atomics),
//! which keeps the decode step allocation-free where a general-purpose pool would queue
//! boxed or block-allocated jobs. A decode step dispatches a few hundred short jobs, so
//! idle workers and the waiting caller spin briefly on an atomic before sleeping on the
//! condvars: a condvar wake-up costs more than most of those jobs.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

type Job = &'static (dyn Fn(usize) + Sync);

#[derive(Default)]
struct State {
    generation: u64,
    job: Option<Job>,
    tasks: usize,
    active: usize,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    start: Condvar,
    done: Condvar,
    next: AtomicUsize,
    panicked: AtomicBool,
    /// `State::generation`, readable without the lock (for spinning).
    published: AtomicU64,
    /// `State::active`, readable without the lock (for spinning).
    remaining: AtomicUsize,
}

/// Polls of a spin before sleeping: tens of microseconds, longer than the gap between the
/// jobs of one forward, far shorter than a scheduler tick.
const SPIN_POLLS: usize = 4096;

/// Spins until `ready` or [`SPIN_POLLS`] polls; the caller then takes the lock, which
/// decides.
#[inline]
fn spin_until(ready: impl Fn() -> bool) {
    for _ in 0..SPIN_POLLS {
        if ready() {
            return;
        }
        std::hint::spin_loop();
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs tasks until the counter passes `tasks`; records a panic instead of unwinding.
    fn drain(&self, job: Job, tasks: usize) {
        let r = catch_unwind(AssertUnwindSafe(|| loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= tasks {
                break;
            }
            job(i);
        }));
        if r.is_err() {
            self.panicked.store(true, Ordering::Relaxed);
        }
    }
}

/// Worker threads plus the calling thread.
pub struct Workers {
    shared: Arc<Shared>,
    threads: usize,
    /// One job at a time.
    run_lock: Mutex<()>,
}

impl Workers {
    /// A pool with `threads` workers (the caller is one more participant).
    pub fn new(threads: usize) -> Self {
        let shared = Arc::new(Shared::default());
        for n in 0..threads {
            let s = shared.clone();
            std::thread::Builder::new()
                .name(format!("kvplug-cpu-{n}"))
                .spawn(move || worker(&s))
                .expect("spawning a cpu worker thread");
        }
        Workers {
            shared,
            threads,
            run_lock: Mutex::new(()),
        }
    }

    /// The process-wide pool: one worker per core beyond the caller's.
    pub fn global() -> &'static Workers {
        static POOL: OnceLock<Workers> = OnceLock::new();
        POOL.get_or_init(|| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            Workers::new(cores.saturating_sub(1))
        })
    }

    /// Threads that run tasks, the caller included.
    pub fn participants(&self) -> usize {
        self.threads + 1
    }

    /// Calls `f(i)` for every `i < tasks`, spread over the workers and the caller; returns
    /// when all calls have returned. A panic in any call is re-raised here.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if self.threads == 0 || tasks <= 1 {
            (0..tasks).for_each(f);
            return;
        }
        let _one_at_a_time = self.run_lock.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the reference is only used by workers until `active` drops to zero,
        // which this function waits for before returning.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
        let s = &*self.shared;
        s.next.store(0, Ordering::Relaxed);
        s.panicked.store(false, Ordering::Relaxed);
        {
            let mut st = s.lock();
            st.generation += 1;
            st.job = Some(job);
            st.tasks = tasks;
            st.active = self.threads;
            s.remaining.store(self.threads, Ordering::Release);
            s.published.store(st.generation, Ordering::Release);
        }
        s.start.notify_all();
        s.drain(job, tasks);
        spin_until(|| s.remaining.load(Ordering::Acquire) == 0);
        let mut st = s.lock();
        while st.active > 0 {
            st = s.done.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st.job = None;
        drop(st);
        if s.panicked.load(Ordering::Relaxed) {
            panic!("a cpu worker task panicked");
        }
    }
}

fn worker(s: &Shared) {
    let mut seen = 0;
    loop {
        spin_until(|| s.published.load(Ordering::Acquire) != seen);
        let (job, tasks) = {
            let mut st = s.lock();
            while st.generation == seen {
                st = s.start.wait(st).unwrap_or_else(|p| p.into_inner());
            }
            seen = st.generation;
            (
                st.job.expect("a job accompanies every generation"),
                st.tasks,
            )
        };
        s.drain(job, tasks);
        let mut st = s.lock();
        st.active -= 1;
        s.remaining.store(st.active, Ordering::Release);
        if st.active == 0 {
            s.done.notify_one();
        }
    }
}

/// `n` equal disjoint chunks of a slice, handed out by index to concurrent tasks.
pub struct DisjointChunks<T> {
    ptr: *mut T,
    chunk: usize,
    n: usize,
}

// SAFETY: each chunk is reached through `get`, whose contract gives every index to at most
// one task at a time.
unsafe impl<T: Send> Sync for DisjointChunks<T> {}

impl<T> DisjointChunks<T> {
    /// Splits `slice` into chunks of `chunk` elements (`slice.len()` a multiple of it).
    pub fn new(slice: &mut [T], chunk: usize) -> Self {
        assert!(chunk > 0 && slice.len().is_multiple_of(chunk));
        DisjointChunks {
            ptr: slice.as_mut_ptr(),
            chunk,
            n: slice.len() / chunk,
        }
    }

    /// Chunk `i`.
    ///
    /// # Safety
    /// No two live references to the same chunk may exist: call once per index per job.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn get(&self, i: usize) -> &mut [T] {
        assert!(i < self.n);
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(i * self.chunk), self.chunk) }
    }

    /// Chunks `[first, first + n)` as one slice.
    ///
    /// # Safety
    /// No two live references may share a chunk: spans handed to concurrent tasks are
    /// disjoint.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn span(&self, first: usize, n: usize) -> &mut [T] {
        assert!(first + n <= self.n);
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(first * self.chunk), n * self.chunk) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_and_panics_propagate() {
        let pool = Workers::new(3);
        for tasks in [0, 1, 2, 7, 64] {
            let mut hits = vec![0u32; tasks];
            let chunks = DisjointChunks::new(&mut hits, 1);
            // SAFETY: index i is handed to exactly one call.
            pool.run(tasks, &|i| unsafe { chunks.get(i)[0] += 1 });
            assert!(hits.iter().all(|&h| h == 1), "{tasks}: {hits:?}");
        }
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(8, &|i| assert!(i != 5, "task five"))
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.run(8, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(
            count.load(Ordering::Relaxed),
            8,
            "the pool survives a panicking job"
        );
    }
}
