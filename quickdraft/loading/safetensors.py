"""Hugging Face model folders: config.json + *.safetensors (single file or sharded with an index)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from quickdraft.config import ModelConfig, model_types
from quickdraft.errors import QuickdraftError


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise QuickdraftError(f"{folder} has no config.json; pass a Hugging Face model folder or a .gguf file")
    try:
        return ModelConfig.from_hf_dict(json.loads(path.read_text()), supported=model_types())
    except json.JSONDecodeError as exc:
        raise QuickdraftError(f"{path} is not valid JSON: {exc}") from None


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise QuickdraftError(f"the safetensors index names files that are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise QuickdraftError(f"{folder} has no *.safetensors files")
    return files


def iter_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in weight_files(folder):
        yield from iter_file(path)


def iter_file(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)
    except (SafetensorError, OSError) as exc:
        raise QuickdraftError(f"{path} is not a readable safetensors file ({exc}); download it again") from None


def file_metadata(path: Path) -> dict[str, str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except (SafetensorError, OSError) as exc:
        raise QuickdraftError(f"{path} is not a readable safetensors file ({exc}); delete it") from None
