//! The real models (fetched into models/ by scripts/fetch-models.sh, which `make test`
//! runs): SmolLM2-135M-Instruct (Q4_1) imported and prompted through its own chat template
//! on every backend, Gemma 3 270M (Q4_K_M, sliding-window layers) against llama.cpp's
//! tokenizer algorithm and past its window, and Qwen2.5-Coder-0.5B-Instruct (Q4_K_M) used
//! in place on every backend and against the f64 reference.

use std::path::PathBuf;

use kvplug::formats::gguf;
use kvplug::{run_decode, RunReport, RunSpec};
use kvplug::{Chat, ChatOptions, Draft, KvDtype, Message, Model, Sampler, Speculation, Text};

use crate::common;
use common::{runtime, BACKENDS};

/// Greedy decoding of `spec` on `model`.
fn greedy(model: &Model, spec: &RunSpec) -> RunReport {
    run_decode(model, spec, None, Sampler::greedy(), None, &mut |_| Ok(())).unwrap()
}

/// `models/NAME`, fetched by scripts/fetch-models.sh (which `make test` runs).
fn model_file(name: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(name);
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-models.sh (make test does)",
        path.display()
    );
    path
}

fn smollm2() -> PathBuf {
    model_file("SmolLM2-135M-Instruct.Q4_1.gguf")
}

