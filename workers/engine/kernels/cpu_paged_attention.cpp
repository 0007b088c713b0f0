// Paged decode attention for the CPU, reading K/V where they lie in the pool.
//
// The torch path gathers every decode group's blocks into a workspace and runs SDPA on the
// copy: on a CPU decode step that copy plus ~20 SDPA calls per layer cost a third of the
// step. Here each (sequence, KV head) pair walks its own block table once: the `group`
// query heads that share the KV head are scored against each key row while it is in
// cache, with an online softmax per block, so K and V are read once and nothing is copied.
//
// Pool layout per layer: (num_blocks, block_size, num_kv_heads, head_dim), as every backend.
// Accumulation is in float for every storage dtype; bf16 rows are widened on load.

#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include "cpu_checks.h"
#include "cpu_math.h"

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

inline void widen(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

// bf16 is the top half of a float: widening is a shift, which the compiler vectorises.
// The bits go through memcpy, never a uint32_t* store into the floats: that store would
// alias `dst` under another type, and the compiler may then read `dst` before it is
// written (it did, once the row loops were unrolled).
inline void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t word = static_cast<uint32_t>(bits[i]) << 16;
    float value;
    std::memcpy(&value, &word, sizeof value);
    dst[i] = value;
  }
}

inline void widen(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// An fp8 (e4m3) KV pool's bytes as floats: a 256-entry table, built once from c10's own
// conversion, makes a row one lookup per element.
inline const float* e4m3_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) {
      t[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b),
                                                   c10::Float8_e4m3fn::from_bits()));
    }
    return t;
  }();
  return table.data();
}

inline void widen(const c10::Float8_e4m3fn* src, float* dst, int64_t n) {
  const uint8_t* bits = reinterpret_cast<const uint8_t*>(src);
  const float* values = e4m3_values();
  for (int64_t i = 0; i < n; ++i) dst[i] = values[bits[i]];
}

inline void narrow(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

template <typename T>
inline void narrow(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);  // round to nearest even
}

inline float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float alpha, const float* __restrict__ x, float* __restrict__ y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// Ask for `bytes` from p on their way to the cache. A sequence's blocks lie anywhere in
// the pool, and the hardware prefetcher neither guesses the next block nor crosses a 4 KiB
// page, so without this a decode waits on memory at every block and page: one core read
// the pool at ~7 GB/s of the ~35 it streams.
// Into L2 (prefetcht1), not L1: a tile ahead of K and V (2 x 24 KiB for SmolLM2 in fp32)
// does not fit a 32 KiB L1 beside the rows being read, and evicted them. On a Zen 4 a
// batch of 64 (contexts 32-768) took 2.05 instead of 2.8 ms a layer in fp32, 0.96
// instead of 1.62 in bf16.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 2);
}

struct Shape {
  int64_t num_kv_heads, group, head_dim, block_size, width;
  int64_t q_row, q_head, out_row;  // strides in elements
  int64_t pool_block, pool_token;  // strides of the pool in elements
};

// A vector register of floats as one value (GCC/Clang vector extensions): 16 lanes with
// AVX-512, else 8 (AVX2; two NEON registers). Wider than the target's registers, every
// blocked loop below spills: on an AVX2-only Zen 3, 16-lane vectors ran prefill at 4
// GFLOP/s and decode at 2-5 GB/s.
// -DBATCHINFER_LANES=8|16 overrides the choice: tests build the width this CPU would not
// pick (GCC splits vectors wider than the target's into correct, slower halves).
#if !defined(BATCHINFER_LANES) && defined(__AVX512F__)
#define BATCHINFER_LANES 16
#elif !defined(BATCHINFER_LANES)
#define BATCHINFER_LANES 8
#endif
static_assert(BATCHINFER_LANES == 8 || BATCHINFER_LANES == 16, "vectors of 8 or 16 floats");
constexpr int kLanes = BATCHINFER_LANES;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
inline Vec load_vec(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store_vec(float* p, const Vec& v) { std::memcpy(p, &v, sizeof v); }

// A pool row as floats: float rows are read where they lie, others widened into `buf`.
template <typename T>
inline const float* float_row(const T* row, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    widen(row, buf, n);
    return buf;
  }
}

// Gemma 2's attention-logit soft-capping: scores -> cap * tanh(scores / cap); cap 0: none.
inline void soft_cap(float* scores, int64_t n, float cap) {
  if (cap <= 0.f) return;
  const float inv = 1.f / cap;
  for (int64_t i = 0; i < n; ++i) scores[i] = cap * std::tanh(scores[i] * inv);
}

