//! `kvplug chat`: one user turn per line of stdin.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use kvplug::session_dir::SessionDir;
use kvplug::{Chat, ChatOptions, Runtime};

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
    #[arg(long, default_value_t = 256)]
    max_new: usize,
    /// Cache capacity in cells (the whole conversation).
    #[arg(long, default_value_t = 4096)]
    capacity: usize,
    /// KV storage dtype (default: the session's, else f16).
    #[arg(long)]
    kv_dtype: Option<String>,
    /// A named session: resumed (K/V, tokens, messages; no re-prefill) when it exists,
    /// saved after every turn.
    #[arg(long, value_name = "NAME")]
    session: Option<String>,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// One JSON object per turn instead of streamed text.
    #[arg(long)]
    json: bool,
}

pub fn run(runtime: &Runtime, sessions: &SessionDir, a: Args) -> Result<ExitCode> {
    sessions.sweep();
    // Held until the chat ends: a second process on the same session is refused.
    let _lock = a.session.as_deref().map(|n| sessions.lock(n)).transpose()?;
    let model = kvplug::open_model(runtime, &a.backend, &a.model)?;
    let session = match &a.session {
        Some(name) => Some(sessions.path_for_write(name)?),
        None => None,
    };
    let opts = ChatOptions {
        system: a.system,
        capacity: a.capacity,
        kv_dtype: a.kv_dtype.as_deref().map(str::parse).transpose()?,
        max_new: a.max_new,
        sampler: a.sampling.sampler(),
        session,
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
    chat_loop(&mut chat, a.json)
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

fn chat_loop(chat: &mut Chat, json: bool) -> Result<ExitCode> {
    use std::io::IsTerminal;
    let tty = std::io::stdin().is_terminal();
    let mut input = std::io::stdin().lock();
    loop {
        if tty {
            eprint!("> ");
        }
        let Some(line) = read_turn(&mut input)? else {
            break;
        };
        let user = line.trim();
        if user.is_empty() {
            continue;
        }
        if user == "/exit" {
            break;
        }
        let report = chat.turn(user, &mut |piece| {
            if !json {
                print!("{piece}");
                std::io::stdout().flush()?;
            }
            Ok(())
        })?;
        if json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            println!();
            eprintln!(
                "[prefilled {} tokens, reused {} from the cache; {} generated at {:.1} tok/s]",
                report.prefilled_tokens,
                report.reused_tokens,
                report.ids.len(),
                report.decode_tok_s
            );
        }
    }
    Ok(ExitCode::SUCCESS)
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
