// int8 x int8 linear layers on CPUs with AVX512-VNNI: weights int8 per output channel, each
// activation row quantized to int8 on the fly with its own scale (met/layers/w8a8.py).
//
// A row's output is float(sum_k q_x[k] * q_w[n, k]) * (scale_x * scale_w[n]) (+ bias[n]):
// the sum is exact integer arithmetic, so it is the same whichever kernel computes it. Few
// rows go through `gemv` here; many rows through `quantize`, torch._int_mm (oneDNN's int8
// matrix units) and `scale_out`. Both paths quantize with `quantize_row` and finish with
// `finish16`, so a row's result is bitwise the same whatever batch it ran in.
//
// gemv layout: channels in groups of 64 (four blocks of 16), K in quads. VPDPBUSD multiplies
// unsigned bytes by signed bytes and sums each four into a 32-bit lane, so lane l of block j
// holds channel 64 g + 16 j + l's four weights of one quad: packed[g][quad][j][l][4]. The
// activations go in as unsigned bytes q + 128; wsum128[n] = 128 * sum_k q_w[n, k] takes the
// offset back out, exactly.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>

#include "met_vnni.h"

// No fused multiply-adds where the source says multiply then add: the scaling must round
// exactly as the plain-PyTorch fallback (w8a8.py) does.
#pragma GCC optimize("fp-contract=off")

namespace {

constexpr int64_t kLanes = 16;        // channels per block
constexpr int64_t kBlocks = 4;        // blocks per group
constexpr int64_t kGroup = kLanes * kBlocks;
constexpr int64_t kMaxGemvRows = 16;
constexpr int kTileRows = 4;  // rows per register tile

bool supported() { return vnni_supported(); }

#if defined(__x86_64__)

// Row x (bfloat16, K values) -> int8 q = round(x * 127 / max|x|), as signed bytes (q_out) or
// as unsigned bytes q + 128 (u_out); returns the row's scale max|x| / 127. The one definition
// both paths use.
MET_VNNI_TARGET inline float quantize_row(const uint16_t* x, int64_t K, int8_t* q_out,
                                          uint8_t* u_out) {
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kLanes) {
    const __m512 v = widen_bf16(x + k, tail_mask(K - k));
    vmax = _mm512_max_ps(vmax, _mm512_and_ps(v, abs_mask));
  }
  const float absmax = _mm512_reduce_max_ps(vmax);  // max is exact in any order
  const float inv = absmax > 0.0f ? 127.0f / absmax : 0.0f;
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i offset = _mm512_set1_epi32(128);
  for (int64_t k = 0; k < K; k += kLanes) {
    const __mmask16 mask = tail_mask(K - k);
    // Round to nearest even (the default MXCSR mode); |x * inv| <= 127 up to rounding.
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(widen_bf16(x + k, mask), vinv));
    if (q_out != nullptr) _mm512_mask_cvtsepi32_storeu_epi8(q_out + k, mask, q);
    if (u_out != nullptr) {
      _mm512_mask_cvtusepi32_storeu_epi8(u_out + k, mask, _mm512_add_epi32(q, offset));
    }
  }
  return absmax / 127.0f;
}

// Sixteen outputs from their exact integer sums: float(acc) * (sx * sw) (+ bias), stored as
// float32 or bfloat16 (store_out).
// acc_float: the lanes already hold float(acc).
MET_VNNI_TARGET inline void finish16(__m512i acc, bool acc_float, float sx, const float* sw,
                                     const float* bias, void* out, bool out_float,
                                     __mmask16 mask) {
  const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(sx), _mm512_maskz_loadu_ps(mask, sw));
  const __m512 sum = acc_float ? _mm512_castsi512_ps(acc) : _mm512_cvtepi32_ps(acc);
  __m512 y = _mm512_mul_ps(sum, scale);
  if (bias != nullptr) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, bias));
  store_out(out, y, out_float, mask);
}

// One row of scale_out; acc is int32, or float32 holding float(the int32 sum) (oneDNN's
// int8 matmul with unit scales: the same single rounding finish16's conversion does).
MET_VNNI_TARGET void scale_out_row(const void* acc, bool acc_float, float sx, const float* sw,
                                   const float* bias, char* out, int64_t N, bool out_float) {
  const size_t elem = out_float ? 4 : 2;
  for (int64_t n = 0; n < N; n += kLanes) {
    const __mmask16 mask = tail_mask(N - n);
    const __m512i a = _mm512_maskz_loadu_epi32(mask, static_cast<const int32_t*>(acc) + n);
    finish16(a, acc_float, sx, sw + n, bias == nullptr ? nullptr : bias + n, out + n * elem,
             out_float, mask);
  }
}