// First key a query at `pos` sees: the whole prefix, or the last `window` positions
// (itself included) under sliding-window attention; window 0: no window.
inline int64_t window_start(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

// Element offset of token `pos` of a sequence in a pool, through its block table.
inline int64_t table_offset(const Shape& s, const int32_t* table, int64_t pos) {
  return static_cast<int64_t>(table[pos / s.block_size]) * s.pool_block +
         (pos % s.block_size) * s.pool_token;
}

// One (sequence, KV head) pair: `group` query heads over `len` cached keys. T is the
// queries' and output's type, C the pool's (T, or fp8).
template <typename T, typename C>
void attend_one(const Shape& s, const T* q, const C* k_pool, const C* v_pool,
                const int32_t* table, int64_t start, int64_t len, float scale, float cap,
                T* out, std::vector<float>& scratch) {
  const int64_t G = s.group, D = s.head_dim, BS = s.block_size;
  scratch.resize(G * D * 2 + G * BS + 2 * D + 2 * G);
  float* qf = scratch.data();           // (G, D) queries, pre-scaled
  float* acc = qf + G * D;              // (G, D) running weighted sums of V
  float* scores = acc + G * D;          // (G, BS) this block's scores, then weights
  float* row = scores + G * BS;         // (D) one widened key or value row
  float* maxes = row + 2 * D;           // (G) running maxima
  float* sums = maxes + G;              // (G) running softmax denominators
  for (int64_t g = 0; g < G; ++g) {
    widen(q + g * s.q_head, qf + g * D, D);
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] *= scale;
    maxes[g] = -FLT_MAX;
    sums[g] = 0.f;
  }
  std::fill(acc, acc + G * D, 0.f);
  const int64_t num_blocks = (len + BS - 1) / BS;
  for (int64_t b = start / BS; b < num_blocks; ++b) {
    const int64_t base = static_cast<int64_t>(table[b]) * s.pool_block;
    const int64_t n = std::min(BS, len - b * BS);
    const int64_t t0 = std::max<int64_t>(0, start - b * BS);  // keys before it: outside the window
    const C* k_rows = k_pool + base;
    const C* v_rows = v_pool + base;
    for (int64_t t = 0; t < n; ++t) {
      if (t < t0) {
        for (int64_t g = 0; g < G; ++g) scores[g * BS + t] = -1e30f;
        continue;
      }
      widen(k_rows + t * s.pool_token, row, D);
      for (int64_t g = 0; g < G; ++g) scores[g * BS + t] = dot(qf + g * D, row, D);
    }
    if (cap > 0.f) {
      for (int64_t g = 0; g < G; ++g) soft_cap(scores + g * BS + t0, n - t0, cap);
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = scores + g * BS;
      float block_max = *std::max_element(sg, sg + n);
      const float new_max = std::max(maxes[g], block_max);
      if (new_max > maxes[g]) {
        const float alpha = batchinfer::fast_exp(maxes[g] - new_max);
        sums[g] *= alpha;
        float* ag = acc + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;
        maxes[g] = new_max;
      }
      float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
      for (int64_t t = 0; t < n; ++t) {
        sg[t] = batchinfer::fast_exp(sg[t] - new_max);
        block_sum += sg[t];
      }
      sums[g] += block_sum;
    }
    for (int64_t t = t0; t < n; ++t) {
      widen(v_rows + t * s.pool_token, row, D);
      for (int64_t g = 0; g < G; ++g) axpy(scores[g * BS + t], row, acc + g * D, D);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = sums[g] > 0.f ? 1.f / sums[g] : 0.f;
    float* ag = acc + g * D;
    for (int64_t d = 0; d < D; ++d) ag[d] *= inv;
    narrow(ag, out + g * D, D);
  }
}


// Lane t of the result is the sum of v[t]'s lanes: kLanes horizontal sums in log2(kLanes)
// rounds of pairwise shuffles and adds (16 lanes: 30 shuffles, 15 adds), where one
// reduction per vector takes about 8 dependent steps. The rounds leave lane L holding
// v[bitreverse(L)]'s sum; a last shuffle puts them in order.
inline Vec lane_sums(const Vec* v) {
#if BATCHINFER_LANES == 16
  {
    Vec w[8], x[4], y[2];
    for (int i = 0; i < 8; ++i) {
      w[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                     18, 19, 20, 21, 22, 23) +
             __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                     25, 26, 27, 28, 29, 30, 31);
    }
    for (int i = 0; i < 4; ++i) {
      x[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9,
                                     10, 11, 24, 25, 26, 27) +
             __builtin_shufflevector(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13,
                                     14, 15, 28, 29, 30, 31);
    }
    for (int i = 0; i < 2; ++i) {
      y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9,
                                     24, 25, 12, 13, 28, 29) +
             __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11,
                                     26, 27, 14, 15, 30, 31);
    }
    const Vec z = __builtin_shufflevector(y[0], y[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10,
                                          26, 12, 28, 14, 30) +
                  __builtin_shufflevector(y[0], y[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11,
                                          27, 13, 29, 15, 31);
    return __builtin_shufflevector(z, z, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
  }
#else
  {
    Vec w[4], x[2];
    for (int i = 0; i < 4; ++i) {
      w[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
             __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    }
    for (int i = 0; i < 2; ++i) {
      x[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
             __builtin_shufflevector(w[2 * i], w[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    }
    const Vec z = __builtin_shufflevector(x[0], x[1], 0, 8, 2, 10, 4, 12, 6, 14) +
                  __builtin_shufflevector(x[0], x[1], 1, 9, 3, 11, 5, 13, 7, 15);
    return __builtin_shufflevector(z, z, 0, 4, 2, 6, 1, 5, 3, 7);
  }
#endif
}

// The same walk with the head size and group fixed at compile time, over KV heads
// [h0, h0 + nh) of one sequence together: with all heads at once a token's K (or V) rows
// for every head are one contiguous run of the pool, which the prefetches below fetch a
// tile ahead. Within a tile each head's queries and output sums stay in registers while
// its key and value rows stream past: a key row gives each query head a vector of partial
// products, and kLanes tokens' partials are summed across lanes together (lane_sums). Scores
// of a tile of tokens are computed before one softmax update per tile. `work` holds
// nh * G * (2 D + kTile + 2) floats.
constexpr int64_t kTile = 32;  // tokens scored per softmax update

template <typename T, typename C, int D, int G>
void attend_fixed(const Shape& s, const T* q, const C* k_pool, const C* v_pool,
                  const int32_t* table, int64_t first, int64_t len, float scale, float cap,
                  T* out, int64_t h0, int64_t nh, float* work) {
  static_assert(D % kLanes == 0 && kTile % kLanes == 0, "rows and tiles are whole vectors");
  constexpr int kVecs = D / kLanes;
  constexpr int64_t head_bytes = D * static_cast<int64_t>(sizeof(C));
  float* qf = work;                        // (nh, G, D) queries, pre-scaled
  float* acc = qf + nh * G * D;            // (nh, G, D) running weighted sums of V
  float* scores = acc + nh * G * D;        // (nh, G, kTile) a tile's scores, then weights
  float* maxes = scores + nh * G * kTile;  // (nh, G) running maxima
  float* sums = maxes + nh * G;            // (nh, G) running softmax denominators
  alignas(64) float row[D];
  Vec partial[G][kLanes];
  for (int64_t i = 0; i < nh * G; ++i) {
    widen(q + (h0 * G + i) * s.q_head, qf + i * D, D);
    for (int d = 0; d < D; ++d) {
      qf[i * D + d] *= scale;
      acc[i * D + d] = 0.f;
    }
    maxes[i] = -FLT_MAX;
    sums[i] = 0.f;
  }
  // Pool offsets of this tile's tokens and the next one's, walked block by block: a
  // division per token (the block size is a runtime value) cost as much as the scores.
  int64_t cur[kTile], next[kTile];
  auto tile_offsets = [&](int64_t start, int64_t* dst) {
    const int64_t n = std::min(kTile, len - start);
    int64_t block = start / s.block_size, off = start % s.block_size;
    for (int64_t t = 0; t < n; ++t) {
      dst[t] = static_cast<int64_t>(table[block]) * s.pool_block + off * s.pool_token + h0 * D;
      if (++off == s.block_size) off = 0, ++block;
    }
  };
  tile_offsets(first, next);
  for (int64_t t = 0; t < std::min(kTile, len - first); ++t) {  // the first tile of K and V
    prefetch(k_pool + next[t], nh * head_bytes);
    prefetch(v_pool + next[t], nh * head_bytes);
  }
  for (int64_t start = first; start < len; start += kTile) {
    const int64_t n = std::min(kTile, len - start);
    std::copy(next, next + n, cur);
    // The next tile's rows are prefetched a head and a token at a time beside this tile's.
    const int64_t ahead = std::max<int64_t>(0, std::min(kTile, len - start - kTile));
    if (ahead > 0) tile_offsets(start + kTile, next);
    for (int64_t h = 0; h < nh; ++h) {
      Vec qv[G][kVecs];
      for (int g = 0; g < G; ++g) {
        for (int v = 0; v < kVecs; ++v) qv[g][v] = load_vec(qf + (h * G + g) * D + v * kLanes);
      }
      for (int64_t t0 = 0; t0 < n; t0 += kLanes) {
        for (int64_t u = 0; u < kLanes; ++u) {
          const int64_t t = t0 + u;
          if (t >= n) {  // past the tile's end: zero partials, scores never read
            for (int g = 0; g < G; ++g) partial[g][u] = Vec{};
            continue;
          }
          if (t < ahead) prefetch(k_pool + next[t] + h * D, head_bytes);
          const float* kf = float_row(k_pool + cur[t] + h * D, row, D);
          Vec kv[kVecs];
          for (int v = 0; v < kVecs; ++v) kv[v] = load_vec(kf + v * kLanes);
          for (int g = 0; g < G; ++g) {
            Vec p = qv[g][0] * kv[0];
            for (int v = 1; v < kVecs; ++v) p += qv[g][v] * kv[v];
            partial[g][u] = p;
          }
        }
        for (int g = 0; g < G; ++g) {
          store_vec(scores + (h * G + g) * kTile + t0, lane_sums(partial[g]));
        }
      }
    }
    for (int64_t i = 0; i < nh * G; ++i) {
      float* si = scores + i * kTile;
      soft_cap(si, n, cap);
      float block_max = -FLT_MAX;
      for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, si[t]);
      const float new_max = std::max(maxes[i], block_max);
      const float alpha = batchinfer::fast_exp(maxes[i] - new_max);
      float block_sum = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        si[t] = batchinfer::fast_exp(si[t] - new_max);
        block_sum += si[t];
      }
      sums[i] = sums[i] * alpha + block_sum;
      maxes[i] = new_max;
      for (int d = 0; d < D; ++d) acc[i * D + d] *= alpha;
    }
    for (int64_t h = 0; h < nh; ++h) {
      Vec a[G][kVecs];
      for (int g = 0; g < G; ++g) {
        for (int v = 0; v < kVecs; ++v) a[g][v] = load_vec(acc + (h * G + g) * D + v * kLanes);
      }
      for (int64_t t = 0; t < n; ++t) {
        if (t < ahead) prefetch(v_pool + next[t] + h * D, head_bytes);
        const float* vf = float_row(v_pool + cur[t] + h * D, row, D);
        Vec vv[kVecs];
        for (int v = 0; v < kVecs; ++v) vv[v] = load_vec(vf + v * kLanes);
        for (int g = 0; g < G; ++g) {
          const float p = scores[(h * G + g) * kTile + t];
          for (int v = 0; v < kVecs; ++v) a[g][v] += p * vv[v];
        }
      }
      for (int g = 0; g < G; ++g) {
        for (int v = 0; v < kVecs; ++v) store_vec(acc + (h * G + g) * D + v * kLanes, a[g][v]);
      }
    }
  }
  for (int64_t i = 0; i < nh * G; ++i) {
    const float inv = 1.f / sums[i];
    for (int d = 0; d < D; ++d) acc[i * D + d] *= inv;
    narrow(acc + i * D, out + (h0 * G + i) * D, D);
  }
}

template <typename T, typename C>
using AttendFn = void (*)(const Shape&, const T*, const C*, const C*, const int32_t*, int64_t,
                          int64_t, float, float, T*, int64_t, int64_t, float*);

// The compiled (head size, group) pairs; others take the generic walk.
template <typename T, typename C>
AttendFn<T, C> fixed_kernel(int64_t head_dim, int64_t group) {
#define BATCHINFER_CASE(D, G) \
  if (head_dim == D && group == G) return &attend_fixed<T, C, D, G>;
  BATCHINFER_CASE(64, 1) BATCHINFER_CASE(64, 2) BATCHINFER_CASE(64, 3) BATCHINFER_CASE(64, 4)
  BATCHINFER_CASE(64, 5) BATCHINFER_CASE(64, 6) BATCHINFER_CASE(64, 8)
  BATCHINFER_CASE(128, 1) BATCHINFER_CASE(128, 2) BATCHINFER_CASE(128, 4)
  BATCHINFER_CASE(128, 5) BATCHINFER_CASE(128, 6) BATCHINFER_CASE(128, 7) BATCHINFER_CASE(128, 8)
#undef BATCHINFER_CASE
  return nullptr;
}

// A pool's elements as C (the queries' type, or fp8's bytes).
template <typename C>
inline const C* pool_ptr(const at::Tensor& pool) {
  return reinterpret_cast<const C*>(pool.data_ptr());
}

template <typename T, typename C>
void run(const Shape& s, const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
         const at::Tensor& v_cache, const at::Tensor& block_tables,
         const std::vector<int64_t>& lens, float scale, int64_t window, float cap) {
  const int64_t num_seqs = static_cast<int64_t>(lens.size());
  const T* q_ptr = q.data_ptr<T>();
  const C* k_ptr = pool_ptr<C>(k_cache);
  const C* v_ptr = pool_ptr<C>(v_cache);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  T* out_ptr = out.data_ptr<T>();
  const AttendFn<T, C> fixed = fixed_kernel<T, C>(s.head_dim, s.group);
  // A work item is a whole sequence (every KV head, contiguous reads) when there are
  // enough sequences to keep the threads busy, else one (sequence, KV head) pair. The
  // generic walk always takes pairs.
  const int64_t threads = at::get_num_threads();
  const int64_t heads_per_item =
      fixed != nullptr && num_seqs >= 4 * threads ? s.num_kv_heads : 1;
  const int64_t per_seq = s.num_kv_heads / heads_per_item;
  const int64_t items = num_seqs * per_seq;
  // at::parallel_for hands each thread one contiguous range. Items are dealt out
  // round-robin instead, so the threads share short and long sequences alike (rows arrive
  // sorted by length).
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    if (fixed != nullptr) scratch.resize(heads_per_item * s.group * (2 * s.head_dim + kTile + 2));
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t item = w; item < items; item += workers) {
        const int64_t seq = item / per_seq, h0 = (item % per_seq) * heads_per_item;
        const int64_t len = lens[seq];
        T* o = out_ptr + seq * s.out_row;
        if (len <= 0) {
          std::fill(o + h0 * s.group * s.head_dim,
                    o + (h0 + heads_per_item) * s.group * s.head_dim, static_cast<T>(0.f));
          continue;
        }
        const T* qs = q_ptr + seq * s.q_row;
        const int32_t* table = tables + seq * s.width;
        const int64_t first = window_start(len - 1, window);  // the query sits at len - 1
        if (fixed != nullptr) {
          fixed(s, qs, k_ptr, v_ptr, table, first, len, scale, cap, o, h0, heads_per_item,
                scratch.data());
        } else {
          attend_one<T, C>(s, qs + h0 * s.group * s.q_head, k_ptr + h0 * s.head_dim,
                        v_ptr + h0 * s.head_dim, table, first, len, scale, cap,
                        o + h0 * s.group * s.head_dim, scratch);
        }
      }
    }
  });
}

