//! Hybrid models: LFM2 (short-convolution layers between attention layers) and Qwen3.5
//! (gated delta-rule layers between gated attention layers) from GGUFs, on every backend,
//! against the f64 reference forward; and their recurrent state through the verbs a runner
//! uses (a fork of one prompt into two sequences, a rewind, a tree commit).

use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use kvplug::{run_decode, AgentStore, AgentStoreOptions, RunSpec, Sampler};
use kvplug::{Batch, CacheKind, Context, GenOptions, Generator, KvDtype};
use kvplug::{DraftKind, Speculation};

mod common;
use common::{
    bpe_tokenizer_meta, forward, runtime, values, write_gguf, Reference, BACKENDS, MERGES,
};

const HIDDEN: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const FFN: usize = 128;
const VOCAB: usize = 300;
const PROMPT: [i32; 9] = [3, 141, 59, 26, 53, 58, 97, 93, 238];

/// The shape of an LFM2 file: `layers` layers, those in `attention` attending (through a
/// sliding `window` when given), the others convolving over `taps` positions; matrices in
/// `types` (cycled), vectors and the convolution kernel f32; no output matrix when `tied`.
struct Shape<'a> {
    layers: usize,
    attention: &'a [usize],
    taps: usize,
    types: &'a [GgmlDType],
    tied: bool,
    window: Option<usize>,
}

/// Three f32 layers, the middle one attending, convolutions of 3 taps.
const SMALL_LFM2: Shape<'static> = Shape {
    layers: 3,
    attention: &[1],
    taps: 3,
    types: &[GgmlDType::F32],
    tied: true,
    window: None,
};

/// Writes an LFM2 GGUF of `shape`.
fn write_lfm2(path: &Path, shape: &Shape) {
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
    meta.extend(bpe_tokenizer_meta("qwen2", &MERGES, VOCAB).0);
    write_gguf(path, &meta, &tensors);
}

/// Every row's logits of one batch: token `i` at `positions[i]` in sequence `seqs[i]`.
fn decode(ctx: &mut Context, tokens: &[i32], positions: &[i32], seqs: &[i32]) -> Vec<Vec<f32>> {
    let mut b = Batch::new();
    for ((&t, &p), &s) in tokens.iter().zip(positions).zip(seqs) {
        b.push(t, p, s, true);
    }
    ctx.decode(&b)
        .unwrap()
        .rows()
        .map(<[f32]>::to_vec)
        .collect()
}

/// The indexed model of [`write_lfm2`] in `dir`.
fn lfm2(dir: &Path, shape: &Shape) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let gguf = dir.join("lfm2.gguf");
    write_lfm2(&gguf, shape);
    let model = dir.join("indexed");
    kvplug::formats::gguf::index(&gguf, &model).unwrap();
    model
}

/// The largest `|a − b|` of two rows of logits.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// [`common::greedy_logit_error`] from [`PROMPT`], attention through `window` when given.
fn greedy_logit_error(model: &Path, backend: &str, window: Option<usize>) -> f64 {
    let told = Reference {
        window,
        ..Reference::default()
    };
    common::greedy_logit_error(model, backend, &PROMPT, told)
}

#[test]
fn lfm2_gguf_decodes_within_the_f64_reference_on_every_backend() {
    let dir = tempfile::tempdir().unwrap();
    // LFM2's 3 taps with attention in the middle and at the end, tied, f32; 4 taps with
    // attention first, an output matrix, matrices in block formats (the convolution's input
    // projection split through its blocks); attention through a 4-token sliding window.
    let blocks = [
        GgmlDType::Q8_0,
        GgmlDType::Q4_0,
        GgmlDType::Q5_1,
        GgmlDType::Q4_1,
    ];
    let f32s = [GgmlDType::F32];
    let shapes = [
        Shape {
            layers: 5,
            attention: &[1, 4],
            taps: 3,
            types: &f32s,
            tied: true,
            window: None,
        },
        Shape {
            layers: 4,
            attention: &[0],
            taps: 4,
            types: &blocks,
            tied: false,
            window: None,
        },
        Shape {
            layers: 4,
            attention: &[1, 3],
            taps: 3,
            types: &f32s,
            tied: true,
            window: Some(4),
        },
    ];
    for (i, shape) in shapes.iter().enumerate() {
        let model = lfm2(&dir.path().join(i.to_string()), shape);
        for backend in BACKENDS {
            let worst = greedy_logit_error(&model, backend, shape.window);
            // The f32 tolerance of the model tests (model.rs).
            assert!(
                worst < 1e-3,
                "LFM2 shape {i} on {backend}: max |logit error| {worst}"
            );
        }
    }
}

