// w4a8 on CPUs with AVX2 but no AVX512-VNNI (e.g. AMD Zen 2/3, Intel before Ice Lake): the
// same ops, weight layout and arithmetic as w4a8.cpp (read its header first), for x in
// bfloat16 or float32. llama.cpp runs a Q4_1 file on such CPUs the same way.
//
// VPDPBUSD's exact per-lane sums of four u8 × s8 products are built from VPMADDUBSW (pairs,
// into int16) and VPMADDWD by ones (int16 pairs into int32). 4-bit weights: a 32-value block
// sums 8 VPMADDUBSW results in int16 before widening: |sum| <= 16 · 15 · 127 = 30,480, no
// overflow, so the int32 block sums equal VPDPBUSD's. 8-bit weights (the LM head): |x| times
// w with x's sign (VPSIGNB) per quad, widened per quad (|pair| <= 2 · 127 · 128 = 32,512):
// the exact sum q_w · q_x, which w4a8.cpp gets as its offset sum minus 128 · sum q_x. The
// float steps after the sums are w4a8.cpp's, in its order, and the activations are quantized
// by its formula: a row's outputs are the AVX-512 kernel's bits, and (one kernel for any row
// count) do not depend on the batch.
//
// Register budget (16 vector registers): a tile is R rows × C eight-channel halves of the
// 16-lane blocks, each (row, half) with its int16 block sum and float accumulator, plus the
// unpacked weights and two activation broadcasts. Full four-row tiles take two halves
// (R · C = 8): the float accumulators, touched once per block, then live on the stack, and
// each activation broadcast feeds two VPMADDUBSW instead of one (faster than 4 x 1 tiles;
// the same float steps per (row, channel) in the same order, so the same bits).
// Keeping the eight accumulators in an explicit scratch array instead measured slower.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "met_cpu.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "met_w4a8_layout.h"

namespace {

constexpr int64_t kHalves = 2 * kBlocks;  // eight-channel halves per group

bool supported() { return met_cpu::avx2(); }

bool no_amx() { return false; }

#if defined(__x86_64__)
#define MET_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

struct QuantRow {
  const int8_t* q;      // [K]
  const float* s;       // [K / 32] max|x| / 127 of each block
  const float* sq;      // [K / 32] s · sum of the block's q
};

// Eight floats of x (float32 or bfloat16 widened exactly).
template <typename T>
MET_AVX2_TARGET inline __m256 load8(const T* x) {
  if constexpr (sizeof(T) == 4) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(x));
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

MET_AVX2_TARGET inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

MET_AVX2_TARGET inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// Row x (K values, K % 32 == 0) -> q and each block's s, sq: w4a8.cpp's quantize_row.
template <typename T>
MET_AVX2_TARGET void quantize_row(const T* x, int64_t K, int8_t* q, float* s, float* sq) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / kK; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = load8(x + b * kK + 8 * i);
    const __m256 mx = _mm256_max_ps(
        _mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
        _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
    const float absmax = hmax(mx);
    const float inv = absmax > 0.0f ? 127.0f / absmax : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vinv));
    const int32_t total = hsum(_mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]),
                                                _mm256_add_epi32(qi[2], qi[3])));
    // int32 -> int8 with saturation; the packs interleave 128-bit lanes, undone by `order`.
    const __m256i w16 = _mm256_packs_epi32(qi[0], qi[1]), w16b = _mm256_packs_epi32(qi[2], qi[3]);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16, w16b), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kK), bytes);
    const float scale = absmax / 127.0f;
    s[b] = scale;
    sq[b] = scale * static_cast<float>(total);
  }
}

struct Problem {
  const QuantRow* rows;
  const uint8_t* w;       // packed nibbles (4-bit) or offset bytes (8-bit), w4a8.cpp's layout
  const uint16_t* d;      // float16 [groups][blocks][4][16]
  const uint16_t* m;      // the minimums, or null (8-bit weights)
  const float* bias;      // [groups * 64] or null
  void* out;              // [M, N] bfloat16 or float32
  int64_t M, K, N;
  bool out_float;
};

