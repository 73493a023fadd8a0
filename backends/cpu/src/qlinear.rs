//! `out = x·Wᵀ` over weights kept in ggml's block formats ([`BlockFormat`]), computed on the
//! blocks as stored (read in place from the mapped file), the technique of llama.cpp's CPU
//! backend: each activation row is quantized once per call to 8-bit codes in blocks of 32
//! values under an f32 scale, every 32-value sub-block of a weight row meets its activation
//! block in an exact integer dot product, and those are scaled and summed in f32.
//!
//! A weight row is walked in *groups* of 256 values: one K-quant super-block, or eight blocks
//! of a 32-value format (fewer at the end of a row). A group is unpacked once (codes as
//! unsigned bytes, per-sub-block f32 factors) and dotted with every token of a tile (up to 8
//! tokens: a decode step, a speculative verify, the end of a prefill), so each weight byte is
//! read once per tile, the rows streamed front to back with prefetch. On the vector paths a
//! prefill of 16 tokens or more goes by *panels* of 8 tokens instead:
//! the activations are also laid out once per call with the 8 tokens' codes interleaved by
//! 4-byte dwords, so that one weight code dword, broadcast, meets all 8 tokens in one
//! product with lane i for token i — no horizontal sums. Blocks of 4 weight rows are unpacked
//! once per chunk of panels that stays in cache, and then met by 3 pairs of panels at a time
//! on the VNNI path (a pair in one 512-bit vector), one panel at a time on the AVX2 path:
//! each activation vector loaded serves the rows, each broadcast the panels. The tile keeps one accumulator lane per sub-block of a group; a panel runs one
//! lane at a time over its sub-blocks (the rows and the panels' blocks laid out lane by
//! lane, [`LaneMajor`]), so that its accumulators stay in registers. The float steps per
//! sub-block and the final additions are the tile's, lane for lane, so a token's outputs
//! are the same bit for bit whether it comes in a panel, a tile or alone. The vector paths
//! are chosen at run time: AVX2
//! (`maddubs`: unsigned weight codes × signed activation codes to i16 pairs, `madd` to i32,
//! f32 FMA; in panels a run of code dwords adds its pair sums in i16 before one `madd`,
//! [`i16_run`], and in tiles a group's sub-blocks add theirs as far by `hadd` levels) and,
//! where the CPU has AVX-512 VNNI, VL and BW, the same with `dpbusd` (the byte products
//! summed straight into i32, one instruction for two; EVEX encoding, so 32 vector registers;
//! a whole group two sub-blocks per 512-bit product, the products' lanes summed by permutes,
//! not `vphaddd`; the 4- and 5-bit 32-value formats'
//! groups gathered by word permutes and met by activations whose blocks' 16-value halves are
//! regrouped once per call to match their nibbles; Q4_K/Q5_K's super-blocks split into low
//! and high nibbles by two 512-bit loads and met by activations whose blocks are regrouped
//! in pairs, their lane sums narrowed by i16 packs; fifth bits set under byte masks (Q5_K's
//! moved into place by word shifts); Q8_0's codes taken as
//! unsigned `q + 128` with an offset of `128·s_j` (no sign transfer); Q6_K's half scales
//! applied to i32 half sums rather than to i16 pair sums) — exactly the same sums, since no
//! `maddubs` pair sum can saturate here (|c| ≤ 128 for Q8_0's magnitudes, ≤ 63 elsewhere,
//! |q| ≤ 127). Where the CPU has 256-bit `dpbusd` only (AVX-VNNI's VEX form on Intel client
//! cores, or AVX-512 VNNI + VL's EVEX form under `KVPLUG_CPU_ISA=avx2vnni`), the AVX2 path's
//! layout takes it for `maddubs` + `madd` ([`Path::Avx2Vnni`]: Q8_0's codes and offset and
//! Q6_K's i32 half sums as above, the products accumulated in place, so panels take 2 a
//! pass). The scalar fallback does the same integer arithmetic, summing the floats in
//! another order.
//! Work is split over the worker pool in runs of rows.
//!
//! Per group and token the arithmetic is, for sub-block `j` (32 values, activation block
//! scale `d_j`, codes `q`, code sum `s_j = Σq`):
//!
//! `acc += f32(I_j)·(scale_j·d_j) + min_j·(f32(s_j)·d_j)`
//!
//! where `I_j` is an exact i32: `Σ c·q` over the unsigned weight codes `c`, less the
//! format's integer offset (`8·s_j` for Q4_0, `16·s_j` for Q5_0; Q6_K: `Σ_h sc_h·(Σ c·q −
//! 32·Σq)` over its two 16-value halves with their i8 scales; Q8_0's codes are signed, or
//! `q + 128` with `128·s_j` on the `dpbusd` path; MXFP4's 4-bit codes are looked up as
//! `kvalue + 16` by a byte shuffle, with `16·s_j`).
//! `scale_j` is the block's `d` (`d·sc_j` for Q4_K/Q5_K, `2^(e − 128)` for MXFP4), `min_j`
//! the additive part (`m` of Q4_1/Q5_1, `−dmin·m_j` of Q4_K/Q5_K; zero elsewhere). Every
//! `I_j` and `s_j` converts to f32 exactly (|I_j| ≤ 32·32·127·128 < 2²⁴ for Q6_K, less
//! elsewhere), and `scale_j`, `min_j` are exact products of an f16 and a 6-bit integer, or
//! powers of two.

use std::cell::RefCell;
use std::ops::Range;

use kvplug_backend_kit::model::blocks::{
    e8m0_half, half_at, k4_scale_min, BlockFormat, BLOCK_FORMATS, MXFP4_VALUES,
};

#[cfg(target_arch = "x86_64")]
use crate::linear::PREFETCH_AHEAD;
use crate::linear::STREAM_CHUNK_BYTES;
use crate::simd::{dot256, vector_path, vnni_path, Dot256};
use crate::workers::{DisjointChunks, Workers};

/// The formats the kernels compute on, indexed by their const parameter ([`format_index`]):
/// the kit's [`BLOCK_FORMATS`], then MXFP4.
const FORMATS: [BlockFormat; 9] = {
    let mut f = [BlockFormat::Mxfp4; 9];
    let mut i = 0;
    while i < BLOCK_FORMATS.len() {
        f[i] = BLOCK_FORMATS[i];
        i += 1;
    }
    f
};

/// MXFP4's 4-bit codes as the kernels' unsigned codes: `kvalue + 16` (4..=28), the offset
/// being [`code_offset`]'s 16 (a power of two, as every offset the kernels shift by).
const fn mxfp4_codes() -> [u8; 16] {
    let mut c = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        c[i] = (MXFP4_VALUES[i] + 16) as u8;
        i += 1;
    }
    c
}

/// Values per activation block, and per weight sub-block (Q6_K's 16-value sub-blocks come
/// in pairs).
const QK: usize = 32;
/// Sub-blocks per group.
const GROUP: usize = 8;
/// Tokens per prefill tile: each unpacked group meets this many tokens.
const TILE: usize = 4;
/// Tokens per panel (the vector paths' prefill): one 256-bit lane each.
const PANEL: usize = 8;
/// Fewest tokens of a call that go in panels: below, unpacking every row for a panel or two
/// costs more than tiles reading the packed rows.
const MIN_PANEL_TOKENS: usize = 16;
/// Most tokens that meet each row in one tile (a speculative chain, a short prompt): every
/// row is read once. Past it, tiles of [`TILE`] until this many are left.
const SHORT_TILE: usize = 8;
/// Weight rows unpacked at a time for the panels on the `dpbusd` path, and units (pairs of
/// panels, one 512-bit vector) per pass over them: each activation vector loaded serves the
/// rows, each broadcast weight dword the units, and the rows × units accumulators and
/// products stay in the 32 registers. Qwen2.5-1.5B's gate and down shapes, 512 tokens,
/// 2 threads: 4 × 3 at 175–200 GMAC/s, 4 × 2 at 160–170, 6 × 2 at 160–185; on 256-bit
/// vectors (single panels) 4 × 3 reached 175–185.
const PANEL_ROWS: usize = 4;
/// See [`PANEL_ROWS`].
const PANELS_PER_PASS: usize = 3;
/// The same on the `maddubs` path (single panels, 16 registers): 4 × 1 at 103–125 GMAC/s,
/// 2 × 2 at 86–94, 3 × 2 at 92–101, 1 × 4 at 62–80.
const PANEL_ROWS_AVX2: usize = 4;
/// See [`PANEL_ROWS_AVX2`].
const PANELS_PER_PASS_AVX2: usize = 1;
/// The same with 256-bit `dpbusd` (single panels, 16 registers on AVX-VNNI; the products
/// accumulate in place): on Qwen2.5-0.5B's down shape, 512 tokens, 2 threads, VEX on an
/// Emerald Rapids VM, GFLOP/s q4_K / q6_K / q8_0 / q4_0 over two rounds, 4 × 2 at
/// 275–289 / 240–246 / 304–313 / 267–313, 3 × 3 at 252 / 162–198 / 241–254 / 250–264,
/// 4 × 1 at 215–242 / 159–215 / 190–256 / 182–251.
const PANEL_ROWS_VNNI256: usize = 4;
/// See [`PANEL_ROWS_VNNI256`].
const PANELS_PER_PASS_VNNI256: usize = 2;
/// Bytes of activation codes in a chunk of panels that a block of unpacked rows passes over
/// before the next block is unpacked: a chunk's codes and scales stay in a core's L2 on
/// recent x86 (2 MiB on Sapphire Rapids; on Zen 2's 512 KiB they come from L3) while each
/// unpacked row serves every panel in it. On Qwen2.5-1.5B's down shape (8960 columns) 768
/// and 1536 KiB measured alike, both above 192.
const PANEL_CHUNK_BYTES: usize = 1536 << 10;
/// Output rows per task where tokens come in tiles (prefill): enough tasks to balance.
const ROWS_PER_TASK: usize = 32;
/// Values at which the activations are quantized on every thread rather than the caller's.
const PARALLEL_QUANTIZE: usize = 1 << 16;

/// The kernels a linear runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Scalar,
    Avx2,
    /// AVX2 with 256-bit `dpbusd`, VEX-encoded (AVX-VNNI) where `vex`, else EVEX (an AVX-512
    /// CPU capped at `avx2vnni`): the AVX2 path's kernels, the products one instruction.
    Avx2Vnni {
        vex: bool,
    },
    /// AVX2 with AVX-512 VNNI's `dpbusd`: 256-bit registers, whole groups and pairs of panels
    /// on 512-bit ones.
    Vnni,
}

impl Path {
    fn detect() -> Path {
        if vnni_path() {
            return Path::Vnni;
        }
        match dot256() {
            Dot256::Vex => Path::Avx2Vnni { vex: true },
            Dot256::Evex => Path::Avx2Vnni { vex: false },
            Dot256::Maddubs if vector_path() => Path::Avx2,
            Dot256::Maddubs => Path::Scalar,
        }
    }

    /// The vector path that multiplies as `k` ([`kind`]) says.
    fn for_kind(k: u8) -> Path {
        match k {
            kind::VEX => Path::Avx2Vnni { vex: true },
            kind::EVEX => Path::Avx2Vnni { vex: false },
            kind::AVX512 => Path::Vnni,
            _ => Path::Avx2,
        }
    }
}

/// How a vector kernel multiplies bytes: its const parameter, so that only the chosen way is
/// compiled.
mod kind {
    /// AVX2's `maddubs` and `madd`.
    pub const MADDUBS: u8 = 0;
    /// `vpdpbusd` on 256-bit vectors, VEX-encoded (AVX-VNNI).
    pub const VEX: u8 = 1;
    /// `vpdpbusd` on 256-bit vectors, EVEX-encoded (AVX-512 VNNI + VL): [`VEX`]'s kernels.
    pub const EVEX: u8 = 2;
    /// The AVX-512 path: EVEX `vpdpbusd`, whole groups and pairs of panels on 512-bit
    /// vectors, AVX-512 BW's byte masks in the unpacking.
    pub const AVX512: u8 = 3;
}

/// `out[ti·rows + r] = Σ_c x[ti·cols + c] · w_r[c]` for `ti < t`, `r < rows`, where `w` is a
/// `[rows, cols]` weight stored as whole blocks of `format`, row-major (each row
/// `cols / format.block_elems()` blocks) and `w_r` its row `r` as
/// [`kvplug_backend_kit::model::blocks::dequantize_row`] reads it.
///
/// The activations are quantized to 8 bits per 32-value block (scale `amax/127`), so the
/// result is within `Σ_b (d_b/2)·Σ_{c∈b}|w_r[c]|` (plus f32 rounding) of the exact value;
/// the tests state the full bound. Finite `x` assumed. A token's outputs do not depend on
/// how many tokens share the call. Allocates nothing once its per-thread buffer has grown
/// to the largest `t·cols` seen.
///
/// Panics unless `cols` is a multiple of the format's block (callers refuse such weights)
/// and `x` holds `t·cols` values, `w` `rows` rows of blocks and `out` `t·rows` values.
pub fn linear_blocks(
    x: &[f32],
    t: usize,
    format: BlockFormat,
    w: &[u8],
    rows: usize,
    cols: usize,
    out: &mut [f32],
) {
    run(Path::detect(), x, t, format, w, rows, cols, out);
}

/// One matrix of a [`linear_blocks_many`] call: `rows` rows of `format` blocks and the
/// `[t, rows]` output.
pub struct BlockMatrix<'a> {
    pub format: BlockFormat,
    pub w: &'a [u8],
    pub rows: usize,
    pub out: &'a mut [f32],
}

