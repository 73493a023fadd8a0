//! [`TreeBookkeeping`]: a committed prefix plus speculative frontiers.
//!
//! With no tree pending, a step is a contiguous prefill/decode at the prefix tail. `propose`
//! appends a frontier of nodes (the next step's queries) at cells
//! `base + frontier_start ..`; each node attends the committed prefix, its ancestor chain
//! and itself. `commit` maps a root-first accepted chain onto `[base, base + len)` and
//! advances the prefix.

use crate::contiguous::ContiguousBookkeeping;
use crate::error::{CacheError, CacheResult};
use crate::plan::{MaskKind, StepPlan};

/// The row moves a byte layer performs for a commit.
///
/// Row `rows[i]` moves to `base + i`. Rows ascend and `rows[i] >= base + i`, so an in-place
/// forward copy never overwrites a row it has yet to read. Hand the plan back with
/// [`TreeBookkeeping::recycle`] so the next commit reuses its buffer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CommitPlan {
    /// The prefix length before the commit.
    pub base: usize,
    /// Source cell of each accepted node, root first.
    pub rows: Vec<u32>,
}

/// Bookkeeping of the tree (speculative) cache. See the module docs.
#[derive(Clone, Debug)]
pub struct TreeBookkeeping {
    prefix: ContiguousBookkeeping,
    /// Parent of every node proposed since the last commit (`-1` = attached to the prefix).
    parents: Vec<i32>,
    frontier_start: usize,
    /// Nodes whose rows a step has written (`frontier_start` or `parents.len()`).
    written: usize,
    plan: StepPlan,
    /// The current plan is the prefix's (no tree) rather than `plan`.
    plan_is_prefix: bool,
    plan_valid: bool,
    /// `written` before the frontier step in progress (rollback).
    undo_written: usize,
    commit_rows: Vec<u32>,
}

impl TreeBookkeeping {
    /// An empty cache of `capacity` cells.
    pub fn new(capacity: usize) -> Self {
        TreeBookkeeping {
            prefix: ContiguousBookkeeping::new(capacity),
            parents: Vec::new(),
            frontier_start: 0,
            written: 0,
            plan: StepPlan::default(),
            plan_is_prefix: false,
            plan_valid: false,
            undo_written: 0,
            commit_rows: Vec::new(),
        }
    }

    /// Whether `n` more cells fit after the prefix and the pending nodes.
    pub fn can_extend(&self, n: usize) -> bool {
        n <= self.capacity() - self.base() - self.spec_count()
    }

    /// The logical ceiling in cells.
    pub fn capacity(&self) -> usize {
        self.prefix.capacity()
    }

    /// Committed prefix length.
    pub fn base(&self) -> usize {
        self.prefix.len()
    }

    /// Nodes proposed since the last commit.
    pub fn spec_count(&self) -> usize {
        self.parents.len()
    }

    /// Index of the first node of the latest frontier.
    pub fn frontier_start(&self) -> usize {
        self.frontier_start
    }

    /// Nodes in the latest frontier.
    pub fn frontier_size(&self) -> usize {
        self.parents.len() - self.frontier_start
    }

    /// Parents of every pending node.
    pub fn parents(&self) -> &[i32] {
        &self.parents
    }

    /// Cells whose rows hold data: the prefix plus written nodes.
    pub fn high_water(&self) -> usize {
        self.base() + self.written
    }

    /// Forgets the prefix and every pending node.
    pub fn clear(&mut self) {
        self.prefix.clear();
        self.parents.clear();
        self.frontier_start = 0;
        self.written = 0;
        self.plan_valid = false;
    }

