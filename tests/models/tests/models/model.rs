//! Model-level checks on every backend that serves models (cpu; wgpu on lavapipe in CI)
//! with the synthetic `tiny` model: logits against a plain f64 reference forward, the three
//! cache kinds agreeing, speculative decoding equal to greedy decoding, and agent branches
//! equal to running each branch alone; and the backend template's model operations against
//! the same reference. Needs the plugin dylibs next to this test binary
//! (`cargo build --workspace`); every backend must load.

use kvplug::argmax;
use kvplug::formats::synth::{synth, PRESETS};
use kvplug::{generate, Adjustments, CacheKind, GenOptions, Generator, KvDtype, Model, Sampler};
use kvplug::{run_agents, run_decode, RunSpec};
use kvplug::{Draft, DraftKind, Speculation};

use crate::common;
use common::{forward, reference_logits, runtime, BACKENDS};

/// The loader tests' helpers, for the backend template's out-of-tree build.
#[path = "../../../../host/runtime/tests/common/mod.rs"]
mod dylibs;

/// A plugins directory holding only the backend template's dylib, built out of tree (`make
/// test` builds it first, online; here cargo runs offline).
fn template_plugins() -> tempfile::TempDir {
    let manifest = dylibs::checkout().join("examples/backend-template/Cargo.toml");
    dylibs::build_out_of_tree(&manifest, &["--locked"]);
    let name = dylibs::dylib_name("kvplug_backend_template");
    let built = dylibs::out_of_tree_target().join("debug").join(&name);
    dylibs::plugins_dir(&[(built, name.as_str())])
}

const PROMPT: [i32; 7] = [3, 141, 59, 26, 53, 58, 97];

fn tiny() -> tempfile::TempDir {
    tiny_stored_as("f32")
}

/// The synthetic `tiny` model with its weights stored as `dtype`.
fn tiny_stored_as(dtype: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    synth(&PRESETS[0], dir.path(), 7, dtype).unwrap();
    dir
}

fn spec(max_tokens: usize, kv_dtype: KvDtype) -> RunSpec {
    RunSpec {
        prompt: PROMPT.to_vec(),
        max_tokens,
        kv_dtype,
        capacity: 128,
        stop_tokens: Default::default(),
    }
}

/// Greedy ids of `spec` on `model`.
fn greedy_ids(model: &Model, spec: &RunSpec) -> Vec<i32> {
    run_decode(model, spec, None, Sampler::greedy(), None, &mut |_| Ok(()))
        .unwrap()
        .ids
}

#[test]
fn logits_match_the_f64_reference_for_prompt_and_eight_decode_steps() {
    let rt = runtime();
    // Weights stored as f32, f16 and bf16 are read as stored (the reference widens the same
    // stored values); tiny has head_dim 16, so the quantization group is 16.
    let cases = [
        ("f32", KvDtype::F32, 1e-3),
        ("f32", KvDtype::F16, 2e-2),
        ("f32", KvDtype::Q8 { group: 16 }, 5e-2),
        ("f16", KvDtype::F32, 1e-3),
        ("bf16", KvDtype::F32, 1e-3),
    ];
    for backend in BACKENDS {
        logits_match_the_f64_reference(&rt, backend, &cases);
    }
}

/// The backend template (examples/backend-template), built out of tree as an outside author
/// builds it, serves models through its plain-Rust `ModelDevice`: its logits meet the same
/// reference as the in-tree backends' in the KV dtypes it stores. A kit change that breaks a
/// model-serving backend breaks this build.
#[test]
fn the_backend_template_serves_models_within_the_f64_reference() {
    let plugins = template_plugins();
    let rt = kvplug::Runtime::load(&kvplug::PluginSearch::only(
        &[plugins.path().to_path_buf()],
        false,
    ));
    let cases = [
        ("f32", KvDtype::F32, 1e-3),
        ("f32", KvDtype::F16, 2e-2),
        ("f16", KvDtype::F32, 1e-3),
        ("bf16", KvDtype::F32, 1e-3),
    ];
    logits_match_the_f64_reference(&rt, "template", &cases);
}

/// On `backend`, for each `(weights, KV dtype, tolerance)`: the logits of [`PROMPT`] and of
/// eight greedy decode steps against the f64 reference forward.
fn logits_match_the_f64_reference(
    rt: &kvplug::Runtime,
    backend: &str,
    cases: &[(&str, KvDtype, f64)],
) {
    let models = ["f32", "f16", "bf16"].map(|d| (d, tiny_stored_as(d)));
    for &(weights, dtype, tol) in cases {
        let model = &models.iter().find(|(d, _)| *d == weights).unwrap().1;
        let mut ctx = common::model(rt, backend, model.path())
            .context(CacheKind::Contiguous, 64, dtype)
            .unwrap();
        let positions: Vec<i32> = (0..PROMPT.len() as i32).collect();
        let mut got = forward(&mut ctx, &PROMPT, &positions);
        let mut tokens = PROMPT.to_vec();
        for _ in 0..8 {
            let next = argmax(got.last().unwrap());
            tokens.push(next);
            let pos = tokens.len() as i32 - 1;
            got.extend(forward(&mut ctx, &[next], &[pos]));
        }
        assert_eq!(
            ctx.stats()
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
            "{backend} {weights} weights, {dtype} KV: max |logit error| {worst} >= {tol}"
        );
    }
}

