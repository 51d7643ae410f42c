"""GPT-OSS: attention sinks, alternating sliding windows, YaRN, clamped-activation experts with
biases, MXFP4 expert blocks.

tests/test_families.py runs the checks every family gets on the tiny checkpoint (logits equal
transformers' with its eager attention with sinks, rows bitwise plain decoding's, lossless
speculation with every drafter). Here: the sinks matter; an MXFP4 checkpoint loads to exactly the
values of the blocks, dequantized in the test from the format's definition; llama.cpp's GGUF
layout gives transformers' logits; grouped expert kernels are bitwise each expert's own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from helpers import check_scripted, logits, make_case
from safetensors.torch import load_file, save_file
from tiny import (
    gpt_oss_to_gguf,
    load_reference,
    make_tiny_hf_model,
    reference_logits,
    write_tokenizer,
)

from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.models.gpt_oss import SinkAttention
from quickdraft.quant.ggml import GGMLLinear, set_activation_mode
from quickdraft.speculative.ngram import NGramDrafter

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = (
    "for i in range(10):\n    print(i, i * i)\nfor i in range(10):\n    print(i, i * i * i)\n"
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n"
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", seed=3)


@pytest.fixture(scope="module")
def oss(folder: Path) -> LoadedModel:
    return load_model(str(folder), dtype="float32", max_context=256)


def test_config_has_windows_yarn_and_experts(oss: LoadedModel) -> None:
    """What the tiny checkpoint exercises (tests/test_families.py checks its logits against
    transformers and its lossless speculation): a window (5) shorter than the texts, YaRN, experts."""
    cfg = oss.config
    assert cfg.model_type == "gpt_oss" and cfg.num_experts == 4 and cfg.sliding_window == 5
    assert (cfg.rope_scaling or {}).get("rope_type") == "yarn"
    assert len(oss.tokenizer.encode(TEXT)) > 64


def test_the_sinks_matter(oss: LoadedModel) -> None:
    """Without its sinks the model's logits move far beyond the tolerance above (the native attention
    kernel takes the sinks: the layer runs on it)."""
    ids = oss.tokenizer.encode(TEXT)[:30]
    base = logits(oss, ids)
    attn = oss.model.model.layers[1].self_attn
    assert isinstance(attn, SinkAttention) and attn.native
    saved = attn.sinks.detach().clone()
    with torch.no_grad():
        attn.sinks.fill_(-1e4)  # a sink no row attends to: plain softmax
    try:
        assert (logits(oss, ids) - base).abs().max() > 1e-2
    finally:
        with torch.no_grad():
            attn.sinks.copy_(saved)


# ------------------------------------------------------------------------- MXFP4


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [..., K] to MXFP4 from the format's definition: per 32 values an E8M0 scale 2^e
    (the largest |value| / 6 rounded up to a power of two) and each value's nearest FP4 code."""
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    x = w.reshape(*w.shape[:-1], -1, 32)
    amax = x.abs().amax(-1).clamp(min=2.0**-100)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    mag = (x.abs() / torch.exp2(e).unsqueeze(-1)).unsqueeze(-1)
    code = (mag - values).abs().argmin(-1) + 8 * (x < 0)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)  # low nibble first
    return packed, (e + 127).to(torch.uint8)


