// The op carries seven arguments by contract; `#[sabi_trait]` generates shims with one more.
#![allow(clippy::too_many_arguments)]

//! The cache object every backend builds, and its configuration and statistics.

use abi_stable::sabi_trait;
use abi_stable::std_types::{RArc, ROption, RResult, RSlice, RStr, RString, RVec};
use abi_stable::StableAbi;
use kvplug_core::config::{ConvLayers, DeltaLayers, LayerSet, SlidingLayers, SsmLayers};
use kvplug_core::{CacheConfig, CacheError, KvDtype};

use crate::error::PluginError;
use crate::tensor::{HostTensor, TensorDtype};

/// [`CacheConfig`] across the ABI (the KV dtype travels as its string name).
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct AbiCacheConfig {
    /// Hard ceiling in cells.
    pub capacity: u64,
    /// Layers.
    pub n_layers: u32,
    /// KV heads per layer.
    pub n_kv_heads: u32,
    /// Values per head row.
    pub head_dim: u32,
    /// First pool allocation in cells.
    pub min_chunk: u64,
    /// `f32`, `f16`, `bf16`, `q8`, `q4` (or `q8g32`-style).
    pub kv_dtype: RString,
    /// The sliding window of [`AbiCacheConfig::sliding_layers`] (0: no sliding layers).
    pub sliding_window: u64,
    /// Layers attending through the sliding window.
    pub sliding_layers: RVec<u32>,
    /// Taps of [`AbiCacheConfig::conv_layers`]' convolution (0: no convolution layers).
    pub conv_width: u32,
    /// Channels of the convolution layers' rows.
    pub conv_channels: u32,
    /// Short-convolution layers (no K/V; see [`ConvLayers`]).
    pub conv_layers: RVec<u32>,
    /// Key heads of [`AbiCacheConfig::delta_layers`] (0: no delta-rule layers).
    pub delta_key_heads: u32,
    /// Value heads of the delta-rule layers.
    pub delta_value_heads: u32,
    /// Head size (key and value) of the delta-rule layers.
    pub delta_head_dim: u32,
    /// Taps of the convolution in front of the delta rule.
    pub delta_conv_width: u32,
    /// Gated delta-rule layers (no K/V, no rows per cell; see [`DeltaLayers`]).
    pub delta_layers: RVec<u32>,
    /// Heads of [`AbiCacheConfig::ssm_layers`] (0: no Mamba2 layers).
    pub ssm_heads: u32,
    /// Values of x per Mamba2 head.
    pub ssm_head_dim: u32,
    /// Groups of Mamba2 heads sharing B and C.
    pub ssm_groups: u32,
    /// Size of B and C.
    pub ssm_state: u32,
    /// Taps of the convolution in front of the scan.
    pub ssm_conv_width: u32,
    /// Mamba2 layers (no K/V, no rows per cell; see [`SsmLayers`]).
    pub ssm_layers: RVec<u32>,
}

impl From<&CacheConfig> for AbiCacheConfig {
    fn from(c: &CacheConfig) -> Self {
        AbiCacheConfig {
            capacity: c.capacity as u64,
            // Saturated, never wrapped: an oversized value stays oversized and is refused
            // by validation on the other side instead of becoming a small valid one.
            n_layers: u32::try_from(c.n_layers).unwrap_or(u32::MAX),
            n_kv_heads: u32::try_from(c.n_kv_heads).unwrap_or(u32::MAX),
            head_dim: u32::try_from(c.head_dim).unwrap_or(u32::MAX),
            min_chunk: c.min_chunk as u64,
            kv_dtype: c.kv_dtype.to_string().into(),
            sliding_window: c.sliding.map_or(0, |s| s.window as u64),
            sliding_layers: c
                .sliding
                .map(|s| s.layers.iter().map(|l| l as u32).collect())
                .unwrap_or_default(),
            conv_width: c
                .conv
                .map_or(0, |v| u32::try_from(v.width).unwrap_or(u32::MAX)),
            conv_channels: c
                .conv
                .map_or(0, |v| u32::try_from(v.channels).unwrap_or(u32::MAX)),
            conv_layers: c
                .conv
                .map(|v| v.layers.iter().map(|l| l as u32).collect())
                .unwrap_or_default(),
            delta_key_heads: c.delta.map_or(0, |d| saturate(d.key_heads)),
            delta_value_heads: c.delta.map_or(0, |d| saturate(d.value_heads)),
            delta_head_dim: c.delta.map_or(0, |d| saturate(d.head_dim)),
            delta_conv_width: c.delta.map_or(0, |d| saturate(d.width)),
            delta_layers: c
                .delta
                .map(|d| d.layers.iter().map(|l| l as u32).collect())
                .unwrap_or_default(),
            ssm_heads: c.ssm.map_or(0, |m| saturate(m.heads)),
            ssm_head_dim: c.ssm.map_or(0, |m| saturate(m.head_dim)),
            ssm_groups: c.ssm.map_or(0, |m| saturate(m.groups)),
            ssm_state: c.ssm.map_or(0, |m| saturate(m.state)),
            ssm_conv_width: c.ssm.map_or(0, |m| saturate(m.width)),
            ssm_layers: c
                .ssm
                .map(|m| m.layers.iter().map(|l| l as u32).collect())
                .unwrap_or_default(),
        }
    }
}

