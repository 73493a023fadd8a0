//! [`SeqRows`] against the oracle: a backend's exported rows decoded and compared with the
//! values the oracle holds, and the oracle's values as the rows of an import (the row
//! format itself is [`kvplug_core::oracle::encode_row`] / [`decode_row`]).

use kvplug_core::oracle::{decode_row, encode_row, RefRows};
use kvplug_core::CacheConfig;
use kvplug_plugin_api::abi_stable::std_types::RVec;
use kvplug_plugin_api::SeqRows;

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

/// The sliding layers of `cfg`, ascending.
fn sliding_layers(cfg: &CacheConfig) -> Vec<u32> {
    cfg.sliding
        .map(|s| s.layers.iter().map(|l| l as u32).collect())
        .unwrap_or_default()
}

/// Checks a backend's `rows` against the oracle's `want` for a cache of `cfg`: metadata,
/// positions, the rows each layer holds, and every value they decode to, bit for bit.
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
    let sliding = sliding_layers(cfg);
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
                        let n = held.len();
                        let block = &values[layer];
                        let hint = if hkv > 1 && transposed(cfg, bytes, block, n) {
                            "; the rows are in [rows, heads] order, the canonical form is [heads, rows, row]"
                        } else {
                            ""
                        };
                        return Err(RowMismatch {
                            message: format!(
                                "layer {layer} {side} KV head {h} row {r} (position {position}) element {e}: exported {} but the oracle holds {}{hint}",
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

/// Whether `bytes` hold the oracle's `values` (`[heads, n, D]`) with rows and heads swapped.
fn transposed(cfg: &CacheConfig, bytes: &[u8], values: &[f64], n: usize) -> bool {
    let (hkv, d, row) = (
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.kv_dtype.row_bytes(cfg.head_dim),
    );
    (0..hkv).all(|h| {
        (0..n).all(|r| {
            let at = (r * hkv + h) * row;
            decode_row(cfg.kv_dtype, &bytes[at..at + row]) == values[(h * n + r) * d..][..d]
        })
    })
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
    let sliding = sliding_layers(cfg);
    let rows = SeqRows {
        kv_dtype: cfg.kv_dtype.to_string().into(),
        n_layers: cfg.n_layers as u32,
        n_kv_heads: cfg.n_kv_heads as u32,
        head_dim: d as u32,
        positions: want.positions.clone().into(),
        k,
        v,
        window_from: if sliding.is_empty() {
            0
        } else {
            want.window_from as u32
        },
        sliding_layers: sliding.into(),
        recurrent_layers: Default::default(),
        state: Default::default(),
    };
    (rows, decoded)
}
