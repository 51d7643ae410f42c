"""Requests that arrive together with one long shared prompt prefix (an agent's parallel calls with
its system prompt, the choices of n > 1): computed once and copied vs computed by each.

N requests (a long system prompt + N different MT-bench questions) are added to the engine in the
same step, cold each run, twice per round: as the engine runs them (the later ones wait for the
first to compute the shared prefix, then copy it: quickdraft.engine.FOLLOW_MIN) and with waiting
turned off (each computes the prefix itself, what the engine did before). Prints mean time to first
token, end-to-end wall time and prompt tokens computed, the ratios, and saves JSON with the command
and versions.

    .venv/bin/python benchmarks/shared_prompt_arrivals.py [--model qwen2.5-coder-1.5b-instruct] [--users 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import quickdraft.engine as engine_module
from quickdraft.api import LLM
from quickdraft.bench.datasets import load_dataset
from quickdraft.bench.report import environment
from quickdraft.sampling import SamplingParams

SYSTEM = (
    "You are a careful senior software engineer working inside a large Python monorepo. Follow the "
    "team's rules: type-annotate every function, keep functions short, prefer the standard library, "
    "write docstrings that say what and why, never swallow exceptions, log with the logging module, "
    "keep I/O at the edges, test behaviour rather than implementation, and explain trade-offs "
    "briefly before code. "
) * 6


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    engine = llm.engine
    engine.prefix_cache.clear()
    for lane in engine.lanes:
        lane.truncate(0)
    t0 = time.perf_counter()
    gens = [engine.add(p, params) for p in prompts]
    first: dict[int, float] = {}
    while engine.running:
        for gen, out in engine.step():
            if isinstance(out, Exception):
                raise out
            first.setdefault(id(gen), time.perf_counter() - t0)
            if out.finished:
                engine.remove(gen)
    wall = time.perf_counter() - t0
    computed = sum(len(p) - g.cached for p, g in zip(prompts, gens, strict=True))
    return {"mean_ttft_s": sum(first.values()) / len(first), "wall_s": wall, "prompt_tokens_computed": computed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/concurrency/shared-prompt-arrivals.json")
    args = ap.parse_args()
    llm = LLM(args.model, draft="none", max_concurrency=args.users, max_context=4096, threads=2)
    items = load_dataset("mtbench", args.users, progress=False).items
    prompts = [llm.tokenizer.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": it.turns[0]}],
                                         add_generation_prompt=True) for it in items]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    follow = engine_module.FOLLOW_MIN
    modes = {"computed once": follow, "each computes": 1 << 30}
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode, minimum in modes.items():
            engine_module.FOLLOW_MIN = minimum
            results[mode].append(run(llm, prompts, params))
            print(f"round {r + 1} {mode:>13}: " + "  ".join(f"{k} {v:.2f}" for k, v in results[mode][-1].items()),
                  flush=True)
    engine_module.FOLLOW_MIN = follow

    def mean(mode: str, key: str) -> float:
        return sum(x[key] for x in results[mode]) / len(results[mode])

    ttft = mean("each computes", "mean_ttft_s") / mean("computed once", "mean_ttft_s")
    wall = mean("each computes", "wall_s") / mean("computed once", "wall_s")
    print(f"{args.users} requests, {min(map(len, prompts))}-{max(map(len, prompts))}-token prompts: computed once vs each computes: "
          f"mean TTFT {ttft:.2f}x lower, wall {wall:.2f}x lower")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": sys.argv, "settings": vars(args), "environment": environment(),
                               "prompts": "a shared system prompt + mtbench first turns",
                               "prompt_tokens": [len(p) for p in prompts], "results": results,
                               "ttft_ratio": ttft, "wall_ratio": wall}, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
