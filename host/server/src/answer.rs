//! Answers in OpenAI's shapes, from the engine's [`Event`]s: one JSON object (`collect`) or
//! server-sent events (`stream`), with `n` choices, log-probabilities, and tool calls parsed
//! from each completion's text. A streamed completion that may be a tool call is held back
//! until it is decided, so its chunks assemble (as the `openai` client assembles
//! `delta.tool_calls`) into exactly the calls the non-streamed answer holds.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use kvplug::tools::{parse, parse_cut, Parsed};
use kvplug::TokenLogprobs;
use kvplug::{Grammars, Text};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::api::Endpoint;
use crate::engine::{CachedTokens, Event, Predictions, Usage};
use crate::error::ApiError;
use crate::request::Calls;
use kvplug::SpecStats;

/// The answer's fixed fields.
pub struct Answer {
    /// Which API.
    pub endpoint: Endpoint,
    /// `chatcmpl-…` or `cmpl-…`.
    pub id: String,
    /// Unix time.
    pub created: u64,
    /// The model's id.
    pub model: String,
    /// A last chunk with `usage` (streaming).
    pub include_usage: bool,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Completions.
    pub n: usize,
    /// The tools the completions may call.
    pub calls: Option<Calls>,
    /// To write tokens as text in log-probabilities.
    pub text: Arc<Text>,
    /// The vocabulary's token bytes, when the model has grammars (else tokens are decoded
    /// one by one, which loses partial UTF-8).
    pub vocab: Option<Grammars>,
    /// `/v1/completions`' `echo`: what each choice starts with.
    pub echo: Option<Echo>,
}

/// An echoed prompt: its text (as the request gave it, ids decoded) and, when the request
/// asked for log-probabilities, its first token (the others' come in [`Event::Prompt`]),
/// whose log-probability is null: nothing comes before it.
pub struct Echo {
    pub text: String,
    pub scored: Option<i32>,
}

/// One completion as it comes in.
#[derive(Default)]
pub struct Choice {
    text: String,
    /// Characters of its text streamed so far.
    sent_chars: usize,
    /// A harmony answer (whose `text` is kept whole): bytes of its parsed reasoning and
    /// content streamed so far.
    sent_parsed: (usize, usize),
    /// An echoed prompt's first token (see [`Echo`]), listed before `logprobs`.
    lead: Option<i32>,
    logprobs: Vec<TokenLogprobs>,
    finish: Option<&'static str>,
    tokens: usize,
    speculation: Option<SpecStats>,
    stop_string: Option<String>,
}

impl Choice {
    /// Why it ended, as OpenAI says it before tool calls are told apart (`stop`, `length`).
    pub fn finish(&self) -> &'static str {
        self.finish.unwrap_or("stop")
    }

    /// Why it ended, as OpenAI says it when its answer holds calls (`called`): `tool_calls`,
    /// unless its token limit cut it (`length`, as OpenAI and llama.cpp say it even after
    /// whole calls: a call may have been cut off).
    pub fn finish_calling(&self, called: bool) -> &'static str {
        match self.finish() {
            "length" => "length",
            _ if called => "tool_calls",
            f => f,
        }
    }

    /// Its generated tokens.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Its tokens' log-probabilities, where the request asked for them.
    pub fn logprobs(&self) -> &[TokenLogprobs] {
        &self.logprobs
    }

    /// The stop string that ended it, when one did.
    pub fn stop_string(&self) -> Option<&str> {
        self.stop_string.as_deref()
    }
}

/// A streamed answer's pieces, before they are shaped into one API's events.
pub enum Chunk {
    /// An OpenAI chunk (`chat.completion.chunk` or `text_completion`).
    Data(Value),
    /// Choice 0 ended (this comes before its finish chunk): why, as the finish chunk says
    /// it (`tool_calls` when it called), the stop string that ended it, and its tokens.
    Ended {
        finish: &'static str,
        stop_string: Option<String>,
        tokens: usize,
    },
    /// The request failed; nothing more follows.
    Failed(ApiError),
}

