//! Affine per-group quantization, the reference definition every backend matches.
//!
//! For each group of `group` consecutive values along `head_dim` (taken as f32): `lo = min`,
//! `hi = max`, `scale = f16(f32(hi − lo) · r)` with `r = f32(1 / (2^bits − 1))`, `lo`
//! stored as f16 (round to nearest even). The codes come from the stored values:
//! `q = clamp(⌊(x ⊖ lo) / scale + ½⌋, 0, 2^bits − 1)`, where `x ⊖ lo` is the f32 difference
//! and the quotient is the exact real one (so ties round up); `scale == 0` gives `q = 0`.
//! Dequantized: `lo + q · scale`. A zero `lo` is stored as +0 (`min` may pick either zero).
//! The definition covers finite inputs within f16's range (|x| ≤ 65504); backends need
//! not agree on the bytes of a group holding anything else.
//!
//! Every step is exactly reproducible with correctly rounded f32 operations — a subtraction,
//! a multiplication, comparisons against `(c ± ½) · scale` (exact in f32: a 9-bit by 11-bit
//! product) — so a GPU whose division is approximate (WGSL and Metal allow 2.5 ulp) can
//! still produce the same codes bit for bit: it may estimate `q` by dividing and then
//! correct it against those thresholds, as `kvplug_backend_kit::quant` does.

use crate::rounding::round_f16;

/// `f32(1 / (2^bits − 1))`, the factor that gives a group's scale.
pub fn inverse_levels(bits: u32) -> f32 {
    1.0 / ((1u32 << bits) - 1) as f32
}

/// One quantized group.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantGroup {
    /// f16-rounded scale.
    pub scale: f64,
    /// f16-rounded minimum.
    pub lo: f64,
    /// Codes in `0..2^bits`.
    pub codes: Vec<u8>,
}

/// Quantizes one group (values are taken as f32, as a backend receives them).
pub fn quantize_group(x: &[f64], bits: u32) -> QuantGroup {
    let levels = ((1u32 << bits) - 1) as f64;
    let x: Vec<f32> = x.iter().map(|&v| v as f32).collect();
    let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let scale = round_f16(((hi - lo) * inverse_levels(bits)) as f64);
    let lo = round_f16(lo as f64) + 0.0; // a zero lo is +0
    let codes = x
        .iter()
        .map(|&v| {
            if scale == 0.0 {
                0
            } else {
                // The f64 quotient of an f32 by an f16 value is never rounded onto a
                // half-integer h it is not equal to: d and h·scale are multiples of
                // 2^(e_d − 23) and of 2^(e_scale − 11), so where d/scale ≈ h ≥ ½ they differ
                // by at least one of those, which puts d/scale at least ~2^-25 from h, while
                // the f64 rounding of a quotient below 256 is at most 2^-45.
                let d = (v - lo as f32) as f64;
                (d / scale + 0.5).floor().clamp(0.0, levels) as u8
            }
        })
        .collect();
    QuantGroup { scale, lo, codes }
}

/// Dequantizes one group.
pub fn dequantize_group(g: &QuantGroup) -> Vec<f64> {
    g.codes.iter().map(|&q| g.lo + q as f64 * g.scale).collect()
}

/// What a quantized pool returns for `row` (length a multiple of `group`).
pub fn quant_round_trip(row: &[f64], bits: u32, group: usize) -> Vec<f64> {
    row.chunks(group)
        .flat_map(|g| dequantize_group(&quantize_group(g, bits)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_cover_the_range() {
        let x: Vec<f64> = (0..16).map(|i| i as f64 / 15.0 * 2.0 - 1.0).collect();
        let g = quantize_group(&x, 4);
        assert_eq!(g.lo, -1.0);
        assert_eq!(g.scale, round_f16(2.0 / 15.0));
        assert_eq!(g.codes.first(), Some(&0));
        assert_eq!(g.codes.last(), Some(&15));
        let back = dequantize_group(&g);
        for (a, b) in x.iter().zip(&back) {
            assert!((a - b).abs() <= g.scale / 2.0 + 1e-3, "{a} vs {b}");
        }
    }

    #[test]
    fn constant_group_has_zero_scale() {
        let g = quantize_group(&[0.25; 8], 8);
        assert_eq!((g.scale, g.lo), (0.0, 0.25));
        assert!(g.codes.iter().all(|&q| q == 0));
        assert_eq!(quant_round_trip(&[0.25; 8], 8, 4), vec![0.25; 8]);
    }

    #[test]
    fn q8_error_is_below_half_a_step() {
        let x: Vec<f64> = (0..64)
            .map(|i| ((i * 37) % 64) as f64 / 32.0 - 1.0)
            .collect();
        let back = quant_round_trip(&x, 8, 64);
        let step = 2.0 / 255.0;
        for (a, b) in x.iter().zip(&back) {
            assert!((a - b).abs() <= step * 0.51 + 1e-3, "{a} vs {b}");
        }
    }
}
