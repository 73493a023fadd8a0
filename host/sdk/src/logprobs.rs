//! Log-probabilities of tokens under a row of logits: the log-softmax that sampled tokens'
//! `logprobs`, scored prompts and speculative branches report.

use kvplug_core::exp::fast_exp;

/// The log-probability of token `id` under `logits` (log-softmax by `log_sum_exp`).
pub fn log_prob(logits: &[f32], id: i32) -> f64 {
    logits[id as usize] as f64 - log_sum_exp(logits)
}

/// Lanes summed side by side (a vector register or two).
const LANES: usize = 8;
/// Terms summed in f32, `LANES` a lane, before their sum joins the f64 total.
const BLOCK: usize = 8 * LANES;

/// `ln Σ e^v` over `logits`: the terms `e^(v − max)` by [`fast_exp`] in f32, summed in f32
/// a block of [`BLOCK`] at a time and the blocks in f64, so that the passes vectorize (a
/// 151,936-entry row in 0.17 ms, against 0.73 in f64 `exp`); within `fast_exp`'s error of
/// the f64 sum (the test derives the bound). NaN
/// where a logit is NaN or +∞, or every one is −∞; −∞ for an empty row.
fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = max_of(logits);
    let mut z = 0f64;
    let mut blocks = logits.chunks_exact(BLOCK);
    let mut terms = [0f32; BLOCK];
    for block in &mut blocks {
        // Two loops, not one: their fused form did not vectorize (2.3 ns a term, 1.1 so).
        for (e, &v) in terms.iter_mut().zip(block) {
            *e = fast_exp(v - max);
        }
        let mut sums = [0f32; LANES];
        for run in terms.chunks_exact(LANES) {
            for (s, &e) in sums.iter_mut().zip(run) {
                *s += e;
            }
        }
        z += sums.iter().map(|&s| s as f64).sum::<f64>();
    }
    let rest = blocks.remainder().iter();
    z += rest.map(|&v| fast_exp(v - max) as f64).sum::<f64>();
    max as f64 + z.ln()
}

/// `v`'s place in IEEE 754's total order (`f32::total_cmp`) as an integer, whose maximum
/// over a block vectorizes.
fn order_key(v: f32) -> i32 {
    let bits = v.to_bits() as i32;
    bits ^ (((bits >> 31) as u32) >> 1) as i32
}

/// The largest value of `row` that is not NaN (−∞ if none), `LANES` at a time.
fn max_of(row: &[f32]) -> f32 {
    let larger = |m: f32, v: f32| if v > m { v } else { m };
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut runs = row.chunks_exact(LANES);
    for run in &mut runs {
        for (m, &v) in lanes.iter_mut().zip(run) {
            *m = larger(*m, v);
        }
    }
    lanes
        .into_iter()
        .chain(runs.remainder().iter().copied())
        .fold(f32::NEG_INFINITY, larger)
}

/// A token's log-probability under the model and the `top` most likely alternatives'.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TokenLogprobs {
    /// The token.
    pub token: i32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens and theirs, most likely first.
    pub top: Vec<(i32, f32)>,
}

