"""Gemma 4 text: full-attention layers with their own head size and proportional RoPE, KV sharing,
keys as values, per-layer embeddings, routed experts beside the MLP, layer scalars.

Two tiny random layouts (the small models': KV sharing, double-wide MLPs, per-layer embeddings;
the MoE one: experts, k = v, fewer KV heads on full layers) are rows of tests/test_families.py,
which checks their logits against transformers, rows bitwise plain decoding's, lossless speculation
with every drafter and the prefix cache. Here: the cache's storage groups, each part's effect on the
logits, a vision-language checkpoint's layout, refused configs, and GGUF files as llama.cpp writes
them loading to the same model, quantized experts kept in their blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import check_scripted, logits, make_case
from safetensors.torch import load_file, save_file
from tiny import (
    GEMMA4_MOE,
    gemma4_to_gguf,
    load_reference,
    make_tiny_hf_model,
    reference_logits,
    write_tokenizer,
)

from quickdraft.cache import KVLayout
from quickdraft.config import ModelConfig
from quickdraft.errors import QuickdraftError
from quickdraft.gguf_vocab import read_gguf_metadata, vocab_from_gguf_metadata
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.models.gemma4 import Gemma4Attention
from quickdraft.models.layers import QuantEmbedding
from quickdraft.quant.ggml import GGMLLinear
from quickdraft.speculative.ngram import NGramDrafter

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = (
    "for i in range(10):\n    print(i, i * i)\nfor i in range(10):\n    print(i, i * i * i)\n"
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n"
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma4")
    return {"small": make_tiny_hf_model(root, "gemma4_text", seed=1, name="small"),
            "moe": make_tiny_hf_model(root, "gemma4_text", seed=2, name="moe", **GEMMA4_MOE)}


@pytest.fixture(scope="module")
def small(folders: dict[str, Path]) -> LoadedModel:
    return load_model(str(folders["small"]), dtype="float32", max_context=256)


@pytest.mark.parametrize("name", ["small", "moe"])
def test_config_has_what_each_layout_claims(folders: dict[str, Path], name: str) -> None:
    """What both tiny layouts exercise (tests/test_families.py checks their logits against
    transformers and their lossless speculation): full layers' own head size, a window (5) shorter
    than the texts, proportional RoPE; the MoE layout's cache: one group per head shape."""
    loaded = load_model(str(folders[name]), dtype="float32", max_context=256)
    cfg = loaded.config
    assert cfg.model_type == "gemma4_text" and cfg.family.global_head_dim == 32 and cfg.sliding_window == 5
    assert (cfg.rope_scaling or {}).get("rope_type") == "proportional"
    assert len(loaded.tokenizer.encode(TEXT)) > 64
    if name == "moe":
        assert loaded.model.new_cache().layout.groups == ((2, 2, 16), (2, 1, 32))


def test_the_cache_holds_one_group_per_shape_and_nothing_for_sharing_layers(small: LoadedModel) -> None:
    """Sliding layers' keys are 2 heads x 16, full layers' 2 x 32; layers 2 and 3 reuse layers 0 and
    1's places and write nothing: half the memory of a cache for all four."""
    cache = small.model.new_cache()
    assert cache.layout == KVLayout(((1, 2, 16), (1, 2, 32)), ((0, 0), (1, 0), (0, 0), (1, 0)), (True, True, False, False))
    assert cache.bytes_per_token == 2 * 4 * (2 * 16 + 2 * 32)
    assert cache.k_layers[2] is cache.k_layers[0] and cache.v_layers[3] is cache.v_layers[1]
    attn = small.model.model.layers[3].self_attn
    assert isinstance(attn, Gemma4Attention) and attn.reuses_kv and not hasattr(attn, "k_proj")


def test_each_part_changes_the_logits(small: LoadedModel) -> None:
    """Per-layer embeddings, the layer scalar and the reused keys matter beyond the tolerance."""
    ids = small.tokenizer.encode(TEXT)[:30]
    base = logits(small, ids)
    layers = small.model.model.layers
    for param in (small.model.model.embed_tokens_per_layer.weight, layers[2].layer_scalar,
                  layers[1].self_attn.k_norm.weight):
        saved = param.detach().clone()
        with torch.no_grad():
            param.mul_(1.5)
        try:
            assert (logits(small, ids) - base).abs().max() > 1e-2
        finally:
            with torch.no_grad():
                param.copy_(saved)
    assert torch.equal(logits(small, ids), base)


