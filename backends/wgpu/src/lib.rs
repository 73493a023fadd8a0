//! # kvplug-wgpu
//!
//! The `wgpu` backend: the kit's [`Device`] over wgpu 30 with WGSL compute kernels, for every
//! desktop GPU API (Vulkan, Metal, DX12) and, in CI, the software Vulkan driver (lavapipe).
//!
//! - Pools are storage buffers of u32 words, SDPA-major `[heads, cells, row_words]`: f32
//!   rows as bits, f16 and bf16 packed two per word (`unpack2x16float` / shifts), q8 and q4
//!   codes packed four / eight per word followed by one word per group holding the f16
//!   scale and offset. Rows are encoded by a kernel, so activations never leave the device.
//! - Attention over the window `[0, read_len)` with GQA head mapping and None / Causal /
//!   Explicit masks, quantized rows decoded inside the kernels: in the f32 arithmetic split
//!   over chunks of 256 keys (flash-decoding: each chunk's scores, softmax and weighted values
//!   in one workgroup, then a pass merging a row's chunks), in the int8-query arithmetic as
//!   scores, masked stable softmax and output passes. Query heads are processed in groups so
//!   the scratch fits the adapter's storage-binding limit.
//! - Arithmetics: f32 everywhere (the default); on q8/q4 pools with groups a multiple of 32
//!   also int8-query, where the query is quantized once per call and every 4 codes meet 4
//!   key codes in one `dot4I8Packed` (native `OpSDot` where the Vulkan device has integer
//!   dot products, naga's exact polyfill elsewhere; the result is the same integer).
//! - Device selection honours `WGPU_BACKEND` and `WGPU_ADAPTER_NAME`. Without an adapter the
//!   plugin still loads, `describe` says why, and building a cache fails with that reason.

// A backend's docs are read with its private items (`cargo doc --document-private-items`),
// which its public items' docs link to.
#![allow(rustdoc::private_intra_doc_links)]

pub mod context;
pub mod model;
mod profile;

use kvplug_backend_kit::{AttendMask, Backend, Device, KitError};
use kvplug_core::{Arithmetic, CacheError, KvDtype};
use kvplug_plugin_api::{HostTensor, TensorDtype};
use wgpu::BufferUsages;

use crate::context::{Bind, Context, OwnedBuffer};

/// An f32 activation tensor in a storage buffer.
pub struct WgpuTensor {
    pub(crate) buf: OwnedBuffer,
    pub(crate) dims: Vec<usize>,
}

/// One layer's K or V pool.
pub struct WgpuPool {
    buf: OwnedBuffer,
    heads: usize,
    head_dim: usize,
    cells: usize,
    row_words: usize,
    dtype: u32,
    group: u32,
}

/// Per-cache scratch: the score buffer and the step's mask, both grown on demand and kept,
/// so the decode path binds the same buffers every step.
#[derive(Default)]
pub struct WgpuScratch {
    scores: Option<OwnedBuffer>,
    /// The int8-query codes of the call's query rows (`attention.wgsl`'s `qcodes`).
    qcodes: Option<OwnedBuffer>,
    /// The mask bits being packed for this call.
    packing: Vec<u32>,
    /// The last mask uploaded, as packed bits, and the buffer holding it: every layer of a
    /// step attends with the same mask, so it is uploaded once per step, not once per layer.
    mask: Option<(Vec<u32>, OwnedBuffer)>,
}

impl WgpuScratch {
    /// Packs `mask` into bits (`kind` 0 none, 1 causal, 2 explicit) and returns its buffer,
    /// writing the bits into it only when they differ from the last ones.
    fn mask_buffer(&mut self, dev: &WgpuDevice, mask: AttendMask<'_>) -> (u32, wgpu::Buffer) {
        let words = &mut self.packing;
        words.clear();
        let kind = match mask {
            AttendMask::None => 0,
            AttendMask::Causal => 1,
            AttendMask::Explicit(m) => {
                words.resize(m.len().div_ceil(32), 0);
                for (b, _) in m.iter().enumerate().filter(|(_, &on)| on) {
                    words[b / 32] |= 1 << (b % 32);
                }
                2
            }
        };
        if words.is_empty() {
            words.push(0);
        }
        let ctx = &dev.ctx;
        let bytes = (words.len() * 4) as u64;
        match &mut self.mask {
            Some((last, _)) if last == words => {}
            Some((last, buf)) if buf.size() >= bytes => {
                ctx.write_buffer(buf, 0, bytemuck::cast_slice(words));
                std::mem::swap(last, words);
            }
            held => {
                let buf = ctx.storage("mask", bytes.next_power_of_two().max(MIN_MASK_BYTES));
                ctx.write_buffer(&buf, 0, bytemuck::cast_slice(words));
                *held = Some((std::mem::take(words), buf));
            }
        }
        (kind, (*self.mask.as_ref().expect("set above").1).clone())
    }
}

