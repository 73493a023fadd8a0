//! The tiled attention kernel (AVX2 + FMA + F16C). One call takes one KV head, a run of
//! its query rows (`g` heads × `T` tokens, row `r` being token `r % T`) and a range of key
//! rows, in tiles of [`TILE`] rows with an online softmax (flash-attention style): the
//! scratch is `rows × TILE` scores whatever the window, and each K and V row is read from
//! memory once per call for all the query rows that see it.
//!
//! Rows are read in their storage dtype and widened in registers, 8 values at a time
//! ([`Row8`]: f32, f16, bf16, and q8/q4 with the affine dequantization fused in), never
//! staged as f32 rows. Per block of up to 4 query rows and per tile: scores of 2 rows × the
//! block per pass over `D`, then `out += p · V` with the tile's rows swept once per 16-wide
//! slice of `D` into register accumulators. Key rows a whole block cannot see (past the
//! causal limit) are skipped.
//!
//! [`accumulate`] leaves `out` unnormalized with each row's running max and sum, so a
//! caller may split the key rows of one head over threads and [`merge`] the parts
//! (flash-decoding), or [`finish`] a single part.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use kvplug_backend_kit::AttendMask;

use crate::pool::{CpuPool, HeadRows};
use crate::simd::fast_exp;
use crate::simd::x86::{exp8, hsum};
use crate::tensor::CpuTensor;
use crate::workers::{DisjointChunks, Workers};

/// Rows per tile: 64 f16 rows of 128 values (16 KiB) stay in L1 while the tile is swept.
pub const TILE: usize = 64;

/// 8 consecutive values of a row, widened to f32. Rows are read group by group: what the
/// loads of one group share (a quantized row's scale and offset) is fetched once.
pub trait Row8: Copy {
    /// What the loads of one group of a row share.
    type Group: Copy;
    /// Values per group: a multiple of 8 that divides `D` (`D` where rows have no groups).
    fn group_len(&self) -> usize;
    /// The group holding value `c` of row `j`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are present, `c < D` and `j` is a row of the pool.
    unsafe fn group(&self, j: usize, c: usize) -> Self::Group;
    /// Values `[c, c + 8)` of row `j`, whose group is `gr`.
    ///
    /// # Safety
    /// As [`Row8::group`], and `c + 8 <= D`.
    unsafe fn load8(&self, gr: Self::Group, j: usize, c: usize) -> __m256;
    /// Hints that row `j` is read soon (no effect on results).
    ///
    /// # Safety
    /// As [`Row8::group`].
    unsafe fn prefetch(&self, j: usize);
    /// A view for reading rows `[j0, j0 + n)` (one tile) whose groups are widened once into
    /// `staged` rather than at every load; the view reads `staged`, which must outlive its
    /// use and stay untouched meanwhile. Rows without groups return themselves.
    ///
    /// # Safety
    /// As [`Row8::group`] for every row of the tile.
    #[inline(always)]
    unsafe fn for_tile(self, _j0: usize, _n: usize, _staged: &mut Vec<f32>) -> Self {
        self
    }
}

/// Prefetches the cache lines of `bytes` bytes at `p`.
#[inline(always)]
unsafe fn prefetch_bytes<T>(p: *const T, bytes: usize) {
    let p = p as *const i8;
    for off in (0..bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(p.add(off));
    }
}

/// The [`Row8`] group items of rows without groups.
macro_rules! ungrouped {
    () => {
        type Group = ();
        #[inline(always)]
        fn group_len(&self) -> usize {
            self.d()
        }
        #[inline(always)]
        unsafe fn group(&self, _: usize, _: usize) {}
    };
}

/// Rows of `d` values in dtype `T` at `p`.
#[derive(Clone, Copy)]
pub struct Plain<T> {
    /// First row.
    pub p: *const T,
    /// Values per row.
    pub d: usize,
}

impl<T> Plain<T> {
    fn d(&self) -> usize {
        self.d
    }
}

