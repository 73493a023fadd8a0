//! Helpers shared by the model-level tests: the runtime over this build's plugins, and a
//! plain f64 reference forward.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use kvplug::formats::synth::Preset;
use kvplug::{Batch, Context, Model, PluginSearch, Runtime};
use kvplug_backend_kit::model::ModelPackage;

pub mod hybrids;

/// Backends under test.
pub const BACKENDS: [&str; 3] = ["cpu", "wgpu", "mlx"];

pub fn plugin_dir() -> PathBuf {
    let dir = std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    assert!(
        dir.join("libkvplug_cpu.so").exists(),
        "build the workspace first (cargo build --workspace)"
    );
    dir
}

/// This build's plugins; every backend under test must load and have a device.
pub fn runtime() -> Runtime {
    let rt = Runtime::load(&PluginSearch::only(&[plugin_dir()], false));
    for b in BACKENDS {
        let p = rt
            .plugin(b)
            .unwrap_or_else(|e| panic!("{e}; skipped: {:?}", rt.skipped()));
        let device = &p.description().device;
        assert!(!device.starts_with("unavailable"), "{b}: {device}");
    }
    rt
}

/// The model in directory `dir` on `backend`.
pub fn model(rt: &Runtime, backend: &str, dir: &Path) -> Model {
    rt.model(backend, dir).unwrap()
}

/// Every row's logits of `tokens` at `positions` on sequence 0 of `ctx`.
pub fn forward(ctx: &mut Context, tokens: &[i32], positions: &[i32]) -> Vec<Vec<f32>> {
    forward_seq(ctx, 0, tokens, positions)
}

/// Every row's logits of `tokens` at `positions` on sequence `seq` of `ctx`.
pub fn forward_seq(
    ctx: &mut Context,
    seq: i32,
    tokens: &[i32],
    positions: &[i32],
) -> Vec<Vec<f32>> {
    let mut b = Batch::new();
    for (&t, &p) in tokens.iter().zip(positions) {
        b.push(t, p, seq, true);
    }
    ctx.decode(&b)
        .unwrap()
        .rows()
        .map(<[f32]>::to_vec)
        .collect()
}

/// The largest |got − want| over every logit of every position (NaN where one is NaN).
pub fn max_logit_error(got: &[Vec<f32>], want: &[Vec<f64>]) -> f64 {
    got.iter()
        .flatten()
        .zip(want.iter().flatten())
        .map(|(a, b)| (f64::from(*a) - b).abs())
        .fold(0.0, nan_max)
}

/// The larger of `m` and `d`, NaN where either is: a fold of errors with it fails any `<`
/// bound on a NaN output (`f64::max` would skip the NaN).
pub fn nan_max(m: f64, d: f64) -> f64 {
    if d > m || d.is_nan() {
        d
    } else {
        m
    }
}

/// Plain f64 Llama-family forward (Llama, Qwen2's biases, Qwen3's q/k norms) over the whole
/// sequence (causal attention, no cache): logits of every position.
pub fn reference_logits(model: &Path, tokens: &[i32]) -> Vec<Vec<f64>> {
    reference_logits_with(model, tokens, &Reference::default())
}

/// [`reference_logits`] with the cpu backend's declared arithmetic for weights in ggml block
/// formats when `int8_block_acts` (see [`Reference::int8_block_acts`]).
pub fn reference_logits_as(model: &Path, tokens: &[i32], int8_block_acts: bool) -> Vec<Vec<f64>> {
    let r = Reference {
        int8_block_acts,
        ..Reference::default()
    };
    reference_logits_with(model, tokens, &r)
}

/// What the reference forward is told rather than reads from the package.
#[derive(Clone, Debug, Default)]
pub struct Reference {
    /// Each input row of a linear over a block-format weight is quantized in blocks of 32 to
    /// `d·round(x/d)`, `d = max|x|/127`, before the f64 products (the cpu's arithmetic).
    pub int8_block_acts: bool,
    /// The rotary inverse frequencies of each head's pairs (default `θ^(−2i/head_dim)` with
    /// the config's `rope_theta`): a test of scaled RoPE computes them itself.
    pub inv_freq: Option<Vec<f64>>,
    /// Every layer attends through a sliding window `W`: a query at `p` sees keys at `q` with
    /// `p − W < q ≤ p`.
    pub window: Option<usize>,
    /// Each head's q and k, after RoPE, multiplied by `H_n/√n` per `n`-wide piece (`n` the
    /// largest power of two dividing head_dim, `H` Sylvester's: entry `(i, j)` is
    /// `(−1)^popcount(i & j)`), as a context with [`kvplug::KeyBasis::Hadamard`] keys does.
    pub rotate_keys: bool,
    /// K and V rows stored in this quantized dtype (rounded through core's affine
    /// quantization) before attention reads them.
    pub kv_quant: Option<kvplug::KvDtype>,
    /// Rotated q and k multiplied by this (YaRN's magnitude factor).
    pub rope_magnitude: Option<f64>,
    /// Each sliding layer attends through the window its config states (GPT-OSS's
    /// alternating layers); other layers as `window` says.
    pub config_windows: bool,
}

/// `x` with each `n`-wide piece multiplied by `H_n/√n`, from the matrix's definition.
fn hadamard_f64(x: &[f64], n: usize) -> Vec<f64> {
    x.chunks(n)
        .flat_map(|piece| {
            (0..n).map(move |i| {
                piece
                    .iter()
                    .enumerate()
                    .map(|(j, v)| {
                        if (i & j).count_ones() % 2 == 0 {
                            *v
                        } else {
                            -v
                        }
                    })
                    .sum::<f64>()
                    / (n as f64).sqrt()
            })
        })
        .collect()
}