/// The wgpu device and its kernels.
pub struct WgpuDevice {
    ctx: Context,
    /// The top-k kernels' scratch of greedy steps (`argmax_rows`), grown on demand; its
    /// lock holds it from the kernels to the readback.
    picks: std::sync::Mutex<Option<WgpuTensor>>,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct RowParams {
    heads: u32,
    t: u32,
    d: u32,
    cells: u32,
    row_words: u32,
    dtype: u32,
    group: u32,
    base: u32,
    /// Where the op's cells start in the index words.
    idx0: u32,
    /// What `write_main` writes an invocation: a word of a dense row, a group of a
    /// quantized one; a row is `units` of them.
    units: u32,
    /// Tensors `write_main` writes, each into its pool: 1, or 2 (keys and values).
    pairs: u32,
    /// 1 when `write_main` writes rows `base..` rather than the cells at `idx0`.
    run: u32,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct AttnParams {
    hq: u32,
    hkv: u32,
    t: u32,
    l: u32,
    d: u32,
    cells: u32,
    row_words: u32,
    dtype: u32,
    group: u32,
    mask_kind: u32,
    head0: u32,
    nheads: u32,
    scale: f32,
    rows_per_y: u32,
    /// 1: scores in the int8-query arithmetic.
    int8: u32,
    /// 1: a sink per query head is bound.
    sinks: u32,
}

const MAX_DISPATCH: u32 = 65535;

/// Keys per chunk of the flash-decoding pass (`attention.wgsl`'s `CHUNK`).
const FLASH_CHUNK: usize = 256;

/// Values per int8 query block (`attention.wgsl`'s `QBLOCK`).
const QUERY_BLOCK: usize = kvplug_core::arithmetic::QUERY_BLOCK;

/// Pool dtype codes (`attention.wgsl`'s `Params.dtype`).
const DTYPE_Q8: u32 = 3;
const DTYPE_Q4: u32 = 4;

/// Values of one query row per workgroup of `output_main` (its `VALUES_PER_GROUP`).
const VALUES_PER_GROUP: u32 = 8;

/// The smallest mask buffer: a decode step's mask over up to 8192 cells fits.
const MIN_MASK_BYTES: u64 = 1024;

/// `(dtype code, words per row, group)` of a pool, or why this device cannot hold it.
fn layout(dtype: KvDtype, d: usize) -> Result<(u32, usize, u32), CacheError> {
    let bad =
        |why: &str| CacheError::bad_config(format!("wgpu {dtype} pools need {why} (head_dim {d})"));
    Ok(match dtype {
        KvDtype::F32 => (0, d, 1),
        KvDtype::F16 | KvDtype::Bf16 if d % 2 != 0 => return Err(bad("an even head_dim")),
        KvDtype::F16 => (1, d / 2, 1),
        KvDtype::Bf16 => (2, d / 2, 1),
        KvDtype::Q8 { group } if group % 4 != 0 => {
            return Err(bad("a group that is a multiple of 4"))
        }
        KvDtype::Q8 { group } => (DTYPE_Q8, d / 4 + d / group, group as u32),
        KvDtype::Q4 { group } if group % 8 != 0 => {
            return Err(bad("a group that is a multiple of 8"))
        }
        KvDtype::Q4 { group } => (DTYPE_Q4, d / 8 + d / group, group as u32),
    })
}

/// Maximal runs of consecutive cells, as `(first cell, length)`, in order.
fn runs(cells: &[u32]) -> impl Iterator<Item = (u32, usize)> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        let first = *cells.get(i)?;
        let len = cells[i..]
            .iter()
            .enumerate()
            .take_while(|&(k, &c)| c as usize == first as usize + k)
            .count();
        i += len;
        Some((first, len))
    })
}

