// Drawing a token per row over the whole vocabulary, by inverse CDF, in one kernel; and
// the greedy token per row.
//
// The sampler's torch path for a row that may draw any token (temperature alone, or a
// filter too wide for its candidates) divides the logits by the temperature, takes a
// softmax, a cumulative sum and a search: four passes, each writing a copy of the whole
// (rows, vocabulary) matrix. At 256 rows of SmolLM2's 49,152 that was ~70 ms of a 2-core
// CPU's step, a quarter of a decode step's time. Here each row is read at most three
// times and nothing is written but the token: its maximum, its total weight, then blocks
// of weight skipped until the one holding the draw, scanned token by token.
//
// The rule is the torch path's: weights exp((s - max) / T), the first token whose
// cumulative weight exceeds u times the total, and where rounding leaves none, the last
// token with weight. The sums are taken in another order than torch's, so a draw whose
// uniform falls within a rounding error of a token's boundary may take its neighbour.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_checks.h"
#include "cpu_math.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

using batchinfer::fast_exp;
using batchinfer::message;

// Tokens summed at once while the scan skips whole blocks of weight.
constexpr int64_t kBlock = 256;
// fast_exp is 0 below this: a token further below the row's maximum has no weight.
constexpr float kNoWeight = -87.0f;

// The scale as a finite number: one past float32's range (1/T for T below ~3e-39) would
// make the best token's weight exp(0 x inf) = NaN; at the largest finite scale it is 1 and
// every lower token's 0, the draw's limit as T goes to 0. Tested on the bits, since
// -ffast-math lets the compiler assume that no float is infinite or NaN.
float finite_scale(float scale) {
  uint32_t bits;
  std::memcpy(&bits, &scale, sizeof bits);
  return (bits & 0x7fffffffu) >= 0x7f800000u ? std::numeric_limits<float>::max() : scale;
}

// Each weight is exp((s - top) x scale), top the row's best score: the best's exponent is
// exactly 0 whatever the scale. As s x scale - max(s x scale), which the compiler fuses
// into one multiply-add, it was the product's rounding error instead: below -87 at scales
// near 1e8, so that no token had weight and the draw fell to the last token.
int64_t draw_row(const float* s, int64_t vocab, float scale, float uniform) {
  scale = finite_scale(scale);
  float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < vocab; ++i) top = s[i] > top ? s[i] : top;
  if (!(top > -std::numeric_limits<float>::infinity())) return 0;  // no token has weight
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < vocab; ++i) total += fast_exp((s[i] - top) * scale);
  int64_t last = vocab - 1;  // the last token with weight: where rounding leaves none
  while (last > 0 && (s[last] - top) * scale < kNoWeight) --last;
  const float target = uniform * total;
  float cumulative = 0.f;
  int64_t i = 0;
  for (; i + kBlock <= vocab; i += kBlock) {
    float block = 0.f;
#pragma omp simd reduction(+ : block)
    for (int64_t j = i; j < i + kBlock; ++j) block += fast_exp((s[j] - top) * scale);
    if (cumulative + block > target) break;
    cumulative += block;
  }
  for (; i < vocab; ++i) {
    cumulative += fast_exp((s[i] - top) * scale);
    if (cumulative > target) return i < last ? i : last;
  }
  return last;
}

// Token per row j of `rows`: drawn from scores[rows[j]] * scales[j] with uniforms[j].
at::Tensor draw_tokens(const at::Tensor& scores, const at::Tensor& rows,
                       const at::Tensor& scales, const at::Tensor& uniforms) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat &&
                  scores.stride(1) == 1,
              "scores must be float32 (rows, vocabulary) with contiguous rows");
  const int64_t num = rows.numel();
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "rows must be a contiguous int64 vector");
  TORCH_CHECK(scales.dim() == 1 && scales.numel() == num &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "scales must be a contiguous float32 vector, one per row");
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.numel() == num &&
                  uniforms.scalar_type() == at::kFloat && uniforms.is_contiguous(),
              "uniforms must be a contiguous float32 vector, one per row");
  const int64_t vocab = scores.size(1), stride = scores.stride(0);
  TORCH_CHECK(vocab > 0, "the vocabulary must not be empty");
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < num; ++j) {
    TORCH_CHECK(row[j] >= 0 && row[j] < scores.size(0),
                message("row %lld is outside the scores' %lld rows",
                        static_cast<long long>(row[j]),
                        static_cast<long long>(scores.size(0))).c_str());
  }
  at::Tensor out = at::empty({num}, rows.options());
  const float* s = scores.data_ptr<float>();
  const float* scale = scales.data_ptr<float>();
  const float* u = uniforms.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, num, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      o[j] = draw_row(s + row[j] * stride, vocab, scale[j], u[j]);
    }
  });
  return out;
}

