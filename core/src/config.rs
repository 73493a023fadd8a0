//! Cache configuration: architecture facts (from model metadata) plus runtime policy.

use crate::dtype::KvDtype;
use crate::error::{CacheError, CacheResult};
use crate::limits::{
    check_limit, MAX_CAPACITY, MAX_CONV_CHANNELS, MAX_HEAD_DIM, MAX_KV_HEADS, MAX_LAYERS,
};

/// Default first pool allocation, in cells.
pub const DEFAULT_MIN_CHUNK: usize = 256;

/// The architecture facts a cache needs, as stored in a model's `kv_cache.*` metadata.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelCacheParams {
    /// Transformer layers, each with its own K and V pool.
    pub n_layers: usize,
    /// KV heads per layer (GQA: query heads are a multiple of this).
    pub n_kv_heads: usize,
    /// Values per head row.
    pub head_dim: usize,
}

/// Everything needed to build a cache of any kind.
///
/// `capacity` is the logical ceiling in cells; pools start at `min_chunk` cells and double on
/// demand up to it, so a short session never holds `capacity` cells.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CacheConfig {
    /// Hard ceiling in cells (tokens across all sequences).
    pub capacity: usize,
    /// Layers.
    pub n_layers: usize,
    /// KV heads per layer.
    pub n_kv_heads: usize,
    /// Values per head row.
    pub head_dim: usize,
    /// First allocation in cells (clamped to `capacity`).
    #[serde(default = "default_min_chunk")]
    pub min_chunk: usize,
    /// Storage dtype of K and V.
    #[serde(default = "default_kv_dtype")]
    pub kv_dtype: KvDtype,
    /// The layers that attend through a sliding window (`None`: every layer attends fully).
    #[serde(default)]
    pub sliding: Option<SlidingLayers>,
    /// The short-convolution layers of a hybrid model (`None`: none); they hold no K/V and
    /// no rows per cell (their state, the convolution's tail, is kept as anchors).
    #[serde(default)]
    pub conv: Option<ConvLayers>,
    /// The gated delta-rule layers of a hybrid model (`None`: none); they hold no K/V and
    /// no rows per cell (their whole state, the convolution's tail included, is kept as
    /// anchors).
    #[serde(default)]
    pub delta: Option<DeltaLayers>,
    /// The Mamba2 (selective state-space) layers of a hybrid model (`None`: none); they hold
    /// no K/V and no rows per cell (their state and convolution tail are kept as anchors).
    #[serde(default)]
    pub ssm: Option<SsmLayers>,
}

/// A set of layer indices below [`MAX_LAYERS`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
pub struct LayerSet([u64; MAX_LAYERS / 64]);

impl LayerSet {
    /// The set of `layers` (`bad_config` for an index at or above [`MAX_LAYERS`]).
    pub fn of(layers: impl IntoIterator<Item = usize>) -> CacheResult<Self> {
        let mut set = LayerSet::default();
        for l in layers {
            if l >= MAX_LAYERS {
                return Err(CacheError::bad_config(format!(
                    "layer {l} is above the limit of {MAX_LAYERS} layers"
                )));
            }
            set.0[l / 64] |= 1 << (l % 64);
        }
        Ok(set)
    }

    /// Whether `layer` is in the set.
    pub fn contains(&self, layer: usize) -> bool {
        layer < MAX_LAYERS && self.0[layer / 64] & (1 << (layer % 64)) != 0
    }

