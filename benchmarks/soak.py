"""Soak: N concurrent clients for a bounded time against ``quickdraft serve``, every route mixed.

The script starts ``quickdraft serve`` itself on 127.0.0.1 (a free port; ``--max-concurrency`` =
the number of clients and ``--max-context 2048`` unless --server-args says otherwise) and stops it
at the end, or uses a running one (``--endpoint http://127.0.0.1:PORT``; loopback only, anything else is refused).

1. Alone: with the server otherwise idle, each fixed request whose answer must not depend on the
   load is sent once, one at a time, and its answer kept: greedy chat prompts through
   /v1/chat/completions, /v1/responses and /v1/messages (the three must agree: the two others are
   translated onto the chat request), greedy /v1/completions prompts, greedy tool-call requests
   (``tools`` with one function, tool_choice auto; skipped where the model's chat template has no
   tools), and sampled chat requests (temperature 0.7) with fixed seeds.
2. Load: ``--clients`` clients run for ``--duration`` seconds, each cycling through the request
   kinds (a fixed interleaved schedule, each client at its own offset; prompts and seeds by a
   seeded RNG): chat whole and streamed, /v1/completions, tool calls whole and streamed, seeded
   sampling whole and streamed, ``n = 2`` (greedy: both choices are the greedy answer; seeded:
   choice i draws with seed + i, so it is the alone answer of seed + i), Responses and Messages
   whole and streamed, and clients that close the connection after a few streamed chunks (what
   they got must be a prefix of the greedy answer). Every greedy or seeded answer is compared with
   the alone answer of the same request: the engine promises each answer is bitwise what it is
   alone. Whole and streamed answers must both equal it.
3. After: the server must be idle (no request running or waiting), and the greedy chat prompts
   sent alone again must still give the alone answers.

The server's RSS (psutil, the pid and its children: when the script starts the server, or with
--pid) is sampled
every few seconds with the prefix cache's size from /metrics; growth is from the first sample
after --warmup seconds of load to the end of the load. The prefix cache holds earlier sequences
up to its budget (``--prefix-cache-mb``), which grows RSS without being a leak, so the check is on
the growth net of the prefix cache's growth (both are printed and saved).

Every loop is bounded in count and time: each client sends at most --max-requests-per-client
requests and none after --duration; a request has --request-timeout seconds; at duration +
request timeout + 30 s everything still running is cancelled (counted as hung) and the server is
stopped. Progress is printed every --progress-every seconds; figures are printed and saved as JSON
(command, versions, CPU, model, settings) into benchmarks/results/soak/<name>.json. The last line
is PASS or FAIL: no response >= 500 (nor server error mid-stream or traceback in the server log),
no other error (4xx, transport, timeout, malformed stream, hung request), no greedy or seeded
answer different from alone, the server idle after the load, RSS growth net of the prefix cache
<= --max-rss-growth percent, and (a server this script started) its exit on SIGTERM within 30 s.

    .venv/bin/python benchmarks/soak.py                      # qwen-1.5b, 16 clients, 600 s
    .venv/bin/python benchmarks/soak.py --model smollm2 --clients 4 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil

RESULTS = Path(__file__).resolve().parent / "results" / "soak"
DEFAULT_MODEL = "qwen-1.5b"

GREEDY_PROMPTS = (
    "Name three primary colors.",
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the square of a number.",
    "Explain what a hash table is in two sentences.",
    "Write a haiku about the sea.",
    "List the first five prime numbers.",
)
COMPLETION_PROMPTS = (
    "def fibonacci(n):",
    "The three laws of thermodynamics are",
    "import numpy as np\n\n# the mean of a list of numbers\n",
)
TOOL_PROMPTS = (
    "What's the weather like in Paris right now?",
    "Is it raining in Tokyo? Use celsius.",
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "the city's name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEEDED_PROMPTS = 2  # the first GREEDY_PROMPTS, also sent sampled
SEEDS = (11, 12, 23, 24)  # n = 2 sends seed 11 or 23: its choice 1 draws with 12 or 24
N2_SEEDS = (11, 23)
TEMPERATURE = 0.7

# One cycle of request kinds; each client runs through it from its own offset. Greedy chat comes
# most often (short answers, many requests); every other kind once or twice per cycle.
SCHEDULE = (
    "chat_stream", "seeded", "chat", "responses_stream", "n2", "messages", "disconnect",
    "tools", "completion", "chat_stream", "responses", "seeded_stream", "messages_stream",
    "tools_stream", "chat", "n2_stream", "disconnect", "chat_stream",
)
KINDS = tuple(dict.fromkeys(SCHEDULE))
DISCONNECT_AFTER = 3  # data chunks read before the client closes the connection
MAX_KEPT = 20  # mismatches and error messages kept in the JSON
CLEAN_EXIT = (0, -signal.SIGTERM, None)  # None: a server this script did not start


class Failure(Exception):
    """A request that did not get a proper answer. ``category``: 5xx, http (other non-200),
    transport, timeout, stream_server_error (an error event mid-stream of server_error type),
    stream_error (another error event), protocol (a malformed answer)."""

    def __init__(self, category: str, message: str) -> None:
        super().__init__(message)
        self.category = category
        self.message = message


@dataclass
class Answer:
    """What a request produced: one text per choice (greedy/seeded comparisons), or for tool
    requests a canonical JSON of (content, calls)."""

    texts: list[str]
    complete: bool = True  # False: the client closed the stream on purpose


@dataclass
class Stats:
    started: float = field(default_factory=time.monotonic)
    ok: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)  # by category
    messages: Counter[str] = field(default_factory=Counter)  # "kind category: message"
    latency: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    compared: Counter[str] = field(default_factory=Counter)  # answers compared with alone
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    mismatch_count: Counter[str] = field(default_factory=Counter)
    hung: int = 0

    @property
    def requests(self) -> int:
        return sum(self.ok.values()) + sum(self.failed.values())

    @property
    def errors(self) -> int:
        return sum(self.failed.values()) + self.hung


# ------------------------------------------------------------------------------------- the client


def _check_loopback(url: str) -> str:
    """The endpoint's root URL; anything not on loopback is refused."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if parts.scheme != "http" or not loopback or parts.port is None:
        raise SystemExit(
            f"--endpoint must be http://127.0.0.1:PORT (a loopback address and a port), got {url!r}"
        )
    netloc = f"[{host}]:{parts.port}" if ":" in host else f"{host}:{parts.port}"
    return f"http://{netloc}"


