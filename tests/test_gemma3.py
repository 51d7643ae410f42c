"""Gemma 3: logits equal transformers' (tiny random models from safetensors and from GGUF, and the
real Gemma-3-270M GGUF), sliding-window attention through every cache path (prefill, decode,
rollback, tree passes, speculative decoding), and the SentencePiece GGUF tokenizer against
transformers' tokenizer for the same file.

The tiny models are built so that every Gemma feature changes the result: windows shorter than
the texts, both layer types, two RoPE bases, query_pre_attn_scalar != head_dim, random norm
weights (a loader that forgot Gemma's "1 + w" or the GGUF's stored "+1" would be off by a
factor), linear RoPE scaling on the full layers and final-logit soft-capping in one case.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import (
    CONVERSATIONS,
    SAMPLES,
    assert_close,
    generate,
    model_pass,
    transformers_from_gguf,
)
from tiny import hf_to_gguf, load_reference, make_spm_gguf, make_tiny_hf_model, reference_logits

from quickdraft import zoo
from quickdraft.config import ModelConfig
from quickdraft.detokenizer import IncrementalDetokenizer
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.loading import gguf as gguf_io
from quickdraft.loading.gguf_file import GGUFFile
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.models.gemma3 import CausalLM as GemmaLM
from quickdraft.sampling import SamplingParams
from quickdraft.speculative.ngram import NGramDrafter
from quickdraft.tokenizer import Tokenizer

TEXT = "def fibonacci(n):\n    return the quick brown fox!"
LONG_TEXT = (
    "for i in range(10):\n    print(i, i * i)\nfor i in range(10):\n    print(i, i * i * i)\n"
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n"
    "The quick brown fox jumps over the lazy dog. Hello, world! How are you today?\n"
)
SLIDING, FULL = "sliding_attention", "full_attention"

# name -> config overrides on top of tiny.py's gemma3_text defaults (window 5, head_dim 32,
# query_pre_attn_scalar 24, RoPE bases 1e4 sliding / 1e6 full).
CASES: dict[str, dict[str, Any]] = {
    "gemma3": {"num_hidden_layers": 3, "layer_types": [SLIDING, FULL, SLIDING]},
    # llama.cpp's layout (every 6th layer global), tied head, the scale GGUF files imply.
    "gemma3-tied": {"num_hidden_layers": 7, "tie_word_embeddings": True, "query_pre_attn_scalar": 32},
    "gemma3-scaled": {
        "num_hidden_layers": 3,
        "layer_types": [FULL, SLIDING, FULL],
        "query_pre_attn_scalar": 32,
        "final_logit_softcapping": 3.0,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
        },
    },
}
# GGUF files carry no query_pre_attn_scalar (llama.cpp derives it from head_dim), so only the cases
# whose scalar equals head_dim can be converted faithfully.
GGUF_CASES = ["gemma3-tied", "gemma3-scaled"]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """One compute thread, as tests/test_spec.py: on a busy 2-core machine a second OpenMP
    thread makes passes many times slower (and the real model's timings erratic)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Tiny:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.loaded = load_model(str(folder), dtype="float32", max_context=256)
        self.reference = load_reference(folder)
        self.ids = self.loaded.tokenizer.encode(TEXT)
        self.expected = reference_logits(self.reference, self.ids)

    @property
    def model(self) -> GemmaLM:
        assert isinstance(self.loaded.model, GemmaLM)
        return self.loaded.model

    def full(self, ids: list[int] | None = None) -> torch.Tensor:
        return self.model(torch.tensor(self.ids if ids is None else ids), self.model.new_cache())[0]


_TINY: dict[str, Tiny] = {}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-gemma3")


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> Any:
    def get(name: str) -> Tiny:
        if name not in _TINY:
            _TINY[name] = Tiny(make_tiny_hf_model(tiny_dir, "gemma3_text", name=name, **CASES[name]))
        return _TINY[name]

    yield get
    _TINY.clear()


# ------------------------------------------------------------------------ tiny: vs transformers


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(tiny: Any, name: str) -> None:
    t = tiny(name)
    logits = t.full()
    assert logits.dtype == torch.float32 and logits.shape == (len(t.ids), t.loaded.config.vocab_size)
    assert_close(logits, t.expected)
    assert torch.equal(logits.argmax(-1), t.expected.argmax(-1))


def test_cases_exercise_what_they_claim(tiny: Any) -> None:
    cfg = tiny("gemma3").loaded.config
    assert cfg.model_type == "gemma3_text" and cfg.sliding_window == 5 < len(tiny("gemma3").ids)
    assert cfg.layer_types == (SLIDING, FULL, SLIDING)
    assert cfg.rope_local_theta == 10000.0 != cfg.rope_theta
    assert cfg.query_pre_attn_scalar == 24 != cfg.head_dim
    assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_attention_heads
    assert not cfg.tie_word_embeddings
    tied = tiny("gemma3-tied")
    assert tied.loaded.config.layer_types == (SLIDING,) * 5 + (FULL, SLIDING)
    assert tied.model.lm_head.weight.data_ptr() == tied.model.model.embed_tokens.weight.data_ptr()
    scaled = tiny("gemma3-scaled").loaded.config
    assert scaled.rope_scaling is not None and scaled.rope_scaling["rope_type"] == "linear"
    assert scaled.final_logit_softcapping == 3.0
    assert float(tiny("gemma3-scaled").expected.abs().max()) <= 3.0  # the cap is active


@pytest.mark.parametrize("change", ["window", "softcap", "norm offset"])
def test_each_feature_changes_the_logits(tiny: Any, change: str) -> None:
    """Switching one Gemma feature off moves the logits far: the cases really test them."""
    t = tiny("gemma3-scaled" if change == "softcap" else "gemma3")
    m = t.model
    saved_config = m.config
    saved_windows = [layer.self_attn.window for layer in m.model.layers]
    norm = m.model.layers[0].input_layernorm.weight
    try:
        if change == "window":
            assert any(saved_windows)
            for layer in m.model.layers:
                layer.self_attn.window = None
        elif change == "softcap":
            m.config = dataclasses.replace(saved_config, final_logit_softcapping=None)
        else:
            with torch.no_grad():
                norm.add_(1.0)  # what forgetting the GGUF's stored "+1" would do
        assert float((t.full() - t.expected).abs().max()) > 1e-2
    finally:
        m.config = saved_config
        for layer, window in zip(m.model.layers, saved_windows, strict=True):
            layer.self_attn.window = window
        if change == "norm offset":
            with torch.no_grad():
                norm.sub_(1.0)
    assert_close(t.full(), t.expected)


@pytest.mark.parametrize("name", GGUF_CASES)
def test_gguf_conversion_matches_transformers(tiny: Any, tiny_dir: Path, name: str) -> None:
    """Converted as llama.cpp does (norms stored as 1 + w, Gemma's tensor names, the window and
    layer pattern in metadata): the GGUF path gives transformers' logits too."""
    t = tiny(name)
    path = tiny_dir / f"{name}.gguf"
    if not path.exists():
        hf_to_gguf(t.folder, path)
    stored = {ti.name: ti for ti in GGUFFile(path).tensors}["blk.0.attn_norm.weight"]
    hf = t.reference.model.layers[0].input_layernorm.weight.detach().numpy()
    assert np.allclose(np.asarray(stored.data), hf + 1.0)  # the file really holds 1 + w
    loaded = load_model(str(path), dtype="float32", max_context=256)
    assert loaded.config.layer_types == t.loaded.config.layer_types
    assert loaded.config.tie_word_embeddings == t.loaded.config.tie_word_embeddings
    assert loaded.config.rope_scaling == (None if name != "gemma3-scaled" else {"rope_type": "linear", "factor": 4.0})
    logits, _ = loaded.model(torch.tensor(t.ids), loaded.model.new_cache())
    assert_close(logits, t.expected)


def test_block_formats_without_kernels_are_dequantized(
    tiny: Any, tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With quantized weights kept (dtype auto), formats the kernels compute on stay in blocks
    (here Q8_0, Q5_1 and BF16) and the others (TQ2_0) are dequantized to plain weights instead of
    failing, with one line per such type saying what it costs."""
    from quickdraft.loading.gguf import QuantTensor
    from quickdraft.quant.ggml import GGMLLinear, kernels_available

    t = tiny("gemma3-tied")
    wide = make_tiny_hf_model(tiny_dir, "gemma3_text", name="gemma3-256", seed=5, hidden_size=256,  # TQ2_0: 256 / block
                              **CASES["gemma3-tied"])
    path = hf_to_gguf(
        wide,
        tiny_dir / "mixed.gguf",
        qtypes={"attn_q.weight": "Q8_0", "attn_k.weight": "Q5_1", "ffn_up.weight": "BF16", "ffn_gate.weight": "TQ2_0"},
    )
    reader = gguf_io.open_gguf(path)
    cfg = gguf_io.config_from_metadata(gguf_io.metadata(reader), {ti.name for ti in reader.tensors})
    capsys.readouterr()
    weights = dict(gguf_io.iter_tensors(reader, cfg, keep_quantized=True))
    for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj"):
        assert isinstance(weights[f"model.layers.0.{name}.weight"], QuantTensor), name
    assert isinstance(weights["model.layers.0.mlp.gate_proj.weight"], torch.Tensor)
    note = [line for line in capsys.readouterr().err.splitlines() if "no native kernel" in line]
    assert len(note) == 1 and f"{cfg.num_hidden_layers} matrices of type TQ2_0" in note[0], note
    exact = load_model(str(path), dtype="float32", max_context=64)
    auto = load_model(str(path), max_context=64)
    layer = auto.model.model.layers[0]
    if kernels_available():  # else "auto" means bf16 dense weights for everything
        assert isinstance(layer.self_attn.q_proj, GGMLLinear)
        assert isinstance(layer.self_attn.k_proj, GGMLLinear) and isinstance(layer.mlp.up_proj, GGMLLinear)
        assert not isinstance(layer.mlp.gate_proj, GGMLLinear)
    ids = torch.tensor(t.ids)
    expected = exact.model(ids, exact.model.new_cache())[0]
    assert_close(auto.model(ids, auto.model.new_cache())[0], expected, rel=5e-2)


def test_generate_without_chat_template_completes_the_prompt(
    tiny: Any, tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`quickdraft generate` on a base model without a chat template (gemma-3-270m's GGUF has
    none) completes the prompt as --raw would, says so, and refuses --system."""
    from quickdraft.cli.main import main

    t = tiny("gemma3-tied")
    path = tiny_dir / "gemma3-tied.gguf"
    if not path.exists():
        hf_to_gguf(t.folder, path)
    args = ["generate", "--model", str(path), "--dtype", "float32", "--draft", "none", "-n", "6", "--threads", "1"]
    assert main([*args, "def fibonacci(n):"]) == 0
    out, err = capsys.readouterr()
    assert "no chat template" in err and "plain text" in err
    assert main([*args, "--raw", "def fibonacci(n):"]) == 0
    raw_out, raw_err = capsys.readouterr()
    assert out == raw_out and out.strip() and "no chat template" not in raw_err
    assert main([*args, "--system", "Be brief.", "hi"]) == 2
    assert "no chat template" in capsys.readouterr().err


# ------------------------------------------------------------------ tiny: cache paths and windows


def test_prefill_then_decode_equals_full_forward(tiny: Any) -> None:
    """Decoding one token at a time past the window (rows see exactly the last 5 slots) and long
    prefills (> 64 rows: the masked SDPA path) agree with one full pass and with transformers."""
    t = tiny("gemma3")
    ids = t.loaded.tokenizer.encode(LONG_TEXT)
    assert len(ids) > 64 + 8
    full = t.full(ids)
    assert_close(full, reference_logits(t.reference, ids))
    for split in (3, 70):
        cache = t.model.new_cache()
        parts = [t.model(torch.tensor(ids[:split]), cache)[0]]
        parts += [t.model(torch.tensor(ids[i : i + 1]), cache)[0] for i in range(split, len(ids))]
        assert cache.length == len(ids)
        assert_close(torch.cat(parts), full, rel=1e-5)


def test_rollback_past_the_window(tiny: Any) -> None:
    t = tiny("gemma3")
    full = t.full()
    ids = torch.tensor(t.ids)
    n = 9
    cache = t.model.new_cache()
    t.model(ids[:n], cache)
    t.model((ids[n:] + 17) % t.loaded.config.vocab_size, cache)  # wrong tokens, then roll back
    cache.truncate(n)
    assert_close(t.model(ids[n:], cache)[0], full[n:], rel=1e-5)


def test_tree_pass_matches_decoding_each_path(tiny: Any) -> None:
    """A tree pass (tree positions, each row sees the prefix + its ancestors, windowed by
    position) gives every node the logits plain decoding of its own path gives."""
    t = tiny("gemma3")
    prefix = t.ids[:8]
    # root r, children a, b; a's child c; c's child d  -> rows [r, a, b, c, d]
    tokens = [t.ids[8], 11, 12, 13, 14]
    parents = [-1, 0, 0, 1, 3]  # row index of each row's parent (-1: the root itself)
    depth = [0, 1, 1, 2, 3]
    n, start = len(tokens), len(prefix)
    mask = torch.zeros(n, start + n, dtype=torch.bool)
    mask[:, :start] = True
    for row in range(n):
        node = row
        while node != -1:
            mask[row, start + node] = True
            node = parents[node]
    cache = t.model.new_cache()
    t.model(torch.tensor(prefix), cache)
    positions = torch.tensor([start + d for d in depth])
    tree_logits, _ = model_pass(t.model, torch.tensor(tokens), cache, positions, mask)
    for row in range(n):
        path, node = [], row
        while node != -1:
            path.insert(0, tokens[node])
            node = parents[node]
        expected = t.full(prefix + path)[-1]
        assert torch.equal(tree_logits[row], expected), f"row {row}"


def test_rows_are_batch_invariant_with_windows(tiny: Any) -> None:
    """A verify pass of k+1 rows gives each row the bits a one-row decode gives (lossless greedy)."""
    t = tiny("gemma3")
    ids = torch.tensor(t.ids)
    n = 10
    cache = t.model.new_cache()
    t.model(ids[:n], cache)
    block, _ = t.model(ids[n:], cache)
    cache.truncate(n)
    single = torch.cat([t.model(ids[i : i + 1], cache)[0] for i in range(n, len(t.ids))])
    assert torch.equal(block, single)


@pytest.mark.parametrize("k", [2, 5])
def test_ngram_speculation_equals_plain_greedy(tiny: Any, k: int) -> None:
    t = tiny("gemma3-tied")
    prompt = t.loaded.tokenizer.encode(LONG_TEXT)[:40]
    plain = generate(t.loaded, prompt, max_tokens=40, ignore_eos=True).ids
    engine = Engine(t.loaded.model, t.loaded.tokenizer)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    steps = list(engine.generate(prompt, params, NGramDrafter(min_ngram=1), k))
    assert [tok for s in steps for tok in s.token_ids] == plain
    assert steps[-1].stats.drafted > 0


# ---------------------------------------------------------------------------- config parsing


def _hf_dict(**overrides: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "model_type": "gemma3_text",
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
    }
    d.update(overrides)
    return d


def test_older_flat_hf_config_is_read_like_transformers() -> None:
    """Hub configs written before transformers 5: rope_theta / rope_scaling (full layers),
    rope_local_base_freq, sliding_window_pattern instead of layer_types; Gemma defaults."""
    cfg = ModelConfig.from_hf_dict(
        _hf_dict(
            rope_theta=1e6,
            rope_local_base_freq=1e4,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            sliding_window=512,
            sliding_window_pattern=4,
        )
    )
    assert cfg.layer_types == (SLIDING, SLIDING, SLIDING, FULL) * 2
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.sliding_window) == (1e6, 1e4, 512)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["factor"] == 8.0
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.query_pre_attn_scalar == 256
    bare = ModelConfig.from_hf_dict(_hf_dict())
    assert bare.layer_types == (SLIDING,) * 5 + (FULL, SLIDING, SLIDING)
    assert (bare.rope_theta, bare.rope_local_theta, bare.sliding_window) == (1e6, 1e4, 4096)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"attn_logit_softcapping": 50.0}, "soft-capping"),
        ({"use_bidirectional_attention": True}, "bidirectional"),
        ({"hidden_activation": "relu"}, "hidden_activation"),
        ({"layer_types": [SLIDING, "chunked_attention"] * 4}, "layer_types"),
    ],
)
def test_unsupported_gemma_configs_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(QuickdraftError, match=message):
        ModelConfig.from_hf_dict(_hf_dict(**overrides))


