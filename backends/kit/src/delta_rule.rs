//! The gated delta rule's arithmetic over a step's tokens, per value head, after the
//! convolution (see [`Anchors::run_layer`](crate::anchors::Anchors::run_layer) for the
//! rule). A token advances its head's state row by row. A **run** of at least
//! [`MIN_CHUNKED_RUN`] tokens of one sequence (a prefill chunk) advances it in the chunked
//! form instead, [`CHUNK`] tokens at a time, which reads the state twice per chunk instead
//! of twice per token.
//!
//! The chunked form (the WY form of Yang et al.'s gated DeltaNet). With `S₀` the state
//! before a chunk, `Gₜ` the sum of the log decays of its tokens up to `t`, `γₜ = e^{Gₜ}`,
//! the rule `Sₜ = gₜ·Sₜ₋₁ + kₜ·uₜᵀ`, `uₜ = bₜ·(vₜ − gₜ·Sₜ₋₁ᵀkₜ)` unrolls to
//!
//! - `uₜ = bₜ·(vₜ − γₜ·S₀ᵀkₜ) − bₜ·Σ_{s<t} e^{Gₜ−Gₛ}·(kₜ·kₛ)·uₛ` (forward substitution),
//! - `outₜ = γₜ·S₀ᵀqₜ + Σ_{s≤t} e^{Gₜ−Gₛ}·(qₜ·kₛ)·uₛ`,
//! - `S_end = γ_end·S₀ + Σₛ e^{G_end−Gₛ}·kₛ·uₛᵀ`,
//!
//! every factor `e^{…}` of a non-positive exponent (decays are at most 1), so nothing
//! overflows where the token-by-token rule does not. In exact arithmetic both forms are
//! equal; in f32 they round differently, within the bound `testing::check_delta_verbs`
//! derives.
//!
//! On x86-64 the loops are compiled a second time for AVX2 and FMA and chosen at run time
//! (the rule runs on the host for every backend).

use std::ops::Range;

/// Tokens of a run advanced together in the chunked form.
pub const CHUNK: usize = 64;

/// Runs shorter than this (a decode step, a speculative chain) go token by token: a chunk's
/// products with the state cost about as much for 2 tokens as for 64.
pub const MIN_CHUNKED_RUN: usize = 32;

/// A step's tokens as the rule reads them, after the convolution and the activations.
pub struct Tokens<'a> {
    /// Each head's size (`dk = dv`), key heads, value heads (value head `h` reads key head
    /// `h mod hk`).
    pub n: usize,
    pub hk: usize,
    pub hv: usize,
    /// `[T][2·hk·n]`: each token's L2-normalized q (also scaled by `1/√n`), then k.
    pub qk: &'a [f32],
    /// `[T][hv·n]`: each token's SiLU'd v.
    pub v: &'a [f32],
    /// `[T][hv]`: each token's log decay per value head, `a·softplus(alpha)` (≤ 0).
    pub lg: &'a [f32],
    /// `[T][hv]`: each token's step size per value head, `sigmoid(beta)`.
    pub b: &'a [f32],
}

/// Tokens `start..end` of a step, one sequence's positions in order, advancing one state
/// in place in slot `home` from the state in slot `from` (`NO_STATE`: zeros; `home`:
/// already there).
#[derive(Clone, Copy, Debug)]
pub struct Run {
    pub start: usize,
    pub end: usize,
    pub from: u32,
    pub home: u32,
}

/// [`Run::from`] of a run that starts a sequence.
pub const NO_STATE: u32 = u32::MAX;

/// One thread's buffers, kept between steps (no allocation once warm).
#[derive(Default)]
pub struct Scratch {
    /// `[n][CHUNK]`: a chunk's `S₀ᵀk` and `S₀ᵀq` by token; its k and q transposed.
    ks: Vec<f32>,
    qs: Vec<f32>,
    kt: Vec<f32>,
    qt: Vec<f32>,
    /// `[CHUNK][CHUNK]`: `k_c·k_s` and `q_c·k_s`.
    kk: Vec<f32>,
    qk: Vec<f32>,
    /// `[CHUNK][n]`: a chunk's `u`, k and q by token.
    u: Vec<f32>,
    kr: Vec<f32>,
    qr: Vec<f32>,
    /// Per token of a chunk: its `G` (in f64: differences of sums of many decays), and two
    /// rows of coefficients.
    gc: Vec<f64>,
    w: Vec<f32>,
    e: Vec<f32>,
    /// One state row, copied before it is updated in place.
    row: Vec<f32>,
}

