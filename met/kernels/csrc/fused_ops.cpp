// Fused element-wise ops of a decoder layer on CPU, for bfloat16 or float32 activations:
// RMSNorm (with the residual add folded in), SiLU(gate) * up, and rope on q|k with the new
// keys and values written straight into the paged cache. Each replaces a chain of 4-10 ATen
// ops (and as many passes over the activations and Python dispatches) with one call.
//
// Every op reproduces the rounding of the ATen chain it replaces: values are widened to
// float32, each intermediate that ATen stores as bfloat16 is rounded to bfloat16 at the same
// point (float32: no rounding), so rope and the residual add give the same bits as the ATen
// ops, and SiLU * up too in bfloat16 (its exp is a polynomial: float32 results are within
// ~1 ulp of ATen's); RMSNorm's mean of squares is summed in another (fixed) order, so its
// output can differ by one ulp now and then. The functions are templates over the stored
// type T (uint16_t: bfloat16 bits, or float); each op has one target_clones entry per type.
//
// Batch invariance: every row (token) is computed alone, in a fixed order, whatever the
// number of rows or threads.
#include "met_rows.h"

namespace {

// ---- RMSNorm ---------------------------------------------------------------------------

// Rows [r0, r1): residual = bf16(x + delta) when delta is given (stored to sum_out), then
// out = bf16(w * bf16(v * rsqrt(mean(v^2) + eps))), as met.layers.norms.RMSNorm computes it.
// In V = vfloat, or vfloat8 for float32 rows: then two accumulators side by side hold the
// sixteen lanes of the sum of squares, so both widths add in one order (the same bits).
template <typename T, typename V>
MET_INLINE void rms_norm_rows_impl(const void* x_, const void* delta_, void* sum_out_,
                                   void* out_, const void* w_, int64_t r0, int64_t r1,
                                   int64_t D, float eps) {
  constexpr int64_t kW = sizeof(V) / sizeof(float), kParts = kLanes / kW;
  const T* x = static_cast<const T*>(x_);
  const T* delta = static_cast<const T*>(delta_);
  const T* w = static_cast<const T*>(w_);
  T* sum_out = static_cast<T*>(sum_out_);
  T* out = static_cast<T*>(out_);
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * D;
    const T* dr = delta == nullptr ? nullptr : delta + r * D;
    T* sr = delta == nullptr ? nullptr : sum_out + r * D;
    V acc[kParts] = {};
    for (int64_t d = 0; d < D; d += kLanes) {
#pragma GCC unroll 2
      for (int64_t j = 0; j < kParts; ++j) {  // lanes j * kW.. of the sixteen
        const int64_t at = d + j * kW, n = std::min(kW, D - at);
        if (n <= 0) break;  // past the end: adding zeros changes no sum
        V v = load_lanes<T, V>(xr + at, n);
        if (dr != nullptr) {
          v = rnd<T>(v + load_lanes<T, V>(dr + at, n));
          store_lanes(sr + at, v, n);
        }
        acc[j] += v * v;
      }
    }
    vfloat sum;
    std::memcpy(&sum, acc, sizeof(sum));
    const float inv = 1.0f / std::sqrt(hsum(sum) / static_cast<float>(D) + eps);
    const T* src = dr == nullptr ? xr : sr;
    T* orow = out + r * D;
    for (int64_t d = 0; d < D; d += kW) {
      const int64_t n = std::min(kW, D - d);
      const V normed = rnd<T>(load_lanes<T, V>(src + d, n) * inv);
      store_lanes(orow + d, normed * load_lanes<T, V>(w + d, n), n);
    }
  }
}

MET_CLONES void rms_norm_rows_bf16(const void* x, const void* delta, void* sum_out, void* out,
                                   const void* w, int64_t r0, int64_t r1, int64_t D,
                                   float eps) {
  rms_norm_rows_impl<uint16_t, vfloat>(x, delta, sum_out, out, w, r0, r1, D, eps);
}

MET_CLONES void rms_norm_rows_f32(const void* x, const void* delta, void* sum_out, void* out,
                                  const void* w, int64_t r0, int64_t r1, int64_t D,
                                  float eps) {
  if (kWideVectors) {
    rms_norm_rows_impl<float, vfloat>(x, delta, sum_out, out, w, r0, r1, D, eps);
  } else {
    rms_norm_rows_impl<float, vfloat8>(x, delta, sum_out, out, w, r0, r1, D, eps);
  }
}

