//! [`DecoderModel`]: weights on the device and the forward pass, written once for the Llama
//! family, Gemma 3, LFM2, Qwen3.5 and Granite 4.0-H (the differences are optional weights, a
//! few config facts and, for the hybrids, blocks that mix positions by a gated short
//! convolution (LFM2), a gated delta rule (Qwen3.5) or a Mamba2 scan (Granite 4.0-H) instead
//! of attention).

use std::any::{Any, TypeId};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use kvplug_core::key_basis::rotation_width;
use kvplug_core::{CacheError, KeyBasis, LayerAttention, RopePairs};
use kvplug_plugin_api::{HostTensor, TensorDtype};

use super::config::{Arch, ModelConfig, ModelError};
use super::moe::{route, Expert, ExpertGroups, Routes};
use super::ops::{ModelDevice, Projection, QkvHeads};
use super::package::{ModelPackage, Residency};
use crate::cache::{KitCache, KitError};
use kvplug_core::Experts;

/// One block. Gemma 3 adds the per-head q/k norms (Qwen3 and LFM2 have them too) and the
/// norms after attention and MLP; its RMSNorm weights are stored as `w` and loaded as
/// `1 + w`.
struct Layer<D: ModelDevice> {
    /// Before attention (or the convolution).
    ln1: D::Tensor,
    mixer: Mixer<D>,
    /// On the attention output before the residual add.
    post_attn: Option<D::Tensor>,
    /// Before the MLP.
    ln2: D::Tensor,
    ffn: Ffn<D>,
    /// On the MLP output before the residual add.
    post_mlp: Option<D::Tensor>,
}

/// A block's feed-forward.
enum Ffn<D: ModelDevice> {
    /// `down(act(gate·x) · up·x)`.
    Dense {
        gate: D::Weight,
        up: D::Weight,
        down: D::Weight,
    },
    /// A mixture of experts: the router (`[experts, hidden]`) chooses each token's experts.
    Experts {
        router: D::Weight,
        /// GPT-OSS: on the router's logits.
        router_bias: Option<D::Tensor>,
        experts: Vec<Expert<D>>,
        spec: Experts,
    },
}

/// What mixes positions in a block.
enum Mixer<D: ModelDevice> {
    Attention(Attention<D>),
    /// LFM2's gated short convolution: `out(C · conv(B · x))`, with `B`, `C` and `x` the
    /// three parts of its input projection and the convolution's state in the cache.
    Conv {
        b: D::Weight,
        c: D::Weight,
        x: D::Weight,
        /// `[hidden, width]`, on the host (the convolution runs there).
        kernel: Vec<f32>,
        out: D::Weight,
    },
    /// Qwen3.5's gated delta rule: `out(norm(rule(conv(qkv · x))) · silu(z · x))`, the
    /// rule's decay from `alpha · x + dt_bias` and step size from `beta · x`; its state and
    /// the convolution's in the cache.
    Delta(Box<Delta<D>>),
    /// A Mamba2 block: `out(norm(scan(conv(xBC · x)) · silu(z · x)))`, the scan's step from
    /// `dt · x + dt_bias`; its state and the convolution's in the cache.
    Ssm(Box<Ssm<D>>),
}

/// A Mamba2 block's weights (its input projection split into z, xBC and dt).
struct Ssm<D: ModelDevice> {
    z: D::Weight,
    xbc: D::Weight,
    dt: D::Weight,
    dt_bias: D::Tensor,
    /// `[channels, width]` and `[channels]`, on the host (the scan and its convolution run
    /// there).
    kernel: Vec<f32>,
    conv_bias: Vec<f32>,
    /// Per head, `−exp(A_log)`, and the skip weights `D`.
    a: Vec<f32>,
    d: Vec<f32>,
    /// `[heads · head_dim]`, on the gated scan output (one group).
    norm: D::Tensor,
    out: D::Weight,
}

/// A gated delta-rule block's weights (names after Hugging Face's `linear_attn`).
struct Delta<D: ModelDevice> {
    qkv: D::Weight,
    z: D::Weight,
    beta: D::Weight,
    alpha: D::Weight,
    dt_bias: D::Tensor,
    /// `[conv_channels, width]`, on the host (the rule and its convolution run there).
    kernel: Vec<f32>,
    /// Per value head, `−exp(A_log)`.
    a: Vec<f32>,
    /// `[head_dim]`, on each head of the rule's output.
    norm: D::Tensor,
    out: D::Weight,
}

/// An attention block's weights.
struct Attention<D: ModelDevice> {
    q: D::Weight,
    k: D::Weight,
    v: D::Weight,
    q_bias: Option<D::Tensor>,
    k_bias: Option<D::Tensor>,
    v_bias: Option<D::Tensor>,
    /// Per head, on q and k before RoPE (`[head_dim]`).
    q_norm: Option<D::Tensor>,
    k_norm: Option<D::Tensor>,
    o: D::Weight,
    /// Qwen3.5: the output gate (`sigmoid(gate · x)` times the attention output), split
    /// from the q projection.
    gate: Option<D::Weight>,
    /// GPT-OSS: the output projection's bias (`[hidden]`) and a learned sink per head
    /// (`[Hq]`).
    o_bias: Option<D::Tensor>,
    sinks: Option<D::Tensor>,
    /// Whether the layer attends through the sliding window (its RoPE base is the local one).
    sliding: bool,
}

/// The weights of a model on device `D`, loaded once.
struct Weights<D: ModelDevice> {
    device: Arc<D>,
    config: ModelConfig,
    embed: D::Weight,
    layers: Vec<Layer<D>>,
    norm: D::Tensor,
    /// `None` when tied to `embed`.
    lm_head: Option<D::Weight>,
    /// RoPE frequencies of full layers, then of sliding layers.
    inv_freq: Vec<f32>,
    inv_freq_local: Vec<f32>,
    /// How q/k rows pair their rotary halves (as the package stores them).
    rope_pairs: RopePairs,
}

/// A decoder on device `D`: shared weights, how many of its layers run and the basis it
/// writes keys in. Cloning or taking a [`DecoderModel::view`] shares the weights (no copy,
/// no I/O); a view of the first N layers is a cheap draft model.
pub struct DecoderModel<D: ModelDevice> {
    weights: Arc<Weights<D>>,
    layers: usize,
    keys: KeyBasis,
}

