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

from quickdraft.config import (
    Family,
    GGUFMetadata,
    ModelConfig,
    family_of,
    gguf_architectures,
    gguf_family,
)
from quickdraft.errors import QuickdraftError
from quickdraft.loading.gguf_file import GGUFFile, release_pages
from quickdraft.pages import weight_buffer

# llama.cpp's layer tensor names -> Hugging Face ones; a family's own (:attr:`Family.gguf_tensor_names`)
# come first.
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
# Multi-token-prediction ("nextn") blocks after the model's layers: llama.cpp's names -> the
# checkpoint's mtp.* ones (their decoder layer's tensors keep the standard block names).
_NEXTN_NAMES = {
    "nextn.eh_proj.weight": "fc.weight",
    "nextn.enorm.weight": "pre_fc_norm_embedding.weight",
    "nextn.hnorm.weight": "pre_fc_norm_hidden.weight",
    "nextn.shared_head_norm.weight": "norm.weight",
}
_NEXTN_SHARED = ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight")  # copies of the target's
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",  # Gemma 4's per-layer embeddings
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
_NO_FAMILY = Family(model_types=())  # the defaults: a config no family built
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
    """The config of a GGUF file: the fields every family shares, read from llama.cpp's common
    keys here; the family's own (and its conventions for shared ones) by its
    :attr:`Family.read_gguf`; routed experts from llama.cpp's common ``expert_*`` keys unless the
    family reads its own."""
    arch = meta.get("general.architecture")
    found = gguf_family(str(arch))
    if found is None:
        supported = ", ".join(sorted(gguf_architectures()))
        raise QuickdraftError(f"GGUF architecture {arch!r} is not supported; supported: {supported}")
    model_type, family = found
    view = GGUFMetadata(meta, frozenset(tensor_names))
    cfg = _shared_fields(view, model_type)
    cfg = dataclasses.replace(cfg, **family.read_gguf(view, cfg))
    if view.optional("expert_count") and family.gguf_experts:
        cfg = dataclasses.replace(cfg, **_moe_fields(view, cfg, family.gguf_norm_topk))
    return cfg


def _shared_fields(meta: GGUFMetadata, model_type: str) -> ModelConfig:
    """The fields every family shares, from llama.cpp's common keys."""

    def first(value: Any) -> Any:  # per-layer arrays (Gemma 4): the first layer's here, the rest per family
        return value[0] if isinstance(value, list | tuple) else value

    heads = int(meta.get("attention.head_count"))
    hidden = int(meta.get("embedding_length"))
    tokens = meta.values.get("tokenizer.ggml.tokens") or []
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(meta.optional("vocab_size") or len(tokens)),
        hidden_size=hidden,
        intermediate_size=int(first(_feed_forward_length(meta) or meta.get("feed_forward_length"))),
        num_hidden_layers=int(meta.get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(first(meta.get("attention.head_count_kv", heads))),
        head_dim=int(meta.get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(meta.get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta.get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta),
        max_position_embeddings=int(meta.get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in meta.tensor_names,
        attention_bias="blk.0.attn_q.bias" in meta.tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in meta.tensor_names,
    )


def _rope_scaling(meta: GGUFMetadata) -> dict[str, Any] | None:
    """Linear or YaRN RoPE scaling, llama.cpp's keys as transformers' fields."""
    kind = meta.optional("rope.scaling.type")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta.get("rope.scaling.factor"))}
    if kind != "yarn":
        return None
    scaling = {"rope_type": "yarn", "factor": float(meta.get("rope.scaling.factor")),
               "original_max_position_embeddings": int(meta.get("rope.scaling.original_context_length"))}
    for key, field in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
        if meta.optional(key) is not None:
            scaling[field] = float(meta.optional(key))
    return scaling


def _feed_forward_length(meta: GGUFMetadata) -> Any:
    """The dense MLP width; for a MoE file without one (llama.cpp's Qwen3.5-MoE converter writes no
    ``feed_forward_length``: every layer is routed) the shared expert's, else the routed experts'."""
    value = meta.optional("feed_forward_length")
    if value is None and meta.optional("expert_count"):
        value = meta.optional("expert_shared_feed_forward_length") or meta.optional("expert_feed_forward_length")
    return value


