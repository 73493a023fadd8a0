//! [`SharedCache`]: a [`KitCache`] behind the ABI's `CacheObject`.

use std::sync::{Arc, Mutex, MutexGuard};

use kvplug_core::{Arithmetic, CacheError, CacheVerbs, PosRange};
use kvplug_plugin_api::abi_stable::sabi_trait::TD_CanDowncast;
use kvplug_plugin_api::abi_stable::std_types::{
    RArc, ROption, RResult, RSlice, RStr, RString, RVec,
};
use kvplug_plugin_api::{
    guard, guard_or, AbiErrorKind, CacheHandle, CacheObject, CacheObject_TO, CacheStats,
    HostTensor, PluginError, SeqRows, TensorDtype,
};

use crate::cache::KitCache;
use crate::device::Device;

/// A shared, locked [`KitCache`]. Clones share the cache. Model methods of the same
/// plugin reach it by downcasting the ABI object and calling [`SharedCache::lock`].
pub struct SharedCache<D: Device> {
    inner: Arc<Mutex<KitCache<D>>>,
}

impl<D: Device> Clone for SharedCache<D> {
    fn clone(&self) -> Self {
        SharedCache {
            inner: self.inner.clone(),
        }
    }
}

impl<D: Device> SharedCache<D> {
    /// Shares `cache`.
    pub fn new(cache: KitCache<D>) -> Self {
        SharedCache {
            inner: Arc::new(Mutex::new(cache)),
        }
    }

    /// Locks the cache; an error if an earlier panic poisoned it.
    pub fn lock(&self) -> Result<MutexGuard<'_, KitCache<D>>, PluginError> {
        self.inner.lock().map_err(|_| {
            PluginError::new(
                AbiErrorKind::Panic,
                "cache is unusable: an earlier call panicked while holding it",
            )
        })
    }

    /// The ABI object (downcastable inside this dylib).
    pub fn into_handle(self) -> CacheHandle {
        CacheObject_TO::from_ptr(RArc::new(self), TD_CanDowncast)
    }

    fn with<T>(
        &self,
        f: impl FnOnce(&mut KitCache<D>) -> Result<T, CacheError>,
    ) -> RResult<T, PluginError> {
        guard(|| -> Result<T, PluginError> { Ok(f(&mut *self.lock()?)?) })
    }

    /// The op over host tensors: validates `[1, H, T, D]` shapes, uploads, runs
    /// [`KitCache::update_and_attend`], downloads in `out_dtype`.
    #[allow(clippy::too_many_arguments)]
    fn host_update_and_attend(
        &self,
        layer: u32,
        q: &HostTensor,
        k: &HostTensor,
        v: &HostTensor,
        positions: &[i32],
        scale: f32,
        out_dtype: TensorDtype,
    ) -> Result<HostTensor, PluginError> {
        if out_dtype == TensorDtype::I32 {
            return Err(CacheError::bad_shape("out_dtype must be f32, f16 or bf16").into());
        }
        let mut cache = self.lock()?;
        let dev = cache.device().clone();
        let squeeze = |t: &HostTensor| -> Result<HostTensor, PluginError> {
            t.check().map_err(CacheError::bad_shape)?;
            if t.dtype == TensorDtype::I32 || t.shape.len() != 4 || t.shape[0] != 1 {
                return Err(CacheError::bad_shape(format!(
                    "q/k/v must be float [1, H, T, D], got {} {:?}",
                    t.dtype.as_str(),
                    t.shape.as_slice()
                ))
                .into());
            }
            let mut s = t.clone();
            s.shape.remove(0);
            Ok(s)
        };
        let (q3, k3, v3) = (squeeze(q)?, squeeze(k)?, squeeze(v)?);
        let qt = dev.upload(&q3)?;
        let kt = dev.upload(&k3)?;
        let vt = dev.upload(&v3)?;
        let mut out = dev.zeros(&q3.dims())?;
        cache.update_and_attend(layer as usize, &qt, &kt, &vt, positions, scale, &mut out)?;
        let mut host = dev.download(&out, out_dtype)?;
        host.shape.insert(0, 1);
        Ok(host)
    }
}

fn range(p0: ROption<i32>, p1: ROption<i32>) -> PosRange {
    PosRange::new(p0.into_option(), p1.into_option())
}

