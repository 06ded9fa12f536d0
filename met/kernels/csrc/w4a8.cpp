// 4-bit weights (GGUF Q4_1 layout: 32-weight blocks, w = d * q + m, q in 0..15) times 8-bit
// activations (each row's 32-value blocks quantized with their own scale), on CPUs with
// AVX512-VNNI: the arithmetic llama.cpp runs a Q4_1 file with (met/layers/w4a8.py).
//
// Row r, output n: y = sum_b (float(sum_{k in b} q_w[n,k] q_x[r,k]) * d[n,b] * s_x[r,b]
//                             + m[n,b] * (s_x[r,b] * sum_{k in b} q_x[r,k])).
// One kernel serves every number of rows (tiles of four rows share each unpacked weight
// block), and each row's float operations run in the same order in any tile, so a row's
// output is bitwise the same whatever batch it ran in.
//
// Layout: channels in groups of 64 (four 16-channel blocks j), K in 32-value blocks b, each
// block in four pairs p of quads: packed[g][b][p][j][lane][4] is one byte per lane and
// k-offset i holding q(k = 32 b + 8 p + i) in its low nibble and q(k + 4) in its high one.
// VPDPBUSD multiplies the unsigned nibbles by the signed activation bytes. d and m are
// float16 [g][b][j][16].
//
// From amx_min_rows rows on (chosen by the caller) and with AMX-INT8, TDPBSUD computes the
// same integer block sums sixteen rows × sixteen channels at a time (exact, so equal to
// VPDPBUSD's), and the float steps after them are the same operations in the same order:
// the two paths give the same bits, and a row's output still does not depend on its batch.
//
// linear_q8: the same kernels for 8-bit weights in 32-value blocks, w = d * q (GGUF Q8_0's
// form; w4a8's LM head): y = sum_b float(sum_{k in b} q_w q_x) * d[n,b] * s_x[r,b]. The
// weights are stored plus 128 (VPDPBUSD's unsigned operand) and 128 * sum q_x is taken off
// each block's integer sum, so it stays exact. Layout packed[g][b][quad][j][lane][4]: byte i
// of a lane is q(k = 32 b + 4 quad + i) + 128.
//
// Prompt rows (linear's prompt_rows: the first rows of x, which the caller orders first):
// with AMX-BF16, those rows are not quantized; they multiply the weights dequantized to
// bfloat16 (w = d q + m in float32, one fused multiply-add, rounded to nearest even) on
// TDPBF16PS tiles, in float32, over the blocks in order. Half the 4-bit path's time at many
// rows (its per-block float steps are gone), and a row's output is still a function of that
// row alone: the same tiles run for any number of prompt rows.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "met_vnni.h"
#include "met_w4a8_layout.h"

namespace {

constexpr int64_t kStreamOutBytes = int64_t{4} << 20;  // float32 outputs past this stream out

bool supported() { return vnni_supported(); }

// AMX-INT8 tiles usable by this process; AMX-BF16 and AVX512-BF16 as well (the prompt
// rows' tiles and their bfloat16 stores).
bool amx_supported() { return met_cpu::amx_int8(); }
bool amx_bf16_supported() { return met_cpu::amx_bf16(); }

#if defined(__x86_64__)

// One row's activations, quantized per 32-value block.
struct QuantRow {
  const int8_t* q;       // [K]
  const float* s;        // [K / 32] scale max|x| / 127 of each block
  const float* sq;       // [K / 32] s * sum of the block's q (the minimum's factor)
  const int32_t* qsum;   // [K / 32] 128 · sum of the block's q (the 8-bit weights' offset)
};

// Sixteen values of x: float32, or bfloat16 widened exactly.
template <typename T>
MET_VNNI_TARGET inline __m512 load16(const T* x) {
  if constexpr (sizeof(T) == 4) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(x));
  } else {
    return widen_bf16(x);
  }
}

// Row x (bfloat16 or float32, K values, K % 32 == 0) -> q, and block b's s, sq, qsum at
// [b * stride].
template <typename T>
MET_VNNI_TARGET void quantize_row(const T* x, int64_t K, int8_t* q, float* s,
                                  float* sq, int32_t* qsum, int64_t stride) {
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < K / kK; ++b) {
    const __m512 v0 = load16(x + b * kK), v1 = load16(x + b * kK + 16);
    const float absmax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_and_ps(v0, abs_mask), _mm512_and_ps(v1, abs_mask)));
    const float inv = absmax > 0.0f ? 127.0f / absmax : 0.0f;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vinv));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vinv));
    _mm512_mask_cvtsepi32_storeu_epi8(q + b * kK, 0xFFFF, q0);
    _mm512_mask_cvtsepi32_storeu_epi8(q + b * kK + 16, 0xFFFF, q1);
    const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));  // exact
    const float scale = absmax / 127.0f;
    s[b * stride] = scale;
    sq[b * stride] = scale * static_cast<float>(total);
    qsum[b * stride] = 128 * total;
  }
}

