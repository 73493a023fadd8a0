//! The attention kernels: GQA without repeating KV heads, masks None / Causal / Explicit,
//! quantized rows dequantized inside the dot products, stable softmax. Where the CPU has
//! AVX2/FMA/F16C every call runs on the tiled kernel of [`crate::tiled_attention`], on
//! 512-bit registers where it also has AVX-512F and the shapes allow (faster than XNNPACK
//! on a 512-token prefill: 1.4–1.9× in BENCH.md runs on AVX2 alone). Elsewhere long
//! query blocks run as XNNPACK GEMMs where it is built in, the rest on the portable row
//! kernel here, split over KV heads on the [`Workers`] pool when the window is long.

use kvplug_backend_kit::AttendMask;
use kvplug_core::Arithmetic;

use crate::pool::{CpuPool, HeadRows};
use crate::simd;
use crate::tensor::CpuTensor;
use crate::workers::{DisjointChunks, Workers};

/// Below this many multiply-adds per call, attention stays on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 18;

/// Query blocks at least this long use the XNNPACK GEMM path where the tiled kernel does
/// not apply (measured crossover over the row kernel; see BENCH.md).
#[cfg(all(feature = "xnnpack", target_os = "linux"))]
pub const XNNPACK_MIN_TOKENS: usize = 32;

/// The attention kernels, fastest first; each call runs on the first that applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kernel {
    /// [`crate::tiled_attention`] on 512-bit registers: AVX-512F, `D` a multiple of 32,
    /// quantized groups a multiple of 16 values.
    TiledAvx512,
    /// [`crate::tiled_attention`] on 256-bit registers: AVX2/FMA/F16C, `D` a multiple of 16.
    Tiled,
    /// XNNPACK GEMMs for query blocks of at least [`XNNPACK_MIN_TOKENS`] (when built in).
    Xnnpack,
    /// The portable row kernel: every call.
    Rows,
}

static FIRST_KERNEL: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Skips the kernels faster than `first` (default [`Kernel::TiledAvx512`], i.e. none): for
/// comparisons and for ruling a kernel out when debugging. Process-wide.
pub fn use_kernels_from(first: Kernel) {
    FIRST_KERNEL.store(first as u8, std::sync::atomic::Ordering::Relaxed);
}

/// Whether `kernel` may run: not skipped by [`use_kernels_from`], and XNNPACK (whose own
/// vector kernels `KVPLUG_CPU_ISA` cannot cap) not under `KVPLUG_CPU_ISA=scalar`.
fn allowed(kernel: Kernel) -> bool {
    let scalar = crate::simd::isa_cap().is_ok_and(|cap| cap == crate::simd::Isa::Scalar);
    kernel as u8 >= FIRST_KERNEL.load(std::sync::atomic::Ordering::Relaxed)
        && !(scalar && kernel == Kernel::Xnnpack)
}

/// Per-KV-head scratch, reused across steps.
#[derive(Default)]
pub struct HeadScratch {
    /// Scores, `[group, L]` (`[group, T, L]` on the GEMM path).
    scores: Vec<f32>,
    /// f32 copies of the K and V windows for the GEMM path, `[L, D]` each.
    #[cfg(all(feature = "xnnpack", target_os = "linux"))]
    window: (Vec<f32>, Vec<f32>),
    /// One K or V row converted to f32, `[D]`.
    row: Vec<f32>,
}

/// Scratch of one cache: one [`HeadScratch`] per KV head.
#[derive(Default)]
pub struct CpuScratch {
    heads: Vec<HeadScratch>,
    /// One per task of the tiled kernel.
    #[cfg(target_arch = "x86_64")]
    tiles: Vec<crate::tiled_attention::TileScratch>,
}

/// Row conversions of the row kernel.
trait LoadRows {
    /// Row `j` as f32 into `out` (`[D]`).
    fn load(&self, j: usize, out: &mut [f32]);
    /// Rows `[0, l)` as f32 into `buf` (`[l, d]`).
    #[cfg(all(feature = "xnnpack", target_os = "linux"))]
    fn window_f32(&self, l: usize, d: usize, buf: &mut Vec<f32>);
}