def test_gguf_metadata_conventions() -> None:
    """llama.cpp's conventions for gemma3 files: pattern 6 unless listed, local base 10000,
    1/sqrt(head_dim) scores except the 62-layer 27B model (hidden / heads)."""
    meta = {
        "general.architecture": "gemma3",
        "gemma3.embedding_length": 5376,
        "gemma3.feed_forward_length": 21504,
        "gemma3.block_count": 62,
        "gemma3.attention.head_count": 32,
        "gemma3.attention.head_count_kv": 16,
        "gemma3.attention.key_length": 128,
        "gemma3.attention.sliding_window": 1024,
        "gemma3.rope.freq_base": 1e6,
        "gemma3.rope.scaling.type": "linear",
        "gemma3.rope.scaling.factor": 8.0,
        "tokenizer.ggml.tokens": ["a"] * 10,
    }
    cfg = gguf_io.config_from_metadata(meta, {"token_embd.weight"})
    assert cfg.model_type == "gemma3_text" and cfg.tie_word_embeddings
    assert cfg.query_pre_attn_scalar == 168  # 5376 / 32, not head_dim
    assert cfg.layer_types is not None and cfg.layer_types[:6] == (SLIDING,) * 5 + (FULL,)
    assert cfg.rope_local_theta == 10000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    small = dict(meta, **{"gemma3.block_count": 4, "gemma3.attention.sliding_window_pattern": [True, False, False, True]})
    cfg = gguf_io.config_from_metadata(small, {"token_embd.weight"})
    assert cfg.query_pre_attn_scalar == 128
    assert cfg.layer_types == (SLIDING, FULL, FULL, SLIDING)


