//! GGUF files (`llama` — Llama 2/3.x, Mistral, SmolLM —, `qwen2`, `qwen3`, `qwen3moe`,
//! `gpt-oss`, `gemma3`, `lfm2`, `qwen35`, `granitehybrid`).
//!
//! [`resolve_model`] (what `--model FILE.gguf` does): the weights stay in the GGUF and are
//! used where they lie, in their stored types (quantized blocks included). It derives a small
//! directory, cached under [`cache_dir`]: `config.json`, the tokenizer files, and
//! [`gguf.json`](kvplug_core::gguf_index) — where each Hugging Face–named tensor lies in the
//! file, and what llama.cpp's converter changed (Llama's q/k rows permuted into interleaved
//! rotary pairs; Gemma's `+ 1` folded into its RMSNorm weights).
//!
//! [`import`] (`kvplug model import`, an explicit conversion): the GGUF becomes a Hugging
//! Face–style directory (`model.safetensors` — matrices dequantized to f16, vectors in f32 —
//! with `kv_cache.*` metadata), the converter's changes undone.
//!
//! The container is read by `formats::gguf_file` (kvplug's own reader: candle's refuses files
//! with MXFP4 tensors and trusts claimed lengths); the block formats are dequantized by
//! candle's reference code for `import`. This module maps names and metadata.
//!
//! Tokenizers: byte-level BPE (`tokenizer.ggml.model = gpt2`) from the vocabulary and merges;
//! SentencePiece BPE (`llama`, as Gemma ships it) from the vocabulary and scores — the merge
//! of two adjacent pieces ranks by the score of the piece they make, which is how
//! SentencePiece (and llama.cpp's SPM tokenizer) picks the next merge — with byte fallback
//! and `▁` for spaces.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::error::{fail, Context, Result};
use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::GgmlDType;
use candle_core::Device;
use half::f16;
use kvplug_core::files::open_regular;

use super::gguf_file::{ggml_type, GgufFile};
use safetensors::tensor::{Dtype, TensorView};
use sha2::{Digest, Sha256};

/// Reads a GGUF header and its metadata.
struct Gguf {
    path: PathBuf,
    file: GgufFile,
}

impl Gguf {
    /// Reads the header; every tensor lies inside the file ([`GgufFile::read`]).
    fn open(path: &Path) -> Result<Self> {
        Ok(Gguf {
            path: path.to_path_buf(),
            file: GgufFile::read(path)?,
        })
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.file.metadata.get(key)
    }

    fn has_tensor(&self, name: &str) -> bool {
        self.file.tensors.contains_key(name)
    }

    fn string(&self, key: &str) -> Result<&str> {
        self.get(key)
            .with_context(|| format!("{}: metadata '{key}' is missing", self.path.display()))?
            .to_string()
            .map(String::as_str)
            .map_err(|e| {
                crate::Error::Model(format!("{}: metadata '{key}': {e}", self.path.display()))
            })
    }

    fn uint(&self, key: &str) -> Result<u64> {
        let v = self
            .get(key)
            .with_context(|| format!("{}: metadata '{key}' is missing", self.path.display()))?;
        as_u64(v)
            .with_context(|| format!("{}: metadata '{key}' is not a count", self.path.display()))
    }

    /// A count, `None` when absent; a value that is no count (a negative number, a string,
    /// an array) is refused by key rather than read as absent.
    fn uint_opt(&self, key: &str) -> Result<Option<u64>> {
        self.get(key).map(|_| self.uint(key)).transpose()
    }

    /// A string, `None` when absent; a value of another type is refused by key.
    fn string_opt(&self, key: &str) -> Result<Option<&str>> {
        self.get(key).map(|_| self.string(key)).transpose()
    }

    /// A number, `None` when absent; a NaN or infinity is refused by key.
    fn float(&self, key: &str) -> Result<Option<f64>> {
        let x = match self.get(key) {
            None => return Ok(None),
            // The f32's shortest decimal (1e-5, not 9.99999974e-6).
            Some(Value::F32(x)) => x.to_string().parse().ok(),
            Some(Value::F64(x)) => Some(*x),
            Some(v) => as_u64(v).map(|x| x as f64),
        };
        match x {
            Some(x) if !x.is_finite() => Err(crate::Error::Model(format!(
                "{}: metadata '{key}' is {x}, not a finite number",
                self.path.display()
            ))),
            x => Ok(x),
        }
    }

    /// A count per layer: an array of counts, or one count for every layer.
    fn uints(&self, key: &str) -> Result<Vec<u64>> {
        let v = self
            .get(key)
            .with_context(|| format!("{}: metadata '{key}' is missing", self.path.display()))?;
        if let Some(n) = as_u64(v) {
            let layers = self.uint(&format!(
                "{}.block_count",
                self.string("general.architecture")?
            ))?;
            return Ok(vec![
                n;
                layers.min(kvplug_core::limits::MAX_LAYERS as u64 + 1)
                    as usize
            ]);
        }
        v.to_vec()
            .map_err(|e| crate::Error::Model(format!("{key}: {e}")))?
            .iter()
            .map(|n| {
                as_u64(n).with_context(|| {
                    format!(
                        "{}: metadata '{key}' holds a non-count",
                        self.path.display()
                    )
                })
            })
            .collect()
    }

    fn strings(&self, key: &str) -> Result<Vec<String>> {
        let v = self
            .get(key)
            .with_context(|| format!("{}: metadata '{key}' is missing", self.path.display()))?;
        v.to_vec()
            .map_err(|e| crate::Error::Model(format!("{key}: {e}")))?
            .iter()
            .map(|s| {
                s.to_string()
                    .cloned()
                    .map_err(|e| crate::Error::Model(format!("{key}: {e}")))
            })
            .collect()
    }

    /// One tensor as f32, row-major in Hugging Face's `[rows, cols]` order (dequantized by
    /// candle's reference code: types candle reads only).
    fn tensor(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let at = |e: String| {
            crate::Error::Model(format!("{}: tensor '{name}': {e}", self.path.display()))
        };
        let info = self
            .file
            .tensors
            .get(name)
            .ok_or_else(|| at("missing".into()))?;
        let dtype = candle_type(info.ggml_type).ok_or_else(|| {
            let type_name = ggml_type(info.ggml_type).map_or("unknown", |t| t.2);
            at(format!("kvplug cannot dequantize {type_name} tensors"))
        })?;
        let mut raw = vec![0u8; info.bytes() as usize];
        let mut f = open_regular(&self.path)?.0;
        f.seek(SeekFrom::Start(self.file.data_offset + info.offset))?;
        f.read_exact(&mut raw)?;
        let q = candle_core::quantized::ggml_file::qtensor_from_ggml(
            dtype,
            &raw,
            info.dims.clone(),
            &Device::Cpu,
        )
        .map_err(|e| at(e.to_string()))?;
        let dims = q.shape().dims().to_vec();
        let t = q
            .dequantize(&Device::Cpu)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| {
                crate::Error::Model(format!(
                    "{}: dequantizing '{name}': {e}",
                    self.path.display()
                ))
            })?;
        Ok((dims, t))
    }
}

fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::U8(x) => Some(*x as u64),
        Value::U16(x) => Some(*x as u64),
        Value::U32(x) => Some(*x as u64),
        Value::U64(x) => Some(*x),
        Value::I8(x) => u64::try_from(*x).ok(),
        Value::I16(x) => u64::try_from(*x).ok(),
        Value::I32(x) => u64::try_from(*x).ok(),
        Value::I64(x) => u64::try_from(*x).ok(),
        _ => None,
    }
}

/// The architectures this module reads.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    GptOss,
    Gemma3,
    Lfm2,
    Qwen35,
    GraniteHybrid,
}

/// Gemma's chat template (text turns) for a `gemma3` GGUF that ships none: Google's
/// template as published with the Gemma 3 instruction-tuned models, images left out.
const GEMMA_TEMPLATE: &str = "{{ bos_token }}\
{%- if messages[0]['role'] == 'system' -%}\
{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\
{%- set loop_messages = messages[1:] -%}\
{%- else -%}\
{%- set first_user_prefix = '' -%}\
{%- set loop_messages = messages -%}\
{%- endif -%}\
{%- for message in loop_messages -%}\
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\
{%- endif -%}\
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\
{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}\
{{- message['content'] | trim }}{{ '<end_of_turn>\n' }}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}";

impl Gguf {
    fn arch(&self) -> Result<Arch> {
        match self.string("general.architecture")? {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            "qwen3moe" => Ok(Arch::Qwen3Moe),
            "gpt-oss" => Ok(Arch::GptOss),
            "gemma3" => Ok(Arch::Gemma3),
            "lfm2" => Ok(Arch::Lfm2),
            "qwen35" => Ok(Arch::Qwen35),
            "granitehybrid" => Ok(Arch::GraniteHybrid),
            other => fail!(
                Model,
                "{}: architecture '{other}' is not supported (supported: llama, qwen2, qwen3, \
                 qwen3moe, gpt-oss, gemma3, lfm2, qwen35, granitehybrid)",
                self.path.display()
            ),
        }
    }
}

