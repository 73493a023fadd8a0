//! The HTTP side: routes, the API key check, request checks, and answers as one JSON object
//! or as server-sent events (`data: {chunk}` … `data: [DONE]`). Generation itself happens
//! on the engine thread; a handler sends it a [`GenRequest`] and relays its [`Event`]s.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, Uri};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::api::{self, Endpoint, Prompt};
use crate::engine::{Event, GenRequest, Status, Usage};
use crate::error::ApiError;
use kvplug::agent_store::check_agent_name;
use kvplug::Sampler;
use kvplug::Text;

/// The header naming an agent session: its K/V stays in the cache between requests, and
/// in its session file when the memory budget needs the room.
pub const SESSION_HEADER: &str = "x-session-id";

/// What every handler shares.
pub struct Shared {
    /// Tokenizer and chat template.
    pub text: Arc<Text>,
    /// To the engine thread.
    pub engine: Sender<GenRequest>,
    /// The model's id in `/v1/models` and in answers.
    pub model_id: String,
    /// Cache capacity in cells: the longest prompt + completion.
    pub capacity: usize,
    /// The `max_tokens` limit, and the default when a request gives none.
    pub max_tokens: usize,
    /// Bearer key required on `/v1/*`, if set.
    pub api_key: Option<String>,
    /// The engine's figures for `/health`.
    pub status: Arc<Mutex<Status>>,
    /// Unix time the server started.
    pub created: u64,
    /// Answer ids and default seeds.
    pub counter: AtomicU64,
}

type AppState = Arc<Shared>;

/// The routes; bodies above `max_body` bytes are refused with 413.
pub fn router(state: AppState, max_body: usize) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(state)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Compares without an early exit, so timing does not reveal how much of a key matched.
fn same_key(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

async fn auth(State(s): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| same_key(g.as_bytes(), key.as_bytes())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(uri.path())
}

async fn health(State(s): State<AppState>) -> Json<Value> {
    let status = s.status.lock().expect("status lock").clone();
    Json(json!({ "status": "ok", "model": s.model_id, "engine": status }))
}

async fn models(State(s): State<AppState>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": s.model_id,
            "object": "model",
            "created": s.created,
            "owned_by": "kvplug",
            "context_length": s.capacity,
        }],
    }))
}

async fn chat(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(s, Endpoint::Chat, &headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn completions(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(s, Endpoint::Completion, &headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// The `max_tokens` to run: the request's, checked against the server's limit and what the
/// capacity leaves after the prompt, else the largest the server allows.
fn max_tokens(s: &Shared, prompt: usize, asked: Option<usize>) -> Result<usize, ApiError> {
    let cap = s.capacity;
    if prompt >= cap {
        return Err(ApiError::too_long(format!(
            "This model's maximum context length is {cap} tokens. However, your prompt is \
             {prompt} tokens, which leaves no room to generate."
        )));
    }
    match asked {
        Some(m) if m > s.max_tokens => Err(ApiError::invalid(
            Some("max_tokens"),
            format!(
                "max_tokens {m} is above this server's limit of {}",
                s.max_tokens
            ),
        )),
        Some(m) if prompt + m > cap => Err(ApiError::too_long(format!(
            "This model's maximum context length is {cap} tokens. However, you requested {} \
             tokens ({prompt} in the prompt, {m} in the completion).",
            prompt + m
        ))),
        Some(m) => Ok(m),
        None => Ok(s.max_tokens.min(cap - prompt)),
    }
}

/// The agent named by the session header, if any.
fn agent_of(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(v) = headers.get(SESSION_HEADER) else {
        return Ok(None);
    };
    let name = v
        .to_str()
        .map_err(|_| ApiError::invalid(None, "X-Session-Id must be ASCII"))?;
    check_agent_name(name).map_err(|e| ApiError::invalid(None, format!("X-Session-Id: {e}")))?;
    Ok(Some(name.to_string()))
}

async fn generate(
    s: AppState,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(|e| ApiError::with_status(e.status(), e.body_text()))?;
    let p = api::parse(endpoint, &body)?;
    let agent = agent_of(headers)?;
    let rendered = match &p.prompt {
        Prompt::Chat(messages) => {
            if !s.text.has_template() {
                return Err(ApiError::invalid(
                    None,
                    "this model has no chat template: use /v1/completions",
                ));
            }
            s.text
                .render(messages)
                .map_err(|e| ApiError::invalid(Some("messages"), format!("{e:#}")))?
        }
        Prompt::Text(t) => t.clone(),
    };
    let prompt = s
        .text
        .encode(&rendered)
        .map_err(|e| ApiError::invalid(None, format!("{e:#}")))?;
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            Some("prompt"),
            "the prompt has no tokens",
        ));
    }
    let max_tokens = max_tokens(&s, prompt.len(), p.max_tokens)?;
    let n = s.counter.fetch_add(1, Ordering::Relaxed);
    let seed = p.seed.unwrap_or_else(|| {
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        t ^ n.rotate_left(32)
    });
    let (tx, mut rx) = unbounded_channel();
    s.engine
        .send(GenRequest {
            prompt,
            max_tokens,
            sampler: Sampler::new(p.temperature, p.top_p, seed),
            stop: p.stop,
            agent,
            events: tx,
        })
        .map_err(|_| ApiError::unavailable("the model has stopped", 5))?;
    let first = rx
        .recv()
        .await
        .ok_or_else(|| ApiError::internal("the engine dropped the request"))?;
    if let Event::Failed(e) = first {
        return Err(e);
    }
    let answer = Answer {
        endpoint,
        id: format!(
            "{}-{n:08x}",
            match endpoint {
                Endpoint::Chat => "chatcmpl",
                Endpoint::Completion => "cmpl",
            }
        ),
        created: unix_now(),
        model: s.model_id.clone(),
        include_usage: p.include_usage,
    };
    if p.stream {
        Ok(stream(answer, first, rx).into_response())
    } else {
        collect(answer, first, rx)
            .await
            .map(|v| Json(v).into_response())
    }
}

/// The answer's fixed fields.
struct Answer {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
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
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": Value::Null,
            "choices": choices,
        })
    }

    /// A streamed chunk: `delta` for chat (`role` opens the answer), `text` for completions.
    fn chunk(&self, text: Option<&str>, role: bool, finish: Option<&str>) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => {
                let mut delta = json!({});
                if role {
                    delta["role"] = json!("assistant");
                }
                if let Some(t) = text {
                    delta["content"] = json!(t);
                }
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
            Endpoint::Completion => json!({
                "index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish
            }),
        };
        self.envelope(true, json!([choice]))
    }

    /// The whole answer.
    fn full(&self, text: String, finish: &str, usage: Usage) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": finish,
            }),
            Endpoint::Completion => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
            }
        };
        let mut v = self.envelope(false, json!([choice]));
        v["usage"] = json!(usage);
        v
    }
}

