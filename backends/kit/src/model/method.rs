//! [`ForwardMethod`]: the `forward` model method over the ABI, bound to a cache.

use std::path::Path;
use std::sync::{Arc, Mutex};

use kvplug_core::{Adjust, CacheError, CacheVerbs};
use kvplug_plugin_api::abi_stable::sabi_trait::TD_Opaque;
use kvplug_plugin_api::abi_stable::std_types::{RArc, RResult, RSlice, RString, RVec};
use kvplug_plugin_api::{
    guard, AbiErrorKind, BackendOptions, HostServices, HostTensor, MethodHandle, ModelMethod,
    ModelMethod_TO, PluginError, TensorDtype,
};

use super::forward::{Activations, DecoderModel};
use super::ops::ModelDevice;
use super::package::Residency;
use crate::device::Backend;
use crate::object::SharedCache;

/// The option naming the model directory.
pub const OPTION_MODEL_DIR: &str = "model_dir";
/// The option limiting the model to its first N layers (a cheap draft model).
pub const OPTION_LAYERS: &str = "layers";
/// The option naming the basis keys are written in (`identity` when absent; see
/// [`kvplug_core::KeyBasis`]).
pub const OPTION_KEY_BASIS: &str = "key_basis";
/// The option saying whether the weight files are mapped (`true`, the default) or read
/// into memory (`false`; see [`Residency`]).
pub const OPTION_MMAP: &str = "mmap";

/// `forward` bound to one cache, with its buffers.
pub struct ForwardMethod<D: ModelDevice> {
    model: DecoderModel<D>,
    cache: SharedCache<D>,
    buffers: Arc<Mutex<Buffers<D>>>,
}

/// What a call reuses from the last: the activations, the decoded inputs and a greedy or
/// top-k call's picks (on the device and on the host).
struct Buffers<D: ModelDevice> {
    acts: Option<Activations<D>>,
    tokens: Vec<i32>,
    positions: Vec<i32>,
    ints: Vec<i32>,
    rows: Vec<usize>,
    ids: Option<D::Tensor>,
    /// [`ModelDevice::top_k_rows`]'s scratch (the device may replace it).
    top: Option<D::Tensor>,
    /// Inputs 6 and 7 decoded (sorted by place), and the logits they adjust into.
    adjust: Vec<([u32; 2], Adjust)>,
    at: Vec<[u32; 2]>,
    by: Vec<Adjust>,
    adjusted: Option<D::Tensor>,
    picked: Vec<i32>,
    values: Vec<f32>,
}

impl<D: ModelDevice> Clone for ForwardMethod<D> {
    fn clone(&self) -> Self {
        ForwardMethod {
            model: self.model.clone(),
            cache: self.cache.clone(),
            buffers: self.buffers.clone(),
        }
    }
}

/// Inputs 6 and 7 (see `ForwardMethod::run`) into `out`, sorted by place: each row below
/// `rows`, each token below `vocab`, no place twice.
fn adjustments(
    inputs: &[HostTensor],
    rows: usize,
    vocab: usize,
    ints_buf: &mut Vec<i32>,
    floats: &mut Vec<f32>,
    out: &mut Vec<([u32; 2], Adjust)>,
) -> Result<(), PluginError> {
    out.clear();
    let (Some(at), Some(by)) = (inputs.get(6), inputs.get(7)) else {
        return Ok(());
    };
    let bad = |m: String| -> PluginError { CacheError::bad_shape(m).into() };
    ints(at, "adjust at", ints_buf)?;
    by.check().map_err(CacheError::bad_shape)?;
    if by.dtype != TensorDtype::F32 || !by.read_f32_into(floats) {
        return Err(bad(format!(
            "adjust by must be f32, got {}",
            by.dtype.as_str()
        )));
    }
    let n = ints_buf.len() / 2;
    if at.shape.as_slice() != [n as u64, 2] || by.shape.as_slice() != [n as u64, 4] {
        return Err(bad(format!(
            "adjust at must be [n, 2] and adjust by [n, 4]; got {:?} and {:?}",
            at.dims(),
            by.dims()
        )));
    }
    for (place, v) in ints_buf.chunks_exact(2).zip(floats.chunks_exact(4)) {
        let (r, t) = (place[0], place[1]);
        if !(0..rows as i64).contains(&(r as i64)) || !(0..vocab as i64).contains(&(t as i64)) {
            return Err(bad(format!(
                "adjust at ({r}, {t}) is outside {rows} rows of {vocab} logits"
            )));
        }
        out.push((
            [r as u32, t as u32],
            Adjust::from_array([v[0], v[1], v[2], v[3]]),
        ));
    }
    out.sort_unstable_by_key(|a| a.0);
    if let Some(w) = out.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(bad(format!("adjust at {:?} is given twice", w[0].0)));
    }
    Ok(())
}

