//! A multi-turn conversation on one contiguous cache: the cache carries the conversation, so
//! each turn prefills only the tokens the cache does not already hold. With a session file
//! the conversation survives the process: its K/V, tokens and messages are saved after every
//! turn and restored on start, without re-prefilling.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use kvplug_core::{CacheKind, KvDtype};
use kvplug_plugin_api::AbiErrorKind;
use kvplug_runtime::{Context as RtContext, Model};

use crate::error::{fail, Context, Error, Result};
use crate::fingerprint::model_fingerprint;
use crate::generator::{generate, Finish, GenOptions};
use crate::harmony::ContentStream;
use crate::sampler::Sampler;
use crate::session_file::{self, Session};
use crate::speculative::{SpecStats, Speculation};
use crate::text::{Message, Text};

/// The `app.*` entry of a chat's session file holding its messages (JSON).
const MESSAGES_KEY: &str = "chat.messages";

/// How a conversation runs.
pub struct ChatOptions {
    /// A system message opening a new conversation.
    pub system: Option<String>,
    /// Cache capacity in cells (the whole conversation).
    pub capacity: usize,
    /// KV storage dtype; `None` = the session file's, else f16.
    pub kv_dtype: Option<KvDtype>,
    /// Most tokens per answer.
    pub max_tokens: usize,
    /// How tokens are picked.
    pub sampler: Sampler,
    /// A session file: resumed when it exists, written after every turn.
    pub session: Option<PathBuf>,
    /// Set (from any thread, or a signal handler) to stop the turn in progress, its
    /// prompt's prefill included: the turn fails and the conversation stays as it was.
    pub cancel: Option<Arc<AtomicBool>>,
    /// Answers speculate so (their tokens are those plain decoding gives; the
    /// conversation's tokens are its `earlier`).
    pub speculate: Option<Speculation>,
}

impl Default for ChatOptions {
    /// No system message, 4,096 cells (as [`crate::Llm::builder`]), the session's K/V dtype
    /// else f16, up to 256 tokens an answer (as `kvplug chat`), greedy, no session file.
    fn default() -> Self {
        ChatOptions {
            system: None,
            capacity: 4096,
            kv_dtype: None,
            max_tokens: 256,
            sampler: Sampler::greedy(),
            session: None,
            cancel: None,
            speculate: None,
        }
    }
}

/// A conversation restored from a session file.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Restored {
    /// Tokens whose K/V came from the file.
    pub tokens: usize,
    /// Messages so far.
    pub messages: usize,
    /// Reading, checking and importing the file, in seconds (the model's fingerprint, taken
    /// before, not included).
    pub seconds: f64,
}

/// What one turn did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TurnReport {
    /// The assistant's answer (a harmony model's content: no reasoning, no markers).
    pub text: String,
    /// Its token ids (ending at the end-of-turn token unless cut at `max_tokens`).
    pub ids: Vec<i32>,
    /// Prompt tokens already in the cache from earlier turns.
    pub reused_tokens: usize,
    /// Prompt tokens prefilled for this turn.
    pub prefilled_tokens: usize,
    /// Generated tokens per second.
    pub decode_tok_s: f64,
    /// The oldest messages (after the system message) left out so the conversation fits the
    /// capacity; what followed them was prefilled again.
    pub dropped_messages: usize,
    /// What speculation did, when the chat speculates.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculation: Option<SpecStats>,
}

/// Where a conversation stands.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ChatStats {
    /// Messages, the system message included.
    pub messages: usize,
    /// Tokens the cache holds.
    pub tokens: usize,
    /// The cache's capacity in tokens.
    pub capacity: usize,
    /// The session file, if any.
    pub session: Option<PathBuf>,
}

/// One conversation: its messages, and the tokens its cache holds.
pub struct Chat {
    text: Arc<Text>,
    ctx: RtContext,
    messages: Vec<Message>,
    /// Tokens in the cache, in order (cell i holds `cached[i]`).
    cached: Vec<i32>,
    /// The lengths of this conversation's newest prompts still in the cache, ascending:
    /// where a hybrid cache keeps the recurrent state (see [`Chat::rewind`]).
    prompt_ends: Vec<usize>,
    capacity: usize,
    max_tokens: usize,
    sampler: Sampler,
    cancel: Option<Arc<AtomicBool>>,
    speculate: Option<Speculation>,
    /// The session file, if any: written after every turn.
    file: Option<PathBuf>,
    /// The model's directory, and its fingerprint once a session needed it.
    dir: PathBuf,
    fingerprint: Option<String>,
    restored: Option<Restored>,
}