// Checks shared by both entry points: q (rows, H, D) with contiguous rows, pools
// (num_blocks, block_size, Hkv, D) contiguous, one dtype, int32 block tables, out (rows, H*D).
void check_common(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& block_tables) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be (B, H, D) with contiguous rows");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be contiguous (num_blocks, block_size, Hkv, D)");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == q.scalar_type() ||
                   k_cache.scalar_type() == at::kFloat8_e4m3fn) &&
                  q.scalar_type() == out.scalar_type(),
              "q and out must share a dtype, and the pools be of it or float8_e4m3fn");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.dim() == 2,
              "block_tables must be contiguous int32 (B, W)");
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % k_cache.size(2) == 0,
              "pool head_dim must match q's and H must be a multiple of Hkv");
  TORCH_CHECK(out.is_contiguous() && out.numel() == q.size(0) * num_heads * head_dim,
              "out must be contiguous (B, H * D)");
}

Shape make_shape(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& block_tables) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2), num_kv_heads = k_cache.size(2);
  const int64_t block_size = k_cache.size(1);
  return Shape{num_kv_heads, num_heads / num_kv_heads, head_dim, block_size,
               block_tables.size(1), q.stride(0), q.stride(1), num_heads * head_dim,
               block_size * num_kv_heads * head_dim, num_kv_heads * head_dim};
}