/// The rows `write_main` writes: the cells given, or consecutive ones from a start.
#[derive(Clone, Copy)]
enum Rows<'a> {
    Cells(&'a [u32]),
    Run(usize),
}

/// Whether two pools hold rows of the same shape and encoding, so that one `write_main`
/// dispatch can write both.
fn same_layout(a: &WgpuPool, b: &WgpuPool) -> bool {
    (a.heads, a.head_dim, a.cells, a.row_words, a.dtype, a.group)
        == (b.heads, b.head_dim, b.cells, b.row_words, b.dtype, b.group)
}

fn device_err(e: String) -> KitError {
    KitError::Device(e)
}

impl WgpuDevice {
    fn new(ctx: Context) -> WgpuDevice {
        WgpuDevice {
            ctx,
            picks: Default::default(),
        }
    }

    pub(crate) fn context(&self) -> &Context {
        &self.ctx
    }

    /// The default adapter, as [`Backend::open`] opens it, but with storage bindings capped
    /// at `max_binding` bytes: a smaller adapter's limit, so that splitting weights across
    /// bindings can be exercised on any machine; `tuning` as [`Self::open_tuned`]'s, or the
    /// adapter's kind's.
    pub fn open_with_binding_limit(
        max_binding: u64,
        tuning: Option<context::Tuning>,
    ) -> Result<Self, String> {
        Context::open(Some(max_binding), tuning).map(WgpuDevice::new)
    }

    /// The default adapter with its projection kernels shaped by `tuning` rather than by the
    /// adapter's kind: a GPU's shapes (three projections a dispatch, 256 invocations a
    /// workgroup) can be run on lavapipe, whose own default is [`context::Tuning::CPU`].
    pub fn open_tuned(tuning: context::Tuning) -> Result<Self, String> {
        Context::open(None, Some(tuning)).map(WgpuDevice::new)
    }

    /// Buffers and bind groups this device has created since it opened.
    pub fn created(&self) -> context::Created {
        self.ctx.created()
    }

    /// Bind groups cached now; those of a dropped pool, tensor or weight go with it.
    pub fn bind_groups_held(&self) -> usize {
        self.ctx.bind_groups_held()
    }

    fn row_params(pool: &WgpuPool, t: usize, base: usize, idx0: u32) -> RowParams {
        RowParams {
            heads: pool.heads as u32,
            t: t as u32,
            d: pool.head_dim as u32,
            cells: pool.cells as u32,
            row_words: pool.row_words as u32,
            dtype: pool.dtype,
            group: pool.group,
            base: base as u32,
            idx0,
            units: match pool.dtype {
                0 => pool.head_dim,
                1 | 2 => pool.head_dim / 2,
                _ => pool.head_dim / pool.group as usize,
            } as u32,
            pairs: 1,
            run: 0,
        }
    }

    /// A zeroed pool buffer, refused when it exceeds the adapter's storage binding limit.
    fn pool_buffer(
        &self,
        heads: usize,
        cells: usize,
        row_words: usize,
    ) -> Result<OwnedBuffer, KitError> {
        let bytes = (heads * cells * row_words * 4) as u64;
        let limit = self.ctx.limits.max_storage_buffer_binding_size;
        if bytes > limit {
            return Err(CacheError::capacity(format!(
                "a {cells}-cell pool needs {bytes} bytes, over this adapter's storage binding limit of {limit}"
            ))
            .into());
        }
        Ok(self.ctx.storage("pool", bytes))
    }

