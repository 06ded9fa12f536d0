// Paged decode attention for any layout (strided rows, head dims that are not a multiple of
// 32): the general path, attend_one. Sixteen cache rows at a time are converted into a
// float32 tile in memory, which the score and value loops then read at fixed offsets. The
// engine's own caches take the faster register-blocked path (decode_attention_blocked.cpp);
// decode_attention.h has the pieces all paths share, decode_attention.cpp the op.
#include "decode_attention.h"

namespace met_decode_attention {
namespace {

// Lane j of the result is the sum of the lanes of a[j]: sixteen horizontal sums for fifteen
// two-register shuffle steps, always in the same tree order.
MET_INLINE vfloat hsum16(const vfloat* a) {
  vfloat r1[8], r2[4], r3[2];
  for (int m = 0; m < 8; ++m) {
    const vfloat x = a[2 * m], y = a[2 * m + 1];
    r1[m] = MET_SHUFFLE(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            MET_SHUFFLE(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int m = 0; m < 4; ++m) {
    const vfloat x = r1[2 * m], y = r1[2 * m + 1];
    r2[m] = MET_SHUFFLE(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            MET_SHUFFLE(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int m = 0; m < 2; ++m) {
    const vfloat x = r2[2 * m], y = r2[2 * m + 1];
    r3[m] = MET_SHUFFLE(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
            MET_SHUFFLE(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return MET_SHUFFLE(r3[0], r3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         MET_SHUFFLE(r3[0], r3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// Converts n <= 16 cache rows into a float32 tile laid out chunk-major: element d of row j
// sits at tile[(d / 16) * 256 + j * 16 + d % 16] (d in pair order when kPairs); rows n..15
// are zero. The sixteen rows of a chunk are then at fixed offsets from one pointer, which the
// loops below use as memory operands, and a partial last tile needs no special case.
template <typename T, bool kPairs>
MET_INLINE void load_tile(const T* base, int64_t s1, int64_t s2, const int64_t* slots,
                          int64_t n, int64_t D, int64_t Dp, float* tile) {
  constexpr int64_t kChunk = kLanes * kLanes;
  for (int64_t j = 0; j < kLanes; ++j) {
    float* dst = tile + j * kLanes;
    if (j >= n) {
      for (int64_t d = 0; d < Dp; d += kLanes) vstore(dst + d * kLanes, vfloat{});
      continue;
    }
    const T* src = base + slots[j] * s1;
    if constexpr (kPairs) {
      for (int64_t d = 0; d < Dp; d += 2 * kLanes) {
        vfloat even, odd;
        vload_bf16_pairs(src + d, &even, &odd);
        vstore(dst + d * kLanes, even);
        vstore(dst + d * kLanes + kChunk, odd);
      }
      continue;
    } else if constexpr (std::is_same_v<T, float>) {
      if (s2 == 1 && D == Dp) {
        for (int64_t d = 0; d < Dp; d += kLanes) vstore(dst + d * kLanes, vload(src + d));
        continue;
      }
    }
    for (int64_t d = 0; d < Dp; ++d) {
      dst[(d / kLanes) * kChunk + d % kLanes] = d < D ? to_float(src[d * s2]) : 0.f;
    }
  }
}

// Attention of the G = H / Hkv query heads of request i that share kv head g, for any layout:
// rows are converted into a float32 tile, sixteen at a time. Everything is a function of this
// request's own inputs, computed in one fixed order. next_task only steers a prefetch.
template <typename T, bool kPairs>
MET_INLINE void attend_one(const Problem& p, const Span& t, const Span* next, float* ws) {
  const int64_t D = p.D, Dp = padded_dim(D), G = p.H / p.Hkv;
  const int64_t i = t.i, g = t.g, L = t.L;
  const int64_t Lp = (L + kLanes - 1) / kLanes * kLanes;
  const int64_t* slots = t.slots;
  const T* kg = static_cast<const T*>(p.k) + g * p.k_s0;
  const T* vg = static_cast<const T*>(p.v) + g * p.v_s0;

  float* qf = ws;                 // [G, Dp]
  float* acc = qf + G * Dp;       // [G, Dp]
  float* tile = acc + G * Dp;     // [Dp / 16, 16, 16], see load_tile
  float* s = tile + kLanes * Dp;  // [G, Lp]: scores, then probabilities
  std::fill(acc, acc + G * Dp, 0.f);

  load_q<T, kPairs>(p, i, g, qf);

  // Scores, sixteen keys at a time; a key row is converted once for all G heads of its group.
  // Each key's dot product is kept as sixteen partial sums (dots[j], in registers) that
  // hsum16 then adds up for all sixteen keys at once.
  for (int64_t t0 = 0; t0 < L; t0 += kLanes) {
    const int64_t n = std::min(kLanes, L - t0);
    if (t0 + kLanes < L) {
      prefetch_rows(kg, p.k_s1, p.k_s2, slots + t0 + kLanes, std::min(kLanes, L - t0 - kLanes),
                    D);
    } else {
      prefetch_rows(vg, p.v_s1, p.v_s2, slots, std::min(kLanes, L), D);  // first value tile
    }
    load_tile<T, kPairs>(kg, p.k_s1, p.k_s2, slots + t0, n, D, Dp, tile);
    for (int64_t h = 0; h < G; ++h) {
      const float* qh = qf + h * Dp;
      vfloat dots[kLanes] = {};
      for (int64_t d = 0; d < Dp; d += kLanes) {
        const vfloat qv = vload(qh + d);
        const float* chunk = tile + d * kLanes;
        for (int64_t j = 0; j < kLanes; ++j) dots[j] += qv * vload(chunk + j * kLanes);
      }
      vstore(s + h * Lp + t0, hsum16(dots) * p.scale);
    }
  }

  float inv_sum[64], row_max[64], row_sum[64];  // G <= 64 is checked by the caller
  softmax_rows<vfloat, vint>(s, G, L, Lp, inv_sum, row_max, row_sum);

  // Probability-weighted sum of the value rows. Even and odd positions of a tile go to
  // separate accumulators (added at the end of the tile): with four vectors of the output row
  // per block that keeps eight independent FMA chains in flight instead of four, and the
  // order of the additions is still fixed.
  for (int64_t t0 = 0; t0 < L; t0 += kLanes) {
    const int64_t n = std::min(kLanes, L - t0);
    if (t0 + kLanes < L) {
      prefetch_rows(vg, p.v_s1, p.v_s2, slots + t0 + kLanes, std::min(kLanes, L - t0 - kLanes),
                    D);
    } else if (next != nullptr) {  // the first key tile of the task this thread runs next
      const T* nk = static_cast<const T*>(p.k) + next->g * p.k_s0;
      prefetch_rows(nk, p.k_s1, p.k_s2, next->slots, std::min(kLanes, next->L), D);
    }
    load_tile<T, kPairs>(vg, p.v_s1, p.v_s2, slots + t0, n, D, Dp, tile);
    for (int64_t h = 0; h < G; ++h) {
      // Weights past n are zero and so are their rows, so the full tile is exact.
      const float* w = s + h * Lp + t0;
      float* ah = acc + h * Dp;
      int64_t d = 0;
      for (; d + 4 * kLanes <= Dp; d += 4 * kLanes) {
        const float* c0 = tile + d * kLanes;  // four chunks, 256 floats apart
        vfloat e0 = {}, e1 = {}, e2 = {}, e3 = {}, o0 = {}, o1 = {}, o2 = {}, o3 = {};
        for (int64_t j = 0; j < kLanes; j += 2) {
          const vfloat we = MET_SPLAT(w[j]), wo = MET_SPLAT(w[j + 1]);
          const float* re = c0 + j * kLanes;
          const float* ro = re + kLanes;
          e0 += we * vload(re);
          e1 += we * vload(re + 256);
          e2 += we * vload(re + 512);
          e3 += we * vload(re + 768);
          o0 += wo * vload(ro);
          o1 += wo * vload(ro + 256);
          o2 += wo * vload(ro + 512);
          o3 += wo * vload(ro + 768);
        }
        vstore(ah + d, vload(ah + d) + (e0 + o0));
        vstore(ah + d + 16, vload(ah + d + 16) + (e1 + o1));
        vstore(ah + d + 32, vload(ah + d + 32) + (e2 + o2));
        vstore(ah + d + 48, vload(ah + d + 48) + (e3 + o3));
      }
      for (; d < Dp; d += kLanes) {
        const float* c = tile + d * kLanes;
        vfloat e = {}, o = {};
        for (int64_t j = 0; j < kLanes; j += 2) {
          e += MET_SPLAT(w[j]) * vload(c + j * kLanes);
          o += MET_SPLAT(w[j + 1]) * vload(c + (j + 1) * kLanes);
        }
        vstore(ah + d, vload(ah + d) + (e + o));
      }
    }
  }

  finish<T, kPairs>(p, t, acc, inv_sum, row_max, row_sum);
}

}  // namespace

MET_CLONES void attend_range_tile_f32(const Problem& p, int64_t begin, int64_t end,
                                      float* ws) {
  for_each_task(p, begin, end, [&](const Span& t, const Span* ahead, int64_t)
                                   MET_INLINE_LAMBDA {
    attend_one<float, false>(p, t, ahead, ws);
  });
}

MET_CLONES void attend_range_tile_bf16(const Problem& p, int64_t begin, int64_t end,
                                       float* ws) {
  for_each_task(p, begin, end, [&](const Span& t, const Span* ahead, int64_t)
                                   MET_INLINE_LAMBDA {
    if (p.pairs) {
      attend_one<c10::BFloat16, true>(p, t, ahead, ws);
    } else {
      attend_one<c10::BFloat16, false>(p, t, ahead, ws);
    }
  });
}

}  // namespace met_decode_attention
