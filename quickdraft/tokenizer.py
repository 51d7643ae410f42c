"""Text <-> token ids: the :class:`Tokenizer` a model comes with, and its loading.

A tokenizer is built from a GGUF file's metadata (:mod:`quickdraft.gguf_vocab` rebuilds the
vocabulary the way transformers does), from a Hugging Face directory's own ``tokenizer.json``, or
from the state prepared weights keep. Chat templates are rendered by
:mod:`quickdraft.chat_template`; streamed ids become text through
:class:`quickdraft.detokenizer.IncrementalDetokenizer`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _Backend

from quickdraft.chat_template import render_chat_template
from quickdraft.errors import QuickdraftError
from quickdraft.special_tokens import Specials, set_post_processor

# Tokens chat formats end a turn with. A generation stops on these as well as on EOS, the way
# llama.cpp marks "end of generation" tokens and Hugging Face generation configs list several ids
# (Qwen2.5: <|im_end|> and <|endoftext|>). Only ones that are special tokens count.
_END_OF_TURN = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<｜end▁of▁sentence｜>",
)


# Backends built by Tokenizer.from_state, by the hash of their JSON: read-only once built, so
# tokenizers with the same JSON (a target and its draft model) share one.
_SHARED_BACKENDS: dict[str, _Backend] = {}


class Tokenizer:
    """A fast tokenizer plus the special tokens and chat template a model comes with.

    Build one with :meth:`from_gguf`, :meth:`from_gguf_metadata` or :meth:`from_hf_dir`.
    """

    def __init__(
        self,
        backend: _Backend,
        specials: Specials,
        chat_template: str | None,
        vocab_size: int,
        unused_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._backend = backend
        self._specials = specials
        self.chat_template = chat_template
        self.vocab_size = vocab_size
        self.bos_id = specials.bos_id
        self.pad_id = specials.pad_id
        self.eos_ids = _eos_ids(backend, specials)
        self._unused_ids = unused_ids
        self._fingerprint: str | None = None
        self._merges: list[str] | None = None  # the BPE merges as built (else read from the backend)

    # ----------------------------------------------------------------------------- constructors

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Read the tokenizer metadata of a GGUF file (no tensors are loaded)."""
        from quickdraft.gguf_vocab import read_gguf_metadata

        return cls.from_gguf_metadata(read_gguf_metadata(Path(path)))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (key -> value, as ``GGUFReader`` field ``contents()`` gives)."""
        from quickdraft.gguf_vocab import vocab_from_gguf_metadata

        v = vocab_from_gguf_metadata(meta)
        tok = cls(v.backend, v.specials, v.chat_template, v.vocab_size, v.unused_ids)
        tok._merges = v.merges
        return tok


    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and the configs next to it from a Hugging Face model directory."""
        root = Path(path)
        file = root / "tokenizer.json"
        if not file.is_file():
            raise QuickdraftError(
                f"No tokenizer.json in {root}; quickdraft needs the fast-tokenizer file. Save it with "
                "transformers (AutoTokenizer.from_pretrained(...).save_pretrained(dir)) or use a GGUF."
            )
        try:
            backend = _Backend.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise QuickdraftError(f"Cannot read {file}: {exc}. Is the file complete?") from exc
        config = _read_json(root / "tokenizer_config.json")
        specials = _hf_specials(root, backend, config)
        if "add_bos_token" in config or "add_eos_token" in config:
            # transformers rebuilds the post-processor when the config states these explicitly.
            set_post_processor(backend, specials)
        specials = _with_observed_add_bos(backend, specials)
        vocab_size = backend.get_vocab_size(with_added_tokens=True)
        return cls(backend, specials, _hf_chat_template(root, config), vocab_size)

    def to_state(self) -> tuple[str, dict[str, Any]]:
        """(tokenizer.json text, everything else as JSON-able values): what :meth:`from_state`
        rebuilds this tokenizer from, fingerprint included (prepared weights keep it)."""
        sp = self._specials
        state = {
            "specials": {
                **dataclasses.asdict(sp),
                "extra_eos_ids": sorted(sp.extra_eos_ids),
                "strings": dict(sp.strings),
            },
            "chat_template": self.chat_template,
            "vocab_size": self.vocab_size,
            "unused_ids": sorted(self._unused_ids),
            "fingerprint": self.fingerprint(),
        }
        return self._backend.to_str(), state

    @classmethod
    def from_state(cls, backend_json: str, state: Mapping[str, Any]) -> Tokenizer:
        """The tokenizer :meth:`to_state` described (~0.4 s for a 150k vocabulary, half of
        building it from GGUF metadata)."""
        digest = hashlib.sha256(backend_json.encode("utf-8")).hexdigest()
        backend = _SHARED_BACKENDS.get(digest)
        if backend is None:  # a draft model usually has its target's vocabulary: parsed once
            backend = _SHARED_BACKENDS[digest] = _Backend.from_str(backend_json)
        sp = dict(state["specials"])
        specials = Specials(**{**sp, "extra_eos_ids": frozenset(sp["extra_eos_ids"])})
        tok = cls(backend, specials, state["chat_template"], int(state["vocab_size"]), frozenset(state["unused_ids"]))
        tok._fingerprint = str(state["fingerprint"])
        return tok

    # ------------------------------------------------------------------------------- encoding

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; BOS/EOS are added only if the model's config asks for them."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text for ``ids`` (bytes that do not form whole UTF-8 characters come out as U+FFFD)."""
        return str(
            self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        )

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, spelled as stored (byte-level: ``"Ġthe"`` for " the")."""
        result = self._backend.token_to_id(token)
        return None if result is None else int(result)

    def id_to_token(self, id: int) -> str | None:
        """The vocabulary entry for ``id``, spelled as stored; None outside the vocabulary."""
        if id < 0:
            return None
        result = self._backend.id_to_token(int(id))
        return None if result is None else str(result)

    @property
    def add_bos(self) -> bool:
        """Whether :meth:`encode` puts BOS in front (the model's ``add_bos_token``)."""
        return self._specials.add_bos

    @property
    def backend(self) -> _Backend:
        """The underlying ``tokenizers.Tokenizer``, for callers that need offsets or batching."""
        return self._backend

    # ---------------------------------------------------------------------------------- chat

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's chat template, as transformers would."""
        if not self.chat_template:
            raise QuickdraftError(
                "This model has no chat template, so chat messages cannot be formatted; "
                "give it a plain text prompt instead, or use an instruct model that ships a template."
            )
        variables = {**self._specials.strings, **kwargs}
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt, **variables
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Render then encode; BOS is added only when the model wants it and the text lacks it.

        transformers tokenizes rendered chats with ``add_special_tokens=False`` (templates that
        need BOS write it themselves); llama.cpp additionally prepends BOS when ``add_bos_token``
        is set and the template did not. Both agree whenever the template writes its own BOS.
        """
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools or None
        )
        ids = self.encode(text, add_special_tokens=False)
        bos = self.bos_id
        if self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    # --------------------------------------------------------------------------- identity

    def fingerprint(self) -> str:
        """A hash of the vocabulary and merges: equal fingerprints mean interchangeable ids.

        Placeholder ids that only pad the embedding table ("[PAD151665]", type UNUSED) are left
        out, so a draft and a target with different padding but the same real tokens match.
        """
        if self._fingerprint is None:
            vocab = self._backend.get_vocab(with_added_tokens=True)
            pairs = sorted((i, t) for t, i in vocab.items() if i not in self._unused_ids)
            merges = self._merges
            if merges is None:  # serialising the backend costs ~0.4 s for a 150k vocabulary
                model = json.loads(self._backend.to_str())["model"]
                merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or ()]
            blob = json.dumps([pairs, merges], ensure_ascii=False).encode("utf-8")
            self._fingerprint = hashlib.sha256(blob).hexdigest()
        return self._fingerprint

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_ids={sorted(self.eos_ids)}, chat_template={self.chat_template is not None})"
        )


def _eos_ids(backend: _Backend, specials: Specials) -> frozenset[int]:
    """EOS, the file's end-of-turn ids, and known end-of-turn special tokens in the vocabulary."""
    ids = set(specials.extra_eos_ids)
    if specials.eos_id is not None:
        ids.add(specials.eos_id)
    special_ids = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
    for text in _END_OF_TURN:
        token_id = backend.token_to_id(text)
        if token_id is not None and token_id in special_ids:
            ids.add(int(token_id))
    return frozenset(ids)


# ------------------------------------------------------------------------ Hugging Face dirs


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON config file, or {} when it is absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise QuickdraftError(f"Cannot read {path}: {exc}. Is the file complete?") from exc
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _hf_specials(root: Path, backend: _Backend, config: Mapping[str, Any]) -> Specials:
    """Special tokens from tokenizer_config.json/special_tokens_map.json; extra stop ids from
    generation_config.json and config.json."""
    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    special_map = _read_json(root / "special_tokens_map.json")
    strings: dict[str, str] = {}
    for name in names:
        content = _token_content(config.get(name, special_map.get(name)))
        if content is not None:
            strings[name] = content
    ids = {name: backend.token_to_id(text) for name, text in strings.items()}
    extra: set[int] = set()
    for cfg in (_read_json(root / "generation_config.json"), _read_json(root / "config.json")):
        value = cfg.get("eos_token_id")
        extra.update(
            int(v) for v in (value if isinstance(value, list) else [value]) if v is not None
        )
    return Specials(
        bos_id=ids.get("bos_token"),
        eos_id=ids.get("eos_token"),
        unk_id=ids.get("unk_token"),
        pad_id=ids.get("pad_token"),
        extra_eos_ids=frozenset(extra),
        add_bos=bool(config.get("add_bos_token", False)),
        add_eos=bool(config.get("add_eos_token", False)),
        strings={k: v for k, v in strings.items() if ids.get(k) is not None},
    )


def _with_observed_add_bos(backend: _Backend, specials: Specials) -> Specials:
    """Whether encode() really adds BOS: tokenizer.json's post-processor decides when the config
    is silent (Llama-3 adds it there), so ask the backend instead of trusting the flag."""
    ids = backend.encode("a", add_special_tokens=True).ids
    adds = specials.bos_id is not None and bool(ids) and ids[0] == specials.bos_id
    return dataclasses.replace(specials, add_bos=adds)


def _hf_chat_template(root: Path, config: Mapping[str, Any]) -> str | None:
    """``chat_template.jinja`` if present (transformers' newer layout), else the config's."""
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template else None