/// Llama 3's RoPE scaling of `θ^(−2i/head_dim)` as Hugging Face's
/// `_compute_llama3_parameters` writes it: wavelengths shorter than
/// `original / high_freq_factor` keep their frequency, longer than `original /
/// low_freq_factor` are divided by `factor`, and those between are blended.
pub fn llama3_inv_freq(
    theta: f64,
    head_dim: usize,
    factor: f64,
    low_freq_factor: f64,
    high_freq_factor: f64,
    original: f64,
) -> Vec<f64> {
    (0..head_dim / 2)
        .map(|i| {
            let f = theta.powf(-(2.0 * i as f64) / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < original / high_freq_factor {
                f
            } else if wavelen > original / low_freq_factor {
                f / factor
            } else {
                let smooth =
                    (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                (1.0 - smooth) * f / factor + smooth * f
            }
        })
        .collect()
}

/// YaRN's frequencies as the YaRN paper and llama.cpp's `rope_yarn` define them, written out
/// here: pair `i` of a `d`-wide head turns `r_i = L·θ^(−2i/d)/(2π)` times over the original
/// context `L`; pairs with `r_i > 32` (β_fast) keep `θ^(−2i/d)`, those with `r_i < 1`
/// (β_slow) divide it by `factor`, a linear ramp in `i` between (the ramp's ends rounded
/// out to whole pairs).
pub fn yarn_inv_freq(theta: f64, d: usize, factor: f64, original: f64) -> Vec<f64> {
    let pair_at = |rotations: f64| {
        d as f64 * (original / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
    };
    let (low, high) = (
        pair_at(32.0).floor().max(0.0),
        pair_at(1.0).ceil().min(d as f64 - 1.0),
    );
    (0..d / 2)
        .map(|i| {
            let f = theta.powf(-(2.0 * i as f64) / d as f64);
            let ramp = ((i as f64 - low) / (high - low).max(0.001)).clamp(0.0, 1.0);
            f * (1.0 - ramp) + f / factor * ramp
        })
        .collect()
}

/// Deterministic values in `[-gain, gain)` (a multiplicative hash of the index and salt).
pub fn values(n: usize, salt: u64, gain: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let h = (i ^ salt.wrapping_mul(0x9e37_79b9)).wrapping_mul(0x2545_f491_4f6c_dd1d);
            ((h >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * gain
        })
        .collect()
}

/// The largest logit error of `backend` against the reference forward told `told` (and,
/// on the cpu, its int8 arithmetic for block-format linears): `prompt` decoded in one step
/// (prefill), then 6 greedy tokens one at a time, on a contiguous f32 cache.
pub fn greedy_logit_error(model: &Path, backend: &str, prompt: &[i32], told: Reference) -> f64 {
    let rt = runtime();
    let mut ctx = self::model(&rt, backend, model)
        .context(kvplug::CacheKind::Contiguous, 64, kvplug::KvDtype::F32)
        .unwrap();
    let positions: Vec<i32> = (0..prompt.len() as i32).collect();
    let mut got = forward(&mut ctx, prompt, &positions);
    let mut tokens = prompt.to_vec();
    for _ in 0..6 {
        let next = kvplug::argmax(got.last().unwrap());
        tokens.push(next);
        got.extend(forward(&mut ctx, &[next], &[tokens.len() as i32 - 1]));
    }
    let told = Reference {
        int8_block_acts: backend == "cpu",
        ..told
    };
    max_logit_error(&got, &reference_logits_with(model, &tokens, &told))
}

/// The reference forward, as `r` says.
pub fn reference_logits_with(model: &Path, tokens: &[i32], r: &Reference) -> Vec<Vec<f64>> {
    let pkg = ModelPackage::open(model).unwrap();
    let c = pkg.config.clone();
    let (h, hd, hq, hkv, im, v) = (
        c.hidden_size,
        c.head_dim(),
        c.num_attention_heads,
        c.kv_heads(),
        c.intermediate_size,
        c.vocab_size,
    );
    let w = |name: &str, shape: &[usize]| -> Vec<f64> {
        pkg.tensor_f32(name, shape)
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect()
    };
    let eps = c.rms_norm_eps;
    let norm = |x: &[f64], g: &[f64]| -> Vec<f64> {
        let rms = (x.iter().map(|a| a * a).sum::<f64>() / x.len() as f64 + eps).sqrt();
        x.iter().zip(g).map(|(a, b)| a / rms * b).collect()
    };
    let blocks = |name: &str, shape: &[usize]| {
        r.int8_block_acts
            && matches!(
                pkg.tensor(name, shape).unwrap().dtype(),
                kvplug_backend_kit::model::StoredDtype::Block(_)
            )
    };
    let act_quant = |x: &[f64]| -> Vec<f64> {
        x.chunks(32)
            .flat_map(|b| {
                let d = b.iter().fold(0.0f64, |m, v| m.max(v.abs())) / 127.0;
                b.iter()
                    .map(move |v| if d == 0.0 { 0.0 } else { (v / d).round() * d })
            })
            .collect()
    };
    let matvec_as = |quant: bool, m: &[f64], rows: usize, x: &[f64]| -> Vec<f64> {
        let xq;
        let x = if quant {
            xq = act_quant(x);
            &xq[..]
        } else {
            x
        };
        (0..rows)
            .map(|r| {
                m[r * x.len()..(r + 1) * x.len()]
                    .iter()
                    .zip(x)
                    .map(|(a, b)| a * b)
                    .sum()
            })
            .collect()
    };
    let matvec = |m: &(Vec<f64>, bool), rows: usize, x: &[f64]| matvec_as(m.1, &m.0, rows, x);
    // A matrix and whether its linear quantizes its input.
    let mat = |name: &str, shape: &[usize]| (w(name, shape), blocks(name, shape));
    // Granite 4.0-H's `nope`: no positional encoding (no pair turns).
    let nope = c.position_embedding_type.as_deref() == Some("nope");
    let inv_freq: Vec<f64> = r.inv_freq.clone().unwrap_or_else(|| {
        (0..hd / 2)
            .map(|i| match nope {
                true => 0.0,
                false => c.rope_theta.powf(-(2.0 * i as f64) / hd as f64),
            })
            .collect()
    });
    assert_eq!(inv_freq.len(), hd / 2, "one frequency per rotary pair");
    // Pair i of each head: (i, i + hd/2), or (2i, 2i + 1) where the package stores q/k rows
    // as llama.cpp's converter permutes them.
    let interleaved = pkg.rope_pairs() == kvplug_core::RopePairs::Interleaved;
    let rope = |x: &mut [f64], pos: usize| {
        for head in x.chunks_mut(hd) {
            for (i, f) in inv_freq.iter().enumerate() {
                let (s, co) = (pos as f64 * f).sin_cos();
                let (i1, i2) = if interleaved {
                    (2 * i, 2 * i + 1)
                } else {
                    (i, i + hd / 2)
                };
                let (a, b) = (head[i1], head[i2]);
                head[i1] = a * co - b * s;
                head[i2] = b * co + a * s;
            }
        }
    };
    let embed = w("model.embed_tokens.weight", &[v, h]);
    let mut xs: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| embed[t as usize * h..(t as usize + 1) * h].to_vec())
        .collect();
    // Granite's multipliers: on the embeddings, each block's output, the attention scale
    // (in place of 1/√hd) and the logits (divided).
    let embedding = c.embedding_multiplier.unwrap_or(1.0);
    xs.iter_mut().flatten().for_each(|x| *x *= embedding);
    let residual = c.residual_multiplier.unwrap_or(1.0);
    let n = tokens.len();
    // LFM2 names its norms, MLP and attention output its own way.
    let lfm2 = c.model_type == "lfm2";
    let name = |llama: &'static str, lfm2_name: &'static str| if lfm2 { lfm2_name } else { llama };
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}.");
        let ln1 = w(
            &format!("{p}{}.weight", name("input_layernorm", "operator_norm")),
            &[h],
        );
        let ln2 = w(
            &format!("{p}{}.weight", name("post_attention_layernorm", "ffn_norm")),
            &[h],
        );
        // A sparse layer's experts (`[experts, rows, cols]` each) and router, or the MLP.
        let sparse = c.experts().filter(|_| c.sparse_layer(l));
        let (ew, en) = sparse.map_or((im, 1), |e| (e.width, e.count));
        let (wg, wu, wd) = if sparse.is_some() {
            let e =
                |n: &str, rows, cols| mat(&format!("{p}mlp.experts.{n}.weight"), &[en, rows, cols]);
            (
                e("gate_proj", ew, h),
                e("up_proj", ew, h),
                e("down_proj", h, ew),
            )
        } else {
            (
                mat(
                    &format!("{p}{}.weight", name("mlp.gate_proj", "feed_forward.w1")),
                    &[im, h],
                ),
                mat(
                    &format!("{p}{}.weight", name("mlp.up_proj", "feed_forward.w3")),
                    &[im, h],
                ),
                mat(
                    &format!("{p}{}.weight", name("mlp.down_proj", "feed_forward.w2")),
                    &[h, im],
                ),
            )
        };
        let router = sparse.map(|e| mat(&format!("{p}mlp.gate.weight"), &[e.count, h]));
        // GPT-OSS: biases on the router and the experts (`[experts, rows]`), its clamped
        // SwiGLU and its gating (a softmax over the top-k logits).
        let gpt_oss = c.model_type == "gpt_oss";
        let stacked_bias = |n: &str, rows: usize| {
            let name = format!("{p}mlp.experts.{n}.bias");
            pkg.has_tensor(&name).then(|| w(&name, &[en, rows]))
        };
        let (bg, bu, bd) = (
            stacked_bias("gate_proj", ew),
            stacked_bias("up_proj", ew),
            stacked_bias("down_proj", h),
        );
        let router_bias = {
            let name = format!("{p}mlp.gate.bias");
            pkg.has_tensor(&name).then(|| w(&name, &[en]))
        };
        // Expert `e`'s gated MLP (expert 0 of a dense layer: its MLP).
        let expert = |e: usize, hn: &[f64]| -> Vec<f64> {
            let part = |m: &(Vec<f64>, bool), b: &Option<Vec<f64>>, rows, cols, x: &[f64]| {
                let mut y = matvec_as(m.1, &m.0[e * rows * cols..(e + 1) * rows * cols], rows, x);
                if let Some(b) = b {
                    y.iter_mut()
                        .zip(&b[e * rows..(e + 1) * rows])
                        .for_each(|(y, b)| *y += b);
                }
                y
            };
            let (g, u) = (part(&wg, &bg, ew, h, hn), part(&wu, &bu, ew, h, hn));
            let m: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(&g, &u)| {
                    if gpt_oss {
                        let (g, u) = (g.min(7.0), u.clamp(-7.0, 7.0));
                        g / (1.0 + (-1.702 * g).exp()) * (u + 1.0)
                    } else {
                        g / (1.0 + (-g).exp()) * u
                    }
                })
                .collect();
            part(&wd, &bd, h, ew, &m)
        };
        let mlp = |x: &mut Vec<f64>| {
            let hn = norm(x, &ln2);
            let d = match (sparse, &router) {
                (Some(e), Some(router)) => {
                    // Softmax over every expert; the per_token most probable (ties to the
                    // lower index), weighted by probability, renormalized when asked.
                    let mut z = matvec(router, e.count, &hn);
                    if let Some(b) = &router_bias {
                        z.iter_mut().zip(b).for_each(|(z, b)| *z += b);
                    }
                    let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let mut order: Vec<usize> = (0..e.count).collect();
                    order.sort_by(|&a, &b| z[b].total_cmp(&z[a]).then(a.cmp(&b)));
                    order.truncate(e.per_token);
                    // GPT-OSS softmaxes the chosen logits alone (`total` over them).
                    let among: &[usize] = if gpt_oss { &order } else { &[] };
                    let total: f64 = match among {
                        [] => z.iter().map(|z| (z - max).exp()).sum(),
                        chosen => chosen.iter().map(|&i| (z[i] - max).exp()).sum(),
                    };
                    let p: Vec<f64> = order.iter().map(|&i| (z[i] - max).exp() / total).collect();
                    let sum: f64 = if e.renormalize { p.iter().sum() } else { 1.0 };
                    let mut d = vec![0.0; h];
                    for (&i, p) in order.iter().zip(&p) {
                        let y = expert(i, &hn);
                        d.iter_mut().zip(&y).for_each(|(d, y)| *d += p / sum * y);
                    }
                    d
                }
                _ => expert(0, &hn),
            };
            x.iter_mut().zip(&d).for_each(|(a, b)| *a += residual * b);
        };
        if let kvplug_core::LayerAttention::Conv { width, .. } = c.attention[l] {
            // LFM2's gated short convolution: B, C, x = in_proj·hn; y = C·conv(B·x), the
            // convolution over this and the previous width − 1 tokens (zeros before the
            // first); out_proj·y.
            let inp = mat(&format!("{p}conv.in_proj.weight"), &[3 * h, h]);
            let kernel = w(&format!("{p}conv.conv.weight"), &[h, width]);
            let outp = mat(&format!("{p}conv.out_proj.weight"), &[h, h]);
            let mut bx: Vec<Vec<f64>> = Vec::new();
            let mut gates: Vec<Vec<f64>> = Vec::new();
            for x in &xs {
                let bcx = matvec(&inp, 3 * h, &norm(x, &ln1));
                bx.push((0..h).map(|i| bcx[i] * bcx[2 * h + i]).collect());
                gates.push(bcx[h..2 * h].to_vec());
            }
            for t in 0..n {
                let y: Vec<f64> = (0..h)
                    .map(|ch| {
                        let conv: f64 = (0..width)
                            .filter_map(|j| {
                                let at = (t + j).checked_sub(width - 1)?;
                                Some(kernel[ch * width + j] * bx[at][ch])
                            })
                            .sum();
                        gates[t][ch] * conv
                    })
                    .collect();
                let o = matvec(&outp, h, &y);
                xs[t].iter_mut().zip(&o).for_each(|(a, b)| *a += b);
                mlp(&mut xs[t]);
            }
            continue;
        }
        if let kvplug_core::LayerAttention::Delta {
            width,
            key_heads: hk,
            value_heads: hv,
            head_dim: dn,
        } = c.attention[l]
        {
            // Qwen3.5's gated delta rule: qkv = conv(in_proj_qkv·hn) through SiLU, split
            // into q, k (hk heads) and v (hv heads); per value head (key head h mod hk) the
            // f64 recurrence with g = a·softplus(in_proj_a·hn + dt_bias) and
            // β = sigmoid(in_proj_b·hn); then RMSNorm per head times SiLU(in_proj_z·hn),
            // out_proj.
            let a = format!("{p}linear_attn.");
            let ch = (2 * hk + hv) * dn;
            let wqkv = mat(&format!("{a}in_proj_qkv.weight"), &[ch, h]);
            let wz = mat(&format!("{a}in_proj_z.weight"), &[hv * dn, h]);
            let wb = mat(&format!("{a}in_proj_b.weight"), &[hv, h]);
            let wa = mat(&format!("{a}in_proj_a.weight"), &[hv, h]);
            let dt = w(&format!("{a}dt_bias"), &[hv]);
            let decay = w(&format!("{a}a"), &[hv]);
            let kernel = w(&format!("{a}conv1d.weight"), &[ch, width]);
            let gnorm = w(&format!("{a}norm.weight"), &[dn]);
            let outp = mat(&format!("{a}out_proj.weight"), &[h, hv * dn]);
            let silu = |x: f64| x / (1.0 + (-x).exp());
            let hns: Vec<Vec<f64>> = xs.iter().map(|x| norm(x, &ln1)).collect();
            let mixed: Vec<Vec<f64>> = hns.iter().map(|hn| matvec(&wqkv, ch, hn)).collect();
            let mut states = vec![vec![0.0; dn * dn]; hv];
            for t in 0..n {
                let hn = &hns[t];
                let act: Vec<f64> = (0..ch)
                    .map(|c| {
                        silu(
                            (0..width)
                                .filter_map(|j| {
                                    let at = (t + j).checked_sub(width - 1)?;
                                    Some(kernel[c * width + j] * mixed[at][c])
                                })
                                .sum(),
                        )
                    })
                    .collect();
                let (z, b, al) = (
                    matvec(&wz, hv * dn, hn),
                    matvec(&wb, hv, hn),
                    matvec(&wa, hv, hn),
                );
                let mut y = Vec::with_capacity(hv * dn);
                for (head, s) in states.iter_mut().enumerate() {
                    let kh = head % hk;
                    let q = &act[kh * dn..(kh + 1) * dn];
                    let k = &act[(hk + kh) * dn..(hk + kh + 1) * dn];
                    let v = &act[(2 * hk + head) * dn..(2 * hk + head + 1) * dn];
                    let g = decay[head] * (al[head] + dt[head]).exp().ln_1p();
                    let beta = 1.0 / (1.0 + (-b[head]).exp());
                    let o = kvplug_core::oracle::gated_delta_step(s, q, k, v, g, beta);
                    let o = norm(&o, &gnorm);
                    y.extend(
                        o.iter()
                            .zip(&z[head * dn..(head + 1) * dn])
                            .map(|(o, z)| o * silu(*z)),
                    );
                }
                let o = matvec(&outp, h, &y);
                xs[t].iter_mut().zip(&o).for_each(|(a, b)| *a += b);
                mlp(&mut xs[t]);
            }
            continue;
        }
        if let kvplug_core::LayerAttention::Ssm {
            width,
            heads,
            head_dim: hp,
            groups,
            state,
        } = c.attention[l]
        {
            // Granite 4.0-H's Mamba2 block: z, xBC, dt = in_proj·hn; xBC through the
            // convolution (zeros before the first token) plus its bias and SiLU, split into x
            // (heads of hp), B and C (groups of state); per head (group head / (heads /
            // groups)) the f64 scan with dt + dt_bias; then y·SiLU(z), RMSNorm per group,
            // out_proj.
            let m = format!("{p}mamba.");
            let (inner, gw) = (heads * hp, heads * hp / groups);
            let ch = inner + 2 * groups * state;
            let win = mat(&format!("{m}in_proj.weight"), &[inner + ch + heads, h]);
            let kernel = w(&format!("{m}conv1d.weight"), &[ch, width]);
            let bias_name = format!("{m}conv1d.bias");
            let cb = match pkg.has_tensor(&bias_name) {
                true => w(&bias_name, &[ch]),
                false => vec![0.0; ch],
            };
            let dt_bias = w(&format!("{m}dt_bias"), &[heads]);
            let a = w(&format!("{m}a"), &[heads, 1]);
            let skip = w(&format!("{m}D"), &[heads, 1]);
            let gnorm = w(&format!("{m}norm.weight"), &[groups, gw]);
            let outp = mat(&format!("{m}out_proj.weight"), &[h, inner]);
            let silu = |x: f64| x / (1.0 + (-x).exp());
            let proj: Vec<Vec<f64>> = xs
                .iter()
                .map(|x| matvec(&win, inner + ch + heads, &norm(x, &ln1)))
                .collect();
            let mut states = vec![vec![0.0; hp * state]; heads];
            for t in 0..n {
                let act: Vec<f64> = (0..ch)
                    .map(|c| {
                        let conv: f64 = (0..width)
                            .filter_map(|j| {
                                let at = (t + j).checked_sub(width - 1)?;
                                Some(kernel[c * width + j] * proj[at][inner + c])
                            })
                            .sum();
                        silu(conv + cb[c])
                    })
                    .collect();
                let mut y = Vec::with_capacity(inner);
                for (head, s) in states.iter_mut().enumerate() {
                    let g = head / (heads / groups);
                    let x = &act[head * hp..(head + 1) * hp];
                    let b = &act[inner + g * state..inner + (g + 1) * state];
                    let cc = &act[inner + (groups + g) * state..inner + (groups + g + 1) * state];
                    let dt = proj[t][inner + ch + head] + dt_bias[head];
                    y.extend(kvplug_core::oracle::mamba2_step(
                        s, x, b, cc, dt, a[head], skip[head],
                    ));
                }
                y.iter_mut()
                    .zip(&proj[t][..inner])
                    .for_each(|(y, z)| *y *= silu(*z));
                let y: Vec<f64> = y
                    .chunks(gw)
                    .zip(gnorm.chunks(gw))
                    .flat_map(|(y, g)| norm(y, g))
                    .collect();
                let o = matvec(&outp, h, &y);
                xs[t]
                    .iter_mut()
                    .zip(&o)
                    .for_each(|(a, b)| *a += residual * b);
                mlp(&mut xs[t]);
            }
            continue;
        }
        if c.model_type == "qwen3_5_text" {
            qwen35_attention(&pkg, &c, l, &mut xs, &ln1, &norm, &mat, &matvec, &mlp);
            continue;
        }
        let (wq, wk, wv) = (
            mat(&format!("{p}self_attn.q_proj.weight"), &[hq * hd, h]),
            mat(&format!("{p}self_attn.k_proj.weight"), &[hkv * hd, h]),
            mat(&format!("{p}self_attn.v_proj.weight"), &[hkv * hd, h]),
        );
        let wo = mat(
            &format!("{p}self_attn.{}.weight", name("o_proj", "out_proj")),
            &[h, hq * hd],
        );
        // Qwen2's q/k/v biases and Qwen3's per-head q/k norms, where the package has them.
        let optional = |name: String, n: usize| pkg.has_tensor(&name).then(|| w(&name, &[n]));
        let bias = |v: &mut Vec<f64>, b: &Option<Vec<f64>>| {
            if let Some(b) = b {
                v.iter_mut().zip(b).for_each(|(x, b)| *x += b);
            }
        };
        let head_norm = |v: &mut Vec<f64>, g: &Option<Vec<f64>>| {
            if let Some(g) = g {
                *v = v.chunks(hd).flat_map(|head| norm(head, g)).collect();
            }
        };
        let (bq, bk, bv) = (
            optional(format!("{p}self_attn.q_proj.bias"), hq * hd),
            optional(format!("{p}self_attn.k_proj.bias"), hkv * hd),
            optional(format!("{p}self_attn.v_proj.bias"), hkv * hd),
        );
        // GPT-OSS: the output's bias, a sink per head, this layer's own window.
        let bo = optional(format!("{p}self_attn.o_proj.bias"), h);
        let sinks = optional(format!("{p}self_attn.sinks"), hq);
        let window = match (r.config_windows, c.attention[l]) {
            (true, kvplug_core::LayerAttention::Sliding { window }) => Some(window),
            _ => r.window,
        };
        let (nq, nk) = (
            optional(
                format!("{p}self_attn.{}.weight", name("q_norm", "q_layernorm")),
                hd,
            ),
            optional(
                format!("{p}self_attn.{}.weight", name("k_norm", "k_layernorm")),
                hd,
            ),
        );
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (t, x) in xs.iter().enumerate() {
            let hn = norm(x, &ln1);
            let (mut q, mut k) = (matvec(&wq, hq * hd, &hn), matvec(&wk, hkv * hd, &hn));
            let mut v = matvec(&wv, hkv * hd, &hn);
            bias(&mut q, &bq);
            bias(&mut k, &bk);
            bias(&mut v, &bv);
            head_norm(&mut q, &nq);
            head_norm(&mut k, &nk);
            rope(&mut q, t);
            rope(&mut k, t);
            if let Some(m) = r.rope_magnitude {
                q.iter_mut().chain(k.iter_mut()).for_each(|x| *x *= m);
            }
            if let Some(m) = c.attention_multiplier {
                q.iter_mut().for_each(|x| *x *= m * (hd as f64).sqrt());
            }
            if r.rotate_keys {
                let n = 1 << hd.trailing_zeros();
                (q, k) = (hadamard_f64(&q, n), hadamard_f64(&k, n));
            }
            if let Some((bits, group)) = r.kv_quant.and_then(kvplug::KvDtype::quant) {
                let store = |x: &[f64]| -> Vec<f64> {
                    x.chunks(hd)
                        .flat_map(|row| kvplug_core::quant::quant_round_trip(row, bits, group))
                        .collect()
                };
                (k, v) = (store(&k), store(&v));
            }
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for (t, x) in xs.iter_mut().enumerate() {
            let att = causal_attention(&qs, &ks, &vs, t, (hq, hkv, hd), window, sinks.as_deref());
            let mut o = matvec(&wo, h, &att);
            bias(&mut o, &bo);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += residual * b);
            mlp(x);
        }
    }
    let fnorm = w(
        name("model.norm.weight", "model.embedding_norm.weight"),
        &[h],
    );
    let head = if c.tie_word_embeddings {
        mat("model.embed_tokens.weight", &[v, h])
    } else {
        mat("lm_head.weight", &[v, h])
    };
    let divisor = c.logits_scaling.unwrap_or(1.0);
    xs.iter()
        .map(|x| {
            let logits = matvec(&head, v, &norm(x, &fnorm));
            logits.into_iter().map(|z| z / divisor).collect()
        })
        .collect()
}

