// 4-bit GPTQ/AWQ projections on x86-64 CPUs: y = x W^T with W kept at half a byte a weight,
// for bf16 activations; AVX-512 VNNI where the CPU has it, else AVX2.
//
// Why our own: torch's int4 CPU GEMM dequantizes each weight to float and multiplies in
// fp32, so it turns compute-bound at a handful of rows (0.9x oneDNN's bf16 GEMM at 8 rows
// on a 1B Llama's projections, 0.6x at 16), exactly the decode batches a CPU serves; and a
// kernel taking bf16 products (vdpbf16ps, 32 multiply-adds an instruction, as oneDNN's bf16
// GEMM does) is held to oneDNN's speed from 8 rows on, where both are bound by those
// products. Here the products are integer: vpdpbusd takes 64 multiply-adds of the raw
// weight values (0..15, unsigned bytes) by the activations quantized to int8, and a group's
// scale and zero point are applied once per group by linearity:
//
//   sum_k x_k s (q_k - z) ~= s a (sum_k x8_k q_k - z sum_k x8_k),  x_k ~= a x8_k
//
// where a is the row's scale over the group (its largest |x| / 127), as llama.cpp runs its
// 4-bit formats. The integer sums are exact; what differs from the dequantized matrix is
// the activations' rounding to int8 (about 0.6% rms of a projection's output on random
// data, against 0.17% for rounding the dequantized weights to bf16), small beside the 4-bit
// weights' own error. Accumulated in fp32 and rounded to bf16 once.
//
// Layout (`workers/engine/cpu_int4.py` builds it): the N outputs in tiles of 16, and per
// tile, per 4 inputs k..k+3, 32 bytes: byte 4i + j holds output i's q at input k + j in
// its low nibble and output 8 + i's in its high one, so that the two halves, split and
// placed side by side, are 16 lanes of 4 consecutive inputs as vpdpbusd reads them. Scales
// and zero points: per tile and group, 16 fp16 scales then 16 fp16 zero points.
//
// The VNNI path is built where the compiler targets AVX-512 VNNI (Ice Lake, Zen 4 and
// later); the AVX2 path (below) on every x86-64 build, chosen at run time. Elsewhere the
// op is not registered and `cpu_int4` uses torch's kernel.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_checks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define BATCHINFER_INT4_VNNI 1
#endif

namespace {

using batchinfer::message;

constexpr int64_t kTile = 16;       // outputs per tile: one fp32 vector
constexpr int64_t kQuadBytes = 32;  // 16 outputs x 4 inputs x 4 bits
constexpr int kMaxRows = 8;         // rows per pass over a tile's weights (registers)
// How far ahead of the weights it reads each thread asks for them (a thread's tiles lie
// one after another). Busy with its products, a core left the hardware prefetcher behind:
// a 1B Llama's 16 layers of projections streamed from memory at 16 GB/s at 8 rows, 30 GB/s
// at 4; 4 KiB ahead, at 34 and 38 (Zen 4, 2 threads; 2 and 8 KiB measured alike).
constexpr int64_t kPrefetchBytes = 4096;

// Each row of x (bf16 bits) over each group as int8 values, their scale and their sum.
void quantize_rows(const uint16_t* x, int64_t rows, int64_t in_features, int64_t group_size,
                   int8_t* x8, float* scales, float* sums) {
  const int64_t num_groups = in_features / group_size;
  std::vector<float> values(group_size);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < num_groups; ++g) {
      const uint16_t* src = x + r * in_features + g * group_size;
      float largest = 0.0f;
      for (int64_t k = 0; k < group_size; ++k) {
        const uint32_t bits = static_cast<uint32_t>(src[k]) << 16;
        std::memcpy(&values[k], &bits, sizeof(float));
        largest = std::max(largest, std::fabs(values[k]));
      }
      const float inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
      int8_t* dst = x8 + r * in_features + g * group_size;
      int32_t total = 0;
      for (int64_t k = 0; k < group_size; ++k) {
        const auto q = static_cast<int32_t>(std::nearbyint(values[k] * inverse));
        dst[k] = static_cast<int8_t>(q);
        total += q;
      }
      scales[r * num_groups + g] = largest / 127.0f;
      sums[r * num_groups + g] = static_cast<float>(total);
    }
  }
}

// What both paths take: the int8 rows, their groups' scales and sums, and the output.
struct Problem {
  const int8_t* x8;
  const float* x_scales;
  const float* x_sums;
  const uint8_t* weights;
  const uint16_t* scales_zeros;
  uint16_t* out;
  int64_t rows, in_features, tiles, num_groups, group_size;
};

