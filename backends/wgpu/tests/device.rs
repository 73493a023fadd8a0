//! The wgpu backend on whatever adapter this machine has (lavapipe in CI): it must open, and
//! behave like the cpu backend on the fast path and in lazy growth. Numerical agreement
//! with the oracle is the conformance run's job (`kvplug conform --backend wgpu`).

use std::sync::Arc;

use kvplug_backend_kit::{Backend, Device, KitCache};
use kvplug_core::{make_config, CacheKind, CacheVerbs, KvDtype, ModelCacheParams, PlanKind};
use kvplug_plugin_api::HostTensor;
use kvplug_wgpu::WgpuDevice;

fn device() -> Arc<WgpuDevice> {
    Arc::new(WgpuDevice::open().unwrap_or_else(|e| {
        panic!("no wgpu adapter on this machine (install mesa-vulkan-drivers): {e}")
    }))
}

fn tensor(dev: &WgpuDevice, h: usize, t: usize) -> <WgpuDevice as Device>::Tensor {
    let data: Vec<f32> = (0..h * t * 64).map(|i| (i as f32 * 0.01).sin()).collect();
    dev.upload(&HostTensor::from_f32(&[h, t, 64], &data))
        .unwrap()
}

#[test]
fn single_sequence_decode_stays_on_the_fast_path_and_pools_grow_lazily() {
    let dev = device();
    for kind in [CacheKind::Contiguous, CacheKind::Seq, CacheKind::Tree] {
        let cfg = make_config(
            &ModelCacheParams {
                n_layers: 1,
                n_kv_heads: 2,
                head_dim: 64,
            },
            32768,
            KvDtype::Q8_DEFAULT,
        );
        let mut c = KitCache::new(dev.clone(), kind, cfg).unwrap();
        let mut pos = 0;
        for chunk in [100usize, 1, 1, 3, 1] {
            let positions: Vec<i32> = (pos..pos + chunk as i32).collect();
            if kind == CacheKind::Seq {
                c.begin_step(&vec![0; chunk]).unwrap();
            }
            let (q, k, v) = (
                tensor(&dev, 4, chunk),
                tensor(&dev, 2, chunk),
                tensor(&dev, 2, chunk),
            );
            let mut out = dev.zeros(&[4, chunk, 64]).unwrap();
            c.update_and_attend(0, &q, &k, &v, &positions, 0.125, &mut out)
                .unwrap();
            assert_eq!(
                c.stats().last_plan,
                Some(PlanKind::SingleContiguous),
                "{kind} chunk {chunk}"
            );
            pos += chunk as i32;
        }
        let s = c.stats();
        assert!(s.pool_cells <= 512, "{kind}: {} cells", s.pool_cells);
        assert_eq!(s.high_water, 106);
        // 2 pools × 2 heads × 256 cells × (64 code bytes + 4 bytes of scale/offset).
        assert_eq!(s.allocated_bytes, 2 * 2 * 256 * 68);
    }
}

#[test]
fn describes_its_adapter() {
    let dev = device();
    let d = dev.device_description();
    assert!(d.contains('(') && d.contains(')'), "{d}");
    assert!(!dev.features().is_empty());
}
