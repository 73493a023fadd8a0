//! Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), as the
//! `anthropic` SDK and Claude-Code-style agents speak it, mapped onto the same request
//! checks, engine and answers as the OpenAI routes: a body becomes [`Params`] (the system
//! prompt, content blocks, `tool_use` / `tool_result` turns and tools rendered by the model's
//! own chat template), and an answer becomes a `message` — text and `tool_use` blocks, a
//! `stop_reason`, usage with `cache_read_input_tokens` — or its stream of named events.
//!
//! Every field the API defines is implemented (`output_config.format` through the same
//! llguidance path as `response_format`), ignored because it cannot change the answer
//! (`metadata`, `service_tier`, `speed`, `cache_control` at the top or on blocks: caching is
//! automatic here), or refused with a 400 naming it; `thinking` and `output_config.effort` are
//! accepted and ignored (the models served here write no thinking blocks).

use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvplug::tools::Tool;
use kvplug::{Adjustments, Message};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::answer::{chunks, Answer, Choice, Chunk};
use crate::api::{
    check_prefill, checked_choice, declare_tool, object, refuse_others, tools_with, Fields, Format,
    Params, Prompt, ToolChoice,
};
use crate::engine::Event;
use crate::error::ApiError;

/// Most stop sequences per request.
pub const MAX_STOP_SEQUENCES: usize = 16;

/// Fields that cannot change the answer (or, `thinking`, cannot here).
const IGNORED: [&str; 10] = [
    "model",
    "metadata",
    "service_tier",
    "thinking",
    "cache_control",
    "speed",
    "inference_geo",
    "diagnostics",
    "user_profile_id",
    "workspace_id",
];

/// Fields this server reads (`temperature`, `top_p` and `top_k` from earlier versions of
/// the API, which clients may still send).
const IMPLEMENTED: [&str; 11] = [
    "output_config",
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
];

/// Parses and checks a Messages body (`counting`: a `count_tokens` body, which has no
/// `max_tokens`).
pub fn parse(body: &[u8], counting: bool) -> Result<Params, ApiError> {
    let map = object(body)?;
    let f = Fields(&map);
    refuse_others(&f, &IGNORED, &IMPLEMENTED)?;
    f.string("model")?;
    let max_tokens = match (f.count("max_tokens")?, counting) {
        (Some(0), false) => {
            return Err(ApiError::invalid(
                Some("max_tokens"),
                "'max_tokens' must be at least 1",
            ))
        }
        (None, false) => {
            return Err(ApiError::invalid(
                Some("max_tokens"),
                "'max_tokens' is required",
            ))
        }
        (n, _) => n.map(|n| n.min(usize::MAX as u64) as usize),
    };
    let tools = tools(&f)?;
    let (tool_choice, parallel) = tool_choice(&f, &tools)?;
    let mut messages = system(&f)?;
    messages.extend(turns(&f)?);
    let prompt = prompt(messages)?;
    let format = output_format(&f)?;
    // Anthropic's API refuses a prefill with structured outputs too.
    check_prefill(&prompt, &format, &tool_choice, "output_config")?;
    Ok(Params {
        prompt,
        more_prompts: Vec::new(),
        prompt_field: "messages",
        format_field: "output_config",
        max_tokens,
        max_tokens_is_bound: true,
        temperature: f.number("temperature", 0.0, 1.0)?.unwrap_or(1.0) as f32,
        top_p: top_p(&f)?,
        top_k: f
            .count("top_k")?
            .map_or(0, |k| k.min(u32::MAX as u64) as usize),
        min_p: 0.0,
        adjust: Adjustments::default(),
        ignore_eos: false,
        stop: stop_sequences(&f)?,
        seed: None,
        n: 1,
        logprobs: None,
        echo: false,
        tools,
        tool_choice,
        parallel_tool_calls: parallel,
        format,
        stream: f.bool("stream")?.unwrap_or(false),
        include_usage: false,
        speculative: None,
    })
}

/// `output_config.format`: a JSON schema the answer follows (`effort` is ignored).
fn output_format(f: &Fields) -> Result<Format, ApiError> {
    let bad = |m: &str| ApiError::invalid(Some("output_config"), m);
    let Some(config) = f.get("output_config") else {
        return Ok(Format::Text);
    };
    let Value::Object(config) = config else {
        return Err(bad("'output_config' must be an object"));
    };
    match config.get("format") {
        None | Some(Value::Null) => Ok(Format::Text),
        Some(v) => match (v.get("type").and_then(Value::as_str), v.get("schema")) {
            (Some("json_schema"), Some(s @ Value::Object(_))) => Ok(Format::Json(Some(s.clone()))),
            _ => Err(bad(
                "'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {…}}",
            )),
        },
    }
}

