//! Decode attention on mlx: one query token over a window of L tokens (Hq 32, Hkv 8,
//! head_dim 128), output read back (which evaluates MLX's lazy graph). The shapes and ids
//! match the cpu backend's `decode` group (`cargo bench -p kvplug-cpu --bench attention --
//! decode/`); the two plugins cannot link into one binary (each exports the root module).

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvplug_backend_kit::testing::DecodeCase;
use kvplug_backend_kit::Backend;
use kvplug_core::KvDtype;
use kvplug_mlx::MlxDevice;

const HQ: usize = 32;
const HKV: usize = 8;
const D: usize = 128;

fn benches(cr: &mut Criterion) {
    let dev = Arc::new(MlxDevice::open().expect("MLX"));
    let mut g = cr.benchmark_group(format!("mlx_decode [{}]", dev.device_description()));
    g.sample_size(10)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    for dtype in [KvDtype::F16, KvDtype::Q8_DEFAULT, KvDtype::Q4_DEFAULT] {
        for l in [512usize, 4096] {
            let mut case = DecodeCase::new(dev.clone(), HQ, HKV, D, dtype, l);
            g.bench_with_input(BenchmarkId::new(dtype.to_string(), l), &l, |b, _| {
                b.iter(|| black_box(case.step()))
            });
        }
    }
    g.finish();
}

criterion_group!(mlx_benches, benches);
criterion_main!(mlx_benches);
