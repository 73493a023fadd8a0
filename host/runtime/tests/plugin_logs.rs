//! A plugin's tracing events reach the host's subscriber through HostServices (each dylib
//! has its own tracing statics, so without forwarding they would vanish). Own test binary:
//! it installs a global subscriber.

use std::sync::{Arc, Mutex};

use kvplug_core::{make_config, KvDtype, ModelCacheParams};
use kvplug_runtime::{CacheKind, PluginSearch, Runtime};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<String>>>);

struct Line<'a>(&'a mut String);

impl Visit for Line<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!("{}={value:?} ", field.name()));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push_str(&format!("{}={value} ", field.name()));
    }
}

impl Subscriber for Capture {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::DEBUG)
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, e: &Event<'_>) {
        let mut s = format!("{} ", e.metadata().target());
        e.record(&mut Line(&mut s));
        self.0.lock().unwrap().push(s);
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

#[test]
fn plugin_events_are_forwarded_to_the_host_subscriber() {
    let capture = Capture::default();
    tracing::subscriber::set_global_default(capture.clone()).unwrap();
    let exe = std::env::current_exe().unwrap();
    let target = exe.parent().unwrap().parent().unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        target.join("libkvplug_cpu.so"),
        dir.path().join("libkvplug_cpu.so"),
    )
    .unwrap();
    let host = Runtime::load(&PluginSearch::only(&[dir.path().to_path_buf()], false));
    let cfg = make_config(
        &ModelCacheParams {
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: 64,
        },
        64,
        KvDtype::Q4_DEFAULT,
    );
    let _cache = host.cache("cpu", CacheKind::Seq, &cfg).unwrap();
    let lines = capture.0.lock().unwrap().clone();
    let from_plugin: Vec<&String> = lines
        .iter()
        .filter(|l| l.starts_with("kvplug::plugin "))
        .collect();
    assert!(
        from_plugin
            .iter()
            .any(|l| l.contains("registered builders")
                && l.contains("plugin_target=kvplug_backend_kit")),
        "{lines:#?}"
    );
    assert!(
        from_plugin
            .iter()
            .any(|l| l.contains("cache created") && l.contains("dtype=q4")),
        "{lines:#?}"
    );
}
