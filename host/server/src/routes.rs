//! The HTTP side: routes, the API key check, request checks, and answers as one JSON object
//! or as server-sent events (`data: {chunk}` … `data: [DONE]`). Generation itself happens
//! on the engine thread; a handler sends it a [`GenRequest`] and relays its [`Event`]s.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tower_http::timeout::{RequestBodyTimeoutLayer, TimeoutError};

use crate::answer::{collect_all, piece, stream, Answer, Echo};
use crate::api::{self, Endpoint, Params, Prompt};
use crate::engine::{Event, GenRequest, Status};
use crate::error::ApiError;
use crate::messages;
use crate::metrics::Metrics;
use crate::request::{prepare, render, BatchGrammar, Model};
use crate::responses;
use kvplug::ascii_escaped;
use kvplug::check_agent_name;
use kvplug::Divergence;
use kvplug::{Grammars, Text};

/// The header naming an agent session: its K/V stays in the cache between requests, and
/// in its session file when the memory budget needs the room.
pub const SESSION_HEADER: &str = "x-session-id";

/// What every handler shares.
pub struct Shared {
    /// Tokenizer and chat template.
    pub text: Arc<Text>,
    /// Token ids the model reads.
    pub vocab: usize,
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
    /// This process's part of answer ids (hex).
    pub instance: String,
    /// Whether answers carry the `x-kvplug-prefix` header.
    pub prefix_header: bool,
    /// Stored responses, for `previous_response_id`.
    pub responses: Arc<responses::Store>,
    /// Constrained decoding over the model's vocabulary, or why it is not available.
    pub grammars: Result<Grammars, String>,
    /// What `/metrics` shows.
    pub metrics: Arc<Metrics>,
}

type AppState = Arc<Shared>;

impl Shared {
    /// What preparing a request needs of the server.
    fn request_model(&self) -> Model<'_> {
        Model {
            text: &self.text,
            vocab: self.vocab,
            grammars: &self.grammars,
            capacity: self.capacity,
            max_tokens: self.max_tokens,
        }
    }
}

/// The routes; bodies above `max_body` bytes are refused with 413 (at once where the
/// `Content-Length` header declares one, before `100 Continue` invites it), and one whose
/// bytes stop arriving for `body_timeout` with 408.
pub fn router(state: AppState, max_body: usize, body_timeout: Duration) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(openai_responses))
        .route(
            "/v1/responses/{id}",
            get(stored_response).delete(delete_response),
        )
        .route("/v1/responses/{id}/input_items", get(response_input_items))
        .route("/v1/messages", post(anthropic_messages))
        .route("/v1/messages/count_tokens", post(anthropic_count_tokens))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn(move |req: Request, next: Next| {
            declared_size(max_body, req, next)
        }))
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(middleware::from_fn_with_state(state.clone(), count))
        .layer(DefaultBodyLimit::max(max_body))
        .layer(RequestBodyTimeoutLayer::new(body_timeout))
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

/// Checks the key on `/v1/*` (a path that is no route included, so that a client without
/// the key learns nothing of the routes): `Authorization: Bearer KEY` (OpenAI's clients; the
/// scheme's case is free, as HTTP's schemes are) or `x-api-key: KEY` (Anthropic's).
async fn auth(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    if let Some(key) = s
        .api_key
        .as_ref()
        .filter(|_| path == "/v1" || path.starts_with("/v1/"))
    {
        let headers = req.headers();
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                let (scheme, key) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then_some(key)
            })
            .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()));
        if !given.is_some_and(|g| same_key(g.as_bytes(), key.as_bytes())) {
            return in_dialect(req.uri(), ApiError::unauthorized());
        }
    }
    next.run(req).await
}

/// Refuses with 413 a request whose `Content-Length` is above `max_body`, before its body is
/// read: a client is not invited to upload what would be refused (one that sends no length
/// is cut off by the body limit as its bytes arrive).
async fn declared_size(max_body: usize, req: Request, next: Next) -> Response {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    match declared {
        Some(n) if n > max_body as u64 => in_dialect(
            req.uri(),
            ApiError::with_status(
                axum::http::StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "the request body is {n} bytes, past the length limit of {max_body} (--max-body)"
                ),
            ),
        ),
        _ => next.run(req).await,
    }
}

