//! The largest sizes kvplug accepts, and the memory check made before an allocation.
//!
//! Every size a user or a file supplies is checked against these limits before anything is
//! allocated, and every pool allocation against the memory the system has available, so a
//! bad number is a typed error naming it, never an aborted process.

use crate::error::{CacheError, CacheResult};

/// Cells a cache may be asked to hold: 16M, past every released context length (positions
/// are i32, and per-cell bookkeeping of a few bytes must stay small beside the pools).
pub const MAX_CAPACITY: usize = 1 << 24;
/// Transformer layers: released models have at most a few hundred.
pub const MAX_LAYERS: usize = 1024;
/// KV heads per layer: released models have at most 128.
pub const MAX_KV_HEADS: usize = 1024;
/// Values per head row: released models use at most 512; the scenario format allows up to
/// this bound, so it is the largest the conformance matrix can check on every backend.
pub const MAX_HEAD_DIM: usize = 1024;
/// Channels of a convolution layer's rows (its model's residual width, at most 64Ki).
pub const MAX_CONV_CHANNELS: usize = 1 << 16;

/// Checks `value` of `name` against `max`.
pub fn check_limit(name: &str, value: usize, max: usize) -> CacheResult<()> {
    if value > max {
        return Err(CacheError::bad_config(format!(
            "{name} {value} is above the limit of {max}"
        )));
    }
    Ok(())
}

/// Bytes of memory the system can still give this process without swapping
/// (`MemAvailable`), when known (Linux); `None` elsewhere.
pub fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    Some(kib.saturating_mul(1024))
}

/// Refuses an allocation of `bytes` for `what` that the system cannot supply
/// ([`CacheError::capacity`], naming both numbers). `None` bytes means the size overflowed.
pub fn check_memory(what: &str, bytes: Option<u64>) -> CacheResult<()> {
    let Some(bytes) = bytes else {
        return Err(CacheError::capacity(format!(
            "{what} would need more bytes than this machine can address"
        )));
    };
    match available_memory() {
        Some(avail) if bytes > avail => Err(CacheError::capacity(format!(
            "{what} needs {bytes} bytes but only {avail} are available"
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_and_memory_checks_name_the_numbers() {
        assert!(check_limit("n_layers", MAX_LAYERS, MAX_LAYERS).is_ok());
        let e = check_limit("n_layers", 1_000_000, MAX_LAYERS).unwrap_err();
        assert_eq!(e.message, "n_layers 1000000 is above the limit of 1024");
        if let Some(avail) = available_memory() {
            assert!(avail > 0);
            let e = check_memory("the pools", Some(avail.saturating_mul(4)))
                .unwrap_err()
                .to_string();
            assert!(e.contains("only") && e.contains("available"), "{e}");
            assert!(check_memory("a byte", Some(1)).is_ok());
        }
        assert!(check_memory("x", None).is_err());
    }
}
