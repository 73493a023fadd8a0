//! The batcher: every request in flight is a sequence of one seq cache, and each step runs
//! one forward over all of them (continuous batching). Requests are admitted at step
//! boundaries in arrival order, each with the cells it may still need reserved (prompt +
//! `max_tokens`), so a step never runs out of memory; they retire at a stop token, a stop
//! string, `max_tokens`, or when the client goes away (its sequence is released at once).
//! Long prompts are prefilled in chunks that share the step's
//! [`PREFILL_UBATCH`](kvplug::PREFILL_UBATCH) tokens with the decoding requests, so a long
//! prompt never stalls the others for a whole prefill: the SDK's [`Generator`] runs the
//! steps, this module admits, reports and retires.

use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvplug::CacheReport;
use kvplug::TokenLogprobs;
use kvplug::{AbiErrorKind, Text};
use kvplug::{AgentStore, Divergence, Placed};
use kvplug::{Draft, SpecStats, Speculation};
use kvplug::{Finish, Finished, GenOptions, Generator, RequestId};
use tokio::sync::mpsc::UnboundedSender;

use crate::error::ApiError;
use crate::metrics::Metrics;

/// A request for the batcher.
pub struct GenRequest {
    /// Prompt token ids (at least one).
    pub prompt: Vec<i32>,
    /// How to generate each completion (`max_tokens` 0 only to echo the prompt).
    pub opts: GenOptions,
    /// Completions of the prompt (1..=16; more than one only without an agent): the prompt
    /// is prefilled once and shared by sequence membership.
    pub n: usize,
    /// The agent session (`X-Session-Id`), if any.
    pub agent: Option<String>,
    /// Where the answer goes; closed when the client has gone.
    pub events: UnboundedSender<Event>,
    /// When it arrived (for time to first token).
    pub arrived: Instant,
    /// Whether its completions speculate (`None`: as the server does by default).
    pub speculative: Option<bool>,
}

/// What a request hears back.
#[derive(Debug)]
pub enum Event {
    /// It has sequences and its prompt's reuse is known (always the first event of an
    /// answered request).
    Admitted {
        /// Prompt tokens reused instead of prefilled.
        cached_tokens: usize,
        /// Where the prompt parted from what the cache holds, when it shares anything.
        divergence: Option<Divergence>,
    },
    /// Text of completion `choice` released (by a token, or held back to its end), with the
    /// log-probabilities of the tokens whose text it completes, when the request asked.
    Token {
        /// Which completion.
        choice: usize,
        /// Text released.
        text: String,
        /// Log-probabilities of the tokens it releases, in order.
        logprobs: Vec<TokenLogprobs>,
    },
    /// A scored prompt's log-probabilities ([`kvplug::GenOptions::prompt_logprobs`]): one
    /// a prompt token from the second on, before any token of the answer.
    Prompt {
        /// In prompt order.
        logprobs: Vec<TokenLogprobs>,
    },
    /// Completion `choice` ended.
    Done {
        /// Which completion.
        choice: usize,
        /// `stop` or `length`.
        finish_reason: &'static str,
        /// Its generated tokens (a final end-of-turn token included).
        completion_tokens: usize,
        /// What speculation did, when it speculated.
        speculation: Option<SpecStats>,
        /// The stop string that ended it, when one did.
        stop_string: Option<String>,
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
    /// Draft tokens accepted and refused, when the request speculated (OpenAI's names for
    /// its predicted outputs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completion_tokens_details: Option<Predictions>,
}

/// `usage.completion_tokens_details`.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Predictions {
    /// Draft tokens the model accepted (each saved a forward).
    pub accepted_prediction_tokens: usize,
    /// Draft tokens it refused.
    pub rejected_prediction_tokens: usize,
}

/// `usage.prompt_tokens_details`.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct CachedTokens {
    /// Prompt tokens reused from the prefix index, the agent's sequence or its file.
    pub cached_tokens: usize,
}

/// How long an idle engine waits for a request before checking its parked agents' limits.
const IDLE_WAKE: std::time::Duration = std::time::Duration::from_secs(10);

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
    /// Parked agents' files: count, bytes, removals, limits.
    pub parked: kvplug::WarmUsage,
}

