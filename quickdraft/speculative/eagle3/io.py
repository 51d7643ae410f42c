"""Reading and writing EAGLE-3 heads in the public layouts, checked against the target.

What the published layouts look like (checked in the sources named, 2025-2026):

* **Hugging Face EAGLE-3 layout** (the EAGLE authors' heads, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B;
  SpecForge, sgl-project/SpecForge ``configs/*-eagle3.json``; NVIDIA ModelOpt exports): config.json
  with ``architectures: ["LlamaForCausalLMEagle3"]``, ``model_type: "llama"``, ``num_hidden_layers: 1``,
  ``draft_vocab_size`` (``vocab_size`` is the target's), optional ``target_hidden_size``; tensors
  ``fc.weight`` [H, 3 * Ht], ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
  ``midlayer.self_attn.{q,k,v}_proj.weight`` [heads * hd, 2H], ``midlayer.self_attn.o_proj.weight``,
  ``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight`` [Vd, H],
  ``d2t`` [Vd] int64 (target id = draft id + d2t[draft id]), ``t2d`` [V] bool, and optionally
  ``embed_tokens.weight`` (the EAGLE authors' heads omit it: the target's embedding is used). The
  authors' loader (eagle/model/ea_model.py) reads ``pytorch_model.bin`` or ``model.safetensors``;
  SpecForge and ModelOpt write safetensors. Both are read here.
* **vLLM speculators layout** (vllm-project/speculators ``models/eagle3/config.py``; read by vLLM's
  ``transformers_utils/configs/speculators/algos.py``): config.json with ``speculators_model_type:
  "eagle3"``, ``architectures: ["Eagle3Speculator"]``, ``transformer_layer_config`` (a Llama config of
  the layer), ``draft_vocab_size``, ``norm_before_residual``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids`` (top level) and ``speculators_config`` (algorithm, proposal
  methods, verifier). Tensors as above with ``layers.0.`` instead of ``midlayer.`` (vLLM's
  llama_eagle3.py maps ``midlayer.`` -> ``layers.0.``), plus ``verifier_norm`` / ``verifier_lm_head``
  during training (not saved).
* ``norm_before_residual`` (residual = hidden_norm(feature) instead of the feature): vLLM's
  llama_eagle3.py supports it; the speculators config class defaults it to False but vLLM's
  speculators reader defaults a missing key to True. We read a missing key as False in the HF layout
  and as True in the speculators layout (vLLM's reading), and always write it in the latter.
* RoPE positions: EAGLE's and vLLM's inference give row j (feature of position j, token j+1)
  position j; speculators' trainer uses j + 1. RoPE scores depend only on position differences,
  so both are the same head.

Aux layer conventions (the ids are NOT interchangeable between tools):

* quickdraft, the EAGLE authors' code (``modeling_llama_kv.py``: captures ``hidden_states`` before
  calling layers 2, L//2, L-3) and vLLM (``aux_hidden_states.append(hidden_states + residual)``
  before layer idx; since vLLM PR #36063 id k = the boundary before layer k, k = L allowed) use the
  INPUT of layer i (= HF ``output_hidden_states[i]``). Default (2, L//2, L-3).
* SpecForge (forward hooks on layer outputs, default ``[1, L//2-1, L-4]``), NVIDIA ModelOpt (same
  hooks and default) and SGLang (``set_eagle3_layers_to_capture`` adds 1 before capturing layer
  inputs; since sglang PR #25454 only when the first id is 1) read ``eagle_aux_hidden_state_layer_ids``
  as OUTPUT-of-layer ids: output i = our input i + 1. SGLang and SpecForge keep the list in
  ``eagle_config``; vLLM reads it at the top level (speculators layout) as input ids.

So a config that does not name its convention is read with its layout's documented default: HF
EAGLE-3 layout ids (``eagle_config`` or top level) as OUTPUT ids (SpecForge/ModelOpt/SGLang, the
tools that write this layout), speculators layout ids as INPUT ids (vLLM); no ids at all means the
EAGLE default (2, L//2, L-3) in the input convention. When the default would put an id outside the
target (0..L) and the other convention would not, the other one is used. The loader logs which it
used; a wrong guess makes the load-time canary fail, and the factory then retries the other
convention (``aux_convention=`` overrides all of this). Files we write
name the convention next to the ids (``quickdraft_aux_layer_convention``): "output" ids in
``eagle_config`` for the HF layout (what SGLang and SpecForge expect), "input" ids at the top level
for the speculators layout (what vLLM expects).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from quickdraft.config import ModelConfig
from quickdraft.errors import QuickdraftError
from quickdraft.models.causal_lm import CausalLM
from quickdraft.models.layers import allocate_empty
from quickdraft.speculative.eagle3.head import Eagle3Config, Eagle3Head, default_aux_layers

HF_LAYOUT = "hf"
SPECULATORS_LAYOUT = "speculators"
LAYOUTS = (HF_LAYOUT, SPECULATORS_LAYOUT)
CONVENTION_KEY = "quickdraft_aux_layer_convention"
METADATA_KEY = "quickdraft.eagle3.config"  # config.json carried inside the safetensors header
_IGNORED = ("verifier_norm.weight", "verifier_lm_head.weight", "rotary_emb.inv_freq")
_MARKERS = ("midlayer.", "layers.0.")


@dataclass(frozen=True)
class HeadInfo:
    """How a head file was read: for the load log and for the canary's convention retry."""

    path: Path
    layout: str  # "hf" | "speculators"
    file_ids: tuple[int, ...] | None  # aux ids as written in the file (None: not given)
    convention: str  # "input" | "output": how file_ids were read
    convention_given: bool  # the file named its convention (False: the layout's default)
    aux_layers: tuple[int, ...]  # resolved INPUT-of-layer ids
    note: str = ""  # why the convention differs from the layout's default, if it does
    variant: str = ""  # the head's maths, e.g. "Llama layer, residual = hidden_norm(features)"

    def describe(self) -> str:
        if self.file_ids is None:
            how = f"no aux layer ids in the file: EAGLE default, inputs of layers {list(self.aux_layers)}"
        else:
            source = "as the file says" if self.convention_given else self.note or f"the {self.layout} layout's default"
            how = (f"aux ids {list(self.file_ids)} read as {self.convention.upper()}-of-layer ids ({source}) "
                   f"-> inputs of layers {list(self.aux_layers)}")
        variant = f"; variant: {self.variant}" if self.variant else ""
        return f"EAGLE-3 head {self.path} ({self.layout} layout): {how}{variant}"


