//! Criterion benchmarks of the cpu backend's cache + attention (one layer, Hq 32, Hkv 8,
//! D 128). `examples/bench_report.rs` turns the results into BENCH.md.

use std::hint::black_box;
use std::time::Duration;

mod shared;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvplug_core::{Arithmetic, CacheKind, CacheVerbs, KvDtype};
use shared::steps::{cache, filled, step_arithmetics, Fork, Io, Tree};

/// The machine's read bandwidth: [`shared::read_pass`] over 256 MiB (GB/s = bytes / time).
fn read_bandwidth(cr: &mut Criterion) {
    let buf = shared::bandwidth_buffer();
    let mut g = cr.benchmark_group("read_bandwidth");
    g.sample_size(10).measurement_time(Duration::from_secs(4));
    g.bench_function("sum_256MiB", |b| b.iter(|| shared::read_pass(&buf)));
    g.finish();
}

/// The arithmetic peak of the attention kernels' two multiply-add instructions on this
/// machine at the kernels' ISA level (`examples/bench_report.rs` divides each step's
/// multiply-adds by it: the time no kernel could beat on these instructions): per thread of
/// the worker pool, [`PEAK_CHAINS`] ([`PEAK_CHAINS_256`] for 256-bit `vfmadd`) independent chains
/// of [`PEAK_STEPS`] steps each. With AVX-512: f32 `vfmadd` (16 multiply-adds) and, with
/// VNNI, `vpdpbusd` (64); capped at or limited to AVX2 (`f32_fma_256`, `int8_dot_256`):
/// 256-bit `vfmadd` (8) and the int8 kernels' `vpmaddubsw`, `vpmaddwd`, `vpaddd` (32).
/// Criterion's throughput is the multiply-adds of one pass. Measures nothing off x86-64 (the instructions are x86's).
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn compute_peak(cr: &mut Criterion) {
    #[cfg(target_arch = "x86_64")]
    {
        use criterion::Throughput;
        let isa = kvplug_cpu::simd::features();
        let threads = kvplug_cpu::workers::Workers::global().participants();
        let mut g = cr.benchmark_group("compute_peak");
        g.sample_size(10).measurement_time(Duration::from_secs(2));
        let pass = (threads * PEAK_CHAINS * PEAK_STEPS) as u64;
        if isa.avx512f {
            g.throughput(Throughput::Elements(16 * pass));
            // SAFETY: AVX-512F is present (the kernels' view).
            g.bench_function("f32_fma", |b| {
                b.iter(|| peak_pass(|| unsafe { fma_chains() }))
            });
            if isa.avx512vnni {
                g.throughput(Throughput::Elements(64 * pass));
                // SAFETY: AVX-512F and VNNI are present.
                g.bench_function("int8_dot", |b| {
                    b.iter(|| peak_pass(|| unsafe { dot_chains() }))
                });
            }
        } else if isa.avx2_fma_f16c {
            let fma_pass = (threads * PEAK_CHAINS_256 * PEAK_STEPS) as u64;
            g.throughput(Throughput::Elements(8 * fma_pass));
            // SAFETY: AVX2 and FMA are present (the kernels' view).
            g.bench_function("f32_fma_256", |b| {
                b.iter(|| peak_pass(|| unsafe { fma_chains_256() }))
            });
            g.throughput(Throughput::Elements(32 * pass));
            // SAFETY: as above.
            g.bench_function("int8_dot_256", |b| {
                b.iter(|| peak_pass(|| unsafe { dot_chains_256() }))
            });
        }
        g.finish();
    }
}

/// Independent accumulator chains per thread in [`compute_peak`]: more than the
/// instructions' latency times the ports that run them.
#[cfg(target_arch = "x86_64")]
const PEAK_CHAINS: usize = 16;
/// `vfmadd` chains at 256 bits: AVX2 has 16 vector registers, so 16 chains and their
/// operands spill inside the loop (measured 103 against 126 GMAC/s with 12, on this
/// project's Intel VM). The int8 chain keeps [`PEAK_CHAINS`]: three instructions long (~11 cycles),
/// it needs more in flight than it loses to a spill (215–220 against 198 GMAC/s with 12).
#[cfg(target_arch = "x86_64")]
const PEAK_CHAINS_256: usize = 12;
/// Instructions per chain in one [`compute_peak`] pass.
#[cfg(target_arch = "x86_64")]
const PEAK_STEPS: usize = 1 << 16;