/// The i32 elements of input `t` into `out`.
fn ints(t: &HostTensor, what: &str, out: &mut Vec<i32>) -> Result<(), PluginError> {
    t.check().map_err(CacheError::bad_shape)?;
    if t.read_i32_into(out) {
        Ok(())
    } else {
        Err(CacheError::bad_shape(format!(
            "{what} must be an i32 tensor, got {}",
            t.dtype.as_str()
        ))
        .into())
    }
}

impl<D: ModelDevice> ForwardMethod<D> {
    /// The method's work, into `result`, its tensors reused: the logits; or where input 5
    /// asks for `k >= 1`, each logit row's top `k` ([`ModelDevice::top_k_rows`]; `k` at most
    /// the vocabulary) as i32 ids `[R, k]` and f32 logits `[R, k]`; or else, where input 4
    /// asks, each row's argmax as i32 ids `[R]`. Then the final hidden states where input 3
    /// asks. Inputs 6 (i32 `[n, 2]`: row among the R, token) and 7 (f32 `[n, 4]`: a
    /// [`kvplug_core::Adjust`]'s four values) adjust those logits first
    /// ([`ModelDevice::adjust_rows`]); they are checked before the step runs.
    fn run(&self, inputs: &[HostTensor], result: &mut RVec<HostTensor>) -> Result<(), PluginError> {
        if !matches!(inputs.len(), 2..=6 | 8) {
            return Err(CacheError::bad_shape(format!(
                "forward takes tokens, positions[, logit rows[, want hidden[, argmax[, top k[, \
                 adjust at, adjust by]]]]]; got {} inputs",
                inputs.len()
            ))
            .into());
        }
        let mut cache = self.cache.lock()?;
        let mut buffers = self.buffers.lock().map_err(|_| {
            PluginError::new(
                AbiErrorKind::Panic,
                "forward is unusable: an earlier call panicked while holding its buffers",
            )
        })?;
        let b = &mut *buffers;
        ints(&inputs[0], "tokens", &mut b.tokens)?;
        ints(&inputs[1], "positions", &mut b.positions)?;
        let rows = match inputs.get(2) {
            Some(r) => {
                ints(r, "logit rows", &mut b.ints)?;
                b.rows.clear();
                for &r in &b.ints {
                    b.rows.push(usize::try_from(r).map_err(|_| {
                        PluginError::from(CacheError::bad_shape(format!(
                            "logit row {r} is negative"
                        )))
                    })?);
                }
                Some(&b.rows[..])
            }
            None => None,
        };
        let mut flag = |i: usize, what: &str| -> Result<bool, PluginError> {
            match inputs.get(i) {
                Some(f) => {
                    ints(f, what, &mut b.ints)?;
                    Ok(b.ints.first().copied().unwrap_or(0) != 0)
                }
                None => Ok(false),
            }
        };
        let want_hidden = flag(3, "want hidden")?;
        let want_argmax = flag(4, "argmax")?;
        let top_k = match inputs.get(5) {
            Some(t) => {
                ints(t, "top k", &mut b.ints)?;
                match b.ints[..] {
                    [k] if k >= 0 => k as usize,
                    ref k => {
                        let m = format!("top k must be one integer of at least 0, got {k:?}");
                        return Err(CacheError::bad_shape(m).into());
                    }
                }
            }
            None => 0,
        };
        let n_rows = rows.map_or(b.tokens.len(), <[usize]>::len);
        let vocab = self.model.config().vocab_size;
        adjustments(
            inputs,
            n_rows,
            vocab,
            &mut b.ints,
            &mut b.values,
            &mut b.adjust,
        )?;
        b.at.clear();
        b.by.clear();
        b.at.extend(b.adjust.iter().map(|a| a.0));
        b.by.extend(b.adjust.iter().map(|a| a.1));
        let out = self.model.forward(
            &mut cache,
            &b.tokens,
            &b.positions,
            rows,
            want_hidden,
            &mut b.acts,
        )?;
        let dev = self.model_device();
        let logits = if b.at.is_empty() {
            out.logits
        } else {
            let dims = dev.dims(out.logits);
            if b.adjusted.as_ref().is_none_or(|t| dev.dims(t) != dims) {
                b.adjusted = Some(dev.zeros(dims)?);
            }
            let adjusted = b.adjusted.as_mut().expect("set above");
            dev.adjust_rows(out.logits, &b.at, &b.by, adjusted)?;
            &*adjusted
        };
        let picks = if top_k > 0 { 2 } else { 1 };
        let n = picks + usize::from(out.hidden.is_some());
        result.truncate(n);
        while result.len() < n {
            result.push(HostTensor::empty());
        }
        if top_k > 0 {
            let (rows, vocab) = match dev.dims(logits)[..] {
                [r, v] => (r, v),
                ref d => {
                    let m = format!("forward gave logits of shape {d:?}");
                    return Err(PluginError::new(AbiErrorKind::Backend, m));
                }
            };
            let k = top_k.min(vocab);
            if b.top.is_none() {
                b.top = Some(dev.zeros(&[rows, 2 * k])?);
            }
            let scratch = b.top.as_mut().expect("set above");
            dev.top_k_rows(logits, k, scratch, &mut b.picked, &mut b.values)?;
            if b.picked.len() != rows * k || b.values.len() != rows * k {
                let m = format!(
                    "top_k_rows gave {} ids and {} values for {rows} rows of {k}",
                    b.picked.len(),
                    b.values.len()
                );
                return Err(PluginError::new(AbiErrorKind::Backend, m));
            }
            result[0].set_i32(&[rows, k], &b.picked);
            result[1].encode_f32_into(&[rows, k], &b.values, TensorDtype::F32);
        } else if want_argmax {
            let n = dev.dims(logits).first().copied().unwrap_or(0);
            if b.ids.as_ref().is_none_or(|t| dev.dims(t) != [n]) {
                b.ids = Some(dev.zeros(&[n])?);
            }
            let ids = b.ids.as_mut().expect("set above");
            dev.argmax_rows(logits, ids, &mut b.picked)?;
            result[0].set_i32(&[b.picked.len()], &b.picked);
        } else {
            dev.download_into(logits, TensorDtype::F32, &mut result[0])?;
        }
        if let Some(h) = out.hidden {
            dev.download_into(h, TensorDtype::F32, &mut result[picks])?;
        }
        Ok(())
    }

