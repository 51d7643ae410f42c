"""Build the drafter a user asked for: ``--draft auto|none|ngram|MODEL`` and ``--num-draft K|auto``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from quickdraft import zoo
from quickdraft.errors import QuickdraftError
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.spec.base import Drafter
from quickdraft.spec.draft_model import DraftModelDrafter, check_same_tokenizer
from quickdraft.spec.ngram import NGramDrafter
from quickdraft.spec.policy import (
    Acceptance,
    AutoDrafter,
    Candidate,
    TargetCost,
    measure_pass_seconds,
)

# Zoo targets and the small model of the same family that drafts for them in --draft auto.
DEFAULT_DRAFTS = {"qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-0.5b-instruct"}
MAX_AUTO_K = 8
NGRAM_PRIOR, DRAFT_PRIOR = 0.6, 0.7


@dataclass(frozen=True)
class SpecConfig:
    draft: str = "auto"  # auto | none | ngram | a model (zoo name, .gguf, folder)
    num_draft: int | None = None  # None = chosen per step by the cost model

    def __post_init__(self) -> None:
        if self.num_draft is not None and not 1 <= self.num_draft <= 32:
            raise QuickdraftError(f"--num-draft must be between 1 and 32 (or 'auto'), got {self.num_draft}")


def parse_num_draft(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise QuickdraftError(f"--num-draft takes a number or 'auto', got {text!r}") from None


def build_drafter(
    cfg: SpecConfig, target: LoadedModel, dtype: str, say: Callable[[str], None] = lambda _m: None
) -> tuple[Drafter | None, int]:
    """The drafter for ``cfg`` and the k the engine should offer it per step (0 = plain)."""
    if cfg.draft == "none":
        return None, 0
    base = _base_drafters(cfg, target, dtype, say)
    if not base:
        return None, 0
    if cfg.num_draft is not None and len(base) == 1:
        return base[0][0], cfg.num_draft  # fixed k, one drafter: no policy needed
    say("measuring this machine's pass costs for the speculation policy ...")
    cost = TargetCost(measure_pass_seconds(target.model))
    candidates = [Candidate(d, Acceptance(prior, MAX_AUTO_K), per_token, cheap=per_token == 0.0)
                  for d, prior, per_token in base]
    return AutoDrafter(candidates, cost, fixed_k=cfg.num_draft), cfg.num_draft or MAX_AUTO_K


def _base_drafters(
    cfg: SpecConfig, target: LoadedModel, dtype: str, say: Callable[[str], None]
) -> list[tuple[Drafter, float, float]]:
    """(drafter, acceptance prior, seconds per drafted token) for each drafter in play."""
    out: list[tuple[Drafter, float, float]] = []
    if cfg.draft in ("auto", "ngram"):
        out.append((NGramDrafter(), NGRAM_PRIOR, 0.0))
    spec = cfg.draft if cfg.draft not in ("auto", "ngram") else _default_draft(target)
    if spec is not None:
        say(f"loading draft model {spec} ...")
        draft = load_model(spec, dtype=dtype, max_context=target.model.max_len)
        check_same_tokenizer(target.tokenizer, draft.tokenizer)
        per_token = measure_pass_seconds(draft.model, rows=(1,))[1]
        out.append((DraftModelDrafter(draft.model, target.config.vocab_size), DRAFT_PRIOR, per_token))
    return out


def _default_draft(target: LoadedModel) -> str | None:
    for name, draft in DEFAULT_DRAFTS.items():
        if target.path == zoo.cached_path(name):
            return draft
    return None
