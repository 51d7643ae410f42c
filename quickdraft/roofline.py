"""The decode roofline: how close a 1-row pass comes to this machine's memory bandwidth; and the
floor of a pass of any row count, which is its bytes over that bandwidth or its int8 products over
the q8 GEMM's integer dot rate (:func:`int8_dot_rate`), whichever is more (:func:`pass_floor`).

A plain decode step reads every weight of the model once (the output head included; of the
embedding table only one row) plus the keys and values of the context. Its time cannot be less
than those bytes over the machine's read bandwidth, which :func:`read_bandwidth` measures with a
short streaming-read probe (the kernels' ``read_bandwidth``: 2 threads by default read a 256 MiB
buffer, best of 4), beside the decode it is compared with: before and after a benchmark's runs.

    before = read_bandwidth()
    ...  # plain decoding at 9.8 tok/s, 300 tokens of context
    print(roofline(model, 9.8, 300, [before, read_bandwidth()]).line())
    # "decode roofline: 1.05 GB per token (weights 1.02 GB, KV 0.03 GB at 300 tokens) x 9.8 tok/s
    #  = 10.3 GB/s = 58% of this machine's read bandwidth measured beside it, 17.7 GB/s (probes
    #  17.1, 18.3 GB/s; 2 threads)"
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from quickdraft.cache import kv_value_bytes
from quickdraft.models.causal_lm import CausalLM

PROBE_BYTES = 256 << 20  # far beyond any L3 of the machines this runs on
PROBE_REPEATS = 4  # the best of: every other one with software prefetch


def weight_read_bytes(model: CausalLM) -> int:
    """Bytes of weights one decode pass reads: every weight tensor of the model once (shared ones
    once: a tied table is read whole as the output head), except embedding tables, of which a pass
    reads one row. Mixture-of-Experts layers count all their experts."""
    from quickdraft.models.layers import QuantEmbedding
    from quickdraft.quant.ggml import GGMLLinear

    head = model.lm_head
    head_ptrs = {t.data_ptr() for t in [*head.parameters(), *head.buffers()]}
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


def read_bandwidth(threads: int | None = None) -> float | None:
    """This machine's streaming-read bandwidth in GB/s (1e9 bytes/s) with ``threads`` threads
    (default: torch's), measured now (~0.3 s); None without the native kernels. Measured where it
    is used, never kept: on a shared machine it moves by 1.5x within minutes (measured on a Zen 4
    VM: 32-36 GB/s and 57-59 GB/s a few seconds apart), and a decode step moves with it."""
    from quickdraft.quant.ggml import active_kernels

    mod = active_kernels()
    if mod is None:
        return None
    return float(mod.read_bandwidth(PROBE_BYTES, threads or torch.get_num_threads(), PROBE_REPEATS))


def int8_products(model: CausalLM) -> int:
    """int8 x int8 products one row of a pass makes: in x out features of every quantized linear in
    q8 mode (the output head included; embedding tables are looked up, not multiplied)."""
    from quickdraft.models.layers import QuantEmbedding
    from quickdraft.quant.ggml import GGMLLinear

    head = model.lm_head
    tables = {id(m.linear) for m in model.modules() if isinstance(m, QuantEmbedding)}
    return sum(m.in_features * m.out_features for m in model.modules()  # (each once; a tied head too)
               if isinstance(m, GGMLLinear) and m.activation_mode == "q8" and (id(m) not in tables or m is head))


def int8_dot_rate(threads: int | None = None) -> float | None:
    """int8 products per second of the q8 GEMM's integer dot step in the kernel build in use (AVX-512
    VNNI: dpbusd; AVX2: maddubs + an int16 add) with ``threads`` threads (default: torch's), measured
    now (~30 ms; the best of 3); None without the native kernels. No pass of T rows can take less than
    T x :func:`int8_products` / this: the compute roofline of verification passes, beside the memory
    one (measured on a 2-core Zen 4: 116-117 G/s per core with dpbusd and with the AVX2 step)."""
    from quickdraft.quant.ggml import active_kernels

    mod = active_kernels()
    if mod is None:
        return None
    return float(mod.int8_dot_rate(threads or torch.get_num_threads()))


def pass_floor(model: CausalLM, rows: int, context: int, bandwidth_gbs: float, dot_rate: float) -> float:
    """The least time (seconds) a pass of ``rows`` rows after ``context`` tokens can take on this
    machine: its weight and KV bytes over the read bandwidth (GB/s), or its int8 products over the
    dot rate (products/s), whichever is more. A 1-row pass sits on the first, a pass of many rows on
    the second: their ratio bounds T(rows) / T(1)."""
    if rows < 1 or bandwidth_gbs <= 0 or dot_rate <= 0:
        raise ValueError("pass_floor needs rows >= 1 and a positive bandwidth and dot rate")
    memory = (weight_read_bytes(model) + kv_read_bytes(model, context)) / (bandwidth_gbs * 1e9)
    return max(memory, rows * int8_products(model) / dot_rate)


@dataclass(frozen=True)
class Roofline:
    """One decode step against the machine's read bandwidth, probed beside it (``probes``: GB/s)."""

    weight_bytes: int
    kv_bytes: int
    context: int
    tokens_per_second: float
    probes: tuple[float, ...]
    threads: int

    @property
    def achieved_gbs(self) -> float:
        return (self.weight_bytes + self.kv_bytes) * self.tokens_per_second / 1e9

    @property
    def bandwidth_gbs(self) -> float | None:
        """The mean of the probes (None without any)."""
        return sum(self.probes) / len(self.probes) if self.probes else None

    @property
    def fraction(self) -> float | None:
        return None if not self.bandwidth_gbs else self.achieved_gbs / self.bandwidth_gbs

    def line(self) -> str:
        total = (self.weight_bytes + self.kv_bytes) / 1e9
        text = (f"decode roofline: {total:.2f} GB per token (weights {self.weight_bytes / 1e9:.2f} GB, KV "
                f"{self.kv_bytes / 1e9:.3f} GB at {self.context} tokens) x {self.tokens_per_second:.1f} tok/s = "
                f"{self.achieved_gbs:.1f} GB/s")
        if self.fraction is None or self.bandwidth_gbs is None:
            return text + " (no bandwidth probe without the native kernels)"
        probes = ", ".join(f"{g:.1f}" for g in self.probes)
        return (f"{text} = {100 * self.fraction:.0f}% of this machine's read bandwidth measured beside it, "
                f"{self.bandwidth_gbs:.1f} GB/s (probe{'s' if len(self.probes) > 1 else ''} {probes} GB/s; "
                f"{self.threads} threads)")

    def as_dict(self) -> dict[str, object]:
        return {"weight_bytes": self.weight_bytes, "kv_bytes": self.kv_bytes, "context": self.context,
                "tokens_per_second": self.tokens_per_second, "achieved_gbs": self.achieved_gbs,
                "read_bandwidth_gbs": self.bandwidth_gbs, "probes_gbs": list(self.probes),
                "fraction": self.fraction, "threads": self.threads}


def roofline(
    model: CausalLM, tokens_per_second: float, context: int, probes: Sequence[float | None] = ()
) -> Roofline:
    """Plain decoding at ``tokens_per_second`` with ``context`` tokens cached, against ``probes``
    (:func:`read_bandwidth` results taken beside the decode: before and after it); none given (or
    all None): one probe now. A model off the CPU gets none."""
    threads = torch.get_num_threads()
    on_cpu = next(model.parameters()).device.type == "cpu"
    taken = [g for g in probes if g is not None] if on_cpu else []
    if on_cpu and not taken and (now := read_bandwidth(threads)) is not None:
        taken = [now]
    return Roofline(weight_read_bytes(model), kv_read_bytes(model, context), context, tokens_per_second,
                    tuple(taken), threads)
