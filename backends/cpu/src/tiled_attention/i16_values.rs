//! The value sum in the [`Arithmetic::Int8QueryI16Values`](kvplug_core::Arithmetic)
//! arithmetic, for quantized values (`lo + σ·c` per group): each tile (one run of at most
//! [`TILE`] keys) has its value codes staged once as pairs of keys ([`ValueTile`]: 32-bit
//! lane `d` of pair `p` holds `c[2p][d] | c[2p + 1][d] << 16`), shared by every query row
//! of the tile (or, with AVX-512 VBMI and at most two blocks of rows, formed in registers
//! from the pool as the sums read them: [`values_vbmi`]); per block row and value group the
//! weights times the scales are coded to i16 (`u = p·σ`, `e = round(u·(32767 / max u))`,
//! `r = max u / 32767`), and one `vpdpwssd` (AVX2 without 256-bit VNNI: `vpmaddwd` and an
//! add, [`values_256`]) multiplies a broadcast pair of codes with 16 (8) values of
//! both keys at once, summing exactly in i32. Each block row then adds `r·Σ e·c` and
//! `Σ p·lo` (f32) to its output. Both widths give the same sums, bit for bit.

use std::arch::x86_64::*;

use kvplug_core::arithmetic::{TINY_RUN, WEIGHT_CODES};

use super::{Block, QuantRows, TILE};
use crate::simd::Dot256;

/// Value groups a row may have ([`QuantRows`] holds up to 512 values in groups of 32).
const MAX_GROUPS: usize = 16;

/// A tile's value rows staged for the integer value sum.
#[derive(Default)]
pub struct ValueTile {
    /// `[pair, d]`: the codes of keys `2p` and `2p + 1` of the tile, as i16 pairs (0 past
    /// the tile's last key); only where `pairs_staged`.
    pairs: Vec<i32>,
    /// `[group, TILE]`: each key's scale and offset per group (0 past the last key).
    scales: Vec<f32>,
    los: Vec<f32>,
    /// Whether `pairs` holds the tile ([`ValueTile::stage`]) or the sums read the pool's
    /// codes themselves ([`ValueTile::stage_scales`]).
    pairs_staged: bool,
    /// Keys in the tile, values per row and per group.
    n: usize,
    d: usize,
    group: usize,
    /// How [`values_256`] multiplies (set before the sums; the 512-bit kernels ignore it).
    pub dot: Dot256,
}

impl ValueTile {
    /// Stages rows `[j0, j0 + n)` of `v` (the view [`super::RowView::for_tile`] made for
    /// them: their groups' scales and offsets widened).
    ///
    /// # Safety
    /// AVX2 is present, `v`'s groups are a multiple of 32 values and `n <= TILE`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn stage(&mut self, v: &QuantRows, j0: usize, n: usize) {
        self.stage_scales(v, n);
        self.pairs_staged = true;
        let d = v.d;
        let pairs = n.div_ceil(2);
        self.pairs.resize(pairs * d, 0);
        for p in 0..pairs {
            let (a, b) = (j0 + 2 * p, j0 + 2 * p + 1);
            for c in (0..d).step_by(16) {
                let ca = v.codes(a, c, 16);
                let cb = match 2 * p + 1 < n {
                    true => v.codes(b, c, 16),
                    false => _mm_setzero_si128(),
                };
                // Bytes a0 b0 a1 b1 …, widened to i16: lane i of 32 bits is (a_i, b_i).
                let lo = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(ca, cb));
                let hi = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(ca, cb));
                let at = self.pairs.as_mut_ptr().add(p * d + c) as *mut __m256i;
                _mm256_storeu_si256(at, lo);
                _mm256_storeu_si256(at.add(1), hi);
            }
        }
    }

    /// Stages only the scales and offsets of the tile's `n` rows, for [`values_vbmi`], which
    /// reads the codes from the pool as it sums.
    ///
    /// # Safety
    /// `v` is the view [`super::RowView::for_tile`] made for the tile's `n` rows, its groups
    /// a multiple of 32 values, and `n <= TILE`.
    pub unsafe fn stage_scales(&mut self, v: &QuantRows, n: usize) {
        debug_assert!(n <= TILE && v.group.is_multiple_of(32) && v.ng <= MAX_GROUPS);
        (self.n, self.d, self.group, self.pairs_staged) = (n, v.d, v.group, false);
        self.scales.clear();
        self.scales.resize(v.ng * TILE, 0.0);
        self.los.clear();
        self.los.resize(v.ng * TILE, 0.0);
        for jj in 0..n {
            for g in 0..v.ng {
                let gr = v.staged.add((jj * v.ng + g) * 2);
                self.scales[g * TILE + jj] = *gr;
                self.los[g * TILE + jj] = *gr.add(1);
            }
        }
    }

    /// Whether [`ValueTile::stage`] staged the codes.
    pub fn has_pairs(&self) -> bool {
        self.pairs_staged
    }
}

