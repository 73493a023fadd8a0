//! # kvplug-server
//!
//! An OpenAI-compatible HTTP server for agents (axum on tokio), over the SDK.
//!
//! - **Routes.** `POST /v1/chat/completions` and `POST /v1/completions` (one JSON answer, or
//!   server-sent events ending with `data: [DONE]` when `stream` is true), OpenAI's
//!   `POST /v1/responses` (`responses.rs`, stored responses continued by
//!   `previous_response_id`, read by `GET /v1/responses/{id}`, forgotten by `DELETE`),
//!   Anthropic's
//!   `POST /v1/messages` and `/v1/messages/count_tokens` (`messages.rs`), `GET /v1/models`
//!   and `/v1/models/{id}`, `GET /health` and `GET /metrics` (Prometheus; both open even with
//!   a key). The key goes in `Authorization: Bearer` or `x-api-key`.
//! - **Agents' dialect.** Tools (`tools`, `tool_choice`, `parallel_tool_calls`, tool
//!   messages) rendered by the model's own template and parsed back per template family;
//!   `response_format` (JSON object or schema) and `grammar` (Lark or GBNF) followed by
//!   constrained decoding (llguidance); `logprobs`, `n`, penalties, `logit_bias`, `min_p`,
//!   `top_k`, `ignore_eos`.
//! - **One model, one seq cache.** Requests are sequences of one cache; the engine thread
//!   runs one forward per step over all of them (the `engine` module). The cache's capacity
//!   is the memory budget: requests beyond it wait, a full queue answers 429 with
//!   `Retry-After`.
//! - **Reuse.** Every answered request leaves its K/V in the prefix index, so a later
//!   request sharing its beginning (a system prompt, an agent's transcript) prefills only the
//!   rest; `usage.prompt_tokens_details.cached_tokens` says how much was reused. A request
//!   with an `X-Session-Id` header is an agent: its sequence stays between requests (hot)
//!   and moves to its session file when the budget needs the room (warm), then comes back
//!   from there ([`AgentStore`]).
//!
//! The HTTP side runs on its own thread; the model stays on the caller's. The library prints
//! nothing: [`Server::bind`] returns the bound address for the caller to announce, and
//! [`Server::run`] calls back when a shutdown signal arrives or a [`Stopper`] is used.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let (runtime, config): (kvplug::Runtime, kvplug_server::ServerConfig) = todo!();
//! let server = kvplug_server::Server::bind(&runtime, config)?; // port 0: any free port
//! let (addr, stop) = (server.local_addr(), server.stopper());
//! let serving = std::thread::spawn(move || server.run(|| {}));
//! // ... talk HTTP to `addr` ...
//! stop.stop();
//! serving.join().unwrap()?;
//! # Ok(()) }
//! ```

mod answer;
mod api;
mod engine;
mod error;
mod messages;
mod metrics;
mod request;
mod responses;
mod routes;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{mpsc, Arc, Mutex};

use kvplug::{AgentStore, AgentStoreOptions, KvDtype, Runtime, Text};

use engine::{Engine, Limits, Status};
pub use routes::SESSION_HEADER;

/// How the server runs.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The model: a directory, or a GGUF file (indexed once, used in place).
    pub model: PathBuf,
    /// The model's id in answers and `/v1/models`.
    pub model_id: String,
    /// Backend id.
    pub backend: String,
    /// Where to listen (port 0: any free port; [`Server::local_addr`] says which).
    pub addr: SocketAddr,
    /// Bearer key required on `/v1/*`.
    pub api_key: Option<String>,
    /// Cache capacity in cells: the K/V memory budget, and the longest prompt + answer.
    pub capacity: usize,
    /// KV storage dtype.
    pub kv_dtype: KvDtype,
    /// Whether q8/q4 keys are Hadamard-rotated (the default; see [`kvplug::KeyBasis`]).
    pub key_rotation: bool,
    /// Whether the weight files are mapped (the default) or read into memory (see
    /// [`kvplug::Model::with_mmap`]).
    pub mmap: bool,
    /// The attention arithmetic (`None`: the cache's default; see
    /// [`kvplug::Model::with_attention`]).
    pub attention: Option<kvplug::Arithmetic>,
    /// Most requests in flight (sequences of the cache, 1..=64).
    pub parallel: usize,
    /// Most requests waiting beyond those.
    pub max_queue: usize,
    /// The `max_tokens` limit and default.
    pub max_tokens: usize,
    /// Largest request body in bytes.
    pub max_body: usize,
    /// The agents' session files.
    pub session_dir: PathBuf,
    /// What parked agents may keep there.
    pub parked: kvplug::WarmLimits,
    /// How long a client may take to send a request's headers.
    pub header_timeout: std::time::Duration,
    /// The longest a request's body may stop arriving before the request ends with 408.
    pub body_timeout: std::time::Duration,
    /// Most connections open at once; further clients wait in the listen queue until one
    /// closes (so a flood of connections cannot take every file descriptor).
    pub max_connections: usize,
    /// Whether answers say where their prompt's reuse ended (the `x-kvplug-prefix` header:
    /// it shows the token of a recent request's prompt, possibly another client's, where
    /// this prompt departs from it; turn off where clients must not learn of each other's
    /// prompts).
    pub prefix_header: bool,
    /// Speculative decoding: the draft (`ngram`, `draft:PATH`, `layers:N`) greedy requests
    /// use unless they send `"speculative": false`, and any request sending `"speculative":
    /// true`; `None`: off unless a request asks (then by prompt lookup).
    pub speculative: Option<kvplug::DraftKind>,
}

