//! The decode-step attention kernel (one query token, AVX2 + FMA + F16C): one KV head and
//! its `g` query heads over rows `[0, l)`, in tiles of [`TILE`] rows with an online softmax
//! (flash-decoding style), so the scratch is `g × TILE` scores whatever `l` is.
//!
//! Rows are read in their storage dtype and widened in registers, 8 values at a time
//! ([`Row8`]: f32, f16, bf16, and q8/q4 with the affine dequantization fused in), never
//! staged as f32 rows. Per tile: scores of 2 rows × up to 4 queries per pass over `D`
//! (8 accumulators), then `out += p · V` with the tile's rows swept once per 16-wide slice
//! of `D` into 8 register accumulators, so `out` is loaded and stored once per tile instead
//! of once per row.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use crate::simd::fast_exp;

/// Rows per tile: 64 f16 rows of 128 values (16 KiB) stay in L1 while the tile is swept.
pub const TILE: usize = 64;

/// 8 consecutive values of a row, widened to f32.
pub trait Row8: Copy {
    /// Values `[c, c + 8)` of row `j`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are present, `c + 8 <= D` and `j` is a row of the pool.
    unsafe fn load8(&self, j: usize, c: usize) -> __m256;
}

/// Rows of `d` values in dtype `T` at `p`.
#[derive(Clone, Copy)]
pub struct Plain<T> {
    /// First row.
    pub p: *const T,
    /// Values per row.
    pub d: usize,
}

impl Row8 for Plain<f32> {
    #[inline(always)]
    unsafe fn load8(&self, j: usize, c: usize) -> __m256 {
        _mm256_loadu_ps(self.p.add(j * self.d + c))
    }
}

impl Row8 for Plain<u16> {
    /// f16 bits.
    #[inline(always)]
    unsafe fn load8(&self, j: usize, c: usize) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(self.p.add(j * self.d + c) as *const __m128i))
    }
}

/// bf16 bits (the high half of an f32).
#[derive(Clone, Copy)]
pub struct Bf16Rows(pub Plain<u16>);

impl Row8 for Bf16Rows {
    #[inline(always)]
    unsafe fn load8(&self, j: usize, c: usize) -> __m256 {
        let h = _mm_loadu_si128(self.0.p.add(j * self.0.d + c) as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    }
}

/// Affine-quantized rows (see `crate::pool::Storage::Quant`): `bits` 8 or 4, groups a
/// multiple of 8 values, so one f16 scale and offset cover each 8-value load.
#[derive(Clone, Copy)]
pub struct QuantRows {
    codes: *const u8,
    scales: *const u16,
    los: *const u16,
    bits: usize,
    d: usize,
    /// Groups per row.
    ng: usize,
    /// The group of each 8-value chunk of a row (no division on the hot path).
    chunk_group: [u16; MAX_CHUNKS],
}

/// Chunks of 8 values per row [`QuantRows`] supports (head_dim up to 512).
const MAX_CHUNKS: usize = 64;

impl QuantRows {
    /// A view of quantized rows; `None` when a group is not a multiple of 8 values or `d`
    /// exceeds 512.
    pub fn new(
        codes: &[u8],
        scales: &[u16],
        los: &[u16],
        bits: u32,
        group: usize,
        d: usize,
    ) -> Option<Self> {
        if group % 8 != 0 || d / 8 > MAX_CHUNKS {
            return None;
        }
        let mut chunk_group = [0u16; MAX_CHUNKS];
        for (i, g) in chunk_group.iter_mut().enumerate().take(d / 8) {
            *g = (i * 8 / group) as u16;
        }
        Some(QuantRows {
            codes: codes.as_ptr(),
            scales: scales.as_ptr(),
            los: los.as_ptr(),
            bits: bits as usize,
            d,
            ng: d / group,
            chunk_group,
        })
    }
}

impl Row8 for QuantRows {
    #[inline(always)]
    unsafe fn load8(&self, j: usize, c: usize) -> __m256 {
        let codes = if self.bits == 8 {
            let at = self.codes.add(j * self.d + c);
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(at as *const __m128i))
        } else {
            // 4 bytes, two values each, low nibble first.
            let at = self.codes.add((j * self.d + c) / 2);
            let four = _mm_cvtsi32_si128((at as *const i32).read_unaligned());
            let pairs = _mm_shuffle_epi8(
                four,
                _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1),
            );
            let wide = _mm256_cvtepu8_epi32(pairs);
            let shifted = _mm256_srlv_epi32(wide, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
            _mm256_and_si256(shifted, _mm256_set1_epi32(0xf))
        };
        let g = j * self.ng + *self.chunk_group.get_unchecked(c / 8) as usize;
        // Scale and offset as a pair of f16s, widened together.
        let pair = _mm_insert_epi16::<1>(
            _mm_cvtsi32_si128(*self.scales.add(g) as i32),
            *self.los.add(g) as i32,
        );
        let sl = _mm_cvtph_ps(pair);
        _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(codes),
            _mm256_broadcastss_ps(sl),
            _mm256_broadcastss_ps(_mm_movehdup_ps(sl)),
        )
    }
}

