//! `out = x·Wᵀ` over weights in their stored dtype (f32, f16, bf16), read in place from the
//! mapped file: register-blocked tiles for prefill (6 tokens × 4 rows on AVX-512, 4 × 2 on
//! AVX2) and, for the tokens left over (a decode step's one), one row at a time read front
//! to back, so each task streams its rows from memory in order. Each weight vector is
//! widened as it is loaded; work is split over the worker pool in blocks of rows. f32
//! accumulation in every path.

use half::{bf16, f16};

use crate::simd::{vector_path, wide_path};
use crate::workers::{DisjointChunks, Workers};

/// Output rows per task where tokens come in tiles (prefill): enough tasks to balance.
const ROWS_PER_TASK: usize = 32;

/// The smallest run of weight bytes that [`Workers::run_split`] hands out where every token
/// streams a linear's rows (a decode step; here and in [`crate::qlinear`]): each thread
/// streams one long run of its share, which the prefetchers follow (counter-dispatched tasks
/// of 32 rows of a `[1536, 576]` f16 matrix streamed 23 GB/s, of 256 rows 29 GB/s; 8 tasks
/// per thread on Qwen2.5-0.5B Q4_K_M decoded 20% slower than 2, 1 about 5% faster).
pub(crate) const STREAM_CHUNK_BYTES: usize = 16 << 10;

/// Bytes ahead of a streamed weight row that a decode step prefetches, every cache line
/// (here and in [`crate::qlinear`], where a row is read by groups): two 4 KiB pages (the
/// hardware prefetchers stop at page boundaries).
/// Measured on `weights_decode_blocks` (896 × 4864, 2 threads, best of 4 interleaved runs):
/// prefetching one line per group 4 KiB ahead, q4_K 6.8 ms; every line 2 KiB ahead 5.4,
/// 4 KiB 5.1, 8 KiB 4.9 (q8_0 4.1 / 3.9 / 3.4). One line per group 4 KiB ahead had been
/// the best of 256 B … 32 KiB before.
pub(crate) const PREFETCH_AHEAD: usize = 8192;

/// A stored weight element.
pub trait Elem: Copy + Send + Sync + 'static {
    /// The value as f32 (exact for every element type here).
    fn to_f32(self) -> f32;
    /// Eight consecutive elements at `p`, widened.
    ///
    /// # Safety
    /// `p` must be valid for eight reads and AVX2, FMA and F16C available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    /// Sixteen consecutive elements at `p`, widened.
    ///
    /// # Safety
    /// `p` must be valid for sixteen reads and AVX-512F available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

/// The kernels a linear runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Scalar,
    Avx2,
    Avx512,
}

impl Path {
    /// Tokens per prefill tile; fewer tokens stream each row once per token.
    fn tile_tokens(self) -> usize {
        match self {
            Path::Avx512 => 6,
            Path::Avx2 | Path::Scalar => 4,
        }
    }

    fn detect() -> Path {
        if wide_path() {
            Path::Avx512
        } else if vector_path() {
            Path::Avx2
        } else {
            Path::Scalar
        }
    }
}

impl Elem for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
}

impl Elem for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const f16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
    }
}

impl Elem for bf16 {
    fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const bf16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())),
            16,
        ))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const bf16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256(p.cast()),
        )))
    }
}

/// `out[ti·rows + r] = Σ_c x[ti·cols + c] · w[r·cols + c]` for `ti < t`, `r < rows`.
/// Panics unless `x` holds `t·cols`, `w` `rows·cols` and `out` `t·rows` values.
pub fn linear<E: Elem>(x: &[f32], t: usize, w: &[E], rows: usize, cols: usize, out: &mut [f32]) {
    assert!(
        x.len() == t * cols && w.len() == rows * cols && out.len() == t * rows,
        "linear: x {} (want {t}x{cols}), w {} (want {rows}x{cols}), out {} (want {t}x{rows})",
        x.len(),
        w.len(),
        out.len()
    );
    let path = Path::detect();
    let workers = Workers::global();
    let out = DisjointChunks::new(out, 1);
    let block = Block {
        x,
        w,
        cols,
        out: &out,
        out_stride: rows,
        path,
    };
    if t < path.tile_tokens() {
        // Where every token streams the rows: one long run per thread.
        let chunk = STREAM_CHUNK_BYTES.div_ceil((cols * std::mem::size_of::<E>()).max(1));
        workers.run_split(rows, chunk, &|r| block.run(t, r));
    } else {
        let per = ROWS_PER_TASK;
        workers.run(rows.div_ceil(per), &|task| {
            block.run(t, task * per..((task + 1) * per).min(rows))
        });
    }
}

/// One task's view of a linear.
struct Block<'a, E> {
    x: &'a [f32],
    w: &'a [E],
    cols: usize,
    out: &'a DisjointChunks<f32>,
    out_stride: usize,
    path: Path,
}

