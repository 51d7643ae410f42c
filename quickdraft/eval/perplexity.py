"""Perplexity of a loaded model on a text: the accuracy yardstick for quantized weights.

The token ids are cut into consecutive, non-overlapping windows of ``context`` tokens; each window
runs through the model from an empty cache (one prefill pass) and every token but the window's
first is scored by the log-probability the model gave it after the tokens before it in the
window. Perplexity is ``exp(mean negative log-likelihood)``. Non-overlapping windows are cheaper
than a sliding window and give a slightly higher value (early tokens of a window see little
context); comparisons between models on the same ids and windows are exact like for like.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from quickdraft.errors import QuickdraftError
from quickdraft.models.causal_lm import CausalLM


@dataclass(frozen=True)
class Perplexity:
    nll: float  # mean negative log-likelihood per scored token, in nats
    tokens: int  # tokens scored
    windows: int

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)


@torch.inference_mode()
def perplexity(model: CausalLM, ids: Sequence[int], context: int = 1024) -> Perplexity:
    """Perplexity of ``model`` on ``ids`` in windows of ``context`` tokens (see the module doc)."""
    if context < 2:
        raise QuickdraftError(f"the perplexity window must hold at least 2 tokens, got {context}")
    if context > model.max_len:
        raise QuickdraftError(f"window of {context} tokens exceeds the model's context ({model.max_len}); load it with a larger max_context")
    total, count, windows = 0.0, 0, 0
    for start in range(0, len(ids), context):
        chunk = torch.tensor(list(ids[start : start + context]), dtype=torch.long, device=model.device)
        if chunk.numel() < 2:
            break
        logits, _ = model(chunk, model.make_cache(chunk.numel()))  # [T, V] float32
        logp = torch.log_softmax(logits[:-1].float(), dim=-1)
        nll = -logp.gather(1, chunk[1:, None]).squeeze(1)
        total += float(nll.double().sum())
        count += int(nll.numel())
        windows += 1
    if count == 0:
        raise QuickdraftError("the text is too short to measure perplexity (fewer than 2 tokens)")
    return Perplexity(total / count, count, windows)


def load_text(spec: str) -> str:
    """The text named by ``spec``: ``stdlib:MODULE`` (the source of a Python standard-library
    module, a text every machine has) or a path to a UTF-8 file."""
    if spec.startswith("stdlib:"):
        name = spec.removeprefix("stdlib:")
        found = importlib.util.find_spec(name)
        if found is None or not found.origin or not found.origin.endswith(".py"):
            raise QuickdraftError(f"{name!r} is not a pure-Python standard library module; try stdlib:textwrap")
        return Path(found.origin).read_text(encoding="utf-8")
    path = Path(spec).expanduser()
    if not path.is_file():
        raise QuickdraftError(f"no such text file: {spec} (or use stdlib:MODULE)")
    return path.read_text(encoding="utf-8")
