//! `kvplug`: the host CLI.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use kvplug_conformance::{builtin_scenarios, load_dir};
use kvplug_core::{CacheKind, KvDtype};
use kvplug_host::conform::{run_matrix, ConformOptions, REQUIRE_BACKENDS_ENV};
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
        /// One JSON object instead of the table.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
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
        Command::Conform {
            backends,
            scenarios,
            kinds,
            dtypes,
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
