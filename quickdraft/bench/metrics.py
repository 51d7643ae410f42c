"""Benchmark arithmetic: pure functions of streamed-token timestamps and per-request records.

Definitions (the same for an in-process run and an OpenAI-compatible endpoint):

- TTFT: time from sending the request to the first chunk that carries output.
- end-to-end latency: time from sending the request to the last chunk that carries output.
- output speed (tokens/s per user), as Artificial Analysis defines it: the output tokens after the
  first one, divided by the time after the first token arrived: (N - 1) / (t_last - t_first).
- tau (acceptance length): tokens emitted per target verify pass, bonus token included.
- acceptance by position i: of the steps that drafted at least i + 1 tokens, the fraction whose
  draft token i was accepted.

Worked example: sent at t=10.0, chunks at 10.5 (1 token), 10.7 (3 tokens), 11.5 (2 tokens):
N = 6, TTFT = 0.5 s, end-to-end = 1.5 s, output speed = (6 - 1) / (11.5 - 10.5) = 5 tokens/s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class RequestMetrics:
    output_tokens: int
    ttft: float | None  # seconds; None when nothing came back
    e2e: float | None  # seconds to the last output chunk
    decode_seconds: float | None  # t_last - t_first
    tokens_per_second: float | None  # (N - 1) / decode_seconds; None when it cannot be measured


def request_metrics(
    t_start: float, chunk_times: Sequence[float], output_tokens: int
) -> RequestMetrics:
    """Metrics of one request from when it was sent and when each output-carrying chunk arrived."""
    if not chunk_times:
        return RequestMetrics(output_tokens, None, None, None, None)
    t_first, t_last = chunk_times[0], chunk_times[-1]
    decode = t_last - t_first
    tps = (output_tokens - 1) / decode if output_tokens > 1 and decode > 0 else None
    return RequestMetrics(output_tokens, t_first - t_start, t_last - t_start, decode, tps)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Summary:
    n: int
    median: float | None
    p10: float | None
    p90: float | None
    mean: float | None


def summarize(values: Iterable[float | None]) -> Summary:
    """median, p10, p90 and mean of the values that are not None."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return Summary(0, None, None, None, None)
    return Summary(
        len(xs), percentile(xs, 50), percentile(xs, 10), percentile(xs, 90), sum(xs) / len(xs)
    )


def speedup(value: float | None, baseline: float | None) -> float | None:
    """value / baseline (e.g. tokens/s of a method over tokens/s of plain decoding on the same prompt)."""
    if value is None or baseline is None or baseline <= 0:
        return None
    return value / baseline


def tau(accepted: int, target_passes: int) -> float | None:
    """Tokens per target pass: each pass emits its accepted drafts plus one bonus/recovered token."""
    return (accepted + target_passes) / target_passes if target_passes else None


def acceptance_by_position(
    drafted: Iterable[Sequence[int]], accepted: Iterable[Sequence[int]]
) -> list[float]:
    """Pool per-position counts over requests; the rate at each draft position (0-based)."""
    d_tot: list[int] = []
    a_tot: list[int] = []
    for d_row, a_row in zip(drafted, accepted, strict=True):
        for i, (d, a) in enumerate(zip(d_row, a_row, strict=True)):
            if i == len(d_tot):
                d_tot.append(0)
                a_tot.append(0)
            d_tot[i] += d
            a_tot[i] += a
    return [a / d if d else 0.0 for a, d in zip(a_tot, d_tot, strict=True)]


def _pooled(rows: Iterable[Sequence[int]]) -> list[int]:
    out: list[int] = []
    for row in rows:
        out += [0] * (len(row) - len(out))
        for i, x in enumerate(row):
            out[i] += x
    return out


@dataclass
class Record:
    """One measured request: one method on one turn of one prompt."""

    method: str
    item_index: int
    item_id: str
    turn: int
    seed: int | None
    prompt_tokens: int
    output_tokens: int
    ttft: float | None
    e2e: float | None
    decode_seconds: float | None
    tokens_per_second: float | None
    finish_reason: str | None
    tau: float | None = None  # None where unknown (an endpoint)
    target_passes: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    peak_rss_mb: float | None = None  # peak RSS of this process so far (None for an endpoint)
    cached_tokens: int | None = None  # prompt tokens reused from a prefix cache (None: not reported)
    speedup: float | None = None  # tokens/s over the baseline method on the same prompt and turn
    same_as_baseline: bool | None = None  # greedy runs: identical output to the baseline method
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. how often auto picked each drafter
    text: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fill_speedups(records: list[Record], baseline: str) -> None:
    """Set each record's speedup and same_as_baseline against the baseline on the same prompt/turn."""
    base = {(r.item_index, r.turn): r for r in records if r.method == baseline}
    for r in records:
        b = base.get((r.item_index, r.turn))
        if b is None or r.method == baseline:
            continue
        r.speedup = speedup(r.tokens_per_second, b.tokens_per_second)
        r.same_as_baseline = r.text == b.text


