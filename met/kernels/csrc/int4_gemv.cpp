// Few-row int4 weight-only linear layer on CPUs with AVX512-BF16, computing with exactly the
// bfloat16 weights the many-rows path multiplies.
//
// Int4Weight (met/layers/linear.py) runs few rows through a GEMV kernel and many rows through
// oneDNN's bfloat16 matmul over the dequantized weights w = bf16((q - 8) * scale + zero).
// torch's int4 kernel dequantizes to float32 without that rounding, so a row's result changed
// with the number of rows in its batch (many outputs one bfloat16 ulp apart, enough to
// flip greedy tokens). This kernel rounds each dequantized weight to bfloat16 exactly as the
// many-rows weights were rounded, then accumulates in float32 with VDPBF16PS: the two paths
// differ only in the order of the float32 sums, as oneDNN's own kernels do among themselves.
//
// Layout: 16 output channels per block, K in pairs, four pairs per 32-bit lane. VDPBF16PS
// wants, in 32-bit lane i, channel i's weights for the pair's two k. Dequantizing in float32
// and converting two vectors at once (VCVTNE2PS2BF16 puts the first in the low half) lands
// lane l of the "low" vector at bf16 position l, so the low vector holds channels 0-7 as
// (k0, k1) pairs and the high vector channels 8-15 the same way. Hence, for block b and
// pair p = 4 u + j: byte j of qpacked[b][u][l] = q[16b + l/2][2p + l%2] |
// q[16b + 8 + l/2][2p + l%2] << 4, and scale/zero are stored per group and block in the
// same lane order (each channel twice), low vector's 16 then high vector's 16.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "met_cpu.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

constexpr int64_t kBlock = 16;  // output channels per block
constexpr int64_t kGroup = 32;  // weights per scale/zero along K
constexpr int kRows = 2;        // rows per register block
constexpr int kBlocks = 4;      // channel blocks per register block

bool supported() { return met_cpu::avx512_bf16(); }

#if defined(__x86_64__)
#define MET_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

struct Problem {
  const uint16_t* x;      // [M, K] bfloat16
  const uint8_t* q;       // [blocks, K / 8, 16 lanes, 4 bytes]
  const uint16_t* scale;  // [K / 32, blocks, 2, 16] bfloat16
  const uint16_t* zero;   // [K / 32, blocks, 2, 16] bfloat16
  uint16_t* out;          // [M, N] bfloat16
  int64_t M, K, N, blocks;
};

MET_BF16_TARGET inline __m512 widen_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// R rows x NB channel blocks starting at block b0, rows m0..m0+R.
template <int R, int NB>
MET_BF16_TARGET inline void tile(const Problem& p, int64_t b0, int64_t m0) {
  const int64_t quads = p.K / 8;  // four pairs per 32-bit lane
  // The sixteen int4 values as floats: VPERMPS reads only an index's low four bits.
  const __m512 levels = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 minus_eight = _mm512_set1_ps(-8.0f);
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  __m512 scale[NB][2], zero[NB][2];
  for (int64_t u = 0; u < quads; ++u) {
    if ((8 * u) % kGroup == 0) {
      const int64_t g = 8 * u / kGroup;
      for (int b = 0; b < NB; ++b) {
        for (int h = 0; h < 2; ++h) {
          const int64_t at = (g * p.blocks + b0 + b) * 2 * kBlock + h * kBlock;
          scale[b][h] = widen_bf16(p.scale + at);
          // q * scale + (zero - 8 * scale) is the same real number as (q - 8) * scale +
          // zero, and both this FMA and the Python dequant round it once; zero - 8 * scale
          // itself is exact (two bfloat16 values, an exact factor 8).
          zero[b][h] = _mm512_fmadd_ps(minus_eight, scale[b][h], widen_bf16(p.zero + at));
        }
      }
    }
    __m512i v[NB];
    for (int b = 0; b < NB; ++b) {
      v[b] = _mm512_loadu_si512(p.q + ((b0 + b) * quads + u) * kBlock * 4);
    }
    for (int j = 0; j < 4; ++j) {
      const int64_t pr = 4 * u + j;
      __m512bh w[NB];
      for (int b = 0; b < NB; ++b) {
        const __m512i lo = _mm512_srli_epi32(v[b], 8 * j);
        const __m512i hi = _mm512_srli_epi32(v[b], 8 * j + 4);
        const __m512 w_lo = _mm512_fmadd_ps(_mm512_permutexvar_ps(lo, levels), scale[b][0],
                                            zero[b][0]);
        const __m512 w_hi = _mm512_fmadd_ps(_mm512_permutexvar_ps(hi, levels), scale[b][1],
                                            zero[b][1]);
        w[b] = _mm512_cvtne2ps_pbh(w_hi, w_lo);  // rounded like the Python dequant
      }
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, p.x + (m0 + r) * p.K + 2 * pr, sizeof(pair));
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], w[b], xv);
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t n = (b0 + b) * kBlock;
    const int64_t valid = std::min<int64_t>(kBlock, p.N - n);
    if (valid <= 0) break;
    const __mmask16 mask = valid == kBlock ? 0xFFFF : (__mmask16)((1u << valid) - 1);
    for (int r = 0; r < R; ++r) {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(acc[r][b]);
      _mm256_mask_storeu_epi16(p.out + (m0 + r) * p.N + n, mask, h);
    }
  }
}

template <int NB>
MET_BF16_TARGET void all_rows(const Problem& p, int64_t b0) {
  int64_t m = 0;
  for (; m + kRows <= p.M; m += kRows) tile<kRows, NB>(p, b0, m);
  if (m < p.M) tile<1, NB>(p, b0, m);
}
#endif