impl<D: ModelDevice> Clone for DecoderModel<D> {
    fn clone(&self) -> Self {
        DecoderModel {
            weights: self.weights.clone(),
            layers: self.layers,
            keys: self.keys,
        }
    }
}

/// What a forward pass returns.
pub struct ForwardOutput<T> {
    /// `[R, vocab]`.
    pub logits: T,
    /// `[R, hidden]`, when asked for.
    pub hidden: Option<T>,
}

/// The Hugging Face tensor names that differ by family (per layer: after
/// `model.layers.{l}.`; attention ones after `self_attn.`).
struct Names {
    attn_norm: &'static str,
    ffn_norm: &'static str,
    o: &'static str,
    q_norm: &'static str,
    k_norm: &'static str,
    gate: &'static str,
    up: &'static str,
    down: &'static str,
    final_norm: &'static str,
}

impl Names {
    fn of(arch: Arch) -> Self {
        match arch {
            Arch::Llama | Arch::Gemma3 | Arch::Qwen35 | Arch::GptOss | Arch::GraniteHybrid => {
                Names {
                    attn_norm: "input_layernorm",
                    ffn_norm: "post_attention_layernorm",
                    o: "o_proj",
                    q_norm: "q_norm",
                    k_norm: "k_norm",
                    gate: "mlp.gate_proj",
                    up: "mlp.up_proj",
                    down: "mlp.down_proj",
                    final_norm: "model.norm.weight",
                }
            }
            // LFM2's final norm is named for the embedding, though it runs after the last
            // layer (as in its Hugging Face and llama.cpp graphs).
            Arch::Lfm2 => Names {
                attn_norm: "operator_norm",
                ffn_norm: "ffn_norm",
                o: "out_proj",
                q_norm: "q_layernorm",
                k_norm: "k_layernorm",
                gate: "feed_forward.w1",
                up: "feed_forward.w3",
                down: "feed_forward.w2",
                final_norm: "model.embedding_norm.weight",
            },
        }
    }
}

/// `t` as `device` takes it: MXFP4 kept as stored where the device reads it
/// ([`ModelDevice::reads_mxfp4`]), re-encoded once elsewhere.
fn held<D: ModelDevice>(device: &D, t: super::stored::StoredTensor) -> super::stored::StoredTensor {
    if device.reads_mxfp4() {
        t
    } else {
        t.computable()
    }
}

fn weights_err(e: KitError) -> ModelError {
    ModelError::Malformed(format!("loading weights: {e}"))
}

