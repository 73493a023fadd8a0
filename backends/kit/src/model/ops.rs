//! The device operations the model graph needs, on top of the cache primitives.

use kvplug_core::RopePairs;
use kvplug_plugin_api::{HostTensor, TensorDtype};

use crate::cache::KitError;
use crate::device::Device;

use super::config::{Activation, Experts};
use super::moe::{check, combine, Expert, ExpertGroups, Routes};
use super::stored::StoredTensor;

/// Refuses a [`ModelDevice::hadamard`] call whose shapes break its contract: `n` not a power
/// of two or not dividing a row's width (the last dim), or `out` of other dims than `x`.
pub fn check_hadamard(x: &[usize], n: usize, out: &[usize]) -> Result<(), KitError> {
    let row = x.last().copied().unwrap_or(0);
    if !n.is_power_of_two() || row % n != 0 || out != x {
        return Err(KitError::Device(format!(
            "hadamard of {n}-wide pieces on {x:?} into {out:?}"
        )));
    }
    Ok(())
}

/// Multiplies each `n`-wide piece of `data` by `H_n / √n` in place (the host form of
/// [`ModelDevice::hadamard`]: butterflies `(a, b) → (a + b, a − b)` at strides 1, 2, 4, …,
/// then the scale). `n` is a power of two dividing `data.len()` ([`check_hadamard`]).
pub fn hadamard_in_place(data: &mut [f32], n: usize) {
    let norm = 1.0 / (n as f32).sqrt();
    for piece in data.chunks_exact_mut(n) {
        let mut h = 1;
        while h < n {
            for pair in piece.chunks_exact_mut(2 * h) {
                let (lo, hi) = pair.split_at_mut(h);
                for (a, b) in lo.iter_mut().zip(hi) {
                    (*a, *b) = (*a + *b, *a - *b);
                }
            }
            h *= 2;
        }
        piece.iter_mut().for_each(|v| *v *= norm);
    }
}

/// GPT-OSS's clamped SwiGLU of one gate and up value ([`Activation::SwigluOai`]), in f32 as
/// ggml computes it: `g = min(gate, limit)`, `u = clamp(up, −limit, limit)`,
/// `g / (1 + e^{−alpha·g}) · (u + 1)`.
pub fn swiglu_oai(gate: f32, up: f32, alpha: f32, limit: f32) -> f32 {
    let g = gate.min(limit);
    let u = up.clamp(-limit, limit);
    g / (1.0 + (-alpha * g).exp()) * (u + 1.0)
}

/// One projection of a [`ModelDevice::linears`] call: `out = x·Wᵀ (+ bias)`.
pub struct Projection<'a, D: ModelDevice> {
    pub w: &'a D::Weight,
    pub bias: Option<&'a D::Tensor>,
    pub out: &'a mut D::Tensor,
}

/// The rotary embedding and head split of [`ModelDevice::norm_qkv_heads`]: q has `heads_q`
/// heads, k and v `heads_kv`, each `2 · inv_freq.len()` wide (rotary over whole heads).
#[derive(Clone, Copy)]
pub struct QkvHeads<'a> {
    pub heads_q: usize,
    pub heads_kv: usize,
    /// Each token's position.
    pub positions: &'a [i32],
    pub inv_freq: &'a [f32],
    pub pairs: RopePairs,
}

/// Checks [`ModelDevice::adjust_rows`]'s arguments for logit rows of `dims`: `[R, V]`, as
/// many adjustments as places, each place inside the rows; returns `(R, V)`.
pub fn check_adjust(
    dims: &[usize],
    at: &[[u32; 2]],
    by: &[kvplug_core::Adjust],
) -> Result<(usize, usize), KitError> {
    let [rows, width] = dims[..] else {
        return Err(KitError::Device(format!(
            "adjusting logits of shape {dims:?}"
        )));
    };
    let outside = |&[r, c]: &[u32; 2]| r as usize >= rows || c as usize >= width;
    if at.len() != by.len() || at.iter().any(outside) {
        return Err(KitError::Device(format!(
            "adjusting {dims:?} at {} places by {}, or a place outside them",
            at.len(),
            by.len()
        )));
    }
    Ok((rows, width))
}

/// The rows of `x` (`[R, V]`) on the host, and `V`: what the defaults of
/// [`ModelDevice::argmax_rows`] and [`ModelDevice::top_k_rows`] pick from.
fn host_rows<D: ModelDevice>(d: &D, x: &D::Tensor) -> Result<(Vec<f32>, usize), KitError> {
    let width = d.dims(x).last().copied().unwrap_or(0).max(1);
    let rows = d
        .download(x, TensorDtype::F32)?
        .to_f32()
        .ok_or_else(|| KitError::Device("logit rows: an f32 download was not f32".into()))?;
    Ok((rows, width))
}

