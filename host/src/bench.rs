//! `kvplug bench`: prompt processing and generation throughput in the shape of llama.cpp's
//! `llama-bench`, for any model (GGUF included), per backend, cache kind and KV dtype.
//!
//! A test `ppN @ dD` times the prefill of `N` tokens after `D` tokens of context (in
//! micro-batches of [`PREFILL_UBATCH`](crate::run::PREFILL_UBATCH), as every prefill runs); `tgN @ dD` times `N` single-token
//! decode steps after `D` tokens. Tokens are drawn uniformly from the vocabulary with a fixed
//! seed, as `llama-bench` does. Each test runs once untimed (warm-up: pools grown, kernels
//! and buffers ready), then `repetitions` times from the same context: the context is
//! prefilled once per depth and the cache cut back to it before every run (`rewind` on a
//! contiguous cache, `seq_rm` on a seq cache; a tree cache, which cannot be cut, is cleared
//! and prefilled again). Results carry `llama-bench`'s JSON field names (`n_prompt`,
//! `n_gen`, `n_depth`, `avg_ts`, `stddev_ts`, `samples_ts`) so the two compare directly.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use kvplug_core::{CacheKind, KvDtype};

use crate::host::Host;
use crate::model::cache_config;
use crate::run::Forward;
use crate::session::CacheSession;
use kvplug_plugin_api::abi_stable::std_types::{RNone, RSlice, RSome};

/// `kvplug bench`'s arguments. Lists are comma-separated; every combination runs.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Model: a directory or a GGUF file.
    #[arg(long)]
    pub model: PathBuf,
    /// Backend ids.
    #[arg(long, value_delimiter = ',', default_value = "cpu")]
    pub backend: Vec<String>,
    /// Cache kinds.
    #[arg(long, value_delimiter = ',', default_value = "contiguous")]
    pub kind: Vec<CacheKind>,
    /// KV storage dtypes.
    #[arg(long, value_delimiter = ',', default_value = "f16")]
    pub kv_dtype: Vec<KvDtype>,
    /// Prompt lengths of the pp tests (0: none).
    #[arg(short = 'p', long, value_delimiter = ',', default_value = "512")]
    pub n_prompt: Vec<usize>,
    /// Generated tokens of the tg tests (0: none).
    #[arg(short = 'n', long, value_delimiter = ',', default_value = "128")]
    pub n_gen: Vec<usize>,
    /// Tokens of context before each test.
    #[arg(short = 'd', long, value_delimiter = ',', default_value = "0")]
    pub n_depth: Vec<usize>,
    /// Timed runs per test.
    #[arg(short = 'r', long, default_value_t = 5)]
    pub repetitions: usize,
    /// A JSON array instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// One test's figures.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchResult {
    /// The model's file or directory name.
    pub model: String,
    /// Backend id.
    pub backend: String,
    /// The backend's device description (threads, kernels).
    pub device: String,
    /// Cache kind.
    pub kind: String,
    /// KV storage dtype.
    pub kv_dtype: String,
    /// Prompt tokens (pp test) or 0.
    pub n_prompt: usize,
    /// Generated tokens (tg test) or 0.
    pub n_gen: usize,
    /// Context before the test.
    pub n_depth: usize,
    /// Tokens per second of each timed run.
    pub samples_ts: Vec<f64>,
    /// Their mean.
    pub avg_ts: f64,
    /// Their sample standard deviation (0 for one run).
    pub stddev_ts: f64,
    /// The cache's K/V pool bytes after the last run.
    pub cache_bytes: u64,
}

impl BenchResult {
    /// `pp512`, `tg128 @ d4096`: `llama-bench`'s test names.
    pub fn test(&self) -> String {
        let t = match self.n_prompt {
            0 => format!("tg{}", self.n_gen),
            p => format!("pp{p}"),
        };
        match self.n_depth {
            0 => t,
            d => format!("{t} @ d{d}"),
        }
    }
}

/// Deterministic tokens in `0..vocab` (xorshift; the figures do not depend on the ids).
fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<i32> {
    let mut s = seed.max(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as i32
        })
        .collect()
}

/// A forward and its cache, run as one sequence (seq 0 on a seq cache).
struct Bench {
    session: CacheSession,
    fwd: Forward,
}

impl Bench {
    /// Names sequence 0 for the next step's `n` tokens (seq caches only).
    fn begin(session: &CacheSession, n: usize) -> Result<()> {
        if session.kind() == CacheKind::Seq {
            let seqs = vec![0; n];
            session
                .cache()
                .begin_step(RSlice::from_slice(&seqs))
                .into_result()?;
        }
        Ok(())
    }

    /// Brings the cache to exactly `context`: cut back to it when the cache starts with it
    /// (`ctx` says which context it starts with), else cleared and prefilled.
    fn reset(&mut self, context: &[i32], ctx: &mut Option<usize>) -> Result<()> {
        let (d, cache) = (context.len(), self.session.cache());
        match self.session.kind() {
            CacheKind::Contiguous if *ctx == Some(d) => {
                return Ok(cache.rewind(d as u64).into_result()?)
            }
            CacheKind::Seq if *ctx == Some(d) => {
                return Ok(cache.seq_rm(0, RSome(d as i32), RNone).into_result()?)
            }
            _ => {}
        }
        self.session.clear()?;
        if d > 0 {
            self.pp(context, 0)?;
        }
        *ctx = Some(d);
        Ok(())
    }

