//! [`RefCache`]: one reference cache for every kind, on top of core's bookkeeping.

use crate::config::CacheConfig;
use crate::dtype::KvDtype;
use crate::error::{CacheError, CacheResult};
use crate::kind::{Bookkeeping, CacheKind, CacheVerbs};
use crate::plan::MaskKind;
use crate::quant::quant_round_trip;
use crate::rounding::{round_bf16, round_f16, round_f32};

use super::attention::{attend, AttnDims, RefMask};

/// What a pool of `dtype` returns for `row` after storing it.
pub fn store_rounded(dtype: KvDtype, row: &[f64]) -> Vec<f64> {
    match dtype {
        KvDtype::F32 => row.iter().map(|&x| round_f32(x)).collect(),
        KvDtype::F16 => row.iter().map(|&x| round_f16(x)).collect(),
        KvDtype::Bf16 => row.iter().map(|&x| round_bf16(x)).collect(),
        KvDtype::Q8 { group } => quant_round_trip(row, 8, group),
        KvDtype::Q4 { group } => quant_round_trip(row, 4, group),
    }
}

/// A reference cache: bookkeeping plus per-layer K/V as f64 `[n_kv_heads][capacity][head_dim]`.
#[derive(Clone, Debug)]
pub struct RefCache {
    cfg: CacheConfig,
    book: Bookkeeping,
    k: Vec<Vec<f64>>,
    v: Vec<Vec<f64>>,
}

impl RefCache {
    /// Builds an empty cache; `bad_config` when `cfg` is invalid.
    pub fn new(kind: CacheKind, cfg: CacheConfig) -> CacheResult<Self> {
        cfg.validate()?;
        let size = cfg.n_kv_heads * cfg.capacity * cfg.head_dim;
        Ok(RefCache {
            cfg,
            book: Bookkeeping::new(kind, cfg.capacity),
            k: vec![vec![0.0; size]; cfg.n_layers],
            v: vec![vec![0.0; size]; cfg.n_layers],
        })
    }

    /// The configuration.
    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    /// Writes this step's k/v for `layer` and attends. q is `[n_q_heads, T, D]` (the head
    /// count follows from its length), k and v `[n_kv_heads, T, D]`, all row-major; the
    /// result is `[n_q_heads, T, D]`.
    pub fn update_and_attend(
        &mut self,
        layer: usize,
        q: &[f64],
        k: &[f64],
        v: &[f64],
        positions: &[i32],
        scale: f64,
    ) -> CacheResult<Vec<f64>> {
        let (hkv, d, cap) = (self.cfg.n_kv_heads, self.cfg.head_dim, self.cfg.capacity);
        let t = positions.len();
        let n_q_heads = if t == 0 { 0 } else { q.len() / (t * d) };
        if layer >= self.cfg.n_layers {
            return Err(CacheError::bad_shape(format!(
                "layer {layer} is outside 0..{}",
                self.cfg.n_layers
            )));
        }
        if n_q_heads == 0 || n_q_heads % hkv != 0 {
            return Err(CacheError::bad_shape(format!(
                "{n_q_heads} query heads are not a multiple of {hkv} KV heads"
            )));
        }
        if q.len() != n_q_heads * t * d || k.len() != hkv * t * d || v.len() != hkv * t * d {
            return Err(CacheError::bad_shape(format!(
                "q/k/v lengths {}/{}/{} do not match {t} tokens",
                q.len(),
                k.len(),
                v.len()
            )));
        }
        let plan = self.book.plan_layer(layer, positions)?.clone();
        for h in 0..hkv {
            for i in 0..t {
                let dst = (h * cap + plan.cell_of(i)) * d;
                let src = (h * t + i) * d;
                let krow = store_rounded(self.cfg.kv_dtype, &k[src..src + d]);
                let vrow = store_rounded(self.cfg.kv_dtype, &v[src..src + d]);
                self.k[layer][dst..dst + d].copy_from_slice(&krow);
                self.v[layer][dst..dst + d].copy_from_slice(&vrow);
            }
        }
        let l = plan.read_len;
        let window = |pool: &[f64]| -> Vec<f64> {
            (0..hkv)
                .flat_map(|h| pool[h * cap * d..(h * cap + l) * d].iter().copied())
                .collect()
        };
        let mask = match plan.mask {
            MaskKind::None => RefMask::None,
            MaskKind::Causal => RefMask::Causal,
            MaskKind::Explicit => RefMask::Explicit(&plan.mask_bits),
        };
        let dims = AttnDims {
            n_q_heads,
            n_kv_heads: hkv,
            n_tok: t,
            read_len: l,
            head_dim: d,
        };
        Ok(attend(
            dims,
            q,
            &window(&self.k[layer]),
            &window(&self.v[layer]),
            scale,
            mask,
        ))
    }
}

