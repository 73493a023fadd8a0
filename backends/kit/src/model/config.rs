//! `config.json` of a Llama-family model, and the rotary frequencies it implies.

use kvplug_core::{CacheError, ModelCacheParams};

/// Why a model package cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read (the message names it).
    #[error(transparent)]
    File(#[from] kvplug_core::files::FileError),
    /// A malformed or inconsistent file.
    #[error("{0}")]
    Malformed(String),
    /// An architecture this kit does not implement.
    #[error("unsupported architecture '{0}' (supported: llama, mistral, qwen2)")]
    Unsupported(String),
}

impl From<ModelError> for CacheError {
    fn from(e: ModelError) -> Self {
        CacheError::bad_config(e.to_string())
    }
}

/// `rope_scaling` of Llama 3.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct RopeScaling {
    /// `llama3` (others are rejected).
    #[serde(alias = "type")]
    pub rope_type: String,
    /// Frequency division factor.
    #[serde(default = "one")]
    pub factor: f64,
    /// Low-frequency factor.
    #[serde(default = "one")]
    pub low_freq_factor: f64,
    /// High-frequency factor.
    #[serde(default = "four")]
    pub high_freq_factor: f64,
    /// Context length the frequencies were trained for.
    #[serde(default = "ctx")]
    pub original_max_position_embeddings: f64,
}

fn one() -> f64 {
    1.0
}
fn four() -> f64 {
    4.0
}
fn ctx() -> f64 {
    8192.0
}
fn eps() -> f64 {
    1e-6
}
fn theta() -> f64 {
    10000.0
}

/// The fields of a Hugging Face `config.json` this kit reads (others are ignored).
#[derive(Clone, Debug, serde::Deserialize)]
pub struct LlamaConfig {
    /// `llama`, `mistral` or `qwen2`.
    #[serde(default)]
    pub model_type: String,
    /// Residual width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// KV heads (default: as many as query heads).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Layers.
    pub num_hidden_layers: usize,
    /// Vocabulary.
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    #[serde(default = "eps")]
    pub rms_norm_eps: f64,
    /// RoPE base.
    #[serde(default = "theta")]
    pub rope_theta: f64,
    /// Llama 3 frequency scaling.
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Whether `lm_head` reuses the embedding table.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Head width (default hidden / heads).
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Biases on q/k/v (Qwen2 always has them).
    #[serde(default)]
    pub attention_bias: bool,
    /// Sliding-window width (Mistral; Qwen2's takes effect only with
    /// `use_sliding_window`). Refused until sliding-window attention exists: running it
    /// with full attention would be silently wrong past the window.
    #[serde(default)]
    pub sliding_window: Option<u64>,
    /// Qwen2: whether `sliding_window` applies.
    #[serde(default)]
    pub use_sliding_window: bool,
    /// The MLP activation; only `silu` is implemented.
    #[serde(default)]
    pub hidden_act: Option<String>,
    /// Biases on the MLP projections (not implemented: refused).
    #[serde(default)]
    pub mlp_bias: bool,
}

/// The largest residual width, MLP width and vocabulary a config may declare (released
/// models stay well below; the bounds keep every shape product far from overflow).
pub const MAX_HIDDEN: usize = 1 << 16;
/// See [`MAX_HIDDEN`].
pub const MAX_INTERMEDIATE: usize = 1 << 18;
/// See [`MAX_HIDDEN`].
pub const MAX_VOCAB: usize = 1 << 22;

