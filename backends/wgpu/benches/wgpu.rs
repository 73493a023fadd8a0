//! Decode attention and pool growth on the wgpu backend, reported with the adapter name.
//! On lavapipe (software Vulkan) the figures are for regression tracking only.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvplug_backend_kit::{Backend, Device, KitCache};
use kvplug_core::{make_config, CacheKind, CacheVerbs, KvDtype, ModelCacheParams};
use kvplug_plugin_api::{HostTensor, TensorDtype};
use kvplug_wgpu::WgpuDevice;

const HQ: usize = 8;
const HKV: usize = 2;
const D: usize = 64;

fn tensor(dev: &WgpuDevice, h: usize, t: usize) -> <WgpuDevice as Device>::Tensor {
    let data: Vec<f32> = (0..h * t * D).map(|i| (i as f32 * 0.013).sin()).collect();
    dev.upload(&HostTensor::from_f32(&[h, t, D], &data))
        .unwrap()
}

fn cfg(dtype: KvDtype) -> kvplug_core::CacheConfig {
    make_config(
        &ModelCacheParams {
            n_layers: 1,
            n_kv_heads: HKV,
            head_dim: D,
        },
        8192,
        dtype,
    )
}

fn benches(cr: &mut Criterion) {
    let dev = Arc::new(WgpuDevice::open().expect("a wgpu adapter"));
    eprintln!("adapter: {}", dev.device_description());
    let mut g = cr.benchmark_group(format!("wgpu_decode [{}]", dev.device_description()));
    g.sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    for dtype in [KvDtype::F16, KvDtype::Q8_DEFAULT, KvDtype::Q4_DEFAULT] {
        for l in [256usize, 1024] {
            let mut c = KitCache::new(dev.clone(), CacheKind::Contiguous, cfg(dtype)).unwrap();
            let pos: Vec<i32> = (0..l as i32 - 1).collect();
            let mut out = dev.zeros(&[HQ, l - 1, D]).unwrap();
            c.update_and_attend(
                0,
                &tensor(&dev, HQ, l - 1),
                &tensor(&dev, HKV, l - 1),
                &tensor(&dev, HKV, l - 1),
                &pos,
                0.125,
                &mut out,
            )
            .unwrap();
            let (q, k, v) = (
                tensor(&dev, HQ, 1),
                tensor(&dev, HKV, 1),
                tensor(&dev, HKV, 1),
            );
            let mut out = dev.zeros(&[HQ, 1, D]).unwrap();
            let p = [(l - 1) as i32];
            g.bench_with_input(BenchmarkId::new(dtype.to_string(), l), &l, |b, _| {
                b.iter(|| {
                    c.rewind(l - 1).unwrap();
                    c.update_and_attend(0, &q, &k, &v, &p, 0.125, &mut out)
                        .unwrap();
                    // Reading the output back waits for the GPU.
                    black_box(dev.download(&out, TensorDtype::F32).unwrap());
                })
            });
        }
    }
    g.finish();
    let mut g = cr.benchmark_group("wgpu_pool_grow");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    g.bench_function("f16_256_to_4096_cells", |b| {
        b.iter(|| {
            let mut pool = dev.pool_new(KvDtype::F16, HKV, D, 256).unwrap();
            for cells in [512, 1024, 2048, 4096] {
                dev.pool_grow(&mut pool, cells, cells / 2).unwrap();
            }
            black_box(dev.pool_bytes(&pool))
        })
    });
    g.finish();
}

criterion_group!(wgpu_benches, benches);
criterion_main!(wgpu_benches);
