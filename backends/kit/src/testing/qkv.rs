//! [`check_norm_qkv_heads`]: a device's attention inputs in one op against an f64 reference.

use kvplug_core::RopePairs;
use kvplug_plugin_api::TensorDtype;

use crate::model::{ModelDevice, Projection, QkvHeads, StoredTensor};

/// The absolute error a device's f32 sine and cosine may have on [-π, π] (WGSL's, and
/// Vulkan's, 2^-11); the check's angles stay in that range.
const TRIG: f64 = 1.0 / 2048.0;

/// Query heads, key/value heads, head width and input width of the check.
const HQ: usize = 4;
const HKV: usize = 2;
const HD: usize = 18;
const COLS: usize = 96;

/// [`ModelDevice::norm_qkv_heads`] against the same computation in f64 on the host (the
/// norm, the projections, the rotation with f64 sine and cosine, the head split): 1 and 3
/// tokens, both pair layouts, with and without biases, GQA.
///
/// An output's dot product is within γ(n)·S of the exact one (any summation order, S =
/// Σ|hn_j·w_j| + |bias| in f64): n = COLS for the sum, COLS / 2 for the norm's sum of
/// squares (halved by its square root) and 16 for the norm's scalar steps (a GPU's square
/// root and division are within 2 and 2.5 ulp) and hn's products. A rotated pair
/// (a, b) takes both its members' errors, its sine and cosine's ([`TRIG`] each), the
/// rounding of a·cos − b·sin (4u) and of its angle (u·|angle|), times |a| + |b|.
pub fn check_norm_qkv_heads<D: ModelDevice>(dev: D) {
    for (t, pairs, biases) in [
        (1, RopePairs::Halves, true),
        (1, RopePairs::Interleaved, false),
        (3, RopePairs::Halves, false),
        (3, RopePairs::Interleaved, true),
    ] {
        check_case(&dev, t, pairs, biases);
    }
}

