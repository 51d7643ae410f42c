"""Tokenizer tests: ids and chat text identical to transformers' GGUF tokenizer, streaming
detokenization, special tokens, fingerprints and the user-facing errors."""

from __future__ import annotations

import json
import os
import random
import struct
from pathlib import Path
from typing import Any

import pytest
from helpers import CONVERSATIONS, SAMPLES

from quickdraft.detokenizer import IncrementalDetokenizer
from quickdraft.errors import QuickdraftError
from quickdraft.tokenizer import Tokenizer

STREAM_TEXTS = [
    "Hello 世界! 😀🎉 café — naïve 👍🏽\n日本語のテキストです。",
    "def f():\n    return '✓ 🐍 λ'  # 注释\n",
    "🇫🇷🇯🇵 👨‍👩‍👧‍👦 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 한국어 العربية",
]

# Loading transformers' Qwen tokenizer takes ~11 s, so tests comparing with it are slow;
# tests of our tokenizer alone load in well under a second and run for both models.
MODELS = ["smollm2", pytest.param("qwen05", marks=pytest.mark.slow)]
ALL_MODELS = ["smollm2", "qwen05"]


@pytest.fixture(scope="module")
def gguf_path(request: pytest.FixtureRequest) -> Path:
    """The GGUF of the model named by the test's parameter."""
    return Path(request.getfixturevalue(f"{request.param}_gguf"))


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def ref(gguf_path: Path) -> Any:
    """transformers' tokenizer for the same GGUF: the reference our ids must equal."""
    pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _tiny_meta(**overrides: Any) -> dict[str, Any]:
    """A hand-made byte-level GGUF tokenizer: a few letters, two merges, two control tokens."""
    tokens = ["<s>", "</s>", "a", "b", "Ġ", "ab", "Ġab", "<think>"]
    meta: dict[str, Any] = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 1, 1, 1, 1, 1, 4],
        "tokenizer.ggml.merges": ["a b", "Ġ ab"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }
    meta.update(overrides)
    return meta


# ------------------------------------------------------------------ parity with transformers


@pytest.mark.parametrize("gguf_path", MODELS, indirect=True)
def test_ids_match_transformers(ours: Tokenizer, ref: Any) -> None:
    for text in SAMPLES:
        assert ours.encode(text) == ref(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False
        ), text


@pytest.mark.parametrize("gguf_path", MODELS, indirect=True)
def test_decode_round_trips_and_matches_transformers(ours: Tokenizer, ref: Any) -> None:
    for text in SAMPLES:
        ids = ours.encode(text)
        assert ours.decode(ids) == text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip
            ), text


@pytest.mark.parametrize("gguf_path", MODELS, indirect=True)
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_matches_transformers(ours: Tokenizer, ref: Any, name: str) -> None:
    messages = CONVERSATIONS[name]
    for gen in (True, False):
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected
    expected_ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(expected_ids, list):
        expected_ids = expected_ids["input_ids"]
    assert ours.encode_chat(messages) == list(expected_ids)


