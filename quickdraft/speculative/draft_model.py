"""Draft-model drafter: a small model sharing the target's tokenizer proposes k tokens.

State: the draft's own KV cache holds every committed token except ``pending``, the tokens the
draft has not read yet (normally just the last emitted one). Worked example, k = 3::

    committed ... a b | pending [c]         cache: ... a b
    propose:  read [c] -> d0, read d0 -> d1, read d1 -> d2       cache: ... a b c d0 d1
    verdict n = 1, token t:   keep c d0 -> truncate;   pending [t]
    verdict n = 3, token t:   keep c d0 d1;            pending [d2, t]   (d2 was never read)

If a step did not ask this drafter (speculation paused, another drafter chosen), the emitted
tokens simply join ``pending`` and are read in one pass next time; but at most MAX_CATCH_UP of
them: after a long stretch drafted by n-gram lookup (often a copy of the prompt), reading a
hundred missed tokens would cost the 0.5B draft ~300 ms, several target passes. It reads the last
MAX_CATCH_UP at their true positions instead and drafts with a gap in its context (its cache
slots then lag the positions by ``offset``). Drafts stay lossless whatever the draft reads.

Reuse across requests: ``slot_tokens`` / ``slot_positions`` record which token at which position
every cache slot holds. ``prefill`` keeps the leading slots that agree with the new prompt (the
previous turn of a conversation, a restored snapshot) and reads only the prompt after them, in
PREFILL_CHUNK-row passes (bitwise the keys and values of one long read). With ``prefill_window``
it reads at most the last max(window, rest / 4) of what is left to read, at their true positions
(the same gap as a capped catch-up): under ``--draft auto`` the draft must not add much to the
first token's time on a long prompt (reading it all costs ~30% of the target's prefill). While
other sequences share the engine's passes (``join``), it reads nothing at prefill: they would all
wait for it; its first proposal reads the prompt's last MAX_CATCH_UP tokens.

With ``stop_below`` > 0 a proposal ends early, after the first token the draft itself is unsure
of (its top probability under ``stop_below``; that token is still offered): the caller asks for
up to k and the draft spends passes only where the target is likely to agree. (Hugging Face's
assisted generation has the same rule, ``assistant_confidence_threshold``.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from quickdraft.cache import CacheSnapshot, KVPool, SequenceCache
from quickdraft.errors import QuickdraftError
from quickdraft.models.batch_invariance import BLOCKED_MAX_ROWS
from quickdraft.models.causal_lm import CausalLM
from quickdraft.models.forward_pass import RowSlots, Step
from quickdraft.sampling import (
    SamplingParams,
    greedy_tokens,
    probs_from_logits,
    process_logits,
    sample_at,
)
from quickdraft.speculative.base import (
    ALONE,
    Drafter,
    DraftPass,
    PassLoad,
    PassOutput,
    Steps,
    begin_together,
)
from quickdraft.speculative.verify import Draft
from quickdraft.speculative.vocab import DraftVocab
from quickdraft.tokenizer import Tokenizer

_EMPTY = torch.empty(0, dtype=torch.long)
MAX_CATCH_UP = 16  # missed tokens read at most before drafting (older ones are skipped)
POOL_STAGING = BLOCKED_MAX_ROWS  # rows of one pass over several sequences' lanes (batch invariant)


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer) -> None:
    """Refuse a draft whose tokenizer differs (a padded vocabulary is fine)."""
    if target.fingerprint() != draft.fingerprint():
        raise QuickdraftError(
            "the draft model's tokenizer differs from the target's, so its tokens would mean "
            "other text; pick a draft from the same model family (e.g. Qwen2.5-Coder-0.5B for "
            "Qwen2.5-Coder-1.5B), or use --draft ngram"
        )


def check_draft_confidence(p: float) -> None:
    """Refuse a --draft-confidence outside [0, 1)."""
    if not 0.0 <= p < 1.0:
        raise QuickdraftError(f"--draft-confidence must be at least 0 (0: off) and below 1, got {p}")


@dataclass(frozen=True, eq=False)
class ModelPass(DraftPass):
    """One pass of a draft model: read ``ids`` [t] into ``cache`` at ``positions`` [t] (None: at
    the cache's next slots) and give back the logits of the last row [1, V]. ``slot_positions``:
    the position each slot of the cache holds (they lag the slots after a capped catch-up)."""

    model: CausalLM
    cache: SequenceCache
    ids: Tensor
    positions: Tensor | None
    slot_positions: Sequence[int]
    pool: KVPool | None = None
    lane: int = 0

    @property
    def rows(self) -> int:
        return int(self.ids.shape[0])

    def run(self) -> PassOutput:
        logits, _ = self.model(self.ids, self.cache, positions=self.positions, num_logits=1)
        return PassOutput(logits)

    @classmethod
    def together(cls, asks: Sequence[ModelPass]) -> list[PassOutput]:
        """The asks' rows as ONE pass of the model over the pool's staging slots (each row sees its
        lane's slots, then its own rows of the pass); each lane then keeps its rows."""
        pool, model = begin_together(asks), asks[0].model
        device = pool.buffer.device
        slots: list[Tensor] = []
        positions: list[Tensor] = []
        held: dict[int, Tensor] = {}
        staged: list[Tensor] = []  # each ask's rows in the pass
        offset = 0
        for a in asks:
            start = a.cache.length
            pos = a.positions if a.positions is not None else torch.arange(start, start + a.rows, device=device)
            positions.append(pos.to(device))
            if a.positions is not None:  # slots lag positions: say which position each slot holds
                held[a.lane] = torch.tensor(a.slot_positions[:start], dtype=torch.long, device=device)
            staged.append(torch.arange(offset, offset + a.rows, device=device))
            slots += pool.visible(a.lane, start, [staged[-1][: j + 1] for j in range(a.rows)])
            offset += a.rows
        at = torch.cat(positions)
        last_rows = [int(rows[-1]) for rows in staged]
        ids = torch.cat([a.ids.to(device) for a in asks])
        lanes = [a.cache for a in asks for _ in range(a.rows)]
        seen = RowSlots(slots, pool.slot_positions(at, held), lanes)
        logits, _ = model.run(ids, Step.reserve(pool.buffer, ids.shape[0], at, rows=seen, outputs=last_rows))
        for a, rows in zip(asks, staged, strict=True):
            pool.keep(a.lane, rows)
        return [PassOutput(logits[i : i + 1]) for i in range(len(asks))]


class DraftModelDrafter(Drafter):
    name = "draft"
    max_catch_up = MAX_CATCH_UP

    def __init__(
        self,
        model: CausalLM,
        target_vocab: int,
        eager: bool = False,
        vocab: DraftVocab | None = None,
        stop_below: float = 0.0,
        prefill_window: int | None = None,
        lane: tuple[KVPool, int] | None = None,
    ) -> None:
        """``eager``: read the prompt at prefill (as the engine's drafters do), instead of at its
        first use (for a mix where it may never be used for the request). ``vocab``:
        the ids the draft may propose (its output head is cut to them plus each prompt's ids).
        ``stop_below``: end a proposal after a token whose draft probability is below it (0: never).
        ``prefill_window``: read at most max(window, rest / 4) prompt tokens at prefill (None: all).
        ``lane``: (pool, i): its cache is lane i of that KV pool (see :meth:`forks`), else its own."""
        check_draft_confidence(stop_below)
        self.model = model
        self.stop_below = stop_below
        self.vocab = vocab
        self.eager = eager
        self.prefill_window = prefill_window
        self.pool: KVPool | None = None  # the KV pool whose lane ``lane`` is the cache (see forks)
        self.lane = 0
        if lane is None:
            self.cache = model.new_cache()
        else:
            self.pool, self.lane = lane
            self.cache = self.pool.lanes[self.lane]
        self.slot_tokens: list[int] = []  # the token each cache slot holds ...
        self.slot_positions: list[int] = []  # ... and its position
        self.target_vocab = target_vocab
        self.pending: list[int] = []
        self.params = SamplingParams()
        self.length = 0  # tokens of the sequence so far (prompt + committed output)
        self._base = 0  # cache length before the last proposal
        self.offset = 0  # position - cache slot: tokens skipped by capped catch-ups
        self._proposed: Tensor | None = None
        self.last_token_seconds: float | None = None  # cost of the last one-token draft pass
        self.load = ALONE  # what the other sequences of the engine's batch bring to its pass
        self._deferred = False  # the next prefill reads no prompt (defer_prompt)
        self._vocab_due: Tensor | None = None  # the prompt whose ids the head is cut to at the next draft

    def join(self, load: PassLoad) -> None:
        self.load = load

    def forks(self, count: int) -> list[Drafter]:
        """Other sequences' drafters on the same draft model. This drafter and its forks each own a
        lane of one KV pool (what this one has read moves to the first lane), so the engine runs
        their passes together (:class:`ModelPass`). The model's cut
        output head is shared: each prefill widens it with that prompt's ids, so concurrent
        sequences draft from the latest prompt's cut (any draft distribution stays lossless)."""
        length = self.cache.max_len
        buffer = self.model.make_cache((count + 1) * length + POOL_STAGING)
        pool = KVPool(buffer, count + 1, length, POOL_STAGING) if buffer.copyable else None
        if pool is not None:
            n = self.cache.length
            pool.lanes[0].restore(self.cache.snapshot(n), n)
            self.cache, self.pool, self.lane = pool.lanes[0], pool, 0
        twins: list[Drafter] = []
        for i in range(1, count + 1):
            twin = DraftModelDrafter(self.model, self.target_vocab, self.eager, self.vocab, self.stop_below,
                                     self.prefill_window, lane=None if pool is None else (pool, i))
            twin.last_token_seconds = self.last_token_seconds
            twins.append(twin)
        return twins

    def prefill(self, prompt_ids: Tensor, params: SamplingParams, cached: int = 0) -> None:
        # q must be shaped like p except for penalties (they need history the draft lacks; any q
        # stays lossless, a closer one just accepts more).
        self.params = dataclasses.replace(params, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
        self.length = int(prompt_ids.shape[0])
        # The output head is cut to this prompt's ids when the draft first drafts for it (reading
        # needs no logits): a cut costs a gather and a repack of the head, which requests the cost
        # model never drafts for with this model (under load, mostly) do not pay.
        self._vocab_due = prompt_ids if self.vocab is not None else None
        ids = prompt_ids.tolist()
        keep, start, skip, read = self._plan_read(ids)
        self._truncate(keep)
        self.offset = start + skip - keep
        self.pending = ids[start + skip:]
        self._proposed = None
        self._deferred = False
        if read:
            self._read(self.pending[:-1])
            self.pending = self.pending[-1:]

    def _plan_read(self, ids: list[int]) -> tuple[int, int, int, bool]:
        """How ``prefill(ids)`` goes: the cache slots it keeps, the first position not held, the
        prompt tokens it skips after that, and whether it reads the rest (all but the last token,
        which the first proposal reads) now."""
        keep = self._valid_slots(ids)
        start = self.slot_positions[keep - 1] + 1 if keep else 0
        pending = len(ids) - start
        if (self.load.sequences or self._deferred) and pending > MAX_CATCH_UP:
            # Other sequences would wait for whatever this prefill reads (or the cost model found
            # the read would not pay back): the prompt is left to the first proposal, which reads
            # only its last MAX_CATCH_UP tokens (a capped catch-up).
            return keep, start, pending - MAX_CATCH_UP, False
        if self.eager and pending > 1:
            rest = pending - 1  # the last prompt token is read by the first proposal
            skip = 0
            if self.prefill_window is not None and rest > self.prefill_window:
                skip = rest - max(self.prefill_window, rest // 4)
            return keep, start, skip, True
        return keep, start, 0, False

    def prompt_read(self, prompt_ids: Tensor) -> int:
        """Rows ``prefill(prompt_ids)`` would read now (the slots it holds that agree are kept)."""
        keep, start, skip, read = self._plan_read(prompt_ids.tolist())
        return max(0, len(prompt_ids) - start - skip - 1) if read else 0

    def defer_prompt(self) -> None:
        self._deferred = True

    def _valid_slots(self, ids: list[int]) -> int:
        """How many leading cache slots hold the token ``ids`` has at their position (the last
        prompt position excluded: it is read when drafting starts)."""
        n = 0
        for pos, tok in zip(self.slot_positions, self.slot_tokens, strict=True):
            if pos >= len(ids) - 1 or ids[pos] != tok:
                break
            n += 1
        return n

    def _read(self, tokens: list[int]) -> None:
        """Read ``tokens`` into the cache at the next positions (no logits)."""
        start = self.cache.length + self.offset
        ids = torch.tensor(tokens, dtype=torch.long, device=self.model.device)
        positions = torch.arange(start, start + len(tokens), device=self.model.device) if self.offset else None
        self.model.prefill(ids, self.cache, positions=positions)
        self.slot_tokens.extend(tokens)
        self.slot_positions.extend(range(start, start + len(tokens)))

    def _truncate(self, n: int) -> None:
        self.cache.truncate(n)
        del self.slot_tokens[n:], self.slot_positions[n:]

    def context_length(self) -> int:
        """Tokens in this model's own cache (what its passes attend over)."""
        return self.cache.length

    def pending_count(self) -> int:
        return len(self.pending)

    def snapshot(self) -> tuple[CacheSnapshot, list[int], list[int]]:
        n = self.cache.length
        return self.cache.snapshot(n), self.slot_tokens[:n], self.slot_positions[:n]

    def restore(self, state: object) -> None:
        kv, tokens, positions = cast(tuple[CacheSnapshot, list[int], list[int]], state)
        self.cache.restore(kv, len(tokens))
        self.slot_tokens, self.slot_positions = list(tokens), list(positions)
        self.pending, self._proposed = [], None

    def drafting(self, k: int) -> Steps[Draft]:
        if k <= 0 or not self.pending:
            return Draft(tokens=_EMPTY)
        if self._vocab_due is not None and self.vocab is not None:
            self.vocab.apply(self.model, self._vocab_due)
            self._vocab_due = None
        if len(self.pending) > MAX_CATCH_UP and (self.cache.length > 0 or self.offset > 0):
            # (a cache that holds tokens, or skipped some: the prompt was left to a capped catch-up
            # under load or deferred; only a lazy first read of a whole short prompt reads all)
            self.offset += len(self.pending) - MAX_CATCH_UP
            self.pending = self.pending[-MAX_CATCH_UP:]
        room = self.cache.max_len - self.cache.length - len(self.pending)
        k = min(k, room)
        if k <= 0:
            return Draft(tokens=_EMPTY)
        self._base = self.cache.length
        self.cache.hold_from(self._base)  # commit truncates back among the proposal passes' ends
        ids = torch.tensor(self.pending, dtype=torch.long, device=self.model.device)
        tokens: list[Tensor] = []
        qs: list[Tensor] = []
        for _ in range(k):
            start = self.cache.length + self.offset
            positions = torch.arange(start, start + ids.shape[0], device=self.model.device) if self.offset else None
            out = yield ModelPass(self.model, self.cache, ids, positions, self.slot_positions, self.pool, self.lane)
            logits = out.logits
            self.slot_tokens.extend(ids.tolist())
            self.slot_positions.extend(range(start, start + ids.shape[0]))
            if ids.shape[0] == 1 and not self.load.sequences:  # (under load the pass is shared)
                self.last_token_seconds = out.seconds
            tok, q = self._pick(logits, self.length + len(tokens))
            tokens.append(tok)
            if q is not None:
                qs.append(q)
            ids = tok
            if self.stop_below and len(tokens) < k and self._confidence(logits, q) < self.stop_below:
                break
        drafted = torch.cat(tokens)
        self._proposed = drafted
        return Draft(tokens=drafted, probs=torch.cat(qs) if qs else None)

    def _pick(self, logits: Tensor, position: int) -> tuple[Tensor, Tensor | None]:
        """The draft's token for sequence ``position``: its argmax, or for a sampled request a draw
        with the target's random numbers for that position (coupled: a q close to p proposes the
        token the target will pick)."""
        logits = _fit_vocab(logits, self.target_vocab)
        processed = process_logits(logits, self.params, _EMPTY, _EMPTY)
        if self.params.greedy:
            return greedy_tokens(processed), None
        q = probs_from_logits(processed)  # [1, V]
        assert self.params.seed is not None  # the engine gives sampled requests a seed
        return sample_at(q, self.params.seed, [position]), q

    def _confidence(self, logits: Tensor, q: Tensor | None) -> float:
        """The draft's probability of its own pick: the top of q (sampling: the distribution it
        drew from), else of the softmax of its logits (greedy; over the cut head's rows only, the
        ids it cannot propose have probability 0 either way)."""
        if q is not None:
            return float(q.max())
        return float(logits.float().softmax(dim=-1).max())

    def commit(self, tokens: Tensor, num_accepted: int) -> None:
        emitted = [int(t) for t in tokens.tolist()]
        self.length += len(emitted)
        if self._proposed is None:  # not asked this step: read everything next time
            self.pending.extend(emitted)
            return
        k = int(self._proposed.shape[0])
        read = len(self.pending) + min(num_accepted, k - 1)  # tokens of this step now in the cache
        self._truncate(self._base + read)
        self.pending = ([int(self._proposed[k - 1])] if num_accepted == k else []) + emitted[num_accepted:]
        self._proposed = None

    def reset(self) -> None:
        self._truncate(0)
        self.offset = 0
        self.pending = []
        self._proposed = None


def _fit_vocab(logits: Tensor, vocab: int) -> Tensor:
    """Pad or cut the draft's logits [N, V_draft] to the target's vocabulary size."""
    v = logits.shape[-1]
    if v == vocab:
        return logits
    if v > vocab:
        return logits[:, :vocab]
    return torch.cat([logits, logits.new_full((logits.shape[0], vocab - v), float("-inf"))], dim=1)
