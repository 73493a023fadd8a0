//! [`RadixIndex`]: which cells already hold the K/V of which token prefixes (seed 001's
//! prefix-cache contract, tensor-free).
//!
//! A radix tree over token ids: each edge carries a run of tokens and the cells holding their
//! K/V, and the path from the root spells a cached prefix, so token `i` of a path sits at
//! position `i`. Contracts:
//!
//! - [`RadixIndex::match_prefix`] does not mutate; its [`PrefixHandle`] stays valid until the
//!   next [`RadixIndex::evict`] or [`RadixIndex::clear`].
//! - A locked prefix ([`RadixIndex::lock`]) is *protected*: eviction never touches its cells.
//!   Locks count; every lock is released by exactly one [`RadixIndex::unlock`]. Locking splits
//!   an edge at the matched length, so protection covers exactly the matched tokens.
//! - [`RadixIndex::insert_prefix`] returns how many leading tokens were cached already; their
//!   cells in the caller's list are not taken (the caller still owns them).
//! - [`RadixIndex::evict`]`(n)` frees at least `n` cells, whole leaf edges in least-recently
//!   used order (a lock or an insert is a use), or fails when `n` exceeds the evictable size;
//!   `evict(0)` is a no-op.
//! - `evictable + protected` is the number of cached tokens.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

/// A refused index operation; the index is unchanged.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RadixError {
    /// `tokens` and `cells` differ in length.
    #[error("{tokens} tokens but {cells} cells")]
    LengthMismatch {
        /// Tokens given.
        tokens: usize,
        /// Cells given.
        cells: usize,
    },
    /// An eviction larger than what is evictable.
    #[error("cannot evict {requested} cells: only {evictable} are evictable")]
    NotEvictable {
        /// Cells asked for.
        requested: usize,
        /// Cells that could be freed.
        evictable: usize,
    },
    /// The lock was already released.
    #[error("the prefix is not locked (released twice?)")]
    NotLocked,
    /// The handle was made before an eviction or a clear; match again.
    #[error("stale prefix handle: the index was evicted or cleared since the match")]
    StaleHandle,
}

/// The result of [`RadixIndex::match_prefix`]: how many leading tokens are cached, where the
/// match ends. Lock it before relying on the cells.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixHandle {
    node: u32,
    len: usize,
    epoch: u64,
}

impl PrefixHandle {
    /// Matched tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing matched.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A held lock (see [`RadixIndex::lock`]); give it back with [`RadixIndex::unlock`]. A clone
/// is a copy of the record, not a second lock (that is [`RadixIndex::relock`]): unlocking both
/// is refused with `NotLocked` once the count is spent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixLock {
    node: u32,
    len: usize,
    clears: u64,
}

impl PrefixLock {
    /// Protected tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the lock protects nothing (the empty prefix).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

const ROOT: u32 = 0;

#[derive(Clone, Debug)]
struct Node {
    parent: u32,
    /// Depth of the edge's first token (the root's edge is empty at depth 0).
    start: usize,
    tokens: Vec<u32>,
    cells: Vec<u32>,
    children: BTreeMap<u32, u32>,
    refs: u32,
    last_use: u64,
}

impl Node {
    fn end(&self) -> usize {
        self.start + self.tokens.len()
    }
}

/// The prefix index. See the module docs for its contract.
#[derive(Clone, Debug)]
pub struct RadixIndex {
    /// Slot `ROOT` is the root; `None` slots are free for reuse.
    nodes: Vec<Option<Node>>,
    free_slots: Vec<u32>,
    clock: u64,
    evictable: usize,
    protected: usize,
    /// Bumped by every evict that removed something and by clear: unlocked handles expire.
    epoch: u64,
    /// Bumped by clear: locks expire.
    clears: u64,
}

impl Default for RadixIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl RadixIndex {
    /// An empty index.
    pub fn new() -> Self {
        RadixIndex {
            nodes: vec![Some(Self::root())],
            free_slots: Vec::new(),
            clock: 0,
            evictable: 0,
            protected: 0,
            epoch: 0,
            clears: 0,
        }
    }

    fn root() -> Node {
        Node {
            parent: ROOT,
            start: 0,
            tokens: Vec::new(),
            cells: Vec::new(),
            children: BTreeMap::new(),
            refs: 0,
            last_use: 0,
        }
    }

    /// Cached tokens that no lock protects.
    pub fn evictable_size(&self) -> usize {
        self.evictable
    }

    /// Cached tokens some lock protects.
    pub fn protected_size(&self) -> usize {
        self.protected
    }

    /// All cached tokens.
    pub fn total_size(&self) -> usize {
        self.evictable + self.protected
    }

    fn node(&self, id: u32) -> &Node {
        self.nodes[id as usize]
            .as_ref()
            .expect("live node ids only")
    }

    fn node_mut(&mut self, id: u32) -> &mut Node {
        self.nodes[id as usize]
            .as_mut()
            .expect("live node ids only")
    }