impl<D: Device> CacheObject for SharedCache<D> {
    fn kind(&self) -> RString {
        guard_or(RString::new(), || {
            self.lock()
                .map(|c| c.kind().as_str().into())
                .unwrap_or_default()
        })
    }
    fn capacity(&self) -> u64 {
        guard_or(0, || self.lock().map(|c| c.capacity() as u64).unwrap_or(0))
    }
    fn can_extend(&self, n: u64) -> bool {
        guard_or(false, || {
            self.lock()
                .map(|c| c.can_extend(n as usize))
                .unwrap_or(false)
        })
    }
    fn clear(&self) -> RResult<(), PluginError> {
        self.with(|c| {
            c.clear();
            Ok(())
        })
    }
    fn rewind(&self, len: u64) -> RResult<(), PluginError> {
        self.with(|c| c.rewind(len as usize))
    }
    fn begin_step(&self, seq_ids: RSlice<'_, i32>) -> RResult<(), PluginError> {
        self.with(|c| c.begin_step(&seq_ids))
    }
    fn seq_cp(
        &self,
        src: i32,
        dst: i32,
        p0: ROption<i32>,
        p1: ROption<i32>,
    ) -> RResult<(), PluginError> {
        self.with(|c| c.seq_cp(src, dst, range(p0, p1)))
    }
    fn seq_rm(&self, seq: i32, p0: ROption<i32>, p1: ROption<i32>) -> RResult<(), PluginError> {
        self.with(|c| c.seq_rm(seq, range(p0, p1)))
    }
    fn seq_keep(&self, seq: i32) -> RResult<(), PluginError> {
        self.with(|c| c.seq_keep(seq))
    }
    fn seq_len(&self, seq: i32) -> RResult<u64, PluginError> {
        self.with(|c| c.seq_len(seq).map(|n| n as u64))
    }
    fn propose(&self, parents: RSlice<'_, i32>) -> RResult<(), PluginError> {
        self.with(|c| c.propose(&parents))
    }
    fn commit(&self, accepted: RSlice<'_, i32>) -> RResult<(), PluginError> {
        self.with(|c| c.commit(&accepted))
    }
    fn stats(&self) -> RResult<CacheStats, PluginError> {
        self.with(|c| {
            let s = c.stats();
            Ok(CacheStats {
                allocated_bytes: s.allocated_bytes as u64,
                pool_cells: s.pool_cells as u64,
                window_cells: s.window_cells as u64,
                live_cells: s.live_cells as u64,
                high_water: s.high_water as u64,
                last_plan: s.last_plan.map(|p| RString::from(p.as_str())).into(),
                last_read_len: s.last_read_len as u64,
                prefix_cached: s.prefix.cached as u64,
                prefix_evictable: s.prefix.evictable as u64,
            })
        })
    }
    fn update_and_attend(
        &self,
        layer: u32,
        q: &HostTensor,
        k: &HostTensor,
        v: &HostTensor,
        positions: RSlice<'_, i32>,
        scale: f32,
        out_dtype: TensorDtype,
    ) -> RResult<HostTensor, PluginError> {
        guard(|| self.host_update_and_attend(layer, q, k, v, &positions, scale, out_dtype))
    }
    fn prefix_match(&self, tokens: RSlice<'_, u32>) -> RResult<u64, PluginError> {
        self.with(|c| c.prefix_match(&tokens).map(|n| n as u64))
    }
    fn prefix_attach(&self, seq: i32, tokens: RSlice<'_, u32>) -> RResult<u64, PluginError> {
        self.with(|c| c.prefix_attach(seq, &tokens).map(|n| n as u64))
    }
    fn prefix_publish(&self, seq: i32, tokens: RSlice<'_, u32>) -> RResult<u64, PluginError> {
        self.with(|c| c.prefix_publish(seq, &tokens).map(|n| n as u64))
    }
    fn prefix_reserve(&self, n: u64) -> RResult<u64, PluginError> {
        self.with(|c| c.prefix_reserve(n as usize).map(|n| n as u64))
    }
    fn prefix_evict(&self, n: u64) -> RResult<u64, PluginError> {
        self.with(|c| c.prefix_evict(n as usize).map(|n| n as u64))
    }
    fn export_seq(&self, seq: i32) -> RResult<SeqRows, PluginError> {
        guard(|| -> Result<_, PluginError> { Ok(self.lock()?.export_seq(seq)?) })
    }
    fn import_seq(&self, seq: i32, rows: &SeqRows) -> RResult<(), PluginError> {
        guard(|| -> Result<_, PluginError> { Ok(self.lock()?.import_seq(seq, rows)?) })
    }
    fn attention_arithmetics(&self) -> RVec<RString> {
        guard_or(RVec::new(), || {
            self.lock()
                .map(|c| c.arithmetics().iter().map(|a| a.as_str().into()).collect())
                .unwrap_or_default()
        })
    }
    fn attention_arithmetic(&self) -> RString {
        guard_or(RString::new(), || {
            self.lock()
                .map(|c| c.arithmetic().as_str().into())
                .unwrap_or_default()
        })
    }
    fn set_attention_arithmetic(&self, name: RStr<'_>) -> RResult<(), PluginError> {
        self.with(|c| {
            let a: Arithmetic =
                name.parse()
                    .map_err(|e: kvplug_core::arithmetic::ParseArithmeticError| {
                        CacheError::not_supported(e.to_string())
                    })?;
            c.set_arithmetic(a)
        })
    }
}
