//! The tiled attention kernel (AVX2 + FMA + F16C, or AVX-512F registers where the CPU has
//! them). One call takes one KV head, a run of its query rows (`g` heads × `T` tokens, row
//! `r` being token `r % T`) and a range of key rows, in tiles of [`TILE`] rows with an
//! online softmax (flash-attention style): the scratch is `rows × TILE` scores whatever the
//! window, and each K and V row is read from memory once per call for all the query rows
//! that see it.
//!
//! Rows are read in their storage dtype and widened in registers, a register at a time
//! ([`RowView`]: f32, f16, bf16, and q8/q4 with the affine dequantization fused in), never
//! staged as f32 rows. Per block of query rows (`Lanes::BLOCK`: 4 on AVX2, 8 on AVX-512;
//! 8 at both in int8-query calls) and per tile: scores of 2 rows × the block per pass over
//! `D`, then `out += p · V` with the tile's rows swept once per slice of `D` (two registers;
//! four at 512 bits for blocks of up to 4 rows, one at 256 for blocks of more) into
//! register accumulators. Key rows a whole block cannot see (past the
//! causal limit) are skipped. Both widths do the same f32 multiply-adds; only their order of
//! summation differs. In the int8-query arithmetic the scores come from [`int8_query`]
//! instead (at 512-bit width with VNNI, else at 256): each tile's key codes are transposed
//! once, then integer dots give 16 (8) key rows' scores per register.
//!
//! `accumulate` leaves `out` unnormalized with each row's running max and sum: [`attend`]
//! sums every row's keys in chunks of [`KEY_CHUNK`] and [`fold`]s them in order
//! (flash-decoding), or [`finish`]es a single chunk.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use kvplug_backend_kit::AttendMask;
use kvplug_core::arithmetic::QUERY_BLOCK;
use kvplug_core::exp::fast_exp;
use kvplug_core::Arithmetic;

use crate::pool::{CpuPool, HeadRows};
use crate::simd::sink_weight;
use crate::simd::x86::{exp16, exp8, hsum};
use crate::tensor::CpuTensor;
use crate::workers::{DisjointChunks, Workers};

mod i16_values;
mod int8_query;
#[cfg(test)]
mod test_rows;

use i16_values::{values_256, ValueTile};
use int8_query::{KeyTile, QueryCodes};

/// Rows per tile: 64 f16 rows of 128 values (16 KiB) stay in L1 while the tile is swept.
pub const TILE: usize = 64;

/// A view of one head's rows, read a register of values at a time and widened to f32. Rows
/// are read group by group: what the loads of one group share (a quantized row's scale and
/// offset) is fetched once.
pub trait RowView: Copy {
    /// What the loads of one group of a row share.
    type Group: Copy;
    /// Values per group: a multiple of 8 that divides `D` (`D` where rows have no groups).
    fn group_len(&self) -> usize;
    /// The group holding value `c` of row `j`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are present, `c < D`, `j` is a row of the pool and, for grouped
    /// rows, of the tile this view was made for by [`RowView::for_tile`].
    unsafe fn group(&self, j: usize, c: usize) -> Self::Group;
    /// Values `[c, c + 8)` of row `j`, whose group is `gr`.
    ///
    /// # Safety
    /// As [`RowView::group`], and `c + 8 <= D`.
    unsafe fn load8(&self, gr: Self::Group, j: usize, c: usize) -> __m256;
    /// Values `[c, c + 16)` of row `j`, whose group (at least 16 values long) is `gr`.
    ///
    /// # Safety
    /// As [`RowView::group`], AVX-512F is present and `c + 16 <= D`.
    unsafe fn load16(&self, gr: Self::Group, j: usize, c: usize) -> __m512;
    /// Hints that row `j` is read soon (no effect on results). Reads nothing staged, so a
    /// tile's view may prefetch rows of other tiles.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are present and `j` is a row of the pool.
    unsafe fn prefetch(&self, j: usize);
    /// The view that reads rows `[j0, j0 + n)` (one tile), their groups widened once into
    /// `staged` rather than at every load; the view reads `staged`, which must outlive its
    /// use and stay untouched meanwhile. Grouped rows are read only through such a view;
    /// rows without groups return themselves.
    ///
    /// # Safety
    /// As [`RowView::group`] for every row of the tile.
    #[inline(always)]
    unsafe fn for_tile(self, _j0: usize, _n: usize, _staged: &mut Vec<f32>) -> Self {
        self
    }
    /// These rows as affine-quantized ones, when they are.
    #[inline(always)]
    fn as_quant(&self) -> Option<&QuantRows> {
        None
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

/// The [`RowView`] group items of rows without groups.
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

    /// Value `c` of row `j`.
    #[inline(always)]
    unsafe fn at(&self, j: usize, c: usize) -> *const T {
        self.p.add(j * self.d + c)
    }
}

impl RowView for Plain<f32> {
    ungrouped!();
    #[inline(always)]
    unsafe fn prefetch(&self, j: usize) {
        prefetch_bytes(self.at(j, 0), self.d * 4);
    }
    #[inline(always)]
    unsafe fn load8(&self, _: (), j: usize, c: usize) -> __m256 {
        _mm256_loadu_ps(self.at(j, c))
    }
    #[inline(always)]
    unsafe fn load16(&self, _: (), j: usize, c: usize) -> __m512 {
        _mm512_loadu_ps(self.at(j, c))
    }
}

impl RowView for Plain<u16> {
    ungrouped!();
    #[inline(always)]
    unsafe fn prefetch(&self, j: usize) {
        prefetch_bytes(self.at(j, 0), self.d * 2);
    }
    /// f16 bits.
    #[inline(always)]
    unsafe fn load8(&self, _: (), j: usize, c: usize) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(self.at(j, c) as *const __m128i))
    }
    #[inline(always)]
    unsafe fn load16(&self, _: (), j: usize, c: usize) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(self.at(j, c) as *const __m256i))
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

