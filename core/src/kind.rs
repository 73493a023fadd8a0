//! The three cache kinds behind one bookkeeping front, and the verb surface every cache
//! (reference or backend) exposes.

use std::fmt;
use std::str::FromStr;

use crate::contiguous::ContiguousBookkeeping;
use crate::error::{CacheError, CacheResult};
use crate::plan::StepPlan;
use crate::seq::{PosRange, SeqBookkeeping};
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

/// The bookkeeping of one cache, whichever kind. Verbs a kind does not have return
/// `not_supported`.
#[derive(Clone, Debug)]
pub enum Bookkeeping {
    /// See [`ContiguousBookkeeping`].
    Contiguous(ContiguousBookkeeping),
    /// See [`SeqBookkeeping`].
    Seq(SeqBookkeeping),
    /// See [`TreeBookkeeping`].
    Tree(TreeBookkeeping),
}

fn unsupported(verb: &str, kind: CacheKind) -> CacheError {
    CacheError::not_supported(format!("{verb} is not a verb of the {kind} cache"))
}

impl Bookkeeping {
    /// Empty bookkeeping of `kind` with `capacity` cells.
    pub fn new(kind: CacheKind, capacity: usize) -> Self {
        match kind {
            CacheKind::Contiguous => Bookkeeping::Contiguous(ContiguousBookkeeping::new(capacity)),
            CacheKind::Seq => Bookkeeping::Seq(SeqBookkeeping::new(capacity)),
            CacheKind::Tree => Bookkeeping::Tree(TreeBookkeeping::new(capacity)),
        }
    }

    /// The kind.
    pub fn kind(&self) -> CacheKind {
        match self {
            Bookkeeping::Contiguous(_) => CacheKind::Contiguous,
            Bookkeeping::Seq(_) => CacheKind::Seq,
            Bookkeeping::Tree(_) => CacheKind::Tree,
        }
    }

    /// Whether `n` more tokens fit.
    pub fn can_extend(&self, n: usize) -> bool {
        match self {
            Bookkeeping::Contiguous(b) => b.can_extend(n),
            Bookkeeping::Seq(b) => b.can_extend(n),
            Bookkeeping::Tree(b) => b.can_extend(n),
        }
    }

    /// The logical ceiling in cells.
    pub fn capacity(&self) -> usize {
        match self {
            Bookkeeping::Contiguous(b) => b.capacity(),
            Bookkeeping::Seq(b) => b.capacity(),
            Bookkeeping::Tree(b) => b.capacity(),
        }
    }

    /// One past the highest cell holding data.
    pub fn high_water(&self) -> usize {
        match self {
            Bookkeeping::Contiguous(b) => b.len(),
            Bookkeeping::Seq(b) => b.high_water(),
            Bookkeeping::Tree(b) => b.high_water(),
        }
    }

    /// Cells holding data.
    pub fn live_cells(&self) -> usize {
        match self {
            Bookkeeping::Seq(b) => b.live_cells(),
            _ => self.high_water(),
        }
    }

    /// Reserves per-cell bookkeeping for `cells` cells (byte layers call this as pools grow).
    pub fn reserve(&mut self, cells: usize) {
        if let Bookkeeping::Seq(b) = self {
            b.reserve(cells);
        }
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        match self {
            Bookkeeping::Contiguous(b) => b.clear(),
            Bookkeeping::Seq(b) => b.clear(),
            Bookkeeping::Tree(b) => b.clear(),
        }
    }

    /// Contiguous only: truncate to `len` tokens.
    pub fn rewind(&mut self, len: usize) -> CacheResult<()> {
        match self {
            Bookkeeping::Contiguous(b) => b.rewind(len),
            _ => Err(unsupported("rewind", self.kind())),
        }
    }

    /// Seq only: the next step's per-token sequences.
    pub fn begin_step(&mut self, seq_ids: &[i32]) -> CacheResult<()> {
        match self {
            Bookkeeping::Seq(b) => b.begin_step(seq_ids),
            _ => Err(unsupported("begin_step", self.kind())),
        }
    }

    /// Seq only: share `src`'s cells in `range` with `dst`.
    pub fn seq_cp(&mut self, src: i32, dst: i32, range: PosRange) -> CacheResult<()> {
        match self {
            Bookkeeping::Seq(b) => b.seq_cp(src, dst, range),
            _ => Err(unsupported("seq_cp", self.kind())),
        }
    }

    /// Seq only: drop `seq` from its cells in `range`.
    pub fn seq_rm(&mut self, seq: i32, range: PosRange) -> CacheResult<()> {
        match self {
            Bookkeeping::Seq(b) => b.seq_rm(seq, range),
            _ => Err(unsupported("seq_rm", self.kind())),
        }
    }

