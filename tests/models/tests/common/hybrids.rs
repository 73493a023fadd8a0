//! Random-weight hybrid GGUFs (LFM2, Qwen3.5, Granite 4.0-H) written with candle's GGUF writer, an
//! implementation independent of the loader under test.

use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use super::{bpe_tokenizer_meta, values, write_gguf, MERGES};

pub const HIDDEN: usize = 64;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const FFN: usize = 128;
pub const VOCAB: usize = 300;
pub const PROMPT: [i32; 9] = [3, 141, 59, 26, 53, 58, 97, 93, 238];

/// The shape of an LFM2 file: `layers` layers, those in `attention` attending (through a
/// sliding `window` when given), the others convolving over `taps` positions; matrices in
/// `types` (cycled), vectors and the convolution kernel f32; no output matrix when `tied`.
pub struct Shape<'a> {
    pub layers: usize,
    pub attention: &'a [usize],
    pub taps: usize,
    pub types: &'a [GgmlDType],
    pub tied: bool,
    pub window: Option<usize>,
}

/// Three f32 layers, the middle one attending, convolutions of 3 taps.
pub const SMALL_LFM2: Shape<'static> = Shape {
    layers: 3,
    attention: &[1],
    taps: 3,
    types: &[GgmlDType::F32],
    tied: true,
    window: None,
};

