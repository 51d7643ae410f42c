"""A first start on a busy machine must not leave slower kernels or wrong pass costs behind.

Two fresh caches (the models and prepared weights linked in, nothing measured kept): cache A's
first start runs while other programs keep every core busy (``--hogs`` busy loops), cache B's on
the quiet machine. After the load ends, plain decoding is timed from each cache in turn
(``--rounds`` alternations of ``quickdraft generate --draft none``): the ratio A / B is what the
busy start cost (goal: >= 0.95). Also printed: each first start's kernel and pass-cost lines
(a busy one says "not kept"), and what each cache kept.

    .venv/bin/python benchmarks/busy_first_start.py [--model qwen-1.5b] [--rounds 3] [--tokens 128]

Saves benchmarks/results/busy_first_start/<name>.json with the command, versions and CPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a Python function that merges two sorted lists into one sorted list."
KEPT = ("kernel_choices.json", "pass_costs.json")


def _hog(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _cache(base: Path, name: str) -> Path:
    """A fresh cache folder sharing the user's downloaded models and prepared weights."""
    from quickdraft import zoo

    folder = base / name
    folder.mkdir()
    for shared in ("models", "prepared", "token_ranks"):
        if (zoo.cache_dir() / shared).exists():
            (folder / shared).symlink_to(zoo.cache_dir() / shared)
    return folder


def _generate(cache: Path, model: str, tokens: int, draft: str = "none") -> tuple[float, list[str]]:
    """Decode tok/s of one ``quickdraft generate`` from ``cache``, and its stderr lines."""
    env = dict(os.environ, QUICKDRAFT_CACHE=str(cache))
    cmd = [sys.executable, "-m", "quickdraft", "generate", "-m", model, "--draft", draft, "-n", str(tokens),
           "--ignore-eos", PROMPT]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"quickdraft generate failed ({out.returncode}):\n{out.stderr[-2000:]}")
    lines = out.stderr.splitlines()
    speed = next((float(m.group(1)) for line in lines if (m := re.search(r"([\d.]+) tokens/s", line))), 0.0)
    return speed, lines


def _kept(cache: Path) -> dict[str, int]:
    """Entries each kept file of ``cache`` holds (0: none, or no file)."""
    out = {}
    for name in KEPT:
        try:
            out[name] = len(json.loads((cache / name).read_text()))
        except (OSError, ValueError):
            out[name] = 0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="busy processes during the busy start")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    from quickdraft import __version__
    from quickdraft.hardware import cpu_model

    with tempfile.TemporaryDirectory(prefix="qd-busy-") as tmp:
        busy, quiet = _cache(Path(tmp), "busy"), _cache(Path(tmp), "quiet")
        hogs = [mp.Process(target=_hog, args=(600.0,), daemon=True) for _ in range(args.hogs)]
        for h in hogs:
            h.start()
        try:
            _, busy_lines = _generate(busy, args.model, 8)
        finally:
            for h in hogs:
                h.terminate()
                h.join()
        time.sleep(2.0)
        kept_after_busy = _kept(busy)
        _, quiet_lines = _generate(quiet, args.model, 8)
        kept_after_quiet = _kept(quiet)
        speeds: dict[str, list[float]] = {"busy": [], "quiet": []}
        after: list[str] = []
        for r in range(args.rounds):
            for name, cache in (("busy", busy), ("quiet", quiet)) if r % 2 == 0 else (("quiet", quiet), ("busy", busy)):
                speed, lines = _generate(cache, args.model, args.tokens)
                speeds[name].append(speed)
                if name == "busy" and r == 0:
                    after = [line for line in lines if line.startswith(("kernels:", "measuring", "pass costs"))]
    ratio = statistics.median(speeds["busy"]) / statistics.median(speeds["quiet"])
    pick = ("kernels:", "measuring", "pass costs", "choosing")
    report = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": {"quickdraft": __version__, "python": platform.python_version()},
        "cpu": cpu_model(),
        "model": args.model,
        "hogs": args.hogs,
        "busy_first_start": [line for line in busy_lines if line.startswith(pick)],
        "kept_after_busy_start": kept_after_busy,
        "next_start_of_the_busy_cache": after,
        "quiet_first_start": [line for line in quiet_lines if line.startswith(pick)],
        "kept_after_quiet_start": kept_after_quiet,
        "decode_tok_s": speeds,
        "ratio_busy_over_quiet": round(ratio, 3),
    }
    for key in ("busy_first_start", "kept_after_busy_start", "next_start_of_the_busy_cache", "quiet_first_start",
                "kept_after_quiet_start", "decode_tok_s"):
        print(f"{key}: {report[key]}")
    print(f"plain decode after the load ended, busy-start cache / quiet-start cache: {ratio:.3f}x "
          f"({'PASS' if ratio >= 0.95 else 'FAIL'}: goal >= 0.95)")
    out = ROOT / "benchmarks" / "results" / "busy_first_start" / f"{args.name or 'run'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