/// Token `t`'s attention output (`[hq · hd]`) over the rows of tokens `..=t` (the last
/// `window` of them when given): per query head, softmax of `q·k / √hd` over its KV head
/// `head / (hq / hkv)`, times v.
fn causal_attention(
    qs: &[Vec<f64>],
    ks: &[Vec<f64>],
    vs: &[Vec<f64>],
    t: usize,
    (hq, hkv, hd): (usize, usize, usize),
    window: Option<usize>,
    sinks: Option<&[f64]>,
) -> Vec<f64> {
    let mut att = vec![0.0; hq * hd];
    for head in 0..hq {
        let kh = head / (hq / hkv);
        let q = &qs[t][head * hd..(head + 1) * hd];
        let first = window.map_or(0, |w| (t + 1).saturating_sub(w));
        let scores: Vec<f64> = (first..=t)
            .map(|j| {
                q.iter()
                    .zip(&ks[j][kh * hd..(kh + 1) * hd])
                    .map(|(a, b)| a * b)
                    .sum::<f64>()
                    / (hd as f64).sqrt()
            })
            .collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        // A sink is one more score (unscaled) whose value is zero.
        let sink = sinks.map_or(0.0, |s| (s[head] - max).exp());
        let z: f64 = e.iter().sum::<f64>() + sink;
        for (j, ej) in (first..=t).zip(&e) {
            for d in 0..hd {
                att[head * hd + d] += ej / z * vs[j][kh * hd + d];
            }
        }
    }
    att
}

