"""Put named tensors into a model strictly: every parameter filled, every shape checked.

The model is built on the meta device and materialised in the inference dtype first, so each
checkpoint tensor is converted and copied in one at a time and peak memory stays near the
final size (no fp32 copy of the whole model). Block-quantized GGUF matrices
(:class:`QuantTensor`) replace their ``Linear`` / ``Embedding`` with a module that computes on the
blocks directly, so the weights stay as compact in memory as in the file.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from quickdraft.errors import QuickdraftError
from quickdraft.loading.gguf import QuantTensor
from quickdraft.quant.fp8 import FP8Tensor, install_fp8_linear

# Tensors some checkpoints carry that the model derives itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_weights(
    model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor | QuantTensor | FP8Tensor]], tied: bool
) -> None:
    params = dict(model.named_parameters())  # tied lm_head is deduplicated away
    filled: set[str] = set()
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        param = params.get(name)
        if param is None:
            raise QuickdraftError(f"checkpoint tensor {name!r} has no place in the model; is the config right?")
        shape = tensor.shape if isinstance(tensor, QuantTensor | FP8Tensor) else tuple(tensor.shape)
        if tuple(shape) != tuple(param.shape):
            raise QuickdraftError(f"tensor {name} has shape {tuple(shape)}, the model expects {tuple(param.shape)}")
        if isinstance(tensor, QuantTensor):
            _install_quantized(model, name, tensor, tied)
        elif isinstance(tensor, FP8Tensor):  # FP8 checkpoints: the Linear becomes an FP8Linear
            install_fp8_linear(model, name, tensor)
        else:
            with torch.no_grad():
                param.copy_(tensor)
        filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise QuickdraftError(f"checkpoint lacks {len(missing)} tensor(s) the model needs: {shown}")


def _install_quantized(model: nn.Module, name: str, q: QuantTensor, tied: bool) -> None:
    from quickdraft.models.layers import QuantEmbedding
    from quickdraft.quant.ggml import GGMLLinear

    parent_name, _, attr = name.removesuffix(".weight").rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, attr)
    if isinstance(old, nn.Embedding):
        # one copy of the blocks serves the token embedding and the output head (not another
        # embedding table: Gemma 4's per-layer one)
        head = tied and old is getattr(getattr(model, "model", None), "embed_tokens", None)
        linear = GGMLLinear(q.qtype, q.raw, q.shape[1], lanes=q.lanes, owns_raw=True)
        setattr(parent, attr, QuantEmbedding(linear))
        if head:
            model.lm_head = linear
    elif isinstance(old, nn.Linear):
        setattr(parent, attr, GGMLLinear(q.qtype, q.raw, q.shape[1], bias=old.bias, lanes=q.lanes, owns_raw=True))
    else:
        raise QuickdraftError(f"tensor {name} is block-quantized, but its layer cannot use quantized weights")


def quantized_linear(model: nn.Module, name: str) -> nn.Module:
    """The module that holds checkpoint tensor ``name``'s blocks once installed (the GGMLLinear
    itself, or the one inside a QuantEmbedding)."""
    from quickdraft.models.layers import QuantEmbedding

    module = model.get_submodule(name.removesuffix(".weight"))
    return module.linear if isinstance(module, QuantEmbedding) else module