impl Chat {
    /// A conversation with `model`: resumed from `opts.session` when that file exists
    /// (refused if it belongs to another model, does not fit the capacity, or conflicts with
    /// `opts.kv_dtype` or `opts.system`), else new.
    pub fn new(model: &Model, opts: ChatOptions) -> Result<Self> {
        if opts.max_tokens == 0 {
            fail!(
                Invalid,
                "max_tokens is 0: an answer needs at least one token"
            );
        }
        let dir = model.dir();
        let text = Arc::new(Text::load(dir)?);
        if !text.has_template() {
            fail!(
                Invalid,
                "{}: no chat template, so no chat (run a raw prompt instead)",
                model.source().display()
            );
        }
        let fingerprint = opts
            .session
            .as_ref()
            .map(|_| model_fingerprint(dir))
            .transpose()?;
        let t = Instant::now();
        let saved = match (&opts.session, &fingerprint) {
            (Some(path), Some(fp)) if path.exists() => {
                let s = session_file::read(path)?;
                let dtype = s.rows.kv_dtype.parse::<KvDtype>()?;
                s.check_fits(path, fp, dtype, model.key_basis(dtype), opts.capacity)?;
                s.check_conversation(path)?;
                Some((s, dtype, path.clone()))
            }
            _ => None,
        };
        let saved_dtype = saved.as_ref().map(|(_, dtype, _)| *dtype);
        let kv_dtype = match (opts.kv_dtype, saved_dtype) {
            (Some(a), Some(b)) if a != b => {
                fail!(Invalid, "the session stores {b} KV, not {a}")
            }
            (a, b) => a.or(b).unwrap_or(KvDtype::F16),
        };
        let ctx = model.context(CacheKind::Contiguous, opts.capacity, kv_dtype)?;
        let messages: Vec<Message> = opts
            .system
            .as_deref()
            .map(|s| Message::new("system", s))
            .into_iter()
            .collect();
        let mut chat = Chat {
            text,
            ctx,
            messages,
            cached: Vec::new(),
            prompt_ends: Vec::new(),
            capacity: opts.capacity,
            max_tokens: opts.max_tokens,
            sampler: opts.sampler,
            speculate: opts.speculate,
            cancel: opts.cancel,
            file: opts.session,
            dir: dir.to_path_buf(),
            fingerprint,
            restored: None,
        };
        if let Some((s, _, path)) = saved {
            let saved_messages = session_messages(&path, &s)?;
            if !chat.messages.is_empty() && saved_messages.first() != chat.messages.first() {
                fail!(
                    Invalid,
                    "the session has its own system message, not the one given"
                );
            }
            chat.restored = Some(chat.restore(&path, s, saved_messages, t)?);
        }
        Ok(chat)
    }

    /// Puts session `s` (read from `path`, checked against this model and capacity) in the
    /// cache in place of the conversation.
    fn restore(
        &mut self,
        path: &Path,
        s: Session,
        messages: Vec<Message>,
        started: Instant,
    ) -> Result<Restored> {
        self.rewind(0)?;
        self.ctx.import_seq(0, &s.rows).map_err(|e| {
            Error::from(e).context(format!("{}: restoring its K/V", path.display()))
        })?;
        let restored = Restored {
            tokens: s.tokens.len(),
            messages: messages.len(),
            seconds: started.elapsed().as_secs_f64(),
        };
        (self.messages, self.cached) = (messages, s.tokens);
        Ok(restored)
    }

    /// The model's fingerprint (taken once).
    fn fingerprint(&mut self) -> Result<String> {
        if self.fingerprint.is_none() {
            self.fingerprint = Some(model_fingerprint(&self.dir)?);
        }
        Ok(self.fingerprint.clone().expect("just set"))
    }

