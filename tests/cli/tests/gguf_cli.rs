//! The quantized real model through the CLI, as a user runs it: `run --model FILE.gguf`
//! serves the file's weights in place (what the cache directory gains is a few MB of derived
//! metadata, never a weight copy), mapped or read into memory alike, `plan` counts the
//! weights as stored (quantized blocks as their bytes, summed here from the file's own tensor
//! table), and `plugins` lists the weight formats each backend computes.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

mod common;
use common::target_dir;

fn qwen() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    assert!(p.exists(), "run scripts/fetch-models.sh (make test does)");
    p
}

fn kvplug(cache: &Path, args: &[&str]) -> String {
    kvplug_fed(cache, args, b"")
}

/// `kvplug ARGS` with `stdin` as its standard input; its standard output.
fn kvplug_fed(cache: &Path, args: &[&str], stdin: &[u8]) -> String {
    let mut child = Command::new(common::kvplug_bin())
        .arg("--plugins")
        .arg(target_dir())
        .args(args)
        .env("KVPLUG_CACHE_DIR", cache)
        .env_remove("KVPLUG_PLUGIN_PATH")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The object `kvplug ARGS --json` prints.
fn run_json(cache: &Path, args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&kvplug(cache, &[args, &["--json"]].concat())).unwrap()
}

/// Bytes of every file under `dir`.
fn bytes_under(dir: &Path) -> u64 {
    std::fs::read_dir(dir).map_or(0, |entries| {
        entries
            .map(|e| {
                let p = e.unwrap().path();
                if p.is_dir() {
                    bytes_under(&p)
                } else {
                    p.metadata().unwrap().len()
                }
            })
            .sum()
    })
}