# ------------------------------------------------------ SentencePiece GGUF tokenizers (tiny)


@pytest.mark.parametrize("arch", ["gemma3", "llama", "phi3"])
def test_sentencepiece_gguf_tokenizer_matches_transformers(tmp_path: Path, arch: str) -> None:
    """The three SentencePiece flavours (Gemma; Llama-2 style with a Metaspace prefix; Phi-3 with
    a prefix normalizer) give transformers' ids for the same GGUF, byte fallback, whitespace runs,
    ranked-tie merges and added tokens included, and decode back the same text."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    path = make_spm_gguf(tmp_path / f"{arch}.gguf", arch)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = Tokenizer.from_gguf(path)
    assert ours.add_bos and ours.bos_id == 1  # the file has no add_bos flag: SentencePiece adds BOS
    texts = [*SAMPLES, "<start_of_turn>x <think>y  z\n\n", " lead", "a  b", "\u2581literal"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids) == ref.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text
    assert any(3 <= i < 3 + 256 for i in ours.encode(SAMPLES[4]))  # byte-fallback tokens used
    for text in texts:  # streaming one token at a time joins up to the full decode
        ids = ours.encode(text, add_special_tokens=False)
        stream = IncrementalDetokenizer(ours, skip_special_tokens=False)
        pieces = [stream.push([i]) for i in ids] + [stream.flush()]
        assert "".join(pieces) == ours.decode(ids), text


# --------------------------------------------------------------------------- real Gemma-3-270M

PROMPT = "The history of the Roman Empire begins with"
GEMMA_SAMPLES = [
    *SAMPLES,
    "tabs\tand\t\ttabs and    four spaces and\n    indented\n\t\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n<table><tr><td>x</td></tr>",
    "bytes: \x00\x07\x1b[0m \u200b\u2028 𐎀𐎁 \U0001f9d1\u200d\U0001f4bb",
    "import numpy as np\nx = np.arange(10_000).reshape(100, -1)  # 1e4 items\nprint(f'{x.sum():,}')\n",
    "  two leading, three trailing   \n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n",
]

# Gemma 3's chat template (google/gemma-3-*-it): the 270M base GGUF ships none.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    return zoo.fetch("gemma-3-270m", progress=False)


@pytest.fixture(scope="module")
def gemma32(gemma_gguf: Path) -> LoadedModel:
    """The fp32 reference mode (dequantized weights)."""
    return load_model(str(gemma_gguf), dtype="float32", max_context=256)


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma32: LoadedModel) -> Tokenizer:
    return gemma32.tokenizer  # built from the GGUF's metadata by load_model


@pytest.fixture(scope="module")
def gemma_ref_tokenizer(gemma_gguf: Path) -> Any:
    """transformers' tokenizer for the GGUF: the class AutoTokenizer picks for gemma3 GGUFs,
    called directly because AutoTokenizer first rebuilds the model config with GGUFReader (~30 s
    for this vocabulary) only to learn that class."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GemmaTokenizer

    return GemmaTokenizer.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name)