struct Problem {
  const QuantRow* rows;   // the VNNI path's rows (empty when the tiles run)
  const uint8_t* w;       // packed nibbles (4-bit weights) or offset bytes (8-bit weights)
  const uint16_t* d;      // float16 [groups][blocks][4][16]
  const uint16_t* m;      // the same for the minimums; null for 8-bit weights
  const float* bias;      // [groups * 64] or null
  void* out;              // [M, N] bfloat16 or float32
  int64_t M, K, N;
  bool out_float;
  // float32 output larger than L2 (the LM head's logits at many rows): streaming stores
  // bypass the caches, where a plain store would first read each line in.
  bool stream_out;
  // AMX: each 16-row tile's row scales side by side, [tile][block][16 rows] (zero for
  // padding rows): one broadcast load per row and block instead of two through QuantRow.
  const float* tile_s;
  const float* tile_sq;
  const int32_t* tile_qsum;
};

MET_VNNI_TARGET inline void store16(const Problem& p, int64_t r, int64_t n, __m512 y) {
  if (p.bias != nullptr) y = _mm512_add_ps(y, _mm512_loadu_ps(p.bias + n));
  char* out = static_cast<char*>(p.out) + (r * p.N + n) * (p.out_float ? 4 : 2);
  if (p.stream_out && p.N - n >= kLanes && (reinterpret_cast<uintptr_t>(out) & 63) == 0) {
    _mm512_stream_ps(reinterpret_cast<float*>(out), y);
    return;
  }
  store_out(out, y, p.out_float, tail_mask(p.N - n));
}

// The float steps after a block's integer sums isum (row r, channels j), the same in both
// kernels below. 4-bit: acc += isum · (d s) + m · sq. 8-bit weights are stored plus 128
// (VPDPBUSD wants them unsigned): isum - 128 · qsum is the exact sum, acc += it · (d s).
template <bool kQ8>
MET_VNNI_TARGET inline __m512 block_step(__m512 acc, __m512i isum, __m512 d, __m512 m, float s,
                                         float sq, int32_t qsum) {
  const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(s));
  if constexpr (kQ8) {
    isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(qsum));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), ds, acc);
  } else {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), ds, acc);
    return _mm512_fmadd_ps(m, _mm512_set1_ps(sq), acc);
  }
}

template <bool kQ8>
MET_VNNI_TARGET inline __m512 block_step(__m512 acc, __m512i isum, __m512 d, __m512 m,
                                         const QuantRow& row, int64_t b) {
  return block_step<kQ8>(acc, isum, d, m, row.s[b], row.sq[b], row.qsum[b]);
}

// Rows m0..m0+R of blocks j0..j0+JB of channel group g.
template <int R, bool kQ8, int JB = kBlocks>
MET_VNNI_TARGET void tile(const Problem& p, int64_t g, int64_t m0, int j0 = 0) {
  const int64_t nb = p.K / kK;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R][JB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < JB; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint8_t* w = p.w + g * nb * kBlockBytes<kQ8> + j0 * 64;
  const uint16_t* dp = p.d + g * nb * kGroup + j0 * kLanes;
  const uint16_t* mp = kQ8 ? nullptr : p.m + g * nb * kGroup + j0 * kLanes;
  for (int64_t b = 0; b < nb; ++b, w += kBlockBytes<kQ8>, dp += kGroup) {
    __m512i isum[R][JB];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < JB; ++j) isum[r][j] = _mm512_setzero_si512();
    for (int pq = 0; pq < 4; ++pq) {
      __m512i lo[JB], hi[JB];
      for (int j = 0; j < JB; ++j) {
        if constexpr (kQ8) {  // quads 2 pq and 2 pq + 1
          lo[j] = _mm512_loadu_si512(w + (2 * pq * kBlocks + j) * 64);
          hi[j] = _mm512_loadu_si512(w + ((2 * pq + 1) * kBlocks + j) * 64);
        } else {
          const __m512i v = _mm512_loadu_si512(w + (pq * kBlocks + j) * 64);
          lo[j] = _mm512_and_si512(v, low4);
          hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
      }
      for (int r = 0; r < R; ++r) {
        int32_t q0, q1;
        std::memcpy(&q0, p.rows[m0 + r].q + b * kK + 8 * pq, 4);
        std::memcpy(&q1, p.rows[m0 + r].q + b * kK + 8 * pq + 4, 4);
        const __m512i x0 = _mm512_set1_epi32(q0), x1 = _mm512_set1_epi32(q1);
        for (int j = 0; j < JB; ++j) {
          isum[r][j] = _mm512_dpbusd_epi32(isum[r][j], lo[j], x0);
          isum[r][j] = _mm512_dpbusd_epi32(isum[r][j], hi[j], x1);
        }
      }
    }
    for (int j = 0; j < JB; ++j) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dp + j * kLanes)));
      const __m512 m = kQ8 ? d : _mm512_cvtph_ps(_mm256_loadu_si256(
                                     (const __m256i*)(mp + b * kGroup + j * kLanes)));
      for (int r = 0; r < R; ++r)
        acc[r][j] = block_step<kQ8>(acc[r][j], isum[r][j], d, m, p.rows[m0 + r], b);
    }
  }
  for (int j = 0; j < JB; ++j) {
    const int64_t n = g * kGroup + (j0 + j) * kLanes;
    if (n >= p.N) break;
    for (int r = 0; r < R; ++r) store16(p, m0 + r, n, acc[r][j]);
  }
}

