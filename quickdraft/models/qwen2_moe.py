"""Qwen2-MoE / Qwen1.5-MoE (HF ``model_type`` "qwen2_moe"): the Qwen2 decoder (q/k/v biases) with
sparse MoE layers.

Routing: softmax over all experts, top k, renormalised only if ``norm_topk_prob``. Every sparse
layer adds a shared expert scaled by ``sigmoid(shared_expert_gate(x))``. Layer i is sparse when
``(i + 1) % decoder_sparse_step == 0`` and i is not in ``mlp_only_layers``; the other layers keep
the dense MLP of width ``intermediate_size``.
"""

from __future__ import annotations

from quickdraft.models.moe import MoECausalLM


class CausalLM(MoECausalLM):
    routing = "softmax_topk"
    shared_expert_gate = True

    def is_moe_layer(self, i: int) -> bool:
        cfg = self.config
        return cfg.num_experts > 0 and i not in cfg.mlp_only_layers and (i + 1) % cfg.decoder_sparse_step == 0
