//! The greedy pick, shared by the host's sampler and the backends' device argmax
//! (`ModelDevice::argmax_rows`), so that both choose the same token.

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

#[cfg(test)]
mod tests {
    use super::argmax;

    #[test]
    fn the_first_largest_wins_and_nans_never_do() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, f32::NAN, 0.25]), 1);
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(argmax(&[]), 0);
    }
}