#[test]
fn lfm2_convolution_state_follows_forks_and_rewinds() {
    let dir = tempfile::tempdir().unwrap();
    let model = lfm2(dir.path(), &SMALL_LFM2);
    let rt = runtime();
    let m = common::model(&rt, "cpu", &model);
    let positions: Vec<i32> = (0..PROMPT.len() as i32).collect();
    // Alone: the prompt then token 7 (or token 9) at the next position.
    let alone = |next: i32| {
        let mut ctx = m.context(CacheKind::Contiguous, 64, KvDtype::F32).unwrap();
        forward(&mut ctx, &PROMPT, &positions);
        forward(&mut ctx, &[next, 11], &[9, 10])
    };
    let (want7, want9) = (alone(7), alone(9));
    // One seq cache: the prompt in sequence 0, copied to sequence 1, then each sequence
    // continues with its own token in one batch, then one more token each.
    let mut ctx = m.context(CacheKind::Seq, 64, KvDtype::F32).unwrap();
    decode(&mut ctx, &PROMPT, &positions, &[0; 9]);
    ctx.seq_cp(0, 1, None, None).unwrap();
    let a = decode(&mut ctx, &[7, 9], &[9, 9], &[0, 1]);
    let b = decode(&mut ctx, &[11, 11], &[10, 10], &[0, 1]);
    for (what, got, want) in [
        ("sequence 0", [&a[0], &b[0]], &want7),
        ("sequence 1", [&a[1], &b[1]], &want9),
    ] {
        for (g, w) in got.iter().zip(want) {
            let worst = max_diff(g, w);
            // Same arithmetic on both sides, up to the attention's read order.
            assert!(
                worst < 1e-4,
                "{what} after the fork: max |logit diff| {worst}"
            );
        }
    }
    // A rewind past a token and a different token there: as if it had never been seen.
    let mut ctx = m.context(CacheKind::Contiguous, 64, KvDtype::F32).unwrap();
    forward(&mut ctx, &PROMPT, &positions);
    forward(&mut ctx, &[9, 11], &[9, 10]);
    ctx.rewind(9).unwrap();
    let again = forward(&mut ctx, &[7, 11], &[9, 10]);
    assert_eq!(
        again, want7,
        "a rewind leaves no trace in the convolution state"
    );
}

