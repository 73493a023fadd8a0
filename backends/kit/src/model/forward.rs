//! [`LlamaModel`]: weights on the device and the forward pass, written once.

use std::sync::Arc;

use kvplug_core::CacheError;

use super::config::{LlamaConfig, ModelError};
use super::ops::ModelDevice;
use super::package::ModelPackage;
use crate::cache::{KitCache, KitError};

struct Layer<D: ModelDevice> {
    ln1: D::Tensor,
    q: D::Weight,
    k: D::Weight,
    v: D::Weight,
    q_bias: Option<D::Tensor>,
    k_bias: Option<D::Tensor>,
    v_bias: Option<D::Tensor>,
    o: D::Weight,
    ln2: D::Tensor,
    gate: D::Weight,
    up: D::Weight,
    down: D::Weight,
}

/// A Llama-family model on device `D`.
pub struct LlamaModel<D: ModelDevice> {
    device: Arc<D>,
    config: LlamaConfig,
    embed: D::Tensor,
    layers: Vec<Layer<D>>,
    norm: D::Tensor,
    lm_head: D::Weight,
    inv_freq: Vec<f32>,
}

/// What a forward pass returns.
pub struct ForwardOutput<T> {
    /// `[R, vocab]`.
    pub logits: T,
    /// `[R, hidden]`, when asked for.
    pub hidden: Option<T>,
}

fn weights_err(e: KitError) -> ModelError {
    ModelError::Malformed(format!("loading weights: {e}"))
}

