//! Synthetic models (`kvplug model synth`): deterministic random-weight Llama packages with
//! real `kv_cache.*` metadata, for tests and benchmarks.

use std::collections::HashMap;
use std::path::Path;

use kvplug_core::files::{read_text, write_atomic, MAX_TEXT_BYTES};
use kvplug_core::metadata::write_cache_params;
use kvplug_core::ModelCacheParams;
use safetensors::Dtype;

use crate::error::{fail, Context, Result};

/// A synthetic model shape.
#[derive(Clone, Copy, Debug)]
pub struct Preset {
    /// Name (`tiny`, `small`).
    pub name: &'static str,
    /// Layers.
    pub layers: usize,
    /// Residual width.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Vocabulary.
    pub vocab: usize,
}

/// `tiny` for tests, `small` with SmolLM-135M's shape for benchmarks.
pub const PRESETS: [Preset; 2] = [
    Preset {
        name: "tiny",
        layers: 2,
        hidden: 64,
        heads: 4,
        kv_heads: 2,
        intermediate: 128,
        vocab: 256,
    },
    Preset {
        name: "small",
        layers: 30,
        hidden: 576,
        heads: 9,
        kv_heads: 3,
        intermediate: 1536,
        vocab: 49152,
    },
];

/// Deterministic values uniform in `[-a, a)`.
fn uniform(seed: u64, n: usize, a: f32) -> Vec<f32> {
    let mut s = seed ^ 0x5851_F42D_4C95_7F2D;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
        })
        .collect()
}

/// Writes `preset` with random weights (seeded) to `out` in `dtype` (`f32`, `f16`, `bf16`).
pub fn synth(preset: &Preset, out: &Path, seed: u64, dtype: &str) -> Result<()> {
    let st_dtype = match dtype {
        "f32" => Dtype::F32,
        "f16" => Dtype::F16,
        "bf16" => Dtype::BF16,
        other => fail!(
            Invalid,
            "unknown weight dtype '{other}' (expected f32, f16 or bf16)"
        ),
    };
    let p = preset;
    let hd = p.hidden / p.heads;
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let mut n = 0u64;
    let mut add = |name: String, shape: Vec<usize>, a: f32, offset: f32| {
        n += 1;
        let len = shape.iter().product();
        let data = uniform(seed.wrapping_mul(1_000_003).wrapping_add(n), len, a)
            .into_iter()
            .map(|v| v + offset)
            .collect();
        tensors.push((name, shape, data));
    };
    let lin = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    add(
        "model.embed_tokens.weight".into(),
        vec![p.vocab, p.hidden],
        1.0,
        0.0,
    );
    for l in 0..p.layers {
        let pre = format!("model.layers.{l}.");
        add(
            format!("{pre}input_layernorm.weight"),
            vec![p.hidden],
            0.1,
            1.0,
        );
        add(
            format!("{pre}self_attn.q_proj.weight"),
            vec![p.heads * hd, p.hidden],
            lin(p.hidden),
            0.0,
        );
        add(
            format!("{pre}self_attn.k_proj.weight"),
            vec![p.kv_heads * hd, p.hidden],
            lin(p.hidden),
            0.0,
        );
        add(
            format!("{pre}self_attn.v_proj.weight"),
            vec![p.kv_heads * hd, p.hidden],
            lin(p.hidden),
            0.0,
        );
        add(
            format!("{pre}self_attn.o_proj.weight"),
            vec![p.hidden, p.heads * hd],
            lin(p.heads * hd),
            0.0,
        );
        add(
            format!("{pre}post_attention_layernorm.weight"),
            vec![p.hidden],
            0.1,
            1.0,
        );
        add(
            format!("{pre}mlp.gate_proj.weight"),
            vec![p.intermediate, p.hidden],
            lin(p.hidden),
            0.0,
        );
        add(
            format!("{pre}mlp.up_proj.weight"),
            vec![p.intermediate, p.hidden],
            lin(p.hidden),
            0.0,
        );
        add(
            format!("{pre}mlp.down_proj.weight"),
            vec![p.hidden, p.intermediate],
            lin(p.intermediate),
            0.0,
        );
    }
    add("model.norm.weight".into(), vec![p.hidden], 0.1, 1.0);
    // Untied: a tied random head mostly echoes the current token back.
    add(
        "lm_head.weight".into(),
        vec![p.vocab, p.hidden],
        lin(p.hidden),
        0.0,
    );
    let encoded: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(name, shape, data)| {
            let bytes = match st_dtype {
                Dtype::F16 => data
                    .iter()
                    .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                    .collect(),
                Dtype::BF16 => data
                    .iter()
                    .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                    .collect(),
                _ => data.iter().flat_map(|v| v.to_le_bytes()).collect(),
            };
            (name, shape, bytes)
        })
        .collect();
    let views = encoded
        .iter()
        .map(|(name, shape, bytes)| {
            Ok((
                name.clone(),
                safetensors::tensor::TensorView::new(st_dtype, shape.clone(), bytes)?,
            ))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    let mut meta: HashMap<String, String> = HashMap::new();
    meta.insert("format".into(), "pt".into());
    write_cache_params(
        &ModelCacheParams {
            n_layers: p.layers,
            n_kv_heads: p.kv_heads,
            head_dim: hd,
        },
        &mut meta,
    );
    prepare_out(out)?;
    // Written beside, then renamed: a failure (a full disk) leaves no torn weights, and no
    // temporary file.
    let tmp = out.join(".model.safetensors.partial");
    safetensors::serialize_to_file(views, Some(meta), &tmp).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })?;
    std::fs::rename(&tmp, out.join("model.safetensors"))?;
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": p.hidden,
        "intermediate_size": p.intermediate,
        "num_attention_heads": p.heads,
        "num_key_value_heads": p.kv_heads,
        "num_hidden_layers": p.layers,
        "vocab_size": p.vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": false,
        "max_position_embeddings": 8192,
        "torch_dtype": match dtype { "f32" => "float32", "f16" => "float16", _ => "bfloat16" },
        "kvplug_synthetic": {"preset": p.name, "seed": seed},
    });
    write_atomic(
        &out.join("config.json"),
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )?;
    Ok(())
}

/// Makes `out` ready for a synthetic model: created when missing; when it holds files,
/// only an earlier synthetic model is replaced (its weight files removed first, so no stale
/// shard index can shadow the new weights); anything else is refused.
fn prepare_out(out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let entries: Vec<std::path::PathBuf> = std::fs::read_dir(out)
        .with_context(|| format!("reading {}", out.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    if entries.is_empty() {
        return Ok(());
    }
    let synthetic = read_text(&out.join("config.json"), MAX_TEXT_BYTES)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|v| v.get("kvplug_synthetic").is_some());
    if !synthetic {
        fail!(
            Invalid,
            "{}: not empty and not a synthetic model; give a new or empty directory",
            out.display()
        );
    }
    for p in entries {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if name.ends_with(".safetensors") || name == "model.safetensors.index.json" {
            std::fs::remove_file(&p).with_context(|| format!("removing {}", p.display()))?;
        }
    }
    Ok(())
}
