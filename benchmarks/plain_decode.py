"""Plain greedy decode speed (batch 1): tokens/s over N new tokens, load time, resident memory.

    .venv/bin/python benchmarks/plain_decode.py --models smollm2 qwen-0.5b qwen-1.5b --tokens 256

Each model is loaded in a fresh subprocess so resident memory is its own. Results are printed
and saved as JSON (command, versions, machine) under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Write a Python function that parses an ISO 8601 date string and returns a datetime, with tests."


def measure(model: str, tokens: int, dtype: str) -> dict[str, object]:
    import psutil
    import torch

    from quickdraft import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, draft="none")
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(max_tokens=8))  # warm-up
    t0 = time.perf_counter()
    out = llm.chat([{"role": "user", "content": PROMPT}], params)
    wall = time.perf_counter() - t0
    return {
        "model": model, "path": str(llm.target.path), "dtype": dtype, "threads": torch.get_num_threads(),
        "new_tokens": out.stats.output_tokens, "prompt_tokens": out.stats.prompt_tokens,
        "tokens_per_second": out.stats.tokens_per_second, "ttft_s": out.stats.ttft, "wall_s": wall,
        "load_s": llm.target.load_seconds, "rss_gb": psutil.Process().memory_info().rss / 1e9,
        "gguf_gb": Path(llm.target.path).stat().st_size / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2", "qwen-0.5b", "qwen-1.5b"])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="benchmarks/results/plain_decode.json")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.tokens, args.dtype)))
        return
    rows = []
    for m in args.models:
        cmd = [sys.executable, __file__, "--one", m, "--tokens", str(args.tokens), "--dtype", args.dtype]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{m:28s} {r['tokens_per_second']:6.1f} tok/s  load {r['load_s']:5.1f} s  "
              f"RSS {r['rss_gb']:.2f} GB (GGUF {r['gguf_gb']:.2f} GB)", flush=True)
    import torch

    record = {"command": " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
              "machine": platform.machine(), "cpu": platform.processor(), "prompt": PROMPT, "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
