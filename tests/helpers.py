"""Helpers the test modules share: plain and speculative runs through the engine, the scripted
drafters (chains and trees built from the plain greedy output, checking on every commit that the
engine accepted exactly the longest right prefix), requests run together and alone, prefix-cache
runs, and a model's logits. Test modules import from here (and from tiny.py, the tiny
checkpoints), never from each other.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from tiny import reference_logits

from quickdraft.engine import Engine, Generation, RequestStats, StepOutput
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.models.causal_lm import CausalLM
from quickdraft.models.forward_pass import RowSlots, Step
from quickdraft.sampling import SamplingParams
from quickdraft.speculative.base import Drafter
from quickdraft.speculative.draft_model import DraftModelDrafter
from quickdraft.speculative.policy import Acceptance, AutoDrafter, Candidate, TargetCost
from quickdraft.speculative.suffix import SuffixDrafter
from quickdraft.speculative.tree import DraftTree
from quickdraft.speculative.verify import Draft
from quickdraft.tokenizer import Tokenizer

MB = 1 << 20
# The prompt of the tiny models' speculation tests: it repeats, so lookup drafters find matches.
TINY_PROMPT = "for i in range(10):\n    print(i, i * i)\nfor i in range(10):\n    print(i"
# Prefix-cache runs: 24 greedy tokens, the first token's top 3 logprobs compared bitwise.
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3)
# The same kind of model as GGUF blocks (Q8_0 / Q4_0 / Q5_0 linears) on the CPU kernels, where every
# decode and verify pass runs through the native decoder stack (quickdraft/models/native.py).
GGUF_LINEARS = {"attn_q.weight": "Q8_0", "attn_k.weight": "Q4_0", "attn_v.weight": "Q5_0",
                "attn_output.weight": "Q8_0", "ffn_gate.weight": "Q4_0", "ffn_up.weight": "Q8_0",
                "ffn_down.weight": "Q5_0"}


def logits(loaded: LoadedModel, ids: list[int], cache: Any = None) -> torch.Tensor:
    """The logits of every row of one pass over ``ids``: on ``cache`` (continuing it), else a fresh cache."""
    out, _ = loaded.model(torch.tensor(ids), cache if cache is not None else loaded.model.new_cache())
    return out  # [len(ids), V]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-4) -> None:
    """Max abs difference within ``rel`` times the logits' scale (max |logit|, at least 1)."""
    assert actual.shape == expected.shape
    scale = max(1.0, float(expected.abs().max()))
    diff = float((actual - expected).abs().max())
    assert diff <= rel * scale, f"max abs diff {diff:.3g} > {rel:g} * scale {scale:.3g}"


def fp32_as_close_as_transformers(loaded: LoadedModel, reference: Any, ids: list[int]) -> None:
    """A recurrent model's logits (Qwen3.5's Gated DeltaNet) against transformers' ``reference``:
    over the first 32 positions, in one pass and decoded token by token, within 1e-4 (+ 3e-6 of
    the logit: a few fp32 ulps, since torch's fp32 GEMMs sum in another order on some CPUs: 1.0e-4
    at a logit of ~42 on a Sapphire Rapids) of transformers' fp32 logits, or at least as close to
    the float64 computation as transformers' own fp32 run. Further on, fp32 rounding in the
    recurrence grows with the position (a tied head's logits reach ~75): there quickdraft must be
    at least as close to the float64 computation as transformers' own fp32 run."""
    want = reference_logits(reference, ids)
    got = logits(loaded, ids)
    with torch.inference_mode():
        exact = reference.double()(input_ids=torch.tensor([ids]), use_cache=False).logits[0]

    def close(ours: torch.Tensor) -> bool:
        if bool(((ours - want[:32]).abs() <= 1e-4 + 3e-6 * want[:32].abs()).all()):
            return True
        return bool((ours.double() - exact[:32]).abs().max() <= (want[:32].double() - exact[:32]).abs().max())

    assert close(got[:32])
    cache = loaded.model.new_cache()  # decoded token by token: every step's state carried over
    stepped = torch.cat([logits(loaded, [t], cache) for t in ids[:32]])
    assert close(stepped)
    ours, theirs = (got.double() - exact).abs().max(), (want.double() - exact).abs().max()
    assert ours <= max(theirs, 1e-4), (ours, theirs)


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def tree(tokens: Sequence[int], parents: Sequence[int], probs: torch.Tensor | None = None) -> DraftTree:
    return DraftTree(ids(*tokens), ids(*parents), probs)


