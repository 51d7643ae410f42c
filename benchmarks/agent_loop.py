"""An agent loop with tools against ``quickdraft serve``: TTFT and output tokens/s per turn, with
``--draft none`` and with the default drafter, measured side by side in one run.

    .venv/bin/python benchmarks/agent_loop.py                       # Qwen2.5-Coder-1.5B, 3 rounds
    QUICKDRAFT_ISA=avx2 .venv/bin/python benchmarks/agent_loop.py --rounds 5 --out benchmarks/results/agent_loop-avx2.json

Two servers of the same model run at once (2 threads each), and the loop runs on them in turn,
never at the same time: round r runs the whole loop on one server, then on the other, the order
alternating per round. The loop: a system prompt, a task that needs two tools (a population lookup,
then a calculator), tool results fed back as ``role: "tool"`` messages until the model answers
without a call (at most 6 turns). Every request streams (``stream_options.include_usage``), greedy:
TTFT = the server's time to the first output token (usage.quickdraft.ttft_s; a tool call is
streamed once complete, so the first delta comes later: reported as first_delta_s); tokens/s = output tokens after the
first / time after the first (RequestStats' definition, from the server's usage). The calls and the
answer of the two servers must be identical (speculation is lossless); the script exits 1 if not.
Turns after the first reuse the prefix cache (the conversation so far), so their TTFT is short.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from statistics import median
from typing import Any

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression and return the result.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": "an arithmetic expression"}
                },
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "population",
            "description": "Look up the population of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "the city's name"}},
                "required": ["city"],
            },
        },
    },
]
SYSTEM = "You are a helpful assistant. Use the tools, one step at a time."
TASK = "Look up the population of Lisbon, then use the calculator to multiply it by 3."
POPULATION = {"lisbon": "545923", "oslo": "709037"}


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments)
    except ValueError:
        return "error: the arguments are not JSON"
    if name == "population":
        return POPULATION.get(str(args.get("city", "")).strip().lower(), "unknown")
    expr = str(args.get("expression", ""))
    if not expr or not set(expr) <= set("0123456789+-*/(). "):
        return "error: only numbers and + - * / ( ) are allowed"
    try:
        return str(eval(expr, {"__builtins__": {}}))  # noqa: S307 - digits and operators only
    except Exception as exc:  # a syntax error in what the model wrote
        return f"error: {exc}"


def start(model: str, draft: str | None, threads: int, context: int) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "quickdraft", "serve", "--model", model, "--served-model-name", "m",
           "--port", "0", "--threads", str(threads), "--max-context", str(context)]
    if draft is not None:
        cmd += ["--draft", draft]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            found = re.search(r"serving \S+ at (http://\S+/v1)", line)
            if found:
                url.append(found.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    ready.wait(600)
    if not url:
        proc.kill()
        raise SystemExit(f"error: the server ({' '.join(cmd)}) did not start")
    return proc, url[0]


def turn(client: Any, messages: list[dict[str, Any]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    first = None
    content = ""
    calls: dict[int, dict[str, str]] = {}
    usage = None
    finish = None
    for chunk in client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, temperature=0, max_tokens=256, stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if (delta.content or delta.tool_calls) and first is None:
            first = time.perf_counter() - t0
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] = tc.id or entry["id"]
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert usage is not None
    extra = usage.model_extra.get("quickdraft", {})
    return {
        "ttft_s": extra.get("ttft_s"),
        "first_delta_s": first,
        "wall_s": time.perf_counter() - t0,
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.prompt_tokens_details.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "tokens_per_second": extra.get("tokens_per_second"),
        "tau": extra.get("tau"),
        "finish_reason": finish,
        "content": content,
        "tool_calls": [calls[i] for i in sorted(calls)],
    }


def loop(url: str) -> list[dict[str, Any]]:
    import openai

    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}
    ]
    turns = []
    for _ in range(6):
        t = turn(client, messages)
        turns.append(t)
        if not t["tool_calls"]:
            break
        messages.append({
            "role": "assistant", "content": t["content"] or None,
            "tool_calls": [{"id": c["id"], "type": "function",
                            "function": {"name": c["name"], "arguments": c["arguments"]}}
                           for c in t["tool_calls"]],
        })
        for c in t["tool_calls"]:
            messages.append({"role": "tool", "tool_call_id": c["id"],
                             "content": run_tool(c["name"], c["arguments"])})
    return turns


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/agent_loop.json"))
    args = ap.parse_args()
    from quickdraft import __version__, kernels
    from quickdraft.bench.report import environment
    from quickdraft.loading.load import resolve

    model = str(resolve(args.model))
    servers = {"none": start(model, "none", args.threads, args.context),
               "auto": start(model, None, args.threads, args.context)}
    runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in servers}
    try:
        order = list(servers)
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                time.sleep(0.2)
                runs[name].append(loop(servers[name][1]))
                t = runs[name][-1]
                print(f"round {r + 1} {name}: " + ", ".join(
                    f"turn {i + 1} ttft {x['ttft_s']:.2f}s {x['output_tokens']} tok "
                    f"{x['tokens_per_second'] or 0:.1f} tok/s" for i, x in enumerate(t)), flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)

    def shape(t: list[dict[str, Any]]) -> list[tuple[str, str]]:
        return [(json.dumps(x["tool_calls"] and [(c["name"], c["arguments"]) for c in x["tool_calls"]]),
                 x["content"]) for x in t]

    lossless = all(shape(a) == shape(b) for a, b in zip(runs["none"], runs["auto"], strict=True))
    n_turns = len(runs["none"][0])
    table = []
    for i in range(n_turns):
        row: dict[str, Any] = {"turn": i + 1}
        for name in servers:
            xs = [t[i] for t in runs[name] if len(t) > i]
            row[name] = {
                "ttft_s": round(median(x["ttft_s"] for x in xs), 3),
                "first_delta_s": round(median(x["first_delta_s"] for x in xs), 3),
                "ttft_round1_s": round(xs[0]["ttft_s"], 3),  # nothing of the loop cached yet
                "tokens_per_second": round(median(x["tokens_per_second"] or 0 for x in xs), 2),
                "output_tokens": xs[0]["output_tokens"],
                "prompt_tokens": xs[0]["prompt_tokens"],
                "cached_tokens": xs[0]["cached_tokens"],
                "tau": xs[0]["tau"],
                "kind": "tool call" if xs[0]["tool_calls"] else "answer",
            }
        row["speedup"] = round(row["auto"]["tokens_per_second"] / row["none"]["tokens_per_second"], 3) \
            if row["none"]["tokens_per_second"] else None
        table.append(row)
    print("\nTTFT: round 1 (cold) / median of all rounds; tok/s: median of all rounds")
    print("| turn | kind | prompt (cached) | out tok | none TTFT s | auto TTFT s | none tok/s | auto tok/s | auto/none |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in table:
        a, n = row["auto"], row["none"]
        print(f"| {row['turn']} | {n['kind']} | {n['prompt_tokens']} ({n['cached_tokens']}) | {n['output_tokens']} | "
              f"{n['ttft_round1_s']:.2f} / {n['ttft_s']:.2f} | {a['ttft_round1_s']:.2f} / {a['ttft_s']:.2f} | "
              f"{n['tokens_per_second']:.1f} | "
              f"{a['tokens_per_second']:.1f} | {row['speedup']} |")
    print("lossless (same calls and answers):", "OK" if lossless else "FAILED")
    env = environment()
    report = {
        "created": datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "versions": {**env["versions"], "quickdraft": __version__, "kernels": kernels.build_name(),
                     "isa": kernels.isa()},
        "hardware": env["hardware"],
        "platform": platform.platform(),
        "model": model,
        "settings": {"rounds": args.rounds, "threads": args.threads, "context": args.context,
                     "greedy": True, "max_tokens": 256, "task": TASK, "system": SYSTEM},
        "lossless": lossless,
        "turns": table,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