impl Answer {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completion, _) => "text_completion",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": Value::Null,
            "choices": choices,
        });
        if chunk && self.include_usage {
            // OpenAI's: `usage` on every chunk, null until the last.
            v["usage"] = Value::Null;
        }
        v
    }

    /// The request's usage once `choices` ended.
    fn usage(&self, cached: usize, choices: &[Choice]) -> Usage {
        let completion = choices.iter().map(|c| c.tokens).sum();
        let drafts = choices
            .iter()
            .filter_map(|c| c.speculation)
            .reduce(|mut a, b| {
                a.add(&b);
                a
            });
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: completion,
            total_tokens: self.prompt_tokens + completion,
            prompt_tokens_details: CachedTokens {
                cached_tokens: cached,
            },
            completion_tokens_details: drafts.map(|d| Predictions {
                accepted_prediction_tokens: d.accepted,
                rejected_prediction_tokens: d.drafted - d.accepted,
            }),
        }
    }

    /// [`piece`] of this answer's vocabulary.
    fn piece(&self, id: i32) -> (Vec<u8>, String) {
        piece(self.vocab.as_ref(), &self.text, id)
    }

    /// A completion's name for a token: its text, or where its bytes are no UTF-8 (a piece
    /// of a character) `bytes:` and their escapes, as OpenAI names them (`bytes:\xf0\x9f`),
    /// so two such tokens do not share a name.
    fn token_name(&self, id: i32) -> String {
        let (bytes, text) = self.piece(id);
        match std::str::from_utf8(&bytes) {
            Ok(_) => text,
            Err(_) => bytes.iter().fold("bytes:".to_string(), |mut s, b| {
                s += &format!("\\x{b:02x}");
                s
            }),
        }
    }

    /// Where each of `ids` starts in the text they spell from character `offset` on (a
    /// token that completes a character split across tokens starts where that character
    /// does), and where the text ends.
    fn offsets(&self, ids: impl Iterator<Item = i32>, offset: usize) -> (Vec<usize>, usize) {
        let (mut bytes, mut counted, mut chars) = (Vec::new(), 0, offset);
        let mut starts = Vec::new();
        for id in ids {
            starts.push(chars);
            bytes.extend(self.piece(id).0);
            let whole = bytes.len() - incomplete_tail(&bytes);
            chars += String::from_utf8_lossy(&bytes[counted..whole])
                .chars()
                .count();
            counted = whole;
        }
        chars += String::from_utf8_lossy(&bytes[counted..]).chars().count();
        (starts, chars)
    }

    /// Chat's per-token log-probability entries (`token`, `logprob`, `bytes`,
    /// `top_logprobs`), as chat's `logprobs.content` and the Responses API's `output_text`
    /// carry them.
    pub fn token_logprobs(&self, lps: &[TokenLogprobs]) -> Vec<Value> {
        let entry = |id: i32, lp: f32| {
            let (bytes, token) = self.piece(id);
            json!({"token": token, "logprob": lp, "bytes": bytes})
        };
        lps.iter()
            .map(|l| {
                let mut e = entry(l.token, l.logprob);
                e["top_logprobs"] = l.top.iter().map(|&(t, p)| entry(t, p)).collect();
                e
            })
            .collect()
    }

    /// Log-probabilities in the endpoint's shape, or null when there are none; completions'
    /// `text_offset`s count the tokens' characters from `offset` (the answer's tokens before
    /// these) on, and start with `lead`, an echoed prompt's first token, whose
    /// log-probability and alternatives are null (OpenAI's shape).
    fn logprobs(&self, lead: Option<i32>, lps: &[TokenLogprobs], offset: usize) -> Value {
        if lead.is_none() && lps.is_empty() {
            return Value::Null;
        }
        match self.endpoint {
            Endpoint::Chat => json!({"content": self.token_logprobs(lps), "refusal": null}),
            Endpoint::Completion => {
                let ids = || lead.into_iter().chain(lps.iter().map(|l| l.token));
                let tokens: Vec<String> = ids().map(|id| self.token_name(id)).collect();
                let offsets = self.offsets(ids(), offset).0;
                let null = lead.map(|_| Value::Null);
                let top = |l: &TokenLogprobs| {
                    let mut top = serde_json::Map::new();
                    for &(t, p) in &l.top {
                        // Names may still meet (a special token written as text): the more
                        // likely one, listed first, keeps its value.
                        top.entry(self.token_name(t)).or_insert(json!(p));
                    }
                    Value::Object(top)
                };
                let values = lps.iter().map(|l| json!(l.logprob));
                let token_logprobs: Vec<Value> = null.iter().cloned().chain(values).collect();
                let top_logprobs: Vec<Value> =
                    null.into_iter().chain(lps.iter().map(top)).collect();
                json!({
                    "tokens": tokens,
                    "token_logprobs": token_logprobs,
                    "top_logprobs": top_logprobs,
                    "text_offset": offsets,
                })
            }
        }
    }

    /// Characters of the text the log-probabilities' tokens `lead` and `lps` spell (see
    /// [`logprobs`](Self::logprobs)).
    fn token_chars(&self, lead: Option<i32>, lps: &[TokenLogprobs]) -> usize {
        let ids = lead.into_iter().chain(lps.iter().map(|l| l.token));
        self.offsets(ids, 0).1
    }

    /// Starts `choices` with the echoed prompt's text and first token (its other tokens'
    /// scores lead their log-probabilities already, see [`choices`]).
    fn echo_into(&self, choices: &mut [Choice]) {
        let Some(echo) = &self.echo else { return };
        for c in choices {
            c.text.insert_str(0, &echo.text);
            c.lead = echo.scored;
        }
    }

    /// The streamed answer's first chunks when it echoes its prompt: each choice's at once,
    /// or, when the prompt is scored, once its scores are in ([`Event::Prompt`]).
    fn echo_chunks(&self, choices: &mut [Choice], scores: Option<&[TokenLogprobs]>) -> Vec<Chunk> {
        let Some(echo) = self
            .echo
            .as_ref()
            .filter(|e| e.scored.is_some() == scores.is_some())
        else {
            return Vec::new();
        };
        let scores = scores.unwrap_or_default();
        let mut out = Vec::new();
        for (i, c) in choices.iter_mut().enumerate() {
            let delta = json!({"content": echo.text});
            out.push(Chunk::Data(self.chunk_led(
                i,
                delta,
                echo.scored,
                scores,
                0,
                None,
            )));
            c.sent_chars = match echo.scored {
                // Offsets count the tokens' characters, as the whole answer's do.
                Some(_) => self.token_chars(echo.scored, scores),
                None => echo.text.chars().count(),
            };
        }
        out
    }

    /// Completion `c`'s text split into content, reasoning and tool calls (no tools: all
    /// content, but a harmony model's reasoning). A call block the answer was cut inside is
    /// left out, its markup never content.
    pub fn split(&self, c: &Choice) -> Parsed {
        // Ended on a turn's end: not cut at the token limit or a stop string.
        let complete = c.finish() == "stop" && c.stop_string.is_none();
        if self.text.harmony() {
            return kvplug::harmony::parse(&c.text, self.tools(), complete);
        }
        match &self.calls {
            Some(calls) if complete => parse(&c.text, calls.format, &calls.tools),
            Some(calls) => parse_cut(&c.text, calls.format, &calls.tools),
            None => Parsed {
                content: c.text.clone(),
                ..Parsed::default()
            },
        }
    }

    /// The tools the completions may call (none without `calls`).
    fn tools(&self) -> &[kvplug::tools::Tool] {
        self.calls.as_ref().map_or(&[], |c| &c.tools)
    }

    /// Whether streamed chat text is parsed as it grows (a harmony model's channels) rather
    /// than sent as it comes.
    fn parses_stream(&self) -> bool {
        self.endpoint == Endpoint::Chat && self.text.harmony()
    }

    /// The parts of choice `c`'s parsed answer not streamed yet, as delta chunks of choice
    /// `i` (`reasoning_content`, as llama.cpp and DeepSeek's API name it, then `content`),
    /// the held log-probabilities going with the first.
    fn parsed_deltas(&self, i: usize, c: &mut Choice, parsed: &Parsed, out: &mut VecDeque<Chunk>) {
        let (r, t) = c.sent_parsed;
        for (key, now, sent) in [
            ("reasoning_content", &parsed.reasoning, r),
            ("content", &parsed.content, t),
        ] {
            // Each field only grows (harmony::parse on a prefix gives prefixes).
            let Some(new) = now.get(sent..).filter(|n| !n.is_empty()) else {
                continue;
            };
            let lps = std::mem::take(&mut c.logprobs);
            out.push_back(Chunk::Data(self.chunk(i, json!({key: new}), &lps, 0, None)));
        }
        c.sent_parsed = (parsed.reasoning.len().max(r), parsed.content.len().max(t));
    }

    /// OpenAI's `tool_calls` entries for `parsed`'s calls of choice `i`.
    pub fn tool_calls(&self, i: usize, parsed: &Parsed) -> Vec<Value> {
        parsed
            .calls
            .iter()
            .enumerate()
            .map(|(k, c)| {
                json!({
                    "id": format!("call_{}_{i}_{k}", self.id),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                })
            })
            .collect()
    }

    /// The whole answer.
    fn full(&self, choices: &[Choice], cached: usize) -> Value {
        let list: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let logprobs = self.logprobs(c.lead, &c.logprobs, 0);
                match self.endpoint {
                    Endpoint::Chat => {
                        let parsed = self.split(c);
                        let mut message = json!({"role": "assistant", "content": parsed.content});
                        if !parsed.reasoning.is_empty() {
                            message["reasoning_content"] = json!(parsed.reasoning);
                        }
                        if !parsed.calls.is_empty() {
                            message["tool_calls"] = json!(self.tool_calls(i, &parsed));
                            if parsed.content.is_empty() {
                                message["content"] = Value::Null;
                            }
                        }
                        let finish = c.finish_calling(!parsed.calls.is_empty());
                        json!({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
                    }
                    Endpoint::Completion => json!({
                        "index": i, "text": c.text, "logprobs": logprobs,
                        "finish_reason": c.finish(),
                    }),
                }
            })
            .collect();
        let mut v = self.envelope(false, json!(list));
        v["usage"] = json!(self.usage(cached, choices));
        v
    }

    /// A streamed chunk of choice `i`: `delta` for chat, `text` for completions, with the
    /// log-probabilities of its tokens (`offset`: characters streamed before them).
    fn chunk(
        &self,
        i: usize,
        delta: Value,
        logprobs: &[TokenLogprobs],
        offset: usize,
        finish: Option<&str>,
    ) -> Value {
        self.chunk_led(i, delta, None, logprobs, offset, finish)
    }

    /// [`chunk`](Self::chunk) whose log-probabilities start with `lead` (an echoed prompt's
    /// first token).
    fn chunk_led(
        &self,
        i: usize,
        delta: Value,
        lead: Option<i32>,
        logprobs: &[TokenLogprobs],
        offset: usize,
        finish: Option<&str>,
    ) -> Value {
        let logprobs = self.logprobs(lead, logprobs, offset);
        let choice = match self.endpoint {
            Endpoint::Chat => {
                json!({"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
            Endpoint::Completion => json!({
                "index": i, "text": delta["content"].as_str().unwrap_or(""),
                "logprobs": logprobs, "finish_reason": finish
            }),
        };
        self.envelope(true, json!([choice]))
    }
}

/// Reads events to the end of every completion into one JSON answer.
pub async fn collect(
    answer: Answer,
    cached: usize,
    rx: UnboundedReceiver<Event>,
) -> Result<Value, ApiError> {
    let mut choices = choices(answer.n, rx).await?;
    answer.echo_into(&mut choices);
    Ok(answer.full(&choices, cached))
}

/// Reads events to the end of every one of `n` completions; a scored prompt's scores
/// ([`Event::Prompt`], before any token) lead each one's log-probabilities.
pub async fn choices(n: usize, mut rx: UnboundedReceiver<Event>) -> Result<Vec<Choice>, ApiError> {
    let mut choices: Vec<Choice> = (0..n).map(|_| Choice::default()).collect();
    let mut open = n;
    while open > 0 {
        match rx.recv().await {
            Some(Event::Token {
                choice,
                text,
                logprobs,
            }) => {
                let c = &mut choices[choice];
                c.text += &text;
                c.logprobs.extend(logprobs);
            }
            Some(Event::Done {
                choice,
                finish_reason,
                completion_tokens,
                speculation,
                stop_string,
            }) => {
                let c = &mut choices[choice];
                c.finish = Some(finish_reason);
                c.tokens = completion_tokens;
                c.speculation = speculation;
                c.stop_string = stop_string;
                open -= 1;
            }
            Some(Event::Prompt { logprobs }) => {
                for c in &mut choices {
                    c.logprobs.splice(0..0, logprobs.iter().cloned());
                }
            }
            Some(Event::Admitted { .. }) => {}
            Some(Event::Failed(e)) => return Err(e),
            None => return Err(ApiError::internal("the engine dropped the request")),
        }
    }
    Ok(choices)
}

/// Where in `text` a call opened by `opening` starts or may start (a prefix of it at the end):
/// the text before it can be streamed. `text.len()` when nowhere.
fn call_start(text: &str, opening: &str) -> usize {
    text.char_indices()
        .map(|(i, _)| i)
        .find(|&i| {
            let rest = &text[i..];
            rest.starts_with(opening) || opening.starts_with(rest)
        })
        .unwrap_or(text.len())
}

/// Whether a completion's text so far may still turn out to be a tool call.
fn may_be_call(text: &str) -> bool {
    let t = text.trim_start();
    ["<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "{", "```"]
        .iter()
        .any(|o| t.starts_with(o) || o.starts_with(t))
}

/// A token's bytes and its text (a partial UTF-8 sequence replaced), special tokens written
/// out, from `vocab`'s bytes where the model has grammars, else `text`'s decoding (which
/// loses partial UTF-8).
pub fn piece(vocab: Option<&Grammars>, text: &Text, id: i32) -> (Vec<u8>, String) {
    match vocab {
        Some(v) => {
            let bytes = v.token_bytes(id);
            let text = String::from_utf8_lossy(&bytes).into_owned();
            (bytes, text)
        }
        None => {
            let text = text.piece(id).unwrap_or_default();
            (text.as_bytes().to_vec(), text)
        }
    }
}

/// Bytes at the end of `b` that begin a character not complete yet.
fn incomplete_tail(b: &[u8]) -> usize {
    for back in 1..=b.len().min(3) {
        let lead = b[b.len() - back];
        if lead & 0xc0 != 0x80 {
            let len = match lead {
                0xc0..=0xdf => 2,
                0xe0..=0xef => 3,
                0xf0..=0xf7 => 4,
                _ => 1,
            };
            return if len > back { back } else { 0 };
        }
    }
    0
}

/// One prompt's answer in the making: its fixed fields, the prompt tokens its admission
/// reused, and the engine's events for it.
pub type Part = (Answer, usize, UnboundedReceiver<Event>);

/// Reads several prompts' answers (`/v1/completions`' batch form) into one JSON answer:
/// prompt `i`'s choice `j` is choice `i·n + j`, the usage their sum, the id the first's.
pub async fn collect_all(parts: Vec<Part>) -> Result<Value, ApiError> {
    let mut whole: Option<Value> = None;
    for (i, (answer, cached, rx)) in parts.into_iter().enumerate() {
        let n = answer.n;
        let mut v = collect(answer, cached, rx).await?;
        let Some(w) = whole.as_mut() else {
            whole = Some(v);
            continue;
        };
        for c in v["choices"].as_array_mut().into_iter().flatten() {
            c["index"] = json!(i * n + c["index"].as_u64().unwrap_or(0) as usize);
            w["choices"].as_array_mut().expect("choices").push(c.take());
        }
        add_counts(&mut w["usage"], &v["usage"]);
    }
    whole.ok_or_else(|| ApiError::internal("no prompt to answer"))
}

/// Adds `more`'s counts into `into`'s, field by field (a field only `more` has is copied).
fn add_counts(into: &mut Value, more: &Value) {
    match (into, more) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                match a.get_mut(k) {
                    Some(x) => add_counts(x, v),
                    None => {
                        a.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (a @ Value::Number(_), Value::Number(b)) => {
            *a = json!(a.as_u64().unwrap_or(0) + b.as_u64().unwrap_or(0));
        }
        (a @ Value::Null, b) => *a = b.clone(),
        _ => {}
    }
}

/// OpenAI's server-sent events (`data: {chunk}` … `data: [DONE]`) of one prompt's answer or
/// several's (`/v1/completions`' batch form: their chunks as they come, prompt `i`'s choice
/// `j` numbered `i·n + j`, all under the first's id, one usage chunk last summing theirs).
/// Dropping the stream (the client went away) drops the receivers, which tells the engine
/// to release the requests' sequences.
pub fn stream(
    parts: Vec<Part>,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    use futures_util::StreamExt;
    let data = |v: &Value| Ok(SseEvent::default().data(v.to_string()));
    let id = parts.first().map(|p| p.0.id.clone()).unwrap_or_default();
    let usage = Arc::new(std::sync::Mutex::new(None::<Value>));
    let streams = parts
        .into_iter()
        .enumerate()
        .map(|(i, (answer, cached, rx))| {
            let (n, id, usage) = (answer.n, id.clone(), usage.clone());
            chunks(answer, cached, rx)
                .filter_map(move |c| {
                    let out = match c {
                        Chunk::Data(mut v) => {
                            v["id"] = json!(id);
                            let none = v["choices"].as_array().is_some_and(Vec::is_empty);
                            if none && !v["usage"].is_null() {
                                // The usage chunk: one, last, for the whole answer.
                                let mut sum = usage.lock().expect("usage lock");
                                match sum.as_mut() {
                                    Some(s) => add_counts(&mut s["usage"], &v["usage"]),
                                    None => *sum = Some(v),
                                }
                                None
                            } else {
                                for c in v["choices"].as_array_mut().into_iter().flatten() {
                                    let j = c["index"].as_u64().unwrap_or(0) as usize;
                                    c["index"] = json!(i * n + j);
                                }
                                Some(data(&v))
                            }
                        }
                        Chunk::Failed(e) => Some(data(&e.body())),
                        Chunk::Ended { .. } => None,
                    };
                    async move { out }
                })
                .boxed()
        })
        .collect::<Vec<_>>();
    let last = futures_util::stream::once(async move { usage.lock().expect("usage lock").take() })
        .filter_map(move |u| async move { u.map(|u| data(&u)) });
    let events =
        futures_util::stream::select_all(streams)
            .chain(last)
            .chain(futures_util::stream::once(async {
                Ok(SseEvent::default().data("[DONE]"))
            }));
    Sse::new(events).keep_alive(KeepAlive::default())
}

/// The pieces of a streamed answer, as the engine's events come in (see [`Chunk`]).
pub fn chunks(
    answer: Answer,
    cached: usize,
    rx: UnboundedReceiver<Event>,
) -> impl futures_util::Stream<Item = Chunk> {
    struct State {
        answer: Answer,
        cached: usize,
        rx: UnboundedReceiver<Event>,
        choices: Vec<Choice>,
        /// Per choice: text is held back (it may be a tool call).
        holding: Vec<bool>,
        open: usize,
        out: VecDeque<Chunk>,
        ended: bool,
    }
    let data = Chunk::Data;
    let mut out = VecDeque::new();
    if answer.endpoint == Endpoint::Chat {
        for i in 0..answer.n {
            out.push_back(data(answer.chunk(
                i,
                json!({"role": "assistant", "content": ""}),
                &[],
                0,
                None,
            )));
        }
    }
    let holding = vec![answer.calls.is_some(); answer.n];
    let mut choices: Vec<Choice> = (0..answer.n).map(|_| Choice::default()).collect();
    out.extend(answer.echo_chunks(&mut choices, None));
    let state = State {
        choices,
        open: answer.n,
        answer,
        cached,
        rx,
        holding,
        out,
        ended: false,
    };
    futures_util::stream::unfold(state, move |mut st| async move {
        loop {
            if let Some(e) = st.out.pop_front() {
                return Some((e, st));
            }
            if st.ended {
                return None;
            }
            let a = &st.answer;
            match st.rx.recv().await {
                Some(Event::Token {
                    choice: i,
                    text,
                    logprobs,
                }) => {
                    let c = &mut st.choices[i];
                    c.text += &text;
                    c.logprobs.extend(logprobs);
                    if a.parses_stream() {
                        // Reasoning and content as they grow; calls at the end.
                        let parsed = kvplug::harmony::parse(&c.text, a.tools(), false);
                        a.parsed_deltas(i, c, &parsed, &mut st.out);
                        continue;
                    }
                    if st.holding[i] && !may_be_call(&c.text) {
                        // Not a call at the start: the text goes out as it comes.
                        st.holding[i] = false;
                    }
                    if !st.holding[i] {
                        // All of it but what may open a call later in the answer (the
                        // template's tag), which is held until it can be told apart.
                        let opening = a.calls.as_ref().and_then(|c| c.format.opening());
                        let held = opening.map_or(c.text.len(), |o| call_start(&c.text, o));
                        if held > 0 {
                            let rest = c.text.split_off(held);
                            let sent = std::mem::replace(&mut c.text, rest);
                            let lps = std::mem::take(&mut c.logprobs);
                            let offset = c.sent_chars;
                            c.sent_chars += sent.chars().count();
                            st.out.push_back(data(a.chunk(
                                i,
                                json!({"content": sent}),
                                &lps,
                                offset,
                                None,
                            )));
                        }
                    }
                }
                Some(Event::Done {
                    choice: i,
                    finish_reason,
                    completion_tokens,
                    speculation,
                    stop_string,
                }) => {
                    let c = &mut st.choices[i];
                    c.finish = Some(finish_reason);
                    c.tokens = completion_tokens;
                    c.speculation = speculation;
                    c.stop_string = stop_string;
                    let mut finish = finish_reason;
                    if a.parses_stream() {
                        let parsed = a.split(c);
                        a.parsed_deltas(i, c, &parsed, &mut st.out);
                        for (k, call) in a.tool_calls(i, &parsed).into_iter().enumerate() {
                            st.out
                                .extend(call_chunks(a, i, k, call, &mut c.logprobs, 0));
                        }
                        if !c.logprobs.is_empty() {
                            // Tokens that added no text (markers, trailing space, the end).
                            let lps = std::mem::take(&mut c.logprobs);
                            let empty = a.chunk(i, json!({"content": ""}), &lps, 0, None);
                            st.out.push_back(data(empty));
                        }
                        finish = c.finish_calling(!parsed.calls.is_empty());
                    } else if !c.text.is_empty() {
                        let parsed = a.split(c);
                        // The held tokens' log-probabilities go with the first chunk.
                        let mut lps = std::mem::take(&mut c.logprobs);
                        let offset = c.sent_chars;
                        if !parsed.content.is_empty() || parsed.calls.is_empty() {
                            st.out.push_back(data(a.chunk(
                                i,
                                json!({"content": parsed.content}),
                                &std::mem::take(&mut lps),
                                offset,
                                None,
                            )));
                        }
                        for (k, call) in a.tool_calls(i, &parsed).into_iter().enumerate() {
                            st.out.extend(call_chunks(a, i, k, call, &mut lps, offset));
                        }
                        finish = c.finish_calling(!parsed.calls.is_empty());
                    } else if !c.logprobs.is_empty() {
                        // Tokens that added no text at the end (an end-of-turn token under
                        // ignore_eos), as the whole answer lists them.
                        let lps = std::mem::take(&mut c.logprobs);
                        let empty = a.chunk(i, json!({"content": ""}), &lps, c.sent_chars, None);
                        st.out.push_back(data(empty));
                    }
                    let delta = match a.endpoint {
                        Endpoint::Chat => json!({}),
                        Endpoint::Completion => json!({"content": ""}),
                    };
                    let c = &st.choices[i];
                    st.out.push_back(Chunk::Ended {
                        finish,
                        stop_string: c.stop_string.clone(),
                        tokens: c.tokens,
                    });
                    st.out
                        .push_back(data(a.chunk(i, delta, &[], 0, Some(finish))));
                    st.open -= 1;
                    if st.open == 0 {
                        if a.include_usage {
                            let mut u = a.envelope(true, json!([]));
                            u["usage"] = json!(a.usage(st.cached, &st.choices));
                            st.out.push_back(data(u));
                        }
                        st.ended = true;
                    }
                }
                Some(Event::Prompt { logprobs }) => {
                    let echoed = a.echo_chunks(&mut st.choices, Some(&logprobs));
                    st.out.extend(echoed);
                }
                Some(Event::Admitted { .. }) => {}
                Some(Event::Failed(e)) => {
                    st.out.push_back(Chunk::Failed(e));
                    st.ended = true;
                }
                None => {
                    let e = ApiError::internal("the engine dropped the request");
                    st.out.push_back(Chunk::Failed(e));
                    st.ended = true;
                }
            }
        }
    })
}

/// Call `k` of choice `i` as two chunks (as OpenAI streams one): its id and name, then its
/// arguments; `lps` (held log-probabilities, at character `offset`) go with the first.
fn call_chunks(
    a: &Answer,
    i: usize,
    k: usize,
    call: Value,
    lps: &mut Vec<TokenLogprobs>,
    offset: usize,
) -> [Chunk; 2] {
    let mut head = call.clone();
    head["index"] = json!(k);
    head["function"]["arguments"] = json!("");
    let args = json!({"index": k, "function": {"arguments": call["function"]["arguments"]}});
    [
        Chunk::Data(a.chunk(
            i,
            json!({"tool_calls": [head]}),
            &std::mem::take(lps),
            offset,
            None,
        )),
        Chunk::Data(a.chunk(i, json!({"tool_calls": [args]}), &[], 0, None)),
    ]
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::request::Calls;
    use kvplug::tools::{Tool, ToolFormat};
    use tokio::sync::mpsc::unbounded_channel;

    /// A harmony model's text: harmony's markers in the vocabulary (special tokens, ids
    /// 1..=6) and a template that writes them.
    pub(crate) fn harmony_text() -> Arc<Text> {
        text_of("{{ '<|start|>assistant<|channel|>final<|message|>' }}")
    }

    /// A text with harmony's markers in its vocabulary (special tokens, ids 1..=6), the
    /// words of [`WORDS`] after them, and the chat template `template`.
    fn text_of(template: &str) -> Arc<Text> {
        static MADE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let k = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kvplug-harmony-{}-{k}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let specials = [
            "<|start|>",
            "<|channel|>",
            "<|message|>",
            "<|end|>",
            "<|call|>",
            "<|return|>",
        ];
        let mut vocab = serde_json::Map::from_iter([("[UNK]".to_string(), json!(0))]);
        for (id, w) in (specials.len() + 1..).zip(WORDS) {
            vocab.insert(w.into(), json!(id));
        }
        let added: Vec<Value> = (1..)
            .zip(specials)
            .map(|(id, t)| {
                vocab.insert(t.into(), json!(id));
                json!({"id": id, "content": t, "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        let tokenizer = json!({"version": "1.0", "truncation": null, "padding": null,
            "added_tokens": added, "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}});
        std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
        let config = json!({"chat_template": template, "eos_token": "<|return|>"});
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        let text = Text::load(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        Arc::new(text)
    }

    /// Plain words in [`text_of`]'s vocabulary, ids 7 on.
    pub(crate) const WORDS: [&str; 2] = ["Hel", "lo"];

    fn harmony_answer(tools: bool) -> Answer {
        let text = harmony_text();
        let calls = tools.then(|| Calls {
            tools: vec![Tool {
                name: "get_weather".into(),
                description: None,
                parameters: json!({"type": "object"}),
            }],
            format: ToolFormat::of_template(text.template().unwrap()),
            doubled_braces: false,
        });
        Answer {
            endpoint: Endpoint::Chat,
            id: "chatcmpl-t".into(),
            created: 0,
            model: "gpt-oss".into(),
            include_usage: false,
            prompt_tokens: 1,
            n: 1,
            calls,
            text,
            vocab: None,
            echo: None,
        }
    }

    /// The engine's events for an answer of `pieces` (as the generator releases them: it
    /// stops on `<|call|>` or `<|return|>`, which are not in the text).
    fn events(pieces: &[&str]) -> UnboundedReceiver<Event> {
        events_ending(pieces, "stop")
    }

    /// [`events`] ending for `finish_reason`.
    pub(crate) fn events_ending(
        pieces: &[&str],
        finish_reason: &'static str,
    ) -> UnboundedReceiver<Event> {
        let (tx, rx) = unbounded_channel();
        for p in pieces {
            let text = p.to_string();
            tx.send(Event::Token {
                choice: 0,
                text,
                logprobs: Vec::new(),
            })
            .unwrap();
        }
        tx.send(Event::Done {
            choice: 0,
            finish_reason,
            completion_tokens: pieces.len() + 1,
            speculation: None,
            stop_string: None,
        })
        .unwrap();
        rx
    }

    const CALL: [&str; 12] = [
        "<|channel|>",
        "analysis",
        "<|message|>",
        "Need the weather.",
        "<|end|>",
        "<|start|>",
        "assistant",
        "<|channel|>",
        "commentary to=functions.get_weather <|constrain|>json",
        "<|message|>",
        "{\"city\": ",
        "\"Paris\"}",
    ];
    const FINAL: [&str; 10] = [
        "<|channel|>",
        "analysis",
        "<|message|>",
        "Easy.",
        "<|end|>",
        "<|start|>",
        "assistant<|channel|>final",
        "<|message|>",
        "It is ",
        "sunny.",
    ];

    #[test]
    fn a_harmony_vocabulary_stops_on_its_turn_ends_not_on_end() {
        let stops: Vec<i32> = harmony_text().stop_tokens().iter().copied().collect();
        assert_eq!(stops, [5, 6], "<|call|> and <|return|>, not <|end|> (4)");
    }

    #[tokio::test]
    async fn a_harmony_answer_has_reasoning_content_and_calls() {
        let v = collect(harmony_answer(true), 0, events(&CALL))
            .await
            .unwrap();
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
        let m = &choice["message"];
        assert_eq!(m["reasoning_content"], "Need the weather.");
        assert_eq!(m["content"], Value::Null);
        assert_eq!(m["tool_calls"][0]["function"]["name"], "get_weather");
        assert_eq!(
            m["tool_calls"][0]["function"]["arguments"],
            r#"{"city":"Paris"}"#
        );
        // Cut at the token limit inside the call: no call, the finish says so.
        let cut = events_ending(&CALL[..11], "length");
        let v = collect(harmony_answer(true), 0, cut).await.unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
        assert_eq!(v["choices"][0]["message"]["tool_calls"], Value::Null, "{v}");
        let v = collect(harmony_answer(false), 0, events(&FINAL))
            .await
            .unwrap();
        let m = &v["choices"][0]["message"];
        assert_eq!(
            (m["reasoning_content"].as_str(), m["content"].as_str()),
            (Some("Easy."), Some("It is sunny."))
        );
    }

    #[tokio::test]
    async fn a_streamed_harmony_answer_assembles_into_the_whole() {
        use futures_util::StreamExt;
        for (pieces, tools) in [(&CALL[..], true), (&FINAL[..], false)] {
            let whole = collect(harmony_answer(tools), 0, events(pieces))
                .await
                .unwrap();
            let whole = &whole["choices"][0]["message"];
            let chunks: Vec<Chunk> = chunks(harmony_answer(tools), 0, events(pieces))
                .collect()
                .await;
            let (mut reasoning, mut content, mut args, mut calls) =
                (String::new(), String::new(), String::new(), 0);
            let mut deltas = 0;
            for c in &chunks {
                let Chunk::Data(v) = c else { continue };
                let d = &v["choices"][0]["delta"];
                reasoning += d["reasoning_content"].as_str().unwrap_or_default();
                content += d["content"].as_str().unwrap_or_default();
                if let Some(call) = d["tool_calls"].get(0) {
                    calls += usize::from(call["id"].is_string());
                    args += call["function"]["arguments"].as_str().unwrap_or_default();
                }
                deltas += usize::from(d["reasoning_content"].is_string());
            }
            assert_eq!(reasoning, whole["reasoning_content"].as_str().unwrap());
            assert_eq!(content, whole["content"].as_str().unwrap_or_default());
            assert_eq!(calls, whole["tool_calls"].as_array().map_or(0, Vec::len));
            assert_eq!(
                args,
                whole["tool_calls"][0]["function"]["arguments"]
                    .as_str()
                    .unwrap_or_default()
            );
            assert!(deltas >= 1, "reasoning streamed as it came");
            assert!(!content.contains("<|"), "{content}");
        }
    }

    /// An answer of a Hermes-family model (Qwen2.5's tags) that may call two tools.
    pub(crate) fn hermes_answer() -> Answer {
        let tool = |name: &str| Tool {
            name: name.into(),
            description: None,
            parameters: json!({"type": "object"}),
        };
        Answer {
            calls: Some(Calls {
                tools: vec![tool("get_weather"), tool("get_time")],
                format: ToolFormat::Hermes,
                doubled_braces: false,
            }),
            text: text_of("{{ '<|im_start|>assistant\\n<tool_call>' }}"),
            ..harmony_answer(false)
        }
    }

    /// A whole Hermes call.
    pub(crate) const WHOLE_CALL: &str =
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

    /// Hermes answers their token limit cut: after a whole call, inside a second; inside the
    /// first. With the whole calls each has.
    pub(crate) const CUT: [(&[&str], usize); 2] = [
        (&[WHOLE_CALL, "\n<tool_call>\n{\"name\": \"get_ti"], 1),
        (&["<tool_call>\n{\"name\": \"get_weather\", \""], 0),
    ];

    #[tokio::test]
    async fn streamed_logprobs_are_those_of_the_whole_answer() {
        use futures_util::StreamExt;
        // The last token adds no text (an end-of-turn token under ignore_eos).
        let answer = || Answer {
            calls: None,
            ..hermes_answer()
        };
        let events = || {
            let (tx, rx) = unbounded_channel();
            for (text, token) in [("Hel", 7), ("lo", 8), ("", 6)] {
                let logprobs = vec![TokenLogprobs {
                    token,
                    logprob: -0.5,
                    top: Vec::new(),
                }];
                tx.send(Event::Token {
                    choice: 0,
                    text: text.into(),
                    logprobs,
                })
                .unwrap();
            }
            tx.send(Event::Done {
                choice: 0,
                finish_reason: "length",
                completion_tokens: 3,
                speculation: None,
                stop_string: None,
            })
            .unwrap();
            rx
        };
        let entries = |v: &Value| {
            v["choices"][0]["logprobs"]["content"]
                .as_array()
                .map_or(0, Vec::len)
        };
        let whole = collect(answer(), 0, events()).await.unwrap();
        let chunks: Vec<Chunk> = chunks(answer(), 0, events()).collect().await;
        let streamed: usize = chunks
            .iter()
            .map(|c| match c {
                Chunk::Data(v) => entries(v),
                _ => 0,
            })
            .sum();
        assert_eq!((entries(&whole), streamed), (3, 3));
    }

    #[tokio::test]
    async fn an_answer_cut_in_a_call_says_length_and_shows_no_call_markup() {
        use futures_util::StreamExt;
        let v = collect(hermes_answer(), 0, events(&[WHOLE_CALL]))
            .await
            .unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
        for (pieces, whole_calls) in CUT {
            let v = collect(hermes_answer(), 0, events_ending(pieces, "length"))
                .await
                .unwrap();
            let (choice, m) = (&v["choices"][0], &v["choices"][0]["message"]);
            assert_eq!(choice["finish_reason"], "length", "{v}");
            let calls = m["tool_calls"].as_array().map_or(0, Vec::len);
            assert_eq!(calls, whole_calls, "{v}");
            assert_eq!(m["content"].as_str().unwrap_or_default(), "", "{v}");
            let chunks: Vec<Chunk> = chunks(hermes_answer(), 0, events_ending(pieces, "length"))
                .collect()
                .await;
            let (mut content, mut calls, mut finish) = (String::new(), 0, Value::Null);
            for c in &chunks {
                let Chunk::Data(v) = c else { continue };
                let choice = &v["choices"][0];
                content += choice["delta"]["content"].as_str().unwrap_or_default();
                calls += usize::from(choice["delta"]["tool_calls"][0]["id"].is_string());
                if !choice["finish_reason"].is_null() {
                    finish = choice["finish_reason"].clone();
                }
            }
            assert_eq!((content.as_str(), calls), ("", whole_calls));
            assert_eq!(finish, "length");
        }
    }

    #[test]
    fn text_before_a_possible_call_opening_can_be_streamed() {
        let o = "<tool_call>";
        assert_eq!(call_start("Let me check.", o), 13);
        assert_eq!(call_start("Let me check.\n<tool_call>{", o), 14);
        assert_eq!(call_start("a <b", o), 4, "'<b' cannot open it");
        assert_eq!(call_start("Let me <tool", o), 7, "may open it");
        assert_eq!(call_start("é<", o), 2);
        assert_eq!(call_start("", o), 0);
    }
}
