//! Mixtures of experts: Qwen3-MoE GGUFs (a router and 3-D expert tensors in every layer) on
//! every backend against the f64 reference forward, and a token's result independent of the
//! batch it is routed in.

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use kvplug::{Batch, CacheKind, KvDtype};

use crate::common;
use common::{
    bpe_tokenizer_meta, forward, greedy_logit_error, runtime, values, write_gguf, write_gguf_raw,
    yarn_inv_freq, RawTensor, Reference, BACKENDS, MERGES,
};

const HIDDEN: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const VOCAB: usize = 300;
const PROMPT: [i32; 9] = [3, 141, 59, 26, 53, 58, 97, 93, 238];

/// A Qwen3-MoE file's shape: `experts` experts of `width` per layer, `per_token` of them per
/// token; expert matrices in `types` (cycled), attention and router f32 (llama-quantize
/// keeps routers f32); an output matrix unless `tied`.
struct Shape<'a> {
    layers: usize,
    experts: usize,
    per_token: usize,
    width: usize,
    types: &'a [GgmlDType],
    tied: bool,
}

/// Writes the GGUF of `s` and indexes it under `dir`; returns the indexed model.
fn qwen3moe(dir: &Path, s: &Shape) -> PathBuf {
    let hd = HIDDEN / HEADS;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let (mut salt, mut matrix) = (200, 0);
    let mut add = |name: String, shape: &[usize], gain: f32, ty: Option<&[GgmlDType]>| {
        salt += 1;
        let mut data = values(shape.iter().product(), salt, gain);
        if shape.len() == 1 {
            data.iter_mut().for_each(|x| *x += 1.0);
        }
        let ty = ty.map_or(GgmlDType::F32, |types| {
            matrix += 1;
            types[matrix % types.len()]
        });
        let t = Tensor::from_vec(data, shape, &Device::Cpu).unwrap();
        tensors.push((name, QTensor::quantize(&t, ty).unwrap()));
    };
    let f32s = Some(&[GgmlDType::F32][..]);
    add("token_embd.weight".into(), &[VOCAB, HIDDEN], 1.0, f32s);
    add("output_norm.weight".into(), &[HIDDEN], 0.1, None);
    if !s.tied {
        add("output.weight".into(), &[VOCAB, HIDDEN], 0.5, f32s);
    }
    let (e, w) = (s.experts, s.width);
    for l in 0..s.layers {
        let b = |n: &str| format!("blk.{l}.{n}.weight");
        add(b("attn_norm"), &[HIDDEN], 0.1, None);
        add(b("attn_q"), &[HEADS * hd, HIDDEN], 0.3, f32s);
        add(b("attn_k"), &[KV_HEADS * hd, HIDDEN], 0.3, f32s);
        add(b("attn_v"), &[KV_HEADS * hd, HIDDEN], 0.3, f32s);
        add(b("attn_output"), &[HIDDEN, HEADS * hd], 0.3, f32s);
        add(b("attn_q_norm"), &[hd], 0.1, None);
        add(b("attn_k_norm"), &[hd], 0.1, None);
        add(b("ffn_norm"), &[HIDDEN], 0.1, None);
        // Router logits a few units apart: the choice is not decided by rounding.
        add(b("ffn_gate_inp"), &[e, HIDDEN], 1.0, f32s);
        add(b("ffn_gate_exps"), &[e, w, HIDDEN], 0.3, Some(s.types));
        add(b("ffn_up_exps"), &[e, w, HIDDEN], 0.3, Some(s.types));
        add(b("ffn_down_exps"), &[e, HIDDEN, w], 0.3, Some(s.types));
    }
    let u = |x: usize| Value::U32(x as u32);
    let mut meta = vec![
        ("general.architecture", Value::String("qwen3moe".into())),
        ("qwen3moe.block_count", u(s.layers)),
        ("qwen3moe.embedding_length", u(HIDDEN)),
        ("qwen3moe.feed_forward_length", u(4 * HIDDEN)),
        ("qwen3moe.expert_feed_forward_length", u(w)),
        ("qwen3moe.expert_count", u(e)),
        ("qwen3moe.expert_used_count", u(s.per_token)),
        ("qwen3moe.attention.head_count", u(HEADS)),
        ("qwen3moe.attention.head_count_kv", u(KV_HEADS)),
        ("qwen3moe.attention.key_length", u(hd)),
        ("qwen3moe.attention.value_length", u(hd)),
        (
            "qwen3moe.attention.layer_norm_rms_epsilon",
            Value::F32(1e-6),
        ),
        ("qwen3moe.rope.freq_base", Value::F32(1e6)),
        ("qwen3moe.context_length", u(2048)),
    ];
    meta.extend(bpe_tokenizer_meta("qwen2", &MERGES, VOCAB).0);
    std::fs::create_dir_all(dir).unwrap();
    let gguf = dir.join("qwen3moe.gguf");
    write_gguf(&gguf, &meta, &tensors);
    let model = dir.join("indexed");
    kvplug::formats::gguf::index(&gguf, &model).unwrap();
    model
}

