//! OpenAI's Responses API (`POST /v1/responses`), as the OpenAI Agents SDK's default model
//! and Codex-style agents speak it, mapped onto the same checks, engine and answers as the
//! chat route: `instructions` and input items (messages, `function_call`,
//! `function_call_output`) become chat messages rendered by the model's template; the answer
//! becomes a `response` of `message` and `function_call` output items, or its stream of
//! typed events. A response is stored (unless `store` is false) so that a later request's
//! `previous_response_id` continues its conversation: the stored turns are rendered again,
//! and their K/V comes back from the prefix cache instead of being prefilled.
//! `GET /v1/responses/{id}` returns a stored response and `DELETE` forgets it; the store
//! keeps the newest [`MAX_STORED`] responses within [`MAX_STORED_BYTES`].
//!
//! `include: ["message.output_text.logprobs"]` or `top_logprobs` give the output text its
//! tokens' log-probabilities. Fields that cannot change the answer (`metadata`, `user`,
//! `include`'s other values, `reasoning`, `truncation`, cache keys, …) are accepted; fields that would change it in ways not
//! implemented (`background`, `conversation`, `prompt`, …) and unknown ones are refused with
//! a 400 naming them.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use kvplug::tools::Tool;
use kvplug::{Adjustments, Message};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::answer::{chunks, Answer, Choice, Chunk};
use crate::api::{
    checked_choice, declare_tool, object, refuse_others, tools_with, top_logprobs, unanswered_call,
    Fields, Format, Params, Prompt, ToolChoice,
};
use crate::engine::Event;
use crate::error::ApiError;

/// A response id no other client can guess (`previous_response_id` continues a stored
/// conversation by id alone): `resp_` and 128 bits of SipHash under per-process random keys.
pub fn unguessable_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let word = |salt: u64| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(n);
        h.write_u64(salt);
        h.finish()
    };
    format!("resp_{:016x}{:016x}", word(1), word(2))
}

/// Responses kept for `previous_response_id` (the oldest go first).
pub const MAX_STORED: usize = 1024;
/// The most bytes of conversations and responses the store keeps (the oldest go first): a
/// client chaining long conversations cannot fill the server's memory.
pub const MAX_STORED_BYTES: usize = 256 << 20;

/// Fields that cannot change the answer.
const IGNORED: [&str; 11] = [
    "model",
    "metadata",
    "user",
    "reasoning",
    "truncation",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
    "stream_options",
    "max_tool_calls",
];

/// Fields this server reads.
const IMPLEMENTED: [&str; 14] = [
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "store",
    "previous_response_id",
    "include",
    "top_logprobs",
];

/// The `include` value that asks for the output text's log-probabilities.
const INCLUDE_LOGPROBS: &str = "message.output_text.logprobs";

/// A stored response's conversation (instructions aside).
type Turns = Arc<Vec<Message>>;

/// A stored response.
struct Stored {
    /// What `previous_response_id` continues.
    turns: Turns,
    /// The `response` object, as answered.
    response: Arc<Value>,
    /// What it holds, in bytes of JSON.
    bytes: usize,
}

/// Stored responses, by id, and the ids oldest first.
#[derive(Default)]
struct Kept {
    by_id: HashMap<String, Stored>,
    order: VecDeque<String>,
    bytes: usize,
}

/// Stored responses: what `previous_response_id` continues and `GET /v1/responses/{id}`
/// returns.
pub struct Store {
    inner: Mutex<Kept>,
    /// The most bytes of JSON kept.
    max_bytes: usize,
}

impl Default for Store {
    fn default() -> Self {
        Store::within(MAX_STORED_BYTES)
    }
}

impl Store {
    /// A store that keeps at most `max_bytes` of JSON.
    fn within(max_bytes: usize) -> Self {
        Store {
            inner: Mutex::default(),
            max_bytes,
        }
    }

    fn kept(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.inner.lock().expect("store lock")
    }

    fn turns(&self, id: &str) -> Option<Turns> {
        self.kept().by_id.get(id).map(|s| s.turns.clone())
    }

    /// The stored response `id`.
    pub fn response(&self, id: &str) -> Option<Arc<Value>> {
        self.kept().by_id.get(id).map(|s| s.response.clone())
    }

    /// The input items of stored response `id` (the conversation before its answer, as
    /// items), oldest first.
    pub fn input_items(&self, id: &str) -> Option<Vec<Value>> {
        let turns = self.turns(id)?;
        let before = &turns[..turns.len().saturating_sub(1)];
        Some(items_of(id.trim_start_matches("resp_"), before))
    }

    /// Forgets response `id`; false when none was stored.
    pub fn remove(&self, id: &str) -> bool {
        let mut k = self.kept();
        let Some(gone) = k.by_id.remove(id) else {
            return false;
        };
        k.bytes -= gone.bytes;
        k.order.retain(|o| o != id);
        true
    }

    /// Stores `response` and its conversation under `id`; false when they are too large to
    /// store (they would push out every other response and then themselves).
    fn put(&self, id: String, turns: Vec<Message>, response: Value) -> bool {
        let bytes = json_len(&turns) + json_len(&response);
        if bytes > self.max_bytes {
            tracing::warn!(id = %id, bytes, "a response too large to store");
            return false;
        }
        let mut k = self.kept();
        let stored = Stored {
            turns: Arc::new(turns),
            response: Arc::new(response),
            bytes,
        };
        match k.by_id.insert(id.clone(), stored) {
            Some(old) => k.bytes -= old.bytes,
            None => k.order.push_back(id),
        }
        k.bytes += bytes;
        while k.order.len() > MAX_STORED || k.bytes > self.max_bytes {
            let Some(old) = k.order.pop_front() else {
                break;
            };
            if let Some(gone) = k.by_id.remove(&old) {
                k.bytes -= gone.bytes;
            }
        }
        true
    }
}

/// The length of `v` written as JSON.
fn json_len(v: &impl serde::Serialize) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len();
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Messages and JSON values always serialize; a failure would only undercount.
    let _ = serde_json::to_writer(&mut count, v);
    count.0
}

/// A checked request: its parameters, and what storing its response needs.
pub struct Request {
    /// What the engine runs.
    pub params: Params,
    /// The conversation before the answer (the previous response's, then the input).
    turns: Vec<Message>,
    /// Whether the response is stored.
    store: bool,
    /// Echoed in the response.
    echo: Value,
}

