//! `kvplug bench`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use kvplug::{Arithmetic, CacheKind, KvDtype, Runtime};
use kvplug::{BenchOptions, BenchResult, Readback};

/// `kvplug bench`'s arguments. Lists are comma-separated; every combination runs.
#[derive(clap::Args)]
pub struct Args {
    /// Model: a directory or a GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// Backend ids.
    #[arg(long, value_delimiter = ',', default_value = "cpu")]
    backend: Vec<String>,
    /// Cache kinds.
    #[arg(long, value_delimiter = ',', default_value = "contiguous")]
    kind: Vec<CacheKind>,
    /// KV storage dtypes.
    #[arg(long, value_delimiter = ',', default_value = "f16")]
    kv_dtype: Vec<KvDtype>,
    /// Attention arithmetics (`f32`, `int8-query`; default: the cache's own), each one the
    /// cache declares for the dtype.
    #[arg(long, value_delimiter = ',')]
    attention: Vec<Arithmetic>,
    /// Prompt lengths of the pp tests (0: none).
    #[arg(short = 'p', long, value_delimiter = ',', default_value = "512")]
    n_prompt: Vec<usize>,
    /// Generated tokens of the tg tests (0: none).
    #[arg(short = 'n', long, value_delimiter = ',', default_value = "128")]
    n_gen: Vec<usize>,
    /// Tokens of context before each test.
    #[arg(short = 'd', long, value_delimiter = ',', default_value = "0")]
    n_depth: Vec<usize>,
    /// Timed runs per test.
    #[arg(short = 'r', long, default_value_t = 5)]
    repetitions: usize,
    /// What each decode step reads back: `logits` (the whole row, as llama-bench), `argmax`
    /// (a greedy step's id) or `top-k` (the 64 best ids and logits a sampler draws from).
    #[arg(long, default_value = "logits")]
    readback: Readback,
    /// A JSON array instead of the table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    model_flags: crate::model_flags::ModelFlags,
}

pub fn run(runtime: &Runtime, a: Args) -> Result<ExitCode> {
    let opts = BenchOptions {
        model: a.model,
        backend: a.backend,
        kind: a.kind,
        kv_dtype: a.kv_dtype,
        attention: a.attention,
        n_prompt: a.n_prompt,
        n_gen: a.n_gen,
        n_depth: a.n_depth,
        repetitions: a.repetitions,
        readback: a.readback,
        key_rotation: a.model_flags.key_rotation(),
        mmap: a.model_flags.mmap(),
    };
    // The head comes with the first row: a refused option or model prints no table.
    let mut head = !a.json;
    let results = kvplug::bench(runtime, &opts, &mut |r| {
        if std::mem::take(&mut head) {
            println!("{}", BenchResult::TABLE_HEAD);
        }
        if !a.json {
            println!("{}", r.table_row());
        }
    })?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    } else {
        let devices: std::collections::BTreeSet<_> =
            results.iter().map(|r| (&r.backend, &r.device)).collect();
        for (backend, device) in devices {
            println!("{backend}: {device}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
