"""The decode roofline: how close a 1-row pass comes to this machine's memory bandwidth.

A plain decode step reads every weight of the model once (the output head included; of the
embedding table only one row) plus the keys and values of the context. Its time cannot be less
than those bytes over the machine's read bandwidth, which :func:`read_bandwidth` measures with a
short streaming-read probe (the kernels' ``read_bandwidth``: 2 threads by default read a 256 MiB
buffer, best of 3) and keeps per (CPU, threads) in ``<cache>/bandwidth.json`` for 30 days.

    line = roofline_line(model, tokens_per_second=9.8, context=300)
    # "decode roofline: 1.05 GB per token (weights 1.02 GB, KV 0.03 GB at 300 tokens) x 9.8 tok/s
    #  = 10.3 GB/s = 58% of this machine's measured 17.7 GB/s read bandwidth (2 threads)"
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from quickdraft import kept, zoo
from quickdraft.cache import kv_value_bytes
from quickdraft.hardware import cpu_model
from quickdraft.models.causal_lm import CausalLM

MAX_AGE_DAYS = 30
PROBE_BYTES = 256 << 20  # far beyond any L3 of the machines this runs on
FILE_NAME = "bandwidth.json"
PROBE_VERSION = 2  # a probe that measures differently is measured again (2: software prefetch too)


def weight_read_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode pass reads: every weight tensor of the model once (shared ones
    once: a tied table is read whole as the output head), except embedding tables, of which a pass
    reads one row. Mixture-of-Experts layers count all their experts."""
    from quickdraft.models.layers import QuantEmbedding
    from quickdraft.quant.ggml import GGMLLinear

    head = getattr(model, "lm_head", None)
    head_ptrs = {t.data_ptr() for t in [*head.parameters(), *head.buffers()]} if head is not None else set()
    tables: set[int] = set()
    for m in model.modules():
        if isinstance(m, QuantEmbedding):
            tables |= {t.data_ptr() for t in m.linear.buffers()}
        elif isinstance(m, nn.Embedding):
            tables.add(m.weight.data_ptr())
    seen = tables - head_ptrs  # (counted as nothing)
    total = 0
    for m in model.modules():
        own = [*m.buffers(recurse=False)] if isinstance(m, GGMLLinear) else [*m.parameters(recurse=False)]
        for t in own:
            if t is None or t.data_ptr() in seen or t.device.type == "meta":
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def kv_read_bytes(model: CausalLM, context: int) -> int:
    """Bytes of keys and values a 1-row pass reads after ``context`` tokens (every layer, K and V)."""
    cfg = model.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    return int(per_token * context * kv_value_bytes(model.kv_dtype or model.dtype))


def read_bandwidth(threads: int | None = None, path: Path | None = None) -> float | None:
    """This machine's streaming-read bandwidth in GB/s (1e9 bytes/s) with ``threads`` threads
    (default: torch's), kept from an earlier measurement or measured now (~0.5 s); None without
    the native kernels."""
    from quickdraft.quant.ggml import active_kernels

    mod = active_kernels()
    if mod is None:
        return None
    threads = threads or torch.get_num_threads()
    path = path or zoo.cache_dir() / FILE_NAME
    key = f"{cpu_model()}|threads={threads}|probe={PROBE_VERSION}"
    entries, _ = kept.read(path)
    try:
        entry = entries[key]
        if time.time() - float(entry["measured"]) < MAX_AGE_DAYS * 86400 and float(entry["gbs"]) > 0:
            return float(entry["gbs"])
    except (KeyError, TypeError, ValueError):
        pass
    gbs = float(mod.read_bandwidth(PROBE_BYTES, threads, 4))
    entries[key] = {"measured": time.time(), "gbs": gbs}
    kept.write(path, entries)  # (where it cannot, measured again next time)
    return gbs


@dataclass(frozen=True)
class Roofline:
    """One decode step against the machine's read bandwidth."""

    weight_bytes: int
    kv_bytes: int
    context: int
    tokens_per_second: float
    bandwidth_gbs: float | None
    threads: int

    @property
    def achieved_gbs(self) -> float:
        return (self.weight_bytes + self.kv_bytes) * self.tokens_per_second / 1e9

    @property
    def fraction(self) -> float | None:
        return None if not self.bandwidth_gbs else self.achieved_gbs / self.bandwidth_gbs

    def line(self) -> str:
        total = (self.weight_bytes + self.kv_bytes) / 1e9
        text = (f"decode roofline: {total:.2f} GB per token (weights {self.weight_bytes / 1e9:.2f} GB, KV "
                f"{self.kv_bytes / 1e9:.3f} GB at {self.context} tokens) x {self.tokens_per_second:.1f} tok/s = "
                f"{self.achieved_gbs:.1f} GB/s")
        if self.fraction is None:
            return text + " (no bandwidth probe without the native kernels)"
        return (f"{text} = {100 * self.fraction:.0f}% of this machine's measured {self.bandwidth_gbs:.1f} GB/s "
                f"read bandwidth ({self.threads} threads)")

    def as_dict(self) -> dict[str, float | int | None]:
        return {"weight_bytes": self.weight_bytes, "kv_bytes": self.kv_bytes, "context": self.context,
                "tokens_per_second": self.tokens_per_second, "achieved_gbs": self.achieved_gbs,
                "read_bandwidth_gbs": self.bandwidth_gbs, "fraction": self.fraction, "threads": self.threads}


def roofline(model: CausalLM, tokens_per_second: float, context: int) -> Roofline:
    """Plain decoding at ``tokens_per_second`` with ``context`` tokens cached, against the probe."""
    threads = torch.get_num_threads()
    on_cpu = next(model.parameters()).device.type == "cpu"
    return Roofline(weight_read_bytes(model), kv_read_bytes(model, context), context, tokens_per_second,
                    read_bandwidth(threads) if on_cpu else None, threads)
