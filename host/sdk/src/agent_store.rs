//! [`AgentStore`]: agents that call the model again and again over shared context, on one
//! seq cache, with their K/V kept across calls in two tiers (seed 002's AgentCacheStore).
//!
//! - **Reuse.** A request's prompt takes the longest prefix any earlier request left in the
//!   cache's prefix index (zero-copy: the cells join its sequence) and prefills only the
//!   rest. Everything a request's sequence ends up holding is published to the index.
//! - **Hot tier.** A named agent keeps its sequence between calls; its next prompt reuses
//!   its whole history up to where the prompt departs from it.
//! - **Warm tier.** When a request needs cells the cache (its capacity is the memory
//!   budget) cannot free by evicting unheld prefixes, the least recently used idle agent is
//!   written to its session file and its sequence released; its next request restores it
//!   from the file (beyond what the prefix index still holds) instead of prefilling.
//! - **Model-tagged.** Files are named by agent and model fingerprint
//!   (`AGENT.<first 16 hex>.kvsession.safetensors`), so a store for another model never
//!   loads them and a store for the same model finds them again after a swap or a restart.
//! - **Bounded.** The warm tier's files (every model's, in the directory) stay within
//!   [`WarmLimits`]: those idle longer than its TTL are removed, then the least recently
//!   parked until the rest fit its disk budget. A removed agent's next request prefills.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use kvplug_core::{CacheKind, KvDtype, MAX_SEQS};
use kvplug_plugin_api::AbiErrorKind;
use kvplug_runtime::{Context as RtContext, Model};

use crate::error::{fail, Context, Result};
use crate::fingerprint::model_fingerprint;
use crate::generator::{generate, Finish, GenOptions};
use crate::sampler::Sampler;
use crate::session_file::{self, Session, SessionFileError, EXTENSION};
use crate::speculative::SpecStats;

/// How a store runs.
pub struct AgentStoreOptions {
    /// Cache capacity in cells: the memory budget for K/V (see `kvplug plan`).
    pub capacity: usize,
    /// KV storage dtype.
    pub kv_dtype: KvDtype,
    /// The warm tier's directory (created on first use).
    pub dir: PathBuf,
    /// What the warm tier may keep on disk.
    pub warm: WarmLimits,
}

/// Bounds on the warm tier's files (`None`: unbounded).
#[derive(Clone, Copy, Debug, Default)]
pub struct WarmLimits {
    /// Bytes all parked agents' files may take.
    pub bytes: Option<u64>,
    /// A parked agent's file unused this long is removed.
    pub idle: Option<Duration>,
}

/// The warm tier on disk (see [`AgentStore::warm_usage`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct WarmUsage {
    /// Parked agents' files in the directory (any model's).
    pub files: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Files removed by the limits since the store started.
    pub removed: u64,
    /// The byte budget ([`WarmLimits::bytes`]).
    pub limit_bytes: Option<u64>,
    /// The idle limit in seconds ([`WarmLimits::idle`]).
    pub limit_idle_s: Option<u64>,
}

/// What one request did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Reply {
    /// Generated ids (ending at a stop token unless cut at `max_tokens`).
    pub ids: Vec<i32>,
    /// Prompt tokens whose K/V were reused: from the prefix index, the agent's own sequence
    /// or its session file.
    pub cached_tokens: usize,
    /// Of those, tokens restored from the agent's session file.
    pub restored_tokens: usize,
    /// Prompt tokens prefilled.
    pub prefilled_tokens: usize,
    /// Seconds from the request to its first generated token.
    pub ttft: f64,
    /// Generated tokens per second after the first.
    pub decode_tok_s: f64,
    /// The sampler as it ended (its stream goes on from there).
    #[serde(skip)]
    pub sampler: Sampler,
    /// What speculation did, when the request speculated.
    pub speculation: Option<SpecStats>,
}

struct Agent {
    /// Tokens whose K/V its sequence (hot) or file (warm) holds.
    tokens: Vec<i32>,
    /// Its sequence while hot.
    seq: Option<i32>,
    /// A request of its is in flight (never parked then).
    busy: bool,
    last_use: u64,
}