/// Parses and checks a Responses body, continuing `previous_response_id` from `store`.
pub fn parse(body: &[u8], store: &Store) -> Result<Request, ApiError> {
    let map = object(body)?;
    let f = Fields(&map);
    refuse_others(&f, &IGNORED, &IMPLEMENTED)?;
    f.string("model")?;
    let previous = f.string("previous_response_id")?;
    let mut turns = match previous {
        Some(id) => store
            .turns(id)
            .ok_or_else(|| {
                ApiError::invalid(
                    Some("previous_response_id"),
                    format!(
                        "no stored response '{id}' (it was not stored, has expired or was deleted)"
                    ),
                )
            })?
            .to_vec(),
        None => Vec::new(),
    };
    turns.extend(input(&f)?);
    answered_calls(&turns)?;
    if turns.is_empty() {
        return Err(ApiError::invalid(Some("input"), "'input' is required"));
    }
    let mut messages = Vec::new();
    if let Some(i) = f.string("instructions")?.filter(|i| !i.is_empty()) {
        messages.push(Message::new("system", i));
    }
    messages.extend(turns.iter().cloned());
    let tools = tools(&f)?;
    let tool_choice = tool_choice(&f, &tools)?;
    let max_tokens = match f.count("max_output_tokens")? {
        Some(0) => {
            return Err(ApiError::invalid(
                Some("max_output_tokens"),
                "'max_output_tokens' must be at least 1",
            ))
        }
        n => n.map(|n| n.min(usize::MAX as u64) as usize),
    };
    let top_p = f.number("top_p", 0.0, 1.0)?.unwrap_or(1.0);
    if top_p == 0.0 {
        return Err(ApiError::invalid(Some("top_p"), "'top_p' must be above 0"));
    }
    let format = format(&f)?;
    let echo = json!({
        "instructions": f.get("instructions"),
        "previous_response_id": previous,
        "tools": f.get("tools").cloned().unwrap_or(json!([])),
        "tool_choice": f.get("tool_choice").cloned().unwrap_or(json!("auto")),
        "parallel_tool_calls": f.bool("parallel_tool_calls")?.unwrap_or(true),
        "text": f.get("text").cloned().unwrap_or(json!({"format": {"type": "text"}})),
        "max_output_tokens": max_tokens,
        "metadata": f.get("metadata").cloned().unwrap_or(json!({})),
        "top_logprobs": f.count("top_logprobs")?.unwrap_or(0),
    });
    let params = Params {
        prompt: Prompt::Chat(messages),
        more_prompts: Vec::new(),
        prompt_field: "input",
        format_field: "text",
        max_tokens,
        max_tokens_is_bound: true,
        temperature: f.number("temperature", 0.0, 2.0)?.unwrap_or(1.0) as f32,
        top_p: top_p as f32,
        top_k: 0,
        min_p: 0.0,
        adjust: Adjustments::default(),
        ignore_eos: false,
        stop: Vec::new(),
        seed: None,
        n: 1,
        logprobs: logprobs(&f)?,
        echo: false,
        tools,
        tool_choice,
        parallel_tool_calls: f.bool("parallel_tool_calls")?.unwrap_or(true),
        format,
        stream: f.bool("stream")?.unwrap_or(false),
        include_usage: false,
        speculative: None,
    };
    Ok(Request {
        params,
        turns,
        store: f.bool("store")?.unwrap_or(true),
        echo,
    })
}

/// Log-probabilities, with `top_logprobs` (0 to [`MAX_TOP_LOGPROBS`](crate::api::MAX_TOP_LOGPROBS)) alternatives a token,
/// where `include` names [`INCLUDE_LOGPROBS`] or `top_logprobs` asks for alternatives.
/// `include`'s other values (`reasoning.encrypted_content`, …) ask for what this server
/// does not keep and are passed over.
fn logprobs(f: &Fields) -> Result<Option<usize>, ApiError> {
    let asked = match f.get("include") {
        None | Some(Value::Null) => false,
        Some(Value::Array(values)) => {
            let mut asked = false;
            for (i, v) in values.iter().enumerate() {
                let v = v.as_str().ok_or_else(|| {
                    ApiError::invalid(Some("include"), format!("include[{i}] must be a string"))
                })?;
                asked |= v == INCLUDE_LOGPROBS;
            }
            asked
        }
        Some(_) => {
            return Err(ApiError::invalid(
                Some("include"),
                "'include' must be an array of strings",
            ))
        }
    };
    let top = top_logprobs(f, "top_logprobs")?.unwrap_or(0);
    Ok((asked || top > 0).then_some(top))
}

/// Checks that each `function_call_output` answers a `function_call` before it (given in
/// `input` or in the stored response continued), as OpenAI's API does.
fn answered_calls(turns: &[Message]) -> Result<(), ApiError> {
    match unanswered_call(turns) {
        Some((_, id)) => Err(ApiError::invalid(
            Some("input"),
            format!("no function call found for function_call_output with call_id '{id}'"),
        )),
        None => Ok(()),
    }
}

/// `input`: a string (one user message) or items — messages (`role` with a string or
/// `input_text` / `output_text` parts), `function_call` (joined to the assistant turn before
/// it) and `function_call_output` (a tool message); `reasoning` items are skipped.
fn input(f: &Fields) -> Result<Vec<Message>, ApiError> {
    let bad = |m: String| ApiError::invalid(Some("input"), m);
    let items = match f.get("input") {
        None => return Ok(Vec::new()),
        Some(Value::String(s)) => return Ok(vec![Message::new("user", s)]),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(bad("'input' must be a string or an array of items".into())),
    };
    let mut out: Vec<Message> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let kind = item.get("type").and_then(Value::as_str);
        match kind {
            Some("function_call") => {
                let (Some(call_id), Some(name), Some(args)) = (
                    item.get("call_id").and_then(Value::as_str),
                    item.get("name").and_then(Value::as_str),
                    item.get("arguments").and_then(Value::as_str),
                ) else {
                    return Err(bad(format!(
                        "input[{i}]: a function_call needs call_id, name and arguments strings"
                    )));
                };
                let arguments: Value = serde_json::from_str(args)
                    .map_err(|e| bad(format!("input[{i}].arguments is not JSON: {e}")))?;
                let call = json!({"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": arguments}});
                match out.last_mut() {
                    Some(m) if m.role == "assistant" => m.tool_calls.push(call),
                    _ => {
                        let mut m = Message::new("assistant", "");
                        m.tool_calls.push(call);
                        out.push(m);
                    }
                }
            }
            Some("function_call_output") => {
                let Some(call_id) = item.get("call_id").and_then(Value::as_str) else {
                    return Err(bad(format!("input[{i}].call_id must be a string")));
                };
                let output = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => parts_text(parts)
                        .ok_or_else(|| bad(format!("input[{i}].output: only text parts")))?,
                    _ => return Err(bad(format!("input[{i}].output must be a string"))),
                };
                let mut m = Message::new("tool", &output);
                m.tool_call_id = Some(call_id.to_string());
                out.push(m);
            }
            Some("reasoning") => {}
            None | Some("message") => {
                let role = match item.get("role").and_then(Value::as_str) {
                    Some("developer") => "system",
                    Some(r @ ("system" | "user" | "assistant")) => r,
                    _ => {
                        return Err(bad(format!(
                            "input[{i}].role must be user, assistant, system or developer"
                        )))
                    }
                };
                let content = match item.get("content") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => parts_text(parts).ok_or_else(|| {
                        bad(format!(
                            "input[{i}].content: only input_text and output_text parts are \
                             supported"
                        ))
                    })?,
                    _ => return Err(bad(format!("input[{i}].content must be a string or parts"))),
                };
                out.push(Message::new(role, &content));
            }
            Some(t) => return Err(bad(format!("input[{i}]: '{t}' items are not supported"))),
        }
    }
    Ok(out)
}

/// Chat messages as Responses items, the inverse of [`input`] (a developer message reads
/// back as `system`), item `k` numbered `{kind}_{rest}_{k}`: messages (a user's or system's
/// text as `input_text`, an assistant's as `output_text`), an assistant's calls as
/// `function_call` items, tool messages as `function_call_output`.
fn items_of(rest: &str, turns: &[Message]) -> Vec<Value> {
    let mut items = Vec::new();
    for m in turns {
        // `in` keeps them apart from the ids of the response's own output items.
        let id = |kind: &str, n: usize| format!("{kind}_{rest}_in{n}");
        match m.role.as_str() {
            "tool" => items.push(json!({
                "type": "function_call_output", "id": id("fco", items.len()),
                "call_id": m.tool_call_id.as_deref().unwrap_or_default(),
                "output": m.content, "status": "completed",
            })),
            role => {
                if !m.content.is_empty() || m.tool_calls.is_empty() {
                    let at = id("msg", items.len());
                    items.push(message_item(&at, role, &m.content, "completed"));
                }
                for call in &m.tool_calls {
                    let (f, at) = (&call["function"], id("fc", items.len()));
                    let (call_id, name) = (call["id"].as_str(), f["name"].as_str());
                    let (call_id, name) = (call_id.unwrap_or_default(), name.unwrap_or_default());
                    let arguments = f["arguments"].to_string();
                    items.push(call_item(&at, call_id, name, &arguments, "completed"));
                }
            }
        }
    }
    items
}

