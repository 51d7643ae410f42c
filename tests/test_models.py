"""Every architecture computes what transformers computes (fp32), through every cache path.

Tiny random checkpoints (``tests/tiny.py``) are saved by transformers and loaded by quickdraft's
own loader, so these tests cover config parsing, weight naming, tying and the forward pass
together; the same checkpoints converted to GGUF the way llama.cpp does cover the GGUF path for
every architecture. The real SmolLM2 / Qwen2.5 GGUF files then check dequantization, the q/k
permutation and the generation loop against transformers' own GGUF loader.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_close, generate, transformers_from_gguf
from tiny import hf_to_gguf, load_reference, make_tiny_hf_model, reference_logits

from quickdraft.errors import QuickdraftError
from quickdraft.loading.load import LoadedModel, load_model

TEXT = "def fibonacci(n):\n    return the quick brown fox!"

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small enough that the tiny model's head_dim 16 frequencies fall in all three bands
    # (kept, smoothly blended, divided by the factor).
    "original_max_position_embeddings": 64,
}

YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}  # head_dim 16: a ramp

# name -> (model_type, config overrides)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-rope-llama3": ("llama", {"rope_scaling": LLAMA3_ROPE, "num_hidden_layers": 3}),
    "llama-padded-vocab": ("llama", {"vocab_size": 384}),
    "qwen2": ("qwen2", {"num_hidden_layers": 3}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2-rope-yarn": ("qwen2", {"rope_scaling": YARN_ROPE}),
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {}),
}
ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


class Tiny:
    """One tiny checkpoint loaded by quickdraft and by transformers, with reference logits."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.loaded: LoadedModel = load_model(str(folder), dtype="float32")
        self.reference = load_reference(folder)
        self.ids = self.loaded.tokenizer.encode(TEXT)
        self.expected = reference_logits(self.reference, self.ids)  # [T, V]

    @property
    def model(self) -> Any:
        return self.loaded.model

    def full(self) -> torch.Tensor:
        logits, _ = self.model(torch.tensor(self.ids), self.model.new_cache())
        return logits


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


_TINY: dict[str, Tiny] = {}


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> Any:
    """``tiny(name)``: the checkpoint of CASES[name], built and loaded once per module."""

    def get(name: str) -> Tiny:
        if name not in _TINY:
            model_type, overrides = CASES[name]
            _TINY[name] = Tiny(make_tiny_hf_model(tiny_dir, model_type, name=name, **overrides))
        return _TINY[name]

    yield get
    _TINY.clear()


# --------------------------------------------------------------------------- tiny: vs transformers


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(tiny: Any, name: str) -> None:
    t = tiny(name)
    assert 12 <= len(t.ids) <= 20
    logits = t.full()
    assert logits.dtype == torch.float32
    assert logits.shape == (len(t.ids), t.loaded.config.vocab_size)
    assert_close(logits, t.expected)
    assert torch.equal(logits.argmax(-1), t.expected.argmax(-1))


def test_config_variants_are_what_they_claim(tiny: Any) -> None:
    """The cases really exercise what they are named after (guards against silent defaults)."""
    assert tiny("llama-tied").loaded.config.tie_word_embeddings
    assert not tiny("llama").loaded.config.tie_word_embeddings
    assert tiny("llama-rope-llama3").loaded.config.rope_scaling["rope_type"] == "llama3"
    assert tiny("qwen2").loaded.config.attention_bias
    qwen3 = tiny("qwen3").loaded.config
    assert qwen3.qk_norm and qwen3.head_dim == 32 != qwen3.hidden_size // qwen3.num_attention_heads
    assert (
        tiny("llama-padded-vocab").loaded.config.vocab_size
        > tiny("llama").loaded.tokenizer.vocab_size
    )
    m = tiny("llama-tied").model
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()


def test_yarn_changes_the_logits_and_extends_the_context(tiny: Any) -> None:
    """The YaRN case differs from plain RoPE (frequencies and the cos/sin scale), and a YaRN config
    allows factor x its original length (Qwen2.5's 32k config with factor 4: 128k), no more."""
    import dataclasses

    from quickdraft.loading.load import _context_length
    from quickdraft.models.layers import rope_attention_factor, rope_inv_freq

    cfg = tiny("qwen2-rope-yarn").loaded.config
    assert cfg.rope_scaling["rope_type"] == "yarn"
    plain = dataclasses.replace(cfg, rope_scaling=None)
    assert not torch.equal(rope_inv_freq(cfg), rope_inv_freq(plain))
    assert rope_attention_factor(cfg) == pytest.approx(0.1 * math.log(4.0) + 1.0)
    long = dataclasses.replace(cfg, max_position_embeddings=32768,
                               rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 32768})
    assert _context_length(long, 131072) == 131072
    with pytest.raises(QuickdraftError, match="exceeds what this model supports"):
        _context_length(long, 131073)
    assert _context_length(plain, None) <= plain.max_position_embeddings


