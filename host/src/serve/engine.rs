//! The batcher: every request in flight is a sequence of one seq cache, and each step runs
//! one forward over all of them (continuous batching). Requests are admitted at step
//! boundaries in arrival order, each with the cells it may still need reserved (prompt +
//! `max_tokens`), so a step never runs out of memory; they retire at a stop token, a stop
//! string, `max_tokens`, or when the client goes away (its sequence is released at once).
//! Long prompts are prefilled in chunks that share the step's [`PREFILL_UBATCH`] tokens
//! with the decoding requests, so a long prompt never stalls the others for a whole prefill.

use std::collections::{BTreeSet, VecDeque};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::{Arc, Mutex};

use anyhow::Result;
use tokio::sync::mpsc::UnboundedSender;

use super::error::ApiError;
use super::stop::StopMatcher;
use crate::agent_store::{AgentStore, Placed};
use crate::run::{CacheReport, Sampler, PREFILL_UBATCH};
use crate::text::{Streamer, Text};

/// A request for the batcher.
pub struct GenRequest {
    /// Prompt token ids (at least one).
    pub prompt: Vec<i32>,
    /// Most tokens to generate (at least one).
    pub max_tokens: usize,
    /// How tokens are picked.
    pub sampler: Sampler,
    /// Stop strings.
    pub stop: Vec<String>,
    /// The agent session (`X-Session-Id`), if any.
    pub agent: Option<String>,
    /// Where the answer goes; closed when the client has gone.
    pub events: UnboundedSender<Event>,
}

/// What a request hears back.
#[derive(Debug)]
pub enum Event {
    /// More of the answer.
    Text(String),
    /// The end: why, and the token counts.
    Done {
        /// `stop` or `length`.
        finish_reason: &'static str,
        /// Token counts.
        usage: Usage,
    },
    /// The request failed; nothing more follows.
    Failed(ApiError),
}

/// Token counts of a request, as OpenAI reports them.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens (a final end-of-turn token included).
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
    /// `cached_tokens`: prompt tokens whose K/V were reused, not prefilled.
    pub prompt_tokens_details: CachedTokens,
}

/// `usage.prompt_tokens_details`.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct CachedTokens {
    /// Prompt tokens reused from the prefix index, the agent's sequence or its file.
    pub cached_tokens: usize,
}

/// What `/health` shows.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Status {
    /// Requests in flight (each holds a sequence).
    pub active: usize,
    /// Requests waiting for a sequence or for memory.
    pub queued: usize,
    /// Forward steps run.
    pub steps: u64,
    /// Requests answered (finished, stopped or abandoned by their client).
    pub completed: u64,
    /// The seq cache (cells, bytes, prefix index).
    pub cache: Option<CacheReport>,
}

/// Batcher limits.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Most requests in flight at once (each a sequence of the cache).
    pub parallel: usize,
    /// Most requests waiting; beyond, 429.
    pub max_queue: usize,
}

/// A request in flight.
struct Active {
    req: GenRequest,
    placed: Placed,
    /// Tokens whose K/V the sequence holds (token `i` at position `i`).
    held: Vec<i32>,
    generated: Vec<i32>,
    streamer: Streamer,
    stop: StopMatcher,
    /// Tokens this step feeds (0: none).
    fed: usize,
}

impl Active {
    fn prefilling(&self) -> bool {
        self.held.len() < self.req.prompt.len()
    }

    /// Cells it may still write: the prompt's rest and all but the last generated token.
    fn outstanding(&self) -> usize {
        (self.req.prompt.len() + self.req.max_tokens - 1).saturating_sub(self.held.len())
    }

    fn usage(&self) -> Usage {
        let (p, c) = (self.req.prompt.len(), self.generated.len());
        Usage {
            prompt_tokens: p,
            completion_tokens: c,
            total_tokens: p + c,
            prompt_tokens_details: CachedTokens {
                cached_tokens: self.placed.history,
            },
        }
    }
}

