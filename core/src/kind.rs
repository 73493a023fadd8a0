//! The three cache kinds behind one bookkeeping front, and the verb surface every cache
//! (reference or backend) exposes.

use std::fmt;
use std::str::FromStr;

use crate::contiguous::ContiguousBookkeeping;
use crate::error::{CacheError, CacheResult};
use crate::plan::StepPlan;
use crate::seq::{PosRange, PrefixStats, SeqBookkeeping, MAX_SEQS};
use crate::tree::{CommitPlan, TreeBookkeeping};

/// Which bookkeeping a cache runs; also the builder tag (`backend_id:kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CacheKind {
    /// One sequence, a length counter (`make_decode_session`).
    Contiguous,
    /// Multi-sequence cell pool (`make_seq_session`).
    Seq,
    /// Committed prefix + speculative frontiers (`make_tree_session`).
    Tree,
}

impl CacheKind {
    /// All kinds.
    pub const ALL: [CacheKind; 3] = [CacheKind::Contiguous, CacheKind::Seq, CacheKind::Tree];

    /// The builder tag.
    pub fn as_str(self) -> &'static str {
        match self {
            CacheKind::Contiguous => "contiguous",
            CacheKind::Seq => "seq",
            CacheKind::Tree => "tree",
        }
    }
}

impl fmt::Display for CacheKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CacheKind {
    type Err = CacheError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CacheKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| {
                CacheError::bad_config(format!(
                    "unknown cache kind '{s}' (expected contiguous, seq or tree)"
                ))
            })
    }
}

impl serde::Serialize for CacheKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for CacheKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The bookkeeping of one cache, whichever kind, with steps as transactions.
///
/// A step is opened with [`Bookkeeping::open_step`] (placing its tokens and planning it),
/// then either committed ([`Bookkeeping::commit_step`]) once every layer has written through
/// it, or rolled back ([`Bookkeeping::rollback_step`]), which leaves the bookkeeping exactly
/// as before the step (see [`ContiguousBookkeeping::rollback_step`] for the one exception,
/// a contiguous step that rewrote history). A step left open is abandoned: opening another
/// or calling any verb rolls it back first. Verbs a kind does not have return
/// `not_supported`.
#[derive(Clone, Debug)]
pub struct Bookkeeping {
    book: Book,
    step_open: bool,
}

#[derive(Clone, Debug)]
enum Book {
    Contiguous(ContiguousBookkeeping),
    Seq(SeqBookkeeping),
    Tree(TreeBookkeeping),
}

fn unsupported(verb: &str, kind: CacheKind) -> CacheError {
    CacheError::not_supported(format!("{verb} is not a verb of the {kind} cache"))
}

impl Bookkeeping {
    /// Empty bookkeeping of `kind` with `capacity` cells.
    pub fn new(kind: CacheKind, capacity: usize) -> Self {
        let book = match kind {
            CacheKind::Contiguous => Book::Contiguous(ContiguousBookkeeping::new(capacity)),
            CacheKind::Seq => Book::Seq(SeqBookkeeping::new(capacity)),
            CacheKind::Tree => Book::Tree(TreeBookkeeping::new(capacity)),
        };
        Bookkeeping {
            book,
            step_open: false,
        }
    }

    /// The kind.
    pub fn kind(&self) -> CacheKind {
        match self.book {
            Book::Contiguous(_) => CacheKind::Contiguous,
            Book::Seq(_) => CacheKind::Seq,
            Book::Tree(_) => CacheKind::Tree,
        }
    }

    /// Whether `n` more tokens fit.
    pub fn can_extend(&self, n: usize) -> bool {
        match &self.book {
            Book::Contiguous(b) => b.can_extend(n),
            Book::Seq(b) => b.can_extend(n),
            Book::Tree(b) => b.can_extend(n),
        }
    }

    /// The logical ceiling in cells.
    pub fn capacity(&self) -> usize {
        match &self.book {
            Book::Contiguous(b) => b.capacity(),
            Book::Seq(b) => b.capacity(),
            Book::Tree(b) => b.capacity(),
        }
    }