/// The architecture facts of a GGUF, as `config.json` wants them.
fn config_json(g: &Gguf, tied: bool) -> Result<serde_json::Value> {
    let arch = g.arch()?;
    let name = g.string("general.architecture")?;
    let k = |s: &str| format!("{name}.{s}");
    let heads = g.uint(&k("attention.head_count"))?;
    let hidden = g.uint(&k("embedding_length"))?;
    let layers = g.uint(&k("block_count"))?;
    // Bounded before any per-layer list is made from it.
    let max_layers = kvplug_core::limits::MAX_LAYERS as u64;
    if layers > max_layers {
        fail!(
            Model,
            "{}: {layers} layers (block_count) is above the limit of {max_layers}",
            g.path.display()
        );
    }
    // Qwen3.5's multi-token-prediction blocks follow its layers (`nextn_predict_layers`,
    // counted in `block_count`): llama.cpp's graph runs the layers before them, as here.
    let layers = match arch {
        Arch::Qwen35 => {
            let nextn = g.uint_opt(&k("nextn_predict_layers"))?.unwrap_or(0);
            if nextn >= layers {
                fail!(
                    Model,
                    "{}: {nextn} next-token prediction blocks (nextn_predict_layers) of \
                     {layers} leave no layer",
                    g.path.display()
                );
            }
            layers - nextn
        }
        _ => layers,
    };
    let vocab = match g.uint_opt(&k("vocab_size"))? {
        Some(v) => v,
        None => g.strings("tokenizer.ggml.tokens")?.len() as u64,
    };
    // A mixture of experts' file may leave the dense width out: its experts' width stands in.
    let ffn = match (g.uint_opt(&k("feed_forward_length"))?, arch) {
        (Some(ffn), _) => ffn,
        (None, Arch::Qwen3Moe | Arch::GptOss) => g.uint(&k("expert_feed_forward_length"))?,
        // Its "missing" error.
        (None, _) => g.uint(&k("feed_forward_length"))?,
    };
    let mut c = serde_json::json!({
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_attention_heads": heads,
        "num_key_value_heads": g.uint(&k("attention.head_count_kv")).unwrap_or(heads),
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
    });
    match arch {
        Arch::Lfm2 => {
            // Per layer KV heads: 0 marks a short-convolution layer (the converter's rule).
            let (kv, attn_kv) = per_layer_kv_heads(g, &k("attention.head_count_kv"), layers)?;
            if matches!(g.get(&k("attention.causal")), Some(Value::Bool(false))) {
                fail!(
                    Model,
                    "{}: a bidirectional (non-causal) LFM2 is an embedding model; kvplug runs \
                     causal decoders",
                    g.path.display()
                );
            }
            // As llama.cpp reads it: a positive window makes every attention layer slide.
            let window = g
                .uint_opt(&k("attention.sliding_window"))?
                .filter(|&w| w > 0);
            c["model_type"] = "lfm2".into();
            c["architectures"] = serde_json::json!(["Lfm2ForCausalLM"]);
            c["num_key_value_heads"] = attn_kv.unwrap_or(heads).into();
            c["layer_types"] = kv
                .iter()
                .map(|&n| match (n, window) {
                    (0, _) => "conv",
                    (_, Some(_)) => "sliding_attention",
                    (_, None) => "full_attention",
                })
                .collect();
            if let Some(w) = window {
                c["sliding_window"] = w.into();
            }
            c["conv_L_cache"] = g.uint(&k("shortconv.l_cache"))?.into();
            c["rms_norm_eps"] = g
                .float(&k("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5)
                .into();
            c["rope_theta"] = g.float(&k("rope.freq_base"))?.unwrap_or(1e6).into();
            rope_scaling_fields(g, &mut c, &k, &[])?;
        }
        Arch::Qwen35 => qwen35_fields(g, &mut c, layers)?,
        Arch::GraniteHybrid => granite_hybrid_fields(g, &mut c, layers)?,
        Arch::GptOss => gpt_oss_fields(g, &mut c, layers)?,
        Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe => {
            let (model_type, class) = match arch {
                Arch::Qwen2 => ("qwen2", "Qwen2ForCausalLM"),
                Arch::Qwen3 => ("qwen3", "Qwen3ForCausalLM"),
                Arch::Qwen3Moe => ("qwen3_moe", "Qwen3MoeForCausalLM"),
                _ => ("llama", "LlamaForCausalLM"),
            };
            if arch == Arch::Llama {
                // What llama.cpp's llama graph also runs and kvplug does not: refused, not
                // run without it.
                if g.uint_opt(&k("expert_count"))?.is_some_and(|n| n > 0) {
                    fail!(
                        Model,
                        "{}: a llama mixture of experts (Mixtral's expert_count) is not \
                         supported",
                        g.path.display()
                    );
                }
                if let Some(name) = g.file.tensors.keys().find(|n| n.ends_with(".bias")) {
                    fail!(
                        Model,
                        "{}: tensor '{name}': biases on a llama model's projections are not \
                         supported",
                        g.path.display()
                    );
                }
            }
            if arch == Arch::Qwen3Moe {
                // llama.cpp's qwen3moe graph: every layer sparse, the chosen experts'
                // softmax probabilities renormalized.
                c["num_experts"] = g.uint(&k("expert_count"))?.into();
                c["num_experts_per_tok"] = g.uint(&k("expert_used_count"))?.into();
                c["moe_intermediate_size"] = g.uint(&k("expert_feed_forward_length"))?.into();
                c["norm_topk_prob"] = true.into();
            }
            c["model_type"] = model_type.into();
            c["architectures"] = serde_json::json!([class]);
            c["rms_norm_eps"] = g
                .float(&k("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5)
                .into();
            c["rope_theta"] = g.float(&k("rope.freq_base"))?.unwrap_or(10000.0).into();
            rope_scaling_fields(g, &mut c, &k, &["linear", "yarn"])?;
            // Llama 3.x: the converter turns rope_scaling into per-pair frequency divisors.
            if g.has_tensor("rope_freqs.weight") {
                let (_, f) = g.tensor("rope_freqs.weight")?;
                c["rope_freq_factors"] = f.iter().map(|&x| x as f64).collect();
            }
        }
        Arch::Gemma3 => {
            // llama.cpp's gemma3 graph: local layers use RoPE base 10000 and every sixth
            // layer is global; attention scale is key_length^-1/2 (query_pre_attn_scalar),
            // but (hidden / heads)^-1/2 for the 62-layer model (Gemma 3 27B: 168, its
            // query_pre_attn_scalar, where its heads are 128 wide), as llama.cpp tells it by
            // its layer count.
            let window = g.uint(&k("attention.sliding_window"))?;
            let head_dim = g.uint(&k("attention.key_length"))?;
            let scalar = match layers {
                // No heads: refused by the config's check, not divided by here.
                62 => hidden.checked_div(heads).unwrap_or(head_dim),
                _ => head_dim,
            };
            c["model_type"] = "gemma3_text".into();
            c["architectures"] = serde_json::json!(["Gemma3ForCausalLM"]);
            c["rms_norm_eps"] = g
                .float(&k("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-6)
                .into();
            c["rope_theta"] = g.float(&k("rope.freq_base"))?.unwrap_or(1e6).into();
            c["rope_local_base_freq"] = 10000.0.into();
            c["query_pre_attn_scalar"] = scalar.into();
            c["hidden_activation"] = "gelu_pytorch_tanh".into();
            c["sliding_window"] = window.into();
            c["layer_types"] = (0..layers)
                .map(|i| {
                    if (i + 1) % 6 == 0 {
                        "full_attention"
                    } else {
                        "sliding_attention"
                    }
                })
                .collect();
            // Gemma 3's global layers alone scale (4B and up: linear, factor 8).
            rope_scaling_fields(g, &mut c, &k, &["linear"])?;
        }
    }
    // The rotating dims (a `llama` file must rotate all). The Qwen3.5 and Granite hybrids read
    // them above; LFM2 and GPT-OSS rotate every dim.
    if matches!(
        arch,
        Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3
    ) {
        let head_dim = g.uint_opt(&k("attention.key_length"))?;
        if let Some(head_dim) = head_dim.or(hidden.checked_div(heads)) {
            partial_rotary(
                g,
                &mut c,
                &k("rope.dimension_count"),
                head_dim,
                arch == Arch::Llama,
            )?;
        }
    }
    // A context length of 0 states nothing.
    if let Some(n) = g.uint_opt(&k("context_length"))?.filter(|&n| n > 0) {
        c["max_position_embeddings"] = n.into();
    }
    if let Some(d) = g.uint_opt(&k("attention.key_length"))? {
        c["head_dim"] = d.into();
    }
    if let Some(id) = g.uint_opt("tokenizer.ggml.bos_token_id")? {
        c["bos_token_id"] = id.into();
    }
    // The tokens that end generation, as llama.cpp gathers them from the ids the file names:
    // its EOS, end-of-turn (`<|eot_id|>`) and end-of-message (Llama 3.1's `<|eom_id|>`,
    // which ends a tool call) tokens, and the fill-in-the-middle pad, repository and file
    // separators. Ids outside the vocabulary are left out, as llama.cpp ignores them.
    let mut ends = Vec::new();
    for key in [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
        "tokenizer.ggml.fim_pad_token_id",
        "tokenizer.ggml.fim_rep_token_id",
        "tokenizer.ggml.fim_sep_token_id",
    ] {
        if let Some(id) = g.uint_opt(key)?.filter(|&id| id < vocab) {
            if !ends.contains(&id) {
                ends.push(id);
            }
        }
    }
    match ends[..] {
        [] => {}
        [eos] => c["eos_token_id"] = eos.into(),
        _ => c["eos_token_id"] = ends.into(),
    }
    Ok(c)
}

/// GPT-OSS's facts (llama.cpp's `gpt-oss` keys) under Hugging Face's names, as llama.cpp's
/// graph reads them: sliding and full layers alternating (`attention.sliding_window_pattern`,
/// an array of flags or a period, default 2: even layers slide), biased attention with
/// sinks, YaRN from `rope.scaling.*` (beta 32 and 1, its ramp rounded to whole pairs), the
/// experts' width from `expert_feed_forward_length`. The weights stay as the converter
/// wrote them (`gguf_converted`).
fn gpt_oss_fields(g: &Gguf, c: &mut serde_json::Value, layers: u64) -> Result<()> {
    let k = |s: &str| format!("gpt-oss.{s}");
    let sliding: Vec<bool> = match g.get(&k("attention.sliding_window_pattern")) {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| matches!(v, Value::Bool(true)) || as_u64(v).is_some_and(|n| n != 0))
            .collect(),
        other => {
            let n = other.and_then(as_u64).unwrap_or(2);
            (0..layers).map(|l| n == 0 || l % n < n - 1).collect()
        }
    };
    if sliding.len() as u64 != layers {
        fail!(
            Model,
            "{}: {} sliding-layer flags for {layers} layers",
            g.path.display(),
            sliding.len()
        );
    }
    c["model_type"] = "gpt_oss".into();
    c["architectures"] = serde_json::json!(["GptOssForCausalLM"]);
    c["gguf_converted"] = true.into();
    c["attention_bias"] = true.into();
    c["sliding_window"] = g.uint(&k("attention.sliding_window"))?.into();
    c["layer_types"] = sliding
        .iter()
        .map(|&s| {
            if s {
                "sliding_attention"
            } else {
                "full_attention"
            }
        })
        .collect();
    c["num_local_experts"] = g.uint(&k("expert_count"))?.into();
    c["num_experts_per_tok"] = g.uint(&k("expert_used_count"))?.into();
    c["intermediate_size"] = g.uint(&k("expert_feed_forward_length"))?.into();
    c["rms_norm_eps"] = g
        .float(&k("attention.layer_norm_rms_epsilon"))?
        .unwrap_or(1e-5)
        .into();
    c["rope_theta"] = g.float(&k("rope.freq_base"))?.unwrap_or(150000.0).into();
    rope_scaling_fields(g, c, &k, &["yarn"])
}

/// `rope.scaling.*` (keys named by `k`) as `rope_scaling`, in the meaning llama.cpp gives
/// them, where `kinds` (this architecture's) holds its kind. The factor (`rope.scaling.factor`,
/// else the older `rope.scale_linear`; 0 or 1: none) divides every frequency unless the type
/// is `yarn`, whatever else the type says or where it is absent (llama.cpp's default type is
/// `linear`); `yarn` ramps from kept to divided pairs (beta 32 and 1, the ramp's ends
/// rounded to whole pairs, the original context `original_context_length`, else
/// `context_length`) and multiplies rotated q and k by `1 + 0.1·ln(factor)`, stated as the
/// `attention_factor`. An `attn_factor` other than 1 is refused.
fn rope_scaling_fields(
    g: &Gguf,
    c: &mut serde_json::Value,
    k: &dyn Fn(&str) -> String,
    kinds: &[&str],
) -> Result<()> {
    if let Some(f) = g
        .float(&k("rope.scaling.attn_factor"))?
        .filter(|&f| f != 1.0)
    {
        fail!(
            Model,
            "{}: rope.scaling.attn_factor {f} is not supported (1 only)",
            g.path.display()
        );
    }
    let factor = match g.float(&k("rope.scaling.factor"))? {
        Some(f) => Some(f),
        None => g.float(&k("rope.scale_linear"))?,
    }
    .filter(|&f| f != 0.0 && f != 1.0);
    let kind = match (g.string_opt(&k("rope.scaling.type"))?, factor) {
        (None | Some("none" | "linear" | "yarn"), None) => return Ok(()),
        (Some("yarn"), Some(_)) => "yarn",
        (None | Some("none" | "linear"), Some(_)) => "linear",
        (Some(other), _) => other,
    };
    if !kinds.contains(&kind) {
        fail!(
            Model,
            "{}: rope scaling '{kind}' is not supported for {} ({})",
            g.path.display(),
            g.string("general.architecture")?,
            match kinds {
                [] => "none".to_string(),
                _ => kinds.join(", "),
            }
        );
    }
    let factor = factor.expect("a kind to apply comes with a factor");
    c["rope_scaling"] = match kind {
        "yarn" => {
            let original = match g.uint_opt(&k("rope.scaling.original_context_length"))? {
                Some(n) => n,
                None => g.uint(&k("context_length"))?,
            };
            serde_json::json!({"rope_type": "yarn", "factor": factor,
                "original_max_position_embeddings": original, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": true,
                "attention_factor": if factor > 1.0 { 1.0 + 0.1 * factor.ln() } else { 1.0 }})
        }
        _ => serde_json::json!({"rope_type": kind, "factor": factor}),
    };
    Ok(())
}

/// Qwen3.5's facts (llama.cpp's `qwen35` keys) under Hugging Face's names: which of its
/// `layers` (the blocks before its prediction blocks) run the delta rule
/// (`attention.recurrent_layers`, else all but every `full_attention_interval`-th), the
/// rule's heads, the partial rotary and its MRoPE sections. The weights stay as the
/// converter wrote them (`gguf_converted`).
fn qwen35_fields(g: &Gguf, c: &mut serde_json::Value, layers: u64) -> Result<()> {
    let k = |s: &str| format!("qwen35.{s}");
    let blocks = g.uint(&k("block_count"))?;
    let recurrent: Vec<bool> = match g.get(&k("attention.recurrent_layers")) {
        // One flag a layer, or one a block (the prediction blocks' left out).
        Some(Value::Array(a)) => {
            let a = match a.len() as u64 == blocks {
                true => &a[..layers as usize],
                false => &a[..],
            };
            a.iter()
                .map(|v| matches!(v, Value::Bool(true)) || as_u64(v).is_some_and(|n| n != 0))
                .collect()
        }
        _ => {
            let every = g
                .uint_opt(&k("full_attention_interval"))?
                .unwrap_or(4)
                .max(1);
            (0..layers).map(|i| (i + 1) % every != 0).collect()
        }
    };
    if recurrent.len() as u64 != layers {
        fail!(
            Model,
            "{}: {} recurrent-layer flags for {layers} layers",
            g.path.display(),
            recurrent.len()
        );
    }
    let head_dim = g.uint(&k("attention.key_length"))?;
    if let Some(v) = g.uint_opt(&k("attention.value_length"))? {
        if v != head_dim {
            fail!(
                Model,
                "{}: key_length {head_dim} and value_length {v} differ",
                g.path.display()
            );
        }
    }
    let state = g.uint(&k("ssm.state_size"))?;
    let v_heads = g.uint(&k("ssm.time_step_rank"))?;
    let inner = g.uint(&k("ssm.inner_size"))?;
    if inner != state * v_heads {
        fail!(
            Model,
            "{}: ssm.inner_size {inner} is not {v_heads} value heads of {state} (the rule's \
             key and value heads have one size)",
            g.path.display()
        );
    }
    c["model_type"] = "qwen3_5_text".into();
    c["architectures"] = serde_json::json!(["Qwen3_5ForCausalLM"]);
    c["gguf_converted"] = true.into();
    c["layer_types"] = recurrent
        .iter()
        .map(|&r| {
            if r {
                "linear_attention"
            } else {
                "full_attention"
            }
        })
        .collect();
    c["linear_conv_kernel_dim"] = g.uint(&k("ssm.conv_kernel"))?.into();
    c["linear_num_key_heads"] = g.uint(&k("ssm.group_count"))?.into();
    c["linear_num_value_heads"] = v_heads.into();
    c["linear_key_head_dim"] = state.into();
    c["linear_value_head_dim"] = state.into();
    partial_rotary(g, c, &k("rope.dimension_count"), head_dim, false)?;
    let sections = k("rope.dimension_sections");
    if g.get(&sections).is_some() {
        let sections = g.uints(&sections)?;
        if sections.iter().any(|&s| s > 0) {
            c["mrope_section"] = sections.into();
        }
    }
    c["rms_norm_eps"] = g
        .float(&k("attention.layer_norm_rms_epsilon"))?
        .unwrap_or(1e-6)
        .into();
    c["rope_theta"] = g.float(&k("rope.freq_base"))?.unwrap_or(1e7).into();
    rope_scaling_fields(g, c, &k, &[])?;
    Ok(())
}

/// Sets `partial_rotary_factor` from `key` (`<arch>.rope.dimension_count`, llama.cpp's
/// `n_rot`: the dims of each `head_dim`-wide head that rotate; all where absent). `whole`:
/// the architecture rotates every dim, so another count is refused (llama.cpp's rule for
/// `llama`). The config check refuses an odd count or one above the head.
fn partial_rotary(
    g: &Gguf,
    c: &mut serde_json::Value,
    key: &str,
    head_dim: u64,
    whole: bool,
) -> Result<()> {
    let rot = g.uint_opt(key)?.unwrap_or(head_dim);
    if whole && rot != head_dim {
        fail!(
            Model,
            "{}: {key} {rot} is not the head size {head_dim} (a llama model rotates every \
             dim of a head)",
            g.path.display()
        );
    }
    if head_dim > 0 {
        c["partial_rotary_factor"] = (rot as f64 / head_dim as f64).into();
    }
    Ok(())
}

/// A hybrid's per-layer KV head counts (`key`, one per layer; 0 marks a recurrent layer, the
/// converter's rule) and the one count its attention layers share (`None`: no attention
/// layer); refused when the list's length is not `layers` or the attention layers differ.
fn per_layer_kv_heads(g: &Gguf, key: &str, layers: u64) -> Result<(Vec<u64>, Option<u64>)> {
    let kv = g.uints(key)?;
    if kv.len() as u64 != layers {
        fail!(
            Model,
            "{}: {} per-layer KV head counts for {layers} layers",
            g.path.display(),
            kv.len()
        );
    }
    let attn_kv: Vec<u64> = kv.iter().copied().filter(|&n| n > 0).collect();
    if attn_kv.windows(2).any(|w| w[0] != w[1]) {
        fail!(
            Model,
            "{}: attention layers with different KV head counts {attn_kv:?}",
            g.path.display()
        );
    }
    Ok((kv, attn_kv.first().copied()))
}

/// Granite 4.0-H's facts (llama.cpp's `granitehybrid` keys) under Hugging Face's names, as
/// llama.cpp's graph reads them: a layer with 0 KV heads is a Mamba2 layer; its heads
/// (`ssm.time_step_rank`), groups, state and convolution; RoPE on `rope.dimension_count`
/// dims unless `rope.scaling.finetuned` is false (as Granite 4.0-H's files say); the four
/// multipliers. The mixture-of-experts sizes (`expert_count` > 0) and biases on the
/// attention or MLP projections (which llama.cpp would add) are refused.
fn granite_hybrid_fields(g: &Gguf, c: &mut serde_json::Value, layers: u64) -> Result<()> {
    let k = |s: &str| format!("granitehybrid.{s}");
    let (hidden, attn_heads) = (
        g.uint(&k("embedding_length"))?,
        g.uint(&k("attention.head_count"))?.max(1),
    );
    if g.uint_opt(&k("expert_count"))?.is_some_and(|n| n > 0) {
        fail!(
            Model,
            "{}: a Granite 4.0-H mixture of experts (tiny, small) is not supported; the dense \
             models (micro, 1b, 350m) are",
            g.path.display()
        );
    }
    let (kv, attn_kv) = per_layer_kv_heads(g, &k("attention.head_count_kv"), layers)?;
    let heads = g.uint(&k("ssm.time_step_rank"))?;
    let inner = g.uint(&k("ssm.inner_size"))?;
    if heads == 0 || inner % heads != 0 {
        fail!(
            Model,
            "{}: ssm.inner_size {inner} is not a multiple of {heads} heads",
            g.path.display()
        );
    }
    c["model_type"] = "granitemoehybrid".into();
    c["architectures"] = serde_json::json!(["GraniteMoeHybridForCausalLM"]);
    c["gguf_converted"] = true.into();
    if let Some(n) = attn_kv {
        c["num_key_value_heads"] = n.into();
    }
    c["layer_types"] = kv
        .iter()
        .map(|&n| if n == 0 { "mamba" } else { "attention" })
        .collect();
    c["mamba_d_conv"] = g.uint(&k("ssm.conv_kernel"))?.into();
    c["mamba_n_heads"] = heads.into();
    c["mamba_d_head"] = (inner / heads).into();
    c["mamba_n_groups"] = g.uint(&k("ssm.group_count"))?.into();
    c["mamba_d_state"] = g.uint(&k("ssm.state_size"))?.into();
    if let Some(name) = g
        .file
        .tensors
        .keys()
        .find(|n| n.ends_with(".bias") && !n.contains(".ssm_"))
    {
        fail!(
            Model,
            "{}: tensor '{name}': biases on Granite's attention or MLP projections are not \
             supported",
            g.path.display()
        );
    }
    let rope = !matches!(
        g.get(&k("rope.scaling.finetuned")),
        Some(Value::Bool(false))
    );
    c["position_embedding_type"] = if rope { "rope" } else { "nope" }.into();
    if rope {
        let head_dim = g
            .uint_opt(&k("attention.key_length"))?
            .unwrap_or(hidden / attn_heads);
        partial_rotary(g, c, &k("rope.dimension_count"), head_dim, false)?;
    }
    for (key, field) in [
        ("embedding_scale", "embedding_multiplier"),
        ("residual_scale", "residual_multiplier"),
        ("attention.scale", "attention_multiplier"),
        ("logit_scale", "logits_scaling"),
    ] {
        // llama.cpp reads 0 (or no key) as "no multiplier".
        if let Some(v) = g.float(&k(key))?.filter(|&v| v != 0.0) {
            c[field] = v.into();
        }
    }
    c["rms_norm_eps"] = g
        .float(&k("attention.layer_norm_rms_epsilon"))?
        .unwrap_or(1e-5)
        .into();
    c["rope_theta"] = g.float(&k("rope.freq_base"))?.unwrap_or(10000.0).into();
    rope_scaling_fields(g, c, &k, &[])?;
    Ok(())
}

/// llama.cpp's converter stores q/k rows of each head as (pairs interleaved) for its
/// rotary kernel; Hugging Face's rotate-half layout takes the first half, then the second.
/// Undo `reshape(heads, 2, hd/2, cols).swap(1, 2)`.
fn unpermute_rows(w: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let rows = w.len() / cols;
    let hd = rows / heads;
    let mut out = vec![0.0; w.len()];
    for h in 0..heads {
        for i in 0..hd / 2 {
            for j in 0..2 {
                // GGUF row h·hd + 2i + j holds HF row h·hd + j·hd/2 + i.
                let src = (h * hd + 2 * i + j) * cols;
                let dst = (h * hd + j * hd / 2 + i) * cols;
                out[dst..dst + cols].copy_from_slice(&w[src..src + cols]);
            }
        }
    }
    out
}

/// The GGUF tensor behind each Hugging Face weight name, for the layers of `config`.
fn tensor_names(
    arch: Arch,
    config: &serde_json::Value,
    tied: bool,
    conv_bias: &[usize],
) -> Vec<(String, String)> {
    let layers = config["num_hidden_layers"].as_u64().unwrap_or(0) as usize;
    if arch == Arch::Lfm2 {
        return lfm2_tensor_names(config, layers, tied);
    }
    let mut v = vec![
        (
            "token_embd.weight".into(),
            "model.embed_tokens.weight".into(),
        ),
        ("output_norm.weight".into(), "model.norm.weight".into()),
    ];
    if !tied {
        v.push(("output.weight".into(), "lm_head.weight".into()));
    }
    let common = [
        ("attn_norm", "input_layernorm"),
        ("attn_q", "self_attn.q_proj"),
        ("attn_k", "self_attn.k_proj"),
        ("attn_v", "self_attn.v_proj"),
        ("attn_output", "self_attn.o_proj"),
        ("ffn_gate", "mlp.gate_proj"),
        ("ffn_up", "mlp.up_proj"),
        ("ffn_down", "mlp.down_proj"),
    ];
    let own: &[(&str, &str)] = match arch {
        Arch::Llama => &[("ffn_norm", "post_attention_layernorm")],
        Arch::Qwen2 => &[("ffn_norm", "post_attention_layernorm")],
        Arch::Qwen3 | Arch::Qwen3Moe => &[
            ("ffn_norm", "post_attention_layernorm"),
            ("attn_q_norm", "self_attn.q_norm"),
            ("attn_k_norm", "self_attn.k_norm"),
        ],
        Arch::Gemma3 => &[
            ("attn_q_norm", "self_attn.q_norm"),
            ("attn_k_norm", "self_attn.k_norm"),
            ("post_attention_norm", "post_attention_layernorm"),
            ("ffn_norm", "pre_feedforward_layernorm"),
            ("post_ffw_norm", "post_feedforward_layernorm"),
        ],
        Arch::Qwen35 | Arch::GptOss => &[("post_attention_norm", "post_attention_layernorm")],
        Arch::GraniteHybrid => &[("ffn_norm", "post_attention_layernorm")],
        Arch::Lfm2 => unreachable!("lfm2_tensor_names names LFM2's tensors"),
    };
    // Qwen3.5's delta-rule layers hold `linear_attn.*` (kvplug's names where the
    // converter changed a tensor: `a` is `−exp(A_log)`), its attention layers q/k norms.
    let delta = [
        ("attn_qkv.weight", "linear_attn.in_proj_qkv.weight"),
        ("attn_gate.weight", "linear_attn.in_proj_z.weight"),
        ("ssm_beta.weight", "linear_attn.in_proj_b.weight"),
        ("ssm_alpha.weight", "linear_attn.in_proj_a.weight"),
        ("ssm_dt.bias", "linear_attn.dt_bias"),
        ("ssm_a", "linear_attn.a"),
        ("ssm_conv1d.weight", "linear_attn.conv1d.weight"),
        ("ssm_norm.weight", "linear_attn.norm.weight"),
        ("ssm_out.weight", "linear_attn.out_proj.weight"),
    ];
    let gated_attention = [
        ("attn_q_norm", "self_attn.q_norm"),
        ("attn_k_norm", "self_attn.k_norm"),
    ];
    // Granite 4.0-H's Mamba2 layers hold `mamba.*` (kvplug's names where the converter
    // changed a tensor: `a` is `−exp(A_log)`; the conv bias only where the file has one).
    let mamba = [
        ("ssm_in.weight", "mamba.in_proj.weight"),
        ("ssm_conv1d.weight", "mamba.conv1d.weight"),
        ("ssm_dt.bias", "mamba.dt_bias"),
        ("ssm_a", "mamba.a"),
        ("ssm_d", "mamba.D"),
        ("ssm_norm.weight", "mamba.norm.weight"),
        ("ssm_out.weight", "mamba.out_proj.weight"),
    ];
    for l in 0..layers {
        if arch == Arch::GraniteHybrid && config["layer_types"][l] == "mamba" {
            v.extend(
                mamba
                    .iter()
                    .chain(
                        conv_bias
                            .contains(&l)
                            .then_some(&("ssm_conv1d.bias", "mamba.conv1d.bias")),
                    )
                    .map(|(g, hf)| (format!("blk.{l}.{g}"), format!("model.layers.{l}.{hf}"))),
            );
            for (g, hf) in common[..1].iter().chain(&common[5..]).chain(own) {
                v.push((
                    format!("blk.{l}.{g}.weight"),
                    format!("model.layers.{l}.{hf}.weight"),
                ));
            }
            continue;
        }
        if arch == Arch::Qwen35 {
            let pairs: Vec<(&str, &str)> = if config["layer_types"][l] == "linear_attention" {
                v.extend(
                    delta
                        .iter()
                        .map(|(g, hf)| (format!("blk.{l}.{g}"), format!("model.layers.{l}.{hf}"))),
                );
                common[..1].iter().chain(&common[5..]).copied().collect()
            } else {
                common.iter().chain(&gated_attention).copied().collect()
            };
            for (g, hf) in pairs.iter().chain(own) {
                v.push((
                    format!("blk.{l}.{g}.weight"),
                    format!("model.layers.{l}.{hf}.weight"),
                ));
            }
            continue;
        }
        // A mixture of experts in place of the MLP: the router and the 3-D expert tensors
        // (`[experts, rows, cols]`; kvplug's names for the stacked form).
        let ffn: &[(&str, &str)] = if matches!(arch, Arch::Qwen3Moe | Arch::GptOss) {
            &[
                ("ffn_gate_inp", "mlp.gate"),
                ("ffn_gate_exps", "mlp.experts.gate_proj"),
                ("ffn_up_exps", "mlp.experts.up_proj"),
                ("ffn_down_exps", "mlp.experts.down_proj"),
            ]
        } else {
            &common[5..]
        };
        for (g, hf) in common[..5].iter().chain(ffn).chain(own) {
            v.push((
                format!("blk.{l}.{g}.weight"),
                format!("model.layers.{l}.{hf}.weight"),
            ));
        }
        if arch == Arch::GptOss {
            // Biases on q/k/v/o, the router and the experts; a sink per head.
            let biased = [
                ("attn_q", "self_attn.q_proj"),
                ("attn_k", "self_attn.k_proj"),
                ("attn_v", "self_attn.v_proj"),
                ("attn_output", "self_attn.o_proj"),
                ("ffn_gate_inp", "mlp.gate"),
                ("ffn_gate_exps", "mlp.experts.gate_proj"),
                ("ffn_up_exps", "mlp.experts.up_proj"),
                ("ffn_down_exps", "mlp.experts.down_proj"),
            ];
            for (g, hf) in biased {
                v.push((
                    format!("blk.{l}.{g}.bias"),
                    format!("model.layers.{l}.{hf}.bias"),
                ));
            }
            v.push((
                format!("blk.{l}.attn_sinks.weight"),
                format!("model.layers.{l}.self_attn.sinks"),
            ));
        }
        if arch == Arch::Qwen2 {
            for p in ["q", "k", "v"] {
                v.push((
                    format!("blk.{l}.attn_{p}.bias"),
                    format!("model.layers.{l}.self_attn.{p}_proj.bias"),
                ));
            }
        }
    }
    v
}

/// The layers whose Mamba2 convolution has a bias in the file (`blk.{l}.ssm_conv1d.bias`),
/// among the `config`'s.
fn conv_biases(g: &Gguf, config: &serde_json::Value) -> Vec<usize> {
    let layers = config["num_hidden_layers"].as_u64().unwrap_or(0) as usize;
    (0..layers)
        .filter(|l| g.has_tensor(&format!("blk.{l}.ssm_conv1d.bias")))
        .collect()
}

/// LFM2's names: its convolution layers hold `shortconv.*`, its attention layers q/k/v,
/// their norms and `out_proj`; the final norm is `token_embd_norm` (llama.cpp's name for
/// Hugging Face's `embedding_norm`).
fn lfm2_tensor_names(
    config: &serde_json::Value,
    layers: usize,
    tied: bool,
) -> Vec<(String, String)> {
    let mut v = vec![
        (
            "token_embd.weight".into(),
            "model.embed_tokens.weight".into(),
        ),
        (
            "token_embd_norm.weight".into(),
            "model.embedding_norm.weight".into(),
        ),
    ];
    if !tied {
        v.push(("output.weight".into(), "lm_head.weight".into()));
    }
    let common = [
        ("attn_norm", "operator_norm"),
        ("ffn_norm", "ffn_norm"),
        ("ffn_gate", "feed_forward.w1"),
        ("ffn_up", "feed_forward.w3"),
        ("ffn_down", "feed_forward.w2"),
    ];
    let attention = [
        ("attn_q", "self_attn.q_proj"),
        ("attn_k", "self_attn.k_proj"),
        ("attn_v", "self_attn.v_proj"),
        ("attn_output", "self_attn.out_proj"),
        ("attn_q_norm", "self_attn.q_layernorm"),
        ("attn_k_norm", "self_attn.k_layernorm"),
    ];
    let conv = [
        ("shortconv.conv", "conv.conv"),
        ("shortconv.in_proj", "conv.in_proj"),
        ("shortconv.out_proj", "conv.out_proj"),
    ];
    for l in 0..layers {
        let own: &[_] = if config["layer_types"][l] == "conv" {
            &conv
        } else {
            &attention
        };
        for (g, hf) in common.iter().chain(own) {
            v.push((
                format!("blk.{l}.{g}.weight"),
                format!("model.layers.{l}.{hf}.weight"),
            ));
        }
    }
    v
}

/// Token types of `tokenizer.ggml.token_type` (llama.cpp's `llama_token_type`).
const NORMAL: u64 = 1;
const CONTROL: u64 = 3;
const USER_DEFINED: u64 = 4;

/// Texts llama.cpp takes as ending generation and so as control tokens whatever type the
/// file gives them (`llama-vocab.cpp` overrides the type with a warning: "control-looking
/// token ... was not control-type"). Files that need it exist: Mistral fine-tunes with
/// ChatML's `<|im_end|>` typed normal, Gemma's `<end_of_turn>` typed user-defined.
const CONTROL_LOOKING: [&str; 12] = [
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

/// Builds `tokenizer.json` from the GGUF vocabulary (see the module docs for the models),
/// plus the tokenizer config with the chat template and special tokens.
fn tokenizer_files(g: &Gguf) -> Result<(tokenizers::Tokenizer, serde_json::Value)> {
    use tokenizers::AddedToken;

    let tokens = g.strings("tokenizer.ggml.tokens")?;
    let mut types: Vec<u64> = match g.get("tokenizer.ggml.token_type") {
        Some(v) => v
            .to_vec()
            .map_err(|e| crate::Error::Model(format!("token_type: {e}")))?
            .iter()
            .map(|t| as_u64(t).unwrap_or(NORMAL))
            .collect(),
        None => vec![NORMAL; tokens.len()],
    };
    if types.len() != tokens.len() {
        fail!(
            Model,
            "{}: {} token types for {} tokens",
            g.path.display(),
            types.len(),
            tokens.len()
        );
    }
    for (t, ty) in tokens.iter().zip(types.iter_mut()) {
        if CONTROL_LOOKING.contains(&t.as_str()) {
            *ty = CONTROL;
        }
    }
    let mut tk = match g.string("tokenizer.ggml.model")? {
        "gpt2" => byte_level_bpe(g, &tokens)?,
        "llama" => sentencepiece_bpe(g, &tokens, &types)?,
        model => fail!(
            Model,
            "{}: tokenizer model '{model}' cannot be imported yet (supported: gpt2 byte-level \
             BPE, llama SentencePiece BPE)",
            g.path.display()
        ),
    };
    // Control and user-defined tokens are matched whole in the raw text, never split; only
    // control tokens are special (skipped when decoding).
    let special: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter(|(_, &t)| t == CONTROL || t == USER_DEFINED)
        .map(|(s, &t)| AddedToken::from(s.clone(), t == CONTROL).normalized(false))
        .collect();
    tk.add_special_tokens(&special);
    // An id outside the vocabulary names no token (llama.cpp warns and ignores it too).
    let name = |key: &str| -> Result<Option<String>> {
        Ok(g.uint_opt(key)?
            .and_then(|i| tokens.get(i as usize))
            .cloned())
    };
    let mut config = serde_json::json!({});
    match g.string_opt("tokenizer.chat_template")? {
        Some(t) => config["chat_template"] = t.into(),
        None if g.arch()? == Arch::Gemma3 => config["chat_template"] = GEMMA_TEMPLATE.into(),
        None => {}
    }
    for (key, field) in [
        ("tokenizer.ggml.bos_token_id", "bos_token"),
        ("tokenizer.ggml.eos_token_id", "eos_token"),
        ("tokenizer.ggml.padding_token_id", "pad_token"),
        ("tokenizer.ggml.unknown_token_id", "unk_token"),
    ] {
        if let Some(t) = name(key)? {
            config[field] = t.into();
        }
    }
    // Unstated, llama.cpp's default: SentencePiece vocabularies and the Llama 3
    // pre-tokenizer start a raw prompt with BOS, other byte-level BPEs do not.
    let add_bos = match g.get("tokenizer.ggml.add_bos_token") {
        Some(Value::Bool(b)) => *b,
        None => {
            g.string("tokenizer.ggml.model")? == "llama"
                || g.string_opt("tokenizer.ggml.pre")?
                    .is_some_and(is_llama3_pre)
        }
        Some(v) => fail!(
            Model,
            "{}: metadata 'tokenizer.ggml.add_bos_token' is {v:?}, not a bool",
            g.path.display()
        ),
    };
    config["add_bos_token"] = add_bos.into();
    // Unstated, false (llama.cpp's default for every vocabulary kvplug reads).
    match g.get("tokenizer.ggml.add_eos_token") {
        Some(Value::Bool(b)) => config["add_eos_token"] = (*b).into(),
        None => {}
        Some(v) => fail!(
            Model,
            "{}: metadata 'tokenizer.ggml.add_eos_token' is {v:?}, not a bool",
            g.path.display()
        ),
    }
    Ok((tk, config))
}

/// The `tokenizer.ggml.pre` names of Llama 3's pre-tokenizer: every name llama.cpp maps to
/// `LLAMA_VOCAB_PRE_TYPE_LLAMA3` (its split, merges ignored for whole pre-tokens, BOS added
/// by default), Llama 3's own and those of models that reuse it (Falcon 3, Pixtral, ...).
const LLAMA3_PRES: [&str; 9] = [
    "llama-bpe",
    "llama3",
    "llama-v3",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "jina-v5-nano",
];

/// The `tokenizer.ggml.pre` names llama.cpp gives Qwen2's pre-tokenizer: Qwen2's own and
/// DeepSeek-R1's distilled Qwen models'.
const QWEN2_PRES: [&str; 2] = ["qwen2", "deepseek-r1-qwen"];

/// The `tokenizer.ggml.pre` names llama.cpp gives GPT-2's pre-tokenizer
/// (`LLAMA_VOCAB_PRE_TYPE_GPT2`: GPT-2's split regex, as `ByteLevel`'s own), and "gpt2", no
/// llama.cpp name, kept for files that wrote it.
const GPT2_PRES: [&str; 11] = [
    "gpt-2",
    "gpt2",
    "phi-2",
    "jina-es",
    "jina-de",
    "gigachat",
    "jina-v2-es",
    "jina-v2-de",
    "a.x-4.0",
    "mellum",
    "modern-bert",
];

/// Whether `pre` names Llama 3's pre-tokenizer ([`LLAMA3_PRES`]).
fn is_llama3_pre(pre: &str) -> bool {
    LLAMA3_PRES.contains(&pre)
}

/// Byte-level BPE from `tokenizer.ggml.merges`, with the pre-tokenizer `tokenizer.ggml.pre`
/// names.
fn byte_level_bpe(g: &Gguf, tokens: &[String]) -> Result<tokenizers::Tokenizer> {
    use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::digits::Digits;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior};

    let merges: Vec<(String, String)> = g
        .strings("tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .with_context(|| format!("merge '{m}' is not two tokens"))
        })
        .collect::<Result<_>>()?;
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    // A file naming no pre-tokenizer (or an empty name) gets llama.cpp's DEFAULT one, as
    // "default" does.
    let pre = g
        .string_opt("tokenizer.ggml.pre")?
        .filter(|p| !p.is_empty())
        .unwrap_or("default");
    // Llama 3's tokenizer.json (and llama.cpp for its pre-tokenizer) takes a pre-token found
    // whole in the vocabulary as one token, whatever the merges would make of it.
    let llama3 = is_llama3_pre(pre);
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(llama3)
        .build()
        .map_err(|e| crate::Error::Model(format!("building the BPE tokenizer: {e}")))?;
    let mut tk = tokenizers::Tokenizer::new(bpe);
    let byte_level = ByteLevel::new(false, true, true);
    // Split regexes (each splitting the pieces of the one before, matches and the text
    // between them kept as pieces, as llama.cpp's `unicode_regex_split` does), then
    // byte-level without its own regex.
    let splits = |regexes: &[&str]| -> Result<PreTokenizerWrapper> {
        let mut seq = Vec::with_capacity(regexes.len() + 1);
        for &regex in regexes {
            let split = Split::new(
                SplitPattern::Regex(regex.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| crate::Error::Model(format!("the {pre} split regex {regex:?}: {e}")))?;
            seq.push(split.into());
        }
        seq.push(ByteLevel::new(false, false, false).into());
        Ok(Sequence::new(seq).into())
    };
    // Qwen2's, Qwen3.5's and Llama 3's tokenizer.json: their split regex. They differ in
    // digit runs (one vs up to three) and in whether combining marks (`\p{M}`) join letters
    // (Qwen3.5).
    let qwen_llama = |digits: &str, marks: bool| -> Result<PreTokenizerWrapper> {
        let m = if marks { r"\p{M}" } else { "" };
        splits(&[&format!(
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}{m}]+|\p{{N}}{digits}| ?[^\s\p{{L}}{m}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        )])
    };
    let split: PreTokenizerWrapper = match pre {
        // SmolLM's tokenizer.json: single digits, then byte-level with the GPT-2 regex.
        "smollm" => Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into(),
        // GPT-2's regex.
        pre if GPT2_PRES.contains(&pre) => byte_level.into(),
        // llama.cpp's DEFAULT: runs of punctuation, GPT-2's split, digit runs, runs of three
        // digits.
        "default" => splits(&[
            r"[\p{P}\$\+<=>\^~\|]+",
            r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
            r"\p{N}+",
            "[0-9][0-9][0-9]",
        ])?,
        pre if QWEN2_PRES.contains(&pre) => qwen_llama("", false)?,
        "qwen35" => qwen_llama("", true)?,
        // GPT-4o's (o200k, GPT-OSS's): the split regex of its tokenizer.json (case classes
        // instead of Qwen's `(?i:…)` contractions; digit runs up to three).
        "gpt-4o" | "llama4" => splits(&[
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ])?,
        // DBRX's (GPT-4's cl100k, as Granite 4.0 writes it) and Smaug's: Llama 3's split,
        // with the merges applied to every pre-token, as llama.cpp applies them.
        pre if is_llama3_pre(pre) || ["dbrx", "smaug-bpe"].contains(&pre) => {
            qwen_llama("{1,3}", false)?
        }
        other => fail!(
            Model,
            "{}: pre-tokenizer '{other}' is not supported (supported: default, {}, smollm, \
             {}, qwen35, gpt-4o, llama4, dbrx, smaug-bpe, {})",
            g.path.display(),
            GPT2_PRES.join(", "),
            QWEN2_PRES.join(", "),
            LLAMA3_PRES.join(", ")
        ),
    };
    if QWEN2_PRES.contains(&pre) || pre == "qwen35" {
        tk.with_normalizer(Some(tokenizers::normalizers::unicode::NFC));
    }
    tk.with_pre_tokenizer(Some(split));
    tk.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(tk)
}

/// SentencePiece BPE from `tokenizer.ggml.scores`: the merges are every split of a normal
/// piece into two pieces of the vocabulary, ranked by the piece's score (highest first;
/// splits of one piece by their ids), as Hugging Face's `SentencePieceExtractor` derives
/// them. Spaces become `▁`, and one comes first unless `tokenizer.ggml.add_space_prefix`
/// is false;
/// characters outside the vocabulary fall back to `<0xNN>` byte tokens.
fn sentencepiece_bpe(g: &Gguf, tokens: &[String], types: &[u64]) -> Result<tokenizers::Tokenizer> {
    use tokenizers::decoders::byte_fallback::ByteFallback;
    use tokenizers::decoders::fuse::Fuse;
    use tokenizers::decoders::sequence::Sequence;
    use tokenizers::models::bpe::BPE;
    use tokenizers::normalizers::{Prepend, Replace};
    use tokenizers::{DecoderWrapper, NormalizerWrapper};

    let scores: Vec<f64> = g
        .get("tokenizer.ggml.scores")
        .with_context(|| format!("{}: no tokenizer.ggml.scores", g.path.display()))?
        .to_vec()
        .map_err(|e| crate::Error::Model(format!("scores: {e}")))?
        .iter()
        .map(|v| match v {
            Value::F32(x) => Ok(*x as f64),
            Value::F64(x) => Ok(*x),
            other => fail!(Model, "a score is not a float: {other:?}"),
        })
        .collect::<Result<_>>()?;
    if scores.len() != tokens.len() {
        fail!(
            Model,
            "{}: {} scores for {} tokens",
            g.path.display(),
            scores.len(),
            tokens.len()
        );
    }
    let id: std::collections::HashMap<&str, u32> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i as u32))
        .collect();
    let mut ranked: Vec<(f64, u32, u32)> = Vec::new();
    for (piece, (&ty, &score)) in tokens.iter().zip(types.iter().zip(&scores)) {
        if ty != NORMAL {
            continue;
        }
        for (at, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(at);
            if let (Some(&l), Some(&r)) = (id.get(l), id.get(r)) {
                ranked.push((score, l, r));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2))));
    let merges: Vec<(String, String)> = ranked
        .iter()
        .map(|&(_, l, r)| (tokens[l as usize].clone(), tokens[r as usize].clone()))
        .collect();
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let mut bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = g
        .uint_opt("tokenizer.ggml.unknown_token_id")?
        .and_then(|i| tokens.get(i as usize))
    {
        bpe = bpe.unk_token(unk.clone());
    }
    let bpe = bpe.build().map_err(|e| {
        crate::Error::Model(format!("building the SentencePiece BPE tokenizer: {e}"))
    })?;
    let mut tk = tokenizers::Tokenizer::new(bpe);
    let replace = || Replace::new(" ", "▁").map_err(|e| crate::Error::Model(format!("{e}")));
    // Unstated, llama.cpp's default for SentencePiece: a space before the text (Llama 2's
    // and Mistral's files state nothing; Gemma's say false).
    let prefix = match g.get("tokenizer.ggml.add_space_prefix") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => fail!(
            Model,
            "{}: metadata 'tokenizer.ggml.add_space_prefix' is {v:?}, not a bool",
            g.path.display()
        ),
    };
    let normalizer: NormalizerWrapper = if prefix {
        tokenizers::normalizers::Sequence::new(vec![
            Prepend::new("▁".into()).into(),
            replace()?.into(),
        ])
        .into()
    } else {
        replace()?.into()
    };
    tk.with_normalizer(Some(normalizer));
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new("▁", " ")
            .map_err(|e| crate::Error::Model(format!("{e}")))?
            .into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if prefix {
        decoders.push(tokenizers::decoders::strip::Strip::new(' ', 1, 0).into());
    }
    tk.with_decoder(Some(Sequence::new(decoders)));
    Ok(tk)
}

