//! Panic containment at the boundary.

use std::panic::{catch_unwind, AssertUnwindSafe};

use abi_stable::std_types::RResult;

use crate::error::{AbiErrorKind, PluginError, PluginResult};

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".to_string())
}

/// Runs `f`, turning a panic into a [`PluginError`] of kind `Panic` and any error into a
/// `PluginError`.
pub fn guard<T, E: Into<PluginError>>(f: impl FnOnce() -> Result<T, E>) -> PluginResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => RResult::ROk(v),
        Ok(Err(e)) => RResult::RErr(e.into()),
        Err(payload) => RResult::RErr(PluginError::new(
            AbiErrorKind::Panic,
            format!("plugin panicked: {}", panic_message(&*payload)),
        )),
    }
}

/// Runs an infallible `f`, returning `fallback` if it panics.
pub fn guard_or<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(fallback)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panics_become_errors() {
        let r: PluginResult<()> = guard(|| -> Result<(), PluginError> { panic!("boom {}", 7) });
        let e = r.unwrap_err();
        assert_eq!(e.kind, AbiErrorKind::Panic);
        assert_eq!(e.message.as_str(), "plugin panicked: boom 7");
        assert_eq!(guard_or(3, || panic!("x")), 3);
        let ok: PluginResult<i32> = guard(|| Ok::<_, PluginError>(4));
        assert_eq!(ok.unwrap(), 4);
    }
}
