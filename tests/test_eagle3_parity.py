"""EAGLE-3 heads built by the reference implementations draft in quickdraft as the references do.

Reference: vLLM's ``speculators`` 0.9.0 (installed by ``scripts/setup.sh --test`` with ``--no-deps``
beside the pinned torch). Each head variant is built with speculators' own classes
(``Eagle3SpeculatorConfig`` / ``Eagle3DraftModel``), given random weights, saved with its own
``save_pretrained`` and loaded by quickdraft's ``load_head``. The reference logits are speculators'
own forward: its training-time-test unroll (teacher forced; step k consumes the state step k - 1
produced at the same row, and attends to the step-0 keys of its prefix plus its own drafted keys).
quickdraft runs the same thing the way it drafts: the prefix as committed rows, then one drafted
row per step at the next position, fed the head's own state. float32 throughout; tolerance 2e-5.
Greedy chains (each step fed the head's own argmax, mapped through d2t) must be identical.

SpecForge (its own ``LlamaForCausalLMEagle3`` and TTT loop from the PyPI wheel, see
tests/eagle3_specforge.py): heads exported with its ``export_to_hf`` in the three variants it
defines (default, ``fc_norm``, ``norm_output: false``) draft in quickdraft as its unroll computes.

A head quickdraft trains (``Eagle3Head`` saved in the speculators layout) loads in speculators
(``from_pretrained``) and gives the same logits there (the round trip the issue asks for).
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import make_tiny_hf_model

from quickdraft.errors import QuickdraftError
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.speculative.eagle3.head import Eagle3Config, Eagle3Head, init_head_weights
from quickdraft.speculative.eagle3.io import build_head, load_head, save_head

T = 12  # rows of the prefix the reference unrolls
STEPS = 4  # drafting steps compared
AUX = [1, 2, 4]  # input-of-layer ids of the 4-layer target (speculators / vLLM convention)
VD = 128  # draft vocabulary
TOL = 2e-5


@pytest.fixture(scope="module")
def spec() -> Any:
    """The speculators modules. Its eagle3 package imports its training data code, which imports
    ``datasets`` (pyarrow, pandas: not installed here); a stand-in module is put in place for that
    import only and removed afterwards. Nothing of it runs."""
    stub = None
    if "datasets" not in sys.modules:
        try:
            import datasets  # noqa: F401
        except ImportError:
            stub = types.ModuleType("datasets")
            stub.__spec__ = importlib.machinery.ModuleSpec("datasets", None)

            def _absent(*_a: Any, **_k: Any) -> Any:
                raise ImportError("datasets is not installed")

            stub.load_from_disk = stub.load_dataset = stub.concatenate_datasets = _absent  # type: ignore[attr-defined]
            stub.Dataset = type("Dataset", (), {})  # type: ignore[attr-defined]
            sys.modules["datasets"] = stub
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import speculators
            from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
            from speculators.proposals.greedy import GreedyTokenProposalConfig
    except ImportError as exc:
        pytest.fail(f"speculators 0.9.0 is a test dependency: run scripts/setup.sh --test ({exc})")
    finally:
        if stub is not None and sys.modules.get("datasets") is stub:
            del sys.modules["datasets"]
    from importlib.metadata import version

    assert version("speculators").startswith("0.9"), version("speculators")
    return types.SimpleNamespace(
        pkg=speculators, Model=Eagle3DraftModel, Config=Eagle3SpeculatorConfig, Greedy=GreedyTokenProposalConfig
    )


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, Path]:
    folder = make_tiny_hf_model(tmp_path_factory.mktemp("parity-target"), "llama", num_hidden_layers=4, seed=7)
    return load_model(str(folder), dtype="float32", max_context=256), folder


def _layer_config(loaded: LoadedModel, qwen3: bool, layers: int = 1, sliding: int | None = None) -> Any:
    from transformers import LlamaConfig, Qwen3Config

    c = loaded.config
    fields: dict[str, Any] = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, rms_norm_eps=1e-6, max_position_embeddings=256, hidden_act="silu",
        tie_word_embeddings=False,
    )
    if sliding:
        fields |= dict(sliding_window=sliding, use_sliding_window=True, layer_types=["sliding_attention"] * layers)
    layer = (Qwen3Config if qwen3 else LlamaConfig)(**fields)
    layer.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    layer._attn_implementation = "eager"  # speculators' default flex attention needs T % 128 == 0
    return layer


def _reference_head(spec: Any, target: tuple[LoadedModel, Path], seed: int, *, qwen3: bool = False,
                    layers: int = 1, sliding: int | None = None, **flags: Any) -> Any:
    from speculators import SpeculatorsConfig, VerifierConfig

    loaded, folder = target
    cfg = spec.Config(
        transformer_layer_config=_layer_config(loaded, qwen3, layers, sliding), draft_vocab_size=VD,
        eagle_aux_hidden_state_layer_ids=AUX,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[spec.Greedy(speculative_tokens=3)], default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(folder), architectures=["LlamaForCausalLM"]),
        ),
        **flags,
    )
    model = spec.Model(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    v = loaded.config.vocab_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:  # embed_tokens / lm_head start as NaN in speculators (filled from the verifier in training)
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 * (4 if "embed" in name else 1))
        kept = torch.randperm(v, generator=g)[:VD].sort().values
        t2d = torch.zeros(v, dtype=torch.bool)
        t2d[kept] = True
    model.load_vocab_mappings(t2d, kept - torch.arange(VD))
    return model


def _reference_steps(model: Any, hidden: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
    """speculators' own forward: per TTT step, the draft logits [T, Vd] (captured at lm_head)."""
    out: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, o: out.append(o.detach()[0].float()))
    try:
        with torch.no_grad():
            model(hidden_states=hidden[None], input_ids=ids[None], document_ids=torch.zeros_like(ids)[None],
                  ttt_steps=STEPS)
    finally:
        hook.remove()
    assert len(out) == STEPS
    return out


