// GGUF weights kept as the file stores them (Q4_0 ... Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16, F32),
// multiplied without a float copy of the matrix ever existing (met/kernels/gguf_blocks.py).
//
// A weight is uint8 [N, row_bytes]: row n holds output channel n's blocks, in file order.
// `linear` takes tiles of four channels, dequantizes them into a float32 buffer that stays in
// L1/L2 (the values gguf-py's dequantize gives, bit for bit: every scale product below is
// exact in float32 and each value is rounded once, as gguf-py does), and dots every x row
// with them in float32. A row's result depends only on that row and the weights (the sums run
// in one fixed order per machine), so it does not change with its batch. `dequantize` is the
// same decoder for whole rows (the embedding lookup, tests).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "met_simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// ggml's type ids (gguf.GGMLQuantizationType).
enum Kind : int64_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30,
};

struct Format {
  int64_t values;  // per block
  int64_t bytes;   // per block
};

bool format_of(int64_t kind, Format* f) {
  switch (kind) {
    case kF32: *f = {1, 4}; return true;
    case kF16: *f = {1, 2}; return true;
    case kBF16: *f = {1, 2}; return true;
    case kQ4_0: *f = {32, 18}; return true;
    case kQ4_1: *f = {32, 20}; return true;
    case kQ5_0: *f = {32, 22}; return true;
    case kQ5_1: *f = {32, 24}; return true;
    case kQ8_0: *f = {32, 34}; return true;
    case kQ4_K: *f = {256, 144}; return true;
    case kQ5_K: *f = {256, 176}; return true;
    case kQ6_K: *f = {256, 210}; return true;
    default: return false;
  }
}

// _Float16: the clones with F16C convert with VCVTPH2PS, the default one calls libgcc.
MET_INLINE float half(const uint8_t* p) {
  _Float16 h;
  std::memcpy(&h, p, 2);
  return float(h);
}