/// Batcher limits and defaults.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Most requests in flight at once (each a sequence of the cache).
    pub parallel: usize,
    /// Most requests waiting; beyond, 429.
    pub max_queue: usize,
    /// The draft of speculating requests (`None`: prompt lookup).
    pub draft: Option<Draft>,
    /// Whether greedy requests speculate unless they say otherwise.
    pub speculate: bool,
}

/// A generator request of a request in flight: which completion, on which sequence, from
/// which position.
#[derive(Clone, Debug)]
struct Running {
    request: RequestId,
    /// The completion (`None`: the shared prefill before `n` completions fork).
    choice: Option<usize>,
    seq: i32,
    start: usize,
    /// Log-probabilities of its latest tokens whose text is not out yet (see
    /// [`kvplug::TokenEvent::held`]): they go out with it, or not at all when it is in a stop
    /// string.
    held_logprobs: Vec<TokenLogprobs>,
}

/// A request in flight.
struct Active {
    req: GenRequest,
    placed: Placed,
    running: Vec<Running>,
    /// Sequences taken for its other completions and not forked yet.
    reserved: Vec<i32>,
    /// Whether `placed.seq` is still its own (not yet published and released).
    main_open: bool,
    /// Completions ended.
    done: usize,
    /// Whether a token has been sampled (time to first token recorded).
    started: bool,
    /// Whether the prefill up to `placed.anchor_at` runs (it is published when it ends).
    anchoring: bool,
    /// Prompt tokens `placed.seq` holds while no generator request runs on it.
    main_held: usize,
}

impl Active {
    /// Whether its completion scores the prompt: a scored prompt of one completion (of
    /// several, the shared prefill does, see [`Engine::fork`]).
    fn completion_scores(&self) -> bool {
        self.req.opts.prompt_logprobs.is_some() && self.req.n == 1
    }

    /// The prompt part request `r` was given.
    fn prompt_of(&self, r: &Running) -> &[i32] {
        let prompt = &self.req.prompt;
        match r.choice {
            Some(_) if self.req.n > 1 => &prompt[prompt.len() - 1..],
            None if self.anchoring => &prompt[r.start..self.placed.anchor_at.expect("anchoring")],
            None => &prompt[r.start..prompt.len() - 1],
            Some(_) => &prompt[r.start..],
        }
    }

    /// The tokens `r`'s sequence holds once `f` ended: the prompt up to what was written,
    /// then, `written_only` aside, every generated token that was run.
    fn held(&self, r: &Running, f: &Finished, written_only: bool) -> Vec<i32> {
        let prompt_end = r.start + f.prompt_written;
        let mut held = self.req.prompt[..prompt_end].to_vec();
        if !written_only && f.prompt_written == self.prompt_of(r).len() {
            held.extend_from_slice(&f.generated[..f.generated.len().saturating_sub(1)]);
        }
        held
    }
}

/// The batcher, on the thread that owns the model.
pub struct Engine {
    store: AgentStore,
    generator: Generator,
    limits: Limits,
    queue: VecDeque<GenRequest>,
    active: Vec<Active>,
    status: Arc<Mutex<Status>>,
    metrics: Arc<Metrics>,
}

impl Engine {
    /// A batcher over `store`, reporting to `status` and `metrics`.
    pub fn new(
        store: AgentStore,
        text: Arc<Text>,
        limits: Limits,
        status: Arc<Mutex<Status>>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Engine {
            store,
            generator: Generator::with_text(text),
            limits,
            queue: VecDeque::new(),
            active: Vec::new(),
            status,
            metrics,
        }
    }