impl Row8 for Plain<f32> {
    ungrouped!();
    #[inline(always)]
    unsafe fn prefetch(&self, j: usize) {
        prefetch_bytes(self.p.add(j * self.d), self.d * 4);
    }
    #[inline(always)]
    unsafe fn load8(&self, _: (), j: usize, c: usize) -> __m256 {
        _mm256_loadu_ps(self.p.add(j * self.d + c))
    }
}

impl Row8 for Plain<u16> {
    ungrouped!();
    #[inline(always)]
    unsafe fn prefetch(&self, j: usize) {
        prefetch_bytes(self.p.add(j * self.d), self.d * 2);
    }
    /// f16 bits.
    #[inline(always)]
    unsafe fn load8(&self, _: (), j: usize, c: usize) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(self.p.add(j * self.d + c) as *const __m128i))
    }
}

/// bf16 bits (the high half of an f32).
#[derive(Clone, Copy)]
pub struct Bf16Rows(pub Plain<u16>);

impl Bf16Rows {
    fn d(&self) -> usize {
        self.0.d
    }
}

impl Row8 for Bf16Rows {
    ungrouped!();
    #[inline(always)]
    unsafe fn prefetch(&self, j: usize) {
        self.0.prefetch(j);
    }
    #[inline(always)]
    unsafe fn load8(&self, _: (), j: usize, c: usize) -> __m256 {
        let h = _mm_loadu_si128(self.0.p.add(j * self.0.d + c) as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    }
}

/// Affine-quantized rows (see `crate::pool::Storage::Quant`): `bits` 8 or 4, groups a
/// multiple of 8 values, so one f16 scale and offset (widened once per group and row) cover
/// each 8-value load.
#[derive(Clone, Copy)]
pub struct QuantRows {
    codes: *const u8,
    scales: *const u16,
    los: *const u16,
    bits: usize,
    d: usize,
    /// Values per group.
    group: usize,
    /// Groups per row.
    ng: usize,
    /// The group of each 8-value chunk of a row (no division on the hot path).
    chunk_group: [u16; MAX_CHUNKS],
    /// Set by [`Row8::for_tile`]: the tile's first row, and its groups' scales and offsets
    /// widened to f32 pairs, `[row - tile_row][group]`.
    tile_row: usize,
    staged: *const f32,
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
        if !group.is_multiple_of(8) || d / 8 > MAX_CHUNKS {
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
            group,
            ng: d / group,
            chunk_group,
            tile_row: 0,
            staged: std::ptr::null(),
        })
    }
}

impl Row8 for QuantRows {
    /// Scale and offset, broadcast.
    type Group = (__m256, __m256);

    #[inline(always)]
    fn group_len(&self) -> usize {
        self.group
    }

    #[inline(always)]
    unsafe fn group(&self, j: usize, c: usize) -> Self::Group {
        let g = *self.chunk_group.get_unchecked(c / 8) as usize;
        if !self.staged.is_null() {
            let at = self.staged.add(((j - self.tile_row) * self.ng + g) * 2);
            return (_mm256_broadcast_ss(&*at), _mm256_broadcast_ss(&*at.add(1)));
        }
        let g = j * self.ng + g;
        // Scale and offset as a pair of f16s, widened together.
        let pair = _mm_insert_epi16::<1>(
            _mm_cvtsi32_si128(*self.scales.add(g) as i32),
            *self.los.add(g) as i32,
        );
        let sl = _mm_cvtph_ps(pair);
        (
            _mm256_broadcastss_ps(sl),
            _mm256_broadcastss_ps(_mm_movehdup_ps(sl)),
        )
    }