#[test]
fn qwen3moe_gguf_decodes_within_the_f64_reference_on_every_backend() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = [
        GgmlDType::Q8_0,
        GgmlDType::Q4_0,
        GgmlDType::Q5_1,
        GgmlDType::Q4_1,
    ];
    // 8 experts, 2 per token, f32, tied; 6 experts, 3 per token, block formats, untied.
    let shapes = [
        Shape {
            layers: 3,
            experts: 8,
            per_token: 2,
            width: 32,
            types: &[GgmlDType::F32],
            tied: true,
        },
        Shape {
            layers: 2,
            experts: 6,
            per_token: 3,
            width: 64,
            types: &blocks,
            tied: false,
        },
    ];
    for (i, shape) in shapes.iter().enumerate() {
        let model = qwen3moe(&dir.path().join(i.to_string()), shape);
        for backend in BACKENDS {
            // The prompt in one step (its tokens grouped by expert), then one at a time.
            let worst = greedy_logit_error(&model, backend, &PROMPT, Reference::default());
            // The f32 tolerance of the model tests (model.rs).
            assert!(
                worst < 1e-3,
                "Qwen3-MoE shape {i} on {backend}: max |logit error| {worst}"
            );
        }
    }
}

/// Five sequences forked from one prompt and decoded in one batch give each sequence's
/// logits as decoding it alone does. Five tokens route 10 times over 8 experts, two per
/// token and distinct within a token: some expert runs rows of two tokens in one group.
#[test]
fn a_tokens_experts_do_not_depend_on_its_batch() {
    let dir = tempfile::tempdir().unwrap();
    let model = qwen3moe(
        dir.path(),
        &Shape {
            layers: 2,
            experts: 8,
            per_token: 2,
            width: 32,
            types: &[GgmlDType::Q8_0],
            tied: true,
        },
    );
    let rt = runtime();
    let m = common::model(&rt, "cpu", &model);
    let positions: Vec<i32> = (0..PROMPT.len() as i32).collect();
    let alone = |next: i32| {
        let mut ctx = m.context(CacheKind::Contiguous, 64, KvDtype::F32).unwrap();
        forward(&mut ctx, &PROMPT, &positions);
        forward(&mut ctx, &[next], &[9]).remove(0)
    };
    let mut ctx = m.context(CacheKind::Seq, 64, KvDtype::F32).unwrap();
    let mut b = Batch::new();
    for (&t, &p) in PROMPT.iter().zip(&positions) {
        b.push(t, p, 0, false);
    }
    ctx.decode(&b).unwrap();
    let next = [7, 9, 11, 40, 77];
    for s in 1..next.len() as i32 {
        ctx.seq_cp(0, s, None, None).unwrap();
    }
    let mut b = Batch::new();
    for (s, &t) in next.iter().enumerate() {
        b.push(t, 9, s as i32, true);
    }
    let rows: Vec<Vec<f32>> = ctx
        .decode(&b)
        .unwrap()
        .rows()
        .map(<[f32]>::to_vec)
        .collect();
    for (row, &t) in rows.iter().zip(&next) {
        let want = alone(t);
        let worst = row
            .iter()
            .zip(&want)
            .map(|(a, b)| f64::from((a - b).abs()))
            .fold(0.0, common::nan_max);
        // The experts' arithmetic is per row; only attention's read order may differ.
        assert!(worst < 1e-4, "token {t}: max |logit diff| {worst}");
    }
}

