//! Row kernels: dot products and `y += w·x` over f32, f16 and bf16 rows, with AVX2/FMA/F16C
//! paths chosen at run time and portable fallbacks.

use half::{bf16, f16};
use kvplug_core::exp::{fast_exp, EXP2_POLY};

/// CPU features the kernels use, detected once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Features {
    /// AVX2 + FMA + F16C (the vector path).
    pub avx2_fma_f16c: bool,
    /// AVX-512F (the weight kernels' and the tiled attention kernel's 512-bit path).
    pub avx512f: bool,
    /// AVX-512 VNNI + VL + BW (the block-format weight kernels' `dpbusd` path).
    pub avx512vnni: bool,
    /// How the 256-bit integer kernels multiply ([`dot256`]).
    pub dot256: Dot256,
}

impl Default for Features {
    fn default() -> Self {
        features()
    }
}

/// Detects the features, capped at the level `KVPLUG_CPU_ISA` allows ([`isa_cap`]).
pub fn features() -> Features {
    Features {
        avx2_fma_f16c: vector_path(),
        avx512f: wide_path(),
        avx512vnni: vnni_path(),
        dot256: dot256(),
    }
}

/// The instruction-set levels the kernels are written for, lowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Portable Rust only.
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX2 with 256-bit VNNI ([`Dot256::Vex`] or [`Dot256::Evex`]) in the integer
    /// attention and block-format weight kernels.
    Avx2Vnni,
    /// AVX-512 (F, and VNNI + VL + BW for the integer kernels) beside AVX2.
    Avx512,
}

/// How the 256-bit integer kernels (`tiled_attention::int8_query`, `i16_values`, and
/// `qlinear` where the CPU lacks AVX-512 VNNI or the cap excludes it) multiply: the same
/// exact integer sums whichever, so the same results bit for bit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Dot256 {
    /// AVX2's `vpmaddubsw`/`vpmaddwd` and an add.
    #[default]
    Maddubs,
    /// AVX-VNNI's `vpdpbusd`/`vpdpwssd` in their VEX form (Intel cores since Alder Lake
    /// without AVX-512).
    Vex,
    /// The same instructions in their EVEX form (AVX-512 VNNI + VL): what an AVX-512 CPU
    /// capped at `avx2vnni` runs, so that it tests and benchmarks that level.
    Evex,
}

/// The highest level the kernels may use: `KVPLUG_CPU_ISA` (`scalar`, `avx2`, `avx2vnni` or
/// `avx512`),
/// read once; unset or empty, no cap. It lets a machine test and benchmark the paths a lesser
/// CPU takes; it never enables what the CPU lacks. An unknown value is an error
/// [`CpuDevice`](crate::CpuDevice) reports when the plugin opens (kernels then run scalar).
pub fn isa_cap() -> Result<Isa, String> {
    static CAP: std::sync::OnceLock<Result<Isa, String>> = std::sync::OnceLock::new();
    CAP.get_or_init(|| {
        let v = std::env::var("KVPLUG_CPU_ISA").unwrap_or_default();
        match v.trim().to_ascii_lowercase().as_str() {
            "" | "avx512" => Ok(Isa::Avx512),
            "avx2vnni" => Ok(Isa::Avx2Vnni),
            "avx2" => Ok(Isa::Avx2),
            "scalar" => Ok(Isa::Scalar),
            _ => Err(format!(
                "KVPLUG_CPU_ISA={v:?}: expected avx512, avx2vnni, avx2 or scalar"
            )),
        }
    })
    .clone()
}

/// Whether `level` is within [`isa_cap`].
#[inline]
fn allowed(level: Isa) -> bool {
    isa_cap().is_ok_and(|cap| level <= cap)
}