impl Tokens<'_> {
    /// Advances value heads `heads` over `runs`: `states` holds each slot's states of
    /// those heads (`[head][j][i]`, `S[i][j]` in row `j`), `out` receives each token's
    /// outputs of those heads.
    pub fn advance<S: States + ?Sized, O: Outputs + ?Sized>(
        &self,
        heads: Range<usize>,
        runs: &[Run],
        states: &mut S,
        out: &mut O,
        sc: &mut Scratch,
    ) {
        let n = self.n;
        for buf in [
            &mut sc.ks, &mut sc.qs, &mut sc.kt, &mut sc.qt, &mut sc.u, &mut sc.kr, &mut sc.qr,
        ] {
            buf.resize(CHUNK * n, 0.0);
        }
        sc.kk.resize(CHUNK * CHUNK, 0.0);
        sc.qk.resize(CHUNK * CHUNK, 0.0);
        sc.gc.resize(CHUNK, 0.0);
        sc.w.resize(CHUNK, 0.0);
        sc.e.resize(CHUNK, 0.0);
        sc.row.resize(n, 0.0);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has the features `advance_avx2` is compiled for.
            return unsafe { self.advance_avx2(heads, runs, states, out, sc) };
        }
        self.advance_any::<false, S, O>(heads, runs, states, out, sc)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn advance_avx2<S: States + ?Sized, O: Outputs + ?Sized>(
        &self,
        heads: Range<usize>,
        runs: &[Run],
        states: &mut S,
        out: &mut O,
        sc: &mut Scratch,
    ) {
        self.advance_any::<true, S, O>(heads, runs, states, out, sc)
    }

    /// [`Tokens::advance`], products fused (`FUSED`: one rounding each, where the CPU has
    /// FMA) or not.
    #[inline(always)]
    fn advance_any<const FUSED: bool, S: States + ?Sized, O: Outputs + ?Sized>(
        &self,
        heads: Range<usize>,
        runs: &[Run],
        states: &mut S,
        out: &mut O,
        sc: &mut Scratch,
    ) {
        let nn = self.n * self.n;
        for r in runs {
            let (from, to) = states.pair(r.from, r.home);
            for (x, h) in heads.clone().enumerate() {
                let from = from.map(|f| &f[x * nn..(x + 1) * nn]);
                let to = &mut to[x * nn..(x + 1) * nn];
                if r.end - r.start < MIN_CHUNKED_RUN {
                    let mut from = from;
                    for t in r.start..r.end {
                        self.token(h, t, from, to, &mut out.row(t)[x * self.n..], sc);
                        from = None;
                    }
                    continue;
                }
                let mut from = from;
                for start in (r.start..r.end).step_by(CHUNK) {
                    let toks = start..(start + CHUNK).min(r.end);
                    self.chunk::<FUSED, O>(h, x, toks, from, to, out, sc);
                    from = None;
                }
            }
        }
    }

    /// Token `t`'s q, k (of value head `h`'s key head) and v.
    #[inline(always)]
    fn qkv(&self, h: usize, t: usize) -> (&[f32], &[f32], &[f32]) {
        let (n, hk) = (self.n, self.hk);
        let qk = &self.qk[t * 2 * hk * n..(t + 1) * 2 * hk * n];
        let kh = h % hk;
        (
            &qk[kh * n..(kh + 1) * n],
            &qk[(hk + kh) * n..(hk + kh + 1) * n],
            &self.v[(t * self.hv + h) * n..(t * self.hv + h + 1) * n],
        )
    }

    /// One token through head `h`, row by row: decay, recall along k, correct toward v,
    /// read along q; `to` from `from` (`None`: in place).
    #[inline(always)]
    fn token(
        &self,
        h: usize,
        t: usize,
        from: Option<&[f32]>,
        to: &mut [f32],
        out: &mut [f32],
        sc: &mut Scratch,
    ) {
        let n = self.n;
        let (q, k, v) = self.qkv(h, t);
        let g = self.lg[t * self.hv + h].exp();
        let b = self.b[t * self.hv + h];
        for (j, row) in to.chunks_exact_mut(n).enumerate() {
            let old = match from {
                Some(f) => &f[j * n..(j + 1) * n],
                None => {
                    sc.row.copy_from_slice(row);
                    &sc.row[..]
                }
            };
            let delta = (v[j] - g * dot(old, k)) * b;
            out[j] = decay_update_dot(row, old, g, k, delta, q);
        }
    }

    /// Tokens `toks` (at most [`CHUNK`], one run) through head `h` (the `x`th of the
    /// thread's heads) in the chunked form (module doc); `to` from `from` (`None`: in
    /// place). Its products are small matrix products ([`rows_times`], [`add_combination`]).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn chunk<const FUSED: bool, O: Outputs + ?Sized>(
        &self,
        h: usize,
        x: usize,
        toks: Range<usize>,
        from: Option<&[f32]>,
        to: &mut [f32],
        out: &mut O,
        sc: &mut Scratch,
    ) {
        let (n, hv) = (self.n, self.hv);
        let (t0, l) = (toks.start, toks.len());
        // Columns of the products over the chunk's tokens, whole blocks.
        let cols = l.div_ceil(BLK) * BLK;
        // G in f64, each log decay at least just below the flush (a factor spanning it
        // flushes either way; −∞ or a huge decay would otherwise make G meaningless).
        let mut g = 0f64;
        for (c, t) in toks.clone().enumerate() {
            let lg = self.lg[t * hv + h];
            g += if lg < FLUSHED_LOG_DECAY {
                FLUSHED_LOG_DECAY - 1.0
            } else {
                lg
            } as f64;
            sc.gc[c] = g;
            let (q, k, _) = self.qkv(h, t);
            sc.kr[c * n..(c + 1) * n].copy_from_slice(k);
            sc.qr[c * n..(c + 1) * n].copy_from_slice(q);
            for i in 0..n {
                sc.kt[i * CHUNK + c] = k[i];
                sc.qt[i * CHUNK + c] = q[i];
            }
        }
        // `[j][c]`: (S₀ᵀk_c)[j], (S₀ᵀq_c)[j]; `[c][s]`: k_c·k_s, q_c·k_s.
        let s0 = from.unwrap_or(&*to);
        rows_times::<FUSED>(s0, n, &sc.kt, cols, &mut sc.ks);
        rows_times::<FUSED>(s0, n, &sc.qt, cols, &mut sc.qs);
        rows_times::<FUSED>(&sc.kr[..l * n], n, &sc.kt, cols, &mut sc.kk);
        rows_times::<FUSED>(&sc.qr[..l * n], n, &sc.kt, cols, &mut sc.qk);
        // u by forward substitution, then each output.
        for c in 0..l {
            let t = t0 + c;
            let (_, _, v) = self.qkv(h, t);
            let b = self.b[t * hv + h];
            let gamma = decay(sc.gc[c] as f32);
            for s in 0..=c {
                let e = decay((sc.gc[c] - sc.gc[s]) as f32);
                sc.w[s] = -b * e * sc.kk[c * CHUNK + s];
                sc.e[s] = e * sc.qk[c * CHUNK + s];
            }
            let (done, rest) = sc.u.split_at_mut(c * n);
            let u = &mut rest[..n];
            for (j, (u, &v)) in u.iter_mut().zip(v).enumerate() {
                *u = b * (v - gamma * sc.ks[j * CHUNK + c]);
            }
            add_combination::<FUSED>(u, &sc.w[..c], done);
            let o = &mut out.row(t)[x * n..(x + 1) * n];
            for (j, o) in o.iter_mut().enumerate() {
                *o = gamma * sc.qs[j * CHUNK + c];
            }
            add_combination::<FUSED>(o, &sc.e[..=c], &sc.u[..(c + 1) * n]);
        }
        // S_end = γ_end·S₀ + Σ_c e^{G_end−G_c}·k_c·u_cᵀ; row j adds `Σ_c e^{…}·u_c[j]·k_c`.
        let g_end = sc.gc[l - 1];
        for c in 0..l {
            sc.e[c] = decay((g_end - sc.gc[c]) as f32);
        }
        let gamma = decay(g_end as f32);
        for j in 0..n {
            for c in 0..l {
                sc.w[c] = sc.e[c] * sc.u[c * n + j];
            }
            let row = &mut to[j * n..(j + 1) * n];
            match from {
                Some(f) => {
                    for (r, &o) in row.iter_mut().zip(&f[j * n..(j + 1) * n]) {
                        *r = gamma * o;
                    }
                }
                None => row.iter_mut().for_each(|r| *r *= gamma),
            }
            add_combination::<FUSED>(row, &sc.w[..l], &sc.kr[..l * n]);
        }
    }
}

