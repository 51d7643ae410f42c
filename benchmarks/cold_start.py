"""Cold start: seconds from process start to the first answer byte, quickdraft against llama.cpp.

Each contender is a fresh process answering "Hi" (chat template, greedy, a few tokens) with the
model already downloaded; the clock starts before the process is spawned and stops at the first
byte of the answer on its stdout (quickdraft's load messages go to stderr). Contenders run in
turn, ``--repeats`` rounds, so a noisy neighbour hits all alike; the medians and their ratios to
llama.cpp are printed and saved as JSON with the commands and versions.

llama.cpp is llama-cpp-python's ``Llama`` (create_chat_completion, stream=True) in its own virtual
environment (``--llamacpp-python``), with the same GGUF, threads and context length.

    QUICKDRAFT_ISA=avx2 .venv/bin/python benchmarks/cold_start.py \\
        --llamacpp-python ~/.cache/quickdraft/llamacpp-avx2-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from quickdraft.bench.report import environment

LLAMACPP = """
import sys
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]), n_ctx=int(sys.argv[3]),
            verbose=False)
for chunk in llm.create_chat_completion([{"role": "user", "content": "Hi"}], stream=True, max_tokens=4,
                                        temperature=0.0):
    text = chunk["choices"][0]["delta"].get("content")
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()
"""


def first_byte_seconds(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    seconds = time.perf_counter() - t0
    _, err = proc.communicate()
    if not first or proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{err.decode(errors='replace')[-2000:]}")
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--drafts", default="none,auto", help="quickdraft --draft values to time")
    ap.add_argument("--llamacpp-python", help="python of the environment holding llama-cpp-python")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cold_start.json"))
    args = ap.parse_args()
    from quickdraft.loading.load import resolve

    gguf = str(resolve(args.model))
    quickdraft = [sys.executable, "-m", "quickdraft"]
    contenders: dict[str, list[str]] = {
        f"quickdraft --draft {d}": [*quickdraft, "generate", "Hi", "--model", args.model, "--draft", d,
                                    "--max-tokens", "4", "--threads", str(args.threads),
                                    "--max-context", str(args.context)]
        for d in args.drafts.split(",")
    }
    if args.llamacpp_python:
        contenders["llama.cpp"] = [args.llamacpp_python, "-c", LLAMACPP, gguf, str(args.threads), str(args.context)]
    env = dict(os.environ)
    for name, cmd in contenders.items():  # untimed once: page cache, extension build, prepared weights
        first_byte_seconds(cmd, env)
        print(f"warmed {name}", file=sys.stderr, flush=True)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(args.repeats):
        for name, cmd in contenders.items():
            times[name].append(first_byte_seconds(cmd, env))
            print(f"round {r + 1}: {name} {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    ref = med.get("llama.cpp")
    for name, m in med.items():
        ratio = f"  {m / ref:.2f}x llama.cpp" if ref else ""
        print(f"{name:28s} first byte {m:5.2f} s (median of {args.repeats}){ratio}")
    env_info = environment()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": " ".join(sys.argv), **env_info, "model": gguf, "isa": os.environ.get("QUICKDRAFT_ISA"),
        "contenders": contenders, "seconds": times, "median": med,
    }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