/// A `message` item: an assistant's `text` as `output_text`, anyone else's as `input_text`.
fn message_item(id: &str, role: &str, text: &str, status: &str) -> Value {
    let part = match role {
        "assistant" => json!({"type": "output_text", "text": text, "annotations": []}),
        _ => json!({"type": "input_text", "text": text}),
    };
    json!({"type": "message", "id": id, "status": status, "role": role, "content": [part]})
}

/// A `function_call` item (`arguments` as the JSON text of the call's arguments).
fn call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name,
        "arguments": arguments, "status": status})
}

/// A page of `items` (oldest first) as `GET /v1/responses/{id}/input_items` lists them, by
/// its query's pairs (`limit` 1–100, default 20; `order` `asc` or `desc`, the default; `after`
/// an item id; others ignored).
pub fn input_items_page(items: Vec<Value>, query: &[(String, String)]) -> Result<Value, ApiError> {
    let (mut limit, mut newest_first, mut after) = (20, true, None);
    for (k, v) in query {
        let v = v.as_str();
        match k.as_str() {
            "limit" => {
                limit = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=100).contains(n))
                    .ok_or_else(|| {
                        ApiError::invalid(Some("limit"), "'limit' must be an integer from 1 to 100")
                    })?
            }
            "order" => {
                newest_first = match v {
                    "desc" => true,
                    "asc" => false,
                    _ => {
                        return Err(ApiError::invalid(
                            Some("order"),
                            "'order' must be asc or desc",
                        ))
                    }
                }
            }
            "after" if !v.is_empty() => after = Some(v),
            _ => {}
        }
    }
    let mut items = items;
    if newest_first {
        items.reverse();
    }
    let start = match after {
        Some(a) => {
            items.iter().position(|i| i["id"] == a).ok_or_else(|| {
                ApiError::invalid(
                    Some("after"),
                    format!("'after' names no item of this response: {a}"),
                )
            })? + 1
        }
        None => 0,
    };
    let has_more = items.len() > start + limit;
    let page: Vec<Value> = items.into_iter().skip(start).take(limit).collect();
    Ok(json!({
        "object": "list",
        "first_id": page.first().map(|i| i["id"].clone()),
        "last_id": page.last().map(|i| i["id"].clone()),
        "has_more": has_more,
        "data": page,
    }))
}

/// The text of `input_text` / `output_text` parts.
fn parts_text(parts: &[Value]) -> Option<String> {
    parts
        .iter()
        .map(|p| match p.get("type").and_then(Value::as_str)? {
            "input_text" | "output_text" | "text" => p.get("text")?.as_str(),
            _ => None,
        })
        .collect()
}

/// `tools`: function tools, flat (`{"type": "function", "name", "parameters"}`).
fn tools(f: &Fields) -> Result<Vec<Tool>, ApiError> {
    tools_with(f, |declared, i, t| {
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(other) => {
                return Err(format!(
                    "tools[{i}]: '{other}' tools are not supported (function tools are)"
                ))
            }
            None => return Err(format!("tools[{i}].type must be \"function\"")),
        }
        let f = |k: &str| t.get(k).filter(|v| !v.is_null());
        let at = format!("tools[{i}]");
        declare_tool(declared, &at, f("name"), f("description"), f("parameters"))
    })
}

/// `tool_choice`: `auto`, `none`, `required` or `{"type": "function", "name"}`.
fn tool_choice(f: &Fields, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    let bad = |m: String| ApiError::invalid(Some("tool_choice"), m);
    let choice = match f.get("tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            _ => {
                return Err(bad(
                    "'tool_choice' must be auto, none, required or a function".into(),
                ))
            }
        },
        Some(v) => match v.get("name").and_then(Value::as_str) {
            Some(n) => ToolChoice::Named(n.to_string()),
            None => return Err(bad("'tool_choice' names no function".into())),
        },
    };
    checked_choice(choice, tools)
}

/// `text.format`: text, `json_object`, or `json_schema` with its `schema`.
fn format(f: &Fields) -> Result<Format, ApiError> {
    let bad = |m: &str| ApiError::invalid(Some("text"), m);
    let Some(format) = f.get("text").and_then(|t| t.get("format")) else {
        return Ok(Format::Text);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(Format::Text),
        Some("json_object") => Ok(Format::Json(None)),
        Some("json_schema") => match format.get("schema") {
            Some(s @ Value::Object(_)) => Ok(Format::Json(Some(s.clone()))),
            _ => Err(bad("'text.format.schema' must be an object")),
        },
        _ => Err(bad(
            "'text.format.type' must be text, json_object or json_schema",
        )),
    }
}

/// The output items of answer `c` (text as one `message`, then each `function_call`), the
/// assistant turn they add to the conversation, and whether any call was made. Where the
/// token limit cut the answer, the item it cut (its last, where that is text or reasoning:
/// its calls are whole ones) is `incomplete`, as the streamed answer leaves it. Where the
/// request asked for log-probabilities, the message's text carries those of the tokens that
/// spell it ([`TokenRun`]).
fn output(a: &Answer, c: &Choice, logprobs: bool) -> (Vec<Value>, Message, bool) {
    let parsed = a.split(c);
    let rest = a.id.trim_start_matches("resp_");
    let mut items = Vec::new();
    let mut turn = Message::new("assistant", &parsed.content);
    if !parsed.reasoning.is_empty() {
        items.push(reasoning_item(
            &format!("rs_{rest}"),
            &parsed.reasoning,
            "completed",
        ));
    }
    if !parsed.content.is_empty() || parsed.calls.is_empty() {
        let id = format!("msg_{rest}");
        let mut item = message_item(&id, "assistant", &parsed.content, "completed");
        if logprobs {
            let mut run = TokenRun::default();
            run.extend(&a.token_logprobs(c.logprobs()));
            let text = parsed.content.as_bytes();
            let spelled = run
                .find(text, 0, a.text.harmony())
                .map_or(0..0, |at| run.covering(at, at + text.len()));
            item["content"][0]["logprobs"] = json!(run.entries[spelled]);
        }
        items.push(item);
    }
    for (k, (call, openai)) in parsed
        .calls
        .iter()
        .zip(a.tool_calls(0, &parsed))
        .enumerate()
    {
        let call_id = openai["id"].as_str().unwrap_or_default().to_string();
        let id = format!("fc_{rest}_{k}");
        items.push(call_item(
            &id,
            &call_id,
            &call.name,
            &call.arguments,
            "completed",
        ));
        let arguments: Value = serde_json::from_str(&call.arguments).unwrap_or(json!({}));
        turn.tool_calls
            .push(json!({"id": call_id, "type": "function",
            "function": {"name": call.name, "arguments": arguments}}));
    }
    if let Some(last) = items.last_mut().filter(|i| i["type"] != "function_call") {
        last["status"] = json!(status(c.finish()));
    }
    let called = !parsed.calls.is_empty();
    (items, turn, called)
}

