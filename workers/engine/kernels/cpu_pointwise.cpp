// The decoder's pointwise steps, each one pass over its rows instead of a chain of ATen ops.
//
// In eager torch, SwiGLU is silu (one pass, one new tensor) then a multiply (another);
// rotary is two multiplies, a roll and an add; the residual add and RMSNorm are five more.
// Between them they wrote and re-read every activation about a dozen times per layer: a
// sixth of a SmolLM2-135M step on the CPU. Each op here reads its inputs once and writes
// once, rows split across threads.
//
// Rounding follows the torch formulas they replace: float math rounds where torch rounds
// to float, and bf16/fp16 inputs are rounded back to their type after each step that torch
// runs in that type, so outputs stay within an ulp or two of the eager path.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_checks.h"
#include "cpu_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

namespace {

// Conversions the compiler can vectorise. c10's bf16 rounding branches on NaN per element
// and stays scalar, which made every bf16 kernel here 4-5x slower than its float twin;
// these are branch-free integer operations on the bits (NaN checked on the integer bits, as
// -ffast-math lets the compiler assume floats are never NaN).
inline float f32(float v) { return v; }
inline float f32(c10::BFloat16 v) {
  const uint32_t word = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &word, sizeof out);
  return out;
}
inline float f32(c10::Half v) { return static_cast<float>(v); }

template <typename T>
inline T from_f32(float x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    uint32_t word;
    std::memcpy(&word, &x, sizeof word);
    const uint32_t rounded = (word + 0x7FFFu + ((word >> 16) & 1u)) >> 16;  // nearest even
    const bool nan = (word & 0x7FFFFFFFu) > 0x7F800000u;
    return c10::BFloat16(static_cast<uint16_t>(nan ? 0x7FC0u : rounded),
                         c10::BFloat16::from_bits());
  } else {
    return static_cast<T>(x);
  }
}

// x rounded to T and back: what torch stores between two ops on a T tensor.
template <typename T>
inline float round_to(float x) {
  return f32(from_f32<T>(x));
}

// Rows of `width` elements per task: enough work per thread to outweigh the hand-off.
inline int64_t grain(int64_t width) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));
}

// out (N, I) = silu(x[:, :I]) * x[:, I:], x (N, 2I) with contiguous rows.
template <typename T>
void silu_and_mul_impl(const at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), width = x.size(1) / 2, stride = x.stride(0);
  const T* in = x.data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * stride;
      const T* up = gate + width;
      T* dst = o + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float g = f32(gate[i]);
        const float s = round_to<T>(g / (1.f + batchinfer::fast_exp(-g)));
        dst[i] = from_f32<T>(s * f32(up[i]));
      }
    }
  });
}

void silu_and_mul(const at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "x must be (N, 2 I) with contiguous rows");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == x.size(0) &&
                  out.size(1) == x.size(1) / 2 && out.scalar_type() == x.scalar_type(),
              "out must be contiguous (N, I) of x's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul",
                                  [&] { silu_and_mul_impl<scalar_t>(out, x); });
}

// In place on qk (N, heads, D): x * cos + rotate_half(x) * sin, NeoX style, with table rows
// [cos | cos | -sin | sin] (the model's RotaryEmbedding table) picked by positions (N,).
// A table of R < D dimensions (partial rotary) rotates the first R of each head.
template <typename T>
void rotary_impl(const at::Tensor& qk, const at::Tensor& positions, const at::Tensor& table) {
  const int64_t rows = qk.size(0), heads = qk.size(1), D = qk.size(2);
  const int64_t R = table.size(1) / 2, half = R / 2;
  const int64_t s_row = qk.stride(0), s_head = qk.stride(1);
  T* base = qk.data_ptr<T>();
  const T* tab = table.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain(heads * D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* cos = tab + pos[r] * 2 * R;
      const T* sin = cos + R;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = base + r * s_row + h * s_head;
        // Iteration i reads and writes only x[i] and x[i + half]; the table never aliases x.
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = f32(x[i]), x2 = f32(x[i + half]);
          const float a1 = round_to<T>(x1 * f32(cos[i])), b1 = round_to<T>(x2 * f32(sin[i]));
          const float a2 = round_to<T>(x2 * f32(cos[i + half]));
          const float b2 = round_to<T>(x1 * f32(sin[i + half]));
          x[i] = from_f32<T>(a1 + b1);
          x[i + half] = from_f32<T>(a2 + b2);
        }
      }
    }
  });
}