impl RowView for Bf16Rows {
    ungrouped!();
    #[inline(always)]
    unsafe fn prefetch(&self, j: usize) {
        self.0.prefetch(j);
    }
    #[inline(always)]
    unsafe fn load8(&self, _: (), j: usize, c: usize) -> __m256 {
        let h = _mm_loadu_si128(self.0.at(j, c) as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    }
    #[inline(always)]
    unsafe fn load16(&self, _: (), j: usize, c: usize) -> __m512 {
        let h = _mm256_loadu_si256(self.0.at(j, c) as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
    }
}

/// Affine-quantized rows (see `crate::pool::Storage::Quant`): `bits` 8 or 4, groups a
/// multiple of 8 values, so one f16 scale and offset (widened once per group and tile row
/// by [`RowView::for_tile`]) cover each load.
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
    /// Set by [`RowView::for_tile`]: the tile's first row, and its groups' scales and
    /// offsets widened to f32 pairs, `[row - tile_row][group]`.
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

    /// Hints that rows `[j, j + n)` are read soon: one hint per cache line of their codes,
    /// scales and offsets (contiguous runs; no effect on results).
    #[inline(always)]
    pub(super) unsafe fn prefetch_rows(&self, j: usize, n: usize) {
        prefetch_bytes(
            self.codes.add(j * self.d * self.bits / 8),
            n * self.d * self.bits / 8,
        );
        prefetch_bytes(self.scales.add(j * self.ng), n * self.ng * 2);
        prefetch_bytes(self.los.add(j * self.ng), n * self.ng * 2);
    }

    /// Hints that row `j` is read soon: the cache lines of its codes, and of its group scales
    /// and offsets where the row holds the start of a run of 32 of them (a line from a
    /// 64-byte-aligned start), so that rows asked in order ask for each such run once (no
    /// effect on results).
    #[inline(always)]
    pub(super) unsafe fn prefetch_ahead(&self, j: usize) {
        let bytes = self.d * self.bits / 8;
        prefetch_bytes(self.codes.add(j * bytes), bytes);
        let run = (j * self.ng).next_multiple_of(32);
        if run < (j + 1) * self.ng {
            _mm_prefetch::<_MM_HINT_T0>(self.scales.add(run) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(self.los.add(run) as *const i8);
        }
    }

    /// The codes of values `[c, c + n)` of row `j` (`n` 8 or 16), one byte each.
    #[inline(always)]
    unsafe fn codes(&self, j: usize, c: usize, n: usize) -> __m128i {
        let at = j * self.d + c;
        if self.bits == 8 {
            let at = self.codes.add(at) as *const __m128i;
            return if n == 8 {
                _mm_loadl_epi64(at)
            } else {
                _mm_loadu_si128(at)
            };
        }
        // n / 2 bytes, two values each, low nibble first.
        let at = self.codes.add(at / 2);
        let packed = if n == 8 {
            _mm_cvtsi32_si128((at as *const i32).read_unaligned())
        } else {
            _mm_loadl_epi64(at as *const __m128i)
        };
        let lo = _mm_and_si128(packed, _mm_set1_epi8(0xf));
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(packed), _mm_set1_epi8(0xf));
        _mm_unpacklo_epi8(lo, hi)
    }
}

impl RowView for QuantRows {
    /// The group's widened (scale, offset) pair in the tile's staging.
    type Group = *const f32;

    #[inline(always)]
    fn as_quant(&self) -> Option<&QuantRows> {
        Some(self)
    }

    #[inline(always)]
    fn group_len(&self) -> usize {
        self.group
    }

    #[inline(always)]
    unsafe fn group(&self, j: usize, c: usize) -> Self::Group {
        let g = *self.chunk_group.get_unchecked(c / 8) as usize;
        self.staged.add(((j - self.tile_row) * self.ng + g) * 2)
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
        self.prefetch_rows(j, 1);
    }

    #[inline(always)]
    unsafe fn load8(&self, gr: Self::Group, j: usize, c: usize) -> __m256 {
        let x = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(self.codes(j, c, 8)));
        _mm256_fmadd_ps(
            x,
            _mm256_broadcast_ss(&*gr),
            _mm256_broadcast_ss(&*gr.add(1)),
        )
    }

