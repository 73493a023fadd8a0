//! Scores in the [`Arithmetic::Int8Query`](kvplug_core::Arithmetic) arithmetic on AVX-512
//! VNNI: each query row quantized once per call to int8 per 32-value block; each tile's key
//! codes transposed once ([`KeyTile`]) so that a register holds 4 codes of 16 key rows;
//! then, per 16 key rows, `dpbusd` of those registers with the query's broadcast 4-code
//! words gives 16 integer block dots at once, scaled per block by `scale_k·s` and summed
//! with the offsets' `lo·Σ s·q` in f32. The keys are never widened to f32 and no horizontal
//! sums are taken; the transposition is shared by every query row of the tile.
//!
//! q4 keys pack values `2i, 2i + 1` in the low and high nibble of one byte, so a 4-byte word
//! gives the 4 even values (low nibbles) of 8 and the 4 odd ones (high nibbles): within each
//! block the query codes are stored evens first to match.

use std::arch::x86_64::*;

use kvplug_core::arithmetic::QUERY_BLOCK;

use super::{Block, QuantRows, TILE};

/// Codes per 4-byte word.
const WORD: usize = 4;

/// Key rows per register.
const LANES: usize = 16;

/// A call's query rows in int8, laid out for [`scores`].
#[derive(Default)]
pub struct QueryCodes {
    /// `[rows, d]` codes, each block in the key codes' order.
    codes: Vec<i8>,
    /// `[rows, d / 32]`: each block's scale.
    scales: Vec<f32>,
    /// `[rows, d / group]`: `Σ scale · Σ codes` over the blocks of each key group.
    group_sums: Vec<f32>,
    d: usize,
    /// Values per key group.
    group: usize,
}

impl QueryCodes {
    /// Quantizes `q` (`[rows, d]`, `d` a multiple of 64) for keys in groups of `group`
    /// values (a multiple of 32 dividing `d`): per block of 32 values `s = max|q| / 127`,
    /// codes `round(q / s)` half away from zero clamped to ±127 (`s = 0`, or a NaN
    /// quotient: code 0). With `nibble_order` each block's codes are stored evens first.
    ///
    /// # Safety
    /// AVX-512F is present.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn quantize(&mut self, q: &[f32], d: usize, group: usize, nibble_order: bool) {
        debug_assert!(d.is_multiple_of(2 * QUERY_BLOCK) && q.len().is_multiple_of(d));
        debug_assert!(group.is_multiple_of(QUERY_BLOCK) && d.is_multiple_of(group));
        let blocks = q.len() / QUERY_BLOCK;
        (self.d, self.group) = (d, group);
        self.codes.resize(q.len(), 0);
        self.scales.resize(blocks, 0.0);
        self.group_sums.clear();
        self.group_sums.resize(q.len() / group, 0.0);
        let abs = |v: __m512| {
            _mm512_castsi512_ps(_mm512_and_si512(
                _mm512_castps_si512(v),
                _mm512_set1_epi32(0x7fff_ffff),
            ))
        };
        let (evens, odds) = (
            _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
            _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31),
        );
        for b in 0..blocks {
            let x = q.as_ptr().add(b * QUERY_BLOCK);
            let (x0, x1) = (_mm512_loadu_ps(x), _mm512_loadu_ps(x.add(16)));
            let s = _mm512_reduce_max_ps(_mm512_max_ps(abs(x0), abs(x1))) / 127.0;
            let (x0, x1) = if nibble_order {
                (
                    _mm512_permutex2var_ps(x0, evens, x1),
                    _mm512_permutex2var_ps(x0, odds, x1),
                )
            } else {
                (x0, x1)
            };
            let code = |x: __m512| {
                if s == 0.0 {
                    return _mm512_setzero_si512();
                }
                // Half away from zero: the truncation, plus the sign where the exact
                // remainder is at least a half.
                let y = _mm512_div_ps(x, _mm512_set1_ps(s));
                let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
                let half =
                    _mm512_cmp_ps_mask::<_CMP_GE_OQ>(abs(_mm512_sub_ps(y, t)), _mm512_set1_ps(0.5));
                let sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(i32::MIN));
                let one = _mm512_castsi512_ps(_mm512_or_si512(
                    sign,
                    _mm512_castps_si512(_mm512_set1_ps(1.0)),
                ));
                let r = _mm512_mask_add_ps(t, half, t, one);
                let r = _mm512_min_ps(
                    _mm512_max_ps(r, _mm512_set1_ps(-127.0)),
                    _mm512_set1_ps(127.0),
                );
                _mm512_maskz_cvtps_epi32(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(y, y), r)
            };
            let (c0, c1) = (code(x0), code(x1));
            let at = self.codes.as_mut_ptr().add(b * QUERY_BLOCK) as *mut __m128i;
            _mm_storeu_si128(at, _mm512_cvtepi32_epi8(c0));
            _mm_storeu_si128(at.add(1), _mm512_cvtepi32_epi8(c1));
            let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
            self.scales[b] = s;
            self.group_sums[b * QUERY_BLOCK / group] += s * sum as f32;
        }
    }
}

