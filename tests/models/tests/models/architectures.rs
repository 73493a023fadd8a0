//! The Llama-family variants beyond plain Llama, each a synthetic model checked on every
//! backend against the f64 reference forward (which is told the variant's arithmetic rather
//! than reading it from the package): Llama 3.x RoPE scaling — from a GGUF's `rope_freqs`
//! tensor and from a Hugging Face `rope_scaling` — with tied embeddings, a GGUF's linear and
//! YaRN `rope.scaling.*` (as llama.cpp reads them for any family), and Mistral's sliding
//! window. (Qwen2's biases and Qwen3's q/k norms are in `model.rs`, Gemma 3 in
//! `gemma.rs`.)

use std::path::Path;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use kvplug::argmax;
use kvplug::formats::synth::{synth, Preset};
use kvplug::{CacheKind, KvDtype};
use kvplug_backend_kit::model::ModelPackage;

use crate::common;
use common::{
    bpe_tokenizer_meta, forward, gguf_tensors, llama3_inv_freq, llama_gguf_meta, max_logit_error,
    reference_logits_with, runtime, write_gguf, yarn_inv_freq, Reference, BACKENDS, MERGES,
};

/// head_dim 32: sixteen rotary frequencies, enough for every region of Llama 3's scaling.
const PRESET: Preset = Preset {
    name: "variants",
    layers: 2,
    hidden: 128,
    heads: 4,
    kv_heads: 2,
    intermediate: 256,
    vocab: 300,
};

const PROMPT: [i32; 11] = [3, 141, 59, 26, 53, 58, 97, 93, 238, 46, 26];
const THETA: f64 = 500_000.0;
/// Llama 3.1's factors with the original context shrunk to 64 positions, so that the
/// wavelengths of a 32-wide head fall below 16 (kept), above 64 (divided by 8) and between
/// (blended).
const LLAMA3: (f64, f64, f64, f64) = (8.0, 1.0, 4.0, 64.0);

fn llama3() -> Vec<f64> {
    let (factor, low, high, original) = LLAMA3;
    llama3_inv_freq(
        THETA,
        PRESET.hidden / PRESET.heads,
        factor,
        low,
        high,
        original,
    )
}

/// The synthetic model with `config` merged into its `config.json`.
fn synthetic(dir: &Path, config: serde_json::Value) {
    synth(&PRESET, dir, 5, "f32").unwrap();
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for (k, v) in config.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    std::fs::write(&path, cfg.to_string()).unwrap();
}

/// Logits of `tokens` on `backend`: the prompt in one forward, then one token per forward.
fn logits(backend: &str, dir: &Path, prompt: &[i32], steps: usize) -> (Vec<i32>, Vec<Vec<f32>>) {
    let rt = runtime();
    let mut ctx = common::model(&rt, backend, dir)
        .context(CacheKind::Contiguous, 64, KvDtype::F32)
        .unwrap();
    let positions: Vec<i32> = (0..prompt.len() as i32).collect();
    let mut got = forward(&mut ctx, prompt, &positions);
    let mut tokens = prompt.to_vec();
    for _ in 0..steps {
        let next = argmax(got.last().unwrap());
        tokens.push(next);
        got.extend(forward(&mut ctx, &[next], &[tokens.len() as i32 - 1]));
    }
    (tokens, got)
}

/// Asserts that `variant` moves the reference's logits (so the check can fail) and that
/// every backend's logits over `model` track the reference told `variant`.
fn check(model: &Path, what: &str, variant: &Reference, steps: usize) {
    for backend in BACKENDS {
        let (tokens, got) = logits(backend, model, &PROMPT, steps);
        // The cpu quantizes the inputs of block-format linears to int8 blocks (its declared
        // arithmetic); the reference does the same for it.
        let int8_block_acts = backend == "cpu" && variant.int8_block_acts;
        let told = Reference {
            int8_block_acts,
            ..variant.clone()
        };
        let want = reference_logits_with(model, &tokens, &told);
        let plain = Reference {
            int8_block_acts,
            ..Reference::default()
        };
        let moved = reference_logits_with(model, &tokens, &plain)
            .iter()
            .flatten()
            .zip(want.iter().flatten())
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(moved > 1e-2, "{what}: the variant must change the logits");
        let worst = max_logit_error(&got, &want);
        // The f32 tolerance of the model tests (model.rs).
        assert!(
            worst < 1e-3,
            "{what} on {backend}: max |logit error| {worst}"
        );
    }
}