// Rows of bfloat16 or float32: the type's entry.
#define MET_CALL_TYPED(is_float, name, ...) \
  ((is_float) ? name##_f32(__VA_ARGS__) : name##_bf16(__VA_ARGS__))

void check_rows(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() &&
                  (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat) &&
                  t.dim() == 2 && t.is_contiguous(),
              op, ": ", name, " must be a contiguous 2-D bfloat16 or float32 CPU tensor");
}

// Rows per task: enough work per thread to pay for the fork.

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm", "x");
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == D,
              "rms_norm: weight must be a contiguous [hidden] tensor of x's dtype");
  at::Tensor out = at::empty({T, D}, x.options());
  const bool f32 = x.scalar_type() == at::kFloat;
  const void* xp = x.data_ptr();
  const void* wp = weight.data_ptr();
  void* op = out.data_ptr();
  at::parallel_for(0, T, grain_rows(D), [&](int64_t b, int64_t e) {
    MET_CALL_TYPED(f32, rms_norm_rows, xp, nullptr, nullptr, op, wp, b, e, D,
                   static_cast<float>(eps));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm", "x");
  check_rows(delta, "add_rms_norm", "delta");
  TORCH_CHECK(x.sizes() == delta.sizes() && x.scalar_type() == delta.scalar_type(),
              "add_rms_norm: x and delta differ in shape or dtype");
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == D,
              "add_rms_norm: weight must be a contiguous [hidden] tensor of x's dtype");
  at::Tensor sum = at::empty({T, D}, x.options());
  at::Tensor out = at::empty({T, D}, x.options());
  const bool f32 = x.scalar_type() == at::kFloat;
  const void* xp = x.data_ptr();
  const void* dp = delta.data_ptr();
  const void* wp = weight.data_ptr();
  void* sp = sum.data_ptr();
  void* op = out.data_ptr();
  at::parallel_for(0, T, grain_rows(D), [&](int64_t b, int64_t e) {
    MET_CALL_TYPED(f32, rms_norm_rows, xp, dp, sp, op, wp, b, e, D, static_cast<float>(eps));
  });
  return {sum, out};
}

// ---- SiLU(gate) * up ---------------------------------------------------------------------

// Rows [r0, r1) of gate_up [T, 2I] (gate then up): out = bf16(bf16(silu(gate)) * up), the
// rounding of F.silu followed by a bfloat16 multiply.
MET_INLINE void silu_mul_rows_bf16_impl(const void* gu_, void* out_, int64_t r0, int64_t r1,
                                        int64_t I) {
  const uint16_t* gu = static_cast<const uint16_t*>(gu_);
  uint16_t* out = static_cast<uint16_t*>(out_);
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* g = gu + r * 2 * I;
    const uint16_t* u = g + I;
    uint16_t* o = out + r * I;
    int64_t i = 0;
    // Four vectors per iteration: each is a ~100-cycle chain of dependent steps (exp, divide,
    // roundings), so independent ones side by side keep the pipelines busy.
    for (; i + 4 * kLanes <= I; i += 4 * kLanes) {
      vfloat s[4];
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        const vfloat x = load_bf16(g + i + v * kLanes);
        s[v] = round_bf16(x / (1.0f + vexp(-x)));
      }
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        store_bf16(o + i + v * kLanes, s[v] * load_bf16(u + i + v * kLanes));
      }
    }
    for (; i < I; i += kLanes) {
      const int64_t n = std::min(kLanes, I - i);
      const vfloat x = load_bf16_n(g + i, n);
      const vfloat s = round_bf16(x / (1.0f + vexp(-x)));
      store_bf16_n(o + i, s * load_bf16_n(u + i, n), n);
    }
  }
}

