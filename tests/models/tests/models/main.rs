//! The model tests, one module a file, in one test binary: each binary links the SDK, the
//! cpu backend and their dependencies, and linking eleven of them cost CI minutes. The
//! tests that count allocations with a global allocator (`fuzz.rs`,
//! `hybrid_decode_path.rs`) stay binaries of their own.

#[path = "../common/mod.rs"]
mod common;

mod agents;
mod architectures;
mod constrained;
mod gemma;
mod gguf;
mod hybrid;
mod model;
mod moe;
mod real_model;
mod sessions;
mod tokenizers;
