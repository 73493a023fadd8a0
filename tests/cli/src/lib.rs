//! kvplug's end-to-end tests live in `tests/`: the `kvplug` binary driven as a user drives it
//! (commands, a chat in a pseudo-terminal, `serve` with the OpenAI Python clients, sessions,
//! plugin directories, hostile inputs).
//!
//! They run the binary and plugin dylibs a workspace build leaves in `target/<profile>/`: run
//! `cargo build --workspace --bins` (or `make build`) before `cargo test -p kvplug-cli-tests`.
