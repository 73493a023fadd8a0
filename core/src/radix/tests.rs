//! Unit tests of the prefix index, and a property test against a brute-force model.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

#[test]
fn shared_prefixes_split_edges_and_match_exactly() {
    let mut ix = RadixIndex::new();
    assert_eq!(ix.insert_prefix(&[1, 2, 3, 4], &[10, 11, 12, 13]), Ok(0));
    assert_eq!(ix.insert_prefix(&[1, 2, 9], &[20, 21, 22]), Ok(2));
    let (h, cells) = ix.match_prefix(&[1, 2, 9, 7]);
    assert_eq!((h.len(), cells), (3, vec![10, 11, 22]));
    let (h, cells) = ix.match_prefix(&[1, 2, 3, 5]);
    assert_eq!((h.len(), cells), (3, vec![10, 11, 12]));
    assert_eq!(ix.match_prefix(&[7]).0.len(), 0);
    assert_eq!((ix.total_size(), ix.evictable_size()), (5, 5));
}

#[test]
fn locks_protect_exactly_the_matched_tokens() {
    let mut ix = RadixIndex::new();
    ix.insert_prefix(&[1, 2, 3, 4], &[0, 1, 2, 3]).unwrap();
    let (h, _) = ix.match_prefix(&[1, 2, 8]);
    let lock = ix.lock(&h).unwrap();
    assert_eq!((ix.protected_size(), ix.evictable_size()), (2, 2));
    assert_eq!(
        ix.evict(3),
        Err(RadixError::NotEvictable {
            requested: 3,
            evictable: 2
        })
    );
    assert_eq!(ix.evict(1), Ok(vec![2, 3]));
    ix.unlock(lock.clone()).unwrap();
    assert_eq!(ix.unlock(lock), Err(RadixError::NotLocked));
    assert_eq!((ix.protected_size(), ix.evictable_size()), (0, 2));
    assert_eq!(ix.evict(0), Ok(vec![]));
    assert_eq!(ix.evict(2), Ok(vec![0, 1]));
    assert_eq!(ix.total_size(), 0);
}

#[test]
fn eviction_takes_the_least_recently_used_leaf_first() {
    let mut ix = RadixIndex::new();
    ix.insert_prefix(&[1, 2], &[0, 1]).unwrap();
    ix.insert_prefix(&[1, 3], &[0, 2]).unwrap();
    ix.insert_prefix(&[4], &[3]).unwrap();
    let (h, _) = ix.match_prefix(&[1, 2]);
    let lock = ix.lock(&h).unwrap();
    ix.unlock(lock).unwrap();
    // [1,3] and [4] are older than [1,2]; [1,3] is the oldest.
    assert_eq!(ix.evict(1), Ok(vec![2]));
    assert_eq!(ix.evict(1), Ok(vec![3]));
    // [1] becomes a leaf only after [1,2] goes.
    assert_eq!(ix.evict(2), Ok(vec![1, 0]));
}

#[test]
fn handles_expire_on_eviction_and_locks_on_clear() {
    let mut ix = RadixIndex::new();
    ix.insert_prefix(&[1, 2], &[0, 1]).unwrap();
    ix.insert_prefix(&[3], &[2]).unwrap();
    let (h, _) = ix.match_prefix(&[1, 2]);
    ix.evict(1).unwrap();
    assert_eq!(ix.lock(&h), Err(RadixError::StaleHandle));
    let (h, _) = ix.match_prefix(&[3]);
    let lock = ix.lock(&h).unwrap();
    ix.clear();
    assert_eq!(ix.unlock(lock), Err(RadixError::StaleHandle));
    assert_eq!((ix.total_size(), ix.protected_size()), (0, 0));
    assert_eq!(
        ix.insert_prefix(&[1], &[]),
        Err(RadixError::LengthMismatch {
            tokens: 1,
            cells: 0
        })
    );
}

/// The brute-force model: every cached prefix (as its token string) with the cell of its
/// last token and its last use; locks as the token strings they protect.
#[derive(Default)]
struct Model {
    keys: BTreeMap<Vec<u32>, (u32, u64)>,
    clock: u64,
}

impl Model {
    fn matched(&self, tokens: &[u32]) -> Vec<u32> {
        (1..=tokens.len())
            .map_while(|k| self.keys.get(&tokens[..k]).map(|e| e.0))
            .collect()
    }

    fn touch(&mut self, path: &[u32]) {
        self.clock += 1;
        for k in 1..=path.len() {
            if let Some(e) = self.keys.get_mut(&path[..k]) {
                e.1 = self.clock;
            }
        }
    }

    fn protected(&self, locks: &[(PrefixLock, Vec<u32>)]) -> Vec<Vec<u32>> {
        self.keys
            .keys()
            .filter(|k| locks.iter().any(|(_, p)| p.starts_with(k)))
            .cloned()
            .collect()
    }
}

