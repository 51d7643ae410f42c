"""One matrix in each 4- and 8-bit block format the kernels read, one row (a decode step's
matmul), q8 activations: ms per call and the weight bytes read per second. The formats are timed
in turn, round after round; each reports its best round (the machine may be shared). Random valid
blocks (tests/test_kernels.py's), GPT-OSS-20b's expert shape by default (2 x 2880 gate/up rows).
JSON with the command and versions goes to benchmarks/results/block_formats.json.

    .venv/bin/python benchmarks/block_formats.py [--rows 5760 --cols 2880 --rounds 7]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from test_kernels import random_raw  # noqa: E402  (valid random blocks of any format)

from quickdraft.bench.report import environment  # noqa: E402
from quickdraft.quant.ggml import GGMLLinear  # noqa: E402

FORMATS = (Q.MXFP4, Q.IQ4_NL, Q.Q4_0, Q.Q4_K, Q.Q8_0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=5760)
    ap.add_argument("--cols", type=int, default=2880)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(1, args.cols)
    layers = {q.name: GGMLLinear(q, torch.from_numpy(random_raw(q, args.rows, args.cols, seed=1)), args.cols)
              for q in FORMATS if args.cols % (256 if q == Q.Q4_K else 32) == 0}
    best = dict.fromkeys(layers, float("inf"))
    for lin in layers.values():
        for _ in range(5):
            lin(x)
    for _ in range(args.rounds):
        for name, lin in layers.items():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                lin(x)
            best[name] = min(best[name], (time.perf_counter() - t0) / args.calls)
    rows = []
    for name, lin in layers.items():
        nbytes = lin.raw.numel()
        rows.append({"format": name, "ms": best[name] * 1e3, "GB_per_s": nbytes / best[name] / 1e9, "MiB": nbytes / 2**20})
        print(f"{name:7s} {best[name] * 1e3:6.2f} ms  {nbytes / best[name] / 1e9:5.1f} GB/s  {nbytes / 2**20:5.1f} MiB")
    out = Path(__file__).parent / "results" / "block_formats.json"
    out.write_text(json.dumps({"command": " ".join(sys.argv), "environment": environment(), "shape": [args.rows, args.cols],
                               "threads": args.threads, "results": rows}, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
