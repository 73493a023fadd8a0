//! Memory plans (`kvplug plan`): how a memory budget divides between weights and K/V, by
//! layer group.

use std::path::{Path, PathBuf};

use kvplug_core::files::{open_regular, read_text, MAX_TEXT_BYTES};
use kvplug_core::gguf_index::config_source;
use kvplug_core::{KvDtype, LayerAttention, ModelCacheSpec, ModelConfig, MAX_SEQS};
use safetensors::SafeTensors;

use crate::error::{fail, Context, Result};
use crate::generator::PREFILL_UBATCH;

/// What to plan.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    /// Model: a directory or a GGUF file.
    pub model: PathBuf,
    /// Memory for weights and K/V, in bytes.
    pub budget: u64,
    /// KV storage dtype.
    pub kv_dtype: KvDtype,
    /// Tokens per agent, for the agents line.
    pub agent_tokens: usize,
    /// How the backend planned for holds the weights.
    pub holding: Holding,
}

/// How a backend holds a model's weights beyond mapping them as stored, as its `features`
/// (`kvplug plugins`) declare. The default holds every tensor as stored, as the cpu does.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Holding {
    /// MXFP4 tensors are re-encoded at load, as Q5_0 (`weights-reencoded=mxfp4`).
    pub reencodes_mxfp4: bool,
    /// Stored types widened to f32 at load, by the GGUF index's names
    /// (`weights-widened=q4_K|q6_K`).
    pub widened: Vec<String>,
}

impl Holding {
    /// How `plugin` holds weights, from its features.
    pub fn of(plugin: &kvplug_runtime::LoadedPlugin) -> Holding {
        let listed = |key: &str| -> Vec<String> {
            let lists = plugin
                .description()
                .features
                .iter()
                .filter_map(|f| f.strip_prefix(key));
            lists.flat_map(|l| l.split('|').map(String::from)).collect()
        };
        Holding {
            reencodes_mxfp4: listed("weights-reencoded=").iter().any(|f| f == "mxfp4"),
            widened: listed("weights-widened="),
        }
    }
}

/// `4GiB`, `512MB`, `1.5GiB`, `1000` or `1e9` (bytes); a bare `K`/`M`/`G`/`T` is binary, as
/// `docker --memory 2g` and `ulimit` read it (`2G` = 2 GiB). Case does not matter.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    // The unit is the letters at the end (`1e9`'s exponent is part of its number).
    let split = t.trim_end_matches(|c: char| c.is_ascii_alphabetic()).len();
    let (num, unit) = t.split_at(split);
    let v: f64 = match num.trim() {
        "" => {
            return Err(format!(
                "'{s}': no number (expected e.g. 4GiB, 512MB or 1000)"
            ))
        }
        n => n
            .parse()
            .map_err(|e| format!("'{s}': {e} (expected e.g. 4GiB)"))?,
    };
    let scale: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        u => return Err(format!("'{s}': unknown unit '{u}'")),
    };
    let bytes = v * scale;
    if !(bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64) {
        return Err(format!("'{s}' is not a byte count"));
    }
    Ok(bytes as u64)
}

/// One layer group of the plan.
#[derive(Debug, serde::Serialize)]
pub struct GroupPlan {
    /// Full or sliding(window).
    pub attention: LayerAttention,
    /// Layers in the group.
    pub layers: usize,
    /// K/V bytes one token takes across the group's layers.
    pub bytes_per_token: usize,
}

