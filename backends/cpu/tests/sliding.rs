//! A hybrid cache's sliding-window group on the cpu device: its pools stay bounded by the
//! window however long the history, and a rollback deeper than it holds says how far back
//! is possible.

mod common;

use common::*;
use kvplug_core::{CacheKind, CacheVerbs, ErrorKind, KvDtype, LayerSet, PosRange, SlidingLayers};

const WINDOW: usize = 64;

/// Two layers: layer 0 slides (window 64), layer 1 attends fully.
fn hybrid(kind: CacheKind) -> kvplug_backend_kit::KitCache<kvplug_cpu::CpuDevice> {
    let mut cfg = config(2, 4096, KvDtype::F16);
    cfg.min_chunk = 16;
    cfg.sliding = Some(SlidingLayers {
        window: WINDOW,
        layers: LayerSet::of([0]).unwrap(),
    });
    cache(kind, cfg)
}

/// Bytes of one layer's K and V for `cells` cells.
fn layer_bytes(cells: usize) -> usize {
    2 * cells * HKV * KvDtype::F16.row_bytes(D)
}

#[test]
fn the_sliding_group_stays_bounded_by_the_window() {
    for kind in CacheKind::ALL {
        let mut c = hybrid(kind);
        // A 100-token prefill, then 400 decode steps.
        Step::new(100).run(&mut c, &(0..100).collect::<Vec<_>>());
        let mut step = Step::new(1);
        for p in 100..500 {
            if kind == CacheKind::Seq {
                c.begin_step(&[0]).unwrap();
            }
            step.run(&mut c, &[p]);
        }
        let s = c.stats();
        // The full layer holds 500 rows in a 512-cell pool; the sliding layer held at most
        // 100 rows (the prefill step; later, window + 1), so its pool doubled from 16 to 128
        // cells and never again.
        assert_eq!(s.pool_cells, 512, "{kind}");
        assert_eq!(
            s.allocated_bytes,
            layer_bytes(512) + layer_bytes(128),
            "{kind}"
        );
    }
}

#[test]
fn a_rollback_past_the_window_says_where_it_can_resume() {
    let mut c = hybrid(CacheKind::Contiguous);
    Step::new(200).run(&mut c, &(0..200).collect::<Vec<_>>());
    // The sliding layer keeps positions 136..200; a query at r needs r - 63.. .
    c.rewind(199).unwrap();
    let e = c.rewind(150).unwrap_err();
    assert_eq!(e.kind, ErrorKind::OutOfWindow);
    assert!(
        e.message.contains("resume at position 199 at the earliest"),
        "{}",
        e.message
    );
    assert_eq!(
        c.stats().high_water,
        199,
        "a refused rewind changes nothing"
    );
    // Rewriting from 150 is refused the same way, and changes nothing either.
    let mut step = Step::new(2);
    let scale = 1.0 / (D as f32).sqrt();
    let e = c
        .update_and_attend(
            0,
            &step.q,
            &step.k,
            &step.v,
            &[150, 151],
            scale,
            &mut step.out,
        )
        .unwrap_err();
    assert!(e.to_string().contains("out_of_window"), "{e}");
    assert_eq!(c.stats().high_water, 199);

    let mut s = hybrid(CacheKind::Seq);
    Step::new(200).run(&mut s, &(0..200).collect::<Vec<_>>());
    let e = s.seq_rm(0, PosRange::new(Some(100), None)).unwrap_err();
    assert_eq!(e.kind, ErrorKind::OutOfWindow);
    assert!(
        e.message.contains("resume at position 199"),
        "{}",
        e.message
    );
    assert_eq!(s.seq_len(0).unwrap(), 200);
    // Removing the whole sequence is always possible: it starts again from 0.
    s.seq_rm(0, PosRange::ALL).unwrap();
    Step::new(3).run(&mut s, &[0, 1, 2]);
}
