//! The canonical row form of saved K/V (the plugin API's `SeqRows`: what `export_seq`
//! returns, `import_seq` takes and session files hold), written from its definition for the
//! oracle's side of every check: the bytes a row of values must be, and the values a row of
//! bytes holds. No backend's code is used.
//!
//! A row is one KV head's `head_dim` values of one position: f32/f16/bf16 little-endian; for
//! q8/q4 the codes (one byte per value; q4 two per byte, low nibble first) followed by one
//! little-endian f16 `(scale, lo)` pair per group, the value being `lo + code · scale`
//! ([`crate::quant`]).

use crate::dtype::KvDtype;
use crate::quant::quantize_group;
use crate::rounding::{round_bf16, round_f16};

/// The first of `positions` (ascending) a sliding layer of `window` still holds: the first
/// position above `last - window`.
pub fn window_start(positions: &[i32], window: usize) -> usize {
    let Some(&last) = positions.last() else {
        return 0;
    };
    positions
        .iter()
        .position(|&p| p as i64 > last as i64 - window as i64)
        .unwrap_or(positions.len())
}

/// An IEEE half's value.
fn half_value(bits: u16) -> f64 {
    let sign = if bits & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = ((bits >> 10) & 0x1f) as i32;
    let frac = (bits & 0x3ff) as f64;
    sign * match exp {
        0 => frac * 2f64.powi(-24),
        31 if frac == 0.0 => f64::INFINITY,
        31 => f64::NAN,
        e => (1.0 + frac / 1024.0) * 2f64.powi(e - 15),
    }
}

/// The half holding `x` rounded to nearest even.
fn half_bits(x: f64) -> u16 {
    let v = round_f16(x);
    let sign = if v.is_sign_negative() { 0x8000 } else { 0 };
    let a = v.abs();
    if a.is_nan() {
        return 0x7e00;
    }
    if a.is_infinite() {
        return sign | 0x7c00;
    }
    if a < 2f64.powi(-14) {
        // Subnormal (or zero): an exact multiple of 2^-24.
        return sign | (a * 2f64.powi(24)) as u16;
    }
    let bits = a.to_bits();
    let exp = ((bits >> 52) & 0x7ff) as i64 - 1023 + 15;
    sign | ((exp as u16) << 10) | ((bits >> 42) & 0x3ff) as u16
}

/// One row of `dtype` holding `x` (taken as f32, as a backend receives activations: f16 and
/// bf16 round to nearest even, q8/q4 quantize by [`crate::quant`]).
pub fn encode_row(dtype: KvDtype, x: &[f64]) -> Vec<u8> {
    let x32 = |v: f64| v as f32 as f64;
    match dtype {
        KvDtype::F32 => x.iter().flat_map(|&v| (v as f32).to_le_bytes()).collect(),
        KvDtype::F16 => x
            .iter()
            .flat_map(|&v| half_bits(x32(v)).to_le_bytes())
            .collect(),
        KvDtype::Bf16 => x
            .iter()
            .flat_map(|&v| (((round_bf16(x32(v)) as f32).to_bits() >> 16) as u16).to_le_bytes())
            .collect(),
        KvDtype::Q8 { group } | KvDtype::Q4 { group } => {
            let bits = if dtype.family() == "q8" { 8 } else { 4 };
            let groups: Vec<_> = x.chunks(group).map(|g| quantize_group(g, bits)).collect();
            let codes: Vec<u8> = groups.iter().flat_map(|g| g.codes.clone()).collect();
            let mut row: Vec<u8> = match bits {
                8 => codes,
                _ => codes.chunks(2).map(|p| p[0] | (p[1] << 4)).collect(),
            };
            for g in &groups {
                row.extend(half_bits(g.scale).to_le_bytes());
                row.extend(half_bits(g.lo).to_le_bytes());
            }
            row
        }
    }
}

/// The values one row of `dtype` holds (`bytes` is exactly one row of `head_dim` values).
pub fn decode_row(dtype: KvDtype, bytes: &[u8]) -> Vec<f64> {
    let le16 = |c: &[u8]| u16::from_le_bytes([c[0], c[1]]);
    match dtype {
        KvDtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect(),
        KvDtype::F16 => bytes.chunks_exact(2).map(|c| half_value(le16(c))).collect(),
        KvDtype::Bf16 => bytes
            .chunks_exact(2)
            .map(|c| f32::from_bits((le16(c) as u32) << 16) as f64)
            .collect(),
        KvDtype::Q8 { group } | KvDtype::Q4 { group } => {
            let bits = if dtype.family() == "q8" { 8 } else { 4 };
            let groups = bytes.len() / (4 + group * bits / 8);
            let d = groups * group;
            let (codes, params) = bytes.split_at(d * bits / 8);
            (0..d)
                .map(|i| {
                    let code = match bits {
                        8 => codes[i],
                        _ => (codes[i / 2] >> (4 * (i % 2))) & 0xf,
                    };
                    let p = &params[(i / group) * 4..];
                    let (scale, lo) = (half_value(le16(p)), half_value(le16(&p[2..])));
                    lo + code as f64 * scale
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oracle::store_rounded;

    #[test]
    fn every_dtype_decodes_what_it_encodes_as_the_oracle_stores_it() {
        let x: Vec<f64> = (0..64)
            .map(|i| ((i * 37 % 64) as f64 / 9.0 - 3.5) * if i % 7 == 0 { 1e-6 } else { 1.0 })
            .collect();
        for dtype in [
            KvDtype::F32,
            KvDtype::F16,
            KvDtype::Bf16,
            KvDtype::Q8 { group: 32 },
            KvDtype::Q4 { group: 16 },
        ] {
            let bytes = encode_row(dtype, &x);
            assert_eq!(bytes.len(), dtype.row_bytes(64), "{dtype}");
            assert_eq!(
                decode_row(dtype, &bytes),
                store_rounded(dtype, &x),
                "{dtype}"
            );
        }
    }

    #[test]
    fn rows_have_the_bytes_the_format_defines() {
        // Halves: 1, -2, the smallest subnormal, the largest finite.
        let x = [1.0, -2.0, 2f64.powi(-24), 65504.0];
        assert_eq!(
            encode_row(KvDtype::F16, &x),
            [0x00, 0x3c, 0x00, 0xc0, 0x01, 0x00, 0xff, 0x7b]
        );
        assert_eq!(
            encode_row(KvDtype::Bf16, &[1.0, -2.0]),
            [0x80, 0x3f, 0x00, 0xc0]
        );
        // q4, one group of 4 spanning [0, 15]: scale 1, lo 0, codes 0, 15, 1, 2 packed low
        // nibble first, then the f16 pair (scale, lo).
        assert_eq!(
            encode_row(KvDtype::Q4 { group: 4 }, &[0.0, 15.0, 1.0, 2.0]),
            [0xf0, 0x21, 0x00, 0x3c, 0x00, 0x00]
        );
        // q8, one group of 2 spanning [-1, 254]: scale 1, lo -1.
        assert_eq!(
            encode_row(KvDtype::Q8 { group: 2 }, &[-1.0, 254.0]),
            [0, 255, 0x00, 0x3c, 0x00, 0xbc]
        );
    }

    #[test]
    fn the_window_starts_above_last_minus_window() {
        assert_eq!(window_start(&[0, 1, 2, 3, 4, 5], 2), 4);
        assert_eq!(window_start(&[3, 9], 100), 0);
        assert_eq!(window_start(&[], 4), 0);
    }
}