/// Runs `chains` on every thread of the kernels' worker pool.
#[cfg(target_arch = "x86_64")]
fn peak_pass(chains: impl Fn() + Sync) {
    let workers = kvplug_cpu::workers::Workers::global();
    workers.run(workers.participants(), &|_| chains());
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_chains() {
    use std::arch::x86_64::*;
    let (x, y) = (_mm512_set1_ps(1.000_000_1), _mm512_set1_ps(1e-7));
    // Distinct starts: no two chains are the same computation.
    let mut acc = [_mm512_setzero_ps(); PEAK_CHAINS];
    for (i, a) in acc.iter_mut().enumerate() {
        *a = _mm512_set1_ps(i as f32);
    }
    for _ in 0..PEAK_STEPS {
        for a in &mut acc {
            *a = _mm512_fmadd_ps(*a, x, y);
        }
    }
    black_box(acc);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn dot_chains() {
    use std::arch::x86_64::*;
    let (x, y) = (_mm512_set1_epi8(3), _mm512_set1_epi8(5));
    let mut acc = [_mm512_setzero_si512(); PEAK_CHAINS];
    for (i, a) in acc.iter_mut().enumerate() {
        *a = _mm512_set1_epi32(i as i32);
    }
    for _ in 0..PEAK_STEPS {
        for a in &mut acc {
            *a = _mm512_dpbusd_epi32(*a, x, y);
        }
    }
    black_box(acc);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_chains_256() {
    use std::arch::x86_64::*;
    let (x, y) = (_mm256_set1_ps(1.000_000_1), _mm256_set1_ps(1e-7));
    let mut acc = [_mm256_setzero_ps(); PEAK_CHAINS_256];
    for (i, a) in acc.iter_mut().enumerate() {
        *a = _mm256_set1_ps(i as f32);
    }
    for _ in 0..PEAK_STEPS {
        for a in &mut acc {
            *a = _mm256_fmadd_ps(*a, x, y);
        }
    }
    black_box(acc);
}

/// The AVX2 int8 dot as the kernels do it: 32 u8 × i8 products summed in pairs to i16
/// (`vpmaddubsw`), in pairs again to i32 (`vpmaddwd` by ones), added to the accumulator
/// (32 multiply-adds in three instructions).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_chains_256() {
    use std::arch::x86_64::*;
    // `ones` through black_box: no multiply by a known 1 to rewrite.
    let (x, ones) = (_mm256_set1_epi8(3), black_box(_mm256_set1_epi16(1)));
    let mut acc = [_mm256_setzero_si256(); PEAK_CHAINS];
    for (i, a) in acc.iter_mut().enumerate() {
        *a = _mm256_set1_epi32(i as i32);
    }
    for _ in 0..PEAK_STEPS {
        for a in &mut acc {
            // The accumulator's bytes as the signed operand: a chain the compiler cannot
            // lift out of the loop.
            let pairs = _mm256_maddubs_epi16(x, *a);
            *a = _mm256_add_epi32(*a, _mm256_madd_epi16(pairs, ones));
        }
    }
    black_box(acc);
}

/// One decode step at window L: rewind to L-1 and decode position L-1, in each arithmetic
/// the cache has: f32 named by the dtype, others `q8+int8-query` (but int8-query-i16-values,
/// whose decode steps are int8-query's: it codes weights only for more rows than a block).
fn decode(cr: &mut Criterion) {
    let mut g = cr.benchmark_group("decode");
    g.sample_size(20)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    for dtype in [KvDtype::F16, KvDtype::Q8_DEFAULT, KvDtype::Q4_DEFAULT] {
        for l in [512usize, 4096, 16384] {
            let mut c = filled(CacheKind::Contiguous, l, dtype);
            let mut io = Io::new(1);
            let p = [(l - 1) as i32];
            let arithmetics = c.arithmetics().into_iter().filter(|a| !a.i16_values());
            for arithmetic in arithmetics {
                c.set_arithmetic(arithmetic).unwrap();
                let name = match arithmetic {
                    Arithmetic::F32 => dtype.to_string(),
                    _ => format!("{dtype}+{arithmetic}"),
                };
                g.bench_with_input(BenchmarkId::new(name, l), &l, |b, _| {
                    b.iter(|| {
                        c.rewind(l - 1).unwrap();
                        io.step(&mut c, &p);
                    })
                });
            }
        }
    }
    g.finish();
}

/// Seq cache: `n` branches sharing a `STEP_CONTEXT`-token trunk ([`shared::steps`]), one
/// decode step for all of them, in f16 and q8 (each in the cache's default arithmetic, and q8
/// in int8-query-i16-values).
fn fork(cr: &mut Criterion) {
    let mut g = cr.benchmark_group("fork_step");
    g.sample_size(20)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    for dtype in [KvDtype::F16, KvDtype::Q8_DEFAULT] {
        let mut f = Fork::new(dtype);
        for (arithmetic, name) in step_arithmetics(&f.cache, dtype) {
            f.cache.set_arithmetic(arithmetic).unwrap();
            for n in [1usize, 4] {
                let id = BenchmarkId::new(format!("{name}/branches"), n);
                g.bench_with_input(id, &n, |b, &n| b.iter(|| f.step(n)));
            }
        }
    }
    g.finish();
}

/// Tree verify of 16 nodes vs a 1-token decode at L = `STEP_CONTEXT` ([`shared::steps`]), in
/// f16 and q8 (each in the cache's default arithmetic, and q8 in int8-query-i16-values).
fn tree_verify(cr: &mut Criterion) {
    let mut g = cr.benchmark_group("tree_verify");
    g.sample_size(20)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    for dtype in [KvDtype::F16, KvDtype::Q8_DEFAULT] {
        let mut t = Tree::new(dtype);
        for (arithmetic, name) in step_arithmetics(&t.tree, dtype) {
            t.set_arithmetic(arithmetic);
            g.bench_function(format!("{name}/nodes_16"), |b| b.iter(|| t.verify()));
            g.bench_function(format!("{name}/decode_1"), |b| b.iter(|| t.decode()));
        }
    }
    g.finish();
}

/// Prefill of 512 tokens (one layer) on each attention kernel.
fn prefill(cr: &mut Criterion) {
    use kvplug_cpu::attention::{use_kernels_from, Kernel};
    let mut g = cr.benchmark_group("prefill_512");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_secs(1));
    let pos: Vec<i32> = (0..512).collect();
    let kernels = [
        Kernel::TiledAvx512,
        Kernel::Tiled,
        Kernel::Xnnpack,
        Kernel::Rows,
    ];
    for kernel in kernels {
        if kernel == Kernel::Xnnpack && !cfg!(all(feature = "xnnpack", target_os = "linux")) {
            continue;
        }
        // The kernels' own view (KVPLUG_CPU_ISA capped), so a row's label is what ran.
        if kernel == Kernel::TiledAvx512 && !kvplug_cpu::simd::features().avx512f {
            continue;
        }
        use_kernels_from(kernel);
        let mut c = cache(CacheKind::Contiguous, 4096, KvDtype::F16);
        let mut io = Io::new(512);
        g.bench_function(format!("{kernel:?}").to_lowercase(), |b| {
            b.iter(|| {
                c.clear();
                io.step(&mut c, &pos);
            })
        });
    }
    use_kernels_from(Kernel::TiledAvx512);
    g.finish();
}

/// Shapes of the decode weight pass: [`WEIGHT_MATRICES`] matrices of `[1536, 576]` (SmolLM2's
/// MLP), 265 MB in f16, so every call streams from memory as a model's decode step does.
const WEIGHT_ROWS: usize = 1536;
const WEIGHT_COLS: usize = 576;
/// Matrices in the weight pass.
const WEIGHT_MATRICES: usize = 150;

/// One token through every matrix of the weight pass (`out = x·Wᵀ`), per stored dtype.
fn weights(cr: &mut Criterion) {
    use half::{bf16, f16};
    let mut g = cr.benchmark_group("weights_decode");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_secs(1));
    let x: Vec<f32> = (0..WEIGHT_COLS).map(|i| (i % 13) as f32 * 0.1).collect();
    let mut out = vec![0f32; WEIGHT_ROWS];
    let values =
        |m: usize| (0..WEIGHT_ROWS * WEIGHT_COLS).map(move |i| ((i + m) % 97) as f32 * 0.01);
    let f16s: Vec<Vec<f16>> = (0..WEIGHT_MATRICES)
        .map(|m| values(m).map(f16::from_f32).collect())
        .collect();
    g.bench_function("f16", |b| {
        b.iter(|| {
            for w in &f16s {
                kvplug_cpu::linear::linear(&x, 1, w, WEIGHT_ROWS, WEIGHT_COLS, &mut out);
            }
        })
    });
    drop(f16s);
    let bf16s: Vec<Vec<bf16>> = (0..WEIGHT_MATRICES)
        .map(|m| values(m).map(bf16::from_f32).collect())
        .collect();
    g.bench_function("bf16", |b| {
        b.iter(|| {
            for w in &bf16s {
                kvplug_cpu::linear::linear(&x, 1, w, WEIGHT_ROWS, WEIGHT_COLS, &mut out);
            }
        })
    });
    g.finish();
}

