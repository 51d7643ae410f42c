"""GGUF files: metadata -> ModelConfig, tensors -> Hugging Face names (dequantized by ``gguf``).

The ``gguf`` package (from the llama.cpp project) parses the file and dequantizes every block
format. When quantized weights are kept for the CPU kernels, a matrix in a format the kernels
compute on (:data:`quickdraft.quant.ggml.SUPPORTED_TYPES`: Q4_0 .. Q8_0, Q2_K .. Q6_K, IQ4_NL,
IQ4_XS, F16, BF16) stays in its blocks; one in any other format (IQ2_XXS, TQ1_0 ...) is
dequantized to float32 instead, so such files still load, and the load says so in one line per
type with what it costs.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from quickdraft.config import ModelConfig
from quickdraft.errors import QuickdraftError
from quickdraft.loading.gguf_file import GGUFFile, release_pages

# GGUF general.architecture -> Hugging Face model_type. Mistral checkpoints convert to "llama".
ARCH_TO_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text", "phi3": "phi3",
                      "qwen35": "qwen3_5", "gemma4": "gemma4_text", "gpt-oss": "gpt_oss",
                      "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "qwen35moe": "qwen3_5_moe",
                      "qwen3next": "qwen3_next"}
# Mixture-of-experts layers as llama.cpp names them: the router, stacked experts (split per expert
# at load, :func:`quickdraft.models.moe.convert_expert_layouts`), the shared expert and its gate.
_MOE_LAYER_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj.weight",
    **{f"ffn_{p}_exps.weight": f"mlp.experts.{p}_proj.weight" for p in ("gate", "up", "down")},
    **{f"ffn_{p}_shexp.weight": f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")},
}
_NORM_TOPK = ("qwen3moe", "qwen35moe", "qwen3next")  # renormalised top-k weights (llama.cpp's norm_w for the arch)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Per-architecture renames that differ from the table above. Gemma 3 has four norms per layer;
# llama.cpp calls its pre-MLP norm "ffn_norm" (the Llama name of post_attention_layernorm).
_ARCH_LAYER_NAMES = {
    "gemma3_text": {
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    # Phi-3 keeps its fused weights (llama.cpp's ffn_up holds gate then up, like gate_up_proj).
    "phi3": {
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
    },
    # Qwen3.5: Gated DeltaNet layers' tensors (llama.cpp's ssm_* names), the gated attention's.
    "qwen3_5": {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
        "attn_gate.weight": "linear_attn.in_proj_z.weight",
        "ssm_beta.weight": "linear_attn.in_proj_b.weight",
        "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
        "ssm_conv1d.weight": "linear_attn.conv1d.weight",
        "ssm_dt.bias": "linear_attn.dt_bias",
        "ssm_a": "linear_attn.A_log",
        "ssm_norm.weight": "linear_attn.norm.weight",
        "ssm_out.weight": "linear_attn.out_proj.weight",
    },
    "qwen2_moe": _MOE_LAYER_NAMES,
    "qwen3_moe": _MOE_LAYER_NAMES,
    # GPT-OSS: sinks, the output projection's bias, the router with its bias, stacked experts (gate
    # and up apart, each with a bias; MXFP4 blocks in the released files).
    "gpt_oss": {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "attn_sinks.weight": "self_attn.sinks",
        "attn_output.bias": "self_attn.o_proj.bias",
        "ffn_gate_inp.weight": "mlp.gate.weight",
        "ffn_gate_inp.bias": "mlp.gate.bias",
        **{f"ffn_{p}_exps.{f}": f"mlp.experts.{p}_proj.{f}" for p in ("gate", "up", "down") for f in ("weight", "bias")},
    },
    # Gemma 4: Gemma 3's four norms, the layer scalar, the per-layer embedding branch, and the
    # routed experts' router (its input scale and per-expert scales) and norms.
    "gemma4_text": {
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        "layer_output_scale.weight": "layer_scalar",
        "inp_gate.weight": "per_layer_input_gate.weight",
        "proj.weight": "per_layer_projection.weight",
        "post_norm.weight": "post_per_layer_input_norm.weight",
        "ffn_gate_inp.weight": "router.proj.weight",
        "ffn_gate_inp.scale": "router.scale",
        "ffn_down_exps.scale": "router.per_expert_scale",
        "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
        "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
        "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
        "ffn_gate_up_exps.weight": "experts.gate_up_proj",
        "ffn_down_exps.weight": "experts.down_proj",
    },
}
_ARCH_LAYER_NAMES["qwen3_5_moe"] = _ARCH_LAYER_NAMES["qwen3_5"] | _MOE_LAYER_NAMES
# Qwen3-Next: Qwen3.5's names, its b / a projections still fused (grouped per key head, split at load)
_ARCH_LAYER_NAMES["qwen3_next"] = _ARCH_LAYER_NAMES["qwen3_5_moe"] | {"ssm_ba.weight": "linear_attn.in_proj_ba.weight"}
# Multi-token-prediction ("nextn") blocks after the model's layers: llama.cpp's names -> the
# checkpoint's mtp.* ones (their decoder layer's tensors keep the standard block names).
_NEXTN_NAMES = {
    "nextn.eh_proj.weight": "fc.weight",
    "nextn.enorm.weight": "pre_fc_norm_embedding.weight",
    "nextn.hnorm.weight": "pre_fc_norm_hidden.weight",
    "nextn.shared_head_norm.weight": "norm.weight",
}
_NEXTN_SHARED = ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight")  # copies of the target's
# Architectures whose GGUF norm weights are stored as ``1 + w`` (llama.cpp's converter adds the 1
# that Gemma's RMSNorm adds at run time); the loader subtracts it again, as transformers does.
_NORM_PLUS_ONE = ("gemma3_text", "qwen3_5", "qwen3_5_moe", "qwen3_next")
_NORM_AS_IS = ("ssm_norm.weight",)  # ... except these (Qwen3.5's gated norm multiplies by w)
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",  # Gemma 4's per-layer embeddings
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def open_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF file, turning parse failures into a clear error."""
    path = Path(path)
    if not path.is_file():
        raise QuickdraftError(f"no such file: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise QuickdraftError(f"{path} is not a GGUF file (bad magic {magic!r}); pass a .gguf file or a model folder")
    try:
        return GGUFFile(path)
    except Exception as exc:  # ValueError, struct errors, unknown enum values ... on damage
        raise QuickdraftError(
            f"{path} is damaged or truncated ({type(exc).__name__}: {exc}); delete it and fetch it again"
        ) from None


def metadata(reader: GGUFFile) -> dict[str, Any]:
    """All key/value metadata as plain Python values."""
    return dict(reader.metadata)


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in ARCH_TO_MODEL_TYPE:
        supported = ", ".join(sorted(ARCH_TO_MODEL_TYPE))
        raise QuickdraftError(f"GGUF architecture {arch!r} is not supported; supported: {supported}")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise QuickdraftError(f"GGUF metadata lacks '{arch}.{key}'; the file is incomplete")
        return value

    def first(value: Any) -> Any:  # per-layer arrays (Gemma 4): the first layer's here, the rest per family
        return value[0] if isinstance(value, list | tuple) else value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    scaling = None
    if meta.get(f"{arch}.rope.scaling.type") in ("linear",):
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif meta.get(f"{arch}.rope.scaling.type") == "yarn":  # llama.cpp's keys for transformers' fields
        scaling = {"rope_type": "yarn", "factor": float(get("rope.scaling.factor")),
                   "original_max_position_embeddings": int(get("rope.scaling.original_context_length"))}
        for key, field in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if meta.get(f"{arch}.{key}") is not None:
                scaling[field] = float(meta[f"{arch}.{key}"])
    cfg = ModelConfig(
        model_type=ARCH_TO_MODEL_TYPE[arch],
        vocab_size=int(meta.get(f"{arch}.vocab_size") or len(tokens)),
        hidden_size=hidden,
        intermediate_size=int(first(_feed_forward_length(meta, arch) or get("feed_forward_length"))),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(first(get("attention.head_count_kv", heads))),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
    )
    if arch == "gemma3":
        cfg = dataclasses.replace(cfg, **_gemma3_fields(meta, cfg))
    elif arch == "gpt-oss":
        cfg = dataclasses.replace(cfg, **_gpt_oss_fields(meta, cfg))
    elif arch == "gemma4":
        cfg = dataclasses.replace(cfg, **_gemma4_fields(meta, cfg, tensor_names))
    elif arch in ("qwen35", "qwen35moe", "qwen3next"):
        cfg = dataclasses.replace(cfg, **_qwen35_fields(meta, cfg, arch))
    elif arch == "phi3":
        cfg = dataclasses.replace(cfg, **_phi3_fields(meta, cfg, tensor_names))
    if meta.get(f"{arch}.expert_count"):
        cfg = dataclasses.replace(cfg, **_moe_fields(meta, cfg, arch, tensor_names))
    return cfg


def _feed_forward_length(meta: dict[str, Any], arch: str) -> Any:
    """The dense MLP width; for a MoE file without one (llama.cpp's Qwen3.5-MoE converter writes no
    ``feed_forward_length``: every layer is routed) the shared expert's, else the routed experts'."""
    value = meta.get(f"{arch}.feed_forward_length")
    if value is None and meta.get(f"{arch}.expert_count"):
        value = meta.get(f"{arch}.expert_shared_feed_forward_length") or meta.get(f"{arch}.expert_feed_forward_length")
    return value


def _moe_fields(meta: dict[str, Any], cfg: ModelConfig, arch: str, tensor_names: set[str]) -> dict[str, Any]:
    """Routed experts (``expert_*`` keys); layers with a plain MLP (``ffn_gate``) stay dense."""
    if arch in ("gpt-oss", "gemma4"):
        return {}  # (their own fields above)
    shared = int(meta.get(f"{arch}.expert_shared_feed_forward_length") or 0)
    norm = meta.get(f"{arch}.expert_weights_norm")
    return {
        "num_experts": int(meta[f"{arch}.expert_count"]),
        "num_experts_per_tok": int(meta.get(f"{arch}.expert_used_count") or 1),
        "moe_intermediate_size": int(meta.get(f"{arch}.expert_feed_forward_length") or cfg.intermediate_size),
        "shared_expert_intermediate_size": shared,
        "norm_topk_prob": bool(norm) if norm is not None else arch in _NORM_TOPK,
        "mlp_only_layers": tuple(i for i in range(cfg.num_hidden_layers) if f"blk.{i}.ffn_gate.weight" in tensor_names),
    }


def _phi3_fields(meta: dict[str, Any], cfg: ModelConfig, tensor_names: set[str]) -> dict[str, Any]:
    """Partial rotary (``rope.dimension_count`` below head_dim) and the all-layer sliding window.
    LongRoPE files (``rope_factors_short/long`` tensors) are refused: their per-frequency factors
    would have to be read from tensors, which quickdraft does not do for Phi-3 GGUFs."""
    if any(name.startswith("rope_factors_") for name in tensor_names):
        raise QuickdraftError(
            "Phi-3 GGUF files with LongRoPE (rope_factors_short/long, the 128k-context models) are "
            "not supported; use the model's Hugging Face folder, or a 4k-context model"
        )
    rotary = int(meta.get("phi3.rope.dimension_count") or cfg.head_dim)
    window = meta.get("phi3.attention.sliding_window")
    return {
        "partial_rotary_factor": rotary / cfg.head_dim,
        "sliding_window": int(window) if window else None,
        "layer_types": ("sliding_attention",) * cfg.num_hidden_layers if window else None,
    }


def _qwen35_fields(meta: dict[str, Any], cfg: ModelConfig, arch: str = "qwen35") -> dict[str, Any]:
    """Qwen3.5's hybrid layout as llama.cpp's converter writes it: the block count includes the
    multi-token-prediction blocks (``nextn_predict_layers``), the layer kinds come as
    ``attention.recurrent_layers`` (or every ``full_attention_interval``-th is full), the Gated
    DeltaNet shape as ``ssm.*`` keys, value heads in tiled order."""

    def get(key: str) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise QuickdraftError(f"GGUF metadata lacks '{arch}.{key}'; the file is incomplete")
        return value

    layers = cfg.num_hidden_layers - int(meta.get(f"{arch}.nextn_predict_layers") or 0)
    recurrent = meta.get(f"{arch}.attention.recurrent_layers")
    if recurrent is not None:
        kinds = ["linear_attention" if r else "full_attention" for r in list(recurrent)[:layers]]
    else:
        interval = int(meta.get(f"{arch}.full_attention_interval") or 4)
        kinds = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    nv, nk, inner = int(get("ssm.time_step_rank")), int(get("ssm.group_count")), int(get("ssm.inner_size"))
    for key, value in (("ssm.time_step_rank", nv), ("ssm.group_count", nk), ("ssm.inner_size", inner),
                       ("ssm.state_size", int(get("ssm.state_size"))), ("ssm.conv_kernel", int(get("ssm.conv_kernel")))):
        if value <= 0:
            raise QuickdraftError(f"GGUF metadata '{arch}.{key}' is {value}; the file is damaged (it must be positive)")
    if inner % nv or nv % nk:
        raise QuickdraftError(
            f"GGUF metadata is inconsistent: '{arch}.ssm.inner_size' {inner} must be a multiple of "
            f"'{arch}.ssm.time_step_rank' {nv} (value heads), and that of '{arch}.ssm.group_count' {nk} (key heads)")
    return {
        "num_hidden_layers": layers,
        "layer_types": tuple(kinds),
        "partial_rotary_factor": int(get("rope.dimension_count")) / cfg.head_dim,
        "qk_norm": True,
        "attn_output_gate": True,
        "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
        "linear_key_head_dim": int(get("ssm.state_size")),
        "linear_num_key_heads": nk,
        "linear_num_value_heads": nv,
        "linear_value_head_dim": inner // nv,
        "linear_value_heads_tiled": arch != "qwen3next",  # (Qwen3-Next's converter keeps them grouped)
    }


def _gpt_oss_fields(meta: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """GPT-OSS as llama.cpp runs it: sliding-window attention on the even layers, biases, experts
    (``expert_*`` keys), the clamped activation's constants (fixed in llama.cpp: 1.702 and 7); YaRN
    as the model was trained (transformers' config), not rounded as llama.cpp's rope does."""
    window = meta.get("gpt-oss.attention.sliding_window")
    experts = int(meta.get("gpt-oss.expert_count") or 0)
    if window is None or not experts:
        raise QuickdraftError("GGUF metadata lacks 'gpt-oss.attention.sliding_window' or 'gpt-oss.expert_count'; "
                              "the file is incomplete")
    return {
        "sliding_window": int(window),
        "layer_types": tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.num_hidden_layers)),
        "attention_bias": True,
        "num_experts": experts,
        "num_experts_per_tok": int(meta.get("gpt-oss.expert_used_count") or 4),
        "moe_intermediate_size": int(meta.get("gpt-oss.expert_feed_forward_length") or cfg.intermediate_size),
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        # YaRN without rounding the ramp's ends (the released configs' "truncate": false, which
        # GGUF keys do not carry)
        "rope_scaling": dict(cfg.rope_scaling, truncate=False) if cfg.rope_scaling else None,
    }


