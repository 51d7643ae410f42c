"""A tokenizer from the vocabulary a GGUF file stores as metadata.

A GGUF file carries no ``tokenizer.json``; it stores the vocabulary, merges and special token ids
as metadata under llama.cpp's key names. We rebuild a fast ``tokenizers`` tokenizer from those the
same way transformers does (``transformers/integrations/gguf``), so that a prompt becomes exactly the
ids transformers would feed the model: any difference would change what the model sees and make
our outputs incomparable with the reference. :meth:`quickdraft.tokenizer.Tokenizer.from_gguf`
wraps what :func:`vocab_from_gguf_metadata` builds.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend
from tokenizers.models import BPE

from quickdraft.errors import QuickdraftError
from quickdraft.loading.gguf_file import GGUFHeader
from quickdraft.special_tokens import Specials, set_post_processor

# llama.cpp token types (``tokenizer.ggml.token_type``).
_CONTROL = 3
_USER_DEFINED = 4
_UNUSED = 5

# Pre-tokenizer split regexes, by ``tokenizer.ggml.pre``. ``None`` means GPT-2's own regex, which
# the ByteLevel pre-tokenizer applies itself. Names and regexes follow transformers'
# GGUF_PRE_TOKENIZER_SPLITS so that our ids equal its ids. Note that transformers gives names it
# does not list GPT-2's regex, "smollm" included, while llama.cpp (and SmolLM2's own
# tokenizer.json) also split every digit apart first; the two differ only on whitespace runs
# right before a number ("x  1"). We follow transformers, the reference our tests compare with.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS: dict[str, str | None] = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "smollm"), None),
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}

_PAD_PLACEHOLDER = re.compile(r"^\[PAD\d+\]$")


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are spelled in."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


@dataclass(frozen=True)
class GGUFVocab:
    """What a GGUF file's tokenizer metadata describes, as :class:`~quickdraft.tokenizer.Tokenizer`
    takes it."""

    backend: _Backend
    specials: Specials
    chat_template: str | None
    vocab_size: int
    unused_ids: frozenset[int]
    merges: list[str] | None  # the byte-level BPE merges as built; None for SentencePiece


def vocab_from_gguf_metadata(meta: Mapping[str, Any]) -> GGUFVocab:
    """Build from GGUF metadata (key -> value, as ``GGUFReader`` field ``contents()`` gives)."""
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if model is None or not tokens:
        raise QuickdraftError(
            "This GGUF file has no tokenizer (tokenizer.ggml.model/tokens are missing); "
            "convert the model again with llama.cpp's convert_hf_to_gguf.py, which embeds it."
        )
    if model not in ("gpt2", "llama", "gemma4"):
        raise QuickdraftError(
            f"Tokenizer type {model!r} in this GGUF file is not supported (only 'gpt2', the "
            "byte-level BPE of Llama-3, Qwen, SmolLM... models, 'llama', the SentencePiece "
            "BPE of Gemma, Llama-2, Mistral, Phi-3... models, and 'gemma4'). Use the model's "
            "Hugging Face directory with its tokenizer.json instead."
        )
    tokens = [str(t) for t in tokens]
    token_types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or ()]
    merges: list[str] | None = None
    if model == "gpt2":
        backend, pairs = _byte_level_backend(meta, tokens, token_types)
        merges = [" ".join(p) for p in pairs]
    elif model == "gemma4":
        backend = _gemma4_backend(meta, tokens, token_types)
    else:
        backend = _sentencepiece_backend(meta, tokens, token_types)
    # llama.cpp (and transformers) add BOS to a SentencePiece vocabulary that does not say.
    specials = _gguf_specials(meta, tokens, token_types, add_bos_default=model == "llama")
    set_post_processor(backend, specials)
    unused = frozenset(
        i
        for i, token in enumerate(tokens)
        if (i < len(token_types) and token_types[i] == _UNUSED) or _PAD_PLACEHOLDER.match(token)
    )
    template = meta.get("tokenizer.chat_template")
    return GGUFVocab(
        backend, specials, str(template) if template else None, len(tokens), unused, merges
    )


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """The ``general.*`` and ``tokenizer.*`` metadata of a GGUF file.

    ``gguf.GGUFReader`` parses every array item into numpy views, which takes ~7 s for a 150k
    vocabulary; the header is simple, so we walk the key/value section ourselves and stop
    before the tensor infos. Files we do not understand (GGUF v1, big-endian) go to GGUFReader.
    """
    if not path.is_file():
        raise QuickdraftError(f"GGUF file not found: {path}")
    try:
        with path.open("rb") as fh:
            parsed = GGUFHeader(fh).metadata(("tokenizer.", "general."))
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise QuickdraftError(f"{path} is not a readable GGUF file ({exc}).") from exc
    return parsed if parsed is not None else _read_with_gguf_reader(path)


def _read_with_gguf_reader(path: Path) -> dict[str, Any]:
    """Slow but general fallback: the ``gguf`` package's own reader."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as exc:  # the reader raises ValueError/struct errors on foreign files
        raise QuickdraftError(f"{path} is not a readable GGUF file ({exc}).") from exc
    return {
        key: f.contents()
        for key, f in reader.fields.items()
        if key.startswith(("tokenizer.", "general."))
    }


