"""SpecForge EAGLE-3 reference for the parity tests: SpecForge's own code, run on CPU in float32.

Path (a): SpecForge's own modules, not a transcription. The PyPI wheel ``specforge==0.2.0`` is
installed with ``--no-deps`` into a folder of its own. Its draft-model, TTT, export and loading
files (``modeling/draft/llama3_eagle.py``, ``modeling/draft/base.py``, ``modeling/auto.py``,
``algorithms/eagle3/model.py``, ``core/eagle3_adapters.py``, ``export/to_hf.py``,
``export/checkpoint_io.py``, ``utils.py``) are byte-identical to sgl-project/SpecForge HEAD
``a6b6b023``, and it already has ``fc_norm`` and ``norm_output``. Their import chain needs only
torch, transformers, huggingface_hub and safetensors, which the test environment already has.
sglang, yunchang, wandb and datasets are imported lazily or not at all on this path, and
flash_attn is optional (it only warns). So no third-party package is stubbed, nothing is
transcribed.

Three things make SpecForge's code run on a CPU without changing what it computes:

- ``specforge/core/loss.py`` imports ``triton`` at module level for its fused ``LogSoftmaxLoss``
  kernel. ``OnlineEagle3Model.forward`` needs it only for the training loss, which is thrown away
  here. The kernel is swapped for the file's own pure-torch ``_compute_loss`` (l.15-21). When
  triton is absent, that module is stubbed with this swap, and ``triton`` itself is never faked,
  because a fake triton breaks ``torch._inductor``.
- ``@torch.compile`` (RMSNorm, RoPE, ``_compute_target_p``) is switched off for the call with
  ``torch._dynamo.config.patch(disable=True)``. ``TORCH_COMPILE_DISABLE=1`` does the same thing.
- The head is rebuilt the way ``build_eagle3_draft`` (model_providers.py:91) builds it:
  ``AutoDraftModel.from_config(..., attention_backend="sdpa")`` and then a strict
  ``load_state_dict``. The loader skips ``from_pretrained``, which under transformers 5.24 leaves
  the non-persistent RoPE buffers uninitialised and reads ``dtype`` from config.json.

Setup (CI: the only network is PyPI, and torch is never reinstalled). Python >= 3.11 is needed:

    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps \
        --target .venv/reference/specforge specforge==0.2.0

``QUICKDRAFT_SPECFORGE_PATH`` overrides ``.venv/reference/specforge``. If ``specforge`` is already importable,
that copy is used. :func:`specforge_available` lets tests skip when the package is missing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import sys
import tempfile
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import torch

SPECFORGE_VERSION = "0.2.0"  # PyPI; the files used equal sgl-project/SpecForge @ a6b6b023
SPECFORGE_PATH = os.environ.get(
    "QUICKDRAFT_SPECFORGE_PATH", str(Path(__file__).resolve().parents[1] / ".venv" / "reference" / "specforge")
)
SETUP_COMMAND = (
    f"python -m pip install --no-deps --target {SPECFORGE_PATH} specforge=={SPECFORGE_VERSION}"
)


class _TorchLogSoftmaxLoss:
    """``LogSoftmaxLoss.apply`` (core/loss.py:173, a Triton kernel) as the same file's reference
    ``_compute_loss`` (core/loss.py:15-21). Only the discarded training loss goes through it."""

    @staticmethod
    def apply(logits: torch.Tensor, target_p: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits.float(), dim=2)
        return -torch.sum(mask * target_p * logp, 2).mean()


def _ensure_importable() -> None:
    if importlib.util.find_spec("specforge") is None and SPECFORGE_PATH not in sys.path:
        sys.path.append(SPECFORGE_PATH)  # appended: the --no-deps folder holds only specforge
    if importlib.util.find_spec("specforge") is None:
        raise ImportError(f"specforge is not installed; run: {SETUP_COMMAND}")
    if importlib.util.find_spec("triton") is None and "specforge.core.loss" not in sys.modules:
        stub = types.ModuleType("specforge.core.loss")
        stub.LogSoftmaxLoss = _TorchLogSoftmaxLoss  # type: ignore[attr-defined]
        sys.modules["specforge.core.loss"] = stub


def specforge_available() -> bool:
    """True when SpecForge's draft model and TTT trainer import (after :data:`SETUP_COMMAND`)."""
    try:
        _ensure_importable()
        import specforge.algorithms.eagle3.model  # noqa: F401
        import specforge.modeling.draft.llama3_eagle  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _cpu_eager() -> Iterator[None]:
    """No torch.compile (the SpecForge modules carry @torch.compile), no grad, quiet prints."""
    with torch.no_grad(), torch._dynamo.config.patch(disable=True):
        with contextlib.redirect_stdout(io.StringIO()):
            yield


