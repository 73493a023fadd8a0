//! [`ModelCacheSpec`]: what a model's cache holds per layer, read from `config.json`.
//!
//! Each layer attends fully or through a sliding window. Conventions read, in order (those of
//! Hugging Face `transformers`):
//!
//! 1. an explicit `layer_types` list (`full_attention` / `sliding_attention`, window
//!    `sliding_window`; LFM2's `conv`, a short-convolution layer of `conv_L_cache` taps over
//!    `hidden_size` channels; Qwen3.5's `linear_attention`, a gated delta-rule layer of
//!    `linear_num_key_heads` / `linear_num_value_heads` heads of `linear_key_head_dim`
//!    behind a `linear_conv_kernel_dim`-tap convolution; Granite 4.0-H's `mamba`, a Mamba2
//!    layer of `mamba_n_heads` heads of `mamba_d_head` values, `mamba_n_groups` groups of
//!    `mamba_d_state`-wide B and C, behind a `mamba_d_conv`-tap convolution; its `attention`
//!    attends fully);
//! 2. Gemma 3's `sliding_window_pattern` `N`: layer `i` is full iff `(i + 1) % N == 0`;
//! 3. Qwen2's `use_sliding_window` with `max_window_layers` `M`: layers `i >= M` slide
//!    (absent in a `qwen*` config, it is false: Qwen2 ships a window it does not use);
//! 4. otherwise a non-null `sliding_window` makes every layer slide (Mistral);
//! 5. otherwise every layer is full (Llama).
//!
//! [`ModelCacheSpec::sliding`] and [`ModelCacheSpec::conv`] turn the spec into the
//! [`SlidingLayers`] and [`ConvLayers`] of a [`crate::CacheConfig`]: a hybrid cache (see
//! [`crate::window`]).

use serde_json::Value;

use crate::config::{ConvLayers, DeltaLayers, LayerSet, SlidingLayers, SsmLayers, MAX_CONV_WIDTH};
use crate::dtype::KvDtype;
use crate::error::{CacheError, CacheResult};
use crate::limits::MAX_CONV_CHANNELS;

/// How one layer attends, or what state it keeps instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerAttention {
    /// Every earlier position.
    Full,
    /// The last `window` positions.
    Sliding {
        /// Positions seen, the query's own included.
        window: usize,
    },
    /// No attention: a recurrent short convolution (LFM2), whose state is its input rows of
    /// the last `width - 1` positions per sequence (see [`ConvLayers`]).
    Conv {
        /// Taps, the current position's included.
        width: usize,
        /// Channels per row.
        channels: usize,
    },
    /// No attention: a gated delta rule (Qwen3.5) behind a short convolution over its q, k
    /// and v; its state is a `head_dim × head_dim` matrix per value head and sequence and
    /// the convolution's last `width - 1` input rows (see [`DeltaLayers`]).
    Delta {
        /// Taps of the convolution.
        width: usize,
        /// Key heads.
        key_heads: usize,
        /// Value heads.
        value_heads: usize,
        /// Key and value head size.
        head_dim: usize,
    },
    /// No attention: a Mamba2 selective scan (Granite 4.0-H) behind a short convolution over
    /// its x, B and C; its state is a `head_dim × state` matrix per head and sequence and the
    /// convolution's last `width - 1` input rows (see [`SsmLayers`]).
    Ssm {
        /// Taps of the convolution.
        width: usize,
        /// Heads.
        heads: usize,
        /// Values of x per head.
        head_dim: usize,
        /// Groups of heads sharing B and C.
        groups: usize,
        /// Size of B and C.
        state: usize,
    },
}

/// A model's per-layer cache shape.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ModelCacheSpec {
    /// KV heads per layer.
    pub n_kv_heads: usize,
    /// Values per head row.
    pub head_dim: usize,
    /// Attention of each layer.
    pub layers: Vec<LayerAttention>,
}

/// Layers sharing one attention type.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LayerGroup {
    /// The attention type.
    pub attention: LayerAttention,
    /// Layer indices.
    pub layers: Vec<usize>,
}

