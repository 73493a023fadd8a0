//! Unit tests of every seq verb, and property tests against a brute-force model.

use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;
use crate::error::ErrorKind;
use crate::plan::PlanKind;

fn step(b: &mut SeqBookkeeping, seqs: &[i32], pos: &[i32]) -> StepPlan {
    b.begin_step(seqs).unwrap();
    b.plan(pos).unwrap().clone()
}

#[test]
fn single_sequence_prefill_and_decode_are_contiguous() {
    let mut b = SeqBookkeeping::new(32);
    let p = b.plan(&[0, 1, 2, 3]).unwrap().clone();
    assert_eq!(p.kind(), PlanKind::SingleContiguous);
    assert_eq!(
        (p.write_start, p.read_len, p.mask),
        (Some(0), 4, MaskKind::Causal)
    );
    for pos in 4..10 {
        let p = step(&mut b, &[0], &[pos]);
        assert_eq!(p.kind(), PlanKind::SingleContiguous);
        assert_eq!(
            (p.write_start, p.read_len, p.mask),
            (Some(pos as usize), pos as usize + 1, MaskKind::None)
        );
    }
    assert_eq!(b.seq_len(0).unwrap(), 10);
    assert_eq!(b.high_water(), 10);
}

#[test]
fn agent_fork_shares_the_trunk_and_isolates_branches() {
    let mut b = SeqBookkeeping::new(32);
    step(&mut b, &[0, 0, 0], &[0, 1, 2]);
    b.seq_cp(0, 1, PosRange::ALL).unwrap();
    b.seq_cp(0, 2, PosRange::ALL).unwrap();
    assert_eq!(b.live_cells(), 3);
    let p = step(&mut b, &[1, 2], &[3, 3]);
    assert_eq!(p.kind(), PlanKind::Explicit);
    assert_eq!((p.write_cells.as_slice(), p.read_len), (&[3u32, 4][..], 5));
    // Both branches see the trunk and themselves, not each other.
    for (i, own, other) in [(0, 3, 4), (1, 4, 3)] {
        assert!((0..3).all(|j| p.visible(i, j)));
        assert!(p.visible(i, own) && !p.visible(i, other));
    }
    b.seq_keep(2).unwrap();
    assert_eq!(
        (
            b.seq_len(0).unwrap(),
            b.seq_len(1).unwrap(),
            b.seq_len(2).unwrap()
        ),
        (0, 0, 4)
    );
    assert_eq!((b.live_cells(), b.high_water()), (4, 5));
    // Seq 2 now holds cells 0,1,2,4: a hole keeps it on the explicit path; the hole is reused.
    let p = step(&mut b, &[2], &[4]);
    assert_eq!(
        (p.kind(), p.write_cells.as_slice()),
        (PlanKind::Explicit, &[3u32][..])
    );
    assert!(
        p.visible(0, 4),
        "position 3 (cell 4) is visible to position 4"
    );
}

#[test]
fn seq_rm_half_open_ranges_and_high_water() {
    let mut b = SeqBookkeeping::new(16);
    step(&mut b, &[0; 6], &[0, 1, 2, 3, 4, 5]);
    b.seq_rm(0, PosRange::new(Some(1), Some(3))).unwrap();
    assert_eq!(b.seq_len(0).unwrap(), 4);
    assert_eq!(
        (b.cell_pos(1), b.cell_pos(2), b.cell_pos(3)),
        (None, None, Some(3))
    );
    b.seq_rm(0, PosRange::new(Some(4), None)).unwrap();
    assert_eq!((b.seq_len(0).unwrap(), b.high_water()), (2, 4));
    assert!(b.can_extend(14) && !b.can_extend(15));
    // Empty sequences: cp / rm are no-ops, len is 0, keep is refused.
    let before = b.clone();
    b.seq_cp(5, 6, PosRange::ALL).unwrap();
    b.seq_rm(5, PosRange::ALL).unwrap();
    assert_eq!(b.seq_len(6).unwrap(), 0);
    assert_eq!(b.seq_keep(5).unwrap_err().kind, ErrorKind::UnknownSeq);
    assert_eq!(
        (b.live_cells(), b.high_water()),
        (before.live_cells(), before.high_water())
    );
    b.seq_rm(0, PosRange::ALL).unwrap();
    assert_eq!((b.live_cells(), b.high_water()), (0, 0));
}