/// What a model's weights take on a backend (`kvplug plan`, `kvplug plugins --model`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Weights {
    /// Bytes the weights take on the backend: as stored (mapped), but MXFP4 tensors as the
    /// Q5_0 they are re-encoded into where `reencodes_mxfp4`, and tensors of a widened type
    /// as f32.
    pub weight_bytes: u64,
    /// Bytes more the weights take, at least, on a backend that re-encodes MXFP4 at load
    /// than on one that reads them in place (as Q5_0, 22 bytes a block for 17, in memory;
    /// f32 for a tensor whose scales fall outside f16's range); 0 for a model without MXFP4
    /// tensors.
    pub reencoded_extra_bytes: u64,
    /// Whether `weight_bytes` (and every figure after it) counts that re-encoding.
    pub reencodes_mxfp4: bool,
    /// Bytes more than stored the weights take from the backend widening them to f32 at
    /// load (0 where it widens none of the model's types).
    pub widened_extra_bytes: u64,
    /// Parameters (weight elements) in all.
    pub parameters: u64,
    /// Parameters a token runs through: all but the experts it is not routed to (equal to
    /// `parameters` for a dense model; the embedding table counts whole).
    pub active_parameters: u64,
    /// Bytes of the experts' weights (0 for a dense model).
    pub expert_bytes: u64,
    /// Bytes of weights a one-token step reads at most: all but the experts it is not
    /// routed to (the embedding table counted whole).
    pub step_bytes: u64,
}

/// Counts the weights of `model` (a directory or a GGUF file) as a backend holding them as
/// `holding` says ([`Holding::of`] a loaded plugin) takes them.
pub fn weights(model: &Path, holding: &Holding) -> Result<Weights> {
    let dir = crate::formats::resolve_model(model)?;
    let (config, _) = model_config(&dir)?;
    Ok(census(&dir, holding)?.weights(&config))
}

/// The plan.
#[derive(Debug, serde::Serialize)]
pub struct Plan {
    /// The weights on the backend planned for.
    #[serde(flatten)]
    pub weights: Weights,
    /// The budget.
    pub budget_bytes: u64,
    /// KV storage dtype.
    pub kv_dtype: String,
    /// Layer groups.
    pub groups: Vec<GroupPlan>,
    /// Tokens one sequence can hold within the budget.
    pub tokens: usize,
    /// Tokens per agent.
    pub agent_tokens: usize,
    /// Agents of `agent_tokens` that fit (no shared prefix).
    pub agents: usize,
    /// The same two figures if every layer kept its whole history; equal to the above for
    /// models without sliding layers.
    pub tokens_all_full: usize,
    /// See `tokens_all_full`.
    pub agents_all_full: usize,
    /// The model's `max_position_embeddings`, if stated.
    pub trained_positions: Option<u64>,
    /// Bytes of one sequence's recurrent state (delta-rule, convolution and Mamba2 layers; 0
    /// without): each sequence holds two (its end's, and its step's new one until the step
    /// commits), and the cache up to
    /// [`SURPLUS_ANCHORS`](kvplug_core::config::SURPLUS_ANCHORS) more, all counted in
    /// `tokens` and `agents`.
    pub state_bytes: usize,
}

/// What a model's weights hold: bytes as held (see [`Holding`]) and elements, in all and in
/// its experts' tensors (`mlp.experts.*`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Census {
    holding: Holding,
    bytes: u64,
    reencoded_extra_bytes: u64,
    widened_extra_bytes: u64,
    parameters: u64,
    expert_bytes: u64,
    expert_parameters: u64,
}

impl Census {
    /// Counts tensor `name` of `shape`, `bytes` stored in `dtype` (the kit's names).
    fn add(&mut self, name: &str, shape: &[usize], bytes: u64, dtype: &str) {
        let elems = shape.iter().product::<usize>() as u64;
        let (mut dtype, mut bytes) = (dtype, bytes);
        if dtype == "mxfp4" {
            // As Q5_0 (StoredTensor::computable).
            self.reencoded_extra_bytes += bytes / 17 * 5;
            if self.holding.reencodes_mxfp4 {
                (dtype, bytes) = ("q5_0", bytes / 17 * 22);
            }
        }
        if self.holding.widened.iter().any(|w| w == dtype) {
            self.widened_extra_bytes += (elems * 4).saturating_sub(bytes);
            bytes = elems * 4;
        }
        self.bytes += bytes;
        self.parameters += elems;
        if name.contains(".mlp.experts.") {
            self.expert_bytes += bytes;
            self.expert_parameters += elems;
        }
    }

