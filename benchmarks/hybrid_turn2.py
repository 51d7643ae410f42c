"""A hybrid model's second chat turn: quickdraft serve vs llama-server, time to the first token.

A Gated DeltaNet model cannot roll its recurrent state back, so a server that keeps only the state
at the end of the last request recomputes the whole conversation when the next turn's prompt
diverges from it anywhere (the answer it generated against the client's copy of it, a re-rendered
template): llama.cpp's issue #20225 reports ~8 minutes a turn at 15k tokens. quickdraft keeps the
recurrent state at every 64th token of a prompt (quickdraft.cache.RecurrentState checkpoints, shared
through the prefix cache), so turn 2 computes from the last checkpoint inside turn 1's prompt.

Both servers get the same token ids over HTTP (quickdraft: ``/v1/completions`` with a list of ids;
llama-server: ``/completion`` with ``cache_prompt``), one after the other, never at once:

    turn 1: T1 random ids, answer ``--answer`` tokens (greedy);
    turn 2: the T1 ids + ``--answer`` fixed ids (the client's copy of the answer) + ``--new`` ids,
            one token: its time is the time to the first token of turn 2.

The file is ``benchmarks/gguf_archs.py``'s random Qwen3.5-0.8B (``--layers``, the real vocabulary)
unless ``--file`` names one. JSON with the command, versions and figures goes to
benchmarks/results/hybrid_turn2/.

    .venv/bin/python benchmarks/hybrid_turn2.py --turn1 4096
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from gguf_archs import REAL_VOCAB, write_gguf  # noqa: E402

OUT = Path(__file__).parent / "results" / "hybrid_turn2"
LLAMA_BIN = Path.home() / ".cache/quickdraft/llamacpp-native/bin"


def post(url: str, body: dict[str, Any], timeout: float = 3600.0) -> tuple[float, dict[str, Any]]:
    """(seconds, JSON answer) of one POST."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        answer = json.loads(resp.read())
    return time.perf_counter() - t0, answer


def wait_up(url: str, proc: subprocess.Popen[bytes], seconds: float = 600.0) -> None:
    end = time.time() + seconds
    while time.time() < end:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}) before it was up: {url}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"no answer from {url}/health in {seconds:.0f} s")


class Server:
    """One engine behind HTTP: how to start it and ask it for ``n`` tokens after ``ids``."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str] | None = None) -> None:
        self.name, self.cmd, self.url, self.env = name, cmd, f"http://127.0.0.1:{port}", env

    def __enter__(self) -> Server:
        self.log = open(f"/tmp/hybrid_turn2-{self.name}.log", "wb")  # noqa: SIM115 (closed in __exit__)
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(self.env or {})}, start_new_session=True)
        wait_up(self.url, self.proc)
        return self

    def __exit__(self, *_exc: object) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=60)
        self.log.close()

    def complete(self, ids: list[int], n: int) -> float:
        if self.name == "llama.cpp":
            seconds, _ = post(self.url + "/completion", {"prompt": ids, "n_predict": n, "temperature": 0.0,
                                                         "cache_prompt": True, "ignore_eos": True})
        else:
            seconds, _ = post(self.url + "/v1/completions", {"model": "m", "prompt": ids, "max_tokens": n,
                                                             "temperature": 0.0, "ignore_eos": True})
        return seconds


def conversation(server: Server, turn1: list[int], answer: list[int], new: list[int]) -> dict[str, float]:
    server.complete(turn1[:32], 2)  # warm-up (a prompt turn 1 shares nothing useful with)
    t1 = server.complete(turn1, 1)  # turn 1's time to its first token ...
    server.complete(turn1, len(answer))  # ... then the answer, as a chat would go on
    t2 = server.complete(turn1 + answer + new, 1)
    return {"turn1_ttft_s": t1, "turn2_ttft_s": t2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", type=Path, default=None, help="a hybrid GGUF (default: the random Qwen3.5-0.8B)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--turn1", type=int, default=4096, help="prompt tokens of turn 1")
    ap.add_argument("--answer", type=int, default=64, help="tokens of the answer to turn 1")
    ap.add_argument("--new", type=int, default=32, help="tokens turn 2 adds after the answer")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", type=Path, default=LLAMA_BIN / "llama-server")
    args = ap.parse_args()
    path = args.file or Path(f"/tmp/quickdraft-random-qwen35-{args.layers}-{REAL_VOCAB['qwen35']}.gguf")
    if args.file is None and not path.is_file():
        write_gguf("qwen35", args.layers, path, vocab=REAL_VOCAB["qwen35"])
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 280, size=args.turn1 + args.answer + args.new).tolist()  # (the tiny tokenizer's ids)
    turn1, answer, new = ids[: args.turn1], ids[args.turn1 : args.turn1 + args.answer], ids[args.turn1 + args.answer :]
    context = str(args.turn1 + args.answer + args.new + 256)
    servers = [
        Server("quickdraft", [sys.executable, "-m", "quickdraft", "serve", "--model", str(path), "--served-model-name",
                              "m", "--port", "8195", "--threads", str(args.threads), "--max-context", context,
                              "--draft", "none"], 8195),
        Server("llama.cpp", [str(args.llama_server), "-m", str(path), "-t", str(args.threads), "-c", context,
                             "--port", "8196", "-np", "1"], 8196, {"LD_LIBRARY_PATH": str(args.llama_server.parent)}),
    ]
    results: dict[str, dict[str, float]] = {}
    for server in servers:
        if server.name == "llama.cpp" and not args.llama_server.is_file():
            print(f"no llama-server at {args.llama_server}: build it with ../shared/tools/build_llamacpp.sh")
            continue
        with server:
            results[server.name] = conversation(server, turn1, answer, new)
        print(f"{server.name}: turn 1 TTFT {results[server.name]['turn1_ttft_s']:.2f} s, "
              f"turn 2 TTFT {results[server.name]['turn2_ttft_s']:.2f} s")
    if len(results) == 2:
        q, ll = results["quickdraft"]["turn2_ttft_s"], results["llama.cpp"]["turn2_ttft_s"]
        print(f"turn 2 time to first token, quickdraft / llama-server: {q / ll:.3f} (goal <= 0.2)")
    from quickdraft.bench.report import environment

    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"qwen35-{args.layers}l-turn1-{args.turn1}.json"
    out.write_text(json.dumps({"command": " ".join(sys.argv), "environment": environment(), "file": str(path),
                               "turn1": args.turn1, "answer": args.answer, "new": args.new,
                               "threads": args.threads, "results": results}, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
