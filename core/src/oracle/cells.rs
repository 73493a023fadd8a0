//! [`CellModel`]: the oracle's own picture of a cache — which cell holds which position for
//! which sequences or tree node, and who sees whom — decided naively from the contract in
//! the architecture notes. It never calls core's bookkeeping or planning: conformance diffs
//! those against this.
//!
//! Visibility, per kind:
//! - contiguous: cell `j` holds position `j`; a query at position `p` sees `j <= p`;
//! - seq: a query of sequence `s` at position `p` sees an occupied cell iff the cell belongs
//!   to `s` and holds a position `<= p`;
//! - tree: a frontier node sees the committed prefix, its ancestors (by walking parents) and
//!   itself; a step with no frontier is a contiguous step on the prefix.
//!
//! Refusals use the same [`ErrorKind`](crate::error::ErrorKind)s, checked in the order the contract lists them.

use std::collections::BTreeSet;

use crate::error::{CacheError, CacheResult};
use crate::kind::CacheKind;
use crate::plan::PlanKind;

/// Sequence ids are `0..MAX_SEQ_ID` (the contract's 64 live sequences).
const MAX_SEQ_ID: i32 = 64;

/// Where a step's tokens went and what each query sees.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefPlan {
    /// The read path a backend must report: maskless only for one sequence in contiguous
    /// cells `[0, n)`, positions ascending, with the step's tokens as its last cells.
    pub kind: PlanKind,
    /// The read window `[0, read_len)`: one past the highest occupied cell.
    pub read_len: usize,
    /// The cell of each token.
    pub cells: Vec<usize>,
    /// `[T, read_len]`, `true` = query `i` sees cell `j`.
    pub mask: Vec<bool>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Cell {
    pos: i32,
    seqs: BTreeSet<i32>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Node {
    parent: i32,
    pos: i32,
    stepped: bool,
}

/// The naive cache model of one kind. See the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CellModel {
    kind: CacheKind,
    capacity: usize,
    /// Occupied cells (`None` = free); grows as cells are first used, never to capacity.
    cells: Vec<Option<Cell>>,
    /// Seq: the sequences `begin_step` declared for the next step.
    declared: Option<Vec<i32>>,
    /// Tree: nodes proposed since the last commit; node `n` lives in cell `prefix + n`.
    nodes: Vec<Node>,
    /// Tree: first node of the latest frontier.
    frontier: usize,
}

fn err(kind: crate::error::ErrorKind, msg: String) -> CacheError {
    CacheError::new(kind, msg)
}

use crate::error::ErrorKind as E;

impl CellModel {
    /// An empty model.
    pub fn new(kind: CacheKind, capacity: usize) -> Self {
        CellModel {
            kind,
            capacity,
            cells: Vec::new(),
            declared: None,
            nodes: Vec::new(),
            frontier: 0,
        }
    }

    /// The kind modelled.
    pub fn kind(&self) -> CacheKind {
        self.kind
    }

    fn not_supported(&self, verb: &str) -> CacheError {
        err(E::NotSupported, format!("{verb} on a {} cache", self.kind))
    }

    fn occupied(&self) -> usize {
        self.cells.iter().flatten().count()
    }

    /// Contiguous and tree: the committed tokens (cells `[0, prefix)` are all occupied).
    fn prefix(&self) -> usize {
        self.cells.len() - self.nodes.iter().filter(|n| n.stepped).count()
    }

    /// One past the highest occupied cell.
    pub fn high_water(&self) -> usize {
        self.cells
            .iter()
            .rposition(Option::is_some)
            .map_or(0, |c| c + 1)
    }

    /// Who may still attend `cell` through a window: `None` for a free cell; else its
    /// position and its holders — its sequences (seq cache), holder 0 for committed tokens
    /// (contiguous and tree), and no holder list for a stepped tree node (kept whole until
    /// the commit).
    pub fn window_holders(&self, cell: usize) -> Option<(i32, Option<Vec<i32>>)> {
        let c = self.cells.get(cell)?.as_ref()?;
        let holders = match self.kind {
            CacheKind::Seq => Some(c.seqs.iter().copied().collect()),
            _ if cell < self.prefix() => Some(vec![0]),
            _ => None,
        };
        Some((c.pos, holders))
    }

    /// Whether `n` more tokens fit.
    pub fn can_extend(&self, n: usize) -> bool {
        let used = match self.kind {
            CacheKind::Seq => self.occupied(),
            CacheKind::Contiguous => self.prefix(),
            CacheKind::Tree => self.prefix() + self.nodes.len(),
        };
        (used as u128) + (n as u128) <= self.capacity as u128
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        *self = CellModel::new(self.kind, self.capacity);
    }

