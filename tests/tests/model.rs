//! Model-level checks on every backend that serves models (cpu; wgpu on lavapipe in CI)
//! with the synthetic `tiny` model: logits against a plain f64 reference forward, the three
//! cache kinds agreeing, speculative decoding equal to greedy decoding, and agent branches
//! equal to running each branch alone. Needs the plugin dylibs next to this test binary
//! (`cargo build --workspace`); both backends must load.

use std::path::{Path, PathBuf};

use kvplug_backend_kit::model::ModelPackage;
use kvplug_core::{make_config, KvDtype};
use kvplug_host::model::{synth, PRESETS};
use kvplug_host::run::{
    argmax, run_agents, run_decode, run_speculative, Draft, Forward, RunSpec, Sampler,
};
use kvplug_host::{Host, PluginSearch};

const PROMPT: [i32; 7] = [3, 141, 59, 26, 53, 58, 97];

/// Backends under test.
const BACKENDS: [&str; 2] = ["cpu", "wgpu"];

fn plugin_dir() -> PathBuf {
    let dir = std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    assert!(
        dir.join("libkvplug_cpu.so").exists(),
        "build the workspace first (cargo build --workspace)"
    );
    dir
}

fn host() -> Host {
    let host = Host::load(&PluginSearch::only(&[plugin_dir()], false));
    for b in BACKENDS {
        let p = host
            .plugin(b)
            .unwrap_or_else(|e| panic!("{e}; skipped: {:?}", host.skipped()));
        assert!(!p.device.starts_with("unavailable"), "{b}: {}", p.device);
    }
    host
}

fn tiny() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    synth(&PRESETS[0], dir.path(), 7, "f32").unwrap();
    dir
}

/// Plain f64 Llama forward over the whole sequence (causal attention, no cache): logits of
/// every position.
fn reference_logits(model: &Path, tokens: &[i32]) -> Vec<Vec<f64>> {
    let pkg = ModelPackage::open(model).unwrap();
    let c = pkg.config.clone();
    let (h, hd, hq, hkv, im, v) = (
        c.hidden_size,
        c.head_dim(),
        c.num_attention_heads,
        c.kv_heads(),
        c.intermediate_size,
        c.vocab_size,
    );
    let w = |name: &str, shape: &[usize]| -> Vec<f64> {
        pkg.tensor_f32(name, shape)
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect()
    };
    let eps = c.rms_norm_eps;
    let norm = |x: &[f64], g: &[f64]| -> Vec<f64> {
        let rms = (x.iter().map(|a| a * a).sum::<f64>() / x.len() as f64 + eps).sqrt();
        x.iter().zip(g).map(|(a, b)| a / rms * b).collect()
    };
    let matvec = |m: &[f64], rows: usize, x: &[f64]| -> Vec<f64> {
        (0..rows)
            .map(|r| {
                m[r * x.len()..(r + 1) * x.len()]
                    .iter()
                    .zip(x)
                    .map(|(a, b)| a * b)
                    .sum()
            })
            .collect()
    };
    let inv_freq: Vec<f64> = (0..hd / 2)
        .map(|i| c.rope_theta.powf(-(2.0 * i as f64) / hd as f64))
        .collect();
    let rope = |x: &mut [f64], pos: usize| {
        for head in x.chunks_mut(hd) {
            for i in 0..hd / 2 {
                let (s, co) = (pos as f64 * inv_freq[i]).sin_cos();
                let (a, b) = (head[i], head[i + hd / 2]);
                head[i] = a * co - b * s;
                head[i + hd / 2] = b * co + a * s;
            }
        }
    };
    let embed = w("model.embed_tokens.weight", &[v, h]);
    let mut xs: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| embed[t as usize * h..(t as usize + 1) * h].to_vec())
        .collect();
    let n = tokens.len();
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}.");
        let (wq, wk, wv) = (
            w(&format!("{p}self_attn.q_proj.weight"), &[hq * hd, h]),
            w(&format!("{p}self_attn.k_proj.weight"), &[hkv * hd, h]),
            w(&format!("{p}self_attn.v_proj.weight"), &[hkv * hd, h]),
        );
        let wo = w(&format!("{p}self_attn.o_proj.weight"), &[h, hq * hd]);
        let (ln1, ln2) = (
            w(&format!("{p}input_layernorm.weight"), &[h]),
            w(&format!("{p}post_attention_layernorm.weight"), &[h]),
        );
        let (wg, wu, wd) = (
            w(&format!("{p}mlp.gate_proj.weight"), &[im, h]),
            w(&format!("{p}mlp.up_proj.weight"), &[im, h]),
            w(&format!("{p}mlp.down_proj.weight"), &[h, im]),
        );
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (t, x) in xs.iter().enumerate() {
            let hn = norm(x, &ln1);
            let (mut q, mut k) = (matvec(&wq, hq * hd, &hn), matvec(&wk, hkv * hd, &hn));
            rope(&mut q, t);
            rope(&mut k, t);
            qs.push(q);
            ks.push(k);
            vs.push(matvec(&wv, hkv * hd, &hn));
        }
        for t in 0..n {
            let mut att = vec![0.0; hq * hd];
            for head in 0..hq {
                let kh = head / (hq / hkv);
                let q = &qs[t][head * hd..(head + 1) * hd];
                let scores: Vec<f64> = (0..=t)
                    .map(|j| {
                        q.iter()
                            .zip(&ks[j][kh * hd..(kh + 1) * hd])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    for d in 0..hd {
                        att[head * hd + d] += ej / z * vs[j][kh * hd + d];
                    }
                }
            }
            let o = matvec(&wo, h, &att);
            xs[t].iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let hn = norm(&xs[t], &ln2);
            let (g, u) = (matvec(&wg, im, &hn), matvec(&wu, im, &hn));
            let m: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let d = matvec(&wd, h, &m);
            xs[t].iter_mut().zip(&d).for_each(|(a, b)| *a += b);
        }
    }
    let fnorm = w("model.norm.weight", &[h]);
    let head = w("lm_head.weight", &[v, h]);
    xs.iter()
        .map(|x| matvec(&head, v, &norm(x, &fnorm)))
        .collect()
}

