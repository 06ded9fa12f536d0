// Shared by met's int8-activation kernels (w8a8.cpp, w4a8.cpp): the AVX512-VNNI check and
// target, bfloat16 loads, tail masks and the float32 / bfloat16 output store. Each kernel is
// its own shared library, so the anonymous namespace keeps these private to it. The
// extensions' names hash every header, so an edit here rebuilds each kernel that includes it.
#pragma once

#include "met_cpu.h"

#include <immintrin.h>

#include <cstdint>

namespace {

constexpr int64_t kVnniLanes = 16;

bool vnni_supported() { return met_cpu::avx512_vnni(); }

#if defined(__x86_64__)
#define MET_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

// The lanes of a 16-lane vector that hold one of the ``left`` remaining values.
MET_VNNI_TARGET inline __mmask16 tail_mask(int64_t left) {
  return left >= kVnniLanes ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

// Sixteen bfloat16 values (the masked lanes) widened exactly to float32.
MET_VNNI_TARGET inline __m512 widen_bf16(const uint16_t* p, __mmask16 mask = 0xFFFF) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

// Store the masked lanes of y as float32 (out_float) or rounded to bfloat16 (nearest even,
// as c10::BFloat16 does for finite values).
MET_VNNI_TARGET inline void store_out(void* out, __m512 y, bool out_float, __mmask16 mask) {
  if (out_float) {
    _mm512_mask_storeu_ps(out, mask, y);
    return;
  }
  const __m512i u = _mm512_castps_si512(y);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_mask_storeu_epi16(out, mask, _mm512_cvtepi32_epi16(rounded));
}
#endif

}  // namespace