// Row r's eight outputs at channel n (fewer at the end of N): + bias, stored as float32 or
// rounded to bfloat16 (nearest even, as w4a8.cpp's store_out).
MET_AVX2_TARGET inline void store8(const Problem& p, int64_t r, int64_t n, __m256 y) {
  const int64_t left = std::min<int64_t>(8, p.N - n);
  if (left <= 0) return;
  if (p.bias != nullptr) y = _mm256_add_ps(y, _mm256_loadu_ps(p.bias + n));
  if (p.out_float) {
    float* out = static_cast<float*>(p.out) + r * p.N + n;
    if (left == 8) {
      _mm256_storeu_ps(out, y);
    } else {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, y);
      std::memcpy(out, tmp, left * 4);
    }
    return;
  }
  const __m256i u = _mm256_castps_si256(y);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  // Eight 16-bit results: packus of values < 65536 is exact; lanes 0-3 and 4-7 meet in the
  // low 64 bits of each 128-bit half.
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded),
                                          _mm256_extracti128_si256(rounded, 1));
  uint16_t* out = static_cast<uint16_t*>(p.out) + r * p.N + n;
  if (left == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), packed);
  } else {
    alignas(16) uint16_t tmp[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(tmp), packed);
    std::memcpy(out, tmp, left * 2);
  }
}

// Weights stream from memory (the model's ~100 MB do not stay in cache between steps); at a
// few rows there is little arithmetic per byte to hide the latency behind. So the tile that
// starts a group's pass (channels 0.., first rows) asks for all of block b + kAhead and its
// scales while it works on block b: all units of the group then find the group in cache
// (a unit reads only half of each 256-byte row, a pattern the hardware prefetcher follows
// badly), and near a group's end the requests run on into the next group, which follows in
// memory, so a new unit does not start cold. (Past the last group they run off the buffer:
// a prefetch never faults.) With it one row runs at the memory's pace (benchmarks/
// w4a8_linear.py --layers 30 measures it).
constexpr int64_t kAhead = 4;
template <bool kQ8>
MET_AVX2_TARGET inline void prefetch_block(const uint8_t* w, const uint16_t* d,
                                           const uint16_t* m) {
  for (int64_t line = 0; line < kBlockBytes<kQ8>; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(w + line), _MM_HINT_T0);
  for (int64_t lane = 0; lane < kGroup; lane += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(d + lane), _MM_HINT_T0);
    if (m != nullptr) _mm_prefetch(reinterpret_cast<const char*>(m + lane), _MM_HINT_T0);
  }
}

// An empty asm that needs ``v`` in a register here. The block sums are chains of integer
// adds, which GCC may reorder: it built them as trees over all of a block's products,
// computed first and spilled through the stack (~48 vector moves per tile, in the inner
// loop); pinned each step, the chains stay in registers. Same sums (integer adds), same bits.
MET_AVX2_TARGET inline void keep_in_register(__m256i& v) { __asm__("" : "+x"(v)); }

