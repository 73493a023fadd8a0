//! The delta-rule state check: every cache verb is exact on the gated delta-rule layers of a
//! hybrid model (Qwen3.5), their convolution included, against the f64 recurrence over a
//! history the check keeps itself.

use std::sync::Arc;

use kvplug_core::config::{PROMPT_END_ANCHORS, SPARE_ANCHORS};
use kvplug_core::oracle::{gamma, gated_delta_step};
use kvplug_core::{CacheConfig, CacheKind, CacheVerbs, DeltaLayers};
use kvplug_plugin_api::{HostTensor, TensorDtype};

use crate::cache::{KitCache, KitError};
use crate::delta_rule::CHUNK;
use crate::device::Device;

use super::recurrent::{
    check_and_commit, check_verbs, convolved, run, silu, step_and_check, tagged_row, test_config,
    test_kernel, History, Layer,
};

/// One key head serving two value heads of 4 dims: q, k, then two v heads.
const HK: usize = 1;
const HV: usize = 2;
const N: usize = 4;
const CH: usize = (2 * HK + HV) * N;
/// The convolution's taps.
const WIDTH: usize = 4;
/// Per value head, `−exp(A_log)`.
const A: [f32; HV] = [-0.5, -1.25];
const EPS: f32 = 1e-6;

/// A token's row (q, k, v), alpha and beta.
fn row(tag: u32) -> Vec<f32> {
    tagged_row(tag, CH + 2 * HV)
}

/// The convolution's kernel, `[CH, WIDTH]`.
fn kernel() -> Vec<f32> {
    test_kernel(CH, WIDTH)
}

/// The f64 recurrence over `tags` (a sequence's tokens from position 0, the current one
/// last): the output of its last token per value head, and the bound on an f32
/// evaluation's difference from it. The bound propagates magnitudes through the same
/// recurrence (`|S| ← g·|S| + b·|k|·(|v| + g·|S|ᵀ|k|)`, `|out| = |S|ᵀ|q|`) and takes
/// `γ(K·t)` of them, `t` tokens, `K = 3·N + 20 + WIDTH + 2·CHUNK` roundings per token: the
/// two dots and the rank-one update per element, the q/k normalization, the convolution's
/// sum, SiLU, exp, softplus and sigmoid within a few ulps; and, for runs the rule advances
/// in its chunked form, the two sums over at most `CHUNK` earlier tokens of the chunk that
/// each `u` and output adds (the form's other terms are dots of `N`, and decay factors each
/// rounded once from an f64 sum of log decays). Every term the chunked form sums appears, in
/// absolute value, in the magnitudes' expansion, so they bound both forms. Higham's
/// first-order bound, which holds for the convolution's rounding too because SiLU's slope
/// stays below 1.1 and the normalization divides by norms the rows keep well above the
/// error.
fn reference(tags: &[u32]) -> (Vec<f64>, Vec<f64>) {
    let mut s = vec![vec![0f64; N * N]; HV];
    let mut mag = vec![vec![0f64; N * N]; HV];
    let (mut out, mut bound) = (vec![0f64; HV * N], vec![0f64; HV * N]);
    let (rows, conv) = convolved(tags, CH + 2 * HV, &kernel(), WIDTH);
    for (x, conv) in rows.iter().zip(&conv) {
        let act: Vec<f64> = conv.iter().map(|&(c, _)| silu(c)).collect();
        let (q, k) = (&act[..N], &act[N..2 * N]);
        let norm = |v: &[f64]| (v.iter().map(|a| a * a).sum::<f64>() + 1e-6).sqrt();
        let (qn, kn) = (norm(q), norm(k));
        for h in 0..HV {
            let v = &act[2 * N + h * N..2 * N + (h + 1) * N];
            let alpha = x[CH + h];
            let g = A[h] as f64 * alpha.exp().ln_1p();
            let beta = 1.0 / (1.0 + (-x[CH + HV + h]).exp());
            let o = gated_delta_step(&mut s[h], q, k, v, g, beta);
            out[h * N..(h + 1) * N].copy_from_slice(&o);
            let (m, decay) = (&mut mag[h], g.exp());
            for j in 0..N {
                let recalled: f64 = (0..N).map(|i| m[i * N + j] * k[i].abs() / kn).sum();
                for i in 0..N {
                    m[i * N + j] = decay * m[i * N + j]
                        + beta * k[i].abs() / kn * (v[j].abs() + decay * recalled);
                }
                bound[h * N + j] = (0..N)
                    .map(|i| m[i * N + j] * q[i].abs() / qn / (N as f64).sqrt())
                    .sum();
            }
        }
    }
    let g = gamma((3 * N + 20 + WIDTH + 2 * CHUNK) * tags.len());
    (out, bound.iter().map(|b| g * b).collect())
}

/// The delta-rule layer kind under the shared script.
struct Delta;