    #[inline(always)]
    unsafe fn for_tile(self, j0: usize, n: usize, staged: &mut Vec<f32>) -> Self {
        let groups = n * self.ng;
        staged.resize(groups * 2, 0.0);
        let (sc, lo) = (self.scales.add(j0 * self.ng), self.los.add(j0 * self.ng));
        let out = staged.as_mut_ptr();
        let mut i = 0;
        while i + 8 <= groups {
            let s = _mm256_cvtph_ps(_mm_loadu_si128(sc.add(i) as *const __m128i));
            let l = _mm256_cvtph_ps(_mm_loadu_si128(lo.add(i) as *const __m128i));
            // Interleaved (scale, lo) pairs.
            let (a, b) = (_mm256_unpacklo_ps(s, l), _mm256_unpackhi_ps(s, l));
            _mm256_storeu_ps(out.add(2 * i), _mm256_permute2f128_ps::<0x20>(a, b));
            _mm256_storeu_ps(out.add(2 * i + 8), _mm256_permute2f128_ps::<0x31>(a, b));
            i += 8;
        }
        for i in i..groups {
            let pair =
                _mm_insert_epi16::<1>(_mm_cvtsi32_si128(*sc.add(i) as i32), *lo.add(i) as i32);
            _mm_store_sd(
                out.add(2 * i) as *mut f64,
                _mm_castps_pd(_mm_cvtph_ps(pair)),
            );
        }
        QuantRows {
            tile_row: j0,
            staged: out,
            ..self
        }
    }

    #[inline(always)]
    unsafe fn prefetch(&self, j: usize) {
        prefetch_bytes(
            self.codes.add(j * self.d * self.bits / 8),
            self.d * self.bits / 8,
        );
        prefetch_bytes(self.scales.add(j * self.ng), self.ng * 2);
        prefetch_bytes(self.los.add(j * self.ng), self.ng * 2);
    }

    #[inline(always)]
    unsafe fn load8(&self, (scale, lo): Self::Group, j: usize, c: usize) -> __m256 {
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
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes), scale, lo)
    }
}

/// Which key rows query token `i` of `t` may see in a window of `l` rows.
#[derive(Clone, Copy)]
pub struct Visibility<'a> {
    /// The mask of the call.
    pub mask: AttendMask<'a>,
    /// Query tokens.
    pub t: usize,
    /// Window rows.
    pub l: usize,
}

impl Visibility<'_> {
    /// Token `i` sees no row at or past this one.
    #[inline(always)]
    fn end(&self, i: usize) -> usize {
        match self.mask {
            AttendMask::Causal => self.l - self.t + i + 1,
            AttendMask::None | AttendMask::Explicit(_) => self.l,
        }
    }

    /// Hides what token `i` must not see among `p`, the scores of rows `[j0, j0 + p.len())`.
    #[inline(always)]
    fn apply(&self, i: usize, j0: usize, p: &mut [f32]) {
        match self.mask {
            AttendMask::None => {}
            AttendMask::Causal => {
                let e = self.end(i).saturating_sub(j0).min(p.len());
                p[e..].fill(f32::NEG_INFINITY);
            }
            AttendMask::Explicit(m) => {
                let row = &m[i * self.l + j0..][..p.len()];
                for (x, &seen) in p.iter_mut().zip(row) {
                    if !seen {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
}

/// Tile scores and running softmax state of one task, reused across steps.
#[derive(Default)]
pub struct TileScratch {
    /// `[rows, TILE]` scores, then weights.
    p: Vec<f32>,
    /// Running max and sum per query row.
    max: Vec<f32>,
    sum: Vec<f32>,
    /// The unnormalized output of a part of a split head, `[rows, D]`.
    pub part: Vec<f32>,
    /// The tile's K and V groups (see [`Row8::for_tile`]).
    k_groups: Vec<f32>,
    v_groups: Vec<f32>,
}

/// Sums of 8 vectors, in order.
#[inline(always)]
unsafe fn hsum8(v: [__m256; 8]) -> __m256 {
    let a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    let b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(a, b),
        _mm256_permute2f128_ps::<0x31>(a, b),
    )
}

/// The largest of `p` (a whole number of vectors).
#[inline(always)]
unsafe fn max8(p: &[f32]) -> f32 {
    let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
    for c in p.chunks_exact(8) {
        m = _mm256_max_ps(m, _mm256_loadu_ps(c.as_ptr()));
    }
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)))
}