#[test]
fn sliding_window_eviction_then_decode() {
    let mut b = SeqBookkeeping::new(8);
    step(&mut b, &[0; 8], &[0, 1, 2, 3, 4, 5, 6, 7]);
    assert!(!b.can_extend(1));
    b.seq_rm(0, PosRange::new(None, Some(2))).unwrap();
    let p = step(&mut b, &[0], &[8]);
    assert_eq!(
        (p.kind(), p.write_cells.as_slice()),
        (PlanKind::Explicit, &[0u32][..])
    );
    assert!(!p.visible(0, 1) && p.visible(0, 0) && (2..8).all(|j| p.visible(0, j)));
}

#[test]
fn clear_resets_everything() {
    let mut b = SeqBookkeeping::new(8);
    step(&mut b, &[3, 3], &[0, 1]);
    b.clear();
    assert_eq!(
        (b.live_cells(), b.high_water(), b.seq_len(3).unwrap()),
        (0, 0, 0)
    );
    assert!(b.current_plan().is_none() && b.can_extend(8));
}

#[test]
fn errors_leave_state_unchanged() {
    let mut b = SeqBookkeeping::new(6);
    step(&mut b, &[0, 0, 1], &[0, 1, 0]);
    let snap = |b: &SeqBookkeeping| {
        (
            (0..6)
                .map(|c| (b.cell_pos(c), b.cell_seqs(c)))
                .collect::<Vec<_>>(),
            b.high_water(),
            b.live_cells(),
            b.current_plan().cloned(),
        )
    };
    let before = snap(&b);
    let r = PosRange::ALL;
    let errs = [
        b.begin_step(&[]).unwrap_err().kind,
        b.begin_step(&[0, 64]).unwrap_err().kind,
        b.begin_step(&[-1]).unwrap_err().kind,
        b.seq_cp(0, 64, r).unwrap_err().kind,
        b.seq_cp(0, 1, PosRange::new(Some(3), Some(2)))
            .unwrap_err()
            .kind,
        b.seq_rm(-2, r).unwrap_err().kind,
        b.seq_rm(0, PosRange::new(Some(-1), None)).unwrap_err().kind,
        b.seq_keep(70).unwrap_err().kind,
        b.seq_len(64).unwrap_err().kind,
        b.plan(&[]).unwrap_err().kind,
        b.plan(&[-1]).unwrap_err().kind,
        b.plan(&[2, 3, 4, 5]).unwrap_err().kind,
    ];
    use ErrorKind::*;
    assert_eq!(
        errs,
        [
            BadShape,
            BadSeqId,
            BadSeqId,
            BadSeqId,
            BadPosition,
            BadSeqId,
            BadPosition,
            BadSeqId,
            BadSeqId,
            BadShape,
            BadPosition,
            Capacity
        ]
    );
    assert_eq!(snap(&b), before);
    b.begin_step(&[0, 0]).unwrap();
    assert_eq!(b.plan(&[2]).unwrap_err().kind, BadShape);
    assert_eq!(snap(&b).0, before.0);
    // The declared step survives the refused plan.
    assert_eq!(b.plan(&[2, 3]).unwrap().write_cells, vec![3, 4]);
}

// ---- property tests against a brute-force model ----

/// The obviously-right model: a vector of cells, each `None` or (position, owners).
#[derive(Clone, Debug, PartialEq)]
struct Model {
    cells: Vec<Option<(i32, BTreeSet<i32>)>>,
    pending: Option<Vec<i32>>,
}

