//! [`SeqBookkeeping`]: a pool of cells, each tagged with a position and a set of sequences.
//!
//! Visibility rule (the correctness core): query `i` attends cell `j` iff `j` is occupied,
//! shares a sequence with `i`, and `pos[j] <= pos[i]`. The read window is `[0, high_water)`.
//!
//! Capacity counts cells, not positions: positions are any non-negative values, so a
//! sliding window (`seq_rm` of the oldest positions) decodes on past `capacity` tokens.

use crate::error::{CacheError, CacheResult};
use crate::plan::{MaskKind, StepPlan};
use crate::radix::{PrefixLock, RadixIndex};

mod prefix;

pub use prefix::PrefixStats;

/// Live sequences are ids `0..MAX_SEQS` (one bit each in a `u64`).
pub const MAX_SEQS: usize = 64;

/// A set of sequence ids.
pub type SeqBits = u64;

/// Per-sequence summary, kept incrementally by `plan` and re-derived by the verbs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct SeqInfo {
    count: usize,
    min_cell: usize,
    max_cell: usize,
    /// Positions strictly increase with cell index over this sequence's cells.
    ordered: bool,
    /// Position stored at `max_cell`.
    last_pos: i32,
}

impl SeqInfo {
    fn add(&mut self, cell: usize, pos: i32) {
        if self.count == 0 {
            *self = SeqInfo {
                count: 1,
                min_cell: cell,
                max_cell: cell,
                ordered: true,
                last_pos: pos,
            };
            return;
        }
        self.count += 1;
        self.min_cell = self.min_cell.min(cell);
        if cell > self.max_cell {
            self.ordered &= pos > self.last_pos;
            self.max_cell = cell;
            self.last_pos = pos;
        } else {
            self.ordered = false;
        }
    }
}

/// A half-open position range `p0 <= pos < p1`; `None` is open-ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PosRange {
    /// Inclusive lower bound (`None` = 0).
    pub p0: Option<i32>,
    /// Exclusive upper bound (`None` = unbounded).
    pub p1: Option<i32>,
}

impl PosRange {
    /// Every position.
    pub const ALL: PosRange = PosRange { p0: None, p1: None };

    /// `p0 <= pos < p1`.
    pub fn new(p0: Option<i32>, p1: Option<i32>) -> Self {
        PosRange { p0, p1 }
    }

    fn check(self) -> CacheResult<()> {
        if let Some(p0) = self.p0.filter(|&p| p < 0) {
            return Err(CacheError::bad_position(format!("p0 {p0} is negative")));
        }
        if let Some(p1) = self.p1.filter(|&p| p < 0) {
            return Err(CacheError::bad_position(format!("p1 {p1} is negative")));
        }
        if let (Some(p0), Some(p1)) = (self.p0, self.p1) {
            if p0 > p1 {
                return Err(CacheError::bad_position(format!("p0 {p0} > p1 {p1}")));
            }
        }
        Ok(())
    }

    /// Whether `pos` lies in the range.
    pub fn contains(self, pos: i32) -> bool {
        self.p0.is_none_or(|p0| pos >= p0) && self.p1.is_none_or(|p1| pos < p1)
    }
}

/// Checks a sequence id and returns its bit.
pub fn seq_bit(seq: i32) -> CacheResult<SeqBits> {
    if (0..MAX_SEQS as i32).contains(&seq) {
        Ok(1u64 << seq)
    } else {
        Err(CacheError::bad_seq_id(format!(
            "sequence id {seq} is outside 0..{MAX_SEQS}"
        )))
    }
}

/// The multi-sequence cell pool. See the module docs for the visibility rule.
///
/// Cells are handed out lowest-first. `seq_cp` shares cells (no bytes move), `seq_rm`
/// frees a cell only when no sequence owns it any more. Every verb validates before it
/// mutates and invalidates the memoized plan.
#[derive(Clone, Debug)]
pub struct SeqBookkeeping {
    capacity: usize,
    /// Position per cell; `-1` = empty. Cells at or past `pos.len()` are free and untouched.
    pos: Vec<i32>,
    /// Owning sequences per cell.
    seqs: Vec<SeqBits>,
    /// Cells the prefix index holds (kept, invisible to every query, while no sequence owns
    /// them).
    indexed: Vec<bool>,
    /// Token prefixes whose K/V some cells hold (see [`SeqBookkeeping::prefix_attach`]).
    index: RadixIndex,
    /// Per sequence, the index prefixes it holds cells of (released when it empties).
    locks: Vec<Vec<PrefixLock>>,
    /// Free cells below `pos.len()`, sorted descending (the lowest pops first).
    free: Vec<u32>,
    high_water: usize,
    info: Box<[SeqInfo; MAX_SEQS]>,
    /// Sequences with at least one cell.
    live: SeqBits,
    /// Per-token sequences declared by `begin_step` for the next step.
    pending: Vec<SeqBits>,
    pending_set: bool,
    plan: StepPlan,
    plan_valid: bool,
    undo: SeqUndo,
}

