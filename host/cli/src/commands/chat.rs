//! `kvplug chat`: a conversation on a terminal (a line editor with history, multi-line
//! input, commands, Ctrl-C stopping an answer) or over a pipe (a turn per line).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};

use anyhow::{bail, Context, Result};
use kvplug::{Chat, ChatOptions, KvDtype, Runtime};
use kvplug::{SessionDir, SessionLock};

use crate::sampling::SamplingArgs;

/// Arguments of `kvplug chat`.
#[derive(clap::Args)]
pub struct Args {
    /// Model: a directory with a tokenizer and chat template, or a GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// Backend id.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// A system message opening the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Most tokens per answer.
    #[arg(short = 'n', long, visible_alias = "max-new", default_value_t = 256)]
    max_tokens: usize,
    /// Cache capacity in cells (the whole conversation; older messages are left out beyond
    /// it). Default: the model's trained context, bounded by half the available memory.
    #[arg(long)]
    capacity: Option<usize>,
    /// KV storage dtype (default: the session's, else f16).
    #[arg(long)]
    kv_dtype: Option<String>,
    /// A named session: resumed (K/V, tokens, messages; no re-prefill) when it exists,
    /// saved after every turn.
    #[arg(long, value_name = "NAME")]
    session: Option<String>,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    model_flags: crate::model_flags::ModelFlags,
    #[command(flatten)]
    attention: crate::model_flags::AttentionFlag,
    /// Speculative decoding, drafting with KIND: `ngram` (prompt lookup over the
    /// conversation), `draft:PATH` or `layers:N`. Answers are those plain decoding gives.
    #[arg(long, value_name = "KIND")]
    speculative: Option<kvplug::DraftKind>,
    /// One JSON object per turn instead of streamed text.
    #[arg(long)]
    json: bool,
}

pub fn run(runtime: &Runtime, sessions: &SessionDir, a: Args) -> Result<ExitCode> {
    if a.max_tokens == 0 {
        bail!("--max-tokens 0 would answer nothing: give at least 1");
    }
    sessions.sweep();
    // Held until the chat ends (or moves to another name): a second process on the same
    // session is refused.
    let lock = a.session.as_deref().map(|n| sessions.lock(n)).transpose()?;
    let model = a
        .model_flags
        .builder(runtime, &a.backend, &a.model)
        .attention(a.attention.get())
        .build_model()?;
    let session = match &a.session {
        Some(name) => Some(sessions.path_for_write(name)?),
        None => None,
    };
    let kv_dtype: Option<KvDtype> = a.kv_dtype.as_deref().map(str::parse).transpose()?;
    let capacity = match a.capacity {
        Some(c) => c,
        None => kvplug::default_capacity(model.dir(), kv_dtype.unwrap_or(KvDtype::F16))?,
    };
    if let Some(n) = kvplug::trained_context(model.dir())?.filter(|&n| n < capacity as u64) {
        eprintln!(
            "warning: a capacity of {capacity} tokens passes the {n} positions the model was \
             trained on (max_position_embeddings): a conversation past them may degrade"
        );
    }
    let opts = ChatOptions {
        system: a.system,
        capacity,
        kv_dtype,
        max_tokens: a.max_tokens,
        sampler: a.sampling.sampler(),
        session,
        cancel: Some(STOP.clone()),
        speculate: match &a.speculative {
            Some(kind) => Some(kvplug::Speculation::new(kvplug::Draft::open(kind, &model)?)),
            None => None,
        },
    };
    let mut chat = Chat::new(&model, opts)?;
    if let Some(r) = chat.restored() {
        eprintln!(
            "[resumed: {} messages, {} tokens of K/V restored in {:.0} ms]",
            r.messages,
            r.tokens,
            r.seconds * 1e3
        );
    }
    let mut repl = Repl {
        chat: &mut chat,
        sessions,
        lock,
        json: a.json,
        last: None,
    };
    repl.run()
}

/// Set by SIGINT while an answer is produced (its prompt's prefill included): the answer
/// stops, the chat goes on. Made before the handler is installed (the chat's options hold it).
static STOP: LazyLock<Arc<AtomicBool>> = LazyLock::new(|| Arc::new(AtomicBool::new(false)));

extern "C" fn on_sigint(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

const HELP: &str = "\
/help            this text
/clear           start a new conversation (the system message stays; a saved session keeps
                 the previous one)
/system TEXT     start a new conversation with this system message (empty: none)
/save NAME       save the conversation as session NAME (a new one, or its own), and after
                 every turn from now on
/load NAME       continue session NAME instead
/stats           messages, tokens in the cache, capacity, the last turn's speed
/exit, /bye      leave (so do Ctrl-D and the end of input)
\"\"\"            on a line of its own: starts or ends a multi-line message
//TEXT           sends /TEXT to the model
Ctrl-C stops an answer (the turn is dropped) or clears the line being typed.";

/// The chat's loop: input, commands, turns.
struct Repl<'a> {
    chat: &'a mut Chat,
    sessions: &'a SessionDir,
    /// The lock of the session the chat saves to.
    lock: Option<SessionLock>,
    json: bool,
    last: Option<kvplug::TurnReport>,
}

