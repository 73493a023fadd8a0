//! `kvplug serve` on the real model (SmolLM2-135M-Instruct, fetched by
//! scripts/fetch-models.sh, which `make test` runs, imported to f16), each test starting its own server on a
//! loopback port and talking HTTP to it: with a Rust client (ureq) and with the official
//! `openai` Python package. Needs `cargo build --workspace` (the cpu plugin).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;
use common::server::Server;

/// SmolLM2 imported to f16 (see [`common::server::smollm2_f16`]).
fn model() -> PathBuf {
    common::server::smollm2_f16()
}

/// File names in a session directory.
fn session_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect()
}

/// The server's engine state once `ok` holds of it, polled. The limit only guards against a
/// hang: every wait here ends on the server's own work or timers, seconds on any machine.
fn engine_when(s: &Server, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let started = Instant::now();
    loop {
        let e = s.engine();
        if ok(&e) {
            return e;
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "{what}: never after 10 minutes: {e}"
        );
        thread::sleep(Duration::from_millis(20));
    }
}

fn user(q: &str) -> Value {
    json!([{"role": "user", "content": q}])
}

fn chat(messages: &Value, max_tokens: usize) -> Value {
    json!({"messages": messages, "temperature": 0, "max_tokens": max_tokens})
}

/// The first streamed chunk of choice `i`.
fn first_chunk(chunks: &[Value], i: usize) -> &Value {
    let mut of_i = chunks.iter().filter(|c| c["choices"][0]["index"] == i);
    of_i.next()
        .unwrap_or_else(|| panic!("no chunk of choice {i}: {chunks:?}"))
}