# ------------------------------------------------------------------------------- engine runs


@dataclass
class Run:
    ids: list[int]
    text: str
    finish_reason: str | None
    stats: RequestStats
    steps: list[StepOutput]
    engine: Engine


def generate(
    loaded: LoadedModel,
    prompt: list[int],
    drafter: Drafter | None = None,
    k: int = 0,
    tokenizer: Tokenizer | None = None,
    constraint: Any = None,
    **params: Any,
) -> Run:
    """One request on a fresh engine, ``params`` being SamplingParams fields."""
    engine = Engine(loaded.model, tokenizer or loaded.tokenizer)
    steps = list(engine.generate(prompt, SamplingParams(**params), drafter, k, constraint=constraint))
    return Run(
        [t for s in steps for t in s.token_ids],
        "".join(s.text for s in steps),
        steps[-1].finish_reason,
        steps[-1].stats,
        steps,
        engine,
    )


# ------------------------------------------------------------------------------- scripted drafters


@dataclass
class Case:
    """A model, a prompt and its plain greedy continuation (EOS ignored, ``len(truth)`` tokens)
    under ``params`` (extra SamplingParams fields, e.g. penalties)."""

    loaded: LoadedModel
    prompt: list[int]
    truth: list[int]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def vocab(self) -> int:
        return self.loaded.config.vocab_size

    def spec(self, drafter: Drafter, k: int, **params: Any) -> Run:
        params = {"max_tokens": len(self.truth), "ignore_eos": True} | self.params | params
        return generate(self.loaded, self.prompt, drafter, k, **params)


def make_case(loaded: LoadedModel, text: str, n: int, **params: Any) -> Case:
    prompt = loaded.tokenizer.encode(text)
    run = generate(loaded, prompt, max_tokens=n, ignore_eos=True, **params)
    assert len(run.ids) == n and run.finish_reason == "length"
    assert run.stats.target_passes == n - 1 and run.stats.drafted == 0
    return Case(loaded, prompt, run.ids, params)


class ScriptedDrafter(Drafter):
    """Knows the plain greedy output; ``draft(true, step)`` turns the next k true tokens into a
    proposal. Checks on every commit that the engine emitted the truth and accepted exactly the
    longest right prefix of the proposal; ``log`` keeps (k, num_accepted) per drafting step."""

    name = "scripted"

    def __init__(self, truth: list[int], vocab: int) -> None:
        self.truth, self.vocab = truth, vocab
        self.context: list[int] = []
        self.prompt_len = 0
        self.step = 0
        self.proposed: list[int] | None = None
        self.log: list[tuple[int, int]] = []

    def draft(self, true: list[int], step: int) -> list[int]:
        raise NotImplementedError

    def prefill(self, prompt_ids: torch.Tensor, params: SamplingParams, cached: int = 0) -> None:
        self.context = [int(t) for t in prompt_ids.tolist()]
        self.prompt_len = len(self.context)
        self.step, self.proposed, self.log = 0, None, []

    def propose(self, k: int) -> Draft:
        assert self.proposed is None, "propose called twice without a commit"
        pos = len(self.context) - self.prompt_len
        true = self.truth[pos : pos + k]
        assert len(true) == k, f"the engine asked for {k} drafts at output {pos}, past max_tokens"
        self.proposed = self.draft(true, self.step)
        self.step += 1
        return Draft(tokens=torch.tensor(self.proposed, dtype=torch.long))

    def commit(self, tokens: torch.Tensor, num_accepted: int) -> None:
        emitted = [int(t) for t in tokens.tolist()]
        pos = len(self.context) - self.prompt_len
        assert emitted == self.truth[pos : pos + len(emitted)], f"output differs at {pos}"
        if self.proposed is None:
            assert num_accepted == 0 and len(emitted) == 1
        else:
            true = self.truth[pos : pos + len(self.proposed)]
            right = 0
            while right < len(true) and self.proposed[right] == true[right]:
                right += 1
            assert num_accepted == right, (
                f"step {self.step - 1}: accepted {num_accepted}, {right} right"
            )
            assert len(emitted) == num_accepted + 1
            self.log.append((len(self.proposed), num_accepted))
            self.proposed = None
        self.context.extend(emitted)

    def reset(self) -> None:
        self.context, self.proposed = [], None


