//! The attention kernel: GQA without repeating KV heads, masks None / Causal / Explicit,
//! quantized rows dequantized inside the dot products, stable softmax. Work is split over
//! KV heads on the [`Workers`] pool when the window is long. A decode step (one query
//! token) runs on the fused, tiled kernel of [`crate::decode_attention`] where the CPU has
//! AVX2/FMA/F16C; several query tokens (prefill, fork, tree verify) on the row kernel here.

use kvplug_backend_kit::AttendMask;

use crate::pool::{CpuPool, HeadRows};
use crate::simd;
use crate::tensor::CpuTensor;
use crate::workers::{DisjointChunks, Workers};

/// Below this many multiply-adds per call, attention stays on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 18;

/// Query blocks at least this long use the XNNPACK GEMM path (measured crossover; see
/// BENCH.md).
#[cfg(feature = "xnnpack")]
pub const XNNPACK_MIN_TOKENS: usize = 32;

#[cfg(feature = "xnnpack")]
static XNNPACK_ENABLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Turns the XNNPACK prefill path on or off (on by default) — for comparisons and for
/// ruling it out when debugging.
#[cfg(feature = "xnnpack")]
pub fn use_xnnpack(enabled: bool) {
    XNNPACK_ENABLED.store(enabled, std::sync::atomic::Ordering::Relaxed);
}

/// Per-KV-head scratch, reused across steps.
#[derive(Default)]
pub struct HeadScratch {
    /// Scores, `[group, L]` (`[group, T, L]` on the GEMM path).
    scores: Vec<f32>,
    /// f32 copies of the K and V windows for the GEMM path, `[L, D]` each.
    #[cfg(feature = "xnnpack")]
    window: (Vec<f32>, Vec<f32>),
    /// One K or V row converted to f32, `[D]`.
    row: Vec<f32>,
    /// The decode kernel's tile scores and softmax state.
    #[cfg(target_arch = "x86_64")]
    decode: crate::decode_attention::DecodeScratch,
}

/// Scratch of one cache: one [`HeadScratch`] per KV head.
#[derive(Default)]
pub struct CpuScratch {
    heads: Vec<HeadScratch>,
}

/// Row conversions of the row kernel.
trait LoadRows {
    /// Row `j` as f32 into `out` (`[D]`).
    fn load(&self, j: usize, out: &mut [f32]);
    /// HeadRows `[0, l)` as f32 into `buf` (`[l, d]`).
    /// Rows `[0, l)` as f32 into `buf` (`[l, d]`).
    #[cfg(feature = "xnnpack")]
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
    #[cfg(feature = "xnnpack")]
    fn window_f32(&self, l: usize, d: usize, buf: &mut Vec<f32>) {
        buf.clear();
        buf.resize(l * d, 0.0);
        for (j, row) in buf.chunks_exact_mut(d).enumerate() {
            self.load(j, row);
        }
    }
}

