// Vector helpers shared by the CPU attention kernels (paged_decode.cpp, paged_prefill.cpp):
// sixteen float32 lanes as a GCC vector, bfloat16 widening, a vectorised exp, lane reductions.
// Everything is forced inline, so each instruction-set copy of a kernel compiles them for its
// own registers.

#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace pdserve_cpu {

#define PDSERVE_INLINE __attribute__((always_inline)) inline

// exp(x) for x <= 0 in a form the compiler vectorises (libm's expf is a call per element):
// x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' degree-6 polynomial, 2^n through the
// exponent bits. Relative error about 1e-7, like expf's.
PDSERVE_INLINE float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below this e^x underflows to 0 in float32 anyway
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
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
  return p * scale;
}

// A cache row as float32: the row itself for a float32 cache, a widened copy for bfloat16.
PDSERVE_INLINE const float* as_float(const float* row, int64_t, float*) { return row; }

PDSERVE_INLINE const float* as_float(const c10::BFloat16* row, int64_t n, float* buffer) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(row);
#pragma omp simd
  for (int64_t i = 0; i < n; i++) {
    const uint32_t wide = static_cast<uint32_t>(bits[i]) << 16;
    float value;
    std::memcpy(&value, &wide, sizeof value);
    buffer[i] = value;
  }
  return buffer;
}

PDSERVE_INLINE void store(float* out, const float* acc, float inv, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) out[i] = acc[i] * inv;
}

PDSERVE_INLINE void store(c10::BFloat16* out, const float* acc, float inv, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = c10::BFloat16(acc[i] * inv);  // round to nearest even
}

// Sixteen float32 lanes as a GCC vector: AVX-512 registers in the avx512f clone, pairs of AVX2
// ones or fours of SSE ones in the others.
typedef float v16 __attribute__((vector_size(64)));
typedef float v16_unaligned __attribute__((vector_size(64), aligned(4)));

PDSERVE_INLINE v16 load16(const float* p) { return *reinterpret_cast<const v16_unaligned*>(p); }

// Sixteen bfloat16 values widened in registers: a bfloat16 is the high half of a float32.
typedef uint16_t u16x16_unaligned __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

PDSERVE_INLINE v16 load16(const c10::BFloat16* p) {
  const u32x16 wide =
      __builtin_convertvector(*reinterpret_cast<const u16x16_unaligned*>(p), u32x16) << 16;
  v16 out;
  std::memcpy(&out, &wide, sizeof out);
  return out;
}

typedef int32_t i16x16 __attribute__((vector_size(64)));

// e^r for |r| <= ln2 / 2 on 16 lanes, by Cephes' degree-6 polynomial (the vector exps' shared
// part; they reduce x = n ln2 + r and scale by 2^n themselves).
PDSERVE_INLINE v16 exp_reduced16(v16 r) {
  v16 p = v16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp_nonpositive on 16 lanes (same steps; floor from truncation, which rounds toward zero).
// Lanes above 0 (masked-out ones hold anything) are clamped to 0 so no conversion overflows.
PDSERVE_INLINE v16 exp16_nonpositive(v16 x) {
  const v16 floor_value = v16{} - 87.0f;
  x = x < floor_value ? floor_value : x;
  x = x > 0.0f ? v16{} : x;
  const v16 y = x * 1.44269504088896341f + 0.5f;
  const i16x16 truncated = __builtin_convertvector(y, i16x16);
  const i16x16 whole = truncated + (__builtin_convertvector(truncated, v16) > y);  // true = -1
  const v16 n = __builtin_convertvector(whole, v16);
  const v16 p = exp_reduced16(x - n * 0.693359375f + n * 2.12194440e-4f);
  const i16x16 bits = (whole + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

PDSERVE_INLINE float lane_max(v16 x) {
  float m = x[0];
  for (int i = 1; i < 16; i++) m = std::max(m, x[i]);
  return m;
}

PDSERVE_INLINE float lane_sum(v16 x) {
  float sum = 0.0f;
  for (int i = 0; i < 16; i++) sum += x[i];
  return sum;
}

// One copy per instruction set, picked when the library loads: the build runs anywhere, and
// the vector loops use the widest registers of the CPU they run on.
#if defined(__x86_64__)
#define PDSERVE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PDSERVE_CLONES  // other architectures: one copy for the build's own target
#endif

}  // namespace pdserve_cpu