    /// The counts as [`Weights`], for a model of `config`.
    fn weights(&self, config: &ModelConfig) -> Weights {
        // `total` less the share of the experts' `part` a token is not routed to.
        let active = |total: u64, part: u64| match config.experts() {
            Some(e) => {
                let idle = e.count - e.per_token;
                total - (part as u128 * idle as u128 / e.count as u128) as u64
            }
            None => total,
        };
        Weights {
            weight_bytes: self.bytes,
            reencoded_extra_bytes: self.reencoded_extra_bytes,
            reencodes_mxfp4: self.holding.reencodes_mxfp4,
            widened_extra_bytes: self.widened_extra_bytes,
            parameters: self.parameters,
            active_parameters: active(self.parameters, self.expert_parameters),
            expert_bytes: self.expert_bytes,
            step_bytes: active(self.bytes, self.expert_bytes),
        }
    }
}

/// Every tensor as stored: in the model's safetensors shards, or, for weights used in place
/// in a GGUF, every indexed tensor (quantized blocks counted as their bytes).
fn census(dir: &Path, holding: &Holding) -> Result<Census> {
    let mut c = Census {
        holding: holding.clone(),
        ..Census::default()
    };
    let index = dir.join(kvplug_core::gguf_index::GGUF_INDEX_FILE);
    if index.exists() {
        let index: kvplug_core::GgufIndex = serde_json::from_str(&kvplug_core::files::read_text(
            &index,
            kvplug_core::files::MAX_TEXT_BYTES,
        )?)
        .with_context(|| format!("{}", index.display()))?;
        for (name, t) in &index.tensors {
            c.add(name, &t.shape, t.bytes, &t.dtype);
        }
        return Ok(c);
    }
    for e in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let p = e?.path();
        if p.extension().is_none_or(|x| x != "safetensors") {
            continue;
        }
        let (file, _) = open_regular(&p)?;
        // SAFETY: read-only map of a model shard; only the header is parsed.
        let map = unsafe { memmap2::Mmap::map(&file) }?;
        let st = SafeTensors::deserialize(&map)
            .with_context(|| format!("{}: not a safetensors file", p.display()))?;
        for (name, v) in st.tensors() {
            c.add(&name, v.shape(), v.data().len() as u64, "");
        }
    }
    Ok(c)
}

