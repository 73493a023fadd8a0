//! Scores in the [`Arithmetic::Int8Query`](kvplug_core::Arithmetic) arithmetic on AVX-512
//! VNNI: each query row quantized once per call to int8 per 32-value block, then `dpbusd`
//! of the stored key codes (unsigned) with the query codes (signed), 64 values a register,
//! and per key group `scale·Σ s·(q·c) + lo·Σ s·Σq` accumulated in f32. The keys are never
//! widened to f32.
//!
//! A register holds two query blocks: lanes 0–7 the first, 8–15 the second, which is why the
//! block scales and code sums are stored as 16-lane vectors per 64 values. q4 keys unpack a
//! block's 16 bytes as its 16 low nibbles then its 16 high nibbles (values 0, 2, …, 30, then
//! 1, 3, …, 31), so their query codes are stored in that order.

use std::arch::x86_64::*;

use kvplug_core::arithmetic::QUERY_BLOCK;

use super::{Avx512, Block, QuantRows, RowView};

/// Values per register of codes (two query blocks).
const CHUNK: usize = 2 * QUERY_BLOCK;

/// A call's query rows in int8, laid out for [`scores`].
#[derive(Default)]
pub struct QueryCodes {
    /// `[rows, d]` codes, each block in the key codes' order.
    codes: Vec<i8>,
    /// `[rows, d / 64, 16]`: lane `l` of register `c` holds the scale of block `2c + l / 8`.
    scales: Vec<f32>,
    /// Same layout: `scale · Σ codes` of the lane's block, divided by 8 (its 8 lanes sum to
    /// it).
    sums: Vec<f32>,
    d: usize,
}

impl QueryCodes {
    /// Quantizes `q` (`[rows, d]`, `d` a multiple of 64): per block of 32 values
    /// `s = max|q| / 127`, codes `round(q / s)` half away from zero clamped to ±127 (`s = 0`:
    /// codes 0). With `nibble_order` each block's codes are stored evens first.
    pub fn quantize(&mut self, q: &[f32], d: usize, nibble_order: bool) {
        debug_assert!(d.is_multiple_of(CHUNK) && q.len().is_multiple_of(d));
        let blocks = q.len() / QUERY_BLOCK;
        self.d = d;
        self.codes.resize(q.len(), 0);
        self.scales.resize(blocks * 8, 0.0);
        self.sums.resize(blocks * 8, 0.0);
        for (b, x) in q.chunks_exact(QUERY_BLOCK).enumerate() {
            let s = x.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            let codes = &mut self.codes[b * QUERY_BLOCK..(b + 1) * QUERY_BLOCK];
            let mut sum = 0i32;
            for (i, &v) in x.iter().enumerate() {
                let code = if s == 0.0 {
                    0
                } else {
                    (v / s).round().clamp(-127.0, 127.0) as i8
                };
                let at = if nibble_order {
                    (i % 2) * (QUERY_BLOCK / 2) + i / 2
                } else {
                    i
                };
                codes[at] = code;
                sum += code as i32;
            }
            // Blocks are consecutive, so block b fills lanes 8(b % 2).. of register b / 2.
            let lanes = b * 8..(b + 1) * 8;
            self.scales[lanes.clone()].fill(s);
            self.sums[lanes].fill(s * sum as f32 / 8.0);
        }
    }
}

/// The codes of values `[64c, 64c + 64)` of row `j`, one unsigned byte each, in the order
/// [`QueryCodes`] stores the query's.
#[inline(always)]
unsafe fn key_codes(k: &QuantRows, j: usize, c: usize) -> __m512i {
    let at = j * k.d + c * CHUNK;
    if k.bits == 8 {
        return _mm512_loadu_si512(k.codes.add(at) as *const _);
    }
    // 32 bytes: chunks [bytes 0–15, bytes 0–15, bytes 16–31, bytes 16–31], the second of
    // each pair shifted to its high nibbles.
    let x = _mm512_castsi256_si512(_mm256_loadu_si256(k.codes.add(at / 2) as *const _));
    let x = _mm512_shuffle_i64x2::<0b01_01_00_00>(x, x);
    let x = _mm512_srlv_epi64(x, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4));
    _mm512_and_si512(x, _mm512_set1_epi8(0xf))
}