/// The most `max_connections` may be (each open connection takes a file descriptor).
pub const MAX_CONNECTIONS: usize = 1 << 20;

/// What starting or running the server can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A setting out of range.
    #[error("{0}")]
    Config(String),
    /// The model, its tokenizer or its context could not be made, or the engine failed.
    #[error(transparent)]
    Sdk(#[from] kvplug::Error),
    /// Listening or serving failed.
    #[error("{what}: {error}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        error: std::io::Error,
    },
    /// The HTTP thread panicked.
    #[error("the HTTP thread panicked")]
    HttpThread,
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ServerError {
    let what = what.into();
    move |error| ServerError::Io { what, error }
}

/// Stops a running [`Server`] as SIGTERM does (requests in flight finish, agents are
/// parked); from any thread, before or after `run` starts.
#[derive(Clone)]
pub struct Stopper(Arc<tokio::sync::Notify>);

impl Stopper {
    /// Asks the server to stop.
    pub fn stop(&self) {
        self.0.notify_one();
    }
}

/// A server bound to its address, its model loaded.
pub struct Server {
    listener: std::net::TcpListener,
    addr: SocketAddr,
    config: ServerConfig,
    store: AgentStore,
    text: Arc<Text>,
    vocab: usize,
    grammars: Result<kvplug::Grammars, String>,
    draft: Option<kvplug::Draft>,
    stop: Arc<tokio::sync::Notify>,
}

