//! Decode attention as a model streams it: Qwen2.5-0.5B's shape (24 layers, Hq 14, Hkv 2,
//! D 64), one cache per layer holding `L` tokens, one decode step through every layer in
//! turn, so each layer's K/V rows come from memory as they do in `kvplug bench -d L`.
//! Prints the fastest of 20 (ROUNDS) steps per KV dtype, in µs per token and GB/s of K/V read.
//! `cargo run --release -p kvplug-cpu --example decode_attention [L [DTYPES [ROUNDS [SHAPE]]]]`;
//! DTYPES is a comma list of KV dtypes, each optionally `+ARITHMETIC` (`q8+int8-query`);
//! SHAPE is `LAYERS,HQ,HKV,D` for another model's (SmolLM2-135M: `30,9,3,64`).

use std::sync::Arc;
use std::time::Instant;

use kvplug_backend_kit::KitCache;
use kvplug_core::{make_config, Arithmetic, CacheKind, CacheVerbs, KvDtype, ModelCacheParams};
use kvplug_cpu::tensor::CpuTensor;
use kvplug_cpu::CpuDevice;

/// Qwen2.5-0.5B's layers, query heads, KV heads and head size.
const QWEN_05B: [usize; 4] = [24, 14, 2, 64];

fn tensor(h: usize, t: usize, d: usize, salt: f32) -> CpuTensor {
    let data = (0..h * t * d)
        .map(|i| ((i as f32 + salt) * 0.0131).sin())
        .collect();
    CpuTensor::new(&[h, t, d], data)
}

fn main() {
    let l: usize = std::env::args()
        .nth(1)
        .map_or(4096, |s| s.parse().expect("L is a number"));
    let rounds: usize = std::env::args()
        .nth(3)
        .map_or(20, |s| s.parse().expect("ROUNDS is a number"));
    let [layers, hq, hkv, d] = std::env::args().nth(4).map_or(QWEN_05B, |s| {
        let v: Vec<usize> = s.split(',').map(|x| x.parse().expect("a number")).collect();
        v.try_into().expect("SHAPE is LAYERS,HQ,HKV,D")
    });
    let device = Arc::new(CpuDevice::new());
    let params = ModelCacheParams {
        n_layers: 1,
        n_kv_heads: hkv,
        head_dim: d,
    };
    let dtypes: Vec<(KvDtype, Arithmetic)> = std::env::args()
        .nth(2)
        .unwrap_or_else(|| "f16,q8,q4".into())
        .split(',')
        .map(|s| {
            let (dtype, arithmetic) = s.split_once('+').unwrap_or((s, "f32"));
            (
                dtype.parse().expect("a KV dtype"),
                arithmetic.parse().expect("an attention arithmetic"),
            )
        })
        .collect();
    for (dtype, arithmetic) in dtypes {
        let config = make_config(&params, l + 1, dtype);
        let prefill = (
            tensor(hq, l, d, 1.0),
            tensor(hkv, l, d, 2.0),
            tensor(hkv, l, d, 3.0),
        );
        let positions: Vec<i32> = (0..l as i32).collect();
        let mut out = CpuTensor::zeros(&[hq, l, d]);
        let mut caches: Vec<_> = (0..layers)
            .map(|_| {
                let mut c = KitCache::new(device.clone(), CacheKind::Contiguous, config).unwrap();
                let (q, k, v) = &prefill;
                c.update_and_attend(0, q, k, v, &positions, 0.125, &mut out)
                    .unwrap();
                c.set_arithmetic(arithmetic)
                    .expect("an arithmetic this cache computes");
                c
            })
            .collect();
        let (q, k, v) = (
            tensor(hq, 1, d, 4.0),
            tensor(hkv, 1, d, 5.0),
            tensor(hkv, 1, d, 6.0),
        );
        let mut out = CpuTensor::zeros(&[hq, 1, d]);
        let at = [l as i32];
        let mut best = f64::MAX;
        for _ in 0..rounds {
            let t = Instant::now();
            for c in &mut caches {
                c.rewind(l).unwrap();
                c.update_and_attend(0, &q, &k, &v, &at, 0.125, &mut out)
                    .unwrap();
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        let bytes = (layers * hkv * 2 * (l + 1) * dtype.row_bytes(d)) as f64;
        println!(
            "{:>16} L {l}: {:7.1} µs per token, {:5.1} GB/s of K/V",
            format!("{dtype}+{arithmetic}"),
            best * 1e6,
            bytes / best / 1e9
        );
    }
}