/// Writes a Qwen3.5 GGUF: 3 layers, the last attending (q with its output gate, rotary on
/// half of each head, MRoPE sections), the others running the delta rule with two key heads
/// of 16 serving four value heads; matrices in `types` (cycled), vectors and the
/// convolution kernel f32.
fn write_qwen35(path: &Path, types: &[GgmlDType], template: Option<&str>) {
    let (hd, rot, state, hk, hv) = (HIDDEN / HEADS, 8usize, 16usize, 2usize, 4usize);
    let ch = (2 * hk + hv) * state;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let (mut salt, mut matrix) = (100, 0);
    let mut add = |name: String, shape: &[usize], gain: f32, offset: f32| {
        salt += 1;
        let mut data = values(shape.iter().product(), salt, gain);
        data.iter_mut().for_each(|x| *x += offset);
        let t = Tensor::from_vec(data, shape, &Device::Cpu).unwrap();
        let ty = if shape.len() == 2 && shape[1] == HIDDEN {
            matrix += 1;
            types[matrix % types.len()]
        } else {
            GgmlDType::F32
        };
        tensors.push((name, QTensor::quantize(&t, ty).unwrap()));
    };
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
    let u = |x: usize| Value::U32(x as u32);
    let mut meta = vec![
        ("general.architecture", Value::String("qwen35".into())),
        ("qwen35.block_count", u(3)),
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
    meta.extend(bpe_tokenizer_meta("qwen2", &MERGES, VOCAB).0);
    if let Some(t) = template {
        let at = meta.iter().position(|m| m.0 == "tokenizer.chat_template");
        meta[at.expect("the tokenizer has a template")].1 = Value::String(t.into());
    }
    write_gguf(path, &meta, &tensors);
}

/// The indexed model of [`write_qwen35`] in `dir`.
fn qwen35(dir: &Path, types: &[GgmlDType]) -> std::path::PathBuf {
    qwen35_templated(dir, types, None)
}

/// [`qwen35`] with its own chat template.
fn qwen35_templated(dir: &Path, types: &[GgmlDType], template: Option<&str>) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let gguf = dir.join("qwen35.gguf");
    write_qwen35(&gguf, types, template);
    let model = dir.join("indexed");
    kvplug::formats::gguf::index(&gguf, &model).unwrap();
    model
}

#[test]
fn qwen35_gguf_decodes_within_the_f64_reference_on_every_backend() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = [
        GgmlDType::Q8_0,
        GgmlDType::Q4_0,
        GgmlDType::Q5_1,
        GgmlDType::Q4_1,
    ];
    for (i, types) in [&[GgmlDType::F32][..], &blocks].into_iter().enumerate() {
        let model = qwen35(&dir.path().join(i.to_string()), types);
        for backend in BACKENDS {
            let worst = greedy_logit_error(&model, backend, None);
            // The f32 tolerance of the model tests (model.rs).
            assert!(
                worst < 1e-3,
                "Qwen3.5 file {i} on {backend}: max |logit error| {worst}"
            );
        }
    }
}

/// The delta-rule state through the verbs a runner uses, on a Qwen3.5 file: a fork of one
/// prompt into two sequences decodes each as if alone; a rewind to a step's end forgets
/// what followed; a rewind inside the prompt is refused and changes nothing; a speculative
/// tree's committed branch continues as the same tokens decoded one by one.
#[test]
fn qwen35_delta_state_follows_forks_rewinds_and_tree_commits() {
    let dir = tempfile::tempdir().unwrap();
    let model = qwen35(dir.path(), &[GgmlDType::F32]);
    let rt = runtime();
    for backend in BACKENDS {
        let m = common::model(&rt, backend, &model);
        let positions: Vec<i32> = (0..PROMPT.len() as i32).collect();
        let alone = |next: i32| {
            let mut ctx = m.context(CacheKind::Contiguous, 64, KvDtype::F32).unwrap();
            forward(&mut ctx, &PROMPT, &positions);
            let mut out = forward(&mut ctx, &[next], &[9]);
            out.extend(forward(&mut ctx, &[11], &[10]));
            out
        };
        let (want7, want9) = (alone(7), alone(9));
        let close = |what: &str, got: &[Vec<f32>], want: &[Vec<f32>]| {
            for (g, w) in got.iter().zip(want) {
                let worst = max_diff(g, w);
                // Same arithmetic on both sides, up to the attention's read order.
                assert!(worst < 1e-4, "{backend}, {what}: max |logit diff| {worst}");
            }
        };
        // Fork: both continuations in one seq cache.
        let mut ctx = m.context(CacheKind::Seq, 64, KvDtype::F32).unwrap();
        decode(&mut ctx, &PROMPT, &positions, &[0; 9]);
        ctx.seq_cp(0, 1, None, None).unwrap();
        let a = decode(&mut ctx, &[7, 9], &[9, 9], &[0, 1]);
        let b = decode(&mut ctx, &[11, 11], &[10, 10], &[0, 1]);
        close(
            "sequence 0 after the fork",
            &[a[0].clone(), b[0].clone()],
            &want7,
        );
        close(
            "sequence 1 after the fork",
            &[a[1].clone(), b[1].clone()],
            &want9,
        );
        // Rewind to the end of the prompt's step, then another token.
        let mut ctx = m.context(CacheKind::Contiguous, 64, KvDtype::F32).unwrap();
        forward(&mut ctx, &PROMPT, &positions);
        forward(&mut ctx, &[9], &[9]);
        forward(&mut ctx, &[11], &[10]);
        let e = ctx.rewind(5).unwrap_err().to_string();
        assert!(e.contains("not kept"), "{backend}: {e}");
        ctx.rewind(9).unwrap();
        let mut again = forward(&mut ctx, &[7], &[9]);
        again.extend(forward(&mut ctx, &[11], &[10]));
        close("after a rewind", &again, &want7);
        // A tree: the root 7 with children 11 and 12; committing 7, 11 then decoding 5
        // gives what decoding 7, 11, 5 one by one gives.
        let mut ctx = m.context(CacheKind::Tree, 64, KvDtype::F32).unwrap();
        forward(&mut ctx, &PROMPT, &positions);
        ctx.propose(&[-1, 0, 0]).unwrap();
        let tree = forward(&mut ctx, &[7, 11, 12], &[9, 10, 10]);
        close("the tree's branch", &tree[..2], &want7);
        ctx.commit(&[0, 1]).unwrap();
        let next = forward(&mut ctx, &[5], &[11]);
        let mut plain = m.context(CacheKind::Contiguous, 64, KvDtype::F32).unwrap();
        forward(&mut plain, &PROMPT, &positions);
        forward(&mut plain, &[7, 11], &[9, 10]);
        close("after the commit", &next, &forward(&mut plain, &[5], &[11]));
    }
}

