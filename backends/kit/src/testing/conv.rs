//! The convolution-state check: every cache verb is exact on the short-convolution layers
//! of a hybrid model (or refused, unchanged, where no anchor keeps the state it would need),
//! against the f64 recurrence and a history the check keeps itself.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvplug_core::config::CHAIN_ANCHORS;
use kvplug_core::oracle::{short_conv, short_conv_bound};
use kvplug_core::{
    CacheConfig, CacheKind, CacheVerbs, ConvLayers, ErrorKind, KvDtype, LayerSet, PosRange,
};
use kvplug_plugin_api::{HostTensor, SeqRows, TensorDtype};

use crate::cache::{KitCache, KitError};
use crate::device::Device;

/// Channels (odd, so no kernel can assume a vector width).
const C: usize = 5;
/// Layers: 0 and 2 convolve, 1 attends.
const CONV_LAYERS: [usize; 2] = [0, 2];

/// A token's input row on conv layer `l`: a function of the tag the script gives it, so two
/// sequences at one position can hold different rows.
fn row(l: usize, tag: u32) -> Vec<f32> {
    (0..C)
        .map(|c| {
            let h = (tag as u64 * 2_654_435_761 + (l * 97 + c * 13) as u64) % 1009;
            h as f32 / 504.5 - 1.0
        })
        .collect()
}

fn kernel(l: usize, width: usize) -> Vec<f32> {
    (0..C * width)
        .map(|i| ((i * 7 + l * 3) % 11) as f32 / 5.0 - 1.0)
        .collect()
}

/// The rows a sequence holds, by position (the check's own model of the state).
type History = BTreeMap<i32, u32>;

/// Runs one step of tokens `(position, tag)` (sequences `seqs` for a seq cache) and checks
/// each token's convolution output on both conv layers against the f64 recurrence over
/// `histories[i]` (the rows token `i` sees before it: its sequence's, this step's earlier
/// tokens of it included).
/// Returns `Err` when the step is refused.
fn step_and_check<D2: Device>(
    cache: &mut KitCache<D2>,
    width: usize,
    tokens: &[(i32, u32)],
    seqs: Option<&[i32]>,
    histories: &[History],
    what: &str,
) -> Result<(), KitError> {
    step_reading(cache, width, tokens, seqs, histories, &[], what)
}

/// [`step_and_check`], the outputs of tokens `read` read (as a model reads its logit rows).
fn step_reading<D2: Device>(
    cache: &mut KitCache<D2>,
    width: usize,
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
    for l in 0..3 {
        if !CONV_LAYERS.contains(&l) {
            let q = dev.upload(&HostTensor::from_f32(&[2, t, 4], &vec![0.5; 2 * t * 4]))?;
            let kv = dev.upload(&HostTensor::from_f32(&[1, t, 4], &vec![0.25; t * 4]))?;
            let mut out = dev.zeros(&[2, t, 4])?;
            step.attend(l, &q, &kv, &kv, 0.5, &mut out)?;
            continue;
        }
        let x: Vec<f32> = tokens.iter().flat_map(|&(_, tag)| row(l, tag)).collect();
        let x = dev.upload(&HostTensor::from_f32(&[t, C], &x))?;
        let k = kernel(l, width);
        let mut out = dev.zeros(&[t, C])?;
        step.conv(l, &x, &k, &mut out)?;
        let got = dev.download(&out, TensorDtype::F32)?.to_f32().expect("f32");
        let kernel64: Vec<f64> = k.iter().map(|&v| v as f64).collect();
        for (i, &(p, tag)) in tokens.iter().enumerate() {
            let rows: Vec<Option<Vec<f64>>> = (0..width)
                .map(|j| {
                    let at = p - (width - 1 - j) as i32;
                    let tag = if at == p {
                        Some(tag)
                    } else {
                        histories[i].get(&at).copied()
                    };
                    tag.map(|g| row(l, g).iter().map(|&v| v as f64).collect())
                })
                .collect();
            let window: Vec<Option<&[f64]>> = rows.iter().map(|r| r.as_deref()).collect();
            let want = short_conv(&window, &kernel64, C);
            for c in 0..C {
                let (g, w) = (got[i * C + c] as f64, want[c]);
                let bound = short_conv_bound(&window, &kernel64, c);
                assert!(
                    (g - w).abs() <= bound,
                    "{what}: layer {l} token {i} (position {p}) channel {c}: {g} vs the \
                     recurrence's {w} (bound {bound:e}): the convolution read rows other \
                     than its sequence's last {width}"
                );
            }
        }
    }
    step.commit()
}