/// What [`SeqBookkeeping::rollback_step`] restores: the state the step in progress changed,
/// saved by `plan` (a fixed-size copy, so planning stays allocation-free).
#[derive(Clone, Debug)]
struct SeqUndo {
    /// `pos.len()` before the step: cells at or past it were appended by the step.
    cells: usize,
    high_water: usize,
    live: SeqBits,
    pending_set: bool,
    info: Box<[SeqInfo; MAX_SEQS]>,
}

impl SeqBookkeeping {
    /// An empty pool of `capacity` cells.
    pub fn new(capacity: usize) -> Self {
        SeqBookkeeping {
            capacity,
            pos: Vec::new(),
            seqs: Vec::new(),
            indexed: Vec::new(),
            index: RadixIndex::new(),
            locks: vec![Vec::new(); MAX_SEQS],
            free: Vec::new(),
            high_water: 0,
            info: Box::new([SeqInfo::default(); MAX_SEQS]),
            live: 0,
            pending: Vec::new(),
            pending_set: false,
            plan: StepPlan::default(),
            plan_valid: false,
            undo: SeqUndo {
                cells: 0,
                high_water: 0,
                live: 0,
                pending_set: false,
                info: Box::new([SeqInfo::default(); MAX_SEQS]),
            },
        }
    }

    /// Reserves per-cell storage for `cells` cells, so later steps up to that many cells
    /// allocate nothing. Called by byte layers when their pools grow.
    pub fn reserve(&mut self, cells: usize) {
        let cells = cells.min(self.capacity);
        self.pos.reserve(cells.saturating_sub(self.pos.len()));
        self.seqs.reserve(cells.saturating_sub(self.seqs.len()));
        self.indexed
            .reserve(cells.saturating_sub(self.indexed.len()));
    }

    /// Whether `n` more cells are free.
    pub fn can_extend(&self, n: usize) -> bool {
        self.free_cells() >= n
    }

    fn free_cells(&self) -> usize {
        self.free.len() + (self.capacity - self.pos.len())
    }

    /// The logical ceiling in cells.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// One past the highest occupied cell: the read window of an explicit step.
    pub fn high_water(&self) -> usize {
        self.high_water
    }

    /// Occupied cells.
    pub fn live_cells(&self) -> usize {
        self.pos.len() - self.free.len()
    }

    /// The position in `cell`, or `None` when it is empty.
    pub fn cell_pos(&self, cell: usize) -> Option<i32> {
        self.pos.get(cell).copied().filter(|&p| p >= 0)
    }

    /// Whether the prefix index holds `cell`.
    pub fn cell_indexed(&self, cell: usize) -> bool {
        self.indexed.get(cell).copied().unwrap_or(false)
    }

    /// The sequences owning `cell` (empty set for a free cell).
    pub fn cell_seqs(&self, cell: usize) -> SeqBits {
        self.seqs.get(cell).copied().unwrap_or(0)
    }

    /// Cells held by `seq` (0 for a sequence that holds none).
    pub fn seq_len(&self, seq: i32) -> CacheResult<usize> {
        Ok(self.info[seq_bit(seq)?.trailing_zeros() as usize].count)
    }

    /// `(position, cell)` of every cell `seq` holds, by position (then cell).
    pub fn seq_history(&self, seq: i32) -> CacheResult<Vec<(i32, u32)>> {
        let b = seq_bit(seq)?;
        let mut cells: Vec<(i32, u32)> = (0..self.high_water)
            .filter(|&c| self.seqs[c] & b != 0)
            .map(|c| (self.pos[c], c as u32))
            .collect();
        cells.sort_unstable();
        Ok(cells)
    }

