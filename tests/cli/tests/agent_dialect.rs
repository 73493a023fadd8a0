//! What agent clients send, on the real model whose template supports tools
//! (Qwen2.5-Coder-0.5B-Instruct Q4_K_M, in place): tool calls streamed and not, the
//! tool-choice modes, tool messages, structured output, grammars, log-probabilities, `n`,
//! sampling fields, refusals, the model routes, `/metrics`, and a ten-turn tool loop that
//! reuses its history. Then the OpenAI Agents SDK and the `openai` client's stream assembly
//! (tests/cli/tests/agents_sdk.py), the Responses API through the `openai` client and the
//! Agents SDK's default model (tests/cli/tests/responses_client.py), and the `anthropic`
//! client on the Messages API (tests/cli/tests/anthropic_client.py), all through
//! scripts/openai-client.sh.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

mod common;
use common::server::Server;

fn qwen() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    assert!(p.exists(), "run scripts/fetch-models.sh (make test does)");
    p
}

/// The id of the one token whose text is `piece`, by the model's own tokenizer.
fn token_id(piece: &str) -> i32 {
    let dir = kvplug::formats::gguf::resolve_model(&qwen()).unwrap();
    let ids = kvplug::Text::load(&dir).unwrap().encode_raw(piece).unwrap();
    assert_eq!(ids.len(), 1, "{piece:?} is one token");
    ids[0]
}

const PATH: &str = "/v1/chat/completions";