    /// Appends a frontier: `parents[k]` is the parent of node `spec_count() + k`, indexing
    /// any node proposed since the last commit (or `-1`). The previous frontier must have
    /// been stepped.
    pub fn propose(&mut self, parents: &[i32]) -> CacheResult<()> {
        if parents.is_empty() {
            return Err(CacheError::bad_tree("propose needs at least one node"));
        }
        if self.written != self.parents.len() {
            return Err(CacheError::bad_tree(format!(
                "the frontier of {} nodes proposed last has not been stepped yet",
                self.frontier_size()
            )));
        }
        let base_idx = self.parents.len();
        for (k, &p) in parents.iter().enumerate() {
            let node = base_idx + k;
            if p < -1 || p >= node as i32 {
                return Err(CacheError::bad_tree(format!(
                    "node {node} has parent {p}: parents must be -1 or an earlier node"
                )));
            }
        }
        if !self.can_extend(parents.len()) {
            return Err(CacheError::capacity(format!(
                "{} more nodes do not fit: prefix {} + pending {} of capacity {}",
                parents.len(),
                self.base(),
                self.spec_count(),
                self.capacity()
            )));
        }
        self.frontier_start = base_idx;
        self.parents.extend_from_slice(parents);
        self.plan_valid = false;
        Ok(())
    }

    /// Plans a step: the prefix's contiguous plan when no frontier is pending, else the
    /// frontier's run with the ancestor mask over `[0, base + spec_count)`.
    pub fn plan(&mut self, positions: &[i32]) -> CacheResult<&StepPlan> {
        if self.written == self.parents.len() {
            if !self.parents.is_empty() {
                return Err(CacheError::bad_tree(format!(
                    "{} speculative nodes are pending: commit (or propose the next frontier) before a plain step",
                    self.parents.len()
                )));
            }
            let plan = self.prefix.plan(positions)?;
            self.plan_is_prefix = true;
            self.plan_valid = true;
            return Ok(plan);
        }
        let q = self.frontier_size();
        if positions.len() != q {
            return Err(CacheError::bad_shape(format!(
                "the frontier has {q} nodes but the step has {} tokens",
                positions.len()
            )));
        }
        if let Some(&p) = positions
            .iter()
            .find(|&&p| p < 0 || p as usize >= self.capacity())
        {
            return Err(CacheError::bad_position(format!(
                "position {p} is outside 0..{}",
                self.capacity()
            )));
        }
        let base = self.base();
        let l = base + self.parents.len();
        self.plan.set_run(base + self.frontier_start, positions, l);
        self.plan.mask = MaskKind::Explicit;
        self.plan.mask_bits.clear();
        self.plan.mask_bits.resize(q * l, false);
        for qi in 0..q {
            let row = &mut self.plan.mask_bits[qi * l..(qi + 1) * l];
            row[..base].fill(true);
            let mut node = (self.frontier_start + qi) as i32;
            while node >= 0 {
                row[base + node as usize] = true;
                node = self.parents[node as usize];
            }
        }
        self.undo_written = self.written;
        self.written = self.parents.len();
        self.plan_is_prefix = false;
        self.plan_valid = true;
        Ok(&self.plan)
    }

    /// The plan of the step in progress, until a verb invalidates it.
    pub fn current_plan(&self) -> Option<&StepPlan> {
        if !self.plan_valid {
            None
        } else if self.plan_is_prefix {
            self.prefix.current_plan()
        } else {
            Some(&self.plan)
        }
    }

    /// Undoes the step in progress: a prefix step as [`ContiguousBookkeeping::rollback_step`]
    /// does, a frontier step by marking its nodes unstepped again. A no-op when none is.
    pub fn rollback_step(&mut self) {
        if !self.plan_valid {
            return;
        }
        if self.plan_is_prefix {
            self.prefix.rollback_step();
        } else {
            self.written = self.undo_written;
        }
        self.plan_valid = false;
    }

    /// Undoes the step in progress before any row was written: exact (see
    /// [`ContiguousBookkeeping::cancel_step`]). A no-op when none is.
    pub fn cancel_step(&mut self) {
        if self.plan_valid && self.plan_is_prefix {
            self.prefix.cancel_step();
            self.plan_valid = false;
        }
        self.rollback_step();
    }