/// A matrix and whether its linear quantizes its input (see `reference_logits_with`).
type RefMatrix = (Vec<f64>, bool);
/// RMSNorm of a row by a weight.
type RefNorm<'a> = &'a dyn Fn(&[f64], &[f64]) -> Vec<f64>;
/// A matrix (rows) times a vector.
type RefMatvec<'a> = &'a dyn Fn(&RefMatrix, usize, &[f64]) -> Vec<f64>;

/// Qwen3.5's gated attention layer `l` over every token of `xs`, with its MLP: q and its
/// output gate interleaved per head in `q_proj`, per-head q/k RMSNorms, rotary on the first
/// `partial_rotary_factor` of each head (pairs `(i, i + rot/2)`, frequencies
/// `θ^(−2i/rot)`; under interleaved MRoPE on text, pairs of the fourth section do not
/// turn), causal attention, the output times `sigmoid(gate)`.
#[allow(clippy::too_many_arguments)]
fn qwen35_attention(
    pkg: &ModelPackage,
    c: &kvplug_backend_kit::model::ModelConfig,
    l: usize,
    xs: &mut [Vec<f64>],
    ln1: &[f64],
    norm: RefNorm,
    mat: &dyn Fn(&str, &[usize]) -> RefMatrix,
    matvec: RefMatvec,
    mlp: &dyn Fn(&mut Vec<f64>),
) {
    let (h, hd, hq, hkv) = (
        c.hidden_size,
        c.head_dim(),
        c.num_attention_heads,
        c.kv_heads(),
    );
    let p = format!("model.layers.{l}.self_attn.");
    let vecw = |name: &str| -> Vec<f64> {
        pkg.tensor_f32(name, &[hd])
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect()
    };
    let (wq, wk, wv, wo) = (
        mat(&format!("{p}q_proj.weight"), &[2 * hq * hd, h]),
        mat(&format!("{p}k_proj.weight"), &[hkv * hd, h]),
        mat(&format!("{p}v_proj.weight"), &[hkv * hd, h]),
        mat(&format!("{p}o_proj.weight"), &[h, hq * hd]),
    );
    let (nq, nk) = (
        vecw(&format!("{p}q_norm.weight")),
        vecw(&format!("{p}k_norm.weight")),
    );
    let rot = (c.partial_rotary_factor.unwrap_or(1.0) * hd as f64) as usize;
    let sections = c.mrope_section.clone();
    let turns = |i: usize| match &sections {
        None => true,
        Some(s) => {
            let sector = i % s.iter().sum::<usize>();
            sector < 3 * s.get(sector % 3).copied().unwrap_or(0)
        }
    };
    let rope = |x: &mut [f64], pos: usize| {
        for head in x.chunks_mut(hd) {
            for i in (0..rot / 2).filter(|&i| turns(i)) {
                let f = c.rope_theta.powf(-(2.0 * i as f64) / rot as f64);
                let (s, co) = (pos as f64 * f).sin_cos();
                let (a, b) = (head[i], head[i + rot / 2]);
                head[i] = a * co - b * s;
                head[i + rot / 2] = b * co + a * s;
            }
        }
    };
    let (mut qs, mut gates, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (t, x) in xs.iter().enumerate() {
        let hn = norm(x, ln1);
        let qg = matvec(&wq, 2 * hq * hd, &hn);
        let mut q: Vec<f64> = qg
            .chunks(2 * hd)
            .flat_map(|c| norm(&c[..hd], &nq))
            .collect();
        gates.push(
            qg.chunks(2 * hd)
                .flat_map(|c| c[hd..].to_vec())
                .collect::<Vec<_>>(),
        );
        let mut k: Vec<f64> = matvec(&wk, hkv * hd, &hn)
            .chunks(hd)
            .flat_map(|c| norm(c, &nk))
            .collect();
        rope(&mut q, t);
        rope(&mut k, t);
        qs.push(q);
        ks.push(k);
        vs.push(matvec(&wv, hkv * hd, &hn));
    }
    for (t, x) in xs.iter_mut().enumerate() {
        let mut att = causal_attention(&qs, &ks, &vs, t, (hq, hkv, hd), None, None);
        att.iter_mut()
            .zip(&gates[t])
            .for_each(|(a, g)| *a /= 1.0 + (-g).exp());
        let o = matvec(&wo, h, &att);
        x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        mlp(x);
    }
}

/// The Hugging Face weight names and shapes of a Llama model of shape `p` (untied).
pub fn hf_tensor_shapes(p: &Preset) -> Vec<(String, Vec<usize>)> {
    let hd = p.hidden / p.heads;
    let mut v = vec![
        (
            "model.embed_tokens.weight".to_string(),
            vec![p.vocab, p.hidden],
        ),
        ("model.norm.weight".into(), vec![p.hidden]),
        ("lm_head.weight".into(), vec![p.vocab, p.hidden]),
    ];
    for l in 0..p.layers {
        let pre = format!("model.layers.{l}.");
        for (name, shape) in [
            ("input_layernorm", vec![p.hidden]),
            ("post_attention_layernorm", vec![p.hidden]),
            ("self_attn.q_proj", vec![p.heads * hd, p.hidden]),
            ("self_attn.k_proj", vec![p.kv_heads * hd, p.hidden]),
            ("self_attn.v_proj", vec![p.kv_heads * hd, p.hidden]),
            ("self_attn.o_proj", vec![p.hidden, p.heads * hd]),
            ("mlp.gate_proj", vec![p.intermediate, p.hidden]),
            ("mlp.up_proj", vec![p.intermediate, p.hidden]),
            ("mlp.down_proj", vec![p.hidden, p.intermediate]),
        ] {
            v.push((format!("{pre}{name}.weight"), shape));
        }
    }
    v
}

/// The GGUF tensor behind a Hugging Face weight name (llama.cpp's naming).
pub fn gguf_name(hf: &str) -> String {
    if let Some(rest) = hf.strip_prefix("model.layers.") {
        let (l, name) = rest.split_once('.').unwrap();
        let g = match name {
            "input_layernorm.weight" => "attn_norm",
            "post_attention_layernorm.weight" => "ffn_norm",
            "self_attn.q_proj.weight" => "attn_q",
            "self_attn.k_proj.weight" => "attn_k",
            "self_attn.v_proj.weight" => "attn_v",
            "self_attn.o_proj.weight" => "attn_output",
            "mlp.gate_proj.weight" => "ffn_gate",
            "mlp.up_proj.weight" => "ffn_up",
            "mlp.down_proj.weight" => "ffn_down",
            other => panic!("{other}"),
        };
        return format!("blk.{l}.{g}.weight");
    }
    match hf {
        "model.embed_tokens.weight" => "token_embd.weight",
        "model.norm.weight" => "output_norm.weight",
        "lm_head.weight" => "output.weight",
        other => panic!("{other}"),
    }
    .into()
}

/// The architecture metadata of a Llama GGUF of shape `p` (tokenizer entries are the
/// caller's).
pub fn llama_gguf_meta(p: &Preset, eps: f32, theta: f32) -> Vec<(&'static str, Value)> {
    let u = |x: usize| Value::U32(x as u32);
    vec![
        ("general.architecture", Value::String("llama".into())),
        ("llama.block_count", u(p.layers)),
        ("llama.embedding_length", u(p.hidden)),
        ("llama.feed_forward_length", u(p.intermediate)),
        ("llama.attention.head_count", u(p.heads)),
        ("llama.attention.head_count_kv", u(p.kv_heads)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(eps)),
        ("llama.rope.freq_base", Value::F32(theta)),
        ("llama.context_length", u(2048)),
    ]
}

/// Writes a GGUF file of `meta` and `tensors`.
pub fn write_gguf(path: &Path, meta: &[(&str, Value)], tensors: &[(String, QTensor)]) {
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(
        &mut f,
        &meta.iter().map(|(k, v)| (*k, v)).collect::<Vec<_>>(),
        &tensors
            .iter()
            .map(|(n, t)| (n.as_str(), t))
            .collect::<Vec<_>>(),
    )
    .unwrap();
}

/// A tensor as [`write_gguf_raw`] writes it: dims outermost first, ggml type id, bytes.
pub struct RawTensor {
    pub name: String,
    pub dims: Vec<usize>,
    pub ggml_type: u32,
    pub bytes: Vec<u8>,
}

impl RawTensor {
    /// `t`'s stored bytes.
    pub fn of(name: &str, t: &QTensor) -> RawTensor {
        let ggml_type = match t.dtype() {
            GgmlDType::F32 => 0,
            GgmlDType::F16 => 1,
            GgmlDType::Q4_0 => 2,
            GgmlDType::Q4_1 => 3,
            GgmlDType::Q5_0 => 6,
            GgmlDType::Q5_1 => 7,
            GgmlDType::Q8_0 => 8,
            GgmlDType::Q4K => 12,
            GgmlDType::Q5K => 13,
            GgmlDType::Q6K => 14,
            other => panic!("RawTensor::of: {other:?}"),
        };
        RawTensor {
            name: name.into(),
            dims: t.shape().dims().to_vec(),
            ggml_type,
            bytes: t.data().unwrap().into_owned(),
        }
    }
}

/// Writes a GGUF of `meta` and `tensors` as given, laid out as ggml's `gguf.cpp` lays out
/// version 3 (tensor data aligned to 32 bytes). For ggml types candle cannot write (MXFP4,
/// type 39); [`write_gguf`] writes the others.
pub fn write_gguf_raw(path: &Path, meta: &[(&str, Value)], tensors: &[RawTensor]) {
    fn string(w: &mut Vec<u8>, s: &str) {
        w.extend((s.len() as u64).to_le_bytes());
        w.extend(s.as_bytes());
    }
    fn type_id(v: &Value) -> u32 {
        match v {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }
    fn value(w: &mut Vec<u8>, v: &Value) {
        match v {
            Value::U8(x) => w.push(*x),
            Value::I8(x) => w.extend(x.to_le_bytes()),
            Value::U16(x) => w.extend(x.to_le_bytes()),
            Value::I16(x) => w.extend(x.to_le_bytes()),
            Value::U32(x) => w.extend(x.to_le_bytes()),
            Value::I32(x) => w.extend(x.to_le_bytes()),
            Value::U64(x) => w.extend(x.to_le_bytes()),
            Value::I64(x) => w.extend(x.to_le_bytes()),
            Value::F32(x) => w.extend(x.to_le_bytes()),
            Value::F64(x) => w.extend(x.to_le_bytes()),
            Value::Bool(x) => w.push(u8::from(*x)),
            Value::String(x) => string(w, x),
            Value::Array(a) => {
                w.extend(a.first().map_or(4, type_id).to_le_bytes());
                w.extend((a.len() as u64).to_le_bytes());
                a.iter().for_each(|x| value(w, x));
            }
        }
    }
    let pad = |n: usize| n.next_multiple_of(32) - n;
    let mut w = Vec::new();
    w.extend(b"GGUF");
    w.extend(3u32.to_le_bytes());
    w.extend((tensors.len() as u64).to_le_bytes());
    w.extend((meta.len() as u64).to_le_bytes());
    for (k, v) in meta {
        string(&mut w, k);
        w.extend(type_id(v).to_le_bytes());
        value(&mut w, v);
    }
    let mut offset = 0;
    for t in tensors {
        string(&mut w, &t.name);
        w.extend((t.dims.len() as u32).to_le_bytes());
        t.dims
            .iter()
            .rev()
            .for_each(|&d| w.extend((d as u64).to_le_bytes()));
        w.extend(t.ggml_type.to_le_bytes());
        w.extend((offset as u64).to_le_bytes());
        offset += t.bytes.len() + pad(t.bytes.len());
    }
    w.resize(w.len() + pad(w.len()), 0);
    for t in tensors {
        w.extend(&t.bytes);
        w.resize(w.len() + pad(t.bytes.len()), 0);
    }
    std::fs::write(path, w).unwrap();
}

/// GPT-2's byte → printable character map (tokens of a byte-level BPE vocabulary).
pub fn byte_chars() -> Vec<char> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut extra = 256;
    (0..=255u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                extra += 1;
                char::from_u32(extra - 1).unwrap()
            }
        })
        .collect()
}

