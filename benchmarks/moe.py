"""Mixture-of-experts micro-benchmark: a random MoE vs a dense model with the same active weights.

    .venv/bin/python benchmarks/moe.py                    # bf16, 8 experts top-2, hidden 1024
    .venv/bin/python benchmarks/moe.py --dtype float32 --layers 8 --tokens 64

The MoE is Mixtral-shaped (8 experts, top 2, expert width 1408, no shared expert); the dense
model is the llama decoder with MLP width 2 x 1408, so both read the same weights per token
(the MoE's router adds E x H). Both are randomly initialised (random routing: every expert is
equally likely). Reported: batch-1 decode tokens/s, and the time of one T-row pass (T = 1, 2, 4,
8: what a speculative verification of k = T - 1 drafts costs) after a 128-token context, with
the average number of distinct experts a T-row pass touches per layer. Passes are timed round
after round, interleaved, and each reports its minimum (the machine may be shared; the median is
kept too). Results are printed and saved as JSON (command, versions, machine) in
benchmarks/results/moe.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from quickdraft.config import ModelConfig
from quickdraft.models import build_model
from quickdraft.models.causal_lm import CausalLM
from quickdraft.models.moe import SparseMoE, route

CONTEXT = 128


def make(kind: str, args: argparse.Namespace, dtype: torch.dtype) -> CausalLM:
    common: dict[str, Any] = dict(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 256, head_dim=64,
        max_position_embeddings=4096,
    )
    if kind == "moe":
        cfg = ModelConfig(
            model_type="mixtral", intermediate_size=args.expert_width, num_experts=args.experts,
            num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_width, **common,
        )
    else:
        cfg = ModelConfig(model_type="llama", intermediate_size=args.top_k * args.expert_width, **common)
    with torch.device("meta"):
        model = build_model(cfg, CONTEXT + 64)
    assert isinstance(model, CausalLM)
    model.materialize("cpu", dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                std = 1.0 if "embed_tokens" in name else p.shape[-1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model.eval()


def weights_per_token(model: CausalLM) -> int:
    """Parameters one decoded token reads (MoE: router + top-k experts per sparse layer)."""
    total = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            continue
        total += p.numel() if "embed_tokens" not in name else p.shape[1]
    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoE):
            total += layer.mlp.top_k * sum(p.numel() for p in layer.mlp.experts[0].parameters())
    return total


def decode_tps(model: CausalLM, tokens: int) -> float:
    cache = model.new_cache()
    ids = torch.randint(0, model.config.vocab_size, (CONTEXT + tokens,), generator=torch.Generator().manual_seed(1))
    model(ids[:CONTEXT], cache, num_logits=1)
    t0 = time.perf_counter()
    for i in range(CONTEXT, CONTEXT + tokens):
        model(ids[i : i + 1], cache)
    return tokens / (time.perf_counter() - t0)


def experts_touched(model: CausalLM, rows: int, samples: int = 50) -> float:
    """Average distinct experts a pass of ``rows`` rows touches in the first sparse layer."""
    layer = next(la.mlp for la in model.model.layers if isinstance(la.mlp, SparseMoE))
    gen = torch.Generator().manual_seed(2)
    counts = []
    with torch.inference_mode():
        for _ in range(samples):
            x = torch.randn(rows, model.config.hidden_size, generator=gen).to(model.dtype)
            _, experts = route(layer.routing, layer.gate(x), layer.top_k, layer.renormalize)
            counts.append(len(set(experts.flatten().tolist())))
    return statistics.mean(counts)


def pass_times(models: dict[str, CausalLM], rows: list[int], rounds: int) -> dict[str, dict[int, list[float]]]:
    """Seconds of one ``rows``-row pass after CONTEXT tokens, for each model, interleaved."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 1000, (CONTEXT + max(rows),), generator=gen)
    caches = {}
    for name, model in models.items():
        caches[name] = model.new_cache()
        model(ids[:CONTEXT], caches[name], num_logits=1)
    times: dict[str, dict[int, list[float]]] = {n: {r: [] for r in rows} for n in models}
    for rnd in range(rounds + 1):  # round 0 warms up
        for r in rows:
            for name, model in models.items():
                cache = caches[name]
                cache.truncate(CONTEXT)
                t0 = time.perf_counter()
                model(ids[CONTEXT : CONTEXT + r], cache)
                if rnd:
                    times[name][r].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-width", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=32, help="decoded tokens per tokens/s measurement")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="benchmarks/results/moe.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    t_start = time.perf_counter()
    models = {"moe": make("moe", args, dtype), "dense": make("dense", args, dtype)}
    results: dict[str, dict[str, object]] = {}
    for name, model in models.items():
        decode_tps(model, 4)  # warm-up
        results[name] = {
            "params": sum(p.numel() for p in model.parameters()),
            "weights_read_per_token": weights_per_token(model),
            "decode_tokens_per_second": [round(decode_tps(model, args.tokens), 2) for _ in range(2)],
        }
    times = pass_times(models, args.rows, args.rounds)
    for name in models:
        results[name]["pass_ms_min"] = {r: round(1e3 * min(ts), 3) for r, ts in times[name].items()}
        results[name]["pass_ms_median"] = {r: round(1e3 * statistics.median(ts), 3) for r, ts in times[name].items()}
    results["moe"]["experts_touched_per_layer"] = {r: experts_touched(models["moe"], r) for r in args.rows}
    print(f"{'':6s} {'params':>8s} {'read/tok':>9s} {'tok/s':>7s}  " + "  ".join(f"{r}-row ms" for r in args.rows))
    for name, res in results.items():
        tps = max(res["decode_tokens_per_second"])  # type: ignore[type-var]
        passes = "  ".join(f"{res['pass_ms_min'][r]:8.2f}" for r in args.rows)  # type: ignore[index]
        print(f"{name:6s} {res['params'] / 1e6:7.1f}M {res['weights_read_per_token'] / 1e6:8.1f}M {tps:7.1f}  {passes}")
    print("MoE experts touched per layer by a T-row pass:", results["moe"]["experts_touched_per_layer"])
    record = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu": platform.processor(),
        "threads": torch.get_num_threads(),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "context_tokens": CONTEXT,
        "seconds": round(time.perf_counter() - t_start, 1),
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
