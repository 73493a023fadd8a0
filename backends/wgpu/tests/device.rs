//! The wgpu backend on whatever adapter this machine has (lavapipe in CI): it must open,
//! take the fast path and grow lazily like the cpu backend, with outputs inside the
//! oracle's bound. The full numerical matrix is the conformance run's job
//! (`kvplug conform --backend wgpu`).

use std::sync::Arc;

use kvplug_backend_kit::{Backend, Device, KitCache};
use kvplug_core::oracle::RefCache;
use kvplug_core::{make_config, CacheKind, CacheVerbs, KvDtype, ModelCacheParams, PlanKind};
use kvplug_plugin_api::{HostTensor, TensorDtype};
use kvplug_wgpu::WgpuDevice;

fn device() -> Arc<WgpuDevice> {
    Arc::new(WgpuDevice::open().unwrap_or_else(|e| {
        panic!("no wgpu adapter on this machine (install mesa-vulkan-drivers): {e}")
    }))
}

fn values(h: usize, t: usize, salt: f32) -> Vec<f32> {
    (0..h * t * 64)
        .map(|i| (i as f32 * 0.01 + salt).sin())
        .collect()
}

fn tensor(dev: &WgpuDevice, data: &[f32], h: usize, t: usize) -> <WgpuDevice as Device>::Tensor {
    dev.upload(&HostTensor::from_f32(&[h, t, 64], data))
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
        let mut oracle = RefCache::new(kind, cfg).unwrap();
        let mut pos = 0;
        for (step, chunk) in [100usize, 1, 1, 3, 1].into_iter().enumerate() {
            let positions: Vec<i32> = (pos..pos + chunk as i32).collect();
            if kind == CacheKind::Seq {
                c.begin_step(&vec![0; chunk]).unwrap();
                oracle.begin_step(&vec![0; chunk]).unwrap();
            }
            let salt = step as f32;
            let (qd, kd, vd) = (
                values(4, chunk, salt),
                values(2, chunk, salt + 0.3),
                values(2, chunk, salt + 0.7),
            );
            let (q, k, v) = (
                tensor(&dev, &qd, 4, chunk),
                tensor(&dev, &kd, 2, chunk),
                tensor(&dev, &vd, 2, chunk),
            );
            let mut out = dev.zeros(&[4, chunk, 64]).unwrap();
            c.update_and_attend(0, &q, &k, &v, &positions, 0.125, &mut out)
                .unwrap();
            assert_eq!(
                c.stats().last_plan,
                Some(PlanKind::SingleContiguous),
                "{kind} chunk {chunk}"
            );
            let got = dev
                .download(&out, TensorDtype::F32)
                .unwrap()
                .to_f32()
                .unwrap();
            let wide = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<_>>();
            let want = oracle
                .update_and_attend(0, &wide(&qd), &wide(&kd), &wide(&vd), &positions, 0.125)
                .unwrap();
            for (i, &g) in got.iter().enumerate() {
                let err = (g as f64 - want.out[i]).abs();
                assert!(
                    err <= want.bound[i],
                    "{kind} chunk {chunk} element {i}: {g} vs oracle {} (bound {:e})",
                    want.out[i],
                    want.bound[i]
                );
            }
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

// The kit's device contract: step and import rollback, canonical rows, pool growth,
// attention under each mask kind; and its model-device contract (the argmax).
kvplug_backend_kit::backend_tests!(
    WgpuDevice::open().unwrap_or_else(|e| panic!("no wgpu adapter: {e}"))
);
kvplug_backend_kit::model_device_tests!(
    WgpuDevice::open().unwrap_or_else(|e| panic!("no wgpu adapter: {e}"))
);

/// Kernel writes are recorded and submitted later; a host write of pool rows must still land
/// after the kernel writes recorded before it, and a readback must see both in order.
#[test]
fn host_writes_and_readbacks_keep_the_order_of_recorded_kernels() {
    let dev = device();
    let mut pool = dev.pool_new(KvDtype::F32, 2, 64, 8).unwrap();
    let kernel = tensor(&dev, &values(2, 4, 0.5), 2, 4);
    // Kernel writes rows 0..4, then the host overwrites rows 1 and 2.
    dev.write_run(&mut pool, 0, &kernel).unwrap();
    let host: Vec<u8> = (0..2 * 2 * 64 * 4).map(|i| (i % 251) as u8).collect();
    dev.write_rows(&mut pool, &[1, 2], &host).unwrap();
    assert_eq!(
        dev.read_rows(&pool, &[1, 2]).unwrap(),
        host,
        "host rows win"
    );
    // Row 0 still holds the kernel's values (head 0, token 0).
    let row0 = dev.read_rows(&pool, &[0]).unwrap();
    let want: Vec<u8> = values(2, 4, 0.5)[..64]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    assert_eq!(&row0[..64 * 4], &want[..], "kernel row 0");
}

/// Ops recorded past the uniform ring's 1024 slots go to the next batch: every op still
/// reads its own parameters and index words. 3000 single-row writes, each to its own cell
/// of a reversed order, then one readback of the whole pool.
#[test]
fn ops_beyond_one_batch_keep_their_parameters_and_index_words() {
    let dev = device();
    let cells = 3000;
    let mut pool = dev.pool_new(KvDtype::F32, 1, 64, cells).unwrap();
    let rows: Vec<Vec<f32>> = (0..cells).map(|i| values(1, 1, i as f32)).collect();
    let srcs: Vec<_> = rows.iter().map(|r| tensor(&dev, r, 1, 1)).collect();
    for (i, src) in srcs.iter().enumerate() {
        let cell = (cells - 1 - i) as u32;
        dev.scatter_rows(&mut pool, &[cell], src).unwrap();
    }
    let all: Vec<u32> = (0..cells as u32).collect();
    let got: Vec<f32> = bytemuck_f32(&dev.read_rows(&pool, &all).unwrap());
    for (cell, row) in got.chunks(64).enumerate() {
        assert_eq!(row, &rows[cells - 1 - cell][..], "cell {cell}");
    }
}

/// The write kernel quantizes rows to the kit's bytes bit for bit (codes, then each group's
/// f16 scale and lo), whatever the adapter's division accuracy: q8 and q4 at two group
/// sizes, over rows with wide, narrow and constant groups, f16 ties, subnormal scales, a lo
/// rounded above the minimum and a minimum of both zeros.
#[test]
fn quantized_rows_written_by_the_kernel_are_the_kits_bytes() {
    use kvplug_backend_kit::quant::quantize_row;
    let dev = device();
    let (heads, t, d) = (2, 48, 64);
    let data: Vec<f32> = (0..heads * t * d)
        .map(|i| match (i / d) % 9 {
            0 => (i as f32 * 0.37).sin() * 3.0,
            1 => (i as f32 * 0.011).cos() * 1e-3 + 0.5,
            2 => 0.25,
            // lo an f16 tie (1 + 2^-11: even is down) and a range that makes the scale an f16 subnormal.
            3 => 1.0 + 1.0 / 2048.0 + (i % 7) as f32 * 1.5e-6,
            4 => -1000.0 + (i % 13) as f32 * 7.3,
            // lo exactly 0 and a subnormal scale with codes across the range.
            5 => (i % 11) as f32 * 1e-6,
            // The minimum just below an f16 value, so lo rounds above it (negative d).
            6 => {
                if i % 5 == 0 {
                    0.5 - 1e-5
                } else {
                    0.5 + (i % 7) as f32 * 0.01
                }
            }
            // Both zeros as the minimum: lo is stored as +0.
            7 => [0.0, -0.0, 0.3, 0.7][i % 4],
            _ => ((i * 7919 % 1000) as f32 - 500.0) * 0.0173,
        })
        .collect();
    for dtype in [
        KvDtype::Q8 { group: 32 },
        KvDtype::Q8 { group: 64 },
        KvDtype::Q4 { group: 16 },
        KvDtype::Q4 { group: 32 },
    ] {
        let (bits, group) = dtype.quant().unwrap();
        let mut pool = dev.pool_new(dtype, heads, d, t).unwrap();
        dev.write_run(&mut pool, 0, &tensor(&dev, &data, heads, t))
            .unwrap();
        let cells: Vec<u32> = (0..t as u32).collect();
        let got = dev.read_rows(&pool, &cells).unwrap();
        let row_bytes = dtype.row_bytes(d);
        let code_bytes = d * bits as usize / 8;
        for (r, row) in data.chunks(d).enumerate() {
            let mut codes = vec![0u8; code_bytes];
            let (mut scales, mut los) = (vec![0u16; d / group], vec![0u16; d / group]);
            quantize_row(row, bits, group, &mut codes, &mut scales, &mut los);
            let mut want = codes;
            for (s, l) in scales.iter().zip(&los) {
                want.extend(s.to_le_bytes());
                want.extend(l.to_le_bytes());
            }
            let got = &got[r * row_bytes..(r + 1) * row_bytes];
            if let Some(b) = (0..row_bytes).find(|&b| got[b] != want[b]) {
                let g = if b < code_bytes {
                    b * 8 / bits as usize / group
                } else {
                    (b - code_bytes) / 4
                };
                panic!(
                    "{dtype:?} row {r} byte {b} (group {g}): got {:#04x}, want {:#04x}; \
                     scale {} lo {}; group values {:?}",
                    got[b],
                    want[b],
                    half::f16::from_bits(scales[g]),
                    half::f16::from_bits(los[g]),
                    &row[g * group..(g + 1) * group]
                );
            }
        }
    }
}

fn bytemuck_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// Attention in both arithmetics at the head widths real models use (128, 256), with GQA,
/// a causal mask over several query rows and query heads split into score chunks (a small
/// storage-binding limit), against the oracle's bound for each arithmetic. Conformance
/// covers the matrix at head_dim 64.
#[test]
fn attention_at_wide_heads_in_chunks_is_inside_each_arithmetics_bound() {
    use kvplug_backend_kit::testing::assert_within_bound;
    use kvplug_backend_kit::AttendMask;
    use kvplug_core::oracle::{attend, store_rounded, AttnDims, RefMask};
    use kvplug_core::Arithmetic;

    // The scores of all heads (182 400 bytes) exceed the binding limit, so the heads run in
    // chunks of 7 and 1; the query (up to 155 648 bytes), the pools (up to 172 800) and K/V
    // written 50 rows at a time fit it. Four query heads share each KV head.
    let (hq, hkv, t, l) = (8, 2, 19, 300);
    let dev = WgpuDevice::open_with_binding_limit(176_000, None).unwrap();
    for d in [128, 256] {
        // Rows of their own range and offset, so that each key's quantization groups differ
        // (a wrong offset term then shifts the scores unevenly, which softmax does not undo).
        let wave = |n: usize, salt: usize| -> Vec<f32> {
            (0..n)
                .map(|i| {
                    let row = i / d;
                    let x = ((i * 7919 + salt * 104_729) as f32 * 0.001).sin();
                    x * (0.25 + (row % 7) as f32 * 0.25) + (row % 3) as f32 * 0.5 - 0.5
                })
                .collect()
        };
        let (q, k, v) = (
            wave(hq * t * d, 1),
            wave(hkv * l * d, 2),
            wave(hkv * l * d, 3),
        );
        let up = |x: &[f32], h: usize, n: usize| {
            dev.upload(&HostTensor::from_f32(&[h, n, d], x)).unwrap()
        };
        for dtype in [
            KvDtype::Q8 { group: 64 },
            KvDtype::Q8 { group: 32 },
            KvDtype::Q4 { group: 32 },
        ] {
            let (mut kp, mut vp) = (
                dev.pool_new(dtype, hkv, d, l).unwrap(),
                dev.pool_new(dtype, hkv, d, l).unwrap(),
            );
            for c in (0..l).step_by(50) {
                let rows = |x: &[f32]| {
                    let run: Vec<f32> = (0..hkv)
                        .flat_map(|h| x[(h * l + c) * d..(h * l + c + 50) * d].iter().copied())
                        .collect();
                    up(&run, hkv, 50)
                };
                dev.write_run(&mut kp, c, &rows(&k)).unwrap();
                dev.write_run(&mut vp, c, &rows(&v)).unwrap();
            }
            let stored = |x: &[f32]| -> Vec<f64> {
                x.chunks(d)
                    .flat_map(|r| {
                        store_rounded(dtype, &r.iter().map(|&x| x as f64).collect::<Vec<_>>())
                    })
                    .collect()
            };
            let (ks, vs) = (stored(&k), stored(&v));
            let wide: Vec<f64> = q.iter().map(|&x| x as f64).collect();
            let scale = 1.0 / (d as f32).sqrt();
            assert!(
                dev.arithmetics(dtype).contains(&Arithmetic::Int8Query),
                "{dtype}"
            );
            for arithmetic in [Arithmetic::F32, Arithmetic::Int8Query] {
                let mut out = dev.zeros(&[hq, t, d]).unwrap();
                let mut scratch = Default::default();
                dev.attend(
                    arithmetic,
                    &up(&q, hq, t),
                    &kp,
                    &vp,
                    l,
                    AttendMask::Causal,
                    scale,
                    &mut out,
                    &mut scratch,
                )
                .unwrap();
                let got = dev
                    .download(&out, TensorDtype::F32)
                    .unwrap()
                    .to_f32()
                    .unwrap();
                let dims = AttnDims {
                    n_q_heads: hq,
                    n_kv_heads: hkv,
                    n_tok: t,
                    read_len: l,
                    head_dim: d,
                };
                let want = attend(
                    dims,
                    &wide,
                    &ks,
                    &vs,
                    scale as f64,
                    RefMask::Causal,
                    arithmetic,
                );
                assert_within_bound(
                    &format!("d {d} {dtype} {arithmetic}"),
                    &got,
                    &want,
                    dims,
                    |_| "",
                );
            }
        }
    }
}