def _gemma4_fields(meta: dict[str, Any], cfg: ModelConfig, tensor_names: set[str]) -> dict[str, Any]:
    """Gemma 4 as llama.cpp's converter writes it: per-layer arrays for the sliding pattern, the KV
    heads and the MLP width (twice as wide on KV-sharing layers with ``use_double_wide_mlp``), the
    full layers' head size as ``key_length`` and the sliding ones' as ``key_length_swa``; keys as
    values where full layers have no ``attn_v``. Proportional RoPE comes from ``rope_freqs``
    (:func:`with_rope_factors`)."""
    layers = cfg.num_hidden_layers

    def per_layer(key: str, default: Any) -> list[Any]:
        value = meta.get(f"gemma4.{key}", default)
        values = list(value) if isinstance(value, list | tuple) else [value] * layers
        if len(values) != layers:
            raise QuickdraftError(f"gemma4.{key} has {len(values)} entries for {layers} layers; the file is damaged")
        return values

    window = meta.get("gemma4.attention.sliding_window")
    if window is None:
        raise QuickdraftError("GGUF metadata lacks 'gemma4.attention.sliding_window'; the file is incomplete")
    sliding = [bool(s) for s in per_layer("attention.sliding_window_pattern", True)]
    types = ["sliding_attention" if s else "full_attention" for s in sliding]
    kv = per_layer("attention.head_count_kv", cfg.num_key_value_heads)
    ff = per_layer("feed_forward_length", cfg.intermediate_size)
    shared = int(meta.get("gemma4.attention.shared_kv_layers") or 0)
    full = [i for i in range(layers) if not sliding[i]]
    if not full:
        raise QuickdraftError("this Gemma 4 GGUF has no full-attention layer; the file is damaged")
    swa_kv = [kv[i] for i in range(layers) if sliding[i]] or [kv[full[0]]]
    k_eq_v = f"blk.{full[0]}.attn_v.weight" not in tensor_names
    wide = [2 * ff[0] if i >= layers - shared else ff[0] for i in range(layers)]
    if len(set(swa_kv)) > 1 or len({kv[i] for i in full}) > 1 or (not k_eq_v and kv[full[0]] != swa_kv[0]) \
            or ff not in ([ff[0]] * layers, wide):
        raise QuickdraftError(f"this Gemma 4 GGUF's per-layer KV heads {kv} or MLP widths {ff} are not a layout "
                              "quickdraft knows (one value per layer type; double-wide sharing layers)")
    experts = int(meta.get("gemma4.expert_count") or 0)
    softcap = meta.get("gemma4.final_logit_softcapping")
    return {
        "num_key_value_heads": int(swa_kv[0]),
        "head_dim": int(meta.get("gemma4.attention.key_length_swa") or cfg.head_dim),
        "global_head_dim": cfg.head_dim,
        "num_global_key_value_heads": int(kv[full[0]]) if k_eq_v else 0,
        "attention_k_eq_v": k_eq_v,
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": shared > 0 and ff == wide and ff != [ff[0]] * layers,
        "hidden_size_per_layer_input": int(meta.get("gemma4.embedding_length_per_layer_input") or 0),
        "vocab_size_per_layer_input": cfg.vocab_size,
        "sliding_window": int(window),
        "layer_types": tuple(types),
        "rope_local_theta": float(meta.get("gemma4.rope.freq_base_swa", 10000.0)),
        "final_logit_softcapping": None if softcap is None else float(softcap),
        "qk_norm": True,
        "num_experts": experts,
        "num_experts_per_tok": int(meta.get("gemma4.expert_used_count") or 0) if experts else 0,
        "moe_intermediate_size": int(meta.get("gemma4.expert_feed_forward_length") or 0) if experts else 0,
    }


