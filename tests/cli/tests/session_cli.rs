//! Named sessions shared between processes, through the binary: a crashed writer's leftovers
//! are removed (a live writer's are not), a session in use by one `chat` is refused to a
//! second, and output into a closed pipe ends a command quietly. Needs
//! `cargo build --workspace` and the SmolLM2 model (make test fetches it).

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Output, Stdio};

mod common;
use common::cpu_plugins;

fn kvplug(sessions: &Path) -> Command {
    let mut c = Command::new(common::kvplug_bin());
    c.arg("--session-dir")
        .arg(sessions)
        .env_remove("KVPLUG_PLUGIN_PATH");
    c
}

fn output(c: &mut Command) -> Output {
    c.stdin(Stdio::null()).output().unwrap()
}

fn smollm2() -> String {
    let m =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(m.exists(), "run scripts/fetch-models.sh (make test does)");
    m.to_str().unwrap().to_string()
}

/// `chat` on SmolLM2 with the cpu plugins in `plugins`, 4 tokens per answer, on `session`.
fn chat_on(sessions: &Path, plugins: &Path, session: &str, extra: &[&str]) -> Command {
    let mut c = kvplug(sessions);
    c.arg("--plugins").arg(plugins).args([
        "chat",
        "--model",
        &smollm2(),
        "--max-tokens",
        "4",
        "--session",
        session,
    ]);
    c.args(extra);
    c
}

/// The pid of a process that has ended.
fn dead_pid() -> u32 {
    let mut c = Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    pid
}

#[test]
fn a_crashed_writers_temporaries_are_removed_and_a_live_writers_kept() {
    let sessions = tempfile::tempdir().unwrap();
    /// The stand-in live writer, killed however the test ends.
    struct Live(std::process::Child);
    impl Drop for Live {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let live = Live(Command::new("sleep").arg("3600").spawn().unwrap());
    let stale = sessions
        .path()
        .join(format!(".a.kvsession.safetensors.tmp-{}", dead_pid()));
    let busy = sessions
        .path()
        .join(format!(".b.kvsession.safetensors.tmp-{}", live.0.id()));
    std::fs::write(&stale, vec![0u8; 3_000_000]).unwrap();
    std::fs::write(&busy, b"being written").unwrap();
    let out = output(kvplug(sessions.path()).args(["session", "ls"]));
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("removed 1 temporary file(s) of crashed writers (3.0 MB)"),
        "{err}"
    );
    assert!(!stale.exists() && busy.exists());
    // `chat` sweeps when it starts, too.
    drop(live);
    let out =
        output(kvplug(sessions.path()).args(["chat", "--model", &smollm2(), "--max-tokens", "1"]));
    assert!(out.status.success(), "{out:?}");
    assert!(!busy.exists(), "the writer has ended: its temporary goes");
}

#[test]
fn a_session_in_use_is_refused_to_a_second_process() {
    let sessions = tempfile::tempdir().unwrap();
    let plugins = cpu_plugins();
    let chat = |session: &str| chat_on(sessions.path(), plugins.path(), session, &[]);
    let mut first = chat("dup")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = first.stdin.take().unwrap();
    // Saving under its own name keeps the session held.
    writeln!(stdin, "/save dup").unwrap();
    writeln!(stdin, "Hi").unwrap();
    // Its first answer is out: it holds the session.
    let mut answer = String::new();
    BufReader::new(first.stdout.take().unwrap())
        .read_line(&mut answer)
        .unwrap();
    let second = output(chat("dup").stdin(Stdio::null()));
    let err = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(1), "{second:?}");
    assert!(
        err.contains(&format!(
            "session 'dup' is in use by another process (pid {})",
            first.id()
        )),
        "{err}"
    );
    let rm = output(kvplug(sessions.path()).args(["session", "rm", "dup"]));
    assert!(
        String::from_utf8_lossy(&rm.stderr).contains("in use"),
        "{rm:?}"
    );
    // Another name is free; and once the first has ended, so is its own.
    assert!(output(chat("other").stdin(Stdio::null())).status.success());
    drop(stdin);
    assert!(first.wait().unwrap().success());
    let again = output(chat("dup").stdin(Stdio::null()));
    assert!(again.status.success(), "{again:?}");
    let ls = output(kvplug(sessions.path()).args(["session", "ls"]));
    // Listed with the model's name (its GGUF file's), not only a fingerprint.
    let listed = String::from_utf8_lossy(&ls.stdout).to_string();
    assert!(
        listed
            .lines()
            .any(|l| l.starts_with("dup ") && l.contains("  SmolLM2-135M-Instruct.Q4_1 (")),
        "{listed}"
    );
    // A missing name fails the command, not the names after it.
    let rm = output(kvplug(sessions.path()).args(["session", "rm", "missing", "dup"]));
    assert_eq!(rm.status.code(), Some(1), "{rm:?}");
    assert_eq!(String::from_utf8_lossy(&rm.stdout), "removed dup\n");
    assert!(
        String::from_utf8_lossy(&rm.stderr).contains("no session 'missing'"),
        "{rm:?}"
    );
    let ls = output(kvplug(sessions.path()).args(["session", "ls"]));
    assert!(
        !String::from_utf8_lossy(&ls.stdout).contains("dup "),
        "{ls:?}"
    );
}

