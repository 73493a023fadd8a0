//! `kvplug plan`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Result};
use kvplug::{parse_bytes, plan, Holding, PlanOptions};
use kvplug::{KvDtype, Runtime};

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
    /// The backend to plan for (a loaded plugin's id): how it holds the weights (MXFP4 read
    /// in place or re-encoded at load, block formats widened to f32). Without it, the
    /// weights count as stored, as the cpu backend holds them.
    #[arg(long)]
    backend: Option<String>,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(runtime: &Runtime, a: Args) -> Result<ExitCode> {
    let holding = match &a.backend {
        None => Holding::default(),
        Some(id) => {
            // An unavailable device says nothing of how it would hold the weights.
            let plugin = runtime.plugin(id)?;
            if let Some(why) = plugin.description().device.strip_prefix("unavailable: ") {
                bail!("backend '{id}' has no usable device: {why}");
            }
            Holding::of(plugin)
        }
    };
    let p = plan(&PlanOptions {
        model: a.model,
        budget: a.budget,
        kv_dtype: a.kv_dtype,
        agent_tokens: a.agent_tokens,
        holding,
    })?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
    } else {
        print!("{}", p.render());
    }
    Ok(ExitCode::SUCCESS)
}