    #[inline(always)]
    unsafe fn load16(&self, gr: Self::Group, j: usize, c: usize) -> __m512 {
        let x = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(self.codes(j, c, 16)));
        _mm512_fmadd_ps(x, _mm512_set1_ps(*gr), _mm512_set1_ps(*gr.add(1)))
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
                // Most tiles are seen whole (a shared trunk under forks or a tree).
                if all_seen(row) {
                    return;
                }
                for (x, &seen) in p.iter_mut().zip(row) {
                    if !seen {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
}

/// Whether every entry of `row` is true, 8 at a time.
#[inline(always)]
fn all_seen(row: &[bool]) -> bool {
    // SAFETY: a bool is one byte holding 0 or 1.
    let bytes = unsafe { std::slice::from_raw_parts(row.as_ptr().cast::<u8>(), row.len()) };
    let (words, rest) = bytes.as_chunks::<8>();
    words.iter().fold(true, |all, w| {
        all & (u64::from_ne_bytes(*w) == 0x0101_0101_0101_0101)
    }) && rest.iter().all(|&b| b == 1)
}

/// One key chunk's partial softmax for a task's query rows: their unnormalized outputs
/// (`[rows, D]`), each row's max and sum.
#[derive(Default)]
struct Partial {
    out: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
}

/// Tile scores and running softmax state of one task, reused across steps.
#[derive(Default)]
pub struct TileScratch {
    /// `[rows, TILE]` scores, then weights.
    p: Vec<f32>,
    /// Running max and sum per query row.
    max: Vec<f32>,
    sum: Vec<f32>,
    /// The partial softmaxes of the key chunks this task computed for a fold after it (a
    /// head's keys split over tasks: the first `kept`), else the chunk it is folding.
    chunks: Vec<Partial>,
    kept: usize,
    /// The running max and sum of the rows whose chunks this task folds ([`fold`]).
    fold_max: Vec<f32>,
    fold_sum: Vec<f32>,
    /// The tile's K and V groups (see [`RowView::for_tile`]).
    k_groups: Vec<f32>,
    v_groups: Vec<f32>,
    /// The part's query rows in int8 and the tile's keys staged for them (int8-query
    /// calls only).
    query: QueryCodes,
    keys: KeyTile,
    /// The tile's values staged for the integer value sum (int8-query-i16-values calls).
    values: ValueTile,
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

/// A register width the kernel runs at: [`Avx2`] (8 f32 lanes) or [`Avx512`] (16).
///
/// # Safety
/// Every item is called only where the width's features are present, with pointers that
/// hold `N` values (and, for [`Lanes::block`], the contract of [`accumulate`]).
trait Lanes {
    /// A register of `N` f32 values.
    type V: Copy;
    /// f32 values per register.
    const N: usize;
    /// Query rows per block: what the scores' and values' accumulators leave of the
    /// register file (16 ymm; 32 zmm).
    const BLOCK: usize;
    /// Query rows per block in int8-query calls: 8 at both widths (the integer scores take
    /// 4 rows at a time at 256 bits, the values pass one register per slice there), so
    /// that each V row of a tile is widened once for up to 8 rows (GQA groups of up to 8).
    const INT8_BLOCK: usize = 8;
    unsafe fn zero() -> Self::V;
    unsafe fn set1(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    /// `*p += v`.
    unsafe fn add_to(p: *mut f32, v: Self::V);
    unsafe fn fmadd(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// Values `[c, c + N)` of row `j` of `rows`.
    unsafe fn row<R: RowView>(rows: &R, gr: R::Group, j: usize, c: usize) -> Self::V;
    /// `out[i] = scale · Σ lanes of slot i` for the slots `i < n` (`n` a constant of the
    /// caller, at most 16), slot `i` being `acc[i / 8][i % 8]`.
    unsafe fn sums(acc: [[Self::V; 8]; 2], n: usize, scale: f32, out: &mut [f32; 16]);
    /// The largest of `p` (a whole number of registers).
    unsafe fn max(p: &[f32]) -> f32;
    /// `p = e^(p - max)` in place (a whole number of registers); returns the sum.
    unsafe fn exp_sum(p: &mut [f32], max: f32) -> f32;
    /// [`Block::run`] at this width, compiled on its own (its registers allocated apart
    /// from the other block sizes').
    #[allow(clippy::too_many_arguments)]
    unsafe fn block<const M: usize, K: RowView, V: RowView>(
        blk: Block<'_>,
        q: &[f32],
        k: K,
        v: V,
        ahead: Option<(K, V)>,
        out: &mut [f32],
        s: &mut TileScratch,
    ) -> bool;
    /// Stages `kt` at this width for [`Lanes::int8_scores`] (see [`KeyTile::stage_avx512`]).
    unsafe fn stage_keys(
        kt: &mut KeyTile,
        k: &QuantRows,
        v: &QuantRows,
        j0: usize,
        n: usize,
        kend: usize,
        ask: bool,
    );
    /// `out += p · V` in the int8-query-i16-values arithmetic (see
    /// [`i16_values::values_avx512`]), `v` holding the tile's rows.
    unsafe fn i16_values<const M: usize>(
        blk: &Block<'_>,
        vt: &ValueTile,
        v: &QuantRows,
        p: &[f32],
        out: &mut [f32],
    );
    /// The int8-query scores at this width (see [`int8_query::scores_avx512`]).
    unsafe fn int8_scores<const M: usize>(
        blk: &Block<'_>,
        qc: &QueryCodes,
        kt: &KeyTile,
        p: &mut [f32],
    );
    /// [`accumulate`] at this width.
    unsafe fn accumulate<K: RowView, V: RowView>(
        part: Part<'_>,
        k: K,
        v: V,
        out: &mut [f32],
        s: &mut TileScratch,
    );
}

/// Implements [`Lanes`] for `$width` from its intrinsics; `$own` are its `sums`, `max` and
/// `exp_sum`.
macro_rules! lanes {
    ($width:ident, $v:ty, $n:literal, $block:literal, $features:literal, $row:ident,
     $zero:ident, $set1:ident, $load:ident, $store:ident, $add:ident, $fmadd:ident,
     $stage:ident, $int8_scores:ident, $i16_values:ident,
     $($own:item),+ $(,)?) => {
        impl Lanes for $width {
            type V = $v;
            const N: usize = $n;
            const BLOCK: usize = $block;
            #[inline(always)]
            unsafe fn zero() -> $v {
                $zero()
            }
            #[inline(always)]
            unsafe fn set1(x: f32) -> $v {
                $set1(x)
            }
            #[inline(always)]
            unsafe fn load(p: *const f32) -> $v {
                $load(p)
            }
            #[inline(always)]
            unsafe fn add_to(p: *mut f32, v: $v) {
                $store(p, $add($load(p), v));
            }
            #[inline(always)]
            unsafe fn fmadd(a: $v, b: $v, c: $v) -> $v {
                $fmadd(a, b, c)
            }
            #[inline(always)]
            unsafe fn row<R: RowView>(rows: &R, gr: R::Group, j: usize, c: usize) -> $v {
                rows.$row(gr, j, c)
            }
            #[inline(always)]
            unsafe fn stage_keys(
                kt: &mut KeyTile,
                k: &QuantRows,
                v: &QuantRows,
                j0: usize,
                n: usize,
                kend: usize,
                ask: bool,
            ) {
                kt.$stage(k, v, j0, n, kend, ask)
            }
            #[inline(always)]
            unsafe fn int8_scores<const M: usize>(
                blk: &Block<'_>,
                qc: &QueryCodes,
                kt: &KeyTile,
                p: &mut [f32],
            ) {
                int8_query::$int8_scores::<M>(blk, qc, kt, p)
            }
            #[inline(always)]
            unsafe fn i16_values<const M: usize>(
                blk: &Block<'_>,
                vt: &ValueTile,
                v: &QuantRows,
                p: &[f32],
                out: &mut [f32],
            ) {
                $i16_values::<M>(blk, vt, v, p, out)
            }
            $($own)*
            #[inline(never)]
            #[target_feature(enable = $features)]
            unsafe fn block<const M: usize, K: RowView, V: RowView>(
                blk: Block<'_>,
                q: &[f32],
                k: K,
                v: V,
                ahead: Option<(K, V)>,
                out: &mut [f32],
                s: &mut TileScratch,
            ) -> bool {
                blk.run::<Self, M, K, V>(q, k, v, ahead, out, s)
            }
            #[target_feature(enable = $features)]
            unsafe fn accumulate<K: RowView, V: RowView>(
                part: Part<'_>,
                k: K,
                v: V,
                out: &mut [f32],
                s: &mut TileScratch,
            ) {
                accumulate::<Self, K, V>(part, k, v, out, s)
            }
        }
    };
}

/// 256-bit registers (AVX2 + FMA + F16C).
struct Avx2;

lanes!(
    Avx2,
    __m256,
    8,
    4,
    "avx2,fma,f16c",
    load8,
    _mm256_setzero_ps,
    _mm256_set1_ps,
    _mm256_loadu_ps,
    _mm256_storeu_ps,
    _mm256_add_ps,
    _mm256_fmadd_ps,
    stage_avx2,
    scores_avx2,
    values_256,
    #[inline(always)]
    unsafe fn sums(acc: [[__m256; 8]; 2], n: usize, scale: f32, out: &mut [f32; 16]) {
        for (i, a) in acc.into_iter().enumerate() {
            if 8 * i < n {
                let sums = _mm256_mul_ps(hsum8(a), _mm256_set1_ps(scale));
                _mm256_storeu_ps(out.as_mut_ptr().add(8 * i), sums);
            }
        }
    },
    #[inline(always)]
    unsafe fn max(p: &[f32]) -> f32 {
        max8(p)
    },
    #[inline(always)]
    unsafe fn exp_sum(p: &mut [f32], max: f32) -> f32 {
        exp8_sum(p, max)
    }
);

/// 512-bit registers (AVX-512F, with the AVX2 set).
struct Avx512;

lanes!(
    Avx512,
    __m512,
    16,
    8,
    "avx512f,avx2,fma,f16c",
    load16,
    _mm512_setzero_ps,
    _mm512_set1_ps,
    _mm512_loadu_ps,
    _mm512_storeu_ps,
    _mm512_add_ps,
    _mm512_fmadd_ps,
    // Need AVX-512 VNNI too, which `attend` checks before it asks for int8 scores (and
    // VBMI for the values from the pool's codes, which `accumulate` checks).
    stage_avx512,
    scores_avx512,
    i16_values_avx512,
    /// A tree of 512-bit shuffles and adds (15 merges of two registers for 16 slots, 7
    /// for 8), all EVEX-encoded: the accumulators may live in any of the 32 registers.
    #[inline(always)]
    unsafe fn sums(acc: [[__m512; 8]; 2], n: usize, scale: f32, out: &mut [f32; 16]) {
        use merge512::*;
        let [a, b] = acc;
        // Chunk c of q(m) sums slot 4m + c; after `pairs` and `quads`, lane 4c + r of the
        // result holds slot 4r + c.
        let q0 = chunks(halves(a[0], a[1]), halves(a[2], a[3]));
        let q1 = chunks(halves(a[4], a[5]), halves(a[6], a[7]));
        let total = if n > 8 {
            let q2 = chunks(halves(b[0], b[1]), halves(b[2], b[3]));
            let q3 = chunks(halves(b[4], b[5]), halves(b[6], b[7]));
            quads(pairs(q0, q1), pairs(q2, q3))
        } else {
            let e = pairs(q0, q1);
            quads(e, e)
        };
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);

        let total = _mm512_mul_ps(_mm512_permutexvar_ps(order, total), _mm512_set1_ps(scale));
        _mm512_storeu_ps(out.as_mut_ptr(), total);
    },
    #[inline(always)]
    unsafe fn max(p: &[f32]) -> f32 {
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        for c in p.chunks_exact(16) {
            m = _mm512_max_ps(m, _mm512_loadu_ps(c.as_ptr()));
        }
        _mm512_reduce_max_ps(m)
    },
    #[inline(always)]
    unsafe fn exp_sum(p: &mut [f32], max: f32) -> f32 {
        let (m, mut sum) = (_mm512_set1_ps(max), _mm512_setzero_ps());
        for c in p.chunks_exact_mut(16) {
            let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), m));
            _mm512_storeu_ps(c.as_mut_ptr(), e);
            sum = _mm512_add_ps(sum, e);
        }
        _mm512_reduce_add_ps(sum)
    }
);

/// [`i16_values::values_avx512`] on a tile [`ValueTile::stage`] staged, else
/// [`i16_values::values_vbmi`].
#[inline(always)]
unsafe fn i16_values_avx512<const M: usize>(
    blk: &Block<'_>,
    vt: &ValueTile,
    v: &QuantRows,
    p: &[f32],
    out: &mut [f32],
) {
    match vt.has_pairs() {
        true => i16_values::values_avx512::<M>(blk, vt, v, p, out),
        false => {
            debug_assert!(crate::simd::vbmi_path(), "only a VBMI CPU skips the pairs");
            i16_values::values_vbmi::<M>(blk, vt, v, p, out)
        }
    }
}

/// The merges of [`Avx512::sums`]: each adds two shuffles of `a` and `b`, leaving one
/// register that holds the partial sums of both.
mod merge512 {
    use std::arch::x86_64::*;

