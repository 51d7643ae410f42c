"""First-turn time to first token of the default drafter against --draft none, side by side.

Both engines are loaded in one process (the same GGUF twice) and answer the same long first
message alternately, with the prefix cache off (every request cold). Prints and saves each TTFT
and the ratio of medians.

    QUICKDRAFT_ISA=avx2 .venv/bin/python benchmarks/first_turn.py --prompts benchmarks/prompts/followup.jsonl --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from quickdraft import LLM, SamplingParams
from quickdraft.bench.report import environment


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--prompts", type=Path, default=Path("benchmarks/prompts/followup.jsonl"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/first_turn.json"))
    args = ap.parse_args()
    llms = {d: LLM(args.model, draft=d, prefix_cache_mb=0) for d in ("none", "auto")}
    rows = []
    for line in args.prompts.read_text().splitlines():
        item = json.loads(line)
        messages = [{"role": "user", "content": item["turns"][0]}]
        ttft: dict[str, list[float]] = {"none": [], "auto": []}
        for _ in range(args.repeats):
            for name, llm in llms.items():
                step = next(iter(llm.stream_chat(messages, SamplingParams(max_tokens=1))))
                ttft[name].append(step.stats.ttft)
                print(f"{item['id']}: {name} {step.stats.prompt_tokens} tokens, TTFT {step.stats.ttft:.2f} s",
                      file=sys.stderr, flush=True)
        ratio = statistics.median(ttft["auto"]) / statistics.median(ttft["none"])
        rows.append({"id": item["id"], "ttft": ttft, "auto_over_none": ratio})
        print(f"{item['id']}: auto / none = {ratio:.3f}", flush=True)
    env = environment()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": " ".join(sys.argv), **env, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