// Rows r0..r1 of blocks j0..j0+JB of group g (r1 - r0 a multiple of four unless r1 == M).
template <bool kQ8, int JB>
MET_VNNI_TARGET void rows_of_blocks(const Problem& p, int64_t g, int64_t r0, int64_t r1,
                                    int j0) {
  int64_t r = r0;
  for (; r + kTileRows <= r1; r += kTileRows) tile<kTileRows, kQ8, JB>(p, g, r, j0);
  switch (r1 - r) {
    case 1: tile<1, kQ8, JB>(p, g, r, j0); break;
    case 2: tile<2, kQ8, JB>(p, g, r, j0); break;
    case 3: tile<3, kQ8, JB>(p, g, r, j0); break;
    default: break;
  }
}

// Every row of blocks j0..j1 of group g.
template <bool kQ8>
MET_VNNI_TARGET void blocks_all_rows(const Problem& p, int64_t g, int j0, int j1) {
  switch (j1 - j0) {
    case 1: rows_of_blocks<kQ8, 1>(p, g, 0, p.M, j0); break;
    case 2: rows_of_blocks<kQ8, 2>(p, g, 0, p.M, j0); break;
    case 3: rows_of_blocks<kQ8, 3>(p, g, 0, p.M, j0); break;
    case 4: rows_of_blocks<kQ8, 4>(p, g, 0, p.M, j0); break;
    default: break;
  }
}

// The VNNI path's work as units numbered group-major: from 8 rows on a unit is one four-row
// tile of a group (every block), below that one 16-channel block of a group (every row). A
// task runs units u0..u1, so threads get equal shares where whole groups would not split
// evenly (a 576-wide projection's 9 groups went 5 + 4 on two threads). The units only decide
// which thread computes a row's channels, never how: a row's outputs stay the same bits.
MET_VNNI_TARGET inline int64_t units_per_group(int64_t M) {
  return M >= 8 ? (M + kTileRows - 1) / kTileRows : kBlocks;
}

template <bool kQ8>
MET_VNNI_TARGET void vnni_units(const Problem& p, int64_t u0, int64_t u1) {
  const int64_t per_group = units_per_group(p.M);
  for (int64_t u = u0; u < u1;) {
    const int64_t g = u / per_group, first = u % per_group;
    const int64_t last = std::min(per_group, first + (u1 - u));  // this group's units: [first, last)
    u += last - first;
    if (p.M >= 8) {
      // Two 16-channel blocks per pass for 4-bit weights: a tile's accumulators, integer
      // sums and unpacked weights then fit in the 32 vector registers (faster than four
      // blocks from 8 rows on, the same bits). 8-bit weights (no unpacking to
      // share), and fewer rows (below), take all four blocks in one pass.
      const int64_t r0 = first * kTileRows, r1 = std::min(p.M, last * kTileRows);
      constexpr int kPass = kQ8 ? kBlocks : 2;
      for (int j0 = 0; j0 < kBlocks && g * kGroup + j0 * kLanes < p.N; j0 += kPass)
        rows_of_blocks<kQ8, kPass>(p, g, r0, r1, j0);
    } else {
      const int64_t valid = std::min<int64_t>(kBlocks, (p.N - g * kGroup + kLanes - 1) / kLanes);
      if (first < valid) blocks_all_rows<kQ8>(p, g, first, std::min(last, valid));
    }
  }
}

// ---- AMX: sixteen rows at a time -------------------------------------------------------
#define MET_AMX_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,amx-tile,amx-int8")))

constexpr int kAmxRows = 16;

// Tiles 0 and 1: int32 block sums C [16 rows × 16 channels] of alternate blocks; tiles 2 and
// 4: A, 16 rows × one 32-value block of activations; tiles 3 and 5: B, the block's 16
// channels as 8 rows of 4-value quads.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 32, 64, 32, 64};
  uint8_t rows[16] = {16, 16, 16, 8, 16, 8};
};

