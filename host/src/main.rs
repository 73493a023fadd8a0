//! `kvplug`: the host CLI.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use kvplug_conformance::{builtin_scenarios, load_dir};
use kvplug_core::{CacheKind, KvDtype};
use kvplug_host::chat::{Chat, ChatOptions};
use kvplug_host::conform::{run_matrix, ConformOptions, REQUIRE_BACKENDS_ENV};
use kvplug_host::model::{synth, PRESETS};
use kvplug_host::run::{
    run_agents, run_decode, run_decode_streaming, run_fork, RunReport, RunSpec, Sampler,
};
use kvplug_host::session_dir::SessionDir;
use kvplug_host::speculative::{run_speculative, DraftKind, SpecOptions};
use kvplug_host::text::{Message, Streamer, Text};
use kvplug_host::{Host, PluginSearch};

/// kvplug: runtime-swappable KV caches behind pluggable backends.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    /// Plugin directory (repeatable); searched before KVPLUG_PLUGIN_PATH and the defaults.
    #[arg(long = "plugins", global = true, value_name = "DIR")]
    plugins: Vec<PathBuf>,
    /// Load plugins from world-writable directories and files.
    #[arg(long, global = true)]
    allow_insecure_plugins: bool,
    /// Where named sessions live (default: $KVPLUG_SESSION_DIR, else
    /// $XDG_DATA_HOME/kvplug/sessions, else ~/.local/share/kvplug/sessions).
    #[arg(long, global = true, value_name = "DIR")]
    session_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List loaded backends and skipped files.
    Plugins {
        /// One JSON object instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Model packages.
    Model {
        #[command(subcommand)]
        command: ModelCommand,
    },
    /// Generate with a model on a backend: decode, agent fork or speculative decoding.
    Run(RunArgs),
    /// Chat: one user turn per line of stdin (a terminal or a pipe); one cache carries the
    /// conversation, so each turn prefills only its new tokens.
    Chat {
        /// Model: a directory with a tokenizer and chat template, or a GGUF file.
        #[arg(long)]
        model: PathBuf,
        /// Backend id.
        #[arg(long, default_value = "cpu")]
        backend: String,
        /// A system message opening the conversation.
        #[arg(long)]
        system: Option<String>,
        /// Most tokens per answer.
        #[arg(long, default_value_t = 256)]
        max_new: usize,
        /// Cache capacity in cells (the whole conversation).
        #[arg(long, default_value_t = 4096)]
        capacity: usize,
        /// KV storage dtype (default: the session's, else f16).
        #[arg(long)]
        kv_dtype: Option<String>,
        /// A named session: resumed (K/V, tokens, messages; no re-prefill) when it exists,
        /// saved after every turn.
        #[arg(long, value_name = "NAME")]
        session: Option<String>,
        #[command(flatten)]
        sampling: SamplingArgs,
        /// One JSON object per turn instead of streamed text.
        #[arg(long)]
        json: bool,
    },
    /// Saved sessions (see chat --session).
    Session {
        #[command(subcommand)]
        command: SessionCommand,
    },
    /// Memory plan: weights, KV bytes per token by layer group, and how many tokens and
    /// agents fit a budget.
    Plan(kvplug_host::plan::PlanArgs),
    /// An OpenAI-compatible HTTP server (chat and text completions, streaming, continuous
    /// batching, prefix reuse; agent sessions by the X-Session-Id header).
    Serve(kvplug_host::serve::ServeArgs),
    /// Throughput like llama.cpp's llama-bench: pp (prefill) and tg (decode) tokens per second
    /// at context depths, per backend, cache kind and KV dtype.
    Bench(kvplug_host::bench::BenchArgs),
    /// The main job: decode (f16 and q8 KV), agent fork and speculative decoding of a model
    /// on one backend, as a table.
    Demo {
        /// Model: a directory with a tokenizer, or a GGUF file.
        #[arg(long)]
        model: PathBuf,
        /// Backend id.
        #[arg(long, default_value = "cpu")]
        backend: String,
        /// Most tokens to generate per answer.
        #[arg(long, default_value_t = 48)]
        max_new: usize,
    },
    /// Run the cross-backend conformance matrix against the f64 oracle.
    Conform {
        /// Backend to test (repeatable; default: every loaded backend).
        #[arg(long = "backend", value_name = "ID")]
        backends: Vec<String>,
        /// Scenario directory (repeatable); replaces the built-in scenarios.
        #[arg(long = "scenarios", value_name = "DIR")]
        scenarios: Vec<PathBuf>,
        /// Only these kinds (comma-separated).
        #[arg(long, value_delimiter = ',')]
        kinds: Vec<String>,
        /// Only these KV dtypes (comma-separated).
        #[arg(long, value_delimiter = ',')]
        dtypes: Vec<String>,
        /// Only these input distributions (comma-separated: uniform, outliers).
        #[arg(long, value_delimiter = ',')]
        inputs: Vec<String>,
        /// One JSON object instead of the table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum SessionCommand {
    /// List sessions (from their headers).
    Ls {
        /// One JSON array instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Check one session in full (checksum, tensors) and describe it.
    Show {
        /// Session name.
        name: String,
        /// Also check that it fits this model (a directory or GGUF file).
        #[arg(long)]
        model: Option<PathBuf>,
    },
    /// Delete sessions.
    Rm {
        /// Session names.
        #[arg(required = true)]
        names: Vec<String>,
    },
}

#[derive(Subcommand)]
enum ModelCommand {
    /// Write a deterministic random-weight Llama model with kv_cache.* metadata.
    Synth {
        /// `tiny` (tests) or `small` (SmolLM-135M's shape, benchmarks).
        #[arg(long)]
        preset: String,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Weight seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Weight dtype: f32, f16 or bf16.
        #[arg(long, default_value = "f32")]
        dtype: String,
    },
    /// Import a Llama-architecture GGUF file as a model directory (f16 weights, tokenizer,
    /// chat template).
    Import {
        /// The GGUF file.
        gguf: PathBuf,
        /// Output directory (must not exist).
        #[arg(long)]
        out: PathBuf,
    },
}

/// How tokens are picked: greedy unless a temperature is given.
#[derive(clap::Args)]
struct SamplingArgs {
    /// Sampling temperature, finite and >= 0 (0 = greedy, the default).
    #[arg(long, alias = "temp", default_value_t = 0.0, value_parser = temperature, allow_negative_numbers = true)]
    temperature: f32,
    /// Nucleus mass, in (0, 1].
    #[arg(long, default_value_t = 1.0, value_parser = top_p)]
    top_p: f32,
    /// Keep only the K most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

fn finite(s: &str) -> Result<f32, String> {
    let v: f32 = s.parse().map_err(|e| format!("'{s}': {e}"))?;
    if v.is_finite() {
        Ok(v)
    } else {
        Err(format!("'{s}' is not a finite number"))
    }
}

fn temperature(s: &str) -> Result<f32, String> {
    let v = finite(s)?;
    if v < 0.0 {
        return Err(format!("{v} is negative (0 = greedy)"));
    }
    Ok(v)
}

fn top_p(s: &str) -> Result<f32, String> {
    let v = finite(s)?;
    if !(v > 0.0 && v <= 1.0) {
        return Err(format!("{v} is outside (0, 1]"));
    }
    Ok(v)
}

impl SamplingArgs {
    fn sampler(&self) -> Sampler {
        Sampler::new(self.temperature, self.top_p, self.seed).with_top_k(self.top_k)
    }
}

#[derive(clap::Args)]
struct RunArgs {
    /// Backend id.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Model: a directory (config.json + *.safetensors) or a GGUF file (imported once into
    /// the cache directory).
    #[arg(long)]
    model: PathBuf,
    /// Prompt text, sent through the model's chat template as a user turn (unless --raw).
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// Send --prompt as is, without the chat template.
    #[arg(long, requires = "prompt")]
    raw: bool,
    /// A system message before the user turn.
    #[arg(long, requires = "prompt")]
    system: Option<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Prompt token ids, comma-separated.
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true)]
    prompt_ids: Vec<i32>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 32)]
    max_new: usize,
    /// KV storage dtype.
    #[arg(long, default_value = "f16")]
    kv_dtype: String,
    /// Cache capacity in cells.
    #[arg(long, default_value_t = 4096)]
    capacity: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Agent fork: K branches from the prompt, decoded together, best kept.
    #[arg(long, conflicts_with = "speculative")]
    agents: Option<usize>,
    /// Speculative tree decoding, drafting with KIND: `ngram` (prompt lookup), `draft:PATH`
    /// (a model sharing the vocabulary) or `layers:N` (the target's first N layers).
    #[arg(long, value_name = "KIND")]
    speculative: Option<DraftKind>,
    /// Deepest draft chain per round (the depth adapts below it).
    #[arg(long, default_value_t = 8)]
    depth: usize,
    /// Most draft branches from the root (each adds a chain of target nodes to verify).
    #[arg(long, default_value_t = 1)]
    width: usize,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Mesa's Vulkan drivers (the wgpu plugin's, when loaded) print an error to stderr when
