"""The generation loop: one loop for the CLI, the server and the benchmark, over one or many sequences.

Each :meth:`Engine.step` is ONE target pass over the rows of every running generation: a chunk of a
new arrival's prompt, or a running one's last token and draft. One sequence alone runs on its own
KV lane exactly as below; several share a pass through the pool's staging slots, each row
attending to its own sequence's keys in the same order (:class:`~quickdraft.cache.KVPool`,
:class:`~quickdraft.models.forward_pass.RowSlots`), so every answer is bitwise what it is alone.

Per request: prefill the target (and the drafter); then repeat
draft -> ONE target pass over [last token, drafted tokens] -> verify -> roll back the cache to the
accepted run -> stop checks -> yield a :class:`StepOutput`. Plain decoding is the same loop with
no drafter (k = 0). Nothing in here is specific to a model or a drafting method.

A drafter may propose a tree (:class:`~quickdraft.speculative.tree.DraftTree`) instead of a chain: the
pass then runs over [last token] + the tree's nodes with tree positions and a tree mask, the
verdict is a root-to-node path, and ``cache.compact`` moves that path's KV behind the prefix.
Drafters that read target features (``capture_layers``, see :mod:`quickdraft.speculative.base`) get the
captured hidden states of every row whose KV was kept, through ``feed``, before each commit.

Drafters propose together before each pass (:func:`~quickdraft.speculative.batch.propose_together`):
the passes their own models ask for run as one pass per round where the drafters share a KV pool.

Prefill first asks the prefix cache (:mod:`quickdraft.prefix_cache`) for the longest already
computed prefix of the prompt, then runs the rest in chunks of at most ``model.prefill_rows()`` rows: the
same batch-invariant passes decoding uses, so a token's keys and values are bitwise the same
whichever way its sequence was cut into passes, and a warm request equals a cold one.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from quickdraft.cache import KVPool, SequenceCache
from quickdraft.constraints import Constraint, apply_mask
from quickdraft.errors import QuickdraftError
from quickdraft.models.batch_invariance import BLOCKED_MAX_ROWS
from quickdraft.models.causal_lm import CausalLM
from quickdraft.models.forward_pass import RowSlots, Step
from quickdraft.models.graphs import make_step_graphs
from quickdraft.prefix_cache import PrefixCache, as_ids, common_prefix
from quickdraft.sampling import (
    SamplingParams,
    greedy_tokens,
    probs_from_logits,
    process_logits,
    sample_at,
)
from quickdraft.speculative.base import ALONE, Drafter, PassLoad, capture_layers_of
from quickdraft.speculative.batch import propose_together
from quickdraft.speculative.tree import (
    DraftTree,
    tree_chain,
    tree_mask,
    tree_positions,
    verify_tree_greedy,
)
from quickdraft.speculative.verify import Draft, Verdict, verify_greedy
from quickdraft.stopping import StopChecker
from quickdraft.tokenizer import Tokenizer

_NO_DRAFT = Draft(tokens=torch.empty(0, dtype=torch.long))


@dataclass
class RequestStats:
    """What one request did and how fast. tau = tokens emitted per target verify pass."""

    drafter: str = "none"
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (not recomputed)
    output_tokens: int = 0
    target_passes: int = 0  # verify/decode passes after the prefill
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    t_start: float = 0.0
    t_first: float = 0.0  # when the first token was ready
    t_end: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def tau(self) -> float:
        return (self.accepted + self.target_passes) / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def ttft(self) -> float:
        return self.t_first - self.t_start

    @property
    def tokens_per_second(self) -> float:
        """Output speed as leaderboards define it: tokens after the first / time after the first."""
        dt = self.t_end - self.t_first
        return (self.output_tokens - 1) / dt if self.output_tokens > 1 and dt > 0 else 0.0

    def record(self, verdict: Verdict, k: int, depth: int | None = None) -> None:
        """One verify pass over ``k`` drafted tokens (tree nodes) reaching ``depth`` (default k).

        Per-position counts are indexed by depth: position i counts the passes that drafted at
        depth i + 1 (for a tree, at least one node there) and those that accepted a token there.
        """
        depth = k if depth is None else depth
        self.target_passes += 1
        self.drafted += k
        self.accepted += verdict.num_accepted
        while len(self.drafted_per_position) < depth:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(depth):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < verdict.num_accepted)

    def to_dict(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d.update(tau=self.tau, acceptance_rate=self.acceptance_rate, ttft=self.ttft,
                 tokens_per_second=self.tokens_per_second)
        return d


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float  # log p(token) under the target's raw distribution at its position
    top: list[tuple[int, float]]  # the n most likely tokens there (SamplingParams.logprobs = n)


@dataclass
class StepOutput:
    token_ids: list[int]  # tokens emitted by this step (after stop truncation)
    text: str  # text safe to show, new since the last step
    finish_reason: str | None  # "stop" | "length" | None while running
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry when asked for
    # Provenance: the first ``accepted`` of token_ids are drafts the target accepted (the rest, the
    # target's own), and their text is characters [start, end) of the whole output text.
    accepted: int = 0
    accepted_text: tuple[int, int] = (0, 0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Request:
    prompt: torch.Tensor  # [P] long
    prompt_ids: np.ndarray  # [P] int64, the same ids on the host (prefix matching)
    params: SamplingParams  # a sampled request's params always carry a seed (drawn when not given)
    stop: StopChecker
    stats: RequestStats
    constraint: Constraint | None = None
    output: list[int] = field(default_factory=list)
    capture: tuple[int, ...] = ()  # layers the drafter wants features of, in its order

    def output_tensor(self) -> torch.Tensor:
        return torch.tensor(self.output, dtype=torch.long)


def runtime_warning(msg: str) -> None:
    """Say ``msg`` as a RuntimeWarning (the default way the engine reports a setting it cannot honour)."""
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


# Rows in one pass over several sequences: the batch-invariant path's limit, so every row's result
# is bitwise what it is when its sequence runs alone.
PASS_ROWS = BLOCKED_MAX_ROWS
# While a sequence still reads its prompt, each decoding one drafts at most this many tokens per
# pass, leaving the rest of the pass to the prompt (time to first token of the new arrival).
DRAFT_WHILE_PREFILLING = 2
# A request whose prompt shares at least this many more leading tokens with a prompt another lane is
# still computing waits for them and copies them (requests that arrive together: n > 1 choices, parallel
# calls with one system prompt) instead of computing them too.
FOLLOW_MIN = 32
MAX_SEQUENCES = PASS_ROWS // 2  # every running sequence gets a last token and a draft token per pass


@dataclass(eq=False)
class Generation:
    """One request the engine is generating: the request's state, the KV lane it holds (a region of
    the engine's KV memory) and its drafter (its own instance: drafters keep per-sequence state)."""

    req: _Request
    drafter: Drafter | None
    num_draft: int  # k offered to the drafter per step (0: plain decoding)
    lane: int
    cache: SequenceCache
    cached: int = 0  # prompt tokens reused from the prefix cache
    computed: int = 0  # prompt tokens whose keys and values are in the cache
    features: list[torch.Tensor] = field(default_factory=list)  # prompt rows' features, until the drafter reads them
    last: StepOutput | None = None
    # What it brought to the last step's pass (the load the others' drafters weigh, PassLoad):
    rows: int = 0
    draft_seconds: float = 0.0
    emitted: int = 0
    # A generation that waits for another lane to compute the first ``waits_for`` tokens of its
    # prompt before it takes what is computed (Engine.add); None once it has.
    follows: Generation | None = None
    waits_for: int = 0
    # The first token, out before its drafter read the prompt: the next step starts the drafter
    # (Engine._start_drafter) so a drafter's prompt read is not in the time to first token.
    drafter_due: torch.Tensor | None = None

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.req.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished


@dataclass(eq=False)
class _Part:
    """One generation's rows in a pass: a prompt chunk (``draft`` None) or [last token] + a draft."""

    gen: Generation
    ids: torch.Tensor  # [t]
    positions: torch.Tensor  # [t]
    start: int  # the generation's cache length before the pass
    draft: Draft | DraftTree | None = None
    logit_from: int = 0  # logits are computed for rows logit_from .. t-1
    draft_seconds: float = 0.0
    staged: bool = False  # ran in the pool's staging slots (a pass over several generations)
    offset: int = 0  # its first staging row

    @property
    def rows(self) -> int:
        return int(self.ids.shape[0])


StepResult = tuple[Generation, StepOutput | Exception]


class Engine:
    """Generates for up to ``max_sequences`` sequences at once with a target model and drafters.

    Each engine step is ONE target pass over the rows of every running generation (its prompt's next
    chunk, or its last token and draft): :meth:`add` joins a request between steps, :meth:`step`
    runs a pass and returns what each generation emitted, :meth:`remove` frees a finished or
    cancelled one. :meth:`generate` is the same loop for one request on an idle engine.
    """

    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        max_len: int | None = None,
        cuda_graphs: str = "auto",
        warn: Callable[[str], None] = runtime_warning,
        prefix_cache: PrefixCache | None = None,
        max_sequences: int = 1,
    ) -> None:
        """``max_len``: KV cache length of each sequence (default: the model's context; shorter for
        scratch runs). ``cuda_graphs``: replay decode/verify passes as CUDA graphs ('auto': where the
        model is on a CUDA device and supports them and one sequence runs at a time; 'on': the same,
        saying through ``warn`` where it cannot; 'off'). ``prefix_cache``: reuse computed prefixes
        across requests (default: off). ``max_sequences``: sequences generated at once (each holds a
        KV region of ``max_len`` slots while it runs)."""
        if not 1 <= max_sequences <= MAX_SEQUENCES:
            raise QuickdraftError(f"--max-concurrency must be between 1 and {MAX_SEQUENCES}, got {max_sequences}")
        self.model = model
        self.tokenizer = tokenizer
        self.prefix_cache = prefix_cache or PrefixCache()
        self.device = model.device
        self.pool: KVPool | None = None
        if max_sequences == 1:
            self.lanes = [model.new_cache() if max_len is None else model.make_cache(max_len)]
        else:
            length = model.max_len if max_len is None else max_len
            buffer = model.make_cache(max_sequences * length + PASS_ROWS)
            if not buffer.copyable:
                raise QuickdraftError("--max-concurrency above 1 is not supported with --tensor-parallel yet; use 1")
            self.pool = KVPool(buffer, max_sequences, length, PASS_ROWS)
            self.lanes = self.pool.lanes
        if max_sequences > 1 and cuda_graphs == "on":
            warn("CUDA graphs replay one sequence's passes; with --max-concurrency above 1 they are off")
        self.graphs = make_step_graphs(model, self.lanes[0], cuda_graphs if max_sequences == 1 else "off", warn=warn)
        self.running: list[Generation] = []
        self._free = list(range(max_sequences))
        self.last_pass_rows = 0  # rows of the last step's pass ...
        self.last_pass_seconds = 0.0  # ... and its seconds

    @property
    def cache(self) -> SequenceCache:
        """The first lane's KV cache (the only one of a one-sequence engine)."""
        return self.lanes[0]

    @property
    def max_sequences(self) -> int:
        return len(self.lanes)

    @property
    def kv_bytes(self) -> int:
        """Bytes of KV memory the engine holds for all its lanes."""
        return self.pool.nbytes if self.pool is not None else self.cache.max_len * self.cache.bytes_per_token

    def has_room(self) -> bool:
        """Whether :meth:`add` can start another sequence now."""
        return bool(self._free)

    def warm_up(self) -> None:
        """One token through the model on a scratch cache, so that one-time work (quantized weights
        repacked for the kernels: ~2.5 s for a 1.5B model; the native stack built) happens at
        load time instead of in the first request's time to first token."""
        self.model(torch.zeros(1, dtype=torch.long, device=self.device), self.model.make_cache(1))

    # ------------------------------------------------------------------ the loop

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        drafter: Drafter | None = None,
        num_draft: int = 0,
        constraint: Constraint | None = None,
    ) -> Iterator[StepOutput]:
        """Stream the continuation of ``prompt_ids`` on an idle engine; each step yields >= 1 new
        token (a long prompt's chunks before the first yield nothing).

        ``constraint`` (structured output) masks the target's logits at every position, in plain
        and speculative steps alike.
        """
        if self.running:
            raise RuntimeError("generate() runs one request on an idle engine; use add() and step() for several")
        gen = self.add(prompt_ids, params, drafter, num_draft, constraint)
        try:
            while not gen.finished:
                for _, out in self.step():
                    if isinstance(out, Exception):
                        raise out
                    yield out
        finally:  # finished, stopped or cancelled: what the cache holds is committed
            self.remove(gen)

    def add(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        drafter: Drafter | None = None,
        num_draft: int = 0,
        constraint: Constraint | None = None,
    ) -> Generation:
        """Start a request between steps: it takes a free lane (the one already holding the longest
        prefix of its prompt) and the longest match of the prefix cache or of a running sequence;
        its prompt is read by the next steps. When a sequence still reading its prompt shares at
        least FOLLOW_MIN more leading tokens, it waits for them instead and then copies them.
        Raises QuickdraftError for a request that cannot run (and when no lane is free)."""
        if not self._free:
            raise QuickdraftError(f"all {self.max_sequences} sequences are running; wait for one to finish")
        req = self._start(prompt_ids, params, drafter)
        req.constraint = constraint
        req.capture = self._capture_layers(drafter)
        lane = max(self._free, key=lambda i: (self.prefix_cache.held_prefix(req.prompt_ids, self.lanes[i]), -i))
        gen = Generation(req, drafter, num_draft if drafter is not None else 0, lane, self.lanes[lane])
        if drafter is not None:
            drafter.use_target_cache(gen.cache)
        gen.follows, gen.waits_for = self._prefix_in_progress(gen)
        if gen.follows is None:
            self._reuse(gen)
        self._free.remove(lane)
        self.running.append(gen)
        return gen

    def _prefix_in_progress(self, gen: Generation) -> tuple[Generation | None, int]:
        """The running sequence still reading a prompt that shares at least FOLLOW_MIN more leading
        tokens with ``gen``'s than are computed anywhere now, and how many it shares (None, 0: none)."""
        prompt = gen.req.prompt_ids
        if not self.prefix_cache.enabled or not gen.cache.copyable:
            return None, 0
        now = self.prefix_cache.stored_prefix(prompt, gen.cache)
        best: tuple[Generation | None, int] = (None, 0)
        for g in self.running:
            if g.prefilling:
                shared = common_prefix(g.req.prompt_ids, prompt, len(prompt) - 1)
                if shared - max(now, min(shared, g.computed)) >= FOLLOW_MIN and shared > best[1]:
                    best = (g, shared)
        return best

    def _reuse(self, gen: Generation) -> None:
        """Put the longest computed prefix of ``gen``'s prompt into its lane (from the prefix cache
        or a running sequence's lane); the next steps read the rest."""
        running = [(np.concatenate([g.req.prompt_ids, np.asarray(g.req.output, dtype=np.int64)]), g.cache)
                   for g in self.running if g is not gen]
        cached = self.prefix_cache.reuse(gen.req.prompt_ids, gen.cache, gen.drafter, running)
        gen.cached = gen.computed = gen.req.stats.cached_tokens = cached

    def _waiting(self, gen: Generation) -> bool:
        """Whether ``gen`` still waits for the sequence it follows to compute their shared prefix."""
        leader = gen.follows
        return leader is not None and leader in self.running and leader.prefilling and leader.computed < gen.waits_for

    def remove(self, gen: Generation) -> None:
        """A generation leaves (finished, stopped or cancelled): its lane is free again and what its
        cache holds is remembered by the prefix cache."""
        if gen not in self.running:
            return
        self.running.remove(gen)
        self._free.append(gen.lane)
        if gen.follows is not None:  # it never started: its lane holds what it held before
            return
        held = np.concatenate([gen.req.prompt_ids, np.asarray(gen.req.output, dtype=np.int64)])
        drafter = gen.drafter
        if drafter is not None and gen.drafter_due is not None:  # it never read the prompt
            drafter.reset()
            drafter = None
        self.prefix_cache.release(held, gen.cache, drafter)

    def step(self) -> list[StepResult]:
        """One target pass over every running, unfinished generation: what each emitted (a prompt
        chunk before the last emits nothing), or the error that ended it (the others go on)."""
        parts: list[_Part] = []
        results: list[StepResult] = []
        for part_or_error in self._plan():
            if isinstance(part_or_error, _Part):
                parts.append(part_or_error)
            else:
                results.append(part_or_error)
        if not parts:
            return results
        self.last_pass_rows = sum(p.rows for p in parts)
        t0 = time.perf_counter()
        outputs = self._forward(parts)
        seconds = self.last_pass_seconds = time.perf_counter() - t0
        for part, (logits, features) in zip(parts, outputs, strict=True):
            part.gen.rows, part.gen.draft_seconds, part.gen.emitted = part.rows, part.draft_seconds, 0
            try:
                out = self._finish(part, logits, features, seconds)
            except Exception as exc:  # this generation's constraint or drafter failed
                results.append((part.gen, exc))
                continue
            if out is not None:
                part.gen.emitted = len(out.token_ids)
                part.gen.last = out
                results.append((part.gen, out))
        return results

    # ------------------------------------------------------------------ planning a pass

    def _plan(self) -> list[_Part | StepResult]:
        """Each unfinished generation's rows for the next pass: decoding ones first (their last
        token and a draft), then prompt chunks in arrival order, PASS_ROWS rows in all when
        several generations share the pass."""
        gens = [g for g in self.running if not g.finished]
        self._tell_load(gens)
        parts: list[_Part | StepResult] = []
        for g in [g for g in gens if g.drafter_due is not None]:
            try:
                self._start_drafter(g)
            except Exception as exc:  # this generation's drafter failed
                parts.append((g, exc))
                gens.remove(g)
        decoding = [g for g in gens if not g.prefilling]
        prefilling = [g for g in gens if g.prefilling]
        alone = len(gens) == 1
        if alone or not decoding:
            k_cap = 1 << 30
        elif prefilling:
            k_cap = DRAFT_WHILE_PREFILLING
        else:
            k_cap = PASS_ROWS // len(decoding) - 1
        left = PASS_ROWS
        ks = [self._budget(g, min(g.num_draft, k_cap)) for g in decoding]
        # every drafter's proposal, the passes of drafters on one draft model's lanes run together
        drafting = [(g, g.drafter, k) for g, k in zip(decoding, ks, strict=True) if g.drafter is not None and k > 0]
        done = propose_together([(d, k) for _, d, k in drafting])
        proposals = {g: p for (g, _, _), p in zip(drafting, done, strict=True)}
        for g, k in zip(decoding, ks, strict=True):
            draft, seconds = proposals.get(g, (_NO_DRAFT, 0.0))
            if isinstance(draft, Exception):  # this generation's drafter failed
                parts.append((g, draft))
                continue
            try:
                part = self._decode_part(g, k, draft, seconds)
            except Exception as exc:
                parts.append((g, exc))
                continue
            parts.append(part)
            left -= part.rows
        for g in prefilling:
            if g.follows is not None:
                if self._waiting(g):
                    continue
                g.follows = None
                self._reuse(g)
            n = min(len(g.req.prompt_ids) - g.computed, self.model.prefill_rows() if alone else left)
            if n <= 0:
                break
            parts.append(self._prefill_part(g, n))
            left -= n
        return parts

    def _tell_load(self, gens: list[Generation]) -> None:
        """Tell each drafter what the other generations brought to the last pass (the one its next
        draft joins is much like it): their rows, drafting seconds and emitted tokens, and the
        pass's rows and seconds as a whole."""
        rows = sum(g.rows for g in gens)
        seconds = sum(g.draft_seconds for g in gens)
        tokens = sum(g.emitted for g in gens)
        for g in gens:
            if g.drafter is None:
                continue
            if len(gens) == 1:
                g.drafter.join(ALONE)
            else:
                g.drafter.join(PassLoad(len(gens) - 1, rows - g.rows, seconds - g.draft_seconds, tokens - g.emitted,
                                        self.last_pass_rows, self.last_pass_seconds))

    def _prefill_part(self, gen: Generation, n: int) -> _Part:
        s, e = gen.computed, gen.computed + n
        last = e == len(gen.req.prompt_ids)
        positions = torch.arange(s, e, device=self.device)
        return _Part(gen, gen.req.prompt[s:e], positions, gen.cache.length, logit_from=n - 1 if last else n)

    def _decode_part(self, gen: Generation, k: int, draft: Draft | DraftTree, seconds: float) -> _Part:
        """[last token] + ``draft``, the drafter's answer to k (``seconds``: what drafting it cost)."""
        req = gen.req
        if draft.k > k:
            raise ValueError(f"drafter {req.stats.drafter!r} proposed {draft.k} tokens, more than the {k} asked for")
        if isinstance(draft, DraftTree) and req.constraint is not None:
            # Constraint.allowed masks chains; verifying the first-child chain keeps it exact.
            draft = tree_chain(draft)
        if isinstance(draft, DraftTree) and draft.k == 0:
            draft = _NO_DRAFT
        start = gen.cache.length
        last = torch.tensor(req.output[-1:], device=self.device)
        ids = torch.cat([last, draft.tokens.to(self.device)])
        if isinstance(draft, DraftTree):
            positions = tree_positions(start, draft, self.device)
        else:
            positions = torch.arange(start, start + draft.k + 1, device=self.device)
        return _Part(gen, ids, positions, start, draft=draft, draft_seconds=seconds)

    def _budget(self, gen: Generation, k: int) -> int:
        """Draft no further than the tokens still allowed and the cache still holds."""
        left = gen.req.params.max_tokens - len(gen.req.output) - 1
        room = gen.cache.max_len - gen.cache.length - 1
        return max(0, min(k, left, room))

    # ------------------------------------------------------------------ the pass

    def _forward(self, parts: list[_Part]) -> list[tuple[torch.Tensor, dict[int, torch.Tensor]]]:
        """ONE target pass over the parts' rows: per part, the logits of its rows from logit_from
        on [n, V] and its rows' features by captured layer [t, H]."""
        capture = tuple(sorted({i for p in parts for i in p.gen.req.capture}))
        if len(parts) == 1:  # on the generation's own cache, as when it runs alone
            p = parts[0]
            tree = p.draft if isinstance(p.draft, DraftTree) else None
            mask = tree_mask(p.start, tree, self.device) if tree is not None else None
            logits, captured = self._run(p.gen.cache, p.ids, p.positions if tree is not None else None, mask, capture,
                                         p.rows - p.logit_from)
            return [(logits, dict(zip(capture, captured, strict=True)))]
        assert self.pool is not None  # several generations run only on a pool
        total = sum(p.rows for p in parts)
        self.pool.begin_pass(total)
        slots: list[torch.Tensor] = []
        offset = 0
        for p in parts:
            p.staged, p.offset = True, offset
            if isinstance(p.draft, DraftTree):  # row j sees the root, its ancestors and itself
                visible = tree_mask(0, p.draft, self.device)  # [t, t]
                own = [offset + row.nonzero().squeeze(1) for row in visible]
            else:
                own = [torch.arange(offset, offset + j + 1, device=self.device) for j in range(p.rows)]
            slots += self.pool.visible(p.gen.lane, p.start, own)
            offset += p.rows
        positions = torch.cat([p.positions for p in parts])
        lanes = [p.gen.cache for p in parts for _ in range(p.rows)]  # (recurrent states: each row's sequence)
        rows = RowSlots(slots, self.pool.slot_positions(positions), lanes)
        logit_rows = [r for p in parts for r in range(p.offset + p.logit_from, p.offset + p.rows)]
        ids = torch.cat([p.ids for p in parts])
        step = Step.reserve(self.pool.buffer, ids.shape[0], positions, rows=rows, outputs=logit_rows)
        logits, captured = self.model.run(ids, step, capture)
        out = []
        at = 0
        for p in parts:
            n = p.rows - p.logit_from
            features = {layer: c[p.offset : p.offset + p.rows] for layer, c in zip(capture, captured, strict=True)}
            out.append((logits[at : at + n], features))
            at += n
        return out

    def _run(
        self,
        cache: SequenceCache,
        ids: torch.Tensor,
        positions: torch.Tensor | None,
        mask: torch.Tensor | None,
        capture: tuple[int, ...],
        num_logits: int,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One target pass on one generation's cache (CUDA graphs where they apply)."""
        rows = None if num_logits == ids.shape[0] else num_logits
        if self.graphs is not None:
            out = self.graphs.run(ids, positions, mask, capture, rows)
            if out is not None:
                return out
        t = ids.shape[0]
        outputs = None if rows is None else list(range(t - rows, t))
        return self.model.run(ids, Step.reserve(cache, t, positions, mask=mask, outputs=outputs), capture)

    def _keep(self, part: _Part, rows: torch.Tensor, leading: bool) -> None:
        """Keep the part's rows ``rows`` [n] (increasing) in its generation's cache, in that order;
        ``leading``: they are its first n rows (a prompt chunk, a chain's accepted run)."""
        if part.staged:
            assert self.pool is not None
            self.pool.keep(part.gen.lane, rows + part.offset)
        elif leading:
            part.gen.cache.truncate(part.start + int(rows.numel()))  # O(1)
        else:
            part.gen.cache.compact(part.start, rows)

    # ------------------------------------------------------------------ after the pass

    def _finish(
        self, part: _Part, logits: torch.Tensor, features: dict[int, torch.Tensor], seconds: float
    ) -> StepOutput | None:
        gen, req = part.gen, part.gen.req
        if part.draft is None:
            return self._finish_prefill(part, logits, features)
        draft = part.draft
        verdict: Verdict
        if isinstance(draft, DraftTree):
            chosen = self._choose(req, self._process_tree(req, logits, draft), (part.positions + 1).tolist())
            verdict = verify_tree_greedy(chosen, draft)
            kept = verdict.rows.to(self.device)  # [n+1]: the root, then the accepted path
            logits = logits.index_select(0, kept)
            req.stats.record(verdict, draft.k, draft.depth)
        else:
            chosen = self._choose(req, self._process(req, logits, draft), range(part.start + 1, part.start + draft.k + 2))
            verdict = verify_greedy(chosen, draft)
            kept = torch.arange(verdict.num_accepted + 1, device=self.device)
            req.stats.record(verdict, draft.k)
        self._keep(part, kept, leading=not isinstance(draft, DraftTree))
        req.stats.draft_seconds += part.draft_seconds
        req.stats.verify_seconds += seconds
        if gen.drafter is not None:
            hidden = self._features(req, features, kept)
            if hidden is not None:
                gen.drafter.feed(hidden)
            gen.drafter.commit(verdict.tokens, verdict.num_accepted)
        return self._emit(req, verdict.tokens, logits, verdict.num_accepted)

    def _finish_prefill(self, part: _Part, logits: torch.Tensor, features: dict[int, torch.Tensor]) -> StepOutput | None:
        gen, req = part.gen, part.gen.req
        self._keep(part, torch.arange(part.rows, device=self.device), leading=True)
        gen.computed += part.rows
        rows = self._features(req, features, None)
        if rows is not None:
            gen.features.append(rows)
        if gen.prefilling:
            return None
        token = self._choose(req, self._process(req, logits, _NO_DRAFT), [len(req.prompt_ids)])  # [1]
        req.stats.t_first = time.perf_counter()
        if gen.drafter is not None:
            gen.drafter_due = token  # its prompt read waits for the next step: the first token goes out first
        return self._emit(req, token, logits)

    @staticmethod
    def _start_drafter(gen: Generation) -> None:
        """The drafter of a generation whose first token is out reads its prompt (and the features of
        the computed rows) and the first token."""
        drafter, req, token = gen.drafter, gen.req, gen.drafter_due
        assert drafter is not None and token is not None
        gen.drafter_due = None
        drafter.prefill(req.prompt, req.params, cached=gen.cached)  # features: the computed rows only
        if gen.features:
            drafter.feed(torch.cat(gen.features) if len(gen.features) > 1 else gen.features[0])
        gen.features = []
        drafter.commit(token, 0)

    def _start(self, prompt_ids: Sequence[int], params: SamplingParams, drafter: Drafter | None) -> _Request:
        n = len(prompt_ids)
        room = self.cache.max_len - n
        if n == 0:
            raise QuickdraftError("the prompt is empty; give at least one token of input")
        if room < 1:
            raise QuickdraftError(
                f"the prompt has {n} tokens but the context holds {self.cache.max_len}; "
                "shorten the prompt or raise --max-context"
            )
        vocab = self.model.config.vocab_size
        if params.logit_bias and params.logit_bias[-1][0] >= vocab:
            raise QuickdraftError(
                f"logit_bias token id {params.logit_bias[-1][0]} is not in the vocabulary [0, {vocab})"
            )
        if params.max_tokens > room:  # finish with "length" where the context ends
            params = dataclasses.replace(params, max_tokens=room)
        if params.seed is None and not params.greedy:  # drafters sample with the same seed
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        ids = as_ids(list(prompt_ids))
        prompt = torch.from_numpy(ids).to(self.device)
        stats = RequestStats(drafter="none" if drafter is None else drafter.name, prompt_tokens=n, t_start=time.perf_counter())
        stop = StopChecker(self.tokenizer, params, prompt_ids)
        return _Request(prompt, ids, params, stop, stats)

    def _capture_layers(self, drafter: Drafter | None) -> tuple[int, ...]:
        """The drafter's feature layers, checked against the target (0..L, L = final norm input)."""
        layers = capture_layers_of(drafter)
        num_layers = self.model.config.num_hidden_layers
        bad = [i for i in layers if not 0 <= i <= num_layers]
        if bad:
            raise QuickdraftError(
                f"drafter {drafter.name if drafter else '?'!r} needs hidden states of layers {list(layers)}, "
                f"but the target has {num_layers} layers (valid: 0..{num_layers}); "
                "use a drafter made for this target model"
            )
        return layers

    @staticmethod
    def _features(req: _Request, by_layer: dict[int, torch.Tensor], rows: torch.Tensor | None) -> torch.Tensor | None:
        """[n, len(capture) * H]: the kept ``rows`` (None = all) of the captured layers, concatenated
        in the drafter's order; None when the drafter takes no features."""
        if not req.capture:
            return None
        hidden = torch.cat([by_layer[i] for i in req.capture], dim=-1)  # [T, n * H]
        return hidden if rows is None else hidden.index_select(0, rows)

    @staticmethod
    def _choose(req: _Request, processed: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
        """The token plain decoding picks at each row's sequence position: the argmax, or a draw
        whose random numbers depend on (seed, position) alone. A step keeps the drafted tokens
        equal to these choices and emits the choice at the first one that differs, so its output
        is exactly plain decoding's, greedy or seeded, under every drafter and k."""
        if req.params.greedy:
            return greedy_tokens(processed)
        assert req.params.seed is not None  # _start draws one
        return sample_at(probs_from_logits(processed), req.params.seed, positions)

    def _process(self, req: _Request, logits: torch.Tensor, draft: Draft) -> torch.Tensor:
        """The distribution to pick from at each row: constraint mask, then sampling transforms."""
        if req.constraint is not None:
            logits = apply_mask(logits, req.constraint.allowed(draft.tokens.tolist(), self.tokenizer.vocab_size))
        history = req.output_tensor() if req.params.needs_history else _NO_DRAFT.tokens
        return process_logits(logits, req.params, req.prompt, history, draft.tokens if draft.k else None)

    def _process_tree(self, req: _Request, logits: torch.Tensor, tree: DraftTree) -> torch.Tensor:
        """Like :meth:`_process` for tree rows (no constraint: trees are cut to chains for those).

        History-free transforms act on each row alone, so one call does every row. Penalties need
        each row's own history, the output plus that row's ancestors' tokens (rows of different
        branches see different tokens), so each row is processed by itself as a one-row call with
        exactly that history: bitwise what plain decoding computes at that position.
        """
        if not req.params.needs_history:
            return process_logits(logits, req.params, req.prompt, _NO_DRAFT.tokens)
        drafted = tree.tokens.tolist()
        rows = []
        for row in range(tree.k + 1):
            history = req.output + [drafted[j] for j in tree.path(row - 1)]
            ids = torch.tensor(history, dtype=torch.long, device=self.device)
            rows.append(process_logits(logits[row : row + 1], req.params, req.prompt, ids))
        return torch.cat(rows)

    def _emit(self, req: _Request, tokens: torch.Tensor, logits: torch.Tensor, accepted: int = 0) -> StepOutput:
        """Apply stops token by token; ``logits`` [>= n, V] row i is token i's raw distribution;
        the first ``accepted`` tokens are accepted drafts."""
        text, kept = "", []
        start = end = len(req.stop.text)
        for token in tokens.tolist():  # sync: the host needs the ids for text and stops
            req.output.append(token)
            kept.append(token)
            text += req.stop.add(token)
            if len(kept) <= accepted:
                end = len(req.stop.text)
            if req.stop.finished:
                break
        if req.constraint is not None:
            req.constraint.commit(kept)
        req.stats.output_tokens = len(req.output)
        req.stats.t_end = time.perf_counter()
        logprobs = _logprobs(logits[: len(kept)], kept, req.params.logprobs) if req.params.logprobs is not None else None
        drafts = min(accepted, len(kept))
        end = min(end, len(req.stop.text))  # a stop string cuts the text
        return StepOutput(kept, text, req.stop.finish_reason, req.stats, logprobs, drafts, (min(start, end), end))


def _logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Log-probabilities of the emitted tokens (accepted drafts included) and the top ``top``."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    if top:
        values, ids = lp.topk(top, dim=-1)
        tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    else:
        tops = [[] for _ in tokens]
    return [TokenLogprob(t, c, tp) for t, c, tp in zip(tokens, chosen, tops, strict=True)]
