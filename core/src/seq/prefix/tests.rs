//! Prefix reuse on the seq cache: reused cells hold the right tokens, eviction never takes a
//! cell a live sequence holds, and reserve frees exactly what it promises.

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;
use crate::error::ErrorKind;
use crate::seq::PosRange;

/// Runs `tokens[from..]` as one step of `seq` at positions `from..`; returns the cells.
fn prefill(b: &mut SeqBookkeeping, seq: i32, tokens: &[u32], from: usize) -> Vec<u32> {
    let n = tokens.len() - from;
    b.begin_step(&vec![seq; n]).unwrap();
    let pos: Vec<i32> = (from as i32..tokens.len() as i32).collect();
    let plan = b.plan(&pos).unwrap();
    match plan.write_start {
        Some(start) => (start as u32..(start + n) as u32).collect(),
        None => plan.write_cells.clone(),
    }
}

#[test]
fn a_second_request_reuses_the_published_prefix() {
    let mut b = SeqBookkeeping::new(16);
    let system = [7u32, 8, 9, 10, 11];
    let first = prefill(&mut b, 0, &system, 0);
    assert_eq!(b.prefix_publish(0, &system), Ok(0));
    b.seq_rm(0, PosRange::ALL).unwrap();
    // The cells stay, owned by no sequence, and invisible.
    assert_eq!((b.live_cells(), b.seq_len(0).unwrap()), (5, 0));
    assert_eq!(
        b.prefix_stats(),
        PrefixStats {
            cached: 5,
            evictable: 5
        }
    );

    let request = [7u32, 8, 9, 10, 11, 3, 4];
    assert_eq!(b.prefix_match(&request), 5);
    assert_eq!(b.prefix_attach(1, &request[..6]), Ok(5));
    assert_eq!(
        b.prefix_stats(),
        PrefixStats {
            cached: 5,
            evictable: 0
        }
    );
    let rest = prefill(&mut b, 1, &request, 5);
    assert_eq!(rest.len(), 2);
    // The suffix attends the reused cells: same cells, no copy.
    let plan = b.current_plan().unwrap();
    for (j, &c) in first.iter().enumerate() {
        assert!(plan.visible(0, c as usize), "cell {j} of the prefix");
    }
    assert_eq!(b.prefix_evict(1).unwrap_err().kind, ErrorKind::Capacity);
    b.seq_rm(1, PosRange::ALL).unwrap();
    assert_eq!(b.prefix_evict(1), Ok(5));
    assert_eq!(b.live_cells(), 0);
}

#[test]
fn a_request_sharing_a_beginning_leaves_the_rest_of_anothers_history_evictable() {
    let mut b = SeqBookkeeping::new(16);
    // Agent A's history, published and kept.
    let a = [1u32, 2, 3, 4, 5, 6];
    prefill(&mut b, 0, &a, 0);
    b.prefix_publish(0, &a).unwrap();
    // Agent B shares A's first three tokens, goes on with its own, publishes, and parks.
    let bee = [1u32, 2, 3, 7, 8, 9, 10];
    assert_eq!(b.prefix_attach(1, &bee[..6]), Ok(3));
    prefill(&mut b, 1, &bee, 3);
    b.prefix_publish(1, &bee).unwrap();
    b.seq_rm(1, PosRange::ALL).unwrap();
    // A holds the three shared cells, not B's four: those can go.
    assert_eq!(
        b.prefix_stats(),
        PrefixStats {
            cached: 10,
            evictable: 4
        }
    );
    assert_eq!(b.prefix_reserve(16 - 6), Ok(4));
    // A fork of A's first two tokens, and A cut to one token: only the fork's two are held.
    b.seq_cp(0, 2, PosRange::new(None, Some(2))).unwrap();
    b.seq_rm(0, PosRange::new(Some(1), None)).unwrap();
    assert_eq!(b.prefix_stats().evictable, 4);
    b.seq_rm(2, PosRange::ALL).unwrap();
    assert_eq!(b.prefix_stats().evictable, 5);
}

#[test]
fn reserve_evicts_only_what_is_missing() {
    let mut b = SeqBookkeeping::new(8);
    let t = [1u32, 2, 3, 4, 5, 6];
    prefill(&mut b, 0, &t, 0);
    b.prefix_publish(0, &t).unwrap();
    b.seq_rm(0, PosRange::ALL).unwrap();
    assert_eq!(b.prefix_reserve(2), Ok(0));
    assert_eq!(b.prefix_reserve(3), Ok(6));
    assert!(b.can_extend(8));
    assert_eq!(b.prefix_reserve(9).unwrap_err().kind, ErrorKind::Capacity);
}

#[test]
fn bad_publish_and_attach_change_nothing() {
    let mut b = SeqBookkeeping::new(8);
    prefill(&mut b, 0, &[1, 2, 3], 0);
    let before = format!("{b:?}");
    assert_eq!(
        b.prefix_publish(0, &[1, 2, 3, 4]).unwrap_err().kind,
        ErrorKind::BadPosition
    );
    assert_eq!(
        b.prefix_attach(0, &[1, 2]).unwrap_err().kind,
        ErrorKind::BadPosition
    );
    assert_eq!(
        b.prefix_attach(64, &[1]).unwrap_err().kind,
        ErrorKind::BadSeqId
    );
    assert_eq!(format!("{b:?}"), before);
}