    /// One past the highest cell holding data.
    pub fn high_water(&self) -> usize {
        match &self.book {
            Book::Contiguous(b) => b.len(),
            Book::Seq(b) => b.high_water(),
            Book::Tree(b) => b.high_water(),
        }
    }

    /// Cells holding data.
    pub fn live_cells(&self) -> usize {
        match &self.book {
            Book::Seq(b) => b.live_cells(),
            _ => self.high_water(),
        }
    }

    /// The highest position each holder holds (`-1`: none): per sequence for the seq cache;
    /// holder 0 (the committed tokens) for the contiguous and tree caches.
    pub fn last_positions(&self, out: &mut [i32; MAX_SEQS]) {
        out.fill(-1);
        match &self.book {
            Book::Contiguous(b) => out[0] = b.len() as i32 - 1,
            Book::Tree(b) => out[0] = b.base() as i32 - 1,
            Book::Seq(b) => {
                for c in 0..b.high_water() {
                    let Some(p) = b.cell_pos(c) else { continue };
                    let mut bits = b.cell_seqs(c);
                    while bits != 0 {
                        let s = bits.trailing_zeros() as usize;
                        out[s] = out[s].max(p);
                        bits &= bits - 1;
                    }
                }
            }
        }
    }

    /// The position `cell` holds, for cells that hold committed tokens (`None`: a free cell
    /// or a speculative tree node).
    pub fn cell_position(&self, cell: usize) -> Option<i32> {
        match &self.book {
            Book::Contiguous(b) => (cell < b.len()).then_some(cell as i32),
            Book::Tree(b) => (cell < b.base()).then_some(cell as i32),
            Book::Seq(b) => b.cell_pos(cell),
        }
    }

    /// Whether `cell` still holds position `pos` and a future query of one of its holders
    /// may attend it through a window reaching `reach` positions back: `pos > last - reach`
    /// for some holder whose highest position is `last` (from [`Bookkeeping::last_positions`]).
    /// Speculative tree nodes always are.
    pub fn in_reach(&self, cell: usize, pos: i32, reach: usize, last: &[i32; MAX_SEQS]) -> bool {
        let near = |l: i32| pos as i64 > l as i64 - reach as i64;
        match &self.book {
            Book::Tree(b) if cell >= b.base() => cell < b.high_water(),
            Book::Contiguous(_) | Book::Tree(_) => {
                self.cell_position(cell) == Some(pos) && near(last[0])
            }
            Book::Seq(b) => {
                if b.cell_pos(cell) != Some(pos) {
                    return false;
                }
                let mut bits = b.cell_seqs(cell);
                while bits != 0 {
                    if near(last[bits.trailing_zeros() as usize]) {
                        return true;
                    }
                    bits &= bits - 1;
                }
                false
            }
        }
    }

    /// Whether `cell` is in the seq cache's prefix index (never for the other kinds).
    pub fn is_indexed(&self, cell: usize) -> bool {
        match &self.book {
            Book::Seq(b) => b.cell_indexed(cell),
            _ => false,
        }
    }

    /// The holders of `cell` (sequence bits; bit 0 for the contiguous and tree caches).
    pub fn cell_holders(&self, cell: usize) -> u64 {
        match &self.book {
            Book::Seq(b) => b.cell_seqs(cell),
            _ => 1,
        }
    }

    /// Reserves per-cell bookkeeping for `cells` cells (byte layers call this as pools grow).
    pub fn reserve(&mut self, cells: usize) {
        if let Book::Seq(b) = &mut self.book {
            b.reserve(cells);
        }
    }

    /// Opens a step writing `positions`: places the tokens and plans the read. Validates
    /// before it mutates; an open step is rolled back first.
    pub fn open_step(&mut self, positions: &[i32]) -> CacheResult<&StepPlan> {
        self.abandon_step();
        let plan = match &mut self.book {
            Book::Contiguous(b) => b.plan(positions)?,
            Book::Seq(b) => b.plan(positions)?,
            Book::Tree(b) => b.plan(positions)?,
        };
        self.step_open = true;
        Ok(plan)
    }

