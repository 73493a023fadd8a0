//! Decode attention and pool growth on the wgpu backend, reported with the adapter name.
//! On lavapipe (software Vulkan) the figures are for regression tracking only.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvplug_backend_kit::testing::DecodeCase;
use kvplug_backend_kit::{Backend, Device};
use kvplug_core::{Arithmetic, KvDtype};
use kvplug_wgpu::WgpuDevice;

const HQ: usize = 8;
const HKV: usize = 2;
const D: usize = 64;

fn benches(cr: &mut Criterion) {
    let dev = Arc::new(WgpuDevice::open().expect("a wgpu adapter"));
    eprintln!("adapter: {}", dev.device_description());
    let mut g = cr.benchmark_group(format!("wgpu_decode [{}]", dev.device_description()));
    g.sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    // Each arithmetic the cache declares: f32 named by the dtype, others `q8+int8-query`.
    for dtype in [KvDtype::F16, KvDtype::Q8_DEFAULT, KvDtype::Q4_DEFAULT] {
        for l in [256usize, 1024] {
            let mut case = DecodeCase::new(dev.clone(), HQ, HKV, D, dtype, l);
            for arithmetic in case.arithmetics() {
                case.set_arithmetic(arithmetic).unwrap();
                let name = match arithmetic {
                    Arithmetic::F32 => dtype.to_string(),
                    _ => format!("{dtype}+{arithmetic}"),
                };
                g.bench_with_input(BenchmarkId::new(name, l), &l, |b, _| {
                    b.iter(|| black_box(case.step()))
                });
            }
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
