// Row helpers shared by fused_ops.cpp (layer ops) and sampler_ops.cpp (sampler ops):
// bfloat16 / float32 loads and stores, lane-width dispatch, exp. Included by one
// translation unit each (everything here is in an anonymous namespace).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "met_simd.h"

namespace {

typedef uint16_t vhalf __attribute__((vector_size(32)));

// Sixteen bfloat16 values widened (exactly) to float32, in order.
MET_INLINE vfloat load_bf16(const uint16_t* p) {
  vhalf h;
  std::memcpy(&h, p, sizeof(h));
  const vuint w = __builtin_convertvector(h, vuint) << 16;
  vfloat f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

MET_INLINE void store_bf16(uint16_t* p, vfloat f) {
  const vhalf h = __builtin_convertvector(bf16_bits(f), vhalf);
  std::memcpy(p, &h, sizeof(h));
}

// The float32 value a bfloat16 store of f would read back as.
MET_INLINE vfloat round_bf16(vfloat f) {
  const vuint w = bf16_bits(f) << 16;
  vfloat r;
  std::memcpy(&r, &w, sizeof(r));
  return r;
}

// The first n (<= 16) lanes of the same, the others zero: rows whose length is not a whole
// number of vectors end with one such partial chunk.
MET_INLINE vfloat load_bf16_n(const uint16_t* p, int64_t n) {
  if (n == kLanes) return load_bf16(p);
  uint16_t tmp[kLanes] = {};
  std::memcpy(tmp, p, n * sizeof(uint16_t));
  return load_bf16(tmp);
}

MET_INLINE void store_bf16_n(uint16_t* p, vfloat f, int64_t n) {
  if (n == kLanes) return store_bf16(p, f);
  uint16_t tmp[kLanes];
  store_bf16(tmp, f);
  std::memcpy(p, tmp, n * sizeof(uint16_t));
}

MET_INLINE vfloat load_f32_n(const float* p, int64_t n) {
  if (n == kLanes) return vload(p);
  float tmp[kLanes] = {};
  std::memcpy(tmp, p, n * sizeof(float));
  return vload(tmp);
}

MET_INLINE void store_f32_n(float* p, vfloat f, int64_t n) {
  if (n == kLanes) return vstore(p, f);
  std::memcpy(p, &f, n * sizeof(float));
}

// The stored type T's loads, stores and rounding: T = uint16_t holds bfloat16 bits (rounded
// where ATen's bfloat16 chain rounds), T = float is float32 (exact).
template <typename T>
MET_INLINE vfloat load_n(const T* p, int64_t n) {
  if constexpr (sizeof(T) == 2) return load_bf16_n(p, n);
  else return load_f32_n(p, n);
}

template <typename T>
MET_INLINE vfloat load_v(const T* p) {
  if constexpr (sizeof(T) == 2) return load_bf16(p);
  else return vload(p);
}

template <typename T>
MET_INLINE void store_n(T* p, vfloat f, int64_t n) {
  if constexpr (sizeof(T) == 2) store_bf16_n(p, f, n);
  else store_f32_n(p, f, n);
}

template <typename T>
MET_INLINE void store_v(T* p, vfloat f) {
  if constexpr (sizeof(T) == 2) store_bf16(p, f);
  else vstore(p, f);
}

template <typename T, typename V>
MET_INLINE V rnd(V f) {
  if constexpr (sizeof(T) == 2) return round_bf16(f);  // V = vfloat
  else return f;
}

// The first n values at p widened to float32 in a V of sixteen or eight lanes, the others
// zero.
template <typename T, typename V>
MET_INLINE V load_lanes(const T* p, int64_t n) {
  if constexpr (sizeof(V) == sizeof(vfloat)) {
    return load_n(p, n);
  } else {
    V v;
    float f[sizeof(V) / sizeof(float)] = {};
    if constexpr (sizeof(T) == 4) {
      if (n == sizeof(V) / sizeof(float)) {  // whole: one load, not through the stack
        std::memcpy(&v, p, sizeof(v));
        return v;
      }
      std::memcpy(f, p, n * sizeof(float));
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t w = static_cast<uint32_t>(p[i]) << 16;
        std::memcpy(f + i, &w, sizeof(w));
      }
    }
    std::memcpy(&v, f, sizeof(v));
    return v;
  }
}

// The first n lanes of f stored at p as T (V = vfloat8 only for T = float).
template <typename T, typename V>
MET_INLINE void store_lanes(T* p, V f, int64_t n) {
  if constexpr (sizeof(V) == sizeof(vfloat)) {
    store_n(p, f, n);
  } else if (n == sizeof(V) / sizeof(float)) {
    std::memcpy(p, &f, sizeof(f));
  } else {
    float t[sizeof(V) / sizeof(float)];
    std::memcpy(t, &f, sizeof(t));
    std::memcpy(p, t, n * sizeof(float));
  }
}

// The two instantiations of a row function body as target_clones entries.
#define MET_TYPED_ENTRIES(name, impl, params, args)            \
  MET_CLONES void name##_bf16 params { impl<uint16_t> args; } \
  MET_CLONES void name##_f32 params { impl<float> args; }

// exp(x), sixteen at a time: Cephes' expf polynomial (about 1 ulp), clamped to [-87, 88] so
// that 2^n stays a normal float.
template <typename V, typename VI>
MET_INLINE V vexp_t(V x) {
  const V lo = -87.0f - V{}, hi = 88.0f - V{};
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  V t = x * 1.44269504088896341f;
  t = t + (t < 0.0f ? -0.5f - V{} : 0.5f - V{});  // round half away from zero
  const VI n = __builtin_convertvector(t, VI);
  const V fn = __builtin_convertvector(n, V);
  V r = x - fn * 0.693359375f;  // ln2 in two parts: the first product is exact
  r = r - fn * -2.12194440e-4f;
  V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const VI bits = (n + 127) << 23;
  V two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

MET_INLINE vfloat vexp(vfloat x) { return vexp_t<vfloat, vint>(x); }

// Where a function has selects (exp's clamps, a running max) it also runs in 8-lane vectors
// on CPUs without AVX-512 (kWideVectors, met_simd.h); both widths give the same bits
// (element-wise maths; the argmax's first maximum does not depend on the lane count).


int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 32768 / row_elems); }

}  // namespace