impl CacheVerbs for RefCache {
    fn bookkeeping(&self) -> &Bookkeeping {
        &self.book
    }
    fn bookkeeping_mut(&mut self) -> &mut Bookkeeping {
        &mut self.book
    }
    fn move_rows(&mut self, base: usize, rows: &[u32]) {
        let (hkv, d, cap) = (self.cfg.n_kv_heads, self.cfg.head_dim, self.cfg.capacity);
        for pool in self.k.iter_mut().chain(self.v.iter_mut()) {
            for h in 0..hkv {
                for (i, &src) in rows.iter().enumerate() {
                    let (s, t) = ((h * cap + src as usize) * d, (h * cap + base + i) * d);
                    pool.copy_within(s..s + d, t);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CacheConfig;
    use crate::error::ErrorKind;
    use crate::seq::PosRange;

    fn cfg(kv_dtype: KvDtype) -> CacheConfig {
        CacheConfig {
            capacity: 16,
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: 4,
            min_chunk: 4,
            kv_dtype,
        }
    }

    /// Deterministic rows that differ per token.
    fn rows(t: usize, salt: f64) -> Vec<f64> {
        (0..t * 4)
            .map(|i| ((i as f64 + salt) * 0.37).sin())
            .collect()
    }

    #[test]
    fn seq_fork_matches_running_each_branch_alone() {
        // Trunk of 3 tokens, two branches forked by seq_cp, decoded in one step.
        let mut fork = RefCache::new(CacheKind::Seq, cfg(KvDtype::F32)).unwrap();
        fork.update_and_attend(
            0,
            &rows(3, 0.0),
            &rows(3, 1.0),
            &rows(3, 2.0),
            &[0, 1, 2],
            0.5,
        )
        .unwrap();
        fork.seq_cp(0, 1, PosRange::ALL).unwrap();
        fork.begin_step(&[0, 1]).unwrap();
        let q = rows(2, 7.0);
        let (k, v) = (rows(2, 8.0), rows(2, 9.0));
        let both = fork.update_and_attend(0, &q, &k, &v, &[3, 3], 0.5).unwrap();
        for b in 0..2 {
            let mut alone = RefCache::new(CacheKind::Contiguous, cfg(KvDtype::F32)).unwrap();
            alone
                .update_and_attend(
                    0,
                    &rows(3, 0.0),
                    &rows(3, 1.0),
                    &rows(3, 2.0),
                    &[0, 1, 2],
                    0.5,
                )
                .unwrap();
            let r = b * 4..b * 4 + 4;
            let out = alone
                .update_and_attend(0, &q[r.clone()], &k[r.clone()], &v[r.clone()], &[3], 0.5)
                .unwrap();
            assert_eq!(out, both[r]);
        }
    }

    #[test]
    fn tree_commit_moves_accepted_rows() {
        let mut tree = RefCache::new(CacheKind::Tree, cfg(KvDtype::F32)).unwrap();
        tree.update_and_attend(0, &rows(2, 0.0), &rows(2, 1.0), &rows(2, 2.0), &[0, 1], 1.0)
            .unwrap();
        tree.propose(&[-1, -1, 1]).unwrap();
        let (k, v) = (rows(3, 3.0), rows(3, 4.0));
        tree.update_and_attend(0, &rows(3, 5.0), &k, &v, &[2, 2, 3], 1.0)
            .unwrap();
        tree.commit(&[1, 2]).unwrap();
        // After the commit, cells 2 and 3 hold nodes 1 and 2 (rounded as f32).
        let q = rows(1, 6.0);
        let out = tree
            .update_and_attend(0, &q, &rows(1, 7.0), &rows(1, 8.0), &[4], 1.0)
            .unwrap();
        let mut seq = RefCache::new(CacheKind::Contiguous, cfg(KvDtype::F32)).unwrap();
        seq.update_and_attend(0, &rows(2, 0.0), &rows(2, 1.0), &rows(2, 2.0), &[0, 1], 1.0)
            .unwrap();
        seq.update_and_attend(0, &rows(2, 5.0), &k[4..], &v[4..], &[2, 3], 1.0)
            .unwrap();
        let expect = seq
            .update_and_attend(0, &q, &rows(1, 7.0), &rows(1, 8.0), &[4], 1.0)
            .unwrap();
        assert_eq!(out, expect);
    }

    #[test]
    fn quantized_storage_is_what_is_attended() {
        let mut c = RefCache::new(CacheKind::Contiguous, cfg(KvDtype::Q4 { group: 4 })).unwrap();
        let v = vec![0.1, -0.7, 0.35, 0.9];
        let out = c
            .update_and_attend(0, &[0.0; 4], &[0.2; 4], &v, &[0], 1.0)
            .unwrap();
        assert_eq!(out, quant_round_trip(&v, 4, 4));
        assert_ne!(out, v);
    }

    #[test]
    fn bad_inputs_are_refused_without_change() {
        let mut c = RefCache::new(CacheKind::Contiguous, cfg(KvDtype::F16)).unwrap();
        let e = c.update_and_attend(0, &[0.0; 4], &[0.0; 8], &[0.0; 4], &[0], 1.0);
        assert_eq!(e.unwrap_err().kind, ErrorKind::BadShape);
        let e = c.update_and_attend(1, &[0.0; 4], &[0.0; 4], &[0.0; 4], &[0], 1.0);
        assert_eq!(e.unwrap_err().kind, ErrorKind::BadShape);
        let e = c.update_and_attend(0, &[], &[0.0; 4], &[0.0; 4], &[0], 1.0);
        assert_eq!(e.unwrap_err().kind, ErrorKind::BadShape);
        assert_eq!(c.bookkeeping().high_water(), 0);
        assert_eq!(c.seq_len(0).unwrap_err().kind, ErrorKind::NotSupported);
        assert_eq!(
            RefCache::new(CacheKind::Seq, cfg(KvDtype::Q8_DEFAULT))
                .unwrap_err()
                .kind,
            ErrorKind::BadConfig
        );
    }
}