// q: int32 [N, K] in 0..15; scale, zero: bfloat16 [N, K / 32]. Returns (qpacked, scale,
// zero) in the kernel's layout (see the top of this file).
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack(const at::Tensor& q_in,
                                                    const at::Tensor& scale_in,
                                                    const at::Tensor& zero_in) {
  TORCH_CHECK(q_in.dim() == 2 && q_in.is_cpu(), "int4_gemv.pack: q must be a 2-D CPU tensor");
  const int64_t N = q_in.size(0), K = q_in.size(1);
  TORCH_CHECK(K % kGroup == 0, "int4_gemv.pack: K must be a multiple of 32");
  TORCH_CHECK(scale_in.sizes() == zero_in.sizes() && scale_in.dim() == 2 &&
                  scale_in.size(0) == N && scale_in.size(1) == K / kGroup &&
                  scale_in.scalar_type() == at::kBFloat16 &&
                  zero_in.scalar_type() == at::kBFloat16,
              "int4_gemv.pack: scale and zero must be bfloat16 [N, K / 32]");
  const at::Tensor q = q_in.to(at::kInt).contiguous();
  const at::Tensor sc = scale_in.contiguous(), ze = zero_in.contiguous();
  const int64_t blocks = (N + kBlock - 1) / kBlock, quads = K / 8, G = K / kGroup;
  at::Tensor qp = at::zeros({blocks, quads, kBlock, 4}, q_in.options().dtype(at::kByte));
  at::Tensor st = at::zeros({G, blocks, 2, kBlock}, scale_in.options());
  at::Tensor zt = at::zeros({G, blocks, 2, kBlock}, zero_in.options());
  const int32_t* qs = q.data_ptr<int32_t>();
  uint8_t* qd = qp.data_ptr<uint8_t>();
  const auto* ss = static_cast<const uint16_t*>(sc.data_ptr());
  const auto* zs = static_cast<const uint16_t*>(ze.data_ptr());
  auto* sd = static_cast<uint16_t*>(st.data_ptr());
  auto* zd = static_cast<uint16_t*>(zt.data_ptr());
  // Channel of lane l in the low (h = 0) and high (h = 1) vector of block b; -1 past N.
  auto channel = [&](int64_t b, int64_t h, int64_t l) {
    const int64_t n = b * kBlock + h * 8 + l / 2;
    return n < N ? n : -1;
  };
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t l = 0; l < kBlock; ++l) {
      const int64_t n_lo = channel(b, 0, l), n_hi = channel(b, 1, l);
      for (int64_t pr = 0; pr < K / 2; ++pr) {
        const int64_t k = 2 * pr + l % 2;
        const int32_t lo = n_lo < 0 ? 8 : qs[n_lo * K + k];
        const int32_t hi = n_hi < 0 ? 8 : qs[n_hi * K + k];
        TORCH_CHECK(lo >= 0 && lo < 16 && hi >= 0 && hi < 16, "int4_gemv.pack: q outside 0..15");
        qd[((b * quads + pr / 4) * kBlock + l) * 4 + pr % 4] = static_cast<uint8_t>(lo | hi << 4);
      }
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t n = h == 0 ? n_lo : n_hi;
          const int64_t at = ((g * blocks + b) * 2 + h) * kBlock + l;
          sd[at] = n < 0 ? 0 : ss[n * G + g];
          zd[at] = n < 0 ? 0 : zs[n * G + g];
        }
      }
    }
  }
  return {qp, st, zt};
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& qpacked, const at::Tensor& scale,
                  const at::Tensor& zero, int64_t out_features) {
  TORCH_CHECK(supported(), "int4_gemv: this CPU has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_cpu() &&
                  x.is_contiguous(),
              "int4_gemv: x must be a contiguous 2-D bfloat16 CPU tensor");
  TORCH_CHECK(qpacked.dim() == 4 && qpacked.size(2) == kBlock && qpacked.size(3) == 4 &&
                  qpacked.is_contiguous() && scale.is_contiguous() && zero.is_contiguous(),
              "int4_gemv: weights must come from int4_gemv.pack");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const int64_t blocks = qpacked.size(0);
  TORCH_CHECK(qpacked.size(1) * 8 == K && blocks == (N + kBlock - 1) / kBlock &&
                  scale.dim() == 4 && scale.size(0) == K / kGroup && scale.size(1) == blocks,
              "int4_gemv: x has ", K, " features, the packed weight ", 8 * qpacked.size(1));
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
#if defined(__x86_64__)
  const Problem p{static_cast<const uint16_t*>(x.data_ptr()),
                  qpacked.data_ptr<uint8_t>(),
                  static_cast<const uint16_t*>(scale.data_ptr()),
                  static_cast<const uint16_t*>(zero.data_ptr()),
                  static_cast<uint16_t*>(out.data_ptr()),
                  M, K, N, blocks};
  const int64_t groups = (blocks + kBlocks - 1) / kBlocks;
  // Tasks own whole channel blocks and run every row: the thread split never changes a sum.
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b0 = g * kBlocks;
      switch (std::min<int64_t>(kBlocks, blocks - b0)) {
        case 4: all_rows<4>(p, b0); break;
        case 3: all_rows<3>(p, b0); break;
        case 2: all_rows<2>(p, b0); break;
        default: all_rows<1>(p, b0); break;
      }
    }
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY(MET_OP_NAMESPACE, m) {
  m.def("supported() -> bool", &supported);
  m.def("pack(Tensor q, Tensor scale, Tensor zero) -> (Tensor, Tensor, Tensor)", &pack);
  m.def("linear(Tensor x, Tensor qpacked, Tensor scale, Tensor zero, int out_features) -> Tensor",
        &linear);
}