/// `config.json`, `generation_config.json`, `tokenizer_config.json` and `tokenizer.json`
/// into `dir`.
fn write_text_files(
    dir: &Path,
    config: &serde_json::Value,
    tokenizer: &tokenizers::Tokenizer,
    tokenizer_config: &serde_json::Value,
) -> Result<()> {
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(config)?,
    )?;
    let mut gen = serde_json::json!({});
    for k in ["bos_token_id", "eos_token_id"] {
        if !config[k].is_null() {
            gen[k] = config[k].clone();
        }
    }
    std::fs::write(
        dir.join("generation_config.json"),
        serde_json::to_string_pretty(&gen)?,
    )?;
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(tokenizer_config)?,
    )?;
    tokenizer
        .save(dir.join("tokenizer.json"), false)
        .map_err(|e| crate::Error::Model(format!("writing tokenizer.json: {e}")))
}

/// A fresh, empty staging directory beside `out` (for a write renamed into place).
fn staging_dir(out: &Path, what: &str) -> Result<PathBuf> {
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).with_context(|| format!("{}", parent.display()))?;
    let tmp = parent.join(format!(
        ".{}.{what}-{}",
        out.file_name().and_then(|s| s.to_str()).unwrap_or("model"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).with_context(|| format!("{}", tmp.display()))?;
    Ok(tmp)
}

/// The stored-type name `gguf.json` uses for a ggml type id (the kit's names), or `None` for
/// a type kvplug does not compute.
fn stored_type_name(id: u32) -> Option<&'static str> {
    Some(match id {
        0 => "f32",
        1 => "f16",
        30 => "bf16",
        2 => "q4_0",
        3 => "q4_1",
        6 => "q5_0",
        7 => "q5_1",
        8 => "q8_0",
        12 => "q4_K",
        13 => "q5_K",
        14 => "q6_K",
        39 => "mxfp4",
        _ => return None,
    })
}

