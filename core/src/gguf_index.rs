//! `gguf.json`: a model directory whose weights stay in a GGUF file and are used where they
//! lie. The host writes it (with `config.json` and the tokenizer files derived from the
//! GGUF's metadata); the backend kit reads it, maps the GGUF once and serves each tensor as
//! a range of that mapping in its stored type (no copy, no dequantized file).

use std::collections::BTreeMap;
use std::path::PathBuf;

/// The manifest's file name inside a model directory.
pub const GGUF_INDEX_FILE: &str = "gguf.json";

/// The manifest version this build writes and reads.
pub const GGUF_INDEX_VERSION: u32 = 1;

/// The cache's directory of GGUF index directories (one per file, named by a digest).
pub const INDEX_DIR: &str = "gguf-index";

/// How the two values of each rotary pair sit in a head's q/k rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopePairs {
    /// Pair `i` is `(i, i + head_dim/2)` (Hugging Face's rotate-half; llama.cpp's NEOX).
    #[default]
    Halves,
    /// Pair `i` is `(2i, 2i + 1)`: llama.cpp's converter permutes Llama's q/k rows this way.
    /// Rotating those rows pairwise gives q·k exactly as rotate-half does on the original
    /// rows (the same permutation of both operands leaves their dot product unchanged).
    Interleaved,
}

/// One tensor of the GGUF, named as the Hugging Face package would name it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IndexedTensor {
    /// Stored type: `f32`, `f16`, `bf16`, or a ggml block format (`q4_K`, `q8_0`, ...).
    pub dtype: String,
    /// Row-major shape (`[rows, cols]` for a matrix).
    pub shape: Vec<usize>,
    /// Absolute byte offset in the GGUF file.
    pub offset: u64,
    /// Byte length.
    pub bytes: u64,
    /// Its name in the GGUF (`token_embd.weight`), which errors give; empty in indexes
    /// written before it was kept.
    #[serde(default)]
    pub gguf_name: String,
}

/// The manifest.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct GgufIndex {
    /// [`GGUF_INDEX_VERSION`].
    pub version: u32,
    /// The GGUF file (absolute).
    pub file: PathBuf,
    /// Its length when indexed: a file of another length is refused (re-index it).
    pub file_bytes: u64,
    /// How q/k rows pair their rotary halves.
    pub rope_pairs: RopePairs,
    /// Whether RMSNorm weights already include Gemma's `+ 1` (llama.cpp's converter folds
    /// it in).
    pub norms_plus_one: bool,
    /// Hugging Face tensor name → where it lies.
    pub tensors: BTreeMap<String, IndexedTensor>,
}

/// The GGUF file a model directory indexes, if it indexes one.
pub fn indexed_file(dir: &std::path::Path) -> Option<PathBuf> {
    /// `gguf.json`'s one field read here (the tensors are skipped).
    #[derive(serde::Deserialize)]
    struct File {
        file: PathBuf,
    }
    let text =
        crate::files::read_text(&dir.join(GGUF_INDEX_FILE), crate::files::MAX_TEXT_BYTES).ok()?;
    serde_json::from_str::<File>(&text).ok().map(|f| f.file)
}

/// What a model directory stands for, to name in messages: for an index directory of the
/// cache (`…/gguf-index/DIGEST`, which the user never named) the GGUF it indexes, else
/// `dir` itself.
pub fn model_source(dir: &std::path::Path) -> PathBuf {
    let cached = dir
        .parent()
        .and_then(|p| p.file_name())
        .is_some_and(|n| n == INDEX_DIR);
    cached
        .then(|| indexed_file(dir))
        .flatten()
        .unwrap_or_else(|| dir.to_path_buf())
}

/// The file a model directory's `config.json` speaks for, to name in messages: the GGUF
/// whose metadata it restates when `dir` indexes one, else that `config.json`.
pub fn config_source(dir: &std::path::Path) -> PathBuf {
    indexed_file(dir).unwrap_or_else(|| dir.join("config.json"))
}