# ------------------------------------------------------------------------------------ detection


def is_head(path: str | Path) -> bool:
    """True when ``path`` (a folder or a .safetensors file) holds an EAGLE-3 head."""
    p = Path(path).expanduser()
    try:
        if p.is_dir():
            cfg = _read_json(p / "config.json") if (p / "config.json").is_file() else None
            if cfg is not None and _config_says_head(cfg):
                return True
            files = sorted(p.glob("*.safetensors"))
            return len(files) == 1 and _names_say_head(_safetensors_names(files[0]))
        if p.is_file() and p.suffix == ".safetensors":
            return _names_say_head(_safetensors_names(p))
    except (QuickdraftError, OSError):
        return False
    return False


def _config_says_head(cfg: dict[str, Any]) -> bool:
    archs = " ".join(str(a) for a in cfg.get("architectures") or [])
    return "eagle3" in archs.lower() or cfg.get("speculators_model_type") == "eagle3"


def _names_say_head(names: list[str]) -> bool:
    normal = {_normalize(n) for n in names}
    return "fc.weight" in normal and "midlayer.hidden_norm.weight" in normal


def _safetensors_names(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as exc:
        raise QuickdraftError(f"{path} is not a readable safetensors file ({exc})") from None


# ------------------------------------------------------------------------------------ saving


def save_head(head: Eagle3Head, dest: str | Path, layout: str = HF_LAYOUT, verifier: str | None = None) -> Path:
    """Write ``head`` as a folder (config.json + model.safetensors) in ``layout``; returns the folder.

    The safetensors header carries the config too, so the weights file alone is a complete head.
    ``verifier``: the target's name or path, recorded in the speculators layout.
    """
    if layout not in LAYOUTS:
        raise QuickdraftError(f"unknown head layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    folder = Path(dest).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    cfg = head.config
    config = cfg.to_hf_config("output") if layout == HF_LAYOUT else _speculators_config(cfg, verifier)
    if layout == HF_LAYOUT:
        config["eagle_config"]["use_aux_hidden_state"] = True
    prefix = "midlayer." if layout == HF_LAYOUT else "layers.0."
    tensors: dict[str, Tensor] = {}
    for name, tensor in head.state_dict().items():
        out = prefix + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name
        tensors[out] = tensor.detach().to("cpu").contiguous()
    text = json.dumps(config, indent=2)
    (folder / "config.json").write_text(text + "\n")
    save_file(tensors, str(folder / "model.safetensors"), metadata={METADATA_KEY: text})
    return folder


def _speculators_config(cfg: Eagle3Config, verifier: str | None) -> dict[str, Any]:
    if not cfg.final_norm:
        raise QuickdraftError(
            "the speculators layout cannot say 'no final norm' (SpecForge's norm_output: false); save the head "
            "in the Hugging Face layout"
        )
    layer: dict[str, Any] = {
        "model_type": "qwen3" if cfg.qk_norm else "llama",
        "architectures": ["Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"],
        "hidden_act": "silu",
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "layer_types": ["sliding_attention" if cfg.sliding_window else "full_attention"],
    }
    if cfg.sliding_window:
        layer |= {"sliding_window": cfg.sliding_window, "use_sliding_window": True}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers),
        CONVENTION_KEY: "input",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        },
    }


