//! The runner: prefill + decode and agent fork (speculative decoding is in
//! [`crate::speculative`]), driving a
//! backend's `forward` method bound to host-made sessions through `cache_key`.

use std::collections::BTreeSet;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use kvplug_core::{CacheConfig, KvDtype};
use kvplug_plugin_api::abi_stable::std_types::RVec;
use kvplug_plugin_api::{BackendOptions, CacheStats, HostTensor, MethodHandle};

use crate::host::Host;
use crate::model::cache_config;

/// The option naming the model directory (as the kit reads it).
const OPTION_MODEL_DIR: &str = "model_dir";
/// The option limiting a model to its first N layers.
const OPTION_LAYERS: &str = "layers";

/// Greedy (temperature 0) or temperature + top-p sampling with a seed.
#[derive(Clone, Debug)]
pub struct Sampler {
    /// 0 = greedy.
    pub temperature: f32,
    /// Nucleus mass.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    state: u64,
}

impl Sampler {
    /// A sampler; greedy when `temperature <= 0`.
    pub fn new(temperature: f32, top_p: f32, seed: u64) -> Self {
        Sampler {
            temperature,
            top_p,
            top_k: 0,
            state: seed ^ 0x2545_F491_4F6C_DD1D,
        }
    }

    /// The same sampler restricted to the `k` most likely tokens (0 = no limit), applied
    /// before `top_p` as Hugging Face and llama.cpp do.
    pub fn with_top_k(mut self, k: usize) -> Self {
        self.top_k = k;
        self
    }