    /// The members, ascending.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        (0..MAX_LAYERS).filter(|&l| self.contains(l))
    }

    /// Members.
    pub fn len(&self) -> usize {
        self.0.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Debug for LayerSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

/// The sliding-window layers of a hybrid model: which layers slide, and their window.
///
/// Window rule (Hugging Face's `sliding_window` as Gemma 3 and Mistral use it, and
/// llama.cpp's `LLAMA_SWA_TYPE_STANDARD`): a query at position `p` attends keys at positions
/// `q` with `p - window < q <= p`: the window counts the query itself.
///
/// Such layers form one group with its own pools: after each step it keeps, for each
/// sequence, only the rows of its last `window` positions, so it holds at most `window` plus
/// one step's cells per sequence whatever the length of the conversation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct SlidingLayers {
    /// Positions a query sees, itself included (`>= 1`).
    pub window: usize,
    /// The layers that slide (the others attend fully).
    pub layers: LayerSet,
}

/// The short-convolution layers of a hybrid model (LFM2): recurrent layers whose state is
/// the tail of a causal depthwise convolution over their input rows.
///
/// A sequence's state after a position is the layer's input rows of its last `width - 1`
/// positions (`channels` f32 values each). The cache keeps it as it keeps a delta-rule
/// layer's ([`DeltaLayers`]): in **anchors**, the state of every recurrent layer after the
/// token of a cell, so every verb that ends a sequence where an anchor is kept is exact and
/// the others are refused (see `docs/architecture.md`, "Recurrent state").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct ConvLayers {
    /// Taps of the convolution, the current position's included (`>= 2`; LFM2's
    /// `conv_L_cache`).
    pub width: usize,
    /// Channels (values per row).
    pub channels: usize,
    /// The convolution layers.
    pub layers: LayerSet,
}

impl ConvLayers {
    /// f32 values of one layer's convolution tail (its last `width - 1` input rows): what a
    /// saved sequence carries of the layer.
    pub fn tail_len(&self) -> usize {
        (self.width - 1) * self.channels
    }
}

/// The gated delta-rule (linear attention) layers of a hybrid model (Qwen3.5, Qwen3-Next):
/// per sequence, a `head_dim × head_dim` f32 state per value head, decayed and moved toward
/// each token's value along its key.
///
/// The state cannot be kept per token (a layer's state is as large as thousands of K/V
/// rows), so the cache keeps **anchors**: the state after the token of a cell (the rule's
/// matrices and the last `width - 1` input rows of the convolution in front of it), for
/// the cell that ends each committed step of each sequence, for every node of a tree step,
/// and at published prefix ends. A step resumes each sequence from the anchor of its previous
/// position; a verb that would leave a sequence ending where no anchor is kept is refused
/// (see `docs/architecture.md`, "Recurrent state").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct DeltaLayers {
    /// Key heads (q and k); each serves `value_heads / key_heads` value heads, value head
    /// `h` reading key head `h % key_heads` (llama.cpp's layout of Qwen3.5 files).
    pub key_heads: usize,
    /// Value heads, each with its own state.
    pub value_heads: usize,
    /// Size of a key and of a value head (the state is `head_dim × head_dim`).
    pub head_dim: usize,
    /// Taps of the causal depthwise convolution over q, k and v in front of the rule.
    pub width: usize,
    /// The delta-rule layers.
    pub layers: LayerSet,
}

impl DeltaLayers {
    /// f32 values of one layer's rule state of one sequence.
    pub fn state_len(&self) -> usize {
        self.value_heads * self.head_dim * self.head_dim
    }

    /// f32 values of one layer's convolution tail (its last `width - 1` input rows).
    pub fn tail_len(&self) -> usize {
        (self.width - 1) * self.conv_channels()
    }

    /// Channels of the convolution in front of the rule: q and k (`key_heads` heads each),
    /// then v, in that order.
    pub fn conv_channels(&self) -> usize {
        (2 * self.key_heads + self.value_heads) * self.head_dim
    }
}

