//! `kvplug serve`.

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use kvplug::session_dir::SessionDir;
use kvplug::{KvDtype, Runtime};
use kvplug_server::{Server, ServerConfig};

/// `kvplug serve`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Model: a directory with a tokenizer (and a chat template for chat), or a GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// The model's id in answers and /v1/models (default: the file or directory name).
    #[arg(long)]
    alias: Option<String>,
    /// Backend id.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Address to listen on (loopback by default; anything else exposes the model).
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port (0: any free port; the address is printed on start).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/*.
    #[arg(long, env = "KVPLUG_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Cache capacity in cells: the K/V memory budget shared by all requests and agents
    /// (see `kvplug plan`), and the longest prompt + answer.
    #[arg(long, default_value_t = 8192)]
    capacity: usize,
    /// KV storage dtype.
    #[arg(long, default_value = "f16")]
    kv_dtype: KvDtype,
    /// Most requests decoded together (sequences of the cache, 1..=64).
    #[arg(long, default_value_t = 16)]
    parallel: usize,
    /// Most requests waiting beyond those; more get 429.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// The largest max_tokens a request may ask for, and the default.
    #[arg(long, default_value_t = 1024)]
    max_tokens: usize,
    /// Largest request body in bytes; larger bodies get 413.
    #[arg(long, default_value_t = 1 << 20)]
    max_body: usize,
    /// Leave out the x-kvplug-prefix header, which shows the token where a prompt departs
    /// from a recent request's — possibly another client's — prompt.
    #[arg(long)]
    no_prefix_header: bool,
}

pub fn run(runtime: &Runtime, sessions: &SessionDir, a: Args) -> Result<ExitCode> {
    sessions.sweep();
    let model_id = match &a.alias {
        Some(alias) => alias.clone(),
        None => a
            .model
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .context("--model has no file name: give --alias")?,
    };
    let config = ServerConfig {
        model: a.model,
        model_id: model_id.clone(),
        backend: a.backend.clone(),
        addr: SocketAddr::new(a.host, a.port),
        api_key: a.api_key.filter(|k| !k.is_empty()),
        capacity: a.capacity,
        kv_dtype: a.kv_dtype,
        parallel: a.parallel,
        max_queue: a.max_queue,
        max_tokens: a.max_tokens,
        max_body: a.max_body,
        session_dir: sessions.dir().to_path_buf(),
        prefix_header: !a.no_prefix_header,
    };
    let server = Server::bind(runtime, config)?;
    println!(
        "kvplug serve: listening on http://{} (model {model_id}, backend {}, capacity {}, {} KV)",
        server.local_addr(),
        a.backend,
        a.capacity,
        a.kv_dtype
    );
    std::io::stdout().flush()?;
    server.run(|| eprintln!("kvplug serve: shutting down (finishing requests in flight)"))?;
    Ok(ExitCode::SUCCESS)
}
