"""CUDA graphs for decode and verify passes: one captured graph per (rows, attended length).

A decode step of a small model on a GPU is bound by launching kernels, not by the GPU: a 28-layer
model issues several hundred kernels per pass, each a few microseconds of host work. Replaying a
captured CUDA graph issues them all at once. A graph needs static shapes and no host-side
decisions, so these passes run :meth:`CausalLM.run` of a static :class:`Step`: keys/values are written at a slot
tensor and each row attends over the first L cache slots under a [T, L] mask (chains: causal;
trees: the tree mask). L is the used length rounded up to a power of two (at least
``MIN_SPAN``), so one graph serves many steps and attention reads about the used part of the
cache, not all of it.

Graphs are captured lazily, the first time a (T, L) is needed, after warm-up runs on a side
stream (standard practice: lazily built buffers are allocated outside the capture). All graphs
share one memory pool; outputs are copied out after each replay, so a later graph may reuse that
memory. Passes longer than ``max_rows`` (prefills), models whose layers take other paths
(sliding windows, MoE routing, other families) and a model whose output vocabulary was cut run
eagerly, as does everything after a capture fails (with one warning).

On the CPU there is nothing to capture: ``StepGraphs(..., capture=False)`` runs the same static
pass eagerly (the tests check it against the dynamic pass, :meth:`CausalLM.run` of a reserved Step).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from quickdraft.cache import SequenceCache
from quickdraft.config import CUDA_GRAPH_MODES
from quickdraft.models.forward_pass import Step
from quickdraft.models.layers import MLP, Attention, DecoderLayer

if TYPE_CHECKING:
    from quickdraft.models.causal_lm import CausalLM

MIN_SPAN = 256  # fewest cache slots a graph attends over
MAX_GRAPHS = 96  # captured graphs kept at most; further shapes run eagerly
WARMUP = 2  # eager runs on a side stream before a capture


def supports_static(model: torch.nn.Module) -> str | None:
    """None if every layer of ``model`` takes the shared static path, else why not."""
    from quickdraft.models.causal_lm import CausalLM

    if not isinstance(model, CausalLM):
        return f"{type(model).__name__} is not a decoder CausalLM"
    if type(model).run is not CausalLM.run or type(model).embed is not CausalLM.embed:
        return f"{type(model).__name__} has its own forward pass"
    for i, layer in enumerate(model.model.layers):
        if type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention or type(layer.mlp) is not MLP:
            return f"layer {i} is a {type(layer).__name__} (not the shared decoder layer)"
        if layer.self_attn.window is not None:
            return f"layer {i} uses sliding-window attention"
    return None


@dataclass
class _Graph:
    """Static inputs and outputs of one (rows, span) shape and its captured graph (None: eager)."""

    ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slots: torch.Tensor  # [T] long
    mask: torch.Tensor  # [T, L] bool
    logits: torch.Tensor | None = None  # [T, V] float32
    captured: list[torch.Tensor] | None = None
    graph: torch.cuda.CUDAGraph | None = None


class StepGraphs:
    """Runs a model's short passes as CUDA graph replays (see the module docstring)."""

    def __init__(self, model: CausalLM, cache: SequenceCache, max_rows: int = 32, capture: bool = True) -> None:
        reason = supports_static(model)
        if reason is not None:
            raise ValueError(f"CUDA graphs do not apply: {reason}")
        if capture and cache.device.type != "cuda":
            raise ValueError("CUDA graphs need the model and its cache on a CUDA device")
        self.model = model
        self.cache = cache
        self.max_rows = max_rows
        self.capture = capture
        self.disabled: str | None = None  # why graphs were switched off (a failed capture)
        self._graphs: dict[tuple[int, int, tuple[int, ...]], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0  # passes served by a graph (or by the static pass when capture is False)

    def span(self, end: int) -> int:
        """Cache slots attended by a pass ending at slot ``end``: a power of two >= end."""
        span = MIN_SPAN
        while span < end:
            span *= 2
        return min(span, self.cache.max_len)

    def run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None,
        mask: torch.Tensor | None,
        capture: Sequence[int],
        num_logits: int | None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """The pass :meth:`CausalLM.run` would make of ``Step.reserve(cache, T, positions, mask=mask)``
        with the last ``num_logits`` rows as outputs, or None where graphs do not apply (the caller then
        runs it eagerly). Advances the cache like that pass."""
        model = self.model
        t = int(ids.shape[0])
        if self.disabled is not None or t > self.max_rows or model._vocab_subset is not None:
            return None
        start, end = self.cache.reserve(t)
        span = self.span(end)
        key = (t, span, tuple(capture))
        g = self._graphs.get(key)
        if g is None:
            if len(self._graphs) >= MAX_GRAPHS:
                return None
            g = self._new(t, span)
        device = g.ids.device
        g.ids.copy_(ids)
        g.slots.copy_(torch.arange(start, end, device=device))
        if positions is None:
            g.positions.copy_(g.slots)
        else:
            g.positions.copy_(positions)
        if mask is None:  # causal: row i sees slots <= start + i
            cols = torch.arange(span, device=device)
            g.mask.copy_(cols.unsqueeze(0) <= g.slots.unsqueeze(1))
        else:  # [T, end] (trees)
            g.mask.zero_()
            g.mask[:, :end].copy_(mask)
        fresh = g.logits is None
        if fresh:  # first use of this shape: capture (on the CPU: run) it
            if not self._record(g, capture):
                return None
            self._graphs[key] = g
        if g.graph is not None:
            g.graph.replay()
        elif not fresh:
            g.logits, g.captured = self._static(g, capture)
        assert g.logits is not None and g.captured is not None
        self.cache.advance(t)
        self.replays += 1
        logits = g.logits if num_logits is None else g.logits[t - num_logits :]
        return logits.clone(), [c.clone() for c in g.captured]

    def _new(self, t: int, span: int) -> _Graph:
        device = self.cache.device
        return _Graph(
            ids=torch.zeros(t, dtype=torch.long, device=device),
            positions=torch.zeros(t, dtype=torch.long, device=device),
            slots=torch.zeros(t, dtype=torch.long, device=device),
            mask=torch.zeros(t, span, dtype=torch.bool, device=device),
        )

    def _static(self, g: _Graph, capture: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.model.run(g.ids, Step.static(self.cache, g.positions, g.slots, g.mask), capture)

    def _record(self, g: _Graph, capture: Sequence[int]) -> bool:
        """Capture ``g``'s graph (inputs already filled); False (graphs off, one warning) on failure.

        The warm-up runs write this pass's keys/values into its own slots, which the replay that
        follows overwrites with the same values: harmless.
        """
        if not self.capture:
            g.logits, g.captured = self._static(g, capture)
            return True
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(WARMUP):
                    self._static(g, capture)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                g.logits, g.captured = self._static(g, capture)
            g.graph = graph
            return True
        except Exception as exc:  # an op that cannot be captured: run eagerly from now on
            self.disabled = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            warnings.warn(f"CUDA graphs switched off, decoding eagerly ({self.disabled})", RuntimeWarning, stacklevel=3)
            return False


def make_step_graphs(
    model: CausalLM, cache: SequenceCache, mode: str, warn: Callable[[str], None] | None = None
) -> StepGraphs | None:
    """The engine's graphs for ``mode`` 'auto' (on for CUDA models that support them), 'on' (the
    same, but saying why where they cannot be used) or 'off'."""
    if mode not in CUDA_GRAPH_MODES:
        raise ValueError(f"cuda_graphs must be 'auto', 'on' or 'off', got {mode!r}")
    if mode == "off":
        return None
    why = "the model is not on a CUDA device" if cache.device.type != "cuda" else supports_static(model)
    if why is not None:
        if mode == "on" and warn is not None:
            warn(f"CUDA graphs not used: {why}")
        return None
    return StepGraphs(model, cache)