@pytest.mark.slow
def test_gemma_270m_logits_match_transformers(gemma_gguf: Path, gemma32: LoadedModel, tmp_path: Path) -> None:
    ids = gemma32.tokenizer.encode(PROMPT)
    assert ids[0] == gemma32.tokenizer.bos_id == 2
    assert gemma32.config.layer_types is not None and gemma32.config.layer_types.count(FULL) == 3
    logits, _ = gemma32.model(torch.tensor(ids), gemma32.model.new_cache())
    expected = reference_logits(transformers_from_gguf(gemma_gguf, tmp_path), ids)
    diff = float((logits - expected).abs().max())
    assert diff < 1e-3, f"max abs diff {diff:.3g}"
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.slow
def test_gemma_270m_quantized_greedy_ngram_equals_plain(gemma_gguf: Path) -> None:
    """The shipped default (dtype auto: quantized weights) generates, and n-gram speculation is
    token-identical to plain greedy decoding on it."""
    loaded = load_model(str(gemma_gguf), max_context=256)
    ids = loaded.tokenizer.encode("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n")
    plain = generate(loaded, ids, max_tokens=24, ignore_eos=True).ids
    assert len(plain) == 24 and "return" in loaded.tokenizer.decode(plain)
    assert generate(loaded, ids, NGramDrafter(min_ngram=1), 4, max_tokens=24, ignore_eos=True).ids == plain