    /// `src` (`[heads, t, d]`) into rows `rows` of `pool`, and `second`'s tensor into the
    /// same rows of its pool when given: `write_main`, one dispatch, one invocation a word
    /// of a dense row or a group of a quantized one. The second pool must be laid out as
    /// `pool` and its tensor shaped as `src` ([`same_layout`]).
    fn write_rows(
        &self,
        pool: &mut WgpuPool,
        rows: Rows<'_>,
        src: &WgpuTensor,
        second: Option<(&mut WgpuPool, &WgpuTensor)>,
    ) {
        let t = src.dims[1];
        let (cells, base, run) = match rows {
            Rows::Cells(cells) => (cells, 0, 0),
            Rows::Run(start) => (&[][..], start, 1),
        };
        let pairs = 1 + usize::from(second.is_some());
        // Writable slots must not alias: a missing second pool takes the scratch.
        let (src2, pool2) = match &second {
            Some((p, v)) => (Bind::Buffer(&v.buf), Bind::Buffer(&p.buf)),
            None => (Bind::Buffer(&src.buf), Bind::Scratch(4)),
        };
        let units = Self::row_params(pool, 0, 0, 0).units as usize;
        self.ctx.dispatch(
            self.ctx.rows(),
            |idx0| RowParams {
                pairs: pairs as u32,
                run,
                ..Self::row_params(pool, t, base, idx0)
            },
            &[cells],
            &[
                Bind::Buffer(&src.buf),
                Bind::Words,
                Bind::Buffer(&pool.buf),
                Bind::Unused,
                src2,
                pool2,
            ],
            &[(0, model::flat_groups(pairs * pool.heads * t * units))],
        );
    }

    /// Keys into `kp` and values into `vp` at `rows`: one dispatch where the pools and
    /// tensors match, else one each.
    fn write_kv(
        &self,
        kp: &mut WgpuPool,
        vp: &mut WgpuPool,
        rows: Rows<'_>,
        k: &WgpuTensor,
        v: &WgpuTensor,
    ) {
        if same_layout(kp, vp) && k.dims == v.dims {
            self.write_rows(kp, rows, k, Some((vp, v)));
        } else {
            self.write_rows(kp, rows, k, None);
            self.write_rows(vp, rows, v, None);
        }
    }
}

impl Device for WgpuDevice {
    type Tensor = WgpuTensor;
    type Pool = WgpuPool;
    type Scratch = WgpuScratch;

    fn kv_dtypes(&self) -> &[KvDtype] {
        &KvDtype::ALL
    }