/// candle's type for a ggml type id it dequantizes.
fn candle_type(id: u32) -> Option<GgmlDType> {
    use GgmlDType as T;
    Some(match id {
        0 => T::F32,
        1 => T::F16,
        30 => T::BF16,
        2 => T::Q4_0,
        3 => T::Q4_1,
        6 => T::Q5_0,
        7 => T::Q5_1,
        8 => T::Q8_0,
        9 => T::Q8_1,
        10 => T::Q2K,
        11 => T::Q3K,
        12 => T::Q4K,
        13 => T::Q5K,
        14 => T::Q6K,
        15 => T::Q8K,
        _ => return None,
    })
}

/// Revision of what [`index`] derives from a file (config, tokenizer): bumped when that
/// changes, so that indexes an older build cached are made again rather than reused.
/// 2: Llama 3 tokenizers take whole-vocabulary pre-tokens as is; unstated `add_bos_token`
/// follows llama.cpp's default. 3: a `context_length` of 0 is left out; NaN or infinite
/// numbers are refused. 4: optional metadata of the wrong type (a negative count, a
/// template that is no string) is refused, not read as absent; tensors keep their GGUF names.
/// 5: `rope.scaling.*` (linear, YaRN; the older `rope.scale_linear`) is read for Llama, Qwen2
/// and Qwen3 files, not ignored; a SentencePiece text without `add_space_prefix` starts with
/// a space (llama.cpp's default); Qwen3.5's prediction blocks are left out; Gemma 3 27B's
/// attention scale. 6: a byte-level BPE naming no pre-tokenizer, or `default`, takes
/// llama.cpp's DEFAULT splits, not GPT-2's; tokens llama.cpp reads as ending generation are
/// control tokens whatever their type in the file; `add_eos_token` is read.
const INDEXER_REVISION: u32 = 6;