def _chain(head: Eagle3Head, hidden: torch.Tensor, ids: torch.Tensor, row: int, greedy: bool = False) -> list[torch.Tensor]:
    """quickdraft drafting from ``row``: rows 0..row committed, then one drafted row per step at the
    next position, fed the previous row's state and a token: the reference's teacher-forced one
    (``ids[row + k]``), or with ``greedy`` the head's own previous draft mapped to a target id."""
    assert head.embed_tokens is not None
    cache = head.new_cache(64)
    feats = head.fuse(hidden[: row + 1])
    logits, state = head(head.embed_tokens(ids[: row + 1]), feats, cache)
    out, s = [logits[row]], state[row : row + 1]
    for k in range(1, STEPS):
        if greedy:
            tok = int(head.to_target_ids(logits[-1].argmax()))
        else:
            tok = int(ids[row + k]) if row + k < len(ids) else 0
        pos = torch.tensor([row + k])
        logits, s = head(head.embed_tokens(torch.tensor([tok])), s, cache, positions=pos, committed=row + 1)
        out.append(logits[0])
    return out


def _inputs(loaded: LoadedModel, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, len(AUX) * loaded.config.hidden_size, generator=g)
    ids = torch.randint(0, loaded.config.vocab_size, (T,), generator=g)
    return hidden, ids


VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "norm_before_residual": {"norm_before_residual": True},
    "trainer_defaults": {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True},
    "fc_norm+norm_output": {"fc_norm": True, "norm_output": True},
    "qwen3_layer": {"qwen3": True},
    "qwen3_layer+norm_output": {"qwen3": True, "norm_output": True, "norm_before_residual": True},
    "sliding_window_5": {"sliding": 5, "norm_before_residual": True},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_speculators_heads_draft_as_speculators_does(spec: Any, target: tuple[LoadedModel, Path], tmp_path: Path,
                                                      variant: str) -> None:
    loaded, _ = target
    ref = _reference_head(spec, target, seed=list(VARIANTS).index(variant), **VARIANTS[variant])
    ref.save_pretrained(tmp_path)
    logs: list[str] = []
    head, info = load_head(tmp_path, loaded.model, log=logs.append)
    assert info.layout == "speculators" and info.aux_layers == tuple(AUX)
    words = {"qwen3": "Qwen3 decoder layer", "norm_output": "norm(h) fed back", "fc_norm": "fc_norm per aux state",
             "norm_before_fc": "input_norm before fc", "sliding": "sliding window 5",
             "norm_before_residual": "residual = hidden_norm(features)"}
    for key in VARIANTS[variant]:
        assert words[key] in info.variant and words[key] in logs[0], (key, info.variant)
    hidden, ids = _inputs(loaded, seed=3)
    want = _reference_steps(ref, hidden, ids)
    worst = [0.0] * STEPS
    for row in (2, 6, T - 1):  # row 6 and 11 > the sliding window: the window binds
        got = _chain(head, hidden, ids, row)
        for k in range(STEPS):
            diff = float((got[k] - want[k][row]).abs().max())
            worst[k] = max(worst[k], diff)
            assert torch.equal(got[k].argmax(), want[k][row].argmax()), (variant, row, k)
    assert max(worst) < TOL, (variant, worst)
    print(f"\n{variant}: max |logit diff| per drafting step {[f'{w:.1e}' for w in worst]}")