    /// The plan of the open step, if one is open.
    pub fn step_plan(&self) -> Option<&StepPlan> {
        if !self.step_open {
            return None;
        }
        match &self.book {
            Book::Contiguous(b) => b.current_plan(),
            Book::Seq(b) => b.current_plan(),
            Book::Tree(b) => b.current_plan(),
        }
    }

    /// Whether a step is open.
    pub fn step_is_open(&self) -> bool {
        self.step_open
    }

    /// Makes the open step permanent (every layer has written its rows).
    pub fn commit_step(&mut self) {
        self.step_open = false;
    }

    /// Undoes the open step; a no-op when none is open.
    pub fn rollback_step(&mut self) {
        if !self.step_open {
            return;
        }
        match &mut self.book {
            Book::Contiguous(b) => b.rollback_step(),
            Book::Seq(b) => b.rollback_step(),
            Book::Tree(b) => b.rollback_step(),
        }
        self.step_open = false;
    }

    /// Undoes the open step before any layer wrote a row: exactly, unlike
    /// [`Bookkeeping::rollback_step`] for a rewriting contiguous step. A no-op when none is.
    pub fn cancel_step(&mut self) {
        if !self.step_open {
            return;
        }
        match &mut self.book {
            Book::Contiguous(b) => b.cancel_step(),
            Book::Seq(b) => b.rollback_step(),
            Book::Tree(b) => b.cancel_step(),
        }
        self.step_open = false;
    }

    fn abandon_step(&mut self) {
        if self.step_open {
            tracing::debug!("an open step was abandoned: rolled back");
            self.rollback_step();
        }
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.abandon_step();
        match &mut self.book {
            Book::Contiguous(b) => b.clear(),
            Book::Seq(b) => b.clear(),
            Book::Tree(b) => b.clear(),
        }
    }

    /// Contiguous only: truncate to `len` tokens.
    pub fn rewind(&mut self, len: usize) -> CacheResult<()> {
        self.abandon_step();
        match &mut self.book {
            Book::Contiguous(b) => b.rewind(len),
            _ => Err(unsupported("rewind", self.kind())),
        }
    }

    /// Seq only: the next step's per-token sequences.
    pub fn begin_step(&mut self, seq_ids: &[i32]) -> CacheResult<()> {
        self.abandon_step();
        match &mut self.book {
            Book::Seq(b) => b.begin_step(seq_ids),
            _ => Err(unsupported("begin_step", self.kind())),
        }
    }

    /// Seq only: share `src`'s cells in `range` with `dst`.
    pub fn seq_cp(&mut self, src: i32, dst: i32, range: PosRange) -> CacheResult<()> {
        self.abandon_step();
        match &mut self.book {
            Book::Seq(b) => b.seq_cp(src, dst, range),
            _ => Err(unsupported("seq_cp", self.kind())),
        }
    }

    /// Seq only: drop `seq` from its cells in `range`.
    pub fn seq_rm(&mut self, seq: i32, range: PosRange) -> CacheResult<()> {
        self.abandon_step();
        match &mut self.book {
            Book::Seq(b) => b.seq_rm(seq, range),
            _ => Err(unsupported("seq_rm", self.kind())),
        }
    }

    /// Seq only: keep `seq` alone.
    pub fn seq_keep(&mut self, seq: i32) -> CacheResult<()> {
        self.abandon_step();
        match &mut self.book {
            Book::Seq(b) => b.seq_keep(seq),
            _ => Err(unsupported("seq_keep", self.kind())),
        }
    }

    /// Seq only: cells held by `seq`.
    pub fn seq_len(&self, seq: i32) -> CacheResult<usize> {
        match &self.book {
            Book::Seq(b) => b.seq_len(seq),
            _ => Err(unsupported("seq_len", self.kind())),
        }
    }

