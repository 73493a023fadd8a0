//! The attention steps the criterion benches and `examples/step_ratios` time: one layer of
//! Hq 32, Hkv 8, D 128 in a kit cache on the cpu backend, filled with the same inputs.

use std::hint::black_box;
use std::sync::Arc;

use kvplug_backend_kit::KitCache;
use kvplug_core::{
    make_config, Arithmetic, CacheConfig, CacheKind, CacheVerbs, KvDtype, ModelCacheParams,
    PosRange,
};
use kvplug_cpu::tensor::CpuTensor;
use kvplug_cpu::CpuDevice;

pub const HQ: usize = 32;
pub const HKV: usize = 8;
pub const D: usize = 128;

/// The context length of the fork and tree steps (the shared trunk, the committed rows):
/// issue 64's goals are set at this depth.
pub const STEP_CONTEXT: usize = 4096;

/// The parents of the tree verify's 16 nodes: a binary tree of depth 4 under the root.
pub const TREE: [i32; 16] = [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7];

fn config(capacity: usize, dtype: KvDtype) -> CacheConfig {
    make_config(
        &ModelCacheParams {
            n_layers: 1,
            n_kv_heads: HKV,
            head_dim: D,
        },
        capacity,
        dtype,
    )
}

fn tensor(h: usize, t: usize, salt: f32) -> CpuTensor {
    CpuTensor::new(
        &[h, t, D],
        (0..h * t * D)
            .map(|i| ((i as f32 + salt) * 0.0131).sin())
            .collect(),
    )
}

/// One call's query, keys, values and output for `t` tokens.
pub struct Io {
    q: CpuTensor,
    k: CpuTensor,
    v: CpuTensor,
    out: CpuTensor,
}

impl Io {
    pub fn new(t: usize) -> Self {
        Io {
            q: tensor(HQ, t, 1.0),
            k: tensor(HKV, t, 2.0),
            v: tensor(HKV, t, 3.0),
            out: CpuTensor::zeros(&[HQ, t, D]),
        }
    }

    /// `update_and_attend` of layer 0 at `positions`.
    pub fn step(&mut self, c: &mut KitCache<CpuDevice>, positions: &[i32]) {
        c.update_and_attend(
            0,
            &self.q,
            &self.k,
            &self.v,
            positions,
            1.0 / (D as f32).sqrt(),
            &mut self.out,
        )
        .unwrap();
        black_box(&self.out);
    }
}

pub fn cache(kind: CacheKind, capacity: usize, dtype: KvDtype) -> KitCache<CpuDevice> {
    KitCache::new(Arc::new(CpuDevice::new()), kind, config(capacity, dtype)).unwrap()
}

/// A cache of `kind` (capacity 32768) holding `len` tokens of sequence 0, prefilled 512 at a
/// time.
pub fn filled(kind: CacheKind, len: usize, dtype: KvDtype) -> KitCache<CpuDevice> {
    let mut c = cache(kind, 32768, dtype);
    let mut chunk = Io::new(512);
    for start in (0..len).step_by(512) {
        let n = 512.min(len - start);
        if n < 512 {
            chunk = Io::new(n);
        }
        let pos: Vec<i32> = (start as i32..(start + n) as i32).collect();
        chunk.step(&mut c, &pos);
    }
    c
}

/// The arithmetics the fork and tree steps run a cache in, with the names they go by:
/// its default (named by the dtype), then int8-query-i16-values where it has it.
pub fn step_arithmetics(c: &KitCache<CpuDevice>, dtype: KvDtype) -> Vec<(Arithmetic, String)> {
    let i16 = Arithmetic::Int8QueryI16Values;
    let mut runs = vec![(c.arithmetic(), dtype.to_string())];
    if c.arithmetics().contains(&i16) {
        runs.push((i16, format!("{dtype}+{i16}")));
    }
    runs
}

/// Branches 1 to 4 of a seq cache sharing a [`STEP_CONTEXT`]-token trunk.
pub struct Fork {
    pub cache: KitCache<CpuDevice>,
    io: [Io; 4],
}

impl Fork {
    pub fn new(dtype: KvDtype) -> Self {
        let mut cache = filled(CacheKind::Seq, STEP_CONTEXT, dtype);
        for b in 1..=4 {
            cache.seq_cp(0, b, PosRange::ALL).unwrap();
        }
        Fork {
            cache,
            io: std::array::from_fn(|i| Io::new(i + 1)),
        }
    }

    /// One decode step for branches `1..=n` (`n` ≤ 4), then their new token removed.
    pub fn step(&mut self, n: usize) {
        const SEQS: [i32; 4] = [1, 2, 3, 4];
        const AT: i32 = STEP_CONTEXT as i32;
        self.cache.begin_step(&SEQS[..n]).unwrap();
        self.io[n - 1].step(&mut self.cache, &[AT; 4][..n]);
        for &s in &SEQS[..n] {
            self.cache.seq_rm(s, PosRange::new(Some(AT), None)).unwrap();
        }
    }
}

/// A tree cache holding [`STEP_CONTEXT`] committed tokens, and a contiguous one holding one
/// more (the decode step's token, rewound before each step).
pub struct Tree {
    pub tree: KitCache<CpuDevice>,
    pub line: KitCache<CpuDevice>,
    nodes: Io,
    one: Io,
    positions: Vec<i32>,
}

impl Tree {
    pub fn new(dtype: KvDtype) -> Self {
        let depth = |mut n: usize| {
            let mut d = 0;
            while TREE[n] >= 0 {
                n = TREE[n] as usize;
                d += 1;
            }
            d
        };
        Tree {
            tree: filled(CacheKind::Tree, STEP_CONTEXT, dtype),
            line: filled(CacheKind::Contiguous, STEP_CONTEXT + 1, dtype),
            nodes: Io::new(TREE.len()),
            one: Io::new(1),
            positions: (0..TREE.len())
                .map(|n| (STEP_CONTEXT + depth(n)) as i32)
                .collect(),
        }
    }

    /// Both caches in `arithmetic`.
    pub fn set_arithmetic(&mut self, arithmetic: Arithmetic) {
        self.tree.set_arithmetic(arithmetic).unwrap();
        self.line.set_arithmetic(arithmetic).unwrap();
    }

    /// A verify of the [`TREE`]'s nodes, none committed.
    pub fn verify(&mut self) {
        self.tree.propose(&TREE).unwrap();
        self.nodes.step(&mut self.tree, &self.positions);
        self.tree.commit(&[]).unwrap();
    }

    /// One decode step on the contiguous cache, then its token removed.
    pub fn decode(&mut self) {
        self.line.rewind(STEP_CONTEXT).unwrap();
        self.one.step(&mut self.line, &[STEP_CONTEXT as i32]);
    }
}
