"""Phi-3: logits equal transformers' on tiny random models (fused qkv / gate_up weights, partial
rotary, an all-layer sliding window shorter than the text, LongRoPE, tied embeddings), from
safetensors and from GGUF, through the cache paths and speculative decoding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_close
from tiny import hf_to_gguf, load_reference, make_tiny_hf_model, reference_logits

from quickdraft.config import ModelConfig
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.loading import gguf as gguf_io
from quickdraft.loading.load import load_model
from quickdraft.models.phi3 import CausalLM as Phi3LM
from quickdraft.sampling import SamplingParams
from quickdraft.speculative.ngram import NGramDrafter

TEXT = "def fibonacci(n):\n    return the quick brown fox! and the lazy dog jumps over"
SHORT = [1.0 + 0.3 * i for i in range(8)]  # head_dim 16: 8 frequencies
LONG = [2.0 + i for i in range(8)]

CASES: dict[str, dict[str, Any]] = {
    "phi3": {},
    "phi3-partial-window": {"partial_rotary_factor": 0.5, "sliding_window": 6, "num_hidden_layers": 3},
    "phi3-tied-mha": {"tie_word_embeddings": True, "num_key_value_heads": 4},
    "phi3-longrope": {
        "rope_scaling": {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG},
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 512,
    },
}
GGUF_CASES = ["phi3", "phi3-partial-window", "phi3-tied-mha"]


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """One compute thread, as tests/test_spec.py: tiny passes on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Tiny:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.loaded = load_model(str(folder), dtype="float32")
        self.reference = load_reference(folder)
        self.ids = self.loaded.tokenizer.encode(TEXT)
        self.expected = reference_logits(self.reference, self.ids)

    @property
    def model(self) -> Phi3LM:
        assert isinstance(self.loaded.model, Phi3LM)
        return self.loaded.model

    def full(self) -> torch.Tensor:
        return self.model(torch.tensor(self.ids), self.model.new_cache())[0]


_TINY: dict[str, Tiny] = {}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-phi3")


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> Any:
    def get(name: str) -> Tiny:
        if name not in _TINY:
            _TINY[name] = Tiny(make_tiny_hf_model(tiny_dir, "phi3", name=name, **CASES[name]))
        return _TINY[name]

    yield get
    _TINY.clear()


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(tiny: Any, name: str) -> None:
    t = tiny(name)
    logits = t.full()
    assert_close(logits, t.expected)
    assert torch.equal(logits.argmax(-1), t.expected.argmax(-1))


def test_cases_exercise_what_they_claim(tiny: Any) -> None:
    plain = tiny("phi3")
    assert "model.layers.0.self_attn.qkv_proj.weight" in dict(plain.model.named_parameters())
    assert "model.layers.0.mlp.gate_up_proj.weight" in dict(plain.model.named_parameters())
    partial = tiny("phi3-partial-window").loaded.config
    assert partial.partial_rotary_factor == 0.5
    assert partial.sliding_window == 6 < len(plain.ids) and partial.layer_types == ("sliding_attention",) * 3
    tied = tiny("phi3-tied-mha")
    assert tied.model.lm_head.weight.data_ptr() == tied.model.model.embed_tokens.weight.data_ptr()
    longrope = tiny("phi3-longrope").loaded.config
    assert longrope.rope_scaling is not None and longrope.rope_scaling["rope_type"] == "longrope"
    assert longrope.rope_scaling["attention_factor"] == pytest.approx((1 + 2.0794415 / 6.2383246) ** 0.5)