/// The largest `n` with `fits(n)` (monotone), up to `cap`.
fn largest(cap: usize, fits: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (0usize, cap);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// Plans `args.model` under `args.budget`.
pub fn plan(args: &PlanOptions) -> Result<Plan> {
    if args.agent_tokens == 0 {
        fail!(Invalid, "agent tokens 0: an agent holds at least 1 token");
    }
    let dir = crate::formats::resolve_model(&args.model)?;
    let (model, text) = model_config(&dir)?;
    let spec = model.cache_spec();
    args.kv_dtype.check_head_dim(spec.head_dim)?;
    let config: serde_json::Value = serde_json::from_str(&text)?;
    let weights = census(&dir, &args.holding)?.weights(&model);
    let weight_bytes = weights.weight_bytes;
    let Some(kv_budget) = args.budget.checked_sub(weight_bytes) else {
        fail!(
            Invalid,
            "the weights alone take {weight_bytes} bytes, more than the budget of {}",
            args.budget
        );
    };
    let dtype = args.kv_dtype;
    // Every sliding layer kept whole.
    let full = ModelCacheSpec {
        layers: spec
            .layers
            .iter()
            .map(|&l| match l {
                LayerAttention::Sliding { .. } => LayerAttention::Full,
                other => other,
            })
            .collect(),
        ..spec.clone()
    };
    let (tokens, agents) = fit(&spec, dtype, kv_budget, args.agent_tokens);
    let (tokens_all_full, agents_all_full) = fit(&full, dtype, kv_budget, args.agent_tokens);
    Ok(Plan {
        weights,
        budget_bytes: args.budget,
        kv_dtype: dtype.to_string(),
        groups: spec
            .groups()
            .into_iter()
            .map(|g| GroupPlan {
                attention: g.attention,
                layers: g.layers.len(),
                bytes_per_token: g.layers.len() * spec.bytes_per_token(g.attention, dtype),
            })
            .collect(),
        tokens,
        agent_tokens: args.agent_tokens,
        agents,
        tokens_all_full,
        agents_all_full,
        trained_positions: trained_positions(&config),
        state_bytes: spec.state_bytes(),
    })
}

/// The config of the model in `dir`, and its text; a fault names the file it came from.
fn model_config(dir: &Path) -> Result<(ModelConfig, String)> {
    let text = read_text(&dir.join("config.json"), MAX_TEXT_BYTES)?;
    let config =
        ModelConfig::parse(&text).with_context(|| format!("{}", config_source(dir).display()))?;
    Ok((config, text))
}

/// The tokens one sequence can hold, and the sequences of `agent_tokens` tokens that fit, in
/// `budget` bytes of cache of `spec` (the cache's surplus anchors counted once).
fn fit(spec: &ModelCacheSpec, dtype: KvDtype, budget: u64, agent_tokens: usize) -> (usize, usize) {
    let budget = (budget as u128).saturating_sub(spec.surplus_bytes());
    let tokens = largest(kvplug_core::limits::MAX_CAPACITY, |n| {
        spec.sequence_bytes(dtype, n, PREFILL_UBATCH) <= budget
    });
    let each = spec
        .sequence_bytes(dtype, agent_tokens, PREFILL_UBATCH)
        .max(1);
    (tokens, (budget / each) as usize)
}

/// The cache capacity a conversation on `model` gets by default: the context it was trained
/// on (`max_position_embeddings`, else 4096), bounded by the tokens whose K/V (in `kv_dtype`)
/// fit half the memory the system has available now, with a hybrid's recurrent states.
pub fn default_capacity(model: &Path, kv_dtype: KvDtype) -> Result<usize> {
    let dir = crate::formats::resolve_model(model)?;
    let (model, text) = model_config(&dir)?;
    let spec = model.cache_spec();
    let config: serde_json::Value = serde_json::from_str(&text)?;
    let trained = trained_positions(&config).map_or(4096, |n| {
        n.min(kvplug_core::limits::MAX_CAPACITY as u64) as usize
    });
    let Some(available) = kvplug_core::limits::available_memory() else {
        return Ok(trained);
    };
    let half = (available / 2) as u128;
    let fits = largest(trained, |n| {
        spec.sequence_bytes(kv_dtype, n, PREFILL_UBATCH) + spec.surplus_bytes() <= half
    });
    Ok(fits.max(1))
}

/// The positions `model` was trained on: its config's `max_position_embeddings` where that is
/// positive (a GGUF's `context_length`). A context past them runs on positions the model never
/// saw, as llama.cpp warns when `n_ctx` passes `n_ctx_train`.
pub fn trained_context(model: &Path) -> Result<Option<u64>> {
    let dir = crate::formats::resolve_model(model)?;
    let (_, text) = model_config(&dir)?;
    Ok(trained_positions(&serde_json::from_str(&text)?))
}

/// The positions the model was trained on: `max_position_embeddings` where the config states
/// a positive one (a 0, as some converters write for "unknown", states nothing).
fn trained_positions(config: &serde_json::Value) -> Option<u64> {
    config["max_position_embeddings"]
        .as_u64()
        .filter(|&n| n > 0)
}

/// Bytes in MiB, or in KiB below one MiB (an LFM2 layer's state is a few KiB).
fn size(b: u64) -> String {
    match b {
        0..1_048_576 => format!("{:.1} KiB", b as f64 / 1024.0),
        _ => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
    }
}

/// A parameter count as people quote it (`494.0M`, `30.5B`).
fn count(n: u64) -> String {
    match n {
        0..1_000_000 => n.to_string(),
        1_000_000..1_000_000_000 => format!("{:.1}M", n as f64 / 1e6),
        _ => format!("{:.2}B", n as f64 / 1e9),
    }
}

impl Weights {
    /// The counts as text: a `weights` line, and an `experts` line for a mixture of experts.
    pub fn render(&self) -> String {
        let p = self;
        let held = match (p.reencoded_extra_bytes, p.reencodes_mxfp4) {
            (0, _) => "as stored".to_string(),
            (extra, true) => format!(
                "with MXFP4 re-encoded at load ({} more than stored)",
                size(extra)
            ),
            (extra, false) => format!(
                "as stored, MXFP4 read in place ({} more on a backend that re-encodes it)",
                size(extra)
            ),
        };
        let held = match p.widened_extra_bytes {
            0 => held,
            extra => format!(
                "{held}, block formats widened to f32 ({} more)",
                size(extra)
            ),
        };
        let mut out = format!(
            "weights     {} {held}, {} parameters\n",
            size(p.weight_bytes),
            count(p.parameters)
        );
        if p.expert_bytes > 0 {
            out += &format!(
                "experts     {} of the weights; a token runs {} parameters, a step reads at most {}\n",
                size(p.expert_bytes),
                count(p.active_parameters),
                size(p.step_bytes)
            );
        }
        out
    }
}

impl Plan {
    /// The plan as text, a table per layer group.
    pub fn render(&self) -> String {
        let p = self;
        let mut out = format!(
            "budget      {} ({} bytes)\n{}",
            size(p.budget_bytes),
            p.budget_bytes,
            p.weights.render()
        );
        out += &format!(
            "K/V         {} left, {} storage\n\nlayer group          layers  K/V bytes per token\n",
            size(p.budget_bytes - p.weights.weight_bytes),
            p.kv_dtype
        );
        for g in &p.groups {
            let name = match g.attention {
                LayerAttention::Full => "full".to_string(),
                LayerAttention::Sliding { window } => format!("sliding({window})"),
                LayerAttention::Conv { width, .. } => format!("conv({width})"),
                LayerAttention::Delta { width, .. } => format!("delta rule, conv({width})"),
                LayerAttention::Ssm { width, .. } => format!("mamba2, conv({width})"),
            };
            out += &format!("{name:<20} {:>6}  {:>19}\n", g.layers, g.bytes_per_token);
        }
        if p.state_bytes > 0 {
            out += &format!(
                "recurrent state      {} an anchor, 2 per sequence (its end, and a step's new end); a cache keeps up to {} more; all counted below (a speculative tree holds one per node, speculative chains up to {} more)\n",
                size(p.state_bytes as u64),
                kvplug_core::config::SURPLUS_ANCHORS,
                2 * kvplug_core::config::CHAIN_ANCHORS
            );
        }
        out += &format!(
        "\none sequence   {} tokens\nagents         {} of {} tokens each (a seq cache runs at most {MAX_SEQS} at once)\n",
        p.tokens, p.agents, p.agent_tokens
    );
        if let Some(n) = p.trained_positions.filter(|&n| (n as usize) < p.tokens) {
            out += &format!(
                "note: the model was trained on {n} positions (max_position_embeddings)\n"
            );
        }
        if p.groups
            .iter()
            .any(|g| matches!(g.attention, LayerAttention::Sliding { .. }))
        {
            out += &format!(
            "note: sliding layers are counted at window + {PREFILL_UBATCH} tokens; with every layer kept whole: {} tokens, {} agents\n",
            p.tokens_all_full, p.agents_all_full
        );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_parse_with_units() {
        assert_eq!(parse_bytes("4GiB"), Ok(4 << 30));
        assert_eq!(parse_bytes("1.5 MB"), Ok(1_500_000));
        assert_eq!(parse_bytes("1000"), Ok(1000));
        assert_eq!(parse_bytes("2G"), Ok(2 << 30));
        assert_eq!(parse_bytes("2g"), parse_bytes("2GiB"));
        assert_eq!(parse_bytes("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_bytes("512m"), Ok(512 << 20));
        assert!(parse_bytes("4 parsecs")
            .unwrap_err()
            .contains("unknown unit"));
        assert!(parse_bytes("-1GB").is_err());
        assert_eq!(parse_bytes("1e9"), Ok(1_000_000_000));
        assert_eq!(parse_bytes("2.5e3 KB"), Ok(2_500_000));
        for unnumbered in ["GB", "abc", ""] {
            assert!(
                parse_bytes(unnumbered).unwrap_err().contains("no number"),
                "{unnumbered}"
            );
        }
        for not_a_count in ["inf", "NaN", "1e30"] {
            assert!(parse_bytes(not_a_count).is_err(), "{not_a_count}");
        }
    }

    #[test]
    fn plans_the_tiny_model() {
        let dir = tempfile::tempdir().unwrap();
        crate::formats::synth::synth(&crate::formats::synth::PRESETS[0], dir.path(), 1, "f16")
            .unwrap();
        let args = |budget, kv_dtype| PlanOptions {
            model: dir.path().to_path_buf(),
            budget,
            kv_dtype,
            agent_tokens: 100,
            holding: Holding::default(),
        };
        let weights = census(dir.path(), &Holding::default()).unwrap().bytes;
        // tiny: 2 layers, 2 KV heads, head_dim 16: f16 K+V = 2 * 2 * 32 bytes per layer.
        let per_token = 2 * 2 * 2 * 32;
        let p = plan(&args(weights + 1000 * per_token + 5, KvDtype::F16)).unwrap();
        assert_eq!(
            (p.weights.weight_bytes, p.groups[0].bytes_per_token),
            (weights, per_token as usize)
        );
        assert_eq!((p.tokens, p.agents), (1000, 10));
        assert_eq!((p.tokens_all_full, p.agents_all_full), (1000, 10));
        let e = plan(&args(weights - 1, KvDtype::F16))
            .unwrap_err()
            .to_string();
        assert!(e.contains("the weights alone take"), "{e}");
    }

    #[test]
    fn a_zero_max_position_embeddings_states_no_trained_context() {
        let dir = tempfile::tempdir().unwrap();
        crate::formats::synth::synth(&crate::formats::synth::PRESETS[0], dir.path(), 1, "f16")
            .unwrap();
        let path = dir.path().join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let stated = config["max_position_embeddings"].as_u64();
        assert!(stated.is_some_and(|n| n > 0));
        assert_eq!(trained_context(dir.path()).unwrap(), stated);
        config["max_position_embeddings"] = 0.into();
        std::fs::write(&path, config.to_string()).unwrap();
        // The tiny model's K/V for 4096 tokens (256 KiB a thousand) fits any machine's half.
        assert_eq!(default_capacity(dir.path(), KvDtype::F16).unwrap(), 4096);
        assert_eq!(trained_context(dir.path()).unwrap(), None);
        let args = PlanOptions {
            model: dir.path().to_path_buf(),
            budget: 1 << 30,
            kv_dtype: KvDtype::F16,
            agent_tokens: 100,
            holding: Holding::default(),
        };
        assert_eq!(plan(&args).unwrap().trained_positions, None);
    }

    #[test]
    fn a_recurrent_cache_counts_its_surplus_anchors_once() {
        use kvplug_core::config::SURPLUS_ANCHORS;
        // LFM2-shaped: two convolution layers (a 2-row f32 tail of 1024 channels each)
        // around an attention layer of 2 KV heads of 64.
        let c = serde_json::json!({"layer_types": ["conv", "full_attention", "conv"],
            "conv_L_cache": 3, "hidden_size": 1024});
        let spec = ModelCacheSpec::from_config(&c, 3, 2, 64).unwrap();
        let state = spec.state_bytes() as u64;
        assert_eq!(state, 2 * 2 * 1024 * 4);
        let per_token = 2 * 2 * 64 * 2;
        let surplus = SURPLUS_ANCHORS as u64 * state;
        // One sequence: its tokens, its two states and the cache's surplus anchors.
        let (tokens, _) = fit(
            &spec,
            KvDtype::F16,
            surplus + 2 * state + 1000 * per_token,
            1,
        );
        assert_eq!(tokens, 1000);
        // Agents: each its tokens and two states, the surplus once.
        let agent = 100 * per_token + 2 * state;
        let (_, agents) = fit(&spec, KvDtype::F16, surplus + 10 * agent + agent - 1, 100);
        assert_eq!(agents, 10);
    }

    #[test]
    fn largest_finds_the_boundary() {
        assert_eq!(largest(100, |n| n * 3 <= 100), 33);
        assert_eq!(largest(100, |_| true), 100);
        assert_eq!(largest(100, |n| n == 0), 0);
    }
}
