"""Mixture-of-experts feed-forward blocks, shared by mixtral, qwen2_moe, qwen3_moe and llama4.

A sparse layer replaces the dense MLP of the llama decoder: a router (``gate``, a Linear H -> E)
scores the E experts for every row, each row runs through its top-k experts (gated SiLU MLPs
``experts.N.{gate,up,down}_proj``), and their outputs are combined with the routing weights;
some families add an always-on ``shared_expert``. The families differ in the routing:

    softmax_topk   (qwen2_moe, qwen3_moe)  softmax over all E, top k, renormalised if norm_topk_prob
    topk_softmax   (mixtral)               top k of the logits, softmax over those k
    sigmoid_input  (llama4)                top k of the logits; sigmoid(score) scales the expert's
                                           INPUT and the outputs are summed unweighted

Speed: each expert is its own set of :class:`Linear` modules, so a one-token decode step reads
only its k experts' weights, and a (k+1)-row verification pass groups its rows by expert: every
expert that any row chose runs once, over exactly those rows.

Batch invariance (speculative greedy output == plain greedy output): a row's result must not
depend on the rows sharing its pass. Routing is row-wise (softmax and top-k per row over the
router's batch-invariant Linear), every expert is a batch-invariant :class:`Linear` that sees the
row's exact input whichever rows come with it, and the k outputs are combined element-wise in a
fixed order (by top-k rank, not by expert id or by arrival), so the row's bits are the same as
when it is decoded alone.

Checkpoints: the parameters carry the per-expert names that ``save_pretrained`` writes for
qwen MoE (``mlp.experts.N.gate_proj.weight`` ...). :meth:`MoECausalLM.convert_checkpoint` maps the
other layouts onto them while the tensors stream in: family renames (mixtral's
``block_sparse_moe.experts.N.w1/w3/w2``, llama4's ``feed_forward.router``) and stacked experts,
split per expert: transformers 5's in-memory ``experts.gate_up_proj`` [E, 2I, H] /
``experts.down_proj`` [E, H, I], and llama4's ``[E, H, 2I]`` / ``[E, I, H]`` (input-major).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.config import ModelConfig
from quickdraft.errors import QuickdraftError
from quickdraft.models.batch_invariance import Linear
from quickdraft.models.causal_lm import CausalLM
from quickdraft.models.layers import MLP, linear_grouped
from quickdraft.models.native import WeightSpec, float_rows, weight_spec, weight_specs
from quickdraft.quant.ggml import active_kernels

ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_input")
ROW_LANES = 64  # elements per row that keep element-wise kernels on one code path (see rowwise)
# Mixture-of-experts layers as llama.cpp names them (the Qwen MoE families' GGUFs): the router,
# stacked experts (split per expert at load, :func:`convert_expert_layouts`), the shared expert
# and its gate.
GGUF_MOE_TENSOR_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj.weight",
    **{f"ffn_{p}_exps.weight": f"mlp.experts.{p}_proj.weight" for p in ("gate", "up", "down")},
    **{f"ffn_{p}_shexp.weight": f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")},
}


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an element-wise ``fn`` on a narrow ``x`` [T, n], bitwise independent of T.

    torch's CPU kernels compute full SIMD chunks with vectorised approximations (exp, sigmoid,
    silu ...) and a ragged tail another way, so an element's bits depend on where the tensor ends:
    sigmoid of a [1, 2] row differs in the last bit from the same row inside [9, 2]. Padding each
    row to ROW_LANES elements keeps every element on the vectorised path at any T. Released
    models' MLP widths are multiples of 64, so the experts' SiLU needs no padding (a width that is
    not would lose batch invariance, as a dense MLP of that width does).
    """
    n = x.shape[-1]
    if n % ROW_LANES == 0:
        return fn(x)
    return fn(F.pad(x, (0, ROW_LANES - n % ROW_LANES)))[..., :n]