fn spec(backend: &str, model: &Path, max_new: usize, kv_dtype: KvDtype) -> RunSpec {
    RunSpec {
        backend: backend.into(),
        model: model.to_path_buf(),
        prompt: PROMPT.to_vec(),
        max_new,
        kv_dtype,
        capacity: 128,
    }
}

#[test]
fn logits_match_the_f64_reference_for_prompt_and_eight_decode_steps() {
    let model = tiny();
    let host = host();
    // tiny has head_dim 16, so the quantization group is 16.
    let cases = [
        (KvDtype::F32, 1e-3),
        (KvDtype::F16, 2e-2),
        (KvDtype::Q8 { group: 16 }, 5e-2),
    ];
    for (backend, (dtype, tol)) in BACKENDS
        .iter()
        .flat_map(|b| cases.iter().map(move |c| (*b, *c)))
    {
        let params = kvplug_host::model::cache_params(model.path()).unwrap();
        let (session, opts) = host
            .make_decode_session(backend, &make_config(&params, 64, dtype))
            .unwrap();
        let mut fwd = Forward::load(&host, backend, model.path(), None, opts).unwrap();
        let positions: Vec<i32> = (0..PROMPT.len() as i32).collect();
        let mut got = fwd.call(&PROMPT, &positions, None).unwrap();
        let mut tokens = PROMPT.to_vec();
        for _ in 0..8 {
            let next = argmax(got.last().unwrap());
            tokens.push(next);
            let pos = tokens.len() as i32 - 1;
            got.extend(fwd.call(&[next], &[pos], None).unwrap());
        }
        assert_eq!(
            session
                .stats()
                .unwrap()
                .last_plan
                .into_option()
                .unwrap()
                .as_str(),
            "single_contiguous"
        );
        let want = reference_logits(model.path(), &tokens);
        assert_eq!(got.len(), want.len());
        let mut worst = 0.0f64;
        for (g, w) in got.iter().zip(&want) {
            for (a, b) in g.iter().zip(w) {
                worst = worst.max((*a as f64 - b).abs());
            }
        }
        assert!(
            worst < tol,
            "{backend} {dtype}: max |logit error| {worst} >= {tol}"
        );
    }
}

#[test]
fn the_three_cache_kinds_produce_the_same_greedy_tokens() {
    let model = tiny();
    let host = host();
    for backend in BACKENDS {
        let greedy = &mut Sampler::new(0.0, 1.0, 0);
        let plain = run_decode(
            &host,
            &spec(backend, model.path(), 12, KvDtype::F16),
            greedy,
        )
        .unwrap()
        .ids;
        let params = kvplug_host::model::cache_params(model.path()).unwrap();
        let cfg = make_config(&params, 128, KvDtype::F16);
        let (seq, seq_opts) = host.make_seq_session(backend, &cfg).unwrap();
        let (_tree, tree_opts) = host.make_tree_session(backend, &cfg).unwrap();
        for (opts, is_seq) in [(seq_opts, true), (tree_opts, false)] {
            let mut fwd = Forward::load(&host, backend, model.path(), None, opts).unwrap();
            let positions: Vec<i32> = (0..PROMPT.len() as i32).collect();
            if is_seq {
                seq.begin_step(&[0; 7]).unwrap();
            }
            let mut ids = vec![argmax(
                &fwd.call(&PROMPT, &positions, Some(&[6])).unwrap()[0],
            )];
            while ids.len() < 12 {
                if is_seq {
                    seq.begin_step(&[0]).unwrap();
                }
                let pos = (PROMPT.len() + ids.len() - 1) as i32;
                ids.push(argmax(
                    &fwd.call(&ids[ids.len() - 1..], &[pos], None).unwrap()[0],
                ));
            }
            assert_eq!(
                ids,
                plain,
                "{backend} {} cache",
                if is_seq { "seq" } else { "tree" }
            );
        }
    }
}

