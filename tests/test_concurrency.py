"""Many sequences at once: every request's tokens are bitwise what it gets alone.

The engine steps every running generation in ONE target pass (rows of several sequences: prompt
chunks, last tokens, draft chains and trees), each row attending to its own sequence's KV region
through explicit slot lists. These tests hold that to the strongest standard: token for token the
answer of the same request run alone on an idle engine, greedy and seeded, with mixed drafters,
lengths, stop conditions, cancellations and prefix-cache hits; and, below the engine, the logits
and keys/values of a pass over several sequences bitwise equal to each sequence's own passes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from helpers import (
    GGUF_LINEARS,
    TEXTS,
    Request,
    alone,
    check_together_equals_alone,
    model_pass,
    request_drafter,
    requests,
    run_to_end,
    together,
)
from tiny import hf_to_gguf, make_tiny_hf_model

from quickdraft.cache import KVPool
from quickdraft.engine import Engine, Generation
from quickdraft.errors import QuickdraftError
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.models.forward_pass import RowSlots, Step
from quickdraft.prefix_cache import PrefixCache
from quickdraft.sampling import SamplingParams
from quickdraft.server.metrics import ServerMetrics
from quickdraft.server.worker import EngineWorker
from quickdraft.speculative.base import ALONE, Drafter, PassLoad
from quickdraft.speculative.batch import propose_together
from quickdraft.speculative.draft_model import MAX_CATCH_UP, DraftModelDrafter
from quickdraft.speculative.suffix import SuffixDrafter
from quickdraft.speculative.tree import DraftTree, tree_mask, tree_positions
from quickdraft.speculative.verify import Draft

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llama-f32", "gemma3-f32", "qwen2-gguf"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = tmp_path_factory.mktemp("concurrency")
    if request.param == "llama-f32":  # the Python layers, fp32
        return load_model(str(make_tiny_hf_model(root, "llama", seed=5)), dtype="float32", max_context=256)
    if request.param == "gemma3-f32":  # sliding-window layers (window 5): slot lists cut by position
        return load_model(str(make_tiny_hf_model(root, "gemma3_text", seed=5)), dtype="float32", max_context=256)
    from quickdraft.quant.ggml import kernels_active

    if not kernels_active():
        pytest.skip("the native kernels are not built on this machine")
    folder = make_tiny_hf_model(root, "qwen2", seed=5, name="qwen2-gguf")
    return load_model(str(hf_to_gguf(folder, root / "q.gguf", GGUF_LINEARS)), dtype="auto", max_context=256)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_concurrent_requests_equal_each_alone(model: LoadedModel, n: int) -> None:
    engine = check_together_equals_alone(model, n, max(1, n // 2 + 1))  # some wait for a lane
    assert engine.has_room() and not engine.running


def test_cancelled_requests_free_their_lanes_and_leave_the_others_alone(model: LoadedModel) -> None:
    reqs = requests(model, 6)
    engine = Engine(model.model, model.tokenizer, max_sequences=3)
    got = together(engine, model, reqs, cancel={0: 3, 2: 1, 3: 5})
    for i, r in enumerate(reqs):
        full = alone(model, r)
        if i in (0, 2, 3):  # cut after the step that reached the count: a prefix of its answer
            assert got[i] == full[: len(got[i])] and len(got[i]) < len(full)
        else:
            assert got[i] == full
    assert len(engine._free) == 3 and not engine.running
    # every lane works again after the cancellations
    again = together(engine, model, reqs[1:4])
    assert [again[i] for i in range(3)] == [alone(model, r) for r in reqs[1:4]]


def test_prefix_cache_hits_under_load_equal_cold_runs(model: LoadedModel) -> None:
    """A conversation's next turn (its history reused from a lane or a stored copy) while other
    requests run equals the same prompt computed cold and alone."""
    engine = Engine(model.model, model.tokenizer, max_sequences=2, prefix_cache=PrefixCache(64 << 20))
    first = requests(model, 3)
    got = together(engine, model, first)
    follow = []
    for i, r in enumerate(first):  # history + answer + a new message
        prompt = r.prompt + got[i] + model.tokenizer.encode(" and then?")
        follow.append(Request(prompt, r.params, r.drafter, r.k))
    got2 = together(engine, model, follow + requests(model, 2))
    assert engine.prefix_cache.stats.hits >= 3
    for i, r in enumerate(follow + requests(model, 2)):
        assert got2[i] == alone(model, r)


@pytest.mark.parametrize("drafter", ["none", "auto"])
def test_a_prefix_running_in_another_lane_is_copied_and_equals_cold(model: LoadedModel, drafter: str) -> None:
    """B arrives while A, with the same long system prompt, still runs: B's lane copies A's computed
    prefix instead of recomputing it, and both answers equal their cold answers alone."""
    system = model.tokenizer.encode(TEXTS[3] + TEXTS[4])
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    a = Request(system + model.tokenizer.encode("Hello"), params, drafter)
    b = Request(system + model.tokenizer.encode("0123"), SamplingParams(max_tokens=8, temperature=0.8, seed=3), drafter)
    engine = Engine(model.model, model.tokenizer, max_sequences=2, prefix_cache=PrefixCache(64 << 20))
    gen_a = engine.add(a.prompt, a.params, request_drafter(a.drafter, model), a.k)
    got: dict[Generation, list[int]] = {gen_a: []}
    while gen_a.computed < len(a.prompt) or not got[gen_a]:  # A's prompt read, a token out
        for gen, step in engine.step():
            assert not isinstance(step, Exception), step
            got[gen] += step.token_ids
    gen_b = engine.add(b.prompt, b.params, request_drafter(b.drafter, model), b.k)
    shared = next(i for i, (x, y) in enumerate(zip(a.prompt, b.prompt, strict=False)) if x != y)
    assert gen_b.cached == shared >= len(system)
    assert engine.prefix_cache.stats.from_running == 1
    got[gen_b] = []
    run_to_end(engine, got)
    assert got[gen_a] == alone(model, a)
    assert got[gen_b] == alone(model, b)

@pytest.mark.parametrize("drafter", ["none", "auto"])
def test_requests_arriving_together_compute_a_shared_prompt_once(model: LoadedModel, drafter: str) -> None:
    """n > 1 choices, parallel calls with one system prompt: requests added in the same step whose
    prompts share a long prefix wait for the first to compute it, then copy it from its lane; one
    that leaves before it starts frees its lane and changes nothing; every answer equals its cold
    answer alone."""
    system = model.tokenizer.encode(TEXTS[3] + TEXTS[4])
    same = system + model.tokenizer.encode("Hello")
    reqs = [Request(same, SamplingParams(max_tokens=10, ignore_eos=True), drafter),
            Request(same, SamplingParams(max_tokens=8, temperature=0.8, seed=3), drafter),  # a second choice
            Request(system + model.tokenizer.encode("0123"), SamplingParams(max_tokens=9, ignore_eos=True), drafter),
            Request(model.tokenizer.encode(TEXTS[0]), SamplingParams(max_tokens=7, ignore_eos=True), drafter)]
    engine = Engine(model.model, model.tokenizer, max_sequences=5, prefix_cache=PrefixCache(64 << 20))
    gens = [engine.add(r.prompt, r.params, request_drafter(r.drafter, model), r.k) for r in reqs]
    assert [g.follows is gens[0] for g in gens] == [False, True, True, False]
    leaving = engine.add(same, reqs[0].params, request_drafter(drafter, model), 4)
    assert leaving.follows is gens[0]
    engine.remove(leaving)
    assert len(engine._free) == 1 and engine.running == gens
    got: dict[Generation, list[int]] = {g: [] for g in gens}
    run_to_end(engine, got)
    shared = next(i for i, (x, y) in enumerate(zip(same, reqs[2].prompt, strict=False)) if x != y)
    assert [g.cached for g in gens] == [0, len(same) - 1, shared, 0]  # computed once, copied twice
    assert engine.prefix_cache.stats.from_running == 2
    for g, r in zip(gens, reqs, strict=True):
        assert got[g] == alone(model, r)


def test_the_first_token_goes_out_before_the_drafter_reads_the_prompt(model: LoadedModel) -> None:
    """A drafter's prompt read (a draft model reads the whole prompt) is not in the time to first
    token: the step that emits the first token leaves the drafter untouched and the next step starts
    it. A request that ends at its first token leaves its drafter reset and no drafter state to the
    prefix cache: the same prompt again with the same drafter equals its cold answer."""
    vocab = model.config.vocab_size
    drafter = DraftModelDrafter(model.model, vocab, eager=True)
    engine = Engine(model.model, model.tokenizer, prefix_cache=PrefixCache(64 << 20))
    req = Request(model.tokenizer.encode(TEXTS[3]), SamplingParams(max_tokens=12, ignore_eos=True), "draft", 3)
    gen = engine.add(req.prompt, req.params, drafter, req.k)
    got: list[int] = []
    while not got:
        for _, step in engine.step():
            assert not isinstance(step, Exception), step
            got += step.token_ids
    assert len(got) == 1 and drafter.cache.length == 0 and drafter.pending_count() == 0
    while not gen.finished:
        for _, step in engine.step():
            assert not isinstance(step, Exception), step
            got += step.token_ids
        assert drafter.cache.length > 0  # started by the step after the first token
    engine.remove(gen)
    assert got == alone_with(model, req, DraftModelDrafter(model.model, vocab, eager=True), req.k)
    one = Request(model.tokenizer.encode(TEXTS[0]), SamplingParams(max_tokens=1), "draft", 3)
    first = engine.add(one.prompt, one.params, drafter, one.k)
    while not first.finished:
        engine.step()
    engine.remove(first)
    assert drafter.cache.length == 0  # reset: it never read that prompt
    again = Request(one.prompt, SamplingParams(max_tokens=10, ignore_eos=True), "draft", 3)
    assert [t for s in engine.generate(again.prompt, again.params, drafter, again.k) for t in s.token_ids] == \
        alone_with(model, again, DraftModelDrafter(model.model, vocab, eager=True), again.k)


def test_rows_of_several_sequences_in_one_pass_equal_each_alone(model: LoadedModel) -> None:
    """Below the engine: one pass over a chain of sequence A, a decode row of B and a tree of C
    (each after its own context in its own lane) gives bitwise each sequence's logits and keys /
    values when it runs alone on its own cache."""
    m = model.model
    vocab = model.config.vocab_size
    contexts = [model.tokenizer.encode(t) for t in TEXTS[:3]]
    tree = DraftTree(torch.tensor([11, 12, 13, 14]), torch.tensor([-1, -1, 0, 1]), None)
    new = [torch.tensor([3, 4, 5]), torch.tensor([6]), torch.cat([torch.tensor([7]), tree.tokens])]
    # alone: each on its own cache
    solo_logits, solo_kv = [], []
    for i, (ctx, ids) in enumerate(zip(contexts, new, strict=True)):
        cache = m.make_cache(64)
        m.prefill(torch.tensor(ctx), cache)
        start = cache.length
        if i == 2:
            logits, _ = model_pass(m, ids, cache, tree_positions(start, tree, m.device), tree_mask(start, tree, m.device))
        else:
            logits, _ = m(ids, cache)
        solo_logits.append(logits)
        solo_kv.append(cache.k[:, :, : start + len(ids)].clone())
    # together: the contexts in three lanes of a pool, the new rows in one pass
    pool = KVPool(m.make_cache(3 * 64 + 16), 3, 64, 16)
    for lane, ctx in zip(pool.lanes, contexts, strict=True):
        m.prefill(torch.tensor(ctx), lane)
    slots, positions, offset = [], [], 0
    for i, ids in enumerate(new):
        start = pool.lanes[i].length
        committed = torch.arange(pool.base(i), pool.base(i) + start)
        first = pool.staging_start + offset
        if i == 2:
            own = [first + row.nonzero().squeeze(1) for row in tree_mask(0, tree, m.device)]
            positions.append(tree_positions(start, tree, m.device))
        else:
            own = [torch.arange(first, first + j + 1) for j in range(len(ids))]
            positions.append(torch.arange(start, start + len(ids)))
        slots += [torch.cat([committed, o]) for o in own]
        offset += len(ids)
    pos = torch.cat(positions)
    pool.begin_pass(offset)
    logits, _ = model_pass(m, torch.cat(new), pool.buffer, pos, rows=RowSlots(slots, pool.slot_positions(pos)))
    assert logits.shape == (offset, vocab)
    at = 0
    for i, ids in enumerate(new):
        assert torch.equal(logits[at : at + len(ids)], solo_logits[i]), f"sequence {i}'s rows differ in a shared pass"
        pool.keep(i, torch.arange(at, at + len(ids)))
        lane = pool.lanes[i]
        assert torch.equal(lane.k[:, :, : lane.length], solo_kv[i])
        at += len(ids)


def test_engine_refuses_what_it_cannot_run(model: LoadedModel) -> None:
    with pytest.raises(QuickdraftError, match="--max-concurrency"):
        Engine(model.model, model.tokenizer, max_sequences=0)
    engine = Engine(model.model, model.tokenizer, max_sequences=2)
    prompt = model.tokenizer.encode("Hello")
    engine.add(prompt, SamplingParams(max_tokens=4))
    engine.add(prompt, SamplingParams(max_tokens=4))
    with pytest.raises(QuickdraftError, match="wait for one to finish"):
        engine.add(prompt, SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="idle engine"):
        next(iter(engine.generate(prompt, SamplingParams(max_tokens=4))))


def test_worker_serves_clients_at_once_in_arrival_order(model: LoadedModel) -> None:
    """The server's worker: 6 clients, 2 lanes. Each answer equals its answer alone, requests start
    in arrival order (FIFO: none starves), a client that leaves mid-stream frees its lane."""
    reqs = [r for r in requests(model, 6) if r.drafter in ("none", "ngram")] * 2  # the server's kinds
    engine = Engine(model.model, model.tokenizer, max_sequences=2)
    worker = EngineWorker(engine, SuffixDrafter(), 4, ServerMetrics())
    worker.start()
    firsts: list[int] = []

    async def client(i: int, r: Request) -> list[int]:
        await asyncio.sleep(0.01 * i)  # arrive in index order
        job = worker.submit(r.prompt, r.params, None)
        ids: list[int] = []
        async for step in job.steps():
            if not ids:
                firsts.append(i)
            ids += step.token_ids
            if i == 1 and len(ids) >= 2:
                job.cancel()
        return ids

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(client(i, r) for i, r in enumerate(reqs)))

    try:
        got = asyncio.run(main())
    finally:
        worker.stop()
    assert sorted(firsts) == list(range(len(reqs)))  # everyone was served
    assert len(reqs) - 1 not in firsts[:2]  # the last to arrive waited for a lane
    for i, r in enumerate(reqs):
        full = alone_with(model, r, SuffixDrafter(), 4)
        assert got[i] == (full[: len(got[i])] if i == 1 else full)
    assert len(engine._free) == 2


def test_the_thread_that_starts_the_worker_hands_over_its_compute_threads() -> None:
    """libgomp keeps a team of workers per thread that ran a parallel region and, once its teams hold
    more threads than there are CPUs, lets every barrier spin only ~100 times: the loader's team
    beside the engine thread's put the compute threads to sleep at each barrier of every pass. The
    thread that starts the worker (the one that loaded the model) ends its team first."""
    import os
    import threading
    import time

    from quickdraft.hardware import hand_over_compute_threads

    def count() -> int:
        return len(os.listdir("/proc/self/task"))

    seen: dict[str, Any] = {}

    def loader() -> None:  # a fresh thread: its team is its own, whatever ran before in this process
        torch.set_num_threads(2)
        before = count()
        torch.ones(1 << 22).exp_()  # large enough for a parallel region of 2 threads
        seen["with team"] = count() - before
        seen["handed over"] = hand_over_compute_threads()
        for _ in range(100):  # (the worker leaves its barrier and exits a moment later)
            if count() == before:
                break
            time.sleep(0.01)
        seen["after"] = count() - before

    threads = torch.get_num_threads()
    try:
        t = threading.Thread(target=loader)
        t.start()
        t.join()
    finally:
        torch.set_num_threads(threads)
    assert seen == {"with team": 1, "handed over": True, "after": 0}

def alone_with(model: LoadedModel, req: Request, drafter: Drafter | None, k: int) -> list[int]:
    engine = Engine(model.model, model.tokenizer)
    return [t for s in engine.generate(req.prompt, req.params, drafter, k) for t in s.token_ids]


def test_lanes_are_regions_of_one_buffer(tmp_path: Path) -> None:
    from quickdraft.cache import KVCache

    buffer = KVCache(2, 2, 8, 3 * 10 + 4, torch.float32)
    pool = KVPool(buffer, 3, 10, 4)
    pool.lanes[1].k[0, 0, 2] = 7.0
    assert buffer.k[0, 0, 12, 0] == 7.0 and pool.lanes[1].max_len == 10
    with pytest.raises(ValueError, match="staging"):
        pool.begin_pass(5)


class LoadRecorder(SuffixDrafter):
    """n-gram lookup that records what the engine says of the pass before each prefill/propose."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[PassLoad] = []

    def join(self, load: PassLoad) -> None:
        self.loads.append(load)


