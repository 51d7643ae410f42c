"""FP8 (E4M3) weights: quantization error bounds, FP8Linear, published checkpoint layouts, export.

* ``quantize_fp8`` / ``dequantize_fp8``: every element within E4M3's rounding bound of its scale,
  for per-channel, per-tensor, 2-D block and group scales, partial blocks included;
* ``FP8Linear`` computes ``x @ dequant(W).T + b`` and is batch-invariant (a row alone gives
  bitwise what it gives among others), on the dequantizing path and the FP8 x FP8 path;
* tiny checkpoints written in the compressed-tensors layout (bf16 per-channel scales, unused
  activation scales and zero points, shards) and the block "fp8" layout (``weight_scale_inv``)
  load to exactly the logits of a plain model holding the dequantized weights;
* ``quickdraft quantize --fp8`` on tiny HF and GGUF models writes a folder that loads on its own
  and generates; speculative greedy decoding on an FP8 model equals plain greedy decoding;
* unsupported quantization configs and incomplete checkpoints fail with a QuickdraftError.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tiny import hf_to_gguf, make_tiny_hf_model

from quickdraft.api import LLM
from quickdraft.cli.main import main
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.export.fp8 import write_tokenizer_files
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.quant import fp8
from quickdraft.quant.fp8 import (
    FP8_DTYPE,
    FP8Linear,
    dequantize_fp8,
    fp8_format,
    fp8_to_float,
    quantize_fp8,
    resolve_block,
    scale_shape,
    using_activation_mode,
)
from quickdraft.sampling import SamplingParams
from quickdraft.speculative.ngram import NGramDrafter
from quickdraft.tokenizer import Tokenizer

TEXT = "def fibonacci(n):\n    return the quick brown fox!"
PROMPT = "for i in range(10):\n    print(i, i * i)\nfor i in range(10):\n    print(i"
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread per module


def spread_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes (1e-4 .. 10), a zero row, and some exact zeros."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 10 ** (torch.rand(n, 1, generator=gen) * 5 - 4)
    w[3] = 0.0
    w[:, 7] = 0.0
    return w


def full_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Every weight's scale, [N, K] (the obvious, slow way)."""
    n, k = shape
    return scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


# ------------------------------------------------------------------------- quantize / dequantize


@pytest.mark.parametrize("block", [None, (128, 128), (32, 48), (1, 32), (200, 300)],
                         ids=["channel", "block128", "block32x48", "group32", "tensor"])
def test_round_trip_within_e4m3_rounding(block: tuple[int, int] | None) -> None:
    w = spread_weight(200, 300)
    q, scale = quantize_fp8(w, block)
    b = resolve_block((200, 300), block)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert scale.dtype == torch.float32 and tuple(scale.shape) == scale_shape((200, 300), b)
    s = full_scale(scale, (200, 300), b)
    dq = dequantize_fp8(q, scale, b)
    assert torch.equal(dq, q.float() * s)  # the fast dequantization is the plain product
    # Round to nearest with 3 mantissa bits: relative error <= 2^-4, and <= half the subnormal
    # step (2^-9 * s) near zero.
    bound = torch.maximum(w.abs() * 2**-4, s * 2**-10) * (1 + 1e-5)
    assert bool(((dq - w).abs() <= bound).all())
    assert bool((dq[3] == 0).all()) and bool((dq[:, 7] == 0).all())
    # Each block's largest magnitude lands exactly on E4M3's maximum, 448 (scale = amax / 448).
    nb_n, nb_k = scale.shape
    for i in range(nb_n):
        for j in range(nb_k):
            blk = q[i * b[0] : (i + 1) * b[0], j * b[1] : (j + 1) * b[1]].float().abs()
            if float(w[i * b[0] : (i + 1) * b[0], j * b[1] : (j + 1) * b[1]].abs().max()) > 0:
                assert float(blk.max()) == 448.0