// Per row r: the sum over the vocabulary of exp((scores[r] - tops[r]) * scales[r]) (a
// nucleus's mass over the whole vocabulary, where the sampler took only its candidates),
// tops[r] the row's best score, whose weight is then exactly 1 (see draw_row).
at::Tensor total_weights(const at::Tensor& scores, const at::Tensor& scales,
                         const at::Tensor& tops) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat &&
                  scores.stride(1) == 1,
              "scores must be float32 (rows, vocabulary) with contiguous rows");
  const int64_t num = scores.size(0), vocab = scores.size(1), stride = scores.stride(0);
  for (const at::Tensor* t : {&scales, &tops}) {
    TORCH_CHECK(t->dim() == 1 && t->numel() == num && t->scalar_type() == at::kFloat &&
                    t->is_contiguous(),
                "scales and tops must be contiguous float32 vectors, one per row");
  }
  at::Tensor out = at::empty({num}, scores.options());
  const float* s = scores.data_ptr<float>();
  const float* scale = scales.data_ptr<float>();
  const float* top = tops.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, num, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = s + r * stride;
      const float row_scale = finite_scale(scale[r]), row_top = top[r];
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t i = 0; i < vocab; ++i) total += fast_exp((row[i] - row_top) * row_scale);
      o[r] = total;
    }
  });
  return out;
}

// The first index of the row's maximum, as torch.argmax (a NaN is the maximum, the first
// one wins). torch's CPU argmax over the last dimension keeps a value and an index per
// element, unvectorised: 576 us for 192 rows of a 2,048-token vocabulary on one Zen 4
// core, where the row's maximum and one scan for it read 1.5 MB. (-ffast-math assumes no
// NaN, so they are found from the bits.)
int64_t greedy_row(const float* s, int64_t vocab) {
  const auto* bits = reinterpret_cast<const uint32_t*>(s);
  uint32_t worst = 0;
#pragma omp simd reduction(max : worst)
  for (int64_t i = 0; i < vocab; ++i) {
    const uint32_t magnitude = bits[i] & 0x7fffffffu;
    worst = magnitude > worst ? magnitude : worst;
  }
  if (worst > 0x7f800000u) {  // a NaN: torch returns the first
    for (int64_t i = 0; i < vocab; ++i) {
      if ((bits[i] & 0x7fffffffu) > 0x7f800000u) return i;
    }
  }
  float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < vocab; ++i) top = s[i] > top ? s[i] : top;
  for (int64_t i = 0; i < vocab; ++i) {
    if (s[i] == top) return i;
  }
  return 0;  // every score -inf: torch's argmax takes the first too
}

at::Tensor greedy_tokens(const at::Tensor& scores) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat &&
                  scores.stride(1) == 1,
              "scores must be float32 (rows, vocabulary) with contiguous rows");
  const int64_t num = scores.size(0), vocab = scores.size(1), stride = scores.stride(0);
  TORCH_CHECK(vocab > 0, "the vocabulary must not be empty");
  at::Tensor out = at::empty({num}, scores.options().dtype(at::kLong));
  const float* s = scores.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  // Rows of a few thousand tokens: split only when each thread gets tens of them.
  at::parallel_for(0, num, std::max<int64_t>(1, 65536 / vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = greedy_row(s + r * stride, vocab);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer_cpu, m) {
  m.def("draw_tokens(Tensor scores, Tensor rows, Tensor scales, Tensor uniforms) -> Tensor");
  m.def("total_weights(Tensor scores, Tensor scales, Tensor tops) -> Tensor");
  m.def("greedy_tokens(Tensor scores) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchinfer_cpu, CPU, m) {
  m.impl("draw_tokens", &draw_tokens);
  m.impl("total_weights", &total_weights);
  m.impl("greedy_tokens", &greedy_tokens);
}
