//! `kvplug run`: decode, agents or speculative decoding of one prompt.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use kvplug::{run_agents, run_decode, RunReport, RunSpec};
use kvplug::{Draft, DraftKind, Speculation};
use kvplug::{Message, Model, Runtime, Text};

use crate::sampling::SamplingArgs;

/// Arguments of `kvplug run`.
#[derive(clap::Args)]
pub struct Args {
    /// Backend id.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Model: a directory (config.json + *.safetensors) or a GGUF file (its weights used in
    /// place).
    #[arg(long)]
    model: PathBuf,
    /// Prompt text, sent through the model's chat template as a user turn (unless --raw);
    /// `-` reads it from standard input (up to 64 MiB).
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// Send --prompt as is, without the chat template.
    #[arg(long, requires = "prompt")]
    raw: bool,
    /// A system message before the user turn.
    #[arg(long, requires = "prompt")]
    system: Option<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Prompt token ids, comma-separated.
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true)]
    prompt_ids: Vec<i32>,
    /// Tokens to generate.
    #[arg(short = 'n', long, visible_alias = "max-new", default_value_t = 32)]
    max_tokens: usize,
    /// KV storage dtype.
    #[arg(long, default_value = "f16")]
    kv_dtype: String,
    /// Cache capacity in cells.
    #[arg(long, default_value_t = 4096)]
    capacity: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    model_flags: crate::model_flags::ModelFlags,
    #[command(flatten)]
    attention: crate::model_flags::AttentionFlag,
    /// Agent fork: K branches from the prompt, decoded together, best kept.
    #[arg(long, conflicts_with = "speculative")]
    agents: Option<usize>,
    /// Speculative tree decoding, drafting with KIND: `ngram` (prompt lookup), `draft:PATH`
    /// (a model sharing the vocabulary) or `layers:N` (the target's first N layers).
    #[arg(long, value_name = "KIND")]
    speculative: Option<DraftKind>,
    /// Deepest draft chain per round (the depth adapts below it).
    #[arg(long, default_value_t = 8)]
    depth: usize,
    /// Most draft branches from the root (each adds a chain of target nodes to verify).
    #[arg(long, default_value_t = 1)]
    width: usize,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// The prompt ids of a run: `--prompt-ids`, or `--prompt` through the model's chat template
/// (with `--system`) unless `--raw`; the text layer when the model has one.
/// Most bytes `--prompt -` reads.
const MAX_STDIN_PROMPT: u64 = 64 << 20;

/// The prompt `--prompt -` names: standard input, whole, as mlx-lm reads it.
fn stdin_prompt() -> Result<String> {
    use std::io::Read;
    let mut buf = Vec::new();
    std::io::stdin()
        .take(MAX_STDIN_PROMPT + 1)
        .read_to_end(&mut buf)
        .context("reading the prompt from stdin")?;
    if buf.len() as u64 > MAX_STDIN_PROMPT {
        bail!("the prompt on stdin is longer than {MAX_STDIN_PROMPT} bytes");
    }
    String::from_utf8(buf).context("the prompt on stdin is not UTF-8")
}

fn prompt_of(a: &Args, model: &Model) -> Result<(Vec<i32>, Option<Arc<Text>>)> {
    let text = match Text::load(model.dir()) {
        Ok(t) => Some(Arc::new(t)),
        Err(e) if a.prompt.is_some() => return Err(e.into()),
        Err(_) => None,
    };
    let prompt = match a.prompt.as_deref() {
        Some("-") => Some(stdin_prompt()?),
        p => p.map(String::from),
    };
    let ids = match (&prompt, &text) {
        (Some(p), Some(t)) => {
            if a.raw || !t.has_template() {
                match (a.system.is_some(), a.raw) {
                    (true, true) => bail!("--system needs the model's chat template (drop --raw)"),
                    (true, false) => bail!(
                        "--system needs a chat template, and {} has none",
                        model.source().display()
                    ),
                    (false, false) => eprintln!(
                        "kvplug: {} has no chat template: the prompt runs as raw text (as --raw)",
                        model.source().display()
                    ),
                    (false, true) => {}
                }
                t.encode_raw(p)?
            } else {
                let mut messages = Vec::new();
                if let Some(sys) = &a.system {
                    messages.push(Message::new("system", sys));
                }
                messages.push(Message::new("user", p));
                t.encode(&t.render(&messages)?)?
            }
        }
        _ if a.system.is_some() => bail!("--system goes with --prompt (ids are sent as they are)"),
        _ if !a.prompt_ids.is_empty() => a.prompt_ids.clone(),
        _ => bail!("pass --prompt TEXT or --prompt-ids 1,2,3"),
    };
    Ok((ids, text))
}

