//! Seed 004's `KeyValueCache` face over the kit's contiguous cache on the cpu device: the
//! views returned after each append are the rows written so far (as f16 stores them), the
//! pools double lazily, and a refused append leaves the history as it was.

use std::sync::Arc;

use half::f16;
use kvplug_backend_kit::kv_face::{ContiguousKv, KeyValueCache};
use kvplug_core::{CacheConfig, KvDtype};
use kvplug_cpu::pool::HeadRows;
use kvplug_cpu::tensor::CpuTensor;
use kvplug_cpu::CpuDevice;

const H: usize = 2;
const D: usize = 8;

fn cfg(capacity: usize) -> CacheConfig {
    CacheConfig {
        capacity,
        n_layers: 1,
        n_kv_heads: H,
        head_dim: D,
        kv_dtype: KvDtype::F16,
        min_chunk: 4,
        sliding: None,
        conv: None,
        delta: None,
        ssm: None,
    }
}

/// `[H, t, D]`: row `start + i` of head `h` holds `sign * (start + i + h / 8 + d / 64)`.
fn rows(start: usize, t: usize, sign: f32) -> CpuTensor {
    let mut data = Vec::with_capacity(H * t * D);
    for h in 0..H {
        for i in 0..t {
            for d in 0..D {
                data.push(sign * ((start + i) as f32 + h as f32 / 8.0 + d as f32 / 64.0));
            }
        }
    }
    CpuTensor::new(&[H, t, D], data)
}

fn expect(view: HeadRows<'_>, h: usize, len: usize, sign: f32) {
    let HeadRows::F16(got) = view else {
        panic!("f16 rows expected")
    };
    assert_eq!(got.len(), len * D);
    for (j, v) in got.iter().enumerate() {
        let (i, d) = (j / D, j % D);
        let want = sign * (i as f32 + h as f32 / 8.0 + d as f32 / 64.0);
        assert_eq!(*v, f16::from_f32(want), "head {h}, row {i}, dim {d}");
    }
}

#[test]
fn views_hold_every_row_written_and_pools_double() {
    let mut c = ContiguousKv::new(Arc::new(CpuDevice::new()), cfg(40)).unwrap();
    assert_eq!(c.max_size(), None);
    let row_bytes = 2 * H * D * 2; // K and V, f16
    assert_eq!(c.bytes(), 4 * row_bytes);
    let mut len = 0;
    for t in [1, 3, 1, 7, 2, 11] {
        let (k, v) = c
            .update_and_fetch(&rows(len, t, 1.0), &rows(len, t, -1.0))
            .unwrap();
        len += t;
        assert_eq!((k.len, v.len), (len, len));
        for h in 0..H {
            expect(k.pool.head_rows(h, k.len), h, len, 1.0);
            expect(v.pool.head_rows(h, v.len), h, len, -1.0);
        }
        assert_eq!(c.offset(), len);
        // 4 cells, doubled on demand, capped at the capacity.
        let cells = len.next_power_of_two().clamp(4, 40);
        assert_eq!(c.bytes(), cells * row_bytes, "after {len} tokens");
    }
    // Refused: a shape mismatch and an append past the capacity change nothing.
    let bad = CpuTensor::new(&[H, 1, D + 1], vec![0.0; H * (D + 1)]);
    assert!(c.update_and_fetch(&bad, &bad).is_err());
    assert!(c
        .update_and_fetch(&rows(len, 2, 1.0), &rows(len, 1, 1.0))
        .is_err());
    let room = 40 - len;
    assert!(c
        .update_and_fetch(&rows(len, room + 1, 1.0), &rows(len, room + 1, -1.0))
        .is_err());
    assert_eq!(c.offset(), len);
    let (k, _) = c
        .update_and_fetch(&rows(len, room, 1.0), &rows(len, room, -1.0))
        .unwrap();
    expect(k.pool.head_rows(1, k.len), 1, 40, 1.0);
}
