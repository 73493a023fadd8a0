//! [`KitCache`]: the Pool policy and the three cache kinds, written once over [`Device`].

use std::sync::Arc;

use kvplug_core::{
    Bookkeeping, CacheConfig, CacheError, CacheKind, CacheVerbs, MaskKind, PlanKind,
};
use kvplug_plugin_api::{AbiErrorKind, PluginError};

use crate::device::{AttendMask, Device};

/// A refused call (cache error, input unchanged) or a device failure.
#[derive(Debug, thiserror::Error)]
pub enum KitError {
    /// Bad input; the cache is unchanged.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// The device or its runtime failed.
    #[error("device: {0}")]
    Device(String),
}

impl From<KitError> for PluginError {
    fn from(e: KitError) -> Self {
        match e {
            KitError::Cache(c) => c.into(),
            KitError::Device(m) => PluginError::new(AbiErrorKind::Backend, m),
        }
    }
}

/// Memory and last-step statistics of a [`KitCache`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KitStats {
    /// Bytes of every layer's K and V pools.
    pub allocated_bytes: usize,
    /// Rows per head each pool has room for.
    pub pool_cells: usize,
    /// Cells holding data.
    pub live_cells: usize,
    /// One past the highest cell holding data.
    pub high_water: usize,
    /// The read path of the last planned step.
    pub last_plan: Option<PlanKind>,
}

/// A KV cache of any kind on device `D`: core's bookkeeping plus one K and one V pool per
/// layer. Pools start at `min_chunk` cells and double on demand up to `capacity`; reads
/// cover only the occupied window; writes are in place.
pub struct KitCache<D: Device> {
    device: Arc<D>,
    cfg: CacheConfig,
    book: Bookkeeping,
    k: Vec<D::Pool>,
    v: Vec<D::Pool>,
    pool_cells: usize,
    last_plan: Option<PlanKind>,
    scratch: D::Scratch,
}

impl<D: Device> KitCache<D> {
    /// An empty cache; `bad_config` for an invalid config or a dtype the device lacks.
    pub fn new(device: Arc<D>, kind: CacheKind, cfg: CacheConfig) -> Result<Self, KitError> {
        cfg.validate()?;
        if !device
            .kv_dtypes()
            .iter()
            .any(|d| d.family() == cfg.kv_dtype.family())
        {
            return Err(CacheError::bad_config(format!(
                "this device has no {} pools",
                cfg.kv_dtype
            ))
            .into());
        }
        let cells = cfg.first_chunk();
        let mut pools = Vec::with_capacity(2 * cfg.n_layers);
        for _ in 0..2 * cfg.n_layers {
            pools.push(device.pool_new(cfg.kv_dtype, cfg.n_kv_heads, cfg.head_dim, cells)?);
        }
        let v = pools.split_off(cfg.n_layers);
        let mut book = Bookkeeping::new(kind, cfg.capacity);
        book.reserve(cells);
        tracing::debug!(kind = kind.as_str(), cells, dtype = %cfg.kv_dtype, "cache created");
        Ok(KitCache {
            device,
            cfg,
            book,
            k: pools,
            v,
            pool_cells: cells,
            last_plan: None,
            scratch: D::Scratch::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    /// The device.
    pub fn device(&self) -> &Arc<D> {
        &self.device
    }

    /// Memory and last-step statistics.
    pub fn stats(&self) -> KitStats {
        KitStats {
            allocated_bytes: self
                .k
                .iter()
                .chain(&self.v)
                .map(|p| self.device.pool_bytes(p))
                .sum(),
            pool_cells: self.pool_cells,
            live_cells: self.book.live_cells(),
            high_water: self.book.high_water(),
            last_plan: self.last_plan,
        }
    }

    /// The op: writes `k`/`v` (`[Hkv, T, D]`) for `layer` at `positions`, then attends `q`
    /// (`[Hq, T, D]`) into `out` (`[Hq, T, D]`) with the plan's mask. A step starts at
    /// layer 0. Shapes are checked before the bookkeeping is touched.
    #[allow(clippy::too_many_arguments)]
    pub fn update_and_attend(
        &mut self,
        layer: usize,
        q: &D::Tensor,
        k: &D::Tensor,
        v: &D::Tensor,
        positions: &[i32],
        scale: f32,
        out: &mut D::Tensor,
    ) -> Result<(), KitError> {
        self.check_shapes(layer, q, k, v, positions.len(), out)?;
        let KitCache {
            device,
            cfg,
            book,
            k: kpools,
            v: vpools,
            pool_cells,
            last_plan,
            scratch,
        } = self;
        let plan = book.plan_layer(layer, positions)?;
        if plan.read_len > *pool_cells {
            let cells = cfg.grown_cells(*pool_cells, plan.read_len);
            let _span = tracing::debug_span!("pool_grow", from = *pool_cells, to = cells).entered();
            for pool in kpools.iter_mut().chain(vpools.iter_mut()) {
                device.pool_grow(pool, cells, *pool_cells)?;
            }
            tracing::debug!(from = *pool_cells, to = cells, "pools grown");
            *pool_cells = cells;
        }
        let (kp, vp) = (&mut kpools[layer], &mut vpools[layer]);
        match plan.write_start {
            Some(start) => {
                device.write_run(kp, start, k)?;
                device.write_run(vp, start, v)?;
            }
            None => {
                device.scatter_rows(kp, &plan.write_cells, k)?;
                device.scatter_rows(vp, &plan.write_cells, v)?;
            }
        }
        let mask = match plan.mask {
            MaskKind::None => AttendMask::None,
            MaskKind::Causal => AttendMask::Causal,
            MaskKind::Explicit => AttendMask::Explicit(&plan.mask_bits),
        };
        *last_plan = Some(plan.kind());
        device.attend(q, kp, vp, plan.read_len, mask, scale, out, scratch)
    }

    fn check_shapes(
        &self,
        layer: usize,
        q: &D::Tensor,
        k: &D::Tensor,
        v: &D::Tensor,
        t: usize,
        out: &D::Tensor,
    ) -> Result<(), CacheError> {
        let (hkv, d) = (self.cfg.n_kv_heads, self.cfg.head_dim);
        if layer >= self.cfg.n_layers {
            return Err(CacheError::bad_shape(format!(
                "layer {layer} is outside 0..{}",
                self.cfg.n_layers
            )));
        }
        let dev = &self.device;
        let (qd, kd, vd, od) = (dev.dims(q), dev.dims(k), dev.dims(v), dev.dims(out));
        let kv_ok = kd == [hkv, t, d] && vd == kd;
        let q_ok = qd.len() == 3 && qd[0] > 0 && qd[0] % hkv == 0 && qd[1] == t && qd[2] == d;
        if !kv_ok || !q_ok || od != qd {
            return Err(CacheError::bad_shape(format!(
                "expected q [Hq, {t}, {d}] with Hq a multiple of {hkv}, k and v [{hkv}, {t}, {d}], out like q; got q {qd:?}, k {kd:?}, v {vd:?}, out {od:?}"
            )));
        }
        Ok(())
    }
}

impl<D: Device> CacheVerbs for KitCache<D> {
    fn bookkeeping(&self) -> &Bookkeeping {
        &self.book
    }
    fn bookkeeping_mut(&mut self) -> &mut Bookkeeping {
        &mut self.book
    }
    fn move_rows(&mut self, base: usize, rows: &[u32]) {
        for pool in self.k.iter_mut().chain(self.v.iter_mut()) {
            self.device.move_rows(pool, base, rows);
        }
    }
}