/// `plan` counts the experts' parameters and bytes, and what a token runs: all but the
/// experts it is not routed to.
#[test]
fn plans_count_total_and_active_parameters() {
    let dir = tempfile::tempdir().unwrap();
    let (layers, experts, per_token, width) = (3, 8, 2, 32);
    let model = qwen3moe(
        dir.path(),
        &Shape {
            layers,
            experts,
            per_token,
            width,
            types: &[GgmlDType::Q8_0],
            tied: true,
        },
    );
    let p = kvplug::plan(&kvplug::PlanOptions {
        model,
        budget: 1 << 30,
        kv_dtype: KvDtype::F16,
        agent_tokens: 100,
        holding: Default::default(),
    })
    .unwrap();
    let (h, hd) = (HIDDEN, HIDDEN / HEADS);
    let attention = h + 2 * HEADS * hd * h + 2 * KV_HEADS * hd * h + 2 * hd;
    let expert = 3 * width * h;
    let layer = attention + h + experts * h + experts * expert;
    let total = VOCAB * h + h + layers * layer;
    let idle = layers * (experts - per_token) * expert;
    assert_eq!(
        (p.weights.parameters, p.weights.active_parameters),
        (total as u64, (total - idle) as u64)
    );
    // Q8_0: 34 bytes per 32 values.
    let expert_bytes = (layers * experts * expert / 32 * 34) as u64;
    assert_eq!(p.weights.expert_bytes, expert_bytes);
    assert_eq!(
        p.weights.weight_bytes - p.weights.step_bytes,
        expert_bytes * (experts - per_token) as u64 / experts as u64
    );
    assert!(p.render().contains("a token runs"), "{}", p.render());
}

/// A GPT-OSS file's shape: layers alternating sliding (`window`) and full attention from
/// layer 0, `experts` of `width` with `per_token` per token; expert matrices in `types`, or
/// in MXFP4 (as GPT-OSS ships them) where `types` is empty.
struct OssShape<'a> {
    layers: usize,
    window: usize,
    experts: usize,
    per_token: usize,
    width: usize,
    types: &'a [GgmlDType],
}

/// `n` values' random MXFP4 blocks (ggml type 39): scales 2^-7..=2^-4, random codes.
fn mxfp4_blocks(n: usize, salt: u64) -> Vec<u8> {
    let bytes = values(n / 32 * 17, salt, 1.0);
    let byte = |x: f32| ((x + 1.0) * 127.5) as u8;
    let at = bytes.iter().enumerate();
    at.map(|(i, &x)| {
        if i % 17 == 0 {
            121 + byte(x) % 4
        } else {
            byte(x)
        }
    })
    .collect()
}

/// GPT-OSS's YaRN: factor 32 over 4096 original positions, rope base 150000.
const YARN_FACTOR: f64 = 32.0;
const YARN_ORIGINAL: f64 = 4096.0;
const OSS_THETA: f64 = 150000.0;