class OracleDrafter(ScriptedDrafter):
    name = "oracle"

    def draft(self, true: list[int], step: int) -> list[int]:
        return list(true)


class WrongDrafter(ScriptedDrafter):
    name = "wrong"

    def draft(self, true: list[int], step: int) -> list[int]:
        return [(t + 1) % self.vocab for t in true]


class PartlyRightDrafter(ScriptedDrafter):
    """Right except at the draft positions ``wrong_at(step)``."""

    name = "partly"

    def __init__(self, truth: list[int], vocab: int, wrong_at: Callable[[int], set[int]]) -> None:
        super().__init__(truth, vocab)
        self.wrong_at = wrong_at

    def draft(self, true: list[int], step: int) -> list[int]:
        bad = self.wrong_at(step)
        return [(t + 1) % self.vocab if i in bad else t for i, t in enumerate(true)]


class RandomDrafter(ScriptedDrafter):
    """Each token right with probability ``p_right``, else a seeded random id."""

    name = "random"

    def __init__(self, truth: list[int], vocab: int, seed: int, p_right: float) -> None:
        super().__init__(truth, vocab)
        self.rng = random.Random(seed)
        self.p_right = p_right

    def draft(self, true: list[int], step: int) -> list[int]:
        return [
            t if self.rng.random() < self.p_right else self.rng.randrange(self.vocab) for t in true
        ]


def partly_wrong_at(step: int) -> set[int]:
    return {0} if step % 3 == 0 else {2}


def scripted_drafter(kind: str, case: Case) -> ScriptedDrafter:
    if kind == "oracle":
        return OracleDrafter(case.truth, case.vocab)
    if kind == "wrong":
        return WrongDrafter(case.truth, case.vocab)
    if kind == "partly":
        return PartlyRightDrafter(case.truth, case.vocab, partly_wrong_at)
    if kind == "random":
        return RandomDrafter(case.truth, case.vocab, seed=7, p_right=0.0)
    if kind == "coin":
        return RandomDrafter(case.truth, case.vocab, seed=8, p_right=0.6)
    raise ValueError(kind)


def check_scripted(case: Case, kind: str, k: int) -> None:
    """Speculative greedy == plain greedy, and the stats match what the drafter construction implies."""
    drafter = scripted_drafter(kind, case)
    run = case.spec(drafter, k)
    n = len(case.truth)
    assert run.ids == case.truth
    assert run.finish_reason == "length"
    stats, log = run.stats, drafter.log
    # Every target pass emits accepted + 1 tokens; the prefill emitted the first one.
    assert stats.accepted + stats.target_passes == n - 1
    assert stats.drafted == sum(kk for kk, _ in log)
    assert stats.accepted == sum(a for _, a in log)
    # The engine offers min(k, tokens still allowed - 1): k every step but where the budget cuts it.
    out = 1
    for kk, a in log:
        assert kk == min(k, n - out - 1)
        out += a + 1
    per_pos_drafted = [sum(kk > i for kk, _ in log) for i in range(k)]
    per_pos_accepted = [sum(a > i for _, a in log) for i in range(k)]
    assert stats.drafted_per_position == per_pos_drafted[: len(stats.drafted_per_position)]
    assert stats.accepted_per_position == per_pos_accepted[: len(stats.accepted_per_position)]
    if kind == "oracle":
        assert stats.accepted == stats.drafted
        assert stats.target_passes == math.ceil((n - 1) / (k + 1))
        assert stats.tau == pytest.approx((n - 1) / math.ceil((n - 1) / (k + 1)))
        if (n - 1) % (k + 1) == 0:
            assert stats.tau == k + 1
    elif kind == "wrong":
        assert stats.accepted == 0 and stats.drafted > 0
        assert stats.tau == 1.0 and stats.target_passes == n - 1
    elif kind == "partly":
        for step, (kk, a) in enumerate(log):
            first_wrong = min(partly_wrong_at(step))
            assert a == min(first_wrong, kk)
        assert 0 < stats.accepted < stats.drafted
    elif kind == "random":
        assert stats.drafted > 0