/// One token through every matrix of a [`shared::WeightSet`] (256 MB, out of cache), per
/// block format and shape, with f16 weights of the same shapes for comparison; throughput
/// is weight bytes streamed (GB/s). `examples/weights_bandwidth.rs` puts the same passes
/// against read-bandwidth passes, interleaved.
fn weights_blocks(cr: &mut Criterion) {
    use criterion::Throughput;
    let mut g = cr.benchmark_group("weights_decode_blocks");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_secs(1));
    for (rows, cols) in shared::BLOCK_SHAPES {
        let shape = format!("{rows}x{cols}");
        let x = shared::decode_token(cols);
        let mut out = vec![0f32; rows];
        let formats = shared::BLOCK_FORMATS.map(Some);
        for f in formats.into_iter().chain([None]) {
            if f.is_some_and(|f| cols % f.block_elems() != 0) {
                continue;
            }
            let set = shared::WeightSet::new(f, rows, cols);
            let name = f.map_or("f16", |f| f.name());
            g.throughput(Throughput::BytesDecimal(set.bytes() as u64));
            g.bench_with_input(BenchmarkId::new(name, &shape), &shape, |b, _| {
                b.iter(|| set.pass(&x, rows, &mut out))
            });
        }
    }
    g.finish();
}

/// Tokens of the block-format prefill benchmark.
const PREFILL_TOKENS: usize = 512;

