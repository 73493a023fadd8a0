//! Plugin directories through the `kvplug` binary: listing, skipped files, hostile files
//! (in a child process, so a crash is a failed assertion), and a backend without an adapter.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{cpu, dylib, fixture, plugins_dir};

#[test]
fn cli_lists_plugins_and_skips_with_exit_status_zero() {
    let dir = plugins_dir(&[
        cpu(),
        (fixture("kvplug_fixture_not_a_plugin"), "libnot_a_plugin.so"),
    ]);
    let out = kvplug(dir.path(), &["plugins"]);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("cpu ") && l.contains("contiguous,seq,tree")),
        "{stdout}"
    );
    assert!(
        stdout.contains("libnot_a_plugin.so: not a kvplug plugin"),
        "{stdout}"
    );
    // Columns line up: each header starts where its value does in the cpu row.
    let header = stdout.lines().next().unwrap();
    let row = stdout.lines().find(|l| l.starts_with("cpu ")).unwrap();
    let row: Vec<char> = row.chars().collect();
    for name in ["api", "kinds", "device", "kv dtypes", "file", "features"] {
        let at = header.find(name).unwrap();
        assert!(row[at - 1] == ' ' && row[at] != ' ', "{name}:\n{stdout}");
    }

    let out = kvplug(dir.path(), &["plugins", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["plugins"][0]["backend_id"], "cpu");
    assert_eq!(
        v["plugins"][0]["api_version"],
        kvplug_plugin_api::API_VERSION
    );
    assert_eq!(v["skipped"].as_array().unwrap().len(), 1);

    let empty = tempfile::tempdir().unwrap();
    let out = kvplug(empty.path(), &["plugins"]);
    assert!(!out.status.success(), "no backend loaded must fail");

    // `--plugins` naming a file, not a directory.
    let out = kvplug(&dylib("kvplug_cpu"), &["plugins"]);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("plugin directory (from --plugins) is not a directory"),
        "{text}"
    );
}

/// A shared library that calls a function nothing defines, built with the system C compiler
/// (the one Rust links with).
fn library_with_an_unresolved_symbol(dir: &Path) -> PathBuf {
    let src = dir.join("unresolved.c");
    std::fs::write(
        &src,
        "void kvplug_test_missing_symbol(void);\nvoid call_it(void) { kvplug_test_missing_symbol(); }\n",
    )
    .unwrap();
    let out = dir.join("libunresolved.so");
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&out)
        .arg(&src)
        .status()
        .expect("a C compiler (cc) is needed to build the fixture");
    assert!(status.success());
    std::fs::remove_file(&src).unwrap();
    out
}

#[test]
fn hostile_plugin_files_are_skipped_with_a_reason_never_a_crash() {
    let dir = plugins_dir(&[cpu()]);
    let cpu_bytes = std::fs::read(dylib("kvplug_cpu")).unwrap();
    let cuts = [1_000, 100_000, 1_000_000];
    for cut in cuts {
        std::fs::write(
            dir.path().join(format!("libcut{cut}.so")),
            &cpu_bytes[..cut],
        )
        .unwrap();
    }
    let d = dir.path();
    std::fs::create_dir(d.join("adir.so")).unwrap();
    assert!(Command::new("mkfifo")
        .arg(d.join("fifo.so"))
        .status()
        .unwrap()
        .success());
    std::os::unix::fs::symlink(d.join("nowhere"), d.join("dangling.so")).unwrap();
    std::os::unix::fs::symlink(d.join("loop.so"), d.join("loop.so")).unwrap();
    library_with_an_unresolved_symbol(d);

    // In a child process: a crash there is a failed assertion here, not a dead test runner.
    let out = kvplug(d, &["plugins", "--json"]);
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["plugins"][0]["backend_id"], "cpu");
    assert_eq!(
        v["plugins"][0]["api_version"],
        kvplug_plugin_api::API_VERSION
    );
    let reason = |name: &str| -> String {
        v["skipped"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["file"].as_str().unwrap().ends_with(name))
            .unwrap_or_else(|| panic!("{name} not reported as skipped: {v}"))["reason"]
            .as_str()
            .unwrap()
            .to_string()
    };
    for cut in cuts {
        let r = reason(&format!("libcut{cut}.so"));
        assert!(r.contains("truncated"), "{cut}: {r}");
    }
    assert_eq!(reason("adir.so"), "not a regular file (a directory)");
    assert_eq!(reason("fifo.so"), "not a regular file (a FIFO)");
    assert!(reason("dangling.so").starts_with("unusable symlink: "));
    assert!(reason("loop.so").starts_with("unusable symlink: "));
    let r = reason("libunresolved.so");
    assert!(
        r.contains("undefined symbol: kvplug_test_missing_symbol"),
        "{r}"
    );
    assert_eq!(v["skipped"].as_array().unwrap().len(), 8, "{v}");

    // A command that runs a model on the backend, from the same directory.
    let model = tempfile::tempdir().unwrap();
    let m = model.path().to_str().unwrap();
    assert!(
        kvplug(d, &["model", "synth", "--preset", "tiny", "--out", m])
            .status
            .success()
    );
    let out = kvplug(
        d,
        &[
            "run",
            "--backend",
            "cpu",
            "--model",
            m,
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "2",
        ],
    );
    assert!(out.status.success(), "{out:?}");
}

