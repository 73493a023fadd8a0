//! A multi-turn conversation on one contiguous cache: the cache carries the conversation, so
//! each turn prefills only the tokens the cache does not already hold. With a session file
//! the conversation survives the process: its K/V, tokens and messages are saved after every
//! turn and restored on start, without re-prefilling.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use kvplug_core::KvDtype;
use kvplug_plugin_api::AbiErrorKind;

use crate::fingerprint::model_fingerprint;
use crate::host::Host;
use crate::model::cache_config;
use crate::run::{Forward, Sampler};
use crate::session::DecodeSession;
use crate::session_file::{self, Session};
use crate::text::{Message, Streamer, Text};

/// The `app.*` entry of a chat's session file holding its messages (JSON).
const MESSAGES_KEY: &str = "chat.messages";

/// How a conversation runs.
pub struct ChatOptions {
    /// Backend id.
    pub backend: String,
    /// A system message opening a new conversation.
    pub system: Option<String>,
    /// Cache capacity in cells (the whole conversation).
    pub capacity: usize,
    /// KV storage dtype; `None` = the session file's, else f16.
    pub kv_dtype: Option<KvDtype>,
    /// Most tokens per answer.
    pub max_new: usize,
    /// How tokens are picked.
    pub sampler: Sampler,
    /// A session file: resumed when it exists, written after every turn.
    pub session: Option<PathBuf>,
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
    /// The assistant's answer.
    pub text: String,
    /// Its token ids (ending at the end-of-turn token unless cut at `max_new`).
    pub ids: Vec<i32>,
    /// Prompt tokens already in the cache from earlier turns.
    pub reused_tokens: usize,
    /// Prompt tokens prefilled for this turn.
    pub prefilled_tokens: usize,
    /// Generated tokens per second.
    pub decode_tok_s: f64,
}

/// One conversation: its messages, and the tokens its cache holds.
pub struct Chat {
    text: Text,
    session: DecodeSession,
    fwd: Forward,
    messages: Vec<Message>,
    /// Tokens in the cache, in order (cell i holds `cached[i]`).
    cached: Vec<i32>,
    capacity: usize,
    max_new: usize,
    sampler: Sampler,
    /// The session file and the model's fingerprint.
    file: Option<(PathBuf, String)>,
    restored: Option<Restored>,
}

impl Chat {
    /// A conversation with the model in `model`: resumed from `opts.session` when that file
    /// exists (refused if it belongs to another model, does not fit the capacity, or
    /// conflicts with `opts.kv_dtype` or `opts.system`), else new.
    pub fn new(host: &Host, model: &Path, opts: ChatOptions) -> Result<Self> {
        let text = Text::load(model)?;
        if !text.has_template() {
            bail!(
                "{}: no chat template, so no chat (use kvplug run --raw)",
                model.display()
            );
        }
        let file = opts
            .session
            .map(|p| Ok::<_, anyhow::Error>((p, model_fingerprint(model)?)))
            .transpose()?;
        let t = Instant::now();
        let saved = match &file {
            Some((path, fp)) if path.exists() => {
                let s = session_file::read(path)?;
                s.check_fits(path, fp, opts.capacity)?;
                Some(s)
            }
            _ => None,
        };
        let saved_dtype = saved
            .as_ref()
            .map(|s| s.rows.kv_dtype.parse::<KvDtype>())
            .transpose()?;
        let kv_dtype = match (opts.kv_dtype, saved_dtype) {
            (Some(a), Some(b)) if a != b => {
                bail!("the session stores {b} KV; drop --kv-dtype or pass {b}")
            }
            (a, b) => a.or(b).unwrap_or(KvDtype::F16),
        };
        let cfg = cache_config(model, None, opts.capacity, kv_dtype)?;
        let (session, options) = host.make_decode_session(&opts.backend, &cfg)?;
        let fwd = Forward::load(host, &opts.backend, model, None, options)?;
        let mut messages: Vec<Message> = opts
            .system
            .as_deref()
            .map(|s| Message::new("system", s))
            .into_iter()
            .collect();
        let (mut cached, mut restored) = (Vec::new(), None);
        if let Some(s) = saved {
            let saved_messages: Vec<Message> =
                serde_json::from_str(s.app.get(MESSAGES_KEY).map_or("[]", String::as_str))
                    .context("the session's messages")?;
            if !messages.is_empty() && saved_messages.first() != messages.first() {
                bail!("the session has its own system message; drop --system to resume it");
            }
            session.import_seq(0, &s.rows)?;
            restored = Some(Restored {
                tokens: s.tokens.len(),
                messages: saved_messages.len(),
                seconds: t.elapsed().as_secs_f64(),
            });
            (messages, cached) = (saved_messages, s.tokens);
        }
        Ok(Chat {
            text,
            session,
            fwd,
            messages,
            cached,
            capacity: opts.capacity,
            max_new: opts.max_new,
            sampler: opts.sampler,
            file,
            restored,
        })
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
        let Some((path, fingerprint)) = &self.file else {
            return Ok(None);
        };
        let session = Session {
            rows: self.session.export_seq(0)?,
            tokens: self.cached.clone(),
            model: fingerprint.clone(),
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
    /// as it is produced.
    pub fn turn(
        &mut self,
        user: &str,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<TurnReport> {
        let mut messages = self.messages.clone();
        messages.push(Message::new("user", user));
        let prompt = self.text.encode(&self.text.render(&messages)?)?;
        let reused = prompt
            .iter()
            .zip(&self.cached)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prompt.len() - 1);
        if prompt.len() + self.max_new > self.capacity {
            bail!(
                "the conversation ({} tokens) + max_new ({}) no longer fits the capacity {}",
                prompt.len(),
                self.max_new,
                self.capacity
            );
        }
        let reused = match self.session.rewind(reused) {
            Ok(()) => reused,
            // The sliding layers of a hybrid cache no longer hold the rows the rewound
            // history would need: start the conversation's cache over.
            Err(e) if e.kind == AbiErrorKind::OutOfWindow => {
                self.session.rewind(0)?;
                0
            }
            Err(e) => return Err(e.into()),
        };
        self.cached.truncate(reused);
        let fresh = &prompt[reused..];
        let logits = self.fwd.prefill(fresh, reused, &mut |_| Ok(()))?;
        self.cached.extend_from_slice(fresh);
        let stop = self.text.stop_tokens().clone();
        let mut streamer = Streamer::default();
        let mut ids = vec![self.sampler.sample(&logits)];
        on_text(&streamer.push(&self.text, ids[0])?)?;
        let t = Instant::now();
        while ids.len() < self.max_new && !stop.contains(&ids[ids.len() - 1]) {
            let last = ids[ids.len() - 1];
            let pos = self.cached.len() as i32;
            let logits = self.fwd.call(&[last], &[pos], None)?;
            self.cached.push(last);
            ids.push(self.sampler.sample(&logits[0]));
            on_text(&streamer.push(&self.text, ids[ids.len() - 1])?)?;
        }
        // The last id was sampled but not run; the next turn's prompt decides whether the
        // cache keeps it (a template may render the end of turn differently).
        let answer = self.text.decode(&ids)?;
        messages.push(Message::new("assistant", answer.trim()));
        self.messages = messages;
        self.save()?;
        Ok(TurnReport {
            text: answer,
            decode_tok_s: (ids.len().saturating_sub(1)) as f64
                / t.elapsed().as_secs_f64().max(1e-9),
            ids,
            reused_tokens: reused,
            prefilled_tokens: fresh.len(),
        })
    }
}
