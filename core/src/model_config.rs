//! `config.json` of a decoder the kit runs (the Llama family and Gemma 3), parsed once for
//! every side (the runtime sizes caches from it, the kit builds the forward pass from it),
//! and what it implies: rotary frequencies per layer type, attention scale, which layers slide.

use crate::spec::{LayerAttention, ModelCacheSpec};
use crate::{CacheError, ConvLayers, DeltaLayers, ModelCacheParams, SlidingLayers, SsmLayers};

/// Why a model package cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read (the message names it).
    #[error(transparent)]
    File(#[from] crate::files::FileError),
    /// A malformed or inconsistent file.
    #[error("{0}")]
    Malformed(String),
    /// An architecture this kit does not implement.
    #[error(
        "unsupported architecture '{0}' (supported: llama, mistral, qwen2, qwen3, qwen3_moe, \
         gpt_oss, gemma3_text, lfm2, qwen3_5_text, granitemoehybrid)"
    )]
    Unsupported(String),
}

impl From<ModelError> for CacheError {
    fn from(e: ModelError) -> Self {
        CacheError::bad_config(e.to_string())
    }
}

/// `rope_scaling`: Llama 3's, linear (position interpolation, Gemma 3's global layers), or
/// YaRN (GPT-OSS's, and any family's whose `attention_factor` is stated, as a GGUF's is).
#[derive(Clone, Debug, serde::Deserialize)]
pub struct RopeScaling {
    /// `llama3`, `linear` or `yarn` (others are rejected).
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
    /// YaRN: rotations per original context above which a pair keeps its frequency.
    #[serde(default = "thirty_two")]
    pub beta_fast: f64,
    /// YaRN: rotations per original context below which a pair's frequency is divided.
    #[serde(default = "one")]
    pub beta_slow: f64,
    /// YaRN: whether the ramp's ends are rounded to whole pairs (llama.cpp always does; a
    /// GGUF's model follows it).
    #[serde(default = "yes")]
    pub truncate: bool,
    /// YaRN: the factor on rotated q and k; unstated, `1 + 0.1·ln(factor)` (GPT-OSS's).
    #[serde(default)]
    pub attention_factor: Option<f64>,
}

fn thirty_two() -> f64 {
    32.0
}
fn yes() -> bool {
    true
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

/// The graph a config selects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama, Mistral, Qwen2, Qwen3 (and SmolLM, TinyLlama shapes): pre-norm blocks, SiLU
    /// MLP; Qwen3 adds per-head q/k RMSNorms; Qwen3-MoE is Qwen3 with a mixture of experts
    /// in place of the MLP ([`Experts`]).
    Llama,
    /// Gemma 3 (text): q/k norms, (1 + w) RMSNorm weights, pre- and post-norms around
    /// attention and MLP, GELU-tanh MLP, embeddings scaled by √hidden, local/global RoPE.
    Gemma3,
    /// LFM2: a hybrid whose layers are short convolutions (`conv`) or GQA attention with
    /// per-head q/k norms, each followed by a SiLU MLP; Hugging Face's LFM2 tensor names.
    Lfm2,
    /// GPT-OSS: attention with biases, a learned sink per head and YaRN rotary, sliding
    /// (128) and full layers alternating, a mixture of biased experts with a clamped SwiGLU
    /// (the router's softmax over its top-k). Read from GGUF only (its Hugging Face weights
    /// are MXFP4 blocks in a layout of their own).
    GptOss,
    /// Qwen3.5 (dense): a hybrid of gated delta-rule layers (`linear_attention`) and gated
    /// full attention (q/k norms, a sigmoid output gate carried by the q projection,
    /// partial rotary), each followed by a SiLU MLP. Read from GGUF only: its weights as
    /// llama.cpp's converter writes them (RMSNorm weights with their `1 +` folded in,
    /// `a = −exp(A_log)`).
    Qwen35,
    /// Granite 4.0-H (dense): a hybrid of Mamba2 layers (`mamba`) and GQA attention without
    /// positional encoding (`position_embedding_type` `nope`; RoPE where `rope`), each
    /// followed by a SiLU MLP, with Granite's multipliers on the embeddings, the residual
    /// branches, the attention scores and the logits. Read from GGUF only (`a = −exp(A_log)`
    /// as llama.cpp's converter writes it).
    GraniteHybrid,
}

/// The gate activation of the MLP.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    /// `x · sigmoid(x)`.
    Silu,
    /// GELU, tanh approximation (`gelu_pytorch_tanh`).
    GeluTanh,
    /// GPT-OSS's clamped SwiGLU: with `g = min(gate, limit)` and `u = clamp(up, −limit,
    /// limit)`, `g·sigmoid(alpha·g)·(u + 1)`.
    SwigluOai {
        /// The sigmoid's slope (1.702).
        alpha: f32,
        /// The clamp (`swiglu_limit`, 7).
        limit: f32,
    },
}

/// How a router turns a token's logits into its experts' weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// Qwen3-MoE: softmax over every expert, the top-k probabilities as weights
    /// (renormalized to sum to 1 when [`Experts::renormalize`]).
    Softmax,
    /// GPT-OSS: the top-k logits, then a softmax over those k.
    TopKSoftmax,
}

