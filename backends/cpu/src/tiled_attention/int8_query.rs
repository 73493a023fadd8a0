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
/// `[j0, j0 + nb)` into `p`, 2 key rows per pass; prefetches as [`Block::score_pairs`] does.
///
/// # Safety
/// AVX-512F/BW/VNNI and the AVX2 set are present; `k` holds the rows, its groups a multiple
/// of 32 values, staged for the tile; `qc` holds the block's rows quantized for `k`'s bits.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub unsafe fn scores<const M: usize, V: RowView>(
    blk: &Block<'_>,
    qc: &QueryCodes,
    k: &QuantRows,
    ahead: Option<(QuantRows, V)>,
    p: &mut [f32],
) {
    let Block { b0, d, .. } = *blk;
    debug_assert_eq!(qc.d, d);
    let nc = d / CHUNK;
    blk.score_pairs::<Avx512, M, QuantRows, V>(ahead, p, |r0, r1, acc| {
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
    use crate::tiled_attention::{Visibility, TILE};
    use kvplug_backend_kit::AttendMask;
    use kvplug_core::oracle::gamma;

    /// A deterministic generator of values in `[0, 1)`.
    fn stream(seed: u64) -> impl FnMut() -> f32 {
        let mut s = seed;
        move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32
        }
    }

    /// [`scores`] against the same arithmetic in f64, from the definition (query codes
    /// recomputed here, key codes unpacked by hand): within the f32 rounding of the block
    /// arithmetic, `γ(D + 2)·scale·Σ |code|·s·(scale_k·c + |lo|)`, per score. Query blocks
    /// of very different magnitudes and key groups of different scales and offsets, so a
    /// lane given the wrong block's or group's factor is far outside it.
    fn check<const M: usize>(bits: u32, group: usize, d: usize, nb: usize, seed: u64) {
        let mut next = stream(seed);
        let levels = (1u32 << bits) - 1;
        let codes: Vec<u8> = (0..nb * d)
            .map(|_| (next() * (levels + 1) as f32) as u8)
            .collect();
        let packed: Vec<u8> = match bits {
            8 => codes.clone(),
            _ => codes.chunks(2).map(|p| p[0] | (p[1] << 4)).collect(),
        };
        let ng = d / group;
        let f16 = |x: f32| half::f16::from_f32(x);
        let (sk, lo): (Vec<half::f16>, Vec<half::f16>) = (0..nb * ng)
            .map(|i| {
                (
                    f16(0.001 + next() * 0.1 * (1 + i % 3) as f32),
                    f16(next() * 4.0 - 3.0),
                )
            })
            .unzip();
        let bits16 = |v: &[half::f16]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
        let (sk16, lo16) = (bits16(&sk), bits16(&lo));
        let q: Vec<f32> = (0..M * d)
            .map(|i| (next() * 2.0 - 1.0) * [1.0, 30.0, 0.01, 3.0][(i / QUERY_BLOCK) % 4])
            .collect();
        let mut qc = QueryCodes::default();
        qc.quantize(&q, d, bits == 4);
        let k = QuantRows::new(&packed, &sk16, &lo16, bits, group, d).unwrap();
        let mut staged = Vec::new();
        let scale = 0.125;
        let mut p = vec![f32::NAN; M * TILE];
        // SAFETY: the features are checked by the caller; k holds nb rows staged for them.
        unsafe {
            let k = k.for_tile(0, nb, &mut staged);
            let blk = Block {
                b0: 0,
                j0: 0,
                nb,
                d,
                scale,
                first: 0,
                vis: Visibility {
                    mask: AttendMask::None,
                    t: 1,
                    l: nb,
                },
                query: Some(&qc),
                kend: nb,
            };
            scores::<M, QuantRows>(&blk, &qc, &k, None, &mut p);
        }
        for r in 0..M {
            for j in 0..nb {
                let (mut exact, mut abs) = (0f64, 0f64);
                for (b, x) in q[r * d..(r + 1) * d].chunks(QUERY_BLOCK).enumerate() {
                    let s = x.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                    for (i, &v) in x.iter().enumerate() {
                        let code = match s {
                            0.0 => 0.0,
                            s => (v / s).round().clamp(-127.0, 127.0) as f64,
                        };
                        let e = b * QUERY_BLOCK + i;
                        let g = j * ng + e / group;
                        let (kc, ks, kl) =
                            (codes[j * d + e] as f64, sk[g].to_f64(), lo[g].to_f64());
                        exact += code * s as f64 * (ks * kc + kl);
                        abs += (code * s as f64).abs() * (ks * kc + kl.abs());
                    }
                }
                let (got, want) = (p[r * TILE + j] as f64, exact * scale as f64);
                let bound = gamma(d + 2) * scale as f64 * abs;
                assert!(
                    (got - want).abs() <= bound,
                    "q{bits} g{group} d{d} M{M}: row {r} key {j}: {got} vs {want} (bound {bound:e})"
                );
            }
        }
    }

    #[test]
    fn scores_are_the_declared_arithmetic_lane_for_lane() {
        if !(crate::simd::wide_path() && crate::simd::vnni_path()) {
            eprintln!("skipped: this CPU has no AVX-512 VNNI, the kernel's only target");
            return;
        }
        for (bits, group) in [(8, 64), (8, 32), (4, 32), (4, 64)] {
            for (d, nb) in [(64, 37), (128, 64), (256, 5)] {
                let seed = (bits * 1000 + group as u32 + d as u32) as u64;
                check::<1>(bits, group, d, nb, seed);
                check::<4>(bits, group, d, nb, seed + 1);
                check::<7>(bits, group, d, nb, seed + 2);
                check::<8>(bits, group, d, nb, seed + 3);
            }
        }
    }

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
