//! What the recurrent-state checks share: the script of verbs every recurrent layer kind
//! must be exact under ([`check_verbs`]), over a [`Layer`] that runs one step of its kind and
//! checks every token against its own f64 recurrence.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvplug_core::config::CHAIN_ANCHORS;
use kvplug_core::{CacheConfig, CacheKind, CacheVerbs, KvDtype, LayerSet, PosRange};

use crate::cache::{KitCache, KitError};
use crate::device::Device;

/// The tags a sequence holds, by position.
pub(super) type History = BTreeMap<i32, u32>;

/// A recurrent layer kind under check: layer 0 of [`Layer::config`] is one of its layers,
/// layer 1 attends.
pub(super) trait Layer {
    /// A cache config with the layer.
    fn config() -> CacheConfig;

    /// Runs one step of tokens `(position, tag)` (sequences `seqs` for a seq cache), the
    /// outputs of tokens `read` read (as a model reads its logit rows), and checks each
    /// token's output against the recurrence over `histories[i]` (what token `i`'s
    /// sequence holds before it) and its own tag.
    fn step<D2: Device>(
        cache: &mut KitCache<D2>,
        tokens: &[(i32, u32)],
        seqs: Option<&[i32]>,
        histories: &[History],
        read: &[usize],
        what: &str,
    ) -> Result<(), KitError>;

    /// Opens a step of one token at `p`, runs the layer and drops the step.
    fn dropped_step<D2: Device>(cache: &mut KitCache<D2>, p: i32, seqs: Option<&[i32]>);
}

/// [`Layer::step`], no output read.
pub(super) fn step_and_check<L: Layer, D2: Device>(
    cache: &mut KitCache<D2>,
    tokens: &[(i32, u32)],
    seqs: Option<&[i32]>,
    histories: &[History],
    what: &str,
) -> Result<(), KitError> {
    L::step(cache, tokens, seqs, histories, &[], what)
}

/// Ends a step whose recurrent layer (layer 0) wrote `got` (`width` outputs per token):
/// runs the attention layer (layer 1), checks each token's outputs against `reference` over
/// its sequence's tags (`histories[i]` before it, then its own) within the bound it gives,
/// and commits. `what` names the step in a failure, `resumed` the state that was wrong.
#[allow(clippy::too_many_arguments)]
pub(super) fn check_and_commit<D2: Device>(
    mut step: crate::cache::Step<'_, D2>,
    dev: &D2,
    tokens: &[(i32, u32)],
    histories: &[History],
    got: &[f32],
    width: usize,
    reference: impl Fn(&[u32]) -> (Vec<f64>, Vec<f64>),
    what: &str,
) -> Result<(), KitError> {
    use kvplug_plugin_api::HostTensor;
    let t = tokens.len();
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
            let g = got[i * width + j] as f64;
            assert!(
                (g - w).abs() <= b,
                "{what}: token {i} (position {p}) output {j}: {g} vs the recurrence's {w} \
                 (bound {b:e}): the layer did not resume from its sequence's own state"
            );
        }
    }
    step.commit()
}

/// The checks' cache config: two layers, layer 0 recurrent as `recurrent` makes it (given
/// the set holding layer 0), layer 1 attending with one KV head of 4; f32 K/V.
pub(super) fn test_config(recurrent: impl FnOnce(&mut CacheConfig, LayerSet)) -> CacheConfig {
    let mut c = CacheConfig {
        capacity: 256,
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 4,
        min_chunk: 4,
        kv_dtype: KvDtype::F32,
        sliding: None,
        conv: None,
        delta: None,
        ssm: None,
    };
    recurrent(&mut c, LayerSet::of([0]).expect("small layer indices"));
    c
}

/// A token's `len` input values: functions of the tag the script gives it, in [−2, 2).
pub(super) fn tagged_row(tag: u32, len: usize) -> Vec<f32> {
    (0..len)
        .map(|c| {
            let h = (tag as u64 * 2_654_435_761 + (c * 13) as u64) % 1009;
            h as f32 / 252.25 - 2.0
        })
        .collect()
}