    /// Accepts a root-first chain of stepped nodes (each the parent of the next, the first
    /// attached to the prefix), appends it to the prefix and drops every pending node. An
    /// empty chain just drops them.
    pub fn commit(&mut self, accepted: &[i32]) -> CacheResult<CommitPlan> {
        for (i, &node) in accepted.iter().enumerate() {
            if node < 0 || node as usize >= self.parents.len() {
                return Err(CacheError::bad_tree(format!(
                    "accepted node {node} was never proposed ({} pending)",
                    self.parents.len()
                )));
            }
            if node as usize >= self.written {
                return Err(CacheError::bad_tree(format!(
                    "accepted node {node} has not been stepped yet"
                )));
            }
            let want = if i == 0 { -1 } else { accepted[i - 1] };
            if self.parents[node as usize] != want {
                return Err(CacheError::bad_tree(format!(
                    "accepted chain is not root-first: node {node} has parent {}, expected {want}",
                    self.parents[node as usize]
                )));
            }
        }
        let base = self.base();
        let mut rows = std::mem::take(&mut self.commit_rows);
        rows.clear();
        rows.extend(accepted.iter().map(|&n| (base + n as usize) as u32));
        self.prefix.set_len(base + accepted.len());
        self.parents.clear();
        self.frontier_start = 0;
        self.written = 0;
        self.plan_valid = false;
        Ok(CommitPlan { base, rows })
    }