void rotary_embedding(const at::Tensor& qk, const at::Tensor& positions, const at::Tensor& table) {
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.size(2) % 2 == 0,
              "qk must be (N, heads, D) with contiguous rows and an even D");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == qk.size(0),
              "positions must be contiguous int64 (N,)");
  TORCH_CHECK(table.is_contiguous() && table.dim() == 2 && table.size(1) % 4 == 0 &&
                  table.size(1) > 0 && table.size(1) <= 2 * qk.size(2) &&
                  table.scalar_type() == qk.scalar_type(),
              "table must be contiguous (P, 2 R) of qk's dtype, R <= D and even");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < positions.numel(); ++r) {
    TORCH_CHECK(pos[r] >= 0 && pos[r] < table.size(0),
                batchinfer::message("position %lld is outside the rotary table of %lld",
                                    static_cast<long long>(pos[r]),
                                    static_cast<long long>(table.size(0))).c_str());
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qk.scalar_type(), "rotary_embedding",
                                  [&] { rotary_impl<scalar_t>(qk, positions, table); });
}

// residual += delta (when given), then out = rms_norm(residual) * weight, per row.
// float: torch's F.rms_norm; a half type: normalised in float, rounded, times the weight.
template <typename T>
void add_rms_norm_impl(const at::Tensor& out, const at::Tensor& residual, const T* delta,
                       const at::Tensor& weight, float eps) {
  const int64_t rows = residual.size(0), width = residual.size(1);
  T* res = residual.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* x = res + r * width;
      if (delta != nullptr) {
        const T* d = delta + r * width;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) x[i] = from_f32<T>(f32(x[i]) + f32(d[i]));
      }
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < width; ++i) squares += f32(x[i]) * f32(x[i]);
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
      T* dst = o + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        dst[i] = from_f32<T>(f32(w[i]) * round_to<T>(f32(x[i]) * inv));
      }
    }
  });
}

void add_rms_norm(const at::Tensor& out, const at::Tensor& residual,
                  const std::optional<at::Tensor>& delta, const at::Tensor& weight, double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(),
              "residual must be contiguous (N, hidden)");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == residual.sizes() &&
                  out.scalar_type() == residual.scalar_type(),
              "out must be contiguous and shaped as residual");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == residual.size(1) &&
                  weight.scalar_type() == residual.scalar_type(),
              "weight must be contiguous (hidden,) of residual's dtype");
  if (delta.has_value()) {
    TORCH_CHECK(delta->is_contiguous() && delta->sizes() == residual.sizes() &&
                    delta->scalar_type() == residual.scalar_type(),
                "delta must be contiguous and shaped as residual");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, residual.scalar_type(), "add_rms_norm", [&] {
        const scalar_t* d = delta.has_value() ? delta->data_ptr<scalar_t>() : nullptr;
        add_rms_norm_impl<scalar_t>(out, residual, d, weight, static_cast<float>(eps));
      });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer_cpu, m) {
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary_embedding(Tensor(a!) qk, Tensor positions, Tensor table) -> ()");
  m.def(
      "add_rms_norm(Tensor(a!) out, Tensor(b!) residual, Tensor? delta, Tensor weight, "
      "float eps) -> ()");
}

TORCH_LIBRARY_IMPL(batchinfer_cpu, CPU, m) {
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("add_rms_norm", &add_rms_norm);
}