impl LoadRows for HeadRows<'_> {
    /// One conversion per row, shared by every query.
    #[inline(always)]
    fn load(&self, j: usize, out: &mut [f32]) {
        let d = out.len();
        match *self {
            HeadRows::F32(v) => out.copy_from_slice(&v[j * d..(j + 1) * d]),
            HeadRows::F16(v) => simd::f16_to_f32(&v[j * d..(j + 1) * d], out),
            HeadRows::Bf16(v) => simd::bf16_to_f32(&v[j * d..(j + 1) * d], out),
            HeadRows::Quant {
                bits,
                group,
                codes,
                scales,
                los,
            } => {
                let (ng, cb) = (d / group, d * bits as usize / 8);
                simd::dequantize_row(
                    &codes[j * cb..(j + 1) * cb],
                    &scales[j * ng..(j + 1) * ng],
                    &los[j * ng..(j + 1) * ng],
                    bits,
                    group,
                    out,
                );
            }
        }
    }

    /// Rows `[0, l)` as f32 into `buf` (`[l, d]`).
    #[cfg(all(feature = "xnnpack", target_os = "linux"))]
    fn window_f32(&self, l: usize, d: usize, buf: &mut Vec<f32>) {
        buf.clear();
        buf.resize(l * d, 0.0);
        for (j, row) in buf.chunks_exact_mut(d).enumerate() {
            self.load(j, row);
        }
    }
}

/// `out = softmax(q·kᵀ·scale + mask)·v` over rows `[0, l)`. q and out are `[Hq, T, D]`.
/// `arithmetic` is the largest error allowed: the tiled kernel takes int8-query scores
/// where it has them; every other path computes in f32. With `sinks` (one per query head),
/// each row's softmax sum also counts `e^{sink}` ([`simd::sink_weight`]).
#[allow(clippy::too_many_arguments)]
pub fn attend(
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))] arithmetic: Arithmetic,
    q: &CpuTensor,
    k: &CpuPool,
    v: &CpuPool,
    l: usize,
    mask: AttendMask<'_>,
    scale: f32,
    sinks: Option<&[f32]>,
    out: &mut CpuTensor,
    scratch: &mut CpuScratch,
) {
    let (hq, t, d) = (q.dims[0], q.dims[1], q.dims[2]);
    #[cfg(target_arch = "x86_64")]
    {
        use crate::tiled_attention::{self as tiled, Width};
        let widths: &[Width] = if allowed(Kernel::TiledAvx512) {
            &[Width::Avx512, Width::Avx2]
        } else if allowed(Kernel::Tiled) {
            &[Width::Avx2]
        } else {
            &[]
        };
        let (tiles, min) = (&mut scratch.tiles, PARALLEL_MIN_WORK);
        let call = tiled::Call {
            l,
            mask,
            scale,
            sinks,
            parallel_min: min,
            arithmetic,
        };
        if tiled::attend(q, k, v, call, out, tiles, widths) {
            return;
        }
    }
    #[cfg(all(feature = "xnnpack", target_os = "linux"))]
    let gemm =
        t >= XNNPACK_MIN_TOKENS && allowed(Kernel::Xnnpack) && crate::xnnpack::available().is_ok();
    let hkv = k.heads;
    let g = hq / hkv;
    scratch.heads.resize_with(hkv, HeadScratch::default);
    let per_head = g * t * d;
    let one = |kh: usize, o: &mut [f32], s: &mut HeadScratch| {
        let qh = &q.data[kh * per_head..(kh + 1) * per_head];
        // The sinks of this KV head's g query heads.
        let sinks = sinks.map(|s| &s[kh * g..(kh + 1) * g]);
        let (kr, vr) = (k.head_rows(kh, k.cells), v.head_rows(kh, v.cells));
        #[cfg(all(feature = "xnnpack", target_os = "linux"))]
        if gemm {
            match attend_kv_head_gemm(qh, kr, vr, g, t, d, l, mask, scale, sinks, o, s) {
                Ok(()) => return,
                Err(e) => tracing::debug!("xnnpack path failed, using the Rust kernel: {e}"),
            }
        }
        attend_kv_head(qh, kr, vr, g, t, d, l, mask, scale, sinks, o, s);
    };
    if hq * t * l * d >= PARALLEL_MIN_WORK {
        let outs = DisjointChunks::new(&mut out.data, per_head);
        let scratch = DisjointChunks::new(&mut scratch.heads, 1);
        // SAFETY: the pool hands each KV head index to exactly one task.
        Workers::global().run(hkv, &|kh| unsafe {
            one(kh, outs.get(kh), &mut scratch.get(kh)[0])
        });
    } else {
        for (kh, (o, s)) in out
            .data
            .chunks_mut(per_head)
            .zip(scratch.heads.iter_mut())
            .enumerate()
        {
            one(kh, o, s);
        }
    }
}

