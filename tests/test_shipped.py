"""The promise in the shipped configuration: quantized GGUF weights on the CPU kernels (dtype
"auto"), not only fp32. Rows are bitwise batch-invariant, so speculative greedy output equals
plain greedy output token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quickdraft.engine import Engine
from quickdraft.loading.load import load_model
from quickdraft.quant.ggml import GGMLLinear, kernels_available
from quickdraft.sampling import SamplingParams
from quickdraft.speculative.ngram import NGramDrafter

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the CPU kernels did not build here")

PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"


def _rows_are_invariant(path: Path) -> None:
    loaded = load_model(str(path), dtype="auto", max_context=256)
    model = loaded.model
    assert isinstance(model.lm_head, GGMLLinear)  # really the quantized path
    ids = torch.tensor(loaded.tokenizer.encode(PROMPT * 2))
    p = len(ids) - 16
    cache = model.new_cache()
    model(ids[:p], cache, num_logits=1)
    alone = []
    for i in range(16):  # decode one token at a time: the plain path
        logits, _ = model(ids[p + i : p + i + 1], cache)
        alone.append(logits[0])
    for t in (2, 4, 8, 9, 16):
        cache.truncate(p)
        together, _ = model(ids[p : p + t], cache)
        for i in range(t):
            assert torch.equal(together[i], alone[i]), f"row {i} of a {t}-row pass differs"


def test_smollm2_quantized_rows_are_batch_invariant(smollm2_gguf: Path) -> None:
    _rows_are_invariant(smollm2_gguf)


@pytest.mark.slow
def test_qwen05_quantized_rows_are_batch_invariant(qwen05_gguf: Path) -> None:
    _rows_are_invariant(qwen05_gguf)


def test_smollm2_quantized_speculative_greedy_equals_plain(smollm2_gguf: Path) -> None:
    loaded = load_model(str(smollm2_gguf), dtype="auto", max_context=512)
    engine = Engine(loaded.model, loaded.tokenizer)
    ids = loaded.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    plain = [t for s in engine.generate(ids, params) for t in s.token_ids]
    for k in (2, 5, 8):
        steps = list(engine.generate(ids, params, NGramDrafter(), k))
        assert [t for s in steps for t in s.token_ids] == plain
        assert steps[-1].stats.accepted > 0  # the drafts really were used