/// `p = e^(p - max)` in place (a whole number of vectors); returns the sum.
#[inline(always)]
unsafe fn exp8_sum(p: &mut [f32], max: f32) -> f32 {
    let (m, mut sum) = (_mm256_set1_ps(max), _mm256_setzero_ps());
    for c in p.chunks_exact_mut(8) {
        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m));
        _mm256_storeu_ps(c.as_mut_ptr(), e);
        sum = _mm256_add_ps(sum, e);
    }
    hsum(sum)
}

/// Accumulates `softmax(q·Kᵀ·scale)·V` over key rows `keys` into `out` for the query rows
/// `q` (`[rows, d]`, the first being row `first` of the head's `g·T`), leaving `out`
/// unnormalized and each row's running max and sum in `s` (see [`finish`], [`merge`]).
///
/// # Safety
/// AVX2, FMA and F16C are present, `d % 16 == 0`, `k` and `v` hold `keys.end` rows of `d`,
/// `out` holds as many values as `q`, and an explicit mask covers `t × l`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn accumulate<K: Row8, V: Row8>(
    q: &[f32],
    first: usize,
    k: K,
    v: V,
    d: usize,
    keys: std::ops::Range<usize>,
    vis: Visibility<'_>,
    scale: f32,
    out: &mut [f32],
    s: &mut TileScratch,
) {
    debug_assert!(d.is_multiple_of(16) && q.len().is_multiple_of(d) && out.len() == q.len());
    let rows = q.len() / d;
    s.p.resize(rows * TILE, 0.0);
    s.max.clear();
    s.max.resize(rows, f32::NEG_INFINITY);
    s.sum.clear();
    s.sum.resize(rows, 0.0);
    out.fill(0.0);
    for j0 in keys.clone().step_by(TILE) {
        let n = TILE.min(keys.end - j0);
        let (k, v) = (
            k.for_tile(j0, n, &mut s.k_groups),
            v.for_tile(j0, n, &mut s.v_groups),
        );
        for b0 in (0..rows).step_by(4) {
            let m = (rows - b0).min(4);
            let token = |b: usize| (first + b0 + b) % vis.t;
            // Rows of the tile some query of the block may see.
            let nb = (0..m)
                .map(|b| vis.end(token(b)).saturating_sub(j0).min(n))
                .max()
                .unwrap_or(0);
            if nb == 0 {
                continue;
            }
            let blk = Block {
                b0,
                j0,
                nb,
                d,
                scale,
            };
            // The first block of a tile asks for the V rows as it reads their K rows: the
            // values pass sweeps the V tile column-slice by column-slice, which the hardware
            // prefetcher follows poorly from memory (f16 decode at L = 4096: 15–20% faster).
            let ahead = (b0 == 0).then_some(v);
            match m {
                4 => blk.scores::<4, K, V>(q, k, ahead, &mut s.p),
                3 => blk.scores::<3, K, V>(q, k, ahead, &mut s.p),
                2 => blk.scores::<2, K, V>(q, k, ahead, &mut s.p),
                _ => blk.scores::<1, K, V>(q, k, ahead, &mut s.p),
            }
            let mut any = false;
            // Rows past nb are padded with -inf up to a whole vector (0 after exp).
            let w = nb.next_multiple_of(8);
            for b in 0..m {
                let r = b0 + b;
                let p = &mut s.p[r * TILE..r * TILE + w];
                p[nb..].fill(f32::NEG_INFINITY);
                vis.apply(token(b), j0, &mut p[..nb]);
                let new_max = s.max[r].max(max8(p));
                if new_max == f32::NEG_INFINITY {
                    p.fill(0.0);
                    continue;
                }
                any = true;
                let alpha = fast_exp(s.max[r] - new_max);
                s.sum[r] = s.sum[r] * alpha + exp8_sum(p, new_max);
                s.max[r] = new_max;
                if alpha != 1.0 {
                    let o = _mm256_set1_ps(alpha);
                    for c in (0..d).step_by(8) {
                        let at = out.as_mut_ptr().add(r * d + c);
                        _mm256_storeu_ps(at, _mm256_mul_ps(_mm256_loadu_ps(at), o));
                    }
                }
            }
            if any {
                match m {
                    4 => blk.values::<4, V>(v, &s.p, out),
                    3 => blk.values::<3, V>(v, &s.p, out),
                    2 => blk.values::<2, V>(v, &s.p, out),
                    _ => blk.values::<1, V>(v, &s.p, out),
                }
            }
        }
    }
}

