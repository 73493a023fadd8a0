//! The delta-rule state check: every cache verb is exact on the gated delta-rule layers of a
//! hybrid model (Qwen3.5), their convolution included, against the f64 recurrence over a
//! history the check keeps itself.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvplug_core::config::{PROMPT_END_ANCHORS, SPARE_ANCHORS};
use kvplug_core::oracle::{gamma, gated_delta_step};
use kvplug_core::{CacheConfig, CacheKind, CacheVerbs, DeltaLayers, KvDtype, LayerSet, PosRange};
use kvplug_plugin_api::{HostTensor, TensorDtype};

use crate::cache::{KitCache, KitError};
use crate::delta_rule::CHUNK;
use crate::device::Device;

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

/// A token's row, alpha and beta: functions of the tag the script gives it.
fn row(tag: u32) -> Vec<f32> {
    (0..CH + 2 * HV)
        .map(|c| {
            let h = (tag as u64 * 2_654_435_761 + (c * 13) as u64) % 1009;
            h as f32 / 252.25 - 2.0
        })
        .collect()
}

/// The convolution's kernel, `[CH, WIDTH]`.
fn kernel() -> Vec<f32> {
    (0..CH * WIDTH)
        .map(|i| ((i * 7) % 11) as f32 / 5.0 - 1.0)
        .collect()
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
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
    let kernel: Vec<f64> = kernel().iter().map(|&v| v as f64).collect();
    let rows: Vec<Vec<f64>> = tags
        .iter()
        .map(|&t| row(t).iter().map(|&v| v as f64).collect())
        .collect();
    for (t, x) in rows.iter().enumerate() {
        // The convolution over this and the previous WIDTH − 1 rows (zeros before).
        let act: Vec<f64> = (0..CH)
            .map(|c| {
                let conv: f64 = (0..WIDTH)
                    .filter_map(|j| {
                        let at = (t + j).checked_sub(WIDTH - 1)?;
                        Some(kernel[c * WIDTH + j] * rows[at][c])
                    })
                    .sum();
                silu(conv)
            })
            .collect();
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

/// The tags a sequence holds, by position.
type History = BTreeMap<i32, u32>;

/// Runs one step of tokens `(position, tag)` (sequences `seqs` for a seq cache) and checks
/// each token's rule output against the recurrence over `histories[i]` (what token `i`'s
/// sequence holds before it) and its own tag.
fn step_and_check<D2: Device>(
    cache: &mut KitCache<D2>,
    tokens: &[(i32, u32)],
    seqs: Option<&[i32]>,
    histories: &[History],
    what: &str,
) -> Result<(), KitError> {
    step_reading(cache, tokens, seqs, histories, &[], what)
}

/// [`step_and_check`], the outputs of tokens `read` read (as a model reads its logit rows).
fn step_reading<D2: Device>(
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
    let q = dev.upload(&HostTensor::from_f32(&[2, t, 4], &vec![0.5; 2 * t * 4]))?;
    let kv = dev.upload(&HostTensor::from_f32(&[1, t, 4], &vec![0.25; t * 4]))?;
    let mut att = dev.zeros(&[2, t, 4])?;
    step.attend(1, &q, &kv, &kv, 0.5, &mut att)?;
    let got = dev.download(&out, TensorDtype::F32)?.to_f32().expect("f32");
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
            let g = got[i * HV * N + j] as f64;
            assert!(
                (g - w).abs() <= b,
                "{what}: token {i} (position {p}) output {j}: {g} vs the recurrence's {w} \
                 (bound {b:e}): the rule did not resume from its sequence's own state"
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
        delta: Some(DeltaLayers {
            key_heads: HK,
            value_heads: HV,
            head_dim: N,
            width: WIDTH,
            layers,
        }),
        ssm: None,
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

/// Opens a step of one token, runs its delta layer and drops it.
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

/// A prompt prefilled in two chunks (the last token's output read, as a model reads its
/// logits), then more decode steps than spares are kept, each with a speculative chain of
/// two read tokens written between them: the cache returns to the prompt's end (its anchor
/// is kept as a prompt end), not to the first chunk's or a chain's (only spares), and
/// decodes from there.
fn check_prompt_ends<D2: Device>(dev: &Arc<D2>) {
    let mut c = KitCache::new(dev.clone(), CacheKind::Contiguous, config()).unwrap();
    let mut h = History::new();
    for (chunk, read) in [(0..4, &[][..]), (4..8, &[3][..])] {
        let tokens: Vec<(i32, u32)> = chunk.map(|p| (p, 700 + p as u32)).collect();
        let hs = run(&h, &tokens);
        step_reading(&mut c, &tokens, None, &hs, read, "a prompt's chunk").unwrap();
        h.extend(tokens);
    }
    let end = 8 + 3 * (SPARE_ANCHORS + PROMPT_END_ANCHORS) as i32;
    for p in (8..end).step_by(3) {
        let one = [(p, 700 + p as u32)];
        step_reading(&mut c, &one, None, &run(&h, &one), &[0], "decode").unwrap();
        h.extend(one);
        let chain = [(p + 1, 701 + p as u32), (p + 2, 702 + p as u32)];
        step_reading(&mut c, &chain, None, &run(&h, &chain), &[0, 1], "a chain").unwrap();
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
    step_and_check(&mut c, &[(8, 808)], None, &[h], "after the prompt's end").unwrap();
}

/// The delta-rule state contract on `device`: a prefill (its heads over threads),
/// decoding, a dropped step, a rewind to a step's end and one refused (no anchor there, the
/// cache unchanged) on a contiguous cache, and a prompt's end kept (`check_prompt_ends`);
/// forked sequences that diverge, a tail removed, a hole refused, a cached prefix attached
/// up to its anchored part (seq); a speculative tree
/// whose commit of a branch ending inside it, then decoding (tree): every token's output
/// is the recurrence over its own sequence, within the derived bound.
pub fn check_delta_verbs<D2: Device>(device: D2) {
    let dev = Arc::new(device);
    // Contiguous.
    let mut c = KitCache::new(dev.clone(), CacheKind::Contiguous, config()).unwrap();
    let mut h = History::new();
    // Prefill chunks long enough to split the heads over threads and to cross chunks of
    // the chunked form, the second resuming from the first's anchor.
    let c0 = CHUNK as i32 + 9;
    for (what, ps) in [("prefill", 0..c0), ("second chunk", c0..2 * c0)] {
        let chunk: Vec<(i32, u32)> = ps.map(|p| (p, 100 + p as u32)).collect();
        step_and_check(&mut c, &chunk, None, &run(&h, &chunk), what).unwrap();
        h.extend(chunk.iter().copied());
    }
    c.clear();
    h.clear();
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

    check_prompt_ends(&dev);

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