    fn dims<'t>(&self, t: &'t WgpuTensor) -> &'t [usize] {
        &t.dims
    }

    fn pool_new(
        &self,
        dtype: KvDtype,
        heads: usize,
        head_dim: usize,
        cells: usize,
    ) -> Result<WgpuPool, KitError> {
        let (code, row_words, group) = layout(dtype, head_dim)?;
        Ok(WgpuPool {
            buf: self.pool_buffer(heads, cells, row_words)?,
            heads,
            head_dim,
            cells,
            row_words,
            dtype: code,
            group,
        })
    }

    fn pool_grow(&self, pool: &mut WgpuPool, cells: usize, keep: usize) -> Result<(), KitError> {
        let grown = self.pool_buffer(pool.heads, cells, pool.row_words)?;
        let rw = pool.row_words as u64 * 4;
        if keep > 0 {
            self.ctx.record(|enc| {
                for h in 0..pool.heads as u64 {
                    enc.copy_buffer_to_buffer(
                        &pool.buf,
                        h * pool.cells as u64 * rw,
                        &grown,
                        h * cells as u64 * rw,
                        keep as u64 * rw,
                    );
                }
            });
        }
        pool.buf = grown;
        pool.cells = cells;
        Ok(())
    }

    fn pool_bytes(&self, pool: &WgpuPool) -> usize {
        pool.heads * pool.cells * pool.row_words * 4
    }

    fn write_run(
        &self,
        pool: &mut WgpuPool,
        start: usize,
        src: &WgpuTensor,
    ) -> Result<(), KitError> {
        self.write_rows(pool, Rows::Run(start), src, None);
        Ok(())
    }

    fn scatter_rows(
        &self,
        pool: &mut WgpuPool,
        cells: &[u32],
        src: &WgpuTensor,
    ) -> Result<(), KitError> {
        self.write_rows(pool, Rows::Cells(cells), src, None);
        Ok(())
    }

    fn write_kv_run(
        &self,
        kp: &mut WgpuPool,
        vp: &mut WgpuPool,
        start: usize,
        k: &WgpuTensor,
        v: &WgpuTensor,
    ) -> Result<(), KitError> {
        self.write_kv(kp, vp, Rows::Run(start), k, v);
        Ok(())
    }

    fn scatter_kv_rows(
        &self,
        kp: &mut WgpuPool,
        vp: &mut WgpuPool,
        cells: &[u32],
        k: &WgpuTensor,
        v: &WgpuTensor,
    ) -> Result<(), KitError> {
        self.write_kv(kp, vp, Rows::Cells(cells), k, v);
        Ok(())
    }

    fn read_rows(&self, pool: &WgpuPool, cells: &[u32]) -> Result<Vec<u8>, KitError> {
        // The pool's word layout is the canonical row form; read each run of cells per head.
        let row = pool.row_words as u64 * 4;
        let regions: Vec<(u64, u64)> = (0..pool.heads as u64)
            .flat_map(|h| {
                runs(cells).map(move |(first, len)| {
                    (
                        (h * pool.cells as u64 + first as u64) * row,
                        len as u64 * row,
                    )
                })
            })
            .collect();
        self.ctx
            .read_regions(&pool.buf, &regions)
            .map_err(device_err)
    }

    fn write_rows(&self, pool: &mut WgpuPool, cells: &[u32], rows: &[u8]) -> Result<(), KitError> {
        let row = pool.row_words * 4;
        for h in 0..pool.heads {
            let mut i = h * cells.len();
            for (first, len) in runs(cells) {
                let offset = ((h * pool.cells + first as usize) * row) as u64;
                self.ctx
                    .write_buffer(&pool.buf, offset, &rows[i * row..(i + len) * row]);
                i += len;
            }
        }
        Ok(())
    }

    fn move_rows(&self, pool: &mut WgpuPool, base: usize, rows: &[u32]) {
        if rows.is_empty() {
            return;
        }
        let n = (pool.heads * rows.len() * pool.row_words) as u64;
        let groups = (n as u32).div_ceil(64);
        self.ctx.dispatch(
            self.ctx.rows(),
            |idx0| Self::row_params(pool, rows.len(), base, idx0),
            &[rows],
            &[
                Bind::Words,
                Bind::Words,
                Bind::Buffer(&pool.buf),
                Bind::Scratch(n * 4),
                Bind::Words,
                Bind::Unused,
            ],
            &[(1, [groups, 1, 1]), (2, [groups, 1, 1])],
        );
    }

    /// f32 first (it is the measured default here; int8-query has not been timed on a GPU
    /// yet), then int8-query on q8/q4 pools whose groups hold whole query blocks.
    fn arithmetics(&self, dtype: KvDtype) -> Vec<Arithmetic> {
        match dtype {
            KvDtype::Q8 { group } | KvDtype::Q4 { group } if group % QUERY_BLOCK == 0 => {
                vec![Arithmetic::F32, Arithmetic::Int8Query]
            }
            _ => Vec::new(),
        }
    }

    fn attend(
        &self,
        arithmetic: Arithmetic,
        q: &WgpuTensor,
        k: &WgpuPool,
        v: &WgpuPool,
        read_len: usize,
        mask: AttendMask<'_>,
        scale: f32,
        out: &mut WgpuTensor,
        scratch: &mut WgpuScratch,
    ) -> Result<(), KitError> {
        let call = (arithmetic, read_len, mask, scale, None);
        self.attention(q, k, v, call, out, scratch)
    }

    fn attend_sinks(
        &self,
        arithmetic: Arithmetic,
        q: &WgpuTensor,
        k: &WgpuPool,
        v: &WgpuPool,
        read_len: usize,
        mask: AttendMask<'_>,
        scale: f32,
        sinks: &WgpuTensor,
        out: &mut WgpuTensor,
        scratch: &mut WgpuScratch,
    ) -> Result<(), KitError> {
        if sinks.dims != [q.dims[0]] {
            return Err(CacheError::bad_shape(format!(
                "sinks of shape {:?} for {} query heads",
                sinks.dims, q.dims[0]
            ))
            .into());
        }
        let call = (arithmetic, read_len, mask, scale, Some(sinks));
        self.attention(q, k, v, call, out, scratch)
    }

    fn zeros(&self, dims: &[usize]) -> Result<WgpuTensor, KitError> {
        Ok(WgpuTensor {
            buf: self
                .ctx
                .storage("tensor", (dims.iter().product::<usize>() * 4) as u64),
            dims: dims.to_vec(),
        })
    }

    fn upload(&self, t: &HostTensor) -> Result<WgpuTensor, KitError> {
        let data = t.to_f32().ok_or_else(|| {
            CacheError::bad_shape(format!(
                "cannot upload a {} tensor as activations",
                t.dtype.as_str()
            ))
        })?;
        Ok(WgpuTensor {
            buf: self.ctx.buffer_with(
                "tensor",
                bytemuck::cast_slice(&data),
                BufferUsages::STORAGE | BufferUsages::COPY_SRC,
            ),
            dims: t.dims(),
        })
    }

    fn download(&self, t: &WgpuTensor, dtype: TensorDtype) -> Result<HostTensor, KitError> {
        let mut out = HostTensor::empty();
        self.download_into(t, dtype, &mut out)?;
        Ok(out)
    }

    /// Encodes from the mapped staging buffer into `out`'s buffers: a decode step's logits
    /// are copied once on the host and allocate nothing once warm.
    fn download_into(
        &self,
        t: &WgpuTensor,
        dtype: TensorDtype,
        out: &mut HostTensor,
    ) -> Result<(), KitError> {
        let n = t.dims.iter().product::<usize>();
        let encoded = self
            .ctx
            .read_with(&t.buf, (n * 4) as u64, |bytes| {
                match bytemuck::try_cast_slice::<u8, f32>(bytes) {
                    Ok(data) => out.encode_f32_into(&t.dims, data, dtype),
                    // A mapping not aligned for f32 (none seen): copied first.
                    Err(_) => {
                        out.encode_f32_into(&t.dims, &bytemuck::pod_collect_to_vec(bytes), dtype)
                    }
                }
            })
            .map_err(device_err)?;
        if encoded {
            Ok(())
        } else {
            Err(CacheError::bad_shape("cannot download activations as i32").into())
        }
    }
}