/// [`linear_blocks`] for several matrices of the same input (a layer's q/k/v, its gate/up),
/// with the same results bit for bit: the activations are quantized once and the matrices'
/// rows run as one job (one dispatch, each thread's stream running on from one matrix into
/// the next). Panics as [`linear_blocks`] does for any of them.
pub fn linear_blocks_many<const N: usize>(
    x: &[f32],
    t: usize,
    cols: usize,
    matrices: [BlockMatrix<'_>; N],
) {
    run_many(Path::detect(), x, t, cols, matrices);
}

/// [`linear_blocks`] on `path`.
#[allow(clippy::too_many_arguments)]
fn run(
    path: Path,
    x: &[f32],
    t: usize,
    format: BlockFormat,
    w: &[u8],
    rows: usize,
    cols: usize,
    out: &mut [f32],
) {
    let m = BlockMatrix {
        format,
        w,
        rows,
        out,
    };
    run_many(path, x, t, cols, [m]);
}

/// [`linear_blocks_many`] on `path`.
fn run_many<const N: usize>(
    path: Path,
    x: &[f32],
    t: usize,
    cols: usize,
    matrices: [BlockMatrix<'_>; N],
) {
    assert!(
        x.len() == t * cols,
        "linear_blocks: x {} (want {t}x{cols})",
        x.len()
    );
    for m in &matrices {
        let format = m.format;
        assert!(
            cols.is_multiple_of(format.block_elems()),
            "linear_blocks: {cols} columns are not whole {} blocks",
            format.name()
        );
        let (rows, row_bytes) = (m.rows, format.bytes_for(cols));
        assert!(
            m.w.len() == rows * row_bytes && m.out.len() == t * rows,
            "linear_blocks: w {} bytes (want {rows} rows of {row_bytes}), out {} (want \
             {t}x{rows})",
            m.w.len(),
            m.out.len()
        );
    }
    if t == 0 || matrices.iter().all(|m| m.rows == 0) {
        return;
    }
    if cols == 0 {
        // Empty sums.
        for m in matrices {
            m.out.fill(0.0);
        }
        return;
    }
    let matrices_formats = matrices.each_ref().map(|m| m.format);
    let outs = matrices.map(|m| (m.format, m.w, m.rows, DisjointChunks::new(m.out, 1)));
    QUANTIZED.with_borrow_mut(|buf| {
        let acts = buf.quantize(path, x, t, cols, &matrices_formats);
        // Each matrix's format, rows and task.
        let tasks = outs.each_ref().map(|(format, w, rows, out)| {
            let task = Task {
                path,
                w,
                row_bytes: format.bytes_for(cols),
                acts,
                t,
                out,
                out_stride: *rows,
            };
            (*format, *rows, task)
        });
        let workers = Workers::global();
        if t <= SHORT_TILE {
            // Where every token streams the rows: one long run per thread, through the
            // matrices in turn (their rows numbered on from one to the next).
            let total = tasks.iter().map(|(_, rows, _)| rows).sum();
            let thinnest = tasks.iter().map(|(_, _, k)| k.row_bytes).min();
            let chunk = STREAM_CHUNK_BYTES.div_ceil(thinnest.unwrap_or(1).max(1));
            workers.run_split(total, chunk, &|r| {
                let mut first = 0;
                for (format, rows, task) in &tasks {
                    let end = first + rows;
                    let (a, b) = (r.start.max(first), r.end.min(end));
                    if a < b {
                        task.rows(*format, a - first..b - first);
                    }
                    first = end;
                }
            });
        } else {
            let per = ROWS_PER_TASK;
            let total = tasks.iter().map(|(_, rows, _)| rows.div_ceil(per)).sum();
            workers.run(total, &|mut i| {
                for (format, rows, task) in &tasks {
                    let n = rows.div_ceil(per);
                    if i < n {
                        return task.rows(*format, i * per..((i + 1) * per).min(*rows));
                    }
                    i -= n;
                }
            });
        }
    });
}

thread_local! {
    /// The calling thread's quantized activations, grown on demand and kept between calls.
    static QUANTIZED: RefCell<Quantized> = RefCell::default();
}

/// Activation rows quantized to 8 bits: per token, the row's `cols/32` blocks padded with
/// zero blocks to whole groups.
#[derive(Default)]
struct Quantized {
    /// Codes, 32 per block.
    q: Vec<i8>,
    /// Block scales.
    d: Vec<f32>,
    /// Block code sums.
    sum: Vec<i32>,
    /// Block code sums times scales, `f32(sum)·d` (the minimums' factor).
    sum_d: Vec<f32>,
    /// Code sums of each block's two 16-value halves (Q6_K's sub-blocks).
    half: Vec<i16>,
    /// The `dpbusd` path's codes for the tokens past the panels in [`WideOrder::Halves`]'
    /// order (filled only for calls with such a format).
    q_halves: Vec<i8>,
    /// The same in [`WideOrder::Pairs`]' order.
    q_pairs: Vec<i8>,
    /// The same for whole panels of [`PANEL`] tokens, interleaved (see [`Panels`]).
    panel_q: Vec<i8>,
    panel_d: Vec<f32>,
    panel_sum: Vec<i32>,
    panel_half: Vec<i32>,
}

/// Grows `v` to at least `n` elements (never shrinks, so steady calls allocate nothing) and
/// returns its first `n`.
fn at_least<T: Copy + Default>(v: &mut Vec<T>, n: usize) -> &mut [T] {
    if v.len() < n {
        v.resize(n, T::default());
    }
    &mut v[..n]
}

impl Quantized {
    /// Quantizes the `t` rows of `x` (`cols` each), on every thread when there are many,
    /// with the layouts that `formats` take on `path`.
    fn quantize(
        &mut self,
        path: Path,
        x: &[f32],
        t: usize,
        cols: usize,
        formats: &[BlockFormat],
    ) -> Acts<'_> {
        let blocks = (cols / QK).div_ceil(GROUP) * GROUP;
        let q = at_least(&mut self.q, t * blocks * QK);
        let d = at_least(&mut self.d, t * blocks);
        let sum = at_least(&mut self.sum, t * blocks);
        let half = at_least(&mut self.half, t * blocks * 2);
        let workers = Workers::global();
        if t > 1 && t * cols >= PARALLEL_QUANTIZE && workers.participants() > 1 {
            let (qc, dc) = (
                DisjointChunks::new(q, blocks * QK),
                DisjointChunks::new(d, blocks),
            );
            let (sc, hc) = (
                DisjointChunks::new(sum, blocks),
                DisjointChunks::new(half, blocks * 2),
            );
            workers.run(t, &|ti| {
                // SAFETY: token `ti`'s chunks are handed to this call only.
                let (q, d, s, h) = unsafe { (qc.get(ti), dc.get(ti), sc.get(ti), hc.get(ti)) };
                quantize_row_on(path, &x[ti * cols..(ti + 1) * cols], q, d, s, h);
            });
        } else {
            for ti in 0..t {
                quantize_row_on(
                    path,
                    &x[ti * cols..(ti + 1) * cols],
                    &mut q[ti * blocks * QK..(ti + 1) * blocks * QK],
                    &mut d[ti * blocks..(ti + 1) * blocks],
                    &mut sum[ti * blocks..(ti + 1) * blocks],
                    &mut half[ti * blocks * 2..(ti + 1) * blocks * 2],
                );
            }
        }
        let sum_d = at_least(&mut self.sum_d, t * blocks);
        for ((sd, &s), &d) in sum_d.iter_mut().zip(&self.sum[..t * blocks]).zip(&*d) {
            *sd = s as f32 * d;
        }
        // The vector paths' panels (the scalar path has none).
        let panels = if path == Path::Scalar || t < MIN_PANEL_TOKENS {
            0
        } else {
            t / PANEL
        };
        // Blocks of pairs of panels (see [`Panels`]).
        let n = panels.div_ceil(2) * blocks;
        let pq = at_least(&mut self.panel_q, n * 2 * PANEL * QK);
        let pd = at_least(&mut self.panel_d, n * 2 * PANEL);
        let ps = at_least(&mut self.panel_sum, n * 2 * PANEL);
        let ph = at_least(&mut self.panel_half, n * 4 * PANEL);
        let order = LaneMajor::new(cols / QK);
        let placed = Panels {
            blocks,
            ..Panels::default()
        };
        for pb in 0..panels * order.len() {
            let (pi, b) = (pb / order.len(), pb % order.len());
            let at = placed.block(pi, order.position(b));
            for i in 0..PANEL {
                let src = (pi * PANEL + i) * blocks + b;
                for k in 0..QK / 4 {
                    let c = at.codes + k * PANEL_ROW + i * 4;
                    pq[c..c + 4].copy_from_slice(&self.q[src * QK + 4 * k..][..4]);
                }
                pd[at.scalars + i] = self.d[src];
                ps[at.scalars + i] = self.sum[src];
                ph[at.half + i] = i32::from(self.half[2 * src]);
                ph[at.half + 2 * PANEL + i] = i32::from(self.half[2 * src + 1]);
            }
        }
        // The regrouped codes the call's formats take on the `dpbusd` path, for the tokens
        // past the panels (others empty).
        let (from, to) = (panels * PANEL * blocks * QK, t * blocks * QK);
        let regrouped = |order: WideOrder, v: &mut Vec<i8>| {
            if path != Path::Vnni || !formats.iter().any(|&f| wide_order(f) == order) {
                return 0;
            }
            let chunks = if order == WideOrder::Halves { 8 } else { 4 };
            for (w, q) in at_least(v, to)[from..]
                .chunks_exact_mut(4 * QK)
                .zip(self.q[from..to].chunks_exact(4 * QK))
            {
                for (k, w) in w.chunks_exact_mut(4 * QK / chunks).enumerate() {
                    let c = k % (chunks / 2) * 2 + k / (chunks / 2);
                    w.copy_from_slice(&q[c * w.len()..][..w.len()]);
                }
            }
            to
        };
        let halves = regrouped(WideOrder::Halves, &mut self.q_halves);
        let pairs = regrouped(WideOrder::Pairs, &mut self.q_pairs);
        Acts {
            q: &self.q[..t * blocks * QK],
            q_halves: &self.q_halves[..halves],
            q_pairs: &self.q_pairs[..pairs],
            d: &self.d[..t * blocks],
            sum: &self.sum[..t * blocks],
            sum_d: &self.sum_d[..t * blocks],
            half: &self.half[..t * blocks * 2],
            blocks,
            panels: Panels {
                q: &self.panel_q[..n * 2 * PANEL * QK],
                d: &self.panel_d[..n * 2 * PANEL],
                sum: &self.panel_sum[..n * 2 * PANEL],
                half: &self.panel_half[..n * 4 * PANEL],
                count: panels,
                blocks,
            },
        }
    }
}

/// [`quantize_row`], compiled for `path`'s instructions (the same arithmetic either way).
fn quantize_row_on(
    path: Path,
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    sum: &mut [i32],
    half: &mut [i16],
) {
    #[cfg(target_arch = "x86_64")]
    if path != Path::Scalar {
        // SAFETY: the Avx2 path is only chosen where its features were detected.
        return unsafe { x86::quantize_row(x, q, d, sum, half) };
    }
    let _ = path;
    quantize_row(x, q, d, sum, half);
}

/// Quantizes `x` (whole 32-value blocks) into the blocks of `q`/`d`/`sum`/`half` (as many
/// blocks as `d` has; those past `x` are zero): block scale `d = amax/127` in f32, codes
/// `q = round(x/d)` (half away from zero; all zero when `d` is 0), their sum and the sums
/// of each block's two 16-value halves.
#[inline(always)]
fn quantize_row(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32], half: &mut [i16]) {
    for (b, (qb, db)) in q.chunks_exact_mut(QK).zip(d.iter_mut()).enumerate() {
        let Some(xb) = x.get(b * QK..(b + 1) * QK) else {
            qb.fill(0);
            *db = 0.0;
            sum[b] = 0;
            half[2 * b..2 * b + 2].fill(0);
            continue;
        };
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        if scale == 0.0 {
            qb.fill(0);
        } else {
            // |x/d| ≤ 127/(1 − 2⁻²⁴) < 127.5, so the clamp changes nothing for finite x (and
            // maps NaN into range); it lets the conversion vectorize.
            for (o, &v) in qb.iter_mut().zip(xb) {
                // Not `clamp`: that keeps NaN, which the conversion below must not see.
                #[allow(clippy::manual_clamp)]
                let r = (v / scale).round().max(-127.0).min(127.0);
                // SAFETY: `r` is an integer in [-127, 127] (max/min return the non-NaN operand).
                *o = unsafe { r.to_int_unchecked::<i32>() } as i8;
            }
        }
        *db = scale;
        let halves = |r: &[i8]| r.iter().map(|&v| i16::from(v)).sum::<i16>();
        half[2 * b] = halves(&qb[..QK / 2]);
        half[2 * b + 1] = halves(&qb[QK / 2..]);
        sum[b] = i32::from(half[2 * b]) + i32::from(half[2 * b + 1]);
    }
}

/// A call's quantized activations (see [`Quantized`]).
#[derive(Clone, Copy)]
struct Acts<'a> {
    q: &'a [i8],
    /// See [`Quantized::q_halves`] (empty unless the call has such a format).
    q_halves: &'a [i8],
    /// See [`Quantized::q_pairs`] (likewise).
    q_pairs: &'a [i8],
    d: &'a [f32],
    sum: &'a [i32],
    sum_d: &'a [f32],
    half: &'a [i16],
    /// Blocks per token (whole groups).
    blocks: usize,
    panels: Panels<'a>,
}

/// Tokens `PANEL·p .. PANEL·(p + 1)` of a call, for the vector paths' prefill, per pair of
/// panels (`2m`, `2m + 1`) and block (at `m·blocks + position`, `blocks` as in [`Acts`],
/// `position` the block's [`LaneMajor`] position in a row; the padding past a row's last
/// block left out): the codes as eight [`PANEL_ROW`]-byte rows, row `k` holding codes
/// `4k..4k+4` of each token of the first panel in turn, then the second's; the two panels'
/// tokens' scales, then their code sums, then their first halves' sums, then their second
/// halves'. A 256-bit vector reads one panel's tokens, a 512-bit one both.
#[derive(Clone, Copy, Default)]
struct Panels<'a> {
    q: &'a [i8],
    d: &'a [f32],
    sum: &'a [i32],
    half: &'a [i32],
    /// Whole panels (`t / PANEL` from [`MIN_PANEL_TOKENS`] on; 0 below and on the scalar
    /// path).
    count: usize,
    /// Blocks per token, as in [`Acts`].
    blocks: usize,
}

/// Bytes of a row of a pair of panels' codes: four of each of their tokens.
const PANEL_ROW: usize = 2 * PANEL * 4;

/// A panel kernel's outputs: `[unit][row][token]`, a unit's one or two panels' tokens in
/// order (the rest of each row unused).
type PanelOut<const R: usize, const P: usize> = [[[f32; 2 * PANEL]; R]; P];

/// Where panel `p`'s block at a position lies in [`Panels`]: its codes' first row (in bytes;
/// rows [`PANEL_ROW`] apart), its scales and sums, and its half sums (the second halves'
/// `2·PANEL` on).
#[derive(Clone, Copy)]
struct PanelBlock {
    codes: usize,
    scalars: usize,
    half: usize,
}

impl Panels<'_> {
    /// Panel `pi`'s block at `position`.
    #[inline(always)]
    fn block(&self, pi: usize, position: usize) -> PanelBlock {
        let (pair, second) = (pi / 2 * self.blocks + position, pi % 2);
        PanelBlock {
            codes: pair * 2 * PANEL * QK + second * PANEL * 4,
            scalars: pair * 2 * PANEL + second * PANEL,
            half: pair * 4 * PANEL + second * PANEL,
        }
    }
}

/// One token's activations for one group: 256 codes, 8 scales, 8 sums, 16 half sums.
#[derive(Clone, Copy)]
struct ActGroup<'a> {
    q: &'a [i8],
    d: &'a [f32],
    sum: &'a [i32],
    sum_d: &'a [f32],
    half: &'a [i16],
}

impl<'a> Acts<'a> {
    /// The codes in `order` (the `dpbusd` path's; empty where the call has no such format).
    fn wide(&self, order: WideOrder) -> &'a [i8] {
        match order {
            WideOrder::Natural => self.q,
            WideOrder::Halves => self.q_halves,
            WideOrder::Pairs => self.q_pairs,
        }
    }

    /// Token `ti`'s activations for group `g`.
    #[inline(always)]
    fn group(&self, ti: usize, g: usize) -> ActGroup<'a> {
        let b = ti * self.blocks + g * GROUP;
        ActGroup {
            q: &self.q[b * QK..(b + GROUP) * QK],
            d: &self.d[b..b + GROUP],
            sum: &self.sum[b..b + GROUP],
            sum_d: &self.sum_d[b..b + GROUP],
            half: &self.half[2 * b..2 * (b + GROUP)],
        }
    }
}

/// The order in which the `dpbusd` path's whole groups of a format take their activation
/// codes: that of the format's 512-bit unpack, per four 32-value blocks (128 codes).
#[derive(Clone, Copy, PartialEq, Eq)]
enum WideOrder {
    /// As quantized (Q8_0, Q6_K, MXFP4).
    Natural,
    /// The first 16 codes of the four blocks, then their last 16: a block's low and high
    /// nibbles (Q4_0, Q4_1, Q5_0, Q5_1).
    Halves,
    /// Blocks 0, 2, 1, 3: the low nibbles of 64 code bytes, then their high ones (Q4_K,
    /// Q5_K, whose 32 bytes hold a sub-block in low nibbles and the next in high ones).
    Pairs,
}

/// [`WideOrder`] of `f`.
const fn wide_order(f: BlockFormat) -> WideOrder {
    match f {
        BlockFormat::Q4_0 | BlockFormat::Q4_1 | BlockFormat::Q5_0 | BlockFormat::Q5_1 => {
            WideOrder::Halves
        }
        BlockFormat::Q4K | BlockFormat::Q5K => WideOrder::Pairs,
        // MXFP4's 17-byte blocks lie at odd offsets, out of reach of the word permutes:
        // its codes come a block at a time, in order.
        _ => WideOrder::Natural,
    }
}

/// The index of `f` in [`FORMATS`] (the kernels' const parameter).
const fn format_index(f: BlockFormat) -> usize {
    match f {
        BlockFormat::Q4_0 => 0,
        BlockFormat::Q4_1 => 1,
        BlockFormat::Q5_0 => 2,
        BlockFormat::Q5_1 => 3,
        BlockFormat::Q8_0 => 4,
        BlockFormat::Q4K => 5,
        BlockFormat::Q5K => 6,
        BlockFormat::Q6K => 7,
        BlockFormat::Mxfp4 => 8,
    }
}

/// Whether a format's values have an additive part (`min_j` in the module docs).
const fn has_min(f: BlockFormat) -> bool {
    matches!(
        f,
        BlockFormat::Q4_1 | BlockFormat::Q5_1 | BlockFormat::Q4K | BlockFormat::Q5K
    )
}

/// The offset subtracted from each unsigned code of a 32-value format (`x = d·(c − o)`).
const fn code_offset(f: BlockFormat) -> i32 {
    match f {
        BlockFormat::Q4_0 => 8,
        BlockFormat::Q5_0 | BlockFormat::Mxfp4 => 16,
        _ => 0,
    }
}

/// The largest unsigned code of `f` as the kernels hold it (Q8_0's magnitudes on the
/// `maddubs` path; MXFP4's `kvalue + 16`).
const fn max_code(f: BlockFormat) -> i32 {
    match f {
        BlockFormat::Q4_0 | BlockFormat::Q4_1 | BlockFormat::Q4K => 15,
        BlockFormat::Q5_0 | BlockFormat::Q5_1 | BlockFormat::Q5K => 31,
        BlockFormat::Mxfp4 => 28,
        BlockFormat::Q6K => 63,
        BlockFormat::Q8_0 => 128,
    }
}

/// Code dwords of a sub-block whose `maddubs` pair sums one 16-bit lane adds up exactly
/// before a `madd` widens them (a power of two, at most the sub-block's 8): each pair sum is
/// at most `2·max_code·127` in magnitude (|q| ≤ 127), so 8 for the 4-bit formats, 4 for
/// the 5-bit ones and MXFP4, 2 for Q6_K and 1 for Q8_0.
const fn i16_run(f: BlockFormat) -> usize {
    let fits = i16::MAX as i32 / (2 * max_code(f) * 127);
    let mut run = 1;
    while run < QK / 4 && 2 * run <= fits as usize {
        run *= 2;
    }
    run
}

/// The offset the integer dots subtract per code: [`code_offset`], or 128 for Q8_0 on the
/// `dpbusd` path, which takes its codes as unsigned `q + 128` (`maddubs`, whose pair sums
/// 2·255·127 would saturate, takes |q| against sign(x, q) instead).
const fn dot_offset(f: BlockFormat, vnni: bool) -> i32 {
    match f {
        BlockFormat::Q8_0 if vnni => 128,
        _ => code_offset(f),
    }
}

/// Bytes of one group of `f` (eight 32-value blocks, or one super-block).
const fn group_bytes(f: BlockFormat) -> usize {
    f.bytes_for(QK * GROUP)
}

/// One task of a call: a run of rows for every token.
struct Task<'a> {
    path: Path,
    w: &'a [u8],
    row_bytes: usize,
    acts: Acts<'a>,
    t: usize,
    out: &'a DisjointChunks<f32>,
    out_stride: usize,
}

