//! f32 affine quantization of one row, matching [`kvplug_core::quant`] exactly (f16 scale
//! and `lo`, codes computed with the stored values, ties rounded up). Shared by byte layers
//! that quantize on the host; [`code`] is the estimate-and-correct step a GPU kernel mirrors.

use half::f16;
use kvplug_core::quant::inverse_levels;

/// Quantizes `row` in groups of `group` into `codes` (one byte per value for 8 bits; two
/// values per byte, low nibble first, for 4 bits), `scales` and `los` (f16 bits, one per
/// group).
pub fn quantize_row(
    row: &[f32],
    bits: u32,
    group: usize,
    codes: &mut [u8],
    scales: &mut [u16],
    los: &mut [u16],
) {
    let levels = (1u32 << bits) - 1;
    for (g, x) in row.chunks_exact(group).enumerate() {
        let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
        let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let scale_h = f16::from_f32((hi - lo) * inverse_levels(bits));
        let mut lo_h = f16::from_f32(lo);
        if lo_h == f16::ZERO {
            lo_h = f16::ZERO; // -0 too: a zero lo is stored as +0
        }
        scales[g] = scale_h.to_bits();
        los[g] = lo_h.to_bits();
        let (scale, lo) = (scale_h.to_f32(), lo_h.to_f32());
        let code = |v: f32| code(v - lo, scale, levels) as u8;
        if bits == 8 {
            for (c, &v) in codes[g * group..(g + 1) * group].iter_mut().zip(x) {
                *c = code(v);
            }
        } else {
            let out = &mut codes[g * group / 2..(g + 1) * group / 2];
            for (c, pair) in out.iter_mut().zip(x.chunks_exact(2)) {
                *c = code(pair[0]) | (code(pair[1]) << 4);
            }
        }
    }
}

/// The code of the f32 difference `d = x ⊖ lo` on the f16 `scale`: `⌊d / scale + ½⌋` of the
/// exact quotient, clamped to `0..=levels` (0 when `scale == 0`). The division only
/// estimates it; the comparisons decide, against `(c ± ½) · scale`, which f32 holds exactly
/// (a 9-bit by 11-bit product).
#[inline]
pub fn code(d: f32, scale: f32, levels: u32) -> u32 {
    if scale == 0.0 {
        return 0;
    }
    let top = levels as f32;
    let mut c = (d / scale + 0.5).floor().clamp(0.0, top);
    if c > 0.0 && d < (c - 0.5) * scale {
        c -= 1.0;
    } else if c < top && d >= (c + 0.5) * scale {
        c += 1.0;
    }
    c as u32
}