/// Where a thread's runs keep their states: each slot's states of the thread's heads.
pub trait States {
    /// Slot `from`'s states (read only) and slot `home`'s (written): `None` when the run
    /// advances in place (`from` is `home`, or [`NO_STATE`]: `home` zeroed first).
    fn pair(&mut self, from: u32, home: u32) -> (Option<&[f32]>, &mut [f32]);
}

/// Slot `s`'s states are `self[s]`.
impl States for [&mut [f32]] {
    fn pair(&mut self, from: u32, home: u32) -> (Option<&[f32]>, &mut [f32]) {
        let home = home as usize;
        if from == NO_STATE || from as usize == home {
            if from == NO_STATE {
                self[home].fill(0.0);
            }
            return (None, &mut *self[home]);
        }
        let (from, to) = two(self, from as usize, home);
        (Some(&**from), &mut **to)
    }
}

/// The same, held in a `Vec` (one thread's part of a split layer).
impl States for Vec<&mut [f32]> {
    fn pair(&mut self, from: u32, home: u32) -> (Option<&[f32]>, &mut [f32]) {
        self[..].pair(from, home)
    }
}

/// Where a thread's tokens put their outputs.
pub trait Outputs {
    /// Token `t`'s outputs of the thread's heads.
    fn row(&mut self, t: usize) -> &mut [f32];
}

