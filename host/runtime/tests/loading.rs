//! Loading real plugin dylibs: the cpu backend and the fixtures in `tests/fixtures`, and the
//! caches a runtime installs. Run `cargo build --workspace` first (`make test` does): the cpu
//! dylib is read from the target directory this test binary lives in; the fixtures (a
//! workspace of their own) are built into `target/out-of-tree` on first use.

use kvplug_core::{make_config, CacheKind, KvDtype, ModelCacheParams};
use kvplug_plugin_api::abi_stable::std_types::RStr;
use kvplug_plugin_api::AbiErrorKind;
use kvplug_runtime::{PluginSearch, Runtime, RuntimeError};

mod common;
use common::{
    build_out_of_tree, checkout, cpu, dylib, dylib_name, fixture, out_of_tree_target, plugins_dir,
};

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
        (fixture("kvplug_fixture_not_a_plugin"), "libnot_a_plugin.so"),
        (fixture("kvplug_fixture_panicking_plugin"), "libpanicky.so"),
        (
            fixture("kvplug_fixture_abi_mismatch_plugin"),
            "libmismatch.so",
        ),
    ]);
    std::fs::write(dir.path().join("garbage.so"), "this is text, not ELF").unwrap();
    std::fs::write(dir.path().join("notes.txt"), "not considered").unwrap();
    let host = Runtime::load(&PluginSearch::only(&[dir.path().to_path_buf()], false));

    assert_eq!(host.backend_ids(), vec!["cpu".to_string()]);
    let p = &host.plugins()[0];
    assert_eq!(p.kinds, vec!["contiguous", "seq", "tree"]);
    assert_eq!(
        p.description().kv_dtypes,
        vec!["f32", "f16", "bf16", "q8", "q4"]
    );
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
    // A backend asked for and not loaded: the error says what was skipped and why.
    let e = host
        .cache("wgpu", CacheKind::Contiguous, &cfg())
        .err()
        .unwrap()
        .to_string();
    let garbage = dir.path().join("garbage.so");
    assert!(
        e.starts_with("backend 'wgpu' is not loaded (loaded: cpu); skipped ")
            && e.contains(&format!(
                "; skipped {}: not a loadable object file",
                garbage.display()
            )),
        "{e}"
    );
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
    // Where nothing was found at all, the error says where plugins are looked for.
    let empty = tempfile::tempdir().unwrap();
    let none = Runtime::load(&PluginSearch::only(&[empty.path().to_path_buf()], false));
    match none.cache("cpu", CacheKind::Contiguous, &cfg()) {
        Err(e @ RuntimeError::UnknownBackend { .. }) => {
            let e = e.to_string();
            assert!(
                e.starts_with("backend 'cpu' is not loaded (loaded: none); no plugin was found")
                    && e.contains("KVPLUG_PLUGIN_PATH"),
                "{e}"
            )
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

/// A plugin is described (its device opened) when first asked, not at load: a run on one
/// backend does not open every other plugin's device. A failing `describe` leaves the plugin
/// loaded, its device reported unavailable.
#[test]
fn plugins_are_described_when_first_asked_and_once() {
    let dir = plugins_dir(&[(
        fixture("kvplug_fixture_describe_counting_plugin"),
        "libcounting.so",
    )]);
    let host = Runtime::load(&PluginSearch::only(&[dir.path().to_path_buf()], false));
    let p = host
        .plugin("counting")
        .expect("a failing describe does not fail the load");
    let calls = || {
        p.counters()
            .into_iter()
            .find(|(name, _)| name == "describe_calls")
            .map(|(_, n)| n)
            .expect("the fixture counts its describe calls")
    };
    assert_eq!(calls(), 0, "loading described the plugin");
    // A clone made before the first description shares it.
    let clone = p.clone();
    let d = p.description();
    assert_eq!(
        d.device,
        "unavailable: describe failed: backend: fixture has no device to describe"
    );
    assert_eq!((d.name.as_str(), d.kv_dtypes.len()), ("?", 0));
    assert_eq!(clone.description(), d);
    // The JSON of `kvplug plugins --json` reads it too.
    let json = serde_json::to_value(&clone).unwrap();
    assert_eq!(json["device"], d.device.as_str());
    assert_eq!(calls(), 1, "the plugin was described more than once");
}

/// The plugin of [`built_against_the_next_api_major`]: a root module with nothing to offer.
const BUMPED_PLUGIN: &str = r#"
use abi_stable::prefix_type::PrefixTypeTrait;
use abi_stable::std_types::{RResult, RStr, RString, RVec, Tuple2};
use kvplug_plugin_api::*;

extern "C" fn backend_id() -> RString {
    "bumped".into()
}
extern "C" fn describe() -> RResult<BackendInfo, PluginError> {
    RResult::RErr(PluginError::new(AbiErrorKind::Backend, "fixture"))
}
extern "C" fn register(_: HostServices, _: &mut Registrar) -> RResult<(), PluginError> {
    RResult::ROk(())
}
extern "C" fn load_method(
    _: RStr<'_>,
    _: &BackendOptions,
    _: HostServices,
) -> RResult<MethodHandle, PluginError> {
    RResult::RErr(PluginError::new(AbiErrorKind::NotFound, "fixture"))
}

extern "C" fn counters() -> RVec<Tuple2<RString, u64>> {
    RVec::new()
}

#[abi_stable::export_root_module]
pub fn get_library() -> BackendModule_Ref {
    BackendModule { backend_id, describe, register, load_method, counters }.leak_into_prefix()
}
"#;

/// Builds, out of tree, a plugin against a copy of this checkout's kvplug-plugin-api whose
/// version is the next major, and returns the dylib.
fn built_against_the_next_api_major() -> std::path::PathBuf {
    let root = &checkout();
    let bumped = format!(
        "{}.0.0",
        kvplug_runtime::loader::host_api_version().major + 1
    );
    let work = root.join("target/out-of-tree/api-bump");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(work.join("plugin-api")).unwrap();
    std::fs::create_dir_all(work.join("plugin/src")).unwrap();
    let copy = std::process::Command::new("cp")
        .arg("-r")
        .arg(root.join("plugin-api/src"))
        .arg(work.join("plugin-api"))
        .status()
        .unwrap();
    assert!(copy.success());
    // The copy's manifest, outside the workspace: its own version, inherited fields spelled
    // out.
    let manifest = std::fs::read_to_string(root.join("plugin-api/Cargo.toml")).unwrap();
    let mut out = String::new();
    for line in manifest.lines() {
        let line = match line.split_once(".workspace = true") {
            _ if line.starts_with("version = ") => format!("version = \"{bumped}\""),
            Some(("edition", _)) => "edition = \"2021\"".into(),
            Some(("rust-version" | "license", _)) => continue,
            Some(("kvplug-core", _)) => {
                format!("kvplug-core = {{ path = {:?} }}", root.join("core"))
            }
            Some(("tracing", _)) => "tracing = \"0.1\"".into(),
            Some((other, _)) => panic!("plugin-api inherits '{other}': teach this test it"),
            None => line.to_string(),
        };
        out.push_str(&line);
        out.push('\n');
    }
    std::fs::write(work.join("plugin-api/Cargo.toml"), out).unwrap();
    std::fs::write(
        work.join("plugin/Cargo.toml"),
        "[package]\nname = \"bumped-plugin\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\
         [lib]\ncrate-type = [\"cdylib\"]\n[dependencies]\nabi_stable = \"0.11\"\n\
         kvplug-plugin-api = { path = \"../plugin-api\" }\n",
    )
    .unwrap();
    std::fs::write(work.join("plugin/src/lib.rs"), BUMPED_PLUGIN).unwrap();
    std::fs::write(
        work.join("Cargo.toml"),
        "[workspace]\nresolver = \"2\"\nmembers = [\"plugin\", \"plugin-api\"]\n",
    )
    .unwrap();
    // The workspace's lock pins the same abi_stable; nothing is fetched.
    std::fs::copy(root.join("Cargo.lock"), work.join("Cargo.lock")).unwrap();
    build_out_of_tree(
        &work.join("Cargo.toml"),
        &["--quiet", "-p", "bumped-plugin"],
    );
    out_of_tree_target()
        .join("debug")
        .join(dylib_name("bumped_plugin"))
}

#[test]
fn refuses_a_plugin_built_against_another_api_major_in_one_line() {
    let lib = built_against_the_next_api_major();
    let dir = plugins_dir(&[cpu(), (lib, "libbumped.so")]);
    let host = Runtime::load(&PluginSearch::only(&[dir.path().to_path_buf()], false));
    assert_eq!(host.backend_ids(), vec!["cpu".to_string()]);
    let api = kvplug_plugin_api::API_VERSION;
    let ours = kvplug_runtime::loader::host_api_version();
    assert_eq!(
        reason_for(&host, "libbumped.so"),
        format!(
            "plugin API version {}.0.0 is incompatible with the host's {api} (this host loads plugins built against {})",
            ours.major + 1,
            kvplug_plugin_api::accepted_range(ours)
        )
    );
    assert_eq!(host.plugins()[0].api_version, api);
}