async fn collect(
    answer: Answer,
    first: Event,
    mut rx: UnboundedReceiver<Event>,
) -> Result<Value, ApiError> {
    let mut text = String::new();
    let mut next = Some(first);
    loop {
        let event = match next.take() {
            Some(e) => Some(e),
            None => rx.recv().await,
        };
        match event {
            Some(Event::Text(t)) => text += &t,
            Some(Event::Done {
                finish_reason,
                usage,
            }) => return Ok(answer.full(text, finish_reason, usage)),
            Some(Event::Failed(e)) => return Err(e),
            None => return Err(ApiError::internal("the engine dropped the request")),
        }
    }
}

/// Server-sent events. Dropping the stream (the client went away) drops `rx`, which tells
/// the engine to release the request's sequence.
fn stream(
    answer: Answer,
    first: Event,
    rx: UnboundedReceiver<Event>,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    struct State {
        answer: Answer,
        rx: UnboundedReceiver<Event>,
        first: Option<Event>,
        out: VecDeque<SseEvent>,
        ended: bool,
    }
    let data = |v: Value| SseEvent::default().data(v.to_string());
    let mut out = VecDeque::new();
    if answer.endpoint == Endpoint::Chat {
        out.push_back(data(answer.chunk(Some(""), true, None)));
    }
    let state = State {
        answer,
        rx,
        first: Some(first),
        out,
        ended: false,
    };
    let events = futures_util::stream::unfold(state, move |mut st| async move {
        loop {
            if let Some(e) = st.out.pop_front() {
                return Some((Ok(e), st));
            }
            if st.ended {
                return None;
            }
            let event = match st.first.take() {
                Some(e) => Some(e),
                None => st.rx.recv().await,
            };
            let a = &st.answer;
            match event {
                Some(Event::Text(t)) => st.out.push_back(data(a.chunk(Some(&t), false, None))),
                Some(Event::Done {
                    finish_reason,
                    usage,
                }) => {
                    let text = (a.endpoint == Endpoint::Completion).then_some("");
                    st.out
                        .push_back(data(a.chunk(text, false, Some(finish_reason))));
                    if a.include_usage {
                        let mut u = a.envelope(true, json!([]));
                        u["usage"] = json!(usage);
                        st.out.push_back(data(u));
                    }
                    st.ended = true;
                }
                Some(Event::Failed(e)) => {
                    st.out.push_back(data(e.body()));
                    st.ended = true;
                }
                None => {
                    let e = ApiError::internal("the engine dropped the request");
                    st.out.push_back(data(e.body()));
                    st.ended = true;
                }
            }
            if st.ended {
                st.out.push_back(SseEvent::default().data("[DONE]"));
            }
        }
    });
    Sse::new(events).keep_alive(KeepAlive::default())
}