/// Logits of `tokens` on a contiguous `dtype` context of `model`: the first `prompt` tokens
/// as one batch, then one decode step per token.
fn stepped_logits(model: &Model, dtype: KvDtype, tokens: &[i32], prompt: usize) -> Vec<Vec<f32>> {
    let mut ctx = model.context(CacheKind::Contiguous, 64, dtype).unwrap();
    let positions: Vec<i32> = (0..tokens.len() as i32).collect();
    let mut got = forward(&mut ctx, &tokens[..prompt], &positions[..prompt]);
    for t in prompt..tokens.len() {
        got.extend(forward(&mut ctx, &tokens[t..=t], &positions[t..=t]));
    }
    got
}

#[test]
fn quantized_keys_are_rotated_as_the_f64_reference_rotates_them() {
    let rt = runtime();
    let model = tiny();
    for backend in BACKENDS {
        let m = common::model(&rt, backend, model.path());
        for dtype in [KvDtype::Q8 { group: 16 }, KvDtype::Q4 { group: 16 }] {
            // Greedy tokens of the rotating context, then the same tokens on both.
            let mut tokens = PROMPT.to_vec();
            for _ in 0..8 {
                let got = stepped_logits(&m, dtype, &tokens, PROMPT.len());
                tokens.push(argmax(got.last().unwrap()));
            }
            let rotated = stepped_logits(&m, dtype, &tokens, PROMPT.len());
            let plain = stepped_logits(&m.with_key_rotation(false), dtype, &tokens, PROMPT.len());
            let reference = |rotate_keys: bool| {
                let r = common::Reference {
                    rotate_keys,
                    kv_quant: Some(dtype),
                    ..Default::default()
                };
                common::reference_logits_with(model.path(), &tokens, &r)
            };
            let (want_rotated, want_plain) = (reference(true), reference(false));
            let err = common::max_logit_error;
            let (hit, miss) = (err(&rotated, &want_rotated), err(&rotated, &want_plain));
            let (plain_hit, plain_miss) = (err(&plain, &want_plain), err(&plain, &want_rotated));
            eprintln!(
                "{backend} {dtype}: rotating context {hit:.1e} from the rotating reference, \
                 {miss:.1e} from the plain one; plain context {plain_hit:.1e} / {plain_miss:.1e}"
            );
            // The f32 forward is ~1e-6 from the f64 one on this model (the f32-KV case above);
            // one quantization code stored differently moves a logit by ~1e-3 (q8) or more.
            // So below 1e-4 means the same codes as the reference, in the same basis.
            assert!(
                hit < 1e-4 && plain_hit < 1e-4,
                "{backend} {dtype}: {hit:e} / {plain_hit:e} from the reference in the context's own basis"
            );
            assert!(
                miss > 10.0 * hit && plain_miss > 10.0 * plain_hit,
                "{backend} {dtype}: the basis does not show in the logits ({miss:e}, {plain_miss:e})"
            );
        }
    }
}

#[test]
fn long_prompts_prefill_in_micro_batches_on_every_cache_kind() {
    let model = tiny();
    let rt = runtime();
    // Exactly three full micro-batches; f32 KV, so the f32 tolerance of the reference test
    // applies.
    let n = 3 * kvplug::PREFILL_UBATCH;
    let prompt: Vec<i32> = (0..n).map(|i| (i * 37 % 251) as i32).collect();
    let want = reference_logits(model.path(), &prompt).pop().unwrap();
    for backend in BACKENDS {
        let m = common::model(&rt, backend, model.path());
        for kind in CacheKind::ALL {
            let mut ctx = m.context(kind, n + 8, KvDtype::F32).unwrap();
            let mut got = Vec::new();
            let one = GenOptions {
                max_tokens: 1,
                ..GenOptions::default()
            };
            generate(&mut ctx, None, 0, &prompt, 0, one, &mut |e| {
                got = e.logits.to_vec();
                Ok(())
            })
            .unwrap();
            assert_eq!(
                ctx.decodes(),
                3,
                "{backend} {kind}: one forward per micro-batch"
            );
            let worst = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (f64::from(*a) - b).abs())
                .fold(0.0, common::nan_max);
            assert!(worst < 1e-3, "{backend} {kind}: max |logit error| {worst}");
        }
    }
}