/// Divides each row of `out` (`[rows, d]`) by its softmax sum; a row that saw nothing is 0.
pub fn finish(out: &mut [f32], d: usize, s: &TileScratch) {
    for (o, &sum) in out.chunks_exact_mut(d).zip(&s.sum) {
        match sum {
            0.0 => o.fill(0.0),
            sum => o.iter_mut().for_each(|x| *x /= sum),
        }
    }
}

/// Combines the parts of one head split over key rows (each [`accumulate`]d into its
/// scratch's `part`) into the normalized `out` (`[rows, d]`).
pub fn merge(parts: &[TileScratch], d: usize, out: &mut [f32]) {
    for (r, o) in out.chunks_exact_mut(d).enumerate() {
        let max = parts
            .iter()
            .map(|p| p.max[r])
            .fold(f32::NEG_INFINITY, f32::max);
        o.fill(0.0);
        if max == f32::NEG_INFINITY {
            continue;
        }
        let mut sum = 0.0;
        for p in parts.iter().filter(|p| p.sum[r] > 0.0) {
            let w = fast_exp(p.max[r] - max);
            sum += p.sum[r] * w;
            for (x, &y) in o.iter_mut().zip(&p.part[r * d..(r + 1) * d]) {
                *x += w * y;
            }
        }
        o.iter_mut().for_each(|x| *x /= sum);
    }
}

/// One block of up to 4 query rows over rows `[j0, j0 + nb)` of a tile.
#[derive(Clone, Copy)]
struct Block {
    b0: usize,
    j0: usize,
    nb: usize,
    d: usize,
    scale: f32,
}

impl Block {
    /// Scores of the block's `M` query rows into `p` (`[rows, TILE]`), 2 key rows per pass
    /// over `D` and one horizontal reduction for the 8 dot products; prefetches the same
    /// rows of `ahead` when given.
    #[inline(always)]
    unsafe fn scores<const M: usize, K: Row8, V: Row8>(
        self,
        q: &[f32],
        k: K,
        ahead: Option<V>,
        p: &mut [f32],
    ) {
        let Block {
            b0,
            j0,
            nb,
            d,
            scale,
        } = self;
        let qp = q.as_ptr().add(b0 * d);
        let mut j = 0;
        while j < nb {
            let two = j + 1 < nb;
            let (r0, r1) = (j0 + j, j0 + j + two as usize);
            if let Some(v) = ahead {
                v.prefetch(r0);
                v.prefetch(r1);
            }
            let mut acc = [_mm256_setzero_ps(); 8];
            let gl = k.group_len();
            for g0 in (0..d).step_by(gl) {
                let (gr0, gr1) = (k.group(r0, g0), k.group(r1, g0));
                for c in (g0..g0 + gl).step_by(8) {
                    let (k0, k1) = (k.load8(gr0, r0, c), k.load8(gr1, r1, c));
                    for b in 0..M {
                        let qv = _mm256_loadu_ps(qp.add(b * d + c));
                        acc[b] = _mm256_fmadd_ps(qv, k0, acc[b]);
                        acc[4 + b] = _mm256_fmadd_ps(qv, k1, acc[4 + b]);
                    }
                }
            }
            let mut sums = [0f32; 8];
            _mm256_storeu_ps(
                sums.as_mut_ptr(),
                _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)),
            );
            for b in 0..M {
                p[(b0 + b) * TILE + j] = sums[b];
                if two {
                    p[(b0 + b) * TILE + j + 1] = sums[4 + b];
                }
            }
            j += 2;
        }
    }

    /// `out += p · V` for the block's `M` query rows: 16 values of `D` at a time, every row.
    #[inline(always)]
    unsafe fn values<const M: usize, V: Row8>(self, v: V, p: &[f32], out: &mut [f32]) {
        let Block { b0, j0, nb, d, .. } = self;
        // Both halves of a 16-wide slice in one group, or each in its own.
        let paired = v.group_len().is_multiple_of(16);
        for c in (0..d).step_by(16) {
            let mut acc = [[_mm256_setzero_ps(); 2]; M];
            for jj in 0..nb {
                let r = j0 + jj;
                let gr0 = v.group(r, c);
                let gr1 = if paired { gr0 } else { v.group(r, c + 8) };
                let (v0, v1) = (v.load8(gr0, r, c), v.load8(gr1, r, c + 8));
                for (b, a) in acc.iter_mut().enumerate() {
                    let w = _mm256_set1_ps(*p.get_unchecked((b0 + b) * TILE + jj));
                    a[0] = _mm256_fmadd_ps(w, v0, a[0]);
                    a[1] = _mm256_fmadd_ps(w, v1, a[1]);
                }
            }
            for (b, a) in acc.iter().enumerate() {
                let at = out.as_mut_ptr().add((b0 + b) * d + c);
                _mm256_storeu_ps(at, _mm256_add_ps(_mm256_loadu_ps(at), a[0]));
                let at = at.add(8);
                _mm256_storeu_ps(at, _mm256_add_ps(_mm256_loadu_ps(at), a[1]));
            }
        }
    }
}