def perturbed_copy(folder: Path, seed: int, scale: float, max_context: int = 256) -> LoadedModel:
    """The model in ``folder`` with every weight nudged by ``scale`` times its own spread (a single
    value, such as Gemma 4's layer scalars, has none: it is kept)."""
    copy = load_model(str(folder), dtype="float32", max_context=max_context)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in copy.model.parameters():
            if param.numel() > 1:
                param.add_(torch.randn(param.shape, generator=gen) * param.std() * scale)
    return copy


# ------------------------------------------------------------------------------- fixed and tree drafters


class ConstDrafter(Drafter):
    """Always proposes the same tokens: a deterministic draft (q one-hot), like n-gram lookup's."""

    name = "const"

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def prefill(self, prompt_ids: torch.Tensor, params: SamplingParams, cached: int = 0) -> None:
        pass

    def propose(self, k: int) -> Draft:
        return Draft(tokens=torch.tensor(self.tokens[:k], dtype=torch.long))

    def commit(self, tokens: torch.Tensor, num_accepted: int) -> None:
        pass

    def reset(self) -> None:
        pass




def build_tree(
    true: list[int],
    vocab: int,
    width: int,
    right_levels: int,
    slot: Callable[[int], int],
    decoys: bool,
    k: int,
    trap: bool = False,
) -> tuple[list[int], list[int]]:
    """A spine of ``width``-way sibling groups along the true continuation: at depth d the sibling
    ``slot(d)`` carries the true token (or a wrong one from depth ``right_levels`` on), the others
    wrong ones; with ``decoys`` the next wrong sibling gets a child carrying the NEXT true token (a
    right token on a wrong branch, which must never be accepted); with ``trap`` the first wrong
    sibling carries the NEXT true token (a row that wrongly counted its siblings as history would
    penalise the token it should pick). The first k nodes are kept."""
    tokens: list[int] = []
    parents: list[int] = []
    spine = -1
    for d, t in enumerate(true):
        s = slot(d) % width
        group = []
        for j in range(width):
            if j == s:
                tok = t if d < right_levels else (t + width + 1) % vocab
            elif trap and j == min({0, 1} - {s}) and d + 1 < len(true):
                tok = true[d + 1]
            else:
                tok = (t + j + 1) % vocab
            tokens.append(tok)
            parents.append(spine)
            group.append(len(tokens) - 1)
        if decoys and width > 1 and d + 1 < len(true):
            tokens.append(true[d + 1])
            parents.append(group[(s + 1) % width])
        spine = group[s]
        if len(tokens) >= k:
            break
    return tokens[:k], parents[:k]


SHAPES: dict[str, Callable[[list[int], int, int, int], tuple[list[int], list[int]]]] = {
    # (true tokens, vocab, k, step) -> (tokens, parents)
    "chain": lambda true, v, k, step: build_tree(true, v, 1, k, lambda d: 0, False, k),
    "chain_partly": lambda true, v, k, step: build_tree(true, v, 1, step % 4, lambda d: 0, False, k),
    "right_last": lambda true, v, k, step: build_tree(true, v, 3, k, lambda d: 2, True, k),
    "right_varied": lambda true, v, k, step: build_tree(true, v, 2, k, lambda d: d + step, True, k),
    "wide": lambda true, v, k, step: build_tree(true, v, 5, k, lambda d: 4 - step, False, k),
    "wrong": lambda true, v, k, step: build_tree(true, v, 3, 0, lambda d: d, True, k),
    "partly": lambda true, v, k, step: build_tree(true, v, 2, step % 3, lambda d: d + 1, True, k),
    "trap": lambda true, v, k, step: build_tree(true, v, 2, k, lambda d: 1, False, k, trap=True),
}


