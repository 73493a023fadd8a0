//! The greedy pick, the order of sampling candidates and the adjustment of a logit before
//! either, shared by the host's sampler and the backends' device picks
//! (`ModelDevice::argmax_rows`, `top_k_rows`, `adjust_rows`), so that both choose the same
//! tokens.

use std::cmp::Ordering;

/// Index of the largest value of `row`, the lowest such index on ties (`-0.0` ties `0.0`).
/// A NaN is never the largest; a row of NaNs, or an empty one, gives 0.
pub fn argmax(row: &[f32]) -> i32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in row.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map_or(0, |(i, _)| i as i32)
}

/// How a token's logit `l` is changed before it is picked (logit bias, frequency, presence
/// and repetition penalties): `(l + add) − sub`, then times `pos` where that is above 0 and
/// times `neg` elsewhere (a repetition penalty `p` is `pos = 1/p`, `neg = p`). Each step is
/// one f32 operation, correctly rounded, so a device computes the host's bits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adjust {
    /// Added first (the logit bias).
    pub add: f32,
    /// Subtracted next (the frequency and presence penalties).
    pub sub: f32,
    /// The factor of a result above 0.
    pub pos: f32,
    /// The factor of any other result.
    pub neg: f32,
}

impl Adjust {
    /// No change.
    pub const NONE: Adjust = Adjust {
        add: 0.0,
        sub: 0.0,
        pos: 1.0,
        neg: 1.0,
    };

    /// `l` adjusted.
    pub fn apply(&self, l: f32) -> f32 {
        let l = (l + self.add) - self.sub;
        if l > 0.0 {
            l * self.pos
        } else {
            l * self.neg
        }
    }

    /// As four values: `add, sub, pos, neg`.
    pub fn to_array(self) -> [f32; 4] {
        [self.add, self.sub, self.pos, self.neg]
    }

    /// From [`Adjust::to_array`]'s four values.
    pub fn from_array([add, sub, pos, neg]: [f32; 4]) -> Self {
        Adjust { add, sub, pos, neg }
    }
}

/// The order of candidates `(index, value)`: larger values first, the lower index first on
/// ties (`-0.0` ties `0.0`), NaNs after every number. Its first over a row is [`argmax`]'s
/// pick.
pub fn rank(a: (i32, f32), b: (i32, f32)) -> Ordering {
    let by_value = match (a.1.is_nan(), b.1.is_nan()) {
        (false, false) => b.1.partial_cmp(&a.1).expect("neither is a NaN"),
        (a_nan, b_nan) => a_nan.cmp(&b_nan),
    };
    by_value.then(a.0.cmp(&b.0))
}

/// The first `k` of `row`'s `(index, value)` pairs in [`rank`] order (all of them when `k`
/// is longer than `row`), into `out`.
pub fn top_k(row: &[f32], k: usize, out: &mut Vec<(i32, f32)>) {
    out.clear();
    out.extend(row.iter().enumerate().map(|(i, &v)| (i as i32, v)));
    let k = k.min(out.len());
    if k > 0 && k < out.len() {
        out.select_nth_unstable_by(k - 1, |a, b| rank(*a, *b));
    }
    out.truncate(k);
    out.sort_unstable_by(|a, b| rank(*a, *b));
}

#[cfg(test)]
mod tests {
    use super::{argmax, rank, top_k};

    #[test]
    fn the_first_largest_wins_and_nans_never_do() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, f32::NAN, 0.25]), 1);
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(argmax(&[]), 0);
    }

    #[test]
    fn top_k_follows_the_rank_and_begins_with_the_argmax() {
        let row = [
            0.5,
            f32::NAN,
            2.0,
            -0.0,
            2.0,
            0.0,
            f32::NEG_INFINITY,
            f32::NAN,
            1.0,
        ];
        let mut out = Vec::new();
        top_k(&row, 5, &mut out);
        assert_eq!(out, [(2, 2.0), (4, 2.0), (8, 1.0), (0, 0.5), (3, -0.0)]);
        top_k(&row, 100, &mut out);
        let ids: Vec<i32> = out.iter().map(|c| c.0).collect();
        assert_eq!(ids, [2, 4, 8, 0, 3, 5, 6, 1, 7]);
        for k in 1..=row.len() {
            top_k(&row, k, &mut out);
            assert_eq!(out[0].0, argmax(&row));
            assert!(out.windows(2).all(|w| rank(w[0], w[1]).is_lt()));
        }
        top_k(&row, 0, &mut out);
        assert!(out.is_empty());
        top_k(&[f32::NAN, f32::NAN], 1, &mut out);
        assert_eq!(out[0].0, argmax(&[f32::NAN, f32::NAN]));
    }
}
