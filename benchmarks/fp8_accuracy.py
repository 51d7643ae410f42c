"""FP8 vs bf16 accuracy: perplexity on held-out text and greedy n-gram-drafter tau.

    .venv/bin/python benchmarks/fp8_accuracy.py                       # SmolLM2-135M, ~a few minutes
    .venv/bin/python benchmarks/fp8_accuracy.py --model qwen-0.5b --max-tokens 4096

The model (zoo name, GGUF or folder) runs in bf16 (``dtype=bfloat16``: GGUF weights dequantized
to bf16) and as its FP8 copies written by ``quickdraft quantize --fp8`` (per-channel or 128x128
block scales, ``amax / 448`` or least-squared-error "mse" scales; weights dequantized to bf16,
activations bf16). Optionally also with FP8 activations (``--w8a8``: per-token dynamic activation
scales through ``torch._scaled_mm``, the path FP8 GPUs take) to see what that costs. For each: perplexity on the source of a Python
standard-library module that nothing else in quickdraft uses (default ``textwrap``, non-overlapping
windows, see ``quickdraft.eval.perplexity``), and greedy chat answers to a few code-editing prompts
with the n-gram drafter (tau = tokens per target pass; how many answer tokens equal the bf16
answer's). Results (with command and versions) go to ``benchmarks/results/fp8_accuracy.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

PROMPTS = [
    "Add type hints and a docstring to this function, and return the whole function:\n\n"
    "def moving_average(values, window):\n    result = []\n    total = 0\n"
    "    for i, v in enumerate(values):\n        total += v\n        if i >= window:\n"
    "            total -= values[i - window]\n        if i >= window - 1:\n"
    "            result.append(total / window)\n    return result\n",
    "Rename the variable `x` to `count` everywhere in this code and show the result:\n\n"
    "def tally(words):\n    x = {}\n    for w in words:\n        x[w] = x.get(w, 0) + 1\n"
    "    return sorted(x.items(), key=lambda kv: -kv[1])\n",
    "Convert this JavaScript to Python:\n\nfunction clamp(v, lo, hi) {\n  if (v < lo) return lo;\n"
    "  if (v > hi) return hi;\n  return v;\n}\nfunction scale(xs, f) {\n  return xs.map(x => clamp(x * f, 0, 255));\n}\n",
    "Write a Python class Stack with push, pop, peek and is_empty methods, then show how to use it.",
]


def _versions() -> dict[str, str]:
    import quickdraft

    return {"python": platform.python_version(), "torch": torch.__version__, "quickdraft": quickdraft.__version__,
            "machine": platform.machine(), "threads": str(torch.get_num_threads())}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def measure(name: str, spec: str, ids: list[int], args: argparse.Namespace, mode: str, generate: bool = True) -> dict[str, Any]:
    from quickdraft import LLM, SamplingParams
    from quickdraft.eval import perplexity
    from quickdraft.quant.fp8 import cache_dequantized_weights, using_activation_mode

    t0 = time.perf_counter()
    llm = LLM(spec, dtype="bfloat16", draft="ngram", max_context=max(args.context, 2048))
    # Bitwise the same results (tests/test_fp8.py), just faster on CPU: keep the bf16 weights.
    fp8_layers = cache_dequantized_weights(llm.target.model)
    with using_activation_mode(mode):
        t1 = time.perf_counter()
        ppl = perplexity(llm.target.model, ids, context=args.context)
        t2 = time.perf_counter()
        answers = []
        for prompt in PROMPTS if generate else []:
            out = llm.chat([{"role": "user", "content": prompt}], SamplingParams(max_tokens=args.gen_tokens))
            answers.append({"tau": out.stats.tau, "acceptance": out.stats.acceptance_rate, "accepted": out.stats.accepted,
                            "output_tokens": out.stats.output_tokens, "target_passes": out.stats.target_passes,
                            "token_ids": out.token_ids})
        t3 = time.perf_counter()
    passes = sum(a["target_passes"] for a in answers)
    tau_all = (sum(a["accepted"] for a in answers) + passes) / passes if passes else None  # as RequestStats.tau
    print(f"{name:22s} ppl {ppl.ppl:8.4f}  tau {tau_all or 0:5.3f}  ({fp8_layers} FP8 layers; "
          f"ppl {t2 - t1:5.1f} s, generation {t3 - t2:5.1f} s)", flush=True)
    return {"name": name, "spec": spec, "activation_mode": mode, "fp8_layers": fp8_layers,
            "dequantized_weight_cache": fp8_layers > 0,
            "perplexity": ppl.ppl, "nll": ppl.nll, "scored_tokens": ppl.tokens, "windows": ppl.windows,
            "tau": tau_all, "answers": answers, "load_s": t1 - t0, "ppl_s": t2 - t1, "generation_s": t3 - t2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--text", default="stdlib:textwrap", help="stdlib:MODULE or a text file")
    ap.add_argument("--max-tokens", type=int, default=6144, help="perplexity over at most this many tokens")
    ap.add_argument("--context", type=int, default=1024, help="perplexity window")
    ap.add_argument("--gen-tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--schemes", default="channel,block,channel:mse",
                    help="FP8 copies to measure: SCHEME[:OBSERVER], SCHEME channel|block, OBSERVER minmax|mse")
    ap.add_argument("--w8a8", action="store_true", help="also FP8 activations (torch._scaled_mm) for the channel scheme")
    ap.add_argument("--out", default="benchmarks/results/fp8_accuracy.json")
    args = ap.parse_args()

    from quickdraft.api import configure_threads
    from quickdraft.eval import load_text
    from quickdraft.export.fp8 import export_fp8
    from quickdraft.loading.load import load_model

    configure_threads(None)
    text = load_text(args.text)
    tokenizer = load_model(args.model, dtype="bfloat16", max_context=16).tokenizer
    ids = tokenizer.encode(text)[: args.max_tokens]
    print(f"{args.text}: {len(text)} chars, {len(ids)} tokens scored in windows of {args.context}", flush=True)
    runs = []
    exports = {}
    with tempfile.TemporaryDirectory(prefix="fp8-accuracy-") as tmp:
        runs.append(measure("bf16", args.model, ids, args, "weight-only"))
        for variant in [v for v in args.schemes.split(",") if v]:
            scheme, _, observer = variant.partition(":")
            name = f"fp8-{scheme}" + (f"-{observer}" if observer else "")
            t0 = time.perf_counter()
            res = export_fp8(args.model, Path(tmp) / name, scheme=scheme, observer=observer or "minmax")
            exports[name] = {"seconds": time.perf_counter() - t0, "bytes": res.bytes_written,
                             "fp8_layers": len(res.quantized), "kept": res.kept}
            runs.append(measure(name, str(res.path), ids, args, "weight-only"))
            if args.w8a8 and variant == "channel":  # perplexity only: _scaled_mm is slow on CPUs
                runs.append(measure("fp8-channel-w8a8", str(res.path), ids, args, "fp8", generate=False))
    base = runs[0]
    for r in runs:
        r["ppl_rel_change"] = r["perplexity"] / base["perplexity"] - 1
        r["tau_rel_change"] = r["tau"] / base["tau"] - 1 if r["tau"] and base["tau"] else None
        r["same_tokens_as_bf16"] = [
            _common_prefix(a["token_ids"], b["token_ids"]) for a, b in zip(r["answers"], base["answers"], strict=False)
        ]
    print("\nname                   ppl      vs bf16   tau     vs bf16   identical answer prefix (tokens)")
    for r in runs:
        tau = f"{r['tau']:5.3f} {100 * r['tau_rel_change']:+6.2f}%" if r["tau"] else "    -        -"
        print(f"{r['name']:22s} {r['perplexity']:8.4f} {100 * r['ppl_rel_change']:+6.2f}%  {tau}   {r['same_tokens_as_bf16']}")
    result = {
        "command": " ".join(["benchmarks/fp8_accuracy.py", *sys.argv[1:]]),
        "versions": _versions(),
        "model": args.model,
        "text": {"spec": args.text, "chars": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest(),
                 "tokens": len(ids), "context": args.context},
        "prompts": PROMPTS,
        "gen_tokens": args.gen_tokens,
        "exports": exports,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
