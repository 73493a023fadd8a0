//! A speculative verify computes each drafted position's attention in one call with the
//! others; greedy output with drafts equals plain decoding only if each row of that call gets
//! the bits a decode step at its position gets. Here: 8 tokens attended one step each, then
//! rewound and attended in one causal step, after a context of several key chunks, on each
//! dtype in its default arithmetic (int8-query for quantized K/V) and in f32 — every row the
//! same bits. Before the key chunks were fixed, a decode step and a verify split a head's keys
//! over the threads at points set by their own lengths, and greedy text with drafts parted
//! from plain decoding on 2 threads.

use std::sync::Arc;

use kvplug_backend_kit::KitCache;
use kvplug_core::{make_config, Arithmetic, CacheKind, CacheVerbs, KvDtype, ModelCacheParams};
use kvplug_cpu::tensor::CpuTensor;
use kvplug_cpu::CpuDevice;

const HQ: usize = 6;
const HKV: usize = 3;
const D: usize = 64;
/// Contexts before the tokens: across key chunk boundaries (every 1,024) and across 1280, where
/// the old split of 3 KV heads over 2 threads moved (half the keys, rounded up to a tile: 640
/// up to 1280 keys, 704 from 1281); the longer ones do the work that runs a decode step split
/// over the threads (508 does not: one task a head).
const CONTEXTS: [usize; 5] = [2044, 1275, 1020, 1000, 508];
/// Tokens verified at once: a draft's 8 (a task per run of key chunks, as a decode step),
/// and 40 (80 query rows a head: tasks of 64 query rows, each folding its chunks itself).
const TOKENS: [usize; 2] = [8, 40];

/// Token `i`'s values of `h` heads (a multiplicative hash in `[-amplitude, amplitude)`).
fn token(h: usize, i: usize, salt: u32, amplitude: f32) -> Vec<f32> {
    (0..h * D)
        .map(|j| {
            let x =
                ((i * h * D + j) as u32 ^ salt.wrapping_mul(0x9e37_79b9)).wrapping_mul(0x85eb_ca6b);
            amplitude * ((x >> 8) as f32 / (1 << 23) as f32 - 1.0)
        })
        .collect()
}

/// Tokens `range` as a `[h, t, D]` tensor.
fn tokens(h: usize, range: std::ops::Range<usize>, salt: u32, amplitude: f32) -> CpuTensor {
    let t = range.len();
    let mut data = vec![0f32; h * t * D];
    for (k, i) in range.enumerate() {
        for (hh, v) in token(h, i, salt, amplitude).chunks_exact(D).enumerate() {
            data[(hh * t + k) * D..][..D].copy_from_slice(v);
        }
    }
    CpuTensor::new(&[h, t, D], data)
}

/// Attends tokens `range` in one step (positions as their indices); the output `[HQ, t, D]`.
fn step(c: &mut KitCache<CpuDevice>, range: std::ops::Range<usize>) -> Vec<f32> {
    let t = range.len();
    let positions: Vec<i32> = range.clone().map(|i| i as i32).collect();
    let mut out = CpuTensor::zeros(&[HQ, t, D]);
    c.update_and_attend(
        0,
        &tokens(HQ, range.clone(), 1, 3.0),
        &tokens(HKV, range.clone(), 2, 1.0),
        &tokens(HKV, range, 3, 1.0),
        &positions,
        1.0 / (D as f32).sqrt(),
        &mut out,
    )
    .unwrap();
    out.data
}

#[test]
fn a_verify_gives_each_row_a_decode_steps_bits() {
    // A head's key chunks are split in runs over tasks only with 2 threads or more.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert!(
        threads >= 2,
        "this test needs 2 threads to split a step's keys"
    );
    for dtype in [KvDtype::F16, KvDtype::Q8_DEFAULT, KvDtype::Q4_DEFAULT] {
        let params = ModelCacheParams {
            n_layers: 1,
            n_kv_heads: HKV,
            head_dim: D,
        };
        let cfg = make_config(&params, 4096, dtype);
        let mut c = KitCache::new(Arc::new(CpuDevice::new()), CacheKind::Contiguous, cfg).unwrap();
        let mut arithmetics = vec![c.arithmetic()];
        arithmetics.extend((c.arithmetic() != Arithmetic::F32).then_some(Arithmetic::F32));
        for start in (0..CONTEXTS[0]).step_by(512) {
            step(&mut c, start..(start + 512).min(CONTEXTS[0]));
        }
        // Longest first: each context is the cache rewound.
        let runs = CONTEXTS.into_iter().flat_map(|n| {
            let arithmetics = arithmetics.clone();
            TOKENS
                .into_iter()
                .flat_map(move |t| arithmetics.clone().into_iter().map(move |a| (n, t, a)))
        });
        for (context, t, arithmetic) in runs {
            c.set_arithmetic(arithmetic).unwrap();
            c.rewind(context).unwrap();
            let decoded: Vec<Vec<f32>> = (context..context + t)
                .map(|i| step(&mut c, i..i + 1))
                .collect();
            c.rewind(context).unwrap();
            let verified = step(&mut c, context..context + t);
            for (i, one) in decoded.iter().enumerate() {
                for h in 0..HQ {
                    let row = &verified[(h * t + i) * D..][..D];
                    let alone = &one[h * D..][..D];
                    let same = row
                        .iter()
                        .zip(alone)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{dtype} {arithmetic}, {context} tokens before: token {i} of {t}, head \
                         {h}, differs in the verify:\n{row:?}\n{alone:?}"
                    );
                }
            }
        }
    }
}
