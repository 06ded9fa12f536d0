// Causal attention of prompt rows on AMX-BF16 tiles (met/kernels/prompt_attention.py).
//
// A task is sixteen consecutive query rows of one prompt chunk and one query head. Its
// scores S = Q Kᵀ come from TDPBF16PS tiles (16 rows × 16 keys, bfloat16 products summed in
// float32), its softmax runs on the vector units in float32, and its output P V comes from
// tiles again, each probability split into two bfloat16 parts (p ≈ hi + lo, ~16 bits) so
// that the weights lose next to nothing to the bfloat16 operands.
//
// Batch invariance: a tile's rows are independent (element [r][n] of a TDPBF16PS result
// reads row r of A and column n of B only), keys are taken in fixed 16- and 32-key tiles
// counted from the context's first key, and a key past a row's own position gets weight
// zero, which adds exactly nothing to the row's sums. So a row's output is a function of its
// query and its context alone: the same bits whatever other rows share its tile, however its
// prompt was chunked, and whether its prefix came from the prefix cache.
//
// Each (chunk, kv head)'s keys and values are staged once for all its query rows: keys as B
// tiles of 16 dimension pairs × 16 keys (one 32-bit word per key and pair), values as B tiles
// of 16 key pairs × 16 dimensions; keys past the context are zero.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "met_cpu.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kRows = 16;      // query rows per task: a tile's rows
constexpr int64_t kKeys = 16;      // keys per score tile
constexpr int64_t kPairKeys = 32;  // keys per value tile (16 pairs); contexts pad to this

// AMX-BF16 and AVX512-BF16 present and the tile registers usable by this process.
bool supported() { return met_cpu::amx_bf16(); }

// One prompt chunk: its query rows are rows q_start .. q_start + q_len of q, the last q_len
// positions of a context of ctx_len keys whose cache slots are slots[slot_start ..].
struct Chunk {
  int64_t q_start, q_len, ctx_len, slot_start;
};

struct Problem {
  const uint16_t* q;  // [P, H, D] bfloat16, element strides q_s0, q_s1, 1
  int64_t q_s0, q_s1;
  const uint16_t* k;  // [Hkv, S, D] bfloat16, element strides k_s0, k_s1, 1
  int64_t k_s0, k_s1;
  const uint16_t* v;
  int64_t v_s0, v_s1;
  const int64_t* slots;
  const Chunk* chunks;
  uint16_t* out;  // [P, H, D], contiguous
  int64_t H, Hkv, D;
  float scale;
  uint32_t* stage;          // staged keys and values (see staged)
  const int64_t* stage_at;  // per chunk: words of `stage` before its first kv head's
};

// A context's keys padded to whole value tiles.
inline int64_t padded_len(int64_t L) { return (L + kPairKeys - 1) / kPairKeys * kPairKeys; }

// Words of staged keys (and as many of values) of one kv head of a chunk.
inline int64_t stage_words(int64_t L, int64_t D) { return padded_len(L) * D / 2; }

// Chunk c's staged keys for kv head g; its values follow them.
inline uint32_t* staged(const Problem& p, int64_t c, int64_t g) {
  return p.stage + p.stage_at[c] + g * 2 * stage_words(p.chunks[c].ctx_len, p.D);
}

#if defined(__x86_64__)
#define MET_AMX_TARGET                                                                      \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16")))

// Transposes a 16 × 16 matrix of 32-bit words held as 16 rows: w[c] becomes column c.
MET_AMX_TARGET inline void transpose16(__m512i* w) {
  __m512i t[16], u[16];
  for (int k = 0; k < 8; ++k) {  // 128-bit lane l: words 4l + 0, 1 (lo) or 2, 3 (hi) of 2 rows
    t[2 * k] = _mm512_unpacklo_epi32(w[2 * k], w[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(w[2 * k], w[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // u[4k + m], lane l: column 4l + m of rows 4k .. 4k + 3
    u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // gather lane l of u[m], u[4 + m], u[8 + m], u[12 + m]
    const __m512i v0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88);  // lanes 0, 2
    const __m512i v1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xdd);  // lanes 1, 3
    const __m512i x0 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88);
    const __m512i x1 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xdd);
    w[m] = _mm512_shuffle_i32x4(v0, x0, 0x88);
    w[8 + m] = _mm512_shuffle_i32x4(v0, x0, 0xdd);
    w[4 + m] = _mm512_shuffle_i32x4(v1, x1, 0x88);
    w[12 + m] = _mm512_shuffle_i32x4(v1, x1, 0xdd);
  }
}