struct Gemv {
  const uint8_t* xu;     // [M, quads * 4] activations as q + 128
  const float* sx;       // [M]
  const int8_t* w;       // [groups, quads, 4, 16, 4]
  const int32_t* wsum;   // [groups * 64]: 128 * sum_k q_w
  const float* sw;       // [groups * 64]
  const float* bias;     // [groups * 64] or null
  void* out;             // [M, N], float32 or bfloat16
  int64_t M, quads, N;
  bool out_float;
};

// Rows m0..m0+R of channel group g.
template <int R>
MET_VNNI_TARGET void gemv_tile(const Gemv& p, int64_t g, int64_t m0) {
  __m512i acc[R][kBlocks];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kBlocks; ++j) acc[r][j] = _mm512_setzero_si512();
  const int8_t* w = p.w + g * p.quads * kGroup * 4;
  const int64_t xstride = p.quads * 4;
  for (int64_t u = 0; u < p.quads; ++u, w += kGroup * 4) {
    __m512i wv[kBlocks];
    for (int j = 0; j < kBlocks; ++j) wv[j] = _mm512_loadu_si512(w + j * kLanes * 4);
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, p.xu + (m0 + r) * xstride + 4 * u, sizeof(quad));
      const __m512i xv = _mm512_set1_epi32(quad);
      for (int j = 0; j < kBlocks; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], xv, wv[j]);
    }
  }
  const size_t elem = p.out_float ? 4 : 2;
  for (int j = 0; j < kBlocks; ++j) {
    const int64_t n = g * kGroup + j * kLanes;
    if (n >= p.N) break;
    const __mmask16 mask = tail_mask(p.N - n);
    const __m512i off = _mm512_loadu_si512(p.wsum + n);
    for (int r = 0; r < R; ++r) {
      char* out = static_cast<char*>(p.out) + ((m0 + r) * p.N + n) * elem;
      finish16(_mm512_sub_epi32(acc[r][j], off), false, p.sx[m0 + r], p.sw + n,
               p.bias == nullptr ? nullptr : p.bias + n, out, p.out_float, mask);
    }
  }
}
// Every row of channel group g, four at a time (the group's weights stay in cache).
MET_VNNI_TARGET void gemv_group(const Gemv& p, int64_t g) {
  int64_t m = 0;
  for (; m + kTileRows <= p.M; m += kTileRows) gemv_tile<kTileRows>(p, g, m);
  switch (p.M - m) {
    case 1: gemv_tile<1>(p, g, m); break;
    case 2: gemv_tile<2>(p, g, m); break;
    case 3: gemv_tile<3>(p, g, m); break;
    default: break;
  }
}
#endif

void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_cpu() &&
                  x.is_contiguous(),
              "w8a8.", op, ": x must be a contiguous 2-D bfloat16 CPU tensor");
}

// x bfloat16 [M, K] -> (q int8 [M, K], scale float32 [M]).
std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& x) {
  TORCH_CHECK(supported(), "w8a8: this CPU has no AVX512-VNNI");
  check_x(x, "quantize");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor s = at::empty({M}, x.options().dtype(at::kFloat));
#if defined(__x86_64__)
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = s.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) sp[m] = quantize_row(xp + m * K, K, qp + m * K, nullptr);
  });
#endif
  return {q, s};
}

void check_scales(const at::Tensor& sw, const std::optional<at::Tensor>& bias, int64_t N,
                  const char* op) {
  TORCH_CHECK(sw.dim() == 1 && sw.size(0) >= N && sw.scalar_type() == at::kFloat &&
                  sw.is_contiguous(),
              "w8a8.", op, ": weight scales must be float32 [>= ", N, "]");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) >= N &&
                                    bias->scalar_type() == at::kFloat && bias->is_contiguous()),
              "w8a8.", op, ": bias must be float32 [>= ", N, "]");
}

