//! Test support every backend runs on its own device (feature `testing`): a [`Device`] that
//! fails on demand, the checks of the device contract built on it, and
//! [`backend_tests!`](crate::backend_tests), which runs them all as a backend crate's tests.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kvplug_core::oracle::{Attention, AttnDims, RefCache};
use kvplug_core::{Arithmetic, CacheConfig, CacheError, CacheKind, CacheVerbs, KvDtype, PosRange};
use kvplug_plugin_api::{HostTensor, TensorDtype};

use crate::cache::{KitCache, KitError};
use crate::device::{AttendMask, Device};
use crate::model::blocks::{dequantize_row, BlockFormat};

mod alloc_count;
mod argmax;
mod conv;
mod delta;
mod qkv;
mod recurrent;
mod ssm;
pub use alloc_count::CountingAllocator;
pub use argmax::{check_adjust_rows, check_argmax_rows, check_top_k_rows};
pub use conv::check_conv_verbs;
pub use delta::check_delta_verbs;
pub use qkv::check_norm_qkv_heads;
pub use ssm::check_ssm_verbs;

/// `D` with fault injection: after [`Faulty::fail_after`]`(n)`, the `n`-th next `attend` or
/// `write_rows` call (0-based) fails with a device error; everything else is `D`'s.
pub struct Faulty<D> {
    inner: D,
    /// Attend calls left before the fault, plus one; 0 = no fault armed.
    countdown: AtomicUsize,
}

impl<D: Device> Faulty<D> {
    /// Wraps `inner`, no fault armed.
    pub fn new(inner: D) -> Self {
        Faulty {
            inner,
            countdown: AtomicUsize::new(0),
        }
    }

    /// Arms one fault: `n` more attends (or row writes) succeed, the next fails.
    pub fn fail_after(&self, n: usize) {
        self.countdown.store(n + 1, Ordering::SeqCst);
    }

    /// Counts one faultable call; `Err` when it is the armed one.
    fn tick(&self) -> Result<(), KitError> {
        let armed = self
            .countdown
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |c| c.checked_sub(1))
            .unwrap_or(0);
        if armed == 1 {
            return Err(KitError::Device("injected fault".into()));
        }
        Ok(())
    }
}

impl<D: Device> Device for Faulty<D> {
    type Tensor = D::Tensor;
    type Pool = D::Pool;
    type Scratch = D::Scratch;

    fn kv_dtypes(&self) -> &[KvDtype] {
        self.inner.kv_dtypes()
    }
    fn dims<'t>(&self, t: &'t Self::Tensor) -> &'t [usize] {
        self.inner.dims(t)
    }
    fn pool_new(
        &self,
        dtype: KvDtype,
        heads: usize,
        d: usize,
        cells: usize,
    ) -> Result<D::Pool, KitError> {
        self.inner.pool_new(dtype, heads, d, cells)
    }
    fn pool_grow(&self, pool: &mut D::Pool, cells: usize, keep: usize) -> Result<(), KitError> {
        self.inner.pool_grow(pool, cells, keep)
    }
    fn pool_bytes(&self, pool: &D::Pool) -> usize {
        self.inner.pool_bytes(pool)
    }
    fn write_run(&self, pool: &mut D::Pool, start: usize, src: &D::Tensor) -> Result<(), KitError> {
        self.inner.write_run(pool, start, src)
    }
    fn scatter_rows(
        &self,
        pool: &mut D::Pool,
        cells: &[u32],
        src: &D::Tensor,
    ) -> Result<(), KitError> {
        self.inner.scatter_rows(pool, cells, src)
    }
    fn write_kv_run(
        &self,
        kp: &mut D::Pool,
        vp: &mut D::Pool,
        start: usize,
        k: &D::Tensor,
        v: &D::Tensor,
    ) -> Result<(), KitError> {
        self.inner.write_kv_run(kp, vp, start, k, v)
    }
    fn scatter_kv_rows(
        &self,
        kp: &mut D::Pool,
        vp: &mut D::Pool,
        cells: &[u32],
        k: &D::Tensor,
        v: &D::Tensor,
    ) -> Result<(), KitError> {
        self.inner.scatter_kv_rows(kp, vp, cells, k, v)
    }
    fn read_rows(&self, pool: &D::Pool, cells: &[u32]) -> Result<Vec<u8>, KitError> {
        self.inner.read_rows(pool, cells)
    }
    fn write_rows(&self, pool: &mut D::Pool, cells: &[u32], rows: &[u8]) -> Result<(), KitError> {
        self.tick()?;
        self.inner.write_rows(pool, cells, rows)
    }
    fn move_rows(&self, pool: &mut D::Pool, base: usize, rows: &[u32]) {
        self.inner.move_rows(pool, base, rows)
    }
    fn arithmetics(&self, dtype: KvDtype) -> Vec<Arithmetic> {
        self.inner.arithmetics(dtype)
    }
    fn attend(
        &self,
        arithmetic: Arithmetic,
        q: &D::Tensor,
        k: &D::Pool,
        v: &D::Pool,
        read_len: usize,
        mask: AttendMask<'_>,
        scale: f32,
        out: &mut D::Tensor,
        scratch: &mut D::Scratch,
    ) -> Result<(), KitError> {
        self.tick()?;
        self.inner
            .attend(arithmetic, q, k, v, read_len, mask, scale, out, scratch)
    }
    fn attend_sinks(
        &self,
        arithmetic: Arithmetic,
        q: &D::Tensor,
        k: &D::Pool,
        v: &D::Pool,
        read_len: usize,
        mask: AttendMask<'_>,
        scale: f32,
        sinks: &D::Tensor,
        out: &mut D::Tensor,
        scratch: &mut D::Scratch,
    ) -> Result<(), KitError> {
        self.tick()?;
        self.inner.attend_sinks(
            arithmetic, q, k, v, read_len, mask, scale, sinks, out, scratch,
        )
    }
    fn zeros(&self, dims: &[usize]) -> Result<D::Tensor, KitError> {
        self.inner.zeros(dims)
    }
    fn upload(&self, t: &HostTensor) -> Result<D::Tensor, KitError> {
        self.inner.upload(t)
    }
    fn download(&self, t: &D::Tensor, dtype: TensorDtype) -> Result<HostTensor, KitError> {
        self.inner.download(t, dtype)
    }
}