def _byte_level_backend(
    meta: Mapping[str, Any], tokens: list[str], token_types: list[int]
) -> tuple[_Backend, list[tuple[str, str]]]:
    """Byte-level BPE as transformers' GGUF converter builds it (vocab, merges, split, added);
    also the merges it was given."""
    alphabet = set(_bytes_to_unicode().values())
    spell = _bytes_to_unicode()
    # A token outside the byte alphabet (rare llama.cpp spelling) is respelled byte by byte.
    vocab = {
        (t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    merges = [_merge_pair(str(m)) for m in meta.get("tokenizer.ggml.merges") or ()]
    backend = _Backend(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre") or "default")
    backend.decoder = decoders.ByteLevel()
    _add_gguf_added_tokens(backend, tokens, token_types, alphabet, vocab)
    return backend, merges


# SentencePiece vocabularies whose GGUF lists no usable scores: merges are ranked by file order.
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
_SPM_SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space


def _sentencepiece_backend(
    meta: Mapping[str, Any], tokens: list[str], token_types: list[int]
) -> _Backend:
    """SentencePiece BPE ("llama" in GGUF) as transformers' GGUF converter builds it (kept whole,
    over 60 lines: the three flavours below differ in a few lines each of one build).

    The model is a BPE with byte fallback (``<0x..>`` tokens for bytes outside the vocabulary);
    its merges are not in the file and are recovered from the vocabulary (:func:`_spm_merges`).
    Three flavours, chosen by architecture as transformers does:

    * Gemma: spaces become "▁" in a normalizer, no prefix space; whitespace-only tokens stored with
      real spaces are respelled "▁▁..." (so merges built from them match), and merges are ranked by
      file order (Gemma's scores are all equal);
    * Phi-3: a normalizer prepends "▁" and respells spaces;
    * others (Llama-2, Mistral ...): a Metaspace pre-tokenizer adds "▁" before the first word;
      merges are ranked by the file's scores.
    """
    arch = str(meta.get("general.architecture") or "")
    gemma = arch in _GEMMA_ARCHS
    if gemma:
        spelled = [_SPM_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranks: dict[str, float] = {}
        for i, t in enumerate(spelled):
            ranks[t] = -i  # a repeated token keeps its first place and its last rank, as a dict does
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise QuickdraftError(
                "This GGUF file's SentencePiece ('llama') vocabulary has no scores "
                "(tokenizer.ggml.scores), "
                "so its merges cannot be recovered; convert the model again with llama.cpp."
            )
        spelled = tokens
        ranks = dict(zip(tokens, (float(x) for x in scores), strict=True))
    vocab = {t: i for i, t in enumerate(spelled)}
    backend = _Backend(
        BPE(
            vocab=vocab,
            merges=_spm_merges(vocab, ranks),
            dropout=None,
            unk_token="<unk>" if gemma else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", _SPM_SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif arch == "phi3":
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend(_SPM_SPACE), normalizers.Replace(" ", _SPM_SPACE)]
        )
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPM_SPACE, prepend_scheme="first", split=False
        )
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    _add_gguf_added_tokens(backend, tokens, token_types, None, vocab)
    return backend


def _gemma4_backend(meta: Mapping[str, Any], tokens: list[str], token_types: list[int]) -> _Backend:
    """Gemma 4's BPE ("gemma4" in GGUF) as llama.cpp runs it: spaces spelled "▁", the text split
    into runs of newlines and runs of anything else, the file's merges over raw UTF-8 characters
    (no byte-level alphabet), bytes outside the vocabulary as ``<0x..>`` tokens."""
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise QuickdraftError("This GGUF file's 'gemma4' tokenizer has no merges (tokenizer.ggml.merges); "
                              "convert the model again with llama.cpp.")
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}  # a repeated token keeps its first id
    backend = _Backend(
        BPE(vocab=vocab, merges=[_merge_pair(str(m)) for m in merges], dropout=None, fuse_unk=False, byte_fallback=True)
    )
    backend.normalizer = normalizers.Replace(" ", _SPM_SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    _add_gguf_added_tokens(backend, tokens, token_types, None, vocab)
    return backend


def _spm_merges(vocab: Mapping[str, int], ranks: Mapping[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies, in transformers' ``generate_merges`` order.

    Every way to cut a token into two vocabulary entries is a merge. They are ranked by the
    token's rank (best first), then longer left piece, then longer right piece; ties keep the
    order of ``ranks`` (a stable sort). A token's own cuts never tie (each has its own left
    length), so when the ranks fall strictly from token to token (Gemma's file order) the cuts
    listed token by token, longest left piece first, are already sorted and no sort is needed.
    """
    pairs: list[tuple[str, str]] = []
    for token in ranks:
        for i in range(len(token) - 1, 0, -1):
            left = token[:i]
            if left in vocab:
                right = token[i:]
                if right in vocab:
                    pairs.append((left, right))
    values = list(ranks.values())
    if all(a > b for a, b in zip(values, values[1:], strict=False)):
        return pairs
    keys = [(ranks[left + right], len(left), len(right)) for left, right in pairs]
    order = sorted(range(len(pairs)), key=keys.__getitem__, reverse=True)
    return [pairs[i] for i in order]


def _merge_pair(merge: str) -> tuple[str, str]:
    """``"Ġ t"`` -> ``("Ġ", "t")``; byte-level tokens never contain a real space."""
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right or " " in right:
        raise QuickdraftError(
            f"Malformed merge {merge!r} in the GGUF tokenizer; the file is damaged."
        )
    return left, right


def _pre_tokenizer(name: str) -> Any:
    """The split a vocabulary's merges were learned with, by llama.cpp's ``pre`` name."""
    if name not in _PRE_SPLITS:
        raise QuickdraftError(
            f"Unknown GGUF pre-tokenizer {name!r} (tokenizer.ggml.pre); quickdraft knows "
            f"{', '.join(sorted(_PRE_SPLITS))}. Use the model's Hugging Face directory "
            "(tokenizer.json) instead."
        )
    split = _PRE_SPLITS[name]
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _add_gguf_added_tokens(
    backend: _Backend,
    tokens: list[str],
    token_types: list[int],
    alphabet: set[str] | None,
    vocab: Mapping[str, int],
) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens.

    Added tokens are matched whole in the input instead of being cut by BPE. In a byte-level
    vocabulary (``alphabet`` given) a control token spelled outside the byte alphabet is a
    llama.cpp mislabel and is skipped, as transformers does. A user-defined token is added as
    the file spells it, and only where the model's vocabulary has that spelling.
    """
    pairs = list(zip(tokens, token_types, strict=False))  # types may be absent
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in pairs
        if kind == _CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in pairs
        if kind == _USER_DEFINED and t in vocab
    ]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def _gguf_specials(
    meta: Mapping[str, Any], tokens: list[str], token_types: list[int], add_bos_default: bool = False
) -> Specials:
    """Special ids from ``tokenizer.ggml.*_token_id`` and the add_bos/add_eos flags
    (``add_bos_default`` where the file has no add_bos flag)."""

    def token_id(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    ids = {
        "bos_token": token_id("bos_token_id"),
        "eos_token": token_id("eos_token_id"),
        "unk_token": token_id("unknown_token_id"),
        "pad_token": token_id("padding_token_id"),
    }
    extra = {i for i in (token_id("eot_token_id"), token_id("eom_token_id")) if i is not None}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and ids["bos_token"] is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and ids["eos_token"] is not None
    return Specials(
        bos_id=ids["bos_token"],
        eos_id=ids["eos_token"],
        unk_id=ids["unk_token"],
        pad_id=ids["pad_token"],
        extra_eos_ids=frozenset(extra),
        add_bos=add_bos,
        add_eos=add_eos,
        strings={name: tokens[i] for name, i in ids.items() if i is not None},
    )