/// One tile's key rows for [`scores`], staged by [`KeyTile::stage`].
#[derive(Default)]
pub struct KeyTile {
    /// `[n / 16, d / 4]` registers: lane `i` of register `w` of group `r` is the codes
    /// of word `w` of key row `16r + i`, one unsigned byte each, in the query codes' order
    /// (rows past the tile repeat its last).
    codes: Vec<__m512i>,
    /// `[ng, rows]`: each row's group scales, then (`los`) offsets, in f32; `rows` is the
    /// tile's rows rounded up to 16.
    scales: Vec<f32>,
    los: Vec<f32>,
    rows: usize,
    group: usize,
}

/// Transposes 16 registers of 16 words: word `w` of register `i` moves to word `i` of
/// register `w`.
#[inline(always)]
unsafe fn transpose16(r: &mut [__m512i; 16]) {
    // Words 4L + c of rows 4a..4a + 4 gather in lane L of u[4a + c].
    let mut u = [_mm512_setzero_si512(); 16];
    for a in 0..4 {
        let [r0, r1, r2, r3] = [r[4 * a], r[4 * a + 1], r[4 * a + 2], r[4 * a + 3]];
        let (t0, t1) = (_mm512_unpacklo_epi32(r0, r1), _mm512_unpackhi_epi32(r0, r1));
        let (t2, t3) = (_mm512_unpacklo_epi32(r2, r3), _mm512_unpackhi_epi32(r2, r3));
        u[4 * a] = _mm512_unpacklo_epi64(t0, t2);
        u[4 * a + 1] = _mm512_unpackhi_epi64(t0, t2);
        u[4 * a + 2] = _mm512_unpacklo_epi64(t1, t3);
        u[4 * a + 3] = _mm512_unpackhi_epi64(t1, t3);
    }
    // Then lane L of the four row quarters into word 4L + c.
    for c in 0..4 {
        let (a, b, e, f) = (u[c], u[4 + c], u[8 + c], u[12 + c]);
        let v0 = _mm512_shuffle_i32x4::<0b10_00_10_00>(a, b);
        let v1 = _mm512_shuffle_i32x4::<0b11_01_11_01>(a, b);
        let v2 = _mm512_shuffle_i32x4::<0b10_00_10_00>(e, f);
        let v3 = _mm512_shuffle_i32x4::<0b11_01_11_01>(e, f);
        r[c] = _mm512_shuffle_i32x4::<0b10_00_10_00>(v0, v2);
        r[c + 8] = _mm512_shuffle_i32x4::<0b11_01_11_01>(v0, v2);
        r[c + 4] = _mm512_shuffle_i32x4::<0b10_00_10_00>(v1, v3);
        r[c + 12] = _mm512_shuffle_i32x4::<0b11_01_11_01>(v1, v3);
    }
}

