//! Loading real plugin dylibs: the cpu backend and the fixtures in `tests/fixtures`, and the
//! caches a runtime installs. Run `cargo build --workspace` first (`make test` does): the
//! dylibs are read from the target directory this test binary lives in.

use kvplug_core::{make_config, CacheKind, KvDtype, ModelCacheParams};
use kvplug_plugin_api::abi_stable::std_types::RStr;
use kvplug_plugin_api::AbiErrorKind;
use kvplug_runtime::{PluginSearch, Runtime, RuntimeError};

mod common;
use common::{cpu, dylib, plugins_dir};

fn reason_for<'a>(host: &'a Runtime, file: &str) -> &'a str {
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
    let host = Runtime::load(&PluginSearch::only(&[dir.path().to_path_buf()], false));

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
    let strict = Runtime::load(&PluginSearch::only(&[dir.path().to_path_buf()], false));
    assert!(strict.plugins().is_empty());
    assert!(strict.skipped()[0]
        .reason
        .starts_with("directory is world-writable"));
    let lax = Runtime::load(&PluginSearch::only(&[dir.path().to_path_buf()], true));
    assert_eq!(lax.backend_ids(), vec!["cpu".to_string()]);

    let dir = plugins_dir(&[cpu()]);
    let file = dir.path().join("libkvplug_cpu.so");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o777)).unwrap();
    let strict = Runtime::load(&PluginSearch::only(&[dir.path().to_path_buf()], false));
    assert!(reason_for(&strict, "libkvplug_cpu.so").starts_with("file is world-writable"));
}

#[test]
fn caches_install_distinct_keys_and_erase_on_drop() {
    let dir = plugins_dir(&[cpu()]);
    let host = Runtime::load(&PluginSearch::only(&[dir.path().to_path_buf()], false));
    let a = host.cache("cpu", CacheKind::Contiguous, &cfg()).unwrap();
    let b = host.cache("cpu", CacheKind::Seq, &cfg()).unwrap();
    let t = host.cache("cpu", CacheKind::Tree, &cfg()).unwrap();
    assert_ne!(a.key(), b.key());
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

    // Verbs of other kinds are refused by the plugin.
    assert_eq!(a.seq_len(0).unwrap_err().kind, AbiErrorKind::NotSupported);
    assert_eq!(t.rewind(0).unwrap_err().kind, AbiErrorKind::NotSupported);
}

#[test]
fn unknown_backends_and_bad_configs_are_clear_errors() {
    let dir = plugins_dir(&[cpu()]);
    let host = Runtime::load(&PluginSearch::only(&[dir.path().to_path_buf()], false));
    match host.cache("mlx", CacheKind::Contiguous, &cfg()) {
        Err(e @ RuntimeError::UnknownBackend { .. }) => {
            assert_eq!(e.to_string(), "backend 'mlx' is not loaded (loaded: cpu)")
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    let bad = kvplug_core::CacheConfig {
        head_dim: 48,
        kv_dtype: KvDtype::Q8_DEFAULT,
        ..cfg()
    };
    match host.cache("cpu", CacheKind::Seq, &bad) {
        Err(RuntimeError::Plugin(e)) => {
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
