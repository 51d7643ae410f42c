"""Batch invariance: a row's bits do not depend on the pass it runs in.

**The contract.** The result of one row of a forward pass (its keys and values written into the
cache, its hidden states, its logits) is bitwise the same whichever other rows share its pass (a
verification chain, a draft tree, rows of other sequences in a pooled pass), however its prompt
was cut into prefill passes, and whatever the cache held before beyond what the row attends to.
It holds for passes of up to :data:`BLOCKED_MAX_ROWS` rows of any shape, and for chains (prefill
passes) of up to :data:`NATIVE_CHAIN_ROWS` rows where the native kernels run the whole model
(:meth:`CausalLM.prefill_rows <quickdraft.models.causal_lm.CausalLM.prefill_rows>`). Longer
passes take the plain (faster, not invariant) way.

**Why it matters.** Three promises rest on it:

* lossless speculation: a verified draft token's logits are those plain decoding computes for it,
  so greedy output with any drafter is token-identical to greedy output without one (an argmax a
  last bit away could flip);
* warm == cold: keys and values a prefix cache restores are bitwise those a fresh prefill of the
  same tokens writes, whatever chunks either was cut into;
* many users == alone: a request served beside others (its rows in pooled passes) gets bitwise
  the answer it gets alone.

**How it is kept.** CPU GEMM libraries and fused kernels pick their blocking, and so their
reduction order, from the shapes they see; so every operation a row takes is made to see the
same shapes whatever the pass holds:

* linears run in fixed blocks of :data:`ROW_BLOCK` rows, zero-padded (:func:`blocked_linear`,
  :class:`Linear`; FP8's scaled matmul likewise, :func:`in_row_blocks`);
* outputs of 2 or 3 columns are padded to 4 (torch sums those in an order that depends on the
  other rows);
* attention runs each row alone over exactly the slots it sees, as a decode step would
  (:meth:`~quickdraft.models.layers.Attention` per-row fallback), or in the native fused kernel,
  which computes each row so by construction;
* the native q8 GEMMs, the native decoder stack and the Gated DeltaNet step have fixed
  reduction orders per row, so on that path chains of up to :data:`NATIVE_CHAIN_ROWS` rows keep
  the contract (a 256-row prefill pass reads the weights once, not four times);
* recurrent layers run one row at a time in the same ops (torch vectorises the bulk of a tensor
  and does its tail scalar, so a row's result would otherwise depend on the row count);
* prefills are cut into passes of at most :func:`prefill_chunks` rows, never longer than the
  invariant limit, so a token's keys and values do not depend on where its prompt was cut.

Tests: ``test_native_stack`` (one 250-row pass == 64-row passes == single rows), ``test_verify``
and ``test_tree`` (greedy equivalence for every drafter), ``test_concurrency`` (pooled == alone),
``test_prefix_cache`` (warm == cold).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

ROW_BLOCK = 8  # rows per matmul in the decode/verify path
BLOCKED_MAX_ROWS = 64  # passes with more rows take the plain (not batch-invariant) path ...
# ... except chains on the native kernels' path (CPU float32, the kernels built): there the q8 GEMMs,
# the native attention, the Gated DeltaNet step and Linear's blocked matmuls compute a row the same
# way up to this many rows (CausalLM.prefill_rows).
NATIVE_CHAIN_ROWS = 256
# Prefills run in passes of at most this many rows (CausalLM.prefill_rows: NATIVE_CHAIN_ROWS where the
# native path runs the whole model): the batch-invariant path, so a token's keys and values are
# bitwise the same however its sequence is cut into passes (prefix reuse stays exact).
PREFILL_CHUNK = BLOCKED_MAX_ROWS


def prefill_chunks(start: int, end: int, rows: int = PREFILL_CHUNK) -> list[tuple[int, int]]:
    """Rows ``[start, end)`` cut into the passes a prefill runs: ``(s, e)`` of at most ``rows``."""
    return [(s, min(s + rows, end)) for s in range(start, end, rows)]


def invariant_pass(rows: int, chain: bool) -> bool:
    """Whether a pass of ``rows`` rows is on the batch-invariant path: any pass of at most
    BLOCKED_MAX_ROWS rows, a chain of at most NATIVE_CHAIN_ROWS (where the native kernels run it)."""
    return rows <= BLOCKED_MAX_ROWS or (chain and rows <= NATIVE_CHAIN_ROWS)


def in_row_blocks(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn(x)`` [T, N] computed on fixed blocks of ROW_BLOCK rows of ``x`` [T, K] (zero-padded), so
    each row meets the same kernel whatever rows come with it."""
    t = x.shape[0]
    pad = (-t) % ROW_BLOCK
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    blocks = [fn(x[i : i + ROW_BLOCK]) for i in range(0, t + pad, ROW_BLOCK)]
    return torch.cat(blocks)[:t] if len(blocks) > 1 else blocks[0][:t]


class Linear(nn.Linear):
    """``nn.Linear`` whose result for a row does not depend on how many rows come with it.

    CPU GEMM libraries pick different kernels (and so different reduction orders) for different
    row counts, so row i of a k-row verification pass could differ in the last bit from the same
    row decoded alone, and a greedy argmax could flip. Short passes are therefore computed in
    fixed blocks of ROW_BLOCK rows (zero-padded): every decode and verify row goes through the
    same kernel, so speculative greedy output stays token-identical to plain decoding. At batch 1
    the pass is bound by reading the weights, so the padding costs little.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] -> [T, out]
        return blocked_linear(x, self.weight, self.bias)


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` computed the batch-invariant way :class:`Linear` describes (also used by
    layers that build their weight on the fly, e.g. ``quickdraft.quant.fp8.FP8Linear``)."""
    t = x.shape[0]
    if t > NATIVE_CHAIN_ROWS:
        return F.linear(x, weight, bias)
    n = weight.shape[0]
    if 1 < n < 4:  # torch's CPU GEMM sums 2-3 output columns in an order that depends on the other rows
        weight = torch.cat([weight, weight.new_zeros(4 - n, weight.shape[1])])
        bias = None if bias is None else torch.cat([bias, bias.new_zeros(4 - n)])
        return blocked_linear(x, weight, bias)[:, :n].contiguous()
    return in_row_blocks(x, lambda block: F.linear(block, weight, bias))