/// A request's cancel flag, set while its long prompt is being prefilled, ends it at the next
/// step: no further micro-batch runs and nothing is sampled.
#[test]
fn a_cancel_flag_stops_a_long_prefill_within_one_micro_batch() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let model = tiny();
    let rt = runtime();
    let m = common::model(&rt, "cpu", model.path());
    let n = 3 * kvplug::PREFILL_UBATCH;
    let prompt: Vec<i32> = (0..n).map(|i| (i * 37 % 251) as i32).collect();
    let mut ctx = m
        .context(CacheKind::Contiguous, n + 8, KvDtype::F16)
        .unwrap();
    let cancel = Arc::new(AtomicBool::new(false));
    let opts = GenOptions {
        max_tokens: 4,
        cancel: Some(cancel.clone()),
        ..GenOptions::default()
    };
    let mut g = kvplug::Generator::new();
    g.add(0, &prompt, 0, opts).unwrap();
    let mut sampled = 0;
    let mut count = |_: &kvplug::TokenEvent<'_>| {
        sampled += 1;
        Ok(())
    };
    assert!(g.step(&mut ctx, &mut count).unwrap().is_empty());
    cancel.store(true, Ordering::SeqCst);
    let done = g.step(&mut ctx, &mut count).unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].reason, kvplug::Finish::Cancelled);
    assert_eq!(done[0].prompt_written, kvplug::PREFILL_UBATCH);
    assert_eq!(
        (ctx.decodes(), sampled),
        (1, 0),
        "one micro-batch ran, nothing sampled"
    );
    assert!(g.is_idle());
}

#[test]
fn the_three_cache_kinds_produce_the_same_greedy_tokens() {
    let model = tiny();
    let rt = runtime();
    for backend in BACKENDS {
        let m = common::model(&rt, backend, model.path());
        let plain = greedy_ids(&m, &spec(12, KvDtype::F16));
        for kind in [CacheKind::Seq, CacheKind::Tree] {
            let mut ctx = m.context(kind, 128, KvDtype::F16).unwrap();
            let opts = GenOptions {
                max_tokens: 12,
                ..GenOptions::default()
            };
            let ids = generate(&mut ctx, None, 0, &PROMPT, 0, opts, &mut |_| Ok(()))
                .unwrap()
                .ids;
            assert_eq!(ids, plain, "{backend} {kind} cache");
        }
    }
}

/// Greedy tokens picked by the device's argmax (4 bytes read back a token) are those picked
/// on the host from the logits; events carry no logits then. A step with one request that
/// needs its logits (logprobs) reads them back for every request, with the same tokens.
#[test]
fn device_argmax_picks_the_tokens_the_host_picks() {
    let model = tiny();
    let rt = runtime();
    for backend in BACKENDS {
        let m = common::model(&rt, backend, model.path());
        let plain = greedy_ids(&m, &spec(12, KvDtype::F16));
        for kind in [CacheKind::Contiguous, CacheKind::Seq] {
            let mut ctx = m.context(kind, 128, KvDtype::F16).unwrap();
            let opts = GenOptions {
                max_tokens: 12,
                device_argmax: true,
                ..GenOptions::default()
            };
            let mut rows = 0;
            let ids = generate(&mut ctx, None, 0, &PROMPT, 0, opts, &mut |e| {
                rows += e.logits.len();
                Ok(())
            })
            .unwrap()
            .ids;
            assert_eq!((ids, rows), (plain.clone(), 0), "{backend} {kind} cache");
        }
        let mut ctx = m.context(CacheKind::Seq, 256, KvDtype::F16).unwrap();
        let mut g = Generator::new();
        for (seq, logprobs) in [(0, None), (1, Some(2))] {
            let opts = GenOptions {
                max_tokens: 12,
                device_argmax: true,
                logprobs,
                ..GenOptions::default()
            };
            g.add(seq, &PROMPT, 0, opts).unwrap();
        }
        let mut got = [Vec::new(), Vec::new()];
        let mut rows = 0;
        g.run(&mut ctx, &mut |e| {
            got[e.seq as usize].push(e.id);
            rows += e.logits.len();
            Ok(())
        })
        .unwrap();
        let vocab = PRESETS[0].vocab;
        assert_eq!(got, [plain.clone(), plain], "{backend} mixed");
        assert_eq!(
            rows,
            2 * 12 * vocab,
            "{backend}: the mixed steps read logits"
        );
    }
}