@pytest.mark.slow
@pytest.mark.parametrize("gguf_path", ["qwen05"], indirect=True)
def test_chat_template_with_tools_matches_transformers(ours: Tokenizer, ref: Any) -> None:
    """Qwen's template serializes tools with ``tojson``; ours must print them identically."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city <b>now</b> & later",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = CONVERSATIONS["single"]
    expected = ref.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(messages, tools=tools) == expected


@pytest.mark.parametrize("gguf_path", ALL_MODELS, indirect=True)
def test_special_tokens(ours: Tokenizer) -> None:
    im_end = ours.token_to_id("<|im_end|>")
    assert im_end is not None and im_end in ours.eos_ids
    assert ours.id_to_token(im_end) == "<|im_end|>"
    assert ours.id_to_token(ours.vocab_size + 10) is None
    assert ours.encode("<|im_end|>", add_special_tokens=False) == [im_end]
    assert ours.decode([im_end], skip_special_tokens=True) == ""
    assert not ours.add_bos  # both models' GGUFs say add_bos_token = false
    assert ours.encode("hi") == ours.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("gguf_path", ["smollm2"], indirect=True)
def test_fast_metadata_reader_matches_gguf_reader(gguf_path: Path) -> None:
    import gguf

    from quickdraft.gguf_vocab import read_gguf_metadata

    reader = gguf.GGUFReader(str(gguf_path))
    expected = {
        k: f.contents()
        for k, f in reader.fields.items()
        if k.startswith(("tokenizer.", "general."))
    }
    assert read_gguf_metadata(gguf_path) == expected


# ------------------------------------------------------------------ incremental detokenizing


@pytest.mark.parametrize("gguf_path", ALL_MODELS, indirect=True)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_detokenizer_equals_full_decode(ours: Tokenizer, chunk: int) -> None:
    held_back = False
    for text in STREAM_TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        held_back |= any("\ufffd" in ours.decode([i]) for i in ids)
        detok = IncrementalDetokenizer(ours, prompt_ids=ours.encode("Say:"))
        pieces = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
        pieces.append(detok.flush())
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == ours.decode(ids, skip_special_tokens=True) == text
    assert held_back, "the texts should contain characters split across tokens"


@pytest.mark.parametrize("gguf_path", ALL_MODELS, indirect=True)
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer_with_special_tokens(ours: Tokenizer, skip: bool) -> None:
    ids = ours.encode("Sure 😀 done<|im_end|><|im_start|>x", add_special_tokens=False)
    detok = IncrementalDetokenizer(ours, skip_special_tokens=skip)
    text = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert text == ours.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("gguf_path", ALL_MODELS, indirect=True)
def test_incremental_detokenizer_holds_then_flushes_partial_char(ours: Tokenizer) -> None:
    ids = ours.encode("é𓀀𓁐", add_special_tokens=False)
    partial = next(n for n in range(1, len(ids) + 1) if ours.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(ours)
    shown = "".join(detok.push([i]) for i in ids[:partial])
    assert "\ufffd" not in shown
    assert shown + detok.flush() == ours.decode(ids[:partial])
    assert detok.flush() == ""
    assert detok.push([]) == ""
    assert detok.push(ours.encode(" ok", add_special_tokens=False)) == " ok"


@pytest.mark.parametrize("gguf_path", ALL_MODELS, indirect=True)
def test_incremental_detokenizer_on_random_broken_streams(ours: Tokenizer) -> None:
    """Random ids, many of them partial UTF-8 bytes, pushed in random chunks: the pieces must
    still join to exactly the full decode, invalid bytes (U+FFFD) included."""
    rng = random.Random(1234)
    partial = [i for i in range(5000) if "\ufffd" in ours.decode([i])]
    assert partial
    for _ in range(200):
        ids = [
            rng.choice(partial) if rng.random() < 0.6 else rng.randrange(ours.vocab_size)
            for _ in range(rng.randrange(1, 25))
        ]
        for skip in (True, False):
            detok = IncrementalDetokenizer(ours, skip_special_tokens=skip)
            pieces, i = [], 0
            while i < len(ids):
                step = rng.randrange(1, 4)
                pieces.append(detok.push(ids[i : i + step]))
                i += step
            pieces.append(detok.flush())
            assert "".join(pieces) == ours.decode(ids, skip_special_tokens=skip)


# -------------------------------------------------------------------------- synthetic vocab


def test_tiny_tokenizer_encodes_with_merges_and_added_tokens() -> None:
    tok = Tokenizer.from_gguf_metadata(_tiny_meta())
    assert tok.vocab_size == 8
    assert tok.encode("ab ab") == [5, 6]
    assert tok.encode("<think>ab</s>") == [7, 5, 1]
    assert tok.decode([7, 5, 1], skip_special_tokens=True) == "<think>ab"
    assert tok.bos_id == 0 and tok.eos_ids == frozenset({1}) and tok.pad_id is None


def test_add_bos_token_is_honoured_and_not_doubled_in_chat() -> None:
    tok = Tokenizer.from_gguf_metadata(_tiny_meta(**{"tokenizer.ggml.add_bos_token": True}))
    assert tok.encode("ab") == [0, 5]
    assert tok.encode("ab", add_special_tokens=False) == [5]
    assert tok.encode_chat([{"role": "user", "content": "ab"}]) == [0, 5]
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok = Tokenizer.from_gguf_metadata(
        _tiny_meta(**{"tokenizer.ggml.add_bos_token": True, "tokenizer.chat_template": template})
    )
    assert tok.apply_chat_template([{"role": "user", "content": "ab"}]) == "<s>ab"
    assert tok.encode_chat([{"role": "user", "content": "ab"}]) == [0, 5]


@pytest.mark.parametrize(
    "pre", ["gpt-2", "smollm", "llama-bpe", "qwen2", "qwen35", "tekken", "gpt-4o"]
)
def test_pre_tokenizers_split_like_transformers(pre: str) -> None:
    """Every byte plus a few merges, split by each known ``pre``: same ids as transformers'
    GGUF converter fed the same metadata."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # <|endoftext|> is in the vocab because transformers adds it (a new id) when it is not.
    tokens = ["<|endoftext|>", *bytes_to_unicode().values(), "Ġt", "he", "Ġthe", "ĠĠ", "ĠĠĠĠ"]
    merges = ["Ġ t", "h e", "Ġt he", "Ġ Ġ", "ĠĠ ĠĠ"]
    types = [3] + [1] * (len(tokens) - 1)
    meta = _tiny_meta(
        **{
            "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges,
        }
    )
    spec = {"tokenizer_type": "gpt2", "pre_tokenizer_type": pre, "tokens": tokens}
    spec.update(token_type=types, merges=merges)
    expected, _ = mapping.convert_gguf_tokenizer("llama", spec)
    ours = Tokenizer.from_gguf_metadata(meta)
    for text in SAMPLES:
        assert ours.encode(text) == expected.encode(text).ids, text