impl<E: Elem> Block<'_, E> {
    /// Every token for the rows in `rows`.
    fn run(&self, t: usize, rows: std::ops::Range<usize>) {
        // Tile tokens as Path::tile_tokens says.
        match self.path {
            // 24 of the 32 registers accumulate; 10 loads per 24 multiply-adds.
            Path::Avx512 => self.run_tiles::<6, 4>(t, rows),
            Path::Avx2 | Path::Scalar => self.run_tiles::<4, 2>(t, rows),
        }
    }

    /// Every token for the rows in `rows`: tiles of `PT` tokens × `PR` rows, then the
    /// remaining tokens one at a time, one row at a time.
    fn run_tiles<const PT: usize, const PR: usize>(&self, t: usize, rows: std::ops::Range<usize>) {
        let mut ti = 0;
        while ti + PT <= t {
            let mut r = rows.start;
            while r + PR <= rows.end {
                self.tile::<PT, PR>(ti, r);
                r += PR;
            }
            for r in r..rows.end {
                self.tile::<PT, 1>(ti, r);
            }
            ti += PT;
        }
        // One row at a time, front to back: the same arithmetic per (token, row) as the
        // tiles (one accumulator, the same order), so a token's output does not depend on
        // how many tokens share the call (batched requests match requests served alone).
        for ti in ti..t {
            for r in rows.clone() {
                self.tile::<1, 1>(ti, r);
            }
        }
    }

    /// Tokens `t0..t0+NT` × rows `r0..r0+NR`.
    fn tile<const NT: usize, const NR: usize>(&self, t0: usize, r0: usize) {
        let c = self.cols;
        let x = &self.x[t0 * c..(t0 + NT) * c];
        let w = &self.w[r0 * c..(r0 + NR) * c];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: each path's features were detected; x and w hold NT and NR rows of c.
        let acc = match self.path {
            Path::Avx512 => unsafe { x86::tile_512::<E, NT, NR>(x, w, c) },
            Path::Avx2 => unsafe { x86::tile::<E, NT, NR>(x, w, c) },
            Path::Scalar => scalar_tile::<E, NT, NR>(x, w, c),
        };
        #[cfg(not(target_arch = "x86_64"))]
        let acc = scalar_tile::<E, NT, NR>(x, w, c);
        for (i, row) in acc.iter().enumerate() {
            for (j, &v) in row.iter().enumerate() {
                // SAFETY: element (t0+i, r0+j) lies in this task's rows only.
                unsafe { self.out.get((t0 + i) * self.out_stride + r0 + j)[0] = v };
            }
        }
    }
}

