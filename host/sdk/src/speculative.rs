//! Speculative tree decoding that pays: a draft proposes a tree of continuations, the target
//! verifies the whole tree in one forward on its tree cache, and the longest accepted chain
//! is committed. Output is the target's: identical to plain greedy decoding when greedy,
//! and distributed as the target's sampler when sampling.
//!
//! Draft sources ([`DraftKind`]):
//! - `ngram` (prompt lookup): the continuations of earlier occurrences of the context's last
//!   tokens (longest n-gram first, most recent first); no draft model.
//! - `draft:PATH`: another model sharing the vocabulary, on its own tree cache.
//! - `layers:N`: the target's first N layers, a view of the loaded weights.
//!
//! Verification walks the tree from the root: at each node the target's distribution `p`
//! is tried against the node's children in turn (each child token `x` is accepted with
//! probability `p(x)`; when refused, `p` loses `x` and is renormalized), and when no child
//! is accepted the next token is drawn from what is left of `p`. Drafted tokens are
//! deterministic proposals, so this is exact; greedily `p` is the argmax alone.
//!
//! Adaptive: each round drafts the depth that maximizes expected tokens per second, from the
//! measured cost of target rounds by tree size and the recent acceptance at each draft
//! position. When no depth beats a plain step, drafting pauses and then probes again, each
//! pause twice as long as the last (a round that beats plain decoding per token resets
//! it), so a draft that stops paying costs a probe every few hundred tokens at most.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Instant;

use kvplug_core::CacheKind;
use kvplug_runtime::{Batch, Context, Model};

use crate::error::{fail, Result};
use crate::generator::{generate, GenOptions};
use crate::run::{rate, RunReport, RunSpec};
use crate::sampler::{argmax, Sampler};

/// Where draft tokens come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DraftKind {
    /// Prompt lookup: continuations of earlier occurrences of the last tokens.
    Ngram,
    /// Another model directory.
    Model(PathBuf),
    /// The target's first N layers.
    Layers(usize),
}

impl FromStr for DraftKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "ngram" {
            return Ok(DraftKind::Ngram);
        }
        if let Some(p) = s.strip_prefix("draft:").filter(|p| !p.is_empty()) {
            return Ok(DraftKind::Model(PathBuf::from(p)));
        }
        if let Some(n) = s.strip_prefix("layers:") {
            return match n.parse::<usize>() {
                Ok(n) if n > 0 => Ok(DraftKind::Layers(n)),
                _ => Err(format!("'{s}': layers:N needs N >= 1")),
            };
        }
        Err(format!(
            "'{s}' is not a draft source (expected ngram, draft:PATH or layers:N)"
        ))
    }
}

/// Speculative decoding settings: the draft and the largest tree.
#[derive(Clone, Debug)]
pub struct SpecOptions {
    /// The draft source.
    pub draft: DraftKind,
    /// Deepest chain per round.
    pub max_depth: usize,
    /// Most children of the root.
    pub max_width: usize,
}

impl SpecOptions {
    /// Whether the largest draft tree fits beside `spec`'s prompt and answer in its
    /// capacity (and depth and width are at least 1).
    pub fn fits(&self, spec: &RunSpec) -> bool {
        let tree = self
            .max_width
            .checked_mul(self.max_depth)
            .and_then(|n| n.checked_add(1));
        self.max_depth > 0
            && self.max_width > 0
            && tree.is_some_and(|n| spec.prompt.len() + spec.max_new + n <= spec.capacity)
    }
}

/// The longest n-gram prompt lookup tries.
const NGRAM_MAX: usize = 4;
/// The shortest: a single matching token predicts too little.
const NGRAM_MIN: usize = 2;
/// Plain steps a first pause lasts; doubles on each pause that follows, up to `PAUSE_MAX`.
const PAUSE_MIN: usize = 4;
const PAUSE_MAX: usize = 256;

/// One round's tree: node 0 is the root (the last committed token, not yet run).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tree {
    /// Token of each node.
    pub tokens: Vec<i32>,
    /// Parent of each node (`-1` for the root).
    pub parents: Vec<i32>,
    /// Depth of each node (root 0).
    pub depth: Vec<usize>,
}

impl Tree {
    fn root(token: i32) -> Self {
        Tree {
            tokens: vec![token],
            parents: vec![-1],
            depth: vec![0],
        }
    }

