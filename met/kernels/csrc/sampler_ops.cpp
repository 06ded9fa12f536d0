// Sampler ops over float32 logits on CPU: the greedy argmax and top-p's threshold and cut.
// Batch invariance: every row is computed alone, in a fixed order, whatever the number
// of rows or threads.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "met_rows.h"

namespace {

// ---- greedy argmax over float32 logits ----------------------------------------------------

// Rows [r0, r1) of [T, V]: the index of each row's maximum, the first one on ties, a NaN
// counting as the maximum (what torch.argmax returns).
template <typename VF, typename VI>
MET_INLINE void argmax_rows_t(const float* x, int64_t* out, int64_t r0, int64_t r1, int64_t V) {
  constexpr int64_t kW = sizeof(VF) / sizeof(float);
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = x + r * V;
    VF best = -INFINITY - VF{};
    VI nan_seen = {};
    int64_t v = 0;
    for (; v + kW <= V; v += kW) {
      VF chunk;
      std::memcpy(&chunk, row + v, sizeof(chunk));
      nan_seen |= chunk != chunk;
      best = chunk > best ? chunk : best;
    }
    float m = -INFINITY;
    float lanes[kW];
    std::memcpy(lanes, &best, sizeof(lanes));
    for (int l = 0; l < kW; ++l) m = std::max(m, lanes[l]);
    bool nan = false;
    for (int l = 0; l < kW; ++l) nan |= nan_seen[l] != 0;
    for (int64_t t = v; t < V; ++t) {
      nan |= std::isnan(row[t]);
      m = std::max(m, row[t]);
    }
    int64_t idx = 0;
    if (nan) {
      while (!std::isnan(row[idx])) ++idx;
    } else {
      while (row[idx] != m) ++idx;  // m is one of the row's values: the scan stops
    }
    out[r] = idx;
  }
}

MET_CLONES void argmax_rows(const float* x, int64_t* out, int64_t r0, int64_t r1, int64_t V) {
  if (kWideVectors) {
    argmax_rows_t<vfloat, vint>(x, out, r0, r1, V);
  } else {
    argmax_rows_t<vfloat8, vint8>(x, out, r0, r1, V);
  }
}

at::Tensor argmax_last(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0,
              "argmax: logits must be a contiguous non-empty 2-D float32 CPU tensor");
  const int64_t T = logits.size(0), V = logits.size(1);
  at::Tensor out = at::empty({T}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, T, grain_rows(V), [&](int64_t b, int64_t e) { argmax_rows(x, o, b, e, V); });
  return out;
}

// ---- top-p (nucleus) threshold ------------------------------------------------------------

// The top-p cut among buf (every value whose tokens are still undecided), `above` the mass of
// the tokens above all of them (< top_p): the smallest v in buf with above + mass(buf > v) <
// top_p, by a weighted quickselect (three-way partitions, masses in double), or the
// smallest value when even all of buf stays under top_p.
float top_p_select(std::vector<float>& buf, double above, double top_p) {
  int64_t lo = 0, hi = static_cast<int64_t>(buf.size());
  while (hi - lo > 1) {
    const float pivot = buf[lo + (hi - lo) / 2];
    // Three-way partition of buf[lo, hi): > pivot, == pivot, < pivot.
    int64_t gt = lo, lt = hi;
    double mass_gt = 0.0, mass_eq = 0.0;
    for (int64_t i = lo; i < lt;) {
      const float v = buf[i];
      if (v > pivot) {
        mass_gt += v;
        std::swap(buf[i++], buf[gt++]);
      } else if (v == pivot) {
        mass_eq += v;
        ++i;
      } else {
        std::swap(buf[i], buf[--lt]);
      }
    }
    if (above + mass_gt >= top_p) {  // the pivot's tokens are dropped: the cut is higher
      hi = gt;
    } else if (above + mass_gt + mass_eq >= top_p || lt == hi) {
      return pivot;  // kept, and every smaller value is dropped (or there is none)
    } else {
      above += mass_gt + mass_eq;
      lo = lt;
    }
  }
  return buf[lo];
}

