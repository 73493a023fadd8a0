//! Speculative decoding in the server, on a [`kvplug_server::Server`] in this process (port
//! 0, stopped by its `Stopper`) with SmolLM2-135M-Instruct imported to f16: a request that
//! speculates gets the answer plain decoding gives — whole or streamed, cut at a stop string,
//! with its log-probabilities, under a JSON schema — and its usage and `/metrics` count the
//! draft tokens.

use serde_json::{json, Value};

mod common;
use common::server::{config, smollm2_f16, Server};

/// A code-copying request (prompt lookup pays: the answer quotes the prompt), greedy, with
/// `extra` fields.
fn copy_code(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content":
            "Repeat this Python code exactly, then stop:\n\n```python\ndef total(xs):\n    s = 0\n    for x in xs:\n        s += x\n    return s\n```"}],
        "temperature": 0,
        "max_tokens": 64,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn content(v: &Value) -> &str {
    v["choices"][0]["message"]["content"].as_str().unwrap()
}

fn counter(metrics: &str, name: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("{name} missing"))
        .parse()
        .unwrap()
}

#[test]
fn speculating_requests_get_plain_decodings_answer_and_count_their_drafts() {
    // `kvplug serve`'s defaults: greedy requests draft by prompt lookup.
    let s = Server::in_process(config(&smollm2_f16()));
    let path = "/v1/chat/completions";
    let plain = s.ok(path, &copy_code(json!({"speculative": false})), &[]);
    assert!(
        plain["usage"].get("completion_tokens_details").is_none(),
        "{plain}"
    );
    let drafted = s.ok(path, &copy_code(json!({})), &[]);
    assert_eq!(content(&drafted), content(&plain));
    assert_eq!(
        drafted["usage"]["completion_tokens"],
        plain["usage"]["completion_tokens"]
    );
    let details = &drafted["usage"]["completion_tokens_details"];
    let accepted = details["accepted_prediction_tokens"].as_u64().unwrap();
    assert!(accepted > 0, "the copied code was drafted: {details}");
    let metrics = s.text("/metrics");
    let drafts = counter(&metrics, "kvplug_draft_tokens_total");
    let rejected = details["rejected_prediction_tokens"].as_u64().unwrap();
    assert_eq!(drafts, accepted + rejected, "{metrics}");
    assert_eq!(
        counter(&metrics, "kvplug_draft_accepted_tokens_total"),
        accepted
    );

    // Streamed: the deltas assemble into the same answer.
    let chunks = s.chunks(path, &copy_code(json!({"stream": true})));
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, content(&plain));

    // A stop string inside the answer ends both at the same place.
    let text = content(&plain);
    let stop = "return";
    assert!(text.contains(stop), "{text:?}");
    let cut = |speculative: bool| {
        let body = copy_code(json!({"stop": [stop], "speculative": speculative}));
        s.ok(path, &body, &[])
    };
    let (a, b) = (cut(false), cut(true));
    assert_eq!(content(&a), &text[..text.find(stop).unwrap()]);
    assert_eq!(content(&b), content(&a));
    assert_eq!(b["choices"][0]["finish_reason"], "stop");

    // Log-probabilities: the same tokens, each with its alternatives.
    let lp = |speculative: bool| {
        let body =
            copy_code(json!({"logprobs": true, "top_logprobs": 2, "speculative": speculative}));
        let v = s.ok(path, &body, &[]);
        v["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    t["token"].clone(),
                    t["top_logprobs"].as_array().unwrap().len(),
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(lp(true), lp(false));

    // Under a JSON schema (the grammar masks every verified row): the same object.
    let schema = json!({"type": "json_schema", "json_schema": {"name": "code", "strict": true,
        "schema": {"type": "object", "properties": {"function": {"type": "string"},
        "lines": {"type": "integer"}}, "required": ["function", "lines"],
        "additionalProperties": false}}});
    let structured = |speculative: bool| {
        let body = copy_code(json!({"response_format": schema, "speculative": speculative}));
        s.ok(path, &body, &[])
    };
    let (a, b) = (structured(false), structured(true));
    assert_eq!(content(&b), content(&a));
    let object: Value = serde_json::from_str(content(&b)).unwrap();
    assert!(
        object["function"].is_string() && object["lines"].is_i64(),
        "{object}"
    );

    // A bad value is refused by name, and the server goes on.
    let (status, e) = s.post(path, &copy_code(json!({"speculative": "yes"})), &[]);
    assert_eq!(status, 400, "{e}");
    assert_eq!(e["error"]["param"], "speculative", "{e}");
    assert_eq!(
        content(&s.ok(path, &copy_code(json!({})), &[])),
        content(&plain)
    );
    s.stop();
}