    fn uniform(&mut self) -> f32 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Whether this sampler always takes the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Picks a token from `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> i32 {
        if self.is_greedy() {
            return argmax(logits);
        }
        let dist = self.distribution(logits);
        self.draw(&dist)
    }

    /// The distribution [`Sampler::sample`] draws from: `(token, probability)` by descending
    /// probability after temperature, top-k and top-p (renormalized); the argmax alone when
    /// greedy.
    pub fn distribution(&self, logits: &[f32]) -> Vec<(i32, f32)> {
        if self.is_greedy() {
            return vec![(argmax(logits), 1.0)];
        }
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let max = logits[order[0]];
        let w: Vec<f32> = order
            .iter()
            .map(|&i| ((logits[i] - max) / self.temperature).exp())
            .collect();
        let candidates = if self.top_k == 0 {
            w.len()
        } else {
            self.top_k.min(w.len())
        };
        let total: f32 = w[..candidates].iter().sum();
        let (mut mass, mut keep) = (0.0, 0);
        while keep < candidates && (keep == 0 || mass < self.top_p * total) {
            mass += w[keep];
            keep += 1;
        }
        order[..keep]
            .iter()
            .zip(&w)
            .map(|(&i, &wk)| (i as i32, wk / mass))
            .collect()
    }

    /// Draws a token from `dist` (`(token, probability)` pairs; the probabilities need not
    /// sum to exactly 1).
    pub fn draw(&mut self, dist: &[(i32, f32)]) -> i32 {
        let total: f32 = dist.iter().map(|d| d.1).sum();
        let mut r = self.uniform() * total;
        for &(t, p) in dist {
            if r < p {
                return t;
            }
            r -= p;
        }
        dist.last().map_or(0, |d| d.0)
    }

    /// A uniform draw in `[0, 1)` from this sampler's stream.
    pub fn coin(&mut self) -> f32 {
        self.uniform()
    }
}

/// Index of the largest logit (the first on ties).
pub fn argmax(logits: &[f32]) -> i32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as i32
}

fn log_softmax_at(logits: &[f32], id: i32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    logits[id as usize] as f64 - max - z.ln()
}

/// A `forward` method bound to one session.
pub struct Forward {
    method: MethodHandle,
    vocab: usize,
    /// Forward calls made.
    pub calls: usize,
}

impl Forward {
    /// Loads `forward` of `model` (first `layers` layers if given) on `backend`, bound to the
    /// cache `options` names.
    pub fn load(
        host: &Host,
        backend: &str,
        model: &Path,
        layers: Option<usize>,
        mut options: BackendOptions,
    ) -> Result<Self> {
        options.set(OPTION_MODEL_DIR, &model.display().to_string());
        if let Some(n) = layers {
            options.set(OPTION_LAYERS, &n.to_string());
        }
        let method = host.load_method(backend, "forward", &options)?;
        let cfg: serde_json::Value = serde_json::from_str(&kvplug_core::files::read_text(
            &model.join("config.json"),
            kvplug_core::files::MAX_TEXT_BYTES,
        )?)?;
        let vocab = cfg["vocab_size"]
            .as_u64()
            .context("config.json has no vocab_size")? as usize;
        Ok(Forward {
            method,
            vocab,
            calls: 0,
        })
    }

    /// The vocabulary size (logits per row).
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Prefills `tokens` at positions `start..` in micro-batches of at most
    /// [`PREFILL_UBATCH`] tokens (one forward each, so attention scratch grows with
    /// `ubatch × window`, never with the prompt squared), calling `begin(n)` before each
    /// batch of `n` tokens (a seq cache names their sequences there). Returns the last
    /// token's logits.
    pub fn prefill(
        &mut self,
        tokens: &[i32],
        start: usize,
        begin: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<Vec<f32>> {
        let mut last = None;
        for (i, chunk) in tokens.chunks(PREFILL_UBATCH).enumerate() {
            let p0 = start + i * PREFILL_UBATCH;
            let positions: Vec<i32> = (p0 as i32..(p0 + chunk.len()) as i32).collect();
            begin(chunk.len())?;
            last = self
                .call(chunk, &positions, Some(&[chunk.len() as i32 - 1]))?
                .pop();
        }
        last.context("nothing to prefill")
    }

    /// Runs `tokens` at `positions`; returns the logits of `rows` (all when `None`).
    pub fn call(
        &mut self,
        tokens: &[i32],
        positions: &[i32],
        rows: Option<&[i32]>,
    ) -> Result<Vec<Vec<f32>>> {
        let mut inputs = RVec::new();
        inputs.push(HostTensor::from_i32(&[tokens.len()], tokens));
        inputs.push(HostTensor::from_i32(&[positions.len()], positions));
        if let Some(r) = rows {
            inputs.push(HostTensor::from_i32(&[r.len()], r));
        }
        let out = self.method.execute(inputs).into_result()?;
        self.calls += 1;
        let logits = out
            .first()
            .context("forward returned nothing")?
            .to_f32()
            .context("logits are not float")?;
        Ok(logits.chunks(self.vocab).map(<[f32]>::to_vec).collect())
    }
}

/// Tokens per prefill forward (llama.cpp's default `n_ubatch`).
pub const PREFILL_UBATCH: usize = 512;

/// Cache statistics for reports.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CacheReport {
    /// Bytes of K/V pools.
    pub allocated_bytes: u64,
    /// Cells the full layers' pools have room for.
    pub pool_cells: u64,
    /// Cells the sliding layers' pools have room for (0 without sliding layers).
    pub window_cells: u64,
    /// Cells holding data.
    pub live_cells: u64,
    /// Tokens the prefix index holds (seq caches).
    pub prefix_cached: u64,
    /// Of those, tokens no live sequence holds (evictable).
    pub prefix_evictable: u64,
}

impl From<CacheStats> for CacheReport {
    fn from(s: CacheStats) -> Self {
        CacheReport {
            allocated_bytes: s.allocated_bytes,
            pool_cells: s.pool_cells,
            window_cells: s.window_cells,
            live_cells: s.live_cells,
            prefix_cached: s.prefix_cached,
            prefix_evictable: s.prefix_evictable,
        }
    }
}

/// What a run produced.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RunReport {
    /// `decode`, `agents` or `speculative`.
    pub mode: String,
    /// Generated ids (the winner's for agents).
    pub ids: Vec<i32>,
    /// Prompt tokens per second of prefill.
    pub prefill_tok_s: f64,
    /// Generated tokens per second.
    pub decode_tok_s: f64,
    /// Cache statistics at the end (the target's for speculative runs).
    pub cache: CacheReport,
    /// Agents: every branch's ids.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub branches: Option<Vec<Vec<i32>>>,
    /// Agents: the kept branch (index into `branches`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub winner: Option<usize>,
    /// Speculative: accepted draft tokens / drafted chain depth.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub acceptance: Option<f64>,
    /// Speculative: tokens emitted per target forward.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_target_forward: Option<f64>,
}

/// Where and how to run.
#[derive(Clone, Debug)]
pub struct RunSpec {
    /// Backend id.
    pub backend: String,
    /// Model directory.
    pub model: PathBuf,
    /// Prompt ids (at least one).
    pub prompt: Vec<i32>,
    /// Tokens to generate.
    pub max_new: usize,
    /// KV storage dtype.
    pub kv_dtype: KvDtype,
    /// Cache capacity in cells.
    pub capacity: usize,
    /// Tokens that end generation (kept as the last id; none: run to `max_new`).
    pub stop: BTreeSet<i32>,
}

/// The cache config of `model` (its first `layers` layers) for `spec`.
pub(crate) fn config(spec: &RunSpec, layers: Option<usize>, model: &Path) -> Result<CacheConfig> {
    cache_config(model, layers, spec.capacity, spec.kv_dtype)
}

/// Refuses an empty prompt, `max_new` 0 and runs beyond the capacity.
pub(crate) fn check_prompt(spec: &RunSpec) -> Result<()> {
    if spec.prompt.is_empty() {
        bail!("the prompt is empty");
    }
    if spec.max_new == 0 {
        bail!("--max-new 0 would generate nothing: give at least 1");
    }
    if spec.prompt.len().saturating_add(spec.max_new) > spec.capacity {
        bail!(
            "prompt ({}) + max_new ({}) exceed the capacity {}",
            spec.prompt.len(),
            spec.max_new,
            spec.capacity
        );
    }
    Ok(())
}

/// A progress line on a terminal's stderr.
pub(crate) struct Progress {
    on: bool,
}

impl Progress {
    pub(crate) fn new() -> Self {
        Progress {
            on: std::io::stderr().is_terminal(),
        }
    }
    pub(crate) fn tick(&self, done: usize, total: usize) {
        if self.on && (done % 16 == 0 || done == total) {
            eprint!("\rgenerated {done}/{total}");
            let _ = std::io::stderr().flush();
            if done == total {
                eprintln!();
            }
        }
    }
}

/// Tokens per second since `since`.
pub(crate) fn rate(tokens: usize, since: Instant) -> f64 {
    tokens as f64 / since.elapsed().as_secs_f64().max(1e-9)
}

/// Plain prefill + decode on a contiguous cache.
pub fn run_decode(host: &Host, spec: &RunSpec, sampler: &mut Sampler) -> Result<RunReport> {
    run_decode_streaming(host, spec, sampler, &mut |_| Ok(()))
}

/// [`run_decode`], handing each id to `on_token` as soon as it is sampled.
pub fn run_decode_streaming(
    host: &Host,
    spec: &RunSpec,
    sampler: &mut Sampler,
    on_token: &mut dyn FnMut(i32) -> Result<()>,
) -> Result<RunReport> {
    check_prompt(spec)?;
    let (session, options) =
        host.make_decode_session(&spec.backend, &config(spec, None, &spec.model)?)?;
    let mut fwd = Forward::load(host, &spec.backend, &spec.model, None, options)?;
    let p = spec.prompt.len();
    let t0 = Instant::now();
    let logits = fwd.prefill(&spec.prompt, 0, &mut |_| Ok(()))?;
    let prefill_tok_s = rate(p, t0);
    let mut ids = vec![sampler.sample(&logits)];
    on_token(ids[0])?;
    let progress = Progress::new();
    let t1 = Instant::now();
    while ids.len() < spec.max_new && !spec.stop.contains(&ids[ids.len() - 1]) {
        let pos = (p + ids.len() - 1) as i32;
        let logits = fwd.call(&ids[ids.len() - 1..], &[pos], None)?;
        ids.push(sampler.sample(&logits[0]));
        on_token(ids[ids.len() - 1])?;
        progress.tick(ids.len(), spec.max_new);
    }
    Ok(RunReport {
        mode: "decode".into(),
        decode_tok_s: rate(ids.len().saturating_sub(1), t1),
        ids,
        prefill_tok_s,
        cache: session.stats()?.into(),
        branches: None,
        winner: None,
        acceptance: None,
        tokens_per_target_forward: None,
    })
}

/// What [`run_fork`] produced.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ForkReport {
    /// Each branch's generated ids (ending at a stop token or at `max_new`).
    pub branches: Vec<Vec<i32>>,
    /// Trunk tokens prefilled once and shared by every branch.
    pub trunk_tokens: usize,
    /// Branch suffix tokens, prefilled together in one forward.
    pub suffix_tokens: usize,
    /// Forwards of the decode phase (one per step for all live branches).
    pub decode_forwards: usize,
    /// Generated tokens per second over all branches.
    pub decode_tok_s: f64,
    /// Cache statistics at the end.
    pub cache: CacheReport,
}

/// Agents continuing one conversation: `spec.prompt` is the shared trunk (sequence 0,
/// prefilled once); branch `b` (sequence `b + 1`) shares it zero-copy (`seq_cp`) and adds
/// its own `suffixes[b]` (e.g. a different user turn). All suffixes are prefilled in one
/// forward, then every live branch decodes in one forward per step until it reaches a stop
/// token or `spec.max_new`.
pub fn run_fork(host: &Host, spec: &RunSpec, suffixes: &[Vec<i32>]) -> Result<ForkReport> {
    check_prompt(spec)?;
    let k = suffixes.len();
    if !(1..=63).contains(&k) || suffixes.iter().any(Vec::is_empty) {
        bail!("a fork takes 1..=63 non-empty branch suffixes (sequence 0 is the trunk)");
    }
    let p = spec.prompt.len();
    let suffix_tokens: usize = suffixes.iter().map(Vec::len).sum();
    let longest = suffixes.iter().map(Vec::len).max().unwrap_or(0);
    let cells = p + suffix_tokens + k * spec.max_new;
    if cells > spec.capacity || p + longest + spec.max_new > spec.capacity {
        bail!(
            "the trunk ({p}), the suffixes ({suffix_tokens}) and {k} × max_new ({}) need {cells} cells; the capacity is {}",
            spec.max_new,
            spec.capacity
        );
    }
    let (session, options) =
        host.make_seq_session(&spec.backend, &config(spec, None, &spec.model)?)?;
    let mut fwd = Forward::load(host, &spec.backend, &spec.model, None, options)?;
    fwd.prefill(&spec.prompt, 0, &mut |n| {
        Ok(session.begin_step(&vec![0; n])?)
    })?;
    for b in 1..=k as i32 {
        session.seq_cp(0, b, None, None)?;
    }
    // All suffixes in one forward; logits at each branch's last token.
    let (mut tokens, mut seqs, mut pos, mut rows) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (b, suffix) in suffixes.iter().enumerate() {
        for (i, &t) in suffix.iter().enumerate() {
            tokens.push(t);
            seqs.push(b as i32 + 1);
            pos.push((p + i) as i32);
        }
        rows.push(tokens.len() as i32 - 1);
    }
    session.begin_step(&seqs)?;
    let mut samplers: Vec<Sampler> = Vec::new();
    let mut branches: Vec<Vec<i32>> = Vec::new();
    for (b, l) in fwd.call(&tokens, &pos, Some(&rows))?.iter().enumerate() {
        let mut s = Sampler::new(0.0, 1.0, b as u64);
        branches.push(vec![s.sample(l)]);
        samplers.push(s);
    }
    let live = |br: &[i32]| br.len() < spec.max_new && !spec.stop.contains(&br[br.len() - 1]);
    let (t1, mut forwards) = (Instant::now(), 0);
    loop {
        let active: Vec<usize> = (0..k).filter(|&b| live(&branches[b])).collect();
        if active.is_empty() {
            break;
        }
        let tokens: Vec<i32> = active
            .iter()
            .map(|&b| *branches[b].last().unwrap())
            .collect();
        let pos: Vec<i32> = active
            .iter()
            .map(|&b| (p + suffixes[b].len() + branches[b].len() - 1) as i32)
            .collect();
        let seqs: Vec<i32> = active.iter().map(|&b| b as i32 + 1).collect();
        session.begin_step(&seqs)?;
        let logits = fwd.call(&tokens, &pos, None)?;
        forwards += 1;
        for (&b, l) in active.iter().zip(&logits) {
            let next = samplers[b].sample(l);
            branches[b].push(next);
        }
    }
    let generated: usize = branches.iter().map(Vec::len).sum();
    Ok(ForkReport {
        decode_tok_s: rate(generated.saturating_sub(k), t1),
        branches,
        trunk_tokens: p,
        suffix_tokens,
        decode_forwards: forwards,
        cache: session.stats()?.into(),
    })
}

/// Agent fork on a seq cache: the prompt as a shared trunk (sequence 0), `k` branches forked
/// with `seq_cp` and decoded together, one forward per step; the branch with the highest
/// log-probability is kept with `seq_keep`. Branch `b` starts from the trunk's `b`-th most
/// likely token (greedy) or its own sample.
pub fn run_agents(host: &Host, spec: &RunSpec, k: usize, sampler: &Sampler) -> Result<RunReport> {
    check_prompt(spec)?;
    if !(1..=63).contains(&k) {
        bail!("--agents takes 1..=63 branches (sequence 0 is the trunk)");
    }
    let need = spec.prompt.len() + k * spec.max_new;
    if need > spec.capacity {
        bail!(
            "the prompt ({}) and {k} branches of max_new ({}) need {need} cells; the capacity is {}",
            spec.prompt.len(),
            spec.max_new,
            spec.capacity
        );
    }
    let cfg = config(spec, None, &spec.model)?;
    let (session, options) = host.make_seq_session(&spec.backend, &cfg)?;
    let mut fwd = Forward::load(host, &spec.backend, &spec.model, None, options)?;
    let p = spec.prompt.len();
    let t0 = Instant::now();
    let trunk = fwd.prefill(&spec.prompt, 0, &mut |n| {
        Ok(session.begin_step(&vec![0; n])?)
    })?;
    let prefill_tok_s = rate(p, t0);
    let mut order: Vec<usize> = (0..trunk.len()).collect();
    order.sort_by(|&a, &b| trunk[b].total_cmp(&trunk[a]));
    let mut samplers: Vec<Sampler> = (0..k)
        .map(|b| {
            Sampler::new(sampler.temperature, sampler.top_p, sampler.state ^ b as u64)
                .with_top_k(sampler.top_k)
        })
        .collect();
    let mut branches: Vec<Vec<i32>> = (0..k)
        .map(|b| {
            vec![if sampler.temperature <= 0.0 {
                order[b] as i32
            } else {
                samplers[b].sample(&trunk)
            }]
        })
        .collect();
    let mut score: Vec<f64> = branches
        .iter()
        .map(|br| log_softmax_at(&trunk, br[0]))
        .collect();
    for b in 1..=k as i32 {
        session.seq_cp(0, b, None, None)?;
    }
    let seqs: Vec<i32> = (1..=k as i32).collect();
    let progress = Progress::new();
    let t1 = Instant::now();
    let ended = |br: &Vec<i32>| br.last().is_some_and(|t| spec.stop.contains(t));
    while branches[0].len() < spec.max_new && !branches.iter().all(ended) {
        let n = branches[0].len();
        let tokens: Vec<i32> = branches.iter().map(|br| br[n - 1]).collect();
        session.begin_step(&seqs)?;
        let logits = fwd.call(&tokens, &vec![(p + n - 1) as i32; k], None)?;
        for (b, l) in logits.iter().enumerate() {
            let next = samplers[b].sample(l);
            score[b] += log_softmax_at(l, next);
            branches[b].push(next);
        }
        progress.tick(n + 1, spec.max_new);
    }
    let winner = (0..k)
        .max_by(|&a, &b| score[a].total_cmp(&score[b]))
        .expect("k >= 1");
    session.seq_keep(winner as i32 + 1)?;
    Ok(RunReport {
        mode: "agents".into(),
        ids: branches[winner].clone(),
        prefill_tok_s,
        decode_tok_s: rate(k * spec.max_new.saturating_sub(1), t1),
        cache: session.stats()?.into(),
        branches: Some(branches),
        winner: Some(winner),
        acceptance: None,
        tokens_per_target_forward: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_and_top_p_limit_the_candidates() {
        let logits = [0.0, 3.0, 2.9, 2.8, -1.0];
        let mut seen = BTreeSet::new();
        let mut s = Sampler::new(1.0, 1.0, 1).with_top_k(2);
        for _ in 0..500 {
            seen.insert(s.sample(&logits));
        }
        assert_eq!(seen, BTreeSet::from([1, 2]), "top-k 2 keeps the two best");
        let mut s = Sampler::new(1.0, 0.01, 1);
        assert!(
            (0..100).all(|_| s.sample(&logits) == 1),
            "a tiny top-p is greedy"
        );
        let mut all = BTreeSet::new();
        let mut s = Sampler::new(5.0, 1.0, 7);
        for _ in 0..2000 {
            all.insert(s.sample(&logits));
        }
        assert_eq!(
            all.len(),
            logits.len(),
            "no limit: every token can come out"
        );
    }
}
