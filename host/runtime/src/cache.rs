//! [`Cache`]: a cache object installed in the registry while it lives, with every verb.

use std::sync::Arc;

use kvplug_core::{Arithmetic, CacheKind};
use kvplug_plugin_api::abi_stable::std_types::{ROption, RSlice, RStr};
use kvplug_plugin_api::{CacheHandle, CacheStats, HostTensor, PluginError, SeqRows, TensorDtype};

use crate::registry::CacheRegistry;

/// A cache installed in the registry under [`Cache::key`]; dropping it erases the key
/// (holders of the cache object, such as a bound `forward`, keep the object alive). Every
/// verb of every kind is here; one the kind lacks returns `not_supported` from the plugin.
pub struct Cache {
    key: String,
    backend: String,
    kind: CacheKind,
    cache: CacheHandle,
    registry: Arc<CacheRegistry>,
}

impl Cache {
    pub(crate) fn new(
        key: String,
        backend: String,
        kind: CacheKind,
        cache: CacheHandle,
        registry: Arc<CacheRegistry>,
    ) -> Self {
        Cache {
            key,
            backend,
            kind,
            cache,
            registry,
        }
    }

    /// The registry key (`cache-N`).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The owning backend.
    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// The cache kind.
    pub fn kind(&self) -> CacheKind {
        self.kind
    }

    /// The shared cache object as the plugin exports it (every verb; those of other kinds
    /// return `not_supported`).
    pub fn handle(&self) -> &CacheHandle {
        &self.cache
    }

    /// The attention arithmetic the cache computes with (see [`Arithmetic`]; `f32` unless
    /// set, or unless its backend prefers another).
    pub fn arithmetic(&self) -> String {
        self.cache.attention_arithmetic().into()
    }

    /// Computes later attention with `arithmetic`: `not_supported` (and no change) unless the
    /// cache declares it.
    pub fn set_arithmetic(&self, arithmetic: Arithmetic) -> Result<(), PluginError> {
        self.cache
            .set_attention_arithmetic(RStr::from_str(arithmetic.as_str()))
            .into_result()
    }

    /// Whether `n` more tokens fit.
    pub fn can_extend(&self, n: usize) -> bool {
        self.cache.can_extend(n as u64)
    }

    /// The logical ceiling in cells.
    pub fn capacity(&self) -> usize {
        self.cache.capacity() as usize
    }

    /// Forgets everything.
    pub fn clear(&self) -> Result<(), PluginError> {
        self.cache.clear().into_result()
    }

    /// Memory and last-step statistics.
    pub fn stats(&self) -> Result<CacheStats, PluginError> {
        self.cache.stats().into_result()
    }

    /// The K/V history `seq` holds (contiguous and tree caches: 0, the committed prefix).
    pub fn export_seq(&self, seq: i32) -> Result<SeqRows, PluginError> {
        self.cache.export_seq(seq).into_result()
    }

    /// Writes `rows` as the history of the empty `seq` (contiguous and tree caches: 0, the
    /// empty cache). All or nothing.
    pub fn import_seq(&self, seq: i32, rows: &SeqRows) -> Result<(), PluginError> {
        self.cache.import_seq(seq, rows).into_result()
    }

    /// The op over host tensors (`[1, H, T, D]`).
    #[allow(clippy::too_many_arguments)]
    pub fn update_and_attend(
        &self,
        layer: usize,
        q: &HostTensor,
        k: &HostTensor,
        v: &HostTensor,
        positions: &[i32],
        scale: f32,
        out_dtype: TensorDtype,
    ) -> Result<HostTensor, PluginError> {
        self.cache
            .update_and_attend(
                layer as u32,
                q,
                k,
                v,
                RSlice::from_slice(positions),
                scale,
                out_dtype,
            )
            .into_result()
    }
}

impl Drop for Cache {
    fn drop(&mut self) {
        self.registry.erase(&self.key);
        tracing::debug!(key = %self.key, "cache dropped, key erased");
    }
}

/// The verbs of the contiguous cache.
impl Cache {
    /// Truncate to `len` tokens.
    pub fn rewind(&self, len: usize) -> Result<(), PluginError> {
        self.cache.rewind(len as u64).into_result()
    }
}

/// The verbs of the seq cache.
impl Cache {
    /// Per-token sequence ids of the next step.
    pub fn begin_step(&self, seq_ids: &[i32]) -> Result<(), PluginError> {
        self.cache
            .begin_step(RSlice::from_slice(seq_ids))
            .into_result()
    }
    /// Share `src`'s cells with positions in `[p0, p1)` with `dst`.
    pub fn seq_cp(
        &self,
        src: i32,
        dst: i32,
        p0: Option<i32>,
        p1: Option<i32>,
    ) -> Result<(), PluginError> {
        self.cache
            .seq_cp(src, dst, ROption::from(p0), ROption::from(p1))
            .into_result()
    }
    /// Drop `seq` from its cells with positions in `[p0, p1)`.
    pub fn seq_rm(&self, seq: i32, p0: Option<i32>, p1: Option<i32>) -> Result<(), PluginError> {
        self.cache
            .seq_rm(seq, ROption::from(p0), ROption::from(p1))
            .into_result()
    }
    /// Keep `seq` alone.
    pub fn seq_keep(&self, seq: i32) -> Result<(), PluginError> {
        self.cache.seq_keep(seq).into_result()
    }
    /// Cells held by `seq`.
    pub fn seq_len(&self, seq: i32) -> Result<usize, PluginError> {
        self.cache.seq_len(seq).into_result().map(|n| n as usize)
    }
    /// How many leading `tokens` the prefix index holds.
    pub fn prefix_match(&self, tokens: &[u32]) -> Result<usize, PluginError> {
        let n = self.cache.prefix_match(RSlice::from_slice(tokens));
        n.into_result().map(|n| n as usize)
    }
    /// Gives the empty `seq` the cells of the longest cached prefix of `tokens`; returns
    /// its length (the caller prefills the rest).
    pub fn prefix_attach(&self, seq: i32, tokens: &[u32]) -> Result<usize, PluginError> {
        let n = self.cache.prefix_attach(seq, RSlice::from_slice(tokens));
        n.into_result().map(|n| n as usize)
    }
    /// Caches `seq`'s K/V of `tokens` (token `i` at position `i`); returns how many were
    /// cached already.
    pub fn prefix_publish(&self, seq: i32, tokens: &[u32]) -> Result<usize, PluginError> {
        let n = self.cache.prefix_publish(seq, RSlice::from_slice(tokens));
        n.into_result().map(|n| n as usize)
    }
    /// Makes `n` cells free, evicting unheld cached prefixes as needed; returns the cells
    /// evicted.
    pub fn prefix_reserve(&self, n: usize) -> Result<usize, PluginError> {
        let e = self.cache.prefix_reserve(n as u64);
        e.into_result().map(|n| n as usize)
    }
}

/// The verbs of the tree cache.
impl Cache {
    /// Append a frontier.
    pub fn propose(&self, parents: &[i32]) -> Result<(), PluginError> {
        self.cache
            .propose(RSlice::from_slice(parents))
            .into_result()
    }
    /// Accept a root-first chain.
    pub fn commit(&self, accepted: &[i32]) -> Result<(), PluginError> {
        self.cache
            .commit(RSlice::from_slice(accepted))
            .into_result()
    }
}
