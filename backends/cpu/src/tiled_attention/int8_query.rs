//! Scores in the [`Arithmetic::Int8Query`](kvplug_core::Arithmetic) arithmetic, on AVX-512
//! VNNI or on AVX2: each query row quantized once per call to int8 per 32-value block; each
//! tile's key codes transposed once ([`KeyTile`]) so that a register holds 4 codes of 16
//! key rows (8 on AVX2); then, per register of key rows, `dpbusd` (AVX2: `maddubs` and
//! `madd`) of those registers with the query's broadcast 4-code words gives 16 (8) integer
//! block dots at once, scaled per block by `scale_k·s` and summed with the offsets'
//! `lo·Σ s·q` in f32. Both widths give the same f32 scores, bit for bit. The keys are never widened to f32 and no horizontal
//! sums are taken; the transposition is shared by every query row of the tile.
//!
//! q4 keys pack values `2i, 2i + 1` in the low and high nibble of one byte, so a 4-byte word
//! gives the 4 even values (low nibbles) of 8 and the 4 odd ones (high nibbles): within each
//! block the query codes are stored evens first to match.

use std::arch::x86_64::*;

use kvplug_core::arithmetic::QUERY_BLOCK;

use super::{Block, QuantRows, TILE};
use crate::simd::Dot256;

/// Codes per 4-byte word.
const WORD: usize = 4;
/// Words per query block.
const PER_BLOCK: usize = QUERY_BLOCK / WORD;

/// A call's query rows in int8, laid out for the scores kernels.
#[derive(Default)]
pub struct QueryCodes {
    /// `[rows, d]` codes, each block in the key codes' order.
    codes: Vec<i8>,
    /// `[rows, d / 32]`: each block's scale.
    scales: Vec<f32>,
    /// `[rows, d / 32]`: each block's `Σ codes`.
    sums: Vec<i32>,
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
    /// quotient: code 0; a NaN value makes `s` NaN). With `nibble_order` each block's codes
    /// are stored evens first.
    ///
    /// # Safety
    /// AVX2 and FMA are present.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn quantize(&mut self, q: &[f32], d: usize, group: usize, nibble_order: bool) {
        debug_assert!(d.is_multiple_of(2 * QUERY_BLOCK) && q.len().is_multiple_of(d));
        debug_assert!(group.is_multiple_of(QUERY_BLOCK) && d.is_multiple_of(group));
        let blocks = q.len() / QUERY_BLOCK;
        (self.d, self.group) = (d, group);
        self.codes.resize(q.len(), 0);
        self.scales.resize(blocks, 0.0);
        self.sums.resize(blocks, 0);
        self.group_sums.clear();
        self.group_sums.resize(q.len() / group, 0.0);
        let blocks = q.chunks_exact(QUERY_BLOCK);
        let codes = self.codes.chunks_exact_mut(QUERY_BLOCK);
        for (b, (x, codes)) in blocks.zip(codes).enumerate() {
            let (s, block) = quantize_block(x.try_into().expect("blocks of 32"));
            let mut sum = 0;
            for (i, &c) in block.iter().enumerate() {
                let at = match nibble_order {
                    true => i % 2 * (QUERY_BLOCK / 2) + i / 2,
                    false => i,
                };
                codes[at] = c as i8;
                sum += c;
            }
            self.scales[b] = s;
            self.sums[b] = sum;
            self.group_sums[b * QUERY_BLOCK / group] += s * sum as f32;
        }
    }
}

