"""quickdraft next to llama.cpp in ONE run: same GGUF, same prompt tokens, same threads.

    .venv/bin/python benchmarks/vs_llamacpp.py                                  # 1.5B, 20 prompts
    .venv/bin/python benchmarks/vs_llamacpp.py --models qwen-1.5b qwen-0.5b --prompts 20
    .venv/bin/python benchmarks/vs_llamacpp.py --quick                          # does it work?

Two measurements per model, each engine taking turns with the other so that drift of a shared
machine (thermal, other processes) hits both alike:

(a) Forward passes ("pp1..pp32" at batch 1): T new tokens (T = --rows) decoded after a context of
    --context tokens, logits for every row as in a speculative verification pass, KV cache rolled
    back after each pass. Each engine's turn is a burst of back-to-back passes (3 untimed, then
    the median of 3 timed: passes straight after a pause run slower on these VMs); median (and
    minimum) of --repeats turns per engine and T, the engines alternating turn by turn (A B, then
    B A, ...). The cost of T rows relative to 1 row is
    what speculative decoding lives on, so it is reported too, with each pass's floor on this
    machine: its bytes over the read bandwidth or its int8 products over the GEMM's integer dot
    rate, whichever is more (both probed before and after the passes; quickdraft.roofline). A
    1-row pass sits on the memory floor, an 8-row one on the compute floor: their ratio bounds
    T(8) / T(1) on the machine for any kernel built on the same dot instructions.
(b) Greedy decoding: up to --tokens new tokens for each of the first --prompts HumanEval prompts
    (--dataset: another prompt set, e.g. code-qa: a 1k-6k-token module and a question, for
    decoding after a long context),
    rendered with the model's chat template exactly as ``quickdraft bench`` does; the same prompt
    token ids go to both engines, and generation stops on quickdraft's end-of-turn ids in both.
    tokens/s = output tokens after the first / time after the first token (RequestStats'
    definition; llama.cpp is timed per streamed token the same way). quickdraft runs plain
    (``none``) and with its drafters (``auto``, ``ngram``, ...); every drafter's output must equal
    quickdraft's own plain output token for token (lossless). llama.cpp's output may differ (other
    numerics); the fraction of identical outputs is reported anyway. --eagle3 DIR adds quickdraft
    with that EAGLE-3 head (method eagle3=DIR of ``quickdraft bench``).

llama.cpp is llama-cpp-python 0.3.36 in its OWN virtual environment: it is a benchmark opponent,
never a quickdraft dependency. Create it once (a source build, 15-25 minutes on 2 cores):

    python3 -m venv ~/.cache/quickdraft/llamacpp-venv
    CMAKE_ARGS="-DGGML_NATIVE=ON" ~/.cache/quickdraft/llamacpp-venv/bin/pip install llama-cpp-python==0.3.36

It runs in a subprocess (benchmarks/_llamacpp_worker.py)
that answers JSON lines on stdin/stdout; the parent waits for each answer before doing anything,
so only one engine computes at a time, and pauses --settle seconds at every switch so the other
engine's OpenMP threads have stopped spinning. The worker uses llama.cpp's C API (llama_decode,
argmax of the logits): no Python-side sampler or logits copies are timed.

Results: a table with quickdraft / llama.cpp ratios on the terminal, and
benchmarks/results/vs_llamacpp/<name>.json (command, versions, CPU, settings, every raw number)
plus <name>.md next to it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from quickdraft.errors import QuickdraftError
from quickdraft.options import EngineOptions

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python release this benchmark was written against
WORKER = Path(__file__).with_name("_llamacpp_worker.py")
LLAMACPP = "llama.cpp"  # the contender name of llama.cpp in records and tables
DEFAULT_METHODS = "none,auto,ngram"
BURST_WARM, BURST_TIMED = 3, 3  # passes per turn of the pass timing: untimed, then timed (median)
PASS_TEXT = '''def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge overlapping closed intervals and return them sorted by start."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


class LRUCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.data: dict[str, int] = {}

    def get(self, key: str) -> int | None:
        if key not in self.data:
            return None
        value = self.data.pop(key)
        self.data[key] = value
        return value
'''


@dataclass(frozen=True)
class Profile:
    """Defaults of a full measurement and of --quick (a tiny run that checks the script works)."""

    models: tuple[str, ...]
    prompts: int
    tokens: int
    rows: tuple[int, ...]
    repeats: int


FULL = Profile(("qwen2.5-coder-1.5b-instruct",), 20, 256, (1, 2, 4, 8, 16, 32), 7)
QUICK = Profile(("smollm2-135m-instruct",), 2, 16, (1, 4), 2)


# --------------------------------------------------------------------------------------------
# The llama.cpp environment and the JSON-lines protocol


def default_venv() -> Path:
    from quickdraft import zoo

    return zoo.cache_dir() / "llamacpp-venv"


def venv_instructions(venv: Path) -> str:
    """How to create the llama.cpp benchmark environment (a separate venv, built from source), or
    to install llama.cpp into it where the venv exists but cannot import it."""
    pip = (
        f'CMAKE_ARGS="-DGGML_NATIVE=ON" {venv}/bin/pip install llama-cpp-python=={LLAMA_CPP_PYTHON}'
    )
    if (venv / "bin" / "python").exists():
        steps = (
            f"Install it into {venv} with (a source build: 15-25 minutes on 2 cores):\n    {pip}\n"
        )
    else:
        steps = (
            "Create it with (a source build: 15-25 minutes on 2 cores):\n"
            f"    python3 -m venv {venv}\n    {pip}\n"
        )
    return (
        "llama.cpp for this benchmark lives in its own virtual environment, never in quickdraft's. "
        f"{steps}or point --llamacpp-venv at another environment that has it."
    )


def llamacpp_python(venv: Path) -> Path:
    """The venv's interpreter, or a QuickdraftError that says how to create the venv."""
    python = venv / "bin" / "python"
    if not python.exists():
        raise QuickdraftError(f"no llama.cpp environment at {venv}.\n{venv_instructions(venv)}")
    return python