def _moe_fields(meta: GGUFMetadata, cfg: ModelConfig, norm_topk: bool) -> dict[str, Any]:
    """Routed experts (``expert_*`` keys); layers with a plain MLP (``ffn_gate``) stay dense;
    ``norm_topk``: the family's top-k renormalisation where the file does not say."""
    shared = int(meta.optional("expert_shared_feed_forward_length") or 0)
    norm = meta.optional("expert_weights_norm")
    return {
        "num_experts": int(meta.get("expert_count")),
        "num_experts_per_tok": int(meta.optional("expert_used_count") or 1),
        "moe_intermediate_size": int(meta.optional("expert_feed_forward_length") or cfg.intermediate_size),
        "shared_expert_intermediate_size": shared,
        "norm_topk_prob": bool(norm) if norm is not None else norm_topk,
        "mlp_only_layers": tuple(i for i in range(cfg.num_hidden_layers)
                                 if f"blk.{i}.ffn_gate.weight" in meta.tensor_names),
    }


def with_rope_factors(cfg: ModelConfig, factors: list[float]) -> ModelConfig:
    """The config with a file's ``rope_freqs`` divisors, as its family reads them (Llama 3.1's
    per-frequency scaling unless the family says otherwise)."""
    return (family_of(cfg.model_type) or _NO_FAMILY).with_rope_factors(cfg, factors)


def rope_freq_factors(reader: GGUFFile) -> list[float] | None:
    """Llama 3.1+ GGUFs keep their RoPE scaling as per-frequency divisors in ``rope_freqs.weight``."""
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            return [float(v) for v in np.asarray(dequantize(t.data, t.tensor_type)).reshape(-1)]
    return None


def hf_name(gguf_name: str, model_type: str | None = None, layers: int | None = None) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (None if unknown);
    ``model_type`` selects its family's own names (:attr:`Family.gguf_tensor_names`); blocks from
    ``layers`` on are multi-token-prediction blocks (``mtp.*`` names, "" for the target's copies)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m is None:
        return None
    block, rest = int(m.group(1)), m.group(2)
    family = family_of(model_type or "")
    names = family.gguf_tensor_names.get(model_type or "", {}) if family is not None else {}
    local = names.get(rest) or _LAYER_NAMES.get(rest)
    if layers is not None and block >= layers:
        if rest in _NEXTN_SHARED:
            return ""
        if rest in _NEXTN_NAMES:
            return f"mtp.{_NEXTN_NAMES[rest]}" if block == layers else None
        return None if local is None or block != layers else f"mtp.layers.0.{local}"
    return None if local is None else f"model.layers.{block}.{local}"


def _quant_tensor(t: Any, name: str, cfg: ModelConfig, permute: bool) -> QuantTensor:
    raw = np.asarray(t.data)  # [N, row_bytes] view of the memory map
    if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = cfg.num_attention_heads if name.endswith("q_proj.weight") else cfg.num_key_value_heads
        raw = _unpermute(raw, heads)  # a permutation of whole rows, so blocks stay intact
    dims = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first: [N, K] or [E, N, K]
    copy = torch.from_numpy(copy_out(raw.view(np.uint8).reshape(*dims[:-1], -1)))  # (F16 / BF16: their bytes)
    release_pages(t.data)
    return QuantTensor(t.tensor_type, copy, dims)


COPY_SLAB_BYTES = 16 << 20


def copy_out(view: np.ndarray) -> np.ndarray:
    """A copy of ``view`` (a tensor's bytes in a file's memory map) in a weight buffer (huge pages), made
    COPY_SLAB_BYTES of rows at a time, each slab's pages released once copied: a 262k-row embedding table
    is never resident twice."""
    out = weight_buffer(view.shape)  # (uint8: a tensor's bytes)
    src, dst = view.reshape(-1, view.shape[-1]), out.reshape(-1, view.shape[-1])
    step = max(1, COPY_SLAB_BYTES // max(1, src.strides[0]))
    for r0 in range(0, src.shape[0], step):
        dst[r0 : r0 + step] = src[r0 : r0 + step]
        release_pages(src[r0 : r0 + step])
    return out


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
    family = family_of(cfg.model_type) or _NO_FAMILY
    permute = family.gguf_permute_qk
    dequantized = DequantizedTypes()
    layers = cfg.num_hidden_layers if family.gguf_mtp_blocks else None
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
        if family.gguf_norm_plus_one and t.name.endswith("norm.weight") and not t.name.endswith(family.gguf_norms_as_is):
            w = w - np.float32(1.0)
        w = family.gguf_tensor(name, w)
        if name.endswith(".shared_expert_gate.weight") and w.ndim == 1:  # llama.cpp's [H] -> the gate's [1, H]
            w = w[None, :]
        yield name, torch.from_numpy(np.ascontiguousarray(w))
    dequantized.report()