/// One block's scale and codes (see [`QueryCodes::quantize`]), 8 values a register: the
/// quotient `q / s` is IEEE's as in scalar code, rounded half away from zero as
/// `f32::round` does (its truncation, one more away from zero where the exact remainder
/// is at least a half).
///
/// # Safety
/// AVX2 is present.
#[inline(always)]
unsafe fn quantize_block(x: &[f32; QUERY_BLOCK]) -> (f32, [i32; QUERY_BLOCK]) {
    const REGS: usize = QUERY_BLOCK / 8;
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX));
    let v: [__m256; REGS] = std::array::from_fn(|i| _mm256_loadu_ps(x.as_ptr().add(8 * i)));
    let (mut max, mut nan) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for &v in &v {
        max = _mm256_max_ps(max, _mm256_and_ps(v, abs));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
    }
    let mut codes = [0i32; QUERY_BLOCK];
    // A NaN value makes `s` NaN (every code 0), so the scores are NaN, as in f32.
    if _mm256_movemask_ps(nan) != 0 {
        return (f32::NAN, codes);
    }
    let s = {
        let m = _mm_max_ps(_mm256_castps256_ps128(max), _mm256_extractf128_ps::<1>(max));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)))
    } / 127.0;
    if s == 0.0 {
        return (s, codes);
    }
    let (sv, half, one) = (_mm256_set1_ps(s), _mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    for (i, &v) in v.iter().enumerate() {
        let y = _mm256_div_ps(v, sv);
        // A NaN quotient (an infinite value over an infinite `s`) is code 0.
        let y = _mm256_and_ps(y, _mm256_cmp_ps::<_CMP_ORD_Q>(y, y));
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
        let away = _mm256_cmp_ps::<_CMP_GE_OQ>(_mm256_and_ps(_mm256_sub_ps(y, t), abs), half);
        let step = _mm256_and_ps(away, _mm256_or_ps(one, _mm256_andnot_ps(abs, y)));
        let r = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(t, step), lo), hi);
        _mm256_storeu_si256(
            codes.as_mut_ptr().add(8 * i) as *mut __m256i,
            _mm256_cvttps_epi32(r),
        );
    }
    (s, codes)
}

/// One tile's key rows for the scores kernels, staged at one width by
/// [`KeyTile::stage_avx512`] or [`KeyTile::stage_avx2`] (`lanes` rows a register).
#[derive(Default)]
pub struct KeyTile {
    /// `[rows / lanes, d / 4]` registers: 4-byte word `i` of register `w` of group `r`
    /// holds the codes of word `w` of key row `lanes·r + i`, in the query codes' order (rows
    /// past the tile repeat its last): unsigned bytes, but for q8 at 256 bits with
    /// [`Dot256::Maddubs`] `code − 128` (see [`scores_avx2`]).
    codes: Vec<Line>,
    /// `[ng, rows]`: each row's group scales, then (`los`) offsets, in f32; `rows` is the
    /// tile's rows rounded up to `lanes`.
    scales: Vec<f32>,
    los: Vec<f32>,
    rows: usize,
    group: usize,
    /// Bits per key code (8 or 4).
    bits: usize,
    /// How [`KeyTile::stage_avx2`] stages and [`scores_avx2`] multiplies (set before
    /// staging; the 512-bit kernels ignore it).
    pub dot: Dot256,
}

/// 64 bytes aligned as a 512-bit register (and so as two 256-bit ones), zeroed without
/// AVX-512.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct Line([u64; 8]);

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

/// Transposes 8 registers of 8 words: word `w` of register `i` moves to word `i` of
/// register `w`.
#[inline(always)]
unsafe fn transpose8(r: &mut [__m256i; 8]) {
    // Per 128-bit half: words c and 4 + c of rows 4a..4a + 4 gather in u[4a + c].
    let mut u = [_mm256_setzero_si256(); 8];
    for a in 0..2 {
        let [r0, r1, r2, r3] = [r[4 * a], r[4 * a + 1], r[4 * a + 2], r[4 * a + 3]];
        let (t0, t1) = (_mm256_unpacklo_epi32(r0, r1), _mm256_unpackhi_epi32(r0, r1));
        let (t2, t3) = (_mm256_unpacklo_epi32(r2, r3), _mm256_unpackhi_epi32(r2, r3));
        u[4 * a] = _mm256_unpacklo_epi64(t0, t2);
        u[4 * a + 1] = _mm256_unpackhi_epi64(t0, t2);
        u[4 * a + 2] = _mm256_unpacklo_epi64(t1, t3);
        u[4 * a + 3] = _mm256_unpackhi_epi64(t1, t3);
    }
    for c in 0..4 {
        r[c] = _mm256_permute2x128_si256::<0x20>(u[c], u[4 + c]);
        r[c + 4] = _mm256_permute2x128_si256::<0x31>(u[c], u[4 + c]);
    }
}