# ------------------------------------------------------------------------------------ loading


def load_head(
    spec: str | Path,
    target: CausalLM,
    aux_convention: str | None = None,
    log: Callable[[str], None] = lambda _m: None,
) -> tuple[Eagle3Head, HeadInfo]:
    """Load the head at ``spec`` (folder or .safetensors) for ``target``, checking every shape.

    ``aux_convention`` ("input" / "output") overrides how the file's aux layer ids are read. The
    head gets the target's activation dtype and device, and a KV cache as long as the target's
    context (plus room for drafting trees).
    """
    if aux_convention not in (None, "input", "output"):
        raise QuickdraftError(f"aux layer convention must be 'input' or 'output', got {aux_convention!r}")
    path = Path(spec).expanduser()
    if not path.exists():
        raise QuickdraftError(f"no such EAGLE-3 head: {path}")
    config, raw = _read_head_files(path)
    tensors = _normalize_tensors(raw, path)
    layout = _layout(config, raw)
    tcfg = target.config
    cfg, info = _head_config(config, tensors, layout, tcfg, path, aux_convention)
    _check_against_target(cfg, tensors, tcfg, path)
    if cfg.norm_before_fc and "input_norm.weight" not in tensors:
        # speculators loads such a head with the norm's initial weight (ones); so here
        tensors["input_norm.weight"] = torch.ones(len(cfg.aux_layers) * cfg.target_hidden_size)
        log(f"{path}: norm_before_fc without input_norm.weight: weight 1, as speculators loads it")
    head = build_head(cfg, target, own_embedding="embed_tokens.weight" in tensors)
    _load_tensors(head, tensors, path)
    log(info.describe())
    return head, info


def build_head(cfg: Eagle3Config, target: CausalLM, own_embedding: bool = False, extra_len: int = 256) -> Eagle3Head:
    """An (uninitialised) head in the target's dtype and device, with rope tables long enough for
    the target's context plus ``extra_len`` drafted positions."""
    with torch.device("meta"):
        head = Eagle3Head(cfg, max_len=target.max_len + extra_len, own_embedding=own_embedding)
    allocate_empty(head, target.device, target.dtype)
    head.rope.reset_tables(target.device)
    with torch.no_grad():  # buffers: default identity vocabulary map until loaded
        head.d2t.zero_()
        head.t2d.zero_()
        head.t2d[: cfg.draft_vocab_size] = True
    return head.eval()