// Row p [V] of probabilities (>= 0): the smallest value top-p sampling keeps, t = min{v :
// mass of the tokens with p > v < top_p} (a token is dropped once the more likely ones hold
// top_p; ties with the last kept token stay). One pass sums the mass per bucket of the
// values' top bits (exponent and 5 mantissa bits: monotone for floats >= 0), from the top
// down to the bucket where the mass reaches top_p; only that bucket's values (a 32nd of an
// octave) go through the quickselect: O(V) with small constants instead of a sort. A NaN
// keeps everything (0); negative values are no probabilities and count as tiny ones.
constexpr int kTopPBucketShift = 18;

inline uint32_t top_p_bucket(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits >> kTopPBucketShift;
}

constexpr int64_t kTopPBuckets = int64_t{1} << (31 - kTopPBucketShift);
constexpr float kSmallestFloat = std::numeric_limits<float>::denorm_min();

// Bit i % 64 of flags[i / 64] = whether value i of row p [V] is not below floor (a NaN
// counts), so that the passes after it touch only those values: on AVX2 one compare and one
// movemask per eight values.
#if defined(__x86_64__)
__attribute__((target("avx2"))) void top_p_flags_avx2(const float* p, int64_t words,
                                                       float floor, uint64_t* flags) {
  const __m256 f = _mm256_set1_ps(floor);
  for (int64_t w = 0; w < words; ++w) {
    uint64_t word = 0;
    for (int k = 0; k < 8; ++k) {
      const __m256 v = _mm256_loadu_ps(p + 64 * w + 8 * k);
      word |= static_cast<uint64_t>(_mm256_movemask_ps(_mm256_cmp_ps(v, f, _CMP_NLT_UQ)))
              << (8 * k);
    }
    flags[w] = word;
  }
}
const bool kTopPFlagsAvx2 = MET_CPU_HAS("avx2");
#endif

void top_p_flags(const float* p, int64_t V, float floor, uint64_t* flags) {
  int64_t w = 0;
#if defined(__x86_64__)
  if (kTopPFlagsAvx2) {
    top_p_flags_avx2(p, V / 64, floor, flags);
    w = V / 64;
  }
#endif
  for (; 64 * w < V; ++w) {
    uint64_t word = 0;
    for (int64_t j = 0; j < 64 && 64 * w + j < V; ++j) {
      word |= static_cast<uint64_t>(!(p[64 * w + j] < floor)) << j;
    }
    flags[w] = word;
  }
}

// A thread's scratch for the search: the mass per bucket, the cut bucket's values, the flags.
struct TopPScratch {
  std::vector<double> mass;
  std::vector<float> buf;
  std::vector<uint64_t> flags;
};

// f(i) for each flagged value i, in order, while f returns true.
template <typename F>
MET_INLINE bool for_flagged(const std::vector<uint64_t>& flags, F&& f) {
  for (int64_t w = 0; w < static_cast<int64_t>(flags.size()); ++w) {
    for (uint64_t m = flags[w]; m != 0; m &= m - 1) {
      if (!f(64 * w + __builtin_ctzll(m))) return false;
    }
  }
  return true;
}

// The search over the values >= floor only (floor: the smallest positive float for every
// value with mass; zeros, -0 and negative values never count). Those are counted whole, so
// the masses of the buckets above floor's are exact, and the result is the search over every
// value whenever it comes out >= floor (only values below a cut decide about it); it is
// discarded (false) otherwise. A peaked row's long tail of tiny probabilities, most of it,
// is then never summed.
bool top_p_search(const float* p, int64_t V, double top_p, float floor, TopPScratch& scratch,
                  float* cut) {
  std::vector<double>& mass = scratch.mass;
  std::vector<float>& buf = scratch.buf;
  mass.assign(kTopPBuckets, 0.0);
  scratch.flags.resize((V + 63) / 64);
  top_p_flags(p, V, floor, scratch.flags.data());
  uint32_t largest = 0;  // the largest value's bits (monotone for floats >= 0)
  const bool probabilities = for_flagged(scratch.flags, [&](int64_t i) {
    const float v = p[i];
    if (std::isnan(v)) return false;  // (values below floor, negative ones too, are not here)
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    bits &= 0x7FFFFFFFu;  // (a -0 where denormals read as zero: the buckets are for v >= 0)
    mass[bits >> kTopPBucketShift] += v;
    largest = std::max(largest, bits);
    return true;
  });
  if (!probabilities) {
    *cut = 0.0f;  // everything stays
    return true;
  }
  double above = 0.0;
  int64_t bucket = largest >> kTopPBucketShift;  // the buckets above it are empty
  for (; bucket > 0 && above + mass[bucket] < top_p; --bucket) above += mass[bucket];
  buf.clear();
  for_flagged(scratch.flags, [&](int64_t i) {
    if (static_cast<int64_t>(top_p_bucket(p[i])) == bucket) buf.push_back(p[i]);
    return true;
  });
  *cut = buf.empty() ? 0.0f : top_p_select(buf, above, top_p);
  return floor == kSmallestFloat || (!buf.empty() && *cut >= floor);
}