#[test]
fn smollm2_answers_paris_and_stops_at_end_of_turn_on_every_backend() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("smollm2");
    gguf::import(&smollm2(), &model, &mut |_, _, _| {}).unwrap();
    let text = Text::load(&model).unwrap();
    let prompt = text
        .render(&[Message::new("user", "What is the capital of France?")])
        .unwrap();
    assert!(
        prompt.starts_with("<|im_start|>system\n") && prompt.ends_with("<|im_start|>assistant\n"),
        "{prompt:?}"
    );
    let rt = runtime();
    let mut answers = Vec::new();
    for backend in BACKENDS {
        let spec = RunSpec {
            prompt: text.encode(&prompt).unwrap(),
            max_tokens: 32,
            kv_dtype: KvDtype::F16,
            capacity: 256,
            stop_tokens: text.stop_tokens().clone(),
        };
        let report = greedy(&common::model(&rt, backend, &model), &spec);
        let answer = text.detokenize(&report.ids).unwrap();
        assert!(answer.contains("Paris"), "{backend}: {answer:?}");
        let last = report.ids.last().unwrap();
        assert!(
            text.stop_tokens().contains(last) && report.ids.len() < spec.max_tokens,
            "{backend}: generation must end at <|im_end|>, got {:?}",
            report.ids
        );
        answers.push(report.ids);
    }
    for (backend, answer) in BACKENDS.iter().zip(&answers).skip(1) {
        assert_eq!(&answers[0], answer, "cpu and {backend} disagree");
    }

    // A chat: the second turn reuses the whole first exchange from the cache and prefills
    // only its own tokens.
    // The first turn is saved to a session file after it ends.
    let saved = dir.path().join("chat.kvsession.safetensors");
    let opts = |session: PathBuf| ChatOptions {
        system: None,
        capacity: 512,
        kv_dtype: None,
        max_tokens: 32,
        sampler: Sampler::new(0.0, 1.0, 0),
        session: Some(session),
        cancel: None,
        speculate: None,
    };
    let mut chat = Chat::new(&common::model(&rt, "cpu", &model), opts(saved.clone())).unwrap();
    let first = chat
        .turn("What is the capital of France?", &mut |_| Ok(()))
        .unwrap();
    assert!(first.text.contains("Paris"), "{:?}", first.text);
    assert_eq!(first.reused_tokens, 0);
    let after_first = dir.path().join("after-first.kvsession.safetensors");
    std::fs::copy(&saved, &after_first).unwrap();
    let second = chat.turn("And of Germany?", &mut |_| Ok(())).unwrap();
    assert!(second.text.contains("Berlin"), "{:?}", second.text);
    assert_eq!(
        second.reused_tokens,
        first.prefilled_tokens + first.ids.len() - 1
    );
    assert!(
        second.prefilled_tokens < 20,
        "{} prefilled",
        second.prefilled_tokens
    );

    // Resumed in a new chat on every backend (as after a restart): the same second answer,
    // with the first exchange restored from the file instead of prefilled.
    for backend in BACKENDS {
        let copy = dir.path().join(format!("{backend}.kvsession.safetensors"));
        std::fs::copy(&after_first, &copy).unwrap();
        let mut resumed = Chat::new(&common::model(&rt, backend, &model), opts(copy)).unwrap();
        assert_eq!(
            resumed.restored().map(|r| (r.tokens, r.messages)),
            Some((first.prefilled_tokens + first.ids.len() - 1, 2))
        );
        let again = resumed.turn("And of Germany?", &mut |_| Ok(())).unwrap();
        assert_eq!(
            (
                again.ids.as_slice(),
                again.reused_tokens,
                again.prefilled_tokens
            ),
            (
                second.ids.as_slice(),
                second.reused_tokens,
                second.prefilled_tokens
            ),
            "{backend}: resumed second turn"
        );
    }

    // A chat speculating (prompt lookup over the conversation, and the first 8 of the
    // model's 30 layers as a draft, drafting every step) answers as the plain chat does;
    // asked to repeat itself, prompt lookup finds the answer in the conversation (the
    // shallow draft's acceptance is its own business: on this model it is low).
    let turns = [
        "What is the capital of France?",
        "Repeat your last answer word for word.",
    ];
    let answers = |speculate: Option<Speculation>| {
        let opts = ChatOptions {
            session: None,
            speculate,
            ..opts(PathBuf::new())
        };
        let mut chat = Chat::new(&common::model(&rt, "cpu", &model), opts).unwrap();
        turns
            .iter()
            .map(|t| chat.turn(t, &mut |_| Ok(())).unwrap())
            .collect::<Vec<_>>()
    };
    let plain = answers(None);
    let layers = Draft::open(
        &"layers:8".parse().unwrap(),
        &common::model(&rt, "cpu", &model),
    );
    let drafted = [
        Speculation::ngram(),
        Speculation {
            min_depth: 4,
            ..Speculation::new(layers.unwrap())
        },
    ];
    for speculate in drafted {
        let what = format!("{:?}", speculate.draft);
        let got = answers(Some(speculate));
        for (g, p) in got.iter().zip(&plain) {
            assert_eq!(g.ids, p.ids, "{what}");
            assert_eq!(g.text, p.text, "{what}");
        }
        let repeat = got[1].speculation.unwrap();
        assert!(repeat.drafted > 0, "{what}: {repeat:?}");
        if what == "Ngram" {
            assert!(repeat.accepted > 0, "{what}: {repeat:?}");
        }
    }
}