/// Whether the AVX2 + FMA + F16C kernels can run here.
#[inline]
pub(crate) fn vector_path() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        allowed(Isa::Avx2)
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the AVX-512F kernels (weights, tiled attention) can run here (the AVX2 set is
/// present too).
#[inline]
pub(crate) fn wide_path() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        allowed(Isa::Avx512) && vector_path() && is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the AVX-512 VNNI kernels can run here (the AVX2 set, AVX-512 VL and BW are present
/// too).
#[inline]
pub(crate) fn vnni_path() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        wide_path()
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// How the 256-bit integer kernels multiply here: 256-bit VNNI where the cap
/// allows [`Isa::Avx2Vnni`] and the CPU has AVX-VNNI (VEX) or AVX-512 VNNI + VL (EVEX), else
/// `maddubs`.
pub fn dot256() -> Dot256 {
    #[cfg(target_arch = "x86_64")]
    {
        if !(allowed(Isa::Avx2Vnni) && vector_path()) {
            Dot256::Maddubs
        } else if is_x86_feature_detected!("avxvnni") {
            Dot256::Vex
        } else if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
            Dot256::Evex
        } else {
            Dot256::Maddubs
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Dot256::Maddubs
    }
}

/// Whether the AVX-512 VBMI byte permutes can run here (beside the [`vnni_path`] set).
#[inline]
pub(crate) fn vbmi_path() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        vnni_path() && is_x86_feature_detected!("avx512vbmi")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `Σ a[i]·b[i]` with eight independent lanes (vectorizes without reassociation).
#[inline(always)]
fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `Σ x[i]` with eight independent lanes.
#[inline(always)]
fn sum_lanes(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let c = x.chunks_exact(8);
    let tail: f32 = c.remainder().iter().sum();
    for v in c {
        for l in 0..8 {
            acc[l] += v[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `Σ a[i]·b[i]`. Panics unless `a` and `b` have the same length.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f32 operands");
    #[cfg(target_arch = "x86_64")]
    if vector_path() {
        // SAFETY: the features were detected above.
        return unsafe { x86::dot_f32(a, b) };
    }
    dot_lanes(a, b)
}

/// `y += w·x`. Panics unless `x` and `y` have the same length.
pub fn axpy_f32(w: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "axpy_f32 operands");
    #[cfg(target_arch = "x86_64")]
    if vector_path() {
        // SAFETY: the features were detected above.
        return unsafe { x86::axpy_f32(w, x, y) };
    }
    for (o, v) in y.iter_mut().zip(x) {
        *o += w * v;
    }
}

/// `out[r·out_stride] = scale · (q[r·q_stride ..][..d] · k)` for `r < n` (`d = k.len()`):
/// one pass over `k` for all `n` query rows. Panics unless `q` holds `n` rows of `d` at
/// `q_stride` and `out` `n` values at `out_stride`.
pub fn dot_many(
    q: &[f32],
    q_stride: usize,
    n: usize,
    k: &[f32],
    scale: f32,
    out: &mut [f32],
    out_stride: usize,
) {
    if n == 0 {
        return;
    }
    let (last_q, last_out) = ((n - 1) * q_stride + k.len(), (n - 1) * out_stride);
    assert!(
        q.len() >= last_q && out.len() > last_out,
        "dot_many: {n} rows need q >= {last_q} and out > {last_out} values, got {} and {}",
        q.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    if vector_path() {
        // SAFETY: the features were detected above.
        return unsafe { x86::dot_many(q, q_stride, n, k, scale, out, out_stride) };
    }
    let d = k.len();
    for r in 0..n {
        out[r * out_stride] = dot_lanes(&q[r * q_stride..r * q_stride + d], k) * scale;
    }
}

/// `out[r] += w[r·w_stride] · v` for `r < n`, where `out` holds `n` rows of `v.len()`;
/// rows with a zero weight are skipped. One pass over `v` for all rows. Panics unless `w`
/// holds `n` weights at `w_stride` and `out` `n` rows.
pub fn axpy_many(w: &[f32], w_stride: usize, n: usize, v: &[f32], out: &mut [f32]) {
    if n == 0 {
        return;
    }
    assert!(
        w.len() > (n - 1) * w_stride && out.len() >= n * v.len(),
        "axpy_many: {n} rows of {} do not fit w ({}) and out ({})",
        v.len(),
        w.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    if vector_path() {
        // SAFETY: the features were detected above.
        return unsafe { x86::axpy_many(w, w_stride, n, v, out) };
    }
    let d = v.len();
    for r in 0..n {
        let wr = w[r * w_stride];
        if wr != 0.0 {
            for (o, x) in out[r * d..(r + 1) * d].iter_mut().zip(v) {
                *o += wr * x;
            }
        }
    }
}

/// Dequantizes one row (see [`kvplug_backend_kit::quant::dequantize_row`]), vectorized
/// with AVX2 where available. Panics unless `bits` is 4 or 8, `group` divides `out.len()`
/// and `codes`, `scales` and `los` hold a whole row of that layout.
pub fn dequantize_row(
    codes: &[u8],
    scales: &[u16],
    los: &[u16],
    bits: u32,
    group: usize,
    out: &mut [f32],
) {
    let d = out.len();
    assert!(
        matches!(bits, 4 | 8)
            && group > 0
            && group.is_multiple_of(2)
            && d.is_multiple_of(group)
            && codes.len() >= d * bits as usize / 8
            && scales.len() >= d / group
            && los.len() >= d / group,
        "dequantize_row: a row of {d} values in {bits}-bit groups of {group} needs more than {} codes, {} scales, {} offsets",
        codes.len(),
        scales.len(),
        los.len()
    );
    #[cfg(target_arch = "x86_64")]
    if vector_path() {
        // SAFETY: the features were detected above.
        return unsafe { x86::dequantize_row(codes, scales, los, bits, group, out) };
    }
    kvplug_backend_kit::quant::dequantize_row(codes, scales, los, bits, group, out)
}

/// Quantizes one row (see [`kvplug_backend_kit::quant::quantize_row`]), the same bytes,
/// vectorized with AVX-512 where available for groups of a multiple of 16 values.
pub fn quantize_row(
    row: &[f32],
    bits: u32,
    group: usize,
    codes: &mut [u8],
    scales: &mut [u16],
    los: &mut [u16],
) {
    #[cfg(target_arch = "x86_64")]
    if wide_path()
        && group.is_multiple_of(16)
        && row.len().is_multiple_of(group)
        && matches!(bits, 4 | 8)
        && codes.len() >= row.len() * bits as usize / 8
        && scales.len() >= row.len() / group
        && los.len() >= row.len() / group
    {
        // SAFETY: the features were detected and the layout checked above.
        return unsafe { x86::quantize_row(row, bits, group, codes, scales, los) };
    }
    kvplug_backend_kit::quant::quantize_row(row, bits, group, codes, scales, los)
}

/// `out = src` converted from f16. Panics unless both have the same length.
pub fn f16_to_f32(src: &[f16], out: &mut [f32]) {
    assert_eq!(src.len(), out.len(), "f16_to_f32 operands");
    #[cfg(target_arch = "x86_64")]
    if vector_path() {
        // SAFETY: the features were detected above.
        return unsafe { x86::f16_to_f32(src, out) };
    }
    for (o, x) in out.iter_mut().zip(src) {
        *o = x.to_f32();
    }
}

/// `out = src` converted from bf16 (exact: a shift). Panics unless both have the same length.
pub fn bf16_to_f32(src: &[bf16], out: &mut [f32]) {
    assert_eq!(src.len(), out.len(), "bf16_to_f32 operands");
    for (o, x) in out.iter_mut().zip(src) {
        *o = f32::from_bits((x.to_bits() as u32) << 16);
    }
}

/// Numerically stable softmax of `x` in place; an all `-inf` row becomes zeros.
pub fn softmax_in_place(x: &mut [f32], sink: Option<f32>) {
    #[cfg(target_arch = "x86_64")]
    if vector_path() {
        // SAFETY: the features were detected above.
        return unsafe { x86::softmax_in_place(x, sink) };
    }
    softmax_body(x, sink)
}

#[inline(always)]
fn softmax_body(x: &mut [f32], sink: Option<f32>) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        x.fill(0.0);
        return;
    }
    // Separate passes so the exp loop vectorizes (a running float sum would not).
    x.iter_mut().for_each(|v| *v = fast_exp(*v - max));
    let inv = 1.0 / (sum_lanes(x) + sink_weight(sink, max));
    x.iter_mut().for_each(|v| *v *= inv);
}

/// The weight `e^{sink − max}` an attention sink adds to a softmax sum taken relative to
/// `max` (0 without a sink), in f32's exp.
pub fn sink_weight(sink: Option<f32>, max: f32) -> f32 {
    sink.map_or(0.0, |s| (s - max).exp())
}

/// `out = silu(gate) · up` element-wise, `silu(g) = g / (1 + e^-g)` with [`fast_exp`].
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    gated(gate, up, out, |g| g / (1.0 + fast_exp(-g)))
}

/// `out = sigmoid(gate) · x` element-wise, through [`fast_exp`].
pub fn sigmoid_mul(gate: &[f32], x: &[f32], out: &mut [f32]) {
    gated(gate, x, out, |g| 1.0 / (1.0 + fast_exp(-g)))
}

/// `out = gelu_tanh(gate) · up` element-wise (Gemma's GELU, tanh approximation), as
/// `g / (1 + e^(−2y))`, which equals `g · (1 + tanh y) / 2` without its cancellation,
/// through [`fast_exp`].
pub fn gelu_tanh_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    const C: f32 = 0.797_884_6; // √(2/π)
    gated(gate, up, out, |g| {
        g / (1.0 + fast_exp(-2.0 * (C * (g + 0.044715 * g * g * g))))
    })
}

/// `out = act(gate) · up` element-wise, compiled for AVX2/FMA where the CPU has them so that
/// the loop vectorizes (`act` is branch-free).
#[inline(always)]
fn gated(gate: &[f32], up: &[f32], out: &mut [f32], act: impl Fn(f32) -> f32) {
    #[cfg(target_arch = "x86_64")]
    if vector_path() {
        // SAFETY: the features were detected above.
        return unsafe { x86::gated(gate, up, out, act) };
    }
    gated_body(gate, up, out, act)
}

#[inline(always)]
fn gated_body(gate: &[f32], up: &[f32], out: &mut [f32], act: impl Fn(f32) -> f32) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = act(g) * u;
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use half::f16;
    use std::arch::x86_64::*;

    /// The sum of the 8 lanes.
    #[inline(always)]
    pub unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i + 16 <= n {
            acc0 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(b.as_ptr().add(i)),
                acc0,
            );
            acc1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i + 8)),
                _mm256_loadu_ps(b.as_ptr().add(i + 8)),
                acc1,
            );
            i += 16;
        }
        let mut s = hsum(_mm256_add_ps(acc0, acc1));
        while i < n {
            s += a[i] * b[i];
            i += 1;
        }
        s
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy_f32(w: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len().min(y.len());
        let wv = _mm256_set1_ps(w);
        let mut i = 0;
        while i + 8 <= n {
            let o = _mm256_fmadd_ps(
                wv,
                _mm256_loadu_ps(x.as_ptr().add(i)),
                _mm256_loadu_ps(y.as_ptr().add(i)),
            );
            _mm256_storeu_ps(y.as_mut_ptr().add(i), o);
            i += 8;
        }
        while i < n {
            y[i] += w * x[i];
            i += 1;
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn h2f(bits: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// Same maths as the kit's reference, which it calls for layouts other than q8 with
    /// groups of a multiple of 8: there the f16 scale and offset are converted by F16C and
    /// 8 codes are widened per instruction.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dequantize_row(
        codes: &[u8],
        scales: &[u16],
        los: &[u16],
        bits: u32,
        group: usize,
        out: &mut [f32],
    ) {
        if bits != 8 || !group.is_multiple_of(8) {
            return kvplug_backend_kit::quant::dequantize_row(codes, scales, los, bits, group, out);
        }
        for (g, o) in out.chunks_exact_mut(group).enumerate() {
            let (sv, lv) = (_mm256_set1_ps(h2f(scales[g])), _mm256_set1_ps(h2f(los[g])));
            for (i, chunk) in o.chunks_exact_mut(8).enumerate() {
                let c8 = _mm_loadl_epi64(codes.as_ptr().add(g * group + i * 8) as *const __m128i);
                let f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c8));
                _mm256_storeu_ps(chunk.as_mut_ptr(), _mm256_fmadd_ps(f, sv, lv));
            }
        }
    }

    /// [`super::quantize_row`] on 16 lanes: each group's minimum and maximum, its f16 scale
    /// and offset, then per value the estimated code corrected against `(c ± ½)·scale`,
    /// the kit's steps lane for lane.
    ///
    /// # Safety
    /// AVX-512F/BW/VL are present; groups are a multiple of 16 values and the outputs hold
    /// the row's layout.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn quantize_row(
        row: &[f32],
        bits: u32,
        group: usize,
        codes: &mut [u8],
        scales: &mut [u16],
        los: &mut [u16],
    ) {
        let levels = (1u32 << bits) - 1;
        let top = _mm512_set1_ps(levels as f32);
        let (zero, half) = (_mm512_setzero_ps(), _mm512_set1_ps(0.5));
        let f2h = |x: f32| {
            _mm_extract_epi16::<0>(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(x))) as u16
        };
        for (g, x) in row.chunks_exact(group).enumerate() {
            let (mut lo, mut hi) = (
                _mm512_set1_ps(f32::INFINITY),
                _mm512_set1_ps(f32::NEG_INFINITY),
            );
            for c in x.chunks_exact(16) {
                let v = _mm512_loadu_ps(c.as_ptr());
                // NaN lanes lose, as in `f32::min`/`max` folds.
                lo = _mm512_min_ps(v, lo);
                hi = _mm512_max_ps(v, hi);
            }
            let (lo, hi) = (_mm512_reduce_min_ps(lo), _mm512_reduce_max_ps(hi));
            let scale_h = f2h((hi - lo) * kvplug_core::quant::inverse_levels(bits));
            // A zero lo (either sign) is stored as +0.
            let lo_h = match f2h(lo) {
                0x8000 => 0,
                h => h,
            };
            (scales[g], los[g]) = (scale_h, lo_h);
            let (scale, lo) = (h2f(scale_h), h2f(lo_h));
            let (sv, lv) = (_mm512_set1_ps(scale), _mm512_set1_ps(lo));
            for (i, c) in x.chunks_exact(16).enumerate() {
                let code = if scale == 0.0 {
                    _mm512_setzero_si512()
                } else {
                    let d = _mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), lv);
                    let q = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(
                        _mm512_add_ps(_mm512_div_ps(d, sv), half),
                    );
                    // NaN estimates clamp to 0, as `f32::clamp` then `as u32` gives.
                    let q = _mm512_min_ps(_mm512_max_ps(q, zero), top);
                    let down = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(q, zero)
                        & _mm512_cmp_ps_mask::<_CMP_LT_OQ>(
                            d,
                            _mm512_mul_ps(_mm512_sub_ps(q, half), sv),
                        );
                    let up = !down
                        & _mm512_cmp_ps_mask::<_CMP_LT_OQ>(q, top)
                        & _mm512_cmp_ps_mask::<_CMP_GE_OQ>(
                            d,
                            _mm512_mul_ps(_mm512_add_ps(q, half), sv),
                        );
                    let q = _mm512_mask_sub_ps(q, down, q, _mm512_set1_ps(1.0));
                    let q = _mm512_mask_add_ps(q, up, q, _mm512_set1_ps(1.0));
                    _mm512_cvttps_epi32(q)
                };
                let at = g * group + i * 16;
                if bits == 8 {
                    _mm_storeu_si128(
                        codes.as_mut_ptr().add(at) as *mut __m128i,
                        _mm512_cvtepi32_epi8(code),
                    );
                } else {
                    // Each 64-bit lane holds (even, odd): even | odd << 4 in its low byte.
                    let pair = _mm512_or_si512(code, _mm512_srli_epi64::<28>(code));
                    _mm_storel_epi64(
                        codes.as_mut_ptr().add(at / 2) as *mut __m128i,
                        _mm512_cvtepi64_epi8(pair),
                    );
                }
            }
        }
    }

    /// [`kvplug_core::exp::fast_exp`] on 8 lanes, to the same accuracy (fused multiply-adds).
    #[inline(always)]
    pub unsafe fn exp8(x: __m256) -> __m256 {
        let c = super::EXP2_POLY;
        let xc = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(-87.0)),
            _mm256_set1_ps(88.0),
        );
        let t = _mm256_mul_ps(xc, _mm256_set1_ps(std::f32::consts::LOG2_E));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
        let f = _mm256_sub_ps(t, n);
        let mut p = _mm256_set1_ps(c[5]);
        for &ck in c[..5].iter().rev() {
            p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(ck));
        }
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0));
        let two_n = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        let e = _mm256_mul_ps(_mm256_castsi256_ps(two_n), p);
        _mm256_and_ps(e, _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(-87.0)))
    }

    /// [`exp8`] on 16 lanes (AVX-512F): the same operations, lane for lane.
    #[inline(always)]
    pub unsafe fn exp16(x: __m512) -> __m512 {
        let c = super::EXP2_POLY;
        let xc = _mm512_min_ps(
            _mm512_max_ps(x, _mm512_set1_ps(-87.0)),
            _mm512_set1_ps(88.0),
        );
        let t = _mm512_mul_ps(xc, _mm512_set1_ps(std::f32::consts::LOG2_E));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
        let f = _mm512_sub_ps(t, n);
        let mut p = _mm512_set1_ps(c[5]);
        for &ck in c[..5].iter().rev() {
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(ck));
        }
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0));
        let two_n = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvtps_epi32(n),
            _mm512_set1_epi32(127),
        ));
        let e = _mm512_mul_ps(_mm512_castsi512_ps(two_n), p);
        let kept = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(-87.0));
        _mm512_maskz_mov_ps(kept, e)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn softmax_in_place(x: &mut [f32], sink: Option<f32>) {
        super::softmax_body(x, sink)
    }

    /// [`super::gated`]'s loop, vectorized by the compiler for AVX2/FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gated(gate: &[f32], up: &[f32], out: &mut [f32], act: impl Fn(f32) -> f32) {
        super::gated_body(gate, up, out, act)
    }

    /// Up to four query rows per pass over `k`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_many(
        q: &[f32],
        q_stride: usize,
        n: usize,
        k: &[f32],
        scale: f32,
        out: &mut [f32],
        out_stride: usize,
    ) {
        let d = k.len();
        let (qp, kp) = (q.as_ptr(), k.as_ptr());
        let mut r = 0;
        while r < n {
            let m = (n - r).min(4);
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut c = 0;
            while c + 8 <= d {
                let kv = _mm256_loadu_ps(kp.add(c));
                for (b, a) in acc.iter_mut().enumerate().take(m) {
                    *a = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add((r + b) * q_stride + c)), kv, *a);
                }
                c += 8;
            }
            for (b, a) in acc.iter().enumerate().take(m) {
                let mut s = hsum(*a);
                for i in c..d {
                    s += q[(r + b) * q_stride + i] * k[i];
                }
                out[(r + b) * out_stride] = s * scale;
            }
            r += m;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy_many(w: &[f32], w_stride: usize, n: usize, v: &[f32], out: &mut [f32]) {
        let d = v.len();
        for r in 0..n {
            let wr = w[r * w_stride];
            if wr != 0.0 {
                axpy_f32(wr, v, &mut out[r * d..(r + 1) * d]);
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f16_to_f32(src: &[f16], out: &mut [f32]) {
        let n = src.len().min(out.len());
        let sp = src.as_ptr() as *const u16;
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(
                out.as_mut_ptr().add(i),
                _mm256_cvtph_ps(_mm_loadu_si128(sp.add(i) as *const __m128i)),
            );
            i += 8;
        }
        while i < n {
            out[i] = src[i].to_f32();
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_agree_with_scalar_maths() {
        let a: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..37).map(|i| (i as f32 * 0.11).cos()).collect();
        let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot_f32(&a, &b) - want).abs() < 1e-4);
        let mut y = vec![1.0f32; 37];
        axpy_f32(2.0, &b, &mut y);
        for (o, x) in y.iter().zip(&b) {
            assert!((o - (1.0 + 2.0 * x)).abs() < 1e-6);
        }
        let bh: Vec<f16> = b.iter().map(|&x| f16::from_f32(x)).collect();
        let mut out = vec![0.0; 37];
        f16_to_f32(&bh, &mut out);
        assert!(out.iter().zip(&bh).all(|(o, x)| *o == x.to_f32()));
        let bb: Vec<bf16> = b.iter().map(|&x| bf16::from_f32(x)).collect();
        bf16_to_f32(&bb, &mut out);
        assert!(out.iter().zip(&bb).all(|(o, x)| *o == x.to_f32()));
    }

    #[test]
    fn quantize_matches_the_kit_reference_byte_for_byte() {
        use kvplug_backend_kit::quant::quantize_row as reference;
        let mut rows: Vec<Vec<f32>> = (0..6)
            .map(|r| {
                (0..128)
                    .map(|i| {
                        ((i * 7 + r * 13) as f32 * 0.37).sin()
                            * [1.0, 3.0, 1e-3, 60000.0, 0.5, 1e-6][r]
                    })
                    .collect()
            })
            .collect();
        // A constant group (scale 0), groups of -0 alone and of -0 and +0, ties on code boundaries (values
        // k·0.5 with scale a power of two), a group far from zero (lo's f16 rounding exceeds
        // a step), a NaN.
        rows.push([vec![2.5f32; 32], vec![-0.0; 32], [-0.0, 0.0].repeat(32)].concat());
        // Every 16 values: 0, the maximum, then exact ties (c + ½)·scale for a power-of-two
        // scale: 1/64 at 8 bits (max 255/64), 1/16 at 4 bits (max 15/16).
        for (max, step) in [(255.0 / 64.0, 1.0 / 64.0), (15.0 / 16.0, 1.0 / 16.0)] {
            rows.push(
                (0..128)
                    .map(|i| match i % 16 {
                        0 => 0.0,
                        1 => max,
                        k => ((k * 7 + i / 16) % 15) as f32 * step + step / 2.0,
                    })
                    .collect(),
            );
        }
        rows.push((0..128).map(|i| 1000.0 + (i % 7) as f32 * 0.01).collect());
        let mut nan: Vec<f32> = (0..128).map(|i| i as f32).collect();
        nan[5] = f32::NAN;
        rows.push(nan);
        for row in &rows {
            for (bits, group) in [(8, 64), (8, 16), (4, 32), (4, 128)] {
                let ng = 128 / group;
                let cb = 128 * bits as usize / 8;
                let (mut c, mut s, mut l) = (vec![0u8; cb], vec![0u16; ng], vec![0u16; ng]);
                let (mut rc, mut rs, mut rl) = (vec![0u8; cb], vec![0u16; ng], vec![0u16; ng]);
                quantize_row(row, bits, group, &mut c, &mut s, &mut l);
                reference(row, bits, group, &mut rc, &mut rs, &mut rl);
                assert_eq!(
                    (c, s, l),
                    (rc, rs, rl),
                    "q{bits} g{group} row {:?}",
                    &row[..4]
                );
            }
        }
    }

    #[test]
    fn dequantize_matches_the_kit_reference() {
        use kvplug_backend_kit::quant::{dequantize_row as reference, quantize_row};
        let row: Vec<f32> = (0..128).map(|i| (i as f32 * 0.21).sin() * 3.0).collect();
        for (bits, group) in [(8, 64), (8, 4), (4, 32), (4, 8)] {
            let ng = 128 / group;
            let mut codes = vec![0u8; 128 * bits as usize / 8];
            let (mut sc, mut lo) = (vec![0u16; ng], vec![0u16; ng]);
            quantize_row(&row, bits, group, &mut codes, &mut sc, &mut lo);
            let (mut a, mut b) = (vec![0.0; 128], vec![0.0; 128]);
            dequantize_row(&codes, &sc, &lo, bits, group, &mut a);
            reference(&codes, &sc, &lo, bits, group, &mut b);
            for (x, y) in a.iter().zip(&b) {
                assert!(
                    (x - y).abs() <= 1e-6 * y.abs().max(1.0),
                    "bits {bits} group {group}: {x} vs {y}"
                );
            }
        }
    }

    #[test]
    fn softmax_is_stable() {
        let mut x = [1000.0, 1000.0, f32::NEG_INFINITY];
        softmax_in_place(&mut x, None);
        assert_eq!(x, [0.5, 0.5, 0.0]);
        // A sink equal to the scores takes a third of the weight.
        let mut x = [3.0, 3.0];
        softmax_in_place(&mut x, Some(3.0));
        assert_eq!(x, [1.0 / 3.0; 2]);
        let mut none = [f32::NEG_INFINITY; 3];
        softmax_in_place(&mut none, Some(1.0));
        assert_eq!(none, [0.0; 3]);
    }

    #[test]
    fn gated_activations_match_f64_within_fast_exps_error() {
        // Gates over [-100, 100) (odd lengths reach the vector loops' remainders), up rows
        // of both signs. fast_exp is within 1e-5 relative on [-80, 88] (kvplug_core::exp's test);
        // with the few f32 roundings after it, both gates stay within 2e-5 relative (GELU
        // is g / (1 + e^-2y), the same form as SiLU's). Past e^88 the exponential is
        // clamped: the values are then below |g·u|/e^88 in size.
        let n = 2001;
        let gate: Vec<f32> = (0..n).map(|i| (i as f32 - 1000.0) / 10.0).collect();
        let up: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.37).sin() * 3.0).collect();
        let mut out = vec![0.0; n];
        silu_mul(&gate, &up, &mut out);
        for ((&g, &u), &o) in gate.iter().zip(&up).zip(&out) {
            let (g64, u64) = (g as f64, u as f64);
            let want = g64 / (1.0 + (-g64).exp()) * u64;
            let tol = 2e-5 * want.abs() + (g64 * u64).abs() * 1e-38;
            assert!(
                (o as f64 - want).abs() <= tol,
                "silu({g})·{u} = {o}, want {want}"
            );
        }
        gelu_tanh_mul(&gate, &up, &mut out);
        for ((&g, &u), &o) in gate.iter().zip(&up).zip(&out) {
            let (g64, u64) = (g as f64, u as f64);
            // 0.5·g·(1 + tanh y), written without the cancellation f64 has too.
            let y = (2.0 / std::f64::consts::PI).sqrt() * (g64 + 0.044715 * g64.powi(3));
            let want = g64 / (1.0 + (-2.0 * y).exp()) * u64;
            let tol = 2e-5 * want.abs() + (g64 * u64).abs() * 1e-38;
            assert!(
                (o as f64 - want).abs() <= tol,
                "gelu({g})·{u} = {o}, want {want}"
            );
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp8_and_exp16_match_fast_exp_and_each_other() {
        use std::arch::x86_64::*;
        if !vector_path() {
            return;
        }
        // The same polynomial, evaluated with fused multiply-adds: within 2 ulp of the
        // scalar path, and 0 where it is 0; both widths bit for bit alike.
        let xs: Vec<f32> = (-900..=880)
            .map(|i| i as f32 / 10.0)
            .chain([f32::NEG_INFINITY, -100.0, 0.0, 1e-3, -1e-3, 88.0, -87.0])
            .collect();
        for chunk in xs.chunks(16) {
            let mut lanes = [0.0f32; 16];
            lanes[..chunk.len()].copy_from_slice(chunk);
            let mut got = [0.0f32; 16];
            // SAFETY: the features were detected above.
            unsafe {
                for h in 0..2 {
                    let v = x86::exp8(_mm256_loadu_ps(lanes.as_ptr().add(8 * h)));
                    _mm256_storeu_ps(got.as_mut_ptr().add(8 * h), v);
                }
            }
            for (&x, &g) in lanes.iter().zip(&got) {
                let want = fast_exp(x);
                let ulps = (g.to_bits() as i64 - want.to_bits() as i64).abs();
                assert!(ulps <= 2, "exp8({x}) = {g}, fast_exp = {want}");
            }
            if wide_path() {
                let mut wide = [0.0f32; 16];
                // SAFETY: the features were detected above.
                unsafe { wide16(&lanes, &mut wide) };
                assert_eq!(wide.map(f32::to_bits), got.map(f32::to_bits), "{lanes:?}");
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn wide16(x: &[f32; 16], out: &mut [f32; 16]) {
        use std::arch::x86_64::*;
        _mm512_storeu_ps(out.as_mut_ptr(), x86::exp16(_mm512_loadu_ps(x.as_ptr())));
    }
}
