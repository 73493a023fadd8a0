//! A fixed pool of worker threads that runs one borrowed job at a time, handing out task
//! indices from a counter. Dispatch allocates nothing (a mutex, two condvars and atomics),
//! which keeps the decode step allocation-free where a general-purpose pool would queue
//! boxed or block-allocated jobs. A decode step dispatches a few hundred short jobs, so
//! idle workers and the waiting caller spin briefly on an atomic before sleeping on the
//! condvars: a condvar wake-up costs more than most of those jobs.
//!
//! [`Workers::run_split`] hands each participant one contiguous share of a range and lets
//! whoever finishes first take runs from the back of the others' shares: a decode step's
//! weight streams stay one run per thread (which the prefetchers follow), and at the end a
//! participant waits at most for the run another one last claimed.

use std::ops::Range;
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

/// One participant's share of a [`Workers::run_split`] range, in chunks: the next chunk
/// from the front (high 32 bits) and the end of the unclaimed chunks (low 32 bits). The
/// owner claims from the front, the others from the back, each time half of what is left
/// (at least one chunk): a claim is a locked compare-and-swap, which waits for the thread's
/// outstanding loads, so a share costs a handful of them rather than one per chunk.
#[repr(align(64))]
#[derive(Default)]
struct Share(AtomicU64);

impl Share {
    fn set(&self, chunks: Range<usize>) {
        let (a, b) = (chunks.start as u64, chunks.end as u64);
        self.0.store(a << 32 | b, Ordering::Relaxed);
    }

    /// Claims half the unclaimed chunks (at least one) from the front or the back.
    fn claim(&self, front: bool) -> Option<Range<usize>> {
        let mut cur = self.0.load(Ordering::Relaxed);
        loop {
            let (a, b) = (cur >> 32, cur & 0xffff_ffff);
            if a >= b {
                return None;
            }
            let k = ((b - a) / 2).max(1);
            let (next, taken) = if front {
                ((a + k) << 32 | b, a..a + k)
            } else {
                (a << 32 | (b - k), b - k..b)
            };
            match self
                .0
                .compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Some(taken.start as usize..taken.end as usize),
                Err(now) => cur = now,
            }
        }
    }
}

/// Worker threads plus the calling thread.
pub struct Workers {
    shared: Arc<Shared>,
    threads: usize,
    /// One job at a time; holds the shares of [`Workers::run_split`], one per participant.
    run_lock: Mutex<Box<[Share]>>,
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
            run_lock: Mutex::new((0..=threads).map(|_| Share::default()).collect()),
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
        self.dispatch(tasks, f);
    }

    /// Calls `f` on disjoint non-empty ranges that cover `0..n` exactly (none when `n` is
    /// 0), each starting and ending on a multiple of `chunk` (or at `n`): one contiguous
    /// share per participant, claimed in ascending runs of half its unclaimed chunks (so
    /// `chunk` is the smallest claim); a participant done with its share takes runs from the
    /// back of the others'. Returns when all calls have returned; a panic is re-raised here.
    pub fn run_split(&self, n: usize, chunk: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        assert!(chunk > 0, "run_split: empty chunks");
        let chunks = n.div_ceil(chunk);
        let range = |c: Range<usize>| c.start * chunk..(c.end * chunk).min(n);
        if n == 0 {
            return;
        }
        if self.threads == 0 || chunks == 1 {
            f(0..n);
            return;
        }
        assert!(u32::try_from(chunks).is_ok(), "run_split: {chunks} chunks");
        let shares = self.run_lock.lock().unwrap_or_else(|p| p.into_inner());
        let p = shares.len();
        for (i, s) in shares.iter().enumerate() {
            s.set(i * chunks / p..(i + 1) * chunks / p);
        }
        let shares = &shares[..];
        self.dispatch(p, &|i| {
            while let Some(c) = shares[i].claim(true) {
                f(range(c));
            }
            for other in (1..p).map(|k| &shares[(i + k) % p]) {
                while let Some(c) = other.claim(false) {
                    f(range(c));
                }
            }
        });
    }

    /// [`Workers::run`]'s dispatch, under its lock.
    fn dispatch(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
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

    #[test]
    fn run_split_covers_each_index_once_on_chunk_bounds() {
        let pool = Workers::new(3);
        for (n, chunk) in [
            (0, 4),
            (1, 4),
            (7, 8),
            (100, 1),
            (1000, 16),
            (1001, 16),
            (5, 2),
        ] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run_split(n, chunk, &|r| {
                assert!(
                    r.start % chunk == 0 && (r.end % chunk == 0 || r.end == n),
                    "{r:?}"
                );
                // A slow first share, so that the others take chunks from its back.
                if r.start == 0 {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                r.for_each(|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "n {n}, chunk {chunk}"
            );
        }
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run_split(64, 4, &|r| assert!(!r.contains(&37), "index 37"))
        }));
        assert!(r.is_err());
    }

    #[test]
    fn shares_are_claimed_from_both_ends_until_empty() {
        let s = Share::default();
        s.set(3..11);
        assert_eq!(s.claim(true), Some(3..7));
        assert_eq!(s.claim(false), Some(9..11));
        assert_eq!(s.claim(true), Some(7..8));
        assert_eq!(s.claim(false), Some(8..9));
        assert_eq!(s.claim(true), None);
        assert_eq!(s.claim(false), None);
    }
}