fn config(width: usize) -> CacheConfig {
    CacheConfig {
        capacity: 64,
        n_layers: 3,
        n_kv_heads: 1,
        head_dim: 4,
        min_chunk: 4,
        kv_dtype: KvDtype::F32,
        sliding: None,
        delta: None,
        ssm: None,
        conv: Some(ConvLayers {
            width,
            channels: C,
            layers: LayerSet::of(CONV_LAYERS).expect("small layer indices"),
        }),
    }
}

/// Adds `tokens` to `h`.
fn extend(h: &mut History, tokens: &[(i32, u32)]) {
    h.extend(tokens.iter().copied());
}

/// What each of `tokens`, one sequence's run after `h`, sees before it: `h` and the run's
/// earlier tokens.
fn run(h: &History, tokens: &[(i32, u32)]) -> Vec<History> {
    (0..tokens.len())
        .map(|i| {
            let mut seen = h.clone();
            extend(&mut seen, &tokens[..i]);
            seen
        })
        .collect()
}

/// A sequence saved (`export_seq`, the form of session files) carries each convolution
/// layer's rows of its last `width - 1` positions as its state; restored into a seq cache
/// it exports the same rows and decodes as the original would. It refuses (unchanged) a
/// verb that would continue from an earlier position (no state is kept there), and a prefix
/// attached from it stops at its end.
fn check_saved_rows<D2: Device>(dev: &Arc<D2>, c: &KitCache<D2>, w: usize, h: &History) {
    let rows = c.export_seq(0).unwrap();
    assert_eq!(rows.recurrent_layers.as_slice(), [0, 2], "the conv layers");
    assert!(rows.k[0].is_empty() && rows.v[2].is_empty() && !rows.k[1].is_empty());
    let last = *h.keys().last().expect("a history");
    let tail = |l: usize| (last + 2 - w as i32..=last).flat_map(move |q| row(l, h[&q]));
    let want: Vec<u8> = CONV_LAYERS
        .iter()
        .flat_map(|&l| tail(l))
        .flat_map(f32::to_le_bytes)
        .collect();
    assert_eq!(
        rows.state.as_slice(),
        want,
        "each layer's last rows, oldest first"
    );
    let mut r = KitCache::new(dev.clone(), CacheKind::Seq, config(w)).unwrap();
    // Rows that would not start at the sequence's next position (0 here) leave a gap.
    let mut shifted = rows.clone();
    shifted.positions = rows.positions.iter().map(|p| p + 1).collect();
    match r.import_seq(0, &shifted) {
        Err(KitError::Cache(e)) => assert_eq!(e.kind, ErrorKind::BadPosition, "{e}"),
        other => panic!("an import leaving a gap: {other:?}"),
    }
    assert!(
        r.export_seq(0).unwrap().positions.is_empty(),
        "nothing imported"
    );
    r.import_seq(0, &rows).unwrap();
    assert_eq!(
        r.export_seq(0).unwrap(),
        rows,
        "exported again after the import"
    );
    let e = r
        .seq_rm(0, PosRange::new(Some(last), None))
        .expect_err("no state is kept before the restored end");
    assert_eq!(e.kind, ErrorKind::OutOfWindow, "{e}");
    assert_eq!(
        r.export_seq(0).unwrap(),
        rows,
        "a refused verb changes nothing"
    );
    let tokens: Vec<u32> = (0..=last as u32).collect();
    r.prefix_publish(0, &tokens).unwrap();
    assert_eq!(
        r.prefix_attach(1, &tokens).unwrap(),
        tokens.len(),
        "ends restored"
    );
    assert_eq!(
        r.prefix_attach(2, &tokens[..tokens.len() - 1]).unwrap(),
        0,
        "a prefix ending before the restored end"
    );
    let next = [(last + 1, 1234)];
    step_and_check(
        &mut r,
        w,
        &next,
        Some(&[1]),
        std::slice::from_ref(h),
        "restored",
    )
    .unwrap();
}