    /// Contiguous and tree with no nodes pending: keep at most the first `len` tokens (what
    /// survives a rolled-back step that rewrote history from `len`).
    pub fn truncate_prefix(&mut self, len: usize) {
        if self.nodes.is_empty() {
            self.cells.truncate(len);
        }
    }

    /// Contiguous: keep the first `len` tokens.
    pub fn rewind(&mut self, len: usize) -> CacheResult<()> {
        if self.kind != CacheKind::Contiguous {
            return Err(self.not_supported("rewind"));
        }
        if len > self.prefix() {
            return Err(err(E::BadPosition, format!("rewind to {len} past the end")));
        }
        self.cells.truncate(len);
        Ok(())
    }

    fn check_seq(seq: i32) -> CacheResult<()> {
        if (0..MAX_SEQ_ID).contains(&seq) {
            Ok(())
        } else {
            Err(err(E::BadSeqId, format!("sequence id {seq}")))
        }
    }

    fn check_range(p0: Option<i32>, p1: Option<i32>) -> CacheResult<(i32, i32)> {
        let (a, b) = (p0.unwrap_or(0), p1.unwrap_or(i32::MAX));
        if a < 0 || b < 0 || a > b {
            return Err(err(E::BadPosition, format!("range {p0:?}..{p1:?}")));
        }
        Ok((a, b))
    }

    /// Seq: the sequence of each token of the next step.
    pub fn begin_step(&mut self, seqs: &[i32]) -> CacheResult<()> {
        if self.kind != CacheKind::Seq {
            return Err(self.not_supported("begin_step"));
        }
        if seqs.is_empty() {
            return Err(err(E::BadShape, "begin_step with no tokens".into()));
        }
        for &s in seqs {
            Self::check_seq(s)?;
        }
        self.declared = Some(seqs.to_vec());
        Ok(())
    }

    /// Seq: `dst` joins every cell of `src` with a position in `[p0, p1)`.
    pub fn seq_cp(
        &mut self,
        src: i32,
        dst: i32,
        p0: Option<i32>,
        p1: Option<i32>,
    ) -> CacheResult<()> {
        if self.kind != CacheKind::Seq {
            return Err(self.not_supported("seq_cp"));
        }
        Self::check_seq(src)?;
        Self::check_seq(dst)?;
        let (a, b) = Self::check_range(p0, p1)?;
        for cell in self.cells.iter_mut().flatten() {
            if cell.seqs.contains(&src) && (a..b).contains(&cell.pos) {
                cell.seqs.insert(dst);
            }
        }
        Ok(())
    }

    /// Seq: `seq` leaves its cells with a position in `[p0, p1)`; cells nobody holds are free.
    pub fn seq_rm(&mut self, seq: i32, p0: Option<i32>, p1: Option<i32>) -> CacheResult<()> {
        if self.kind != CacheKind::Seq {
            return Err(self.not_supported("seq_rm"));
        }
        Self::check_seq(seq)?;
        let (a, b) = Self::check_range(p0, p1)?;
        for slot in self.cells.iter_mut() {
            if let Some(cell) = slot {
                if (a..b).contains(&cell.pos) {
                    cell.seqs.remove(&seq);
                }
                if cell.seqs.is_empty() {
                    *slot = None;
                }
            }
        }
        Ok(())
    }

    /// Seq: only `seq` remains; it must hold a cell.
    pub fn seq_keep(&mut self, seq: i32) -> CacheResult<()> {
        if self.kind != CacheKind::Seq {
            return Err(self.not_supported("seq_keep"));
        }
        Self::check_seq(seq)?;
        if self.seq_len(seq)? == 0 {
            return Err(err(E::UnknownSeq, format!("sequence {seq} holds no cells")));
        }
        for slot in self.cells.iter_mut() {
            match slot {
                Some(cell) if cell.seqs.contains(&seq) => cell.seqs = BTreeSet::from([seq]),
                _ => *slot = None,
            }
        }
        Ok(())
    }

    /// The (position, cell) of every token `seq` holds, positions ascending: a seq cache's
    /// cells of `seq`; for contiguous and tree caches, sequence 0 only, the committed tokens.
    pub fn history(&self, seq: i32) -> CacheResult<Vec<(i32, usize)>> {
        if self.kind != CacheKind::Seq {
            if seq != 0 {
                return Err(err(
                    E::BadSeqId,
                    format!("a {} cache holds sequence 0 only, not {seq}", self.kind),
                ));
            }
            return Ok((0..self.prefix())
                .map(|c| (self.cells[c].as_ref().map_or(c as i32, |x| x.pos), c))
                .collect());
        }
        Self::check_seq(seq)?;
        let mut held: Vec<(i32, usize)> = (0..self.cells.len())
            .filter_map(|c| {
                let cell = self.cells[c].as_ref()?;
                cell.seqs.contains(&seq).then_some((cell.pos, c))
            })
            .collect();
        held.sort_unstable();
        Ok(held)
    }

