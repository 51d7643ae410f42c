"""Qwen3-MoE (HF ``model_type`` "qwen3_moe"): the Qwen3 decoder (per-head q/k RMSNorm, no biases)
with sparse MoE layers and no shared expert.

The routing and layer placement are Qwen2-MoE's (softmax, top k, renormalised when
``norm_topk_prob``, as the released Qwen3 MoE models set it); ``shared_expert_intermediate_size``
is 0, so :class:`~quickdraft.models.moe.SparseMoE` builds no shared expert.
"""

from __future__ import annotations

from quickdraft.models.qwen2_moe import CausalLM

__all__ = ["CausalLM"]
