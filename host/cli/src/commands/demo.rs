//! `kvplug demo`: the main job on a real model, as a table.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use kvplug::Speculation;
use kvplug::{run_decode, run_fork, RunSpec};
use kvplug::{KvDtype, Message, Runtime, Sampler};

/// Arguments of `kvplug demo`.
#[derive(clap::Args)]
pub struct Args {
    /// Model: a directory with a tokenizer, or a GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// Backend id.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Most tokens to generate per answer.
    #[arg(long, visible_alias = "max-new", default_value_t = 48)]
    max_tokens: usize,
}

/// Code the demo's speculative run rewrites.
const DEMO_CODE: &str = r#"def summarize(orders):
    total = 0
    count = 0
    for order in orders:
        if order.status == "cancelled":
            continue
        total += order.amount
        count += 1
    average = total / count if count else 0
    return {"total": total, "count": count, "average": average}


def apply_discount(orders, rate):
    total = 0
    for order in orders:
        order.amount = order.amount * (1 - rate)
        total += order.amount
    return total
"#;

/// The main job on a real model: a chat answer streamed as text; agents continuing that
/// conversation with different user turns (shared trunk, one forward per step); speculative
/// decoding (prompt lookup) of a code rewrite, identical to greedy, against plain decoding.
pub fn run(runtime: &Runtime, a: Args) -> Result<ExitCode> {
    let (backend, max_tokens) = (a.backend.as_str(), a.max_tokens);
    if max_tokens == 0 {
        bail!("--max-tokens 0 would generate nothing: give at least 1");
    }
    let llm = kvplug::Llm::builder(&a.model)
        .runtime(runtime)
        .backend(backend)
        .build()?;
    let (model, text) = (llm.model(), llm.text());
    let question = Message::new("user", "What is the capital of France?");
    let spec = |prompt: Vec<i32>| RunSpec {
        prompt,
        max_tokens,
        kv_dtype: KvDtype::F16,
        capacity: 2048,
        stop_tokens: text.stop_tokens().clone(),
    };
    println!("== chat ({backend}, {})", model.dir().display());
    println!("user: {}", question.content);
    print!("assistant: ");
    let chat = spec(text.encode(&text.render(std::slice::from_ref(&question))?)?);
    let answer = run_decode(
        model,
        &chat,
        Some(text.clone()),
        Sampler::greedy(),
        None,
        &mut |e| {
            print!("{}", e.text);
            std::io::stdout().flush()?;
            Ok(())
        },
    )?;
    println!();
    let reply = text.detokenize(&answer.ids)?;

    let turns = [
        "And of Germany?",
        "And of Italy?",
        "Which river flows through it?",
        "Name one famous landmark there.",
    ];
    let history = [question.clone(), Message::new("assistant", reply.trim())];
    let trunk_text = text.render_with(&history, false)?;
    let mut suffixes = Vec::new();
    for turn in turns {
        let mut conv = history.to_vec();
        conv.push(Message::new("user", turn));
        let full = text.render(&conv)?;
        let suffix = full
            .strip_prefix(&trunk_text)
            .context("the chat template does not extend a conversation by appending")?;
        suffixes.push(text.encode(suffix)?);
    }
    let fork = run_fork(model, &spec(text.encode(&trunk_text)?), &suffixes)?;
    println!(
        "\n== agents: {} branches share the {}-token conversation (prefilled once), then decode together",
        turns.len(),
        fork.trunk_tokens
    );
    for (turn, ids) in turns.iter().zip(&fork.branches) {
        println!("user: {turn}\nassistant: {}", text.detokenize(ids)?.trim());
    }

    // Speculative decoding where it pays: rewriting code quotes the prompt, so prompt
    // lookup (ngram) drafts are mostly right.
    let rewrite = Message::new(
        "user",
        &format!("Rewrite this code with the variable `total` renamed to `amount_sum`:\n\n```python\n{DEMO_CODE}```"),
    );
    let code = RunSpec {
        max_tokens: 200,
        ..spec(text.encode(&text.render(std::slice::from_ref(&rewrite))?)?)
    };
    let greedy = |speculate| {
        run_decode(
            model,
            &code,
            None,
            Sampler::greedy(),
            speculate,
            &mut |_| Ok(()),
        )
    };
    let plain = greedy(None)?;
    let spec_run = greedy(Some(Speculation::ngram()))?;
    let same = spec_run.ids == plain.ids;
    println!(
        "\n== speculative (ngram prompt lookup) on a code rewrite ({} prompt tokens): output {} greedy decoding; {:.0}% of drafted tokens accepted, {:.2} tokens per target forward, {:.2}x plain decoding",
        code.prompt.len(),
        if same { "equals" } else { "DIFFERS FROM" },
        spec_run.acceptance.unwrap_or(0.0) * 100.0,
        spec_run.tokens_per_target_forward.unwrap_or(0.0),
        spec_run.decode_tok_s / plain.decode_tok_s
    );

    println!(
        "\n{:<34} {:>8} {:>13} {:>13} {:>11} {:>13} {:>12}",
        "run",
        "tokens",
        "prefill tok/s",
        "decode tok/s",
        "acceptance",
        "tok/target fw",
        "cache bytes"
    );
    let row = |name: &str,
               n: usize,
               pre: Option<f64>,
               dec: f64,
               acc: Option<f64>,
               tpf: Option<f64>,
               bytes: u64| {
        let opt = |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map_or("-".to_string(), f);
        println!(
            "{name:<34} {n:>8} {:>13} {dec:>13.1} {:>11} {:>13} {bytes:>12}",
            opt(pre, &|x| format!("{x:.1}")),
            opt(acc, &|x| format!("{:.0}%", x * 100.0)),
            opt(tpf, &|x| format!("{x:.2}")),
        );
    };
    row(
        "chat (greedy)",
        answer.ids.len(),
        Some(answer.prefill_tok_s),
        answer.decode_tok_s,
        None,
        None,
        answer.cache.allocated_bytes,
    );
    row(
        &format!("agents x{} (one forward per step)", turns.len()),
        fork.branches.iter().map(Vec::len).sum(),
        None,
        fork.decode_tok_s,
        None,
        None,
        fork.cache.allocated_bytes,
    );
    row(
        "code rewrite (greedy)",
        plain.ids.len(),
        Some(plain.prefill_tok_s),
        plain.decode_tok_s,
        None,
        None,
        plain.cache.allocated_bytes,
    );
    row(
        "code rewrite (speculative, ngram)",
        spec_run.ids.len(),
        Some(spec_run.prefill_tok_s),
        spec_run.decode_tok_s,
        spec_run.acceptance,
        spec_run.tokens_per_target_forward,
        spec_run.cache.allocated_bytes,
    );
    Ok(if same {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
