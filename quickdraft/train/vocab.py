"""The draft vocabulary: the target tokens an EAGLE-3 head can propose.

A head's output layer over the full vocabulary would be most of its size (SmolLM2: 49152 x 576),
while a few thousand tokens cover nearly all the target actually writes. The head therefore
predicts over ``draft_vocab`` ids, mapped to target ids by the published layout:

    target_id = draft_id + d2t[draft_id]       t2d[target_id] = True iff the target id is covered

Draft ids are assigned in increasing target-id order (so d2t is non-decreasing, as in the
published heads). The tokens kept are the most frequent in the training data, counting both the
sequences' tokens and the target's own predictions at every position (what the head must
match); end-of-sequence and other special tokens are always kept, so a head can draft the end of
an answer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from quickdraft.errors import QuickdraftError
from quickdraft.tokenizer import Tokenizer


def token_counts(vocab_size: int, *streams: Tensor) -> Tensor:
    """How often each target id occurs in the given id tensors, ``[vocab_size]`` long."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in streams:
        ids = ids.reshape(-1).long()
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"token ids outside the vocabulary of {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def special_ids(tokenizer: Tokenizer) -> list[int]:
    """EOS ids, BOS, and the tokenizer's added special tokens (chat markers)."""
    ids = set(tokenizer.eos_ids)
    if tokenizer.bos_id is not None:
        ids.add(tokenizer.bos_id)
    for i, added in tokenizer.backend.get_added_tokens_decoder().items():
        if added.special:
            ids.add(int(i))
    return sorted(i for i in ids if 0 <= i < tokenizer.vocab_size)


def select_tokens(counts: Tensor, size: int, always: Iterable[int] = ()) -> Tensor:
    """The ``size`` target ids to cover, sorted: ``always`` first, then the most frequent.

    Ties (including never-seen ids, which fill a vocabulary larger than the data's) go to the
    smaller id, so the choice is deterministic.
    """
    vocab = counts.numel()
    if not 0 < size <= vocab:
        raise QuickdraftError(f"--draft-vocab must be between 1 and the target's vocabulary ({vocab}), got {size}")
    forced = sorted({int(i) for i in always})
    if len(forced) > size:
        raise QuickdraftError(
            f"--draft-vocab {size} is smaller than the {len(forced)} special tokens it must keep"
        )
    score = counts.double().clone()
    score[forced] = float("inf")
    # stable sort on (-count) keeps ascending ids among equal counts
    order = torch.sort(-score, stable=True).indices
    return torch.sort(order[:size]).values


def vocab_maps(selected: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    """(d2t [Vd] long, t2d [V] bool) for the sorted target ids ``selected``."""
    selected = selected.long()
    if selected.numel() > 1 and not bool((selected[1:] > selected[:-1]).all()):
        raise ValueError("selected ids must be strictly increasing")
    d2t = selected - torch.arange(selected.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[selected] = True
    return d2t, t2d


def target_to_draft(t2d: Tensor) -> Tensor:
    """``[V]`` long: the draft id of each covered target id, -1 for the others."""
    index = torch.cumsum(t2d.long(), 0) - 1
    return torch.where(t2d, index, torch.full_like(index, -1))


def build_vocab(counts: Tensor, size: int, always: Iterable[int] = ()) -> tuple[Tensor, Tensor]:
    """(d2t, t2d) for the ``size`` most useful target ids."""
    return vocab_maps(select_tokens(counts, size, always), counts.numel())


def coverage(counts: Tensor, t2d: Tensor) -> float:
    """Share of the counted tokens the draft vocabulary covers."""
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else 0.0