@pytest.mark.slow
def test_gemma_270m_token_ids_match_transformers(gemma_tokenizer: Tokenizer, gemma_ref_tokenizer: Any) -> None:
    ref = gemma_ref_tokenizer
    for text in GEMMA_SAMPLES:
        assert gemma_tokenizer.encode(text) == ref(text)["input_ids"], text
        plain = gemma_tokenizer.encode(text, add_special_tokens=False)
        assert plain == ref.encode(text, add_special_tokens=False), text
        for skip in (False, True):
            assert gemma_tokenizer.decode(plain, skip_special_tokens=skip) == ref.decode(plain, skip_special_tokens=skip), text
    assert gemma_tokenizer.decode(gemma_tokenizer.encode(GEMMA_SAMPLES[2], add_special_tokens=False)) == GEMMA_SAMPLES[2]
    assert gemma_tokenizer.eos_ids == {1, 106}  # <eos> and <end_of_turn>


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_gemma_chat_template_matches_transformers(
    gemma_tokenizer: Tokenizer, gemma_ref_tokenizer: Any, name: str
) -> None:
    """The template rendered through our jinja environment and encoded (BOS written by the
    template, not added twice) equals transformers' apply_chat_template."""
    messages = CONVERSATIONS[name]
    ours, ref = copy.copy(gemma_tokenizer), copy.copy(gemma_ref_tokenizer)
    ours.chat_template = ref.chat_template = GEMMA3_TEMPLATE
    for gen in (True, False):
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected
    expected_ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(expected_ids, list):
        expected_ids = expected_ids["input_ids"]
    ids = ours.encode_chat(messages)
    assert ids == list(expected_ids) and ids.count(2) == 1  # the template's BOS, not a second one