#ifdef BATCHINFER_INT4_VNNI
// 64 weights (16 outputs x 4 inputs) as unsigned bytes, from their 32 packed bytes.
inline __m512i unpack_quad(const uint8_t* packed) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed));
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(bytes),
                                          _mm256_srli_epi16(bytes, 4), 1);
  return _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
}

// fp32 -> bf16 bits, to nearest even (AVX-512 VNNI CPUs before Zen 4 and Cooper Lake lack
// the conversion instruction); outputs are finite.
inline __m256i to_bf16(__m512 values) {
  const __m512i bits = _mm512_castps_si512(values);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// One tile (16 outputs) for ROWS rows: every group's integer dot products, then the
// group's scales and zero point. UNPACKED: the tile's weights were unpacked to bytes
// ahead (64 a quad), for passes of many rows over them.
template <int ROWS, bool UNPACKED>
void tile_rows(const int8_t* x8, int64_t ldx, const float* x_scales, const float* x_sums,
               int64_t num_groups, const uint8_t* weights, const uint16_t* scales_zeros,
               int64_t quads_per_group, uint16_t* out, int64_t ldo) {
  __m512 y[ROWS];
  for (int r = 0; r < ROWS; ++r) y[r] = _mm512_setzero_ps();
  const uint8_t* w = weights;
  for (int64_t g = 0; g < num_groups; ++g) {
    __m512i sums[ROWS];
    for (int r = 0; r < ROWS; ++r) sums[r] = _mm512_setzero_si512();
    const int8_t* xg = x8 + g * quads_per_group * 4;
    for (int64_t q = 0; q < quads_per_group; ++q) {
      __m512i quad;
      if constexpr (UNPACKED) {
        quad = _mm512_loadu_si512(w);
        w += 64;
      } else {
        _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
        quad = unpack_quad(w);
        w += kQuadBytes;
      }
      for (int r = 0; r < ROWS; ++r) {
        int32_t four;
        std::memcpy(&four, xg + r * ldx + q * 4, sizeof four);
        sums[r] = _mm512_dpbusd_epi32(sums[r], quad, _mm512_set1_epi32(four));
      }
    }
    const __m512i raw = _mm512_loadu_si512(scales_zeros + g * 2 * kTile);
    const __m512 scale = _mm512_cvtph_ps(_mm512_castsi512_si256(raw));
    const __m512 zero = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(raw, 1));
    for (int r = 0; r < ROWS; ++r) {
      // Exact in fp32: |sum| <= 15 x 127 x group size < 2^24 for groups up to 8,000.
      const __m512 centred = _mm512_fnmadd_ps(
          zero, _mm512_set1_ps(x_sums[r * num_groups + g]), _mm512_cvtepi32_ps(sums[r]));
      const __m512 both_scales = _mm512_mul_ps(scale, _mm512_set1_ps(x_scales[r * num_groups + g]));
      y[r] = _mm512_fmadd_ps(both_scales, centred, y[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo), to_bf16(y[r]));
  }
}

template <bool UNPACKED>
using TileFn = void (*)(const int8_t*, int64_t, const float*, const float*, int64_t,
                        const uint8_t*, const uint16_t*, int64_t, uint16_t*, int64_t);
template <bool U>
constexpr TileFn<U> kTileFns[kMaxRows + 1] = {
    nullptr,         tile_rows<1, U>, tile_rows<2, U>, tile_rows<3, U>, tile_rows<4, U>,
    tile_rows<5, U>, tile_rows<6, U>, tile_rows<7, U>, tile_rows<8, U>};

void gemm_vnni(const Problem& p) {
  const int64_t quads = p.in_features / 4, out_features = p.tiles * kTile;
  at::parallel_for(0, p.tiles, 1, [&](int64_t begin, int64_t end) {
    // More rows than one pass takes (a prefill): the tile's weights unpacked once, then
    // each pass reads bytes (K x 16 of them: 128 KiB at K = 8,192, in L2).
    std::vector<uint8_t> unpacked(p.rows > kMaxRows ? quads * 64 : 0);
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile_weights = p.weights + t * quads * kQuadBytes;
      const uint16_t* tile_scales = p.scales_zeros + t * p.num_groups * 2 * kTile;
      if (p.rows <= kMaxRows) {
        kTileFns<false>[p.rows](p.x8, p.in_features, p.x_scales, p.x_sums, p.num_groups,
                                tile_weights, tile_scales, p.group_size / 4, p.out + t * kTile,
                                out_features);
        continue;
      }
      for (int64_t q = 0; q < quads; ++q) {
        _mm_prefetch(reinterpret_cast<const char*>(tile_weights + q * kQuadBytes) + kPrefetchBytes,
                     _MM_HINT_T0);
        _mm512_storeu_si512(unpacked.data() + q * 64, unpack_quad(tile_weights + q * kQuadBytes));
      }
      for (int64_t r = 0; r < p.rows; r += kMaxRows) {
        const int64_t n = std::min<int64_t>(p.rows - r, kMaxRows);
        kTileFns<true>[n](p.x8 + r * p.in_features, p.in_features, p.x_scales + r * p.num_groups,
                          p.x_sums + r * p.num_groups, p.num_groups, unpacked.data(), tile_scales,
                          p.group_size / 4, p.out + r * out_features + t * kTile, out_features);
      }
    }
  });
}
#endif  // BATCHINFER_INT4_VNNI