/// The Mamba2 layers of a hybrid model (Granite 4.0-H, Falcon-H1, Nemotron-H): per sequence,
/// a `head_dim × state` f32 state per head, decayed by a per-head scalar and moved by each
/// token's `x ⊗ B`, behind a short convolution over x, B and C. Kept as anchors, as a
/// delta-rule layer's state is ([`DeltaLayers`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct SsmLayers {
    /// Heads, each with its own state and decay (llama.cpp's `ssm.time_step_rank`).
    pub heads: usize,
    /// Values of x per head (`d_inner / heads`).
    pub head_dim: usize,
    /// Groups of heads sharing one B and one C (`heads % groups == 0`; head `h` reads group
    /// `h / (heads / groups)`).
    pub groups: usize,
    /// Size of B and C (the state's second dimension).
    pub state: usize,
    /// Taps of the causal depthwise convolution over x, B and C in front of the scan.
    pub width: usize,
    /// The Mamba2 layers.
    pub layers: LayerSet,
}

impl SsmLayers {
    /// f32 values of one layer's scan state of one sequence (`[heads][head_dim][state]`).
    pub fn state_len(&self) -> usize {
        self.heads * self.head_dim * self.state
    }

    /// f32 values of one layer's convolution tail (its last `width - 1` input rows).
    pub fn tail_len(&self) -> usize {
        (self.width - 1) * self.conv_channels()
    }

    /// Channels of the convolution: x (`heads · head_dim`), then B and C (`groups · state`
    /// each), in that order.
    pub fn conv_channels(&self) -> usize {
        self.heads * self.head_dim + 2 * self.groups * self.state
    }
}

/// Anchors a recurrent cache keeps beyond those a sequence needs to continue (the newest;
/// older step ends a `rewind` or `seq_rm` may return to).
pub const SPARE_ANCHORS: usize = 8;

/// Published prefix ends whose anchors a recurrent cache keeps (the newest), as a sliding
/// group pins its windows.
pub const PINNED_ANCHORS: usize = 4;

/// Prompt ends whose anchors a recurrent cache keeps (the newest): the end of a sequence's
/// run of two or more tokens in a step whose last token's output is read and the one
/// before it not (the last chunk of a prompt). A chat whose template renders the last answer differently the next
/// turn (reasoning dropped, text trimmed) returns there instead of to the start, as
/// llama.cpp's server keeps context checkpoints near the end of each prompt.
pub const PROMPT_END_ANCHORS: usize = 4;

/// Anchors a recurrent cache holds beside those its sequences need before a commit drops the
/// surplus spares: twice [`SPARE_ANCHORS`], [`PINNED_ANCHORS`] and [`PROMPT_END_ANCHORS`].
/// A step adds one per stepping sequence (its new end) before its commit checks; speculative
/// steps' [`CHAIN_ANCHORS`] come on top.
pub const SURPLUS_ANCHORS: usize = 2 * SPARE_ANCHORS + PINNED_ANCHORS + PROMPT_END_ANCHORS;

/// The most tokens of one step's runs whose outputs are all read (speculative chains: any
/// token may end the accepted part) that a recurrent cache anchors each, the earliest of
/// each run first, so that cutting a refused tail there is exact; a cut elsewhere inside
/// such a run is refused as a rewind into a prefill is. Kept until the next step commits.
/// Bounds what a step of many chains or a run reading every output (a prompt's logprobs)
/// holds: a Qwen3.5-0.8B anchor is 19.3 MiB.
pub const CHAIN_ANCHORS: usize = 16;

/// The widest convolution kernel a config may declare.
pub const MAX_CONV_WIDTH: usize = 64;

fn default_min_chunk() -> usize {
    DEFAULT_MIN_CHUNK
}

fn default_kv_dtype() -> KvDtype {
    KvDtype::F16
}

/// Combines a model's architecture facts with runtime policy (capacity, storage dtype).
/// `min_chunk` takes its default; validate with [`CacheConfig::validate`].
pub fn make_config(params: &ModelCacheParams, capacity: usize, kv_dtype: KvDtype) -> CacheConfig {
    CacheConfig {
        capacity,
        n_layers: params.n_layers,
        n_kv_heads: params.n_kv_heads,
        head_dim: params.head_dim,
        min_chunk: DEFAULT_MIN_CHUNK,
        kv_dtype,
        sliding: None,
        conv: None,
        delta: None,
        ssm: None,
    }
}