/// llama.cpp's converter: `reshape(heads, 2, hd/2, cols).swapaxes(1, 2)` of q/k rows.
pub fn permute(w: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let hd = w.len() / cols / heads;
    let mut out = vec![0.0; w.len()];
    for h in 0..heads {
        for two in 0..2 {
            for i in 0..hd / 2 {
                let from = (h * hd + two * hd / 2 + i) * cols;
                let to = (h * hd + i * 2 + two) * cols;
                out[to..to + cols].copy_from_slice(&w[from..from + cols]);
            }
        }
    }
    out
}

/// The ggml type of weight `i` of [`hf_tensor_shapes`]: vectors f32, matrices cycling
/// through `types`.
pub fn matrix_type(types: &[GgmlDType], i: usize, shape: &[usize]) -> GgmlDType {
    if shape.len() == 1 {
        GgmlDType::F32
    } else {
        types[i % types.len()]
    }
}

/// The GGUF tensors of the Llama model `pkg` of shape `p`, as llama.cpp's converter writes
/// them: llama.cpp's names, q/k rows permuted into rotary pairs, each weight in
/// [`matrix_type`]; no `output.weight` when `tied` (the head is the embedding table).
pub fn gguf_tensors(
    pkg: &ModelPackage,
    p: &Preset,
    types: &[GgmlDType],
    tied: bool,
) -> Vec<(String, QTensor)> {
    let mut out = Vec::new();
    for (i, (name, shape)) in hf_tensor_shapes(p).iter().enumerate() {
        if tied && name == "lm_head.weight" {
            continue;
        }
        let data = pkg.tensor_f32(name, shape).unwrap();
        let data = if name.ends_with("q_proj.weight") {
            permute(&data, p.heads, shape[1])
        } else if name.ends_with("k_proj.weight") {
            permute(&data, p.kv_heads, shape[1])
        } else {
            data
        };
        let t = Tensor::from_vec(data, shape.as_slice(), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, matrix_type(types, i, shape)).unwrap();
        out.push((gguf_name(name), q));
    }
    out
}

