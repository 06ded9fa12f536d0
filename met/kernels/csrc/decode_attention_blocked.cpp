// Paged decode attention, register-blocked (attend_fast): the path of the engine's caches,
// contiguous rows with D % 32 == 0, float32 / bf16 rows (the queries' dtype) or int8 rows with
// float32 scales (read in quad order). Two variants of the same maths, picked once per
// process by kWideVectors (met_simd.h): the wide one sized for AVX-512's 32 zmm registers,
// and the narrow one in 8-lane vectors for CPUs without AVX-512 (they add in different
// orders). int8 caches on AVX2 CPUs without AVX-512 take decode_attention_int8_avx2.cpp
// instead; other layouts decode_attention_tile.cpp. decode_attention.h has the pieces all
// paths share, decode_attention.cpp the op.
#include "decode_attention.h"

namespace met_decode_attention {
namespace {

// ---------------------------------------------------------------------------------------------
// Register-blocked path for rows stored contiguously with D a multiple of 32 (the engine's
// caches). Cache rows are read straight into registers (bf16 widened in pair order with one
// shift or mask per vector) instead of being staged through a tile in memory, each row serves
// up to three query heads of its group at once, and the value sums stay in registers for the
// whole context: faster than the tile path (benchmarks/decode_attention.py). Scoring with
// vdpbf16ps or with AMX tiles instead was not faster: the scores are bound by fetching the
// rows, not by the multiply-adds.

// Keys per score block and query heads per block: 3 heads x 8 keys of partial dot products
// plus the row and query vectors fill the 32 vector registers of AVX-512.
constexpr int kKeyBlock = 8;
// How far ahead (in rows) the register-blocked passes ask for lines into L2, beside the
// next block's lines into L1: with the whole decode step's cache (~250 MB at 64 requests)
// coming from memory, the L1 request alone arrives too late to hide the DRAM latency.
constexpr int kFarRows = 32;
constexpr int kHeadBlock = 3;

// Lanes `first`.. of vector c (16 floats) of a contiguous row, as a V (vfloat: all sixteen,
// first = 0; vfloat8: eight of them): float32 as is; bf16 in pair order (even vector 2b holds
// the even elements of the row's 32-element block b, odd vector 2b + 1 the odd ones); int8 in
// quad order (the 64 values of block c / 4 as sixteen words, byte c % 4 of each moved to the
// top and shifted back down with its sign: GCC 12 widens a vector of int8 lane by lane, so
// the sign extension is spelled as shifts). Lane l of vector c is 32-bit word `first` + l of
// the span the vector is read from.
template <typename T, int kOdd, typename V, typename VI, typename VU>
MET_INLINE V row_lanes(const T* row, int64_t c, int64_t first) {
  if constexpr (std::is_same_v<T, float>) {
    V f;
    std::memcpy(&f, row + c * kLanes + first, sizeof(f));
    return f;
  } else if constexpr (std::is_same_v<T, int8_t>) {
    VI w;
    std::memcpy(&w, row + (c / 4) * 64 + 4 * first, sizeof(w));
    const VI x = (w << (24 - 8 * static_cast<int>(c % 4))) >> 24;
    return __builtin_convertvector(x, V);
  } else {
    VU w;
    std::memcpy(&w, row + (c - kOdd) * kLanes + 2 * first, sizeof(w));
    const VU x = kOdd ? (w & 0xFFFF0000u) : (w << 16);
    V f;
    std::memcpy(&f, &x, sizeof(f));
    return f;
  }
}

template <typename T, int kOdd>
MET_INLINE vfloat row_vector(const T* row, int64_t c) {
  return row_lanes<T, kOdd, vfloat, vint, vuint>(row, c, 0);
}

// The block's row pointers for slots[0..n) (keys past n repeat the last row), and each key's
// score scale: scale, times the row's own scale for int8 rows.
template <typename T, typename V>
MET_INLINE V key_block(const T* kg, int64_t s1, const float* row_scale, const int64_t* slots,
                       int64_t n, float scale, const T** rows) {
  for (int j = 0; j < kKeyBlock; ++j) rows[j] = kg + slots[j < n ? j : n - 1] * s1;
  V key_scale = scale - V{};
  if constexpr (std::is_same_v<T, int8_t>) {
    for (int j = 0; j < kKeyBlock; ++j) key_scale[j] = scale * row_scale[slots[j < n ? j : n - 1]];
  }
  return key_scale;
}

// Lanes j = 0..7 of the result are the sums of the lanes of a[j] (lanes 8..15 repeat them), by
// the same tree for every j.
MET_INLINE vfloat hsum8(const vfloat* a) {
  vfloat r1[4], r2[2];
  for (int m = 0; m < 4; ++m) {
    const vfloat x = a[2 * m], y = a[2 * m + 1];
    r1[m] = MET_SHUFFLE(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            MET_SHUFFLE(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int m = 0; m < 2; ++m) {
    const vfloat x = r1[2 * m], y = r1[2 * m + 1];
    r2[m] = MET_SHUFFLE(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            MET_SHUFFLE(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  const vfloat r3 =
      MET_SHUFFLE(r2[0], r2[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
      MET_SHUFFLE(r2[0], r2[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return MET_SHUFFLE(r3, r3, 0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14) +
         MET_SHUFFLE(r3, r3, 1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15);
}

// Accumulates, for GB heads and the eight keys of rows[], query vector c times row vector c.
template <typename T, int GB, int kOdd>
MET_INLINE void dot_step(const T* const* rows, const float* qf, int64_t Dp, int64_t c,
                         vfloat (*dots)[kKeyBlock]) {
  vfloat qv[GB];
#pragma GCC unroll 4
  for (int h = 0; h < GB; ++h) qv[h] = vload(qf + h * Dp + c * kLanes);
#pragma GCC unroll 8
  for (int j = 0; j < kKeyBlock; ++j) {
    const vfloat kv = row_vector<T, kOdd>(rows[j], c);
#pragma GCC unroll 4
    for (int h = 0; h < GB; ++h) dots[h][j] += qv[h] * kv;
  }
}

// Scores of keys t0..t0+7 for GB heads (rows of qf, Dp apart) into s[h * Lp + t0 + j]. Keys
// past the context (n < 8) repeat its last row; their scores are overwritten by the softmax.
// int8 rows: each key's dot product is multiplied by scale · its row scale (row_scale, the
// kv head's scales by slot) instead of scale.
template <typename T, int GB>
MET_INLINE void score_block(const T* kg, int64_t s1, const float* row_scale,
                            const int64_t* slots, int64_t n, const float* qf, int64_t Dp,
                            float scale, float* s, int64_t Lp) {
  const T* rows[kKeyBlock];
  const vfloat key_scale = key_block<T, vfloat>(kg, s1, row_scale, slots, n, scale, rows);
  vfloat dots[GB][kKeyBlock] = {};
  // The even and odd vectors of a bf16 block come from one load each; float32 rows are read
  // in order. Either way every key sees the same sequence of products.
  for (int64_t c = 0; c < Dp; c += 2 * kLanes) {
    dot_step<T, GB, 0>(rows, qf, Dp, c / kLanes, dots);
    dot_step<T, GB, 1>(rows, qf, Dp, c / kLanes + 1, dots);
  }
#pragma GCC unroll 4
  for (int h = 0; h < GB; ++h) {
    const vfloat r = hsum8(dots[h]) * key_scale;
    std::memcpy(s + h * Lp, &r, kKeyBlock * sizeof(float));
  }
}

// ---- The narrow variant, for CPUs without AVX-512 (16 vector registers of 8 floats) ----
// There the blocks above do not fit: 3 heads x 8 keys of 16-lane partial sums alone are 48
// ymm registers, and the compiled loop spent most of its time spilling them. The narrow scores keep eight 8-lane sums (one head, eight keys) in
// registers; the value pass keeps two heads x four 8-lane sums. A CPU runs one variant only
// (chosen once, see kWideVectors), so its results stay reproducible and batch-invariant; the
// two variants add in different orders.

// Half `half` (lanes 8 * half ..) of row_vector<T, kOdd>(row, c), read on its own.
template <typename T, int kOdd>
MET_INLINE vfloat8 row_half(const T* row, int64_t c, int half) {
  return row_lanes<T, kOdd, vfloat8, vint8, vuint8>(row, c, 8 * half);
}

// Lane j of the result is the sum of the lanes of a[j], by the same tree for every j.
MET_INLINE vfloat8 hsum8_narrow(const vfloat8* a) {
  vfloat8 r1[4], r2[2];
  for (int m = 0; m < 4; ++m) {  // lanes 0-3: a[2m]'s half sums, 4-7: a[2m + 1]'s
    const vfloat8 x = a[2 * m], y = a[2 * m + 1];
    r1[m] = MET_SHUFFLE8(x, y, 0, 1, 2, 3, 8, 9, 10, 11) +
            MET_SHUFFLE8(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int m = 0; m < 2; ++m) {  // pairs of lanes: a[4m], a[4m + 2], a[4m + 1], a[4m + 3]
    const vfloat8 x = r1[2 * m], y = r1[2 * m + 1];
    r2[m] = MET_SHUFFLE8(x, y, 0, 1, 8, 9, 4, 5, 12, 13) +
            MET_SHUFFLE8(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
  }
  // lanes: a[0], a[2], a[4], a[6], a[1], a[3], a[5], a[7]
  const vfloat8 r3 = MET_SHUFFLE8(r2[0], r2[1], 0, 2, 8, 10, 4, 6, 12, 14) +
                     MET_SHUFFLE8(r2[0], r2[1], 1, 3, 9, 11, 5, 7, 13, 15);
  return MET_SHUFFLE8(r3, r3, 0, 4, 1, 5, 2, 6, 3, 7);
}

template <typename T, int kOdd>
MET_INLINE void dot_step_narrow(const T* const* rows, const float* q, int64_t c,
                                vfloat8* dots) {
#pragma GCC unroll 2
  for (int half = 0; half < 2; ++half) {
    vfloat8 qv;
    std::memcpy(&qv, q + c * kLanes + half * 8, sizeof(qv));
#pragma GCC unroll 8
    for (int j = 0; j < kKeyBlock; ++j) dots[j] += qv * row_half<T, kOdd>(rows[j], c, half);
  }
}

// score_block for one head (q: its row of Dp floats), in 8-lane vectors.
template <typename T>
MET_INLINE void score_block_narrow(const T* kg, int64_t s1, const float* row_scale,
                                   const int64_t* slots, int64_t n, const float* q, int64_t Dp,
                                   float scale, float* s) {
  const T* rows[kKeyBlock];
  const vfloat8 key_scale = key_block<T, vfloat8>(kg, s1, row_scale, slots, n, scale, rows);
  vfloat8 dots[kKeyBlock] = {};
  for (int64_t c = 0; c < Dp; c += 2 * kLanes) {
    dot_step_narrow<T, 0>(rows, q, c / kLanes, dots);
    dot_step_narrow<T, 1>(rows, q, c / kLanes + 1, dots);
  }
  const vfloat8 r = hsum8_narrow(dots) * key_scale;
  std::memcpy(s, &r, kKeyBlock * sizeof(float));
}

// acc[h][d0..d0+CB*16) += sum over the L keys, in order, of w[h * Lp + t] * value row t.
template <typename T, int GB, int CB>
MET_INLINE void value_pass(const T* vg, int64_t s1, const int64_t* slots, int64_t L,
                           const float* w, int64_t Lp, int64_t d0, float* acc, int64_t Dp) {
  static_assert(CB % 2 == 0, "bf16 vectors come in even/odd pairs");
  vfloat a[GB][CB] = {};
  const int64_t bytes = CB * kLanes * static_cast<int64_t>(sizeof(T));
  for (int64_t t = 0; t < L; ++t) {
    if (t + kKeyBlock < L) {
      const char* ahead = reinterpret_cast<const char*>(vg + slots[t + kKeyBlock] * s1 + d0);
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(ahead + b);
    }
    if (t + kFarRows < L) {
      const char* far = reinterpret_cast<const char*>(vg + slots[t + kFarRows] * s1 + d0);
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(far + b, 0, 2);
    }
    const T* row = vg + slots[t] * s1 + d0;
    vfloat v[CB];
#pragma GCC unroll 8
    for (int c = 0; c < CB; c += 2) {
      v[c] = row_vector<T, 0>(row, c);
      v[c + 1] = row_vector<T, 1>(row, c + 1);
    }
#pragma GCC unroll 4
    for (int h = 0; h < GB; ++h) {
      const vfloat wv = MET_SPLAT(w[h * Lp + t]);
#pragma GCC unroll 8
      for (int c = 0; c < CB; ++c) a[h][c] += wv * v[c];
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < GB; ++h) {
#pragma GCC unroll 8
    for (int c = 0; c < CB; ++c) vstore(acc + h * Dp + d0 + c * kLanes, a[h][c]);
  }
}

template <typename T, int GB>
MET_INLINE void scores_fast(const Problem& p, const T* kg, const float* row_scale,
                            const int64_t* slots, int64_t L, const float* qf, int64_t Dp,
                            float* s, int64_t Lp) {
  for (int64_t t0 = 0; t0 < L; t0 += kKeyBlock) {
    const int64_t n = std::min<int64_t>(kKeyBlock, L - t0);
    // The next block's lines into L1 while this one is computed, and the block kFarRows
    // ahead into L2 (prefetch_rows ignores a count of zero or less).
    prefetch_rows(kg, p.k_s1, p.k_s2, slots + t0 + kKeyBlock,
                  std::min<int64_t>(kKeyBlock, L - t0 - kKeyBlock), p.D);
    prefetch_rows<T, 2>(kg, p.k_s1, p.k_s2, slots + t0 + kFarRows,
                        std::min<int64_t>(kKeyBlock, L - t0 - kFarRows), p.D);
    score_block<T, GB>(kg, p.k_s1, row_scale, slots + t0, n, qf, Dp, p.scale, s + t0, Lp);
  }
}

template <typename T, int GB>
MET_INLINE void values_fast(const Problem& p, const T* vg, const int64_t* slots, int64_t L,
                            const float* w, int64_t Lp, float* acc, int64_t Dp) {
  int64_t d0 = 0;
  for (; d0 + 4 * kLanes <= p.D; d0 += 4 * kLanes) {
    value_pass<T, GB, 4>(vg, p.v_s1, slots, L, w, Lp, d0, acc, Dp);
  }
  if (d0 < p.D) value_pass<T, GB, 2>(vg, p.v_s1, slots, L, w, Lp, d0, acc, Dp);
}

// scores_fast for CPUs without AVX-512: each block of eight keys scored for one head at a
// time (its rows stay in L1 across the heads).
template <typename T>
MET_INLINE void scores_narrow(const Problem& p, const T* kg, const float* row_scale,
                              const int64_t* slots, int64_t L, const float* qf, int64_t G,
                              int64_t Dp, float* s, int64_t Lp) {
  for (int64_t t0 = 0; t0 < L; t0 += kKeyBlock) {
    const int64_t n = std::min<int64_t>(kKeyBlock, L - t0);
    prefetch_rows(kg, p.k_s1, p.k_s2, slots + t0 + kKeyBlock,
                  std::min<int64_t>(kKeyBlock, L - t0 - kKeyBlock), p.D);
    prefetch_rows<T, 2>(kg, p.k_s1, p.k_s2, slots + t0 + kFarRows,
                        std::min<int64_t>(kKeyBlock, L - t0 - kFarRows), p.D);
    for (int64_t h = 0; h < G; ++h) {
      score_block_narrow<T>(kg, p.k_s1, row_scale, slots + t0, n, qf + h * Dp, Dp, p.scale,
                            s + h * Lp + t0);
    }
  }
}

// value_pass in 8-lane vectors: lanes 8 * half .. of the CB 16-lane vectors of the rows from
// d0 on, for GB heads (a[GB][CB] and the row's CB vectors stay in registers).
template <typename T, int GB, int CB>
MET_INLINE void value_pass_narrow(const T* vg, int64_t s1, const int64_t* slots, int64_t L,
                                  const float* w, int64_t Lp, int64_t d0, int half, float* acc,
                                  int64_t Dp) {
  vfloat8 a[GB][CB] = {};
  const int64_t bytes = CB * kLanes * static_cast<int64_t>(sizeof(T));
  for (int64_t t = 0; t < L; ++t) {
    if (half == 0 && t + kKeyBlock < L) {
      const char* ahead = reinterpret_cast<const char*>(vg + slots[t + kKeyBlock] * s1 + d0);
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(ahead + b);
    }
    if (half == 0 && t + kFarRows < L) {
      const char* far = reinterpret_cast<const char*>(vg + slots[t + kFarRows] * s1 + d0);
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(far + b, 0, 2);
    }
    const T* row = vg + slots[t] * s1 + d0;
    vfloat8 v[CB];
#pragma GCC unroll 4
    for (int c = 0; c < CB; c += 2) {
      v[c] = row_half<T, 0>(row, c, half);
      v[c + 1] = row_half<T, 1>(row, c + 1, half);
    }
#pragma GCC unroll 2
    for (int h = 0; h < GB; ++h) {
      const vfloat8 wv = w[h * Lp + t] - vfloat8{};
#pragma GCC unroll 4
      for (int c = 0; c < CB; ++c) a[h][c] += wv * v[c];
    }
  }
#pragma GCC unroll 2
  for (int h = 0; h < GB; ++h) {
#pragma GCC unroll 4
    for (int c = 0; c < CB; ++c) {
      std::memcpy(acc + h * Dp + d0 + c * kLanes + half * 8, &a[h][c], sizeof(a[h][c]));
    }
  }
}

template <typename T, int GB>
MET_INLINE void values_narrow_heads(const Problem& p, const T* vg, const int64_t* slots,
                                    int64_t L, const float* w, int64_t Lp, float* acc,
                                    int64_t Dp) {
  for (int half = 0; half < 2; ++half) {
    int64_t d0 = 0;
    for (; d0 + 4 * kLanes <= p.D; d0 += 4 * kLanes) {
      value_pass_narrow<T, GB, 4>(vg, p.v_s1, slots, L, w, Lp, d0, half, acc, Dp);
    }
    if (d0 < p.D) value_pass_narrow<T, GB, 2>(vg, p.v_s1, slots, L, w, Lp, d0, half, acc, Dp);
  }
}

// values_fast for CPUs without AVX-512: two heads at a time.
template <typename T>
MET_INLINE void values_narrow(const Problem& p, const T* vg, const int64_t* slots, int64_t L,
                              const float* w, int64_t G, int64_t Lp, float* acc, int64_t Dp) {
  for (int64_t h0 = 0; h0 < G; h0 += 2) {
    if (G - h0 >= 2) {
      values_narrow_heads<T, 2>(p, vg, slots, L, w + h0 * Lp, Lp, acc + h0 * Dp, Dp);
    } else {
      values_narrow_heads<T, 1>(p, vg, slots, L, w + h0 * Lp, Lp, acc + h0 * Dp, Dp);
    }
  }
}

// attend_one for contiguous rows with D % 32 == 0: the same maths on the same inputs (in
// another, equally fixed, order), no tile. Q is the queries' (and output's) type, T the
// cache's: the same, or int8 rows with float32 scales. kWide: the AVX-512 blocking, else the
// narrow one.
template <typename Q, typename T, bool kWide>
MET_INLINE void attend_fast(const Problem& p, const Span& t, const Span* next, float* ws) {
  constexpr bool kInt8 = std::is_same_v<T, int8_t>;
  constexpr int kOrder = std::is_same_v<T, c10::BFloat16> ? kPairOrder
                         : std::is_same_v<T, int8_t>     ? kQuadOrder
                                                         : kNaturalOrder;
  const int64_t D = p.D, Dp = D, G = p.H / p.Hkv;
  const int64_t i = t.i, g = t.g, L = t.L;
  const int64_t Lp = (L + kLanes - 1) / kLanes * kLanes;
  const int64_t* slots = t.slots;
  const T* kg = static_cast<const T*>(p.k) + g * p.k_s0;
  const T* vg = static_cast<const T*>(p.v) + g * p.v_s0;
  const float* k_scale = kInt8 ? p.k_scale + g * p.S : nullptr;
  float* qf = ws;            // [G, Dp]
  float* acc = qf + G * Dp;  // [G, Dp]
  float* s = acc + G * Dp;   // [G, Lp]: scores, then probabilities

  load_q<Q, kOrder>(p, i, g, qf);
  if constexpr (!kWide) scores_narrow<T>(p, kg, k_scale, slots, L, qf, G, Dp, s, Lp);
  for (int64_t h0 = 0; kWide && h0 < G; h0 += kHeadBlock) {
    const float* qh = qf + h0 * Dp;
    float* sh = s + h0 * Lp;
    switch (std::min<int64_t>(kHeadBlock, G - h0)) {
      case 3: scores_fast<T, 3>(p, kg, k_scale, slots, L, qh, Dp, sh, Lp); break;
      case 2: scores_fast<T, 2>(p, kg, k_scale, slots, L, qh, Dp, sh, Lp); break;
      default: scores_fast<T, 1>(p, kg, k_scale, slots, L, qh, Dp, sh, Lp); break;
    }
  }
  prefetch_rows(vg, p.v_s1, p.v_s2, slots, std::min<int64_t>(kKeyBlock, L), D);
  float inv_sum[64], row_max[64], row_sum[64];  // G <= 64 is checked by the caller
  if constexpr (kWide) {
    softmax_rows<vfloat, vint>(s, G, L, Lp, inv_sum, row_max, row_sum);
  } else {
    softmax_rows<vfloat8, vint8>(s, G, L, Lp, inv_sum, row_max, row_sum);
  }
  if constexpr (kInt8) {
    // Each value row's scale joins its weight: sum_t w_t (s_t q_t) = sum_t (w_t s_t) q_t.
    const float* v_scale = p.v_scale + g * p.S;
    for (int64_t t = 0; t < L; ++t) {
      const float vs = v_scale[slots[t]];
      for (int64_t h = 0; h < G; ++h) s[h * Lp + t] *= vs;
    }
  }
  if constexpr (!kWide) values_narrow<T>(p, vg, slots, L, s, G, Lp, acc, Dp);
  for (int64_t h0 = 0; kWide && h0 < G; h0 += kHeadBlock) {
    const float* wh = s + h0 * Lp;
    float* ah = acc + h0 * Dp;
    switch (std::min<int64_t>(kHeadBlock, G - h0)) {
      case 3: values_fast<T, 3>(p, vg, slots, L, wh, Lp, ah, Dp); break;
      case 2: values_fast<T, 2>(p, vg, slots, L, wh, Lp, ah, Dp); break;
      default: values_fast<T, 1>(p, vg, slots, L, wh, Lp, ah, Dp); break;
    }
  }
  if (next != nullptr) {  // the first keys of the task this thread runs next
    const T* nk = static_cast<const T*>(p.k) + next->g * p.k_s0;
    prefetch_rows(nk, p.k_s1, p.k_s2, next->slots, std::min<int64_t>(kKeyBlock, next->L), D);
  }
  finish<Q, kOrder>(p, t, acc, inv_sum, row_max, row_sum);
}

template <typename Q, typename T>
MET_INLINE void attend_fast_any(const Problem& p, const Span& t, const Span* next, float* ws) {
  if (kWideVectors) {
    attend_fast<Q, T, true>(p, t, next, ws);
  } else {
    attend_fast<Q, T, false>(p, t, next, ws);
  }
}

}  // namespace

MET_CLONES void attend_range_blocked_f32(const Problem& p, int64_t begin, int64_t end,
                                         float* ws) {
  for_each_task(p, begin, end, [&](const Span& t, const Span* ahead, int64_t)
                                   MET_INLINE_LAMBDA {
    if (p.k_scale != nullptr) {
      attend_fast_any<float, int8_t>(p, t, ahead, ws);
    } else {
      attend_fast_any<float, float>(p, t, ahead, ws);
    }
  });
}

MET_CLONES void attend_range_blocked_bf16(const Problem& p, int64_t begin, int64_t end,
                                          float* ws) {
  for_each_task(p, begin, end, [&](const Span& t, const Span* ahead, int64_t)
                                   MET_INLINE_LAMBDA {
    if (p.k_scale != nullptr) {
      attend_fast_any<c10::BFloat16, int8_t>(p, t, ahead, ws);
    } else {
      attend_fast_any<c10::BFloat16, c10::BFloat16>(p, t, ahead, ws);
    }
  });
}

}  // namespace met_decode_attention
