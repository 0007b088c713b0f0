// Math shared by the CPU kernels, written so that loops calling it vectorise.
#pragma once

#include <cstdint>
#include <cstring>

namespace batchinfer {

// e^x for float, within ~2 ulp of expf (Cephes' range reduction and polynomial), and 0
// below e^-87. glibc's expf is a call per element in most of our loops (the compiler finds
// its vector twin only in the simplest ones), a third of the prefill kernel's time; this
// inlines into every loop as plain FMAs and integer shifts.
inline float fast_exp(float x) {
  const float clamped = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = __builtin_floorf(clamped * 1.44269504088896341f + 0.5f);
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.0f ? 0.0f : p * scale;
}

}  // namespace batchinfer
