"""Pass costs at long contexts: a decode (1 row), verify (4, 8 rows) and prefill chunk (64 rows)
of the target at 1k-32k tokens of context, and attention's share of each.

The cache is filled with random keys and values up to the context length (their values do not
change the time) instead of a prefill of 32k tokens; each pass is timed ``--repeats`` times
(median) and rolled back. Attention alone is the native ``attend`` over the same slots, once per
layer, with the pass's rows. Prints a table; saves JSON with the command and versions.

    QUICKDRAFT_ISA=avx2 .venv/bin/python benchmarks/long_context.py --kv-dtype float16 float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from quickdraft.api import configure_threads
from quickdraft.bench.report import environment
from quickdraft.loading.load import load_model
from quickdraft.quant.ggml import active_kernels


def timed(fn, repeats: int) -> float:  # noqa: ANN001
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def measure(args: argparse.Namespace, kv: str) -> list[dict[str, object]]:
    ops = active_kernels()
    max_len = max(args.contexts) + max(args.rows)
    loaded = load_model(args.model, max_context=max_len, kv_dtype=kv)
    model, cfg = loaded.model, loaded.config
    cache = model.make_cache(max_len)
    stored = cache.attention  # (a dense model's cache: its keys and values)
    g = torch.Generator().manual_seed(0)
    for layer in range(cfg.num_hidden_layers):  # plausible magnitudes, no NaNs
        stored.k[layer].copy_(torch.randn(stored.k[layer].shape, generator=g).to(stored.k.dtype))
        stored.v[layer].copy_(torch.randn(stored.v[layer].shape, generator=g).to(stored.v.dtype))
    print(f"{args.model}: KV {stored.k.dtype}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} / "
          f"{cfg.num_key_value_heads} heads", file=sys.stderr)

    def one_pass(ids: torch.Tensor, ctx: int) -> None:
        cache.truncate(0)
        cache.length = ctx  # as if ctx tokens were there: their values do not change the time
        model(ids, cache, num_logits=1)

    def attention(q: torch.Tensor, ctx: int) -> None:
        assert ops is not None
        end = ctx + q.shape[1]
        for layer in range(cfg.num_hidden_layers):
            ops.attend(q, stored.k_layers[layer][:, :end], stored.v_layers[layer][:, :end], ctx, 0,
                       cfg.head_dim ** -0.5, None, None)

    results: list[dict[str, object]] = []
    for ctx in args.contexts:
        for rows in args.rows:
            ids = torch.randint(0, cfg.vocab_size, (rows,), generator=g)
            seconds = timed(lambda: one_pass(ids, ctx), args.repeats)  # noqa: B023 (called at once)
            attn = None
            if ops is not None:
                q = torch.randn(cfg.num_attention_heads, rows, cfg.head_dim, generator=g)
                attn = timed(lambda: attention(q, ctx), args.repeats)  # noqa: B023
            results.append({"kv_dtype": kv, "context": ctx, "rows": rows, "pass_ms": seconds * 1e3,
                            "attention_ms": None if attn is None else attn * 1e3,
                            "attention_share": None if attn is None else attn / seconds})
            share = "" if attn is None else f"  attention {attn * 1e3:7.1f} ms ({attn / seconds:4.0%})"
            print(f"kv {kv:8s} context {ctx:6d} rows {rows:3d}: pass {seconds * 1e3:7.1f} ms"
                  f" ({rows / seconds:6.1f} rows/s){share}", flush=True)
    cache.truncate(0)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096, 16384, 32000])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 64])
    ap.add_argument("--kv-dtype", nargs="+", default=["float16"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/long_context.json"))
    args = ap.parse_args()
    configure_threads(args.threads)
    results = [r for kv in args.kv_dtype for r in measure(args, kv)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": " ".join(sys.argv), **environment(), "model": args.model,
                                    "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
