"""Mixtral (HF ``model_type`` "mixtral"): the Mistral decoder with a sparse MoE on every layer.

Routing: top-k of the router logits, softmax over those k (equal to transformers' softmax,
top-k, renormalise). Checkpoints name the block ``block_sparse_moe`` and the expert matrices
``w1`` (gate), ``w3`` (up), ``w2`` (down); transformers 5 keeps them stacked in memory as
``mlp.experts.gate_up_proj`` / ``down_proj``. Both load (see :mod:`quickdraft.models.moe`).
"""

from __future__ import annotations

from typing import Any

from quickdraft.config import ConfigUpdate, Family, hf_num_experts
from quickdraft.models.moe import MoECausalLM


class CausalLM(MoECausalLM):
    routing = "topk_softmax"
    checkpoint_renames = (
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
        (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."),
        (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."),
    )


def _hf_fields(d: dict[str, Any]) -> ConfigUpdate:
    """Experts as transformers' MixtralConfig defaults them, each ``intermediate_size`` wide."""
    return {
        "num_experts": hf_num_experts(d, 8),
        "num_experts_per_tok": int(d.get("num_experts_per_tok", 2)),
        "moe_intermediate_size": int(d["intermediate_size"]),
        "sliding_window": d.get("sliding_window"),  # Mixtral has no use_sliding_window switch
    }


# (Mixtral GGUFs are llama.cpp "llama" files: the llama family reads them)
FAMILY = Family(model_types=("mixtral",), read_hf=_hf_fields)