impl Model {
    fn new(cap: usize) -> Self {
        Model {
            cells: vec![None; cap],
            pending: None,
        }
    }
    fn free(&self) -> usize {
        self.cells.iter().filter(|c| c.is_none()).count()
    }
    fn window(&self) -> usize {
        self.cells
            .iter()
            .rposition(Option::is_some)
            .map_or(0, |c| c + 1)
    }
    fn seq_len(&self, s: i32) -> usize {
        self.cells
            .iter()
            .flatten()
            .filter(|(_, o)| o.contains(&s))
            .count()
    }
    fn max_pos(&self, s: i32) -> Option<i32> {
        self.cells
            .iter()
            .flatten()
            .filter(|(_, o)| o.contains(&s))
            .map(|(p, _)| *p)
            .max()
    }
    fn id_ok(s: i32) -> bool {
        (0..64).contains(&s)
    }
    fn range(p0: Option<i32>, p1: Option<i32>) -> Result<(i32, i32), ErrorKind> {
        let (a, b) = (p0.unwrap_or(0), p1.unwrap_or(i32::MAX));
        if a < 0 || b < 0 || a > b {
            Err(ErrorKind::BadPosition)
        } else {
            Ok((a, b))
        }
    }
    fn begin(&mut self, seqs: &[i32]) -> Result<(), ErrorKind> {
        if seqs.is_empty() {
            return Err(ErrorKind::BadShape);
        }
        if !seqs.iter().all(|&s| Self::id_ok(s)) {
            return Err(ErrorKind::BadSeqId);
        }
        self.pending = Some(seqs.to_vec());
        Ok(())
    }
    /// Places tokens; returns each token's (cell, seq).
    fn step(&mut self, pos: &[i32]) -> Result<Vec<(usize, i32)>, ErrorKind> {
        if pos.is_empty() {
            return Err(ErrorKind::BadShape);
        }
        if self.pending.as_ref().is_some_and(|p| p.len() != pos.len()) {
            return Err(ErrorKind::BadShape);
        }
        if pos.iter().any(|&p| p < 0) {
            return Err(ErrorKind::BadPosition);
        }
        if self.free() < pos.len() {
            return Err(ErrorKind::Capacity);
        }
        let seqs = self.pending.take().unwrap_or_else(|| vec![0; pos.len()]);
        Ok(pos
            .iter()
            .zip(seqs)
            .map(|(&p, s)| {
                let c = self.cells.iter().position(Option::is_none).unwrap();
                self.cells[c] = Some((p, BTreeSet::from([s])));
                (c, s)
            })
            .collect())
    }
    fn visible(&self, seq: i32, pos: i32, j: usize) -> bool {
        matches!(&self.cells[j], Some((p, o)) if o.contains(&seq) && *p <= pos)
    }
    fn cp(
        &mut self,
        src: i32,
        dst: i32,
        p0: Option<i32>,
        p1: Option<i32>,
    ) -> Result<(), ErrorKind> {
        if !Self::id_ok(src) || !Self::id_ok(dst) {
            return Err(ErrorKind::BadSeqId);
        }
        let (a, b) = Self::range(p0, p1)?;
        for (p, o) in self.cells.iter_mut().flatten() {
            if o.contains(&src) && a <= *p && *p < b {
                o.insert(dst);
            }
        }
        Ok(())
    }
    fn rm(&mut self, seq: i32, p0: Option<i32>, p1: Option<i32>) -> Result<(), ErrorKind> {
        if !Self::id_ok(seq) {
            return Err(ErrorKind::BadSeqId);
        }
        let (a, b) = Self::range(p0, p1)?;
        for c in self.cells.iter_mut() {
            if let Some((p, o)) = c {
                if a <= *p && *p < b {
                    o.remove(&seq);
                }
                if o.is_empty() {
                    *c = None;
                }
            }
        }
        Ok(())
    }
    fn keep(&mut self, seq: i32) -> Result<(), ErrorKind> {
        if !Self::id_ok(seq) {
            return Err(ErrorKind::BadSeqId);
        }
        if self.seq_len(seq) == 0 {
            return Err(ErrorKind::UnknownSeq);
        }
        for c in self.cells.iter_mut() {
            match c {
                Some((_, o)) if o.contains(&seq) => *o = BTreeSet::from([seq]),
                _ => *c = None,
            }
        }
        Ok(())
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// `n` tokens of `seq`; `cont` continues after the sequence's last position, else the
    /// positions are `raw`. `declare` calls begin_step (with `n + skew` tokens).
    Step {
        seq: i32,
        n: usize,
        cont: bool,
        raw: Vec<i32>,
        declare: bool,
        skew: usize,
        mixed: Vec<i32>,
    },
    Cp {
        src: i32,
        dst: i32,
        p0: Option<i32>,
        p1: Option<i32>,
    },
    Rm {
        seq: i32,
        p0: Option<i32>,
        p1: Option<i32>,
    },
    Keep {
        seq: i32,
    },
    Clear,
}

const CAP: usize = 24;

fn seq_id() -> impl Strategy<Value = i32> {
    prop_oneof![8 => 0..4i32, 1 => Just(64), 1 => Just(-1)]
}

fn pos_bound() -> impl Strategy<Value = Option<i32>> {
    prop_oneof![2 => Just(None), 5 => (0..CAP as i32).prop_map(Some), 1 => Just(Some(-3))]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (seq_id(), 1..5usize, any::<bool>(), prop::collection::vec(-1..2 * CAP as i32, 4),
              prop_oneof![9 => Just(true), 1 => Just(false)], prop_oneof![9 => Just(0usize), 1 => Just(1usize)],
              prop::collection::vec(prop_oneof![3 => Just(-1i32), 1 => 0..4i32], 4))
            .prop_map(|(seq, n, cont, raw, declare, skew, mixed)| Op::Step { seq, n, cont, raw, declare, skew, mixed }),
        2 => (seq_id(), seq_id(), pos_bound(), pos_bound()).prop_map(|(src, dst, p0, p1)| Op::Cp { src, dst, p0, p1 }),
        2 => (seq_id(), pos_bound(), pos_bound()).prop_map(|(seq, p0, p1)| Op::Rm { seq, p0, p1 }),
        1 => seq_id().prop_map(|seq| Op::Keep { seq }),
        1 => Just(Op::Clear),
    ]
}