    /// `(position, cell)` of the history `seq` holds, by position: the seq cache's cells of
    /// `seq`; for contiguous and tree caches (sequence 0 only) the committed prefix.
    pub fn history(&self, seq: i32) -> CacheResult<Vec<(i32, u32)>> {
        let prefix = |len: usize| -> CacheResult<Vec<(i32, u32)>> {
            if seq != 0 {
                return Err(CacheError::bad_seq_id(format!(
                    "the {} cache holds one sequence, 0; got {seq}",
                    self.kind()
                )));
            }
            Ok((0..len).map(|i| (i as i32, i as u32)).collect())
        };
        match &self.book {
            Book::Contiguous(b) => prefix(b.len()),
            Book::Tree(b) => prefix(b.base()),
            Book::Seq(b) => b.seq_history(seq),
        }
    }

    /// Seq only: see [`SeqBookkeeping::prefix_match`].
    pub fn prefix_match(&self, tokens: &[u32]) -> CacheResult<usize> {
        match &self.book {
            Book::Seq(b) => Ok(b.prefix_match(tokens)),
            _ => Err(unsupported("prefix_match", self.kind())),
        }
    }

    /// Seq only: the cells the prefix index holds the longest cached beginning of `tokens`
    /// in, by position (locking nothing).
    pub fn prefix_cells(&self, tokens: &[u32]) -> CacheResult<Vec<u32>> {
        match &self.book {
            Book::Seq(b) => Ok(b.prefix_cells(tokens)),
            _ => Err(unsupported("prefix_cells", self.kind())),
        }
    }

    /// Seq only: see [`SeqBookkeeping::prefix_attach`].
    pub fn prefix_attach(&mut self, seq: i32, tokens: &[u32]) -> CacheResult<usize> {
        self.abandon_step();
        match &mut self.book {
            Book::Seq(b) => b.prefix_attach(seq, tokens),
            _ => Err(unsupported("prefix_attach", self.kind())),
        }
    }

    /// Seq only: see [`SeqBookkeeping::prefix_publish`].
    pub fn prefix_publish(&mut self, seq: i32, tokens: &[u32]) -> CacheResult<usize> {
        self.abandon_step();
        match &mut self.book {
            Book::Seq(b) => b.prefix_publish(seq, tokens),
            _ => Err(unsupported("prefix_publish", self.kind())),
        }
    }

    /// Seq only: see [`SeqBookkeeping::prefix_evict`].
    pub fn prefix_evict(&mut self, n: usize) -> CacheResult<usize> {
        self.abandon_step();
        match &mut self.book {
            Book::Seq(b) => b.prefix_evict(n),
            _ => Err(unsupported("prefix_evict", self.kind())),
        }
    }

    /// Seq only: see [`SeqBookkeeping::prefix_reserve`].
    pub fn prefix_reserve(&mut self, n: usize) -> CacheResult<usize> {
        self.abandon_step();
        match &mut self.book {
            Book::Seq(b) => b.prefix_reserve(n),
            _ => Err(unsupported("prefix_reserve", self.kind())),
        }
    }

    /// Sizes of the prefix index (zero for kinds without one).
    pub fn prefix_stats(&self) -> PrefixStats {
        match &self.book {
            Book::Seq(b) => b.prefix_stats(),
            _ => PrefixStats::default(),
        }
    }

    /// Tree only: append a frontier.
    pub fn propose(&mut self, parents: &[i32]) -> CacheResult<()> {
        self.abandon_step();
        match &mut self.book {
            Book::Tree(b) => b.propose(parents),
            _ => Err(unsupported("propose", self.kind())),
        }
    }

    /// Tree only: accept a root-first chain; the caller moves the rows, then recycles.
    pub fn commit(&mut self, accepted: &[i32]) -> CacheResult<CommitPlan> {
        self.abandon_step();
        match &mut self.book {
            Book::Tree(b) => b.commit(accepted),
            _ => Err(unsupported("commit", self.kind())),
        }
    }

    /// Returns a commit plan's buffer.
    pub fn recycle(&mut self, plan: CommitPlan) {
        if let Book::Tree(b) = &mut self.book {
            b.recycle(plan);
        }
    }
}