    /// Adds `chain` below the root, sharing nodes with chains already there.
    fn insert(&mut self, chain: &[i32]) {
        let mut cur = 0usize;
        for &t in chain {
            cur = match (0..self.tokens.len())
                .find(|&n| self.parents[n] == cur as i32 && self.tokens[n] == t)
            {
                Some(n) => n,
                None => {
                    self.tokens.push(t);
                    self.parents.push(cur as i32);
                    self.depth.push(self.depth[cur] + 1);
                    self.tokens.len() - 1
                }
            };
        }
    }

    fn children(&self, node: usize) -> impl Iterator<Item = usize> + '_ {
        (0..self.tokens.len()).filter(move |&n| self.parents[n] == node as i32)
    }

    /// The deepest chain.
    pub fn max_depth(&self) -> usize {
        self.depth.iter().copied().max().unwrap_or(0)
    }
}

/// Prompt lookup: up to `width` continuations (distinct first tokens, at most `depth` tokens
/// each) of the latest occurrences of the longest suffix of `context` (`NGRAM_MAX` down to
/// `NGRAM_MIN` tokens) found earlier in it, as a tree under `context`'s last token.
pub fn ngram_tree(context: &[i32], depth: usize, width: usize) -> Tree {
    let mut tree = Tree::root(*context.last().expect("a context"));
    let n = context.len();
    for k in (NGRAM_MIN..=NGRAM_MAX.min(n - 1)).rev() {
        let suffix = &context[n - k..];
        let mut firsts = Vec::new();
        // Occurrences ending before the suffix itself, latest first.
        for end in (k..n).rev() {
            if &context[end - k..end] != suffix {
                continue;
            }
            let cont = &context[end..(end + depth).min(n)];
            if cont.is_empty() || firsts.contains(&cont[0]) {
                continue;
            }
            firsts.push(cont[0]);
            tree.insert(cont);
            if firsts.len() == width {
                break;
            }
        }
        if !firsts.is_empty() {
            break;
        }
    }
    tree
}

/// The target's verdict at one node: the accepted child, or none and the token drawn from
/// what is left of the target's distribution.
fn verify_node(
    sampler: &mut Sampler,
    logits: &[f32],
    tree: &Tree,
    node: usize,
) -> (Option<usize>, i32) {
    let mut dist = sampler.distribution(logits);
    for child in tree.children(node) {
        let t = tree.tokens[child];
        let p = dist.iter().find(|d| d.0 == t).map_or(0.0, |d| d.1);
        let total: f32 = dist.iter().map(|d| d.1).sum();
        if sampler.is_greedy() {
            if p > 0.0 {
                return (Some(child), t);
            }
        } else if sampler.coin() * total < p {
            return (Some(child), t);
        }
        dist.retain(|d| d.0 != t);
        if dist.is_empty() {
            // Every token the target allows was drafted and refused: cannot happen with
            // exact arithmetic; take the child (the target's own top choice) to stay total.
            return (Some(child), t);
        }
    }
    let t = sampler.draw(&dist);
    (None, t)
}

/// When to draft, how deep and how wide: the tree that maximizes expected tokens per second,
/// from the measured cost of target rounds by tree size and the recent acceptance of each
/// root branch (by rank) and each deeper draft position. Depth 0 is a plain step.
struct Policy {
    max_depth: usize,
    max_width: usize,
    /// `first[r]`: how often the root's `r`-th branch was accepted when the branches before
    /// it were refused (exponential average).
    first: Vec<f64>,
    /// `deeper[i]`: how often draft token `i + 2` of a chain was accepted when the tokens
    /// before it were.
    deeper: Vec<f64>,
    /// Seconds of a target round by node count (`cost[n]`, exponential average).
    cost: Vec<Option<f64>>,
    /// Plain steps left before the next probe round.
    pause_left: usize,
    next_pause: usize,
    probe: bool,
}

impl Policy {
    fn new(max_depth: usize, max_width: usize) -> Self {
        Policy {
            max_depth,
            max_width,
            first: vec![0.6; max_width],
            deeper: vec![0.6; max_depth],
            cost: vec![None; max_depth * max_width + 2],
            pause_left: 0,
            next_pause: PAUSE_MIN,
            probe: false,
        }
    }

    /// Expected tokens of a round drafting `w` chains of `d` tokens (the bonus included).
    fn expected_tokens(&self, d: usize, w: usize) -> f64 {
        if d == 0 {
            return 1.0;
        }
        let missed: f64 = self.first[..w].iter().map(|a| 1.0 - a).product();
        let mut reach = 1.0 - missed;
        let mut tokens = 1.0 + reach;
        for a in &self.deeper[..d - 1] {
            reach *= a;
            tokens += reach;
        }
        tokens
    }

