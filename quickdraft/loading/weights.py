"""Put named tensors into a model strictly: every parameter filled, every shape checked.

The model is built on the meta device and materialised in the inference dtype first, so each
checkpoint tensor is converted and copied in one at a time and peak memory stays near the
final size (no fp32 copy of the whole model).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from quickdraft.errors import QuickdraftError

# Tensors some checkpoints carry that the model derives itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], tied: bool) -> None:
    params = dict(model.named_parameters())  # tied lm_head is deduplicated away
    filled: set[str] = set()
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        param = params.get(name)
        if param is None:
            raise QuickdraftError(f"checkpoint tensor {name!r} has no place in the model; is the config right?")
        if tuple(tensor.shape) != tuple(param.shape):
            raise QuickdraftError(
                f"tensor {name} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise QuickdraftError(f"checkpoint lacks {len(missing)} tensor(s) the model needs: {shown}")