// ---- AVX2 (Zen 3, Haswell to Alder Lake): the same arithmetic, 8 outputs a vector ----
//
// vpmaddubsw multiplies the weight bytes by the int8 activations and adds neighbours into
// 16-bit lanes (at most 2 x 15 x 127, never saturating), vpmaddwd adds those pairs into
// the 32-bit sums vpdpbusd makes in one step. The two nibbles of a quad's 32 bytes are
// outputs 0-7 and 8-15, a vector each. Built for any x86-64 compiler target and chosen
// at run time where AVX2, FMA and F16C are present.

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

constexpr int kMaxRowsAvx2 = 4;  // 16 vector registers: two sums a row, and the weights

// fp32 -> bf16 bits in 32-bit lanes, to nearest even; outputs are finite. (Helpers are
// functions, not lambdas: a lambda does not take its caller's target.)
AVX2_TARGET inline __m256i bf16_lanes(__m256 values) {
  const __m256i bits = _mm256_castps_si256(values);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
}

// 8 + 8 outputs as 16 bf16.
AVX2_TARGET inline __m256i to_bf16_avx2(__m256 low, __m256 high) {
  // packus interleaves 128-bit halves: put them back in order.
  return _mm256_permute4x64_epi64(
      _mm256_packus_epi32(bf16_lanes(low), bf16_lanes(high)), 0xD8);
}

// 8 fp16 values as floats.
AVX2_TARGET inline __m256 halves_avx2(const uint16_t* at) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
}

template <int ROWS>
AVX2_TARGET void tile_rows_avx2(const int8_t* x8, int64_t ldx, const float* x_scales,
                                const float* x_sums, int64_t num_groups,
                                const uint8_t* weights, const uint16_t* scales_zeros,
                                int64_t quads_per_group, uint16_t* out, int64_t ldo) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 y_low[ROWS], y_high[ROWS];
  for (int r = 0; r < ROWS; ++r) y_low[r] = y_high[r] = _mm256_setzero_ps();
  const uint8_t* w = weights;
  for (int64_t g = 0; g < num_groups; ++g) {
    __m256i low[ROWS], high[ROWS];
    for (int r = 0; r < ROWS; ++r) low[r] = high[r] = _mm256_setzero_si256();
    const int8_t* xg = x8 + g * quads_per_group * 4;
    for (int64_t q = 0; q < quads_per_group; ++q, w += kQuadBytes) {
      _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      const __m256i first = _mm256_and_si256(bytes, low_nibbles);
      const __m256i second = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_nibbles);
      for (int r = 0; r < ROWS; ++r) {
        int32_t four;
        std::memcpy(&four, xg + r * ldx + q * 4, sizeof four);
        const __m256i xv = _mm256_set1_epi32(four);
        low[r] = _mm256_add_epi32(
            low[r], _mm256_madd_epi16(_mm256_maddubs_epi16(first, xv), ones));
        high[r] = _mm256_add_epi32(
            high[r], _mm256_madd_epi16(_mm256_maddubs_epi16(second, xv), ones));
      }
    }
    const uint16_t* sz = scales_zeros + g * 2 * kTile;
    const __m256 scale_low = halves_avx2(sz), scale_high = halves_avx2(sz + 8);
    const __m256 zero_low = halves_avx2(sz + 16), zero_high = halves_avx2(sz + 24);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 x_sum = _mm256_set1_ps(x_sums[r * num_groups + g]);
      const __m256 x_scale = _mm256_set1_ps(x_scales[r * num_groups + g]);
      y_low[r] = _mm256_fmadd_ps(
          _mm256_mul_ps(scale_low, x_scale),
          _mm256_fnmadd_ps(zero_low, x_sum, _mm256_cvtepi32_ps(low[r])), y_low[r]);
      y_high[r] = _mm256_fmadd_ps(
          _mm256_mul_ps(scale_high, x_scale),
          _mm256_fnmadd_ps(zero_high, x_sum, _mm256_cvtepi32_ps(high[r])), y_high[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo),
                        to_bf16_avx2(y_low[r], y_high[r]));
  }
}

