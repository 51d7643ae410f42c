"""Prepared weights: a GGUF model kept in the cache folder as the CPU kernels compute on it.

Loading a GGUF file for the q8 kernels parses its metadata and tokenizer (~1 s for a 150k
vocabulary), copies every block out of the memory map (~1 s per GB) and repacks the Q4_K / Q6_K /
32-block matrices into the kernels' lane layout (~1.3 s for Qwen2.5-Coder-1.5B). None of it
depends on anything but the file and the kernel build, so the first load writes the result next to
the other cached files and every later start maps it instead::

    <cache>/prepared/<gguf stem>-<key digest>/
        index.json      key, ModelConfig, tokenizer state (specials, template, fingerprint), and
                        per tensor: name, offset, shape, dtype or GGML type + layout
        tokenizer.json  the tokenizers backend, as ``tokenizers.Tokenizer.to_str`` wrote it
        weights.bin     every tensor, 64-byte aligned, blocks already in their kernel layout

A later load maps ``weights.bin`` copy-on-write, copies each block matrix out of the map into
memory in transparent huge pages (:mod:`quickdraft.pages`; a page-cache copy, ~0.1 s per GB once the
file is cached, that makes a decode step's weight stream ~15% faster than reading the mapped 4 KiB
pages: Qwen2.5-Coder-1.5B Q4_K_M 15.7 -> 18.1 tok/s on 2 Xeon cores) and builds the tokenizer from
its JSON. The values are the bytes the GGUF path produces, so results are bitwise the same either
way (tests check it).

The key is the GGUF's resolved path, size and modification time, the kernel build
(:func:`quickdraft.kernels.build_name`, which changes with any kernel source) and :data:`FORMAT`:
a replaced file or a new build gets a new folder (the old one of the same file is removed), and a
damaged folder (a missing or short file, an index that is garbled, of another format or not
consistent with weights.bin) is removed and rebuilt, the reason printed in one line. Files under
:data:`MIN_BYTES` load quickly anyway and are not prepared; at most :data:`MAX_ENTRIES` models are
kept (least recently used go first). ``QUICKDRAFT_PREPARED=0`` turns it off. Writing follows
quickdraft.kept's rules: atomic (a temporary folder, its files flushed to disk, renamed; one a
killed process left is removed by a later write), and a cache folder that cannot be written
(read-only, disk full) only warns, once per process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from quickdraft import kept, zoo
from quickdraft.config import ModelConfig
from quickdraft.loading.gguf import GGMLQuantizationType, QuantTensor, copy_out
from quickdraft.tokenizer import Tokenizer

if TYPE_CHECKING:
    from quickdraft.models.causal_lm import CausalLM

FORMAT = 2  # bump when the folder's layout or meaning changes (2: the config keeps a family's own fields apart)
MIN_BYTES = 32 << 20
MAX_ENTRIES = 8
_ALIGN = 64
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

Tensors = Iterable[tuple[str, Any]]


def enabled() -> bool:
    return os.environ.get("QUICKDRAFT_PREPARED", "1").strip().lower() not in ("0", "false", "no", "off")


def root() -> Path:
    return zoo.cache_dir() / "prepared"


def key(gguf: Path) -> dict[str, Any]:
    """What the prepared copy of ``gguf`` depends on."""
    from quickdraft import kernels

    st = gguf.stat()
    return {
        "format": FORMAT,
        "path": str(gguf.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "kernels": kernels.build_name(),
    }


def folder(gguf: Path, k: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:16]
    return root() / f"{gguf.stem}-{digest}"


def wanted(gguf: Path) -> bool:
    """Whether ``gguf`` is worth preparing (on, a file, large enough)."""
    return enabled() and gguf.is_file() and gguf.stat().st_size >= MIN_BYTES


@dataclass
class Prepared:
    """An opened prepared folder: config, tokenizer and the tensors as ``load_weights`` takes them."""

    config: ModelConfig
    tokenizer: Tokenizer
    entries: list[dict[str, Any]]
    weights: np.ndarray  # uint8 copy-on-write map of weights.bin

    def tensors(self) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        for e in self.entries:
            view = self.weights[e["offset"] : e["offset"] + e["nbytes"]]
            if e["kind"] == "quant":  # copied out of the map into huge pages (quickdraft.pages: ~15% faster decode)
                raw = torch.from_numpy(copy_out(view.reshape(int(e["shape"][0]), -1)))
                yield e["name"], QuantTensor(GGMLQuantizationType(e["qtype"]), raw, tuple(e["shape"]), e["lanes"])
            else:
                yield e["name"], torch.from_numpy(view).view(_TORCH_DTYPES[e["dtype"]]).reshape(e["shape"])


def open_prepared(gguf: Path) -> Prepared | None:
    """The prepared copy of ``gguf``, or None (absent; a damaged or stale one is removed, saying
    why in one line on stderr, and the caller loads the GGUF and prepares it again)."""
    if not wanted(gguf):
        return None
    k = key(gguf)
    where = folder(gguf, k)
    if not where.exists():
        return None
    try:
        if not where.is_dir():
            raise ValueError("it is not a folder")
        index = json.loads((where / "index.json").read_text(encoding="utf-8"))
        weights = where / "weights.bin"
        _check(index, k, weights.stat().st_size)
        tokenizer = Tokenizer.from_state((where / "tokenizer.json").read_text(encoding="utf-8"), index["tokenizer"])
        config = ModelConfig.from_json_dict(index["config"])
        mapped = np.memmap(weights, dtype=np.uint8, mode="c") if index["weights_bytes"] else np.zeros(0, np.uint8)
    except Exception as exc:  # any damage: rebuild from the GGUF
        print(f"prepared weights in {where} are unusable ({kept.one_line(exc)}); rebuilding them",
              file=sys.stderr, flush=True)
        shutil.rmtree(where, ignore_errors=True)
        with contextlib.suppress(OSError):
            where.unlink()  # (not a folder)
        return None
    with contextlib.suppress(OSError):  # (a read-only cache: the copy is still good)
        os.utime(where / "index.json")  # least recently used goes first
    return Prepared(config, tokenizer, index["tensors"], mapped)


def _check(index: Any, k: dict[str, Any], weights_bytes: int) -> None:
    """Raise ValueError where ``index`` (index.json) is not whole, of this FORMAT and key, and
    consistent with a weights.bin of ``weights_bytes`` bytes."""
    if not isinstance(index, dict):
        raise ValueError(f"index.json holds a JSON {type(index).__name__}, not an object")
    found = index.get("key")
    if not isinstance(found, dict) or found.get("format") != FORMAT:
        fmt = found.get("format") if isinstance(found, dict) else None
        raise ValueError(f"index.json is of format {fmt!r}, this version reads format {FORMAT}")
    if found != k:
        raise ValueError("its key does not match the model file")
    if weights_bytes != index.get("weights_bytes"):
        raise ValueError(f"weights.bin has {weights_bytes} bytes, the index says {index.get('weights_bytes')!r}")
    tensors = index.get("tensors")
    if not isinstance(tensors, list) or not isinstance(index.get("tokenizer"), dict):
        raise ValueError("index.json lacks its tensors or tokenizer")
    for e in tensors:
        if not _whole(e, weights_bytes):
            name = e.get("name") if isinstance(e, dict) else None
            raise ValueError(f"index.json's entry for {name!r} is damaged")


def _whole(e: Any, weights_bytes: int) -> bool:
    """Whether the index entry ``e`` names a tensor that lies within weights.bin and has the size
    its shape and type say."""
    if not isinstance(e, dict) or not isinstance(e.get("name"), str):
        return False
    offset, nbytes, shape = e.get("offset"), e.get("nbytes"), e.get("shape")
    if (not isinstance(offset, int) or not isinstance(nbytes, int) or min(offset, nbytes) < 0
            or offset + nbytes > weights_bytes or not isinstance(shape, list)
            or not all(isinstance(d, int) and d >= 0 for d in shape)):
        return False
    if e.get("kind") == "float":
        dtype = _TORCH_DTYPES.get(str(e.get("dtype")))
        return dtype is not None and math.prod(shape) * dtype.itemsize == nbytes
    if e.get("kind") == "quant":
        try:
            GGMLQuantizationType(e["qtype"])
        except (KeyError, TypeError, ValueError):
            return False
        return len(shape) == 2 and shape[0] > 0 and nbytes % shape[0] == 0 and isinstance(e.get("lanes"), bool)
    return False


class Recorder:
    """Notes what a GGUF load streams into the model, then writes the prepared folder from the
    loaded model (so nothing is held twice meanwhile)."""

    def __init__(self, gguf: Path) -> None:
        self.gguf = gguf
        self.names: list[tuple[str, bool]] = []  # (checkpoint name, block-quantized)

    def watch(self, tensors: Tensors) -> Iterator[tuple[str, Any]]:
        for name, t in tensors:
            self.names.append((name, isinstance(t, QuantTensor)))
            yield name, t

    def save(self, model: nn.Module, config: ModelConfig, tokenizer: Tokenizer) -> None:
        """Write the folder (blocks in the layout they now have), whole or not at all: its files
        go to a temporary folder beside it, flushed to disk, which is then renamed."""
        k = key(self.gguf)
        dest = folder(self.gguf, k)
        tmp = dest.with_name(dest.name + f".partial-{os.getpid()}")
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            entries: list[dict[str, Any]] = []
            offset = 0
            with open(tmp / "weights.bin", "wb") as f:
                for name, quant in self.names:
                    found = _loaded(model, name, quant)
                    if found is None:  # a tensor the loader skips (tied lm_head, rotary_emb.inv_freq)
                        continue
                    data, entry = found
                    blob = data.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
                    pad = -offset % _ALIGN
                    f.write(b"\0" * pad)
                    offset += pad
                    entries.append({"name": name, **entry, "offset": offset, "nbytes": int(blob.size)})
                    f.write(blob.data)
                    offset += int(blob.size)
                kept.flush_to_disk(f)
            backend_json, tok_state = tokenizer.to_state()
            index = {"key": k, "config": config.to_json_dict(), "tokenizer": tok_state,
                     "tensors": entries, "weights_bytes": offset}
            for name, text in (("tokenizer.json", backend_json), ("index.json", json.dumps(index))):
                with open(tmp / name, "w", encoding="utf-8") as f:
                    f.write(text)
                    kept.flush_to_disk(f)
            for old in root().iterdir():  # earlier versions of this file; partials left by a crash
                if old != dest and old != tmp and (_stale_partial(old) if ".partial-" in old.name
                                                   else _key_path(old) == k["path"]):
                    shutil.rmtree(old, ignore_errors=True)
            if dest.exists():  # another process prepared it meanwhile
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                os.replace(tmp, dest)
            _evict(keep=dest)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            kept.warn_unkept(root(), f"could not keep prepared weights in {dest} ({kept.one_line(exc)}); "
                                     "the next start reads the GGUF again")



def _loaded(model: nn.Module, name: str, quant: bool) -> tuple[torch.Tensor, dict[str, Any]] | None:
    """Checkpoint tensor ``name`` as the model now holds it, with its index entry."""
    from quickdraft.loading.weights import quantized_linear
    from quickdraft.quant.ggml import GGMLLinear

    parent, _, attr = name.rpartition(".")
    try:
        if quant:
            linear = quantized_linear(model, name)
        else:
            value = getattr(model.get_submodule(parent), attr)
    except AttributeError:
        return None
    if quant:
        if not isinstance(linear, GGMLLinear):
            return None
        return linear.raw, {"kind": "quant", "qtype": int(linear.qtype), "lanes": bool(linear._lanes),
                            "shape": [linear.out_features, linear.in_features]}
    if not isinstance(value, torch.Tensor):
        return None
    return value, {"kind": "float", "dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}


def _key_path(p: Path) -> str | None:
    try:
        return json.loads((p / "index.json").read_text(encoding="utf-8"))["key"]["path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _stale_partial(p: Path) -> bool:
    """Whether ``p`` is a temporary folder a killed process left: nothing in it written for
    kept.TEMP_MAX_AGE_S (a folder being written has its weights.bin growing) and its writer gone,
    or nothing written for an hour (a writer of that id may be another process, or on another
    machine sharing the cache)."""
    try:
        quiet = time.time() - max([p.stat().st_mtime, *(c.stat().st_mtime for c in p.iterdir())])
    except OSError:
        return False
    return quiet > 3600 or (quiet > kept.TEMP_MAX_AGE_S and not _running(p.name.rpartition("-")[2]))


def _running(pid: str) -> bool:
    """Whether a process ``pid`` runs on this machine (True where that cannot be told)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError, OverflowError):
        return True
    return True


def _evict(keep: Path) -> None:
    folders = [p for p in root().iterdir() if p.is_dir() and ".partial-" not in p.name and p != keep]
    folders.sort(key=lambda p: _used(p), reverse=True)
    for old in folders[MAX_ENTRIES - 1 :]:
        shutil.rmtree(old, ignore_errors=True)


def _used(p: Path) -> float:
    try:
        return (p / "index.json").stat().st_mtime
    except OSError:
        return 0.0


def set_kernel_layouts(model: CausalLM) -> None:
    """Put every matrix the q8 kernels multiply by into their lane layout now (it would happen at
    the first pass), so the prepared copy keeps it; embedding-only tables stay in GGML blocks."""
    from quickdraft.models.layers import QuantEmbedding
    from quickdraft.quant.ggml import LANE_TYPES, GGMLLinear

    embedding_only = {id(m.linear) for m in model.modules() if isinstance(m, QuantEmbedding)}
    embedding_only.discard(id(model.lm_head))
    for m in model.modules():
        if (type(m) is GGMLLinear and id(m) not in embedding_only and m.qtype in LANE_TYPES
                and m.activation_mode == "q8"):
            m._set_layout(True)
