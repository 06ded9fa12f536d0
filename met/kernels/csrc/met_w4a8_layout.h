// What the two w4a8 kernels (w4a8.cpp with AVX512-VNNI, w4a8_avx2.cpp with AVX2) share: the
// packed weight layout's sizes (described at the top of w4a8.cpp), the checks of their
// arguments and their ops' schemas. Each kernel is its own shared library, so the anonymous
// namespace keeps these private to it. torch keys a cached build on the .cpp source only:
// after changing this header, bump the version suffix of both kernels (met/layers/w4a8.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kBlocks = 4;  // 16-channel blocks per group
constexpr int64_t kGroup = kLanes * kBlocks;
constexpr int64_t kK = 32;      // values per quantization block
constexpr int kTileRows = 4;

// Bytes of packed weights per 32-value block of 64 channels: four pairs of nibble quads
// (4-bit) or eight quads of bytes (8-bit).
template <bool kQ8>
constexpr int64_t kBlockBytes = (kQ8 ? 8 : 4) * kBlocks * 64;

// x [M, K] (contiguous bfloat16 or float32) and the packed weights, scales, bias and
// prompt_rows of an op call; each failure names the argument.
inline void check_args(const char* op, bool q8, const at::Tensor& x, const at::Tensor& packed,
                       const at::Tensor& d, const at::Tensor* m,
                       const std::optional<at::Tensor>& bias, int64_t N, int64_t prompt_rows) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 ||
                               x.scalar_type() == at::kFloat) &&
                  x.is_cpu() && x.is_contiguous(),
              op, ": x must be a contiguous 2-D bfloat16 or float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kK == 0, op, ": K must be a multiple of 32, got ", K);
  const int64_t groups = (N + kGroup - 1) / kGroup, nb = K / kK;
  const int64_t block_bytes = q8 ? kBlockBytes<true> : kBlockBytes<false>;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == groups * nb * block_bytes,
              op, ": packed weights do not match x's ", K, " features and ", N, " outputs");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() &&
                  d.numel() == groups * nb * kGroup,
              op, ": d must be float16 [groups, K / 32, 64]");
  TORCH_CHECK(m == nullptr || (m->scalar_type() == at::kHalf && m->is_contiguous() &&
                               m->numel() == d.numel()),
              op, ": m must be float16 [groups, K / 32, 64]");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat &&
                                    bias->is_contiguous() && bias->numel() == groups * kGroup),
              op, ": bias must be float32 [groups * 64]");
  TORCH_CHECK(prompt_rows >= 0 && prompt_rows <= M, op, ": prompt_rows must be in [0, ", M,
              "], got ", prompt_rows);
}

constexpr const char* kLinearSchema =
    "linear(Tensor x, Tensor packed, Tensor d, Tensor m, Tensor? bias, int out_features, "
    "bool out_float, int amx_min_rows, int prompt_rows) -> Tensor";
constexpr const char* kLinearQ8Schema =
    "linear_q8(Tensor x, Tensor packed, Tensor d, Tensor? bias, int out_features, "
    "bool out_float, int amx_min_rows) -> Tensor";

}  // namespace