def test_the_engine_tells_each_drafter_what_the_others_bring_to_the_pass(model: LoadedModel) -> None:
    """Alone a drafter hears ALONE; beside another sequence it hears that one's rows, drafting
    seconds and emitted tokens of the last pass (what its own draft competes with), and the last
    pass's rows and seconds as a whole (what a row costs in a pass of many)."""
    engine = Engine(model.model, model.tokenizer, max_sequences=2)
    a, b = LoadRecorder(), LoadRecorder()
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ga = engine.add(model.tokenizer.encode(TEXTS[0]), params, a, 3)
    engine.step()  # A alone reads its prompt and emits its first token
    assert a.loads == [ALONE]
    alone = engine.last_pass_seconds
    gb = engine.add(model.tokenizer.encode(TEXTS[1]), params, b, 3)
    engine.step()  # B's prompt beside A's first draft
    first = len(model.tokenizer.encode(TEXTS[0]))  # (A's prompt: the last pass, alone)
    assert a.loads[-1] == PassLoad(1, 0, 0.0, 0, first, alone) and b.loads[-1].sequences == 1
    brought = {g: (g.rows, g.draft_seconds, g.emitted) for g in (ga, gb)}  # by each in the last pass
    assert brought[gb][0] == len(model.tokenizer.encode(TEXTS[1])) and brought[gb][2] == 1  # its prompt, its first token
    both = (engine.last_pass_rows, engine.last_pass_seconds)
    assert both[0] == brought[ga][0] + brought[gb][0] and both[1] > 0
    engine.step()
    assert a.loads[-1] == PassLoad(1, *brought[gb], *both)
    assert b.loads[-1] == PassLoad(1, *brought[ga], *both)