/// A depthwise convolution kernel, `[channels, width]`, in [−1, 1].
pub(super) fn test_kernel(channels: usize, width: usize) -> Vec<f32> {
    (0..channels * width)
        .map(|i| ((i * 7) % 11) as f32 / 5.0 - 1.0)
        .collect()
}

/// A convolution's value and magnitude.
pub(super) type Convolved = (f64, f64);

/// The f64 base of a check's reference: the rows of `tags` (`tagged_row` of `len`), and
/// per token the causal depthwise convolution of their first `kernel.len() / width`
/// channels over this and the previous `width − 1` rows (zeros before the first), with its
/// magnitude `Σ |kernel · row|` (what its f32 rounding is relative to).
pub(super) fn convolved(
    tags: &[u32],
    len: usize,
    kernel: &[f32],
    width: usize,
) -> (Vec<Vec<f64>>, Vec<Vec<Convolved>>) {
    let channels = kernel.len() / width;
    let rows: Vec<Vec<f64>> = tags
        .iter()
        .map(|&t| tagged_row(t, len).iter().map(|&v| v as f64).collect())
        .collect();
    let conv = (0..rows.len())
        .map(|t| {
            (0..channels)
                .map(|c| {
                    (0..width)
                        .filter_map(|j| {
                            let at = (t + j).checked_sub(width - 1)?;
                            Some(kernel[c * width + j] as f64 * rows[at][c])
                        })
                        .fold((0.0, 0.0), |(s, m), p| (s + p, m + p.abs()))
                })
                .collect()
        })
        .collect();
    (rows, conv)
}

pub(super) fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// What each of `tokens`, one sequence's run after `h`, sees before it.
pub(super) fn run(h: &History, tokens: &[(i32, u32)]) -> Vec<History> {
    (0..tokens.len())
        .map(|i| {
            let mut seen = h.clone();
            seen.extend(tokens[..i].iter().copied());
            seen
        })
        .collect()
}

