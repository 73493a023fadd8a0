//! Hostile chat templates (a model file's `chat_template` is a program from the download) through
//! `run`, `chat` and `serve`: each ends in a one-line error, its time bounded by the sandbox, in bounded memory,
//! and the server answers that request with an error and keeps serving. Needs
//! `cargo build --workspace` and the SmolLM2 model (scripts/fetch-models.sh; make test does).

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use serde_json::{json, Value};

mod common;
use common::server::Server;
use common::{cpu_plugins, peak_child_rss_kib};

/// Templates that exhaust memory, time or output, and what the error names (`|` separates
/// alternatives).
const HOSTILE: [(&str, &str); 6] = [
    // A string doubled 64 times: 2^64 bytes in a few instructions.
    (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        "MiB",
    ),
    // A list doubled 40 times.
    (
        "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l|length }}",
        "MiB",
    ),
    // Doubling through macro recursion, no loop.
    (
        "{% macro f(s, n) %}{% if n > 0 %}{{ f(s ~ s, n - 1) }}{% else %}{{ s|length }}{% endif %}{% endmacro %}{{ f('x', 60) }}",
        "MiB",
    ),
    // 10^15 iterations: the fuel runs out, or on a slow machine the sandbox's CPU limit comes
    // first (the in-process unit test `a_runaway_template_stops` checks the fuel alone).
    (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}x{% endfor %}{% endfor %}{% endfor %}",
        "fuel|s limit",
    ),
    // Endless output, 100 kB per few instructions.
    (
        "{% for i in range(10000) %}{% for j in range(10000) %}{{ 'x' * 100000 }}{% endfor %}{% endfor %}",
        "16 MiB",
    ),
    // Recursion without end.
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursion"),
];

/// Wall-clock bound per command, in seconds: a hang guard, not a speed bound (the sandbox's own
/// limits are 10 s of CPU and 20 s of wall time; a model load in a debug build takes seconds).
const SECONDS: u64 = 300;
/// Peak RSS bound over every child (and their sandboxes), in KiB.
const MAX_RSS_KIB: i64 = 1 << 20;

/// SmolLM2's model directory (served from its GGUF in place) copied to `dir`, with `template`
/// as its chat template.
fn model_with(template: &str, dir: &Path) {
    let gguf =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        gguf.exists(),
        "run scripts/fetch-models.sh (make test does)"
    );
    let src = kvplug::formats::gguf::resolve_model(&gguf).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    let path = dir.join("tokenizer_config.json");
    let mut config: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    config["chat_template"] = template.into();
    std::fs::write(path, config.to_string()).unwrap();
}

/// Runs `kvplug ARGS` with `stdin`, under `timeout`; asserts a short failure naming `says`.
fn refused(plugins: &Path, args: &[&str], stdin: &str, says: &str) {
    let started = Instant::now();
    let mut child = Command::new("timeout")
        .arg(SECONDS.to_string())
        .arg(common::kvplug_bin())
        .arg("--plugins")
        .arg(plugins)
        .args(args)
        .env_remove("KVPLUG_PLUGIN_PATH")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _ = child.stdin.take().unwrap().write_all(stdin.as_bytes());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{args:?}: {:?} (124 = timed out), stderr: {err}",
        out.status
    );
    assert!(names(&err, says), "{args:?}: '{says}' not in: {err}");
    assert!(
        err.lines().filter(|l| !l.trim().is_empty()).count() <= 2,
        "{args:?}: {err}"
    );
    eprintln!(
        "{args:?}: {:.1} s: {}",
        started.elapsed().as_secs_f64(),
        err.trim()
    );
}

/// Whether `err` names one of `says`'s `|`-separated alternatives.
fn names(err: &str, says: &str) -> bool {
    says.split('|').any(|s| err.contains(s))
}

#[test]
fn hostile_templates_end_in_errors_and_the_server_keeps_serving() {
    let plugins = cpu_plugins();
    let tmp = tempfile::tempdir().unwrap();
    for (i, (template, says)) in HOSTILE.iter().enumerate() {
        let dir = tmp.path().join(format!("m{i}"));
        model_with(template, &dir);
        let m = dir.to_str().unwrap();
        refused(
            plugins.path(),
            &["run", "--model", m, "--prompt", "Hi", "--max-tokens", "2"],
            "",
            says,
        );
        refused(
            plugins.path(),
            &["chat", "--model", m, "--max-tokens", "2"],
            "Hi\n",
            says,
        );
    }
    // One server per hostile template would cost a model load each: two of the kinds suffice
    // to show that a request fails alone (memory, then time).
    for (i, (template, says)) in [HOSTILE[0], HOSTILE[3]].iter().enumerate() {
        let dir = tmp.path().join(format!("s{i}"));
        model_with(template, &dir);
        let server = Server::start(&dir, &[]);
        let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2});
        for _ in 0..2 {
            let started = Instant::now();
            let (status, v) = server.post("/v1/chat/completions", &chat, &[]);
            assert!(status == 400 || status == 500, "{status}: {v}");
            let message = v["error"]["message"].as_str().unwrap_or_default();
            assert!(names(message, says), "{v}");
            eprintln!("serve: {:.1} s: {message}", started.elapsed().as_secs_f64());
        }
        // Still serving: a raw completion needs no template.
        let v = server.ok(
            "/v1/completions",
            &json!({"prompt": "The capital of France is", "max_tokens": 3}),
            &[],
        );
        assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
        server.stop();
    }
    // Few instructions, each slow: the sandbox's CPU limit ends it.
    let dir = tmp.path().join("slow");
    model_with(
        "{% for i in range(1000) %}{% for j in range(1000) %}{% set s = ('x' * 10000000).upper() %}{% endfor %}{% endfor %}",
        &dir,
    );
    let m = dir.to_str().unwrap();
    refused(
        plugins.path(),
        &["run", "--model", m, "--prompt", "Hi"],
        "",
        "10 s limit",
    );
    let rss = peak_child_rss_kib();
    assert!(rss < MAX_RSS_KIB, "a child peaked at {rss} KiB");
}