/// `Llm`'s rules on the cpu backend: an answer that would pass the capacity ends there
/// with `Length` (the text streamed so far kept), a prompt that fills the capacity, a
/// `max_tokens` of 0 and an empty stop string are refused, and asked-for log-probabilities
/// come one per generated id.
#[test]
fn llm_answers_end_at_the_capacity_and_refuse_what_cannot_run() {
    use kvplug::{Finish, GenOptions, Llm};
    let rt = runtime();
    let open = |capacity| {
        Llm::builder(smollm2())
            .runtime(&rt)
            .capacity(capacity)
            .build()
            .unwrap()
    };
    let question = [Message::user("Tell me a long story about a dragon.")];
    let llm = open(48);
    let mut streamed = String::new();
    let long = GenOptions {
        logprobs: Some(2),
        ..GenOptions::max_tokens(1000)
    };
    let answer = llm
        .chat_stream(&question, long, &mut |piece| {
            streamed.push_str(piece);
            Ok(())
        })
        .unwrap();
    assert_eq!(answer.finish, Finish::Length, "{:?}", answer.text);
    assert!(answer.ids.len() >= 8, "{}", answer.prompt_tokens);
    assert_eq!(answer.prompt_tokens + answer.ids.len(), 48);
    assert_eq!(streamed, answer.text);
    let logprobs = answer.logprobs.unwrap();
    assert_eq!(logprobs.len(), answer.ids.len());
    for (l, &id) in logprobs.iter().zip(&answer.ids) {
        // Greedy: the token is the best alternative.
        assert_eq!((l.token, l.top.len(), l.top[0]), (id, 2, (id, l.logprob)));
        assert!(l.logprob <= 0.0 && l.logprob >= l.top[1].1, "{l:?}");
    }
    let e = llm.chat(&question, GenOptions::default()).unwrap_err();
    assert!(e.to_string().contains("max_tokens is 0"), "{e}");
    let empty_stop = GenOptions {
        stop_strings: vec![String::new()],
        ..GenOptions::max_tokens(8)
    };
    let e = llm.chat(&question, empty_stop).unwrap_err();
    assert!(
        e.to_string().contains("stop string must not be empty"),
        "{e}"
    );
    let e = open(answer.prompt_tokens)
        .chat(&question, GenOptions::max_tokens(8))
        .unwrap_err();
    assert!(e.to_string().contains("leaves no room"), "{e}");
    let e = Llm::builder(smollm2())
        .runtime(&rt)
        .capacity(0)
        .build()
        .err()
        .unwrap();
    assert!(e.to_string().contains("capacity"), "{e}");
}

/// Streamed pieces add up to the answer's ids detokenized whole, on each real tokenizer
/// (byte-level BPE: SmolLM2, Qwen; SentencePiece with byte fallback: Gemma 3), for a
/// sampled answer to a prompt that asks for accented, CJK and emoji text.
#[test]
fn streamed_pieces_add_up_to_the_answer_detokenized_whole() {
    use kvplug::{GenOptions, Llm};
    let rt = runtime();
    let question = [Message::user(
        "Écris trois phrases en français, puis traduis-les en japonais 日本語 avec des emoji 🐉🔥.",
    )];
    let mut non_ascii = false;
    for path in [smollm2(), gemma3(), qwen_coder()] {
        let llm = Llm::builder(&path).runtime(&rt).build().unwrap();
        let opts = GenOptions {
            sampler: Sampler::new(1.0, 1.0, 0),
            ..GenOptions::max_tokens(64)
        };
        let mut streamed = String::new();
        let answer = llm
            .chat_stream(&question, opts, &mut |piece| {
                streamed.push_str(piece);
                Ok(())
            })
            .unwrap();
        let ids = match answer.finish {
            kvplug::Finish::Stop => &answer.ids[..answer.ids.len() - 1],
            _ => &answer.ids[..],
        };
        let whole = llm.text().detokenize(ids).unwrap();
        // A sampled answer may end inside a character: its bytes are never printed.
        let whole = whole.trim_end_matches('\u{FFFD}');
        assert_eq!(streamed, whole, "{}", path.display());
        non_ascii |= !streamed.is_ascii();
    }
    assert!(non_ascii, "no answer had a character past ASCII");
}

/// Index directories no GGUF resolves to any more — its file deleted or changed, or its
/// indexing never finished — are removed once old enough; current ones stay.
#[test]
fn stale_gguf_indexes_are_swept() {
    use std::time::{Duration, SystemTime};
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("gguf-index");
    let [kept, gone, changed] = ["kept", "gone", "changed"].map(|n| dir.path().join(n));
    for f in [&kept, &gone, &changed] {
        std::fs::copy(smollm2(), f).unwrap();
    }
    for f in [&kept, &gone, &changed] {
        gguf::index(f, &root.join(gguf::index_digest(f).unwrap())).unwrap();
    }
    std::fs::create_dir(root.join(".kept.index-1")).unwrap();
    std::fs::remove_file(&gone).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&changed)
        .unwrap()
        .set_modified(SystemTime::now() - Duration::from_secs(600))
        .unwrap();
    let left = || {
        let mut names: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    };
    gguf::sweep_index(&root, gguf::STALE_INDEX_AGE);
    assert_eq!(left().len(), 4, "young directories stay");
    gguf::sweep_index(&root, Duration::ZERO);
    assert_eq!(left(), [gguf::index_digest(&kept).unwrap()]);
}

