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
//! - [`Speculation`]: a request's option — draft tokens (prompt lookup or a draft model)
//!   verified in its own steps, the output unchanged.
//! - [`run_decode`] (plain or speculative), [`run_fork`], [`run_agents`]: `kvplug run`.
//! - [`Chat`]: a conversation on one contiguous context that prefills only what is new.
//! - [`AgentStore`]: named agents on one seq context, their K/V hot in the cache or warm in
//!   their session files.
//! - [`session_file`]: saved K/V files ("sessions"), [`SessionDir`] where they live.
//! - [`Text`]: tokenizer, chat template, streamed text; [`Grammars`]: constrained decoding;
//!   [`tools`]: tool calls as templates write them.
//! - [`formats`]: GGUF and synthetic models; [`plan()`]: memory plans; [`weights()`]: what
//!   a model's weights take on a backend; [`bench()`]: `llama-bench`-shaped throughput.

mod agent_store;
mod bench;
mod chat;
mod chat_template;
mod error;
mod fingerprint;
pub mod formats;
mod generator;
mod grammar;
pub mod harmony;
mod llm;
mod logprobs;
mod plan;
mod run;
mod sampler;
mod session_dir;
pub mod session_file;
mod speculative;
mod stop;
mod text;
pub mod tools;

pub use agent_store::{
    check_agent_name, parked_in, AgentStore, AgentStoreOptions, Divergence, Placed, Reply,
    WarmLimits, WarmUsage,
};
pub use bench::{bench, BenchOptions, BenchResult, Readback};
pub use chat::{Chat, ChatOptions, ChatStats, Restored, TurnReport};
pub use error::{Error, Result};
pub use fingerprint::model_fingerprint;
pub use generator::{
    generate, Finish, Finished, GenOptions, Generation, Generator, RequestId, TokenEvent,
    Triggered, DEVICE_TOP_K, MAX_LOGPROBS, PREFILL_UBATCH, SCORED_UBATCH,
};
pub use grammar::{json_rule, Constraint, GrammarSpec, Grammars};
/// The errors [`Error`]'s variants carry, so that a host can match on them with this crate
/// alone.
pub use kvplug_core::{dtype::ParseDtypeError, files::FileError, CacheError, ModelError};
pub use kvplug_plugin_api::{AbiErrorKind, PluginError};
pub use kvplug_runtime::loader;
pub use kvplug_runtime::{
    Adjust, Arithmetic, Batch, CacheKind, Context, KeyBasis, KvDtype, Logits, Model, PluginSearch,
    Runtime, RuntimeError,
};
pub use llm::{Answer, Llm, LlmBuilder};
pub use logprobs::TokenLogprobs;
pub use plan::{
    default_capacity, parse_bytes, plan, trained_context, weights, GroupPlan, Holding, Plan,
    PlanOptions, Weights,
};
pub use run::{run_agents, run_decode, run_fork, CacheReport, ForkReport, RunReport, RunSpec};
pub use sampler::{argmax, check_temperature, check_top_p, Adjustments, Sampler};
pub use session_dir::{Listed, SessionDir, SessionLock};
pub use speculative::{Draft, DraftKind, SpecStats, Speculation, MAX_DRAFT_DEPTH, MAX_DRAFT_WIDTH};
pub use text::{Message, Text};

/// JSON escaping shared with the server: not part of the SDK's surface.
#[doc(hidden)]
pub use chat_template::ascii_escaped;
/// A host that opens model files it did not vet renders their chat templates in a child
/// process of its own binary, bounded in memory and time: [`Sandbox::install`] at start,
/// and [`serve_sandboxed`] when the binary is started as that child (docs/sdk.md,
/// "Untrusted model files").
pub use chat_template::{serve_sandboxed, Sandbox};
