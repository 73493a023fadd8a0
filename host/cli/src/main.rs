//! `kvplug`: the command line. One module per command under [`commands`]; clap and
//! progress bars live here and nowhere else.

mod commands;
mod model_flags;
mod sampling;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvplug::{PluginSearch, Runtime};

use commands::{bench, chat, conform, demo, model, plan, plugins, run, serve, session};

/// kvplug: runtime-swappable KV caches behind pluggable backends.
#[derive(Parser)]
#[command(name = "kvplug", version = version_line(), about)]
struct Cli {
    /// Plugin directory (repeatable); searched before KVPLUG_PLUGIN_PATH and the defaults.
    #[arg(long = "plugins", global = true, value_name = "DIR")]
    plugins: Vec<PathBuf>,
    /// Plugin file to load (repeatable). With it only these files and the --plugins
    /// directories are loaded: nothing from KVPLUG_PLUGIN_PATH or the default directories.
    #[arg(long = "plugin", global = true, value_name = "FILE")]
    plugin_files: Vec<PathBuf>,
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
    Plugins(plugins::Args),
    /// Model packages.
    Model {
        #[command(subcommand)]
        command: model::Command,
    },
    /// Generate with a model on a backend: decode, agent fork or speculative decoding.
    Run(run::Args),
    /// Chat: one user turn per line of stdin (a terminal or a pipe); one cache carries the
    /// conversation, so each turn prefills only its new tokens.
    Chat(chat::Args),
    /// Saved sessions (see chat --session).
    Session {
        #[command(subcommand)]
        command: session::Command,
    },
    /// Memory plan: weights, KV bytes per token by layer group, and how many tokens and
    /// agents fit a budget.
    Plan(plan::Args),
    /// An OpenAI- and Anthropic-compatible HTTP server (chat and text completions, the
    /// Responses and Messages APIs, streaming, continuous batching, prefix reuse; agent
    /// sessions by the X-Session-Id header).
    Serve(serve::Args),
    /// Throughput like llama.cpp's llama-bench: pp (prefill) and tg (decode) tokens per second
    /// at context depths, per backend, cache kind and KV dtype.
    Bench(bench::Args),
    /// The main job: a chat answer, agents continuing it, and speculative decoding of a code
    /// rewrite, on one backend, as a table.
    Demo(demo::Args),
    /// Run the cross-backend conformance matrix against the f64 oracle.
    Conform(conform::Args),
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

/// `kvplug --version`: the crate's version and the plugin API this host loads.
fn version_line() -> &'static str {
    static LINE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    LINE.get_or_init(|| {
        format!(
            "{} ({})",
            env!("CARGO_PKG_VERSION"),
            kvplug::loader::api_version_line()
        )
    })
}

/// Output that cannot be written (stdout on a full disk, `> /dev/full`) ends the process
/// with the error and status 1, as a failed command does, instead of a panic report: the
/// commands print with `println!`, which panics there. Other panics keep the default report.
fn exit_on_unwritable_stdout() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied());
        match message.filter(|m| m.starts_with("failed printing to stdout")) {
            Some(m) => {
                eprintln!("kvplug: {m}");
                std::process::exit(1);
            }
            None => report(info),
        }
    }));
}

/// The hidden argument that starts this binary as its own chat-template sandbox.
const RENDER_TEMPLATE: &str = "__render-template";

fn main() -> ExitCode {
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == RENDER_TEMPLATE)
    {
        return kvplug::serve_sandboxed();
    }
    // Templates come from model files: render them in a child of this binary, bounded.
    if let Ok(exe) = std::env::current_exe() {
        let _ = kvplug::Sandbox::new(exe, [RENDER_TEMPLATE]).install();
    }
    ensure_runtime_dir();
    let cli = Cli::parse();
    let serving = matches!(cli.command, Command::Serve(_));
    // A server's own warnings (parked agents removed, constrained decoding unavailable) are
    // its log; otherwise errors only (`kvplug plugins` lists skipped plugins).
    let quiet = if serving {
        "error,kvplug::agent_store=warn,kvplug_server=warn"
    } else {
        "error"
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(quiet)),
        )
        .with_writer(std::io::stderr)
        .init();
    if !serving {
        // Output into a closed pipe (`kvplug session ls | head -1`) ends the process quietly,
        // as it does for other command-line tools; the server keeps Rust's default (ignored),
        // where a client going away is an error on its own connection.
        // SAFETY: setting a signal's disposition to the default before any thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
        exit_on_unwritable_stdout();
    }
    match dispatch(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvplug: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn dispatch(cli: Cli) -> anyhow::Result<ExitCode> {
    let search = if cli.plugin_files.is_empty() {
        PluginSearch::standard(&cli.plugins, cli.allow_insecure_plugins)
    } else {
        let mut only = PluginSearch::only(&cli.plugins, cli.allow_insecure_plugins);
        only.files = cli.plugin_files.clone();
        only
    };
    let runtime = Runtime::load(&search);
    let sessions = kvplug::SessionDir::standard(cli.session_dir.as_deref());
    match cli.command {
        Command::Plugins(a) => plugins::run(&runtime, &search, a),
        Command::Model { command } => model::run(command),
        Command::Run(a) => run::run(&runtime, a),
        Command::Chat(a) => chat::run(&runtime, &sessions, a),
        Command::Session { command } => session::run(&sessions, command),
        Command::Plan(a) => plan::run(&runtime, a),
        Command::Serve(a) => serve::run(&runtime, &sessions, a),
        Command::Bench(a) => bench::run(&runtime, a),
        Command::Demo(a) => demo::run(&runtime, a),
        Command::Conform(a) => conform::run(&runtime, a),
    }
}
