// See bridge.h. Shapes are validated by the kit before they get here.
#include "kvplug-mlx/src/bridge.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "kvplug-mlx/src/ffi.rs.h"

namespace mx = mlx::core;

namespace kvplug_mlx {

namespace {

std::unique_ptr<Array> wrap(mx::array a) {
  return std::make_unique<Array>(Array{std::move(a)});
}

mx::Shape shape_of(rust::Slice<const int32_t> s) {
  return mx::Shape(s.begin(), s.end());
}

mx::array index_array(rust::Slice<const int32_t> idx) {
  return mx::array(idx.begin(), mx::Shape{static_cast<int>(idx.size())}, mx::int32);
}

// `true` where query i of t may see column j of l: everything, lower-right aligned causal,
// or the explicit `[t, l]` booleans.
std::optional<mx::array> mask_array(uint8_t kind, rust::Slice<const uint8_t> mask, int t,
                                    int l) {
  switch (kind) {
    case 0:
      return std::nullopt;
    case 1: {
      auto rows = mx::reshape(mx::arange(t, mx::int32), {t, 1});
      auto cols = mx::reshape(mx::arange(l, mx::int32), {1, l});
      return mx::less_equal(cols, mx::add(rows, mx::array(l - t)));
    }
    default: {
      auto m = mx::array(mask.begin(), mx::Shape{t, l}, mx::uint8);
      return mx::not_equal(m, mx::array(0, mx::uint8));
    }
  }
}

// `out` (`[..., t, d]`) with the rows of queries that see no key set to zeros, the
// contract for such a query (a softmax over no key is NaN, or MLX's SDPA averages them all).
mx::array zero_unseeing(const mx::array& out, const std::optional<mx::array>& allowed) {
  if (!allowed) {
    return out;
  }
  auto sees = mx::any(*allowed, -1, true);
  return mx::where(sees, out, mx::array(0.0f, out.dtype()));
}

// Rows [0, read_len) of head h of a `[heads, cells, row]` pool, as `[read_len, row]`.
mx::array head_window(const mx::array& pool, int h, int read_len) {
  int row = pool.shape(2);
  return mx::reshape(mx::slice(pool, {h, 0, 0}, {h + 1, read_len, row}), {read_len, row});
}

// `[rows, words]` packed codes with `[rows, d / group]` f16 scales and offsets, as f32
// `lo + q * scale` values `[rows, d]`.
mx::array dequantized(const mx::array& codes, const mx::array& scales, const mx::array& los,
                      int bits, int group) {
  int rows = codes.shape(0), per_word = 32 / bits, d = codes.shape(1) * per_word;
  auto shifts = mx::multiply(mx::arange(per_word, mx::uint32), mx::array(bits, mx::uint32));
  auto q = mx::bitwise_and(mx::right_shift(mx::expand_dims(codes, -1), shifts),
                           mx::array((1u << bits) - 1, mx::uint32));
  auto values = mx::reshape(mx::astype(q, mx::float32), {rows, d / group, group});
  auto s = mx::expand_dims(mx::astype(scales, mx::float32), -1);
  auto lo = mx::expand_dims(mx::astype(los, mx::float32), -1);
  return mx::reshape(mx::add(lo, mx::multiply(values, s)), {rows, d});
}

}  // namespace

mx::Dtype dtype_of(uint8_t code) {
  switch (code) {
    case 0: return mx::float32;
    case 1: return mx::float16;
    case 2: return mx::bfloat16;
    case 3: return mx::uint32;
    default: throw std::invalid_argument("unknown dtype code");
  }
}

std::unique_ptr<Array> zeros(rust::Slice<const int32_t> shape, uint8_t dtype) {
  return wrap(mx::zeros(shape_of(shape), dtype_of(dtype)));
}

bool default_device_is_gpu() { return mx::default_device() == mx::Device::gpu; }

size_t active_memory() { return mx::get_active_memory(); }

size_t peak_memory() { return mx::get_peak_memory(); }

void reset_peak_memory() { mx::reset_peak_memory(); }

std::unique_ptr<Array> pool_zeros(rust::Slice<const int32_t> shape, uint8_t dtype) {
  // Materialised now (a plain zeros is a broadcast scalar): pools are written in place.
  auto a = mx::contiguous(mx::zeros(shape_of(shape), dtype_of(dtype)));
  mx::eval(a);
  return wrap(std::move(a));
}

std::unique_ptr<Array> from_bytes(rust::Slice<const uint8_t> bytes,
                                  rust::Slice<const int32_t> shape, uint8_t dtype) {
  auto copy = new uint8_t[bytes.size() ? bytes.size() : 1];
  std::memcpy(copy, bytes.data(), bytes.size());
  return wrap(mx::array(copy, shape_of(shape), dtype_of(dtype),
                        [](void* p) { delete[] static_cast<uint8_t*>(p); }));
}

void read_bytes(const Array& a, rust::Slice<uint8_t> out) {
  auto c = mx::contiguous(a.a);
  mx::eval(c);
  if (c.nbytes() != out.size()) {
    throw std::length_error("read_bytes: size mismatch");
  }
  std::memcpy(out.data(), c.data<uint8_t>(), out.size());
}

void eval(const Array& a) { mx::eval(a.a); }

size_t nbytes(const Array& a) { return a.a.nbytes(); }

std::unique_ptr<Array> astype(const Array& a, uint8_t dtype) {
  return wrap(mx::astype(a.a, dtype_of(dtype)));
}

void describe_device(rust::String& out) {
  std::ostringstream s;
  s << "MLX " << mx::version() << ", " << mx::default_device();
  out = s.str();
}

void put_rows(Array& dst, rust::Slice<const int32_t> cells, const Array& rows) {
  int n = static_cast<int>(cells.size());
  if (n == 0) return;
  bool run = true;
  for (int i = 1; i < n && run; i++) run = cells[i] == cells[0] + i;
  auto src = mx::astype(rows.a, dst.a.dtype());
  if (run) {
    // Reassigning drops the old handle, so at evaluation the update donates its buffer:
    // the write happens in place.
    dst.a = mx::slice_update(dst.a, src, mx::Shape{0, cells[0], 0},
                             mx::Shape{dst.a.shape(0), cells[0] + n, dst.a.shape(2)});
  } else {
    // scatter wants updates shaped indices + the indexed slice: [n, heads, 1, row].
    auto upd = mx::expand_dims(mx::transpose(src, {1, 0, 2}), 2);
    dst.a = mx::scatter(dst.a, index_array(cells), upd, 1);
  }
}

std::unique_ptr<Array> take_rows(const Array& src, rust::Slice<const int32_t> cells) {
  return wrap(mx::take(src.a, index_array(cells), 1));
}

std::unique_ptr<Array> regrown(const Array& src, int32_t cells, int32_t keep) {
  auto grown = mx::zeros({src.a.shape(0), cells, src.a.shape(2)}, src.a.dtype());
  if (keep > 0) {
    auto kept = mx::slice(src.a, {0, 0, 0}, {src.a.shape(0), keep, src.a.shape(2)});
    grown = mx::slice_update(grown, kept, mx::Shape{0, 0, 0},
                             mx::Shape{src.a.shape(0), keep, src.a.shape(2)});
  }
  grown = mx::contiguous(grown);
  mx::eval(grown);
  return wrap(std::move(grown));
}

QuantRows quantize(const Array& x, int32_t bits, int32_t group) {
  // Core's affine format (kvplug_core::quant), in f32: lo = min, scale = (max - lo) *
  // f32(1 / levels), both rounded to f16 (a zero lo as +0); the code of d = x - lo16 is
  // floor(d / scale + 1/2) of the exact quotient, clamped (scale 0 gives code 0): the division
  // estimates it (a GPU's may be approximate) and comparisons against (c -+ 1/2) * scale,
  // exact in f32, decide, as kvplug_backend_kit::quant::code does. Codes are packed
  // little-endian into u32 words, 32 / bits per word.
  auto shape = x.a.shape();  // [heads, t, d]
  int h = shape[0], t = shape[1], d = shape[2];
  float levels = static_cast<float>((1 << bits) - 1);
  auto g = mx::reshape(mx::astype(x.a, mx::float32), {h, t, d / group, group});
  auto lo = mx::min(g, -1, true);
  auto hi = mx::max(g, -1, true);
  auto scale16 =
      mx::astype(mx::multiply(mx::subtract(hi, lo), mx::array(1.0f / levels)), mx::float16);
  auto lo16 = mx::astype(lo, mx::float16);
  lo16 = mx::where(mx::equal(lo16, mx::zeros_like(lo16)), mx::zeros_like(lo16), lo16);  // +0
  auto scale = mx::astype(scale16, mx::float32);
  auto diff = mx::subtract(g, mx::astype(lo16, mx::float32));
  auto half = mx::array(0.5f);
  auto estimate = mx::clip(mx::floor(mx::add(mx::divide(diff, scale), half)), mx::array(0.0f),
                           mx::array(levels));
  auto below = mx::logical_and(mx::greater(estimate, mx::array(0.0f)),
                               mx::less(diff, mx::multiply(mx::subtract(estimate, half), scale)));
  auto above =
      mx::logical_and(mx::less(estimate, mx::array(levels)),
                      mx::greater_equal(diff, mx::multiply(mx::add(estimate, half), scale)));
  auto q = mx::subtract(mx::add(estimate, mx::astype(above, mx::float32)),
                        mx::astype(below, mx::float32));
  q = mx::where(mx::equal(scale, mx::array(0.0f)), mx::array(0.0f), q);
  int per_word = 32 / bits;
  auto codes = mx::reshape(mx::astype(q, mx::uint32), {h, t, d / per_word, per_word});
  auto shifts = mx::multiply(mx::arange(per_word, mx::uint32), mx::array(bits, mx::uint32));
  auto words = mx::sum(mx::left_shift(codes, shifts), -1);
  return QuantRows{
      wrap(mx::astype(words, mx::uint32)),
      wrap(mx::reshape(scale16, {h, t, d / group})),
      wrap(mx::reshape(lo16, {h, t, d / group})),
  };
}

std::unique_ptr<Array> attend(const Array& q, const Array& k, const Array& v,
                              int32_t read_len, uint8_t mask_kind,
                              rust::Slice<const uint8_t> mask, float scale,
                              const Array& sinks, bool has_sinks) {
  int hq = q.a.shape(0), t = q.a.shape(1), d = q.a.shape(2);
  int hkv = k.a.shape(0);
  auto window = [&](const mx::array& pool) {
    auto w = mx::slice(pool, {0, 0, 0}, {hkv, read_len, d});
    return mx::expand_dims(w, 0);
  };
  auto q4 = mx::expand_dims(q.a, 0);
  std::string mode;
  std::optional<mx::array> m;
  if (mask_kind == 1) {
    mode = "causal";
  } else if (mask_kind == 2) {
    mode = "array";
    m = mask_array(mask_kind, mask, t, read_len);
  }
  std::optional<mx::array> sink;
  if (has_sinks) {
    sink = sinks.a;
  }
  auto o = mx::fast::scaled_dot_product_attention(q4, window(k.a), window(v.a), scale, mode, m,
                                                  sink);
  o = zero_unseeing(mx::reshape(o, {hq, t, d}), m);
  return wrap(mx::astype(o, mx::float32));
}

std::unique_ptr<Array> attend_quant(const Array& q, const Array& k_codes,
                                    const Array& k_scales, const Array& k_los,
                                    const Array& v_codes, const Array& v_scales,
                                    const Array& v_los, int32_t read_len,
                                    uint8_t mask_kind,
                                    rust::Slice<const uint8_t> mask, float scale,
                                    int32_t bits, int32_t group, const Array& sinks,
                                    bool has_sinks) {
  // Per KV head (a head's window is one contiguous block, so MLX reads it without a copy):
  // scores, a masked softmax, the product with V. With a group MLX's quantized_matmul
  // supports, both products run on the codes (dequantization fused into the dot); other
  // groups dequantize the head's window first.
  int hq = q.a.shape(0), t = q.a.shape(1), d = q.a.shape(2);
  int hkv = k_codes.a.shape(0), g = hq / hkv, l = read_len;
  bool fused = group == 32 || group == 64 || group == 128;
  auto product = [&](const mx::array& x, const Array& codes, const Array& scales,
                     const Array& los, int h, bool transpose) {
    auto c = head_window(codes.a, h, l);
    auto s = head_window(scales.a, h, l);
    auto lo = head_window(los.a, h, l);
    if (fused) {
      return mx::quantized_matmul(x, c, s, lo, transpose, group, bits);
    }
    auto w = dequantized(c, s, lo, bits, group);
    return mx::matmul(x, transpose ? mx::transpose(w) : w);
  };
  auto allowed = mask_array(mask_kind, mask, t, l);
  std::vector<mx::array> heads;
  for (int h = 0; h < hkv; h++) {
    auto qh = mx::reshape(mx::slice(q.a, {h * g, 0, 0}, {(h + 1) * g, t, d}), {g * t, d});
    auto s = product(qh, k_codes, k_scales, k_los, h, true);
    s = mx::reshape(mx::multiply(s, mx::array(scale)), {g, t, l});
    if (allowed) {
      s = mx::where(*allowed, s, mx::array(-std::numeric_limits<float>::infinity()));
    }
    if (has_sinks) {
      // One more score per row, the head's sink (value zero: its column is dropped).
      auto sink = mx::reshape(mx::slice(sinks.a, {h * g}, {(h + 1) * g}), {g, 1, 1});
      s = mx::concatenate({s, mx::broadcast_to(sink, {g, t, 1})}, -1);
      s = mx::slice(mx::softmax(s, -1, true), {0, 0, 0}, {g, t, l});
    } else {
      s = mx::softmax(s, -1, true);
    }
    auto p = mx::reshape(s, {g * t, l});
    auto o = product(p, v_codes, v_scales, v_los, h, false);
    heads.push_back(zero_unseeing(mx::reshape(o, {g, t, d}), allowed));
  }
  return wrap(mx::astype(mx::concatenate(heads, 0), mx::float32));
}

std::unique_ptr<Array> embed(const Array& table, rust::Slice<const int32_t> ids) {
  return wrap(mx::astype(mx::take(table.a, index_array(ids), 0), mx::float32));
}

std::unique_ptr<Array> embed_affine(const Array& codes, const Array& scales,
                                    const Array& biases, rust::Slice<const int32_t> ids,
                                    int32_t bits) {
  auto rows = index_array(ids);
  return wrap(mx::dequantize(mx::take(codes.a, rows, 0), mx::take(scales.a, rows, 0),
                             mx::take(biases.a, rows, 0), 32, bits));
}

std::unique_ptr<Array> rms_norm(const Array& x, const Array& w, float eps) {
  // Rows of w.size() values: [T, k·n] with w [n] normalises each n-wide piece.
  auto rows = mx::reshape(x.a, {-1, static_cast<int>(w.a.size())});
  return wrap(mx::reshape(mx::fast::rms_norm(rows, w.a, eps), x.a.shape()));
}

std::unique_ptr<Array> linear(const Array& x, const Array& w) {
  // f32 products; a weight kept in f16/bf16 (on a GPU) is widened inside the product.
  return wrap(mx::matmul(x.a, mx::transpose(mx::astype(w.a, mx::float32))));
}

std::unique_ptr<Array> linear_affine(const Array& x, const Array& codes, const Array& scales,
                                     const Array& biases, int32_t bits) {
  return wrap(mx::quantized_matmul(x.a, codes.a, scales.a, biases.a, true, 32, bits));
}

std::unique_ptr<Array> add(const Array& x, const Array& y) {
  return wrap(mx::add(x.a, y.a));
}

std::unique_ptr<Array> rope(const Array& x, int32_t heads,
                            rust::Slice<const int32_t> positions,
                            rust::Slice<const float> inv_freq,
                            bool interleaved) {
  // Pair i is (i, i + d/2) (rotate-half) or (2i, 2i + 1) (interleaved): viewed as
  // [t, heads, 2, half] or [t, heads, half, 2], the pair's two values are slices 0 and 1 of
  // the pair axis.
  int t = x.a.shape(0), n = x.a.shape(1), d = n / heads, half = d / 2;
  auto pos = mx::astype(mx::reshape(index_array(positions), {t, 1, 1}), mx::float32);
  auto freq = mx::array(inv_freq.begin(), mx::Shape{1, 1, half}, mx::float32);
  auto angle = mx::multiply(pos, freq);
  auto cos = mx::cos(angle), sin = mx::sin(angle);
  int axis = interleaved ? 3 : 2;
  mx::Shape end = interleaved ? mx::Shape{t, heads, half, 2} : mx::Shape{t, heads, 2, half};
  auto xs = mx::reshape(x.a, end);
  mx::Shape first = end, second = {0, 0, 0, 0};
  first[axis] = 1;
  second[axis] = 1;
  auto x1 = mx::reshape(mx::slice(xs, {0, 0, 0, 0}, first), {t, heads, half});
  auto x2 = mx::reshape(mx::slice(xs, second, end), {t, heads, half});
  auto r1 = mx::subtract(mx::multiply(x1, cos), mx::multiply(x2, sin));
  auto r2 = mx::add(mx::multiply(x2, cos), mx::multiply(x1, sin));
  return wrap(mx::reshape(mx::stack({r1, r2}, axis), {t, n}));
}

std::unique_ptr<Array> split_heads(const Array& x, int32_t heads) {
  int t = x.a.shape(0), n = x.a.shape(1);
  return wrap(mx::transpose(mx::reshape(x.a, {t, heads, n / heads}), {1, 0, 2}));
}

std::unique_ptr<Array> merge_heads(const Array& x) {
  int h = x.a.shape(0), t = x.a.shape(1), d = x.a.shape(2);
  return wrap(mx::reshape(mx::transpose(x.a, {1, 0, 2}), {t, h * d}));
}

std::unique_ptr<Array> silu_mul(const Array& gate, const Array& up) {
  return wrap(mx::multiply(mx::multiply(gate.a, mx::sigmoid(gate.a)), up.a));
}

std::unique_ptr<Array> gelu_tanh_mul(const Array& gate, const Array& up) {
  const auto& g = gate.a;
  auto inner = mx::multiply(
      mx::array(0.7978845608f),
      mx::add(g, mx::multiply(mx::array(0.044715f), mx::multiply(g, mx::multiply(g, g)))));
  auto gelu = mx::multiply(mx::multiply(mx::array(0.5f), g), mx::add(mx::array(1.0f), mx::tanh(inner)));
  return wrap(mx::multiply(gelu, up.a));
}

std::unique_ptr<Array> scale(const Array& x, float s) {
  return wrap(mx::multiply(x.a, mx::array(s)));
}

std::unique_ptr<Array> hadamard(const Array& x, int32_t n) {
  auto pieces = mx::reshape(x.a, {-1, n});
  auto h = mx::hadamard_transform(pieces, 1.0f / std::sqrt(static_cast<float>(n)));
  return wrap(mx::reshape(h, x.a.shape()));
}

std::unique_ptr<Array> gather_rows(const Array& x, rust::Slice<const int32_t> rows) {
  return wrap(mx::take(x.a, index_array(rows), 0));
}

}  // namespace kvplug_mlx
