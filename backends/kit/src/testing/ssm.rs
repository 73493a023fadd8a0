//! The Mamba2 state check: every cache verb is exact on the Mamba2 layers of a hybrid model
//! (Granite 4.0-H), their convolution included, against the f64 recurrence over a history
//! the check keeps itself.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvplug_core::oracle::{gamma, mamba2_step};
use kvplug_core::{CacheConfig, CacheKind, CacheVerbs, KvDtype, LayerSet, PosRange, SsmLayers};
use kvplug_plugin_api::{HostTensor, TensorDtype};

use crate::cache::{KitCache, KitError};
use crate::device::Device;

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

/// A token's row and per-head dt: functions of the tag the script gives it.
fn row(tag: u32) -> Vec<f32> {
    (0..CH + HEADS)
        .map(|c| {
            let h = (tag as u64 * 2_654_435_761 + (c * 13) as u64) % 1009;
            h as f32 / 252.25 - 2.0
        })
        .collect()
}

/// The convolution's kernel, `[CH, WIDTH]`, and bias, `[CH]`.
fn kernel() -> Vec<f32> {
    (0..CH * WIDTH)
        .map(|i| ((i * 7) % 11) as f32 / 5.0 - 1.0)
        .collect()
}

fn bias() -> Vec<f32> {
    (0..CH)
        .map(|c| ((c * 5) % 7) as f32 / 8.0 - 0.375)
        .collect()
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// The f64 recurrence over `tags` (a sequence's tokens from position 0, the current one
/// last): the output of its last token per head value, and the bound on an f32
/// evaluation's difference from it. The bound propagates magnitudes through the same
/// recurrence (`|S| ← decay·|S| + dt·|x|·|B|`, `|y| = |S|·|C| + |d·x|`) and takes `γ(K·t)` of
/// them, `t` tokens, `K = 2·N + 20 + WIDTH` roundings per token: the update and the dot over
/// the state per element, the convolution's sum and bias, SiLU, softplus and exp within a
/// few ulps each. Higham's first-order bound; the convolution's rounding carries through
/// SiLU, whose slope stays below 1.1, and every later term is a product the expansion of
/// the magnitudes holds.
fn reference(tags: &[u32]) -> (Vec<f64>, Vec<f64>) {
    let mut s = vec![vec![0f64; P * N]; HEADS];
    let mut mag = vec![vec![0f64; P * N]; HEADS];
    let (mut out, mut bound) = (vec![0f64; HEADS * P], vec![0f64; HEADS * P]);
    let kernel: Vec<f64> = kernel().iter().map(|&v| v as f64).collect();
    let bias: Vec<f64> = bias().iter().map(|&v| v as f64).collect();
    let rows: Vec<Vec<f64>> = tags
        .iter()
        .map(|&t| row(t).iter().map(|&v| v as f64).collect())
        .collect();
    for (t, r) in rows.iter().enumerate() {
        // The convolution over this and the previous WIDTH − 1 rows (zeros before).
        let act: Vec<f64> = (0..CH)
            .map(|c| {
                let conv: f64 = (0..WIDTH)
                    .filter_map(|j| {
                        let at = (t + j).checked_sub(WIDTH - 1)?;
                        Some(kernel[c * WIDTH + j] * rows[at][c])
                    })
                    .sum();
                silu(conv + bias[c])
            })
            .collect();
        for h in 0..HEADS {
            let g = h / (HEADS / GROUPS);
            let x = &act[h * P..(h + 1) * P];
            let b = &act[HEADS * P + g * N..HEADS * P + (g + 1) * N];
            let c = &act[HEADS * P + GROUPS * N + g * N..HEADS * P + GROUPS * N + (g + 1) * N];
            let (dt_raw, a, d) = (r[CH + h], A[h] as f64, D[h] as f64);
            let y = mamba2_step(&mut s[h], x, b, c, dt_raw, a, d);
            out[h * P..(h + 1) * P].copy_from_slice(&y);
            let dt = dt_raw.exp().ln_1p();
            let decay = (dt * a).exp();
            let m = &mut mag[h];
            for i in 0..P {
                let mut sum = 0.0;
                for j in 0..N {
                    m[i * N + j] = decay * m[i * N + j] + dt * x[i].abs() * b[j].abs();
                    sum += m[i * N + j] * c[j].abs();
                }
                bound[h * P + i] = sum + (d * x[i]).abs();
            }
        }
    }
    let g = gamma((2 * N + 20 + WIDTH) * tags.len());
    (out, bound.iter().map(|b| g * b).collect())
}

/// The tags a sequence holds, by position.
type History = BTreeMap<i32, u32>;

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

/// Runs one step of tokens `(position, tag)` (sequences `seqs` for a seq cache) and checks
/// each token's output against the recurrence over `histories[i]` (what token `i`'s
/// sequence holds before it) and its own tag.
fn step_and_check<D2: Device>(
    cache: &mut KitCache<D2>,
    tokens: &[(i32, u32)],
    seqs: Option<&[i32]>,
    histories: &[History],
    what: &str,
) -> Result<(), KitError> {
    let dev = cache.device().clone();
    let t = tokens.len();
    let positions: Vec<i32> = tokens.iter().map(|x| x.0).collect();
    let mut step = cache.step(&positions, seqs)?;
    let tags: Vec<u32> = tokens.iter().map(|x| x.1).collect();
    let got = run_layer(&mut step, &dev, &tags)?;
    let q = dev.upload(&HostTensor::from_f32(&[2, t, 4], &vec![0.5; 2 * t * 4]))?;
    let kv = dev.upload(&HostTensor::from_f32(&[1, t, 4], &vec![0.25; t * 4]))?;
    let mut att = dev.zeros(&[2, t, 4])?;
    step.attend(1, &q, &kv, &kv, 0.5, &mut att)?;
    for (i, &(p, tag)) in tokens.iter().enumerate() {
        let mut tags: Vec<u32> = histories[i].range(..p).map(|(_, &g)| g).collect();
        assert_eq!(
            tags.len(),
            p as usize,
            "{what}: the script's history has holes"
        );
        tags.push(tag);
        let (want, bound) = reference(&tags);
        for (j, (&w, &b)) in want.iter().zip(&bound).enumerate() {
            let g = got[i * HEADS * P + j] as f64;
            assert!(
                (g - w).abs() <= b,
                "{what}: token {i} (position {p}) output {j}: {g} vs the recurrence's {w} \
                 (bound {b:e}): the scan did not resume from its sequence's own state"
            );
        }
    }
    step.commit()
}

fn config() -> CacheConfig {
    let layers = LayerSet::of([0]).expect("small layer indices");
    CacheConfig {
        capacity: 256,
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 4,
        min_chunk: 4,
        kv_dtype: KvDtype::F32,
        sliding: None,
        conv: None,
        delta: None,
        ssm: Some(SsmLayers {
            heads: HEADS,
            head_dim: P,
            groups: GROUPS,
            state: N,
            width: WIDTH,
            layers,
        }),
    }
}

/// What each of `tokens`, one sequence's run after `h`, sees before it.
fn run(h: &History, tokens: &[(i32, u32)]) -> Vec<History> {
    (0..tokens.len())
        .map(|i| {
            let mut seen = h.clone();
            seen.extend(tokens[..i].iter().copied());
            seen
        })
        .collect()
}

/// Opens a step of one token, runs its Mamba2 layer and drops it.
fn dropped_step<D2: Device>(cache: &mut KitCache<D2>, p: i32, seqs: Option<&[i32]>) {
    let dev = cache.device().clone();
    let mut s = cache.step(&[p], seqs).unwrap();
    run_layer(&mut s, &dev, &[4242]).unwrap();
}

/// The Mamba2 state contract on `device`: a prefill, decoding, a dropped step, a rewind to
/// a step's end and one refused (no anchor there, the cache unchanged) on a contiguous
/// cache; forked sequences that diverge, a tail removed, a hole refused, a cached prefix
/// attached up to its anchored part (seq); a speculative tree whose commit of a branch
/// ending inside it, then decoding (tree): every token's output is the recurrence over its
/// own sequence, within the derived bound.
pub fn check_ssm_verbs<D2: Device>(device: D2) {
    let dev = Arc::new(device);
    let mut c = KitCache::new(dev.clone(), CacheKind::Contiguous, config()).unwrap();
    let mut h = History::new();
    let prefill: Vec<(i32, u32)> = (0..9).map(|p| (p, 100 + p as u32)).collect();
    step_and_check(&mut c, &prefill, None, &run(&h, &prefill), "prefill").unwrap();
    h.extend(prefill.iter().copied());
    for p in 9..12 {
        step_and_check(&mut c, &[(p, 100 + p as u32)], None, &[h.clone()], "decode").unwrap();
        h.insert(p, 100 + p as u32);
    }
    dropped_step(&mut c, 12, None);
    step_and_check(
        &mut c,
        &[(12, 512)],
        None,
        &[h.clone()],
        "after a dropped step",
    )
    .unwrap();
    h.insert(12, 512);
    // Position 10 ended a step (its anchor is kept); position 3 is inside the prefill.
    let e = c.rewind(4).unwrap_err();
    assert!(e.message.contains("not kept"), "{}", e.message);
    assert_eq!(
        c.bookkeeping().high_water(),
        13,
        "a refused rewind changes nothing"
    );
    c.rewind(11).unwrap();
    h.retain(|&p, _| p < 11);
    let redo = [(11, 911), (12, 912)];
    step_and_check(&mut c, &redo, None, &run(&h, &redo), "after a rewind").unwrap();

    // Seq: a shared prefix, a fork that diverges, a tail removed, a hole refused.
    let mut s = KitCache::new(dev.clone(), CacheKind::Seq, config()).unwrap();
    let mut h0 = History::new();
    let prefix: Vec<(i32, u32)> = (0..4).map(|p| (p, 200 + p as u32)).collect();
    step_and_check(
        &mut s,
        &prefix,
        Some(&[0; 4]),
        &run(&h0, &prefix),
        "seq prefill",
    )
    .unwrap();
    h0.extend(prefix.iter().copied());
    s.seq_cp(0, 1, PosRange::ALL).unwrap();
    let mut h1 = h0.clone();
    let fork = [(4, 300), (4, 400)];
    step_and_check(
        &mut s,
        &fork,
        Some(&[0, 1]),
        &[h0.clone(), h1.clone()],
        "fork",
    )
    .unwrap();
    h0.insert(4, 300);
    h1.insert(4, 400);
    let next = [(5, 301), (5, 401)];
    step_and_check(
        &mut s,
        &next,
        Some(&[0, 1]),
        &[h0.clone(), h1.clone()],
        "after the fork",
    )
    .unwrap();
    h0.insert(5, 301);
    h1.insert(5, 401);
    let e = s.seq_rm(0, PosRange::new(Some(1), Some(2))).unwrap_err();
    assert!(e.message.contains("middle"), "{}", e.message);
    s.seq_rm(1, PosRange::new(Some(5), None)).unwrap();
    h1.retain(|&p, _| p < 5);
    dropped_step(&mut s, 5, Some(&[1]));
    let again = [(5, 501), (6, 302)];
    step_and_check(
        &mut s,
        &again,
        Some(&[1, 0]),
        &[h1.clone(), h0.clone()],
        "after seq_rm",
    )
    .unwrap();

    // Prefix reuse: an attached prefix is cut back to its longest anchored part.
    let mut r = KitCache::new(dev.clone(), CacheKind::Seq, config()).unwrap();
    let prompt: Vec<(i32, u32)> = (0..6).map(|p| (p, 300 + p as u32)).collect();
    step_and_check(
        &mut r,
        &prompt,
        Some(&[0; 6]),
        &run(&History::new(), &prompt),
        "to publish",
    )
    .unwrap();
    let ids: Vec<u32> = (1..=6).collect();
    r.prefix_publish(0, &ids).unwrap();
    // Four shared tokens end inside the prompt's step: nothing can be resumed there.
    assert_eq!(r.prefix_attach(1, &[1, 2, 3, 4, 99]).unwrap(), 0);
    assert_eq!(r.prefix_attach(2, &[1, 2, 3, 4, 5, 6, 7]).unwrap(), 6);
    let shared: History = prompt.iter().copied().collect();
    step_and_check(
        &mut r,
        &[(6, 777)],
        Some(&[2]),
        &[shared],
        "after an attach",
    )
    .unwrap();

    // A tree cache's prompt (a plain step) keeps its end's state only, as a contiguous
    // cache's does: the same memory.
    let long: Vec<(i32, u32)> = (0..12).map(|p| (p, 650 + p as u32)).collect();
    let bytes = |kind| {
        let mut c = KitCache::new(dev.clone(), kind, config()).unwrap();
        step_and_check(
            &mut c,
            &long,
            None,
            &run(&History::new(), &long),
            "a prompt",
        )
        .unwrap();
        c.stats().allocated_bytes
    };
    assert_eq!(
        bytes(CacheKind::Tree),
        bytes(CacheKind::Contiguous),
        "a tree cache's prompt keeps a state per token"
    );

    // Tree: a prompt, a tree, the commit of a branch that ends inside it, decoding.
    let mut t = KitCache::new(dev.clone(), CacheKind::Tree, config()).unwrap();
    let base_tokens: Vec<(i32, u32)> = (0..3).map(|p| (p, 600 + p as u32)).collect();
    let base: History = base_tokens.iter().copied().collect();
    step_and_check(
        &mut t,
        &base_tokens,
        None,
        &run(&History::new(), &base_tokens),
        "tree prompt",
    )
    .unwrap();
    // Nodes: 0 (position 3) ← 1, 2 (position 4); 1 ← 3 (position 5).
    t.propose(&[-1, 0, 0, 1]).unwrap();
    let nodes = [(3, 700), (4, 701), (4, 702), (5, 703)];
    let path = |ids: &[usize]| {
        let mut h = base.clone();
        h.extend(ids.iter().map(|&n| nodes[n]));
        h
    };
    let hs = [path(&[]), path(&[0]), path(&[0]), path(&[0, 1])];
    step_and_check(&mut t, &nodes, None, &hs, "tree step").unwrap();
    // The chain through node 2 ends inside the tree: its state is node 2's.
    t.commit(&[0, 2]).unwrap();
    step_and_check(
        &mut t,
        &[(5, 800)],
        None,
        &[path(&[0, 2])],
        "after the commit",
    )
    .unwrap();
}
