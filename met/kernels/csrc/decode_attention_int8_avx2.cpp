// Paged decode attention over an int8 cache on AVX2 CPUs without AVX-512 (attend_int8_avx2):
// a target("avx2,fma") path with its own blocking and read-ahead, in natural element order.
// Why it exists is below; kInt8Avx2 (defined here) says whether this CPU takes it, otherwise
// int8 caches take the register-blocked path (decode_attention_blocked.cpp). decode_attention.h
// has the pieces all paths share, decode_attention.cpp the op.
#include "decode_attention.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace met_decode_attention {

// ---- int8 caches on AVX2 CPUs without AVX-512 ----
// The portable narrow variant (decode_attention_blocked.cpp) converts every int8 row once per
// head (3 shifts and a convert per eight values, per head) and re-reads it per head group,
// too slow on CPUs without AVX-512. Here each row is
// sign-extended and converted once (vpmovsxbd + vcvtdq2ps per eight values) for up to three
// heads, four keys at a time in registers, in natural element order. Picked once per process
// (kInt8Avx2), so a machine always adds in one order.
#if defined(__x86_64__)
#define MET_AVX2_TARGET __attribute__((target("avx2,fma")))

namespace {

inline bool int8_avx2_path() {
  return !kWideVectors && MET_CPU_HAS("avx2") && MET_CPU_HAS("fma");
}

}  // namespace

const bool kInt8Avx2 = int8_avx2_path();

namespace {

// The rows a task reads, in the order it first reads them: its keys, its values, then the
// next task's keys. fetch(n) asks for the line of row n of that sequence and, every eighth
// row, its scale's line. A decode step's whole cache comes from memory in blocks of a few
// rows that sit anywhere, which the hardware prefetchers cannot follow; asking kReadAhead rows
// ahead in one steady stream (rather than in bursts per task) keeps the memory busy without
// stalling on full miss buffers (a wide range of distances ahead measured alike).
constexpr int64_t kReadAhead = 128;

// Where a task's int8 rows and their scales are: kv head g's cache, read by slot.
struct Int8Rows {
  const int8_t *k = nullptr, *v = nullptr;
  const float *k_scale = nullptr, *v_scale = nullptr;
  const int64_t* slots = nullptr;
  int64_t L = 0;
};

MET_INLINE Int8Rows int8_rows(const Problem& p, const Span& t) {
  return {static_cast<const int8_t*>(p.k) + t.g * p.k_s0,
          static_cast<const int8_t*>(p.v) + t.g * p.v_s0, p.k_scale + t.g * p.S,
          p.v_scale + t.g * p.S, t.slots, t.L};
}

struct ReadAhead {
  Int8Rows task, next;  // next: empty (L = 0) for a thread's last task
  int64_t k_s1, v_s1;

