"""Quantized linear kernels: one model pass worth of matmuls on Qwen2.5-Coder-1.5B Q4_K_M.

    .venv/bin/python benchmarks/kernels.py                       # rows 1 2 4 8 16 32, 2 threads
    .venv/bin/python benchmarks/kernels.py --rows 1 8 --repeats 5 --no-bf16

A "model pass" is every linear layer of the real model (attn q/k/v/o, ffn gate/up/down of all 28
blocks, and output.weight) applied to T rows, with the real tensors' GGML types and shapes read
from the GGUF (matmuls only: no attention, norms or sampling). The row counts are timed in turn,
round after round, and each reports its minimum over the rounds (the machine may be shared: the
minimum is the least disturbed pass; the median is shown too). Reported next to llama.cpp's
llama-bench figures from the issue (pp1..pp16, same model and machine class) and a torch bf16
``F.linear`` baseline on the dequantized weights. Results are printed and saved as JSON
(command, versions, machine) in benchmarks/results/kernels.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
LLAMA_CPP_MS = {1: 58.0, 2: 94.0, 4: 141.0, 8: 306.0, 16: 380.0, 32: None}  # from the issue


def load_layers(path: Path) -> list[tuple[str, int, torch.Tensor, int]]:
    """[(name, ggml type, raw uint8 [N, row_bytes] in RAM, in_features)] for every linear layer."""
    import gguf

    reader = gguf.GGUFReader(path)
    out = []
    for t in reader.tensors:
        parts = t.name.split(".")
        in_block = t.name.startswith("blk.") and parts[2] in LINEARS and parts[3] == "weight"
        if in_block or t.name == "output.weight":
            raw = torch.from_numpy(np.array(t.data, copy=True))  # off the memmap, into RAM
            out.append((t.name, int(t.tensor_type), raw, int(t.shape[0])))
    return out


def time_rounds(
    passes: dict[int, list[Callable[[], object]]], rounds: int
) -> dict[int, list[float]]:
    """Seconds per pass for each row count, the row counts interleaved round after round."""
    for fns in passes.values():  # warm-up
        for f in fns:
            f()
    times: dict[int, list[float]] = {r: [] for r in passes}
    for _ in range(rounds):
        for r, fns in passes.items():
            t0 = time.perf_counter()
            for f in fns:
                f()
            times[r].append(time.perf_counter() - t0)
    return times


def table(
    times: dict[int, list[float]], wbytes: int, macs_per_row: int, llama: bool
) -> list[dict[str, object]]:
    rows = []
    base = min(times[min(times)])
    head = f"{'rows':>4} {'ms/pass':>9} {'median':>8} {'x 1row':>7} {'GB/s':>6} {'GFLOP/s':>8}"
    print(head + (f" {'llama.cpp ms':>12}" if llama else ""))
    for r, ts in times.items():
        best = min(ts)
        row: dict[str, object] = {
            "rows": r,
            "ms_min": round(best * 1e3, 2),
            "ms_median": round(statistics.median(ts) * 1e3, 2),
            "ratio_to_min_rows": round(best / base, 3),
            "weight_GBps": round(wbytes / best / 1e9, 2),
            "GFLOPps": round(2 * r * macs_per_row / best / 1e9, 1),
        }
        line = (
            f"{r:4d} {best * 1e3:9.1f} {statistics.median(ts) * 1e3:8.1f} {best / base:7.2f} "
            f"{wbytes / best / 1e9:6.1f} {2 * r * macs_per_row / best / 1e9:8.1f}"
        )
        if llama:
            row["llama_cpp_ms"] = LLAMA_CPP_MS.get(r)
            line += f" {LLAMA_CPP_MS.get(r) or '-':>12}"
        rows.append(row)
        print(line)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default=None, help="GGUF path (default: the zoo's qwen2.5-coder-1.5b-instruct)"
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--repeats", type=int, default=9, help="rounds over all row counts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-bf16", action="store_true", help="skip the torch bf16 F.linear baseline")
    ap.add_argument("--out", default="benchmarks/results/kernels.json")
    args = ap.parse_args()

    from quickdraft import kernels
    from quickdraft.quant import GGMLLinear, kernels_active

    torch.set_num_threads(args.threads)
    if args.model is None:
        from quickdraft import zoo

        args.model = str(zoo.fetch("qwen2.5-coder-1.5b-instruct"))
    layers = load_layers(Path(args.model))
    if not kernels_active():
        print(
            f"warning: kernels not active ({kernels.load_error()}); timing the reference path",
            file=sys.stderr,
        )
    mods = [GGMLLinear(qt, raw, k) for _, qt, raw, k in layers]
    wbytes = sum(m.weight_bytes for m in mods)
    macs_per_row = sum(m.in_features * m.out_features for m in mods)
    types: dict[str, float] = {}
    for m in mods:
        types[m.qtype.name] = types.get(m.qtype.name, 0.0) + m.weight_bytes / 1e9
    by_type = ", ".join(f"{k} {v:.3f} GB" for k, v in types.items())
    print(
        f"{args.model}: {len(mods)} linear layers, {wbytes / 1e9:.3f} GB of weights ({by_type}), "
        f"{macs_per_row / 1e9:.3f} GMAC per row; {args.threads} threads"
    )
    dims = {m.in_features for m in mods}
    results: dict[str, list[dict[str, object]]] = {}

    passes: dict[int, list[Callable[[], object]]] = {}
    for r in args.rows:
        xs = {k: torch.randn(r, k) for k in dims}
        passes[r] = [functools.partial(m, xs[m.in_features]) for m in mods]
    print("quickdraft GGMLLinear (fp32 activations, weights in their GGML blocks):")
    results["quantized"] = table(
        time_rounds(passes, args.repeats), wbytes, macs_per_row, llama=True
    )
    del passes

    if not args.no_bf16:
        ws = [m.dequantize().to(torch.bfloat16) for m in mods]  # bit-exact dequant, then bf16
        bbytes = sum(w.numel() * 2 for w in ws)
        bpasses: dict[int, list[Callable[[], object]]] = {}
        for r in args.rows:
            xb = {k: torch.randn(r, k).to(torch.bfloat16) for k in dims}
            bpasses[r] = [functools.partial(F.linear, xb[w.shape[1]], w) for w in ws]
        print(f"torch bf16 F.linear baseline ({bbytes / 1e9:.2f} GB of bf16 weights):")
        results["bf16"] = table(
            time_rounds(bpasses, args.repeats), bbytes, macs_per_row, llama=False
        )
        del bpasses, ws

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import gguf

    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": args.model,
        "threads": args.threads,
        "rounds": args.repeats,
        "weight_bytes": wbytes,
        "weight_GB_by_type": types,
        "macs_per_row": macs_per_row,
        "kernels_active": kernels_active(),
        "kernels_build": kernels.build_name(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"),
            "numpy": np.__version__,
        },
        "machine": {"cpu": cpu, "logical_cpus": os.cpu_count(), "platform": platform.platform()},
        "llama_cpp_ms_from_issue": LLAMA_CPP_MS,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"saved {args.out}")


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