fn content(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn chat_and_completions_speak_openai_streamed_or_not() {
    // A host name listens where it resolves (localhost: loopback).
    let s = Server::start(&model(), &["--api-key", "sesame", "--host", "localhost"]);
    // The key guards /v1; /health stays open.
    assert_eq!(s.get_as("/health", None).1["status"], "ok");
    let (status, v) = s.get_as("/v1/models", None);
    assert_eq!(
        (status, &v["error"]["code"]),
        (401, &json!("invalid_api_key"))
    );
    assert_eq!(s.get_as("/v1/models", Some("wrong")).0, 401);
    // An authentication scheme's name is case-insensitive (RFC 9110 §11.1).
    for scheme in ["bearer", "BEARER"] {
        let header = format!("{scheme} sesame");
        assert_eq!(
            s.get_authorized("/v1/models", Some(&header)).0,
            200,
            "{header}"
        );
    }
    assert_eq!(s.get_authorized("/v1/models", Some("Basic sesame")).0, 401);
    // A path that is no route tells a client without the key nothing either; with it, 404.
    assert_eq!(s.get_as("/v1/bogus", None).0, 401);
    assert_eq!(s.get_as("/v1/bogus", Some("sesame")).0, 404);
    assert_eq!(s.get_as("/bogus", None).0, 404);
    let (status, v) = s.get("/v1/models");
    assert_eq!(
        (status, v["data"][0]["object"].as_str()),
        (200, Some("model"))
    );
    // A model directory is named whole (a file would lose its extension).
    assert_eq!(v["data"][0]["id"], common::server::SMOLLM2_F16_ID);

    let q = user("What is the capital of France?");
    let a = s.ok("/v1/chat/completions", &chat(&q, 24), &[]);
    assert_eq!(a["object"], "chat.completion");
    let answer = content(&a);
    assert!(answer.contains("Paris"), "{a}");
    assert_eq!(a["choices"][0]["finish_reason"], "stop");
    let usage = &a["usage"];
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 0,
        "{usage}"
    );
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(prompt_tokens + usage["completion_tokens"].as_u64().unwrap())
    );

    // Asked again: reused up to its last token (which must run for its logits). A server
    // requiring a key does not say where reuse ended (x-kvplug-prefix would show another
    // client's prompt; agent_dialect's Messages test checks `--prefix-header` makes it).
    let (status, headers, _) = s.post_with_headers("/v1/chat/completions", &chat(&q, 1));
    assert_eq!(
        (status, headers.contains_key("x-kvplug-prefix")),
        (200, false)
    );

    // Streamed: the same answer in chunks, then the usage chunk. The repeated prompt is
    // reused from the prefix index up to its last token (which must run for its logits).
    let mut body = chat(&q, 24);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let chunks = s.chunks("/v1/chat/completions", &body);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, answer);
    let n = chunks.len();
    assert_eq!(chunks[n - 2]["choices"][0]["finish_reason"], "stop");
    assert_eq!(chunks[n - 1]["choices"], json!([]));
    assert!(
        chunks[..n - 1]
            .iter()
            .all(|c| c["usage"].is_null() && c.as_object().unwrap().contains_key("usage")),
        "usage: null on every chunk before the last"
    );
    assert_eq!(
        chunks[n - 1]["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(prompt_tokens - 1),
        "{}",
        chunks[n - 1]
    );

    // Completions with a stop string: the text is cut right before it, and is otherwise
    // what the same request without the stop generates.
    let prompt = json!({"prompt": "1, 2, 3, 4,", "temperature": 0, "max_tokens": 12});
    let free = s.ok("/v1/completions", &prompt, &[]);
    let free_text = free["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(free_text.contains('7'), "{free}");
    // The same prompt as token ids, bare or as a batch of one: the same answer.
    let ids = kvplug::Text::load(&model())
        .unwrap()
        .encode("1, 2, 3, 4,")
        .unwrap();
    for as_ids in [json!(ids), json!([ids])] {
        let mut by_ids = prompt.clone();
        by_ids["prompt"] = as_ids;
        let v = s.ok("/v1/completions", &by_ids, &[]);
        assert_eq!(v["choices"][0]["text"], free_text.as_str(), "{v}");
        assert_eq!(v["usage"]["prompt_tokens"], ids.len(), "{v}");
    }
    let mut stopped = prompt.clone();
    stopped["stop"] = json!(["7", "never"]);
    let cut = s.ok("/v1/completions", &stopped, &[]);
    let cut_text = cut["choices"][0]["text"].as_str().unwrap();
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        free_text.find('7').map(|i| &free_text[..i]),
        Some(cut_text),
        "{cut}"
    );
    stopped["stream"] = json!(true);
    let chunks = s.chunks("/v1/completions", &stopped);
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, cut_text);

    // The official Python client.
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/openai-client.sh");
    let out = Command::new(script)
        .args([&s.url, "sesame"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "openai client: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    s.stop();
}

/// `/v1/completions` with `echo`: each choice's text starts with the prompt, and with
/// `logprobs` the prompt's tokens lead the log-probabilities in OpenAI's shape (the first
/// one's null, nothing coming before it) — lm-eval-harness's loglikelihood request (token ids
/// in a batch of one, `max_tokens` 1, `logprobs` 1) — streamed as the whole answer gives it,
/// and alike for each of `n` completions.
/// The scores themselves are checked against the f64 reference forward in the model tests
/// (`prompt_scores_match_the_f64_reference`).
#[test]
fn completions_echo_and_score_their_prompt() {
    const CAPACITY: usize = 256;
    let s = Server::start(&model(), &["--capacity", &CAPACITY.to_string()]);
    let text = kvplug::Text::load(&model()).unwrap();
    let q = "The capital of France is";
    let ids = text.encode(q).unwrap();
    let plain = s.ok(
        "/v1/completions",
        &json!({"prompt": q, "temperature": 0, "max_tokens": 1}),
        &[],
    );
    let next = plain["choices"][0]["text"].as_str().unwrap();
    let scored =
        json!({"prompt": q, "temperature": 0, "max_tokens": 1, "echo": true, "logprobs": 2});
    let v = s.ok("/v1/completions", &scored, &[]);
    let c = &v["choices"][0];
    assert_eq!(c["text"], format!("{q}{next}"), "{v}");
    let lp = &c["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(
        tokens.len(),
        ids.len() + 1,
        "the prompt's tokens and the answer's: {v}"
    );
    assert_eq!(tokens.concat(), format!("{q}{next}"), "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], ids.len(), "{v}");
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "a scored prompt runs whole: {v}"
    );
    assert!(
        lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null(),
        "{v}"
    );
    let mut offset = 0;
    for (k, t) in tokens.iter().enumerate() {
        assert_eq!(lp["text_offset"][k], offset, "{v}");
        offset += t.chars().count();
        if k == 0 {
            continue;
        }
        let own = lp["token_logprobs"][k].as_f64().unwrap();
        let top = lp["top_logprobs"][k].as_object().unwrap();
        let best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!(
            (1..=2).contains(&top.len()) && own <= best && best <= 0.0,
            "{k}: {v}"
        );
    }
    // Streamed: the echo comes first, then the answer, with the same tokens. The scores are
    // the same computation in other cells: f32 sums over at most 6 keys in another order,
    // far below 1e-3.
    let mut streamed = scored.clone();
    streamed["stream"] = json!(true);
    let chunks = s.chunks("/v1/completions", &streamed);
    let choices: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]).collect();
    assert_eq!(choices[0]["text"], q, "{chunks:?}");
    let joined: String = choices.iter().filter_map(|c| c["text"].as_str()).collect();
    assert_eq!(joined, c["text"].as_str().unwrap());
    let field = |name: &str| -> Vec<Value> {
        let lps = choices.iter().filter(|c| !c["logprobs"].is_null());
        lps.flat_map(|c| c["logprobs"][name].as_array().unwrap().clone())
            .collect()
    };
    assert_eq!(field("tokens"), *lp["tokens"].as_array().unwrap());
    assert_eq!(field("text_offset"), *lp["text_offset"].as_array().unwrap());
    for (a, b) in field("token_logprobs")
        .iter()
        .zip(lp["token_logprobs"].as_array().unwrap())
    {
        assert!(a.is_null() == b.is_null(), "{a} {b}");
        assert!(
            a.is_null() || (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-3,
            "{a} {b}"
        );
    }
    // OpenAI's scoring idiom: `max_tokens` 0 echoes the prompt alone, scored as above.
    let mut prompt_only = scored.clone();
    prompt_only["max_tokens"] = json!(0);
    let p0 = s.ok("/v1/completions", &prompt_only, &[]);
    let c0 = &p0["choices"][0];
    assert_eq!(
        (&c0["text"], &c0["finish_reason"]),
        (&json!(q), &json!("length")),
        "{p0}"
    );
    assert_eq!(p0["usage"]["completion_tokens"], 0, "{p0}");
    let l0 = c0["logprobs"]["token_logprobs"].as_array().unwrap();
    assert_eq!(l0.len(), ids.len(), "{p0}");
    for (a, b) in l0
        .iter()
        .zip(lp["token_logprobs"].as_array().unwrap())
        .skip(1)
    {
        assert!(
            (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-3,
            "{a} {b}"
        );
    }
    prompt_only["stream"] = json!(true);
    let chunks = s.chunks("/v1/completions", &prompt_only);
    let joined: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(joined, q, "{chunks:?}");
    let unscored = json!({"prompt": q, "max_tokens": 0, "echo": true, "n": 2});
    let v = s.ok("/v1/completions", &unscored, &[]);
    assert!(
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["text"] == q),
        "{v}"
    );
    let (status, e) = s.post(
        "/v1/completions",
        &json!({"prompt": q, "max_tokens": 0}),
        &[],
    );
    assert_eq!(
        (status, &e["error"]["param"]),
        (400, &json!("max_tokens")),
        "{e}"
    );
    // Nothing generated: a prompt as long as the context is scored whole.
    let full =
        json!({"prompt": [vec![ids[1]; CAPACITY]], "max_tokens": 0, "echo": true, "logprobs": 0});
    let v = s.ok("/v1/completions", &full, &[]);
    assert_eq!(
        v["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .len(),
        CAPACITY
    );
    // Pieces of a character (SmolLM2's byte tokens split these emoji): each alternative
    // under a name of its own (`bytes:\x..` where its bytes are no text), so none hides a
    // likelier one; a token starts where the character it completes does.
    let emoji = "😀👍🏽";
    let e = s.ok(
        "/v1/completions",
        &json!({"prompt": emoji, "max_tokens": 3, "temperature": 0, "echo": true, "logprobs": 20}),
        &[],
    );
    let el = &e["choices"][0]["logprobs"];
    let names = el["tokens"].as_array().unwrap();
    assert!(
        names
            .iter()
            .any(|t| t.as_str().unwrap().starts_with("bytes:\\x")),
        "{e}"
    );
    for (k, top) in el["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .skip(1)
    {
        let values: Vec<f64> = top
            .as_object()
            .unwrap()
            .values()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(
            values.len(),
            20,
            "{k}: no two alternatives share a name: {top}"
        );
        let own = el["token_logprobs"][k].as_f64().unwrap();
        let best = values.iter().copied().fold(f64::MIN, f64::max);
        assert!(own <= best, "{k}: {top}");
    }
    let offsets: Vec<usize> = el["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap() as usize)
        .collect();
    let prompt_tokens = e["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert_eq!(
        offsets[prompt_tokens],
        emoji.chars().count(),
        "the answer starts after the prompt: {e}"
    );
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{e}");
    // lm-eval-harness's request: token ids in a batch of one.
    let harness = json!({"prompt": [ids], "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": true, "seed": 1234});
    let h = s.ok("/v1/completions", &harness, &[]);
    let hl = &h["choices"][0]["logprobs"];
    assert_eq!(hl["tokens"], lp["tokens"], "{h}");
    assert!(
        h["choices"][0]["text"].as_str().unwrap().starts_with(q),
        "{h}"
    );
    // Echo alone: every completion starts with the prompt, streamed or not.
    let sampled = json!({"prompt": q, "max_tokens": 3, "n": 2, "seed": 5, "echo": true});
    let v = s.ok("/v1/completions", &sampled, &[]);
    for c in v["choices"].as_array().unwrap() {
        assert!(
            c["text"].as_str().unwrap().starts_with(q) && c["logprobs"].is_null(),
            "{v}"
        );
    }
    let mut sampled_stream = sampled.clone();
    sampled_stream["stream"] = json!(true);
    let chunks = s.chunks("/v1/completions", &sampled_stream);
    for i in 0..2 {
        let first = first_chunk(&chunks, i);
        assert_eq!(first["choices"][0]["text"], q, "{chunks:?}");
    }
    // Several completions of a scored prompt share one prefill, which scores the prompt to
    // its last token (its last row against the token each completion feeds): every choice
    // leads with the prompt's tokens and the scores one completion gets, streamed or not.
    // The same cells and rows as above, in a batch one token shorter: at most the f32
    // reordering allowed there.
    let mut several = scored.clone();
    several["n"] = json!(2);
    several["temperature"] = json!(1);
    let prompt_part = |lp: &Value, field: &str| -> Vec<Value> {
        lp[field].as_array().unwrap()[..ids.len()].to_vec()
    };
    let close = |a: &[Value], b: &[Value], what: &str| {
        assert_eq!(a.len(), b.len(), "{what}");
        for (a, b) in a.iter().zip(b) {
            assert!(a.is_null() == b.is_null(), "{what}: {a} {b}");
            assert!(
                a.is_null() || (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-3,
                "{what}: {a} {b}"
            );
        }
    };
    let v = s.ok("/v1/completions", &several, &[]);
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{v}");
    for c in choices {
        let l = &c["logprobs"];
        assert!(c["text"].as_str().unwrap().starts_with(q), "{v}");
        assert_eq!(prompt_part(l, "tokens"), prompt_part(lp, "tokens"), "{v}");
        assert_eq!(
            prompt_part(l, "text_offset"),
            prompt_part(lp, "text_offset")
        );
        let (got, want) = (
            prompt_part(l, "token_logprobs"),
            prompt_part(lp, "token_logprobs"),
        );
        close(&got, &want, "n = 2");
        // The answer's token follows with its own score.
        assert_eq!(l["tokens"].as_array().unwrap().len(), ids.len() + 1, "{v}");
    }
    several["stream"] = json!(true);
    let chunks = s.chunks("/v1/completions", &several);
    for i in 0..2 {
        let first = first_chunk(&chunks, i);
        let l = &first["choices"][0]["logprobs"];
        assert_eq!(first["choices"][0]["text"], q, "{chunks:?}");
        close(
            &prompt_part(l, "token_logprobs"),
            &prompt_part(lp, "token_logprobs"),
            "n = 2, streamed",
        );
    }
    // A prompt of one token has no shared prefill: nothing to score but its lead.
    let one = json!({"prompt": [[ids[0]]], "max_tokens": 1, "n": 2, "echo": true, "logprobs": 1});
    let v = s.ok("/v1/completions", &one, &[]);
    for c in v["choices"].as_array().unwrap() {
        let l = &c["logprobs"]["token_logprobs"];
        assert!(l[0].is_null() && l.as_array().unwrap().len() == 2, "{v}");
    }
    // An agent's reused history is not scored again.
    let (status, e) = s.post("/v1/completions", &scored, &[("X-Session-Id", "a")]);
    assert_eq!((status, &e["error"]["param"]), (400, &json!("echo")), "{e}");
    s.stop();
}

/// `/v1/completions`' batch form (several prompts, as OpenAI and lm-eval-harness's batches
/// send them): prompt `i`'s completion `j` is choice `i·n + j`, each what its prompt gets
/// alone, the usage their sum, one id; streamed, the same texts under one id and one usage
/// chunk last; echoed and scored, each choice leads with its own prompt.
#[test]
fn completions_answer_a_batch_of_prompts() {
    let s = Server::start(&model(), &[]);
    let prompts = ["1, 2, 3, 4,", "a, b, c, d,", "Monday, Tuesday,"];
    let ask = |prompt: Value, n: usize| json!({"prompt": prompt, "temperature": 0, "max_tokens": 6, "n": n});
    let alone: Vec<Value> = prompts
        .iter()
        .map(|p| s.ok("/v1/completions", &ask(json!(p), 1), &[]))
        .collect();
    let text = |v: &Value, i: usize| v["choices"][i]["text"].as_str().unwrap().to_string();
    let v = s.ok("/v1/completions", &ask(json!(prompts), 2), &[]);
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 6, "{v}");
    for (k, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], k, "{v}");
        assert_eq!(text(&v, k), text(&alone[k / 2], 0), "choice {k}: {v}");
    }
    // Each prompt counted once, each completion's tokens (two a prompt here).
    let sum = |f: &str| -> u64 { alone.iter().map(|a| a["usage"][f].as_u64().unwrap()).sum() };
    let (prompt, completion) = (sum("prompt_tokens"), 2 * sum("completion_tokens"));
    let u = &v["usage"];
    assert_eq!(
        (
            &u["prompt_tokens"],
            &u["completion_tokens"],
            &u["total_tokens"]
        ),
        (
            &json!(prompt),
            &json!(completion),
            &json!(prompt + completion)
        ),
        "{v}"
    );
    let mut streamed = ask(json!(prompts), 2);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = s.chunks("/v1/completions", &streamed);
    let id = &chunks[0]["id"];
    assert!(chunks.iter().all(|c| &c["id"] == id), "one id: {chunks:?}");
    let usages: Vec<&Value> = chunks.iter().filter(|c| !c["usage"].is_null()).collect();
    assert_eq!(usages.len(), 1, "{chunks:?}");
    assert_eq!(
        usages[0]["usage"], v["usage"],
        "the usage chunk is the last"
    );
    assert_eq!(chunks.last().unwrap()["usage"], v["usage"]);
    for k in 0..6 {
        let joined: String = chunks
            .iter()
            .flat_map(|c| c["choices"].as_array().unwrap())
            .filter(|c| c["index"] == k)
            .filter_map(|c| c["text"].as_str())
            .collect();
        assert_eq!(joined, text(&v, k), "streamed choice {k}");
    }
    // lm-eval-harness's loglikelihood batch: token ids, echoed and scored.
    let ids: Vec<Vec<i32>> = prompts
        .iter()
        .map(|p| kvplug::Text::load(&model()).unwrap().encode(p).unwrap())
        .collect();
    let scored =
        json!({"prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": true});
    let v = s.ok("/v1/completions", &scored, &[]);
    for (k, p) in prompts.iter().enumerate() {
        let c = &v["choices"][k];
        assert!(c["text"].as_str().unwrap().starts_with(p), "{v}");
        assert_eq!(
            c["logprobs"]["tokens"].as_array().unwrap().len(),
            ids[k].len() + 1,
            "{v}"
        );
        assert!(c["logprobs"]["token_logprobs"][0].is_null(), "{v}");
    }
    // One grammar for the batch, compiled once: every prompt's answers follow it, and a
    // grammar that allows no answer refuses the batch.
    let mut constrained = ask(json!(prompts), 2);
    constrained["grammar"] = json!(r#"start: "yes" | "no""#);
    let v = s.ok("/v1/completions", &constrained, &[]);
    for k in 0..6 {
        assert!(
            ["yes", "no"].contains(&text(&v, k).as_str()),
            "choice {k}: {v}"
        );
    }
    constrained["grammar"] = json!("start: start");
    let (status, e) = s.post("/v1/completions", &constrained, &[]);
    assert_eq!(
        (status, &e["error"]["param"]),
        (400, &json!("grammar")),
        "{e}"
    );
    // A batch is answered whole or refused whole; an agent session takes one prompt.
    let (status, e) = s.post("/v1/completions", &json!({"prompt": ["x", [1]]}), &[]);
    assert_eq!(
        (status, &e["error"]["param"]),
        (400, &json!("prompt")),
        "{e}"
    );
    let (status, e) = s.post("/v1/completions", &json!({"prompt": ["x", ""]}), &[]);
    let says = e["error"]["message"].as_str().unwrap();
    assert!(
        status == 400 && says.starts_with("prompt 1: "),
        "which prompt: {e}"
    );
    let (status, e) = s.post(
        "/v1/completions",
        &ask(json!(["x", "y"]), 1),
        &[("X-Session-Id", "a")],
    );
    assert_eq!(
        (status, &e["error"]["param"]),
        (400, &json!("prompt")),
        "{e}"
    );
    s.stop();
}

/// A bad request and the error it must get.
struct Bad {
    body: Vec<u8>,
    header: Option<(&'static str, &'static str)>,
    status: u16,
    param: Option<&'static str>,
    says: &'static str,
}

#[test]
fn bad_requests_get_4xx_and_the_server_keeps_serving() {
    let s = Server::start(
        &model(),
        &[
            "--capacity",
            "256",
            "--max-body",
            "4096",
            "--max-tokens",
            "64",
            "--parallel",
            "1",
            "--max-queue",
            "1",
        ],
    );
    let path = "/v1/chat/completions";
    let hi = user("Hi");
    let long = "word ".repeat(400);
    let bad =
        |body: &[u8], header: Option<(&'static str, &'static str)>, status, param, says| Bad {
            body: body.to_vec(),
            header,
            status,
            param,
            says,
        };
    let cases = [
        bad(b"{\"messages\": [", None, 400, None, "not valid JSON"),
        bad(b"[1, 2]", None, 400, None, "JSON object"),
        bad(
            br#"{"messages": "hi"}"#,
            None,
            400,
            Some("messages"),
            "array",
        ),
        bad(
            json!({"messages": hi, "temperature": "hot"})
                .to_string()
                .as_bytes(),
            None,
            400,
            Some("temperature"),
            "a number",
        ),
        bad(
            json!({"messages": hi, "max_tokens": 65})
                .to_string()
                .as_bytes(),
            None,
            400,
            Some("max_tokens"),
            "limit of 64",
        ),
        bad(
            json!({"messages": user(&long)}).to_string().as_bytes(),
            None,
            400,
            Some("messages"),
            "tokens > 255 maximum. This model's maximum context length is 256 tokens.",
        ),
        bad(&[b' '; 5000], None, 413, None, "length limit"),
        bad(
            json!({"messages": hi}).to_string().as_bytes(),
            Some(("X-Session-Id", "../etc")),
            400,
            None,
            "not an agent name",
        ),
    ];
    for c in &cases {
        let headers: Vec<_> = c.header.into_iter().collect();
        let (got, v) = s.post_raw(path, &c.body, &headers);
        let what = String::from_utf8_lossy(&c.body[..c.body.len().min(60)]);
        assert_eq!(got, c.status, "{what}: {v}");
        assert_eq!(v["error"]["param"].as_str(), c.param, "{what}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(c.says), "{what}: {message}");
        assert_eq!(s.engine()["active"], 0);
    }
    // A token id the model does not have.
    let (got, v) = s.post("/v1/completions", &json!({"prompt": [1, 99_999_999]}), &[]);
    assert_eq!(
        (got, v["error"]["param"].as_str()),
        (400, Some("prompt")),
        "{v}"
    );
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("outside the vocabulary"), "{message}");
    // A prompt past the capacity is named by its own field on each OpenAI endpoint.
    for (route, body, param) in [
        ("/v1/completions", json!({"prompt": long}), "prompt"),
        ("/v1/responses", json!({"input": long}), "input"),
    ] {
        let (got, v) = s.post(route, &body, &[]);
        assert_eq!(
            (got, v["error"]["param"].as_str()),
            (400, Some(param)),
            "{route}: {v}"
        );
    }
    let (got, v) = s.post(
        path,
        &json!({"messages": hi, "logit_bias": {"7": 500}}),
        &[],
    );
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        got == 400 && message.contains("token 7") && message.contains("not 500"),
        "{v}"
    );
    let (got, v) = s.post(
        path,
        &json!({"messages": hi, "logit_bias": {"99999999": 5}}),
        &[],
    );
    assert_eq!(
        (got, v["error"]["param"].as_str()),
        (400, Some("logit_bias")),
        "{v}"
    );
    let (status, v) = s.get("/v1/nothing");
    assert_eq!(
        (status, v["error"]["type"].as_str()),
        (404, Some("invalid_request_error"))
    );
    let (status, v) = s.get(path);
    assert_eq!(
        (status, v["error"]["type"].as_str()),
        (405, Some("invalid_request_error")),
        "{v}"
    );
    // Under /v1/messages, in Anthropic's shape.
    for (got, status, kind) in [
        (s.get("/v1/messages"), 405, "invalid_request_error"),
        (s.get("/v1/messages/batches"), 404, "not_found_error"),
    ] {
        assert_eq!(
            (
                got.0,
                got.1["type"].as_str(),
                got.1["error"]["type"].as_str()
            ),
            (status, Some("error"), Some(kind)),
            "{}",
            got.1
        );
    }
    assert!(
        content(&s.ok(path, &chat(&hi, 4), &[])).len() > 1,
        "still serving"
    );

    s.stop();

    // The rest holds requests in flight with answers far longer than the test needs them (a
    // thousand tokens, EOS ignored), so no check below races the decode however fast or slow
    // the machine is: one in flight (--parallel 1) and one waiting (--max-queue 1).
    let s = Server::start(&model(), &["--parallel", "1", "--max-queue", "1"]);
    let held = 1000;
    let mut body = chat(&user("Count from 1 to 100, separated by commas."), held);
    body["stream"] = json!(true);
    body["ignore_eos"] = json!(true);

    // A client that goes away mid-stream: its sequence is released within a few steps, long
    // before its answer would have been generated.
    let mut lines = s.stream(path, &body);
    for _ in 0..4 {
        lines.next().unwrap();
    }
    let during = s.engine();
    assert_eq!(during["active"], 1, "{during}");
    let cache = &during["cache"];
    assert!(
        cache["live_cells"].as_u64() > cache["prefix_evictable"].as_u64(),
        "the stream's sequence holds cells: {cache}"
    );
    drop(lines);
    let after = engine_when(&s, "the sequence released", |e| e["active"] == 0);
    let steps = after["steps"].as_u64().unwrap() - during["steps"].as_u64().unwrap();
    assert!(
        steps < held as u64 / 2,
        "{steps} more steps ran after the client left"
    );
    let cache = &after["cache"];
    assert_eq!(
        cache["live_cells"], cache["prefix_evictable"],
        "no sequence holds a cell once the client is gone: {cache}"
    );
    // The abandoned answer left nothing behind: the same question now runs its 64 tokens.
    let full = s.ok(
        path,
        &chat(&user("Count from 1 to 100, separated by commas."), 64),
        &[],
    );
    assert_eq!(full["usage"]["completion_tokens"], 64, "{full}");

    // One request in flight and one waiting: a third is turned away with 429 and
    // Retry-After, and the waiting one is served after.
    let mut lines = s.stream(path, &body);
    lines.next().unwrap();
    thread::scope(|scope| {
        let waiting = scope.spawn(|| s.post(path, &chat(&hi, 4), &[]));
        engine_when(&s, "a request queued", |e| e["queued"] == 1);
        let mut r = s.send(path, chat(&hi, 4).to_string().as_bytes(), &[]);
        assert_eq!(r.status().as_u16(), 429);
        assert_eq!(r.headers()["retry-after"], "1");
        let v: Value = r.body_mut().read_json().unwrap();
        assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
        drop(lines);
        let (status, v) = waiting.join().unwrap();
        assert_eq!(status, 200, "{v}");
    });
    s.stop();
}

#[test]
fn concurrent_clients_get_what_each_would_get_alone() {
    const CLIENTS: usize = 16;
    const ROUNDS: usize = 8;
    let s = Server::start(&model(), &["--parallel", "16", "--capacity", "4096"]);
    let path = "/v1/chat/completions";
    let topics = [
        "cats", "rivers", "bread", "stars", "chess", "rain", "bees", "glass", "salt", "wolves",
        "maps", "clocks", "tea", "snow", "bridges", "owls",
    ];
    let request = |i: usize| {
        chat(
            &user(&format!("Say one short sentence about {}.", topics[i])),
            8,
        )
    };
    let alone: Vec<String> = (0..topics.len())
        .map(|i| content(&s.ok(path, &request(i), &[])))
        .collect();
    let t = Instant::now();
    thread::scope(|scope| {
        let s = &s;
        let alone = &alone;
        let handles: Vec<_> = (0..CLIENTS)
            .map(|c| {
                scope.spawn(move || {
                    for r in 0..ROUNDS {
                        let i = (c * 5 + r * 3) % topics.len();
                        let got = content(&s.ok(path, &request(i), &[]));
                        assert_eq!(got, alone[i], "client {c} round {r}: {}", topics[i]);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    });
    let e = s.engine();
    eprintln!(
        "{} requests from {CLIENTS} clients in {:.1} s, {} forward steps",
        CLIENTS * ROUNDS,
        t.elapsed().as_secs_f64(),
        e["steps"]
    );
    assert_eq!(
        e["completed"],
        (CLIENTS * ROUNDS + topics.len()) as u64,
        "{e}"
    );
    s.stop();
}

/// More completions than the cache has sequences (6 requests × n=16 against 64): the
/// requests wait for sequences instead of failing or stopping the server, each gets its 16
/// choices, and the server then serves on.
#[test]
fn requests_for_more_completions_than_sequences_wait_their_turn() {
    let s = Server::start(&model(), &["--capacity", "4096"]);
    let body = json!({"prompt": "One, two, three,", "n": 16, "max_tokens": 4, "temperature": 0.9});
    thread::scope(|scope| {
        let handles: Vec<_> = (0..6)
            .map(|_| scope.spawn(|| s.ok("/v1/completions", &body, &[])))
            .collect();
        for h in handles {
            let v = h.join().unwrap();
            assert_eq!(v["choices"].as_array().unwrap().len(), 16, "{v}");
        }
    });
    s.ok(
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 2}),
        &[],
    );
    s.stop();
}

#[test]
fn agent_sessions_stay_hot_then_go_to_their_file_and_come_back() {
    // 200 cells hold one agent's conversation but not two.
    let s = Server::start(&model(), &["--capacity", "200", "--max-tokens", "32"]);
    let path = "/v1/chat/completions";
    let as_agent = |name: &'static str| [("X-Session-Id", name)];
    let q1 = user("What is the capital of France?");
    let a1 = s.ok(path, &chat(&q1, 24), &as_agent("alice"));
    let p1 = a1["usage"]["prompt_tokens"].as_u64().unwrap();
    let mut q2 = q1.clone();
    q2.as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": content(&a1)}),
        json!({"role": "user", "content": "And of Italy?"}),
    ]);
    // Hot: the second turn reuses the first turn's prompt and answer from alice's sequence.
    let a2 = s.ok(path, &chat(&q2, 24), &as_agent("alice"));
    let cached = a2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached > p1,
        "turn 2 reused {cached} of alice's tokens, turn 1's prompt was {p1}"
    );
    let file = |name: &str| {
        session_files(s.sessions.path())
            .into_iter()
            .find(|f| f.starts_with(&format!("{name}.")))
    };
    assert_eq!(file("alice"), None, "alice is hot, not parked");

    // Bob's long request needs alice's cells: alice is parked to her session file.
    let story = user(&format!(
        "Summarize: {}",
        "The quick brown fox jumps. ".repeat(18)
    ));
    let b = s.ok(path, &chat(&story, 32), &as_agent("bob"));
    let parked =
        file("alice").unwrap_or_else(|| panic!("alice not parked: {} {}", b["usage"], s.engine()));
    assert!(parked.ends_with(".kvsession.safetensors"), "{parked}");

    // Alice's third turn comes back from the file (and what the index still has), and
    // answers as an anonymous request of the same conversation does.
    let mut q3 = q2.clone();
    q3.as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": content(&a2)}),
        json!({"role": "user", "content": "And of Spain?"}),
    ]);
    let a3 = s.ok(path, &chat(&q3, 24), &as_agent("alice"));
    let cached = a3["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let p2 = a2["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        cached > p2,
        "turn 3 restored {cached} tokens, turn 2's prompt was {p2}"
    );
    let anonymous = s.ok(path, &chat(&q3, 24), &[]);
    assert_eq!(content(&a3), content(&anonymous));
    // On SIGTERM every hot agent is parked: bob's file appears.
    let sessions = s.stop();
    let names = session_files(sessions.path());
    assert!(names.iter().any(|n| n.starts_with("bob.")), "{names:?}");
}

