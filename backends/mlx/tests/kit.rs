//! The kit's device contract on MLX: step and import rollback, canonical rows, pool growth,
//! attention under each mask kind.

#[cfg(mlx)]
mod with_mlx {
    use kvplug_backend_kit::Backend;

    kvplug_backend_kit::backend_tests!(
        kvplug_mlx::MlxDevice::open().unwrap_or_else(|e| panic!("no MLX device: {e}"))
    );
    kvplug_backend_kit::model_device_tests!(
        kvplug_mlx::MlxDevice::open().unwrap_or_else(|e| panic!("no MLX device: {e}"))
    );
}
