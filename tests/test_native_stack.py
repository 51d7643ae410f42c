"""The native decoder stack (quickdraft/models/native.py, kernels/decode_cpu.cpp): a whole decode /
verify pass in one C++ call must give bitwise the Python layers' results (chains, trees, captured
hidden states, every GGML format incl. the Q4_K / Q6_K lane layouts), and must step aside wherever
it does not apply (f32 activations, reference path, fp32 weights, other layer types, bigger passes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from helpers import GREEDY, MB, check_together_equals_alone, generate, model_pass, run, tokens
from tiny import (
    GEMMA4_MOE,
    gemma4_to_gguf,
    gpt_oss_to_gguf,
    hf_to_gguf,
    make_tiny_hf_model,
    qwen3_5_to_gguf,
)

from quickdraft.engine import Engine
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.models.batch_invariance import BLOCKED_MAX_ROWS, NATIVE_CHAIN_ROWS, Linear
from quickdraft.models.causal_lm import CausalLM
from quickdraft.models.native import DenseStack, PerLayerCacheStack
from quickdraft.models.qwen3_5 import HybridStack
from quickdraft.prefix_cache import PrefixCache
from quickdraft.quant.ggml import GGMLLinear, kernels_active, reference_mode, set_activation_mode
from quickdraft.speculative.ngram import NGramDrafter

Q = GGMLQuantizationType
pytestmark = pytest.mark.skipif(not kernels_active(), reason="the native kernels are not built on this machine")

LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
MIXED = dict(zip((f"{n}.weight" for n in LINEARS), ("Q8_0", "Q4_0", "Q5_0", "Q8_0", "Q4_0", "Q8_0", "Q5_0"), strict=True))
MIXED["output.weight"] = "Q8_0"


def quantized_tiny(root: Path, model_type: str, **overrides) -> LoadedModel:  # noqa: ANN003
    """A tiny random model converted to GGUF with its layer linears in 32-block formats."""
    folder = make_tiny_hf_model(root, model_type, seed=5, name=f"{model_type}-native", **overrides)
    path = hf_to_gguf(folder, root / f"{model_type}-native.gguf", MIXED)
    return load_model(str(path), dtype="auto", max_context=256)  # auto: GGUF blocks stay blocks


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, seed: int) -> torch.Tensor:
    """Random valid blocks (random bytes, small finite fp16 scales)."""
    rng = np.random.default_rng(seed)
    bs, ts = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n * k // bs, ts), dtype=np.uint8)
    offs = {Q.Q4_K: (0, 2), Q.Q6_K: (208,), Q.Q8_0: (0,)}[qtype]
    for off in offs:
        raw[:, off : off + 2] = (rng.standard_normal((raw.shape[0], 1)) * 0.002).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def k_quant_tiny(root: Path) -> CausalLM:
    """A hidden-256 model whose layer linears are random Q4_K / Q6_K / Q8_0 blocks (the lane
    layouts of the q8 GEMM), built in memory: gguf-py cannot write K-quants."""
    folder = make_tiny_hf_model(root, "qwen2", seed=9, name="kquant-native", hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    model = load_model(str(folder), dtype="float32", max_context=256).model
    kinds = [Q.Q4_K, Q.Q6_K, Q.Q8_0]
    for i, layer in enumerate(model.model.layers):
        a, mlp = layer.self_attn, layer.mlp
        for j, name in enumerate(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
            owner = a if name.endswith("proj") and hasattr(a, name) else mlp
            old = getattr(owner, name)
            qt = kinds[(i + j) % 3]
            setattr(owner, name, GGMLLinear(qt, random_blocks(qt, old.out_features, old.in_features, 10 * i + j),
                                            old.in_features, bias=old.bias))
    return model


def python_path(model: CausalLM):  # noqa: ANN201 (a context manager)
    """Runs ``model`` on the Python layers (the native stack switched off) inside the block."""

    class _Off:
        def __enter__(self) -> None:
            model._native.get = lambda x: None  # type: ignore[method-assign]

        def __exit__(self, *exc: object) -> None:
            del model._native.get

    return _Off()


def tree_mask(start: int, parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [T, start + T], positions [T]) of a draft tree given each node's parent (-1 = root)."""
    t = len(parents)
    mask = torch.zeros(t, start + t, dtype=torch.bool)
    mask[:, :start] = True
    depth = []
    for i, p in enumerate(parents):
        mask[i, start + i] = True
        if p >= 0:
            mask[i, start : start + t] |= mask[p, start : start + t]
        depth.append(0 if p < 0 else depth[p] + 1)
    return mask, torch.tensor([start - 1 + 1 + d for d in depth])