def test_channel_scales_keep_small_rows_accurate_where_one_scale_does_not() -> None:
    """Rows 5 orders of magnitude apart: a per-tensor scale flushes the small rows to (near) zero,
    per-channel scales keep every row within 2^-4 relative error."""
    w = spread_weight(64, 96, seed=1)
    w[0] *= 1e6 / float(w[0].abs().max())  # one row ~1e6 times larger than the smallest ones
    rel = {}
    for name, block in (("channel", None), ("tensor", (64, 96))):
        q, s = quantize_fp8(w, block)
        dq = dequantize_fp8(q, s, resolve_block((64, 96), block))
        row_err = (dq - w).norm(dim=1) / w.norm(dim=1).clamp_min(1e-30)
        rel[name] = float(row_err[w.norm(dim=1) > 0].max())
    assert rel["channel"] <= 2**-4
    assert rel["tensor"] > 0.5


@pytest.mark.parametrize("block", [None, (32, 48)], ids=["channel", "block"])
def test_mse_observer_never_does_worse_than_minmax(block: tuple[int, int] | None) -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(96, 160, generator=gen)
    w[torch.rand(96, 160, generator=gen) < 0.002] *= 8  # a few outliers, as real weights have
    b = resolve_block((96, 160), block)
    err = {}
    for observer in ("minmax", "mse"):
        q, s = quantize_fp8(w, block, observer)
        sq = (dequantize_fp8(q, s, b) - w).square()
        err[observer] = F.pad(sq, (0, -160 % b[1], 0, -96 % b[0])).view(s.shape[0], b[0], s.shape[1], b[1]).sum((1, 3))
        if observer == "mse":  # scales searched between 0.8 and 1 times amax / 448
            _, s_minmax = quantize_fp8(w, block)
            assert bool(((s <= s_minmax * (1 + 1e-6)) & (s >= s_minmax * 0.8 * (1 - 1e-6))).all())
    assert bool((err["mse"] <= err["minmax"] * (1 + 1e-5)).all())  # 1.0 x amax is a candidate
    assert float(err["mse"].sum()) < 0.99 * float(err["minmax"].sum())
    with pytest.raises(QuickdraftError, match="observer"):
        quantize_fp8(w, block, "percentile")


def test_fp8_to_float_is_exact_for_every_code() -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
    expected = codes.float()
    got = fp8_to_float(codes)
    finite = ~expected.isnan()
    assert int(finite.sum()) == 254
    assert torch.equal(got[finite], expected[finite])


# ------------------------------------------------------------------------------------ FP8Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [None, (32, 48)], ids=["channel", "block"])
def test_fp8linear_computes_the_dequantized_product(dtype: torch.dtype, block: tuple[int, int] | None) -> None:
    w = spread_weight(96, 160, seed=2)
    bias = torch.randn(96)
    layer = FP8Linear.from_float(w, bias=bias.to(dtype), block=block)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_bytes < w.numel() * 2
    dq = layer.dequantize()
    assert torch.equal(dq, dequantize_fp8(layer.weight, layer.weight_scale, layer.block))
    assert torch.equal(layer.dequantize(dtype), dq.to(dtype))
    x = torch.randn(11, 160)
    y = layer(x.to(dtype))
    assert y.dtype == dtype and y.shape == (11, 96)
    ref = x.to(dtype).double() @ dq.to(dtype).double().T + bias.to(dtype).double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert float((y.double() - ref).abs().max()) <= tol * float(ref.abs().max())
    y3 = layer(x.to(dtype).reshape(1, 11, 160))  # leading dims are kept
    assert torch.equal(y3[0], y)


def assert_batch_invariant(layer: torch.nn.Module, x: torch.Tensor) -> None:
    full = layer(x)
    for i in range(x.shape[0]):
        assert torch.equal(layer(x[i : i + 1])[0], full[i]), f"row {i} alone differs"
    for t in (2, 5, 8, 9, 17):
        assert torch.equal(layer(x[:t]), full[:t]), f"first {t} rows differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [None, (32, 48)], ids=["channel", "block"])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "row-chunks"])