/// The neutral runner verbs of a cache with bytes behind its bookkeeping.
///
/// Implementors provide access to their [`Bookkeeping`] and the one byte operation a verb
/// needs (moving committed tree rows); every verb validates in the bookkeeping first, so a
/// refused verb leaves bytes and bookkeeping untouched. A cache with sliding-window layers
/// also answers [`CacheVerbs::after_verb`], which may refuse what the bookkeeping allowed
/// (a rollback deeper than its windows still hold); the verb is then undone.
pub trait CacheVerbs {
    /// The bookkeeping.
    fn bookkeeping(&self) -> &Bookkeeping;
    /// The bookkeeping, mutably.
    fn bookkeeping_mut(&mut self) -> &mut Bookkeeping;
    /// Moves row `rows[i]` to `base + i` in every layer's K and V (tree commit).
    fn move_rows(&mut self, base: usize, rows: &[u32]);
    /// Whether [`CacheVerbs::after_verb`] must see verbs (it costs a copy of the bookkeeping
    /// per verb).
    fn checks_verbs(&self) -> bool {
        false
    }
    /// Called after a verb changed the bookkeeping (`before`: a copy from before it, when
    /// the verb could shorten a sequence); an error undoes the verb.
    fn after_verb(&mut self, before: Option<&Bookkeeping>) -> CacheResult<()> {
        let _ = before;
        Ok(())
    }

    /// Called after `seq`'s `tokens` (positions `0..tokens.len()`) were published to the
    /// prefix index (whose cells for a beginning it held already stay another sequence's:
    /// [`Bookkeeping::prefix_cells`] names them).
    fn after_publish(&mut self, seq: i32, tokens: &[u32]) {
        let _ = (seq, tokens);
    }

    /// Runs `verb` on the bookkeeping, then [`CacheVerbs::after_verb`]; all or nothing.
    fn checked<T>(
        &mut self,
        verb: impl FnOnce(&mut Bookkeeping) -> CacheResult<T>,
    ) -> CacheResult<T> {
        if !self.checks_verbs() {
            return verb(self.bookkeeping_mut());
        }
        let before = self.bookkeeping().clone();
        let out = verb(self.bookkeeping_mut())?;
        if let Err(e) = self.after_verb(Some(&before)) {
            *self.bookkeeping_mut() = before;
            return Err(e);
        }
        Ok(out)
    }

