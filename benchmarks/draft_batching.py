"""Several users drafting with one draft model (or EAGLE-3 head): its passes batched across
sequences vs one by one.

The same engine, drafters and requests twice per round, alternating: once as the engine runs them
(the draft-model passes of every sequence on lanes of one pool run as ONE pass per drafted token,
quickdraft.speculative.batch) and once with each sequence's pass run by itself (the grouping
replaced by singletons: what the engine did before). Prints aggregate tok/s, time to first token,
tau and drafting seconds of each, the ratio, and saves JSON with the command and versions.

    .venv/bin/python benchmarks/draft_batching.py [--draft qwen2.5-coder-0.5b-instruct] [--num-draft 3]
    .venv/bin/python benchmarks/draft_batching.py --head random-tree --num-draft 8

``--head random-chain|random-tree``: an EAGLE-3 head of the target's shape with random weights
(no trained head is installable here) drafting fixed chains of k or full trees (no cost model):
its drafts are rejected, so this measures what batching the head's passes saves, not acceptance.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

import quickdraft.speculative.batch as batch
from quickdraft.api import LLM
from quickdraft.bench.datasets import load_dataset
from quickdraft.bench.report import environment
from quickdraft.engine import Engine, RequestStats
from quickdraft.sampling import SamplingParams
from quickdraft.speculative.base import Drafter
from quickdraft.speculative.eagle3.drafter import Eagle3Drafter
from quickdraft.speculative.eagle3.head import Eagle3Config, init_head_weights
from quickdraft.speculative.eagle3.io import build_head


def random_head_drafter(llm: LLM, mode: str) -> Eagle3Drafter:
    """A random EAGLE-3 head shaped like one layer of the target, a 32k draft vocabulary."""
    target = llm.target.model
    head = build_head(Eagle3Config.for_target(target.config, draft_vocab_size=32000), target)
    init_head_weights(head, torch.Generator().manual_seed(0))
    return Eagle3Drafter(head, target, mode=mode, policy=False)


def run(engine: Engine, drafters: list[Drafter], prompts: list[list[int]], params: SamplingParams, k: int) -> dict[str, float]:
    """Every prompt through ``engine``, as many at once as it has lanes (arrival order), cold: no
    prefix cached from an earlier run, by the engine or the drafters."""
    engine.prefix_cache.clear()
    for lane in engine.lanes:
        lane.truncate(0)
    for d in drafters:
        d.reset()
    free = list(drafters)
    waiting = list(range(len(prompts)))
    running: dict[Any, Drafter] = {}
    stats: list[RequestStats] = []
    t0 = time.perf_counter()
    while waiting or running:
        while waiting and engine.has_room():
            drafter = free.pop()
            running[engine.add(prompts[waiting.pop(0)], params, drafter, k)] = drafter
        for gen, out in engine.step():
            if isinstance(out, Exception):
                raise out
            if out.finished:
                stats.append(out.stats)
                engine.remove(gen)
                free.append(running.pop(gen))
    wall = time.perf_counter() - t0
    passes = sum(s.target_passes for s in stats)
    return {
        "aggregate_tok_s": sum(s.output_tokens for s in stats) / wall,
        "mean_ttft_s": sum(s.ttft for s in stats) / len(stats),
        "tau": sum(s.accepted + s.target_passes for s in stats) / passes if passes else 0.0,
        "draft_seconds": sum(s.draft_seconds for s in stats),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--head", choices=["random-chain", "random-tree"], default=None,
                    help="draft with a random EAGLE-3 head instead of --draft")
    ap.add_argument("--num-draft", type=int, default=3, help="k per step (0: the auto drafter's cost model picks)")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None, help="default: benchmarks/results/concurrency/draft-batching/"
                    "in-process.json (a draft model), eagle3-<head>.json (--head)")
    args = ap.parse_args()
    llm = LLM(args.model, draft="none" if args.head else args.draft, num_draft=args.num_draft or None,
              max_concurrency=args.users, max_context=4096, threads=2)
    first = random_head_drafter(llm, args.head.removeprefix("random-")) if args.head else llm.drafter
    assert first is not None
    drafters = [first, *first.forks(args.users - 1)]
    k = args.num_draft if args.head else llm.num_draft
    items = load_dataset("mtbench", args.prompts, progress=False).items
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": it.turns[0]}], add_generation_prompt=True)
               for it in items]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    together = batch._groups
    modes = {"batched": together, "one by one": lambda asks: [[i] for i in asks]}
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode, groups in modes.items():
            setattr(batch, "_groups", groups)  # noqa: B010 (the one knob this benchmark turns)
            results[mode].append(run(llm.engine, drafters, prompts, params, k))
            print(f"round {r + 1} {mode:>10}: " + "  ".join(f"{k} {v:.2f}" for k, v in results[mode][-1].items()),
                  flush=True)
    setattr(batch, "_groups", together)  # noqa: B010

    def mean(mode: str, key: str) -> float:
        return sum(x[key] for x in results[mode]) / len(results[mode])

    ratio = mean("batched", "aggregate_tok_s") / mean("one by one", "aggregate_tok_s")
    drafting = mean("one by one", "draft_seconds") / max(mean("batched", "draft_seconds"), 1e-9)
    print(f"batched / one by one: aggregate tok/s {ratio:.2f}x; drafting time {drafting:.2f}x less")
    folder = Path("benchmarks/results/concurrency/draft-batching")
    out = Path(args.out) if args.out else folder / (f"eagle3-{args.head}.json" if args.head else "in-process.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": sys.argv, "settings": vars(args), "environment": environment(),
                               "prompts": "mtbench first turns", "results": results, "aggregate_ratio": ratio,
                               "drafting_ratio": drafting}, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