/// One block row's weights in one group, coded: its codes' scale `r` and the f32 `Σ p·lo`.
#[derive(Clone, Copy, Default)]
struct Coded {
    r: f32,
    lo: f32,
}

/// Codes the weights `p` of one block row for group `g` of `vt` into `codes` (`codes[p]`
/// the i16 pair of keys `2p, 2p + 1`): its first `nb` keys (`p` holds 0 from `nb` to the
/// next multiple of 8), up to the pair `nb.div_ceil(2)` that the sums read, 8 keys a
/// register. The max and `Σ p·lo` each run in two registers of 8 lanes: keys `16i + k` in
/// lane `k` of the first, `16i + 8 + k` of the second, each in key order, then the two
/// combined ([`code512`] keeps this order, so both widths give the same bits, NaNs
/// included).
#[inline(always)]
unsafe fn code256(
    vt: &ValueTile,
    p: &[f32],
    nb: usize,
    g: usize,
    codes: &mut [i32; TILE / 2],
) -> Coded {
    let (sc, lo) = (&vt.scales[g * TILE..][..TILE], &vt.los[g * TILE..][..TILE]);
    let mut u = [_mm256_setzero_ps(); TILE / 8];
    let (mut max, mut los) = ([_mm256_setzero_ps(); 2], [_mm256_setzero_ps(); 2]);
    let chunks = nb.div_ceil(8);
    for (i, u) in u.iter_mut().enumerate().take(chunks) {
        let w = _mm256_loadu_ps(p.as_ptr().add(8 * i));
        *u = _mm256_mul_ps(w, _mm256_loadu_ps(sc.as_ptr().add(8 * i)));
        max[i % 2] = _mm256_max_ps(max[i % 2], *u);
        los[i % 2] = _mm256_fmadd_ps(w, _mm256_loadu_ps(lo.as_ptr().add(8 * i)), los[i % 2]);
    }
    let max = max8(_mm256_max_ps(max[0], max[1]));
    let to_codes = _mm256_set1_ps(to_codes(max));
    for (i, u) in u.iter().enumerate().take(chunks) {
        // Rounded to nearest (ties to even), packed to i16 by pairs of 32-bit lanes.
        let e = _mm256_cvtps_epi32(_mm256_mul_ps(*u, to_codes));
        let packed = _mm256_packs_epi32(e, e);
        let packed = _mm256_permute4x64_epi64::<0b1000>(packed);
        _mm_storeu_si128(
            codes.as_mut_ptr().add(4 * i) as *mut __m128i,
            _mm256_castsi256_si128(packed),
        );
    }
    Coded {
        r: max / WEIGHT_CODES as f32,
        lo: super::hsum(_mm256_add_ps(los[0], los[1])),
    }
}