#[test]
fn llama3_rope_freqs_gguf_with_tied_embeddings_matches_the_f64_reference() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("hf");
    synthetic(&src, serde_json::json!({}));
    let pkg = ModelPackage::open(&src).unwrap();
    // Block formats on the matrices (32-value blocks fit 128-wide rows), no output.weight:
    // the head is the embedding table.
    let mut tensors = gguf_tensors(
        &pkg,
        &PRESET,
        &[GgmlDType::Q8_0, GgmlDType::Q4_0, GgmlDType::Q5_1],
        true,
    );
    // llama.cpp's converter writes Llama 3's scaling as per-pair divisors of the base
    // frequencies.
    let hd = PRESET.hidden / PRESET.heads;
    let factors: Vec<f32> = llama3()
        .iter()
        .enumerate()
        .map(|(i, f)| (THETA.powf(-(2.0 * i as f64) / hd as f64) / f) as f32)
        .collect();
    let t = Tensor::from_vec(factors, hd / 2, &Device::Cpu).unwrap();
    tensors.push((
        "rope_freqs.weight".into(),
        QTensor::quantize(&t, GgmlDType::F32).unwrap(),
    ));
    let mut meta = llama_gguf_meta(&PRESET, pkg.config.rms_norm_eps as f32, THETA as f32);
    meta.extend(bpe_tokenizer_meta("llama-bpe", &MERGES, PRESET.vocab).0);
    let gguf = dir.path().join("llama3.gguf");
    write_gguf(&gguf, &meta, &tensors);
    let model = dir.path().join("indexed");
    kvplug::formats::gguf::index(&gguf, &model).unwrap();
    let indexed = ModelPackage::open(&model).unwrap();
    assert!(indexed.config.tie_word_embeddings, "no output.weight: tied");
    let variant = Reference {
        int8_block_acts: true,
        inv_freq: Some(llama3()),
        ..Reference::default()
    };
    check(&model, "Llama 3 GGUF", &variant, 4);
}

#[test]
fn gguf_linear_and_yarn_rope_scaling_match_the_f64_reference() {
    use candle_core::quantized::gguf_file::Value;
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("hf");
    synthetic(&src, serde_json::json!({}));
    let pkg = ModelPackage::open(&src).unwrap();
    let tensors = gguf_tensors(&pkg, &PRESET, &[GgmlDType::F32], false);
    let hd = PRESET.hidden / PRESET.heads;
    // An original context of 64 positions puts the ramp inside a 32-wide head's pairs.
    let (factor, original) = (4.0, 64.0);
    let plain = (0..hd / 2).map(|i| THETA.powf(-(2.0 * i as f64) / hd as f64));
    let cases = [
        (
            "linear",
            Reference {
                inv_freq: Some(plain.map(|f| f / factor).collect()),
                ..Reference::default()
            },
        ),
        (
            "yarn",
            Reference {
                inv_freq: Some(yarn_inv_freq(THETA, hd, factor, original)),
                rope_magnitude: Some(1.0 + 0.1 * f64::ln(factor)),
                ..Reference::default()
            },
        ),
    ];
    for (kind, variant) in cases {
        let mut meta = llama_gguf_meta(&PRESET, pkg.config.rms_norm_eps as f32, THETA as f32);
        meta.extend([
            ("llama.rope.scaling.type", Value::String(kind.into())),
            ("llama.rope.scaling.factor", Value::F32(factor as f32)),
            (
                "llama.rope.scaling.original_context_length",
                Value::U32(original as u32),
            ),
        ]);
        meta.extend(bpe_tokenizer_meta("llama-bpe", &MERGES, PRESET.vocab).0);
        let gguf = dir.path().join(format!("{kind}.gguf"));
        write_gguf(&gguf, &meta, &tensors);
        let model = dir.path().join(kind);
        kvplug::formats::gguf::index(&gguf, &model).unwrap();
        check(&model, &format!("{kind} GGUF"), &variant, 4);
    }
}

#[test]
fn llama3_rope_scaling_and_tied_embeddings_from_a_config_match_the_f64_reference() {
    let dir = tempfile::tempdir().unwrap();
    let (factor, low, high, original) = LLAMA3;
    synthetic(
        dir.path(),
        serde_json::json!({
            "rope_theta": THETA,
            "tie_word_embeddings": true,
            "rope_scaling": {
                "rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                "high_freq_factor": high, "original_max_position_embeddings": original
            }
        }),
    );
    let variant = Reference {
        inv_freq: Some(llama3()),
        ..Reference::default()
    };
    check(dir.path(), "Llama 3 config", &variant, 4);
}

#[test]
fn mistral_sliding_window_matches_the_f64_reference() {
    let dir = tempfile::tempdir().unwrap();
    synthetic(
        dir.path(),
        serde_json::json!({
            "model_type": "mistral",
            "architectures": ["MistralForCausalLM"],
            "sliding_window": 4
        }),
    );
    let variant = Reference {
        window: Some(4),
        ..Reference::default()
    };
    // Decode steps past the window: rows leave it one by one.
    check(dir.path(), "Mistral", &variant, 6);
}
