//! Throughput in the shape of llama.cpp's `llama-bench` (`kvplug bench`), for any model
//! (GGUF included), per backend, cache kind and KV dtype.
//!
//! A test `ppN @ dD` times the prefill of `N` tokens after `D` tokens of context (in
//! micro-batches of [`PREFILL_UBATCH`](crate::generator::PREFILL_UBATCH) through the
//! [`Generator`](crate::Generator), as every prefill runs); `tgN @ dD` times `N` single-token
//! decode steps after `D` tokens, feeding drawn tokens rather than sampled ones, as
//! `llama-bench` does. Each decode step reads its whole row of logits back, as `llama-bench`
//! does, unless [`Readback`] asks for what a greedy or top-k sampler reads instead. Tokens
//! are drawn uniformly from the vocabulary with a fixed seed.
//! Each test runs once untimed (warm-up: pools grown, kernels and buffers ready), then
//! `repetitions` times from the same context: the context is prefilled once per depth and
//! the cache cut back to it before every run (`rewind` on a contiguous cache, `seq_rm` on a
//! seq cache; a tree cache, which cannot be cut, is cleared and prefilled again, as is a
//! cache whose sliding-window layers no longer hold the rows the cut needs). Results
//! carry `llama-bench`'s JSON field names (`n_prompt`, `n_gen`, `n_depth`, `avg_ts`, `stddev_ts`, `samples_ts`) so the two
//! compare directly.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use kvplug_core::{Arithmetic, CacheKind, KeyBasis, KvDtype};
use kvplug_plugin_api::AbiErrorKind;
use kvplug_runtime::{Batch, Context, Runtime};

use crate::error::{fail, Result};
use crate::generator::{generate, GenOptions, DEVICE_TOP_K};

/// What a timed decode step reads back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Readback {
    /// The whole row of logits ([`Context::decode`]), as `llama-bench` measures.
    #[default]
    Logits,
    /// The row's argmax, reduced by the backend ([`Context::decode_argmax`]): a greedy step.
    Argmax,
    /// The row's [`DEVICE_TOP_K`] best ids and logits ([`Context::decode_top_k`]): what a
    /// top-k / top-p / min-p sampler reads.
    TopK,
}

impl Readback {
    /// `logits`, `argmax` or `top-k`.
    pub fn as_str(self) -> &'static str {
        match self {
            Readback::Logits => "logits",
            Readback::Argmax => "argmax",
            Readback::TopK => "top-k",
        }
    }
}

impl std::str::FromStr for Readback {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        [Readback::Logits, Readback::Argmax, Readback::TopK]
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| format!("unknown readback {s:?} (logits, argmax or top-k)"))
    }
}

/// What to measure. Every combination of the lists runs.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Model: a directory or a GGUF file.
    pub model: PathBuf,
    /// Backend ids.
    pub backend: Vec<String>,
    /// Cache kinds.
    pub kind: Vec<CacheKind>,
    /// KV storage dtypes.
    pub kv_dtype: Vec<KvDtype>,
    /// Attention arithmetics (empty: the cache's default); each must be one the cache
    /// declares.
    pub attention: Vec<Arithmetic>,
    /// Prompt lengths of the pp tests (0: none).
    pub n_prompt: Vec<usize>,
    /// Generated tokens of the tg tests (0: none).
    pub n_gen: Vec<usize>,
    /// Tokens of context before each test.
    pub n_depth: Vec<usize>,
    /// Timed runs per test.
    pub repetitions: usize,
    /// What each decode step of a tg test reads back.
    pub readback: Readback,
    /// Whether q8/q4 keys are Hadamard-rotated (the default; see [`kvplug_core::KeyBasis`]).
    pub key_rotation: bool,
    /// Whether the weight files are mapped (the default) or read into memory (see
    /// [`kvplug_runtime::Model::with_mmap`]).
    pub mmap: bool,
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
    /// The attention arithmetic the cache computed with.
    pub attention: String,
    /// The basis keys were stored in (`identity` or `hadamard`).
    pub key_basis: String,
    /// Whether the weight files were mapped (llama-bench's field of the same name).
    pub use_mmap: bool,
    /// Prompt tokens (pp test) or 0.
    pub n_prompt: usize,
    /// Generated tokens (tg test) or 0.
    pub n_gen: usize,
    /// Context before the test.
    pub n_depth: usize,
    /// What each decode step of a tg test read back (`logits`, `argmax`, `top-k`;
    /// [`Readback`]); a pp test records the option given.
    pub readback: &'static str,
    /// Tokens per second of each timed run.
    pub samples_ts: Vec<f64>,
    /// Their mean.
    pub avg_ts: f64,
    /// Their sample standard deviation (0 for one run).
    pub stddev_ts: f64,
    /// The cache's K/V pool bytes after the last run.
    pub cache_bytes: u64,
    /// The backend's counters per token of the last run (`dispatches`, `read_back_bytes`,
    /// ...; empty where the backend keeps none): a test of N tokens divides each
    /// counter's growth over the run by N.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub per_token: BTreeMap<String, f64>,
}