#[test]
fn a_quantized_gguf_runs_in_place_and_is_planned_and_listed_as_stored() {
    let cache = tempfile::tempdir().unwrap();
    let model = qwen();
    let m = model.to_str().unwrap();

    // `run --json` on the question, with `extra` flags.
    let ask = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["run", "--model", m, "--prompt", "What is 2 + 2?"];
        args.extend(["--max-tokens", "8", "--json"]);
        args.extend(extra);
        serde_json::from_str(&kvplug(cache.path(), &args)).unwrap()
    };
    let run = ask(&[]);
    assert!(
        run["text"].as_str().is_some_and(|t| t.contains('4')),
        "{run}"
    );
    // The file read into memory instead of mapped (--no-mmap) gives the same answer.
    let loaded = ask(&["--no-mmap"]);
    assert_eq!(loaded["text"], run["text"], "{loaded}");
    // `--prompt -` reads the prompt from standard input (mlx-lm's convention).
    let args = [
        "run",
        "--model",
        m,
        "--prompt",
        "-",
        "--max-tokens",
        "8",
        "--json",
    ];
    let piped: serde_json::Value =
        serde_json::from_str(&kvplug_fed(cache.path(), &args, b"What is 2 + 2?")).unwrap();
    assert_eq!(piped["text"], run["text"], "{piped}");
    let derived = bytes_under(cache.path());
    assert!(
        derived < 32 << 20,
        "the cache directory holds {derived} bytes: only derived metadata belongs there"
    );

    // The file's own tensor table: each tensor's elements over its type's block size, times
    // the block's bytes.
    let content = {
        let mut f = std::fs::File::open(&model).unwrap();
        candle_core::quantized::gguf_file::Content::read(&mut f).unwrap()
    };
    let stored: u64 = content
        .tensor_infos
        .values()
        .map(|t| {
            let elems = t.shape.elem_count();
            (elems / t.ggml_dtype.block_size() * t.ggml_dtype.type_size()) as u64
        })
        .sum();
    let plan: serde_json::Value = serde_json::from_str(&kvplug(
        cache.path(),
        &["plan", "--model", m, "--budget", "2GiB", "--json"],
    ))
    .unwrap();
    assert_eq!(plan["weight_bytes"].as_u64(), Some(stored), "{plan}");
    assert!(stored < 500_000_000, "Q4_K_M, not widened: {stored}");
    // Planned for a loaded backend (no MXFP4 here: the same bytes), or refused for one that
    // is not loaded.
    let for_wgpu: serde_json::Value = serde_json::from_str(&kvplug(
        cache.path(),
        &[
            "plan",
            "--model",
            m,
            "--budget",
            "2GiB",
            "--backend",
            "wgpu",
            "--json",
        ],
    ))
    .unwrap();
    assert_eq!(for_wgpu["weight_bytes"], plan["weight_bytes"], "{for_wgpu}");
    let out = Command::new(common::kvplug_bin())
        .args(["--plugins", &target_dir().display().to_string()])
        .args([
            "plan",
            "--model",
            m,
            "--budget",
            "2GiB",
            "--backend",
            "nope",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("backend 'nope' is not loaded (loaded: "),
        "{err}"
    );

    // Errors name the file the user gave, not its index in the cache.
    let out = Command::new(common::kvplug_bin())
        .args(["--plugins", &target_dir().display().to_string()])
        .args([
            "run",
            "--model",
            m,
            "--prompt",
            "Hi",
            "--speculative",
            "layers:99",
        ])
        .env("KVPLUG_CACHE_DIR", cache.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains(&format!(
                "{}: a view of 99 layers",
                model.canonicalize().unwrap().display()
            ))
            && !err.contains("gguf-index"),
        "{err}"
    );

    let plugins: serde_json::Value =
        serde_json::from_str(&kvplug(cache.path(), &["plugins", "--json"])).unwrap();
    let features = |id: &str| -> Vec<String> {
        let p = plugins["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["backend_id"] == id)
            .unwrap_or_else(|| panic!("{id} not loaded: {plugins}"));
        p["features"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_str().unwrap().to_string())
            .collect()
    };
    let all = "weights=f32|f16|bf16|q4_0|q4_1|q5_0|q5_1|q8_0|q4_K|q5_K|q6_K";
    // The cpu reads MXFP4 in place; wgpu has it re-encoded at load.
    for (id, mxfp4) in [("cpu", true), ("wgpu", false)] {
        let f = features(id);
        let weights = if mxfp4 {
            format!("{all}|mxfp4")
        } else {
            all.into()
        };
        assert!(f.contains(&weights), "{id}: {f:?}");
        assert!(!f.iter().any(|f| f.starts_with("weights-widened")), "{id}");
        assert_eq!(
            f.iter().any(|f| f == "weights-reencoded=mxfp4"),
            !mxfp4,
            "{id}: {f:?}"
        );
    }
    let mlx = features("mlx");
    assert!(
        mlx.iter().any(|f| f.starts_with("weights=f32"))
            && mlx.iter().any(|f| f.starts_with("weights-widened=")),
        "mlx on its CPU device widens the block formats and says so: {mlx:?}"
    );

    // With a model, each backend's line counts its weights as `plan --backend` does: as
    // stored on the cpu and wgpu, the block formats widened to f32 on mlx's CPU device.
    let with_model: serde_json::Value =
        serde_json::from_str(&kvplug(cache.path(), &["plugins", "--model", m, "--json"])).unwrap();
    for id in ["cpu", "wgpu", "mlx"] {
        let w = &with_model["model_weights"][id];
        let planned: serde_json::Value = serde_json::from_str(&kvplug(
            cache.path(),
            &[
                "plan",
                "--model",
                m,
                "--budget",
                "8GiB",
                "--backend",
                id,
                "--json",
            ],
        ))
        .unwrap();
        for field in [
            "weight_bytes",
            "widened_extra_bytes",
            "parameters",
            "step_bytes",
        ] {
            assert_eq!(w[field], planned[field], "{id} {field}: {with_model}");
        }
        assert_eq!(w["parameters"], plan["parameters"], "{id}");
        assert_eq!(w["expert_bytes"], 0, "a dense model: {w}");
        let widened = w["widened_extra_bytes"].as_u64().unwrap();
        assert_eq!(widened > 0, id == "mlx", "{id}: {w}");
        let held = w["weight_bytes"].as_u64().unwrap();
        assert_eq!(held, stored + widened, "{id}: {w}");
    }
    let text = kvplug(cache.path(), &["plugins", "--model", m]);
    assert!(
        text.contains("\non cpu:\nweights ") && !text.contains("experts "),
        "{text}"
    );
}

/// `run --agents` shows each branch as text (and `--json` lists them), the kept one being
/// the run's answer.
#[test]
fn agents_show_each_branch_as_text() {
    let cache = tempfile::tempdir().unwrap();
    let model = qwen();
    let args = [
        "run",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "Name one primary colour.",
        "--agents",
        "3",
        "--max-tokens",
        "16",
    ];
    let v = run_json(cache.path(), &args);
    let texts = v["branch_texts"].as_array().expect("branch_texts");
    assert_eq!(texts.len(), 3, "{v}");
    assert!(
        texts
            .iter()
            .all(|t| t.as_str().is_some_and(|t| !t.trim().is_empty())),
        "{v}"
    );
    assert!(
        texts.contains(&v["text"]),
        "the kept branch is the answer: {v}"
    );
    let shown = kvplug(cache.path(), &args);
    assert_eq!(shown.matches("--- branch ").count(), 3, "{shown}");
    assert_eq!(shown.matches("(kept)").count(), 1, "{shown}");
}

#[test]
fn a_streamed_answer_ending_inside_a_character_shows_what_the_whole_answer_shows() {
    let cache = tempfile::tempdir().unwrap();
    let model = qwen();
    // Qwen writes an emoji as byte tokens: one token of it ends inside the character.
    let args = [
        "run",
        "--model",
        model.to_str().unwrap(),
        "--raw",
        "--prompt",
        "Three rocket emojis: 🚀🚀🚀. Again:",
        "--max-tokens",
        "1",
    ];
    let v = run_json(cache.path(), &args);
    let whole = v["text"].as_str().unwrap();
    assert!(whole.ends_with('\u{FFFD}'), "{v}");
    assert_eq!(kvplug(cache.path(), &args), format!("{whole}\n"));
}
