"""Tensor parallelism on CPU: 2 gloo processes on loopback against the single-process model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import make_moe_model, make_tiny_hf_model

from quickdraft.errors import QuickdraftError
from quickdraft.loading.load import load_model
from quickdraft.parallel.tp import shard_model, split_points

RUN = Path(__file__).with_name("tp_run.py")


def test_split_points_even_uneven_and_aligned() -> None:
    assert split_points(8, 2) == [0, 4, 8]
    assert split_points(3, 2) == [0, 2, 3]
    assert split_points(8960, 2, 256) == [0, 4608, 8960]  # 35 blocks: 18 + 17
    with pytest.raises(QuickdraftError, match="over 4 ranks"):
        split_points(3, 4)
    with pytest.raises(QuickdraftError, match="blocks of 256"):
        split_points(1000, 2, 256)


def test_too_few_kv_heads_is_a_clear_error(tmp_path: Path) -> None:
    folder = make_tiny_hf_model(tmp_path, "llama", num_attention_heads=4, num_key_value_heads=1)
    model = load_model(str(folder), dtype="float32", max_context=64).model
    with pytest.raises(QuickdraftError, match="key/value heads"):
        shard_model(model, 0, 2)


def _run(folder: Path, tp: int) -> dict:
    proc = subprocess.run([sys.executable, str(RUN), str(folder), str(tp)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _moe(tmp_path: Path) -> Path:
    return make_moe_model(tmp_path, "qwen2_moe")  # shared expert with its gate, a dense layer, qkv biases


@pytest.mark.slow
@pytest.mark.parametrize("build", [
    lambda tmp: make_tiny_hf_model(tmp, "qwen2"),  # q/k/v biases
    # uneven split of 3 kv heads, tied embeddings
    lambda tmp: make_tiny_hf_model(tmp, "llama", tie_word_embeddings=True, hidden_size=96,
                                   num_attention_heads=6, num_key_value_heads=3),
    lambda tmp: make_tiny_hf_model(tmp, "gemma3_text"),  # sliding-window layers, own MLP and norms
    _moe,  # sharded experts, one all-reduce per MoE block
], ids=["qwen2", "llama-uneven-tied", "gemma3", "qwen2_moe"])
def test_two_gloo_ranks_match_one_process(tmp_path: Path, build) -> None:
    folder = build(tmp_path)
    one, two = _run(folder, 1), _run(folder, 2)
    # partial sums are added in another order: equal up to float rounding
    for key in ("prefill", "after_compact"):  # logits of magnitude ~1-10
        torch.testing.assert_close(torch.tensor(two[key]), torch.tensor(one[key]), rtol=1e-4, atol=1e-4)
    assert two["plain"] == one["plain"]
    # lossless speculation under TP: the n-gram drafter's output is the plain output
    assert two["ngram"] == two["plain"]
    if "gemma" not in folder.name:  # the tiny gemma's random text has no repeats to look up
        assert two["accepted"] > 0  # the drafter really drafted and was verified in parallel
