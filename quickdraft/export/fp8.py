"""Write an FP8 copy of any model quickdraft loads, as a self-contained Hugging Face folder.

The source (zoo name, GGUF file, Hugging Face folder, even an FP8 folder) is loaded through
:func:`quickdraft.loading.load.load_model` in float32, so GGUF blocks are dequantized exactly and
every architecture quickdraft builds is covered; peak memory is therefore about 4 bytes per
parameter plus the output. Every ``nn.Linear`` weight (``FP8Linear`` too, requantized) except the
output head (unless asked) and MoE routers (a module named ``gate``) becomes float8_e4m3fn with
``s = amax / 448`` (or least-squared-error, ``observer="mse"``) scales per output channel or per
128x128 block; embeddings, norms and biases are stored in bf16. The folder uses the compressed-tensors layout (``X.weight`` + ``X.weight_scale``,
``quantization_config`` with ``quant_method: "compressed-tensors"``, ``format: "float-quantized"``,
weight-only: ``input_activations: null``), which vLLM and transformers also read (checked once by
hand: transformers 5.24 with compressed-tensors 0.20.1 loads a tiny exported folder, channel and
block scales, to quickdraft's logits within 2e-6).

Tokenizer files are copied from a Hugging Face source; for a GGUF source they are written from
the GGUF tokenizer (``tokenizer.json`` from the rebuilt fast tokenizer, ``tokenizer_config.json``
with the special tokens, ``add_bos_token`` and ``chat_template``, stop ids in ``config.json``),
which is what :meth:`quickdraft.tokenizer.Tokenizer.from_hf_dir` reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from quickdraft import __version__
from quickdraft.config import ModelConfig, family_of
from quickdraft.errors import QuickdraftError
from quickdraft.quant.fp8 import DEFAULT_BLOCK, OBSERVERS, FP8Linear, quantize_fp8
from quickdraft.tokenizer import Tokenizer

SCHEMES = ("channel", "block")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
)
_KEPT_MODULES = ("gate",)  # MoE routers: tiny, and their choices are sensitive to rounding


@dataclasses.dataclass(frozen=True)
class ExportResult:
    path: Path
    quantized: list[str]  # modules stored in FP8
    kept: list[str]  # Linear modules kept in bf16
    bytes_written: int


def quantization_config(
    scheme: str, block: tuple[int, int], ignore: list[str], observer: str = "minmax"
) -> dict[str, Any]:
    """compressed-tensors ``quantization_config`` for FP8 weights (weight-only, static scales)."""
    weights = {
        "num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
        "strategy": "channel" if scheme == "channel" else "block",
        "block_structure": None if scheme == "channel" else list(block),
        "group_size": None, "actorder": None, "observer": observer, "observer_kwargs": {},
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"], "weights": weights,
                "input_activations": None, "output_activations": None, "format": "float-quantized",
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
        "quantization_tool": f"quickdraft {__version__}",
    }


def hf_config_dict(cfg: ModelConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    """A config.json that :meth:`ModelConfig.from_hf_dict` reads back to ``cfg`` (for GGUF sources).

    Unknown fields kept in ``cfg.extra`` are written as they are; ``qk_norm`` follows from the
    model type. RoPE scaling from GGUF ``rope_freqs`` is written as quickdraft's own
    ``{"rope_type": "freq_factors", ...}`` (transformers does not know it).
    """
    d: dict[str, Any] = {k: v for k, v in cfg.extra.items() if k != "quantization_config"}
    for f in dataclasses.fields(cfg):
        if f.name not in ("extra", "qk_norm", "family"):
            d[f.name] = getattr(cfg, f.name)
    d.update(dataclasses.asdict(cfg.family))  # (a family's own fields have their config.json names)
    d["use_sliding_window"] = cfg.sliding_window is not None
    family = family_of(cfg.model_type)
    if family is not None and family.hf_architecture:
        d.setdefault("architectures", [family.hf_architecture])
    d.setdefault("hidden_act", "silu")
    if tokenizer.bos_id is not None:
        d["bos_token_id"] = tokenizer.bos_id
    if tokenizer.eos_ids:
        eos = sorted(tokenizer.eos_ids)
        d["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return d


def write_tokenizer_files(tokenizer: Tokenizer, out: Path) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` for a tokenizer read from GGUF metadata."""
    tokenizer.backend.save(str(out / "tokenizer.json"))
    specials = tokenizer._specials  # the ids the GGUF file named
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": tokenizer.add_bos,
        "add_eos_token": specials.add_eos,
        "clean_up_tokenization_spaces": False,
    }
    for key, token_id in (
        ("bos_token", specials.bos_id), ("eos_token", specials.eos_id),
        ("unk_token", specials.unk_id), ("pad_token", specials.pad_id),
    ):
        token = tokenizer.id_to_token(token_id) if token_id is not None else None
        if token is not None:
            config[key] = token
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _quantizable(name: str, module: nn.Module, cfg: ModelConfig, lm_head: bool) -> bool:
    if not isinstance(module, nn.Linear | FP8Linear):
        return False
    if name == "lm_head":
        return lm_head and not cfg.tie_word_embeddings
    return name.rpartition(".")[2] not in _KEPT_MODULES