// Keys of chunk c, kv head g: keys[(t * D / 2 + i) * 16 + j] holds dimensions 2 i, 2 i + 1 of
// key 16 t + j, so 16 consecutive i of a 16-key tile t are one B tile (rows 64 bytes apart).
// Values: values[kp * D + d] holds dimension d of keys 2 kp (low half) and 2 kp + 1.
MET_AMX_TARGET void stage(const Problem& p, int64_t c, int64_t g) {
  const Chunk& ch = p.chunks[c];
  const int64_t L = ch.ctx_len, Lp = padded_len(L), D = p.D, pairs = D / 2;
  uint32_t* keys = staged(p, c, g);
  uint32_t* values = keys + stage_words(L, D);
  const int64_t* slots = p.slots + ch.slot_start;
  const uint16_t* kg = p.k + g * p.k_s0;
  const uint16_t* vg = p.v + g * p.v_s0;
  // 16 keys × 16 dimension pairs at a time: rows in, transposed, out as one B tile.
  for (int64_t t = 0; t < Lp / kKeys; ++t)
    for (int64_t i0 = 0; i0 < pairs; i0 += 16) {
      __m512i w[16];
      for (int64_t j = 0; j < kKeys; ++j) {
        const int64_t key = t * kKeys + j;
        w[j] = key < L ? _mm512_loadu_si512(kg + slots[key] * p.k_s1 + 2 * i0)
                       : _mm512_setzero_si512();
      }
      transpose16(w);
      uint32_t* dst = keys + (t * pairs + i0) * kKeys;
      for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * kKeys, w[i]);
    }
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t kp = 0; kp < Lp / 2; ++kp) {
    const int64_t a = 2 * kp, b = a + 1;
    const uint16_t* ra = a < L ? vg + slots[a] * p.v_s1 : nullptr;
    const uint16_t* rb = b < L ? vg + slots[b] * p.v_s1 : nullptr;
    for (int64_t d = 0; d < D; d += 16) {
      const __m256i lo = ra ? _mm256_loadu_si256((const __m256i*)(ra + d)) : zero;
      const __m256i hi = rb ? _mm256_loadu_si256((const __m256i*)(rb + d)) : zero;
      const __m512i w = _mm512_or_si512(_mm512_cvtepu16_epi32(lo),
                                        _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
      _mm512_storeu_si512(values + kp * D + d, w);
    }
  }
}

