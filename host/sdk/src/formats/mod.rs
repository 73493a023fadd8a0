//! Model formats: GGUF files used in place ([`gguf`]), synthetic models ([`synth`]), and
//! [`open_model`], which takes either a model directory or a GGUF file.

pub mod gguf;
mod gguf_file;
pub mod synth;

use std::path::Path;

use kvplug_runtime::{Model, Runtime};

use crate::error::Result;
pub use gguf::resolve_model;

/// The model at `path` (a directory, or a GGUF file indexed once into the cache directory)
/// on `backend`.
pub fn open_model(runtime: &Runtime, backend: &str, path: &Path) -> Result<Model> {
    Ok(runtime.model(backend, &resolve_model(path)?)?)
}