pub fn run(runtime: &Runtime, a: Args) -> Result<ExitCode> {
    if a.max_tokens == 0 {
        bail!("--max-tokens 0 would generate nothing: give at least 1");
    }
    let model = a
        .model_flags
        .builder(runtime, &a.backend, &a.model)
        .attention(a.attention.get())
        .build_model()?;
    let (prompt, text) = prompt_of(&a, &model)?;
    let reach = prompt.len().saturating_add(a.max_tokens);
    if let Some(n) = kvplug::trained_context(model.dir())?.filter(|&n| n < reach as u64) {
        eprintln!(
            "warning: this run spans up to {reach} positions (prompt + --max-tokens), past the \
             {n} the model was trained on (max_position_embeddings): output past them may degrade"
        );
    }
    // A harmony answer to a chat prompt shows its content (--raw: all of it).
    let harmony = text.as_ref().is_some_and(|t| t.harmony()) && a.prompt.is_some() && !a.raw;
    let spec = RunSpec {
        prompt,
        max_tokens: a.max_tokens,
        kv_dtype: a.kv_dtype.parse()?,
        capacity: a.capacity,
        stop_tokens: match (&text, a.ignore_eos) {
            (Some(t), false) => t.stop_tokens().clone(),
            _ => Default::default(),
        },
    };
    let sampler = a.sampling.sampler();
    let report: RunReport = if let Some(k) = a.agents {
        run_agents(&model, &spec, k, &sampler)?
    } else {
        let speculate = match &a.speculative {
            Some(kind) => {
                let s = Speculation {
                    max_depth: a.depth,
                    max_width: a.width,
                    ..Speculation::ngram()
                };
                s.check()?;
                Some(Speculation {
                    draft: Draft::open(kind, &model)?,
                    ..s
                })
            }
            None => None,
        };
        let stream = !a.json;
        let progress = std::io::stderr().is_terminal();
        let mut done = 0;
        let mut content = kvplug::harmony::ContentStream::new(harmony);
        let mut show = |t: &str| -> kvplug::Result<()> {
            let shown = content.push(t);
            if stream && !shown.is_empty() {
                print!("{shown}");
                std::io::stdout().flush()?;
            }
            Ok(())
        };
        let report = run_decode(&model, &spec, text.clone(), sampler, speculate, &mut |e| {
            show(&e.text)?;
            done += 1;
            if progress && (done % 16 == 0 || done == spec.max_tokens) {
                eprint!("\rgenerated {done}/{}", spec.max_tokens);
                if done == spec.max_tokens {
                    eprintln!();
                }
            }
            Ok(())
        })?;
        show(&report.text_tail)?;
        report
    };
    // The text of `ids` (an answer or a branch) and, for a harmony answer, its content and
    // reasoning apart; `None` without a tokenizer.
    let answer = |ids: &[i32]| -> Result<Option<(String, Option<kvplug::tools::Parsed>)>> {
        let Some(t) = &text else { return Ok(None) };
        let d = t.detokenize(ids)?;
        let parsed = harmony.then(|| {
            let complete = ids.last().is_some_and(|i| spec.stop_tokens.contains(i));
            kvplug::harmony::parse(&d, &[], complete)
        });
        Ok(Some((d, parsed)))
    };
    // What a text shows: a harmony answer's content, else all of it.
    let shown = |ids: &[i32]| -> Result<Option<String>> {
        Ok(answer(ids)?.map(|(d, p)| p.map_or(d, |p| p.content)))
    };
    let (decoded, parsed) = answer(&report.ids)?.unzip();
    let parsed = parsed.flatten();
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        v["prompt_tokens"] = spec.prompt.len().into();
        v["prompt_ids"] = spec.prompt.clone().into();
        v["generated_tokens"] = report.ids.len().into();
        v["stopped_at_eos"] = report
            .ids
            .last()
            .is_some_and(|t| spec.stop_tokens.contains(t))
            .into();
        match (parsed, decoded) {
            (Some(p), _) => {
                v["text"] = p.content.into();
                v["reasoning"] = p.reasoning.into();
            }
            (None, Some(d)) => v["text"] = d.into(),
            (None, None) => {}
        }
        if let (Some(_), Some(branches)) = (&text, &report.branches) {
            let texts: Vec<Option<String>> = branches
                .iter()
                .map(|ids| shown(ids))
                .collect::<Result<_>>()?;
            v["branch_texts"] = texts.into();
        }
        println!("{}", serde_json::to_string(&v)?);
        return Ok(ExitCode::SUCCESS);
    }
    match (&decoded, report.mode.as_str()) {
        (Some(_), "decode" | "speculative") => println!(),
        (Some(_), _) => println!("{}", shown(&report.ids)?.unwrap_or_default()),
        (None, _) => {
            let ids: Vec<String> = report.ids.iter().map(|i| i.to_string()).collect();
            println!("ids: {}", ids.join(","));
        }
    }
    if let (Some(branches), Some(w)) = (&report.branches, report.winner) {
        for (b, ids) in branches.iter().enumerate() {
            let kept = if b == w { " (kept)" } else { "" };
            match shown(ids)? {
                Some(s) => println!(
                    "--- branch {b}{kept}, {} tokens ---\n{}",
                    ids.len(),
                    s.trim_end()
                ),
                None => println!("branch {b}{kept}: {ids:?}"),
            }
        }
    }
    eprintln!(
        "{} prompt + {} generated tokens; prefill {:.1} tok/s, decode {:.1} tok/s; cache {} bytes, {} cells allocated, {} live",
        spec.prompt.len(),
        report.ids.len(),
        report.prefill_tok_s,
        report.decode_tok_s,
        report.cache.allocated_bytes,
        report.cache.pool_cells,
        report.cache.live_cells
    );
    if report.cache.window_cells > 0 {
        eprintln!(
            "sliding-window layers: {} cells allocated (window plus one micro-batch)",
            report.cache.window_cells
        );
    }
    if let (Some(acc), Some(tpf)) = (report.acceptance, report.tokens_per_target_forward) {
        eprintln!(
            "acceptance {:.1}%, {:.2} tokens per target forward",
            acc * 100.0,
            tpf
        );
    }
    Ok(ExitCode::SUCCESS)
}
