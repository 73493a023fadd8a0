//! Naive scaled-dot-product attention in f64.

use crate::arithmetic::{Arithmetic, QUERY_BLOCK, WEIGHT_CODES};

/// Shapes of one attention call. q and the output are `[n_q_heads, n_tok, head_dim]`;
/// k and v are `[n_kv_heads, read_len, head_dim]`. Query head `h` reads KV head
/// `h / (n_q_heads / n_kv_heads)` (GQA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnDims {
    /// Query heads (a multiple of `n_kv_heads`).
    pub n_q_heads: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Query tokens `T`.
    pub n_tok: usize,
    /// Read window `L`.
    pub read_len: usize,
    /// Values per head row.
    pub head_dim: usize,
}

/// Which keys each query attends.
#[derive(Clone, Copy, Debug)]
pub enum RefMask<'a> {
    /// All of them.
    None,
    /// Lower-right aligned: query `i` sees keys `j <= L - T + i`.
    Causal,
    /// Row-major `[T, L]`, `true` = attend.
    Explicit(&'a [bool]),
}

impl RefMask<'_> {
    fn visible(&self, i: usize, j: usize, t: usize, l: usize) -> bool {
        match self {
            RefMask::None => true,
            RefMask::Causal => j + t <= l + i,
            RefMask::Explicit(m) => m[i * l + j],
        }
    }
}

/// Unit roundoff of f32 (round to nearest).
pub const F32_UNIT_ROUNDOFF: f64 = 1.0 / 16_777_216.0;

/// Higham's `γ(n) = n·u / (1 − n·u)`: the relative error bound of `n` f32 roundings in a row,
/// e.g. a dot product or a sum of `n` terms, in any association order.
pub fn gamma(n: usize) -> f64 {
    let nu = n as f64 * F32_UNIT_ROUNDOFF;
    nu / (1.0 - nu)
}

/// The relative error an f32 `exp(x)` may have, `x <= 0`: WGSL's accuracy contract,
/// `3 + 2·|x|` ULP (one ULP is at most `2u` relative), the loosest of any backend's
/// kernels; below `-80` the result may flush to zero (relative error 1, weight < e^-80).
pub fn exp_rel_error(x: f64) -> f64 {
    if x < -80.0 {
        1.0
    } else {
        (3.0 + 2.0 * x.abs()) * 2.0 * F32_UNIT_ROUNDOFF
    }
}

/// The result of [`attend`]: the f64 output and, per element, how far an f32 backend may
/// be from it.
#[derive(Clone, Debug, PartialEq)]
pub struct Attention {
    /// `[n_q_heads, n_tok, head_dim]`.
    pub out: Vec<f64>,
    /// Same shape: how far a backend computing in the declared arithmetic may be (see
    /// [`attend`]).
    pub bound: Vec<f64>,
}

/// `softmax(q·kᵀ·scale + mask)·v`, with a query that sees no key giving zeros, and the
/// error bound of a backend that computes it in `arithmetic` from the same stored K/V.
///
/// The bound is derived, not tuned. With `u = 2^-24`, for one query row with visible keys
/// `j` (n of them), exact scores `s_j`, `x_j = s_j − max s`, weights `w_j` and output `o`:
/// - a score computed in f32 (dot over `D`, times `scale`, K dequantized in f32) is off by
///   at most `δ_j = γ(D + 2)·scale·Σ_d |q_d·k_jd| + u·|x_j|` (the shift by the max cancels);
/// - its unnormalized weight `exp(x_j)` by a relative `ρ_j = (1 + ε_j)²·e^{δ_j} − 1`, with
///   `ε_j` = [`exp_rel_error`] (squared: one more exp for an online-softmax rescale);
/// - weights off by relative `ρ_j` move the output by at most
///   `Σ_j w_j·ρ_j·|v_j − o| / (1 − max ρ)`;
/// - the f32 sums of weights and of weighted values (and V's dequantization) add at most
///   `γ(n + 4)·(Σ_j w_j·|v_j| + |o|)`.
///
/// Storage rounding and quantization are not in the bound: the caller stores K/V exactly
/// as the backend does, so they are in `k` and `v` already.
///
/// [`Arithmetic::Int8Query`] replaces the `γ(D + 2)` term of `δ_j` by
/// [`int8_query_score_error`] (times `scale`): the query's quantization error and the f32
/// roundings of the block arithmetic; the rest is unchanged.
/// [`Arithmetic::Int8QueryI16Values`] has those scores, and its value sum splits each value
/// into `lo + σ·c`, whose terms may exceed `|v|`: the sums' term counts `v_j`'s
/// [`value_span`] beside `|v_j|` (`γ(n + 8)`: the codes' scale, its product and the
/// conversion add roundings), and [`i16_value_error`] is added. Every bound is at least the
/// f32 one, so a kernel may always compute more exactly than it declares.
pub fn attend(
    dims: AttnDims,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    scale: f64,
    mask: RefMask,
    arithmetic: Arithmetic,
) -> Attention {
    attend_sinks(dims, q, k, v, scale, mask, arithmetic, None)
}