/// Writes into `out` (which must not exist; staged and renamed into place) the directory
/// that serves `gguf`'s weights in place: `config.json`, the tokenizer files and
/// `gguf.json`. A weight of a type kvplug cannot compute is refused here, by name.
pub fn index(gguf: &Path, out: &Path) -> Result<()> {
    use kvplug_core::gguf_index::{
        GgufIndex, IndexedTensor, RopePairs, GGUF_INDEX_FILE, GGUF_INDEX_VERSION,
    };
    let g = Gguf::open(gguf)?;
    let arch = g.arch()?;
    let tied = !g.has_tensor("output.weight");
    let config = config_json(&g, tied)?;
    let (tokenizer, tokenizer_config) = tokenizer_files(&g)?;
    let file = std::fs::canonicalize(gguf).with_context(|| format!("{}", gguf.display()))?;
    let mut tensors = std::collections::BTreeMap::new();
    for (src, dst) in tensor_names(arch, &config, tied, &conv_biases(&g, &config)) {
        let info = g
            .file
            .tensors
            .get(&src)
            .with_context(|| format!("{}: tensor '{src}' is missing", gguf.display()))?;
        let dtype = stored_type_name(info.ggml_type).with_context(|| {
            format!(
                "{}: tensor '{src}' is {}, a type kvplug cannot compute (supported: f32, \
                 f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q4_K, q5_K, q6_K, mxfp4)",
                gguf.display(),
                ggml_type(info.ggml_type).map_or("unknown", |t| t.2)
            )
        })?;
        tensors.insert(
            dst,
            IndexedTensor {
                dtype: dtype.into(),
                shape: info.dims.clone(),
                // GgufFile::read proved whole blocks inside the file.
                offset: g.file.data_offset + info.offset,
                bytes: info.bytes(),
                gguf_name: src.clone(),
            },
        );
    }
    let manifest = GgufIndex {
        version: GGUF_INDEX_VERSION,
        file_bytes: std::fs::metadata(&file)?.len(),
        file,
        rope_pairs: if matches!(arch, Arch::Llama | Arch::GraniteHybrid) {
            RopePairs::Interleaved
        } else {
            RopePairs::Halves
        },
        norms_plus_one: arch == Arch::Gemma3,
        tensors,
    };
    let tmp = staging_dir(out, "index")?;
    let write = || -> Result<()> {
        write_text_files(&tmp, &config, &tokenizer, &tokenizer_config)?;
        std::fs::write(
            tmp.join(GGUF_INDEX_FILE),
            serde_json::to_string_pretty(&manifest)?,
        )?;
        File::open(&tmp)?.sync_all()?;
        std::fs::rename(&tmp, out).with_context(|| format!("renaming into {}", out.display()))
    };
    write().inspect_err(|_| {
        let _ = std::fs::remove_dir_all(&tmp);
    })
}