// Rows m0..m0+R of halves c0..c0+C of group g (half c: channels 8 c.. of the group, block
// j = c / 2, its lanes 8 (c % 2)..).
template <int R, int C, bool kQ8>
MET_AVX2_TARGET void tile(const Problem& p, int64_t g, int64_t m0, int c0) {
  const int64_t nb = p.K / kK;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const uint8_t* wg = p.w + g * nb * kBlockBytes<kQ8>;
  const uint16_t* dg = p.d + g * nb * kGroup;
  const uint16_t* mg = kQ8 ? nullptr : p.m + g * nb * kGroup;
  // Byte offset of half c inside a 64-channel row of the layout: block j's 64 bytes, then
  // the half's 32.
  int64_t off[C];
  for (int c = 0; c < C; ++c) off[c] = ((c0 + c) / 2) * 64 + ((c0 + c) % 2) * 32;
  // The rows' pointers, read once: through p.rows each block reloaded them (a chain of three
  // loads per scale in the block tail, a large share of a four-row tile's time).
  const int8_t* xq[R];
  const float* xs[R];
  const float* xsq[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = p.rows[m0 + r].q;
    xs[r] = p.rows[m0 + r].s;
    xsq[r] = p.rows[m0 + r].sq;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w = wg + b * kBlockBytes<kQ8>;
    if (c0 == 0 && m0 == 0)
      prefetch_block<kQ8>(w + kAhead * kBlockBytes<kQ8>, dg + (b + kAhead) * kGroup,
                          kQ8 ? nullptr : mg + (b + kAhead) * kGroup);
    __m256i isum[R][C];
    if constexpr (kQ8) {
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) isum[r][c] = _mm256_setzero_si256();
      for (int quad = 0; quad < 8; ++quad) {
        __m256i wq[C];
        for (int c = 0; c < C; ++c)  // stored q + 128: flipping the top bit gives q
          wq[c] = _mm256_xor_si256(
              _mm256_loadu_si256((const __m256i*)(w + quad * kBlocks * 64 + off[c])), flip);
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          std::memcpy(&x4, xq[r] + b * kK + 4 * quad, 4);
          const __m256i x = _mm256_set1_epi32(x4), ax = _mm256_sign_epi8(x, x);
          for (int c = 0; c < C; ++c) {
            const __m256i pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wq[c], x));
            isum[r][c] = _mm256_add_epi32(isum[r][c], _mm256_madd_epi16(pairs, ones));
            keep_in_register(isum[r][c]);
          }
        }
      }
    } else {
      __m256i s16[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) s16[r][c] = _mm256_setzero_si256();
      for (int pq = 0; pq < 4; ++pq) {
        __m256i lo[C], hi[C];
        for (int c = 0; c < C; ++c) {
          const __m256i v =
              _mm256_loadu_si256((const __m256i*)(w + pq * kBlocks * 64 + off[c]));
          lo[c] = _mm256_and_si256(v, low4);
          hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
        for (int r = 0; r < R; ++r) {
          int32_t q0, q1;
          std::memcpy(&q0, xq[r] + b * kK + 8 * pq, 4);
          std::memcpy(&q1, xq[r] + b * kK + 8 * pq + 4, 4);
          const __m256i x0 = _mm256_set1_epi32(q0), x1 = _mm256_set1_epi32(q1);
          for (int c = 0; c < C; ++c) {
            s16[r][c] = _mm256_add_epi16(s16[r][c], _mm256_maddubs_epi16(lo[c], x0));
            s16[r][c] = _mm256_add_epi16(s16[r][c], _mm256_maddubs_epi16(hi[c], x1));
            keep_in_register(s16[r][c]);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) isum[r][c] = _mm256_madd_epi16(s16[r][c], ones);
    }
    for (int c = 0; c < C; ++c) {
      const int64_t lane0 = b * kGroup + ((c0 + c) / 2) * kLanes + ((c0 + c) % 2) * 8;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dg + lane0)));
      const __m256 m = kQ8 ? d : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(mg + lane0)));
      for (int r = 0; r < R; ++r) {  // w4a8.cpp's block_step, in its order
        const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(xs[r][b]));
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][c]), ds, acc[r][c]);
        if constexpr (!kQ8) acc[r][c] = _mm256_fmadd_ps(m, _mm256_set1_ps(xsq[r][b]), acc[r][c]);
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) store8(p, m0 + r, g * kGroup + (c0 + c) * 8, acc[r][c]);
}

// Rows r0..r1 of halves c0..c0+C: four rows at a time (two halves each), the rest as 3 × 1,
// 2 × 2 or 1 × 4 tiles (C == 4 only: the last rows of a block pair).
template <bool kQ8>
MET_AVX2_TARGET void rows_of_halves(const Problem& p, int64_t g, int64_t r0, int64_t r1,
                                    int c0, int C) {
  int64_t r = r0;
  for (; r + kTileRows <= r1; r += kTileRows)
    for (int c = c0; c < c0 + C; c += 2) tile<kTileRows, 2, kQ8>(p, g, r, c);
  const int64_t left = r1 - r;
  if (left == 3) {
    for (int c = c0; c < c0 + C; ++c) tile<3, 1, kQ8>(p, g, r, c);
  } else if (left == 2) {
    for (int c = c0; c < c0 + C; c += 2) tile<2, 2, kQ8>(p, g, r, c);
  } else if (left == 1) {
    for (int c = c0; c < c0 + C; c += 4) tile<1, 4, kQ8>(p, g, r, c);
  }
}