    /// Returns a commit plan's buffer for reuse.
    pub fn recycle(&mut self, plan: CommitPlan) {
        self.commit_rows = plan.rows;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use crate::plan::PlanKind;

    /// The seed's example: prefix [0, base), parents [-1, 0, 0, 1].
    #[test]
    fn seed_mask_example() {
        let base = 3;
        let mut t = TreeBookkeeping::new(16);
        t.plan(&[0, 1, 2]).unwrap();
        t.propose(&[-1, 0, 0, 1]).unwrap();
        let p = t.plan(&[3, 4, 4, 5]).unwrap();
        assert_eq!(p.kind(), PlanKind::Explicit);
        assert_eq!((p.write_start, p.read_len), (Some(base), base + 4));
        let expect = [
            [true, false, false, false],
            [true, true, false, false],
            [true, false, true, false],
            [true, true, false, true],
        ];
        for (q, row) in expect.iter().enumerate() {
            for j in 0..base {
                assert!(p.visible(q, j), "node {q} must see prefix cell {j}");
            }
            for (n, &want) in row.iter().enumerate() {
                assert_eq!(p.visible(q, base + n), want, "node {q} vs node {n}");
            }
        }
    }

    #[test]
    fn bfs_levels_then_commit() {
        let mut t = TreeBookkeeping::new(32);
        t.plan(&[0, 1, 2, 3]).unwrap();
        t.propose(&[-1]).unwrap();
        t.plan(&[4]).unwrap();
        t.propose(&[0, 0]).unwrap();
        let p = t.plan(&[5, 5]).unwrap();
        assert_eq!((p.write_start, p.read_len), (Some(5), 7));
        assert!(p.visible(0, 4) && p.visible(0, 5) && !p.visible(0, 6));
        assert!(p.visible(1, 4) && !p.visible(1, 5) && p.visible(1, 6));
        t.propose(&[2]).unwrap();
        t.plan(&[6]).unwrap();
        let c = t.commit(&[0, 2, 3]).unwrap();
        assert_eq!(c.base, 4);
        assert_eq!(c.rows, vec![4, 6, 7]);
        assert_eq!((t.base(), t.spec_count()), (7, 0));
        let p = t.plan(&[7]).unwrap();
        assert_eq!(
            (p.kind(), p.write_start, p.read_len),
            (PlanKind::SingleContiguous, Some(7), 8)
        );
    }

    #[test]
    fn bad_trees_leave_state_unchanged() {
        let mut t = TreeBookkeeping::new(8);
        t.plan(&[0, 1]).unwrap();
        t.propose(&[-1, 0, 0]).unwrap();
        let cases: [(&[i32], ErrorKind); 5] = [
            (&[], ErrorKind::BadTree),
            (&[3], ErrorKind::BadTree),
            (&[-1, 4], ErrorKind::BadTree),
            (&[-2], ErrorKind::BadTree),
            (&[-1, -1, -1, -1], ErrorKind::Capacity),
        ];
        // The frontier has not been stepped: any propose is refused.
        assert_eq!(t.propose(&[0]).unwrap_err().kind, ErrorKind::BadTree);
        t.plan(&[2, 3, 3]).unwrap();
        for (parents, kind) in cases {
            let before = t.clone();
            assert_eq!(t.propose(parents).unwrap_err().kind, kind, "{parents:?}");
            assert_eq!(t.parents(), before.parents());
            assert_eq!(t.current_plan(), before.current_plan());
        }
        for accepted in [&[1][..], &[0, 2, 1], &[5], &[-1], &[0, 0]] {
            let before = t.clone();
            assert_eq!(t.commit(accepted).unwrap_err().kind, ErrorKind::BadTree);
            assert_eq!((t.base(), t.parents()), (before.base(), before.parents()));
        }
        // A plain step while nodes are pending, and a wrong token count.
        assert_eq!(t.plan(&[2]).unwrap_err().kind, ErrorKind::BadTree);
        t.propose(&[1]).unwrap();
        assert_eq!(t.plan(&[3, 4]).unwrap_err().kind, ErrorKind::BadShape);
        assert_eq!(t.plan(&[9]).unwrap_err().kind, ErrorKind::BadPosition);
        // Accepting a node that was proposed but not stepped.
        assert_eq!(t.commit(&[0, 1, 3]).unwrap_err().kind, ErrorKind::BadTree);
        assert_eq!(t.frontier_size(), 1);
    }

    #[test]
    fn empty_commit_discards_and_clear_resets() {
        let mut t = TreeBookkeeping::new(8);
        t.plan(&[0]).unwrap();
        t.propose(&[-1, -1]).unwrap();
        t.plan(&[1, 1]).unwrap();
        assert!(t.can_extend(5) && !t.can_extend(6));
        let c = t.commit(&[]).unwrap();
        assert!(c.rows.is_empty());
        assert_eq!((t.base(), t.spec_count(), t.high_water()), (1, 0, 1));
        t.clear();
        assert_eq!((t.base(), t.current_plan()), (0, None));
    }

    // ---- property test against a brute-force model ----

    use proptest::prelude::*;
    use std::collections::BTreeSet;

    /// Model: the prefix length and the pending nodes as (parent, stepped).
    #[derive(Clone, Debug, Default)]
    struct Model {
        base: usize,
        nodes: Vec<(i32, bool)>,
        frontier: usize,
    }

    impl Model {
        fn ancestors(&self, node: usize) -> BTreeSet<usize> {
            let mut set = BTreeSet::from([node]);
            let p = self.nodes[node].0;
            if p >= 0 {
                set.extend(self.ancestors(p as usize));
            }
            set
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Plain(usize),
        Propose(Vec<i32>),
        Step(i32),
        Commit(Vec<i32>),
        Clear,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            2 => (1..4usize).prop_map(Op::Plain),
            4 => prop::collection::vec(-2..6i32, 0..4).prop_map(Op::Propose),
            4 => (-1..2i32).prop_map(Op::Step),
            2 => prop::collection::vec(-1..7i32, 0..4).prop_map(Op::Commit),
            1 => Just(Op::Clear),
        ]
    }

    const CAP: usize = 20;

    fn run(ops: &[Op]) -> Result<(), TestCaseError> {
        let mut t = TreeBookkeeping::new(CAP);
        let mut m = Model::default();
        for op in ops {
            match op {
                Op::Plain(_) if m.nodes.iter().any(|n| !n.1) => continue,
                Op::Plain(n) => {
                    let pos: Vec<i32> = (m.base..m.base + n).map(|p| p as i32).collect();
                    let want_ok = m.nodes.is_empty() && m.base + n <= CAP;
                    let r = t.plan(&pos).cloned();
                    prop_assert_eq!(r.is_ok(), want_ok, "{:?}", r);
                    if let Ok(p) = r {
                        prop_assert_eq!(p.kind(), PlanKind::SingleContiguous);
                        prop_assert_eq!((p.write_start, p.read_len), (Some(m.base), m.base + n));
                        m.base += n;
                    }
                }
                Op::Propose(parents) => {
                    let first = m.nodes.len();
                    let stepped = m.nodes.iter().all(|n| n.1);
                    let shaped = !parents.is_empty()
                        && parents
                            .iter()
                            .enumerate()
                            .all(|(k, &p)| p >= -1 && p < (first + k) as i32);
                    let fits = m.base + m.nodes.len() + parents.len() <= CAP;
                    let r = t.propose(parents);
                    match (&r, stepped && shaped, fits) {
                        (Ok(()), true, true) => {
                            m.frontier = first;
                            m.nodes.extend(parents.iter().map(|&p| (p, false)));
                        }
                        (Err(e), false, _) => prop_assert_eq!(e.kind, ErrorKind::BadTree),
                        (Err(e), true, false) => prop_assert_eq!(e.kind, ErrorKind::Capacity),
                        _ => {
                            return Err(TestCaseError::fail(format!("propose {parents:?}: {r:?}")))
                        }
                    }
                }
                Op::Step(skew) => {
                    let pending = m.nodes.len() - m.frontier;
                    let active = m.nodes.iter().any(|n| !n.1);
                    let n = (pending as i32 + skew).max(1) as usize;
                    let pos: Vec<i32> = (0..n).map(|i| (m.base + i) as i32).collect();
                    let r = t.plan(&pos).cloned();
                    if !active {
                        // Covered by Op::Plain; only the pending-tree refusal is checked here.
                        if !m.nodes.is_empty() {
                            prop_assert_eq!(r.unwrap_err().kind, ErrorKind::BadTree);
                        } else if let Ok(p) = r {
                            m.base = p.read_len;
                        }
                        continue;
                    }
                    if n != pending {
                        prop_assert_eq!(r.unwrap_err().kind, ErrorKind::BadShape);
                        continue;
                    }
                    let p = r.unwrap();
                    let l = m.base + m.nodes.len();
                    prop_assert_eq!(
                        (p.write_start, p.read_len, p.kind()),
                        (Some(m.base + m.frontier), l, PlanKind::Explicit)
                    );
                    for q in 0..pending {
                        let anc = m.ancestors(m.frontier + q);
                        for j in 0..l {
                            let want = j < m.base || anc.contains(&(j - m.base));
                            prop_assert_eq!(p.visible(q, j), want, "query {} cell {}", q, j);
                        }
                    }
                    for n in &mut m.nodes[m.frontier..] {
                        n.1 = true;
                    }
                }
                Op::Commit(accepted) => {
                    let chain_ok = accepted.iter().enumerate().all(|(i, &a)| {
                        a >= 0
                            && (a as usize) < m.nodes.len()
                            && m.nodes[a as usize].1
                            && m.nodes[a as usize].0 == if i == 0 { -1 } else { accepted[i - 1] }
                    });
                    let r = t.commit(accepted);
                    prop_assert_eq!(r.is_ok(), chain_ok, "{:?} on {:?}", accepted, m);
                    if let Ok(c) = r {
                        let rows: Vec<u32> = accepted
                            .iter()
                            .map(|&a| (m.base + a as usize) as u32)
                            .collect();
                        prop_assert_eq!(c.base, m.base);
                        prop_assert_eq!(c.rows, rows);
                        m.base += accepted.len();
                        m.nodes.clear();
                        m.frontier = 0;
                    } else {
                        prop_assert_eq!(r.unwrap_err().kind, ErrorKind::BadTree);
                    }
                }
                Op::Clear => {
                    t.clear();
                    m = Model::default();
                }
            }
            prop_assert_eq!((t.base(), t.spec_count()), (m.base, m.nodes.len()));
            for n in 0..=CAP {
                prop_assert_eq!(t.can_extend(n), m.base + m.nodes.len() + n <= CAP);
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

        /// Masks, windows, commits and every refusal agree with the brute-force model.
        #[test]
        fn verbs_and_plans_match_the_model(ops in prop::collection::vec(op(), 1..24)) {
            run(&ops)?;
        }
    }
}
