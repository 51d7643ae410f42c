"""Special tokens: the ids and strings a tokenizer names (BOS, EOS, ...) and the post-processor that
adds them around encoded text. Shared by :mod:`quickdraft.tokenizer` and :mod:`quickdraft.gguf_vocab`
(which builds a tokenizer's pieces from GGUF metadata), so neither imports the other for them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tokenizers import Tokenizer as _Backend
from tokenizers import processors


@dataclass(frozen=True)
class Specials:
    """Special token ids and strings, gathered once from whichever source the tokenizer came from."""

    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    extra_eos_ids: frozenset[int] = frozenset()
    add_bos: bool = False
    add_eos: bool = False
    strings: Mapping[str, str] = field(default_factory=dict)


def set_post_processor(backend: _Backend, specials: Specials) -> None:
    """BOS/EOS around every encoded text, exactly as the model's flags say (transformers'
    ``update_post_processor``)."""
    bos = specials.strings.get("bos_token")
    eos = specials.strings.get("eos_token")
    add_bos = specials.add_bos and bos is not None and specials.bos_id is not None
    add_eos = specials.add_eos and eos is not None and specials.eos_id is not None
    single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
    pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    special_tokens = []
    if add_bos:
        special_tokens.append((bos, specials.bos_id))
    if add_eos:
        special_tokens.append((eos, specials.eos_id))
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=special_tokens
    )
