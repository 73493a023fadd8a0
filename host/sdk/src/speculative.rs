//! Speculative decoding inside the [`Generator`](crate::Generator): a request that asks for
//! it ([`GenOptions::speculate`](crate::GenOptions::speculate)) feeds, each decode step, its
//! last token followed by draft tokens, and the target verifies them all in that one
//! forward. Output is the target's: identical to plain decoding when greedy, and
//! distributed as the target's sampler (its adjustments and grammar included) when not.
//!
//! Draft sources ([`Draft`]):
//! - `ngram` (prompt lookup): the continuations of earlier occurrences of the sequence's last
//!   tokens (longest n-gram first, most recent first); no draft model.
//! - `draft:PATH`: another model sharing the vocabulary, on its own tree cache.
//! - `layers:N`: the target's first N layers, a view of the loaded weights.
//!
//! Verification samples each drafted position's row as plain decoding would (the request's
//! sampler, adjustments, grammar, stop checks and logprobs) and follows the drafted child
//! holding the sampled token; where none does, the sampled token is the round's last. A
//! drafted token is a deterministic proposal, so it is accepted exactly with the target's
//! probability of it, and the tokens come out as plain decoding would draw them (the same
//! draws of a seeded sampler).
//!
//! The cache decides the draft's shape. A tree cache verifies a tree (`propose`, then
//! `commit` of the accepted chain). A contiguous or seq cache verifies a chain and drops
//! the refused tail (`rewind`, `seq_rm`); where it cannot cut inside the step (a recurrent
//! layer keeps the state of at most `CHAIN_ANCHORS` tokens of a step's chains; another
//! backend's cache may keep none) it drops the whole step and the accepted tokens are
//! written again in a second forward of the same step.
//!
//! Adaptive: each round drafts the depth that maximizes expected tokens per second, from the
//! measured cost of steps by draft size and the recent acceptance at each draft position.
//! When no depth beats a plain step, drafting pauses and then probes again, each pause
//! twice as long as the last (a round that beats plain decoding per token resets it), so a
//! draft that stops paying costs a probe every few hundred tokens at most. Every
//! [`EXPLORE_EVERY`]-th drafting round drafts one level deeper than the best, so that a
//! depth once measured slow (a busy machine) or never tried is measured again. No request drafts
//! in a step that prefills a prompt (the step is the prompt's), nor beyond the cache's room.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use kvplug_core::CacheKind;
use kvplug_plugin_api::AbiErrorKind;
use kvplug_runtime::{Batch, Context, Model};

use crate::error::{fail, Result};
use crate::generator::{generate, GenOptions};
use crate::sampler::argmax;

/// Where draft tokens come from, as a user names it (`ngram`, `draft:PATH`, `layers:N`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DraftKind {
    /// Prompt lookup: continuations of earlier occurrences of the last tokens.
    Ngram,
    /// Another model (a directory or a GGUF file).
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

impl fmt::Display for DraftKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DraftKind::Ngram => f.write_str("ngram"),
            DraftKind::Model(p) => write!(f, "draft:{}", p.display()),
            DraftKind::Layers(n) => write!(f, "layers:{n}"),
        }
    }
}

/// A draft source, ready: prompt lookup or a loaded draft model.
#[derive(Clone)]
pub enum Draft {
    /// Prompt lookup over the sequence's tokens.
    Ngram,
    /// A model sharing the target's vocabulary (each request drafts on its own tree cache
    /// of it, as large as the target's cache).
    Model(Model),
}

impl fmt::Debug for Draft {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Draft::Ngram => f.write_str("Ngram"),
            Draft::Model(m) => write!(f, "Model({})", m.dir().display()),
        }
    }
}