/// A scored prompt ([`GenOptions::prompt_logprobs`], OpenAI's `echo` with `logprobs`) gives
/// each prompt token after the first its log-probability under the logits of the token
/// before it, and the best alternatives', as the f64 reference forward's log-softmax gives
/// them: across scored chunks ([`kvplug::SCORED_UBATCH`] tokens a step), beside a decoding
/// request, with the first sampled token or, sampling nothing, in [`kvplug::Finished`]; a
/// shared prefill ([`Generator::add_prefix`]) scores its last row against the token after it.
#[test]
fn prompt_scores_match_the_f64_reference() {
    let model = tiny();
    let rt = runtime();
    let vocab = PRESETS[0].vocab as i32;
    let prompt: Vec<i32> = (0..150).map(|i| (i * 37 + 11) % vocab).collect();
    let want: Vec<Vec<f64>> = reference_logits(model.path(), &prompt)
        .into_iter()
        .map(|row| {
            let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + row.iter().map(|&x| (x - max).exp()).sum::<f64>().ln();
            row.iter().map(|&x| x - lse).collect()
        })
        .collect();
    // Logits within 1e-3 of the reference (f32 weights and K/V, as in the logits test
    // above): a log-softmax, the logit less their log-sum-exp, within twice that.
    let tol = 2e-3;
    for backend in BACKENDS {
        let m = common::model(&rt, backend, model.path());
        let mut ctx = m.context(CacheKind::Seq, 640, KvDtype::F32).unwrap();
        let mut g = Generator::new();
        g.add(1, &PROMPT, 0, GenOptions::max_tokens(40)).unwrap();
        for (seq, max_tokens, top) in [(0, 2, 3), (2, 0, 0)] {
            let opts = GenOptions {
                prompt_logprobs: Some(top),
                ..GenOptions::max_tokens(max_tokens)
            };
            g.add(seq, &prompt, 0, opts).unwrap();
        }
        let (prefix, last) = prompt.split_at(prompt.len() - 1);
        let shared = GenOptions {
            prompt_logprobs: Some(1),
            ..GenOptions::default()
        };
        let generating = GenOptions::max_tokens(1);
        assert!(g.add_prefix(4, prefix, last[0], 0, generating).is_err());
        g.add_prefix(3, prefix, last[0], 0, shared).unwrap();
        let mut handed = Vec::new();
        let finished = g
            .run(&mut ctx, &mut |e| {
                if !e.prompt_logprobs.is_empty() {
                    handed.push((e.seq, e.prompt_logprobs.clone()));
                }
                Ok(())
            })
            .unwrap();
        let ended = |seq| finished.iter().find(|f| f.seq == seq).unwrap();
        assert!(ended(0).prompt_logprobs.is_empty() && ended(1).prompt_logprobs.is_empty());
        // The scored request samples from its prompt's last row, as an unscored one does.
        let mut alone = m.context(CacheKind::Contiguous, 256, KvDtype::F32).unwrap();
        let plain = generate(
            &mut alone,
            None,
            0,
            &prompt,
            0,
            GenOptions::max_tokens(2),
            &mut |_| Ok(()),
        );
        assert_eq!(ended(0).generated, plain.unwrap().ids, "{backend}");
        assert_eq!(handed.len(), 1, "{backend}: one event hands the scores out");
        let (seq, first) = handed.pop().unwrap();
        assert_eq!(seq, 0, "{backend}");
        let scored = [
            (first, 3),
            (ended(2).prompt_logprobs.clone(), 0),
            (ended(3).prompt_logprobs.clone(), 1),
        ];
        for (scores, top) in scored {
            assert_eq!(scores.len(), prompt.len() - 1, "{backend}");
            for (k, s) in scores.iter().enumerate() {
                let (t, row) = (prompt[k + 1], &want[k]);
                let at = format!("{backend}: prompt token {}", k + 1);
                assert_eq!(s.token, t, "{at}");
                assert!((s.logprob as f64 - row[t as usize]).abs() < tol, "{at}");
                assert_eq!(s.top.len(), top, "{at}");
                let best = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                for (j, &(id, lp)) in s.top.iter().enumerate() {
                    assert!((lp as f64 - row[id as usize]).abs() < tol, "{at}: top {j}");
                    // The j-th best: at most j tokens of the reference clearly above it.
                    let above = row.iter().filter(|&&x| x > lp as f64 + 2.0 * tol).count();
                    assert!(above <= j, "{at}: top {j} has {above} tokens above it");
                }
                assert!(s
                    .top
                    .first()
                    .is_none_or(|&(_, lp)| (lp as f64 - best).abs() < tol));
            }
        }
    }
}

/// A chat whose answers could hold no token is refused when it opens (as `Llm` refuses
/// `max_tokens` 0), before anything else about the model is read.
#[test]
fn a_chat_of_empty_answers_is_refused() {
    let model = tiny();
    let rt = runtime();
    let m = common::model(&rt, "cpu", model.path());
    let opts = kvplug::ChatOptions {
        max_tokens: 0,
        ..kvplug::ChatOptions::default()
    };
    let e = kvplug::Chat::new(&m, opts).err().expect("refused");
    assert!(matches!(e, kvplug::Error::Invalid(_)), "{e}");
    assert!(e.to_string().contains("max_tokens is 0"), "{e}");
}

