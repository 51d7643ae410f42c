"""Text <-> token ids, chat templates and streaming detokenization.

A GGUF file carries no ``tokenizer.json``; it stores the vocabulary, merges and special token ids
as metadata under llama.cpp's key names. We rebuild a fast ``tokenizers`` tokenizer from those the
same way transformers does (``transformers/integrations/gguf``), so that a prompt becomes exactly the
ids transformers would feed the model: any difference would change what the model sees and make
our outputs incomparable with the reference. Hugging Face directories are loaded from their own
``tokenizer.json``.

Chat templates are rendered with jinja2 configured like transformers' ``apply_chat_template``
(sandboxed, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, its ``tojson``...), since the
templates shipped with models are written against that environment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend
from tokenizers.models import BPE

from quickdraft.errors import QuickdraftError
from quickdraft.loading.gguf_file import GGUFHeader

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
class _Specials:
    """Special token ids and strings, gathered once from whichever source the tokenizer came from."""

    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    extra_eos_ids: frozenset[int] = frozenset()
    add_bos: bool = False
    add_eos: bool = False
    strings: Mapping[str, str] = field(default_factory=dict)


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
        specials: _Specials,
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
        return cls.from_gguf_metadata(_read_gguf_metadata(Path(path)))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (key -> value, as ``GGUFReader`` field ``contents()`` gives)."""
        model = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if model is None or not tokens:
            raise QuickdraftError(
                "This GGUF file has no tokenizer (tokenizer.ggml.model/tokens are missing); "
                "convert the model again with llama.cpp's convert_hf_to_gguf.py, which embeds it."
            )
        if model not in ("gpt2", "llama"):
            raise QuickdraftError(
                f"Tokenizer type {model!r} in this GGUF file is not supported (only 'gpt2', the "
                "byte-level BPE of Llama-3, Qwen, SmolLM... models, and 'llama', the SentencePiece "
                "BPE of Gemma, Llama-2, Mistral, Phi-3... models). Use the model's Hugging Face "
                "directory with its tokenizer.json instead."
            )
        tokens = [str(t) for t in tokens]
        token_types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or ()]
        merges: list[str] | None = None
        if model == "gpt2":
            backend, pairs = _byte_level_backend(meta, tokens, token_types)
            merges = [" ".join(p) for p in pairs]
        else:
            backend = _sentencepiece_backend(meta, tokens, token_types)
        # llama.cpp (and transformers) add BOS to a SentencePiece vocabulary that does not say.
        specials = _gguf_specials(meta, tokens, token_types, add_bos_default=model == "llama")
        _set_post_processor(backend, specials)
        unused = frozenset(
            i
            for i, token in enumerate(tokens)
            if (i < len(token_types) and token_types[i] == _UNUSED) or _PAD_PLACEHOLDER.match(token)
        )
        template = meta.get("tokenizer.chat_template")
        tok = cls(backend, specials, str(template) if template else None, len(tokens), unused)
        tok._merges = merges
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
            _set_post_processor(backend, specials)
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
        specials = _Specials(**{**sp, "extra_eos_ids": frozenset(sp["extra_eos_ids"])})
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


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text pieces, never splitting a UTF-8 character.

    Decoding each token alone is wrong: a character can span several byte-level tokens, and
    sentencepiece-style decoders treat a leading space differently at the start of a text. So
    each push decodes a short window that starts one emitted chunk back and returns only what
    lies past the text already handed out; if the window ends in U+FFFD (an incomplete
    character) the text is held back until the next push or :meth:`flush`. The pieces joined
    equal ``tokenizer.decode(all_ids, skip_special_tokens)``.

    ``prompt_ids`` are accepted for callers that have them but do not change the text: the
    stream is defined as the decode of the generated ids alone (what transformers' streamers
    print with ``skip_prompt=True``).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.prompt_len = len(prompt_ids)
        self._ids: list[int] = []
        self._prefix = 0  # window start: one chunk before the first unread id
        self._read = 0  # ids before this have had their text handed out
        self._prefix_text = ""  # decode of ids[_prefix:_read]

    @property
    def ids(self) -> list[int]:
        """Every id pushed so far."""
        return list(self._ids)

    def push(self, ids: Sequence[int]) -> str:
        """Add generated ids; return the new text that is safe to show now (maybe "")."""
        self._ids.extend(int(i) for i in ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Return whatever was held back (at the end of generation), even an incomplete char."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        window = self._decode(self._prefix, len(self._ids))
        if not final and window.endswith("\ufffd"):
            return ""
        new_text = window[len(self._prefix_text) :]
        if final:  # a later push starts afresh instead of rewriting a flushed U+FFFD
            self._prefix = self._read = len(self._ids)
            self._prefix_text = ""
        else:
            self._prefix, self._read = self._read, len(self._ids)
            self._prefix_text = self._decode(self._prefix, self._read)
        return new_text

    def _decode(self, start: int, stop: int) -> str:
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip)