impl Draft {
    /// Opens `kind` for `target`: a draft model is loaded on the target's backend and keyed,
    /// mapped and computed as the target is; `layers:N` is a view of the target's weights.
    /// Refuses a draft whose vocabulary differs from the target's.
    pub fn open(kind: &DraftKind, target: &Model) -> Result<Draft> {
        let m = match kind {
            DraftKind::Ngram => return Ok(Draft::Ngram),
            DraftKind::Model(path) => crate::Llm::builder(path)
                .runtime(target.runtime())
                .backend(target.backend())
                .key_rotation(target.key_rotation())
                .mmap(target.mmap())
                .attention(target.attention())
                .build_model()?,
            DraftKind::Layers(n) => target
                .layers(*n)
                .map_err(|e| crate::Error::from(e).context(format!("draft layers:{n}")))?,
        };
        if m.vocab() != target.vocab() {
            fail!(
                Invalid,
                "the draft model {} has a vocabulary of {} tokens, the target {} has {}: a \
                 draft must share the target's tokenizer",
                m.source().display(),
                m.vocab(),
                target.source().display(),
                target.vocab()
            );
        }
        Ok(Draft::Model(m))
    }
}

/// How a request speculates.
#[derive(Clone, Debug)]
pub struct Speculation {
    /// The draft source.
    pub draft: Draft,
    /// Deepest chain per round (the depth adapts below it).
    pub max_depth: usize,
    /// Shallowest chain per round, where the room allows (llama.cpp's `--draft-min`): 0
    /// lets the policy pause drafting that does not pay.
    pub min_depth: usize,
    /// Most children of the root (above 1 only on a tree cache; others verify one chain).
    pub max_width: usize,
    /// The sequence's tokens before the request's `start`: all of them, or none (prompt
    /// lookup then searches the request's own tokens only; a draft model needs them all).
    pub earlier: Vec<i32>,
}

impl Speculation {
    /// Drafts of `draft`, chains up to 8 deep, one branch.
    pub fn new(draft: Draft) -> Self {
        Speculation {
            draft,
            max_depth: 8,
            min_depth: 0,
            max_width: 1,
            earlier: Vec::new(),
        }
    }

    /// Prompt lookup (see [`Speculation::new`]).
    pub fn ngram() -> Self {
        Speculation::new(Draft::Ngram)
    }

    /// Refuses a depth or width of 0 or above [`MAX_DRAFT_DEPTH`] / [`MAX_DRAFT_WIDTH`], and
    /// a least depth above the depth.
    pub fn check(&self) -> Result<()> {
        let (d, w, least) = (self.max_depth, self.max_width, self.min_depth);
        if !(1..=MAX_DRAFT_DEPTH).contains(&d) || !(1..=MAX_DRAFT_WIDTH).contains(&w) || least > d {
            fail!(
                Invalid,
                "speculation takes a draft depth of 1..={MAX_DRAFT_DEPTH}, a width of \
                 1..={MAX_DRAFT_WIDTH} and a least depth of at most the depth (got --depth {d}, \
                 --width {w}, least depth {least})"
            );
        }
        Ok(())
    }
}

/// The deepest draft chain a request may ask for (llama.cpp's default `--draft-max` is 16).
pub const MAX_DRAFT_DEPTH: usize = 64;
/// The most branches from a draft tree's root.
pub const MAX_DRAFT_WIDTH: usize = 16;

/// What speculation did for one request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SpecStats {
    /// Decode steps, plain or drafting (each one target forward).
    pub steps: usize,
    /// Draft tokens verified (the deepest chain of each round).
    pub drafted: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
}

impl SpecStats {
    /// Accepted draft tokens per drafted one (0 when nothing was drafted).
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }

    /// Adds `other`'s counts.
    pub fn add(&mut self, other: &SpecStats) {
        self.steps += other.steps;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
    }
}

/// The longest n-gram prompt lookup tries.
const NGRAM_MAX: usize = 4;
/// The shortest: a single matching token predicts too little.
const NGRAM_MIN: usize = 2;
/// Plain steps a first pause lasts; doubles on each pause that follows, up to `PAUSE_MAX`.
const PAUSE_MIN: usize = 4;
const PAUSE_MAX: usize = 256;
/// Drafting rounds between two that draft one level deeper than the best, so that the cost
/// and acceptance there are measured again (one slow round is not the last word).
const EXPLORE_EVERY: usize = 8;

/// One round's tree: node 0 is the root (the last committed token, not yet run).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Tree {
    /// Token of each node.
    pub tokens: Vec<i32>,
    /// Parent of each node (`-1` for the root).
    pub parents: Vec<i32>,
    /// Depth of each node (root 0).
    pub depth: Vec<usize>,
}