#[test]
fn save_does_not_write_over_another_conversation() {
    let sessions = tempfile::tempdir().unwrap();
    let plugins = cpu_plugins();
    // `lines` on stdin, from a file.
    let talk = |c: &mut Command, lines: &str| -> Output {
        let mut input = tempfile::tempfile().unwrap();
        input.write_all(lines.as_bytes()).unwrap();
        std::io::Seek::rewind(&mut input).unwrap();
        c.stdin(input).output().unwrap()
    };
    let kept = talk(
        &mut chat_on(sessions.path(), plugins.path(), "kept", &[]),
        "Hi\n",
    );
    assert!(kept.status.success(), "{kept:?}");
    let file = sessions.path().join("kept.kvsession.safetensors");
    let before = std::fs::read(&file).unwrap();
    let mut other = kvplug(sessions.path());
    other.arg("--plugins").arg(plugins.path()).args([
        "chat",
        "--model",
        &smollm2(),
        "--max-tokens",
        "4",
    ]);
    let out = talk(
        &mut other,
        "Hello\n/load nowhere\n/save kept\n/save fresh\nMore\n",
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{out:?}");
    // A name with no session is refused, and leaves no lock file behind.
    assert!(err.contains("no session 'nowhere' to load"), "{err}");
    assert!(!sessions.path().join(".nowhere.lock").exists());
    assert!(err.contains("session 'kept' exists"), "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), before, "kept is untouched");
    assert!(err.contains("[saved as fresh"), "{err}");
    // The chat's own session is saved again under its name.
    let again = talk(
        &mut chat_on(sessions.path(), plugins.path(), "kept", &[]),
        "Again\n/save kept\n",
    );
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(err.contains("[saved as kept"), "{err}");
    // It fits the model, named as given (not the index directory a GGUF file is served from).
    let show =
        output(kvplug(sessions.path()).args(["session", "show", "kept", "--model", &smollm2()]));
    let listed = String::from_utf8_lossy(&show.stdout);
    assert!(
        listed.contains(&format!("  fits         {}\n", smollm2())),
        "{show:?}"
    );
}

#[test]
fn output_into_a_closed_pipe_ends_quietly() {
    let sessions = tempfile::tempdir().unwrap();
    for args in [&["session", "ls"][..], &["plugins"][..]] {
        let mut fds = [0; 2];
        // SAFETY: pipe fills the two descriptors it is given.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both descriptors were just made, and each is owned once.
        let (reader, writer) = unsafe {
            use std::os::fd::{FromRawFd, OwnedFd};
            (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))
        };
        drop(reader);
        let out = kvplug(sessions.path())
            .args(args)
            .stdin(Stdio::null())
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert!(
            out.stderr.is_empty(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGPIPE),
            "{args:?}: {:?}",
            out.status
        );
    }
}

#[test]
fn a_session_with_rotated_keys_resumes_only_where_keys_are_rotated() {
    let sessions = tempfile::tempdir().unwrap();
    let plugins = cpu_plugins();
    let chat = |extra: &[&str]| chat_on(sessions.path(), plugins.path(), "rot", extra);
    let mut first = chat(&["--kv-dtype", "q4"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    writeln!(first.stdin.take().unwrap(), "Hi").unwrap();
    assert!(first.wait().unwrap().success());
    let ls = output(kvplug(sessions.path()).args(["session", "ls"]));
    let listed = String::from_utf8_lossy(&ls.stdout).to_string();
    assert!(
        listed
            .lines()
            .any(|l| l.starts_with("rot ") && l.contains(" q4  hadamard ")),
        "{listed}"
    );
    let plain = output(chat(&["--no-key-rotation"]).stdin(Stdio::null()));
    let err = String::from_utf8_lossy(&plain.stderr);
    assert_eq!(plain.status.code(), Some(1), "{plain:?}");
    assert!(
        err.contains(
            "keys saved in the hadamard basis; this context keeps its keys in the identity basis"
        ),
        "{err}"
    );
    assert!(output(chat(&[]).stdin(Stdio::null())).status.success());
}

#[test]
fn a_session_a_chat_cannot_resume_does_not_fit_and_is_named() {
    let sessions = tempfile::tempdir().unwrap();
    let plugins = cpu_plugins();
    let mut talk = chat_on(sessions.path(), plugins.path(), "gap", &[])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    writeln!(talk.stdin.take().unwrap(), "Hi").unwrap();
    assert!(talk.wait_with_output().unwrap().status.success());
    // Its checksum still holds: a position held twice, as a seq cache may hold one.
    let file = sessions.path().join("gap.kvsession.safetensors");
    let mut s = kvplug::session_file::read(&file).unwrap();
    let mut positions = s.rows.positions.to_vec();
    positions[3] = 2;
    s.rows.positions = positions.into();
    kvplug::session_file::write(&file, &s).unwrap();
    let why = "gap.kvsession.safetensors: not a valid kvplug session file: row 3 is at position 2";
    let show =
        output(kvplug(sessions.path()).args(["session", "show", "gap", "--model", &smollm2()]));
    assert_eq!(show.status.code(), Some(1), "{show:?}");
    assert!(
        String::from_utf8_lossy(&show.stderr).contains(why),
        "{show:?}"
    );
    let chat = output(&mut chat_on(sessions.path(), plugins.path(), "gap", &[]));
    assert_eq!(chat.status.code(), Some(1), "{chat:?}");
    assert!(
        String::from_utf8_lossy(&chat.stderr).contains(why),
        "{chat:?}"
    );
}