/// Speculation in the generator on a Qwen3.5 file gives plain decoding's tokens on every
/// cache kind: a tree cache commits the accepted branch; a seq or contiguous cache, which
/// keeps the delta-rule state only at a step's end, drops a partly refused step and
/// writes the accepted tokens again — after which the cache holds exactly the prompt and
/// every generated token but the last.
#[test]
fn qwen35_speculation_gives_plain_decodings_tokens_on_every_cache_kind() {
    let dir = tempfile::tempdir().unwrap();
    let model = qwen35(dir.path(), &[GgmlDType::F32]);
    let rt = runtime();
    for backend in BACKENDS {
        let m = common::model(&rt, backend, &model);
        let run = |kind, speculate| {
            let mut ctx = m.context(kind, 128, KvDtype::F32).unwrap();
            let opts = GenOptions {
                speculate,
                ..GenOptions::max_tokens(24)
            };
            let mut g = Generator::new();
            g.add(0, &PROMPT, 0, opts).unwrap();
            let f = g.run(&mut ctx, &mut |_| Ok(())).unwrap().remove(0);
            let held = match kind {
                CacheKind::Seq => ctx.seq_len(0).unwrap(),
                _ => ctx.stats().unwrap().live_cells as usize,
            };
            (f, held)
        };
        let (plain, _) = run(CacheKind::Contiguous, None);
        let layers = kvplug::Draft::open(&DraftKind::Layers(1), &m).unwrap();
        for kind in [CacheKind::Tree, CacheKind::Seq, CacheKind::Contiguous] {
            let speculate = Speculation {
                max_depth: 3,
                min_depth: 3,
                ..Speculation::new(layers.clone())
            };
            let (f, held) = run(kind, Some(speculate));
            assert_eq!(f.generated, plain.generated, "{backend} {kind}");
            let stats = f.speculation.unwrap();
            assert!(
                stats.accepted > 0 && stats.accepted < stats.drafted,
                "{backend} {kind}: {stats:?} (both verdicts exercised)"
            );
            if kind != CacheKind::Tree {
                assert_eq!(
                    held,
                    PROMPT.len() + f.generated.len() - 1,
                    "{backend} {kind}"
                );
            }
        }
    }
}

