//! Hostile input through the CLI, built from the reproductions of the hardening issue: every
//! case must end in a one-line error naming the offending value or file, exit status 1 or 2,
//! within seconds and in bounded memory — or, where the input is valid, succeed. Each run is
//! a child process under `timeout`, so a hang or a crash fails the test instead of killing
//! it; the children's peak RSS is checked at the end. Needs `cargo build --workspace`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::{cpu_plugins, peak_child_rss_kib};

/// Wall-clock bound per command: a hang guard, not a speed bound (each command is cheap: a tiny
/// model or a refusal), so a machine 5× slower than CI's stays far inside it.
const SECONDS: &str = "300";
/// Peak RSS bound over every child, in KiB.
const MAX_RSS_KIB: i64 = 1 << 20;

struct Cli {
    plugins: tempfile::TempDir,
}

impl Cli {
    fn new() -> Self {
        Cli {
            plugins: cpu_plugins(),
        }
    }

    /// `kvplug args` under `timeout`, with this test's plugins only.
    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new("timeout");
        c.arg(SECONDS)
            .arg(common::kvplug_bin())
            .arg("--plugins")
            .arg(self.plugins.path())
            .args(args)
            .env_remove("KVPLUG_PLUGIN_PATH");
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().unwrap()
    }

    /// Runs `args` expecting a clean failure whose message contains `says`.
    fn refuses(&self, args: &[&str], says: &str) {
        let out = self.run(args);
        let err = String::from_utf8_lossy(&out.stderr);
        let code = out.status.code();
        assert!(
            matches!(code, Some(1 | 2)),
            "{args:?}: exit {:?} (124 = timed out), stderr: {err}",
            out.status
        );
        assert!(err.contains(says), "{args:?}: '{says}' not in: {err}");
        let lines = err.lines().filter(|l| !l.trim().is_empty()).count();
        assert!(
            lines <= 3,
            "{args:?}: want a short error, got {lines} lines: {err}"
        );
    }

    /// Runs `args` with stdout on a full disk (`/dev/full`): status 1 and a one-line error.
    fn fails_on_full_stdout(&self, args: &[&str]) {
        let out = self
            .command(args)
            .stdout(std::fs::File::create("/dev/full").unwrap())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("No space left") && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }

    fn succeeds(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn synth(&self, dir: &Path) {
        self.succeeds(&[
            "model",
            "synth",
            "--preset",
            "tiny",
            "--out",
            dir.to_str().unwrap(),
        ]);
    }
}

/// Rewrites `dir/model.safetensors` through `edit` (name, shape, bytes → keep?).
fn rewrite_weights(dir: &Path, edit: impl Fn(&str, &mut Vec<usize>, &mut Vec<u8>) -> bool) {
    use safetensors::tensor::TensorView;
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut kept: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        let (mut shape, mut data) = (view.shape().to_vec(), view.data().to_vec());
        if edit(&name, &mut shape, &mut data) {
            kept.push((name, view.dtype(), shape, data));
        }
    }
    let views: Vec<(&str, TensorView<'_>)> = kept
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    safetensors::serialize_to_file(views, meta.metadata().clone(), &path).unwrap();
}

fn mkfifo(path: &Path) {
    assert!(Command::new("mkfifo").arg(path).status().unwrap().success());
}

