//! Seed 004's in-process face: a per-layer [`KeyValueCache`] (`offset`, `max_size`,
//! `update_and_fetch`) for Rust code that links a backend as a library and runs its own
//! attention over the returned history, as OminiX-MLX's models do. No plugin, no host.
//!
//! [`ContiguousKv`] is the kit's contiguous cache for one layer: the same device pools as
//! [`crate::KitCache`], grown the same way (lazy doubling from `min_chunk` up to `capacity`,
//! [`CacheConfig::grown_cells`]), written in place ([`Device::write_run`]); `update_and_fetch`
//! returns borrowed [`PoolView`]s of the occupied rows, never a copy of the history (the
//! seed's concatenating cache copies all of it per token, its step-256 cache once per 256).

use std::sync::Arc;

use kvplug_core::limits::check_memory;
use kvplug_core::{CacheConfig, CacheError};

use crate::cache::KitError;
use crate::device::Device;

/// A per-layer KV cache that hands back the whole history (seed 004's trait).
pub trait KeyValueCache {
    /// What is appended: `[n_kv_heads, T, head_dim]`.
    type Tensor;
    /// A view of the history.
    type View<'a>
    where
        Self: 'a;
    /// Tokens held.
    fn offset(&self) -> usize;
    /// The window of a sliding cache; `None` for a cache that keeps everything.
    fn max_size(&self) -> Option<usize>;
    /// Appends `keys` and `values` (same shape) and returns views of all `offset()` rows
    /// (K, V). Refused, with the cache unchanged, for a bad shape or beyond the capacity.
    #[allow(clippy::type_complexity)]
    fn update_and_fetch(
        &mut self,
        keys: &Self::Tensor,
        values: &Self::Tensor,
    ) -> Result<(Self::View<'_>, Self::View<'_>), KitError>;
}

/// Rows `[0, len)` of every head of `pool`, borrowed from the cache (the backend's pool type
/// says how to read them, e.g. `kvplug_cpu::CpuPool::head_rows`).
#[derive(Clone, Copy, Debug)]
pub struct PoolView<'a, P> {
    /// The pool; rows from `len` on are not part of the history.
    pub pool: &'a P,
    /// Rows of history per head.
    pub len: usize,
}

/// One layer's contiguous cache on device `D` (see the module docs).
pub struct ContiguousKv<D: Device> {
    device: Arc<D>,
    cfg: CacheConfig,
    k: D::Pool,
    v: D::Pool,
    cells: usize,
    len: usize,
}

impl<D: Device> ContiguousKv<D> {
    /// An empty cache with `cfg`'s heads, head_dim, dtype, `min_chunk` and `capacity` (its
    /// layer fields are ignored: this is one layer, attending fully).
    pub fn new(device: Arc<D>, cfg: CacheConfig) -> Result<Self, KitError> {
        let cfg = CacheConfig {
            n_layers: 1,
            sliding: None,
            conv: None,
            delta: None,
            ssm: None,
            ..cfg
        };
        cfg.validate()?;
        let cells = cfg.first_chunk();
        check_memory("the first K/V pools", cfg.pools_bytes(cells))?;
        let pool = || device.pool_new(cfg.kv_dtype, cfg.n_kv_heads, cfg.head_dim, cells);
        let (k, v) = (pool()?, pool()?);
        Ok(ContiguousKv {
            device,
            cfg,
            k,
            v,
            cells,
            len: 0,
        })
    }

    /// Bytes of the K and V pools (what the cache holds, used or not).
    pub fn bytes(&self) -> usize {
        self.device.pool_bytes(&self.k) + self.device.pool_bytes(&self.v)
    }

    /// Forgets the history (keeps the pools).
    pub fn clear(&mut self) {
        self.len = 0;
    }
}

impl<D: Device> KeyValueCache for ContiguousKv<D> {
    type Tensor = D::Tensor;
    type View<'a>
        = PoolView<'a, D::Pool>
    where
        D: 'a;

    fn offset(&self) -> usize {
        self.len
    }

    fn max_size(&self) -> Option<usize> {
        None
    }

    fn update_and_fetch(
        &mut self,
        keys: &D::Tensor,
        values: &D::Tensor,
    ) -> Result<(Self::View<'_>, Self::View<'_>), KitError> {
        let (h, d) = (self.cfg.n_kv_heads, self.cfg.head_dim);
        let dims = self.device.dims(keys);
        let t = dims.get(1).copied().unwrap_or(0);
        if dims != [h, t, d] || self.device.dims(values) != dims || t == 0 {
            return Err(CacheError::bad_shape(format!(
                "keys and values must both be [{h}, T >= 1, {d}]; got {dims:?} and {:?}",
                self.device.dims(values)
            ))
            .into());
        }
        let need = self.len + t;
        if need > self.cfg.capacity {
            return Err(CacheError::capacity(format!(
                "{t} more tokens after {} exceed the capacity {}",
                self.len, self.cfg.capacity
            ))
            .into());
        }
        if need > self.cells {
            let cells = self.cfg.grown_cells(self.cells, need);
            check_memory(
                &format!("growing the K/V pools to {cells} cells"),
                self.cfg.pools_bytes(cells - self.cells),
            )?;
            self.device.pool_grow(&mut self.k, cells, self.len)?;
            self.device.pool_grow(&mut self.v, cells, self.len)?;
            self.cells = cells;
        }
        self.device
            .write_kv_run(&mut self.k, &mut self.v, self.len, keys, values)?;
        self.len = need;
        let view = |pool| PoolView { pool, len: need };
        Ok((view(&self.k), view(&self.v)))
    }
}