impl ModelCacheSpec {
    /// Reads the spec from a parsed `config.json` (see the module docs), given the cache
    /// shape its metadata states.
    pub fn from_config(
        config: &Value,
        n_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> CacheResult<Self> {
        let bad = |m: String| CacheError::bad_config(format!("config.json: {m}"));
        let window = || -> CacheResult<usize> {
            config["sliding_window"]
                .as_u64()
                .filter(|&w| w > 0)
                .map(|w| w as usize)
                .ok_or_else(|| bad("sliding layers need a positive integer sliding_window".into()))
        };
        let conv = || -> CacheResult<LayerAttention> {
            let width = config["conv_L_cache"]
                .as_u64()
                .filter(|w| (2..=MAX_CONV_WIDTH as u64).contains(w))
                .ok_or_else(|| {
                    bad(format!(
                        "conv layers need an integer conv_L_cache in 2..={MAX_CONV_WIDTH}"
                    ))
                })? as usize;
            let channels = config["hidden_size"]
                .as_u64()
                .filter(|&h| h > 0)
                .ok_or_else(|| bad("conv layers need a positive hidden_size".into()))?
                as usize;
            Ok(LayerAttention::Conv { width, channels })
        };
        let delta = || -> CacheResult<LayerAttention> {
            let get = |key: &str| {
                config[key]
                    .as_u64()
                    .filter(|&n| n > 0)
                    .map(|n| n as usize)
                    .ok_or_else(|| bad(format!("linear_attention layers need a positive {key}")))
            };
            let (head_dim, value_dim) =
                (get("linear_key_head_dim")?, get("linear_value_head_dim")?);
            if head_dim != value_dim {
                return Err(bad(format!(
                    "linear_key_head_dim {head_dim} differs from linear_value_head_dim {value_dim}"
                )));
            }
            let width = get("linear_conv_kernel_dim")?;
            if !(2..=MAX_CONV_WIDTH).contains(&width) {
                return Err(bad(format!(
                    "linear_conv_kernel_dim {width} is outside 2..={MAX_CONV_WIDTH}"
                )));
            }
            Ok(LayerAttention::Delta {
                width,
                key_heads: get("linear_num_key_heads")?,
                value_heads: get("linear_num_value_heads")?,
                head_dim,
            })
        };
        let ssm = || -> CacheResult<LayerAttention> {
            // Bounded here: the spec's byte counts multiply them before any validation.
            let get = |key: &str| {
                config[key]
                    .as_u64()
                    .filter(|&n| n > 0 && n <= MAX_CONV_CHANNELS as u64)
                    .map(|n| n as usize)
                    .ok_or_else(|| {
                        bad(format!(
                            "mamba layers need a {key} in 1..={MAX_CONV_CHANNELS}"
                        ))
                    })
            };
            let width = get("mamba_d_conv")?;
            if !(2..=MAX_CONV_WIDTH).contains(&width) {
                return Err(bad(format!(
                    "mamba_d_conv {width} is outside 2..={MAX_CONV_WIDTH}"
                )));
            }
            Ok(LayerAttention::Ssm {
                width,
                heads: get("mamba_n_heads")?,
                head_dim: get("mamba_d_head")?,
                groups: get("mamba_n_groups")?,
                state: get("mamba_d_state")?,
            })
        };
        let layers = if let Some(types) = config["layer_types"].as_array() {
            if types.len() != n_layers {
                return Err(bad(format!(
                    "{} layer_types for {n_layers} layers",
                    types.len()
                )));
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    Some("full_attention" | "attention") => Ok(LayerAttention::Full),
                    Some("sliding_attention") => Ok(LayerAttention::Sliding { window: window()? }),
                    Some("conv") => conv(),
                    Some("linear_attention") => delta(),
                    Some("mamba") => ssm(),
                    other => Err(bad(format!("unknown layer type {other:?}"))),
                })
                .collect::<CacheResult<_>>()?
        } else if let Some(n) = config["sliding_window_pattern"].as_u64() {
            if n == 0 {
                return Err(bad("sliding_window_pattern is 0".into()));
            }
            let w = window()?;
            (0..n_layers)
                .map(|i| {
                    if (i as u64 + 1) % n == 0 {
                        LayerAttention::Full
                    } else {
                        LayerAttention::Sliding { window: w }
                    }
                })
                .collect()
        } else if let Some(on) = config["use_sliding_window"].as_bool().or_else(|| {
            let qwen = config["model_type"]
                .as_str()
                .is_some_and(|t| t.starts_with("qwen"));
            qwen.then_some(false)
        }) {
            let from = config["max_window_layers"].as_u64().unwrap_or(0) as usize;
            let w = if on { Some(window()?) } else { None };
            (0..n_layers)
                .map(|i| match w {
                    Some(window) if i >= from => LayerAttention::Sliding { window },
                    _ => LayerAttention::Full,
                })
                .collect()
        } else if !config["sliding_window"].is_null() && config.get("sliding_window").is_some() {
            vec![LayerAttention::Sliding { window: window()? }; n_layers]
        } else {
            vec![LayerAttention::Full; n_layers]
        };
        Ok(ModelCacheSpec {
            n_kv_heads,
            head_dim,
            layers,
        })
    }