async def _sse(response: httpx.Response) -> AsyncIterator[tuple[str | None, str]]:
    """(event name or None, data) of each server-sent event."""
    event: str | None = None
    data: list[str] = []
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = None, []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
    if data:
        yield event, "\n".join(data)


def _json(data: str) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        raise Failure("protocol", f"not JSON: {data[:200]!r}") from None


def _stream_error(error: Any) -> Failure:
    error = error if isinstance(error, dict) else {"message": str(error)}
    kind = str(error.get("type") or error.get("code") or "")
    category = "stream_server_error" if kind in ("server_error", "api_error") else "stream_error"
    return Failure(category, f"error event: {error.get('message')} ({kind})")


def _tool_answer(content: str | None, calls: list[tuple[str, str]]) -> str:
    return json.dumps({"content": content or "", "calls": calls})


class Client:
    """Requests of each kind against one server; each returns an :class:`Answer` or raises
    :class:`Failure`."""

    def __init__(self, http: httpx.AsyncClient, model: str, max_tokens: int) -> None:
        self.http = http
        self.model = model
        self.max_tokens = max_tokens

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        r = await self.http.post(path, json=body)
        if r.status_code != 200:
            raise Failure("5xx" if r.status_code >= 500 else "http", f"{r.status_code} {r.text[:300]}")
        return _json(r.text)

    async def _stream(
        self, path: str, body: dict[str, Any], limit: int | None = None
    ) -> AsyncGenerator[tuple[str | None, Any], None]:
        """The stream's events as (name, parsed data); ``[DONE]`` as (None, None). With
        ``limit``: stop (and close the connection) after that many events."""
        async with self.http.stream("POST", path, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                raise Failure("5xx" if r.status_code >= 500 else "http", f"{r.status_code} {text[:300]}")
            n = 0
            async for event, data in _sse(r):
                yield event, (None if data == "[DONE]" else _json(data))
                n += 1
                if limit is not None and n >= limit:
                    return  # leaving the block closes the connection mid-stream

    def chat_body(self, prompt: str, **kw: Any) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            **kw,
        }

    async def chat(self, body: dict[str, Any], stream: bool, limit: int | None = None) -> Answer:
        n = body.get("n") or 1
        texts = [""] * n
        calls: list[dict[int, list[str]]] = [{} for _ in range(n)]
        if not stream:
            obj = await self._post("/v1/chat/completions", body)
            choices = sorted(obj.get("choices") or [], key=lambda c: c["index"])
            if len(choices) != n or any(c.get("finish_reason") is None for c in choices):
                raise Failure("protocol", f"chat answer with {len(choices)} choices for n={n}")
            for c in choices:
                msg = c["message"]
                texts[c["index"]] = msg.get("content") or ""
                for i, tc in enumerate(msg.get("tool_calls") or []):
                    calls[c["index"]][i] = [tc["function"]["name"], tc["function"]["arguments"]]
        else:
            finished: set[int] = set()
            done = False
            async with aclosing(self._stream("/v1/chat/completions", body, limit)) as events:
                async for _event, obj in events:
                    if obj is None:
                        done = True
                        continue
                    if "error" in obj:
                        raise _stream_error(obj["error"])
                    for c in obj.get("choices") or []:
                        i = c["index"]
                        delta = c.get("delta") or {}
                        texts[i] += delta.get("content") or ""
                        for tc in delta.get("tool_calls") or []:
                            call = calls[i].setdefault(tc["index"], ["", ""])
                            fn = tc.get("function") or {}
                            call[0] += fn.get("name") or ""
                            call[1] += fn.get("arguments") or ""
                        if c.get("finish_reason") is not None:
                            finished.add(i)
            if limit is not None and not done:
                return Answer(texts, complete=False)
            if not done or len(finished) != n:
                raise Failure("protocol", f"chat stream ended without [DONE] or a finish_reason "
                                          f"(done={done}, finished {len(finished)} of {n})")
        if "tools" in body:
            return Answer([_tool_answer(t, [(calls[i][k][0], calls[i][k][1]) for k in sorted(calls[i])])
                           for i, t in enumerate(texts)])
        return Answer(texts)

    async def completion(self, prompt: str) -> Answer:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0}
        obj = await self._post("/v1/completions", body)
        choices = obj.get("choices") or []
        if len(choices) != 1 or choices[0].get("finish_reason") is None:
            raise Failure("protocol", f"completion answer without one finished choice: {obj}")
        return Answer([choices[0]["text"]])

    def responses_body(self, prompt: str, max_tokens: int | None = None) -> dict[str, Any]:
        return {"model": self.model, "input": prompt, "temperature": 0,
                "max_output_tokens": max_tokens or self.max_tokens}

    async def responses(self, prompt: str, stream: bool, limit: int | None = None,
                        max_tokens: int | None = None) -> Answer:
        body = self.responses_body(prompt, max_tokens)
        if not stream:
            return Answer([_response_text(await self._post("/v1/responses", body))])
        text = ""
        final = None
        async with aclosing(self._stream("/v1/responses", body, limit)) as events:
            async for event, obj in events:
                if event == "error" or (obj or {}).get("type") == "error":
                    raise _stream_error(obj)
                if event == "response.output_text.delta":
                    text += obj["delta"]
                elif event in ("response.completed", "response.incomplete"):
                    final = obj["response"]
        if limit is not None and final is None:
            return Answer([text], complete=False)
        if final is None:
            raise Failure("protocol", "responses stream ended without response.completed")
        if _response_text(final) != text:
            raise Failure("protocol", f"responses stream: deltas {text!r} but the final response "
                                      f"says {_response_text(final)!r}")
        return Answer([text])

    def messages_body(self, prompt: str, max_tokens: int | None = None) -> dict[str, Any]:
        return {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens or self.max_tokens, "temperature": 0}

    async def messages(self, prompt: str, stream: bool, limit: int | None = None,
                       max_tokens: int | None = None) -> Answer:
        body = self.messages_body(prompt, max_tokens)
        if not stream:
            obj = await self._post("/v1/messages", body)
            if obj.get("type") != "message" or obj.get("stop_reason") is None:
                raise Failure("protocol", f"messages answer is not a finished message: {obj}")
            return Answer(["".join(b["text"] for b in obj["content"] if b["type"] == "text")])
        text = ""
        stopped = False
        async with aclosing(self._stream("/v1/messages", body, limit)) as events:
            async for event, obj in events:
                if event == "error" or (obj or {}).get("type") == "error":
                    raise _stream_error((obj or {}).get("error", obj))
                if event == "content_block_delta" and obj["delta"].get("type") == "text_delta":
                    text += obj["delta"]["text"]
                elif event == "message_stop":
                    stopped = True
        if limit is not None and not stopped:
            return Answer([text], complete=False)
        if not stopped:
            raise Failure("protocol", "messages stream ended without message_stop")
        return Answer([text])