def test_vision_language_checkpoint_runs_its_text_model(tmp_path: Path, folders: dict[str, Path],
                                                         small: LoadedModel) -> None:
    """A Gemma 4 checkpoint as published (model_type "gemma4", text_config with global_head_dim,
    ``model.language_model.`` names, vision and audio towers beside it) loads as the text model."""
    src = folders["small"]
    text = json.loads((src / "config.json").read_text())
    text.pop("per_layer_config")
    text |= {"global_head_dim": 32}
    folder = tmp_path / "vl"
    write_tokenizer(folder)
    config = {"model_type": "gemma4", "text_config": text, "vision_config": {"hidden_size": 8}}
    (folder / "config.json").write_text(json.dumps(config))
    weights = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(str(src / "model.safetensors")).items()}
    weights |= {"model.vision_tower.patch_embedder.input_proj.weight": torch.zeros(4, 3),
                "model.embed_vision.embedding_projection.weight": torch.zeros(4, 4),
                "model.audio_tower.layers.0.norm.weight": torch.zeros(4)}
    save_file(weights, str(folder / "model.safetensors"))
    vl = load_model(str(folder), dtype="float32", max_context=256)
    assert vl.config.model_type == "gemma4_text" and vl.config.family.global_head_dim == 32
    assert vl.config.layer_pattern() == ("4 layers: 2 sliding_attention + 2 full_attention, "
                                        "the last 2 reusing earlier layers' keys and values")
    ids = small.tokenizer.encode(TEXT)[:40]
    assert torch.equal(logits(vl, ids), logits(small, ids))


def test_configs_quickdraft_cannot_run_are_refused() -> None:
    base = {"model_type": "gemma4_text", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 2, "num_attention_heads": 2, "layer_types": ["sliding_attention", "full_attention"]}
    cfg = ModelConfig.from_hf_dict(base)
    assert cfg.family.global_head_dim == 512 and cfg.family.hidden_size_per_layer_input == 256 and cfg.tie_word_embeddings
    with pytest.raises(QuickdraftError, match="bidirectional"):
        ModelConfig.from_hf_dict(base | {"use_bidirectional_attention": "all"})
    with pytest.raises(QuickdraftError, match="per_layer_config"):
        ModelConfig.from_hf_dict(base | {"per_layer_config": {"0": {"head_dim": 64}}})
    with pytest.raises(QuickdraftError, match="num_kv_shared_layers"):
        ModelConfig.from_hf_dict(base | {"num_kv_shared_layers": 1})


# ------------------------------------------------------------------------- GGUF


