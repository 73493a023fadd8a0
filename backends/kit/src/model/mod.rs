//! Model methods, written once over [`ModelDevice`]: the Llama family forward pass
//! (Llama 2/3, Mistral, Qwen2, SmolLM, TinyLlama shapes) reading Hugging Face–style packages.
//!
//! `forward` inputs: token ids (i32 `[T]`), positions (i32 `[T]`), optionally the rows whose
//! logits to return (i32 `[R]`, default all) and a flag asking for hidden features (i32
//! `[1]`). Outputs: logits f32 `[R, vocab]`, then, when asked, the final normed hidden
//! states f32 `[R, hidden]` (features for drafting). Sequence ids travel out of band through
//! the bound cache's `begin_step`.

pub mod blocks;
/// `config.json`'s parser, which lives in core so the runtime reads models with it too.
pub use kvplug_core::model_config as config;
pub mod forward;
pub mod method;
pub mod moe;
pub mod ops;
pub mod package;
pub mod stored;

pub use blocks::BlockFormat;
pub use forward::{Activations, DecoderModel, ForwardOutput};
pub use kvplug_core::{ModelConfig, ModelError};
pub use method::ForwardMethod;
pub use ops::{check_adjust, compose_norm_qkv_heads, ModelDevice, Projection, QkvHeads};
pub use package::{ModelPackage, Residency};
pub use stored::{StoredDtype, StoredTensor, StoredValues};
