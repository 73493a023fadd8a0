//! The decode GEMV's weight streaming against the machine's read bandwidth, per format and
//! shape, measured in interleaved pairs: a read-bandwidth pass (`sum_256MiB`), then one
//! token through a 256 MB weight set, round-robin over every set for [`SECONDS`]. This VM's bandwidth swings between
//! two speeds for seconds at a time, so a ratio of separately timed benchmarks (criterion's
//! `read_bandwidth` against `weights_decode_blocks`) depends on which speed each caught; a
//! pair's two passes, milliseconds apart, see the same one. Prints a markdown table (the
//! median of the pairs' ratios, and the fastest weight pass against the fastest bandwidth
//! pass), which `make bench` keeps for BENCH.md.
//! `cargo run --release -p kvplug-cpu --example weights_bandwidth`.

#[allow(dead_code)] // the attention steps are the other examples'
#[path = "../benches/shared/mod.rs"]
mod shared;

use std::time::Instant;

/// Rounds of pairs at least, and seconds of rounds at least: every round pairs each set
/// once, so each sees the bandwidth's slow and fast spells alike.
const ROUNDS: usize = 24;
const SECONDS: f64 = 40.0;

/// A pair's read pass counts as the fast speed from this fraction of the fastest read pass.
const FAST: f64 = 0.9;

/// Seconds `f` takes.
fn timed(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

/// The median of `v` (sorted in place; NaN where empty).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// One weight set's pairs: (read GB/s, weight GB/s).
struct Pairs {
    name: &'static str,
    rows: usize,
    x: Vec<f32>,
    set: shared::WeightSet,
    pairs: Vec<(f64, f64)>,
}

fn main() {
    let buf = shared::bandwidth_buffer();
    let buf_bytes = (buf.len() * 4) as f64;
    let mut all = Vec::new();
    for (rows, cols) in shared::BLOCK_SHAPES {
        let formats = shared::BLOCK_FORMATS.map(Some);
        for f in formats.into_iter().chain([None]) {
            if f.is_some_and(|f| cols % f.block_elems() != 0) {
                continue;
            }
            all.push(Pairs {
                name: f.map_or("f16", |f| f.name()),
                rows,
                x: shared::decode_token(cols),
                set: shared::WeightSet::new(f, rows, cols),
                pairs: Vec::new(),
            });
        }
    }
    let mut out = vec![0f32; shared::BLOCK_SHAPES.iter().map(|s| s.0).max().unwrap_or(0)];
    // One of each first: pages touched, threads awake.
    shared::read_pass(&buf);
    for p in &all {
        p.set.pass(&p.x, p.rows, &mut out[..p.rows]);
    }
    let start = Instant::now();
    let mut rounds = 0;
    while rounds < ROUNDS || start.elapsed().as_secs_f64() < SECONDS {
        for p in &mut all {
            let r = buf_bytes / timed(|| shared::read_pass(&buf));
            let bytes = p.set.bytes() as f64;
            let w = bytes / timed(|| p.set.pass(&p.x, p.rows, &mut out[..p.rows]));
            p.pairs.push((r / 1e9, w / 1e9));
        }
        rounds += 1;
    }
    let fastest_read = all
        .iter()
        .flat_map(|p| p.pairs.iter().map(|q| q.0))
        .fold(0f64, f64::max);
    println!(
        "{rounds} rounds of interleaved pairs in {:.0} s; fastest read pass {fastest_read:.1} GB/s; \"fast\" pairs: read pass at ≥ {FAST} of it.\n",
        start.elapsed().as_secs_f64()
    );
    println!(
        "| format | shape | weight GB/s (median) | read GB/s (median) | vs read bandwidth (median of pairs) | fast pairs: vs read bandwidth (median, pairs) | fastest weight pass vs fastest read pass |"
    );
    println!("|---|---|---|---|---|---|---|");
    for p in &all {
        let ratio = |q: &(f64, f64)| q.1 / q.0;
        let mut ratios: Vec<f64> = p.pairs.iter().map(ratio).collect();
        let fast = |q: &&(f64, f64)| q.0 >= FAST * fastest_read;
        let mut fast_ratios: Vec<f64> = p.pairs.iter().filter(fast).map(ratio).collect();
        let fastest = |i: usize| p.pairs.iter().map(|q| [q.0, q.1][i]).fold(0f64, f64::max);
        println!(
            "| {} | {}x{} | {:.1} | {:.1} | {:.2}× | {:.2}× ({}) | {:.2}× |",
            p.name,
            p.rows,
            p.x.len(),
            median(&mut p.pairs.iter().map(|q| q.1).collect::<Vec<_>>()),
            median(&mut p.pairs.iter().map(|q| q.0).collect::<Vec<_>>()),
            median(&mut ratios),
            median(&mut fast_ratios),
            fast_ratios.len(),
            fastest(1) / fastest(0),
        );
    }
}