fn assert_same_state(b: &SeqBookkeeping, m: &Model) -> Result<(), TestCaseError> {
    for c in 0..CAP {
        let expect = m.cells[c]
            .as_ref()
            .map(|(p, o)| (*p, o.iter().fold(0u64, |acc, &s| acc | 1 << s)));
        let got = b.cell_pos(c).map(|p| (p, b.cell_seqs(c)));
        prop_assert_eq!(got, expect, "cell {}", c);
    }
    prop_assert_eq!(b.high_water(), m.window());
    for s in 0..5 {
        prop_assert_eq!(b.seq_len(s).unwrap(), m.seq_len(s));
    }
    for n in 0..=CAP + 1 {
        prop_assert_eq!(b.can_extend(n), m.free() >= n);
    }
    Ok(())
}

fn same_kind<T, U>(
    got: Result<T, CacheError>,
    want: Result<U, ErrorKind>,
) -> Result<Option<U>, TestCaseError> {
    match (got, want) {
        (Ok(_), Ok(u)) => Ok(Some(u)),
        (Err(e), Err(k)) => {
            prop_assert_eq!(e.kind, k, "{}", e);
            Ok(None)
        }
        (Ok(_), Err(k)) => Err(TestCaseError::fail(format!("accepted, model says {k}"))),
        (Err(e), Ok(_)) => Err(TestCaseError::fail(format!("refused ({e}), model accepts"))),
    }
}

