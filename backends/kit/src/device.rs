//! The device trait a backend implements, and the backend descriptor for its plugin.

use kvplug_core::{Arithmetic, KvDtype};
use kvplug_plugin_api::{HostTensor, TensorDtype};

use crate::cache::KitError;

/// How attention masks the read window `[0, read_len)`.
#[derive(Clone, Copy, Debug)]
pub enum AttendMask<'a> {
    /// Every query sees the whole window.
    None,
    /// Lower-right aligned causal: query `i` of `T` sees `j <= read_len - T + i`.
    Causal,
    /// Row-major `[T, read_len]` booleans, `true` = attend.
    Explicit(&'a [bool]),
}

/// Tensor primitives and kernels of one backend.
///
/// `Tensor` holds activations (`[heads, tokens, head_dim]` for attention operands);
/// `Pool` holds one layer's K or V rows, `cells` per head, in a [`KvDtype`], laid out as
/// the device likes (the in-tree backends: SDPA-major `[heads, cells, head_dim]`); only the
/// canonical form of [`Device::read_rows`] / [`Device::write_rows`] is fixed. Row indices
/// are cells. Implementations may assume the kit has validated
/// every shape and index; they report only device failures.
pub trait Device: Send + Sync + Sized + 'static {
    /// An activation tensor on the device.
    type Tensor: Send + Sync;
    /// One layer's K or V storage.
    type Pool: Send;
    /// Per-cache scratch reused across steps (attention score buffers and the like).
    type Scratch: Default + Send;

    /// KV dtypes this device's pools support.
    fn kv_dtypes(&self) -> &[KvDtype];

    /// Dimensions of a tensor.
    fn dims<'t>(&self, t: &'t Self::Tensor) -> &'t [usize];

    /// A pool of `cells` rows per head.
    fn pool_new(
        &self,
        dtype: KvDtype,
        heads: usize,
        head_dim: usize,
        cells: usize,
    ) -> Result<Self::Pool, KitError>;

    /// Grows `pool` to `cells` rows per head, keeping rows `[0, keep)`.
    fn pool_grow(&self, pool: &mut Self::Pool, cells: usize, keep: usize) -> Result<(), KitError>;

    /// Bytes `pool` holds (codes, scales and offsets included).
    fn pool_bytes(&self, pool: &Self::Pool) -> usize;

    /// Writes `src` (`[heads, T, head_dim]`) to rows `start..start + T`. The default scatters
    /// to those rows ([`Device::scatter_rows`]).
    fn write_run(
        &self,
        pool: &mut Self::Pool,
        start: usize,
        src: &Self::Tensor,
    ) -> Result<(), KitError> {
        let tokens = self.dims(src)[1];
        let cells: Vec<u32> = (start..start + tokens).map(|c| c as u32).collect();
        self.scatter_rows(pool, &cells, src)
    }

    /// Writes token `i` of `src` to row `cells[i]`.
    fn scatter_rows(
        &self,
        pool: &mut Self::Pool,
        cells: &[u32],
        src: &Self::Tensor,
    ) -> Result<(), KitError>;

    /// Writes a step's keys `k` to rows `start..start + T` of `kp` and its values `v` to
    /// the same rows of `vp`. The default writes each pool by [`Device::write_run`]; a
    /// backend may write both in one pass.
    fn write_kv_run(
        &self,
        kp: &mut Self::Pool,
        vp: &mut Self::Pool,
        start: usize,
        k: &Self::Tensor,
        v: &Self::Tensor,
    ) -> Result<(), KitError> {
        self.write_run(kp, start, k)?;
        self.write_run(vp, start, v)
    }

    /// Writes token `i` of the keys `k` to row `cells[i]` of `kp` and of the values `v` to
    /// the same row of `vp`. The default writes each pool by [`Device::scatter_rows`]; a
    /// backend may write both in one pass.
    fn scatter_kv_rows(
        &self,
        kp: &mut Self::Pool,
        vp: &mut Self::Pool,
        cells: &[u32],
        k: &Self::Tensor,
        v: &Self::Tensor,
    ) -> Result<(), KitError> {
        self.scatter_rows(kp, cells, k)?;
        self.scatter_rows(vp, cells, v)
    }

    /// Reads rows `cells` of every head in the canonical storage form (see
    /// [`SeqRows`](kvplug_plugin_api::SeqRows)): `[heads, cells.len(), row_bytes]`.
    fn read_rows(&self, pool: &Self::Pool, cells: &[u32]) -> Result<Vec<u8>, KitError>;

    /// Writes canonical rows (`[heads, cells.len(), row_bytes]`, as [`Device::read_rows`]
    /// returns them) to rows `cells`, bit for bit.
    fn write_rows(&self, pool: &mut Self::Pool, cells: &[u32], rows: &[u8])
        -> Result<(), KitError>;

    /// Moves row `rows[i]` to row `base + i` (tree commit). Rows ascend and
    /// `rows[i] >= base + i`, so a forward copy is safe in place. Infallible once indices
    /// are validated; a device reports asynchronous failures on its next fallible call.
    fn move_rows(&self, pool: &mut Self::Pool, base: usize, rows: &[u32]);

    /// The arithmetics [`Device::attend`] computes with on pools of `dtype`, the one new
    /// caches use first (none: f32 only; f32 is always available, listed or not). A declared
    /// arithmetic is held to its own bound (`kvplug_core::oracle::attend`); using an
    /// undeclared one fails conformance.
    fn arithmetics(&self, _dtype: KvDtype) -> Vec<Arithmetic> {
        Vec::new()
    }

    /// `out = softmax(q·kᵀ·scale + mask)·v` over rows `[0, read_len)` of `k` and `v`.
    /// q and out are `[Hq, T, head_dim]`; query head `h` reads KV head `h / (Hq / Hkv)`.
    /// `arithmetic` is f32 or one of [`Device::arithmetics`] for the pools' dtype: the
    /// largest error the call may add (computing more exactly is always allowed).
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        arithmetic: Arithmetic,
        q: &Self::Tensor,
        k: &Self::Pool,
        v: &Self::Pool,
        read_len: usize,
        mask: AttendMask<'_>,
        scale: f32,
        out: &mut Self::Tensor,
        scratch: &mut Self::Scratch,
    ) -> Result<(), KitError>;

    /// [`Device::attend`] with a learned sink per query head (GPT-OSS's `attn_sinks`):
    /// row `i` of query head `h` divides by `Σ_j e^{s_j} + e^{sinks[h]}`, as if one more key
    /// of score `sinks[h]` (not scaled) and value zero were visible
    /// ([`kvplug_core::oracle::attend_sinks`]); a row that sees no key still reads zeros.
    /// `sinks` is `[Hq]` (a model's weights, uploaded once).
    /// A backend that computes it lists `attention-sinks` in its
    /// [`Backend::features`]; the default refuses.
    #[allow(clippy::too_many_arguments)]
    fn attend_sinks(
        &self,
        _arithmetic: Arithmetic,
        _q: &Self::Tensor,
        _k: &Self::Pool,
        _v: &Self::Pool,
        _read_len: usize,
        _mask: AttendMask<'_>,
        _scale: f32,
        _sinks: &Self::Tensor,
        _out: &mut Self::Tensor,
        _scratch: &mut Self::Scratch,
    ) -> Result<(), KitError> {
        Err(KitError::Device(
            "this backend has no attention sinks (models such as GPT-OSS need them)".into(),
        ))
    }

    /// A zeroed f32 tensor of `dims`. The default uploads zeros from the host.
    fn zeros(&self, dims: &[usize]) -> Result<Self::Tensor, KitError> {
        let zeros = vec![0f32; dims.iter().product()];
        self.upload(&HostTensor::from_f32(dims, &zeros))
    }

    /// Uploads a host tensor (f32/f16/bf16) as an activation tensor.
    fn upload(&self, t: &HostTensor) -> Result<Self::Tensor, KitError>;

    /// [`Device::upload`] into `out`, reusing its buffers where the device can (a decode
    /// step's host-computed layers then allocate nothing once warm); by default a fresh
    /// upload moved in.
    fn upload_into(&self, t: &HostTensor, out: &mut Self::Tensor) -> Result<(), KitError> {
        *out = self.upload(t)?;
        Ok(())
    }

    /// Downloads a tensor, converting to `dtype`.
    fn download(&self, t: &Self::Tensor, dtype: TensorDtype) -> Result<HostTensor, KitError>;

    /// [`Device::download`] into `out`, reusing its buffers where the device can (a decode
    /// loop's logits then allocate nothing once warm); by default a fresh download moved in.
    fn download_into(
        &self,
        t: &Self::Tensor,
        dtype: TensorDtype,
        out: &mut HostTensor,
    ) -> Result<(), KitError> {
        *out = self.download(t, dtype)?;
        Ok(())
    }
}

/// A device that is also a plugin: its id, how to open it, and what `describe` says.
pub trait Backend: Device {
    /// The id applications select the backend by.
    const ID: &'static str;
    /// Human-readable name.
    const NAME: &'static str;

    /// Opens the device (once per process). An error keeps the plugin loadable: `describe`
    /// reports it and building a cache fails with it.
    fn open() -> Result<Self, String>;

    /// Device description for `kvplug plugins` (adapter, backend, type, ...).
    fn device_description(&self) -> String;

    /// Feature flags (e.g. `xnnpack`, `avx2`).
    fn features(&self) -> Vec<String>;

    /// The device's counters since it opened, by name (`dispatches`, `read_back_bytes`,
    /// ...), which `kvplug bench` reports per token. The default keeps none.
    fn counters(&self) -> Vec<(String, u64)> {
        Vec::new()
    }
}