/// Dequantizes a row written by [`quantize_row`] into `out`. `#[inline]` so byte layers can
/// compile it inside their own vector-feature contexts.
#[inline]
pub fn dequantize_row(
    codes: &[u8],
    scales: &[u16],
    los: &[u16],
    bits: u32,
    group: usize,
    out: &mut [f32],
) {
    for (g, o) in out.chunks_exact_mut(group).enumerate() {
        let scale = f16::from_bits(scales[g]).to_f32();
        let lo = f16::from_bits(los[g]).to_f32();
        if bits == 8 {
            for (v, &c) in o.iter_mut().zip(&codes[g * group..(g + 1) * group]) {
                *v = lo + c as f32 * scale;
            }
        } else {
            for (pair, &c) in o
                .chunks_exact_mut(2)
                .zip(&codes[g * group / 2..(g + 1) * group / 2])
            {
                pair[0] = lo + (c & 0xf) as f32 * scale;
                pair[1] = lo + (c >> 4) as f32 * scale;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvplug_core::quant::quant_round_trip;

    #[test]
    fn matches_the_core_reference() {
        let row: Vec<f32> = (0..64)
            .map(|i| ((i * 29 % 64) as f32 / 40.0 - 0.8).sin())
            .collect();
        for (bits, group) in [(8, 64), (8, 16), (4, 32), (4, 8)] {
            let n_groups = 64 / group;
            let mut codes = vec![0u8; if bits == 8 { 64 } else { 32 }];
            let (mut s, mut l) = (vec![0u16; n_groups], vec![0u16; n_groups]);
            quantize_row(&row, bits, group, &mut codes, &mut s, &mut l);
            let mut out = vec![0f32; 64];
            dequantize_row(&codes, &s, &l, bits, group, &mut out);
            let reference = quant_round_trip(
                &row.iter().map(|&x| x as f64).collect::<Vec<_>>(),
                bits,
                group,
            );
            for (a, b) in out.iter().zip(&reference) {
                assert!(
                    (*a as f64 - b).abs() < 1e-6,
                    "bits {bits} group {group}: {a} vs {b}"
                );
            }
        }
    }

    /// Differences on either side of each threshold `(c + ½) · scale`, for scales across
    /// the f16 range (normal and subnormal): the tie and above take `c + 1`, the f32 just
    /// below takes `c` — whatever an estimate by division says (an f32 division rounds
    /// many of the just-below quotients up to the half-integer itself).
    #[test]
    fn code_decides_each_threshold_exactly() {
        let mut estimate_wrong = 0;
        for bits in [4u32, 8] {
            let levels = (1u32 << bits) - 1;
            for sh in (1u16..0x7b00).step_by(97) {
                let scale = f16::from_bits(sh).to_f32();
                for c in 0..levels {
                    let tie = (c as f32 + 0.5) * scale;
                    assert_eq!(
                        (tie as f64),
                        (c as f64 + 0.5) * scale as f64,
                        "exact product"
                    );
                    let below = f32::from_bits(tie.to_bits() - 1);
                    assert_eq!(code(tie, scale, levels), c + 1, "tie, scale {scale} c {c}");
                    assert_eq!(code(below, scale, levels), c, "below, scale {scale} c {c}");
                    estimate_wrong += ((below / scale + 0.5).floor() as u32 != c) as u32;
                }
                assert_eq!(code(-scale, scale, levels), 0);
                assert_eq!(code(1e9 * scale, scale, levels), levels);
            }
        }
        assert!(
            estimate_wrong > 0,
            "the case the comparisons exist for never arose"
        );
        assert_eq!(code(1.0, 0.0, 255), 0);
    }

    /// The codes of rows with values placed at and beside the thresholds equal the core
    /// reference's (which decides in f64, a different route to the same definition).
    #[test]
    fn near_threshold_rows_match_the_core_reference() {
        use kvplug_core::quant::quantize_group;
        for (bits, group) in [(8u32, 32usize), (4, 32)] {
            let levels = (1u32 << bits) - 1;
            for seed in 0..64u32 {
                // lo = 0, so each difference is the value itself: interior values sit on a
                // threshold of the scale the row will get, or one f32 either side of it.
                let hi = levels as f32 * (0.001 + seed as f32 * 1.7e-4);
                let scale = f16::from_f32(hi * inverse_levels(bits)).to_f32();
                let row: Vec<f32> = (0..group as u32)
                    .map(|i| match i {
                        0 => 0.0,
                        1 => hi,
                        _ => {
                            let t = (((i * 7 + seed) % levels) as f32 + 0.5) * scale;
                            f32::from_bits((t.to_bits() as i32 + (i % 3) as i32 - 1) as u32)
                        }
                    })
                    .collect();
                let mut codes = vec![0u8; group * bits as usize / 8];
                let (mut s, mut l) = ([0u16], [0u16]);
                quantize_row(&row, bits, group, &mut codes, &mut s, &mut l);
                let reference =
                    quantize_group(&row.iter().map(|&x| x as f64).collect::<Vec<_>>(), bits);
                let ours: Vec<u8> = if bits == 8 {
                    codes.clone()
                } else {
                    codes.iter().flat_map(|&c| [c & 0xf, c >> 4]).collect()
                };
                assert_eq!(ours, reference.codes, "bits {bits} seed {seed}");
                assert_eq!(f16::from_bits(s[0]).to_f64(), reference.scale);
                assert_eq!(f16::from_bits(l[0]).to_f64(), reference.lo);
            }
        }
    }

    /// A group whose minimum is zero (either sign, mixed) stores lo as +0.
    #[test]
    fn a_zero_lo_is_stored_as_plus_zero() {
        for row in [[-0.0f32, 0.0, 0.5, 1.0], [0.0, -0.0, 0.5, 1.0], [-0.0; 4]] {
            for bits in [8, 4] {
                let mut codes = [0u8; 4];
                let (mut s, mut l) = ([0u16], [0u16]);
                quantize_row(&row, bits, 4, &mut codes, &mut s, &mut l);
                assert_eq!(l[0], 0, "{row:?} bits {bits}");
            }
        }
    }
}
