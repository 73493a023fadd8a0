//! # kvplug-mlx
//!
//! The `mlx` backend: the kit's [`Device`](kvplug_backend_kit::Device) and model operations
//! over MLX's C++ API (`mlx::core::array`) through a thin `cxx` bridge (`bridge.cc`); the kit
//! keeps all cache logic. MLX comes from PyPI (`mlx-cpu` on Linux, `mlx-metal` on macOS),
//! installed into `.deps/mlx` by `scripts/install-mlx.sh` and found by `build.rs` (`MLX_DIR`
//! overrides). `mlx-rs` is not used: its `mlx-sys` build downloads MLX from GitHub and links
//! Apple frameworks unconditionally, so it cannot build off macOS.
//!
//! Built without MLX, the plugin still loads and reports `unavailable: …`.

#[cfg(mlx)]
pub mod device;
#[cfg(mlx)]
mod ffi;
#[cfg(mlx)]
pub mod model;
#[cfg(not(mlx))]
mod unavailable;

#[cfg(mlx)]
pub use device::{MlxDevice, MlxPool, MlxTensor};
#[cfg(not(mlx))]
pub use unavailable::MlxDevice;

kvplug_backend_kit::export_backend!(MlxDevice, models);