  MET_INLINE void fetch(int64_t n) const {
    const int8_t* base;
    const float* scale;
    const int64_t* sl;
    int64_t s1 = k_s1;
    if (n < task.L) {
      base = task.k, scale = task.k_scale, sl = task.slots;
    } else if (n < 2 * task.L) {
      n -= task.L, base = task.v, scale = task.v_scale, sl = task.slots, s1 = v_s1;
    } else if (n - 2 * task.L < next.L) {
      n -= 2 * task.L, base = next.k, scale = next.k_scale, sl = next.slots;
    } else {
      return;
    }
    __builtin_prefetch(base + sl[n] * s1, 0, 2);
    if (n % 8 == 0) __builtin_prefetch(scale + sl[n], 0, 2);
  }
};

// Eight int8 values as float32.
MET_AVX2_TARGET MET_INLINE __m256 load8_i8(const int8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

// The lane sums of a[0..3], in that order (a fixed tree: pairs, quads, then the two halves).
MET_AVX2_TARGET MET_INLINE __m128 hsum4x8(const __m256* a) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Scores of keys t0 .. t0+3 for GB heads (rows of q, D apart) into s[h * Lp + t0 + j]; keys
// past n repeat the last row (the softmax overwrites their scores).
template <int GB>
MET_AVX2_TARGET MET_INLINE void score4_avx2(const int8_t* kg, int64_t s1,
                                            const float* row_scale, const int64_t* slots,
                                            int64_t n, const float* q, int64_t D, float scale,
                                            float* s, int64_t Lp) {
  const int8_t* rows[4];
  float key_scale[4];
  for (int j = 0; j < 4; ++j) {
    const int64_t slot = slots[j < n ? j : n - 1];
    rows[j] = kg + slot * s1;
    key_scale[j] = scale * row_scale[slot];
  }
  __m256 dots[GB][4];
  for (int h = 0; h < GB; ++h) {
    for (int j = 0; j < 4; ++j) dots[h][j] = _mm256_setzero_ps();
  }
#pragma GCC unroll 8
  for (int64_t d = 0; d < D; d += 8) {
    __m256 qv[GB];
    for (int h = 0; h < GB; ++h) qv[h] = _mm256_loadu_ps(q + h * D + d);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256 kv = load8_i8(rows[j] + d);
      for (int h = 0; h < GB; ++h) dots[h][j] = _mm256_fmadd_ps(qv[h], kv, dots[h][j]);
    }
  }
  const __m128 ks = _mm_loadu_ps(key_scale);
  for (int h = 0; h < GB; ++h) _mm_storeu_ps(s + h * Lp, _mm_mul_ps(hsum4x8(dots[h]), ks));
}

// acc[h][d0 .. d0+32) = sum over the L keys, in order, of w[h * Lp + t] * value row t, for
// GB heads (acc rows D apart). ra: the task's read-ahead, on the first pass over the rows.
template <int GB>
MET_AVX2_TARGET MET_INLINE void value32_avx2(const int8_t* vg, int64_t s1,
                                             const int64_t* slots, int64_t L, const float* w,
                                             int64_t Lp, int64_t d0, const ReadAhead* ra,
                                             float* acc, int64_t D) {
  __m256 a[GB][4];
  for (int h = 0; h < GB; ++h) {
    for (int c = 0; c < 4; ++c) a[h][c] = _mm256_setzero_ps();
  }
  for (int64_t t = 0; t < L; ++t) {
    if (ra != nullptr) ra->fetch(L + t + kReadAhead);
    const int8_t* row = vg + slots[t] * s1 + d0;
    __m256 wv[GB];
    for (int h = 0; h < GB; ++h) wv[h] = _mm256_broadcast_ss(w + h * Lp + t);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256 v = load8_i8(row + 8 * c);
      for (int h = 0; h < GB; ++h) a[h][c] = _mm256_fmadd_ps(wv[h], v, a[h][c]);
    }
  }
  for (int h = 0; h < GB; ++h) {
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + h * D + d0 + 8 * c, a[h][c]);
  }
}

template <int GB>
MET_AVX2_TARGET MET_INLINE void scores_avx2(const Problem& p, const int8_t* kg,
                                            const float* k_scale, const int64_t* slots,
                                            int64_t L, const ReadAhead* ra, const float* q,
                                            float* s, int64_t Lp) {
  for (int64_t t0 = 0; t0 < L; t0 += 4) {
    if (ra != nullptr) {
      for (int j = 0; j < 4; ++j) ra->fetch(t0 + j + kReadAhead);
    }
    score4_avx2<GB>(kg, p.k_s1, k_scale, slots + t0, std::min<int64_t>(4, L - t0), q, p.D,
                    p.scale, s + t0, Lp);
  }
}

template <int GB>
MET_AVX2_TARGET MET_INLINE void values_avx2(const Problem& p, const int8_t* vg,
                                            const int64_t* slots, int64_t L,
                                            const ReadAhead* ra, const float* w, int64_t Lp,
                                            float* acc) {
  for (int64_t d0 = 0; d0 < p.D; d0 += 32) {
    value32_avx2<GB>(vg, p.v_s1, slots, L, w, Lp, d0, d0 == 0 ? ra : nullptr, acc, p.D);
  }
}

// f(std::integral_constant<int, GB>, h0) for the G heads in blocks of up to three (h0: the
// block's first head).
template <typename F>
MET_INLINE void for_head_blocks(int64_t G, F&& f) {
  for (int64_t h0 = 0; h0 < G; h0 += 3) {
    switch (std::min<int64_t>(3, G - h0)) {
      case 3: f(std::integral_constant<int, 3>{}, h0); break;
      case 2: f(std::integral_constant<int, 2>{}, h0); break;
      default: f(std::integral_constant<int, 1>{}, h0); break;
    }
  }
}