/// The `logprobs.content` entries of streamed chat chunks, in order.
fn chat_logprobs(chunks: &[Value]) -> Vec<Value> {
    chunks
        .iter()
        .flat_map(|c| {
            c["choices"][0]["logprobs"]["content"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect()
}

fn weather_tools() -> Value {
    json!([{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": false}}}])
}

fn ask_weather() -> Value {
    json!([{"role": "user", "content": "What is the weather in Paris? Use the tool."}])
}

/// The calls of a non-streamed answer: (name, arguments as JSON).
fn calls_of(v: &Value) -> Vec<(String, Value)> {
    v["choices"][0]["message"]["tool_calls"]
        .as_array()
        .map(|c| {
            c.iter()
                .map(|c| {
                    let args = c["function"]["arguments"].as_str().unwrap();
                    (
                        c["function"]["name"].as_str().unwrap().to_string(),
                        serde_json::from_str(args).unwrap(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The calls of a streamed answer, assembled as the `openai` client does: per index, the
/// first delta's id and name, then the argument fragments concatenated; and its finish.
fn assembled(chunks: &[Value]) -> (Vec<(String, Value)>, String) {
    let mut calls: Vec<(String, String)> = Vec::new();
    let mut finish = String::new();
    for c in chunks {
        let choice = &c["choices"][0];
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = f.to_string();
        }
        for d in choice["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let i = d["index"].as_u64().unwrap() as usize;
            if i == calls.len() {
                assert!(d["id"].is_string(), "a call opens with its id: {d}");
                calls.push((String::new(), String::new()));
            }
            if let Some(n) = d["function"]["name"].as_str() {
                calls[i].0 += n;
            }
            if let Some(a) = d["function"]["arguments"].as_str() {
                calls[i].1 += a;
            }
        }
    }
    let calls = calls
        .into_iter()
        .map(|(n, a)| (n, serde_json::from_str(&a).unwrap()))
        .collect();
    (calls, finish)
}

#[test]
fn tool_calls_streamed_or_not_in_every_choice_mode() {
    let s = Server::start(&qwen(), &["--capacity", "2048"]);
    let body = json!({"messages": ask_weather(), "tools": weather_tools(), "temperature": 0, "max_tokens": 64});
    let v = s.ok(PATH, &body, &[]);
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    assert!(v["choices"][0]["message"]["content"].is_null(), "{v}");
    let calls = calls_of(&v);
    assert_eq!(
        calls,
        [("get_weather".to_string(), json!({"city": "Paris"}))],
        "{v}"
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (got, finish) = assembled(&s.chunks(PATH, &streamed));
    assert_eq!((got, finish.as_str()), (calls, "tool_calls"));

    // none: the same prompt (the tools shown, the cached prefix kept) and a text answer,
    // even to a question the model answers with a call.
    let mut none = body.clone();
    none["tool_choice"] = json!("none");
    let t = s.ok(PATH, &none, &[]);
    assert_eq!(
        t["usage"]["prompt_tokens"], v["usage"]["prompt_tokens"],
        "{t}"
    );
    assert_eq!(
        t["usage"]["prompt_tokens_details"]["cached_tokens"],
        json!(v["usage"]["prompt_tokens"].as_u64().unwrap() - 1),
        "{t}"
    );
    let content = t["choices"][0]["message"]["content"].as_str();
    assert!(
        calls_of(&t).is_empty() && content.is_some_and(|c| !c.is_empty()),
        "{t}"
    );

    // required: a call even where the question needs none; named: that tool; none: text.
    let hello = json!([{"role": "user", "content": "Say hello."}]);
    let mut b = json!({"messages": hello, "tools": weather_tools(), "tool_choice": "required",
                       "temperature": 0.9, "seed": 5, "max_tokens": 64});
    let v = s.ok(PATH, &b, &[]);
    let calls = calls_of(&v);
    assert!(!calls.is_empty(), "{v}");
    for (name, args) in &calls {
        match name.as_str() {
            "get_weather" => assert!(
                args["city"].is_string() && args.as_object().unwrap().len() == 1,
                "{args}"
            ),
            "add" => assert!(args["a"].is_i64() && args["b"].is_i64(), "{args}"),
            other => panic!("{other}"),
        }
    }
    b["tool_choice"] = json!({"type": "function", "function": {"name": "add"}});
    let v = s.ok(PATH, &b, &[]);
    let calls = calls_of(&v);
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0].0, "add");
    b["tool_choice"] = json!("none");
    let v = s.ok(PATH, &b, &[]);
    assert!(
        calls_of(&v).is_empty() && v["choices"][0]["message"]["content"].is_string(),
        "{v}"
    );

    // A tool result goes back through the template.
    let history = json!([
        {"role": "user", "content": "What is the weather in Paris? Use the tool."},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"}]);
    s.ok(
        PATH,
        &json!({"messages": history, "tools": weather_tools(), "max_tokens": 16}),
        &[],
    );

    // A schema llguidance cannot compile is a 400 naming the tools; the server goes on.
    let hostile = json!([{"type": "function", "function": {"name": "f",
        "parameters": {"type": "object", "properties": {"x": {"$ref": "#/definitions/nowhere"}}}}}]);
    let (status, v) = s.post(
        PATH,
        &json!({"messages": hello, "tools": hostile, "tool_choice": "required"}),
        &[],
    );
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("tools")),
        "{v}"
    );
    s.ok(PATH, &json!({"messages": hello, "max_tokens": 4}), &[]);
}

#[test]
fn structured_output_grammars_logprobs_n_and_sampling_fields() {
    let s = Server::start(&qwen(), &["--capacity", "2048"]);
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": false});
    let person = json!([{"role": "user", "content": "Invent a person, as JSON."}]);
    let body = json!({"messages": person, "temperature": 0.8, "n": 4, "max_tokens": 80,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": true}}});
    let v = s.ok(PATH, &body, &[]);
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    let mut completion = 0;
    for c in choices {
        let p: Value = serde_json::from_str(c["message"]["content"].as_str().unwrap()).unwrap();
        assert!(
            p["name"].as_str().is_some_and(|n| n.chars().count() <= 24),
            "{p}"
        );
        assert!(p["age"].as_u64().is_some_and(|a| a <= 120), "{p}");
        assert_eq!(p.as_object().unwrap().len(), 2, "{p}");
        assert_eq!(c["finish_reason"], "stop");
    }
    let one = s.ok(PATH, &json!({"messages": person, "max_tokens": 1}), &[]);
    assert_eq!(
        v["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"],
        "the prompt counts once"
    );
    for c in choices {
        completion += c["message"]["content"].as_str().map_or(0, |_| 1);
    }
    assert_eq!(completion, 4);
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() >= 4 * 5);

    // Log-probabilities: the chosen token and its best alternatives, best first.
    let v = s.ok(
        PATH,
        &json!({"messages": person, "temperature": 0, "max_tokens": 6,
        "logprobs": true, "top_logprobs": 3}),
        &[],
    );
    let lps = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        lps.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    for t in lps {
        let top: Vec<f64> = t["top_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["logprob"].as_f64().unwrap())
            .collect();
        assert_eq!(top.len(), 3);
        assert!(top.windows(2).all(|w| w[0] >= w[1]) && top[0] <= 0.0, "{t}");
        // Greedy: the chosen token is the most likely one.
        assert_eq!(t["logprob"], t["top_logprobs"][0]["logprob"], "{t}");
        let bytes: Vec<u8> = t["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            t["token"].as_str().unwrap(),
            "{t}"
        );
    }
    // An answer its end-of-turn token ended: the tokens spell the content, streamed or not
    // (the end-of-turn token is not in it).
    let ok = json!({"messages": [{"role": "user", "content": "Say just OK."}],
        "temperature": 0, "max_tokens": 16, "logprobs": true});
    let v = s.ok(PATH, &ok, &[]);
    let spelled_chat =
        |lps: &[Value]| -> String { lps.iter().map(|t| t["token"].as_str().unwrap()).collect() };
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let whole = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(spelled_chat(whole), content, "{v}");
    let mut streamed = ok.clone();
    streamed["stream"] = json!(true);
    let parts = chat_logprobs(&s.chunks(PATH, &streamed));
    assert_eq!(spelled_chat(&parts), content);
    let v = s.ok(
        "/v1/completions",
        &json!({"prompt": "def add(a, b):", "temperature": 0, "max_tokens": 5, "logprobs": 2}),
        &[],
    );
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 5, "{v}");
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2, "{v}");
    // The tokens spell the text; each offset counts the characters before it, streamed
    // or not.
    let spelled = |lp: &Value| -> (String, Vec<u64>) {
        let tokens = lp["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap());
        let mut at = 0;
        let offsets = tokens
            .clone()
            .map(|t| {
                let o = at;
                at += t.chars().count() as u64;
                o
            })
            .collect();
        (tokens.collect(), offsets)
    };
    let (text, offsets) = spelled(lp);
    assert_eq!(text, v["choices"][0]["text"].as_str().unwrap(), "{v}");
    assert_eq!(json!(offsets), lp["text_offset"], "{v}");
    // Streamed, the chunks' logprobs put together obey the same rule. (Not compared with the
    // answer above token for token: this request may reuse that one's cached prompt, whose
    // last token then goes through attention as a decode step rather than inside a prefill,
    // summing in another order, and at a near-tie greedy decoding may then pick another
    // token.)
    let streamed = json!({"prompt": "def add(a, b):", "temperature": 0, "max_tokens": 5, "logprobs": 2, "stream": true});
    let chunks = s.chunks("/v1/completions", &streamed);
    let field = |name: &str| -> Vec<Value> {
        chunks
            .iter()
            .flat_map(|c| {
                c["choices"][0]["logprobs"][name]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .collect()
    };
    let joined = json!({"tokens": field("tokens"), "text_offset": field("text_offset")});
    let (text, offsets) = spelled(&joined);
    assert_eq!(joined["tokens"].as_array().unwrap().len(), 5, "{joined}");
    assert_eq!(json!(offsets), joined["text_offset"], "streamed offsets");
    let streamed_text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(
        text, streamed_text,
        "streamed tokens spell the streamed text"
    );
    // Cut by a stop string (three tokens of the answer, so held across tokens): the tokens
    // in it are not in the answer's logprobs either, streamed or not.
    let count = json!({"messages": [{"role": "user", "content": "Count from 1 to 20, separated by commas."}],
        "temperature": 0, "max_tokens": 24, "logprobs": true});
    let v = s.ok(PATH, &count, &[]);
    let whole = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    let tokens: Vec<&str> = whole.iter().map(|t| t["token"].as_str().unwrap()).collect();
    let mut stopped = count.clone();
    stopped["stop"] = json!(tokens[6..9].concat());
    let v = s.ok(PATH, &stopped, &[]);
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert!(content.len() < tokens.concat().len(), "{v}");
    let lps = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(spelled_chat(lps), content, "{v}");
    stopped["stream"] = json!(true);
    let chunks = s.chunks(PATH, &stopped);
    let streamed = chat_logprobs(&chunks);
    let streamed_text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(spelled_chat(&streamed), streamed_text);
    // (Not compared with the answer above token for token: it reuses that one's cached
    // prompt, as the completions case above says.) Cut before the stop string.
    let finish = chunks
        .iter()
        .rev()
        .find_map(|c| c["choices"][0]["finish_reason"].as_str());
    assert_eq!(finish, Some("stop"));
    let stop = stopped["stop"].as_str().unwrap();
    assert!(
        !streamed_text.is_empty() && !streamed_text.contains(stop),
        "{streamed_text:?}"
    );

    // A GBNF grammar; a banned token never appears; ignore_eos runs to max_tokens.
    let yes_no = json!({"messages": [{"role": "user", "content": "Is Rust a language?"}],
        "grammar": "root ::= (\"yes\" | \"no\")", "temperature": 1.0, "max_tokens": 8});
    let a = s.ok(PATH, &yes_no, &[])["choices"][0]["message"]["content"].clone();
    assert!(a == "yes" || a == "no", "{a}");
    // A chain of rules deeper than a 2 MiB thread compiles (it aborted the server once);
    // a schema that allows no answer is a 400 before a stream starts.
    let chain: String = (0..1000)
        .map(|i| format!("a{i}: a{} | \"x\"\n", i + 1))
        .collect();
    let mut deep = yes_no.clone();
    deep["grammar"] = json!(format!("start: a0\n{chain}a1000: \"y\"\n"));
    let a = s.ok(PATH, &deep, &[])["choices"][0]["message"]["content"].clone();
    assert!(a == "x" || a == "y", "{a}");
    let nothing = json!({"messages": person, "stream": true,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"$ref": "#"}}}});
    let (status, v) = s.post(PATH, &nothing, &[]);
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("response_format")),
        "{v}"
    );
    // The Responses API names its own field.
    let nothing = json!({"input": "Hi", "stream": true,
        "text": {"format": {"type": "json_schema", "name": "n", "schema": {"$ref": "#"}}}});
    let (status, v) = s.post("/v1/responses", &nothing, &[]);
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("text")),
        "{v}"
    );
    let greedy = json!({"messages": person, "temperature": 0, "max_tokens": 1, "logprobs": true});
    let first = s.ok(PATH, &greedy, &[])["choices"][0]["logprobs"]["content"][0].clone();
    let id = token_id(first["token"].as_str().unwrap());
    let mut banned = greedy.clone();
    banned["logit_bias"] = json!({id.to_string(): -100});
    let other = s.ok(PATH, &banned, &[])["choices"][0]["logprobs"]["content"][0]["token"].clone();
    assert_ne!(
        other, first["token"],
        "logit_bias -100 bans the greedy token"
    );
    // A byte token forced again and again never completes a character: the text still has
    // it, as U+FFFD (as the whole answer decodes), each at its own offset, and the token is
    // named by its byte (OpenAI's `bytes:\xNN`, so no two such alternatives share a name),
    // streamed or not.
    let text = kvplug::Text::load(&kvplug::formats::gguf::resolve_model(&qwen()).unwrap()).unwrap();
    let byte = (0..1000)
        .find(|&id| text.detokenize(&[id]).unwrap() == "\u{FFFD}")
        .expect("a byte token");
    let expected = text.detokenize(&[byte; 3]).unwrap();
    let forced = json!({"prompt": "Hi", "temperature": 0, "max_tokens": 3, "logprobs": 1,
        "logit_bias": {byte.to_string(): 100}});
    let v = s.ok("/v1/completions", &forced, &[]);
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(v["choices"][0]["text"], json!(expected), "{v}");
    let name = lp["tokens"][0].as_str().unwrap().to_string();
    let hex = name.strip_prefix("bytes:\\x").unwrap_or_default();
    assert!(hex.len() == 2 && u8::from_str_radix(hex, 16).is_ok(), "{v}");
    assert_eq!(lp["tokens"], json!([name, name, name]), "{v}");
    assert_eq!(lp["text_offset"], json!([0, 1, 2]), "{v}");
    let mut streamed = forced.clone();
    streamed["stream"] = json!(true);
    let chunks = s.chunks("/v1/completions", &streamed);
    let streamed_text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    let streamed_tokens: String = chunks
        .iter()
        .flat_map(|c| {
            c["choices"][0]["logprobs"]["tokens"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        (streamed_text, streamed_tokens),
        (expected.clone(), name.repeat(3))
    );
    let long = s.ok(
        PATH,
        &json!({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 12,
        "ignore_eos": true, "temperature": 0}),
        &[],
    );
    assert_eq!(
        (
            long["usage"]["completion_tokens"].as_u64(),
            long["choices"][0]["finish_reason"].as_str()
        ),
        (Some(12), Some("length"))
    );
    let v = s.ok(
        PATH,
        &json!({"messages": person, "max_tokens": 8, "top_k": 5, "min_p": 0.1,
        "frequency_penalty": 1.0, "presence_penalty": 0.5, "repetition_penalty": 1.2}),
        &[],
    );
    assert!(v["choices"][0]["message"]["content"].is_string());

    // Refusals name their field; the model routes; /metrics.
    for (extra, param) in [
        (json!({"echo": true}), "echo"),
        (json!({"frobnicate": 1}), "frobnicate"),
        (json!({"n": 17}), "n"),
        (json!({"top_logprobs": 2}), "top_logprobs"),
    ] {
        let mut b = json!({"messages": person});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, v) = s.post(PATH, &b, &[]);
        assert_eq!(
            (status, v["error"]["param"].as_str()),
            (400, Some(param)),
            "{v}"
        );
    }
    let (status, id) = s.get("/v1/models");
    assert_eq!(status, 200);
    let id = id["data"][0]["id"].as_str().unwrap().to_string();
    assert_eq!(s.get(&format!("/v1/models/{id}")).1["id"], id.as_str());
    assert_eq!(s.get("/v1/models/nope").0, 404);
    let metrics = s.text("/metrics");
    for line in [
        "kvplug_requests_total{status=\"200\"}",
        "kvplug_requests_total{status=\"400\"}",
        "kvplug_time_to_first_token_seconds_bucket",
        "kvplug_cached_tokens_total",
    ] {
        assert!(metrics.contains(line), "{line} missing: {metrics}");
    }
    let masks: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("kvplug_constraint_masks_total "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(masks > 0.0, "{metrics}");
}

/// Sixty lines of facts: a long system message both ten-turn tests re-send every turn.
fn city_notes() -> String {
    (0..60)
        .map(|i| {
            format!(
                "Note {i}: city {i} has code C{i:03} and opens at {} o'clock.\n",
                6 + i % 5
            )
        })
        .collect()
}

#[test]
fn a_ten_turn_tool_loop_reuses_its_history() {
    let s = Server::start(&qwen(), &["--capacity", "8192"]);
    // An agent's long instructions and a conversation re-sent every turn.
    let notes = city_notes();
    let mut messages = vec![
        json!({"role": "system", "content": format!("You look up weather with tools.\n{notes}")}),
        json!({"role": "user", "content": "What is the weather in Paris? Use the tool."}),
    ];
    for turn in 1..=10 {
        let body = json!({"messages": messages, "tools": weather_tools(), "tool_choice": "required",
            "parallel_tool_calls": false, "temperature": 0, "max_tokens": 48});
        let (status, headers, v) = s.post_with_headers(PATH, &body);
        assert_eq!(status, 200, "{v}");
        let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        if turn > 1 {
            assert!(
                cached * 10 >= prompt * 9,
                "turn {turn}: {cached} of {prompt} cached"
            );
            let why: Value = serde_json::from_str(&headers["x-kvplug-prefix"]).unwrap();
            assert_eq!(why["cached_tokens"].as_u64(), Some(cached), "{why}");
        }
        let call = &v["choices"][0]["message"]["tool_calls"][0];
        assert!(call.is_object(), "turn {turn}: {v}");
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]}));
        messages.push(json!({"role": "tool", "tool_call_id": call["id"], "content": format!("sunny, {} C", 15 + turn)}));
    }
}

/// Gemma 3 (hybrid: sliding-window and global layers; its template has no tools): a
/// ten-turn conversation re-sent each turn reuses ≥ 90% of each prompt from turn 2 on; a
/// client that rewrites the last answer still reuses up to it; one that rewrites the first
/// is told where and why reuse stopped.
#[test]
fn a_ten_turn_conversation_reuses_its_history_on_a_hybrid_model() {
    let gemma = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/gemma-3-270m-q4_k_m.gguf");
    let s = Server::start(&gemma, &["--capacity", "8192"]);
    let notes = city_notes();
    let mut messages = vec![
        json!({"role": "system", "content": format!("You answer briefly.\n{notes}")}),
        json!({"role": "user", "content": "What is the code of city 3?"}),
    ];
    let mut cached_by_turn = Vec::new();
    for turn in 1..=10 {
        let body = json!({"messages": messages, "temperature": 0, "max_tokens": 24});
        let (status, headers, v) = s.post_with_headers(PATH, &body);
        assert_eq!(status, 200, "{v}");
        let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        if turn > 1 {
            assert!(
                cached * 10 >= prompt * 9,
                "turn {turn}: {cached} of {prompt} cached: {headers:?}"
            );
        }
        cached_by_turn.push(cached);
        messages
            .push(json!({"role": "assistant", "content": v["choices"][0]["message"]["content"]}));
        messages.push(json!({"role": "user", "content": format!("And city {}?", turn + 3)}));
    }
    // The client rewrites the last answer: the prompt departs inside it, and the newest
    // ends' kept windows still let it resume there.
    let last = messages.len() - 2;
    let mut rewritten = messages.clone();
    rewritten[last]["content"] = json!("I do not know.");
    let v = s.ok(PATH, &json!({"messages": rewritten, "max_tokens": 4}), &[]);
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= cached_by_turn[9],
        "{cached} < {}",
        cached_by_turn[9]
    );
    // It rewrites the first answer: far behind every kept window, so the prompt is prefilled
    // from there, and the header says where and why.
    messages[2]["content"] = json!("I do not know.");
    let (status, headers, v) =
        s.post_with_headers(PATH, &json!({"messages": messages, "max_tokens": 4}));
    assert_eq!(status, 200, "{v}");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let why: Value = serde_json::from_str(&headers["x-kvplug-prefix"]).unwrap();
    assert_eq!(why["cached_tokens"].as_u64(), Some(cached), "{why}");
    assert!(why["shared_tokens"].as_u64().unwrap() > cached, "{why}");
    assert!(
        why["why"].as_str().unwrap().contains("sliding-window"),
        "{why}"
    );
    assert_eq!(why["prompt_next_text"], "I", "{why}");

    // A client that goes away mid-answer on a fresh prompt longer than the window, past
    // where the sliding layers could cut back to it: the server keeps what was written and
    // serves on.
    let fresh: String = (0..120)
        .map(|i| format!("Item {i} weighs {} grams. ", 3 * i + 1))
        .collect();
    let mut streamed = json!({"prompt": fresh, "max_tokens": 200, "temperature": 0,
                              "ignore_eos": true, "stream": true});
    // Twelve chunks read, then the connection is dropped with the iterator.
    let read = s.stream("/v1/completions", &streamed).take(12).count();
    assert_eq!(read, 12);
    streamed["stream"] = json!(false);
    streamed["max_tokens"] = json!(4);
    s.ok("/v1/completions", &streamed, &[]);

    // Gemma's tokenizer asks for BOS: a raw prompt gets it, as one that writes it out does.
    let raw = |prompt: &str| {
        let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0});
        let v = s.ok("/v1/completions", &body, &[]);
        (
            v["usage"]["prompt_tokens"].clone(),
            v["choices"][0]["text"].clone(),
        )
    };
    let question = "The capital of France is";
    assert_eq!(raw(question), raw(&format!("<bos>{question}")));
    s.stop();
}

/// Runs the Python client `script` (tests/cli/tests/, in the venv scripts/openai-client.sh
/// makes) with `args`; fails with its output unless it succeeds.
fn python_client(script: &str, args: &[&str]) {
    let runner = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/openai-client.sh");
    let out = Command::new(runner)
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{script}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{}", String::from_utf8_lossy(&out.stdout));
}

#[test]
fn the_agents_sdk_and_the_openai_stream_assembly() {
    let s = Server::start(&qwen(), &["--capacity", "4096"]);
    python_client("agents_sdk.py", &[&s.url]);
}

/// Anthropic's Messages API through the official `anthropic` client (x-api-key): messages
/// whole and streamed, stop sequences and `max_tokens`, a forced tool call whole and
/// streamed, its result rendered back as the template renders a tool message (counted
/// against the OpenAI route), refusals in Anthropic's shape (tests/cli/tests/anthropic_client.py).
#[test]
fn the_anthropic_client_speaks_the_messages_api() {
    let s = Server::start(
        &qwen(),
        &[
            "--capacity",
            "4096",
            "--api-key",
            "secret",
            "--prefix-header",
        ],
    );
    python_client("anthropic_client.py", &[&s.url, "secret"]);
    // A keyed server says where a prompt's reuse ended only when told to (serve.rs checks
    // that it does not by default): a prompt sent again is reused up to its last token.
    let again = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1});
    s.ok(PATH, &again, &[]);
    let (status, headers, _) = s.post_with_headers(PATH, &again);
    assert_eq!(
        (status, headers.contains_key("x-kvplug-prefix")),
        (200, true)
    );
    s.stop();
}

/// OpenAI's Responses API through the official `openai` client and the Agents SDK's default
/// (Responses) model: responses whole and streamed, `previous_response_id` continuing from
/// the cache, `store: false`, retrieval and deletion by id, a forced function call whole and streamed, its output rendered
/// back as the template renders a tool message (counted against the chat route),
/// `text.format`'s schema, a refusal (tests/cli/tests/responses_client.py).
#[test]
fn the_responses_api_speaks_to_the_openai_client_and_the_agents_sdk() {
    let s = Server::start(&qwen(), &["--capacity", "4096"]);
    python_client("responses_client.py", &[&s.url]);
    s.stop();
}