    /// Seq: cells that belong to `seq`.
    pub fn seq_len(&self, seq: i32) -> CacheResult<usize> {
        if self.kind != CacheKind::Seq {
            return Err(self.not_supported("seq_len"));
        }
        Self::check_seq(seq)?;
        Ok(self
            .cells
            .iter()
            .flatten()
            .filter(|c| c.seqs.contains(&seq))
            .count())
    }

    /// Tree: a frontier of nodes with these parents (`-1` = the prefix, else an earlier node
    /// since the last commit).
    pub fn propose(&mut self, parents: &[i32]) -> CacheResult<()> {
        if self.kind != CacheKind::Tree {
            return Err(self.not_supported("propose"));
        }
        if parents.is_empty() {
            return Err(err(E::BadTree, "an empty frontier".into()));
        }
        if self.nodes.iter().any(|n| !n.stepped) {
            return Err(err(E::BadTree, "the last frontier was not stepped".into()));
        }
        for (k, &p) in parents.iter().enumerate() {
            if p < -1 || p >= (self.nodes.len() + k) as i32 {
                return Err(err(E::BadTree, format!("parent {p}")));
            }
        }
        if !self.can_extend(parents.len()) {
            return Err(err(E::Capacity, "the frontier does not fit".into()));
        }
        self.frontier = self.nodes.len();
        self.nodes.extend(parents.iter().map(|&parent| Node {
            parent,
            pos: -1,
            stepped: false,
        }));
        Ok(())
    }

    /// Tree: accepts a root-first chain of stepped nodes; returns the cell moves
    /// `(from, to)` the rows must make, in order.
    pub fn commit(&mut self, accepted: &[i32]) -> CacheResult<Vec<(usize, usize)>> {
        if self.kind != CacheKind::Tree {
            return Err(self.not_supported("commit"));
        }
        for (i, &a) in accepted.iter().enumerate() {
            let node = usize::try_from(a)
                .ok()
                .and_then(|a| self.nodes.get(a))
                .ok_or_else(|| err(E::BadTree, format!("node {a} was not proposed")))?;
            if !node.stepped {
                return Err(err(E::BadTree, format!("node {a} was not stepped")));
            }
            let want = if i == 0 { -1 } else { accepted[i - 1] };
            if node.parent != want {
                return Err(err(
                    E::BadTree,
                    format!("node {a} is not a child of {want}"),
                ));
            }
        }
        let base = self.prefix();
        let moves: Vec<(usize, usize)> = accepted
            .iter()
            .enumerate()
            .map(|(i, &a)| (base + a as usize, base + i))
            .collect();
        let kept: Vec<Cell> = moves
            .iter()
            .map(|&(from, _)| self.cells[from].clone().expect("a stepped node's cell"))
            .collect();
        self.cells.truncate(base);
        self.cells.extend(kept.into_iter().map(Some));
        self.nodes.clear();
        self.frontier = 0;
        Ok(moves)
    }

    /// Places a step's tokens and says what each query sees.
    pub fn step(&mut self, positions: &[i32]) -> CacheResult<RefPlan> {
        match self.kind {
            CacheKind::Contiguous => self.contiguous_step(positions),
            CacheKind::Seq => self.seq_step(positions),
            CacheKind::Tree if self.nodes.iter().all(|n| n.stepped) => {
                if !self.nodes.is_empty() {
                    return Err(err(E::BadTree, "nodes are pending: commit first".into()));
                }
                self.contiguous_step(positions)
            }
            CacheKind::Tree => self.frontier_step(positions),
        }
    }

    /// Contiguous (and the tree's prefix): positions `p..p+T` with `p <= len`; writing at
    /// `p < len` drops everything from `p`.
    fn contiguous_step(&mut self, positions: &[i32]) -> CacheResult<RefPlan> {
        let Some(&first) = positions.first() else {
            return Err(err(E::BadShape, "no tokens".into()));
        };
        if first < 0 {
            return Err(err(E::BadPosition, format!("position {first}")));
        }
        if positions.windows(2).any(|w| w[1] as i64 != w[0] as i64 + 1) {
            return Err(err(E::BadPosition, "positions are not consecutive".into()));
        }
        let start = first as usize;
        if start > self.prefix() {
            return Err(err(
                E::BadPosition,
                format!("position {start} leaves a hole"),
            ));
        }
        let end = start as u128 + positions.len() as u128;
        if end > self.capacity as u128 {
            return Err(err(
                E::Capacity,
                format!("position {} past capacity", end - 1),
            ));
        }
        self.cells.truncate(start);
        for &p in positions {
            self.cells.push(Some(Cell {
                pos: p,
                seqs: BTreeSet::from([0]),
            }));
        }
        let l = self.cells.len();
        let cells = &self.cells;
        let mask = positions
            .iter()
            .flat_map(|&p| {
                cells
                    .iter()
                    .map(move |c| c.as_ref().is_some_and(|c| c.pos <= p))
            })
            .collect();
        Ok(RefPlan {
            kind: PlanKind::SingleContiguous,
            read_len: l,
            cells: (start..l).collect(),
            mask,
        })
    }