impl<D: ModelDevice> LlamaModel<D> {
    /// Loads the first `layers` layers (all when `None`) of `pkg` onto `device`.
    pub fn load(
        device: Arc<D>,
        pkg: &ModelPackage,
        layers: Option<usize>,
    ) -> Result<Self, ModelError> {
        let c = pkg.config.clone();
        let n_layers = layers.unwrap_or(c.num_hidden_layers);
        if n_layers == 0 || n_layers > c.num_hidden_layers {
            return Err(ModelError::Malformed(format!(
                "cannot use {n_layers} layers of a {}-layer model",
                c.num_hidden_layers
            )));
        }
        let (h, hd, hq, hkv, im) = (
            c.hidden_size,
            c.head_dim(),
            c.num_attention_heads,
            c.kv_heads(),
            c.intermediate_size,
        );
        let vec = |name: &str, n: usize| -> Result<D::Tensor, ModelError> {
            device
                .tensor(&pkg.tensor_f32(name, &[n])?, &[n])
                .map_err(weights_err)
        };
        let mat = |name: &str, rows: usize, cols: usize| -> Result<D::Weight, ModelError> {
            device
                .weight(&pkg.tensor_f32(name, &[rows, cols])?, rows, cols)
                .map_err(weights_err)
        };
        let embed_data = pkg.tensor_f32("model.embed_tokens.weight", &[c.vocab_size, h])?;
        let lm_head = if c.tie_word_embeddings || !pkg.contains("lm_head.weight") {
            device
                .weight(&embed_data, c.vocab_size, h)
                .map_err(weights_err)?
        } else {
            mat("lm_head.weight", c.vocab_size, h)?
        };
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
            ls.push(Layer {
                ln1: vec(&format!("{p}input_layernorm.weight"), h)?,
                q: mat(&format!("{p}self_attn.q_proj.weight"), hq * hd, h)?,
                k: mat(&format!("{p}self_attn.k_proj.weight"), hkv * hd, h)?,
                v: mat(&format!("{p}self_attn.v_proj.weight"), hkv * hd, h)?,
                q_bias: bias("q", hq * hd)?,
                k_bias: bias("k", hkv * hd)?,
                v_bias: bias("v", hkv * hd)?,
                o: mat(&format!("{p}self_attn.o_proj.weight"), h, hq * hd)?,
                ln2: vec(&format!("{p}post_attention_layernorm.weight"), h)?,
                gate: mat(&format!("{p}mlp.gate_proj.weight"), im, h)?,
                up: mat(&format!("{p}mlp.up_proj.weight"), im, h)?,
                down: mat(&format!("{p}mlp.down_proj.weight"), h, im)?,
            });
        }
        Ok(LlamaModel {
            embed: device
                .tensor(&embed_data, &[c.vocab_size, h])
                .map_err(weights_err)?,
            norm: vec("model.norm.weight", h)?,
            inv_freq: c.inv_freq(),
            lm_head,
            layers: ls,
            config: c,
            device,
        })
    }

    pub(crate) fn device_arc(&self) -> Arc<D> {
        self.device.clone()
    }

    /// The configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Layers in use.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Runs `tokens` at `positions` through the model, writing K/V into `cache`, and returns
    /// the logits (and optionally the final hidden states) of rows `logit_rows` (all when
    /// `None`).
    pub fn forward(
        &self,
        cache: &mut KitCache<D>,
        tokens: &[i32],
        positions: &[i32],
        logit_rows: Option<&[usize]>,
        want_hidden: bool,
    ) -> Result<ForwardOutput<D::Tensor>, KitError> {
        let c = &self.config;
        let (t, h, hd, hq, hkv) = (
            tokens.len(),
            c.hidden_size,
            c.head_dim(),
            c.num_attention_heads,
            c.kv_heads(),
        );
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
        let all: Vec<usize>;
        let rows = match logit_rows {
            Some(r) => r,
            None => {
                all = (0..t).collect();
                &all
            }
        };
        if let Some(&bad) = rows.iter().find(|&&r| r >= t) {
            return Err(CacheError::bad_shape(format!(
                "logit row {bad} is outside the {t} tokens"
            ))
            .into());
        }
        let d = &*self.device;
        let z = |dims: &[usize]| d.zeros(dims);
        let (mut x, mut hn) = (z(&[t, h])?, z(&[t, h])?);
        let (mut q, mut k, mut v) = (z(&[t, hq * hd])?, z(&[t, hkv * hd])?, z(&[t, hkv * hd])?);
        let (mut qh, mut kh, mut vh, mut att) = (
            z(&[hq, t, hd])?,
            z(&[hkv, t, hd])?,
            z(&[hkv, t, hd])?,
            z(&[hq, t, hd])?,
        );
        let (mut a, mut o) = (z(&[t, hq * hd])?, z(&[t, h])?);
        let (mut g, mut u, mut m) = (
            z(&[t, c.intermediate_size])?,
            z(&[t, c.intermediate_size])?,
            z(&[t, c.intermediate_size])?,
        );
        let scale = 1.0 / (hd as f32).sqrt();
        d.embed(&self.embed, tokens, &mut x)?;
        for (l, w) in self.layers.iter().enumerate() {
            d.rms_norm(&x, &w.ln1, c.rms_norm_eps as f32, &mut hn)?;
            d.linear(&hn, &w.q, w.q_bias.as_ref(), &mut q)?;
            d.linear(&hn, &w.k, w.k_bias.as_ref(), &mut k)?;
            d.linear(&hn, &w.v, w.v_bias.as_ref(), &mut v)?;
            d.rope(&mut q, hq, positions, &self.inv_freq)?;
            d.rope(&mut k, hkv, positions, &self.inv_freq)?;
            d.split_heads(&q, hq, &mut qh)?;
            d.split_heads(&k, hkv, &mut kh)?;
            d.split_heads(&v, hkv, &mut vh)?;
            cache.update_and_attend(l, &qh, &kh, &vh, positions, scale, &mut att)?;
            d.merge_heads(&att, &mut a)?;
            d.linear(&a, &w.o, None, &mut o)?;
            d.add_assign(&mut x, &o)?;
            d.rms_norm(&x, &w.ln2, c.rms_norm_eps as f32, &mut hn)?;
            d.linear(&hn, &w.gate, None, &mut g)?;
            d.linear(&hn, &w.up, None, &mut u)?;
            d.silu_mul(&g, &u, &mut m)?;
            d.linear(&m, &w.down, None, &mut o)?;
            d.add_assign(&mut x, &o)?;
        }
        d.rms_norm(&x, &self.norm, c.rms_norm_eps as f32, &mut hn)?;
        let mut picked = z(&[rows.len(), h])?;
        d.gather_rows(&hn, rows, &mut picked)?;
        let mut logits = z(&[rows.len(), c.vocab_size])?;
        d.linear(&picked, &self.lm_head, None, &mut logits)?;
        Ok(ForwardOutput {
            logits,
            hidden: want_hidden.then_some(picked),
        })
    }
}
