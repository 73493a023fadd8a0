//! [`Context`]: a cache bound to a model's `forward`, and [`Context::decode`].

use std::ops::Deref;

use kvplug_core::{Adjust, CacheError, CacheKind, KeyBasis, KvDtype};
use kvplug_plugin_api::abi_stable::std_types::{RSlice, RVec};
use kvplug_plugin_api::{AbiErrorKind, HostTensor, MethodHandle, PluginError, TensorDtype};

use crate::batch::Batch;
use crate::cache::Cache;
use crate::error::RuntimeError;

/// One cache of a kind bound to a model's `forward` inside the backend (the `cache_key`
/// rendezvous happened when it was made). [`Context::decode`] runs a batch; the cache's verbs
/// (`rewind`, `seq_cp`, `prefix_attach`, `propose`, `export_seq`, ...) are reached through
/// `Deref` to its [`Cache`]. Dropping the context erases the cache's key; the plugin's
/// binding releases the cache object with it.
pub struct Context {
    cache: Cache,
    method: MethodHandle,
    vocab: usize,
    /// Its cache's storage dtype.
    kv_dtype: KvDtype,
    /// The basis its forward writes keys in (what its rows mean in a session file).
    keys: KeyBasis,
    /// The last decode's logits, `rows × vocab`, reused from step to step.
    logits: Vec<f32>,
    /// The last [`Context::decode_argmax`]'s ids, or [`Context::decode_top_k`]'s ids and
    /// their logits (reusing `logits`).
    ids: Vec<i32>,
    /// `forward`'s input and output tensors, reused from step to step (a decode loop
    /// allocates none once warm).
    inputs: RVec<HostTensor>,
    outputs: RVec<HostTensor>,
    /// A step's adjustments as inputs 6 and 7 take them.
    adjust_at: Vec<i32>,
    adjust_by: Vec<f32>,
    rows: usize,
    decodes: u64,
}

/// The logits a [`Context::decode`] returned: one row of `vocab` values per token the batch
/// asked logits for, in batch order.
#[derive(Clone, Copy, Debug)]
pub struct Logits<'a> {
    data: &'a [f32],
    vocab: usize,
}

impl<'a> Logits<'a> {
    /// Rows returned.
    pub fn len(&self) -> usize {
        self.data.len() / self.vocab
    }

    /// Whether no row came back.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Row `i` (the `i`-th token that asked for logits). Panics when out of range.
    pub fn row(&self, i: usize) -> &'a [f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }

    /// Every row, in order.
    pub fn rows(&self) -> impl Iterator<Item = &'a [f32]> + 'a {
        self.data.chunks_exact(self.vocab)
    }
}

impl Context {
    pub(crate) fn new(
        cache: Cache,
        method: MethodHandle,
        vocab: usize,
        kv_dtype: KvDtype,
        keys: KeyBasis,
    ) -> Self {
        Context {
            cache,
            method,
            vocab,
            kv_dtype,
            keys,
            logits: Vec::new(),
            ids: Vec::new(),
            inputs: RVec::from(vec![
                HostTensor::empty(),
                HostTensor::empty(),
                HostTensor::empty(),
                HostTensor::from_i32(&[1], &[0]),
                HostTensor::from_i32(&[1], &[1]),
                HostTensor::from_i32(&[1], &[0]),
                HostTensor::empty(),
                HostTensor::empty(),
            ]),
            adjust_at: Vec::new(),
            adjust_by: Vec::new(),
            outputs: RVec::new(),
            rows: 0,
            decodes: 0,
        }
    }