/// Parked agents' files (`NAME.<16 hex>.kvsession.safetensors`, any model) stay within
/// `--agent-disk` (least recently written removed first) and `--agent-ttl`, at start, after
/// each park and while idle; a named chat session is not an agent's and stays.
#[test]
fn parked_agents_stay_within_the_disk_budget_and_the_idle_limit() {
    let sessions = tempfile::tempdir().unwrap();
    let dir = sessions.path().to_path_buf();
    let put = |name: &str, bytes: usize, age: &str| {
        let p = dir.join(name);
        std::fs::write(&p, vec![0u8; bytes]).unwrap();
        let touched = Command::new("touch")
            .arg("-d")
            .arg(age)
            .arg(&p)
            .status()
            .unwrap();
        assert!(touched.success());
    };
    let agent = |name: &str| format!("{name}.0123456789abcdef.kvsession.safetensors");
    put(&agent("old"), 1000, "2 hours ago");
    put(&agent("a1"), 1000, "30 minutes ago");
    put(&agent("a2"), 1000, "20 minutes ago");
    put(&agent("a3"), 1000, "10 minutes ago");
    put("mine.kvsession.safetensors", 5000, "3 hours ago");
    let s = Server::start_in(
        &model(),
        &[
            "--capacity",
            "200",
            "--max-tokens",
            "32",
            "--agent-disk",
            "2500",
            "--agent-ttl",
            "1h",
        ],
        sessions,
    );
    // At start: "old" is idle past the hour; then a1, the oldest, until 2000 bytes fit.
    let parked = s.engine()["parked"].clone();
    assert_eq!(
        parked,
        json!({"files": 2, "bytes": 2000, "removed": 2, "limit_bytes": 2500, "limit_idle_s": 3600})
    );
    let mut names = session_files(&dir);
    names.sort();
    assert_eq!(
        names,
        [
            agent("a2"),
            agent("a3"),
            "mine.kvsession.safetensors".into()
        ]
    );

    // A real park: alice's file alone is over the budget, so every agent file goes, oldest
    // first, and her next turn is prefilled (and still answered).
    let path = "/v1/chat/completions";
    let q = user("What is the capital of France?");
    let a1 = s.ok(path, &chat(&q, 24), &[("X-Session-Id", "alice")]);
    let mut q2 = q.clone();
    q2.as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": content(&a1)}),
        json!({"role": "user", "content": "And of Italy?"}),
    ]);
    // Two turns: her cells are what bob's request (as in the test above) needs.
    s.ok(path, &chat(&q2, 24), &[("X-Session-Id", "alice")]);
    let story = user(&format!(
        "Summarize: {}",
        "The quick brown fox jumps. ".repeat(18)
    ));
    s.ok(path, &chat(&story, 32), &[("X-Session-Id", "bob")]);
    let parked = s.engine()["parked"].clone();
    assert_eq!(
        (parked["files"].as_u64(), parked["removed"].as_u64()),
        (Some(0), Some(5)),
        "{parked}"
    );
    let again = s.ok(path, &chat(&q2, 24), &[("X-Session-Id", "alice")]);
    assert_eq!(content(&again), content(&s.ok(path, &chat(&q2, 24), &[])));

    // While idle: a file past the idle limit goes within the engine's next wake (10 s).
    let removed = s.engine()["parked"]["removed"].as_u64().unwrap();
    put(&agent("late"), 10, "2 hours ago");
    engine_when(&s, "the idle file removed", |e| {
        e["parked"]["removed"] == removed + 1
    });
    assert!(!dir.join(agent("late")).exists());
    let metric = format!("kvplug_agents_parked_removed_total {}", removed + 1);
    assert!(s.text("/metrics").contains(&metric), "{metric}");
    assert!(dir.join("mine.kvsession.safetensors").exists());
}

