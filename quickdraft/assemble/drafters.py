"""Build the drafter a user asked for: ``--draft auto|none|ngram|mtp|MODEL|HEAD`` and ``--num-draft K|auto``.

mtp is the model's own multi-token-prediction layer (Qwen3.5's ``mtp.*``); ``auto`` drafts with it
(beside n-gram lookup) where the checkpoint has one, else with the zoo's draft model.

HEAD is an EAGLE-3 draft head for the target (a folder or .safetensors file, recognised by its
config / tensor names): it drafts alongside n-gram lookup in the AutoDrafter, after a load-time
canary checked that it pays (see quickdraft.assemble.eagle3_canary).

A Gemma 4 assistant folder (config.json with model_type gemma4_assistant) drafts for a Gemma 4
target alongside n-gram lookup in the AutoDrafter the same way (see
quickdraft.speculative.gemma4_assistant).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from quickdraft import zoo
from quickdraft.assemble.pass_costs import pass_cost_model
from quickdraft.errors import QuickdraftError
from quickdraft.loading.load import LoadedModel, load_model, resolve
from quickdraft.options import EngineOptions
from quickdraft.speculative.base import Drafter
from quickdraft.speculative.draft_model import (
    MAX_CATCH_UP,
    DraftModelDrafter,
    check_same_tokenizer,
)
from quickdraft.speculative.eagle3.drafter import Eagle3Drafter, cost_rows, default_shape
from quickdraft.speculative.eagle3.io import is_head, load_head, with_convention
from quickdraft.speculative.gemma4_assistant import assistant_folder, build_assistant_drafter
from quickdraft.speculative.mtp import MTPDrafter, MTPHead, mtp_head
from quickdraft.speculative.policy import (
    Acceptance,
    AutoDrafter,
    Candidate,
    TargetCost,
)
from quickdraft.speculative.suffix import SuffixDrafter
from quickdraft.speculative.vocab import DraftVocab, corpus_token_ranks

# Zoo targets and the small model of the same family that drafts for them in --draft auto.
DEFAULT_DRAFTS = {"qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-0.5b-instruct"}
MAX_AUTO_K = 8
LOOKUP_MAX_K = 32  # a long match of a file being rewritten holds for dozens of tokens
NGRAM_PRIOR, DRAFT_PRIOR, EAGLE_PRIOR = 0.6, 0.7, 0.8
MTP = "mtp"  # --draft mtp: the checkpoint's own multi-token-prediction layer
PREFILL_WINDOW = 128  # prompt tokens a draft model under the cost model reads at least (see below)



def restrict_draft_vocab(draft: LoadedModel, n: int, ranks: torch.Tensor | None = None) -> DraftVocab | None:
    """The output vocabulary of a draft model cut to its ``n`` most frequent tokens (``ranks``: ids
    most frequent first; default: counted on the Python standard library, see quickdraft.speculative.vocab),
    the first ``n`` ids and the tokenizer's added tokens (EOS, chat markers); each request adds its
    prompt's tokens.
    None where no cut applies (n = 0, or n covers the vocabulary)."""
    vocab = draft.config.vocab_size
    if n <= 0 or n >= vocab:
        return None
    if ranks is None:
        ranks = corpus_token_ranks(draft.tokenizer, vocab)
    # the first n ids too: BPE merge order ranks the tokenizer's own (mostly prose) training text,
    # which the code-heavy stdlib counts miss (80 HumanEval / 20 MT-bench answers: 93.2% / 74.3% of
    # tokens in the stdlib top 16384; 95.5% / 85.8% with ids < 16384 added, 24.7k rows in all)
    always = list(draft.tokenizer.backend.get_added_tokens_decoder()) + list(range(n))
    return DraftVocab.ranked(ranks, n, always, vocab)


def build_drafter(
    cfg: EngineOptions, target: LoadedModel, say: Callable[[str], None] = lambda _m: None
) -> tuple[Drafter | None, int]:
    """The drafter for ``cfg`` and the k the engine should offer it per step (0 = plain)."""
    if cfg.draft == "none":
        return None, 0
    base = _base_drafters(cfg, target, say)
    if not base:
        return None, 0
    if cfg.num_draft is not None and len(base) == 1:
        return base[0][0], cfg.num_draft  # fixed k, one drafter: no policy needed
    eagles = [d for d, _, _, _ in base if isinstance(d, Eagle3Drafter)]
    rows = cost_rows(target.model.device) if eagles else (1, 2, 4, 8, 16)
    cost = pass_cost_model(target, rows, say)
    # An EAGLE-3 drafter sizes its own trees each step (its proposal is previewed like n-gram's,
    # cheap=True) from the same pass costs, which the AutoDrafter observes for both.
    # Longest-match lookup proposes up to LOOKUP_MAX_K tokens where its match is long; the other
    # drafters are offered at most MAX_AUTO_K (or an EAGLE tree's nodes).
    lookup = any(isinstance(d, SuffixDrafter) for d, _, _, _ in base)
    max_k = max([MAX_AUTO_K, *(d.shape.max_nodes for d in eagles), *([LOOKUP_MAX_K] if lookup else [])])
    for d in eagles:
        d.cost, d.observe_cost = cost, False

    def own_k(d: Drafter) -> int:
        if isinstance(d, SuffixDrafter):
            return LOOKUP_MAX_K
        return d.shape.max_nodes if isinstance(d, Eagle3Drafter) else MAX_AUTO_K

    candidates = [Candidate(d, Acceptance(prior, max(MAX_AUTO_K, own_k(d))), per_token, cheap=per_token == 0.0,
                            pass_cost=curve)
                  for d, prior, per_token, curve in base]
    return AutoDrafter(candidates, cost, fixed_k=cfg.num_draft), cfg.num_draft or max_k


# (drafter, acceptance prior, seconds per drafted token, its model's pass seconds by rows or None)
BaseDrafter = tuple[Drafter, float, float, TargetCost | None]


def _base_drafters(cfg: EngineOptions, target: LoadedModel, say: Callable[[str], None]) -> list[BaseDrafter]:
    """Each drafter in play, as a :data:`BaseDrafter`."""
    lookup: BaseDrafter = (SuffixDrafter(), NGRAM_PRIOR, 0.0, None)
    mtp = mtp_head(target.model) if cfg.draft in ("auto", MTP) else None
    if cfg.draft == MTP and mtp is None:
        raise QuickdraftError(
            f"--draft mtp: {target.path} carries no multi-token-prediction layers (mtp.* tensors) quickdraft can "
            "run; use --draft auto, ngram or a draft model"
        )
    if mtp is not None:  # the model's own drafter, trained with it: beside n-gram lookup in auto
        return ([lookup] if cfg.draft == "auto" else []) + [(_mtp_drafter(cfg, target, mtp, say), EAGLE_PRIOR, 0.0, None)]
    assistant = assistant_folder(cfg.draft) if cfg.draft not in ("auto", "none", "ngram", MTP) else None
    if assistant is not None:  # Gemma 4's assistant: beside n-gram lookup, as an EAGLE-3 head
        return [lookup, (build_assistant_drafter(assistant, target.model, cfg.num_draft, say), EAGLE_PRIOR, 0.0, None)]
    out: list[BaseDrafter] = []
    head = eagle3_head_path(cfg.draft)
    if cfg.draft in ("auto", "ngram") or head is not None:
        out.append(lookup)
    if head is not None:
        eagle = build_eagle3_drafter(head, target, cfg.num_draft, say, canary=cfg.canary, standalone=False)
        if eagle is not None:
            return [*out, (eagle, EAGLE_PRIOR, 0.0, None)]
        spec = _default_draft(target)  # the head failed its canary: n-gram and the zoo's draft model
    elif cfg.draft == "ngram":
        return out  # n-gram lookup alone
    else:
        spec = cfg.draft if cfg.draft != "auto" else _default_draft(target)
    if spec is not None:
        out.append(_draft_model_drafter(cfg, target, spec, say))
    return out


def _mtp_drafter(cfg: EngineOptions, target: LoadedModel, mtp: MTPHead, say: Callable[[str], None]) -> MTPDrafter:
    """The checkpoint's multi-token-prediction layer, its tree shaped by --num-draft and its output
    head cut as a draft model's."""
    shape = default_shape(target.model.device)
    if cfg.num_draft is not None:
        shape = dataclasses.replace(shape, max_nodes=cfg.num_draft, max_depth=min(shape.max_depth, cfg.num_draft))
    vocab = restrict_draft_vocab(target, cfg.draft_vocab)  # its output head cut as a draft model's
    cut = vocab is not None and mtp.cut_vocab(vocab.base)
    say("drafting with the checkpoint's multi-token-prediction layer (mtp"
        + (f", output head cut to {mtp.config.draft_vocab_size} tokens)" if cut else ")"))
    return MTPDrafter(mtp, target.model, shape=shape, policy=cfg.num_draft is None)