#[test]
fn hostile_inputs_end_in_clean_errors_in_bounded_time_and_memory() {
    let cli = Cli::new();
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("tiny");
    cli.synth(&model);
    let m = model.to_str().unwrap();
    let run = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = [
            "run",
            "--model",
            m,
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "3",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let refuses = |args: Vec<String>, says: &str| {
        cli.refuses(&args.iter().map(String::as_str).collect::<Vec<_>>(), says)
    };

    // Sizes from the command line, checked before anything is allocated.
    refuses(
        run(&["--speculative", "layers:4294967295"]),
        "layers:4294967295",
    );
    refuses(run(&["--speculative", "layers:1000000"]), "layers:1000000");
    refuses(
        run(&[
            "--speculative",
            "layers:1",
            "--depth",
            "10000",
            "--capacity",
            "4096",
        ]),
        "--depth 10000",
    );
    refuses(
        run(&["--speculative", "ngram", "--width", "4294967295"]),
        "--width 4294967295",
    );
    refuses(
        run(&["--agents", "4", "--capacity", "7"]),
        "the capacity is 7",
    );
    refuses(
        run(&["--capacity", "2147483647"]),
        "capacity 2147483647 is above the limit",
    );
    refuses(
        run(&["--temperature", "-1"]),
        "-1 is not a finite 0 (greedy) or more",
    );
    refuses(run(&["--top-p", "2"]), "2 is outside (0, 1]");
    refuses(
        ["run", "--model", m, "--prompt-ids", "1,-5"]
            .map(String::from)
            .to_vec(),
        "token id -5 is outside the vocabulary of 256",
    );
    refuses(
        [
            "run",
            "--model",
            m,
            "--prompt-ids",
            "1",
            "--max-tokens",
            "0",
        ]
        .map(String::from)
        .to_vec(),
        "--max-tokens 0",
    );
    refuses(
        ["chat", "--model", m, "--max-tokens", "0"]
            .map(String::from)
            .to_vec(),
        "--max-tokens 0",
    );
    refuses(
        ["serve", "--model", m, "--max-tokens", "0", "--port", "0"]
            .map(String::from)
            .to_vec(),
        "max tokens 0 would answer nothing",
    );
    refuses(
        ["serve", "--model", m, "--max-body", "0", "--port", "0"]
            .map(String::from)
            .to_vec(),
        "0 would refuse every request with a body",
    );
    // A refused bench prints no table head.
    let out = cli.run(&["bench", "--model", m, "-r", "0"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "", "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("repetitions must be at least 1"),
        "{out:?}"
    );
    refuses(
        run(&["--system", "Be terse."]),
        "--system goes with --prompt",
    );
    // SmolLM2's GGUF through a copy of its index without the chat template, a directory of
    // the user's: `run` says it takes the prompt raw, and refuses `--system` saying why.
    let smollm2 = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf")
        .canonicalize()
        .unwrap();
    let untemplated = tmp.path().join("untemplated");
    std::fs::create_dir(&untemplated).unwrap();
    for f in std::fs::read_dir(kvplug::formats::resolve_model(&smollm2).unwrap()).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, untemplated.join(f.file_name().unwrap())).unwrap();
    }
    let config = untemplated.join("tokenizer_config.json");
    let mut tc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    tc.as_object_mut().unwrap().remove("chat_template").unwrap();
    std::fs::write(&config, tc.to_string()).unwrap();
    let u = untemplated.to_str().unwrap();
    let text = |extra: &[&str]| -> Vec<String> {
        [
            "run",
            "--model",
            u,
            "--prompt",
            "The capital of France is",
            "-n",
            "2",
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
    };
    let named = u;
    refuses(
        text(&["--system", "Be terse."]),
        &format!("--system needs a chat template, and {named} has none"),
    );
    refuses(
        text(&["--system", "Be terse.", "--raw"]),
        "--system needs the model's chat template (drop --raw)",
    );
    let args = text(&[]);
    let out = cli.run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        out.status.success()
            && String::from_utf8_lossy(&out.stderr).contains(&format!(
                "{named} has no chat template: the prompt runs as raw text"
            )),
        "{out:?}"
    );
    // Output to a full disk is an error like any other, not a panic.
    cli.fails_on_full_stdout(&["plugins"]);
    cli.fails_on_full_stdout(&["plan", "--model", m, "--budget", "1GiB"]);
    refuses(
        [
            "plan",
            "--model",
            m,
            "--budget",
            "1GiB",
            "--agent-tokens",
            "0",
        ]
        .map(String::from)
        .to_vec(),
        "agent tokens 0",
    );
    refuses(
        vec![
            "conform".into(),
            "--backend".into(),
            "cpu".into(),
            "--dtypes".into(),
            "q8g7".into(),
        ],
        "unknown KV dtype 'q8g7'",
    );

    // Missing and malformed model files name the file.
    let missing = tmp.path().join("no-such-model");
    refuses(
        vec![
            "run".into(),
            "--model".into(),
            missing.display().to_string(),
            "--prompt-ids".into(),
            "1".into(),
        ],
        &missing.display().to_string(),
    );
    let bad = tmp.path().join("bad");
    cli.synth(&bad);
    std::fs::write(bad.join("config.json"), "{ not json").unwrap();
    let b = bad.to_str().unwrap().to_string();
    let run_bad = |dir: &str| -> Vec<String> {
        [
            "run",
            "--model",
            dir,
            "--prompt-ids",
            "1,2",
            "--max-tokens",
            "2",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    refuses(run_bad(&b), "config.json");

    // A config whose layer count does not fit 32 bits is refused, not truncated.
    let cfg_text = std::fs::read_to_string(model.join("config.json")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&cfg_text).unwrap();
    cfg["num_hidden_layers"] = serde_json::json!((1u64 << 32) + 2);
    std::fs::write(bad.join("config.json"), cfg.to_string()).unwrap();
    std::fs::remove_file(bad.join("model.safetensors")).unwrap();
    std::fs::copy(
        model.join("model.safetensors"),
        bad.join("model.safetensors"),
    )
    .unwrap();
    // The shard's kv_cache metadata wins for the cache shape; the weights loader reads
    // config.json and must refuse the number.
    refuses(run_bad(&b), "4294967298");

    // Config values and weights kvplug would run wrongly are refused, naming them.
    let wrong = tmp.path().join("wrong");
    cli.synth(&wrong);
    let w = wrong.to_str().unwrap().to_string();
    rewrite_weights(&wrong, |name, _, _| name != "lm_head.weight");
    refuses(run_bad(&w), "missing tensor 'lm_head.weight'");
    cli.synth(&wrong);
    rewrite_weights(&wrong, |name, _, data| {
        if name == "model.layers.1.mlp.up_proj.weight" {
            data[8..12].copy_from_slice(&f32::NAN.to_le_bytes());
        }
        true
    });
    refuses(
        run_bad(&w),
        "'model.layers.1.mlp.up_proj.weight' has a NaN or infinite value at element 2",
    );
    for (key, value, says) in [
        ("hidden_act", serde_json::json!("gelu"), "hidden_act 'gelu'"),
        ("mlp_bias", serde_json::json!(true), "mlp_bias"),
        ("rms_norm_eps", serde_json::json!(-1.0), "rms_norm_eps -1"),
        ("rope_theta", serde_json::json!(0), "rope_theta 0"),
    ] {
        cli.synth(&wrong);
        let text = std::fs::read_to_string(wrong.join("config.json")).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v[key] = value;
        std::fs::write(wrong.join("config.json"), v.to_string()).unwrap();
        refuses(run_bad(&w), says);
    }
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(wrong.join("config.json")).unwrap()).unwrap();
    v["rope_theta"] = serde_json::json!(10000.0);
    v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 0});
    std::fs::write(wrong.join("config.json"), v.to_string()).unwrap();
    refuses(run_bad(&w), "rope_scaling.factor 0");
    refuses(
        vec![
            "demo".into(),
            "--model".into(),
            m.into(),
            "--max-tokens".into(),
            "0".into(),
        ],
        "--max-tokens 0",
    );

    // A draft model with another vocabulary is refused before decoding starts.
    let other = tmp.path().join("other-vocab");
    cli.synth(&other);
    rewrite_weights(&other, |name, shape, data| {
        if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
            shape[0] -= 1;
            data.truncate(shape.iter().product::<usize>() * 4);
        }
        true
    });
    let cfg_path = other.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    v["vocab_size"] = serde_json::json!(v["vocab_size"].as_u64().unwrap() - 1);
    std::fs::write(&cfg_path, v.to_string()).unwrap();
    refuses(
        run(&["--speculative", &format!("draft:{}", other.display())]),
        "has a vocabulary of 255 tokens, the target",
    );

    // Non-regular files never block or grow memory.
    for (file, kind) in [
        ("config.json", "fifo"),
        ("model.safetensors", "fifo"),
        ("config.json", "zero"),
    ] {
        let dir = tmp.path().join(format!("special-{file}-{kind}"));
        cli.synth(&dir);
        std::fs::remove_file(dir.join(file)).unwrap();
        if kind == "fifo" {
            mkfifo(&dir.join(file));
        } else {
            std::os::unix::fs::symlink("/dev/zero", dir.join(file)).unwrap();
        }
        refuses(run_bad(dir.to_str().unwrap()), file);
    }

    // Shards must stay inside the model directory.
    for shard in ["/etc/hostname", "../tiny/model.safetensors"] {
        let dir = tmp.path().join(format!("escape{}", shard.len()));
        cli.synth(&dir);
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::json!({"weight_map": {"model.embed_tokens.weight": shard}}).to_string(),
        )
        .unwrap();
        refuses(
            run_bad(dir.to_str().unwrap()),
            "not a file name inside the model directory",
        );
    }

    // Synth over an earlier synthetic model clears its stale shard index; over anything
    // else it refuses.
    let again = tmp.path().join("again");
    cli.synth(&again);
    std::fs::write(
        again.join("model.safetensors.index.json"),
        r#"{"weight_map": {"x": "old-00001.safetensors"}}"#,
    )
    .unwrap();
    cli.synth(&again);
    assert!(!again.join("model.safetensors.index.json").exists());
    cli.succeeds(
        &run_bad(again.to_str().unwrap())
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    let foreign = tmp.path().join("foreign");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::write(foreign.join("notes.txt"), "mine").unwrap();
    cli.refuses(
        &[
            "model",
            "synth",
            "--preset",
            "tiny",
            "--out",
            foreign.to_str().unwrap(),
        ],
        "not empty and not a synthetic model",
    );

    // Scenario files: sizes above the format's limits, huge steps, FIFOs, empty directories.
    let scen = |name: &str, config: serde_json::Value, ops: serde_json::Value| -> PathBuf {
        let dir = tmp.path().join(format!("scen-{name}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = serde_json::json!({"capacity": 64, "n_layers": 1, "n_kv_heads": 1,
            "n_q_heads": 1, "head_dim": 16});
        for (k, v) in config.as_object().unwrap() {
            c[k] = v.clone();
        }
        std::fs::write(
            dir.join("s.json"),
            serde_json::json!({"name": name, "description": "hostile", "kinds": ["seq"],
                "config": c, "seed": 1, "ops": ops})
            .to_string(),
        )
        .unwrap();
        dir
    };
    let conform = |dir: &Path, says: &str| {
        cli.refuses(
            &[
                "conform",
                "--backend",
                "cpu",
                "--scenarios",
                dir.to_str().unwrap(),
            ],
            says,
        )
    };
    let no_ops = serde_json::json!([]);
    for (i, (key, value)) in [
        ("capacity", 2147483647u64),
        ("n_layers", 1_000_000),
        ("n_layers", 1_000_000_000),
        ("head_dim", 1_000_000_000),
        ("n_kv_heads", 1_000_000),
    ]
    .into_iter()
    .enumerate()
    {
        // The directory name must not contain the value the message is searched for.
        let dir = scen(
            &format!("size{i}"),
            serde_json::json!({ key: value }),
            no_ops.clone(),
        );
        conform(&dir, &format!("{value}"));
        conform(&dir, "limit");
    }
    let dir = scen(
        "pos_range",
        serde_json::json!({}),
        serde_json::json!([{"op": "step", "seq": 0, "pos_range": [0, 2000000000]}]),
    );
    conform(&dir, "pos_range [0, 2000000000]");
    let fifo_dir = tmp.path().join("scen-fifo");
    std::fs::create_dir(&fifo_dir).unwrap();
    mkfifo(&fifo_dir.join("a.json"));
    conform(&fifo_dir, "a.json");
    let empty = tmp.path().join("scen-empty");
    std::fs::create_dir(&empty).unwrap();
    conform(&empty, "no *.json scenario files");

    // A long prompt runs in bounded memory (micro-batched prefill).
    let long: Vec<String> = (0..16384).map(|i| (i % 200 + 1).to_string()).collect();
    let long = long.join(",");
    cli.succeeds(&[
        "run",
        "--model",
        m,
        "--prompt-ids",
        &long,
        "--max-tokens",
        "1",
        "--capacity",
        "16400",
    ]);

    let peak = peak_child_rss_kib();
    assert!(
        peak < MAX_RSS_KIB,
        "a child peaked at {peak} KiB (bound {MAX_RSS_KIB})"
    );
}