impl Server {
    /// Loads the model on `config.backend` and binds `config.addr`.
    pub fn bind(runtime: &Runtime, config: ServerConfig) -> Result<Server, ServerError> {
        if !(1..=kvplug_core::MAX_SEQS).contains(&config.parallel) {
            return Err(ServerError::Config(format!(
                "parallel takes 1..={} requests",
                kvplug_core::MAX_SEQS
            )));
        }
        if config.max_tokens == 0 {
            return Err(ServerError::Config(
                "max tokens 0 would answer nothing: give at least 1".into(),
            ));
        }
        if config.header_timeout.is_zero() || config.body_timeout.is_zero() {
            return Err(ServerError::Config(
                "the header and body timeouts must be above zero".into(),
            ));
        }
        if !(1..=MAX_CONNECTIONS).contains(&config.max_connections) {
            return Err(ServerError::Config(format!(
                "max connections takes 1..={MAX_CONNECTIONS}"
            )));
        }
        let llm = kvplug::Llm::builder(&config.model)
            .runtime(runtime)
            .backend(&config.backend)
            .kv_dtype(config.kv_dtype)
            .capacity(config.capacity)
            .key_rotation(config.key_rotation)
            .mmap(config.mmap)
            .attention(config.attention)
            .build()?;
        let (model, text) = (llm.model().clone(), llm.text().clone());
        let draft = match &config.speculative {
            Some(kind) => Some(kvplug::Draft::open(kind, &model)?),
            None => None,
        };
        // Constrained decoding (response_format, tools, grammar) needs the vocabulary as
        // bytes; a tokenizer llguidance cannot read leaves the server without it.
        let eos: Vec<i32> = text.stop_tokens().iter().copied().collect();
        let grammars =
            kvplug::Grammars::new(model.dir(), model.vocab(), &eos).map_err(|e| e.to_string());
        if let Err(why) = &grammars {
            tracing::warn!("constrained decoding is not available: {why}");
        }
        let store = AgentStore::new(
            &model,
            AgentStoreOptions {
                capacity: config.capacity,
                kv_dtype: config.kv_dtype,
                dir: config.session_dir.clone(),
                warm: config.parked,
            },
        )?;
        let listener = std::net::TcpListener::bind(config.addr)
            .map_err(io(format!("listening on {}", config.addr)))?;
        listener
            .set_nonblocking(true)
            .map_err(io("a non-blocking listener"))?;
        let addr = listener.local_addr().map_err(io("the bound address"))?;
        Ok(Server {
            listener,
            addr,
            config,
            store,
            text,
            vocab: model.vocab(),
            grammars,
            draft,
            stop: Arc::default(),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// A handle that stops it.
    pub fn stopper(&self) -> Stopper {
        Stopper(self.stop.clone())
    }

    /// Serves until SIGINT, SIGTERM or its [`Stopper`]; `on_shutdown` runs then, and
    /// requests in flight are finished and agents parked in their session files.
    pub fn run(self, on_shutdown: impl FnOnce() + Send + 'static) -> Result<(), ServerError> {
        let Server {
            listener,
            config,
            store,
            text,
            vocab,
            grammars,
            draft,
            stop,
            ..
        } = self;
        let (tx, rx) = mpsc::channel();
        let status = Arc::new(Mutex::new(Status::default()));
        let metrics = Arc::new(metrics::Metrics::default());
        let shared = Arc::new(routes::Shared {
            text: text.clone(),
            vocab,
            engine: tx,
            model_id: config.model_id.clone(),
            capacity: config.capacity,
            max_tokens: config.max_tokens,
            api_key: config.api_key.clone(),
            status: status.clone(),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            counter: AtomicU64::new(0),
            instance: format!("{:08x}", instance_id()),
            prefix_header: config.prefix_header,
            responses: Arc::default(),
            grammars,
            metrics: metrics.clone(),
        });
        let app = routes::router(shared, config.max_body, config.body_timeout);
        let (header_timeout, max_connections) = (config.header_timeout, config.max_connections);
        let http = std::thread::Builder::new()
            .name("kvplug-http".into())
            .spawn(move || -> Result<(), ServerError> {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .map_err(io("starting the HTTP runtime"))?;
                rt.block_on(async {
                    let listener =
                        tokio::net::TcpListener::from_std(listener).map_err(io("the listener"))?;
                    let shutdown = shutdown_signal(stop, on_shutdown);
                    serve_http(listener, app, header_timeout, max_connections, shutdown).await;
                    Ok(())
                })
            })
            .map_err(io("starting the HTTP thread"))?;
        let limits = Limits {
            parallel: config.parallel,
            max_queue: config.max_queue,
            speculate: draft.is_some(),
            draft,
        };
        // The engine ends when the HTTP side is gone (every sender dropped).
        Engine::new(store, text, limits, status, metrics).run(rx)?;
        http.join().map_err(|_| ServerError::HttpThread)?
    }
}

/// Serves HTTP/1 connections from `listener` with `app` until `shutdown` completes, then
/// waits for the connections in flight. A client must send a request's headers within
/// `header_timeout` of connecting or of its previous request, else its connection is
/// closed (half-sent requests held connections forever). At most `max_connections` are
/// open at once: at the limit nothing is accepted until one closes, and later clients wait
/// in the kernel's listen queue.
async fn serve_http(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    header_timeout: std::time::Duration,
    max_connections: usize,
    shutdown: impl std::future::Future<Output = ()>,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let open = Arc::new(tokio::sync::Semaphore::new(max_connections));
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = async {
            // The semaphore is never closed.
            let permit = open.clone().acquire_owned().await.ok();
            (permit, listener.accept().await)
        };
        tokio::select! {
            (permit, accepted) = accepted => match accepted {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    let service = hyper_util::service::TowerToHyperService::new(app.clone());
                    let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
                    tokio::spawn(async move {
                        if let Err(e) = conn.await {
                            tracing::debug!("connection ended: {e}");
                        }
                        drop(permit);
                    });
                }
                // Out of descriptors and the like: the listener stays, later accepts may work.
                Err(e) => {
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            },
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    drop(app);
    graceful.shutdown().await;
}

async fn shutdown_signal(stop: Arc<tokio::sync::Notify>, on_shutdown: impl FnOnce()) {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
        () = stop.notified() => {}
    }
    on_shutdown();
}

/// 32 bits that differ between server processes (answer and tool-call ids must not repeat
/// across restarts within one conversation).
fn instance_id() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish() as u32
}