// Group g's weights as B tiles: unpacked[(b * 4 + j) * 8 + kk] = the 64 bytes (16 channels ×
// 4 values, low nibbles of pair kk / 2 for even kk, high ones for odd) of block b, channels j.
MET_AMX_TARGET void unpack_group(const Problem& p, int64_t g, __m512i* unpacked) {
  const int64_t nb = p.K / kK;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* w = p.w + g * nb * kBlockBytes<false>;
  for (int64_t b = 0; b < nb; ++b)
    for (int pq = 0; pq < 4; ++pq)
      for (int j = 0; j < kBlocks; ++j) {
        const __m512i v = _mm512_loadu_si512(w + ((b * 4 + pq) * kBlocks + j) * 64);
        __m512i* dst = unpacked + (b * kBlocks + j) * 8 + 2 * pq;
        dst[0] = _mm512_and_si512(v, low4);
        dst[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
}

// Block b's sums of rows m0..m0+16 (q padded with zero rows past M), channels j, into tile
// `C` and then `sums`; the caller's b_tile(b) / b_stride say where block b's B tile is.
#define MET_AMX_BLOCK_SUMS(C, A, B, b, sums)             \
  do {                                                  \
    _tile_loadd(A, q + m0 * p.K + (b) * kK, p.K);       \
    _tile_loadd(B, b_tile(b), b_stride);                \
    _tile_zero(C);                                      \
    _tile_dpbsud(C, A, B);                              \
    _tile_stored(C, sums, 64);                          \
  } while (0)

constexpr int kFloatRows = 8;

// The float steps of tile() above for 8-bit weights, in its order, for R rows (batch rows
// m..m+R, tile rows t..t+R) of channels n..n+16 on the block sums in `sums` (nb tiles of
// 16 × 16 int32): R independent accumulator chains share each block's d.
template <int R>
MET_AMX_TARGET inline void amx_float_steps_q8(const Problem& p, const int32_t* sums,
                                              const uint16_t* dp, int64_t m, int t, int64_t n) {
  const int64_t nb = p.K / kK;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t at = (m / kAmxRows) * nb * kAmxRows + t;
  const float* ts = p.tile_s + at;
  const int32_t* tq = p.tile_qsum + at;
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dp + b * kGroup)));
    const int32_t* tile_sums = sums + (b * kAmxRows + t) * kLanes;
    for (int r = 0; r < R; ++r) {
      const __m512i isum = _mm512_load_si512(tile_sums + r * kLanes);
      acc[r] = block_step<true>(acc[r], isum, d, d, ts[b * kAmxRows + r], 0.0f,
                                tq[b * kAmxRows + r]);
    }
  }
  for (int r = 0; r < R; ++r) store16(p, m + r, n, acc[r]);
}

