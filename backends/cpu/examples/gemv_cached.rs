//! The decode GEMV's arithmetic alone: one token against a block-format matrix small enough
//! to stay in the per-core caches (0.6–1.2 MB), per format and Qwen2.5-0.5B shape, in µs per
//! million weights, the fastest of 30 rounds of 100 calls. Criterion's `weights_decode_blocks`
//! streams weights from memory as a model does, so its figures swing with this VM's bandwidth
//! (±10% between runs of one binary); this one moves about ±2%, enough to compare kernel
//! changes. `cargo run --release -p kvplug-cpu --example gemv_cached [FORMAT|COLUMNS...]` (every format
//! and shape without names; e.g. `q4_K q5_0 896`).

use std::time::Instant;

use kvplug_backend_kit::model::BlockFormat;
use kvplug_backend_kit::testing::{random_blocks, Rng};

fn main() {
    let formats = [
        BlockFormat::Q8_0,
        BlockFormat::Q5_0,
        BlockFormat::Q5_1,
        BlockFormat::Q4_0,
        BlockFormat::Q4_1,
        BlockFormat::Q4K,
        BlockFormat::Q5K,
        BlockFormat::Q6K,
    ];
    let only: Vec<String> = std::env::args().skip(1).collect();
    // A quarter of the down projection's rows (4864 columns) and of the gate/up ones' (896).
    for f in formats {
        let formats_named = only.iter().any(|n| n.parse::<usize>().is_err());
        if formats_named && !only.iter().any(|n| n == f.name()) {
            continue;
        }
        for (rows, cols) in [(224usize, 4864usize), (1216, 896)] {
            let shape_named = only.iter().any(|n| n.parse() == Ok(cols));
            let shapes_named = only.iter().any(|n| n.parse::<usize>().is_ok());
            if cols % f.block_elems() != 0 || (shapes_named && !shape_named) {
                continue;
            }
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
            let w = random_blocks(f, rows * cols / f.block_elems(), &mut rng);
            let x: Vec<f32> = (0..cols).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
            let mut out = vec![0f32; rows];
            let mut best = f64::MAX;
            for _ in 0..30 {
                let t = Instant::now();
                for _ in 0..100 {
                    kvplug_cpu::qlinear::linear_blocks(&x, 1, f, &w, rows, cols, &mut out);
                }
                best = best.min(t.elapsed().as_secs_f64() / 100.0);
            }
            println!(
                "{:>5} {rows:>4}x{cols:<4} {:6.2} µs per million weights ({} KB)",
                f.name(),
                best * 1e12 / (rows * cols) as f64,
                w.len() / 1024
            );
        }
    }
}