const HQ: usize = 4;
const HKV: usize = 2;
const D: usize = 64;
const LAYERS: usize = 3;

/// f16 (else f32, else bf16) and q4g32 (else q8g32) where the device lists their family.
fn float_and_quantized<D2: Device>(dev: &D2) -> Vec<KvDtype> {
    let has = |d: &KvDtype| dev.kv_dtypes().iter().any(|x| x.family() == d.family());
    let first = |of: &[KvDtype]| of.iter().copied().find(has);
    let q = |bits4| match bits4 {
        true => KvDtype::Q4 { group: 32 },
        false => KvDtype::Q8 { group: 32 },
    };
    let dtypes: Vec<KvDtype> = [
        first(&[KvDtype::F16, KvDtype::F32, KvDtype::Bf16]),
        first(&[q(true), q(false)]),
    ]
    .into_iter()
    .flatten()
    .collect();
    assert!(!dtypes.is_empty(), "the device lists no KV dtype");
    dtypes
}

/// Every dtype family the device lists, quantized ones at groups 32 and 16.
fn every_dtype<D2: Device>(dev: &D2) -> Vec<KvDtype> {
    dev.kv_dtypes()
        .iter()
        .flat_map(|d| match d.quant() {
            None => vec![*d],
            Some((8, _)) => vec![KvDtype::Q8 { group: 32 }, KvDtype::Q8 { group: 16 }],
            Some(_) => vec![KvDtype::Q4 { group: 32 }, KvDtype::Q4 { group: 16 }],
        })
        .collect()
}

/// `src` (`[heads, t, D]`) as canonical rows `[heads, t, row]`, as the reference encodes
/// them ([`kvplug_core::oracle::encode_row`]).
fn canonical_rows(dtype: KvDtype, src: &[f32]) -> Vec<u8> {
    src.chunks(D)
        .flat_map(|r| {
            let wide: Vec<f64> = r.iter().map(|&v| v as f64).collect();
            kvplug_core::oracle::encode_row(dtype, &wide)
        })
        .collect()
}

/// Rows `rows` of each head of `x` (`[HKV, n, D]`), as `[HKV, rows.len(), D]`.
fn pick(x: &[f32], n: usize, rows: &[usize]) -> Vec<f32> {
    let mut out = Vec::with_capacity(HKV * rows.len() * D);
    for h in 0..HKV {
        for &i in rows {
            out.extend_from_slice(&x[(h * n + i) * D..][..D]);
        }
    }
    out
}

/// Panics unless `got` equals `want`, canonical rows `[HKV, cells.len(), row]` of `dtype`,
/// naming the first differing head, cell, element and values.
fn assert_rows(dtype: KvDtype, cells: &[u32], got: &[u8], want: &[u8], what: &str) {
    if got == want {
        return;
    }
    let row = dtype.row_bytes(D);
    assert_eq!(
        got.len(),
        want.len(),
        "{dtype}: {what}: byte count of {} canonical rows [heads, cells, row]",
        cells.len()
    );
    let at = (0..got.len()).find(|&i| got[i] != want[i]).unwrap_or(0) / row;
    let (h, c) = (at / cells.len(), at % cells.len());
    let decode = |b: &[u8]| kvplug_core::oracle::decode_row(dtype, &b[at * row..][..row]);
    let (g, w) = (decode(got), decode(want));
    let e = (0..D)
        .find(|&e| g[e].to_bits() != w[e].to_bits())
        .unwrap_or(0);
    panic!(
        "{dtype}: {what}: head {h} cell {} element {e} reads {} where the reference holds {} (canonical rows are [heads, cells, row]; f16/bf16 round to nearest even, q8/q4 follow kvplug_core::quant)",
        cells[c], g[e], w[e]
    );
}