    /// 128-bit chunks `[a0+a2, a1+a3, b0+b2, b1+b3]`.
    #[inline(always)]
    pub unsafe fn halves(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
        )
    }

    /// Of two [`halves`] results: chunks `[Σa, Σb, Σc, Σd]` (each still 4 lanes wide).
    #[inline(always)]
    pub unsafe fn chunks(x: __m512, y: __m512) -> __m512 {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
        )
    }

    /// Per chunk, `[a0+a2, b0+b2, a1+a3, b1+b3]`.
    #[inline(always)]
    pub unsafe fn pairs(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b))
    }

    /// Of two [`pairs`] results, per chunk: `[a0+a2, a1+a3, b0+b2, b1+b3]`.
    #[inline(always)]
    pub unsafe fn quads(a: __m512, b: __m512) -> __m512 {
        let (a, b) = (_mm512_castps_pd(a), _mm512_castps_pd(b));
        _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
        )
    }
}

/// Which register width a call runs at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Width {
    /// 256-bit registers (AVX2 + FMA + F16C).
    Avx2,
    /// 512-bit registers (AVX-512F): `D` a multiple of 32 and quantized groups a multiple
    /// of 16 values.
    Avx512,
}

/// What one [`accumulate`] call computes: query rows `q` (`[rows, d]`, the first being row
/// `first` of the head's `g·T`) over key rows `keys`.
#[derive(Clone)]
struct Part<'a> {
    q: &'a [f32],
    first: usize,
    d: usize,
    keys: std::ops::Range<usize>,
    /// Rows the views hold (at least `keys.end`): tiles ask for the K rows ahead up to here,
    /// so a key chunk's last tile asks for the next chunk's first.
    held: usize,
    vis: Visibility<'a>,
    scale: f32,
    /// Scores in the int8-query arithmetic ([`int8_query`]): set only for quantized keys in
    /// groups of a multiple of 32, `d` a multiple of 64 and, at 512-bit width, a CPU with
    /// VNNI.
    int8: bool,
    /// And the values summed in i16 weight codes ([`i16_values`]; only with `int8`).
    i16: bool,
    /// The scratch's query codes are already these rows' (a later key chunk of the task).
    quantized: bool,
}

/// Accumulates `softmax(q·Kᵀ·scale)·V` for `part` into `out`, leaving `out` unnormalized and
/// each row's running max and sum in `s` (see [`finish`], [`fold`]).
///
/// # Safety
/// `L`'s features are present, `d` is a multiple of `2·L::N` (and grouped rows' groups of
/// `L::N` values), `k` and `v` hold `held` rows of `d`, `out` holds as many values as
/// `q`, and an explicit mask covers `t × l`.
#[inline(always)]
unsafe fn accumulate<L: Lanes, K: RowView, V: RowView>(
    part: Part<'_>,
    k: K,
    v: V,
    out: &mut [f32],
    s: &mut TileScratch,
) {
    let Part {
        q,
        first,
        d,
        keys,
        held,
        vis,
        scale,
        int8,
        i16,
        quantized,
    } = part;
    debug_assert!(d.is_multiple_of(2 * L::N) && q.len().is_multiple_of(d));
    debug_assert!(out.len() == q.len());
    let rows = q.len() / d;
    s.p.resize(rows * TILE, 0.0);
    s.max.clear();
    s.max.resize(rows, f32::NEG_INFINITY);
    s.sum.clear();
    s.sum.resize(rows, 0.0);
    out.fill(0.0);
    let (mut query, mut ktile) = (std::mem::take(&mut s.query), std::mem::take(&mut s.keys));
    let mut vtile = std::mem::take(&mut s.values);
    let dot = crate::simd::dot256();
    (ktile.dot, vtile.dot) = (dot, dot);
    if let Some(kq) = k.as_quant().filter(|_| int8 && !quantized) {
        query.quantize(q, d, kq.group, kq.bits == 4);
    }
    // With VBMI and at most two blocks of rows the 512-bit value sums read the codes from
    // the pool (`i16_values::values_vbmi`), each block permuting them anew, rather than
    // staging them once per tile. At L = 4096, one thread, interleaved against staging: a
    // 4-branch fork step (2 blocks) 2102–2316 against 2268–2445 µs; a 16-node tree verify
    // (8 blocks) 6696–6936 against 6302–6385 µs, so more blocks stage.
    let vbmi = i16 && L::N == 16 && rows <= 2 * L::INT8_BLOCK && crate::simd::vbmi_path();
    // Whether the last tile's value sum asked for all of this tile's K and V rows
    // (`asks_ahead`); else the staging asks for this tile's V rows and the next tile's K rows.
    let mut asked = false;
    for j0 in keys.clone().step_by(TILE) {
        let n = TILE.min(keys.end - j0);
        let (k, v) = (
            k.for_tile(j0, n, &mut s.k_groups),
            v.for_tile(j0, n, &mut s.v_groups),
        );
        if let Some(kq) = k.as_quant().filter(|_| int8) {
            // A pool's K and V share its dtype.
            let vq = v
                .as_quant()
                .expect("quantized keys come with quantized values");
            L::stage_keys(&mut ktile, kq, vq, j0, n, held, !asked);
            match (i16, vbmi) {
                (true, true) => vtile.stage_scales(vq, n),
                (true, false) => vtile.stage(vq, j0, n),
                _ => {}
            }
        }
        let block = if int8 { L::INT8_BLOCK } else { L::BLOCK };
        asked = false;
        for b0 in (0..rows).step_by(block) {
            let m = (rows - b0).min(block);
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
                first,
                vis,
                int8: int8.then_some((&query, &ktile)),
                i16: i16.then_some(&vtile),
                kend: held,
            };
            // The first block of a tile asks for the V rows as it reads their K rows: the
            // values pass sweeps the V tile column-slice by column-slice, which the hardware
            // prefetcher follows poorly from memory (f16 decode at L = 4096: 15–20% faster).
            // It asks for the next tile's K rows too, which the scores otherwise wait on
            // (examples/decode_attention, Qwen2.5-0.5B's shape at L = 4096: 7–9% faster).
            // In int8-query calls only the values use `ahead`, where the part is one block
            // of rows (a decode step): a block past the first may see rows the first did not.
            let ahead = (b0 == 0 && !(int8 && rows > block)).then_some((k, v));
            let asked_next = match m {
                8 => L::block::<8, K, V>(blk, q, k, v, ahead, out, s),
                7 => L::block::<7, K, V>(blk, q, k, v, ahead, out, s),
                6 => L::block::<6, K, V>(blk, q, k, v, ahead, out, s),
                5 => L::block::<5, K, V>(blk, q, k, v, ahead, out, s),
                4 => L::block::<4, K, V>(blk, q, k, v, ahead, out, s),
                3 => L::block::<3, K, V>(blk, q, k, v, ahead, out, s),
                2 => L::block::<2, K, V>(blk, q, k, v, ahead, out, s),
                _ => L::block::<1, K, V>(blk, q, k, v, ahead, out, s),
            };
            // A value sum over part of the tile asked for the same part of the next one.
            asked |= asked_next && nb == n;
        }
    }
    (s.query, s.keys, s.values) = (query, ktile, vtile);
}

