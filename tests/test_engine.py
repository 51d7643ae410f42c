"""The generation loop on a tiny random model: stops, lengths, seeds, streamed text and stats.

The tiny tokenizer's vocabulary is printable ASCII (``tests/tiny.py``), so the text of a token
prefix is a prefix of the text, and positions in ids and in text are easy to relate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import make_tiny_hf_model, write_tokenizer

from quickdraft.api import LLM, Prompt
from quickdraft.engine import Engine, StepOutput
from quickdraft.errors import QuickdraftError
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.sampling import SamplingParams
from quickdraft.tokenizer import Tokenizer

PROMPT = "def fibonacci(n):\n    return"
N = 40  # length of the reference greedy continuation


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model(tmp_path_factory.mktemp("engine"), "qwen2", seed=3)


@pytest.fixture(scope="module")
def loaded(folder: Path) -> LoadedModel:
    return load_model(str(folder), dtype="float32")


@pytest.fixture(scope="module")
def prompt_ids(loaded: LoadedModel) -> list[int]:
    return loaded.tokenizer.encode(PROMPT)


def run(
    loaded: LoadedModel, ids: list[int], tokenizer: Tokenizer | None = None, **params: Any
) -> list[StepOutput]:
    engine = Engine(loaded.model, tokenizer or loaded.tokenizer)
    return list(engine.generate(ids, SamplingParams(**params)))


def out_ids(steps: list[StepOutput]) -> list[int]:
    return [t for s in steps for t in s.token_ids]


def out_text(steps: list[StepOutput]) -> str:
    return "".join(s.text for s in steps)


@pytest.fixture(scope="module")
def greedy(loaded: LoadedModel, prompt_ids: list[int]) -> list[int]:
    """The plain greedy continuation, EOS ignored: what every stop test cuts short."""
    steps = run(loaded, prompt_ids, max_tokens=N, ignore_eos=True)
    ids = out_ids(steps)
    assert len(ids) == N
    return ids


def decode(loaded: LoadedModel, ids: list[int]) -> str:
    return loaded.tokenizer.decode(ids, skip_special_tokens=True)


def first_new_token_at(ids: list[int], lo: int, avoid: frozenset[int] = frozenset()) -> int:
    """An index j >= lo where ids[j] occurs for the first time, with no id of ``avoid`` before it."""
    for j in range(lo, len(ids)):
        if ids[j] not in ids[:j] and ids[j] not in avoid and not avoid.intersection(ids[:j]):
            return j
    pytest.skip("the tiny model's continuation repeats too much to place a stop token")


# -------------------------------------------------------------------------------------- lengths


@pytest.mark.parametrize("max_tokens", [1, 7])
def test_max_tokens_exact(
    loaded: LoadedModel, prompt_ids: list[int], greedy: list[int], max_tokens: int
) -> None:
    steps = run(loaded, prompt_ids, max_tokens=max_tokens, ignore_eos=True)
    assert out_ids(steps) == greedy[:max_tokens]
    assert steps[-1].finish_reason == "length"
    assert all(s.finish_reason is None for s in steps[:-1])
    assert steps[-1].stats.output_tokens == max_tokens


def test_max_tokens_beyond_the_context_finishes_with_length(folder: Path) -> None:
    small = load_model(str(folder), dtype="float32", max_context=32)
    ids = small.tokenizer.encode(PROMPT)
    room = 32 - len(ids)
    assert room > 1
    steps = run(small, ids, max_tokens=100, ignore_eos=True)
    assert steps[-1].finish_reason == "length"
    assert len(out_ids(steps)) == room
    # The last slot too: a prompt of max_len - 1 tokens still gets its one token.
    filler = (ids * 32)[:31]
    steps = run(small, filler, max_tokens=5, ignore_eos=True)
    assert len(out_ids(steps)) == 1 and steps[-1].finish_reason == "length"
    with pytest.raises(QuickdraftError, match="context"):
        run(small, (ids * 32)[:32], max_tokens=5)


def test_empty_prompt_is_refused(loaded: LoadedModel) -> None:
    with pytest.raises(QuickdraftError, match="empty"):
        run(loaded, [], max_tokens=5)


# ---------------------------------------------------------------------------------------- stops


def test_stop_token_ids(loaded: LoadedModel, prompt_ids: list[int], greedy: list[int]) -> None:
    j = first_new_token_at(greedy, 5)
    steps = run(loaded, prompt_ids, max_tokens=N, ignore_eos=True, stop_token_ids=[greedy[j]])
    assert out_ids(steps) == greedy[: j + 1]  # the stop id is the last token, as in vLLM
    assert steps[-1].finish_reason == "stop"
    assert out_text(steps) == decode(loaded, greedy[:j])  # ... but not part of the text
    assert steps[-1].stats.output_tokens == j + 1


def test_eos_stops_with_stop(
    loaded: LoadedModel, folder: Path, prompt_ids: list[int], greedy: list[int], tmp_path: Path
) -> None:
    """Make greedy's j-th token an EOS of the tokenizer (as config.json's eos_token_id would)."""
    j = first_new_token_at(greedy, 4, avoid=loaded.tokenizer.eos_ids)
    tokenizer = Tokenizer.from_hf_dir(write_tokenizer(tmp_path / "tok", eos_token_id=[greedy[j]]))
    assert greedy[j] in tokenizer.eos_ids
    steps = run(loaded, prompt_ids, tokenizer, max_tokens=N)
    assert out_ids(steps) == greedy[: j + 1]
    assert steps[-1].finish_reason == "stop"
    assert out_text(steps) == decode(loaded, greedy[:j])
    # ignore_eos walks past it to the length limit.
    steps = run(loaded, prompt_ids, tokenizer, max_tokens=N, ignore_eos=True)
    assert out_ids(steps) == greedy and steps[-1].finish_reason == "length"


def _token_ends(loaded: LoadedModel, ids: list[int]) -> list[int]:
    """ends[k] = len(text of ids[:k]); the tiny vocabulary is ASCII, so texts are prefix-closed."""
    return [len(decode(loaded, ids[:k])) for k in range(len(ids) + 1)]


@pytest.mark.parametrize("where", ["inside", "across"])
def test_stop_string(
    loaded: LoadedModel, prompt_ids: list[int], greedy: list[int], where: str
) -> None:
    text = decode(loaded, greedy)
    ends = _token_ends(loaded, greedy)
    k = next(k for k in range(N // 2, N) if ends[k + 1] - ends[k] >= 1 and ends[k] > 0)
    a = ends[k] - 1 if where == "across" else ends[k]  # "across" starts in the previous token
    stop = text[a : a + 3]
    assert len(stop) >= 2
    at = text.find(stop)  # the first occurrence is where generation must stop
    n = next(m for m in range(len(greedy) + 1) if stop in decode(loaded, greedy[:m]))
    steps = run(loaded, prompt_ids, max_tokens=N, ignore_eos=True, stop=[stop])
    assert out_text(steps) == text[:at]
    assert out_ids(steps) == greedy[:n]
    assert steps[-1].finish_reason == "stop"
    assert all(stop not in s.text for s in steps)


def test_several_stop_strings_earliest_wins(
    loaded: LoadedModel, prompt_ids: list[int], greedy: list[int]
) -> None:
    text = decode(loaded, greedy)
    late, early = text[-4:], text[len(text) // 3 : len(text) // 3 + 2]
    steps = run(loaded, prompt_ids, max_tokens=N, ignore_eos=True, stop=[late, early])
    assert out_text(steps) == text[: min(text.find(early), text.find(late))]
    assert steps[-1].finish_reason == "stop"


def test_stop_string_never_seen_runs_to_length(
    loaded: LoadedModel, prompt_ids: list[int], greedy: list[int]
) -> None:
    steps = run(loaded, prompt_ids, max_tokens=N, ignore_eos=True, stop=["\x07never"])
    assert out_ids(steps) == greedy
    assert out_text(steps) == decode(loaded, greedy)
    assert steps[-1].finish_reason == "length"


# ------------------------------------------------------------------------------ sampling & text


def test_seeded_sampling_is_reproducible(loaded: LoadedModel, prompt_ids: list[int]) -> None:
    def sample(seed: int) -> list[int]:
        return out_ids(
            run(loaded, prompt_ids, max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)
        )

    a, b, c = sample(1234), sample(1234), sample(4321)
    assert a == b
    assert a != c
    assert len(a) == len(c) == 24


def test_same_engine_twice_gives_the_same_output(
    loaded: LoadedModel, prompt_ids: list[int], greedy: list[int]
) -> None:
    engine = Engine(loaded.model, loaded.tokenizer)
    params = SamplingParams(max_tokens=N, ignore_eos=True)
    other = loaded.tokenizer.encode("Hello, world! How are you")
    first = [t for s in engine.generate(other, params) for t in s.token_ids]
    assert len(first) == N
    again = [t for s in engine.generate(prompt_ids, params) for t in s.token_ids]
    assert again == greedy


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_streamed_text_equals_decode(
    loaded: LoadedModel, prompt_ids: list[int], temperature: float
) -> None:
    steps = run(loaded, prompt_ids, max_tokens=N, temperature=temperature, seed=7, ignore_eos=True)
    ids = out_ids(steps)
    assert all(len(s.token_ids) == 1 for s in steps)  # plain decoding: one token per step
    assert out_text(steps) == decode(loaded, ids)


def test_stats(loaded: LoadedModel, prompt_ids: list[int]) -> None:
    steps = run(loaded, prompt_ids, max_tokens=12, ignore_eos=True)
    stats = steps[-1].stats
    assert stats.prompt_tokens == len(prompt_ids)
    assert stats.output_tokens == 12
    assert stats.target_passes == 11  # the first token comes from the prefill
    assert stats.tau == 1.0 and stats.drafted == 0 and stats.drafter == "none"
    assert stats.tokens_per_second > 0
    assert stats.t_start <= stats.t_first <= stats.t_end
    assert stats.ttft >= 0
    d = stats.to_dict()
    assert d["output_tokens"] == 12 and float(d["tokens_per_second"]) > 0  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ API


def test_api_generate_chat_stream(
    folder: Path, loaded: LoadedModel, prompt_ids: list[int], greedy: list[int]
) -> None:
    llm = LLM(str(folder), dtype="float32", threads=torch.get_num_threads())
    params = SamplingParams(max_tokens=N, ignore_eos=True)
    [out] = llm.generate(PROMPT, params)
    assert out.token_ids == greedy
    assert out.text == decode(loaded, greedy)
    assert out.finish_reason == "length"
    prompts: list[Prompt] = [PROMPT, prompt_ids]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    assert [o.token_ids for o in outs] == [greedy[:5], greedy[:5]]
    assert "".join(s.text for s in llm.stream(PROMPT, params)) == out.text
    chat = llm.chat(
        [{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=6, ignore_eos=True)
    )
    assert len(chat.token_ids) == 6 and chat.finish_reason == "length"