/// The saved-row contract on `device`, for every dtype it lists: rows written by
/// `write_run` and `scatter_rows` read back with `read_rows` in the canonical form
/// `[heads, cells, row]`, bit for bit as the reference encodes them (the form session files
/// hold and every backend must read), in the order of the cells asked for; `write_rows` of
/// canonical rows reads back unchanged and touches no other row; `move_rows` moves rows.
pub fn check_rows_round_trip<D2: Device>(device: D2) {
    let dev = device;
    for dtype in every_dtype(&dev) {
        let t = 6;
        let src = values(HKV, t, 11);
        let mut pool = dev.pool_new(dtype, HKV, D, 16).unwrap();
        dev.write_run(
            &mut pool,
            0,
            &dev.upload(&HostTensor::from_f32(&[HKV, t, D], &src))
                .unwrap(),
        )
        .unwrap();
        let cells: Vec<u32> = (0..t as u32).collect();
        let want = canonical_rows(dtype, &src);
        let got = dev.read_rows(&pool, &cells).unwrap();
        assert_rows(dtype, &cells, &got, &want, "rows written by write_run");
        // Scattered to cells 9, 7, 12: read back in that order, and ascending.
        let scattered = [9u32, 7, 12];
        let part = values(HKV, 3, 12);
        dev.scatter_rows(
            &mut pool,
            &scattered,
            &dev.upload(&HostTensor::from_f32(&[HKV, 3, D], &part))
                .unwrap(),
        )
        .unwrap();
        let got = dev.read_rows(&pool, &scattered).unwrap();
        let want = canonical_rows(dtype, &part);
        assert_rows(
            dtype,
            &scattered,
            &got,
            &want,
            "rows written by scatter_rows",
        );
        // Keys and values written together (`write_kv_run`, `scatter_kv_rows`): each pool
        // holds its own tensor's rows.
        let (a, b) = (values(HKV, 2, 14), values(HKV, 2, 15));
        let up = |x: &[f32]| dev.upload(&HostTensor::from_f32(&[HKV, 2, D], x)).unwrap();
        let mut kp = dev.pool_new(dtype, HKV, D, 8).unwrap();
        let mut vp = dev.pool_new(dtype, HKV, D, 8).unwrap();
        dev.write_kv_run(&mut kp, &mut vp, 3, &up(&a), &up(&b))
            .unwrap();
        dev.scatter_kv_rows(&mut kp, &mut vp, &[7, 0], &up(&b), &up(&a))
            .unwrap();
        for (pool, run, scattered, what) in [(&kp, &a, &b, "keys"), (&vp, &b, &a, "values")] {
            let got = dev.read_rows(pool, &[3, 4]).unwrap();
            let want = canonical_rows(dtype, run);
            assert_rows(
                dtype,
                &[3, 4],
                &got,
                &want,
                &format!("{what} of write_kv_run"),
            );
            let got = dev.read_rows(pool, &[7, 0]).unwrap();
            let want = canonical_rows(dtype, scattered);
            assert_rows(
                dtype,
                &[7, 0],
                &got,
                &want,
                &format!("{what} of scatter_kv_rows"),
            );
        }
        let ascending = pick(&part, 3, &[1, 0, 2]);
        let got = dev.read_rows(&pool, &[7, 9, 12]).unwrap();
        let want = canonical_rows(dtype, &ascending);
        assert_rows(
            dtype,
            &[7, 9, 12],
            &got,
            &want,
            "scattered rows read ascending",
        );
        // Canonical rows written to cells 14, 3 (out of order) read back unchanged, alone
        // too; the rows around them are untouched.
        let two = values(HKV, 2, 13);
        let rows = canonical_rows(dtype, &two);
        dev.write_rows(&mut pool, &[14, 3], &rows).unwrap();
        let got = dev.read_rows(&pool, &[14, 3]).unwrap();
        assert_rows(dtype, &[14, 3], &got, &rows, "rows written by write_rows");
        let third = pick(&two, 2, &[1]);
        let got = dev.read_rows(&pool, &[3]).unwrap();
        let want = canonical_rows(dtype, &third);
        assert_rows(
            dtype,
            &[3],
            &got,
            &want,
            "a row written by write_rows, read alone",
        );
        let around = [0u32, 1, 2, 4, 5];
        let kept = pick(&src, t, &[0, 1, 2, 4, 5]);
        let got = dev.read_rows(&pool, &around).unwrap();
        let want = canonical_rows(dtype, &kept);
        assert_rows(dtype, &around, &got, &want, "rows write_rows was not given");
        // A tree commit: rows 4 and 7 move to 1 and 2.
        let moved = dev.read_rows(&pool, &[4, 7]).unwrap();
        dev.move_rows(&mut pool, 1, &[4, 7]);
        let got = dev.read_rows(&pool, &[1, 2]).unwrap();
        assert_rows(
            dtype,
            &[1, 2],
            &got,
            &moved,
            "rows 4 and 7 after move_rows(base 1)",
        );
    }
}

/// Growth on `device`, for every dtype it lists: a full pool (keep = its size) and a partly
/// filled one grow keeping rows `[0, keep)` bit for bit, and the new rows can be written.
pub fn check_pool_growth<D2: Device>(device: D2) {
    let dev = device;
    for dtype in every_dtype(&dev) {
        for (cells, keep) in [(16, 16), (16, 5)] {
            let src = values(HKV, keep, 21);
            let mut pool = dev.pool_new(dtype, HKV, D, cells).unwrap();
            dev.write_run(
                &mut pool,
                0,
                &dev.upload(&HostTensor::from_f32(&[HKV, keep, D], &src))
                    .unwrap(),
            )
            .unwrap();
            let kept: Vec<u32> = (0..keep as u32).collect();
            let before = dev.read_rows(&pool, &kept).unwrap();
            dev.pool_grow(&mut pool, 2 * cells, keep).unwrap();
            let got = dev.read_rows(&pool, &kept).unwrap();
            let what = format!("rows kept by growing a pool of {cells} cells (keep {keep})");
            assert_rows(dtype, &kept, &got, &before, &what);
            let last = values(HKV, 1, 22);
            dev.write_run(
                &mut pool,
                2 * cells - 1,
                &dev.upload(&HostTensor::from_f32(&[HKV, 1, D], &last))
                    .unwrap(),
            )
            .unwrap();
            let end = [2 * cells as u32 - 1];
            let got = dev.read_rows(&pool, &end).unwrap();
            let want = canonical_rows(dtype, &last);
            assert_rows(dtype, &end, &got, &want, "the grown pool's last row");
            assert!(
                dev.pool_bytes(&pool) >= 2 * cells * HKV * dtype.row_bytes(D),
                "{dtype}: pool_bytes of a grown pool"
            );
        }
    }
}

