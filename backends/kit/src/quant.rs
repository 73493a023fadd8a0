//! f32 affine quantization of one row, matching [`kvplug_core::quant`] exactly (f16 scale
//! and `lo`, codes computed with the stored values, `round` half away from zero).
//! Shared by byte layers that quantize on the host.

use half::f16;

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
    let levels = ((1u32 << bits) - 1) as f32;
    for (g, x) in row.chunks_exact(group).enumerate() {
        let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
        let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let scale_h = f16::from_f32((hi - lo) / levels);
        let lo_h = f16::from_f32(lo);
        scales[g] = scale_h.to_bits();
        los[g] = lo_h.to_bits();
        let (scale, lo) = (scale_h.to_f32(), lo_h.to_f32());
        let code = |v: f32| -> u8 {
            if scale == 0.0 {
                0
            } else {
                ((v - lo) / scale).round().clamp(0.0, levels) as u8
            }
        };
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
}