def _draft_model_drafter(cfg: EngineOptions, target: LoadedModel, spec: str, say: Callable[[str], None]) -> BaseDrafter:
    """Load the draft model ``spec`` beside the target, cut its vocabulary, warm it and measure
    its pass costs."""
    say(f"loading draft model {spec} ...")
    draft = load_model(spec, dtype=cfg.dtype, device=str(target.model.device), max_context=target.model.max_len,
                       kv_dtype=cfg.kv_dtype)
    check_same_tokenizer(target.tokenizer, draft.tokenizer)
    vocab = restrict_draft_vocab(draft, cfg.draft_vocab)
    if vocab is not None:
        vocab.apply(draft.model, torch.empty(0, dtype=torch.long))  # cut before timing a step
    # one token through it now: its weights are repacked for the kernels at the first pass,
    # which must not land in the first request's time to first token (nor in a kept cost)
    draft.model(torch.zeros(1, dtype=torch.long, device=draft.model.device), draft.model.make_cache(1))
    rows = tuple(r for r in (1, 2, 4, 8, 16) if r <= MAX_CATCH_UP)  # the catch-ups it may run
    curve = pass_cost_model(draft, rows, say, variant=f"draft-vocab={cfg.draft_vocab}")
    per_token = curve(1)
    # It reads the prompt at prefill (a longer first token), also in an auto mix: read at its
    # first use instead, a few-hundred-token prompt costs ~20 tokens' time mid-answer, and the
    # cost model then rarely lets the draft model start at all.
    # Under the cost model (k auto) it reads at most the last max(PREFILL_WINDOW, rest / 4) tokens
    # of a long prompt: reading all of it would add ~30% to the first token's time.
    window = PREFILL_WINDOW if cfg.num_draft is None else None
    drafter = DraftModelDrafter(
        draft.model, target.config.vocab_size, eager=True, vocab=vocab, stop_below=cfg.draft_confidence,
        prefill_window=window,
    )
    return drafter, DRAFT_PRIOR, per_token, curve


