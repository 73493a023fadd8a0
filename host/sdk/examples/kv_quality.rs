//! How much a KV storage dtype, and an attention arithmetic, change a real model's next-token
//! choices, against f16 K/V on the same backend, over six chat prompts:
//!
//! - **teacher-forced top-1 agreement**: f16's greedy continuation of each prompt is fed, as
//!   one batch, to a fresh context of every dtype; at each of its positions the dtype's argmax
//!   is compared with f16's from the same batch. Every position counts, so one near-tie does
//!   not decide the figure as it does a free-running comparison;
//! - **mean KL(f16 ‖ dtype)** of the next-token distributions at those positions, in nats;
//! - **first divergence**: where the dtype's own free-running greedy continuation first
//!   leaves f16's (N = agreed throughout), per prompt.
//!
//! `cargo run --release -p kvplug --example kv_quality -- MODEL [BACKEND] [N] [DTYPES]`
//! (defaults: cpu, 64 tokens, `bf16,q8,q4`), after `cargo build --release --workspace`.
//! Each dtype runs in every attention arithmetic the backend declares for it. End-of-sequence
//! tokens do not stop the continuations (every prompt yields N positions). Quantized dtypes
//! run with their keys Hadamard-rotated (the default) and unrotated.

use std::path::Path;

use anyhow::{ensure, Context as _, Result};
use kvplug::{
    generate, Arithmetic, Batch, CacheKind, Context, GenOptions, KvDtype, Message, Model,
    PluginSearch, Runtime, Sampler, Text, PREFILL_UBATCH,
};

const PROMPTS: [&str; 6] = [
    "Write a python function that reverses a string.",
    "Explain what a KV cache is in two sentences.",
    "Rewrite this loop as a list comprehension: out = []\nfor x in xs:\n    if x > 0:\n        out.append(x * 2)",
    "What is the capital of France, and why is it famous?",
    "Write a haiku about memory bandwidth.",
    "Give three tips for writing fast Rust code.",
];

/// Cells per context: the longest prompt and its continuation fit with room to spare.
const CAPACITY: usize = 4096;

/// A fresh context of `dtype` computing attention in `arithmetic`.
fn context(model: &Model, dtype: KvDtype, arithmetic: Arithmetic) -> Result<Context> {
    let ctx = model.context(CacheKind::Contiguous, CAPACITY, dtype)?;
    ctx.set_arithmetic(arithmetic)?;
    Ok(ctx)
}

/// `n` greedy tokens after `prompt`, end-of-sequence tokens included.
fn greedy(ctx: &mut Context, prompt: &[i32], n: usize) -> Result<Vec<i32>> {
    let opts = GenOptions {
        max_tokens: n,
        sampler: Sampler::greedy(),
        ..GenOptions::default()
    };
    Ok(generate(ctx, None, 0, prompt, 0, opts, &mut |_| Ok(()))?.ids)
}

/// The logits after each of `prompt`'s last token and `forced[..n-1]` (`n = forced.len()`
/// rows, `vocab` each), `prompt ++ forced` fed in micro-batches of [`PREFILL_UBATCH`].
fn forced_logits(ctx: &mut Context, prompt: &[i32], forced: &[i32]) -> Result<Vec<f32>> {
    let tokens = [prompt, &forced[..forced.len() - 1]].concat();
    let first = prompt.len() - 1;
    let mut rows = Vec::with_capacity(forced.len() * ctx.vocab());
    for start in (0..tokens.len()).step_by(PREFILL_UBATCH) {
        let end = (start + PREFILL_UBATCH).min(tokens.len());
        let mut batch = Batch::new();
        for (i, &t) in tokens.iter().enumerate().take(end).skip(start) {
            batch.push(t, i as i32, 0, i >= first);
        }
        let logits = ctx.decode(&batch)?;
        logits.rows().for_each(|r| rows.extend_from_slice(r));
    }
    Ok(rows)
}

fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &x)| {
            if x > best.1 {
                (i, x)
            } else {
                best
            }
        })
        .0
}

/// Log-softmax of `row` in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    row.iter().map(|&x| x as f64 - max - sum.ln()).collect()
}

/// KL(p ‖ q) in nats for logits `p`, `q`.
fn kl(p: &[f32], q: &[f32]) -> f64 {
    let (lp, lq) = (log_softmax(p), log_softmax(q));
    lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum()
}