class TreeOracle(Drafter):
    """Proposes trees built from the plain greedy output by ``shape``, and checks on every commit
    that the engine emitted the truth and accepted exactly the longest right path of the tree.
    ``log`` keeps (nodes, depth, accepted) per drafting step."""

    name = "tree-oracle"

    def __init__(self, truth: list[int], vocab: int, shape: str, first_child_only: bool = False) -> None:
        self.truth, self.vocab, self.shape = truth, vocab, SHAPES[shape]
        self.first_child_only = first_child_only  # the engine verifies only the first-child chain
        self.context: list[int] = []
        self.prompt_len = 0
        self.step = 0
        self.proposed: DraftTree | None = None
        self.log: list[tuple[int, int, int]] = []

    def prefill(self, prompt_ids: torch.Tensor, params: SamplingParams, cached: int = 0) -> None:
        self.context = [int(t) for t in prompt_ids.tolist()]
        self.prompt_len = len(self.context)
        self.step, self.proposed, self.log = 0, None, []

    def propose(self, k: int) -> Draft | DraftTree:
        assert self.proposed is None, "propose called twice without a commit"
        pos = len(self.context) - self.prompt_len
        true = self.truth[pos : pos + k]
        assert len(true) == k, f"asked for {k} drafts at output {pos}, past max_tokens"
        tokens, parents = self.shape(true, self.vocab, k, self.step)
        self.step += 1
        self.proposed = tree(tokens, parents)
        return self.proposed

    def right_path(self, t: DraftTree, pos: int) -> list[int]:
        path, node = [], -1
        while True:
            want = self.truth[pos + len(path)] if pos + len(path) < len(self.truth) else -1
            children = t.children(node)[:1] if self.first_child_only else t.children(node)
            nxt = next((c for c in children if int(t.tokens[c]) == want), None)
            if nxt is None:
                return path
            path.append(nxt)
            node = nxt

    def commit(self, tokens: torch.Tensor, num_accepted: int) -> None:
        emitted = [int(x) for x in tokens.tolist()]
        pos = len(self.context) - self.prompt_len
        assert emitted == self.truth[pos : pos + len(emitted)], f"output differs at {pos}"
        if self.proposed is None:
            assert num_accepted == 0
        else:
            right = self.right_path(self.proposed, pos)
            assert num_accepted == len(right), f"accepted {num_accepted}, right path {right}"
            self.log.append((self.proposed.k, self.proposed.depth, num_accepted))
            self.proposed = None
        self.context.extend(emitted)

    def reset(self) -> None:
        self.context, self.proposed = [], None


class RandomTree(Drafter):
    """A sampling tree drafter: root children i.i.d. from a fixed q, one grandchild each; its own
    generator is seeded from the request's seed (like the draft-model drafter)."""

    name = "random-tree"

    def __init__(self, vocab: int) -> None:
        self.q = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 3, -1)
        self.gen = torch.Generator()

    def prefill(self, prompt_ids: torch.Tensor, params: SamplingParams, cached: int = 0) -> None:
        self.gen.manual_seed(0 if params.seed is None else params.seed + 1)

    def propose(self, k: int) -> DraftTree:
        width = (k + 1) // 2
        tokens = torch.multinomial(self.q, k, replacement=True, generator=self.gen)
        parents = [-1] * width + list(range(k - width))  # root children, then one child each
        return DraftTree(tokens, ids(*parents), self.q.expand(k, -1))

    def commit(self, tokens: torch.Tensor, num_accepted: int) -> None:
        pass

    def reset(self) -> None:
        pass