// Q4_K / Q5_K: the 6-bit scale and minimum of sub-block j (ggml's get_scale_min_k4).
MET_INLINE void scale_min_k4(int j, const uint8_t* s, float* sc, float* m) {
  if (j < 4) {
    *sc = float(s[j] & 63);
    *m = float(s[j + 4] & 63);
  } else {
    *sc = float((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
    *m = float((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// Each block in two steps, both of which GCC 12 vectorises for every clone: its integers as
// int8 with sixteen-byte vector operations (its byte-to-float vector conversions go lane by
// lane), then a plain loop widening them to floats times the block's scale (plus offset).
typedef uint8_t vbyte __attribute__((vector_size(16)));

MET_INLINE vbyte load16(const uint8_t* p) {
  vbyte v;
  std::memcpy(&v, p, 16);
  return v;
}

// Lane j: bit (16 · second + j) of the 32 bits at p, as 16 or 0 (Q5's fifth bits).
MET_INLINE vbyte fifth_bits(const uint8_t* p, bool second) {
  vbyte four = {};
  std::memcpy(&four, p, 4);
  const vbyte lo = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
  const vbyte hi = {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
  const vbyte bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  const vbyte bytes = __builtin_shuffle(four, second ? hi : lo);
  return (vbyte)((bytes & bit) != 0) & 16;
}

// y = s · q (n values): one rounding, as gguf-py's d · q.
template <int n>
MET_INLINE void widen(const int8_t* __restrict q, float s, float* __restrict y) {
  for (int j = 0; j < n; ++j) y[j] = s * float(q[j]);
}

// y = s · q + o: s · q is exact in every format that has an offset, so one rounding.
MET_INLINE void widen_affine(const int8_t* __restrict q, float s, float o, float* __restrict y) {
  for (int j = 0; j < 32; ++j) y[j] = s * float(q[j]) + o;
}

MET_INLINE void put(int8_t* v, vbyte lo, vbyte hi) {
  std::memcpy(v, &lo, 16);
  std::memcpy(v + 16, &hi, 16);
}

MET_INLINE void q4_0(const uint8_t* __restrict b, float* __restrict y) {
  alignas(32) int8_t v[32];
  const vbyte q = load16(b + 2);
  put(v, (q & 15) - 8, (q >> 4) - 8);
  widen<32>(v, half(b), y);
}

MET_INLINE void q4_1(const uint8_t* __restrict b, float* __restrict y) {
  alignas(32) int8_t v[32];
  const vbyte q = load16(b + 4);
  put(v, q & 15, q >> 4);
  widen_affine(v, half(b), half(b + 2), y);
}

MET_INLINE void q5_0(const uint8_t* __restrict b, float* __restrict y) {
  alignas(32) int8_t v[32];
  const vbyte q = load16(b + 6);
  put(v, ((q & 15) | fifth_bits(b + 2, false)) - 16, ((q >> 4) | fifth_bits(b + 2, true)) - 16);
  widen<32>(v, half(b), y);
}

MET_INLINE void q5_1(const uint8_t* __restrict b, float* __restrict y) {
  alignas(32) int8_t v[32];
  const vbyte q = load16(b + 8);
  put(v, (q & 15) | fifth_bits(b + 4, false), (q >> 4) | fifth_bits(b + 4, true));
  widen_affine(v, half(b), half(b + 2), y);
}

MET_INLINE void q8_0(const uint8_t* __restrict b, float* __restrict y) {
  widen<32>(reinterpret_cast<const int8_t*>(b + 2), half(b), y);
}

// Q4_K (five = false) and Q5_K: eight sub-blocks of 32, each with a 6-bit scale and minimum.
template <bool five>
MET_INLINE void qk_45(const uint8_t* __restrict b, float* __restrict y) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;  // Q5_K only: bit s of qh[l] is sub-block s's 5th bit
  const uint8_t* qs = b + (five ? 48 : 16);
  alignas(32) int8_t v[32];
  for (int s = 0; s < 8; ++s) {
    float sc, m;
    scale_min_k4(s, scales, &sc, &m);
    const uint8_t* q = qs + 32 * (s / 2);
    const int shift = 4 * (s % 2);
    vbyte lo = (load16(q) >> shift) & 15, hi = (load16(q + 16) >> shift) & 15;
    if (five) {
      lo |= ((load16(qh) >> s) & 1) << 4;
      hi |= ((load16(qh + 16) >> s) & 1) << 4;
    }
    put(v, lo, hi);
    widen_affine(v, d * sc, -(dmin * m), y + 32 * s);  // both products exact: gguf-py's
  }
}

// Q6_K: 256 values in eight groups of 32 (two halves of four), an int8 scale per 16.
MET_INLINE void q6_k(const uint8_t* __restrict b, float* __restrict y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half(b + 208);
  alignas(32) int8_t v[32];
  for (int g = 0; g < 8; ++g) {
    const int h = g / 4, c = g % 4;
    const uint8_t* lo = ql + 64 * h + 32 * (c % 2);
    const int ls = 4 * (c / 2);
    const uint8_t* hi = qh + 32 * h;
    const int hs = 2 * c;
    put(v, (((load16(lo) >> ls) & 15) | (((load16(hi) >> hs) & 3) << 4)) - 32,
        (((load16(lo + 16) >> ls) & 15) | (((load16(hi + 16) >> hs) & 3) << 4)) - 32);
    // d · scale first (exact), then one rounding of its product with q, as gguf-py
    widen<16>(v, d * float(sc[2 * g]), y + 32 * g);
    widen<16>(v + 16, d * float(sc[2 * g + 1]), y + 32 * g + 16);
  }
}

template <void (*block)(const uint8_t* __restrict, float* __restrict), int values, int bytes>
MET_INLINE void each_block(const uint8_t* __restrict b, int64_t K, float* __restrict y) {
  for (int64_t k = 0; k < K; k += values) block(b + k / values * bytes, y + k);
}

// One row of K values. Inlined into each clone of `dequantize_row`.
MET_INLINE void decode_row(int64_t kind, const uint8_t* __restrict b, int64_t K,
                           float* __restrict y) {
  switch (kind) {
    case kF32:
      std::memcpy(y, b, K * sizeof(float));
      return;
    case kF16:
      for (int64_t i = 0; i < K; ++i) y[i] = half(b + 2 * i);
      return;
    case kBF16:
      for (int64_t i = 0; i < K; ++i) {
        uint16_t h;
        std::memcpy(&h, b + 2 * i, 2);
        const uint32_t u = uint32_t(h) << 16;
        std::memcpy(y + i, &u, 4);
      }
      return;
    case kQ4_0: return each_block<q4_0, 32, 18>(b, K, y);
    case kQ4_1: return each_block<q4_1, 32, 20>(b, K, y);
    case kQ5_0: return each_block<q5_0, 32, 22>(b, K, y);
    case kQ5_1: return each_block<q5_1, 32, 24>(b, K, y);
    case kQ8_0: return each_block<q8_0, 32, 34>(b, K, y);
    case kQ4_K: return each_block<qk_45<false>, 256, 144>(b, K, y);
    case kQ5_K: return each_block<qk_45<true>, 256, 176>(b, K, y);
    case kQ6_K: return each_block<q6_k, 256, 210>(b, K, y);
    default: return;
  }
}

MET_CLONES void dequantize_row(int64_t kind, const uint8_t* b, int64_t K, float* y) {
  decode_row(kind, b, K, y);
}

constexpr int kTile = 4;  // output channels dequantized together

// acc[m][r] = x[m] · w[r] for MR rows and kTile channels, L float lanes per vector; the
// sums run lane by lane in k order, then `lane_sum`: the same order for every MR.
template <typename V, int L, int MR>
MET_INLINE void dot_block(const float* x, int64_t ldx, const float* w, int64_t K, float* out,
                          int64_t ldo) {
  V acc[MR][kTile];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < kTile; ++r) acc[m][r] = V{};
  for (int64_t k = 0; k < K; k += L) {
    V wv[kTile];
    for (int r = 0; r < kTile; ++r) std::memcpy(&wv[r], w + r * K + k, sizeof(V));
    for (int m = 0; m < MR; ++m) {
      V xv;
      std::memcpy(&xv, x + m * ldx + k, sizeof(V));
      for (int r = 0; r < kTile; ++r) acc[m][r] += xv * wv[r];
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < kTile; ++r) {
      float t[L];
      std::memcpy(t, &acc[m][r], sizeof(V));
      for (int w2 = L / 2; w2 > 0; w2 /= 2)
        for (int l = 0; l < w2; ++l) t[l] += t[l + w2];
      out[m * ldo + r] = t[0];
    }
  }
}

// Rows in blocks of MR (4 with sixteen lanes, 2 with eight: what the registers hold).
template <typename V, int L, int MR>
MET_INLINE void dot_rows(const float* x, int64_t M, const float* w, int64_t K, float* out) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) dot_block<V, L, MR>(x + m * K, K, w, K, out + m * kTile, kTile);
  const int64_t rest = M - m;
  if (rest >= 3) dot_block<V, L, 3>(x + m * K, K, w, K, out + m * kTile, kTile), m += 3;
  if (M - m >= 2) dot_block<V, L, 2>(x + m * K, K, w, K, out + m * kTile, kTile), m += 2;
  if (M - m >= 1) dot_block<V, L, 1>(x + m * K, K, w, K, out + m * kTile, kTile);
}

MET_CLONES void dot_rows_wide(const float* x, int64_t M, const float* w, int64_t K,
                              float* out) {
  dot_rows<vfloat, 16, 4>(x, M, w, K, out);
}

MET_CLONES void dot_rows_narrow(const float* x, int64_t M, const float* w, int64_t K,
                                float* out) {
  dot_rows<vfloat8, 8, 2>(x, M, w, K, out);
}

// The channel count and bytes per row of a weight, checked against its kind and K.
int64_t check_weight(const at::Tensor& blocks, int64_t kind, int64_t K) {
  Format f;
  TORCH_CHECK(format_of(kind, &f), "gguf_blocks: unsupported ggml type ", kind);
  TORCH_CHECK(blocks.dtype() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "gguf_blocks: weights must be contiguous uint8 [N, row_bytes]");
  TORCH_CHECK(K % 32 == 0 && K % f.values == 0 && blocks.size(1) == K / f.values * f.bytes,
              "gguf_blocks: ", blocks.size(1), " bytes per row do not hold ", K,
              " values of type ", kind);
  return blocks.size(0);
}

at::Tensor dequantize(const at::Tensor& blocks, int64_t kind, int64_t K) {
  const int64_t N = check_weight(blocks, kind, K);
  at::Tensor out = at::empty({N, K}, blocks.options().dtype(at::kFloat));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  const int64_t rb = blocks.size(1);
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / K), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) dequantize_row(kind, src + n * rb, K, dst + n * K);
  });
  return out;
}