def test_llama3_rope_scaling_changes_the_logits(tiny: Any) -> None:
    """Without the llama3 frequency scaling the same weights give other logits: the case tests it."""
    from transformers import AutoModelForCausalLM

    t = tiny("llama-rope-llama3")
    config = t.reference.config.__class__.from_pretrained(str(t.folder))
    config.rope_parameters = {
        "rope_type": "default",
        "rope_theta": config.rope_parameters["rope_theta"],
    }
    plain = AutoModelForCausalLM.from_pretrained(str(t.folder), config=config, dtype=torch.float32)
    unscaled = reference_logits(plain.eval(), t.ids)
    assert float((unscaled - t.expected).abs().max()) > 1e-2


# ------------------------------------------------------------------------------ tiny: as GGUF files

@pytest.mark.parametrize("name", CASES)
def test_gguf_conversion_matches_transformers(tiny: Any, tiny_dir: Path, name: str) -> None:
    """The same checkpoint converted as llama.cpp does (names, q/k permutation, metadata, tokenizer)
    loads through the GGUF path to the same logits: covers the qwen3 q/k-norm and qwen2 bias GGUF
    tensors, which the real zoo models do not all have."""
    t = tiny(name)
    path = tiny_dir / f"{name}.gguf"
    if not path.exists():
        hf_to_gguf(t.folder, path)
    loaded = load_model(str(path), dtype="float32")
    assert loaded.tokenizer.encode(TEXT) == t.ids
    assert loaded.config.tie_word_embeddings == t.loaded.config.tie_word_embeddings
    logits, _ = loaded.model(torch.tensor(t.ids), loaded.model.new_cache())
    assert_close(logits, t.expected)


def test_mistral_sliding_window_is_respected_or_refused(tiny_dir: Path) -> None:
    """Beyond the window Mistral attends to the last ``sliding_window`` tokens only. quickdraft
    promises (models/mistral.py) to refuse such contexts rather than compute them wrongly."""
    folder = make_tiny_hf_model(tiny_dir, "mistral", name="mistral-window", sliding_window=16)
    loaded = load_model(str(folder), dtype="float32")
    ids = list(range(3, 40))
    if loaded.model.max_len >= len(ids):
        logits, _ = loaded.model(torch.tensor(ids), loaded.model.new_cache())
        assert_close(logits, reference_logits(load_reference(folder), ids))
    else:
        with pytest.raises(QuickdraftError, match="context"):
            loaded.model(torch.tensor(ids), loaded.model.new_cache())


# ------------------------------------------------------------------------------- tiny: cache paths


@pytest.mark.parametrize("name", ARCHS)
def test_prefill_then_decode_equals_full_forward(tiny: Any, name: str) -> None:
    t = tiny(name)
    full = t.full()
    cache = t.model.new_cache()
    ids = torch.tensor(t.ids)
    p = 5
    parts = [t.model(ids[:p], cache)[0]]
    for i in range(p, len(t.ids)):
        parts.append(t.model(ids[i : i + 1], cache)[0])
    assert cache.length == len(t.ids)
    assert_close(torch.cat(parts), full, rel=1e-5)


@pytest.mark.parametrize("name", ARCHS)
def test_prefill_in_two_chunks(tiny: Any, name: str) -> None:
    t = tiny(name)
    full = t.full()
    cache = t.model.new_cache()
    ids = torch.tensor(t.ids)
    a, _ = t.model(ids[:7], cache)
    b, _ = t.model(ids[7:], cache)
    assert_close(torch.cat([a, b]), full, rel=1e-5)


@pytest.mark.parametrize("name", ARCHS)
def test_truncate_rolls_back(tiny: Any, name: str) -> None:
    """Write wrong tokens past n, truncate to n, rerun the right ones: the stale slots are gone."""
    t = tiny(name)
    full = t.full()
    ids = torch.tensor(t.ids)
    n = 8
    cache = t.model.new_cache()
    t.model(ids[:n], cache)
    wrong = (ids[n:] + 17) % t.loaded.tokenizer.vocab_size
    t.model(wrong, cache)
    assert cache.length == len(t.ids)
    cache.truncate(n)
    again, _ = t.model(ids[n:], cache)
    assert_close(again, full[n:], rel=1e-5)
    # Rolling back to the same point twice reproduces the logits again, decode-style.
    cache.truncate(n)
    steps = [t.model(ids[i : i + 1], cache)[0] for i in range(n, len(t.ids))]
    assert_close(torch.cat(steps), full[n:], rel=1e-5)


def test_num_logits_and_reset(tiny: Any) -> None:
    t = tiny("qwen2")
    full = t.full()
    cache = t.model.new_cache()
    last, _ = t.model(torch.tensor(t.ids), cache, num_logits=1)
    assert last.shape == (1, full.shape[1])
    assert_close(last, full[-1:], rel=1e-5)
    cache.reset()
    assert cache.length == 0
    two, _ = t.model(torch.tensor(t.ids), cache, num_logits=2)
    assert_close(two, full[-2:], rel=1e-5)


# ------------------------------------------------------------------------------------ real models

PROMPT = "The history of the Roman Empire begins with"


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> LoadedModel:
    return load_model(str(smollm2_gguf), dtype="float32", max_context=256)


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return transformers_from_gguf(smollm2_gguf, tmp_path_factory.mktemp("smollm2-reference"))