/// [`attend`] with a learned sink per query head (GPT-OSS's `attn_sinks`): the softmax of
/// query head `h` also counts a key of score `sinks[h]` (not scaled) and value zero, so
/// `out = Σ_j e^{s_j}·v_j / (Σ_j e^{s_j} + e^{sinks[h]})`. The sink enters the bound as one
/// more weight whose score has no rounding (it is given) and whose value is 0; a query that
/// sees no key still reads zeros.
#[allow(clippy::too_many_arguments)]
pub fn attend_sinks(
    dims: AttnDims,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    scale: f64,
    mask: RefMask,
    arithmetic: Arithmetic,
    sinks: Option<&[f64]>,
) -> Attention {
    let AttnDims {
        n_q_heads,
        n_kv_heads,
        n_tok: t,
        read_len: l,
        head_dim: d,
    } = dims;
    assert_eq!(q.len(), n_q_heads * t * d, "q shape");
    assert_eq!(k.len(), n_kv_heads * l * d, "k shape");
    assert_eq!(v.len(), n_kv_heads * l * d, "v shape");
    assert_eq!(n_q_heads % n_kv_heads, 0, "GQA group");
    assert!(
        sinks.is_none_or(|s| s.len() == n_q_heads),
        "a sink per query head"
    );
    let u = F32_UNIT_ROUNDOFF;
    let group = n_q_heads / n_kv_heads;
    let mut out = vec![0.0; n_q_heads * t * d];
    let mut bound = vec![0.0; n_q_heads * t * d];
    for h in 0..n_q_heads {
        let kh = h / group;
        for i in 0..t {
            let qrow = &q[(h * t + i) * d..][..d];
            let half_steps = arithmetic.int8_query().then(|| int8_half_steps(qrow));
            // (key, score, its error) of every visible key, then the sink (no key: value 0).
            let mut scores: Vec<(Option<usize>, f64, f64)> = (0..l)
                .filter(|&j| mask.visible(i, j, t, l))
                .map(|j| {
                    let krow = &k[(kh * l + j) * d..][..d];
                    let dot: f64 = qrow.iter().zip(krow).map(|(a, b)| a * b).sum();
                    let err = match &half_steps {
                        None => {
                            let abs: f64 = qrow.iter().zip(krow).map(|(a, b)| (a * b).abs()).sum();
                            gamma(d + 2) * abs * scale.abs()
                        }
                        Some(h) => int8_query_score_error(qrow, h, krow) * scale.abs(),
                    };
                    (Some(j), dot * scale, err)
                })
                .collect();
            if scores.is_empty() {
                continue;
            }
            if let Some(s) = sinks {
                scores.push((None, s[h], 0.0));
            }
            let Some(max) = scores.iter().map(|s| s.1).reduce(f64::max) else {
                continue;
            };
            let weights: Vec<f64> = scores.iter().map(|s| (s.1 - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            let rho: Vec<f64> = scores
                .iter()
                .map(|&(_, s, err)| {
                    let x = s - max;
                    let delta = err + u * x.abs();
                    (1.0 + exp_rel_error(x)).powi(2) * delta.exp() - 1.0
                })
                .collect();
            let rho_max = rho.iter().copied().fold(0.0, f64::max);
            let i16_values = arithmetic.i16_values();
            let sum_gamma = gamma(scores.len() + if i16_values { 8 } else { 4 });
            // Each key's value span where the values are split into `lo + σ·c` (0 for the
            // sink, whose value is no row).
            let spans: Vec<f64> = scores
                .iter()
                .map(|s| match s.0 {
                    Some(j) if i16_values => value_span(&v[(kh * l + j) * d..][..d]),
                    _ => 0.0,
                })
                .collect();
            let codes = if i16_values {
                let keys = scores.iter().zip(&weights).zip(rho.iter().zip(&spans));
                let w = keys.filter(|((s, _), _)| s.0.is_some());
                i16_value_error(w.map(|((_, w), (r, span))| (w * (1.0 + r), *span)), total)
            } else {
                0.0
            };
            let row = (h * t + i) * d;
            for e in 0..d {
                let vs = |j: Option<usize>| j.map_or(0.0, |j| v[(kh * l + j) * d + e]);
                let o: f64 = scores
                    .iter()
                    .zip(&weights)
                    .map(|(s, w)| w / total * vs(s.0))
                    .sum();
                let (mut shift, mut mass) = (0.0, 0.0);
                for (((s, w), r), span) in scores.iter().zip(&weights).zip(&rho).zip(&spans) {
                    let (wn, x) = (w / total, vs(s.0));
                    shift += wn * r * (x - o).abs();
                    mass += wn * (x.abs() + span);
                }
                out[row + e] = o;
                bound[row + e] =
                    (shift + sum_gamma * (mass + o.abs()) + codes) / (1.0 - rho_max - sum_gamma);
            }
        }
    }
    Attention { out, bound }
}

/// A bound on `σ·L` (a quantized group's scale times its top code, `L = 2^bits − 1`) and on
/// `2·|lo|` of every group of the stored value row `v` (dequantized), whatever its bits
/// (4 or 8) and groups: `2.21·max|v| + 2⁻¹⁶`.
///
/// With `x` the values the row was quantized from ([`crate::quant`]): `σ·L` is the f32
/// difference `hi − lo ≤ 2·max|x|` times `f32(1/L)`, rounded to f16 (relative `2⁻¹¹`, or
/// `2⁻²⁵` absolute below f16's normal range), times `L`: at most `2.002·max|x| + 2⁻¹⁷`. Each
/// `x` is within `0.625·σ + 2⁻¹¹·|x|` of its dequantized value (half a step, the top
/// code's clamp at most `L·σ·2⁻¹¹` more, the minimum's f16 rounding), so with `L >= 15`,
/// `max|x| <= 1.092·max|v| + 2⁻¹⁹`, and `|lo| <= (1 + 2⁻¹¹)·max|x| + 2⁻²⁵`.
pub fn value_span(v: &[f64]) -> f64 {
    2.21 * v.iter().fold(0.0f64, |m, x| m.max(x.abs())) + 2f64.powi(-16)
}

/// How far [`Arithmetic::Int8QueryI16Values`]'s weight codes may move each output value of
/// a query row, for its visible keys' `(weight, span)`: weights relative to the row's
/// largest (keys' and sink's: the largest is 1), times `1 + ρ` for their rounding as
/// [`attend`] derives it; spans by [`value_span`]; `z` is the softmax's total in the same
/// unit (sinks included):
///
/// `(0.52 · n · max_j(w_j·span_j) / 32767 + n · 2⁻⁹²) / z`.
///
/// A key's code `e`, `u` times the f32 `32767 / max u` rounded once more, is within
/// `½ + 32767·3u` of `u / r` (`r = max u / 32767`, itself rounded once), so `r·e` is within
/// `0.51·r` of `u` and its term `e·c` is off by at most `0.51·r·L` (`c <= L`); `r` is the
/// run's largest `p·σ` over 32767, with f32 roundings (`<= 0.52` all told), and
/// `σ·L <= span`. Every key's run lies among the visible keys, so the largest `w·span` of
/// all of them bounds each run's, whatever runs the kernel chose. A run coded 0 for
/// being below [`crate::arithmetic::TINY_RUN`] (`2⁻¹⁰⁰`) loses each key's `u·c <= 2⁻¹⁰⁰·255
/// < 2⁻⁹²` in the kernel's units (weights against the running max of the keys), which only
/// shrinks rescaled to the row's largest weight (1, sink included, so `z >= 1`).
pub fn i16_value_error(keys: impl Iterator<Item = (f64, f64)>, z: f64) -> f64 {
    let (mut n, mut widest) = (0usize, 0.0f64);
    for (w, span) in keys {
        n += 1;
        widest = widest.max(w * span);
    }
    (0.52 * n as f64 * widest / WEIGHT_CODES as f64 + n as f64 * 2f64.powi(-92)) / z
}

/// Per value of a query row, how far [`Arithmetic::Int8Query`] may move it: `h =
/// max|q|·((1 + 5u)/254 + 2u) + 2⁻¹¹⁹` for its block.
///
/// - The block's f32 scale `s = max|q|/127` is within a relative `5u` of the exact quotient:
///   `u` when the division is correctly rounded (cpu), 2.5 ulp on a GPU (Vulkan's bound).
/// - The code is the integer nearest `q/s` (half away from zero), found either from the
///   correctly rounded quotient (at most `127u` from the exact one) or by comparing `q` with
///   `(m ± ½)·s` rounded once (at most `u·127.5·s` off). Either way `|code·s − q| <=
///   s·(½ + 127.5u) <= max|q|·((1 + 5u)/254 + 1.01u)`. The clamp to ±127 only removes an
///   f32 rounding's excess (`q/s <= 127/(1 − 5u) < 127.5`).
/// - The last term covers blocks whose scale falls below f32's normal range (`max|q| <
///   127·2⁻¹²⁶ < 2⁻¹¹⁹`): a correctly rounded subnormal scale is off by at most `2⁻¹⁵⁰`
///   (times a code of at most 127), and a kernel may instead give such a block scale 0 and
///   codes 0 (the wgpu kernel does, as GPUs may flush subnormals), an error of at most
///   `max|q|`.
pub fn int8_half_steps(qrow: &[f64]) -> Vec<f64> {
    let u = F32_UNIT_ROUNDOFF;
    qrow.chunks(QUERY_BLOCK)
        .flat_map(|b| {
            let amax = b.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            let h = amax * ((1.0 + 5.0 * u) / 254.0 + 2.0 * u) + 2f64.powi(-119);
            std::iter::repeat_n(h, b.len())
        })
        .collect()
}

/// How far an [`Arithmetic::Int8Query`] kernel's `q·k` may be from the exact one (before
/// the `scale`), for the query row `q` with [`int8_half_steps`] `h` and a stored key row `k`:
///
/// `Σ_d h_d·|k_d|  +  γ(D + 2)·Σ_d (|q_d| + h_d)·(|k_d| + 2·K)`,  `K = (1 + 2⁻⁹)·max|k| + 2⁻²³`.
///
/// - The first term is the query's quantization: each quantized value `q̂_d` is within
///   `h_d` of `q_d`.
/// - The second is the f32 arithmetic on `q̂`: a kernel may split an affine key
///   `k_d = lo + scale·c_d` (see [`crate::quant`]) into `scale·Σ q̂·c` and `lo·Σ q̂` with
///   each product term through at most `D + 2` f32 roundings, so the rounded quantities are
///   bounded by `|q̂_d|·(scale·c_d + |lo|) <= |q̂_d|·(|k_d| + 2·|lo|)`. A group's `lo` is its
///   minimum rounded to f16, and when that rounding exceeds half a step the minimum's code
///   is not 0: then `|x_min − lo|` is at most half an f16 ULP (`2⁻¹¹·|x_min|`, or `2⁻²⁵`
///   below f16's normal range), the dequantized minimum is within half a step (so again
///   within that) of `x_min`, and `|lo| <= (1 + 2⁻⁹)·|k_min| + 2⁻²³ <= K`. Unquantized keys
///   have no `lo` and the bound holds as well.
pub fn int8_query_score_error(q: &[f64], h: &[f64], k: &[f64]) -> f64 {
    let big = (1.0 + 2f64.powi(-9)) * k.iter().fold(0.0f64, |m, x| m.max(x.abs())) + 2f64.powi(-23);
    let (mut quant, mut arith) = (0.0, 0.0);
    for ((&q, &h), &k) in q.iter().zip(h).zip(k) {
        quant += h * k.abs();
        arith += (q.abs() + h) * (k.abs() + 2.0 * big);
    }
    quant + gamma(q.len() + 2) * arith
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize_group, quantize_group, QuantGroup};

    #[test]
    fn single_key_returns_its_value() {
        let dims = AttnDims {
            n_q_heads: 2,
            n_kv_heads: 1,
            n_tok: 1,
            read_len: 1,
            head_dim: 2,
        };
        let out = attend(
            dims,
            &[1.0, 2.0, -3.0, 0.5],
            &[0.3, 0.4],
            &[5.0, -6.0],
            0.7,
            RefMask::None,
            Arithmetic::F32,
        )
        .out;
        assert_eq!(out, vec![5.0, -6.0, 5.0, -6.0]);
    }

    #[test]
    fn equal_scores_average_values_and_causal_is_tail_aligned() {
        let dims = AttnDims {
            n_q_heads: 1,
            n_kv_heads: 1,
            n_tok: 2,
            read_len: 3,
            head_dim: 1,
        };
        // q = 0 makes every score equal; outputs are means of the visible values.
        let v = [3.0, 6.0, 9.0];
        let out = attend(
            dims,
            &[0.0, 0.0],
            &[1.0, 2.0, 3.0],
            &v,
            1.0,
            RefMask::Causal,
            Arithmetic::F32,
        )
        .out;
        assert_eq!(out, vec![4.5, 6.0]);
        let mask = [true, false, true, false, true, false];
        let out = attend(
            dims,
            &[0.0, 0.0],
            &[1.0, 2.0, 3.0],
            &v,
            1.0,
            RefMask::Explicit(&mask),
            Arithmetic::F32,
        )
        .out;
        assert_eq!(out, vec![6.0, 6.0]);
        let none = [false; 6];
        let out = attend(
            dims,
            &[0.0, 0.0],
            &[1.0, 2.0, 3.0],
            &v,
            1.0,
            RefMask::Explicit(&none),
            Arithmetic::F32,
        )
        .out;
        assert_eq!(out, vec![0.0, 0.0]);
    }

    /// A stored key row: its values and, when quantized, its groups.
    struct Key {
        values: Vec<f64>,
        groups: Vec<QuantGroup>,
    }

    /// A kernel's `q·k` for one query row and key row, in f32.
    type Dot<'a> = &'a dyn Fn(&[f64], &Key) -> f32;

    /// How the test kernel sums the values.
    #[derive(Clone, Copy)]
    enum Values {
        /// Raw values, naive f32 sums.
        F32,
        /// Values quantized to `bits` in groups of 32, summed as
        /// [`Arithmetic::Int8QueryI16Values`] declares in runs of `run` keys, each run's
        /// integer sum scaled by `r·r_error` (1 when right), codes up to `codes`.
        I16 {
            bits: u32,
            run: usize,
            r_error: f32,
            codes: f32,
        },
    }

    impl Values {
        const Q8: Values = Values::I16 {
            bits: 8,
            run: 64,
            r_error: 1.0,
            codes: WEIGHT_CODES as f32,
        };
    }

    /// `Σ p_j·v_j` of element `c` over `keys` (weights `p`), as `values` says.
    fn value_sum(values: Values, p: &[f32], keys: &[&Key], c: usize) -> f32 {
        let Values::I16 {
            run,
            r_error,
            codes,
            ..
        } = values
        else {
            return p
                .iter()
                .zip(keys)
                .fold(0f32, |a, (w, k)| a + w * k.values[c] as f32);
        };
        let g = c / 32;
        let mut num = 0f32;
        for (p, keys) in p.chunks(run).zip(keys.chunks(run)) {
            let u: Vec<f32> = p
                .iter()
                .zip(keys)
                .map(|(p, k)| p * k.groups[g].scale as f32)
                .collect();
            let max = u.iter().copied().fold(0f32, f32::max);
            let (r, to_codes) = (max / codes, if max > 0.0 { codes / max } else { 0.0 });
            let acc: i64 = u
                .iter()
                .zip(keys)
                .map(|(&u, k)| {
                    (u * to_codes).round_ties_even() as i64 * k.groups[g].codes[c % 32] as i64
                })
                .sum();
            assert!(acc < 1 << 31, "the i32 sum overflows");
            let lo = p
                .iter()
                .zip(keys)
                .fold(0f32, |a, (p, k)| a + p * k.groups[g].lo as f32);
            num += r * r_error * acc as f32 + lo;
        }
        num
    }

    /// Runs a naive f32 kernel (scores by `dot`, `f32::exp`, naive sums, or `values`) over
    /// 200 random causal cases with outlier key channels, keys quantized to q4 in groups of
    /// 32 when `quantized`; returns the largest ratio of an error to `arithmetic`'s bound
    /// and the widest bound.
    fn largest_ratio(arithmetic: Arithmetic, quantized: bool, dot: Dot<'_>) -> (f64, f64) {
        largest_ratio_with(arithmetic, quantized, dot, Values::F32)
    }

    /// [`largest_ratio`] with the values summed as `values` says (over 700 keys at most,
    /// to span runs).
    fn largest_ratio_with(
        arithmetic: Arithmetic,
        quantized: bool,
        dot: Dot<'_>,
        values: Values,
    ) -> (f64, f64) {
        let mut state = 7u64;
        let mut next = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f64 / (1u64 << 24) as f64) * 2.0 - 1.0
        };
        let mut worst_ratio = 0.0f64;
        let mut widest = 0.0f64;
        for case in 0..200 {
            let most = if matches!(values, Values::F32) {
                90
            } else {
                700
            };
            let sizes = if matches!(values, Values::F32) {
                [8, 64, 128]
            } else {
                [32, 64, 128]
            };
            let (t, l, d) = (1 + case % 4, 1 + (case * 7) % most, sizes[case % 3]);
            let dims = AttnDims {
                n_q_heads: 2,
                n_kv_heads: 1,
                n_tok: t,
                read_len: l,
                head_dim: d,
            };
            let outlier = |e: usize| if e % 29 == 3 { 40.0 } else { 1.0 };
            let f32v = |x: f64| x as f32 as f64;
            let q: Vec<f64> = (0..2 * t * d).map(|_| f32v(next())).collect();
            let keys: Vec<Key> = (0..l)
                .map(|_| {
                    let raw: Vec<f64> = (0..d).map(|e| f32v(next() * outlier(e))).collect();
                    if !quantized {
                        return Key {
                            values: raw,
                            groups: Vec::new(),
                        };
                    }
                    let groups: Vec<QuantGroup> =
                        raw.chunks(32).map(|g| quantize_group(g, 4)).collect();
                    Key {
                        values: groups.iter().flat_map(dequantize_group).collect(),
                        groups,
                    }
                })
                .collect();
            let k: Vec<f64> = keys.iter().flat_map(|r| r.values.clone()).collect();
            let rows: Vec<Key> = (0..l)
                .map(|_| {
                    let Values::I16 { bits, .. } = values else {
                        return Key {
                            values: (0..d).map(|_| f32v(next())).collect(),
                            groups: Vec::new(),
                        };
                    };
                    let raw: Vec<f64> = (0..d).map(|e| f32v(next() * outlier(e + 7))).collect();
                    let groups: Vec<QuantGroup> =
                        raw.chunks(32).map(|g| quantize_group(g, bits)).collect();
                    Key {
                        values: groups.iter().flat_map(dequantize_group).collect(),
                        groups,
                    }
                })
                .collect();
            let v: Vec<f64> = rows.iter().flat_map(|r| r.values.clone()).collect();
            let scale = 1.0 / (d as f64).sqrt();
            let want = attend(dims, &q, &k, &v, scale, RefMask::Causal, arithmetic);
            for h in 0..2 {
                for i in 0..t {
                    let visible: Vec<usize> = (0..l).filter(|&j| j + t <= l + i).collect();
                    let qr = &q[(h * t + i) * d..][..d];
                    let s: Vec<f32> = visible
                        .iter()
                        .map(|&j| dot(qr, &keys[j]) * scale as f32)
                        .collect();
                    let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
                    let z: f32 = e.iter().sum();
                    let seen: Vec<&Key> = visible.iter().map(|&j| &rows[j]).collect();
                    for c in 0..d {
                        let num = value_sum(values, &e, &seen, c);
                        let got = if visible.is_empty() {
                            0.0
                        } else {
                            (num / z) as f64
                        };
                        let idx = (h * t + i) * d + c;
                        let err = (got - want.out[idx]).abs();
                        worst_ratio = worst_ratio.max(err / want.bound[idx].max(f64::MIN_POSITIVE));
                        widest = widest.max(want.bound[idx]);
                    }
                }
            }
        }
        (worst_ratio, widest)
    }

    /// The f32 reference kernel's dot: K widened to f32, naive order.
    fn f32_dot(q: &[f64], k: &Key) -> f32 {
        q.iter()
            .zip(&k.values)
            .fold(0f32, |a, (x, y)| a + *x as f32 * *y as f32)
    }

    /// An int8-query kernel's dot on q4 keys in groups of 32, the query's block scales
    /// multiplied by `scale_error` (1 when right): codes per 32-block, `Σ s·(scale·Σ qc·c +
    /// lo·Σ qc)` in f32.
    fn int8_dot(q: &[f64], k: &Key, scale_error: f32) -> f32 {
        q.chunks(32).zip(&k.groups).fold(0f32, |acc, (qb, g)| {
            let amax = qb.iter().fold(0f32, |m, x| m.max(x.abs() as f32));
            let s = amax / 127.0;
            let codes: Vec<i32> = qb
                .iter()
                .map(|&x| match s {
                    0.0 => 0,
                    s => (x as f32 / s).round().clamp(-127.0, 127.0) as i32,
                })
                .collect();
            let dot: i32 = codes.iter().zip(&g.codes).map(|(a, &c)| a * c as i32).sum();
            let sum: i32 = codes.iter().sum();
            let block = g.scale as f32 * dot as f32 + g.lo as f32 * sum as f32;
            acc + s * scale_error * block
        })
    }

    /// A plain f32 kernel stays inside the bound, and the bound is tight enough to see a
    /// one-ULP-of-f16 error.
    #[test]
    fn an_f32_kernel_stays_inside_the_bound() {
        let (worst, widest) = largest_ratio(Arithmetic::F32, false, &f32_dot);
        assert!(worst <= 1.0, "an error exceeds its bound: {worst}");
        assert!(worst > 1e-3, "the bound is never approached: {worst}");
        // Half an f16 ULP at 1 is 2^-12: a bound below it sees any f16 rounding error.
        assert!(
            widest < 2f64.powi(-12),
            "the bound is too loose to see f16 rounding: {widest:e}"
        );
    }

    /// An int8-query kernel on q4 keys stays inside its declared bound, and outside the f32
    /// one (an undeclared int8 query fails); with a block scale off by 2 it fails its own.
    #[test]
    fn an_int8_query_kernel_stays_inside_its_bound_and_only_its_own() {
        let (worst, _) = largest_ratio(Arithmetic::Int8Query, true, &|q, k| int8_dot(q, k, 1.0));
        assert!(worst <= 1.0, "an error exceeds its bound: {worst}");
        assert!(worst > 1e-2, "the bound is never approached: {worst}");
        let (undeclared, _) = largest_ratio(Arithmetic::F32, true, &|q, k| int8_dot(q, k, 1.0));
        assert!(
            undeclared > 1.0,
            "the f32 bound admits an int8 query: {undeclared}"
        );
        let (doubled, _) = largest_ratio(Arithmetic::Int8Query, true, &|q, k| int8_dot(q, k, 2.0));
        assert!(doubled > 1.0, "a doubled query scale passes: {doubled}");
        // The f32 kernel on the same quantized keys is inside the int8 bound too.
        let (exact, _) = largest_ratio(Arithmetic::Int8Query, true, &f32_dot);
        assert!(exact <= 1.0);
    }

    /// An i16-values kernel on q8 and q4 values stays inside its declared bound, and outside
    /// the int8-query one (undeclared i16 weights fail); with a code scale 1% off, or 8-bit
    /// weight codes, it fails its own.
    #[test]
    fn an_i16_values_kernel_stays_inside_its_bound_and_only_its_own() {
        let a = Arithmetic::Int8QueryI16Values;
        let int8 = |q: &[f64], k: &Key| int8_dot(q, k, 1.0);
        for bits in [8, 4] {
            let values = Values::I16 {
                bits,
                run: 64,
                r_error: 1.0,
                codes: WEIGHT_CODES as f32,
            };
            let (worst, _) = largest_ratio_with(a, true, &int8, values);
            assert!(worst <= 1.0, "q{bits}: an error exceeds its bound: {worst}");
            assert!(
                worst > 1e-3,
                "q{bits}: the bound is never approached: {worst}"
            );
        }
        // Runs of the most keys a run may hold.
        let longest = Values::I16 {
            bits: 8,
            run: crate::arithmetic::VALUE_RUN,
            r_error: 1.0,
            codes: WEIGHT_CODES as f32,
        };
        let (worst, _) = largest_ratio_with(a, true, &int8, longest);
        assert!(
            worst <= 1.0,
            "runs of {}: {worst}",
            crate::arithmetic::VALUE_RUN
        );
        let (undeclared, _) = largest_ratio_with(Arithmetic::Int8Query, true, &int8, Values::Q8);
        assert!(
            undeclared > 1.0,
            "the int8-query bound admits i16 weights: {undeclared}"
        );
        let off = Values::I16 {
            bits: 8,
            run: 64,
            r_error: 1.01,
            codes: WEIGHT_CODES as f32,
        };
        let (off, _) = largest_ratio_with(a, true, &int8, off);
        assert!(off > 1.0, "a code scale 1% off passes: {off}");
        let coarse = Values::I16 {
            bits: 8,
            run: 64,
            r_error: 1.0,
            codes: 255.0,
        };
        let (coarse, _) = largest_ratio_with(a, true, &int8, coarse);
        assert!(coarse > 1.0, "8-bit weight codes pass: {coarse}");
        // The f32 value sum on the same quantized values is inside the i16 bound too.
        let (exact, _) = largest_ratio_with(
            a,
            true,
            &int8,
            Values::I16 {
                bits: 8,
                run: 1,
                r_error: 1.0,
                codes: WEIGHT_CODES as f32,
            },
        );
        assert!(exact <= 1.0, "{exact}");
    }

    #[test]
    fn softmax_weights_follow_scores() {
        let dims = AttnDims {
            n_q_heads: 1,
            n_kv_heads: 1,
            n_tok: 1,
            read_len: 2,
            head_dim: 1,
        };
        // scores 0 and ln 3 → weights 1/4, 3/4.
        let out = attend(
            dims,
            &[1.0],
            &[0.0, 3f64.ln()],
            &[4.0, 8.0],
            1.0,
            RefMask::None,
            Arithmetic::F32,
        )
        .out;
        assert!((out[0] - 7.0).abs() < 1e-12);
    }
}
