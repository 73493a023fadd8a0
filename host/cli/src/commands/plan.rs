//! `kvplug plan`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use kvplug::KvDtype;
use kvplug::{parse_bytes, plan, PlanOptions};

/// Arguments of `kvplug plan`.
#[derive(clap::Args)]
pub struct Args {
    /// Model: a directory or a GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// Memory for weights and K/V: bytes, or with a unit (KB, MB, GB; KiB, MiB, GiB; K, M, G
    /// are binary: 2G = 2 GiB).
    #[arg(long, value_parser = parse_bytes)]
    budget: u64,
    /// KV storage dtype.
    #[arg(long, default_value = "f16")]
    kv_dtype: KvDtype,
    /// Tokens per agent, for the agents line.
    #[arg(long, default_value_t = 4096)]
    agent_tokens: usize,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<ExitCode> {
    let p = plan(&PlanOptions {
        model: a.model,
        budget: a.budget,
        kv_dtype: a.kv_dtype,
        agent_tokens: a.agent_tokens,
    })?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
    } else {
        print!("{}", p.render());
    }
    Ok(ExitCode::SUCCESS)
}