/// [`code256`] 16 keys a register, with the same operations lane for lane: where
/// [`code256`] has no register for the last one's upper half, its max and sum leave those
/// lanes out (its codes there are 0).
///
/// # Safety
/// AVX-512F is present.
#[inline(always)]
unsafe fn code512(
    vt: &ValueTile,
    p: &[f32],
    nb: usize,
    g: usize,
    codes: &mut [i32; TILE / 2],
) -> Coded {
    let (sc, lo) = (&vt.scales[g * TILE..][..TILE], &vt.los[g * TILE..][..TILE]);
    let mut u = [_mm512_setzero_ps(); TILE / 16];
    let (mut max, mut los) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let chunks = nb.div_ceil(8);
    for (i, u) in u.iter_mut().enumerate().take(chunks.div_ceil(2)) {
        let lanes: __mmask16 = if 2 * i + 1 < chunks { 0xffff } else { 0xff };
        let w = _mm512_maskz_loadu_ps(lanes, p.as_ptr().add(16 * i));
        *u = _mm512_mul_ps(w, _mm512_maskz_loadu_ps(lanes, sc.as_ptr().add(16 * i)));
        max = _mm512_mask_max_ps(max, lanes, max, *u);
        let l = _mm512_maskz_loadu_ps(lanes, lo.as_ptr().add(16 * i));
        los = _mm512_mask3_fmadd_ps(w, l, los, lanes);
    }
    let max = max8(_mm256_max_ps(_mm512_castps512_ps256(max), upper8(max)));
    let to_codes = _mm512_set1_ps(to_codes(max));
    for (i, u) in u.iter().enumerate().take(chunks.div_ceil(2)) {
        let e = _mm512_cvtps_epi32(_mm512_mul_ps(*u, to_codes));
        // Saturated to i16 as `packs` does.
        let packed = _mm512_cvtsepi32_epi16(e);
        _mm256_storeu_si256(codes.as_mut_ptr().add(8 * i) as *mut __m256i, packed);
    }
    let los = _mm256_add_ps(_mm512_castps512_ps256(los), upper8(los));
    Coded {
        r: max / WEIGHT_CODES as f32,
        lo: super::hsum(los),
    }
}

/// Lanes 8 to 15 of `x`.
#[inline(always)]
unsafe fn upper8(x: __m512) -> __m256 {
    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x)))
}

/// The largest lane of `m`.
#[inline(always)]
unsafe fn max8(m: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)))
}

/// The factor from weights to codes for a run whose largest weight is `max`: 0 below
/// [`TINY_RUN`] (such a run is coded 0: its factor could overflow, `r` be subnormal).
#[inline(always)]
fn to_codes(max: f32) -> f32 {
    if max >= TINY_RUN {
        WEIGHT_CODES as f32 / max
    } else {
        0.0
    }
}

/// Where each block row's output goes: `out[(b0 + b)·d ..]`.
#[inline(always)]
unsafe fn finish_slice(out: *mut f32, acc: __m256i, coded: &Coded) {
    let x = _mm256_fmadd_ps(
        _mm256_cvtepi32_ps(acc),
        _mm256_set1_ps(coded.r),
        _mm256_set1_ps(coded.lo),
    );
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), x));
}

macro_rules! values {
    ($name:ident, $features:literal, $v:ty, $n:literal, $slice:literal, $pair:ident,
     $code:ident, $dot:expr, $zero:ident, $finish:expr) => {
        /// `out += p · V` for the block's `M` rows over the first `blk.nb` keys of the tile
        /// staged in `vt` (see the module docs).
        ///
        /// # Safety
        /// The width's features are present; `v` holds the tile's rows and `vt` was staged
        /// as `$pair` reads it; `p` holds the block's weights (`[rows, TILE]`, 0 from `nb`
        /// to the next multiple of 8) and `out` its rows.
        #[target_feature(enable = $features)]
        pub unsafe fn $name<const M: usize>(
            blk: &Block<'_>,
            vt: &ValueTile,
            v: &QuantRows,
            p: &[f32],
            out: &mut [f32],
        ) {
            const { assert!(M <= 8) };
            let (d, b0, nb) = (vt.d, blk.b0, blk.nb);
            let pairs = nb.div_ceil(2);
            let mut codes = [[0i32; TILE / 2]; 8];
            let mut coded = [Coded::default(); 8];
            // `$slice` registers of values at a time (16 accumulators for 8 rows at 512
            // bits; two at 256 would spill one: a store and load in the loop, 30% of its
            // time), within one group (groups are multiples of 32 values); the weights are
            // coded anew at each group's first.
            for c in (0..d).step_by($n * $slice) {
                if c % vt.group == 0 {
                    let g = c / vt.group;
                    for b in 0..M {
                        let p = &p[(b0 + b) * TILE..][..TILE];
                        coded[b] = $code(vt, p, nb, g, &mut codes[b]);
                    }
                }
                let mut acc = [[$zero(); $slice]; M];
                for pr in 0..pairs {
                    let x: [$v; $slice] = $pair(vt, v, blk.j0, pr, c);
                    for (b, a) in acc.iter_mut().enumerate() {
                        let w = *codes.get_unchecked(b).get_unchecked(pr);
                        for (a, &x) in a.iter_mut().zip(&x) {
                            *a = $dot(*a, x, w);
                        }
                    }
                }
                for (b, a) in acc.iter().enumerate() {
                    for (i, &a) in a.iter().enumerate() {
                        let at = out.as_mut_ptr().add((b0 + b) * d + c + i * $n);
                        $finish(at, a, &coded[b]);
                    }
                }
            }
        }
    };
}

