"""Tiny random Hugging Face models for tests: a few layers, hidden 64, a ~300-token BPE vocabulary.

A folder written by :func:`make_tiny_hf_model` is a complete Hugging Face checkpoint
(``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``), so it goes
through the same ``load_model`` path as a real one, and transformers can load it as the reference.

    folder = make_tiny_hf_model(tmp_path, "qwen2", num_hidden_layers=3)
    loaded = quickdraft.loading.load.load_model(str(folder), dtype="float32")
    reference = load_reference(folder)  # transformers model, fp32, eval mode

The tokenizer is a byte-level BPE trained on a small ASCII corpus: its alphabet holds only the
bytes the corpus uses, so every id decodes to printable ASCII and generated text is easy to
reason about (no partial UTF-8 characters). It knows three special tokens, ChatML style:
``<|endoftext|>`` (0, BOS/EOS), ``<|im_start|>`` (1) and ``<|im_end|>`` (2, also EOS), and carries a
ChatML chat template. Weights are random but seeded, so a given (model_type, overrides, seed) always
produces the same checkpoint.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as _Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
EOS_ID = 0  # <|endoftext|>
IM_END_ID = 2
TOKENIZER_VOCAB = 300

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for i in range(10):\n    print(i, i * i, i ** 3)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n",
    "Speculative decoding drafts several tokens cheaply and verifies them in one pass.",
    "Hello, world! How are you today? I am fine, thank you; and you?",
    "import os, sys, json\nfrom pathlib import Path\n\nprint(json.dumps({'a': 1, 'b': [2, 3]}))\n",
    "0123456789 +-*/=<>()[]{}:;,.'\"!?#@$%^&_|~`\\",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz",
]

# Per-architecture knobs on top of the shared tiny shape.
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {"use_sliding_window": False, "sliding_window": None},  # attention_bias is implied
    "qwen3": {"head_dim": 32, "use_sliding_window": False, "sliding_window": None},
    # head_dim and query_pre_attn_scalar differ from hidden/heads and from each other, the window
    # is shorter than the test texts, and the two RoPE bases differ, so each is exercised.
    "gemma3_text": {
        "head_dim": 32,
        "query_pre_attn_scalar": 24,
        "sliding_window": 5,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    },
    "phi3": {"sliding_window": None, "original_max_position_embeddings": 512},
    # Gated DeltaNet layers with grouped value heads (2 q/k heads, 4 value heads), a full-attention
    # layer between them, RoPE on a quarter of each head.
    "qwen3_5_text": {
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    },
}
# Qwen3.5-MoE: the same hybrid layers, each MLP four routed experts (top 2) and a gated shared one
# (widths of 64: element-wise SiLU stays batch invariant, see quickdraft.models.moe.rowwise).
_ARCH_DEFAULTS["qwen3_5_moe_text"] = _ARCH_DEFAULTS["qwen3_5_text"] | {
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
}
# Qwen3-Next: the same, with fused in_proj_qkvz / in_proj_ba and sparse layers every second one.
_ARCH_DEFAULTS["qwen3_next"] = _ARCH_DEFAULTS["qwen3_5_moe_text"] | {"decoder_sparse_step": 2}
# GPT-OSS: sinks, a window (5) shorter than the texts on alternate layers, YaRN, four experts (top 2).
_ARCH_DEFAULTS["gpt_oss"] = {
    "head_dim": 16,
    "num_hidden_layers": 3,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "intermediate_size": 64,
    "sliding_window": 5,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 128, "rope_theta": 10000.0},
}
# Gemma 4 (the small models' layout): full-attention layers with twice the head size and
# proportional RoPE, a window (5) shorter than the texts, the last two layers reusing the first
# two's keys and values with double-wide MLPs, per-layer embeddings, soft-capped logits. The MoE
# layout (routed experts beside the MLP, keys as values): the overrides GEMMA4_MOE.
_ARCH_DEFAULTS["gemma4_text"] = {
    "head_dim": 16,
    "global_head_dim": 32,
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "sliding_window": 5,
    "num_kv_shared_layers": 2,
    "use_double_wide_mlp": True,
    "hidden_size_per_layer_input": 16,
    "final_logit_softcapping": 30.0,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    },
}
# The Gemma 4 MoE layout (Gemma 4 26B-A4B's kind): four experts (top 2) beside every MLP,
# full-attention layers without v_proj and with one KV head, no KV sharing or per-layer embeddings.
GEMMA4_MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 64,
              "attention_k_eq_v": True, "num_global_key_value_heads": 1, "num_kv_shared_layers": 0,
              "hidden_size_per_layer_input": 0}
SUPPORTED_TYPES = tuple(_ARCH_DEFAULTS)


@lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    backend = _Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    backend.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return backend.to_str()


def write_tokenizer(folder: Path, eos_token_id: int | list[int] | None = None) -> Path:
    """Write the tiny tokenizer's files into ``folder``; ``eos_token_id`` adds a config.json
    naming extra stop ids (how Hugging Face folders declare several EOS ids)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": ENDOFTEXT,
        "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 4096,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    if eos_token_id is not None:
        (folder / "config.json").write_text(json.dumps({"eos_token_id": eos_token_id}))
    return folder