/// A top-k sampler drawing from the device's top-k candidates (`8·k` bytes read back a
/// token) draws the tokens it draws on the host from whole rows of logits, seed for seed,
/// beside a greedy request in the same steps; events carry no logits then. With logit bias
/// and penalties (applied on the device then) both requests still pick the host's tokens,
/// and the greedy one no longer plain decoding's. A top-k beyond `DEVICE_TOP_K` reads
/// whole rows.
#[test]
fn device_top_k_draws_the_tokens_the_host_draws() {
    let model = tiny();
    let rt = runtime();
    let vocab = PRESETS[0].vocab;
    let penalties = Adjustments {
        // Bans plain decoding's first token (so the greedy request departs from it).
        logit_bias: vec![(-1, 5.0), (3, 1.5), (0, -0.5), (3, 0.25)],
        repetition_penalty: 1.3,
        frequency_penalty: 0.4,
        presence_penalty: 0.2,
    };
    for backend in BACKENDS {
        let m = common::model(&rt, backend, model.path());
        let plain = greedy_ids(&m, &spec(12, KvDtype::F16));
        let mut banned = penalties.clone();
        banned.logit_bias[0] = (plain[0], -100.0);
        let cases = [
            (40, 3, Adjustments::default()),
            (5, 11, Adjustments::default()),
            (kvplug::DEVICE_TOP_K + 1, 7, Adjustments::default()),
            (40, 5, banned),
        ];
        for (top_k, seed, adjust) in cases {
            let sampler = Sampler::new(1.2, 0.95, seed).with_top_k(top_k);
            let mut got = Vec::new();
            for device in [false, true] {
                let mut ctx = m.context(CacheKind::Seq, 256, KvDtype::F16).unwrap();
                let mut g = Generator::new();
                for (seq, sampler) in [(0, Sampler::greedy()), (1, sampler.clone())] {
                    let opts = GenOptions {
                        max_tokens: 12,
                        sampler,
                        adjust: adjust.clone(),
                        device_argmax: device,
                        ..GenOptions::default()
                    };
                    g.add(seq, &PROMPT, 0, opts).unwrap();
                }
                let (mut ids, mut rows) = ([Vec::new(), Vec::new()], 0);
                g.run(&mut ctx, &mut |e| {
                    ids[e.seq as usize].push(e.id);
                    rows += e.logits.len();
                    Ok(())
                })
                .unwrap();
                let on_device = device && top_k <= kvplug::DEVICE_TOP_K;
                let want_rows = if on_device { 0 } else { 2 * 12 * vocab };
                assert_eq!(rows, want_rows, "{backend}, top-k {top_k}: logits read");
                if adjust.is_identity() {
                    assert_eq!(ids[0], plain, "{backend}: the greedy request");
                } else {
                    assert_ne!(ids[0][0], plain[0], "{backend}: the ban holds");
                }
                got.push(ids);
            }
            assert_eq!(got[0], got[1], "{backend}, top-k {top_k}, seed {seed}");
        }
    }
}

/// Adjustments a step cannot apply — a token outside the vocabulary, a row the batch does
/// not ask for, a place given twice — are refused before the step runs: the cache holds
/// what it held, and the same batch then goes through.
#[test]
fn bad_adjustments_are_refused_before_the_step() {
    use kvplug::{Adjust, Batch};
    let model = tiny();
    let rt = runtime();
    let vocab = PRESETS[0].vocab as i32;
    for backend in BACKENDS {
        let m = common::model(&rt, backend, model.path());
        let mut ctx = m.context(CacheKind::Seq, 64, KvDtype::F16).unwrap();
        let mut batch = Batch::new();
        batch.push_run(&PROMPT, 0, 0, true);
        let bias = Adjust {
            add: 1.0,
            ..Adjust::NONE
        };
        for bad in [
            vec![(0, vocab, bias)],
            vec![(0, -1, bias)],
            vec![(1, 3, bias)],
            vec![(0, 3, bias), (0, 3, bias)],
        ] {
            let err = ctx.decode_argmax(&batch, &bad).unwrap_err().to_string();
            assert!(err.contains("adjust at"), "{backend}: {err}");
            assert_eq!(
                ctx.seq_len(0).unwrap(),
                0,
                "{backend}: the step did not run"
            );
        }
        ctx.decode_argmax(&batch, &[(0, 3, bias)]).unwrap();
        assert_eq!(ctx.seq_len(0).unwrap(), PROMPT.len(), "{backend}");
    }
}

