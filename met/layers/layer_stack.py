"""A step's decoder layers in one native call (csrc/layer_stack.cpp).

The fused CPU path of a Llama-family model (`LlamaForCausalLM._forward_fused`) runs nine
native ops per layer: the four w4a8 projections, rope + cache writes, decode attention, two
residual-add RMSNorms and SiLU · up. Called from Python each costs ~3 µs of argument
conversion and dispatch on top of its work, and the loop's own Python more: ~1 ms of a ~9 ms
one-stream decode step of the embedded model on a 2-core CPU. `LayerStack.run` makes the same
calls, in the same order with the same arguments, from C++: the hidden states are bitwise
those of the Python loop.

It applies where every projection is a native 4-bit w4a8 kernel, every layer has the same
attention window and head counts, and the step attends every row through the decode kernel in
one call: a pure decode step, or any step of a w4a8 model (its prompt rows attend row by row,
`ForwardBatch.row_attention`) unless prompt rows take their own kernels (``prompt_rows``, on
AMX CPUs), and no row of the step runs a LoRA adapter (their deltas are added by
`Linear.forward`, which the stack skips). Elsewhere `run` returns None and the caller runs the
Python loop.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from met.kernels.decode_attention import native_applies, native_op_name
from met.kernels.kv_cache import KVCache
from met.kernels.native import namespace, native_op
from met.kernels.w4a8 import AMX_MIN_ROWS
from met.layers.batch import ForwardBatch
from met.layers.fused_layer import FusedLayer
from met.layers.linear import Linear


@functools.cache
def _op():
    return native_op("layer_stack", "decode_layers")


@dataclass(frozen=True, slots=True)
class LayerStack:
    """The tensors and sizes of every layer, bound once (`build`)."""

    norms: list[torch.Tensor]  # the first input norm, then each layer's post and next norm
    norm_eps: list[float]
    linear_op: str  # the projections' qualified op name
    weights: list[torch.Tensor]  # packed, d, m of each layer's qkv, o, gate_up, down
    biases: list[torch.Tensor | None]
    out_features: list[int]
    # The first layer (`FusedLayer`): its rotary tables, head counts,
    # attention scale and window are every layer's (`build` checks).
    shared: FusedLayer
    attention_op: str
    lora_step: object | None = None  # `met.lora.slots.StepMapping` where adapter slots exist

    def run(self, x: torch.Tensor, batch: ForwardBatch, kv_caches: Sequence[KVCache]
            ) -> torch.Tensor | None:
        """The last layer's output through the final norm, as the Python loop computes it
        from the embedded tokens ``x``; None when this step cannot run here."""
        if self.lora_step is not None and self.lora_step.active:
            return None
        cache = kv_caches[0]  # every layer's cache has the same dtype and layout
        if batch.prompt_rows or not native_applies(cache, x.dtype, cache.k.shape[-1]):
            return None
        shared = self.shared
        plan = batch.window_plan(shared.window)
        if plan.per_seq:
            return None
        return _op()(
            x, self.norms, self.norm_eps, self.linear_op, self.weights, self.biases,
            self.out_features, AMX_MIN_ROWS, batch.positions, shared.cos, shared.sin,
            shared.num_heads, shared.num_kv_heads, [kv.k for kv in kv_caches],
            [kv.v for kv in kv_caches], [kv.k_scale for kv in kv_caches],
            [kv.v_scale for kv in kv_caches], batch.slot_mapping, self.attention_op,
            plan.decode_slots, plan.decode_offsets, shared.scale, namespace("fused_ops"))


def build(layers: Sequence[FusedLayer], projections: Sequence[Sequence[Linear]],
          first_norm: torch.Tensor, first_eps: float) -> LayerStack | None:
    """The stack of a model's fused layers (`FusedLayer`: norms, rotary
    tables, head counts, window) and their projections (qkv, o, gate_up, down per layer), or
    None where it does not apply (see the module docstring) or a kernel did not build."""
    loras = [proj.lora for per_layer in projections for proj in per_layer
             if proj.lora is not None]
    calls = [proj.kernel_call() for per_layer in projections for proj in per_layer]
    attention_op = native_op_name()
    if (not layers or any(call is None for call in calls) or attention_op is None
            or _op() is None or len({call.op for call in calls}) != 1):
        return None
    shared = {(layer.cos.data_ptr(), layer.sin.data_ptr(), layer.num_heads,
               layer.num_kv_heads, layer.scale, layer.window) for layer in layers}
    if len(shared) != 1:
        return None
    norms, eps = [first_norm], [first_eps]
    for layer in layers:
        norms += [layer.post_norm, layer.next_norm]
        eps += [layer.post_eps, layer.next_eps]
    return LayerStack(
        norms=norms, norm_eps=eps, linear_op=calls[0].op,
        weights=[w for call in calls for w in call.weights],
        biases=[call.bias for call in calls], out_features=[call.out_features for call in calls],
        shared=layers[0], attention_op=attention_op,
        lora_step=loras[0].step if loras else None)