def tokenizer_vocab_size() -> int:
    return int(_Backend.from_str(_tokenizer_json()).get_vocab_size(with_added_tokens=True))


def tiny_config(model_type: str = "llama", **overrides: Any) -> Any:
    """A transformers config of the tiny shape; ``overrides`` replace any field."""
    from transformers import AutoConfig

    if model_type not in _ARCH_DEFAULTS:
        raise ValueError(f"tiny models exist for {', '.join(SUPPORTED_TYPES)}, not {model_type!r}")
    fields: dict[str, Any] = dict(
        vocab_size=tokenizer_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
    )
    fields.update(_ARCH_DEFAULTS[model_type])
    if model_type == "gemma4_text":
        fields["vocab_size_per_layer_input"] = fields["vocab_size"]
    fields.update(overrides)
    return AutoConfig.for_model(model_type, **fields)


def make_tiny_hf_model(
    tmp_path: Path,
    model_type: str = "llama",
    *,
    seed: int = 0,
    name: str | None = None,
    init_gain: float = 1.0,
    **overrides: Any,
) -> Path:
    """Build a seeded random ``model_type`` model, save it as a Hugging Face folder, return it.

    ``overrides`` are config fields (``num_hidden_layers=3``, ``tie_word_embeddings=True``,
    ``rope_scaling={...}``, ``vocab_size=400`` for a padded vocabulary ...). Weights are drawn
    with std ``init_gain / sqrt(fan_in)`` (embeddings: std 1), far above transformers' 0.02
    default, so activations keep unit scale, logits are spread out and greedy choices are well
    separated rather than decided by float rounding. Norm weights and biases are randomised
    too, so a loader that skipped them would be caught.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif pname.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif pname.endswith("embed_tokens.weight"):
                param.normal_(0.0, 1.0)
            else:
                param.normal_(0.0, init_gain / param.shape[-1] ** 0.5)
        for bname, buf in model.named_buffers():
            if bname.endswith("layer_scalar"):  # Gemma 4's per-layer output scale (saved with the weights)
                buf.uniform_(0.5, 1.5)
    folder = tmp_path / (name or f"tiny-{model_type}-{seed}")
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


# --------------------------------------------------------------------------------------- MoE

# name -> (HF model_type, config overrides on the tiny shape). MLP widths are multiples of 64, as
# in real models: torch's element-wise SiLU is only batch invariant on such rows (moe.rowwise).
MOE_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64}),
    "qwen2_moe": (  # shared expert with its gate, one dense layer (mlp_only_layers), qkv biases
        "qwen2_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 128,
            "num_hidden_layers": 3,
            "mlp_only_layers": [1],
        },
    ),
    "qwen2_moe-step2": (  # every 2nd layer sparse, renormalised top-3, tied embeddings
        "qwen2_moe",
        {
            "num_experts": 6,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "decoder_sparse_step": 2,
            "norm_topk_prob": True,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3_moe": (
        "qwen3_moe",
        {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "head_dim": 32, "norm_topk_prob": True},
    ),
    "llama4": (  # MoE on layers 1 and 3, chunks of 8 < the 17 tokens, NoPE layer 1, temperature,
        # RoPE layer 2 with full attention (explicit layer_types)
        "llama4_text",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "intermediate_size": 64,
            "intermediate_size_mlp": 128,
            "num_hidden_layers": 4,
            "head_dim": 16,
            "interleave_moe_layer_step": 2,
            "attention_chunk_size": 8,
            "no_rope_layers": [1, 0, 1, 1],
            "layer_types": ["chunked_attention", "full_attention", "full_attention", "chunked_attention"],
            "floor_scale": 4,  # the temperature grows within the test's positions (real: 8192)
            "attn_scale": 0.5,
            "use_qk_norm": True,
        },
    ),
    "llama4-top2": (  # two sigmoid-scaled experts, no qk norm, biases, explicit moe_layers, no chunks
        "llama4_text",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 64,
            "intermediate_size_mlp": 192,
            "num_hidden_layers": 3,
            "head_dim": 16,
            "moe_layers": [0, 2],
            "attention_chunk_size": None,
            "no_rope_layers": [1, 1, 0],
            "floor_scale": 4,
            "attn_scale": 0.3,
            "use_qk_norm": False,
            "attention_bias": True,
        },
    ),
}


def moe_config(model_type: str, **overrides: Any) -> Any:
    from transformers import AutoConfig

    fields: dict[str, Any] = dict(
        vocab_size=tokenizer_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
    )
    fields.update(overrides)
    return AutoConfig.for_model(model_type, **fields)


def randomize(model: Any) -> None:
    """Weights of unit-scale activations, as tests/tiny.py draws them (std 1/sqrt(fan_in), norms
    around 1, random biases), so logits are spread and routing choices well separated. Llama 4's
    stacked experts are input-major ([E, in, out]): their fan-in is the middle dimension."""
    input_major = model.config.model_type.startswith("llama4")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 1.0)
            else:
                fan_in = param.shape[-2] if input_major and param.dim() == 3 else param.shape[-1]
                param.normal_(0.0, fan_in**-0.5)


def make_moe_model(root: Path, name: str, seed: int = 0) -> Path:
    """The seeded random checkpoint of MOE_CASES[name], saved by transformers with the tiny tokenizer."""
    from transformers import AutoModelForCausalLM

    model_type, overrides = MOE_CASES[name]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(model_type, **overrides), dtype=torch.float32)
    randomize(model)
    folder = root / f"{name}-{seed}"
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


# --------------------------------------------------------------------------------------- GGUF

_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Architecture-specific GGUF names (llama.cpp's tensor map): Phi-3's fused weights, Gemma 3's
# four norms per layer.
_GGUF_ARCH_LAYER = {
    "phi3": {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"},
    "gemma3": {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    },
}
_GGUF_MOE = {  # the router and the shared expert (qwen2moe / qwen3moe)
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    **{f"mlp.shared_expert.{p}_proj.weight": f"ffn_{p}_shexp.weight" for p in ("gate", "up", "down")},
}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_tokenizer_metadata(writer: Any, pad_to: int | None = None) -> None:
    """Store the tiny BPE the way llama.cpp does: tokens, types, merges, special ids; with
    ``pad_to``, unused tokens after it up to that vocabulary size (a real model's head and
    embedding rows around the tiny tokenizer)."""
    spec = json.loads(_tokenizer_json())
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {a["id"] for a in spec["added_tokens"]}
    types = [3 if i in specials else 1 for i in range(len(tokens))]  # 3 = control
    if pad_to is not None and pad_to > len(tokens):
        types += [5] * (pad_to - len(tokens))  # 5 = unused
        tokens += [f"<|unused_{i}|>" for i in range(len(tokens), pad_to)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(
        [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    )
    writer.add_bos_token_id(EOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)


def _llama_cpp_permute(w: Any, n_head: int) -> Any:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py ``LlamaModel.permute``)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _llama3_rope_factors(config: Any) -> Any:
    """The ``rope_freqs.weight`` tensor llama.cpp writes for rope_type "llama3" (per-frequency
    divisors of the inverse frequencies), as convert_hf_to_gguf.py computes it."""
    import math

    import numpy as np

    rope = config.rope_parameters
    base, dim = rope["rope_theta"], config.head_dim
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _gemma3_metadata(writer: Any, config: Any) -> None:
    """Gemma 3 keys: the window and, where the layer layout is not llama.cpp's built-in "every
    6th layer is global", the per-layer pattern (True = sliding), as gguf-py writes it."""
    import gguf

    if config.query_pre_attn_scalar != config.head_dim:
        raise ValueError("llama.cpp scales Gemma 3 scores by 1/sqrt(head_dim); this model cannot be a GGUF")
    writer.add_sliding_window(config.sliding_window)
    sliding = [t == "sliding_attention" for t in config.layer_types]
    if sliding != [bool((i + 1) % 6) for i in range(len(sliding))]:
        writer.add_sliding_window_pattern(sliding)
    full = config.rope_parameters["full_attention"]
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(full["factor"]))
    if config.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))


