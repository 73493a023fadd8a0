//! The growth benchmark seed 004 implies: a per-layer cache fed one token at a time for
//! 4,096 tokens (Hkv 8, head_dim 128, f16; K and V), three ways:
//!
//! - `concat`: the seed's `ConcatKeyValueCache`, a new `[H, n + 1, D]` buffer per token
//!   with the history copied in (what `concatenate` along the sequence axis does);
//! - `step-256`: the seed's (and mlx-lm's) `KVCache`, buffers grown by 256 tokens at a time
//!   (the history copied into the larger buffer), tokens written in place;
//! - `kvplug`: the kit's [`ContiguousKv`] on the cpu device, pools doubled lazily from 256
//!   cells, tokens written in place.
//!
//! Each returns (a view of) the whole history after every append. Printed: time per
//! appended token (median of 3 runs), bytes held at 4,000 and 4,096 tokens, the peak held
//! while growing (K and V grow one after the other: V's old buffer and both new ones), and
//! bytes copied from old buffers.
//!
//! `cargo run --release -p kvplug-cpu --example kv_growth`

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use half::f16;
use kvplug_backend_kit::kv_face::{ContiguousKv, KeyValueCache};
use kvplug_core::{CacheConfig, KvDtype};
use kvplug_cpu::tensor::CpuTensor;
use kvplug_cpu::CpuDevice;

const H: usize = 8;
const D: usize = 128;
const TOKENS: usize = 4096;
const PROBE: usize = 4000;
const STEP: usize = 256;
const ROW: usize = H * D * 2; // one token of K (or V) in f16

/// What one strategy did over the run.
#[derive(Default)]
struct Run {
    secs: f64,
    held_at_probe: usize,
    held_at_end: usize,
    peak: usize,
    copied: usize,
}

/// `[H, n, D]` f16 buffers with room for `cap` tokens, grown by copying.
struct HostKv {
    k: Vec<f16>,
    v: Vec<f16>,
    cap: usize,
    len: usize,
}

impl HostKv {
    fn new() -> Self {
        HostKv {
            k: Vec::new(),
            v: Vec::new(),
            cap: 0,
            len: 0,
        }
    }

    /// Moves the history into buffers of `cap` tokens (the copy a concatenate makes).
    fn regrow(&mut self, cap: usize, run: &mut Run) {
        for buf in [&mut self.k, &mut self.v] {
            let mut grown = vec![f16::ZERO; H * cap * D];
            for h in 0..H {
                grown[h * cap * D..(h * cap + self.len) * D]
                    .copy_from_slice(&buf[h * self.cap * D..(h * self.cap + self.len) * D]);
            }
            *buf = grown;
        }
        // V's old buffer, and K's new one, live while V is copied.
        run.peak = run.peak.max((self.cap + 2 * cap) * ROW);
        run.copied += 2 * self.len * ROW;
        self.cap = cap;
    }

    fn append(&mut self, k: &[f32], v: &[f32]) {
        for (buf, src) in [(&mut self.k, k), (&mut self.v, v)] {
            for h in 0..H {
                let at = (h * self.cap + self.len) * D;
                for (d, x) in buf[at..at + D].iter_mut().zip(&src[h * D..(h + 1) * D]) {
                    *d = f16::from_f32(*x);
                }
            }
        }
        self.len += 1;
    }

    /// The history of head 0 (what the model's attention would read next).
    fn view(&self) -> (&[f16], &[f16]) {
        (&self.k[..self.len * D], &self.v[..self.len * D])
    }
}

fn token(i: usize) -> Vec<f32> {
    (0..H * D)
        .map(|j| ((i * 31 + j) % 97) as f32 / 97.0)
        .collect()
}

fn host_run(grow_to: impl Fn(usize) -> usize, tokens: &[Vec<f32>]) -> Run {
    let mut run = Run::default();
    let mut c = HostKv::new();
    let t = Instant::now();
    for (i, x) in tokens.iter().enumerate() {
        if c.len == c.cap {
            c.regrow(grow_to(c.len + 1), &mut run);
        }
        c.append(x, x);
        black_box(c.view());
        if i + 1 == PROBE {
            run.held_at_probe = 2 * c.cap * ROW;
        }
    }
    run.secs = t.elapsed().as_secs_f64();
    run.held_at_end = 2 * c.cap * ROW;
    run
}

fn kvplug_run(tokens: &[Vec<f32>]) -> Run {
    let cfg = CacheConfig {
        capacity: TOKENS,
        n_layers: 1,
        n_kv_heads: H,
        head_dim: D,
        kv_dtype: KvDtype::F16,
        min_chunk: STEP,
        sliding: None,
        conv: None,
        delta: None,
        ssm: None,
    };
    let mut c = ContiguousKv::new(Arc::new(CpuDevice::new()), cfg).expect("a cache");
    let inputs: Vec<CpuTensor> = tokens
        .iter()
        .map(|x| CpuTensor::new(&[H, 1, D], x.clone()))
        .collect();
    let mut run = Run::default();
    let t = Instant::now();
    for (i, x) in inputs.iter().enumerate() {
        let before = c.bytes();
        let len = c.offset();
        let (k, v) = c.update_and_fetch(x, x).expect("room for every token");
        black_box((k.pool.head_rows(0, k.len), v.pool.head_rows(0, v.len)));
        let after = c.bytes();
        if after != before {
            // K grows, then V: V's old pool and K's new one live while V is copied.
            run.peak = run.peak.max(before / 2 + after);
            run.copied += 2 * len * ROW;
        }
        if i + 1 == PROBE {
            run.held_at_probe = after;
        }
    }
    run.secs = t.elapsed().as_secs_f64();
    run.held_at_end = c.bytes();
    run.peak = run.peak.max(run.held_at_end);
    run
}

fn median(mut runs: Vec<Run>) -> Run {
    runs.sort_by(|a, b| a.secs.total_cmp(&b.secs));
    runs.swap_remove(1)
}

fn main() {
    let tokens: Vec<Vec<f32>> = (0..TOKENS).map(token).collect();
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    println!("| cache | µs per appended token | MiB held at {PROBE} | at {TOKENS} | peak MiB while growing | MiB copied |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    let strategies: [(&str, &dyn Fn() -> Run); 3] = [
        ("concat (seed ConcatKeyValueCache)", &|| {
            host_run(|n| n, &tokens)
        }),
        ("step-256 (seed / mlx-lm KVCache)", &|| {
            host_run(|n| n.div_ceil(STEP) * STEP, &tokens)
        }),
        ("kvplug ContiguousKv (lazy doubling)", &|| {
            kvplug_run(&tokens)
        }),
    ];
    for (name, f) in strategies {
        let r = median((0..3).map(|_| f()).collect());
        println!(
            "| {name} | {:.2} | {:.1} | {:.1} | {:.1} | {:.0} |",
            r.secs * 1e6 / TOKENS as f64,
            mib(r.held_at_probe),
            mib(r.held_at_end),
            mib(r.peak),
            mib(r.copied)
        );
    }
}