@pytest.mark.parametrize("name, field", [("phi3-longrope", "rope"), ("phi3-partial-window", "window")])
def test_features_change_the_logits(tiny: Any, name: str, field: str) -> None:
    """Without LongRoPE's factors, or without the window, the same weights give other logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    t = tiny(name)
    config = AutoConfig.from_pretrained(str(t.folder))
    if field == "rope":
        config.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}
    else:
        config.sliding_window = None
    other = AutoModelForCausalLM.from_pretrained(str(t.folder), config=config, dtype=torch.float32)
    assert float((reference_logits(other.eval(), t.ids) - t.expected).abs().max()) > 1e-2


def test_longrope_context_stays_within_the_original_length(tiny: Any) -> None:
    """Only LongRoPE's short factors are implemented, which transformers uses up to the original
    context: longer contexts are refused, not computed with the wrong frequencies."""
    t = tiny("phi3-longrope")
    assert t.loaded.config.max_position_embeddings == 512 and t.model.max_len == 512
    with pytest.raises(QuickdraftError, match="512"):
        load_model(str(t.folder), dtype="float32", max_context=1024)


@pytest.mark.parametrize("name", GGUF_CASES)
def test_gguf_conversion_matches_transformers(tiny: Any, tiny_dir: Path, name: str) -> None:
    """llama.cpp's Phi-3 layout (fused attn_qkv, ffn_up = gate then up, rope.dimension_count for
    partial rotary, the window in metadata) loads to transformers' logits."""
    t = tiny(name)
    path = tiny_dir / f"{name}.gguf"
    if not path.exists():
        hf_to_gguf(t.folder, path)
    loaded = load_model(str(path), dtype="float32")
    assert loaded.config.partial_rotary_factor == t.loaded.config.partial_rotary_factor
    assert loaded.config.layer_types == t.loaded.config.layer_types
    logits, _ = loaded.model(torch.tensor(t.ids), loaded.model.new_cache())
    assert_close(logits, t.expected)


def test_longrope_gguf_is_refused() -> None:
    meta = {
        "general.architecture": "phi3",
        "phi3.embedding_length": 3072,
        "phi3.feed_forward_length": 8192,
        "phi3.block_count": 32,
        "phi3.attention.head_count": 32,
        "tokenizer.ggml.tokens": ["a"] * 10,
    }
    with pytest.raises(QuickdraftError, match="LongRoPE"):
        gguf_io.config_from_metadata(meta, {"token_embd.weight", "rope_factors_long.weight"})
    assert gguf_io.config_from_metadata(meta, {"token_embd.weight"}).model_type == "phi3"


def test_older_hub_config_with_su_scaling() -> None:
    """Configs written before transformers 5: rope_scaling {"type": "su"} and a top-level
    original_max_position_embeddings; the attention factor follows from the length ratio."""
    cfg = ModelConfig.from_hf_dict(
        {
            "model_type": "phi3",
            "vocab_size": 32064,
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rope_scaling": {"type": "su", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
            "sliding_window": 262144,
        }
    )
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(1.1902380714238083)
    assert cfg.max_position_embeddings == 4096
    with pytest.raises(QuickdraftError, match="dynamic"):
        ModelConfig.from_hf_dict(
            {**_minimal(), "rope_scaling": {"type": "dynamic", "factor": 2.0}}
        )


def _minimal() -> dict[str, Any]:
    return {
        "model_type": "phi3",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }


def test_prefill_then_decode_equals_full_forward(tiny: Any) -> None:
    t = tiny("phi3-partial-window")
    full = t.full()
    cache = t.model.new_cache()
    ids = torch.tensor(t.ids)
    parts = [t.model(ids[:4], cache)[0]] + [t.model(ids[i : i + 1], cache)[0] for i in range(4, len(t.ids))]
    assert_close(torch.cat(parts), full, rel=1e-5)
    cache.truncate(10)
    assert torch.equal(t.model(ids[10:], cache)[0], torch.cat(parts)[10:])  # batch-invariant rows


@pytest.mark.parametrize("name", ["phi3-partial-window", "phi3-longrope"])
def test_ngram_speculation_equals_plain_greedy(tiny: Any, name: str) -> None:
    t = tiny(name)
    prompt = t.loaded.tokenizer.encode("for i in range(10):\n    print(i, i * i)\nfor i in range(10):\n    print(i")
    engine = Engine(t.loaded.model, t.loaded.tokenizer)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = [tok for s in engine.generate(prompt, params) for tok in s.token_ids]
    steps = list(engine.generate(prompt, params, NGramDrafter(min_ngram=1), 4))
    assert [tok for s in steps for tok in s.token_ids] == plain
    assert steps[-1].stats.drafted > 0