/// A chat outgrowing its capacity leaves out its oldest exchanges (never the system message)
/// and goes on; a turn whose callback fails or whose cancel flag is set (Ctrl-C in the CLI)
/// leaves the conversation and the cache as they were; `clear` keeps the system message; `save_as`/`load` round-trip.
#[test]
fn a_chat_outgrowing_its_capacity_drops_its_oldest_exchanges() {
    let rt = runtime();
    let model = common::model(&rt, "cpu", &gguf::resolve_model(&smollm2()).unwrap());
    let text = Text::load(model.dir()).unwrap();
    let cancel = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let opts = ChatOptions {
        system: Some("You answer in one short sentence.".into()),
        capacity: 110,
        kv_dtype: None,
        max_tokens: 24,
        sampler: Sampler::greedy(),
        session: None,
        cancel: Some(cancel.clone()),
        speculate: None,
    };
    let mut chat = Chat::new(&model, opts).unwrap();
    let questions = [
        "What is the capital of France?",
        "What is the capital of Italy?",
        "What is the capital of Spain?",
        "What is the capital of Japan?",
        "What is the capital of Peru?",
    ];
    let mut dropped = 0;
    for q in questions {
        let before = chat.messages().to_vec();
        let r = chat.turn(q, &mut |_| Ok(())).unwrap();
        dropped += r.dropped_messages;
        // The prompt was the rendering of what the conversation kept.
        let mut kept = chat.messages().to_vec();
        kept.pop();
        assert_eq!(kept[0].role, "system");
        assert_eq!(kept.last().unwrap().content, q);
        assert_eq!(&kept[1..kept.len() - 1], &before[1 + r.dropped_messages..]);
        let prompt = text.encode(&text.render(&kept).unwrap()).unwrap().len();
        assert_eq!(r.reused_tokens + r.prefilled_tokens, prompt);
        assert!(prompt + 24 <= 110 && chat.stats().tokens <= 110);
    }
    assert!(dropped >= 2 && dropped % 2 == 0, "dropped {dropped}");

    // A failing callback: the turn is dropped; the cache keeps the conversation's history.
    let (messages, tokens) = (chat.messages().to_vec(), chat.stats().tokens);
    let stopped = chat.turn("Tell me a long story.", &mut |_| {
        Err(kvplug::Error::Invalid("stopped".into()))
    });
    assert!(stopped.is_err());
    // (The cache keeps what the stopped turn's prompt shared with it.)
    assert_eq!(chat.messages(), messages.as_slice());
    assert!((1..=tokens).contains(&chat.stats().tokens));
    // The cancel flag set (Ctrl-C during a long prompt's prefill): the turn stops before any
    // text and is dropped the same way.
    cancel.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut pieces = 0;
    let stopped = chat.turn("Tell me a long story.", &mut |_| {
        pieces += 1;
        Ok(())
    });
    assert!(stopped.unwrap_err().to_string().contains("stopped"));
    assert_eq!(pieces, 0);
    assert_eq!(chat.messages(), messages.as_slice());
    cancel.store(false, std::sync::atomic::Ordering::SeqCst);
    let r = chat
        .turn("What is the capital of Chile?", &mut |_| Ok(()))
        .unwrap();
    assert!(r.reused_tokens > 0);

    // save_as, then load into a cleared chat: the same conversation and tokens. The new
    // conversation's turn in between is not saved over it.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("c.kvsession.safetensors");
    chat.save_as(file.clone()).unwrap();
    let (messages, tokens) = (chat.messages().to_vec(), chat.stats().tokens);
    assert_eq!(chat.clear(None), Some(file.clone()));
    assert_eq!(chat.messages(), &messages[..1], "the system message stays");
    assert_eq!(chat.stats().session, None);
    chat.turn("Hi.", &mut |_| Ok(())).unwrap();
    let restored = chat.load(file).unwrap();
    assert_eq!(
        (restored.messages, restored.tokens),
        (messages.len(), tokens)
    );
    assert_eq!(chat.messages(), messages.as_slice());
}

