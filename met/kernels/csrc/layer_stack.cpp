// A step's decoder layers in one op: the loop of LlamaForCausalLM._forward_fused
// (met/models/llama.py), op for op, in C++. Each layer there is nine native calls (w4a8
// projections, rope + cache writes, decode attention, the fused norms and SiLU) plus the
// Python between them; from Python each call pays argument conversion and dispatch, a
// visible share of a one-stream decode step. Here the same ops are called through the
// dispatcher's typed handles (far cheaper per call), with the same arguments in
// the same order: the result is bitwise the Python loop's.
//
// The ops live in other libraries (their names carry a version suffix), so the caller
// passes their qualified names; each must already be loaded. Every layer has full attention
// over the same context slots (one WindowPlan for the step) and the same head counts.
#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

namespace {

using OptTensor = std::optional<at::Tensor>;

// The C++ signatures the ops were registered with (csrc/w4a8*.cpp, fused_ops.cpp,
// decode_attention.cpp): a typed handle must name them exactly.
using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const OptTensor&, int64_t, bool, int64_t,
                            int64_t);
using RmsNormFn = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddRmsNormFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&, double);
using SiluMulFn = at::Tensor(const at::Tensor&);
using RopeFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&, int64_t,
                          int64_t, const OptTensor&, const OptTensor&);
using AttentionFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, double, const OptTensor&,
                               const OptTensor&);

template <typename Fn>
c10::TypedOperatorHandle<Fn> find_op(const std::string& name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "").typed<Fn>();
}

constexpr int64_t kProjections = 4;  // qkv, o, gate_up, down
constexpr int64_t kWeightTensors = 3;  // packed, d, m of each projection

at::Tensor decode_layers(const at::Tensor& x, at::TensorList norms, c10::ArrayRef<double> norm_eps,
                         c10::string_view linear_op, at::TensorList weights,
                         const c10::List<OptTensor>& biases,
                         c10::ArrayRef<int64_t> out_features, int64_t amx_min_rows,
                         const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads,
                         at::TensorList k_caches, at::TensorList v_caches,
                         const c10::List<OptTensor>& k_scales,
                         const c10::List<OptTensor>& v_scales, const at::Tensor& slots,
                         c10::string_view attention_op, const at::Tensor& context_slots,
                         const at::Tensor& context_offsets, double scale,
                         c10::string_view fused_ops) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(x.dim() == 2, "decode_layers: x must be [T, hidden]");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * L + 1 &&
                  static_cast<int64_t>(norm_eps.size()) == 2 * L + 1,
              "decode_layers: norms and norm_eps need 2 per layer + the final norm");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kProjections * kWeightTensors * L &&
                  static_cast<int64_t>(biases.size()) == kProjections * L &&
                  static_cast<int64_t>(out_features.size()) == kProjections * L,
              "decode_layers: weights, biases and out_features need 4 projections per layer");
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == L &&
                  static_cast<int64_t>(k_scales.size()) == L &&
                  static_cast<int64_t>(v_scales.size()) == L,
              "decode_layers: one key cache, value cache and scale pair per layer");
  const std::string fused(fused_ops);
  const auto linear = find_op<LinearFn>(std::string(linear_op));
  const auto rms_norm = find_op<RmsNormFn>(fused + "::rms_norm");
  const auto add_rms_norm = find_op<AddRmsNormFn>(fused + "::add_rms_norm");
  const auto silu_mul = find_op<SiluMulFn>(fused + "::silu_mul");
  const auto rope = find_op<RopeFn>(fused + "::rope_qkv_to_cache");
  const auto attention = find_op<AttentionFn>(std::string(attention_op));

  const bool out_float = x.scalar_type() == at::kFloat;
  const int64_t T = x.size(0);
  const auto project = [&](const at::Tensor& in, int64_t i) {
    const int64_t w = kWeightTensors * i;
    return linear.call(in, weights[w], weights[w + 1], weights[w + 2], biases.get(i),
                       out_features[i], out_float, amx_min_rows, 0);
  };
  at::Tensor hidden = x;
  at::Tensor normed = rms_norm.call(x, norms[0], norm_eps[0]);
  for (int64_t l = 0; l < L; ++l) {
    const int64_t p = kProjections * l;
    const OptTensor k_scale = k_scales.get(l), v_scale = v_scales.get(l);
    const at::Tensor q = rope.call(project(normed, p), positions, cos, sin, k_caches[l],
                                   v_caches[l], slots, num_heads, num_kv_heads, k_scale,
                                   v_scale);
    const at::Tensor o = attention.call(q, k_caches[l], v_caches[l], context_slots,
                                        context_offsets, scale, k_scale, v_scale);
    std::tie(hidden, normed) = add_rms_norm.call(hidden, project(o.view({T, -1}), p + 1),
                                                 norms[2 * l + 1], norm_eps[2 * l + 1]);
    const at::Tensor mlp = project(silu_mul.call(project(normed, p + 2)), p + 3);
    std::tie(hidden, normed) = add_rms_norm.call(hidden, mlp, norms[2 * l + 2],
                                                 norm_eps[2 * l + 2]);
  }
  return normed;
}

}  // namespace

TORCH_LIBRARY(MET_OP_NAMESPACE, m) {
  m.def(
      "decode_layers(Tensor x, Tensor[] norms, float[] norm_eps, str linear_op, "
      "Tensor[] weights, Tensor?[] biases, int[] out_features, int amx_min_rows, "
      "Tensor positions, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, "
      "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor(c!)?[] k_scales, "
      "Tensor(d!)?[] v_scales, Tensor slots, str attention_op, Tensor context_slots, "
      "Tensor context_offsets, float scale, str fused_ops) -> Tensor",
      &decode_layers);
}