/// A Qwen3.5 sequence saved to session-file bytes on the cpu (K/V of the attention layers,
/// the delta-rule state at its end) and restored on every backend decodes on as the
/// original does; a slice of it that ends early carries no state and is refused
/// `out_of_window` (its prompt is prefilled instead).
#[test]
fn qwen35_sessions_carry_the_recurrent_state_across_backends() {
    let dir = tempfile::tempdir().unwrap();
    sessions_carry_the_recurrent_state(&qwen35(dir.path(), &[GgmlDType::F32]), &[0, 1]);
}

/// The same for LFM2, whose convolution layers' state is the rows of the last two
/// positions; a restored sequence cannot go back before them (`out_of_window`, unchanged).
#[test]
fn lfm2_sessions_carry_the_convolution_rows_across_backends() {
    let dir = tempfile::tempdir().unwrap();
    sessions_carry_the_recurrent_state(&lfm2(dir.path(), &SMALL_LFM2), &[0, 2]);
}

/// Saves the prompt and one token of `model` on the cpu through session-file bytes
/// (naming `recurrent` as its recurrent layers), restores it on every backend and checks
/// the next two tokens' logits against the original's; a slice ending early is refused.
fn sessions_carry_the_recurrent_state(model: &Path, recurrent: &[u32]) {
    use kvplug::session_file::{self, Session};
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let positions: Vec<i32> = (0..PROMPT.len() as i32).collect();
    let mut ctx = common::model(&rt, "cpu", model)
        .context(CacheKind::Contiguous, 64, KvDtype::F32)
        .unwrap();
    forward(&mut ctx, &PROMPT, &positions);
    forward(&mut ctx, &[7], &[9]);
    let rows = ctx.export_seq(0).unwrap();
    assert_eq!(rows.recurrent_layers.as_slice(), recurrent);
    let session = Session {
        rows,
        tokens: [&PROMPT[..], &[7]].concat(),
        model: "test".into(),
        key_basis: kvplug::KeyBasis::Identity,
        model_name: String::new(),
        app: Default::default(),
    };
    let path = dir.path().join("s.kvsession.safetensors");
    let bytes = session_file::to_bytes(&session).unwrap();
    let saved = session_file::from_bytes(&path, &bytes).unwrap();
    assert_eq!(
        saved.rows, session.rows,
        "the file keeps every row and the state"
    );
    let want = forward(&mut ctx, &[11, 5], &[10, 11]);
    for backend in BACKENDS {
        let m = common::model(&rt, backend, model);
        let mut restored = m.context(CacheKind::Seq, 64, KvDtype::F32).unwrap();
        restored.import_seq(0, &saved.rows).unwrap();
        let e = restored.seq_rm(0, Some(3), None).unwrap_err();
        assert_eq!(e.kind, kvplug_plugin_api::AbiErrorKind::OutOfWindow, "{e}");
        let got = decode(&mut restored, &[11, 5], &[10, 11], &[0, 0]);
        for (g, w) in got.iter().zip(&want) {
            let worst = max_diff(g, w);
            // The cpu's f32 arithmetic against each backend's (model.rs's tolerance).
            assert!(
                worst < 1e-3,
                "{backend}: restored, max |logit diff| {worst}"
            );
        }
        let early = m.context(CacheKind::Seq, 64, KvDtype::F32).unwrap();
        let e = early.import_seq(0, &saved.rows.slice(0..5)).unwrap_err();
        assert_eq!(e.kind, kvplug_plugin_api::AbiErrorKind::OutOfWindow, "{e}");
    }
}