/// Writes an LFM2 GGUF of `shape` (with `template` as its chat template when given).
pub fn write_lfm2(path: &Path, shape: &Shape, template: Option<&str>) {
    let Shape {
        layers,
        attention,
        taps,
        types,
        tied,
        window,
    } = *shape;
    let hd = HIDDEN / HEADS;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut salt = 0;
    let mut add = |name: String, shape: &[usize], gain: f32, ty: GgmlDType| {
        salt += 1;
        let n = shape.iter().product();
        let mut data = values(n, salt, gain);
        if shape.len() == 1 {
            // Norm weights near 1.
            data.iter_mut().for_each(|x| *x += 1.0);
        }
        let t = Tensor::from_vec(data, shape, &Device::Cpu).unwrap();
        tensors.push((name, QTensor::quantize(&t, ty).unwrap()));
    };
    let mut matrix = 0;
    let mut next_type = || {
        matrix += 1;
        types[matrix % types.len()]
    };
    add(
        "token_embd.weight".into(),
        &[VOCAB, HIDDEN],
        1.0,
        next_type(),
    );
    add(
        "token_embd_norm.weight".into(),
        &[HIDDEN],
        0.1,
        GgmlDType::F32,
    );
    if !tied {
        add("output.weight".into(), &[VOCAB, HIDDEN], 0.5, next_type());
    }
    for l in 0..layers {
        let b = |n: &str| format!("blk.{l}.{n}.weight");
        add(b("attn_norm"), &[HIDDEN], 0.1, GgmlDType::F32);
        add(b("ffn_norm"), &[HIDDEN], 0.1, GgmlDType::F32);
        add(b("ffn_gate"), &[FFN, HIDDEN], 0.3, next_type());
        add(b("ffn_up"), &[FFN, HIDDEN], 0.3, next_type());
        add(b("ffn_down"), &[HIDDEN, FFN], 0.3, next_type());
        if attention.contains(&l) {
            add(b("attn_q"), &[HEADS * hd, HIDDEN], 0.3, next_type());
            add(b("attn_k"), &[KV_HEADS * hd, HIDDEN], 0.3, next_type());
            add(b("attn_v"), &[KV_HEADS * hd, HIDDEN], 0.3, next_type());
            add(b("attn_output"), &[HIDDEN, HEADS * hd], 0.3, next_type());
            add(b("attn_q_norm"), &[hd], 0.1, GgmlDType::F32);
            add(b("attn_k_norm"), &[hd], 0.1, GgmlDType::F32);
        } else {
            add(b("shortconv.conv"), &[HIDDEN, taps], 0.8, GgmlDType::F32);
            add(
                b("shortconv.in_proj"),
                &[3 * HIDDEN, HIDDEN],
                0.5,
                next_type(),
            );
            add(b("shortconv.out_proj"), &[HIDDEN, HIDDEN], 0.5, next_type());
        }
    }
    let u = |x: usize| Value::U32(x as u32);
    let mut meta = vec![
        ("general.architecture", Value::String("lfm2".into())),
        ("lfm2.block_count", u(layers)),
        ("lfm2.embedding_length", u(HIDDEN)),
        ("lfm2.feed_forward_length", u(FFN)),
        ("lfm2.attention.head_count", u(HEADS)),
        (
            "lfm2.attention.head_count_kv",
            Value::Array(
                (0..layers)
                    .map(|l| u(if attention.contains(&l) { KV_HEADS } else { 0 }))
                    .collect(),
            ),
        ),
        ("lfm2.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("lfm2.rope.freq_base", Value::F32(1e6)),
        ("lfm2.context_length", u(2048)),
        ("lfm2.shortconv.l_cache", u(taps)),
        ("lfm2.vocab_size", u(VOCAB)),
    ];
    if let Some(w) = window {
        meta.push(("lfm2.attention.sliding_window", u(w)));
    }
    tokenizer_meta(&mut meta, template);
    write_gguf(path, &meta, &tensors);
}

/// Appends the test tokenizer's metadata to `meta`, with `template` as its chat template
/// when given.
fn tokenizer_meta(meta: &mut Vec<(&'static str, Value)>, template: Option<&str>) {
    meta.extend(bpe_tokenizer_meta("qwen2", &MERGES, VOCAB).0);
    if let Some(t) = template {
        let at = meta.iter().position(|m| m.0 == "tokenizer.chat_template");
        meta[at.expect("the tokenizer has a template")].1 = Value::String(t.into());
    }
}

/// The indexed model of [`write_lfm2`] in `dir`.
pub fn lfm2(dir: &Path, shape: &Shape) -> std::path::PathBuf {
    lfm2_templated(dir, shape, None)
}

/// [`lfm2`] with `template` as its chat template when given.
pub fn lfm2_templated(dir: &Path, shape: &Shape, template: Option<&str>) -> std::path::PathBuf {
    indexed(dir, "lfm2", |gguf| write_lfm2(gguf, shape, template))
}

/// Writes `dir/NAME.gguf` with `write` and indexes it into `dir/indexed`, returned.
fn indexed(dir: &Path, name: &str, write: impl FnOnce(&Path)) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let gguf = dir.join(format!("{name}.gguf"));
    write(&gguf);
    let model = dir.join("indexed");
    kvplug::formats::gguf::index(&gguf, &model).unwrap();
    model
}

/// Random tensors for a GGUF: each `salt`ed apart, 2-D matrices `hidden` wide in the next
/// of `types` (cycled), the rest f32.
struct RandomTensors<'a> {
    tensors: Vec<(String, QTensor)>,
    types: &'a [GgmlDType],
    salt: u64,
    matrix: usize,
}

impl<'a> RandomTensors<'a> {
    fn new(types: &'a [GgmlDType], salt: u64) -> Self {
        RandomTensors {
            tensors: Vec::new(),
            types,
            salt,
            matrix: 0,
        }
    }

    /// A tensor of `shape`, values of `gain` around `offset`.
    fn add(&mut self, name: String, shape: &[usize], gain: f32, offset: f32) {
        self.salt += 1;
        let mut data = values(shape.iter().product(), self.salt, gain);
        data.iter_mut().for_each(|x| *x += offset);
        let t = Tensor::from_vec(data, shape, &Device::Cpu).unwrap();
        let ty = if shape.len() == 2 && shape[1] == HIDDEN {
            self.matrix += 1;
            self.types[self.matrix % self.types.len()]
        } else {
            GgmlDType::F32
        };
        self.tensors
            .push((name, QTensor::quantize(&t, ty).unwrap()));
    }
}