/// Where the codes of the `LANES` key rows from `first` start, rows past the tile `tile`
/// repeating its last; with `ask`, asks for the same rows of `v` and for `k`'s rows a tile
/// further (up to `kend`), a hint per cache line: spread over the staging, these measured
/// 1.4–2× faster decode from memory than none or the whole tile's at once (q8, 8–30 layers
/// streamed at L = 4096, `examples/decode_attention`).
///
/// # Safety
/// `k` holds the rows to `kend`, `v` the tile's rows.
#[inline(always)]
unsafe fn row_group<const LANES: usize>(
    k: &QuantRows,
    v: &QuantRows,
    first: usize,
    tile: std::ops::Range<usize>,
    kend: usize,
    ask: bool,
) -> [*const u8; LANES] {
    let here = LANES.min(tile.end - first);
    if ask {
        v.prefetch_rows(first, here);
        if first + TILE < kend {
            k.prefetch_rows(first + TILE, here.min(kend - first - TILE));
        }
    }
    let row_bytes = k.d * k.bits / 8;
    let mut rows_at = [k.codes; LANES];
    for (i, at) in rows_at.iter_mut().enumerate() {
        *at = k.codes.add((first + i).min(tile.end - 1) * row_bytes);
    }
    rows_at
}

impl KeyTile {
    /// Sizes the tile for `n` rows of `k` at `lanes` rows a register and stages each row's
    /// group scales and offsets; returns the registers per row group.
    ///
    /// # Safety
    /// `k` was staged for a tile of `n` rows by [`super::RowView::for_tile`].
    unsafe fn start(&mut self, k: &QuantRows, n: usize, lanes: usize) -> usize {
        let words = k.d / WORD;
        let rows = n.next_multiple_of(lanes);
        self.codes
            .resize((rows * words * WORD).div_ceil(64), Line::default());
        (self.rows, self.group, self.bits) = (rows, k.group, k.bits);
        self.scales.resize(k.ng * rows, 0.0);
        self.los.resize(k.ng * rows, 0.0);
        for g in 0..k.ng {
            for i in 0..rows {
                // The (scale, offset) pairs `for_tile` widened, `ng` a row.
                let pair = k.staged.add((i.min(n - 1) * k.ng + g) * 2);
                (self.scales[g * rows + i], self.los[g * rows + i]) = (*pair, *pair.add(1));
            }
        }
        words
    }

    /// Stages rows `[j0, j0 + n)` of `k` (staged for the tile by [`super::RowView::for_tile`]) 16
    /// rows a register, asking for rows of `v` and `k` as [`row_group`] says with `ask`.
    ///
    /// # Safety
    /// AVX-512F/BW are present; `k` holds the rows and `kend`, `v` the tile's rows; `k.d`
    /// is a multiple of 64 and its groups of 32.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub unsafe fn stage_avx512(
        &mut self,
        k: &QuantRows,
        v: &QuantRows,
        j0: usize,
        n: usize,
        kend: usize,
        ask: bool,
    ) {
        const LANES: usize = 16;
        let words = self.start(k, n, LANES);
        // Packed 4-byte words per row.
        let packed = k.d * k.bits / 8 / WORD;
        let mask = _mm512_set1_epi8(0xf);
        let codes = self.codes.as_mut_ptr() as *mut __m512i;
        for r in 0..self.rows / LANES {
            let rows_at = row_group::<LANES>(k, v, j0 + r * LANES, j0..j0 + n, kend, ask);
            let out = codes.add(r * words);
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

    /// [`KeyTile::stage_avx512`] 8 rows a register, q8 codes for [`Dot256::Maddubs`] stored
    /// as `code − 128` (signed).
    ///
    /// # Safety
    /// AVX2 is present; the rest as [`KeyTile::stage_avx512`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn stage_avx2(
        &mut self,
        k: &QuantRows,
        v: &QuantRows,
        j0: usize,
        n: usize,
        kend: usize,
        ask: bool,
    ) {
        const LANES: usize = 8;
        let words = self.start(k, n, LANES);
        // Packed 4-byte words per row: a multiple of 8, as `d` is of 64.
        let packed = k.d * k.bits / 8 / WORD;
        let mask = _mm256_set1_epi8(0xf);
        let flip = match self.dot {
            Dot256::Maddubs => _mm256_set1_epi8(i8::MIN),
            Dot256::Vex | Dot256::Evex => _mm256_setzero_si256(),
        };
        let codes = self.codes.as_mut_ptr() as *mut __m256i;
        for r in 0..self.rows / LANES {
            let rows_at = row_group::<LANES>(k, v, j0 + r * LANES, j0..j0 + n, kend, ask);
            let out = codes.add(r * words);
            for w0 in (0..packed).step_by(LANES) {
                let mut x = [_mm256_setzero_si256(); LANES];
                for (x, at) in x.iter_mut().zip(&rows_at) {
                    *x = _mm256_loadu_si256(at.add(w0 * WORD) as *const __m256i);
                }
                transpose8(&mut x);
                for (w, &x) in x.iter().enumerate() {
                    let w = w0 + w;
                    if k.bits == 8 {
                        out.add(w).write(_mm256_xor_si256(x, flip));
                    } else {
                        let (b, s) = (w / 4, w % 4);
                        out.add(8 * b + s).write(_mm256_and_si256(x, mask));
                        out.add(8 * b + 4 + s)
                            .write(_mm256_and_si256(_mm256_srli_epi32::<4>(x), mask));
                    }
                }
            }
        }
    }
}