    /// Logits per row.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Its cache's storage dtype.
    pub fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype
    }

    /// The basis its forward writes keys in: rows exported from it hold keys in this basis,
    /// and rows imported into it must too (rows do not say their basis: a session file
    /// does, and `Session::check_fits` compares it).
    pub fn key_basis(&self) -> KeyBasis {
        self.keys
    }

    /// Forward passes run so far.
    pub fn decodes(&self) -> u64 {
        self.decodes
    }

    /// Runs `batch` through the model, writing its K/V into the cache, and returns the
    /// logits of the rows it asked for. A seq cache learns each token's sequence first
    /// (`begin_step`); the other kinds hold one sequence, so their batches use sequence 0.
    /// A refused batch leaves the cache as it was.
    pub fn decode(&mut self, batch: &Batch) -> Result<Logits<'_>, RuntimeError> {
        let rows = self.step(batch, Reduce::None, &[])?;
        if !first_output(&self.outputs)?.read_f32_into(&mut self.logits)
            || self.logits.len() != rows * self.vocab
        {
            return Err(PluginError::new(
                AbiErrorKind::Backend,
                format!(
                    "forward returned {} logits for {rows} rows of {}",
                    self.logits.len(),
                    self.vocab
                ),
            )
            .into());
        }
        self.rows = if batch.logit_rows().is_empty() {
            0
        } else {
            rows
        };
        Ok(Logits {
            data: &self.logits[..self.rows * self.vocab],
            vocab: self.vocab,
        })
    }

    /// [`Context::decode`] returning each asked row's greedy token instead of its logits:
    /// the index of its largest logit (the lowest on ties, never a NaN, as
    /// [`kvplug_core::argmax()`] picks it) after `adjust`, computed where the logits are, so
    /// a step reads back 4 bytes a row rather than `4 · vocab`. `adjust` changes logits
    /// before they are picked: `(row, token, how)`, `row` counting the rows the batch asks
    /// for, each place once (logit bias and penalties).
    pub fn decode_argmax(
        &mut self,
        batch: &Batch,
        adjust: &[(usize, i32, Adjust)],
    ) -> Result<&[i32], RuntimeError> {
        let rows = self.step(batch, Reduce::Argmax, adjust)?;
        if !first_output(&self.outputs)?.read_i32_into(&mut self.ids) || self.ids.len() != rows {
            return Err(PluginError::new(
                AbiErrorKind::Backend,
                format!("forward's argmax returned no {rows} i32 ids"),
            )
            .into());
        }
        let asked = if batch.logit_rows().is_empty() {
            0
        } else {
            rows
        };
        Ok(&self.ids[..asked])
    }

    /// [`Context::decode`] returning each asked row's first `k` logits in
    /// [`kvplug_core::rank`] order (larger first, the lower id on ties, NaNs last; `k` at
    /// most the vocabulary) with their token ids, `k` a row, computed where the logits are:
    /// a top-k sampler's candidates, `8·k` bytes a row rather than `4 · vocab`, after
    /// `adjust` (as [`Context::decode_argmax`] takes it). Returns the ids and the logits,
    /// row by row.
    pub fn decode_top_k(
        &mut self,
        batch: &Batch,
        k: usize,
        adjust: &[(usize, i32, Adjust)],
    ) -> Result<(&[i32], &[f32]), RuntimeError> {
        let k = k.min(self.vocab).max(1);
        let rows = self.step(batch, Reduce::TopK(k), adjust)?;
        let bad = |what: &str| -> RuntimeError {
            PluginError::new(
                AbiErrorKind::Backend,
                format!("forward's top {k} returned no {rows}x{k} {what}"),
            )
            .into()
        };
        if !first_output(&self.outputs)?.read_i32_into(&mut self.ids) || self.ids.len() != rows * k
        {
            return Err(bad("i32 ids"));
        }
        let values = self.outputs.get(1).ok_or_else(|| bad("logits"))?;
        if !values.read_f32_into(&mut self.logits) || self.logits.len() != rows * k {
            return Err(bad("logits"));
        }
        let asked = if batch.logit_rows().is_empty() {
            0
        } else {
            rows * k
        };
        Ok((&self.ids[..asked], &self.logits[..asked]))
    }

    /// Runs `batch` through `forward`, its rows adjusted by `adjust` and reduced as `reduce`
    /// says, and returns how many rows came back.
    fn step(
        &mut self,
        batch: &Batch,
        reduce: Reduce,
        adjust: &[(usize, i32, Adjust)],
    ) -> Result<usize, RuntimeError> {
        if batch.is_empty() {
            return Err(CacheError::bad_shape("an empty batch").into());
        }
        if self.cache.kind() == CacheKind::Seq {
            self.cache.begin_step(batch.seq_ids())?;
        } else if batch.seq_ids().iter().any(|&s| s != 0) {
            return Err(CacheError::bad_shape(format!(
                "a {} cache holds one sequence: a batch's sequence ids must be 0",
                self.cache.kind().as_str()
            ))
            .into());
        }
        // A forward returns at least one row: a batch that wants none (a prompt's earlier
        // chunk, a chain written again) asks for its first and drops it. Not its last: a
        // recurrent cache keeps a run's state as a prompt end when only its last output is
        // read (the last chunk of a prompt).
        let wanted = batch.logit_rows();
        let first = [0];
        let rows = if wanted.is_empty() {
            &first[..]
        } else {
            wanted
        };
        self.inputs[0].set_i32(&[batch.len()], batch.tokens());
        self.inputs[1].set_i32(&[batch.len()], batch.positions());
        self.inputs[2].set_i32(&[rows.len()], rows);
        // Inputs 3 (want hidden: no), 4 (argmax), 5 (top k), 6 and 7 (adjustments) only
        // when asked, so a plugin built before them still serves plain decodes.
        debug_assert!(
            adjust.is_empty() || !matches!(reduce, Reduce::None),
            "adjustments go with a pick"
        );
        let mut n = match reduce {
            Reduce::None => 3,
            Reduce::Argmax => 5,
            Reduce::TopK(_) => 6,
        };
        let k = match reduce {
            Reduce::TopK(k) => k as i32,
            _ => 0,
        };
        self.inputs[5].set_i32(&[1], &[k]);
        if !adjust.is_empty() {
            self.adjust_at.clear();
            self.adjust_by.clear();
            for &(row, token, a) in adjust {
                self.adjust_at.extend([row as i32, token]);
                self.adjust_by.extend(a.to_array());
            }
            let m = adjust.len();
            self.inputs[6].set_i32(&[m, 2], &self.adjust_at);
            self.inputs[7].encode_f32_into(&[m, 4], &self.adjust_by, TensorDtype::F32);
            n = 8;
        }
        self.method
            .execute_into(RSlice::from_slice(&self.inputs[..n]), &mut self.outputs)
            .into_result()?;
        self.decodes += 1;
        Ok(rows.len())
    }
}

/// What a step reads back of its logit rows.
#[derive(Clone, Copy)]
enum Reduce {
    /// The rows.
    None,
    /// Each row's argmax.
    Argmax,
    /// Each row's first `k` in rank order, with their ids.
    TopK(usize),
}

/// `forward`'s first output (its logits or ids).
fn first_output(outputs: &RVec<HostTensor>) -> Result<&HostTensor, RuntimeError> {
    Ok(outputs
        .first()
        .ok_or_else(|| PluginError::new(AbiErrorKind::Backend, "forward returned no logits"))?)
}

impl Deref for Context {
    type Target = Cache;

    fn deref(&self) -> &Cache {
        &self.cache
    }
}
