//! Helpers shared by the end-to-end tests: the runtime tests' dylib helpers and the binary.
#![allow(unused_imports)]

#[path = "../../../../host/runtime/tests/common/mod.rs"]
mod dylibs;
pub use dylibs::*;

pub mod server;

/// This build's `kvplug` binary (`make build`, or `cargo build --workspace --bins`, builds it
/// beside the plugins: this crate only tests it). Refused when missing, or older than a
/// source file of the host crates (a test of a stale binary would pass or fail for nothing).
#[allow(dead_code)]
pub fn kvplug_bin() -> std::path::PathBuf {
    built_bin("kvplug")
}

/// The binary `name` of this build, checked as [`kvplug_bin`] says.
#[allow(dead_code)]
pub fn built_bin(name: &str) -> std::path::PathBuf {
    let bin = target_dir().join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    let built = std::fs::metadata(&bin)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| {
            panic!(
                "{} is missing: run `cargo build --workspace --bins` first",
                bin.display()
            )
        });
    let sources =
        ["runtime", "sdk", "server", "cli"].map(|c| checkout().join("host").join(c).join("src"));
    let newest = sources
        .iter()
        .filter_map(|d| newest_source(d))
        .max_by_key(|(t, _)| *t);
    if let Some(newer) = newest.filter(|(t, _)| *t > built) {
        panic!(
            "{} is older than {}: run `cargo build --workspace --bins` first",
            bin.display(),
            newer.1.display()
        );
    }
    bin
}

/// The most recently modified `.rs` file below `dir`, with its time.
fn newest_source(dir: &std::path::Path) -> Option<(std::time::SystemTime, std::path::PathBuf)> {
    let entries = std::fs::read_dir(dir).ok()?.flatten();
    entries
        .filter_map(|e| {
            let path = e.path();
            if path.is_dir() {
                newest_source(&path)
            } else if path.extension().is_some_and(|x| x == "rs") {
                Some((e.metadata().and_then(|m| m.modified()).ok()?, path))
            } else {
                None
            }
        })
        .max_by_key(|(t, _)| *t)
}

/// A plugins directory holding only the cpu plugin (so tests load nothing else).
#[allow(dead_code)]
pub fn cpu_plugins() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        target_dir().join("libkvplug_cpu.so"),
        dir.path().join("libkvplug_cpu.so"),
    )
    .expect("run `cargo build --workspace` first");
    dir
}

/// The largest peak RSS of this process's waited-for children (and theirs), in KiB.
#[allow(dead_code)]
pub fn peak_child_rss_kib() -> i64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, usage.as_mut_ptr()) };
    assert_eq!(rc, 0);
    // SAFETY: initialised by the successful call.
    unsafe { usage.assume_init() }.ru_maxrss
}