def test_unknown_pre_tokenizer_is_named_in_the_error() -> None:
    with pytest.raises(QuickdraftError, match="made-up-pre"):
        Tokenizer.from_gguf_metadata(_tiny_meta(**{"tokenizer.ggml.pre": "made-up-pre"}))


@pytest.mark.parametrize("model", ["llama", "bert"])
def test_unsupported_model_and_missing_vocab_raise(model: str) -> None:
    with pytest.raises(QuickdraftError, match=f"'{model}'"):
        Tokenizer.from_gguf_metadata(_tiny_meta(**{"tokenizer.ggml.model": model}))
    with pytest.raises(QuickdraftError, match="no tokenizer"):
        Tokenizer.from_gguf_metadata({"general.architecture": "llama"})


def test_fingerprint_ignores_padding_but_not_merges() -> None:
    base = Tokenizer.from_gguf_metadata(_tiny_meta())
    meta = _tiny_meta()
    padded = Tokenizer.from_gguf_metadata(
        _tiny_meta(
            **{
                "tokenizer.ggml.tokens": [*meta["tokenizer.ggml.tokens"], "[PAD8]", "[PAD9]"],
                "tokenizer.ggml.token_type": [*meta["tokenizer.ggml.token_type"], 5, 5],
            }
        )
    )
    other = Tokenizer.from_gguf_metadata(_tiny_meta(**{"tokenizer.ggml.merges": ["a b"]}))
    for tok in (base, padded, other):  # the merges kept at build time hash as the backend's own
        slow = Tokenizer.from_gguf_metadata(_tiny_meta())
        slow._backend, slow._unused_ids, slow._merges = tok._backend, tok._unused_ids, None
        assert slow.fingerprint() == tok.fingerprint()
    assert padded.vocab_size == 10
    assert (
        padded.fingerprint()
        == base.fingerprint()
        == Tokenizer.from_gguf_metadata(meta).fingerprint()
    )
    assert other.fingerprint() != base.fingerprint()


def test_chat_template_errors_are_user_errors() -> None:
    tok = Tokenizer.from_gguf_metadata(_tiny_meta(**{"tokenizer.chat_template": None}))
    assert tok.chat_template is None
    with pytest.raises(QuickdraftError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    raising = "{{ raise_exception('roles must alternate') }}"
    tok = Tokenizer.from_gguf_metadata(_tiny_meta(**{"tokenizer.chat_template": raising}))
    with pytest.raises(QuickdraftError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    broken = "{% for m in messages %}"
    tok = Tokenizer.from_gguf_metadata(_tiny_meta(**{"tokenizer.chat_template": broken}))
    with pytest.raises(QuickdraftError, match="not valid jinja"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(QuickdraftError, match="empty conversation"):
        Tokenizer.from_gguf_metadata(_tiny_meta()).apply_chat_template([])


def test_template_environment_matches_transformers_helpers() -> None:
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% if loop.index > 5 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
        "{{ ns.n }}{{ tools }}{{ strftime_now('%Y') | length }}{{ bos_token }}{{ eos_token }}"
    )
    tok = Tokenizer.from_gguf_metadata(_tiny_meta(**{"tokenizer.chat_template": template}))
    text = tok.apply_chat_template([{"role": "user", "content": "<é>", "name": None}])
    assert text == '{"role": "user", "content": "<é>"}1None4<s></s>'


# ---------------------------------------------------------------------------- files on disk


def test_from_hf_dir_matches_gguf_built_tokenizer(tmp_path: Path) -> None:
    gguf_built = Tokenizer.from_gguf_metadata(_tiny_meta())
    gguf_built.backend.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text(gguf_built.chat_template or "")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.encode("ab ab<think>") == gguf_built.encode("ab ab<think>")
    assert tok.fingerprint() == gguf_built.fingerprint()
    assert tok.bos_id == 0 and tok.eos_ids == frozenset({1, 7})
    messages = [{"role": "user", "content": "ab"}]
    assert tok.apply_chat_template(messages) == gguf_built.apply_chat_template(messages)


def test_missing_files_raise_user_errors(tmp_path: Path) -> None:
    with pytest.raises(QuickdraftError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(QuickdraftError, match="not found"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(QuickdraftError, match="not a readable GGUF"):
        Tokenizer.from_gguf(bogus)
    # GGUF v3 header whose first key claims to be 2**62 bytes long.
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1 << 62))
    with pytest.raises(QuickdraftError, match="not a readable GGUF"):
        Tokenizer.from_gguf(damaged)