def kv_slabs(cache) -> tuple:  # noqa: ANN001
    """The keys and values a pass left in a cache of one [layers, kv heads, S, D] slab each."""
    return cache.k[:, :, : cache.length].clone(), cache.v[:, :, : cache.length].clone()


def both_paths(model: CausalLM, prompt: list[int], ids: list[int], read=kv_slabs, **kw):  # noqa: ANN001, ANN003, ANN201
    """(native, python) results of one pass over ``ids`` after ``prompt``: logits, captured, and what
    ``read`` takes from the cache."""
    out = []
    for native in (True, False):
        cache = model.new_cache()
        model(torch.tensor(prompt), cache)
        if native:
            logits, captured = model_pass(model, torch.tensor(ids), cache, **kw)
            assert model._native._stack is not None  # the pass ran natively
        else:
            with python_path(model):
                logits, captured = model_pass(model, torch.tensor(ids), cache, **kw)
        out.append((logits, captured, *read(cache)))
    return out


def assert_same(a, b) -> None:  # noqa: ANN001
    logits_a, cap_a, k_a, v_a = a
    logits_b, cap_b, k_b, v_b = b
    assert torch.equal(logits_a, logits_b)
    assert len(cap_a) == len(cap_b) and all(torch.equal(x, y) for x, y in zip(cap_a, cap_b, strict=True))
    assert torch.equal(k_a, k_b) and torch.equal(v_a, v_b)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("native")


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def quantized(request: pytest.FixtureRequest, root: Path) -> LoadedModel:
    return quantized_tiny(root, request.param)


PROMPT = [5, 17, 42, 99, 3, 150, 7, 8, 60, 61, 62, 200]


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 33])
def test_chain_rows_bitwise_equal_python(quantized: LoadedModel, rows: int) -> None:
    model = quantized.model
    with torch.inference_mode():  # (as in forward)
        assert model._native.get(torch.zeros(1, 1)) is not None  # it applies here
    ids = [(11 * i + 4) % 250 + 3 for i in range(rows)]
    native, python = both_paths(model, PROMPT, ids, capture=[0, 1, 2])
    assert_same(native, python)
    assert len(native[1]) == 3  # input of layer 0, of layer 1, and the last layer's output


def test_tree_rows_bitwise_equal_python(quantized: LoadedModel) -> None:
    model = quantized.model
    mask, pos = tree_mask(len(PROMPT), [-1, 0, 0, 1, 1, 2, 5])
    native, python = both_paths(model, PROMPT, [9, 30, 31, 40, 41, 50, 60], mask=mask, positions=pos, capture=[1])
    assert_same(native, python)


def test_k_quant_lanes_stack_bitwise_equal_python(root: Path) -> None:
    model = k_quant_tiny(root)
    for rows in (1, 4, 8):
        ids = [(7 * i + 3) % 250 + 3 for i in range(rows)]
        assert_same(*both_paths(model, PROMPT, ids, capture=[3]))
    assert all(m._lanes for m in model.modules() if isinstance(m, GGMLLinear) and m.qtype in (Q.Q4_K, Q.Q6_K))
    mask, pos = tree_mask(len(PROMPT), [-1, 0, 1, 0])
    assert_same(*both_paths(model, PROMPT, [9, 30, 31, 40], mask=mask, positions=pos))


