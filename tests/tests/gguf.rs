//! GGUF import: a GGUF written here (Llama shape, q/k rows permuted as llama.cpp's converter
//! does, every weight in a different ggml type including K-quants, a byte-level BPE
//! vocabulary and a chat template) imports into a model directory whose weights are exactly
//! the dequantized ones, whose logits match the f64 reference, and whose tokenizer and
//! template work.

use std::collections::BTreeMap;
use std::path::PathBuf;

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use kvplug_backend_kit::model::ModelPackage;
use kvplug_core::{make_config, KvDtype};
use kvplug_host::model::{synth, Preset};
use kvplug_host::run::Forward;
use kvplug_host::text::{Message, Text};

mod common;
use common::{gguf_name, hf_tensor_shapes, host, llama_gguf_meta, reference_logits, write_gguf};

/// hidden and intermediate 256: every matrix row is a whole number of K-quant blocks.
const PRESET: Preset = Preset {
    name: "gguf-test",
    layers: 2,
    hidden: 256,
    heads: 4,
    kv_heads: 2,
    intermediate: 256,
    vocab: 300,
};

/// GPT-2's byte → printable character map (tokens of a byte-level BPE vocabulary).
fn byte_chars() -> Vec<char> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut extra = 256;
    (0..=255u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                extra += 1;
                char::from_u32(extra - 1).unwrap()
            }
        })
        .collect()
}

/// llama.cpp's converter: `reshape(heads, 2, hd/2, cols).swapaxes(1, 2)` of q/k rows.
fn permute(w: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let hd = w.len() / cols / heads;
    let mut out = vec![0.0; w.len()];
    for h in 0..heads {
        for two in 0..2 {
            for i in 0..hd / 2 {
                let from = (h * hd + two * hd / 2 + i) * cols;
                let to = (h * hd + i * 2 + two) * cols;
                out[to..to + cols].copy_from_slice(&w[from..from + cols]);
            }
        }
    }
    out
}

