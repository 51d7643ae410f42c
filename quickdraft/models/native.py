"""The native decoder stacks: every layer of a pass in one C++ call.

A family says which stack its layers have (:meth:`CausalLM.native_stack
<quickdraft.models.causal_lm.CausalLM.native_stack>`, a :class:`NativePass`): the standard layer's
here (:func:`build_stack`: Llama, Qwen2/3, Mistral), Qwen3.5's hybrid one (``qwen3_5.py``), Gemma
4's (``gemma4.py``) and GPT-OSS's (``gpt_oss.py``); the kernels' classes are in
``kernels/decode_cpu.cpp``. ``CausalLM.run`` uses it where it applies: the kernels built and
active, a CPU fp32 pass on the batch-invariant path (:func:`~quickdraft.models.batch_invariance.invariant_pass`)
outside autograd, and layers whose matrices are GGML blocks in q8 mode (a few small float32
projections are allowed where a stack runs them as :func:`~quickdraft.models.batch_invariance.blocked_linear`
does). It computes bitwise what the Python layers compute (the same kernels and torch ops, called
from C++) and only removes the interpreter's per-op cost (~5 ms of a 36 ms decode step on
Qwen2.5-Coder-1.5B; ~16 ms of 64 on Qwen3.5-0.8B). Anything else (other layer types, f32
activations, bf16 weights, CUDA, training) runs the Python layers as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from quickdraft.models.batch_invariance import Linear
from quickdraft.models.forward_pass import Step
from quickdraft.models.layers import MLP, Attention, DecoderLayer, RMSNorm, Rope
from quickdraft.quant.ggml import GGMLLinear, active_kernels, layout_epoch

WeightSpec = tuple[int, torch.Tensor, int, torch.Tensor | None]  # as the kernels take a GGML block matrix


class NativePass(Protocol):
    """A model's whole stack of layers for one pass in one native call."""

    def run(self, x: torch.Tensor, step: Step, capture: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(hidden state after the last layer, the inputs of the ``capture`` layers), bitwise what
        the Python layers give for the pass ``step`` describes (its keys, values and states written)."""
        ...


def weight_spec(m: nn.Module) -> WeightSpec | None:
    """A q8-mode GGML linear as the kernels take it; None for anything else."""
    if type(m) is not GGMLLinear or m.activation_mode != "q8":
        return None
    qt = m._set_layout(True)
    return qt, m.raw, m.in_features, m.bias


def weight_specs(*modules: nn.Module) -> list[WeightSpec] | None:
    """Every module's :func:`weight_spec`, or None where any is not a q8-mode GGML linear."""
    specs = [weight_spec(m) for m in modules]
    return None if any(s is None for s in specs) else [s for s in specs if s is not None]


def float_rows(m: nn.Module, bias: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) of a float32 :class:`~quickdraft.models.batch_invariance.Linear` as a native stack
    runs it (``blocked_linear``'s fixed row blocks), or None where ``m`` is not one, has a bias and
    ``bias`` is False, or has 2-3 outputs (which ``blocked_linear`` pads)."""
    if type(m) is not Linear or (m.bias is not None and not bias) or 1 < m.out_features < 4:
        return None
    if not on_cpu_fp32(m.weight, *([m.bias] if m.bias is not None else [])):
        return None
    return m.weight.detach(), None if m.bias is None else m.bias.detach()


def float_weight(m: nn.Module) -> torch.Tensor | None:
    """The weight of a bias-free float32 Linear as :func:`float_rows` takes it, or None."""
    rows = float_rows(m)
    return None if rows is None else rows[0]


def on_cpu_fp32(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_cpu for t in ts)


class DenseStack:
    """The standard layer's stack (the kernels' ``DecoderStack``)."""

    def __init__(self, native: Any, window: int | None) -> None:
        self.native, self.window = native, window

    def run(self, x: torch.Tensor, step: Step, capture: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        slots, offsets = step.flat_slots(self.window)
        cache = step.cache.attention
        return self.native.run(x, step.positions, cache.k, cache.v, step.start, slots, offsets, list(capture))


class PerLayerCacheStack:
    """A stack whose layers each attend over their own cache view (``cache.k_layers``: head shapes
    that differ from layer to layer, layers reading another's keys and values), some of them through
    a sliding ``window``: the kernels' ``Gemma4Stack`` (which also takes the per-layer inputs) and
    ``GptOssStack``."""

    def __init__(self, native: Any, window: int | None, layer_inputs: bool) -> None:
        self.native, self.window, self.layer_inputs = native, window, layer_inputs

    def run(self, x: torch.Tensor, step: Step, capture: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        cache = step.cache.attention
        slots, offsets = step.flat_slots(None)
        window_slots, window_offsets = step.flat_slots(self.window) if self.window else (None, None)
        extra = {"layer_inputs": step.layer_inputs} if self.layer_inputs else {}
        return self.native.run(x, step.positions, cache.k_layers, cache.v_layers, step.start, slots, offsets,
                               window_slots, window_offsets, capture=list(capture), **extra)


def build_stack(layers: nn.ModuleList) -> DenseStack | None:
    """The standard layers' native stack, or None where it does not apply."""
    mod = active_kernels()
    if mod is None or len(layers) == 0:
        return None
    first = layers[0]
    if type(first) is not DecoderLayer:
        return None
    attn0 = first.self_attn
    rope, eps = attn0.rope, first.input_layernorm.eps
    specs = []
    for layer in layers:
        if type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention or type(layer.mlp) is not MLP:
            return None
        a, mlp = layer.self_attn, layer.mlp
        norms: list[nn.Module | None] = [layer.input_layernorm, layer.post_attention_layernorm]
        if a.q_norm is not None:
            norms += [a.q_norm, a.k_norm]
        # exactly RMSNorm: subclasses (e.g. Gemma's 1 + w) compute something else
        if any(not isinstance(n, RMSNorm) or type(n) is not RMSNorm or n.eps != eps
               or n.weight.dtype != torch.float32 or not n.weight.is_cpu for n in norms):
            return None
        if (a.rope is not rope or a.window != attn0.window or (a.nh, a.nkv, a.hd) != (attn0.nh, attn0.nkv, attn0.hd)
                or a.scale != attn0.scale):
            return None
        lin = [weight_spec(m) for m in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
        if any(s is None for s in lin):
            return None
        specs.append((
            layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
            None if a.q_norm is None else a.q_norm.weight.detach(),
            None if a.k_norm is None else a.k_norm.weight.detach(),
            lin[0:3], lin[3], lin[4:6], lin[6],
        ))
    if attn0.hd % 8 or rope.cos.dtype != torch.float32 or not rope.cos.is_cpu:
        return None
    native = mod.DecoderStack(
        specs, rope.cos.contiguous(), rope.sin.contiguous(), float(eps), attn0.nh, attn0.nkv, attn0.hd,
        float(attn0.scale), attn0.window or 0,
    )
    return DenseStack(native, attn0.window)


class NativeStack:
    """A model's native stack (``build()``), rebuilt when any layer's weights, layout or mode may
    have changed, or its RoPE tables were replaced."""

    def __init__(self, build: Callable[[], NativePass | None], rope: Rope) -> None:
        self._build, self._rope = build, rope
        self._stack: NativePass | None = None
        self._epoch = -1
        self._rope_cos: torch.Tensor | None = None

    def get(self, x: torch.Tensor) -> NativePass | None:
        """The stack for a pass over ``x`` [T, H], or None: the Python layers run it."""
        if x.dtype is not torch.float32 or not x.is_cpu or torch.is_grad_enabled() or active_kernels() is None:
            return None
        cos = self._rope.cos  # new tables (materialize, .to()) mean a new stack
        if self._epoch != layout_epoch() or cos is not self._rope_cos:
            self._stack = self._build()
            self._epoch = layout_epoch()  # after the build: it may repack layers (and move the epoch)
            self._rope_cos = cos
        return self._stack