def route(kind: str, logits: torch.Tensor, k: int, renormalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, experts [T, k] long), best expert first.

    Computed in float32 like transformers does (bf16 probabilities would round the weights).
    For "sigmoid_input" the weights are the sigmoid scores that multiply each expert's input.
    """
    if kind == "softmax_topk":
        weights, experts = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts
    top, experts = torch.topk(logits, k, dim=-1)
    if kind == "topk_softmax":
        return torch.softmax(top.float(), dim=-1), experts
    if kind == "sigmoid_input":
        return rowwise(torch.sigmoid, top.float()), experts
    raise ValueError(f"unknown routing {kind!r}; one of {ROUTINGS}")


def group_by_expert(experts: torch.Tensor) -> dict[int, list[int]]:
    """Expert id -> the flat (row * k + rank) slots routed to it, in slot order."""
    groups: dict[int, list[int]] = {}
    for slot, expert in enumerate(experts.flatten().tolist()):
        groups.setdefault(expert, []).append(slot)
    return groups


def gated_mlp(cfg: ModelConfig, width: int) -> MLP:
    """The decoder's gated SiLU MLP (``gate_proj``, ``up_proj``, ``down_proj``) of another width."""
    return MLP(dataclasses.replace(cfg, intermediate_size=width))


class SparseMoE(nn.Module):
    """Routed experts plus an optional shared expert; ``forward(x [T, H]) -> [T, H]``."""

    def __init__(self, cfg: ModelConfig, routing: str, shared_expert_gate: bool = False) -> None:
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing {routing!r}; one of {ROUTINGS}")
        self.routing, self.top_k, self.renormalize = routing, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(gated_mlp(cfg, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = gated_mlp(cfg, shared) if shared else None
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False) if shared and shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.routing, self.gate(x), self.top_k, self.renormalize)
        out = self.run_experts(x, weights, experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:  # qwen2_moe: a per-row sigmoid gate
                shared = rowwise(torch.sigmoid, self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each chosen expert once over its rows; outputs combined per row in top-k rank order."""
        return mix_experts(self.experts, x, weights, experts, scale_input=self.routing == "sigmoid_input")


def mix_experts(
    modules: nn.ModuleList, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, scale_input: bool = False
) -> torch.Tensor:
    """Rows ``x`` [T, H] through their top-k ``experts`` [T, k] (each chosen expert runs once, over
    exactly its rows), outputs weighted by ``weights`` [T, k] and summed per row in top-k rank
    order (batch invariant). ``scale_input``: the weights scale each expert's input instead, the
    outputs are summed unweighted (llama4)."""
    t, k = experts.shape
    groups = group_by_expert(experts)
    mlps = [modules[e] for e in groups]
    if not scale_input and all(isinstance(m, MLP) for m in mlps) and len({type(m) for m in mlps}) == 1:
        ys = _grouped_mlps(mlps, list(groups.values()), x, k)  # (quantized GGML experts: few kernel calls)
    else:
        ys = x.new_empty(t * k, x.shape[1])  # slot row * k + rank
        flat_weights = weights.flatten()
        for expert, slots in groups.items():
            idx = torch.tensor(slots, device=x.device)
            xe = x if t == 1 else x.index_select(0, idx // k)  # one row: top-k experts are distinct
            if scale_input:  # llama4 scales the input in the activation dtype, as transformers does
                xe = xe * flat_weights[idx].to(x.dtype).unsqueeze(1)
            ys.index_copy_(0, idx, modules[expert](xe))
    ys = ys.view(t, k, -1)
    if scale_input:
        out = ys[:, 0]
        for r in range(1, k):
            out = out + ys[:, r]
        return out
    acc = ys[:, 0].float() * weights[:, :1]
    for r in range(1, k):
        acc = acc + ys[:, r].float() * weights[:, r : r + 1]
    return acc.to(x.dtype)


def _grouped_mlps(mlps: list[nn.Module], slots: list[list[int]], x: torch.Tensor, k: int) -> torch.Tensor:
    """The chosen experts (gated MLPs of one kind) over their rows: every expert's input projections
    in one grouped call, their activation over all rows at once, every down projection in another
    call (GGML experts in q8 mode: each projection's bits those of its own call on its rows; other
    layers: each module called). Returns the outputs [T * k, H] in slot (row * k + rank) order."""
    counts = [len(s) for s in slots]
    order = torch.tensor([s for group in slots for s in group], device=x.device)
    rows = x.index_select(0, order // k)  # each expert's rows, one expert after another
    typed = [m for m in mlps if isinstance(m, MLP)]
    projected = linear_grouped([m.in_projections() for m in typed], rows, counts)
    inputs = [torch.cat(parts) for parts in zip(*projected, strict=True)]  # (gate, up) of all rows
    hidden = typed[0].activate(*inputs)  # (an elementwise activation, the same for experts of one kind)
    down = linear_grouped([[m.down_proj] for m in typed], hidden, counts)
    ys = x.new_empty(order.numel(), x.shape[1])
    return ys.index_copy_(0, order, torch.cat([d[0] for d in down]).to(x.dtype))


# What an ExpertBlock's experts compute from gate and up (the kernels' activation ids)
SILU, SWIGLU_CLAMPED, GELU_TANH = 0, 1, 2


@dataclass(frozen=True)
class RouterScales:
    """Gemma 4's router: its input normed without a weight (``eps``), times ``scale`` [H] and ``root``;
    each chosen expert's weight times ``per_expert`` [E]."""

    scale: torch.Tensor
    per_expert: torch.Tensor
    root: float
    eps: float


def experts_block(experts: Iterable[nn.Module], router: nn.Module, routing: str, renormalize: bool, top_k: int,
                  activation: int = SILU, swiglu: tuple[float, float] = (0.0, 0.0), shared: nn.Module | None = None,
                  shared_gate: nn.Module | None = None, scales: RouterScales | None = None) -> Any | None:
    """Routed experts as the kernels' ``ExpertBlock`` for a native stack (the same ops as
    :class:`SparseMoE` / :func:`mix_experts`), or None where it does not apply: a softmax routing,
    every expert (and the shared one) a gated MLP of q8 GGML blocks, the router and the shared
    expert's gate a float32 Linear or q8 blocks."""
    mod = active_kernels()
    if mod is None or routing not in ("softmax_topk", "topk_softmax"):
        return None
    specs: list[list[WeightSpec]] = []
    for e in experts:
        if not isinstance(e, MLP) or (s := weight_specs(e.gate_proj, e.up_proj, e.down_proj)) is None:
            return None
        specs.append(s)
    router_q8 = weight_spec(router)
    rows = None if router_q8 is not None else float_rows(router, bias=True)
    if router_q8 is None and rows is None:
        return None
    shared_specs: list[WeightSpec] = []
    gate_q8 = gate_w = None
    if shared is not None:
        if type(shared) is not MLP or (ss := weight_specs(shared.gate_proj, shared.up_proj, shared.down_proj)) is None:
            return None
        shared_specs = ss
        if shared_gate is not None:
            gate_q8 = weight_spec(shared_gate)
            if gate_q8 is None and (g := float_rows(shared_gate)) is not None:
                gate_w = g[0]
            if gate_q8 is None and gate_w is None:
                return None
    extra = {} if scales is None else {"router_scale": scales.scale.detach(), "expert_scale": scales.per_expert.detach(),
                                       "router_root": float(scales.root), "norm_eps": float(scales.eps)}
    return mod.ExpertBlock(
        router_q8, None if rows is None else rows[0], None if rows is None else rows[1],
        0 if routing == "softmax_topk" else 1, bool(renormalize), top_k, specs, activation, float(swiglu[0]),
        float(swiglu[1]), ROW_LANES, shared_specs, gate_q8, gate_w, **extra)


def expert_block(moe: nn.Module, swiglu: tuple[float, float] | None = None) -> Any | None:
    """``moe`` (a :class:`SparseMoE`) as :func:`experts_block` takes it; None where it is not one.
    ``swiglu``: GPT-OSS's (alpha, limit) activation instead of silu(gate) * up (every expert a plain
    gated MLP otherwise)."""
    if type(moe) is not SparseMoE or (swiglu is None and any(type(e) is not MLP for e in moe.experts)):
        return None
    return experts_block(moe.experts, moe.gate, moe.routing, moe.renormalize, moe.top_k,
                         SILU if swiglu is None else SWIGLU_CLAMPED, swiglu or (0.0, 0.0),
                         moe.shared_expert, moe.shared_expert_gate)


_STACKED = re.compile(r"(.+\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(?:\.(weight|bias))?")


def convert_expert_layouts(
    tensors: Iterable[tuple[str, Any]],
    renames: Iterable[tuple[str, str]] = (),
    skip: tuple[str, ...] = (),
    input_major: bool = False,
) -> Iterator[tuple[str, Any]]:
    """Stream checkpoint tensors under per-expert parameter names.

    ``renames``: (regex, replacement) applied to every name in turn; names starting with one of
    ``skip`` are dropped (e.g. a multimodal checkpoint's vision tower). Stacked experts
    ``*.experts.gate_up_proj`` (gate rows first, then up) and ``*.experts.down_proj`` are split
    into ``*.experts.N.{gate,up,down}_proj.weight``; ``input_major`` means they are stored as
    ``[E, in, out]`` (used as ``x @ W``, llama4) rather than ``[E, out, in]``. One tensor is split at
    a time, so memory stays near the model's own size.
    """
    patterns = [(re.compile(p), r) for p, r in renames]
    for name, tensor in tensors:
        for pattern, repl in patterns:
            name = pattern.sub(repl, name)
        if name.startswith(skip):
            continue
        m = _STACKED.fullmatch(name)
        if m is None:
            yield name, tensor
            continue
        prefix, kind, field = m.groups()
        if field == "bias":  # [E, out] (GGUF's GPT-OSS experts)
            if kind == "gate_up_proj" or not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
                raise QuickdraftError(f"stacked expert bias {name} must be an [experts, rows] array of one projection")
            for e, b in enumerate(tensor.unbind(0)):
                yield f"{prefix}.{e}.{kind}.bias", b
            continue
        for e, w in enumerate(_experts(name, tensor, input_major)):
            if kind == "gate_up_proj":
                rows = int(w.shape[0])
                if rows % 2:
                    raise QuickdraftError(f"{name} has an odd number of gate/up rows {rows}")
                if isinstance(w, torch.Tensor):
                    gate, up = w.chunk(2, dim=0)
                else:  # a GGUF's blocks: whole rows each
                    gate, up = w.rows(0, rows // 2), w.rows(rows // 2, rows)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up
            else:
                yield f"{prefix}.{e}.{kind}.weight", w


def _experts(name: str, tensor: Any, input_major: bool) -> list[Any]:
    """A stacked [E, out, in] tensor's E matrices (float, or a GGUF's blocks kept per expert)."""
    from quickdraft.loading.gguf import QuantTensor

    if isinstance(tensor, QuantTensor) and len(tensor.shape) == 3 and not input_major:
        return [tensor.expert(e) for e in range(tensor.shape[0])]
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3:
        raise QuickdraftError(
            f"stacked expert tensor {name} must be an [experts, rows, columns] array; this one cannot be split "
            "per expert (use the safetensors checkpoint)"
        )
    return list((tensor.transpose(1, 2) if input_major else tensor).unbind(0))  # -> [E, out, in]


def check_moe_config(cfg: ModelConfig) -> None:
    if cfg.num_experts < 1 or not 1 <= cfg.num_experts_per_tok <= cfg.num_experts or cfg.moe_intermediate_size < 1:
        raise QuickdraftError(
            f"{cfg.model_type} is a mixture-of-experts model, but its config has num_experts="
            f"{cfg.num_experts}, num_experts_per_tok={cfg.num_experts_per_tok}, moe_intermediate_size="
            f"{cfg.moe_intermediate_size}; it needs 1 <= num_experts_per_tok <= num_experts and a positive "
            "expert width: check the model folder's config.json"
        )


class MoECausalLM(CausalLM):
    """The llama-family causal LM with :class:`SparseMoE` in place of the MLP on sparse layers.

    Families set the class attributes: ``routing`` (see :func:`route`), ``shared_expert_gate``,
    and how their checkpoints name things (``checkpoint_renames``, ``checkpoint_skip``,
    ``stacked_input_major``); ``is_moe_layer`` says which layers are sparse (default: all). The
    dense skeleton is built first and its MLPs replaced: under the meta device (how models are
    loaded) that costs nothing.
    """

    converts_checkpoint = True

    routing: ClassVar[str] = "softmax_topk"
    shared_expert_gate: ClassVar[bool] = False
    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    checkpoint_skip: ClassVar[tuple[str, ...]] = ()
    stacked_input_major: ClassVar[bool] = False

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__(cfg, max_len)
        for i, layer in enumerate(self.model.layers):
            if self.is_moe_layer(i):
                check_moe_config(cfg)
                layer.mlp = SparseMoE(cfg, self.routing, self.shared_expert_gate)

    def is_moe_layer(self, i: int) -> bool:
        return True

    def convert_checkpoint(self, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Checkpoint tensors renamed and split into this model's parameters (called by the loader)."""
        return convert_expert_layouts(tensors, self.checkpoint_renames, self.checkpoint_skip, self.stacked_input_major)
