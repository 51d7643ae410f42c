"""Qwen3-MoE (HF ``model_type`` "qwen3_moe"): the Qwen3 decoder (per-head q/k RMSNorm, no biases)
with sparse MoE layers and no shared expert.

The routing and layer placement are Qwen2-MoE's (softmax, top k, renormalised when
``norm_topk_prob``, as the released Qwen3 MoE models set it); ``shared_expert_intermediate_size``
is 0, so :class:`~quickdraft.models.moe.SparseMoE` builds no shared expert.
"""

from __future__ import annotations

from typing import Any

from quickdraft.config import ConfigUpdate, Family
from quickdraft.models.moe import GGUF_MOE_TENSOR_NAMES
from quickdraft.models.qwen2_moe import CausalLM, qwen_moe_hf_fields

__all__ = ["FAMILY", "CausalLM"]


def _hf_fields(d: dict[str, Any]) -> ConfigUpdate:
    return qwen_moe_hf_fields(d, experts=128, per_token=8, width=768) | {"qk_norm": True}


# (llama.cpp renormalises qwen3moe's top-k weights where a file has no expert_weights_norm)
FAMILY = Family(model_types=("qwen3_moe",), read_hf=_hf_fields, gguf_archs={"qwen3moe": "qwen3_moe"},
                gguf_norm_topk=True, gguf_tensor_names={"qwen3_moe": GGUF_MOE_TENSOR_NAMES})
