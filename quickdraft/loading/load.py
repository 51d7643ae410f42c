"""``load_model(spec)``: a zoo name, a .gguf file, a Hugging Face folder or a hub id -> ready model."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from quickdraft import zoo
from quickdraft.config import ModelConfig
from quickdraft.errors import QuickdraftError
from quickdraft.loading import gguf as gguf_io
from quickdraft.loading import safetensors as st_io
from quickdraft.loading.weights import load_weights
from quickdraft.models import build_model
from quickdraft.models.llama import CausalLM
from quickdraft.tokenizer import Tokenizer

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
DEFAULT_MAX_CONTEXT = 8192
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path
    load_seconds: float


def resolve(spec: str) -> Path:
    """Where the model named by ``spec`` lives locally, fetching zoo models on first use."""
    path = Path(spec).expanduser()
    if path.exists():
        return path
    if zoo.lookup(spec) is not None:
        return zoo.fetch(spec)
    if spec.endswith(".gguf") or "/" in spec and not _HUB_ID.match(spec) or spec.startswith((".", "~")):
        raise QuickdraftError(f"no such file or folder: {spec}")
    if _HUB_ID.match(spec):
        return _hub_download(spec)
    known = ", ".join(zoo.names())
    raise QuickdraftError(f"unknown model {spec!r}; use a zoo name ({known}), a .gguf file, or a model folder")


def _hub_download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise QuickdraftError(
            f"{repo_id!r} looks like a Hugging Face hub id, but huggingface_hub is not installed; "
            "pip install huggingface_hub, or pass a local path or a zoo name"
        ) from None
    patterns = ["config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*", "generation_config.json", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:
        raise QuickdraftError(
            f"could not download {repo_id!r} from the Hugging Face hub ({type(exc).__name__}); "
            "check the id and your connection, or pass a local path or a zoo name (quickdraft models list)"
        ) from None


def load_model(
    spec: str, dtype: str = "bfloat16", device: str = "cpu", max_context: int | None = None
) -> LoadedModel:
    """Load weights, config and tokenizer. ``dtype="float32"`` is the exact mode used by tests."""
    if dtype not in DTYPES:
        raise QuickdraftError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    t0 = time.perf_counter()
    path = resolve(spec)
    if path.is_dir():
        cfg = st_io.read_config(path)
        tokenizer = Tokenizer.from_hf_dir(path)
        tensors = st_io.iter_tensors(path)
    else:
        reader = gguf_io.open_gguf(path)
        meta = gguf_io.metadata(reader)
        cfg = gguf_io.config_from_metadata(meta, {t.name for t in reader.tensors})
        tokenizer = Tokenizer.from_gguf_metadata(meta)
        tensors = gguf_io.iter_tensors(reader, cfg)
    max_len = _context_length(cfg, max_context)
    with torch.device("meta"):
        model = build_model(cfg, max_len)
    assert isinstance(model, CausalLM)
    model.materialize(device, DTYPES[dtype])
    load_weights(model, tensors, tied=cfg.tie_word_embeddings)
    model.eval()
    return LoadedModel(model, tokenizer, cfg, path, time.perf_counter() - t0)


def _context_length(cfg: ModelConfig, requested: int | None) -> int:
    limit = cfg.max_position_embeddings
    if cfg.sliding_window:
        limit = min(limit, cfg.sliding_window)
    if requested is None:
        return min(limit, DEFAULT_MAX_CONTEXT)
    if requested < 16:
        raise QuickdraftError(f"--max-context must be at least 16, got {requested}")
    if requested > limit:
        raise QuickdraftError(f"--max-context {requested} exceeds what this model supports ({limit})")
    return requested