impl KeyTile {
    /// Stages rows `[j0, j0 + n)` of `k` (staged for the tile by [`RowView::for_tile`]).
    /// Per 16 rows it asks for the same rows of `v` and for `k`'s rows a tile further (up
    /// to `kend`), a hint per cache line: spread over the staging, these measured 1.4–2×
    /// faster decode from memory than none or the whole tile's at once (q8, 8–30 layers
    /// streamed at L = 4096, `examples/decode_attention`).
    ///
    /// # Safety
    /// AVX-512F/BW are present; `k` holds the rows and `kend`, `v` the tile's rows; `k.d`
    /// is a multiple of 64 and its groups of 32.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub unsafe fn stage(&mut self, k: &QuantRows, v: &QuantRows, j0: usize, n: usize, kend: usize) {
        let d = k.d;
        let words = d / WORD;
        let groups = n.div_ceil(LANES);
        let rows = groups * LANES;
        // Packed 4-byte words per row.
        let packed = d * k.bits / 8 / WORD;
        self.codes.resize(groups * words, _mm512_setzero_si512());
        self.rows = rows;
        self.group = k.group;
        self.scales.resize(k.ng * rows, 0.0);
        self.los.resize(k.ng * rows, 0.0);
        let row_bytes = d * k.bits / 8;
        let mask = _mm512_set1_epi8(0xf);
        for r in 0..groups {
            let first = j0 + r * LANES;
            let here = LANES.min(j0 + n - first);
            v.prefetch_rows(first, here);
            if first + TILE < kend {
                k.prefetch_rows(first + TILE, here.min(kend - first - TILE));
            }
            // Rows past the tile repeat its last.
            let row = |i: usize| (first + i).min(j0 + n - 1);
            // Each row's (scale, offset) pairs as `for_tile` widened them, gathered by group.
            let pairs = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            let pairs = _mm512_min_epi32(
                _mm512_add_epi32(pairs, _mm512_set1_epi32((first - j0) as i32)),
                _mm512_set1_epi32((n - 1) as i32),
            );
            let pairs = _mm512_mullo_epi32(pairs, _mm512_set1_epi32(2 * k.ng as i32));
            for g in 0..k.ng {
                let at = _mm512_add_epi32(pairs, _mm512_set1_epi32(2 * g as i32));
                let staged = k.staged;
                _mm512_storeu_ps(
                    self.scales.as_mut_ptr().add(g * rows + r * LANES),
                    _mm512_i32gather_ps::<4>(at, staged),
                );
                _mm512_storeu_ps(
                    self.los.as_mut_ptr().add(g * rows + r * LANES),
                    _mm512_i32gather_ps::<4>(at, staged.add(1)),
                );
            }
            let mut rows_at = [k.codes; LANES];
            for (i, at) in rows_at.iter_mut().enumerate() {
                *at = k.codes.add(row(i) * row_bytes);
            }
            let out = self.codes.as_mut_ptr().add(r * words);
            for w0 in (0..packed).step_by(LANES) {
                let left = (packed - w0).min(LANES);
                let m: __mmask16 = if left == LANES { !0 } else { (1 << left) - 1 };
                // Loops, not closures: outlined, a closure loses the target features.
                let mut x = [_mm512_setzero_si512(); LANES];
                for (x, at) in x.iter_mut().zip(&rows_at) {
                    *x = _mm512_maskz_loadu_epi32(m, at.add(w0 * WORD) as *const i32);
                }
                transpose16(&mut x);
                for (w, &x) in x.iter().enumerate().take(left) {
                    let w = w0 + w;
                    if k.bits == 8 {
                        out.add(w).write(x);
                    } else {
                        // Packed word s of block b: its low nibbles are query word 8b + s,
                        // its high nibbles word 8b + 4 + s.
                        let (b, s) = (w / 4, w % 4);
                        out.add(8 * b + s).write(_mm512_and_si512(x, mask));
                        out.add(8 * b + 4 + s)
                            .write(_mm512_and_si512(_mm512_srli_epi32::<4>(x), mask));
                    }
                }
            }
        }
    }
}

