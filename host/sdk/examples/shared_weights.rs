//! Memory of one model bound to several caches: loads the model (a package directory or a
//! `.gguf`) on a backend, then binds it to 1, 2, … N caches, running a short prompt and a
//! few decode steps through each, and prints the process RSS and the caches' bytes after
//! every binding. Weights load once per process and backend, so RSS should grow by about
//! one cache's bytes per binding, not by the weights.
//!
//! `cargo run --release -p kvplug --example shared_weights -- MODEL [BACKEND] [N]`
//! (defaults: cpu, 4), after `cargo build --release --workspace` (plugins next to the
//! examples directory).

use anyhow::{Context, Result};
use kvplug::{generate, CacheKind, GenOptions, KvDtype, PluginSearch, Runtime};

/// Resident set size in MiB, from `/proc/self/status`.
fn rss_mib() -> Result<f64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .context("no VmRSS in /proc/self/status")?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()?;
    Ok(kb / 1024.0)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model = args
        .first()
        .context("usage: shared_weights MODEL [BACKEND] [N]")?;
    let backend = args.get(1).map_or("cpu", String::as_str);
    let n: usize = args.get(2).map_or(Ok(4), |s| s.parse())?;
    let runtime = Runtime::load(&PluginSearch::of_build());
    let model = kvplug::Llm::builder(std::path::Path::new(model))
        .runtime(&runtime)
        .backend(backend)
        .build_model()?;
    println!("{backend}: plugins loaded, RSS {:.0} MiB", rss_mib()?);
    let prompt: Vec<i32> = (1..=32).collect();
    let mut bound = Vec::new();
    for i in 1..=n {
        let mut ctx = model.context(CacheKind::Contiguous, 256, KvDtype::F16)?;
        // The prompt, then 8 decode steps.
        let opts = GenOptions {
            max_tokens: 9,
            ..GenOptions::default()
        };
        generate(&mut ctx, None, 0, &prompt, 0, opts, &mut |_| Ok(()))?;
        let cache_bytes: u64 = ctx.stats()?.allocated_bytes;
        bound.push(ctx);
        let total: u64 = bound
            .iter()
            .map(|c| c.stats().map_or(0, |st| st.allocated_bytes))
            .sum();
        println!(
            "{i} binding(s): RSS {:.0} MiB (this cache {:.1} MiB, all caches {:.1} MiB)",
            rss_mib()?,
            cache_bytes as f64 / (1 << 20) as f64,
            total as f64 / (1 << 20) as f64
        );
    }
    Ok(())
}
