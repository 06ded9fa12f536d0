// Paged decode attention, the op: decode_attention(q, k_cache, v_cache, slots, offsets,
// scale[, k_scale, v_scale]) checks its arguments, cuts long contexts into chunks, runs one
// task per (chunk, kv head) under at::parallel_for on the path the cache and the CPU call
// for, merges split contexts, and registers the op (the one TORCH_LIBRARY block of the
// extension). The paths are in their own files (see decode_attention.h, which also holds
// what they share); this is the only file that needs ATen.
//
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

#include "decode_attention.h"

namespace met_decode_attention {
namespace {

// Per-thread scratch, in floats.
MET_INLINE size_t workspace_floats(int64_t G, int64_t Dp, int64_t max_len) {
  const int64_t Lp = (max_len + kLanes - 1) / kLanes * kLanes;
  return static_cast<size_t>(2 * G * Dp + kLanes * Dp + G * Lp);
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

// The element order of an int8 task's float32 rows (queries, partial sums for merge_one).
MET_INLINE int int8_order() { return kInt8Avx2 ? kNaturalOrder : kQuadOrder; }

// Tasks begin..end-1 on the path this call takes: the same for every task, chosen by the
// cache (dtype, layout) and, for int8 caches, the CPU (kInt8Avx2).
void attend_range(const Problem& p, bool is_f32, int64_t begin, int64_t end, float* ws) {
  if (p.k_scale != nullptr && kInt8Avx2) {
    is_f32 ? attend_range_int8_avx2_f32(p, begin, end, ws)
           : attend_range_int8_avx2_bf16(p, begin, end, ws);
  } else if (p.k_scale != nullptr || p.fast) {
    is_f32 ? attend_range_blocked_f32(p, begin, end, ws)
           : attend_range_blocked_bf16(p, begin, end, ws);
  } else {
    is_f32 ? attend_range_tile_f32(p, begin, end, ws) : attend_range_tile_bf16(p, begin, end, ws);
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
    with_scratch([&](float* ws) { attend_range(p, is_f32, begin, end, ws); });
  });
  if (num_chunks > N) {  // then the split requests' chunks are combined, in chunk order
    at::parallel_for(0, N * Hkv, 1, [&](int64_t begin, int64_t end) {
      with_scratch([&](float* ws) { merge_range(p, is_f32, begin, end, ws); });
    });
  }
  return out;
}


}  // namespace
}  // namespace met_decode_attention

TORCH_LIBRARY(MET_OP_NAMESPACE, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, "
      "Tensor offsets, float scale, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor",
      &met_decode_attention::decode_attention);
}
