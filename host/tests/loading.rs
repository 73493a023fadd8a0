//! Loading real plugin dylibs: the cpu backend and the fixtures in `tests/fixtures`.
//! Run `cargo build --workspace` first (`make test` does): the dylibs are read from the
//! target directory this test binary lives in.

use std::path::{Path, PathBuf};
use std::process::Command;

use kvplug_core::{make_config, CacheKind, KvDtype, ModelCacheParams};
use kvplug_host::{Host, HostError, PluginSearch};
use kvplug_plugin_api::abi_stable::std_types::RStr;
use kvplug_plugin_api::AbiErrorKind;

mod common;
use common::target_dir;

fn dylib(crate_name: &str) -> PathBuf {
    let name = format!(
        "{}{crate_name}{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    let p = target_dir().join(&name);
    assert!(
        p.exists(),
        "{} is missing: run `cargo build --workspace` first",
        p.display()
    );
    p
}

/// A fresh plugins directory holding copies of `files` (source, name in the dir).
fn plugins_dir(files: &[(PathBuf, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (src, name) in files {
        std::fs::copy(src, dir.path().join(name)).unwrap();
    }
    dir
}

fn cpu() -> (PathBuf, &'static str) {
    (dylib("kvplug_cpu"), "libkvplug_cpu.so")
}

fn reason_for<'a>(host: &'a Host, file: &str) -> &'a str {
    host.skipped()
        .iter()
        .find(|s| s.file.file_name().is_some_and(|f| f == file))
        .map(|s| s.reason.as_str())
        .unwrap_or_else(|| panic!("{file} was not reported as skipped: {:?}", host.skipped()))
}

fn cfg() -> kvplug_core::CacheConfig {
    make_config(
        &ModelCacheParams {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 64,
        },
        128,
        KvDtype::F16,
    )
}

#[test]
fn loads_cpu_and_skips_every_bad_file_with_a_reason() {
    let dir = plugins_dir(&[
        cpu(),
        (dylib("kvplug_cpu"), "libkvplug_cpu_copy.so"),
        (dylib("kvplug_fixture_not_a_plugin"), "libnot_a_plugin.so"),
        (dylib("kvplug_fixture_panicking_plugin"), "libpanicky.so"),
        (
            dylib("kvplug_fixture_abi_mismatch_plugin"),
            "libmismatch.so",
        ),
    ]);
    std::fs::write(dir.path().join("garbage.so"), "this is text, not ELF").unwrap();
    std::fs::write(dir.path().join("notes.txt"), "not considered").unwrap();
    let host = Host::load(&PluginSearch::only(&[dir.path().to_path_buf()], false));

    assert_eq!(host.backend_ids(), vec!["cpu".to_string()]);
    let p = &host.plugins()[0];
    assert_eq!(p.kinds, vec!["contiguous", "seq", "tree"]);
    assert_eq!(p.kv_dtypes, vec!["f32", "f16", "bf16", "q8", "q4"]);
    assert_eq!(
        host.builders().keys(),
        vec!["cpu:contiguous", "cpu:seq", "cpu:tree"]
    );

    assert!(reason_for(&host, "libkvplug_cpu_copy.so")
        .starts_with("backend 'cpu' is already loaded from"));
    assert_eq!(
        reason_for(&host, "libnot_a_plugin.so"),
        "not a kvplug plugin: it exports no abi_stable root module"
    );
    assert_eq!(
        reason_for(&host, "libpanicky.so"),
        "register failed: panic: plugin panicked: fixture panics in register"
    );
    assert!(reason_for(&host, "libmismatch.so").starts_with("ABI/layout mismatch"));
    assert!(reason_for(&host, "garbage.so").starts_with("not a loadable object file"));
    assert!(!host.skipped().iter().any(|s| s.file.ends_with("notes.txt")));
    assert_eq!(host.skipped().len(), 5);
}

#[test]
fn refuses_world_writable_directories_unless_allowed() {
    use std::os::unix::fs::PermissionsExt;
    let dir = plugins_dir(&[cpu()]);
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let strict = Host::load(&PluginSearch::only(&[dir.path().to_path_buf()], false));
    assert!(strict.plugins().is_empty());
    assert!(strict.skipped()[0]
        .reason
        .starts_with("directory is world-writable"));
    let lax = Host::load(&PluginSearch::only(&[dir.path().to_path_buf()], true));
    assert_eq!(lax.backend_ids(), vec!["cpu".to_string()]);

    let dir = plugins_dir(&[cpu()]);
    let file = dir.path().join("libkvplug_cpu.so");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o777)).unwrap();
    let strict = Host::load(&PluginSearch::only(&[dir.path().to_path_buf()], false));
    assert!(reason_for(&strict, "libkvplug_cpu.so").starts_with("file is world-writable"));
}