    /// The measured cost of an `n`-node round, else a straight line from the plain step
    /// through the measured size nearest `n` (before any: a slope of a tenth of a plain step
    /// per node, optimistic enough to get measured).
    fn cost_of(&self, n: usize, plain: f64) -> f64 {
        if let Some(c) = self.cost.get(n).copied().flatten() {
            return c;
        }
        let nearest = (2..self.cost.len())
            .filter_map(|m| self.cost[m].map(|c| (m, c)))
            .min_by_key(|&(m, _)| m.abs_diff(n));
        let slope = nearest.map_or(0.1 * plain, |(m, c)| {
            ((c - plain) / (m - 1) as f64).max(0.0)
        });
        plain + slope * (n - 1) as f64
    }

    /// `(depth, width)` to draft this round (depth 0: a plain step). A plain step comes
    /// first, so there is a cost to compare with.
    fn shape(&mut self) -> (usize, usize) {
        let Some(plain) = self.cost[1] else {
            return (0, 1);
        };
        if self.pause_left > 0 {
            self.pause_left -= 1;
            self.probe = self.pause_left == 0;
            return (0, 1);
        }
        let rate =
            |(d, w): (usize, usize)| self.expected_tokens(d, w) / self.cost_of(1 + d * w, plain);
        // The first best: on a tie, the shallower and narrower tree.
        let best = (1..=self.max_depth)
            .flat_map(|d| (1..=self.max_width).map(move |w| (d, w)))
            .fold(
                (0, 1),
                |best, x| if rate(x) > rate(best) { x } else { best },
            );
        let deepest_single = (1..=self.max_depth).map(|d| (d, 1)).fold((1, 1), |b, x| {
            if rate(x) > rate(b) {
                x
            } else {
                b
            }
        });
        let probe = std::mem::take(&mut self.probe);
        if best.0 > 0 {
            return best;
        }
        if probe {
            return deepest_single;
        }
        // Drafting does not pay now: plain steps (this one first), then a probe; each pause
        // twice as long as the last.
        self.pause_left = self.next_pause - 1;
        self.next_pause = (self.next_pause * 2).min(PAUSE_MAX);
        (0, 1)
    }

    /// A round of `nodes` target nodes took `seconds`; its root had `branches` children, the
    /// one of rank `rank` was accepted (`None`: none), and `accepted` tokens of a chain of
    /// `depth` were accepted.
    fn observe(
        &mut self,
        seconds: f64,
        nodes: usize,
        branches: usize,
        rank: Option<usize>,
        depth: usize,
        accepted: usize,
    ) {
        if let Some(c) = self.cost.get_mut(nodes) {
            *c = Some(ema(*c, seconds));
        }
        let tried = rank.map_or(branches, |r| r + 1).min(self.max_width);
        for r in 0..tried {
            let hit = if Some(r) == rank { 1.0 } else { 0.0 };
            self.first[r] = 0.8 * self.first[r] + 0.2 * hit;
        }
        for i in 1..depth.min(accepted + 1).min(self.max_depth) {
            let hit = if i < accepted { 1.0 } else { 0.0 };
            self.deeper[i - 1] = 0.8 * self.deeper[i - 1] + 0.2 * hit;
        }
        // A round that beat plain decoding per token ends the doubling of pauses.
        let plain = self.cost[1].unwrap_or(f64::INFINITY);
        if depth > 0 && seconds / ((accepted + 1) as f64) < plain {
            self.next_pause = PAUSE_MIN;
        }
    }
}

fn ema(prev: Option<f64>, x: f64) -> f64 {
    prev.map_or(x, |p| 0.7 * p + 0.3 * x)
}

/// Every token of `tokens` at `positions` (sequence 0), each wanting its logits (a tree
/// round: every node is verified).
fn every_row(tokens: &[i32], positions: &[i32]) -> Batch {
    let mut b = Batch::new();
    for (&t, &p) in tokens.iter().zip(positions) {
        b.push(t, p, 0, true);
    }
    b
}

/// Writes `tokens` at positions `start..` of `ctx` (a prefill, nothing sampled).
fn prefill(ctx: &mut Context, tokens: &[i32], start: usize) -> Result<()> {
    generate(
        ctx,
        None,
        0,
        tokens,
        start,
        GenOptions::default(),
        &mut |_| Ok(()),
    )?;
    Ok(())
}