/// Counts every answer by status for `/metrics`.
async fn count(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let response = next.run(req).await;
    s.metrics.response(response.status().as_u16());
    response
}

async fn metrics(State(s): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}

/// `e` in the shape of the API `uri` belongs to: Anthropic's under `/v1/messages`, else
/// OpenAI's.
fn in_dialect(uri: &Uri, e: ApiError) -> Response {
    let path = uri.path();
    match path == "/v1/messages" || path.starts_with("/v1/messages/") {
        true => messages::error_response(e),
        false => e.into_response(),
    }
}

async fn not_found(uri: Uri) -> Response {
    in_dialect(&uri, ApiError::not_found(uri.path()))
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    in_dialect(
        &uri,
        ApiError::method_not_allowed(method.as_str(), uri.path()),
    )
}

async fn health(State(s): State<AppState>) -> Json<Value> {
    let status = s.status.lock().expect("status lock").clone();
    Json(json!({ "status": "ok", "model": s.model_id, "engine": status }))
}

fn model_object(s: &Shared) -> Value {
    json!({
        "id": s.model_id,
        "object": "model",
        "created": s.created,
        "owned_by": "kvplug",
        "context_length": s.capacity,
    })
}

async fn models(State(s): State<AppState>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&s)]}))
}

async fn model(State(s): State<AppState>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    if id == s.model_id {
        Ok(Json(model_object(&s)))
    } else {
        Err(ApiError::not_found_model(&id))
    }
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

/// A request's body, or why it could not be read (413 past the size limit, 408 when its
/// bytes stopped arriving for the body timeout).
fn body_of(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        let mut cause: Option<&dyn std::error::Error> = Some(&e);
        while let Some(c) = cause {
            if c.is::<TimeoutError>() {
                return ApiError::with_status(
                    axum::http::StatusCode::REQUEST_TIMEOUT,
                    "the request body stopped arriving",
                );
            }
            cause = c.source();
        }
        ApiError::with_status(e.status(), e.body_text())
    })
}

/// The header telling where a prompt's reuse ended (JSON, non-ASCII escaped).
pub const PREFIX_HEADER: &str = "x-kvplug-prefix";

/// A request the engine admitted: what its answer is built from.
struct Admitted {
    answer: Answer,
    cached: usize,
    rx: UnboundedReceiver<Event>,
    divergence: Option<Divergence>,
    stream: bool,
}

/// Prepares `p` (the template, tokens and grammars, off the runtime's few workers; a batch's
/// prompts share `batch`'s grammar), hands it to the engine and waits for its admission; the
/// answer's id starts with `id_prefix`.
async fn admit(
    s: &AppState,
    endpoint: Endpoint,
    headers: &HeaderMap,
    p: Params,
    arrived: Instant,
    id_prefix: &str,
    batch: Option<Arc<BatchGrammar>>,
) -> Result<Admitted, ApiError> {
    let agent = agent_of(headers)?;
    if agent.is_some() && p.n > 1 {
        return Err(ApiError::invalid(
            Some("n"),
            "an agent session (X-Session-Id) continues one completion: n must be 1",
        ));
    }
    if agent.is_some() && p.echo && p.logprobs.is_some() {
        return Err(ApiError::invalid(
            Some("echo"),
            "'echo' with 'logprobs' scores the whole prompt, which an agent session \
             (X-Session-Id) reuses: send it without the session",
        ));
    }
    let n = s.counter.fetch_add(1, Ordering::Relaxed);
    let seed = {
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        t ^ n.rotate_left(32)
    };
    let shared = s.clone();
    let (prepared, echo, p) = tokio::task::spawn_blocking(move || {
        let prepared = prepare(&shared.request_model(), &p, seed, batch.as_deref())?;
        let echo = echo(&shared, &p, &prepared.prompt);
        Ok::<_, ApiError>((prepared, echo, p))
    })
    .await
    .map_err(|e| ApiError::internal(format!("preparing the request: {e}")))??;
    let prompt_tokens = prepared.prompt.len();
    let (tx, mut rx) = unbounded_channel();
    s.engine
        .send(GenRequest {
            prompt: prepared.prompt,
            opts: prepared.opts,
            n: p.n,
            agent,
            events: tx,
            arrived,
            speculative: p.speculative,
        })
        .map_err(|_| ApiError::unavailable("the model has stopped", 5))?;
    let first = rx
        .recv()
        .await
        .ok_or_else(|| ApiError::internal("the engine dropped the request"))?;
    let (cached, divergence) = match first {
        Event::Admitted {
            cached_tokens,
            divergence,
        } => (cached_tokens, divergence),
        Event::Failed(e) => return Err(e),
        _ => return Err(ApiError::internal("the engine answered out of order")),
    };
    let answer = Answer {
        endpoint,
        id: format!("{id_prefix}{}{n:08x}", s.instance),
        created: unix_now(),
        model: s.model_id.clone(),
        include_usage: p.include_usage,
        prompt_tokens,
        n: p.n,
        calls: prepared.calls,
        text: s.text.clone(),
        vocab: s.grammars.as_ref().ok().cloned(),
        echo,
    };
    Ok(Admitted {
        answer,
        cached,
        rx,
        divergence,
        stream: p.stream,
    })
}

