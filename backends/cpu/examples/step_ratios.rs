//! Issue 64's step ratios, a 4-branch fork step against one branch and a 16-node tree verify
//! against a decode step (q8 at [`STEP_CONTEXT`] tokens), on one thread in that thread's
//! own CPU time. On a shared VM criterion's wall-clock means of two steps timed a minute
//! apart swing with what the host takes (±30% from run to run); a thread's CPU time leaves
//! out the time it was not running. The two steps of a ratio alternate for `ROUNDS` rounds
//! (default 300) and each keeps its fastest, the run least disturbed. Prints a markdown
//! table, which `make bench` keeps for BENCH.md at each ISA level.
//! `cargo run --release -p kvplug-cpu --example step_ratios [ROUNDS]`.

#[allow(dead_code)] // the weight sets are weights_bandwidth's
#[path = "../benches/shared/mod.rs"]
mod shared;

use kvplug_core::KvDtype;
use shared::steps::{step_arithmetics, Fork, Tree, STEP_CONTEXT};

/// This thread's CPU time in µs.
fn cpu_time() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    ts.tv_sec as f64 * 1e6 + ts.tv_nsec as f64 / 1e3
}

/// Keeps this thread (the process's only one yet) on one CPU it may run on, so the kernels'
/// worker pool, sized by `available_parallelism` when first used, is the caller alone.
fn one_thread() {
    // SAFETY: the calls read and write only `set`, a cpu_set_t of the size they are given.
    unsafe {
        let size = std::mem::size_of::<libc::cpu_set_t>();
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(
            libc::sched_getaffinity(0, size, &mut set),
            0,
            "sched_getaffinity"
        );
        let cpu = (0..libc::CPU_SETSIZE as usize)
            .find(|&c| libc::CPU_ISSET(c, &set))
            .expect("the affinity mask names a CPU");
        libc::CPU_ZERO(&mut set);
        libc::CPU_SET(cpu, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, size, &set),
            0,
            "sched_setaffinity"
        );
    }
    assert_eq!(std::thread::available_parallelism().unwrap().get(), 1);
}

/// The fastest CPU time of `a` and of `b` on `x`, run alternately `rounds` times.
fn fastest<T>(rounds: usize, x: &mut T, a: impl Fn(&mut T), b: impl Fn(&mut T)) -> (f64, f64) {
    let mut best = (f64::INFINITY, f64::INFINITY);
    for _ in 0..rounds {
        let t = cpu_time();
        a(x);
        let u = cpu_time();
        b(x);
        let v = cpu_time();
        best = (best.0.min(u - t), best.1.min(v - u));
    }
    best
}

fn main() {
    let rounds: usize = match std::env::args().nth(1) {
        Some(r) => r.parse().expect("ROUNDS: a whole number"),
        None => 300,
    };
    assert!(rounds > 0, "ROUNDS: at least 1");
    one_thread();
    println!("| KV dtype, arithmetic | 4 branches (µs) | 1 branch (µs) | **4 / 1** | 16-node tree (µs) | decode (µs) | **tree / decode** |");
    println!("|---|---|---|---|---|---|---|");
    let dtype = KvDtype::Q8_DEFAULT;
    let (mut fork, mut tree) = (Fork::new(dtype), Tree::new(dtype));
    for (arithmetic, name) in step_arithmetics(&fork.cache, dtype) {
        fork.cache.set_arithmetic(arithmetic).unwrap();
        tree.set_arithmetic(arithmetic);
        let (four, one) = fastest(rounds, &mut fork, |f| f.step(4), |f| f.step(1));
        let (verify, decode) = fastest(rounds, &mut tree, Tree::verify, Tree::decode);
        println!(
            "| {} | {four:.0} | {one:.0} | **{:.2}×** | {verify:.0} | {decode:.0} | **{:.2}×** |",
            name.replace('+', " "),
            four / one,
            verify / decode,
        );
    }
    println!("\nL = {STEP_CONTEXT}; the fastest of {rounds} alternating rounds, one thread.");
}