// out (B, H * D); q (B, H, D), last dim contiguous; pools (num_blocks, block_size, Hkv, D)
// contiguous; block_tables (B, W) int32; seq_lens (B,) int32: keys each row attends to.
// window > 0: each query sees only its last `window` keys; softcap > 0: scores soft-capped.
void paged_decode_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, int64_t window,
                            double softcap) {
  check_common(out, q, k_cache, v_cache, block_tables);
  TORCH_CHECK(block_tables.size(0) == q.size(0), "block_tables must have a row per query");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.numel() == q.size(0),
              "seq_lens must be int32 (B,)");
  const Shape s = make_shape(q, k_cache, block_tables);
  auto lens_cpu = seq_lens.contiguous();
  const int32_t* lens_ptr = lens_cpu.data_ptr<int32_t>();
  std::vector<int64_t> lens(lens_ptr, lens_ptr + q.size(0));
  for (int64_t len : lens) {
    TORCH_CHECK(len <= s.width * s.block_size, "a seq_len exceeds its block table");
  }
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  auto dispatch = [&](auto zero) {
    using T = decltype(zero);
    if (fp8) {
      run<T, c10::Float8_e4m3fn>(s, out, q, k_cache, v_cache, block_tables, lens, fscale,
                                 window, fcap);
    } else {
      run<T, T>(s, out, q, k_cache, v_cache, block_tables, lens, fscale, window, fcap);
    }
  };
  switch (q.scalar_type()) {
    case at::kFloat:
      dispatch(0.f);
      break;
    case at::kBFloat16:
      dispatch(c10::BFloat16());
      break;
    case at::kHalf:
      TORCH_CHECK(!fp8, "an fp8 pool is read for float32 and bfloat16 queries");
      run<c10::Half, c10::Half>(s, out, q, k_cache, v_cache, block_tables, lens, fscale, window,
                                fcap);
      break;
    default:
      TORCH_CHECK(false, "paged_decode_attention supports float32, bfloat16 and float16");
  }
}