/// The batcher, on the thread that owns the model.
pub struct Engine {
    store: AgentStore,
    text: Arc<Text>,
    stop_tokens: BTreeSet<i32>,
    limits: Limits,
    queue: VecDeque<GenRequest>,
    active: Vec<Active>,
    status: Arc<Mutex<Status>>,
    // The step's batch, reused across steps.
    tokens: Vec<i32>,
    positions: Vec<i32>,
    seqs: Vec<i32>,
    rows: Vec<i32>,
    owners: Vec<usize>,
}

impl Engine {
    /// A batcher over `store`, reporting to `status`.
    pub fn new(
        store: AgentStore,
        text: Arc<Text>,
        limits: Limits,
        status: Arc<Mutex<Status>>,
    ) -> Self {
        Engine {
            stop_tokens: text.stop_tokens().clone(),
            store,
            text,
            limits,
            queue: VecDeque::new(),
            active: Vec::new(),
            status,
            tokens: Vec::new(),
            positions: Vec::new(),
            seqs: Vec::new(),
            rows: Vec::new(),
            owners: Vec::new(),
        }
    }

    /// Serves requests from `rx` until every sender is gone, then parks the agents' K/V in
    /// their session files.
    pub fn run(mut self, rx: Receiver<GenRequest>) -> Result<()> {
        self.report();
        loop {
            if self.active.is_empty() && self.queue.is_empty() {
                match rx.recv() {
                    Ok(r) => self.enqueue(r),
                    Err(_) => break,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(r) => self.enqueue(r),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) if self.active.is_empty() => {
                        self.queue.clear();
                        break;
                    }
                    Err(TryRecvError::Disconnected) => break,
                }
            }
            self.queue.retain(|r| !r.events.is_closed());
            self.drop_abandoned()?;
            self.admit()?;
            if !self.active.is_empty() {
                self.step()?;
            }
            self.report();
        }
        self.store.park_all()
    }

    fn enqueue(&mut self, r: GenRequest) {
        if self.queue.len() >= self.limits.max_queue {
            let _ = r.events.send(Event::Failed(ApiError::busy(
                format!(
                    "{} requests in flight and {} waiting: retry later",
                    self.active.len(),
                    self.queue.len()
                ),
                1,
            )));
            return;
        }
        self.queue.push_back(r);
    }

    /// Admits waiting requests in arrival order while sequences and memory allow. A request
    /// whose agent is busy waits without holding up the ones behind it.
    fn admit(&mut self) -> Result<()> {
        let mut i = 0;
        while i < self.queue.len() && self.active.len() < self.limits.parallel {
            let r = &self.queue[i];
            if r.agent.is_some() && self.active.iter().any(|a| a.req.agent == r.agent) {
                i += 1;
                continue;
            }
            let others: usize = self.active.iter().map(Active::outstanding).sum();
            let extra = r.max_tokens - 1 + others;
            match self.store.admit(r.agent.as_deref(), &r.prompt, extra) {
                Ok(Some(placed)) => {
                    let req = self.queue.remove(i).expect("index in range");
                    self.active.push(Active {
                        held: req.prompt[..placed.history].to_vec(),
                        stop: StopMatcher::new(req.stop.clone()),
                        req,
                        placed,
                        generated: Vec::new(),
                        streamer: Streamer::default(),
                        fed: 0,
                    });
                }
                Ok(None) if self.active.is_empty() => {
                    let req = self.queue.remove(i).expect("index in range");
                    let _ = req.events.send(Event::Failed(ApiError::unavailable(
                        "the memory budget cannot hold this request now",
                        1,
                    )));
                }
                Ok(None) => break,
                Err(e) => {
                    // An agent's unreadable session file, or the backend failing.
                    let req = self.queue.remove(i).expect("index in range");
                    let _ = req
                        .events
                        .send(Event::Failed(ApiError::internal(format!("{e:#}"))));
                }
            }
        }
        Ok(())
    }

    /// Releases the sequences of requests whose client has gone: the prompt's K/V stays in
    /// the prefix index (or the agent's sequence), what was generated is dropped.
    fn drop_abandoned(&mut self) -> Result<()> {
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].req.events.is_closed() {
                let a = self.active.swap_remove(i);
                let keep = a.held.len().min(a.req.prompt.len());
                let seq = a.placed.seq;
                self.store.truncate(seq, keep)?;
                self.store
                    .finish(a.req.agent.as_deref(), seq, &a.held[..keep])?;
                self.status.lock().expect("status lock").completed += 1;
                tracing::debug!(seq, "client gone: sequence released");
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// One forward: a token for every decoding request, then prompt chunks in arrival order
    /// up to [`PREFILL_UBATCH`] tokens in all; samples where a row's logits are due.
    fn step(&mut self) -> Result<()> {
        let (tokens, positions, seqs, rows, owners) = (
            &mut self.tokens,
            &mut self.positions,
            &mut self.seqs,
            &mut self.rows,
            &mut self.owners,
        );
        tokens.clear();
        positions.clear();
        seqs.clear();
        rows.clear();
        owners.clear();
        let mut budget = PREFILL_UBATCH.saturating_sub(self.active.len());
        for decode in [true, false] {
            for (i, a) in self.active.iter_mut().enumerate() {
                if a.prefilling() == decode {
                    continue;
                }
                let p0 = a.held.len();
                let input: &[i32] = if decode {
                    a.fed = 1;
                    &a.generated[a.generated.len() - 1..]
                } else {
                    a.fed = (a.req.prompt.len() - p0).min(budget);
                    budget -= a.fed;
                    &a.req.prompt[p0..p0 + a.fed]
                };
                tokens.extend_from_slice(input);
                positions.extend((p0..p0 + a.fed).map(|p| p as i32));
                seqs.extend(std::iter::repeat_n(a.placed.seq, a.fed));
                if a.fed > 0 && (decode || p0 + a.fed == a.req.prompt.len()) {
                    rows.push(tokens.len() as i32 - 1);
                    owners.push(i);
                }
            }
        }
        let logits = match self.store.step(tokens, positions, seqs, rows) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("forward failed: {e:#}");
                for a in std::mem::take(&mut self.active) {
                    let _ = a.req.events.send(Event::Failed(ApiError::internal(format!(
                        "forward failed: {e:#}"
                    ))));
                    self.store.abort(a.req.agent.as_deref(), a.placed.seq)?;
                }
                return Ok(());
            }
        };
        self.status.lock().expect("status lock").steps += 1;
        for a in &mut self.active {
            let fed = std::mem::take(&mut a.fed);
            if fed == 0 {
                continue;
            }
            let p0 = a.held.len();
            if p0 < a.req.prompt.len() {
                a.held.extend_from_slice(&a.req.prompt[p0..p0 + fed]);
            } else {
                a.held.push(a.generated[a.generated.len() - 1]);
            }
        }
        let mut done = Vec::new();
        for (row, &i) in self.owners.iter().enumerate() {
            let a = &mut self.active[i];
            let id = a.req.sampler.sample(&logits[row]);
            a.generated.push(id);
            let finish = if self.stop_tokens.contains(&id) {
                Some("stop")
            } else {
                let piece = a.streamer.push(&self.text, id)?;
                let (text, stopped) = a.stop.push(&piece);
                if !text.is_empty() {
                    let _ = a.req.events.send(Event::Text(text));
                }
                if stopped {
                    Some("stop")
                } else {
                    (a.generated.len() >= a.req.max_tokens).then_some("length")
                }
            };
            if let Some(reason) = finish {
                done.push((i, reason));
            }
        }
        done.sort_unstable_by_key(|&(i, _)| std::cmp::Reverse(i));
        for (i, finish_reason) in done {
            let mut a = self.active.swap_remove(i);
            // After a stop string nothing is held; otherwise the held text was no stop.
            let rest = a.stop.flush();
            if !rest.is_empty() {
                let _ = a.req.events.send(Event::Text(rest));
            }
            let usage = a.usage();
            let _ = a.req.events.send(Event::Done {
                finish_reason,
                usage,
            });
            self.store
                .finish(a.req.agent.as_deref(), a.placed.seq, &a.held)?;
            self.status.lock().expect("status lock").completed += 1;
        }
        Ok(())
    }

    fn report(&self) {
        let cache = self.store.cache().stats().ok().map(CacheReport::from);
        let mut s = self.status.lock().expect("status lock");
        (s.active, s.queued, s.cache) = (self.active.len(), self.queue.len(), cache);
    }
}
