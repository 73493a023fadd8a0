//! Helpers shared by the CLI's integration tests: the runtime tests' dylib helpers.
#![allow(unused_imports)]

#[path = "../../../runtime/tests/common/mod.rs"]
mod dylibs;
pub use dylibs::*;

pub mod server;