def by_turn(records: Sequence[Record]) -> list[dict[str, Any]]:
    """TTFT, output speed, tau and cached prompt tokens per turn index (multi-turn datasets)."""
    turns = sorted({r.turn for r in records})
    out = []
    for t in turns:
        rs = [r for r in records if r.turn == t]
        out.append({
            "turn": t,
            "requests": len(rs),
            "prompt_tokens": asdict(summarize(r.prompt_tokens for r in rs)),
            "cached_tokens": asdict(summarize(r.cached_tokens for r in rs)),
            "ttft": asdict(summarize(r.ttft for r in rs)),
            "tokens_per_second": asdict(summarize(r.tokens_per_second for r in rs)),
            "tau": asdict(summarize(r.tau for r in rs)),
        })
    return out


def summarize_method(records: Sequence[Record]) -> dict[str, Any]:
    """The summary of one method's records: distributions, pooled counts, acceptance by position."""
    has_spec = [r for r in records if r.target_passes is not None]
    drafted = sum(r.drafted or 0 for r in has_spec)
    accepted = sum(r.accepted or 0 for r in has_spec)
    passes = sum(r.target_passes or 0 for r in has_spec)
    rss = [r.peak_rss_mb for r in records if r.peak_rss_mb is not None]
    same = [r.same_as_baseline for r in records if r.same_as_baseline is not None]
    return {
        "requests": len(records),
        "output_tokens": sum(r.output_tokens for r in records),
        "tokens_per_second": asdict(summarize(r.tokens_per_second for r in records)),
        "ttft": asdict(summarize(r.ttft for r in records)),
        "e2e": asdict(summarize(r.e2e for r in records)),
        "speedup": asdict(summarize(r.speedup for r in records)),
        "tau": asdict(summarize(r.tau for r in records)),
        "tau_pooled": tau(accepted, passes) if has_spec else None,
        "drafted": drafted if has_spec else None,
        "accepted": accepted if has_spec else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "acceptance_by_position": acceptance_by_position(
            (r.drafted_per_position for r in has_spec), (r.accepted_per_position for r in has_spec)
        ),
        "drafted_by_position": _pooled(r.drafted_per_position for r in has_spec),
        "peak_rss_mb": max(rss) if rss else None,
        "by_turn": by_turn(records),
        "same_as_baseline": f"{sum(same)}/{len(same)}" if same else None,
        "decisions": decisions(records),
    }


def decisions(records: Sequence[Record]) -> dict[str, Any] | None:
    """What the cost model decided over ``records`` (auto drafters only; None otherwise): steps and
    drafting seconds by drafter ("none": plain steps) and the stand-downs by kind, with counts."""
    steps: dict[str, int] = {}
    seconds: dict[str, float] = {}
    downs: dict[str, int] = {}
    for r in records:
        for key, n in r.extra.get("usage", {}).items():
            steps[key] = steps.get(key, 0) + int(n)
        for key, t in r.extra.get("drafting_seconds", {}).items():
            seconds[key] = round(seconds.get(key, 0.0) + float(t), 4)
        for why in r.extra.get("stand_downs", []):
            kind = str(why).split(" (")[0]
            downs[kind] = downs.get(kind, 0) + 1
    if not steps:
        return None
    return {"steps": steps, "drafting_seconds": seconds, "stand_downs": downs}


def describe_decisions(d: dict[str, Any]) -> str:
    """One line of :func:`decisions`: steps and drafting seconds by drafter, then the stand-downs."""
    parts = [f"{k} {n} steps" + (f" ({d['drafting_seconds'][k]:.2f} s drafting)" if k in d["drafting_seconds"] else "")
             for k, n in d["steps"].items()]
    downs = "; ".join(f"{k} x{n}" for k, n in d["stand_downs"].items()) or "none"
    return f"{', '.join(parts)}; stood down: {downs}"