using TileFnAvx2 = void (*)(const int8_t*, int64_t, const float*, const float*, int64_t,
                            const uint8_t*, const uint16_t*, int64_t, uint16_t*, int64_t);
constexpr TileFnAvx2 kTileFnsAvx2[kMaxRowsAvx2 + 1] = {
    nullptr, tile_rows_avx2<1>, tile_rows_avx2<2>, tile_rows_avx2<3>, tile_rows_avx2<4>};

void gemm_avx2(const Problem& p) {
  const int64_t quads = p.in_features / 4, out_features = p.tiles * kTile;
  at::parallel_for(0, p.tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      // Passes of up to 4 rows, each over the tile's packed weights (in cache after the
      // first): AVX2 is bound by its products here, not by reading.
      for (int64_t r = 0; r < p.rows; r += kMaxRowsAvx2) {
        const int64_t n = std::min<int64_t>(p.rows - r, kMaxRowsAvx2);
        kTileFnsAvx2[n](p.x8 + r * p.in_features, p.in_features, p.x_scales + r * p.num_groups,
                        p.x_sums + r * p.num_groups, p.num_groups,
                        p.weights + t * quads * kQuadBytes,
                        p.scales_zeros + t * p.num_groups * 2 * kTile, p.group_size / 4,
                        p.out + r * out_features + t * kTile, out_features);
      }
    }
  });
}

// x (M, K) bf16, packed (N/16, K/4, 32) uint8, scales_zeros (N/16, K/group, 32) fp16
// -> (M, N) bf16. `portable`: the AVX2 path even where the VNNI one runs (tests).
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& packed,
                     const at::Tensor& scales_zeros, int64_t group_size, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "int4_gemm: x must be a contiguous 2-D bf16 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous()
                  && packed.size(2) == kQuadBytes,
              "int4_gemm: packed must be a contiguous (N/16, K/4, 32) uint8 tensor");
  TORCH_CHECK(scales_zeros.dim() == 3 && scales_zeros.scalar_type() == at::kHalf
                  && scales_zeros.is_contiguous() && scales_zeros.size(2) == 2 * kTile,
              "int4_gemm: scales_zeros must be a contiguous (N/16, groups, 32) fp16 tensor");
  const int64_t rows = x.size(0), in_features = x.size(1);
  const int64_t tiles = packed.size(0);
  TORCH_CHECK(packed.size(1) * 4 == in_features,
              message("int4_gemm: x has %lld inputs, the weights %lld",
                      static_cast<long long>(in_features),
                      static_cast<long long>(packed.size(1) * 4)).c_str());
  TORCH_CHECK(group_size > 0 && group_size % 4 == 0 && in_features % group_size == 0,
              message("int4_gemm: group size %lld does not divide %lld inputs in fours",
                      static_cast<long long>(group_size),
                      static_cast<long long>(in_features)).c_str());
  const int64_t num_groups = in_features / group_size;
  TORCH_CHECK(scales_zeros.size(0) == tiles && scales_zeros.size(1) == num_groups,
              "int4_gemm: scales_zeros does not match the weights' tiles and groups");
  at::Tensor out = at::empty({rows, tiles * kTile}, x.options());
  if (rows == 0) return out;

  at::Tensor x8 = at::empty({rows, in_features}, x.options().dtype(at::kChar));
  at::Tensor x_scales = at::empty({rows, num_groups}, x.options().dtype(at::kFloat));
  at::Tensor x_sums = at::empty({rows, num_groups}, x.options().dtype(at::kFloat));
  quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), rows,
                in_features, group_size, x8.data_ptr<int8_t>(), x_scales.data_ptr<float>(),
                x_sums.data_ptr<float>());
  const Problem problem{x8.data_ptr<int8_t>(),
                        x_scales.data_ptr<float>(),
                        x_sums.data_ptr<float>(),
                        packed.data_ptr<uint8_t>(),
                        reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr<at::Half>()),
                        reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
                        rows, in_features, tiles, num_groups, group_size};
#ifdef BATCHINFER_INT4_VNNI
  if (!portable) {
    gemm_vnni(problem);
    return out;
  }
#endif
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
                  && __builtin_cpu_supports("f16c"),
              "int4_gemm: this CPU has neither AVX-512 VNNI nor AVX2 with FMA and F16C");
  gemm_avx2(problem);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer_cpu, m) {
  m.def(
      "int4_gemm(Tensor x, Tensor packed, Tensor scales_zeros, int group_size, "
      "bool portable=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchinfer_cpu, CPU, m) { m.impl("int4_gemm", &int4_gemm); }

#endif  // __x86_64__