/// A step dropped after its first layer (sequences `seqs`, at positions `positions`).
fn dropped_step<D2: Device>(
    cache: &mut KitCache<D2>,
    w: usize,
    positions: &[i32],
    seqs: Option<&[i32]>,
) {
    let dev = cache.device().clone();
    let mut s = cache.step(positions, seqs).unwrap();
    let t = positions.len();
    let x: Vec<f32> = (0..t as u32).flat_map(|i| row(0, 7777 + i)).collect();
    let x = dev.upload(&HostTensor::from_f32(&[t, C], &x)).unwrap();
    let mut out = dev.zeros(&[t, C]).unwrap();
    s.conv(0, &x, &kernel(0, w), &mut out).unwrap();
}

/// Asserts that `result` is a refusal whose message says `why`, and that sequence `seq`
/// still exports `before`.
fn refused<D2: Device, T: std::fmt::Debug>(
    c: &KitCache<D2>,
    result: kvplug_core::CacheResult<T>,
    why: &str,
    seq: i32,
    before: &SeqRows,
) {
    let e = result.expect_err(why);
    assert!(e.message.contains(why), "{}", e.message);
    assert_eq!(
        &c.export_seq(seq).unwrap(),
        before,
        "a refused verb changes nothing"
    );
}

/// The convolution-state contract on `device`, for widths 3 and 4: decoding, a rewind to a
/// step's end, a rewind refused where no state is kept, a dropped step and a speculative
/// chain cut inside it (contiguous),
/// forked sequences that diverge, a hole refused and a tail removed (seq), and a
/// speculative tree, its commit and decoding after it (tree) each give every token the
/// convolution of its own sequence's last rows, within the f64 recurrence's bound; a saved
/// sequence restores them (`check_saved_rows`).
pub fn check_conv_verbs<D2: Device>(device: D2) {
    let dev = Arc::new(device);
    for width in [2, 3, 4] {
        let w = width;
        // Contiguous: prefill, decode, rewind and decode other rows, a dropped step.
        let mut c = KitCache::new(dev.clone(), CacheKind::Contiguous, config(w)).unwrap();
        let mut h = History::new();
        let prefill: Vec<(i32, u32)> = (0..5).map(|p| (p, 100 + p as u32)).collect();
        step_and_check(
            &mut c,
            w,
            &prefill,
            None,
            &run(&h, &prefill),
            "contiguous prefill",
        )
        .unwrap();
        extend(&mut h, &prefill);
        step_and_check(
            &mut c,
            w,
            &[(5, 105)],
            None,
            &[h.clone()],
            "contiguous decode",
        )
        .unwrap();
        extend(&mut h, &[(5, 105)]);
        step_and_check(
            &mut c,
            w,
            &[(6, 106)],
            None,
            &[h.clone()],
            "contiguous decode",
        )
        .unwrap();
        // Position 3 is inside the prefill: no state is kept after it.
        let before = c.export_seq(0).unwrap();
        let inside = c.rewind(4);
        refused(&c, inside, "not kept", 0, &before);
        // Position 4 ended the prefill.
        c.rewind(5).unwrap();
        h.retain(|&p, _| p < 5);
        let redo = [(5, 905)];
        step_and_check(&mut c, w, &redo, None, &run(&h, &redo), "after a rewind").unwrap();
        extend(&mut h, &redo);
        // A step dropped after its first layer leaves the state as it was.
        dropped_step(&mut c, w, &[6], None);
        step_and_check(
            &mut c,
            w,
            &[(6, 606)],
            None,
            &[h.clone()],
            "after a dropped step",
        )
        .unwrap();
        extend(&mut h, &[(6, 606)]);
        // A speculative chain (every output read) longer than the states a step keeps: its
        // refused tail is cut exactly inside its first CHAIN_ANCHORS tokens; a cut after
        // them, short of its end, is refused.
        let chain: Vec<(i32, u32)> = (7..9 + CHAIN_ANCHORS as i32)
            .map(|p| (p, 700 + p as u32))
            .collect();
        let read: Vec<usize> = (0..chain.len()).collect();
        step_reading(&mut c, w, &chain, None, &run(&h, &chain), &read, "a chain").unwrap();
        let before = c.export_seq(0).unwrap();
        let late = c.rewind(8 + CHAIN_ANCHORS);
        refused(&c, late, "not kept", 0, &before);
        c.rewind(10).unwrap();
        extend(&mut h, &chain[..3]);
        step_and_check(
            &mut c,
            w,
            &[(10, 710)],
            None,
            &[h.clone()],
            "after a cut chain",
        )
        .unwrap();
        extend(&mut h, &[(10, 710)]);
        check_saved_rows(&dev, &c, w, &h);

        // Seq: a shared prefix, a fork that diverges, a tail removed and decoded again.
        let mut s = KitCache::new(dev.clone(), CacheKind::Seq, config(w)).unwrap();
        let mut h0 = History::new();
        let prefix: Vec<(i32, u32)> = (0..4).map(|p| (p, 200 + p as u32)).collect();
        step_and_check(
            &mut s,
            w,
            &prefix,
            Some(&[0; 4]),
            &run(&h0, &prefix),
            "seq prefill",
        )
        .unwrap();
        extend(&mut h0, &prefix);
        s.seq_cp(0, 1, PosRange::ALL).unwrap();
        let mut h1 = h0.clone();
        let fork = [(4, 300), (4, 400)];
        step_and_check(
            &mut s,
            w,
            &fork,
            Some(&[0, 1]),
            &[h0.clone(), h1.clone()],
            "forked decode",
        )
        .unwrap();
        extend(&mut h0, &fork[..1]);
        extend(&mut h1, &fork[1..]);
        let next = [(5, 301), (5, 401)];
        step_and_check(
            &mut s,
            w,
            &next,
            Some(&[0, 1]),
            &[h0.clone(), h1.clone()],
            "after the fork",
        )
        .unwrap();
        extend(&mut h0, &next[..1]);
        extend(&mut h1, &next[1..]);
        let before = s.export_seq(0).unwrap();
        let hole = s.seq_rm(0, PosRange::new(Some(1), Some(2)));
        refused(&s, hole, "middle", 0, &before);
        s.seq_rm(1, PosRange::new(Some(5), None)).unwrap();
        h1.retain(|&p, _| p < 5);
        // A step of both sequences dropped after its first layer.
        dropped_step(&mut s, w, &[5, 6], Some(&[1, 0]));
        let again = [(5, 501), (6, 302)];
        step_and_check(
            &mut s,
            w,
            &again,
            Some(&[1, 0]),
            &[h1.clone(), h0.clone()],
            "after seq_rm",
        )
        .unwrap();
        // Sequence 0 holds 0..=6: a step at 8 would skip 7.
        let before = s.export_seq(0).unwrap();
        match s.step(&[8], Some(&[0])) {
            Err(KitError::Cache(e)) => {
                assert_eq!(e.kind, ErrorKind::BadPosition, "{e}");
                assert!(e.message.contains("skips"), "{e}");
            }
            Err(e) => panic!("a step skipping a position: {e}"),
            Ok(_) => panic!("a step skipping a position was accepted"),
        }
        assert_eq!(
            s.export_seq(0).unwrap(),
            before,
            "a refused step changes nothing"
        );

        // Tree: committed base, a proposed tree, the commit of one branch, then decoding.
        let mut t = KitCache::new(dev.clone(), CacheKind::Tree, config(w)).unwrap();
        let mut base = History::new();
        let prompt: Vec<(i32, u32)> = (0..3).map(|p| (p, 600 + p as u32)).collect();
        step_and_check(
            &mut t,
            w,
            &prompt,
            None,
            &run(&base, &prompt),
            "tree prompt",
        )
        .unwrap();
        extend(&mut base, &prompt);
        // Nodes: 0 (position 3) ← 1, 2 (position 4); 1 ← 3 (position 5).
        t.propose(&[-1, 0, 0, 1]).unwrap();
        let nodes = [(3, 700), (4, 701), (4, 702), (5, 703)];
        let path = |ids: &[usize]| {
            let mut h = base.clone();
            for &n in ids {
                extend(&mut h, &nodes[n..n + 1]);
            }
            h
        };
        let hs = [path(&[]), path(&[0]), path(&[0]), path(&[0, 1])];
        step_and_check(&mut t, w, &nodes, None, &hs, "tree step").unwrap();
        // The chain through node 1 and its child: node 3's row moves from the cell after
        // node 2's to node 2's cell.
        t.commit(&[0, 1, 3]).unwrap();
        let kept = path(&[0, 1, 3]);
        step_and_check(&mut t, w, &[(6, 800)], None, &[kept], "after the commit").unwrap();
    }
}