/// `top_p` in (0, 1] (default 1).
fn top_p(f: &Fields) -> Result<f32, ApiError> {
    let p = f.number("top_p", 0.0, 1.0)?.unwrap_or(1.0);
    if p == 0.0 {
        return Err(ApiError::invalid(Some("top_p"), "'top_p' must be above 0"));
    }
    Ok(p as f32)
}

/// `system`: a string or text blocks, as the first message.
fn system(f: &Fields) -> Result<Vec<Message>, ApiError> {
    let text = match f.get("system") {
        None => return Ok(Vec::new()),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => blocks
            .iter()
            .map(|b| text_of(b).ok_or("system blocks must be text blocks"))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|m| ApiError::invalid(Some("system"), m))?
            .join(BLOCK_SEPARATOR),
        Some(_) => {
            return Err(ApiError::invalid(
                Some("system"),
                "'system' must be a string or an array of text blocks",
            ))
        }
    };
    Ok(vec![Message::new("system", &text)])
}

/// Between a turn's text blocks (each its own paragraph).
const BLOCK_SEPARATOR: &str = "\n\n";

/// A text block's text.
fn text_of(block: &Value) -> Option<&str> {
    (block.get("type")? == "text")
        .then(|| block.get("text")?.as_str())
        .flatten()
}

/// The prompt of `messages`, as Anthropic's API reads a last assistant turn: its text is a
/// prefill the answer goes on with (and may not end in whitespace), an empty one is no turn.
fn prompt(mut messages: Vec<Message>) -> Result<Prompt, ApiError> {
    match messages.last() {
        Some(m) if m.role == "assistant" && m.tool_calls.is_empty() => {
            if m.content.is_empty() {
                messages.pop();
                if messages.iter().all(|m| m.role == "system") {
                    return Err(ApiError::invalid(
                        Some("messages"),
                        "'messages' holds no turn to answer (only an empty assistant turn)",
                    ));
                }
                return Ok(Prompt::Chat(messages));
            }
            if m.content.trim_end() != m.content {
                return Err(ApiError::invalid(
                    Some("messages"),
                    "final assistant content cannot end with trailing whitespace",
                ));
            }
            Ok(Prompt::Prefilled(messages))
        }
        _ => Ok(Prompt::Chat(messages)),
    }
}

