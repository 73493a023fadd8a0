//! The Mamba2 state check: every cache verb is exact on the Mamba2 layers of a hybrid model
//! (Granite 4.0-H), their convolution included, against the f64 recurrence over a history
//! the check keeps itself.

use std::sync::Arc;

use kvplug_core::oracle::{gamma, mamba2_step};
use kvplug_core::{CacheConfig, SsmLayers};
use kvplug_plugin_api::{HostTensor, TensorDtype};

use crate::cache::{KitCache, KitError};
use crate::device::Device;

use super::recurrent::{
    check_and_commit, check_verbs, convolved, silu, tagged_row, test_config, test_kernel, History,
    Layer,
};

/// Four heads of 3 values in two groups of 4-wide B and C: x, then B, then C.
const HEADS: usize = 4;
const P: usize = 3;
const GROUPS: usize = 2;
const N: usize = 4;
const CH: usize = HEADS * P + 2 * GROUPS * N;
/// The convolution's taps.
const WIDTH: usize = 4;
/// Per head, `−exp(A_log)`, and the skip weights.
const A: [f32; HEADS] = [-0.5, -1.25, -3.0, -0.125];
const D: [f32; HEADS] = [1.0, -0.5, 0.25, 2.0];

/// A token's row (x, B and C) and per-head dt.
fn row(tag: u32) -> Vec<f32> {
    tagged_row(tag, CH + HEADS)
}

/// The convolution's kernel, `[CH, WIDTH]`, and bias, `[CH]`.
fn kernel() -> Vec<f32> {
    test_kernel(CH, WIDTH)
}

fn bias() -> Vec<f32> {
    (0..CH)
        .map(|c| ((c * 5) % 7) as f32 / 8.0 - 0.375)
        .collect()
}

/// The f64 recurrence over `tags` (a sequence's tokens from position 0, the current one
/// last): the output of its last token per head value, and the bound on an f32
/// evaluation's difference from it. The bound propagates magnitudes through the same
/// recurrence (`|S| ← decay·|S| + dt·|x|·|B|`, `|y| = |S|·|C| + |d·x|`) and takes `γ(K·t)` of
/// them, `t` tokens, `K = 2·N + 20 + WIDTH` roundings per token: the update and the dot over
/// the state per element, the convolution's sum and bias, SiLU, softplus and exp within a
/// few ulps each. Higham's first-order bound. The convolution rounds relative to its
/// magnitude `Σ|k·row| + |bias|`, not to its value (which may cancel), and SiLU's slope stays
/// below 1.1: so x, B and C enter the magnitudes as `|value| + 1.1·magnitude`.
fn reference(tags: &[u32]) -> (Vec<f64>, Vec<f64>) {
    let mut s = vec![vec![0f64; P * N]; HEADS];
    let mut mag = vec![vec![0f64; P * N]; HEADS];
    let (mut out, mut bound) = (vec![0f64; HEADS * P], vec![0f64; HEADS * P]);
    let bias = bias();
    let (rows, conv) = convolved(tags, CH + HEADS, &kernel(), WIDTH);
    for (r, conv) in rows.iter().zip(&conv) {
        let act: Vec<f64> = conv
            .iter()
            .zip(&bias)
            .map(|(&(c, _), &b)| silu(c + b as f64))
            .collect();
        let am: Vec<f64> = conv
            .iter()
            .zip(&bias)
            .zip(&act)
            .map(|((&(_, m), &b), a)| a.abs() + 1.1 * (m + (b as f64).abs()))
            .collect();
        for h in 0..HEADS {
            let g = h / (HEADS / GROUPS);
            let x = &act[h * P..(h + 1) * P];
            let b = &act[HEADS * P + g * N..HEADS * P + (g + 1) * N];
            let c = &act[HEADS * P + GROUPS * N + g * N..HEADS * P + GROUPS * N + (g + 1) * N];
            let xm = &am[h * P..(h + 1) * P];
            let bm = &am[HEADS * P + g * N..HEADS * P + (g + 1) * N];
            let cm = &am[HEADS * P + GROUPS * N + g * N..HEADS * P + GROUPS * N + (g + 1) * N];
            let (dt_raw, a, d) = (r[CH + h], A[h] as f64, D[h] as f64);
            let y = mamba2_step(&mut s[h], x, b, c, dt_raw, a, d);
            out[h * P..(h + 1) * P].copy_from_slice(&y);
            let dt = dt_raw.exp().ln_1p();
            let decay = (dt * a).exp();
            let m = &mut mag[h];
            for i in 0..P {
                let mut sum = 0.0;
                for j in 0..N {
                    m[i * N + j] = decay * m[i * N + j] + dt * xm[i] * bm[j];
                    sum += m[i * N + j] * cm[j];
                }
                bound[h * P + i] = sum + d.abs() * xm[i];
            }
        }
    }
    let g = gamma((2 * N + 20 + WIDTH) * tags.len());
    (out, bound.iter().map(|b| g * b).collect())
}