    /// Walks `tokens` from the root: the deepest node reached and the tokens matched.
    fn walk(&self, tokens: &[u32]) -> (u32, usize) {
        let (mut id, mut len) = (ROOT, 0);
        while len < tokens.len() {
            let Some(&child) = self.node(id).children.get(&tokens[len]) else {
                break;
            };
            let edge = &self.node(child).tokens;
            let common = edge
                .iter()
                .zip(&tokens[len..])
                .take_while(|(a, b)| a == b)
                .count();
            id = child;
            len += common;
            if common < edge.len() {
                break;
            }
        }
        (id, len)
    }

    /// The longest cached prefix of `tokens` and its cells (cell `i` holds token `i`).
    /// Changes nothing.
    pub fn match_prefix(&self, tokens: &[u32]) -> (PrefixHandle, Vec<u32>) {
        let (mut id, len) = self.walk(tokens);
        let handle = PrefixHandle {
            node: id,
            len,
            epoch: self.epoch,
        };
        let mut cells = vec![0; len];
        while id != ROOT {
            let n = self.node(id);
            let upto = n.end().min(len);
            cells[n.start..upto].copy_from_slice(&n.cells[..upto - n.start]);
            id = n.parent;
        }
        (handle, cells)
    }

    /// Splits the edge of `id` so that a node ends at depth `at` (`start < at < end`): the new
    /// head takes the first tokens and `id` keeps the tail, so ids of deeper nodes (and held
    /// locks) stay valid. Returns the head.
    fn split(&mut self, id: u32, at: usize) -> u32 {
        let n = self.node_mut(id);
        let k = at - n.start;
        let head = Node {
            parent: n.parent,
            start: n.start,
            tokens: n.tokens.drain(..k).collect(),
            cells: n.cells.drain(..k).collect(),
            children: BTreeMap::new(),
            refs: n.refs,
            last_use: n.last_use,
        };
        n.start = at;
        let (parent, first, tail_first) = (head.parent, head.tokens[0], n.tokens[0]);
        let head_id = self.alloc(head);
        self.node_mut(head_id).children.insert(tail_first, id);
        self.node_mut(id).parent = head_id;
        self.node_mut(parent).children.insert(first, head_id);
        head_id
    }

    fn alloc(&mut self, node: Node) -> u32 {
        match self.free_slots.pop() {
            Some(slot) => {
                self.nodes[slot as usize] = Some(node);
                slot
            }
            None => {
                self.nodes.push(Some(node));
                (self.nodes.len() - 1) as u32
            }
        }
    }

    /// The node ending exactly at depth `len` on the path through `id`, splitting if needed.
    fn node_ending_at(&mut self, mut id: u32, len: usize) -> u32 {
        // Splits since the match keep `id` on the deeper side: climb to the edge holding `len`.
        while id != ROOT && self.node(id).start >= len {
            id = self.node(id).parent;
        }
        if id != ROOT && self.node(id).end() > len {
            id = self.split(id, len);
        }
        id
    }

    fn touch(&mut self, mut id: u32) {
        self.clock += 1;
        let now = self.clock;
        while id != ROOT {
            let n = self.node_mut(id);
            n.last_use = now;
            id = n.parent;
        }
    }

    /// Protects the matched prefix from eviction and marks it used. `StaleHandle` when an
    /// eviction or clear happened since the match.
    pub fn lock(&mut self, handle: &PrefixHandle) -> Result<PrefixLock, RadixError> {
        if handle.epoch != self.epoch {
            return Err(RadixError::StaleHandle);
        }
        let id = self.node_ending_at(handle.node, handle.len);
        self.add_ref(id);
        self.touch(id);
        Ok(PrefixLock {
            node: id,
            len: handle.len,
            clears: self.clears,
        })
    }

    /// Takes one more lock on what `lock` protects (for a second holder of the same cells).
    pub fn relock(&mut self, lock: &PrefixLock) -> Result<PrefixLock, RadixError> {
        self.relock_to(lock, lock.len)
    }

    /// Takes a lock on the first `len` (at most `lock.len()`) tokens of what `lock` protects.
    pub fn relock_to(&mut self, lock: &PrefixLock, len: usize) -> Result<PrefixLock, RadixError> {
        if lock.clears != self.clears {
            return Err(RadixError::StaleHandle);
        }
        debug_assert!(
            len <= lock.len,
            "a relock protects part of the lock's prefix"
        );
        let id = self.node_ending_at(lock.node, len.min(lock.len));
        self.add_ref(id);
        Ok(PrefixLock {
            node: id,
            len: len.min(lock.len),
            clears: self.clears,
        })
    }