@pytest.mark.parametrize("name", ["small", "moe"])
def test_gguf_matches_transformers(folders: dict[str, Path], tmp_path: Path, name: str) -> None:
    """A float GGUF written as llama.cpp's converter writes Gemma 4 (per-layer arrays, key_length /
    key_length_swa, rope_freqs for proportional RoPE, stacked experts) gives transformers' logits."""
    path = gemma4_to_gguf(folders[name], tmp_path / f"{name}.gguf")
    loaded = load_model(str(path), dtype="float32", max_context=256)
    want = load_model(str(folders[name]), dtype="float32", max_context=256).config
    got = loaded.config
    for field in ("layer_types", "head_dim", "num_key_value_heads", "num_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "sliding_window", "rope_theta", "rope_local_theta", "final_logit_softcapping"):
        assert getattr(got, field) == getattr(want, field), field
    for field in ("global_head_dim", "num_global_key_value_heads", "attention_k_eq_v", "num_kv_shared_layers",
                  "hidden_size_per_layer_input"):  # Gemma 4's own fields
        assert getattr(got.family, field) == getattr(want.family, field), field
    assert got.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    # (double-wide MLPs only exist on KV-sharing layers: the MoE layout has none)
    assert got.family.use_double_wide_mlp == (want.family.use_double_wide_mlp and want.family.num_kv_shared_layers > 0)
    assert (want.rope_scaling or {})["partial_rotary_factor"] == 0.25
    ids = loaded.tokenizer.encode(TEXT)
    assert (logits(loaded, ids) - reference_logits(load_reference(folders[name]), ids)).abs().max() < 1e-4


def test_quantized_gguf_keeps_expert_blocks_and_speculates_losslessly(folders: dict[str, Path], tmp_path: Path) -> None:
    """Q8_0 attention, MLP, per-layer embedding and stacked experts: every expert's matrix stays in
    its blocks (one kernel module per expert, gate and up rows split), the logits are the float
    file's within the activations' int8 rounding (on average), and speculation equals plain decoding."""
    q = {"attn_q.weight": "Q8_0", "ffn_up.weight": "Q8_0", "exps.weight": "Q8_0", "per_layer_token_embd.weight": "Q8_0"}
    for name in ("moe", "small"):
        path = gemma4_to_gguf(folders[name], tmp_path / f"{name}-q8.gguf", q)
        quant = load_model(str(path), dtype="auto", max_context=256)
        plain = load_model(str(path), dtype="float32", max_context=256)
        layer = quant.model.model.layers[0]
        if name == "moe":
            assert all(isinstance(m, GGMLLinear) for e in layer.experts for m in (e.gate_proj, e.up_proj, e.down_proj))
        else:
            assert isinstance(quant.model.model.embed_tokens_per_layer, QuantEmbedding)
        ids = quant.tokenizer.encode(TEXT)[:40]
        diff = (logits(quant, ids) - logits(plain, ids)).abs()  # (a near-tied router choice may flip a row)
        assert diff.mean() < 0.01 and diff.max() < 0.5
        qcase = make_case(quant, TEXT[:60], 20)
        check_scripted(qcase, "partly", 4)
        assert qcase.spec(NGramDrafter(max_ngram=3, min_ngram=1), 4).ids == qcase.truth


def test_quantized_tied_gguf_head_is_the_token_embedding(tmp_path: Path) -> None:
    """A tied Gemma 4 GGUF (no output.weight) with both embedding tables in Q8_0: the output head is
    the token embedding's blocks, not the per-layer table's (4 layers x 16 columns: the hidden size
    here, so the wrong head gave wrong logits silently; another layer count, a shape error); the
    logits are the float file's within the Q8_0 head's and activations' rounding (about 0.03 on
    logits of about 6; the per-layer table as the head: about 6)."""
    folder = make_tiny_hf_model(tmp_path, "gemma4_text", seed=3, name="tied", tie_word_embeddings=True)
    path = gemma4_to_gguf(folder, tmp_path / "tied-q8.gguf", {"token_embd.weight": "Q8_0"})  # (both tables)
    quant = load_model(str(path), dtype="auto", max_context=256)
    model = quant.model
    assert isinstance(model.model.embed_tokens_per_layer, QuantEmbedding)
    assert model.lm_head is model.model.embed_tokens.linear
    ids = quant.tokenizer.encode(TEXT)[:40]
    diff = (logits(quant, ids) - logits(load_model(str(path), dtype="float32", max_context=256), ids)).abs()
    assert diff.mean() < 0.1 and diff.max() < 0.5


def test_gguf_gemma4_tokenizer_matches_llamacpp() -> None:
    """A "gemma4" GGUF vocabulary (spaces as "▁", BPE merges over raw UTF-8, newline runs split
    off, byte tokens) encodes every text to the ids llama.cpp's own tokenizer gave them (recorded
    by tests/data/make_gemma4_vocab.py), and decodes back to the text."""
    data = Path(__file__).parent / "data"
    vocab = vocab_from_gguf_metadata(read_gguf_metadata(data / "gemma4-vocab.gguf"))
    want = json.loads((data / "gemma4-vocab-llamacpp.json").read_text(encoding="utf-8"))
    assert any(len(ids) > 1 for ids in want["ids"]) and any(235 < i < 260 for ids in want["ids"] for i in ids)
    for text, ids in zip(want["texts"], want["ids"], strict=True):
        got = vocab.backend.encode(text, add_special_tokens=False).ids
        assert got == ids, text
        assert vocab.backend.decode(got) == text