/// A chat template that renders an earlier answer as a placeholder, as Qwen3's drops its
/// reasoning: a chat's next prompt leaves the cache inside the earlier answer's steps.
const PLACEHOLDER_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n\
    {% if m.role == 'assistant' and not loop.last %}(an earlier answer){% else %}\
    {{ m.content | trim }}{% endif %}<|im_end|>\n{% endfor %}\
    {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// A greedy cpu chat on `model` of `capacity` tokens: the turn `first`, enough decode steps
/// that its prompt's end is no longer among the recent steps' ends, then a second turn,
/// which must resume where the first prompt ended. Returns the first turn's prefilled
/// tokens.
fn second_turn_resumes_at_the_first_prompt_end(
    model: &Path,
    capacity: usize,
    first: &str,
) -> usize {
    use kvplug::{Chat, ChatOptions, Sampler};
    let rt = runtime();
    let opts = ChatOptions {
        system: None,
        capacity,
        kv_dtype: None,
        max_tokens: 48,
        sampler: Sampler::greedy(),
        session: None,
        cancel: None,
        speculate: None,
    };
    let mut chat = Chat::new(&common::model(&rt, "cpu", model), opts).unwrap();
    let first = chat.turn(first, &mut |_| Ok(())).unwrap();
    let spares = kvplug_core::config::SPARE_ANCHORS;
    assert!(first.ids.len() > 3 * spares, "{} tokens", first.ids.len());
    let second = chat.turn("and again", &mut |_| Ok(())).unwrap();
    assert_eq!(
        second.reused_tokens, first.prefilled_tokens,
        "the second turn resumes where the first prompt ended"
    );
    first.prefilled_tokens
}

/// A chat on Qwen3.5 whose template renders an earlier answer differently from how it was
/// generated: the second turn's prompt leaves the cache after the first turn's prompt,
/// inside the first answer's steps, and the chat resumes at the end of that prompt (kept as
/// a prompt end) instead of prefilling everything again.
#[test]
fn qwen35_chat_resumes_at_the_previous_prompt_end() {
    let dir = tempfile::tempdir().unwrap();
    let model = qwen35_templated(dir.path(), &[GgmlDType::F32], Some(PLACEHOLDER_TEMPLATE));
    second_turn_resumes_at_the_first_prompt_end(&model, 512, "hello there");
}

/// A prompt one token longer than a prefill micro-batch is not fed as a last chunk of one
/// token (which reads as a decode step and is not kept as a prompt end): the next turn
/// resumes at its end all the same.
#[test]
fn qwen35_prompt_of_a_micro_batch_and_one_token_keeps_its_end() {
    use kvplug::{Message, Text, PREFILL_UBATCH};
    let dir = tempfile::tempdir().unwrap();
    let model = qwen35_templated(dir.path(), &[GgmlDType::F32], Some(PLACEHOLDER_TEMPLATE));
    let text = Text::load(&model).unwrap();
    let prompt_len = |m: &str| {
        let rendered = text.render(&[Message::user(m)]).unwrap();
        text.encode(&rendered).unwrap().len()
    };
    // Words added one at a time, then a letter, until the prompt is a micro-batch and one
    // token long.
    let want = PREFILL_UBATCH + 1;
    let mut message = String::from("a");
    while prompt_len(&format!("{message} a")) <= want {
        message.push_str(" a");
    }
    while prompt_len(&message) < want {
        message.push('b');
    }
    assert_eq!(prompt_len(&message), want, "{message}");
    let prefilled = second_turn_resumes_at_the_first_prompt_end(&model, 1024, &message);
    assert_eq!(prefilled, want);
}

/// Through the runtime's batches, as the generator sends them: a prompt's earlier chunk and
/// a chain written again want no logits, its last chunk wants its last row's. Only the
/// prompt's end is kept as a prompt end, so after more unread chunks than prompt ends are
/// kept, and a verb that drops the surplus anchors, Qwen3.5 still returns there.
#[test]
fn qwen35_prompt_end_outlives_unread_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let model = qwen35(dir.path(), &[GgmlDType::F32]);
    let rt = runtime();
    let mut ctx = common::model(&rt, "cpu", &model)
        .context(CacheKind::Contiguous, 128, KvDtype::F32)
        .unwrap();
    let mut at = 0;
    let mut feed = |ctx: &mut Context, n: usize, read_last: bool| {
        let mut b = Batch::new();
        for i in 0..n {
            b.push(3 + at % 200, at, 0, read_last && i + 1 == n);
            at += 1;
        }
        ctx.decode(&b).unwrap();
    };
    feed(&mut ctx, 4, false);
    feed(&mut ctx, 4, true);
    let prompt_end = 8;
    let chunks = kvplug_core::config::PROMPT_END_ANCHORS + 1;
    for _ in 0..chunks {
        feed(&mut ctx, 1, true);
        feed(&mut ctx, 2, false);
    }
    let len = prompt_end + chunks * 3;
    ctx.rewind(len).unwrap();
    ctx.rewind(prompt_end)
        .expect("the prompt's end is kept, not the unread chunks' ends");
}