// Prefill (and chunked prefill): query rows of one sequence against every key up to their
// own position, keys read from the pool through the block table. Tiled as flash attention
// is, but transposed: a tile's kTileRows score rows ((query, group head) pairs) lie along
// the vector lanes. Then
//  - scores come out of register-blocked FMAs of 8 keys x 3 row vectors, each key element
//    broadcast from its pool row, so K is read where it lies and never transposed;
//  - the online softmax is elementwise over row vectors (a row's max over the tile's keys
//    is a vector max across keys), with no horizontal reductions;
//  - P x V accumulates the output transposed as well, (D, rows), 8 dims x 3 row vectors
//    in registers, each value element broadcast from its pool row.
// The queries are transposed once per tile and the output once at its end, both amortised
// over every key tile. The previous layout (rows along memory, K transposed into the tile
// per key tile) spent half its time outside FMAs.
//
// The register blocks follow the target's vector registers: AVX-512's 32 registers of 16
// floats hold 8 keys (or dims) x 3 row vectors, all 48 rows at once. With 16 registers of
// 8 floats (AVX2) that block would need 54 registers and spill on every FMA (4 GFLOP/s,
// against 90+ for oneDNN's GEMMs on the same Zen 3): there a block is 4 x 3 vectors of 8,
// and a tile's rows are walked in two groups of 24.
constexpr int kKeyBlock = kLanes == 16 ? 8 : 4;  // keys scored in registers together
constexpr int kDimBlock = kLanes == 16 ? 8 : 4;  // output dims accumulated together
constexpr int kRowVecs = 3;
constexpr int64_t kRegRows = kRowVecs * kLanes;  // score rows in one register block
constexpr int64_t kTileRows = 48;                // score rows per tile
constexpr int64_t kKTile = 32;                   // keys per online-softmax update
static_assert(kTileRows % kRegRows == 0, "register blocks tile the rows");