def _draft_config(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                  vocab: int, draft_vocab: int, fc_norm: bool, norm_output: bool,
                  aux_layer_ids: Sequence[int]) -> dict[str, Any]:
    """A draft config JSON in the form of SpecForge's ``configs/*-eagle3*.json``, e.g.
    ``qwen3-30B-A3B-eagle3.1.json`` (fc_norm, norm_output) and ``gpt-oss-20B-eagle3.json``
    (``eagle_config``). Its aux ids are output-of-layer ids (model_providers.py:188-211)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_act": "silu", "hidden_size": hidden, "intermediate_size": intermediate,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
        "rope_theta": 10000.0, "attention_bias": False,
        "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True,
        "vocab_size": vocab, "draft_vocab_size": draft_vocab, "target_hidden_size": hidden,
        "fc_norm": fc_norm, "norm_output": norm_output,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)},
    }


def build_specforge_head(folder: Path, *, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                         head_dim: int = 16, intermediate: int = 128, vocab: int = 256,
                         draft_vocab: int = 128, fc_norm: bool = False, norm_output: bool = True,
                         seed: int = 0, aux_layer_ids: Sequence[int] = (0, 3, 5)) -> None:
    """Write a tiny random ``LlamaForCausalLMEagle3`` head to ``folder`` with SpecForge's own
    ``export_to_hf`` (export/to_hf.py:68-118).

    The head is saved as a training checkpoint (``training_state.pt`` holding
    ``draft_state_dict``, embedding included), then exported. ``materialize_draft``
    (export/checkpoint_io.py:144) checks the keys, ``save_pretrained`` writes config.json and
    model.safetensors, and ``apply_legacy_rope_scaling`` (checkpoint_io.py:32) adds the top-level
    ``rope_theta``. The tensors stay float32, because the checkpoint's keys win over the
    exporter's bf16 model (to_hf.py:115), but config.json says ``"dtype": "bfloat16"``, as every
    ``export_to_hf`` output does (``materialize_draft`` hard-codes bf16). Norm weights are
    1 + 0.2·N(0,1), the embedding is N(0,1) and projections are N(0,1)/sqrt(fan_in).
    ``t2d``/``d2t`` cover a random sorted subset ``kept`` of the target vocabulary, with
    ``d2t[i] = kept[i] - i`` (data/preprocessing.py:760-766)."""
    _ensure_importable()
    from specforge.export.to_hf import export_to_hf
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    config = _draft_config(hidden, heads, kv_heads, head_dim, intermediate, vocab, draft_vocab,
                           fc_norm, norm_output, aux_layer_ids)
    g = torch.Generator().manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp, _cpu_eager():
        config_path = Path(tmp) / "draft_config.json"
        config_path.write_text(json.dumps(config, indent=2))
        draft = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(str(config_path)),
                                           attention_backend="sdpa", torch_dtype=torch.float32)
        state: dict[str, torch.Tensor] = {}
        for name, tensor in sorted(draft.state_dict().items()):
            if name in ("t2d", "d2t"):
                continue
            noise = torch.randn(tensor.shape, generator=g)
            if "norm" in name:
                state[name] = 1 + 0.2 * noise
            elif "embed" in name:
                state[name] = noise
            else:
                state[name] = noise / tensor.shape[-1] ** 0.5
        kept = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        state["t2d"] = torch.zeros(vocab, dtype=torch.bool)
        state["t2d"][kept] = True
        state["d2t"] = kept - torch.arange(draft_vocab)
        checkpoint = Path(tmp) / "training_state.pt"
        torch.save({"draft_state_dict": state}, checkpoint)
        Path(folder).mkdir(parents=True, exist_ok=True)
        export_to_hf(str(checkpoint), str(config_path), str(folder))


def load_specforge_head(folder: Path) -> torch.nn.Module:
    """The head in ``folder`` as SpecForge's ``LlamaForCausalLMEagle3`` (sdpa, float32, eval).

    It is built the way ``build_eagle3_draft`` (algorithms/model_providers.py:91-111) builds a
    draft: ``AutoDraftModelConfig.from_file`` (modeling/auto.py:76) and
    ``AutoDraftModel.from_config``. The exported weights are then loaded strictly, as
    ``warm_start_draft_model`` (training/model_loading.py:399) loads them, but directly from
    model.safetensors, so no dtype round trip and no uninitialised RoPE buffers."""
    _ensure_importable()
    from safetensors.torch import load_file
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    with _cpu_eager():
        config = AutoDraftModelConfig.from_file(str(Path(folder) / "config.json"))
        draft = AutoDraftModel.from_config(config, attention_backend="sdpa",
                                           torch_dtype=torch.float32)
    draft.load_state_dict(load_file(str(Path(folder) / "model.safetensors")), strict=True)
    return draft.float().eval()


def specforge_ttt_logits(folder: Path, hidden_states: torch.Tensor, input_ids: torch.Tensor,
                         steps: int) -> list[torch.Tensor]:
    """Draft-vocab logits [T, Vd] (float32) of each of the ``steps`` TTT steps, as SpecForge's
    ``OnlineEagle3Model.forward`` (algorithms/eagle3/model.py:244-443, sdpa backend) computes
    them for the head in ``folder``.

    ``hidden_states`` [1, T, 3·H] holds the three aux target states, and ``input_ids`` [1, T] the
    tokens. Row j is target position j and token j+1, as after ``TargetHead.preprocess``
    (modeling/target/target_head.py:103-108). The loop itself is SpecForge's, run as it is:
    - step k embeds the ids shifted left by k with 0 padding (``padding``, model.py:430);
    - it feeds back the un-normalised h (model.py:397);
    - it uses positions arange(T) + k (``lck``, llama3_eagle.py:718-734);
    - it attends causally over the step-0 keys plus the diagonal key of each later step
      (llama3_eagle.py:739-778).
    The logits are read with a hook on ``lm_head``, which ``compute_logits`` (l.1772-1777) calls
    once per step. The loss inputs are dummies (a zero teacher, a full loss mask) and the loss
    is discarded."""
    _ensure_importable()
    import specforge.algorithms.eagle3.model as sf_eagle3

    draft: Any = load_specforge_head(folder)
    trainer = sf_eagle3.OnlineEagle3Model(draft, length=steps, attention_backend="sdpa")
    seq = int(input_ids.shape[1])
    logits: list[torch.Tensor] = []

    def grab(_module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        logits.append(output[0].detach().float().clone())

    hook = draft.lm_head.register_forward_hook(grab)
    try:
        with _cpu_eager(), mock.patch.object(sf_eagle3, "LogSoftmaxLoss", _TorchLogSoftmaxLoss):
            trainer(
                input_ids=input_ids.long(),
                attention_mask=torch.ones(1, seq, dtype=torch.bool),
                target=torch.zeros(1, seq, draft.vocab_size),
                loss_mask=torch.ones(1, seq, 1),
                hidden_states=hidden_states.float(),
            )
    finally:
        hook.remove()
    if len(logits) != steps:
        raise RuntimeError(f"expected {steps} lm_head calls, got {len(logits)}")
    return logits