values!(
    values_avx2,
    "avx2,fma",
    __m256i,
    8,
    1,
    staged256,
    code256,
    |a, x, w| _mm256_add_epi32(a, _mm256_madd_epi16(x, _mm256_set1_epi32(w))),
    _mm256_setzero_si256,
    finish_slice
);

values!(
    values_vex,
    "avx2,fma,avxvnni",
    __m256i,
    8,
    1,
    staged256,
    code256,
    |a, x, w| _mm256_dpwssd_avx_epi32(a, x, _mm256_set1_epi32(w)),
    _mm256_setzero_si256,
    finish_slice
);

values!(
    values_evex,
    "avx2,fma,avx512vnni,avx512vl",
    __m256i,
    8,
    1,
    staged256,
    code256,
    |a, x, w| _mm256_dpwssd_epi32(a, x, _mm256_set1_epi32(w)),
    _mm256_setzero_si256,
    finish_slice
);

/// The 256-bit value sum by the instructions `vt.dot` names: [`values_avx2`], [`values_vex`]
/// or [`values_evex`] (the same sums, bit for bit).
///
/// # Safety
/// As [`values_avx2`], and the VNNI set `vt.dot` names is present.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn values_256<const M: usize>(
    blk: &Block<'_>,
    vt: &ValueTile,
    v: &QuantRows,
    p: &[f32],
    out: &mut [f32],
) {
    match vt.dot {
        Dot256::Maddubs => values_avx2::<M>(blk, vt, v, p, out),
        Dot256::Vex => values_vex::<M>(blk, vt, v, p, out),
        Dot256::Evex => values_evex::<M>(blk, vt, v, p, out),
    }
}

/// The 512-bit sums' lanes, bit for bit (see [`finish_slice`]).
#[inline(always)]
unsafe fn finish512(o: *mut f32, a: __m512i, c: &Coded) {
    let x = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(a),
        _mm512_set1_ps(c.r),
        _mm512_set1_ps(c.lo),
    );
    _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), x));
}

values!(
    values_avx512,
    "avx512f,avx512vnni,avx2,fma",
    __m512i,
    16,
    2,
    staged512,
    code512,
    |a, x, w| _mm512_dpwssd_epi32(a, x, _mm512_set1_epi32(w)),
    _mm512_setzero_si512,
    finish512
);

values!(
    values_vbmi,
    "avx512f,avx512bw,avx512vbmi,avx512vnni,avx2,fma",
    __m512i,
    16,
    2,
    pair_vbmi,
    code512,
    |a, x, w| _mm512_dpwssd_epi32(a, x, _mm512_set1_epi32(w)),
    _mm512_setzero_si512,
    finish512
);

/// Values `[c, c + 8)` of pair `pr`, as [`ValueTile::stage`] left them.
#[inline(always)]
unsafe fn staged256(vt: &ValueTile, _: &QuantRows, _: usize, pr: usize, c: usize) -> [__m256i; 1] {
    debug_assert!(vt.pairs_staged);
    [_mm256_loadu_si256(
        vt.pairs.as_ptr().add(pr * vt.d + c) as *const __m256i
    )]
}

/// Values `[c, c + 32)` of pair `pr`, as [`ValueTile::stage`] left them.
#[inline(always)]
unsafe fn staged512(vt: &ValueTile, _: &QuantRows, _: usize, pr: usize, c: usize) -> [__m512i; 2] {
    debug_assert!(vt.pairs_staged);
    let at = vt.pairs.as_ptr().add(pr * vt.d + c);
    [0, 16].map(|i| _mm512_loadu_si512(at.add(i) as *const __m512i))
}

