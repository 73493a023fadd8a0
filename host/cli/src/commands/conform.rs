//! `kvplug conform`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Result};
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
    /// Only the scenario of this name (repeatable; `kvplug conform --list` names them).
    #[arg(long = "scenario", value_name = "NAME")]
    only: Vec<String>,
    /// List the scenarios (name and description) instead of running them.
    #[arg(long)]
    list: bool,
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
    if let Some(unknown) = a
        .only
        .iter()
        .find(|n| !scenarios.iter().any(|s| &s.name == *n))
    {
        let names: Vec<&str> = scenarios.iter().map(|s| s.name.as_str()).collect();
        bail!(
            "no scenario named '{unknown}' (there are: {})",
            names.join(", ")
        );
    }
    let scenarios: Vec<_> = scenarios
        .into_iter()
        .filter(|s| a.only.is_empty() || a.only.contains(&s.name))
        .collect();
    if a.list {
        let w = scenarios.iter().map(|s| s.name.len()).max().unwrap_or(0);
        for s in &scenarios {
            println!("{:w$}  {}", s.name, s.description);
        }
        return Ok(ExitCode::SUCCESS);
    }
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
