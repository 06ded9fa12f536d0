// The LoRA delta of a step's rows, each row with its own adapter slot (the BGMV shape):
// y[m] += (x[m] A_s^T) B_s^T for s = slots[m], skipped where s < 0 (the base model alone).
//
// Batch invariance: every row is computed alone, its shrink and expand summed in float32 in
// one fixed order, so a row's result is the same whichever rows, adapters or threads share
// its step (seeded sampling with mixed adapters stays reproducible). Rows of one slot are
// taken up to kTile at a time so that each loaded vector of A and B serves several rows; the
// tile changes how often the matrices are read, never the order of any row's sums.

#include "met_rows.h"

#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int kTile = 4;  // rows sharing one pass over their slot's matrices

template <typename T>
MET_INLINE vfloat load_row(const T* p, int64_t n);

template <>
MET_INLINE vfloat load_row<float>(const float* p, int64_t n) {
  return load_f32_n(p, n);
}

template <>
MET_INLINE vfloat load_row<uint16_t>(const uint16_t* p, int64_t n) {
  return load_bf16_n(p, n);
}

// y[0..n) += v, rounded once into y's type.
template <typename T>
MET_INLINE void add_into(T* y, vfloat v, int64_t n) {
  const vfloat sum = load_row<T>(y, n) + v;
  if constexpr (std::is_same_v<T, float>) {
    store_f32_n(y, sum, n);
  } else {
    store_bf16_n(y, sum, n);
  }
}

// y[rows[i]] += sum_r t[i][r] bt[r], r ascending, in float32.
template <typename T, typename W, int NR>
MET_INLINE void expand(T* y, const W* bt, const int64_t* rows, int64_t R, int64_t N,
                       const float* t) {
  for (int64_t n0 = 0; n0 < N; n0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, N - n0);
    vfloat acc[NR];
    for (int i = 0; i < NR; ++i) acc[i] = vfloat{};
    for (int64_t r = 0; r < R; ++r) {
      const vfloat bv = load_row<W>(bt + r * N + n0, n);
      for (int i = 0; i < NR; ++i) acc[i] += MET_SPLAT(t[i * R + r]) * bv;
    }
    for (int i = 0; i < NR; ++i) add_into(y + rows[i] * N + n0, acc[i], n);
  }
}

#if defined(__x86_64__)
// bfloat16 rows times bfloat16 A on CPUs with AVX512-BF16: VDPBF16PS multiplies 32 pairs
// exactly and adds them into float32 lanes, half the instructions of widening both first.
// Chosen once per process (kDotBF16), so every row of a machine sums in the same order.
const bool kDotBF16 = met_cpu::avx512_bf16() && met_cpu::avx512();

template <int NR>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void shrink_bf16(
    const uint16_t* x, const uint16_t* a, const int64_t* rows, int64_t K, int64_t R,
    float* t) {
  for (int64_t r = 0; r < R; ++r) {
    __m512 acc[NR];
    for (int i = 0; i < NR; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      const int64_t n = std::min<int64_t>(32, K - k);
      const __mmask32 m = n == 32 ? ~__mmask32{0} : (__mmask32{1} << n) - 1;
      const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(m, a + r * K + k);
      for (int i = 0; i < NR; ++i) {
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + rows[i] * K + k);
        acc[i] = _mm512_dpbf16_ps(acc[i], xv, av);
      }
    }
    for (int i = 0; i < NR; ++i) t[i * R + r] = _mm512_reduce_add_ps(acc[i]);
  }
}
#endif

// rows[0..nr) all run slot `a`/`bt` (W: float32, or bfloat16 bits for a bfloat16 model: half
// the bytes, which matters: eight rank-16 adapters on every projection outweigh a 4-bit base).
// t[i][r] = x[rows[i]] . a[r], then y[rows[i]] += sum_r t[i][r] bt[r]: float32 sums, k and r
// ascending, one rounding into y. xf: the rows widened to float32 once ([NR][K]).
template <typename T, typename W, int NR>
MET_INLINE void tile_rows(const T* x, T* y, const W* a, const W* bt, const int64_t* rows,
                          int64_t K, int64_t R, int64_t N, float* t, float* xf) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, uint16_t> && std::is_same_v<W, uint16_t>) {
    if (kDotBF16) {
      shrink_bf16<NR>(x, a, rows, K, R, t);
      expand<T, W, NR>(y, bt, rows, R, N, t);
      return;
    }
  }
#endif
  for (int i = 0; i < NR; ++i) {
    for (int64_t k = 0; k < K; k += kLanes) {
      const int64_t n = std::min<int64_t>(kLanes, K - k);
      store_f32_n(xf + i * K + k, load_row<T>(x + rows[i] * K + k, n), n);
    }
  }
  // Four ranks at a time: each loaded vector of x serves four, each of A serves NR rows.
  constexpr int RB = 4;
  int64_t r = 0;
  for (; r + RB <= R; r += RB) {
    vfloat acc[RB][NR];
    for (int j = 0; j < RB; ++j)
      for (int i = 0; i < NR; ++i) acc[j][i] = vfloat{};
    for (int64_t k = 0; k < K; k += kLanes) {
      const int64_t n = std::min<int64_t>(kLanes, K - k);
      vfloat xv[NR];
      for (int i = 0; i < NR; ++i) xv[i] = load_f32_n(xf + i * K + k, n);
      for (int j = 0; j < RB; ++j) {
        const vfloat av = load_row<W>(a + (r + j) * K + k, n);
        for (int i = 0; i < NR; ++i) acc[j][i] += xv[i] * av;
      }
    }
    for (int j = 0; j < RB; ++j)
      for (int i = 0; i < NR; ++i) t[i * R + r + j] = hsum(acc[j][i]);
  }
  for (; r < R; ++r) {
    vfloat acc[NR];
    for (int i = 0; i < NR; ++i) acc[i] = vfloat{};
    for (int64_t k = 0; k < K; k += kLanes) {
      const int64_t n = std::min<int64_t>(kLanes, K - k);
      const vfloat av = load_row<W>(a + r * K + k, n);
      for (int i = 0; i < NR; ++i) acc[i] += load_f32_n(xf + i * K + k, n) * av;
    }
    for (int i = 0; i < NR; ++i) t[i * R + r] = hsum(acc[i]);
  }
  expand<T, W, NR>(y, bt, rows, R, N, t);
}