    /// Seconds to prefill `prompt` at `depth..`.
    fn pp(&mut self, prompt: &[i32], depth: usize) -> Result<f64> {
        let session = &self.session;
        let t = Instant::now();
        self.fwd
            .prefill(prompt, depth, &mut |n| Self::begin(session, n))?;
        Ok(t.elapsed().as_secs_f64())
    }

    /// Seconds to decode `ids` one at a time at `depth..`.
    fn tg(&mut self, ids: &[i32], depth: usize) -> Result<f64> {
        let t = Instant::now();
        for (i, id) in ids.iter().enumerate() {
            Self::begin(&self.session, 1)?;
            self.fwd
                .call(std::slice::from_ref(id), &[(depth + i) as i32], None)?;
        }
        Ok(t.elapsed().as_secs_f64())
    }
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = match v.len() {
        0 | 1 => 0.0,
        _ => v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0),
    };
    (mean, var.sqrt())
}

/// Runs every combination of `a`; `on_result` sees each test as it finishes.
pub fn run(
    host: &Host,
    a: &BenchArgs,
    on_result: &mut dyn FnMut(&BenchResult),
) -> Result<Vec<BenchResult>> {
    if a.repetitions == 0 {
        bail!("--repetitions must be at least 1");
    }
    let model = crate::gguf::resolve_model(&a.model)?;
    let name = a.model.file_name().map_or_else(
        || a.model.display().to_string(),
        |n| n.to_string_lossy().into(),
    );
    let tests: Vec<(usize, usize)> = (a.n_prompt.iter().filter(|&&p| p > 0).map(|&p| (p, 0)))
        .chain(a.n_gen.iter().filter(|&&n| n > 0).map(|&n| (0, n)))
        .collect();
    if tests.is_empty() {
        bail!("no tests: give a positive -p or -n");
    }
    let longest = tests.iter().map(|&(p, n)| p.max(n)).max().unwrap_or(0);
    let capacity = a.n_depth.iter().max().copied().unwrap_or(0) + longest;
    let mut results = Vec::new();
    for backend in &a.backend {
        let device = host.plugin(backend)?.device.clone();
        for &kind in &a.kind {
            for &dtype in &a.kv_dtype {
                let cfg = cache_config(&model, None, capacity, dtype)?;
                let (session, options) = host.make_session(backend, kind, &cfg)?;
                let fwd = Forward::load(host, backend, &model, None, options)?;
                let vocab = fwd.vocab();
                let mut b = Bench { session, fwd };
                let mut ctx = None;
                for &depth in &a.n_depth {
                    let context = tokens(depth, vocab, 1 + depth as u64);
                    for &(p, n) in &tests {
                        let ids = tokens(p.max(n), vocab, 7);
                        let mut samples = Vec::with_capacity(a.repetitions);
                        for rep in 0..=a.repetitions {
                            b.reset(&context, &mut ctx)?;
                            let secs = match p {
                                0 => b.tg(&ids, depth)?,
                                _ => b.pp(&ids, depth)?,
                            };
                            // Run 0 warms up.
                            if rep > 0 {
                                samples.push(ids.len() as f64 / secs.max(1e-9));
                            }
                        }
                        let (avg_ts, stddev_ts) = mean_sd(&samples);
                        let r = BenchResult {
                            model: name.clone(),
                            backend: backend.clone(),
                            device: device.clone(),
                            kind: kind.as_str().into(),
                            kv_dtype: dtype.to_string(),
                            n_prompt: p,
                            n_gen: n,
                            n_depth: depth,
                            samples_ts: samples,
                            avg_ts,
                            stddev_ts,
                            cache_bytes: b.session.stats()?.allocated_bytes,
                        };
                        on_result(&r);
                        results.push(r);
                    }
                }
            }
        }
    }
    Ok(results)
}

/// The table's header rows.
pub const TABLE_HEAD: &str = "| model | backend | kind | kv | test | t/s | cache MiB |\n| --- | --- | --- | --- | ---: | ---: | ---: |";

/// One table row.
pub fn table_row(r: &BenchResult) -> String {
    format!(
        "| {} | {} | {} | {} | {} | {:.2} ± {:.2} | {:.1} |",
        r.model,
        r.backend,
        r.kind,
        r.kv_dtype,
        r.test(),
        r.avg_ts,
        r.stddev_ts,
        r.cache_bytes as f64 / (1 << 20) as f64
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_names_follow_llama_bench() {
        let mut r = BenchResult {
            model: "m".into(),
            backend: "cpu".into(),
            device: String::new(),
            kind: "contiguous".into(),
            kv_dtype: "f16".into(),
            n_prompt: 512,
            n_gen: 0,
            n_depth: 0,
            samples_ts: vec![],
            avg_ts: 0.0,
            stddev_ts: 0.0,
            cache_bytes: 0,
        };
        assert_eq!(r.test(), "pp512");
        (r.n_prompt, r.n_gen, r.n_depth) = (0, 128, 4096);
        assert_eq!(r.test(), "tg128 @ d4096");
    }

    #[test]
    fn mean_and_sample_deviation() {
        let (m, s) = mean_sd(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
        assert_eq!(m, 5.0);
        // Sum of squared deviations 32 over n - 1 = 7.
        assert!((s - (32.0f64 / 7.0).sqrt()).abs() < 1e-12);
    }
}