impl Repl<'_> {
    fn run(&mut self) -> Result<ExitCode> {
        use std::io::IsTerminal;
        let mut input = if std::io::stdin().is_terminal() {
            let editor = rustyline::DefaultEditor::new().context("the line editor")?;
            // After the editor, which takes SIGINT for itself when it is made (a key press
            // cannot raise it while a line is read: the terminal is raw then).
            // SAFETY: the handler only stores to an atomic.
            unsafe { libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t) };
            eprintln!("[/help lists commands; Ctrl-D leaves]");
            Input::Editor(Box::new(editor))
        } else {
            Input::Lines(std::io::stdin().lock())
        };
        while let Some(text) = input.next()? {
            let text = text.trim();
            if text.is_empty() {
                continue;
            }
            let message = match text.strip_prefix('/') {
                Some(rest) if rest.starts_with('/') => rest,
                Some(command) => match self.command(command) {
                    Ok(true) => continue,
                    Ok(false) => break,
                    Err(e) => {
                        eprintln!("kvplug: {e:#}");
                        continue;
                    }
                },
                None => text,
            };
            match self.turn(message) {
                // At a terminal a failed turn (a message past the capacity, a full disk) is
                // told and the conversation goes on; a script stops at it.
                Err(e) if matches!(input, Input::Editor(_)) => {
                    println!();
                    eprintln!("kvplug: {e:#}");
                }
                done => done?,
            }
        }
        Ok(ExitCode::SUCCESS)
    }

    /// Runs a command (without its `/`); false to leave.
    fn command(&mut self, line: &str) -> Result<bool> {
        let (name, arg) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
        let arg = arg.trim();
        match name {
            "exit" | "bye" | "quit" => return Ok(false),
            "help" | "?" => eprintln!("{HELP}"),
            "clear" | "system" => {
                let left = self.chat.clear((name == "system").then_some(arg));
                let with = if name == "system" {
                    " with this system message"
                } else {
                    ""
                };
                eprintln!("[new conversation{with}]");
                if let Some(file) = left {
                    // The session keeps the previous conversation; its lock goes with it.
                    self.lock = None;
                    eprintln!(
                        "[{} keeps the previous one: /save NAME saves this one]",
                        file.display()
                    );
                }
            }
            "save" | "load" if arg.is_empty() => bail!("/{name} takes a session name"),
            "save" => {
                let path = self.sessions.path_for_write(arg)?;
                let lock = self.lock_for(arg)?;
                // Another conversation saved under the name is not written over.
                if path.exists() && self.chat.stats().session.as_ref() != Some(&path) {
                    bail!(
                        "session '{arg}' exists: /save NAME takes a new name (/load {arg} \
                         continues it; `kvplug session rm {arg}` deletes it)"
                    );
                }
                let bytes = self.chat.save_as(path)?;
                self.hold(lock);
                eprintln!("[saved as {arg}: {bytes} bytes; later turns are saved there too]");
            }
            "load" => {
                let path = self.sessions.path(arg)?;
                // Checked before locking: a lock file is not left for a name with no session.
                if !path.exists() {
                    bail!("no session '{arg}' to load (`kvplug session ls` lists them)");
                }
                let lock = self.lock_for(arg)?;
                let r = self.chat.load(path)?;
                self.hold(lock);
                eprintln!(
                    "[loaded {arg}: {} messages, {} tokens of K/V restored in {:.0} ms]",
                    r.messages,
                    r.tokens,
                    r.seconds * 1e3
                );
            }
            "stats" => {
                let s = self.chat.stats();
                eprintln!(
                    "[{} messages, {} of {} tokens in the cache{}]",
                    s.messages,
                    s.tokens,
                    s.capacity,
                    s.session
                        .map_or(String::new(), |p| format!(", saved to {}", p.display()))
                );
                if let Some(r) = &self.last {
                    eprintln!("[last turn: {}]", summary(r));
                }
            }
            _ => bail!("unknown command /{name}: /help lists them (//{name} sends it as text)"),
        }
        Ok(true)
    }

    /// Holds `lock`, the lock of the session the chat moved to; `None` (it stayed on its own
    /// session) keeps the lock it holds.
    fn hold(&mut self, lock: Option<SessionLock>) {
        if lock.is_some() {
            self.lock = lock;
        }
    }

    /// The lock of session `name`, unless the chat holds it already.
    fn lock_for(&self, name: &str) -> Result<Option<SessionLock>> {
        let current = self.chat.stats().session;
        if current.is_some() && current == Some(self.sessions.path(name)?) {
            return Ok(None);
        }
        Ok(Some(self.sessions.lock(name)?))
    }

    fn turn(&mut self, message: &str) -> Result<()> {
        let json = self.json;
        STOP.store(false, Ordering::SeqCst);
        let done = self.chat.turn(message, &mut |piece| {
            if STOP.load(Ordering::SeqCst) {
                return Err(kvplug::Error::Invalid("stopped".into()));
            }
            if !json {
                print!("{piece}");
                std::io::stdout().flush()?;
            }
            Ok(())
        });
        let report = match done {
            Ok(r) => r,
            Err(_) if STOP.swap(false, Ordering::SeqCst) => {
                println!();
                eprintln!("[stopped: this turn is not kept]");
                return Ok(());
            }
            Err(e) => return Err(e.into()),
        };
        if report.dropped_messages > 0 {
            eprintln!(
                "[the conversation outgrew the capacity ({}): its {} oldest messages were left \
                 out and the rest prefilled again]",
                self.chat.stats().capacity,
                report.dropped_messages
            );
        }
        if json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            println!();
            eprintln!("[{}]", summary(&report));
        }
        self.last = Some(report);
        Ok(())
    }
}

