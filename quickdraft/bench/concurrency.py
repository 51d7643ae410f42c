"""``quickdraft bench --concurrency N``: N users at once against each endpoint, measured the way
serving benchmarks measure (vLLM's benchmark_serving, llama.cpp's server bench).

Each of the N users owns every N-th prompt of the set (user u: prompts u, u + N, ...) and sends
them one after another, streaming each answer; the users run at the same time (threads). Per
endpoint it reports per-user tokens/s (tokens after the first / time after the first, as for one
user), time to first token, end-to-end latency, aggregate tokens/s (all output tokens / the wall
time from the first request to the last answer), and how many answers are identical to the same
prompt's answer alone (the endpoint's own one-user run of it, made first, one prompt at a time).
Endpoints are measured one after another (the machine's cores are shared); run the paired
one-user benchmark (without --concurrency) for ratios measured side by side.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from quickdraft.bench.datasets import Dataset
from quickdraft.bench.runner import BenchSettings, EndpointContender, Trace


@dataclass
class UserResult:
    user: int
    prompt: int
    trace: Trace
    identical: bool | None = None  # to the answer alone (None: no alone run)

    @property
    def ttft(self) -> float | None:
        return self.trace.chunk_times[0] - self.trace.t_start if self.trace.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return self.trace.chunk_times[-1] - self.trace.t_start if self.trace.chunk_times else None

    @property
    def tokens_per_second(self) -> float | None:
        t = self.trace
        if t.output_tokens < 2 or len(t.chunk_times) < 2:
            return None
        dt = t.chunk_times[-1] - t.chunk_times[0]
        return (t.output_tokens - 1) / dt if dt > 0 else None


@dataclass
class ConcurrencyRun:
    contender: str
    users: int
    wall_seconds: float
    results: list[UserResult] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        def mean(xs: list[float | None]) -> float | None:
            vals = [x for x in xs if x is not None]
            return round(statistics.fmean(vals), 4) if vals else None

        tokens = sum(r.trace.output_tokens for r in self.results)
        compared = [r.identical for r in self.results if r.identical is not None]
        return {
            "contender": self.contender,
            "users": self.users,
            "requests": len(self.results),
            "output_tokens": tokens,
            "wall_seconds": round(self.wall_seconds, 3),
            "aggregate_tokens_per_second": round(tokens / self.wall_seconds, 3) if self.wall_seconds > 0 else None,
            "mean_user_tokens_per_second": mean([r.tokens_per_second for r in self.results]),
            "mean_ttft_seconds": mean([r.ttft for r in self.results]),
            "mean_e2e_seconds": mean([r.e2e for r in self.results]),
            "identical_to_alone": f"{sum(compared)}/{len(compared)}" if compared else None,
        }


def first_user_message(item: Any) -> list[dict[str, str]]:
    """The prompt's first turn as chat messages (later turns of a conversation are not sent)."""
    return [{"role": "user", "content": item.turns[0]}]


def run_concurrent(
    contender: EndpointContender, dataset: Dataset, settings: BenchSettings, users: int, alone: bool = True
) -> ConcurrencyRun:
    """The dataset's prompts sent by ``users`` users at once (see the module docstring); with
    ``alone``, each prompt is first answered alone, to count identical answers."""
    items = list(enumerate(dataset.items))
    reference: dict[int, str] = {}
    if alone:
        for i, item in items:
            reference[i] = contender.run(first_user_message(item), settings.params(i), None).text
    results: list[UserResult] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def user(u: int) -> None:
        for i, item in items[u::users]:
            try:
                trace = contender.run(first_user_message(item), settings.params(i), None)
            except BaseException as exc:  # reported after the run; the other users go on
                with lock:
                    errors.append(exc)
                return
            same = trace.text == reference[i] if i in reference else None
            with lock:
                results.append(UserResult(u, i, trace, same))

    threads = [threading.Thread(target=user, args=(u,), name=f"bench-user-{u}") for u in range(users)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return ConcurrencyRun(contender.name, users, wall, sorted(results, key=lambda r: r.prompt))


def markdown(runs: list[ConcurrencyRun], meta: dict[str, Any]) -> str:
    lines = [
        f"# {runs[0].users} users at once" if runs else "# concurrency",
        "",
        f"`{meta.get('command', '')}`",
        "",
        f"- created {meta.get('created', '')}; dataset {meta.get('dataset', '')}, {meta.get('max_tokens', '')} tokens "
        "per answer, greedy unless said; endpoints measured one after another",
        "",
        "| endpoint | users | aggregate tok/s | mean per-user tok/s | mean TTFT s | mean end-to-end s | identical to alone |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        s = r.summary()
        lines.append(
            f"| {s['contender']} | {s['users']} | {s['aggregate_tokens_per_second']} | "
            f"{s['mean_user_tokens_per_second']} | {s['mean_ttft_seconds']} | {s['mean_e2e_seconds']} | "
            f"{s['identical_to_alone']} |"
        )
    return "\n".join(lines) + "\n"