/// The merges of [`bpe_tokenizer_meta`]'s small vocabularies.
pub const MERGES: [&str; 5] = ["h e", "l l", "he ll", "o Ġ", "Ġ w"];

/// A byte-level BPE tokenizer as GGUF metadata: the 256 byte tokens, one token per merge of
/// `merges` (pairs of earlier tokens, in rank order), the control tokens `<|im_start|>`
/// (BOS), `<|im_end|>` (EOS) and `<|endoftext|>`, then `<unusedN>` up to `vocab` tokens;
/// pre-tokenizer `pre` and a ChatML template. Returns the metadata and the vocabulary.
pub fn bpe_tokenizer_meta(
    pre: &str,
    merges: &[&str],
    vocab: usize,
) -> (Vec<(&'static str, Value)>, Vec<String>) {
    let mut tokens: Vec<String> = byte_chars().iter().map(|c| c.to_string()).collect();
    tokens.extend(merges.iter().map(|m| m.replace(' ', "")));
    let first_special = tokens.len();
    tokens.extend(["<|im_start|>", "<|im_end|>", "<|endoftext|>"].map(String::from));
    while tokens.len() < vocab {
        tokens.push(format!("<unused{}>", tokens.len()));
    }
    let token_type = (0..tokens.len())
        .map(|i| {
            Value::I32(if (first_special..first_special + 3).contains(&i) {
                3
            } else {
                1
            })
        })
        .collect();
    let template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let s = |x: &str| Value::String(x.into());
    let u = |x: usize| Value::U32(x as u32);
    let meta = vec![
        ("tokenizer.ggml.model", s("gpt2")),
        ("tokenizer.ggml.pre", s(pre)),
        (
            "tokenizer.ggml.tokens",
            Value::Array(tokens.iter().map(|t| s(t)).collect()),
        ),
        (
            "tokenizer.ggml.merges",
            Value::Array(merges.iter().map(|m| s(m)).collect()),
        ),
        ("tokenizer.ggml.token_type", Value::Array(token_type)),
        ("tokenizer.ggml.bos_token_id", u(first_special)),
        ("tokenizer.ggml.eos_token_id", u(first_special + 1)),
        ("tokenizer.chat_template", s(template)),
    ];
    (meta, tokens)
}