# ------------------------------------------------------------------------------- requests together


TEXTS = [
    "for i in range(10):\n    print(i, i * i)\nfor i in range(10):\n    print(i",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Hello",
    # longer than a pass: its prompt is read in chunks between the others' decode steps
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n" * 2,
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine.",
    "import os, sys, json\nfrom pathlib import Path\n",
    "0123456789 +-*/=<>()",
    "Speculative decoding drafts several tokens cheaply and verifies them in one pass.",
]



@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    drafter: str  # none | ngram | const | tree
    k: int = 4


def request_drafter(kind: str, model: LoadedModel) -> Drafter | None:
    vocab = model.config.vocab_size
    if kind == "auto":  # n-gram and a draft model (the target itself: right drafts) under the cost model
        cost = TargetCost({1: 0.010, 2: 0.011, 4: 0.012, 8: 0.015})
        return AutoDrafter([Candidate(SuffixDrafter(), Acceptance(0.6, 8), 0.0, cheap=True),
                            Candidate(DraftModelDrafter(model.model, vocab, eager=True), Acceptance(0.9, 8), 0.002,
                                      cheap=False)], cost)
    if kind == "ngram":
        return SuffixDrafter()
    if kind == "const":  # mostly wrong chains
        return ConstDrafter([5, 6, 7, 8, 9, 10])
    if kind == "tree":
        return RandomTree(vocab)
    return None


def requests(model: LoadedModel, n: int) -> list[Request]:
    kinds = ["none", "ngram", "const", "tree", "auto"]
    out = []
    for i in range(n):
        prompt = model.tokenizer.encode(TEXTS[i % len(TEXTS)])
        params: dict[str, Any] = {"max_tokens": 12 + 5 * (i % 4), "ignore_eos": True}
        if i % 3 == 1:  # seeded sampling: one answer per seed, alone or not
            params |= {"temperature": 0.9, "top_p": 0.95, "seed": 100 + i}
        if i % 5 == 4:
            params |= {"stop": ("e",), "ignore_eos": False}
        out.append(Request(prompt, SamplingParams(**params), kinds[i % len(kinds)], k=2 + i % 5))
    return out


def run_to_end(engine: Engine, got: dict[Generation, list[int]]) -> None:
    """Step ``engine`` until nothing runs, adding each generation's tokens to ``got``."""
    while engine.running:
        for gen, step in engine.step():
            assert not isinstance(step, Exception), step
            got[gen] += step.token_ids
            if step.finished:
                engine.remove(gen)


def alone(model: LoadedModel, req: Request) -> list[int]:
    engine = Engine(model.model, model.tokenizer)
    drafter = request_drafter(req.drafter, model)
    return [t for s in engine.generate(req.prompt, req.params, drafter, req.k) for t in s.token_ids]


def together(engine: Engine, model: LoadedModel, reqs: list[Request], cancel: dict[int, int] | None = None
             ) -> dict[int, list[int]]:
    """Run ``reqs`` through ``engine`` as a server would: admitted in order while lanes are free,
    stepped together; ``cancel`` {request: after how many tokens it is removed}."""
    cancel = cancel or {}
    out: dict[int, list[int]] = {i: [] for i in range(len(reqs))}
    waiting = list(range(len(reqs)))
    running: dict[Generation, int] = {}
    while waiting or running:
        while waiting and engine.has_room():
            i = waiting.pop(0)
            r = reqs[i]
            running[engine.add(r.prompt, r.params, request_drafter(r.drafter, model), r.k)] = i
        for gen, step in engine.step():
            assert not isinstance(step, Exception), step
            i = running[gen]
            out[i] += step.token_ids
            if step.finished or (i in cancel and len(out[i]) >= cancel[i]):
                engine.remove(gen)
                del running[gen]
    return out


