//! GGUF import: a GGUF written here (Llama shape, q/k rows permuted as llama.cpp's converter
//! does, every weight in a different ggml type including K-quants, a byte-level BPE
//! vocabulary and a chat template) imports into a model directory whose weights are exactly
//! the dequantized ones, whose logits match the f64 reference, and whose tokenizer and
//! template work.

use std::collections::BTreeMap;
use std::path::PathBuf;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use kvplug::formats::gguf;
use kvplug::formats::synth::{synth, Preset};
use kvplug::{CacheKind, KvDtype, Message, Text};
use kvplug_backend_kit::model::ModelPackage;

use crate::common;
use common::{
    bpe_tokenizer_meta, forward, gguf_name, gguf_tensors, hf_tensor_shapes, llama_gguf_meta,
    matrix_type, reference_logits, runtime, write_gguf, MERGES,
};

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
    let tensors = gguf_tensors(&pkg, &PRESET, &types, false);
    // What the import must produce: each weight quantized and dequantized (a row-wise
    // round trip commutes with the converter's row permutation).
    let mut expect: BTreeMap<String, Vec<f32>> = BTreeMap::new();
    for (i, (name, shape)) in shapes.iter().enumerate() {
        let dev = &Device::Cpu;
        let data = Tensor::from_vec(pkg.tensor_f32(name, shape).unwrap(), shape.as_slice(), dev);
        let round_trip = QTensor::quantize(&data.unwrap(), matrix_type(&types, i, shape))
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
    }
    let (tokenizer, tokens) = bpe_tokenizer_meta("smollm", &MERGES, PRESET.vocab);
    let first_special = tokens.iter().position(|t| t == "<|im_start|>").unwrap();
    let mut meta = llama_gguf_meta(
        &PRESET,
        pkg.config.rms_norm_eps as f32,
        pkg.config.rope_theta as f32,
    );
    meta.extend(tokenizer);
    let gguf = dir.path().join("model.gguf");
    write_gguf(&gguf, &meta, &tensors);

    let out: PathBuf = dir.path().join("imported");
    gguf::import(&gguf, &out, &mut |_, _, _| {}).unwrap();
    let e = gguf::import(&gguf, &out, &mut |_, _, _| {})
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
    let rt = runtime();
    let f32_context = |backend: &str, dir: &std::path::Path| {
        common::model(&rt, backend, dir)
            .context(CacheKind::Contiguous, 64, KvDtype::F32)
            .unwrap()
    };
    let tokens = [5, 77, 260, 3, 199];
    let positions: Vec<i32> = (0..tokens.len() as i32).collect();
    let got = forward(&mut f32_context("cpu", &out), &tokens, &positions);
    let want = reference_logits(&out, &tokens);
    let worst = common::max_logit_error(&got, &want);
    assert!(worst < 1e-3, "max |logit error| {worst}");

    // In place: the index serves the GGUF's own blocks (the kit's dequantization of each
    // tensor equals candle's, bit for bit) and every backend's logits track the f64
    // reference over those weights (q/k rows still permuted: the reference pairs its rotary
    // halves as the package says).
    let indexed = dir.path().join("indexed");
    gguf::index(&gguf, &indexed).unwrap();
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
        let got = forward(&mut f32_context(backend, &indexed), &tokens, &positions);
        let worst = common::max_logit_error(&got, &want);
        assert!(
            worst < 1e-3,
            "{backend}: in place, max |logit error| {worst}"
        );
        // The same file read into memory (--no-mmap) computes the same logits, bit for bit.
        let mut loaded = common::model(&rt, backend, &indexed)
            .with_mmap(false)
            .context(CacheKind::Contiguous, 64, KvDtype::F32)
            .unwrap();
        let bits = |l: &[Vec<f32>]| -> Vec<Vec<u32>> {
            l.iter()
                .map(|r| r.iter().map(|x| x.to_bits()).collect())
                .collect()
        };
        assert!(
            bits(&forward(&mut loaded, &tokens, &positions)) == bits(&got),
            "{backend}: the GGUF read into memory gives other logits than mapped"
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
    let e = gguf::index(&bad, &dir.path().join("q2k"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&name) && e.contains("q2_K") && e.contains("cannot compute"),
        "{e}"
    );

    // A NaN weight is named as the GGUF holds it, with the file (not the Hugging Face name
    // of the index it is served from).
    let nan: Vec<(String, QTensor)> = tensors
        .iter()
        .map(|(n, t)| {
            let mut v = t.dequantize(&Device::Cpu).unwrap();
            if *n == name {
                let mut data = v.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                data[2] = f32::NAN;
                v = Tensor::from_vec(data, v.shape(), &Device::Cpu).unwrap();
            }
            (n.clone(), QTensor::quantize(&v, GgmlDType::F32).unwrap())
        })
        .collect();
    let file = dir.path().join("nan.gguf");
    write_gguf(&file, &meta, &nan);
    let out = dir.path().join("nan");
    gguf::index(&file, &out).unwrap();
    let rt = runtime();
    let e = common::model(&rt, "cpu", &out)
        .context(CacheKind::Contiguous, 64, KvDtype::F32)
        .err()
        .expect("a NaN weight is refused")
        .to_string();
    let says = format!(
        "{}: tensor '{name}' has a NaN or infinite value at element 2",
        file.canonicalize().unwrap().display()
    );
    assert!(e.contains(&says), "{e}");

    // Metadata that contradicts itself is refused naming the GGUF file (not the index's
    // derived config.json) and the fault; a NaN or infinite number, naming its key.
    {
        use candle_core::quantized::gguf_file::Value;
        let rt = runtime();
        let with = |key: &str, value: Value, n: usize| {
            let mut m = meta.clone();
            m.iter_mut().find(|kv| kv.0 == key).unwrap().1 = value.clone();
            let file = dir.path().join(format!("bad{n}.gguf"));
            write_gguf(&file, &m, &tensors);
            let out = dir.path().join(format!("bad{n}"));
            let e = gguf::index(&file, &out)
                .map_err(|e| e.to_string())
                .and_then(|()| rt.model("cpu", &out).map_err(|e| e.to_string()))
                .err()
                .unwrap_or_else(|| panic!("{key} = {value:?} was accepted"));
            (file, e)
        };
        let (file, e) = with("llama.attention.head_count", Value::U32(0), 0);
        let named = format!("{}: ", file.canonicalize().unwrap().display());
        assert!(e.starts_with(&named) && e.contains("heads 0"), "{e}");
        // `plan` reads the same config and names the same file.
        let e = kvplug::plan(&kvplug::PlanOptions {
            model: dir.path().join("bad0"),
            budget: 1 << 30,
            kv_dtype: KvDtype::F16,
            agent_tokens: 100,
            holding: Default::default(),
        })
        .unwrap_err()
        .to_string();
        assert!(e.starts_with(&named) && e.contains("heads 0"), "{e}");
        // A context length of 0 states none: a chat gets the default capacity, not 1 token.
        let mut m = meta.clone();
        m.iter_mut()
            .find(|kv| kv.0 == "llama.context_length")
            .unwrap()
            .1 = Value::U32(0);
        let file = dir.path().join("no-context.gguf");
        write_gguf(&file, &m, &tensors);
        let out = dir.path().join("no-context");
        gguf::index(&file, &out).unwrap();
        assert_eq!(kvplug::default_capacity(&out, KvDtype::F16).unwrap(), 4096);
        let key = "llama.attention.layer_norm_rms_epsilon";
        let (_, e) = with(key, Value::F32(f32::NAN), 1);
        assert!(
            e.contains(&format!("metadata '{key}' is NaN, not a finite number")),
            "{e}"
        );
        // A value of another type is refused by its key, not read as absent (a negative
        // context length would have given the default capacity; a template no template).
        for (n, key, value) in [
            (4, "llama.context_length", Value::I32(-5)),
            (5, "tokenizer.chat_template", Value::U32(7)),
        ] {
            let (_, e) = with(key, value, n);
            assert!(e.contains(&format!("metadata '{key}'")), "{e}");
        }
        // A `llama` file whose rotary dims are not the head's (llama.cpp refuses them too;
        // read as all, the model would run with the wrong positions).
        let head = PRESET.hidden / PRESET.heads;
        for (n, rot) in [(2, head / 2), (3, 2 * head)] {
            let mut m = meta.clone();
            m.push(("llama.rope.dimension_count", Value::U32(rot as u32)));
            let file = dir.path().join(format!("bad{n}.gguf"));
            write_gguf(&file, &m, &tensors);
            let e = gguf::index(&file, &dir.path().join(format!("bad{n}")))
                .unwrap_err()
                .to_string();
            let says = format!("rope.dimension_count {rot} is not the head size {head}");
            assert!(e.contains(&says), "{e}");
        }
    }

    // Text: the tokenizer round-trips, special tokens are whole, the template renders,
    // and the end-of-turn token stops generation.
    let text = Text::load(&out).unwrap();
    let hello = "hello world 42, ünïcode";
    let ids = text.encode(hello).unwrap();
    assert!(
        ids.contains(&(256 + 2)),
        "the 'hell' merge is used: {ids:?}"
    );
    assert_eq!(text.detokenize(&ids).unwrap(), hello);
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

/// Every block format's dequantization (the kit's `dequantize_row`, which the backends'
/// kernels are checked against) equals candle's, bit for bit, on blocks of random bytes:
/// every code, sub-block scale and 5th/6th-bit pattern, with random finite f16 scales and
/// minimums of both signs, zero and subnormal ones included.
#[test]
fn every_block_format_dequantizes_like_candle_on_random_blocks() {
    use kvplug_backend_kit::model::blocks::{dequantize_row, BLOCK_FORMATS};
    use kvplug_backend_kit::model::BlockFormat as F;
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for format in BLOCK_FORMATS {
        let ggml = match format {
            F::Q4_0 => GgmlDType::Q4_0,
            F::Q4_1 => GgmlDType::Q4_1,
            F::Q5_0 => GgmlDType::Q5_0,
            F::Q5_1 => GgmlDType::Q5_1,
            F::Q8_0 => GgmlDType::Q8_0,
            F::Q4K => GgmlDType::Q4K,
            F::Q5K => GgmlDType::Q5K,
            F::Q6K => GgmlDType::Q6K,
            F::Mxfp4 => unreachable!("MXFP4 is not in BLOCK_FORMATS (candle has no MXFP4)"),
        };
        let blocks = 96;
        let mut bytes: Vec<u8> = (0..blocks * format.block_bytes())
            .map(|_| next() as u8)
            .collect();
        for (b, block) in bytes.chunks_exact_mut(format.block_bytes()).enumerate() {
            for &at in format.half_fields() {
                let h = match b % 8 {
                    0 => half::f16::ZERO,
                    1 => half::f16::from_bits(next() as u16 & 0x83ff), // subnormal, either sign
                    _ => half::f16::from_f32((next() % 20_000) as f32 / 1e4 - 1.0),
                };
                block[at..at + 2].copy_from_slice(&h.to_le_bytes());
            }
        }
        let values = blocks * format.block_elems();
        let want = candle_core::quantized::ggml_file::qtensor_from_ggml(
            ggml,
            &bytes,
            vec![values],
            &Device::Cpu,
        )
        .unwrap()
        .dequantize(&Device::Cpu)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
        let mut got = vec![0f32; values];
        dequantize_row(format, &bytes, &mut got);
        let differ = got
            .iter()
            .zip(&want)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        assert!(
            differ.is_none(),
            "{}: value {} is {} where candle gives {}",
            format.name(),
            differ.unwrap(),
            got[differ.unwrap()],
            want[differ.unwrap()]
        );
    }
}