    /// Serves requests from `rx` until every sender is gone, then parks the agents' K/V in
    /// their session files.
    pub fn run(mut self, rx: Receiver<GenRequest>) -> kvplug::Result<()> {
        self.report();
        loop {
            if self.active.is_empty() && self.queue.is_empty() {
                // Idle: wake now and then to expire parked agents.
                match rx.recv_timeout(IDLE_WAKE) {
                    Ok(r) => self.enqueue(r),
                    Err(RecvTimeoutError::Timeout) => {
                        self.store.check_warm();
                        self.report();
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => break,
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
            self.store.check_warm();
            self.report();
        }
        self.store.park_all()
    }

    /// Queues `r`, or answers 429 when the server already holds `parallel + max_queue`
    /// requests (counting those queued but not yet admitted into free slots: requests that
    /// arrive together are all queued before any is admitted).
    fn enqueue(&mut self, r: GenRequest) {
        // Requests whose client has gone (a refused batch's other prompts) hold nothing.
        self.queue.retain(|r| !r.events.is_closed());
        let held = self.active.len() + self.queue.len();
        if held >= self.limits.parallel + self.limits.max_queue {
            let _ = r.events.send(Event::Failed(ApiError::busy(
                format!(
                    "the server holds {held} requests (at most {} in flight and {} waiting): \
                     retry later",
                    self.limits.parallel, self.limits.max_queue
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
            // The completions of prompts still prefilling write once they fork, and an
            // anchoring prefill's prompt goes on past its anchor.
            let forks: usize = self
                .active
                .iter()
                .filter(|a| a.running.iter().any(|r| r.choice.is_none()))
                .map(|a| {
                    let rest = match (a.anchoring, a.placed.anchor_at) {
                        (true, Some(at)) => a.req.prompt.len() - at,
                        _ => 0,
                    };
                    a.req.n * a.req.opts.max_tokens.max(1) + rest
                })
                .sum();
            // Each completion writes its last prompt token and all it generates but the last
            // (the first completion's prompt token is the prompt's).
            let extra = r.n * r.opts.max_tokens.max(1) - 1 + self.generator.outstanding() + forks;
            // A scored prompt runs every token: it reuses nothing.
            let reuse = r.opts.prompt_logprobs.is_none();
            match self
                .store
                .admit(r.agent.as_deref(), &r.prompt, extra, reuse)
            {
                Ok(Some(placed)) => {
                    // n completions need n - 1 more sequences, taken now.
                    let reserved = match self.store.reserve(r.n - 1, r.agent.as_deref()) {
                        Ok(Some(seqs)) => seqs,
                        refused => {
                            let (agent, prompt) = (r.agent.clone(), r.prompt.clone());
                            self.store.finish(
                                agent.as_deref(),
                                placed.seq,
                                &prompt[..placed.history],
                            )?;
                            if self.active.is_empty() || refused.is_err() {
                                let req = self.queue.remove(i).expect("index in range");
                                let why = match refused {
                                    Err(e) => e.to_string(),
                                    Ok(_) => format!(
                                        "{} completions need more sequences than are free",
                                        req.n
                                    ),
                                };
                                let _ = req
                                    .events
                                    .send(Event::Failed(ApiError::unavailable(why, 1)));
                                continue;
                            }
                            break;
                        }
                    };
                    let req = self.queue.remove(i).expect("index in range");
                    let divergence =
                        self.store
                            .explain(req.agent.as_deref(), &req.prompt, placed.history);
                    if let Some(d) = &divergence {
                        tracing::debug!(?d, "prefix reuse");
                    }
                    self.metrics.admitted(req.prompt.len(), placed.history);
                    let _ = req.events.send(Event::Admitted {
                        cached_tokens: placed.history,
                        divergence,
                    });
                    let mut a = Active {
                        req,
                        placed,
                        running: Vec::new(),
                        reserved,
                        main_open: true,
                        done: 0,
                        started: false,
                        anchoring: placed.anchor_at.is_some(),
                        main_held: placed.history,
                    };
                    let last = a.req.prompt.len() - 1;
                    let started = if a.anchoring {
                        self.start(&mut a, None, placed.seq, placed.history)
                    } else if a.req.n == 1 {
                        self.start(&mut a, Some(0), placed.seq, placed.history)
                    } else if placed.history < last {
                        self.start(&mut a, None, placed.seq, placed.history)
                    } else {
                        self.fork(&mut a, Vec::new())
                    };
                    self.keep_if_started(a, started)?;
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

    /// Adds `a`'s generator request for completion `choice` (or the shared prefill) on
    /// `seq` from position `start`.
    fn start(
        &mut self,
        a: &mut Active,
        choice: Option<usize>,
        seq: i32,
        start: usize,
    ) -> kvplug::Result<()> {
        let mut opts = match choice {
            // The shared prefill samples nothing: it never keeps a step off the device argmax.
            // It scores the prompt where that is asked for (nothing is then reused, so it is
            // not anchoring).
            None => GenOptions {
                device_argmax: true,
                prompt_logprobs: a.req.opts.prompt_logprobs,
                ..GenOptions::default()
            },
            Some(c) => GenOptions {
                sampler: a.req.opts.sampler.fork(c as u64),
                prompt_logprobs: a.req.opts.prompt_logprobs.filter(|_| a.completion_scores()),
                ..a.req.opts.clone()
            },
        };
        if choice == Some(0) {
            opts.sampler = a.req.opts.sampler.clone();
        }
        let greedy = a.req.opts.sampler.is_greedy();
        if choice.is_some() && a.req.speculative.unwrap_or(self.limits.speculate && greedy) {
            let draft = self.limits.draft.clone().unwrap_or(Draft::Ngram);
            opts.speculate = Some(Speculation {
                earlier: a.req.prompt[..start].to_vec(),
                ..Speculation::new(draft)
            });
        }
        let mut r = Running {
            request: 0,
            choice,
            seq,
            start,
            held_logprobs: Vec::new(),
        };
        let prompt = a.prompt_of(&r);
        r.request = match (choice, a.anchoring) {
            // It stops before the prompt's last token, which each completion feeds.
            (None, false) => {
                let last = *a.req.prompt.last().expect("a prompt has a token");
                self.generator.add_prefix(seq, prompt, last, start, opts)?
            }
            _ => self.generator.add(seq, prompt, start, opts)?,
        };
        a.running.push(r);
        Ok(())
    }

    /// The `n` completions of a prefilled prompt: each on a sequence sharing its cells but
    /// the last token's, which every completion feeds itself (the others' sequences were
    /// reserved at admission). A scored prompt's scores (the shared prefill's, none for a
    /// prompt of one token) go out first.
    fn fork(&mut self, a: &mut Active, scores: Vec<TokenLogprobs>) -> kvplug::Result<()> {
        if a.req.opts.prompt_logprobs.is_some() {
            let _ = a.req.events.send(Event::Prompt { logprobs: scores });
        }
        let (main, last) = (a.placed.seq, a.req.prompt.len() - 1);
        for choice in 0..a.req.n {
            let seq = if choice == 0 {
                main
            } else {
                let seq = a.reserved.pop().expect("n - 1 sequences reserved");
                if let Err(e) = self.store.fork(main, seq, last) {
                    a.reserved.push(seq);
                    return Err(e);
                }
                seq
            };
            if let Err(e) = self.start(a, Some(choice), seq, last) {
                if seq != main {
                    self.store.abort(None, seq)?;
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Releases the sequences of requests whose client has gone.
    fn drop_abandoned(&mut self) -> kvplug::Result<()> {
        let mut i = 0;
        while i < self.active.len() {
            if !self.active[i].req.events.is_closed() {
                i += 1;
                continue;
            }
            let a = self.active.swap_remove(i);
            tracing::debug!(seq = a.placed.seq, "client gone: sequences released");
            self.release(a)?;
        }
        Ok(())
    }

    /// Keeps `a` in flight if `started` (its prefill or fork) succeeded; else answers its
    /// client with the error and releases its sequences.
    fn keep_if_started(&mut self, a: Active, started: kvplug::Result<()>) -> kvplug::Result<()> {
        match started {
            Ok(()) => self.active.push(a),
            Err(e) => {
                let _ = a
                    .req
                    .events
                    .send(Event::Failed(ApiError::internal(e.to_string())));
                self.release(a)?;
            }
        }
        Ok(())
    }

    /// Ends `a` early: cancels its generator requests and publishes and releases its
    /// sequences — the prompt's K/V stays in the prefix index (or the agent's sequence),
    /// what was generated is dropped where the cache can cut back to the prompt — and gives
    /// back the sequences it reserved.
    fn release(&mut self, mut a: Active) -> kvplug::Result<()> {
        let main = a.placed.seq;
        for r in std::mem::take(&mut a.running) {
            let f = self.generator.cancel(r.request).expect("in flight");
            let agent = a.req.agent.as_deref().filter(|_| r.seq == main);
            self.close(agent, r.seq, a.held(&r, &f, true), a.held(&r, &f, false))?;
            a.main_open &= r.seq != main;
        }
        if a.main_open {
            // No generator request runs on it: it holds `main_held` prompt tokens.
            let (agent, held) = (a.req.agent.as_deref(), &a.req.prompt[..a.main_held]);
            self.store.finish(agent, main, held)?;
        }
        self.store.unreserve(a.reserved.drain(..));
        self.status.lock().expect("status lock").completed += 1;
        Ok(())
    }

    /// Publishes and releases `seq` cut back to `keep`; a hybrid cache that can no longer
    /// cut back that far (its sliding layers dropped the rows) keeps `written`, all it holds.
    fn close(
        &mut self,
        agent: Option<&str>,
        seq: i32,
        keep: Vec<i32>,
        written: Vec<i32>,
    ) -> kvplug::Result<()> {
        let held = match self.store.truncate(seq, keep.len()) {
            Ok(()) => keep,
            Err(e) if e.plugin_kind() == Some(AbiErrorKind::OutOfWindow) => written,
            Err(e) => return Err(e),
        };
        self.store.finish(agent, seq, &held)
    }

    /// One step of the generator over the requests in flight: their text goes out as it is
    /// released, and those that end are answered and retired.
    fn step(&mut self) -> kvplug::Result<()> {
        let t = Instant::now();
        let active = &mut self.active;
        let metrics = &self.metrics;
        let mut tokens = 0usize;
        let sent = self.generator.step(self.store.context(), &mut |e| {
            tokens += 1;
            let Some(a) = active
                .iter_mut()
                .find(|a| a.running.iter().any(|r| r.request == e.request))
            else {
                return Ok(());
            };
            if !a.started {
                a.started = true;
                metrics.first_token(a.req.arrived.elapsed());
                if a.completion_scores() {
                    let logprobs = e.prompt_logprobs.clone();
                    let _ = a.req.events.send(Event::Prompt { logprobs });
                }
            }
            let r = a
                .running
                .iter_mut()
                .find(|r| r.request == e.request)
                .expect("its request");
            // A token's log-probability goes out with its text: held with it, and left out
            // with a stop token or a stop string, which end the answer but are not in it
            // (as OpenAI's), so an answer's tokens spell its text, streamed or not.
            if let Some(l) = e.logprobs.as_ref() {
                if !e.stop_token {
                    r.held_logprobs.push(l.clone());
                }
            }
            let out = r.held_logprobs.len().saturating_sub(e.held);
            if !e.text.is_empty() || out > 0 {
                let _ = a.req.events.send(Event::Token {
                    choice: r.choice.unwrap_or(0),
                    text: e.text.clone(),
                    logprobs: r.held_logprobs.drain(..out).collect(),
                });
            }
            Ok(())
        });
        let done = match sent {
            Ok(done) => done,
            Err(e) => {
                tracing::error!("forward failed: {e}");
                self.generator.cancel_all();
                // The K/V the step was writing may be partial: every sequence is dropped.
                for a in std::mem::take(&mut self.active) {
                    let _ = a.req.events.send(Event::Failed(ApiError::internal(format!(
                        "forward failed: {e}"
                    ))));
                    let main = a.placed.seq;
                    let mut seqs: Vec<i32> = a.running.iter().map(|r| r.seq).collect();
                    if a.main_open && !seqs.contains(&main) {
                        seqs.push(main);
                    }
                    for seq in seqs {
                        self.store
                            .abort(a.req.agent.as_deref().filter(|_| seq == main), seq)?;
                    }
                    self.store.unreserve(a.reserved);
                }
                return Ok(());
            }
        };
        self.metrics.step(t.elapsed(), tokens);
        self.status.lock().expect("status lock").steps += 1;
        for f in done {
            self.retire(f)?;
        }
        Ok(())
    }

    /// A generator request ended: the shared prefill forks the completions; a completion is
    /// answered and its sequence published and released (the agent's kept).
    fn retire(&mut self, f: Finished) -> kvplug::Result<()> {
        let i = self
            .active
            .iter()
            .position(|a| a.running.iter().any(|r| r.request == f.request))
            .expect("in flight");
        let mut a = self.active.swap_remove(i);
        let at = a
            .running
            .iter()
            .position(|r| r.request == f.request)
            .expect("its request");
        let mut r = a.running.remove(at);
        let Some(choice) = r.choice else {
            if a.anchoring {
                // The prompt is in up to where it departs from a recent request: published
                // there, the rest is prefilled (n > 1) or the completion starts.
                a.anchoring = false;
                let from = a.placed.anchor_at.expect("anchoring");
                a.main_held = from;
                let (seq, last) = (a.placed.seq, a.req.prompt.len() - 1);
                let go_on = self
                    .store
                    .publish(seq, &a.req.prompt[..from])
                    .and_then(|()| match a.req.n {
                        1 => self.start(&mut a, Some(0), seq, from),
                        _ if from < last => self.start(&mut a, None, seq, from),
                        _ => self.fork(&mut a, Vec::new()),
                    });
                return self.keep_if_started(a, go_on);
            }
            // The shared prompt is in: the completions fork from it.
            a.main_held = a.req.prompt.len() - 1;
            let forked = self.fork(&mut a, f.prompt_logprobs);
            return self.keep_if_started(a, forked);
        };
        let agent = a.req.agent.clone().filter(|_| r.seq == a.placed.seq);
        a.main_open &= r.seq != a.placed.seq;
        if f.reason == Finish::Failed {
            // Its grammar failed: the request fails, its other completions end with it.
            let why = f.error.clone().unwrap_or_default();
            let _ = a
                .req
                .events
                .send(Event::Failed(ApiError::invalid(None, why)));
            self.store
                .finish(agent.as_deref(), r.seq, &a.held(&r, &f, false))?;
            return self.release(a);
        }
        // The held text was no stop string: it goes out with its tokens' log-probabilities
        // (after a stop string, those held are in it and dropped).
        let logprobs = match f.stop_string {
            Some(_) => Vec::new(),
            None => std::mem::take(&mut r.held_logprobs),
        };
        if !f.text_tail.is_empty() || !logprobs.is_empty() {
            let _ = a.req.events.send(Event::Token {
                choice,
                text: f.text_tail.clone(),
                logprobs,
            });
        }
        if !a.started {
            // It sampled nothing (`max_tokens` 0): its prompt's scores come now.
            a.started = true;
            if a.completion_scores() {
                let logprobs = f.prompt_logprobs.clone();
                let _ = a.req.events.send(Event::Prompt { logprobs });
            }
        }
        let finish_reason = match f.reason {
            Finish::Length | Finish::Prefilled => "length",
            _ => "stop",
        };
        self.metrics.generated(f.generated.len(), f.speculation);
        // The bookkeeping comes before `Done`: a client that has its answer finds the
        // request counted (and its K/V published) when it asks next.
        let finished = self
            .store
            .finish(agent.as_deref(), r.seq, &a.held(&r, &f, false));
        if finished.is_ok() {
            a.done += 1;
            if a.done == a.req.n {
                self.status.lock().expect("status lock").completed += 1;
            }
        }
        let _ = a.req.events.send(Event::Done {
            choice,
            finish_reason,
            completion_tokens: f.generated.len(),
            speculation: f.speculation,
            stop_string: f.stop_string.clone(),
        });
        finished?;
        if a.done < a.req.n {
            self.active.push(a);
        }
        Ok(())
    }

    fn report(&self) {
        let cache = self.store.cache().stats().ok().map(CacheReport::from);
        let (masks, mask_time) = self.generator.mask_stats();
        self.metrics.engine(
            self.queue.len(),
            self.active.len(),
            cache.as_ref(),
            self.store.agents_hot_and_parked(),
            self.store.warm_usage(),
            (masks, mask_time),
        );
        let mut s = self.status.lock().expect("status lock");
        (s.active, s.queued, s.cache) = (self.active.len(), self.queue.len(), cache);
        s.parked = self.store.warm_usage();
    }
}