impl Layer for Delta {
    fn config() -> CacheConfig {
        test_config(|c, layers| {
            c.delta = Some(DeltaLayers {
                key_heads: HK,
                value_heads: HV,
                head_dim: N,
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
        let t = tokens.len();
        let positions: Vec<i32> = tokens.iter().map(|x| x.0).collect();
        let mut step = cache.step(&positions, seqs)?;
        step.read_rows(read);
        let rows: Vec<Vec<f32>> = tokens.iter().map(|&(_, tag)| row(tag)).collect();
        let x: Vec<f32> = rows.iter().flat_map(|r| r[..CH].to_vec()).collect();
        let part =
            |at: usize| -> Vec<f32> { rows.iter().flat_map(|r| r[at..at + HV].to_vec()).collect() };
        let x = dev.upload(&HostTensor::from_f32(&[t, CH], &x))?;
        let alpha = dev.upload(&HostTensor::from_f32(&[t, HV], &part(CH)))?;
        let beta = dev.upload(&HostTensor::from_f32(&[t, HV], &part(CH + HV)))?;
        let mut out = dev.zeros(&[t, HV * N])?;
        step.delta(0, &x, &kernel(), &alpha, &beta, &A, EPS, &mut out)?;
        let got = dev.download(&out, TensorDtype::F32)?.to_f32().expect("f32");
        check_and_commit(step, &dev, tokens, histories, &got, HV * N, reference, what)
    }

    fn dropped_step<D2: Device>(cache: &mut KitCache<D2>, p: i32, seqs: Option<&[i32]>) {
        let dev = cache.device().clone();
        let mut s = cache.step(&[p], seqs).unwrap();
        let r = row(4242);
        let x = dev
            .upload(&HostTensor::from_f32(&[1, CH], &r[..CH]))
            .unwrap();
        let ab = dev
            .upload(&HostTensor::from_f32(&[1, HV], &r[CH..CH + HV]))
            .unwrap();
        let mut out = dev.zeros(&[1, HV * N]).unwrap();
        s.delta(0, &x, &kernel(), &ab, &ab, &A, EPS, &mut out)
            .unwrap();
    }
}

/// A prompt prefilled in two chunks (the last token's output read, as a model reads its
/// logits), then more decode steps than spares are kept, each with a speculative chain of
/// two read tokens written between them: the cache returns to the prompt's end (its anchor
/// is kept as a prompt end), not to the first chunk's or a chain's (only spares), and
/// decodes from there.
fn check_prompt_ends<D2: Device>(dev: &Arc<D2>) {
    let mut c = KitCache::new(dev.clone(), CacheKind::Contiguous, Delta::config()).unwrap();
    let mut h = History::new();
    for (chunk, read) in [(0..4, &[][..]), (4..8, &[3][..])] {
        let tokens: Vec<(i32, u32)> = chunk.map(|p| (p, 700 + p as u32)).collect();
        let hs = run(&h, &tokens);
        Delta::step(&mut c, &tokens, None, &hs, read, "a prompt's chunk").unwrap();
        h.extend(tokens);
    }
    let end = 8 + 3 * (SPARE_ANCHORS + PROMPT_END_ANCHORS) as i32;
    for p in (8..end).step_by(3) {
        let one = [(p, 700 + p as u32)];
        Delta::step(&mut c, &one, None, &run(&h, &one), &[0], "decode").unwrap();
        h.extend(one);
        let chain = [(p + 1, 701 + p as u32), (p + 2, 702 + p as u32)];
        Delta::step(&mut c, &chain, None, &run(&h, &chain), &[0, 1], "a chain").unwrap();
        h.extend(chain);
    }
    // A verb drops the anchors beyond the budgets.
    c.rewind(end as usize).unwrap();
    let e = c.rewind(4).unwrap_err();
    assert!(
        e.message.contains("not kept"),
        "a chunk's end: {}",
        e.message
    );
    c.rewind(8).expect("the prompt's end is kept");
    h.retain(|&p, _| p < 8);
    step_and_check::<Delta, D2>(&mut c, &[(8, 808)], None, &[h], "after the prompt's end").unwrap();
}

/// The delta-rule state contract on `device`: prefill chunks long enough to split the heads
/// over threads and to cross chunks of the chunked form, the second resuming from the
/// first's anchor; the shared script ([`check_verbs`]); a prompt's end kept
/// (`check_prompt_ends`): every token's output is the recurrence over its own sequence,
/// within the derived bound.
pub fn check_delta_verbs<D2: Device>(device: D2) {
    let dev = Arc::new(device);
    let mut c = KitCache::new(dev.clone(), CacheKind::Contiguous, Delta::config()).unwrap();
    let mut h = History::new();
    let c0 = CHUNK as i32 + 9;
    for (what, ps) in [("prefill", 0..c0), ("second chunk", c0..2 * c0)] {
        let chunk: Vec<(i32, u32)> = ps.map(|p| (p, 100 + p as u32)).collect();
        step_and_check::<Delta, D2>(&mut c, &chunk, None, &run(&h, &chunk), what).unwrap();
        h.extend(chunk.iter().copied());
    }
    check_verbs::<Delta, D2>(&dev);
    check_prompt_ends(&dev);
}
