"""quickdraft serve end to end: real server processes on loopback, the real ``openai`` client.

Two servers of SmolLM2-135M (fp32, the exact mode) run for the whole module: one speculates
(``--draft ngram``), one does not and needs an API key. Greedy outputs of the two must be equal
(speculation is lossless), structured output included.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, settings
from live_server import CONTEXT, KEY, NAME, Server, running, start_server
from schemathesis import GenerationMode

from quickdraft.cli.main import main
from quickdraft.errors import QuickdraftError
from quickdraft.server.grammar import GrammarCompiler
from quickdraft.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

HAIKU = [{"role": "user", "content": "Write a haiku about the sea."}]
FIB = "def fibonacci(n):"
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 20},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


ALIAS = "smol-alias"  # spec also answers to this name; responses report NAME, the first


@pytest.fixture(scope="module")
def servers(smollm2_gguf: Path) -> Iterator[tuple[Server, Server]]:
    spec = start_server(
        smollm2_gguf, "--draft", "ngram", "--num-draft", "4", "--served-model-name", ALIAS
    )
    plain = start_server(smollm2_gguf, "--draft", "none", "--api-key", KEY)
    with running(spec, plain):
        yield spec, plain


@pytest.fixture(scope="module")
def spec(servers: tuple[Server, Server]) -> Server:
    return servers[0]


@pytest.fixture(scope="module")
def plain(servers: tuple[Server, Server]) -> Server:
    return servers[1]


def _chat(server: Server, key: str = "unused", **kw: Any) -> Any:
    args: dict[str, Any] = {
        "model": NAME,
        "messages": HAIKU,
        "max_tokens": 12,
        "temperature": 0,
        **kw,
    }
    return server.client(key).chat.completions.create(**args)


# ------------------------------------------------------------------------------------ routes


def test_models_health_and_metrics(spec: Server) -> None:
    assert [m.id for m in spec.client().models.list().data] == [NAME, ALIAS]
    assert httpx.get(f"{spec.root}/health").json() == {"status": "ok"}
    text = httpx.get(f"{spec.root}/metrics").text
    for name in (
        "quickdraft_time_to_first_token_seconds_bucket",
        "quickdraft_inter_token_latency_seconds_bucket",
        "quickdraft_e2e_request_latency_seconds_bucket",
        "quickdraft_spec_drafted_tokens_total",
        "quickdraft_spec_accepted_tokens_total",
        "quickdraft_spec_tau",
    ):
        assert name in text


def test_served_model_name_aliases(spec: Server) -> None:
    client = spec.client()
    assert client.models.retrieve(ALIAS).id == ALIAS
    resp = _chat(spec, model=ALIAS, max_tokens=1)
    assert resp.model == NAME  # the first served name is the one reported
    text = client.completions.create(model=ALIAS, prompt="Hi", max_tokens=1)
    assert text.model == NAME
    for route, body in (
        ("chat/completions", {"model": "gpt-9", "messages": HAIKU}),
        ("completions", {"model": "gpt-9", "prompt": "Hi"}),
        ("models/gpt-9", None),
    ):
        r = httpx.post(f"{spec.url}/{route}", json=body) if body else httpx.get(f"{spec.url}/{route}")
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert f"`{NAME}`" in error["message"] and f"`{ALIAS}`" in error["message"]


def test_unknown_route_lists_the_routes(spec: Server) -> None:
    resp = httpx.post(f"{spec.url}/foo", json={}, timeout=30)
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "not_found"
    message = error["message"]
    assert message.startswith("no route POST /v1/foo; this server serves: ")
    for route in ("GET /health", "GET /v1/models", "POST /v1/chat/completions",
                  "POST /v1/completions", "GET /metrics"):
        assert route in message


def test_chat_stream_equals_whole_and_has_usage(spec: Server) -> None:
    whole = _chat(spec)
    content = whole.choices[0].message.content
    assert content and whole.choices[0].finish_reason in ("stop", "length")
    usage = whole.usage
    assert (
        usage.completion_tokens <= 12
        and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    )
    extra = usage.model_extra["quickdraft"]
    assert set(extra) == {"drafted", "accepted", "tau", "tokens_per_second", "ttft_s"}
    assert extra["tau"] >= 1 and 0 < extra["ttft_s"] < 60

    chunks = list(_chat(spec, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert (
        chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == usage.completion_tokens
    )

    # The wire format itself: data lines, then [DONE]; usage on the finishing chunk only.
    body = {"model": NAME, "messages": HAIKU, "max_tokens": 3, "temperature": 0, "stream": True}
    resp = httpx.post(f"{spec.url}/chat/completions", json=body, timeout=60)
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = resp.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])
    objs = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(o["object"] == "chat.completion.chunk" and "usage" not in o for o in objs[:-1])
    assert (
        objs[-1]["choices"][0]["finish_reason"] == "length"
        and objs[-1]["usage"]["completion_tokens"] == 3
    )


def test_prefix_cache_across_requests_and_clients(spec: Server, plain: Server) -> None:
    """Turn 2 of a conversation, sent by another client, reuses turn 1's computed prefix: usage says
    how many prompt tokens were cached, /metrics counts them, and the answer is the plain one."""
    turn1 = _chat(spec, messages=HAIKU, max_tokens=16)
    follow = [*HAIKU, {"role": "assistant", "content": turn1.choices[0].message.content},
              {"role": "user", "content": "Now one about disks."}]
    other = spec.client("another-client")  # a different client object and connection
    turn2 = other.chat.completions.create(model=NAME, messages=follow, max_tokens=16, temperature=0)
    cached = turn2.usage.prompt_tokens_details.cached_tokens
    assert turn1.usage.prompt_tokens + 8 <= cached < turn2.usage.prompt_tokens
    reference = _chat(plain, KEY, messages=follow, max_tokens=16)
    assert turn2.choices[0].message.content == reference.choices[0].message.content
    text = httpx.get(f"{spec.root}/metrics").text
    assert "quickdraft_prompt_tokens_cached_total" in text and "quickdraft_prefix_cache_hit_rate" in text
    count = float(re.search(r"^quickdraft_prompt_tokens_cached_total (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]
    assert count >= cached


def test_completions_stream_logprobs_and_stop(spec: Server) -> None:
    client = spec.client()
    whole = client.completions.create(
        model=NAME, prompt=FIB, max_tokens=12, temperature=0, logprobs=2
    )
    text = whole.choices[0].text
    lp = whole.choices[0].logprobs
    assert (
        len(lp.tokens)
        == whole.usage.completion_tokens
        == len(lp.token_logprobs)
        == len(lp.top_logprobs)
    )
    assert "".join(lp.tokens) == text and lp.text_offset[0] == 0
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and chosen == pytest.approx(
            max(top.values()), abs=1e-5
        )  # greedy = argmax

    streamed = client.completions.create(
        model=NAME, prompt=FIB, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text

    cut = text.index("return") if "return" in text else len(text) // 2
    word = text[cut : cut + 6]
    stopped = client.completions.create(
        model=NAME, prompt=FIB, max_tokens=12, temperature=0, stop=[word]
    )
    assert stopped.choices[0].text == text[:cut] and stopped.choices[0].finish_reason == "stop"


def test_chat_logprobs_cover_every_token_with_speculation(spec: Server, plain: Server) -> None:
    messages = [
        {"role": "user", "content": "Repeat this line three times: one two three four five six"}
    ]
    kw: dict[str, Any] = {
        "messages": messages,
        "max_tokens": 40,
        "logprobs": True,
        "top_logprobs": 3,
    }
    fast, slow = _chat(spec, **kw), _chat(plain, KEY, **kw)
    assert fast.usage.model_extra["quickdraft"]["accepted"] > 0  # drafts were accepted
    assert fast.choices[0].message.content == slow.choices[0].message.content
    tokens, reference = fast.choices[0].logprobs.content, slow.choices[0].logprobs.content
    assert len(tokens) == fast.usage.completion_tokens == len(reference)
    for got, want in zip(tokens, reference, strict=True):
        assert got.token == want.token and bytes(got.bytes) == bytes(want.bytes)
        assert got.logprob == pytest.approx(want.logprob, abs=1e-3)
        assert len(got.top_logprobs) == 3 and got.logprob == pytest.approx(
            got.top_logprobs[0].logprob, abs=1e-5
        )


def test_seeds_and_sampling_knobs(spec: Server, plain: Server) -> None:
    kw: dict[str, Any] = {
        "temperature": 0.9,
        "top_p": 0.95,
        "seed": 7,
        "max_tokens": 10,
        "presence_penalty": 0.3,
        "frequency_penalty": 0.2,
        "extra_body": {"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1},
    }
    answers = {_chat(spec, **kw).choices[0].message.content for _ in range(4)}
    first = _chat(spec, **kw)
    assert answers == {first.choices[0].message.content}  # a seed means one answer ...
    assert _chat(plain, KEY, **kw).choices[0].message.content == first.choices[0].message.content  # ... plain's
    others = {_chat(spec, **{**kw, "seed": s}).choices[0].message.content for s in (8, 9)}
    assert others != {first.choices[0].message.content}


# -------------------------------------------------------------------------- structured output


def _check_person(text: str) -> dict[str, Any]:
    obj = json.loads(text)
    assert set(obj) == {"name", "age", "city"}
    assert isinstance(obj["name"], str) and isinstance(obj["city"], str) and len(obj["name"]) <= 20
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 150
    return obj


def test_structured_output_is_valid_and_lossless(spec: Server, plain: Server) -> None:
    # The n-gram drafter copies from the prompt, "job" included, which the schema forbids: those
    # drafts must be rejected, and the output must equal plain decoding's.
    source = '{"name": "Ada Lovelace", "age": 36, "city": "London", "job": "mathematician"}'
    messages = [{"role": "user", "content": f"Copy this JSON exactly: {source}"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
    kw: dict[str, Any] = {"messages": messages, "max_tokens": 48, "response_format": fmt}
    fast, slow = _chat(spec, **kw), _chat(plain, KEY, **kw)
    assert fast.choices[0].finish_reason == "stop"  # ended by EOS once the object closed
    text = fast.choices[0].message.content
    assert _check_person(text)["city"] == "London"
    assert text == slow.choices[0].message.content
    assert fast.usage.model_extra["quickdraft"]["accepted"] > 0
    free = _chat(spec, messages=messages, max_tokens=48).choices[0].message.content
    assert '"job"' in free  # without the grammar the model copies the forbidden key

    describe = [{"role": "user", "content": "Describe a person as JSON with name, age and city."}]
    streamed = _chat(spec, stream=True, **{**kw, "messages": describe})
    assert _check_person("".join(c.choices[0].delta.content or "" for c in streamed if c.choices))
    any_object = _chat(
        spec, messages=describe, max_tokens=48, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(any_object.choices[0].message.content), dict)

    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}
    with pytest.raises(openai.BadRequestError):
        _chat(spec, messages=messages, response_format=bad)


def test_constraint_rows_follow_the_draft_prefix(smollm2_gguf: Path) -> None:
    """allowed(draft) row i = the mask after draft[:i]; a forbidden draft token ends the walk
    without disturbing the state; EOS is allowed exactly when the object is complete."""
    tokenizer = Tokenizer.from_gguf(smollm2_gguf)
    compiler = GrammarCompiler(tokenizer)
    vocab = tokenizer.vocab_size
    eos = sorted(tokenizer.eos_ids)
    ids = tokenizer.encode('{"name": "Bo", "age": 3, "city": "Rome"}', add_special_tokens=False)
    forbidden = tokenizer.encode("x", add_special_tokens=False)[0]

    constraint = compiler.json(PERSON_SCHEMA)
    draft = [*ids[:3], forbidden, *ids[3:5]]
    rows = constraint.allowed(draft, vocab)
    assert rows.shape == (len(draft) + 1, vocab)
    for i in range(4):
        step = compiler.json(PERSON_SCHEMA)
        step.commit(draft[:i])
        assert torch.equal(rows[i], step.allowed([], vocab)[0])
        assert not rows[i, eos].any()
    assert not rows[3, forbidden] and all(
        torch.equal(rows[j], rows[3]) for j in range(4, len(draft) + 1)
    )
    assert torch.equal(constraint.allowed([], vocab)[0], rows[0])  # the walk was rolled back

    constraint.commit(ids)
    done = constraint.allowed([], vocab)[0]
    assert constraint.is_finished() and done.nonzero().flatten().tolist() == eos
    with pytest.raises(QuickdraftError):
        compiler.json({"type": "frob"})


# ------------------------------------------------------------------------------ auth and errors


def test_api_key(plain: Server) -> None:
    with pytest.raises(openai.AuthenticationError):
        _chat(plain, max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        _chat(plain, "wrong", max_tokens=1)
    assert httpx.get(f"{plain.root}/metrics").status_code == 401
    assert httpx.get(f"{plain.root}/health").status_code == 200
    assert _chat(plain, KEY, max_tokens=1).choices[0].message.content is not None


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b'{"model": "smollm2", "messages": [', 400, "not valid JSON"),
        ({"model": "gpt-9", "messages": HAIKU}, 404, "gpt-9"),
        ({"model": NAME}, 400, "messages"),
        ({"model": NAME, "messages": []}, 400, "messages"),
        ({"model": NAME, "messages": HAIKU, "max_tokens": CONTEXT}, 400, "maximum context length"),
        (
            {"model": NAME, "messages": [{"role": "user", "content": "hi " * CONTEXT}]},
            400,
            "maximum context length",
        ),
        ({"model": NAME, "messages": HAIKU, "temperature": -1}, 400, "temperature"),
        ({"model": NAME, "messages": HAIKU, "n": 17}, 400, "n must be between 1 and 16"),
        ({"model": NAME, "messages": HAIKU, "top_k": -5}, 400, "top_k"),
        ({"model": NAME, "prompt": [10**9]}, 400, "token ids"),
        ({"model": NAME, "messages": HAIKU, "padding": "x" * (1 << 20)}, 413, "larger than"),
        ({"model": NAME, "messages": HAIKU, "seed": 2**80}, 400, "seed"),
        (b'{"model": "smollm2", "messages": [{"role": "user", "content": "\\udcff"}]}', 400,
         "not valid Unicode"),
        (b"[" * 5000 + b"]" * 5000, 400, "deeper than"),
        ({"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
        ({"model": NAME, "messages": HAIKU, "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ({"model": NAME, "messages": HAIKU, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
        (
            {"model": NAME, "messages": HAIKU, "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
            ]},
            400,
            "no place for tools",
        ),
        ({"model": NAME, "messages": HAIKU, "tool_choice": "required"}, 400, "needs tools"),
        ({"model": NAME, "messages": HAIKU, "functions": [{"name": "f"}]}, 400, "deprecated"),
        ({"model": NAME, "messages": HAIKU, "modalities": ["audio"]}, 400, "only text"),
        (
            {"model": NAME, "messages": [
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}
                ]},
            ]},
            400,
            "not JSON",
        ),
    ],
)
def test_bad_requests_get_openai_errors(spec: Server, body: Any, status: int, needle: str) -> None:
    route = "completions" if isinstance(body, dict) and "prompt" in body else "chat/completions"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(
        f"{spec.url}/{route}",
        content=content,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and needle in error["message"]


def test_wrong_method_says_which_are_allowed_and_openapi_documents_bodies(spec: Server) -> None:
    resp = httpx.get(f"{spec.url}/chat/completions", timeout=30)
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"
    error = resp.json()["error"]
    assert error["code"] == "method_not_allowed" and "allowed: POST" in error["message"]
    assert "GET" in error["message"] and "/v1/chat/completions" in error["message"]
    resp = httpx.delete(f"{spec.url}/models", timeout=30)
    assert resp.status_code == 405 and "allowed: GET" in resp.json()["error"]["message"]
    doc = httpx.get(f"{spec.root}/openapi.json", timeout=30).json()
    for route, model in (("chat/completions", "ChatCompletionRequest"),
                         ("completions", "CompletionRequest")):
        op = doc["paths"][f"/v1/{route}"]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}" and "400" in op["responses"]
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert {"messages", "model", "tools", "tool_choice", "logit_bias"} <= set(chat["properties"])
    role = doc["components"]["schemas"]["ChatMessage"]["properties"]["role"]
    assert set(role["enum"]) == {"system", "developer", "user", "assistant", "tool"}


def test_logit_bias_changes_the_output_losslessly(spec: Server, plain: Server) -> None:
    base = _chat(spec, logprobs=True).choices[0]
    first = base.logprobs.content[0].token
    ids = Tokenizer.from_gguf(_model_path(spec)).encode(first, add_special_tokens=False)
    bias = {str(ids[0]): -100}
    fast = _chat(spec, logit_bias=bias, logprobs=True).choices[0]
    slow = _chat(plain, KEY, logit_bias=bias).choices[0]
    assert fast.logprobs.content[0].token != first and fast.message.content == slow.message.content
    assert fast.message.content != base.message.content


def _model_path(server: Server) -> Path:
    from quickdraft import zoo

    return zoo.fetch("smollm2-135m-instruct", progress=False)


def test_errors_through_the_client_and_server_keeps_serving(spec: Server) -> None:
    with pytest.raises(openai.NotFoundError):
        _chat(spec, model="nope")
    with pytest.raises(openai.BadRequestError, match="n must be between"):
        _chat(spec, n=0)
    assert httpx.get(f"{spec.root}/v1/nothing").json()["error"]["code"] == "not_found"
    assert _chat(spec, max_tokens=2).choices[0].message.content


# ----------------------------------------------------------------------------------- concurrency


def test_n_choices_are_sequences_of_their_own(spec: Server) -> None:
    """n > 1: one sequence per choice, generated at once; greedy choices are the one answer,
    sampled choice i is the answer of seed + i; streamed chunks carry their choice's index and
    add up to the whole answers; usage counts the prompt once and every choice's tokens."""
    one = _chat(spec, max_tokens=8)
    greedy = _chat(spec, n=3, max_tokens=8)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert {c.message.content for c in greedy.choices} == {one.choices[0].message.content}
    assert greedy.usage.prompt_tokens == one.usage.prompt_tokens
    assert greedy.usage.completion_tokens == 3 * one.usage.completion_tokens
    sampled = _chat(spec, n=2, temperature=1.0, seed=7, max_tokens=8)
    alone = [_chat(spec, temperature=1.0, seed=7 + i, max_tokens=8).choices[0].message.content for i in range(2)]
    assert [c.message.content for c in sampled.choices] == alone
    stream = spec.client().chat.completions.create(
        model=NAME, messages=HAIKU, n=2, temperature=1.0, seed=7, max_tokens=8, stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage, finished = ["", ""], None, set()
    for chunk in stream:
        for choice in chunk.choices:
            parts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
        if not chunk.choices:
            usage = chunk.usage
    assert parts == alone and finished == {0, 1}
    assert usage is not None and usage.completion_tokens == sampled.usage.completion_tokens
    client = spec.client()
    texts = client.completions.create(model=NAME, prompt="Once upon a time", n=2, max_tokens=6, temperature=1.0, seed=3)
    assert [c.index for c in texts.choices] == [0, 1]
    streamed = ["", ""]
    for chunk in client.completions.create(model=NAME, prompt="Once upon a time", n=2, max_tokens=6, temperature=1.0,
                                           seed=3, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [c.text for c in texts.choices]


def test_concurrent_streams_equal_their_solo_runs(spec: Server) -> None:
    subjects = ["cats", "rain", "trains", "bread", "mountains", "coffee", "stars", "rivers"]
    prompts = [[{"role": "user", "content": f"One sentence about {s}."}] for s in subjects]
    solo = [_chat(spec, messages=m, max_tokens=8).choices[0].message.content for m in prompts]
    results: list[str | None] = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        client = spec.client()
        barrier.wait()
        stream = client.chat.completions.create(
            model=NAME, messages=prompts[i], max_tokens=8, temperature=0, stream=True
        )
        results[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == solo


def test_client_disconnect_stops_generation(spec: Server) -> None:
    before = spec.metric("quickdraft_generation_tokens_total")
    cancelled = spec.metric("quickdraft_requests_cancelled_total")
    body = {
        "model": NAME,
        "messages": HAIKU,
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{spec.url}/chat/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        seen = 0
        while seen < 2:
            seen += next(lines).startswith("data: {")
    deadline = time.time() + 20
    while spec.metric("quickdraft_requests_cancelled_total") == cancelled:
        assert time.time() < deadline, "the generation went on after the client left"
        time.sleep(0.1)
    t0 = time.perf_counter()
    assert _chat(spec, max_tokens=2).choices[0].message.content
    assert time.perf_counter() - t0 < 10
    assert spec.metric("quickdraft_generation_tokens_total") - before < 100  # far from 400


# ------------------------------------------------------------------------------------- benchmark


def test_bench_against_the_server(spec: Server, smollm2_gguf: Path, tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "Name three colors."}) + "\n")
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            "--endpoint",
            spec.root,
            "--served-model",
            NAME,
            "--model",
            str(smollm2_gguf),
            "--dataset",
            str(data),
            "--max-tokens",
            "8",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    (record,) = report["records"]
    assert record["output_tokens"] == 8 and record["finish_reason"] == "length"
    assert record["ttft"] > 0 and record["tokens_per_second"] > 0


# ------------------------------------------------------------------------------- API fuzzing


# Requests per operation and data kind (valid, invalid): ~290 in all. Building them is the test's cost
# (~80 ms a request, in this process, not the server); the GETs and DELETEs vary only an id in their path.
FUZZ_EXAMPLES = {"POST": 25, "GET": 8, "DELETE": 8}


def _fuzz_runner(
    op: Any, mode: Any, status: dict[str, dict[int, int]], bad: list[str]
) -> Any:
    """A hypothesis test sending FUZZ_EXAMPLES[method] requests of ``op`` in ``mode`` (valid or invalid
    data); counts their status codes and records every answer that is wrong."""
    from hypothesis import given

    has_body = op.method.upper() == "POST"

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(
        max_examples=FUZZ_EXAMPLES[op.method.upper()],
        deadline=None,
        derandomize=True,  # the same requests every run
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def run(case: Any) -> None:
        if isinstance(case.body, dict) and has_body:
            if mode == GenerationMode.POSITIVE:
                case.body["model"] = NAME  # else nearly every valid body is a 404
            for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                value = case.body.get(key)
                if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 4):
                    case.body[key] = 4
        # 180 s: a 4-token answer can wait in the FIFO behind a request whose fuzzed JSON schema
        # makes every token's grammar mask slow (one CI run timed out at 60 s and passed on replay)
        response = case.call(timeout=180)
        counts = status.setdefault(op.label, {})
        counts[response.status_code] = counts.get(response.status_code, 0) + 1
        if response.status_code >= 500:
            bad.append(f"{op.label} {case.body!r:.300} -> {response.status_code} {response.text:.300}")
        elif response.status_code >= 400 and response.status_code != 405:
            body = response.json()
            error = body.get("error", {})
            if op.path.startswith("/v1/messages"):  # Anthropic's Messages API: its error shape
                if body.get("type") != "error" or set(error) != {"message", "type"}:
                    bad.append(f"{op.label} {case.body!r:.300}: not an Anthropic error: {response.text:.300}")
            elif set(error) != {"message", "type", "param", "code"}:
                bad.append(f"{op.label} {case.body!r:.300}: not an OpenAI error: {response.text:.300}")

    return run


def test_fuzzed_requests_never_get_a_server_error(spec: Server) -> None:
    """schemathesis builds requests from /openapi.json (bodies from the request schemas, valid
    ones and ones that break them) for every operation; every answer must be < 500, an error
    must be OpenAI's error object, and the server must still answer afterwards. Generation is
    kept short (max_tokens <= 4) so the run stays bounded."""
    schema = schemathesis.openapi.from_url(f"{spec.root}/openapi.json")
    status: dict[str, dict[int, int]] = {}  # operation -> status -> count
    bad: list[str] = []
    operations = [op.ok() for op in schema.get_all_operations()]
    assert {op.label for op in operations} >= {
        "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages",
        "POST /v1/messages/count_tokens",
    }
    for op in operations:
        modes = [GenerationMode.POSITIVE]
        if op.method.upper() == "POST":  # GETs take nothing that could be invalid
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            _fuzz_runner(op, mode, status, bad)()
    total = sum(sum(c.values()) for c in status.values())
    print(f"\nschemathesis {schemathesis.SCHEMATHESIS_VERSION}: {total} requests", json.dumps(status, sort_keys=True))
    assert not bad, "\n".join(bad[:10])
    assert total >= 150
    assert _chat(spec, max_tokens=2).choices[0].message.content  # still serving