impl<D: ModelDevice> DecoderModel<D> {
    /// Loads every layer of `pkg` onto `device`.
    pub fn load(device: Arc<D>, pkg: &ModelPackage) -> Result<Self, ModelError> {
        let c = pkg.config.clone();
        let n_layers = c.num_hidden_layers;
        let (h, hd, hq, hkv, im) = (
            c.hidden_size,
            c.head_dim(),
            c.num_attention_heads,
            c.kv_heads(),
            c.intermediate_size,
        );
        let gemma = c.arch() == Arch::Gemma3;
        // Gemma's RMSNorm scales by (1 + w); a GGUF stores the sum.
        let add_one = gemma && !pkg.norms_plus_one();
        let vec = |name: &str, n: usize| -> Result<D::Tensor, ModelError> {
            device
                .tensor(&pkg.tensor_f32(name, &[n])?, &[n])
                .map_err(weights_err)
        };
        let norm = |name: &str, n: usize| -> Result<D::Tensor, ModelError> {
            let mut w = pkg.tensor_f32(name, &[n])?;
            if add_one {
                w.iter_mut().for_each(|x| *x += 1.0);
            }
            device.tensor(&w, &[n]).map_err(weights_err)
        };
        let gemma_norm = |name: String, n: usize| -> Result<Option<D::Tensor>, ModelError> {
            if gemma {
                norm(&name, n).map(Some)
            } else {
                Ok(None)
            }
        };
        // GPT-OSS's attention output bias and sinks.
        let sinks_too = |name: String, n: usize| -> Result<Option<D::Tensor>, ModelError> {
            if c.o_bias_and_sinks() {
                vec(&name, n).map(Some)
            } else {
                Ok(None)
            }
        };
        let qk_norm = |name: String| -> Result<Option<D::Tensor>, ModelError> {
            if c.qk_norm() {
                norm(&name, hd).map(Some)
            } else {
                Ok(None)
            }
        };
        let mat = |name: &str, rows: usize, cols: usize| -> Result<D::Weight, ModelError> {
            device
                .weight(held(&*device, pkg.tensor(name, &[rows, cols])?), rows, cols)
                .map_err(weights_err)
        };
        let embed = mat("model.embed_tokens.weight", c.vocab_size, h)?;
        // A tied head is the embedding table itself: stored once.
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(mat("lm_head.weight", c.vocab_size, h)?)
        };
        let n = Names::of(c.arch());
        let mut ls = Vec::with_capacity(n_layers);
        for l in 0..n_layers {
            let p = format!("model.layers.{l}.");
            let bias = |n: &str, len: usize| -> Result<Option<D::Tensor>, ModelError> {
                if c.qkv_bias() {
                    vec(&format!("{p}self_attn.{n}_proj.bias"), len).map(Some)
                } else {
                    Ok(None)
                }
            };
            let (ln2, post_attn) = if gemma {
                (
                    norm(&format!("{p}pre_feedforward_layernorm.weight"), h)?,
                    gemma_norm(format!("{p}post_attention_layernorm.weight"), h)?,
                )
            } else {
                (norm(&format!("{p}{}.weight", n.ffn_norm), h)?, None)
            };
            let mixer = match c.attention[l] {
                LayerAttention::Conv { width, channels } => {
                    if channels != h {
                        return Err(ModelError::Malformed(format!(
                            "layer {l}: {channels} convolution channels for a {h}-wide model"
                        )));
                    }
                    let name = format!("{p}conv.in_proj.weight");
                    let bcx = pkg.tensor(&name, &[3 * h, h])?;
                    let part = |i: usize| -> Result<D::Weight, ModelError> {
                        let rows = bcx.rows(h, i * h..(i + 1) * h).ok_or_else(|| {
                            ModelError::Malformed(format!("{name}: rows of partial blocks"))
                        })?;
                        device
                            .weight(held(&*device, rows), h, h)
                            .map_err(weights_err)
                    };
                    // Hugging Face stores the depthwise kernel as [h, 1, width]; a GGUF as
                    // [h, width].
                    let kernel_name = format!("{p}conv.conv.weight");
                    let kernel = pkg
                        .tensor_f32(&kernel_name, &[h, width])
                        .or_else(|_| pkg.tensor_f32(&kernel_name, &[h, 1, width]))?;
                    Mixer::Conv {
                        b: part(0)?,
                        c: part(1)?,
                        x: part(2)?,
                        kernel,
                        out: mat(&format!("{p}conv.out_proj.weight"), h, h)?,
                    }
                }
                LayerAttention::Delta {
                    width,
                    key_heads,
                    value_heads,
                    head_dim: dn,
                } => {
                    let (ch, vd) = ((2 * key_heads + value_heads) * dn, value_heads * dn);
                    let a = format!("{p}linear_attn.");
                    // A GGUF stores the depthwise kernel as [channels, width].
                    let kernel = pkg.tensor_f32(&format!("{a}conv1d.weight"), &[ch, width])?;
                    // Decay rates are `−exp(A_log)`: a rate above 0 (or NaN) would make the
                    // state grow without bound.
                    let rates = pkg.tensor_f32(&format!("{a}a"), &[value_heads])?;
                    if let Some(r) = rates.iter().find(|r| r.is_nan() || **r > 0.0) {
                        return Err(ModelError::Malformed(format!(
                            "{a}a: a decay rate of {r} (rates are -exp(A_log), at most 0)"
                        )));
                    }
                    Mixer::Delta(Box::new(Delta {
                        qkv: mat(&format!("{a}in_proj_qkv.weight"), ch, h)?,
                        z: mat(&format!("{a}in_proj_z.weight"), vd, h)?,
                        beta: mat(&format!("{a}in_proj_b.weight"), value_heads, h)?,
                        alpha: mat(&format!("{a}in_proj_a.weight"), value_heads, h)?,
                        dt_bias: vec(&format!("{a}dt_bias"), value_heads)?,
                        kernel,
                        a: rates,
                        norm: vec(&format!("{a}norm.weight"), dn)?,
                        out: mat(&format!("{a}out_proj.weight"), h, vd)?,
                    }))
                }
                LayerAttention::Ssm {
                    width,
                    heads,
                    head_dim: hp,
                    groups,
                    state,
                } => {
                    if groups != 1 {
                        return Err(ModelError::Malformed(format!(
                            "layer {l}: a Mamba2 layer of {groups} groups is not supported (its \
                             grouped output norm is not implemented; Granite 4.0-H has one)"
                        )));
                    }
                    let (inner, m) = (heads * hp, format!("{p}mamba."));
                    let ch = inner + 2 * groups * state;
                    let name = format!("{m}in_proj.weight");
                    let zxbcdt = pkg.tensor(&name, &[inner + ch + heads, h])?;
                    let part = |from: usize, rows: usize| -> Result<D::Weight, ModelError> {
                        let t = zxbcdt.rows(h, from..from + rows).ok_or_else(|| {
                            ModelError::Malformed(format!("{name}: rows of partial blocks"))
                        })?;
                        device
                            .weight(held(&*device, t), rows, h)
                            .map_err(weights_err)
                    };
                    // A GGUF stores vectors per head as [heads, 1] and the depthwise kernel
                    // as [channels, width] (Hugging Face: [heads], [channels, 1, width]).
                    let either = |name: String, a: &[usize], b: &[usize]| {
                        pkg.tensor_f32(&name, a)
                            .or_else(|_| pkg.tensor_f32(&name, b))
                    };
                    let kernel =
                        either(format!("{m}conv1d.weight"), &[ch, width], &[ch, 1, width])?;
                    let bias_name = format!("{m}conv1d.bias");
                    let conv_bias = match pkg.has_tensor(&bias_name) {
                        true => pkg.tensor_f32(&bias_name, &[ch])?,
                        false => vec![0.0; ch],
                    };
                    // Decay rates above 0 (or NaN) would make the state grow without bound.
                    let rates = either(format!("{m}a"), &[heads, 1], &[heads])?;
                    if let Some(r) = rates.iter().find(|r| r.is_nan() || **r > 0.0) {
                        return Err(ModelError::Malformed(format!(
                            "{m}a: a decay rate of {r} (rates are -exp(A_log), at most 0)"
                        )));
                    }
                    let norm = either(format!("{m}norm.weight"), &[1, inner], &[inner])?;
                    Mixer::Ssm(Box::new(Ssm {
                        z: part(0, inner)?,
                        xbc: part(inner, ch)?,
                        dt: part(inner + ch, heads)?,
                        dt_bias: vec(&format!("{m}dt_bias"), heads)?,
                        kernel,
                        conv_bias,
                        a: rates,
                        d: either(format!("{m}D"), &[heads, 1], &[heads])?,
                        norm: device.tensor(&norm, &[inner]).map_err(weights_err)?,
                        out: mat(&format!("{m}out_proj.weight"), h, inner)?,
                    }))
                }
                attention if c.arch() == Arch::Qwen35 => {
                    let a = format!("{p}self_attn.");
                    // q and the output gate interleave per head; the rotary dims go first.
                    let order = rotary_first(hd, c.rotary_dim());
                    let rows = |heads: usize, stride: usize, at: usize| -> Vec<usize> {
                        (0..heads)
                            .flat_map(|hh| order.iter().map(move |&i| hh * stride + at + i))
                            .collect()
                    };
                    let qg = pkg.tensor(&format!("{a}q_proj.weight"), &[2 * hq * hd, h])?;
                    let kw = pkg.tensor(&format!("{a}k_proj.weight"), &[hkv * hd, h])?;
                    let pick = |t: &super::stored::StoredTensor, rows: Vec<usize>| {
                        let n = rows.len();
                        let picked = t.gather(h, &rows).ok_or_else(|| {
                            ModelError::Malformed(format!("layer {l}: q/k rows of partial blocks"))
                        })?;
                        device
                            .weight(held(&*device, picked), n, h)
                            .map_err(weights_err)
                    };
                    let permuted = |name: &str| -> Result<D::Tensor, ModelError> {
                        let w = pkg.tensor_f32(&format!("{a}{name}.weight"), &[hd])?;
                        let w: Vec<f32> = order.iter().map(|&i| w[i]).collect();
                        device.tensor(&w, &[hd]).map_err(weights_err)
                    };
                    Mixer::Attention(Attention {
                        q: pick(&qg, rows(hq, 2 * hd, 0))?,
                        // The gate multiplies the output: its rows keep their order.
                        gate: Some(pick(
                            &qg,
                            (0..hq)
                                .flat_map(|hh| (0..hd).map(move |i| hh * 2 * hd + hd + i))
                                .collect(),
                        )?),
                        k: pick(&kw, rows(hkv, hd, 0))?,
                        v: mat(&format!("{a}v_proj.weight"), hkv * hd, h)?,
                        q_bias: None,
                        k_bias: None,
                        v_bias: None,
                        q_norm: Some(permuted(n.q_norm)?),
                        k_norm: Some(permuted(n.k_norm)?),
                        o: mat(&format!("{a}{}.weight", n.o), h, hq * hd)?,
                        o_bias: None,
                        sinks: None,
                        sliding: attention != LayerAttention::Full,
                    })
                }
                attention => Mixer::Attention(Attention {
                    q: mat(&format!("{p}self_attn.q_proj.weight"), hq * hd, h)?,
                    k: mat(&format!("{p}self_attn.k_proj.weight"), hkv * hd, h)?,
                    v: mat(&format!("{p}self_attn.v_proj.weight"), hkv * hd, h)?,
                    q_bias: bias("q", hq * hd)?,
                    k_bias: bias("k", hkv * hd)?,
                    v_bias: bias("v", hkv * hd)?,
                    q_norm: qk_norm(format!("{p}self_attn.{}.weight", n.q_norm))?,
                    k_norm: qk_norm(format!("{p}self_attn.{}.weight", n.k_norm))?,
                    o: mat(&format!("{p}self_attn.{}.weight", n.o), h, hq * hd)?,
                    gate: None,
                    o_bias: sinks_too(format!("{p}self_attn.{}.bias", n.o), h)?,
                    sinks: sinks_too(format!("{p}self_attn.sinks"), hq)?,
                    sliding: attention != LayerAttention::Full,
                }),
            };
            let ffn = match c.experts().filter(|_| c.sparse_layer(l)) {
                Some(spec) => Ffn::Experts {
                    router: mat(&format!("{p}mlp.gate.weight"), spec.count, h)?,
                    router_bias: match pkg.has_tensor(&format!("{p}mlp.gate.bias")) {
                        true => Some(vec(&format!("{p}mlp.gate.bias"), spec.count)?),
                        false => None,
                    },
                    experts: load_experts(&*device, pkg, &p, &spec, h)?,
                    spec,
                },
                None => Ffn::Dense {
                    gate: mat(&format!("{p}{}.weight", n.gate), im, h)?,
                    up: mat(&format!("{p}{}.weight", n.up), im, h)?,
                    down: mat(&format!("{p}{}.weight", n.down), h, im)?,
                },
            };
            ls.push(Layer {
                ln1: norm(&format!("{p}{}.weight", n.attn_norm), h)?,
                mixer,
                post_attn,
                ln2,
                ffn,
                post_mlp: gemma_norm(format!("{p}post_feedforward_layernorm.weight"), h)?,
            });
        }
        let weights = Weights {
            embed,
            norm: norm(n.final_norm, h)?,
            inv_freq: c.inv_freq(),
            inv_freq_local: c.inv_freq_local(),
            rope_pairs: pkg.rope_pairs(),
            lm_head,
            layers: ls,
            config: c,
            device,
        };
        Ok(DecoderModel {
            weights: Arc::new(weights),
            layers: n_layers,
            keys: KeyBasis::Identity,
        })
    }

    /// The model in `dir`, its files held as `residency` says, loaded once per process,
    /// device type and residency: while any model from an earlier call is alive, its weights
    /// are shared (no I/O, no copy); the registry holds them only weakly, so they go when the
    /// last binding does.
    pub fn load_shared(
        device: Arc<D>,
        dir: &Path,
        residency: Residency,
    ) -> Result<Self, ModelError> {
        type Loaded = Vec<(PathBuf, TypeId, Residency, Weak<dyn Any + Send + Sync>)>;
        static LOADED: Mutex<Loaded> = Mutex::new(Vec::new());
        let key = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        let ty = TypeId::of::<D>();
        let mut loaded = LOADED.lock().unwrap_or_else(|p| p.into_inner());
        loaded.retain(|(.., w)| w.strong_count() > 0);
        let found = loaded
            .iter()
            .filter(|(k, t, r, _)| *k == key && *t == ty && *r == residency)
            .find_map(|(.., w)| w.upgrade()?.downcast::<Weights<D>>().ok());
        if let Some(weights) = found {
            tracing::debug!(dir = %key.display(), "model already loaded: sharing its weights");
            let layers = weights.layers.len();
            return Ok(DecoderModel {
                weights,
                layers,
                keys: KeyBasis::Identity,
            });
        }
        let model = DecoderModel::load(device, &ModelPackage::open_with(dir, residency)?)?;
        let erased: Arc<dyn Any + Send + Sync> = model.weights.clone();
        loaded.push((key, ty, residency, Arc::downgrade(&erased)));
        Ok(model)
    }

    /// The same weights running only their first `layers` layers (a draft model).
    pub fn view(&self, layers: usize) -> Result<Self, ModelError> {
        let total = self.weights.layers.len();
        if layers == 0 || layers > total {
            return Err(ModelError::Malformed(format!(
                "cannot use {layers} layers of a {total}-layer model"
            )));
        }
        Ok(DecoderModel {
            weights: self.weights.clone(),
            layers,
            keys: self.keys,
        })
    }

    /// The same model writing keys (and reading queries) in `keys`' basis.
    pub fn with_key_basis(&self, keys: KeyBasis) -> Self {
        DecoderModel {
            keys,
            ..self.clone()
        }
    }

    /// The basis its keys are written in.
    pub fn key_basis(&self) -> KeyBasis {
        self.keys
    }

    /// Whether `self` and `other` share their weights.
    pub fn shares_weights_with(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.weights, &other.weights)
    }

    /// The device the weights live on.
    pub fn device(&self) -> Arc<D> {
        self.weights.device.clone()
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.weights.config
    }

    /// Layers in use.
    pub fn n_layers(&self) -> usize {
        self.layers
    }

    /// Runs `tokens` at `positions` through the model as one cache step (committed only
    /// when every layer and the logits succeeded; any failure rolls it back), and returns
    /// the logits (and optionally the final hidden states) of rows `logit_rows` (all when
    /// `None`). The outputs live in `acts`, which is reused while the shape repeats: a
    /// decode loop allocates nothing once warm.
    pub fn forward<'a>(
        &self,
        cache: &mut KitCache<D>,
        tokens: &[i32],
        positions: &[i32],
        logit_rows: Option<&[usize]>,
        want_hidden: bool,
        acts: &'a mut Option<Activations<D>>,
    ) -> Result<ForwardOutput<&'a D::Tensor>, KitError> {
        let w = &*self.weights;
        let c = &w.config;
        let (t, hq, hkv) = (tokens.len(), c.num_attention_heads, c.kv_heads());
        if t == 0 || positions.len() != t {
            return Err(CacheError::bad_shape(format!(
                "{t} tokens with {} positions",
                positions.len()
            ))
            .into());
        }
        if let Some(&bad) = tokens
            .iter()
            .find(|&&id| id < 0 || id as usize >= c.vocab_size)
        {
            return Err(CacheError::bad_shape(format!(
                "token id {bad} is outside the vocabulary of {}",
                c.vocab_size
            ))
            .into());
        }
        if let Some(&bad) = logit_rows.and_then(|r| r.iter().find(|&&r| r >= t)) {
            return Err(CacheError::bad_shape(format!(
                "logit row {bad} is outside the {t} tokens"
            ))
            .into());
        }
        let n_rows = logit_rows.map_or(t, <[usize]>::len);
        let d = &*w.device;
        if !acts.as_ref().is_some_and(|a| a.fits(t, n_rows)) {
            *acts = Some(Activations::new(d, c, t, n_rows)?);
        }
        let a = acts.as_mut().expect("set above");
        a.rows.clear();
        match logit_rows {
            Some(r) => a.rows.extend_from_slice(r),
            None => a.rows.extend(0..t),
        }
        let scale = c.attn_scale();
        let eps = c.rms_norm_eps as f32;
        let residual = c.residual_scale();
        d.embed(&w.embed, tokens, &mut a.x)?;
        if let Some(s) = c.embed_scale() {
            d.scale(&mut a.x, s)?;
        }
        // The piece width of the key rotation, when there is one.
        let rotate = match self.keys {
            KeyBasis::Hadamard => Some(rotation_width(c.head_dim())).filter(|&n| n > 1),
            KeyBasis::Identity => None,
        };
        let mut step = cache.step(positions, None)?;
        step.read_rows(&a.rows);
        for (l, lw) in w.layers[..self.layers].iter().enumerate() {
            match &lw.mixer {
                Mixer::Attention(at) => {
                    let qkv = &mut [
                        Projection {
                            w: &at.q,
                            bias: at.q_bias.as_ref(),
                            out: &mut a.q,
                        },
                        Projection {
                            w: &at.k,
                            bias: at.k_bias.as_ref(),
                            out: &mut a.k,
                        },
                        Projection {
                            w: &at.v,
                            bias: at.v_bias.as_ref(),
                            out: &mut a.v,
                        },
                    ];
                    let inv_freq = if at.sliding {
                        &w.inv_freq_local
                    } else {
                        &w.inv_freq
                    };
                    let pairs = w.rope_pairs;
                    let qk_norms = at.q_norm.is_some() && at.k_norm.is_some();
                    if at.gate.is_none() && !qk_norms && rotate.is_none() {
                        // Norm, projections, rotation and head split: one op.
                        let rope = QkvHeads {
                            heads_q: hq,
                            heads_kv: hkv,
                            positions,
                            inv_freq,
                            pairs,
                        };
                        let heads = [&mut a.qh, &mut a.kh, &mut a.vh];
                        d.norm_qkv_heads(&a.x, &lw.ln1, eps, &mut a.hn, qkv, rope, heads)?;
                    } else {
                        if at.gate.is_some() {
                            // The output gate reads the normed rows after attention.
                            d.rms_norm(&a.x, &lw.ln1, eps, &mut a.hn)?;
                            d.linears(&a.hn, qkv)?;
                        } else {
                            d.norm_linears(&a.x, &lw.ln1, eps, &mut a.hn, qkv)?;
                        }
                        if let (Some(qn), Some(kn)) = (&at.q_norm, &at.k_norm) {
                            d.rms_norm(&a.q, qn, eps, &mut a.merged)?;
                            std::mem::swap(&mut a.q, &mut a.merged);
                            d.rms_norm(&a.k, kn, eps, &mut a.kn)?;
                            std::mem::swap(&mut a.k, &mut a.kn);
                        }
                        if let Some(n) = rotate {
                            d.rope(&mut a.q, hq, positions, inv_freq, pairs)?;
                            d.rope(&mut a.k, hkv, positions, inv_freq, pairs)?;
                            d.hadamard(&a.q, n, &mut a.merged)?;
                            std::mem::swap(&mut a.q, &mut a.merged);
                            d.hadamard(&a.k, n, &mut a.kn)?;
                            std::mem::swap(&mut a.k, &mut a.kn);
                            d.split_heads(&a.q, hq, &mut a.qh)?;
                            d.split_heads(&a.k, hkv, &mut a.kh)?;
                        } else {
                            d.rope_heads(&mut a.q, hq, positions, inv_freq, pairs, &mut a.qh)?;
                            d.rope_heads(&mut a.k, hkv, positions, inv_freq, pairs, &mut a.kh)?;
                        }
                        d.split_heads(&a.v, hkv, &mut a.vh)?;
                    }
                    let sinks = at.sinks.as_ref();
                    step.attend_sinks(l, &a.qh, &a.kh, &a.vh, scale, sinks, &mut a.att)?;
                    let (o_bias, post) = (at.o_bias.as_ref(), lw.post_attn.as_ref());
                    if at.gate.is_none() && post.is_none() && residual.is_none() {
                        let (merged, o) = (&mut a.merged, &mut a.o);
                        d.heads_linear_add(&a.att, &at.o, o_bias, merged, o, &mut a.x)?;
                    } else {
                        d.merge_heads(&a.att, &mut a.merged)?;
                        if let Some(g) = &at.gate {
                            d.linear(&a.hn, g, None, &mut a.q)?;
                            d.sigmoid_mul(&a.q, &a.merged, &mut a.qh_flat)?;
                            std::mem::swap(&mut a.merged, &mut a.qh_flat);
                        }
                        let (o, x, hn) = (&mut a.o, &mut a.x, &mut a.hn);
                        let join = Join {
                            post,
                            residual,
                            eps,
                        };
                        project_out(d, &a.merged, &at.o, o_bias, join, o, x, hn)?;
                    }
                }
                Mixer::Conv {
                    b,
                    c: gate,
                    x,
                    kernel,
                    out,
                } => {
                    let cv = a
                        .conv
                        .as_mut()
                        .ok_or_else(|| KitError::Device("convolution buffers missing".into()))?;
                    d.norm_linears(
                        &a.x,
                        &lw.ln1,
                        eps,
                        &mut a.hn,
                        &mut [
                            Projection {
                                w: b,
                                bias: None,
                                out: &mut cv.b,
                            },
                            Projection {
                                w: gate,
                                bias: None,
                                out: &mut cv.c,
                            },
                            Projection {
                                w: x,
                                bias: None,
                                out: &mut cv.x,
                            },
                        ],
                    )?;
                    d.mul(&cv.b, &cv.x, &mut cv.bx)?;
                    step.conv(l, &cv.bx, kernel, &mut cv.y)?;
                    d.mul(&cv.c, &cv.y, &mut cv.bx)?;
                    let post = lw.post_attn.as_ref();
                    let join = Join {
                        post,
                        residual,
                        eps,
                    };
                    project_out(d, &cv.bx, out, None, join, &mut a.o, &mut a.x, &mut a.hn)?;
                }
                Mixer::Delta(dw) => {
                    let dv = a
                        .delta
                        .as_mut()
                        .ok_or_else(|| KitError::Device("delta-rule buffers missing".into()))?;
                    d.norm_linears(
                        &a.x,
                        &lw.ln1,
                        eps,
                        &mut a.hn,
                        &mut [
                            Projection {
                                w: &dw.qkv,
                                bias: None,
                                out: &mut dv.qkv,
                            },
                            Projection {
                                w: &dw.z,
                                bias: None,
                                out: &mut dv.z,
                            },
                            Projection {
                                w: &dw.beta,
                                bias: None,
                                out: &mut dv.beta,
                            },
                            Projection {
                                w: &dw.alpha,
                                bias: Some(&dw.dt_bias),
                                out: &mut dv.alpha,
                            },
                        ],
                    )?;
                    step.delta(
                        l,
                        &dv.qkv,
                        &dw.kernel,
                        &dv.alpha,
                        &dv.beta,
                        &dw.a,
                        eps,
                        &mut dv.core,
                    )?;
                    d.rms_norm(&dv.core, &dw.norm, eps, &mut dv.normed)?;
                    d.silu_mul(&dv.z, &dv.normed, &mut dv.core)?;
                    let post = lw.post_attn.as_ref();
                    let (o, x, hn) = (&mut a.o, &mut a.x, &mut a.hn);
                    let join = Join {
                        post,
                        residual,
                        eps,
                    };
                    project_out(d, &dv.core, &dw.out, None, join, o, x, hn)?;
                }
                Mixer::Ssm(sw) => {
                    let sv = a
                        .ssm
                        .as_mut()
                        .ok_or_else(|| KitError::Device("Mamba2 buffers missing".into()))?;
                    d.norm_linears(
                        &a.x,
                        &lw.ln1,
                        eps,
                        &mut a.hn,
                        &mut [
                            Projection {
                                w: &sw.z,
                                bias: None,
                                out: &mut sv.z,
                            },
                            Projection {
                                w: &sw.xbc,
                                bias: None,
                                out: &mut sv.xbc,
                            },
                            Projection {
                                w: &sw.dt,
                                bias: Some(&sw.dt_bias),
                                out: &mut sv.dt,
                            },
                        ],
                    )?;
                    let (kernel, bias) = (&sw.kernel, &sw.conv_bias);
                    step.ssm(l, &sv.xbc, kernel, bias, &sv.dt, &sw.a, &sw.d, &mut sv.y)?;
                    d.silu_mul(&sv.z, &sv.y, &mut sv.gated)?;
                    d.rms_norm(&sv.gated, &sw.norm, eps, &mut sv.y)?;
                    let post = lw.post_attn.as_ref();
                    let (o, x, hn) = (&mut a.o, &mut a.x, &mut a.hn);
                    let join = Join {
                        post,
                        residual,
                        eps,
                    };
                    project_out(d, &sv.y, &sw.out, None, join, o, x, hn)?;
                }
            }
            match &lw.ffn {
                Ffn::Dense { gate, up, down } => {
                    d.norm_linears(
                        &a.x,
                        &lw.ln2,
                        eps,
                        &mut a.hn,
                        &mut [
                            Projection {
                                w: gate,
                                bias: None,
                                out: &mut a.gate,
                            },
                            Projection {
                                w: up,
                                bias: None,
                                out: &mut a.up,
                            },
                        ],
                    )?;
                    let (act, post) = (c.activation(), lw.post_mlp.as_ref());
                    let (o, x, hn) = (&mut a.o, &mut a.x, &mut a.hn);
                    match (post, residual) {
                        (None, None) => {
                            d.gated_linear_add(act, &a.gate, &a.up, down, &mut a.mlp, o, x)?
                        }
                        _ => {
                            d.gated(act, &a.gate, &a.up, &mut a.mlp)?;
                            let join = Join {
                                post,
                                residual,
                                eps,
                            };
                            project_out(d, &a.mlp, down, None, join, o, x, hn)?;
                        }
                    }
                }
                Ffn::Experts {
                    router,
                    router_bias,
                    experts,
                    spec,
                } => {
                    d.rms_norm(&a.x, &lw.ln2, eps, &mut a.hn)?;
                    let m = a
                        .moe
                        .as_mut()
                        .ok_or_else(|| KitError::Device("router buffers missing".into()))?;
                    d.linear(&a.hn, router, router_bias.as_ref(), &mut m.logits)?;
                    d.download_into(&m.logits, TensorDtype::F32, &mut m.downloaded)?;
                    if !m.downloaded.read_f32_into(&mut m.host) {
                        return Err(KitError::Device(
                            "the router's logits did not download as f32".into(),
                        ));
                    }
                    route(&m.host, spec, &mut m.routes);
                    m.groups.group(&m.routes, spec.count);
                    d.experts(&a.hn, experts, spec, &m.routes, &m.groups, &mut a.o)?;
                    if let Some(r) = residual {
                        d.scale(&mut a.o, r)?;
                    }
                    residual_add(d, &mut a.x, &mut a.o, lw.post_mlp.as_ref(), eps, &mut a.hn)?;
                }
            }
        }
        d.rms_norm(&a.x, &w.norm, eps, &mut a.hn)?;
        d.gather_rows(&a.hn, &a.rows, &mut a.picked)?;
        let head = w.lm_head.as_ref().unwrap_or(&w.embed);
        d.linear(&a.picked, head, None, &mut a.logits)?;
        if let Some(div) = c.logit_divisor() {
            d.scale(&mut a.logits, 1.0 / div)?;
        }
        step.commit()?;
        let a = &*a;
        Ok(ForwardOutput {
            logits: &a.logits,
            hidden: want_hidden.then_some(&a.picked),
        })
    }
}

