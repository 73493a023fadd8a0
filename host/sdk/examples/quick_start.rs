//! Load the plugins, pick "cpu" by string, open a model, make a context, generate text.
use std::sync::Arc;

use kvplug::{CacheKind, GenOptions, KvDtype, Message, PluginSearch, Runtime, Sampler, Text};

/// Answers one question with the model at `path` (a GGUF file or a model directory).
pub fn answer(path: &std::path::Path, question: &str) -> kvplug::Result<String> {
    let runtime = Runtime::load(&PluginSearch::of_build()); // the plugins beside this build
    let model = kvplug::open_model(&runtime, "cpu", path)?;
    let text = Arc::new(Text::load(model.dir())?); // tokenizer and chat template
    let mut ctx = model.context(CacheKind::Contiguous, 4096, KvDtype::F16)?;
    let prompt = text.encode(&text.render(&[Message::new("user", question)])?)?;
    let opts = GenOptions {
        max_tokens: 64,
        sampler: Sampler::greedy(),
        stop_tokens: text.stop_tokens().clone(),
        ..GenOptions::default()
    };
    let out = kvplug::generate(
        &mut ctx,
        Some(text.clone()),
        0,
        &prompt,
        0,
        opts,
        &mut |_| Ok(()),
    )?;
    text.decode(&out.ids)
}

#[allow(dead_code)]
fn main() -> kvplug::Result<()> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or("models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf".into());
    println!(
        "{}",
        answer(
            path.as_ref(),
            "Write a Python function that reverses a string."
        )?
    );
    Ok(())
}