# ------------------------------------------------------------------------------ chat templates


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    **variables: Any,
) -> str:
    """Render a chat template the way transformers' ``apply_chat_template(tokenize=False)`` does.

    ``variables`` are what transformers passes besides the messages: the special token strings
    (``bos_token``, ``eos_token``...) and any extra template arguments; ``tools`` and
    ``documents`` default to None.
    """
    if not messages:
        raise QuickdraftError("Cannot format an empty conversation; give at least one message.")
    compiled = _compile_template(template)
    tools = variables.pop("tools", None)
    documents = variables.pop("documents", None)
    try:
        return str(
            compiled.render(
                messages=_template_messages(messages),
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **_plain(variables),
            )
        )
    except QuickdraftError:
        raise
    except Exception as exc:  # any failure inside a template is caused by template or messages
        raise QuickdraftError(
            f"The model's chat template could not format these messages: {exc}. Check the roles "
            "and their order (many templates require user/assistant turns to alternate)."
        ) from exc


@lru_cache(maxsize=16)
def _compile_template(template: str) -> Any:
    """Compile once per template; the environment mirrors transformers' sandboxed one."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_generation_extension(), jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _safe_namespace_class()
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise QuickdraftError(
            f"The model's chat template is not valid jinja (line {exc.lineno}: {exc.message}); "
            "fix the template or use a plain text prompt."
        ) from exc


def _generation_extension() -> Any:
    """transformers' ``{% generation %}`` block tag, rendered as its plain body."""
    import jinja2.nodes
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    return GenerationBlock


def _safe_namespace_class() -> type:
    """``namespace`` that refuses underscore names, like transformers' (a sandbox hardening)."""
    import jinja2.exceptions
    import jinja2.utils

    def check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes, got {name!r}."
            )

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return TemplateNamespace


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters; templates expect plain JSON (as transformers).
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    import jinja2.exceptions

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _template_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to templates: plain data, no None values, and
    reasoning available under both ``thinking`` and ``reasoning_content``."""
    result = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise QuickdraftError(
                f"Chat messages must be dicts with role and content, got {message!r}."
            )
        plain = {k: _plain(v) for k, v in message.items() if v is not None}
        reasoning = next((plain[k] for k in _REASONING_FIELDS if plain.get(k) is not None), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        result.append(plain)
    return result


def _plain(value: Any) -> Any:
    """Rebuild ``value`` from JSON types only, so the sandbox never sees rich objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


# ----------------------------------------------------------------------------- GGUF building


def _read_gguf_metadata(path: Path) -> dict[str, Any]:
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
    """SentencePiece BPE ("llama" in GGUF) as transformers' GGUF converter builds it.

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
) -> _Specials:
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
    return _Specials(
        bos_id=ids["bos_token"],
        eos_id=ids["eos_token"],
        unk_id=ids["unk_token"],
        pad_id=ids["pad_token"],
        extra_eos_ids=frozenset(extra),
        add_bos=add_bos,
        add_eos=add_eos,
        strings={name: tokens[i] for name, i in ids.items() if i is not None},
    )


def _set_post_processor(backend: _Backend, specials: _Specials) -> None:
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


def _eos_ids(backend: _Backend, specials: _Specials) -> frozenset[int]:
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


def _hf_specials(root: Path, backend: _Backend, config: Mapping[str, Any]) -> _Specials:
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
    return _Specials(
        bos_id=ids.get("bos_token"),
        eos_id=ids.get("eos_token"),
        unk_id=ids.get("unk_token"),
        pad_id=ids.get("pad_token"),
        extra_eos_ids=frozenset(extra),
        add_bos=bool(config.get("add_bos_token", False)),
        add_eos=bool(config.get("add_eos_token", False)),
        strings={k: v for k, v in strings.items() if ids.get(k) is not None},
    )


def _with_observed_add_bos(backend: _Backend, specials: _Specials) -> _Specials:
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
