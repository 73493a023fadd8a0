//! Exact rounding of f64 values to the storage precisions (f32, f16, bf16), so the oracle
//! stores what a backend stores. Round-to-nearest-even, as IEEE conversions do.

/// `x` rounded to the nearest f32.
pub fn round_f32(x: f64) -> f64 {
    x as f32 as f64
}

/// `x` rounded to the nearest IEEE half (subnormals included; overflow gives ±inf).
pub fn round_f16(x: f64) -> f64 {
    round_to_precision(x, 10, -14, 65520.0)
}

/// `x` rounded to f32 and then to the nearest bfloat16 (inputs are f32 in practice).
pub fn round_bf16(x: f64) -> f64 {
    let x32 = x as f32;
    if !x32.is_finite() {
        return x32 as f64;
    }
    round_to_precision(x32 as f64, 7, -126, 3.3961775292304077e38)
}

/// Rounds to a binary format with `mant` explicit mantissa bits and minimum normal
/// exponent `min_exp`; magnitudes at or above `overflow` become infinite.
fn round_to_precision(x: f64, mant: i32, min_exp: i32, overflow: f64) -> f64 {
    if !x.is_finite() || x == 0.0 {
        return x;
    }
    if x.abs() >= overflow {
        return f64::INFINITY.copysign(x);
    }
    let exp = (((x.to_bits() >> 52) & 0x7ff) as i32 - 1023).max(min_exp);
    let ulp = 2f64.powi(exp - mant);
    let y = x / ulp;
    let mut r = y.round();
    if (r - y).abs() == 0.5 {
        r = 2.0 * (y / 2.0).round();
    }
    let out = r * ulp;
    if out.abs() >= overflow {
        f64::INFINITY.copysign(x)
    } else {
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_known_values() {
        assert_eq!(round_f16(1.0), 1.0);
        assert_eq!(round_f16(65504.0), 65504.0);
        assert_eq!(round_f16(65519.0), 65504.0);
        assert_eq!(round_f16(65520.0), f64::INFINITY);
        // 1 + 2^-11 is a tie between 1 and 1 + 2^-10: even mantissa wins.
        assert_eq!(round_f16(1.0 + 2f64.powi(-11)), 1.0);
        assert_eq!(
            round_f16(1.0 + 3.0 * 2f64.powi(-11)),
            1.0 + 2.0 * 2f64.powi(-10)
        );
        // Smallest subnormal and below.
        assert_eq!(round_f16(2f64.powi(-24)), 2f64.powi(-24));
        assert_eq!(round_f16(2f64.powi(-26)), 0.0);
        assert_eq!(round_f16(-0.1), -0.0999755859375);
    }

    #[test]
    fn bf16_known_values() {
        assert_eq!(round_bf16(1.0), 1.0);
        assert_eq!(round_bf16(1.0 + 2f64.powi(-8)), 1.0);
        assert_eq!(round_bf16(1.0 + 3.0 * 2f64.powi(-8)), 1.0 + 2f64.powi(-6));
        assert_eq!(round_bf16(0.1), 0.10009765625);
    }
}
