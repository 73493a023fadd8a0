//! Affine per-group quantization, the reference definition every backend matches.
//!
//! For each group of `group` consecutive values along `head_dim`: `lo = min`, `hi = max`,
//! `scale = (hi - lo) / (2^bits - 1)`; `scale` and `lo` are stored as f16 (round to nearest
//! even) and the codes are computed with the stored values:
//! `q = clamp(round((x - lo) / scale), 0, 2^bits - 1)` (`round` half away from zero;
//! `scale == 0` gives `q = 0`). The arithmetic is IEEE f32 (inputs are f32), so every
//! backend produces the same codes bit for bit. Dequantized: `lo + q * scale`.

use crate::rounding::round_f16;

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
    let levels = ((1u32 << bits) - 1) as f32;
    let x: Vec<f32> = x.iter().map(|&v| v as f32).collect();
    let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let scale = round_f16(((hi - lo) / levels) as f64);
    let lo = round_f16(lo as f64);
    let (scale32, lo32) = (scale as f32, lo as f32);
    let codes = x
        .iter()
        .map(|&v| {
            if scale == 0.0 {
                0
            } else {
                ((v - lo32) / scale32).round().clamp(0.0, levels) as u8
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