/// The verbs every recurrent layer kind is exact under, on `dev`: a prefill, decoding, a
/// dropped step, a rewind to a step's end and one refused (no anchor there, the cache
/// unchanged), a speculative chain cut inside it and a cut past its kept anchors refused,
/// on a contiguous cache; forked sequences that diverge, a tail removed, a hole
/// refused, a cached prefix attached up to its anchored part (seq); a tree cache's prompt
/// keeping its end's state only; a speculative tree whose commit of a branch ending inside
/// it, then decoding (tree): every token's output is the recurrence over its own sequence,
/// within the layer's derived bound.
pub(super) fn check_verbs<L: Layer, D2: Device>(dev: &Arc<D2>) {
    let mut c = KitCache::new(dev.clone(), CacheKind::Contiguous, L::config()).unwrap();
    let mut h = History::new();
    let prefill: Vec<(i32, u32)> = (0..9).map(|p| (p, 100 + p as u32)).collect();
    step_and_check::<L, D2>(&mut c, &prefill, None, &run(&h, &prefill), "prefill").unwrap();
    h.extend(prefill.iter().copied());
    for p in 9..12 {
        step_and_check::<L, D2>(&mut c, &[(p, 100 + p as u32)], None, &[h.clone()], "decode")
            .unwrap();
        h.insert(p, 100 + p as u32);
    }
    L::dropped_step(&mut c, 12, None);
    step_and_check::<L, D2>(
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
    step_and_check::<L, D2>(&mut c, &redo, None, &run(&h, &redo), "after a rewind").unwrap();
    h.extend(redo);
    // A speculative chain (every output read) longer than the anchors a step keeps: its
    // refused tail is cut exactly inside its first CHAIN_ANCHORS tokens; a cut after them,
    // short of its end, is refused.
    let chain: Vec<(i32, u32)> = (13..15 + CHAIN_ANCHORS as i32)
        .map(|p| (p, 900 + p as u32))
        .collect();
    let read: Vec<usize> = (0..chain.len()).collect();
    L::step(&mut c, &chain, None, &run(&h, &chain), &read, "a chain").unwrap();
    let e = c.rewind(14 + CHAIN_ANCHORS).unwrap_err();
    assert!(e.message.contains("not kept"), "{}", e.message);
    c.rewind(16).unwrap();
    h.extend(chain[..3].iter().copied());
    step_and_check::<L, D2>(
        &mut c,
        &[(16, 916)],
        None,
        &[h.clone()],
        "after a cut chain",
    )
    .unwrap();

    // Seq: a shared prefix, a fork that diverges, a tail removed, a hole refused.
    let mut s = KitCache::new(dev.clone(), CacheKind::Seq, L::config()).unwrap();
    let mut h0 = History::new();
    let prefix: Vec<(i32, u32)> = (0..4).map(|p| (p, 200 + p as u32)).collect();
    step_and_check::<L, D2>(
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
    step_and_check::<L, D2>(
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
    step_and_check::<L, D2>(
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
    L::dropped_step(&mut s, 5, Some(&[1]));
    let again = [(5, 501), (6, 302)];
    step_and_check::<L, D2>(
        &mut s,
        &again,
        Some(&[1, 0]),
        &[h1.clone(), h0.clone()],
        "after seq_rm",
    )
    .unwrap();
    h1.insert(5, 501);
    h0.insert(6, 302);
    // Both sequences' speculative chains in one step, the first keeping more states than
    // the spares a verb leaves, then each cut early in its chain, the second first: that
    // cut's check keeps the other chain's states.
    let (long, short) = (CHAIN_ANCHORS - 3, 5usize);
    let mut chains: Vec<(i32, u32)> = (7..7 + long as i32).map(|p| (p, 700 + p as u32)).collect();
    chains.extend((6..6 + short as i32).map(|p| (p, 600 + p as u32)));
    let mut seqs = vec![0; long];
    seqs.extend(vec![1; short]);
    let mut hs = run(&h0, &chains[..long]);
    hs.extend(run(&h1, &chains[long..]));
    let read: Vec<usize> = (0..chains.len()).collect();
    L::step(&mut s, &chains, Some(&seqs), &hs, &read, "two chains").unwrap();
    s.seq_rm(1, PosRange::new(Some(7), None)).unwrap();
    // Every kept state of the first chain is still there: a copy of it ending at each.
    for (k, p) in (7..6 + long as i32).enumerate() {
        let copy = 2 + k as i32;
        if let Err(e) = s.seq_cp(0, copy, PosRange::new(None, Some(p + 1))) {
            panic!("the chain's state at {p} was dropped by the other's cut: {e}");
        }
        s.seq_rm(copy, PosRange::ALL).unwrap();
    }
    s.seq_rm(0, PosRange::new(Some(8), None)).unwrap();
    h1.insert(6, 606);
    h0.insert(7, 707);
    step_and_check::<L, D2>(
        &mut s,
        &[(7, 617), (8, 718)],
        Some(&[1, 0]),
        &[h1.clone(), h0.clone()],
        "after two cut chains",
    )
    .unwrap();

    // Prefix reuse: an attached prefix is cut back to its longest anchored part.
    let mut r = KitCache::new(dev.clone(), CacheKind::Seq, L::config()).unwrap();
    let prompt: Vec<(i32, u32)> = (0..6).map(|p| (p, 300 + p as u32)).collect();
    step_and_check::<L, D2>(
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
    step_and_check::<L, D2>(
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
        let mut c = KitCache::new(dev.clone(), kind, L::config()).unwrap();
        step_and_check::<L, D2>(
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
    let mut t = KitCache::new(dev.clone(), CacheKind::Tree, L::config()).unwrap();
    let base_tokens: Vec<(i32, u32)> = (0..3).map(|p| (p, 600 + p as u32)).collect();
    let base: History = base_tokens.iter().copied().collect();
    step_and_check::<L, D2>(
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
    step_and_check::<L, D2>(&mut t, &nodes, None, &hs, "tree step").unwrap();
    // The chain through node 2 ends inside the tree: its state is node 2's.
    t.commit(&[0, 2]).unwrap();
    step_and_check::<L, D2>(
        &mut t,
        &[(5, 800)],
        None,
        &[path(&[0, 2])],
        "after the commit",
    )
    .unwrap();
}