/// Values `[c, c + 32)` of pair `pr` of the tile at row `j0` of `v`, in [`ValueTile::stage`]'s
/// layout, read from the pool's codes: per 16 values one two-source byte permute of both
/// keys' codes ([`PAIR_BYTES`]), whose high bytes come from the first source's upper half,
/// zero. The second key of an odd last pair reads as 0.
///
/// # Safety
/// AVX-512F/BW/VBMI are present, `c + 32 <= v.d`, and the pair's rows are in `v`.
#[inline(always)]
unsafe fn pair_vbmi(vt: &ValueTile, v: &QuantRows, j0: usize, pr: usize, c: usize) -> [__m512i; 2] {
    let (d, a, has_b) = (v.d, j0 + 2 * pr, 2 * pr + 1 < vt.n);
    let (x, y, idx) = if v.bits == 8 {
        let row = |j: usize| {
            _mm512_zextsi256_si512(_mm256_loadu_si256(v.codes.add(j * d + c) as *const __m256i))
        };
        let y = if has_b {
            row(a + 1)
        } else {
            _mm512_setzero_si512()
        };
        (row(a), y, &PAIR_BYTES[0])
    } else {
        // Key a's 16 bytes, then key b's: low nibbles (even values) in `x`, high in `y`.
        let row = |j: usize| _mm_loadu_si128(v.codes.add((j * d + c) / 2) as *const __m128i);
        let b = if has_b {
            row(a + 1)
        } else {
            _mm_setzero_si128()
        };
        let both = _mm512_zextsi256_si512(_mm256_set_m128i(b, row(a)));
        let nibble = _mm512_set1_epi8(0xf);
        let y = _mm512_and_si512(_mm512_srli_epi16::<4>(both), nibble);
        (_mm512_and_si512(both, nibble), y, &PAIR_BYTES[1])
    };
    idx.map(|i| _mm512_permutex2var_epi8(x, _mm512_loadu_si512(i.as_ptr().cast()), y))
}

/// The permutes of [`pair_vbmi`], for q8 then q4 codes: index `h` makes values `[16h, 16h +
/// 16)` of a run of 32, byte `4i` (`4i + 2`) taking value `16h + i` of the pair's first
/// (second) key and the others byte 32 of the first source (0). q8 sources hold each key's
/// 32 codes; q4 sources the low nibbles (`x`) and high nibbles (`y`, index bit 6) of the
/// first key's 16 bytes, then the second's.
static PAIR_BYTES: [[[u8; 64]; 2]; 2] = [pair_bytes(8), pair_bytes(4)];

const fn pair_bytes(bits: usize) -> [[u8; 64]; 2] {
    let mut idx = [[32u8; 64]; 2];
    let mut v = 0;
    while v < 32 {
        let (h, i) = (v / 16, v % 16);
        let (a, b) = if bits == 8 {
            (v, 64 + v)
        } else {
            let base = if v % 2 == 1 { 64 } else { 0 };
            (base + v / 2, base + 16 + v / 2)
        };
        idx[h][4 * i] = a as u8;
        idx[h][4 * i + 2] = b as u8;
        v += 1;
    }
    idx
}

#[cfg(test)]
mod tests {
    use super::super::test_rows::{block, kernels, stream, Kernel, RandomRows};
    use super::*;
    use crate::tiled_attention::{RowView, Width};
    use kvplug_core::oracle::gamma;