/// Divides each row of `out` (`[rows, d]`) by its softmax sum (`sum`, the row's max in
/// `max`), plus its sink's weight (`sink(r)` for row `r`); a row that saw nothing is 0.
fn finish(
    out: &mut [f32],
    d: usize,
    sum: &[f32],
    max: &[f32],
    sink: impl Fn(usize) -> Option<f32>,
) {
    let rows = out.chunks_exact_mut(d).zip(sum.iter().zip(max));
    for (r, (o, (&sum, &max))) in rows.enumerate() {
        match sum {
            0.0 => o.fill(0.0),
            sum => {
                let sum = sum + sink_weight(sink(r), max);
                o.iter_mut().for_each(|x| *x /= sum)
            }
        }
    }
}

/// Folds the partial softmax of one key chunk (`part`) into the running one (`out`, `max`,
/// `sum`; begun at 0, −∞ and 0). Chunks fold in key order with these same operations
/// wherever a row's chunks were computed (see [`KEY_CHUNK`]); the first a row sees is
/// copied, so a row within one chunk gets the unsplit kernel's bits.
fn fold(out: &mut [f32], max: &mut [f32], sum: &mut [f32], part: &Partial, d: usize) {
    let (pmax, psum) = (&part.max, &part.sum);
    let rows = out.chunks_exact_mut(d).zip(part.out.chunks_exact(d));
    for (r, (o, p)) in rows.enumerate() {
        if psum[r] == 0.0 {
            // The row sees none of the chunk's keys.
            continue;
        }
        if sum[r] == 0.0 {
            o.copy_from_slice(p);
            (max[r], sum[r]) = (pmax[r], psum[r]);
            continue;
        }
        let m = max[r].max(pmax[r]);
        let (a, b) = (fast_exp(max[r] - m), fast_exp(pmax[r] - m));
        sum[r] = sum[r] * a + psum[r] * b;
        for (x, &y) in o.iter_mut().zip(p) {
            *x = *x * a + y * b;
        }
        max[r] = m;
    }
}

/// One block of query rows (rows `first + b0 ..` of the head) over rows `[j0, j0 + nb)` of
/// a tile.
#[derive(Clone, Copy)]
struct Block<'a> {
    b0: usize,
    j0: usize,
    nb: usize,
    d: usize,
    scale: f32,
    first: usize,
    vis: Visibility<'a>,
    /// The part's query rows in int8 and the tile's keys staged for them, where the scores
    /// use them.
    int8: Option<(&'a QueryCodes, &'a KeyTile)>,
    /// The tile's values staged for the integer value sum, where it is used.
    i16: Option<&'a ValueTile>,
    /// The rows the views hold (the call's window): prefetches stop there.
    kend: usize,
}