impl LlamaConfig {
    /// Parses and validates `config.json` text.
    pub fn parse(text: &str) -> Result<Self, ModelError> {
        let c: LlamaConfig =
            serde_json::from_str(text).map_err(|e| ModelError::Malformed(e.to_string()))?;
        if !matches!(c.model_type.as_str(), "llama" | "mistral" | "qwen2") {
            return Err(ModelError::Unsupported(c.model_type));
        }
        use kvplug_core::limits::{MAX_HEAD_DIM, MAX_KV_HEADS, MAX_LAYERS};
        for (name, v, max) in [
            ("hidden_size", c.hidden_size, MAX_HIDDEN),
            ("intermediate_size", c.intermediate_size, MAX_INTERMEDIATE),
            ("vocab_size", c.vocab_size, MAX_VOCAB),
            ("num_hidden_layers", c.num_hidden_layers, MAX_LAYERS),
            ("num_attention_heads", c.num_attention_heads, MAX_KV_HEADS),
            ("head_dim", c.head_dim(), MAX_HEAD_DIM),
        ] {
            if v > max {
                return Err(ModelError::Malformed(format!(
                    "{name} {v} is above the limit of {max}"
                )));
            }
        }
        let positive = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(ModelError::Malformed(format!(
                    "{name} {v} must be a finite number > 0"
                )))
            }
        };
        positive("rms_norm_eps", c.rms_norm_eps)?;
        positive("rope_theta", c.rope_theta)?;
        if let Some(act) = c.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(ModelError::Malformed(format!(
                "hidden_act '{act}' is not supported (only silu)"
            )));
        }
        if c.mlp_bias {
            return Err(ModelError::Malformed(
                "mlp_bias is not supported (MLP projections without biases only)".into(),
            ));
        }
        if c.attention_bias && c.model_type != "qwen2" {
            return Err(ModelError::Malformed(
                "attention_bias is not supported for llama/mistral (it adds an o_proj bias)".into(),
            ));
        }
        let kv = c.kv_heads();
        let dims_ok = c.hidden_size > 0
            && c.intermediate_size > 0
            && c.num_attention_heads > 0
            && kv > 0
            && c.num_attention_heads % kv == 0
            && c.num_hidden_layers > 0
            && c.vocab_size > 0
            && c.head_dim() % 2 == 0
            && c.head_dim() > 0;
        if !dims_ok {
            return Err(ModelError::Malformed(format!(
                "inconsistent shape (hidden {}, heads {}, kv heads {kv}, head_dim {}, layers {})",
                c.hidden_size,
                c.num_attention_heads,
                c.head_dim(),
                c.num_hidden_layers
            )));
        }
        let windowed = c.model_type != "qwen2" || c.use_sliding_window;
        if let Some(w) = c.sliding_window.filter(|_| windowed) {
            return Err(ModelError::Malformed(format!(
                "sliding-window attention (sliding_window = {w}) is not supported yet; \
                 running this {} model with full attention would be wrong past {w} tokens",
                c.model_type
            )));
        }
        if let Some(s) = &c.rope_scaling {
            if s.rope_type != "llama3" {
                return Err(ModelError::Malformed(format!(
                    "rope_scaling type '{}' is not supported (only llama3)",
                    s.rope_type
                )));
            }
            positive("rope_scaling.factor", s.factor)?;
            positive("rope_scaling.low_freq_factor", s.low_freq_factor)?;
            positive(
                "rope_scaling.original_max_position_embeddings",
                s.original_max_position_embeddings,
            )?;
            if s.high_freq_factor.partial_cmp(&s.low_freq_factor)
                != Some(std::cmp::Ordering::Greater)
            {
                return Err(ModelError::Malformed(format!(
                    "rope_scaling.high_freq_factor {} must exceed low_freq_factor {}",
                    s.high_freq_factor, s.low_freq_factor
                )));
            }
        }
        Ok(c)
    }

    /// KV heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Head width.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Whether q/k/v carry biases.
    pub fn qkv_bias(&self) -> bool {
        self.attention_bias || self.model_type == "qwen2"
    }

    /// The cache shape this model needs.
    pub fn cache_params(&self) -> ModelCacheParams {
        ModelCacheParams {
            n_layers: self.num_hidden_layers,
            n_kv_heads: self.kv_heads(),
            head_dim: self.head_dim(),
        }
    }

    /// Rotary inverse frequencies (`head_dim / 2` values), Llama 3 scaling applied.
    pub fn inv_freq(&self) -> Vec<f32> {
        let hd = self.head_dim();
        (0..hd / 2)
            .map(|i| {
                let f = self.rope_theta.powf(-(2.0 * i as f64) / hd as f64);
                let Some(s) = &self.rope_scaling else {
                    return f as f32;
                };
                let wavelen = 2.0 * std::f64::consts::PI / f;
                let low = s.original_max_position_embeddings / s.low_freq_factor;
                let high = s.original_max_position_embeddings / s.high_freq_factor;
                let scaled = if wavelen < high {
                    f
                } else if wavelen > low {
                    f / s.factor
                } else {
                    let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * f / s.factor + smooth * f
                };
                scaled as f32
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOL: &str = r#"{"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30,
        "vocab_size": 49152, "rope_theta": 10000.0, "tie_word_embeddings": true, "extra": 1}"#;

    #[test]
    fn parses_hf_configs() {
        let c = LlamaConfig::parse(SMOL).unwrap();
        assert_eq!((c.head_dim(), c.kv_heads(), c.qkv_bias()), (64, 3, false));
        assert_eq!(c.inv_freq().len(), 32);
        assert_eq!(c.inv_freq()[0], 1.0);
        let q = LlamaConfig::parse(&SMOL.replace("\"llama\"", "\"qwen2\"")).unwrap();
        assert!(q.qkv_bias());
        let e = LlamaConfig::parse(&SMOL.replace("\"llama\"", "\"gpt2\"")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "unsupported architecture 'gpt2' (supported: llama, mistral, qwen2)"
        );
        let e = LlamaConfig::parse(
            &SMOL.replace("\"num_key_value_heads\": 3", "\"num_key_value_heads\": 4"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("inconsistent shape"), "{e}");
        assert!(LlamaConfig::parse("{").is_err());
    }

    #[test]
    fn unsupported_or_invalid_values_are_refused_naming_them() {
        let with = |key: &str, value: serde_json::Value| {
            let mut v: serde_json::Value = serde_json::from_str(SMOL).unwrap();
            v[key] = value;
            LlamaConfig::parse(&v.to_string())
        };
        use serde_json::json;
        for (key, value, says) in [
            (
                "hidden_act",
                json!("gelu"),
                "hidden_act 'gelu' is not supported",
            ),
            ("mlp_bias", json!(true), "mlp_bias is not supported"),
            (
                "attention_bias",
                json!(true),
                "attention_bias is not supported",
            ),
            (
                "rms_norm_eps",
                json!(-1e-5),
                "rms_norm_eps -0.00001 must be",
            ),
            (
                "rope_theta",
                json!(0.0),
                "rope_theta 0 must be a finite number > 0",
            ),
            (
                "rope_scaling",
                json!({"rope_type": "llama3", "factor": 0.0}),
                "rope_scaling.factor 0 must be",
            ),
            (
                "vocab_size",
                json!(1u64 << 32),
                "vocab_size 4294967296 is above the limit",
            ),
            (
                "num_hidden_layers",
                json!((1u64 << 32) + 2),
                "num_hidden_layers 4294967298 is above the limit",
            ),
        ] {
            let e = with(key, value).unwrap_err().to_string();
            assert!(e.contains(says), "{key}: {e}");
        }
        assert!(with("hidden_act", json!("silu")).is_ok());
    }

    #[test]
    fn sliding_window_configs_are_refused_until_supported() {
        let with = |extra: &str, ty: &str| {
            LlamaConfig::parse(&SMOL.replace("\"extra\": 1", extra).replace("\"llama\"", ty))
        };
        let e = with("\"sliding_window\": 4096", "\"mistral\"").unwrap_err();
        assert!(e.to_string().contains("sliding_window = 4096"), "{e}");
        assert!(with("\"sliding_window\": null", "\"mistral\"").is_ok());
        // Qwen2 ships a window it does not use unless told to.
        assert!(with("\"sliding_window\": 32768", "\"qwen2\"").is_ok());
        let e = with(
            "\"sliding_window\": 32768, \"use_sliding_window\": true",
            "\"qwen2\"",
        )
        .unwrap_err();
        assert!(e.to_string().contains("not supported yet"), "{e}");
    }

    #[test]
    fn llama3_scaling_divides_low_frequencies_only() {
        let c = LlamaConfig::parse(&SMOL.replace(
            "\"rope_theta\": 10000.0",
            r#""rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#,
        ))
        .unwrap();
        let plain = LlamaConfig {
            rope_scaling: None,
            ..c.clone()
        }
        .inv_freq();
        let scaled = c.inv_freq();
        assert_eq!(scaled[0], plain[0], "high frequencies are kept");
        let last = plain.len() - 1;
        assert!(
            (scaled[last] - plain[last] / 8.0).abs() < 1e-12,
            "low frequencies are divided by the factor"
        );
    }
}