/// `messages`: user and assistant turns of a string or content blocks, as chat messages —
/// an assistant's `tool_use` blocks become its tool calls, a user's `tool_result` blocks
/// tool messages (before the text of the same turn). As Anthropic's API, turns of one role in
/// a row are one turn (their text and calls join the message before); every turn but a last
/// assistant one has content, and a `tool_result` answers a `tool_use` of the assistant turns
/// just before.
fn turns(f: &Fields) -> Result<Vec<Message>, ApiError> {
    let bad = |m: String| ApiError::invalid(Some("messages"), m);
    let list = match f.get("messages") {
        Some(Value::Array(l)) if !l.is_empty() => l,
        Some(Value::Array(_)) => return Err(bad("'messages' must not be empty".into())),
        Some(_) => return Err(bad("'messages' must be an array".into())),
        None => return Err(bad("'messages' is required".into())),
    };
    let mut out = Vec::new();
    // The ids of the `tool_use` blocks of the last run of assistant turns, and of all.
    let mut used: Vec<String> = Vec::new();
    let mut ids = std::collections::HashSet::new();
    let mut previous_role = "";
    for (i, m) in list.iter().enumerate() {
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            _ => return Err(bad(format!("messages[{i}].role must be user or assistant"))),
        };
        if role == "assistant" && previous_role == "user" {
            used.clear();
        }
        let continues = previous_role == role;
        previous_role = role;
        let empty = match m.get("content") {
            Some(Value::String(s)) => s.is_empty(),
            Some(Value::Array(b)) => b.is_empty(),
            _ => false,
        };
        if empty && (role == "user" || i + 1 < list.len()) {
            return Err(bad(format!(
                "messages[{i}].content must not be empty (only a last assistant turn may be)"
            )));
        }
        let (mut text, mut calls) = (String::new(), Vec::new());
        let last_assistant = role == "assistant" && i + 1 == list.len();
        let blocks = match m.get("content") {
            // A string is one text block, and a last assistant one a prefill (`prompt` refuses
            // its trailing whitespace).
            Some(Value::String(s)) if !s.is_empty() && s.trim().is_empty() && !last_assistant => {
                return Err(bad(format!(
                    "messages[{i}].content: text content blocks must contain non-whitespace text"
                )))
            }
            Some(Value::String(s)) => {
                text.clone_from(s);
                &[][..]
            }
            Some(Value::Array(b)) => b.as_slice(),
            _ => {
                return Err(bad(format!(
                    "messages[{i}].content must be a string or an array of blocks"
                )))
            }
        };
        for (j, b) in blocks.iter().enumerate() {
            let at = format!("messages[{i}].content[{j}]");
            match (b.get("type").and_then(Value::as_str), role) {
                (Some("text"), _) => {
                    let t = text_of(b).ok_or_else(|| bad(format!("{at}.text must be a string")))?;
                    if t.trim().is_empty() {
                        return Err(bad(format!(
                            "{at}: text content blocks must contain non-whitespace text"
                        )));
                    }
                    if !text.is_empty() {
                        text.push_str(BLOCK_SEPARATOR);
                    }
                    text.push_str(t)
                }
                (Some("tool_use"), "assistant") => {
                    let call = tool_use(b).map_err(|e| bad(format!("{at}: {e}")))?;
                    let id = call["id"].as_str().unwrap_or_default();
                    // Anthropic's rule: a result answers exactly one call.
                    if !ids.insert(id.to_string()) {
                        return Err(bad(format!(
                            "{at}: tool_use id '{id}' is used by an earlier tool_use block \
                             (ids must be unique)"
                        )));
                    }
                    calls.push(call)
                }
                (Some("tool_result"), "user") => {
                    let result = tool_result(b).map_err(|e| bad(format!("{at}: {e}")))?;
                    let id = result.tool_call_id.as_deref().unwrap_or_default();
                    if !used.iter().any(|u| u == id) {
                        return Err(bad(format!(
                            "{at}: tool_use_id '{id}' answers no tool_use block of the assistant \
                             turn before"
                        )));
                    }
                    out.push(result)
                }
                // The models served here write none; earlier ones are not shown to them.
                (Some("thinking" | "redacted_thinking"), "assistant") => {}
                (Some(t), _) => {
                    return Err(bad(format!(
                        "{at}: a '{t}' block is not supported in a {role} turn"
                    )))
                }
                (None, _) => return Err(bad(format!("{at}.type must be a string"))),
            }
        }
        used.extend(
            calls
                .iter()
                .filter_map(|c| c["id"].as_str().map(str::to_string)),
        );
        match out.last_mut() {
            Some(last) if continues && last.role == role => {
                if !text.is_empty() && !last.content.is_empty() {
                    last.content.push_str(BLOCK_SEPARATOR);
                }
                last.content.push_str(&text);
                last.tool_calls.extend(calls);
            }
            _ if !text.is_empty() || !calls.is_empty() || role == "assistant" => {
                let mut msg = Message::new(role, &text);
                msg.tool_calls = calls;
                out.push(msg);
            }
            _ => {}
        }
    }
    Ok(out)
}

/// A `tool_use` block as a chat template's tool call.
fn tool_use(b: &Value) -> Result<Value, &'static str> {
    let id = b
        .get("id")
        .and_then(Value::as_str)
        .ok_or("id must be a string")?;
    let name = b
        .get("name")
        .and_then(Value::as_str)
        .ok_or("name must be a string")?;
    let input = match b.get("input") {
        Some(v @ Value::Object(_)) => v.clone(),
        None | Some(Value::Null) => json!({}),
        Some(_) => return Err("input must be an object"),
    };
    Ok(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input}}))
}

/// A `tool_result` block as a tool message (an error result says so first).
fn tool_result(b: &Value) -> Result<Message, &'static str> {
    let id = b
        .get("tool_use_id")
        .and_then(Value::as_str)
        .ok_or("tool_use_id must be a string")?;
    let mut content = match b.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|p| text_of(p).ok_or("content blocks must be text blocks"))
            .collect::<Result<Vec<_>, _>>()?
            .join(BLOCK_SEPARATOR),
        None | Some(Value::Null) => String::new(),
        Some(_) => return Err("content must be a string or text blocks"),
    };
    if b.get("is_error").and_then(Value::as_bool) == Some(true) {
        content = format!("Error: {content}");
    }
    let mut m = Message::new("tool", &content);
    m.tool_call_id = Some(id.to_string());
    Ok(m)
}