// The same for 8-bit weights (the LM head), in two passes: first every block's sums (the
// tile unit streams loads, dot products and stores back to back into `sums`, nb × 16 × 16
// int32), then the float steps, eight rows at a time over the blocks in order. For the head
// (weights read from memory) this beats interleaving; for the 4-bit layers (weights unpacked
// into L1, sums up to 48 KB at K = 1536) it was slower.
MET_AMX_TARGET void amx_tile_two_pass(const Problem& p, const int8_t* q, int64_t g, int j,
                                      int64_t m0, int32_t* sums) {
  const int64_t nb = p.K / kK;
  // 8-bit weights are read in place: their quads are the tile's rows, 4 × 64 bytes apart.
  const auto b_tile = [&](int64_t b) {
    return p.w + g * nb * kBlockBytes<true> + (b * 8 * kBlocks + j) * 64;
  };
  constexpr int64_t b_stride = kBlocks * 64;
  const uint16_t* dp = p.d + g * nb * kGroup + j * kLanes;
  const int valid = static_cast<int>(std::min<int64_t>(kAmxRows, p.M - m0));
  constexpr int kTileInts = kAmxRows * kLanes;
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {
    MET_AMX_BLOCK_SUMS(0, 2, 3, b, sums + b * kTileInts);
    MET_AMX_BLOCK_SUMS(1, 4, 5, b + 1, sums + (b + 1) * kTileInts);
  }
  if (b < nb) MET_AMX_BLOCK_SUMS(0, 2, 3, b, sums + b * kTileInts);
  const int64_t n = g * kGroup + j * kLanes;
  int r0 = 0;
  for (; r0 + kFloatRows <= valid; r0 += kFloatRows) {
    amx_float_steps_q8<kFloatRows>(p, sums, dp, m0 + r0, r0, n);
  }
  for (; r0 < valid; ++r0) amx_float_steps_q8<1>(p, sums, dp, m0 + r0, r0, n);  // last tile
}
// Rows m0..m0+16 of channels j of group g (4-bit weights): the float steps of tile() above,
// in its order, on TDPBSUD's block sums, each block's sums issued a block ahead of the float
// steps that read them. All 16 rows run (padding rows: zero activations and scales), so the
// sixteen accumulators are named registers (GCC keeps an array of them on the stack and
// reloads it every block) and each row's scales are one broadcast load from the tile's
// [block][16] arrays (Problem::tile_s), so no step waits on a reload.
MET_AMX_TARGET void amx_tile_interleaved(const Problem& p, const int8_t* q, int64_t g, int j,
                                         int64_t m0, const __m512i* unpacked) {
  const int64_t nb = p.K / kK;
  const uint16_t* dp = p.d + g * nb * kGroup + j * kLanes;
  const uint16_t* mp = p.m + g * nb * kGroup + j * kLanes;
  const float* ts = p.tile_s + (m0 / kAmxRows) * nb * kAmxRows;
  const float* tsq = p.tile_sq + (m0 / kAmxRows) * nb * kAmxRows;
  const auto b_tile = [&](int64_t b) { return unpacked + (b * kBlocks + j) * 8; };
  constexpr int64_t b_stride = 64;
  alignas(64) int32_t sums[2][kAmxRows * kLanes];
#define MET_ROWS16(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) \
  X(13) X(14) X(15)
#define MET_ACC_DECLARE(r) __m512 acc##r = _mm512_setzero_ps();
  MET_ROWS16(MET_ACC_DECLARE)
  MET_AMX_BLOCK_SUMS(0, 2, 3, 0, sums[0]);
  for (int64_t b = 0; b < nb; ++b) {
    if (b + 1 < nb) {
      if (b % 2 == 0) {
        MET_AMX_BLOCK_SUMS(1, 4, 5, b + 1, sums[1]);
      } else {
        MET_AMX_BLOCK_SUMS(0, 2, 3, b + 1, sums[0]);
      }
    }
    const int32_t* block_sums = sums[b % 2];
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dp + b * kGroup)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(mp + b * kGroup)));
    const float* s = ts + b * kAmxRows;
    const float* sq = tsq + b * kAmxRows;
#define MET_ACC_STEP(r)                                                                    \
  acc##r = block_step<false>(acc##r, _mm512_load_si512(block_sums + (r) * kLanes), d, m, s[r], \
                             sq[r], 0);
    MET_ROWS16(MET_ACC_STEP)
  }
#define MET_ACC_LIST(r) acc##r,
  const __m512 acc[kAmxRows] = {MET_ROWS16(MET_ACC_LIST)};
#undef MET_ACC_LIST
#undef MET_ACC_STEP
#undef MET_ACC_DECLARE
#undef MET_ROWS16
  const int64_t n = g * kGroup + j * kLanes;
  const int valid = static_cast<int>(std::min<int64_t>(kAmxRows, p.M - m0));
  for (int r = 0; r < valid; ++r) store16(p, m0 + r, n, acc[r]);
}
#undef MET_AMX_BLOCK_SUMS

