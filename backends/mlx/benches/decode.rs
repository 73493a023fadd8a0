//! Decode attention on mlx: one query token over a window of L tokens (Hq 32, Hkv 8,
//! head_dim 128), output read back (which evaluates MLX's lazy graph). The shapes and ids
//! match the cpu backend's `decode` group (`cargo bench -p kvplug-cpu --bench attention --
//! decode/`); the two plugins cannot link into one binary (each exports the root module).

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvplug_backend_kit::{Backend, Device, KitCache};
use kvplug_core::{make_config, CacheKind, CacheVerbs, KvDtype, ModelCacheParams};
use kvplug_mlx::{MlxDevice, MlxTensor};
use kvplug_plugin_api::{HostTensor, TensorDtype};

const HQ: usize = 32;
const HKV: usize = 8;
const D: usize = 128;

fn tensor(dev: &MlxDevice, h: usize, t: usize) -> MlxTensor {
    let data: Vec<f32> = (0..h * t * D).map(|i| (i as f32 * 0.013).sin()).collect();
    dev.upload(&HostTensor::from_f32(&[h, t, D], &data))
        .unwrap()
}

fn benches(cr: &mut Criterion) {
    let dev = Arc::new(MlxDevice::open().expect("MLX"));
    let mut g = cr.benchmark_group(format!("mlx_decode [{}]", dev.device_description()));
    g.sample_size(10)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    for dtype in [KvDtype::F16, KvDtype::Q8_DEFAULT, KvDtype::Q4_DEFAULT] {
        for l in [512usize, 4096] {
            let params = ModelCacheParams {
                n_layers: 1,
                n_kv_heads: HKV,
                head_dim: D,
            };
            let cfg = make_config(&params, 8192, dtype);
            let mut c = KitCache::new(dev.clone(), CacheKind::Contiguous, cfg).unwrap();
            let pos: Vec<i32> = (0..l as i32 - 1).collect();
            let mut out = dev.zeros(&[HQ, l - 1, D]).unwrap();
            let (q, k, v) = (
                tensor(&dev, HQ, l - 1),
                tensor(&dev, HKV, l - 1),
                tensor(&dev, HKV, l - 1),
            );
            c.update_and_attend(0, &q, &k, &v, &pos, 0.088, &mut out)
                .unwrap();
            black_box(dev.download(&out, TensorDtype::F32).unwrap());
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
                    c.update_and_attend(0, &q, &k, &v, &p, 0.088, &mut out)
                        .unwrap();
                    black_box(dev.download(&out, TensorDtype::F32).unwrap());
                })
            });
        }
    }
    g.finish();
}

criterion_group!(mlx_benches, benches);
criterion_main!(mlx_benches);