/// `tools`: custom tools with an `input_schema` (Anthropic's server tools are refused).
fn tools(f: &Fields) -> Result<Vec<Tool>, ApiError> {
    tools_with(f, |declared, i, t| {
        if let Some(other) = t
            .get("type")
            .and_then(Value::as_str)
            .filter(|&k| k != "custom")
        {
            return Err(format!(
                "tools[{i}]: '{other}' is a server tool; only custom tools are supported"
            ));
        }
        let schema = t
            .get("input_schema")
            .filter(|s| s.is_object())
            .ok_or_else(|| format!("tools[{i}].input_schema must be a JSON schema object"))?;
        let at = format!("tools[{i}]");
        declare_tool(
            declared,
            &at,
            t.get("name"),
            t.get("description"),
            Some(schema),
        )
    })
}

/// `tool_choice` (`auto`, `any`, `tool` with a name, `none`) and whether several calls may
/// come in one answer (not with `disable_parallel_tool_use`).
fn tool_choice(f: &Fields, tools: &[Tool]) -> Result<(ToolChoice, bool), ApiError> {
    let bad = |m: String| ApiError::invalid(Some("tool_choice"), m);
    let Some(c) = f.get("tool_choice") else {
        return Ok((ToolChoice::Auto, true));
    };
    let Value::Object(c) = c else {
        return Err(bad("'tool_choice' must be an object".into()));
    };
    let parallel = !c
        .get("disable_parallel_tool_use")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let choice = match c.get("type").and_then(Value::as_str) {
        Some("auto") => ToolChoice::Auto,
        Some("none") => ToolChoice::None,
        Some("any") => ToolChoice::Required,
        Some("tool") => match c.get("name").and_then(Value::as_str) {
            Some(n) => ToolChoice::Named(n.to_string()),
            None => return Err(bad("'tool_choice' of type tool needs a name".into())),
        },
        _ => {
            return Err(bad(
                "'tool_choice.type' must be auto, any, tool or none".into()
            ))
        }
    };
    let choice = checked_choice(choice, tools)?;
    Ok((choice, parallel))
}

/// `stop_sequences`: non-empty strings.
fn stop_sequences(f: &Fields) -> Result<Vec<String>, ApiError> {
    let bad = |m: String| ApiError::invalid(Some("stop_sequences"), m);
    let list = match f.get("stop_sequences") {
        None => return Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().filter(|s| !s.is_empty()).map(String::from))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("'stop_sequences' must be non-empty strings".into()))?,
        Some(_) => return Err(bad("'stop_sequences' must be an array".into())),
    };
    if list.len() > MAX_STOP_SEQUENCES {
        return Err(bad(format!(
            "'stop_sequences' takes at most {MAX_STOP_SEQUENCES} strings"
        )));
    }
    Ok(list)
}

/// Anthropic's `stop_reason` for an answer that ended as OpenAI's `finish` says, with
/// `stop_string` when one ended it.
fn stop_reason(finish: &str, stop_string: Option<&str>) -> &'static str {
    match (finish, stop_string) {
        ("tool_calls", _) => "tool_use",
        ("length", _) => "max_tokens",
        (_, Some(_)) => "stop_sequence",
        _ => "end_turn",
    }
}

/// Usage: prompt tokens reused (`cached`) are `cache_read_input_tokens`, the rest
/// `input_tokens`.
fn usage(a: &Answer, cached: usize, output: usize) -> Value {
    json!({
        "input_tokens": a.prompt_tokens - cached.min(a.prompt_tokens),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": output,
    })
}

/// The message of a whole answer.
pub async fn message(
    a: Answer,
    cached: usize,
    rx: UnboundedReceiver<Event>,
) -> Result<Value, ApiError> {
    let choices = crate::answer::choices(1, rx).await?;
    let c: &Choice = &choices[0];
    let parsed = a.split(c);
    let mut content = Vec::new();
    if !parsed.reasoning.is_empty() {
        // No signature: the reasoning is the model's own text, not Anthropic's.
        content.push(json!({"type": "thinking", "thinking": parsed.reasoning, "signature": ""}));
    }
    if !parsed.content.is_empty() {
        content.push(json!({"type": "text", "text": parsed.content}));
    }
    for (call, openai) in parsed.calls.iter().zip(a.tool_calls(0, &parsed)) {
        content.push(json!({
            "type": "tool_use",
            "id": tool_use_id(&openai["id"]),
            "name": call.name,
            "input": serde_json::from_str::<Value>(&call.arguments).unwrap_or_else(|_| json!({})),
        }));
    }
    let finish = c.finish_calling(!parsed.calls.is_empty());
    Ok(json!({
        "id": a.id,
        "type": "message",
        "role": "assistant",
        "model": a.model,
        "content": content,
        "stop_reason": stop_reason(finish, c.stop_string()),
        "stop_sequence": c.stop_string(),
        "usage": usage(&a, cached, c.tokens()),
    }))
}