/// A draft model on its own tree cache, caught up lazily with the committed tokens.
struct ModelDraft {
    ctx: Context,
    /// Committed tokens its cache holds.
    len: usize,
}

impl ModelDraft {
    /// A tree of `width` best children of the root, each extended greedily to `depth`, one
    /// draft forward per level; `context` ends with the root at position `base`.
    fn tree(&mut self, context: &[i32], base: usize, depth: usize, width: usize) -> Result<Tree> {
        if self.len < base {
            prefill(&mut self.ctx, &context[self.len..base], self.len)?;
            self.len = base;
        }
        let root = context[base];
        let mut tree = Tree::root(root);
        self.ctx.propose(&[-1])?;
        let mut level = vec![0usize];
        let mut logits: Vec<Vec<f32>> = self
            .ctx
            .decode(&every_row(&[root], &[base as i32]))?
            .rows()
            .map(<[f32]>::to_vec)
            .collect();
        for d in 1..=depth {
            let mut next = Vec::new();
            for (li, &node) in level.iter().enumerate() {
                let l = &logits[li];
                let picks: Vec<i32> = if d == 1 {
                    let mut order: Vec<usize> = (0..l.len()).collect();
                    order.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
                    order.iter().take(width).map(|&i| i as i32).collect()
                } else {
                    vec![argmax(l)]
                };
                for t in picks {
                    next.push(tree.tokens.len());
                    tree.tokens.push(t);
                    tree.parents.push(node as i32);
                    tree.depth.push(d);
                }
            }
            let parents: Vec<i32> = next.iter().map(|&n| tree.parents[n]).collect();
            self.ctx.propose(&parents)?;
            let tokens: Vec<i32> = next.iter().map(|&n| tree.tokens[n]).collect();
            let pos: Vec<i32> = next
                .iter()
                .map(|&n| (base + tree.depth[n]) as i32)
                .collect();
            logits = self
                .ctx
                .decode(&every_row(&tokens, &pos))?
                .rows()
                .map(<[f32]>::to_vec)
                .collect();
            level = next;
        }
        Ok(tree)
    }

    /// Commits the accepted chain of the tree it proposed.
    fn commit(&mut self, chain: &[i32], base: usize) -> Result<()> {
        self.ctx.commit(chain)?;
        self.len = base + chain.len();
        Ok(())
    }
}

