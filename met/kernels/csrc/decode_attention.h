// Paged decode attention (the decode_attention op): what its files share. The kernel is one
// op with several algorithms, one file each, so that a reader finds one path in one place and
// ninja compiles them in parallel:
//   decode_attention.cpp            the op: checks, chunks and tasks, threads, which path runs,
//                                   the merge of split contexts, the op's registration
//   decode_attention_tile.cpp       any layout: rows staged through a float32 tile
//   decode_attention_blocked.cpp    contiguous rows, D % 32 == 0 (the engine's caches):
//                                   register-blocked, wide (AVX-512) and narrow variants,
//                                   float32 / bf16 / int8 (quad order) caches
//   decode_attention_int8_avx2.cpp  int8 caches on AVX2 CPUs without AVX-512
// This header holds the task's description (Problem, Span: one type for all the files, in
// namespace met_decode_attention, with the paths' entry points) and the steps every path
// shares: queries in, softmax, the output or a split context's partial sums out. Those
// helpers are always-inline code in an anonymous namespace, like met_simd.h's: each file
// compiles its own copy into its paths, so every path is still one inlined body per clone
// of its range function, with the arithmetic (and summation order) it had in one file.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "met_simd.h"

namespace met_decode_attention {

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

// The paths' entry points: tasks begin..end-1 (task = chunk * Hkv + kv head, see task_span)
// of one call, in order, on one thread; ws is the thread's scratch (workspace_floats in
// decode_attention.cpp). _f32 / _bf16: the queries' (and output's) dtype. Each is a
// MET_CLONES function: one clone per ISA level, the loader picks this CPU's.
// decode_attention_tile.cpp: any layout (attend_one).
void attend_range_tile_f32(const Problem& p, int64_t begin, int64_t end, float* ws);
void attend_range_tile_bf16(const Problem& p, int64_t begin, int64_t end, float* ws);
// decode_attention_blocked.cpp: p.fast, a cache of the queries' dtype or int8 (attend_fast).
void attend_range_blocked_f32(const Problem& p, int64_t begin, int64_t end, float* ws);
void attend_range_blocked_bf16(const Problem& p, int64_t begin, int64_t end, float* ws);
// decode_attention_int8_avx2.cpp: int8 caches where kInt8Avx2 (attend_int8_avx2).
void attend_range_int8_avx2_f32(const Problem& p, int64_t begin, int64_t end, float* ws);
void attend_range_int8_avx2_bf16(const Problem& p, int64_t begin, int64_t end, float* ws);

// Whether int8 caches take the AVX2 path (decode_attention_int8_avx2.cpp) rather than the
// register-blocked one: decided once per process, so a machine always adds in one order.
extern const bool kInt8Avx2;

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

// Head dim rounded up to whole vectors; rows are zero-padded to it.
MET_INLINE int64_t padded_dim(int64_t D) { return (D + kLanes - 1) / kLanes * kLanes; }

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

// The task loop of every path: tasks begin..end-1 in order, each attended by
// ``attend(span, next span or nullptr, task)`` (the next one's rows are prefetched). The
// callback must be an always-inline lambda so it compiles with its clone's target.
template <typename F>
MET_INLINE void for_each_task(const Problem& p, int64_t begin, int64_t end, F&& attend) {
  Span next = task_span(p, begin);
  for (int64_t task = begin; task < end; ++task) {
    const Span t = next;
    if (task + 1 < end) next = task_span(p, task + 1);
    attend(t, task + 1 < end ? &next : nullptr, task);
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

}  // namespace
}  // namespace met_decode_attention
