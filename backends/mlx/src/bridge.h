// The C++ half of the mlx backend: thin wrappers over mlx::core, one per device operation.
// Every function builds lazy MLX graph nodes; only `read_bytes` and `eval` evaluate. Errors
// are C++ exceptions, which cxx turns into Rust `Err`s.
#pragma once

#include <memory>

#include <mlx/mlx.h>

#include "rust/cxx.h"

namespace kvplug_mlx {

// One MLX array (a shared, lazily evaluated handle).
struct Array {
  mlx::core::array a;
};

struct QuantRows;

// Element types, as numbered in ffi.rs.
mlx::core::Dtype dtype_of(uint8_t code);

std::unique_ptr<Array> zeros(rust::Slice<const int32_t> shape, uint8_t dtype);
std::unique_ptr<Array> pool_zeros(rust::Slice<const int32_t> shape, uint8_t dtype);
std::unique_ptr<Array> from_bytes(rust::Slice<const uint8_t> bytes,
                                  rust::Slice<const int32_t> shape,
                                  uint8_t dtype);
void read_bytes(const Array& a, rust::Slice<uint8_t> out);
void eval(const Array& a);
size_t nbytes(const Array& a);
std::unique_ptr<Array> astype(const Array& a, uint8_t dtype);
void describe_device(rust::String& out);
bool default_device_is_gpu();
size_t active_memory();
size_t peak_memory();
void reset_peak_memory();

// Pools: `[heads, cells, row]` arrays.
void put_rows(Array& dst, rust::Slice<const int32_t> cells, const Array& rows);
std::unique_ptr<Array> take_rows(const Array& src, rust::Slice<const int32_t> cells);
std::unique_ptr<Array> regrown(const Array& src, int32_t cells, int32_t keep);
QuantRows quantize(const Array& x, int32_t bits, int32_t group);
std::unique_ptr<Array> attend(const Array& q, const Array& k, const Array& v,
                              int32_t read_len, uint8_t mask_kind,
                              rust::Slice<const uint8_t> mask, float scale,
                              const Array& sinks, bool has_sinks);
std::unique_ptr<Array> attend_quant(const Array& q, const Array& k_codes,
                                    const Array& k_scales, const Array& k_los,
                                    const Array& v_codes, const Array& v_scales,
                                    const Array& v_los, int32_t read_len,
                                    uint8_t mask_kind,
                                    rust::Slice<const uint8_t> mask, float scale,
                                    int32_t bits, int32_t group, const Array& sinks,
                                    bool has_sinks);

// Model graph operations on f32 activations.
std::unique_ptr<Array> embed(const Array& table, rust::Slice<const int32_t> ids);
// Rows `ids` of a table in MLX's affine form (see linear_affine), dequantized to f32.
std::unique_ptr<Array> embed_affine(const Array& codes, const Array& scales,
                                    const Array& biases, rust::Slice<const int32_t> ids,
                                    int32_t bits);
std::unique_ptr<Array> rms_norm(const Array& x, const Array& w, float eps);
std::unique_ptr<Array> linear(const Array& x, const Array& w);
// `x · wᵀ` for a weight in MLX's affine form: `[rows, cols·bits/32]` packed codes, f32
// scales and biases `[rows, cols/32]` (group 32).
std::unique_ptr<Array> linear_affine(const Array& x, const Array& codes, const Array& scales,
                                     const Array& biases, int32_t bits);
std::unique_ptr<Array> add(const Array& x, const Array& y);
std::unique_ptr<Array> rope(const Array& x, int32_t heads,
                            rust::Slice<const int32_t> positions,
                            rust::Slice<const float> inv_freq,
                            bool interleaved);
std::unique_ptr<Array> split_heads(const Array& x, int32_t heads);
std::unique_ptr<Array> merge_heads(const Array& x);
std::unique_ptr<Array> silu_mul(const Array& gate, const Array& up);
std::unique_ptr<Array> gelu_tanh_mul(const Array& gate, const Array& up);
std::unique_ptr<Array> scale(const Array& x, float s);
std::unique_ptr<Array> hadamard(const Array& x, int32_t n);
std::unique_ptr<Array> gather_rows(const Array& x, rust::Slice<const int32_t> rows);

}  // namespace kvplug_mlx