def _response_text(response: dict[str, Any]) -> str:
    if response.get("status") not in ("completed", "incomplete"):
        raise Failure("protocol", f"response status {response.get('status')!r}")
    return "".join(
        part.get("text", "")
        for item in response.get("output") or []
        if item.get("type") == "message"
        for part in item.get("content") or []
        if part.get("type") == "output_text"
    )


# ------------------------------------------------------------------------------------ the server


@dataclass
class Server:
    root: str
    pid: int | None
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    command: list[str] | None = None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def start_server(args: argparse.Namespace, log_dir: Path) -> Server:
    extra = shlex.split(args.server_args or "")
    cmd = [sys.executable, "-m", "quickdraft", "serve", "--model", args.model,
           "--host", "127.0.0.1", "--port", "0"]
    if args.draft is not None:
        cmd += ["--draft", args.draft]
    if not _has_flag(extra, "--max-concurrency"):
        cmd += ["--max-concurrency", str(args.clients)]
    if not _has_flag(extra, "--max-context"):
        cmd += ["--max-context", "2048"]  # short prompts: room for every client's lane
    cmd += extra
    log_path = log_dir / "server.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log.close()
    print(f"starting: {shlex.join(cmd)}", flush=True)
    deadline = time.monotonic() + args.start_timeout
    while True:
        text = log_path.read_text(errors="replace")
        found = re.search(r"serving \S+ at (http://\S+)/v1", text)
        if found:
            return Server(_check_loopback(found.group(1)), proc.pid, proc, log_path, cmd)
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            raise SystemExit(f"the server did not start (exit {proc.returncode}):\n{text[-3000:]}")
        time.sleep(0.5)