/// The message's stream: `message_start`, then per content block `content_block_start`,
/// its deltas (`text_delta`, `input_json_delta`) and `content_block_stop`, then
/// `message_delta` (stop reason, output tokens) and `message_stop`; `error` if it fails. A
/// model's reasoning (harmony's analysis channel) is a `thinking` block (`thinking_delta`).
/// Built from the OpenAI chunks, whose held-back tool calls it keeps.
pub fn stream(
    a: Answer,
    cached: usize,
    rx: UnboundedReceiver<Event>,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    use futures_util::StreamExt;
    let start = json!({"type": "message_start", "message": {
        "id": a.id, "type": "message", "role": "assistant", "model": a.model, "content": [],
        "stop_reason": null, "stop_sequence": null, "usage": usage(&a, cached, 0),
    }});
    let mut blocks = Blocks::default();
    let events = futures_util::stream::once(async move { vec![start] })
        .chain(chunks(a, cached, rx).map(move |c| blocks.events(c)))
        .flat_map(futures_util::stream::iter)
        .map(|v: Value| {
            let name = v["type"].as_str().unwrap_or("error").to_string();
            Ok(SseEvent::default().event(name).data(v.to_string()))
        });
    Sse::new(events).keep_alive(KeepAlive::default())
}

/// The content blocks of a streamed message, as OpenAI chunks open and fill them.
#[derive(Default)]
struct Blocks {
    /// Blocks started so far, and whether the last is still open.
    count: usize,
    open: bool,
    text_open: bool,
    thinking_open: bool,
}

impl Blocks {
    /// The events for chunk `c`.
    fn events(&mut self, c: Chunk) -> Vec<Value> {
        let mut out = Vec::new();
        match c {
            Chunk::Data(v) => {
                let delta = &v["choices"][0]["delta"];
                if let Some(t) = delta["reasoning_content"]
                    .as_str()
                    .filter(|t| !t.is_empty())
                {
                    if !self.thinking_open {
                        let block = json!({"type": "thinking", "thinking": "", "signature": ""});
                        self.start(&mut out, block);
                        self.thinking_open = true;
                    }
                    out.push(self.delta(json!({"type": "thinking_delta", "thinking": t})));
                }
                if let Some(t) = delta["content"].as_str().filter(|t| !t.is_empty()) {
                    if !self.text_open {
                        self.start(&mut out, json!({"type": "text", "text": ""}));
                        self.text_open = true;
                    }
                    out.push(self.delta(json!({"type": "text_delta", "text": t})));
                }
                if let Some(call) = delta["tool_calls"].get(0) {
                    if call["id"].is_string() {
                        let head = json!({"type": "tool_use", "id": tool_use_id(&call["id"]),
                            "name": call["function"]["name"], "input": {}});
                        self.start(&mut out, head);
                    } else if let Some(args) = call["function"]["arguments"].as_str() {
                        out.push(
                            self.delta(json!({"type": "input_json_delta", "partial_json": args})),
                        );
                    }
                }
            }
            Chunk::Ended {
                finish,
                stop_string,
                tokens,
            } => {
                self.stop(&mut out);
                out.push(json!({"type": "message_delta",
                    "delta": {"stop_reason": stop_reason(finish, stop_string.as_deref()),
                              "stop_sequence": stop_string},
                    "usage": {"output_tokens": tokens}}));
                out.push(json!({"type": "message_stop"}));
            }
            Chunk::Failed(e) => out.push(error_body(&e)),
        }
        out
    }

    fn start(&mut self, out: &mut Vec<Value>, block: Value) {
        self.stop(out);
        out.push(
            json!({"type": "content_block_start", "index": self.count, "content_block": block}),
        );
        self.count += 1;
        self.open = true;
    }

