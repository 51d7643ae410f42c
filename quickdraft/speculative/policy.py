"""Speculate only when it pays: a cost model picks the drafter and k for every step.

On a CPU a (k+1)-row target pass can cost much more than a 1-row pass, and drafting is not free,
so a fixed k often makes speculative decoding SLOWER than plain decoding. Each step we instead
maximise the expected output rate

    rate(d, k) = E_d[tokens | k] / (c_target(k + 1) + c_draft_d * k),
    E_d[tokens | k] = 1 + sum_{i=1..k} prod_{j=1..i} a_d(j)

over drafters d and k = 0..max_k (k = 0 is plain decoding: 1 token per c_target(1)), where a_d(j)
is drafter d's observed acceptance rate at draft position j given that j-1 were accepted
(Leviathan et al. 2023, section 3.4, with per-position rates), and c_* are seconds measured on
this machine: calibrated once at start, then tracked online. A drafter not used for a while gets
a small probe step so its estimates recover when the text changes character.

A candidate may propose trees: k then counts its nodes (the target pass costs k + 1 rows), and its
acceptance is tracked per depth along the accepted path. Candidates that read target features
(``capture_layers`` / ``feed``, see :mod:`quickdraft.speculative.base`) get them through the AutoDrafter,
which asks the engine for the union of their layers.

Under load (several sequences in one pass, :class:`~quickdraft.speculative.base.PassLoad`) the rate is
the whole pass's: with the others' rows R_o, drafting seconds D_o and tokens E_o,

    rate(d, k) = (E_o + E_d[tokens | k]) / (c_target(R_o + k + 1) + D_o + c_draft_d * k),

so a draft pays only where its tokens per extra second beat what the pass already yields per
second: extra rows in a pass of many are cheap (n-gram drafts stay), a draft model's passes hold up
every sequence (they stop). c_target is then the curve of passes of many (``shared_cost``, shared by
the sequences' drafters): learned from the engine's whole passes by their total rows, since a row
added to four sequences' pass costs more than one added to a pass alone (measured, 1.5B on Sapphire
Rapids: 4 rows 72 ms, 5 rows 81, 8 rows 99, where one sequence's curve said 73.5 -> 90.5 from 4 to 8
rows). A sequence's own wait includes the others' rows, so its alone curve is not observed then,
and drafters with a model of their own are not probed.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from quickdraft.cache import SequenceCache
from quickdraft.models.causal_lm import CausalLM
from quickdraft.sampling import SamplingParams
from quickdraft.speculative.base import ALONE, Drafter, PassLoad, Steps, capture_layers_of
from quickdraft.speculative.tree import DraftTree, cut_tree
from quickdraft.speculative.verify import Draft

EMA = 0.2  # weight of a new observation
PROBE_EVERY = 8  # steps without using a drafter before a probe step ...
MAX_PROBE_EVERY = 64  # ... doubling after each probe until the drafter pays again, up to this
PROBE_K = 2
# A drafter that ends its proposals itself when unsure (a draft model's ``stop_below``) is offered
# at least this many tokens: the cost model's k is sized for drafts of average confidence, the
# drafter's own stop rule then keeps the confident stretches going. Replayed offline on 80 greedy
# HumanEval answers (Qwen2.5-Coder 1.5B + 0.5B, n-gram alongside): 6 (2.11x plain) >= 8 (2.10x)
# > 4 (2.07x) > the cost model's k alone (2.02x); with probes every 8 idle steps instead of 24,
# 2.14-2.20x.
CONFIDENT_K = 6
# A draft model's prompt read is weighed against the answer it speeds up: the request's max_tokens,
# but at most READ_PAYBACK_ANSWERS times the tokens answers have brought (an EMA from ANSWER_TOKENS).
ANSWER_TOKENS = 256.0
READ_PAYBACK_ANSWERS = 2
# ... and must pay back READ_MARGIN times over: the saving is an estimate from acceptance learned on
# other texts (a 720-token read judged to pay 1.3x over, then drafting a summary: 0.85x plain).
READ_MARGIN = 2.0
LOAD_MARGIN = 1.05  # under load, a draft's expected pass rate must beat plain decoding's by this


@dataclass
class TargetCost:
    """Seconds of one pass by row count at the current ``context`` length.

    ``seconds``: the passes measured over a short context (linear between measured row counts);
    ``per_key``: (a, b), the attention a pass adds per cached token, a + b * rows seconds (decode
    rows read every key and value of the context, so at 16k tokens attention is most of a pass).
    The owner sets ``context`` before asking; observed passes update the short-context part.
    """

    seconds: dict[int, float]
    per_key: tuple[float, float] = (0.0, 0.0)
    context: int = 0

    def attention(self, rows: int) -> float:
        a, b = self.per_key
        return self.context * (a + b * rows)

    def __call__(self, rows: int) -> float:
        return self._base(rows) + self.attention(rows)

    def _base(self, rows: int) -> float:
        pts = sorted(self.seconds.items())
        if rows <= pts[0][0]:
            return pts[0][1]
        for (r0, s0), (r1, s1) in zip(pts, pts[1:], strict=False):
            if rows <= r1:
                return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
        if len(pts) == 1:
            return pts[0][1]
        (r0, s0), (r1, s1) = pts[-2], pts[-1]
        return s1 + (s1 - s0) / (r1 - r0) * (rows - r1)

    def observe(self, rows: int, seconds: float, weight: float = 1.0) -> None:
        """A pass of ``rows`` rows took ``seconds`` (``weight``: its share of one observation)."""
        seconds = max(seconds - self.attention(rows), 0.1 * seconds)  # back to the short-context part
        old = self.seconds.get(rows)
        now = self.seconds[rows] = seconds if old is None else (1 - EMA * weight) * old + EMA * weight * seconds
        # Fewer rows never cost more: a start-up measurement inflated by a busy moment (a 1-row
        # pass kept at 1.5x its real time made auto draft where plain decoding was faster, and
        # plain steps, which would correct it, were then rare) is pulled down by what is observed.
        for r, s in self.seconds.items():
            if r < rows and s > now:
                self.seconds[r] = now
            elif r > rows and s < now:
                self.seconds[r] = now


@dataclass
class Acceptance:
    """Per-position conditional acceptance a(j), j = 1..max_k, as running averages."""

    prior: float
    max_k: int
    rates: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rates = [self.prior] * self.max_k

    def observe(self, k: int, n: int) -> None:
        for j in range(min(k, n + 1, self.max_k)):  # positions reached: 0..n (n+1 only if n < k)
            self.rates[j] = (1 - EMA) * self.rates[j] + EMA * float(j < n)

    def expected_tokens(self, k: int) -> float:
        total, run = 1.0, 1.0
        for j in range(k):
            run *= self.rates[j]
            total += run
        return total


@dataclass
class Candidate:
    drafter: Drafter
    acceptance: Acceptance
    seconds_per_token: float  # drafting cost per drafted token
    cheap: bool  # proposing is ~free (n-gram): look at its proposal before deciding
    idle: int = 0  # steps since last used
    extra_seconds: float = 0.0  # measured per-use drafting time beyond the model (picking, syncs, ...)
    pass_cost: TargetCost | None = None  # the drafter's own model's pass seconds by rows (catch-ups)
    probe_every: int = PROBE_EVERY  # idle steps before the next probe (backs off while it loses)


def pass_rate(cost: TargetCost, load: PassLoad, tokens: float, rows: int, seconds: float) -> float:
    """Expected tokens per second of a pass this sequence joins with ``rows`` rows expected to
    yield ``tokens``, after ``seconds`` of its own drafting (alone: its own rate)."""
    return (load.tokens + tokens) / (cost(load.rows + rows) + load.draft_seconds + seconds)


def best_k(
    cost: TargetCost, cand: Candidate, max_k: int, overhead: float = 0.0, load: PassLoad = ALONE
) -> tuple[int, float]:
    """The k in 0..max_k with the highest expected tokens/s, and that rate. ``overhead``: seconds
    the drafter must spend before its first token whatever k is (catching up on missed tokens).
    ``load``: what the other sequences bring to the pass (the rate is then the pass's)."""
    best = (0, pass_rate(cost, load, 1.0, 1, 0.0))
    for k in range(1, max_k + 1):
        rate = pass_rate(cost, load, cand.acceptance.expected_tokens(k), k + 1,
                         cand.seconds_per_token * k + overhead)
        if rate > best[1]:
            best = (k, rate)
    return best


class AutoDrafter(Drafter):
    """Wraps one or more drafters; each step picks the drafter and k that the cost model favours.

    With ``fixed_k`` the drafter is still chosen per step but always drafts min(fixed_k, budget).
    """

    name = "auto"

    def __init__(self, candidates: list[Candidate], cost: TargetCost, fixed_k: int | None = None,
                 shared_cost: TargetCost | None = None) -> None:
        """``cost``: the target's passes alone; ``shared_cost``: its passes of many sequences by
        their total rows (learned from the engine's passes; default: a copy of ``cost`` to start)."""
        self.candidates = candidates
        self.cost = cost
        self.shared_cost = shared_cost or TargetCost(dict(cost.seconds))
        self.fixed_k = fixed_k
        self.usage: dict[str, int] = {c.drafter.name: 0 for c in candidates} | {"none": 0}
        self.seconds: dict[str, float] = {c.drafter.name: 0.0 for c in candidates}  # drafting, by drafter
        self._chosen: Candidate | None = None
        self._k = 0
        self._depth = 0  # how deep the last proposal reaches (= k for a chain)
        self._t_ready = 0.0
        self._context = 0  # tokens in the target's cache: what a pass's attention reads
        self._load = ALONE  # what the other sequences bring to the next pass
        self.answer_tokens = ANSWER_TOKENS  # what answers bring, on average (updated per request)
        self._answer = 0  # tokens of the current request's answer so far (0: none started yet)
        self.stand_downs: list[str] = []  # this request's drafters the cost model stood down, and why
        # Feature layers: the union of the candidates', in layer order (see feed).
        self.capture_layers: tuple[int, ...] = tuple(
            sorted({i for c in candidates for i in capture_layers_of(c.drafter)})
        )

    def join(self, load: PassLoad) -> None:
        self._load = load
        if load.sequences and load.pass_rows:
            # Every sequence in the pass observes it (the forks share this curve): each with a
            # 1/n share of the weight, so a pass counts once.
            self.shared_cost.observe(load.pass_rows, load.pass_seconds, weight=1.0 / (load.sequences + 1))
        for c in self.candidates:
            c.drafter.join(load)

    def feed(self, hidden: Tensor) -> None:
        """Hand each feature-reading candidate its own layers' columns, in its own order.

        ``hidden`` [n, len(self.capture_layers) * H] holds the union of the layers, in layer order.
        """
        width = hidden.shape[-1] // len(self.capture_layers)
        for c in self.candidates:
            layers = capture_layers_of(c.drafter)
            if not layers:
                continue
            if layers == self.capture_layers:
                c.drafter.feed(hidden)
                continue
            blocks = [self.capture_layers.index(i) for i in layers]
            cols = [hidden[:, b * width : (b + 1) * width] for b in blocks]
            c.drafter.feed(torch.cat(cols, dim=-1))

    def use_target_cache(self, cache: SequenceCache) -> None:
        for c in self.candidates:
            c.drafter.use_target_cache(cache)

    def prefill(self, prompt_ids: Tensor, params: SamplingParams, cached: int = 0) -> None:
        before = [c.pass_cost(1) if c.pass_cost is not None else 0.0 for c in self.candidates]
        if self._answer:  # the last request's answer: what the next one may last
            self.answer_tokens = (1 - EMA) * self.answer_tokens + EMA * self._answer
        self._answer = 0
        self._context = len(prompt_ids)
        self._set_context()
        for c, old in zip(self.candidates, before, strict=True):
            if c.pass_cost is not None and old > 0:  # a new prompt's length: its one-token pass costs more or less
                c.seconds_per_token *= c.pass_cost(1) / old
        self.stand_downs = []
        for c in self.candidates:
            rows = c.drafter.prompt_read(prompt_ids)
            if rows and not self._read_pays(c, rows, params.max_tokens):
                c.drafter.defer_prompt()
                self.stand_downs.append(f"{c.drafter.name}: its prompt read would not pay back ({rows} tokens)")
            c.drafter.prefill(prompt_ids, params, cached=cached)

    def _read_pays(self, c: Candidate, rows: int, max_tokens: int) -> bool:
        """Whether reading ``rows`` prompt tokens into ``c``'s own model pays back over the answer:
        the seconds it saves per token (its best rate against plain decoding's, at this context)
        times the tokens the answer may bring (the requested maximum, at most READ_PAYBACK_ANSWERS
        times what answers have brought) must exceed READ_MARGIN times the read (its own pass
        costs, per row beyond 16 rows as between 8 and 16). Without the read it drafts after a
        capped catch-up, priced every step. Measured on a 2,878-token module + a question, 128 tokens (Sapphire Rapids, 2
        threads): the 0.5B's read of 720 tokens took 2.1 s, 0.86x plain decoding's speed."""
        curve = c.pass_cost or self.cost
        read = c.seconds_per_token * curve(rows) / curve(1)
        load = self._load
        cost = self.shared_cost if load.sequences else self.cost
        _, rate = best_k(cost, c, c.acceptance.max_k, c.extra_seconds, load)
        plain = pass_rate(cost, load, 1.0, 1, 0.0)
        # Seconds saved per token of the pass (all its sequences' tokens), over the tokens the pass
        # yields while this answer runs: alone, the answer's; under load, the read stalls every
        # sequence of the pass, and the draft's saving is shared by all of their tokens. (Comparing
        # the batch's seconds per token with one sequence's plain pass, as before, counted the
        # batching itself as the draft's saving: 4 users' passes read every draft model prompt.)
        saved = max(0.0, 1.0 / plain - 1.0 / rate) if rate > 0 else 0.0
        answer = min(max(max_tokens - 1, 0), READ_PAYBACK_ANSWERS * self.answer_tokens)
        return saved * answer * (1 + load.sequences) > READ_MARGIN * read

    def covered(self, prompt_ids: Tensor | np.ndarray) -> int:
        """The fewest leading prompt tokens any feature-reading candidate holds features for."""
        return min((c.drafter.covered(prompt_ids) for c in self.candidates), default=len(prompt_ids))

    def usage_counts(self) -> dict[str, int]:
        return dict(self.usage)

    def drafting_seconds(self) -> dict[str, float]:
        return dict(self.seconds)

    def stood_down(self) -> list[str]:
        return list(self.stand_downs)

    def parts(self) -> list[Drafter]:
        return [c.drafter for c in self.candidates]

    def snapshot(self) -> list[object | None]:
        """Each candidate's snapshot (None for one that keeps no state worth copying)."""
        return [c.drafter.snapshot() for c in self.candidates]

    def restore(self, state: object) -> None:
        assert isinstance(state, list)  # what snapshot returned
        for c, part in zip(self.candidates, state, strict=True):
            if part is not None:
                c.drafter.restore(part)

    def drafting(self, k: int) -> Steps[Draft | DraftTree]:
        chosen, draft = yield from self._choose(k)
        self._chosen, self._k = chosen, draft.k
        self._depth = draft.depth if isinstance(draft, DraftTree) else draft.k
        self.usage[chosen.drafter.name if chosen and draft.k else "none"] += 1
        self._t_ready = time.perf_counter()
        return draft

    def _set_context(self) -> None:
        """Tell the cost curves how long the contexts their passes attend over are now."""
        self.cost.context = self._context
        for c in self.candidates:
            if c.pass_cost is not None:  # a draft model may hold fewer tokens (a windowed prompt read)
                own = c.drafter.context_length()
                c.pass_cost.context = self._context if own is None else own

    def _choose(self, budget: int) -> Steps[tuple[Candidate | None, Draft | DraftTree]]:
        """This step's drafter and its draft (None and an empty draft: a plain step): each
        candidate's best k and pass rate, then the two overrides (a proposal already made that
        pays beats a draft model's; a due plain step probes the stalest drafter), then the chosen
        one drafts and what it really cost is learned. Kept whole, over 60 lines, most of them the
        measurements behind each rule: the rules read in the order they apply, and the overrides
        use the loop's bests."""
        self._set_context()
        load = self._load
        cost = self.shared_cost if load.sequences else self.cost  # (shared: what a row adds to a pass of many)
        # Under load a draft must beat the plain pass by LOAD_MARGIN: its rows slow every sequence
        # for sure, its tokens are an estimate (break-even drafts lost 5% of 4 users' throughput).
        plain = pass_rate(cost, load, 1.0, 1, 0.0) * (LOAD_MARGIN if load.sequences else 1.0)
        best: tuple[float, Candidate | None, int, Draft | DraftTree | None] = (plain, None, 0, None)
        free = best  # the best among proposals already made (cheap drafters)
        stale: list[tuple[int, Candidate, int, Draft | DraftTree | None]] = []
        for c in self.candidates:
            c.idle += 1
            t0 = time.perf_counter()
            preview = (yield from c.drafter.drafting(min(budget, c.acceptance.max_k))) if c.cheap else None
            self.seconds[c.drafter.name] += time.perf_counter() - t0
            limit = min(budget, c.acceptance.max_k, preview.k if preview is not None else budget)
            estimates = preview is not None and c.drafter.expected_tokens(1) is not None
            if self.fixed_k:
                k, rate = min(self.fixed_k, limit), float("inf")
            elif estimates and limit > 0:
                # The drafter estimates its own proposal (an EAGLE tree from its confidences, a
                # lookup from its match length) and already paid for drafting it: take the prefix
                # with the best estimate per target pass.
                k, rate = max(
                    ((j, pass_rate(cost, load, c.drafter.expected_tokens(j) or 0.0, j + 1, 0.0))
                     for j in range(1, limit + 1)),
                    key=lambda x: x[1],
                )
            else:
                k, rate = best_k(cost, c, limit, self._catch_up_seconds(c) + c.extra_seconds, load)
            if c.idle > c.probe_every and limit > 0 and not c.drafter.learns_unused and (c.cheap or not load.sequences):
                stale.append((c.idle, c, min(PROBE_K, limit), preview))
            if k > 0 and rate > best[0]:
                best = (rate, c, k, preview)
            if k > 0 and c.cheap and rate > free[0]:
                free = (rate, c, k, preview)
        if free[1] is not None:
            # A proposal already made (n-gram, EAGLE) that pays is taken over paying a draft model
            # for one: per-step rates favour the draft model's higher acceptance, but its tokens
            # cost time whether accepted or not. Measured on HumanEval (Qwen2.5-Coder 1.5B + 0.5B):
            # without this rule auto settled on the draft model alone, 1.35x plain, below n-gram's
            # 1.62x; with it n-gram drafts where it can and the draft model fills the gaps.
            best = free
        if best[1] is None and stale:
            # A plain step is due: probe the stalest drafter instead, so its estimates follow the
            # text (a drafter that looked too costly once is never measured again otherwise). Its
            # catch-up is paid now, but any later use would pay it too. A drafter that learns its
            # estimate from every step (longest-match lookup) is never probed: on MT-bench chat
            # with 4 users its probes added 2 rows to a third of the passes and ~no tokens.
            # Each probe of a drafter that keeps losing doubles the wait before the next one: on a
            # text neither drafter predicts (a summary of a long file), probes every 8 steps cost
            # 7-15% of plain speed (a failed 3-row verify plus the draft model's catch-up).
            _, c, k, preview = max(stale, key=lambda s: s[0])
            best = (float("inf"), c, k, preview)
            c.probe_every = min(MAX_PROBE_EVERY, 2 * c.probe_every)
        elif best[1] is not None:
            best[1].probe_every = PROBE_EVERY
        _, chosen, k, preview = best
        if chosen is None:
            return None, Draft(tokens=torch.empty(0, dtype=torch.long))
        chosen.idle = 0
        catch_up = self._catch_up_seconds(chosen)
        t0 = time.perf_counter()
        if preview is None and chosen.drafter.stop_below > 0:
            k = min(budget, max(k, CONFIDENT_K))
        draft = _cut(preview, k) if preview is not None else (yield from chosen.drafter.drafting(k))
        if preview is None:
            self.seconds[chosen.drafter.name] += time.perf_counter() - t0
        if preview is None and draft.k and not load.sequences:  # (under load its passes are shared)
            # What this use really cost beyond the model's k * seconds_per_token + catch-up:
            # learned, so a drafter whose real cost is higher stops looking like it pays.
            spent = time.perf_counter() - t0 - catch_up - chosen.seconds_per_token * draft.k
            chosen.extra_seconds = (1 - EMA) * chosen.extra_seconds + EMA * max(0.0, spent)
        steady = chosen.drafter.last_token_seconds
        if not chosen.cheap and steady is not None:
            # Per-token cost from the drafter's steady one-token passes: the catch-up pass over
            # tokens it missed while idle is paid once, not per drafted token, and counting it
            # here would make an idle drafter look ever more expensive and never get used again.
            chosen.seconds_per_token = (1 - EMA) * chosen.seconds_per_token + EMA * steady
        return chosen, draft

    def _catch_up_seconds(self, c: Candidate) -> float:
        """What a drafter with its own model pays first for the tokens it missed while idle.

        Its first pass reads them all (as a multi-row pass: cheaper per row, scaled like its own
        model's measured pass costs, else like the target's); one row of it is the usual one-token
        step already in ``seconds_per_token``. Without this, switching between n-gram steps and a
        draft model looks free, and the mix ends up slower than n-gram lookup alone. (The
        target's curve overstates a small model's: 16 rows cost Qwen2.5-Coder-1.5B ~3.8-4.2
        one-row passes here, the 0.5B with its cut head ~3.1.)
        """
        pending = min(c.drafter.pending_count(), c.drafter.max_catch_up)
        if c.cheap or pending <= 1:
            return 0.0
        curve = c.pass_cost or self.cost
        return c.seconds_per_token * (curve(pending) / curve(1) - 1.0)

    def commit(self, tokens: Tensor, num_accepted: int) -> None:
        if self._t_ready and not self._load.sequences:  # a verify pass of its own ran since propose
            self.cost.observe(self._k + 1, time.perf_counter() - self._t_ready)
        self._t_ready = 0.0
        if self._chosen is not None and self._k:
            self._chosen.acceptance.observe(self._depth, num_accepted)
        for c in self.candidates:
            c.drafter.commit(tokens, num_accepted if c is self._chosen else 0)
        self._chosen, self._k, self._depth = None, 0, 0
        self._context += int(tokens.numel())
        self._answer += int(tokens.numel())

    def reset(self) -> None:
        for c in self.candidates:
            c.drafter.reset()

    def forks(self, count: int) -> list[Drafter]:
        """Forks of the candidates under the same cost model; acceptance statistics are shared."""
        twins = [c.drafter.forks(count) for c in self.candidates]
        return [AutoDrafter([dataclasses.replace(c, drafter=t[i]) for c, t in zip(self.candidates, twins, strict=True)],
                            self.cost, self.fixed_k, self.shared_cost) for i in range(count)]


def _cut(draft: Draft | DraftTree, k: int) -> Draft | DraftTree:
    """The first k tokens of a chain, or the first k nodes of a tree (still a tree)."""
    if isinstance(draft, DraftTree):
        return cut_tree(draft, k)
    return Draft(tokens=draft.tokens[:k], probs=None if draft.probs is None else draft.probs[:k])


ATTENTION_CONTEXT = 2048  # the context length attention is measured at (per key: linear beyond)


def measure_attention_per_key(model: CausalLM, repeats: int = 2) -> tuple[float, float]:
    """(a, b): the seconds a pass of r rows spends per cached token, a + b * r, from 1- and 8-row
    passes at ATTENTION_CONTEXT tokens against the same passes at 64 (the cache's contents do not
    change the time, so no long prefill is needed)."""
    long = min(ATTENTION_CONTEXT, model.max_len - 8)
    short = min(64, long // 4)
    if long - short < 256:
        return 0.0, 0.0  # a model this short never has a long context
    cache = model.make_cache(long + 8)
    ids = torch.randint(0, model.config.vocab_size, (8,), device=model.device)
    per_key = {}
    for r in (1, 8):
        best = {}
        for length in (short, long):
            t_best = float("inf")
            for _ in range(repeats + 1):
                cache.truncate(0)
                cache.length = length  # as if `length` tokens were cached
                t0 = time.perf_counter()
                model(ids[:r], cache, num_logits=1)
                t_best = min(t_best, time.perf_counter() - t0)
            best[length] = t_best
        per_key[r] = max(0.0, best[long] - best[short]) / (long - short)
    b = max(0.0, (per_key[8] - per_key[1]) / 7)
    return max(0.0, per_key[1] - b), b


def measure_pass_seconds(model: CausalLM, rows: tuple[int, ...] = (1, 2, 4, 8), repeats: int = 2) -> dict[int, float]:
    """Time target passes of each row count on a scratch cache (a few seconds at most)."""
    n = max(1, min(64, model.max_len - max(rows)))  # a short context that fits any max_len
    cache = model.make_cache(n + max(rows))
    context = torch.randint(0, model.config.vocab_size, (max(n, max(rows)),), device=model.device)
    model(context[:n], cache, num_logits=1)
    out = {r: float("inf") for r in rows}
    for _ in range(repeats + 2):  # the first round warms kernels up; rounds interleave the row
        for r in rows:            # counts, so a busy moment does not inflate one of them alone
            t0 = time.perf_counter()
            model(context[:r], cache)
            out[r] = min(out[r], time.perf_counter() - t0)
            cache.truncate(n)
    return out