#[derive(Clone, Debug)]
enum Op {
    Insert(Vec<u32>),
    Lock(Vec<u32>),
    Relock(usize),
    Unlock(usize),
    Evict(usize),
    StaleLock(Vec<u32>, usize),
    Clear,
}

fn tokens() -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(0u32..3, 0..10)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => tokens().prop_map(Op::Insert),
        3 => tokens().prop_map(Op::Lock),
        1 => any::<usize>().prop_map(Op::Relock),
        2 => any::<usize>().prop_map(Op::Unlock),
        3 => (0usize..12).prop_map(Op::Evict),
        1 => (tokens(), 1usize..4).prop_map(|(t, n)| Op::StaleLock(t, n)),
        1 => Just(Op::Clear),
    ]
}

fn check_evict(ix: &mut RadixIndex, m: &mut Model, locks: &[(PrefixLock, Vec<u32>)], n: usize) {
    let protected = m.protected(locks);
    let evictable = m.keys.len() - protected.len();
    let Ok(freed) = ix.evict(n) else {
        assert!(
            n > evictable,
            "evict({n}) refused with {evictable} evictable"
        );
        return;
    };
    assert!(
        n <= evictable && freed.len() >= n,
        "evict({n}) freed {}",
        freed.len()
    );
    let mut freed_ticks = Vec::new();
    for cell in &freed {
        let key = m
            .keys
            .iter()
            .find(|(_, e)| e.0 == *cell)
            .map(|(k, _)| k.clone())
            .expect("freed cells were cached");
        assert!(
            !protected.contains(&key),
            "evicted protected prefix {key:?}"
        );
        freed_ticks.push(m.keys.remove(&key).unwrap().1);
    }
    // Prefix-closed after eviction, and LRU: nothing evicted is newer than an evictable leaf.
    for k in m.keys.keys() {
        assert!(k.len() == 1 || m.keys.contains_key(&k[..k.len() - 1]));
    }
    let newest_freed = freed_ticks.iter().copied().max().unwrap_or(0);
    for (k, e) in &m.keys {
        let leaf = !m
            .keys
            .keys()
            .any(|o| o.len() == k.len() + 1 && o.starts_with(k));
        if leaf && !protected.contains(k) {
            assert!(
                e.1 >= newest_freed,
                "evicted a newer prefix than leaf {k:?}"
            );
        }
    }
}

fn run(ops: Vec<Op>) {
    let mut ix = RadixIndex::new();
    let mut m = Model::default();
    let mut locks: Vec<(PrefixLock, Vec<u32>)> = Vec::new();
    let mut next_cell = 0u32;
    for op in ops {
        match op {
            Op::Insert(t) => {
                let cells: Vec<u32> = (next_cell..next_cell + t.len() as u32).collect();
                next_cell += t.len() as u32;
                let cached = m.matched(&t).len();
                assert_eq!(ix.insert_prefix(&t, &cells), Ok(cached));
                for k in cached..t.len() {
                    m.keys.insert(t[..=k].to_vec(), (cells[k], 0));
                }
                m.touch(&t);
            }
            Op::Lock(t) => {
                let (h, cells) = ix.match_prefix(&t);
                assert_eq!(cells, m.matched(&t));
                let path = t[..h.len()].to_vec();
                locks.push((ix.lock(&h).unwrap(), path.clone()));
                m.touch(&path);
            }
            Op::Relock(i) if !locks.is_empty() => {
                let i = i % locks.len();
                let again = ix.relock(&locks[i].0).unwrap();
                let path = locks[i].1.clone();
                locks.push((again, path));
            }
            Op::Unlock(i) if !locks.is_empty() => {
                let (lock, _) = locks.swap_remove(i % locks.len());
                ix.unlock(lock).unwrap();
            }
            Op::Relock(_) | Op::Unlock(_) => {}
            Op::Evict(n) => check_evict(&mut ix, &mut m, &locks, n),
            Op::StaleLock(t, n) => {
                let (h, _) = ix.match_prefix(&t);
                let evictable = m.keys.len() - m.protected(&locks).len();
                check_evict(&mut ix, &mut m, &locks, n);
                if n <= evictable {
                    assert_eq!(ix.lock(&h), Err(RadixError::StaleHandle));
                }
            }
            Op::Clear => {
                ix.clear();
                m.keys.clear();
                for (lock, _) in locks.drain(..) {
                    assert_eq!(ix.unlock(lock), Err(RadixError::StaleHandle));
                }
            }
        }
        let protected = m.protected(&locks).len();
        assert_eq!(ix.total_size(), m.keys.len());
        assert_eq!(ix.protected_size(), protected);
        assert_eq!(ix.evictable_size(), m.keys.len() - protected);
        for k in m.keys.keys() {
            assert_eq!(ix.match_prefix(k).1, m.matched(k), "match of {k:?}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

    /// Matches, sizes, protection and LRU eviction agree with the brute-force model over
    /// 10,000 random operation sequences.
    #[test]
    fn index_agrees_with_brute_force(ops in prop::collection::vec(op(), 1..40)) {
        run(ops);
    }
}