/// Prefill through one `[896, 4864]` weight (Qwen2.5-0.5B's down projection) for
/// [`PREFILL_TOKENS`] tokens, per block format and f16; throughput in multiply-adds × 2
/// (GFLOP/s).
fn weights_prefill_blocks(cr: &mut Criterion) {
    use criterion::Throughput;
    use kvplug_backend_kit::model::BlockFormat;
    let (rows, cols, t) = (896, 4864, PREFILL_TOKENS);
    let mut g = cr.benchmark_group("weights_prefill_blocks");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_secs(1))
        .throughput(Throughput::Elements((2 * rows * cols * t) as u64));
    let x: Vec<f32> = (0..t * cols).map(|i| ((i as f32) * 0.0131).sin()).collect();
    let mut out = vec![0f32; t * rows];
    for f in [
        BlockFormat::Q4K,
        BlockFormat::Q6K,
        BlockFormat::Q8_0,
        BlockFormat::Q4_0,
    ] {
        let w = shared::random_blocks(f, rows * cols / f.block_elems(), 9);
        g.bench_function(f.name(), |b| {
            b.iter(|| kvplug_cpu::qlinear::linear_blocks(&x, t, f, &w, rows, cols, &mut out))
        });
    }
    let w: Vec<half::f16> = (0..rows * cols)
        .map(|i| half::f16::from_f32((i % 97) as f32 * 0.01))
        .collect();
    g.bench_function("f16", |b| {
        b.iter(|| kvplug_cpu::linear::linear(&x, t, &w, rows, cols, &mut out))
    });
    g.finish();
}

criterion_group!(
    benches,
    read_bandwidth,
    compute_peak,
    decode,
    fork,
    tree_verify,
    prefill,
    weights,
    weights_blocks,
    weights_prefill_blocks
);
criterion_main!(benches);