// exp(x) for x <= 0, sixteen at a time: Cephes' expf polynomial (about 1 ulp), as in the
// decode kernel. Inputs below -87 are clamped so that 2^n stays a normal float.
MET_AMX_TARGET inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  // n = round(x / ln2): x <= 0, so truncating (y - 0.5) towards zero rounds to nearest.
  const __m512i n = _mm512_cvttps_epi32(
      _mm512_fmsub_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)));
  const __m512 fn = _mm512_cvtepi32_ps(n);
  __m512 r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_fmadd_ps(r, _mm512_set1_ps(1.9875691500e-4f), _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

MET_AMX_TARGET inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

// Every tile 16 rows × 64 bytes. Scores: tile 0 (C), 4 (A: queries), 6 (B: keys). Output:
// tiles 0-3 (C: 16 dimensions each), 4 and 5 (A: the weights' hi and lo parts), 6 (B: values).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Per-thread buffers, grown as needed and kept between calls.
struct Scratch {
  std::vector<uint16_t> q;       // [16, D]: the task's queries
  std::vector<float> scores;     // [16, Lp]
  std::vector<uint16_t> hi, lo;  // [16, Lp]: the weights' two bfloat16 parts
};

#define MET_PV_TILE(j)                                                  \
  if (nc > j) {                                                         \
    _tile_loadd(6, vals + (j) * kKeys, D * 4);                          \
    _tile_dpbf16ps(j, 4, 6);                                            \
    _tile_dpbf16ps(j, 5, 6);                                            \
  }

// Rows r0 .. r0 + 16 of chunk c, query head h.
MET_AMX_TARGET void attend_rows(const Problem& p, int64_t c, int64_t h, int64_t r0,
                                Scratch& ws) {
  const Chunk& ch = p.chunks[c];
  const int64_t D = p.D, pairs = D / 2, g = h / (p.H / p.Hkv);
  const int64_t rows = std::min(kRows, ch.q_len - r0);
  const int64_t pos0 = ch.ctx_len - ch.q_len + r0;  // position of row r0
  const int64_t L = pos0 + rows;                      // keys the last row sees
  const int64_t Lp = padded_len(L);
  const uint32_t* keys = staged(p, c, g);
  const uint32_t* values = keys + stage_words(ch.ctx_len, D);
  ws.q.resize(std::max<size_t>(ws.q.size(), kRows * D));
  ws.scores.resize(std::max<size_t>(ws.scores.size(), kRows * Lp));
  ws.hi.resize(std::max<size_t>(ws.hi.size(), kRows * Lp));
  ws.lo.resize(std::max<size_t>(ws.lo.size(), kRows * Lp));
  uint16_t* q = ws.q.data();
  float* s = ws.scores.data();
  for (int64_t r = 0; r < kRows; ++r) {
    if (r < rows) {
      std::memcpy(q + r * D, p.q + (ch.q_start + r0 + r) * p.q_s0 + h * p.q_s1, D * 2);
    } else {
      std::memset(q + r * D, 0, D * 2);
    }
  }
  for (int64_t t = 0; t * kKeys < L; ++t) {
    _tile_zero(0);
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      _tile_loadd(4, q + d0, D * 2);
      _tile_loadd(6, keys + (t * pairs + d0 / 2) * kKeys, 64);
      _tile_dpbf16ps(0, 4, 6);
    }
    _tile_stored(0, s + t * kKeys, Lp * 4);
  }
  // Softmax of each row over its keys 0 .. its position, in 16-key steps from key 0; the
  // weights past the position are zero up to Lp.
  float inv_sum[kRows];
  const __m512 scale = _mm512_set1_ps(p.scale);
  for (int64_t r = 0; r < kRows; ++r) {
    const float* sr = s + r * Lp;
    uint16_t* hr = ws.hi.data() + r * Lp;
    uint16_t* lr = ws.lo.data() + r * Lp;
    const int64_t n = r < rows ? pos0 + r + 1 : 0;
    __m512 vmax = _mm512_set1_ps(-3.0e38f);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = first_lanes(n - j);
      vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sr + j), scale));
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 total = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j < n; j += 16) {
      const __mmask16 m = first_lanes(n - j);
      const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sr + j), scale);
      const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_sub_ps(x, top)));
      total = _mm512_add_ps(total, e);
      const __m256i e_hi = (__m256i)_mm512_cvtneps_pbh(e);
      const __m512 hi_f =
          _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(e_hi), 16));
      const __m256i e_lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(e, hi_f));
      _mm256_storeu_si256((__m256i*)(hr + j), e_hi);
      _mm256_storeu_si256((__m256i*)(lr + j), e_lo);
    }
    for (; j < Lp; j += 16) {
      _mm256_storeu_si256((__m256i*)(hr + j), _mm256_setzero_si256());
      _mm256_storeu_si256((__m256i*)(lr + j), _mm256_setzero_si256());
    }
    inv_sum[r] = n > 0 ? 1.0f / _mm512_reduce_add_ps(total) : 0.0f;
  }
  // Output: 64 dimensions at a time in four C tiles, over the value tiles in order.
  alignas(64) float acc[4][kRows * 16];
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int64_t nc = std::min<int64_t>(4, (D - d0) / 16);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t u = 0; u < Lp / kPairKeys; ++u) {
      _tile_loadd(4, ws.hi.data() + u * kPairKeys, Lp * 2);
      _tile_loadd(5, ws.lo.data() + u * kPairKeys, Lp * 2);
      const uint32_t* vals = values + u * (kPairKeys / 2) * D + d0;
      MET_PV_TILE(0)
      MET_PV_TILE(1)
      MET_PV_TILE(2)
      MET_PV_TILE(3)
    }
    _tile_stored(0, acc[0], 64);
    _tile_stored(1, acc[1], 64);
    _tile_stored(2, acc[2], 64);
    _tile_stored(3, acc[3], 64);
    for (int64_t r = 0; r < rows; ++r) {
      uint16_t* o = p.out + ((ch.q_start + r0 + r) * p.H + h) * D + d0;
      const __m512 inv = _mm512_set1_ps(inv_sum[r]);
      for (int64_t j = 0; j < nc; ++j) {
        const __m512 y = _mm512_mul_ps(_mm512_load_ps(acc[j] + r * 16), inv);
        _mm256_storeu_si256((__m256i*)(o + j * 16), (__m256i)_mm512_cvtneps_pbh(y));
      }
    }
  }
}

