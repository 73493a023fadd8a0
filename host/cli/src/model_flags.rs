//! The flags of the commands that run a model which say how its weights are held, its keys
//! stored and its attention computed: `--no-mmap`, `--no-key-rotation`, `--attention`.

use std::path::Path;

use kvplug::{Arithmetic, Llm, LlmBuilder, Runtime};

/// How the model is loaded and its quantized keys stored.
#[derive(clap::Args)]
pub struct ModelFlags {
    /// Keep q8/q4 keys unrotated. By default a quantized KV cache stores each head's keys
    /// (and reads its queries) Hadamard-rotated, which lowers their quantization error
    /// (docs/concepts.md "Key rotation"; llama.cpp's counterpart is
    /// LLAMA_ATTN_ROT_DISABLE=1).
    #[arg(long)]
    no_key_rotation: bool,
    /// Read the weight files into memory instead of mapping them, as llama.cpp's --no-mmap
    /// does: on Linux onto transparent huge pages, which the cpu backend's decode streams
    /// faster (docs/cli.md "Weights in memory"); the whole file is read at load and its pages
    /// are not shared with other processes.
    #[arg(long)]
    no_mmap: bool,
}

impl ModelFlags {
    /// Whether keys are rotated.
    pub fn key_rotation(&self) -> bool {
        !self.no_key_rotation
    }

    /// Whether the weight files are mapped.
    pub fn mmap(&self) -> bool {
        !self.no_mmap
    }

    /// The builder of `model` on `backend` with `runtime`'s plugins, as these flags say.
    pub fn builder(&self, runtime: &Runtime, backend: &str, model: &Path) -> LlmBuilder {
        Llm::builder(model)
            .runtime(runtime)
            .backend(backend)
            .key_rotation(self.key_rotation())
            .mmap(self.mmap())
    }
}

/// The attention arithmetic of the commands that run one (`bench` takes a list instead).
#[derive(clap::Args)]
pub struct AttentionFlag {
    /// Attention arithmetic: `f32` or `int8-query` (default: the cache's own;
    /// docs/conformance.md "Declared arithmetics" says which backend declares which for which
    /// KV dtype).
    /// Refused where the backend does not declare it for the KV dtype.
    #[arg(long, value_name = "ARITHMETIC")]
    attention: Option<Arithmetic>,
}

impl AttentionFlag {
    /// The arithmetic asked for, if any.
    pub fn get(&self) -> Option<Arithmetic> {
        self.attention
    }
}
