//! Hybrid models: LFM2 (short-convolution layers between attention layers), Qwen3.5
//! (gated delta-rule layers between gated attention layers) and Granite 4.0-H (Mamba2 layers
//! between attention layers) from GGUFs, on every backend,
//! against the f64 reference forward; and their recurrent state through the verbs a runner
//! uses (a fork of one prompt into two sequences, a rewind, a tree commit).

use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use kvplug::{run_decode, AgentStore, AgentStoreOptions, RunSpec, Sampler};
use kvplug::{Batch, CacheKind, Context, GenOptions, Generator, KvDtype};
use kvplug::{DraftKind, Speculation};
use kvplug_core::config::CHAIN_ANCHORS;

use crate::common;
use common::hybrids::{
    granite, granite_templated, lfm2, lfm2_templated, qwen35, qwen35_templated, write_granite_with,
    write_qwen35, write_qwen35_with, Shape, PROMPT, SMALL_LFM2,
};
use common::{forward, runtime, Reference, BACKENDS};

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

#[test]
fn qwen35_gguf_decodes_within_the_f64_reference_on_every_backend() {
    decodes_within_the_f64_reference("Qwen3.5", qwen35);
}

/// Granite 4.0-H (Mamba2 and attention layers, Granite's multipliers).
#[test]
fn granite_gguf_decodes_within_the_f64_reference_on_every_backend() {
    decodes_within_the_f64_reference("Granite", granite);
}