impl Block<'_> {
    /// The block's `M` query rows through one tile: scores, the online softmax's update of
    /// each row's max, sum and output, then `out += p · V`. True where the value sum asked
    /// for the next tile's K and V rows (`ahead` given, [`asks_ahead`]).
    #[inline(always)]
    unsafe fn run<L: Lanes, const M: usize, K: RowView, V: RowView>(
        self,
        q: &[f32],
        k: K,
        v: V,
        ahead: Option<(K, V)>,
        out: &mut [f32],
        s: &mut TileScratch,
    ) -> bool {
        let Block { b0, nb, d, .. } = self;
        match self.int8 {
            // SAFETY: `int8` is set only where the int8 kernel's contract holds; the tile's
            // staging or the last tile's value sum asked for its K and V rows (`asks_ahead`).
            Some((qc, kt)) => L::int8_scores::<M>(&self, qc, kt, &mut s.p),
            None => self.scores::<L, M, K, V>(q, k, ahead, &mut s.p),
        }
        let mut any = false;
        // Rows past nb are padded with -inf up to a whole register (0 after exp).
        let w = nb.next_multiple_of(L::N);
        for b in 0..M {
            let r = b0 + b;
            let p = &mut s.p[r * TILE..r * TILE + w];
            p[nb..].fill(f32::NEG_INFINITY);
            self.vis
                .apply((self.first + r) % self.vis.t, self.j0, &mut p[..nb]);
            let old = s.max[r];
            let new_max = old.max(L::max(p));
            if new_max == f32::NEG_INFINITY {
                p.fill(0.0);
                continue;
            }
            any = true;
            // Where the max holds, the rescale is by e^0 = 1 exactly: skipped (mostly
            // after the first tiles), not computed.
            if new_max > old {
                let alpha = fast_exp(old - new_max);
                s.sum[r] *= alpha;
                if alpha != 1.0 {
                    let o = _mm256_set1_ps(alpha);
                    for c in (0..d).step_by(8) {
                        let at = out.as_mut_ptr().add(r * d + c);
                        _mm256_storeu_ps(at, _mm256_mul_ps(_mm256_loadu_ps(at), o));
                    }
                }
            }
            s.sum[r] += L::exp_sum(p, new_max);
            s.max[r] = new_max;
        }
        match self.i16 {
            // SAFETY: `i16` is set only with `int8`, whose width contract it shares (and
            // `vt` skipped the pairs only where `accumulate` found VBMI); the tile's rows
            // past `nb` hold weight 0, and `v` holds its rows for the sums that read them.
            Some(vt) if any => {
                let vq = v.as_quant().expect("i16 values are quantized");
                L::i16_values::<M>(&self, vt, vq, &s.p, out);
                false
            }
            _ if any => {
                let ahead = ahead
                    .filter(|_| self.int8.is_some() && v.as_quant().is_some_and(asks_ahead::<L>));
                self.values::<L, M, K, V>(v, ahead, &s.p, out);
                ahead.is_some()
            }
            _ => false,
        }
    }

    /// Scores of the block's `M` query rows into `p` (`[rows, TILE]`), 2 key rows per pass
    /// over `D` and one horizontal reduction per 8 dot products; prefetches as
    /// [`Block::score_pairs`] does when `ahead` is given. The common head sizes are
    /// constants here, so that the pass over `D` unrolls (examples/decode_attention,
    /// Qwen2.5's D = 64 at L = 4096, fastest of 4 interleaved runs: f16 7%, q8 3%, q4 16%
    /// faster; edited to Hq 32 / Hkv 8 / D = 128 at L = 2048, memory-bound: 2–3%). The
    /// values' pass stays a loop: unrolled it holds more accumulators than there are
    /// registers (5% slower at D = 64).
    #[inline(always)]
    unsafe fn scores<L: Lanes, const M: usize, K: RowView, V: RowView>(
        self,
        q: &[f32],
        k: K,
        ahead: Option<(K, V)>,
        p: &mut [f32],
    ) {
        match self.d {
            64 => self.scores_d::<L, M, K, V>(64, q, k, ahead, p),
            128 => self.scores_d::<L, M, K, V>(128, q, k, ahead, p),
            d => self.scores_d::<L, M, K, V>(d, q, k, ahead, p),
        }
    }

    /// [`Block::scores`] with the head size `d` as the caller gives it.
    #[inline(always)]
    unsafe fn scores_d<L: Lanes, const M: usize, K: RowView, V: RowView>(
        self,
        d: usize,
        q: &[f32],
        k: K,
        ahead: Option<(K, V)>,
        p: &mut [f32],
    ) {
        let qp = q.as_ptr().add(self.b0 * d);
        self.score_pairs::<L, M, K, V>(
            ahead,
            p,
            // Outlined, the closure would lose the caller's target features and call each
            // intrinsic (measured 20× slower).
            #[inline(always)]
            |r0, r1, acc| {
                let gl = k.group_len();
                for g0 in (0..d).step_by(gl) {
                    let (gr0, gr1) = (k.group(r0, g0), k.group(r1, g0));
                    for c in (g0..g0 + gl).step_by(L::N) {
                        let (k0, k1) = (L::row(&k, gr0, r0, c), L::row(&k, gr1, r1, c));
                        for b in 0..M {
                            let qv = L::load(qp.add(b * d + c));
                            let (x, y) = (b, M + b);
                            acc[x / 8][x % 8] = L::fmadd(qv, k0, acc[x / 8][x % 8]);
                            acc[y / 8][y % 8] = L::fmadd(qv, k1, acc[y / 8][y % 8]);
                        }
                    }
                }
            },
        );
    }

    /// The pass structure of the scores: for key rows `r0, r1` of the tile (`r1 = r0` for
    /// an odd last row), `dots` accumulates query `b`'s dot with row `r0` into slot `b` and
    /// with row `r1` into slot `M + b` (slot `i` is `acc[i / 8][i % 8]`, zeroed); the slots
    /// reduce at once, times the scale, into `p`. Prefetches the V rows of `ahead` and its
    /// K rows one tile further, up to the part's last key row.
    #[inline(always)]
    unsafe fn score_pairs<L: Lanes, const M: usize, K: RowView, V: RowView>(
        self,
        ahead: Option<(K, V)>,
        p: &mut [f32],
        mut dots: impl FnMut(usize, usize, &mut [[L::V; 8]; 2]),
    ) {
        let Block {
            b0, j0, nb, scale, ..
        } = self;
        let mut j = 0;
        while j < nb {
            let two = j + 1 < nb;
            let (r0, r1) = (j0 + j, j0 + j + two as usize);
            if let Some((k, v)) = ahead {
                v.prefetch(r0);
                v.prefetch(r1);
                for r in [r0 + TILE, r1 + TILE]
                    .into_iter()
                    .filter(|&r| r < self.kend)
                {
                    k.prefetch(r);
                }
            }
            let mut acc = [[L::zero(); 8]; 2];
            dots(r0, r1, &mut acc);
            let mut sums = [0f32; 16];
            L::sums(acc, 2 * M, scale, &mut sums);
            for b in 0..M {
                p[(b0 + b) * TILE + j] = sums[b];
                if two {
                    p[(b0 + b) * TILE + j + 1] = sums[M + b];
                }
            }
            j += 2;
        }
    }

    /// `out += p · V` for the block's `M` query rows: a slice of `D` at a time through every
    /// row, four registers wide where the accumulators fit (512-bit, up to 4 rows: half the
    /// passes over the tile, q8 decode at L = 4096 measured ~10% faster), one where two
    /// would not (256-bit, more than 4 rows), else two.
    #[inline(always)]
    unsafe fn values<L: Lanes, const M: usize, K: RowView, V: RowView>(
        self,
        v: V,
        ahead: Option<(K, V)>,
        p: &[f32],
        out: &mut [f32],
    ) {
        if L::N == 16 && M <= 4 && self.d.is_multiple_of(4 * L::N) {
            self.values_in::<L, M, K, V, 4>(v, ahead, p, out)
        } else if L::N == 8 && M > 4 {
            self.values_in::<L, M, K, V, 1>(v, ahead, p, out)
        } else {
            self.values_in::<L, M, K, V, 2>(v, ahead, p, out)
        }
    }

    /// [`Block::values`] in slices of `S` registers.
    #[inline(always)]
    unsafe fn values_in<L: Lanes, const M: usize, K: RowView, V: RowView, const S: usize>(
        self,
        v: V,
        ahead: Option<(K, V)>,
        p: &[f32],
        out: &mut [f32],
    ) {
        // At 256 bits the loop is compiled apart for q8 rows, so that the code width's test
        // in `QuantRows::codes` folds away: in the loop it left LLVM 8 rows' accumulators in
        // rotating registers with one on the stack, a store-to-load chain every key row. At
        // KVPLUG_CPU_ISA=avx2, Zen 4, one thread, q8 at L = 4096 (examples/step_ratios,
        // interleaved): a 4-branch fork step 5990–6444 → 3766–3842 µs, a 16-node tree
        // verify 22720–23049 → 14009–14161 µs, prefilling its three 4,096-token caches
        // 8.8–9.3 → 5.9–6.1 s. At 512 bits (no spill) the split measured nothing.
        match v.as_quant().map(|q| q.bits) {
            Some(8) if L::N == 8 => self.values_loop::<L, M, K, V, S>(v, ahead, p, out),
            _ => self.values_loop::<L, M, K, V, S>(v, ahead, p, out),
        }
    }

    /// [`Block::values_in`]'s loop.
    #[inline(always)]
    unsafe fn values_loop<L: Lanes, const M: usize, K: RowView, V: RowView, const S: usize>(
        self,
        v: V,
        ahead: Option<(K, V)>,
        p: &[f32],
        out: &mut [f32],
    ) {
        let Block { b0, j0, nb, d, .. } = self;
        // The registers of a slice in one group, or each in its own.
        let one_group = v.group_len().is_multiple_of(S * L::N);
        let ahead = ahead
            .as_ref()
            .and_then(|(k, v)| Some((k.as_quant()?, v.as_quant()?)));
        let slices = d / (S * L::N);
        for (slice, c) in (0..d).step_by(S * L::N).enumerate() {
            let mut acc = [[L::zero(); S]; M];
            // Rows `slice`, `slice + slices`, … ask for their K and V rows a tile further.
            let mut next = slice;
            for jj in 0..nb {
                let r = j0 + jj;
                if let Some((k, v)) = ahead.filter(|_| jj == next) {
                    next += slices;
                    if r + TILE < self.kend {
                        k.prefetch_ahead(r + TILE);
                        v.prefetch_ahead(r + TILE);
                    }
                }
                let gr = v.group(r, c);
                // A loop, not a closure: outlined, a closure loses the target features.
                let mut x = [L::zero(); S];
                for (i, x) in x.iter_mut().enumerate() {
                    let at = c + i * L::N;
                    let g = if one_group || i == 0 {
                        gr
                    } else {
                        v.group(r, at)
                    };
                    *x = L::row(&v, g, r, at);
                }
                for (b, a) in acc.iter_mut().enumerate() {
                    let w = L::set1(*p.get_unchecked((b0 + b) * TILE + jj));
                    for (a, &x) in a.iter_mut().zip(&x) {
                        *a = L::fmadd(w, x, *a);
                    }
                }
            }
            for (b, a) in acc.iter().enumerate() {
                let at = out.as_mut_ptr().add((b0 + b) * d + c);
                for (i, &a) in a.iter().enumerate() {
                    L::add_to(at.add(i * L::N), a);
                }
            }
        }
    }
}