def with_convention(cfg: Eagle3Config, info: HeadInfo, convention: str, num_layers: int) -> tuple[Eagle3Config, HeadInfo] | None:
    """The same head with its file's ids read in the other convention, or None when that is not
    possible (ids given explicitly, none in the file, or out of range)."""
    if info.file_ids is None or info.convention_given or convention == info.convention:
        return None
    aux = _to_input(info.file_ids, convention)
    if not all(0 <= i <= num_layers for i in aux):
        return None
    new_info = dataclasses.replace(info, convention=convention, aux_layers=aux)
    return dataclasses.replace(cfg, aux_layers=aux), new_info


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise QuickdraftError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise QuickdraftError(f"{path} does not hold a JSON object")
    return data


def _read_head_files(path: Path) -> tuple[dict[str, Any] | None, dict[str, Tensor]]:
    """(config dict or None, raw tensors) of a head folder or file."""
    from quickdraft.loading.safetensors import iter_file, weight_files

    config: dict[str, Any] | None = None
    if path.is_dir():
        if (path / "config.json").is_file():
            config = _read_json(path / "config.json")
        bins = sorted(path.glob("pytorch_model*.bin"))
        if not list(path.glob("*.safetensors")) and bins:
            tensors: dict[str, Tensor] = {}
            for b in bins:
                try:
                    tensors.update(torch.load(str(b), map_location="cpu", weights_only=True))
                except Exception as exc:  # a corrupt or non-tensor pickle
                    raise QuickdraftError(f"{b} is not a readable PyTorch weights file ({exc})") from None
            return config, tensors
        files = weight_files(path)
    elif path.suffix == ".safetensors":
        files = [path]
        meta = _file_metadata(path)
        if METADATA_KEY in meta:
            config = json.loads(meta[METADATA_KEY])
        elif (path.parent / "config.json").is_file():
            sibling = _read_json(path.parent / "config.json")
            config = sibling if _config_says_head(sibling) else None
    else:
        raise QuickdraftError(f"{path} is neither a folder nor a .safetensors file; pass an EAGLE-3 head folder")
    if config is None and path.is_dir():
        files = [f for f in files if METADATA_KEY in _file_metadata(f)] or files
        meta = _file_metadata(files[0])
        config = json.loads(meta[METADATA_KEY]) if METADATA_KEY in meta else None
    out: dict[str, Tensor] = {}
    for f in files:
        out.update(iter_file(f))
    return config, out


def _file_metadata(path: Path) -> dict[str, str]:
    from quickdraft.loading.safetensors import file_metadata

    return file_metadata(path)


def _normalize(name: str) -> str:
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def _normalize_tensors(raw: dict[str, Tensor], path: Path) -> dict[str, Tensor]:
    """Our names (``midlayer.*``) for either layout; refuse what the head cannot use."""
    out: dict[str, Tensor] = {}
    for name, tensor in raw.items():
        norm = _normalize(name)
        if norm.endswith(_IGNORED):
            continue
        if norm.startswith("layers."):
            raise QuickdraftError(
                f"{path} has more than one decoder layer ({name}: transformer_layer_config.num_hidden_layers > 1); "
                "quickdraft runs single-layer EAGLE-3 heads only"
            )
        out[norm] = tensor
    if "fc.weight" not in out or not any(n.startswith("midlayer.") for n in out):
        raise QuickdraftError(
            f"{path} is not an EAGLE-3 head: it lacks fc.weight or the midlayer.* / layers.0.* tensors; "
            "pass a head folder (config.json + safetensors) or a head .safetensors file"
        )
    return out