def _default_draft(target: LoadedModel) -> str | None:
    for name, draft in DEFAULT_DRAFTS.items():
        if target.path == zoo.cached_path(name):
            return draft
    return None


# ------------------------------------------------------------------------------------ EAGLE-3


def eagle3_head_path(spec: str) -> Path | None:
    """Where the EAGLE-3 head named by ``spec`` lives, or None when ``spec`` names no head
    (a keyword, a draft model, or a path that does not exist: load_model reports that)."""
    if spec in ("auto", "none", "ngram", MTP):
        return None
    path = Path(spec).expanduser()
    if not path.exists() and zoo.lookup(spec) is not None:
        path = resolve(spec)  # a zoo entry (a head once one is shipped)
    return path if path.exists() and is_head(path) else None


def build_eagle3_drafter(
    spec: str | Path,
    target: LoadedModel,
    num_draft: int | None = None,
    say: Callable[[str], None] = lambda _m: None,
    canary: bool = True,
    standalone: bool = True,
    mode: str = "auto",
) -> Eagle3Drafter | None:
    """Load the head at ``spec`` for ``target``; None when the canary finds it useless.

    The canary decodes a few tokens with the head (quickdraft.assemble.eagle3_canary). When it fails
    and the file did not name its aux layer convention, the other convention is tried before
    giving up. ``num_draft``: fixed tree size (no cost model). ``standalone``: the drafter measures
    and tracks the target's pass costs itself (not inside an AutoDrafter, which shares its own).
    ``mode``: "auto"/"tree" (dynamic trees) or "chain".
    """
    from quickdraft.assemble.eagle3_canary import (  # runs the engine
        CANARY_TOKENS,
        MIN_TAU,
        canary_tau,
    )

    say(f"loading EAGLE-3 head {spec} ...")
    head, info = load_head(spec, target.model, log=say)
    if canary:
        tau = canary_tau(target, head)
        if tau < MIN_TAU:
            other = "input" if info.convention == "output" else "output"
            alt = with_convention(head.config, info, other, target.config.num_hidden_layers)
            if alt is not None:
                original, head.config = head.config, alt[0]
                alt_tau = canary_tau(target, head)
                if alt_tau >= MIN_TAU:
                    say(f"the head's aux layer ids work in the {other} convention instead: {alt[1].describe()}")
                    tau = alt_tau
                else:
                    head.config = original
        if tau < MIN_TAU:
            msg = (
                f"the EAGLE-3 head {spec} ({info.variant}) drafts badly for this model (canary: tau {tau:.2f} < {MIN_TAU} over "
                f"{CANARY_TOKENS} tokens), so it is NOT used; check that it was trained for exactly this target "
                "model and that its aux layer ids are read in the right convention (input vs output of a layer)"
            )
            warnings.warn(msg, stacklevel=2)
            say("WARNING: " + msg)
            return None
        say(f"EAGLE-3 canary: tau {tau:.2f} over {CANARY_TOKENS} tokens ({info.variant})")
    shape = default_shape(target.model.device)
    if num_draft is not None:
        shape = dataclasses.replace(shape, max_nodes=num_draft, max_depth=min(shape.max_depth, num_draft))
    cost = pass_cost_model(target, cost_rows(target.model.device), say) if standalone else None
    drafter = Eagle3Drafter(head, target.model, mode=mode, shape=shape, cost=cost, policy=num_draft is None)
    drafter.variant = info.variant
    return drafter

