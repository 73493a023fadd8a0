//! `kvplug chat` on a terminal, driven through a pseudo-terminal (rexpect) as a person types:
//! commands are not sent to the model, Ctrl-C stops an answer and clears a line without
//! leaving, a pasted 20,000-character line and a `"""` block each arrive whole (the prompt's
//! token count is checked against the SDK's rendering), and /exit leaves. Needs
//! `cargo build --workspace` and the SmolLM2 model (make test fetches it).

use std::path::Path;
use std::process::Command;

use kvplug::{Message, Text};

mod common;
use common::cpu_plugins;

/// How long any one expectation may wait: a hang guard, not a speed bound. The longest wait is
/// the pasted turn's report (a ~3,500-token prefill and up to 300 tokens in a debug build),
/// about a minute alone on two cores; ten minutes leaves a machine 5× slower, or loaded,
/// room. A crash ends every wait at once (end of file).
const TIMEOUT_MS: u64 = 600_000;

fn smollm2() -> std::path::PathBuf {
    let m =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(m.exists(), "run scripts/fetch-models.sh (make test does)");
    m
}

/// Tokens of the conversation `[user: message]` as the chat renders it.
fn prompt_tokens(text: &Text, message: &str) -> usize {
    let rendered = text.render(&[Message::new("user", message)]).unwrap();
    text.encode(&rendered).unwrap().len()
}

/// Waits for a turn's report; returns prefilled + reused tokens (its prompt's length).
fn turn_tokens(p: &mut rexpect::session::PtySession) -> usize {
    let (_, m) = p
        .exp_regex(r"prefilled \d+ tokens, reused \d+ from")
        .unwrap_or_else(|e| panic!("no turn report: {e}"));
    let n: Vec<usize> = m
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    n[0] + n[1]
}

#[test]
fn a_person_can_chat_on_a_terminal() {
    let plugins = cpu_plugins();
    let sessions = tempfile::tempdir().unwrap();
    let model = smollm2();
    let text = Text::load(&kvplug::formats::gguf::resolve_model(&model).unwrap()).unwrap();
    let mut cmd = Command::new(common::kvplug_bin());
    cmd.arg("--plugins")
        .arg(plugins.path())
        .arg("--session-dir")
        .arg(sessions.path())
        .args([
            "chat",
            "--capacity",
            "8192",
            "--max-tokens",
            "300",
            "--model",
        ])
        .arg(&model)
        .env_remove("KVPLUG_PLUGIN_PATH");
    let mut p = rexpect::session::spawn_command(cmd, Some(TIMEOUT_MS)).unwrap();
    p.exp_string("/help lists commands").unwrap();

    // Commands are the chat's, not the model's.
    p.send_line("/help").unwrap();
    p.exp_string("/system TEXT").unwrap();
    p.send_line("/bogus").unwrap();
    p.exp_string("unknown command /bogus").unwrap();

    // Ctrl-C on a half-typed line clears it and stays.
    p.send("half a line").unwrap();
    p.send_control('c').unwrap();
    p.exp_string("Ctrl-D or /exit leaves").unwrap();

    // Ctrl-C during an answer stops it; the turn is not kept.
    p.send_line("Count from 1 to 1000, one number per line.")
        .unwrap();
    p.exp_string("3. 3").unwrap();
    p.send_control('c').unwrap();
    p.exp_string("[stopped: this turn is not kept]").unwrap();
    p.send_line("/stats").unwrap();
    p.exp_string("[0 messages, ").unwrap();

    // A pasted line of 20,000 characters arrives whole (bracketed paste; the terminal's
    // canonical mode would have cut it at 4095).
    let words = ["apple", "river", "stone", "cloud"];
    let words: Vec<&str> = (0..3500).map(|i| words[i % 4]).collect();
    let pasted = format!("What is the last word? {} end", words.join(" "));
    assert!(pasted.len() > 20_000);
    // In pieces, as a terminal writes a paste (the pty's input queue holds 4 KiB).
    let paste = format!("\x1b[200~{pasted}\x1b[201~\r");
    for piece in paste.as_bytes().chunks(1024) {
        p.send(std::str::from_utf8(piece).unwrap()).unwrap();
        p.flush().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(turn_tokens(&mut p), prompt_tokens(&text, &pasted));

    // A """ block is one message of several lines.
    p.send_line("/clear").unwrap();
    p.exp_string("[new conversation]").unwrap();
    // Each line once its prompt is drawn, as a person types.
    p.exp_string("\x1b[K> ").unwrap();
    p.send_line("\"\"\"").unwrap();
    for line in ["First line.", "Second line.", "\"\"\""] {
        p.exp_string("\x1b[K. ").unwrap();
        p.send_line(line).unwrap();
    }
    assert_eq!(
        turn_tokens(&mut p),
        prompt_tokens(&text, "First line.\nSecond line.")
    );

    // /save keeps the conversation under a name; /exit leaves.
    p.send_line("/save mine").unwrap();
    p.exp_string("[saved as mine").unwrap();
    p.send_line("/exit").unwrap();
    p.exp_eof().unwrap();
    assert!(sessions.path().join("mine.kvsession.safetensors").exists());
}

#[test]
fn a_failed_turn_at_a_terminal_leaves_the_chat_going() {
    let plugins = cpu_plugins();
    let sessions = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(common::kvplug_bin());
    cmd.arg("--plugins")
        .arg(plugins.path())
        .arg("--session-dir")
        .arg(sessions.path())
        .args(["chat", "--capacity", "64", "--max-tokens", "8", "--model"])
        .arg(smollm2())
        .env_remove("KVPLUG_PLUGIN_PATH");
    let mut p = rexpect::session::spawn_command(cmd, Some(TIMEOUT_MS)).unwrap();
    p.exp_string("/help lists commands").unwrap();
    p.exp_string("\x1b[K> ").unwrap();
    // Past the capacity: told, not kept, and the chat goes on.
    p.send_line(&"word ".repeat(100)).unwrap();
    p.exp_string("does not fit the capacity 64").unwrap();
    p.exp_string("\x1b[K> ").unwrap();
    p.send_line("/stats").unwrap();
    p.exp_string("[0 messages, ").unwrap();
    p.send_line("Hi").unwrap();
    turn_tokens(&mut p);
    p.send_line("/exit").unwrap();
    p.exp_eof().unwrap();
}