/// The tiled views of one KV head's K and V rows.
// Built on the stack once per task and never stored: the quantized variant's group table
// costs nothing to move.
#[allow(clippy::large_enum_variant)]
enum HeadViews {
    F32(Plain<f32>, Plain<f32>),
    F16(Plain<u16>, Plain<u16>),
    Bf16(Bf16Rows, Bf16Rows),
    Quant(QuantRows, QuantRows),
}

impl HeadViews {
    /// Views of `k` and `v`; `None` where the kernel does not apply: no AVX2/FMA/F16C, `d`
    /// not a multiple of 16, quantized groups not a multiple of 8.
    fn new(k: HeadRows<'_>, v: HeadRows<'_>, d: usize) -> Option<Self> {
        use half::slice::HalfFloatSliceExt;
        if !crate::simd::vector_path() || !d.is_multiple_of(16) {
            return None;
        }
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
        Some(match (k, v) {
            (HeadRows::F32(a), HeadRows::F32(b)) => {
                HeadViews::F32(Plain { p: a.as_ptr(), d }, Plain { p: b.as_ptr(), d })
            }
            (HeadRows::F16(a), HeadRows::F16(b)) => {
                HeadViews::F16(bits(a.reinterpret_cast()), bits(b.reinterpret_cast()))
            }
            (HeadRows::Bf16(a), HeadRows::Bf16(b)) => HeadViews::Bf16(
                Bf16Rows(bits(a.reinterpret_cast())),
                Bf16Rows(bits(b.reinterpret_cast())),
            ),
            _ => HeadViews::Quant(quant(k)?, quant(v)?),
        })
    }

    /// [`accumulate`] on these views.
    ///
    /// # Safety
    /// The views hold `keys.end` rows; the rest as [`accumulate`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn accumulate(
        &self,
        q: &[f32],
        first: usize,
        d: usize,
        keys: std::ops::Range<usize>,
        vis: Visibility<'_>,
        scale: f32,
        out: &mut [f32],
        s: &mut TileScratch,
    ) {
        match *self {
            HeadViews::F32(k, v) => accumulate(q, first, k, v, d, keys, vis, scale, out, s),
            HeadViews::F16(k, v) => accumulate(q, first, k, v, d, keys, vis, scale, out, s),
            HeadViews::Bf16(k, v) => accumulate(q, first, k, v, d, keys, vis, scale, out, s),
            HeadViews::Quant(k, v) => accumulate(q, first, k, v, d, keys, vis, scale, out, s),
        }
    }
}

/// Query rows per task when a head's queries are split (prefill): enough rows to reuse
/// each tile, enough tasks to balance causal work over the threads.
const ROWS_PER_TASK: usize = 64;

/// How each head's work is split over tasks.
#[derive(Clone, Copy, PartialEq)]
enum Split {
    /// Query rows, `n` per task, each task normalizing its own rows.
    Queries(usize),
    /// Key rows, `n` per task (a multiple of [`TILE`]), merged after.
    Keys(usize),
}

