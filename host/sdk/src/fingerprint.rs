//! A model's identity for session files: what K/V rows computed by one model mean only to
//! that model.

use std::path::Path;

use crate::error::{Context, Result};
use kvplug_core::files::{open_regular, read_text, MAX_TEXT_BYTES};
use safetensors::SafeTensors;

/// A readable name for the model package in `dir`, for listings: the GGUF file's name
/// without its extension for weights read in place from one, else the directory's name.
/// Not an identity ([`model_fingerprint`] is).
pub fn model_name(dir: &Path) -> String {
    let gguf = kvplug_core::gguf_index::indexed_file(dir);
    let named = gguf.as_deref().unwrap_or(dir);
    let stem = if gguf.is_some() {
        named.file_stem()
    } else {
        named.file_name()
    };
    stem.map_or_else(
        || dir.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    )
}

/// The BLAKE3 (hex) of the model package in `dir`: its `config.json` (parsed, so formatting
/// does not count) and, shard by shard in name order (or, for weights in a GGUF, tensor by
/// tensor in name order), every tensor's name, dtype, shape and content hash. Reads every weight once (about 0.1 s per 250 MB here).
pub fn model_fingerprint(dir: &Path) -> Result<String> {
    let mut h = blake3::Hasher::new();
    h.update(b"kvplug-model-fingerprint-v1\0");
    let config: serde_json::Value =
        serde_json::from_str(&read_text(&dir.join("config.json"), MAX_TEXT_BYTES)?)
            .with_context(|| format!("{}: config.json", dir.display()))?;
    h.update(config.to_string().as_bytes());
    let index = dir.join(kvplug_core::gguf_index::GGUF_INDEX_FILE);
    if index.exists() {
        // Weights in place in a GGUF: every indexed tensor's name, type, shape and bytes.
        let index: kvplug_core::GgufIndex =
            serde_json::from_str(&read_text(&index, MAX_TEXT_BYTES)?)
                .with_context(|| format!("{}", index.display()))?;
        let (file, _) = open_regular(&index.file)?;
        // SAFETY: read-only map of a model file; it is not modified while we hash it.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .with_context(|| format!("mapping {}", index.file.display()))?;
        for (name, t) in &index.tensors {
            let bytes = usize::try_from(t.offset)
                .ok()
                .zip(usize::try_from(t.offset + t.bytes).ok())
                .and_then(|(a, b)| map.get(a..b))
                .with_context(|| format!("{name} lies outside {}", index.file.display()))?;
            h.update(name.as_bytes());
            h.update(format!("\0{}\0{:?}\0", t.dtype, t.shape).as_bytes());
            h.update(blake3::hash(bytes).as_bytes());
        }
        return Ok(h.finalize().to_hex().to_string());
    }
    let mut shards: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    shards.sort();
    for shard in shards {
        let (file, _) = open_regular(&shard)?;
        // SAFETY: read-only map of a model file; it is not modified while we hash it.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .with_context(|| format!("mapping {}", shard.display()))?;
        let st = SafeTensors::deserialize(&map)
            .with_context(|| format!("{}: not a safetensors file", shard.display()))?;
        let mut tensors = st.tensors();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, view) in tensors {
            h.update(name.as_bytes());
            h.update(format!("\0{:?}\0{:?}\0", view.dtype(), view.shape()).as_bytes());
            h.update(blake3::hash(view.data()).as_bytes());
        }
    }
    Ok(h.finalize().to_hex().to_string())
}