/// Uploads the step's rows and runs its Mamba2 layer (layer 0).
fn run_layer<D2: Device>(
    step: &mut crate::cache::Step<'_, D2>,
    dev: &Arc<D2>,
    tags: &[u32],
) -> Result<Vec<f32>, KitError> {
    let t = tags.len();
    let rows: Vec<Vec<f32>> = tags.iter().map(|&tag| row(tag)).collect();
    let x: Vec<f32> = rows.iter().flat_map(|r| r[..CH].to_vec()).collect();
    let dt: Vec<f32> = rows.iter().flat_map(|r| r[CH..].to_vec()).collect();
    let x = dev.upload(&HostTensor::from_f32(&[t, CH], &x))?;
    let dt = dev.upload(&HostTensor::from_f32(&[t, HEADS], &dt))?;
    let mut out = dev.zeros(&[t, HEADS * P])?;
    step.ssm(0, &x, &kernel(), &bias(), &dt, &A, &D, &mut out)?;
    Ok(dev.download(&out, TensorDtype::F32)?.to_f32().expect("f32"))
}

/// The Mamba2 layer kind under the shared script.
struct Ssm;

impl Layer for Ssm {
    fn config() -> CacheConfig {
        test_config(|c, layers| {
            c.ssm = Some(SsmLayers {
                heads: HEADS,
                head_dim: P,
                groups: GROUPS,
                state: N,
                width: WIDTH,
                layers,
            })
        })
    }

    fn step<D2: Device>(
        cache: &mut KitCache<D2>,
        tokens: &[(i32, u32)],
        seqs: Option<&[i32]>,
        histories: &[History],
        read: &[usize],
        what: &str,
    ) -> Result<(), KitError> {
        let dev = cache.device().clone();
        let positions: Vec<i32> = tokens.iter().map(|x| x.0).collect();
        let mut step = cache.step(&positions, seqs)?;
        step.read_rows(read);
        let tags: Vec<u32> = tokens.iter().map(|x| x.1).collect();
        let got = run_layer(&mut step, &dev, &tags)?;
        check_and_commit(
            step,
            &dev,
            tokens,
            histories,
            &got,
            HEADS * P,
            reference,
            what,
        )
    }

    fn dropped_step<D2: Device>(cache: &mut KitCache<D2>, p: i32, seqs: Option<&[i32]>) {
        let dev = cache.device().clone();
        let mut s = cache.step(&[p], seqs).unwrap();
        run_layer(&mut s, &dev, &[4242]).unwrap();
    }
}

/// The Mamba2 state contract on `device` ([`check_verbs`], with two groups of heads): every
/// token's output is the f64 recurrence over its own sequence, within the derived bound.
pub fn check_ssm_verbs<D2: Device>(device: D2) {
    check_verbs::<Ssm, D2>(&Arc::new(device));
}
