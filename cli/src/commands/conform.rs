//! `kvplug conform`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use kvplug::{CacheKind, KvDtype, Runtime};
use kvplug_conformance::{
    builtin_scenarios, load_dir, run_matrix, ConformOptions, Inputs, REQUIRE_BACKENDS_ENV,
};

/// Arguments of `kvplug conform`.
#[derive(clap::Args)]
pub struct Args {
    /// Backend to test (repeatable; default: every loaded backend).
    #[arg(long = "backend", value_name = "ID")]
    backends: Vec<String>,
    /// Scenario directory (repeatable); replaces the built-in scenarios.
    #[arg(long = "scenarios", value_name = "DIR")]
    scenarios: Vec<PathBuf>,
    /// Only these kinds (comma-separated).
    #[arg(long, value_delimiter = ',')]
    kinds: Vec<CacheKind>,
    /// Only these KV dtypes (comma-separated).
    #[arg(long, value_delimiter = ',')]
    dtypes: Vec<KvDtype>,
    /// Only these input distributions (comma-separated: uniform, outliers).
    #[arg(long, value_delimiter = ',', value_parser = inputs)]
    inputs: Vec<Inputs>,
    /// One JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

fn inputs(s: &str) -> Result<Inputs, String> {
    Inputs::ALL
        .into_iter()
        .find(|x| x.as_str() == s)
        .ok_or_else(|| format!("unknown inputs '{s}' (expected uniform or outliers)"))
}

pub fn run(runtime: &Runtime, a: Args) -> Result<ExitCode> {
    let scenarios = if a.scenarios.is_empty() {
        builtin_scenarios()
    } else {
        let mut all = Vec::new();
        for dir in &a.scenarios {
            all.extend(load_dir(dir)?);
        }
        all
    };
    let opts = ConformOptions {
        backends: a.backends,
        kinds: a.kinds,
        dtypes: a.dtypes,
        inputs: a.inputs,
        required: std::env::var(REQUIRE_BACKENDS_ENV)
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect(),
    };
    for s in runtime.skipped() {
        eprintln!("skipped {}: {}", s.file.display(), s.reason);
    }
    let matrix = run_matrix(runtime, &scenarios, &opts);
    if a.json {
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
