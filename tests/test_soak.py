"""benchmarks/soak.py: the soak benchmark's main coroutine against a real ``quickdraft serve`` of
SmolLM2-135M (started by the script), a few clients through one cycle of request kinds each, and
its refusal of endpoints off loopback."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import signal
import sys
from collections import Counter
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


def _soak() -> ModuleType:
    """Import benchmarks/soak.py (not a package) as a module."""
    if "soak" in sys.modules:
        return sys.modules["soak"]
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"
    spec = importlib.util.spec_from_file_location("soak", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_endpoint_must_be_loopback() -> None:
    soak = _soak()
    for url in ("http://10.0.0.1:8000", "http://example.com:8000", "http://0.0.0.0:8000",
                "https://127.0.0.1:8000", "http://127.0.0.1"):
        with pytest.raises(SystemExit):
            soak.parse_args(["--endpoint", url])
    args = soak.parse_args(["--endpoint", "http://127.0.0.1:8123/v1", "--pid", "1"])
    assert soak._check_loopback(args.endpoint) == "http://127.0.0.1:8123"
    assert soak._check_loopback("http://[::1]:9") == "http://[::1]:9"
    with pytest.raises(SystemExit):  # --pid measures a running server only
        soak.parse_args(["--pid", "1"])
    with pytest.raises(SystemExit):  # the running server's model is what it serves
        soak.parse_args(["--endpoint", "http://127.0.0.1:8123", "--model", "smollm2"])
    assert soak.parse_args([]).model == "qwen-1.5b" and args.model is None


def test_compare_counts_a_different_answer() -> None:
    soak = _soak()
    s = soak.Soak(soak.parse_args(["--clients", "1"]), None, None)
    s.refs[("chat", 0)] = "The sea is calm"
    s.compare("chat", ("chat", 0), "The sea is calm")
    s.compare("disconnect", ("chat", 0), "The sea", prefix=True)  # a stream closed early
    assert sum(s.stats.mismatch_count.values()) == 0
    s.compare("chat_stream", ("chat", 0), "The sea is rough")
    s.compare("disconnect", ("chat", 0), "A sea", prefix=True)
    s.compare("chat", ("chat", 9), "anything")  # no alone answer: not compared
    assert s.stats.mismatch_count == Counter({"chat_stream": 1, "disconnect": 1})
    assert s.stats.compared == Counter({"chat": 1, "disconnect": 2, "chat_stream": 1})
    assert s.stats.mismatches[0]["under_load"] == "The sea is rough"


@pytest.mark.slow
def test_soak_run(smollm2_gguf: Path, tmp_path: Path) -> None:
    """3 clients, each through the whole schedule once (the count bound ends the run, long before
    the duration): every kind served as often as the schedule says, every greedy and seeded answer
    compared with and equal to its alone answer, no error, the disconnecting clients' requests
    cancelled on the server, RSS sampled by pid, the JSON saved with the command."""
    soak = _soak()
    clients = 3
    argv = [
        "--model", str(smollm2_gguf), "--clients", str(clients), "--duration", "120",
        "--warmup", "0", "--max-tokens", "12", "--sample-every", "0.5",
        "--max-requests-per-client", str(len(soak.SCHEDULE)),
        "--server-args", "--threads 1 --max-context 512", "--out-dir", str(tmp_path),
        "--name", "short",
    ]
    report = asyncio.run(soak.run_soak(soak.parse_args(argv), argv))

    saved = json.loads((tmp_path / "short.json").read_text())
    assert saved["command"] == ["benchmarks/soak.py", *argv]
    assert saved["verdict"] == report["verdict"] == "PASS", report["checks"]
    assert saved["environment"]["versions"]["torch"] and saved["environment"]["hardware"]["cpu"]
    assert saved["server_command"][:4] == [sys.executable, "-m", "quickdraft", "serve"]

    # SmolLM2's chat template has no tools: the alone phase found out and left them out
    requests = report["requests"]
    assert "tools" in requests["skipped_kinds"]
    expected = Counter(k for k in soak.SCHEDULE if not k.startswith("tools"))
    by_kind = requests["by_kind"]
    assert {k: v["ok"] for k, v in by_kind.items() if k != "alone_after"} == {
        k: clients * n for k, n in expected.items()
    }
    assert requests["served"] == clients * sum(expected.values()) and requests["failed"] == 0
    assert report["load_wall_s"] < 120  # ended by the count bound, not the duration

    errors = report["errors"]
    assert errors["status_5xx"] == errors["other"] == errors["hung_clients"] == 0
    assert errors["server_log_tracebacks"] == 0 and not errors["messages"]

    same = report["identical_to_alone"]
    assert same["mismatches"] == 0 and not same["first_mismatches"]
    # every answer of a greedy or seeded kind was compared (n = 2: both choices), disconnects too
    compared = sum(clients * n * (2 if k.startswith("n2") else 1) for k, n in expected.items())
    assert same["compared"] == compared + len(soak.GREEDY_PROMPTS)  # + the alone_after round
    assert same["seeded_compared"] == clients * (expected["seeded"] + expected["seeded_stream"])
    assert not same["responses_messages_differ_from_chat_alone"]

    # a client that closes its stream cancels the generation on the server, and none is left over
    server = report["server"]
    assert server["idle_after_load"] and server["exit_code"] in (0, -signal.SIGTERM)
    assert server["log"] is None  # the server's log is kept only when the run fails
    metrics = server["metrics_after_load"]
    assert metrics["quickdraft_requests_cancelled_total"] == clients * expected["disconnect"]
    assert metrics["quickdraft_requests_failed_total"] == 0

    rss = report["rss"]
    assert rss["pid"] and rss["start_mb"] > 50 and rss["end_mb"] > 50
    assert len(rss["samples"]) >= 2 and rss["peak_mb"] >= rss["start_mb"]
    assert rss["growth_net_of_prefix_cache_pct"] is not None


def test_server_errors_are_counted(tmp_path: Path) -> None:
    """A 500, a server error event mid-stream, a malformed stream and a 400 (a fake server, no
    model): each counted in its category with its message, none counted as served."""
    import httpx

    soak = _soak()

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/v1/completions":
            return httpx.Response(500, json={"error": {"message": "boom", "type": "server_error"}})
        if request.url.path == "/v1/messages":
            return httpx.Response(400, json={"type": "error", "error": {"message": "bad"}})
        if body.get("stream"):  # chat: an error event after one chunk, then [DONE]
            chunk = {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}
            error = {"error": {"message": "internal server error (RuntimeError)", "type": "server_error"}}
            text = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(error)}\n\ndata: [DONE]\n\n"
            return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, text="{not json")

    async def run() -> Any:
        transport = httpx.MockTransport(answer)
        async with httpx.AsyncClient(base_url="http://127.0.0.1:1", transport=transport) as http:
            s = soak.Soak(soak.parse_args(["--clients", "1"]), soak.Client(http, "m", 8), None)
            rng = random.Random(0)
            for kind in ("completion", "chat_stream", "chat", "messages"):
                await s.timed(kind, partial(s.request, kind, rng))
            return s.stats

    stats = asyncio.run(run())
    assert not stats.ok and stats.requests == stats.errors == 4
    assert stats.failures == Counter(
        {"5xx": 1, "stream_server_error": 1, "protocol": 1, "http": 1}
    )
    messages = "\n".join(stats.messages)
    assert "completion 5xx: 500" in messages and "boom" in messages
    assert "chat_stream stream_server_error: error event: internal server error" in messages
    assert "chat protocol: not JSON" in messages and "messages http: 400" in messages
