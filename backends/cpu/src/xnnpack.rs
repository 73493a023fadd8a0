//! Safe wrapper over the system XNNPACK's f32 fully-connected operator, used for prefill
//! attention GEMMs. Operator creation packs the weights (~0.3 ms at prefill sizes), so this
//! serves long query blocks, never decode.

use std::sync::OnceLock;

use xnnpack_sys as sys;

/// Initialises XNNPACK once per process (per plugin dylib); the error says why not.
pub fn available() -> Result<(), &'static str> {
    static INIT: OnceLock<Result<(), String>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: a null allocator selects XNNPACK's default; initialisation is idempotent.
        match unsafe { sys::xnn_initialize(std::ptr::null()) } {
            sys::xnn_status::xnn_status_success => Ok(()),
            s => Err(format!("xnn_initialize failed: status {}", s.0)),
        }
    })
    .as_ref()
    .map(|_| ())
    .map_err(String::as_str)
}

fn check(status: sys::xnn_status, what: &str) -> Result<(), String> {
    match status {
        sys::xnn_status::xnn_status_success => Ok(()),
        s => Err(format!("{what}: XNNPACK status {}", s.0)),
    }
}

/// `out[m, n] = a[m, k] · w`, where `w` is `[n, k]` (`a·wᵀ`) or, transposed, `[k, n]`.
/// The operator packs `w` when created and is deleted on drop.
pub struct FullyConnected {
    op: sys::xnn_operator_t,
    k: usize,
    n: usize,
}

impl FullyConnected {
    /// Packs `w` (`[n, k]`, or `[k, n]` when `transposed`).
    pub fn new(k: usize, n: usize, w: &[f32], transposed: bool) -> Result<Self, String> {
        available().map_err(str::to_string)?;
        assert_eq!(w.len(), k * n, "weights shape");
        let mut op = std::ptr::null_mut();
        let flags = if transposed {
            sys::XNN_FLAG_TRANSPOSE_WEIGHTS
        } else {
            0
        };
        // SAFETY: `w` holds k·n floats and is packed (copied) during the call; a null bias
        // means none.
        let status = unsafe {
            sys::xnn_create_fully_connected_nc_f32(
                k,
                n,
                k,
                n,
                w.as_ptr(),
                std::ptr::null(),
                f32::NEG_INFINITY,
                f32::INFINITY,
                flags,
                &mut op,
            )
        };
        check(status, "xnn_create_fully_connected_nc_f32")?;
        Ok(FullyConnected { op, k, n })
    }

    /// Runs on `m` rows of `a` (`[m, k]`) into `out` (`[m, n]`), single-threaded.
    pub fn run(&self, m: usize, a: &[f32], out: &mut [f32]) -> Result<(), String> {
        assert!(
            a.len() >= m * self.k && out.len() >= m * self.n,
            "operand shapes"
        );
        // SAFETY: the buffers cover m rows; the operator runs synchronously and keeps no
        // pointer past xnn_run_operator.
        unsafe {
            check(
                sys::xnn_setup_fully_connected_nc_f32(
                    self.op,
                    m,
                    a.as_ptr(),
                    out.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
                "xnn_setup_fully_connected_nc_f32",
            )?;
            check(
                sys::xnn_run_operator(self.op, std::ptr::null_mut()),
                "xnn_run_operator",
            )
        }
    }
}

// SAFETY: an operator may move between threads; callers serialise runs (the model keeps it
// behind a mutex), which is what XNNPACK requires of one operator.
unsafe impl Send for FullyConnected {}

impl Drop for FullyConnected {
    fn drop(&mut self) {
        // SAFETY: created by xnn_create_*, deleted once.
        unsafe {
            sys::xnn_delete_operator(self.op);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_naive_matmul_both_layouts() {
        let (m, k, n) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.3).sin()).collect();
        let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.7).cos()).collect();
        let mut out = vec![0.0; m * n];
        FullyConnected::new(k, n, &w, false)
            .unwrap()
            .run(m, &a, &mut out)
            .unwrap();
        for r in 0..m {
            for c in 0..n {
                let want: f32 = (0..k).map(|i| a[r * k + i] * w[c * k + i]).sum();
                assert!((out[r * n + c] - want).abs() < 1e-4);
            }
        }
        // The same weights read as [k, n].
        FullyConnected::new(k, n, &w, true)
            .unwrap()
            .run(m, &a, &mut out)
            .unwrap();
        for r in 0..m {
            for c in 0..n {
                let want: f32 = (0..k).map(|i| a[r * k + i] * w[i * n + c]).sum();
                assert!((out[r * n + c] - want).abs() < 1e-4);
            }
        }
    }
}