    /// The value sum of `M` rows of weights over `nb` random q`bits` value rows at `width`
    /// against the declared arithmetic computed here: the same f32 codes and scale (scalar
    /// IEEE operations give the vector lanes' bits), the integer sums exact, and `r·Σ e·c +
    /// Σ p·lo` within the f32 roundings of the `lo` sum and the last multiply-add. Weights
    /// spanning six decades and groups of different scales, so a lane coded with another
    /// group's scale or key's weight is far outside. Returns the outputs.
    fn check<const M: usize>(
        width: Kernel,
        bits: u32,
        group: usize,
        d: usize,
        nb: usize,
    ) -> Vec<f32> {
        let mut next = stream((bits as usize * 1000 + group + d + nb) as u64);
        let rows = RandomRows::new(&mut next, bits, group, d, nb);
        let (codes, sv, lo) = (&rows.codes, &rows.scales, &rows.los);
        let ng = d / group;
        let mut p = vec![0f32; M * TILE];
        for (i, w) in p.iter_mut().enumerate().filter(|(i, _)| i % TILE < nb) {
            *w = next() * 10f32.powi(-((i % 7) as i32));
        }
        let out = values_at::<M>(width, &rows, &p, d, nb);
        let limit = WEIGHT_CODES as f32;
        for r in 0..M {
            let w = &p[r * TILE..][..nb];
            for g in 0..ng {
                let u: Vec<f32> = (0..nb).map(|j| w[j] * sv[j * ng + g].to_f32()).collect();
                let max = u.iter().copied().fold(0f32, f32::max);
                let to_codes = if max >= TINY_RUN { limit / max } else { 0.0 };
                let e: Vec<i64> = u
                    .iter()
                    .map(|&u| (u * to_codes).round_ties_even() as i64)
                    .collect();
                let rs = max / limit;
                let (los, los_abs) = (0..nb).fold((0f64, 0f64), |(s, a), j| {
                    let x = w[j] as f64 * lo[j * ng + g].to_f64();
                    (s + x, a + x.abs())
                });
                for c in g * group..(g + 1) * group {
                    let acc: i64 = (0..nb).map(|j| e[j] * codes[j * d + c] as i64).sum();
                    let want = rs as f64 * acc as f64 + los;
                    let bound = gamma(nb + 2) * (rs as f64 * acc as f64 + los_abs);
                    let got = out[r * d + c] as f64;
                    assert!(
                        (got - want).abs() <= bound,
                        "{width:?} q{bits} g{group} d{d} M{M}: row {r} value {c}: {got} vs {want} (bound {bound:e})"
                    );
                }
            }
        }
        out
    }

    /// The value sum at `width` of `M` rows of weights `p` (`[M, TILE]`) over the `nb` rows
    /// of `rows`, as the kernel runs it (at 512 bits with VBMI, from the pool's codes).
    fn values_at<const M: usize>(
        width: Kernel,
        rows: &RandomRows,
        p: &[f32],
        d: usize,
        nb: usize,
    ) -> Vec<f32> {
        let vbmi = width.width == Width::Avx512 && crate::simd::vbmi_path();
        values_staged::<M>(width, !vbmi, rows, (0, nb), p, d, nb)
    }

    /// [`values_at`] over the first `nb` keys of the tile of `n` rows from row `j0` of
    /// `rows` (`tile`), from codes staged as pairs or (`staged` false, at 512 bits with
    /// VBMI) read from the pool.
    fn values_staged<const M: usize>(
        width: Kernel,
        staged: bool,
        rows: &RandomRows,
        (j0, n): (usize, usize),
        p: &[f32],
        d: usize,
        nb: usize,
    ) -> Vec<f32> {
        let mut out = vec![0f32; M * d];
        let mut groups = Vec::new();
        // SAFETY: the caller checked the width's features; the rows hold j0 + n rows of d.
        unsafe {
            let v = rows.view().for_tile(j0, n, &mut groups);
            let mut vt = ValueTile {
                dot: width.dot,
                ..ValueTile::default()
            };
            match staged {
                true => vt.stage(&v, j0, n),
                false => vt.stage_scales(&v, n),
            }
            let blk = Block {
                j0,
                ..block(nb, d, 1.0)
            };
            match (width.width, staged) {
                (Width::Avx512, true) => values_avx512::<M>(&blk, &vt, &v, p, &mut out),
                (Width::Avx512, false) => values_vbmi::<M>(&blk, &vt, &v, p, &mut out),
                (Width::Avx2, _) => values_256::<M>(&blk, &vt, &v, p, &mut out),
            }
        }
        out
    }

