"""A real ``quickdraft serve`` process on loopback for the server and agent tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

NAME = "smollm2"
KEY = "test-key-123"
CONTEXT = 512


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str  # .../v1
    log: list[str]

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=api_key, max_retries=0, timeout=120)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.root}/metrics", headers=_auth(KEY)).text
        found = re.search(rf"^{name} (\S+)$", text, re.M)
        assert found, f"{name} not in /metrics"
        return float(found.group(1))


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def start_server(model: Path, *extra: str, name: str = NAME, context: int = CONTEXT) -> Server:
    cmd = [
        sys.executable,
        "-m",
        "quickdraft",
        "serve",
        "--model",
        str(model),
        "--served-model-name",
        name,
        "--dtype",
        "float32",
        "--max-context",
        str(context),
        "--threads",
        "1",
        "--port",
        "0",
        *extra,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    log: list[str] = []
    url: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)
            found = re.search(r"serving \S+ at (http://\S+/v1)", line)
            if found:
                url.append(found.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    ready.wait(300)  # a first start may build the CPU kernels (~80 s on 2 cores)
    assert url, "the server did not start:\n" + "".join(log)
    return Server(proc, url[0], log)


def stop_server(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(30)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()




@contextmanager
def running(*servers: Server, ready_s: float = 120) -> Iterator[None]:
    """Wait until every server answers /health, run the block, then stop them and check that
    none logged a traceback."""
    for s in servers:
        deadline = time.time() + ready_s
        while httpx.get(f"{s.root}/health", timeout=60).status_code != 200:
            assert time.time() < deadline, f"{s.url} did not become healthy"
            time.sleep(0.1)
    try:
        yield
    finally:
        for s in servers:
            stop_server(s)
    for s in servers:
        assert "Traceback" not in "".join(s.log), "".join(s.log)