impl Task<'_> {
    /// Every token for `rows`, on the kernels of `format`.
    fn rows(&self, format: BlockFormat, rows: Range<usize>) {
        const F0: usize = format_index(BlockFormat::Q4_0);
        const F1: usize = format_index(BlockFormat::Q4_1);
        const F2: usize = format_index(BlockFormat::Q5_0);
        const F3: usize = format_index(BlockFormat::Q5_1);
        const F4: usize = format_index(BlockFormat::Q8_0);
        const F5: usize = format_index(BlockFormat::Q4K);
        const F6: usize = format_index(BlockFormat::Q5K);
        const F7: usize = format_index(BlockFormat::Q6K);
        const F8: usize = format_index(BlockFormat::Mxfp4);
        match format_index(format) {
            F0 => self.rows_of::<F0>(rows),
            F1 => self.rows_of::<F1>(rows),
            F2 => self.rows_of::<F2>(rows),
            F3 => self.rows_of::<F3>(rows),
            F4 => self.rows_of::<F4>(rows),
            F5 => self.rows_of::<F5>(rows),
            F6 => self.rows_of::<F6>(rows),
            F7 => self.rows_of::<F7>(rows),
            F8 => self.rows_of::<F8>(rows),
            _ => unreachable!("format_index covers FORMATS"),
        }
    }

    /// Panels of [`PANEL`] tokens over `rows` (vector paths, from [`MIN_PANEL_TOKENS`] on),
    /// then tiles of [`TILE`] tokens until at most [`SHORT_TILE`] are left, then those in one
    /// tile (the same arithmetic, bit for bit, per token and row every way).
    fn rows_of<const F: usize>(&self, rows: Range<usize>) {
        if self.acts.panels.count > 0 {
            let rows = rows.clone();
            UNPACKED.with_borrow_mut(|u| match self.path {
                Path::Vnni => {
                    self.panels::<F, PANEL_ROWS, PANELS_PER_PASS, { kind::AVX512 }>(u, rows)
                }
                Path::Avx2Vnni { vex: true } => self
                    .panels::<F, PANEL_ROWS_VNNI256, PANELS_PER_PASS_VNNI256, { kind::VEX }>(
                        u, rows,
                    ),
                Path::Avx2Vnni { vex: false } => self
                    .panels::<F, PANEL_ROWS_VNNI256, PANELS_PER_PASS_VNNI256, { kind::EVEX }>(
                        u, rows,
                    ),
                _ => self
                    .panels::<F, PANEL_ROWS_AVX2, PANELS_PER_PASS_AVX2, { kind::MADDUBS }>(u, rows),
            });
        }
        let mut t0 = self.acts.panels.count * PANEL;
        while self.t - t0 > SHORT_TILE {
            self.tiles::<F, TILE>(t0, rows.clone());
            t0 += TILE;
        }
        match self.t - t0 {
            0 => {}
            1 => self.tiles::<F, 1>(t0, rows),
            2 => self.tiles::<F, 2>(t0, rows),
            3 => self.tiles::<F, 3>(t0, rows),
            4 => self.tiles::<F, 4>(t0, rows),
            5 => self.tiles::<F, 5>(t0, rows),
            6 => self.tiles::<F, 6>(t0, rows),
            7 => self.tiles::<F, 7>(t0, rows),
            8 => self.tiles::<F, 8>(t0, rows),
            _ => unreachable!("at most SHORT_TILE tokens are left"),
        }
    }

    /// Every panel against `rows`: in equal chunks of panels whose codes fit
    /// [`PANEL_CHUNK_BYTES`], each chunk met by blocks of `R` rows unpacked once (single rows
    /// at the end), `P` units a pass, multiplied as `K` says ([`kind`]). A unit is two panels
    /// on the AVX-512 path's 512-bit vectors, one on 256-bit ones.
    fn panels<const F: usize, const R: usize, const P: usize, const K: u8>(
        &self,
        u: &mut UnpackedRows,
        rows: Range<usize>,
    ) {
        let f = const { FORMATS[F] };
        let order = LaneMajor::new(self.row_bytes / f.block_bytes() * (f.block_elems() / QK));
        u.hold(R * order.len());
        let count = self.acts.panels.count;
        let unit = if K == kind::AVX512 { 2 } else { 1 };
        let most = (PANEL_CHUNK_BYTES / (PANEL * QK * self.acts.blocks).max(1)).max(unit * P);
        // Whole units, so that a chunk starts a pair.
        let chunk = count.div_ceil(count.div_ceil(most)).next_multiple_of(unit);
        for c0 in (0..count).step_by(chunk) {
            let c1 = (c0 + chunk).min(count);
            let mut r = rows.start;
            while r < rows.end {
                if r + R <= rows.end {
                    self.unpack_rows::<F, R>(u, r, &order);
                    self.panels_over::<F, R, P, K>(u, &order, c0..c1, r);
                    r += R;
                } else {
                    self.unpack_rows::<F, 1>(u, r, &order);
                    self.panels_over::<F, 1, 1, K>(u, &order, c0..c1, r);
                    r += 1;
                }
            }
        }
    }

    /// Panels `pis` against the `R` rows unpacked in `u` (rows `r..r + R`): `P` units a pass,
    /// then single units, then single panels.
    fn panels_over<const F: usize, const R: usize, const P: usize, const K: u8>(
        &self,
        u: &UnpackedRows,
        order: &LaneMajor,
        pis: Range<usize>,
        r: usize,
    ) {
        let unit = if K == kind::AVX512 { 2 } else { 1 };
        let mut pi = pis.start;
        while pi + unit * P <= pis.end {
            self.write_panels(pi, unit, r, self.panel::<F, R, P, K, true>(u, order, pi));
            pi += unit * P;
        }
        while pi + unit <= pis.end {
            self.write_panels(pi, unit, r, self.panel::<F, R, 1, K, true>(u, order, pi));
            pi += unit;
        }
        for pi in pi..pis.end {
            self.write_panels(pi, 1, r, self.panel::<F, R, 1, K, false>(u, order, pi));
        }
    }

    /// Unpacks rows `r..r + R` into `u` in `order` (a vector path's).
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    fn unpack_rows<const F: usize, const R: usize>(
        &self,
        u: &mut UnpackedRows,
        r: usize,
        order: &LaneMajor,
    ) {
        let rows: [&[u8]; R] = std::array::from_fn(|i| {
            &self.w[(r + i) * self.row_bytes..(r + i + 1) * self.row_bytes]
        });
        match self.path {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: panels exist on the vector paths only, each where detected.
            Path::Avx2 => unsafe { x86::unpack_rows::<F>(&rows, order, u) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Path::Avx2Vnni { vex: true } => unsafe { x86::unpack_rows_vex::<F>(&rows, order, u) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Path::Avx2Vnni { vex: false } => unsafe { x86::unpack_rows_evex::<F>(&rows, order, u) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Path::Vnni => unsafe { x86::unpack_rows_vnni::<F>(&rows, order, u) },
            _ => unreachable!("the scalar path has no panels"),
        }
    }

    /// Tokens `t0..t0+NT` of each of `rows`, the rows looped over within one call (a row of a
    /// few hundred values takes about as long as a call's entry and exit).
    #[inline(always)]
    fn tiles<const F: usize, const NT: usize>(&self, t0: usize, rows: Range<usize>) {
        let w = &self.w[rows.start * self.row_bytes..rows.end * self.row_bytes];
        let put = |i: usize, v: [f32; NT]| self.write(t0, rows.start + i, v);
        match self.path {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the Avx2 path is only chosen where its features were detected.
            Path::Avx2 => unsafe { x86::tiles::<F, NT>(w, self.row_bytes, &self.acts, t0, put) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: each path is only chosen where its features were detected.
            Path::Avx2Vnni { vex: true } => unsafe {
                x86::tiles_vex::<F, NT>(w, self.row_bytes, &self.acts, t0, put)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Path::Avx2Vnni { vex: false } => unsafe {
                x86::tiles_evex::<F, NT>(w, self.row_bytes, &self.acts, t0, put)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Path::Vnni => unsafe {
                x86::tiles_vnni::<F, NT>(w, self.row_bytes, &self.acts, t0, put)
            },
            _ => {
                for (i, row) in w.chunks_exact(self.row_bytes).enumerate() {
                    put(i, scalar_tile::<F, NT>(row, &self.acts, t0));
                }
            }
        }
    }

    /// `P` units (`UNIT`; else single panels) from panel `pi` on against the first `R` rows
    /// unpacked in `u`, multiplied as `K` says: on the AVX-512 path a unit is a pair of
    /// panels on 512-bit vectors, elsewhere a unit and a panel are one. The parameters are
    /// constants so that only the kernel chosen is compiled.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    fn panel<const F: usize, const R: usize, const P: usize, const K: u8, const UNIT: bool>(
        &self,
        u: &UnpackedRows,
        order: &LaneMajor,
        pi: usize,
    ) -> PanelOut<R, P> {
        let p = &self.acts.panels;
        debug_assert_eq!(self.path, Path::for_kind(K));
        #[cfg(target_arch = "x86_64")]
        // SAFETY: panels exist on the vector paths only, each where detected (the AVX-512
        // path has AVX-512 F).
        return unsafe {
            match K {
                kind::AVX512 if UNIT => x86::panel_pairs::<F, R, P>(u, order, p, pi),
                kind::AVX512 | kind::EVEX => x86::panel_evex::<F, R, P>(u, order, p, pi),
                kind::VEX => x86::panel_vex::<F, R, P>(u, order, p, pi),
                _ => x86::panel::<F, R, P>(u, order, p, pi),
            }
        };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("panels exist on the x86 vector paths only")
    }

    /// Writes a kernel's outputs for `P` units of `unit` panels from panel `pi` on, rows
    /// `r..r + R`.
    fn write_panels<const R: usize, const P: usize>(
        &self,
        pi: usize,
        unit: usize,
        r: usize,
        v: PanelOut<R, P>,
    ) {
        for (pp, v) in v.iter().enumerate() {
            let first = (pi + pp * unit) * PANEL;
            for (k, t) in (first..first + unit * PANEL).enumerate() {
                // A token's rows together: one store.
                let token: [f32; R] = std::array::from_fn(|i| v[i][k]);
                let at = t * self.out_stride + r;
                // SAFETY: elements (token, r..r + R) lie in this task's rows only.
                unsafe { self.out.span(at, R) }.copy_from_slice(&token);
            }
        }
    }

    fn write<const NT: usize>(&self, t0: usize, r: usize, v: [f32; NT]) {
        for (i, v) in v.into_iter().enumerate() {
            // SAFETY: element (t0+i, r) lies in this task's rows only.
            unsafe { self.out.get((t0 + i) * self.out_stride + r)[0] = v };
        }
    }
}

/// The order in which the panels take a row's sub-blocks and their activation blocks:
/// lane-major, every sub-block of accumulator lane 0 in row order, then lane 1's, and so on,
/// where a sub-block's lane is its place in its group, or in its piece of a short row's last
/// fours, twos and ones ([`Task::tiles`]' pieces). One lane's sub-blocks then run
/// contiguously into one accumulator per row and token.
#[derive(Clone, Copy, Debug)]
struct LaneMajor {
    /// Whole groups in a row.
    full: usize,
    /// Sub-blocks past them (32-value formats only).
    rest: usize,
    /// Lane j's positions: `starts[j]..starts[j + 1]`.
    starts: [usize; GROUP + 1],
}

impl LaneMajor {
    /// The order of a row of `sub_blocks` sub-blocks.
    fn new(sub_blocks: usize) -> LaneMajor {
        let (full, rest) = (sub_blocks / GROUP, sub_blocks % GROUP);
        let mut starts = [0; GROUP + 1];
        for j in 0..GROUP {
            let pieces = [4, 2, 1]
                .iter()
                .filter(|&&w| rest & w != 0 && j < w)
                .count();
            starts[j + 1] = starts[j] + full + pieces;
        }
        LaneMajor { full, rest, starts }
    }

    /// Sub-blocks in a row.
    fn len(&self) -> usize {
        self.full * GROUP + self.rest
    }

    /// The position of sub-block `sb` (below [`LaneMajor::len`]).
    fn position(&self, sb: usize) -> usize {
        if sb < self.full * GROUP {
            return self.starts[sb % GROUP] + sb / GROUP;
        }
        // Each earlier piece is wider, so holds this lane too.
        let (mut t, mut rank) = (sb - self.full * GROUP, self.full);
        for w in [4, 2, 1] {
            if self.rest & w != 0 {
                if t < w {
                    return self.starts[t] + rank;
                }
                t -= w;
                rank += 1;
            }
        }
        panic!("sub-block {sb} past a row of {}", self.len())
    }
}

/// Weight rows unpacked for the panels (vector paths): per [`LaneMajor`] position, that
/// sub-block of each row in turn (of `R` rows, row r's at `position·R + r`).
#[derive(Default)]
struct UnpackedRows {
    /// Unsigned codes as eight dwords (Q8_0 on the `maddubs` path: their magnitudes).
    codes: Vec<[i32; QK / 4]>,
    /// Q8_0 on the `maddubs` path: the signed codes.
    signed: Vec<[i32; QK / 4]>,
    /// `scale_j`.
    scale: Vec<f32>,
    /// `min_j`.
    min: Vec<f32>,
    /// Q6_K: the i8 scales of the sub-block's two 16-value halves.
    half_scales: Vec<[i32; 2]>,
}

impl UnpackedRows {
    /// Room for `n` sub-blocks (grown, never shrunk).
    fn hold(&mut self, n: usize) {
        at_least(&mut self.codes, n);
        at_least(&mut self.signed, n);
        at_least(&mut self.scale, n);
        at_least(&mut self.min, n);
        at_least(&mut self.half_scales, n);
    }
}

thread_local! {
    /// The calling thread's unpacked rows, grown on demand and kept between calls.
    static UNPACKED: RefCell<UnpackedRows> = RefCell::default();
}

/// Sub-blocks in the group starting at byte `start` of a row of `row_len` bytes.
#[inline(always)]
fn group_len(f: BlockFormat, start: usize, row_len: usize) -> usize {
    let bytes = (row_len - start).min(group_bytes(f));
    bytes / f.block_bytes() * (f.block_elems() / QK)
}

/// A group of a weight row unpacked for the scalar path (see the module docs).
struct Group {
    /// Sub-block `j`'s codes: unsigned as stored (Q8_0: the i8 codes' bits); zero past the
    /// group's sub-blocks.
    codes: [[u8; QK]; GROUP],
    /// `scale_j`.
    scale: [f32; GROUP],
    /// `min_j`.
    min: [f32; GROUP],
    /// Q6_K: the scales of the sixteen 16-value sub-blocks.
    sc16: [i8; 16],
}

/// Unpacks the `n` sub-blocks of `f` at `b` (whole blocks: up to eight of a 32-value format,
/// or one super-block) as the kit's `dequantize_row` reads them.
fn unpack(f: BlockFormat, b: &[u8], n: usize) -> Group {
    let mut g = Group {
        codes: [[0; QK]; GROUP],
        scale: [0.0; GROUP],
        min: [0.0; GROUP],
        sc16: [0; 16],
    };
    // Codes of a 32-value block: low nibbles are values 0..16, high nibbles 16..32, and
    // value v's fifth bit (Q5_*) is bit v of `qh`.
    let nibbles = |c: &mut [u8; QK], qs: &[u8], qh: Option<u32>| {
        for l in 0..QK / 2 {
            c[l] = qs[l] & 0x0f;
            c[l + 16] = qs[l] >> 4;
        }
        if let Some(qh) = qh {
            for (v, c) in c.iter_mut().enumerate() {
                *c |= (((qh >> v) & 1) << 4) as u8;
            }
        }
    };
    let u32_at = |b: &[u8], at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    match f {
        BlockFormat::Q4_0
        | BlockFormat::Q4_1
        | BlockFormat::Q5_0
        | BlockFormat::Q5_1
        | BlockFormat::Q8_0 => {
            for (j, b) in b.chunks_exact(f.block_bytes()).take(n).enumerate() {
                g.scale[j] = half_at(b, 0);
                let c = &mut g.codes[j];
                match f {
                    BlockFormat::Q4_0 => nibbles(c, &b[2..18], None),
                    BlockFormat::Q4_1 => nibbles(c, &b[4..20], None),
                    BlockFormat::Q5_0 => nibbles(c, &b[6..22], Some(u32_at(b, 2))),
                    BlockFormat::Q5_1 => nibbles(c, &b[8..24], Some(u32_at(b, 4))),
                    _ => c.copy_from_slice(&b[2..34]),
                }
                if has_min(f) {
                    g.min[j] = half_at(b, 2);
                }
            }
        }
        BlockFormat::Q4K | BlockFormat::Q5K => {
            let (d, dmin) = (half_at(b, 0), half_at(b, 2));
            let (qh, qs) = if f == BlockFormat::Q5K {
                (Some(&b[16..48]), &b[48..176])
            } else {
                (None, &b[16..144])
            };
            for j in 0..GROUP {
                let (sc, m) = k4_scale_min(j, &b[4..16]);
                g.scale[j] = d * f32::from(sc);
                g.min[j] = -(dmin * f32::from(m));
                // Sub-blocks 2i and 2i+1 are the low and high nibbles of bytes 32i..32i+32.
                let q = &qs[j / 2 * 32..j / 2 * 32 + 32];
                for (l, c) in g.codes[j].iter_mut().enumerate() {
                    *c = (q[l] >> (4 * (j % 2))) & 0x0f;
                    if let Some(qh) = qh {
                        *c |= ((qh[l] >> j) & 1) << 4;
                    }
                }
            }
        }
        BlockFormat::Mxfp4 => {
            let table = const { mxfp4_codes() };
            for (j, b) in b.chunks_exact(f.block_bytes()).take(n).enumerate() {
                g.scale[j] = e8m0_half(b[0]);
                nibbles(&mut g.codes[j], &b[1..17], None);
                g.codes[j] = g.codes[j].map(|c| table[usize::from(c)]);
            }
        }
        BlockFormat::Q6K => {
            let d = half_at(b, 208);
            // Half h (128 values) holds sub-blocks 4h..4h+4: low nibbles of ql[0..32] and
            // ql[32..64], then their high nibbles, each with two bits of qh[0..32].
            for h in 0..2 {
                let (ql, qh) = (&b[64 * h..64 * h + 64], &b[128 + 32 * h..160 + 32 * h]);
                for l in 0..QK {
                    g.codes[4 * h][l] = (ql[l] & 0x0f) | ((qh[l] & 3) << 4);
                    g.codes[4 * h + 1][l] = (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4);
                    g.codes[4 * h + 2][l] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    g.codes[4 * h + 3][l] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                }
            }
            for (s, &v) in g.sc16.iter_mut().zip(&b[192..208]) {
                *s = v as i8;
            }
            g.scale = [d; GROUP];
        }
    }
    g
}

/// `acc` plus one token's dot product with group `g` (the module docs' arithmetic).
fn scalar_dot<const F: usize>(g: &Group, a: ActGroup<'_>, mut acc: f32) -> f32 {
    let f = const { FORMATS[F] };
    let dot = |c: &[u8], q: &[i8]| -> i32 {
        c.iter()
            .zip(q)
            .map(|(&c, &q)| {
                let c = if f == BlockFormat::Q8_0 {
                    i32::from(c as i8)
                } else {
                    i32::from(c)
                };
                c * i32::from(q)
            })
            .sum()
    };
    for j in 0..GROUP {
        let (c, q) = (&g.codes[j], &a.q[j * QK..(j + 1) * QK]);
        let isum = if f == BlockFormat::Q6K {
            (0..2)
                .map(|h| {
                    let k = 2 * j + h;
                    let s = dot(&c[16 * h..16 * h + 16], &q[16 * h..16 * h + 16]);
                    i32::from(g.sc16[k]) * (s - 32 * i32::from(a.half[k]))
                })
                .sum()
        } else {
            dot(c, q) - code_offset(f) * a.sum[j]
        };
        acc += isum as f32 * (g.scale[j] * a.d[j]);
        if has_min(f) {
            acc += g.min[j] * a.sum_d[j];
        }
    }
    acc
}

/// Tokens `t0..t0+NT` against one weight `row`, scalar.
fn scalar_tile<const F: usize, const NT: usize>(
    row: &[u8],
    acts: &Acts<'_>,
    t0: usize,
) -> [f32; NT] {
    let f = const { FORMATS[F] };
    let mut acc = [0f32; NT];
    for (gi, start) in (0..row.len()).step_by(group_bytes(f)).enumerate() {
        let n = group_len(f, start, row.len());
        let g = unpack(f, &row[start..], n);
        for (i, a) in acc.iter_mut().enumerate() {
            *a = scalar_dot::<F>(&g, acts.group(t0 + i, gi), *a);
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    use kvplug_backend_kit::model::blocks::BlockFormat;

    use std::ops::Range;

    use super::{
        dot_offset, group_bytes, group_len, has_min, i16_run, kind, mxfp4_codes, wide_order, Acts,
        LaneMajor, PanelBlock, PanelOut, Panels, UnpackedRows, WideOrder, FORMATS, GROUP, PANEL,
        PANEL_ROW, PREFETCH_AHEAD, QK,
    };
    use crate::simd::x86::hsum;

    /// Sub-block scales and minimums of the Q4_K/Q5_K block at `p`, from its 12 packed bytes
    /// (`p + 4..p + 16`), in the bytes of one vector: byte `j` = the kit's
    /// `k4_scale_min(j)`'s scale, byte `8 + j` its minimum. With `a`, `b`, `c` the packed
    /// bytes 0..4, 4..8, 8..12, sub-blocks 0..4 keep the low 6 bits of `a` (scales) and `b`
    /// (minimums); sub-blocks 4..8 take 4 bits from `c` (low nibbles scales, high nibbles
    /// minimums) under the top 2 bits of `a` (scales) and `b` (minimums). Byte shuffles, not
    /// scalar words: the scalar unpack and its moves into vectors took ~40% of a Q4_K
    /// super-block's time.
    ///
    /// # Safety
    /// `p` must be valid for 16 bytes' reads; SSSE3.
    #[inline(always)]
    pub(super) unsafe fn k4_scales_mins(p: *const u8) -> __m128i {
        const Z: i8 = -128; // a shuffle index that gives 0
        let v = _mm_loadu_si128(p.cast());
        // a0..a3 c0..c3 b0..b3, under the masks 0x3f, 0x0f, 0x3f.
        let low = _mm_shuffle_epi8(
            v,
            _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, Z, Z, Z, Z),
        );
        let low = _mm_and_si128(
            low,
            _mm_setr_epi32(0x3f3f_3f3f, 0x0f0f_0f0f, 0x3f3f_3f3f, 0),
        );
        // c's high nibbles for the minimums 4..8 (a 16-bit shift keeps them in their byte).
        let c_hi = _mm_shuffle_epi8(
            _mm_srli_epi16(v, 4),
            _mm_setr_epi8(Z, Z, Z, Z, Z, Z, Z, Z, Z, Z, Z, Z, 12, 13, 14, 15),
        );
        // a's and b's top 2 bits, moved to bits 4 and 5 of the bytes of sub-blocks 4..8.
        let top = _mm_shuffle_epi8(
            v,
            _mm_setr_epi8(Z, Z, Z, Z, 4, 5, 6, 7, Z, Z, Z, Z, 8, 9, 10, 11),
        );
        let top = _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30));
        _mm_or_si128(
            _mm_or_si128(low, _mm_and_si128(c_hi, _mm_set1_epi8(0x0f))),
            top,
        )
    }

    /// [`super::quantize_row`] on AVX2, block by block: the same IEEE division, rounding and
    /// clamp lane for lane (so the same codes), with the block's largest magnitude taken as
    /// a tree of vector maxima (the compiler leaves the scalar fold a 32-step chain: a
    /// decode step quantized its activations ~3× slower that way, with the other threads
    /// waiting).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize_row(
        x: &[f32],
        q: &mut [i8],
        d: &mut [f32],
        sum: &mut [i32],
        half: &mut [i16],
    ) {
        let whole = (x.len() / QK).min(d.len());
        assert!(q.len() >= d.len() * QK && sum.len() >= d.len() && half.len() >= 2 * d.len());
        let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX));
        let sign = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
        // Round half away from zero as `f32::round` lowers: add 0.5 less half an ulp with
        // x's sign, then truncate (exact for every f32).
        let below_half = _mm256_set1_ps(0.5 - f32::EPSILON / 4.0);
        let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        for b in 0..whole {
            let p = x.as_ptr().add(b * QK);
            let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(p.add(8 * i)));
            // Max of |x| over a tree (x is finite by contract: unlike the scalar fold, which
            // skips a NaN, `max_ps` may carry one into the scale).
            let m = _mm256_max_ps(
                _mm256_max_ps(
                    _mm256_and_ps(v[0], magnitude),
                    _mm256_and_ps(v[1], magnitude),
                ),
                _mm256_max_ps(
                    _mm256_and_ps(v[2], magnitude),
                    _mm256_and_ps(v[3], magnitude),
                ),
            );
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
            let scale = amax / 127.0;
            d[b] = scale;
            let codes: [__m256i; 4] = if scale == 0.0 {
                [_mm256_setzero_si256(); 4]
            } else {
                let s = _mm256_set1_ps(scale);
                std::array::from_fn(|i| {
                    let r = _mm256_div_ps(v[i], s);
                    let r = _mm256_add_ps(r, _mm256_or_ps(_mm256_and_ps(r, sign), below_half));
                    let r = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(r);
                    _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
                })
            };
            // i32 → i8 (saturation never bites: |c| ≤ 127); packs interleave 128-bit halves.
            let w = _mm256_packs_epi32(codes[0], codes[1]);
            let w2 = _mm256_packs_epi32(codes[2], codes[3]);
            let bytes = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(w, w2),
                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
            );
            _mm256_storeu_si256(q.as_mut_ptr().add(b * QK).cast(), bytes);
            let total = |a: __m256i, c: __m256i| {
                let t = _mm256_add_epi32(a, c);
                let t = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
                let t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
                _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 1)))
            };
            let (h0, h1) = (total(codes[0], codes[1]), total(codes[2], codes[3]));
            half[2 * b] = h0 as i16;
            half[2 * b + 1] = h1 as i16;
            sum[b] = h0 + h1;
        }
        // The zero blocks past `x`.
        super::quantize_row(
            &x[whole * QK..],
            &mut q[whole * QK..],
            &mut d[whole..],
            &mut sum[whole..],
            &mut half[2 * whole..],
        );
    }

    /// A group unpacked into registers: [`super::Group`] laid out for the vector path.
    #[derive(Clone, Copy)]
    struct VGroup {
        /// Unsigned codes of each sub-block (Q8_0: their absolute values, or `q + 128` on the
        /// `dpbusd` paths).
        codes: [__m256i; GROUP],
        /// Q8_0: the signed codes, whose signs go onto the activations.
        signed: [__m256i; GROUP],
        /// Q6_K: per sub-block, the i16 multipliers of its 16 pair sums (the first eight
        /// its first half's scale, the rest its second half's); on the 256-bit `dpbusd`
        /// paths the i32 multipliers of its 8 dword sums (4 a half).
        mul: [__m256i; GROUP],
        /// Q6_K: the sixteen half scales as i16, in order.
        sc16: __m256i,
        /// Q6_K on the AVX-512 path: half scales 0..8 as i32 lanes.
        sc_lo: __m256i,
        /// Q6_K on the AVX-512 path: half scales 8..16 as i32 lanes.
        sc_hi: __m256i,
        /// `scale_j` in lane j.
        scale: __m256,
        /// `min_j` in lane j.
        min: __m256,
        /// The AVX-512 path's whole groups, 64 codes a vector in the format's [`WideOrder`]:
        /// sub-blocks 2k and 2k + 1 of `codes` in `wide[k]` (Q6_K, Q8_0, MXFP4); sub-blocks 4h,
        /// 4h + 2 in `wide[2h]` and 4h + 1, 4h + 3 in `wide[2h + 1]` (Q4_K, Q5_K); blocks
        /// 4h..4h + 4's first 16 codes each in `wide[2h]`, their last 16 in `wide[2h + 1]`
        /// (the [`fours`]).
        wide: [__m512i; GROUP / 2],
    }

    impl VGroup {
        /// Every field zero (no instruction: the AVX2 path has no 512-bit ones).
        #[inline(always)]
        fn zeroed() -> VGroup {
            // SAFETY: every field is a SIMD vector, for which all-zero bits are valid.
            unsafe { std::mem::zeroed() }
        }
    }

    /// The 32 codes of 16 bytes of nibbles: low nibbles first, then high nibbles.
    #[inline(always)]
    unsafe fn nibbles(p: *const u8) -> __m256i {
        _mm256_and_si256(unmasked_nibbles(p), _mm256_set1_epi8(0x0f))
    }

    /// [`nibbles`] before the mask: each byte's low nibble is the code, its high one noise.
    #[inline(always)]
    unsafe fn unmasked_nibbles(p: *const u8) -> __m256i {
        // The 16 bytes in both halves (a broadcast load: no shuffle), the high half's shifted
        // by a nibble.
        let v = _mm256_broadcastsi128_si256(_mm_loadu_si128(p.cast()));
        _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4))
    }

    /// Byte v = 0x10 where bit v of `qh` is set, else 0 (the fifth bits of a Q5_0/Q5_1 block).
    #[inline(always)]
    unsafe fn fifth_bits(qh: u32) -> __m256i {
        // Byte v takes byte v/8 of qh (every 128-bit lane holds all four), then tests bit v%8.
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(qh as i32),
            _mm256_set_epi64x(
                0x0303_0303_0303_0303,
                0x0202_0202_0202_0202,
                0x0101_0101_0101_0101,
                0,
            ),
        );
        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
        _mm256_and_si256(
            _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
            _mm256_set1_epi8(0x10),
        )
    }

    /// The f16 at `p`, widened (F16C; the `half` crate would detect features per call).
    #[inline(always)]
    unsafe fn half(p: *const u8) -> f32 {
        let h = std::ptr::read_unaligned(p.cast::<u16>());
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))))
    }

    /// The low eight bytes of `v` widened to f32 lanes.
    #[inline(always)]
    unsafe fn widen8(v: __m128i) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
    }

    /// Byte v = 0x10 where byte v of `qh` has `bit` set, else 0 (a Q5_K sub-block's fifth
    /// bits).
    #[inline(always)]
    unsafe fn bit_to_fifth(qh: __m256i, bit: i8) -> __m256i {
        let bit = _mm256_set1_epi8(bit);
        _mm256_and_si256(
            _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit),
            _mm256_set1_epi8(0x10),
        )
    }

    /// The f16 at `p + j·stride` in lane j for `j < N`, widened; 0 in the other lanes.
    #[inline(always)]
    unsafe fn halves<const N: usize>(p: *const u8, stride: usize) -> __m256 {
        let at = |j: usize| {
            if j < N {
                std::ptr::read_unaligned(p.add(j * stride).cast::<i16>())
            } else {
                0
            }
        };
        _mm256_cvtph_ps(_mm_set_epi16(
            at(7),
            at(6),
            at(5),
            at(4),
            at(3),
            at(2),
            at(1),
            at(0),
        ))
    }

    /// The scales [`unpack`] gives the `N` MXFP4 blocks at `p`, lane by lane (for a test of
    /// every E8M0 byte).
    ///
    /// # Safety
    /// `p` must be valid for `N` blocks' reads; AVX2, FMA and F16C.
    #[cfg(test)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn mxfp4_scales<const N: usize>(p: *const u8) -> [f32; GROUP] {
        let g = unpack::<{ super::format_index(BlockFormat::Mxfp4) }, N, { kind::MADDUBS }>(p);
        let mut scale = [0f32; GROUP];
        _mm256_storeu_ps(scale.as_mut_ptr(), g.scale);
        scale
    }

    /// Unpacks the `N` sub-blocks of format `F` at `p` (see [`super::unpack`]; a K-quant
    /// super-block is always eight) for kernels that multiply as `K` says ([`kind`]). On the
    /// `dpbusd` paths Q8_0's codes come as `q + 128`; on the AVX-512 path the fifth bits are
    /// set under byte masks, and Q6_K's half scales come as i32 lanes (`sc_lo`, `sc_hi`)
    /// instead of `mul`.
    ///
    /// # Safety
    /// `p` must be valid for the reads of `N` sub-blocks' whole blocks; `K`'s instruction
    /// sets (AVX-512 BW and VL on the AVX-512 path).
    #[inline(always)]
    unsafe fn unpack<const F: usize, const N: usize, const K: u8>(p: *const u8) -> VGroup {
        let f = const { FORMATS[F] };
        let (bw, dpbusd) = (K == kind::AVX512, K != kind::MADDUBS);
        let bb = f.block_bytes();
        let mut g = VGroup::zeroed();
        let low4 = _mm256_set1_epi8(0x0f);
        let u32_at = |at: usize| std::ptr::read_unaligned(p.add(at).cast::<u32>());
        match f {
            BlockFormat::Q4_0 | BlockFormat::Q4_1 | BlockFormat::Q5_0 | BlockFormat::Q5_1 => {
                let qs = match f {
                    BlockFormat::Q4_0 => 2,
                    BlockFormat::Q4_1 => 4,
                    BlockFormat::Q5_0 => 6,
                    _ => 8,
                };
                let q5 = f == BlockFormat::Q5_0 || f == BlockFormat::Q5_1;
                for (j, c) in g.codes.iter_mut().enumerate().take(N) {
                    let codes = p.add(j * bb + qs);
                    *c = if q5 && bw {
                        // Byte v of the codes is value v: bit v of qh, as a byte mask, selects
                        // 0x10; one ternary op masks the nibbles and ors it in.
                        let qh = u32_at(j * bb + qs - 4);
                        let fifth = _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(0x10));
                        // (a & b) | c
                        _mm256_ternarylogic_epi32::<0xEA>(
                            unmasked_nibbles(codes),
                            _mm256_set1_epi8(0x0f),
                            fifth,
                        )
                    } else if q5 {
                        _mm256_or_si256(nibbles(codes), fifth_bits(u32_at(j * bb + qs - 4)))
                    } else {
                        nibbles(codes)
                    };
                }
                g.scale = halves::<N>(p, bb);
                if has_min(f) {
                    g.min = halves::<N>(p.add(2), bb);
                }
            }
            BlockFormat::Q8_0 => {
                for j in 0..N {
                    g.signed[j] = _mm256_loadu_si256(p.add(j * bb + 2).cast());
                    // See `dot_offset`.
                    g.codes[j] = if dpbusd {
                        _mm256_xor_si256(g.signed[j], _mm256_set1_epi8(i8::MIN))
                    } else {
                        _mm256_abs_epi8(g.signed[j])
                    };
                }
                g.scale = halves::<N>(p, bb);
            }
            BlockFormat::Q4K | BlockFormat::Q5K => {
                let sm = k4_scales_mins(p);
                // d and dmin widened, each then in every lane.
                let dd = _mm_cvtph_ps(_mm_cvtsi32_si128(p.cast::<i32>().read_unaligned()));
                let d = _mm256_broadcastss_ps(dd);
                let neg_dmin = _mm256_xor_ps(
                    _mm256_broadcastss_ps(_mm_movehdup_ps(dd)),
                    _mm256_set1_ps(-0.0),
                );
                g.scale = _mm256_mul_ps(widen8(sm), d);
                g.min = _mm256_mul_ps(widen8(_mm_unpackhi_epi64(sm, sm)), neg_dmin);
                let q5 = f == BlockFormat::Q5K;
                let qs = p.add(if q5 { 48 } else { 16 });
                let qh = _mm256_loadu_si256(p.add(16).cast());
                for i in 0..4 {
                    let v = _mm256_loadu_si256(qs.add(32 * i).cast());
                    let lo = _mm256_and_si256(v, low4);
                    let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                    if q5 && bw {
                        // Codes below 16: adding 16 under the bit's byte mask sets the fifth bit.
                        let fifth = _mm256_set1_epi8(0x10);
                        let k0 = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(1 << (2 * i)));
                        let k1 = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(1 << (2 * i + 1)));
                        g.codes[2 * i] = _mm256_mask_add_epi8(lo, k0, lo, fifth);
                        g.codes[2 * i + 1] = _mm256_mask_add_epi8(hi, k1, hi, fifth);
                    } else if q5 {
                        g.codes[2 * i] = _mm256_or_si256(lo, bit_to_fifth(qh, 1 << (2 * i)));
                        g.codes[2 * i + 1] =
                            _mm256_or_si256(hi, bit_to_fifth(qh, 1 << (2 * i + 1)));
                    } else {
                        g.codes[2 * i] = lo;
                        g.codes[2 * i + 1] = hi;
                    }
                }
            }
            BlockFormat::Mxfp4 => {
                let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(
                    const { mxfp4_codes() }.as_ptr().cast(),
                ));
                for (j, c) in g.codes.iter_mut().enumerate().take(N) {
                    *c = _mm256_shuffle_epi8(table, nibbles(p.add(j * bb + 1)));
                }
                // The scales' bits as `e8m0_half` makes them, lane by lane: `(e − 1) << 23`,
                // or the subnormal `0x200000 << e` for e < 2.
                let at = |j: usize| if j < N { i32::from(*p.add(j * bb)) } else { 0 };
                let e = _mm256_setr_epi32(at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7));
                let normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
                let subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
                let small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
                let bits = _mm256_blendv_epi8(normal, subnormal, small);
                // Lanes from `N` on are zero, as the other formats' (e = 0 gives 2^-128).
                let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let kept = _mm256_cmpgt_epi32(_mm256_set1_epi32(N as i32), lane);
                g.scale = _mm256_castsi256_ps(_mm256_and_si256(bits, kept));
            }
            BlockFormat::Q6K => {
                let two = _mm256_set1_epi8(0x30);
                for h in 0..2 {
                    let ql0 = _mm256_loadu_si256(p.add(64 * h).cast());
                    let ql1 = _mm256_loadu_si256(p.add(64 * h + 32).cast());
                    let qh = _mm256_loadu_si256(p.add(128 + 32 * h).cast());
                    // Each code's two high bits, moved to bits 4..6 (shifts stay within bytes
                    // where it matters: the masks keep bits 4 and 5 only).
                    let hi = [
                        _mm256_slli_epi16(qh, 4),
                        _mm256_slli_epi16(qh, 2),
                        qh,
                        _mm256_srli_epi16(qh, 2),
                    ];
                    let lo = [
                        ql0,
                        ql1,
                        _mm256_srli_epi16(ql0, 4),
                        _mm256_srli_epi16(ql1, 4),
                    ];
                    for k in 0..4 {
                        g.codes[4 * h + k] = _mm256_or_si256(
                            _mm256_and_si256(lo[k], low4),
                            _mm256_and_si256(hi[k], two),
                        );
                    }
                }
                let sc = _mm_loadu_si128(p.add(192).cast());
                g.sc16 = _mm256_cvtepi8_epi16(sc);
                if bw {
                    g.sc_lo = _mm256_cvtepi8_epi32(sc);
                    g.sc_hi = _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc, sc));
                } else if dpbusd {
                    // i32 lanes 0..4 of sub-block j's: its first half's scale, 4..8 its
                    // second's (a `dpbusd` lane sums 4 codes of one half).
                    let lo = _mm256_cvtepi8_epi32(sc);
                    let hi = _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc, sc));
                    for (j, m) in g.mul.iter_mut().enumerate() {
                        let (a, b) = ((2 * j % 8) as i32, (2 * j % 8 + 1) as i32);
                        let pick = _mm256_setr_epi32(a, a, a, a, b, b, b, b);
                        *m = _mm256_permutevar8x32_epi32(if j < 4 { lo } else { hi }, pick);
                    }
                } else {
                    // Even-numbered half scales in the low 128 bits, odd ones in the high:
                    // i16 lane j of each is sub-block j's (first half's, second half's) scale.
                    let deinterleave =
                        _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
                    let eo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, deinterleave));
                    for (j, m) in g.mul.iter_mut().enumerate() {
                        let pick = (((2 * j + 1) << 8) | (2 * j)) as i16;
                        *m = _mm256_shuffle_epi8(eo, _mm256_set1_epi16(pick));
                    }
                }
                g.scale = _mm256_set1_ps(half(p.add(208)));
            }
        }
        g
    }

    /// A whole group of format `F` at `p` unpacked for the AVX-512 path: `wide` (not `codes`)
    /// set.
    ///
    /// # Safety
    /// As [`unpack`] on that path.
    #[inline(always)]
    unsafe fn unpack_pairs<const F: usize>(p: *const u8) -> VGroup {
        match const { wide_order(FORMATS[F]) } {
            WideOrder::Halves => return wide_fours::<F>(p),
            WideOrder::Pairs => return wide_k_quant::<F>(p),
            WideOrder::Natural => {}
        }
        let mut g = unpack::<F, GROUP, { kind::AVX512 }>(p);
        for (k, wide) in g.wide.iter_mut().enumerate() {
            *wide = join(g.codes[2 * k], g.codes[2 * k + 1]);
        }
        g
    }

    /// The 4- and 5-bit formats of 32-value blocks whose fields start at even offsets
    /// (whole words): all but MXFP4.
    const fn fours(f: BlockFormat) -> bool {
        matches!(wide_order(f), WideOrder::Halves)
    }

    /// Word permutes of a [`fours`] group's bytes from `A` = bytes 0..64 and `B` = 64..128
    /// (index bit 5 picks `B`), or from `B` and `C` = 128..192.
    struct WordPicks {
        /// For blocks 4h..4h + 4: the 32 words of their codes (16 bytes each) from `A`, `B`
        /// (h = 0) or `B`, `C` (h = 1).
        codes: [[u16; 32]; 2],
        /// Lane j < 8: block j's scale; 8 + j its min; 16 + j the low word of its fifth
        /// bits, 24 + j the high word: from `A`, `B` …
        fields_ab: [u16; 32],
        /// … or, where the mask has the lane's bit, from `B`, `C`.
        fields_bc: ([u16; 32], u32),
    }

    /// [`WordPicks`] of format `f`'s group (none where not [`fours`]).
    const fn word_picks(f: BlockFormat) -> WordPicks {
        let mut p = WordPicks {
            codes: [[0; 32]; 2],
            fields_ab: [0; 32],
            fields_bc: ([0; 32], 0),
        };
        if !fours(f) {
            return p;
        }
        // Words: a block's, its codes', its fifth bits'.
        let (bw, qs) = (f.block_bytes() / 2, (f.block_bytes() - QK / 2) / 2);
        let mut l = 0;
        while l < 64 {
            let (h, block, word) = (l / 32, l / 8 % 4, l % 8);
            let at = (4 * h + block) * bw + qs + word;
            assert!(
                at >= 32 * h && at < 32 * h + 64,
                "codes lie in A, B or in B, C"
            );
            p.codes[h][l % 32] = (at - 32 * h) as u16;
            l += 1;
        }
        let q5 = matches!(f, BlockFormat::Q5_0 | BlockFormat::Q5_1);
        let mut j = 0;
        while j < 32 {
            let block = j % GROUP;
            let at = match j / GROUP {
                0 => Some(block * bw),
                1 if has_min(f) => Some(block * bw + 1),
                k if k >= 2 && q5 => Some(block * bw + qs - 2 + (k - 2)),
                _ => None,
            };
            if let Some(at) = at {
                assert!(at < 96, "a group's fields lie in A, B, C");
                if at < 64 {
                    p.fields_ab[j] = at as u16;
                } else {
                    p.fields_bc.0[j] = (at - 32) as u16;
                    p.fields_bc.1 |= 1 << j;
                }
            }
            j += 1;
        }
        p
    }

    /// The `i16` lanes of `w` (the first 32 a vector holds).
    #[inline(always)]
    unsafe fn words(w: &[u16; 32]) -> __m512i {
        _mm512_loadu_si512(w.as_ptr().cast())
    }

    /// A whole group of a [`fours`] format `F` at `p` into `g.wide`, `g.scale` and `g.min`,
    /// from three vector loads: four blocks' code bytes by one word permute, then their low
    /// and high nibbles (the first and last 16 codes of each) apart; the scales, mins and
    /// fifth bits by one or two more.
    ///
    /// # Safety
    /// `p` must be valid for the reads of a group; AVX-512 BW.
    #[inline(always)]
    unsafe fn wide_fours<const F: usize>(p: *const u8) -> VGroup {
        let f = const { FORMATS[F] };
        let picks = const { &word_picks(FORMATS[F]) };
        let mut g = VGroup::zeroed();
        let span = GROUP * f.block_bytes();
        let a = _mm512_loadu_si512(p.cast());
        let b = _mm512_loadu_si512(p.add(64).cast());
        // Only the group's own bytes past 128 (none past the row).
        let c = _mm512_maskz_loadu_epi8(u64::MAX >> (192 - span), p.add(128).cast());
        let mut fields = _mm512_permutex2var_epi16(a, words(&picks.fields_ab), b);
        if picks.fields_bc.1 != 0 {
            let bc = _mm512_permutex2var_epi16(b, words(&picks.fields_bc.0), c);
            fields = _mm512_mask_mov_epi16(fields, picks.fields_bc.1, bc);
        }
        // Bit 16i + v of `fifth[2h]` (`fifth[2h + 1]`): bit v (16 + v) of block 4h + i's.
        let mut fifth = [0u64; 4];
        if matches!(f, BlockFormat::Q5_0 | BlockFormat::Q5_1) {
            // Stored, and loaded from memory straight into mask registers (`black_box` keeps
            // the compiler from moving each through a general register instead: eight more
            // vector operations a group).
            let mut hi = [0u64; 4];
            _mm256_storeu_si256(
                hi.as_mut_ptr().cast(),
                _mm512_extracti64x4_epi64::<1>(fields),
            );
            let hi = std::hint::black_box(&hi);
            fifth = [0, 2, 1, 3].map(|i| _load_mask64(&hi[i]));
        }
        let low4 = _mm512_set1_epi8(0x0f);
        for h in 0..2 {
            let (x, y) = if h == 0 { (a, b) } else { (b, c) };
            let bytes = _mm512_permutex2var_epi16(x, words(&picks.codes[h]), y);
            let halves = [
                _mm512_and_si512(bytes, low4),
                _mm512_and_si512(_mm512_srli_epi16::<4>(bytes), low4),
            ];
            for (k, v) in halves.into_iter().enumerate() {
                g.wide[2 * h + k] =
                    _mm512_mask_add_epi8(v, fifth[2 * h + k], v, _mm512_set1_epi8(0x10));
            }
        }
        let sm = _mm512_cvtph_ps(_mm512_castsi512_si256(fields));
        g.scale = _mm512_castps512_ps256(sm);
        if has_min(f) {
            g.min = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(sm)));
        }
        g
    }

    /// A whole Q4_K/Q5_K super-block at `p` into `g.wide` ([`WideOrder::Pairs`]), `g.scale`
    /// and `g.min`: two 512-bit loads of codes, each split into low and high nibbles (the
    /// fifth bits added under byte masks of a broadcast of the 32 bytes that hold them), and
    /// the 16 scales and minimums widened and multiplied by `d` and `−dmin` as one vector.
    ///
    /// # Safety
    /// `p` must be valid for the reads of a super-block; AVX-512 BW.
    #[inline(always)]
    unsafe fn wide_k_quant<const F: usize>(p: *const u8) -> VGroup {
        let q5 = const { matches!(FORMATS[F], BlockFormat::Q5K) };
        let mut g = VGroup::zeroed();
        let sm = k4_scales_mins(p);
        // d in lanes 0..8, dmin in 8..16 (the other six words widened too, and unused).
        let dd = _mm512_permutexvar_ps(
            _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
            _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(p.cast()))),
        );
        // The sign bit flipped in lanes 8..16 (an integer xor: AVX-512 F, not DQ).
        let neg_high = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi32(i32::MIN));
        let dd = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dd), neg_high));
        let sm = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sm)), dd);
        g.scale = _mm512_castps512_ps256(sm);
        g.min = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(sm)));
        let qs = p.add(if q5 { 48 } else { 16 });
        let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(16).cast()));
        let low4 = _mm512_set1_epi8(0x0f);
        for h in 0..2 {
            let v = _mm512_loadu_si512(qs.add(64 * h).cast());
            let halves = [
                _mm512_and_si512(v, low4),
                _mm512_and_si512(_mm512_srli_epi16::<4>(v), low4),
            ];
            for (k, v) in halves.into_iter().enumerate() {
                // Sub-blocks 4h + k (low 256 bits) and 4h + k + 2 (high), whose fifth bits
                // are those bits of each byte of qh.
                g.wide[2 * h + k] = if q5 {
                    // Bit s of each byte moved to bit 4 (word shifts: bits moved across a
                    // byte boundary are masked off), s = 4h + k, + 2 in the high half.
                    let (s0, s1) = ((4 * h + k) as i16, (4 * h + k + 2) as i16);
                    let counts = |s: i16| _mm256_set1_epi16((s - 4).abs());
                    let counts =
                        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(counts(s0)), counts(s1));
                    let moved = if s1 <= 4 {
                        _mm512_sllv_epi16(qh, counts)
                    } else {
                        _mm512_srlv_epi16(qh, counts)
                    };
                    // (a & b) | c
                    _mm512_ternarylogic_epi32::<0xEA>(moved, _mm512_set1_epi8(0x10), v)
                } else {
                    v
                };
            }
        }
        g
    }

    /// Lane j = block j's integer sum `Σ c·q` for a whole [`fours`] group `g` (from
    /// [`wide_fours`]) against the codes at `q` in [`super::Quantized::q_halves`]' order.
    ///
    /// # Safety
    /// `q` must point at 256 codes; AVX-512 VNNI and BW.
    #[inline(always)]
    unsafe fn block_sums_of_fours(g: &VGroup, q: *const i8) -> __m256i {
        // Lanes 4i..4i + 4 of z[h]: block 4h + i's partial sums.
        let z: [__m512i; 2] = std::array::from_fn(|h| {
            let x = |k: usize| _mm512_loadu_si512(q.add(64 * (2 * h + k)).cast());
            let first = _mm512_dpbusd_epi32(_mm512_setzero_si512(), g.wide[2 * h], x(0));
            _mm512_dpbusd_epi32(first, g.wide[2 * h + 1], x(1))
        });
        narrowed_pair_sums(pair_sums(z[0], z[1]))
    }

    /// The `dpbusd` products of a whole group `g` with one token's codes at `q`: `z[k]` holds
    /// sub-blocks 2k (low 256 bits) and 2k + 1 (high) as eight i32 lanes each.
    ///
    /// # Safety
    /// `q` must point at 256 codes; AVX-512 VNNI and BW (`g` unpacked for that path).
    #[inline(always)]
    unsafe fn products(g: &VGroup, q: *const i8) -> [__m512i; GROUP / 2] {
        let mut z = [_mm512_setzero_si512(); GROUP / 2];
        for (k, z) in z.iter_mut().enumerate() {
            let x = _mm512_loadu_si512(q.add(2 * QK * k).cast());
            *z = _mm512_dpbusd_epi32(_mm512_setzero_si512(), g.wide[k], x);
        }
        z
    }

    /// Lane 2j (2j + 1) = sub-block j's first (second) 16-value half's integer sum `Σ c·q`
    /// for a whole group `g` against the codes at `q`, Q6_K's times that half's i8 scale
    /// (|Σ c·q| ≤ 16·63·127, so the product fits).
    ///
    /// # Safety
    /// As [`products`].
    #[inline(always)]
    unsafe fn scaled_half_sums<const F: usize>(g: &VGroup, q: *const i8) -> __m512i {
        let h = half_sums(&products(g, q));
        if const { matches!(FORMATS[F], BlockFormat::Q6K) } {
            _mm512_mullo_epi32(h, join(g.sc_lo, g.sc_hi))
        } else {
            h
        }
    }

    /// `lo` in the low 256 bits, `hi` in the high.
    #[inline(always)]
    unsafe fn join(lo: __m256i, hi: __m256i) -> __m512i {
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    }

    /// Lane i = the sum of the i-th four-lane run of `z` taken in order (`z[k]` holds
    /// sub-blocks 2k and 2k + 1 as `dpbusd` leaves them, so lanes 2j and 2j + 1 are sub-block
    /// j's two 16-value halves), by two rounds of even/odd permutes: 6 permutes and 3
    /// additions, each one micro-op that issues more than once per cycle, where `vphaddd`
    /// issues once per 2 cycles on Zen 4/5 (measured here: 0.5 per cycle against 1.6 for
    /// `vpermt2d`), which made the reduction a third of a Q4_K super-block's time.
    ///
    /// # Safety
    /// AVX-512 F.
    #[inline(always)]
    unsafe fn half_sums(z: &[__m512i; GROUP / 2]) -> __m512i {
        pair_sums(pair_sums(z[0], z[1]), pair_sums(z[2], z[3]))
    }

    /// Lanes 0..8 = the sums of `a`'s lane pairs, lanes 8..16 those of `b`'s.
    #[inline(always)]
    unsafe fn pair_sums(a: __m512i, b: __m512i) -> __m512i {
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        _mm512_add_epi32(
            _mm512_permutex2var_epi32(a, even, b),
            _mm512_permutex2var_epi32(a, odd, b),
        )
    }

    /// Lane j = sub-block j's integer sum `Σ c·q` for a whole Q4_K/Q5_K super-block `g`
    /// (from [`wide_k_quant`]) against the codes at `q` in [`WideOrder::Pairs`]' order. The
    /// products' lanes are summed by packing to i16 and pair sums (`packs`, `madd` with
    /// ones: two operations halve two vectors, where permutes take three): a product lane
    /// holds four code products, |c·q| ≤ 31·127, so it and the sum of two fit in an i16.
    ///
    /// # Safety
    /// As [`products`].
    #[inline(always)]
    unsafe fn sub_block_sums_of_pairs(g: &VGroup, q: *const i8) -> __m256i {
        // z[2h] holds sub-blocks 4h, 4h + 2; z[2h + 1] 4h + 1, 4h + 3; each sub-block in two
        // 128-bit lanes.
        let z = products(g, q);
        let ones = _mm512_set1_epi16(1);
        let halved = |a: __m512i, b: __m512i| _mm512_madd_epi16(_mm512_packs_epi32(a, b), ones);
        // 128-bit lane l: the sums of lane l of z[0], z[1], z[2], z[3] (sub-blocks 0, 1, 4, 5
        // in lanes 0 and 1, 2, 3, 6, 7 in lanes 2 and 3).
        let r = halved(halved(z[0], z[1]), halved(z[2], z[3]));
        let pick = |idx: __m512i| _mm512_castsi512_si256(_mm512_permutexvar_epi32(idx, r));
        _mm256_add_epi32(
            pick(_mm512_setr_epi32(
                0, 1, 8, 9, 2, 3, 10, 11, 0, 0, 0, 0, 0, 0, 0, 0,
            )),
            pick(_mm512_setr_epi32(
                4, 5, 12, 13, 6, 7, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0,
            )),
        )
    }

    /// Lane j = the sum of `h`'s lanes 2j and 2j + 1 (added in their 64-bit lane's low half,
    /// then narrowed: no `vphaddd`).
    #[inline(always)]
    unsafe fn narrowed_pair_sums(h: __m512i) -> __m256i {
        _mm512_cvtepi64_epi32(_mm512_add_epi32(h, _mm512_srli_epi64::<32>(h)))
    }

    /// Lanes 0..4 = `a`'s four lanes of its first 128 bits plus those of its second; lanes
    /// 4..8 the same of `b`.
    #[inline(always)]
    unsafe fn add_halves(a: __m256i, b: __m256i) -> __m256i {
        _mm256_add_epi32(
            _mm256_permute2x128_si256(a, b, 0x20),
            _mm256_permute2x128_si256(a, b, 0x31),
        )
    }

    /// Lane j = the sum of the 16 `maddubs` pair sums (i16) of `p[j]`, for a format whose
    /// [`i16_run`] `RUN` is 4 or 8: `hadd` levels add them in i16 while a lane holds at most
    /// `RUN` of them (exact, as in the panels), then one widening for all eight sub-blocks:
    /// `RUN` 8 sign-extends the two halves, 4 takes one `madd` per four sub-blocks, where
    /// the sums [`reduce8`] takes are widened by one each. The `madd`s were what an AVX2
    /// core without AVX-512 ran out of (Zen 1-class, 256-bit multiplies on one 128-bit
    /// port).
    #[inline(always)]
    unsafe fn reduce8_pair_sums<const RUN: usize>(p: &[__m256i; GROUP]) -> __m256i {
        const { assert!(RUN == 4 || RUN == 8) };
        let h = |a, b| _mm256_hadd_epi16(a, b);
        // Per 128-bit half: s0 s0 s1 s1 s2 s2 s3 s3, each lane 4 pair sums; then s4 … s7.
        let a = h(h(p[0], p[1]), h(p[2], p[3]));
        let b = h(h(p[4], p[5]), h(p[6], p[7]));
        if RUN == 8 {
            // Per half: s0 … s7, each lane 8 pair sums; the halves added in i32.
            let s = h(a, b);
            let lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(s));
            _mm256_add_epi32(lo, _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s, 1)))
        } else {
            let ones = _mm256_set1_epi16(1);
            add_halves(_mm256_madd_epi16(a, ones), _mm256_madd_epi16(b, ones))
        }
    }

    /// Lane j = Q6_K sub-block j's `Σ_h sc_h·Σ c·q` over its two halves, from its `maddubs`
    /// pair sums `p[j]` (the first 128 bits its first half's, as `mul[j]` holds the scales):
    /// one `hadd` level per pair of sub-blocks (Q6_K's [`i16_run`] is 2), then one `madd`
    /// with both sub-blocks' scales rather than one each (see [`reduce8_pair_sums`]).
    #[inline(always)]
    unsafe fn reduce8_q6k(p: &[__m256i; GROUP], mul: &[__m256i; GROUP]) -> __m256i {
        // Per 128-bit half: sub-block 2k's four i32 lanes' worth, then 2k + 1's: i32 lanes
        // [2k, 2k, 2k + 1, 2k + 1], each scaled by its half's scale.
        let q: [__m256i; 4] = std::array::from_fn(|k| {
            let scales = _mm256_blend_epi32::<0b1100_1100>(mul[2 * k], mul[2 * k + 1]);
            _mm256_madd_epi16(_mm256_hadd_epi16(p[2 * k], p[2 * k + 1]), scales)
        });
        // Per half: sub-blocks 0 … 3, then 4 … 7; the halves added.
        add_halves(_mm256_hadd_epi32(q[0], q[1]), _mm256_hadd_epi32(q[2], q[3]))
    }

    /// Lane j = the sum of the eight lanes of `s[j]` for `j < N`, zero above (`s[N..]` must be
    /// zero).
    #[inline(always)]
    unsafe fn reduce8<const N: usize>(s: &[__m256i; GROUP]) -> __m256i {
        if N <= 4 {
            // One 128-bit regrouping is enough for four sub-blocks.
            let a = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
            let sum = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
            return _mm256_zextsi128_si256(sum);
        }
        // Per 128-bit half: [s0 s1 s2 s3] partial sums, then [s4 … s7].
        let a = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
        let b = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
        add_halves(a, b)
    }

    /// One token's activations for one group, as [`super::ActGroup`]: 256 codes, 8 scales, 8
    /// sums, 16 half sums.
    #[derive(Clone, Copy)]
    struct ActPtrs {
        q: *const i8,
        /// The group's codes in its format's [`WideOrder`] (the `dpbusd` path's whole groups).
        q_wide: *const i8,
        d: *const f32,
        sum: *const i32,
        sum_d: *const f32,
        half: *const i16,
    }

    /// The `N` i32 at `p` (`N` = 8, 4, 2 or 1) in the low lanes, zeros above; reads nothing
    /// past them.
    #[inline(always)]
    unsafe fn lanes<const N: usize>(p: *const i32) -> __m256i {
        match N {
            8 => _mm256_loadu_si256(p.cast()),
            4 => _mm256_zextsi128_si256(_mm_loadu_si128(p.cast())),
            2 => _mm256_zextsi128_si256(_mm_loadl_epi64(p.cast())),
            _ => _mm256_zextsi128_si256(_mm_cvtsi32_si128(p.read_unaligned())),
        }
    }

    /// `acc` plus one token's dot product with the `N` sub-blocks of `g`, in lanes (the
    /// module docs' arithmetic, lane j for sub-block j; lanes from `N` on add zero),
    /// multiplied as `K` says ([`kind`]).
    ///
    /// # Safety
    /// `a` must point at `N` blocks' activations (a K-quant's eight: its half sums).
    #[inline(always)]
    unsafe fn dot<const F: usize, const N: usize, const K: u8>(
        g: &VGroup,
        a: ActPtrs,
        acc: __m256,
    ) -> __m256 {
        let f = const { FORMATS[F] };
        let (wide, maddubs) = (K == kind::AVX512, K == kind::MADDUBS);
        let offset = dot_offset(f, !maddubs);
        let run = const { i16_run(FORMATS[F]) };
        let ones = _mm256_set1_epi16(1);
        let mut s = [_mm256_setzero_si256(); GROUP];
        let order = const { wide_order(FORMATS[F]) };
        let mut isum = if wide && N == GROUP && order == WideOrder::Halves {
            block_sums_of_fours(g, a.q_wide)
        } else if wide && N == GROUP && order == WideOrder::Pairs {
            sub_block_sums_of_pairs(g, a.q_wide)
        } else if wide && N == GROUP {
            narrowed_pair_sums(scaled_half_sums::<F>(g, a.q))
        } else if maddubs && N == GROUP && (run >= 4 || f == BlockFormat::Q6K) {
            let p: [__m256i; GROUP] = std::array::from_fn(|j| {
                let x = _mm256_loadu_si256(a.q.add(QK * j).cast());
                _mm256_maddubs_epi16(g.codes[j], x)
            });
            match (f, run) {
                (BlockFormat::Q6K, _) => reduce8_q6k(&p, &g.mul),
                (_, 8) => reduce8_pair_sums::<8>(&p),
                _ => reduce8_pair_sums::<4>(&p),
            }
        } else {
            debug_assert!(!wide || f.block_elems() == QK, "K-quant groups are whole");
            for (j, s) in s.iter_mut().enumerate().take(N) {
                let x = _mm256_loadu_si256(a.q.add(QK * j).cast());
                let x = if f == BlockFormat::Q8_0 && maddubs {
                    _mm256_sign_epi8(x, g.signed[j])
                } else {
                    x
                };
                *s = match (f == BlockFormat::Q6K, maddubs) {
                    // Pair sums meet their half's scale as i16.
                    (true, true) => {
                        _mm256_madd_epi16(_mm256_maddubs_epi16(g.codes[j], x), g.mul[j])
                    }
                    (false, true) => _mm256_madd_epi16(_mm256_maddubs_epi16(g.codes[j], x), ones),
                    // Dword sums meet their half's scale as i32.
                    (true, false) => _mm256_mullo_epi32(
                        dpbusd::<K>(_mm256_setzero_si256(), g.codes[j], x),
                        g.mul[j],
                    ),
                    (false, false) => dpbusd::<K>(_mm256_setzero_si256(), g.codes[j], x),
                };
            }
            reduce8::<N>(&s)
        };
        if f == BlockFormat::Q6K {
            let off = _mm256_madd_epi16(g.sc16, _mm256_loadu_si256(a.half.cast()));
            isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(off, 5));
        } else if offset != 0 {
            // Offsets are powers of two.
            let sum = lanes::<N>(a.sum);
            let off = _mm256_sllv_epi32(sum, _mm256_set1_epi32(offset.trailing_zeros() as i32));
            isum = _mm256_sub_epi32(isum, off);
        }
        let dx = _mm256_castsi256_ps(lanes::<N>(a.d.cast()));
        let acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(g.scale, dx), acc);
        if has_min(f) {
            let sx = _mm256_castsi256_ps(lanes::<N>(a.sum_d.cast()));
            _mm256_fmadd_ps(g.min, sx, acc)
        } else {
            acc
        }
    }

    /// Adds to `acc[i]` token `t0+i`'s dot product with the `N` sub-blocks of `row` from
    /// sub-block `b` on (`N` = 8 for a K-quant super-block), unpacked once; `at(i, b)` points at
    /// that token's activations for them.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; the sub-blocks lie in `row` and `at` gives valid pointers.
    #[inline(always)]
    unsafe fn sub_blocks<const F: usize, const N: usize, const NT: usize, const K: u8>(
        row: &[u8],
        b: usize,
        at: &impl Fn(usize, usize) -> ActPtrs,
        acc: &mut [__m256; NT],
    ) {
        let f = const { FORMATS[F] };
        let start = b / (f.block_elems() / QK) * f.block_bytes();
        assert!(start + f.bytes_for(N * QK) <= row.len());
        let g = if K == kind::AVX512 && N == GROUP {
            unpack_pairs::<F>(row.as_ptr().add(start))
        } else {
            unpack::<F, N, K>(row.as_ptr().add(start))
        };
        // Unrolled by hand so the accumulators stay in registers.
        let mut i = 0;
        while i + 2 <= NT {
            acc[i] = dot::<F, N, K>(&g, at(i, b), acc[i]);
            acc[i + 1] = dot::<F, N, K>(&g, at(i + 1, b), acc[i + 1]);
            i += 2;
        }
        if i < NT {
            acc[i] = dot::<F, N, K>(&g, at(i, b), acc[i]);
        }
    }

    /// Compiles a kernel body once per way of multiplying ([`kind`]), each entry point with
    /// that way's instruction sets: a `#[target_feature]` function cannot take them as a
    /// parameter, and the body (`#[inline(always)]`) is compiled into each one's.
    ///
    /// # Safety (of every entry point)
    /// The instruction sets it names must be available, and the body's own conditions hold.
    macro_rules! per_kind {
        (
            [$($generics:tt)*] $params:tt $(-> $ret:ty)? => |$k:ident| $body:expr;
            $(#[$doc:meta])* $name:ident: $features:literal, $kind:expr; $($rest:tt)*
        ) => {
            $(#[$doc])*
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name<$($generics)*> $params $(-> $ret)? {
                const $k: u8 = $kind;
                $body
            }
            per_kind! { [$($generics)*] $params $(-> $ret)? => |$k| $body; $($rest)* }
        };
        ([$($generics:tt)*] $params:tt $(-> $ret:ty)? => |$k:ident| $body:expr;) => {};
    }

    per_kind! {
        [const F: usize, const NT: usize]
        (w: &[u8], row_bytes: usize, acts: &Acts<'_>, t0: usize, mut put: impl FnMut(usize, [f32; NT]))
        => |K| for (i, row) in w.chunks_exact(row_bytes).enumerate() {
            put(i, tile_with::<F, NT, K>(row, acts, t0));
        };
        /// Tokens `t0..t0+NT` against each row of `w` (whole rows of `row_bytes` bytes of
        /// format `F`), `put(i, outputs)` for row i: each group is unpacked once and dotted
        /// with every token. AVX2, FMA and F16C.
        tiles: "avx2,fma,f16c", kind::MADDUBS;
        /// [`tiles`] with AVX-VNNI's `dpbusd`.
        tiles_vex: "avx2,fma,f16c,avxvnni", kind::VEX;
        /// [`tiles_vex`] in EVEX encoding (AVX-512 VNNI and VL).
        tiles_evex: "avx2,fma,f16c,avx512vnni,avx512vl", kind::EVEX;
        /// [`tiles`] on the AVX-512 path (AVX-512 VNNI, VL and BW).
        tiles_vnni: "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw", kind::AVX512;
    }

    /// [`tile_with`]'s body, inlined into each entry point's features.
    #[inline(always)]
    unsafe fn tile_with<const F: usize, const NT: usize, const K: u8>(
        row: &[u8],
        acts: &Acts<'_>,
        t0: usize,
    ) -> [f32; NT] {
        let f = const { FORMATS[F] };
        let groups = row.len().div_ceil(group_bytes(f));
        // Every token's activations span `acts.blocks` ≥ 8·groups blocks.
        let first = t0 * acts.blocks;
        assert!(
            groups * GROUP <= acts.blocks && (t0 + NT) * acts.blocks <= acts.d.len(),
            "tile: activations for tokens {t0}..{} of {} groups",
            t0 + NT,
            groups
        );
        let wide = if K == kind::AVX512 {
            acts.wide(const { wide_order(FORMATS[F]) })
        } else {
            acts.q
        };
        assert!(wide.len() >= (t0 + NT) * acts.blocks * QK);
        let mut acc = [_mm256_setzero_ps(); NT];
        let at = |i: usize, b: usize| {
            let b = first + i * acts.blocks + b;
            // SAFETY: the sub-blocks read lie within token t0+i's blocks (asserted above).
            ActPtrs {
                q: acts.q.as_ptr().add(b * QK),
                q_wide: wide.as_ptr().add(b * QK),
                d: acts.d.as_ptr().add(b),
                sum: acts.sum.as_ptr().add(b),
                sum_d: acts.sum_d.as_ptr().add(b),
                half: acts.half.as_ptr().add(2 * b),
            }
        };
        // Whole groups, then a short row's last sub-blocks in fours, twos and ones (only the
        // 32-value formats have them), each unpacked once and dotted with every token.
        let full = row.len() / group_bytes(f);
        for gi in 0..full {
            // A tile's few tokens stream the rows: warm the group's lines ahead. A prefetch
            // never faults, past the weight included.
            for l in 0..group_bytes(f).div_ceil(64) {
                let ahead = row
                    .as_ptr()
                    .wrapping_add(gi * group_bytes(f) + 64 * l + PREFETCH_AHEAD);
                _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
            }
            sub_blocks::<F, GROUP, NT, K>(row, gi * GROUP, &at, &mut acc);
        }
        let mut b = full * GROUP;
        let rest = group_len(f, full * group_bytes(f), row.len());
        if rest & 4 != 0 {
            sub_blocks::<F, 4, NT, K>(row, b, &at, &mut acc);
            b += 4;
        }
        if rest & 2 != 0 {
            sub_blocks::<F, 2, NT, K>(row, b, &at, &mut acc);
            b += 2;
        }
        if rest & 1 != 0 {
            sub_blocks::<F, 1, NT, K>(row, b, &at, &mut acc);
        }
        let mut out = [0f32; NT];
        for (o, &a) in out.iter_mut().zip(&acc) {
            *o = hsum(a);
        }
        out
    }

    per_kind! {
        [const F: usize] (rows: &[&[u8]], order: &LaneMajor, u: &mut UnpackedRows)
        => |K| unpack_rows_with::<F, K>(rows, order, u);
        /// Unpacks `rows` (whole rows of format `F`, each of `order.len()` sub-blocks) into
        /// `u`, row r's sub-block `sb` at `order.position(sb)·rows.len() + r`: the pieces of
        /// [`tile_with`], each unpacked as it does. AVX2, FMA and F16C; `u` holds
        /// `rows.len()` rows.
        unpack_rows: "avx2,fma,f16c", kind::MADDUBS;
        /// [`unpack_rows`] for AVX-VNNI's `dpbusd`.
        unpack_rows_vex: "avx2,fma,f16c,avxvnni", kind::VEX;
        /// [`unpack_rows_vex`] in EVEX encoding (AVX-512 VNNI and VL).
        unpack_rows_evex: "avx2,fma,f16c,avx512vnni,avx512vl", kind::EVEX;
        /// [`unpack_rows`] for the AVX-512 path (AVX-512 VNNI, VL and BW).
        unpack_rows_vnni: "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw", kind::AVX512;
    }

    /// [`unpack_rows`]' body, inlined into each entry point's features.
    #[inline(always)]
    unsafe fn unpack_rows_with<const F: usize, const K: u8>(
        rows: &[&[u8]],
        order: &LaneMajor,
        u: &mut UnpackedRows,
    ) {
        let f = const { FORMATS[F] };
        let n = order.len();
        assert!(
            u.codes.len() >= rows.len() * n,
            "unpack_rows: {} rows",
            rows.len()
        );
        for (r, row) in rows.iter().enumerate() {
            assert!(row.len() == f.bytes_for(n * QK), "unpack_rows: row {r}");
            let at = |b: usize| {
                row.as_ptr()
                    .add(b / (f.block_elems() / QK) * f.block_bytes())
            };
            for gi in 0..order.full {
                let p = at(gi * GROUP);
                let g = unpack::<F, GROUP, K>(p);
                store_sub_blocks::<F, GROUP, K>(&g, p, gi * GROUP, (r, rows.len()), order, u);
            }
            let mut b = order.full * GROUP;
            if order.rest & 4 != 0 {
                let g = unpack::<F, 4, K>(at(b));
                store_sub_blocks::<F, 4, K>(&g, at(b), b, (r, rows.len()), order, u);
                b += 4;
            }
            if order.rest & 2 != 0 {
                let g = unpack::<F, 2, K>(at(b));
                store_sub_blocks::<F, 2, K>(&g, at(b), b, (r, rows.len()), order, u);
                b += 2;
            }
            if order.rest & 1 != 0 {
                let g = unpack::<F, 1, K>(at(b));
                store_sub_blocks::<F, 1, K>(&g, at(b), b, (r, rows.len()), order, u);
            }
        }
    }

    /// Stores the `N` sub-blocks of `g` (unpacked from `p`), sub-blocks `sb..sb + N` of row
    /// `r` of `rows`, in `u`.
    #[inline(always)]
    unsafe fn store_sub_blocks<const F: usize, const N: usize, const K: u8>(
        g: &VGroup,
        p: *const u8,
        sb: usize,
        (r, rows): (usize, usize),
        order: &LaneMajor,
        u: &mut UnpackedRows,
    ) {
        let f = const { FORMATS[F] };
        let (mut scale, mut min) = ([0f32; GROUP], [0f32; GROUP]);
        _mm256_storeu_ps(scale.as_mut_ptr(), g.scale);
        _mm256_storeu_ps(min.as_mut_ptr(), g.min);
        for j in 0..N {
            let at = order.position(sb + j) * rows + r;
            _mm256_storeu_si256(u.codes[at].as_mut_ptr().cast(), g.codes[j]);
            if f == BlockFormat::Q8_0 && K == kind::MADDUBS {
                _mm256_storeu_si256(u.signed[at].as_mut_ptr().cast(), g.signed[j]);
            }
            u.scale[at] = scale[j];
            u.min[at] = min[j];
            if f == BlockFormat::Q6K {
                let sc = |h: usize| i32::from(*p.add(192 + 2 * j + h).cast::<i8>());
                u.half_scales[at] = [sc(0), sc(1)];
            }
        }
    }

    /// The vectors a panel kernel runs on, a lane per token: one panel's [`PANEL`] tokens in
    /// 256 bits ([`Ymm`], multiplying as its [`kind`] says), or two consecutive panels' in 512
    /// ([`Zmm`], `dpbusd`). The operations are the same lane by lane either way.
    trait Lanes {
        type I: Copy;
        type F: Copy;
        /// Panels a vector holds.
        const PANELS: usize;
        /// Whether the products run on `maddubs` (Q8_0's signs then go onto the activations).
        const MADDUBS: bool;
        unsafe fn zero_i() -> Self::I;
        unsafe fn zero_f() -> Self::F;
        /// The lanes at `p`, the vector's first panel's first.
        unsafe fn load_i(p: *const i32) -> Self::I;
        unsafe fn load_f(p: *const f32) -> Self::F;
        unsafe fn set1_i(v: i32) -> Self::I;
        unsafe fn set1_f(v: f32) -> Self::F;
        /// `s` plus, per lane, the sum of the byte products of `w`'s unsigned and `x`'s
        /// signed dword (`dpbusd`; `maddubs` and `madd`, exact here: see the module docs).
        unsafe fn dot(s: Self::I, w: Self::I, x: Self::I) -> Self::I;
        /// `s` plus, per 16-bit lane, the sum of the byte products of `w`'s unsigned and
        /// `x`'s signed byte pair (`maddubs`; the caller keeps the sums in i16's range).
        unsafe fn dot16(s: Self::I, w: Self::I, x: Self::I) -> Self::I;
        /// `s` plus, per 32-bit lane, the sum of `p`'s two 16-bit lanes (`madd` with ones).
        unsafe fn widen_add(s: Self::I, p: Self::I) -> Self::I;
        /// `x` with each byte's sign flipped where `s`'s byte is negative, zero where zero.
        unsafe fn sign(x: Self::I, s: Self::I) -> Self::I;
        unsafe fn add_i(a: Self::I, b: Self::I) -> Self::I;
        unsafe fn sub_i(a: Self::I, b: Self::I) -> Self::I;
        unsafe fn mullo_i(a: Self::I, b: Self::I) -> Self::I;
        /// `a·32`.
        unsafe fn times32(a: Self::I) -> Self::I;
        unsafe fn cvt(a: Self::I) -> Self::F;
        unsafe fn mul_f(a: Self::F, b: Self::F) -> Self::F;
        unsafe fn add_f(a: Self::F, b: Self::F) -> Self::F;
        /// `a·b + c`, one rounding.
        unsafe fn fmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
        unsafe fn store_f(p: *mut f32, a: Self::F);
    }

    struct Ymm<const K: u8>;
    struct Zmm;

    /// `s` plus `dpbusd(w, x)` on 256-bit vectors in `K`'s encoding (a `dpbusd` [`kind`]).
    #[inline(always)]
    unsafe fn dpbusd<const K: u8>(s: __m256i, w: __m256i, x: __m256i) -> __m256i {
        if K == kind::VEX {
            _mm256_dpbusd_avx_epi32(s, w, x)
        } else {
            _mm256_dpbusd_epi32(s, w, x)
        }
    }

    impl<const K: u8> Lanes for Ymm<K> {
        type I = __m256i;
        type F = __m256;
        const PANELS: usize = 1;
        const MADDUBS: bool = K == kind::MADDUBS;
        #[inline(always)]
        unsafe fn zero_i() -> __m256i {
            _mm256_setzero_si256()
        }
        #[inline(always)]
        unsafe fn zero_f() -> __m256 {
            _mm256_setzero_ps()
        }
        #[inline(always)]
        unsafe fn load_i(p: *const i32) -> __m256i {
            _mm256_loadu_si256(p.cast())
        }
        #[inline(always)]
        unsafe fn load_f(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn set1_i(v: i32) -> __m256i {
            _mm256_set1_epi32(v)
        }
        #[inline(always)]
        unsafe fn set1_f(v: f32) -> __m256 {
            _mm256_set1_ps(v)
        }
        #[inline(always)]
        unsafe fn dot(s: __m256i, w: __m256i, x: __m256i) -> __m256i {
            if Self::MADDUBS {
                let pairs = _mm256_maddubs_epi16(w, x);
                _mm256_add_epi32(s, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
            } else {
                dpbusd::<K>(s, w, x)
            }
        }
        #[inline(always)]
        unsafe fn dot16(s: __m256i, w: __m256i, x: __m256i) -> __m256i {
            _mm256_add_epi16(s, _mm256_maddubs_epi16(w, x))
        }
        #[inline(always)]
        unsafe fn widen_add(s: __m256i, p: __m256i) -> __m256i {
            _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
        }
        #[inline(always)]
        unsafe fn sign(x: __m256i, s: __m256i) -> __m256i {
            _mm256_sign_epi8(x, s)
        }
        #[inline(always)]
        unsafe fn add_i(a: __m256i, b: __m256i) -> __m256i {
            _mm256_add_epi32(a, b)
        }
        #[inline(always)]
        unsafe fn sub_i(a: __m256i, b: __m256i) -> __m256i {
            _mm256_sub_epi32(a, b)
        }
        #[inline(always)]
        unsafe fn mullo_i(a: __m256i, b: __m256i) -> __m256i {
            _mm256_mullo_epi32(a, b)
        }
        #[inline(always)]
        unsafe fn times32(a: __m256i) -> __m256i {
            _mm256_slli_epi32(a, 5)
        }
        #[inline(always)]
        unsafe fn cvt(a: __m256i) -> __m256 {
            _mm256_cvtepi32_ps(a)
        }
        #[inline(always)]
        unsafe fn mul_f(a: __m256, b: __m256) -> __m256 {
            _mm256_mul_ps(a, b)
        }
        #[inline(always)]
        unsafe fn add_f(a: __m256, b: __m256) -> __m256 {
            _mm256_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn store_f(p: *mut f32, a: __m256) {
            _mm256_storeu_ps(p, a)
        }
    }

    impl Lanes for Zmm {
        type I = __m512i;
        type F = __m512;
        const PANELS: usize = 2;
        const MADDUBS: bool = false;
        #[inline(always)]
        unsafe fn zero_i() -> __m512i {
            _mm512_setzero_si512()
        }
        #[inline(always)]
        unsafe fn zero_f() -> __m512 {
            _mm512_setzero_ps()
        }
        #[inline(always)]
        unsafe fn load_i(p: *const i32) -> __m512i {
            _mm512_loadu_si512(p.cast())
        }
        #[inline(always)]
        unsafe fn load_f(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn set1_i(v: i32) -> __m512i {
            _mm512_set1_epi32(v)
        }
        #[inline(always)]
        unsafe fn set1_f(v: f32) -> __m512 {
            _mm512_set1_ps(v)
        }
        #[inline(always)]
        unsafe fn dot(s: __m512i, w: __m512i, x: __m512i) -> __m512i {
            _mm512_dpbusd_epi32(s, w, x)
        }
        #[inline(always)]
        unsafe fn dot16(_: __m512i, _: __m512i, _: __m512i) -> __m512i {
            unreachable!("the 512-bit panels run on dpbusd")
        }
        #[inline(always)]
        unsafe fn widen_add(_: __m512i, _: __m512i) -> __m512i {
            unreachable!("the 512-bit panels run on dpbusd")
        }
        #[inline(always)]
        unsafe fn sign(_: __m512i, _: __m512i) -> __m512i {
            unreachable!("the 512-bit panels run on dpbusd")
        }
        #[inline(always)]
        unsafe fn add_i(a: __m512i, b: __m512i) -> __m512i {
            _mm512_add_epi32(a, b)
        }
        #[inline(always)]
        unsafe fn sub_i(a: __m512i, b: __m512i) -> __m512i {
            _mm512_sub_epi32(a, b)
        }
        #[inline(always)]
        unsafe fn mullo_i(a: __m512i, b: __m512i) -> __m512i {
            _mm512_mullo_epi32(a, b)
        }
        #[inline(always)]
        unsafe fn times32(a: __m512i) -> __m512i {
            _mm512_slli_epi32::<5>(a)
        }
        #[inline(always)]
        unsafe fn cvt(a: __m512i) -> __m512 {
            _mm512_cvtepi32_ps(a)
        }
        #[inline(always)]
        unsafe fn mul_f(a: __m512, b: __m512) -> __m512 {
            _mm512_mul_ps(a, b)
        }
        #[inline(always)]
        unsafe fn add_f(a: __m512, b: __m512) -> __m512 {
            _mm512_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn store_f(p: *mut f32, a: __m512) {
            _mm512_storeu_ps(p, a)
        }
    }

    per_kind! {
        [const F: usize, const R: usize, const P: usize]
        (u: &UnpackedRows, order: &LaneMajor, p: &Panels<'_>, pi: usize) -> PanelOut<R, P>
        => |K| panel_with::<Ymm<K>, F, R, P>(u, order, p, pi);
        /// Panels `pi..pi + P` (one panel a unit) against the first `R` rows of `u` (unpacked
        /// by [`unpack_rows`] in `order`) on 256-bit vectors: see [`panel_with`]. AVX2, FMA
        /// and F16C.
        panel: "avx2,fma,f16c", kind::MADDUBS;
        /// [`panel`] with AVX-VNNI's `dpbusd`.
        panel_vex: "avx2,fma,f16c,avxvnni", kind::VEX;
        /// [`panel_vex`] in EVEX encoding (AVX-512 VNNI and VL; on the AVX-512 path, its
        /// single panels).
        panel_evex: "avx2,fma,f16c,avx512vnni,avx512vl", kind::EVEX;
    }

    /// Panels `pi..pi + 2·P` (`pi` even; a pair of panels a unit, on 512-bit vectors) with
    /// `dpbusd`.
    ///
    /// # Safety
    /// AVX2, FMA, F16C, AVX-512 F, VNNI, VL and BW must be available.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vnni,avx512vl,avx512bw")]
    pub(super) unsafe fn panel_pairs<const F: usize, const R: usize, const P: usize>(
        u: &UnpackedRows,
        order: &LaneMajor,
        p: &Panels<'_>,
        pi: usize,
    ) -> PanelOut<R, P> {
        panel_with::<Zmm, F, R, P>(u, order, p, pi)
    }

    /// `P` units of `L::PANELS` panels from panel `pi` on against the first `R` rows of `u`
    /// (unpacked by [`unpack_rows`] in `order`), lane i of a unit's vectors for its token
    /// i: each code dword of a sub-block, broadcast, meets the unit's tokens' codes in one
    /// product (no horizontal sums; each activation vector loaded serves the `R` rows and
    /// each broadcast the `P` units). The per-sub-block float steps are [`dot`]'s, lane for
    /// lane, one accumulator lane at a time over its sub-blocks in row order (so that one
    /// register per row and unit holds it), and [`hsum`]'s additions are done across the
    /// lanes' vectors: the outputs are [`tile_with`]'s bit for bit.
    #[inline(always)]
    unsafe fn panel_with<L: Lanes, const F: usize, const R: usize, const P: usize>(
        u: &UnpackedRows,
        order: &LaneMajor,
        p: &Panels<'_>,
        pi: usize,
    ) -> PanelOut<R, P> {
        let f = const { FORMATS[F] };
        let (q8, q6) = (f == BlockFormat::Q8_0, f == BlockFormat::Q6K);
        let offset = dot_offset(f, !L::MADDUBS);
        let n = order.len();
        let step = L::PANELS;
        let pair_blocks = p.count.div_ceil(2) * p.blocks;
        assert!(
            u.codes.len() >= R * n
                && (!q8 || !L::MADDUBS || u.signed.len() >= R * n)
                && (!q6 || u.half_scales.len() >= R * n)
                && u.scale.len() >= R * n
                && u.min.len() >= R * n
                && n <= p.blocks
                && (step == 1 || pi.is_multiple_of(2))
                && pi + step * P <= p.count
                && p.q.len() >= pair_blocks * 2 * PANEL * QK
                && p.d.len() >= pair_blocks * 2 * PANEL
                && p.sum.len() >= pair_blocks * 2 * PANEL
                && p.half.len() >= pair_blocks * 4 * PANEL,
            "panel: {R} unpacked rows of {n} sub-blocks, {P} units of {step} from panel {pi}",
        );
        // lanes[j][pp][r]: lane j of [`tile_with`]'s accumulator for row r, for each token of
        // unit pp. Left uninitialised until each lane is written whole: zeroing them first
        // took a `memset` call a panel, 5% of a prefill at the AVX2 level.
        let mut lanes = [const { MaybeUninit::<[[L::F; R]; P]>::uninit() }; GROUP];
        for (j, lane) in lanes.iter_mut().enumerate() {
            let mut acc = [[L::zero_f(); R]; P];
            for pos in order.starts[j]..order.starts[j + 1] {
                // Position pos's rows lie together.
                let w: [*const i32; R] =
                    std::array::from_fn(|r| u.codes.as_ptr().add(pos * R + r).cast());
                let signs: [*const i32; R] =
                    std::array::from_fn(|r| u.signed.as_ptr().wrapping_add(pos * R + r).cast());
                let at: [PanelBlock; P] = std::array::from_fn(|pp| p.block(pi + step * pp, pos));
                let mut isum = if q6 {
                    // Σ_h sc_h·(Σ c·q − 32·Σq) over the two halves with their i8 scales.
                    let mut d0 = panel_dots::<L, F, R, P>(p, at, w, signs, 0..4);
                    let d1 = panel_dots::<L, F, R, P>(p, at, w, signs, 4..8);
                    for pp in 0..P {
                        let half = p.half.as_ptr().add(at[pp].half);
                        let hs0 = L::times32(L::load_i(half));
                        let hs1 = L::times32(L::load_i(half.add(2 * PANEL)));
                        for r in 0..R {
                            let [sc0, sc1] = u.half_scales[pos * R + r];
                            d0[pp][r] = L::add_i(
                                L::mullo_i(L::sub_i(d0[pp][r], hs0), L::set1_i(sc0)),
                                L::mullo_i(L::sub_i(d1[pp][r], hs1), L::set1_i(sc1)),
                            );
                        }
                    }
                    d0
                } else {
                    panel_dots::<L, F, R, P>(p, at, w, signs, 0..8)
                };
                for (pp, acc) in acc.iter_mut().enumerate() {
                    let sum = L::load_i(p.sum.as_ptr().add(at[pp].scalars));
                    if !q6 && offset != 0 {
                        let off = L::mullo_i(sum, L::set1_i(offset));
                        for s in isum[pp].iter_mut() {
                            *s = L::sub_i(*s, off);
                        }
                    }
                    let dx = L::load_f(p.d.as_ptr().add(at[pp].scalars));
                    let sx = L::mul_f(L::cvt(sum), dx);
                    for r in 0..R {
                        let sdx = L::mul_f(L::set1_f(u.scale[pos * R + r]), dx);
                        acc[r] = L::fmadd(L::cvt(isum[pp][r]), sdx, acc[r]);
                        if has_min(f) {
                            acc[r] = L::fmadd(L::set1_f(u.min[pos * R + r]), sx, acc[r]);
                        }
                    }
                }
            }
            lane.write(acc);
        }
        let mut out = [[[0f32; 2 * PANEL]; R]; P];
        for (pp, out) in out.iter_mut().enumerate() {
            for (r, o) in out.iter_mut().enumerate() {
                // SAFETY: the loop above wrote every lane.
                let a = |j: usize| unsafe { lanes[j].assume_init_ref() }[pp][r];
                // hsum's order: lanes j and j+4, then (0+2) + (1+3).
                let (s0, s1) = (L::add_f(a(0), a(4)), L::add_f(a(1), a(5)));
                let (s2, s3) = (L::add_f(a(2), a(6)), L::add_f(a(3), a(7)));
                L::store_f(o.as_mut_ptr(), L::add_f(L::add_f(s0, s2), L::add_f(s1, s3)));
            }
        }
        out
    }

    /// Per unit pp and row r, `Σ_k (w[r][k], broadcast) · (dword k of each token of
    /// at[pp])` over `ks` (Q8_0 with `maddubs`: the magnitudes against the activations under
    /// `signs[r][k]`'s signs); each tokens' vector is loaded once for all the rows and each
    /// broadcast made once for all the units. On the `maddubs` path the pair sums of
    /// [`i16_run`] dwords add up in i16 before one `madd` widens them (the same exact sums,
    /// one widening a run rather than a dword). A function, not a closure: a closure that is
    /// not inlined loses the target features, and its intrinsics with them.
    ///
    /// # Safety
    /// The vector path's features; `at` lies in `p`, each `w` (and `signs`, for Q8_0 with
    /// `maddubs`) points at eight dwords.
    #[inline(always)]
    unsafe fn panel_dots<L: Lanes, const F: usize, const R: usize, const P: usize>(
        p: &Panels<'_>,
        at: [PanelBlock; P],
        w: [*const i32; R],
        signs: [*const i32; R],
        ks: Range<usize>,
    ) -> [[L::I; R]; P] {
        let q8 = const { FORMATS[F] } == BlockFormat::Q8_0;
        let run = const { i16_run(FORMATS[F]) };
        // Q8_0's signs go onto the activations dword by dword (below), a run of one.
        const { assert!(!(matches!(FORMATS[F], BlockFormat::Q8_0) && i16_run(FORMATS[F]) > 1)) };
        let xk = |k: usize| -> [L::I; P] {
            std::array::from_fn(|pp| {
                L::load_i(p.q.as_ptr().add(at[pp].codes + k * PANEL_ROW).cast())
            })
        };
        let mut s = [[L::zero_i(); R]; P];
        if L::MADDUBS && run > 1 {
            debug_assert!(ks.len().is_multiple_of(run));
            for k0 in ks.step_by(run) {
                let mut s16 = [[L::zero_i(); R]; P];
                for k in k0..k0 + run {
                    let xk = xk(k);
                    for r in 0..R {
                        let wk = L::set1_i(*w[r].add(k));
                        for pp in 0..P {
                            s16[pp][r] = L::dot16(s16[pp][r], wk, xk[pp]);
                        }
                    }
                }
                for (s, s16) in s.iter_mut().zip(&s16) {
                    for (s, &s16) in s.iter_mut().zip(s16) {
                        *s = L::widen_add(*s, s16);
                    }
                }
            }
            return s;
        }
        for k in ks {
            let xk = xk(k);
            for r in 0..R {
                let wk = L::set1_i(*w[r].add(k));
                for pp in 0..P {
                    let x = if q8 && L::MADDUBS {
                        L::sign(xk[pp], L::set1_i(*signs[r].add(k)))
                    } else {
                        xk[pp]
                    };
                    s[pp][r] = L::dot(s[pp][r], wk, x);
                }
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kvplug_backend_kit::model::blocks::dequantize_row;
    use kvplug_backend_kit::model::{ModelDevice, StoredDtype, StoredTensor};
    use kvplug_backend_kit::testing::{additive_parts, random_blocks, Rng};
    use kvplug_backend_kit::KitError;

    use super::*;
    use crate::tensor::CpuTensor;
    use crate::CpuDevice;

    /// Every path this CPU can run (within `KVPLUG_CPU_ISA`), the 256-bit `dpbusd` one in
    /// each encoding it has.
    fn paths() -> Vec<Path> {
        let mut p = vec![Path::Scalar];
        if vector_path() {
            p.push(Path::Avx2);
        }
        match dot256() {
            Dot256::Maddubs => {}
            Dot256::Vex => {
                p.push(Path::Avx2Vnni { vex: true });
                #[cfg(target_arch = "x86_64")]
                if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
                    p.push(Path::Avx2Vnni { vex: false });
                }
            }
            Dot256::Evex => p.push(Path::Avx2Vnni { vex: false }),
        }
        if vnni_path() {
            p.push(Path::Vnni);
        }
        p
    }

    /// What token `ti`'s activation row looks like.
    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    enum Row {
        /// Uniform in ±1 (±100 for odd tokens).
        Plain,
        /// Uniform in ±1 but one value of 1000 and one of -300.
        Outlier,
        /// All zeros.
        Zero,
    }

    fn row_kind(ti: usize) -> Row {
        match ti % 4 {
            1 => Row::Outlier,
            2 => Row::Zero,
            _ => Row::Plain,
        }
    }

    fn activations(t: usize, cols: usize, rng: &mut Rng) -> Vec<f32> {
        let mut x = Vec::with_capacity(t * cols);
        for ti in 0..t {
            let scale = if ti % 2 == 1 { 100.0 } else { 1.0 };
            let start = x.len();
            x.extend((0..cols).map(|_| match row_kind(ti) {
                Row::Zero => 0.0,
                _ => rng.signed() * scale,
            }));
            if row_kind(ti) == Row::Outlier {
                x[start + 5] = 1000.0;
                x[start + cols - 3] = -300.0;
            }
        }
        x
    }

    /// Checks `run(path)` for one weight against the f64 reference `Σ_c w[c]·x[c]`, `w` the
    /// kit's `dequantize_row` widened to f64, within a bound derived from the arithmetic (u =
    /// 2⁻²⁴, the f32 unit roundoff; γ_k = k·u/(1 − k·u); underflow excluded):
    ///
    /// 1. *Activation quantization.* Block b's scale is `d_b = fl(amax_b/127) ≤
    ///    (amax_b/127)(1+u)` and `≥ (amax_b/127)(1−u)`, so `|x/d_b| ≤ 127/(1−u) < 128`, and the
    ///    f32 quotient `fl(x/d_b)` is off by at most `128·u` code units. Rounding it moves at
    ///    most 1/2 more, so `|q − x/d_b| ≤ 1/2 + 128u` and `|x̂ − x| ≤ (d_b/2)(1+δ)` for the
    ///    quantized value `x̂ = d_b·q`, with `δ = 2·128·u`. The kernel's exact value is `Σ_c
    ///    w_ex[c]·x̂[c]`, `w_ex` the exact dequantized weight, so this contributes at most `Σ_b
    ///    (d_b/2)(1+δ)·Σ_{c∈b}|w_ex[c]|`.
    /// 2. *f32 accumulation.* The integer sums are exact and convert to f32 exactly (module
    ///    docs), and `scale_j`, `min_j` are exact. Each term `f32(I_j)·scale_j·d_j` or
    ///    `min_j·f32(s_j)·d_j` takes at most two product roundings (one on the vector path),
    ///    then at most one addition per term of its accumulator (≤ 2 per 32-value block: 2·nb
    ///    with nb = cols/32) and 3 more reducing the eight lanes. With k = 2·nb + 4 the error is
    ///    at most `γ_k·Σ|terms|`, and `Σ|terms| ≤ Σ_c (|w_ex[c]| + 2|m[c]|)·|x̂[c]|`, `m[c]` the
    ///    value's additive part (the scaled code is `w_ex − m`; formats whose offsets are
    ///    integer have no such term, m = 0); `|x̂| ≤ |x| + (d_b/2)(1+δ)`.
    /// 3. *The reference's own rounding.* `dequantize_row` rounds `d·q + m` once in f32 (exact
    ///    for the formats without `m`), so `|w_ex| ≤ |w|(1+2u)` and `Σ|w_ex − w|·|x| ≤
    ///    γ_1·Σ|w·x|`; the f64 sum adds at most `γ⁽⁶⁴⁾_cols·Σ|w·x|`.
    ///
    /// Also checks the bound means something: on plain rows it is at most 2% of `Σ|w·x|`
    /// (term 1 dominates: `(d_b/2)/E|x| ≈ (1/254)/(1/2)`, under 1%, for uniform x). And
    /// where there are more than 3 tokens, token 3 is aimed at weight row 0 so that term 1
    /// is nearly reached: every block has d = 1 (one value ±127) and values ±(k + 3/4) with
    /// the signs of row 0's weights, so row 0's rounding errors (1/4 each) all add up, to
    /// half the bound's 1/2 per value; truncating codes (3/4 each) would exceed it.
    fn check(path: Path, f: BlockFormat, t: usize, rows: usize, cols: usize, seed: u64) {
        let mut rng = Rng(seed);
        let be = f.block_elems();
        let w = random_blocks(f, rows * cols / be, &mut rng);
        let mut x = activations(t, cols, &mut rng);
        if t > 3 {
            let mut w0 = vec![0f32; cols];
            dequantize_row(f, &w[..f.bytes_for(cols)], &mut w0);
            for (c, (x, w)) in x[3 * cols..4 * cols].iter_mut().zip(&w0).enumerate() {
                let k = if c % QK == 0 {
                    127.0
                } else {
                    (c * 37 % 126) as f32 + 0.75
                };
                *x = if *w < 0.0 { -k } else { k };
            }
        }
        check_weights(path, f, &w, &x, t, rows, cols);
    }

    /// [`check`]'s comparison for given weights `w` (`rows` rows) and activations `x` (`t`
    /// tokens).
    fn check_weights(
        path: Path,
        f: BlockFormat,
        w: &[u8],
        x: &[f32],
        t: usize,
        rows: usize,
        cols: usize,
    ) {
        let mut out = vec![f32::NAN; t * rows];
        run(path, x, t, f, w, rows, cols, &mut out);

        let u = 2f64.powi(-24);
        let gamma = |k: f64| k * u / (1.0 - k * u);
        let gamma64 = cols as f64 * 2f64.powi(-53) / (1.0 - cols as f64 * 2f64.powi(-53));
        let nb = cols / QK;
        let k = 2.0 * nb as f64 + 4.0;
        let delta = 2.0 * 128.0 * u;
        let rb = f.bytes_for(cols);
        let (mut wd, mut m) = (vec![0f32; cols], vec![0f32; cols]);
        for r in 0..rows {
            let row = &w[r * rb..(r + 1) * rb];
            dequantize_row(f, row, &mut wd);
            additive_parts(f, row, &mut m);
            for ti in 0..t {
                let xr = &x[ti * cols..(ti + 1) * cols];
                let (mut want, mut mag, mut act, mut terms) = (0f64, 0f64, 0f64, 0f64);
                for b in 0..nb {
                    let xb = &xr[b * QK..(b + 1) * QK];
                    let amax = xb.iter().fold(0f64, |a, &v| a.max(f64::from(v).abs()));
                    let e = amax / 127.0 * (1.0 + u) / 2.0 * (1.0 + delta);
                    for c in b * QK..(b + 1) * QK {
                        let (wv, xv) = (f64::from(wd[c]), f64::from(xr[c]));
                        let w_ex = wv.abs() * (1.0 + 2.0 * u);
                        want += wv * xv;
                        mag += (wv * xv).abs();
                        act += e * w_ex;
                        terms += (w_ex + 2.0 * f64::from(m[c]).abs()) * (xv.abs() + e);
                    }
                }
                let bound = act + gamma(k) * terms + (gamma(1.0) + gamma64) * mag;
                let got = f64::from(out[ti * rows + r]);
                assert!(
                    (got - want).abs() <= bound,
                    "{} {path:?} t {t} rows {rows} cols {cols}: token {ti} ({:?}) row {r}: \
                     got {got}, want {want}, |diff| {:e} > bound {bound:e}",
                    f.name(),
                    row_kind(ti),
                    (got - want).abs()
                );
                if row_kind(ti) == Row::Plain {
                    assert!(
                        bound <= 2e-2 * mag,
                        "{} cols {cols}: bound {bound:e} is vacuous against Σ|w·x| {mag:e}",
                        f.name()
                    );
                }
            }
        }
    }

    #[test]
    fn every_format_shape_and_path_is_within_the_derived_bound() {
        // Tokens: one (decode), short tiles of three and seven, two panels, and sixteen
        // panels and a tile of two, enough to quantize on every thread. Rows: odd counts, one
        // task or several.
        // Columns: whole groups, and every partial last group the vector path splits (1, 2,
        // 4 and 7 = 4 + 2 + 1 sub-blocks, alone or after whole groups).
        let shapes = [(1, 37), (3, 5), (7, 13), (16, 70), (130, 3)];
        for (fi, f) in FORMATS.into_iter().enumerate() {
            let cols: &[usize] = if f.block_elems() == QK {
                &[32, 64, 128, 224, 256, 288, 512, 896]
            } else {
                &[256, 512]
            };
            for &c in cols {
                for (si, &(t, rows)) in shapes.iter().enumerate() {
                    for path in paths() {
                        check(path, f, t, rows, c, (fi * 1000 + c * 10 + si) as u64 + 1);
                    }
                }
            }
        }
    }

    #[test]
    fn the_largest_codes_against_the_largest_activations_are_within_the_bound() {
        // Every weight code at its largest (Q8_0: 127) against activation codes of 127 and
        // of −127: the integer sums at their extremes, where a kernel's narrowed lane sums
        // (i16 on some paths) would saturate. Tokens of each sign in tiles (2) and in panels
        // (`MIN_PANEL_TOKENS`).
        let (rows, cols) = (3, 512);
        let tokens = |t: usize| -> Vec<f32> {
            (0..t)
                .flat_map(|i| std::iter::repeat_n(if i % 2 == 0 { 1f32 } else { -1.0 }, cols))
                .collect()
        };
        for f in FORMATS {
            let (codes, top) = match f {
                BlockFormat::Q4_0 => (2..18, 0xff),
                BlockFormat::Q4_1 => (4..20, 0xff),
                BlockFormat::Q5_0 => (2..22, 0xff),
                BlockFormat::Q5_1 => (4..24, 0xff),
                BlockFormat::Q8_0 => (2..34, 0x7f),
                BlockFormat::Q4K => (16..144, 0xff),
                BlockFormat::Q5K => (16..176, 0xff),
                BlockFormat::Q6K => (0..192, 0xff),
                // Nibble 7: kvalue 12 (E2M1's 6, doubled), the largest unsigned code (28).
                BlockFormat::Mxfp4 => (1..17, 0x77),
            };
            let mut w = random_blocks(f, rows * cols / f.block_elems(), &mut Rng(5));
            for b in w.chunks_exact_mut(f.block_bytes()) {
                b[codes.clone()].fill(top);
            }
            for t in [2, MIN_PANEL_TOKENS] {
                for path in paths() {
                    check_weights(path, f, &w, &tokens(t), t, rows, cols);
                }
            }
        }
    }

    #[test]
    fn a_token_gets_the_same_output_alone_or_batched() {
        // Fifteen panels (on the `dpbusd` path: two passes of three pairs, a pair, a lone
        // panel) and a tile of five, over rows in blocks of four and one alone; 992
        // columns end in 4 + 2 + 1 sub-blocks, 896 in 4, and 26880 columns take the panels in
        // chunks of six.
        for cols in [512, 896, 992, 26880] {
            same_output_alone_or_batched(125, 9, cols);
        }
        // Below the panels: one tile of every size up to SHORT_TILE, then tiles of four and
        // one of the rest.
        for t in 2..MIN_PANEL_TOKENS {
            for cols in [768, 992] {
                same_output_alone_or_batched(t, 5, cols);
            }
        }
    }

    fn same_output_alone_or_batched(t: usize, rows: usize, cols: usize) {
        let mut rng = Rng(7);
        let x = activations(t, cols, &mut rng);
        for f in FORMATS
            .into_iter()
            .filter(|f| cols.is_multiple_of(f.block_elems()))
        {
            let w = random_blocks(f, rows * cols / f.block_elems(), &mut rng);
            for path in paths() {
                let mut all = vec![0f32; t * rows];
                run(path, &x, t, f, &w, rows, cols, &mut all);
                for ti in 0..t {
                    let mut one = vec![0f32; rows];
                    run(
                        path,
                        &x[ti * cols..(ti + 1) * cols],
                        1,
                        f,
                        &w,
                        rows,
                        cols,
                        &mut one,
                    );
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&one),
                        bits(&all[ti * rows..(ti + 1) * rows]),
                        "{} {path:?} cols {cols} token {ti}",
                        f.name()
                    );
                }
            }
        }
    }

    #[test]
    fn no_columns_give_empty_sums() {
        for path in paths() {
            for t in [1, 4, 16] {
                let mut out = vec![1f32; t * 3];
                run(path, &[], t, BlockFormat::Q4K, &[], 3, 0, &mut out);
                assert!(out.iter().all(|&v| v == 0.0), "{path:?} t {t}");
            }
        }
    }

    #[test]
    fn matrices_of_one_input_give_each_ones_own_outputs() {
        // A decode step (the split stream, whose shares cross from one matrix into the
        // next), a short prefill and a panel-sized one, on mixed formats (each activation
        // order of the `dpbusd` path) and row counts.
        let (cols, mut rng) = (512, Rng(11));
        let shapes = [
            (BlockFormat::Q5_0, 70),
            (BlockFormat::Q8_0, 3),
            (BlockFormat::Q6K, 41),
            (BlockFormat::Q4K, 9),
        ];
        let ws = shapes.map(|(f, rows)| random_blocks(f, rows * cols / f.block_elems(), &mut rng));
        for t in [1, 5, 17] {
            let x = activations(t, cols, &mut rng);
            for path in paths() {
                let mut fused = shapes.map(|(_, rows)| vec![0f32; t * rows]);
                let mut outs = fused.iter_mut();
                let matrices: [_; 4] = std::array::from_fn(|i| BlockMatrix {
                    format: shapes[i].0,
                    w: &ws[i],
                    rows: shapes[i].1,
                    out: outs.next().expect("one output per matrix"),
                });
                run_many(path, &x, t, cols, matrices);
                for (i, &(f, rows)) in shapes.iter().enumerate() {
                    let mut alone = vec![0f32; t * rows];
                    run(path, &x, t, f, &ws[i], rows, cols, &mut alone);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&fused[i]), bits(&alone), "{path:?} t {t} matrix {i}");
                }
            }
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn every_mxfp4_scale_byte_unpacks_as_the_kit_reads_it() {
        if !vector_path() {
            return;
        }
        let bits = |s: [f32; GROUP]| s.map(f32::to_bits);
        for first in (0..=255u8).step_by(GROUP) {
            let mut blocks = [0u8; GROUP * 17];
            for (j, b) in blocks.chunks_exact_mut(17).enumerate() {
                b[0] = first + j as u8;
            }
            let want = std::array::from_fn(|j| e8m0_half(first + j as u8));
            // SAFETY: eight whole blocks; the vector path's features are there.
            let got = unsafe { x86::mxfp4_scales::<GROUP>(blocks.as_ptr()) };
            assert_eq!(bits(got), bits(want), "bytes from {first}");
            // Fewer blocks: the lanes past them are zero.
            let got = unsafe { x86::mxfp4_scales::<2>(blocks.as_ptr()) };
            let want = std::array::from_fn(|j| if j < 2 { want[j] } else { 0.0 });
            assert_eq!(bits(got), bits(want), "bytes from {first}");
        }
    }

    #[test]
    fn the_vector_paths_agree_bit_for_bit() {
        // Their integer sums are exact and their float steps the same (module docs); on a CPU
        // without VNNI there is one vector path and nothing to compare. Tiles alone, then
        // panels and tiles.
        let vector: Vec<Path> = paths().into_iter().filter(|&p| p != Path::Scalar).collect();
        let (rows, cols) = (11, 768);
        let mut rng = Rng(11);
        for (t, f) in [5, 37].into_iter().flat_map(|t| FORMATS.map(|f| (t, f))) {
            let x = activations(t, cols, &mut rng);
            let w = random_blocks(f, rows * cols / f.block_elems(), &mut rng);
            let outs: Vec<Vec<u32>> = vector
                .iter()
                .map(|&path| {
                    let mut out = vec![0f32; t * rows];
                    run(path, &x, t, f, &w, rows, cols, &mut out);
                    out.iter().map(|v| v.to_bits()).collect()
                })
                .collect();
            assert!(outs.windows(2).all(|p| p[0] == p[1]), "{}", f.name());
        }
    }

    #[test]
    fn activations_quantize_to_codes_rounded_half_away_from_zero() {
        // Block 0 has amax 127, so d = 1 and the codes are x rounded; block 1 is zero; blocks
        // 3..8 pad the row to a whole group.
        let mut x = vec![0f32; 96];
        x[..6].copy_from_slice(&[127.0, 0.5, 1.5, -2.5, -0.499_999_97, 2.499_999_8]);
        x[64..96]
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = i as f32 - 3.0);
        let mut rng = Rng(3);
        let noise: Vec<f32> = (0..4 * 512).map(|_| rng.signed() * 7.0).collect();
        let mut codes = Vec::new();
        for path in paths() {
            let mut buf = Quantized::default();
            let a = buf.quantize(path, &x, 1, 96, &[]);
            assert_eq!(a.blocks, GROUP);
            assert_eq!(a.q[..6], [127, 1, 2, -3, 0, 2], "{path:?}");
            assert_eq!((a.d[0], a.d[1]), (1.0, 0.0));
            assert!(a.q[32..64].iter().all(|&q| q == 0));
            // Block 2: amax 28, codes round(v·127/28).
            assert_eq!(a.d[2], 28.0 / 127.0);
            let want: Vec<i8> = x[64..96]
                .iter()
                .map(|&v| (v / (28.0f32 / 127.0)).round() as i8)
                .collect();
            assert_eq!(a.q[64..96], want[..]);
            assert_eq!(a.sum[2], want.iter().map(|&q| i32::from(q)).sum::<i32>());
            let h0: i16 = want[..16].iter().map(|&q| i16::from(q)).sum();
            assert_eq!(a.half[4..6], [h0, a.sum[2] as i16 - h0]);
            assert!(a.q[96..].iter().all(|&q| q == 0) && a.d[3..].iter().all(|&d| d == 0.0));
            // Random rows, quantized on every thread: the same codes on every path.
            let a = buf.quantize(path, &noise, 4, 512, &[]);
            codes.push((a.q.to_vec(), a.d.to_vec(), a.sum.to_vec(), a.half.to_vec()));
        }
        assert!(codes.windows(2).all(|p| p[0] == p[1]));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn k4_scales_by_shuffles_match_the_kit() {
        if !is_x86_feature_detected!("ssse3") {
            return;
        }
        #[target_feature(enable = "ssse3")]
        unsafe fn unpacked(block: &[u8; 16]) -> [u8; 16] {
            // SAFETY: 16 bytes read, SSSE3 detected by the caller.
            unsafe { std::mem::transmute(x86::k4_scales_mins(block.as_ptr())) }
        }
        let mut rng = Rng(11);
        for _ in 0..1000 {
            let block: [u8; 16] = std::array::from_fn(|_| rng.bits() as u8);
            // SAFETY: SSSE3 was detected above.
            let sm = unsafe { unpacked(&block) };
            let q = &block[4..];
            for j in 0..8 {
                assert_eq!(
                    (sm[j], sm[8 + j]),
                    k4_scale_min(j, q),
                    "{q:?} sub-block {j}"
                );
            }
        }
    }

    #[test]
    fn the_device_runs_projections_of_one_input_as_each_alone() {
        use kvplug_backend_kit::model::Projection;
        let (dev, cols, t) = (CpuDevice::new(), 512, 2);
        let mut rng = Rng(9);
        let stored = |dtype, bytes: Vec<u8>| {
            let n = bytes.len();
            StoredTensor::new(dtype, Arc::new(bytes), 0..n).expect("whole elements")
        };
        let block = |f: BlockFormat, rows: usize, rng: &mut Rng| {
            let bytes = random_blocks(f, rows * cols / f.block_elems(), rng);
            let w = dev.weight(stored(StoredDtype::Block(f), bytes), rows, cols);
            (w.expect("whole blocks"), rows)
        };
        let (q, k, v) = (
            block(BlockFormat::Q4K, 6, &mut rng),
            block(BlockFormat::Q8_0, 2, &mut rng),
            block(BlockFormat::Q5_0, 3, &mut rng),
        );
        let f32s: Vec<u8> = (0..3 * cols)
            .flat_map(|i| ((i as f32 * 0.11).cos()).to_le_bytes())
            .collect();
        let plain = (
            dev.weight(stored(StoredDtype::F32, f32s), 3, cols).unwrap(),
            3,
        );
        let x = CpuTensor::new(&[t, cols], activations(t, cols, &mut rng));
        let bias = |n: usize| CpuTensor::new(&[n], (0..n).map(|i| i as f32 - 1.5).collect());
        let (bq, bk) = (bias(6), bias(2));
        // All block weights (one fused job, biases after), and a set with an f32 weight (one
        // linear each): either way each output as `linear` alone gives it.
        for third in [&v, &plain] {
            let ws = [(&q, Some(&bq)), (&k, Some(&bk)), (third, None)];
            let mut outs = ws.map(|((_, rows), _)| CpuTensor::zeros(&[t, *rows]));
            let mut it = outs.iter_mut();
            let mut ps = ws.map(|((w, _), b)| Projection {
                w,
                bias: b,
                out: it.next().unwrap(),
            });
            dev.linears(&x, &mut ps).unwrap();
            for (((w, rows), b), got) in ws.iter().zip(&outs) {
                let mut want = CpuTensor::zeros(&[t, *rows]);
                dev.linear(&x, w, *b, &mut want).unwrap();
                assert_eq!(got.data, want.data);
            }
        }
        // A bias of the wrong length on the second: refused before anything is written.
        let mut outs = [6, 2, 3].map(|rows| CpuTensor::new(&[t, rows], vec![7.0; t * rows]));
        let [o0, o1, o2] = &mut outs;
        let mut ps = [
            Projection {
                w: &q.0,
                bias: None,
                out: o0,
            },
            Projection {
                w: &k.0,
                bias: Some(&bq),
                out: o1,
            },
            Projection {
                w: &v.0,
                bias: None,
                out: o2,
            },
        ];
        assert!(matches!(dev.linears(&x, &mut ps), Err(KitError::Device(_))));
        assert!(outs.iter().all(|o| o.data.iter().all(|&v| v == 7.0)));
    }

    #[test]
    fn the_device_takes_block_weights_in_whole_blocks() {
        let dev = CpuDevice::new();
        let f = BlockFormat::Q4K;
        let (rows, cols) = (3, 512);
        let bytes = random_blocks(f, rows * cols / 256, &mut Rng(5));
        let n = bytes.len();
        let stored = StoredTensor::new(StoredDtype::Block(f), Arc::new(bytes.clone()), 0..n)
            .expect("whole blocks");
        // 1536 values as 12 rows of 128: rows would split blocks.
        assert!(matches!(
            dev.weight(stored.clone(), 12, 128),
            Err(KitError::Device(_))
        ));
        let w = dev
            .weight(stored, rows, cols)
            .expect("whole blocks per row");
        let x: Vec<f32> = (0..2 * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut out = CpuTensor::zeros(&[2, rows]);
        dev.linear(&CpuTensor::new(&[2, cols], x.clone()), &w, None, &mut out)
            .unwrap();
        let mut want = vec![0f32; 2 * rows];
        linear_blocks(&x, 2, f, &bytes, rows, cols, &mut want);
        assert_eq!(out.data, want);
        let mut row = CpuTensor::zeros(&[1, cols]);
        dev.embed(&w, &[2], &mut row).unwrap();
        let mut deq = vec![0f32; cols];
        dequantize_row(f, &bytes[2 * n / rows..], &mut deq);
        assert_eq!(row.data, deq);
    }
}