def _add_tensor(w: Any, name: str, array: Any, qtypes: dict[str, str] | None) -> None:
    """Add ``array`` as float32, or in the GGML type ``qtypes`` gives the first suffix of ``name`` it ends with."""
    import gguf
    import numpy as np

    a = np.ascontiguousarray(array, dtype=np.float32)
    qtype = next((q for suffix, q in (qtypes or {}).items() if name.endswith(suffix)), None)
    if qtype is None:
        w.add_tensor(name, a)
    else:
        kind = gguf.GGMLQuantizationType[qtype]
        w.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)


def _finish(w: Any, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_to_gguf(folder: Path, path: Path, qtypes: dict[str, str] | None = None) -> Path:
    """Convert a tiny Hugging Face folder to an F32 GGUF file as llama.cpp's converter would.

    ``qtypes`` stores some tensors in block formats instead: GGUF name suffix (``"attn_q.weight"``)
    -> GGML type name (``"Q8_0"``, ``"Q5_1"``, ``"BF16"`` ..., whatever ``gguf.quants`` can write).

    Tensor names, q/k row permutation (llama only), metadata keys, the tokenizer and, for
    rope_type "llama3", the ``rope_freqs.weight`` tensor follow convert_hf_to_gguf.py.
    Mistral converts to architecture "llama", like llama.cpp does; Gemma 3 to "gemma3" with its
    norm weights stored as ``1 + w``; Phi-3 keeps its fused attn_qkv / ffn_up (gate then up).
    """
    import gguf
    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder))
    arch = {"mistral": "llama", "gemma3_text": "gemma3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}.get(
        config.model_type, config.model_type)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(folder.name)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rotary = int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(rotary)  # < head_dim: partial rotary (phi3)
    rope = config.rope_parameters
    if arch == "gemma3":
        rope = rope["full_attention"]  # the sliding layers' base is llama.cpp's fixed 10000
        _gemma3_metadata(w, config)
    if arch == "phi3":
        if rope.get("rope_type", "default") != "default":
            raise ValueError("LongRoPE Phi-3 GGUFs (rope_factors tensors) are not written here")
        if config.sliding_window:
            w.add_sliding_window(config.sliding_window)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "yarn":  # as convert_hf_to_gguf.py writes YaRN configs
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    if arch in ("qwen2moe", "qwen3moe"):  # routed experts (and qwen2moe's shared one)
        w.add_expert_count(config.num_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "shared_expert_intermediate_size", 0):
            w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    gguf_tokenizer_metadata(w)
    if config.rope_parameters.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(config))
    experts: dict[tuple[str, str], dict[int, Any]] = {}  # (layer, projection) -> expert -> matrix
    tensors = []
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if m:  # llama.cpp stacks each layer's experts: ffn_{gate,up,down}_exps [E, out, in]
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = tensor.float().numpy()
        else:
            tensors.append((name, tensor.float().numpy()))
    for (layer, proj), mats in experts.items():
        tensors.append((f"blk.{layer}.ffn_{proj}_exps.weight", np.stack([mats[e] for e in sorted(mats)])))
    for name, array in tensors:
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = _llama_cpp_permute(array, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = _llama_cpp_permute(array, kv_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            array = array + 1.0  # llama.cpp stores Gemma's (1 + w) norm multipliers
        if name in _GGUF_GLOBAL:
            gguf_name = _GGUF_GLOBAL[name]
        elif name.startswith("blk."):  # (stacked experts, named above)
            gguf_name = name
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{_GGUF_ARCH_LAYER.get(arch, {}).get(rest) or _GGUF_LAYER.get(rest) or _GGUF_MOE[rest]}"
        _add_tensor(w, gguf_name, array, qtypes)
    return _finish(w, path)


_QWEN35_LAYER = _GGUF_LAYER | {  # Qwen3.5: the post-attention norm's own name, the Gated DeltaNet layers'
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}
_QWEN35_MTP = {"fc.weight": "nextn.eh_proj.weight", "pre_fc_norm_embedding.weight": "nextn.enorm.weight",
               "pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "norm.weight": "nextn.shared_head_norm.weight"}


_QWEN3_NEXT = {"linear_attn.in_proj_ba.weight": "ssm_ba.weight"}


def _tiled(w: Any, dim: int, nk: int, rep: int, head: int) -> Any:
    """llama.cpp's value-head reorder along ``dim``: grouped (k head, rep, head) -> tiled (rep, k head, head)."""
    import numpy as np

    w = np.moveaxis(w, dim, 0)
    rest = w.shape[1:]
    w = w.reshape(nk, rep, head, *rest).swapaxes(0, 1).reshape(nk * rep * head, *rest)
    return np.ascontiguousarray(np.moveaxis(w, 0, dim))


def qwen3_5_to_gguf(folder: Path, path: Path, qtypes: dict[str, str] | None = None) -> Path:
    """A tiny Qwen3.5 folder (text model, ``mtp.*`` tensors too if it has them) as llama.cpp's
    converter writes it (conversion/qwen.py, arch "qwen35"): ssm_* names and keys, A stored as
    -exp(A_log), the conv kernel squeezed to [C, K], every norm but the gated one stored as 1 + w,
    value heads reordered from grouped to tiled, MTP as a "nextn" block after the layers."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(folder))
    tensors = load_file(str(folder / "model.safetensors"))
    n_mtp = 1 if any(k.startswith("mtp.") for k in tensors) else 0
    layers = c.num_hidden_layers
    nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    rep = nv // nk
    nxt = c.model_type == "qwen3_next"  # Qwen3-Next: qkvz split into attn_qkv / attn_gate, ba kept fused, heads grouped
    moe = c.model_type in ("qwen3_5_moe_text", "qwen3_next")
    arch = "qwen3next" if nxt else "qwen35moe" if moe else "qwen35"
    if nxt:
        for name in [n for n in tensors if n.endswith("linear_attn.in_proj_qkvz.weight")]:
            qkvz = tensors.pop(name).reshape(nk, -1, c.hidden_size)
            q, k, v, z = qkvz.split([dk, dk, rep * dv, rep * dv], dim=1)
            prefix = name.removesuffix("in_proj_qkvz.weight")
            tensors[prefix + "in_proj_qkv.weight"] = torch.cat([x.reshape(-1, c.hidden_size) for x in (q, k, v)])
            tensors[prefix + "in_proj_z.weight"] = z.reshape(-1, c.hidden_size)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(folder.name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(layers + n_mtp)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters.get("partial_rotary_factor", 0.25)))
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(nk)
    w.add_ssm_time_step_rank(nv)
    w.add_ssm_inner_size(dv * nv)
    # (keys the installed gguf package has no writer method for, by their llama.cpp names)
    w.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in c.layer_types] + [False] * n_mtp)
    w.add_uint32(f"{arch}.full_attention_interval", 4)
    if n_mtp:
        w.add_uint32(f"{arch}.nextn_predict_layers", n_mtp)
    if moe:  # routed experts stacked per layer, a gated shared expert
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
        stacked: dict[str, dict[int, Any]] = {}
        for name in [n for n in tensors if re.fullmatch(r"model\.layers\.\d+\.mlp\.experts\.\d+\..+", n)]:
            layer, _, _, e, proj, _ = name.removeprefix("model.layers.").split(".")
            stacked.setdefault(f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight", {})[int(e)] = tensors.pop(name)
        for gname, mats in stacked.items():
            tensors[gname] = torch.stack([mats[e] for e in sorted(mats)])
    gguf_tokenizer_metadata(w)
    for name, tensor in tensors.items():
        a = tensor.float().numpy()
        if name in _GGUF_GLOBAL:
            gname = _GGUF_GLOBAL[name]
        elif name.startswith("blk."):  # (stacked experts)
            gname = name
        elif name.startswith("mtp."):
            rest = name.removeprefix("mtp.")
            if rest in _QWEN35_MTP:
                gname = f"blk.{layers}.{_QWEN35_MTP[rest]}"
            else:
                gname = f"blk.{layers}.{_QWEN35_LAYER[rest.removeprefix('layers.0.')]}"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{_QWEN35_LAYER.get(rest) or _GGUF_MOE.get(rest) or _QWEN3_NEXT[rest]}"
        if rep > 1 and ".linear_attn." in name and not nxt:  # grouped -> tiled value heads
            if name.endswith("in_proj_qkv.weight"):
                a = np.concatenate([a[: 2 * nk * dk], _tiled(a[2 * nk * dk :], 0, nk, rep, dv)])
            elif name.endswith("in_proj_z.weight"):
                a = _tiled(a, 0, nk, rep, dv)
            elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
                a = _tiled(a, 0, nk, rep, 1)
            elif name.endswith("conv1d.weight"):
                a = np.concatenate([a[: 2 * nk * dk], _tiled(a[2 * nk * dk :], 0, nk, rep, dv)])
            elif name.endswith("out_proj.weight"):
                a = _tiled(a, 1, nk, rep, dv)
        if name.endswith("A_log"):
            a = -np.exp(a)
        elif name.endswith("conv1d.weight"):
            a = a[:, 0, :]
        elif gname.endswith("norm.weight") and not gname.endswith("ssm_norm.weight"):
            a = a + 1.0
        _add_tensor(w, gname, a, qtypes)
    return _finish(w, path)


_GEMMA4_LAYER = _GGUF_LAYER | _GGUF_ARCH_LAYER["gemma3"] | {  # Gemma 3's norms, then Gemma 4's own tensors
    "layer_scalar": "layer_output_scale.weight",
    "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight",
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
}
_GEMMA4_GLOBAL = _GGUF_GLOBAL | {
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}


def gemma4_to_gguf(folder: Path, path: Path, qtypes: dict[str, str] | None = None) -> Path:
    """A tiny Gemma 4 text folder as llama.cpp's converter writes it (conversion/gemma.py, arch
    "gemma4"): per-layer arrays for the sliding pattern, KV heads and MLP widths, the full layers'
    head size as key_length (the sliding ones' as key_length_swa), norms as they are, the layer
    scalar as a [1] tensor, the router's scales as ffn_gate_inp.scale / ffn_down_exps.scale, and
    proportional RoPE as ``rope_freqs`` (1 for the rotating angles, 1e30 for the others)."""
    from types import SimpleNamespace

    import gguf
    import numpy as np
    from safetensors.torch import load_file

    c = SimpleNamespace(**json.loads((folder / "config.json").read_text()))  # (transformers' config hides head_dim)
    layers, shared = c.num_hidden_layers, c.num_kv_shared_layers
    swa = [t == "sliding_attention" for t in c.layer_types]
    full = SimpleNamespace(**c.per_layer_config[str(swa.index(False))])
    full.num_key_value_heads = getattr(full, "num_key_value_heads", c.num_key_value_heads)
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_name(folder.name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(layers)
    ff = c.intermediate_size
    w.add_feed_forward_length([ff * 2 if c.use_double_wide_mlp and i >= layers - shared else ff for i in range(layers)])
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if s else full.num_key_value_heads for s in swa])
    w.add_key_length(full.head_dim)
    w.add_value_length(full.head_dim)
    w.add_key_length_swa(c.head_dim)
    w.add_value_length_swa(c.head_dim)
    w.add_rope_dimension_count(full.head_dim)
    w.add_rope_dimension_count_swa(c.head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["full_attention"]["rope_theta"]))
    w.add_rope_freq_base_swa(float(c.rope_parameters["sliding_attention"]["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_sliding_window(c.sliding_window)
    w.add_sliding_window_pattern(swa)
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(c.hidden_size_per_layer_input or 0)
    if c.final_logit_softcapping is not None:
        w.add_final_logit_softcapping(float(c.final_logit_softcapping))
    if c.enable_moe_block:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.top_k_experts)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_vocab_size(c.vocab_size)
    gguf_tokenizer_metadata(w)
    rotating = int(full.head_dim * c.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * rotating + [1e30] * (full.head_dim // 2 - rotating), dtype=np.float32))
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        if name in _GEMMA4_GLOBAL:
            gname = _GEMMA4_GLOBAL[name]
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{_GEMMA4_LAYER[rest]}"
        _add_tensor(w, gname, tensor.float().numpy(), qtypes)
    return _finish(w, path)


def gpt_oss_to_gguf(folder: Path, path: Path, qtypes: dict[str, str] | None = None) -> Path:
    """A tiny GPT-OSS folder as llama.cpp's converter writes it (conversion/gpt_oss.py, arch
    "gpt-oss"): the interleaved gate/up experts split into ffn_gate_exps / ffn_up_exps [E, I, H]
    (biases [E, I]), down as ffn_down_exps [E, H, I], sinks as attn_sinks.weight, the router as
    ffn_gate_inp; YaRN and expert keys; ``qtypes`` as in :func:`hf_to_gguf` (e.g. MXFP4 experts)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(folder))
    rope = c.rope_parameters
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_name(folder.name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(float(rope["factor"]))
    w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_sliding_window(c.sliding_window)
    w.add_expert_feed_forward_length(c.intermediate_size)
    w.add_vocab_size(c.vocab_size)
    gguf_tokenizer_metadata(w)
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
             "mlp.router.bias": "ffn_gate_inp.bias", "self_attn.o_proj.bias": "attn_output.bias"}
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        a = tensor.float().numpy()
        if name in _GGUF_GLOBAL:
            out = [(_GGUF_GLOBAL[name], a)]
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            blk = f"blk.{layer}."
            if rest == "mlp.experts.gate_up_proj":  # [E, H, 2I] -> gate / up [E, I, H]
                t = a.transpose(0, 2, 1)
                out = [(blk + "ffn_gate_exps.weight", t[:, 0::2]), (blk + "ffn_up_exps.weight", t[:, 1::2])]
            elif rest == "mlp.experts.gate_up_proj_bias":
                out = [(blk + "ffn_gate_exps.bias", a[:, 0::2]), (blk + "ffn_up_exps.bias", a[:, 1::2])]
            elif rest == "mlp.experts.down_proj":  # [E, I, H] -> [E, H, I]
                out = [(blk + "ffn_down_exps.weight", a.transpose(0, 2, 1))]
            elif rest == "mlp.experts.down_proj_bias":
                out = [(blk + "ffn_down_exps.bias", a)]
            else:
                out = [(blk + (names.get(rest) or _GGUF_LAYER[rest]), a)]
        for gname, arr in out:
            _add_tensor(w, gname, arr, qtypes)
    return _finish(w, path)


def load_reference(folder: Path) -> Any:
    """The transformers model stored in ``folder``, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@torch.inference_mode()
def reference_logits(model: Any, ids: list[int] | torch.Tensor) -> torch.Tensor:
    """Full-sequence logits ``[T, V]`` from a transformers causal LM (no cache)."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    return model(input_ids=ids.unsqueeze(0), use_cache=False).logits[0].float()


# --------------------------------------------------------------- SentencePiece GGUF tokenizers


def make_spm_gguf(path: Path, arch: str) -> Path:
    """A tokenizer-only GGUF with a small SentencePiece ("llama") vocabulary, as llama.cpp writes
    Llama-2 / Phi-3 / Gemma files: "▁"-spelled pieces learned on the tiny corpus, 256 byte-fallback
    tokens ``<0x00>``.. (type BYTE), control and user-defined tokens (one spelled with real
    spaces, as Gemma files store whitespace tokens), and scores with ties (every three pieces
    share one), so merge recovery has to break ties the way transformers does. The arch keys are
    the minimum transformers needs to read a config."""
    import gguf
    from tokenizers import models as tok_models

    backend = _Backend(tok_models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, show_progress=False)
    backend.train_from_iterator(_CORPUS * 4, trainer=trainer)
    vocab: dict[str, int] = json.loads(backend.to_str())["model"]["vocab"]
    learned = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    extra = ["<start_of_turn>", "<think>", "  ", "\n\n"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256)), *learned, *extra]
    types = [2, 3, 3] + [6] * 256 + [1] * len(learned) + [3, 4, 4, 4]  # unknown, control, byte, normal, user
    scores = [0.0] * 259 + [-float(i // 3) for i in range(len(learned))] + [0.0] * len(extra)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(4)
    w.add_value_length(4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    return _finish(w, path)


class ProposalRecorder:
    """Wraps a feature drafter's proposals (EAGLE-3, MTP, the Gemma 4 assistant): (committed tokens,
    proposed chain) per step, in ``log``."""

    def __init__(self, drafter: Any) -> None:
        self.log: list[tuple[list[int], list[int]]] = []
        inner = drafter.drafting

        def drafting(k: int) -> Any:
            draft = yield from inner(k)
            self.log.append((list(drafter.tokens), draft.tokens.tolist()))
            return draft

        drafter.drafting = drafting
