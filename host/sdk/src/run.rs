//! The runs of `kvplug run`: decode (plain on a contiguous context, speculative on a tree
//! one), agent fork and agents on a seq context, each a few requests of the one
//! [`Generator`].

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use kvplug_core::{CacheKind, KvDtype};
use kvplug_plugin_api::CacheStats;
use kvplug_runtime::Model;

use crate::error::{fail, Result};
use crate::generator::{generate, GenOptions, Generator, TokenEvent};
use crate::logprobs::log_prob;
use crate::sampler::Sampler;
use crate::speculative::Speculation;
use crate::text::Text;

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
    /// Speculative: tokens emitted per decode forward (the prompt's forward, which samples
    /// the first, aside).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_target_forward: Option<f64>,
    /// Decode: text held back at the end, after the streamed tokens' (bytes that never
    /// completed a character, as U+FFFD); print it after them.
    #[serde(skip)]
    pub text_tail: String,
}

/// What to run.
#[derive(Clone, Debug)]
pub struct RunSpec {
    /// Prompt ids (at least one).
    pub prompt: Vec<i32>,
    /// Tokens to generate.
    pub max_tokens: usize,
    /// KV storage dtype.
    pub kv_dtype: KvDtype,
    /// Cache capacity in cells.
    pub capacity: usize,
    /// Tokens that end generation (kept as the last id; none: run to `max_tokens`).
    pub stop_tokens: BTreeSet<i32>,
}

impl RunSpec {
    /// Refuses an empty prompt, `max_tokens` 0 and runs beyond the capacity.
    pub(crate) fn check(&self) -> Result<()> {
        if self.prompt.is_empty() {
            fail!(Invalid, "the prompt is empty");
        }
        if self.max_tokens == 0 {
            fail!(
                Invalid,
                "max_tokens 0 would generate nothing: give at least 1"
            );
        }
        if self.prompt.len().saturating_add(self.max_tokens) > self.capacity {
            fail!(
                Invalid,
                "prompt ({}) + max_tokens ({}) exceed the capacity {}",
                self.prompt.len(),
                self.max_tokens,
                self.capacity
            );
        }
        Ok(())
    }

    /// The request options for `sampler`.
    pub(crate) fn options(&self, sampler: Sampler) -> GenOptions {
        GenOptions {
            max_tokens: self.max_tokens,
            sampler,
            stop_tokens: self.stop_tokens.clone(),
            ..GenOptions::default()
        }
    }
}

/// Tokens per second since `since`.
pub(crate) fn rate(tokens: usize, since: Instant) -> f64 {
    tokens as f64 / since.elapsed().as_secs_f64().max(1e-9)
}

