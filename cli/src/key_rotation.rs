//! The `--no-key-rotation` flag of the commands that run a model.

/// Whether q8/q4 keys are Hadamard-rotated.
#[derive(clap::Args)]
pub struct KeyRotationArgs {
    /// Keep q8/q4 keys unrotated. By default a quantized KV cache stores each head's keys
    /// (and reads its queries) Hadamard-rotated, which lowers their quantization error (README
    /// "Key rotation"; llama.cpp's counterpart is LLAMA_ATTN_ROT_DISABLE=1).
    #[arg(long)]
    no_key_rotation: bool,
}

impl KeyRotationArgs {
    /// Whether keys are rotated.
    pub fn on(&self) -> bool {
        !self.no_key_rotation
    }
}