/// How a block's output joins the residual stream: through its post-norm (Gemma 3), times
/// the residual multiplier (Granite), or as it is.
#[derive(Clone, Copy)]
struct Join<'a, T> {
    post: Option<&'a T>,
    residual: Option<f32>,
    eps: f32,
}

/// A block's output projection `y = x·Wᵀ (+ bias)` added to the residual stream `resid`:
/// in one [`ModelDevice::linear_add`] when the block has no post-norm and no residual
/// multiplier, else `y` into `o`, scaled, and [`residual_add`].
#[allow(clippy::too_many_arguments)]
fn project_out<D: ModelDevice>(
    d: &D,
    x: &D::Tensor,
    w: &D::Weight,
    bias: Option<&D::Tensor>,
    join: Join<'_, D::Tensor>,
    o: &mut D::Tensor,
    resid: &mut D::Tensor,
    scratch: &mut D::Tensor,
) -> Result<(), KitError> {
    if join.post.is_none() && join.residual.is_none() {
        return d.linear_add(x, w, bias, o, resid);
    }
    d.linear(x, w, bias, o)?;
    if let Some(r) = join.residual {
        d.scale(o, r)?;
    }
    residual_add(d, resid, o, join.post, join.eps, scratch)
}

/// `x += y`, or `x += rms_norm(y)·post` when the block has a post-norm (`scratch` receives
/// the normed rows).
fn residual_add<D: ModelDevice>(
    d: &D,
    x: &mut D::Tensor,
    y: &mut D::Tensor,
    post: Option<&D::Tensor>,
    eps: f32,
    scratch: &mut D::Tensor,
) -> Result<(), KitError> {
    match post {
        Some(w) => {
            d.rms_norm(y, w, eps, scratch)?;
            d.add_assign(x, scratch)
        }
        None => d.add_assign(x, y),
    }
}