#[test]
fn speculative_decoding_equals_greedy_decoding() {
    let model = tiny();
    let host = host();
    for backend in BACKENDS {
        let s = spec(backend, model.path(), 20, KvDtype::F16);
        let greedy = run_decode(&host, &s, &mut Sampler::new(0.0, 1.0, 0))
            .unwrap()
            .ids;
        let own =
            run_speculative(&host, &s, &Draft::Model(model.path().to_path_buf()), 3, 2).unwrap();
        assert_eq!(own.ids, greedy, "target as its own draft");
        assert_eq!(
            own.acceptance,
            Some(1.0),
            "a model drafting for itself is always accepted"
        );
        let shallow = run_speculative(&host, &s, &Draft::Layers(1), 3, 2).unwrap();
        assert_eq!(shallow.ids, greedy, "one-layer draft");
        let acc = shallow.acceptance.unwrap();
        assert!((0.0..=1.0).contains(&acc));
    }
}

#[test]
fn agent_branches_equal_running_each_branch_alone() {
    let model = tiny();
    let host = host();
    for backend in BACKENDS {
        let s = spec(backend, model.path(), 8, KvDtype::F16);
        let agents = run_agents(&host, &s, 3, &Sampler::new(0.0, 1.0, 0)).unwrap();
        let branches = agents.branches.unwrap();
        assert_eq!(branches.len(), 3);
        assert_eq!(agents.ids, branches[agents.winner.unwrap()]);
        for br in &branches {
            let mut alone = spec(backend, model.path(), 7, KvDtype::F16);
            alone.prompt.push(br[0]);
            let ids = run_decode(&host, &alone, &mut Sampler::new(0.0, 1.0, 0))
                .unwrap()
                .ids;
            assert_eq!(ids, br[1..], "{backend}: branch starting with {}", br[0]);
        }
    }
}

#[test]
fn refused_forwards_leave_the_cache_as_it_was() {
    let model = tiny();
    let host = host();
    let params = kvplug_host::model::cache_params(model.path()).unwrap();
    for backend in BACKENDS {
        let cfg = make_config(&params, 64, KvDtype::F16);
        let (session, opts) = host.make_decode_session(backend, &cfg).unwrap();
        let mut fwd = Forward::load(&host, backend, model.path(), None, opts).unwrap();
        let positions: Vec<i32> = (0..PROMPT.len() as i32).collect();
        let first = fwd.call(&PROMPT, &positions, None).unwrap();
        let next = argmax(first.last().unwrap());
        let p = PROMPT.len() as i32;
        // A negative logit row and a token outside the vocabulary are typed errors ...
        let e = fwd
            .call(&[next], &[p], Some(&[-1]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("logit row -1 is negative"), "{backend}: {e}");
        let e = fwd.call(&[1 << 20], &[p], None).unwrap_err().to_string();
        assert!(e.contains("outside the vocabulary"), "{backend}: {e}");
        // ... that change nothing: the next step gives what a fresh cache gives.
        assert_eq!(session.stats().unwrap().high_water, PROMPT.len() as u64);
        let got = fwd.call(&[next], &[p], None).unwrap();
        let (_fresh, opts) = host.make_decode_session(backend, &cfg).unwrap();
        let mut clean = Forward::load(&host, backend, model.path(), None, opts).unwrap();
        clean.call(&PROMPT, &positions, None).unwrap();
        assert_eq!(got, clean.call(&[next], &[p], None).unwrap(), "{backend}");
        // Nothing to generate is refused up front, for every runner.
        let none = spec(backend, model.path(), 0, KvDtype::F16);
        let e = run_agents(&host, &none, 2, &Sampler::new(0.0, 1.0, 0))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--max-new 0"), "{e}");
        let e = run_decode(&host, &none, &mut Sampler::new(0.0, 1.0, 0))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--max-new 0"), "{e}");
    }
}
