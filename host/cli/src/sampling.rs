//! The sampling flags `run` and `chat` share.

use kvplug::{check_temperature, check_top_p, Sampler};

/// How tokens are picked: greedy unless a temperature is given.
#[derive(clap::Args)]
pub struct SamplingArgs {
    /// Sampling temperature, finite and >= 0 (0 = greedy, the default).
    #[arg(long, visible_alias = "temp", default_value_t = 0.0, value_parser = temperature, allow_negative_numbers = true)]
    temperature: f32,
    /// Nucleus mass, in (0, 1].
    #[arg(long, default_value_t = 1.0, value_parser = top_p)]
    top_p: f32,
    /// Keep only the K most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

fn finite(s: &str) -> Result<f32, String> {
    let v: f32 = s.parse().map_err(|e| format!("'{s}': {e}"))?;
    if v.is_finite() {
        Ok(v)
    } else {
        Err(format!("'{s}' is not a finite number"))
    }
}

fn temperature(s: &str) -> Result<f32, String> {
    let v = finite(s)?;
    check_temperature(v).map(|_| v)
}

fn top_p(s: &str) -> Result<f32, String> {
    let v = finite(s)?;
    check_top_p(v).map(|_| v)
}

impl SamplingArgs {
    /// The sampler these flags ask for.
    pub fn sampler(&self) -> Sampler {
        Sampler::new(self.temperature, self.top_p, self.seed).with_top_k(self.top_k)
    }
}