def test_stack_steps_aside_where_it_does_not_apply(quantized: LoadedModel, root: Path) -> None:
    model = quantized.model
    layers, x = model.model.layers, torch.zeros(1, 1)
    get = torch.inference_mode()(model._native.get)  # as forward calls it
    stack = get(x)
    assert isinstance(stack, DenseStack) and stack.native.num_layers() == len(layers)
    assert get(x) is stack  # cached while nothing changes
    assert get(x.double()) is None
    assert model._native.get(x) is None  # autograd on: the differentiable Python layers
    with reference_mode():
        assert get(x) is None
    # f32 activations: the Python layers run (and give what they gave before); back to q8: rebuilt
    ids = [4, 5, 6]
    set_activation_mode(model, "f32")
    try:
        assert get(x) is None
    finally:
        set_activation_mode(model, None)
    rebuilt = get(x)
    assert rebuilt is not None and rebuilt is not stack
    assert_same(*both_paths(model, PROMPT, ids))
    # long passes (prefills) run the Python layers, whose output is the same function
    long = list(range(3, 3 + BLOCKED_MAX_ROWS + 1))
    cache = model.new_cache()
    model(torch.tensor(long), cache)  # no error, no stack call needed
    # fp32 weights (no GGML blocks) and other layer types: no stack
    fp32 = load_model(str(make_tiny_hf_model(root, "llama", seed=5, name="fp32-native")), dtype="float32").model
    assert torch.inference_mode()(fp32._native.get)(x) is None
    gemma = load_model(str(make_tiny_hf_model(root, "gemma3_text", seed=5, name="gemma-native")), dtype="float32").model
    assert torch.inference_mode()(gemma._native.get)(x) is None


def test_cut_output_vocabulary_of_a_quantized_head(quantized: LoadedModel) -> None:
    """set_output_vocab on GGML blocks: the kept rows' logits are bitwise the full head's."""
    model = quantized.model
    assert isinstance(model.lm_head, GGMLLinear)
    full = both_paths(model, PROMPT, [3, 4])[0][0]
    ids = torch.tensor([0, 1, 2, 7, 50, 51, 299])
    assert model.set_output_vocab(ids)
    try:
        cut = both_paths(model, PROMPT, [3, 4])[0][0]
    finally:
        model.set_output_vocab(None)
    assert torch.equal(cut[:, ids], full[:, ids])
    assert int(torch.isfinite(cut).sum()) == 2 * ids.numel()


def test_long_prefill_passes_are_bitwise_short_ones(quantized: LoadedModel) -> None:
    """On the native path a chain of up to NATIVE_CHAIN_ROWS rows is computed row by row as a
    64-row pass or a single row is: one 250-row pass, 64-row passes and single rows give the same
    logits for every row, so the longer prefill passes (``prefill_rows``) keep prefix reuse exact."""
    model = quantized.model
    assert model.prefill_rows() == NATIVE_CHAIN_ROWS > BLOCKED_MAX_ROWS
    ids = torch.tensor([(11 * i + 4) % 250 + 3 for i in range(250)])

    def cut(rows: int) -> torch.Tensor:
        cache = model.new_cache()
        return torch.cat([model(ids[s : s + rows], cache)[0] for s in range(0, len(ids), rows)])

    whole = cut(250)
    assert torch.equal(whole, cut(64))
    assert torch.equal(whole[:40], cut(1)[:40])
    cache = model.new_cache()
    assert torch.equal(model.prefill(ids, cache), whole[-1:])  # the engine's prefill of a prompt alone
    with reference_mode():  # without the kernels: the 64-row passes of before
        assert model.prefill_rows() == BLOCKED_MAX_ROWS