    /// Seq only: keep `seq` alone.
    pub fn seq_keep(&mut self, seq: i32) -> CacheResult<()> {
        match self {
            Bookkeeping::Seq(b) => b.seq_keep(seq),
            _ => Err(unsupported("seq_keep", self.kind())),
        }
    }

    /// Seq only: cells held by `seq`.
    pub fn seq_len(&self, seq: i32) -> CacheResult<usize> {
        match self {
            Bookkeeping::Seq(b) => b.seq_len(seq),
            _ => Err(unsupported("seq_len", self.kind())),
        }
    }

    /// Tree only: append a frontier.
    pub fn propose(&mut self, parents: &[i32]) -> CacheResult<()> {
        match self {
            Bookkeeping::Tree(b) => b.propose(parents),
            _ => Err(unsupported("propose", self.kind())),
        }
    }

    /// Tree only: accept a root-first chain; the caller moves the rows, then recycles.
    pub fn commit(&mut self, accepted: &[i32]) -> CacheResult<CommitPlan> {
        match self {
            Bookkeeping::Tree(b) => b.commit(accepted),
            _ => Err(unsupported("commit", self.kind())),
        }
    }

    /// Returns a commit plan's buffer.
    pub fn recycle(&mut self, plan: CommitPlan) {
        if let Bookkeeping::Tree(b) = self {
            b.recycle(plan);
        }
    }

    /// Plans the step for `layer`: layer 0 starts a new step; later layers reuse the
    /// memoized plan and must pass the same positions. Validates before it mutates.
    pub fn plan_layer(&mut self, layer: usize, positions: &[i32]) -> CacheResult<&StepPlan> {
        if layer == 0 {
            return match self {
                Bookkeeping::Contiguous(b) => b.plan(positions),
                Bookkeeping::Seq(b) => b.plan(positions),
                Bookkeeping::Tree(b) => b.plan(positions),
            };
        }
        let plan = match self {
            Bookkeeping::Contiguous(b) => b.current_plan(),
            Bookkeeping::Seq(b) => b.current_plan(),
            Bookkeeping::Tree(b) => b.current_plan(),
        };
        let plan = plan.ok_or_else(|| {
            CacheError::bad_shape(format!(
                "layer {layer} called with no step in progress: every step starts at layer 0"
            ))
        })?;
        if plan.positions != positions {
            return Err(CacheError::bad_position(format!(
                "layer {layer} positions differ from those layer 0 of this step planned"
            )));
        }
        Ok(plan)
    }

    /// The plan of the step in progress, if any.
    pub fn current_plan(&self) -> Option<&StepPlan> {
        match self {
            Bookkeeping::Contiguous(b) => b.current_plan(),
            Bookkeeping::Seq(b) => b.current_plan(),
            Bookkeeping::Tree(b) => b.current_plan(),
        }
    }
}

/// The neutral runner verbs of a cache with bytes behind its bookkeeping.
///
/// Implementors provide access to their [`Bookkeeping`] and the one byte operation a verb
/// needs (moving committed tree rows); every verb validates in the bookkeeping first, so a
/// refused verb leaves bytes and bookkeeping untouched.
pub trait CacheVerbs {
    /// The bookkeeping.
    fn bookkeeping(&self) -> &Bookkeeping;
    /// The bookkeeping, mutably.
    fn bookkeeping_mut(&mut self) -> &mut Bookkeeping;
    /// Moves row `rows[i]` to `base + i` in every layer's K and V (tree commit).
    fn move_rows(&mut self, base: usize, rows: &[u32]);

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
        self.bookkeeping_mut().clear()
    }
    /// Contiguous: truncate to `len`.
    fn rewind(&mut self, len: usize) -> CacheResult<()> {
        self.bookkeeping_mut().rewind(len)
    }
    /// Seq: next step's per-token sequences.
    fn begin_step(&mut self, seq_ids: &[i32]) -> CacheResult<()> {
        self.bookkeeping_mut().begin_step(seq_ids)
    }
    /// Seq: share cells.
    fn seq_cp(&mut self, src: i32, dst: i32, range: PosRange) -> CacheResult<()> {
        self.bookkeeping_mut().seq_cp(src, dst, range)
    }
    /// Seq: drop cells.
    fn seq_rm(&mut self, seq: i32, range: PosRange) -> CacheResult<()> {
        self.bookkeeping_mut().seq_rm(seq, range)
    }
    /// Seq: keep one sequence.
    fn seq_keep(&mut self, seq: i32) -> CacheResult<()> {
        self.bookkeeping_mut().seq_keep(seq)
    }
    /// Seq: cells held by `seq`.
    fn seq_len(&self, seq: i32) -> CacheResult<usize> {
        self.bookkeeping().seq_len(seq)
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
        Ok(())
    }
}