/// Writes a Qwen3.5 GGUF: 3 layers, the last attending (q with its output gate, rotary on
/// half of each head, MRoPE sections), the others running the delta rule with two key heads
/// of 16 serving four value heads; matrices in `types` (cycled), vectors and the
/// convolution kernel f32.
pub fn write_qwen35(path: &Path, types: &[GgmlDType], template: Option<&str>) {
    write_qwen35_with(path, types, template, 0)
}

/// [`write_qwen35`] with `nextn` multi-token-prediction blocks after its 3 layers, as
/// Qwen3.5's files carry them (`nextn_predict_layers`, counted in `block_count`; llama.cpp
/// runs the layers before them only): each an attention layer of random weights with the
/// `nextn.*` projections and norms.
pub fn write_qwen35_with(path: &Path, types: &[GgmlDType], template: Option<&str>, nextn: usize) {
    let (hd, rot, state, hk, hv) = (HIDDEN / HEADS, 8usize, 16usize, 2usize, 4usize);
    let ch = (2 * hk + hv) * state;
    let mut t = RandomTensors::new(types, 100);
    let mut add =
        |name: String, shape: &[usize], gain: f32, offset: f32| t.add(name, shape, gain, offset);
    add("token_embd.weight".into(), &[VOCAB, HIDDEN], 1.0, 0.0);
    add("output_norm.weight".into(), &[HIDDEN], 0.1, 1.0);
    for l in 0..3 {
        let b = |n: &str| format!("blk.{l}.{n}");
        add(b("attn_norm.weight"), &[HIDDEN], 0.1, 1.0);
        add(b("post_attention_norm.weight"), &[HIDDEN], 0.1, 1.0);
        add(b("ffn_gate.weight"), &[FFN, HIDDEN], 0.3, 0.0);
        add(b("ffn_up.weight"), &[FFN, HIDDEN], 0.3, 0.0);
        add(b("ffn_down.weight"), &[HIDDEN, FFN], 0.3, 0.0);
        if l == 2 {
            add(b("attn_q.weight"), &[2 * HEADS * hd, HIDDEN], 0.3, 0.0);
            add(b("attn_k.weight"), &[KV_HEADS * hd, HIDDEN], 0.3, 0.0);
            add(b("attn_v.weight"), &[KV_HEADS * hd, HIDDEN], 0.3, 0.0);
            add(b("attn_output.weight"), &[HIDDEN, HEADS * hd], 0.3, 0.0);
            add(b("attn_q_norm.weight"), &[hd], 0.1, 1.0);
            add(b("attn_k_norm.weight"), &[hd], 0.1, 1.0);
        } else {
            add(b("attn_qkv.weight"), &[ch, HIDDEN], 0.5, 0.0);
            add(b("attn_gate.weight"), &[hv * state, HIDDEN], 0.5, 0.0);
            add(b("ssm_conv1d.weight"), &[ch, 4], 0.8, 0.0);
            add(b("ssm_dt.bias"), &[hv], 0.5, 0.0);
            add(b("ssm_a"), &[hv], 0.3, -0.7);
            add(b("ssm_beta.weight"), &[hv, HIDDEN], 0.5, 0.0);
            add(b("ssm_alpha.weight"), &[hv, HIDDEN], 0.5, 0.0);
            add(b("ssm_norm.weight"), &[state], 0.1, 1.0);
            add(b("ssm_out.weight"), &[HIDDEN, hv * state], 0.5, 0.0);
        }
    }
    for l in 3..3 + nextn {
        let b = |n: &str| format!("blk.{l}.{n}");
        add(b("attn_norm.weight"), &[HIDDEN], 0.1, 1.0);
        add(b("attn_q.weight"), &[2 * HEADS * hd, HIDDEN], 0.3, 0.0);
        add(b("attn_k.weight"), &[KV_HEADS * hd, HIDDEN], 0.3, 0.0);
        add(b("attn_v.weight"), &[KV_HEADS * hd, HIDDEN], 0.3, 0.0);
        add(b("attn_output.weight"), &[HIDDEN, HEADS * hd], 0.3, 0.0);
        add(b("ffn_up.weight"), &[FFN, HIDDEN], 0.3, 0.0);
        add(b("nextn.eh_proj.weight"), &[HIDDEN, 2 * HIDDEN], 0.3, 0.0);
        add(b("nextn.enorm.weight"), &[HIDDEN], 0.1, 1.0);
        add(b("nextn.hnorm.weight"), &[HIDDEN], 0.1, 1.0);
    }
    let u = |x: usize| Value::U32(x as u32);
    let mut meta = vec![
        ("general.architecture", Value::String("qwen35".into())),
        ("qwen35.block_count", u(3 + nextn)),
        ("qwen35.embedding_length", u(HIDDEN)),
        ("qwen35.feed_forward_length", u(FFN)),
        ("qwen35.attention.head_count", u(HEADS)),
        ("qwen35.attention.head_count_kv", u(KV_HEADS)),
        ("qwen35.attention.key_length", u(hd)),
        ("qwen35.attention.value_length", u(hd)),
        ("qwen35.attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
        ("qwen35.rope.freq_base", Value::F32(1e7)),
        ("qwen35.rope.dimension_count", u(rot)),
        (
            "qwen35.rope.dimension_sections",
            // Pairs 0 and 3 of the 4 fall outside the text sections: they do not turn.
            Value::Array(vec![u(0), u(2), u(2), u(0)]),
        ),
        ("qwen35.full_attention_interval", u(3)),
        ("qwen35.ssm.conv_kernel", u(4)),
        ("qwen35.ssm.inner_size", u(hv * state)),
        ("qwen35.ssm.state_size", u(state)),
        ("qwen35.ssm.time_step_rank", u(hv)),
        ("qwen35.ssm.group_count", u(hk)),
        ("qwen35.context_length", u(2048)),
        ("qwen35.vocab_size", u(VOCAB)),
    ];
    if nextn > 0 {
        meta.push(("qwen35.nextn_predict_layers", u(nextn)));
    }
    tokenizer_meta(&mut meta, template);
    write_gguf(path, &meta, &t.tensors);
}

/// The indexed model of [`write_qwen35`] in `dir`.
pub fn qwen35(dir: &Path, types: &[GgmlDType]) -> std::path::PathBuf {
    qwen35_templated(dir, types, None)
}

/// [`qwen35`] with its own chat template.
pub fn qwen35_templated(
    dir: &Path,
    types: &[GgmlDType],
    template: Option<&str>,
) -> std::path::PathBuf {
    indexed(dir, "qwen35", |gguf| write_qwen35(gguf, types, template))
}

/// Writes a Granite 4.0-H GGUF: 4 layers, layer 1 attending (no positional encoding, as
/// Granite 4.0-H), the others Mamba2 layers of 8 heads of 16 in one group with a 16-wide
/// state and 4 taps; Granite's four multipliers; the matrices read by the residual stream in
/// `types` (cycled), the others, vectors and the convolution kernel f32, per-head vectors
/// `[heads, 1]` as llama.cpp's converter writes them.
pub fn write_granite(path: &Path, types: &[GgmlDType], template: Option<&str>) {
    write_granite_with(path, types, template, &[], |_| ());
}

/// [`write_granite`] with metadata keys of `overrides` replaced and its tensors edited by
/// `tensors`.
pub fn write_granite_with(
    path: &Path,
    types: &[GgmlDType],
    template: Option<&str>,
    overrides: &[(&'static str, Value)],
    tensors: impl FnOnce(&mut Vec<(String, QTensor)>),
) {
    let (hd, heads, hp, state, taps) = (HIDDEN / HEADS, 8usize, 16usize, 16usize, 4usize);
    let inner = heads * hp;
    let ch = inner + 2 * state;
    let mut t = RandomTensors::new(types, 300);
    let mut add =
        |name: String, shape: &[usize], gain: f32, offset: f32| t.add(name, shape, gain, offset);
    add("token_embd.weight".into(), &[VOCAB, HIDDEN], 1.0, 0.0);
    add("output_norm.weight".into(), &[HIDDEN], 0.1, 1.0);
    for l in 0..4 {
        let b = |n: &str| format!("blk.{l}.{n}");
        add(b("attn_norm.weight"), &[HIDDEN], 0.1, 1.0);
        add(b("ffn_norm.weight"), &[HIDDEN], 0.1, 1.0);
        add(b("ffn_gate.weight"), &[FFN, HIDDEN], 0.3, 0.0);
        add(b("ffn_up.weight"), &[FFN, HIDDEN], 0.3, 0.0);
        add(b("ffn_down.weight"), &[HIDDEN, FFN], 0.6, 0.0);
        if l == 1 {
            add(b("attn_q.weight"), &[HEADS * hd, HIDDEN], 0.6, 0.0);
            add(b("attn_k.weight"), &[KV_HEADS * hd, HIDDEN], 0.6, 0.0);
            add(b("attn_v.weight"), &[KV_HEADS * hd, HIDDEN], 0.3, 0.0);
            add(b("attn_output.weight"), &[HIDDEN, HEADS * hd], 0.6, 0.0);
        } else {
            add(b("ssm_in.weight"), &[inner + ch + heads, HIDDEN], 0.5, 0.0);
            add(b("ssm_conv1d.weight"), &[ch, taps], 0.8, 0.0);
            add(b("ssm_conv1d.bias"), &[ch], 0.3, 0.0);
            add(b("ssm_dt.bias"), &[heads], 0.5, -1.0);
            add(b("ssm_a"), &[heads, 1], 0.3, -0.7);
            add(b("ssm_d"), &[heads, 1], 0.3, 1.0);
            add(b("ssm_norm.weight"), &[1, inner], 0.1, 1.0);
            add(b("ssm_out.weight"), &[HIDDEN, inner], 0.6, 0.0);
        }
    }
    let u = |x: usize| Value::U32(x as u32);
    let kv: Vec<Value> = (0..4)
        .map(|l| u(if l == 1 { KV_HEADS } else { 0 }))
        .collect();
    let mut meta = vec![
        (
            "general.architecture",
            Value::String("granitehybrid".into()),
        ),
        ("granitehybrid.block_count", u(4)),
        ("granitehybrid.embedding_length", u(HIDDEN)),
        ("granitehybrid.feed_forward_length", u(FFN)),
        ("granitehybrid.attention.head_count", u(HEADS)),
        ("granitehybrid.attention.head_count_kv", Value::Array(kv)),
        (
            "granitehybrid.attention.layer_norm_rms_epsilon",
            Value::F32(1e-5),
        ),
        ("granitehybrid.rope.freq_base", Value::F32(1e4)),
        ("granitehybrid.rope.scaling.finetuned", Value::Bool(false)),
        ("granitehybrid.embedding_scale", Value::F32(2.0)),
        ("granitehybrid.residual_scale", Value::F32(0.5)),
        ("granitehybrid.attention.scale", Value::F32(1.0 / hd as f32)),
        ("granitehybrid.logit_scale", Value::F32(4.0)),
        ("granitehybrid.expert_count", u(0)),
        ("granitehybrid.ssm.conv_kernel", u(taps)),
        ("granitehybrid.ssm.inner_size", u(inner)),
        ("granitehybrid.ssm.state_size", u(state)),
        ("granitehybrid.ssm.time_step_rank", u(heads)),
        ("granitehybrid.ssm.group_count", u(1)),
        ("granitehybrid.context_length", u(2048)),
        ("granitehybrid.vocab_size", u(VOCAB)),
    ];
    for (key, value) in overrides {
        meta.retain(|(k, _)| k != key);
        meta.push((key, value.clone()));
    }
    tokenizer_meta(&mut meta, template);
    tensors(&mut t.tensors);
    write_gguf(path, &meta, &t.tensors);
}

/// The indexed model of [`write_granite`] in `dir`.
pub fn granite(dir: &Path, types: &[GgmlDType]) -> std::path::PathBuf {
    granite_templated(dir, types, None)
}

/// [`granite`] with its own chat template.
pub fn granite_templated(
    dir: &Path,
    types: &[GgmlDType],
    template: Option<&str>,
) -> std::path::PathBuf {
    indexed(dir, "granite", |gguf| write_granite(gguf, types, template))
}
