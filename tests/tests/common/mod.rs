//! Helpers shared by the model-level tests: the host over this build's plugins, and a plain
//! f64 reference forward.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::QTensor;
use kvplug_backend_kit::model::ModelPackage;
use kvplug_host::model::Preset;
use kvplug_host::{Host, PluginSearch};

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

pub fn host() -> Host {
    let host = Host::load(&PluginSearch::only(&[plugin_dir()], false));
    for b in BACKENDS {
        let p = host
            .plugin(b)
            .unwrap_or_else(|e| panic!("{e}; skipped: {:?}", host.skipped()));
        assert!(!p.device.starts_with("unavailable"), "{b}: {}", p.device);
    }
    host
}

/// The largest |got − want| over every logit of every position.
pub fn max_logit_error(got: &[Vec<f32>], want: &[Vec<f64>]) -> f64 {
    got.iter()
        .flatten()
        .zip(want.iter().flatten())
        .map(|(a, b)| (f64::from(*a) - b).abs())
        .fold(0.0, f64::max)
}

/// Plain f64 Llama-family forward (Llama, Qwen2's biases, Qwen3's q/k norms) over the whole
/// sequence (causal attention, no cache): logits of every position.
pub fn reference_logits(model: &Path, tokens: &[i32]) -> Vec<Vec<f64>> {
    reference_logits_as(model, tokens, false)
}

/// [`reference_logits`], optionally with the cpu backend's declared arithmetic for weights
/// in ggml block formats (`int8_block_acts`): each input row of such a linear is quantized in
/// blocks of 32 to `d·round(x/d)`, `d = max|x|/127`, before the f64 products.
pub fn reference_logits_as(model: &Path, tokens: &[i32], int8_block_acts: bool) -> Vec<Vec<f64>> {
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
        int8_block_acts
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
    let inv_freq: Vec<f64> = (0..hd / 2)
        .map(|i| c.rope_theta.powf(-(2.0 * i as f64) / hd as f64))
        .collect();
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
    let n = tokens.len();
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}.");
        let (wq, wk, wv) = (
            mat(&format!("{p}self_attn.q_proj.weight"), &[hq * hd, h]),
            mat(&format!("{p}self_attn.k_proj.weight"), &[hkv * hd, h]),
            mat(&format!("{p}self_attn.v_proj.weight"), &[hkv * hd, h]),
        );
        let wo = mat(&format!("{p}self_attn.o_proj.weight"), &[h, hq * hd]);
        let (ln1, ln2) = (
            w(&format!("{p}input_layernorm.weight"), &[h]),
            w(&format!("{p}post_attention_layernorm.weight"), &[h]),
        );
        let (wg, wu, wd) = (
            mat(&format!("{p}mlp.gate_proj.weight"), &[im, h]),
            mat(&format!("{p}mlp.up_proj.weight"), &[im, h]),
            mat(&format!("{p}mlp.down_proj.weight"), &[h, im]),
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
        let (nq, nk) = (
            optional(format!("{p}self_attn.q_norm.weight"), hd),
            optional(format!("{p}self_attn.k_norm.weight"), hd),
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
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for t in 0..n {
            let mut att = vec![0.0; hq * hd];
            for head in 0..hq {
                let kh = head / (hq / hkv);
                let q = &qs[t][head * hd..(head + 1) * hd];
                let scores: Vec<f64> = (0..=t)
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
                let z: f64 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    for d in 0..hd {
                        att[head * hd + d] += ej / z * vs[j][kh * hd + d];
                    }
                }
            }
            let o = matvec(&wo, h, &att);
            xs[t].iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let hn = norm(&xs[t], &ln2);
            let (g, u) = (matvec(&wg, im, &hn), matvec(&wu, im, &hn));
            let m: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let d = matvec(&wd, h, &m);
            xs[t].iter_mut().zip(&d).for_each(|(a, b)| *a += b);
        }
    }
    let fnorm = w("model.norm.weight", &[h]);
    let head = if c.tie_word_embeddings {
        mat("model.embed_tokens.weight", &[v, h])
    } else {
        mat("lm_head.weight", &[v, h])
    };
    xs.iter()
        .map(|x| matvec(&head, v, &norm(x, &fnorm)))
        .collect()
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
