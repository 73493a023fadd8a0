//! `kvplug model synth|import`.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use kvplug::formats::{gguf, synth};

/// Model packages.
#[derive(clap::Subcommand)]
pub enum Command {
    /// Write a deterministic random-weight Llama model with kv_cache.* metadata.
    Synth {
        /// `tiny` (tests) or `small` (SmolLM-135M's shape, benchmarks).
        #[arg(long)]
        preset: String,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Weight seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Weight dtype: f32, f16 or bf16.
        #[arg(long, default_value = "f32")]
        dtype: String,
    },
    /// Import a GGUF file of a supported architecture as a model directory (f16 weights,
    /// tokenizer, chat template).
    Import {
        /// The GGUF file.
        gguf: PathBuf,
        /// Output directory (must not exist).
        #[arg(long)]
        out: PathBuf,
    },
}

pub fn run(command: Command) -> Result<ExitCode> {
    match command {
        Command::Synth {
            preset,
            out,
            seed,
            dtype,
        } => {
            let p = synth::PRESETS
                .iter()
                .find(|p| p.name == preset)
                .with_context(|| format!("unknown preset '{preset}' (expected tiny or small)"))?;
            synth::synth(p, &out, seed, &dtype)?;
            println!("wrote {} model to {}", p.name, out.display());
        }
        Command::Import { gguf: file, out } => {
            let bar = indicatif::ProgressBar::new(0).with_style(
                indicatif::ProgressStyle::with_template(
                    "importing {bar:30} {pos}/{len} tensors {msg}",
                )
                .expect("a valid template"),
            );
            if !std::io::stderr().is_terminal() {
                bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
            }
            gguf::import(&file, &out, &mut |done, total, name| {
                bar.set_length(total as u64);
                bar.set_position(done as u64);
                bar.set_message(name.to_string());
            })?;
            bar.finish_and_clear();
            println!("imported {} into {}", file.display(), out.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}
