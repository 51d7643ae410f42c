"""Resident memory with N cached conversations of L tokens each (issue: 8 x 4k on the 1.5B + 0.5B).

One L-token conversation is computed once; then N requests each branch from it in their last
``--branch`` tokens, so every request stores a full L-token copy (target KV + drafter state) while
recomputing only its branch. Prints and saves RSS before/after, the prefix cache's bytes and
entries, and the cached tokens per request.

    .venv/bin/python benchmarks/prefix_cache_memory.py --conversations 8 --tokens 4096
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import psutil
import torch

from quickdraft import LLM, SamplingParams, __version__


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--branch", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/prefix_cache_memory.json"))
    args = ap.parse_args()
    proc = psutil.Process()
    llm = LLM(args.model, draft=args.draft, log=lambda m: print(m, file=sys.stderr))
    rss_loaded = proc.memory_info().rss
    gen = torch.Generator().manual_seed(0)
    vocab = llm.tokenizer.vocab_size
    base = torch.randint(100, min(vocab, 30000), (args.tokens,), generator=gen).tolist()
    params = SamplingParams(max_tokens=1)
    t0 = time.perf_counter()
    llm.generate([base], params)  # the shared history, computed once
    first_s = time.perf_counter() - t0
    rows = []
    for _ in range(args.conversations):
        branch = torch.randint(100, min(vocab, 30000), (args.branch,), generator=gen).tolist()
        out = llm.generate([base[: args.tokens - args.branch] + branch], params)[0]
        rows.append({"cached_tokens": out.stats.cached_tokens, "ttft": out.stats.ttft})
    llm.generate([[5, 6, 7]], params)  # moves the last working sequence into the store too
    pc = llm.prefix_cache
    result = {
        "command": " ".join(sys.argv),
        "versions": {"quickdraft": __version__, "torch": torch.__version__, "python": platform.python_version()},
        "model": args.model, "draft": args.draft, "conversations": args.conversations, "tokens": args.tokens,
        "rss_loaded_mb": rss_loaded / 2**20, "rss_after_mb": proc.memory_info().rss / 2**20,
        "prefix_cache_mb": pc.nbytes / 2**20, "entries": len(pc.entries), "evicted": pc.stats.evicted,
        "first_prefill_s": first_s, "requests": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "requests"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