impl BenchResult {
    /// The table's header rows.
    pub const TABLE_HEAD: &str = "| model | backend | kind | kv | test | t/s | cache MiB |\n| --- | --- | --- | --- | ---: | ---: | ---: |";

    /// One table row; `kv` names an attention arithmetic other than f32, and quantized keys
    /// left unrotated, after the dtype; `model` says `no-mmap` after the name where the weights
    /// were read into memory.
    pub fn table_row(&self) -> String {
        let r = self;
        let quantized = r
            .kv_dtype
            .parse::<KvDtype>()
            .is_ok_and(KvDtype::is_quantized);
        let notes: Vec<&str> = [
            (r.attention != Arithmetic::F32.as_str()).then_some(r.attention.as_str()),
            (quantized && r.key_basis == KeyBasis::Identity.as_str()).then_some("unrotated"),
        ]
        .into_iter()
        .flatten()
        .collect();
        let kv = match notes.is_empty() {
            true => r.kv_dtype.clone(),
            false => format!("{} ({})", r.kv_dtype, notes.join(", ")),
        };
        let model = match r.use_mmap {
            true => r.model.clone(),
            false => format!("{} (no-mmap)", r.model),
        };
        format!(
            "| {} | {} | {} | {} | {} | {:.2} ± {:.2} | {:.1} |",
            model,
            r.backend,
            r.kind,
            kv,
            r.test(),
            r.avg_ts,
            r.stddev_ts,
            r.cache_bytes as f64 / (1 << 20) as f64
        )
    }