/// `XDG_RUNTIME_DIR` is unset; give the process a private one instead of spilling driver
/// noise on users. Runs first, before any thread exists.
fn ensure_runtime_dir() {
    if std::env::var_os("XDG_RUNTIME_DIR").is_some() {
        return;
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
        let uid = std::fs::metadata("/proc/self")
            .map(|m| m.uid())
            .unwrap_or(0);
        let dir = std::env::temp_dir().join(format!("kvplug-runtime-{uid}"));
        let _ = std::fs::DirBuilder::new().mode(0o700).create(&dir);
        // Use it only if it is ours and private (another user may have made it first).
        let ok = std::fs::metadata(&dir)
            .is_ok_and(|m| m.is_dir() && m.uid() == uid && m.permissions().mode() & 0o077 == 0);
        if ok {
            std::env::set_var("XDG_RUNTIME_DIR", &dir);
        }
    }
}

fn main() -> ExitCode {
    ensure_runtime_dir();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvplug: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode> {
    let host = Host::load(&PluginSearch::standard(
        &cli.plugins,
        cli.allow_insecure_plugins,
    ));
    match cli.command {
        Command::Plugins { json } => plugins(&host, json),
        Command::Model {
            command:
                ModelCommand::Synth {
                    preset,
                    out,
                    seed,
                    dtype,
                },
        } => {
            let p = PRESETS
                .iter()
                .find(|p| p.name == preset)
                .with_context(|| format!("unknown preset '{preset}' (expected tiny or small)"))?;
            synth(p, &out, seed, &dtype)?;
            println!("wrote {} model to {}", p.name, out.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Model {
            command: ModelCommand::Import { gguf, out },
        } => {
            kvplug_host::gguf::import(&gguf, &out)?;
            println!("imported {} into {}", gguf.display(), out.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Run(args) => run_model(&host, args),
        Command::Chat {
            model,
            backend,
            system,
            max_new,
            capacity,
            kv_dtype,
            session,
            sampling,
            json,
        } => {
            let model = kvplug_host::gguf::resolve_model(&model)?;
            let session = match &session {
                Some(name) => {
                    Some(SessionDir::standard(cli.session_dir.as_deref()).path_for_write(name)?)
                }
                None => None,
            };
            let opts = ChatOptions {
                backend,
                system,
                capacity,
                kv_dtype: kv_dtype.as_deref().map(str::parse).transpose()?,
                max_new,
                sampler: sampling.sampler(),
                session,
            };
            let mut chat = Chat::new(&host, &model, opts)?;
            if let Some(r) = chat.restored() {
                eprintln!(
                    "[resumed: {} messages, {} tokens of K/V restored in {:.0} ms]",
                    r.messages,
                    r.tokens,
                    r.seconds * 1e3
                );
            }
            chat_loop(&mut chat, json)
        }
        Command::Session { command } => {
            sessions(&SessionDir::standard(cli.session_dir.as_deref()), command)
        }
        Command::Bench(args) => bench(&host, args),
        Command::Serve(args) => {
            let dir = SessionDir::standard(cli.session_dir.as_deref());
            kvplug_host::serve::serve(&host, args.options(dir.dir())?)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Plan(args) => {
            print!("{}", kvplug_host::plan::run(&args)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Demo {
            model,
            backend,
            max_new,
        } => demo(&host, &model, &backend, max_new),
        Command::Conform {
            backends,
            scenarios,
            kinds,
            dtypes,
            inputs,
            json,
        } => {
            let scenarios = if scenarios.is_empty() {
                builtin_scenarios()
            } else {
                let mut all = Vec::new();
                for dir in &scenarios {
                    all.extend(load_dir(dir)?);
                }
                all
            };
            let opts = ConformOptions {
                backends,
                kinds: kinds
                    .iter()
                    .map(|k| k.parse::<CacheKind>())
                    .collect::<Result<_, _>>()?,
                dtypes: dtypes
                    .iter()
                    .map(|d| d.parse::<KvDtype>())
                    .collect::<Result<_, _>>()?,
                inputs: inputs
                    .iter()
                    .map(|i| {
                        kvplug_conformance::Inputs::ALL
                            .into_iter()
                            .find(|x| x.as_str() == i)
                            .ok_or_else(|| {
                                anyhow::anyhow!(
                                    "unknown inputs '{i}' (expected uniform or outliers)"
                                )
                            })
                    })
                    .collect::<Result<_, _>>()?,
                required: std::env::var(REQUIRE_BACKENDS_ENV)
                    .unwrap_or_default()
                    .split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(String::from)
                    .collect(),
            };
            for s in host.skipped() {
                eprintln!("skipped {}: {}", s.file.display(), s.reason);
            }
            let matrix = run_matrix(&host, &scenarios, &opts);
            if json {
                println!("{}", serde_json::to_string_pretty(&matrix)?);
            } else {
                print!("{}", matrix.render());
            }
            Ok(if matrix.ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
    }
}

/// The prompt ids of a run: `--prompt-ids`, or `--prompt` through the model's chat template
/// (with `--system`) unless `--raw`; the text layer when the model has one.
fn prompt_of(a: &RunArgs, model: &std::path::Path) -> Result<(Vec<i32>, Option<Text>)> {
    let text = match Text::load(model) {
        Ok(t) => Some(t),
        Err(e) if a.prompt.is_some() => return Err(e),
        Err(_) => None,
    };
    let ids = match (&a.prompt, &text) {
        (Some(p), Some(t)) => {
            if a.raw || !t.has_template() {
                if a.system.is_some() {
                    bail!("--system needs the model's chat template (drop --raw)");
                }
                t.encode_raw(p)?
            } else {
                let mut messages = Vec::new();
                if let Some(sys) = &a.system {
                    messages.push(Message::new("system", sys));
                }
                messages.push(Message::new("user", p));
                t.encode(&t.render(&messages)?)?
            }
        }
        _ if !a.prompt_ids.is_empty() => a.prompt_ids.clone(),
        _ => bail!("pass --prompt TEXT or --prompt-ids 1,2,3"),
    };
    Ok((ids, text))
}

fn bench(host: &Host, a: kvplug_host::bench::BenchArgs) -> Result<ExitCode> {
    use kvplug_host::bench;
    if !a.json {
        println!("{}", bench::TABLE_HEAD);
    }
    let results = bench::run(host, &a, &mut |r| {
        if !a.json {
            println!("{}", bench::table_row(r));
        }
    })?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    } else {
        let devices: std::collections::BTreeSet<_> =
            results.iter().map(|r| (&r.backend, &r.device)).collect();
        for (backend, device) in devices {
            println!("{backend}: {device}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn run_model(host: &Host, a: RunArgs) -> Result<ExitCode> {
    let model = kvplug_host::gguf::resolve_model(&a.model)?;
    let (prompt, text) = prompt_of(&a, &model)?;
    let spec = RunSpec {
        backend: a.backend.clone(),
        model,
        prompt,
        max_new: a.max_new,
        kv_dtype: a.kv_dtype.parse()?,
        capacity: a.capacity,
        stop: if a.ignore_eos {
            Default::default()
        } else {
            text.as_ref()
                .map(|t| t.stop_tokens().clone())
                .unwrap_or_default()
        },
    };
    let mut sampler = a.sampling.sampler();
    let report: RunReport = if let Some(k) = a.agents {
        run_agents(host, &spec, k, &sampler)?
    } else if let Some(draft) = &a.speculative {
        let opts = SpecOptions {
            draft: draft.clone(),
            max_depth: a.depth,
            max_width: a.width,
        };
        run_speculative(host, &spec, &opts, &mut sampler)?
    } else {
        let mut streamer = Streamer::default();
        let stream = !a.json;
        run_decode_streaming(host, &spec, &mut sampler, &mut |id| {
            if let (true, Some(t)) = (stream, &text) {
                let piece = streamer.push(t, id)?;
                print!("{piece}");
                std::io::stdout().flush()?;
            }
            Ok(())
        })?
    };
    let decoded = match &text {
        Some(t) => Some(t.decode(&report.ids)?),
        None => None,
    };
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        v["prompt_tokens"] = spec.prompt.len().into();
        v["generated_tokens"] = report.ids.len().into();
        v["stopped_at_eos"] = report
            .ids
            .last()
            .is_some_and(|t| spec.stop.contains(t))
            .into();
        if let Some(d) = decoded {
            v["text"] = d.into();
        }
        println!("{}", serde_json::to_string(&v)?);
        return Ok(ExitCode::SUCCESS);
    }
    match (&decoded, report.mode.as_str()) {
        (Some(_), "decode") => println!(),
        (Some(d), _) => println!("{d}"),
        (None, _) => {
            let ids: Vec<String> = report.ids.iter().map(|i| i.to_string()).collect();
            println!("ids: {}", ids.join(","));
        }
    }
    if let (Some(branches), Some(w)) = (&report.branches, report.winner) {
        for (b, ids) in branches.iter().enumerate() {
            println!("branch {b}{}: {ids:?}", if b == w { " (kept)" } else { "" });
        }
    }
    eprintln!(
        "{} prompt + {} generated tokens; prefill {:.1} tok/s, decode {:.1} tok/s; cache {} bytes, {} cells allocated, {} live",
        spec.prompt.len(),
        report.ids.len(),
        report.prefill_tok_s,
        report.decode_tok_s,
        report.cache.allocated_bytes,
        report.cache.pool_cells,
        report.cache.live_cells
    );
    if report.cache.window_cells > 0 {
        eprintln!(
            "sliding-window layers: {} cells allocated (window plus one micro-batch)",
            report.cache.window_cells
        );
    }
    if let (Some(acc), Some(tpf)) = (report.acceptance, report.tokens_per_target_forward) {
        eprintln!(
            "acceptance {:.1}%, {:.2} tokens per target forward",
            acc * 100.0,
            tpf
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The longest chat line read: 1 MiB, far more than any cache holds as tokens.
const MAX_CHAT_LINE: u64 = 1 << 20;

/// The next line of `input` (without reading more than [`MAX_CHAT_LINE`] bytes of it);
/// `None` at the end.
fn read_turn(input: &mut impl std::io::BufRead) -> Result<Option<String>> {
    use std::io::{BufRead, Read};
    let mut buf = Vec::new();
    let n = input
        .take(MAX_CHAT_LINE + 1)
        .read_until(b'\n', &mut buf)
        .context("reading stdin")?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() != Some(&b'\n') && n as u64 > MAX_CHAT_LINE {
        bail!("a chat line is longer than {MAX_CHAT_LINE} bytes");
    }
    Ok(Some(String::from_utf8(buf).context("stdin is not UTF-8")?))
}

/// `kvplug session ls|show|rm`.
fn sessions(dir: &SessionDir, command: SessionCommand) -> Result<ExitCode> {
    match command {
        SessionCommand::Ls { json } => {
            let all = dir.list()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&all)?);
                return Ok(ExitCode::SUCCESS);
            }
            println!("sessions in {}", dir.dir().display());
            println!(
                "{:<24} {:>8} {:>6} {:>12}  model",
                "name", "tokens", "kv", "bytes"
            );
            for l in all {
                match l.summary {
                    Ok(s) => println!(
                        "{:<24} {:>8} {:>6} {:>12}  {}",
                        l.name,
                        s.tokens,
                        s.kv_dtype,
                        s.bytes,
                        &s.model[..12.min(s.model.len())]
                    ),
                    Err(e) => println!("{:<24} unreadable: {e}", l.name),
                }
            }
        }
        SessionCommand::Show { name, model } => {
            let path = dir.path(&name)?;
            let t = std::time::Instant::now();
            let s = kvplug_host::session_file::read(&path)?;
            let read_ms = t.elapsed().as_secs_f64() * 1e3;
            let sum = kvplug_host::session_file::summary(&path)?;
            println!("session {name}: {}", path.display());
            println!("  tokens       {}", s.tokens.len());
            println!("  kv dtype     {}", s.rows.kv_dtype);
            println!(
                "  shape        {} layers x {} KV heads x head_dim {}",
                s.rows.n_layers, s.rows.n_kv_heads, s.rows.head_dim
            );
            println!(
                "  bytes        {} ({:.0} per token)",
                sum.bytes,
                sum.bytes as f64 / s.tokens.len().max(1) as f64
            );
            println!("  model        {}", s.model);
            println!("  writer       {}", sum.writer);
            println!("  checksum     ok (read and checked in {read_ms:.1} ms)");
            for (k, v) in &s.app {
                let preview: String = v.chars().take(72).collect();
                println!(
                    "  app.{k:<8} {preview}{}",
                    if v.len() > 72 { "…" } else { "" }
                );
            }
            if let Some(m) = model {
                let m = kvplug_host::gguf::resolve_model(&m)?;
                let fp = kvplug_host::fingerprint::model_fingerprint(&m)?;
                s.check_fits(&path, &fp, usize::MAX)?;
                println!("  fits         {}", m.display());
            }
        }
        SessionCommand::Rm { names } => {
            for n in names {
                dir.remove(&n)?;
                println!("removed {n}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn chat_loop(chat: &mut Chat, json: bool) -> Result<ExitCode> {
    use std::io::IsTerminal;
    let tty = std::io::stdin().is_terminal();
    let mut input = std::io::stdin().lock();
    loop {
        if tty {
            eprint!("> ");
        }
        let Some(line) = read_turn(&mut input)? else {
            break;
        };
        let user = line.trim();
        if user.is_empty() {
            continue;
        }
        if user == "/exit" {
            break;
        }
        let report = chat.turn(user, &mut |piece| {
            if !json {
                print!("{piece}");
                std::io::stdout().flush()?;
            }
            Ok(())
        })?;
        if json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            println!();
            eprintln!(
                "[prefilled {} tokens, reused {} from the cache; {} generated at {:.1} tok/s]",
                report.prefilled_tokens,
                report.reused_tokens,
                report.ids.len(),
                report.decode_tok_s
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Code the demo's speculative run rewrites.
const DEMO_CODE: &str = r#"def summarize(orders):
    total = 0
    count = 0
    for order in orders:
        if order.status == "cancelled":
            continue
        total += order.amount
        count += 1
    average = total / count if count else 0
    return {"total": total, "count": count, "average": average}


def apply_discount(orders, rate):
    total = 0
    for order in orders:
        order.amount = order.amount * (1 - rate)
        total += order.amount
    return total
"#;

/// The main job on a real model: a chat answer streamed as text; agents continuing that
/// conversation with different user turns (shared trunk, one forward per step); speculative
/// decoding (prompt lookup) of a code rewrite, identical to greedy, against plain decoding.
fn demo(host: &Host, model: &std::path::Path, backend: &str, max_new: usize) -> Result<ExitCode> {
    if max_new == 0 {
        bail!("--max-new 0 would generate nothing: give at least 1");
    }
    let model = kvplug_host::gguf::resolve_model(model)?;
    let text = Text::load(&model)?;
    let question = Message::new("user", "What is the capital of France?");
    let spec = |prompt: Vec<i32>| RunSpec {
        backend: backend.to_string(),
        model: model.clone(),
        prompt,
        max_new,
        kv_dtype: KvDtype::F16,
        capacity: 2048,
        stop: text.stop_tokens().clone(),
    };
    println!("== chat ({backend}, {})", model.display());
    println!("user: {}", question.content);
    print!("assistant: ");
    let chat = spec(text.encode(&text.render(std::slice::from_ref(&question))?)?);
    let mut streamer = Streamer::default();
    let answer = run_decode_streaming(host, &chat, &mut Sampler::new(0.0, 1.0, 0), &mut |id| {
        print!("{}", streamer.push(&text, id)?);
        std::io::stdout().flush()?;
        Ok(())
    })?;
    println!();
    let reply = text.decode(&answer.ids)?;

    let turns = [
        "And of Germany?",
        "And of Italy?",
        "Which river flows through it?",
        "Name one famous landmark there.",
    ];
    let history = [question.clone(), Message::new("assistant", reply.trim())];
    let trunk_text = text.render_with(&history, false)?;
    let mut suffixes = Vec::new();
    for turn in turns {
        let mut conv = history.to_vec();
        conv.push(Message::new("user", turn));
        let full = text.render(&conv)?;
        let suffix = full
            .strip_prefix(&trunk_text)
            .context("the chat template does not extend a conversation by appending")?;
        suffixes.push(text.encode(suffix)?);
    }
    let fork = run_fork(host, &spec(text.encode(&trunk_text)?), &suffixes)?;
    println!(
        "\n== agents: {} branches share the {}-token conversation (prefilled once), then decode together",
        turns.len(),
        fork.trunk_tokens
    );
    for (turn, ids) in turns.iter().zip(&fork.branches) {
        println!("user: {turn}\nassistant: {}", text.decode(ids)?.trim());
    }

    // Speculative decoding where it pays: rewriting code quotes the prompt, so prompt
    // lookup (ngram) drafts are mostly right.
    let rewrite = Message::new(
        "user",
        &format!("Rewrite this code with the variable `total` renamed to `amount_sum`:\n\n```python\n{DEMO_CODE}```"),
    );
    let code = RunSpec {
        max_new: 200,
        ..spec(text.encode(&text.render(std::slice::from_ref(&rewrite))?)?)
    };
    let plain = run_decode(host, &code, &mut Sampler::new(0.0, 1.0, 0))?;
    let opts = SpecOptions {
        draft: DraftKind::Ngram,
        max_depth: 8,
        max_width: 1,
    };
    let spec_run = run_speculative(host, &code, &opts, &mut Sampler::new(0.0, 1.0, 0))?;
    let same = spec_run.ids == plain.ids;
    println!(
        "\n== speculative (ngram prompt lookup) on a code rewrite ({} prompt tokens): output {} greedy decoding; {:.0}% of drafted tokens accepted, {:.2} tokens per target forward, {:.2}x plain decoding",
        code.prompt.len(),
        if same { "equals" } else { "DIFFERS FROM" },
        spec_run.acceptance.unwrap_or(0.0) * 100.0,
        spec_run.tokens_per_target_forward.unwrap_or(0.0),
        spec_run.decode_tok_s / plain.decode_tok_s
    );

    println!(
        "\n{:<34} {:>8} {:>13} {:>13} {:>11} {:>13} {:>12}",
        "run",
        "tokens",
        "prefill tok/s",
        "decode tok/s",
        "acceptance",
        "tok/target fw",
        "cache bytes"
    );
    let row = |name: &str,
               n: usize,
               pre: Option<f64>,
               dec: f64,
               acc: Option<f64>,
               tpf: Option<f64>,
               bytes: u64| {
        let opt = |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map_or("-".to_string(), f);
        println!(
            "{name:<34} {n:>8} {:>13} {dec:>13.1} {:>11} {:>13} {bytes:>12}",
            opt(pre, &|x| format!("{x:.1}")),
            opt(acc, &|x| format!("{:.0}%", x * 100.0)),
            opt(tpf, &|x| format!("{x:.2}")),
        );
    };
    row(
        "chat (greedy)",
        answer.ids.len(),
        Some(answer.prefill_tok_s),
        answer.decode_tok_s,
        None,
        None,
        answer.cache.allocated_bytes,
    );
    row(
        &format!("agents x{} (one forward per step)", turns.len()),
        fork.branches.iter().map(Vec::len).sum(),
        None,
        fork.decode_tok_s,
        None,
        None,
        fork.cache.allocated_bytes,
    );
    row(
        "code rewrite (greedy)",
        plain.ids.len(),
        Some(plain.prefill_tok_s),
        plain.decode_tok_s,
        None,
        None,
        plain.cache.allocated_bytes,
    );
    row(
        "code rewrite (speculative, ngram)",
        spec_run.ids.len(),
        Some(spec_run.prefill_tok_s),
        spec_run.decode_tok_s,
        spec_run.acceptance,
        spec_run.tokens_per_target_forward,
        spec_run.cache.allocated_bytes,
    );
    Ok(if same {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn plugins(host: &Host, json: bool) -> Result<ExitCode> {
    if json {
        let v = serde_json::json!({
            "plugins": host.plugins(),
            "skipped": host.skipped(),
            "load_seconds": host.load_seconds(),
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&v).context("serialising")?
        );
    } else {
        println!(
            "{:<6} {:<8} {:<24} {:<40} {:<22} {:<22} features",
            "id", "version", "kinds", "device", "kv dtypes", "file"
        );
        for p in host.plugins() {
            println!(
                "{:<6} {:<8} {:<24} {:<40} {:<22} {:<22} {}",
                p.backend_id,
                p.version,
                p.kinds.join(","),
                p.device,
                p.kv_dtypes.join(","),
                p.file.display(),
                if p.features.is_empty() {
                    "-".to_string()
                } else {
                    p.features.join(",")
                }
            );
        }
        for s in host.skipped() {
            println!("skipped {}: {}", s.file.display(), s.reason);
        }
        println!(
            "loaded {} plugin(s) in {:.1} ms",
            host.plugins().len(),
            host.load_seconds() * 1e3
        );
    }
    if host.plugins().is_empty() {
        bail!(
            "no backend loaded (searched: {})",
            PluginSearch::standard(&[], false)
                .dirs
                .iter()
                .map(|d| d.path.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_lines_are_read_one_by_one_and_bounded() {
        let mut input = std::io::Cursor::new(b"hi\nthere".to_vec());
        assert_eq!(read_turn(&mut input).unwrap().as_deref(), Some("hi\n"));
        assert_eq!(read_turn(&mut input).unwrap().as_deref(), Some("there"));
        assert_eq!(read_turn(&mut input).unwrap(), None);
        // A line that never ends (as from /dev/zero) stops at the bound.
        let mut endless = std::io::Cursor::new(vec![b'a'; 2 * MAX_CHAT_LINE as usize]);
        let e = read_turn(&mut endless).unwrap_err().to_string();
        assert_eq!(e, "a chat line is longer than 1048576 bytes");
        let mut exact = std::io::Cursor::new(vec![b'a'; MAX_CHAT_LINE as usize]);
        assert_eq!(read_turn(&mut exact).unwrap().unwrap().len(), 1 << 20);
    }
}