/// A 3-row f16 session for a 2-layer, 2-head, head_dim-16 cache.
fn tiny_session() -> kvplug::session_file::Session {
    use kvplug_plugin_api::abi_stable::std_types::RVec;
    let layer = || RVec::from(vec![0x3c; 2 * 3 * 32]);
    kvplug::session_file::Session {
        rows: kvplug_plugin_api::SeqRows {
            kv_dtype: "f16".into(),
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 16,
            positions: vec![0, 1, 2].into(),
            k: vec![layer(), layer()].into(),
            v: vec![layer(), layer()].into(),
            sliding_layers: RVec::new(),
            window_from: 0,
            recurrent_layers: Default::default(),
            state: Default::default(),
        },
        tokens: vec![5, 6, 7],
        model: "0".repeat(64),
        key_basis: kvplug::KeyBasis::Identity,
        model_name: String::new(),
        app: Default::default(),
    }
}

#[test]
fn sessions_and_plans_through_the_cli() {
    let cli = Cli::new();
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("tiny");
    cli.synth(&model);
    let m = model.to_str().unwrap();
    let out = cli.succeeds(&[
        "plan",
        "--model",
        m,
        "--budget",
        "1MiB",
        "--kv-dtype",
        "q8g16",
    ]);
    assert!(
        out.contains("one sequence") && out.contains("full"),
        "{out}"
    );
    cli.refuses(
        &["plan", "--model", m, "--budget", "10"],
        "the weights alone take",
    );
    cli.refuses(
        &["plan", "--model", m, "--budget", "4parsecs"],
        "unknown unit",
    );
    cli.refuses(
        &["plan", "--model", m, "--budget", "1GiB", "--kv-dtype", "q8"],
        "group 64 must divide head_dim 16",
    );

    let dir = tmp.path().join("sessions");
    let d = dir.to_str().unwrap();
    let file = dir.join("ada.kvsession.safetensors");
    std::fs::create_dir(&dir).unwrap();
    kvplug::session_file::write(&file, &tiny_session()).unwrap();
    let ls = cli.succeeds(&["--session-dir", d, "session", "ls"]);
    assert!(
        ls.lines()
            .any(|l| l.starts_with("ada ") && l.contains(" 3 ") && l.contains("f16")),
        "{ls}"
    );
    let show = cli.succeeds(&["--session-dir", d, "session", "show", "ada"]);
    assert!(show.contains("checksum     ok"), "{show}");
    // A copy cut short is listed as such, not from its header as a whole session.
    let whole = std::fs::read(&file).unwrap();
    let cut = dir.join("cut.kvsession.safetensors");
    std::fs::write(&cut, &whole[..whole.len() - 1]).unwrap();
    let ls = cli.succeeds(&["--session-dir", d, "session", "ls"]);
    assert!(
        ls.lines()
            .any(|l| l.starts_with("cut ") && l.contains("unreadable") && l.contains("truncated")),
        "{ls}"
    );
    std::fs::remove_file(&cut).unwrap();
    // A session directory that is a file is named as such.
    let f = file.to_str().unwrap();
    cli.refuses(
        &["--session-dir", f, "chat", "--model", m, "--session", "x"],
        "is not a directory",
    );
    cli.refuses(
        &["--session-dir", d, "session", "show", "ada", "--model", m],
        "saved with another model",
    );
    cli.refuses(
        &["--session-dir", d, "session", "show", "../ada"],
        "is not a session name",
    );
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&file, &bytes).unwrap();
    cli.refuses(
        &["--session-dir", d, "session", "show", "ada"],
        "checksum mismatch",
    );
    cli.succeeds(&["--session-dir", d, "session", "rm", "ada"]);
    cli.refuses(
        &["--session-dir", d, "session", "rm", "ada"],
        "no session 'ada'",
    );
    assert!(
        cli.succeeds(&["--session-dir", d, "session", "ls"])
            .lines()
            .count()
            == 2
    );
}