/// Pointers to the block's `M` query rows' codes, block scales, block sums and group sums.
struct QueryRows<const M: usize> {
    words: [*const i32; M],
    scales: [*const f32; M],
    sums: [*const i32; M],
    group_sums: [*const f32; M],
}

impl<const M: usize> QueryRows<M> {
    /// Rows `b0..b0 + M` of `qc`.
    ///
    /// # Safety
    /// `qc` holds those rows.
    unsafe fn new(qc: &QueryCodes, b0: usize) -> Self {
        let (d, blocks, ng) = (qc.d, qc.d / QUERY_BLOCK, qc.d / qc.group);
        QueryRows {
            words: std::array::from_fn(|b| qc.codes.as_ptr().add((b0 + b) * d) as *const i32),
            scales: std::array::from_fn(|b| qc.scales.as_ptr().add((b0 + b) * blocks)),
            sums: std::array::from_fn(|b| qc.sums.as_ptr().add((b0 + b) * blocks)),
            group_sums: std::array::from_fn(|b| qc.group_sums.as_ptr().add((b0 + b) * ng)),
        }
    }
}

/// [`Block::scores`] for quantized keys in [`Arithmetic::Int8Query`](kvplug_core::Arithmetic):
/// the scores of the block's `M` query rows (rows `b0..` of `qc`) against rows
/// `[j0, j0 + nb)` of the tile `kt` staged by [`KeyTile::stage_avx512`] into `p`, 16 key
/// rows at a time (lanes past `nb` are written too, up to a multiple of 16). Per 16 rows:
/// the offsets' terms in group order, then per block in order its integer dots times
/// `scale_k·s`, then the scale; [`scores_avx2`] does the same f32 operations in the same
/// order.
///
/// # Safety
/// AVX-512F/BW/VNNI and the AVX2 set are present; `kt` holds the tile staged from keys
/// in groups of a multiple of 32 values; `qc` holds the block's rows quantized for them.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub unsafe fn scores_avx512<const M: usize>(
    blk: &Block<'_>,
    qc: &QueryCodes,
    kt: &KeyTile,
    p: &mut [f32],
) {
    const LANES: usize = 16;
    let Block {
        b0, nb, d, scale, ..
    } = *blk;
    debug_assert!(qc.d == d && qc.group == kt.group);
    let (words, blocks, rows) = (d / WORD, d / QUERY_BLOCK, kt.rows);
    let (per_group, ng) = (kt.group / QUERY_BLOCK, d / kt.group);
    // Blocks whose dots run side by side: 2·M chains (at most 16 with 8 accumulated rows,
    // which the 32 registers hold).
    let side = 2;
    let q = QueryRows::<M>::new(qc, b0);
    let scale = _mm512_set1_ps(scale);
    let codes = kt.codes.as_ptr() as *const __m512i;
    for r in 0..nb.div_ceil(LANES) {
        let codes = codes.add(r * words);
        let (ks, lo) = (
            kt.scales.as_ptr().add(r * LANES),
            kt.los.as_ptr().add(r * LANES),
        );
        let mut f = [_mm512_setzero_ps(); M];
        for g in 0..ng {
            let lo = _mm512_loadu_ps(lo.add(g * rows));
            for (f, qsum) in f.iter_mut().zip(&q.group_sums) {
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
                    for (a, qw) in acc.iter_mut().zip(&q.words) {
                        let q = _mm512_set1_epi32(*qw.add(w));
                        a[h] = _mm512_dpbusd_epi32(a[h], x, q);
                    }
                }
            }
            for h in 0..side {
                let blk = first + h;
                let ks = _mm512_loadu_ps(ks.add(blk / per_group * rows));
                for ((f, a), qs) in f.iter_mut().zip(&acc).zip(&q.scales) {
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

/// [`scores_avx512`] on AVX2, 8 key rows at a time, for a tile staged by
/// [`KeyTile::stage_avx2`]; the same integer dots by other instructions, so the same f32
/// results. With [`Dot256::Maddubs`], `maddubs` (unsigned × signed bytes to i16 pair sums,
/// saturating) then `madd` with ones to i32: q4 codes (≤ 15) sum a block's 8 words in i16
/// (at most 16·15·127 < 2^15) before one `madd`; q8 codes (≤ 255) would saturate a pair, so
/// they are staged as `c − 128` and multiplied as `|c − 128|` against the query code under
/// their sign (pairs at most 2·128·127 < 2^15), `128·Σ q` (the block's query codes) added
/// back in i32. With 256-bit VNNI, one `dpbusd` a word, as at 512 bits.
///
/// The rows go 4 at a time (their accumulators fill the 16 registers).
///
/// # Safety
/// AVX2 is present, and the VNNI set `kt.dot` names; the rest as [`scores_avx512`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn scores_avx2<const M: usize>(
    blk: &Block<'_>,
    qc: &QueryCodes,
    kt: &KeyTile,
    p: &mut [f32],
) {
    match kt.dot {
        Dot256::Maddubs => scores_256::<M, Maddubs>(blk, qc, kt, p),
        Dot256::Vex => scores_vex::<M>(blk, qc, kt, p),
        Dot256::Evex => scores_evex::<M>(blk, qc, kt, p),
    }
}

/// [`scores_avx2`] with AVX-VNNI.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn scores_vex<const M: usize>(
    blk: &Block<'_>,
    qc: &QueryCodes,
    kt: &KeyTile,
    p: &mut [f32],
) {
    scores_256::<M, Vex>(blk, qc, kt, p)
}

/// [`scores_avx2`] with AVX-512 VNNI at 256 bits.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn scores_evex<const M: usize>(
    blk: &Block<'_>,
    qc: &QueryCodes,
    kt: &KeyTile,
    p: &mut [f32],
) {
    scores_256::<M, Evex>(blk, qc, kt, p)
}

/// [`scores_avx2`] with `D`'s integer dots, 4 rows at a time.
#[inline(always)]
unsafe fn scores_256<const M: usize, D: BlockDots>(
    blk: &Block<'_>,
    qc: &QueryCodes,
    kt: &KeyTile,
    p: &mut [f32],
) {
    if M <= 4 {
        return scores_avx2_rows::<M, D>(blk, qc, kt, p);
    }
    scores_avx2_rows::<4, D>(blk, qc, kt, p);
    let rest = Block {
        b0: blk.b0 + 4,
        ..*blk
    };
    match M - 4 {
        4 => scores_avx2_rows::<4, D>(&rest, qc, kt, p),
        3 => scores_avx2_rows::<3, D>(&rest, qc, kt, p),
        2 => scores_avx2_rows::<2, D>(&rest, qc, kt, p),
        _ => scores_avx2_rows::<1, D>(&rest, qc, kt, p),
    }
}

/// One query block's integer dots against a register of 8 key rows, by one of
/// [`Dot256`]'s instruction sets (its type: [`Maddubs`], [`Vex`], [`Evex`]).
trait BlockDots {
    /// Per row, the dots of query block `blk`'s words of `codes` (a [`KeyTile`] row group
    /// of `bits`-bit codes) with the row's, in i32 lanes.
    ///
    /// # Safety
    /// The instruction set is present; `codes` and `q` hold the block.
    unsafe fn dots<const M: usize>(
        codes: *const __m256i,
        q: &QueryRows<M>,
        bits: usize,
        blk: usize,
    ) -> [__m256i; M];
}

/// AVX2's `maddubs`/`madd` ([`Dot256::Maddubs`]).
struct Maddubs;
/// AVX-VNNI ([`Dot256::Vex`]).
struct Vex;
/// AVX-512 VNNI + VL at 256 bits ([`Dot256::Evex`]).
struct Evex;

impl BlockDots for Maddubs {
    #[inline(always)]
    unsafe fn dots<const M: usize>(
        codes: *const __m256i,
        q: &QueryRows<M>,
        bits: usize,
        blk: usize,
    ) -> [__m256i; M] {
        let words = blk * PER_BLOCK..(blk + 1) * PER_BLOCK;
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_si256(); M];
        if bits == 4 {
            for w in words {
                let x = *codes.add(w);
                for (a, qw) in acc.iter_mut().zip(&q.words) {
                    let pairs = _mm256_maddubs_epi16(x, _mm256_set1_epi32(*qw.add(w)));
                    *a = _mm256_add_epi16(*a, pairs);
                }
            }
            for a in acc.iter_mut() {
                *a = _mm256_madd_epi16(*a, ones);
            }
        } else {
            for (a, sums) in acc.iter_mut().zip(&q.sums) {
                *a = _mm256_set1_epi32(128 * *sums.add(blk));
            }
            for w in words {
                let x = *codes.add(w);
                let magnitude = _mm256_abs_epi8(x);
                for (a, qw) in acc.iter_mut().zip(&q.words) {
                    let signed = _mm256_sign_epi8(_mm256_set1_epi32(*qw.add(w)), x);
                    let pairs = _mm256_maddubs_epi16(magnitude, signed);
                    *a = _mm256_add_epi32(*a, _mm256_madd_epi16(pairs, ones));
                }
            }
        }
        acc
    }
}