/// [`attend_kv_head`] as two XNNPACK GEMMs: `S = Q·Kᵀ` over all `g·T` query rows, masked
/// stable softmax in place, `O = P·V`. Same maths, same masks.
#[cfg(all(feature = "xnnpack", target_os = "linux"))]
#[allow(clippy::too_many_arguments)]
fn attend_kv_head_gemm(
    q: &[f32],
    k: HeadRows<'_>,
    v: HeadRows<'_>,
    g: usize,
    t: usize,
    d: usize,
    l: usize,
    mask: AttendMask<'_>,
    scale: f32,
    sinks: Option<&[f32]>,
    out: &mut [f32],
    s: &mut HeadScratch,
) -> Result<(), String> {
    use crate::xnnpack::FullyConnected;
    let (kw, vw) = &mut s.window;
    k.window_f32(l, d, kw);
    v.window_f32(l, d, vw);
    s.scores.clear();
    s.scores.resize(g * t * l, 0.0);
    FullyConnected::new(d, l, kw, false)?.run(g * t, q, &mut s.scores)?;
    for (r, row) in s.scores.chunks_exact_mut(l).enumerate() {
        let i = r % t;
        let visible = |j: usize| match mask {
            AttendMask::None => true,
            AttendMask::Causal => j + t <= l + i,
            AttendMask::Explicit(m) => m[i * l + j],
        };
        let mut max = f32::NEG_INFINITY;
        for (j, x) in row.iter_mut().enumerate() {
            *x = if visible(j) {
                *x * scale
            } else {
                f32::NEG_INFINITY
            };
            max = max.max(*x);
        }
        if max == f32::NEG_INFINITY {
            row.fill(0.0);
            continue;
        }
        let mut sum = simd::sink_weight(sinks.map(|s| s[r / t]), max);
        for x in row.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        row.iter_mut().for_each(|x| *x /= sum);
    }
    FullyConnected::new(l, d, vw, true)?.run(g * t, &s.scores, out)
}

/// One KV head and its `g` query heads (and their sinks, where given): q and out are `[g, T,
/// D]`. Each K and V row is read and converted once per call and used by all `g·T` query
/// rows.
#[allow(clippy::too_many_arguments)]
fn attend_kv_head(
    q: &[f32],
    k: HeadRows<'_>,
    v: HeadRows<'_>,
    g: usize,
    t: usize,
    d: usize,
    l: usize,
    mask: AttendMask<'_>,
    scale: f32,
    sinks: Option<&[f32]>,
    out: &mut [f32],
    s: &mut HeadScratch,
) {
    let rows = g * t;
    s.scores.clear();
    s.scores.resize(rows * l, f32::NEG_INFINITY);
    s.row.resize(d, 0.0);
    // Query i sees keys [0, last(i)); Explicit masks are consulted inside that range.
    let last = |i: usize| match mask {
        AttendMask::Causal => l - t + i + 1,
        AttendMask::None | AttendMask::Explicit(_) => l,
    };
    let bits = match mask {
        AttendMask::Explicit(m) => Some(m),
        _ => None,
    };
    let visible = |i: usize, j: usize| j < last(i) && bits.is_none_or(|m| m[i * l + j]);
    for j in 0..l {
        k.load(j, &mut s.row);
        for i in (0..t).filter(|&i| visible(i, j)) {
            // Query rows gi·t + i for every gi: stride t rows in q and in the scores.
            let (qi, si) = (&q[i * d..], &mut s.scores[i * l + j..]);
            simd::dot_many(qi, t * d, g, &s.row, scale, si, t * l);
        }
    }
    for (r, sc) in s.scores.chunks_exact_mut(l).enumerate() {
        simd::softmax_in_place(sc, sinks.map(|s| s[r / t]));
    }
    out.fill(0.0);
    for j in 0..l {
        if (0..t).all(|i| !visible(i, j)) {
            continue;
        }
        v.load(j, &mut s.row);
        simd::axpy_many(&s.scores[j..], l, rows, &s.row, out);
    }
}