def check_together_equals_alone(model: LoadedModel, n: int, max_sequences: int) -> Engine:
    """``n`` mixed requests (:func:`requests`) run together on an engine of ``max_sequences`` lanes:
    each answer equals the request's answer alone. Returns the engine."""
    reqs = requests(model, n)
    engine = Engine(model.model, model.tokenizer, max_sequences=max_sequences)
    got = together(engine, model, reqs)
    for i, r in enumerate(reqs):
        assert got[i] == alone(model, r), f"request {i} ({r.drafter}, {r.params}) differs from its answer alone"
    return engine



# ------------------------------------------------------------------------------- prefix-cache runs


@dataclass
class Out:
    ids: list[int]
    stats: RequestStats
    first: list[Any]  # the first token's logprobs (its raw distribution's top 3)


def run(engine: Engine, prompt: list[int], drafter: Any, k: int, params: SamplingParams, steps: int | None = None) -> Out:
    ids: list[int] = []
    first: list[Any] = []
    gen = engine.generate(prompt, params, drafter, k)
    for i, step in enumerate(gen):
        if i == 0:
            first = [(lp.token, lp.logprob, lp.top) for lp in step.logprobs or []]
        ids.extend(step.token_ids)
        if steps is not None and i + 1 >= steps:
            gen.close()  # the client left
            break
    return Out(ids, step.stats, first)


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    """Ids with some repetition (so n-gram lookup and the draft model have something to match)."""
    gen = np.random.default_rng(seed)
    base = gen.integers(3, vocab, size=max(1, n // 3)).tolist()
    return (base * 3 + gen.integers(3, vocab, size=n).tolist())[:n]


def same(warm: Out, ref: Out) -> None:
    assert warm.ids == ref.ids
    assert warm.first == ref.first  # bitwise: the same floats, not close ones


# ------------------------------------------------------------------------------- random GGML blocks

Q = GGMLQuantizationType
# Block formats (the q8 GEMM's), then the float matrices the f32 kernels read as they are.
BLOCK_FORMATS = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS,
                 Q.MXFP4]
FLOAT_FORMATS = [Q.F16, Q.BF16]
FORMATS = BLOCK_FORMATS + FLOAT_FORMATS
# Byte offsets of the fp16 fields (scales, mins) inside each block.
FP16_FIELDS = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0], Q.IQ4_NL: [0], Q.Q2_K: [80, 82],
    Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.IQ4_XS: [0], Q.MXFP4: [],
}
E8M0_FIELDS = {Q.MXFP4: [0]}  # byte offsets of power-of-two scales (2^(e - 128))