#[test]
fn speculative_decoding_equals_plain_decoding() {
    let model = tiny();
    let rt = runtime();
    for backend in BACKENDS {
        let m = common::model(&rt, backend, model.path());
        let draft = |kind: DraftKind| Draft::open(&kind, &m).unwrap();
        let tree = |draft| {
            Some(Speculation {
                max_depth: 3,
                max_width: 2,
                ..Speculation::new(draft)
            })
        };
        let run = |s: &RunSpec, speculate, sampler| {
            run_decode(&m, s, None, sampler, speculate, &mut |_| Ok(())).unwrap()
        };
        let s = spec(20, KvDtype::F16);
        let plain = greedy_ids(&m, &s);
        let own = run(
            &s,
            tree(draft(DraftKind::Model(model.path().to_path_buf()))),
            Sampler::greedy(),
        );
        assert_eq!(own.ids, plain, "{backend}: the target as its own draft");
        assert_eq!(
            own.acceptance,
            Some(1.0),
            "a model drafting for itself is always accepted"
        );
        let shallow = run(&s, tree(draft(DraftKind::Layers(1))), Sampler::greedy());
        assert_eq!(shallow.ids, plain, "{backend}: one-layer draft");
        // Prompt lookup on a prompt that repeats itself, greedy and sampled: a seeded
        // sampler draws the same tokens.
        let repeats = RunSpec {
            prompt: [PROMPT, PROMPT, PROMPT].concat(),
            max_tokens: 24,
            ..s.clone()
        };
        let ngram = run(&repeats, tree(Draft::Ngram), Sampler::greedy());
        assert_eq!(
            ngram.ids,
            greedy_ids(&m, &repeats),
            "{backend}: ngram drafts"
        );
        let seeded = || Sampler::new(0.9, 0.95, 11);
        assert_eq!(
            run(&repeats, tree(Draft::Ngram), seeded()).ids,
            run(&repeats, None, seeded()).ids,
            "{backend}: sampled ngram drafts"
        );
        // Chains on a seq cache (two requests drafting in one forward per step) and on a
        // contiguous one, the refused tails cut: plain decoding's tokens, and the cache
        // holds each prompt and all its tokens but the last.
        let chain = |kind| {
            Some(Speculation {
                max_depth: 4,
                min_depth: 4,
                ..Speculation::new(draft(kind))
            })
        };
        for cache in [CacheKind::Seq, CacheKind::Contiguous] {
            let mut ctx = m.context(cache, 256, KvDtype::F16).unwrap();
            let mut g = Generator::new();
            let prompts = [&s.prompt, &repeats.prompt];
            let seqs = if cache == CacheKind::Seq { 2 } else { 1 };
            for (seq, prompt) in prompts.iter().take(seqs).enumerate() {
                let opts = GenOptions {
                    speculate: chain(DraftKind::Layers(1)),
                    ..GenOptions::max_tokens(20)
                };
                g.add(seq as i32, prompt, 0, opts).unwrap();
            }
            let done = g.run(&mut ctx, &mut |_| Ok(())).unwrap();
            for f in done {
                let prompt = prompts[f.seq as usize];
                let alone = RunSpec {
                    prompt: prompt.to_vec(),
                    ..s.clone()
                };
                assert_eq!(f.generated, greedy_ids(&m, &alone), "{backend} {cache}");
                let stats = f.speculation.expect("it speculated");
                assert!(
                    stats.accepted > 0 && stats.accepted < stats.drafted,
                    "{backend} {cache}: {stats:?} (both verdicts exercised)"
                );
                let held = match cache {
                    CacheKind::Seq => ctx.seq_len(f.seq).unwrap(),
                    _ => ctx.stats().unwrap().live_cells as usize,
                };
                assert_eq!(
                    held,
                    prompt.len() + f.generated.len() - 1,
                    "{backend} {cache}"
                );
            }
        }
    }
}

#[test]
fn agent_branches_equal_running_each_branch_alone() {
    let model = tiny();
    let rt = runtime();
    for backend in BACKENDS {
        let m = common::model(&rt, backend, model.path());
        let s = spec(8, KvDtype::F16);
        let agents = run_agents(&m, &s, 3, &Sampler::greedy()).unwrap();
        let branches = agents.branches.unwrap();
        assert_eq!(branches.len(), 3);
        assert_eq!(agents.ids, branches[agents.winner.unwrap()]);
        for br in &branches {
            let mut alone = spec(7, KvDtype::F16);
            alone.prompt.push(br[0]);
            let ids = greedy_ids(&m, &alone);
            assert_eq!(ids, br[1..], "{backend}: branch starting with {}", br[0]);
        }
    }
}

#[test]
fn refused_forwards_leave_the_cache_as_it_was() {
    let model = tiny();
    let rt = runtime();
    for backend in BACKENDS {
        let m = common::model(&rt, backend, model.path());
        let mut ctx = m.context(CacheKind::Contiguous, 64, KvDtype::F16).unwrap();
        let positions: Vec<i32> = (0..PROMPT.len() as i32).collect();
        let first = forward(&mut ctx, &PROMPT, &positions);
        let next = argmax(first.last().unwrap());
        let p = PROMPT.len() as i32;
        // A second sequence on a contiguous cache and a token outside the vocabulary are
        // typed errors ...
        let e = ctx
            .decode(&kvplug::Batch::sequence(&[next], p as usize, 1))
            .unwrap_err()
            .to_string();
        assert!(e.contains("sequence ids must be 0"), "{backend}: {e}");
        let e = ctx
            .decode(&kvplug::Batch::sequence(&[1 << 20], p as usize, 0))
            .unwrap_err()
            .to_string();
        assert!(e.contains("outside the vocabulary"), "{backend}: {e}");
        // ... that change nothing: the next step gives what a fresh cache gives.
        assert_eq!(ctx.stats().unwrap().high_water, PROMPT.len() as u64);
        let got = forward(&mut ctx, &[next], &[p]);
        let mut clean = m.context(CacheKind::Contiguous, 64, KvDtype::F16).unwrap();
        forward(&mut clean, &PROMPT, &positions);
        assert_eq!(got, forward(&mut clean, &[next], &[p]), "{backend}");
        // Nothing to generate is refused up front, for every runner.
        let none = spec(0, KvDtype::F16);
        let e = run_agents(&m, &none, 2, &Sampler::greedy())
            .unwrap_err()
            .to_string();
        assert!(e.contains("max_tokens 0"), "{e}");
        let e = run_decode(&m, &none, None, Sampler::greedy(), None, &mut |_| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("max_tokens 0"), "{e}");
    }
}