/// What a completion echoing its prompt (`p.echo`) starts with: the prompt's text as it came,
/// or token ids as their pieces spell them (special tokens written out, as in its
/// log-probabilities' tokens).
fn echo(s: &Shared, p: &Params, prompt: &[i32]) -> Option<Echo> {
    let text = match &p.prompt {
        _ if !p.echo => return None,
        Prompt::Text(t) => t.clone(),
        _ => {
            let vocab = s.grammars.as_ref().ok();
            let bytes: Vec<u8> = prompt
                .iter()
                .flat_map(|&id| piece(vocab, &s.text, id).0)
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
    };
    let scored = p.logprobs.map(|_| prompt[0]);
    Some(Echo { text, scored })
}

/// `response` with the `x-kvplug-prefix` header saying where the prompt departed from the
/// cache, when the server shows it.
fn with_prefix_header(
    s: &Shared,
    mut response: Response,
    divergence: Option<Divergence>,
) -> Response {
    if let Some(d) = divergence.filter(|_| s.prefix_header) {
        let mut d = serde_json::to_value(&d).unwrap_or_default();
        let piece = |v: &Value| v.as_i64().and_then(|t| s.text.piece(t as i32).ok());
        d["cached_next_text"] = json!(piece(&d["cached_next"]));
        d["prompt_next_text"] = json!(piece(&d["prompt_next"]));
        // Control characters are escaped by serde_json already.
        if let Ok(v) = HeaderValue::from_str(&ascii_escaped(&d.to_string())) {
            response.headers_mut().insert(PREFIX_HEADER, v);
        }
    }
    response
}

async fn generate(
    s: AppState,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let body = body_of(body)?;
    let mut p = api::parse(endpoint, &body)?;
    let id_prefix = match endpoint {
        Endpoint::Chat => "chatcmpl-",
        Endpoint::Completion => "cmpl-",
    };
    let more = std::mem::take(&mut p.more_prompts);
    if !more.is_empty() && headers.contains_key(SESSION_HEADER) {
        return Err(ApiError::invalid(
            Some("prompt"),
            "an agent session (X-Session-Id) continues one prompt: send one",
        ));
    }
    // The batch form: every prompt admitted as a request of its own (all or none).
    let params: Vec<Params> = std::iter::once(p.prompt.clone())
        .chain(more)
        .map(|prompt| Params {
            prompt,
            ..p.clone()
        })
        .collect();
    let batch = params.len() > 1;
    let grammar = batch.then(|| Arc::new(BatchGrammar::new()));
    let admits = params.into_iter().enumerate().map(|(i, p)| {
        let admitted = admit(
            &s,
            endpoint,
            headers,
            p,
            arrived,
            id_prefix,
            grammar.clone(),
        );
        async move {
            admitted.await.map_err(|mut e| {
                if batch {
                    e.message = format!("prompt {i}: {}", e.message);
                }
                e
            })
        }
    });
    let admitted = futures_util::future::try_join_all(admits).await?;
    let divergence = admitted[0].divergence.clone();
    let parts: Vec<_> = admitted
        .into_iter()
        .map(|a| (a.answer, a.cached, a.rx))
        .collect();
    let response = if p.stream {
        stream(parts).into_response()
    } else {
        Json(collect_all(parts).await?).into_response()
    };
    Ok(with_prefix_header(&s, response, divergence))
}

/// `POST /v1/responses`: OpenAI's Responses API.
async fn openai_responses(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let body = body_of(body)?;
    let r = responses::parse(&body, &s.responses)?;
    let mut a = admit(
        &s,
        Endpoint::Chat,
        &headers,
        r.params.clone(),
        arrived,
        "resp_",
        None,
    )
    .await?;
    // Stored responses are continued by id alone: not one another client could guess.
    a.answer.id = responses::unguessable_id();
    let store = s.responses.clone();
    let response = if a.stream {
        responses::stream(a.answer, r, store, a.cached, a.rx).into_response()
    } else {
        Json(responses::whole(a.answer, r, store, a.cached, a.rx).await?).into_response()
    };
    Ok(with_prefix_header(&s, response, a.divergence))
}

/// `GET /v1/responses/{id}`: a stored response, as it was answered (as JSON: replaying its
/// stream, `?stream=true`, is refused).
async fn stored_response(
    State(s): State<AppState>,
    Path(id): Path<String>,
    Query(query): Query<Vec<(String, String)>>,
) -> Result<Json<Value>, ApiError> {
    // Any `stream` but an explicit false asks for events.
    let streamed = query
        .iter()
        .any(|(k, v)| k == "stream" && v != "false" && v != "0");
    if streamed {
        return Err(ApiError::invalid(
            Some("stream"),
            "a stored response is returned whole: replaying its stream is not supported",
        ));
    }
    match s.responses.response(&id) {
        Some(v) => Ok(Json(Value::clone(&v))),
        None => Err(ApiError::not_found_response(&id)),
    }
}

/// `GET /v1/responses/{id}/input_items`: the items a stored response answered, a page at a
/// time.
async fn response_input_items(
    State(s): State<AppState>,
    Path(id): Path<String>,
    Query(query): Query<Vec<(String, String)>>,
) -> Result<Json<Value>, ApiError> {
    let items = s
        .responses
        .input_items(&id)
        .ok_or_else(|| ApiError::not_found_response(&id))?;
    responses::input_items_page(items, &query).map(Json)
}

/// `DELETE /v1/responses/{id}`: forgets a stored response (a later `previous_response_id`
/// naming it is refused).
async fn delete_response(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    if s.responses.remove(&id) {
        Ok(Json(
            json!({"id": id, "object": "response", "deleted": true}),
        ))
    } else {
        Err(ApiError::not_found_response(&id))
    }
}

/// `POST /v1/messages`: Anthropic's Messages API (errors in its shape).
async fn anthropic_messages(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrived = Instant::now();
    let answered = async {
        let body = body_of(body)?;
        let p = messages::parse(&body, false)?;
        let a = admit(&s, Endpoint::Chat, &headers, p, arrived, "msg_", None).await?;
        let response = if a.stream {
            messages::stream(a.answer, a.cached, a.rx).into_response()
        } else {
            Json(messages::message(a.answer, a.cached, a.rx).await?).into_response()
        };
        Ok::<_, ApiError>(with_prefix_header(&s, response, a.divergence))
    };
    answered.await.unwrap_or_else(messages::error_response)
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as the model's template renders it.
async fn anthropic_count_tokens(
    State(s): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let counted = async {
        let body = body_of(body)?;
        let p = messages::parse(&body, true)?;
        let shared = s.clone();
        let (prompt, _) = tokio::task::spawn_blocking(move || render(&shared.request_model(), &p))
            .await
            .map_err(|e| ApiError::internal(format!("counting tokens: {e}")))??;
        Ok::<_, ApiError>(Json(messages::token_count(prompt.len())).into_response())
    };
    counted.await.unwrap_or_else(messages::error_response)
}