// Queries per tile: as many as fit their group heads into the tile's rows.
inline int64_t tile_queries(int64_t group) { return std::max<int64_t>(1, kTileRows / group); }

// One step of a register block: acc[i] += s[i] * x for N scalars against a tile's row
// vectors (the keys' scores, and the output dims' sums, both grow this way).
template <int N>
inline void outer_fma(Vec (&acc)[N][kRowVecs], const float (&s)[N],
                      const Vec (&x)[kRowVecs]) {
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < kRowVecs; ++v) acc[i][v] += s[i] * x[v];
  }
}

// The block's N rows of row vectors to dst, `stride` floats apart (and back).
template <int N>
inline void store_block(float* dst, int64_t stride, const Vec (&acc)[N][kRowVecs]) {
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < kRowVecs; ++v) store_vec(dst + i * stride + v * kLanes, acc[i][v]);
  }
}

inline void load_row(const float* src, Vec (&x)[kRowVecs]) {
#pragma GCC unroll 4
  for (int v = 0; v < kRowVecs; ++v) x[v] = load_vec(src + v * kLanes);
}

struct Chunk {
  int64_t row0, num_q, seq_len;  // first query row in q, query count, keys after this step
  const int32_t* table;
};

// The head sizes prefill is compiled for (cpu_attention.PREFILL_HEAD_DIMS lists the same):
// the common ones of Llama-family models (SmolLM2 64, Llama and Qwen 128, Phi-2 80, Phi-3
// 96, Gemma 256) and the small ones of tiny test and draft models. Each is one more
// instantiation per dtype, a few seconds of the first build.
#define BATCHINFER_PREFILL_HEAD_DIMS(X) X(16) X(32) X(64) X(80) X(96) X(128) X(256)

inline bool prefill_head_dim(int64_t head_dim) {
#define BATCHINFER_HEAD(D) head_dim == D ||
  return BATCHINFER_PREFILL_HEAD_DIMS(BATCHINFER_HEAD) false;
#undef BATCHINFER_HEAD
}

template <int D>
constexpr int64_t prefill_work_floats() {
  return 2 * D * kTileRows + kKTile * kTileRows + 2 * kKTile * D;
}