def test_a_prefill_pass_of_up_to_native_chain_rows_runs_in_the_stack(
    quantized: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chain longer than BLOCKED_MAX_ROWS (a prompt's prefill pass, up to NATIVE_CHAIN_ROWS rows)
    runs as one native call, not the Python layers; a longer one, or a tree that long, does not."""
    model = quantized.model
    asked: list[tuple[int, bool]] = []
    native = model._native.get

    def get(x: torch.Tensor) -> object:
        stack = native(x)
        asked.append((x.shape[0], stack is not None))
        return stack

    monkeypatch.setattr(model._native, "get", get)
    ids = torch.tensor([(11 * i + 4) % 250 + 3 for i in range(NATIVE_CHAIN_ROWS)])
    model(ids, model.new_cache())
    model_pass(model, ids[:200], model.new_cache(), mask=torch.ones(200, 200, dtype=torch.bool).tril())  # a 200-row tree
    assert asked == [(NATIVE_CHAIN_ROWS, True)]


@pytest.mark.parametrize("outputs", [1, 2, 3, 4, 16])
def test_a_float_linear_row_is_the_same_in_any_pass(outputs: int) -> None:
    """Linear's blocked matmul gives a row the same bits alone, in a 64-row pass and in a 250-row
    one, also with 2 or 3 output columns (torch's CPU GEMM sums those in an order that depends on the
    other rows: a tiny Gated DeltaNet's b / a projections; they run padded to 4)."""
    gen = torch.Generator().manual_seed(outputs)
    layer = Linear(64, outputs, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(outputs, 64, generator=gen))
        layer.bias.copy_(torch.randn(outputs, generator=gen))
        x = torch.randn(250, 64, generator=gen)
        whole = layer(x)
        torch.testing.assert_close(whole, x @ layer.weight.T + layer.bias, rtol=1e-5, atol=1e-5)
        assert torch.equal(whole[:64], layer(x[:64]))
        assert all(torch.equal(layer(x[i : i + 1])[0], whole[i]) for i in range(0, 250, 7))


# ------------------------------------------------------------------- Qwen3.5's hybrid stack

HYBRID_Q8 = {name: "Q8_0" for name in ("attn_qkv.weight", "attn_gate.weight", "ssm_out.weight", "attn_q.weight",
                                       "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
                                       "ffn_up.weight", "ffn_down.weight")}


_BUILT: dict[tuple[Path, str], LoadedModel] = {}


def tiny(root: Path, name: str) -> LoadedModel:
    """The tiny GGUF model ``name`` (one of STACK_MODELS) built once per module."""
    if (root, name) not in _BUILT:
        _BUILT[root, name] = STACK_MODELS[name](root)
    return _BUILT[root, name]


def hybrid_model(root: Path, q8_b_a: bool) -> LoadedModel:
    """Tiny Qwen3.5 (linear, full, linear layers; partial RoPE) as a Q8_0 GGUF, its Gated DeltaNet b / a
    projections float32 (as llama.cpp's quantizer leaves them) or Q8_0 too."""
    qtypes = HYBRID_Q8 | ({"ssm_beta.weight": "Q8_0", "ssm_alpha.weight": "Q8_0"} if q8_b_a else {})
    folder = make_tiny_hf_model(root, "qwen3_5_text", seed=7, name="hybrid-native")
    path = qwen3_5_to_gguf(folder, root / f"hybrid-{int(q8_b_a)}.gguf", qtypes)
    return load_model(str(path), dtype="auto", max_context=256)


@pytest.fixture(scope="module", params=["hybrid", "hybrid-q8-b-a"])
def hybrid(request: pytest.FixtureRequest, root: Path) -> LoadedModel:
    return tiny(root, request.param)


def hybrid_cache(cache) -> tuple:  # noqa: ANN001
    """Keys and values, the rows the pass kept and every layer's recurrent state after each of them."""
    kept = [i for i, k in enumerate(cache.recurrent.kept_rows()) if k]
    states = [s for i in kept for pair in cache.recurrent.row_states(i) for s in pair]
    return (*kv_slabs(cache.attention), kept, states)


def hybrid_paths(model: CausalLM, prompt: list[int], ids: list[int], **kw):  # noqa: ANN003, ANN201
    out = both_paths(model, prompt, ids, read=hybrid_cache, **kw)
    assert isinstance(model._native._stack, HybridStack)  # (the native pass ran on the hybrid stack)
    return out


def assert_hybrid_same(a, b) -> None:  # noqa: ANN001
    assert_same(a[:4], b[:4])
    assert a[4] == b[4] and len(a[5]) == len(b[5]) > 0
    assert all(torch.equal(x, y) for x, y in zip(a[5], b[5], strict=True))


@pytest.mark.parametrize("rows", [1, 3, 9, 70])
def test_hybrid_chain_rows_bitwise_equal_python(hybrid: LoadedModel, rows: int) -> None:
    """Decode steps, verification chains and a prefill pass past BLOCKED_MAX_ROWS: the native hybrid
    stack gives the Python layers' logits, captured states, keys / values and recurrent states bitwise."""
    model = hybrid.model
    with torch.inference_mode():
        assert isinstance(model._native.get(torch.zeros(1, 1)), HybridStack)  # it applies here
    ids = [(11 * i + 4) % 250 + 3 for i in range(rows)]
    native, python = hybrid_paths(model, PROMPT, ids, capture=[0, 3])
    assert_hybrid_same(native, python)
    assert len(native[1]) == 2


def test_hybrid_tree_rows_bitwise_equal_python(hybrid: LoadedModel) -> None:
    model = hybrid.model
    mask, pos = tree_mask(len(PROMPT), [-1, 0, 0, 1, 1, 2, 5])
    native, python = hybrid_paths(model, PROMPT, [9, 30, 31, 40, 41, 50, 60], mask=mask, positions=pos)
    assert_hybrid_same(native, python)
    assert native[4] == list(range(7))  # every row returns its logits: every row keeps its state


def hybrid_moe_model(root: Path) -> LoadedModel:
    """Tiny Qwen3.5-MoE (four routed experts, top 2, renormalised; a shared expert with its sigmoid
    gate; the router float32) with every other matrix Q8_0."""
    moe = make_tiny_hf_model(root, "qwen3_5_moe_text", seed=7, name="hybrid-moe-native")
    qtypes = HYBRID_Q8 | {"exps.weight": "Q8_0", "shexp.weight": "Q8_0"}
    return load_model(str(qwen3_5_to_gguf(moe, root / "moe-native.gguf", qtypes)), dtype="auto", max_context=256)


@pytest.fixture(scope="module")
def hybrid_moe(root: Path) -> LoadedModel:
    return tiny(root, "hybrid-moe")


@pytest.mark.parametrize("rows", [1, 4, 70])
def test_hybrid_moe_rows_bitwise_equal_python(hybrid_moe: LoadedModel, rows: int) -> None:
    """Routed experts in the hybrid stack: each chosen expert once over its rows, outputs summed in
    rank order, the shared expert and its gate, bitwise the Python layers (chains and a tree)."""
    ids = [(13 * i + 5) % 250 + 3 for i in range(rows)]
    assert_hybrid_same(*hybrid_paths(hybrid_moe.model, PROMPT, ids, capture=[1]))
    mask, pos = tree_mask(len(PROMPT), [-1, 0, 0, 1, 2])
    assert_hybrid_same(*hybrid_paths(hybrid_moe.model, PROMPT, [9, 30, 31, 40, 41], mask=mask, positions=pos))


def test_hybrid_stack_steps_aside_for_float_experts_and_weights(root: Path) -> None:
    x = torch.zeros(1, 1)
    moe = make_tiny_hf_model(root, "qwen3_5_moe_text", seed=7, name="hybrid-moe-native")
    q8 = load_model(str(qwen3_5_to_gguf(moe, root / "moe-float-experts.gguf", HYBRID_Q8)), dtype="auto",
                    max_context=256)
    assert torch.inference_mode()(q8.model._native.get)(x) is None  # float32 experts: the Python layers
    fp32 = load_model(str(make_tiny_hf_model(root, "qwen3_5_text", seed=7, name="hybrid-fp32")), dtype="float32")
    assert torch.inference_mode()(fp32.model._native.get)(x) is None  # no GGML blocks


# ------------------------------------------------------------------- Gemma 4's and GPT-OSS's stacks

GEMMA4_Q8 = {name: "Q8_0" for name in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                                       "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")}


def gemma4_model(root: Path, q8_inputs: bool) -> LoadedModel:
    """Tiny Gemma 4 (sliding window 5, full layers of twice the head size, the last two layers reading
    shared keys / values with double-wide MLPs, per-layer inputs) as a Q8_0 GGUF; its per-layer input
    gate float32 or Q8_0 (the projection back, 16 wide, stays float32)."""
    qtypes = GEMMA4_Q8 | ({"inp_gate.weight": "Q8_0"} if q8_inputs else {})
    folder = make_tiny_hf_model(root, "gemma4_text", seed=4, name="gemma4-native")
    path = gemma4_to_gguf(folder, root / f"gemma4-{int(q8_inputs)}.gguf", qtypes)
    return load_model(str(path), dtype="auto", max_context=256)


def gemma4_moe_model(root: Path) -> LoadedModel:
    """Tiny Gemma 4 in the 26B-A4B's layout: four routed experts (top 2) beside every MLP, their
    router with its scales float32, full layers whose values are their keys; every matrix Q8_0."""
    folder = make_tiny_hf_model(root, "gemma4_text", seed=4, name="gemma4-moe-native", **GEMMA4_MOE)
    path = gemma4_to_gguf(folder, root / "gemma4-moe.gguf", GEMMA4_Q8 | {"exps.weight": "Q8_0"})
    return load_model(str(path), dtype="auto", max_context=256)


def gpt_oss_model(root: Path, experts: str) -> LoadedModel:
    """Tiny GPT-OSS (sinks, a window of 5 on alternate layers, YaRN, four experts with biases, top 2)
    with q/k/v/o Q8_0 and its experts MXFP4 (as released) or Q8_0; the router float32."""
    folder = make_tiny_hf_model(root, "gpt_oss", seed=6, name="gpt-oss-native")
    qtypes = {n: "Q8_0" for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")}
    path = gpt_oss_to_gguf(folder, root / f"gpt-oss-{experts}.gguf", qtypes | {"exps.weight": experts})
    return load_model(str(path), dtype="auto", max_context=256)


STACK_MODELS = {
    "hybrid": lambda root: hybrid_model(root, q8_b_a=False),
    "hybrid-q8-b-a": lambda root: hybrid_model(root, q8_b_a=True),
    "hybrid-moe": hybrid_moe_model,
    "gemma4": lambda root: gemma4_model(root, q8_inputs=False),
    "gemma4-q8-inputs": lambda root: gemma4_model(root, q8_inputs=True),
    "gemma4-moe": gemma4_moe_model,
    "gpt-oss": lambda root: gpt_oss_model(root, "MXFP4"),
    "gpt-oss-q8-experts": lambda root: gpt_oss_model(root, "Q8_0"),
}
PER_LAYER = ["gemma4", "gemma4-q8-inputs", "gemma4-moe", "gpt-oss", "gpt-oss-q8-experts"]


def kernel(name: str) -> str:
    """The kernels' class behind a per-layer-cache model's stack."""
    return "Gemma4Stack" if name.startswith("gemma4") else "GptOssStack"


def runs_natively(model: CausalLM, kernel: str) -> bool:
    stack = model._native._stack
    return isinstance(stack, PerLayerCacheStack) and type(stack.native).__name__ == kernel


def layer_views(cache) -> tuple:  # noqa: ANN001
    """Every layer's keys and values (a cache with a view per layer: Gemma 4's, GPT-OSS's)."""
    n = cache.length
    return [k[:, :n].clone() for k in cache.k_layers], [v[:, :n].clone() for v in cache.v_layers]


def per_layer_paths(model: CausalLM, kernel: str, prompt: list[int], ids: list[int], **kw):  # noqa: ANN003, ANN201
    out = both_paths(model, prompt, ids, read=layer_views, **kw)
    assert runs_natively(model, kernel)  # (the native pass ran on the family's stack)
    return out


def assert_per_layer_same(a, b) -> None:  # noqa: ANN001
    assert torch.equal(a[0], b[0])
    assert len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))
    assert all(torch.equal(x, y) for x, y in zip(a[2] + a[3], b[2] + b[3], strict=True))


@pytest.mark.parametrize("name", PER_LAYER)
@pytest.mark.parametrize("rows", [1, 3, 9, 70])
def test_per_layer_chain_rows_bitwise_equal_python(name: str, rows: int, root: Path) -> None:
    model = tiny(root, name).model
    with torch.inference_mode():
        model._native.get(torch.zeros(1, 1))
    assert runs_natively(model, kernel(name))  # it applies here
    ids = [(11 * i + 4) % 250 + 3 for i in range(rows)]
    last = model.config.num_hidden_layers  # (the last layer's output)
    native, python = per_layer_paths(model, kernel(name), PROMPT, ids, capture=[0, 2, last])
    assert_per_layer_same(native, python)
    assert len(native[1]) == 3


@pytest.mark.parametrize("name", PER_LAYER)
def test_per_layer_tree_rows_bitwise_equal_python(name: str, root: Path) -> None:
    """A tree deeper than the sliding window (5): the sliding layers see each row's own window of
    slots (GPT-OSS: its sinks too)."""
    model = tiny(root, name).model
    mask, pos = tree_mask(len(PROMPT), [-1, 0, 1, 2, 3, 4, 5, 1, 7])
    native, python = per_layer_paths(model, kernel(name), PROMPT, [9, 30, 31, 40, 41, 50, 60, 70, 80], mask=mask,
                                     positions=pos)
    assert_per_layer_same(native, python)


@pytest.mark.parametrize("name", list(STACK_MODELS))
def test_stack_decoding_and_speculation_are_the_python_layers_tokens(name: str, root: Path) -> None:
    """Greedy decoding on each family's native stack == on its Python layers, and an n-gram drafter's
    output == plain."""
    loaded = tiny(root, name)
    model = loaded.model
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 9]
    truth = generate(loaded, prompt, max_tokens=20, ignore_eos=True).ids
    assert model._native._stack is not None
    with python_path(model):
        assert generate(loaded, prompt, max_tokens=20, ignore_eos=True).ids == truth
    got = generate(loaded, prompt, NGramDrafter(max_ngram=3, min_ngram=1), 4, max_tokens=20, ignore_eos=True)
    assert got.ids == truth