/// The key group scale and offset vectors of register `c` of row `j` (lanes 0–7 the first
/// block's group, 8–15 the second's).
#[inline(always)]
unsafe fn key_groups(k: &QuantRows, j: usize, c: usize) -> (__m512, __m512) {
    let (a, b) = (k.group(j, c * CHUNK), k.group(j, c * CHUNK + QUERY_BLOCK));
    let pair = |x: f32, y: f32| _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(x), _mm512_set1_ps(y));
    (pair(*a, *b), pair(*a.add(1), *b.add(1)))
}

/// [`Block::scores`] for quantized keys in [`Arithmetic::Int8Query`](kvplug_core::Arithmetic):
/// the scores of the block's `M` query rows (rows `b0..` of `qc`) against rows
/// `[j0, j0 + nb)` into `p`, 2 key rows per pass; prefetches the same rows of `ahead`.
///
/// # Safety
/// AVX-512F/BW/VNNI and the AVX2 set are present; `k` holds the rows, its groups a multiple
/// of 32 values, staged for the tile; `qc` holds the block's rows quantized for `k`'s bits.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub unsafe fn scores<const M: usize, V: RowView>(
    blk: &Block<'_>,
    qc: &QueryCodes,
    k: &QuantRows,
    ahead: Option<V>,
    p: &mut [f32],
) {
    let Block { b0, d, .. } = *blk;
    debug_assert_eq!(qc.d, d);
    let nc = d / CHUNK;
    blk.score_pairs::<Avx512, M, V>(ahead, p, |r0, r1, acc| {
        for c in 0..nc {
            let (k0, k1) = (key_codes(k, r0, c), key_codes(k, r1, c));
            let ((s0, lo0), (s1, lo1)) = (key_groups(k, r0, c), key_groups(k, r1, c));
            for b in 0..M {
                let row = b0 + b;
                let q = _mm512_loadu_si512(qc.codes.as_ptr().add(row * d + c * CHUNK) as *const _);
                let at = (row * nc + c) * 16;
                let (qs, qsum) = (
                    _mm512_loadu_ps(qc.scales.as_ptr().add(at)),
                    _mm512_loadu_ps(qc.sums.as_ptr().add(at)),
                );
                let z = _mm512_setzero_si512();
                let (i0, i1) = (_mm512_dpbusd_epi32(z, k0, q), _mm512_dpbusd_epi32(z, k1, q));
                let (x, y) = (b, M + b);
                let a = &mut acc[x / 8][x % 8];
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(qs, s0), *a);
                *a = _mm512_fmadd_ps(qsum, lo0, *a);
                let a = &mut acc[y / 8][y % 8];
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(qs, s1), *a);
                *a = _mm512_fmadd_ps(qsum, lo1, *a);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Codes by the definition, in f64: ties away from zero, the clamp, a zero block.
    #[test]
    fn query_codes_round_half_away_from_zero_per_block() {
        let d = 64;
        // Block 0: max 127 (s = 1), exact ties ±2.5, ±0.5; block 1: all zero.
        let mut q = vec![0f32; d];
        q[..6].copy_from_slice(&[127.0, 2.5, -2.5, 0.5, -0.5, 1.49]);
        let mut qc = QueryCodes::default();
        qc.quantize(&q, d, false);
        assert_eq!(&qc.codes[..6], &[127, 3, -3, 1, -1, 1]);
        assert!(qc.codes[32..].iter().all(|&c| c == 0));
        assert_eq!(qc.scales[0], 1.0);
        assert_eq!(qc.scales[8], 0.0);
        // Σ codes of block 0 is 128: s·128/8 in each of its lanes.
        assert_eq!(qc.sums[..8], [16.0; 8]);
        // Random rows against the definition, rounded in f64.
        let q: Vec<f32> = (0..4 * d)
            .map(|i| ((i * 7919) as f32 * 0.37).sin() * if i % 13 == 0 { 9.0 } else { 1.0 })
            .collect();
        qc.quantize(&q, d, false);
        for (b, x) in q.chunks(32).enumerate() {
            let s = x.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            for (i, &v) in x.iter().enumerate() {
                let want = ((v / s) as f64).round().clamp(-127.0, 127.0) as i8;
                assert_eq!(qc.codes[b * 32 + i], want, "block {b} value {i}");
            }
        }
        // Nibble order: evens, then odds.
        let mut n = QueryCodes::default();
        n.quantize(&q, d, true);
        for i in 0..32 {
            assert_eq!(n.codes[(i % 2) * 16 + i / 2], qc.codes[i]);
        }
    }
}