def random_raw(
    qtype: GGMLQuantizationType, n: int, k: int, seed: int = 0, scale: float = 0.02
) -> np.ndarray:
    """Random valid blocks: random bytes, with finite fp16 values in the scale fields (F16 / BF16:
    random finite values of that size)."""
    rng = np.random.default_rng(seed)
    if qtype in FLOAT_FORMATS:
        w = np.clip(rng.standard_normal((n, k)) * scale, -65000, 65000).astype(np.float32)
        if qtype == Q.F16:
            return w.astype(np.float16).view(np.uint8).reshape(n, 2 * k)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n, 2 * k)
    bs, ts = GGML_QUANT_SIZES[qtype]
    nb = n * (k // bs)
    raw = rng.integers(0, 256, size=(nb, ts), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        vals = np.clip(rng.standard_normal(nb) * scale, -65000, 65000).astype(np.float16)  # finite
        raw[:, off : off + 2] = vals.view(np.uint8).reshape(nb, 2)
    for off in E8M0_FIELDS.get(qtype, []):  # scales around ``scale`` / 4 (the values reach 12 / 2)
        raw[:, off] = np.clip(round(126 + np.log2(scale)) + rng.integers(-3, 1, size=nb), 1, 254).astype(np.uint8)
    return raw.reshape(n, k // bs * ts)


# ------------------------------------------------------------------------------- texts tokenizers are checked on

SAMPLES = [
    "",
    "Hello world",
    "def add(a, b):\n    return a  +  b\n\n\nclass X:\n\tdef f(self):\n\t\tpass\n",
    "if x:\n        y = [\n    10,\n    20,\n]\n\t \t\n",
    "日本語のテキスト、中文文本 and emoji 😀🎉👍🏽 café naïve résumé Ångström",
    "   leading spaces",
    "trailing spaces   ",
    "\n\n\n",
    "a\r\nb\rc\n\n \n",
    "x  1",
    "1234567890 3.14159 1e10 0xFF 12,345,678 ½ ² ٣",
    "It's we're they'll I'd CAN'T",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <tool_call>{}</tool_call> <|im_start|",
    "Ünïcödé – “quotes” — ellipsis… €100 ₿",
]

CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is the capital of France?"}],
    "system_multi": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    "no_system_multi": [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Silent pond\nfrog jumps"},
        {"role": "user", "content": "Another, with emoji 🐸"},
    ],
}


# ------------------------------------------------------------------------------- structured output schemas


class Place(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=16)
    country: str = pydantic.Field(max_length=16)


class Trip(pydantic.BaseModel):
    origin: Place
    stops: list[Place] = pydantic.Field(max_length=2)


# ------------------------------------------------------------------------------- command lines and scripts


def assert_words(message: str, *words: str) -> None:
    lower = message.lower()
    missing = [w for w in words if w.lower() not in lower]
    assert not missing, f"{missing} not in {message!r}"


def cli_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``quickdraft argv``: it must fail with exit 2 and one error, no traceback; returns stderr."""
    from quickdraft.cli.main import main

    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "error: " in err and "Traceback" not in err
    return err


def bench_script(name: str) -> Any:
    """Import benchmarks/<name>.py (not a package) as a module."""
    import importlib.util
    import sys

    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def model_pass(
    model: CausalLM, ids: torch.Tensor, cache: Any, positions: torch.Tensor | None = None,
    mask: torch.Tensor | None = None, rows: RowSlots | None = None, capture: Sequence[int] = (),
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One pass of ``model`` over ``ids`` into the next slots of ``cache``, a tree (``mask``) or rows
    of several sequences (``rows``): the engine's way (:meth:`CausalLM.run` of a reserved Step)."""
    return model.run(ids, Step.reserve(cache, ids.shape[0], positions, mask=mask, rows=rows), capture)


def mapping_of(addr: int) -> tuple[str, list[str]]:
    """The file ("" for anonymous memory) and VmFlags of this process's mapping that holds ``addr``
    (/proc/self/smaps)."""
    inside, path = False, ""
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and ":" not in head[0]:  # a mapping's first line: range perms offset dev inode [path]
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside, path = lo <= addr < hi, head[5] if len(head) > 5 else ""
            elif inside and line.startswith("VmFlags:"):
                return path, head[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def transformers_from_gguf(path: Path, folder: Path) -> Any:
    """transformers' own model of a GGUF file, loaded by ``from_pretrained(gguf_file=...)`` (its config
    table, tensor-name map, tensor processors and dequantization) from a copy of ``path`` in
    ``folder`` without the tokenizer's arrays: gguf-py's GGUFReader, which transformers reads the file
    with twice, spends ~10 s parsing a 150k-token vocabulary item by item each time. The copy holds
    the same tensor bytes and model keys, and ``ARCH.vocab_size``, which transformers reads from the
    token list otherwise."""
    import gguf
    from transformers import AutoModelForCausalLM

    from quickdraft.loading.gguf_file import GGUFFile

    source = GGUFFile(path)
    meta = source.metadata
    arch = meta["general.architecture"]
    copy = folder / path.name
    writer = gguf.GGUFWriter(copy, arch)
    for key, value in meta.items():
        if (key.startswith("tokenizer.ggml.") and isinstance(value, list)) or key in ("general.architecture",
                                                                                     "general.alignment"):
            continue  # (the writer writes these two itself)
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int) and 0 <= value < 2**32:
            writer.add_uint32(key, value)
        elif isinstance(value, int):
            writer.add_int64(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    writer.add_uint32(f"{arch}.vocab_size", len(meta["tokenizer.ggml.tokens"]))
    for t in source.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=copy.name, dtype=torch.float32)
    return model.eval()