/// A model's attention arithmetic reaches every context made from it and its layer views,
/// overriding the cache's default, and a dtype that does not declare it is refused.
#[test]
fn a_model_sets_its_contexts_attention_arithmetic() {
    use kvplug::Arithmetic;

    let dir = tiny();
    let rt = runtime();
    for backend in BACKENDS {
        let m = kvplug::formats::open_model(&rt, backend, dir.path()).unwrap();
        let q8 = KvDtype::Q8 { group: 16 };
        assert_eq!(m.attention(), None);
        let f32 = m.with_attention(Some(Arithmetic::F32));
        for view in [f32.clone(), f32.layers(1).unwrap()] {
            assert_eq!(view.attention(), Some(Arithmetic::F32));
            let ctx = view.context(CacheKind::Seq, 64, q8).unwrap();
            assert_eq!(ctx.arithmetic(), "f32", "{backend}");
        }
        let int8 = m.with_attention(Some(Arithmetic::Int8Query));
        let e = int8
            .context(CacheKind::Contiguous, 64, KvDtype::F16)
            .err()
            .unwrap_or_else(|| panic!("{backend}: an f16 context in int8-query"))
            .to_string();
        assert!(
            e.contains("int8-query") && e.contains("f16"),
            "{backend}: {e}"
        );
    }
}

/// `kvplug bench` runs every combination (backend, kind, depth, test) with one sample per
/// repetition, from each depth's context, and refuses an empty test list.
#[test]
fn bench_runs_every_combination() {
    use kvplug::{bench as run, BenchOptions, Readback};

    let model = tiny();
    let rt = runtime();
    let mut args = BenchOptions {
        model: model.path().to_path_buf(),
        backend: BACKENDS.iter().map(|b| b.to_string()).collect(),
        kind: CacheKind::ALL.to_vec(),
        kv_dtype: vec![KvDtype::F16],
        attention: vec![],
        n_prompt: vec![9],
        n_gen: vec![4],
        n_depth: vec![0, 5],
        repetitions: 2,
        readback: Readback::Logits,
        key_rotation: true,
        mmap: true,
    };
    let mut seen = 0;
    let results = run(&rt, &args, &mut |_| seen += 1).unwrap();
    assert_eq!(results.len(), BACKENDS.len() * 3 * 2 * 2);
    assert_eq!(seen, results.len());
    let vocab = PRESETS[0].vocab as f64;
    for r in &results {
        assert_eq!(r.samples_ts.len(), 2, "{}", r.test());
        assert!(r.avg_ts.is_finite() && r.avg_ts > 0.0, "{}", r.test());
        assert!(r.cache_bytes > 0);
        // The wgpu backend counts its dispatches and readbacks: a tg token reads back at
        // least its row of logits (the device's counters also count what the other tests
        // of this binary run on it meanwhile; backends/wgpu/tests/decode_path.rs counts a
        // step alone); the others keep no counters.
        match (r.backend.as_str(), r.n_gen) {
            ("wgpu", 0) => assert!(r.per_token["dispatches"] > 0.0),
            ("wgpu", _) => {
                assert!(r.per_token["dispatches"] > 0.0);
                assert!(
                    r.per_token["read_back_bytes"] >= 4.0 * vocab,
                    "{}",
                    r.test()
                );
            }
            _ => assert!(r.per_token.is_empty(), "{}", r.backend),
        }
    }
    let names: Vec<String> = results[..4].iter().map(|r| r.test()).collect();
    assert_eq!(names, ["pp9", "tg4", "pp9 @ d5", "tg4 @ d5"]);
    assert!(results.iter().all(|r| r.attention == "f32"));
    // An arithmetic the cache does not declare (int8-query has no f16 kernel) is refused.
    args.attention = vec![kvplug::Arithmetic::Int8Query];
    let e = run(&rt, &args, &mut |_| {}).unwrap_err().to_string();
    assert!(
        e.contains("int8-query") && e.contains("not computed"),
        "{e}"
    );
    args.attention = vec![];
    // Quantized keys are rotated unless told not to, and the table says when they are not.
    let quick = BenchOptions {
        backend: vec!["cpu".into()],
        kind: vec![CacheKind::Contiguous],
        kv_dtype: vec![KvDtype::Q8 { group: 16 }],
        n_gen: vec![0],
        n_depth: vec![0],
        repetitions: 1,
        ..args.clone()
    };
    for on in [true, false] {
        let opts = BenchOptions {
            key_rotation: on,
            ..quick.clone()
        };
        let r = &run(&rt, &opts, &mut |_| {}).unwrap()[0];
        assert_eq!(r.key_basis, if on { "hadamard" } else { "identity" });
        assert_eq!(
            r.table_row().contains("| q8g16 (unrotated) |"),
            !on,
            "{}",
            r.table_row()
        );
    }
    // Weights read into memory are recorded and marked as such.
    let opts = BenchOptions {
        mmap: false,
        ..quick.clone()
    };
    let r = &run(&rt, &opts, &mut |_| {}).unwrap()[0];
    let row = r.table_row();
    assert!(!r.use_mmap && row.contains(" (no-mmap) |"), "{row}");
    // A tg test can read back what a greedy or a top-k sampler reads, on every backend.
    for readback in [Readback::Argmax, Readback::TopK] {
        let opts = BenchOptions {
            kind: vec![CacheKind::Contiguous],
            kv_dtype: vec![KvDtype::F16],
            n_prompt: vec![0],
            n_gen: vec![3],
            readback,
            ..args.clone()
        };
        let results = run(&rt, &opts, &mut |_| {}).unwrap();
        assert_eq!(results.len(), BACKENDS.len() * 2);
        for r in &results {
            assert!(r.avg_ts > 0.0);
            assert!(r.test().ends_with(&format!("({})", readback.as_str())));
        }
    }
    (args.n_prompt, args.n_gen) = (vec![0], vec![0]);
    let e = run(&rt, &args, &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("no tests"), "{e}");
}