    /// Frees every cell and forgets every sequence and the prefix index; keeps allocations.
    pub fn clear(&mut self) {
        self.pos.clear();
        self.seqs.clear();
        self.indexed.clear();
        self.index.clear();
        self.locks.iter_mut().for_each(Vec::clear);
        self.free.clear();
        self.high_water = 0;
        *self.info = [SeqInfo::default(); MAX_SEQS];
        self.live = 0;
        self.pending.clear();
        self.pending_set = false;
        self.plan_valid = false;
    }

    /// Declares the sequence of each token of the next step. Without it a step puts every
    /// token in sequence 0.
    pub fn begin_step(&mut self, seq_ids: &[i32]) -> CacheResult<()> {
        if seq_ids.is_empty() {
            return Err(CacheError::bad_shape("begin_step needs at least one token"));
        }
        for &s in seq_ids {
            seq_bit(s)?;
        }
        self.pending.clear();
        self.pending.extend(seq_ids.iter().map(|&s| 1u64 << s));
        self.pending_set = true;
        self.plan_valid = false;
        Ok(())
    }

    /// Shares `src`'s cells with positions in `range` with `dst` (no bytes move). A no-op
    /// when `src` is empty or `src == dst`.
    pub fn seq_cp(&mut self, src: i32, dst: i32, range: PosRange) -> CacheResult<()> {
        let (sb, db) = (seq_bit(src)?, seq_bit(dst)?);
        range.check()?;
        self.plan_valid = false;
        if sb == db || self.live & sb == 0 {
            return Ok(());
        }
        for c in 0..self.high_water {
            if self.seqs[c] & sb != 0 && range.contains(self.pos[c]) {
                self.seqs[c] |= db;
            }
        }
        self.reindex(db);
        self.share_locks(src, dst);
        Ok(())
    }

    /// Drops `seq` from its cells with positions in `range`, freeing cells no sequence owns
    /// any more. A no-op for an empty sequence.
    pub fn seq_rm(&mut self, seq: i32, range: PosRange) -> CacheResult<()> {
        let b = seq_bit(seq)?;
        range.check()?;
        self.plan_valid = false;
        if self.live & b == 0 {
            return Ok(());
        }
        for c in 0..self.high_water {
            if self.seqs[c] & b != 0 && range.contains(self.pos[c]) {
                self.seqs[c] &= !b;
                if self.seqs[c] == 0 {
                    self.release(c);
                }
            }
        }
        self.reindex(b);
        self.release_locks(b);
        self.settle_free();
        Ok(())
    }

    /// Keeps `seq` alone: every other sequence is dropped and cells only they owned are
    /// freed. `unknown_seq` when `seq` holds no cells.
    pub fn seq_keep(&mut self, seq: i32) -> CacheResult<()> {
        let b = seq_bit(seq)?;
        if self.live & b == 0 {
            return Err(CacheError::unknown_seq(format!(
                "seq_keep({seq}): sequence {seq} holds no cells"
            )));
        }
        self.plan_valid = false;
        for c in 0..self.high_water {
            if self.seqs[c] & b != 0 {
                self.seqs[c] = b;
            } else if self.pos[c] >= 0 {
                self.seqs[c] = 0;
                self.release(c);
            }
        }
        let dropped = self.live & !b;
        self.reindex(self.live);
        self.release_locks(dropped);
        self.settle_free();
        Ok(())
    }

    /// Places the step's tokens (lowest free cells first), classifies it and, for an
    /// explicit step, builds the `[n_tok, high_water]` mask. Consumes `begin_step`.
    pub fn plan(&mut self, positions: &[i32]) -> CacheResult<&StepPlan> {
        let n = positions.len();
        if n == 0 {
            return Err(CacheError::bad_shape("a step needs at least one token"));
        }
        if self.pending_set && self.pending.len() != n {
            return Err(CacheError::bad_shape(format!(
                "begin_step declared {} tokens but the step has {n}",
                self.pending.len()
            )));
        }
        if let Some(&p) = positions.iter().find(|&&p| p < 0) {
            return Err(CacheError::bad_position(format!(
                "position {p} is negative"
            )));
        }
        if !self.can_extend(n) {
            return Err(CacheError::capacity(format!(
                "{n} tokens need {n} free cells, {} are free (capacity {})",
                self.free_cells(),
                self.capacity
            )));
        }
        self.undo.cells = self.pos.len();
        self.undo.high_water = self.high_water;
        self.undo.live = self.live;
        self.undo.pending_set = self.pending_set;
        *self.undo.info = *self.info;
        if !self.pending_set {
            self.pending.clear();
            self.pending.resize(n, 1);
        }
        self.pending_set = false;

        let plan = &mut self.plan;
        plan.write_cells.clear();
        for (i, &p) in positions.iter().enumerate() {
            let bits = self.pending[i];
            let cell = match self.free.pop() {
                Some(c) => c as usize,
                None => {
                    self.pos.push(-1);
                    self.seqs.push(0);
                    self.indexed.push(false);
                    self.pos.len() - 1
                }
            };
            self.pos[cell] = p;
            self.seqs[cell] = bits;
            self.high_water = self.high_water.max(cell + 1);
            self.info[bits.trailing_zeros() as usize].add(cell, p);
            self.live |= bits;
            plan.write_cells.push(cell as u32);
        }
        self.classify(positions);
        self.plan_valid = true;
        Ok(&self.plan)
    }