fn gemma3() -> PathBuf {
    model_file("gemma-3-270m-q4_k_m.gguf")
}

/// llama.cpp's SentencePiece tokenizer, plainly: user-defined pieces matched first (longest),
/// spaces as `▁`, then repeatedly the adjacent pair whose concatenation is the
/// highest-scoring normal piece is merged (leftmost on ties); leftovers become byte tokens.
fn spm_reference(vocab: &[String], scores: &[f32], types: &[i32], text: &str) -> Vec<i32> {
    let id: std::collections::HashMap<&str, usize> = vocab
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let user: Vec<usize> = (0..vocab.len()).filter(|&i| types[i] == 4).collect();
    let mut out = Vec::new();
    let mut segment = String::new();
    let flush = |segment: &mut String, out: &mut Vec<i32>| {
        let mut syms: Vec<String> = segment
            .replace(' ', "▁")
            .chars()
            .map(String::from)
            .collect();
        loop {
            let mut best: Option<(f32, usize)> = None;
            for i in 0..syms.len().saturating_sub(1) {
                let m = format!("{}{}", syms[i], syms[i + 1]);
                if let Some(&j) = id.get(m.as_str()).filter(|&&j| types[j] == 1) {
                    if best.is_none_or(|(s, _)| scores[j] > s) {
                        best = Some((scores[j], i));
                    }
                }
            }
            let Some((_, i)) = best else { break };
            let right = syms.remove(i + 1);
            syms[i].push_str(&right);
        }
        for s in syms {
            match id.get(s.as_str()) {
                Some(&j) => out.push(j as i32),
                None => out.extend(
                    s.bytes()
                        .map(|b| id[format!("<0x{b:02X}>").as_str()] as i32),
                ),
            }
        }
        segment.clear();
    };
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        let hit = user
            .iter()
            .filter(|&&u| rest.starts_with(vocab[u].as_str()))
            .max_by_key(|&&u| vocab[u].len());
        match hit {
            Some(&u) => {
                flush(&mut segment, &mut out);
                out.push(u as i32);
                rest = &rest[vocab[u].len()..];
            }
            None => {
                segment.push(c);
                rest = &rest[c.len_utf8()..];
            }
        }
    }
    flush(&mut segment, &mut out);
    out
}