/// `tiny` made a Qwen2 (random q/k/v biases) or a Qwen3 (random per-head q/k RMSNorm
/// weights): the extra tensors go in a second shard named by an index, config.json names
/// the architecture.
fn tiny_as(arch: &str) -> tempfile::TempDir {
    use safetensors::{tensor::TensorView, Dtype, SafeTensors};
    let dir = tiny();
    let cfg_path = dir.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["model_type"] = arch.into();
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let n = |k: &str| cfg[k].as_u64().unwrap() as usize;
    let (heads, kv_heads) = (n("num_attention_heads"), n("num_key_value_heads"));
    let hd = n("hidden_size") / heads;
    let mut extra: Vec<(String, Vec<f32>)> = Vec::new();
    for l in 0..n("num_hidden_layers") {
        let p = format!("model.layers.{l}.self_attn.");
        let values = |seed: usize, len: usize, base: f32| -> Vec<f32> {
            (0..len)
                .map(|i| base + ((i * 7919 + seed * 104_729) % 1000) as f32 / 2000.0 - 0.25)
                .collect()
        };
        if arch == "qwen2" {
            extra.push((format!("{p}q_proj.bias"), values(3 * l, heads * hd, 0.0)));
            extra.push((
                format!("{p}k_proj.bias"),
                values(3 * l + 1, kv_heads * hd, 0.0),
            ));
            extra.push((
                format!("{p}v_proj.bias"),
                values(3 * l + 2, kv_heads * hd, 0.0),
            ));
        } else {
            extra.push((format!("{p}q_norm.weight"), values(2 * l, hd, 1.0)));
            extra.push((format!("{p}k_norm.weight"), values(2 * l + 1, hd, 1.0)));
        }
    }
    let bytes: Vec<Vec<u8>> = extra
        .iter()
        .map(|(_, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(&str, TensorView<'_>)> = extra
        .iter()
        .zip(&bytes)
        .map(|((name, v), b)| {
            (
                name.as_str(),
                TensorView::new(Dtype::F32, vec![v.len()], b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("extra.safetensors")).unwrap();
    let main = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let mut map = serde_json::Map::new();
    for name in SafeTensors::deserialize(&main).unwrap().names() {
        map.insert(name.to_string(), "model.safetensors".into());
    }
    for (name, _) in &extra {
        map.insert(name.clone(), "extra.safetensors".into());
    }
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        serde_json::json!({ "weight_map": map }).to_string(),
    )
    .unwrap();
    dir
}

#[test]
fn qwen2_biases_and_qwen3_qk_norms_match_the_f64_reference() {
    let rt = runtime();
    for arch in ["qwen2", "qwen3"] {
        let model = tiny_as(arch);
        let want = reference_logits(model.path(), &PROMPT);
        // Without the extra tensors the logits would differ: the check can fail.
        let plain = reference_logits(tiny().path(), &PROMPT);
        let moved = plain
            .iter()
            .flatten()
            .zip(want.iter().flatten())
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(moved > 1e-2, "{arch}: the extra tensors change the logits");
        for backend in BACKENDS {
            let mut ctx = common::model(&rt, backend, model.path())
                .context(CacheKind::Contiguous, 64, KvDtype::F32)
                .unwrap();
            let positions: Vec<i32> = (0..PROMPT.len() as i32).collect();
            let got = forward(&mut ctx, &PROMPT, &positions);
            let worst = common::max_logit_error(&got, &want);
            // The f32 tolerance of logits_match_the_f64_reference_for_prompt_and_eight_decode_steps.
            assert!(
                worst < 1e-3,
                "{arch} on {backend}: max |logit error| {worst}"
            );
        }
    }
}