template <typename T, typename C, int D>
void prefill_tile(const Shape& s, const Chunk& c, int64_t h, int64_t q0, const T* q_ptr,
                  const C* k_pool, const C* v_pool, float scale, int64_t window, float cap,
                  T* out_ptr, float* work) {
  constexpr int64_t R = kTileRows;
  static_assert(D % kDimBlock == 0 && kKTile % kKeyBlock == 0, "blocks must tile");
  const int64_t G = s.group;
  const int64_t nq = std::min(tile_queries(G), c.num_q - q0);
  const int64_t rows = nq * G;   // row r: query r / G, head h * G + r % G
  // Rows computed: whole register blocks, so a short chunk's tile skips the empty ones.
  const int64_t live = (rows + kRegRows - 1) / kRegRows * kRegRows;
  float* qt = work;              // (D, R) scaled queries, transposed
  float* acc = qt + D * R;       // (D, R) running weighted sums of V, transposed
  float* sc = acc + D * R;       // (kKTile, R) a tile's scores, then weights
  float* kbuf = sc + kKTile * R; // (kKTile, D) widened K rows when T is not float
  float* vbuf = kbuf + kKTile * D;
  alignas(64) float maxes[R], sums[R], qpos[R];
  const int64_t first_pos = c.seq_len - c.num_q + q0;  // position of query q0
  for (int64_t r = 0; r < R; ++r) {
    // Padding rows see every key; their queries are 0 and their results are dropped.
    qpos[r] = r < rows ? static_cast<float>(first_pos + r / G) : FLT_MAX;
    maxes[r] = -FLT_MAX;
    sums[r] = 0.f;
  }
  std::fill(qt, qt + 2 * D * R, 0.f);
  alignas(64) float row[D];
  for (int64_t r = 0; r < rows; ++r) {
    widen(q_ptr + (c.row0 + q0 + r / G) * s.q_row + (h * G + r % G) * s.q_head, row, D);
    for (int d = 0; d < D; ++d) qt[d * R + r] = row[d] * scale;
  }
  const int64_t num_keys = first_pos + nq;  // the last query sees keys 0..first_pos + nq - 1
  // Under a sliding window the first query sees keys from key_start on, later ones fewer:
  // query at p sees keys p - window + 1 .. p (a key before that is masked like a future one).
  const int64_t key_start = window_start(first_pos, window);
  const int64_t last_start = window_start(first_pos + nq - 1, window);
  const float* krow[kKTile];
  const float* vrow[kKTile];
  for (int64_t j0 = key_start; j0 < num_keys; j0 += kKTile) {
    const int64_t nk = std::min(kKTile, num_keys - j0);
    for (int64_t t = 0; t < nk; ++t) {
      const int64_t at = table_offset(s, c.table, j0 + t) + h * D;
      krow[t] = float_row(k_pool + at, kbuf + t * D, D);
      vrow[t] = float_row(v_pool + at, vbuf + t * D, D);
    }
    for (int64_t t = nk; t < kKTile; ++t) krow[t] = krow[nk - 1];  // scored, then masked
    for (int64_t t0 = 0; t0 < nk; t0 += kKeyBlock) {
      for (int64_t r0 = 0; r0 < live; r0 += kRegRows) {
        Vec acc_s[kKeyBlock][kRowVecs] = {};
        for (int d = 0; d < D; ++d) {
          Vec qv[kRowVecs];
          load_row(qt + d * R + r0, qv);
          float kd[kKeyBlock];
#pragma GCC unroll 8
          for (int k = 0; k < kKeyBlock; ++k) kd[k] = krow[t0 + k][d];
          outer_fma(acc_s, kd, qv);
        }
        store_block(sc + t0 * R + r0, R, acc_s);
      }
    }
    if (cap > 0.f) {
      for (int64_t t = 0; t < nk; ++t) soft_cap(sc + t * R, live, cap);
    }
    // Masked keys score -1e30 (not -inf: -ffast-math assumes no infinities), so their
    // weights come out 0. Only a tile that reaches past the first query needs a mask; keys
    // past nk lie after every query.
    if (j0 + kKTile - 1 > first_pos) {
      for (int64_t t = 0; t < kKTile; ++t) {
        const float pos = static_cast<float>(j0 + t);
        float* st = sc + t * R;
#pragma omp simd
        for (int64_t r = 0; r < live; ++r) st[r] = pos > qpos[r] ? -1e30f : st[r];
      }
    }
    // And, under a window, a tile that starts before the last query's first key. A row
    // with every key of a tile masked takes weights 1 there, wiped by the next tile's
    // alpha = exp(-1e30 - max) = 0 (its own keys always come later).
    if (window > 0 && j0 < last_start) {
      const float w = static_cast<float>(window);
      for (int64_t t = 0; t < kKTile; ++t) {
        const float pos = static_cast<float>(j0 + t);
        float* st = sc + t * R;
#pragma omp simd
        for (int64_t r = 0; r < live; ++r) st[r] = pos <= qpos[r] - w ? -1e30f : st[r];
      }
    }
    alignas(64) float new_max[R], alpha[R], tile_sum[R];
#pragma omp simd
    for (int64_t r = 0; r < live; ++r) new_max[r] = maxes[r];
    for (int64_t t = 0; t < nk; ++t) {
      const float* st = sc + t * R;
#pragma omp simd
      for (int64_t r = 0; r < live; ++r) new_max[r] = std::max(new_max[r], st[r]);
    }
#pragma omp simd
    for (int64_t r = 0; r < live; ++r) {
      alpha[r] = batchinfer::fast_exp(maxes[r] - new_max[r]);
      maxes[r] = new_max[r];
      tile_sum[r] = 0.f;
    }
    for (int64_t t = 0; t < nk; ++t) {
      float* st = sc + t * R;
#pragma omp simd
      for (int64_t r = 0; r < live; ++r) {
        const float e = batchinfer::fast_exp(st[r] - new_max[r]);
        st[r] = e;
        tile_sum[r] += e;
      }
    }
#pragma omp simd
    for (int64_t r = 0; r < live; ++r) sums[r] = sums[r] * alpha[r] + tile_sum[r];
    for (int64_t r0 = 0; r0 < live; r0 += kRegRows) {
      Vec al[kRowVecs];
      load_row(alpha + r0, al);
      for (int d0 = 0; d0 < D; d0 += kDimBlock) {
        Vec x[kDimBlock][kRowVecs];
#pragma GCC unroll 8
        for (int dd = 0; dd < kDimBlock; ++dd) {
          load_row(acc + (d0 + dd) * R + r0, x[dd]);
#pragma GCC unroll 4
          for (int v = 0; v < kRowVecs; ++v) x[dd][v] *= al[v];
        }
        for (int64_t t = 0; t < nk; ++t) {
          Vec p[kRowVecs];
          load_row(sc + t * R + r0, p);
          float vd[kDimBlock];
          std::memcpy(vd, vrow[t] + d0, sizeof vd);
          outer_fma(x, vd, p);
        }
        store_block(acc + d0 * R + r0, R, x);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / sums[r];
    for (int d = 0; d < D; ++d) row[d] = acc[d * R + r] * inv;
    narrow(row, out_ptr + (c.row0 + q0 + r / G) * s.out_row + (h * G + r % G) * D, D);
  }
}

template <typename T, typename C, int D>
void run_prefill(const Shape& s, const at::Tensor& out, const at::Tensor& q,
                 const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const std::vector<Chunk>& chunks, float scale, int64_t window, float cap) {
  // Items: (chunk, KV head, query tile), dealt round-robin so every thread gets early
  // (short) and late (long) tiles alike.
  std::vector<std::array<int64_t, 3>> items;
  const int64_t per_tile = tile_queries(s.group);
  for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c) {
    for (int64_t q0 = 0; q0 < chunks[c].num_q; q0 += per_tile) {
      for (int64_t h = 0; h < s.num_kv_heads; ++h) items.push_back({c, h, q0});
    }
  }
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work(prefill_work_floats<D>());
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t i = w; i < n; i += workers) {
        const auto& [c, h, q0] = items[i];
        prefill_tile<T, C, D>(s, chunks[c], h, q0, q.data_ptr<T>(), pool_ptr<C>(k_cache),
                              pool_ptr<C>(v_cache), scale, window, cap, out.data_ptr<T>(),
                           work.data());
      }
    }
  });
}