@pytest.fixture(scope="module")
def smollm2_greedy(smollm2: LoadedModel) -> list[int]:
    return generate(smollm2, smollm2.tokenizer.encode(PROMPT), max_tokens=64, ignore_eos=True).ids


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2: LoadedModel, smollm2_reference: Any) -> None:
    ids = smollm2.tokenizer.encode(PROMPT)
    logits, _ = smollm2.model(torch.tensor(ids), smollm2.model.new_cache())
    expected = reference_logits(smollm2_reference, ids)
    diff = float((logits - expected).abs().max())
    assert diff < 1e-3, f"max abs diff {diff:.3g}"


@pytest.mark.slow
def test_smollm2_greedy_64_tokens_match_transformers(
    smollm2: LoadedModel, smollm2_reference: Any, smollm2_greedy: list[int]
) -> None:
    ids = smollm2.tokenizer.encode(PROMPT)
    ref = smollm2_reference
    ref.generation_config.eos_token_id = None  # like ignore_eos: always 64 tokens
    with torch.inference_mode():
        out = ref.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=64,
            pad_token_id=0,
        )
    expected = out[0, len(ids) :].tolist()
    assert len(smollm2_greedy) == 64
    assert smollm2_greedy == expected, (
        smollm2.tokenizer.decode(smollm2_greedy),
        smollm2.tokenizer.decode(expected),
    )


@pytest.mark.slow
def test_smollm2_bfloat16_greedy_starts_like_float32(
    smollm2_gguf: Path, smollm2: LoadedModel, smollm2_greedy: list[int]
) -> None:
    """bf16 keeps 8 mantissa bits, so logits move by ~1e-2 relative: a near-tie between the top two
    tokens somewhere in a long continuation flips and the texts diverge from there on. Only the
    start, where the top token usually leads clearly, is expected to agree."""
    bf16 = load_model(str(smollm2_gguf), dtype="bfloat16", max_context=256)
    assert bf16.model.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = bf16.tokenizer.encode(PROMPT)
    logits, _ = bf16.model(torch.tensor(ids), bf16.model.new_cache())
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert generate(bf16, ids, max_tokens=8, ignore_eos=True).ids == smollm2_greedy[:8]


@pytest.mark.slow
def test_qwen05_logits_match_transformers(qwen05_gguf: Path, tmp_path: Path) -> None:
    loaded = load_model(str(qwen05_gguf), dtype="float32", max_context=256)
    ids = loaded.tokenizer.encode(PROMPT)
    logits, _ = loaded.model(torch.tensor(ids), loaded.model.new_cache())
    del loaded
    expected = reference_logits(transformers_from_gguf(qwen05_gguf, tmp_path), ids)
    diff = float((logits - expected).abs().max())
    assert diff < 1e-3, f"max abs diff {diff:.3g}"


def test_families_that_convert_checkpoints_say_so() -> None:
    """A family overriding CausalLM.convert_checkpoint sets converts_checkpoint (loading then keeps
    no prepared copy of the file's tensors), and one that does not leaves both alone."""
    import importlib

    from quickdraft.config import family_module, model_types
    from quickdraft.models.causal_lm import CausalLM

    converting = set()
    for arch in model_types():
        cls = importlib.import_module(str(family_module(arch))).CausalLM
        assert issubclass(cls, CausalLM)
        overrides = cls.convert_checkpoint is not CausalLM.convert_checkpoint
        assert cls.converts_checkpoint == overrides, arch
        if overrides:
            converting.add(arch)
    assert {"mixtral", "gpt_oss", "qwen3_5", "gemma4_text"} <= converting
    assert not converting & {"llama", "qwen2", "qwen3", "mistral", "phi3"}


def test_each_family_is_one_module_whose_config_round_trips() -> None:
    """Every module of quickdraft.models but the shared ones declares a Family that builds its own
    model types (found back by model type and GGUF architecture), and a config of each type with
    the family's own fields reads back equal from its JSON form (prepared weights keep it so)."""
    import importlib
    import json
    import pkgutil

    import quickdraft.models as models
    from quickdraft.config import Family, ModelConfig, family_module, family_of, gguf_family

    shape = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
             "num_attention_heads": 4}
    names = [m.name for m in pkgutil.iter_modules(models.__path__) if m.name not in models.SHARED_MODULES]
    assert {"llama", "gemma4", "qwen3_5"} <= set(names)
    for name in names:
        family = importlib.import_module(f"quickdraft.models.{name}").FAMILY
        assert isinstance(family, Family) and family.model_types, name
        for arch, model_type in family.gguf_archs.items():
            assert gguf_family(arch) == (model_type, family) and model_type in family.model_types, arch
        for model_type in family.model_types:
            assert family_of(model_type) is family and family_module(model_type) == f"quickdraft.models.{name}"
            cfg = ModelConfig.from_hf_dict({**shape, "model_type": model_type})
            assert isinstance(cfg.family, family.fields), model_type
            assert ModelConfig.from_json_dict(json.loads(json.dumps(cfg.to_json_dict()))) == cfg, model_type