/// At `--max-connections 2`, two idle connections take the whole allowance: a third
/// client's request is not answered while they stay open, and is as soon as one closes.
#[test]
fn clients_past_the_connection_limit_wait_for_one_to_close() {
    use std::io::{Read, Write};
    let s = Server::start(&model(), &["--max-connections", "2"]);
    let addr = s.url.trim_start_matches("http://").to_string();
    let mut idle: Vec<_> = (0..2)
        .map(|_| std::net::TcpStream::connect(&addr).unwrap())
        .collect();
    let mut third = std::net::TcpStream::connect(&addr).unwrap();
    third
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    // A wait that can only pass the test wrongly (an answer arriving later), never fail it.
    third
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let mut buf = [0u8; 64];
    match third.read(&mut buf) {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) => {}
        r => panic!(
            "a third connection was served past the limit: {:?}",
            r.map(|n| String::from_utf8_lossy(&buf[..n]).to_string())
        ),
    }
    drop(idle.pop());
    third
        .set_read_timeout(Some(Duration::from_secs(600)))
        .unwrap();
    let mut answer = String::new();
    third.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    drop(idle);
    assert_eq!(s.get("/health").0, 200);
}

/// A client that never finishes its headers is disconnected after `--header-timeout`, one
/// whose body stops arriving gets 408 after `--body-timeout`, and the server answers others
/// meanwhile; of simultaneous requests, exactly `parallel + max-queue` are taken and the
/// 429s say so.
#[test]
fn half_sent_requests_time_out_and_busy_answers_add_up() {
    use std::io::{Read, Write};
    let s = Server::start(
        &model(),
        &[
            "--header-timeout",
            "2s",
            "--body-timeout",
            "2s",
            "--parallel",
            "4",
            "--max-queue",
            "2",
        ],
    );
    let addr = s.url.trim_start_matches("http://").to_string();
    let mut slow = std::net::TcpStream::connect(&addr).unwrap();
    slow.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(600)))
        .unwrap();
    let started = Instant::now();
    let mut buf = [0u8; 512];
    // A read that times out is a connection never closed: it fails the test.
    let closed = |r: std::io::Result<usize>| match r {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            panic!("the half-sent request was never disconnected: {e}")
        }
        r => r.unwrap_or(0),
    };
    let n = closed(slow.read(&mut buf));
    let waited = started.elapsed();
    // Not before the timeout; how long after it depends on the machine.
    assert!(
        waited >= Duration::from_millis(1500),
        "closed after {waited:?}"
    );
    // hyper may answer 408 before closing; either way the connection ends.
    let head = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(n == 0 || head.starts_with("HTTP/1.1 408"), "{head}");
    assert_eq!(closed(slow.read(&mut buf)), 0, "still open");

    // Headers whole, the body's first byte of a thousand, then nothing: 408, then closed.
    let mut stalled = std::net::TcpStream::connect(&addr).unwrap();
    stalled
        .write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{",
        )
        .unwrap();
    stalled
        .set_read_timeout(Some(Duration::from_secs(600)))
        .unwrap();
    let started = Instant::now();
    let mut answer = Vec::new();
    loop {
        match closed(stalled.read(&mut buf)) {
            0 => break,
            n => answer.extend_from_slice(&buf[..n]),
        }
    }
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(1500),
        "answered after {waited:?}"
    );
    let answer = String::from_utf8_lossy(&answer).to_string();
    assert!(
        answer.starts_with("HTTP/1.1 408") && answer.contains("stopped arriving"),
        "{answer}"
    );
    // A body declared past --max-body (1 MiB) is refused before it is sent: 413 at once, not
    // `100 Continue` and then 408 for the body that never came.
    let mut declared = std::net::TcpStream::connect(&addr).unwrap();
    declared
        .write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: 50000000\r\nConnection: close\r\n\r\n",
        )
        .unwrap();
    declared
        .set_read_timeout(Some(Duration::from_secs(600)))
        .unwrap();
    let mut answer = Vec::new();
    loop {
        match closed(declared.read(&mut buf)) {
            0 => break,
            n => answer.extend_from_slice(&buf[..n]),
        }
    }
    let answer = String::from_utf8_lossy(&answer).to_string();
    assert!(
        answer.starts_with("HTTP/1.1 413") && answer.contains("50000000 bytes"),
        "{answer}"
    );
    s.ok(
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 1}),
        &[],
    );

    // Four answers held in flight (a thousand tokens each, far longer than the test needs),
    // then six simultaneous requests: two wait, four are turned away.
    let held = json!({"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": true,
                      "temperature": 0, "stream": true});
    let streams: Vec<_> = (0..4).map(|_| s.stream("/v1/completions", &held)).collect();
    engine_when(&s, "four in flight", |e| e["active"] == 4);
    let short = json!({"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0});
    let answers: Vec<(u16, Value)> = thread::scope(|scope| {
        let all: Vec<_> = (0..6)
            .map(|_| scope.spawn(|| s.post("/v1/completions", &short, &[])))
            .collect();
        engine_when(&s, "two waiting", |e| e["queued"] == 2);
        let started = Instant::now();
        while all.iter().filter(|t| t.is_finished()).count() < 4 {
            assert!(started.elapsed() < Duration::from_secs(600), "no 429s");
            thread::sleep(Duration::from_millis(20));
        }
        drop(streams);
        all.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let busy: Vec<&Value> = answers
        .iter()
        .filter(|a| a.0 == 429)
        .map(|a| &a.1)
        .collect();
    assert_eq!(
        answers.iter().filter(|a| a.0 == 200).count(),
        2,
        "{answers:?}"
    );
    assert_eq!(busy.len(), 4, "{answers:?}");
    for b in busy {
        let m = b["error"]["message"].as_str().unwrap();
        assert!(
            m.contains("holds 6 requests (at most 4 in flight and 2 waiting)"),
            "{m}"
        );
    }
}