impl CacheConfig {
    /// Rejects zero sizes, sizes above the [`crate::limits`], and a quantization group that
    /// does not divide `head_dim`. Allocates nothing.
    pub fn validate(&self) -> CacheResult<()> {
        for (name, v) in [
            ("capacity", self.capacity),
            ("n_layers", self.n_layers),
            ("n_kv_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("min_chunk", self.min_chunk),
        ] {
            if v == 0 {
                return Err(CacheError::bad_config(format!("{name} must be > 0")));
            }
        }
        check_limit("capacity", self.capacity, MAX_CAPACITY)?;
        check_limit("n_layers", self.n_layers, MAX_LAYERS)?;
        check_limit("n_kv_heads", self.n_kv_heads, MAX_KV_HEADS)?;
        check_limit("head_dim", self.head_dim, MAX_HEAD_DIM)?;
        if let Some(s) = &self.sliding {
            if s.window == 0 {
                return Err(CacheError::bad_config("a sliding window must be >= 1"));
            }
            if let Some(l) = s.layers.iter().find(|&l| l >= self.n_layers) {
                return Err(CacheError::bad_config(format!(
                    "sliding layer {l} is outside 0..{}",
                    self.n_layers
                )));
            }
        }
        if let Some(c) = &self.conv {
            if !(2..=MAX_CONV_WIDTH).contains(&c.width) {
                return Err(CacheError::bad_config(format!(
                    "a convolution width of {} is outside 2..={MAX_CONV_WIDTH}",
                    c.width
                )));
            }
            if c.channels == 0 || c.layers.is_empty() {
                return Err(CacheError::bad_config(
                    "convolution layers need at least one layer and one channel",
                ));
            }
            check_limit("conv channels", c.channels, MAX_CONV_CHANNELS)?;
            if let Some(l) = c.layers.iter().find(|&l| l >= self.n_layers) {
                return Err(CacheError::bad_config(format!(
                    "convolution layer {l} is outside 0..{}",
                    self.n_layers
                )));
            }
            if let Some(l) = c.layers.iter().find(|&l| self.slides(l)) {
                return Err(CacheError::bad_config(format!(
                    "layer {l} cannot both slide and convolve"
                )));
            }
        }
        if let Some(d) = &self.delta {
            self.validate_delta(d)?;
        }
        if let Some(m) = &self.ssm {
            self.validate_ssm(m)?;
        }
        self.kv_dtype.check_head_dim(self.head_dim)
    }

    fn validate_delta(&self, d: &DeltaLayers) -> CacheResult<()> {
        if d.key_heads == 0 || d.value_heads == 0 || d.head_dim == 0 || d.layers.is_empty() {
            return Err(CacheError::bad_config(
                "delta-rule layers need at least one layer, one key head, one value head and a \
                 head size",
            ));
        }
        if d.value_heads % d.key_heads != 0 {
            return Err(CacheError::bad_config(format!(
                "{} value heads do not share {} key heads evenly",
                d.value_heads, d.key_heads
            )));
        }
        check_limit("delta heads", d.value_heads, MAX_KV_HEADS)?;
        check_limit("delta head size", d.head_dim, MAX_HEAD_DIM)?;
        if !(2..=MAX_CONV_WIDTH).contains(&d.width) {
            return Err(CacheError::bad_config(format!(
                "a delta-rule convolution width of {} is outside 2..={MAX_CONV_WIDTH}",
                d.width
            )));
        }
        if let Some(l) = d.layers.iter().find(|&l| l >= self.n_layers) {
            return Err(CacheError::bad_config(format!(
                "delta-rule layer {l} is outside 0..{}",
                self.n_layers
            )));
        }
        if let Some(l) = d
            .layers
            .iter()
            .find(|&l| self.slides(l) || self.convolves(l))
        {
            return Err(CacheError::bad_config(format!(
                "layer {l} cannot both run the delta rule and slide or convolve"
            )));
        }
        Ok(())
    }

    fn validate_ssm(&self, m: &SsmLayers) -> CacheResult<()> {
        if [m.heads, m.head_dim, m.groups, m.state].contains(&0) || m.layers.is_empty() {
            return Err(CacheError::bad_config(
                "Mamba2 layers need at least one layer, head, group, head value and state value",
            ));
        }
        if m.heads % m.groups != 0 {
            return Err(CacheError::bad_config(format!(
                "{} Mamba2 heads do not share {} groups evenly",
                m.heads, m.groups
            )));
        }
        check_limit("Mamba2 head size", m.head_dim, MAX_HEAD_DIM)?;
        check_limit("Mamba2 state size", m.state, MAX_HEAD_DIM)?;
        check_limit("Mamba2 channels", m.conv_channels(), MAX_CONV_CHANNELS)?;
        if !(2..=MAX_CONV_WIDTH).contains(&m.width) {
            return Err(CacheError::bad_config(format!(
                "a Mamba2 convolution width of {} is outside 2..={MAX_CONV_WIDTH}",
                m.width
            )));
        }
        if let Some(l) = m.layers.iter().find(|&l| l >= self.n_layers) {
            return Err(CacheError::bad_config(format!(
                "Mamba2 layer {l} is outside 0..{}",
                self.n_layers
            )));
        }
        if let Some(l) = m
            .layers
            .iter()
            .find(|&l| self.slides(l) || self.convolves(l) || self.is_delta(l))
        {
            return Err(CacheError::bad_config(format!(
                "layer {l} cannot both run a Mamba2 scan and slide, convolve or run the delta rule"
            )));
        }
        Ok(())
    }

    /// Whether `layer` is a recurrent layer (short convolution, delta rule or Mamba2): it
    /// holds no K/V, its state is kept as anchors.
    pub fn is_recurrent(&self, layer: usize) -> bool {
        self.convolves(layer)
            || self.is_delta(layer)
            || self.ssm.is_some_and(|m| m.layers.contains(layer))
    }

    /// Whether `layer` is a gated delta-rule layer.
    pub fn is_delta(&self, layer: usize) -> bool {
        self.delta.is_some_and(|d| d.layers.contains(layer))
    }

    /// Bytes of one anchor: the state of every recurrent (delta-rule, Mamba2 and convolution) layer
    /// after one token (0 without such layers).
    pub fn anchor_bytes(&self) -> u64 {
        let delta = self
            .delta
            .map_or(0, |d| d.layers.len() * (d.state_len() + d.tail_len()));
        let conv = self.conv.map_or(0, |c| c.layers.len() * c.tail_len());
        let ssm = self
            .ssm
            .map_or(0, |m| m.layers.len() * (m.state_len() + m.tail_len()));
        4 * (delta + conv + ssm) as u64
    }

    /// Whether `layer` is a short-convolution layer.
    pub fn convolves(&self, layer: usize) -> bool {
        self.conv.is_some_and(|c| c.layers.contains(layer))
    }

    /// Whether `layer` attends through the sliding window.
    pub fn slides(&self, layer: usize) -> bool {
        self.sliding.is_some_and(|s| s.layers.contains(layer))
    }

    /// Layers that attend fully.
    pub fn full_layers(&self) -> usize {
        self.n_layers
            - self.sliding.map_or(0, |s| s.layers.len())
            - self.conv.map_or(0, |c| c.layers.len())
            - self.delta.map_or(0, |d| d.layers.len())
            - self.ssm.map_or(0, |m| m.layers.len())
    }

    /// Bytes of the pools indexed by cells (K and V of the fully attending layers) holding
    /// `cells` cells each; `None` on overflow.
    pub fn pools_bytes(&self, cells: usize) -> Option<u64> {
        self.layer_pools_bytes(self.full_layers(), cells)
    }

    /// Bytes of the K and V pools of `layers` layers holding `cells` cells each.
    pub fn layer_pools_bytes(&self, layers: usize, cells: usize) -> Option<u64> {
        (2 * layers as u64)
            .checked_mul(cells as u64)?
            .checked_mul(self.n_kv_heads as u64)?
            .checked_mul(self.kv_dtype.row_bytes(self.head_dim) as u64)
    }

    /// The first pool size in cells: `min_chunk` clamped to `capacity`.
    pub fn first_chunk(&self) -> usize {
        self.min_chunk.min(self.capacity)
    }

    /// Pool size in cells needed to hold `cells` under lazy doubling from
    /// [`CacheConfig::first_chunk`], never above `capacity`.
    pub fn grown_cells(&self, current: usize, needed: usize) -> usize {
        let mut n = current.max(self.first_chunk());
        while n < needed {
            n = n.saturating_mul(2);
        }
        n.min(self.capacity)
    }

    /// The architecture part of this config.
    pub fn params(&self) -> ModelCacheParams {
        ModelCacheParams {
            n_layers: self.n_layers,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// Bytes of one layer's K (or V) pool holding `cells` cells.
    pub fn pool_bytes(&self, cells: usize) -> usize {
        cells * self.n_kv_heads * self.kv_dtype.row_bytes(self.head_dim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> CacheConfig {
        make_config(
            &ModelCacheParams {
                n_layers: 2,
                n_kv_heads: 2,
                head_dim: 64,
            },
            1000,
            KvDtype::F16,
        )
    }

    #[test]
    fn growth_doubles_from_min_chunk_and_stops_at_capacity() {
        let c = cfg();
        assert_eq!(c.grown_cells(0, 1), 256);
        assert_eq!(c.grown_cells(256, 256), 256);
        assert_eq!(c.grown_cells(256, 257), 512);
        assert_eq!(c.grown_cells(256, 900), 1000);
        let small = CacheConfig { capacity: 100, ..c };
        assert_eq!(small.first_chunk(), 100);
    }

    #[test]
    fn validate_rejects_bad_configs() {
        assert!(cfg().validate().is_ok());
        for bad in [
            CacheConfig {
                capacity: 0,
                ..cfg()
            },
            CacheConfig {
                n_layers: 0,
                ..cfg()
            },
            CacheConfig {
                head_dim: 0,
                ..cfg()
            },
            CacheConfig {
                head_dim: 48,
                kv_dtype: KvDtype::Q8_DEFAULT,
                ..cfg()
            },
            CacheConfig {
                capacity: (1 << 31) - 1,
                ..cfg()
            },
            CacheConfig {
                n_layers: 1_000_000,
                ..cfg()
            },
            CacheConfig {
                n_kv_heads: 1_000_000,
                ..cfg()
            },
            CacheConfig {
                head_dim: 1 << 30,
                ..cfg()
            },
        ] {
            assert_eq!(
                bad.validate().unwrap_err().kind,
                crate::ErrorKind::BadConfig
            );
        }
    }

    #[test]
    fn serde_defaults_and_dtype_strings() {
        let c: CacheConfig = serde_json::from_str(
            r#"{"capacity":8,"n_layers":1,"n_kv_heads":1,"head_dim":64,"kv_dtype":"q8"}"#,
        )
        .unwrap();
        assert_eq!(c.min_chunk, DEFAULT_MIN_CHUNK);
        assert_eq!(c.kv_dtype, KvDtype::Q8_DEFAULT);
        let err = serde_json::from_str::<CacheConfig>(
            r#"{"capacity":8,"n_layers":1,"n_kv_heads":1,"head_dim":64,"kv_dtype":"int8"}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("unknown KV dtype 'int8'"), "{err}");
    }
}