/// Speculative decoding of `spec` on `model` with `opts`, drawing with `sampler` (greedy or
/// not).
pub fn run_speculative(
    model: &Model,
    spec: &RunSpec,
    opts: &SpecOptions,
    sampler: &mut Sampler,
) -> Result<RunReport> {
    spec.check()?;
    let (depth_max, width_max) = (opts.max_depth, opts.max_width);
    if !opts.fits(spec) {
        fail!(
            Invalid,
            "draft trees of depth {depth_max} × width {width_max} (both at least 1) do not fit \
             beside the prompt ({}) and max_new ({}) in the capacity {}",
            spec.prompt.len(),
            spec.max_new,
            spec.capacity
        );
    }
    let mut tgt = model.context(CacheKind::Tree, spec.capacity, spec.kv_dtype)?;
    let mut draft = match &opts.draft {
        DraftKind::Ngram => None,
        DraftKind::Model(_) | DraftKind::Layers(_) => {
            let m = match &opts.draft {
                // Loaded and keyed as the target is.
                DraftKind::Model(path) => {
                    crate::formats::open_model(model.runtime(), model.backend(), path)?
                        .with_key_rotation(model.key_rotation())
                        .with_mmap(model.mmap())
                        .with_attention(model.attention())
                }
                DraftKind::Layers(n) => model
                    .layers(*n)
                    .map_err(|e| crate::Error::from(e).context(format!("draft layers:{n}")))?,
                DraftKind::Ngram => unreachable!(),
            };
            if m.vocab() != model.vocab() {
                fail!(
                    Invalid,
                    "the draft model {} has a vocabulary of {} tokens, the target {} has {}: a \
                     draft must share the target's tokenizer",
                    m.dir().display(),
                    m.vocab(),
                    model.dir().display(),
                    model.vocab()
                );
            }
            Some(ModelDraft {
                ctx: m.context(CacheKind::Tree, spec.capacity, spec.kv_dtype)?,
                len: 0,
            })
        }
    };
    let p = spec.prompt.len();
    let t0 = Instant::now();
    if p > 1 {
        prefill(&mut tgt, &spec.prompt[..p - 1], 0)?;
    }
    let prefill_tok_s = rate(p - 1, t0);
    // `context` ends with the root: committed tokens plus the one not yet run.
    let mut context = spec.prompt.clone();
    let mut base = p - 1;
    let mut policy = Policy::new(depth_max, width_max);
    let (mut accepted_total, mut drafted_total, mut target_forwards) = (0usize, 0usize, 0usize);
    let t1 = Instant::now();
    let generated = |context: &[i32]| context.len() - p;
    while generated(&context) < spec.max_new {
        let round = Instant::now();
        let (depth, width) = policy.shape();
        let depth = depth.min(spec.max_new - generated(&context));
        let tree = match (depth, draft.as_mut()) {
            (0, _) => Tree::root(context[base]),
            (d, None) => ngram_tree(&context, d, width),
            (d, Some(m)) => m.tree(&context, base, d, width)?,
        };
        let positions: Vec<i32> = tree.depth.iter().map(|&d| (base + d) as i32).collect();
        let speculative = tree.tokens.len() > 1;
        if speculative {
            tgt.propose(&tree.parents)?;
        }
        let logits = tgt.decode(&every_row(&tree.tokens, &positions))?;
        target_forwards += 1;
        let (mut chain, mut cur) = (vec![0i32], 0usize);
        let next = loop {
            match verify_node(sampler, logits.row(cur), &tree, cur) {
                (Some(child), _) => {
                    chain.push(child as i32);
                    cur = child;
                }
                (None, t) => break t,
            }
        };
        tracing::debug!(
            nodes = tree.tokens.len(),
            depth = tree.max_depth(),
            accepted = chain.len() - 1,
            ms = round.elapsed().as_secs_f64() * 1e3,
            "speculative round"
        );
        if speculative {
            tgt.commit(&chain)?;
            if let Some(m) = draft.as_mut() {
                m.commit(&chain, base)?;
            }
            accepted_total += chain.len() - 1;
            drafted_total += tree.max_depth();
        }
        let roots: Vec<usize> = tree.children(0).collect();
        policy.observe(
            round.elapsed().as_secs_f64(),
            tree.tokens.len(),
            roots.len(),
            chain
                .get(1)
                .and_then(|&c| roots.iter().position(|&r| r == c as usize)),
            tree.max_depth(),
            chain.len() - 1,
        );
        context.extend(chain[1..].iter().map(|&n| tree.tokens[n as usize]));
        context.push(next);
        base += chain.len();
        if context[p..].iter().any(|t| spec.stop.contains(t)) {
            break;
        }
    }
    let mut ids = context[p..].to_vec();
    if let Some(end) = ids.iter().position(|t| spec.stop.contains(t)) {
        ids.truncate(end + 1);
    }
    ids.truncate(spec.max_new);
    Ok(RunReport {
        mode: "speculative".into(),
        decode_tok_s: rate(ids.len(), t1),
        prefill_tok_s,
        cache: tgt.stats()?.into(),
        tokens_per_target_forward: Some(ids.len() as f64 / target_forwards.max(1) as f64),
        ids,
        branches: None,
        winner: None,
        acceptance: Some(accepted_total as f64 / drafted_total.max(1) as f64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draft_kinds_parse() {
        assert_eq!("ngram".parse(), Ok(DraftKind::Ngram));
        assert_eq!("layers:3".parse(), Ok(DraftKind::Layers(3)));
        assert_eq!("draft:/m".parse(), Ok(DraftKind::Model("/m".into())));
        for bad in ["layers:0", "layers:x", "draft:", "medusa"] {
            assert!(bad.parse::<DraftKind>().is_err(), "{bad}");
        }
    }

    #[test]
    fn prompt_lookup_continues_the_latest_occurrences() {
        // "a b c d ... a b c e ... a b c" → after "a b c": "e" (latest), then "d".
        let ctx = [1, 2, 3, 4, 9, 1, 2, 3, 5, 8, 1, 2, 3];
        let t = ngram_tree(&ctx, 2, 2);
        assert_eq!(t.tokens, [3, 5, 8, 4, 9]);
        assert_eq!(t.parents, [-1, 0, 1, 0, 3]);
        assert_eq!(t.max_depth(), 2);
        // No earlier occurrence of the last token: the root alone.
        assert_eq!(ngram_tree(&[1, 2, 3], 4, 2).tokens, [3]);
        // Continuations stop at the end of the context.
        let t = ngram_tree(&[7, 8, 9, 7, 8], 5, 1);
        assert_eq!(t.tokens, [8, 9, 7, 8]);
        // A single matching token is not enough.
        assert_eq!(ngram_tree(&[5, 1, 6, 1], 3, 1).tokens, [1]);
    }

    /// Target distribution p over 4 tokens; a tree proposing tokens 2 then 0 at the root.
    /// The emitted first token must be distributed as p whatever was proposed.
    #[test]
    fn acceptance_keeps_the_target_distribution() {
        let logits = [1.0f32, 0.2, 2.0, -0.5];
        let mut tree = Tree::root(9);
        tree.insert(&[2]);
        tree.insert(&[0]);
        let mut sampler = Sampler::new(1.0, 1.0, 42);
        let p = sampler.distribution(&logits);
        let n = 200_000;
        let mut counts = [0usize; 4];
        for _ in 0..n {
            let (child, t) = verify_node(&mut sampler, &logits, &tree, 0);
            if let Some(c) = child {
                assert_eq!(tree.tokens[c], t);
            }
            counts[t as usize] += 1;
        }
        for &(t, pt) in &p {
            let pt = pt as f64;
            let sigma = (pt * (1.0 - pt) / n as f64).sqrt();
            let got = counts[t as usize] as f64 / n as f64;
            // Five standard deviations of a binomial proportion.
            assert!((got - pt).abs() < 5.0 * sigma, "token {t}: {got} vs {pt}");
        }
        // Greedy: the argmax child is accepted, anything else refused.
        let mut g = Sampler::new(0.0, 1.0, 0);
        assert_eq!(verify_node(&mut g, &logits, &tree, 0), (Some(1), 2));
        let mut other = Tree::root(9);
        other.insert(&[0]);
        assert_eq!(verify_node(&mut g, &logits, &other, 0), (None, 2));
    }

    #[test]
    fn the_policy_drafts_only_when_it_pays() {
        let mut p = Policy::new(8, 2);
        assert_eq!(p.shape(), (0, 1), "a plain step is measured first");
        p.observe(0.010, 1, 0, None, 0, 0);
        // Unmeasured rounds look cheap: draft.
        assert!(p.shape().0 > 0);
        // Rounds of 2+ nodes cost 4x a plain step and nothing is accepted: stop drafting.
        for n in 2..=17 {
            p.observe(0.040, n, 1, None, n - 1, 0);
        }
        assert_eq!(p.shape().0, 0);
        assert!((0..PAUSE_MIN - 1).all(|_| p.shape().0 == 0));
        assert!(p.shape().0 > 0, "a probe after the pause");
        p.observe(0.040, 2, 1, None, 1, 0);
        assert!(
            (0..2 * PAUSE_MIN).all(|_| p.shape().0 == 0),
            "the next pause is longer"
        );
        // Cheap rounds that are accepted make drafting pay again, deep and narrow.
        let mut q = Policy::new(8, 2);
        q.observe(0.010, 1, 0, None, 0, 0);
        for _ in 0..20 {
            for n in 2..=17 {
                let secs = 0.010 + 0.0002 * n as f64;
                q.observe(secs, n, 1, Some(0), (n - 1).min(8), (n - 1).min(8));
            }
        }
        assert_eq!(q.shape(), (8, 1));
        // On a device where a 4-node round costs 4 plain steps, one failed round is enough to
        // stop: deeper trees are priced along that line, not tried one by one.
        let mut slow = Policy::new(8, 1);
        slow.observe(0.010, 1, 0, None, 0, 0);
        assert_eq!(slow.shape(), (3, 1));
        slow.observe(0.040, 4, 1, None, 3, 0);
        assert_eq!(slow.shape(), (0, 1));
        // A probe that is accepted but costs more per token than a plain step does not end
        // the doubling of pauses.
        assert!((0..PAUSE_MIN - 1).all(|_| slow.shape().0 == 0));
        let (d, _) = slow.shape();
        assert!(d > 0, "a probe");
        slow.observe(0.010 * (d + 1) as f64, d + 1, 1, Some(0), d, 1);
        assert!((0..2 * PAUSE_MIN).all(|_| slow.shape().0 == 0));
        // When the first branch keeps missing and the second hits, two branches pay.
        let mut r = Policy::new(3, 2);
        r.observe(0.010, 1, 0, None, 0, 0);
        for _ in 0..30 {
            for n in 2..=7 {
                r.observe(0.010, n, 2, Some(1), 1, 1);
            }
        }
        assert_eq!(r.shape().1, 2);
    }
}