/// A deterministic value in [-1, 1) for index i of stream `seed`.
fn value(seed: usize, i: usize) -> f32 {
    let h = (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (seed as u64) << 32;
    let h = (h ^ (h >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    ((h >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// A `[rows, COLS]` f32 weight (f32: a device may compute block formats with reduced
/// activations, as the cpu does, which this check's bound does not cover).
fn weight(rows: usize, seed: usize) -> StoredTensor {
    let v: Vec<f32> = (0..rows * COLS).map(|i| value(seed, i) * 0.3).collect();
    StoredTensor::from_f32(&v)
}

fn check_case<D: ModelDevice>(dev: &D, t: usize, pairs: RopePairs, biases: bool) {
    let case = format!("{t} tokens, {pairs:?} pairs, biases {biases}");
    let x: Vec<f32> = (0..t * COLS).map(|i| value(1, i) * 2.0).collect();
    let norm: Vec<f32> = (0..COLS).map(|i| 1.0 + 0.5 * value(2, i)).collect();
    let rows = [HQ * HD, HKV * HD, HKV * HD];
    let stored: Vec<StoredTensor> = (0..3).map(|k| weight(rows[k], 10 + k)).collect();
    let bias: Vec<Vec<f32>> = (0..3)
        .map(|k| (0..rows[k]).map(|i| value(20 + k, i) * 0.5).collect())
        .collect();
    let positions: Vec<i32> = (0..t as i32).map(|i| 1 + i).collect();
    let inv_freq: Vec<f32> = (0..HD / 2)
        .map(|i| 10000f32.powf(-2.0 * i as f32 / HD as f32))
        .collect();
    let eps = 1e-6;
    let xt = dev.tensor(&x, &[t, COLS]).unwrap();
    let nt = dev.tensor(&norm, &[COLS]).unwrap();
    let ws: Vec<D::Weight> = (0..3)
        .map(|k| dev.weight(stored[k].clone(), rows[k], COLS).unwrap())
        .collect();
    let bs: Vec<D::Tensor> = (0..3)
        .map(|k| dev.tensor(&bias[k], &[rows[k]]).unwrap())
        .collect();
    let rope = QkvHeads {
        heads_q: HQ,
        heads_kv: HKV,
        positions: &positions,
        inv_freq: &inv_freq,
        pairs,
    };
    let mut hn = dev.zeros(&[t, COLS]).unwrap();
    let mut outs: Vec<D::Tensor> = (0..3).map(|k| dev.zeros(&[t, rows[k]]).unwrap()).collect();
    let heads_of = [HQ, HKV, HKV];
    let mut heads: Vec<D::Tensor> = (0..3)
        .map(|k| dev.zeros(&[heads_of[k], t, HD]).unwrap())
        .collect();
    {
        let [oq, ok, ov] = &mut outs[..] else {
            unreachable!()
        };
        let mut qkv = [(0, oq), (1, ok), (2, ov)].map(|(k, out)| Projection {
            w: &ws[k],
            bias: biases.then(|| &bs[k]),
            out,
        });
        let [hq, hk, hv] = &mut heads[..] else {
            unreachable!()
        };
        dev.norm_qkv_heads(&xt, &nt, eps, &mut hn, &mut qkv, rope, [hq, hk, hv])
            .unwrap();
    }
    let got: Vec<Vec<f32>> = heads
        .iter()
        .map(|h| dev.download(h, TensorDtype::F32).unwrap().to_f32().unwrap())
        .collect();
    // Per output ([T, rows] row-major), in f64: the projection before the rotation and
    // S = Σ|hn_j·w_j| + |bias|.
    let (proj, sums): (Vec<Vec<f64>>, Vec<Vec<f64>>) = (0..3)
        .map(|k| {
            let w = stored[k].to_f32();
            let (mut v, mut s) = (vec![0.0; t * rows[k]], vec![0.0; t * rows[k]]);
            for tt in 0..t {
                let xs = &x[tt * COLS..(tt + 1) * COLS];
                let ms = xs.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / COLS as f64;
                let inv = 1.0 / (ms + eps as f64).sqrt();
                for o in 0..rows[k] {
                    let terms = (0..COLS)
                        .map(|j| xs[j] as f64 * inv * norm[j] as f64 * w[o * COLS + j] as f64);
                    let b = if biases { bias[k][o] as f64 } else { 0.0 };
                    v[tt * rows[k] + o] = terms.clone().sum::<f64>() + b;
                    s[tt * rows[k] + o] = terms.map(f64::abs).sum::<f64>() + b.abs();
                }
            }
            (v, s)
        })
        .unzip();
    let u = f32::EPSILON as f64 / 2.0;
    let n = (COLS + COLS / 2 + 16) as f64;
    let gamma = n * u / (1.0 - n * u);
    for k in 0..3 {
        for h in 0..heads_of[k] {
            for (tt, &position) in positions.iter().enumerate() {
                for j in 0..HD {
                    let row = |jj: usize| tt * rows[k] + h * HD + jj;
                    let at = (h * t + tt) * HD + j;
                    let (want, bound) = if k == 2 {
                        (proj[k][row(j)], gamma * sums[k][row(j)])
                    } else {
                        let (i, partner, first) = match pairs {
                            RopePairs::Halves => (j % (HD / 2), (j + HD / 2) % HD, j < HD / 2),
                            RopePairs::Interleaved => (j / 2, j ^ 1, j % 2 == 0),
                        };
                        let ang = position as f64 * inv_freq[i] as f64;
                        let (a, b) = (proj[k][row(j)], proj[k][row(partner)]);
                        let want = match first {
                            true => a * ang.cos() - b * ang.sin(),
                            false => a * ang.cos() + b * ang.sin(),
                        };
                        let mag = a.abs() + b.abs();
                        let sums = gamma * (sums[k][row(j)] + sums[k][row(partner)]);
                        (want, sums + (2.0 * TRIG + (4.0 + ang.abs()) * u) * mag)
                    };
                    let got = got[k][at] as f64;
                    assert!(
                        (got - want).abs() <= bound,
                        "{case}: projection {k} head {h} token {tt} value {j}: got {got}, \
                         f64 {want}, bound {bound:e}"
                    );
                }
            }
        }
    }
}
