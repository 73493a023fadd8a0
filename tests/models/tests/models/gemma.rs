//! Gemma 3's graph: a synthetic `gemma3_text` package — sliding and global layers, a window
//! shorter than the prompt, head_dim ≠ hidden / heads, `query_pre_attn_scalar` ≠ head_dim,
//! grouped KV heads — run on every backend with f32 KV, prefilled at once and decoded token
//! by token, against a plain f64 Gemma 3 forward written here from Hugging Face's
//! `modeling_gemma3` (it shares no code with the kit: weights come from memory, the window
//! and every constant from the raw config).

use std::collections::HashMap;
use std::path::Path;

use kvplug::{CacheKind, KvDtype};
use serde_json::{json, Value};

use crate::common;
use common::{forward, forward_seq, runtime, BACKENDS};

const WINDOW: usize = 5;

fn config() -> Value {
    json!({
        "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_hidden_layers": 4, "vocab_size": 300, "query_pre_attn_scalar": 24,
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "sliding_window": WINDOW, "rms_norm_eps": 1e-6,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                        "sliding_attention"],
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": true,
    })
}

/// Deterministic weights: name → (shape, values). Norm weights are Hugging Face's `w`
/// (the layer scales by 1 + w), spread around 0.
fn weights(c: &Value) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
    let n = |k: &str| c[k].as_u64().unwrap() as usize;
    let (h, hd, hq, hkv, im) = (
        n("hidden_size"),
        n("head_dim"),
        n("num_attention_heads"),
        n("num_key_value_heads"),
        n("intermediate_size"),
    );
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut uniform = |len: usize, a: f32| -> Vec<f32> {
        (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
            })
            .collect()
    };
    let mut w = HashMap::new();
    let mut add = |name: String, shape: Vec<usize>, a: f32| {
        let v = uniform(shape.iter().product(), a);
        w.insert(name, (shape, v));
    };
    add(
        "model.embed_tokens.weight".into(),
        vec![n("vocab_size"), h],
        1.0,
    );
    add("model.norm.weight".into(), vec![h], 0.5);
    let lin = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    for l in 0..n("num_hidden_layers") {
        let p = format!("model.layers.{l}.");
        for norm in [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ] {
            add(format!("{p}{norm}.weight"), vec![h], 0.5);
        }
        add(format!("{p}self_attn.q_norm.weight"), vec![hd], 0.5);
        add(format!("{p}self_attn.k_norm.weight"), vec![hd], 0.5);
        add(
            format!("{p}self_attn.q_proj.weight"),
            vec![hq * hd, h],
            lin(h),
        );
        add(
            format!("{p}self_attn.k_proj.weight"),
            vec![hkv * hd, h],
            lin(h),
        );
        add(
            format!("{p}self_attn.v_proj.weight"),
            vec![hkv * hd, h],
            lin(h),
        );
        add(
            format!("{p}self_attn.o_proj.weight"),
            vec![h, hq * hd],
            lin(hq * hd),
        );
        add(format!("{p}mlp.gate_proj.weight"), vec![im, h], lin(h));
        add(format!("{p}mlp.up_proj.weight"), vec![im, h], lin(h));
        add(format!("{p}mlp.down_proj.weight"), vec![h, im], lin(im));
    }
    w
}