impl Tree {
    fn root(token: i32) -> Self {
        let mut t = Tree::default();
        t.reset(token);
        t
    }

    /// The root alone.
    fn reset(&mut self, token: i32) {
        self.tokens.clear();
        self.parents.clear();
        self.depth.clear();
        self.tokens.push(token);
        self.parents.push(-1);
        self.depth.push(0);
    }

    /// Adds `chain` below the root, sharing nodes with chains already there.
    fn insert(&mut self, chain: &[i32]) {
        let mut cur = 0usize;
        for &t in chain {
            cur = match self.child(cur, t) {
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

    /// The child of `node` holding `token`.
    fn child(&self, node: usize, token: i32) -> Option<usize> {
        (node + 1..self.tokens.len())
            .find(|&n| self.parents[n] == node as i32 && self.tokens[n] == token)
    }

    fn children(&self, node: usize) -> impl Iterator<Item = usize> + '_ {
        (0..self.tokens.len()).filter(move |&n| self.parents[n] == node as i32)
    }

    /// The deepest chain.
    pub fn max_depth(&self) -> usize {
        self.depth.iter().copied().max().unwrap_or(0)
    }
}

/// Prompt lookup into `tree` (its buffers reused): up to `width` continuations (distinct
/// first tokens, at most `depth` tokens each) of the latest occurrences of the longest
/// suffix of `context` (`NGRAM_MAX` down to `NGRAM_MIN` tokens) found earlier in it, as a
/// tree under `context`'s last token.
fn ngram_into(tree: &mut Tree, context: &[i32], depth: usize, width: usize) {
    tree.reset(*context.last().expect("a context"));
    let n = context.len();
    for k in (NGRAM_MIN..=NGRAM_MAX.min(n - 1)).rev() {
        let suffix = &context[n - k..];
        let mut found = 0;
        // Occurrences ending before the suffix itself, latest first.
        for end in (k..n).rev() {
            if &context[end - k..end] != suffix {
                continue;
            }
            let cont = &context[end..(end + depth).min(n)];
            if cont.is_empty() || tree.child(0, cont[0]).is_some() {
                continue;
            }
            tree.insert(cont);
            found += 1;
            if found == width {
                break;
            }
        }
        if found > 0 {
            break;
        }
    }
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
    /// Drafting rounds left before the next that explores one level deeper (0: it is due).
    explore_in: usize,
    /// The depth an exploring round asked for (0: none); due until a round drafts it.
    exploring: usize,
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
            explore_in: EXPLORE_EVERY,
            exploring: 0,
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
            if self.explore_in == 0 && best.0 < self.max_depth {
                self.exploring = best.0 + 1;
                return (self.exploring, best.1);
            }
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
        // A drafting round counts down to the next exploring one, which is due until a round
        // drafts as deep as it asked (prompt lookup may find a shorter continuation). Its cost
        // replaces what was known of its size: it was run to measure that again.
        let explored = depth > 0 && self.exploring > 0 && depth >= self.exploring;
        if explored {
            (self.explore_in, self.exploring) = (EXPLORE_EVERY, 0);
        } else if depth > 0 {
            self.explore_in = self.explore_in.saturating_sub(1);
        }
        if let Some(c) = self.cost.get_mut(nodes) {
            *c = Some(if explored { seconds } else { ema(*c, seconds) });
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

/// One request's speculation inside the generator: its draft, its policy, and the tree of
/// the step in flight.
pub(crate) struct Speculator {
    /// The most nodes a tree may have besides its root.
    max_nodes: usize,
    min_depth: usize,
    /// Whether its cache can verify drafts (known from the first decode step): a contiguous
    /// or seq cache whose model has sliding-window layers cannot cut a refused tail (see
    /// [`Speculator::draft`]).
    verifies: Option<bool>,
    /// The draft model until its context is made on the first round.
    draft_model: Option<Model>,
    model_draft: Option<ModelDraft>,
    policy: Policy,
    /// The sequence's tokens from position `offset` (0 when the request gave its earlier
    /// tokens), through the root once synced; `synced` of the request's generated ids are in.
    lookup: Vec<i32>,
    offset: usize,
    synced: usize,
    /// The step's tree, its root's position, whether a tree cache holds it as a proposal,
    /// and the nodes whose rows were sampled (root first).
    tree: Tree,
    base: usize,
    proposed: bool,
    path: Vec<i32>,
    stats: SpecStats,
}

impl Speculator {
    /// Speculation `s` for a request of `prompt` at position `start`.
    pub(crate) fn new(s: &Speculation, prompt: &[i32], start: usize) -> Result<Self> {
        s.check()?;
        let whole = s.earlier.len() == start;
        if !s.earlier.is_empty() && !whole {
            fail!(
                Invalid,
                "speculation's earlier tokens ({}) must be the whole sequence before the \
                 request's start ({start})",
                s.earlier.len()
            );
        }
        let draft_model = match &s.draft {
            Draft::Ngram => None,
            Draft::Model(_) if !whole => fail!(
                Invalid,
                "a draft model needs the sequence's {start} earlier tokens (Speculation::earlier)"
            ),
            Draft::Model(m) => Some(m.clone()),
        };
        let mut lookup = s.earlier.clone();
        lookup.extend_from_slice(prompt);
        Ok(Speculator {
            max_nodes: s.max_depth * s.max_width,
            min_depth: s.min_depth,
            verifies: None,
            draft_model,
            model_draft: None,
            policy: Policy::new(s.max_depth, s.max_width),
            lookup,
            offset: if whole { 0 } else { start },
            synced: 0,
            tree: Tree::default(),
            base: 0,
            proposed: false,
            path: Vec::new(),
            stats: SpecStats::default(),
        })
    }

    /// The most nodes a tree may have besides its root.
    pub(crate) fn max_nodes(&self) -> usize {
        self.max_nodes
    }

    /// What it did so far.
    pub(crate) fn stats(&self) -> SpecStats {
        self.stats
    }

    /// Drafts this step's tree under the request's last generated id (the root, at position
    /// `base`): at most `room` nodes besides the root, at most `remaining - 1` deep (the
    /// request samples at most `remaining` more tokens). On a tree cache the tree is
    /// proposed; elsewhere it is one chain. Returns the tree: feed node `n` at position
    /// `base + depth[n]`, every row wanting logits.
    pub(crate) fn draft(
        &mut self,
        ctx: &Context,
        generated: &[i32],
        base: usize,
        remaining: usize,
        room: usize,
    ) -> Result<&Tree> {
        self.lookup.extend_from_slice(&generated[self.synced..]);
        self.synced = generated.len();
        debug_assert_eq!(self.offset + self.lookup.len(), base + 1);
        let tree_cache = ctx.kind() == CacheKind::Tree;
        // A sliding-window layer frees the rows that leave the window after every step, so
        // a seq or contiguous cache cannot cut back a refused tail there (the rows before it
        // are gone): such a request decodes plainly. A tree cache commits the accepted
        // chain before anything is freed.
        let verifies = match self.verifies {
            Some(v) => v,
            None => {
                let v = tree_cache || ctx.stats()?.window_cells == 0;
                if !v {
                    tracing::debug!(
                        "a sliding-window model on a {} cache: no drafts",
                        ctx.kind()
                    );
                }
                *self.verifies.insert(v)
            }
        };
        let (depth, width) = match verifies {
            true => self.policy.shape(),
            false => (0, 1),
        };
        let depth = if verifies {
            depth.max(self.min_depth)
        } else {
            0
        };
        let width = if tree_cache {
            width.min(room.max(1))
        } else {
            1
        };
        let depth = depth.min(remaining.saturating_sub(1)).min(room / width);
        let root = *generated.last().expect("a decoding request has sampled");
        self.base = base;
        self.path.clear();
        if depth > 0 && self.model_draft.is_none() {
            if let Some(m) = self.draft_model.take() {
                self.model_draft = Some(ModelDraft {
                    ctx: m.context(CacheKind::Tree, ctx.capacity(), ctx.kv_dtype())?,
                    len: 0,
                });
            }
        }
        if depth == 0 {
            self.tree.reset(root);
        } else if let Some(m) = self.model_draft.as_mut() {
            self.tree = m.tree(&self.lookup, base, depth, width)?;
        } else {
            ngram_into(&mut self.tree, &self.lookup, depth, width);
        }
        self.proposed = tree_cache && self.tree.tokens.len() > 1;
        if self.proposed {
            ctx.propose(&self.tree.parents)?;
        }
        Ok(&self.tree)
    }

    /// Verification sampled node `node`'s row and drew `token`: the child holding it, to
    /// sample next.
    pub(crate) fn follow(&mut self, node: usize, token: i32) -> Option<usize> {
        self.path.push(node as i32);
        self.tree.child(node, token)
    }

    /// After verification: the cache keeps the root and the accepted chain only (the
    /// sampled nodes). Where it cannot cut inside the step, the step's rows are dropped and
    /// the chain is pushed to `refeed`, to be written again.
    pub(crate) fn settle(&mut self, ctx: &Context, seq: i32, refeed: &mut Batch) -> Result<()> {
        let fed = self.tree.tokens.len();
        if self.proposed {
            ctx.commit(&self.path)?;
        } else if fed > self.path.len() {
            match cut(ctx, seq, self.base + self.path.len()) {
                Ok(()) => {}
                Err(e) if e.kind == AbiErrorKind::OutOfWindow => {
                    cut(ctx, seq, self.base)?;
                    for (k, &n) in self.path.iter().enumerate() {
                        let pos = (self.base + k) as i32;
                        refeed.push(self.tree.tokens[n as usize], pos, seq, false);
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        if let (Some(m), true) = (self.model_draft.as_mut(), fed > 1) {
            m.commit(&self.path, self.base)?;
        }
        Ok(())
    }

    /// The step took `seconds`: the policy learns its cost and what was accepted.
    pub(crate) fn observe(&mut self, seconds: f64) {
        let accepted = self.path.len().saturating_sub(1);
        let depth = self.tree.max_depth();
        let first = self.path.get(1).map(|&n| n as usize);
        let (mut branches, mut rank) = (0, None);
        for (r, c) in self.tree.children(0).enumerate() {
            branches += 1;
            if Some(c) == first {
                rank = Some(r);
            }
        }
        self.policy.observe(
            seconds,
            self.tree.tokens.len(),
            branches,
            rank,
            depth,
            accepted,
        );
        self.stats.steps += 1;
        if depth > 0 {
            self.stats.drafted += depth;
            self.stats.accepted += accepted;
        }
    }
}

/// Drops `seq`'s positions from `keep` on (a contiguous cache holds sequence 0 only).
fn cut(ctx: &Context, seq: i32, keep: usize) -> Result<(), kvplug_plugin_api::PluginError> {
    match ctx.kind() {
        CacheKind::Seq => ctx.seq_rm(seq, Some(keep as i32), None),
        _ => ctx.rewind(keep),
    }
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

    fn ngram_tree(context: &[i32], depth: usize, width: usize) -> Tree {
        let mut tree = Tree::default();
        ngram_into(&mut tree, context, depth, width);
        tree
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

    #[test]
    fn one_slow_round_does_not_keep_the_policy_shallow() {
        // Every draft accepted; a round costs a plain step and a fifth of one per node, but
        // the first 4-node round ran while the machine was busy (ten times that).
        let mut p = Policy::new(8, 1);
        let cost = |n: usize| 0.010 + 0.002 * (n - 1) as f64;
        p.observe(cost(1), 1, 0, None, 0, 0);
        for n in 2..=3 {
            p.observe(cost(n), n, 1, Some(0), n - 1, n - 1);
        }
        p.observe(10.0 * cost(4), 4, 1, Some(0), 3, 3);
        let mut depths = Vec::new();
        for _ in 0..10 * EXPLORE_EVERY {
            let (d, w) = p.shape();
            p.observe(cost(1 + d * w), 1 + d * w, 1, Some(0), d, d);
            depths.push(d);
        }
        assert!(
            depths[0] < 3,
            "the slow round is believed at first: {depths:?}"
        );
        assert!(
            depths[8 * EXPLORE_EVERY..].iter().all(|&d| d == 8),
            "rounds one level deeper now and then find the true cost: {depths:?}"
        );
    }
}