/// The fields of a Hugging Face `config.json` this kit reads (others are ignored). Fields a
/// Gemma 3 config may leave out take `Gemma3TextConfig`'s defaults.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct ModelConfig {
    /// `llama`, `mistral`, `qwen2`, `qwen3`, `qwen3_moe`, `gemma3_text`, `lfm2` or
    /// `qwen3_5_text`.
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
    /// RMSNorm epsilon (LFM2's `norm_eps`).
    #[serde(default = "eps")]
    pub rms_norm_eps: f64,
    /// RoPE base.
    #[serde(default = "theta")]
    pub rope_theta: f64,
    /// Llama 3 frequency scaling.
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Whether `lm_head` reuses the embedding table (LFM2's `tie_embedding`).
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Head width (default hidden / heads).
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Biases on q/k/v (Qwen2 always has them).
    #[serde(default)]
    pub attention_bias: bool,
    /// The MLP activation (Llama family: `silu`).
    #[serde(default)]
    pub hidden_act: Option<String>,
    /// Gemma 3's MLP activation (`gelu_pytorch_tanh`).
    #[serde(default)]
    pub hidden_activation: Option<String>,
    /// Gemma 3: attention scale is `query_pre_attn_scalar^-1/2` (else `head_dim^-1/2`).
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f64>,
    /// Gemma 3: RoPE base of the sliding (local) layers; `rope_theta` is the global one.
    #[serde(default)]
    pub rope_local_base_freq: Option<f64>,
    /// Tanh soft-capping of the final logits (Gemma 2; not implemented: refused).
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
    /// Tanh soft-capping of attention scores (Gemma 2; not implemented: refused).
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    /// How each layer attends, from the sliding-window conventions
    /// ([`ModelCacheSpec::from_config`]); filled by [`ModelConfig::parse`].
    #[serde(skip)]
    pub attention: Vec<LayerAttention>,
    /// Biases on the MLP projections (not implemented: refused).
    #[serde(default)]
    pub mlp_bias: bool,
    /// The share of each head that rotates (Qwen3.5: 0.25; default 1).
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    /// Multimodal RoPE sections (Qwen3.5's `mrope_section`, llama.cpp's
    /// `rope.dimension_sections`, interleaved): on text, pairs of the fourth section (or past
    /// three times each section) rotate by position 0, i.e. not at all.
    #[serde(default)]
    pub mrope_section: Option<Vec<usize>>,
    /// Granite: `nope` (no positional encoding) or `rope`.
    #[serde(default)]
    pub position_embedding_type: Option<String>,
    /// Granite: the factor on the embeddings.
    #[serde(default)]
    pub embedding_multiplier: Option<f64>,
    /// Granite: the factor on each block's output before the residual add.
    #[serde(default)]
    pub residual_multiplier: Option<f64>,
    /// Granite: the attention scale (in place of `head_dim^-1/2`).
    #[serde(default)]
    pub attention_multiplier: Option<f64>,
    /// Granite: the logits are divided by it.
    #[serde(default)]
    pub logits_scaling: Option<f64>,
    /// Set by the host's GGUF index: the weights follow llama.cpp's converter (required for
    /// Qwen3.5, whose Hugging Face and GGUF weights differ).
    #[serde(default)]
    pub gguf_converted: bool,
    /// Per-pair divisors of the rotary frequencies (`head_dim / 2` values): llama.cpp's
    /// `rope_freqs` tensor, in which a Llama 3.x GGUF carries its `rope_scaling` (written
    /// into the derived `config.json` by the host's GGUF index; not a Hugging Face field).
    #[serde(default)]
    pub rope_freq_factors: Option<Vec<f64>>,
    /// Experts of a mixture-of-experts feed-forward (Qwen3-MoE's `num_experts`; absent in
    /// a dense model).
    #[serde(default)]
    pub num_experts: Option<usize>,
    /// Experts each token routes to.
    #[serde(default)]
    pub num_experts_per_tok: Option<usize>,
    /// Each expert's MLP width.
    #[serde(default)]
    pub moe_intermediate_size: Option<usize>,
    /// Whether the chosen experts' probabilities are renormalized to sum to 1 (Qwen3-MoE's
    /// default: false, as in `Qwen3MoeConfig`; llama.cpp's `qwen3moe` always renormalizes,
    /// and the GGUF reader says so).
    #[serde(default)]
    pub norm_topk_prob: bool,
    /// Every `decoder_sparse_step`-th layer is sparse (default 1: all) ...
    #[serde(default)]
    pub decoder_sparse_step: Option<usize>,
    /// ... except these, which keep a dense MLP of `intermediate_size`.
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    /// GPT-OSS's name for [`ModelConfig::num_experts`].
    #[serde(default)]
    pub num_local_experts: Option<usize>,
    /// GPT-OSS: the clamp of its SwiGLU (default 7).
    #[serde(default)]
    pub swiglu_limit: Option<f64>,
}

/// The mixture-of-experts feed-forward of a model's sparse layers: a router (`[experts,
/// hidden]`) scores every expert per token; the token's output is the weighted sum of its
/// `per_token` best experts' gated MLPs of `width`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Experts {
    /// Experts per layer.
    pub count: usize,
    /// Experts each token routes to (top-k).
    pub per_token: usize,
    /// Each expert's MLP width.
    pub width: usize,
    /// Whether the chosen experts' softmax probabilities are renormalized to sum to 1.
    pub renormalize: bool,
    /// How the router's logits become weights.
    pub gating: Gating,
    /// The experts' gate activation.
    pub activation: Activation,
}

/// The most experts a layer may have (released models: 8–512).
pub const MAX_EXPERTS: usize = 1 << 12;

/// The largest residual width, MLP width and vocabulary a config may declare (released
/// models stay well below; the bounds keep every shape product far from overflow).
pub const MAX_HIDDEN: usize = 1 << 16;
/// See [`MAX_HIDDEN`].
pub const MAX_INTERMEDIATE: usize = 1 << 18;
/// See [`MAX_HIDDEN`].
pub const MAX_VOCAB: usize = 1 << 22;

/// LFM2's fields under the names this kit reads: `norm_eps` and `tie_embedding` (where the
/// usual names are absent), and the MLP width as its converter derives it: with
/// `block_auto_adjust_ff_dim`, two thirds of `block_ff_dim` (or `intermediate_size`), times
/// `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`, as `intermediate_size`.
/// Convolution biases are refused (not implemented).
fn lfm2_fields(v: &mut serde_json::Value) -> Result<(), ModelError> {
    if v["conv_bias"].as_bool() == Some(true) {
        return Err(ModelError::Malformed(
            "conv_bias is not supported (LFM2 convolutions without biases only)".into(),
        ));
    }
    for (lfm2, usual) in [
        ("norm_eps", "rms_norm_eps"),
        ("tie_embedding", "tie_word_embeddings"),
    ] {
        if v[usual].is_null() && !v[lfm2].is_null() {
            v[usual] = v[lfm2].clone();
        }
    }
    if !v["block_auto_adjust_ff_dim"].as_bool().unwrap_or(false) {
        return Ok(());
    }
    let ff = v["block_ff_dim"]
        .as_u64()
        .or_else(|| v["intermediate_size"].as_u64())
        .ok_or_else(|| ModelError::Malformed("LFM2 config without block_ff_dim".into()))?;
    let mut ff = 2 * ff / 3;
    if let Some(m) = v["block_ffn_dim_multiplier"].as_f64() {
        ff = (m * ff as f64) as u64;
    }
    let multiple = v["block_multiple_of"].as_u64().unwrap_or(1).max(1);
    v["intermediate_size"] = ff.div_ceil(multiple).saturating_mul(multiple).into();
    Ok(())
}

