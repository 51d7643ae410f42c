"""``load_model(spec)``: a zoo name, a .gguf file, a Hugging Face folder or a hub id -> ready model."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from quickdraft import kept, zoo
from quickdraft.cache import Q8_0
from quickdraft.config import DTYPE_CHOICES, KV_DTYPE_CHOICES, ModelConfig
from quickdraft.errors import QuickdraftError
from quickdraft.loading import gguf as gguf_io
from quickdraft.loading import prepared
from quickdraft.loading import safetensors as st_io
from quickdraft.loading.gguf import QuantTensor
from quickdraft.loading.weights import load_weights
from quickdraft.models import build_model
from quickdraft.models.causal_lm import CausalLM
from quickdraft.quant.fp8 import FP8Tensor, fp8_format, fp8_tensors
from quickdraft.tokenizer import Tokenizer

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
assert set(DTYPE_CHOICES) == {"auto", *DTYPES}
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
    spec: str, dtype: str = "auto", device: str = "cpu", max_context: int | None = None, kv_dtype: str = "auto"
) -> LoadedModel:
    """Load weights, config and tokenizer.

    dtype "auto": a GGUF model keeps its quantized blocks (computed on by the CPU kernels, fp32
    activations) where the kernels are available, else bfloat16; "float32" is the exact
    reference mode used by tests; "bfloat16" / "float16" dequantize into that dtype.
    kv_dtype "auto": float16 keys and values where the CPU kernels run the model (half the memory
    and bandwidth of fp32; every pass reads them the same way, so speculation stays lossless),
    else the activation dtype; or "float32" / "float16" / "bfloat16" explicitly; "q8_0" (CPU
    kernels' path only): GGML Q8_0 blocks, each row quantized alone, as losslessly reused.
    """
    with _freed_blocks_returned():
        return _load_model(spec, dtype, device, max_context, kv_dtype)


# glibc's malloc (M_MMAP_THRESHOLD, -3 in malloc.h): allocations of at least this many bytes get
# mappings of their own, given back to the system when freed. A load frees every weight block it
# repacks into the kernels' layout; under glibc's default (a threshold that rises to 32 MiB after
# the first large free) those blocks come from heap arenas that do not shrink, and the resident size
# of a Q8_0 1.5B model reached 2x its file (3.5 GB for 1.8 GB, measured on Zen 4 with 2 threads).
_M_MMAP_THRESHOLD = -3
_LOAD_MMAP_THRESHOLD = 1 << 20
_RUN_MMAP_THRESHOLD = 32 << 20  # afterwards: glibc's own upper bound, as its dynamic rule would reach


@contextlib.contextmanager
def _freed_blocks_returned() -> Iterator[None]:
    """During a load, large blocks in mappings of their own (glibc only; elsewhere nothing)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        yield
        return
    mallopt(_M_MMAP_THRESHOLD, _LOAD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, _RUN_MMAP_THRESHOLD)


def _load_model(spec: str, dtype: str, device: str, max_context: int | None, kv_dtype: str) -> LoadedModel:
    if dtype not in DTYPE_CHOICES:
        raise QuickdraftError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    if kv_dtype not in KV_DTYPE_CHOICES:
        raise QuickdraftError(f"unknown KV cache dtype {kv_dtype!r}; choose one of {', '.join(KV_DTYPE_CHOICES)}")
    t0 = time.perf_counter()
    path = resolve(spec)
    quantized = dtype == "auto" and path.is_file() and _kernels_available(device)
    ready: prepared.Prepared | None = None
    dtype = "float32" if quantized else ("bfloat16" if dtype == "auto" else dtype)
    tensors: Iterator[tuple[str, torch.Tensor | QuantTensor | FP8Tensor]]
    converted = converted_path(path, dtype) if not quantized and _is_zoo_file(path) else None
    if path.is_dir():
        cfg = st_io.read_config(path)
        tokenizer = Tokenizer.from_hf_dir(path)
        tensors = st_io.iter_tensors(path)
        if (fp8 := fp8_format(cfg.extra)) is not None:  # FP8 checkpoint: pair weights with scales
            tensors = fp8_tensors(st_io.iter_tensors(path), fp8)
    elif converted is not None and (kept_config := converted_config(converted)) is not None:
        cfg = kept_config
        tokenizer = Tokenizer.from_gguf(path)
        tensors = st_io.iter_file(converted)
    elif quantized and (ready := prepared.open_prepared(path)) is not None:  # mapped, already repacked
        cfg, tokenizer, tensors = ready.config, ready.tokenizer, ready.tensors()
    else:
        reader = gguf_io.open_gguf(path)
        meta = gguf_io.metadata(reader)
        try:
            cfg = gguf_io.config_from_metadata(meta, {t.name for t in reader.tensors})
        except QuickdraftError as exc:
            raise QuickdraftError(f"{path.name}: {exc}") from None
        if (factors := gguf_io.rope_freq_factors(reader)) is not None:
            cfg = gguf_io.with_rope_factors(cfg, factors)
        tokenizer = Tokenizer.from_gguf_metadata(meta)
        tensors = gguf_io.iter_tensors(reader, cfg, keep_quantized=quantized)
    max_len = _context_length(cfg, max_context)
    with torch.device("meta"):
        model = build_model(cfg, max_len)
    assert isinstance(model, CausalLM)
    model.materialize(device, DTYPES[dtype])
    if kv_dtype == Q8_0 and not quantized:
        raise QuickdraftError(
            "--kv-dtype q8_0 needs the CPU kernels' path (a GGUF model with --dtype auto on the CPU, kernels "
            "built); use float16 or float32 here"
        )
    model.kv_dtype = torch.float16 if kv_dtype == "auto" and quantized else Q8_0 if kv_dtype == Q8_0 else DTYPES.get(kv_dtype)
    tensors = model.convert_checkpoint(tensors)  # MoE models: expert layouts and names
    recorder = None
    if quantized and ready is None and not model.converts_checkpoint and prepared.wanted(path):
        recorder = prepared.Recorder(path)
        tensors = recorder.watch(tensors)
    load_weights(model, tensors, tied=cfg.tie_word_embeddings)
    model.eval()
    if quantized:
        prepared.set_kernel_layouts(model)  # (else at the first pass)
    if recorder is not None:
        recorder.save(model, cfg, tokenizer)
    if converted is not None and not converted.is_file():
        save_converted(model, cfg, converted)
    return LoadedModel(model, tokenizer, cfg, path, time.perf_counter() - t0)


def _kernels_available(device: str) -> bool:
    if torch.device(device).type != "cpu":
        return False
    from quickdraft.quant.ggml import kernels_available

    return kernels_available()


def _is_zoo_file(path: Path) -> bool:
    """Conversions are cached for zoo models only: one per model and dtype, never for scratch files."""
    return path.is_file() and path.parent == zoo.cache_dir() / "models"


def converted_path(gguf_path: Path, dtype: str) -> Path:
    """Where the dequantized weights of a GGUF file are kept, so later loads skip dequantizing.

    Keyed by name, size and modification time: a replaced file gets a new conversion.
    """
    st = gguf_path.stat()
    return zoo.cache_dir() / "converted" / f"{gguf_path.stem}-{st.st_size}-{int(st.st_mtime)}-{dtype}.safetensors"


def converted_config(path: Path) -> ModelConfig | None:
    """The config kept with the converted weights at ``path``; None where there are none. A damaged
    file (cut short, garbled, another version's config) is removed, with one line on stderr, and
    the GGUF is converted again."""
    if not path.is_file():
        return None
    try:
        meta = st_io.file_metadata(path)
        return ModelConfig.from_json_dict(json.loads(meta["quickdraft.config"]))
    except (QuickdraftError, KeyError, TypeError, ValueError) as exc:
        kept.discard(path)
        print(f"converted weights {path} are damaged ({kept.one_line(exc)}); removed it, converting again",
              file=sys.stderr, flush=True)
        return None


def save_converted(model: CausalLM, cfg: ModelConfig, dest: Path) -> None:
    """Write the loaded weights whole or not at all (a temporary file beside ``dest``, flushed to
    disk, renamed over it); a failure (disk full, read-only cache) only warns, once."""
    tmp = dest.with_name(f".{dest.stem}.partial-{os.getpid()}.tmp")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        kept.remove_stale_temps(dest)
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight" or not cfg.tie_word_embeddings}
        save_file(state, str(tmp), metadata={"quickdraft.config": json.dumps(cfg.to_json_dict())})
        with open(tmp, "rb+") as fh:
            kept.flush_to_disk(fh)
        os.replace(tmp, dest)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        kept.warn_unkept(dest.parent, f"could not keep converted weights in {dest.parent} ({kept.one_line(exc)}); "
                                      "the GGUF is converted again at each start")


def _context_length(cfg: ModelConfig, requested: int | None) -> int:
    limit = cfg.max_position_embeddings
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "yarn":  # e.g. Qwen2.5's 32k config with factor 4: 128k
        from quickdraft.models.layers import yarn_factors

        factor, original = yarn_factors(cfg, scaling)
        limit = max(limit, int(factor * original))
    if cfg.sliding_window and cfg.layer_types is None:  # with layer_types the window is computed
        limit = min(limit, cfg.sliding_window)
    if requested is None:
        return min(limit, DEFAULT_MAX_CONTEXT)
    if requested < 16:
        raise QuickdraftError(f"--max-context must be at least 16, got {requested}")
    if requested > limit:
        raise QuickdraftError(f"--max-context {requested} exceeds what this model supports ({limit})")
    return requested