/// `attend` on `device`, for every dtype it lists and every arithmetic it declares for it,
/// against the oracle's f64 attention and that arithmetic's bound: no mask, the causal mask,
/// an explicit mask, and a query whose mask row is all false, which must read exactly zeros
/// (never NaN); each also through `attend_sinks` with a sink per query head.
pub fn check_attend_masks<D2: Device>(device: D2) {
    use kvplug_core::oracle::{attend_sinks, RefMask};
    let dev = device;
    let (t, l) = (3, 9);
    let q = values(HQ, t, 31);
    let (k, v) = (values(HKV, l, 32), values(HKV, l, 33));
    // Query 1 sees nothing; queries 0 and 2 see alternate keys.
    let explicit: Vec<bool> = (0..t * l).map(|i| i / l != 1 && (i % l) % 2 == 0).collect();
    for dtype in every_dtype(&dev) {
        let (mut kp, mut vp) = (
            dev.pool_new(dtype, HKV, D, 16).unwrap(),
            dev.pool_new(dtype, HKV, D, 16).unwrap(),
        );
        let up = |x: &[f32], h, n| dev.upload(&HostTensor::from_f32(&[h, n, D], x)).unwrap();
        dev.write_run(&mut kp, 0, &up(&k, HKV, l)).unwrap();
        dev.write_run(&mut vp, 0, &up(&v, HKV, l)).unwrap();
        // What the pools hold, as the oracle takes it.
        let stored = |x: &[f32]| -> Vec<f64> {
            x.chunks(D)
                .flat_map(|r| {
                    kvplug_core::oracle::store_rounded(
                        dtype,
                        &r.iter().map(|&v| v as f64).collect::<Vec<_>>(),
                    )
                })
                .collect()
        };
        let wide: Vec<f64> = q.iter().map(|&x| x as f64).collect();
        let scale = 1.0 / (D as f32).sqrt();
        let mut arithmetics = dev.arithmetics(dtype);
        if !arithmetics.contains(&Arithmetic::F32) {
            arithmetics.push(Arithmetic::F32);
        }
        for (((name, mask, refmask), arithmetic), with_sinks) in [
            ("no", AttendMask::None, RefMask::None),
            ("causal", AttendMask::Causal, RefMask::Causal),
            (
                "explicit",
                AttendMask::Explicit(&explicit),
                RefMask::Explicit(&explicit),
            ),
        ]
        .into_iter()
        .flat_map(|m| arithmetics.iter().map(move |&a| (m, a)))
        .flat_map(|c| [(c, false), (c, true)])
        {
            // Sinks about the scores' size, one below and one above them.
            let sinks: Vec<f32> = (0..HQ).map(|h| h as f32 * 0.75 - 0.5).collect();
            let mut out = dev.zeros(&[HQ, t, D]).unwrap();
            let mut scratch = D2::Scratch::default();
            let qt = up(&q, HQ, t);
            match with_sinks {
                false => dev.attend(
                    arithmetic,
                    &qt,
                    &kp,
                    &vp,
                    l,
                    mask,
                    scale,
                    &mut out,
                    &mut scratch,
                ),
                true => dev.attend_sinks(
                    arithmetic,
                    &qt,
                    &kp,
                    &vp,
                    l,
                    mask,
                    scale,
                    &dev.upload(&HostTensor::from_f32(&[HQ], &sinks)).unwrap(),
                    &mut out,
                    &mut scratch,
                ),
            }
            .unwrap();
            let got = dev
                .download(&out, TensorDtype::F32)
                .unwrap()
                .to_f32()
                .unwrap();
            let dims = AttnDims {
                n_q_heads: HQ,
                n_kv_heads: HKV,
                n_tok: t,
                read_len: l,
                head_dim: D,
            };
            let (ks, vs) = (stored(&k), stored(&v));
            let wide_sinks: Vec<f64> = sinks.iter().map(|&s| s as f64).collect();
            let sinks = with_sinks.then_some(&wide_sinks[..]);
            let want = attend_sinks(
                dims,
                &wide,
                &ks,
                &vs,
                scale as f64,
                refmask,
                arithmetic,
                sinks,
            );
            let sinks = if with_sinks { ", sinks" } else { "" };
            assert_within_bound(
                &format!("{dtype} {arithmetic} {name} mask{sinks}"),
                &got,
                &want,
                dims,
                |tok| {
                    if name == "explicit" && tok == 1 {
                        "; this query sees no key and must read zeros"
                    } else {
                        ""
                    }
                },
            );
        }
    }
}