/// The activation buffers of one forward shape (`T` tokens, `R` logit rows), kept between
/// calls: a decode loop allocates nothing once warm.
pub struct Activations<D: ModelDevice> {
    t: usize,
    n_rows: usize,
    rows: Vec<usize>,
    x: D::Tensor,
    hn: D::Tensor,
    q: D::Tensor,
    k: D::Tensor,
    /// The normed (Gemma) or rotated k, swapped with `k`.
    kn: D::Tensor,
    v: D::Tensor,
    qh: D::Tensor,
    kh: D::Tensor,
    vh: D::Tensor,
    att: D::Tensor,
    merged: D::Tensor,
    o: D::Tensor,
    gate: D::Tensor,
    up: D::Tensor,
    mlp: D::Tensor,
    picked: D::Tensor,
    logits: D::Tensor,
    /// The gated attention output (`[T, Hq·hd]`, Qwen3.5).
    qh_flat: D::Tensor,
    /// Those of the convolution blocks (a model with any).
    conv: Option<ConvActivations<D>>,
    /// Those of the delta-rule blocks (a model with any).
    delta: Option<DeltaActivations<D>>,
    /// Those of the Mamba2 blocks (a model with any).
    ssm: Option<SsmActivations<D>>,
    /// The router's (a model with a mixture of experts).
    moe: Option<RouterActivations<D>>,
}