@pytest.mark.parametrize("name", list(STACK_MODELS))
def test_stack_pooled_rows_and_a_warm_cache_equal_alone(name: str, root: Path) -> None:
    """On each family's stack: requests stepped together (rows of several sequences in one pass, each
    continuing its own lane's keys, values and recurrent state) answer as each alone, and a
    conversation's next turn from the prefix cache answers as a cold run."""
    loaded = tiny(root, name)
    check_together_equals_alone(loaded, 4, 2)
    assert loaded.model._native._stack is not None
    vocab = loaded.config.vocab_size
    engine = Engine(loaded.model, loaded.tokenizer, prefix_cache=PrefixCache(64 * MB))
    history = tokens(1, 100, vocab)
    turn2 = history + run(engine, history, None, 0, GREEDY).ids + tokens(2, 20, vocab)
    warm = run(engine, turn2, None, 0, GREEDY)
    assert engine.prefix_cache.stats.cached_tokens > 0
    assert warm.ids == run(Engine(loaded.model, loaded.tokenizer), turn2, None, 0, GREEDY).ids


def test_gemma4_stack_steps_aside_for_float_experts(root: Path) -> None:
    moe = make_tiny_hf_model(root, "gemma4_text", seed=4, name="gemma4-moe-native", **GEMMA4_MOE)
    q8 = load_model(str(gemma4_to_gguf(moe, root / "gemma4-moe-float.gguf", GEMMA4_Q8)), dtype="auto", max_context=256)
    assert torch.inference_mode()(q8.model._native.get)(torch.zeros(1, 1)) is None  # float32 experts: Python layers