    /// The plan of the step in progress, until a verb invalidates it.
    pub fn current_plan(&self) -> Option<&StepPlan> {
        self.plan_valid.then_some(&self.plan)
    }

    /// Undoes the step in progress exactly: its cells are free again (in the free list's
    /// order), the summaries, the high-water mark and a `begin_step` declaration are as
    /// before it. A no-op when no step is in progress.
    pub fn rollback_step(&mut self) {
        if !self.plan_valid {
            return;
        }
        for i in (0..self.plan.n_tok).rev() {
            let c = self.plan.cell_of(i);
            self.pos[c] = -1;
            self.seqs[c] = 0;
            if c < self.undo.cells {
                self.free.push(c as u32);
            }
        }
        self.pos.truncate(self.undo.cells);
        self.seqs.truncate(self.undo.cells);
        self.indexed.truncate(self.undo.cells);
        self.high_water = self.undo.high_water;
        self.live = self.undo.live;
        self.pending_set = self.undo.pending_set;
        *self.info = *self.undo.info;
        self.plan_valid = false;
    }

    /// `SingleContiguous` when one sequence owns exactly cells `[0, count)` in position
    /// order and the step's tokens are its last cells; else `Explicit` with the dense mask.
    fn classify(&mut self, positions: &[i32]) {
        let n = positions.len();
        let first = self.plan.write_cells[0] as usize;
        let bits = self.pending[0];
        let info = self.info[bits.trailing_zeros() as usize];
        let single = self.live == bits
            && info.ordered
            && info.min_cell == 0
            && info.max_cell + 1 == info.count
            && first + n == info.count
            && self.pending.iter().all(|&b| b == bits);
        if single {
            self.plan.set_run(first, positions, info.count);
            return;
        }
        let l = self.high_water;
        let plan = &mut self.plan;
        plan.set_positions(positions);
        plan.write_start = None;
        plan.read_len = l;
        plan.mask = MaskKind::Explicit;
        plan.mask_bits.clear();
        plan.mask_bits.resize(n * l, false);
        for (i, (&pi, &si)) in positions.iter().zip(&self.pending).enumerate() {
            let row = &mut plan.mask_bits[i * l..(i + 1) * l];
            for (j, m) in row.iter_mut().enumerate() {
                *m = self.seqs[j] & si != 0 && self.pos[j] >= 0 && self.pos[j] <= pi;
            }
        }
    }

    /// Marks `cell` free (the caller has cleared its owners) unless the prefix index holds it.
    fn release(&mut self, cell: usize) {
        if self.indexed[cell] {
            return;
        }
        self.pos[cell] = -1;
        self.free.push(cell as u32);
    }

    /// Restores the free-list order and lowers the high-water mark past trailing free cells.
    fn settle_free(&mut self) {
        self.free.sort_unstable_by(|a, b| b.cmp(a));
        while self.high_water > 0 && self.pos[self.high_water - 1] < 0 {
            self.high_water -= 1;
        }
    }

    /// Re-derives the summaries of the sequences in `which` from the cells.
    fn reindex(&mut self, which: SeqBits) {
        let mut bits = which;
        while bits != 0 {
            let s = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            self.info[s] = SeqInfo::default();
        }
        for c in 0..self.high_water {
            let mut owners = self.seqs[c] & which;
            while owners != 0 {
                let s = owners.trailing_zeros() as usize;
                owners &= owners - 1;
                self.info[s].add(c, self.pos[c]);
            }
        }
        let mut bits = which;
        while bits != 0 {
            let s = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if self.info[s].count == 0 {
                self.live &= !(1u64 << s);
            } else {
                self.live |= 1u64 << s;
            }
        }
    }
}

#[cfg(test)]
mod tests;