def _stop(proc: subprocess.Popen[bytes]) -> int | None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    return proc.returncode


def _rss_mb(pid: int | None) -> float | None:
    """RSS of the process and its children (a --pid of a launcher counts the server under it)."""
    if pid is None:
        return None
    try:
        proc = psutil.Process(pid)
        tree = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for p in tree:
        try:
            total += p.memory_info().rss
        except psutil.Error:  # a child that just ended
            pass
    return total / 2**20


async def _metrics(http: httpx.AsyncClient) -> dict[str, float]:
    r = await http.get("/metrics")
    out = {}
    for line in r.text.splitlines():
        found = re.match(r"^(quickdraft_[a-z_]+) (\S+)$", line)
        if found:
            out[found.group(1)] = float(found.group(2))
    return out


# ------------------------------------------------------------------------------------- the soak


class Soak:
    def __init__(self, args: argparse.Namespace, client: Client, server: Server) -> None:
        self.args = args
        self.client = client
        self.server = server
        self.stats = Stats()
        self.refs: dict[tuple[Any, ...], str] = {}
        self.skipped: dict[str, str] = {}
        self.alone_disagree: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.load_start = 0.0

    # -- comparisons

    def compare(self, kind: str, key: tuple[Any, ...], got: str, prefix: bool = False) -> None:
        expected = self.refs.get(key)
        if expected is None:
            return
        self.stats.compared[kind] += 1
        same = (expected.startswith(got) or got.startswith(expected)) if prefix else got == expected
        if not same:
            self.stats.mismatch_count[kind] += 1
            if len(self.stats.mismatches) < MAX_KEPT:
                self.stats.mismatches.append(
                    {"kind": kind, "request": list(key), "alone": expected, "under_load": got}
                )
            if len(self.stats.mismatches) == 1:
                print(f"MISMATCH ({kind}, {key}):\n  alone:      {expected!r}\n"
                      f"  under load: {got!r}", flush=True)

    # -- one request of each kind

    async def request(self, kind: str, rng: random.Random) -> None:
        c = self.client
        p = rng.randrange(len(GREEDY_PROMPTS))
        prompt = GREEDY_PROMPTS[p]
        stream = kind.endswith("_stream")
        if kind in ("chat", "chat_stream"):
            a = await c.chat(c.chat_body(prompt), stream)
            self.compare(kind, ("chat", p), a.texts[0])
        elif kind == "completion":
            i = rng.randrange(len(COMPLETION_PROMPTS))
            self.compare(kind, ("completion", i), (await c.completion(COMPLETION_PROMPTS[i])).texts[0])
        elif kind in ("tools", "tools_stream"):
            i = rng.randrange(len(TOOL_PROMPTS))
            a = await c.chat(c.chat_body(TOOL_PROMPTS[i], tools=[WEATHER_TOOL], tool_choice="auto"),
                             stream)
            self.compare(kind, ("tools", i), a.texts[0])
        elif kind in ("seeded", "seeded_stream"):
            p, seed = rng.randrange(SEEDED_PROMPTS), rng.choice(SEEDS)
            a = await c.chat(c.chat_body(GREEDY_PROMPTS[p], temperature=TEMPERATURE, seed=seed), stream)
            self.compare(kind, ("seeded", p, seed), a.texts[0])
        elif kind in ("n2", "n2_stream"):
            if rng.random() < 0.5:
                a = await c.chat(c.chat_body(prompt, n=2), stream)
                for text in a.texts:
                    self.compare(kind, ("chat", p), text)
            else:
                p, seed = rng.randrange(SEEDED_PROMPTS), rng.choice(N2_SEEDS)
                body = c.chat_body(GREEDY_PROMPTS[p], temperature=TEMPERATURE, seed=seed, n=2)
                a = await c.chat(body, stream)
                for i, text in enumerate(a.texts):
                    self.compare(kind, ("seeded", p, seed + i), text)
        elif kind in ("responses", "responses_stream"):
            self.compare(kind, ("responses", p), (await c.responses(prompt, stream)).texts[0])
        elif kind in ("messages", "messages_stream"):
            self.compare(kind, ("messages", p), (await c.messages(prompt, stream)).texts[0])
        elif kind == "disconnect":
            # a longer answer, so that the client surely leaves while it is being generated
            long = max(4 * c.max_tokens, 128)
            route = rng.choice(("chat", "responses", "messages"))
            if route == "chat":
                a = await c.chat(c.chat_body(prompt, max_tokens=long), True, DISCONNECT_AFTER)
            elif route == "responses":
                a = await c.responses(prompt, True, DISCONNECT_AFTER + 4, long)
            else:
                a = await c.messages(prompt, True, DISCONNECT_AFTER + 4, long)
            self.compare(kind, (route, p), a.texts[0], prefix=True)
        else:
            raise AssertionError(kind)

    async def timed(self, kind: str, make: Callable[[], Awaitable[None]]) -> None:
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(make(), self.args.request_timeout)
        except Failure as exc:
            self._fail(kind, exc.category, exc.message)
        except (TimeoutError, asyncio.TimeoutError):
            self._fail(kind, "timeout", f"no answer in {self.args.request_timeout} s")
        except httpx.HTTPError as exc:
            self._fail(kind, "transport", f"{type(exc).__name__}: {exc}")
        except (KeyError, TypeError, IndexError) as exc:
            self._fail(kind, "protocol", f"unexpected answer shape: {type(exc).__name__}: {exc}")
        else:
            self.stats.ok[kind] += 1
            self.stats.latency[kind].append(time.monotonic() - t0)

    def _fail(self, kind: str, category: str, message: str) -> None:
        self.stats.failed[kind] += 1
        self.stats.failures[category] += 1
        key = f"{kind} {category}: {message[:300]}"
        if key not in self.stats.messages and len(self.stats.messages) < MAX_KEPT:
            print(f"error: {key}", flush=True)
        if key in self.stats.messages or len(self.stats.messages) < MAX_KEPT:
            self.stats.messages[key] += 1

    # -- phases

    async def alone(self) -> None:
        """Every reference request once, one at a time, the server otherwise idle."""
        c = self.client
        jobs: list[tuple[tuple[Any, ...], Callable[[], Awaitable[Answer]]]] = []
        for p, prompt in enumerate(GREEDY_PROMPTS):
            jobs.append((("chat", p), partial(c.chat, c.chat_body(prompt), False)))
            jobs.append((("responses", p), partial(c.responses, prompt, False)))
            jobs.append((("messages", p), partial(c.messages, prompt, False)))
        for i, prompt in enumerate(COMPLETION_PROMPTS):
            jobs.append((("completion", i), partial(c.completion, prompt)))
        for p in range(SEEDED_PROMPTS):
            for seed in SEEDS:
                body = c.chat_body(GREEDY_PROMPTS[p], temperature=TEMPERATURE, seed=seed)
                jobs.append((("seeded", p, seed), partial(c.chat, body, False)))
        for i, prompt in enumerate(TOOL_PROMPTS):
            body = c.chat_body(prompt, tools=[WEATHER_TOOL], tool_choice="auto")
            jobs.append((("tools", i), partial(c.chat, body, False)))
        for key, call in jobs:
            if key[0] == "tools" and "tools" in self.skipped:
                continue
            try:
                answer = await asyncio.wait_for(call(), self.args.request_timeout)
            except Failure as exc:
                if key[0] == "tools" and exc.message.startswith("400 ") and "tools" in exc.message:
                    self.skipped["tools"] = exc.message  # the model's template has no tools
                    continue
                raise SystemExit(f"the alone request {key} failed: {exc.category}: {exc.message}") from None
            self.refs[key] = answer.texts[0]
        for p in range(len(GREEDY_PROMPTS)):
            chat = self.refs[("chat", p)]
            for route in ("responses", "messages"):
                if self.refs[(route, p)] != chat:
                    self.alone_disagree.append({"prompt": p, "route": route, "chat": chat,
                                                "other": self.refs[(route, p)]})
        print(f"alone: {len(self.refs)} reference answers"
              + (f"; skipped tools ({self.skipped['tools'][:120]})" if self.skipped else "")
              + (f"; {len(self.alone_disagree)} Responses/Messages answers differ from chat's"
                 if self.alone_disagree else ""), flush=True)

    async def sample(self, http: httpx.AsyncClient) -> dict[str, Any]:
        try:
            metrics = await _metrics(http)
        except httpx.HTTPError:
            metrics = {}
        s = {
            "t_s": round(time.monotonic() - self.load_start, 1),
            "rss_mb": _round(_rss_mb(self.server.pid)),
            "prefix_cache_mb": _round(metrics.get("quickdraft_prefix_cache_bytes", 0) / 2**20),
            "prefix_cache_entries": metrics.get("quickdraft_prefix_cache_entries"),
            "running": metrics.get("quickdraft_requests_running"),
            "waiting": metrics.get("quickdraft_requests_waiting"),
            "requests": self.stats.requests,
            "errors": self.stats.errors,
        }
        self.samples.append(s)
        return s

    async def monitor(self, http: httpx.AsyncClient, stop: asyncio.Event) -> None:
        last_print = time.monotonic()
        for _ in range(1_000_000):  # bounded: ends with the load (or is cancelled at the deadline)
            try:
                await asyncio.wait_for(stop.wait(), self.args.sample_every)
                return
            except (TimeoutError, asyncio.TimeoutError):
                pass
            s = await self.sample(http)
            if time.monotonic() - last_print >= self.args.progress_every:
                last_print = time.monotonic()
                mism = sum(self.stats.mismatch_count.values())
                print(f"[{s['t_s']:6.0f} s] {s['requests']} requests, {s['errors']} errors, "
                      f"{mism} mismatches, running {s['running']}, waiting {s['waiting']}, "
                      f"RSS {s['rss_mb']} MB, prefix cache {s['prefix_cache_mb']} MB", flush=True)

    async def run_client(self, index: int, stop_at: float) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        offset = index * len(SCHEDULE) // max(self.args.clients, 1)
        for n in range(self.args.max_requests_per_client):
            if time.monotonic() >= stop_at:
                return
            kind = SCHEDULE[(offset + n) % len(SCHEDULE)]
            if kind.startswith("tools") and "tools" in self.skipped:
                continue
            await self.timed(kind, partial(self.request, kind, rng))

    async def load(self, http: httpx.AsyncClient) -> float:
        """The clients until --duration (or their request counts); returns the load's wall time."""
        args = self.args
        self.load_start = time.monotonic()
        stop_at = self.load_start + args.duration
        hard = stop_at + args.request_timeout + 30
        stop = asyncio.Event()
        monitor = asyncio.ensure_future(self.monitor(http, stop))
        clients = [asyncio.ensure_future(self.run_client(i, stop_at)) for i in range(args.clients)]
        _, pending = await asyncio.wait(clients, timeout=max(0.0, hard - time.monotonic()))
        wall = time.monotonic() - self.load_start
        for task in pending:  # past the hard deadline: a request hangs
            task.cancel()
        self.stats.hung = len(pending)
        if pending:
            print(f"error: {len(pending)} clients still waiting at the hard deadline", flush=True)
            await asyncio.wait(pending, timeout=10)
        for task in clients:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]  # a bug of this script
        stop.set()
        await asyncio.wait_for(monitor, 30)
        return wall

    async def idle_after(self, http: httpx.AsyncClient) -> dict[str, float]:
        """/metrics once the server has nothing running or waiting (10 s at most)."""
        metrics: dict[str, float] = {}
        for _ in range(40):
            metrics = await _metrics(http)
            if not metrics.get("quickdraft_requests_running") and not metrics.get(
                "quickdraft_requests_waiting"
            ):
                break
            await asyncio.sleep(0.25)
        return metrics

    async def again_alone(self) -> None:
        """The greedy chat prompts alone again, the load over: still the alone answers."""

        async def one(p: int) -> None:
            a = await self.client.chat(self.client.chat_body(GREEDY_PROMPTS[p]), False)
            self.compare("alone_after", ("chat", p), a.texts[0])

        for p in range(len(GREEDY_PROMPTS)):
            await self.timed("alone_after", partial(one, p))