impl WgpuDevice {
    /// [`Device::attend`], with the sinks of [`Device::attend_sinks`] where given: `call` is
    /// (arithmetic, read_len, mask, scale, sinks).
    #[allow(clippy::type_complexity)]
    fn attention(
        &self,
        q: &WgpuTensor,
        k: &WgpuPool,
        v: &WgpuPool,
        call: (Arithmetic, usize, AttendMask<'_>, f32, Option<&WgpuTensor>),
        out: &mut WgpuTensor,
        scratch: &mut WgpuScratch,
    ) -> Result<(), KitError> {
        let (arithmetic, read_len, mask, scale, sinks) = call;
        let (hq, t, d, l) = (q.dims[0], q.dims[1], q.dims[2], read_len);
        if t > MAX_DISPATCH as usize {
            return Err(device_err(format!(
                "{t} query tokens exceed one dispatch ({MAX_DISPATCH})"
            )));
        }
        let limit = self
            .ctx
            .limits
            .max_storage_buffer_binding_size
            .min(self.ctx.limits.max_buffer_size);
        let int8 = arithmetic == Arithmetic::Int8Query
            && matches!(k.dtype, DTYPE_Q8 | DTYPE_Q4)
            && k.group as usize % QUERY_BLOCK == 0;
        // Scratch per head: the int8 path's scores, or the flash path's partials (per query
        // row and chunk of keys: the largest score, the sum and d weighted values).
        let key_chunks = l.div_ceil(FLASH_CHUNK);
        let per_head = if int8 {
            (t * l * 4) as u64
        } else {
            (t * key_chunks * (d + 2) * 4) as u64
        };
        if per_head > limit {
            return Err(device_err(format!(
                "the attention scratch of one head ({per_head} bytes for {t} queries over {l} \
                 keys) exceeds the adapter's storage binding limit of {limit} bytes"
            )));
        }
        // (No queries or no keys take no scratch.)
        let chunk = ((limit / per_head.max(1)) as usize)
            .clamp(1, hq)
            .min(MAX_DISPATCH as usize);
        let need = per_head * chunk as u64;
        if scratch.scores.as_ref().is_none_or(|b| b.size() < need) {
            scratch.scores = Some(self.ctx.storage("scores", need));
        }
        // The int8 query codes of all Hq·T rows, written by the first chunk's quantize pass.
        let blocks = (hq * t * d / QUERY_BLOCK) as u32;
        if int8 {
            let need = (hq * t * (d / 4 + 2 * d / QUERY_BLOCK) * 4) as u64;
            if scratch.qcodes.as_ref().is_none_or(|b| b.size() < need) {
                scratch.qcodes = Some(self.ctx.storage("query codes", need));
            }
        }
        let (mask_kind, mask_buf) = scratch.mask_buffer(self, mask);
        let scores = scratch.scores.as_ref().expect("allocated above");
        let qcodes = match (int8, &scratch.qcodes) {
            (true, Some(b)) => Bind::Buffer(b),
            _ => Bind::Unused,
        };
        let value_groups = (d as u32).div_ceil(VALUES_PER_GROUP);
        let quantize_groups = blocks.div_ceil(64);
        let qx = quantize_groups.clamp(1, MAX_DISPATCH);
        for head0 in (0..hq).step_by(chunk) {
            let nheads = chunk.min(hq - head0);
            let rows = (nheads * t) as u32;
            let (sx, sy) = (rows.min(MAX_DISPATCH), rows.div_ceil(MAX_DISPATCH));
            let params = AttnParams {
                hq: hq as u32,
                hkv: k.heads as u32,
                t: t as u32,
                l: l as u32,
                d: d as u32,
                cells: k.cells as u32,
                row_words: k.row_words as u32,
                dtype: k.dtype,
                group: k.group,
                mask_kind,
                head0: head0 as u32,
                nheads: nheads as u32,
                scale,
                rows_per_y: sx,
                int8: int8 as u32,
                sinks: sinks.is_some() as u32,
            };
            let score_grid = [(l as u32).div_ceil(64), t as u32, nheads as u32];
            let int8_passes = [
                (3, [qx, quantize_groups.div_ceil(qx), 1]),
                (0, score_grid),
                (1, [sx, sy, 1]),
                (2, [value_groups, t as u32, nheads as u32]),
            ];
            let flash_passes = [
                (4, [key_chunks as u32, t as u32, nheads as u32]),
                (5, [sx, sy, 1]),
            ];
            // One chunk of keys: flash_main writes the output itself.
            let passes = match (int8, head0) {
                (true, 0) => &int8_passes[..],
                (true, _) => &int8_passes[1..],
                (false, _) if key_chunks == 1 => &flash_passes[..1],
                (false, _) => &flash_passes[..],
            };
            self.ctx.dispatch(
                self.ctx.attention(),
                |_| params,
                &[],
                &[
                    Bind::Buffer(&q.buf),
                    Bind::Buffer(&k.buf),
                    Bind::Buffer(&v.buf),
                    Bind::Buffer(&mask_buf),
                    Bind::Buffer(scores),
                    Bind::Buffer(&out.buf),
                    qcodes,
                    // Without sinks the slot holds q (read, as slot 1 does; the shared unused
                    // buffer is qcodes', read-write): the shader does not read it.
                    Bind::Buffer(sinks.map_or(&q.buf, |s| &s.buf)),
                ],
                passes,
            );
        }
        Ok(())
    }
}

impl Backend for WgpuDevice {
    const ID: &'static str = "wgpu";
    const NAME: &'static str = "kvplug wgpu backend";

    fn open() -> Result<Self, String> {
        Context::open(None, None).map(WgpuDevice::new)
    }

    fn device_description(&self) -> String {
        let i = &self.ctx.info;
        format!("{} ({:?}, {:?})", i.name, i.backend, i.device_type)
    }

    fn features(&self) -> Vec<String> {
        let mut f = vec![format!("{:?}", self.ctx.info.backend).to_lowercase()];
        if self
            .ctx
            .adapter_features
            .contains(wgpu::Features::SHADER_F16)
        {
            f.push("shader-f16-available".into());
        }
        if self.ctx.subgroups {
            f.push("subgroups".into());
        }
        f.extend(kvplug_backend_kit::model::blocks::weights_features(&[]));
        f.push("attention-sinks".into());
        f
    }

    fn counters(&self) -> Vec<(String, u64)> {
        let c = self.ctx.created();
        vec![
            ("dispatches".into(), c.dispatches),
            ("read_back_bytes".into(), c.read_back_bytes),
            ("submits".into(), c.submits),
            ("buffers_created".into(), c.buffers),
            ("bind_groups_created".into(), c.bind_groups),
        ]
    }
}

kvplug_backend_kit::export_backend!(WgpuDevice, models);
