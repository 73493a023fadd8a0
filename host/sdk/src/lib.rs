//! # kvplug
//!
//! The SDK over [`kvplug_runtime`]: load plugins, pick a backend by string, open a model
//! (a Hugging Face directory or a GGUF file, used in place), make a context with the cache
//! kind the job needs, and generate.
//!
//! ## Quick start
//!
#![doc = concat!("```no_run\n", include_str!("../../../examples/quick-start/src/main.rs"), "\n```")]
//!
//! ## What is here
//!
//! - [`Llm`]: a loaded model with its text, opened by [`Llm::builder`]; `chat`, `complete`
//!   (and their `_stream` forms) answer on a fresh context, `context` gives the low level.
//! - [`Generator`]: the one generation loop — prefill in micro-batches, sampling, stop
//!   tokens and strings, token limits, a per-token callback — for one sequence or many in
//!   one forward per step (continuous batching). Every runner below is built on it.
//! - [`Sampler`]: greedy, or temperature with top-k and top-p, seeded.
//! - [`Speculation`] ([`speculative`]): a request's option — draft tokens (prompt lookup or a
//!   draft model) verified in its own steps, the output unchanged.
//! - [`run`]: decode (plain or speculative), agent fork and agents.
//! - [`Chat`]: a conversation on one contiguous context that prefills only what is new.
//! - [`AgentStore`]: named agents on one seq context, their K/V hot in the cache or warm in
//!   their session files.
//! - [`session_file`]: saved K/V files ("sessions"), [`session_dir`] where they live.
//! - [`Text`]: tokenizer, chat template, streamed text; [`formats`]: GGUF and synthetic
//!   models; [`plan`]: memory plans; [`bench`]: `llama-bench`-shaped throughput.

pub mod agent_store;
pub mod bench;
pub mod chat;
pub mod chat_template;
pub mod error;
pub mod fingerprint;
pub mod formats;
pub mod generator;
pub mod grammar;
mod llm;
pub mod plan;
pub mod run;
pub mod sampler;
pub mod session_dir;
pub mod session_file;
pub mod speculative;
pub mod stop;
pub mod text;
pub mod tools;

pub use agent_store::{AgentStore, AgentStoreOptions, WarmLimits, WarmUsage};
pub use chat::{Chat, ChatOptions, ChatStats};
pub use error::{Error, Result};
pub use formats::open_model;
pub use generator::{generate, Finish, GenOptions, Generator, TokenEvent, PREFILL_UBATCH};
pub use grammar::{Constraint, GrammarSpec, Grammars};
pub use kvplug_plugin_api::AbiErrorKind;
pub use kvplug_runtime::loader;
pub use kvplug_runtime::{
    Arithmetic, Batch, CacheKind, Context, KeyBasis, KvDtype, Model, PluginSearch, Runtime,
    RuntimeError,
};
pub use llm::{Answer, Llm, LlmBuilder};
pub use sampler::{Adjustments, Sampler};
pub use speculative::{Draft, DraftKind, SpecStats, Speculation};
pub use text::{Message, Text};