/// Asserts that every value of an attention output `got` (`[Hq, T, D]` of `dims`) is finite
/// and within the oracle's bound of `want`; a failure names `what`, the value's place and
/// `hint(token)`.
pub fn assert_within_bound(
    what: &str,
    got: &[f32],
    want: &Attention,
    dims: AttnDims,
    hint: impl Fn(usize) -> &'static str,
) {
    let (t, d) = (dims.n_tok, dims.head_dim);
    assert_eq!(got.len(), want.out.len(), "{what}: output size");
    for (i, g) in got.iter().enumerate() {
        let (h, tok, e) = (i / (t * d), (i / d) % t, i % d);
        let err = (*g as f64 - want.out[i]).abs();
        assert!(
            g.is_finite() && err <= want.bound[i],
            "{what}: query head {h} token {tok} element {e} is {g}, the oracle gives {} (bound {:.2e}){}",
            want.out[i],
            want.bound[i],
            hint(tok)
        );
    }
}

/// Deterministic `[h, t, D]` activations.
fn values(h: usize, t: usize, salt: usize) -> Vec<f32> {
    (0..h * t * D)
        .map(|i| ((i * 7919 + salt * 104_729) as f32 * 0.001).sin())
        .collect()
}

/// Runs one step on `cache` (or fails at the armed layer), returning each layer's output.
fn step<D2: Device>(
    cache: &mut KitCache<D2>,
    positions: &[i32],
    seqs: Option<&[i32]>,
    salt: usize,
) -> Result<Vec<Vec<f32>>, KitError> {
    let dev = cache.device().clone();
    let t = positions.len();
    let up = |h: usize, s: usize| dev.upload(&HostTensor::from_f32(&[h, t, D], &values(h, t, s)));
    let mut step = cache.step(positions, seqs)?;
    let mut outs = Vec::new();
    for layer in 0..LAYERS {
        let s = salt * 16 + layer * 3;
        let (q, k, v) = (up(HQ, s)?, up(HKV, s + 1)?, up(HKV, s + 2)?);
        let mut out = dev.zeros(&[HQ, t, D])?;
        step.attend(layer, &q, &k, &v, 1.0 / (D as f32).sqrt(), &mut out)?;
        outs.push(
            dev.download(&out, TensorDtype::F32)?
                .to_f32()
                .expect("f32 output"),
        );
    }
    step.commit()?;
    Ok(outs)
}

/// The same step on the oracle.
fn oracle_step(
    o: &mut RefCache,
    positions: &[i32],
    seqs: Option<&[i32]>,
    salt: usize,
) -> Vec<Attention> {
    if let Some(s) = seqs {
        o.begin_step(s).unwrap();
    }
    let t = positions.len();
    let wide = |h: usize, s: usize| {
        values(h, t, s)
            .iter()
            .map(|&x| x as f64)
            .collect::<Vec<_>>()
    };
    o.open_step(positions).unwrap();
    let outs = (0..LAYERS)
        .map(|layer| {
            let s = salt * 16 + layer * 3;
            o.attend_layer(
                layer,
                &wide(HQ, s),
                &wide(HKV, s + 1),
                &wide(HKV, s + 2),
                1.0 / (D as f64).sqrt(),
            )
            .unwrap()
        })
        .collect();
    o.commit_step();
    outs
}

/// What a runner can observe of a cache.
fn observe<D2: Device>(c: &KitCache<D2>) -> (Vec<bool>, Vec<Option<usize>>, usize, usize) {
    let s = c.stats();
    (
        (0..=c.capacity() + 1).map(|n| c.can_extend(n)).collect(),
        (0..3).map(|q| c.seq_len(q).ok()).collect(),
        s.high_water,
        s.live_cells,
    )
}

/// One failing step and what follows it, per kind. `prep` brings a cache (and the oracle)
/// to the state before the step; `next` is the step that fails at layer `k`, then is
/// retried; `after` continues decoding.
type Script = (
    CacheKind,
    fn(&mut dyn FnMut(&[i32], Option<&[i32]>, usize)),
    (&'static [i32], Option<&'static [i32]>),
    &'static [(&'static [i32], Option<&'static [i32]>)],
);

