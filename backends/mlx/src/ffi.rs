//! The cxx bridge to `bridge.cc`: one function per device operation over opaque MLX arrays.

/// Element type codes shared with `bridge.cc`'s `dtype_of`.
pub mod dtype {
    pub const F32: u8 = 0;
    pub const F16: u8 = 1;
    pub const BF16: u8 = 2;
    pub const U32: u8 = 3;
}

#[cxx::bridge(namespace = "kvplug_mlx")]
mod bridge {
    /// Quantized rows in core's affine format: packed codes (u32 words), f16 scales and
    /// offsets, each `[heads, t, ...]`.
    struct QuantRows {
        codes: UniquePtr<Array>,
        scales: UniquePtr<Array>,
        los: UniquePtr<Array>,
    }

    unsafe extern "C++" {
        include!("kvplug-mlx/src/bridge.h");

        /// One MLX array.
        type Array;

        fn zeros(shape: &[i32], dtype: u8) -> Result<UniquePtr<Array>>;
        fn pool_zeros(shape: &[i32], dtype: u8) -> Result<UniquePtr<Array>>;
        fn from_bytes(bytes: &[u8], shape: &[i32], dtype: u8) -> Result<UniquePtr<Array>>;
        fn read_bytes(a: &Array, out: &mut [u8]) -> Result<()>;
        fn eval(a: &Array) -> Result<()>;
        fn nbytes(a: &Array) -> usize;
        fn astype(a: &Array, dtype: u8) -> Result<UniquePtr<Array>>;
        fn describe_device(out: &mut String) -> Result<()>;
        fn default_device_is_gpu() -> bool;
        fn active_memory() -> usize;
        fn peak_memory() -> usize;
        fn reset_peak_memory();

        fn put_rows(dst: Pin<&mut Array>, cells: &[i32], rows: &Array) -> Result<()>;
        fn take_rows(src: &Array, cells: &[i32]) -> Result<UniquePtr<Array>>;
        fn regrown(src: &Array, cells: i32, keep: i32) -> Result<UniquePtr<Array>>;
        fn quantize(x: &Array, bits: i32, group: i32) -> Result<QuantRows>;
        #[allow(clippy::too_many_arguments)]
        fn attend(
            q: &Array,
            k: &Array,
            v: &Array,
            read_len: i32,
            mask_kind: u8,
            mask: &[u8],
            scale: f32,
            sinks: &Array,
            has_sinks: bool,
        ) -> Result<UniquePtr<Array>>;
        #[allow(clippy::too_many_arguments)]
        fn attend_quant(
            q: &Array,
            k_codes: &Array,
            k_scales: &Array,
            k_los: &Array,
            v_codes: &Array,
            v_scales: &Array,
            v_los: &Array,
            read_len: i32,
            mask_kind: u8,
            mask: &[u8],
            scale: f32,
            bits: i32,
            group: i32,
            sinks: &Array,
            has_sinks: bool,
        ) -> Result<UniquePtr<Array>>;

        fn embed(table: &Array, ids: &[i32]) -> Result<UniquePtr<Array>>;
        fn rms_norm(x: &Array, w: &Array, eps: f32) -> Result<UniquePtr<Array>>;
        fn linear(x: &Array, w: &Array) -> Result<UniquePtr<Array>>;
        fn linear_affine(
            x: &Array,
            codes: &Array,
            scales: &Array,
            biases: &Array,
            bits: i32,
        ) -> Result<UniquePtr<Array>>;
        fn embed_affine(
            codes: &Array,
            scales: &Array,
            biases: &Array,
            ids: &[i32],
            bits: i32,
        ) -> Result<UniquePtr<Array>>;
        fn add(x: &Array, y: &Array) -> Result<UniquePtr<Array>>;
        fn rope(
            x: &Array,
            heads: i32,
            positions: &[i32],
            inv_freq: &[f32],
            interleaved: bool,
        ) -> Result<UniquePtr<Array>>;
        fn split_heads(x: &Array, heads: i32) -> Result<UniquePtr<Array>>;
        fn merge_heads(x: &Array) -> Result<UniquePtr<Array>>;
        fn silu_mul(gate: &Array, up: &Array) -> Result<UniquePtr<Array>>;
        fn gelu_tanh_mul(gate: &Array, up: &Array) -> Result<UniquePtr<Array>>;
        fn scale(x: &Array, s: f32) -> Result<UniquePtr<Array>>;
        fn hadamard(x: &Array, n: i32) -> Result<UniquePtr<Array>>;
        fn gather_rows(x: &Array, rows: &[i32]) -> Result<UniquePtr<Array>>;
    }
}

pub use bridge::*;

// SAFETY: an MLX array is a reference-counted handle (atomic counts) to an immutable graph
// node; the device serialises every call into MLX behind one lock, so handles may move and
// be shared across threads.
unsafe impl Send for Array {}
unsafe impl Sync for Array {}
