//! `kvplug serve`.

use std::io::Write;
use std::net::ToSocketAddrs;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use kvplug::SessionDir;
use kvplug::{KvDtype, Runtime, WarmLimits};
use kvplug_server::{Server, ServerConfig};

/// `kvplug serve`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// Model: a directory with a tokenizer (and a chat template for chat), or a GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// The model's id in answers and /v1/models (default: the directory's name, or the file's
    /// without its extension).
    #[arg(long)]
    alias: Option<String>,
    /// Backend id.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Address or host name to listen on (loopback by default; anything else exposes the
    /// model). A name listens on the first address it resolves to (`localhost`: loopback).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0: any free port; the address is printed on start).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic
    /// clients) on /v1/*.
    #[arg(long, env = "KVPLUG_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Cache capacity in cells: the K/V memory budget shared by all requests and agents
    /// (see `kvplug plan`), and the longest prompt + answer.
    #[arg(long, default_value_t = 8192)]
    capacity: usize,
    /// KV storage dtype.
    #[arg(long, default_value = "f16")]
    kv_dtype: KvDtype,
    #[command(flatten)]
    model_flags: crate::model_flags::ModelFlags,
    #[command(flatten)]
    attention: crate::model_flags::AttentionFlag,
    /// Most requests decoded together (sequences of the cache, 1..=64).
    #[arg(long, default_value_t = 16)]
    parallel: usize,
    /// Most requests waiting beyond those; more get 429.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// The largest max_tokens a request may ask for, and the default.
    #[arg(long, default_value_t = 1024)]
    max_tokens: usize,
    /// Largest request body in bytes (at least 1); larger bodies get 413.
    #[arg(long, default_value_t = 1 << 20, value_parser = body_limit)]
    max_body: usize,
    /// Disk the parked agents' session files may take, every model's (bytes, or with a unit
    /// as in `plan --budget`; 0: unbounded); past it the least recently parked are removed.
    #[arg(long, default_value = "4GiB", value_parser = kvplug::parse_bytes)]
    agent_disk: u64,
    /// Parked agents unused this long are removed (e.g. 90s, 30m, 24h, 7d; 0: never).
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    agent_ttl: Duration,
    /// A client must send a request's headers within this time of connecting (or of its
    /// previous request on the connection), else it is disconnected.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    header_timeout: Duration,
    /// A request whose body stops arriving for this long ends with 408 and its connection.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    body_timeout: Duration,
    /// Most client connections open at once (1..); at the limit the server accepts no more
    /// until one closes, and new clients wait in the listen queue.
    #[arg(long, default_value_t = 512)]
    max_connections: usize,
    /// Leave out the x-kvplug-prefix header, which shows the token where a prompt departs
    /// from a recent request's — possibly another client's — prompt. It is left out by
    /// default when the server listens beyond loopback or requires a key.
    #[arg(long, conflicts_with = "prefix_header")]
    no_prefix_header: bool,
    /// Send the x-kvplug-prefix header even when listening beyond loopback or requiring a key.
    #[arg(long)]
    prefix_header: bool,
    /// Speculative decoding of greedy requests (unless they send `"speculative": false`)
    /// and of any request sending `"speculative": true`, drafting with KIND: `ngram`
    /// (prompt lookup over the conversation: agents re-emit what they read), `draft:PATH`,
    /// `layers:N`, or `off` (then only requests asking for it speculate, by prompt lookup).
    /// Answers are those plain decoding gives; usage counts accepted and rejected draft
    /// tokens.
    #[arg(long, value_name = "KIND", default_value = "ngram", value_parser = draft_or_off)]
    speculative: Speculative,
}

pub fn run(runtime: &Runtime, sessions: &SessionDir, a: Args) -> Result<ExitCode> {
    sessions.sweep();
    let model_id = match &a.alias {
        Some(alias) => alias.clone(),
        // A directory's whole name (`Qwen2.5-Coder-0.5B-Instruct`), a file's without its
        // extension.
        None => match a.model.is_dir() {
            true => a.model.file_name(),
            false => a.model.file_stem(),
        }
        .map(|s| s.to_string_lossy().into_owned())
        .context("--model has no file name: give --alias")?,
    };
    let api_key = a.api_key.filter(|k| !k.is_empty());
    let addr = (a.host.as_str(), a.port)
        .to_socket_addrs()
        .with_context(|| format!("--host {}: not an address or a name that resolves", a.host))?
        .next()
        .with_context(|| format!("--host {}: the name resolves to no address", a.host))?;
    let config = ServerConfig {
        model: a.model,
        model_id: model_id.clone(),
        backend: a.backend.clone(),
        addr,
        api_key: api_key.clone(),
        capacity: a.capacity,
        kv_dtype: a.kv_dtype,
        key_rotation: a.model_flags.key_rotation(),
        mmap: a.model_flags.mmap(),
        attention: a.attention.get(),
        parallel: a.parallel,
        max_queue: a.max_queue,
        max_tokens: a.max_tokens,
        max_body: a.max_body,
        session_dir: sessions.dir().to_path_buf(),
        // One user's own clients by default; others must not read each other's prompts.
        prefix_header: a.prefix_header
            || (!a.no_prefix_header && addr.ip().is_loopback() && api_key.is_none()),
        speculative: a.speculative.0,
        header_timeout: a.header_timeout,
        body_timeout: a.body_timeout,
        max_connections: a.max_connections,
        parked: WarmLimits {
            bytes: (a.agent_disk > 0).then_some(a.agent_disk),
            idle: (!a.agent_ttl.is_zero()).then_some(a.agent_ttl),
        },
    };
    let server = Server::bind(runtime, config)?;
    let attention = a
        .attention
        .get()
        .map(|x| format!(", {x} attention"))
        .unwrap_or_default();
    println!(
        "kvplug serve: listening on http://{} (model {model_id}, backend {}, capacity {}, {} KV{attention})",
        server.local_addr(),
        a.backend,
        a.capacity,
        a.kv_dtype
    );
    std::io::stdout().flush()?;
    server.run(|| eprintln!("kvplug serve: shutting down (finishing requests in flight)"))?;
    Ok(ExitCode::SUCCESS)
}

/// `--max-body`: 0 would refuse every request that has a body.
fn body_limit(s: &str) -> Result<usize, String> {
    match s.parse::<usize>().map_err(|e| e.to_string())? {
        0 => Err("0 would refuse every request with a body: give at least 1 byte".into()),
        n => Ok(n),
    }
}

/// `90s`, `30m`, `24h`, `7d`, or plain seconds.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|e| format!("'{s}': {e} (expected e.g. 24h)"))?;
    let scale = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        u => return Err(format!("'{s}': unknown unit '{u}' (s, m, h or d)")),
    };
    n.checked_mul(scale)
        .map(Duration::from_secs)
        .ok_or_else(|| format!("'{s}' is too long"))
}

/// `--speculative`: a draft, or `off`.
#[derive(Clone)]
struct Speculative(Option<kvplug::DraftKind>);

fn draft_or_off(s: &str) -> Result<Speculative, String> {
    match s {
        "off" => Ok(Speculative(None)),
        kind => kind.parse().map(|k| Speculative(Some(k))),
    }
}