def _round(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)


def _rss_start(samples: list[dict[str, Any]], warmup: float) -> dict[str, Any] | None:
    later = [s for s in samples if s["rss_mb"] is not None and s["t_s"] >= warmup]
    return later[0] if later else None


def _growth(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None or start <= 0 else 100 * (end - start) / start


async def run_soak(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """The whole soak (server start to stop); prints the figures, saves them as JSON and returns
    them."""
    from quickdraft.bench.report import environment

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.endpoint:
        server = Server(_check_loopback(args.endpoint), args.pid)
    else:
        server = start_server(args, Path(tempfile.mkdtemp(prefix="quickdraft-soak-")))
    exit_code = None
    try:
        limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
        timeout = httpx.Timeout(args.request_timeout, connect=10.0)
        async with httpx.AsyncClient(base_url=server.root, headers=headers, timeout=timeout,
                                     limits=limits, trust_env=False) as http:
            for _ in range(600):
                try:
                    if (await http.get("/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
            models = (await http.get("/v1/models")).json()["data"]
            model = models[0]["id"]
            soak = Soak(args, Client(http, model, args.max_tokens), server)
            load_average = [os.getloadavg()]
            t0 = time.monotonic()
            await soak.alone()
            alone_s = time.monotonic() - t0
            print(f"load: {args.clients} clients for {args.duration:.0f} s "
                  f"(RSS from {args.warmup:.0f} s on)", flush=True)
            wall = await soak.load(http)
            metrics = await soak.idle_after(http)
            end = await soak.sample(http)
            await soak.again_alone()
            load_average.append(os.getloadavg())
    finally:
        if server.proc is not None:
            exit_code = _stop(server.proc)
    log = server.log_text()
    report = _report(args, argv, soak, server, model, wall, alone_s, end, metrics, log, exit_code,
                     environment())
    # the machine's other work slows the answers (not the checks): 1/5/15-minute load averages
    report["environment"]["load_average"] = {"before": load_average[0], "after": load_average[-1]}
    out = Path(args.out_dir) / f"{args.name or _default_name(args, model)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if server.log_path is not None and report["verdict"] == "PASS":  # the log is kept for a FAIL
        shutil.rmtree(server.log_path.parent, ignore_errors=True)
        report["server"]["log"] = None
    out.write_text(json.dumps(report, indent=1))
    print_report(report)
    print(f"saved {out}", flush=True)
    return report


def _report(args: argparse.Namespace, argv: list[str], soak: Soak, server: Server, model: str,
            wall: float, alone_s: float, end: dict[str, Any], metrics: dict[str, float], log: str,
            exit_code: int | None, env: dict[str, Any]) -> dict[str, Any]:
    st = soak.stats
    start = _rss_start(soak.samples[:-1], args.warmup) or end
    rss0, rss1 = start["rss_mb"], end["rss_mb"]
    pc0, pc1 = start["prefix_cache_mb"] or 0.0, end["prefix_cache_mb"] or 0.0
    growth = _growth(rss0, rss1)
    net = _growth(rss0, None if rss1 is None else rss1 - (pc1 - pc0))
    rss_values = [s["rss_mb"] for s in soak.samples if s["rss_mb"] is not None]
    tracebacks = log.count("Traceback")
    status_5xx = st.failures["5xx"]
    server_errors = status_5xx + st.failures["stream_server_error"] + tracebacks
    other_errors = st.errors - status_5xx - st.failures["stream_server_error"]
    mismatches = sum(st.mismatch_count.values())
    idle = not metrics.get("quickdraft_requests_running") and not metrics.get(
        "quickdraft_requests_waiting"
    )
    checks = {
        "no response >= 500, server error mid-stream or traceback": server_errors == 0,
        "no other error (4xx, transport, timeout, malformed, hung)": other_errors == 0,
        "every greedy / seeded answer identical to alone": mismatches == 0,
        "server idle after the load": idle,
        f"RSS growth net of the prefix cache <= {args.max_rss_growth}%": (
            net is not None and net <= args.max_rss_growth
        ),
    }
    if net is None:
        checks["RSS not measured (no pid: pass --pid with --endpoint)"] = False
    clean_exit = exit_code in CLEAN_EXIT
    if server.proc is not None:  # uvicorn exits by the SIGTERM it caught once it has shut down
        checks["server stopped on SIGTERM within 30 s"] = clean_exit
    by_kind = {
        k: {
            "ok": st.ok[k],
            "failed": st.failed[k],
            "compared_with_alone": st.compared[k],
            "mismatches": st.mismatch_count[k],
            "mean_s": _round(statistics.fmean(st.latency[k]), 3) if st.latency[k] else None,
            "max_s": _round(max(st.latency[k]), 3) if st.latency[k] else None,
        }
        for k in (*KINDS, "alone_after")
        if st.ok[k] or st.failed[k]
    }
    report = {
        "command": ["benchmarks/soak.py", *argv],
        "settings": {k: v for k, v in vars(args).items() if k != "api_key"},
        "environment": env,
        "model": model,
        "server_command": server.command,
        "endpoint": server.root,
        "alone_phase_s": round(alone_s, 1),
        "load_wall_s": round(wall, 1),
        "requests": {
            "served": sum(st.ok[k] for k in KINDS),
            "failed": sum(st.failed[k] for k in KINDS),
            "per_second": round(sum(st.ok[k] for k in KINDS) / wall, 3) if wall else None,
            "by_kind": by_kind,
            "skipped_kinds": soak.skipped,
        },
        "errors": {
            "status_5xx": status_5xx,
            "server_errors_mid_stream": st.failures["stream_server_error"],
            "server_log_tracebacks": tracebacks,
            "other": other_errors,
            "hung_clients": st.hung,
            "by_category": dict(st.failures),
            "messages": dict(st.messages),
        },
        "identical_to_alone": {
            "references": len(soak.refs),
            "compared": sum(st.compared.values()),
            "greedy_compared": sum(v for k, v in st.compared.items() if not k.startswith("seeded")),
            "seeded_compared": st.compared["seeded"] + st.compared["seeded_stream"],
            "mismatches": mismatches,
            "first_mismatches": st.mismatches,
            "responses_messages_differ_from_chat_alone": soak.alone_disagree,
            "alone_answers": {"/".join(map(str, k)): v for k, v in soak.refs.items()},
        },
        "rss": {
            "pid": server.pid,
            "start_mb": rss0,
            "start_t_s": start["t_s"],
            "end_t_s": end["t_s"],
            "end_mb": rss1,
            "peak_mb": max(rss_values) if rss_values else None,
            "growth_pct": _round(growth, 2),
            "prefix_cache_start_mb": pc0,
            "prefix_cache_end_mb": pc1,
            "growth_net_of_prefix_cache_pct": _round(net, 2),
            "samples": soak.samples,
        },
        "server": {
            "idle_after_load": idle,
            "metrics_after_load": metrics,
            "exit_code": exit_code,
            "log_tail": log[-4000:] if tracebacks or not clean_exit else None,
            "log": str(server.log_path) if server.log_path else None,  # kept when FAIL
        },
        "checks": checks,
        "verdict": "PASS" if all(checks.values()) else "FAIL",
    }
    return report


def print_report(report: dict[str, Any]) -> None:
    r = report["requests"]
    print(f"\n{report['model']}: {r['served']} requests served in {report['load_wall_s']} s "
          f"({r['per_second']}/s), {r['failed']} failed")
    for kind, k in r["by_kind"].items():
        print(f"  {kind:17} {k['ok']:6} ok {k['failed']:4} failed  {k['compared_with_alone']:6} "
              f"compared {k['mismatches']:3} mismatches  mean {k['mean_s']} s  max {k['max_s']} s")
    for kind, why in r["skipped_kinds"].items():
        print(f"  {kind:17} skipped: {why[:150]}")
    e = report["errors"]
    print(f"status >= 500: {e['status_5xx']}; server errors mid-stream: "
          f"{e['server_errors_mid_stream']}; tracebacks in the server log: "
          f"{e['server_log_tracebacks']}; other errors: {e['other']} (hung clients {e['hung_clients']})")
    for message, count in e["messages"].items():
        print(f"  {count} x {message}")
    i = report["identical_to_alone"]
    print(f"identical to alone: {i['compared'] - i['mismatches']}/{i['compared']} "
          f"(greedy {i['greedy_compared']}, seeded {i['seeded_compared']}; "
          f"{i['references']} alone answers)")
    if i["first_mismatches"]:
        m = i["first_mismatches"][0]
        print(f"  first mismatch ({m['kind']}, {m['request']}):\n    alone:      {m['alone']!r}\n"
              f"    under load: {m['under_load']!r}")
    for d in i["responses_messages_differ_from_chat_alone"]:
        print(f"  alone, prompt {d['prompt']}: {d['route']} gave {d['other']!r}, chat {d['chat']!r}")
    m = report["rss"]
    print(f"RSS: {m['start_mb']} MB at {m['start_t_s']} s -> {m['end_mb']} MB at the end "
          f"({m['growth_pct']}%; peak {m['peak_mb']} MB); prefix cache {m['prefix_cache_start_mb']} "
          f"-> {m['prefix_cache_end_mb']} MB; net of it {m['growth_net_of_prefix_cache_pct']}%")
    s = report["server"]
    if s["log"]:
        print(f"server log: {s['log']}")
    print(f"server idle after the load: {s['idle_after_load']} (cancelled "
          f"{s['metrics_after_load'].get('quickdraft_requests_cancelled_total')}, failed "
          f"{s['metrics_after_load'].get('quickdraft_requests_failed_total')})")
    for check, ok in report["checks"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {check}")
    print(report["verdict"], flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=f"model to serve (default: {DEFAULT_MODEL})")
    ap.add_argument("--draft", default=None, help="--draft for quickdraft serve (default: its default)")
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients (default: 16)")
    ap.add_argument("--duration", type=float, default=600, help="seconds of load (default: 600)")
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds of load before the start RSS (default: min(60, duration / 5))")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (default: 48)")
    ap.add_argument("--endpoint", default=None,
                    help="a running server, http://127.0.0.1:PORT (default: start one)")
    ap.add_argument("--pid", type=int, default=None, help="with --endpoint: the server's pid, for RSS")
    ap.add_argument("--api-key", default=os.environ.get("QUICKDRAFT_API_KEY"),
                    help="with --endpoint: the server's key (default: $QUICKDRAFT_API_KEY)")
    ap.add_argument("--name", default=None,
                    help="result file name (default: MODEL-Nc-Ds, the served model's name with --endpoint)")
    ap.add_argument("--out-dir", default=str(RESULTS), help="where the JSON goes")
    ap.add_argument("--server-args", default="",
                    help="extra arguments for quickdraft serve, one string (e.g. '--threads 2')")
    ap.add_argument("--seed", type=int, default=0, help="seeds the clients' choices (default: 0)")
    ap.add_argument("--request-timeout", type=float, default=180, help="seconds per request")
    ap.add_argument("--max-requests-per-client", type=int, default=100_000)
    ap.add_argument("--start-timeout", type=float, default=900,
                    help="seconds for the server to start (a first start builds kernels)")
    ap.add_argument("--sample-every", type=float, default=5, help="seconds between RSS samples")
    ap.add_argument("--progress-every", type=float, default=30, help="seconds between progress lines")
    ap.add_argument("--max-rss-growth", type=float, default=5.0, help="percent (default: 5)")
    args = ap.parse_args(argv)
    if args.clients < 1 or args.duration <= 0 or args.max_tokens < 1:
        ap.error("--clients, --duration and --max-tokens must be positive")
    if args.endpoint:
        _check_loopback(args.endpoint)
        if args.model or args.draft or args.server_args:
            ap.error("--model, --draft and --server-args are for a server this script starts")
    elif args.pid is not None:
        ap.error("--pid goes with --endpoint (a server this script starts is measured by its pid)")
    else:
        args.model = args.model or DEFAULT_MODEL
    if args.warmup is None:
        args.warmup = min(60.0, args.duration / 5)
    return args


def _default_name(args: argparse.Namespace, served: str) -> str:
    model = Path(args.model or served).name.removesuffix(".gguf")
    return f"{model}-{args.clients}c-{args.duration:g}s"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    report = asyncio.run(run_soak(parse_args(argv), argv))
    return 0 if report["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