/// An answer's tokens' log-probability entries (chat's), in order, with their bytes joined:
/// where the output text's tokens are found. A text is spelled by the tokens whose bytes
/// overlap its place in the joined bytes, so the markup around it (a tool call's, harmony's
/// channels, the end-of-turn token) is left out. A text that is not one run of the tokens'
/// bytes (a harmony answer of several messages, joined by newlines; Hermes text on both sides
/// of a call) is not found, and has none.
#[derive(Default)]
struct TokenRun {
    entries: Vec<Value>,
    joined: Vec<u8>,
    /// Where each token's bytes end in `joined`.
    ends: Vec<usize>,
}

impl TokenRun {
    fn extend(&mut self, entries: &[Value]) {
        for e in entries {
            let bytes = e["bytes"].as_array().map(Vec::as_slice).unwrap_or_default();
            self.joined
                .extend(bytes.iter().filter_map(|x| x.as_u64()).map(|x| x as u8));
            self.ends.push(self.joined.len());
            self.entries.push(e.clone());
        }
    }

    /// Where `text` lies in the bytes from byte `from` on: its first place, or its last in a
    /// harmony answer (whose final channel comes after the reasoning and the markers).
    fn find(&self, text: &[u8], from: usize, harmony: bool) -> Option<usize> {
        let mut windows = self.joined.get(from..)?.windows(text.len().max(1));
        let at = match harmony {
            true => windows.rposition(|w| w == text),
            false => windows.position(|w| w == text),
        };
        at.filter(|_| !text.is_empty()).map(|at| from + at)
    }

    /// The tokens whose bytes overlap bytes `[start, end)` (`start < end`).
    fn covering(&self, start: usize, end: usize) -> std::ops::Range<usize> {
        // Token i holds bytes [ends[i - 1], ends[i]).
        let first = self.ends.partition_point(|&e| e <= start);
        let last = self.ends.partition_point(|&e| e < end);
        first..last + 1
    }

    /// The byte where token `i` starts.
    fn start_of(&self, i: usize) -> usize {
        i.checked_sub(1).map_or(0, |i| self.ends[i])
    }
}

/// A `reasoning` output item holding a model's reasoning text (harmony's analysis channel),
/// as OpenAI's API gives an open-weight model's.
fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "reasoning", "id": id, "status": status, "summary": [],
           "content": [{"type": "reasoning_text", "text": text}]})
}

/// The answer's fixed fields a response shows.
struct Head {
    id: String,
    created: u64,
    model: String,
    prompt_tokens: usize,
    /// Whether the model writes harmony (its text comes after its reasoning; [`TokenRun`]).
    harmony: bool,
}

impl Head {
    fn of(a: &Answer) -> Head {
        Head {
            id: a.id.clone(),
            created: a.created,
            model: a.model.clone(),
            prompt_tokens: a.prompt_tokens,
            harmony: a.text.harmony(),
        }
    }
}

/// The `response` object: the request's fields, `output`, status and usage.
fn response(
    h: &Head,
    r: &Request,
    output: Value,
    status: &str,
    cached: usize,
    tokens: usize,
) -> Value {
    let mut v = json!({
        "id": h.id, "object": "response", "created_at": h.created, "model": h.model,
        "status": status,
        "incomplete_details": if status == "incomplete" {
            json!({"reason": "max_output_tokens"})
        } else {
            Value::Null
        },
        "error": null, "output": output, "store": r.store,
        "temperature": r.params.temperature, "top_p": r.params.top_p,
        "truncation": "disabled", "reasoning": {"effort": null, "summary": null},
        "usage": {
            "input_tokens": h.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": h.prompt_tokens + tokens,
        },
    });
    for (k, x) in r.echo.as_object().expect("an object") {
        v[k] = x.clone();
    }
    v
}

/// The status of an answer that ended as OpenAI's `finish` says.
fn status(finish: &str) -> &'static str {
    match finish {
        "length" => "incomplete",
        _ => "completed",
    }
}

/// Stores `response` and the conversation `r` continued with `turn` under response `id`;
/// where they are too large to store, `response` says `"store": false`.
fn remember(store: &Store, id: &str, r: &Request, turn: Message, response: &mut Value) {
    if r.store {
        let mut turns = r.turns.clone();
        turns.push(turn);
        if !store.put(id.to_string(), turns, response.clone()) {
            response["store"] = json!(false);
        }
    }
}

/// The whole response (stored when asked).
pub async fn whole(
    a: Answer,
    r: Request,
    store: Arc<Store>,
    cached: usize,
    rx: UnboundedReceiver<Event>,
) -> Result<Value, ApiError> {
    let choices = crate::answer::choices(1, rx).await?;
    let c = &choices[0];
    let (items, turn, called) = output(&a, c, r.params.logprobs.is_some());
    let finish = c.finish_calling(called);
    let h = Head::of(&a);
    let mut v = response(&h, &r, json!(items), status(finish), cached, c.tokens());
    remember(&store, &a.id, &r, turn, &mut v);
    Ok(v)
}

/// The response's stream: `response.created`, `response.in_progress`, then per output item
/// `response.output_item.added`, its content (`response.content_part.added`,
/// `response.output_text.delta` … `.done`, or `response.function_call_arguments.delta` …
/// `.done`) and `response.output_item.done`, then `response.completed` (or
/// `response.incomplete`) with the whole response; `error` if it fails. Built from the
/// OpenAI chunks, whose held-back tool calls it keeps.
pub fn stream(
    a: Answer,
    r: Request,
    store: Arc<Store>,
    cached: usize,
    rx: UnboundedReceiver<Event>,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    use futures_util::StreamExt;
    let head = Head::of(&a);
    let mut shown = response(&head, &r, json!([]), "in_progress", cached, 0);
    shown["usage"] = Value::Null;
    let start = vec![
        json!({"type": "response.created", "response": shown}),
        json!({"type": "response.in_progress", "response": shown}),
    ];
    let mut items = Items::new(head, store, r, cached);
    let mut sequence = 0u64;
    let events = futures_util::stream::once(async move { start })
        .chain(chunks(a, cached, rx).map(move |c| items.events(c)))
        .flat_map(futures_util::stream::iter)
        .map(move |mut v: Value| {
            v["sequence_number"] = json!(sequence);
            sequence += 1;
            let name = v["type"].as_str().unwrap_or("error").to_string();
            Ok(SseEvent::default().event(name).data(v.to_string()))
        });
    Sse::new(events).keep_alive(KeepAlive::default())
}

/// The output items of a streamed response, as OpenAI chunks open and fill them.
struct Items {
    head: Head,
    /// The response id's unique part, for item ids.
    rest: String,
    store: Arc<Store>,
    request: Request,
    cached: usize,
    /// Items finished, in order.
    done: Vec<Value>,
    /// The text of the message item being streamed.
    text: Option<String>,
    /// The answer's tokens' log-probabilities so far (from every chunk), where the request
    /// asked for them; how many of them text deltas have sent; where the open message's
    /// text lies in their bytes (`Some(None)`: not one run of them, so it has none); and
    /// the entries its deltas sent.
    tokens: TokenRun,
    tokens_sent: usize,
    text_at: Option<Option<usize>>,
    text_logprobs: Vec<Value>,
    /// The text of the reasoning item being streamed.
    reasoning: Option<String>,
    /// The function call item being streamed (its arguments so far).
    call: Option<Value>,
    /// The status a text or reasoning item ends with: `incomplete` for the one the token
    /// limit cut (the one still open at the end of such an answer).
    text_status: &'static str,
    /// The assistant turn the output adds to the conversation.
    turn: Message,
}

