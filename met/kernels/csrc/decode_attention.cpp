// Only the headers the kernel needs: <torch/extension.h> pulls in pybind11 and all of torch's
// C++ API, which more than doubles the first-call compile time.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "met_simd.h"

namespace {

// 32 bf16 values as two float32 vectors without a widening shuffle: read as sixteen 32-bit
// words, the even elements are the low halves (shift them up) and the odd elements the high
// halves (mask the low ones off). The values come out in "pair order": in each block of 32,
// the 16 even positions, then the 16 odd ones. A dot product does not care about the order as
// long as q uses the same one; the accumulator is put back in order when written out.
// (GCC widens 16 x bf16 -> 16 x float with extract/insert shuffles instead; measured slower.)
MET_INLINE void vload_bf16_pairs(const void* p, vfloat* even, vfloat* odd) {
  vuint w;
  std::memcpy(&w, p, sizeof(w));
  const vuint lo = w << 16, hi = w & 0xFFFF0000u;
  std::memcpy(even, &lo, sizeof(*even));
  std::memcpy(odd, &hi, sizeof(*odd));
}

// Position of element d of a row in pair order.
MET_INLINE int64_t pair_pos(int64_t d) {
  return (d & ~int64_t{31}) + (d & 1) * kLanes + ((d & 31) >> 1);
}

// The orders a row's elements are kept in as float32 (queries, accumulators): as stored,
// bf16 pair order (above), or int8 "quad order": 64 int8 values read as sixteen 32-bit words
// give four vectors by shifting, vector m holding elements 4w + m of the 64 (see row_vector).
constexpr int kNaturalOrder = 0, kPairOrder = 1, kQuadOrder = 2;

template <int kOrder>
MET_INLINE int64_t element_pos(int64_t d) {
  if constexpr (kOrder == kPairOrder) return pair_pos(d);
  if constexpr (kOrder == kQuadOrder) {
    return (d & ~int64_t{63}) + (d & 3) * kLanes + ((d & 63) >> 2);
  }
  return d;
}

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

// exp(x) for x <= 0 (softmax after max-subtraction), sixteen at a time: Cephes' expf
// polynomial (about 1 ulp). Unlike libm's scalar expf it vectorizes, and it gives the same
// bits on every clone. Inputs below -87 are clamped so that 2^n stays a normal float
// (exp(-87) ~ 2e-38 is negligible next to the max term's 1).
template <typename V, typename VI>
MET_INLINE V vexp_nonpositive_t(V x) {
  const V lo = -87.0f - V{};
  x = x < lo ? lo : x;
  // n = round(x / ln2): x <= 0, so truncating (y - 0.5) towards zero rounds to nearest.
  const VI n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, VI);
  const V fn = __builtin_convertvector(n, V);
  V r = x - fn * 0.693359375f;  // ln2 split in two so that the first product is exact
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

template <typename T>
MET_INLINE float to_float(T x) {
  return static_cast<float>(x);
}

struct Problem {
  const void* q;
  int64_t q_s0, q_s1, q_s2;
  const void* k;
  int64_t k_s0, k_s1, k_s2;
  const void* v;
  int64_t v_s0, v_s1, v_s2;
  void* out;  // contiguous [N, H, D]
  const int64_t* slots;
  const int64_t* offsets;
  int64_t H, Hkv, D;
  float scale;
  bool pairs;  // bf16 rows read 32 at a time in pair order (see vload_bf16_pairs)
  bool fast;   // contiguous cache rows, D % 32 == 0: attend_fast
  // Split contexts (see kSplit): request i's chunks are chunk_start[i] .. chunk_start[i + 1]
  // - 1, chunk_req[c] is chunk c's request, and partials holds one [G][Dp + 2] record per
  // (chunk, kv head) of a request with more than one chunk (null when none has).
  const int64_t* chunk_start;
  const int64_t* chunk_req;
  float* partials;
  // int8 caches: each (kv head, slot) row's float32 scale, at k_scale[g * S + slot]; null
  // for float caches. Only the register-blocked path reads int8 rows (in quad order).
  const float* k_scale;
  const float* v_scale;
  int64_t S;
};

// Head dim rounded up to whole vectors; rows are zero-padded to it.
MET_INLINE int64_t padded_dim(int64_t D) { return (D + kLanes - 1) / kLanes * kLanes; }

// Per-thread scratch, in floats.
MET_INLINE size_t workspace_floats(int64_t G, int64_t Dp, int64_t max_len) {
  const int64_t Lp = (max_len + kLanes - 1) / kLanes * kLanes;
  return static_cast<size_t>(2 * G * Dp + kLanes * Dp + G * Lp);
}

// Keys per chunk of a long context. A request longer than this is attended chunk by chunk,
// the chunks running as separate tasks (so a few long requests still spread over all
// threads), and the chunks' partial softmax sums merged in chunk order. The split depends on
// the request's own length only, so its result stays batch- and thread-invariant.
constexpr int64_t kSplit = 512;

// The keys one task attends over: request i, kv head g, slots[0 .. L-1]. partial: where the
// task leaves its unnormalized result for merge_one, or null when it is the whole context.
struct Span {
  int64_t i, g;
  const int64_t* slots;
  int64_t L;
  float* partial;
};

// Task = chunk * Hkv + kv head.
MET_INLINE Span task_span(const Problem& p, int64_t task) {
  const int64_t chunk = task / p.Hkv, g = task % p.Hkv;
  const int64_t i = p.chunk_req[chunk];
  const int64_t begin = p.offsets[i] + (chunk - p.chunk_start[i]) * kSplit;
  const int64_t L = std::min(kSplit, p.offsets[i + 1] - begin);
  float* partial = nullptr;
  if (p.chunk_start[i + 1] - p.chunk_start[i] > 1) {
    const int64_t G = p.H / p.Hkv;
    partial = p.partials + task * G * (padded_dim(p.D) + 2);
  }
  return {i, g, p.slots + begin, L, partial};
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

// Requests the cache lines of the next tile's rows while this tile is computed: the rows sit
// wherever their slots put them, which the hardware prefetchers cannot guess. (Prefetching
// further ahead into L1 measured slower: the line fill buffers are the limit. The
// register-blocked path adds an L2 request (Locality 2) kFarRows ahead, which pays when the
// cache comes from memory.)
template <typename T, int Locality = 3>
MET_INLINE void prefetch_rows(const T* base, int64_t s1, int64_t s2, const int64_t* slots,
                              int64_t n, int64_t D) {
  if (s2 != 1) return;  // strided rows: rare, and not worth guessing lines for
  const int64_t bytes = D * static_cast<int64_t>(sizeof(T));
  for (int64_t j = 0; j < n; ++j) {
    const char* row = reinterpret_cast<const char*>(base + slots[j] * s1);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, Locality);
  }
}

// The G query heads of request i that share kv head g, as float32 rows of Dp (zero-padded,
// in the cache rows' element order).
template <typename T, int kOrder>
MET_INLINE void load_q(const Problem& p, int64_t i, int64_t g, float* qf) {
  const int64_t D = p.D, Dp = padded_dim(D), G = p.H / p.Hkv;
  const T* q = static_cast<const T*>(p.q);
  for (int64_t h = 0; h < G; ++h) {
    const T* qh = q + i * p.q_s0 + (g * G + h) * p.q_s1;
    float* qfh = qf + h * Dp;
    if constexpr (kOrder == kPairOrder) {
      if (p.q_s2 == 1) {
        for (int64_t d = 0; d < Dp; d += 2 * kLanes) {
          vfloat even, odd;
          vload_bf16_pairs(qh + d, &even, &odd);
          vstore(qfh + d, even);
          vstore(qfh + d + kLanes, odd);
        }
        continue;
      }
    }
    for (int64_t d = D; d < Dp; ++d) qfh[d] = 0.f;
    for (int64_t d = 0; d < D; ++d) qfh[element_pos<kOrder>(d)] = to_float(qh[d * p.q_s2]);
  }
}

// The lanes' sum: sixteen by hsum's tree, eight in order.
MET_INLINE float lane_sum(vfloat v) { return hsum(v); }
MET_INLINE float lane_sum(vfloat8 v) {
  float sum = 0.f;
  for (int l = 0; l < 8; ++l) sum += v[l];
  return sum;
}

// Numerically stable softmax of each of the G rows of scores s[h * Lp + t], t < L: the row
// becomes exp(score - max) and inv_sum[h] 1 / its sum. The padding past L gets a score far
// below any real one, so it never wins the max, and is zeroed after exp, so it adds nothing
// to the sum. V: vfloat, or vfloat8 for the narrow path (the same maths; the lane sums add in
// another order).
template <typename V, typename VI>
MET_INLINE void softmax_rows(float* s, int64_t G, int64_t L, int64_t Lp, float* inv_sum,
                             float* row_max, float* row_sum) {
  constexpr int64_t kW = sizeof(V) / sizeof(float);
  for (int64_t h = 0; h < G; ++h) {
    float* sh = s + h * Lp;
    for (int64_t t = L; t < Lp; ++t) sh[t] = -3.0e38f;
    V vmax;
    std::memcpy(&vmax, sh, sizeof(vmax));
    for (int64_t t = kW; t < Lp; t += kW) {
      V x;
      std::memcpy(&x, sh + t, sizeof(x));
      vmax = x > vmax ? x : vmax;
    }
    float m = vmax[0];
    for (int l = 1; l < kW; ++l) m = std::max(m, vmax[l]);
    V total = {};
    for (int64_t t = 0; t < Lp; t += kW) {
      V e;
      std::memcpy(&e, sh + t, sizeof(e));
      e = vexp_nonpositive_t<V, VI>(e - m);
      std::memcpy(sh + t, &e, sizeof(e));
      if (t + kW > L) {
        for (int64_t u = std::max(L, t); u < t + kW; ++u) sh[u] = 0.f;
        std::memcpy(&e, sh + t, sizeof(e));
      }
      total += e;
    }
    row_max[h] = m;
    row_sum[h] = lane_sum(total);
    inv_sum[h] = 1.f / row_sum[h];
  }
}

// Writes acc[h] * inv_sum[h] (rows of Dp floats in element order kOrder) to the output rows
// of request i's heads in group g.
template <typename T, int kOrder>
MET_INLINE void write_out(const Problem& p, int64_t i, int64_t g, const float* acc,
                          const float* inv_sum) {
  const int64_t D = p.D, Dp = padded_dim(D), G = p.H / p.Hkv;
  T* out = static_cast<T*>(p.out) + (i * p.H + g * G) * D;
  for (int64_t h = 0; h < G; ++h) {
    const float* ah = acc + h * Dp;
    T* oh = out + h * D;
    const float inv = inv_sum[h];
    if constexpr (kOrder == kPairOrder) {
      // Back from pair order: even elements in the low halves of the words, odd in the high.
      for (int64_t d = 0; d < D; d += 2 * kLanes) {
        const vuint even = bf16_bits(vload(ah + d) * inv);
        const vuint odd = bf16_bits(vload(ah + d + kLanes) * inv);
        const vuint words = even | (odd << 16);
        std::memcpy(oh + d, &words, sizeof(words));
      }
      continue;
    } else if constexpr (std::is_same_v<T, float> && kOrder == kNaturalOrder) {
      if (D == Dp) {
        for (int64_t d = 0; d < D; d += kLanes) vstore(oh + d, vload(ah + d) * inv);
        continue;
      }
    }
    // float -> bf16 rounds to nearest even, as Tensor.to() does.
    for (int64_t d = 0; d < D; ++d) oh[d] = static_cast<T>(ah[element_pos<kOrder>(d)] * inv);
  }
}

// The end of a task: its heads' outputs, or (a chunk of a split context) the unnormalized
// sums, the max and the sum of exps for merge_one.
template <typename T, int kOrder>
MET_INLINE void finish(const Problem& p, const Span& t, const float* acc, const float* inv_sum,
                       const float* row_max, const float* row_sum) {
  if (t.partial == nullptr) {
    write_out<T, kOrder>(p, t.i, t.g, acc, inv_sum);
    return;
  }
  const int64_t Dp = padded_dim(p.D), G = p.H / p.Hkv;
  for (int64_t h = 0; h < G; ++h) {
    float* rec = t.partial + h * (Dp + 2);
    std::memcpy(rec, acc + h * Dp, Dp * sizeof(float));
    rec[Dp] = row_max[h];
    rec[Dp + 1] = row_sum[h];
  }
}

// Request i's output for kv head g from the records of its chunks, combined in chunk order:
// each chunk's sums scaled by exp(its max - the overall max).
template <typename T, int kOrder>
MET_INLINE void merge_one(const Problem& p, int64_t i, int64_t g, float* acc) {
  const int64_t Dp = padded_dim(p.D), G = p.H / p.Hkv, rec_size = G * (Dp + 2);
  const int64_t c0 = p.chunk_start[i], nc = p.chunk_start[i + 1] - c0;
  const float* first = p.partials + (c0 * p.Hkv + g) * rec_size;
  const int64_t chunk_stride = p.Hkv * rec_size;
  float inv_sum[64];
  for (int64_t h = 0; h < G; ++h) {
    float m = -3.0e38f;
    for (int64_t c = 0; c < nc; ++c) m = std::max(m, first[c * chunk_stride + h * (Dp + 2) + Dp]);
    float total = 0.f;
    float* ah = acc + h * Dp;
    std::fill(ah, ah + Dp, 0.f);
    for (int64_t c = 0; c < nc; ++c) {
      const float* rec = first + c * chunk_stride + h * (Dp + 2);
      const vfloat e = vexp_nonpositive_t<vfloat, vint>(MET_SPLAT(rec[Dp] - m));
      total += e[0] * rec[Dp + 1];
      for (int64_t d = 0; d < Dp; d += kLanes) vstore(ah + d, vload(ah + d) + e * vload(rec + d));
    }
    inv_sum[h] = 1.f / total;
  }
  write_out<T, kOrder>(p, i, g, acc, inv_sum);
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

// ---------------------------------------------------------------------------------------------
// Register-blocked path for rows stored contiguously with D a multiple of 32 (the engine's
// caches). Cache rows are read straight into registers (bf16 widened in pair order with one
// shift or mask per vector) instead of being staged through a tile in memory, each row serves
// up to three query heads of its group at once, and the value sums stay in registers for the
// whole context. (Measured on a Sapphire Rapids core: ~1.3-1.4x faster than the tile path at
// 64 requests x 9/3 heads x 64 dims. Scoring with vdpbf16ps or with AMX tiles instead was
// not faster: the scores are bound by fetching the rows, not by the multiply-adds.)

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
// ymm registers, and the compiled loop spent most of its time spilling them (measured on an
// AMD Zen 3: ~4 GFLOP/s). The narrow scores keep eight 8-lane sums (one head, eight keys) in
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

// ---- int8 caches on AVX2 CPUs without AVX-512 ----
// The portable narrow variant above converts every int8 row once per head (3 shifts and a
// convert per eight values, per head) and re-reads it per head group: on an AMD Zen 3 it ran
// at ~13-20 GMAC/s, a fifth of a 64-request decode step. Here each row is sign-extended and
// converted once (vpmovsxbd + vcvtdq2ps per eight values) for up to three heads, four keys at
// a time in registers, in natural element order. Picked once per process (kInt8Avx2), so a
// machine always adds in one order.
#if defined(__x86_64__)
#include <immintrin.h>
#define MET_AVX2_TARGET __attribute__((target("avx2,fma")))

inline bool int8_avx2_path() {
  __builtin_cpu_init();
  return !kWideVectors && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
const bool kInt8Avx2 = int8_avx2_path();

// The rows a task reads, in the order it first reads them: its keys, its values, then the
// next task's keys. fetch(n) asks for the line of row n of that sequence and, every eighth
// row, its scale's line. A decode step's whole cache comes from memory in blocks of a few
// rows that sit anywhere, which the hardware prefetchers cannot follow; asking kReadAhead rows
// ahead in one steady stream (rather than in bursts per task) keeps the memory busy without
// stalling on full miss buffers (Zen 3: random 1 KB blocks stream at ~20 GB/s that way; 64
// requests x 175 keys over 30 layers' caches took 0.85 ms a call without it, ~0.44 ms with it,
// 0.32 ms with one layer's cache in L3; 48-192 rows ahead measured alike).
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
#else
const bool kInt8Avx2 = false;
template <typename Q>
void attend_int8_avx2(const Problem&, const Span&, const Span*, bool, float*) {}
#endif

// The element order of an int8 task's float32 rows (queries, partial sums for merge_one).
MET_INLINE int int8_order() { return kInt8Avx2 ? kNaturalOrder : kQuadOrder; }

// An int8 cache's task on whichever path this CPU takes.
template <typename Q>
MET_INLINE void attend_int8(const Problem& p, const Span& t, const Span* next, bool cold,
                            float* ws) {
  if (kInt8Avx2) {
    attend_int8_avx2<Q>(p, t, next, cold, ws);
  } else {
    attend_fast_any<Q, int8_t>(p, t, next, ws);
  }
}

MET_CLONES void attend_range_f32(const Problem& p, int64_t begin, int64_t end, float* ws) {
  Span next = task_span(p, begin);
  for (int64_t task = begin; task < end; ++task) {
    const Span t = next;
    if (task + 1 < end) next = task_span(p, task + 1);
    const Span* ahead = task + 1 < end ? &next : nullptr;
    if (p.k_scale != nullptr) {
      attend_int8<float>(p, t, ahead, task == begin, ws);
    } else if (p.fast) {
      attend_fast_any<float, float>(p, t, ahead, ws);
    } else {
      attend_one<float, false>(p, t, ahead, ws);
    }
  }
}

MET_CLONES void attend_range_bf16(const Problem& p, int64_t begin, int64_t end, float* ws) {
  Span next = task_span(p, begin);
  for (int64_t task = begin; task < end; ++task) {
    const Span t = next;
    if (task + 1 < end) next = task_span(p, task + 1);
    const Span* ahead = task + 1 < end ? &next : nullptr;
    if (p.k_scale != nullptr) {
      attend_int8<c10::BFloat16>(p, t, ahead, task == begin, ws);
    } else if (p.fast) {
      attend_fast_any<c10::BFloat16, c10::BFloat16>(p, t, ahead, ws);
    } else if (p.pairs) {
      attend_one<c10::BFloat16, true>(p, t, ahead, ws);
    } else {
      attend_one<c10::BFloat16, false>(p, t, ahead, ws);
    }
  }
}

// merge_one for the split requests among tasks begin..end-1 (request * Hkv + kv head).
MET_CLONES void merge_range(const Problem& p, bool is_f32, int64_t begin, int64_t end,
                            float* ws) {
  for (int64_t task = begin; task < end; ++task) {
    const int64_t i = task / p.Hkv, g = task % p.Hkv;
    if (p.chunk_start[i + 1] - p.chunk_start[i] < 2) continue;
    if (p.k_scale != nullptr && int8_order() == kNaturalOrder) {
      is_f32 ? merge_one<float, kNaturalOrder>(p, i, g, ws)
             : merge_one<c10::BFloat16, kNaturalOrder>(p, i, g, ws);
    } else if (p.k_scale != nullptr) {
      is_f32 ? merge_one<float, kQuadOrder>(p, i, g, ws)
             : merge_one<c10::BFloat16, kQuadOrder>(p, i, g, ws);
    } else if (is_f32) {
      merge_one<float, kNaturalOrder>(p, i, g, ws);
    } else if (p.pairs) {
      merge_one<c10::BFloat16, kPairOrder>(p, i, g, ws);
    } else {
      merge_one<c10::BFloat16, kNaturalOrder>(p, i, g, ws);
    }
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slots_in,
                            const at::Tensor& offsets_in, double scale,
                            const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3,
              "decode_attention: q must be [N, H, D] and the caches [Hkv, S, D]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  slots_in.device().is_cpu() && offsets_in.device().is_cpu(),
              "decode_attention: CPU tensors only");
  const bool int8 = k_scale.has_value();
  TORCH_CHECK(int8 == v_scale.has_value(), "decode_attention: pass both scales or neither");
  const auto cache_type = int8 ? at::kChar : q.scalar_type();
  TORCH_CHECK(k_cache.scalar_type() == cache_type && v_cache.scalar_type() == cache_type,
              "decode_attention: the caches must have q's dtype (or be int8 with scales)");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "decode_attention: float32 or bfloat16 only, got ", q.scalar_type());
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(),
              "decode_attention: k_cache and v_cache differ in shape");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(0), S = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && D > 0, "decode_attention: head_dim of q and cache differ");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0 && H / Hkv <= 64,
              "decode_attention: H must be a multiple of Hkv, at most 64 times Hkv");
  TORCH_CHECK(slots_in.scalar_type() == at::kLong && offsets_in.scalar_type() == at::kLong,
              "decode_attention: slots and offsets must be int64");
  TORCH_CHECK(slots_in.dim() == 1 && offsets_in.dim() == 1 && offsets_in.numel() == N + 1,
              "decode_attention: slots must be 1-D and offsets [N + 1]");
  const at::Tensor slots = slots_in.contiguous();
  const at::Tensor offsets = offsets_in.contiguous();
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK(off[i] >= 0 && off[i] < off[i + 1] && off[i + 1] <= slots.numel(),
                "decode_attention: request ", i, " has an empty or out-of-range span of slots");
    max_len = std::max(max_len, off[i + 1] - off[i]);
  }
  // A bad slot would read outside the cache: check them all before any task runs.
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t j = off[i]; j < off[i + 1]; ++j) {
      TORCH_CHECK(sl[j] >= 0 && sl[j] < S, "decode_attention: slot ", sl[j],
                  " is outside the cache of ", S, " slots");
    }
  }

  at::Tensor out = at::empty({N, H, D}, q.options());
  if (N == 0 || H == 0) return out;
  const bool pairs = !int8 && q.scalar_type() == at::kBFloat16 && D % 32 == 0 &&
                     k_cache.stride(2) == 1 && v_cache.stride(2) == 1;
  const bool fast = D % 32 == 0 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1;
  if (int8) {
    TORCH_CHECK(fast && D % 64 == 0, "decode_attention: int8 caches need head_dim % 64 == 0 "
                                     "and rows of contiguous values");
    for (const at::Tensor* sc : {&*k_scale, &*v_scale}) {
      TORCH_CHECK(sc->scalar_type() == at::kFloat && sc->is_contiguous() && sc->dim() == 2 &&
                      sc->size(0) == Hkv && sc->size(1) == S,
                  "decode_attention: scales must be contiguous float32 [Hkv, S]");
    }
  }
  // Chunks of kSplit keys: one for most requests, several for long ones.
  std::vector<int64_t> chunk_start(N + 1, 0), chunk_req;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t chunks = (off[i + 1] - off[i] + kSplit - 1) / kSplit;
    chunk_start[i + 1] = chunk_start[i] + chunks;
    chunk_req.insert(chunk_req.end(), chunks, i);
  }
  const int64_t num_chunks = chunk_start[N], G = H / Hkv;
  std::vector<float> partials;
  if (num_chunks > N) partials.resize(num_chunks * Hkv * G * (padded_dim(D) + 2));
  const Problem p{q.data_ptr(),       q.stride(0),       q.stride(1),       q.stride(2),
                  k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                  v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                  out.data_ptr(),     sl,                off,               H,
                  Hkv,                D,                 static_cast<float>(scale), pairs, fast,
                  chunk_start.data(), chunk_req.data(),  partials.data(),
                  int8 ? k_scale->data_ptr<float>() : nullptr,
                  int8 ? v_scale->data_ptr<float>() : nullptr, S};
  const size_t ws_size = workspace_floats(G, padded_dim(D), std::min(max_len, kSplit));
  const bool is_f32 = q.scalar_type() == at::kFloat;

  // Cache-line aligned scratch: a 64-byte vector store that straddles two lines costs about
  // twice as much, and every tile element is stored once per key.
  auto with_scratch = [ws_size](auto&& body) {
    std::vector<float> buf(ws_size + kLanes);
    const uintptr_t misalign = reinterpret_cast<uintptr_t>(buf.data()) % 64;
    body(buf.data() + (misalign ? (64 - misalign) / sizeof(float) : 0));
  };
  // One task per (chunk, kv head). Tasks never share outputs, and a task's arithmetic does
  // not depend on which thread runs it, so the split over threads cannot change any result.
  at::parallel_for(0, num_chunks * Hkv, 1, [&](int64_t begin, int64_t end) {
    with_scratch([&](float* ws) {
      if (is_f32) {
        attend_range_f32(p, begin, end, ws);
      } else {
        attend_range_bf16(p, begin, end, ws);
      }
    });
  });
  if (num_chunks > N) {  // then the split requests' chunks are combined, in chunk order
    at::parallel_for(0, N * Hkv, 1, [&](int64_t begin, int64_t end) {
      with_scratch([&](float* ws) { merge_range(p, is_f32, begin, end, ws); });
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(MET_OP_NAMESPACE, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, "
      "Tensor offsets, float scale, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor",
      &decode_attention);
}