// Work units numbered group-major, as w4a8.cpp's vnni_units: from 8 rows on one four-row
// tile of a group (every channel), below that two 16-channel blocks of a group (every row).
// Units only decide which thread computes a row's channels, never how.
inline int64_t units_per_group(int64_t M) {
  return M >= 8 ? (M + kTileRows - 1) / kTileRows : 2;
}

template <bool kQ8>
MET_AVX2_TARGET void run_units(const Problem& p, int64_t u0, int64_t u1) {
  const int64_t per_group = units_per_group(p.M);
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t g = u / per_group, unit = u % per_group;
    const int halves = static_cast<int>(std::min<int64_t>(kHalves, (p.N - g * kGroup + 7) / 8));
    if (p.M >= 8) {
      const int C = halves <= 4 ? 4 : kHalves;  // a multiple of 4 for rows_of_halves' tails
      rows_of_halves<kQ8>(p, g, unit * kTileRows,
                          std::min(p.M, (unit + 1) * kTileRows), 0, C);
    } else {
      const int c0 = static_cast<int>(unit) * 4;
      if (c0 < halves) rows_of_halves<kQ8>(p, g, 0, p.M, c0, 4);
    }
  }
}
#endif

at::Tensor run(const char* op, bool q8, const at::Tensor& x, const at::Tensor& packed,
               const at::Tensor& d, const at::Tensor* m, const std::optional<at::Tensor>& bias,
               int64_t N, bool out_float, int64_t prompt_rows) {
  TORCH_CHECK(supported(), op, ": this CPU has no AVX2/FMA/F16C");
  check_args(op, q8, x, packed, d, m, bias, N, prompt_rows);
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t groups = (N + kGroup - 1) / kGroup, nb = K / kK;
  TORCH_CHECK(prompt_rows == 0, op, ": prompt rows need AMX-BF16 (w4a8.cpp)");
  at::Tensor out = at::empty({M, N}, x.options().dtype(out_float ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
#if defined(__x86_64__)
  std::vector<int8_t> q(M * K);
  std::vector<float> s(M * nb), sq(M * nb);
  std::vector<QuantRow> rows(M);
  const bool f32 = x.scalar_type() == at::kFloat;
  const void* xp = x.data_ptr();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (f32) {
        quantize_row(static_cast<const float*>(xp) + r * K, K, q.data() + r * K,
                     s.data() + r * nb, sq.data() + r * nb);
      } else {
        quantize_row(static_cast<const uint16_t*>(xp) + r * K, K, q.data() + r * K,
                     s.data() + r * nb, sq.data() + r * nb);
      }
      rows[r] = QuantRow{q.data() + r * K, s.data() + r * nb, sq.data() + r * nb};
    }
  });
  const Problem p{rows.data(), packed.data_ptr<uint8_t>(),
                  static_cast<const uint16_t*>(d.data_ptr()),
                  m == nullptr ? nullptr : static_cast<const uint16_t*>(m->data_ptr()),
                  bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data_ptr(), M, K, N,
                  out_float};
  at::parallel_for(0, groups * units_per_group(M), 1, [&](int64_t u0, int64_t u1) {
    q8 ? run_units<true>(p, u0, u1) : run_units<false>(p, u0, u1);
  });
#endif
  return out;
}

// w4a8.cpp's ops, same arguments; amx_min_rows is ignored (no tiles here).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
                  const at::Tensor& m, const std::optional<at::Tensor>& bias, int64_t N,
                  bool out_float, int64_t /*amx_min_rows*/, int64_t prompt_rows) {
  return run("w4a8", false, x, packed, d, &m, bias, N, out_float, prompt_rows);
}

at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
                     const std::optional<at::Tensor>& bias, int64_t N, bool out_float,
                     int64_t /*amx_min_rows*/) {
  return run("w4a8 (8-bit weights)", true, x, packed, d, nullptr, bias, N, out_float, 0);
}

}  // namespace

TORCH_LIBRARY(MET_OP_NAMESPACE, m) {
  m.def("supported() -> bool", &supported);
  m.def("amx_supported() -> bool", &no_amx);
  m.def("amx_bf16_supported() -> bool", &no_amx);
  m.def(kLinearSchema, &linear);
  m.def(kLinearQ8Schema, &linear_q8);
}