impl Items {
    /// No items yet, for the response `head` answering `request`.
    fn new(head: Head, store: Arc<Store>, request: Request, cached: usize) -> Items {
        Items {
            rest: head.id.trim_start_matches("resp_").to_string(),
            head,
            store,
            request,
            cached,
            done: Vec::new(),
            text: None,
            tokens: TokenRun::default(),
            tokens_sent: 0,
            text_at: None,
            text_logprobs: Vec::new(),
            reasoning: None,
            call: None,
            text_status: "completed",
            turn: Message::new("assistant", ""),
        }
    }

    /// The events for chunk `c`.
    fn events(&mut self, c: Chunk) -> Vec<Value> {
        let mut out = Vec::new();
        let index = |s: &Self| s.done.len();
        match c {
            Chunk::Data(v) => {
                if let Some(lps) = v["choices"][0]["logprobs"]["content"].as_array() {
                    self.tokens.extend(lps);
                }
                let delta = &v["choices"][0]["delta"];
                if let Some(t) = delta["reasoning_content"]
                    .as_str()
                    .filter(|t| !t.is_empty())
                {
                    if self.reasoning.is_none() {
                        self.end_text(&mut out);
                        self.end_call(&mut out);
                        let item = reasoning_item(&self.reasoning_id(), "", "in_progress");
                        out.push(json!({"type": "response.output_item.added",
                            "output_index": index(self), "item": item}));
                        self.reasoning = Some(String::new());
                    }
                    self.reasoning.as_mut().expect("open").push_str(t);
                    out.push(json!({"type": "response.reasoning_text.delta",
                        "item_id": self.reasoning_id(), "output_index": index(self),
                        "content_index": 0, "delta": t}));
                }
                if let Some(t) = delta["content"].as_str().filter(|t| !t.is_empty()) {
                    if self.text.is_none() {
                        self.end_reasoning(&mut out);
                        self.end_call(&mut out);
                        self.open_text(&mut out);
                    }
                    self.text.as_mut().expect("open").push_str(t);
                    let lps = self.text_grew(t.len());
                    out.push(json!({"type": "response.output_text.delta",
                        "item_id": self.message_id(), "output_index": index(self),
                        "content_index": 0, "delta": t, "logprobs": lps}));
                }
                if let Some(call) = delta["tool_calls"].get(0) {
                    if let Some(id) = call["id"].as_str() {
                        self.end_reasoning(&mut out);
                        self.end_text(&mut out);
                        self.end_call(&mut out);
                        let k = self.turn.tool_calls.len();
                        let name = call["function"]["name"].as_str().unwrap_or_default();
                        let at = format!("fc_{}_{k}", self.rest);
                        let item = call_item(&at, id, name, "", "in_progress");
                        out.push(json!({"type": "response.output_item.added",
                            "output_index": index(self), "item": item}));
                        self.call = Some(item);
                    } else if let (Some(args), Some(item)) =
                        (call["function"]["arguments"].as_str(), self.call.as_mut())
                    {
                        let so_far = item["arguments"].as_str().unwrap_or_default().to_string();
                        item["arguments"] = json!(so_far + args);
                        out.push(json!({"type": "response.function_call_arguments.delta",
                            "item_id": item["id"], "output_index": self.done.len(),
                            "delta": args}));
                    }
                }
            }
            Chunk::Ended { finish, tokens, .. } => {
                let status = status(finish);
                self.text_status = status;
                self.end_reasoning(&mut out);
                self.end_text(&mut out);
                self.end_call(&mut out);
                if self.done.iter().all(|i| i["type"] == "reasoning") {
                    self.open_text(&mut out);
                    self.end_text(&mut out);
                }
                let mut whole = response(
                    &self.head,
                    &self.request,
                    json!(self.done),
                    status,
                    self.cached,
                    tokens,
                );
                let turn = std::mem::replace(&mut self.turn, Message::new("assistant", ""));
                remember(&self.store, &self.head.id, &self.request, turn, &mut whole);
                out.push(json!({"type": format!("response.{status}"), "response": whole}));
            }
            Chunk::Failed(e) => {
                out.push(json!({"type": "error", "code": null, "message": e.message,
                    "param": e.param}));
                let mut failed = response(
                    &self.head,
                    &self.request,
                    json!(self.done),
                    "failed",
                    self.cached,
                    0,
                );
                failed["error"] = json!({"code": "server_error", "message": e.message});
                out.push(json!({"type": "response.failed", "response": failed}));
            }
        }
        out
    }

    /// The id of the item of `kind` open now (or next): `{prefix}_{rest}`, numbered from the
    /// second on (a harmony answer may go back to reasoning after text).
    fn item_id(&self, prefix: &str, kind: &str) -> String {
        match self.done.iter().filter(|i| i["type"] == kind).count() {
            0 => format!("{prefix}_{}", self.rest),
            k => format!("{prefix}_{}_{k}", self.rest),
        }
    }

    /// The entries of the tokens the open message's text now covers and no delta has sent,
    /// its last `grew` bytes new: its place found at its first delta (after the tokens
    /// earlier text took), then checked to run on there ([`TokenRun`]).
    fn text_grew(&mut self, grew: usize) -> Vec<Value> {
        let text = self.text.as_deref().unwrap_or_default().as_bytes();
        let run = &self.tokens;
        let from = run.start_of(self.tokens_sent);
        let at = *self
            .text_at
            .get_or_insert_with(|| run.find(text, from, self.head.harmony));
        let Some(at) = at else {
            return Vec::new();
        };
        let new = at + text.len() - grew..at + text.len();
        if run.joined.get(new) != Some(&text[text.len() - grew..]) {
            self.text_at = Some(None);
            return Vec::new();
        }
        let spelled = run.covering(at, at + text.len());
        let sent = self.tokens_sent.max(spelled.start)..spelled.end.max(self.tokens_sent);
        let lps = run.entries[sent.clone()].to_vec();
        self.tokens_sent = sent.end;
        self.text_logprobs.extend(lps.iter().cloned());
        lps
    }

    fn message_id(&self) -> String {
        self.item_id("msg", "message")
    }

    fn reasoning_id(&self) -> String {
        self.item_id("rs", "reasoning")
    }

