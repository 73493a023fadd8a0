//! Row kernels: dot products and `y += w·x` over f32, f16 and bf16 rows, with AVX2/FMA/F16C
//! paths chosen at run time and portable fallbacks.

use half::{bf16, f16};

/// CPU features the kernels use, detected once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Features {
    /// AVX2 + FMA + F16C (the vector path).
    pub avx2_fma_f16c: bool,
    /// AVX-512F (reported; the AVX2 path is used).
    pub avx512f: bool,
}

impl Default for Features {
    fn default() -> Self {
        features()
    }
}

/// Detects the features.
pub fn features() -> Features {
    #[cfg(target_arch = "x86_64")]
    {
        Features {
            avx2_fma_f16c: is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c"),
            avx512f: is_x86_feature_detected!("avx512f"),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Features {
            avx2_fma_f16c: false,
            avx512f: false,
        }
    }
}

#[inline]
fn vector_path() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
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

/// `Σ a[i]·b[i]`.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if vector_path() {
        // SAFETY: the features were detected above.
        return unsafe { x86::dot_f32(a, b) };
    }
    dot_lanes(a, b)
}

/// `y += w·x`.
pub fn axpy_f32(w: f32, x: &[f32], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if vector_path() {
        // SAFETY: the features were detected above.
        return unsafe { x86::axpy_f32(w, x, y) };
    }
    for (o, v) in y.iter_mut().zip(x) {
        *o += w * v;
    }
}

/// `Σ q[i]·k[i]` with `k` in f16.
pub fn dot_f16(q: &[f32], k: &[f16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if vector_path() {
        // SAFETY: the features were detected above.
        return unsafe { x86::dot_f16(q, k) };
    }
    q.iter().zip(k).map(|(a, b)| a * b.to_f32()).sum()
}

/// `y += w·x` with `x` in f16.
pub fn axpy_f16(w: f32, x: &[f16], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if vector_path() {
        // SAFETY: the features were detected above.
        return unsafe { x86::axpy_f16(w, x, y) };
    }
    for (o, v) in y.iter_mut().zip(x) {
        *o += w * v.to_f32();
    }
}

/// `Σ q[i]·k[i]` with `k` in bf16.
pub fn dot_bf16(q: &[f32], k: &[bf16]) -> f32 {
    let mut acc = [0f32; 8];
    let (qc, kc) = (q.chunks_exact(8), k.chunks_exact(8));
    let tail: f32 = qc
        .remainder()
        .iter()
        .zip(kc.remainder())
        .map(|(a, b)| a * b.to_f32())
        .sum();
    for (a, b) in qc.zip(kc) {
        for l in 0..8 {
            acc[l] += a[l] * f32::from_bits((b[l].to_bits() as u32) << 16);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `y += w·x` with `x` in bf16.
pub fn axpy_bf16(w: f32, x: &[bf16], y: &mut [f32]) {
    for (o, v) in y.iter_mut().zip(x) {
        *o += w * f32::from_bits((v.to_bits() as u32) << 16);
    }
}

/// `Σ q[i]·c[i]` over 8-bit codes.
pub fn dot_codes8(q: &[f32], c: &[u8]) -> f32 {
    let mut acc = [0f32; 8];
    let (qc, cc) = (q.chunks_exact(8), c.chunks_exact(8));
    let tail: f32 = qc
        .remainder()
        .iter()
        .zip(cc.remainder())
        .map(|(a, &b)| a * b as f32)
        .sum();
    for (a, b) in qc.zip(cc) {
        for l in 0..8 {
            acc[l] += a[l] * b[l] as f32;
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `Σ q[i]·c[i]` over 4-bit codes packed two per byte (low nibble first).
pub fn dot_codes4(q: &[f32], c: &[u8]) -> f32 {
    let mut acc = [0f32; 8];
    for (a, b) in q.chunks_exact(8).zip(c.chunks_exact(4)) {
        for l in 0..4 {
            acc[2 * l] += a[2 * l] * (b[l] & 0xf) as f32;
            acc[2 * l + 1] += a[2 * l + 1] * (b[l] >> 4) as f32;
        }
    }
    acc.iter().sum()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::f16;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
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

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f16(q: &[f32], k: &[f16]) -> f32 {
        let n = q.len().min(k.len());
        let kp = k.as_ptr() as *const u16;
        let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i + 16 <= n {
            let k0 = _mm256_cvtph_ps(_mm_loadu_si128(kp.add(i) as *const __m128i));
            let k1 = _mm256_cvtph_ps(_mm_loadu_si128(kp.add(i + 8) as *const __m128i));
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(i)), k0, acc0);
            acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(i + 8)), k1, acc1);
            i += 16;
        }
        let mut s = hsum(_mm256_add_ps(acc0, acc1));
        while i < n {
            s += q[i] * k[i].to_f32();
            i += 1;
        }
        s
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_f16(w: f32, x: &[f16], y: &mut [f32]) {
        let n = x.len().min(y.len());
        let xp = x.as_ptr() as *const u16;
        let wv = _mm256_set1_ps(w);
        let mut i = 0;
        while i + 8 <= n {
            let xv = _mm256_cvtph_ps(_mm_loadu_si128(xp.add(i) as *const __m128i));
            let o = _mm256_fmadd_ps(wv, xv, _mm256_loadu_ps(y.as_ptr().add(i)));
            _mm256_storeu_ps(y.as_mut_ptr().add(i), o);
            i += 8;
        }
        while i < n {
            y[i] += w * x[i].to_f32();
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
        let bh: Vec<f16> = b.iter().map(|&x| f16::from_f32(x)).collect();
        let want_h: f32 = a.iter().zip(&bh).map(|(x, y)| x * y.to_f32()).sum();
        assert!((dot_f16(&a, &bh) - want_h).abs() < 1e-4);
        let bb: Vec<bf16> = b.iter().map(|&x| bf16::from_f32(x)).collect();
        let want_b: f32 = a.iter().zip(&bb).map(|(x, y)| x * y.to_f32()).sum();
        assert!((dot_bf16(&a, &bb) - want_b).abs() < 1e-4);
        let mut y = vec![1.0f32; 37];
        axpy_f16(2.0, &bh, &mut y);
        for (o, x) in y.iter().zip(&bh) {
            assert!((o - (1.0 + 2.0 * x.to_f32())).abs() < 1e-6);
        }
        let codes: Vec<u8> = (0..32).map(|i| (i * 7 % 256) as u8).collect();
        let want8: f32 = a[..32].iter().zip(&codes).map(|(x, &c)| x * c as f32).sum();
        assert!((dot_codes8(&a[..32], &codes) - want8).abs() < 1e-3);
        let packed: Vec<u8> = codes
            .chunks(2)
            .map(|p| (p[0] & 0xf) | ((p[1] & 0xf) << 4))
            .collect();
        let want4: f32 = a[..32]
            .iter()
            .zip(&codes)
            .map(|(x, &c)| x * (c & 0xf) as f32)
            .sum();
        assert!((dot_codes4(&a[..32], &packed) - want4).abs() < 1e-3);
    }
}