def _layout(config: dict[str, Any] | None, raw: dict[str, Tensor]) -> str:
    if config is not None and ("speculators_model_type" in config or "speculators_config" in config):
        return SPECULATORS_LAYOUT
    if any(_normalize(n) != n.removeprefix("model.") for n in raw):  # layers.0.* names
        return SPECULATORS_LAYOUT
    return HF_LAYOUT


def _variant(config: dict[str, Any], layout: str, tensors: dict[str, Tensor], path: Path) -> dict[str, Any]:
    """The options that change a head's maths, read as the file's layout means them and checked
    against its tensors (a head run without an option it was trained with would draft silently
    worse, so a contradiction is refused, naming the key).

    One key, two meanings: speculators' ``norm_output`` (EAGLE-3.1: the normalised state feeds
    lm_head and the next drafted row; default false) and SpecForge's (default true: normalise
    before lm_head; false: no final norm). The speculators layout (``speculators_model_type``,
    ``transformer_layer_config``) means the first, the Hugging Face / SpecForge layout the second.
    Layer type: speculators' ``transformer_layer_config.model_type`` ``llama`` or ``qwen3`` (per-head
    q/k norms; speculators reads a layer config without ``model_type`` as Qwen3, so there the
    tensors decide). Sliding window: ``layer_types[0] == "sliding_attention"`` with
    ``sliding_window`` W, as speculators builds its masks (drafted rows see the last W positions).
    """
    names = set(tensors)
    has_qk = any(n.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")) for n in names)
    has_fc_norm = any(n.startswith("fc_norm.") for n in names)
    layer = config.get("transformer_layer_config") or {} if layout == SPECULATORS_LAYOUT else config
    where = "transformer_layer_config." if layout == SPECULATORS_LAYOUT else ""
    model_type = layer.get("model_type")
    if model_type is None:
        qk = has_qk
    elif model_type in ("llama", "qwen3"):
        qk = model_type == "qwen3"
    else:
        raise QuickdraftError(
            f"{path}: {where}model_type is {model_type!r}; EAGLE-3 heads have llama or qwen3 decoder layers"
        )
    if qk != has_qk:
        raise QuickdraftError(
            f"{path}: {where}model_type {model_type!r} {'has' if qk else 'has no'} per-head q/k norms, but the "
            f"tensors {'lack' if qk else 'have'} self_attn.q_norm / k_norm; the config and the weights disagree"
        )
    if layout == SPECULATORS_LAYOUT:
        norm_output, final_norm = bool(config.get("norm_output", False)), True
    else:
        norm_output, final_norm = False, bool(config.get("norm_output", True))
    fc_norm = bool(config.get("fc_norm", has_fc_norm))
    if fc_norm != has_fc_norm:
        raise QuickdraftError(
            f"{path}: fc_norm is {str(fc_norm).lower()} but the file {'lacks' if fc_norm else 'has'} the "
            "fc_norm.{i}.weight tensors; the config and the weights disagree"
        )
    norm_before_fc = bool(config.get("norm_before_fc", "input_norm.weight" in names))
    if "input_norm.weight" in names and not norm_before_fc:
        raise QuickdraftError(
            f"{path}: norm_before_fc is false but the file has input_norm.weight; the config and the weights disagree"
        )
    window = None
    types = layer.get("layer_types")
    if types:
        if len(set(types)) != 1 or types[0] not in ("sliding_attention", "full_attention"):
            raise QuickdraftError(f"{path}: {where}layer_types {types!r} is not one attention type for the head's layer")
        if types[0] == "sliding_attention":
            if not layer.get("sliding_window"):
                raise QuickdraftError(f"{path}: {where}layer_types says sliding_attention but sliding_window is not set")
            window = int(layer["sliding_window"])
    return {"norm_output": norm_output, "final_norm": final_norm, "fc_norm": fc_norm,
            "norm_before_fc": norm_before_fc, "qk_norm": qk, "sliding_window": window}


def _to_input(ids: tuple[int, ...], convention: str) -> tuple[int, ...]:
    return tuple(i + 1 for i in ids) if convention == "output" else tuple(ids)


def _head_config(
    config: dict[str, Any] | None,
    tensors: dict[str, Tensor],
    layout: str,
    target: ModelConfig,
    path: Path,
    override: str | None,
) -> tuple[Eagle3Config, HeadInfo]:
    """The head's config with aux layers resolved to INPUT ids, and how they were resolved.
    Kept whole, over 60 lines: the checks of each layout (speculators, EAGLE-3, SpecForge) and
    the resolution of the ids read top-down, each refusal beside the field it is about."""
    num_layers = target.num_hidden_layers
    if config is None:
        return _config_from_shapes(tensors, target, path)
    variant = _variant(config, layout, tensors, path)
    if layout == SPECULATORS_LAYOUT:
        layer = dict(config.get("transformer_layer_config") or {})
        if not layer:
            raise QuickdraftError(f"{path}: a speculators config needs a transformer_layer_config")
        if int(layer.get("num_hidden_layers", 1)) != 1:
            raise QuickdraftError(f"{path}: only single-layer EAGLE-3 heads are supported")
        flat = {
            **layer,
            "draft_vocab_size": config.get("draft_vocab_size"),
            "target_hidden_size": config.get("target_hidden_size"),
            "norm_before_residual": config.get("norm_before_residual", True),
        }
        raw_ids = config.get("eagle_aux_hidden_state_layer_ids")
        given = config.get(CONVENTION_KEY)
        default = "input"
    else:
        if int(config.get("num_hidden_layers", 1)) != 1:
            raise QuickdraftError(f"{path}: only single-layer EAGLE-3 heads are supported")
        eagle = config.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state") is False:
            raise QuickdraftError(f"{path} is an EAGLE-1/2 head (use_aux_hidden_state false), not EAGLE-3")
        flat = dict(config)
        raw_ids = eagle.get("eagle_aux_hidden_state_layer_ids") or config.get("eagle_aux_hidden_state_layer_ids")
        given = eagle.get(CONVENTION_KEY) or config.get(CONVENTION_KEY)
        default = "output"
    if given is not None and given not in ("input", "output"):
        raise QuickdraftError(f"{path}: {CONVENTION_KEY} must be 'input' or 'output', got {given!r}")
    convention = override or given or default
    note = ""
    if raw_ids:
        file_ids: tuple[int, ...] | None = tuple(int(i) for i in raw_ids)
        aux = _to_input(file_ids, convention)  # type: ignore[arg-type]
        other = "input" if convention == "output" else "output"
        alt = _to_input(file_ids, other)  # type: ignore[arg-type]
        fits = lambda ids: all(0 <= i <= num_layers for i in ids)  # noqa: E731
        if not (override or given) and not fits(aux) and fits(alt):
            aux, convention = alt, other
            note = f"the {layout} layout's default '{default}' would put them out of range"
    else:
        file_ids, convention = None, "input"
        aux = default_aux_layers(num_layers)
    if list(aux) != sorted(aux):
        # vLLM and SGLang collect the aux hidden states while running the layers, so the fused
        # features are in layer order whatever order the config lists the ids in; so here.
        aux = tuple(sorted(aux))
        note = (note + "; " if note else "") + "ids taken in layer order, as vLLM and SGLang do"
    cfg = Eagle3Config.from_hf_config(flat, aux, **variant)
    info = HeadInfo(
        path, layout, file_ids, convention, given is not None or override is not None, aux, note,
        variant_of(cfg, own_embedding="embed_tokens.weight" in tensors),
    )
    return cfg, info


def variant_of(cfg: Eagle3Config, own_embedding: bool) -> str:
    """The head's variant in words (for the load log, the canary and selftest)."""
    layer = "Qwen3 decoder layer (q/k norms)" if cfg.qk_norm else "Llama decoder layer"
    if cfg.sliding_window is not None:
        layer += f", sliding window {cfg.sliding_window}"
    fuse = "fc_norm per aux state, " if cfg.fc_norm else "input_norm before fc, " if cfg.norm_before_fc else ""
    residual = "hidden_norm(features)" if cfg.norm_before_residual else "features"
    fed = "norm(h) fed back" if cfg.norm_output else "h fed back"
    out = "" if cfg.final_norm else ", no final norm"
    embed = "its own embedding" if own_embedding else "the target's embedding"
    return (
        f"{layer}, {fuse}residual = {residual}, {fed}{out}, {embed}, draft vocabulary "
        f"{cfg.draft_vocab_size} of {cfg.vocab_size}"
    )


def _config_from_shapes(tensors: dict[str, Tensor], target: ModelConfig, path: Path) -> tuple[Eagle3Config, HeadInfo]:
    """A bare weights file: the shape comes from the tensors, the rest from the target."""
    try:
        fc, q, k = tensors["fc.weight"], tensors["midlayer.self_attn.q_proj.weight"], tensors["midlayer.self_attn.k_proj.weight"]
        gate, head = tensors["midlayer.mlp.gate_proj.weight"], tensors["lm_head.weight"]
    except KeyError as exc:
        raise QuickdraftError(f"{path} lacks the tensor {exc} every EAGLE-3 head has") from None
    hd = target.head_dim
    n_aux, rem = divmod(int(fc.shape[1]), target.hidden_size)
    if rem or n_aux < 1:
        raise QuickdraftError(
            f"{path}: fc.weight takes {fc.shape[1]} inputs, not a multiple of the target's hidden size "
            f"{target.hidden_size}; this head was trained for another model"
        )
    if n_aux != 3:
        raise QuickdraftError(
            f"{path} fuses {n_aux} target layers but has no config.json naming them; add its config.json"
        )
    aux = default_aux_layers(target.num_hidden_layers)
    cfg = Eagle3Config(
        hidden_size=int(fc.shape[0]),
        intermediate_size=int(gate.shape[0]),
        num_attention_heads=int(q.shape[0]) // hd,
        num_key_value_heads=int(k.shape[0]) // hd,
        head_dim=hd,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta,
        rope_scaling=target.rope_scaling,
        max_position_embeddings=target.max_position_embeddings,
        vocab_size=int(tensors["t2d"].shape[0]) if "t2d" in tensors else target.vocab_size,
        draft_vocab_size=int(head.shape[0]),
        aux_layers=aux,
        target_hidden_size=target.hidden_size,
        fc_norm=any(n.startswith("fc_norm.") for n in tensors),
        norm_before_fc="input_norm.weight" in tensors,
        qk_norm="midlayer.self_attn.q_norm.weight" in tensors,
    )
    variant = variant_of(cfg, own_embedding="embed_tokens.weight" in tensors)
    return cfg, HeadInfo(path, HF_LAYOUT, None, "input", False, aux, variant=variant)


def _check_against_target(cfg: Eagle3Config, tensors: dict[str, Tensor], target: ModelConfig, path: Path) -> None:
    """Refuse a head that cannot belong to ``target``, saying what differs."""
    L = target.num_hidden_layers
    if cfg.vocab_size != target.vocab_size:
        raise QuickdraftError(
            f"the EAGLE-3 head {path} was trained for a vocabulary of {cfg.vocab_size} tokens, the target "
            f"has {target.vocab_size}: it belongs to another model; use a head trained for this target"
        )
    if cfg.target_hidden_size != target.hidden_size:
        raise QuickdraftError(
            f"the EAGLE-3 head {path} reads target hidden states of size {cfg.target_hidden_size}, the "
            f"target's are {target.hidden_size}: it belongs to another model"
        )
    if "embed_tokens.weight" not in tensors and cfg.hidden_size != target.hidden_size:
        raise QuickdraftError(
            f"the EAGLE-3 head {path} has hidden size {cfg.hidden_size} and no embedding of its own, so it "
            f"needs the target's embedding, whose size is {target.hidden_size}: it belongs to another model"
        )
    bad = [i for i in cfg.aux_layers if not 0 <= i <= L]
    if bad:
        raise QuickdraftError(
            f"the EAGLE-3 head {path} reads target layers {list(cfg.aux_layers)} (input-of-layer ids), but the "
            f"target has {L} layers (valid: 0..{L}); it was trained for a deeper model, or its aux layer ids "
            "are in the other convention (pass aux_convention='input' or 'output')"
        )
    fc_in = int(tensors["fc.weight"].shape[1])
    if fc_in != len(cfg.aux_layers) * target.hidden_size:
        raise QuickdraftError(
            f"the EAGLE-3 head {path}: fc.weight takes {fc_in} inputs, but {len(cfg.aux_layers)} aux layers of "
            f"the target give {len(cfg.aux_layers) * target.hidden_size}; the config's aux layer list and the "
            "weights disagree, or the head belongs to another model"
        )
    _check_vocab_map(cfg, tensors, path)


def _check_vocab_map(cfg: Eagle3Config, tensors: dict[str, Tensor], path: Path) -> None:
    """d2t [Vd] / t2d [V] must describe the same draft vocabulary inside the target's."""
    vd, v = cfg.draft_vocab_size, cfg.vocab_size
    d2t = tensors.get("d2t")
    if d2t is None:
        if vd != v:
            raise QuickdraftError(
                f"the EAGLE-3 head {path} drafts over {vd} tokens but has no d2t table mapping them to the "
                f"target's {v}; the file is incomplete"
            )
        tensors["d2t"] = torch.zeros(vd, dtype=torch.long)
        d2t = tensors["d2t"]
    if tuple(d2t.shape) != (vd,):
        raise QuickdraftError(
            f"the EAGLE-3 head {path}: d2t has shape {tuple(d2t.shape)}, its draft vocabulary has {vd} tokens"
        )
    mapped = torch.arange(vd) + d2t.long()
    if int(mapped.min()) < 0 or int(mapped.max()) >= v:
        raise QuickdraftError(
            f"the EAGLE-3 head {path}: d2t maps draft tokens outside the target vocabulary (0..{v - 1})"
        )
    if mapped.unique().numel() != vd:
        raise QuickdraftError(f"the EAGLE-3 head {path}: d2t maps two draft tokens to the same target token")
    t2d_expected = torch.zeros(v, dtype=torch.bool)
    t2d_expected[mapped] = True
    t2d = tensors.get("t2d")
    if t2d is None:
        tensors["t2d"] = t2d_expected
    elif tuple(t2d.shape) != (v,):
        raise QuickdraftError(
            f"the EAGLE-3 head {path}: t2d has shape {tuple(t2d.shape)}, the target vocabulary has {v} tokens"
        )
    elif not torch.equal(t2d.bool(), t2d_expected):
        raise QuickdraftError(
            f"the EAGLE-3 head {path}: t2d ({int(t2d.bool().sum())} tokens) and d2t ({vd} tokens) describe "
            "different draft vocabularies; the file is inconsistent"
        )


def _load_tensors(head: Eagle3Head, tensors: dict[str, Tensor], path: Path) -> None:
    """Copy every tensor into its place, strictly (like quickdraft.loading.weights)."""
    own = head.state_dict(keep_vars=True)
    filled: set[str] = set()
    for name, tensor in tensors.items():
        place = own.get(name)
        if place is None:
            raise QuickdraftError(f"the EAGLE-3 head {path} has a tensor {name!r} that has no place in the head")
        if tuple(tensor.shape) != tuple(place.shape):
            raise QuickdraftError(
                f"the EAGLE-3 head {path}: tensor {name} has shape {tuple(tensor.shape)}, its config implies "
                f"{tuple(place.shape)}"
            )
        with torch.no_grad():
            place.copy_(tensor.to(place.dtype))
        filled.add(name)
    missing = sorted(set(own) - filled)
    if missing:
        raise QuickdraftError(f"the EAGLE-3 head {path} lacks tensor(s): {', '.join(missing)}")