impl Split {
    /// Whole heads below `parallel_min` multiply-adds; query rows for long query blocks;
    /// key rows otherwise, into the fewest parts that give every participant the same
    /// number of tasks (3 KV heads on 2 threads: 6 parts of half a window).
    fn plan(hkv: usize, rows: usize, l: usize, work: usize, parallel_min: usize) -> Split {
        let participants = Workers::global().participants();
        if work < parallel_min || participants == 1 {
            return Split::Keys(l.max(1));
        }
        if rows >= ROWS_PER_TASK {
            return Split::Queries(ROWS_PER_TASK);
        }
        let mut parts = 1;
        while !(hkv * parts).is_multiple_of(participants) || hkv * parts < participants {
            parts += 1;
        }
        Split::Keys(l.div_ceil(parts).next_multiple_of(TILE))
    }

    /// Tasks per head.
    fn parts(self, rows: usize, l: usize) -> usize {
        match self {
            Split::Queries(n) => rows.div_ceil(n),
            Split::Keys(n) => l.div_ceil(n).max(1),
        }
    }
}

/// `out = softmax(q·kᵀ·scale + mask)·v` over rows `[0, l)` on the tiled kernel, split over
/// the [`Workers`] pool when the call does at least `parallel_min` multiply-adds; q and out
/// are `[Hq, T, D]`. False (nothing done) where the kernel does not apply.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &CpuTensor,
    k: &CpuPool,
    v: &CpuPool,
    l: usize,
    mask: AttendMask<'_>,
    scale: f32,
    out: &mut CpuTensor,
    tiles: &mut Vec<TileScratch>,
    parallel_min: usize,
) -> bool {
    let (hq, t, d) = (q.dims[0], q.dims[1], q.dims[2]);
    let hkv = k.heads;
    let rows = hq / hkv * t;
    let views = |kh: usize| HeadViews::new(k.head_rows(kh, k.cells), v.head_rows(kh, v.cells), d);
    if views(0).is_none() {
        return false;
    }
    let split = Split::plan(hkv, rows, l, hq * t * l * d, parallel_min);
    let parts = split.parts(rows, l);
    tiles.resize_with(hkv * parts, TileScratch::default);
    let vis = Visibility { mask, t, l };
    let outs = DisjointChunks::new(&mut out.data, d);
    let scratch = DisjointChunks::new(tiles, 1);
    let task = |i: usize| {
        let (kh, part) = (i / parts, i % parts);
        let views = views(kh).expect("every head has the dtype of head 0");
        // SAFETY: task i alone holds scratch i and the output rows of its query range.
        let s = unsafe { &mut scratch.get(i)[0] };
        let (first, n, keys) = match split {
            Split::Queries(n) => (part * n, n.min(rows - part * n), 0..l),
            Split::Keys(n) => (0, rows, (part * n).min(l)..((part + 1) * n).min(l)),
        };
        let at = kh * rows + first;
        let qh = &q.data[at * d..(at + n) * d];
        // SAFETY: the views were built for this CPU and hold l rows of d (d % 16 == 0).
        unsafe {
            if parts > 1 && matches!(split, Split::Keys(_)) {
                let mut part = std::mem::take(&mut s.part);
                part.resize(n * d, 0.0);
                views.accumulate(qh, first, d, keys, vis, scale, &mut part, s);
                s.part = part;
            } else {
                let o = outs.span(at, n);
                views.accumulate(qh, first, d, keys, vis, scale, o, s);
                finish(o, d, s);
            }
        }
    };
    if parts * hkv > 1 && hq * t * l * d >= parallel_min {
        Workers::global().run(hkv * parts, &task);
    } else {
        (0..hkv * parts).for_each(task);
    }
    if parts > 1 && matches!(split, Split::Keys(_)) {
        for (kh, o) in out.data.chunks_exact_mut(rows * d).enumerate() {
            merge(&tiles[kh * parts..(kh + 1) * parts], d, o);
        }
    }
    true
}