// Every row of groups g0..g1 (this thread's) through the tiles.
template <bool kQ8>
MET_AMX_TARGET void amx_groups(const Problem& p, const int8_t* q, int64_t g0, int64_t g1) {
  const TileConfig config;
  _tile_loadconfig(&config);
  const int64_t nb = p.K / kK;
  // Scratch: 4-bit weights unpacked into B tiles, or the 8-bit path's block sums.
  // std::vector<__m512i> would not promise 64-byte alignment here: align by hand.
  std::vector<uint8_t> storage((kQ8 ? nb * kAmxRows * kLanes * 4 : nb * kBlocks * 8 * 64) + 64);
  const uintptr_t scratch =
      (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~static_cast<uintptr_t>(63);
  auto* unpacked = reinterpret_cast<__m512i*>(scratch);
  auto* sums = reinterpret_cast<int32_t*>(scratch);
  for (int64_t g = g0; g < g1; ++g) {
    if (!kQ8) unpack_group(p, g, unpacked);
    if (kQ8 && g + 1 < g1) {
      // The tile loads read 8-bit weights in place and stall on memory: ask for the next
      // group's bytes while this one is computed.
      const char* next = reinterpret_cast<const char*>(p.w + (g + 1) * nb * kBlockBytes<true>);
      for (int64_t off = 0; off < nb * kBlockBytes<true>; off += 64)
        _mm_prefetch(next + off, _MM_HINT_T1);
    }
    for (int64_t m0 = 0; m0 < p.M; m0 += kAmxRows)
      for (int j = 0; j < kBlocks && g * kGroup + j * kLanes < p.N; ++j)
        if constexpr (kQ8) {
          amx_tile_two_pass(p, q, g, j, m0, sums);
        } else {
          amx_tile_interleaved(p, q, g, j, m0, unpacked);
        }
  }
  _tile_release();
}

// ---- Prompt rows: bfloat16 activations × the weights dequantized to bfloat16 (AMX-BF16) ---
#define MET_AMX_BF16_TARGET                                                                 \
  __attribute__((target(                                                                    \
      "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512bf16,amx-tile,amx-bf16")))

// Group g's 4-bit weights as bfloat16 B tiles: dq[((b * 4 + j) * 16 + kk) * 16 + lane] holds
// channel (j, lane)'s pair w(k), w(k + 1) at k = 32 b + 2 kk (low half, high half), w = d q + m
// rounded to nearest even.
// A packed lane's byte i of pair-quad pq holds q(8 pq + i) (low nibble) and q(8 pq + 4 + i).
MET_AMX_BF16_TARGET void dequant_group(const Problem& p, int64_t g, uint32_t* dq) {
  const int64_t nb = p.K / kK;
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  // cvtne2ps_pbh(wo, we) holds we in bfloat16 lanes 0-15 and wo in 16-31: lane 2 i takes
  // we[i], lane 2 i + 1 wo[i].
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                         1, 16, 0);
  const uint8_t* w = p.w + g * nb * kBlockBytes<false>;
  const uint16_t* dp = p.d + g * nb * kGroup;
  const uint16_t* mp = p.m + g * nb * kGroup;
  for (int64_t b = 0; b < nb; ++b)
    for (int j = 0; j < kBlocks; ++j) {
      const __m512 d = _mm512_cvtph_ps(
          _mm256_loadu_si256((const __m256i*)(dp + b * kGroup + j * kLanes)));
      const __m512 m = _mm512_cvtph_ps(
          _mm256_loadu_si256((const __m256i*)(mp + b * kGroup + j * kLanes)));
      uint32_t* dst = dq + (b * kBlocks + j) * 16 * kLanes;
      for (int pq = 0; pq < 4; ++pq) {
        const __m512i v = _mm512_loadu_si512(w + ((b * 4 + pq) * kBlocks + j) * 64);
        // k = 8 pq + 4 half + 2 pair (+ 1): bytes 2 pair and 2 pair + 1, nibble `half`.
        for (int half = 0; half < 2; ++half)
          for (int pair = 0; pair < 2; ++pair) {
            const int shift = 16 * pair + 4 * half;
            const __m512i qe = _mm512_and_si512(_mm512_srli_epi32(v, shift), low4);
            const __m512i qo = _mm512_and_si512(_mm512_srli_epi32(v, shift + 8), low4);
            const __m512 we = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qe), d, m);
            const __m512 wo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qo), d, m);
            const int kk = 4 * pq + 2 * half + pair;
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(wo, we);
            _mm512_store_si512(dst + kk * kLanes, _mm512_permutexvar_epi16(pairs, both));
          }
      }
    }
}