#[test]
fn wgpu_without_a_matching_adapter_still_loads_and_says_why() {
    let dir = plugins_dir(&[(dylib("kvplug_wgpu"), "libkvplug_wgpu.so")]);
    let out = kvplug_env(
        dir.path(),
        &["plugins"],
        &[("WGPU_ADAPTER_NAME", "no-such-adapter")],
    );
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        stdout.contains("unavailable: no adapter matches WGPU_ADAPTER_NAME=no-such-adapter"),
        "{stdout}"
    );
    let out = kvplug_env(
        dir.path(),
        &["conform", "--kinds", "seq", "--dtypes", "f16"],
        &[("WGPU_ADAPTER_NAME", "no-such-adapter")],
    );
    assert!(!out.status.success());
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        stdout.contains("FAIL backend 'wgpu' cannot build caches: unavailable: no adapter matches"),
        "{stdout}"
    );
    // A plan for it is refused too: an unopened device says nothing of how it holds weights.
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let args = ["plan", "--model", model.to_str().unwrap(), "--budget", "1G"];
    let out = kvplug_env(
        dir.path(),
        &[&args[..], &["--backend", "wgpu"]].concat(),
        &[("WGPU_ADAPTER_NAME", "no-such-adapter")],
    );
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        !out.status.success()
            && stderr.contains("backend 'wgpu' has no usable device: no adapter matches"),
        "{stderr}"
    );
}

/// `--plugin FILE` loads that file and nothing else (not the binary's own directory, which
/// holds every backend and the loader fixtures); `--scenario` picks scenarios by name.
#[test]
fn a_backend_author_conforms_one_file_on_chosen_scenarios() {
    let run = |args: &[&str]| {
        Command::new(common::kvplug_bin())
            .arg("--plugin")
            .arg(dylib("kvplug_cpu"))
            .args(args)
            .env_remove("KVPLUG_PLUGIN_PATH")
            .output()
            .unwrap()
    };
    let out = run(&[
        "conform",
        "--scenario",
        "export_import",
        "--scenario",
        "full_pool_growth",
        "--dtypes",
        "f16,q4",
        "--json",
    ]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        out.stderr.is_empty(),
        "nothing else loaded or skipped: {out:?}"
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let results = v["results"].as_array().unwrap();
    let mut names: Vec<&str> = results
        .iter()
        .map(|r| r["scenario"].as_str().unwrap())
        .collect();
    names.dedup();
    assert_eq!(names, ["export_import", "full_pool_growth"]);
    let f32_runs = results.iter().filter(|r| r["arithmetic"] == "f32").count();
    assert_eq!(
        f32_runs,
        2 * 3 * 2 * 2,
        "scenarios × kinds × dtypes × inputs"
    );
    // Each other arithmetic the cpu declares (int8-query and int8-query-i16-values, for q4
    // where it has AVX2) runs the q4 cases again.
    let others: Vec<_> = results
        .iter()
        .filter(|r| r["arithmetic"] != "f32")
        .collect();
    assert!(others.iter().all(|r| r["dtype"] == "q4"), "{others:?}");
    for a in ["int8-query", "int8-query-i16-values"] {
        let runs = others.iter().filter(|r| r["arithmetic"] == a).count();
        assert_eq!(runs, others.len() / 2, "{a}: {others:?}");
    }
    assert!(
        others.is_empty() || others.len() == 2 * 2 * 3 * 2,
        "{others:?}"
    );
    assert!(results.iter().all(|r| r["backend"] == "cpu"));

    let out = run(&["conform", "--scenario", "export_imprt"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no scenario named 'export_imprt' (there are: prefill_decode,"),
        "{stderr}"
    );
}

fn kvplug(plugins: &Path, args: &[&str]) -> std::process::Output {
    kvplug_env(plugins, args, &[])
}

fn kvplug_env(plugins: &Path, args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    // An empty exe-relative search is not possible (the binary sits next to the real
    // dylibs), so isolate with a private copy of the binary.
    let bin_dir = tempfile::tempdir().unwrap();
    let bin = bin_dir.path().join("kvplug");
    std::fs::copy(common::kvplug_bin(), &bin).unwrap();
    let mut command = Command::new(&bin);
    command
        .arg("--plugins")
        .arg(plugins)
        .args(args)
        .env_remove("KVPLUG_PLUGIN_PATH")
        .envs(env.iter().copied());
    // Another test thread forking while the copy was open for writing holds that descriptor
    // until its child execs, and exec then fails with ETXTBSY: a race of the test harness,
    // not of kvplug. Try again once the child has exec'd (it closes the descriptor).
    let mut tries = 0;
    let out = loop {
        match command.output() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && tries < 50 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => break other.unwrap(),
        }
    };
    drop(bin_dir);
    out
}