// out (N, H * D); q (N, H, D) rows of every chunk in order; block_tables (C, W) int32;
// query_starts (C + 1,) int32 row offsets; seq_lens (C,) int32 keys of each chunk's sequence
// after this step (its queries are the last query_len positions). Head sizes as listed above.
void paged_prefill_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& query_starts, const at::Tensor& seq_lens,
                             double scale, int64_t window, double softcap) {
  check_common(out, q, k_cache, v_cache, block_tables);
  const int64_t num_chunks = block_tables.size(0);
  TORCH_CHECK(query_starts.scalar_type() == at::kInt && query_starts.is_contiguous() &&
                  query_starts.numel() == num_chunks + 1,
              "query_starts must be contiguous int32 (C + 1,)");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.numel() == num_chunks,
              "seq_lens must be contiguous int32 (C,)");
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(prefill_head_dim(head_dim),
              "prefill supports head sizes 16, 32, 64, 80, 96, 128 and 256");
  TORCH_CHECK(q.size(1) / k_cache.size(2) <= kTileRows,
              batchinfer::message("prefill supports up to %lld query heads per KV head",
                                  static_cast<long long>(kTileRows)).c_str());
  const Shape s = make_shape(q, k_cache, block_tables);
  const int32_t* starts = query_starts.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_chunks] == q.size(0),
              "query_starts must run from 0 to the number of query rows");
  std::vector<Chunk> chunks;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t num_q = starts[c + 1] - starts[c];
    TORCH_CHECK(num_q >= 1 && lens[c] >= num_q,
                batchinfer::message("chunk %lld has %lld queries and seq_len %d",
                                    static_cast<long long>(c), static_cast<long long>(num_q),
                                    lens[c]).c_str());
    TORCH_CHECK(lens[c] <= s.width * s.block_size, "a seq_len exceeds its block table");
    chunks.push_back({starts[c], num_q, lens[c], block_tables.data_ptr<int32_t>() + c * s.width});
  }
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  auto run_as = [&](auto zero, auto pool_zero) {
    using T = decltype(zero);
    using C = decltype(pool_zero);
    switch (head_dim) {
#define BATCHINFER_HEAD(D)                                                           \
  case D:                                                                            \
    run_prefill<T, C, D>(s, out, q, k_cache, v_cache, chunks, fscale, window, fcap); \
    break;
      BATCHINFER_PREFILL_HEAD_DIMS(BATCHINFER_HEAD)
#undef BATCHINFER_HEAD
    }
  };
  auto run = [&](auto zero) {
    if (fp8) {
      run_as(zero, c10::Float8_e4m3fn());
    } else {
      run_as(zero, zero);
    }
  };
  switch (q.scalar_type()) {
    case at::kFloat:
      run(0.f);
      break;
    case at::kBFloat16:
      run(c10::BFloat16());
      break;
    case at::kHalf:
      TORCH_CHECK(!fp8, "an fp8 pool is read for float32 and bfloat16 queries");
      run_as(c10::Half(), c10::Half());
      break;
    default:
      TORCH_CHECK(false, "paged_prefill_attention supports float32, bfloat16 and float16");
  }
}

}  // namespace

TORCH_LIBRARY(batchinfer_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale, int window=0, float softcap=0.) -> ()");
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor query_starts, Tensor seq_lens, float scale, int window=0, "
      "float softcap=0.) -> ()");
}

TORCH_LIBRARY_IMPL(batchinfer_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