    fn open_text(&mut self, out: &mut Vec<Value>) {
        out.push(
            json!({"type": "response.output_item.added", "output_index": self.done.len(),
            "item": {"type": "message", "id": self.message_id(), "status": "in_progress",
                     "role": "assistant", "content": []}}),
        );
        out.push(
            json!({"type": "response.content_part.added", "item_id": self.message_id(),
            "output_index": self.done.len(), "content_index": 0,
            "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
        );
        self.text = Some(String::new());
    }

    fn end_text(&mut self, out: &mut Vec<Value>) {
        let Some(text) = self.text.take() else {
            return;
        };
        let (id, at) = (self.message_id(), self.done.len());
        let mut item = message_item(&id, "assistant", &text, self.text_status);
        let lps = std::mem::take(&mut self.text_logprobs);
        self.text_at = None;
        if self.request.params.logprobs.is_some() {
            item["content"][0]["logprobs"] = json!(lps);
        }
        out.push(json!({"type": "response.output_text.done", "item_id": id,
            "output_index": at, "content_index": 0, "text": text, "logprobs": lps}));
        out.push(json!({"type": "response.content_part.done", "item_id": id,
            "output_index": at, "content_index": 0, "part": item["content"][0]}));
        out.push(json!({"type": "response.output_item.done", "output_index": at, "item": item}));
        self.done.push(item);
        self.turn.content.push_str(&text);
    }

    fn end_reasoning(&mut self, out: &mut Vec<Value>) {
        let Some(text) = self.reasoning.take() else {
            return;
        };
        let (id, at) = (self.reasoning_id(), self.done.len());
        out.push(
            json!({"type": "response.reasoning_text.done", "item_id": id,
            "output_index": at, "content_index": 0, "text": text}),
        );
        let item = reasoning_item(&id, &text, self.text_status);
        out.push(json!({"type": "response.output_item.done", "output_index": at, "item": item}));
        self.done.push(item);
    }

    fn end_call(&mut self, out: &mut Vec<Value>) {
        let Some(mut item) = self.call.take() else {
            return;
        };
        let at = self.done.len();
        item["status"] = json!("completed");
        out.push(json!({"type": "response.function_call_arguments.done",
            "item_id": item["id"], "output_index": at, "arguments": item["arguments"]}));
        out.push(json!({"type": "response.output_item.done", "output_index": at, "item": item}));
        let arguments: Value =
            serde_json::from_str(item["arguments"].as_str().unwrap_or("{}")).unwrap_or(json!({}));
        self.turn
            .tool_calls
            .push(json!({"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": arguments}}));
        self.done.push(item);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_streamed_answer_that_returns_to_reasoning_numbers_its_items() {
        let store = Arc::new(Store::default());
        let request = parse(br#"{"model": "m", "input": "hi"}"#, &store).unwrap();
        let head = Head {
            id: "resp_x".into(),
            created: 0,
            model: "m".into(),
            prompt_tokens: 1,
            harmony: true,
        };
        let mut items = Items::new(head, store, request, 0);
        let delta = |d: Value| Chunk::Data(json!({"choices": [{"delta": d}]}));
        let mut events = Vec::new();
        for d in [
            json!({"reasoning_content": "First."}),
            json!({"content": "Let me look."}),
            json!({"reasoning_content": "Then."}),
            json!({"content": "Done."}),
        ] {
            events.extend(items.events(delta(d)));
        }
        events.extend(items.events(Chunk::Ended {
            finish: "stop",
            stop_string: None,
            tokens: 4,
        }));
        let added: Vec<(Value, Value)> = events
            .iter()
            .filter(|e| e["type"] == "response.output_item.added")
            .map(|e| (e["output_index"].clone(), e["item"]["id"].clone()))
            .collect();
        assert_eq!(
            added,
            [
                (json!(0), json!("rs_x")),
                (json!(1), json!("msg_x")),
                (json!(2), json!("rs_x_1")),
                (json!(3), json!("msg_x_1")),
            ]
        );
        let done = &events.last().unwrap()["response"]["output"];
        let ids: Vec<&str> = done
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, ["rs_x", "msg_x", "rs_x_1", "msg_x_1"]);
        assert_eq!(done[2]["content"][0]["text"], "Then.");
        // Each delta names the item it fills.
        let deltas: Vec<&Value> = events
            .iter()
            .filter(|e| e["type"] == "response.reasoning_text.delta")
            .map(|e| &e["item_id"])
            .collect();
        assert_eq!(deltas, [&json!("rs_x"), &json!("rs_x_1")]);
    }

    fn refused(body: &str, param: &str, says: &str) {
        let e = parse(body.as_bytes(), &Store::default()).err().unwrap();
        assert_eq!(e.status, 400, "{body}");
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
        assert!(e.message.contains(says), "{body}: {}", e.message);
    }

    #[test]
    fn input_items_become_chat_messages_and_previous_responses_continue() {
        let store = Store::default();
        store.put(
            "resp_1".into(),
            vec![
                Message::new("user", "Hi"),
                Message::new("assistant", "Hello"),
            ],
            json!({}),
        );
        let r = parse(
            br#"{"model": "m", "instructions": "Be brief.", "previous_response_id": "resp_1",
                "input": [
                  {"role": "developer", "content": [{"type": "input_text", "text": "Mind the tools."}]},
                  {"type": "message", "role": "user", "content": "Add 1 and 2."},
                  {"type": "function_call", "call_id": "call_7", "name": "add", "arguments": "{\"a\": 1, \"b\": 2}"},
                  {"type": "function_call_output", "call_id": "call_7", "output": "3"},
                  {"type": "reasoning", "summary": []}],
                "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}],
                "tool_choice": {"type": "function", "name": "add"},
                "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
                "max_output_tokens": 7, "store": false, "reasoning": {"effort": "low"}}"#,
            &store,
        )
        .unwrap();
        let Prompt::Chat(m) = &r.params.prompt else {
            panic!("{:?}", r.params.prompt)
        };
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(
            roles,
            [
                "system",
                "user",
                "assistant",
                "system",
                "user",
                "assistant",
                "tool"
            ]
        );
        assert_eq!(m[0].content, "Be brief.");
        assert_eq!(m[5].tool_calls[0]["function"]["arguments"]["b"], 2);
        assert_eq!(m[6].tool_call_id.as_deref(), Some("call_7"));
        assert_eq!(r.params.tool_choice, ToolChoice::Named("add".into()));
        assert_eq!(
            r.params.format,
            Format::Json(Some(json!({"type": "object"})))
        );
        assert_eq!((r.params.max_tokens, r.store), (Some(7), false));
        // The stored turns carry no instructions.
        assert_eq!(r.turns.len(), m.len() - 1);
    }

    #[test]
    fn what_the_responses_api_does_not_allow_is_refused_by_name() {
        refused(r#"{"model": "m"}"#, "input", "required");
        refused(
            r#"{"input": [{"type": "function_call_output", "call_id": "call_9", "output": "3"}]}"#,
            "input",
            "no function call found for function_call_output with call_id 'call_9'",
        );
        refused(
            r#"{"input": "hi", "previous_response_id": "resp_x"}"#,
            "previous_response_id",
            "no stored response",
        );
        refused(
            r#"{"input": "hi", "background": true}"#,
            "background",
            "not supported",
        );
        refused(
            r#"{"input": "hi", "max_output_tokens": 0}"#,
            "max_output_tokens",
            "at least 1",
        );
        refused(
            r#"{"input": [{"type": "image_generation_call"}]}"#,
            "input",
            "not supported",
        );
        refused(
            r#"{"input": "hi", "tools": [{"type": "web_search"}]}"#,
            "tools",
            "not supported",
        );
        refused(
            r#"{"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}"#,
            "input",
            "not JSON",
        );
    }

    #[tokio::test]
    async fn an_answer_cut_in_a_call_is_incomplete_with_its_whole_calls() {
        use crate::answer::tests::{events_ending, hermes_answer, CUT};
        use futures_util::StreamExt;
        for (pieces, whole_calls) in CUT {
            let store = Arc::new(Store::default());
            let request = parse(br#"{"model": "m", "input": "hi"}"#, &store).unwrap();
            let events = events_ending(pieces, "length");
            let v = whole(hermes_answer(), request, store, 0, events)
                .await
                .unwrap();
            assert_eq!(v["status"], "incomplete", "{v}");
            assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
            let items = v["output"].as_array().unwrap();
            let calls = items.iter().filter(|i| i["type"] == "function_call");
            assert!(calls.clone().all(|c| c["status"] == "completed"), "{v}");
            assert_eq!(calls.count(), whole_calls, "{v}");
            for m in items.iter().filter(|i| i["type"] == "message") {
                assert_eq!(m["status"], "incomplete", "{v}");
                assert_eq!(m["content"][0]["text"], "", "no call markup: {v}");
            }
            // Streamed: the same items, statuses and all.
            let store = Arc::new(Store::default());
            let request = parse(br#"{"model": "m", "input": "hi"}"#, &store).unwrap();
            let mut streamed = Items::new(Head::of(&hermes_answer()), store, request, 0);
            let chunks: Vec<Chunk> = chunks(hermes_answer(), 0, events_ending(pieces, "length"))
                .collect()
                .await;
            let last = chunks.into_iter().flat_map(|c| streamed.events(c)).last();
            let last = last.expect("events");
            assert_eq!(last["type"], "response.incomplete", "{last}");
            let shape = |items: &Value| -> Vec<(Value, Value)> {
                let items = items.as_array().unwrap().iter();
                items
                    .map(|i| (i["type"].clone(), i["status"].clone()))
                    .collect()
            };
            assert_eq!(shape(&last["response"]["output"]), shape(&v["output"]));
        }
    }

    #[test]
    fn logprobs_are_asked_by_include_or_top_logprobs() {
        let asked = |extra: &str| {
            let body = format!(r#"{{"model": "m", "input": "hi"{extra}}}"#);
            parse(body.as_bytes(), &Store::default())
                .unwrap()
                .params
                .logprobs
        };
        assert_eq!(asked(""), None);
        assert_eq!(
            asked(r#", "include": ["reasoning.encrypted_content"]"#),
            None
        );
        assert_eq!(asked(r#", "include": null"#), None);
        assert_eq!(asked(r#", "top_logprobs": 0"#), None);
        assert_eq!(
            asked(r#", "include": ["message.output_text.logprobs"]"#),
            Some(0)
        );
        assert_eq!(asked(r#", "top_logprobs": 3"#), Some(3));
        assert_eq!(
            asked(r#", "include": ["message.output_text.logprobs"], "top_logprobs": 20"#),
            Some(20)
        );
        let base = r#"{"model": "m", "input": "hi", "#;
        refused(
            &format!(r#"{base}"top_logprobs": 21}}"#),
            "top_logprobs",
            "at most 20",
        );
        refused(
            &format!(r#"{base}"include": "x"}}"#),
            "include",
            "an array of strings",
        );
        refused(
            &format!(r#"{base}"include": [1]}}"#),
            "include",
            "include[0]",
        );
    }

    #[tokio::test]
    async fn the_output_text_carries_the_logprobs_of_the_tokens_that_spell_it() {
        use crate::answer::tests::{hermes_answer, WHOLE_CALL, WORDS};
        use futures_util::StreamExt;
        use kvplug::TokenLogprobs;
        use tokio::sync::mpsc::unbounded_channel;
        // "Hel" (7) and "lo" (8), then maybe a whole call (one unknown token, 0), then the
        // end of turn (6, `<|return|>`, which adds no text).
        let events = |call: bool| {
            let (tx, rx) = unbounded_channel();
            let mut tokens = vec![(WORDS[0], 7), (WORDS[1], 8)];
            if call {
                tokens.push((WHOLE_CALL, 0));
            }
            tokens.push(("", 6));
            for (i, &(text, id)) in tokens.iter().enumerate() {
                let lp = -0.25 * (i + 1) as f32;
                let logprobs = TokenLogprobs {
                    token: id,
                    logprob: lp,
                    top: vec![(id, lp), (5, -3.0)],
                };
                tx.send(Event::Token {
                    choice: 0,
                    text: text.into(),
                    logprobs: vec![logprobs],
                })
                .unwrap();
            }
            tx.send(Event::Done {
                choice: 0,
                finish_reason: "stop",
                completion_tokens: tokens.len(),
                speculation: None,
                stop_string: None,
            })
            .unwrap();
            rx
        };
        let logprobs = |entries: &Value| -> Vec<f64> {
            let entries = entries.as_array().expect("logprobs");
            for e in entries {
                assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 2, "{e}");
            }
            entries
                .iter()
                .map(|e| e["logprob"].as_f64().unwrap())
                .collect()
        };
        let spelled = [-0.25, -0.5];
        let body = br#"{"model": "m", "input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 2}"#;
        for call in [false, true] {
            let store = Arc::new(Store::default());
            let request = parse(body, &store).unwrap();
            let v = whole(hermes_answer(), request, store, 0, events(call))
                .await
                .unwrap();
            let part = &v["output"][0]["content"][0];
            assert_eq!(part["text"], "Hello", "{v}");
            let tokens: Vec<&str> = part["logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["token"].as_str().unwrap())
                .collect();
            assert_eq!(tokens, WORDS, "{v}");
            assert_eq!(logprobs(&part["logprobs"]), spelled, "{v}");
            let items = v["output"].as_array().unwrap();
            let called = items.iter().any(|i| i["type"] == "function_call");
            assert_eq!(called, call, "{v}");

            let store = Arc::new(Store::default());
            let request = parse(body, &store).unwrap();
            let mut items = Items::new(Head::of(&hermes_answer()), store, request, 0);
            let chunks: Vec<Chunk> = chunks(hermes_answer(), 0, events(call)).collect().await;
            let sent: Vec<Value> = chunks.into_iter().flat_map(|c| items.events(c)).collect();
            let of = |kind: &'static str| sent.iter().filter(move |e| e["type"] == kind);
            let deltas: Vec<f64> = of("response.output_text.delta")
                .flat_map(|e| logprobs(&e["logprobs"]))
                .collect();
            assert_eq!(deltas, spelled, "call {call}");
            let done = of("response.output_text.done").next().unwrap();
            assert_eq!(logprobs(&done["logprobs"]), spelled);
            let completed = of("response.completed").next().unwrap();
            let part = &completed["response"]["output"][0]["content"][0];
            assert_eq!(logprobs(&part["logprobs"]), spelled, "{completed}");
        }

        // Not asked: no logprobs on the item, none with the deltas.
        let store = Arc::new(Store::default());
        let request = parse(br#"{"model": "m", "input": "hi"}"#, &store).unwrap();
        let v = whole(hermes_answer(), request, store, 0, events(false))
            .await
            .unwrap();
        assert!(
            v["output"][0]["content"][0].get("logprobs").is_none(),
            "{v}"
        );
    }

    #[test]
    fn a_streamed_text_sends_each_token_once_and_done_gathers_the_deltas() {
        let store = Arc::new(Store::default());
        let body = br#"{"model": "m", "input": "hi", "top_logprobs": 1}"#;
        let request = parse(body, &store).unwrap();
        let mut items = Items::new(
            Head::of(&crate::answer::tests::hermes_answer()),
            store,
            request,
            0,
        );
        let data = |delta: Value, tokens: &[&str]| {
            let lps: Vec<Value> = tokens
                .iter()
                .map(|t| json!({"token": t, "logprob": -1.0, "bytes": t.as_bytes(), "top_logprobs": []}))
                .collect();
            Chunk::Data(json!({"choices": [{"delta": delta, "logprobs": {"content": lps}}]}))
        };
        let mut sent = Vec::new();
        for c in [
            // A token's logprobs before its text (held), then with it.
            data(json!({}), &["Ye"]),
            data(json!({"content": "Yes"}), &["s"]),
            // Text that does not run on in the tokens' bytes (harmony joins its messages
            // with a newline): none from there on, nothing sent again.
            data(json!({"content": "\nYes"}), &["<|end|>", "Yes"]),
            data(json!({"content": " again"}), &[" again"]),
            // A call whose arguments hold the text again.
            data(
                json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                    "function": {"name": "f", "arguments": ""}}]}),
                &["{\"a\": \"Yes\"}"],
            ),
        ] {
            sent.extend(items.events(c));
        }
        let tokens = |e: &Value| -> Vec<String> {
            let lps = e["logprobs"].as_array().unwrap();
            lps.iter()
                .map(|l| l["token"].as_str().unwrap().to_string())
                .collect()
        };
        let deltas: Vec<String> = sent
            .iter()
            .filter(|e| e["type"] == "response.output_text.delta")
            .flat_map(tokens)
            .collect();
        assert_eq!(deltas, ["Ye", "s"]);
        let done = sent
            .iter()
            .find(|e| e["type"] == "response.output_text.done")
            .unwrap();
        assert_eq!(done["text"], "Yes\nYes again");
        assert_eq!(tokens(done), deltas);
    }

    #[test]
    fn the_tokens_that_spell_a_text_are_found_in_their_bytes() {
        let mut run = TokenRun::default();
        let tokens = [
            "<|channel|>",
            "He",
            "llo",
            "",
            " wor",
            "ld",
            "<|end|>",
            "He",
            "llo",
        ];
        let entries: Vec<Value> = tokens
            .iter()
            .map(|t| json!({"token": t, "bytes": t.as_bytes()}))
            .collect();
        run.extend(&entries);
        let spelled = |text: &str, from: usize, harmony: bool| {
            let at = run.find(text.as_bytes(), from, harmony)?;
            Some(run.covering(at, at + text.len()))
        };
        // An empty token inside the text is kept.
        assert_eq!(spelled("Hello world", 0, false), Some(1..6));
        // A text cut inside a token keeps that token.
        assert_eq!(spelled("Hello wo", 0, false), Some(1..5));
        // The first place, the last in harmony, or the first from a byte on.
        assert_eq!(spelled("Hello", 0, false), Some(1..3));
        assert_eq!(spelled("Hello", 0, true), Some(7..9));
        assert_eq!(spelled("Hello", run.start_of(3), false), Some(7..9));
        assert_eq!(spelled("", 0, false), None);
        assert_eq!(spelled("absent", 0, false), None);
        assert_eq!(spelled("Hello", 1000, false), None);
    }

    #[test]
    fn a_stored_responses_input_items_read_back_as_its_input_a_page_at_a_time() {
        let store = Store::default();
        let mut call = Message::new("assistant", "");
        call.tool_calls = vec![json!({"id": "call_7", "type": "function",
            "function": {"name": "add", "arguments": {"a": 1, "b": 2}}})];
        let mut result = Message::new("tool", "3");
        result.tool_call_id = Some("call_7".into());
        let before = vec![
            Message::new("system", "Mind the tools."),
            Message::new("user", "Hi"),
            Message::new("assistant", "Hello"),
            Message::new("user", "Add 1 and 2."),
            call,
            result,
        ];
        let mut turns = before.clone();
        turns.push(Message::new("assistant", "It is 3."));
        store.put("resp_9".into(), turns, json!({}));
        let items = store.input_items("resp_9").unwrap();
        assert_eq!(items.len(), 6);
        assert_eq!(items[2]["content"][0]["type"], "output_text");
        assert_eq!(items[4]["arguments"], r#"{"a":1,"b":2}"#);
        // Given back as a request's input, the items are the same conversation.
        let body = json!({"model": "m", "input": items}).to_string();
        let Prompt::Chat(m) = parse(body.as_bytes(), &store).unwrap().params.prompt else {
            panic!()
        };
        assert_eq!(m, before);
        // Newest first by default; pages follow `after`.
        let ids = |v: &Value| -> Vec<String> {
            v["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i["id"].as_str().unwrap().into())
                .collect()
        };
        let page = input_items_page(items.clone(), &[("limit".into(), "4".into())]).unwrap();
        assert_eq!(
            ids(&page),
            ["fco_9_in5", "fc_9_in4", "msg_9_in3", "msg_9_in2"]
        );
        assert_eq!(
            (&page["has_more"], &page["last_id"]),
            (&json!(true), &json!("msg_9_in2"))
        );
        let next = input_items_page(
            items.clone(),
            &[
                ("after".into(), "msg_9_in2".into()),
                ("limit".into(), "4".into()),
            ],
        )
        .unwrap();
        assert_eq!(ids(&next), ["msg_9_in1", "msg_9_in0"]);
        assert_eq!(next["has_more"], false);
        let oldest = input_items_page(
            items.clone(),
            &[("order".into(), "asc".into()), ("limit".into(), "1".into())],
        )
        .unwrap();
        assert_eq!(ids(&oldest), ["msg_9_in0"]);
        for (k, v) in [
            ("limit", "0"),
            ("limit", "101"),
            ("order", "up"),
            ("after", "nope"),
        ] {
            let e = input_items_page(items.clone(), &[(k.into(), v.into())]).unwrap_err();
            assert_eq!(
                (e.status.as_u16(), e.param.as_deref()),
                (400, Some(k)),
                "{k}={v}"
            );
        }
        assert!(store.input_items("resp_8").is_none());
    }

    #[test]
    fn the_store_keeps_the_newest_responses_within_its_bytes() {
        let store = Store::default();
        for i in 0..MAX_STORED + 3 {
            store.put(format!("resp_{i}"), Vec::new(), json!({"n": i}));
        }
        assert!(store.turns("resp_2").is_none());
        assert!(store.turns("resp_3").is_some());
        let newest = format!("resp_{}", MAX_STORED + 2);
        assert_eq!(
            *store.response(&newest).unwrap(),
            json!({"n": MAX_STORED + 2})
        );
        assert!(store.remove(&newest));
        assert!(!store.remove(&newest));
        assert!(store.response(&newest).is_none());

        // Conversations of just under a quarter of the budget each (their JSON and the
        // response's add 32 bytes): four fit, the fifth pushes the first out.
        const BUDGET: usize = 4000;
        let store = Store::within(BUDGET);
        let long = Message::new("user", &"x".repeat(BUDGET / 4 - 100));
        for i in 0..5 {
            store.put(format!("resp_{i}"), vec![long.clone()], json!({}));
        }
        assert!(store.turns("resp_0").is_none());
        assert!(store.turns("resp_1").is_some() && store.turns("resp_4").is_some());
        assert!(store.kept().bytes <= BUDGET);
        // Forgetting one gives its bytes back.
        let before = store.kept().bytes;
        assert!(store.remove("resp_2"));
        assert_eq!(before - store.kept().bytes, BUDGET / 4 - 100 + 32);
        assert_eq!(store.kept().order.len(), 3);
        // One larger than the whole budget is not stored, and pushes nothing out; the
        // response then says so.
        let huge = Message::new("user", &"x".repeat(BUDGET));
        let request = parse(br#"{"model": "m", "input": "hi"}"#, &store).unwrap();
        let mut answered = json!({"id": "resp_huge", "store": true});
        remember(&store, "resp_huge", &request, huge, &mut answered);
        assert!(store.turns("resp_huge").is_none());
        assert_eq!(store.kept().order.len(), 3);
        assert_eq!(answered["store"], false);
        // One that fits keeps saying it is stored.
        let mut answered = json!({"id": "resp_small", "store": true});
        remember(&store, "resp_small", &request, long, &mut answered);
        assert!(store.turns("resp_small").is_some());
        assert_eq!(answered["store"], true);
    }
}