/// Whether the f32 value sums over `v` (int8-query scores) ask for the next tile's K and V
/// rows, a row every few rows, instead of the staging asking for this tile's V and the next
/// tile's K at once: q8 at 512 bits. The staging's burst leaves the memory idle while the
/// core computes; spread, `decode_attention` at L = 4,096 (fastest of 5–6 interleaved runs)
/// measured q8 20–23% faster (SmolLM2's and Qwen2.5-0.5B's shapes, 1 and 2 threads), but q4
/// and the AVX2 level mixed or slower (docs/benchmarks.md).
#[inline(always)]
fn asks_ahead<L: Lanes>(v: &QuantRows) -> bool {
    L::N == 16 && v.bits == 8
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
    /// Views of `k` and `v` for a kernel at `width`; `None` where it does not apply: the CPU
    /// lacks its features, `d` is not a multiple of two registers, quantized groups not a
    /// multiple of one.
    fn new(k: HeadRows<'_>, v: HeadRows<'_>, d: usize, width: Width) -> Option<Self> {
        use half::slice::HalfFloatSliceExt;
        let (present, lanes) = match width {
            Width::Avx2 => (crate::simd::vector_path(), Avx2::N),
            Width::Avx512 => (crate::simd::wide_path(), Avx512::N),
        };
        if !present || !d.is_multiple_of(2 * lanes) {
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
            } if group.is_multiple_of(lanes) => QuantRows::new(codes, scales, los, bits, group, d),
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

    /// [`accumulate`] on these views at `width` (the width they were made for).
    ///
    /// # Safety
    /// The views hold `part.held` rows; the rest as [`accumulate`].
    unsafe fn accumulate(
        &self,
        width: Width,
        part: Part<'_>,
        out: &mut [f32],
        s: &mut TileScratch,
    ) {
        macro_rules! at_width {
            ($k:expr, $v:expr) => {
                match width {
                    Width::Avx2 => Avx2::accumulate(part, $k, $v, out, s),
                    Width::Avx512 => Avx512::accumulate(part, $k, $v, out, s),
                }
            };
        }
        match *self {
            HeadViews::F32(k, v) => at_width!(k, v),
            HeadViews::F16(k, v) => at_width!(k, v),
            HeadViews::Bf16(k, v) => at_width!(k, v),
            HeadViews::Quant(k, v) => at_width!(k, v),
        }
    }
}

/// Query rows per task when a head's queries are split (prefill): enough rows to reuse
/// each tile, enough tasks to balance causal work over the threads.
const ROWS_PER_TASK: usize = 64;

/// Keys per chunk (a multiple of [`TILE`]). Every row's keys are summed a chunk at a time
/// from key 0 on, and the chunks' partial softmaxes folded in order ([`fold`]), however the
/// call is split over tasks and threads: a row's output depends on its own query and keys
/// alone, not on the call's other rows, its length or the thread count, so a speculative
/// verify gives each row plain decoding's bits (before, key splits placed by the call's
/// length and the threads made greedy output with drafts differ from without on 2 threads).
/// The one exception is declared: int8-query-i16-values sums a call of several tokens'
/// values in i16 codes and a decode step's in f32. Each chunk costs a fold, a pass over its
/// rows' outputs: a 16-node tree verify at 4,096 tokens on one thread measured 2–4% slower
/// than unchunked with 1,024 keys a chunk, 5–10% with 512 (which would give a decode step
/// twice the tasks to spread over many threads below 8,192 tokens).
const KEY_CHUNK: usize = 1024;
const _: () = assert!(KEY_CHUNK.is_multiple_of(TILE));

/// How each head's work is split over tasks.
#[derive(Clone, Copy, PartialEq)]
enum Split {
    /// Query rows, `n` per task, each task folding its rows' key chunks as it goes.
    Queries(usize),
    /// All the head's rows, its key chunks in this many runs, a task each, their partial
    /// softmaxes folded after.
    Keys(usize),
}

impl Split {
    /// One task per head below `parallel_min` multiply-adds or on one thread; query rows
    /// for long query blocks; else runs of key chunks, the fewest that give every participant
    /// the same number of tasks (3 KV heads on 2 threads: 2 runs a head), at most one a chunk.
    fn plan(hkv: usize, rows: usize, chunks: usize, work: usize, parallel_min: usize) -> Split {
        let participants = Workers::global().participants();
        if work < parallel_min || participants == 1 {
            return Split::Queries(rows.max(1));
        }
        if rows >= ROWS_PER_TASK {
            return Split::Queries(ROWS_PER_TASK);
        }
        let mut runs = 1;
        while runs < chunks
            && (!(hkv * runs).is_multiple_of(participants) || hkv * runs < participants)
        {
            runs += 1;
        }
        match runs {
            1 => Split::Queries(rows.max(1)),
            runs => Split::Keys(runs),
        }
    }

    /// Tasks per head.
    fn parts(self, rows: usize) -> usize {
        match self {
            Split::Queries(n) => rows.div_ceil(n),
            Split::Keys(runs) => runs,
        }
    }
}

/// What an [`attend`] call computes: over rows `[0, l)`, under `mask`, scores times
/// `scale`, a sink per query head where given, split over the [`Workers`] pool when it does
/// at least `parallel_min` multiply-adds, within `arithmetic`.
#[derive(Clone, Copy)]
pub struct Call<'a> {
    pub l: usize,
    pub mask: AttendMask<'a>,
    pub scale: f32,
    pub sinks: Option<&'a [f32]>,
    pub parallel_min: usize,
    pub arithmetic: Arithmetic,
}