/// [`BlockDots`] by `$dpbusd`: one per word and row, whatever the codes' width.
macro_rules! vnni_dots {
    ($name:ident, $dpbusd:ident) => {
        impl BlockDots for $name {
            #[inline(always)]
            unsafe fn dots<const M: usize>(
                codes: *const __m256i,
                q: &QueryRows<M>,
                _: usize,
                blk: usize,
            ) -> [__m256i; M] {
                let mut acc = [_mm256_setzero_si256(); M];
                for w in blk * PER_BLOCK..(blk + 1) * PER_BLOCK {
                    let x = *codes.add(w);
                    for (a, qw) in acc.iter_mut().zip(&q.words) {
                        *a = $dpbusd(*a, x, _mm256_set1_epi32(*qw.add(w)));
                    }
                }
                acc
            }
        }
    };
}

vnni_dots!(Vex, _mm256_dpbusd_avx_epi32);
vnni_dots!(Evex, _mm256_dpbusd_epi32);

/// [`scores_avx2`] for `M` rows at once.
#[inline(always)]
unsafe fn scores_avx2_rows<const M: usize, D: BlockDots>(
    blk: &Block<'_>,
    qc: &QueryCodes,
    kt: &KeyTile,
    p: &mut [f32],
) {
    const LANES: usize = 8;
    let Block {
        b0, nb, d, scale, ..
    } = *blk;
    debug_assert!(qc.d == d && qc.group == kt.group);
    let (words, blocks, rows) = (d / WORD, d / QUERY_BLOCK, kt.rows);
    let (per_group, ng) = (kt.group / QUERY_BLOCK, d / kt.group);
    let q = QueryRows::<M>::new(qc, b0);
    let scale = _mm256_set1_ps(scale);
    let codes = kt.codes.as_ptr() as *const __m256i;
    for r in 0..nb.div_ceil(LANES) {
        let codes = codes.add(r * words);
        let (ks, lo) = (
            kt.scales.as_ptr().add(r * LANES),
            kt.los.as_ptr().add(r * LANES),
        );
        let mut f = [_mm256_setzero_ps(); M];
        for g in 0..ng {
            let lo = _mm256_loadu_ps(lo.add(g * rows));
            for (f, qsum) in f.iter_mut().zip(&q.group_sums) {
                *f = _mm256_fmadd_ps(lo, _mm256_set1_ps(*qsum.add(g)), *f);
            }
        }
        for blk in 0..blocks {
            let acc = D::dots(codes, &q, kt.bits, blk);
            let ks = _mm256_loadu_ps(ks.add(blk / per_group * rows));
            for ((f, a), qs) in f.iter_mut().zip(&acc).zip(&q.scales) {
                let w = _mm256_mul_ps(ks, _mm256_set1_ps(*qs.add(blk)));
                *f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(*a), w, *f);
            }
        }
        for (b, &f) in f.iter().enumerate() {
            let at = p.as_mut_ptr().add((b0 + b) * TILE + r * LANES);
            _mm256_storeu_ps(at, _mm256_mul_ps(f, scale));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_rows::{block, kernels, stream, Kernel, RandomRows};
    use super::super::RowView;
    use super::*;
    use crate::tiled_attention::{Width, TILE};
    use kvplug_core::oracle::gamma;

    /// The scores kernel at `width` against the same arithmetic in f64, from the definition
    /// (query codes recomputed here, key codes unpacked by hand): within the f32 rounding of
    /// the block arithmetic, `γ(D + 2)·scale·Σ |code|·s·(scale_k·c + |lo|)`, per score.
    /// Query blocks of very different magnitudes and key groups of different scales and
    /// offsets, so a lane given the wrong block's or group's factor is far outside it.
    /// Returns the scores.
    fn check<const M: usize>(
        width: Kernel,
        bits: u32,
        group: usize,
        d: usize,
        nb: usize,
        seed: u64,
    ) -> Vec<f32> {
        let mut next = stream(seed);
        let rows = RandomRows::new(&mut next, bits, group, d, nb);
        let (codes, sk, lo) = (&rows.codes, &rows.scales, &rows.los);
        let ng = d / group;
        let q: Vec<f32> = (0..M * d)
            .map(|i| (next() * 2.0 - 1.0) * [1.0, 30.0, 0.01, 3.0][(i / QUERY_BLOCK) % 4])
            .collect();
        let mut qc = QueryCodes::default();
        unsafe { qc.quantize(&q, d, group, bits == 4) };
        let k = rows.view();
        let scale = 0.125;
        // SAFETY: the features are checked by the caller; k holds nb rows.
        let p = unsafe { scores_at::<M>(width, &qc, k, nb, scale) };
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
                    "{width:?} q{bits} g{group} d{d} M{M}: row {r} key {j}: {got} vs {want} (bound {bound:e})"
                );
            }
        }
        p
    }

    /// The scores of `qc`'s first `M` rows against the `nb` rows of `k`, staged and scored
    /// at `width`: `[M, TILE]`, NaN past `nb`'s register.
    ///
    /// # Safety
    /// The width's int8 features are present; `k` holds `nb` rows `qc` was quantized for.
    unsafe fn scores_at<const M: usize>(
        width: Kernel,
        qc: &QueryCodes,
        k: QuantRows,
        nb: usize,
        scale: f32,
    ) -> Vec<f32> {
        let mut staged = Vec::new();
        let mut p = vec![f32::NAN; M * TILE];
        let k = k.for_tile(0, nb, &mut staged);
        let mut kt = KeyTile::default();
        let blk = block(nb, k.d, scale);
        match width.width {
            Width::Avx512 => {
                kt.stage_avx512(&k, &k, 0, nb, nb, true);
                scores_avx512::<M>(&blk, qc, &kt, &mut p);
            }
            Width::Avx2 => {
                kt.dot = width.dot;
                kt.stage_avx2(&k, &k, 0, nb, nb, true);
                scores_avx2::<M>(&blk, qc, &kt, &mut p);
            }
        }
        p
    }

    /// At every width, against the definition; where both run, the same bits.
    #[test]
    fn scores_are_the_declared_arithmetic_lane_for_lane() {
        let widths = kernels();
        if widths.is_empty() {
            eprintln!("skipped: this CPU has no AVX2, the kernels' least target");
            return;
        }
        for (bits, group) in [(8, 64), (8, 32), (4, 32), (4, 64)] {
            for (d, nb) in [(64, 37), (128, 64), (256, 5)] {
                let seed = (bits * 1000 + group as u32 + d as u32) as u64;
                let runs: Vec<[Vec<f32>; 4]> = widths
                    .iter()
                    .map(|&w| {
                        [
                            check::<1>(w, bits, group, d, nb, seed),
                            check::<4>(w, bits, group, d, nb, seed + 1),
                            check::<7>(w, bits, group, d, nb, seed + 2),
                            check::<8>(w, bits, group, d, nb, seed + 3),
                        ]
                    })
                    .collect();
                for run in &runs[1..] {
                    for (a, b) in run.iter().zip(&runs[0]) {
                        // Only the lanes both wrote: each writes whole registers.
                        let same = a.chunks(TILE).zip(b.chunks(TILE)).all(|(a, b)| {
                            a[..nb]
                                .iter()
                                .zip(&b[..nb])
                                .all(|(x, y)| x.to_bits() == y.to_bits())
                        });
                        assert!(same, "q{bits} g{group} d{d}: the widths' scores differ");
                    }
                }
            }
        }
    }

    /// Extreme codes at every width against query codes ±127: q8 codes 0, 128 and 255 (the
    /// pair sums `maddubs` must not saturate), q4 codes 0, 8 and 15; key row 0 all at the top
    /// code (q4's largest i16 block sum, 16·15·127), row 1 all 0.
    #[test]
    fn extreme_codes_do_not_saturate() {
        let widths = kernels();
        if widths.is_empty() {
            eprintln!("skipped: this CPU has no AVX2, the kernels' least target");
            return;
        }
        let (d, nb, group) = (64, 8, 32);
        // Query block 0: +127 everywhere; block 1: alternating ±127 (s = 1 both).
        let q: Vec<f32> = (0..d)
            .map(|i| if i < 32 || i % 2 == 0 { 127.0 } else { -127.0 })
            .collect();
        for bits in [8u32, 4] {
            let top = (1u32 << bits) - 1;
            let codes: Vec<u8> = (0..nb * d)
                .map(|i| match i / d {
                    0 => top as u8,
                    1 => 0,
                    _ => [0, top / 2 + 1, top][(i / 2) % 3] as u8,
                })
                .collect();
            let packed: Vec<u8> = match bits {
                8 => codes.clone(),
                _ => codes.chunks(2).map(|p| p[0] | (p[1] << 4)).collect(),
            };
            let one = half::f16::ONE.to_bits();
            let (sk, lo) = (vec![one; nb * 2], vec![0u16; nb * 2]);
            let mut qc = QueryCodes::default();
            unsafe { qc.quantize(&q, d, group, bits == 4) };
            for &w in &widths {
                let k = QuantRows::new(&packed, &sk, &lo, bits, group, d).unwrap();
                // SAFETY: the width is this CPU's; k holds nb rows.
                let p = unsafe { scores_at::<1>(w, &qc, k, nb, 1.0) };
                for j in 0..nb {
                    let want: i64 = (0..d).map(|e| codes[j * d + e] as i64 * q[e] as i64).sum();
                    assert_eq!(p[j], want as f32, "{w:?} q{bits} key {j}");
                }
            }
        }
    }

    /// Codes by the definition, in f64: ties away from zero, the clamp, a zero block.
    #[test]
    fn query_codes_round_half_away_from_zero_per_block() {
        if !crate::simd::vector_path() {
            eprintln!("skipped: this CPU has no AVX2, the quantizer's target");
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
        // A NaN value: its block's scale is NaN (the scores NaN, as in f32), its codes 0.
        let mut q = vec![1f32; d];
        q[40] = f32::NAN;
        unsafe { qc.quantize(&q, d, 32, false) };
        assert_eq!(qc.scales[0], 1.0 / 127.0);
        assert!(qc.scales[1].is_nan() && qc.codes[32..].iter().all(|&c| c == 0));
        // An infinite value: its block's scale is infinite, every quotient 0 or NaN, so
        // every code 0.
        q[40] = f32::INFINITY;
        unsafe { qc.quantize(&q, d, 32, false) };
        assert_eq!(qc.scales[1], f32::INFINITY);
        assert!(qc.codes[32..].iter().all(|&c| c == 0) && qc.sums[1] == 0);
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