def encode_request(cmd: str, **fields: Any) -> str:
    """One request line for the worker."""
    return json.dumps({"cmd": cmd, **fields}) + "\n"


def parse_reply(line: str, what: str) -> dict[str, Any]:
    """The worker's answer to ``what`` as a dict; a QuickdraftError for an error or a bad line."""
    if not line:
        raise QuickdraftError(f"the llama.cpp worker exited during {what}")
    try:
        reply = json.loads(line)
    except json.JSONDecodeError:
        raise QuickdraftError(
            f"the llama.cpp worker answered {what} with a line that is not JSON: {line[:200]!r}"
        ) from None
    if not isinstance(reply, dict) or "ok" not in reply:
        raise QuickdraftError(f"the llama.cpp worker answered {what} with {line[:200]!r}")
    if not reply["ok"]:
        raise QuickdraftError(
            f"llama.cpp failed in {what}: {reply.get('error', 'no reason given')}"
        )
    return reply


class LlamaCppWorker:
    """The worker subprocess; ``request`` blocks until it has answered (one engine at a time)."""

    def __init__(self, venv: Path) -> None:
        python = llamacpp_python(venv)
        self.log: IO[str] = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in close())
            "w+", prefix="vs_llamacpp-worker-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(
            [str(python), str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
        )
        try:
            self.hello = self._read("start-up")
        except QuickdraftError as exc:
            self.close()
            raise QuickdraftError(f"{exc}\n{venv_instructions(venv)}") from None

    def _read(self, what: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        try:
            return parse_reply(line, what)
        except QuickdraftError as exc:
            raise QuickdraftError(f"{exc}{self._log_tail()}") from None

    def _log_tail(self, lines: int = 15) -> str:
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace").strip().splitlines()[-lines:]
        return f"\n(worker log {self.log.name}:)\n" + "\n".join(text) if text else ""

    def request(self, cmd: str, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(encode_request(cmd, **fields))
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise QuickdraftError(f"the llama.cpp worker is gone{self._log_tail()}") from None
        return self._read(cmd)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request("quit")
                self.proc.wait(timeout=30)
            except (QuickdraftError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)

    def __enter__(self) -> LlamaCppWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# Pure arithmetic: medians, ratios, tables


def median(xs: Sequence[float]) -> float | None:
    from quickdraft.bench.metrics import percentile

    return percentile(xs, 50) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is not positive."""
    return a / b if a is not None and b is not None and b > 0 else None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def pass_table(
    seconds: dict[str, dict[int, list[float]]], floors: dict[int, float] | None = None
) -> list[dict[str, Any]]:
    """One row per row count: median/min ms of each engine, quickdraft/llama.cpp time ratio, and
    each engine's cost of T rows relative to its own 1-row pass (the smallest T measured); with
    ``floors`` (seconds per row count: the roofline's least time on this machine), the floor and
    the fraction of it quickdraft's median reaches."""
    lc, qd = seconds[LLAMACPP], seconds["quickdraft"]
    rows = sorted(lc)
    base_lc, base_qd = median(lc[rows[0]]), median(qd[rows[0]])
    out = []
    for r in rows:
        m_lc, m_qd = median(lc[r]), median(qd[r])
        out.append(
            {
                "rows": r,
                "llama_cpp_ms": _ms(m_lc),
                "quickdraft_ms": _ms(m_qd),
                "llama_cpp_min_ms": _ms(min(lc[r])),
                "quickdraft_min_ms": _ms(min(qd[r])),
                "time_ratio": _round(ratio(m_qd, m_lc), 3),  # < 1: quickdraft is faster
                "llama_cpp_rel_first": _round(ratio(m_lc, base_lc), 2),
                "quickdraft_rel_first": _round(ratio(m_qd, base_qd), 2),
                "floor_ms": _ms(floors[r]) if floors and r in floors else None,
                "quickdraft_of_floor": _round(ratio(floors[r], m_qd), 2) if floors and r in floors else None,
            }
        )
    return out


@dataclass
class DecodeRecord:
    """One answer of one contender (llama.cpp or a quickdraft method) to one prompt."""

    contender: str
    prompt_index: int
    prompt_id: str
    prompt_tokens: int
    output_tokens: int
    tokens_per_second: float | None
    ttft: float | None
    decode_seconds: float | None
    finish_reason: str | None
    token_ids: list[int]
    tau: float | None = None  # tokens per target pass (speculative quickdraft methods)
    acceptance_rate: float | None = None
    identical_to_plain: bool | None = None  # token-identical to quickdraft 'none' on this prompt
    common_prefix_with_plain: int | None = None


def mark_identical(records: Sequence[DecodeRecord], plain: str = "none") -> None:
    """Compare every record with quickdraft's plain output of the same prompt (in place)."""
    base = {r.prompt_index: r.token_ids for r in records if r.contender == plain}
    for r in records:
        ref = base.get(r.prompt_index)
        if ref is not None:
            r.identical_to_plain = r.token_ids == ref
            r.common_prefix_with_plain = common_prefix(r.token_ids, ref)


def decode_summary(
    records: Sequence[DecodeRecord], contenders: Sequence[str]
) -> list[dict[str, Any]]:
    """Per contender: tokens/s median and p10-p90, ratio to llama.cpp (of the medians, and the
    median of per-prompt ratios), TTFT, tau, and how many outputs equal quickdraft's plain one."""
    from quickdraft.bench.metrics import summarize

    lc_tps = {r.prompt_index: r.tokens_per_second for r in records if r.contender == LLAMACPP}
    lc_median = summarize(lc_tps.values()).median
    out = []
    for name in contenders:
        rs = [r for r in records if r.contender == name]
        tps = summarize(r.tokens_per_second for r in rs)
        paired = [ratio(r.tokens_per_second, lc_tps.get(r.prompt_index)) for r in rs]
        same = [r.identical_to_plain for r in rs if r.identical_to_plain is not None]
        taus = [r.tau for r in rs if r.tau is not None]
        out.append(
            {
                "contender": name,
                "n": len(rs),
                "tokens_per_second_median": _round(tps.median, 2),
                "tokens_per_second_p10": _round(tps.p10, 2),
                "tokens_per_second_p90": _round(tps.p90, 2),
                "ratio_to_llama_cpp": _round(ratio(tps.median, lc_median), 3),
                "paired_ratio_median": _round(summarize(paired).median, 3),
                "ttft_median_s": _round(summarize(r.ttft for r in rs).median, 3),
                "output_tokens_mean": _round(summarize(r.output_tokens for r in rs).mean, 1),
                "tau_mean": _round(sum(taus) / len(taus), 2) if taus else None,
                "identical_to_plain": f"{sum(same)}/{len(same)}" if same else None,
                "identical_fraction": _round(sum(same) / len(same), 3) if same else None,
            }
        )
    return out


def lossless_failures(records: Sequence[DecodeRecord]) -> list[str]:
    """quickdraft drafters whose output differed from quickdraft's plain decode (must be none)."""
    return [
        f"{r.contender} on {r.prompt_id}"
        for r in records
        if r.contender not in (LLAMACPP, "none") and r.identical_to_plain is False
    ]


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1e3, 2)


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown_tables(result: dict[str, Any]) -> list[str]:
    """The tables of one model as Markdown lines (one pass table per context length)."""
    lines: list[str] = []
    for sweep in result.get("passes_by_context") or [result["passes"]]:
        table = sweep["table"]
        first = table[0]["rows"]
        lines += [
            f"Forward pass of T new rows after {sweep['context_tokens']} context tokens, logits for all rows "
            "(median ms; a time ratio < 1 means quickdraft is faster):",
            "",
            f"| T | llama.cpp ms | quickdraft ms | quickdraft / llama.cpp | llama.cpp T / T={first} "
            f"| quickdraft T / T={first} | floor ms | quickdraft at floor |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for p in table:
            lines.append(
                f"| {p['rows']} | {_fmt(p['llama_cpp_ms'], 1)} | {_fmt(p['quickdraft_ms'], 1)} | "
                f"{_fmt(p['time_ratio'])} | {_fmt(p['llama_cpp_rel_first'])} | "
                f"{_fmt(p['quickdraft_rel_first'])} | {_fmt(p.get('floor_ms'), 1)} | "
                f"{_fmt(p.get('quickdraft_of_floor'))} |"
            )
        if (roof := sweep.get("roofline")) is not None:
            lines += [
                "",
                f"floor = max(bytes read / read bandwidth, rows x int8 products / int8 dot rate), probed before "
                f"and after the passes: {_fmt(roof['read_bandwidth_gbs'], 1)} GB/s, "
                f"{_fmt(roof['int8_dot_rate_g'], 0)} G products/s ({roof['isa']}); "
                f"{roof['int8_products_per_row'] / 1e9:.2f} G products per row",
            ]
        lines.append("")
    if result.get("prefill"):
        lines += [
            "Prefill of N prompt tokens into an empty cache (median; speedup > 1 means quickdraft "
            "is faster):",
            "",
            "| N | llama.cpp s | quickdraft s | llama.cpp tok/s | quickdraft tok/s | speedup |",
            "|---|---|---|---|---|---|",
        ]
        for p in result["prefill"]:
            lines.append(
                f"| {p['prompt_tokens']} | {_fmt(p['llama_cpp_s'], 3)} | {_fmt(p['quickdraft_s'], 3)} | "
                f"{_fmt(p['llama_cpp_tok_s'], 1)} | {_fmt(p['quickdraft_tok_s'], 1)} | "
                f"{_fmt(p['speedup'])} |"
            )
        lines.append("")
    if result["decode"].get("records") == []:  # --prompts 0: no decoding was measured
        return lines
    lines += [
        "",
        "Greedy decoding, tokens/s per prompt (a ratio > 1 means quickdraft is faster):",
        "",
        "| engine / method | tok/s median | p10-p90 | / llama.cpp (medians) | / llama.cpp (paired) "
        "| TTFT s | tau | same as quickdraft plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in result["decode"]["summary"]:
        name = s["contender"] if s["contender"] == LLAMACPP else f"quickdraft {s['contender']}"
        lines.append(
            f"| {name} | {_fmt(s['tokens_per_second_median'], 1)} | "
            f"{_fmt(s['tokens_per_second_p10'], 1)}-{_fmt(s['tokens_per_second_p90'], 1)} | "
            f"{_fmt(s['ratio_to_llama_cpp'])} | {_fmt(s['paired_ratio_median'])} | "
            f"{_fmt(s['ttft_median_s'], 3)} | {_fmt(s['tau_mean'])} | "
            f"{s['identical_to_plain'] or '-'} |"
        )
    return lines


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    hw = report["hardware"]
    lines = [
        "# quickdraft vs llama.cpp",
        "",
        f"`{report['command']}`",
        "",
        f"- created {report['created']}; CPU {hw['cpu']}, {s['threads']} threads for both engines",
        f"- quickdraft {report['versions']['quickdraft']} (torch {report['versions']['torch']}, "
        f"dtype {s['dtype']}, kernels {report['versions']['quickdraft_kernels']}); "
        f"llama-cpp-python {report['versions']['llama_cpp_python']} "
        f"(flash attention {s['flash_attn']}, n_batch {s['n_batch']})",
        f"- llama.cpp build: `{report['versions']['llama_cpp_system_info']}`",
        f"- passes: {s['rows']} rows after {s['context']} context tokens, {s['repeats']} repeats "
        "per engine, engines alternating",
        f"- decoding: {report['prompts']['num_prompts']} {report['prompts']['dataset']} prompts, "
        f"up to {s['tokens']} new tokens, greedy, contenders interleaved prompt by prompt",
        "",
    ]
    for result in report["results"]:
        lines += [f"## {result['model']['spec']}", ""]
        lines += markdown_tables(result)
        bad = result["decode"]["lossless_failures"]
        lines += [
            "",
            "Lossless: every quickdraft drafter's output equals quickdraft's plain decode."
            if not bad
            else f"**NOT lossless**: {', '.join(bad)}",
            "",
        ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Measurements


def pass_tokens(tokenizer: Any, n: int) -> list[int]:
    """``n`` token ids of ordinary Python code (the same ids go to both engines)."""
    ids: list[int] = tokenizer.encode(PASS_TEXT, add_special_tokens=False)
    return (ids * (n // len(ids) + 1))[:n]


def settle(seconds: float) -> None:
    """Between engine switches: collect garbage, then let spinning OpenMP threads go to sleep."""
    gc.collect()
    time.sleep(seconds)


def measure_passes(
    worker: LlamaCppWorker,
    model: Any,
    ids: list[int],
    context: int,
    rows: Sequence[int],
    repeats: int,
    pause: float,
) -> dict[str, dict[int, list[float]]]:
    """Seconds per pass of each engine and row count, alternating engines pass by pass."""
    import torch

    ctx, new = ids[:context], ids[context:context + max(rows)]
    cache = model.make_cache(context + max(rows))
    model.prefill(torch.tensor(ctx), cache)  # chunked, as the engine prefills
    new_t = torch.tensor(new)

    # Each turn is a burst of back-to-back passes of one size, as decode and verification run them:
    # BURST_WARM untimed, then BURST_TIMED timed, the turn's time their median. After a pause
    # (settle, the other engine's turn) this machine takes several passes to come up to speed: on a
    # Zen 4 VM, 1-row passes of the 1.5B took 34-35 ms for the first two after a pause and 28.5 ms
    # back to back (2026-12-06), so timing the second pass after the pause (the old protocol) made
    # quickdraft's 1-row pass look slower than its 2-row pass and than its own decode step.
    def qd_pass(r: int) -> float:
        times = []
        for _ in range(BURST_WARM + BURST_TIMED):
            t0 = time.perf_counter()
            model(new_t[:r], cache)  # logits for all r rows, like a verification pass
            times.append(time.perf_counter() - t0)
            cache.truncate(context)
        return float(statistics.median(times[BURST_WARM:]))

    def lc_pass(r: int) -> float:
        reply = worker.request("pass_times", context=ctx, tokens=new, rows=[r], repeats=BURST_WARM + BURST_TIMED)
        return float(statistics.median(float(t) for t in reply["seconds"][str(r)][BURST_WARM:]))

    engines: dict[str, Callable[[int], float]] = {LLAMACPP: lc_pass, "quickdraft": qd_pass}
    for f in engines.values():  # warm-up: first-call allocations, page cache, kernel builds
        settle(pause)
        for r in rows:
            f(r)
    out: dict[str, dict[int, list[float]]] = {name: {r: [] for r in rows} for name in engines}
    order = list(engines)
    for i in range(repeats):
        for j, r in enumerate(rows):
            for name in order if (i + j) % 2 == 0 else order[::-1]:
                settle(pause)
                out[name][r].append(engines[name](r))
    return out


def measure_prefill(
    worker: LlamaCppWorker,
    model: Any,
    ids: list[int],
    lengths: Sequence[int],
    repeats: int,
    pause: float,
) -> list[dict[str, Any]]:
    """Prompt processing: each engine prefills the first N ids into an empty KV cache (its own
    chunking: quickdraft's PREFILL_CHUNK passes, llama.cpp's n_batch), logits for the last row,
    engines alternating repeat by repeat. One row per N: median seconds and tokens/s of each."""
    import torch

    def qd_prefill(n: int) -> float:
        cache = model.make_cache(n + 1)
        t0 = time.perf_counter()
        model.prefill(torch.tensor(ids[:n]), cache)
        return time.perf_counter() - t0

    def lc_prefill(n: int) -> float:
        return float(worker.request("prefill_times", tokens=ids[:n], repeats=1)["seconds"][0])

    engines: dict[str, Callable[[int], float]] = {LLAMACPP: lc_prefill, "quickdraft": qd_prefill}
    for f in engines.values():  # warm-up
        settle(pause)
        f(min(lengths))
    table = []
    for n in lengths:
        got: dict[str, list[float]] = {name: [] for name in engines}
        order = list(engines)
        for i in range(repeats):
            for name in order if i % 2 == 0 else order[::-1]:
                settle(pause)
                got[name].append(engines[name](n))
        m_lc, m_qd = median(got[LLAMACPP]), median(got["quickdraft"])
        table.append(
            {
                "prompt_tokens": n,
                "llama_cpp_s": _round(m_lc, 3),
                "quickdraft_s": _round(m_qd, 3),
                "llama_cpp_tok_s": _round(n / m_lc if m_lc else None, 1),
                "quickdraft_tok_s": _round(n / m_qd if m_qd else None, 1),
                "speedup": _round(ratio(m_lc, m_qd), 3),  # > 1: quickdraft prefills faster
                "seconds": got,
            }
        )
    return table


def llamacpp_record(
    worker: LlamaCppWorker,
    index: int,
    item_id: str,
    ids: list[int],
    max_tokens: int,
    stops: list[int],
) -> DecodeRecord:
    from quickdraft.bench.metrics import request_metrics

    reply = worker.request("generate", prompt=ids, max_tokens=max_tokens, stop_ids=stops)
    tokens = [int(t) for t in reply["token_ids"]]
    m = request_metrics(0.0, [float(t) for t in reply["token_times"]], len(tokens))
    return DecodeRecord(
        LLAMACPP,
        index,
        item_id,
        len(ids),
        len(tokens),
        m.tokens_per_second,
        m.ttft,
        m.decode_seconds,
        reply["finish_reason"],
        tokens,
    )


def quickdraft_record(
    contender: Any, index: int, item_id: str, messages: Any, params: Any
) -> DecodeRecord:
    trace = contender.run(messages, params, None)
    s = trace.stats
    speculative = contender.drafter is not None and s.target_passes > 0
    return DecodeRecord(
        contender.name,
        index,
        item_id,
        trace.prompt_tokens,
        s.output_tokens,
        s.tokens_per_second or None,
        s.ttft,
        s.t_end - s.t_first,
        trace.finish_reason,
        list(trace.token_ids or []),
        tau=s.tau if speculative else None,
        acceptance_rate=s.acceptance_rate if speculative and s.drafted else None,
    )


def pass_probe() -> tuple[float, float] | None:
    """(read bandwidth GB/s, int8 dot rate products/s) of this machine now; None without kernels."""
    from quickdraft.roofline import int8_dot_rate, read_bandwidth

    bw, rate = read_bandwidth(), int8_dot_rate()
    return None if bw is None or rate is None else (bw, rate)


def pass_roofline(
    model: Any, context: int, rows: Sequence[int], probes: Sequence[tuple[float, float] | None]
) -> dict[str, Any] | None:
    """The passes' floors on this machine from the probes' means (None where a probe is missing or
    the model is not in q8 blocks on the CPU)."""
    from quickdraft.kernels import isa
    from quickdraft.roofline import int8_products, pass_floor

    taken = [p for p in probes if p is not None]
    products = int8_products(model)
    if len(taken) != len(probes) or not taken or products == 0:
        return None
    bw = statistics.fmean(p[0] for p in taken)
    rate = statistics.fmean(p[1] for p in taken)
    return {
        "read_bandwidth_gbs": bw,
        "int8_dot_rate_g": rate / 1e9,
        "probes": [list(p) for p in taken],
        "isa": isa(),
        "int8_products_per_row": products,
        "floor_s": {r: pass_floor(model, r, context, bw, rate) for r in rows},  # (JSON: the keys as text)
    }


def measure_decode(
    worker: LlamaCppWorker,
    contenders: Sequence[Any],
    tokenizer: Any,
    items: Sequence[Any],
    max_tokens: int,
    ignore_eos: bool,
    pause: float,
    say: Callable[[str], None],
) -> list[DecodeRecord]:
    """Every contender on every prompt, one prompt at a time, the order rotating per prompt."""
    from quickdraft.sampling import SamplingParams

    stops = [] if ignore_eos else sorted(tokenizer.eos_ids)
    names = [LLAMACPP, *(c.name for c in contenders)]
    by_name = {c.name: c for c in contenders}

    def run(name: str, index: int, item: Any, n: int) -> DecodeRecord:
        messages = item.messages([])
        if name == LLAMACPP:
            ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
            return llamacpp_record(worker, index, item.id, ids, n, stops)
        params = SamplingParams(max_tokens=n, temperature=0.0, seed=index, ignore_eos=ignore_eos)
        return quickdraft_record(by_name[name], index, item.id, messages, params)

    for name in names:  # warm-up, not recorded
        settle(pause)
        run(name, 0, items[0], min(8, max_tokens))
    records: list[DecodeRecord] = []
    for index, item in enumerate(items):
        shift = index % len(names)
        done = []
        for name in names[shift:] + names[:shift]:
            settle(pause)
            records.append(run(name, index, item, max_tokens))
            done.append(records[-1])
        speeds = ", ".join(f"{r.contender} {_fmt(r.tokens_per_second, 1)}" for r in done)
        say(f"  prompt {index + 1}/{len(items)} {item.id}: tok/s {speeds}")
    mark_identical(records)
    return records


# --------------------------------------------------------------------------------------------
# Main


def measure_model(
    spec: str,
    worker: LlamaCppWorker,
    items: Sequence[Any],
    args: argparse.Namespace,
    say: Callable[[str], None],
) -> dict[str, Any]:
    from quickdraft.bench import runner
    from quickdraft.kernels.tuning import tune as tune_kernels
    from quickdraft.loading.load import load_model, resolve
    from quickdraft.quant import kernels_active

    path = resolve(spec)
    say(f"[{spec}] llama.cpp: loading {path} ...")
    lc_info = worker.request(
        "load",
        model=str(path),
        n_ctx=args.max_context,
        n_threads=args.threads,
        n_batch=args.n_batch,
        flash_attn=args.flash_attn,
    )["info"]
    say(f"[{spec}] quickdraft: loading {path} (dtype {args.dtype}) ...")
    target = load_model(str(path), dtype=args.dtype, max_context=args.max_context)
    choice = tune_kernels(target.model, target.path, say)  # the kernels a user's start picks
    if choice is not None:
        say(f"[{spec}] {choice.line()}")
    contenders = runner.build_in_process(
        args.method_list, spec, target, runner.MethodOptions(EngineOptions(dtype=args.dtype, prefix_cache_mb=0)), say
    )
    sweep = []
    ids = pass_tokens(target.tokenizer, max(args.context) + max(args.row_list))
    for context in args.context:  # --context N [N ...]: the pass costs at each context length
        say(f"[{spec}] forward passes: rows {args.row_list} after {context} tokens, {args.repeats} repeats")
        probes = [pass_probe()]
        seconds = measure_passes(
            worker, target.model, ids, context, args.row_list, args.repeats, args.settle
        )
        probes.append(pass_probe())
        roof = pass_roofline(target.model, context, args.row_list, probes)
        sweep.append({"context_tokens": context, "table": pass_table(seconds, roof["floor_s"] if roof else None),
                      "roofline": roof,
                      "seconds": {e: {str(r): v for r, v in d.items()} for e, d in seconds.items()}})
    prefill = []
    if args.prefill:
        say(f"[{spec}] prefill: {args.prefill} prompt tokens, {args.repeats} repeats")
        prefill = measure_prefill(
            worker, target.model, pass_tokens(target.tokenizer, max(args.prefill)),
            args.prefill, args.repeats, args.settle,
        )
    records: list[DecodeRecord] = []
    if items:  # --prompts 0: passes and prefill only
        say(f"[{spec}] greedy decoding: {len(items)} prompts, up to {args.tokens} tokens")
        records = measure_decode(
            worker, contenders, target.tokenizer, items, args.tokens, args.ignore_eos, args.settle,
            say,
        )
    names = [LLAMACPP, *(c.name for c in contenders)]
    result = {
        "model": {
            "spec": spec,
            "path": str(path),
            "gguf_bytes": path.stat().st_size if path.is_file() else None,
            "quickdraft_load_seconds": round(target.load_seconds, 2),
            "quickdraft_kernels_active": kernels_active(),
            "llama_cpp": lc_info,
            "contenders": [c.describe() for c in contenders],
        },
        "passes": {**sweep[0], "token_ids": ids[: args.context[0] + max(args.row_list)]},
        "passes_by_context": sweep,
        "prefill": prefill,
        "decode": {
            "summary": decode_summary(records, names),
            "lossless_failures": lossless_failures(records),
            "records": [asdict(r) for r in records],
        },
    }
    del contenders, target
    gc.collect()
    return result


def parse_rows(text: str) -> list[int]:
    try:
        rows = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise QuickdraftError(f"--rows takes comma-separated numbers, got {text!r}") from None
    if not rows or min(rows) < 1 or max(rows) > 512:
        raise QuickdraftError(f"--rows must list numbers between 1 and 512, got {text!r}")
    return sorted(set(rows))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--models",
        nargs="+",
        default=None,
        help=f"zoo names or .gguf files (default: {' '.join(FULL.models)})",
    )
    ap.add_argument(
        "--prompts",
        type=int,
        default=None,
        help=f"first N HumanEval prompts (default: {FULL.prompts})",
    )
    ap.add_argument(
        "--dataset",
        default="humaneval",
        help="prompt set of the decoding runs, any name `quickdraft bench` takes (default: humaneval; "
        "code-qa: long inputs)",
    )
    ap.add_argument(
        "--tokens",
        type=int,
        default=None,
        help=f"new tokens per answer at most (default: {FULL.tokens})",
    )
    ap.add_argument(
        "--rows", default=None, help=f"pass sizes (default: {','.join(map(str, FULL.rows))})"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"timed passes per engine and row count (default: {FULL.repeats})",
    )
    ap.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help=f"quickdraft methods; 'none' is always run (default: {DEFAULT_METHODS})",
    )
    ap.add_argument(
        "--eagle3",
        metavar="DIR",
        default=None,
        help="also run quickdraft with this EAGLE-3 head (method eagle3=DIR; one model only)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"tiny run to check the script works ({QUICK.models[0]}, "
        f"{QUICK.prompts} prompts, {QUICK.tokens} tokens, rows {QUICK.rows})",
    )
    ap.add_argument(
        "--context", type=int, nargs="+", default=[128],
        help="context tokens before each pass; several values time the passes at each (e.g. 128 1024 4096)"
    )
    ap.add_argument(
        "--prefill", type=int, nargs="*", default=[],
        help="also time the prefill of N prompt tokens into an empty cache (e.g. 512 4096)",
    )
    ap.add_argument(
        "--threads", type=int, default=2, help="compute threads of both engines (default: 2)"
    )
    ap.add_argument(
        "--dtype", default="auto", help="quickdraft dtype (default: auto = quantized kernels)"
    )
    ap.add_argument("--max-context", type=int, default=4096, help="KV cache length of both engines")
    ap.add_argument(
        "--n-batch", type=int, default=512, help="llama.cpp n_batch = n_ubatch (default: 512)"
    )
    ap.add_argument(
        "--flash-attn",
        choices=("auto", "on", "off"),
        default="auto",
        help="llama.cpp flash attention (default: auto, llama.cpp's own default)",
    )
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --tokens tokens")
    ap.add_argument(
        "--settle",
        type=float,
        default=0.1,
        help="seconds of rest at every engine switch (default: 0.1)",
    )
    ap.add_argument(
        "--llamacpp-venv",
        type=Path,
        default=None,
        help="virtual environment holding llama-cpp-python (default: ~/.cache/quickdraft/llamacpp-venv)",
    )
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/vs_llamacpp"))
    ap.add_argument(
        "--name", default=None, help="result file name without extension (default: time)"
    )
    return ap


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill unset options from the full or the --quick profile and validate them."""
    from quickdraft.bench.runner import parse_methods

    prof = QUICK if args.quick else FULL
    args.models = args.models or list(prof.models)
    args.prompts = args.prompts if args.prompts is not None else prof.prompts
    args.tokens = args.tokens if args.tokens is not None else prof.tokens
    args.repeats = args.repeats if args.repeats is not None else prof.repeats
    args.row_list = parse_rows(args.rows) if args.rows is not None else list(prof.rows)
    methods = parse_methods(args.methods)
    if "none" not in methods:
        methods.insert(0, "none")  # the reference of the lossless check
    if args.eagle3 is not None:
        if len(args.models) != 1:
            raise QuickdraftError("--eagle3 belongs to one target: give exactly one --models")
        if not Path(args.eagle3).expanduser().exists():
            raise QuickdraftError(f"no such EAGLE-3 head: {args.eagle3}")
        head = parse_methods(f"eagle3={args.eagle3}")[0]
        methods += [head] if head not in methods else []
    args.method_list = methods
    for key, low in (("prompts", 0), ("tokens", 2), ("repeats", 1), ("threads", 1)):
        if getattr(args, key) < low:
            raise QuickdraftError(f"--{key} must be at least {low}, got {getattr(args, key)}")
    if min(args.context) < 1:
        raise QuickdraftError(f"--context must be at least 1, got {min(args.context)}")
    if args.prefill and (min(args.prefill) < 1 or max(args.prefill) + 1 > args.max_context):
        raise QuickdraftError("every --prefill length must be at least 1 and fit --max-context")
    if max(args.row_list) > args.n_batch:
        raise QuickdraftError(f"--n-batch ({args.n_batch}) must be at least the largest --rows")
    if max(args.context) + max(args.row_list) > args.max_context:
        raise QuickdraftError("--context plus the largest --rows must fit --max-context")
    args.llamacpp_venv = args.llamacpp_venv or default_venv()
    args.name = args.name or ("quick-" if args.quick else "") + datetime.now().strftime(
        "%Y%m%d-%H%M%S"
    )
    return args


def command_line() -> str:
    """How this run was started, the interpreter relative to the working directory if inside it."""
    python = Path(sys.executable)
    try:
        python = python.relative_to(Path.cwd())
    except ValueError:
        pass
    return shlex.join([str(python), *sys.argv])


def print_table(result: dict[str, Any]) -> None:
    print(f"\n== {result['model']['spec']}")
    for line in markdown_tables(result):
        print(line)
    bad = result["decode"]["lossless_failures"]
    print("lossless: OK" if not bad else f"lossless: FAILED on {', '.join(bad)}")


def run(argv: Sequence[str] | None = None) -> int:
    import torch

    from quickdraft import __version__, kernels
    from quickdraft.api import configure_threads
    from quickdraft.bench.datasets import load_dataset
    from quickdraft.bench.report import environment

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    args = resolve_args(build_parser().parse_args(argv))
    configure_threads(args.threads)
    load_start = os.getloadavg()
    if load_start[0] > args.threads + 0.5:
        say(
            f"warning: load average {load_start[0]:.1f} on {os.cpu_count()} CPUs: other processes "
            "are computing, so both engines' numbers will be noisy and low"
        )
    dataset = load_dataset(args.dataset, max(args.prompts, 1))
    items = dataset.items[: args.prompts]
    t0 = time.time()
    results = []
    with LlamaCppWorker(args.llamacpp_venv) as worker:
        say(f"llama.cpp worker: llama-cpp-python {worker.hello.get('llama_cpp_python')}")
        for spec in args.models:
            results.append(measure_model(spec, worker, items, args, say))
            print_table(results[-1])
    env = environment()
    lc_info = results[0]["model"]["llama_cpp"]
    report = {
        "created": datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command_line(),
        "versions": {
            **env["versions"],
            "quickdraft": __version__,
            "torch": torch.__version__,
            "quickdraft_kernels": kernels.build_name(),
            "quickdraft_q8_isa": kernels.isa(),
            "llama_cpp_python": lc_info["llama_cpp_python"],
            "llama_cpp_system_info": lc_info["system_info"],
        },
        "hardware": env["hardware"],
        "settings": {
            "threads": args.threads,
            "dtype": args.dtype,
            "tokens": args.tokens,
            "rows": args.row_list,
            "repeats": args.repeats,
            "context": args.context,
            "prefill": args.prefill,
            "dataset": args.dataset,
            "methods": args.method_list,
            "ignore_eos": args.ignore_eos,
            "max_context": args.max_context,
            "n_batch": args.n_batch,
            "flash_attn": args.flash_attn,
            "settle_s": args.settle,
            "greedy": True,
            "quick": args.quick,
        },
        "prompts": {
            "dataset": dataset.name,
            "source": dataset.source,
            "num_prompts": len(items),
            "ids": [it.id for it in items],
        },
        "wall_seconds": round(time.time() - t0, 1),
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "platform": platform.platform(),
        "results": results,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / f"{args.name}.json"
    md_path = args.out_dir / f"{args.name}.md"
    json_path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    md_path.write_text(markdown(report) + "\n", encoding="utf-8")
    say(f"wrote {json_path} and {md_path}")
    return 1 if any(r["decode"]["lossless_failures"] for r in results) else 0


def main() -> int:
    try:
        return run()
    except QuickdraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