/// `out = softmax(q·kᵀ·scale + mask)·v` over rows `[0, l)`. q and out are `[Hq, T, D]`.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &CpuTensor,
    k: &CpuPool,
    v: &CpuPool,
    l: usize,
    mask: AttendMask<'_>,
    scale: f32,
    out: &mut CpuTensor,
    scratch: &mut CpuScratch,
) {
    let (hq, t, d) = (q.dims[0], q.dims[1], q.dims[2]);
    let hkv = k.heads;
    let g = hq / hkv;
    scratch.heads.resize_with(hkv, HeadScratch::default);
    let per_head = g * t * d;
    let one = |kh: usize, o: &mut [f32], s: &mut HeadScratch| {
        let qh = &q.data[kh * per_head..(kh + 1) * per_head];
        let (kr, vr) = (k.head_rows(kh, k.cells), v.head_rows(kh, v.cells));
        #[cfg(target_arch = "x86_64")]
        if t == 1 && attend_decode(qh, kr, vr, g, d, l, mask, scale, o, s) {
            return;
        }
        #[cfg(feature = "xnnpack")]
        if t >= XNNPACK_MIN_TOKENS
            && XNNPACK_ENABLED.load(std::sync::atomic::Ordering::Relaxed)
            && crate::xnnpack::available().is_ok()
        {
            match attend_kv_head_gemm(qh, kr, vr, g, t, d, l, mask, scale, o, s) {
                Ok(()) => return,
                Err(e) => tracing::debug!("xnnpack path failed, using the Rust kernel: {e}"),
            }
        }
        attend_kv_head(qh, kr, vr, g, t, d, l, mask, scale, o, s);
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

/// [`attend_kv_head`] for one query token on the fused decode kernel
/// ([`crate::decode_attention`]); false (nothing done) where it does not apply: no
/// AVX2/FMA/F16C, `d` not a multiple of 16, quantized groups not a multiple of 8.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn attend_decode(
    q: &[f32],
    k: HeadRows<'_>,
    v: HeadRows<'_>,
    g: usize,
    d: usize,
    l: usize,
    mask: AttendMask<'_>,
    scale: f32,
    out: &mut [f32],
    s: &mut HeadScratch,
) -> bool {
    use crate::decode_attention::{attend, Bf16Rows, Plain, QuantRows};
    use half::slice::HalfFloatSliceExt;
    if !simd::vector_path() || d % 16 != 0 {
        return false;
    }
    // One query at position l - 1: a causal mask hides nothing.
    let mask = match mask {
        AttendMask::Explicit(m) => Some(&m[..l]),
        AttendMask::None | AttendMask::Causal => None,
    };
    let s = &mut s.decode;
    let bits = |r: &[u16]| Plain { p: r.as_ptr(), d };
    let quant = |r: HeadRows<'_>| match r {
        HeadRows::Quant {
            bits,
            group,
            codes,
            scales,
            los,
        } => QuantRows::new(codes, scales, los, bits, group, d),
        _ => None,
    };
    // SAFETY: the features were checked above, d % 16 == 0, and each pool holds l rows of
    // d values in the layout its view reads (K and V share the cache's storage dtype).
    unsafe {
        match (k, v) {
            (HeadRows::F32(a), HeadRows::F32(b)) => {
                let (a, b) = (Plain { p: a.as_ptr(), d }, Plain { p: b.as_ptr(), d });
                attend(q, a, b, g, d, l, mask, scale, out, s)
            }
            (HeadRows::F16(a), HeadRows::F16(b)) => {
                let (a, b) = (bits(a.reinterpret_cast()), bits(b.reinterpret_cast()));
                attend(q, a, b, g, d, l, mask, scale, out, s)
            }
            (HeadRows::Bf16(a), HeadRows::Bf16(b)) => {
                let (a, b) = (
                    Bf16Rows(bits(a.reinterpret_cast())),
                    Bf16Rows(bits(b.reinterpret_cast())),
                );
                attend(q, a, b, g, d, l, mask, scale, out, s)
            }
            _ => match (quant(k), quant(v)) {
                (Some(a), Some(b)) => attend(q, a, b, g, d, l, mask, scale, out, s),
                _ => return false,
            },
        }
    }
    true
}

/// [`attend_kv_head`] as two XNNPACK GEMMs: `S = Q·Kᵀ` over all `g·T` query rows, masked
/// stable softmax in place, `O = P·V`. Same maths, same masks.
#[cfg(feature = "xnnpack")]
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
        let mut sum = 0.0;
        for x in row.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        row.iter_mut().for_each(|x| *x /= sum);
    }
    FullyConnected::new(l, d, vw, true)?.run(g * t, &s.scores, out)
}

/// One KV head and its `g` query heads: q and out are `[g, T, D]`. Each K and V row is
/// read and converted once per call and used by all `g·T` query rows.
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
    for sc in s.scores.chunks_exact_mut(l) {
        simd::softmax_in_place(sc);
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