/// A request admitted onto a sequence (see [`AgentStore::admit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placed {
    /// The request's sequence: it holds the prompt's first `history` tokens at positions
    /// `0..history`.
    pub seq: i32,
    /// Prompt tokens whose K/V were reused (index, hot sequence or file).
    pub history: usize,
    /// Of those, tokens restored from the agent's session file.
    pub restored: usize,
    /// Where the prefill should end a step and publish `prompt[..at]` before going on
    /// (see [`AgentStore::admit`]); `None` on models that resume at every position.
    pub anchor_at: Option<usize>,
}

/// The store. Requests run one at a time through [`AgentStore::generate`], or several at
/// once through [`admit`](AgentStore::admit), a [`Generator`](crate::Generator) stepping
/// the store's [`context`](AgentStore::context), and [`finish`](AgentStore::finish) (the
/// server's batcher).
pub struct AgentStore {
    /// Token lists finished requests published, newest last (to explain prefix misses).
    published: VecDeque<Vec<i32>>,
    /// Whether an anchored prefill lets later requests resume at a shared beginning
    /// (`anchor_point`): the cache keeps a recurrent state at a published end on the
    /// index's own cells. A sliding window is pinned only on the publishing sequence's.
    anchors_prefixes: bool,
    cache: RtContext,
    fingerprint: String,
    /// The model's readable name, written into each parked agent's file.
    model_name: String,
    dir: PathBuf,
    agents: HashMap<String, Agent>,
    free_seqs: Vec<i32>,
    clock: u64,
    warm: WarmLimits,
    usage: WarmUsage,
    /// When the warm tier's files were last checked against its idle limit.
    checked: Instant,
}

/// How often [`AgentStore::check_warm`] looks for files past the idle limit.
const IDLE_CHECK: Duration = Duration::from_secs(10);

/// Published token lists kept to explain prefix misses.
const PUBLISHED_KEPT: usize = 32;

/// Fewest prompt tokens a later request must be spared for a prefill to anchor a shared
/// beginning (see `AgentStore::anchor_point`): each anchor takes one of the few published
/// ends a hybrid cache keeps state at.
const MIN_ANCHOR_GAIN: usize = 64;

/// Where a prompt parted from what earlier requests left in the cache.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Divergence {
    /// Prompt tokens reused.
    pub cached_tokens: usize,
    /// The longest beginning the prompt shares with a recent request's tokens (or the
    /// agent's history).
    pub shared_tokens: usize,
    /// The recent request's token where the prompt departs from it (`None`: it ended there).
    pub cached_next: Option<i32>,
    /// The prompt's token there (`None`: the prompt ended there).
    pub prompt_next: Option<i32>,
    /// Why fewer tokens were reused than were shared, if so.
    pub why: Option<&'static str>,
}

/// Refuses a name that cannot be an agent's (a session file name): 1-128 of
/// `A-Z a-z 0-9 . _ -`, not starting with `.`.
pub fn check_agent_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if !ok {
        fail!(
            Invalid,
            "'{name}' is not an agent name (1-128 of A-Z a-z 0-9 . _ -, not starting with '.')"
        );
    }
    Ok(())
}

/// The parked agents' files in `dir` (any model's): their count and bytes.
pub fn parked_in(dir: &Path) -> Result<WarmUsage> {
    let files = warm_files(dir)?;
    Ok(WarmUsage {
        files: files.len(),
        bytes: files.iter().map(|f| f.bytes).sum(),
        ..WarmUsage::default()
    })
}

/// One parked agent's file.
struct WarmFile {
    path: PathBuf,
    agent: String,
    bytes: u64,
    modified: SystemTime,
}

/// The parked agents' files in `dir` (`AGENT.<16 hex>.kvsession.safetensors`, any model);
/// none when it does not exist.
fn warm_files(dir: &Path) -> Result<Vec<WarmFile>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("listing {}", dir.display())),
    };
    let suffix = format!(".{EXTENSION}");
    Ok(entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let (agent, model) = name.strip_suffix(&suffix)?.rsplit_once('.')?;
            let tagged = model.len() == 16 && model.bytes().all(|b| b.is_ascii_hexdigit());
            let meta = e.metadata().ok().filter(|m| m.is_file())?;
            (tagged && check_agent_name(agent).is_ok()).then(|| WarmFile {
                path: e.path(),
                agent: agent.to_string(),
                bytes: meta.len(),
                modified: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            })
        })
        .collect())
}