/// The router's logits (`[T, experts]`) on the device and on the host, and the routes and
/// groups made from them.
struct RouterActivations<D: ModelDevice> {
    logits: D::Tensor,
    downloaded: HostTensor,
    host: Vec<f32>,
    routes: Routes,
    groups: ExpertGroups,
}

/// The buffers of a delta-rule block: the q/k/v projection (`[T, channels]`), the output
/// gate `z` and the rule's output (`[T, Hv·dv]`, `core` reused for the gated product), its
/// normed form, and the per-head `alpha` and `beta` (`[T, Hv]`).
struct DeltaActivations<D: ModelDevice> {
    qkv: D::Tensor,
    z: D::Tensor,
    core: D::Tensor,
    normed: D::Tensor,
    alpha: D::Tensor,
    beta: D::Tensor,
}

/// The buffers of a Mamba2 block: the gate `z`, the scan's output `y` (`[T, inner]`, reused
/// for the normed product) and their gated product, the convolution's input (`[T, channels]`)
/// and the step projection (`[T, heads]`).
struct SsmActivations<D: ModelDevice> {
    z: D::Tensor,
    xbc: D::Tensor,
    dt: D::Tensor,
    y: D::Tensor,
    gated: D::Tensor,
}

/// The buffers of a convolution block: its three projections (`[T, hidden]`), their gated
/// product (`bx`, the convolution's input, then reused for the gated output) and the
/// convolution's output.
struct ConvActivations<D: ModelDevice> {
    b: D::Tensor,
    c: D::Tensor,
    x: D::Tensor,
    bx: D::Tensor,
    y: D::Tensor,
}