// The same for float32 rows (no rounding steps), in V = vfloat or vfloat8 vectors.
template <typename V, typename VI>
MET_INLINE void silu_mul_rows_f32_impl(const void* gu_, void* out_, int64_t r0, int64_t r1,
                                       int64_t I) {
  constexpr int64_t kW = sizeof(V) / sizeof(float);
  const float* gu = static_cast<const float*>(gu_);
  float* out = static_cast<float*>(out_);
  for (int64_t r = r0; r < r1; ++r) {
    const float* g = gu + r * 2 * I;
    const float* u = g + I;
    float* o = out + r * I;
    int64_t i = 0;
    for (; i + 4 * kW <= I; i += 4 * kW) {
      V s[4];
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        V x;
        std::memcpy(&x, g + i + v * kW, sizeof(x));
        s[v] = x / (1.0f + vexp_t<V, VI>(-x));
      }
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        V up;
        std::memcpy(&up, u + i + v * kW, sizeof(up));
        const V y = s[v] * up;
        std::memcpy(o + i + v * kW, &y, sizeof(y));
      }
    }
    for (; i < I; i += kW) {  // a partial last chunk is zero-padded
      const int64_t n = std::min(kW, I - i);
      float xt[kW] = {}, ut[kW] = {};
      std::memcpy(xt, g + i, n * sizeof(float));
      std::memcpy(ut, u + i, n * sizeof(float));
      V x, up;
      std::memcpy(&x, xt, sizeof(x));
      std::memcpy(&up, ut, sizeof(up));
      const V y = x / (1.0f + vexp_t<V, VI>(-x)) * up;
      std::memcpy(o + i, &y, n * sizeof(float));
    }
  }
}

MET_CLONES void silu_mul_rows_bf16(const void* gu, void* out, int64_t r0, int64_t r1,
                                   int64_t I) {
  silu_mul_rows_bf16_impl(gu, out, r0, r1, I);
}