/// Imports `gguf` into `out` (which must not exist; written under a temporary name and
/// renamed into place). `on_tensor(done, total, name)` follows the conversion.
pub fn import(
    gguf: &Path,
    out: &Path,
    on_tensor: &mut dyn FnMut(usize, usize, &str),
) -> Result<()> {
    if out.exists() {
        fail!(
            Model,
            "{}: already exists; choose a new directory",
            out.display()
        );
    }
    let g = Gguf::open(gguf)?;
    let arch = g.arch()?;
    let tied = !g.has_tensor("output.weight");
    let config = config_json(&g, tied)?;
    let (tokenizer, tokenizer_config) = tokenizer_files(&g)?;
    let n = |k: &str| config[k].as_u64().unwrap_or(0) as usize;
    let (layers, heads, kv_heads) = (
        n("num_hidden_layers"),
        n("num_attention_heads"),
        n("num_key_value_heads"),
    );
    let names = tensor_names(arch, &config, tied, &conv_biases(&g, &config));
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::with_capacity(names.len());
    for (i, (src, dst)) in names.iter().enumerate() {
        on_tensor(i, names.len(), dst);
        let (dims, mut data) = g.tensor(src)?;
        let cols = *dims.last().unwrap_or(&1);
        match arch {
            Arch::Llama | Arch::GraniteHybrid if src.ends_with("attn_q.weight") => {
                data = unpermute_rows(&data, heads, cols);
            }
            Arch::Llama | Arch::GraniteHybrid if src.ends_with("attn_k.weight") => {
                data = unpermute_rows(&data, kv_heads, cols);
            }
            // The converter stores Gemma's RMSNorm weights as 1 + w; Hugging Face stores w.
            Arch::Gemma3 if src.ends_with("norm.weight") => {
                data.iter_mut().for_each(|x| *x -= 1.0);
            }
            _ => {}
        }
        if let Some(bad) = data.iter().find(|x| !x.is_finite()) {
            fail!(Model, "{}: tensor '{src}' holds {bad}", gguf.display());
        }
        // Vectors (norm weights) and LFM2's convolution kernels stay f32, as llama.cpp keeps
        // them; matrices become f16.
        let (dtype, bytes) = if dims.len() == 1 || src.ends_with("shortconv.conv.weight") {
            (
                Dtype::F32,
                data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        } else {
            let b = data
                .iter()
                .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                .collect();
            (Dtype::F16, b)
        };
        tensors.push((dst.clone(), dtype, dims, bytes));
    }
    on_tensor(names.len(), names.len(), "");
    let tmp = staging_dir(out, "import")?;
    let write = || -> Result<()> {
        let views: Vec<(&str, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, t, d, b)| Ok((n.as_str(), TensorView::new(*t, d.clone(), b)?)))
            .collect::<Result<_>>()?;
        let mut meta = HashMap::new();
        kvplug_core::metadata::write_cache_params(
            &kvplug_core::ModelCacheParams {
                n_layers: layers,
                n_kv_heads: kv_heads,
                head_dim: config["head_dim"]
                    .as_u64()
                    .map_or(n("hidden_size") / heads.max(1), |d| d as usize),
            },
            &mut meta,
        );
        meta.insert(
            "kvplug.source".into(),
            gguf.file_name()
                .and_then(|s| s.to_str())
                .unwrap_or("")
                .into(),
        );
        safetensors::serialize_to_file(views, Some(meta), &tmp.join("model.safetensors"))?;
        write_text_files(&tmp, &config, &tokenizer, &tokenizer_config)?;
        File::open(&tmp)?.sync_all()?;
        std::fs::rename(&tmp, out).with_context(|| format!("renaming into {}", out.display()))
    };
    write().inspect_err(|_| {
        let _ = std::fs::remove_dir_all(&tmp);
    })
}