/// [`ModelDevice::norm_qkv_heads`] as the calls it is made of: its default, and what a
/// device that fuses it runs where it cannot (shapes or limits it does not cover).
#[allow(clippy::too_many_arguments)]
pub fn compose_norm_qkv_heads<D: ModelDevice>(
    d: &D,
    x: &D::Tensor,
    norm: &D::Tensor,
    eps: f32,
    hn: &mut D::Tensor,
    qkv: &mut [Projection<'_, D>; 3],
    rope: QkvHeads<'_>,
    heads: [&mut D::Tensor; 3],
) -> Result<(), KitError> {
    d.norm_linears(x, norm, eps, hn, qkv)?;
    let [q, k, v] = qkv;
    let [qh, kh, vh] = heads;
    let QkvHeads {
        heads_q,
        heads_kv,
        positions,
        inv_freq,
        pairs,
    } = rope;
    d.rope_heads(q.out, heads_q, positions, inv_freq, pairs, qh)?;
    d.rope_heads(k.out, heads_kv, positions, inv_freq, pairs, kh)?;
    d.split_heads(v.out, heads_kv, vh)
}

/// Tensor operations of the decoder forward pass (Llama family, Gemma 3, LFM2). Activations are f32 `Device::Tensor`s,
/// row-major; `[T, n]` means T rows of n values. Implementations may assume the kit passes
/// consistent shapes.
pub trait ModelDevice: Device {
    /// A `[rows, cols]` matrix for [`ModelDevice::linear`] and [`ModelDevice::embed`], held
    /// in its stored dtype (f32, f16, bf16 or a ggml block format). A device without kernels
    /// for that dtype may widen it once at load, never per call, and says so in its
    /// [`Backend::features`](crate::Backend::features) (`weights=…`, `weights-widened=…`).
    type Weight: Send + Sync;

    /// Whether [`ModelDevice::weight`] takes MXFP4 blocks as stored. The default (`false`):
    /// the kit re-encodes them once at load, exactly, as Q5_0 (or f32,
    /// [`StoredTensor::computable`]) before handing them over.
    fn reads_mxfp4(&self) -> bool {
        false
    }

    /// Makes `data` (`[rows, cols]`, row-major, `rows·cols` elements) a weight (`out = x·Wᵀ`).
    /// A host-memory device may keep `data` itself (the mapped file: no copy); others upload
    /// its bytes once.
    fn weight(
        &self,
        data: StoredTensor,
        rows: usize,
        cols: usize,
    ) -> Result<Self::Weight, KitError>;
    /// A tensor holding `data` with `dims`. The default uploads it as a host tensor.
    fn tensor(&self, data: &[f32], dims: &[usize]) -> Result<Self::Tensor, KitError> {
        self.upload(&HostTensor::from_f32(dims, data))
    }
    /// `out[t] = table[ids[t]]` widened to f32; `table` is `[vocab, hidden]` (the same weight
    /// serves a tied LM head), out `[T, hidden]`.
    fn embed(
        &self,
        table: &Self::Weight,
        ids: &[i32],
        out: &mut Self::Tensor,
    ) -> Result<(), KitError>;
    /// `out = x / rms(x) · w` per row of `w.len()` values (`eps` inside the root): x
    /// `[T, k·n]` with w `[n]` normalises each n-wide piece (per-head q/k norms).
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        eps: f32,
        out: &mut Self::Tensor,
    ) -> Result<(), KitError>;
    /// `out = x·Wᵀ (+ bias)`: x `[T, cols]`, out `[T, rows]`.
    fn linear(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        bias: Option<&Self::Tensor>,
        out: &mut Self::Tensor,
    ) -> Result<(), KitError>;
    /// `out += x·Wᵀ (+ bias)`: a block's output projection added to the residual stream
    /// (`out` `[T, rows]`). `scratch` (`[T, rows]`) may be left holding anything. The default
    /// is [`ModelDevice::linear`] into `scratch`, then [`ModelDevice::add_assign`]; a device
    /// may add where it stores each output (one kernel instead of two).
    fn linear_add(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        bias: Option<&Self::Tensor>,
        scratch: &mut Self::Tensor,
        out: &mut Self::Tensor,
    ) -> Result<(), KitError> {
        self.linear(x, w, bias, scratch)?;
        self.add_assign(out, scratch)
    }
    /// `out += merge_heads(x)·Wᵀ (+ bias)`: attention's output (`x` `[H, T, D]`) through its
    /// output projection into the residual stream. `merged` (`[T, H·D]`) and `scratch`
    /// (`[T, rows]`) may be left holding anything (a device may read `x` as merged: one
    /// kernel less). The default is [`ModelDevice::merge_heads`] into `merged`, then
    /// [`ModelDevice::linear_add`].
    fn heads_linear_add(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        bias: Option<&Self::Tensor>,
        merged: &mut Self::Tensor,
        scratch: &mut Self::Tensor,
        out: &mut Self::Tensor,
    ) -> Result<(), KitError> {
        self.merge_heads(x, merged)?;
        self.linear_add(merged, w, bias, scratch, out)
    }
    /// [`ModelDevice::linear`] for each projection of one input (a layer's q/k/v, its
    /// gate/up), with the same results; a device may run them as one job (the cpu: one
    /// quantization of `x`, one dispatch). The default calls `linear` for each in turn, so
    /// on an error the outputs before the failing one are already written (they are the
    /// scratch of a forward, which then fails as a whole).
    fn linears(
        &self,
        x: &Self::Tensor,
        projections: &mut [Projection<'_, Self>],
    ) -> Result<(), KitError> {
        projections
            .iter_mut()
            .try_for_each(|p| self.linear(x, p.w, p.bias, p.out))
    }
    /// [`ModelDevice::rms_norm`] of `x` with `norm` into `hn`, then
    /// [`ModelDevice::linears`] of `hn`: a block's normed input projections. `hn` may be left
    /// holding anything (a device may normalize as it reads `x`: one kernel less). The
    /// default is those two calls.
    fn norm_linears(
        &self,
        x: &Self::Tensor,
        norm: &Self::Tensor,
        eps: f32,
        hn: &mut Self::Tensor,
        projections: &mut [Projection<'_, Self>],
    ) -> Result<(), KitError> {
        self.rms_norm(x, norm, eps, hn)?;
        self.linears(hn, projections)
    }
    /// Rotary embedding in place on `x` `[T, heads·head_dim]`: token t rotates pair `i` of
    /// each head by angle `positions[t] · inv_freq[i]`, the pair being `(i, i + head_dim/2)`
    /// for [`RopePairs::Halves`] (rotate-half) and `(2i, 2i + 1)` for
    /// [`RopePairs::Interleaved`]: `(a, b) → (a·cos − b·sin, b·cos + a·sin)`.
    fn rope(
        &self,
        x: &mut Self::Tensor,
        heads: usize,
        positions: &[i32],
        inv_freq: &[f32],
        pairs: RopePairs,
    ) -> Result<(), KitError>;
    /// [`ModelDevice::rope`] of `x` (`[T, heads·head_dim]`), then
    /// [`ModelDevice::split_heads`] into `out` (`[heads, T, head_dim]`); `x` may be left
    /// rotated or not. The default is those two calls; a device may rotate as it splits
    /// (one pass instead of two).
    fn rope_heads(
        &self,
        x: &mut Self::Tensor,
        heads: usize,
        positions: &[i32],
        inv_freq: &[f32],
        pairs: RopePairs,
        out: &mut Self::Tensor,
    ) -> Result<(), KitError> {
        self.rope(x, heads, positions, inv_freq, pairs)?;
        self.split_heads(x, heads, out)
    }
    /// A layer's attention inputs: [`ModelDevice::norm_linears`] of `x` into the q, k and v
    /// projections (`qkv`), then [`ModelDevice::rope_heads`] of q into `heads[0]` and of k
    /// into `heads[1]`, and [`ModelDevice::split_heads`] of v into `heads[2]` (`[heads, T,
    /// head_dim]` each), as `rope` says. The projections' outputs and `hn` may be left
    /// holding anything: a device may rotate and split where it stores each output (one
    /// kernel instead of six). The default is those calls ([`compose_norm_qkv_heads`]).
    #[allow(clippy::too_many_arguments)]
    fn norm_qkv_heads(
        &self,
        x: &Self::Tensor,
        norm: &Self::Tensor,
        eps: f32,
        hn: &mut Self::Tensor,
        qkv: &mut [Projection<'_, Self>; 3],
        rope: QkvHeads<'_>,
        heads: [&mut Self::Tensor; 3],
    ) -> Result<(), KitError> {
        compose_norm_qkv_heads(self, x, norm, eps, hn, qkv, rope, heads)
    }
    /// `out = x` with each `n`-wide piece of every row multiplied by `H_n / √n`, `H_n`
    /// Sylvester's Hadamard matrix (`H_1 = [1]`, `H_2m = [[H_m, H_m], [H_m, −H_m]]`): x and
    /// out `[T, k·n]`, `n` a power of two (the rotation of
    /// [`KeyBasis::Hadamard`](kvplug_core::KeyBasis::Hadamard)). Any summation order. The
    /// default is correct but round-trips through host memory ([`hadamard_in_place`]); a
    /// device that runs quantized KV caches should compute it where its tensors live.
    fn hadamard(&self, x: &Self::Tensor, n: usize, out: &mut Self::Tensor) -> Result<(), KitError> {
        let dims = self.dims(x).to_vec();
        check_hadamard(&dims, n, self.dims(out))?;
        let mut data = self
            .download(x, TensorDtype::F32)?
            .to_f32()
            .ok_or_else(|| KitError::Device("hadamard: an f32 download was not f32".into()))?;
        hadamard_in_place(&mut data, n);
        *out = self.tensor(&data, &dims)?;
        Ok(())
    }
    /// `[T, H·D]` → `[H, T, D]`.
    fn split_heads(
        &self,
        x: &Self::Tensor,
        heads: usize,
        out: &mut Self::Tensor,
    ) -> Result<(), KitError>;
    /// `[H, T, D]` → `[T, H·D]`.
    fn merge_heads(&self, x: &Self::Tensor, out: &mut Self::Tensor) -> Result<(), KitError>;
    /// `out = silu(gate) · up`.
    fn silu_mul(
        &self,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        out: &mut Self::Tensor,
    ) -> Result<(), KitError>;
    /// `out = gelu(gate) · up`, GELU's tanh approximation
    /// `0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³)))`.
    fn gelu_tanh_mul(
        &self,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        out: &mut Self::Tensor,
    ) -> Result<(), KitError>;
    /// `out = swiglu_oai(gate, up)` element by element ([`Activation::SwigluOai`]: `g =
    /// min(gate, limit)`, `u = clamp(up, −limit, limit)`, `g·sigmoid(alpha·g)·(u + 1)`;
    /// GPT-OSS's experts). The default is correct but round-trips through host memory.
    fn swiglu_oai_mul(
        &self,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        alpha: f32,
        limit: f32,
        out: &mut Self::Tensor,
    ) -> Result<(), KitError> {
        let dims = self.dims(gate).to_vec();
        if self.dims(up) != dims {
            return Err(KitError::Device(format!(
                "swiglu_oai_mul: shapes {dims:?} and {:?} differ",
                self.dims(up)
            )));
        }
        let f32s = |t: &Self::Tensor| -> Result<Vec<f32>, KitError> {
            self.download(t, TensorDtype::F32)?.to_f32().ok_or_else(|| {
                KitError::Device("swiglu_oai_mul: an f32 download was not f32".into())
            })
        };
        let (mut g, u) = (f32s(gate)?, f32s(up)?);
        g.iter_mut()
            .zip(&u)
            .for_each(|(g, &u)| *g = swiglu_oai(*g, u, alpha, limit));
        *out = self.tensor(&g, &dims)?;
        Ok(())
    }
    /// `out = a · b`, element by element (LFM2's convolution gates; `a`, `b` and `out` of
    /// one shape). The default is correct but round-trips through host memory.
    fn mul(
        &self,
        a: &Self::Tensor,
        b: &Self::Tensor,
        out: &mut Self::Tensor,
    ) -> Result<(), KitError> {
        let dims = self.dims(a).to_vec();
        if self.dims(b) != dims {
            return Err(KitError::Device(format!(
                "mul: shapes {dims:?} and {:?} differ",
                self.dims(b)
            )));
        }
        let f32s = |t: &Self::Tensor| -> Result<Vec<f32>, KitError> {
            self.download(t, TensorDtype::F32)?
                .to_f32()
                .ok_or_else(|| KitError::Device("mul: an f32 download was not f32".into()))
        };
        let (mut x, y) = (f32s(a)?, f32s(b)?);
        x.iter_mut().zip(&y).for_each(|(x, y)| *x *= y);
        *out = self.tensor(&x, &dims)?;
        Ok(())
    }
    /// `out = sigmoid(gate) · x`, element by element (Qwen3.5's attention output gate;
    /// one shape). The default is correct but round-trips through host memory.
    fn sigmoid_mul(
        &self,
        gate: &Self::Tensor,
        x: &Self::Tensor,
        out: &mut Self::Tensor,
    ) -> Result<(), KitError> {
        let dims = self.dims(x).to_vec();
        if self.dims(gate) != dims {
            return Err(KitError::Device(format!(
                "sigmoid_mul: shapes {:?} and {dims:?} differ",
                self.dims(gate)
            )));
        }
        let f32s = |t: &Self::Tensor| -> Result<Vec<f32>, KitError> {
            self.download(t, TensorDtype::F32)?
                .to_f32()
                .ok_or_else(|| KitError::Device("sigmoid_mul: an f32 download was not f32".into()))
        };
        let (g, mut y) = (f32s(gate)?, f32s(x)?);
        y.iter_mut()
            .zip(&g)
            .for_each(|(y, g)| *y /= 1.0 + (-g).exp());
        *out = self.tensor(&y, &dims)?;
        Ok(())
    }
    /// A mixture of experts' feed-forward: `out[t] = Σ_j w_tj · expert_e(x[t])` over token
    /// `t`'s routes (`e = routes.experts[t·k + j]`, `w_tj` its weight), summed as
    /// [`combine`] sums, an expert being `down(act(gate·x + b_g, up·x + b_u)) + b_d` with
    /// `spec.activation` ([`ModelDevice::gated`]) and its biases where it has them; `groups`
    /// is `routes` grouped by expert; x and out `[T, hidden]`. An implementation reads only
    /// the used experts' weights, each once per call. The default runs each used expert on
    /// its tokens' rows through this trait's ops and combines on the host: correct, but a
    /// download per expert and buffers allocated per call.
    fn experts(
        &self,
        x: &Self::Tensor,
        experts: &[Expert<Self>],
        spec: &Experts,
        routes: &Routes,
        groups: &ExpertGroups,
        out: &mut Self::Tensor,
    ) -> Result<(), KitError>
    where
        Self: Sized,
    {
        let width = spec.width;
        let dims = self.dims(x).to_vec();
        let [t, h] = dims[..] else {
            return Err(KitError::Device(format!(
                "experts: input of shape {dims:?}"
            )));
        };
        check(routes, groups, t, experts.len()).map_err(KitError::Device)?;
        let mut rows = vec![0f32; groups.pairs.len() * h];
        let mut tokens = Vec::new();
        for (e, range) in groups.used() {
            let ex = experts
                .get(e)
                .ok_or_else(|| KitError::Device(format!("experts: no expert {e}")))?;
            tokens.clear();
            tokens.extend(
                groups.pairs[range.clone()]
                    .iter()
                    .map(|&i| i / routes.per_token),
            );
            let n = tokens.len();
            let mut xe = self.zeros(&[n, h])?;
            self.gather_rows(x, &tokens, &mut xe)?;
            let (mut g, mut u, mut m) = (
                self.zeros(&[n, width])?,
                self.zeros(&[n, width])?,
                self.zeros(&[n, width])?,
            );
            self.linears(
                &xe,
                &mut [
                    Projection {
                        w: &ex.gate,
                        bias: ex.gate_bias.as_ref(),
                        out: &mut g,
                    },
                    Projection {
                        w: &ex.up,
                        bias: ex.up_bias.as_ref(),
                        out: &mut u,
                    },
                ],
            )?;
            self.gated(spec.activation, &g, &u, &mut m)?;
            self.linear(&m, &ex.down, ex.down_bias.as_ref(), &mut xe)?;
            let y = self
                .download(&xe, TensorDtype::F32)?
                .to_f32()
                .ok_or_else(|| KitError::Device("experts: an f32 download was not f32".into()))?;
            rows[range.start * h..range.end * h].copy_from_slice(&y);
        }
        let mut sum = vec![0f32; t * h];
        combine(routes, groups, &rows, h, &mut sum);
        *out = self.tensor(&sum, &dims)?;
        Ok(())
    }
    /// `out = act(gate, up)`: the MLP's gated product for `act` (through
    /// [`ModelDevice::silu_mul`], [`ModelDevice::gelu_tanh_mul`] or
    /// [`ModelDevice::swiglu_oai_mul`]).
    fn gated(
        &self,
        act: Activation,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        out: &mut Self::Tensor,
    ) -> Result<(), KitError> {
        match act {
            Activation::Silu => self.silu_mul(gate, up, out),
            Activation::GeluTanh => self.gelu_tanh_mul(gate, up, out),
            Activation::SwigluOai { alpha, limit } => {
                self.swiglu_oai_mul(gate, up, alpha, limit, out)
            }
        }
    }
    /// `out += gated(act, gate, up)·Wᵀ`: an MLP's down projection of its gated product added
    /// to the residual stream. `mlp` (`[T, width]`) and `scratch` (`[T, rows]`) may be left
    /// holding anything (a device may make the product as it reads it: one kernel less). The
    /// default is [`ModelDevice::gated`] into `mlp`, then [`ModelDevice::linear_add`].
    #[allow(clippy::too_many_arguments)]
    fn gated_linear_add(
        &self,
        act: Activation,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        w: &Self::Weight,
        mlp: &mut Self::Tensor,
        scratch: &mut Self::Tensor,
        out: &mut Self::Tensor,
    ) -> Result<(), KitError> {
        self.gated(act, gate, up, mlp)?;
        self.linear_add(mlp, w, None, scratch, out)
    }
    /// `x *= s`.
    fn scale(&self, x: &mut Self::Tensor, s: f32) -> Result<(), KitError>;
    /// `x += y`.
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<(), KitError>;
    /// The index of each row's largest value of `x` (`[R, V]`: logit rows) into `out` (R
    /// ids), picked as [`kvplug_core::argmax()`] picks it (the lowest index on ties, never a
    /// NaN): a greedy step's tokens, read back as R integers instead of R·V floats. `ids`
    /// (`[R]`) is scratch a device may compute them into. The default downloads the rows.
    fn argmax_rows(
        &self,
        x: &Self::Tensor,
        ids: &mut Self::Tensor,
        out: &mut Vec<i32>,
    ) -> Result<(), KitError> {
        let _ = ids;
        let (rows, width) = host_rows(self, x)?;
        out.clear();
        out.extend(rows.chunks_exact(width).map(kvplug_core::argmax));
        Ok(())
    }
    /// Each row's first `k` values of `x` (`[R, V]`: logit rows, `1 <= k <= V`) in
    /// [`kvplug_core::rank`] order (larger first, the lower index on ties, NaNs last), as
    /// [`kvplug_core::top_k`] picks them: their indices into `ids` and values into `values`
    /// (`R·k` each, row by row) — a sampling step's candidates, read back as `8·R·k` bytes
    /// instead of `4·R·V`. `scratch` is the device's to compute them in, kept by the caller
    /// between calls: a device may replace it by a tensor of the shape it needs. The default
    /// downloads the rows.
    fn top_k_rows(
        &self,
        x: &Self::Tensor,
        k: usize,
        scratch: &mut Self::Tensor,
        ids: &mut Vec<i32>,
        values: &mut Vec<f32>,
    ) -> Result<(), KitError> {
        let _ = scratch;
        let (rows, width) = host_rows(self, x)?;
        let (mut row_top, k) = (Vec::with_capacity(width), k.min(width));
        ids.clear();
        values.clear();
        for row in rows.chunks_exact(width) {
            kvplug_core::top_k(row, k, &mut row_top);
            ids.extend(row_top.iter().map(|c| c.0));
            values.extend(row_top.iter().map(|c| c.1));
        }
        Ok(())
    }
    /// `x` (`[R, V]`: logit rows) into `out` (`[R, V]`) with `by[i]` applied to the value
    /// at `at[i]` (`[row, column]`, in range, no two alike) as [`kvplug_core::Adjust`]
    /// computes it: a pick's logit bias and penalties, applied where the logits are. The
    /// default goes through the host.
    fn adjust_rows(
        &self,
        x: &Self::Tensor,
        at: &[[u32; 2]],
        by: &[kvplug_core::Adjust],
        out: &mut Self::Tensor,
    ) -> Result<(), KitError> {
        check_adjust(self.dims(x), at, by)?;
        let (mut rows, width) = host_rows(self, x)?;
        for (&[r, c], a) in at.iter().zip(by) {
            let v = &mut rows[r as usize * width + c as usize];
            *v = a.apply(*v);
        }
        let dims = self.dims(x);
        self.upload_into(&HostTensor::from_f32(dims, &rows), out)
    }
    /// Rows `rows` of `x` (`[T, n]`) into `out` (`[rows.len(), n]`).
    fn gather_rows(
        &self,
        x: &Self::Tensor,
        rows: &[usize],
        out: &mut Self::Tensor,
    ) -> Result<(), KitError>;
}