def with_rope_factors(cfg: ModelConfig, factors: list[float]) -> ModelConfig:
    """The config with a file's ``rope_freqs`` divisors: Llama 3.1's per-frequency scaling, or
    (Gemma 4: 1 for the rotating angles, 1e30 for the still ones) its proportional RoPE."""
    if cfg.model_type == "gemma4_text":
        rotating = sum(1 for f in factors if f < 1e29)
        dim = cfg.global_head_dim or cfg.head_dim
        return dataclasses.replace(cfg, rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 2 * rotating / dim})
    return dataclasses.replace(cfg, rope_scaling={"rope_type": "freq_factors", "factors": factors})


def _gemma3_fields(meta: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """What a Gemma 3 GGUF leaves to convention, filled in as llama.cpp does: every 6th layer is
    a full-attention layer (unless the file lists the pattern), sliding layers use RoPE base
    10000 unscaled, and scores are scaled by 1/sqrt(head_dim), except for the 27B model
    (62 layers) whose query_pre_attn_scalar is hidden_size / heads."""
    layers = cfg.num_hidden_layers
    window = meta.get("gemma3.attention.sliding_window")
    if window is None:
        raise QuickdraftError("GGUF metadata lacks 'gemma3.attention.sliding_window'; the file is incomplete")
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # one flag per layer: True = sliding
        if len(pattern) != layers:
            raise QuickdraftError(f"gemma3.attention.sliding_window_pattern has {len(pattern)} entries for {layers} layers")
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [bool((i + 1) % int(pattern)) for i in range(layers)]
    scalar = cfg.hidden_size / cfg.num_attention_heads if layers == 62 else cfg.head_dim
    softcap = meta.get("gemma3.final_logit_softcapping")
    return {
        "sliding_window": int(window),
        "layer_types": tuple("sliding_attention" if s else "full_attention" for s in sliding),
        "rope_local_theta": float(meta.get("gemma3.rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": float(scalar),
        "final_logit_softcapping": None if softcap is None else float(softcap),
    }


def rope_freq_factors(reader: GGUFFile) -> list[float] | None:
    """Llama 3.1+ GGUFs keep their RoPE scaling as per-frequency divisors in ``rope_freqs.weight``."""
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            return [float(v) for v in np.asarray(dequantize(t.data, t.tensor_type)).reshape(-1)]
    return None


def hf_name(gguf_name: str, model_type: str | None = None, layers: int | None = None) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (None if unknown);
    ``model_type`` selects an architecture's own renames (:data:`_ARCH_LAYER_NAMES`); blocks from
    ``layers`` on are multi-token-prediction blocks (``mtp.*`` names, "" for the target's copies)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m is None:
        return None
    block, rest = int(m.group(1)), m.group(2)
    if layers is not None and block >= layers:
        if rest in _NEXTN_SHARED:
            return ""
        if rest in _NEXTN_NAMES:
            return f"mtp.{_NEXTN_NAMES[rest]}" if block == layers else None
        names = _ARCH_LAYER_NAMES.get(model_type or "", {})
        local = names.get(rest) or _LAYER_NAMES.get(rest)
        return None if local is None or block != layers else f"mtp.layers.0.{local}"
    names = _ARCH_LAYER_NAMES.get(model_type or "", {})
    local = names.get(rest) or _LAYER_NAMES.get(rest)
    return None if local is None else f"model.layers.{block}.{local}"


def _quant_tensor(t: Any, name: str, cfg: ModelConfig, permute: bool) -> QuantTensor:
    raw = np.asarray(t.data)  # [N, row_bytes] view of the memory map
    if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = cfg.num_attention_heads if name.endswith("q_proj.weight") else cfg.num_key_value_heads
        raw = _unpermute(raw, heads)  # a permutation of whole rows, so blocks stay intact
    dims = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first: [N, K] or [E, N, K]
    copy = torch.from_numpy(np.array(raw.view(np.uint8).reshape(*dims[:-1], -1)))  # (F16 / BF16: their bytes)
    release_pages(t.data)
    return QuantTensor(t.tensor_type, copy, dims)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class QuantTensor:
    """A weight kept in its GGUF block format: ``raw`` [N, row_bytes] uint8 for an [N, K] matrix
    (``lanes``: already in the q8 kernels' lane layout, as prepared weights keep it), or
    [E, N, row_bytes] for E stacked experts' matrices (:meth:`expert`)."""

    qtype: GGMLQuantizationType
    raw: torch.Tensor
    shape: tuple[int, ...]
    lanes: bool = False

    def expert(self, e: int) -> QuantTensor:
        """Expert ``e``'s matrix of a stacked [E, N, K] tensor."""
        return QuantTensor(self.qtype, self.raw[e], self.shape[1:], self.lanes)

    def select_rows(self, ids: torch.Tensor) -> QuantTensor:
        """Rows ``ids`` of a matrix, in that order (GPT-OSS's interleaved gate/up, fused projections)."""
        raw = self.raw.index_select(0, ids.to(torch.long)).contiguous()
        return QuantTensor(self.qtype, raw, (int(raw.shape[0]), self.shape[1]), self.lanes)

    def rows(self, start: int, stop: int) -> QuantTensor:
        """Rows ``[start, stop)`` of a matrix (whole blocks: a row's blocks are its own)."""
        return QuantTensor(self.qtype, self.raw[start:stop], (stop - start, self.shape[1]), self.lanes)


def _kernel_type(t: Any) -> bool:
    """True if :class:`quickdraft.quant.ggml.GGMLLinear` computes on this matrix's blocks directly."""
    from quickdraft.quant.ggml import SUPPORTED_TYPES, block_size

    return t.tensor_type in SUPPORTED_TYPES and len(t.shape) in (2, 3) and int(t.shape[0]) % block_size(t.tensor_type) == 0


@dataclass
class DequantizedTypes:
    """Matrices of types without a kernel, dequantized at load: per type, (count, file bytes, fp32 bytes)."""

    seen: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    def add(self, t: Any, fp32_bytes: int) -> None:
        entry = self.seen.setdefault(t.tensor_type.name, [0, 0, 0])
        entry[0] += 1
        entry[1] += int(t.n_bytes)
        entry[2] += fp32_bytes

    def report(self) -> None:
        for name, (count, file_bytes, fp32_bytes) in self.seen.items():
            print(
                f"note: {count} matrices of type {name} have no native kernel in quickdraft: dequantized to "
                f"float32 ({fp32_bytes / 2**20:,.0f} MB in memory instead of {file_bytes / 2**20:,.0f} MB, and "
                "each decode step reads them all); requantize the file to Q4_K_M, Q5_K_M, Q6_K, Q8_0 or IQ4_XS "
                "for full speed",
                file=sys.stderr,
            )


def iter_tensors(
    reader: GGUFFile, cfg: ModelConfig, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor in HF layout: float32, or with
    ``keep_quantized`` a :class:`QuantTensor` for each block-quantized matrix."""
    permute = cfg.model_type == "llama"
    dequantized = DequantizedTypes()
    layers = cfg.num_hidden_layers if cfg.model_type in ("qwen3_5", "qwen3_5_moe", "qwen3_next") else None
    for t in reader.tensors:
        name = hf_name(t.name, cfg.model_type, layers)
        if name == "":
            continue  # a multi-token-prediction block's copy of the embedding or output head
        if name is None:
            if t.name.startswith("rope_freqs"):
                continue  # read by rope_freq_factors() into the config
            raise QuickdraftError(f"unexpected tensor {t.name!r} in GGUF; this model variant is not supported")
        if keep_quantized and _kernel_type(t):
            yield name, _quant_tensor(t, name, cfg, permute)
            continue
        if keep_quantized and len(t.shape) in (2, 3) and t.tensor_type != GGMLQuantizationType.F32:
            dequantized.add(t, 4 * int(np.prod(t.shape)))  # formats the kernels lack: fp32 below
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise QuickdraftError(f"tensor {t.name} uses {t.tensor_type.name}, which quickdraft cannot read yet") from None
        w = np.asarray(w, dtype=np.float32)
        if not w.flags.writeable:  # F32 tensors come straight from the read-only memory map
            w = w.copy()
        if permute and name.endswith("q_proj.weight"):
            w = _unpermute(w, cfg.num_attention_heads)
        elif permute and name.endswith("k_proj.weight"):
            w = _unpermute(w, cfg.num_key_value_heads)
        if cfg.model_type in _NORM_PLUS_ONE and t.name.endswith("norm.weight") and not t.name.endswith(_NORM_AS_IS):
            w = w - np.float32(1.0)
        if name.endswith(".A_log"):  # llama.cpp stores A = -exp(A_log)
            w = np.log(-w)
        elif name.endswith(".conv1d.weight"):  # [C, K] -> the depthwise Conv1d's [C, 1, K]
            w = w[:, None, :]
        elif name.endswith(".shared_expert_gate.weight") and w.ndim == 1:  # llama.cpp's [H] -> the gate's [1, H]
            w = w[None, :]
        yield name, torch.from_numpy(np.ascontiguousarray(w))
    dequantized.report()