def _float_weight(module: nn.Module) -> torch.Tensor:
    if isinstance(module, FP8Linear):
        return module.dequantize(torch.float32)
    return module.weight.detach().float()  # type: ignore[union-attr, operator]


def export_fp8(
    spec: str,
    out: str | Path,
    scheme: str = "channel",
    block: tuple[int, int] = DEFAULT_BLOCK,
    quantize_lm_head: bool = False,
    observer: str = "minmax",
    overwrite: bool = False,
    log: Callable[[str], None] = lambda _msg: None,
) -> ExportResult:
    """Quantize ``spec``'s Linear weights to FP8 and write a Hugging Face folder at ``out``
    (kept whole, over 60 lines: the checks, one pass over the Linear layers and the rest of the
    state, then the folder written under a temporary name and moved in place).

    ``observer``: "minmax" (``s = amax / 448``) or "mse" (least-squared-error scale per channel /
    block; about 20 times slower to quantize). See :func:`quickdraft.quant.fp8.quantize_fp8`.
    """
    from quickdraft.loading.load import load_model

    if scheme not in SCHEMES:
        raise QuickdraftError(f"unknown FP8 scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if min(block) < 1:
        raise QuickdraftError(f"block sizes must be positive, got {block}")
    if observer not in OBSERVERS:
        raise QuickdraftError(f"unknown FP8 observer {observer!r}; choose one of {', '.join(OBSERVERS)}")
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise QuickdraftError(f"{out} already exists and is not empty; choose another --out or pass --overwrite")
    log(f"loading {spec} (float32) ...")
    loaded = load_model(spec, dtype="float32", max_context=16)
    model, cfg = loaded.model, loaded.config
    state: dict[str, torch.Tensor] = {}
    quantized: list[str] = []
    kept: list[str] = []
    handled: set[str] = set()
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear | FP8Linear):
            continue
        if not _quantizable(name, module, cfg, quantize_lm_head):
            kept.append(name)  # a tied lm_head too: it is the (bf16) embedding
            continue
        q, scale = quantize_fp8(_float_weight(module), None if scheme == "channel" else block, observer)
        state[f"{name}.weight"], state[f"{name}.weight_scale"] = q, scale
        if module.bias is not None:
            state[f"{name}.bias"] = module.bias.detach().to(torch.bfloat16)
        handled.add(name)
        quantized.append(name)
    if not quantized:
        raise QuickdraftError(f"{spec} has no Linear layers to quantize")
    for key, tensor in model.state_dict().items():
        owner = key.rpartition(".")[0]
        if owner in handled or key in state or (key == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        state[key] = tensor.detach().to(torch.bfloat16) if tensor.is_floating_point() else tensor

    tmp = out.with_name(out.name + f".partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        log(f"writing {len(quantized)} FP8 layers to {out} ...")
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_config(loaded.path, cfg, loaded.tokenizer, tmp, quantization_config(scheme, block, kept, observer))
        _write_tokenizer(loaded.path, loaded.tokenizer, tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in out.iterdir())
    return ExportResult(out, quantized, kept, size)


def _write_config(source: Path, cfg: ModelConfig, tok: Tokenizer, out: Path, qc: dict[str, Any]) -> None:
    if source.is_dir():
        d = json.loads((source / "config.json").read_text())
        d.pop("compression_config", None)
    else:
        d = hf_config_dict(cfg, tok)
    d["quantization_config"] = qc
    d["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(d, indent=2) + "\n", encoding="utf-8")


def _write_tokenizer(source: Path, tok: Tokenizer, out: Path) -> None:
    if source.is_dir():
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, out / name)
    else:
        write_tokenizer_files(tok, out)


__all__ = ["SCHEMES", "ExportResult", "export_fp8", "hf_config_dict", "quantization_config", "write_tokenizer_files"]