    fn seq_step(&mut self, positions: &[i32]) -> CacheResult<RefPlan> {
        let n = positions.len();
        if n == 0 {
            return Err(err(E::BadShape, "no tokens".into()));
        }
        if self.declared.as_ref().is_some_and(|d| d.len() != n) {
            return Err(err(E::BadShape, "begin_step declared another count".into()));
        }
        if let Some(p) = positions.iter().find(|&&p| p < 0) {
            return Err(err(E::BadPosition, format!("position {p}")));
        }
        if !self.can_extend(n) {
            return Err(err(E::Capacity, format!("{n} cells are not free")));
        }
        let seqs = self.declared.take().unwrap_or_else(|| vec![0; n]);
        let mut cells = Vec::with_capacity(n);
        for (&pos, &s) in positions.iter().zip(&seqs) {
            let free = self.cells.iter().position(Option::is_none);
            let c = free.unwrap_or(self.cells.len());
            if c == self.cells.len() {
                self.cells.push(None);
            }
            self.cells[c] = Some(Cell {
                pos,
                seqs: BTreeSet::from([s]),
            });
            cells.push(c);
        }
        let l = self.high_water();
        let mask = positions
            .iter()
            .zip(&seqs)
            .flat_map(|(&p, s)| {
                self.cells[..l]
                    .iter()
                    .map(move |c| c.as_ref().is_some_and(|c| c.seqs.contains(s) && c.pos <= p))
            })
            .collect();
        Ok(RefPlan {
            kind: self.seq_plan_kind(&seqs, &cells),
            read_len: l,
            cells,
            mask,
        })
    }

    /// Maskless iff one sequence owns every occupied cell, alone, in cells `[0, n)` with
    /// ascending positions, and the step wrote its last cells.
    fn seq_plan_kind(&self, seqs: &[i32], cells: &[usize]) -> PlanKind {
        let s = seqs[0];
        let n = self.occupied();
        let owned = self.cells[..n]
            .iter()
            .all(|c| c.as_ref().is_some_and(|c| c.seqs == BTreeSet::from([s])));
        let ascending = self.cells[..n]
            .windows(2)
            .all(|w| matches!(w, [Some(a), Some(b)] if a.pos < b.pos));
        let tail = cells
            .iter()
            .enumerate()
            .all(|(i, &c)| c == n - cells.len() + i);
        if seqs.iter().all(|&x| x == s) && owned && ascending && tail && self.high_water() == n {
            PlanKind::SingleContiguous
        } else {
            PlanKind::Explicit
        }
    }

    fn frontier_step(&mut self, positions: &[i32]) -> CacheResult<RefPlan> {
        let q = self.nodes.len() - self.frontier;
        if positions.len() != q {
            return Err(err(E::BadShape, format!("{q} frontier nodes")));
        }
        if let Some(p) = positions
            .iter()
            .find(|&&p| p < 0 || p as i64 >= self.capacity as i64)
        {
            return Err(err(E::BadPosition, format!("position {p}")));
        }
        let base = self.prefix();
        let l = base + self.nodes.len();
        self.cells.resize(l, None);
        for (k, &pos) in positions.iter().enumerate() {
            let node = &mut self.nodes[self.frontier + k];
            node.pos = pos;
            node.stepped = true;
            self.cells[base + self.frontier + k] = Some(Cell {
                pos,
                seqs: BTreeSet::from([0]),
            });
        }
        let mut mask = vec![false; q * l];
        for k in 0..q {
            let row = &mut mask[k * l..(k + 1) * l];
            row[..base].fill(true);
            let mut node = (self.frontier + k) as i32;
            while node >= 0 {
                row[base + node as usize] = true;
                node = self.nodes[node as usize].parent;
            }
        }
        Ok(RefPlan {
            kind: PlanKind::Explicit,
            read_len: l,
            cells: (base + self.frontier..base + self.frontier + q).collect(),
            mask,
        })
    }
}