#[test]
fn a_gguf_with_k_quants_imports_exactly_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("hf");
    synth(&PRESET, &src, 11, "f32").unwrap();
    let pkg = ModelPackage::open(&src).unwrap();
    let shapes = hf_tensor_shapes(&PRESET);
    // One ggml type per matrix kind; norms stay f32.
    let types = [
        GgmlDType::Q8_0,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::F16,
        GgmlDType::BF16,
    ];
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    // What the import must produce: each weight quantized and dequantized (a row-wise
    // round trip commutes with the converter's row permutation).
    let mut expect: BTreeMap<String, Vec<f32>> = BTreeMap::new();
    for (i, (name, shape)) in shapes.iter().enumerate() {
        let data = pkg.tensor_f32(name, shape).unwrap();
        let dtype = if shape.len() == 1 {
            GgmlDType::F32
        } else {
            types[i % types.len()]
        };
        let dev = &Device::Cpu;
        let round_trip = QTensor::quantize(
            &Tensor::from_vec(data.clone(), shape.as_slice(), dev).unwrap(),
            dtype,
        )
        .unwrap()
        .dequantize(dev)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
        // Matrices are stored in f16, vectors in f32.
        let stored = if shape.len() == 1 {
            round_trip
        } else {
            round_trip
                .iter()
                .map(|&x| half::f16::from_f32(x).to_f32())
                .collect()
        };
        expect.insert(name.clone(), stored);
        let stored = if name.ends_with("q_proj.weight") {
            permute(&data, PRESET.heads, shape[1])
        } else if name.ends_with("k_proj.weight") {
            permute(&data, PRESET.kv_heads, shape[1])
        } else {
            data
        };
        let t = Tensor::from_vec(stored, shape.as_slice(), dev).unwrap();
        tensors.push((gguf_name(name), QTensor::quantize(&t, dtype).unwrap()));
    }
    // Vocabulary: the 256 byte tokens, a few merges, then special tokens.
    let bytes = byte_chars();
    let mut tokens: Vec<String> = bytes.iter().map(|c| c.to_string()).collect();
    let merges = ["h e", "l l", "he ll", "o Ġ", "Ġ w"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
    }
    let specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"];
    let first_special = tokens.len();
    tokens.extend(specials.iter().map(|s| s.to_string()));
    while tokens.len() < PRESET.vocab {
        tokens.push(format!("<unused{}>", tokens.len()));
    }
    let token_type: Vec<Value> = (0..tokens.len())
        .map(|i| {
            Value::I32(if (first_special..first_special + 3).contains(&i) {
                3
            } else {
                1
            })
        })
        .collect();
    let template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let s = |x: &str| Value::String(x.into());
    let u = |x: usize| Value::U32(x as u32);
    let mut meta = llama_gguf_meta(
        &PRESET,
        pkg.config.rms_norm_eps as f32,
        pkg.config.rope_theta as f32,
    );
    meta.extend([
        ("tokenizer.ggml.model", s("gpt2")),
        ("tokenizer.ggml.pre", s("smollm")),
        (
            "tokenizer.ggml.tokens",
            Value::Array(tokens.iter().map(|t| s(t)).collect()),
        ),
        (
            "tokenizer.ggml.merges",
            Value::Array(merges.iter().map(|m| s(m)).collect()),
        ),
        ("tokenizer.ggml.token_type", Value::Array(token_type)),
        ("tokenizer.ggml.bos_token_id", u(first_special)),
        ("tokenizer.ggml.eos_token_id", u(first_special + 1)),
        ("tokenizer.chat_template", s(template)),
    ]);
    let gguf = dir.path().join("model.gguf");
    write_gguf(&gguf, &meta, &tensors);

    let out: PathBuf = dir.path().join("imported");
    kvplug_host::gguf::import(&gguf, &out).unwrap();
    let e = kvplug_host::gguf::import(&gguf, &out)
        .unwrap_err()
        .to_string();
    assert!(e.contains("already exists"), "{e}");

    // Weights: exactly the dequantized ones, un-permuted.
    let imported = ModelPackage::open(&out).unwrap();
    for (name, shape) in &shapes {
        let got = imported.tensor_f32(name, shape).unwrap();
        assert!(
            got == expect[name],
            "{name} differs from its dequantized source"
        );
    }
    assert_eq!(imported.cache_params(), pkg.cache_params());

    // Logits of the imported model on cpu (f32 KV) against the f64 reference forward over
    // the imported weights; the tolerance is the model tests' f32 one.
    let host = host();
    let (_session, opts) = host
        .make_decode_session(
            "cpu",
            &make_config(&imported.cache_params(), 64, KvDtype::F32),
        )
        .unwrap();
    let mut fwd = Forward::load(&host, "cpu", &out, None, opts).unwrap();
    let tokens = [5, 77, 260, 3, 199];
    let positions: Vec<i32> = (0..tokens.len() as i32).collect();
    let got = fwd.call(&tokens, &positions, None).unwrap();
    let want = reference_logits(&out, &tokens);
    let worst = common::max_logit_error(&got, &want);
    assert!(worst < 1e-3, "max |logit error| {worst}");

    // In place: the index serves the GGUF's own blocks (the kit's dequantization of each
    // tensor equals candle's, bit for bit) and every backend's logits track the f64
    // reference over those weights (q/k rows still permuted: the reference pairs its rotary
    // halves as the package says).
    let indexed = dir.path().join("indexed");
    kvplug_host::gguf::index(&gguf, &indexed).unwrap();
    let in_place = ModelPackage::open(&indexed).unwrap();
    assert_eq!(in_place.rope_pairs(), kvplug_core::RopePairs::Interleaved);
    for (name, shape) in &shapes {
        let (_, q) = tensors.iter().find(|(n, _)| *n == gguf_name(name)).unwrap();
        let want = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let got = in_place.tensor_f32(name, shape).unwrap();
        assert!(
            got.iter()
                .map(|x| x.to_bits())
                .eq(want.iter().map(|x| x.to_bits())),
            "{name} ({:?}): the kit's dequantization differs from candle's",
            q.dtype()
        );
    }
    for backend in common::BACKENDS {
        // The cpu quantizes the inputs of block-format linears to int8 blocks (its declared
        // arithmetic); the reference does the same for it.
        let want = common::reference_logits_as(&indexed, &tokens, backend == "cpu");
        let (_session, opts) = host
            .make_decode_session(
                backend,
                &make_config(&in_place.cache_params(), 64, KvDtype::F32),
            )
            .unwrap();
        let mut fwd = Forward::load(&host, backend, &indexed, None, opts).unwrap();
        let got = fwd.call(&tokens, &positions, None).unwrap();
        let worst = common::max_logit_error(&got, &want);
        assert!(
            worst < 1e-3,
            "{backend}: in place, max |logit error| {worst}"
        );
    }

    // A weight type kvplug does not compute (Q2_K) is refused by name when indexing, never
    // widened.
    let name = gguf_name(&shapes.iter().find(|(_, s)| s.len() == 2).unwrap().0);
    let q2: Vec<(String, QTensor)> = tensors
        .iter()
        .map(|(n, t)| {
            let values = t.dequantize(&Device::Cpu).unwrap();
            let dtype = if *n == name {
                GgmlDType::Q2K
            } else {
                GgmlDType::F32
            };
            (n.clone(), QTensor::quantize(&values, dtype).unwrap())
        })
        .collect();
    let bad = dir.path().join("q2k.gguf");
    write_gguf(&bad, &meta, &q2);
    let e = kvplug_host::gguf::index(&bad, &dir.path().join("q2k"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&name) && e.contains("Q2K") && e.contains("cannot compute"),
        "{e}"
    );

    // Text: the tokenizer round-trips, special tokens are whole, the template renders,
    // and the end-of-turn token stops generation.
    let text = Text::load(&out).unwrap();
    let hello = "hello world 42, ünïcode";
    let ids = text.encode(hello).unwrap();
    assert!(
        ids.contains(&(256 + 2)),
        "the 'hell' merge is used: {ids:?}"
    );
    assert_eq!(text.decode(&ids).unwrap(), hello);
    let prompt = text
        .render(&[
            Message::new("system", " be brief "),
            Message::new("user", "hi"),
        ])
        .unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = text.encode(&prompt).unwrap();
    assert_eq!(ids[0], first_special as i32);
    assert!(text.stop_tokens().contains(&(first_special as i32 + 1)));
}