    /// Replaces the conversation with the one saved in `path` (refused, the conversation
    /// untouched, if the file cannot be read, belongs to another model, does not fit the
    /// capacity or stores another KV dtype); later turns save there.
    pub fn load(&mut self, path: PathBuf) -> Result<Restored> {
        let t = Instant::now();
        let fp = self.fingerprint()?;
        let s = session_file::read(&path)?;
        let c = &self.ctx;
        s.check_fits(&path, &fp, c.kv_dtype(), c.key_basis(), self.capacity)?;
        s.check_conversation(&path)?;
        let messages = session_messages(&path, &s)?;
        let restored = self.restore(&path, s, messages, t)?;
        self.file = Some(path);
        Ok(restored)
    }

    /// Saves the conversation to `path` now, and after every later turn; returns its bytes.
    pub fn save_as(&mut self, path: PathBuf) -> Result<u64> {
        self.fingerprint()?;
        self.file = Some(path);
        Ok(self.save()?.expect("a session file was just set"))
    }

    /// Starts a new conversation: no messages but the system message — `system` when given,
    /// else the current one (an empty `system` removes it). The cache keeps what the new
    /// conversation's first prompt still shares with it. The session file, if any, keeps the
    /// conversation as it was: the new one is saved only once [`Chat::save_as`] names a file.
    /// Returns the file it stopped saving to.
    pub fn clear(&mut self, system: Option<&str>) -> Option<PathBuf> {
        let current = self
            .messages
            .first()
            .filter(|m| m.role == "system")
            .cloned();
        let system = match system {
            Some("") => None,
            Some(s) => Some(Message::new("system", s)),
            None => current,
        };
        self.messages = system.into_iter().collect();
        self.file.take()
    }

    /// Where the conversation stands.
    pub fn stats(&self) -> ChatStats {
        ChatStats {
            messages: self.messages.len(),
            tokens: self.cached.len(),
            capacity: self.capacity,
            session: self.file.clone(),
        }
    }

    /// What was restored from the session file, if anything.
    pub fn restored(&self) -> Option<&Restored> {
        self.restored.as_ref()
    }

    /// The conversation so far.
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// Writes the session file (atomically), if the chat has one; returns its bytes.
    pub fn save(&self) -> Result<Option<u64>> {
        let (Some(path), Some(fingerprint)) = (&self.file, &self.fingerprint) else {
            return Ok(None);
        };
        let session = Session {
            rows: self.ctx.export_seq(0)?,
            tokens: self.cached.clone(),
            model: fingerprint.clone(),
            key_basis: self.ctx.key_basis(),
            model_name: crate::fingerprint::model_name(&self.dir),
            app: [(
                MESSAGES_KEY.to_string(),
                serde_json::to_string(&self.messages)?,
            )]
            .into(),
        };
        Ok(Some(session_file::write(path, &session)?))
    }