/// Tile scores and running softmax state, reused across steps.
#[derive(Default)]
pub struct DecodeScratch {
    /// `[g, TILE]` scores, then weights.
    p: Vec<f32>,
    /// Running max and sum per query.
    max: Vec<f32>,
    sum: Vec<f32>,
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
}

/// `out = softmax(q·Kᵀ·scale)·V` for one KV head: `q` and `out` are `[g, d]`, rows `[0, l)`
/// of `k` and `v`, `mask[j]` false for a row the query must not see (none: every row).
///
/// # Safety
/// AVX2, FMA and F16C are present, `d % 16 == 0`, and `k` and `v` hold `l` rows of `d`.
#[target_feature(enable = "avx2,fma,f16c")]
// Register blocks are indexed by query and row, as the accumulators are laid out.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
pub unsafe fn attend<K: Row8, V: Row8>(
    q: &[f32],
    k: K,
    v: V,
    g: usize,
    d: usize,
    l: usize,
    mask: Option<&[bool]>,
    scale: f32,
    out: &mut [f32],
    s: &mut DecodeScratch,
) {
    debug_assert!(d % 16 == 0 && q.len() >= g * d && out.len() >= g * d);
    s.p.resize(g * TILE, 0.0);
    s.max.clear();
    s.max.resize(g, f32::NEG_INFINITY);
    s.sum.clear();
    s.sum.resize(g, 0.0);
    out[..g * d].fill(0.0);
    let qp = q.as_ptr();
    for j0 in (0..l).step_by(TILE) {
        let n = TILE.min(l - j0);
        // Scores: rows in pairs, queries in fours.
        let mut j = 0;
        while j < n {
            let two = j + 1 < n;
            for b0 in (0..g).step_by(4) {
                let m = (g - b0).min(4);
                let mut acc = [[_mm256_setzero_ps(); 4]; 2];
                for c in (0..d).step_by(8) {
                    let k0 = k.load8(j0 + j, c);
                    let k1 = if two { k.load8(j0 + j + 1, c) } else { k0 };
                    for b in 0..m {
                        let qv = _mm256_loadu_ps(qp.add((b0 + b) * d + c));
                        acc[0][b] = _mm256_fmadd_ps(qv, k0, acc[0][b]);
                        acc[1][b] = _mm256_fmadd_ps(qv, k1, acc[1][b]);
                    }
                }
                for b in 0..m {
                    s.p[(b0 + b) * TILE + j] = hsum(acc[0][b]) * scale;
                    if two {
                        s.p[(b0 + b) * TILE + j + 1] = hsum(acc[1][b]) * scale;
                    }
                }
            }
            j += 2;
        }
        // Online softmax: rescale what the earlier tiles accumulated.
        let mut any = false;
        for b in 0..g {
            let p = &mut s.p[b * TILE..b * TILE + n];
            if let Some(m) = mask {
                for (x, &seen) in p.iter_mut().zip(&m[j0..j0 + n]) {
                    if !seen {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
            let tile_max = p.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let new_max = s.max[b].max(tile_max);
            if new_max == f32::NEG_INFINITY {
                p.fill(0.0);
                continue;
            }
            any = true;
            let alpha = fast_exp(s.max[b] - new_max);
            let mut tile_sum = 0.0;
            for x in p.iter_mut() {
                *x = fast_exp(*x - new_max);
                tile_sum += *x;
            }
            s.sum[b] = s.sum[b] * alpha + tile_sum;
            s.max[b] = new_max;
            if alpha != 1.0 {
                let o = _mm256_set1_ps(alpha);
                for c in (0..d).step_by(8) {
                    let at = out.as_mut_ptr().add(b * d + c);
                    _mm256_storeu_ps(at, _mm256_mul_ps(_mm256_loadu_ps(at), o));
                }
            }
        }
        if !any {
            continue;
        }
        // out += p · V: 16 values of D at a time, every row of the tile, 4 queries.
        for c in (0..d).step_by(16) {
            for b0 in (0..g).step_by(4) {
                let m = (g - b0).min(4);
                let mut acc = [[_mm256_setzero_ps(); 2]; 4];
                for jj in 0..n {
                    let v0 = v.load8(j0 + jj, c);
                    let v1 = v.load8(j0 + jj, c + 8);
                    for b in 0..m {
                        let w = _mm256_set1_ps(s.p[(b0 + b) * TILE + jj]);
                        acc[b][0] = _mm256_fmadd_ps(w, v0, acc[b][0]);
                        acc[b][1] = _mm256_fmadd_ps(w, v1, acc[b][1]);
                    }
                }
                for b in 0..m {
                    let at = out.as_mut_ptr().add((b0 + b) * d + c);
                    _mm256_storeu_ps(at, _mm256_add_ps(_mm256_loadu_ps(at), acc[b][0]));
                    let at = at.add(8);
                    _mm256_storeu_ps(at, _mm256_add_ps(_mm256_loadu_ps(at), acc[b][1]));
                }
            }
        }
    }
    for b in 0..g {
        let o = &mut out[b * d..(b + 1) * d];
        match s.sum[b] {
            0.0 => o.fill(0.0),
            sum => o.iter_mut().for_each(|x| *x /= sum),
        }
    }
}