impl<D: ModelDevice> Activations<D> {
    fn new(d: &D, c: &ModelConfig, t: usize, n_rows: usize) -> Result<Self, KitError> {
        let (h, hd, hq, hkv, im) = (
            c.hidden_size,
            c.head_dim(),
            c.num_attention_heads,
            c.kv_heads(),
            c.intermediate_size,
        );
        Ok(Activations {
            t,
            n_rows,
            rows: Vec::with_capacity(n_rows),
            x: d.zeros(&[t, h])?,
            hn: d.zeros(&[t, h])?,
            q: d.zeros(&[t, hq * hd])?,
            k: d.zeros(&[t, hkv * hd])?,
            kn: d.zeros(&[t, hkv * hd])?,
            v: d.zeros(&[t, hkv * hd])?,
            qh: d.zeros(&[hq, t, hd])?,
            kh: d.zeros(&[hkv, t, hd])?,
            vh: d.zeros(&[hkv, t, hd])?,
            att: d.zeros(&[hq, t, hd])?,
            merged: d.zeros(&[t, hq * hd])?,
            o: d.zeros(&[t, h])?,
            gate: d.zeros(&[t, im])?,
            up: d.zeros(&[t, im])?,
            mlp: d.zeros(&[t, im])?,
            picked: d.zeros(&[n_rows, h])?,
            logits: d.zeros(&[n_rows, c.vocab_size])?,
            qh_flat: d.zeros(&[t, hq * hd])?,
            delta: match c.attention.iter().find_map(|l| match *l {
                LayerAttention::Delta {
                    key_heads,
                    value_heads,
                    head_dim,
                    ..
                } => Some((key_heads, value_heads, head_dim)),
                _ => None,
            }) {
                Some((hk, hv, dn)) => {
                    let ch = (2 * hk + hv) * dn;
                    Some(DeltaActivations {
                        qkv: d.zeros(&[t, ch])?,
                        z: d.zeros(&[t, hv * dn])?,
                        core: d.zeros(&[t, hv * dn])?,
                        normed: d.zeros(&[t, hv * dn])?,
                        alpha: d.zeros(&[t, hv])?,
                        beta: d.zeros(&[t, hv])?,
                    })
                }
                None => None,
            },
            ssm: match c.ssm(c.num_hidden_layers).ok().flatten() {
                Some(m) => {
                    let inner = m.heads * m.head_dim;
                    Some(SsmActivations {
                        z: d.zeros(&[t, inner])?,
                        xbc: d.zeros(&[t, m.conv_channels()])?,
                        dt: d.zeros(&[t, m.heads])?,
                        y: d.zeros(&[t, inner])?,
                        gated: d.zeros(&[t, inner])?,
                    })
                }
                None => None,
            },
            moe: match c.experts() {
                Some(e) => Some(RouterActivations {
                    logits: d.zeros(&[t, e.count])?,
                    downloaded: HostTensor::from_f32(&[0], &[]),
                    host: Vec::with_capacity(t * e.count),
                    routes: Routes::default(),
                    groups: ExpertGroups::default(),
                }),
                None => None,
            },
            conv: match c
                .attention
                .iter()
                .any(|l| matches!(l, LayerAttention::Conv { .. }))
            {
                true => Some(ConvActivations {
                    b: d.zeros(&[t, h])?,
                    c: d.zeros(&[t, h])?,
                    x: d.zeros(&[t, h])?,
                    bx: d.zeros(&[t, h])?,
                    y: d.zeros(&[t, h])?,
                }),
                false => None,
            },
        })
    }

