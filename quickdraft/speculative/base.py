"""The Drafter protocol: what every drafter (draft model, n-gram lookup, EAGLE-3) provides.

The engine calls, per request: ``prefill(prompt)`` once; then per step ``propose(k)`` for up to k
tokens continuing the context, and after the target's verdict ``commit(tokens, n)`` with the
tokens emitted this step (n accepted drafts followed by the bonus or recovered token).
A drafter keeps its own state (its KV cache, an n-gram index) and rolls it back itself.

``propose`` may return a chain (:class:`Draft`) or a tree (:class:`DraftTree`, N <= k nodes). For a
tree, the n accepted tokens in ``commit`` are the tokens of the accepted root-to-node path; a drafter
that needs the node indices finds them by walking its tree from the root, taking at each level the
first child whose token is the next emitted one (the rule verification uses too).

Target keys and values (optional, for drafters such as Gemma 4's assistant that attend to them):
``use_target_cache(cache)`` names the target's cache of the drafter's sequence before each request.

Target features (optional, for drafters such as EAGLE-3 that read the target's hidden states):

- ``capture_layers: tuple[int, ...]``: the decoder layers whose INPUT hidden state the drafter
  needs (index i = the input of layer i = output of layer i - 1, HF ``output_hidden_states[i]``;
  index L = the final norm's input). Missing or empty = no features.
- ``feed(hidden)``: ``hidden`` [n, len(capture_layers) * H] is ``torch.cat`` of those layers' rows,
  in the order of ``capture_layers``, in the target's activation dtype and on its device. The engine
  calls it after the prefill with all P prompt rows (before the first ``commit(token, 0)``), and
  after every verify pass with the rows whose KV was kept: the pass's first row (the last committed
  token) followed by the rows of the accepted drafts (chain: rows 0..n; tree: row 0, then the
  accepted path's nodes, root to leaf), before ``commit(tokens, n)``. After a commit the drafter so
  has a feature for every committed token except the newest one (the bonus or recovered token,
  which no target pass has read yet).

:class:`Drafter` declares every hook with the default of a drafter without features, state or
model of its own.

Reuse across requests (the engine's prefix cache, :mod:`quickdraft.prefix_cache`). ``prefill``
keeps whatever of the drafter's own state is still valid for the new prompt (the longest common
prefix of the ids it has read) and computes only the rest; the state it then holds must be bitwise
what a prefill from nothing builds, so a warm request drafts exactly as a cold one. Optionally,
``snapshot()`` returns a copy of that state (host memory) and ``restore(state)`` loads one back;
the prefix cache keeps snapshots beside its stored sequences. A feature drafter cannot compute its
state from ids: ``covered(prompt_ids)`` says for how many leading prompt tokens it still holds
features (the engine never reuses more of the target's cache than that), and its ``prefill`` gets
``cached``, the count the engine reused: features then come for the rows from ``cached`` on.
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Self, TypeVar

import numpy as np
import torch
from torch import Tensor

from quickdraft.cache import KVPool, SequenceCache
from quickdraft.sampling import SamplingParams
from quickdraft.speculative.tree import DraftTree
from quickdraft.speculative.verify import Draft


@dataclass(frozen=True)
class PassLoad:
    """What the other sequences of a batch bring to the target pass a sequence's next draft joins,
    as they did in the engine's last step: their rows in the pass, the seconds they spent drafting
    before it and the tokens they emitted. A draft pays under load only if its expected tokens per
    extra second beat what the whole pass yields per second (see quickdraft.speculative.policy)."""

    sequences: int = 0  # other sequences in the pass (0: this one runs alone)
    rows: int = 0
    draft_seconds: float = 0.0
    tokens: float = 0.0
    # The last pass as a whole (every sequence's rows, its seconds): what a row costs in a pass of
    # many, which the cost model learns from (0: no pass of many ran yet).
    pass_rows: int = 0
    pass_seconds: float = 0.0


ALONE = PassLoad()


@dataclass(frozen=True)
class PassOutput:
    """What a pass a drafter asked for gives back: the logits it asked for, the hidden state of
    each of its rows where the drafter reads it (an EAGLE-3 head's ``h``; None otherwise), and the
    seconds it took (its share of a pass run together with other drafters' asks)."""

    logits: Tensor
    hidden: Tensor | None = None
    seconds: float = 0.0


class DraftPass(ABC):
    """One pass of a drafter's own model, asked for while it proposes (:meth:`Drafter.drafting`).

    Each kind of model says how to run its pass alone (:meth:`run`) and how to run several asks on
    lanes of one KV pool as ONE pass (:meth:`together`): drafters forked together
    (:meth:`Drafter.forks`) share a ``pool`` and each owns lane ``lane`` of it; every row sees its
    own lane's slots in the same order as alone, so each ask's output is bitwise what its pass
    alone computes."""

    pool: KVPool | None
    lane: int

    @property
    @abstractmethod
    def rows(self) -> int:
        """Rows this pass reads."""

    @abstractmethod
    def run(self) -> PassOutput:
        """The pass by itself, on the drafter's own cache."""

    @classmethod
    @abstractmethod
    def together(cls, asks: Sequence[Self]) -> list[PassOutput]:
        """``asks`` (all of this kind, on lanes of one pool, at most its staging rows) as one pass;
        each lane then holds its rows as its own pass would have left them."""


def begin_together(asks: Sequence[DraftPass]) -> KVPool:
    """The pool ``asks`` share (as the engine groups them), its staging slots made ready for their rows."""
    pool = asks[0].pool
    assert pool is not None and all(a.pool is pool for a in asks)
    pool.begin_pass(sum(a.rows for a in asks))
    return pool


def run_passes(asks: Sequence[DraftPass]) -> list[PassOutput]:
    """Each ask's output: one ask alone, several (on lanes of one pool) as one pass; each with its
    equal share of the pass's seconds."""
    t0 = time.perf_counter()
    outputs = [asks[0].run()] if len(asks) == 1 else type(asks[0]).together(asks)
    device = outputs[0].logits.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    share = (time.perf_counter() - t0) / len(asks)
    return [dataclasses.replace(out, seconds=share) for out in outputs]


Result = TypeVar("Result")
Steps = Generator[DraftPass, PassOutput, Result]


def run_alone(steps: Steps[Result]) -> Result:
    """Drive a :meth:`Drafter.drafting` generator to its proposal, each pass by itself."""
    try:
        ask = next(steps)
        while True:
            ask = steps.send(run_passes([ask])[0])
    except StopIteration as done:
        return done.value


class Drafter:
    """Base of every drafter: the hooks the engine, the prefix cache and the auto drafter's cost
    model call, each with the default of a drafter that has no model of its own, reads no target
    features and keeps no state worth copying. Subclasses override what they do differently."""

    name: str = "drafter"
    variant: str = ""  # which published variant of its kind it runs, in words (EAGLE-3 heads); "" for none
    # Decoder layers whose input hidden states the drafter reads (see the module docstring); ()
    # for drafters that read ids only (``feed`` is then never called).
    capture_layers: tuple[int, ...] = ()
    # What the auto drafter's cost model reads:
    stop_below: float = 0.0  # a proposal may end early below this confidence (0: it drafts k)
    max_catch_up: int = 1 << 30  # most missed tokens its catch-up pass reads
    last_token_seconds: float | None = None  # its own one-token pass, measured (None: no model)
    # Its own estimate (expected_tokens) learns from every committed step, used or not: the cost
    # model never spends a step probing it.
    learns_unused: bool = False

    def prefill(self, prompt_ids: Tensor, params: SamplingParams, cached: int = 0) -> None:
        """Start a request: ``prompt_ids`` [P]. ``params`` shapes q for sampling drafters;
        ``cached``: leading tokens the target did not recompute (features come for the rest)."""
        raise NotImplementedError

    def propose(self, k: int) -> Draft | DraftTree:
        """Up to ``k`` tokens (a chain) or tree nodes that continue the committed context (fewer,
        even 0, is fine). A subclass overrides this or :meth:`drafting` (each defaults to the other)."""
        return run_alone(self.drafting(k))

    def drafting(self, k: int) -> Steps[Draft | DraftTree]:
        """:meth:`propose` in steps, for a drafter that runs a model of its own: it yields each pass
        it needs (:class:`DraftPass`) and is sent that pass's output, so the engine runs the passes
        of every sequence's drafter on the same model together (:mod:`quickdraft.speculative.batch`).
        Default: the whole proposal at once, no pass asked for."""
        return self.propose(k)
        yield  # a generator that asks for no pass

    def commit(self, tokens: Tensor, num_accepted: int) -> None:
        """``tokens`` [n+1] were emitted: the first ``num_accepted`` came from the last proposal."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget the request."""

    def join(self, load: PassLoad) -> None:
        """The engine says, before each step's ``prefill`` or ``propose``, what the other sequences
        bring to the pass this one joins (``ALONE`` when it runs alone). Drafters that weigh their
        cost (the auto drafter) or defer work under load (a draft model's prompt read) keep it."""

    def forks(self, count: int) -> list[Drafter]:
        """``count`` drafters of the same kind for other sequences generated at the same time: they
        share what is read-only or learned across requests (models, weights, cost and acceptance
        statistics) and each owns its per-sequence state (its caches, indexes, the current
        request). A drafter with a model of its own gives this one and its forks lanes of one KV
        pool, so their passes can run together."""
        raise NotImplementedError(f"drafter {self.name!r} cannot draft for several sequences at once")

    def feed(self, hidden: Tensor) -> None:
        """Rows [n, len(capture_layers) * H] of the target's features for tokens whose KV was kept."""
        raise NotImplementedError(f"drafter {self.name!r} reads no target features")

    def use_target_cache(self, cache: SequenceCache) -> None:
        """The target's KV cache the drafter's sequence is computed in (its lane of the engine's
        pool), named by the engine when a request starts, before ``prefill``. At each ``propose``
        it holds the keys and values of every committed token but the newest. Drafters that attend
        to the target's keys and values (Gemma 4's assistant) read them there; the others ignore it."""

    def covered(self, prompt_ids: Tensor | np.ndarray) -> int:
        """How many leading ``prompt_ids`` this drafter holds features for (all, without features)."""
        return len(prompt_ids)

    def snapshot(self) -> object | None:
        """A copy of the drafter's state for the ids it has read (host memory); None: nothing to keep."""
        return None

    def restore(self, state: object) -> None:
        """Load a :meth:`snapshot` back; the next ``prefill`` reuses what of it matches."""

    def expected_tokens(self, k: int) -> float | None:
        """Tokens the last proposal's first ``k`` are expected to yield, by the drafter's own
        estimate (None: it has none; the cost model uses its acceptance history)."""
        return None

    def context_length(self) -> int | None:
        """Tokens its own model attends over now (None: no model of its own)."""
        return None

    def pending_count(self) -> int:
        """Tokens its own model has yet to read before it can draft (0: none)."""
        return 0

    def prompt_read(self, prompt_ids: Tensor) -> int:
        """Rows its own model would read at ``prefill(prompt_ids)`` (0: it reads none): what the
        cost model weighs before the read is paid (see :meth:`defer_prompt`)."""
        return 0

    def defer_prompt(self) -> None:
        """Read no prompt at the next ``prefill``: the first proposal reads the last
        ``max_catch_up`` tokens instead (the cost model found the read would not pay back)."""

    def parts(self) -> list[Drafter]:
        """The drafters this one chooses among ([] for a drafter that drafts itself)."""
        return []

    def usage_counts(self) -> dict[str, int]:
        """Steps by the drafter that proposed them, for drafters that choose among others ({})."""
        return {}

    def drafting_seconds(self) -> dict[str, float]:
        """Seconds spent drafting so far, by the drafter that drafted, for drafters that choose
        among others ({})."""
        return {}

    def stood_down(self) -> list[str]:
        """The drafters the cost model stood down for the current request, and why ([])."""
        return []


def capture_layers_of(drafter: Drafter | None) -> tuple[int, ...]:
    """The layers ``drafter`` wants features of; () for none."""
    return () if drafter is None else tuple(int(i) for i in drafter.capture_layers)