/// Prefill + decode: plain on a contiguous context, or with `speculate` on a tree context
/// (drafts verified as trees); `on_token` sees each token as it is sampled (with its text
/// when `text` is given). Greedy and top-k sampled tokens are picked where the logits are
/// ([`GenOptions::device_argmax`]): their events carry no logits.
pub fn run_decode(
    model: &Model,
    spec: &RunSpec,
    text: Option<Arc<Text>>,
    sampler: Sampler,
    speculate: Option<Speculation>,
    on_token: &mut dyn FnMut(&TokenEvent<'_>) -> Result<()>,
) -> Result<RunReport> {
    spec.check()?;
    let kind = match speculate {
        Some(_) => CacheKind::Tree,
        None => CacheKind::Contiguous,
    };
    let mut ctx = model.context(kind, spec.capacity, spec.kv_dtype)?;
    let opts = GenOptions {
        speculate,
        device_argmax: true,
        ..spec.options(sampler)
    };
    let g = generate(&mut ctx, text, 0, &spec.prompt, 0, opts, on_token)?;
    let decoded = g.ids.len().saturating_sub(1) as f64;
    Ok(RunReport {
        mode: if g.speculation.is_some() {
            "speculative"
        } else {
            "decode"
        }
        .into(),
        acceptance: g.speculation.map(|s| s.acceptance()),
        tokens_per_target_forward: g.speculation.map(|s| decoded / s.steps.max(1) as f64),
        ids: g.ids,
        text_tail: g.text_tail,
        prefill_tok_s: g.prefill_tok_s,
        decode_tok_s: g.decode_tok_s,
        cache: ctx.stats()?.into(),
        branches: None,
        winner: None,
    })
}

/// What [`run_fork`] produced.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ForkReport {
    /// Each branch's generated ids (ending at a stop token or at `max_tokens`).
    pub branches: Vec<Vec<i32>>,
    /// Trunk tokens prefilled once and shared by every branch.
    pub trunk_tokens: usize,
    /// Branch suffix tokens, prefilled together (one forward up to a micro-batch).
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
/// its own `suffixes[b]` (e.g. a different user turn). The suffixes go in together, then
/// every live branch decodes in one forward per step until it reaches a stop token or
/// `spec.max_tokens` (greedy).
pub fn run_fork(model: &Model, spec: &RunSpec, suffixes: &[Vec<i32>]) -> Result<ForkReport> {
    spec.check()?;
    let k = suffixes.len();
    if !(1..=63).contains(&k) || suffixes.iter().any(Vec::is_empty) {
        fail!(
            Invalid,
            "a fork takes 1..=63 non-empty branch suffixes (sequence 0 is the trunk)"
        );
    }
    let p = spec.prompt.len();
    let suffix_tokens: usize = suffixes.iter().map(Vec::len).sum();
    let longest = suffixes.iter().map(Vec::len).max().unwrap_or(0);
    let cells = p + suffix_tokens + k * spec.max_tokens;
    if cells > spec.capacity || p + longest + spec.max_tokens > spec.capacity {
        fail!(
            Invalid,
            "the trunk ({p}), the suffixes ({suffix_tokens}) and {k} × max_tokens ({}) need {cells} cells; the capacity is {}",
            spec.max_tokens,
            spec.capacity
        );
    }
    let mut ctx = model.context(CacheKind::Seq, spec.capacity, spec.kv_dtype)?;
    let trunk = GenOptions::default();
    generate(&mut ctx, None, 0, &spec.prompt, 0, trunk, &mut |_| Ok(()))?;
    let mut g = Generator::new();
    let mut requests = Vec::with_capacity(k);
    for (b, suffix) in suffixes.iter().enumerate() {
        let seq = b as i32 + 1;
        ctx.seq_cp(0, seq, None, None)?;
        requests.push(g.add(seq, suffix, p, spec.options(Sampler::greedy()))?);
    }
    // The suffixes first (one forward, unless they pass a micro-batch); then the decode.
    let mut done = Vec::new();
    while g.is_prefilling() {
        done.extend(g.step(&mut ctx, &mut |_| Ok(()))?);
    }
    let (t1, forwards0) = (Instant::now(), ctx.decodes());
    done.extend(g.run(&mut ctx, &mut |_| Ok(()))?);
    let mut branches = vec![Vec::new(); k];
    for f in done {
        let b = requests.iter().position(|&r| r == f.request).expect("ours");
        branches[b] = f.generated;
    }
    let generated: usize = branches.iter().map(Vec::len).sum();
    Ok(ForkReport {
        decode_tok_s: rate(generated.saturating_sub(k), t1),
        decode_forwards: (ctx.decodes() - forwards0) as usize,
        branches,
        trunk_tokens: p,
        suffix_tokens,
        cache: ctx.stats()?.into(),
    })
}

/// Agent fork on a seq context: the prompt as a shared trunk (sequence 0), `k` branches
/// forked with `seq_cp` and decoded together, one forward per step, each to its own stop
/// token or `max_tokens`; the branch with the highest log-probability is kept with
/// `seq_keep`. Branch `b` starts from the trunk's `b`-th most likely token (greedy) or its
/// own sample.
pub fn run_agents(model: &Model, spec: &RunSpec, k: usize, sampler: &Sampler) -> Result<RunReport> {
    spec.check()?;
    if !(1..=63).contains(&k) {
        fail!(
            Invalid,
            "agents take 1..=63 branches (sequence 0 is the trunk)"
        );
    }
    let need = spec.prompt.len() + k * spec.max_tokens;
    if need > spec.capacity {
        fail!(
            Invalid,
            "the prompt ({}) and {k} branches of max_tokens ({}) need {need} cells; the capacity is {}",
            spec.prompt.len(),
            spec.max_tokens,
            spec.capacity
        );
    }
    let mut ctx = model.context(CacheKind::Seq, spec.capacity, spec.kv_dtype)?;
    let p = spec.prompt.len();
    // The trunk's last logits, from a one-token request whose token is not used.
    let mut trunk = Vec::new();
    let one = GenOptions {
        max_tokens: 1,
        ..GenOptions::default()
    };
    let t0 = Instant::now();
    generate(&mut ctx, None, 0, &spec.prompt, 0, one, &mut |e| {
        trunk = e.logits.to_vec();
        Ok(())
    })?;
    let prefill_tok_s = rate(p, t0);
    let mut order: Vec<usize> = (0..trunk.len()).collect();
    order.sort_by(|&a, &b| trunk[b].total_cmp(&trunk[a]));
    let mut samplers: Vec<Sampler> = (0..k).map(|b| sampler.fork(b as u64)).collect();
    let firsts: Vec<i32> = (0..k)
        .map(|b| {
            if sampler.is_greedy() {
                order[b] as i32
            } else {
                samplers[b].sample(&trunk)
            }
        })
        .collect();
    let mut score: Vec<f64> = firsts.iter().map(|&t| log_prob(&trunk, t)).collect();
    let mut branches: Vec<Vec<i32>> = firsts.iter().map(|&t| vec![t]).collect();
    let mut g = Generator::new();
    let mut seqs = Vec::new();
    for (b, s) in samplers.into_iter().enumerate() {
        let seq = b as i32 + 1;
        ctx.seq_cp(0, seq, None, None)?;
        let first = branches[b][0];
        if spec.max_tokens > 1 && !spec.stop_tokens.contains(&first) {
            let opts = RunSpec {
                max_tokens: spec.max_tokens - 1,
                ..spec.clone()
            }
            .options(s);
            g.add(seq, &[first], p, opts)?;
        }
        seqs.push(seq);
    }
    let t1 = Instant::now();
    g.run(&mut ctx, &mut |e| {
        let b = (e.seq - 1) as usize;
        score[b] += log_prob(e.logits, e.id);
        branches[b].push(e.id);
        Ok(())
    })?;
    let winner = (0..k)
        .max_by(|&a, &b| score[a].total_cmp(&score[b]))
        .expect("k >= 1");
    ctx.seq_keep(seqs[winner])?;
    let generated: usize = branches.iter().map(Vec::len).sum();
    Ok(RunReport {
        mode: "agents".into(),
        ids: branches[winner].clone(),
        prefill_tok_s,
        decode_tok_s: rate(generated.saturating_sub(k), t1),
        cache: ctx.stats()?.into(),
        branches: Some(branches),
        winner: Some(winner),
        acceptance: None,
        tokens_per_target_forward: None,
        text_tail: String::new(),
    })
}