/// One prompt's reference: its tokens, f16's greedy continuation and f16's teacher-forced
/// logits over it.
struct Reference {
    prompt: Vec<i32>,
    greedy: Vec<i32>,
    logits: Vec<f32>,
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args
        .first()
        .context("usage: kv_quality MODEL [BACKEND] [N] [DTYPES]")?;
    let backend = args.get(1).map_or("cpu", String::as_str);
    let n: usize = args.get(2).map_or(Ok(64), |s| s.parse())?;
    ensure!(n > 0, "N must be at least 1");
    let dtypes: Vec<KvDtype> = args
        .get(3)
        .map_or("bf16,q8,q4", String::as_str)
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let runtime = Runtime::load(&PluginSearch::of_build());
    let model = kvplug::Llm::builder(Path::new(path))
        .runtime(&runtime)
        .backend(backend)
        .build_model()?;
    let text = Text::load(model.dir())?;
    let vocab = model
        .context(CacheKind::Contiguous, CAPACITY, KvDtype::F16)?
        .vocab();

    let mut refs = Vec::new();
    let mut self_agree = 0;
    for p in PROMPTS {
        let prompt = text.encode(&text.render(&[Message::new("user", p)])?)?;
        let mut ctx = context(&model, KvDtype::F16, Arithmetic::F32)?;
        let greedy = greedy(&mut ctx, &prompt, n)?;
        let mut ctx = context(&model, KvDtype::F16, Arithmetic::F32)?;
        let logits = forced_logits(&mut ctx, &prompt, &greedy)?;
        self_agree += logits
            .chunks_exact(vocab)
            .zip(&greedy)
            .filter(|(row, &t)| argmax(row) == t as usize)
            .count();
        refs.push(Reference {
            prompt,
            greedy,
            logits,
        });
    }
    let name = Path::new(path)
        .file_name()
        .map_or(path.as_str(), |s| s.to_str().unwrap_or(path.as_str()));
    let total = n * PROMPTS.len();
    println!(
        "{name} on {backend}, {} prompts x {n} tokens, against f16 K/V (f16's batched argmax \
         matches its own step-by-step greedy tokens at {self_agree} of {total} positions):\n",
        PROMPTS.len()
    );
    println!("| KV dtype | keys | arithmetic | top-1 agreement | mean KL (nats) | first divergence per prompt |");
    println!("| --- | --- | --- | ---: | ---: | --- |");
    let mut runs = Vec::new();
    for &dtype in &dtypes {
        runs.push((dtype, model.clone()));
        if dtype.is_quantized() {
            runs.push((dtype, model.with_key_rotation(false)));
        }
    }
    for &(dtype, ref model) in &runs {
        for arithmetic in Arithmetic::ALL {
            // f32 is always computed; another arithmetic only where the backend declares it
            // for this dtype (setting an undeclared one is refused, and there is nothing to
            // measure).
            let probe = model.context(CacheKind::Contiguous, CAPACITY, dtype)?;
            if arithmetic != Arithmetic::F32 && probe.set_arithmetic(arithmetic).is_err() {
                continue;
            }
            let (mut agree, mut kl_sum) = (0, 0.0);
            let mut firsts = Vec::new();
            for r in &refs {
                let mut ctx = context(model, dtype, arithmetic)?;
                let logits = forced_logits(&mut ctx, &r.prompt, &r.greedy)?;
                for (a, b) in logits.chunks_exact(vocab).zip(r.logits.chunks_exact(vocab)) {
                    agree += usize::from(argmax(a) == argmax(b));
                    kl_sum += kl(b, a);
                }
                let mut ctx = context(model, dtype, arithmetic)?;
                let own = greedy(&mut ctx, &r.prompt, n)?;
                firsts.push(
                    own.iter()
                        .zip(&r.greedy)
                        .position(|(a, b)| a != b)
                        .unwrap_or(n)
                        .to_string(),
                );
            }
            println!(
                "| {dtype} | {} | {arithmetic} | {agree}/{total} ({:.1}%) | {:.5} | {} |",
                model.key_basis(dtype),
                100.0 * agree as f64 / total as f64,
                kl_sum / total as f64,
                firsts.join(" / ")
            );
        }
    }
    Ok(())
}
