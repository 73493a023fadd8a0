//! `kvplug plugins`: loaded backends and skipped files.

use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use kvplug::{PluginSearch, Runtime};

/// Arguments of `kvplug plugins`.
#[derive(clap::Args)]
pub struct Args {
    /// One JSON object instead of tables.
    #[arg(long)]
    json: bool,
}

pub fn run(runtime: &Runtime, a: Args) -> Result<ExitCode> {
    if a.json {
        let v = serde_json::json!({
            "plugins": runtime.plugins(),
            "skipped": runtime.skipped(),
            "load_seconds": runtime.load_seconds(),
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
        for p in runtime.plugins() {
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