#[test]
fn gemma3_recalls_a_word_from_past_the_window_with_bounded_sliding_layers() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("gemma3");
    gguf::import(&gemma3(), &model, &mut |_, _, _| {}).unwrap();
    let text = Text::load(&model).unwrap();

    // The imported tokenizer agrees with llama.cpp's algorithm over the GGUF's own
    // vocabulary and scores.
    let gguf = {
        let mut f = std::fs::File::open(gemma3()).unwrap();
        candle_core::quantized::gguf_file::Content::read(&mut f).unwrap()
    };
    let meta = |k: &str| gguf.metadata[k].to_vec().unwrap();
    let vocab: Vec<String> = meta("tokenizer.ggml.tokens")
        .iter()
        .map(|v| v.to_string().unwrap().clone())
        .collect();
    let scores: Vec<f32> = meta("tokenizer.ggml.scores")
        .iter()
        .map(|v| v.to_f32().unwrap())
        .collect();
    let types: Vec<i32> = meta("tokenizer.ggml.token_type")
        .iter()
        .map(|v| v.to_i32().unwrap())
        .collect();
    for s in [
        "The secret word is \"pelican\". Remember it.",
        "Hello world! héllo  two spaces\nnew line\n\n\tindented 12345",
        "naïve café, 東京タワー, emoji 🦜 and ⅞ of a ℌ",
    ] {
        assert_eq!(
            text.encode(s).unwrap(),
            spm_reference(&vocab, &scores, &types, s),
            "{s:?}"
        );
    }
    let chat = text
        .render(&[
            Message::new("system", "Be brief."),
            Message::new("user", "Hi"),
        ])
        .unwrap();
    assert_eq!(
        chat,
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    );

    // A word said once at the start, asked for ~1,500 tokens later: only the global layers
    // still see it (the sliding ones hold the last 512 positions).
    let filler: Vec<String> = (1..=80)
        .map(|i| {
            format!(
                "Line {i}: the weather today is mild and the river flows slowly past the old mill."
            )
        })
        .collect();
    let prompt = format!(
        "The secret word is \"pelican\". Remember it.\n{}\nWhat was the secret word? The secret word is \"",
        filler.join(" ")
    );
    let ids = text.encode_raw(&prompt).unwrap();
    assert_eq!(ids[0], 2, "the raw prompt starts with <bos>");
    assert!(ids.len() > 1024 + 100, "{} tokens", ids.len());
    let rt = runtime();
    let spec = RunSpec {
        prompt: ids.clone(),
        max_tokens: 4,
        kv_dtype: KvDtype::F16,
        capacity: 4096,
        stop_tokens: text.stop_tokens().clone(),
    };
    let report = greedy(&common::model(&rt, "cpu", &model), &spec);
    let answer = text.detokenize(&report.ids).unwrap();
    assert!(answer.starts_with("pelican"), "{answer:?}");
    // The full layers hold every position; the sliding layers at most the window plus
    // one prefill micro-batch (pools grow by doubling).
    let c = &report.cache;
    let bound = (512 + kvplug::PREFILL_UBATCH).next_power_of_two() as u64;
    assert!(c.pool_cells >= ids.len() as u64, "{c:?}");
    assert!(c.window_cells > 0 && c.window_cells <= bound, "{c:?}");
    assert!(c.window_cells < c.pool_cells, "{c:?}");
}

fn qwen_coder() -> PathBuf {
    model_file("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
}

/// Qwen2.5-Coder-0.5B-Instruct Q4_K_M (Q5_0, Q8_0, Q4_K, Q6_K and f32 tensors), its weights
/// used in place: the same greedy tokens on every backend (the cpu computes the blocks with
/// int8 activations, wgpu dequantizes them in its shaders, mlx widens them at load on its CPU device), and the
/// f64 reference forward over the same dequantized weights picks those tokens too (teacher
/// forced, position by position). A raw prompt keeps lavapipe's share short.
#[test]
fn qwen_q4_k_m_in_place_agrees_across_backends_and_with_the_f64_reference() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("qwen");
    gguf::index(&qwen_coder(), &model).unwrap();
    assert!(
        !model.join("model.safetensors").exists(),
        "no weight file is written: the GGUF is used in place"
    );
    let text = Text::load(&model).unwrap();
    let prompt = text.encode("The capital of France is").unwrap();
    let rt = runtime();
    let mut answers = Vec::new();
    for backend in BACKENDS {
        let spec = RunSpec {
            prompt: prompt.clone(),
            max_tokens: 3,
            kv_dtype: KvDtype::F16,
            capacity: 64,
            stop_tokens: Default::default(),
        };
        let report = greedy(&common::model(&rt, backend, &model), &spec);
        let answer = text.detokenize(&report.ids).unwrap();
        assert!(answer.contains("Paris"), "{backend}: {answer:?}");
        answers.push(report.ids);
    }
    for (backend, answer) in BACKENDS.iter().zip(&answers).skip(1) {
        assert_eq!(&answers[0], answer, "cpu and {backend} disagree");
    }
    let mut forced = prompt.clone();
    forced.extend(&answers[0]);
    let want = common::reference_logits(&model, &forced[..forced.len() - 1]);
    let picked: Vec<i32> = want[prompt.len() - 1..]
        .iter()
        .map(|l| (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b])).unwrap() as i32)
        .collect();
    assert_eq!(picked, answers[0], "the f64 reference's greedy tokens");
}