def test_a_draft_model_under_load_leaves_the_prompt_to_its_first_proposal(model: LoadedModel) -> None:
    """Reading a prompt with the draft model at prefill holds up every sequence in the pass: under
    load it reads nothing then, and its first proposal reads only the prompt's last MAX_CATCH_UP
    tokens, at their true positions (alone it reads the whole prompt at prefill, as before)."""
    prompt = torch.tensor(model.tokenizer.encode(TEXTS[3]))
    assert len(prompt) > MAX_CATCH_UP + 1
    loaded = DraftModelDrafter(model.model, model.config.vocab_size, eager=True)
    loaded.join(PassLoad(2, 8, 0.0, 4))
    loaded.prefill(prompt, SamplingParams())
    assert loaded.cache.length == 0 and loaded.pending == prompt[-MAX_CATCH_UP:].tolist()
    draft = loaded.propose(3)
    assert loaded.cache.length == MAX_CATCH_UP + 2  # the catch-up and two drafted tokens
    assert loaded.slot_positions[0] == len(prompt) - MAX_CATCH_UP and draft.k == 3
    alone = DraftModelDrafter(model.model, model.config.vocab_size, eager=True)
    alone.prefill(prompt, SamplingParams())
    assert alone.cache.length == len(prompt) - 1


class PassCounter:
    """Counts a model's passes on one cache (wraps ``run``, which every pass goes through)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, model: torch.nn.Module, cache: object) -> None:
        self.calls: list[int] = []  # rows of each pass on ``cache``
        run = model.run

        def counting(ids: torch.Tensor, step: Step, *args: Any, **kw: Any) -> Any:
            if step.cache is cache:
                self.calls.append(int(ids.shape[0]))
            return run(ids, step, *args, **kw)

        monkeypatch.setattr(model, "run", counting)


def test_forked_draft_models_propose_in_one_pass_per_round_bitwise_as_alone(
        model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four sequences' draft models, forked onto lanes of one KV pool, propose together: ONE pass of
    the draft model per drafted token for all of them, and each one's proposal (tokens, draft
    probabilities) and its cache afterwards are bitwise what a drafter of its own computes alone,
    greedy and sampled, after a capped catch-up (slots lagging positions) and after rollbacks."""
    vocab = model.config.vocab_size
    base = DraftModelDrafter(model.model, vocab, eager=True)
    pooled = [base] + [f for f in base.forks(3) if isinstance(f, DraftModelDrafter)]
    assert len(pooled) == 4 and base.pool is not None and [d.lane for d in pooled] == [0, 1, 2, 3]
    solo = [DraftModelDrafter(model.model, vocab, eager=True) for _ in pooled]
    prompts = [torch.tensor(model.tokenizer.encode(t)) for t in TEXTS[:4]]
    assert len(prompts[3]) > MAX_CATCH_UP + 1
    for i, (p, s, prompt) in enumerate(zip(pooled, solo, prompts, strict=True)):
        params = SamplingParams(temperature=0.9, seed=40 + i) if i % 2 else SamplingParams()
        load = PassLoad(3, 6, 0.0, 3) if i == 3 else ALONE  # under load: the prompt is left to the first proposal
        for d in (p, s):
            d.join(load)
            d.prefill(prompt, params)
            d.commit(torch.tensor([7 + i]), 0)
    counter = PassCounter(monkeypatch, model.model, base.pool.buffer)
    for rnd, (k, accepted) in enumerate([(3, [0, 3, 1, 2]), (4, [4, 0, 2, 1])]):
        reading = sum(min(p.pending_count(), MAX_CATCH_UP) for p in pooled)  # (catch-ups capped)
        before = len(counter.calls)
        together = propose_together([(p, k) for p in pooled])
        assert counter.calls[before:] == [reading] + [len(pooled)] * (k - 1)  # one pass per drafted token
        drafts = []
        for i, ((draft, _), s) in enumerate(zip(together, solo, strict=True)):
            assert isinstance(draft, Draft)
            alone = s.propose(k)
            assert torch.equal(draft.tokens, alone.tokens), f"sequence {i}, round {rnd}"
            assert (draft.probs is None) == (alone.probs is None) == (i % 2 == 0)
            if draft.probs is not None:
                assert alone.probs is not None and torch.equal(draft.probs, alone.probs)
            drafts.append(draft)
        for i, (p, s) in enumerate(zip(pooled, solo, strict=True)):
            n = accepted[i]
            tokens = torch.cat([drafts[i].tokens[:n], torch.tensor([11 + i])])
            p.commit(tokens, n)
            s.commit(tokens, n)
            pkv, ptok, ppos = p.snapshot()
            skv, stok, spos = s.snapshot()
            assert (ptok, ppos) == (stok, spos) and torch.equal(pkv.keys[0], skv.keys[0]) and torch.equal(pkv.values[0], skv.values[0])
    assert pooled[3].offset > 0  # its slots lag its positions


