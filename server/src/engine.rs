//! The batcher: every request in flight is a sequence of one seq cache, and each step runs
//! one forward over all of them (continuous batching). Requests are admitted at step
//! boundaries in arrival order, each with the cells it may still need reserved (prompt +
//! `max_tokens`), so a step never runs out of memory; they retire at a stop token, a stop
//! string, `max_tokens`, or when the client goes away (its sequence is released at once).
//! Long prompts are prefilled in chunks that share the step's
//! [`PREFILL_UBATCH`](kvplug::PREFILL_UBATCH) tokens with the decoding requests, so a long
//! prompt never stalls the others for a whole prefill: the SDK's [`Generator`] runs the
//! steps, this module admits, reports and retires.

use std::collections::{BTreeSet, VecDeque};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::{Arc, Mutex};

use kvplug::agent_store::{AgentStore, Placed};
use kvplug::generator::{Finish, Finished, GenOptions, Generator, RequestId};
use kvplug::run::CacheReport;
use kvplug::{Sampler, Text};
use tokio::sync::mpsc::UnboundedSender;

use crate::error::ApiError;

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
    request: RequestId,
}

impl Active {
    fn usage(&self, generated: usize) -> Usage {
        let p = self.req.prompt.len();
        Usage {
            prompt_tokens: p,
            completion_tokens: generated,
            total_tokens: p + generated,
            prompt_tokens_details: CachedTokens {
                cached_tokens: self.placed.history,
            },
        }
    }

    /// The tokens its sequence holds once `f` ended: the reused history, the prompt written
    /// after it, and every generated token that was run.
    fn held(&self, f: &Finished) -> Vec<i32> {
        let prompt_end = self.placed.history + f.prompt_written;
        let mut held = self.req.prompt[..prompt_end].to_vec();
        if prompt_end == self.req.prompt.len() {
            held.extend_from_slice(&f.generated[..f.generated.len().saturating_sub(1)]);
        }
        held
    }
}

/// The batcher, on the thread that owns the model.
pub struct Engine {
    store: AgentStore,
    generator: Generator,
    stop_tokens: BTreeSet<i32>,
    limits: Limits,
    queue: VecDeque<GenRequest>,
    active: Vec<Active>,
    status: Arc<Mutex<Status>>,
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
            store,
            stop_tokens: text.stop_tokens().clone(),
            generator: Generator::with_text(text),
            limits,
            queue: VecDeque::new(),
            active: Vec::new(),
            status,
        }
    }

    /// Serves requests from `rx` until every sender is gone, then parks the agents' K/V in
    /// their session files.
    pub fn run(mut self, rx: Receiver<GenRequest>) -> kvplug::Result<()> {
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
    fn admit(&mut self) -> kvplug::Result<()> {
        let mut i = 0;
        while i < self.queue.len() && self.active.len() < self.limits.parallel {
            let r = &self.queue[i];
            if r.agent.is_some() && self.active.iter().any(|a| a.req.agent == r.agent) {
                i += 1;
                continue;
            }
            let extra = r.max_tokens - 1 + self.generator.outstanding();
            match self.store.admit(r.agent.as_deref(), &r.prompt, extra) {
                Ok(Some(placed)) => {
                    let req = self.queue.remove(i).expect("index in range");
                    let opts = GenOptions {
                        max_tokens: req.max_tokens,
                        sampler: req.sampler.clone(),
                        stop_tokens: self.stop_tokens.clone(),
                        stop_strings: req.stop.clone(),
                        ..GenOptions::default()
                    };
                    let fresh = &req.prompt[placed.history..];
                    let request = self
                        .generator
                        .add(placed.seq, fresh, placed.history, opts)?;
                    self.active.push(Active {
                        req,
                        placed,
                        request,
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
                        .send(Event::Failed(ApiError::internal(e.to_string())));
                }
            }
        }
        Ok(())
    }

    /// Releases the sequences of requests whose client has gone: the prompt's K/V stays in
    /// the prefix index (or the agent's sequence), what was generated is dropped.
    fn drop_abandoned(&mut self) -> kvplug::Result<()> {
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].req.events.is_closed() {
                let a = self.active.swap_remove(i);
                let f = self.generator.cancel(a.request).expect("in flight");
                let keep = a.placed.history + f.prompt_written;
                let seq = a.placed.seq;
                self.store.truncate(seq, keep)?;
                self.store
                    .finish(a.req.agent.as_deref(), seq, &a.req.prompt[..keep])?;
                self.status.lock().expect("status lock").completed += 1;
                tracing::debug!(seq, "client gone: sequence released");
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// One step of the generator over the requests in flight: their text goes out as it is
    /// released, and those that end are answered and retired.
    fn step(&mut self) -> kvplug::Result<()> {
        let active = &self.active;
        let sent = self.generator.step(self.store.context(), &mut |e| {
            if !e.text.is_empty() {
                if let Some(a) = active.iter().find(|a| a.request == e.request) {
                    let _ = a.req.events.send(Event::Text(e.text.clone()));
                }
            }
            Ok(())
        });
        let done = match sent {
            Ok(done) => done,
            Err(e) => {
                tracing::error!("forward failed: {e}");
                self.generator.cancel_all();
                for a in std::mem::take(&mut self.active) {
                    let _ = a.req.events.send(Event::Failed(ApiError::internal(format!(
                        "forward failed: {e}"
                    ))));
                    self.store.abort(a.req.agent.as_deref(), a.placed.seq)?;
                }
                return Ok(());
            }
        };
        self.status.lock().expect("status lock").steps += 1;
        for f in done {
            let i = self
                .active
                .iter()
                .position(|a| a.request == f.request)
                .expect("in flight");
            let a = self.active.swap_remove(i);
            if !f.text_tail.is_empty() {
                let _ = a.req.events.send(Event::Text(f.text_tail.clone()));
            }
            let finish_reason = match f.reason {
                Finish::Length => "length",
                _ => "stop",
            };
            let _ = a.req.events.send(Event::Done {
                finish_reason,
                usage: a.usage(f.generated.len()),
            });
            self.store
                .finish(a.req.agent.as_deref(), a.placed.seq, &a.held(&f))?;
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