/// `n` as a `u32`, saturated (validation refuses it on the other side).
fn saturate(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl TryFrom<&AbiCacheConfig> for CacheConfig {
    type Error = CacheError;
    /// Parses the dtype and validates the result.
    fn try_from(c: &AbiCacheConfig) -> Result<Self, CacheError> {
        let kv_dtype: KvDtype =
            c.kv_dtype
                .parse()
                .map_err(|e: kvplug_core::dtype::ParseDtypeError| {
                    CacheError::bad_config(e.to_string())
                })?;
        let sliding = match (c.sliding_window, c.sliding_layers.is_empty()) {
            (0, true) => None,
            (0, false) => {
                return Err(CacheError::bad_config(
                    "sliding layers are listed but the sliding window is 0",
                ))
            }
            (w, _) => Some(SlidingLayers {
                window: usize::try_from(w).unwrap_or(usize::MAX),
                layers: LayerSet::of(c.sliding_layers.iter().map(|&l| l as usize))?,
            }),
        };
        let conv = match (c.conv_width, c.conv_layers.is_empty()) {
            (0, true) => None,
            (0, false) => {
                return Err(CacheError::bad_config(
                    "convolution layers are listed but their width is 0",
                ))
            }
            (w, _) => Some(ConvLayers {
                width: w as usize,
                channels: c.conv_channels as usize,
                layers: LayerSet::of(c.conv_layers.iter().map(|&l| l as usize))?,
            }),
        };
        let delta = match (c.delta_key_heads, c.delta_layers.is_empty()) {
            (0, true) => None,
            (0, false) => {
                return Err(CacheError::bad_config(
                    "delta-rule layers are listed but they have no key heads",
                ))
            }
            (k, _) => Some(DeltaLayers {
                key_heads: k as usize,
                value_heads: c.delta_value_heads as usize,
                head_dim: c.delta_head_dim as usize,
                width: c.delta_conv_width as usize,
                layers: LayerSet::of(c.delta_layers.iter().map(|&l| l as usize))?,
            }),
        };
        let ssm = match (c.ssm_heads, c.ssm_layers.is_empty()) {
            (0, true) => None,
            (0, false) => {
                return Err(CacheError::bad_config(
                    "Mamba2 layers are listed but they have no heads",
                ))
            }
            (heads, _) => Some(SsmLayers {
                heads: heads as usize,
                head_dim: c.ssm_head_dim as usize,
                groups: c.ssm_groups as usize,
                state: c.ssm_state as usize,
                width: c.ssm_conv_width as usize,
                layers: LayerSet::of(c.ssm_layers.iter().map(|&l| l as usize))?,
            }),
        };
        let cfg = CacheConfig {
            sliding,
            conv,
            delta,
            ssm,
            capacity: c.capacity as usize,
            n_layers: c.n_layers as usize,
            n_kv_heads: c.n_kv_heads as usize,
            head_dim: c.head_dim as usize,
            min_chunk: c.min_chunk as usize,
            kv_dtype,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// What a cache holds and what its last step did.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct CacheStats {
    /// Bytes allocated for K and V pools over all layers (scales and offsets included) and
    /// for the recurrent layers' state (their anchors).
    pub allocated_bytes: u64,
    /// Cells the full layers' pools have room for (lazy growth: never more than needed,
    /// doubled).
    pub pool_cells: u64,
    /// Cells the sliding layers' pools have room for (0 without sliding layers).
    pub window_cells: u64,
    /// Cells holding data.
    pub live_cells: u64,
    /// One past the highest cell holding data.
    pub high_water: u64,
    /// `single_contiguous` or `explicit` for the last planned step; none before the first.
    pub last_plan: ROption<RString>,
    /// The read window of the last planned step, in cells (0 before the first).
    pub last_read_len: u64,
    /// Seq: tokens the prefix index holds.
    pub prefix_cached: u64,
    /// Seq: of those, tokens no live sequence holds (evictable).
    pub prefix_evictable: u64,
}

/// One sequence's K/V history in storage form: what a session file holds, on any backend.
///
/// Layer `l`'s K rows are `k[l]`, row-major `[n_kv_heads, rows, row_bytes]` with
/// `row_bytes = KvDtype::row_bytes(head_dim)` and `rows` those of [`SeqRows::layer_rows`]:
/// every position for a fully attending layer, the positions from index `window_from` on for
/// a layer in `sliding_layers` (a hybrid model's sliding-window layers keep only the window);
/// none for a layer in `recurrent_layers` (a recurrent layer: its state is in `state`);
/// V likewise. A row is its values little-endian
/// (f32/f16/bf16), or for q8/q4 its codes (one byte per value; for q4 two per byte, low
/// nibble first) followed by one little-endian f16 `(scale, lo)` pair per group.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct SeqRows {
    /// Storage dtype name (`f16`, `q4`, `q8g32`, ...).
    pub kv_dtype: RString,
    /// Layers.
    pub n_layers: u32,
    /// KV heads per layer.
    pub n_kv_heads: u32,
    /// Values per head row.
    pub head_dim: u32,
    /// Position of each row, ascending.
    pub positions: RVec<i32>,
    /// Per layer K rows.
    pub k: RVec<RVec<u8>>,
    /// Per layer V rows.
    pub v: RVec<RVec<u8>>,
    /// Layers holding only the rows from index `window_from` on, ascending (empty: every
    /// layer holds every row).
    pub sliding_layers: RVec<u32>,
    /// Index in `positions` of the first row the `sliding_layers` hold (0 without them).
    pub window_from: u32,
    /// Layers without rows (delta-rule, Mamba2 and short-convolution layers), ascending;
    /// their `k` and `v` are empty.
    pub recurrent_layers: RVec<u32>,
    /// The recurrent layers' state after the last row (empty without them, or for a slice
    /// that ends before the last row): per recurrent layer, ascending, its f32 values
    /// little-endian. A delta-rule layer: the rule's matrices (`[value head][j][i]`,
    /// `S[i][j]`) then its convolution's last `width − 1` input rows, oldest first. A Mamba2
    /// layer: the scan's state (`[head][head_dim][state]`) then its convolution's last
    /// `width − 1` input rows (x, B and C), oldest first. A short-convolution layer: its input rows of positions `last − width + 2 ..= last`,
    /// oldest first, zeros for a position before the sequence's start.
    pub state: RVec<u8>,
}

impl SeqRows {
    /// The range of row indices (into `positions`) layer `layer` holds.
    pub fn layer_rows(&self, layer: usize) -> std::ops::Range<usize> {
        let n = self.positions.len();
        if self.sliding_layers.contains(&(layer as u32)) {
            (self.window_from as usize).min(n)..n
        } else {
            0..n
        }
    }

    /// Bytes of one head row (0 when there are no rows).
    pub fn row_bytes(&self) -> usize {
        let Some(l) = (0..self.k.len()).find(|&l| !self.recurrent_layers.contains(&(l as u32)))
        else {
            return 0;
        };
        let n = self.layer_rows(l).len() * self.n_kv_heads as usize;
        self.k[l].len().checked_div(n).unwrap_or(0)
    }

    /// Rows `range` (by index, not position), every layer; a sliding layer keeps the part of
    /// `range` it holds; the recurrent state only when `range` runs to the last row.
    pub fn slice(&self, range: std::ops::Range<usize>) -> SeqRows {
        let (heads, row) = (self.n_kv_heads as usize, self.row_bytes());
        let from = (self.window_from as usize).clamp(range.start, range.end);
        let cut = |layers: &RVec<RVec<u8>>| -> RVec<RVec<u8>> {
            layers
                .iter()
                .enumerate()
                .map(|(l, rows)| {
                    if rows.is_empty() {
                        return RVec::new();
                    }
                    let held = self.layer_rows(l);
                    let (n, a, b) = (
                        held.len(),
                        range.start.max(held.start) - held.start,
                        range.end.max(held.start) - held.start,
                    );
                    (0..heads)
                        .flat_map(|h| rows[(h * n + a) * row..(h * n + b) * row].to_vec())
                        .collect()
                })
                .collect()
        };
        SeqRows {
            positions: self.positions[range.clone()].to_vec().into(),
            k: cut(&self.k),
            v: cut(&self.v),
            window_from: if self.sliding_layers.is_empty() {
                0
            } else {
                (from - range.start) as u32
            },
            state: if range.end == self.positions.len() {
                self.state.clone()
            } else {
                RVec::new()
            },
            ..self.clone()
        }
    }
}

/// A KV cache owned by a plugin. All methods take `&self` (implementations lock
/// internally) so the host registry, a session and a model method can share it through
/// `RArc`. Verbs the cache's kind lacks return `not_supported`; every refused call leaves
/// the cache exactly as it was.
#[sabi_trait]
pub trait CacheObject: Clone + Send + Sync {
    /// `contiguous`, `seq` or `tree`.
    fn kind(&self) -> RString;
    /// The logical ceiling in cells.
    fn capacity(&self) -> u64;
    /// Whether `n` more tokens fit.
    fn can_extend(&self, n: u64) -> bool;
    /// Forgets everything (no byte work).
    fn clear(&self) -> RResult<(), PluginError>;
    /// Contiguous: truncate to `len` tokens.
    fn rewind(&self, len: u64) -> RResult<(), PluginError>;
    /// Seq: per-token sequence ids of the next step.
    fn begin_step(&self, seq_ids: RSlice<'_, i32>) -> RResult<(), PluginError>;
    /// Seq: share `src`'s cells with `p0 <= pos < p1` (none = open) with `dst`.
    fn seq_cp(
        &self,
        src: i32,
        dst: i32,
        p0: ROption<i32>,
        p1: ROption<i32>,
    ) -> RResult<(), PluginError>;
    /// Seq: drop `seq` from its cells with `p0 <= pos < p1`.
    fn seq_rm(&self, seq: i32, p0: ROption<i32>, p1: ROption<i32>) -> RResult<(), PluginError>;
    /// Seq: keep `seq` alone.
    fn seq_keep(&self, seq: i32) -> RResult<(), PluginError>;
    /// Seq: cells held by `seq`.
    fn seq_len(&self, seq: i32) -> RResult<u64, PluginError>;
    /// Tree: append a frontier (parents index nodes since the last commit; -1 = prefix).
    fn propose(&self, parents: RSlice<'_, i32>) -> RResult<(), PluginError>;
    /// Tree: accept a root-first chain.
    fn commit(&self, accepted: RSlice<'_, i32>) -> RResult<(), PluginError>;
    /// Memory and last-step statistics.
    fn stats(&self) -> RResult<CacheStats, PluginError>;
    /// The op: writes k/v (`[1, Hkv, T, D]`) for `layer` at `positions` (T values), then
    /// attends q (`[1, Hq, T, D]`, `Hq` a multiple of `Hkv`) with the cache's mask and
    /// returns `[1, Hq, T, D]` in `out_dtype`.
    ///
    /// A step is a transaction: layer 0 opens it, layers `1..n_layers` follow in order with
    /// the same positions, and it commits when the last layer succeeds. A refused or failed
    /// layer rolls the whole step back (the cache is exactly as before layer 0), and so does
    /// a verb or a new layer 0 arriving before the step completes.
    fn update_and_attend(
        &self,
        layer: u32,
        q: &HostTensor,
        k: &HostTensor,
        v: &HostTensor,
        positions: RSlice<'_, i32>,
        scale: f32,
        out_dtype: TensorDtype,
    ) -> RResult<HostTensor, PluginError>;
    /// Seq: how many leading `tokens` the prefix index holds.
    fn prefix_match(&self, tokens: RSlice<'_, u32>) -> RResult<u64, PluginError>;
    /// Seq: gives the empty `seq` the cells of the longest cached prefix of `tokens`
    /// (positions `0..m`, no K/V copy); returns `m`.
    fn prefix_attach(&self, seq: i32, tokens: RSlice<'_, u32>) -> RResult<u64, PluginError>;
    /// Seq: caches `seq`'s K/V of `tokens` (token `i` at position `i`); returns how many
    /// leading tokens were cached already.
    fn prefix_publish(&self, seq: i32, tokens: RSlice<'_, u32>) -> RResult<u64, PluginError>;
    /// Seq: makes `n` cells free, evicting unheld cached prefixes (least recently used first)
    /// as needed; returns the cells evicted.
    fn prefix_reserve(&self, n: u64) -> RResult<u64, PluginError>;
    /// Seq: evicts at least `n` cells of unheld cached prefixes; returns the cells freed.
    fn prefix_evict(&self, n: u64) -> RResult<u64, PluginError>;
    /// The K/V history `seq` holds (contiguous and tree: sequence 0, the committed prefix).
    fn export_seq(&self, seq: i32) -> RResult<SeqRows, PluginError>;
    /// Writes `rows` as the history of the empty sequence `seq` (contiguous and tree: the
    /// empty cache). All or nothing.
    #[sabi(last_prefix_field)]
    fn import_seq(&self, seq: i32, rows: &SeqRows) -> RResult<(), PluginError>;
    /// The attention arithmetics this cache computes with, by
    /// [`Arithmetic`](kvplug_core::Arithmetic) name, the one a new cache uses first; `f32`
    /// is always one of them. Conformance checks each against its declared bound. The
    /// defaults (plugin API 1.1) serve a cache that computes in f32 only.
    fn attention_arithmetics(&self) -> RVec<RString> {
        RVec::from(vec![RString::from(kvplug_core::Arithmetic::F32.as_str())])
    }
    /// The arithmetic later `update_and_attend` calls use.
    fn attention_arithmetic(&self) -> RString {
        kvplug_core::Arithmetic::F32.as_str().into()
    }
    /// Selects one of [`CacheObject::attention_arithmetics`] for later calls; any other name
    /// is refused with `not_supported` and changes nothing.
    fn set_attention_arithmetic(&self, name: RStr<'_>) -> RResult<(), PluginError> {
        if name.as_str() == kvplug_core::Arithmetic::F32.as_str() {
            RResult::ROk(())
        } else {
            RResult::RErr(PluginError::new(
                crate::error::AbiErrorKind::NotSupported,
                format!("this cache computes attention in f32 only, not '{name}'"),
            ))
        }
    }
}

/// A shared cache object.
pub type CacheHandle = CacheObject_TO<'static, RArc<()>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_crosses_the_abi_with_every_layer_kind() {
        let set = |l: &[usize]| LayerSet::of(l.iter().copied()).unwrap();
        let cfg = CacheConfig {
            capacity: 4096,
            n_layers: 6,
            n_kv_heads: 2,
            head_dim: 64,
            min_chunk: 16,
            kv_dtype: KvDtype::Q8 { group: 32 },
            sliding: Some(SlidingLayers {
                window: 128,
                layers: set(&[0]),
            }),
            conv: Some(ConvLayers {
                width: 3,
                channels: 256,
                layers: set(&[1]),
            }),
            delta: Some(DeltaLayers {
                key_heads: 2,
                value_heads: 4,
                head_dim: 32,
                width: 4,
                layers: set(&[2]),
            }),
            ssm: Some(SsmLayers {
                heads: 8,
                head_dim: 16,
                groups: 2,
                state: 32,
                width: 4,
                layers: set(&[3, 4]),
            }),
        };
        let abi = AbiCacheConfig::from(&cfg);
        assert_eq!(CacheConfig::try_from(&abi).unwrap(), cfg);
        // Mamba2 layers without heads (a producer that lost a field) are refused.
        let e = CacheConfig::try_from(&AbiCacheConfig {
            ssm_heads: 0,
            ..abi
        })
        .unwrap_err();
        assert!(
            e.message.contains("Mamba2 layers are listed"),
            "{}",
            e.message
        );
    }
}
