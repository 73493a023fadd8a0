//! `e^x` in f32 to about `|x|·1e-7` relative, branch-free so that loops over it vectorize:
//! the cpu backend's softmax and activations (and their 8- and 16-lane twins, which share
//! [`EXP2_POLY`]) and the host's log-probabilities.

/// `ln(2)^k / k!` for k = 1..6: `2^f = e^(f ln 2)` for f in [-0.5, 0.5].
pub const EXP2_POLY: [f32; 6] = [
    std::f32::consts::LN_2,
    0.240_226_5,
    0.055_504_11,
    0.009_618_129,
    0.001_333_355_8,
    0.000_154_035_3,
];

/// `e^x` to about `|x|·1e-7` relative (1e-6 on [-20, 20]); `0` below -87, NaN for NaN.
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    const C: [f32; 6] = EXP2_POLY;
    let xc = x.clamp(-87.0, 88.0);
    let t = xc * std::f32::consts::LOG2_E;
    // Adding 1.5·2^23 rounds t to an integer n in the low bits of `shifted`'s mantissa (its
    // bits are 0x4B40_0000 + n), which give 2^n without a saturating float-to-int
    // conversion (one that SSE2 has no vector form of).
    let shifted = t + 12_582_912.0;
    let n = shifted - 12_582_912.0;
    let f = t - n;
    let p = 1.0 + f * (C[0] + f * (C[1] + f * (C[2] + f * (C[3] + f * (C[4] + f * C[5])))));
    let e = f32::from_bits(shifted.to_bits().wrapping_sub(0x4B40_0000 - 127) << 23) * p;
    if x < -87.0 {
        0.0
    } else {
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_is_within_its_stated_error() {
        // f32 range reduction limits accuracy to about |x|·1e-7 relative.
        for i in -800..=880 {
            let x = i as f32 / 10.0;
            let (got, want) = (fast_exp(x) as f64, (x as f64).exp());
            let tol = if x.abs() <= 20.0 { 1e-6 } else { 1e-5 };
            assert!(
                ((got - want) / want).abs() < tol,
                "exp({x}) = {got}, want {want}"
            );
        }
        assert_eq!(fast_exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(fast_exp(-100.0), 0.0);
        assert!(fast_exp(f32::NAN).is_nan());
    }
}
