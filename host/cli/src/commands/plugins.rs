//! `kvplug plugins`: loaded backends and skipped files.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use kvplug::{Holding, PluginSearch, Runtime, Weights};

/// Arguments of `kvplug plugins`.
#[derive(clap::Args)]
pub struct Args {
    /// A model (directory or GGUF file): also show, per backend, what its weights take
    /// there (bytes as held, total and active parameters, expert bytes).
    #[arg(long)]
    model: Option<PathBuf>,
    /// One JSON object instead of tables.
    #[arg(long)]
    json: bool,
}

pub fn run(runtime: &Runtime, search: &PluginSearch, a: Args) -> Result<ExitCode> {
    // The model's weights on each backend, in the order of `runtime.plugins()`.
    let weights: Vec<Weights> = match &a.model {
        None => Vec::new(),
        Some(m) => runtime
            .plugins()
            .iter()
            .map(|p| kvplug::weights(m, &Holding::of(p)))
            .collect::<Result<_, _>>()
            .with_context(|| format!("counting the weights of {}", m.display()))?,
    };
    if a.json {
        let mut v = serde_json::json!({
            "plugins": runtime.plugins(),
            "skipped": runtime.skipped(),
            "load_seconds": runtime.load_seconds(),
        });
        if a.model.is_some() {
            let by_id = runtime.plugins().iter().zip(&weights);
            v["model_weights"] = by_id
                .map(|(p, w)| Ok((p.backend_id.clone(), serde_json::to_value(w)?)))
                .collect::<serde_json::Result<serde_json::Map<_, _>>>()?
                .into();
        }
        println!(
            "{}",
            serde_json::to_string_pretty(&v).context("serialising")?
        );
    } else {
        let mut rows = vec![[
            "id",
            "version",
            "api",
            "kinds",
            "device",
            "kv dtypes",
            "file",
            "features",
        ]
        .map(String::from)];
        for p in runtime.plugins() {
            let d = p.description();
            let features = match d.features.is_empty() {
                true => "-".to_string(),
                false => d.features.join(","),
            };
            rows.push([
                p.backend_id.to_string(),
                d.version.to_string(),
                p.api_version.to_string(),
                p.kinds.join(","),
                d.device.to_string(),
                d.kv_dtypes.join(","),
                p.file.display().to_string(),
                features,
            ]);
        }
        // Each column as wide as its widest cell (devices and paths vary in length).
        let widths: Vec<usize> = (0..8)
            .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
            .collect();
        for r in &rows {
            let cells: Vec<String> = r[..7]
                .iter()
                .zip(&widths)
                .map(|(cell, &w)| format!("{cell:<w$}"))
                .collect();
            println!("{}  {}", cells.join("  "), r[7]);
        }
        for (p, w) in runtime.plugins().iter().zip(&weights) {
            println!("\non {}:", p.backend_id);
            print!("{}", w.render());
        }
        if !weights.is_empty() {
            println!();
        }
        for s in runtime.skipped() {
            println!("skipped {}: {}", s.file.display(), s.reason);
        }
        println!(
            "loaded {} plugin(s) in {:.1} ms",
            runtime.plugins().len(),
            runtime.load_seconds() * 1e3
        );
    }
    if runtime.plugins().is_empty() {
        let searched: Vec<String> = search
            .files
            .iter()
            .chain(search.dirs.iter().map(|d| &d.path))
            .map(|p| p.display().to_string())
            .collect();
        bail!("no backend loaded (searched: {})", searched.join(", "));
    }
    Ok(ExitCode::SUCCESS)
}