/// The rollback check of the architecture's step contract, on `device`: for every kind and
/// a float and a quantized dtype, a device error at layer `k` of 3 leaves `seq_len`,
/// `can_extend`, high-water mark, live cells, later plans (path and read window) and every
/// later output identical to a cache that never saw the step; retrying the step then matches
/// the oracle (within its bound) and the never-failed twin (bit for bit).
pub fn check_step_rollback<D2: Device>(device: D2) {
    let dev = Arc::new(Faulty::new(device));
    let scripts: [Script; 3] = [
        (
            CacheKind::Contiguous,
            |run| run(&[0, 1, 2, 3, 4], None, 1),
            (&[5, 6, 7], None),
            &[(&[8], None), (&[9], None)],
        ),
        (
            CacheKind::Seq,
            |run| run(&[0, 1, 2, 3, 4, 5], Some(&[0; 6][..]), 1),
            (&[6, 6], Some(&[0, 1])),
            &[(&[7, 7], Some(&[0, 1])), (&[8], Some(&[1]))],
        ),
        (
            CacheKind::Tree,
            |run| run(&[0, 1, 2, 3], None, 1),
            (&[4, 5, 5], None),
            &[(&[6], None)],
        ),
    ];
    for (kind, prep, (next, next_seqs), after) in scripts {
        for dtype in float_and_quantized(&*dev) {
            for k in 0..LAYERS {
                let cfg = CacheConfig {
                    capacity: 64,
                    n_layers: LAYERS,
                    n_kv_heads: HKV,
                    head_dim: D,
                    min_chunk: 4,
                    kv_dtype: dtype,
                    sliding: None,
                    conv: None,
                    delta: None,
                    ssm: None,
                };
                let mut failed = KitCache::new(dev.clone(), kind, cfg).unwrap();
                let mut twin = KitCache::new(dev.clone(), kind, cfg).unwrap();
                let mut oracle = RefCache::new(kind, cfg).unwrap();
                oracle.set_arithmetic(failed.arithmetic());
                let mut run_all = |pos: &[i32], seqs: Option<&[i32]>, salt: usize| {
                    step(&mut failed, pos, seqs, salt).unwrap();
                    step(&mut twin, pos, seqs, salt).unwrap();
                    oracle_step(&mut oracle, pos, seqs, salt);
                };
                prep(&mut run_all);
                if kind == CacheKind::Tree {
                    for c in [&mut failed, &mut twin] {
                        c.propose(&[-1, 0, 0]).unwrap();
                    }
                    oracle.propose(&[-1, 0, 0]).unwrap();
                }
                if kind == CacheKind::Seq {
                    for c in [&mut failed, &mut twin] {
                        c.seq_cp(0, 1, PosRange::ALL).unwrap();
                    }
                    oracle.seq_cp(0, 1, None, None).unwrap();
                }
                let before = observe(&failed);
                dev.fail_after(k);
                let err = step(&mut failed, next, next_seqs, 2).unwrap_err();
                assert!(
                    matches!(err, KitError::Device(_)),
                    "{kind} {dtype} layer {k}: {err}"
                );
                assert_eq!(
                    observe(&failed),
                    before,
                    "{kind} {dtype}: state after a fault at layer {k}"
                );
                assert_eq!(observe(&failed), observe(&twin));
                // Retry, then go on: identical to the twin, inside the oracle's bound.
                let retry = (next, next_seqs);
                for (i, (pos, seqs)) in std::iter::once(&retry).chain(after).enumerate() {
                    if kind == CacheKind::Tree && i == 1 {
                        for c in [&mut failed, &mut twin] {
                            c.commit(&[0, 2]).unwrap();
                        }
                        oracle.commit(&[0, 2]).unwrap();
                    }
                    let got = step(&mut failed, pos, *seqs, 2 + i).unwrap();
                    let want = step(&mut twin, pos, *seqs, 2 + i).unwrap();
                    assert_eq!(
                        got, want,
                        "{kind} {dtype} fault at layer {k}: step {i} after"
                    );
                    let plan = |c: &KitCache<Faulty<D2>>| {
                        let s = c.stats();
                        (s.last_plan, s.last_read_len)
                    };
                    assert_eq!(
                        plan(&failed),
                        plan(&twin),
                        "{kind} {dtype}: plan of step {i}"
                    );
                    for (g, w) in got.iter().zip(oracle_step(&mut oracle, pos, *seqs, 2 + i)) {
                        for (e, (&x, (&o, &b))) in
                            g.iter().zip(w.out.iter().zip(&w.bound)).enumerate()
                        {
                            assert!(
                                (x as f64 - o).abs() <= b,
                                "{kind} {dtype} fault at layer {k}: step {i} element {e}: {x} vs oracle {o} (bound {b:e})"
                            );
                        }
                    }
                    assert_eq!(observe(&failed), observe(&twin));
                }
            }
        }
    }
}

/// The all-or-nothing check of [`KitCache::import_seq`] on `device`: a device error while
/// writing the second chunk of a multi-chunk import leaves a seq cache (another sequence
/// live) and an empty contiguous cache exactly as before; the retried import reads back
/// bit for bit, and the contiguous one decodes like the sequence it was exported from.
pub fn check_import_rollback<D2: Device>(device: D2) {
    let dev = Arc::new(Faulty::new(device));
    let n = crate::cache::IMPORT_CHUNK + 88;
    let positions: Vec<i32> = (0..n as i32).collect();
    for dtype in float_and_quantized(&*dev) {
        let cfg = CacheConfig {
            capacity: 2 * n + 8,
            n_layers: LAYERS,
            n_kv_heads: HKV,
            head_dim: D,
            min_chunk: 4,
            kv_dtype: dtype,
            sliding: None,
            conv: None,
            delta: None,
            ssm: None,
        };
        let mut src = KitCache::new(dev.clone(), CacheKind::Seq, cfg).unwrap();
        step(&mut src, &positions, Some(&vec![0; n]), 1).unwrap();
        let rows = src.export_seq(0).unwrap();
        for kind in [CacheKind::Seq, CacheKind::Contiguous] {
            let seq = if kind == CacheKind::Seq { 1 } else { 0 };
            let mut dst = KitCache::new(dev.clone(), kind, cfg).unwrap();
            if kind == CacheKind::Seq {
                step(&mut dst, &[0, 1, 2], Some(&[2, 2, 2]), 3).unwrap();
            }
            let before = observe(&dst);
            // The first chunk writes K and V of every layer; fail inside the second.
            dev.fail_after(2 * LAYERS + 1);
            let err = dst.import_seq(seq, &rows).unwrap_err();
            assert!(matches!(err, KitError::Device(_)), "{kind} {dtype}: {err}");
            assert_eq!(
                observe(&dst),
                before,
                "{kind} {dtype}: state after a failed import"
            );
            dst.import_seq(seq, &rows).unwrap();
            let back = dst.export_seq(seq).unwrap();
            let differs = (0..LAYERS).find(|&l| back.k[l] != rows.k[l] || back.v[l] != rows.v[l]);
            assert!(
                back.positions == rows.positions && differs.is_none(),
                "{kind} {dtype}: the rows read back after the import differ from those imported (positions equal: {}, first differing layer: {differs:?})",
                back.positions == rows.positions
            );
            if kind == CacheKind::Contiguous {
                // Same rows, same read path: the same output bit for bit.
                let resumed = step(&mut dst, &[n as i32], None, 9).unwrap();
                let original = step(&mut src, &[n as i32], Some(&[0]), 9).unwrap();
                assert_eq!(resumed, original, "{dtype}: decoding after the import");
            }
        }
    }
}