impl TokenLogprobs {
    /// Of `token` under `logits`, with the `top` best (log-softmax by `log_sum_exp`); meant for a few
    /// alternatives (each costs a pass's insertions: see [`crate::MAX_LOGPROBS`]).
    ///
    /// # Panics
    /// If `token` is not an index of `logits` (so also when `logits` is empty).
    pub fn of(logits: &[f32], token: i32, top: usize) -> Self {
        let lse = log_sum_exp(logits);
        // One pass keeping the best `top` in order (higher logit first, then lower id): a
        // row is read once and nothing of its size is allocated (a decode step with logprobs
        // calls this every token, a scored prompt every prompt token). A block none of
        // whose values would enter a full list is passed over on its largest key.
        let mut best: Vec<(i32, f32)> = Vec::with_capacity(top.min(logits.len()) + 1);
        for (b, block) in logits.chunks(BLOCK).enumerate().filter(|_| top > 0) {
            let full = best.len() == top;
            if full && block.iter().map(|&v| order_key(v)).max() <= Some(order_key(best[top - 1].1))
            {
                continue;
            }
            for (i, &v) in block.iter().enumerate() {
                let beaten = |b: f32| order_key(v) > order_key(b);
                if best.len() == top && !beaten(best[top - 1].1) {
                    continue;
                }
                let at = best.partition_point(|&(_, b)| !beaten(b));
                best.insert(at, ((b * BLOCK + i) as i32, v));
                best.truncate(top);
            }
        }
        for (_, v) in &mut best {
            *v = (*v as f64 - lse) as f32;
        }
        TokenLogprobs {
            token,
            logprob: (logits[token as usize] as f64 - lse) as f32,
            top: best,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The alternatives are the `top` best of the row by the definition (sorted by logit,
    /// ties by id), their log-probabilities the log-softmax in f64, on rows with ties.
    #[test]
    fn token_logprobs_list_the_best_alternatives_in_order() {
        for n in [1, 2, 7, 300] {
            // Nine levels in a scrambled order: many ties.
            let row: Vec<f32> = (0..n).map(|i| ((i * 7919 + n) % 9) as f32 * 0.5).collect();
            let lse = log_sum_exp(&row);
            let mut sorted: Vec<usize> = (0..n).collect();
            sorted.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            for top in [0, 1, 3, 20] {
                let got = TokenLogprobs::of(&row, (n - 1) as i32, top);
                let want: Vec<(i32, f32)> = sorted[..top.min(n)]
                    .iter()
                    .map(|&i| (i as i32, (row[i] as f64 - lse) as f32))
                    .collect();
                assert_eq!(got.top, want, "n {n} top {top}");
                assert_eq!(got.logprob, (row[n - 1] as f64 - lse) as f32);
            }
        }
        // IEEE's total order over blocks of the row, signed zeros, infinities and NaNs among
        // them (NaN > +∞ in that order): the ids alone, the log-probabilities being NaN.
        let specials = [
            f32::NAN,
            -0.0,
            0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -f32::NAN,
        ];
        let row: Vec<f32> = (0..1000)
            .map(|i| match i % 53 {
                7 => specials[i / 53 % specials.len()],
                _ => ((i * 7919) % 11) as f32 - 5.0,
            })
            .collect();
        let mut sorted: Vec<usize> = (0..row.len()).collect();
        sorted.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        for top in [1, 2, 5, 64] {
            let ids: Vec<i32> = TokenLogprobs::of(&row, 0, top)
                .top
                .iter()
                .map(|e| e.0)
                .collect();
            let want: Vec<i32> = sorted[..top].iter().map(|&i| i as i32).collect();
            assert_eq!(ids, want, "top {top}");
        }
    }

    /// `log_sum_exp` against f64's on rows of vocabulary size and wide spreads, with −∞
    /// (masked) entries, within the bound its steps give: each term `e^x` (`x = v − max`)
    /// off by `fast_exp`'s error (1e-6 relative for |x| ≤ 20, 1e-5 to −87, its test; the
    /// whole term below), by the rounding of `v − max` (|x|·2^-24) and by its block's f32
    /// sum (at most 8 roundings of 2^-24 a term), so `ln z` by at most `−ln(1 − ε)` for ε
    /// the terms' weighted error.
    #[test]
    fn log_sum_exp_is_within_its_derived_bound_of_f64() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        let ulp = (f32::EPSILON / 2.0) as f64;
        let rows = [
            (1, 1.0),
            (63, 4.0),
            (200, 4.0),
            (151_936, 3.0),
            (151_936, 30.0),
        ];
        for (n, spread) in rows.into_iter().chain([(32_003, 120.0)]) {
            let row: Vec<f32> = (0..n)
                .map(|i| match i % 97 {
                    5 => f32::NEG_INFINITY,
                    _ => (next() * 2.0 - 1.0) * spread,
                })
                .collect();
            let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
            let (mut z, mut err) = (0f64, 0f64);
            for x in row
                .iter()
                .map(|&v| v as f64 - max)
                .filter(|x| x.is_finite())
            {
                let exp_err = match x.abs() {
                    a if a <= 20.0 => 1e-6,
                    a if a <= 87.0 => 1e-5,
                    _ => 1.0,
                };
                z += x.exp();
                err += x.exp() * (exp_err + x.abs() * ulp + 8.0 * ulp);
            }
            let (got, want) = (log_sum_exp(&row), max + z.ln());
            let bound = -(1.0 - err / z).ln();
            assert!(
                (got - want).abs() <= bound,
                "n {n} spread {spread}: {got} vs {want}, bound {bound:e}"
            );
        }
        assert!(log_sum_exp(&[1.0, f32::NAN]).is_nan());
        assert!(log_sum_exp(&[1.0, f32::INFINITY]).is_nan());
        assert_eq!(log_sum_exp(&[f32::NEG_INFINITY, 0.0]), 0.0);
        assert_eq!(log_sum_exp(&[]), f64::NEG_INFINITY);
    }
}