/// Token `t`'s outputs are `self[t]`.
impl Outputs for [&mut [f32]] {
    fn row(&mut self, t: usize) -> &mut [f32] {
        self[t]
    }
}

/// The same, held in a `Vec`.
impl Outputs for Vec<&mut [f32]> {
    fn row(&mut self, t: usize) -> &mut [f32] {
        self[t]
    }
}

/// Every head's outputs on one thread: token `t`'s are the `t`th `width` values of `data`.
pub struct Rows<'a> {
    pub data: &'a mut [f32],
    pub width: usize,
}

impl Outputs for Rows<'_> {
    fn row(&mut self, t: usize) -> &mut [f32] {
        &mut self.data[t * self.width..(t + 1) * self.width]
    }
}

/// Item `a` (read) and item `b` (written) of `items`, `a != b`.
pub fn two<T>(items: &mut [T], a: usize, b: usize) -> (&T, &mut T) {
    let (lo, hi) = items.split_at_mut(a.max(b));
    if a < b {
        (&lo[a], &mut hi[0])
    } else {
        (&hi[0], &mut lo[b])
    }
}

/// Log decays below this make [`decay`] zero.
const FLUSHED_LOG_DECAY: f32 = -64.0;

/// `e^x` of a (non-positive) log decay, zero below [`FLUSHED_LOG_DECAY`] (`e^{-64}` is
/// 1.6e-28). The terms dropped are 2⁻⁹² of their undecayed size, far below an f32
/// rounding of the terms kept beside them; kept, they would make the products that scale
/// by them subnormal, which x86 cores compute in microcode: a chunk of strongly decaying
/// heads (a random-weight file's, or a real model's forgetting heads) ran 5× slower.
#[inline(always)]
fn decay(x: f32) -> f32 {
    if x < FLUSHED_LOG_DECAY {
        0.0
    } else {
        x.exp()
    }
}

/// Lanes of the partial sums below: independent accumulators the compiler keeps in vector
/// registers (a float sum in one accumulator cannot be vectorized).
const LANES: usize = 8;

/// Columns a product keeps in registers at a time.
const BLK: usize = 64;

/// `a·b + c`, fused (one rounding) when `FUSED`.
#[inline(always)]
pub(crate) fn madd<const FUSED: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FUSED {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `Σ a·b`, in `LANES` partial sums.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ac, bc) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `out[r][c] = Σᵢ a[r][i]·bt[i][c]` for each row `r` of `a` (`n` wide) and `c < cols`
/// (whole [`BLK`]s), `bt` and `out` rows [`CHUNK`] wide: a row's value broadcast over a
/// block of columns held in registers.
#[inline(always)]
fn rows_times<const FUSED: bool>(a: &[f32], n: usize, bt: &[f32], cols: usize, out: &mut [f32]) {
    for (ar, or) in a.chunks_exact(n).zip(out.chunks_exact_mut(CHUNK)) {
        for cb in (0..cols).step_by(BLK) {
            let mut acc = [0f32; BLK];
            for (i, &x) in ar.iter().enumerate() {
                let b = &bt[i * CHUNK + cb..i * CHUNK + cb + BLK];
                for l in 0..BLK {
                    acc[l] = madd::<FUSED>(x, b[l], acc[l]);
                }
            }
            or[cb..cb + BLK].copy_from_slice(&acc);
        }
    }
}