template <typename W>
MET_INLINE void prefetch(const W* p, int64_t count) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < count * static_cast<int64_t>(sizeof(W)); off += 64) {
    __builtin_prefetch(c + off, 0, 2);
  }
}

// Tiles [b, e) of `order` (rows sorted by slot, starts[j] the first row of tile j).
template <typename T, typename W>
MET_CLONES void lora_tiles(const T* x, T* y, const W* a, const W* bt,
                           const int32_t* slots, const int64_t* order, const int64_t* starts,
                           int64_t tb, int64_t te, int64_t K, int64_t R, int64_t N) {
  std::vector<float> t(static_cast<size_t>(kTile * R));
  std::vector<float> xf(static_cast<size_t>(kTile * K));
  for (int64_t j = tb; j < te; ++j) {
    const int64_t* rows = order + starts[j];
    const int64_t nr = starts[j + 1] - starts[j];
    const int64_t s = slots[rows[0]];
    const W* as = a + s * R * K;
    const W* bs = bt + s * R * N;
    // Ask for this tile's B and the next tile's A now: they stream in from memory while the
    // shrink computes (the step reads every slot's matrices once, so little is in cache).
    prefetch(bs, R * N);
    if (j + 1 < te) prefetch(a + slots[order[starts[j + 1]]] * R * K, R * K);
    switch (nr) {
      case 1: tile_rows<T, W, 1>(x, y, as, bs, rows, K, R, N, t.data(), xf.data()); break;
      case 2: tile_rows<T, W, 2>(x, y, as, bs, rows, K, R, N, t.data(), xf.data()); break;
      case 3: tile_rows<T, W, 3>(x, y, as, bs, rows, K, R, N, t.data(), xf.data()); break;
      default: tile_rows<T, W, 4>(x, y, as, bs, rows, K, R, N, t.data(), xf.data()); break;
    }
  }
}

// y [M, N] (float32 or bfloat16, in place) += each row's delta; x [M, K] of y's dtype;
// a [S, R, K] and bt [S, R, N] float32 or bfloat16 (both alike); slots int32 [M] (-1: none).
void lora_add_(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
               const at::Tensor& bt, const at::Tensor& slots) {
  TORCH_CHECK(y.device().is_cpu() && y.dim() == 2 && y.is_contiguous() &&
                  (y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16),
              "lora_add_: y must be a contiguous 2-D float32 or bfloat16 CPU tensor");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == y.scalar_type() &&
                  x.size(0) == y.size(0),
              "lora_add_: x must be contiguous [M, K] of y's dtype");
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3 && a.is_contiguous() && bt.is_contiguous() &&
                  (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16) &&
                  bt.scalar_type() == a.scalar_type() &&
                  a.size(0) == bt.size(0) && a.size(1) == bt.size(1) &&
                  a.size(2) == x.size(1) && bt.size(2) == y.size(1),
              "lora_add_: a [S, R, K] and bt [S, R, N] must be contiguous, float32 or "
              "bfloat16 alike");
  TORCH_CHECK(slots.scalar_type() == at::kInt && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.numel() == y.size(0),
              "lora_add_: slots must be int32, one per row");
  const int64_t M = y.size(0), K = x.size(1), N = y.size(1), R = a.size(1), S = a.size(0);
  const int32_t* sl = slots.data_ptr<int32_t>();
  // Rows grouped by slot in ascending row order, cut into tiles of up to kTile rows.
  std::vector<int64_t> order, starts;
  order.reserve(M);
  for (int64_t s = 0; s < S; ++s) {
    int64_t in_tile = 0;
    for (int64_t m = 0; m < M; ++m) {
      if (sl[m] != s) continue;
      if (in_tile % kTile == 0) starts.push_back(static_cast<int64_t>(order.size()));
      order.push_back(m);
      ++in_tile;
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(sl[m] < S, "lora_add_: row ", m, " names slot ", sl[m], " of ", S);
  }
  const int64_t tiles = static_cast<int64_t>(starts.size());
  if (tiles == 0) return;
  starts.push_back(static_cast<int64_t>(order.size()));
  const bool wide = a.scalar_type() == at::kFloat;
  const void* ap = a.data_ptr();
  const void* bp = bt.data_ptr();
  at::parallel_for(0, tiles, 1, [&](int64_t b, int64_t e) {
    auto run = [&](auto* xp, auto* yp) {
      if (wide) {
        lora_tiles(xp, yp, static_cast<const float*>(ap), static_cast<const float*>(bp), sl,
                   order.data(), starts.data(), b, e, K, R, N);
      } else {
        lora_tiles(xp, yp, static_cast<const uint16_t*>(ap), static_cast<const uint16_t*>(bp),
                   sl, order.data(), starts.data(), b, e, K, R, N);
      }
    };
    if (y.scalar_type() == at::kFloat) {
      run(x.data_ptr<float>(), y.data_ptr<float>());
    } else {
      run(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
          reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
    }
  });
}

}  // namespace

TORCH_LIBRARY(MET_OP_NAMESPACE, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor a, Tensor bt, Tensor slots) -> ()",
        &lora_add_);
}