// out[:, col : col + N] = x · Wᵀ, x [M, K] float32 or bfloat16, out [M, *] of x's dtype or
// float32 (the LM head's logits).
void linear(const at::Tensor& x, const at::Tensor& blocks, int64_t kind, int64_t K,
            at::Tensor& out, int64_t col) {
  const int64_t N = check_weight(blocks, kind, K);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.is_contiguous(),
              "gguf_blocks: x must be contiguous [M, ", K, "]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "gguf_blocks: x must be float32 or bfloat16");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.stride(1) == 1 &&
                  col >= 0 && col + N <= out.size(1),
              "gguf_blocks: out must be [M, >= col + N] with unit column stride");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16,
              "gguf_blocks: out must be float32 or bfloat16");
  const int64_t M = x.size(0);
  if (M == 0 || N == 0) return;
  at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  const float* xp = xf.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  const int64_t rb = blocks.size(1), ldo = out.stride(0);
  const bool out_f32 = out.scalar_type() == at::kFloat;
  void* op = out.data_ptr();
  const int64_t tiles = (N + kTile - 1) / kTile;  // the last one may be partial
  // ~64 KiB of weight bytes per task: enough work to be worth a thread.
  const int64_t grain = std::max<int64_t>(1, 65536 / (kTile * rb));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> w(kTile * K, 0.0f), y(M * kTile);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTile, live = std::min<int64_t>(kTile, N - n0);
      for (int r = 0; r < live; ++r) dequantize_row(kind, wp + (n0 + r) * rb, K, &w[r * K]);
      for (int r = live; r < kTile; ++r) std::fill_n(&w[r * K], K, 0.0f);
      if (kWideVectors) {
        dot_rows_wide(xp, M, w.data(), K, y.data());
      } else {
        dot_rows_narrow(xp, M, w.data(), K, y.data());
      }
      for (int64_t m = 0; m < M; ++m) {
        const float* ym = &y[m * kTile];
        if (out_f32) {
          std::memcpy(static_cast<float*>(op) + m * ldo + col + n0, ym, live * sizeof(float));
        } else {
          c10::BFloat16* o = static_cast<c10::BFloat16*>(op) + m * ldo + col + n0;
          for (int r = 0; r < live; ++r) o[r] = c10::BFloat16(ym[r]);
        }
      }
    }
  });
}

bool supported() { return met_cpu::avx2(); }

}  // namespace

TORCH_LIBRARY(MET_OP_NAMESPACE, m) {
  m.def("supported() -> bool", &supported);
  m.def("dequantize(Tensor blocks, int kind, int K) -> Tensor", &dequantize);
  m.def("linear(Tensor x, Tensor blocks, int kind, int K, Tensor(a!) out, int col) -> ()",
        &linear);
}