fn write_package(dir: &Path, c: &Value, w: &HashMap<String, (Vec<usize>, Vec<f32>)>) {
    use safetensors::tensor::{Dtype, TensorView};
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    let bytes: Vec<(&String, &Vec<usize>, Vec<u8>)> = w
        .iter()
        .map(|(n, (s, v))| (n, s, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(&str, TensorView<'_>)> = bytes
        .iter()
        .map(|(n, s, b)| {
            let view = TensorView::new(Dtype::F32, s.to_vec(), b).unwrap();
            (n.as_str(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// Hugging Face's Gemma 3 forward in f64 over the whole sequence: logits of every position.
fn reference(
    c: &Value,
    w: &HashMap<String, (Vec<usize>, Vec<f32>)>,
    tokens: &[i32],
) -> Vec<Vec<f64>> {
    let n = |k: &str| c[k].as_u64().unwrap() as usize;
    let f = |k: &str| c[k].as_f64().unwrap();
    let (h, hd, hq, hkv, im) = (
        n("hidden_size"),
        n("head_dim"),
        n("num_attention_heads"),
        n("num_key_value_heads"),
        n("intermediate_size"),
    );
    let eps = f("rms_norm_eps");
    let get = |name: &str| -> Vec<f64> { w[name].1.iter().map(|&x| x as f64).collect() };
    // Gemma3RMSNorm: x / rms(x) · (1 + w).
    let norm = |x: &[f64], g: &[f64]| -> Vec<f64> {
        let rms = (x.iter().map(|a| a * a).sum::<f64>() / x.len() as f64 + eps).sqrt();
        x.iter().zip(g).map(|(a, b)| a / rms * (1.0 + b)).collect()
    };
    let matvec = |m: &[f64], x: &[f64]| -> Vec<f64> {
        m.chunks(x.len())
            .map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    };
    let rope = |x: &mut [f64], pos: usize, theta: f64| {
        for head in x.chunks_mut(hd) {
            for i in 0..hd / 2 {
                let freq = theta.powf(-(2.0 * i as f64) / hd as f64);
                let (s, co) = (pos as f64 * freq).sin_cos();
                let (a, b) = (head[i], head[i + hd / 2]);
                head[i] = a * co - b * s;
                head[i + hd / 2] = b * co + a * s;
            }
        }
    };
    let gelu = |x: f64| {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
    };
    let embed = get("model.embed_tokens.weight");
    // The embedding scale in f32, as llama.cpp computes it (HF casts it to the weight dtype).
    let scale_in = (h as f32).sqrt() as f64;
    let mut xs: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| {
            embed[t as usize * h..(t as usize + 1) * h]
                .iter()
                .map(|x| x * scale_in)
                .collect()
        })
        .collect();
    let scale = 1.0 / f("query_pre_attn_scalar").sqrt();
    for l in 0..n("num_hidden_layers") {
        let p = format!("model.layers.{l}.");
        let g = |s: &str| get(&format!("{p}{s}.weight"));
        let sliding = c["layer_types"][l] == "sliding_attention";
        let theta = if sliding {
            f("rope_local_base_freq")
        } else {
            f("rope_theta")
        };
        let mut qs = Vec::new();
        let mut kvs = Vec::new();
        for (t, x) in xs.iter().enumerate() {
            let hn = norm(x, &g("input_layernorm"));
            let mut q: Vec<f64> = matvec(&g("self_attn.q_proj"), &hn)
                .chunks(hd)
                .flat_map(|head| norm(head, &g("self_attn.q_norm")))
                .collect();
            let mut k: Vec<f64> = matvec(&g("self_attn.k_proj"), &hn)
                .chunks(hd)
                .flat_map(|head| norm(head, &g("self_attn.k_norm")))
                .collect();
            rope(&mut q, t, theta);
            rope(&mut k, t, theta);
            qs.push(q);
            kvs.push((k, matvec(&g("self_attn.v_proj"), &hn)));
        }
        for (t, x) in xs.iter_mut().enumerate() {
            // Hugging Face's sliding mask: key s is seen by query t iff t - W < s <= t.
            let seen: Vec<usize> = (0..=t)
                .filter(|&s| !sliding || t - s < c["sliding_window"].as_u64().unwrap() as usize)
                .collect();
            let mut att = vec![0.0; hq * hd];
            for head in 0..hq {
                let kh = head / (hq / hkv);
                let qh = &qs[t][head * hd..(head + 1) * hd];
                let scores: Vec<f64> = seen
                    .iter()
                    .map(|&s| {
                        let k = &kvs[s].0[kh * hd..(kh + 1) * hd];
                        qh.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() * scale
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let z: f64 = e.iter().sum();
                for (&s, e) in seen.iter().zip(&e) {
                    let v = &kvs[s].1[kh * hd..(kh + 1) * hd];
                    for (o, v) in att[head * hd..(head + 1) * hd].iter_mut().zip(v) {
                        *o += e / z * v;
                    }
                }
            }
            let o = norm(
                &matvec(&g("self_attn.o_proj"), &att),
                &g("post_attention_layernorm"),
            );
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let hn = norm(x, &g("pre_feedforward_layernorm"));
            let gate = matvec(&g("mlp.gate_proj"), &hn);
            let up = matvec(&g("mlp.up_proj"), &hn);
            let act: Vec<f64> = gate.iter().zip(&up).map(|(a, b)| gelu(*a) * b).collect();
            let m = norm(
                &matvec(&g("mlp.down_proj"), &act),
                &g("post_feedforward_layernorm"),
            );
            x.iter_mut().zip(&m).for_each(|(a, b)| *a += b);
        }
        assert_eq!(im, w[&format!("{p}mlp.up_proj.weight")].0[0]);
    }
    let final_norm = get("model.norm.weight");
    xs.iter()
        .map(|x| matvec(&embed, &norm(x, &final_norm)))
        .collect()
}

fn worst(got: &[f32], want: &[f64]) -> f64 {
    got.iter()
        .zip(want)
        .map(|(a, b)| (*a as f64 - b).abs())
        .fold(0.0, common::nan_max)
}

#[test]
fn gemma3_matches_the_f64_reference_past_the_window_on_every_backend() {
    let dir = tempfile::tempdir().unwrap();
    let c = config();
    let w = weights(&c);
    write_package(dir.path(), &c, &w);
    let tokens: Vec<i32> = (0..4 * WINDOW as i32)
        .map(|i| (i * 37 + 11) % 300)
        .collect();
    let want = reference(&c, &w, &tokens);
    let rt = runtime();
    let cfg = common::model(&rt, "cpu", dir.path())
        .cache_config(64, KvDtype::F32)
        .unwrap();
    let sliding = cfg.sliding.expect("a hybrid cache");
    assert_eq!(sliding.layers.iter().collect::<Vec<_>>(), [0, 1, 3]);
    for backend in BACKENDS {
        // The whole prompt in one step (the window as a mask), then fresh caches fed in
        // micro-batches and token by token (the sliding layers' rows evicted as the window
        // moves).
        let m = common::model(&rt, backend, dir.path());
        let fresh = || m.context(CacheKind::Contiguous, 64, KvDtype::F32).unwrap();
        let mut ctx = fresh();
        let positions: Vec<i32> = (0..tokens.len() as i32).collect();
        let got = forward(&mut ctx, &tokens, &positions);
        for (t, (g, r)) in got.iter().zip(&want).enumerate() {
            let e = worst(g, r);
            assert!(
                e < 1e-3,
                "{backend} prefill, position {t}: max |logit error| {e}"
            );
        }
        // Micro-batches longer than the window: each step reads rows of the one before.
        let mut ctx = fresh();
        for (i, chunk) in tokens.chunks(WINDOW + 2).enumerate() {
            let p0 = i * (WINDOW + 2);
            let positions: Vec<i32> = (p0 as i32..(p0 + chunk.len()) as i32).collect();
            let got = forward(&mut ctx, chunk, &positions);
            for (t, g) in (p0..).zip(&got) {
                let e = worst(g, &want[t]);
                assert!(
                    e < 1e-3,
                    "{backend} chunks, position {t}: max |logit error| {e}"
                );
            }
        }
        let mut ctx = fresh();
        forward(&mut ctx, &tokens[..2], &[0, 1]);
        for t in 2..tokens.len() {
            let got = forward(&mut ctx, &tokens[t..=t], &[t as i32]);
            let e = worst(&got[0], &want[t]);
            assert!(
                e < 1e-3,
                "{backend} decode, position {t}: max |logit error| {e}"
            );
        }
    }

    // A cache whose layers all attend fully is refused for this model: it would be wrong
    // past the window.
    let full = kvplug_core::CacheConfig {
        sliding: None,
        conv: None,
        delta: None,
        ssm: None,
        ..cfg
    };
    let e = common::model(&rt, "cpu", dir.path())
        .context_with(CacheKind::Contiguous, &full)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("has no sliding layers; the model needs a 5-token window on layers [0, 1, 3]"),
        "{e}"
    );
}

/// A hybrid cache's session rows: every row of the global layer, the window's rows of the
/// sliding ones. Saved mid-conversation from a cpu seq cache, through a session file, into
/// every backend and kind, the conversation goes on with the reference's logits (the first
/// queries after the import read the imported window); an import that does not cover the
/// window is refused with the cache untouched.
#[test]
fn a_hybrid_session_resumes_on_every_backend_and_kind() {
    use kvplug::session_file::{self, Session};
    use kvplug_plugin_api::AbiErrorKind;

    let dir = tempfile::tempdir().unwrap();
    let c = config();
    let w = weights(&c);
    write_package(dir.path(), &c, &w);
    let tokens: Vec<i32> = (0..4 * WINDOW as i32)
        .map(|i| (i * 37 + 11) % 300)
        .collect();
    let want = reference(&c, &w, &tokens);
    let saved_len = 3 * WINDOW;
    let rt = runtime();
    let load = |backend: &str, kind: CacheKind| {
        common::model(&rt, backend, dir.path())
            .context(kind, 64, KvDtype::F32)
            .unwrap()
    };

    let mut src = load("cpu", CacheKind::Seq);
    let positions: Vec<i32> = (0..saved_len as i32).collect();
    forward_seq(&mut src, 2, &tokens[..saved_len], &positions);
    let saved = Session {
        rows: src.export_seq(2).unwrap(),
        tokens: tokens[..saved_len].to_vec(),
        model: "0".repeat(64),
        key_basis: src.key_basis(),
        model_name: String::new(),
        app: Default::default(),
    };
    let rows = &saved.rows;
    assert_eq!(rows.sliding_layers.as_slice(), [0, 1, 3]);
    // The last query saw positions 10..=14: the sliding layers kept those 5 rows.
    assert_eq!(rows.window_from as usize, saved_len - WINDOW);
    let row = 4 * 32 * 2; // f32, head_dim 32, 2 KV heads
    assert_eq!(rows.k[2].len(), saved_len * row);
    assert_eq!(rows.k[0].len(), WINDOW * row);
    let bytes = session_file::to_bytes(&saved).unwrap();
    let loaded = session_file::from_bytes(Path::new("mem"), &bytes).unwrap();
    assert!(loaded == saved, "the file round trip changed the session");

    for backend in BACKENDS {
        for kind in CacheKind::ALL {
            let mut dst = load(backend, kind);
            let seq = if kind == CacheKind::Seq { 5 } else { 0 };
            // Rows cut before their end lack the window the cut needs.
            let head = loaded.rows.slice(0..saved_len - 3);
            let e = dst.import_seq(seq, &head).unwrap_err();
            assert_eq!(e.kind, AbiErrorKind::OutOfWindow, "{backend} {kind}: {e}");
            assert_eq!(dst.stats().unwrap().live_cells, 0, "{backend} {kind}");
            dst.import_seq(seq, &loaded.rows).unwrap();
            assert!(
                &dst.export_seq(seq).unwrap() == rows,
                "{backend} {kind}: rows read back differ"
            );
            for t in saved_len..tokens.len() {
                let got = forward_seq(&mut dst, seq, &tokens[t..=t], &[t as i32]);
                let e = worst(&got[0], &want[t]);
                assert!(
                    e < 1e-3,
                    "{backend} {kind} after the import, position {t}: max |logit error| {e}"
                );
            }
        }
    }

    // A cache whose layers all attend fully needs every row of every layer.
    let full = kvplug_core::CacheConfig {
        sliding: None,
        conv: None,
        delta: None,
        ssm: None,
        ..common::model(&rt, "cpu", dir.path())
            .cache_config(64, KvDtype::F32)
            .unwrap()
    };
    let dst = rt.cache("cpu", CacheKind::Contiguous, &full).unwrap();
    let e = dst.import_seq(0, rows).unwrap_err();
    assert_eq!(e.kind, AbiErrorKind::OutOfWindow, "{e}");
    assert!(e.message.contains("attends fully there"), "{e}");
}

/// Prefix reuse on a hybrid cache: a published prefix outlives its sequence with the
/// window's rows before its end kept, so another sequence attaching it decodes on with the
/// reference's logits; an attach ending elsewhere is refused `out_of_window` with the cache
/// untouched; and only the newest ends keep their windows (`PINNED_ENDS` of them).
#[test]
fn a_published_hybrid_prefix_resumes_in_another_sequence_on_every_backend() {
    use kvplug_plugin_api::AbiErrorKind;

    let dir = tempfile::tempdir().unwrap();
    let c = config();
    let w = weights(&c);
    write_package(dir.path(), &c, &w);
    let tokens: Vec<i32> = (0..4 * WINDOW as i32)
        .map(|i| (i * 37 + 11) % 300)
        .collect();
    let ids: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
    let want = reference(&c, &w, &tokens);
    let rt = runtime();
    const CAPACITY: usize = 64;
    for backend in BACKENDS {
        let m = common::model(&rt, backend, dir.path());
        let mut ctx = m.context(CacheKind::Seq, CAPACITY, KvDtype::F32).unwrap();
        let end = 2 * WINDOW + 2;
        let positions: Vec<i32> = (0..end as i32).collect();
        forward_seq(&mut ctx, 1, &tokens[..end], &positions);
        ctx.prefix_publish(1, &ids[..end]).unwrap();
        ctx.seq_rm(1, None, None).unwrap();
        // Another sequence's steps move on: only the pin keeps the ended prefix's window.
        forward_seq(&mut ctx, 7, &[5, 6, 7], &[0, 1, 2]);

        let before = ctx.stats().unwrap().live_cells;
        let e = ctx.prefix_attach(2, &ids[..end - 3]).unwrap_err();
        assert_eq!(e.kind, AbiErrorKind::OutOfWindow, "{backend}: {e}");
        assert_eq!(ctx.stats().unwrap().live_cells, before, "{backend}");
        assert_eq!(ctx.prefix_attach(2, &ids[..end]).unwrap(), end, "{backend}");
        for t in end..tokens.len() {
            let got = forward_seq(&mut ctx, 2, &tokens[t..=t], &[t as i32]);
            let e = worst(&got[0], &want[t]);
            assert!(
                e < 1e-3,
                "{backend} after the attach, position {t}: max |logit error| {e}"
            );
        }

        // Six ends, published as a sequence reaches them, a window apart: the newest
        // PINNED_ENDS stay resumable after the sequence ends, the two oldest do not.
        let mut ctx = m.context(CacheKind::Seq, CAPACITY, KvDtype::F32).unwrap();
        let long: Vec<i32> = (0..40).map(|i| (i * 53 + 7) % 300).collect();
        let ids: Vec<u32> = long.iter().map(|&t| t as u32).collect();
        let ends: Vec<usize> = (0..6).map(|i| WINDOW + 1 + i * WINDOW).collect();
        let positions: Vec<i32> = (0..ends[0] as i32).collect();
        forward_seq(&mut ctx, 1, &long[..ends[0]], &positions);
        for n in ends[0]..=ends[5] {
            if ends.contains(&n) {
                ctx.prefix_publish(1, &ids[..n]).unwrap();
            }
            forward_seq(&mut ctx, 1, &long[n..=n], &[n as i32]);
        }
        ctx.seq_rm(1, None, None).unwrap();
        for (i, &n) in ends.iter().enumerate() {
            let got = ctx.prefix_attach(3, &ids[..n]);
            if i < 2 {
                assert_eq!(
                    got.unwrap_err().kind,
                    AbiErrorKind::OutOfWindow,
                    "{backend} end {n}"
                );
            } else {
                assert_eq!(got.unwrap(), n, "{backend} end {n}");
                ctx.seq_rm(3, None, None).unwrap();
            }
        }
    }
}

/// `kvplug bench` at a depth past the window: the sliding layers have dropped rows the cut
/// back to the depth needs, so each run prefills the depth again instead of failing.
#[test]
fn bench_at_a_depth_past_the_window_runs_on_a_hybrid_model() {
    use kvplug::{bench as run, BenchOptions};

    let dir = tempfile::tempdir().unwrap();
    let c = config();
    write_package(dir.path(), &c, &weights(&c));
    let args = BenchOptions {
        model: dir.path().to_path_buf(),
        backend: vec!["cpu".into()],
        kind: vec![CacheKind::Contiguous, CacheKind::Seq],
        kv_dtype: vec![KvDtype::F16],
        attention: vec![],
        n_prompt: vec![2 * WINDOW],
        n_gen: vec![WINDOW + 1],
        n_depth: vec![3 * WINDOW],
        repetitions: 2,
        readback: Default::default(),
        key_rotation: true,
        mmap: true,
    };
    let results = run(&runtime(), &args, &mut |_| {}).unwrap();
    assert_eq!(results.len(), 4);
    for r in &results {
        assert_eq!(r.samples_ts.len(), 2, "{}", r.test());
    }
}

/// Speculation on a sliding-window model gives plain decoding's tokens on every cache kind:
/// a tree cache verifies drafts (it commits the accepted chain before the window frees
/// anything); a contiguous or seq cache cannot cut a refused tail once the window freed the
/// rows before it, so there the request decodes plainly.
#[test]
fn speculation_on_a_sliding_window_model_drafts_on_a_tree_cache_only() {
    use kvplug::{Draft, DraftKind, GenOptions, Generator, Speculation};

    let dir = tempfile::tempdir().unwrap();
    let c = config();
    write_package(dir.path(), &c, &weights(&c));
    let rt = runtime();
    let prompt: Vec<i32> = (0..3 * WINDOW as i32)
        .map(|i| (i * 37 + 11) % 300)
        .collect();
    for backend in BACKENDS {
        let m = common::model(&rt, backend, dir.path());
        let run = |kind, speculate| {
            let mut ctx = m.context(kind, 64, KvDtype::F32).unwrap();
            let opts = GenOptions {
                speculate,
                ..GenOptions::max_tokens(4 * WINDOW)
            };
            let mut g = Generator::new();
            g.add(0, &prompt, 0, opts).unwrap();
            g.run(&mut ctx, &mut |_| Ok(())).unwrap().remove(0)
        };
        let plain = run(CacheKind::Contiguous, None);
        let layers = Draft::open(&DraftKind::Layers(1), &m).unwrap();
        for kind in [CacheKind::Tree, CacheKind::Seq, CacheKind::Contiguous] {
            let speculate = Speculation {
                max_depth: 3,
                min_depth: 3,
                ..Speculation::new(layers.clone())
            };
            let f = run(kind, Some(speculate));
            assert_eq!(f.generated, plain.generated, "{backend} {kind}");
            let drafted = f.speculation.unwrap().drafted;
            assert_eq!(
                drafted > 0,
                kind == CacheKind::Tree,
                "{backend} {kind}: {drafted}"
            );
        }
    }
}
