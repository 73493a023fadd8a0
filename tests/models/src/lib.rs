//! kvplug's cross-crate tests live in `tests/`: the SDK over the runtime and this build's
//! backend plugins (cpu, wgpu, mlx), on the real models `make models` fetches and on synthetic
//! ones, each checked against an independent reference (candle's GGUF reader, an f64 forward,
//! llama.cpp's tokenizer rules).
//!
//! They load the plugin dylibs a workspace build leaves in `target/<profile>/`: run
//! `cargo build --workspace` (or `make build`) before `cargo test -p kvplug-model-tests`.