    /// `pp512`, `tg128 @ d4096`: `llama-bench`'s test names; a tg test that read back
    /// less than the logits says what, `tg128 (argmax)`.
    pub fn test(&self) -> String {
        let mut t = match self.n_prompt {
            0 => format!("tg{}", self.n_gen),
            p => format!("pp{p}"),
        };
        if self.n_depth > 0 {
            t += &format!(" @ d{}", self.n_depth);
        }
        if self.n_prompt == 0 && self.readback != Readback::Logits.as_str() {
            t += &format!(" ({})", self.readback);
        }
        t
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

/// Brings `ctx` to exactly `context`: cut back to it when the cache starts with it
/// (`held` says which context it starts with), else cleared and prefilled. A cut that
/// sliding-window layers refuse (the rows a shorter history needs are gone) prefills again.
fn reset(ctx: &mut Context, context: &[i32], held: &mut Option<usize>) -> Result<()> {
    let d = context.len();
    let cut = match ctx.kind() {
        CacheKind::Contiguous if *held == Some(d) => Some(ctx.rewind(d)),
        CacheKind::Seq if *held == Some(d) => Some(ctx.seq_rm(0, Some(d as i32), None)),
        _ => None,
    };
    match cut {
        Some(Ok(())) => return Ok(()),
        Some(Err(e)) if e.kind != AbiErrorKind::OutOfWindow => return Err(e.into()),
        _ => {}
    }
    ctx.clear()?;
    if d > 0 {
        pp(ctx, context, 0)?;
    }
    *held = Some(d);
    Ok(())
}

/// Seconds to prefill `prompt` at `depth..`.
fn pp(ctx: &mut Context, prompt: &[i32], depth: usize) -> Result<f64> {
    let t = Instant::now();
    let opts = GenOptions::default();
    generate(ctx, None, 0, prompt, depth, opts, &mut |_| Ok(()))?;
    Ok(t.elapsed().as_secs_f64())
}

/// Seconds to decode `ids` one at a time at `depth..` (each step's `readback` read and
/// not sampled, as `llama-bench` measures generation).
fn tg(ctx: &mut Context, ids: &[i32], depth: usize, readback: Readback) -> Result<f64> {
    let t = Instant::now();
    let mut batch = Batch::new();
    for (i, &id) in ids.iter().enumerate() {
        batch.clear();
        batch.push(id, (depth + i) as i32, 0, true);
        match readback {
            Readback::Logits => drop(ctx.decode(&batch)?),
            Readback::Argmax => drop(ctx.decode_argmax(&batch, &[])?),
            Readback::TopK => drop(ctx.decode_top_k(&batch, DEVICE_TOP_K, &[])?),
        }
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Each counter's growth from `before` to `after` per token of a test of `tokens`.
fn counted(
    before: &[(String, u64)],
    after: &[(String, u64)],
    tokens: usize,
) -> BTreeMap<String, f64> {
    after
        .iter()
        .filter_map(|(name, a)| {
            let (_, b) = before.iter().find(|(n, _)| n == name)?;
            Some((
                name.clone(),
                a.saturating_sub(*b) as f64 / tokens.max(1) as f64,
            ))
        })
        .collect()
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

/// Runs every combination of `a` on `runtime`'s backends; `on_result` sees each test as it
/// finishes.
pub fn bench(
    runtime: &Runtime,
    a: &BenchOptions,
    on_result: &mut dyn FnMut(&BenchResult),
) -> Result<Vec<BenchResult>> {
    if a.repetitions == 0 {
        fail!(Invalid, "repetitions must be at least 1");
    }
    let name = a.model.file_name().map_or_else(
        || a.model.display().to_string(),
        |n| n.to_string_lossy().into(),
    );
    let tests: Vec<(usize, usize)> = (a.n_prompt.iter().filter(|&&p| p > 0).map(|&p| (p, 0)))
        .chain(a.n_gen.iter().filter(|&&n| n > 0).map(|&n| (0, n)))
        .collect();
    if tests.is_empty() {
        fail!(
            Invalid,
            "no tests: give a positive prompt or generation length"
        );
    }
    let longest = tests.iter().map(|&(p, n)| p.max(n)).max().unwrap_or(0);
    let capacity = a.n_depth.iter().max().copied().unwrap_or(0) + longest;
    let mut results = Vec::new();
    for backend in &a.backend {
        let plugin = runtime.plugin(backend)?;
        let device = plugin.description().device.clone();
        let model = crate::Llm::builder(&a.model)
            .runtime(runtime)
            .backend(backend)
            .key_rotation(a.key_rotation)
            .mmap(a.mmap)
            .build_model()?;
        for &kind in &a.kind {
            let arithmetics: Vec<Option<Arithmetic>> = match a.attention.len() {
                0 => vec![None],
                _ => a.attention.iter().copied().map(Some).collect(),
            };
            for (&dtype, arithmetic) in a
                .kv_dtype
                .iter()
                .flat_map(|d| arithmetics.iter().map(move |&x| (d, x)))
            {
                let mut ctx = model.context(kind, capacity, dtype)?;
                if let Some(x) = arithmetic {
                    ctx.set_arithmetic(x)?;
                }
                let vocab = model.vocab();
                let mut held = None;
                for &depth in &a.n_depth {
                    let context = tokens(depth, vocab, 1 + depth as u64);
                    for &(p, n) in &tests {
                        let ids = tokens(p.max(n), vocab, 7);
                        // Grown as the runs end: a huge `-r` runs until stopped, never
                        // allocates its count up front.
                        let mut samples = Vec::new();
                        let mut per_token = BTreeMap::new();
                        for rep in 0..=a.repetitions {
                            reset(&mut ctx, &context, &mut held)?;
                            let before = plugin.counters();
                            let secs = match p {
                                0 => tg(&mut ctx, &ids, depth, a.readback)?,
                                _ => pp(&mut ctx, &ids, depth)?,
                            };
                            // Run 0 warms up.
                            if rep > 0 {
                                samples.push(ids.len() as f64 / secs.max(1e-9));
                            }
                            if rep == a.repetitions {
                                per_token = counted(&before, &plugin.counters(), ids.len());
                            }
                        }
                        let (avg_ts, stddev_ts) = mean_sd(&samples);
                        let r = BenchResult {
                            model: name.clone(),
                            backend: backend.clone(),
                            device: device.clone(),
                            kind: kind.as_str().into(),
                            kv_dtype: dtype.to_string(),
                            attention: ctx.arithmetic(),
                            key_basis: ctx.key_basis().to_string(),
                            use_mmap: a.mmap,
                            n_prompt: p,
                            n_gen: n,
                            n_depth: depth,
                            readback: a.readback.as_str(),
                            samples_ts: samples,
                            avg_ts,
                            stddev_ts,
                            cache_bytes: ctx.stats()?.allocated_bytes,
                            per_token,
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
            attention: "f32".into(),
            key_basis: "identity".into(),
            use_mmap: true,
            n_prompt: 512,
            n_gen: 0,
            n_depth: 0,
            readback: "logits",
            samples_ts: vec![],
            avg_ts: 0.0,
            stddev_ts: 0.0,
            cache_bytes: 0,
            per_token: BTreeMap::new(),
        };
        assert_eq!(r.test(), "pp512");
        (r.n_prompt, r.n_gen, r.n_depth) = (0, 128, 4096);
        assert_eq!(r.test(), "tg128 @ d4096");
        r.readback = Readback::Argmax.as_str();
        assert_eq!(r.test(), "tg128 @ d4096 (argmax)");
        assert_eq!("top-k".parse::<Readback>(), Ok(Readback::TopK));
        assert!("topk".parse::<Readback>().is_err());
    }

    #[test]
    fn counters_per_token_are_the_growth_over_the_run() {
        let c = |d: u64, r: u64| vec![("dispatches".to_string(), d), ("read_back_bytes".into(), r)];
        let per = counted(&c(100, 8), &c(100 + 4 * 424, 8 + 4 * 196_608), 4);
        assert_eq!(per["dispatches"], 424.0);
        assert_eq!(per["read_back_bytes"], 196_608.0);
        assert!(
            counted(&[], &c(1, 1), 4).is_empty(),
            "a counter seen once is skipped"
        );
    }

    #[test]
    fn mean_and_sample_deviation() {
        let (m, s) = mean_sd(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
        assert_eq!(m, 5.0);
        // Sum of squared deviations 32 over n - 1 = 7.
        assert!((s - (32.0f64 / 7.0).sqrt()).abs() < 1e-12);
    }
}
