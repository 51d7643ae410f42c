"""Typed configuration: the model's shape, read from a Hugging Face config.json or GGUF metadata.

:class:`ModelConfig` holds the fields every model family shares; a family's own live in its module
(``quickdraft/models/<name>.py``: a :class:`FamilyFields` dataclass and the :class:`Family` that
reads them), which :func:`family_of` finds by model type. Nothing here names a family."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

from quickdraft.errors import QuickdraftError

if TYPE_CHECKING:
    import numpy as np
    import torch

# --dtype values: "auto" keeps GGUF weights quantized (CPU kernels); the rest dequantize.
DTYPE_CHOICES = ("auto", "bfloat16", "float32", "float16")
# KV cache element types: auto = float16 where the CPU kernels run the model (fp32 activations;
# the native attention widens each key and value exactly), else the activation dtype.
KV_DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16", "q8_0")
DEVICES = ("auto", "cpu", "cuda")  # --device (and cuda:N)
CUDA_GRAPH_MODES = ("auto", "on", "off")  # --cuda-graphs
# A draft model's output head covers its this many most frequent tokens, as many first ids, each
# prompt's tokens and the special tokens (quickdraft.speculative.vocab); 0 = the whole vocabulary.
DEFAULT_DRAFT_VOCAB = 16384
# A draft model stops a proposal after a token it gives less than this probability (0 = never).
DEFAULT_DRAFT_CONFIDENCE = 0.8
# Host memory for stored prefix-cache copies (quickdraft.prefix_cache), capped at a quarter of the
# machine's memory: 8 conversations of 4k tokens of Qwen2.5-Coder-1.5B + its 0.5B draft take ~2.7 GB.
DEFAULT_PREFIX_CACHE_MB = 4096
# quickdraft serve generates this many requests at once by default (fewer where their KV does not fit)
DEFAULT_MAX_CONCURRENCY = 4


def prefix_cache_bytes(mb: int | None, total_bytes: int) -> int:
    """The prefix cache's byte budget for ``--prefix-cache-mb`` (None: the default); 0 = off."""
    if mb is None:
        return min(DEFAULT_PREFIX_CACHE_MB << 20, total_bytes // 4)
    if mb < 0:
        raise QuickdraftError(f"--prefix-cache-mb must be 0 (off) or a positive number of MB, got {mb}")
    if mb << 20 > total_bytes:
        raise QuickdraftError(
            f"--prefix-cache-mb {mb} is more than this machine's memory ({total_bytes >> 20} MB); "
            f"use at most a fraction of it, e.g. {total_bytes >> 22}"
        )
    return mb << 20


@dataclass(frozen=True)
class FamilyFields:
    """The config fields one model family adds to :class:`ModelConfig`, with Hugging Face names:
    a frozen dataclass its module defines (:class:`quickdraft.models.gemma4.Gemma4Fields` ...) and
    reads through :meth:`ModelConfig.family_fields`. A family without any has this empty one."""

    def layer_note(self) -> str:
        """What the start-up line says after the layer kinds ("" for nothing)."""
        return ""


FieldsT = TypeVar("FieldsT", bound=FamilyFields)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer, with Hugging Face field names: the fields every family
    shares here, a family's own in ``family`` (its :class:`FamilyFields`)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (qwen2)
    qk_norm: bool = False  # RMSNorm on each head's q and k before RoPE (qwen3)
    sliding_window: int | None = None
    # Mixture of experts (quickdraft/models/moe.py); the defaults describe a dense model.
    num_experts: int = 0  # routed experts per MoE layer
    num_experts_per_tok: int = 0  # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # width of one routed expert's MLP
    shared_expert_intermediate_size: int = 0  # width of the always-on shared expert; 0 = none
    norm_topk_prob: bool = False  # qwen MoE: renormalise the top-k softmax weights to sum to 1
    decoder_sparse_step: int = 1  # qwen MoE: layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    # Layers of several kinds (Gemma, GPT-OSS, Phi-3, Qwen3.5, Llama 4); the defaults: one kind.
    layer_types: tuple[str, ...] | None = None  # per layer, e.g. "sliding_attention" (uses sliding_window) or "full_attention"
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (rope_theta / rope_scaling: the full ones)
    query_pre_attn_scalar: float | None = None  # attention scores scaled by this ** -0.5 (None: head_dim)
    final_logit_softcapping: float | None = None  # logits -> c * tanh(logits / c)
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * this dims of each head
    family: FamilyFields = field(default_factory=FamilyFields)  # the family's own fields
    extra: dict[str, Any] = field(default_factory=dict)

    def family_fields(self, kind: type[FieldsT]) -> FieldsT:
        """The family's own fields as ``kind``, the dataclass its module defines; an error where
        this config is another family's."""
        if not isinstance(self.family, kind):
            raise QuickdraftError(f"a {self.model_type} config has no {kind.__name__} (it has {type(self.family).__name__})")
        return self.family

    def layer_pattern(self) -> str:
        """The layers as the start-up line names them: "24 layers" or, for models with several
        kinds, "24 layers: 18 linear_attention + 6 full_attention (every 4th)"."""
        return self._layer_kinds() + self.family.layer_note()

    def _layer_kinds(self) -> str:
        n = self.num_hidden_layers
        if not self.layer_types or len(set(self.layer_types)) == 1:
            return f"{n} layers" + (f" of {self.layer_types[0]}" if self.layer_types else "")
        kinds = sorted(set(self.layer_types), key=self.layer_types.index)
        counts = " + ".join(f"{self.layer_types.count(k)} {k}" for k in kinds)
        rarest = min(kinds, key=self.layer_types.count)
        at = [i for i, t in enumerate(self.layer_types) if t == rarest]
        step = at[0] + 1
        every = f" (every {step}{'st' if step == 1 else 'nd' if step == 2 else 'rd' if step == 3 else 'th'})" \
            if at == list(range(step - 1, n, step)) else ""
        return f"{n} layers: {counts}{every}"

    def to_json_dict(self) -> dict[str, Any]:
        """The fields as JSON values (:meth:`from_json_dict` reads them back equal)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Read :meth:`to_json_dict` back: JSON lists become the tuples the fields hold, ``family``
        the fields of the family ``model_type`` names."""
        family = family_of(str(d.get("model_type")))
        kind = family.fields if family is not None else FamilyFields
        values = _tuples_from_json(cls, d) | {"family": kind(**_tuples_from_json(kind, d.get("family") or {}))}
        return cls(**values)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], supported: Sequence[str] | None = None) -> ModelConfig:
        """Build from a parsed Hugging Face ``config.json``; ``supported``: the model types that may
        be built (others are refused by name, before their fields are read). The fields every
        family shares are read here, the family's own (and its defaults for shared ones) by its
        :attr:`Family.read_hf`."""
        wrapper = family_of(str(d.get("model_type")), wrappers=True)
        if wrapper is not None:  # a vision-language checkpoint: its text model
            d = wrapper.text_config(d)
        model_type = d.get("model_type")
        if not model_type:
            raise QuickdraftError("config.json has no 'model_type'; is this a Hugging Face model folder?")
        if supported is not None and model_type not in supported:  # before its fields: a nested config has none at the top
            raise QuickdraftError(f"architecture {model_type!r} is not supported; supported: {', '.join(supported)}")
        family = family_of(str(model_type))
        try:
            cfg = _shared_hf_fields(d) | (family.read_hf(d) if family is not None else {})
        except KeyError as exc:
            raise QuickdraftError(f"config.json lacks the field {exc}; the model folder looks incomplete") from None
        kind = type(cfg.get("family", FamilyFields()))
        known = {f.name for f in fields(cls)} | {f.name for f in fields(kind)}
        extra = {k: v for k, v in d.items() if k not in known}
        return cls(**cfg, extra=extra)