    fn fits(&self, t: usize, n_rows: usize) -> bool {
        (self.t, self.n_rows) == (t, n_rows)
    }
}

/// The experts of a sparse layer (prefix `p`): each a view of its rows of the stacked
/// `mlp.experts.{gate,up,down}_proj.weight` (`[experts, rows, cols]`, a GGUF's 3-D expert
/// tensors, kept in place), or Hugging Face's per-expert `mlp.experts.{e}.*_proj.weight`.
fn load_experts<D: ModelDevice>(
    device: &D,
    pkg: &ModelPackage,
    p: &str,
    spec: &Experts,
    h: usize,
) -> Result<Vec<Expert<D>>, ModelError> {
    let (n, w) = (spec.count, spec.width);
    let stacked = pkg.has_tensor(&format!("{p}mlp.experts.gate_proj.weight"));
    // Each stacked tensor is read (and checked) once; its experts share its bytes.
    let whole = |proj: &str, rows: usize, cols: usize| -> Result<_, ModelError> {
        let name = format!("{p}mlp.experts.{proj}.weight");
        Ok(if stacked {
            Some((pkg.tensor(&name, &[n, rows, cols])?, name))
        } else {
            None
        })
    };
    let parts = [("gate_proj", w, h), ("up_proj", w, h), ("down_proj", h, w)];
    let wholes = parts
        .iter()
        .map(|&(proj, rows, cols)| whole(proj, rows, cols))
        .collect::<Result<Vec<_>, _>>()?;
    let part = |i: usize, e: usize| -> Result<D::Weight, ModelError> {
        let (proj, rows, cols) = parts[i];
        let data = match &wholes[i] {
            Some((t, name)) => t
                .rows(cols, e * rows..(e + 1) * rows)
                .ok_or_else(|| ModelError::Malformed(format!("{name}: rows of partial blocks")))?,
            None => pkg.tensor(&format!("{p}mlp.experts.{e}.{proj}.weight"), &[rows, cols])?,
        };
        device
            .weight(held(device, data), rows, cols)
            .map_err(weights_err)
    };
    // GPT-OSS's expert biases: `[experts, rows]` each, a row per expert.
    let biases = parts
        .iter()
        .map(|&(proj, rows, _)| {
            let name = format!("{p}mlp.experts.{proj}.bias");
            match pkg.has_tensor(&name) {
                true => pkg.tensor_f32(&name, &[n, rows]).map(|b| Some((b, rows))),
                false => Ok(None),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bias = |i: usize, e: usize| -> Result<Option<D::Tensor>, ModelError> {
        let Some((b, rows)) = &biases[i] else {
            return Ok(None);
        };
        let row = &b[e * rows..(e + 1) * rows];
        device.tensor(row, &[*rows]).map(Some).map_err(weights_err)
    };
    (0..n)
        .map(|e| {
            Ok(Expert {
                gate: part(0, e)?,
                up: part(1, e)?,
                down: part(2, e)?,
                gate_bias: bias(0, e)?,
                up_bias: bias(1, e)?,
                down_bias: bias(2, e)?,
            })
        })
        .collect()
}

/// The order of a head's dims that puts a partial rotary's pairs where a rotate-half over
/// the whole head pairs them: with `rot` of `hd` dims rotating as `(i, i + rot/2)`, new
/// dim `j` reads old dim `order[j]`, and pair `(j, j + hd/2)` is a rotary pair for
/// `j < rot/2` and two pass-through dims otherwise (rotated by angle 0).
fn rotary_first(hd: usize, rot: usize) -> Vec<usize> {
    let (half, r2, rest) = (hd / 2, rot / 2, (hd - rot) / 2);
    (0..hd)
        .map(|j| match (j < half, j % half) {
            (true, i) if i < r2 => i,
            (true, i) => rot + (i - r2),
            (false, i) if i < r2 => r2 + i,
            (false, i) => rot + rest + (i - r2),
        })
        .collect()
}
