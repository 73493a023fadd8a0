//! The attention kernels agree. Conformance checks the default one (tiled, on 512-bit
//! registers on CPUs with AVX-512F, else 256-bit ones on CPUs with AVX2/FMA/F16C) against the
//! f64 oracle; this runs the same steps on each kernel (`use_kernels_from`) and compares the
//! others with it, so the narrower tiled kernel, the XNNPACK path and the row kernel stay
//! checked on machines where they are not the default. Shapes are chosen to
//! reach every split: 3 KV heads (a decode step's key chunks split in runs over 2 threads
//! and folded), query blocks long enough to split over query rows and to take the XNNPACK path,
//! and explicit masks (two sequences in one step); each with and without attention sinks.
//! Every kernel computes in f32 here (the int8-query scores of quantized caches are checked
//! against the oracle by conformance).

use std::sync::Arc;

use kvplug_backend_kit::KitCache;
use kvplug_core::{
    make_config, Arithmetic, CacheKind, CacheVerbs, KvDtype, ModelCacheParams, PosRange,
};
use kvplug_cpu::attention::{use_kernels_from, Kernel};
use kvplug_cpu::tensor::CpuTensor;
use kvplug_cpu::CpuDevice;

const HQ: usize = 6;
const HKV: usize = 3;
const D: usize = 64;
/// Long enough that a decode step does the multiply-adds that split it over threads, in
/// more than one run of key chunks (`tiled_attention::KEY_CHUNK`, 1,024 keys).
const TRUNK: usize = 2100;

/// Queries are scaled by this, so that softmax is sharp.
const Q_AMPLITUDE: f32 = 3.0;

/// Pseudo-random activations in `[-amplitude, amplitude)` (a multiplicative hash, so rows
/// do not repeat and the halves of a window have different score maxima).
fn tensor(h: usize, t: usize, salt: u32, amplitude: f32) -> CpuTensor {
    let data = (0..h * t * D)
        .map(|i| {
            let x = (i as u32 ^ salt.wrapping_mul(0x9e37_79b9)).wrapping_mul(0x85eb_ca6b);
            amplitude * ((x >> 8) as f32 / (1 << 23) as f32 - 1.0)
        })
        .collect();
    CpuTensor::new(&[h, t, D], data)
}

/// Attention outputs of: a 2100-token prefill (causal), a decode step, then two sequences
/// forked from the trunk taking 20 tokens each in one step (explicit mask, 40 query tokens)
/// and one token each (explicit mask, 2 query tokens); with a sink per query head where
/// given.
fn outputs(dtype: KvDtype, sinks: Option<&[f32]>) -> Vec<Vec<f32>> {
    let sinks = sinks.map(|s| CpuTensor::new(&[HQ], s.to_vec()));
    let cfg = make_config(
        &ModelCacheParams {
            n_layers: 1,
            n_kv_heads: HKV,
            head_dim: D,
        },
        4096,
        dtype,
    );
    let mut c = KitCache::new(Arc::new(CpuDevice::new()), CacheKind::Seq, cfg).unwrap();
    c.set_arithmetic(Arithmetic::F32).unwrap();
    let mut outs = Vec::new();
    let mut step = |c: &mut KitCache<CpuDevice>, seqs: &[i32], pos: &[i32], salt: u32| {
        let t = pos.len();
        let mut out = CpuTensor::zeros(&[HQ, t, D]);
        let mut step = c.step(pos, Some(seqs)).unwrap();
        step.attend_sinks(
            0,
            &tensor(HQ, t, salt, Q_AMPLITUDE),
            &tensor(HKV, t, salt + 1, 1.0),
            &tensor(HKV, t, salt + 2, 1.0),
            1.0 / (D as f32).sqrt(),
            sinks.as_ref(),
            &mut out,
        )
        .unwrap();
        step.commit().unwrap();
        outs.push(out.data);
    };
    let trunk: Vec<i32> = (0..TRUNK as i32).collect();
    step(&mut c, &vec![0; TRUNK], &trunk, 0);
    step(&mut c, &[0], &[TRUNK as i32], 5);
    c.seq_rm(0, PosRange::new(Some(TRUNK as i32), None))
        .unwrap();
    for s in 1..=2 {
        c.seq_cp(0, s, PosRange::ALL).unwrap();
    }
    let seqs: Vec<i32> = [1; 20].into_iter().chain([2; 20]).collect();
    let pos: Vec<i32> = (0..40).map(|i| TRUNK as i32 + i % 20).collect();
    step(&mut c, &seqs, &pos, 7);
    step(&mut c, &[1, 2], &[TRUNK as i32 + 20; 2], 9);
    outs
}

#[test]
fn every_kernel_gives_the_same_attention() {
    // Keys and values are at most 1 in magnitude and queries 3, so a score is at most
    // 3·D/sqrt(D) = 24 and its f32 rounding error under any summation order at most
    // D·eps·24 ≈ 9.2e-5; softmax turns score errors δ into relative weight errors ≤ 2δ
    // (plus 1e-6 from the exp), and an output is a weighted mean of values ≤ 1: kernels
    // may differ by 2·9.2e-5 + 1e-6.
    // A sink only adds to a row's softmax sum (computed in f32 from an exact sink), which
    // scales the output by at most one more relative f32 rounding of the sum.
    const TOL: f32 = 1.9e-4;
    // Sinks about the scores' size, the largest above most of them.
    let sinks: Vec<f32> = (0..HQ).map(|h| h as f32 * 1.5 - 2.0).collect();
    let cases = [KvDtype::F16, KvDtype::Q8_DEFAULT, KvDtype::Q4_DEFAULT]
        .into_iter()
        .flat_map(|d| [(d, None), (d, Some(&sinks[..]))]);
    for (dtype, sinks) in cases {
        use_kernels_from(Kernel::TiledAvx512);
        let want = outputs(dtype, sinks);
        for kernel in [Kernel::Tiled, Kernel::Xnnpack, Kernel::Rows] {
            use_kernels_from(kernel);
            let got = outputs(dtype, sinks);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let worst = g
                    .iter()
                    .zip(w)
                    .map(|(a, b)| (a - b).abs())
                    // A NaN is the worst (f32::max would skip it).
                    .fold(0.0, |m: f32, d| if d > m || d.is_nan() { d } else { m });
                assert!(
                    worst <= TOL,
                    "{dtype} step {i}, sinks {sinks:?}: {kernel:?} differs from the default \
                     kernel by {worst}"
                );
            }
        }
    }
    use_kernels_from(Kernel::TiledAvx512);
}
