//! `kvplug session ls|show|rm`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use kvplug::SessionDir;
use kvplug::{formats, model_fingerprint, session_file};

/// Saved sessions (see chat --session).
#[derive(clap::Subcommand)]
pub enum Command {
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
    /// Delete sessions (each that can go; the status is 1 if any could not).
    Rm {
        /// Session names.
        #[arg(required = true)]
        names: Vec<String>,
    },
}

/// The model a session belongs to: its name and the start of its fingerprint (the
/// fingerprint alone for files that recorded no name).
fn model_label(s: &session_file::Summary) -> String {
    let short = &s.model[..12.min(s.model.len())];
    if s.model_name.is_empty() {
        short.to_string()
    } else {
        format!("{} ({short})", s.model_name)
    }
}

pub fn run(dir: &SessionDir, command: Command) -> Result<ExitCode> {
    match command {
        Command::Ls { json } => {
            let swept = dir.sweep();
            if !swept.is_empty() {
                let bytes: u64 = swept.iter().map(|s| s.1).sum();
                eprintln!(
                    "removed {} temporary file(s) of crashed writers ({:.1} MB)",
                    swept.len(),
                    bytes as f64 / 1e6
                );
            }
            let all = dir.list()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&all)?);
                return Ok(ExitCode::SUCCESS);
            }
            println!("sessions in {}", dir.dir().display());
            println!(
                "{:<24} {:>8} {:>6} {:>9} {:>12}  model",
                "name", "tokens", "kv", "keys", "bytes"
            );
            for l in all {
                match l.summary {
                    Ok(s) => println!(
                        "{:<24} {:>8} {:>6} {:>9} {:>12}  {}",
                        l.name,
                        s.tokens,
                        s.kv_dtype,
                        s.key_basis,
                        s.bytes,
                        model_label(&s)
                    ),
                    Err(e) => println!("{:<24} unreadable: {e}", l.name),
                }
            }
            let parked = kvplug::parked_in(dir.dir())?;
            if parked.files > 0 {
                println!(
                    "parked agents (NAME.<model>): {} files, {:.1} MB; kvplug serve keeps them \
                     within --agent-disk and --agent-ttl",
                    parked.files,
                    parked.bytes as f64 / 1e6
                );
            }
        }
        Command::Show { name, model } => {
            let path = dir.path(&name)?;
            let t = std::time::Instant::now();
            let s = session_file::read(&path)?;
            let read_ms = t.elapsed().as_secs_f64() * 1e3;
            let sum = session_file::summary(&path)?;
            println!("session {name}: {}", path.display());
            println!("  tokens       {}", s.tokens.len());
            println!("  kv dtype     {}", s.rows.kv_dtype);
            println!("  key basis    {}", s.key_basis);
            println!(
                "  shape        {} layers x {} KV heads x head_dim {}",
                s.rows.n_layers, s.rows.n_kv_heads, s.rows.head_dim
            );
            println!(
                "  bytes        {} ({:.0} per token)",
                sum.bytes,
                sum.bytes as f64 / s.tokens.len().max(1) as f64
            );
            println!("  model        {}", model_label(&sum));
            println!("  fingerprint  {}", s.model);
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
                // The model as given (a GGUF file is served from an index directory).
                let fp = model_fingerprint(&formats::resolve_model(&m)?)?;
                // As a context of its dtype keeps keys by default.
                let dtype: kvplug::KvDtype = s.rows.kv_dtype.parse()?;
                let keys = kvplug::KeyBasis::default_for(dtype);
                s.check_fits(&path, &fp, dtype, keys, usize::MAX)?;
                s.check_conversation(&path)?;
                println!("  fits         {}", m.display());
            }
        }
        Command::Rm { names } => {
            // As rm: a name that cannot go is told, the others still go, and the status
            // says not all went.
            let mut failed = false;
            for n in names {
                match dir.remove(&n) {
                    Ok(()) => println!("removed {n}"),
                    Err(e) => {
                        eprintln!("kvplug: {e:#}");
                        failed = true;
                    }
                }
            }
            if failed {
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