def test_fp8linear_is_batch_invariant(
    dtype: torch.dtype, block: tuple[int, int] | None, chunked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if chunked:  # big layers dequantize a few output rows at a time
        monkeypatch.setattr(fp8, "_CHUNK_ELEMS", 40 * 160)
    gen = torch.Generator().manual_seed(3)
    layer = FP8Linear.from_float(torch.randn(96, 160, generator=gen), bias=torch.randn(96).to(dtype), block=block)
    x = torch.randn(24, 160, generator=gen).to(dtype)
    assert_batch_invariant(layer, x)
    whole = x.double() @ layer.dequantize(dtype).double().T + layer.bias.double()  # type: ignore[union-attr]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert float((layer(x).double() - whole).abs().max()) <= tol * float(whole.abs().max())


def test_dequantized_cache_is_opt_in_and_changes_nothing() -> None:
    layer = FP8Linear.from_float(torch.randn(64, 80), block=(32, 32))
    x = torch.randn(6, 80, dtype=torch.bfloat16)
    plain = layer(x)
    assert layer._cache is None
    assert fp8.cache_dequantized_weights(torch.nn.Sequential(layer)) == 1
    assert torch.equal(layer(x), plain)
    assert layer._cache is not None and layer._cache.dtype == torch.bfloat16
    layer.cache_dequantized(False)
    assert layer._cache is None


def test_fp8_activation_path_is_close_and_batch_invariant() -> None:
    """Per-token FP8 activations through torch._scaled_mm (the path FP8 GPUs take, forced here on
    the CPU): within activation rounding of the weight-only result, and still batch-invariant."""
    gen = torch.Generator().manual_seed(4)
    layer = FP8Linear.from_float(torch.randn(96, 160, generator=gen) / 13, bias=torch.randn(96))
    x = torch.randn(20, 160, generator=gen)
    with using_activation_mode("weight-only"):
        exact = layer(x)
    with using_activation_mode("fp8"):
        assert layer._use_scaled_mm(x)
        fast = layer(x)
        assert_batch_invariant(layer, x)
        blocked = FP8Linear.from_float(torch.randn(96, 160, generator=gen), block=(32, 32))
        assert not blocked._use_scaled_mm(x)  # block scales always dequantize
    err = float((fast - exact).norm() / exact.norm())
    assert 1e-4 < err < 0.06  # E4M3 activations: a few percent, but really quantized
    with using_activation_mode("auto"):
        assert not layer._use_scaled_mm(x)  # CPU: weight-only by default
    with pytest.raises(QuickdraftError, match="weight-only"):
        fp8.set_activation_mode("int4")


# ------------------------------------------------------------------------ checkpoint layouts


def _linear_names(state: dict[str, torch.Tensor]) -> list[str]:
    return [k.removesuffix(".weight") for k in state if k.endswith(tuple(f"{s}.weight" for s in LINEAR_SUFFIXES))]


def write_fp8_checkpoint(
    src: Path, dst: Path, ref: Path, method: str, block: tuple[int, int] | None, shards: bool = False
) -> None:
    """Quantize ``src``'s Linear weights into ``dst`` as published checkpoints store them, and
    write ``ref``: the same model with the dequantized weights as plain fp32 tensors."""
    state = load_file(str(src / "model.safetensors"))
    fp8_state: dict[str, torch.Tensor] = {}
    ref_state = dict(state)
    names = _linear_names(state)
    for name in names:
        w = state.pop(f"{name}.weight")
        q, scale = quantize_fp8(w, block)
        shape = (int(w.shape[0]), int(w.shape[1]))
        b = resolve_block(shape, block)
        if method == "compressed-tensors":  # llm-compressor stores scales in the weights' dtype
            scale = scale.to(torch.bfloat16).reshape(-1, 1)
            fp8_state[f"{name}.weight_scale"] = scale
            fp8_state[f"{name}.weight_zero_point"] = torch.zeros(w.shape[0], 1, dtype=FP8_DTYPE)
            fp8_state[f"{name}.input_scale"] = torch.tensor([0.02], dtype=torch.bfloat16)
        else:
            fp8_state[f"{name}.weight_scale_inv"] = scale
        fp8_state[f"{name}.weight"] = q
        ref_state[f"{name}.weight"] = q.float() * full_scale(scale.float().reshape(scale_shape(shape, b)), shape, b)
    config = json.loads((src / "config.json").read_text())
    if method == "compressed-tensors":
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True},
            }},
            "ignore": ["lm_head"], "kv_cache_scheme": None,
        }
    else:
        config["quantization_config"] = {
            "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "weight_block_size": list(block or ()), "modules_to_not_convert": ["lm_head"],
        }
    for folder, cfg in ((dst, config), (ref, json.loads((src / "config.json").read_text()))):
        shutil.copytree(src, folder)
        (folder / "model.safetensors").unlink()
        (folder / "config.json").write_text(json.dumps(cfg))
    save_file(ref_state, str(ref / "model.safetensors"))
    combined = {**state, **fp8_state}
    if not shards:
        save_file(combined, str(dst / "model.safetensors"))
        return
    # Scales in the second shard, their weights in the first: pairing must not depend on order.
    second = {k: v for k, v in combined.items() if "scale" in k}
    first = {k: v for k, v in combined.items() if k not in second}
    save_file(first, str(dst / "model-00001-of-00002.safetensors"))
    save_file(second, str(dst / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {**dict.fromkeys(first, "model-00001-of-00002.safetensors"),
                            **dict.fromkeys(second, "model-00002-of-00002.safetensors")}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fp8")


@pytest.fixture(scope="module")
def tiny_src(root: Path) -> Path:
    return make_tiny_hf_model(root, "qwen2", seed=5, name="src")


CHECKPOINTS = {
    "compressed-tensors": ("compressed-tensors", None, False),
    "compressed-tensors-sharded": ("compressed-tensors", None, True),
    "fp8-block": ("fp8", (32, 48), False),
}


def logits_of(loaded: LoadedModel, text: str = TEXT) -> torch.Tensor:
    ids = torch.tensor(loaded.tokenizer.encode(text))
    return loaded.model(ids, loaded.model.new_cache())[0]


def fp8_layers(loaded: LoadedModel) -> dict[str, FP8Linear]:
    return {n: m for n, m in loaded.model.named_modules() if isinstance(m, FP8Linear)}


@pytest.mark.parametrize("case", list(CHECKPOINTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_published_layouts_load_to_the_dequantized_models_logits(
    root: Path, tiny_src: Path, case: str, dtype: str
) -> None:
    method, block, shards = CHECKPOINTS[case]
    dst, ref = root / f"{case}-{dtype}", root / f"{case}-{dtype}-ref"
    write_fp8_checkpoint(tiny_src, dst, ref, method, block, shards)
    loaded = load_model(str(dst), dtype=dtype, max_context=128)
    layers = fp8_layers(loaded)
    assert len(layers) == 7 * loaded.config.num_hidden_layers
    assert type(loaded.model.lm_head).__name__ == "Linear"  # "ignore" / modules_to_not_convert
    expected_block = (1, 64) if block is None else block
    assert layers["model.layers.0.self_attn.q_proj"].block == expected_block
    assert layers["model.layers.0.self_attn.q_proj"].bias is not None  # qwen2 q/k/v biases loaded
    reference = load_model(str(ref), dtype=dtype, max_context=128)
    assert torch.equal(logits_of(loaded), logits_of(reference))


def test_fp8_config_is_read_as_declared() -> None:
    fmt = fp8_format({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    assert fmt is not None and fmt.blocks == ((128, 128),) and "weight_scale_inv" in fmt.scale_names
    ct = fp8_format({"compression_config": {  # the older key
        "quant_method": "compressed-tensors", "format": "naive-quantized",
        "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": "64x32"}}},
    }})
    assert ct is not None and ct.blocks == ((64, 32),) and ct.scale_names == ("weight_scale",)
    assert fp8_format({"model_type": "llama"}) is None


UNSUPPORTED = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128}, "awq"),
    "gptq": ({"quant_method": "gptq", "bits": 4}, "gptq"),
    "int8": ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}, "int-quantized"),
    "int4-packed": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}, "pack-quantized"),
    "e5m2": ({"quant_method": "fp8", "fmt": "e5m2"}, "e5m2"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_quantization_is_a_clear_error(root: Path, tiny_src: Path, case: str) -> None:
    qc, word = UNSUPPORTED[case]
    folder = root / f"unsupported-{case}"
    shutil.copytree(tiny_src, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuickdraftError) as info:
        load_model(str(folder), dtype="float32")
    message = str(info.value)
    assert word in message and "quickdraft quantize --fp8" in message


def _broken_copy(root: Path, tiny_src: Path, name: str, edit: Any) -> Path:
    good, ref = root / f"{name}-good", root / f"{name}-ref"
    write_fp8_checkpoint(tiny_src, good, ref, "compressed-tensors", None)
    state = load_file(str(good / "model.safetensors"))
    edit(state)
    save_file(state, str(good / "model.safetensors"))
    return good


def test_missing_scale_is_a_clear_error(root: Path, tiny_src: Path) -> None:
    name = "model.layers.1.mlp.up_proj"
    folder = _broken_copy(root, tiny_src, "no-scale", lambda s: s.pop(f"{name}.weight_scale"))
    with pytest.raises(QuickdraftError, match=rf"{name}\.weight has no scale tensor \({name}\.weight_scale\)"):
        load_model(str(folder), dtype="float32")


def test_wrong_scale_shape_and_asymmetric_weights_are_errors(root: Path, tiny_src: Path) -> None:
    name = "model.layers.0.self_attn.o_proj"

    def bad_shape(s: dict[str, torch.Tensor]) -> None:
        s[f"{name}.weight_scale"] = torch.ones(5, 3)

    folder = _broken_copy(root, tiny_src, "bad-shape", bad_shape)
    with pytest.raises(QuickdraftError, match="matches no blocking"):
        load_model(str(folder), dtype="float32")

    def zero_point(s: dict[str, torch.Tensor]) -> None:
        s[f"{name}.weight_zero_point"] = torch.ones(64, 1).to(FP8_DTYPE)

    folder = _broken_copy(root, tiny_src, "zero-point", zero_point)
    with pytest.raises(QuickdraftError, match="asymmetric"):
        load_model(str(folder), dtype="float32")


# ------------------------------------------------------------------------ quickdraft quantize


@pytest.fixture(scope="module")
def quantized(root: Path, tiny_src: Path) -> Path:
    out = root / "cli-channel"
    assert main(["quantize", "--fp8", str(tiny_src), "--out", str(out)]) == 0
    return out


def test_quantize_writes_a_self_contained_compressed_tensors_folder(quantized: Path, tiny_src: Path) -> None:
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in quantized.iterdir()}
    config = json.loads((quantized / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    assert qc["config_groups"]["group_0"]["weights"]["strategy"] == "channel" and qc["ignore"] == ["lm_head"]
    state = load_file(str(quantized / "model.safetensors"))
    assert state["model.layers.0.mlp.down_proj.weight"].dtype == FP8_DTYPE
    assert state["model.layers.0.mlp.down_proj.weight_scale"].shape == (64, 1)
    assert state["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert state["lm_head.weight"].dtype == torch.bfloat16

    original = load_model(str(tiny_src), dtype="float32", max_context=128)
    loaded = load_model(str(quantized), dtype="float32", max_context=128)
    assert len(fp8_layers(loaded)) == 7 * loaded.config.num_hidden_layers
    assert loaded.tokenizer.encode(TEXT) == original.tokenizer.encode(TEXT)
    a, b = logits_of(original), logits_of(loaded)
    assert float((a - b).abs().max()) < 0.1 * float(a.abs().max())  # FP8 moves logits a little
    assert float((a - b).abs().max()) > 1e-4  # ... but really moves them
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) >= 0.8

    llm = LLM(str(quantized), draft="none")  # default dtype: bf16 activations
    out = llm.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert len(out.token_ids) == 12 and out.text


def test_quantize_block_scheme_and_requantizing_an_fp8_folder(quantized: Path, root: Path) -> None:
    out = root / "cli-block"
    argv = ["quantize", "--fp8", str(quantized), "--out", str(out), "--scheme", "block", "--block-size", "32", "48",
            "--observer", "mse"]
    assert main(argv) == 0
    weights = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert weights["strategy"] == "block" and weights["block_structure"] == [32, 48] and weights["observer"] == "mse"
    loaded = load_model(str(out), dtype="float32", max_context=128)
    layer = fp8_layers(loaded)["model.layers.1.mlp.gate_proj"]
    assert layer.block == (32, 48) and layer.weight_scale.shape == (4, 2)
    source = load_model(str(quantized), dtype="float32", max_context=128)
    a, b = logits_of(source), logits_of(loaded)
    assert float((a - b).abs().max()) < 0.1 * float(a.abs().max())


def test_quantize_a_gguf_writes_its_tokenizer_and_config(root: Path, tiny_src: Path) -> None:
    gguf = hf_to_gguf(make_tiny_hf_model(root, "llama", seed=6, name="llama-src", tie_word_embeddings=True),
                      root / "tiny.gguf")
    out = root / "from-gguf"
    assert main(["quantize", "--fp8", str(gguf), "--out", str(out), "--quantize-lm-head"]) == 0
    original = load_model(str(gguf), dtype="float32", max_context=128)
    loaded = load_model(str(out), dtype="float32", max_context=128)
    assert dataclasses.replace(loaded.config, extra={}) == dataclasses.replace(original.config, extra={})
    tok, ref = loaded.tokenizer, original.tokenizer
    assert tok.encode(TEXT) == ref.encode(TEXT)
    assert (tok.bos_id, tok.eos_ids, tok.add_bos) == (ref.bos_id, ref.eos_ids, ref.add_bos)
    assert tok.fingerprint() == ref.fingerprint()
    assert "lm_head" not in fp8_layers(loaded)  # tied to the embedding: stays bf16 even when asked
    a, b = logits_of(original), logits_of(loaded)
    assert float((a - b).abs().max()) < 0.1 * float(a.abs().max())


def test_quantize_cli_errors(quantized: Path, tiny_src: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quantize", str(tiny_src), "--out", str(quantized.parent / "x")]) == 2
    assert "--fp8" in capsys.readouterr().err
    assert main(["quantize", "--fp8", str(tiny_src), "--out", str(quantized)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["quantize", "--fp8", str(tiny_src / "nope"), "--out", str(quantized.parent / "y")]) == 2
    assert "no such file" in capsys.readouterr().err


# ---------------------------------------------------------------- speculative decoding on FP8


def greedy(loaded: LoadedModel, n: int, drafter: NGramDrafter | None = None, k: int = 0) -> tuple[list[int], int]:
    """Greedy ids and how many tokens were drafted."""
    engine = Engine(loaded.model, loaded.tokenizer)
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    steps = list(engine.generate(loaded.tokenizer.encode(PROMPT), params, drafter, k))
    return [t for s in steps for t in s.token_ids], steps[-1].stats.drafted


@pytest.mark.parametrize("dtype,mode", [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8")])
def test_ngram_speculation_on_fp8_equals_plain_greedy(quantized: Path, dtype: str, mode: str) -> None:
    loaded = load_model(str(quantized), dtype=dtype, max_context=256)
    assert fp8_layers(loaded)
    with using_activation_mode(mode):
        truth, _ = greedy(loaded, 40)
        assert len(truth) == 40
        for k in (2, 5):
            ids, drafted = greedy(loaded, 40, NGramDrafter(min_ngram=1), k)
            assert ids == truth
            assert drafted > 0  # the verify passes really had several rows


# ------------------------------------------------------------------------------ real tokenizer


@pytest.mark.slow
def test_gguf_tokenizer_written_as_hf_files_is_the_same(smollm2_gguf: Path, tmp_path: Path) -> None:
    ref = Tokenizer.from_gguf(smollm2_gguf)
    write_tokenizer_files(ref, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": sorted(ref.eos_ids)}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    for text in (TEXT, "  x  1\n\n\tü ß 😀 <|im_start|>user\nhi<|im_end|>", "12345 67"):
        assert tok.encode(text) == ref.encode(text)
        assert tok.decode(ref.encode(text)) == ref.decode(ref.encode(text))
    assert (tok.bos_id, tok.eos_ids, tok.add_bos, tok.chat_template) == (ref.bos_id, ref.eos_ids, ref.add_bos, ref.chat_template)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tok.encode_chat(messages) == ref.encode_chat(messages)
    assert tok.fingerprint() == ref.fingerprint()
    assert tok.vocab_size == ref.vocab_size
