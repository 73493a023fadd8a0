//! The canonical row form of [`SeqRows`] (what `export_seq` returns, `import_seq` takes and
//! session files hold), written from its definition in the plugin API and independent of
//! every backend: decoding a backend's exported bytes to the values the oracle holds, and
//! encoding the values of an import.
//!
//! A row is one KV head's `head_dim` values of one position: f32/f16/bf16 little-endian; for
//! q8/q4 the codes (one byte per value; q4 two per byte, low nibble first) followed by one
//! little-endian f16 `(scale, lo)` pair per group, the value being `lo + code · scale`.

use kvplug_core::oracle::{store_rounded, RefRows};
use kvplug_core::quant::quantize_group;
use kvplug_core::{CacheConfig, KvDtype};
use kvplug_plugin_api::abi_stable::std_types::RVec;
use kvplug_plugin_api::SeqRows;

/// An IEEE half's value (written out here rather than taken from a conversion crate a
/// backend may also use).
fn f16_value(bits: u16) -> f64 {
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

/// The values of one row of `dtype` (`bytes` is exactly one row).
pub fn decode_row(dtype: KvDtype, bytes: &[u8]) -> Vec<f64> {
    let le16 = |c: &[u8]| u16::from_le_bytes([c[0], c[1]]);
    match dtype {
        KvDtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect(),
        KvDtype::F16 => bytes.chunks_exact(2).map(|c| f16_value(le16(c))).collect(),
        KvDtype::Bf16 => bytes
            .chunks_exact(2)
            .map(|c| f32::from_bits((le16(c) as u32) << 16) as f64)
            .collect(),
        KvDtype::Q8 { group } | KvDtype::Q4 { group } => {
            let bits = if matches!(dtype, KvDtype::Q8 { .. }) {
                8
            } else {
                4
            };
            let per_group = 4;
            let groups = bytes.len() / (per_group + group * bits / 8);
            let d = groups * group;
            let (codes, params) = bytes.split_at(d * bits / 8);
            (0..d)
                .map(|i| {
                    let code = match bits {
                        8 => codes[i],
                        _ => (codes[i / 2] >> (4 * (i % 2))) & 0xf,
                    };
                    let p = &params[(i / group) * per_group..];
                    let (scale, lo) = (f16_value(le16(p)), f16_value(le16(&p[2..])));
                    lo + code as f64 * scale
                })
                .collect()
        }
    }
}

/// One row of `dtype` holding `x` (taken as f32, as a backend receives activations; q8/q4
/// quantized by the reference quantizer).
pub fn encode_row(dtype: KvDtype, x: &[f64]) -> Vec<u8> {
    let half = |v: f64| half::f16::from_f64(v).to_bits().to_le_bytes();
    match dtype {
        KvDtype::F32 => x.iter().flat_map(|&v| (v as f32).to_le_bytes()).collect(),
        KvDtype::F16 => x.iter().flat_map(|&v| half(v)).collect(),
        KvDtype::Bf16 => store_rounded(dtype, x)
            .iter()
            .flat_map(|&v| (((v as f32).to_bits() >> 16) as u16).to_le_bytes())
            .collect(),
        KvDtype::Q8 { group } | KvDtype::Q4 { group } => {
            let bits = if matches!(dtype, KvDtype::Q8 { .. }) {
                8
            } else {
                4
            };
            let groups: Vec<_> = x.chunks(group).map(|g| quantize_group(g, bits)).collect();
            let codes: Vec<u8> = groups.iter().flat_map(|g| g.codes.clone()).collect();
            let mut row: Vec<u8> = match bits {
                8 => codes,
                _ => codes.chunks(2).map(|p| p[0] | (p[1] << 4)).collect(),
            };
            for g in &groups {
                row.extend(half(g.scale));
                row.extend(half(g.lo));
            }
            row
        }
    }
}

/// Why exported rows differ from the oracle's, located.
#[derive(Clone, Debug, PartialEq)]
pub struct RowMismatch {
    /// One line naming what differs.
    pub message: String,
    /// Layer.
    pub layer: Option<usize>,
    /// KV head.
    pub kv_head: Option<usize>,
    /// Row position.
    pub position: Option<i32>,
    /// Element within the row.
    pub element: Option<usize>,
    /// The oracle's value.
    pub expected: Option<f64>,
    /// The decoded value.
    pub actual: Option<f64>,
}

impl RowMismatch {
    fn shape(message: String) -> Self {
        RowMismatch {
            message,
            layer: None,
            kv_head: None,
            position: None,
            element: None,
            expected: None,
            actual: None,
        }
    }
}

/// Checks a backend's `rows` against the oracle's `want` for a cache of `cfg`: metadata,
/// positions, the rows each layer holds, and every value bit for bit.
pub fn compare(cfg: &CacheConfig, rows: &SeqRows, want: &RefRows) -> Result<(), RowMismatch> {
    let meta = (
        rows.kv_dtype.to_string(),
        rows.n_layers as usize,
        rows.n_kv_heads as usize,
        rows.head_dim as usize,
    );
    let expect = (
        cfg.kv_dtype.to_string(),
        cfg.n_layers,
        cfg.n_kv_heads,
        cfg.head_dim,
    );
    if meta != expect {
        return Err(RowMismatch::shape(format!(
            "rows describe (dtype, layers, KV heads, head_dim) = {meta:?}, the cache is {expect:?}"
        )));
    }
    if rows.positions.as_slice() != want.positions.as_slice() {
        return Err(RowMismatch::shape(format!(
            "rows hold positions {:?}, the oracle's sequence {:?}",
            rows.positions.as_slice(),
            want.positions
        )));
    }
    let sliding: Vec<u32> = cfg
        .sliding
        .map(|s| s.layers.iter().map(|l| l as u32).collect())
        .unwrap_or_default();
    let window_from = if sliding.is_empty() {
        0
    } else {
        want.window_from
    };
    if rows.sliding_layers.as_slice() != sliding.as_slice()
        || rows.window_from as usize != window_from
    {
        return Err(RowMismatch::shape(format!(
            "rows say sliding layers {:?} hold rows from index {}; expected {sliding:?} from {window_from}",
            rows.sliding_layers.as_slice(),
            rows.window_from
        )));
    }
    let (hkv, d) = (cfg.n_kv_heads, cfg.head_dim);
    let row_bytes = cfg.kv_dtype.row_bytes(d);
    for layer in 0..cfg.n_layers {
        let held = want.layer_rows(cfg, layer);
        for (side, got, values) in [("K", &rows.k, &want.k), ("V", &rows.v, &want.v)] {
            let Some(bytes) = got.get(layer) else {
                return Err(RowMismatch::shape(format!(
                    "rows have {} layers of {side}, the cache {}",
                    got.len(),
                    cfg.n_layers
                )));
            };
            if bytes.len() != hkv * held.len() * row_bytes {
                return Err(RowMismatch::shape(format!(
                    "layer {layer} {side}: {} bytes, expected {hkv} heads × {} rows × {row_bytes} bytes",
                    bytes.len(),
                    held.len()
                )));
            }
            for h in 0..hkv {
                for (r, i) in held.clone().enumerate() {
                    let at = (h * held.len() + r) * row_bytes;
                    let decoded = decode_row(cfg.kv_dtype, &bytes[at..at + row_bytes]);
                    let expected = &values[layer][(h * held.len() + r) * d..][..d];
                    if let Some(e) = (0..d).find(|&e| decoded[e].to_bits() != expected[e].to_bits())
                    {
                        let position = want.positions[i];
                        return Err(RowMismatch {
                            message: format!(
                                "layer {layer} {side} KV head {h} row {r} (position {position}) element {e}: exported {} but the oracle holds {} (rows are [heads, cells, row] in the canonical form)",
                                decoded[e], expected[e]
                            ),
                            layer: Some(layer),
                            kv_head: Some(h),
                            position: Some(position),
                            element: Some(e),
                            expected: Some(expected[e]),
                            actual: Some(decoded[e]),
                        });
                    }
                }
            }
        }
    }
    Ok(())
}

/// `want` in canonical form for a cache of `cfg` (encoded, then decoded back so the values
/// are exactly what the bytes hold).
pub fn to_seq_rows(cfg: &CacheConfig, want: &RefRows) -> (SeqRows, RefRows) {
    let d = cfg.head_dim;
    let mut decoded = want.clone();
    let side_bytes = |values: &mut Vec<Vec<f64>>| -> RVec<RVec<u8>> {
        values
            .iter_mut()
            .map(|layer| {
                let mut bytes = Vec::new();
                for row in layer.chunks_mut(d) {
                    let b = encode_row(cfg.kv_dtype, row);
                    row.copy_from_slice(&decode_row(cfg.kv_dtype, &b));
                    bytes.extend(b);
                }
                RVec::from(bytes)
            })
            .collect()
    };
    let k = side_bytes(&mut decoded.k);
    let v = side_bytes(&mut decoded.v);
    let sliding = cfg
        .sliding
        .map(|s| s.layers.iter().map(|l| l as u32).collect());
    let rows = SeqRows {
        kv_dtype: cfg.kv_dtype.to_string().into(),
        n_layers: cfg.n_layers as u32,
        n_kv_heads: cfg.n_kv_heads as u32,
        head_dim: d as u32,
        positions: want.positions.clone().into(),
        k,
        v,
        window_from: if sliding.is_some() {
            want.window_from as u32
        } else {
            0
        },
        sliding_layers: sliding.unwrap_or_default(),
    };
    (rows, decoded)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_decodes_what_it_encodes_as_the_oracle_stores_it() {
        let x: Vec<f64> = (0..64)
            .map(|i| ((i * 37 % 64) as f64 / 9.0 - 3.5) * if i % 7 == 0 { 1e-3 } else { 1.0 })
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
    fn halves_decode_subnormals_and_signs() {
        assert_eq!(f16_value(0x3c00), 1.0);
        assert_eq!(f16_value(0xc000), -2.0);
        assert_eq!(f16_value(0x0001), 2f64.powi(-24));
        assert_eq!(f16_value(0x7bff), 65504.0);
    }
}