/// `y ← y + Σₛ coefs[s]·rows[s]` (`rows` `y.len()` wide), a block of `y` in registers.
#[inline(always)]
fn add_combination<const FUSED: bool>(y: &mut [f32], coefs: &[f32], rows: &[f32]) {
    let n = y.len();
    let full = n / BLK * BLK;
    for cb in (0..full).step_by(BLK) {
        let mut acc = [0f32; BLK];
        acc.copy_from_slice(&y[cb..cb + BLK]);
        for (s, &a) in coefs.iter().enumerate() {
            let r = &rows[s * n + cb..s * n + cb + BLK];
            for l in 0..BLK {
                acc[l] = madd::<FUSED>(a, r[l], acc[l]);
            }
        }
        y[cb..cb + BLK].copy_from_slice(&acc);
    }
    for (j, y) in y.iter_mut().enumerate().skip(full) {
        for (s, &a) in coefs.iter().enumerate() {
            *y = madd::<FUSED>(a, rows[s * n + j], *y);
        }
    }
}

/// `row ← g·old + delta·k`, returning `Σ row·q` of the new row, in `LANES` partial sums.
#[inline(always)]
fn decay_update_dot(row: &mut [f32], old: &[f32], g: f32, k: &[f32], delta: f32, q: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let n = row.len() / LANES * LANES;
    for (((r, o), k), q) in row[..n]
        .chunks_exact_mut(LANES)
        .zip(old.chunks_exact(LANES))
        .zip(k.chunks_exact(LANES))
        .zip(q.chunks_exact(LANES))
    {
        let mut new = [0f32; LANES];
        for l in 0..LANES {
            new[l] = g * o[l] + delta * k[l];
            acc[l] += new[l] * q[l];
        }
        r.copy_from_slice(&new);
    }
    let mut tail = 0.0;
    for i in n..row.len() {
        row[i] = g * old[i] + delta * k[i];
        tail += row[i] * q[i];
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvplug_core::oracle::{gamma, gated_delta_step};

    /// Deterministic values in `[lo, hi)`.
    fn values(seed: u64, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        let mut x = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                lo + (hi - lo) * ((x >> 11) as f64 / (1u64 << 53) as f64)
            })
            .collect()
    }

    /// One run of `t` tokens through two value heads of size `n` (one key head), from a
    /// non-zero state in another slot, both compiled variants, against the f64 rule
    /// (`gated_delta_step`): every output and the end state within the bound
    /// `testing::check_delta_verbs` derives (magnitudes through the recurrence, `γ(K·t)`,
    /// `K = 3·n + 20 + 2·CHUNK`). Some log decays are far below the flush, one is −∞.
    fn check(n: usize, t: usize) {
        let (hk, hv) = (1, 2);
        let raw_q = values(1 + n as u64, t * n, -1.0, 1.0);
        let raw_k = values(2 + t as u64, t * n, -1.0, 1.0);
        let v = values(3, t * hv * n, -1.5, 1.5);
        let mut lg = values(4, t * hv, -3.0, -0.01);
        for (i, g) in lg.iter_mut().enumerate() {
            match i % 37 {
                5 => *g = -90.0,
                11 => *g = f64::NEG_INFINITY,
                _ => {}
            }
        }
        let b = values(5, t * hv, 0.05, 0.95);
        let s0 = values(6, hv * n * n, -0.5, 0.5);
        let unit = |x: &[f64], scale: f64| -> Vec<f64> {
            let r = (x.iter().map(|a| a * a).sum::<f64>() + 1e-6).sqrt();
            x.iter().map(|a| a / r * scale).collect()
        };
        let mut qk = Vec::new();
        for i in 0..t {
            qk.extend(unit(&raw_q[i * n..(i + 1) * n], 1.0 / (n as f64).sqrt()));
            qk.extend(unit(&raw_k[i * n..(i + 1) * n], 1.0));
        }
        let f = |x: &[f64]| -> Vec<f32> { x.iter().map(|&a| a as f32).collect() };
        let (qk32, v32, lg32, b32) = (f(&qk), f(&v), f(&lg), f(&b));
        let tokens = Tokens {
            n,
            hk,
            hv,
            qk: &qk32,
            v: &v32,
            lg: &lg32,
            b: &b32,
        };
        // The stored layout: row j holds S[·][j].
        let stored: Vec<f32> = (0..hv * n * n)
            .map(|x| {
                let (h, j, i) = (x / (n * n), x / n % n, x % n);
                s0[h * n * n + i * n + j] as f32
            })
            .collect();
        // The f64 rule and the magnitudes of its terms.
        let mut want = vec![0f64; t * hv * n];
        let mut bound = vec![0f64; t * hv * n];
        let mut s = s0.clone();
        let mut mag: Vec<f64> = s0.iter().map(|a| a.abs()).collect();
        for i in 0..t {
            let g = gamma((3 * n + 20 + 2 * CHUNK) * (i + 1));
            let (q, k) = (&raw_q[i * n..(i + 1) * n], &raw_k[i * n..(i + 1) * n]);
            let (qn, kn) = (unit(q, 1.0 / (n as f64).sqrt()), unit(k, 1.0));
            for h in 0..hv {
                let vh = &v[(i * hv + h) * n..(i * hv + h + 1) * n];
                let (lgi, bi) = (lg[i * hv + h], b[i * hv + h]);
                let st = &mut s[h * n * n..(h + 1) * n * n];
                let o = gated_delta_step(st, q, k, vh, lgi, bi);
                want[(i * hv + h) * n..(i * hv + h + 1) * n].copy_from_slice(&o);
                let m = &mut mag[h * n * n..(h + 1) * n * n];
                let d = lgi.exp();
                for j in 0..n {
                    let recalled: f64 = (0..n).map(|a| m[a * n + j] * kn[a].abs()).sum();
                    for a in 0..n {
                        m[a * n + j] =
                            d * m[a * n + j] + bi * kn[a].abs() * (vh[j].abs() + d * recalled);
                    }
                    bound[(i * hv + h) * n + j] =
                        g * (0..n).map(|a| m[a * n + j] * qn[a].abs()).sum::<f64>();
                }
            }
        }
        let g_end = gamma((3 * n + 20 + 2 * CHUNK) * t);
        for fused in [false, true] {
            if fused && !cfg!(target_arch = "x86_64") {
                continue;
            }
            let mut slots = [stored.clone(), vec![f32::NAN; hv * n * n]];
            let mut out = vec![0f32; t * hv * n];
            let mut states: Vec<&mut [f32]> = slots.iter_mut().map(|s| &mut s[..]).collect();
            let mut rows: Vec<&mut [f32]> = out.chunks_exact_mut(hv * n).collect();
            let runs = [Run {
                start: 0,
                end: t,
                from: 0,
                home: 1,
            }];
            let mut sc = Scratch::default();
            if fused {
                tokens.advance(0..hv, &runs, &mut states[..], &mut rows[..], &mut sc);
            } else {
                // `advance` sizes the scratch; the unfused variant on any CPU.
                tokens.advance(0..hv, &[], &mut states[..], &mut rows[..], &mut sc);
                let (states, rows) = (&mut states[..], &mut rows[..]);
                tokens.advance_any::<false, _, _>(0..hv, &runs, states, rows, &mut sc);
            }
            for (x, (&got, (&w, &bd))) in out.iter().zip(want.iter().zip(&bound)).enumerate() {
                assert!(
                    (got as f64 - w).abs() <= bd,
                    "n {n}, {t} tokens, fused {fused}: token {} head {} value {}: {got} vs \
                     {w} (bound {bd:e})",
                    x / (hv * n),
                    x / n % hv,
                    x % n
                );
            }
            for (x, &got) in slots[1].iter().enumerate() {
                let (h, j, i) = (x / (n * n), x / n % n, x % n);
                let (w, m) = (s[h * n * n + i * n + j], mag[h * n * n + i * n + j]);
                assert!(
                    (got as f64 - w).abs() <= g_end * m,
                    "n {n}, {t} tokens, fused {fused}: end state S[{i}][{j}] of head {h}: \
                     {got} vs {w} (bound {:e})",
                    g_end * m
                );
            }
        }
    }

    #[test]
    fn runs_match_the_f64_rule_at_every_head_size_and_length() {
        for n in [4, 12, 64, 72, 128] {
            for t in [1, 2, MIN_CHUNKED_RUN - 1, MIN_CHUNKED_RUN, 63, 64, 65, 130] {
                check(n, t);
            }
        }
    }
}