def test_requests_drafting_with_forked_draft_models_equal_each_alone(
        model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the engine: four requests whose draft models are forks on one pool (their passes run
    together) emit token for token what each emits alone with a draft model of its own; greedy,
    seeded, and with a repetition penalty the draft ignores (wrong drafts)."""
    vocab = model.config.vocab_size
    base = DraftModelDrafter(model.model, vocab, eager=True)
    drafters = [base, *base.forks(3)]
    assert base.pool is not None
    counter = PassCounter(monkeypatch, model.model, base.pool.buffer)
    reqs = [Request(model.tokenizer.encode(TEXTS[i]), SamplingParams(**params), "draft", k=2 + i)
            for i, params in enumerate([{"max_tokens": 20, "ignore_eos": True},
                                        {"max_tokens": 16, "ignore_eos": True, "temperature": 0.9, "seed": 5},
                                        {"max_tokens": 18, "ignore_eos": True, "repetition_penalty": 1.3},
                                        {"max_tokens": 14, "ignore_eos": True, "temperature": 0.7, "seed": 9}])]
    engine = Engine(model.model, model.tokenizer, max_sequences=4)
    running = {engine.add(r.prompt, r.params, d, r.k): i for i, (r, d) in enumerate(zip(reqs, drafters, strict=True))}
    got: dict[int, list[int]] = {i: [] for i in range(len(reqs))}
    while running:
        for gen, step in engine.step():
            assert not isinstance(step, Exception), step
            got[running[gen]] += step.token_ids
            if step.finished:
                engine.remove(gen)
                del running[gen]
    assert any(rows > 1 for rows in counter.calls)  # the draft models' passes ran together
    for i, r in enumerate(reqs):
        own = Engine(model.model, model.tokenizer)
        alone = [t for s in own.generate(r.prompt, r.params, DraftModelDrafter(model.model, vocab, eager=True), r.k)
                 for t in s.token_ids]
        assert got[i] == alone, f"request {i} ({r.params}) differs from its answer alone"


def test_compute_threads_come_from_the_flag_then_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """--threads, else OMP_NUM_THREADS (processes run side by side, as the test suite's two
    workers on two cores, take their share), else the physical cores; a bad value is one line."""
    from quickdraft.api import configure_threads
    from quickdraft.errors import QuickdraftError

    threads = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert configure_threads(None) == 1 == torch.get_num_threads()
        assert configure_threads(2) == 2 == torch.get_num_threads()
        monkeypatch.setenv("OMP_NUM_THREADS", "two")
        with pytest.raises(QuickdraftError, match="OMP_NUM_THREADS must be a whole number"):
            configure_threads(None)
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert configure_threads(None) == (psutil.cpu_count(logical=False) or threads)
    finally:
        torch.set_num_threads(threads)