// Tiles 0-3: C, float32 [16 rows × 16 channels] for rows (tile a) × channels (tile b) of a
// 32 × 32 block; tiles 4, 5: A, 16 rows × 32 bfloat16 activations; tiles 6, 7: B, 16 pairs
// of rows × 16 channels.
struct alignas(64) Bf16TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Rows m0..m0+32 (activations `a`, rows K apart) × group g's 64 channels (its dequantized
// weights gq), in two halves of 32 channels: every block in order into the four C tiles.
MET_AMX_BF16_TARGET inline void bf16_rows32(const Problem& p, const uint16_t* a,
                                            const uint32_t* gq, int64_t g, int64_t m0) {
  const int64_t nb = p.K / kK, K = p.K;
  alignas(64) float c[4][kLanes * kLanes];
  for (int jp = 0; jp < kBlocks; jp += 2) {
    if (g * kGroup + jp * kLanes >= p.N) break;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = 0; b < nb; ++b) {
      _tile_loadd(4, a + b * kK, K * 2);
      _tile_loadd(5, a + 16 * K + b * kK, K * 2);
      _tile_loadd(6, gq + (b * kBlocks + jp) * 16 * kLanes, 64);
      _tile_loadd(7, gq + (b * kBlocks + jp + 1) * 16 * kLanes, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
    const int64_t n = g * kGroup + jp * kLanes;
    for (int half = 0; half < 2; ++half) {  // rows 16 half on: tiles 2 half (j = jp), + 1
      const int64_t r0 = m0 + 16 * half;
      const int valid = static_cast<int>(std::clamp<int64_t>(p.M - r0, 0, 16));
      const float* lo = c[2 * half];
      const float* hi = c[2 * half + 1];
      if (!p.out_float && p.N - n >= 2 * kLanes) {
        // A row's 32 channels as one 64-byte store, both halves rounded by one instruction.
        const __m512 b0 = p.bias ? _mm512_loadu_ps(p.bias + n) : _mm512_setzero_ps();
        const __m512 b1 = p.bias ? _mm512_loadu_ps(p.bias + n + kLanes) : _mm512_setzero_ps();
        auto* out = static_cast<uint16_t*>(p.out) + r0 * p.N + n;
        for (int r = 0; r < valid; ++r) {
          const __m512 y0 = _mm512_add_ps(_mm512_load_ps(lo + r * kLanes), b0);
          const __m512 y1 = _mm512_add_ps(_mm512_load_ps(hi + r * kLanes), b1);
          _mm512_storeu_si512(out + r * p.N, (__m512i)_mm512_cvtne2ps_pbh(y1, y0));
        }
        continue;
      }
      for (int r = 0; r < valid; ++r) {
        store16(p, r0 + r, n, _mm512_load_ps(lo + r * kLanes));
        if (n + kLanes < p.N) store16(p, r0 + r, n + kLanes, _mm512_load_ps(hi + r * kLanes));
      }
    }
  }
}

// Prompt rows 0..p.M of groups g0..g1 (x bfloat16 [p.M, p.K], row-major; `tail`: its rows
// past the last multiple of 32, zero-padded to 32, since a tile load reads 16 whole rows).
// Groups are dequantized a batch at a time (up to 1 MB of bfloat16 weights); each chunk of
// rows then runs over the batch's groups while its activations stay in L2.
MET_AMX_BF16_TARGET void amx_bf16_groups(const Problem& p, const uint16_t* x,
                                         const uint16_t* tail, int64_t g0, int64_t g1) {
  const Bf16TileConfig config;
  _tile_loadconfig(&config);
  const int64_t nb = p.K / kK, K = p.K;
  const int64_t group_words = nb * kBlocks * 16 * kLanes;  // uint32 pairs per group
  const int64_t batch = std::max<int64_t>(1, (int64_t{1} << 20) / (group_words * 4));
  // Kept per thread between calls: a fresh allocation this size would be page-faulted in
  // (and zeroed) on every call.
  thread_local std::vector<uint8_t> storage;
  storage.resize(std::max<size_t>(storage.size(),
                                  std::min(batch, g1 - g0) * group_words * 4 + 64));
  auto* dq = reinterpret_cast<uint32_t*>(
      (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~static_cast<uintptr_t>(63));
  const int64_t full = p.M / 32 * 32;
  // ~512 KB of activations per chunk: smaller chunks reread the weights more often, larger
  // ones fall out of L2 (benchmarks/w4a8_linear.py measures the trade).
  const int64_t chunk_rows = std::max<int64_t>(32, (int64_t{512} << 10) / (K * 2) / 32 * 32);
  for (int64_t b0 = g0; b0 < g1; b0 += batch) {
    const int64_t b1 = std::min(g1, b0 + batch);
    for (int64_t g = b0; g < b1; ++g) dequant_group(p, g, dq + (g - b0) * group_words);
    for (int64_t c0 = 0; c0 < p.M; c0 += chunk_rows)
      for (int64_t g = b0; g < b1; ++g)
        for (int64_t m0 = c0; m0 < std::min(p.M, c0 + chunk_rows); m0 += 32)
          bf16_rows32(p, m0 < full ? x + m0 * K : tail, dq + (g - b0) * group_words, g, m0);
  }
  _tile_release();
}
#endif

// Shared by the two ops below: checks, quantizes x's rows, runs the kernel for the weights.
at::Tensor run(const char* op, bool q8, const at::Tensor& x, const at::Tensor& packed,
               const at::Tensor& d, const at::Tensor* m, const std::optional<at::Tensor>& bias,
               int64_t N, bool out_float, int64_t amx_min_rows, int64_t prompt_rows) {
  TORCH_CHECK(supported(), op, ": this CPU has no AVX512-VNNI");
  check_args(op, q8, x, packed, d, m, bias, N, prompt_rows);
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t groups = (N + kGroup - 1) / kGroup, nb = K / kK;
  TORCH_CHECK(prompt_rows == 0 || (!q8 && amx_bf16_supported() &&
                                    x.scalar_type() == at::kBFloat16),
              op, ": prompt rows need 4-bit weights, bfloat16 rows and AMX-BF16");
  at::Tensor out = at::empty({M, N}, x.options().dtype(out_float ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
#if defined(__x86_64__)
  // Rows [0, P) through the bfloat16 tiles (`prompt`); the R rows after them quantized (`p`).
  const int64_t P = prompt_rows, R = M - P;
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  char* out_all = static_cast<char*>(out.data_ptr());
  Problem prompt{nullptr, packed.data_ptr<uint8_t>(), static_cast<const uint16_t*>(d.data_ptr()),
                 m == nullptr ? nullptr : static_cast<const uint16_t*>(m->data_ptr()),
                 bias.has_value() ? bias->data_ptr<float>() : nullptr, out_all, P, K, N,
                 out_float, false, nullptr, nullptr, nullptr};
  // The prompt rows past the last multiple of 32, zero-padded to 32 rows.
  const int64_t full = P / 32 * 32;
  std::vector<uint16_t> tail(P > full ? 32 * K : 0, 0);
  if (!tail.empty()) std::memcpy(tail.data(), xp + full * K, (P - full) * K * 2);
  const bool amx = R >= amx_min_rows && amx_supported();
  // The AMX tiles read 16 rows at a time: zero rows pad q to a multiple of 16.
  std::vector<int8_t> q((amx ? (R + kAmxRows - 1) / kAmxRows * kAmxRows : R) * K, 0);
  // Block scales per row: [row][block] for the VNNI path (read through QuantRow), or the
  // tiles' [tile][block][16 rows] (Problem::tile_s), quantize_row writing either directly.
  const int64_t padded_rows = static_cast<int64_t>(q.size()) / K;
  std::vector<float> s(padded_rows * nb, 0.0f), sq(s.size(), 0.0f);
  std::vector<int32_t> qsum(s.size(), 0);
  std::vector<QuantRow> rows(amx ? 0 : R);
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t o = amx ? (r / kAmxRows) * nb * kAmxRows + r % kAmxRows : r * nb;
      if (x.scalar_type() == at::kFloat) {
        quantize_row(x.data_ptr<float>() + r * K, K, q.data() + r * K, s.data() + o,
                     sq.data() + o, qsum.data() + o, amx ? kAmxRows : 1);
      } else {
        quantize_row(xp + (P + r) * K, K, q.data() + r * K, s.data() + o, sq.data() + o,
                     qsum.data() + o, amx ? kAmxRows : 1);
      }
      if (!amx) {
        rows[r] = QuantRow{q.data() + r * K, s.data() + o, sq.data() + o, qsum.data() + o};
      }
    }
  });
  Problem p = prompt;  // the same weights, bias and shape; R rows from row P on
  p.rows = rows.data();
  p.out = out_all + P * N * (out_float ? 4 : 2);
  p.M = R;
  p.stream_out = out_float && R * N * 4 > kStreamOutBytes;
  p.tile_s = s.data();
  p.tile_sq = sq.data();
  p.tile_qsum = qsum.data();
  // Tasks own whole channel groups (tiles) or units of them (VNNI, `vnni_units`) and run
  // every row: the thread split never changes a sum.
  if (P > 0 || (R > 0 && amx)) at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    if (P > 0) amx_bf16_groups(prompt, xp, tail.data(), g0, g1);
    if (R > 0 && amx) {
      q8 ? amx_groups<true>(p, q.data(), g0, g1) : amx_groups<false>(p, q.data(), g0, g1);
    }
    _mm_sfence();  // the streaming stores are visible before the task counts as done
  });
  if (R > 0 && !amx) {
    at::parallel_for(0, groups * units_per_group(R), 1, [&](int64_t u0, int64_t u1) {
      q8 ? vnni_units<true>(p, u0, u1) : vnni_units<false>(p, u0, u1);
      _mm_sfence();
    });
  }