    /// The sums from the pool's codes (VBMI) and from staged pairs give the same bits: q8
    /// and q4, odd and even tiles, a tile past the pool's first, keys the block cannot see
    /// (`nb < n`), every block size. (`values_at` takes the VBMI path where the CPU has it,
    /// so the arithmetic tests check the staged 512-bit sums through this one.)
    #[test]
    fn codes_read_from_the_pool_sum_as_staged_ones() {
        if !crate::simd::vbmi_path() {
            eprintln!("skipped: this CPU has no AVX-512 VBMI");
            return;
        }
        let shapes = [
            (8, 32, 64, 37, 37),
            (8, 64, 128, 64, 64),
            (8, 32, 128, 40, 63),
            (4, 32, 256, 5, 5),
            (4, 32, 64, 63, 64),
            (4, 32, 64, 20, 33),
        ];
        for (bits, group, d, nb, n) in shapes {
            let mut next = stream(bits as u64 * 7 + nb as u64 + n as u64);
            let rows = RandomRows::new(&mut next, bits, group, d, TILE + n);
            let p: Vec<f32> = (0..8 * TILE)
                .map(|i| if i % TILE < nb { next() } else { 0.0 })
                .collect();
            for j0 in [0, TILE] {
                let wide = Kernel {
                    width: Width::Avx512,
                    dot: Dot256::Maddubs,
                };
                let bits_of = |staged: bool| -> Vec<u32> {
                    let tile = (j0, n);
                    let out = values_staged::<8>(wide, staged, &rows, tile, &p, d, nb);
                    let one = values_staged::<1>(wide, staged, &rows, tile, &p, d, nb);
                    out.iter().chain(&one).map(|x| x.to_bits()).collect()
                };
                let what = format!("q{bits} d{d} nb{nb} n{n} j0 {j0}");
                assert_eq!(bits_of(true), bits_of(false), "{what}");
            }
        }
    }

    /// A key whose group scale is infinite under weight 0 makes its `u` NaN; the max runs
    /// in the same order at both widths, so they still give the same bits, wherever the
    /// key sits and whether one or two such keys are in the run.
    #[test]
    fn nan_weight_codes_give_the_same_bits_at_both_widths() {
        let widths = kernels();
        if !widths.iter().any(|k| k.width == Width::Avx512) {
            eprintln!("skipped: this CPU lacks one of the two widths");
            return;
        }
        let (d, group, nb) = (64, 32, 37);
        for (a, b) in (0..nb).flat_map(|a| [(a, a), (a, (a * 7 + 3) % nb)]) {
            let mut next = stream(99);
            let mut rows = RandomRows::new(&mut next, 8, group, d, nb);
            let mut p: Vec<f32> = (0..TILE)
                .map(|j| if j < nb { next() } else { 0.0 })
                .collect();
            for key in [a, b] {
                rows.set_scale(key * (d / group), half::f16::INFINITY);
                p[key] = 0.0;
            }
            let bits = |w: Kernel| -> Vec<u32> {
                let out = values_at::<1>(w, &rows, &p, d, nb);
                out.iter().map(|x| x.to_bits()).collect()
            };
            for &w in &widths[1..] {
                assert_eq!(bits(widths[0]), bits(w), "{w:?}: NaN keys {a} and {b}");
            }
        }
    }

    /// At every width, against the definition; where both run, the same bits.
    #[test]
    fn values_are_the_declared_arithmetic_lane_for_lane() {
        let widths = kernels();
        if widths.is_empty() {
            eprintln!("skipped: this CPU has no AVX2, the kernels' least target");
            return;
        }
        for (bits, group) in [(8, 64), (8, 32), (4, 32)] {
            for (d, nb) in [(64, 37), (128, 64), (256, 5)] {
                let runs: Vec<[Vec<f32>; 3]> = widths
                    .iter()
                    .map(|&w| {
                        [
                            check::<1>(w, bits, group, d, nb),
                            check::<5>(w, bits, group, d, nb),
                            check::<8>(w, bits, group, d, nb),
                        ]
                    })
                    .collect();
                for run in &runs[1..] {
                    for (a, b) in run.iter().zip(&runs[0]) {
                        let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                        assert!(same, "q{bits} g{group} d{d}: the widths' sums differ");
                    }
                }
            }
        }
    }
}