/// One decode step for benchmarks: a one-layer contiguous cache holding `l - 1` tokens of
/// history, and the q/k/v of token `l - 1`. [`DecodeCase::step`] rewinds, attends and reads
/// the output back (which waits for an asynchronous device), so every call measures the same
/// step over a window of `l`.
pub struct DecodeCase<D: Device> {
    device: Arc<D>,
    cache: KitCache<D>,
    q: D::Tensor,
    k: D::Tensor,
    v: D::Tensor,
    out: D::Tensor,
    history: usize,
}

impl<D: Device> DecodeCase<D> {
    /// `hq` query and `hkv` KV heads of `head_dim`, `dtype` pools, window `l` (capacity 8192).
    pub fn new(
        device: Arc<D>,
        hq: usize,
        hkv: usize,
        head_dim: usize,
        dtype: KvDtype,
        l: usize,
    ) -> Self {
        let params = kvplug_core::ModelCacheParams {
            n_layers: 1,
            n_kv_heads: hkv,
            head_dim,
        };
        let cfg = kvplug_core::make_config(&params, 8192, dtype);
        let mut cache = KitCache::new(device.clone(), CacheKind::Contiguous, cfg).unwrap();
        let tensor = |h: usize, t: usize| {
            let data: Vec<f32> = (0..h * t * head_dim)
                .map(|i| (i as f32 * 0.013).sin())
                .collect();
            device
                .upload(&HostTensor::from_f32(&[h, t, head_dim], &data))
                .unwrap()
        };
        let history = l - 1;
        let pos: Vec<i32> = (0..history as i32).collect();
        let mut out = device.zeros(&[hq, history, head_dim]).unwrap();
        let (q, k, v) = (
            tensor(hq, history),
            tensor(hkv, history),
            tensor(hkv, history),
        );
        cache
            .update_and_attend(0, &q, &k, &v, &pos, 0.125, &mut out)
            .unwrap();
        DecodeCase {
            out: device.zeros(&[hq, 1, head_dim]).unwrap(),
            q: tensor(hq, 1),
            k: tensor(hkv, 1),
            v: tensor(hkv, 1),
            device,
            cache,
            history,
        }
    }

    /// The arithmetics the cache declares, its default first (f32 is among them).
    pub fn arithmetics(&self) -> Vec<Arithmetic> {
        self.cache.arithmetics()
    }

    /// Computes later steps in `arithmetic` (one of [`DecodeCase::arithmetics`]).
    pub fn set_arithmetic(&mut self, arithmetic: Arithmetic) -> Result<(), CacheError> {
        self.cache.set_arithmetic(arithmetic)
    }

    /// The decode step, its output read back.
    pub fn step(&mut self) -> HostTensor {
        self.cache.rewind(self.history).unwrap();
        let pos = [self.history as i32];
        self.cache
            .update_and_attend(0, &self.q, &self.k, &self.v, &pos, 0.125, &mut self.out)
            .unwrap();
        self.device.download(&self.out, TensorDtype::F32).unwrap()
    }
}