// acc [M, N]: the integer sums of quantize's q times the weights, as int32 (torch._int_mm)
// or as float32 (oneDNN's int8 matmul with unit scales) -> the layer's output.
at::Tensor scale_out(const at::Tensor& acc, const at::Tensor& sx, const at::Tensor& sw,
                     const std::optional<at::Tensor>& bias, bool out_float) {
  TORCH_CHECK(supported(), "w8a8: this CPU has no AVX512-VNNI");
  const bool acc_float = acc.scalar_type() == at::kFloat;
  TORCH_CHECK(acc.dim() == 2 && (acc_float || acc.scalar_type() == at::kInt) &&
                  acc.is_contiguous(),
              "w8a8.scale_out: acc must be a contiguous int32 or float32 [M, N]");
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK(sx.dim() == 1 && sx.size(0) == M && sx.scalar_type() == at::kFloat,
              "w8a8.scale_out: sx must be float32 [M]");
  check_scales(sw, bias, N, "scale_out");
  at::Tensor out = at::empty({M, N}, acc.options().dtype(out_float ? at::kFloat : at::kBFloat16));
#if defined(__x86_64__)
  const auto* ap = static_cast<const char*>(acc.data_ptr());
  const float* sxp = sx.data_ptr<float>();
  const float* swp = sw.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  char* op = static_cast<char*>(out.data_ptr());
  const size_t elem = out_float ? 4 : 2;
  at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      scale_out_row(ap + m * N * 4, acc_float, sxp[m], swp, bp, op + m * N * elem, N,
                    out_float);
    }
  });
#endif
  return out;
}

// x bfloat16 [M <= 16, K] times packed int8 weights (see the top of this file).
at::Tensor gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& wsum,
                const at::Tensor& sw, const std::optional<at::Tensor>& bias, int64_t N,
                bool out_float) {
  TORCH_CHECK(supported(), "w8a8: this CPU has no AVX512-VNNI");
  check_x(x, "gemv");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M <= kMaxGemvRows, "w8a8.gemv: at most ", kMaxGemvRows, " rows, got ", M);
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == kBlocks && packed.size(3) == kLanes && packed.size(4) == 4,
              "w8a8.gemv: weights must come from w8a8.pack");
  const int64_t groups = packed.size(0), quads = packed.size(1);
  TORCH_CHECK(quads == (K + 3) / 4 && groups == (N + kGroup - 1) / kGroup,
              "w8a8.gemv: x has ", K, " features and ", N, " outputs; the packed weight ",
              4 * quads, " and ", groups * kGroup);
  TORCH_CHECK(wsum.scalar_type() == at::kInt && wsum.numel() == groups * kGroup &&
                  wsum.is_contiguous(),
              "w8a8.gemv: wsum must be int32 [groups * 64]");
  check_scales(sw, bias, groups * kGroup, "gemv");
  at::Tensor out = at::empty({M, N}, x.options().dtype(out_float ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
#if defined(__x86_64__)
  uint8_t xu[kMaxGemvRows * 2048];
  at::Tensor xu_heap;
  uint8_t* xup = xu;
  if (M * quads * 4 > (int64_t)sizeof(xu)) {
    xu_heap = at::empty({M, quads * 4}, x.options().dtype(at::kByte));
    xup = xu_heap.data_ptr<uint8_t>();
  }
  float sx[kMaxGemvRows];
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  for (int64_t m = 0; m < M; ++m) {
    uint8_t* row = xup + m * quads * 4;
    std::memset(row + K, 128, quads * 4 - K);  // padding: weight 0 there, so no effect
    sx[m] = quantize_row(xp + m * K, K, nullptr, row);
  }
  const Gemv p{xup, sx, packed.data_ptr<int8_t>(), wsum.data_ptr<int32_t>(),
               sw.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
               out.data_ptr(), M, quads, N, out_float};
  // Tasks own whole channel groups and run every row: the thread split never changes a sum.
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      gemv_group(p, g);
    }
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY(MET_OP_NAMESPACE, m) {
  m.def("supported() -> bool", &supported);
  m.def("quantize(Tensor x) -> (Tensor, Tensor)", &quantize);
  m.def("scale_out(Tensor acc, Tensor sx, Tensor sw, Tensor? bias, bool out_float) -> Tensor",
        &scale_out);
  m.def("gemv(Tensor x, Tensor packed, Tensor wsum, Tensor sw, Tensor? bias, int out_features, "
        "bool out_float) -> Tensor",
        &gemv);
}