fn scalar_tile<E: Elem, const NT: usize, const NR: usize>(
    x: &[f32],
    w: &[E],
    c: usize,
) -> [[f32; NR]; NT] {
    let mut acc = [[0f32; NR]; NT];
    for (i, a) in acc.iter_mut().enumerate() {
        for (j, o) in a.iter_mut().enumerate() {
            let (xr, wr) = (&x[i * c..(i + 1) * c], &w[j * c..(j + 1) * c]);
            // Eight lanes, as the vector path sums.
            let mut lanes = [0f32; 8];
            for (k, (&xv, &wv)) in xr.iter().zip(wr).enumerate() {
                lanes[k % 8] += xv * wv.to_f32();
            }
            *o = lanes.iter().sum();
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Elem, PREFETCH_AHEAD};
    use crate::simd::x86::hsum;
    use std::arch::x86_64::*;

    /// One vector width: the operations a tile needs.
    trait Lanes {
        type V: Copy;
        const N: usize;
        unsafe fn zero() -> Self::V;
        unsafe fn load_x(p: *const f32) -> Self::V;
        unsafe fn load_w<E: Elem>(p: *const E) -> Self::V;
        unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
        unsafe fn sum(v: Self::V) -> f32;
    }

    struct Avx2;
    impl Lanes for Avx2 {
        type V = __m256;
        const N: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            _mm256_setzero_ps()
        }
        #[inline(always)]
        unsafe fn load_x(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn load_w<E: Elem>(p: *const E) -> __m256 {
            E::load8(p)
        }
        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn sum(v: __m256) -> f32 {
            hsum(v)
        }
    }

    struct Avx512;
    impl Lanes for Avx512 {
        type V = __m512;
        const N: usize = 16;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }
        #[inline(always)]
        unsafe fn load_x(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn load_w<E: Elem>(p: *const E) -> __m512 {
            E::load16(p)
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn sum(v: __m512) -> f32 {
            _mm512_reduce_add_ps(v)
        }
    }

    /// `acc[i][j] = x_i · w_j` for NT rows of `x` and NR rows of `w`, each `c` long, on
    /// `L::N` lanes; the last `c % L::N` columns scalar.
    #[inline(always)]
    unsafe fn tile_on<L: Lanes, E: Elem, const NT: usize, const NR: usize>(
        x: &[f32],
        w: &[E],
        c: usize,
    ) -> [[f32; NR]; NT] {
        debug_assert!(x.len() >= NT * c && w.len() >= NR * c);
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let mut acc = [[L::zero(); NR]; NT];
        let full = c / L::N * L::N;
        let mut k = 0;
        while k < full {
            if NT == 1 && NR == 1 {
                // A lone token streams its row: warm the line two pages ahead (a prefetch
                // never faults, past the weight included). Repeated for each vector of a line:
                // issuing it once per line behind a test measured no faster.
                let ahead = wp.add(k).cast::<u8>().wrapping_add(PREFETCH_AHEAD);
                _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
            }
            let mut wv = [L::zero(); NR];
            for (j, v) in wv.iter_mut().enumerate() {
                *v = L::load_w(wp.add(j * c + k));
            }
            for (i, a) in acc.iter_mut().enumerate() {
                let xv = L::load_x(xp.add(i * c + k));
                for (aj, &wj) in a.iter_mut().zip(&wv) {
                    *aj = L::fma(xv, wj, *aj);
                }
            }
            k += L::N;
        }
        let mut out = [[0f32; NR]; NT];
        for i in 0..NT {
            for j in 0..NR {
                let mut s = L::sum(acc[i][j]);
                for k in full..c {
                    s += x[i * c + k] * w[j * c + k].to_f32();
                }
                out[i][j] = s;
            }
        }
        out
    }

    /// [`tile_on`] 8 lanes wide.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn tile<E: Elem, const NT: usize, const NR: usize>(
        x: &[f32],
        w: &[E],
        c: usize,
    ) -> [[f32; NR]; NT] {
        tile_on::<Avx2, E, NT, NR>(x, w, c)
    }

    /// [`tile_on`] 16 lanes wide.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn tile_512<E: Elem, const NT: usize, const NR: usize>(
        x: &[f32],
        w: &[E],
        c: usize,
    ) -> [[f32; NR]; NT] {
        tile_on::<Avx512, E, NT, NR>(x, w, c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f64 reference of `x·Wᵀ` with the f32 error bound `γ(cols)·Σ|x·w|` (γ(n) = n·u/(1-n·u),
    /// u = 2⁻²⁴): any summation order of n f32 products stays within it.
    fn check<E: Elem>(t: usize, rows: usize, cols: usize, w: &[E], path: Path) {
        let x: Vec<f32> = (0..t * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        let mut out = vec![f32::NAN; t * rows];
        if path == Path::detect() {
            linear(&x, t, w, rows, cols, &mut out);
        } else {
            let d = DisjointChunks::new(&mut out, 1);
            let b = Block {
                x: &x,
                w,
                cols,
                out: &d,
                out_stride: rows,
                path,
            };
            b.run(t, 0..rows);
        }
        let u = f64::from(f32::EPSILON) / 2.0;
        let gamma = cols as f64 * u / (1.0 - cols as f64 * u);
        for ti in 0..t {
            for r in 0..rows {
                let (mut want, mut mag) = (0f64, 0f64);
                for c in 0..cols {
                    let p = f64::from(x[ti * cols + c]) * f64::from(w[r * cols + c].to_f32());
                    want += p;
                    mag += p.abs();
                }
                let got = f64::from(out[ti * rows + r]);
                assert!(
                    (got - want).abs() <= gamma * mag + 1e-30,
                    "t {ti} r {r}: got {got}, want {want} (bound {})",
                    gamma * mag
                );
            }
        }
    }

    #[test]
    fn a_token_gets_the_same_output_alone_or_batched() {
        // 13 tokens: 6- and 4-token tiles and single rows; 70 rows: 4-, 2- and 1-row tiles;
        // columns: a long row, a scalar tail, less than one vector.
        for cols in [4864, 150, 37, 13] {
            let (t, rows) = (13, 70);
            let w: Vec<f16> = weights(rows * cols)
                .iter()
                .map(|&v| f16::from_f32(v))
                .collect();
            let x: Vec<f32> = (0..t * cols)
                .map(|i| ((i * 29 % 89) as f32 - 44.0) / 13.0)
                .collect();
            let mut batched = vec![0f32; t * rows];
            linear(&x, t, &w, rows, cols, &mut batched);
            for ti in 0..t {
                let mut alone = vec![0f32; rows];
                linear(
                    &x[ti * cols..(ti + 1) * cols],
                    1,
                    &w,
                    rows,
                    cols,
                    &mut alone,
                );
                let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&alone),
                    bits(&batched[ti * rows..(ti + 1) * rows]),
                    "cols {cols} token {ti}"
                );
            }
        }
    }

    fn weights(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 31.0)
            .collect()
    }

    #[test]
    fn every_dtype_and_tile_shape_matches_the_reference() {
        // Token counts hit the 6- and 4-token tiles and the one-row path; rows hit 4-, 2-
        // and 1-row tiles and a partial task; columns a 16-lane body, an 8-lane body, the
        // 150 columns of a streamed row and a scalar tail.
        let paths = [
            (Path::Scalar, true),
            (Path::Avx2, vector_path()),
            (Path::Avx512, wide_path()),
        ];
        for (t, rows, cols) in [
            (1, 7, 19),
            (5, 37, 24),
            (9, 70, 13),
            (4, 3, 8),
            (13, 39, 53),
            (2, 9, 150),
        ] {
            let w = weights(rows * cols);
            let h: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
            let b: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            for path in paths.iter().filter(|p| p.1).map(|p| p.0) {
                check(t, rows, cols, &w, path);
                check(t, rows, cols, &h, path);
                check(t, rows, cols, &b, path);
            }
        }
    }
}