    /// Layers grouped by attention type (full first, then windows ascending).
    pub fn groups(&self) -> Vec<LayerGroup> {
        let mut kinds: Vec<LayerAttention> = self.layers.clone();
        kinds.sort();
        kinds.dedup();
        kinds
            .into_iter()
            .map(|attention| LayerGroup {
                attention,
                layers: (0..self.layers.len())
                    .filter(|&i| self.layers[i] == attention)
                    .collect(),
            })
            .collect()
    }

    /// The sliding layers of a cache config (`None` when every layer attends fully);
    /// `bad_config` when sliding layers use more than one window (one sliding group per cache).
    pub fn sliding(&self) -> CacheResult<Option<SlidingLayers>> {
        let mut window = None;
        for l in &self.layers {
            if let LayerAttention::Sliding { window: w } = *l {
                if window.is_some_and(|x| x != w) {
                    return Err(CacheError::bad_config(
                        "sliding layers with different windows are not supported",
                    ));
                }
                window = Some(w);
            }
        }
        let Some(window) = window else {
            return Ok(None);
        };
        let layers = LayerSet::of(
            (0..self.layers.len())
                .filter(|&i| matches!(self.layers[i], LayerAttention::Sliding { .. })),
        )?;
        Ok(Some(SlidingLayers { window, layers }))
    }

    /// The convolution layers of a cache config (`None` without any); `bad_config` when
    /// they differ in width or channels (one convolution group per cache).
    pub fn conv(&self) -> CacheResult<Option<ConvLayers>> {
        let mut shape = None;
        for l in &self.layers {
            if let LayerAttention::Conv { width, channels } = *l {
                if shape.is_some_and(|s| s != (width, channels)) {
                    return Err(CacheError::bad_config(
                        "convolution layers of different widths or channels are not supported",
                    ));
                }
                shape = Some((width, channels));
            }
        }
        let Some((width, channels)) = shape else {
            return Ok(None);
        };
        let layers = LayerSet::of(
            (0..self.layers.len())
                .filter(|&i| matches!(self.layers[i], LayerAttention::Conv { .. })),
        )?;
        Ok(Some(ConvLayers {
            width,
            channels,
            layers,
        }))
    }