/// `Gemma3TextConfig`'s defaults for the fields this kit reads.
fn gemma3_defaults() -> [(&'static str, serde_json::Value); 8] {
    use serde_json::json;
    [
        ("rope_theta", json!(1_000_000.0)),
        ("rope_local_base_freq", json!(10_000.0)),
        ("query_pre_attn_scalar", json!(256)),
        ("head_dim", json!(256)),
        ("rms_norm_eps", json!(1e-6)),
        ("sliding_window", json!(4096)),
        ("tie_word_embeddings", json!(true)),
        ("hidden_activation", json!("gelu_pytorch_tanh")),
    ]
}

impl ModelConfig {
    /// Parses and validates `config.json` text.
    pub fn parse(text: &str) -> Result<Self, ModelError> {
        let mut v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| ModelError::Malformed(e.to_string()))?;
        let model_type = v["model_type"].as_str().unwrap_or_default().to_string();
        if !matches!(
            model_type.as_str(),
            "llama"
                | "mistral"
                | "qwen2"
                | "qwen3"
                | "qwen3_moe"
                | "gpt_oss"
                | "gemma3_text"
                | "lfm2"
                | "qwen3_5_text"
                | "granitemoehybrid"
        ) {
            return Err(ModelError::Unsupported(model_type));
        }
        if model_type == "granitemoehybrid" && v["gguf_converted"].as_bool() != Some(true) {
            return Err(ModelError::Malformed(
                "Granite 4.0-H is read from GGUF files only; convert it with llama.cpp's \
                 convert_hf_to_gguf.py"
                    .into(),
            ));
        }
        if model_type == "gpt_oss" && v["gguf_converted"].as_bool() != Some(true) {
            return Err(ModelError::Malformed(
                "GPT-OSS is read from GGUF files only (its Hugging Face weights are MXFP4 \
                 blocks in a layout of their own)"
                    .into(),
            ));
        }
        if model_type == "qwen3_5_text" && v["gguf_converted"].as_bool() != Some(true) {
            return Err(ModelError::Malformed(
                "Qwen3.5 is read from GGUF files only (its Hugging Face weights are laid out \
                 differently); convert it with llama.cpp's convert_hf_to_gguf.py"
                    .into(),
            ));
        }
        if model_type == "lfm2" {
            lfm2_fields(&mut v)?;
        }
        if model_type == "gemma3_text" {
            let Some(obj) = v.as_object_mut() else {
                return Err(ModelError::Malformed("config.json is not an object".into()));
            };
            for (key, value) in gemma3_defaults() {
                if obj.get(key).is_none_or(serde_json::Value::is_null) {
                    obj.insert(key.into(), value);
                }
            }
            if obj.get("layer_types").is_none() {
                obj.entry("sliding_window_pattern").or_insert(6.into());
            }
        }
        let mut c: ModelConfig =
            serde_json::from_value(v.clone()).map_err(|e| ModelError::Malformed(e.to_string()))?;
        use crate::limits::{MAX_HEAD_DIM, MAX_KV_HEADS, MAX_LAYERS};
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
        if let Some(p) = c
            .position_embedding_type
            .as_deref()
            .filter(|p| !["rope", "nope"].contains(p))
        {
            return Err(ModelError::Malformed(format!(
                "position_embedding_type '{p}' is not supported (rope or nope)"
            )));
        }
        positive("rope_theta", c.rope_theta)?;
        for (name, v) in [
            ("rope_local_base_freq", c.rope_local_base_freq),
            ("query_pre_attn_scalar", c.query_pre_attn_scalar),
            ("embedding_multiplier", c.embedding_multiplier),
            ("residual_multiplier", c.residual_multiplier),
            ("attention_multiplier", c.attention_multiplier),
            ("logits_scaling", c.logits_scaling),
        ] {
            if let Some(v) = v {
                positive(name, v)?;
            }
        }
        let act = match c.arch() {
            Arch::Llama | Arch::Lfm2 | Arch::Qwen35 | Arch::GptOss | Arch::GraniteHybrid => {
                ("hidden_act", c.hidden_act.as_deref(), "silu")
            }
            Arch::Gemma3 => (
                "hidden_activation",
                c.hidden_activation.as_deref(),
                "gelu_pytorch_tanh",
            ),
        };
        if let (name, Some(got), want) = act {
            if got != want {
                return Err(ModelError::Malformed(format!(
                    "{name} '{got}' is not supported (only {want} for {})",
                    c.model_type
                )));
            }
        }
        for (name, cap) in [
            ("final_logit_softcapping", c.final_logit_softcapping),
            ("attn_logit_softcapping", c.attn_logit_softcapping),
        ] {
            if let Some(cap) = cap {
                return Err(ModelError::Malformed(format!(
                    "{name} {cap} is not supported (no logit soft-capping)"
                )));
            }
        }
        if c.mlp_bias {
            return Err(ModelError::Malformed(
                "mlp_bias is not supported (MLP projections without biases only)".into(),
            ));
        }
        if c.attention_bias && !matches!(c.model_type.as_str(), "qwen2" | "gpt_oss") {
            return Err(ModelError::Malformed(format!(
                "attention_bias is not supported for {} (it adds an o_proj bias)",
                c.model_type
            )));
        }
        let kv = c.kv_heads();
        let heads = c.num_attention_heads;
        let broken = [
            (c.hidden_size == 0, "hidden_size is 0"),
            (c.intermediate_size == 0, "intermediate_size is 0"),
            (heads == 0, "num_attention_heads is 0"),
            (kv == 0, "num_key_value_heads is 0"),
            (
                kv > 0 && heads % kv != 0,
                "num_attention_heads is not a multiple of num_key_value_heads",
            ),
            (c.num_hidden_layers == 0, "num_hidden_layers is 0"),
            (c.vocab_size == 0, "vocab_size is 0"),
            (
                c.head_dim() == 0 || c.head_dim() % 2 == 1,
                "head_dim is not an even count above 0",
            ),
        ];
        if let Some((_, why)) = broken.iter().find(|b| b.0) {
            return Err(ModelError::Malformed(format!(
                "inconsistent shape: {why} (hidden {}, heads {}, kv heads {kv}, head_dim {}, \
                 layers {})",
                c.hidden_size,
                c.num_attention_heads,
                c.head_dim(),
                c.num_hidden_layers
            )));
        }
        if let Some(f) = c.partial_rotary_factor {
            let rot = f * c.head_dim() as f64;
            if !(f > 0.0 && f <= 1.0 && rot.fract() == 0.0 && rot as usize % 2 == 0) {
                return Err(ModelError::Malformed(format!(
                    "partial_rotary_factor {f} does not give an even number of the {} dims",
                    c.head_dim()
                )));
            }
        }
        if let Some(s) = &c.mrope_section {
            if s.len() > 4 || s.iter().sum::<usize>() == 0 {
                return Err(ModelError::Malformed(format!(
                    "mrope_section {s:?}: up to four sections, not all empty"
                )));
            }
        }
        c.check_experts()?;
        c.attention = ModelCacheSpec::from_config(&v, c.num_hidden_layers, kv, c.head_dim())
            .map_err(|e| ModelError::Malformed(e.message))?
            .layers;
        if let Some(f) = &c.rope_freq_factors {
            if f.len() != c.head_dim() / 2 {
                return Err(ModelError::Malformed(format!(
                    "rope_freq_factors has {} values for head_dim {}",
                    f.len(),
                    c.head_dim()
                )));
            }
            if c.rope_scaling.is_some() {
                return Err(ModelError::Malformed(
                    "rope_freq_factors and rope_scaling both given".into(),
                ));
            }
            for &v in f {
                positive("a rope_freq_factors value", v)?;
            }
        }
        if let Some(s) = &c.rope_scaling {
            positive("rope_scaling.factor", s.factor)?;
            match s.rope_type.as_str() {
                "linear" => return Ok(c),
                "llama3" => {}
                "yarn" => {
                    // Every dim rotating, and the magnitude GPT-OSS's or stated (as a GGUF's
                    // indexer states llama.cpp's): other families' unstated defaults
                    // (Hugging Face's ratio of context lengths, mscale_all_dim) would compute
                    // something else, refused until read.
                    let stated = s.attention_factor.is_some() || c.model_type == "gpt_oss";
                    if !stated || c.rotary_dim() != c.head_dim() {
                        return Err(ModelError::Malformed(format!(
                            "rope_scaling type 'yarn' is supported with full rotary, for \
                             gpt_oss or with its attention_factor stated, not for {}{}",
                            c.model_type,
                            if stated { " with partial rotary" } else { "" }
                        )));
                    }
                    if let Some(a) = s.attention_factor {
                        positive("rope_scaling.attention_factor", a)?;
                    }
                    positive(
                        "rope_scaling.original_max_position_embeddings",
                        s.original_max_position_embeddings,
                    )?;
                    positive("rope_scaling.beta_fast", s.beta_fast)?;
                    positive("rope_scaling.beta_slow", s.beta_slow)?;
                    return Ok(c);
                }
                other => {
                    return Err(ModelError::Malformed(format!(
                        "rope_scaling type '{other}' is not supported (llama3, linear, yarn)"
                    )))
                }
            }
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

    /// The graph this config selects.
    pub fn arch(&self) -> Arch {
        match self.model_type.as_str() {
            "gemma3_text" => Arch::Gemma3,
            "lfm2" => Arch::Lfm2,
            "qwen3_5_text" => Arch::Qwen35,
            "gpt_oss" => Arch::GptOss,
            "granitemoehybrid" => Arch::GraniteHybrid,
            _ => Arch::Llama,
        }
    }

    /// The MLP's gate activation.
    pub fn activation(&self) -> Activation {
        match self.arch() {
            Arch::Llama | Arch::Lfm2 | Arch::Qwen35 | Arch::GraniteHybrid => Activation::Silu,
            Arch::Gemma3 => Activation::GeluTanh,
            Arch::GptOss => Activation::SwigluOai {
                alpha: 1.702,
                limit: self.swiglu_limit.unwrap_or(7.0) as f32,
            },
        }
    }

    /// Whether q and k pass through per-head RMSNorms before RoPE (Gemma 3, Qwen3, LFM2).
    pub fn qk_norm(&self) -> bool {
        matches!(
            self.model_type.as_str(),
            "gemma3_text" | "qwen3" | "qwen3_moe" | "lfm2" | "qwen3_5_text"
        )
    }

    /// The mixture of experts of the sparse layers, if the model has one.
    pub fn experts(&self) -> Option<Experts> {
        let gpt_oss = self.arch() == Arch::GptOss;
        Some(Experts {
            count: self
                .num_experts
                .or(self.num_local_experts)
                .filter(|&n| n > 0)?,
            per_token: self.num_experts_per_tok.unwrap_or(1),
            width: self.moe_intermediate_size.unwrap_or(self.intermediate_size),
            renormalize: self.norm_topk_prob,
            gating: if gpt_oss {
                Gating::TopKSoftmax
            } else {
                Gating::Softmax
            },
            activation: self.activation(),
        })
    }

    /// Whether layer `l`'s feed-forward is the mixture of experts (Qwen3-MoE's rule: every
    /// `decoder_sparse_step`-th layer but those in `mlp_only_layers`).
    pub fn sparse_layer(&self, l: usize) -> bool {
        let step = self.decoder_sparse_step.unwrap_or(1).max(1);
        self.experts().is_some() && (l + 1) % step == 0 && !self.mlp_only_layers.contains(&l)
    }

    /// Refuses a mixture of experts that cannot run: expert fields on an architecture
    /// without one, top-k outside `1..=experts`, limits exceeded.
    fn check_experts(&self) -> Result<(), ModelError> {
        let Some(e) = self.experts() else {
            if matches!(self.model_type.as_str(), "qwen3_moe" | "gpt_oss") {
                return Err(ModelError::Malformed(format!(
                    "a {} config without its number of experts",
                    self.model_type
                )));
            }
            return Ok(());
        };
        if !matches!(self.model_type.as_str(), "qwen3_moe" | "gpt_oss") {
            return Err(ModelError::Malformed(format!(
                "num_experts is not supported for {} (mixtures of experts: qwen3_moe, gpt_oss)",
                self.model_type
            )));
        }
        if e.count > MAX_EXPERTS || e.width > MAX_INTERMEDIATE || e.width == 0 {
            return Err(ModelError::Malformed(format!(
                "{} experts of width {}: outside the limits ({MAX_EXPERTS} experts, width 1 to \
                 {MAX_INTERMEDIATE})",
                e.count, e.width
            )));
        }
        if !(1..=e.count).contains(&e.per_token) {
            return Err(ModelError::Malformed(format!(
                "num_experts_per_tok {} must be between 1 and num_experts {}",
                e.per_token, e.count
            )));
        }
        Ok(())
    }

    /// Whether q/k/v carry biases.
    pub fn qkv_bias(&self) -> bool {
        self.attention_bias || self.model_type == "qwen2"
    }

    /// Whether the attention output projection carries a bias and each head a learned sink
    /// (GPT-OSS).
    pub fn o_bias_and_sinks(&self) -> bool {
        self.arch() == Arch::GptOss
    }

    /// The factor on q·k: `query_pre_attn_scalar^-1/2` where given, else `head_dim^-1/2`;
    /// times the square of YaRN's magnitude factor, which multiplies both q and k.
    pub fn attn_scale(&self) -> f32 {
        if let Some(m) = self.attention_multiplier {
            return m as f32;
        }
        let s = self.query_pre_attn_scalar.unwrap_or(self.head_dim() as f64);
        let m = self.rope_magnitude();
        (m * m / s.sqrt()) as f32
    }

    /// YaRN's factor on rotated q and k: its `attention_factor`, else `1 + 0.1·ln(factor)`
    /// (1 without YaRN).
    pub fn rope_magnitude(&self) -> f64 {
        match &self.rope_scaling {
            Some(s) if s.rope_type == "yarn" => match s.attention_factor {
                Some(a) => a,
                None if s.factor > 1.0 => 1.0 + 0.1 * s.factor.ln(),
                None => 1.0,
            },
            _ => 1.0,
        }
    }

    /// The factor on embeddings entering the first layer (Gemma: √hidden, in f32 as
    /// llama.cpp computes it).
    pub fn embed_scale(&self) -> Option<f32> {
        match self.arch() {
            Arch::Gemma3 => Some((self.hidden_size as f32).sqrt()),
            _ => self.embedding_multiplier.map(|m| m as f32),
        }
    }

    /// Granite's factor on each block's output before the residual add (`None`: 1).
    pub fn residual_scale(&self) -> Option<f32> {
        self.residual_multiplier.map(|m| m as f32)
    }

    /// Granite's divisor of the logits (`None`: 1).
    pub fn logit_divisor(&self) -> Option<f32> {
        self.logits_scaling.map(|m| m as f32)
    }

    /// The per-layer cache shape: KV heads, head width and each layer's attention.
    pub fn cache_spec(&self) -> ModelCacheSpec {
        ModelCacheSpec {
            n_kv_heads: self.kv_heads(),
            head_dim: self.head_dim(),
            layers: self.attention.clone(),
        }
    }

    /// The sliding layers among the first `layers` (a cache for this model must have
    /// exactly these).
    pub fn sliding(&self, layers: usize) -> Result<Option<SlidingLayers>, ModelError> {
        let mut spec = self.cache_spec();
        spec.layers.truncate(layers);
        spec.sliding().map_err(|e| ModelError::Malformed(e.message))
    }

    /// The convolution layers among the first `layers` (a cache for this model must have
    /// exactly these).
    pub fn conv(&self, layers: usize) -> Result<Option<ConvLayers>, ModelError> {
        let mut spec = self.cache_spec();
        spec.layers.truncate(layers);
        spec.conv().map_err(|e| ModelError::Malformed(e.message))
    }

    /// The gated delta-rule layers among the first `layers`.
    pub fn delta(&self, layers: usize) -> Result<Option<DeltaLayers>, ModelError> {
        let mut spec = self.cache_spec();
        spec.layers.truncate(layers);
        spec.delta().map_err(|e| ModelError::Malformed(e.message))
    }

    /// The Mamba2 layers among the first `layers`.
    pub fn ssm(&self, layers: usize) -> Result<Option<SsmLayers>, ModelError> {
        let mut spec = self.cache_spec();
        spec.layers.truncate(layers);
        spec.ssm().map_err(|e| ModelError::Malformed(e.message))
    }

    /// Dims of each head that rotate (`partial_rotary_factor · head_dim`; all by default).
    pub fn rotary_dim(&self) -> usize {
        if self.position_embedding_type.as_deref() == Some("nope") {
            return 0;
        }
        let hd = self.head_dim();
        self.partial_rotary_factor
            .map_or(hd, |f| (f * hd as f64) as usize)
    }

    /// The cache shape this model needs.
    pub fn cache_params(&self) -> ModelCacheParams {
        ModelCacheParams {
            n_layers: self.num_hidden_layers,
            n_kv_heads: self.kv_heads(),
            head_dim: self.head_dim(),
        }
    }

    /// Rotary inverse frequencies (`head_dim / 2` values) of full-attention layers, with
    /// `rope_scaling` applied.
    pub fn inv_freq(&self) -> Vec<f32> {
        self.frequencies(self.rope_theta, self.rope_scaling.as_ref())
    }

    /// Rotary inverse frequencies of sliding layers: Gemma 3's `rope_local_base_freq`
    /// without scaling; other models use the same as full layers.
    pub fn inv_freq_local(&self) -> Vec<f32> {
        match (self.arch(), self.rope_local_base_freq) {
            (Arch::Gemma3, Some(base)) => self.frequencies(base, None),
            _ => self.inv_freq(),
        }
    }

    /// Per pair of the rotate-half layout (`head_dim / 2`); with a partial rotary, pairs
    /// past `rotary_dim / 2` (and, on text, MRoPE pairs of no text section) are 0: the
    /// model's forward lays a head's dims out so that its rotary pairs come first.
    fn frequencies(&self, theta: f64, scaling: Option<&RopeScaling>) -> Vec<f32> {
        let (hd, rot) = (self.head_dim(), self.rotary_dim());
        (0..hd / 2)
            .map(|i| {
                if i >= rot / 2 || !self.mrope_text_pair(i) {
                    return 0.0;
                }
                let mut f = theta.powf(-(2.0 * i as f64) / rot as f64);
                if let Some(factors) = &self.rope_freq_factors {
                    f /= factors[i];
                }
                let Some(s) = scaling else {
                    return f as f32;
                };
                match s.rope_type.as_str() {
                    "linear" => return (f / s.factor) as f32,
                    "yarn" => return self.yarn(s, i, f) as f32,
                    _ => {}
                }
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

impl ModelConfig {
    /// YaRN's frequency of rotary pair `i` (unscaled `f`): pairs that turn more than
    /// `beta_fast` times over the original context keep `f`, those below `beta_slow` take
    /// `f / factor`, a linear ramp between (llama.cpp's `rope_yarn`; ends rounded out to
    /// whole pairs unless `truncate` is false, as Hugging Face reads GPT-OSS's config).
    fn yarn(&self, s: &RopeScaling, i: usize, f: f64) -> f64 {
        let dims = self.rotary_dim() as f64;
        // The pair index at which a frequency turns `rotations` times over the context.
        let pair = |rotations: f64| {
            let base = self.rope_theta;
            dims * (s.original_max_position_embeddings / (rotations * 2.0 * std::f64::consts::PI))
                .ln()
                / (2.0 * base.ln())
        };
        let (mut low, mut high) = (pair(s.beta_fast), pair(s.beta_slow));
        if s.truncate {
            (low, high) = (low.floor().max(0.0), high.ceil().min(dims - 1.0));
        }
        let ramp = ((i as f64 - low) / (high - low).max(0.001)).clamp(0.0, 1.0);
        // Extrapolated (kept) where the ramp is 0, interpolated (divided) where it is 1.
        f * (1.0 - ramp) + f / s.factor * ramp
    }

    /// Whether rotary pair `i` rotates by a text token's position under interleaved MRoPE
    /// (llama.cpp's `GGML_ROPE_TYPE_IMROPE`, positions `[p, p, p, 0]`): sector `i mod Σ`
    /// belongs to section `sector mod 3` while `sector < 3 · section`, else to the fourth.
    fn mrope_text_pair(&self, i: usize) -> bool {
        let Some(s) = &self.mrope_section else {
            return true;
        };
        let sec = |k: usize| s.get(k).copied().unwrap_or(0);
        let sector = i % s.iter().sum::<usize>();
        sector < 3 * sec(sector % 3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOL: &str = r#"{"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30,
        "vocab_size": 49152, "rope_theta": 10000.0, "tie_word_embeddings": true, "extra": 1}"#;

    #[test]
    fn rope_freq_factors_divide_the_frequencies_and_qwen3_has_qk_norms() {
        let mut v: serde_json::Value = serde_json::from_str(SMOL).unwrap();
        let factors: Vec<f64> = (0..32).map(|i| 1.0 + i as f64 / 8.0).collect();
        v["rope_freq_factors"] = factors.clone().into();
        let c = ModelConfig::parse(&v.to_string()).unwrap();
        for (i, (got, f)) in c.inv_freq().iter().zip(&factors).enumerate() {
            assert_eq!(*got, (10000f64.powf(-(2.0 * i as f64) / 64.0) / f) as f32);
        }
        v["rope_freq_factors"] = vec![1.0; 31].into();
        let e = ModelConfig::parse(&v.to_string()).unwrap_err().to_string();
        assert!(e.contains("31 values for head_dim 64"), "{e}");
        let q3 = ModelConfig::parse(&SMOL.replace("\"llama\"", "\"qwen3\"")).unwrap();
        assert!(q3.qk_norm() && !q3.qkv_bias());
        assert!(!ModelConfig::parse(SMOL).unwrap().qk_norm());
    }

    #[test]
    fn granite_configs_read_mamba_layers_multipliers_and_no_positions() {
        let granite = r#"{"model_type": "granitemoehybrid", "gguf_converted": true,
            "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 300,
            "layer_types": ["mamba", "attention", "mamba"], "mamba_d_conv": 4,
            "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 16,
            "position_embedding_type": "nope", "embedding_multiplier": 12.0,
            "residual_multiplier": 0.25, "attention_multiplier": 0.0078125,
            "logits_scaling": 4.0}"#;
        let c = ModelConfig::parse(granite).unwrap();
        assert_eq!(
            (c.arch(), c.activation()),
            (Arch::GraniteHybrid, Activation::Silu)
        );
        let m = c.ssm(3).unwrap().unwrap();
        assert_eq!((m.heads, m.head_dim, m.state, m.width), (8, 16, 16, 4));
        assert_eq!(m.layers.iter().collect::<Vec<_>>(), [0, 2]);
        assert_eq!(c.ssm(1).unwrap().unwrap().layers.len(), 1);
        assert_eq!(
            (
                c.embed_scale(),
                c.residual_scale(),
                c.attn_scale(),
                c.logit_divisor()
            ),
            (Some(12.0), Some(0.25), 0.0078125, Some(4.0))
        );
        // No positional encoding: no pair turns.
        assert_eq!(c.rotary_dim(), 0);
        assert!(c.inv_freq().iter().all(|&f| f == 0.0));
        let e = ModelConfig::parse(&granite.replace("\"gguf_converted\": true,", ""));
        assert!(e.unwrap_err().to_string().contains("GGUF files only"));
        let e = ModelConfig::parse(&granite.replace("0.25", "-0.25")).unwrap_err();
        assert!(e.to_string().contains("residual_multiplier"), "{e}");
        let e = ModelConfig::parse(&granite.replace("\"nope\"", "\"alibi\"")).unwrap_err();
        assert!(
            e.to_string().contains("position_embedding_type 'alibi'"),
            "{e}"
        );
    }

    #[test]
    fn parses_hf_configs() {
        let c = ModelConfig::parse(SMOL).unwrap();
        assert_eq!((c.head_dim(), c.kv_heads(), c.qkv_bias()), (64, 3, false));
        assert_eq!(c.inv_freq().len(), 32);
        assert_eq!(c.inv_freq()[0], 1.0);
        let q = ModelConfig::parse(&SMOL.replace("\"llama\"", "\"qwen2\"")).unwrap();
        assert!(q.qkv_bias());
        let e = ModelConfig::parse(&SMOL.replace("\"llama\"", "\"gpt2\"")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "unsupported architecture 'gpt2' (supported: llama, mistral, qwen2, qwen3, \
             qwen3_moe, gpt_oss, gemma3_text, lfm2, qwen3_5_text, granitemoehybrid)"
        );
        let e = ModelConfig::parse(
            &SMOL.replace("\"num_key_value_heads\": 3", "\"num_key_value_heads\": 4"),
        )
        .unwrap_err();
        let says =
            "inconsistent shape: num_attention_heads is not a multiple of num_key_value_heads";
        assert!(e.to_string().contains(says), "{e}");
        assert!(ModelConfig::parse("{").is_err());
    }

    #[test]
    fn unsupported_or_invalid_values_are_refused_naming_them() {
        let with = |key: &str, value: serde_json::Value| {
            let mut v: serde_json::Value = serde_json::from_str(SMOL).unwrap();
            v[key] = value;
            ModelConfig::parse(&v.to_string())
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
    fn sliding_windows_are_read_per_layer() {
        use LayerAttention::{Full, Sliding};
        let with = |extra: &str, ty: &str| {
            ModelConfig::parse(&SMOL.replace("\"extra\": 1", extra).replace("\"llama\"", ty))
                .unwrap()
        };
        let w = Sliding { window: 4096 };
        assert_eq!(
            with("\"sliding_window\": 4096", "\"mistral\"").attention,
            [w; 30]
        );
        assert_eq!(
            with("\"sliding_window\": null", "\"mistral\"").attention,
            [Full; 30]
        );
        // Qwen2 ships a window it does not use unless told to.
        let q = with("\"sliding_window\": 4096", "\"qwen2\"");
        assert_eq!(
            (&q.attention[..], q.sliding(30).unwrap()),
            (&[Full; 30][..], None)
        );
        let q = with(
            "\"sliding_window\": 4096, \"use_sliding_window\": true, \"max_window_layers\": 28",
            "\"qwen2\"",
        );
        assert_eq!(q.attention[27..], [Full, w, w]);
        assert_eq!(
            q.sliding(28).unwrap(),
            None,
            "a 28-layer view has no sliding layer"
        );
        let s = q.sliding(30).unwrap().unwrap();
        assert_eq!(
            (s.window, s.layers.iter().collect::<Vec<_>>()),
            (4096, vec![28, 29])
        );
    }

    /// Qwen3-30B-A3B's config.json (fields this kit reads).
    const QWEN3_MOE: &str = r#"{"model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": true, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_hidden_layers": 48, "vocab_size": 151936,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "hidden_act": "silu"}"#;

    #[test]
    fn qwen3_moe_configs_read_their_experts_and_sparse_layers() {
        let c = ModelConfig::parse(QWEN3_MOE).unwrap();
        let e = c.experts().unwrap();
        assert_eq!(
            (e.count, e.per_token, e.width, e.renormalize),
            (128, 8, 768, true)
        );
        assert!(c.qk_norm() && (0..48).all(|l| c.sparse_layer(l)));
        let mut v: serde_json::Value = serde_json::from_str(QWEN3_MOE).unwrap();
        v["decoder_sparse_step"] = 2.into();
        v["mlp_only_layers"] = serde_json::json!([3]);
        let c = ModelConfig::parse(&v.to_string()).unwrap();
        let sparse: Vec<usize> = (0..8).filter(|&l| c.sparse_layer(l)).collect();
        assert_eq!(sparse, [1, 5, 7]);
        assert!(!ModelConfig::parse(SMOL).unwrap().sparse_layer(0));
        for (key, value, says) in [
            (
                "num_experts_per_tok",
                129,
                "must be between 1 and num_experts 128",
            ),
            ("num_experts_per_tok", 0, "must be between 1"),
            ("num_experts", 1 << 20, "outside the limits"),
        ] {
            let mut v: serde_json::Value = serde_json::from_str(QWEN3_MOE).unwrap();
            v[key] = value.into();
            let e = ModelConfig::parse(&v.to_string()).unwrap_err().to_string();
            assert!(e.contains(says), "{key}: {e}");
        }
        let e = ModelConfig::parse(&SMOL.replace("\"extra\": 1", "\"num_experts\": 8"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("num_experts is not supported for llama"), "{e}");
        let mut v: serde_json::Value = serde_json::from_str(QWEN3_MOE).unwrap();
        v.as_object_mut().unwrap().remove("num_experts");
        assert!(ModelConfig::parse(&v.to_string()).is_err());
    }

    /// GPT-OSS-20B's config.json (fields this kit reads), as the GGUF reader derives it.
    const GPT_OSS: &str = r#"{"model_type": "gpt_oss", "gguf_converted": true,
        "hidden_size": 2880, "intermediate_size": 2880, "num_local_experts": 32,
        "num_experts_per_tok": 4, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_hidden_layers": 4, "vocab_size": 201088, "attention_bias": true,
        "rope_theta": 150000.0, "rms_norm_eps": 1e-05, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
        "full_attention"], "rope_scaling": {"rope_type": "yarn", "factor": 32.0,
        "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096,
        "truncate": true}}"#;

    #[test]
    fn gpt_oss_configs_read_experts_windows_and_yarn() {
        let c = ModelConfig::parse(GPT_OSS).unwrap();
        let e = c.experts().unwrap();
        assert_eq!(
            (e.count, e.per_token, e.width, e.gating),
            (32, 4, 2880, Gating::TopKSoftmax)
        );
        assert_eq!(
            e.activation,
            Activation::SwigluOai {
                alpha: 1.702,
                limit: 7.0
            }
        );
        assert!(c.o_bias_and_sinks() && c.qkv_bias() && c.sparse_layer(3));
        let s = c.sliding(4).unwrap().unwrap();
        assert_eq!(
            (s.window, s.layers.iter().collect::<Vec<_>>()),
            (128, vec![0, 2])
        );
        // Pair 0 turns fastest: kept; the last pair turns slowest: divided by the factor.
        let (yarn, plain) = (
            c.inv_freq(),
            ModelConfig {
                rope_scaling: None,
                ..c.clone()
            }
            .inv_freq(),
        );
        assert_eq!(yarn[0], plain[0]);
        assert_eq!(yarn[31], (f64::from(plain[31]) / 32.0) as f32);
        let m = 1.0 + 0.1 * 32f64.ln();
        assert_eq!(c.attn_scale(), (m * m / 8.0) as f32);
        let e = ModelConfig::parse(&GPT_OSS.replace("\"gguf_converted\": true,", ""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("GGUF files only"), "{e}");
        // Other families' YaRN is read where its magnitude is stated (a GGUF's index states
        // llama.cpp's); their unstated defaults are not read yet: refused.
        let yarn = |extra: &str| {
            SMOL.replace(
                "\"extra\": 1",
                &format!(r#""rope_scaling": {{"rope_type": "yarn", "factor": 4.0{extra}}}"#),
            )
        };
        let e = ModelConfig::parse(&yarn("")).unwrap_err().to_string();
        assert!(e.contains("or with its attention_factor stated"), "{e}");
        let c = ModelConfig::parse(&yarn(r#", "attention_factor": 1.25"#)).unwrap();
        assert_eq!(c.rope_magnitude(), 1.25);
        let e = ModelConfig::parse(&yarn(r#", "attention_factor": 0"#))
            .unwrap_err()
            .to_string();
        assert!(e.contains("rope_scaling.attention_factor"), "{e}");
    }

    /// LFM2-350M's config.json as Liquid AI publishes it (fields this kit reads).
    const LFM2: &str = r#"{"model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"],
        "hidden_size": 1024, "intermediate_size": 6656, "block_ff_dim": 6656,
        "block_auto_adjust_ff_dim": true, "block_ffn_dim_multiplier": 1.0,
        "block_multiple_of": 256, "conv_L_cache": 3, "norm_eps": 1e-05,
        "num_attention_heads": 16, "num_key_value_heads": 8, "num_hidden_layers": 16,
        "rope_theta": 1000000.0, "tie_embedding": true, "vocab_size": 65536,
        "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "full_attention",
        "conv", "conv", "full_attention", "conv", "full_attention", "conv", "full_attention",
        "conv", "full_attention", "conv"]}"#;

    #[test]
    fn lfm2_configs_read_conv_layers_and_the_derived_mlp_width() {
        let c = ModelConfig::parse(LFM2).unwrap();
        assert_eq!(
            (c.arch(), c.activation(), c.qk_norm(), c.tie_word_embeddings),
            (Arch::Lfm2, Activation::Silu, true, true)
        );
        // 2/3 of 6656 = 4437, rounded up to a multiple of 256: llama.cpp's 350M size.
        assert_eq!((c.intermediate_size, c.rms_norm_eps), (4608, 1e-5));
        let conv = c.conv(16).unwrap().unwrap();
        assert_eq!((conv.width, conv.channels), (3, 1024));
        assert_eq!(
            conv.layers.iter().collect::<Vec<_>>(),
            [0, 1, 3, 4, 6, 7, 9, 11, 13, 15]
        );
        assert_eq!(c.sliding(16).unwrap(), None);
        assert_eq!(c.conv(2).unwrap().unwrap().layers.len(), 2);
        // The usual names win where both are given; convolution biases are refused.
        let both = LFM2.replace(
            "\"tie_embedding\": true",
            "\"tie_embedding\": true, \"tie_word_embeddings\": false, \"rms_norm_eps\": 1e-6",
        );
        let c = ModelConfig::parse(&both).unwrap();
        assert_eq!((c.tie_word_embeddings, c.rms_norm_eps), (false, 1e-6));
        let biased = LFM2.replace("\"conv_L_cache\"", "\"conv_bias\": true, \"conv_L_cache\"");
        let e = ModelConfig::parse(&biased).unwrap_err().to_string();
        assert!(e.contains("conv_bias"), "{e}");
    }

    /// Gemma 3 270M's config.json as Hugging Face publishes it (fields this kit reads).
    const GEMMA3: &str = r#"{"model_type": "gemma3_text", "hidden_size": 640,
        "intermediate_size": 2048, "num_attention_heads": 4, "num_key_value_heads": 1,
        "num_hidden_layers": 18, "vocab_size": 262144, "head_dim": 256,
        "query_pre_attn_scalar": 256, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "sliding_window": 512, "rms_norm_eps": 1e-06, "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": null, "attn_logit_softcapping": null,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
        "sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
        "sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention",
        "full_attention", "sliding_attention", "sliding_attention", "sliding_attention",
        "sliding_attention", "sliding_attention", "full_attention"]}"#;

    #[test]
    fn gemma3_configs_select_the_gemma_graph() {
        let c = ModelConfig::parse(GEMMA3).unwrap();
        assert_eq!(
            (c.arch(), c.activation(), c.tie_word_embeddings),
            (Arch::Gemma3, Activation::GeluTanh, true)
        );
        assert_eq!(c.attn_scale(), 1.0 / 16.0);
        assert_eq!(c.embed_scale(), Some(640f32.sqrt()));
        assert_eq!(c.inv_freq()[1], 1e6f64.powf(-2.0 / 256.0) as f32);
        assert_eq!(c.inv_freq_local()[1], 1e4f64.powf(-2.0 / 256.0) as f32);
        let s = c.sliding(18).unwrap().unwrap();
        let full: Vec<usize> = (0..18).filter(|&l| !s.layers.contains(l)).collect();
        assert_eq!((s.window, full), (512, vec![5, 11, 17]));
        // Left out, the fields take Gemma3TextConfig's defaults (pattern 6, window 4096).
        let bare = ModelConfig::parse(
            r#"{"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 6,
            "vocab_size": 32}"#,
        )
        .unwrap();
        assert_eq!(
            (bare.head_dim(), bare.rope_theta, bare.rope_local_base_freq),
            (256, 1e6, Some(1e4))
        );
        let s = bare.sliding(6).unwrap().unwrap();
        assert_eq!((s.window, s.layers.len()), (4096, 5));
        let linear = ModelConfig::parse(&GEMMA3.replace(
            "\"rope_theta\"",
            "\"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": 8.0}, \"rope_theta\"",
        ))
        .unwrap();
        assert_eq!(
            linear.inv_freq()[1],
            c.inv_freq()[1] / 8.0,
            "global layers scale"
        );
        assert_eq!(
            linear.inv_freq_local(),
            c.inv_freq_local(),
            "local layers do not"
        );
        let capped = GEMMA3.replace(
            "\"final_logit_softcapping\": null",
            "\"final_logit_softcapping\": 30.0",
        );
        let e = ModelConfig::parse(&capped).unwrap_err().to_string();
        assert!(
            e.contains("final_logit_softcapping 30 is not supported"),
            "{e}"
        );
        let e = ModelConfig::parse(&GEMMA3.replace("gelu_pytorch_tanh", "silu"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("hidden_activation 'silu' is not supported"),
            "{e}"
        );
    }

    #[test]
    fn llama3_scaling_divides_low_frequencies_only() {
        let c = ModelConfig::parse(&SMOL.replace(
            "\"rope_theta\": 10000.0",
            r#""rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#,
        ))
        .unwrap();
        let plain = ModelConfig {
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