/// Writes a GPT-OSS GGUF of `s` (as llama.cpp's converter names it) and indexes it.
fn gpt_oss(dir: &Path, s: &OssShape) -> PathBuf {
    let hd = HIDDEN / HEADS;
    let mut tensors: Vec<RawTensor> = Vec::new();
    let (mut salt, mut matrix) = (300, 0);
    let mut add =
        |name: String, shape: &[usize], gain: f32, offset: f32, ty: Option<&[GgmlDType]>| {
            salt += 1;
            let n = shape.iter().product();
            if ty.is_some_and(|types| types.is_empty()) {
                return tensors.push(RawTensor {
                    name,
                    dims: shape.to_vec(),
                    ggml_type: 39,
                    bytes: mxfp4_blocks(n, salt),
                });
            }
            let mut data = values(n, salt, gain);
            data.iter_mut().for_each(|x| *x += offset);
            let ty = ty.map_or(GgmlDType::F32, |types| {
                matrix += 1;
                types[matrix % types.len()]
            });
            let t = Tensor::from_vec(data, shape, &Device::Cpu).unwrap();
            tensors.push(RawTensor::of(&name, &QTensor::quantize(&t, ty).unwrap()));
        };
    add("token_embd.weight".into(), &[VOCAB, HIDDEN], 1.0, 0.0, None);
    add("output_norm.weight".into(), &[HIDDEN], 0.1, 1.0, None);
    add("output.weight".into(), &[VOCAB, HIDDEN], 0.5, 0.0, None);
    let (e, w) = (s.experts, s.width);
    for l in 0..s.layers {
        let b = |n: &str| format!("blk.{l}.{n}");
        add(b("attn_norm.weight"), &[HIDDEN], 0.1, 1.0, None);
        for (proj, rows) in [("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)] {
            add(
                b(&format!("attn_{proj}.weight")),
                &[rows * hd, HIDDEN],
                0.3,
                0.0,
                None,
            );
            add(
                b(&format!("attn_{proj}.bias")),
                &[rows * hd],
                0.3,
                0.0,
                None,
            );
        }
        add(
            b("attn_output.weight"),
            &[HIDDEN, HEADS * hd],
            0.3,
            0.0,
            None,
        );
        add(b("attn_output.bias"), &[HIDDEN], 0.3, 0.0, None);
        add(b("attn_sinks.weight"), &[HEADS], 1.0, 0.5, None);
        add(b("post_attention_norm.weight"), &[HIDDEN], 0.1, 1.0, None);
        add(b("ffn_gate_inp.weight"), &[e, HIDDEN], 1.0, 0.0, None);
        add(b("ffn_gate_inp.bias"), &[e], 0.5, 0.0, None);
        add(
            b("ffn_gate_exps.weight"),
            &[e, w, HIDDEN],
            0.5,
            0.0,
            Some(s.types),
        );
        add(
            b("ffn_up_exps.weight"),
            &[e, w, HIDDEN],
            0.5,
            0.0,
            Some(s.types),
        );
        add(
            b("ffn_down_exps.weight"),
            &[e, HIDDEN, w],
            0.3,
            0.0,
            Some(s.types),
        );
        add(b("ffn_gate_exps.bias"), &[e, w], 0.3, 0.0, None);
        add(b("ffn_up_exps.bias"), &[e, w], 0.3, 0.0, None);
        add(b("ffn_down_exps.bias"), &[e, HIDDEN], 0.3, 0.0, None);
    }
    let u = |x: usize| Value::U32(x as u32);
    let mut meta = vec![
        ("general.architecture", Value::String("gpt-oss".into())),
        ("gpt-oss.block_count", u(s.layers)),
        ("gpt-oss.embedding_length", u(HIDDEN)),
        ("gpt-oss.feed_forward_length", u(w)),
        ("gpt-oss.expert_feed_forward_length", u(w)),
        ("gpt-oss.expert_count", u(e)),
        ("gpt-oss.expert_used_count", u(s.per_token)),
        ("gpt-oss.attention.head_count", u(HEADS)),
        ("gpt-oss.attention.head_count_kv", u(KV_HEADS)),
        ("gpt-oss.attention.key_length", u(hd)),
        ("gpt-oss.attention.value_length", u(hd)),
        ("gpt-oss.attention.sliding_window", u(s.window)),
        ("gpt-oss.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("gpt-oss.rope.freq_base", Value::F32(OSS_THETA as f32)),
        ("gpt-oss.rope.scaling.type", Value::String("yarn".into())),
        (
            "gpt-oss.rope.scaling.factor",
            Value::F32(YARN_FACTOR as f32),
        ),
        (
            "gpt-oss.rope.scaling.original_context_length",
            u(YARN_ORIGINAL as usize),
        ),
        ("gpt-oss.context_length", u(131072)),
    ];
    meta.extend(bpe_tokenizer_meta("qwen2", &MERGES, VOCAB).0);
    std::fs::create_dir_all(dir).unwrap();
    let gguf = dir.join("gpt-oss.gguf");
    write_gguf_raw(&gguf, &meta, &tensors);
    let model = dir.join("indexed");
    kvplug::formats::gguf::index(&gguf, &model).unwrap();
    model
}

/// `plan` counts MXFP4 experts as stored (17 bytes a block) for a backend that reads them
/// in place, as Q5_0 (22 bytes) for one that re-encodes them, and says the difference.
#[test]
fn plans_count_mxfp4_as_stored_and_say_what_re_encoding_adds() {
    let dir = tempfile::tempdir().unwrap();
    let (layers, experts, width) = (2, 4, 64);
    let shape = OssShape {
        layers,
        window: 4,
        experts,
        per_token: 2,
        width,
        types: &[],
    };
    let model = gpt_oss(dir.path(), &shape);
    let plan = |reencodes_mxfp4, widened: &[&str]| {
        kvplug::plan(&kvplug::PlanOptions {
            model: model.clone(),
            budget: 1 << 30,
            kv_dtype: KvDtype::F16,
            agent_tokens: 100,
            holding: kvplug::Holding {
                reencodes_mxfp4,
                widened: widened.iter().map(|w| w.to_string()).collect(),
            },
        })
        .unwrap()
    };
    let (in_place, reencoded) = (plan(false, &[]), plan(true, &[]));
    // A backend that widens Q5_0 (mlx on its CPU) holds the re-encoded experts as f32.
    let widened = plan(true, &["q5_0"]);
    let blocks = (layers * experts * 3 * width * HIDDEN / 32) as u64;
    // And the experts' f32 biases.
    let biases = (layers * experts * (2 * width + HIDDEN) * 4) as u64;
    assert_eq!(in_place.weights.expert_bytes, blocks * 17 + biases);
    assert_eq!(reencoded.weights.expert_bytes, blocks * 22 + biases);
    assert_eq!(widened.weights.expert_bytes, blocks * 32 * 4 + biases);
    assert_eq!(widened.weights.widened_extra_bytes, blocks * (32 * 4 - 22));
    assert_eq!(in_place.weights.widened_extra_bytes, 0);
    assert!(
        widened.render().contains("block formats widened to f32"),
        "{}",
        widened.render()
    );
    for p in [&in_place, &reencoded, &widened] {
        assert_eq!(p.weights.reencoded_extra_bytes, blocks * 5);
    }
    assert_eq!(
        reencoded.weights.weight_bytes - in_place.weights.weight_bytes,
        blocks * 5
    );
    assert!(reencoded.tokens < in_place.tokens);
    assert!(
        in_place.render().contains("MXFP4 read in place")
            && reencoded.render().contains("MXFP4 re-encoded at load"),
        "{}\n{}",
        in_place.render(),
        reencoded.render()
    );
}

#[test]
fn gpt_oss_gguf_decodes_within_the_f64_reference_on_every_backend() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = [GgmlDType::Q8_0, GgmlDType::Q4_0, GgmlDType::Q4_1];
    // A 4-token window over 15 tokens: the sliding layers see only their last 4.
    let shapes = [
        OssShape {
            layers: 3,
            window: 4,
            experts: 8,
            per_token: 2,
            width: 32,
            types: &[GgmlDType::F32],
        },
        OssShape {
            layers: 2,
            window: 3,
            experts: 6,
            per_token: 4,
            width: 64,
            types: &blocks,
        },
        OssShape {
            layers: 2,
            window: 5,
            experts: 8,
            per_token: 4,
            width: 96,
            types: &[],
        },
    ];
    for (i, shape) in shapes.iter().enumerate() {
        let model = gpt_oss(&dir.path().join(i.to_string()), shape);
        for backend in BACKENDS {
            let told = Reference {
                inv_freq: Some(yarn_inv_freq(
                    OSS_THETA,
                    HIDDEN / HEADS,
                    YARN_FACTOR,
                    YARN_ORIGINAL,
                )),
                rope_magnitude: Some(1.0 + 0.1 * YARN_FACTOR.ln()),
                config_windows: true,
                ..Reference::default()
            };
            let worst = greedy_logit_error(&model, backend, &PROMPT, told);
            // The f32 tolerance of the model tests (model.rs).
            assert!(
                worst < 1e-3,
                "GPT-OSS shape {i} on {backend}: max |logit error| {worst}"
            );
        }
    }
}