// Tasks t0 .. t1: per chunk, head-major, then the 16-row blocks in order.
MET_AMX_TARGET void run_tasks(const Problem& p, const int64_t* task_at, int64_t t0, int64_t t1) {
  thread_local Scratch ws;
  const TileConfig config;
  _tile_loadconfig(&config);
  int64_t c = 0;
  while (t0 >= task_at[c + 1]) ++c;
  for (int64_t t = t0; t < t1; ++t) {
    while (t >= task_at[c + 1]) ++c;
    const int64_t blocks = (p.chunks[c].q_len + kRows - 1) / kRows, i = t - task_at[c];
    attend_rows(p, c, i / blocks, (i % blocks) * kRows, ws);
  }
  _tile_release();
}
#undef MET_PV_TILE

#endif  // __x86_64__

// q [P, H, D] bfloat16; k, v [Hkv, S, D] bfloat16 (the layer's cache); slots long: every
// chunk's context slots, one chunk after another; chunks long [n, 4]: q_start, q_len,
// ctx_len, slot_start per chunk (see Chunk), together covering q's rows. Returns [P, H, D].
at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& slots, const at::Tensor& chunks, double scale) {
  TORCH_CHECK(supported(), "prompt_attention: this CPU has no AMX-BF16");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.is_cpu() && q.stride(2) == 1,
              "prompt_attention: q must be a [P, H, D] bfloat16 CPU tensor with unit "
              "last stride");
  const int64_t P = q.size(0), H = q.size(1), D = q.size(2);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == at::kBFloat16 && t->stride(2) == 1 &&
                    t->size(2) == D && t->size(0) == k.size(0) && t->size(1) == k.size(1),
                "prompt_attention: k and v must be [Hkv, S, D] bfloat16 caches of q's D");
  }
  const int64_t Hkv = k.size(0);
  TORCH_CHECK(D % 32 == 0, "prompt_attention: head_dim must be a multiple of 32, got ", D);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "prompt_attention: ", H,
              " query heads do not share ", Hkv, " kv heads evenly");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1,
              "prompt_attention: slots must be a contiguous 1-D long tensor");
  TORCH_CHECK(chunks.scalar_type() == at::kLong && chunks.is_contiguous() && chunks.dim() == 2 &&
                  chunks.size(1) == 4,
              "prompt_attention: chunks must be a contiguous long [n, 4] tensor");
  const int64_t n = chunks.size(0);
  const auto* ch = reinterpret_cast<const Chunk*>(chunks.data_ptr<int64_t>());
  std::vector<int64_t> stage_at(n + 1, 0), task_at(n + 1, 0);
  for (int64_t c = 0; c < n; ++c) {
    TORCH_CHECK(ch[c].q_len >= 1 && ch[c].q_start >= 0 && ch[c].q_start + ch[c].q_len <= P &&
                    ch[c].q_len <= ch[c].ctx_len && ch[c].slot_start >= 0 &&
                    ch[c].slot_start + ch[c].ctx_len <= slots.numel(),
                "prompt_attention: chunk ", c, " does not fit q's rows or the slots");
    stage_at[c + 1] = stage_at[c] + 2 * Hkv * stage_words(ch[c].ctx_len, D);
    task_at[c + 1] = task_at[c] + H * ((ch[c].q_len + kRows - 1) / kRows);
  }
  at::Tensor out = at::empty({P, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
#if defined(__x86_64__)
  thread_local std::vector<uint32_t> stage_storage;
  if (stage_storage.size() < static_cast<size_t>(stage_at[n])) stage_storage.resize(stage_at[n]);
  Problem p{static_cast<const uint16_t*>(q.data_ptr()), q.stride(0), q.stride(1),
            static_cast<const uint16_t*>(k.data_ptr()), k.stride(0), k.stride(1),
            static_cast<const uint16_t*>(v.data_ptr()), v.stride(0), v.stride(1),
            slots.data_ptr<int64_t>(), ch, static_cast<uint16_t*>(out.data_ptr()), H, Hkv, D,
            static_cast<float>(scale), stage_storage.data(), stage_at.data()};
  at::parallel_for(0, n * Hkv, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) stage(p, t / Hkv, t % Hkv);
  });
  at::parallel_for(0, task_at[n], 1, [&](int64_t t0, int64_t t1) {
    run_tasks(p, task_at.data(), t0, t1);
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY(MET_OP_NAMESPACE, m) {
  m.def("supported() -> bool", &supported);
  m.def("prompt_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor chunks, "
        "float scale) -> Tensor",
        &prompt_attention);
}