fn run_ops(ops: &[Op]) -> Result<(), TestCaseError> {
    let mut b = SeqBookkeeping::new(CAP);
    let mut m = Model::new(CAP);
    for op in ops {
        match op {
            Op::Step {
                seq,
                n,
                cont,
                raw,
                declare,
                skew,
                mixed,
            } => {
                let seqs: Vec<i32> = (0..*n)
                    .map(|i| if mixed[i] >= 0 { mixed[i] } else { *seq })
                    .collect();
                let pos: Vec<i32> = if *cont {
                    let start = m.max_pos(*seq).map_or(0, |p| p + 1);
                    (0..*n as i32).map(|i| start + i).collect()
                } else {
                    raw[..*n].to_vec()
                };
                if *declare {
                    let decl: Vec<i32> = seqs
                        .iter()
                        .copied()
                        .chain(std::iter::repeat_n(*seq, *skew))
                        .collect();
                    let r = b.begin_step(&decl);
                    if same_kind(r, m.begin(&decl))?.is_none() {
                        assert_same_state(&b, &m)?;
                        continue;
                    }
                } else if m.pending.is_none() && seqs.iter().any(|&s| s != 0) {
                    continue;
                }
                let model_seqs = m.pending.clone().unwrap_or_else(|| vec![0; pos.len()]);
                let r = b.plan(&pos).cloned();
                if let Some(placed) = same_kind(r.clone(), m.step(&pos))? {
                    let plan = r.unwrap();
                    prop_assert_eq!(plan.read_len, m.window());
                    for (i, &(cell, s)) in placed.iter().enumerate() {
                        prop_assert_eq!(plan.cell_of(i), cell);
                        prop_assert_eq!(s, model_seqs[i]);
                        for j in 0..m.window() {
                            prop_assert_eq!(
                                plan.visible(i, j),
                                m.visible(s, pos[i], j),
                                "query {} cell {} plan {:?}",
                                i,
                                j,
                                plan.kind()
                            );
                        }
                    }
                }
            }
            Op::Cp { src, dst, p0, p1 } => {
                same_kind(
                    b.seq_cp(*src, *dst, PosRange::new(*p0, *p1)),
                    m.cp(*src, *dst, *p0, *p1),
                )?;
            }
            Op::Rm { seq, p0, p1 } => {
                same_kind(
                    b.seq_rm(*seq, PosRange::new(*p0, *p1)),
                    m.rm(*seq, *p0, *p1),
                )?;
            }
            Op::Keep { seq } => {
                same_kind(b.seq_keep(*seq), m.keep(*seq))?;
            }
            Op::Clear => {
                b.clear();
                m = Model::new(CAP);
            }
        }
        assert_same_state(&b, &m)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

    /// Every plan's mask, window and cells, and every verb's result and error, agree with
    /// the brute-force model.
    #[test]
    fn verbs_and_plans_match_the_model(ops in prop::collection::vec(op(), 1..24)) {
        run_ops(&ops)?;
    }

    /// One sequence decoded in chunks, with tail backtracking, always takes the fast path.
    #[test]
    fn single_sequence_is_always_contiguous(chunks in prop::collection::vec((1..6usize, 0..3usize), 1..12)) {
        let mut b = SeqBookkeeping::new(64);
        let mut len = 0i32;
        for (n, back) in chunks {
            let keep = (len - back as i32).max(0);
            b.seq_rm(0, PosRange::new(Some(keep), None)).unwrap();
            len = keep;
            if !b.can_extend(n) { break; }
            let pos: Vec<i32> = (len..len + n as i32).collect();
            b.begin_step(&vec![0; n]).unwrap();
            let p = b.plan(&pos).unwrap();
            prop_assert_eq!(p.kind(), PlanKind::SingleContiguous);
            prop_assert_eq!((p.write_start, p.read_len), (Some(len as usize), (len as usize) + n));
            len += n as i32;
        }
    }
}