fn summary(r: &kvplug::TurnReport) -> String {
    let drafts = r.speculation.map_or(String::new(), |s| {
        format!("; {} of {} draft tokens accepted", s.accepted, s.drafted)
    });
    format!(
        "prefilled {} tokens, reused {} from the cache; {} generated at {:.1} tok/s{drafts}",
        r.prefilled_tokens,
        r.reused_tokens,
        r.ids.len(),
        r.decode_tok_s
    )
}

/// Where messages come from: a line editor on a terminal, else lines of stdin. Either way
/// a line holding only `"""` starts a message of several lines, ended by another.
enum Input {
    Editor(Box<rustyline::DefaultEditor>),
    Lines(std::io::StdinLock<'static>),
}

/// The line that opens and closes a multi-line message.
const BLOCK: &str = "\"\"\"";

impl Input {
    /// The next message; `None` at the end of input (Ctrl-D).
    fn next(&mut self) -> Result<Option<String>> {
        let Some(first) = self.line("> ")? else {
            return Ok(None);
        };
        if first.trim() != BLOCK {
            return Ok(Some(first));
        }
        let mut lines = Vec::new();
        loop {
            match self.line(". ")? {
                Some(l) if l.trim() == BLOCK => break,
                Some(l) => lines.push(l),
                None => break,
            }
        }
        Ok(Some(lines.join("\n")))
    }

    fn line(&mut self, prompt: &str) -> Result<Option<String>> {
        use rustyline::error::ReadlineError;
        match self {
            Input::Lines(stdin) => {
                Ok(read_turn(stdin)?.map(|l| l.trim_end_matches(['\n', '\r']).to_string()))
            }
            Input::Editor(ed) => loop {
                match ed.readline(prompt) {
                    Ok(line) => {
                        if !line.trim().is_empty() {
                            let _ = ed.add_history_entry(line.as_str());
                        }
                        return Ok(Some(line));
                    }
                    Err(ReadlineError::Interrupted) => eprintln!("[Ctrl-D or /exit leaves]"),
                    Err(ReadlineError::Eof) => return Ok(None),
                    Err(e) => return Err(e).context("reading the terminal"),
                }
            },
        }
    }
}

/// The longest chat line read: 1 MiB, far more than any cache holds as tokens.
const MAX_CHAT_LINE: u64 = 1 << 20;

/// The next line of `input` (without reading more than [`MAX_CHAT_LINE`] bytes of it);
/// `None` at the end.
fn read_turn(input: &mut impl std::io::BufRead) -> Result<Option<String>> {
    use std::io::{BufRead, Read};
    let mut buf = Vec::new();
    let n = input
        .take(MAX_CHAT_LINE + 1)
        .read_until(b'\n', &mut buf)
        .context("reading stdin")?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() != Some(&b'\n') && n as u64 > MAX_CHAT_LINE {
        bail!("a chat line is longer than {MAX_CHAT_LINE} bytes");
    }
    Ok(Some(String::from_utf8(buf).context("stdin is not UTF-8")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_lines_are_read_one_by_one_and_bounded() {
        let mut input = std::io::Cursor::new(b"hi\nthere".to_vec());
        assert_eq!(read_turn(&mut input).unwrap().as_deref(), Some("hi\n"));
        assert_eq!(read_turn(&mut input).unwrap().as_deref(), Some("there"));
        assert_eq!(read_turn(&mut input).unwrap(), None);
        // A line that never ends (as from /dev/zero) stops at the bound.
        let mut endless = std::io::Cursor::new(vec![b'a'; 2 * MAX_CHAT_LINE as usize]);
        let e = read_turn(&mut endless).unwrap_err().to_string();
        assert_eq!(e, "a chat line is longer than 1048576 bytes");
        let mut exact = std::io::Cursor::new(vec![b'a'; MAX_CHAT_LINE as usize]);
        assert_eq!(read_turn(&mut exact).unwrap().unwrap().len(), 1 << 20);
    }
}