    fn model_device(&self) -> Arc<D> {
        self.model.device()
    }
}

impl<D: ModelDevice> ModelMethod for ForwardMethod<D> {
    fn name(&self) -> RString {
        "forward".into()
    }

    fn execute(&self, inputs: RVec<HostTensor>) -> RResult<RVec<HostTensor>, PluginError> {
        guard(|| {
            let mut result = RVec::new();
            self.run(&inputs, &mut result).map(|()| result)
        })
    }

    fn execute_into(
        &self,
        inputs: RSlice<'_, HostTensor>,
        outputs: &mut RVec<HostTensor>,
    ) -> RResult<(), PluginError> {
        guard(|| self.run(&inputs, outputs))
    }
}

/// Loads `forward` for backend `B`: binds the cache named by the `cache_key` option (it must
/// belong to `B`), opens the package in `model_dir`, checks the cache shape against the
/// model and loads the weights; `layers` limits it to a draft view, `key_basis` sets the
/// basis its keys are written in and `mmap` = `false` reads the weight files into memory
/// instead of mapping them.
pub fn load_forward<B: Backend + ModelDevice>(
    options: &BackendOptions,
    host: &HostServices,
) -> Result<MethodHandle, PluginError> {
    let need = |k: &str| {
        options.get(k).ok_or_else(|| {
            PluginError::new(
                AbiErrorKind::BadConfig,
                format!("loading 'forward' needs the '{k}' option"),
            )
        })
    };
    let key = need(kvplug_plugin_api::OPTION_CACHE_KEY)?;
    let dir = need(OPTION_MODEL_DIR)?;
    let entry =
        kvplug_plugin_api::HostServicesTrait::lookup_cache(host, key.into()).into_result()?;
    if entry.backend_id.as_str() != B::ID {
        return Err(PluginError::new(
            AbiErrorKind::BadConfig,
            format!(
                "cache '{key}' belongs to backend '{}'; a '{}' model method can only drive its own caches",
                entry.backend_id,
                B::ID
            ),
        ));
    }
    let cache = entry
        .cache
        .obj
        .downcast_as::<SharedCache<B>>()
        .map_err(|_| {
            PluginError::new(
                AbiErrorKind::BadConfig,
                format!("cache '{key}' is not a {} kit cache", B::ID),
            )
        })?
        .clone();
    let layers = match options.get(OPTION_LAYERS) {
        Some(n) => Some(n.parse::<usize>().map_err(|_| {
            PluginError::new(
                AbiErrorKind::BadConfig,
                format!("option 'layers' = '{n}' is not a count"),
            )
        })?),
        None => None,
    };
    let keys = match options.get(OPTION_KEY_BASIS) {
        Some(b) => b.parse::<kvplug_core::KeyBasis>().map_err(|e| {
            PluginError::new(AbiErrorKind::BadConfig, format!("option 'key_basis': {e}"))
        })?,
        None => kvplug_core::KeyBasis::Identity,
    };
    let residency = match options.get(OPTION_MMAP) {
        Some(m) => Residency::from_mmap(m.parse::<bool>().map_err(|_| {
            PluginError::new(
                AbiErrorKind::BadConfig,
                format!("option 'mmap' = '{m}' is not true or false"),
            )
        })?),
        None => Residency::Mapped,
    };
    let (device, cfg) = {
        let c = cache.lock()?;
        (c.device().clone(), *c.config())
    };
    let model =
        DecoderModel::load_shared(device, Path::new(dir), residency).map_err(CacheError::from)?;
    let model = match layers {
        Some(n) => model.view(n).map_err(CacheError::from)?,
        None => model,
    }
    .with_key_basis(keys);
    let want = model.config().cache_params();
    let want_layers = layers.unwrap_or(want.n_layers);
    if (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim) != (want_layers, want.n_kv_heads, want.head_dim)
    {
        return Err(PluginError::new(
            AbiErrorKind::BadConfig,
            format!(
                "cache '{key}' has {} layers × {} KV heads × {} dims; the model needs {want_layers} × {} × {}",
                cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, want.n_kv_heads, want.head_dim
            ),
        ));
    }
    // A sliding layer run with full attention (or the reverse) is wrong past the window; a
    // convolution layer has no K/V at all.
    let bad = |m: String| PluginError::new(AbiErrorKind::BadConfig, m);
    let sliding = model
        .config()
        .sliding(want_layers)
        .map_err(|e| bad(e.to_string()))?;
    check_layers(key, cfg.sliding, sliding, "no sliding layers", |s| {
        format!(
            "a {}-token window on layers {:?}",
            s.window,
            s.layers.iter().collect::<Vec<_>>()
        )
    })
    .map_err(bad)?;
    let conv = model
        .config()
        .conv(want_layers)
        .map_err(|e| bad(e.to_string()))?;
    check_layers(key, cfg.conv, conv, "no convolution layers", |c| {
        format!(
            "{}-tap convolutions of {} channels on layers {:?}",
            c.width,
            c.channels,
            c.layers.iter().collect::<Vec<_>>()
        )
    })
    .map_err(bad)?;
    let delta = model
        .config()
        .delta(want_layers)
        .map_err(|e| bad(e.to_string()))?;
    check_layers(key, cfg.delta, delta, "no delta-rule layers", |d| {
        format!(
            "delta-rule layers of {} key and {} value heads of {} on layers {:?}",
            d.key_heads,
            d.value_heads,
            d.head_dim,
            d.layers.iter().collect::<Vec<_>>()
        )
    })
    .map_err(bad)?;
    let ssm = model
        .config()
        .ssm(want_layers)
        .map_err(|e| bad(e.to_string()))?;
    check_layers(key, cfg.ssm, ssm, "no Mamba2 layers", |m| {
        format!(
            "Mamba2 layers of {} heads of {} with {} groups of {} on layers {:?}",
            m.heads,
            m.head_dim,
            m.groups,
            m.state,
            m.layers.iter().collect::<Vec<_>>()
        )
    })
    .map_err(bad)?;
    let _span =
        tracing::info_span!("load_method", backend = B::ID, method = "forward", dir).entered();
    tracing::info!(
        layers = model.n_layers(),
        keys = keys.as_str(),
        kind = cache.lock()?.kind().as_str(),
        "forward bound to {key}"
    );
    Ok(ModelMethod_TO::from_ptr(
        RArc::new(ForwardMethod {
            model,
            cache,
            buffers: Arc::new(Mutex::new(Buffers {
                acts: None,
                tokens: Vec::new(),
                positions: Vec::new(),
                ints: Vec::new(),
                rows: Vec::new(),
                ids: None,
                top: None,
                adjust: Vec::new(),
                at: Vec::new(),
                by: Vec::new(),
                adjusted: None,
                picked: Vec::new(),
                values: Vec::new(),
            })),
        }),
        TD_Opaque,
    ))
}

/// Refuses a cache whose layer group (`has`) differs from the model's (`needs`), naming
/// both: `say` describes a group, `none` its absence.
fn check_layers<T: PartialEq + Copy>(
    key: &str,
    has: Option<T>,
    needs: Option<T>,
    none: &str,
    say: impl Fn(T) -> String,
) -> Result<(), String> {
    if has == needs {
        return Ok(());
    }
    let say = |g: Option<T>| g.map_or_else(|| none.to_string(), &say);
    Err(format!(
        "cache '{key}' has {}; the model needs {}",
        say(has),
        say(needs)
    ))
}
