// SIMD basics shared by met's CPU kernels (decode_attention.cpp, fused_ops.cpp): runtime ISA
// dispatch, sixteen-lane vector types, loads/stores, float32 -> bfloat16 rounding and a
// fixed-order lane sum. Each kernel is its own shared library, so the anonymous namespace
// keeps these definitions private to it. The extensions' names hash every header, so an
// edit here rebuilds each kernel that includes it.
#pragma once

#include "met_cpu.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

#define MET_INLINE inline __attribute__((always_inline))
// The same for a lambda, so that it compiles with the target of the clone it is in.
#define MET_INLINE_LAMBDA __attribute__((always_inline))

// Runtime ISA dispatch without -march flags: the compiler emits one clone per target and the
// dynamic loader picks the best one this CPU supports, so one binary runs on any x86-64. A
// machine always runs the same clone, so its results are reproducible.
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define MET_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#endif
#ifndef MET_CLONES
#define MET_CLONES
#endif

// Sixteen float lanes as a GCC/Clang vector type: element-wise arithmetic that each clone maps
// onto its own registers (one zmm, two ymm or four xmm). Spelling the lanes out fixes every
// summation order without -ffast-math, so results are bitwise-reproducible.
constexpr int64_t kLanes = 16;
typedef float vfloat __attribute__((vector_size(64)));
typedef int32_t vint __attribute__((vector_size(64)));
typedef uint32_t vuint __attribute__((vector_size(64)));

#if defined(__clang__)
#define MET_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define MET_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, vint{__VA_ARGS__})
#endif

// Eight float lanes: the native width of AVX2. GCC lowers a select (a < b ? a : b) on the
// sixteen-lane vectors lane by lane through the stack when the clone has only 8-lane
// registers, and register-blocked loops sized for 32 zmm registers spill; the kernels' narrow
// variants use these types instead, picked once per process by kWideVectors.
typedef float vfloat8 __attribute__((vector_size(32)));
typedef int32_t vint8 __attribute__((vector_size(32)));
typedef uint32_t vuint8 __attribute__((vector_size(32)));

#if defined(__clang__)
#define MET_SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define MET_SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, vint8{__VA_ARGS__})
#endif

// Whether this CPU takes the kernels' sixteen-lane variants (the x86-64-v4 test of the
// clones) rather than their 8-lane ones: decided once per process, so every call on a machine
// adds in one order. MET_NARROW_KERNELS=1 picks the narrow variants on any CPU, so that a
// machine with AVX-512 can test them too (tests/layers/test_narrow_kernels.py).
inline bool wide_vectors() {
  const char* narrow = std::getenv("MET_NARROW_KERNELS");
  if (narrow != nullptr && narrow[0] == '1') return false;
#if defined(__x86_64__)
  return met_cpu::avx512();
#else
  return true;
#endif
}
const bool kWideVectors = wide_vectors();

// Broadcast of a scalar. x - 0 is exactly x for every x (even -0), so GCC folds this into one
// vbroadcastss, but only when written at the use site: behind an inline function GCC 12 builds
// the vector lane by lane with sixteen masked broadcasts, a slower kernel.
#define MET_SPLAT(x) ((x) - vfloat{})

MET_INLINE vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

MET_INLINE void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

// float32 -> bf16 bits (in the low half of each word), rounding to nearest even with NaN
// mapped to 0x7FC0: bit for bit what c10::BFloat16(float) does.
MET_INLINE vuint bf16_bits(vfloat f) {
  vuint u;
  std::memcpy(&u, &f, sizeof(u));
  const vuint rounded = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? vuint{} + 0x7FC0u : rounded;
}

// Fixed-order sum of the sixteen lanes.
MET_INLINE float hsum(vfloat v) {
  float t[kLanes];
  vstore(t, v);
  for (int w = kLanes / 2; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) t[l] += t[l + w];
  }
  return t[0];
}

}  // namespace
