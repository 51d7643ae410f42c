"""The static-shape pass behind CUDA graphs (quickdraft/models/graphs.py), run eagerly on the CPU.

What a CUDA graph replays is exactly :meth:`CausalLM.run` of a static :class:`Step` on fixed input buffers; on
the CPU ``StepGraphs(capture=False)`` runs that same pass through the same buffers, so these tests
cover everything but the capture call itself (``benchmarks/gpu_check.py`` checks that on a GPU):
the static pass against the normal one (chains, trees, cache contents), greedy output of plain and
speculative decoding (scripted chains right / wrong / partly right, trees) through it, the span
buckets, what is refused and when the engine falls back to the eager pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import TINY_PROMPT, Case, TreeOracle, check_scripted, make_case, model_pass
from tiny import make_tiny_hf_model

import quickdraft.engine as engine_mod
from quickdraft.engine import Engine
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.models.forward_pass import causal_mask
from quickdraft.models.graphs import MIN_SPAN, StepGraphs, make_step_graphs, supports_static
from quickdraft.sampling import SamplingParams
from quickdraft.speculative.ngram import NGramDrafter

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread per module

TINY_N = 48  # greedy tokens per scripted-chain run (as tests/test_spec.py's)
N = 40  # greedy tokens per n-gram and tree run (as tests/test_tree.py's)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("graphs")


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request: pytest.FixtureRequest, root: Path) -> LoadedModel:
    folder = make_tiny_hf_model(root, request.param, seed=21)
    return load_model(str(folder), dtype="float32", max_context=256)


@pytest.fixture
def static_engines(monkeypatch: pytest.MonkeyPatch) -> list[StepGraphs]:
    """Every Engine built in the test runs its short passes through StepGraphs(capture=False)."""
    made: list[StepGraphs] = []

    def graphs(model: torch.nn.Module, cache: object, mode: str, warn: object = None) -> StepGraphs:
        made.append(StepGraphs(model, cache, max_rows=32, capture=False))  # type: ignore[arg-type]
        return made[-1]

    monkeypatch.setattr(engine_mod, "make_step_graphs", graphs)
    return made


def prefilled(loaded: LoadedModel, prompt: list[int]) -> tuple[Engine, torch.Tensor]:
    engine = Engine(loaded.model, loaded.tokenizer, cuda_graphs="off")
    ids = torch.tensor(prompt)
    loaded.model(ids, engine.cache)
    return engine, ids


def test_static_pass_equals_the_normal_pass(tiny: LoadedModel) -> None:
    """Decode rows, a 5-row chain and a tree: logits and the cache agree with forward()."""
    model = tiny.model
    prompt = tiny.tokenizer.encode(TINY_PROMPT)
    a, _ = prefilled(tiny, prompt)
    b, _ = prefilled(tiny, prompt)
    graphs = StepGraphs(model, b.cache, capture=False)
    passes: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = [
        (torch.tensor([5]), None, None),
        (torch.tensor([7, 8, 9, 10, 11]), None, None),
    ]
    start = a.cache.length + 6
    # a tree: root, two children of the root, a grandchild under the second child
    parents = [-1, 0, 0, 2]
    tree_mask = causal_mask(start, 4, torch.device("cpu"))
    assert tree_mask is not None
    tree_mask[1:, start:] = False
    for i, p in enumerate(parents):
        tree_mask[i, start + i] = True
        while p >= 0:
            tree_mask[i, start + p] = True
            p = parents[p]
    depth = torch.tensor([0, 1, 1, 2])
    passes.append((torch.tensor([12, 13, 14, 15]), start + depth, tree_mask))
    for ids, positions, mask in passes:
        want, _ = model_pass(model, ids, a.cache, positions, mask)
        got = graphs.run(ids, positions, mask, (), None)
        assert got is not None
        logits, captured = got
        assert captured == []
        assert logits.shape == want.shape
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
        assert b.cache.length == a.cache.length
        n = a.cache.length
        torch.testing.assert_close(b.cache.k[:, :, :n], a.cache.k[:, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.cache.v[:, :, :n], a.cache.v[:, :, :n], rtol=1e-5, atol=1e-5)
    assert graphs.replays == 3
    # num_logits and captures come back like forward()'s
    want, want_cap = model(torch.tensor([3, 4]), a.cache, capture=(0, 1), num_logits=1)
    logits, cap = graphs.run(torch.tensor([3, 4]), None, None, (0, 1), 1) or (None, None)
    assert logits is not None and cap is not None and logits.shape == want.shape == (1, tiny.config.vocab_size)
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    assert len(cap) == len(want_cap) == 2
    for c, w in zip(cap, want_cap, strict=True):
        torch.testing.assert_close(c, w, rtol=1e-5, atol=1e-5)


def test_shapes_are_reused_and_spans_are_buckets(tiny: LoadedModel) -> None:
    engine, _ = prefilled(tiny, tiny.tokenizer.encode(TINY_PROMPT))
    graphs = StepGraphs(tiny.model, engine.cache, capture=False)
    assert graphs.span(1) == MIN_SPAN == 256 and graphs.span(256) == 256
    assert graphs.span(257) == 256  # never more than the cache holds (256 here)
    for _ in range(5):
        assert graphs.run(torch.tensor([4]), None, None, (), None) is not None
    assert list(graphs._graphs) == [(1, 256, ())]  # five passes, one shape
    assert graphs.run(torch.tensor([4] * 33), None, None, (), None) is None  # over max_rows: eager
    big = StepGraphs(tiny.model, tiny.model.make_cache(4096), capture=False)
    assert [big.span(e) for e in (1, 300, 512, 513, 4000, 4096)] == [256, 512, 512, 1024, 4096, 4096]


def test_cut_output_vocabulary_runs_eagerly(tiny: LoadedModel) -> None:
    engine, _ = prefilled(tiny, tiny.tokenizer.encode(TINY_PROMPT))
    graphs = StepGraphs(tiny.model, engine.cache, capture=False)
    assert tiny.model.set_output_vocab(torch.arange(50))
    try:
        length = engine.cache.length
        assert graphs.run(torch.tensor([4]), None, None, (), None) is None
        assert engine.cache.length == length  # nothing written
    finally:
        tiny.model.set_output_vocab(None)


@pytest.fixture(scope="module")
def case(root: Path) -> Case:
    folder = make_tiny_hf_model(root, "qwen2", seed=21, name="qwen2-case")
    return make_case(load_model(str(folder), dtype="float32", max_context=256), TINY_PROMPT, TINY_N)


@pytest.mark.parametrize("kind", ["oracle", "wrong", "partly"])
def test_scripted_drafters_through_static_passes_match_plain(
    case: Case, static_engines: list[StepGraphs], kind: str
) -> None:
    """Greedy speculative output through the static passes == plain greedy output (fp32)."""
    check_scripted(case, kind, 4)
    assert static_engines and static_engines[-1].replays > 0
    # plain decoding through them gives the same tokens as the normal passes did
    engine = Engine(case.loaded.model, case.loaded.tokenizer)
    steps = list(engine.generate(case.prompt, SamplingParams(max_tokens=TINY_N, ignore_eos=True)))
    assert [t for s in steps for t in s.token_ids] == case.truth
    # every pass replayed: the decode steps, and the prefill where it fits max_rows
    assert static_engines[-1].replays == TINY_N - 1 + (len(case.prompt) <= 32)


def test_ngram_and_trees_through_static_passes_match_plain(root: Path, static_engines: list[StepGraphs]) -> None:
    loaded = load_model(str(make_tiny_hf_model(root, "llama", seed=21, name="llama-trees")), dtype="float32",
                        max_context=256)
    prompt = loaded.tokenizer.encode(TINY_PROMPT)
    params = SamplingParams(max_tokens=N, ignore_eos=True)
    truth = [t for s in Engine(loaded.model, loaded.tokenizer).generate(prompt, params) for t in s.token_ids]
    for drafter, k in ((NGramDrafter(min_ngram=1), 6), (TreeOracle(truth, loaded.config.vocab_size, "right_varied"), 8),
                       (TreeOracle(truth, loaded.config.vocab_size, "partly"), 8)):
        engine = Engine(loaded.model, loaded.tokenizer)
        steps = list(engine.generate(prompt, params, drafter, k))
        assert [t for s in steps for t in s.token_ids] == truth
        assert steps[-1].stats.accepted > 0
        prefill = len(prompt) <= engine.graphs.max_rows if engine.graphs else 0
        assert engine.graphs is not None and engine.graphs.replays == steps[-1].stats.target_passes + prefill


def test_what_static_passes_refuse(root: Path) -> None:
    gemma = load_model(str(make_tiny_hf_model(root, "gemma3_text", seed=3)), dtype="float32", max_context=64)
    assert supports_static(gemma.model) is not None
    with pytest.raises(ValueError, match="do not apply"):
        StepGraphs(gemma.model, gemma.model.new_cache(), capture=False)
    llama = load_model(str(make_tiny_hf_model(root, "llama", seed=3, name="llama-refuse")), dtype="float32",
                       max_context=64)
    assert supports_static(llama.model) is None
    with pytest.raises(ValueError, match="CUDA device"):
        StepGraphs(llama.model, llama.model.new_cache())  # capture on a CPU cache
    cache = llama.model.new_cache()
    assert make_step_graphs(llama.model, cache, "auto") is None  # CPU: off, silently
    said: list[str] = []
    assert make_step_graphs(llama.model, cache, "on", said.append) is None
    assert said == ["CUDA graphs not used: the model is not on a CUDA device"]
    assert make_step_graphs(llama.model, cache, "off") is None
    with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
        make_step_graphs(llama.model, cache, "yes")
    assert Engine(llama.model, llama.tokenizer).graphs is None


def test_llm_device_and_cuda_graph_options(root: Path) -> None:
    from quickdraft.api import LLM
    from quickdraft.errors import QuickdraftError

    folder = make_tiny_hf_model(root, "llama", seed=4, name="llama-llm")
    said: list[str] = []
    llm = LLM(str(folder), draft="none", dtype="float32", max_context=64, threads=1, cuda_graphs="on", log=said.append)
    assert llm.engine.graphs is None and "CUDA graphs not used: the model is not on a CUDA device" in said
    assert llm.target.model.device == torch.device("cpu")  # device "auto" without a GPU
    with pytest.raises(QuickdraftError, match="--cuda-graphs must be auto, on or off"):
        LLM(str(folder), draft="none", cuda_graphs="yes")
    with pytest.raises(QuickdraftError, match="--device must be one of"):
        LLM(str(folder), draft="none", device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(QuickdraftError, match="CUDA is not available"):
            LLM(str(folder), draft="none", device="cuda")