    /// Answers `user`: renders the whole conversation, reuses the cached tokens it starts
    /// with, prefills the rest, and decodes to the end of the turn. `on_text` gets the answer
    /// as it is produced; its error ends the turn, which then leaves the conversation as it
    /// was (a stopped answer is not kept). When the conversation no longer fits the
    /// capacity with `max_tokens` tokens of answer, its oldest messages after the system
    /// message are left out (the report says how many) and the rest is prefilled again.
    pub fn turn(
        &mut self,
        user: &str,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<TurnReport> {
        let mut messages = self.messages.clone();
        messages.push(Message::new("user", user));
        let first = usize::from(messages.first().is_some_and(|m| m.role == "system"));
        let mut dropped = 0;
        let prompt = loop {
            let prompt = self.text.encode(&self.text.render(&messages)?)?;
            if prompt.len() + self.max_tokens <= self.capacity {
                break prompt;
            }
            if messages.len() - first <= 1 {
                fail!(
                    Invalid,
                    "this message ({} tokens with the system message) + max_tokens ({}) does not \
                     fit the capacity {}",
                    prompt.len(),
                    self.max_tokens,
                    self.capacity
                );
            }
            // The oldest exchange: a user message and what answered it, up to the next user
            // message.
            let end = (first + 1..messages.len() - 1)
                .find(|&i| messages[i].role == "user")
                .unwrap_or(messages.len() - 1);
            dropped += end - first;
            messages.drain(first..end);
        };
        let reused = prompt
            .iter()
            .zip(&self.cached)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prompt.len().saturating_sub(1));
        let reused = self.rewind(reused)?;
        let fresh = &prompt[reused..];
        let opts = GenOptions {
            max_tokens: self.max_tokens,
            sampler: self.sampler.clone(),
            stop_tokens: self.text.stop_tokens().clone(),
            cancel: self.cancel.clone(),
            speculate: self.speculate.clone().map(|s| Speculation {
                earlier: self.cached.clone(),
                ..s
            }),
            // A greedy or top-k chat reads back its tokens or candidates, not rows of logits.
            device_argmax: true,
            ..GenOptions::default()
        };
        let text = Some(self.text.clone());
        // A harmony answer shows its content (final channel, preambles), not its reasoning.
        let mut shown = ContentStream::new(self.text.harmony());
        let mut show = |t: &str| -> Result<()> {
            let t = shown.push(t);
            if t.is_empty() {
                Ok(())
            } else {
                on_text(&t)
            }
        };
        let generated = generate(&mut self.ctx, text, 0, fresh, reused, opts, &mut |e| {
            show(&e.text)
        })
        .and_then(|g| {
            if g.reason == Finish::Cancelled {
                fail!(Invalid, "the turn was stopped");
            }
            show(&g.text_tail)?;
            Ok(g)
        });
        let g = match generated {
            Ok(g) => g,
            Err(e) => {
                // The cache keeps the history the conversation still has.
                self.rewind(reused)?;
                return Err(e);
            }
        };
        // The sampler's stream goes on from where this turn left it.
        self.sampler = g.sampler.clone();
        // Every generated id but the last was run; the next turn's prompt decides whether
        // the cache keeps them (a template may render the end of turn differently).
        self.cached.extend_from_slice(fresh);
        // A recurrent cache keeps the newest few prompt ends: older ones are not tried.
        if self.prompt_ends.len() > kvplug_core::config::PROMPT_END_ANCHORS {
            self.prompt_ends.remove(0);
        }
        self.prompt_ends.push(prompt.len());
        self.cached
            .extend_from_slice(&g.ids[..g.ids.len().saturating_sub(1)]);
        let mut answer = self.text.detokenize(&g.ids)?;
        if self.text.harmony() {
            answer = crate::harmony::parse(&answer, &[], g.reason == Finish::Stop).content;
        }
        messages.push(Message::new("assistant", answer.trim()));
        self.messages = messages;
        self.save()?;
        Ok(TurnReport {
            text: answer,
            decode_tok_s: g.decode_tok_s,
            ids: g.ids,
            reused_tokens: reused,
            prefilled_tokens: fresh.len(),
            dropped_messages: dropped,
            speculation: g.speculation,
        })
    }

    /// Keeps the cache's first `n` tokens, or where a hybrid cache cannot return there
    /// (its sliding layers no longer hold the rows a shorter history needs, or it kept no
    /// recurrent state there) the longest earlier prompt it can return to, else none (all of
    /// it is prefilled again); returns how many it keeps. A template that renders the last
    /// answer differently in the next turn (its reasoning dropped, its text trimmed) makes
    /// `n` fall inside that answer: a recurrent cache then resumes at the end of the
    /// previous prompt, whose state it keeps.
    fn rewind(&mut self, n: usize) -> Result<usize> {
        let earlier = self.prompt_ends.iter().rev().copied().filter(|&e| e < n);
        let mut kept = None;
        for len in std::iter::once(n).chain(earlier) {
            match self.ctx.rewind(len) {
                Ok(()) => {
                    kept = Some(len);
                    break;
                }
                Err(e) if e.kind == AbiErrorKind::OutOfWindow => {}
                Err(e) => return Err(e.into()),
            }
        }
        let kept = match kept {
            Some(k) => k,
            None => {
                self.ctx.rewind(0)?;
                0
            }
        };
        self.cached.truncate(kept);
        self.prompt_ends.retain(|&e| e <= kept);
        Ok(kept)
    }
}

/// The messages a chat's session file holds.
/// The messages saved in session `s`, read from `path`.
fn session_messages(path: &Path, s: &Session) -> Result<Vec<Message>> {
    serde_json::from_str(s.app.get(MESSAGES_KEY).map_or("[]", String::as_str))
        .with_context(|| format!("{}: its messages", path.display()))
}
