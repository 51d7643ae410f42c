"""Quantized linear kernels: one model pass worth of matmuls on a real GGUF model.

    .venv/bin/python benchmarks/linear_kernels.py                       # qwen-1.5b, rows 1 2 4 8 16 32, 2 threads
    .venv/bin/python benchmarks/linear_kernels.py --model qwen-0.5b --rows 1 8 --repeats 5 --no-bf16
    .venv/bin/python benchmarks/linear_kernels.py --modes q8 --out /tmp/k.json   # one mode only
    .venv/bin/python benchmarks/linear_kernels.py --modes q8-multi --isas avx2,avx512vnni --no-bf16  # both builds

A "model pass" is every linear layer of the real model (attn q/k/v/o, ffn gate/up/down of all
blocks, and output.weight) applied to T rows, with the real tensors' GGML types and shapes read
from the GGUF (matmuls only: no attention, norms or sampling). ``--isas`` times the q8 modes once per
build of the q8 GEMM (AVX2, AVX-512 VNNI; default: the one this CPU runs). Modes:

* ``q8``: GGMLLinear with int8 activations (the default path: integer dot products);
* ``q8-multi``: the same, with q/k/v and gate/up each computed by one ``ggml_linear_multi`` call
  (x quantized once, one parallel region), as the model code can call it;
* ``f32``: GGMLLinear with exact fp32 activations (weights dequantized in registers);
* ``bf16``: torch ``F.linear`` on the dequantized weights in bf16 (a baseline; ``--no-bf16``).

The row counts are timed in turn, round after round, and each reports its minimum over the rounds
(the machine may be shared: the minimum is the least disturbed pass; the median is shown, and the
median/minimum spread says how noisy the run was). Every call is also timed on its own: "calls" is
the sum over a pass's calls of each call's minimum, the pass as it runs undisturbed (steadier than
the best whole pass when other work shares the cores). Reported next to llama.cpp's llama-bench
figures from the issue (1.5B Q4_K_M, pp1..pp16, same machine class). Results are printed and
saved as JSON (command, versions, machine) in benchmarks/results/kernels.json.
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# Linears that read the same input: one ggml_linear_multi call each in the q8-multi mode.
GROUPS = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))
LLAMA_CPP_MS = {1: 58.0, 2: 94.0, 4: 141.0, 8: 306.0, 16: 380.0, 32: None}  # from the issue (1.5B)
MODES = ("q8", "q8-multi", "f32")


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


@dataclass
class Timing:
    """One row count's timings: whole passes, and each call's own best."""

    passes: list[float]  # seconds per whole pass, one per round
    call_min: float  # sum over the pass's calls of each call's minimum over the rounds


def time_rounds(passes: dict[int, list[Callable[[], object]]], rounds: int) -> dict[int, Timing]:
    """Time each row count's passes, the row counts interleaved round after round.

    Besides whole passes, every call is timed on its own: the sum of the calls' minima is the
    pass as it runs undisturbed, a far steadier figure than the best whole pass on a machine
    shared with other work (a 60 ms pass is rarely left alone; a 0.3 ms call often is).
    """
    for fns in passes.values():  # warm-up
        for f in fns:
            f()
    totals: dict[int, list[float]] = {r: [] for r in passes}
    calls: dict[int, list[float]] = {r: [float("inf")] * len(fns) for r, fns in passes.items()}
    clock = time.perf_counter
    for _ in range(rounds):
        for r, fns in passes.items():
            best = calls[r]
            start = clock()
            for i, f in enumerate(fns):
                t0 = clock()
                f()
                best[i] = min(best[i], clock() - t0)
            totals[r].append(clock() - start)
    return {r: Timing(totals[r], sum(calls[r])) for r in passes}


def table(
    times: dict[int, Timing], wbytes: int, macs_per_row: int, llama: bool
) -> list[dict[str, object]]:
    """Print and return one row per row count: times, ratios to the fewest rows, GB/s, GOP/s."""
    rows = []
    first = times[min(times)]
    base, base_calls = min(first.passes), first.call_min
    head = (
        f"{'rows':>4} {'ms/pass':>9} {'median':>8} {'calls':>8} {'x 1row':>7} {'calls x1':>8} "
        f"{'GB/s':>6} {'GOP/s':>6}"
    )
    print(head + (f" {'llama.cpp ms':>12}" if llama else ""))
    for r, tm in times.items():
        best, med, cm = min(tm.passes), statistics.median(tm.passes), tm.call_min
        row: dict[str, object] = {
            "rows": r,
            "ms_min": round(best * 1e3, 2),
            "ms_median": round(med * 1e3, 2),
            "ms_sum_of_call_minima": round(cm * 1e3, 2),
            "ratio_to_min_rows": round(best / base, 3),
            "ratio_to_min_rows_call_minima": round(cm / base_calls, 3),
            "weight_GBps": round(wbytes / best / 1e9, 2),
            "weight_GBps_call_minima": round(wbytes / cm / 1e9, 2),
            "GOPps": round(2 * r * macs_per_row / best / 1e9, 1),  # a multiply-add is 2 ops
            "GOPps_call_minima": round(2 * r * macs_per_row / cm / 1e9, 1),
        }
        line = (
            f"{r:4d} {best * 1e3:9.1f} {med * 1e3:8.1f} {cm * 1e3:8.1f} {best / base:7.2f} "
            f"{cm / base_calls:8.2f} {wbytes / best / 1e9:6.1f} {2 * r * macs_per_row / best / 1e9:6.1f}"
        )
        if llama:
            row["llama_cpp_ms"] = LLAMA_CPP_MS.get(r)
            line += f" {LLAMA_CPP_MS.get(r) or '-':>12}"
        rows.append(row)
        print(line)
    spread = max(statistics.median(tm.passes) / min(tm.passes) for tm in times.values())
    calls_vs_pass = max(min(tm.passes) / tm.call_min for tm in times.values())
    by = {r["rows"]: r for r in rows}
    notes = [
        f"noise: worst median/min {spread:.2f}, worst min pass / sum of call minima {calls_vs_pass:.2f}"
    ]
    if 1 in by:
        notes.append(
            f"1 row: {by[1]['weight_GBps']} GB/s of weights ({by[1]['weight_GBps_call_minima']} by call minima)"
        )
    if 8 in by:
        notes.append(
            f"8 rows: {by[8]['GOPps']} GOP/s ({by[8]['GOPps_call_minima']} by call minima)"
        )
    print("  " + "; ".join(notes))
    return rows


def module_passes(
    mods: list[object], names: list[str], rows: list[int], multi: bool
) -> dict[int, list[Callable[[], object]]]:
    """Per row count: the calls of one model pass (grouped into ggml_linear_multi if ``multi``)."""
    from quickdraft.quant.ggml import ggml_linear_multi

    dims = {m.in_features for m in mods}  # type: ignore[attr-defined]
    by_name = dict(zip(names, mods, strict=True))
    calls: list[list[object]] = []
    if multi:
        blocks = sorted({n.split(".")[1] for n in names if n.startswith("blk.")}, key=int)
        for b in blocks:
            for group in GROUPS:
                calls.append([by_name[f"blk.{b}.{g}.weight"] for g in group])
        calls += [[by_name[n]] for n in names if not n.startswith("blk.")]
    else:
        calls = [[m] for m in mods]
    passes: dict[int, list[Callable[[], object]]] = {}
    for r in rows:
        xs = {k: torch.randn(r, k) for k in dims}
        passes[r] = [
            functools.partial(ggml_linear_multi, c, xs[c[0].in_features])  # type: ignore[attr-defined]
            if len(c) > 1
            else functools.partial(c[0], xs[c[0].in_features])  # type: ignore[attr-defined]
            for c in calls
        ]
    return passes


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default="qwen2.5-coder-1.5b-instruct",
        help="GGUF path or zoo name (default: qwen2.5-coder-1.5b-instruct)",
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--repeats", type=int, default=9, help="rounds over all row counts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-bf16", action="store_true", help="skip the torch bf16 F.linear baseline")
    ap.add_argument(
        "--isas",
        default="auto",
        help="comma-separated q8 GEMM builds to time (avx2, avx512vnni; default: auto = this CPU's best)",
    )
    ap.add_argument("--out", default="benchmarks/results/kernels.json")
    args = ap.parse_args()

    from quickdraft import kernels
    from quickdraft.quant import GGMLLinear, kernels_active

    torch.set_num_threads(args.threads)
    if not Path(args.model).is_file():
        from quickdraft import zoo

        args.model = str(zoo.fetch(args.model))
    layers = load_layers(Path(args.model))
    if not kernels_active():
        print(
            f"warning: kernels not active ({kernels.load_error()}); timing the reference path",
            file=sys.stderr,
        )
    mods = [GGMLLinear(qt, raw, k) for _, qt, raw, k in layers]
    names = [name for name, *_ in layers]
    is_15b = "1.5b" in Path(args.model).name.lower()
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
    titles = {
        "q8": "GGMLLinear, q8 activations (int8 per block, integer dot products; the default):",
        "q8-multi": "GGMLLinear, q8 activations, q/k/v and gate/up as one ggml_linear_multi call each:",
        "f32": "GGMLLinear, f32 activations (exact; weights dequantized in registers):",
    }
    isas = [i.strip() for i in args.isas.split(",") if i.strip()]
    for mode in args.modes:
        for m in mods:
            m.activations = "f32" if mode == "f32" else "q8"
        passes = module_passes(mods, names, args.rows, multi=mode == "q8-multi")  # type: ignore[arg-type]
        for isa in isas if mode != "f32" else ["auto"]:
            kernels.set_isa(isa)
            key = mode if len(isas) == 1 or mode == "f32" else f"{mode}@{kernels.isa()}"
            print(titles[mode] + ("" if key == mode else f" [{kernels.isa()}]"))
            results[key] = table(time_rounds(passes, args.repeats), wbytes, macs_per_row, llama=is_15b)
        kernels.set_isa("auto")
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
        "q8_isa_auto": kernels.isa(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"),
            "numpy": np.__version__,
        },
        "machine": {"cpu": cpu, "logical_cpus": os.cpu_count(), "platform": platform.platform()},
        # other work on the machine at the end of the run (1, 5, 15-minute load averages)
        "load_average": [round(v, 2) for v in os.getloadavg()],
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