/// The directory imports are cached in: `$KVPLUG_CACHE_DIR`, else `$XDG_CACHE_HOME/kvplug`,
/// else `~/.cache/kvplug`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("KVPLUG_CACHE_DIR") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("kvplug")
}

/// A model directory for `path`: `path` itself when it is a directory, else the directory
/// that serves the GGUF file's weights in place ([`index`]), made once into [`cache_dir`]
/// under [`index_digest`] (a changed file gets a new index; nothing reads the weights to
/// name it). The directory's modification time is set to now each time it is resolved, so
/// that its age is how long it went unused; making one also removes stale ones
/// ([`sweep_index`]).
pub fn resolve_model(path: &Path) -> Result<PathBuf> {
    if path.is_dir() {
        return Ok(path.to_path_buf());
    }
    let root = cache_dir().join(kvplug_core::gguf_index::INDEX_DIR);
    let dir = root.join(index_digest(path)?);
    if !dir.join(kvplug_core::gguf_index::GGUF_INDEX_FILE).exists() {
        tracing::info!(gguf = %path.display(), dir = %dir.display(), "indexing a GGUF file");
        match index(path, &dir) {
            Ok(()) => sweep_index(&root, STALE_INDEX_AGE),
            // Another process indexed the same file meanwhile and renamed its complete
            // directory into place first.
            Err(_) if dir.join(kvplug_core::gguf_index::GGUF_INDEX_FILE).exists() => {}
            Err(e) => return Err(e),
        }
    } else if let Ok(d) = File::open(&dir) {
        // Best effort: a directory that cannot be touched is only swept sooner.
        let _ = d.set_modified(std::time::SystemTime::now());
    }
    Ok(dir)
}