    fn delta(&self, delta: Value) -> Value {
        json!({"type": "content_block_delta", "index": self.count - 1, "delta": delta})
    }

    fn stop(&mut self, out: &mut Vec<Value>) {
        if std::mem::take(&mut self.open) {
            out.push(json!({"type": "content_block_stop", "index": self.count - 1}));
        }
        self.text_open = false;
        self.thinking_open = false;
    }
}

/// A `tool_use` block's id from the OpenAI call id the answer gives it (`call_…`).
fn tool_use_id(openai: &Value) -> String {
    openai
        .as_str()
        .unwrap_or_default()
        .replacen("call_", "toolu_", 1)
}

/// An error in Anthropic's shape.
fn error_body(e: &ApiError) -> Value {
    let kind = match e.status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        500.. => "api_error",
        _ => "invalid_request_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": e.message}})
}

/// An error answered in Anthropic's shape (with `Retry-After` when it has one).
pub fn error_response(e: ApiError) -> Response {
    let mut r = (e.status, Json(error_body(&e))).into_response();
    if let Some(s) = e.retry_after {
        r.headers_mut()
            .insert(axum::http::header::RETRY_AFTER, s.into());
    }
    r
}

/// `count_tokens`' answer.
pub fn token_count(prompt_tokens: usize) -> Value {
    json!({ "input_tokens": prompt_tokens })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasoning_streams_as_a_thinking_block_before_the_text() {
        let chunk = |delta: Value| Chunk::Data(json!({"choices": [{"delta": delta}]}));
        let mut b = Blocks::default();
        let mut events = b.events(chunk(json!({"reasoning_content": "Hmm."})));
        events.extend(b.events(chunk(json!({"reasoning_content": " Yes."}))));
        events.extend(b.events(chunk(json!({"content": "Hi."}))));
        let kinds: Vec<String> = events
            .iter()
            .map(|e| match e["type"].as_str().unwrap() {
                "content_block_start" => format!("start {}", e["content_block"]["type"]),
                "content_block_delta" => format!("delta {}", e["delta"]["type"]),
                other => other.to_string(),
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "start \"thinking\"",
                "delta \"thinking_delta\"",
                "delta \"thinking_delta\"",
                "content_block_stop",
                "start \"text\"",
                "delta \"text_delta\"",
            ]
        );
        assert_eq!(events[2]["delta"]["thinking"], " Yes.");
        assert_eq!(events[4]["index"], 1);
    }

    #[test]
    fn turns_of_one_role_in_a_row_are_one_turn_for_tool_results() {
        // Results split over user turns, and calls followed by an assistant's text.
        for body in [
            r#"{"max_tokens": 5, "messages": [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f"},
                    {"type": "tool_use", "id": "t2", "name": "f"}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2"}]}]}"#,
            r#"{"max_tokens": 5, "messages": [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f"}]},
                {"role": "assistant", "content": "Calling."},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"},
                    {"type": "text", "text": "Go on."}]}]}"#,
        ] {
            let p = parse(body.as_bytes(), false).unwrap();
            let Prompt::Chat(m) = &p.prompt else {
                panic!("{:?}", p.prompt)
            };
            assert!(m.iter().any(|m| m.role == "tool"), "{m:?}");
            // The assistant's turns are one message: roles alternate as templates want.
            let assistants: Vec<&Message> = m.iter().filter(|m| m.role == "assistant").collect();
            assert_eq!(assistants.len(), 1, "{m:?}");
        }
        // The calls and the text of two assistant turns join in one message.
        let p = parse(
            br#"{"max_tokens": 5, "messages": [{"role": "user", "content": "hi"},
                {"role": "user", "content": [{"type": "text", "text": "there"}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f"}]},
                {"role": "assistant", "content": "Calling."},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}]}"#,
            false,
        )
        .unwrap();
        let Prompt::Chat(m) = &p.prompt else {
            panic!("{:?}", p.prompt)
        };
        let shape: Vec<(&str, &str, usize)> = m
            .iter()
            .map(|m| (m.role.as_str(), m.content.as_str(), m.tool_calls.len()))
            .collect();
        assert_eq!(
            shape,
            [
                ("user", "hi\n\nthere", 0),
                ("assistant", "Calling.", 1),
                ("tool", "", 0)
            ]
        );
    }

    fn refused(body: &str, param: &str, says: &str) {
        let e = parse(body.as_bytes(), false).unwrap_err();
        assert_eq!(e.status, 400, "{body}");
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
        assert!(e.message.contains(says), "{body}: {}", e.message);
    }

    #[test]
    fn a_messages_body_becomes_chat_messages_with_tools() {
        let p = parse(
            br#"{"model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be brief.",
                "cache_control": {"type": "ephemeral"}}],
                "messages": [
                  {"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                     "input": {"city": "Paris"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                     "content": [{"type": "text", "text": "18 C"}, {"type": "text", "text": "dry"}]},
                    {"type": "text", "text": "And tomorrow?"}]}],
                "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
                "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
                "stop_sequences": ["\n\n"], "temperature": 0, "metadata": {"user_id": "u"},
                "stream": true}"#,
            false,
        )
        .unwrap();
        let Prompt::Chat(m) = &p.prompt else {
            panic!("{:?}", p.prompt)
        };
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        assert_eq!(m[0].content, "Be brief.");
        assert_eq!(m[2].content, "Checking.");
        assert_eq!(m[2].tool_calls[0]["function"]["arguments"]["city"], "Paris");
        assert_eq!(
            (m[3].content.as_str(), m[3].tool_call_id.as_deref()),
            ("18 C\n\ndry", Some("toolu_1"))
        );
        assert_eq!(m[4].content, "And tomorrow?");
        assert_eq!(p.tools[0].name, "get_weather");
        assert_eq!(
            (
                &p.tool_choice,
                p.parallel_tool_calls,
                p.max_tokens,
                p.temperature,
                p.stream
            ),
            (&ToolChoice::Required, false, Some(9), 0.0, true)
        );
        assert_eq!(p.stop, ["\n\n"]);
        // count_tokens bodies have no max_tokens.
        let counted = parse(
            br#"{"messages": [{"role": "user", "content": "hi"}]}"#,
            true,
        );
        assert_eq!(counted.unwrap().max_tokens, None);
    }

    #[test]
    fn a_last_assistant_turn_is_a_prefill_the_answer_goes_on_with() {
        let body = |last: &str| {
            format!(
                r#"{{"max_tokens": 5, "messages": [{{"role": "user", "content": "Count."}}, {last}]}}"#
            )
        };
        let p = parse(
            body(r#"{"role": "assistant", "content": [{"type": "text", "text": "1, 2,"}]}"#)
                .as_bytes(),
            false,
        )
        .unwrap();
        let Prompt::Prefilled(m) = &p.prompt else {
            panic!("{:?}", p.prompt)
        };
        assert_eq!((m.len(), m[1].content.as_str()), (2, "1, 2,"));
        // An empty one (or one of thinking only) is no turn; one calling tools is a turn.
        for last in [
            r#"{"role": "assistant", "content": ""}"#,
            r#"{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}]}"#,
        ] {
            let p = parse(body(last).as_bytes(), false).unwrap();
            assert!(
                matches!(&p.prompt, Prompt::Chat(m) if m.len() == 1),
                "{last}"
            );
        }
        let call =
            r#"{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}"#;
        let p = parse(body(call).as_bytes(), false).unwrap();
        assert!(matches!(&p.prompt, Prompt::Chat(m) if m.len() == 2));
        refused(
            &body(r#"{"role": "assistant", "content": "1, 2, "}"#),
            "messages",
            "cannot end with trailing whitespace",
        );
        // It cannot also start a structured answer or a forced call.
        let prefilled = r#""messages": [{"role": "user", "content": "Name?"},
            {"role": "assistant", "content": "{\"name\": \""}]"#;
        let tool = r#""tools": [{"name": "f", "input_schema": {"type": "object"}}]"#;
        refused(
            &format!(
                r#"{{"max_tokens": 5, {prefilled}, "output_config": {{"format":
                {{"type": "json_schema", "schema": {{"type": "object"}}}}}}}}"#
            ),
            "output_config",
            "cannot be combined with a prefilled assistant turn",
        );
        refused(
            &format!(
                r#"{{"max_tokens": 5, {prefilled}, {tool}, "tool_choice": {{"type": "any"}}}}"#
            ),
            "tool_choice",
            "cannot be combined with a prefilled assistant turn",
        );
        let auto = format!(r#"{{"max_tokens": 5, {prefilled}, {tool}}}"#);
        assert!(parse(auto.as_bytes(), false).is_ok());
        refused(
            r#"{"max_tokens": 5, "messages": [{"role": "assistant", "content": ""}]}"#,
            "messages",
            "no turn to answer",
        );
    }

    #[test]
    fn what_the_messages_api_does_not_allow_is_refused_by_name() {
        let hi = r#""messages": [{"role": "user", "content": "hi"}]"#;
        refused(&format!("{{{hi}}}"), "max_tokens", "required");
        refused(
            &format!("{{{hi}, \"max_tokens\": 0}}"),
            "max_tokens",
            "at least 1",
        );
        refused(
            &format!("{{{hi}, \"max_tokens\": 1000000000000000000000000000000}}"),
            "max_tokens",
            "a non-negative integer below 2^64, got 1e+30",
        );
        refused(
            &format!("{{{hi}, \"max_tokens\": 5, \"temperature\": 1.5}}"),
            "temperature",
            "between",
        );
        refused(
            &format!("{{{hi}, \"max_tokens\": 5, \"container\": \"c\"}}"),
            "container",
            "not supported",
        );
        refused(
            r#"{"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}"#,
            "messages",
            "'image' block",
        );
        refused(
            r#"{"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}"#,
            "messages",
            "user or assistant",
        );
        refused(
            r#"{"max_tokens": 5, "messages": [{"role": "user", "content": []}]}"#,
            "messages",
            "messages[0].content must not be empty",
        );
        refused(
            r#"{"max_tokens": 5, "messages": [{"role": "user", "content": "hi"},
                {"role": "user", "content": [{"type": "text", "text": " \n"}]}]}"#,
            "messages",
            "messages[1].content[0]: text content blocks must contain non-whitespace text",
        );
        refused(
            r#"{"max_tokens": 5, "messages": [{"role": "user", "content": " \t"}]}"#,
            "messages",
            "messages[0].content: text content blocks must contain non-whitespace text",
        );
        refused(
            r#"{"max_tokens": 5, "messages": [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": " "}]}"#,
            "messages",
            "final assistant content cannot end with trailing whitespace",
        );
        refused(
            r#"{"max_tokens": 5, "messages": [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": ""}, {"role": "user", "content": "hi"}]}"#,
            "messages",
            "messages[1].content must not be empty",
        );
        refused(
            r#"{"max_tokens": 5, "messages": [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f"}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2"}]}]}"#,
            "messages",
            "tool_use_id 't2' answers no tool_use block",
        );
        refused(
            r#"{"max_tokens": 5, "messages": [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f"}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f"}]}]}"#,
            "messages",
            "messages[3].content[0]: tool_use id 't1' is used by an earlier tool_use block",
        );
        // A result for a call of an earlier exchange.
        refused(
            r#"{"max_tokens": 5, "messages": [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f"}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
                {"role": "assistant", "content": "Done."},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}]}"#,
            "messages",
            "messages[4].content[0]: tool_use_id 't1'",
        );
        refused(
            &format!("{{{hi}, \"max_tokens\": 5, \"tools\": [{{\"type\": \"bash_20250124\", \"name\": \"bash\"}}]}}"),
            "tools",
            "server tool",
        );
        refused(
            &format!("{{{hi}, \"max_tokens\": 5, \"tools\": [{{\"name\": \"f\", \"input_schema\": {{}}}}], \"tool_choice\": {{\"type\": \"tool\", \"name\": \"g\"}}}}"),
            "tool_choice",
            "does not declare",
        );
        refused(
            &format!("{{{hi}, \"max_tokens\": 5, \"stop_sequences\": [\"\"]}}"),
            "stop_sequences",
            "non-empty",
        );
    }

    #[test]
    fn stop_reasons_follow_how_the_answer_ended() {
        assert_eq!(stop_reason("stop", None), "end_turn");
        assert_eq!(stop_reason("stop", Some("\n")), "stop_sequence");
        assert_eq!(stop_reason("length", None), "max_tokens");
        assert_eq!(stop_reason("tool_calls", None), "tool_use");
    }

    #[tokio::test]
    async fn an_answer_cut_in_a_call_stops_at_max_tokens_with_its_whole_calls() {
        use crate::answer::tests::{events_ending, hermes_answer, CUT};
        for (pieces, whole_calls) in CUT {
            let m = message(hermes_answer(), 0, events_ending(pieces, "length"))
                .await
                .unwrap();
            assert_eq!(m["stop_reason"], "max_tokens", "{m}");
            let content = m["content"].as_array().unwrap();
            assert!(content.iter().all(|b| b["type"] == "tool_use"), "{m}");
            assert_eq!(content.len(), whole_calls, "{m}");
        }
    }
}
