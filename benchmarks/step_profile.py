"""Where one decode step's time goes: kernels and torch ops vs Python overhead (cProfile).

    .venv/bin/python benchmarks/step_profile.py [--model qwen2.5-coder-1.5b-instruct] [--rows 1] [--steps 30]

Prints the step time, the share spent inside compiled code (the quantized kernels, torch ops)
and the rest (Python: module calls, shape bookkeeping), and the top functions; writes JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quickdraft.api import configure_threads  # noqa: E402
from quickdraft.loading.load import load_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--rows", type=int, default=1, help="rows per pass (1 = decode, k+1 = verification)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/step_profile.json"))
    args = ap.parse_args()
    threads = configure_threads(args.threads)
    loaded = load_model(args.model, max_context=1024)
    model = loaded.model
    cache = model.new_cache()
    model(torch.arange(100, 356), cache)  # 256 tokens of context
    ids = torch.arange(7, 7 + args.rows)
    start = cache.length

    def step() -> None:
        cache.truncate(start)
        model(ids, cache)

    for _ in range(5):
        step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    plain = (time.perf_counter() - t0) / args.steps
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step()
    prof.disable()
    stats = pstats.Stats(prof)
    total = sum(v[2] for v in stats.stats.values()) / args.steps  # type: ignore[attr-defined]
    compiled = sum(v[2] for (f, _, name), v in stats.stats.items()  # type: ignore[attr-defined]
                   if f == "~" and not name.startswith("<built-in method builtins")) / args.steps
    rows = sorted(((v[2] / args.steps, f"{Path(f).name}:{line}({name})", v[0] // args.steps)
                   for (f, line, name), v in stats.stats.items()), reverse=True)[:15]  # type: ignore[attr-defined]
    print(f"{args.model}, {args.rows} row(s), {threads} threads: step {plain * 1e3:.1f} ms without the profiler")
    print(f"under cProfile: {total * 1e3:.1f} ms, of which compiled code (kernels, torch ops) {compiled * 1e3:.1f} ms "
          f"and Python {(total - compiled) * 1e3:.1f} ms ({(total - compiled) / total:.0%})")
    for sec, name, calls in rows:
        print(f"  {sec * 1e3:8.2f} ms  {calls:5d} calls  {name}")
    result = {
        "command": " ".join(sys.argv), "model": args.model, "rows": args.rows, "threads": threads,
        "torch": torch.__version__, "python": platform.python_version(), "q8_isa": _isa(),
        "step_ms": plain * 1e3, "profiled_step_ms": total * 1e3, "compiled_ms": compiled * 1e3,
        "python_ms": (total - compiled) * 1e3,
        "top": [{"ms": s * 1e3, "function": n, "calls_per_step": c} for s, n, c in rows],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def _isa() -> str | None:
    from quickdraft.quant.ggml import active_kernels

    mod = active_kernels()
    return None if mod is None else str(mod.isa())


if __name__ == "__main__":
    raise SystemExit(main())