    /// The kind.
    fn kind(&self) -> CacheKind {
        self.bookkeeping().kind()
    }
    /// Whether `n` more tokens fit.
    fn can_extend(&self, n: usize) -> bool {
        self.bookkeeping().can_extend(n)
    }
    /// The logical ceiling in cells.
    fn capacity(&self) -> usize {
        self.bookkeeping().capacity()
    }
    /// Forgets everything (no byte work).
    fn clear(&mut self) {
        let _ = self.checked(|b| {
            b.clear();
            Ok(())
        });
    }
    /// Contiguous: truncate to `len`.
    fn rewind(&mut self, len: usize) -> CacheResult<()> {
        self.checked(|b| b.rewind(len))
    }
    /// Seq: next step's per-token sequences.
    fn begin_step(&mut self, seq_ids: &[i32]) -> CacheResult<()> {
        self.bookkeeping_mut().begin_step(seq_ids)
    }
    /// Seq: share cells.
    fn seq_cp(&mut self, src: i32, dst: i32, range: PosRange) -> CacheResult<()> {
        self.checked(|b| b.seq_cp(src, dst, range))
    }
    /// Seq: drop cells.
    fn seq_rm(&mut self, seq: i32, range: PosRange) -> CacheResult<()> {
        self.checked(|b| b.seq_rm(seq, range))
    }
    /// Seq: keep one sequence.
    fn seq_keep(&mut self, seq: i32) -> CacheResult<()> {
        self.checked(|b| b.seq_keep(seq))
    }
    /// Seq: cells held by `seq`.
    fn seq_len(&self, seq: i32) -> CacheResult<usize> {
        self.bookkeeping().seq_len(seq)
    }
    /// Seq: cached leading tokens.
    fn prefix_match(&self, tokens: &[u32]) -> CacheResult<usize> {
        self.bookkeeping().prefix_match(tokens)
    }
    /// Seq: attach a cached prefix to an empty sequence.
    fn prefix_attach(&mut self, seq: i32, tokens: &[u32]) -> CacheResult<usize> {
        self.checked(|b| b.prefix_attach(seq, tokens))
    }
    /// Seq: cache a sequence's tokens.
    fn prefix_publish(&mut self, seq: i32, tokens: &[u32]) -> CacheResult<usize> {
        let cached = self.bookkeeping_mut().prefix_publish(seq, tokens)?;
        self.after_publish(seq, tokens);
        Ok(cached)
    }
    /// Seq: free `n` cells, evicting cached prefixes as needed.
    fn prefix_reserve(&mut self, n: usize) -> CacheResult<usize> {
        self.checked(|b| b.prefix_reserve(n))
    }
    /// Seq: evict at least `n` cells of cached prefixes.
    fn prefix_evict(&mut self, n: usize) -> CacheResult<usize> {
        self.checked(|b| b.prefix_evict(n))
    }
    /// Tree: append a frontier.
    fn propose(&mut self, parents: &[i32]) -> CacheResult<()> {
        self.bookkeeping_mut().propose(parents)
    }
    /// Tree: accept a chain and compact its rows into the prefix.
    fn commit(&mut self, accepted: &[i32]) -> CacheResult<()> {
        let plan = self.bookkeeping_mut().commit(accepted)?;
        self.move_rows(plan.base, &plan.rows);
        self.bookkeeping_mut().recycle(plan);
        // A commit only appends: the check cannot fail, it drops what left the window.
        self.after_verb(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const CAP: usize = 12;

    #[derive(Clone, Copy, Debug)]
    enum Op {
        /// A step of `n` tokens for `seq` (seq cache: declared with begin_step), continuing
        /// at `start`; `fail` rolls it back instead of committing it.
        Step {
            seq: i32,
            start: i32,
            n: usize,
            fail: bool,
        },
        /// Seq: fork `src` into `dst`; tree: propose one node under `src - 1`.
        Fork { src: i32, dst: i32 },
        /// Seq: drop `seq` from positions `>= p0`; contiguous: rewind; tree: commit `[0]`.
        Trim { seq: i32, p0: i32 },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            5 => (0..3i32, 0..8i32, 1..4usize, any::<bool>())
                .prop_map(|(seq, start, n, fail)| Op::Step { seq, start, n, fail }),
            2 => (0..3i32, 0..3i32).prop_map(|(src, dst)| Op::Fork { src, dst }),
            2 => (0..3i32, 0..8i32).prop_map(|(seq, p0)| Op::Trim { seq, p0 }),
        ]
    }

    /// What a runner can observe: answers to every query, and the plan a probe step gets.
    #[test]
    fn can_extend_never_wraps() {
        for kind in [CacheKind::Contiguous, CacheKind::Seq, CacheKind::Tree] {
            let mut b = Bookkeeping::new(kind, CAP);
            if kind == CacheKind::Seq {
                b.begin_step(&[0, 0, 0]).unwrap();
            }
            b.open_step(&[0, 1, 2]).unwrap();
            b.commit_step();
            for n in [CAP - 2, usize::MAX - 2, usize::MAX] {
                assert!(!b.can_extend(n), "{kind:?} {n}");
            }
            assert!(b.can_extend(CAP - 3), "{kind:?}");
        }
    }

    fn observe(b: &Bookkeeping, seq: i32, pos: &[i32]) -> impl PartialEq + std::fmt::Debug {
        let mut probe = b.clone();
        let plan = match probe.kind() {
            CacheKind::Seq => probe
                .begin_step(&vec![seq; pos.len()])
                .and_then(|()| probe.open_step(pos).cloned()),
            _ => probe.open_step(pos).cloned(),
        };
        (
            b.high_water(),
            b.live_cells(),
            (0..=CAP + 1)
                .chain([usize::MAX - 1, usize::MAX])
                .map(|n| b.can_extend(n))
                .collect::<Vec<_>>(),
            (0..4).map(|s| b.seq_len(s).ok()).collect::<Vec<_>>(),
            plan.map_err(|e| e.kind),
        )
    }

    fn apply(b: &mut Bookkeeping, op: &Op) {
        match (*op, b.kind()) {
            (Op::Fork { src, dst }, CacheKind::Seq) => {
                let _ = b.seq_cp(src, dst, PosRange::ALL);
            }
            (Op::Fork { src, .. }, CacheKind::Tree) => {
                let _ = b.propose(&[src - 1]);
            }
            (Op::Trim { seq, p0 }, CacheKind::Seq) => {
                let _ = b.seq_rm(seq, PosRange::new(Some(p0), None));
            }
            (Op::Trim { p0, .. }, CacheKind::Contiguous) => {
                let _ = b.rewind(p0 as usize);
            }
            (Op::Trim { .. }, CacheKind::Tree) => {
                let _ = b.commit(&[0]);
            }
            _ => {}
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 3_000, ..ProptestConfig::default() })]