    /// How many leading tokens of `lock`'s prefix reach its deepest cell that `held` accepts
    /// (0 when it accepts none). Changes nothing and allocates nothing.
    pub fn held_len(
        &self,
        lock: &PrefixLock,
        held: impl Fn(u32) -> bool,
    ) -> Result<usize, RadixError> {
        if lock.clears != self.clears {
            return Err(RadixError::StaleHandle);
        }
        let mut id = lock.node;
        while id != ROOT && self.node(id).start >= lock.len {
            id = self.node(id).parent;
        }
        while id != ROOT {
            let n = self.node(id);
            let upto = n.end().min(lock.len) - n.start;
            if let Some(i) = n.cells[..upto].iter().rposition(|&c| held(c)) {
                return Ok(n.start + i + 1);
            }
            id = n.parent;
        }
        Ok(0)
    }

    /// Releases a lock. A lock from before a [`RadixIndex::clear`] is `StaleHandle` (the clear
    /// released it).
    pub fn unlock(&mut self, lock: PrefixLock) -> Result<(), RadixError> {
        if lock.clears != self.clears {
            return Err(RadixError::StaleHandle);
        }
        let mut id = self.node_ending_at(lock.node, lock.len);
        if id != ROOT && self.node(id).refs == 0 {
            return Err(RadixError::NotLocked);
        }
        while id != ROOT {
            let n = self.node_mut(id);
            n.refs -= 1;
            let (len, freed, parent) = (n.tokens.len(), n.refs == 0, n.parent);
            if freed {
                self.protected -= len;
                self.evictable += len;
            }
            id = parent;
        }
        Ok(())
    }

    fn add_ref(&mut self, mut id: u32) {
        while id != ROOT {
            let n = self.node_mut(id);
            n.refs += 1;
            let (len, first, parent) = (n.tokens.len(), n.refs == 1, n.parent);
            if first {
                self.evictable -= len;
                self.protected += len;
            }
            id = parent;
        }
    }

    /// Caches `tokens` (token `i` at position `i`) held by `cells`, and marks the path used.
    /// Returns how many leading tokens were cached already: the index keeps its own cells for
    /// them and `cells[..returned]` stay the caller's.
    pub fn insert_prefix(&mut self, tokens: &[u32], cells: &[u32]) -> Result<usize, RadixError> {
        if tokens.len() != cells.len() {
            return Err(RadixError::LengthMismatch {
                tokens: tokens.len(),
                cells: cells.len(),
            });
        }
        let (id, cached) = self.walk(tokens);
        let mut id = self.node_ending_at(id, cached);
        if cached < tokens.len() {
            let leaf = Node {
                parent: id,
                start: cached,
                tokens: tokens[cached..].to_vec(),
                cells: cells[cached..].to_vec(),
                children: BTreeMap::new(),
                refs: 0,
                last_use: 0,
            };
            self.evictable += leaf.tokens.len();
            let leaf_id = self.alloc(leaf);
            self.node_mut(id).children.insert(tokens[cached], leaf_id);
            id = leaf_id;
        }
        self.touch(id);
        Ok(cached)
    }

    /// Frees at least `n` cells: unlocked leaf edges, least recently used first (a parent
    /// whose last child goes becomes a leaf). Returns the freed cells; `NotEvictable` (and
    /// nothing freed) when `n` exceeds [`RadixIndex::evictable_size`].
    pub fn evict(&mut self, n: usize) -> Result<Vec<u32>, RadixError> {
        if n > self.evictable {
            return Err(RadixError::NotEvictable {
                requested: n,
                evictable: self.evictable,
            });
        }
        let mut freed = Vec::new();
        if n == 0 {
            return Ok(freed);
        }
        let mut heap: BinaryHeap<Reverse<(u64, u32)>> = self
            .nodes
            .iter()
            .enumerate()
            .skip(1)
            .filter_map(|(i, n)| n.as_ref().map(|n| (i as u32, n)))
            .filter(|(_, n)| n.refs == 0 && n.children.is_empty())
            .map(|(i, n)| Reverse((n.last_use, i)))
            .collect();
        while freed.len() < n {
            let Reverse((_, id)) = heap.pop().expect("evictable cells lie in unlocked leaves");
            let node = self.nodes[id as usize].take().expect("a live leaf");
            self.free_slots.push(id);
            self.evictable -= node.tokens.len();
            freed.extend_from_slice(&node.cells);
            let parent = self.node_mut(node.parent);
            parent.children.remove(&node.tokens[0]);
            if node.parent != ROOT && parent.refs == 0 && parent.children.is_empty() {
                heap.push(Reverse((parent.last_use, node.parent)));
            }
        }
        self.epoch += 1;
        Ok(freed)
    }

    /// Forgets everything; every handle and lock expires.
    pub fn clear(&mut self) {
        self.nodes.clear();
        self.nodes.push(Some(Self::root()));
        self.free_slots.clear();
        self.evictable = 0;
        self.protected = 0;
        self.epoch += 1;
        self.clears += 1;
    }
}

#[cfg(test)]
mod tests;