fn tokens_u32(t: &[i32]) -> Vec<u32> {
    t.iter().map(|&x| x as u32).collect()
}

fn common_prefix(a: &[i32], b: &[i32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl AgentStore {
    /// A store for `model`, on a seq context of its own.
    pub fn new(model: &Model, opts: AgentStoreOptions) -> Result<Self> {
        let cache = model.context(CacheKind::Seq, opts.capacity, opts.kv_dtype)?;
        let anchors_prefixes = model
            .cache_config(opts.capacity, opts.kv_dtype)?
            .anchor_bytes()
            > 0;
        let mut store = AgentStore {
            published: VecDeque::new(),
            anchors_prefixes,
            cache,
            fingerprint: model_fingerprint(model.dir())?,
            model_name: crate::fingerprint::model_name(model.dir()),
            dir: opts.dir,
            agents: HashMap::new(),
            free_seqs: (0..MAX_SEQS as i32).rev().collect(),
            clock: 0,
            warm: opts.warm,
            usage: WarmUsage {
                limit_bytes: opts.warm.bytes,
                limit_idle_s: opts.warm.idle.map(|d| d.as_secs()),
                ..WarmUsage::default()
            },
            checked: Instant::now(),
        };
        store.enforce_warm();
        Ok(store)
    }

    /// The warm tier's files as last counted.
    pub fn warm_usage(&self) -> WarmUsage {
        self.usage
    }

    /// Applies [`WarmLimits`] if they were last applied over `IDLE_CHECK` ago (a server
    /// calls this between steps and when idle); parking applies them at once.
    pub fn check_warm(&mut self) {
        if self.checked.elapsed() >= IDLE_CHECK {
            self.enforce_warm();
        }
    }

    /// [`AgentStore::remove_past_limits`], its failure logged: the files stay, the requests
    /// go on.
    fn enforce_warm(&mut self) {
        self.checked = Instant::now();
        if let Err(e) = self.remove_past_limits() {
            tracing::error!("applying the parked agents' limits: {e}");
        }
    }

    /// Removes parked agents' files past the idle limit, then the least recently written
    /// until the rest fit the byte budget; each removal is logged, and an agent whose file
    /// goes is forgotten unless it is hot. Recounts [`WarmUsage`].
    fn remove_past_limits(&mut self) -> Result<()> {
        let mut files = warm_files(&self.dir)?;
        files.sort_by_key(|f| f.modified);
        let now = SystemTime::now();
        let mut total: u64 = files.iter().map(|f| f.bytes).sum();
        let mut kept = Vec::with_capacity(files.len());
        for f in files {
            let idle = now.duration_since(f.modified).unwrap_or_default();
            let why = if self.warm.idle.is_some_and(|limit| idle > limit) {
                Some("idle past the limit")
            } else if self.warm.bytes.is_some_and(|limit| total > limit) {
                Some("over the disk budget")
            } else {
                None
            };
            match why {
                Some(why) => match std::fs::remove_file(&f.path) {
                    Ok(()) => {
                        total -= f.bytes;
                        self.usage.removed += 1;
                        tracing::warn!(agent = %f.agent, bytes = f.bytes, idle_s = idle.as_secs(), "parked agent removed: {why}");
                        if self.agents.get(&f.agent).is_some_and(|a| a.seq.is_none()) {
                            self.agents.remove(&f.agent);
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => total -= f.bytes,
                    Err(e) => {
                        return Err(e).with_context(|| format!("removing {}", f.path.display()))
                    }
                },
                None => kept.push(f),
            }
        }
        (self.usage.files, self.usage.bytes) = (kept.len(), total);
        Ok(())
    }

    /// The context (statistics, prefix sizes).
    pub fn cache(&self) -> &RtContext {
        &self.cache
    }

    /// The context, to run admitted requests on.
    pub fn context(&mut self) -> &mut RtContext {
        &mut self.cache
    }

    /// Agent `name`'s session file for this model.
    pub fn file_of(&self, name: &str) -> Result<PathBuf> {
        check_agent_name(name)?;
        Ok(self
            .dir
            .join(format!("{name}.{}.{EXTENSION}", &self.fingerprint[..16])))
    }

    /// Why `prompt` reused only `cached` tokens: the longest beginning it shares with a recent
    /// request or `agent`'s history, and the tokens on both sides where they part. `None`
    /// when nothing recent shares a token with it.
    pub fn explain(
        &self,
        agent: Option<&str>,
        prompt: &[i32],
        cached: usize,
    ) -> Option<Divergence> {
        let own = agent.and_then(|n| self.agents.get(n)).map(|a| &a.tokens);
        let (shared, other) = self
            .published
            .iter()
            .chain(own)
            .map(|t| (common_prefix(t, prompt), t))
            .max_by_key(|(n, _)| *n)?;
        if shared == 0 && cached == 0 {
            return None;
        }
        let indexed = self
            .cache
            .prefix_match(&tokens_u32(&prompt[..shared]))
            .unwrap_or(0);
        let why = (shared > cached).then_some(if shared == prompt.len() && cached + 1 == shared {
            "the last prompt token is always recomputed"
        } else if indexed < shared {
            "the cells were evicted to make room"
        } else {
            "the hybrid's sliding-window or recurrent layers keep their state only at some step \
             ends of earlier requests, and the shared part ends between two of them"
        });
        Some(Divergence {
            cached_tokens: cached,
            shared_tokens: shared,
            cached_next: other.get(shared).copied(),
            prompt_next: prompt.get(shared).copied(),
            why,
        })
    }

    /// `prefix_attach` of `prompt` to the empty `seq`: the longest prefix the index holds. On
    /// a hybrid cache, whose sliding layers keep rows only at the ends of published prefixes,
    /// a match ending elsewhere is refused `out_of_window`; then the longest recently
    /// published end the prompt starts with is attached. 0 (nothing attached, the state
    /// untouched) when none can resume: the prompt is then prefilled whole.
    fn attach(&self, seq: i32, prompt: &[i32]) -> Result<usize> {
        let mut ends: Vec<usize> = self
            .published
            .iter()
            .filter(|t| t.len() < prompt.len() && prompt.starts_with(t))
            .map(Vec::len)
            .collect();
        ends.sort_unstable_by(|a, b| b.cmp(a));
        ends.dedup();
        for end in std::iter::once(prompt.len()).chain(ends) {
            match self.cache.prefix_attach(seq, &tokens_u32(&prompt[..end])) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind == AbiErrorKind::OutOfWindow => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(0)
    }

    /// Takes `n` free sequences (parking idle agents other than `current`, least recently
    /// used first, if fewer are free) for [`fork`](Self::fork); `None`, nothing taken, when
    /// that many cannot be had now. Give back unused ones with [`unreserve`](Self::unreserve),
    /// used ones with [`finish`](Self::finish) (no agent) or [`abort`](Self::abort).
    pub fn reserve(&mut self, n: usize, current: Option<&str>) -> Result<Option<Vec<i32>>> {
        while self.free_seqs.len() < n {
            if !self.park_lru(current)? {
                return Ok(None);
            }
        }
        let at = self.free_seqs.len() - n;
        Ok(Some(self.free_seqs.split_off(at)))
    }

    /// Gives back reserved sequences that hold nothing.
    pub fn unreserve(&mut self, seqs: impl IntoIterator<Item = i32>) {
        self.free_seqs.extend(seqs);
    }

    /// The reserved, empty `dst` shares `src`'s positions `0..len` (zero-copy: the cells
    /// gain it).
    pub fn fork(&mut self, src: i32, dst: i32, len: usize) -> Result<()> {
        Ok(self.cache.seq_cp(src, dst, None, Some(len as i32))?)
    }

    /// Agents holding a sequence now, and agents parked in their session files.
    pub fn agents_hot_and_parked(&self) -> (usize, usize) {
        let hot = self.agents.values().filter(|a| a.seq.is_some()).count();
        let parked = self
            .agents
            .values()
            .filter(|a| a.seq.is_none() && !a.tokens.is_empty())
            .count();
        (hot, parked)
    }

    /// Whether `name` holds a sequence now.
    pub fn is_hot(&self, name: &str) -> bool {
        self.agents.get(name).is_some_and(|a| a.seq.is_some())
    }

    /// Generates for `prompt` (at least one token) as agent `agent` (or anonymously):
    /// reuse, prefill, decode as `opts` asks (`max_tokens` at least 1; stop strings need a
    /// generator with text: not here), publish. A speculating request looks up drafts in
    /// the whole sequence, the reused part included. A request cancelled through
    /// `opts.cancel` before its first token is an error, its sequence dropped (the agent
    /// keeps nothing hot); one cancelled later ends as a reply with what it generated.
    pub fn generate(
        &mut self,
        agent: Option<&str>,
        prompt: &[i32],
        opts: GenOptions,
    ) -> Result<Reply> {
        if opts.max_tokens == 0 {
            fail!(Invalid, "a request needs max_tokens >= 1");
        }
        if opts.prompt_logprobs.is_some() {
            fail!(
                Invalid,
                "a scored prompt (prompt_logprobs) runs through a Generator, not here"
            );
        }
        let t0 = Instant::now();
        let Some(placed) = self.admit(agent, prompt, opts.max_tokens, true)? else {
            fail!(
                Invalid,
                "the memory budget ({} cells) cannot hold this request",
                self.cache.capacity()
            );
        };
        let seq = placed.seq;
        let anchored = |s: &mut Self| -> Result<usize> {
            let Some(at) = placed.anchor_at else {
                return Ok(placed.history);
            };
            s.run(
                seq,
                &prompt[..at],
                placed.history,
                GenOptions::max_tokens(0),
                t0,
            )?;
            s.publish(seq, &prompt[..at])?;
            Ok(at)
        };
        let reply = match anchored(self).and_then(|from| self.run(seq, prompt, from, opts, t0)) {
            Ok(r) => r,
            Err(e) => {
                self.abort(agent, seq)?;
                return Err(e);
            }
        };
        let mut held: Vec<i32> = prompt.to_vec();
        held.extend_from_slice(&reply.ids[..reply.ids.len() - 1]);
        self.finish(agent, seq, &held)?;
        Ok(Reply {
            cached_tokens: placed.history,
            restored_tokens: placed.restored,
            prefilled_tokens: prompt.len() - placed.history,
            ..reply
        })
    }

    /// Admits a request: a sequence holding as much of `prompt[..len - 1]` as the agent's
    /// sequence, the prefix index or the agent's file has, and room for the rest of the
    /// prompt plus `extra` more cells (what it will generate, plus whatever other requests
    /// in flight still have to write). `None` when that room or a sequence cannot be had
    /// now (requests in flight hold them); the store is then as before, except that an
    /// agent's hot sequence may have been cut back to what this prompt shares with it.
    /// The agent is busy until [`finish`](Self::finish) or [`abort`](Self::abort). On a
    /// hybrid model, [`Placed::anchor_at`] may name where the prompt departs from a recent
    /// request: the caller prefills up to there in a request of its own, publishes
    /// `prompt[..at]` ([`publish`](Self::publish)), then goes on from there, so that later
    /// requests sharing that beginning resume at it. Without `reuse` (a scored prompt,
    /// [`GenOptions::prompt_logprobs`], runs every token) nothing is reused or anchored and
    /// an agent is refused.
    pub fn admit(
        &mut self,
        agent: Option<&str>,
        prompt: &[i32],
        extra: usize,
        reuse: bool,
    ) -> Result<Option<Placed>> {
        if prompt.is_empty() {
            fail!(Invalid, "a request needs a prompt token");
        }
        if let (false, Some(name)) = (reuse, agent) {
            fail!(
                Invalid,
                "agent '{name}': a prompt run without reusing its history cannot be a session's"
            );
        }
        if let Some(name) = agent {
            self.file_of(name)?;
            if self.agents.get(name).is_some_and(|a| a.busy) {
                fail!(Invalid, "agent '{name}' has a request in flight");
            }
        }
        self.clock += 1;
        if !self.is_hot(agent.unwrap_or_default())
            && self.free_seqs.is_empty()
            && !self.park_lru(agent)?
        {
            return Ok(None);
        }
        let reused = if reuse { prompt.len() - 1 } else { 0 };
        let Some(mut placed) = self.place(agent, &prompt[..reused], prompt.len(), extra)? else {
            return Ok(None);
        };
        if reuse {
            placed.anchor_at = self.anchor_point(prompt, placed.history)?;
        }
        if !self.make_room(prompt.len() - placed.history + extra, agent)? {
            self.finish(agent, placed.seq, &prompt[..placed.history])?;
            return Ok(None);
        }
        if let Some(a) = agent.and_then(|n| self.agents.get_mut(n)) {
            a.busy = true;
        }
        Ok(Some(placed))
    }

    /// Where a request reusing `history` tokens of `prompt` should anchor its prefill: the
    /// end of the longest beginning it shares with a recent request, when the index holds
    /// those cells but the model cannot resume there (a hybrid model keeps its state
    /// only where a step ended) and anchoring saves at least [`MIN_ANCHOR_GAIN`] tokens of
    /// a later request's prefill. Agents sharing a
    /// system prompt: the second request anchors it, the later ones resume there. The
    /// request's own last token is never shared (it is always recomputed).
    fn anchor_point(&self, prompt: &[i32], history: usize) -> Result<Option<usize>> {
        if !self.anchors_prefixes {
            return Ok(None);
        }
        let shared = self
            .published
            .iter()
            .map(|t| common_prefix(t, prompt))
            .max()
            .unwrap_or(0)
            .min(prompt.len() - 1);
        if shared < history + MIN_ANCHOR_GAIN {
            return Ok(None);
        }
        let indexed = self.cache.prefix_match(&tokens_u32(&prompt[..shared]))?;
        Ok((indexed >= shared).then_some(shared))
    }

    /// Publishes `held`, what `seq` holds (token `i` at position `i`), to the prefix index.
    pub fn publish(&mut self, seq: i32, held: &[i32]) -> Result<()> {
        self.cache.prefix_publish(seq, &tokens_u32(held))?;
        self.published.retain(|t| t != held);
        if self.published.len() == PUBLISHED_KEPT {
            self.published.pop_front();
        }
        self.published.push_back(held.to_vec());
        Ok(())
    }

    /// Ends a request whose sequence holds `held` (token `i` at position `i`): publishes it
    /// to the prefix index; a named agent keeps it (hot), an anonymous request's sequence
    /// is released (what the index holds stays, evictable).
    pub fn finish(&mut self, agent: Option<&str>, seq: i32, held: &[i32]) -> Result<()> {
        self.publish(seq, held)?;
        match agent {
            Some(name) => {
                let clock = self.clock;
                let a = self
                    .agents
                    .get_mut(name)
                    .expect("admitted agents are known");
                (a.tokens, a.seq, a.last_use, a.busy) = (held.to_vec(), Some(seq), clock, false);
            }
            None => {
                self.cache.seq_rm(seq, None, None)?;
                self.free_seqs.push(seq);
            }
        }
        Ok(())
    }

    /// Drops `seq`'s positions from `len` on (what a request in flight generated before
    /// its client went away).
    pub fn truncate(&mut self, seq: i32, len: usize) -> Result<()> {
        Ok(self.cache.seq_rm(seq, Some(len as i32), None)?)
    }

    /// Ends a failed request: its K/V may be partial, so its sequence is dropped (an
    /// agent's session file, if any, stays).
    pub fn abort(&mut self, agent: Option<&str>, seq: i32) -> Result<()> {
        self.cache.seq_rm(seq, None, None)?;
        self.release(agent, seq);
        Ok(())
    }

    fn release(&mut self, agent: Option<&str>, seq: i32) {
        if let Some(a) = agent.and_then(|n| self.agents.get_mut(n)) {
            a.seq = None;
            a.busy = false;
            a.tokens.clear();
        }
        self.free_seqs.push(seq);
    }

    /// Gives the request a sequence holding as much of `reusable` (the beginning of a
    /// `len`-token prompt it may reuse) as the agent's sequence, the prefix index or the
    /// agent's file has (a sequence must be free or the agent hot). `None` when the cells
    /// to restore from the file cannot be freed now, with the rest of the prompt and `extra`
    /// more.
    fn place(
        &mut self,
        agent: Option<&str>,
        reusable: &[i32],
        len: usize,
        extra: usize,
    ) -> Result<Option<Placed>> {
        let indexed = self.cache.prefix_match(&tokens_u32(reusable))?;
        if let Some(a) = agent.and_then(|n| self.agents.get_mut(n)) {
            if let Some(seq) = a.seq {
                let keep = common_prefix(&a.tokens, reusable);
                if keep >= indexed {
                    match self.cache.seq_rm(seq, Some(keep as i32), None) {
                        Ok(()) => {
                            a.tokens.truncate(keep);
                            return Ok(Some(Placed {
                                seq,
                                history: keep,
                                restored: 0,
                                anchor_at: None,
                            }));
                        }
                        // A hybrid cache cannot go back that far: start the sequence over.
                        Err(e) if e.kind == AbiErrorKind::OutOfWindow => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                // The index holds more of this prompt than the agent's own history (or the
                // history cannot be kept).
                self.cache.seq_rm(seq, None, None)?;
                a.tokens.clear();
                let attached = self.attach(seq, reusable)?;
                let a = self
                    .agents
                    .get_mut(agent.expect("a hot agent"))
                    .expect("known");
                a.tokens = reusable[..attached].to_vec();
                return Ok(Some(Placed {
                    seq,
                    history: attached,
                    restored: 0,
                    anchor_at: None,
                }));
            }
        }
        let seq = self.free_seqs.pop().context("no free sequence")?;
        let placed = self.fill(seq, agent, reusable, len, extra);
        if !matches!(placed, Ok(Some(_))) {
            // No room, or a failed restore: the sequence goes back empty.
            self.cache.seq_rm(seq, None, None)?;
            self.free_seqs.push(seq);
        }
        placed
    }

    /// Fills the empty `seq` with what the prefix index and the agent's file hold of
    /// `reusable` (as [`place`](Self::place)) and gives it to the agent; `None` when the
    /// cells to restore cannot be freed now together with those the rest of the prompt and
    /// `extra` need (the restore must not take cells promised to requests in flight).
    fn fill(
        &mut self,
        seq: i32,
        agent: Option<&str>,
        reusable: &[i32],
        len: usize,
        extra: usize,
    ) -> Result<Option<Placed>> {
        let attached = self.attach(seq, reusable)?;
        let mut history = attached;
        let mut restored = 0;
        if let Some(name) = agent {
            let path = self.file_of(name)?;
            let saved = if path.exists() {
                Some(session_file::read(&path)?)
            } else {
                None
            };
            let fits = saved.as_ref().map(|s| {
                let c = &self.cache;
                s.check_fits(
                    &path,
                    &self.fingerprint,
                    c.kv_dtype(),
                    c.key_basis(),
                    c.capacity(),
                )
            });
            // The warm tier is a cache: a file of another KV dtype or key basis (a server
            // restarted with another `--kv-dtype`, or files from before keys were rotated)
            // is a miss, prefilled, and replaced when the agent parks again.
            let usable = match fits {
                Some(Err(
                    e @ (SessionFileError::OtherDtype { .. }
                    | SessionFileError::OtherKeyBasis { .. }),
                )) => {
                    tracing::warn!(agent = name, "{e}: prefilling instead");
                    None
                }
                Some(Err(e)) => return Err(e.into()),
                Some(Ok(())) => saved,
                None => None,
            };
            if let Some(s) = usable {
                let have = common_prefix(&s.tokens, reusable);
                if have > attached {
                    let need = have - attached;
                    if !self.make_room(len - attached + extra, agent)? {
                        return Ok(None);
                    }
                    // A hybrid model's file keeps its sliding layers' rows only for the
                    // window at its end: a prompt that diverges before then is prefilled.
                    match self.cache.import_seq(seq, &s.rows.slice(attached..have)) {
                        Ok(()) => (history, restored) = (have, need),
                        Err(e) if e.kind == AbiErrorKind::OutOfWindow => {}
                        Err(e) => return Err(e.into()),
                    }
                }
            }
            let a = self.agents.entry(name.to_string()).or_insert(Agent {
                tokens: Vec::new(),
                seq: None,
                busy: false,
                last_use: 0,
            });
            (a.tokens, a.seq) = (reusable[..history].to_vec(), Some(seq));
        }
        Ok(Some(Placed {
            seq,
            history,
            restored,
            anchor_at: None,
        }))
    }

    /// Makes `n` cells free: evicts unheld prefixes, then parks idle agents (least recently
    /// used first) until enough can be evicted. False when even that is not enough.
    fn make_room(&mut self, n: usize, current: Option<&str>) -> Result<bool> {
        loop {
            match self.cache.prefix_reserve(n) {
                Ok(_) => return Ok(true),
                Err(e) if e.kind == AbiErrorKind::Capacity => {
                    if !self.park_lru(current)? {
                        return Ok(false);
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Parks the least recently used idle hot agent other than `current`; false when none.
    fn park_lru(&mut self, current: Option<&str>) -> Result<bool> {
        let victim = self
            .agents
            .iter()
            .filter(|(n, a)| a.seq.is_some() && !a.busy && Some(n.as_str()) != current)
            .min_by_key(|(_, a)| a.last_use)
            .map(|(n, _)| n.clone());
        match victim {
            Some(name) => self.park(&name).map(|_| true),
            None => Ok(false),
        }
    }

    /// Moves agent `name` to the warm tier: its history to its session file (atomically),
    /// its sequence released (cells the prefix index holds stay there, evictable).
    pub fn park(&mut self, name: &str) -> Result<()> {
        let path = self.file_of(name)?;
        let Some(a) = self.agents.get_mut(name) else {
            fail!(Invalid, "no agent '{name}'");
        };
        let Some(seq) = a.seq else {
            return Ok(());
        };
        if a.busy {
            fail!(Invalid, "agent '{name}' has a request in flight");
        }
        let session = Session {
            rows: self.cache.export_seq(seq)?,
            tokens: a.tokens.clone(),
            model: self.fingerprint.clone(),
            key_basis: self.cache.key_basis(),
            model_name: self.model_name.clone(),
            app: Default::default(),
        };
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("creating {}", self.dir.display()))?;
        session_file::write(&path, &session)?;
        self.cache.seq_rm(seq, None, None)?;
        a.seq = None;
        self.free_seqs.push(seq);
        tracing::debug!(agent = name, tokens = session.tokens.len(), "agent parked");
        self.enforce_warm();
        Ok(())
    }

    /// Parks every idle hot agent (before a model swap or shutdown).
    pub fn park_all(&mut self) -> Result<()> {
        let hot: Vec<String> = self
            .agents
            .iter()
            .filter(|(_, a)| a.seq.is_some() && !a.busy)
            .map(|(n, _)| n.clone())
            .collect();
        hot.iter().try_for_each(|n| self.park(n))
    }

    fn run(
        &mut self,
        seq: i32,
        prompt: &[i32],
        history: usize,
        mut opts: GenOptions,
        t0: Instant,
    ) -> Result<Reply> {
        if let Some(s) = &mut opts.speculate {
            s.earlier = prompt[..history].to_vec();
        }
        let mut ttft = None;
        let g = generate(
            &mut self.cache,
            None,
            seq,
            &prompt[history..],
            history,
            opts,
            &mut |_| {
                ttft.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                Ok(())
            },
        )?;
        if g.reason == Finish::Cancelled && g.ids.is_empty() {
            // Cancelled before its first token: the sequence may hold part of the prompt
            // only, and the caller aborts it.
            fail!(Invalid, "the request was cancelled before its first token");
        }
        Ok(Reply {
            sampler: g.sampler,
            speculation: g.speculation,
            decode_tok_s: g.decode_tok_s,
            ids: g.ids,
            cached_tokens: 0,
            restored_tokens: 0,
            prefilled_tokens: 0,
            ttft: ttft.unwrap_or_default(),
        })
    }
}
