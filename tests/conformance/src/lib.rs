//! # kvplug-conformance
//!
//! Cross-backend conformance: JSON scenario files ([`scenario`]) replayed against a
//! backend's caches and against the core f64 oracle, diffing every `update_and_attend`
//! output (every layer, every step) and the neutral verbs' results ([`runner`]).
//!
//! The runner is independent of how caches are made: the caller passes a
//! [`CacheFactory`]; [`matrix`] runs it over a runtime's backends
//! ([`RuntimeFactory`]), for `kvplug conform` and `make test`.

pub mod matrix;
pub mod report;
pub mod rng;
pub mod rows;
pub mod runner;
pub mod scenario;

pub use matrix::{run_matrix, ConformOptions, RuntimeFactory, REQUIRE_BACKENDS_ENV};
pub use report::{Failure, Matrix, Status};
pub use rng::Inputs;
pub use runner::{run_case, CacheFactory, CaseResult};
pub use scenario::{builtin_scenarios, load_dir, Scenario, ScenarioError};
