//! Forwarding a plugin's `tracing` events to the host.
//!
//! A dylib has its own `tracing` statics, so events emitted inside a plugin reach no
//! subscriber unless the plugin installs one. [`ForwardingSubscriber`] is that subscriber:
//! it formats each event and hands it to [`HostServices::log`](crate::HostServicesTrait::log).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use abi_stable::std_types::RString;
use abi_stable::StableAbi;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

use crate::host::HostServices;

/// One formatted log event.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct LogRecord {
    /// 1 = error, 2 = warn, 3 = info, 4 = debug, 5 = trace.
    pub level: u8,
    /// The event's target (module path inside the plugin).
    pub target: RString,
    /// The message followed by `field=value` pairs.
    pub message: RString,
}

/// The numeric level of a `tracing` level (see [`LogRecord::level`]).
pub fn level_number(level: &Level) -> u8 {
    match *level {
        Level::ERROR => 1,
        Level::WARN => 2,
        Level::INFO => 3,
        Level::DEBUG => 4,
        Level::TRACE => 5,
    }
}

/// The `tracing` level of a [`LogRecord::level`] number (clamped).
pub fn level_from_number(n: u8) -> Level {
    match n {
        0 | 1 => Level::ERROR,
        2 => Level::WARN,
        3 => Level::INFO,
        4 => Level::DEBUG,
        _ => Level::TRACE,
    }
}

/// A subscriber that forwards events to the host. Spans are not forwarded (they only get
/// ids), events inside them are.
pub struct ForwardingSubscriber {
    host: HostServices,
    max_level: u8,
    next_span: AtomicU64,
}

impl ForwardingSubscriber {
    /// Forwards to `host`, filtering at the host's maximum level.
    pub fn new(host: HostServices) -> Self {
        let max_level = host.max_level();
        ForwardingSubscriber {
            host,
            max_level,
            next_span: AtomicU64::new(1),
        }
    }
}

struct MessageVisitor(String);

impl Visit for MessageVisitor {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0.push_str(value);
        } else {
            let _ = write!(self.0, " {}={value}", field.name());
        }
    }
}

impl Subscriber for ForwardingSubscriber {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        level_number(metadata.level()) <= self.max_level
    }
    fn new_span(&self, _span: &Attributes<'_>) -> Id {
        Id::from_u64(self.next_span.fetch_add(1, Ordering::Relaxed))
    }
    fn record(&self, _span: &Id, _values: &Record<'_>) {}
    fn record_follows_from(&self, _span: &Id, _follows: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut v = MessageVisitor(String::new());
        event.record(&mut v);
        let meta = event.metadata();
        self.host.log(&LogRecord {
            level: level_number(meta.level()),
            target: meta.target().into(),
            message: v.0.into(),
        });
    }
    fn enter(&self, _span: &Id) {}
    fn exit(&self, _span: &Id) {}
}