/// The name of a GGUF file's index directory: a digest of its canonical path, length and
/// modification time, and of the index format's versions.
pub fn index_digest(path: &Path) -> Result<String> {
    let (f, len) = open_regular(path)?;
    let canonical = std::fs::canonicalize(path).with_context(|| format!("{}", path.display()))?;
    let modified = f
        .metadata()
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let mut hash = Sha256::new();
    hash.update(canonical.as_os_str().as_encoded_bytes());
    hash.update(len.to_le_bytes());
    hash.update(modified.to_le_bytes());
    hash.update(kvplug_core::gguf_index::GGUF_INDEX_VERSION.to_le_bytes());
    hash.update(INDEXER_REVISION.to_le_bytes());
    Ok(hash
        .finalize()
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// How long a stale index directory must have gone unresolved before [`sweep_index`]
/// removes it: a process that opened it before its file changed may still be reading it.
pub const STALE_INDEX_AGE: std::time::Duration = std::time::Duration::from_secs(3600);

/// Removes the index directories under `root` (`gguf-index/`) unresolved for `age` that no
/// file would resolve to any more: their GGUF is gone or changed (length, modification
/// time) or was indexed by another version, or their indexing never finished (a staging
/// directory left by a crash). Best effort: what cannot be read or removed stays, and so
/// does a directory whose GGUF cannot be opened for another reason than its absence.
pub fn sweep_index(root: &Path, age: std::time::Duration) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let dir = entry.path();
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|e| e >= age);
        if !old || !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let stale = match kvplug_core::gguf_index::indexed_file(&dir) {
            None => true,
            Some(file) => match std::fs::metadata(&file) {
                Err(e) => e.kind() == std::io::ErrorKind::NotFound,
                Ok(_) => index_digest(&file).is_ok_and(|d| entry.file_name() != d.as_str()),
            },
        };
        if stale {
            tracing::info!(dir = %dir.display(), "removing a stale GGUF index");
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::{self as candle_gguf, Value};

    /// The config a GGUF of metadata `meta` (and no tensors) gives.
    fn config_of(meta: &[(&str, Value)]) -> Result<serde_json::Value> {
        config_with(meta, &[])
    }

    /// The config a GGUF of metadata `meta` and f32 vectors named `tensors` gives.
    fn config_with(meta: &[(&str, Value)], tensors: &[&str]) -> Result<serde_json::Value> {
        use candle_core::quantized::{GgmlDType, QTensor};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta.gguf");
        let mut f = std::fs::File::create(&path).unwrap();
        let meta: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
        let t = candle_core::Tensor::zeros(32, candle_core::DType::F32, &candle_core::Device::Cpu)
            .unwrap();
        let t = QTensor::quantize(&t, GgmlDType::F32).unwrap();
        let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|n| (*n, &t)).collect();
        candle_gguf::write(&mut f, &meta, &tensors).unwrap();
        config_json(&Gguf::open(&path)?, false)
    }

    /// A small llama file's metadata (2 layers of 64, 4 heads, 300 tokens, 4096 positions),
    /// then `extra`.
    fn llama_meta(extra: &[(&'static str, Value)]) -> Vec<(&'static str, Value)> {
        let u = |n: u32| Value::U32(n);
        let mut meta = vec![
            ("general.architecture", Value::String("llama".into())),
            ("llama.block_count", u(2)),
            ("llama.embedding_length", u(64)),
            ("llama.feed_forward_length", u(128)),
            ("llama.attention.head_count", u(4)),
            ("llama.context_length", u(4096)),
            ("llama.vocab_size", u(300)),
        ];
        meta.extend_from_slice(extra);
        meta
    }

    #[test]
    fn a_llama_file_with_experts_or_biases_is_refused() {
        let u = |n: u32| Value::U32(n);
        let meta = llama_meta(&[]);
        assert!(config_with(&meta, &["blk.0.attn_norm.weight"]).is_ok());
        let e = config_with(&meta, &["blk.0.attn_q.bias"]).unwrap_err();
        assert!(
            e.to_string()
                .contains("tensor 'blk.0.attn_q.bias': biases on a llama"),
            "{e}"
        );
        let mixtral = [meta.as_slice(), &[("llama.expert_count", u(8))]].concat();
        let e = config_of(&mixtral).unwrap_err();
        assert!(e.to_string().contains("mixture of experts"), "{e}");
    }

    #[test]
    fn rope_scaling_is_read_as_llama_cpp_reads_it() {
        let llama = |extra: &[(&'static str, Value)]| {
            config_of(&llama_meta(extra)).map(|c| c["rope_scaling"].clone())
        };
        let linear = serde_json::json!({"rope_type": "linear", "factor": 4.0});
        let (factor, scale_linear) = ("llama.rope.scaling.factor", "llama.rope.scale_linear");
        let typed = |t: &str| ("llama.rope.scaling.type", Value::String(t.into()));
        // Without a type, with "none", or from the 2023 key: the factor divides.
        assert_eq!(llama(&[(factor, Value::F32(4.0))]).unwrap(), linear);
        assert_eq!(llama(&[(scale_linear, Value::F32(4.0))]).unwrap(), linear);
        assert_eq!(
            llama(&[typed("none"), (factor, Value::F32(4.0))]).unwrap(),
            linear
        );
        // A factor of 1 or 0 scales nothing; a YaRN without one neither.
        for f in [0.0, 1.0] {
            assert!(llama(&[(factor, Value::F32(f))]).unwrap().is_null());
        }
        assert!(llama(&[typed("yarn")]).unwrap().is_null());
        let yarn = llama(&[typed("yarn"), (factor, Value::F32(4.0))]).unwrap();
        assert_eq!(yarn["original_max_position_embeddings"], 4096);
        assert_eq!(yarn["attention_factor"], 1.0 + 0.1 * 4f64.ln());
        let e = llama(&[typed("longrope"), (factor, Value::F32(4.0))]).unwrap_err();
        assert!(
            e.to_string()
                .contains("rope scaling 'longrope' is not supported for llama (linear, yarn)"),
            "{e}"
        );
    }

    #[test]
    fn generation_ends_at_the_eos_eot_and_eom_tokens_the_file_names() {
        let ends = |ids: &[(&'static str, u32)]| {
            let ids: Vec<_> = ids.iter().map(|&(k, id)| (k, Value::U32(id))).collect();
            config_of(&llama_meta(&ids)).unwrap()["eos_token_id"].clone()
        };
        let (eos, eot, eom) = (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        );
        assert_eq!(ends(&[(eos, 2)]), serde_json::json!(2));
        assert_eq!(
            ends(&[(eos, 2), (eot, 7), (eom, 8)]),
            serde_json::json!([2, 7, 8])
        );
        // The same id twice once; one outside the vocabulary not at all.
        assert_eq!(
            ends(&[(eos, 7), (eot, 7), (eom, 300)]),
            serde_json::json!(7)
        );
    }

    #[test]
    fn gemma3_scales_attention_by_the_head_width_except_at_62_layers() {
        let u = |n: u32| Value::U32(n);
        // Gemma 3 27B: 5376 wide, 32 heads of 128; 1B: 1152 wide, 4 heads of 256.
        let gemma = |layers, hidden, heads, head_dim| {
            let meta = [
                ("general.architecture", Value::String("gemma3".into())),
                ("gemma3.block_count", u(layers)),
                ("gemma3.embedding_length", u(hidden)),
                ("gemma3.feed_forward_length", u(4 * hidden)),
                ("gemma3.attention.head_count", u(heads)),
                ("gemma3.attention.head_count_kv", u(heads / 2)),
                ("gemma3.attention.key_length", u(head_dim)),
                ("gemma3.attention.value_length", u(head_dim)),
                ("gemma3.attention.sliding_window", u(1024)),
                ("gemma3.vocab_size", u(262144)),
            ];
            config_of(&meta).unwrap()["query_pre_attn_scalar"].as_u64()
        };
        assert_eq!(gemma(62, 5376, 32, 128), Some(168));
        assert_eq!(gemma(26, 1152, 4, 256), Some(256));
    }

    #[test]
    fn unpermute_inverts_the_converters_permutation() {
        // The converter: reshape(heads, 2, hd/2, cols).swap(1, 2).
        let (heads, hd, cols) = (2, 8, 3);
        let hf: Vec<f32> = (0..heads * hd * cols).map(|i| i as f32).collect();
        let mut gguf = vec![0.0; hf.len()];
        for h in 0..heads {
            for j in 0..2 {
                for i in 0..hd / 2 {
                    let src = (h * hd + j * hd / 2 + i) * cols;
                    let dst = (h * hd + 2 * i + j) * cols;
                    gguf[dst..dst + cols].copy_from_slice(&hf[src..src + cols]);
                }
            }
        }
        assert_ne!(gguf, hf);
        assert_eq!(unpermute_rows(&gguf, heads, cols), hf);
    }
}