/// Requests sharing a system prompt on Qwen3.5, whose state is kept only where a step ended
/// and was published: the second request anchors the beginning it shares with the first
/// (its prefill ends a step there and publishes it), every later one resumes there, though
/// each publishes its own end too (more than the 4 pins a cache keeps: resuming keeps the
/// shared one among the newest); every answer is plain greedy decoding's on a fresh cache.
#[test]
fn qwen35_requests_resume_a_shared_system_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let model = qwen35(dir.path(), &[GgmlDType::F32]);
    let rt = runtime();
    let system: Vec<i32> = (0..100).map(|i| (i * 37 + 11) % 290 + 5).collect();
    let with = |q: &[i32]| [system.as_slice(), q].concat();
    let prompts: Vec<Vec<i32>> = (0..8).map(|i| with(&[7 + i, 20 + 2 * i, 9])).collect();
    for backend in BACKENDS {
        let m = common::model(&rt, backend, &model);
        let files = tempfile::tempdir().unwrap();
        let opts = AgentStoreOptions {
            capacity: 512,
            kv_dtype: KvDtype::F16,
            dir: files.path().to_path_buf(),
            warm: Default::default(),
        };
        let mut store = AgentStore::new(&m, opts).unwrap();
        let mut cached = Vec::new();
        for p in &prompts {
            let reply = store.generate(None, p, GenOptions::max_tokens(6)).unwrap();
            cached.push(reply.cached_tokens);
            let spec = RunSpec {
                prompt: p.clone(),
                max_tokens: 6,
                kv_dtype: KvDtype::F16,
                capacity: 512,
                stop_tokens: Default::default(),
            };
            let plain = run_decode(&m, &spec, None, Sampler::greedy(), None, &mut |_| Ok(()));
            assert_eq!(reply.ids, plain.unwrap().ids, "{backend}");
        }
        let mut want = vec![system.len(); prompts.len()];
        want[..2].fill(0);
        assert_eq!(cached, want, "{backend}: tokens reused");
    }
}

/// A Qwen3.5 file whose decay rate (`ssm_a`, `−exp(A_log)`) is above 0 would make the
/// state grow without bound: every backend refuses to open it, naming the tensor.
#[test]
fn qwen35_decay_rates_above_zero_are_refused() {
    use candle_core::quantized::gguf_file::Content;
    use std::io::{Seek, SeekFrom, Write};
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("qwen35.gguf");
    write_qwen35(&gguf, &[GgmlDType::F32], None);
    let at = {
        let mut f = std::fs::File::open(&gguf).unwrap();
        let content = Content::read(&mut f).unwrap();
        content.tensor_data_offset + content.tensor_infos["blk.1.ssm_a"].offset
    };
    let mut f = std::fs::OpenOptions::new().write(true).open(&gguf).unwrap();
    f.seek(SeekFrom::Start(at + 4)).unwrap();
    f.write_all(&0.5f32.to_le_bytes()).unwrap();
    drop(f);
    let model = dir.path().join("indexed");
    kvplug::formats::gguf::index(&gguf, &model).unwrap();
    let rt = runtime();
    for backend in BACKENDS {
        let e = rt
            .model(backend, &model)
            .and_then(|m| m.context(CacheKind::Contiguous, 64, KvDtype::F32))
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ssm_a") || e.contains("linear_attn.a"),
            "{backend}: {e}"
        );
        assert!(e.contains("decay rate of 0.5"), "{backend}: {e}");
    }
}