def dequant(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    lo, hi = values[(blocks & 15).long()], values[(blocks >> 4).long()]
    x = torch.stack([lo, hi], -1).flatten(-2) * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return x.flatten(-2)


def test_mxfp4_checkpoint_keeps_the_blocks_for_the_native_kernel(folder: Path, tmp_path: Path) -> None:
    """Experts stored as MXFP4 blocks (``*_blocks`` [E, out, K/32, 16], ``*_scales`` [E, out, K/32], as
    the published GPT-OSS checkpoints) stay in their blocks: each expert projection is an MXFP4
    kernel layer whose weights are exactly the blocks' values (dequantized in the test from the
    format's definition), gate and up rows de-interleaved; with exact fp32 activations the logits
    are the float model's, with int8 activations (the default) close; speculation stays lossless."""
    weights = load_file(str(folder / "model.safetensors"))
    quant, exact = dict(weights), dict(weights)
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        out_major = weights[name].transpose(1, 2).contiguous()  # [E, out, in]
        blocks, scales = mxfp4(out_major)
        del quant[name]
        quant[name + "_blocks"], quant[name + "_scales"] = blocks, scales
        exact[name] = dequant(blocks, scales).transpose(1, 2).contiguous()
    models = []
    for label, tensors in (("mxfp4", quant), ("float", exact)):
        out = tmp_path / label
        write_tokenizer(out)
        (out / "config.json").write_text((folder / "config.json").read_text())
        save_file(tensors, str(out / "model.safetensors"))
        models.append(load_model(str(out), dtype="float32", max_context=256))
    blocks_model, float_model = models
    for layer_q, layer_f in zip(blocks_model.model.model.layers, float_model.model.model.layers, strict=True):
        for eq, ef in zip(layer_q.mlp.experts, layer_f.mlp.experts, strict=True):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                mq, mf = getattr(eq, proj), getattr(ef, proj)
                assert isinstance(mq, GGMLLinear) and mq.qtype == GGMLQuantizationType.MXFP4
                assert torch.equal(mq.dequantize(), mf.weight) and torch.equal(mq.bias, mf.bias)
    ids = blocks_model.tokenizer.encode(TEXT)[:30]
    want = logits(float_model, ids)
    set_activation_mode(blocks_model.model, "f32")
    assert (logits(blocks_model, ids) - want).abs().max() < 1e-4
    set_activation_mode(blocks_model.model, "q8")
    assert (logits(blocks_model, ids) - want).abs().mean() < 0.02
    qcase = make_case(blocks_model, TEXT[:60], 20)
    check_scripted(qcase, "partly", 4)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "gpt_oss"


# ------------------------------------------------------------------------- GGUF


def test_gguf_matches_transformers_and_keeps_mxfp4_experts(folder: Path, tmp_path: Path) -> None:
    """A GGUF as llama.cpp's converter writes GPT-OSS (gate / up experts apart, biases, sinks, YaRN
    keys) gives transformers' logits; with MXFP4 experts (what the released GGUFs hold) every expert
    projection stays an MXFP4 kernel layer holding exactly the file's values, and speculation
    equals plain decoding."""
    path = gpt_oss_to_gguf(folder, tmp_path / "f32.gguf")
    loaded = load_model(str(path), dtype="float32", max_context=256)
    cfg = loaded.config
    assert cfg.model_type == "gpt_oss" and cfg.num_experts == 4 and cfg.sliding_window == 5
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (cfg.rope_scaling or {}).get("rope_type") == "yarn"
    ids = loaded.tokenizer.encode(TEXT)
    assert (logits(loaded, ids) - reference_logits(load_reference(folder), ids)).abs().max() < 1e-4
    path = gpt_oss_to_gguf(folder, tmp_path / "mxfp4.gguf", {"exps.weight": "MXFP4", "attn_q.weight": "Q8_0"})
    quant = load_model(str(path), dtype="auto", max_context=256)
    reader = GGUFReader(str(path))
    down = next(t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    assert down.tensor_type == GGMLQuantizationType.MXFP4
    stacked = torch.from_numpy(gguf_dequantize(down.data, down.tensor_type).copy())  # [E, H, I]
    for e, expert in enumerate(quant.model.model.layers[1].mlp.experts):
        assert isinstance(expert.down_proj, GGMLLinear) and expert.down_proj.qtype == GGMLQuantizationType.MXFP4
        assert torch.equal(expert.down_proj.dequantize(), stacked[e])
    qcase = make_case(quant, TEXT[:60], 20)
    check_scripted(qcase, "partly", 4)
    assert qcase.spec(NGramDrafter(max_ngram=3, min_ngram=1), 4).ids == qcase.truth


@pytest.mark.parametrize("qtype", ["MXFP4", "Q8_0", "Q4_0"])  # (the tiny rows are 64 wide: 32-blocks)
def test_grouped_experts_are_bitwise_each_experts_own(folder: Path, tmp_path: Path, qtype: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass of 1-70 rows runs its chosen experts' gate and up projections as one grouped kernel
    call (each expert on its rows) and their down projections as another (mix_experts): the layer's
    output is bitwise each expert computing on its own rows, for the expert formats the released
    files hold, any row grouping; whole rows of a pass and speculation stay plain decoding's."""
    from quickdraft.models import layers
    from quickdraft.models.moe import mix_experts

    path = gpt_oss_to_gguf(folder, tmp_path / f"{qtype}.gguf", {"exps.weight": qtype, "attn_q.weight": "Q8_0"})
    quant = load_model(str(path), dtype="auto", max_context=256)
    moe = quant.model.model.layers[1].mlp
    assert all(isinstance(e.gate_proj, GGMLLinear) for e in moe.experts)
    calls: list[list[int]] = []
    real = layers.ggml_linear_grouped

    def counted(groups: list[list[Any]], x: torch.Tensor, counts: list[int]) -> list[list[torch.Tensor]]:
        calls.append([len(g) for g in groups])
        return real(groups, x, counts)

    gen = torch.Generator().manual_seed(3)
    n = len(moe.experts)
    with torch.no_grad():
        for t in (1, 1, 2, 5, 17, 70):
            x = torch.randn(t, quant.config.hidden_size, generator=gen)
            weights = torch.rand(t, 2, generator=gen)
            experts = torch.stack([torch.randperm(n, generator=gen)[:2] for _ in range(t)])
            own = torch.empty(t, 2, x.shape[1])
            for e in experts.unique().tolist():  # each expert alone on its rows
                rows, ranks = (experts == e).nonzero(as_tuple=True)
                own[rows, ranks] = moe.experts[e](x[rows])
            want = (own[:, 0].float() * weights[:, :1] + own[:, 1].float() * weights[:, 1:2]).to(x.dtype)
            calls.clear()
            with monkeypatch.context() as m:
                m.setattr(layers, "ggml_linear_grouped", counted)
                got = mix_experts(moe.experts, x, weights, experts)
            chosen = len(experts.unique())
            assert calls == [[2] * chosen, [1] * chosen]  # every chosen expert's gate and up, then every down
            assert torch.equal(got, want), t
    qcase = make_case(quant, TEXT[:60], 12)
    check_scripted(qcase, "partly", 4)
