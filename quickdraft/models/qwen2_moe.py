"""Qwen2-MoE / Qwen1.5-MoE (HF ``model_type`` "qwen2_moe"): the Qwen2 decoder (q/k/v biases) with
sparse MoE layers.

Routing: softmax over all experts, top k, renormalised only if ``norm_topk_prob``. Every sparse
layer adds a shared expert scaled by ``sigmoid(shared_expert_gate(x))``. Layer i is sparse when
``(i + 1) % decoder_sparse_step == 0`` and i is not in ``mlp_only_layers``; the other layers keep
the dense MLP of width ``intermediate_size``.
"""

from __future__ import annotations

from typing import Any

from quickdraft.config import ConfigUpdate, Family, hf_num_experts
from quickdraft.models.moe import GGUF_MOE_TENSOR_NAMES, MoECausalLM


class CausalLM(MoECausalLM):
    routing = "softmax_topk"
    shared_expert_gate = True

    def is_moe_layer(self, i: int) -> bool:
        cfg = self.config
        return cfg.num_experts > 0 and i not in cfg.mlp_only_layers and (i + 1) % cfg.decoder_sparse_step == 0


def qwen_moe_hf_fields(d: dict[str, Any], experts: int, per_token: int, width: int) -> ConfigUpdate:
    """The MoE fields of a Qwen MoE config.json, with the family's transformers defaults for the
    experts, the experts per token and their width where it leaves them out."""
    return {
        "num_experts_per_tok": int(d.get("num_experts_per_tok", per_token)),
        "moe_intermediate_size": int(d.get("moe_intermediate_size", width)),
        "num_experts": hf_num_experts(d, experts),
        "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(d.get("decoder_sparse_step", 1)),
        "mlp_only_layers": tuple(int(i) for i in d.get("mlp_only_layers") or ()),
    }


def _hf_fields(d: dict[str, Any]) -> ConfigUpdate:
    return qwen_moe_hf_fields(d, experts=60, per_token=4, width=1408) | {
        "shared_expert_intermediate_size": int(d.get("shared_expert_intermediate_size", 5632)),
        "attention_bias": bool(d.get("qkv_bias", True)),
    }


FAMILY = Family(model_types=("qwen2_moe",), read_hf=_hf_fields, gguf_archs={"qwen2moe": "qwen2_moe"},
                gguf_tensor_names={"qwen2_moe": GGUF_MOE_TENSOR_NAMES})