// attend_fast for an int8 cache, on AVX2: the same maths, rows in natural order.
// cold: the first task of a thread's range (no earlier task read ahead into its rows).
template <typename Q>
MET_AVX2_TARGET __attribute__((noinline)) void attend_int8_avx2(const Problem& p, const Span& t,
                                                                const Span* next, bool cold,
                                                                float* ws) {
  const int64_t D = p.D, G = p.H / p.Hkv, L = t.L;
  const int64_t Lp = (L + kLanes - 1) / kLanes * kLanes;
  const Int8Rows rows = int8_rows(p, t);
  const int64_t* slots = rows.slots;
  float* qf = ws;            // [G, D]
  float* acc = qf + G * D;   // [G, D]
  float* s = acc + G * D;    // [G, Lp]: scores, then probabilities
  const ReadAhead ra{rows, next != nullptr ? int8_rows(p, *next) : Int8Rows{}, p.k_s1, p.v_s1};

  load_q<Q, kNaturalOrder>(p, t.i, t.g, qf);
  if (cold) {
    for (int64_t n = 0; n < std::min(kReadAhead, L); ++n) ra.fetch(n);
  }
  // The first head block's pass over the rows reads ahead; later blocks find them in cache.
  for_head_blocks(G, [&](auto gb, int64_t h0) MET_AVX2_TARGET {
    scores_avx2<gb.value>(p, rows.k, rows.k_scale, slots, L, h0 == 0 ? &ra : nullptr,
                          qf + h0 * D, s + h0 * Lp, Lp);
  });
  float inv_sum[64], row_max[64], row_sum[64];  // G <= 64 is checked by the caller
  softmax_rows<vfloat8, vint8>(s, G, L, Lp, inv_sum, row_max, row_sum);
  // Each value row's scale joins its weight: sum_t w_t (s_t q_t) = sum_t (w_t s_t) q_t.
  // Eight keys at a time (the scores are padded to Lp, a multiple of 16).
  for (int64_t t0 = 0; t0 < L; t0 += 8) {
    alignas(32) float vs[8];
    for (int j = 0; j < 8; ++j) vs[j] = rows.v_scale[slots[std::min(t0 + j, L - 1)]];
    const __m256 vsv = _mm256_load_ps(vs);
    for (int64_t h = 0; h < G; ++h) {
      float* w = s + h * Lp + t0;
      _mm256_storeu_ps(w, _mm256_mul_ps(_mm256_loadu_ps(w), vsv));
    }
  }
  for_head_blocks(G, [&](auto gb, int64_t h0) MET_AVX2_TARGET {
    values_avx2<gb.value>(p, rows.v, slots, L, h0 == 0 ? &ra : nullptr, s + h0 * Lp, Lp,
                          acc + h0 * D);
  });
  finish<Q, kNaturalOrder>(p, t, acc, inv_sum, row_max, row_sum);
}

}  // namespace

MET_CLONES void attend_range_int8_avx2_f32(const Problem& p, int64_t begin, int64_t end,
                                           float* ws) {
  for_each_task(p, begin, end, [&](const Span& t, const Span* ahead, int64_t task)
                                   MET_INLINE_LAMBDA {
    attend_int8_avx2<float>(p, t, ahead, task == begin, ws);
  });
}

MET_CLONES void attend_range_int8_avx2_bf16(const Problem& p, int64_t begin, int64_t end,
                                            float* ws) {
  for_each_task(p, begin, end, [&](const Span& t, const Span* ahead, int64_t task)
                                   MET_INLINE_LAMBDA {
    attend_int8_avx2<c10::BFloat16>(p, t, ahead, task == begin, ws);
  });
}
#else
const bool kInt8Avx2 = false;
void attend_range_int8_avx2_f32(const Problem&, int64_t, int64_t, float*) {}
void attend_range_int8_avx2_bf16(const Problem&, int64_t, int64_t, float*) {}
#endif

}  // namespace met_decode_attention