// In a normalized row the values below (1 - top_p) / 2V hold at most (1 - top_p) / 2, so the
// cut is among the larger ones: the search skips the long tail of tiny probabilities a
// peaked row has, and searches every value again when the cut came out below that (a row
// that sums short).
float top_p_threshold_row(const float* p, int64_t V, double top_p, TopPScratch& scratch) {
  float cut = 0.0f;
  const float floor = static_cast<float>((1.0 - top_p) / (2.0 * static_cast<double>(V)));
  if (!top_p_search(p, V, top_p, std::max(floor, kSmallestFloat), scratch, &cut)) {
    top_p_search(p, V, top_p, kSmallestFloat, scratch, &cut);
  }
  return cut;
}

// Each row's threshold into out[r]; with `cut` (p itself, or null), the row's values below it
// set to 0 too, while the row is in cache (a separate masked fill would read it again).
void top_p_rows(const float* p, const double* tp, float* out, int64_t T, int64_t V, float* cut) {
  at::parallel_for(0, T, 1, [&](int64_t b, int64_t e) {
    TopPScratch scratch;
    for (int64_t r = b; r < e; ++r) {
      const float t = top_p_threshold_row(p + r * V, V, tp[r], scratch);
      out[r] = t;
      if (cut != nullptr) {
        float* row = cut + r * V;
        for (int64_t i = 0; i < V; ++i) row[i] = row[i] < t ? 0.0f : row[i];
      }
    }
  });
}

// The two ops' checks and call: the thresholds, and with `cut` the rows cut in place.
at::Tensor top_p_op(const char* op, const at::Tensor& probs, const at::Tensor& top_p, bool cut) {
  TORCH_CHECK(probs.device().is_cpu() && probs.scalar_type() == at::kFloat && probs.dim() == 2 &&
                  probs.is_contiguous() && probs.size(1) > 0,
              op, ": probs must be a contiguous non-empty 2-D float32 CPU tensor");
  TORCH_CHECK(top_p.device().is_cpu() && top_p.scalar_type() == at::kDouble &&
                  top_p.is_contiguous() && top_p.numel() == probs.size(0),
              op, ": top_p must be a contiguous float64 CPU tensor, one per row");
  at::Tensor out = at::empty({probs.size(0)}, probs.options());
  float* p = probs.data_ptr<float>();
  top_p_rows(p, top_p.data_ptr<double>(), out.data_ptr<float>(), probs.size(0), probs.size(1),
             cut ? p : nullptr);
  return out;
}

at::Tensor top_p_threshold(const at::Tensor& probs, const at::Tensor& top_p) {
  return top_p_op("top_p_threshold", probs, top_p, false);
}

at::Tensor top_p_cut_(const at::Tensor& probs, const at::Tensor& top_p) {
  return top_p_op("top_p_cut_", probs, top_p, true);
}

}  // namespace

TORCH_LIBRARY(MET_OP_NAMESPACE, m) {
  m.def("argmax(Tensor logits) -> Tensor", &argmax_last);
  m.def("top_p_threshold(Tensor probs, Tensor top_p) -> Tensor", &top_p_threshold);
  m.def("top_p_cut_(Tensor(a!) probs, Tensor top_p) -> Tensor", &top_p_cut_);
}