MET_CLONES void silu_mul_rows_f32(const void* gu, void* out, int64_t r0, int64_t r1,
                                  int64_t I) {
  if (kWideVectors) {
    silu_mul_rows_f32_impl<vfloat, vint>(gu, out, r0, r1, I);
  } else {
    silu_mul_rows_f32_impl<vfloat8, vint8>(gu, out, r0, r1, I);
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul", "gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up must have an even width");
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const bool f32 = gate_up.scalar_type() == at::kFloat;
  const void* gp = gate_up.data_ptr();
  void* op = out.data_ptr();
  at::parallel_for(0, T, grain_rows(2 * I), [&](int64_t b, int64_t e) {
    MET_CALL_TYPED(f32, silu_mul_rows, gp, op, b, e, I);
  });
  return out;
}

// ---- rope on q|k, keys and values into the paged cache -------------------------------------

struct RopeProblem {
  const void* qkv;  // [T, (H + 2 Hkv) * D] of the activations' type
  const int64_t* positions;
  const float* cos;  // [P, D] float32 tables (rounded to bfloat16 at use, as ATen's .to())
  const float* sin;
  void* k_cache;  // [Hkv, S, D]: the activations' type, or int8 when the scales are set
  void* v_cache;
  float* k_scale;  // [Hkv, S] float32 (int8 caches), else null
  float* v_scale;
  const int64_t* slots;
  void* q_out;  // [T, H, D]
  int64_t H, Hkv, D, S;
};

// Largest head_dim the int8 cache write stages on the stack.
constexpr int64_t kMaxHeadDim = 512;

typedef int8_t vchar __attribute__((vector_size(16)));
typedef int8_t vchar32 __attribute__((vector_size(32)));

// The first n of r's lanes (each in [-128, 127]) as bytes at q.
MET_INLINE void store_q8(vint r, int8_t* q, int64_t n) {
  const vchar b = __builtin_convertvector(r, vchar);
  std::memcpy(q, &b, n);
}

// Eight lanes: GCC 12 narrows a vint8 lane by lane through general registers; the low byte
// of each lane picked by a byte shuffle is two VPSHUFB and a VPERMQ on AVX2.
MET_INLINE void store_q8(vint8 r, int8_t* q, int64_t n) {
  vchar32 bytes;
  std::memcpy(&bytes, &r, sizeof(bytes));
#if defined(__clang__)
  const vchar32 b = __builtin_shufflevector(bytes, bytes, 0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0,
                                            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                            0, 0, 0, 0);
#else
  const vchar32 b = __builtin_shuffle(bytes, vchar32{0, 4, 8, 12, 16, 20, 24, 28});
#endif
  if (n == 8) {
    std::memcpy(q, &b, 8);  // whole: one fixed-size store
  } else {
    std::memcpy(q, &b, n);
  }
}

// One row of D values into int8 with its scale, as met.layers.kv_cache.quantize_rows does
// it: scale = max|x| / 127, q = round-half-even(x / scale), all in float32 (0 for an
// all-zero row). A division, not a multiply by 127 / max|x|: GCC contracts a multiply and
// the rounding add below into one FMA, which would round some ties differently from torch.
// In V = vfloat or vfloat8 (the running max is a select): the same bits either way.
template <typename T, typename V, typename VI>
MET_INLINE void quantize_row_q8_t(const T* x, int64_t D, int8_t* q, float* scale) {
  constexpr int64_t kW = sizeof(V) / sizeof(float);
  V vmax = {};
  for (int64_t d = 0; d < D; d += kW) {  // a partial last chunk is zero-padded
    const V v = load_lanes<T, V>(x + d, std::min(kW, D - d));
    const V a = v < 0.f ? -v : v;
    vmax = a > vmax ? a : vmax;
  }
  float lanes[kW];
  std::memcpy(lanes, &vmax, sizeof(lanes));
  float absmax = 0.f;
  for (int l = 0; l < kW; ++l) absmax = std::max(absmax, lanes[l]);
  const float s = absmax / 127.0f;
  *scale = s;
  if (s == 0.f) {
    std::memset(q, 0, D);
    return;
  }
  for (int64_t d = 0; d < D; d += kW) {
    const int64_t n = std::min(kW, D - d);
    // Adding and taking off 1.5 * 2^23 rounds |y| <= 127 to the nearest integer, ties to even.
    const V y = load_lanes<T, V>(x + d, n) / s;
    const V r = (y + 12582912.0f) - 12582912.0f;
    store_q8(__builtin_convertvector(r, VI), q + d, n);
  }
}

template <typename T>
MET_INLINE void quantize_row_q8(const T* x, int64_t D, int8_t* q, float* scale) {
  if (kWideVectors) {
    quantize_row_q8_t<T, vfloat, vint>(x, D, q, scale);
  } else {
    quantize_row_q8_t<T, vfloat8, vint8>(x, D, q, scale);
  }
}

// One head: out = T(T(x * c) + T(rotate_half(x) * s)), rotate_half(x) = (-x2, x1), the
// tables rounded to T first (bfloat16: each product and the sum rounded, as ATen's chain).
template <typename T>
MET_INLINE void rope_head(const T* x, const float* c, const float* s, T* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; d += kLanes) {
    const int64_t n = std::min(kLanes, half - d);
    const vfloat x1 = load_n(x + d, n), x2 = load_n(x + half + d, n);
    const vfloat c1 = rnd<T>(load_f32_n(c + d, n));
    const vfloat c2 = rnd<T>(load_f32_n(c + half + d, n));
    const vfloat s1 = rnd<T>(load_f32_n(s + d, n));
    const vfloat s2 = rnd<T>(load_f32_n(s + half + d, n));
    store_n(out + d, rnd<T>(x1 * c1) + rnd<T>(-x2 * s1), n);
    store_n(out + half + d, rnd<T>(x2 * c2) + rnd<T>(x1 * s2), n);
  }
}

template <typename T>
MET_INLINE void rope_rows_impl(const RopeProblem& p, int64_t r0, int64_t r1) {
  const int64_t D = p.D, width = (p.H + 2 * p.Hkv) * D;
  for (int64_t t = r0; t < r1; ++t) {
    const T* row = static_cast<const T*>(p.qkv) + t * width;
    const float* c = p.cos + p.positions[t] * D;
    const float* s = p.sin + p.positions[t] * D;
    for (int64_t h = 0; h < p.H; ++h) {
      rope_head(row + h * D, c, s, static_cast<T*>(p.q_out) + (t * p.H + h) * D, D);
    }
    const int64_t slot = p.slots[t];
    for (int64_t h = 0; h < p.Hkv; ++h) {
      const int64_t at = h * p.S + slot;
      const T* v = row + (p.H + p.Hkv + h) * D;
      if (p.k_scale == nullptr) {
        rope_head(row + (p.H + h) * D, c, s, static_cast<T*>(p.k_cache) + at * D, D);
        std::memcpy(static_cast<T*>(p.v_cache) + at * D, v, D * sizeof(T));
        continue;
      }
      T k[kMaxHeadDim];  // the rotated key as a cache of the activations' type would hold it
      rope_head(row + (p.H + h) * D, c, s, k, D);
      quantize_row_q8(k, D, static_cast<int8_t*>(p.k_cache) + at * D, p.k_scale + at);
      quantize_row_q8(v, D, static_cast<int8_t*>(p.v_cache) + at * D, p.v_scale + at);
    }
  }
}