@pytest.mark.parametrize("variant", ["llama", "trainer_defaults", "qwen3_layer+norm_output"])
def test_greedy_chains_equal_the_references(spec: Any, target: tuple[LoadedModel, Path], tmp_path: Path,
                                            variant: str) -> None:
    """Each step fed the head's own greedy draft (mapped to a target id): quickdraft's chain equals
    the reference's, which is unrolled again with each new draft put in its input (a row's step k
    sees only its prefix and its own drafts, so the later inputs do not change it)."""
    loaded, _ = target
    ref = _reference_head(spec, target, seed=11, **VARIANTS[variant])
    ref.save_pretrained(tmp_path)
    head, _ = load_head(tmp_path, loaded.model)
    hidden, ids = _inputs(loaded, seed=5)
    row = 5
    ids = ids.clone()
    ref_chain: list[int] = []
    for k in range(STEPS):
        d = int(_reference_steps(ref, hidden, ids)[k][row].argmax())
        ref_chain.append(d)
        if row + k + 1 < T:
            ids[row + k + 1] = int(head.to_target_ids(torch.tensor(d)))
    ours = [int(x.argmax()) for x in _chain(head, hidden, ids, row, greedy=True)]
    assert ours == ref_chain


def test_multi_layer_heads_are_refused_naming_the_key(spec: Any, target: tuple[LoadedModel, Path],
                                                      tmp_path: Path) -> None:
    ref = _reference_head(spec, target, seed=2, layers=2)
    ref.save_pretrained(tmp_path)
    with pytest.raises(QuickdraftError, match="num_hidden_layers"):
        load_head(tmp_path, target[0].model)


def test_quickdraft_heads_load_in_speculators(spec: Any, target: tuple[LoadedModel, Path], tmp_path: Path) -> None:
    """A head of quickdraft's (its trainer's layout, every variant flag set) saved in the speculators
    layout: speculators' from_pretrained reads it and its forward gives quickdraft's logits."""
    loaded, folder = target
    for qk in (False, True):
        cfg = Eagle3Config.for_target(loaded.config, aux_layers=tuple(AUX), draft_vocab_size=VD)
        cfg = type(cfg)(**{**cfg.to_dict(), "norm_before_residual": True, "norm_output": True,
                           "norm_before_fc": not qk, "fc_norm": qk, "qk_norm": qk})
        head = build_head(cfg, loaded.model, own_embedding=True)
        init_head_weights(head, torch.Generator().manual_seed(4))
        d2t = torch.zeros(VD, dtype=torch.long)
        d2t[60:] = loaded.config.vocab_size - VD
        head.set_vocab_map(d2t)
        out = tmp_path / f"qk{qk}"
        save_head(head, out, layout="speculators", verifier=str(folder))
        rcfg = spec.Config.from_pretrained(str(out))
        rcfg.transformer_layer_config._attn_implementation = "eager"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = spec.Model.from_pretrained(str(out), config=rcfg).eval()
        hidden, ids = _inputs(loaded, seed=9)
        want = _reference_steps(ref, hidden, ids)
        for row in (3, T - 1):
            got = _chain(head, hidden, ids, row)
            for k in range(STEPS):
                assert float((got[k] - want[k][row]).abs().max()) < TOL, (qk, row, k)


def test_contradicting_configs_are_refused(spec: Any, target: tuple[LoadedModel, Path], tmp_path: Path) -> None:
    import json

    ref = _reference_head(spec, target, seed=5, fc_norm=True)
    ref.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["fc_norm"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuickdraftError, match="fc_norm is false but the file has"):
        load_head(tmp_path, target[0].model)
    config["fc_norm"] = True
    config["transformer_layer_config"]["model_type"] = "qwen3"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuickdraftError, match="model_type 'qwen3' has per-head q/k norms"):
        load_head(tmp_path, target[0].model)


@pytest.mark.parametrize(("fc_norm", "norm_output"), [(False, True), (True, True), (False, False)])
def test_specforge_heads_draft_as_specforge_does(target: tuple[LoadedModel, Path], tmp_path: Path,
                                                 fc_norm: bool, norm_output: bool) -> None:
    import eagle3_specforge as sf

    if not sf.specforge_available():
        pytest.fail(f"SpecForge is a test dependency: run scripts/setup.sh --test ({sf.SETUP_COMMAND})")
    loaded, _ = target
    c = loaded.config
    sf.build_specforge_head(tmp_path, hidden=c.hidden_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                            head_dim=c.head_dim, intermediate=96, vocab=c.vocab_size, draft_vocab=VD,
                            fc_norm=fc_norm, norm_output=norm_output, seed=3,
                            aux_layer_ids=tuple(i - 1 for i in AUX))  # SpecForge: output-of-layer ids
    head, info = load_head(tmp_path, loaded.model)
    assert info.layout == "hf" and info.aux_layers == tuple(AUX) and head.dtype == torch.float32
    assert ("fc_norm per aux state" in info.variant) == fc_norm and ("no final norm" in info.variant) != norm_output
    hidden, ids = _inputs(loaded, seed=4)
    want = sf.specforge_ttt_logits(tmp_path, hidden[None], ids[None], STEPS)
    for row in (2, T - 1):
        got = _chain(head, hidden, ids, row)
        for k in range(STEPS):
            assert float((got[k] - want[k][row]).abs().max()) < TOL, (fc_norm, norm_output, row, k)
            assert torch.equal(got[k].argmax(), want[k][row].argmax())