/// A tiny Llama package (2 layers, hidden 64, 4 query / 2 KV heads, vocab 40) with
/// deterministic pseudo-random f32 weights, written to a fresh directory of the temp dir
/// whose name starts with `kvplug-{tag}-`, removed when the returned handle drops.
pub fn tiny_llama(tag: &str) -> tempfile::TempDir {
    use safetensors::tensor::{Dtype, TensorView};
    let tmp = tempfile::Builder::new()
        .prefix(&format!("kvplug-{tag}-"))
        .tempdir()
        .unwrap();
    let dir = tmp.path();
    std::fs::write(
        dir.join("config.json"),
        r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
            "vocab_size": 40}"#,
    )
    .unwrap();
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![40, 64]),
        ("model.norm.weight".into(), vec![64]),
        ("lm_head.weight".into(), vec![40, 64]),
    ];
    for l in 0..2 {
        for (name, shape) in [
            ("input_layernorm", vec![64]),
            ("post_attention_layernorm", vec![64]),
            ("self_attn.q_proj", vec![64, 64]),
            ("self_attn.k_proj", vec![32, 64]),
            ("self_attn.v_proj", vec![32, 64]),
            ("self_attn.o_proj", vec![64, 64]),
            ("mlp.gate_proj", vec![128, 64]),
            ("mlp.up_proj", vec![128, 64]),
            ("mlp.down_proj", vec![64, 128]),
        ] {
            shapes.push((format!("model.layers.{l}.{name}.weight"), shape));
        }
    }
    let bytes: Vec<Vec<u8>> = shapes
        .iter()
        .enumerate()
        .map(|(i, (_, s))| {
            (0..s.iter().product::<usize>())
                .flat_map(|j| (((i * 7919 + j) as f32 * 0.37).sin() * 0.2).to_le_bytes())
                .collect()
        })
        .collect();
    let views: Vec<(&str, TensorView<'_>)> = shapes
        .iter()
        .zip(&bytes)
        .map(|((n, s), b)| {
            (
                n.as_str(),
                TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    tmp
}

/// xorshift64*: reproducible test data without a dependency.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn bits(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.bits() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in [-1, 1).
    pub fn signed(&mut self) -> f32 {
        (2.0 * self.unit() - 1.0) as f32
    }
}

/// `blocks` valid random blocks of `f`: random code bytes (so random 6-bit K-quant scales
/// and minimums too), every f16 field (d, m, dmin) of random sign and magnitude in
/// [1e-3, 1e-1], Q6_K's i8 scales in ±127, MXFP4's scales in 2^-10..=2^-3.
pub fn random_blocks(f: BlockFormat, blocks: usize, rng: &mut Rng) -> Vec<u8> {
    let bb = f.block_bytes();
    let mut b: Vec<u8> = (0..blocks * bb).map(|_| rng.bits() as u8).collect();
    for blk in b.chunks_exact_mut(bb) {
        for &at in f.half_fields() {
            let mag = 1e-3 + rng.unit() * (1e-1 - 1e-3);
            let v = if rng.bits() & 1 == 0 { mag } else { -mag };
            blk[at..at + 2].copy_from_slice(&half::f16::from_f64(v).to_le_bytes());
        }
        if f == BlockFormat::Mxfp4 {
            blk[0] = 118 + (rng.bits() % 8) as u8;
        }
        if f == BlockFormat::Q6K {
            for s in &mut blk[192..208] {
                *s = ((rng.bits() % 255) as i64 - 127) as i8 as u8;
            }
        }
    }
    b
}

/// Each value's additive part in the whole blocks `row` of `f` (`m`, or `−dmin·m_j` for the
/// K-quants): the value with its code zeroed; 0 for formats without one (their offsets are
/// integers folded into the code, `d·(q − 8)`). A kernel's rounding error is bounded in terms
/// of the scaled code and this part separately, since it may sum them apart.
pub fn additive_parts(f: BlockFormat, row: &[u8], out: &mut [f32]) {
    let codes = match f {
        BlockFormat::Q4_1 => 4..20,
        BlockFormat::Q5_1 => 4..24,
        BlockFormat::Q4K => 16..144,
        BlockFormat::Q5K => 16..176,
        _ => return out.fill(0.0),
    };
    let mut zeroed = row.to_vec();
    zeroed
        .chunks_exact_mut(f.block_bytes())
        .for_each(|b| b[codes.clone()].fill(0));
    dequantize_row(f, &zeroed, out);
}

/// Every device check of [`testing`](crate::testing) as `#[test]` functions of the calling
/// crate (as burn's `testgen_all!` does for its backends): step rollback, import rollback,
/// the canonical rows round trip, pool growth (a full pool included) and attention under
/// each mask kind (a query that sees no key reads zeros). `$device` is evaluated once per
/// test. Needs the kit's `testing` feature (a dev-dependency with
/// `features = ["testing"]`).
///
/// ```text
/// // tests/kit.rs of a backend crate
/// kvplug_backend_kit::backend_tests!(my_backend::MyDevice::new());
/// ```
#[macro_export]
macro_rules! backend_tests {
    ($device:expr) => {
        #[test]
        fn kit_step_rollback() {
            $crate::testing::check_step_rollback($device);
        }
        #[test]
        fn kit_import_rollback() {
            $crate::testing::check_import_rollback($device);
        }
        #[test]
        fn kit_rows_round_trip() {
            $crate::testing::check_rows_round_trip($device);
        }
        #[test]
        fn kit_pool_growth() {
            $crate::testing::check_pool_growth($device);
        }
        #[test]
        fn kit_attend_masks() {
            $crate::testing::check_attend_masks($device);
        }
        #[test]
        fn kit_conv_verbs() {
            $crate::testing::check_conv_verbs($device);
        }
        #[test]
        fn kit_delta_verbs() {
            $crate::testing::check_delta_verbs($device);
        }
        #[test]
        fn kit_ssm_verbs() {
            $crate::testing::check_ssm_verbs($device);
        }
    };
}

/// The [`ModelDevice`](crate::model::ModelDevice) checks of [`testing`](crate::testing) as
/// `#[test]` functions of the calling crate, beside [`backend_tests!`](crate::backend_tests)
/// for a backend that serves models: the device argmax, top-k and logit adjustments against
/// the host's, a layer's attention inputs in one op against an f64 reference. `$device` is evaluated once
/// per test.
#[macro_export]
macro_rules! model_device_tests {
    ($device:expr) => {
        #[test]
        fn kit_argmax_rows() {
            $crate::testing::check_argmax_rows($device);
        }
        #[test]
        fn kit_top_k_rows() {
            $crate::testing::check_top_k_rows($device);
        }
        #[test]
        fn kit_adjust_rows() {
            $crate::testing::check_adjust_rows($device);
        }
        #[test]
        fn kit_norm_qkv_heads() {
            $crate::testing::check_norm_qkv_heads($device);
        }
    };
}
