//! `kvplug serve`: an OpenAI-compatible HTTP server for agents (axum on tokio).
//!
//! - **Routes.** `POST /v1/chat/completions` and `POST /v1/completions` (one JSON answer, or
//!   server-sent events ending with `data: [DONE]` when `stream` is true), `GET /v1/models`,
//!   `GET /health` (never behind the key; shows the batcher and cache figures).
//! - **One model, one seq cache.** Requests are sequences of one cache; the engine thread
//!   runs one forward per step over all of them ([`engine`]). The cache's capacity is the
//!   memory budget: requests beyond it wait, a full queue answers 429 with `Retry-After`.
//! - **Reuse.** Every answered request leaves its K/V in the prefix index, so a later
//!   request sharing its beginning (a system prompt, an agent's transcript) prefills only the
//!   rest; `usage.prompt_tokens_details.cached_tokens` says how much was reused. A request
//!   with an `X-Session-Id` header is an agent: its sequence stays between requests (hot)
//!   and moves to its session file when the budget needs the room (warm), then comes back
//!   from there ([`AgentStore`]).
//!
//! The HTTP side runs on its own thread; the model stays on the caller's.

mod api;
mod engine;
mod error;
mod routes;
mod stop;

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{mpsc, Arc, Mutex};

use anyhow::{Context, Result};
use kvplug_core::KvDtype;

use crate::agent_store::{AgentStore, AgentStoreOptions};
use crate::host::Host;
use crate::text::Text;
use engine::{Engine, Limits, Status};
pub use routes::SESSION_HEADER;

/// `kvplug serve`'s arguments.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Model: a directory with a tokenizer (and a chat template for chat), or a GGUF file.
    #[arg(long)]
    pub model: PathBuf,
    /// The model's id in answers and /v1/models (default: the file or directory name).
    #[arg(long)]
    pub alias: Option<String>,
    /// Backend id.
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Address to listen on (loopback by default; anything else exposes the model).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port (0: any free port; the address is printed on start).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/*.
    #[arg(long, env = "KVPLUG_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Cache capacity in cells: the K/V memory budget shared by all requests and agents
    /// (see `kvplug plan`), and the longest prompt + answer.
    #[arg(long, default_value_t = 8192)]
    pub capacity: usize,
    /// KV storage dtype.
    #[arg(long, default_value = "f16")]
    pub kv_dtype: KvDtype,
    /// Most requests decoded together (sequences of the cache, 1..=64).
    #[arg(long, default_value_t = 16)]
    pub parallel: usize,
    /// Most requests waiting beyond those; more get 429.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// The largest max_tokens a request may ask for, and the default.
    #[arg(long, default_value_t = 1024)]
    pub max_tokens: usize,
    /// Largest request body in bytes; larger bodies get 413.
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body: usize,
}

impl ServeArgs {
    /// The options, agents' session files in `session_dir`.
    pub fn options(&self, session_dir: &Path) -> Result<ServeOptions> {
        let model_id = match &self.alias {
            Some(a) => a.clone(),
            None => self
                .model
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .context("--model has no file name: give --alias")?,
        };
        Ok(ServeOptions {
            model: crate::gguf::resolve_model(&self.model)?,
            model_id,
            backend: self.backend.clone(),
            addr: SocketAddr::new(self.host, self.port),
            api_key: self.api_key.clone().filter(|k| !k.is_empty()),
            capacity: self.capacity,
            kv_dtype: self.kv_dtype,
            parallel: self.parallel,
            max_queue: self.max_queue,
            max_tokens: self.max_tokens,
            max_body: self.max_body,
            session_dir: session_dir.to_path_buf(),
        })
    }
}

/// How the server runs.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// The model directory (a GGUF file is resolved by the caller).
    pub model: PathBuf,
    /// The model's id in answers and `/v1/models`.
    pub model_id: String,
    /// Backend id.
    pub backend: String,
    /// Where to listen (port 0: any free port, printed on start).
    pub addr: SocketAddr,
    /// Bearer key required on `/v1/*`.
    pub api_key: Option<String>,
    /// Cache capacity in cells: the K/V memory budget, and the longest prompt + answer.
    pub capacity: usize,
    /// KV storage dtype.
    pub kv_dtype: KvDtype,
    /// Most requests in flight (sequences of the cache, at most 64).
    pub parallel: usize,
    /// Most requests waiting beyond those.
    pub max_queue: usize,
    /// The `max_tokens` limit and default.
    pub max_tokens: usize,
    /// Largest request body in bytes.
    pub max_body: usize,
    /// The agents' session files.
    pub session_dir: PathBuf,
}

/// Loads the model, listens, prints `listening on http://ADDR` on stdout, and serves until
/// SIGINT or SIGTERM; requests in flight are finished first and agents parked in their
/// session files.
pub fn serve(host: &Host, opts: ServeOptions) -> Result<()> {
    anyhow::ensure!(
        (1..=kvplug_core::MAX_SEQS).contains(&opts.parallel),
        "--parallel takes 1..={}",
        kvplug_core::MAX_SEQS
    );
    let text = Arc::new(Text::load(&opts.model)?);
    let store = AgentStore::new(
        host,
        &opts.model,
        AgentStoreOptions {
            backend: opts.backend.clone(),
            capacity: opts.capacity,
            kv_dtype: opts.kv_dtype,
            dir: opts.session_dir.clone(),
        },
    )?;
    let listener = std::net::TcpListener::bind(opts.addr)
        .with_context(|| format!("listening on {}", opts.addr))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let (tx, rx) = mpsc::channel();
    let status = Arc::new(Mutex::new(Status::default()));
    let shared = Arc::new(routes::Shared {
        text: text.clone(),
        engine: tx,
        model_id: opts.model_id.clone(),
        capacity: opts.capacity,
        max_tokens: opts.max_tokens,
        api_key: opts.api_key.clone(),
        status: status.clone(),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        counter: AtomicU64::new(0),
    });
    let app = routes::router(shared, opts.max_body);
    let http = std::thread::Builder::new()
        .name("kvplug-http".into())
        .spawn(move || -> Result<()> {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            rt.block_on(async {
                let listener = tokio::net::TcpListener::from_std(listener)?;
                axum::serve(listener, app)
                    .with_graceful_shutdown(shutdown_signal())
                    .await?;
                Ok(())
            })
        })?;
    println!(
        "kvplug serve: listening on http://{addr} (model {}, backend {}, capacity {}, {} KV)",
        opts.model_id, opts.backend, opts.capacity, opts.kv_dtype
    );
    use std::io::Write;
    std::io::stdout().flush()?;
    let limits = Limits {
        parallel: opts.parallel,
        max_queue: opts.max_queue,
    };
    // The engine ends when the HTTP side is gone (every sender dropped).
    Engine::new(store, text, limits, status).run(rx)?;
    http.join()
        .map_err(|_| anyhow::anyhow!("the HTTP thread panicked"))?
}

async fn shutdown_signal() {
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
    }
    eprintln!("kvplug serve: shutting down (finishing requests in flight)");
}