    /// The gated delta-rule layers of a cache config (`None` without any); `bad_config`
    /// when they differ in shape.
    pub fn delta(&self) -> CacheResult<Option<DeltaLayers>> {
        let mut shape = None;
        for l in &self.layers {
            if let LayerAttention::Delta {
                width,
                key_heads,
                value_heads,
                head_dim,
            } = *l
            {
                let this = (key_heads, value_heads, head_dim, width);
                if shape.is_some_and(|s| s != this) {
                    return Err(CacheError::bad_config(
                        "delta-rule layers of different shapes are not supported",
                    ));
                }
                shape = Some(this);
            }
        }
        let Some((key_heads, value_heads, head_dim, width)) = shape else {
            return Ok(None);
        };
        let layers = LayerSet::of(
            (0..self.layers.len())
                .filter(|&i| matches!(self.layers[i], LayerAttention::Delta { .. })),
        )?;
        Ok(Some(DeltaLayers {
            key_heads,
            value_heads,
            head_dim,
            width,
            layers,
        }))
    }

    /// The Mamba2 layers of a cache config (`None` without any); `bad_config` when they
    /// differ in shape.
    pub fn ssm(&self) -> CacheResult<Option<SsmLayers>> {
        let mut shape = None;
        for l in &self.layers {
            if let LayerAttention::Ssm {
                width,
                heads,
                head_dim,
                groups,
                state,
            } = *l
            {
                let this = (width, heads, head_dim, groups, state);
                if shape.is_some_and(|s| s != this) {
                    return Err(CacheError::bad_config(
                        "Mamba2 layers of different shapes are not supported",
                    ));
                }
                shape = Some(this);
            }
        }
        let Some((width, heads, head_dim, groups, state)) = shape else {
            return Ok(None);
        };
        let layers = LayerSet::of(
            (0..self.layers.len())
                .filter(|&i| matches!(self.layers[i], LayerAttention::Ssm { .. })),
        )?;
        Ok(Some(SsmLayers {
            heads,
            head_dim,
            groups,
            state,
            width,
            layers,
        }))
    }

    /// K and V bytes one token takes in one layer.
    pub fn layer_bytes_per_token(&self, dtype: KvDtype) -> usize {
        2 * self.n_kv_heads * dtype.row_bytes(self.head_dim)
    }

    /// Cache bytes one token takes in a layer of kind `layer`: its K and V rows, nothing in
    /// a recurrent (convolution or delta-rule) layer (its state is per sequence,
    /// [`ModelCacheSpec::state_bytes`]).
    pub fn bytes_per_token(&self, layer: LayerAttention, dtype: KvDtype) -> usize {
        match layer {
            LayerAttention::Full | LayerAttention::Sliding { .. } => {
                self.layer_bytes_per_token(dtype)
            }
            LayerAttention::Conv { .. }
            | LayerAttention::Delta { .. }
            | LayerAttention::Ssm { .. } => 0,
        }
    }

