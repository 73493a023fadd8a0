//! Helpers shared by the cpu backend's integration tests.

use std::sync::Arc;

use kvplug_backend_kit::KitCache;
use kvplug_core::{make_config, CacheConfig, CacheKind, KvDtype, ModelCacheParams};
use kvplug_cpu::tensor::CpuTensor;
use kvplug_cpu::CpuDevice;

/// A Llama-ish layer shape: Hq 32, Hkv 8, D 128.
pub const HQ: usize = 32;
pub const HKV: usize = 8;
pub const D: usize = 128;

pub fn config(layers: usize, capacity: usize, dtype: KvDtype) -> CacheConfig {
    make_config(
        &ModelCacheParams {
            n_layers: layers,
            n_kv_heads: HKV,
            head_dim: D,
        },
        capacity,
        dtype,
    )
}

pub fn cache(kind: CacheKind, cfg: CacheConfig) -> KitCache<CpuDevice> {
    KitCache::new(Arc::new(CpuDevice::new()), kind, cfg).unwrap()
}

/// Deterministic activations `[h, t, D]`.
pub fn tensor(h: usize, t: usize, salt: f32) -> CpuTensor {
    let data = (0..h * t * D)
        .map(|i| ((i as f32 + salt) * 0.013).sin())
        .collect();
    CpuTensor::new(&[h, t, D], data)
}

/// One step of `t` tokens at `positions` over every layer; q/k/v/out are preallocated.
pub struct Step {
    pub q: CpuTensor,
    pub k: CpuTensor,
    pub v: CpuTensor,
    pub out: CpuTensor,
}

impl Step {
    pub fn new(t: usize) -> Self {
        Step {
            q: tensor(HQ, t, 1.0),
            k: tensor(HKV, t, 2.0),
            v: tensor(HKV, t, 3.0),
            out: CpuTensor::zeros(&[HQ, t, D]),
        }
    }

    pub fn run(&mut self, cache: &mut KitCache<CpuDevice>, positions: &[i32]) {
        let scale = 1.0 / (D as f32).sqrt();
        for layer in 0..cache.config().n_layers {
            cache
                .update_and_attend(
                    layer,
                    &self.q,
                    &self.k,
                    &self.v,
                    positions,
                    scale,
                    &mut self.out,
                )
                .unwrap();
        }
    }
}
