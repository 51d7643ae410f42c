"""The generation loop: one loop for the CLI, the server and the benchmark.

Per request: prefill the target (and the drafter); then repeat
draft -> ONE target pass over [last token, drafted tokens] -> verify -> roll back the cache to the
accepted run -> stop checks -> yield a :class:`StepOutput`. Plain decoding is the same loop with
no drafter (k = 0). Nothing in here is specific to a model or a drafting method.

A drafter may propose a tree (:class:`~quickdraft.speculative.tree.DraftTree`) instead of a chain: the
pass then runs over [last token] + the tree's nodes with tree positions and a tree mask, the
verdict is a root-to-node path, and ``cache.compact`` moves that path's KV behind the prefix.
Drafters that read target features (``capture_layers``, see :mod:`quickdraft.speculative.base`) get the
captured hidden states of every row whose KV was kept, through ``feed``, before each commit.

Prefill first asks the prefix cache (:mod:`quickdraft.prefix_cache`) for the longest already
computed prefix of the prompt, then runs the rest in chunks of at most ``PREFILL_CHUNK`` rows: the
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

from quickdraft.constraints import Constraint, apply_mask
from quickdraft.errors import QuickdraftError
from quickdraft.models.causal_lm import CausalLM
from quickdraft.models.graphs import make_step_graphs
from quickdraft.models.layers import prefill_chunks
from quickdraft.prefix_cache import PrefixCache, as_ids
from quickdraft.sampling import (
    SamplingParams,
    greedy_tokens,
    probs_from_logits,
    process_logits,
    sample_at,
)
from quickdraft.speculative.base import Drafter, capture_layers_of
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


class Engine:
    """Generates for one sequence at a time with a target model and an optional drafter."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        max_len: int | None = None,
        cuda_graphs: str = "auto",
        warn: Callable[[str], None] = runtime_warning,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        """``max_len``: KV cache length (default: the model's context; shorter for scratch runs).
        ``cuda_graphs``: replay decode/verify passes as CUDA graphs ('auto': where the model is on
        a CUDA device and supports them; 'on': the same, saying through ``warn`` where it cannot;
        'off'). ``prefix_cache``: reuse computed prefixes across requests (default: off)."""
        self.model = model
        self.tokenizer = tokenizer
        self.prefix_cache = prefix_cache or PrefixCache()
        self.cache = model.new_cache() if max_len is None else model.make_cache(max_len)
        self.device = model.device
        self.graphs = make_step_graphs(model, self.cache, cuda_graphs, warn=warn)

    def warm_up(self) -> None:
        """One token through the model on a scratch cache, so that one-time work (quantized weights
        repacked for the kernels: ~2.5 s for a 1.5B model; the native stack built) happens at
        load time instead of in the first request's time to first token."""
        self.model(torch.zeros(1, dtype=torch.long, device=self.device), self.model.make_cache(1))

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        drafter: Drafter | None = None,
        num_draft: int = 0,
        constraint: Constraint | None = None,
    ) -> Iterator[StepOutput]:
        """Stream the continuation of ``prompt_ids``; each step yields >= 0 new tokens.

        ``constraint`` (structured output) masks the target's logits at every position, in plain
        and speculative steps alike.
        """
        req = self._start(prompt_ids, params, drafter)
        req.constraint = constraint
        req.capture = self._capture_layers(drafter)
        try:
            yield from self._steps(req, drafter, num_draft)
        finally:  # finished, stopped or cancelled: what the cache holds is committed
            held = np.concatenate([req.prompt_ids, np.asarray(req.output, dtype=np.int64)])
            self.prefix_cache.release(held, self.cache, drafter)

    def _steps(self, req: _Request, drafter: Drafter | None, num_draft: int) -> Iterator[StepOutput]:
        token, logits = self._prefill(req, drafter)
        step = self._emit(req, token, logits)
        if drafter is not None:
            drafter.commit(token, 0)
        yield step
        while not step.finished:
            k = self._budget(req, num_draft if drafter else 0)
            t0 = time.perf_counter()
            draft = drafter.propose(k) if drafter is not None and k > 0 else _NO_DRAFT
            t1 = time.perf_counter()
            if draft.k > k:
                raise ValueError(f"drafter {req.stats.drafter!r} proposed {draft.k} tokens, more than the {k} asked for")
            if isinstance(draft, DraftTree) and req.constraint is not None:
                # Constraint.allowed masks chains; verifying the first-child chain keeps it exact.
                draft = tree_chain(draft)
            if isinstance(draft, DraftTree) and draft.k > 0:
                verdict, logits, hidden = self._verify_tree(req, draft)
                req.stats.record(verdict, draft.k, draft.depth)
            else:
                chain = draft if isinstance(draft, Draft) else _NO_DRAFT
                verdict, logits, hidden = self._verify(req, chain)
                req.stats.record(verdict, chain.k)
            req.stats.draft_seconds += t1 - t0
            req.stats.verify_seconds += time.perf_counter() - t1
            if drafter is not None:
                if hidden is not None:
                    drafter.feed(hidden)
                drafter.commit(verdict.tokens, verdict.num_accepted)
            step = self._emit(req, verdict.tokens, logits)
            yield step

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

    def _run(
        self,
        req: _Request,
        ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        num_logits: int | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One target pass, capturing the drafter's feature layers if it has any."""
        capture = tuple(sorted(set(req.capture)))  # the model returns them in layer order
        if self.graphs is not None:
            out = self.graphs.run(ids, positions, mask, capture, num_logits)
            if out is not None:
                return out
        return self.model(ids, self.cache, positions=positions, mask=mask, capture=capture, num_logits=num_logits)

    def _features(self, req: _Request, captured: list[torch.Tensor], rows: torch.Tensor | None) -> torch.Tensor | None:
        """[n, len(capture) * H]: the kept ``rows`` (None = all) of the captured layers, concatenated
        in the drafter's order; None when the drafter takes no features."""
        if not req.capture:
            return None
        by_layer = dict(zip(sorted(set(req.capture)), captured, strict=True))
        hidden = torch.cat([by_layer[i] for i in req.capture], dim=-1)  # [T, n * H]
        return hidden if rows is None else hidden.index_select(0, rows)

    def _prefill(self, req: _Request, drafter: Drafter | None) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self.prefix_cache.reuse(req.prompt_ids, self.cache, drafter)
        req.stats.cached_tokens = cached
        logits, captured = self._prefill_rows(req, req.prompt[cached:])  # [1, V]
        if drafter is not None:
            drafter.prefill(req.prompt, req.params, cached=cached)  # features: the computed rows only
            hidden = self._features(req, captured, None)
            if hidden is not None:
                drafter.feed(hidden)
        token = self._choose(req, self._process(req, logits, _NO_DRAFT), [len(req.prompt_ids)])  # [1]
        req.stats.t_first = time.perf_counter()
        return token, logits

    def _prefill_rows(self, req: _Request, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run ``ids`` [T] in passes of at most PREFILL_CHUNK rows; logits [1, V] of the last row
        and each captured layer's rows [T, H]."""
        parts: list[list[torch.Tensor]] = []
        logits = torch.empty(0)
        t = ids.shape[0]
        for s, e in prefill_chunks(0, t):
            logits, captured = self._run(req, ids[s:e], num_logits=1 if e == t else 0)
            parts.append(captured)
        if len(parts) == 1:
            return logits, parts[0]
        return logits, [torch.cat(rows) for rows in zip(*parts, strict=True)]

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

    def _verify(self, req: _Request, draft: Draft) -> tuple[Verdict, torch.Tensor, torch.Tensor | None]:
        start = self.cache.length
        draft = draft.to(self.device)
        ids = torch.cat([torch.tensor(req.output[-1:], device=self.device), draft.tokens])  # [k+1]
        logits, captured = self._run(req, ids)  # [k+1, V]
        chosen = self._choose(req, self._process(req, logits, draft), range(start + 1, start + draft.k + 2))
        verdict = verify_greedy(chosen, draft)
        self.cache.truncate(start + 1 + verdict.num_accepted)  # keep last token + accepted drafts
        kept = torch.arange(verdict.num_accepted + 1, device=self.device)
        return verdict, logits, self._features(req, captured, kept)

    def _verify_tree(self, req: _Request, tree: DraftTree) -> tuple[Verdict, torch.Tensor, torch.Tensor | None]:
        """One pass over [last] + nodes, each row seeing the prefix and its own ancestors; keep the
        accepted path. Returns the verdict, the raw logits of the kept rows and their features."""
        start = self.cache.length
        ids = torch.cat([torch.tensor(req.output[-1:], device=self.device), tree.tokens.to(self.device)])
        positions = tree_positions(start, tree, self.device)  # [N+1]
        mask = tree_mask(start, tree, self.device)  # [N+1, start+N+1]
        logits, captured = self._run(req, ids, positions=positions, mask=mask)  # [N+1, V]
        chosen = self._choose(req, self._process_tree(req, logits, tree), (positions + 1).tolist())
        verdict = verify_tree_greedy(chosen, tree)
        rows = verdict.rows.to(self.device)  # [n+1]: the root, then the accepted path
        self.cache.compact(start, rows)
        return verdict, logits.index_select(0, rows), self._features(req, captured, rows)

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

    def _budget(self, req: _Request, k: int) -> int:
        """Draft no further than the tokens still allowed and the cache still holds."""
        left = req.params.max_tokens - len(req.output) - 1
        room = self.cache.max_len - self.cache.length - 1
        return max(0, min(k, left, room))

    def _emit(self, req: _Request, tokens: torch.Tensor, logits: torch.Tensor) -> StepOutput:
        """Apply stops token by token; ``logits`` [>= n, V] row i is token i's raw distribution."""
        text, kept = "", []
        for token in tokens.tolist():  # sync: the host needs the ids for text and stops
            req.output.append(token)
            kept.append(token)
            text += req.stop.add(token)
            if req.stop.finished:
                break
        if req.constraint is not None:
            req.constraint.commit(kept)
        req.stats.output_tokens = len(req.output)
        req.stats.t_end = time.perf_counter()
        logprobs = _logprobs(logits[: len(kept)], kept, req.params.logprobs) if req.params.logprobs is not None else None
        return StepOutput(kept, text, req.stop.finish_reason, req.stats, logprobs)


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