        /// A rolled-back step leaves every kind observably identical to a copy that never
        /// saw it; a committed one is exactly what a plain step does.
        #[test]
        fn rolled_back_steps_leave_no_trace(
            kind in prop_oneof![Just(CacheKind::Contiguous), Just(CacheKind::Seq), Just(CacheKind::Tree)],
            ops in prop::collection::vec(op(), 1..20),
        ) {
            let mut b = Bookkeeping::new(kind, CAP);
            for op in &ops {
                let Op::Step { seq, start, n, fail } = *op else {
                    apply(&mut b, op);
                    continue;
                };
                let pos: Vec<i32> = (start..start + n as i32).collect();
                let before = b.clone();
                if kind == CacheKind::Seq && b.begin_step(&vec![seq; n]).is_err() {
                    continue;
                }
                let Ok(plan) = b.open_step(&pos) else {
                    prop_assert!(!b.step_is_open());
                    continue;
                };
                // A contiguous rewrite cannot roll back exactly (tested below).
                let rewrite = kind != CacheKind::Seq
                    && plan.write_start.is_some_and(|s| s < before.high_water());
                prop_assert!(b.step_plan().is_some());
                if fail && !rewrite {
                    b.rollback_step();
                    prop_assert!(b.step_plan().is_none());
                    for probe in [&pos[..], &[start + 1], &[0, 1]] {
                        prop_assert_eq!(observe(&b, seq, probe), observe(&before, seq, probe));
                    }
                } else {
                    b.commit_step();
                }
            }
        }
    }

    #[test]
    fn verbs_and_new_steps_abandon_an_open_step() {
        let mut b = Bookkeeping::new(CacheKind::Seq, 8);
        b.open_step(&[0, 1, 2]).unwrap();
        b.commit_step();
        b.begin_step(&[1]).unwrap();
        b.open_step(&[3]).unwrap();
        // A verb rolls the open step back, then runs.
        b.seq_cp(0, 2, PosRange::ALL).unwrap();
        assert_eq!((b.seq_len(1).unwrap(), b.live_cells()), (0, 3));
        // Opening a step rolls back the one left open, restoring its begin_step
        // declaration (sequence 1) with it.
        b.open_step(&[3]).unwrap();
        let cells = b.step_plan().unwrap().cell_of(0);
        b.open_step(&[3]).unwrap();
        assert_eq!(b.step_plan().unwrap().cell_of(0), cells);
        assert_eq!((b.seq_len(0).unwrap(), b.seq_len(1).unwrap()), (3, 1));
        let mut c = Bookkeeping::new(CacheKind::Contiguous, 8);
        c.open_step(&[0, 1, 2, 3]).unwrap();
        c.commit_step();
        // A rewrite that rolls back keeps only what its rows did not overwrite.
        c.open_step(&[2]).unwrap();
        c.rollback_step();
        assert_eq!(c.high_water(), 2);
    }
}