/// [`Block::scores`] for quantized keys in [`Arithmetic::Int8Query`](kvplug_core::Arithmetic):
/// the scores of the block's `M` query rows (rows `b0..` of `qc`) against rows
/// `[j0, j0 + nb)` of the staged tile `kt` into `p`, 16 key rows at a time (lanes past `nb`
/// are written too, up to a multiple of 16).
///
/// # Safety
/// AVX-512F/BW/VNNI and the AVX2 set are present; `kt` holds the tile staged from keys
/// in groups of a multiple of 32 values; `qc` holds the block's rows quantized for them.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub unsafe fn scores<const M: usize>(
    blk: &Block<'_>,
    qc: &QueryCodes,
    kt: &KeyTile,
    p: &mut [f32],
) {
    let Block {
        b0, nb, d, scale, ..
    } = *blk;
    debug_assert!(qc.d == d && qc.group == kt.group);
    const PER_BLOCK: usize = QUERY_BLOCK / WORD;
    let (words, blocks, rows) = (d / WORD, d / QUERY_BLOCK, kt.rows);
    let (per_group, ng) = (kt.group / QUERY_BLOCK, d / kt.group);
    // Blocks whose dots run side by side: 2·M chains where the registers allow.
    let side = if M <= 4 { 2 } else { 1 };
    let qw: [*const i32; M] =
        std::array::from_fn(|b| qc.codes.as_ptr().add((b0 + b) * d) as *const i32);
    let qs: [*const f32; M] = std::array::from_fn(|b| qc.scales.as_ptr().add((b0 + b) * blocks));
    let qsum: [*const f32; M] = std::array::from_fn(|b| qc.group_sums.as_ptr().add((b0 + b) * ng));
    let scale = _mm512_set1_ps(scale);
    for r in 0..nb.div_ceil(LANES) {
        let codes = kt.codes.as_ptr().add(r * words);
        let (ks, lo) = (
            kt.scales.as_ptr().add(r * LANES),
            kt.los.as_ptr().add(r * LANES),
        );
        let mut f = [_mm512_setzero_ps(); M];
        for g in 0..ng {
            let lo = _mm512_loadu_ps(lo.add(g * rows));
            for (f, qsum) in f.iter_mut().zip(&qsum) {
                *f = _mm512_fmadd_ps(lo, _mm512_set1_ps(*qsum.add(g)), *f);
            }
        }
        let mut first = 0;
        while first < blocks {
            let mut acc = [[_mm512_setzero_si512(); 2]; M];
            for s in 0..PER_BLOCK {
                for h in 0..side {
                    let w = (first + h) * PER_BLOCK + s;
                    let x = *codes.add(w);
                    for (a, qw) in acc.iter_mut().zip(&qw) {
                        let q = _mm512_set1_epi32(*qw.add(w));
                        a[h] = _mm512_dpbusd_epi32(a[h], x, q);
                    }
                }
            }
            for h in 0..side {
                let blk = first + h;
                let ks = _mm512_loadu_ps(ks.add(blk / per_group * rows));
                for ((f, a), qs) in f.iter_mut().zip(&acc).zip(&qs) {
                    let w = _mm512_mul_ps(ks, _mm512_set1_ps(*qs.add(blk)));
                    *f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[h]), w, *f);
                }
            }
            first += side;
        }
        for (b, &f) in f.iter().enumerate() {
            let at = p.as_mut_ptr().add((b0 + b) * TILE + r * LANES);
            _mm512_storeu_ps(at, _mm512_mul_ps(f, scale));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::RowView;
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
        unsafe { qc.quantize(&q, d, group, bits == 4) };
        let k = QuantRows::new(&packed, &sk16, &lo16, bits, group, d).unwrap();
        let mut staged = Vec::new();
        let scale = 0.125;
        let mut p = vec![f32::NAN; M * TILE];
        // SAFETY: the features are checked by the caller; k holds nb rows staged for them.
        unsafe {
            let k = k.for_tile(0, nb, &mut staged);
            let mut kt = KeyTile::default();
            kt.stage(&k, &k, 0, nb, nb);
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
                int8: Some((&qc, &kt)),
                kend: nb,
            };
            scores::<M>(&blk, &qc, &kt, &mut p);
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
        if !crate::simd::wide_path() {
            eprintln!("skipped: this CPU has no AVX-512, the quantizer's only target");
            return;
        }
        let d = 64;
        // Block 0: max 127 (s = 1), exact ties ±2.5, ±0.5; block 1: all zero.
        let mut q = vec![0f32; d];
        q[..6].copy_from_slice(&[127.0, 2.5, -2.5, 0.5, -0.5, 1.49]);
        let mut qc = QueryCodes::default();
        unsafe { qc.quantize(&q, d, 32, false) };
        assert_eq!(&qc.codes[..6], &[127, 3, -3, 1, -1, 1]);
        assert!(qc.codes[32..].iter().all(|&c| c == 0));
        assert_eq!(qc.scales[..2], [1.0, 0.0]);
        // Σ codes of block 0 is 128.
        assert_eq!(qc.group_sums[..2], [128.0, 0.0]);
        // Random rows against the definition, rounded in f64.
        let q: Vec<f32> = (0..4 * d)
            .map(|i| ((i * 7919) as f32 * 0.37).sin() * if i % 13 == 0 { 9.0 } else { 1.0 })
            .collect();
        unsafe { qc.quantize(&q, d, 64, false) };
        for (b, x) in q.chunks(32).enumerate() {
            let s = x.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            for (i, &v) in x.iter().enumerate() {
                let want = ((v / s) as f64).round().clamp(-127.0, 127.0) as i8;
                assert_eq!(qc.codes[b * 32 + i], want, "block {b} value {i}");
            }
        }
        // Nibble order: evens, then odds.
        let mut n = QueryCodes::default();
        unsafe { n.quantize(&q, d, 64, true) };
        for i in 0..32 {
            assert_eq!(n.codes[(i % 2) * 16 + i / 2], qc.codes[i]);
        }
    }
}