#[test]
fn sessions_install_distinct_keys_and_erase_on_drop() {
    let dir = plugins_dir(&[cpu()]);
    let host = Host::load(&PluginSearch::only(&[dir.path().to_path_buf()], false));
    let (a, a_opts) = host.make_decode_session("cpu", &cfg()).unwrap();
    let (b, b_opts) = host.make_seq_session("cpu", &cfg()).unwrap();
    let (t, _) = host.make_tree_session("cpu", &cfg()).unwrap();
    assert_ne!(a.key(), b.key());
    assert_eq!(a_opts.cache_key(), Some(a.key()));
    assert_eq!(b_opts.cache_key(), Some(b.key()));
    assert_eq!(
        (a.kind(), b.kind(), t.kind()),
        (CacheKind::Contiguous, CacheKind::Seq, CacheKind::Tree)
    );
    assert_eq!(host.caches().len(), 3);

    // A plugin sees the same cache object through HostServices.
    let entry = host
        .services()
        .lookup_cache(RStr::from_str(b.key()))
        .unwrap();
    assert_eq!(entry.backend_id.as_str(), "cpu");
    assert_eq!(entry.cache.kind().as_str(), "seq");
    b.begin_step(&[0]).unwrap();
    assert_eq!(b.seq_len(0).unwrap(), 0);

    let key = b.key().to_string();
    drop(b);
    assert_eq!(host.caches().len(), 2);
    let err = host
        .services()
        .lookup_cache(RStr::from_str(&key))
        .unwrap_err();
    assert_eq!(err.kind, AbiErrorKind::NotFound);
    assert!(err.message.contains(&key));
    // The entry looked up earlier still holds the cache.
    assert!(entry.cache.can_extend(1));
    let err = host
        .services()
        .lookup_cache(RStr::from_str("cache-999"))
        .unwrap_err();
    assert_eq!(err.kind, AbiErrorKind::NotFound);

    // Typed faces: verbs of other kinds are refused by the plugin.
    assert_eq!(
        a.cache().seq_len(0).unwrap_err().kind,
        AbiErrorKind::NotSupported
    );
    assert_eq!(
        t.cache().rewind(0).unwrap_err().kind,
        AbiErrorKind::NotSupported
    );
}

#[test]
fn unknown_backends_and_bad_configs_are_clear_errors() {
    let dir = plugins_dir(&[cpu()]);
    let host = Host::load(&PluginSearch::only(&[dir.path().to_path_buf()], false));
    match host.make_decode_session("mlx", &cfg()) {
        Err(e @ HostError::UnknownBackend { .. }) => {
            assert_eq!(e.to_string(), "backend 'mlx' is not loaded (loaded: cpu)")
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    let bad = kvplug_core::CacheConfig {
        head_dim: 48,
        kv_dtype: KvDtype::Q8_DEFAULT,
        ..cfg()
    };
    match host.make_seq_session("cpu", &bad) {
        Err(HostError::Plugin(e)) => {
            assert_eq!(e.kind, AbiErrorKind::BadConfig);
            assert!(
                e.message.contains("group 64 must divide head_dim 48"),
                "{e}"
            );
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    assert!(host.caches().is_empty());
}

#[test]
fn cli_lists_plugins_and_skips_with_exit_status_zero() {
    let dir = plugins_dir(&[
        cpu(),
        (dylib("kvplug_fixture_not_a_plugin"), "libnot_a_plugin.so"),
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

    let out = kvplug(dir.path(), &["plugins", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["plugins"][0]["backend_id"], "cpu");
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
            "--max-new",
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
}

fn kvplug(plugins: &Path, args: &[&str]) -> std::process::Output {
    kvplug_env(plugins, args, &[])
}

fn kvplug_env(plugins: &Path, args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    // An empty exe-relative search is not possible (the binary sits next to the real
    // dylibs), so isolate with a private copy of the binary.
    let bin_dir = tempfile::tempdir().unwrap();
    let bin = bin_dir.path().join("kvplug");
    std::fs::copy(env!("CARGO_BIN_EXE_kvplug"), &bin).unwrap();
    let out = Command::new(&bin)
        .arg("--plugins")
        .arg(plugins)
        .args(args)
        .env_remove("KVPLUG_PLUGIN_PATH")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    drop(bin_dir);
    out
}