MET_TYPED_ENTRIES(rope_rows, rope_rows_impl, (const RopeProblem& p, int64_t r0, int64_t r1),
                  (p, r0, r1))

at::Tensor rope_qkv_to_cache(const at::Tensor& qkv, const at::Tensor& positions,
                             const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                             at::Tensor v_cache, const at::Tensor& slots, int64_t num_heads,
                             int64_t num_kv_heads, const std::optional<at::Tensor>& k_scale,
                             const std::optional<at::Tensor>& v_scale) {
  check_rows(qkv, "rope_qkv_to_cache", "qkv");
  const int64_t T = qkv.size(0);
  const bool q8 = k_scale.has_value();
  const auto cache_type = q8 ? at::kChar : qkv.scalar_type();
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == cache_type && v_cache.scalar_type() == cache_type &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "rope_qkv_to_cache: caches must be contiguous [Hkv, S, D] tensors of qkv's "
              "dtype (or int8 with scales)");
  const int64_t Hkv = k_cache.size(0), S = k_cache.size(1), D = k_cache.size(2);
  TORCH_CHECK(q8 == v_scale.has_value(), "rope_qkv_to_cache: pass both scales or neither");
  if (q8) {
    for (const at::Tensor* sc : {&*k_scale, &*v_scale}) {
      TORCH_CHECK(sc->scalar_type() == at::kFloat && sc->is_contiguous() && sc->dim() == 2 &&
                      sc->size(0) == Hkv && sc->size(1) == S,
                  "rope_qkv_to_cache: scales must be contiguous float32 [Hkv, S]");
    }
    TORCH_CHECK(D <= kMaxHeadDim, "rope_qkv_to_cache: an int8 cache takes head_dim <= ",
                kMaxHeadDim);
  }
  TORCH_CHECK(Hkv == num_kv_heads && num_heads > 0 && D % 2 == 0 &&
                  qkv.size(1) == (num_heads + 2 * num_kv_heads) * D,
              "rope_qkv_to_cache: qkv width, heads and (even) head_dim disagree");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.sizes() == sin.sizes() && cos.size(1) == D,
              "rope_qkv_to_cache: cos/sin must be contiguous float32 [positions, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slots.is_contiguous() &&
                  positions.numel() == T && slots.numel() == T,
              "rope_qkv_to_cache: positions and slots must be contiguous long [T] tensors");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rope_qkv_to_cache: position ", pos[t],
                " outside the rope table");
    TORCH_CHECK(sl[t] >= 0 && sl[t] < S, "rope_qkv_to_cache: slot ", sl[t],
                " outside the cache");
  }
  at::Tensor q = at::empty({T, num_heads, D}, qkv.options());
  const RopeProblem p{qkv.data_ptr(),
                      pos,
                      cos.data_ptr<float>(),
                      sin.data_ptr<float>(),
                      k_cache.data_ptr(),
                      v_cache.data_ptr(),
                      q8 ? k_scale->data_ptr<float>() : nullptr,
                      q8 ? v_scale->data_ptr<float>() : nullptr,
                      sl,
                      q.data_ptr(),
                      num_heads,
                      Hkv,
                      D,
                      S};
  const bool f32 = qkv.scalar_type() == at::kFloat;
  at::parallel_for(0, T, grain_rows(qkv.size(1)), [&](int64_t b, int64_t e) {
    MET_CALL_TYPED(f32, rope_rows, p, b, e);
  });
  return q;
}

}  // namespace

TORCH_LIBRARY(MET_OP_NAMESPACE, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)",
        &add_rms_norm);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  m.def(
      "rope_qkv_to_cache(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, int num_heads, "
      "int num_kv_heads, Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> Tensor",
      &rope_qkv_to_cache);
}