/// `out = softmax(q·kᵀ·scale + mask)·v` as `call` says, on the tiled kernel at the first of
/// `widths` that applies; q and out are `[Hq, T, D]`. False (nothing done) where no width
/// applies.
pub fn attend(
    q: &CpuTensor,
    k: &CpuPool,
    v: &CpuPool,
    call: Call<'_>,
    out: &mut CpuTensor,
    tiles: &mut Vec<TileScratch>,
    widths: &[Width],
) -> bool {
    let Call {
        l,
        mask,
        scale,
        sinks,
        parallel_min,
        arithmetic,
    } = call;
    let (hq, t, d) = (q.dims[0], q.dims[1], q.dims[2]);
    let hkv = k.heads;
    let rows = hq / hkv * t;
    // Row r of KV head kh's block is query head kh·g + r / t.
    let sink = |kh: usize, r: usize| sinks.map(|s| s[kh * (hq / hkv) + r / t]);
    let views = |kh: usize, w: Width| {
        HeadViews::new(k.head_rows(kh, k.cells), v.head_rows(kh, v.cells), d, w)
    };
    // Int8-query scores at the first width that has them, else f32 at the first that applies.
    let int8_at = |w: Width| {
        arithmetic.int8_query()
            && (w == Width::Avx2 || crate::simd::vnni_path())
            && d.is_multiple_of(2 * QUERY_BLOCK)
            && matches!(views(0, w), Some(HeadViews::Quant(k, _)) if k.group.is_multiple_of(QUERY_BLOCK))
    };
    let int8_width = widths.iter().copied().find(|&w| int8_at(w));
    let Some(width) = int8_width.or(widths.iter().copied().find(|&w| views(0, w).is_some())) else {
        return false;
    };
    let int8 = int8_width.is_some();
    // Values against i16 weight codes where rows share them, in steps of more than one
    // token: for one block of rows coding the weights costs more than it saves (fork step,
    // 1 branch: 340 against 310 µs), and a decode step sums in f32, more exactly than
    // declared, so decode is int8-query's whatever the GQA group.
    let i16 = int8 && arithmetic.i16_values() && t > 1 && rows > Avx2::INT8_BLOCK;
    let chunks = l.div_ceil(KEY_CHUNK).max(1);
    let chunk = |c: usize| c * KEY_CHUNK..((c + 1) * KEY_CHUNK).min(l);
    let split = Split::plan(hkv, rows, chunks, hq * t * l * d, parallel_min);
    let parts = split.parts(rows);
    tiles.resize_with(hkv * parts, TileScratch::default);
    let vis = Visibility { mask, t, l };
    let outs = DisjointChunks::new(&mut out.data, d);
    let scratch = DisjointChunks::new(tiles, 1);
    let task = |i: usize| {
        let (kh, part) = (i / parts, i % parts);
        let views = views(kh, width).expect("every head has the dtype of head 0");
        // SAFETY: task i alone holds scratch i and the output rows of its query range.
        let s = unsafe { &mut scratch.get(i)[0] };
        let (first, n, run) = match split {
            Split::Queries(n) => (part * n, n.min(rows - part * n), 0..chunks),
            Split::Keys(runs) => (0, rows, part * chunks / runs..(part + 1) * chunks / runs),
        };
        let at = kh * rows + first;
        let over = |keys: std::ops::Range<usize>, quantized| Part {
            q: &q.data[at * d..(at + n) * d],
            first,
            d,
            keys,
            held: l,
            vis,
            scale,
            int8,
            i16,
            quantized,
        };
        // SAFETY: the views were built for this CPU and width and hold l rows of d; task i
        // alone holds the output rows of a query split's part.
        unsafe {
            let o = || outs.span(at, n);
            if chunks == 1 {
                views.accumulate(width, over(0..l, false), o(), s);
                finish(o(), d, &s.sum, &s.max, |r| sink(kh, first + r));
                return;
            }
            // Each chunk of the run into a partial of its own where the head's runs are
            // folded after; else into one partial, folded into the output as it comes.
            let kept = matches!(split, Split::Keys(_));
            let mut partials = std::mem::take(&mut s.chunks);
            // Grown, never shrunk: another call's partials keep their buffers.
            s.kept = if kept { run.len() } else { 0 };
            if partials.len() < s.kept.max(1) {
                partials.resize_with(s.kept.max(1), Partial::default);
            }
            if !kept {
                begin_fold(o(), &mut s.fold_max, &mut s.fold_sum, n);
            }
            for (k, c) in run.enumerate() {
                let p = &mut partials[if kept { k } else { 0 }];
                p.out.resize(n * d, 0.0);
                views.accumulate(width, over(chunk(c), k > 0), &mut p.out, s);
                p.max.clone_from(&s.max);
                p.sum.clone_from(&s.sum);
                if !kept {
                    fold(o(), &mut s.fold_max, &mut s.fold_sum, p, d);
                }
            }
            if !kept {
                finish(o(), d, &s.fold_sum, &s.fold_max, |r| sink(kh, first + r));
            }
            s.chunks = partials;
        }
    };
    if parts * hkv > 1 && hq * t * l * d >= parallel_min {
        Workers::global().run(hkv * parts, &task);
    } else {
        (0..hkv * parts).for_each(task);
    }
    if let Split::Keys(runs) = split {
        for (kh, o) in out.data.chunks_exact_mut(rows * d).enumerate() {
            let (head, rest) = tiles[kh * runs..(kh + 1) * runs]
                .split_first_mut()
                .expect("a task per run");
            let (mut max, mut sum) = (
                std::mem::take(&mut head.fold_max),
                std::mem::take(&mut head.fold_sum),
            );
            begin_fold(o, &mut max, &mut sum, rows);
            for p in head
                .kept()
                .iter()
                .chain(rest.iter().flat_map(TileScratch::kept))
            {
                fold(o, &mut max, &mut sum, p, d);
            }
            finish(o, d, &sum, &max, |r| sink(kh, r));
            (head.fold_max, head.fold_sum) = (max, sum);
        }
    }
    true
}

impl TileScratch {
    /// The partials this task kept for the fold after it.
    fn kept(&self) -> &[Partial] {
        &self.chunks[..self.kept]
    }
}

/// `out`, `max` and `sum` as [`fold`] begins them (0, −∞, 0), for `rows` rows.
fn begin_fold(out: &mut [f32], max: &mut Vec<f32>, sum: &mut Vec<f32>, rows: usize) {
    out.fill(0.0);
    max.clear();
    max.resize(rows, f32::NEG_INFINITY);
    sum.clear();
    sum.resize(rows, 0.0);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Slot `i` of `n` holds lanes `100·i + lane` (exact in f32): each of its sums is
    /// known.
    #[inline(always)]
    unsafe fn check<L: Lanes>(n: usize) {
        let lanes: Vec<f32> = (0..16 * L::N)
            .map(|x| ((x / L::N) * 100 + x % L::N) as f32)
            .collect();
        let mut acc = [[L::zero(); 8]; 2];
        for (i, a) in acc.iter_mut().flatten().enumerate().take(n) {
            *a = L::load(lanes[i * L::N..].as_ptr());
        }
        let mut out = [0f32; 16];
        L::sums(acc, n, 0.5, &mut out);
        for (i, &got) in out.iter().enumerate().take(n) {
            let want: f32 = lanes[i * L::N..(i + 1) * L::N].iter().sum::<f32>() * 0.5;
            assert_eq!(got, want, "{} lanes: slot {i} of {n}", L::N);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn check_avx2(n: usize) {
        check::<Avx2>(n)
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn check_avx512(n: usize) {
        check::<Avx512>(n)
    }

    #[test]
    fn the_reductions_give_each_slot_its_lane_total_in_order() {
        for n in (2..=16).step_by(2) {
            // SAFETY: each width runs only where the CPU has its features.
            unsafe {
                if n <= 2 * Avx2::BLOCK && crate::simd::vector_path() {
                    check_avx2(n);
                }
                if crate::simd::wide_path() {
                    check_avx512(n);
                }
            }
        }
    }
}