/// The model `write` makes in f32 and with its matrices in four block formats, on every
/// backend, against the f64 reference forward.
fn decodes_within_the_f64_reference(name: &str, write: fn(&Path, &[GgmlDType]) -> PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let blocks = [
        GgmlDType::Q8_0,
        GgmlDType::Q4_0,
        GgmlDType::Q5_1,
        GgmlDType::Q4_1,
    ];
    for (i, types) in [&[GgmlDType::F32][..], &blocks].into_iter().enumerate() {
        let model = write(&dir.path().join(i.to_string()), types);
        for backend in BACKENDS {
            let worst = greedy_logit_error(&model, backend, None);
            // The f32 tolerance of the model tests (model.rs).
            assert!(
                worst < 1e-3,
                "{name} file {i} on {backend}: max |logit error| {worst}"
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
    state_follows_forks_rewinds_and_tree_commits(&qwen35(dir.path(), &[GgmlDType::F32]));
}

/// The same for Granite 4.0-H's Mamba2 state.
#[test]
fn granite_mamba2_state_follows_forks_rewinds_and_tree_commits() {
    let dir = tempfile::tempdir().unwrap();
    state_follows_forks_rewinds_and_tree_commits(&granite(dir.path(), &[GgmlDType::F32]));
}

fn state_follows_forks_rewinds_and_tree_commits(model: &Path) {
    let rt = runtime();
    for backend in BACKENDS {
        let m = common::model(&rt, backend, model);
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
        // Rewind to the end of the prompt's step (its last row read, as a prompt's is: a run
        // whose every row is read keeps each token's state), then another token.
        let mut ctx = m.context(CacheKind::Contiguous, 64, KvDtype::F32).unwrap();
        let mut prompt = Batch::new();
        for (i, (&t, &p)) in PROMPT.iter().zip(&positions).enumerate() {
            prompt.push(t, p, 0, i + 1 == PROMPT.len());
        }
        ctx.decode(&prompt).unwrap();
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
/// cache kind: a tree cache commits the accepted branch; a seq or contiguous cache keeps the
/// state of a speculative chain's first `CHAIN_ANCHORS` tokens and cuts the refused tail
/// there, and drops a deeper chain refused past them and writes its accepted tokens again
/// — after which the cache holds exactly the prompt and every generated token but the last.
#[test]
fn qwen35_speculation_gives_plain_decodings_tokens_on_every_cache_kind() {
    let dir = tempfile::tempdir().unwrap();
    speculation_gives_plain_decodings_tokens(&qwen35(dir.path(), &[GgmlDType::F32]));
}

#[test]
fn granite_speculation_gives_plain_decodings_tokens_on_every_cache_kind() {
    let dir = tempfile::tempdir().unwrap();
    speculation_gives_plain_decodings_tokens(&granite(dir.path(), &[GgmlDType::F32]));
}

#[test]
fn lfm2_speculation_gives_plain_decodings_tokens_on_every_cache_kind() {
    let dir = tempfile::tempdir().unwrap();
    speculation_gives_plain_decodings_tokens(&lfm2(dir.path(), &SMALL_LFM2));
}

/// Greedy decoding with a layer-skipping draft, on every backend and cache kind, gives
/// plain decoding's tokens with drafts both accepted and rejected (the state of a rejected
/// draft left behind); a contiguous or seq cache then holds exactly the sequence.
fn speculation_gives_plain_decodings_tokens(model: &Path) {
    let rt = runtime();
    for backend in BACKENDS {
        let m = common::model(&rt, backend, model);
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
        let deep = CHAIN_ANCHORS + 2;
        for (kind, depth) in [
            (CacheKind::Tree, 3),
            (CacheKind::Seq, 3),
            (CacheKind::Contiguous, 3),
            (CacheKind::Contiguous, deep),
        ] {
            let speculate = Speculation {
                max_depth: depth,
                min_depth: depth,
                ..Speculation::new(layers.clone())
            };
            let (f, held) = run(kind, Some(speculate));
            assert_eq!(f.generated, plain.generated, "{backend} {kind} {depth}");
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

/// The same for Granite 4.0-H (Mamba2 layers 0, 2 and 3).
#[test]
fn granite_sessions_carry_the_recurrent_state_across_backends() {
    let dir = tempfile::tempdir().unwrap();
    sessions_carry_the_recurrent_state(&granite(dir.path(), &[GgmlDType::F32]), &[0, 2, 3]);
}

/// The same for LFM2, whose convolution layers' state is the rows of the last two
/// positions; a restored sequence cannot go back before its end (`out_of_window`,
/// unchanged).
#[test]
fn lfm2_sessions_carry_the_convolution_state_across_backends() {
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

/// The same on Granite 4.0-H's Mamba2 state.
#[test]
fn granite_chat_resumes_at_the_previous_prompt_end() {
    let dir = tempfile::tempdir().unwrap();
    let model = granite_templated(dir.path(), &[GgmlDType::F32], Some(PLACEHOLDER_TEMPLATE));
    second_turn_resumes_at_the_first_prompt_end(&model, 512, "hello there");
}

/// The same on LFM2, whose convolution state is kept as the delta rule's is.
#[test]
fn lfm2_chat_resumes_at_the_previous_prompt_end() {
    let dir = tempfile::tempdir().unwrap();
    let model = lfm2_templated(dir.path(), &SMALL_LFM2, Some(PLACEHOLDER_TEMPLATE));
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

#[test]
fn qwen35_requests_resume_a_shared_system_prompt() {
    let dir = tempfile::tempdir().unwrap();
    requests_resume_a_shared_system_prompt(&qwen35(dir.path(), &[GgmlDType::F32]));
}

#[test]
fn granite_requests_resume_a_shared_system_prompt() {
    let dir = tempfile::tempdir().unwrap();
    requests_resume_a_shared_system_prompt(&granite(dir.path(), &[GgmlDType::F32]));
}

#[test]
fn lfm2_requests_resume_a_shared_system_prompt() {
    let dir = tempfile::tempdir().unwrap();
    requests_resume_a_shared_system_prompt(&lfm2(dir.path(), &SMALL_LFM2));
}

/// Requests sharing a system prompt on a hybrid, whose state is kept only where a step
/// ended and was published: the second request anchors the beginning it shares with the
/// first (its prefill ends a step there and publishes it), every later one resumes there,
/// though each publishes its own end too (more than the 4 pins a cache keeps: resuming keeps
/// the shared one among the newest); every answer is plain greedy decoding's on a fresh
/// cache.
fn requests_resume_a_shared_system_prompt(model: &Path) {
    let rt = runtime();
    let system: Vec<i32> = (0..100).map(|i| (i * 37 + 11) % 290 + 5).collect();
    let with = |q: &[i32]| [system.as_slice(), q].concat();
    let prompts: Vec<Vec<i32>> = (0..8).map(|i| with(&[7 + i, 20 + 2 * i, 9])).collect();
    for backend in BACKENDS {
        let m = common::model(&rt, backend, model);
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

/// A Qwen3.5 file with a multi-token-prediction block after its layers (as Qwen3.5's files
/// carry one: `nextn_predict_layers`, counted in `block_count`) runs the layers before it
/// only, as llama.cpp does: the same logits as the file without it.
#[test]
fn qwen35_runs_the_layers_before_its_prediction_block() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let [plain, predicting] = [0, 1].map(|nextn| {
        let gguf = dir.path().join(format!("qwen35-{nextn}.gguf"));
        write_qwen35_with(&gguf, &[GgmlDType::F32], None, nextn);
        let model = dir.path().join(format!("indexed-{nextn}"));
        kvplug::formats::gguf::index(&gguf, &model).unwrap();
        model
    });
    let logits = |model: &Path, backend: &str| {
        let mut ctx = common::model(&rt, backend, model)
            .context(CacheKind::Contiguous, 64, KvDtype::F32)
            .unwrap();
        let positions: Vec<i32> = (0..PROMPT.len() as i32).collect();
        forward(&mut ctx, &PROMPT, &positions)
    };
    for backend in BACKENDS {
        assert_eq!(
            logits(&predicting, backend),
            logits(&plain, backend),
            "{backend}"
        );
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

/// What kvplug does not run of Granite 4.0-H is refused with a reason: the mixture-of-experts
/// sizes and biases on the attention or MLP projections when the file is indexed, Mamba2
/// layers of more than one B/C group when it loads. A file without convolution biases (as
/// Hugging Face's `mamba_conv_bias: false` converts) runs, within the reference.
#[test]
fn granite_refusals_and_a_file_without_convolution_biases() {
    use candle_core::quantized::gguf_file::Value;
    let dir = tempfile::tempdir().unwrap();
    let f32s = [GgmlDType::F32];
    let index = |name: &str, overrides: &[(&'static str, Value)], add_bias: bool| {
        let gguf = dir.path().join(format!("{name}.gguf"));
        write_granite_with(&gguf, &f32s, None, overrides, |t| {
            if add_bias {
                let bias = t
                    .iter()
                    .find(|(n, _)| n == "blk.1.attn_norm.weight")
                    .unwrap();
                let q = candle_core::quantized::QTensor::quantize(
                    &bias.1.dequantize(&candle_core::Device::Cpu).unwrap(),
                    GgmlDType::F32,
                )
                .unwrap();
                t.push(("blk.1.attn_output.bias".into(), q));
            }
        });
        kvplug::formats::gguf::index(&gguf, &dir.path().join(name))
    };
    let count = ("granitehybrid.expert_count", Value::U32(8));
    let e = index("experts", &[count], false).unwrap_err();
    assert!(e.to_string().contains("mixture of experts"), "{e}");
    let e = index("biased", &[], true).unwrap_err();
    assert!(e.to_string().contains("blk.1.attn_output.bias"), "{e}");
    let two = ("granitehybrid.ssm.group_count", Value::U32(2));
    index("groups", &[two], false).unwrap();
    let m = common::model(&runtime(), "cpu", &dir.path().join("groups"));
    let e = m
        .context(CacheKind::Contiguous, 64, KvDtype::F32)
        .map(|_| ())
        .unwrap_err();
    assert!(e.to_string().contains("2 groups is not supported"), "{e}");
    let gguf = dir.path().join("unbiased.gguf");
    write_granite_with(&gguf, &f32s, None, &[], |t| {
        t.retain(|(n, _)| !n.ends_with("ssm_conv1d.bias"))
    });
    let model = dir.path().join("unbiased");
    kvplug::formats::gguf::index(&gguf, &model).unwrap();
    let worst = greedy_logit_error(&model, "cpu", None);
    assert!(worst < 1e-3, "without convolution biases: {worst}");
}