def _tuples_from_json(kind: type[Any], d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with the JSON lists of ``kind``'s tuple fields as tuples."""
    tuples = {f.name for f in fields(kind) if "tuple" in str(f.type)}
    return {k: tuple(v) if k in tuples and isinstance(v, list) else v for k, v in d.items()}


def _shared_hf_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The fields every family shares, as a config.json names them (a family's reader overrides
    the ones it names or defaults differently)."""
    heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    return dict(
        model_type=str(d["model_type"]),
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(d["intermediate_size"]),
        num_hidden_layers=int(d["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta_of(d)),
        rope_scaling=rope_scaling_of(d),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", False)),
        sliding_window=d.get("sliding_window") if d.get("use_sliding_window", False) else None,
    )


def rope_theta_of(d: dict[str, Any]) -> float:
    """A config.json's RoPE base: ``rope_theta``, or transformers 5's ``rope_parameters``'."""
    params = d.get("rope_parameters") or {}
    return float(d.get("rope_theta") or params.get("rope_theta") or 10000.0)


def rope_scaling_of(d: dict[str, Any]) -> dict[str, Any] | None:
    """A config.json's RoPE scaling with its ``rope_type`` spelled out; None for plain RoPE."""
    scaling = d.get("rope_scaling") or d.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    return None if kind == "default" else dict(scaling, rope_type=kind)


def hf_num_experts(d: dict[str, Any], default: int) -> int:
    """Routed experts: configs name them num_experts or num_local_experts (transformers aliases
    one to the other for mixtral and qwen3_moe, and saves whichever the class stores)."""
    for key in ("num_experts", "num_local_experts"):
        if d.get(key) is not None:
            return int(d[key])
    return default


def hf_layer_types(d: dict[str, Any], kinds: tuple[str, str], every: int) -> tuple[str, ...]:
    """A config.json's ``layer_types``, else every ``every``-th layer ``kinds[1]`` and the others
    ``kinds[0]`` (transformers' default pattern); an error for other kinds or another count."""
    layers = int(d["num_hidden_layers"])
    layer_types = d.get("layer_types") or [kinds[0] if (i + 1) % every else kinds[1] for i in range(layers)]
    unknown = sorted(set(layer_types) - set(kinds))
    if unknown or len(layer_types) != layers:
        raise QuickdraftError(f"config.json has layer_types {layer_types!r}; expected {layers} of {'/'.join(kinds)}")
    return tuple(str(t) for t in layer_types)


def text_config_of(d: dict[str, Any], text_type: str) -> dict[str, Any]:
    """A checkpoint of a model with a vision tower runs as its text model: its ``text_config``
    (the weights carry a ``language_model.`` prefix, dropped at load; a config without one is the
    text model's already), under the text model's type ``text_type``."""
    text = d.get("text_config")
    out = dict(text) if isinstance(text, dict) else dict(d)
    if isinstance(text, dict) and "tie_word_embeddings" in d:
        out.setdefault("tie_word_embeddings", d["tie_word_embeddings"])
    return {**out, "model_type": text_type}


# ------------------------------------------------------------------------------- families


@dataclass(frozen=True)
class GGUFMetadata:
    """A GGUF file's metadata as a family reads it: keys under the file's architecture's prefix,
    and the names of the file's tensors (some layouts show only in which tensors exist)."""

    values: Mapping[str, Any]
    tensor_names: frozenset[str]

    @property
    def arch(self) -> str:
        return str(self.values.get("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        """``<arch>.<key>``, else ``default``; an error naming the key where neither is there."""
        value = self.values.get(f"{self.arch}.{key}", default)
        if value is None:
            raise QuickdraftError(f"GGUF metadata lacks '{self.arch}.{key}'; the file is incomplete")
        return value

    def optional(self, key: str, default: Any = None) -> Any:
        """``<arch>.<key>``, else ``default`` (which may be None)."""
        return self.values.get(f"{self.arch}.{key}", default)


ConfigUpdate = dict[str, Any]  # ModelConfig field -> value, as a family reads it (its ``family`` fields included)


def _no_hf_update(d: dict[str, Any]) -> ConfigUpdate:
    return {}


def _no_gguf_update(meta: GGUFMetadata, cfg: ModelConfig) -> ConfigUpdate:
    return {}


def _same_config(d: dict[str, Any]) -> dict[str, Any]:
    return d


def _tensor_as_is(name: str, w: np.ndarray) -> np.ndarray:
    return w


def _freq_factors(cfg: ModelConfig, factors: list[float]) -> ModelConfig:
    return dataclasses.replace(cfg, rope_scaling={"rope_type": "freq_factors", "factors": factors})


@dataclass(frozen=True)
class Family:
    """One model family as its module ``quickdraft/models/<name>.py`` declares it (``FAMILY``): the
    Hugging Face model types and GGUF architectures its ``CausalLM`` builds, its own config fields
    and how they are read from a config.json and from GGUF metadata, and what is particular about
    its GGUF tensors. Nothing outside the module names the family: :func:`family_of` finds it."""

    model_types: tuple[str, ...]  # HF model_type values
    hf_architecture: str = ""  # the transformers class a config.json quickdraft writes names ("": none)
    fields: type[FamilyFields] = FamilyFields
    # config.json -> the fields it reads differently from _shared_hf_fields (``family`` included)
    read_hf: Callable[[dict[str, Any]], ConfigUpdate] = _no_hf_update
    # model types of checkpoints that wrap a text model (vision-language ones) -> the text model's config.json
    hf_wrappers: tuple[str, ...] = ()
    text_config: Callable[[dict[str, Any]], dict[str, Any]] = _same_config
    gguf_archs: Mapping[str, str] = field(default_factory=dict)  # GGUF general.architecture -> model_type
    # GGUF metadata -> the fields it reads differently from loading.gguf.config_from_metadata
    read_gguf: Callable[[GGUFMetadata, ModelConfig], ConfigUpdate] = _no_gguf_update
    gguf_experts: bool = True  # llama.cpp's common expert_* keys describe the experts (else read_gguf reads them)
    gguf_norm_topk: bool = False  # top-k weights renormalised where a file has no expert_weights_norm
    # per model_type: llama.cpp's layer tensor names -> HF names, beyond loading.gguf's common table
    gguf_tensor_names: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    gguf_permute_qk: bool = False  # q/k rows in llama.cpp's interleaved RoPE order (Llama's converter)
    gguf_norm_plus_one: bool = False  # norm weights stored as 1 + w (llama.cpp adds the 1 Gemma's RMSNorm adds) ...
    gguf_norms_as_is: tuple[str, ...] = ()  # ... except these
    gguf_mtp_blocks: bool = False  # blocks past num_hidden_layers are multi-token-prediction blocks
    # (HF name, a float tensor as llama.cpp stores it) -> the checkpoint's value and shape
    gguf_tensor: Callable[[str, np.ndarray], np.ndarray] = _tensor_as_is
    # a GGUF's rope_freqs divisors -> the config (default: Llama 3.1's per-frequency scaling)
    with_rope_factors: Callable[[ModelConfig, list[float]], ModelConfig] = _freq_factors


@dataclass(frozen=True)
class _Registry:
    modules: dict[str, str]  # model_type -> quickdraft.models module
    families: dict[str, Family]  # model_type -> its family
    wrappers: dict[str, Family]  # wrapping model_type -> the family of its text model
    gguf: dict[str, tuple[str, Family]]  # GGUF architecture -> (model_type, family)


@functools.cache
def _registry() -> _Registry:
    """Every family module's ``FAMILY`` (imported at the first look-up: no work at import time)."""
    import quickdraft.models as models

    registry = _Registry({}, {}, {}, {})
    for info in sorted(pkgutil.iter_modules(models.__path__), key=lambda m: m.name):
        if info.name in models.SHARED_MODULES:
            continue
        family = importlib.import_module(f"{models.__name__}.{info.name}").FAMILY
        if not isinstance(family, Family):
            raise TypeError(f"quickdraft.models.{info.name}.FAMILY is not a Family")
        claimed = (
            registry.families.keys() & set(family.model_types)
            | registry.gguf.keys() & set(family.gguf_archs)
            | registry.wrappers.keys() & set(family.hf_wrappers)
        )
        if claimed:
            raise TypeError(f"quickdraft.models.{info.name} claims {sorted(claimed)}, which another family builds")
        for model_type in family.model_types:
            registry.modules[model_type] = f"{models.__name__}.{info.name}"
            registry.families[model_type] = family
        registry.wrappers.update(dict.fromkeys(family.hf_wrappers, family))
        registry.gguf.update({arch: (model_type, family) for arch, model_type in family.gguf_archs.items()})
    return registry


def family_of(model_type: str, wrappers: bool = False) -> Family | None:
    """The family that builds ``model_type`` (with ``wrappers``: whose text model a checkpoint of
    that type wraps); None for a type no family builds."""
    registry = _registry()
    return (registry.wrappers if wrappers else registry.families).get(model_type)


def family_module(model_type: str) -> str | None:
    """The module (``quickdraft.models.<name>``) whose ``CausalLM`` builds ``model_type``."""
    return _registry().modules.get(model_type)


def model_types() -> tuple[str, ...]:
    """Every model type a family builds."""
    return tuple(_registry().families)


def gguf_architectures() -> tuple[str, ...]:
    """Every GGUF ``general.architecture`` a family reads."""
    return tuple(_registry().gguf)


def gguf_family(arch: str) -> tuple[str, Family] | None:
    """The model type and family of a GGUF ``general.architecture``; None where no family reads it."""
    return _registry().gguf.get(arch)


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``; a clear
    error when CUDA is asked for but not usable here."""
    import torch

    key = name.strip().lower()
    if key == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if key == "cpu":
        return torch.device("cpu")
    if key == "cuda" or key.startswith("cuda:"):
        if not torch.cuda.is_available():
            why = ("this PyTorch build has no CUDA support" if torch.version.cuda is None
                   else "no CUDA GPU is visible")
            raise QuickdraftError(
                f"--device {name}: CUDA is not available ({why}; torch {torch.__version__}); "
                "use --device cpu, or --device auto to pick CUDA only when it is there"
            )
        try:
            device = torch.device(key)
        except RuntimeError:
            raise QuickdraftError(f"--device {name!r} is not a device name like cuda or cuda:0") from None
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise QuickdraftError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
        return device
    raise QuickdraftError(f"--device must be one of {', '.join(DEVICES)} (or cuda:N), got {name!r}")