#endif
  return out;
}

// x bfloat16 or float32 [M, K] times 4-bit weights (packed nibbles, d, m: see the top)
// -> [M, N].
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
                  const at::Tensor& m, const std::optional<at::Tensor>& bias, int64_t N,
                  bool out_float, int64_t amx_min_rows, int64_t prompt_rows) {
  return run("w4a8", false, x, packed, d, &m, bias, N, out_float, amx_min_rows, prompt_rows);
}

// x bfloat16 or float32 [M, K] times 8-bit weights w = d · q (GGUF Q8_0's form):
// packed[g][b][quad][j][lane][4] holds q(k = 32 b + 4 quad + i) + 128 as unsigned bytes; d
// float16 as for 4 bits.
at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
                     const std::optional<at::Tensor>& bias, int64_t N, bool out_float,
                     int64_t amx_min_rows) {
  return run("w4a8 (8-bit weights)", true, x, packed, d, nullptr, bias, N, out_float,
             amx_min_rows, 0);
}

}  // namespace

TORCH_LIBRARY(MET_OP_NAMESPACE, m) {
  m.def("supported() -> bool", &supported);
  m.def("amx_supported() -> bool", &amx_supported);
  m.def("amx_bf16_supported() -> bool", &amx_bf16_supported);
  m.def(kLinearSchema, &linear);
  m.def(kLinearQ8Schema, &linear_q8);
}