#[derive(Clone, Debug)]
enum Op {
    Request(usize, Vec<u32>),
    Publish(usize, usize),
    Finish(usize),
    Fork(usize, usize),
    Truncate(usize, usize),
    Evict(usize),
    Reserve(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let tokens = prop::collection::vec(0u32..3, 1..9);
    prop_oneof![
        4 => (0usize..4, tokens).prop_map(|(s, t)| Op::Request(s, t)),
        3 => (0usize..4, 0usize..10).prop_map(|(s, n)| Op::Publish(s, n)),
        3 => (0usize..4).prop_map(Op::Finish),
        1 => (0usize..4, 0usize..4).prop_map(|(a, b)| Op::Fork(a, b)),
        1 => (0usize..4, 1usize..8).prop_map(|(s, n)| Op::Truncate(s, n)),
        1 => (0usize..8).prop_map(Op::Evict),
        1 => (0usize..24).prop_map(Op::Reserve),
    ]
}

/// Every live sequence's cells hold its own tokens at their positions; every occupied cell is
/// owned or indexed.
fn check(b: &SeqBookkeeping, content: &HashMap<usize, (u32, i32)>, live: &[Option<Vec<u32>>]) {
    let mut occupied = 0;
    for c in 0..b.pos.len() {
        if b.pos[c] < 0 {
            assert!(
                b.seqs[c] == 0 && !b.indexed[c],
                "free cell {c} is owned or indexed"
            );
            continue;
        }
        occupied += 1;
        assert!(
            b.seqs[c] != 0 || b.indexed[c],
            "cell {c} is occupied by nobody"
        );
        for (s, tokens) in live.iter().enumerate() {
            if b.seqs[c] & (1 << s) != 0 {
                let t = tokens.as_ref().expect("only live sequences own cells");
                let p = b.pos[c];
                assert_eq!(content[&c], (t[p as usize], p), "seq {s} cell {c}");
            }
        }
    }
    assert_eq!(occupied, b.live_cells());
    // No lock of a sequence reaches past the last cell it holds on the locked prefix (else
    // cells it let go of would stay unevictable while it lives) ...
    for (s, locks) in b.locks.iter().enumerate() {
        for lock in locks {
            assert_eq!(b.held_len(s, lock), lock.len(), "a lock of seq {s}");
        }
    }
    // ... and everything the index calls evictable is held by no live sequence: evicting it
    // all frees exactly that many cells.
    let mut probe = b.clone();
    let evictable = probe.prefix_stats().evictable;
    assert_eq!(probe.prefix_evict(evictable), Ok(evictable));
}

fn run(ops: Vec<Op>) {
    const CAP: usize = 24;
    let mut b = SeqBookkeeping::new(CAP);
    let mut content = HashMap::new();
    let mut live: Vec<Option<Vec<u32>>> = vec![None; 4];
    for op in ops {
        match op {
            Op::Request(s, t) if live[s].is_none() => {
                let m = b.prefix_attach(s as i32, &t[..t.len() - 1]).unwrap();
                assert!(m < t.len() && b.seq_len(s as i32).unwrap() == m);
                let need = t.len() - m;
                if b.prefix_reserve(need).is_err() {
                    assert!(b.free_cells() + b.prefix_stats().evictable < need);
                    b.seq_rm(s as i32, PosRange::ALL).unwrap();
                    continue;
                }
                for (i, c) in prefill(&mut b, s as i32, &t, m).into_iter().enumerate() {
                    content.insert(c as usize, (t[m + i], (m + i) as i32));
                }
                live[s] = Some(t);
            }
            Op::Publish(s, n) => {
                if let Some(t) = &live[s] {
                    let n = n.min(t.len());
                    let cached = b.prefix_publish(s as i32, &t[..n]).unwrap();
                    assert!(cached <= n);
                }
            }
            Op::Finish(s) => {
                b.seq_rm(s as i32, PosRange::ALL).unwrap();
                live[s] = None;
            }
            Op::Fork(a, d) if a != d && live[d].is_none() && live[a].is_some() => {
                b.seq_cp(a as i32, d as i32, PosRange::ALL).unwrap();
                live[d] = live[a].clone();
            }
            Op::Truncate(s, n) => {
                if let Some(t) = &mut live[s] {
                    b.seq_rm(s as i32, PosRange::new(Some(n as i32), None))
                        .unwrap();
                    t.truncate(n);
                }
            }
            Op::Evict(n) => {
                let evictable = b.prefix_stats().evictable;
                match b.prefix_evict(n) {
                    Ok(freed) => assert!(n <= evictable && freed >= n),
                    Err(e) => assert!(n > evictable && e.kind == ErrorKind::Capacity),
                }
            }
            Op::Reserve(n) => {
                let possible = b.free_cells() + b.prefix_stats().evictable;
                assert_eq!(b.prefix_reserve(n).is_ok(), n <= possible);
                assert_eq!(b.can_extend(n), n <= possible);
            }
            _ => {}
        }
        check(&b, &content, &live);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

    /// Requests, publishes, forks, evictions and reservations in random order.
    #[test]
    fn reuse_is_exact_and_eviction_spares_live_sequences(ops in prop::collection::vec(op(), 1..40)) {
        run(ops);
    }
}