    /// Bytes of one anchor of a sequence's recurrent state (every delta-rule layer's f32
    /// `head_dim × head_dim` matrices and convolution tail, every Mamba2 layer's
    /// `head_dim × state` matrices and convolution tail, every convolution layer's tail):
    /// what each kept anchor costs.
    pub fn state_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match *l {
                LayerAttention::Delta {
                    width,
                    key_heads,
                    value_heads,
                    head_dim,
                } => {
                    4 * (value_heads * head_dim * head_dim
                        + (width - 1) * (2 * key_heads + value_heads) * head_dim)
                }
                LayerAttention::Conv { width, channels } => 4 * (width - 1) * channels,
                LayerAttention::Ssm {
                    width,
                    heads,
                    head_dim,
                    groups,
                    state,
                } => {
                    let m = SsmLayers {
                        heads,
                        head_dim,
                        groups,
                        state,
                        width,
                        layers: LayerSet::default(),
                    };
                    4 * (m.state_len() + m.tail_len())
                }
                _ => 0,
            })
            .sum()
    }

    /// Cache bytes of the anchors a recurrent cache may hold beside its sequences' own
    /// ([`sequence_bytes`](Self::sequence_bytes)), once per cache: [`SURPLUS_ANCHORS`]
    /// (speculative steps hold up to twice [`CHAIN_ANCHORS`] more: the last step's, kept
    /// through its cut, and the open one's).
    ///
    /// [`SURPLUS_ANCHORS`]: crate::config::SURPLUS_ANCHORS
    /// [`CHAIN_ANCHORS`]: crate::config::CHAIN_ANCHORS
    pub fn surplus_bytes(&self) -> u128 {
        crate::config::SURPLUS_ANCHORS as u128 * self.state_bytes() as u128
    }

    /// Cache bytes of one sequence of `tokens` tokens when each sliding layer keeps at most
    /// `window + ubatch` of them (the window plus one micro-batch in flight), with the
    /// anchor of its end and the one a step opens for its new end (recurrent layers).
    pub fn sequence_bytes(&self, dtype: KvDtype, tokens: usize, ubatch: usize) -> u128 {
        self.layers
            .iter()
            .map(|&l| {
                let held = match l {
                    LayerAttention::Sliding { window } => tokens.min(window + ubatch),
                    LayerAttention::Full
                    | LayerAttention::Conv { .. }
                    | LayerAttention::Delta { .. }
                    | LayerAttention::Ssm { .. } => tokens,
                };
                held as u128 * self.bytes_per_token(l, dtype) as u128
            })
            .sum::<u128>()
            + 2 * self.state_bytes() as u128
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn kinds(c: Value, n: usize) -> Vec<LayerAttention> {
        ModelCacheSpec::from_config(&c, n, 1, 64).unwrap().layers
    }

    #[test]
    fn reads_each_convention() {
        use LayerAttention::{Full, Sliding};
        let s = Sliding { window: 4 };
        assert_eq!(kinds(json!({"model_type": "llama"}), 2), [Full, Full]);
        assert_eq!(
            kinds(json!({"sliding_window": 4, "sliding_window_pattern": 3}), 6),
            [s, s, Full, s, s, Full]
        );
        assert_eq!(
            kinds(
                json!({"sliding_window": 4, "use_sliding_window": true, "max_window_layers": 1}),
                3
            ),
            [Full, s, s]
        );
        assert_eq!(
            kinds(json!({"sliding_window": 4, "use_sliding_window": false}), 2),
            [Full, Full]
        );
        assert_eq!(kinds(json!({"sliding_window": 4}), 2), [s, s]);
        assert_eq!(kinds(json!({"sliding_window": null}), 1), [Full]);
        assert_eq!(
            kinds(
                json!({"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}),
                2
            ),
            [s, Full]
        );
        let e = ModelCacheSpec::from_config(&json!({"layer_types": ["full_attention"]}), 2, 1, 64);
        assert!(e
            .unwrap_err()
            .message
            .contains("1 layer_types for 2 layers"));
        let e = ModelCacheSpec::from_config(&json!({"sliding_window_pattern": 2}), 2, 1, 64);
        assert!(e
            .unwrap_err()
            .message
            .contains("positive integer sliding_window"));
    }

    #[test]
    fn sliding_layers_cap_a_sequence() {
        // Gemma 3 270M's shape: 18 layers, 1 KV head, head_dim 256, window 512, 5:1.
        let c = json!({"sliding_window": 512, "sliding_window_pattern": 6});
        let spec = ModelCacheSpec::from_config(&c, 18, 1, 256).unwrap();
        let groups = spec.groups();
        assert_eq!((groups[0].layers.len(), groups[1].layers.len()), (3, 15));
        let per = spec.layer_bytes_per_token(KvDtype::F16) as u128;
        assert_eq!(per, 1024);
        assert_eq!(
            spec.sequence_bytes(KvDtype::F16, 8192, 0),
            (3 * 8192 + 15 * 512) * per
        );
        assert_eq!(spec.sequence_bytes(KvDtype::F16, 100, 512), 18 * 100 * per);
        let sliding = spec.sliding().unwrap().unwrap();
        assert_eq!(sliding.window, 512);
        let full: Vec<usize> = (0..18).filter(|&l| !sliding.layers.contains(l)).collect();
        assert_eq!(full, [5, 11, 17]);
        let llama = ModelCacheSpec::from_config(&json!({}), 2, 1, 64).unwrap();
        assert_eq!(llama.sliding().unwrap(), None);
        assert_eq!(llama.conv().unwrap(), None);
    }

    #[test]
    fn mamba_layers_hold_a_state_and_tail_per_sequence_and_no_kv() {
        // Granite 4.0-H-350M's pattern: attention at 10 and 13 of 16 here.
        let types: Vec<&str> = (0..16)
            .map(|i| {
                if i == 10 || i == 13 {
                    "attention"
                } else {
                    "mamba"
                }
            })
            .collect();
        let c = json!({"layer_types": types, "mamba_d_conv": 4, "mamba_n_heads": 48,
            "mamba_d_head": 32, "mamba_n_groups": 1, "mamba_d_state": 128});
        let spec = ModelCacheSpec::from_config(&c, 16, 4, 64).unwrap();
        let m = spec.ssm().unwrap().unwrap();
        assert_eq!(
            (m.heads, m.head_dim, m.groups, m.state, m.width),
            (48, 32, 1, 128, 4)
        );
        assert_eq!(m.layers.len(), 14);
        assert_eq!(m.conv_channels(), 48 * 32 + 2 * 128);
        let per_layer = 4 * (48 * 32 * 128 + 3 * (48 * 32 + 256));
        assert_eq!(spec.state_bytes(), 14 * per_layer);
        let per_attn = spec.layer_bytes_per_token(KvDtype::F16) as u128;
        assert_eq!(
            spec.sequence_bytes(KvDtype::F16, 10, 0),
            10 * 2 * per_attn + 2 * 14 * per_layer as u128
        );
        let e = ModelCacheSpec::from_config(&json!({"layer_types": ["mamba"]}), 1, 1, 64);
        assert!(e.unwrap_err().message.contains("mamba_d_conv"));
        // Sizes whose products would overflow the byte counts are refused up front.
        let mut huge = c.clone();
        huge["mamba_d_state"] = json!(1u64 << 40);
        let e = ModelCacheSpec::from_config(&huge, 16, 4, 64).unwrap_err();
        assert!(e.message.contains("mamba_d_state in 1..="), "{}", e.message);
    }

    #[test]
    fn conv_layers_hold_a_tail_per_sequence_and_no_kv() {
        // LFM2-350M's pattern: 16 layers, attention at 2, 5, 8, 10, 12, 14.
        let attn = [2, 5, 8, 10, 12, 14];
        let types: Vec<&str> = (0..16)
            .map(|i| {
                if attn.contains(&i) {
                    "full_attention"
                } else {
                    "conv"
                }
            })
            .collect();
        let c = json!({"layer_types": types, "conv_L_cache": 3, "hidden_size": 1024});
        let spec = ModelCacheSpec::from_config(&c, 16, 8, 64).unwrap();
        let conv = spec.conv().unwrap().unwrap();
        assert_eq!(
            (conv.width, conv.channels, conv.layers.len()),
            (3, 1024, 10)
        );
        assert!(attn.iter().all(|&l| !conv.layers.contains(l)));
        assert_eq!(spec.sliding().unwrap(), None);
        let per_attn = spec.layer_bytes_per_token(KvDtype::F16) as u128;
        // Per token the attention layers' K/V; per sequence each conv layer's last 2 rows,
        // at its end and at a step's.
        assert_eq!(spec.state_bytes(), 10 * 2 * 4 * 1024);
        assert_eq!(
            spec.sequence_bytes(KvDtype::F16, 10, 0),
            10 * 6 * per_attn + 2 * 10 * 2 * 4 * 1024
        );
        for bad in [
            json!({"layer_types": ["conv"], "hidden_size": 8}),
            json!({"layer_types": ["conv"], "conv_L_cache": 1, "hidden_size": 8}),
            json!({"layer_types": ["conv"], "conv_L_cache": 3}),
        ] {
            let e = ModelCacheSpec::from_config(&bad, 1, 1, 64).unwrap_err();
            assert!(e.message.contains("conv"), "{}", e.message);
        }
    }
}
