"""Mixtral (HF ``model_type`` "mixtral"): the Mistral decoder with a sparse MoE on every layer.

Routing: top-k of the router logits, softmax over those k (equal to transformers' softmax,
top-k, renormalise). Checkpoints name the block ``block_sparse_moe`` and the expert matrices
``w1`` (gate), ``w3`` (up), ``w2`` (down); transformers 5 keeps them stacked in memory as
``mlp.experts.gate_up_proj`` / ``down_proj``. Both load (see :mod:`quickdraft.models.moe`).
"""

from __future__ import annotations

from quickdraft.models.moe import MoECausalLM


class CausalLM(MoECausalLM):
    routing = "topk_softmax"
    checkpoint_renames = (
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
        (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."),
        (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."),
    )
