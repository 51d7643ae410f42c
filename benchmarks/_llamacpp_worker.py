"""llama.cpp side of benchmarks/vs_llamacpp.py: a JSON-lines server on stdin/stdout.

Runs inside its own virtual environment (the one holding ``llama-cpp-python``), never inside
quickdraft's: llama.cpp is a benchmark opponent, not a dependency. The parent sends one JSON object
per line and waits for the one-line answer before it does anything else, so the two engines never
compute at the same time. Every answer is ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``;
the first line, sent unasked, says whether ``llama_cpp`` could be imported.

Commands:

- ``{"cmd": "load", "model": PATH, "n_ctx": N, "n_threads": T, "n_batch": B, "flash_attn": "auto"}``
- ``{"cmd": "pass_times", "context": [ids], "tokens": [ids], "rows": [1, 2], "repeats": R}``: the
  context is decoded once (and again only when it changes); each pass then decodes ``tokens[:r]``
  right after it with logits for every row, like a speculative verification pass, is timed, and
  is removed from the KV cache again. Answer: ``{"seconds": {"1": [...], "2": [...]}}``.
- ``{"cmd": "prefill_times", "tokens": [ids], "repeats": R}``: each repeat empties the KV cache
  and decodes ``tokens`` in n_batch chunks (logits for the last row only), as a prompt is
  prefilled, timed. Answer: ``{"seconds": [...]}``.
- ``{"cmd": "generate", "prompt": [ids], "max_tokens": N, "stop_ids": [ids]}``: greedy decoding
  (argmax of the logits, what temperature 0 means), one token per decode call, each token turned
  into text as a streaming client would. Answer: token ids, finish reason, and seconds from the
  request's start to when each token was ready.
- ``{"cmd": "quit"}``

The low-level ``llama_cpp`` API is used (not ``Llama``): no Python-side copies of logits or
sampler chains are timed, only llama.cpp's own decode.

Only the standard library and numpy (a llama-cpp-python dependency) are imported at module level,
so the protocol loop can be tested from quickdraft's environment with a fake engine.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, Any, Protocol

FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # enum llama_flash_attn_type


class Engine(Protocol):
    def info(self) -> dict[str, Any]: ...

    def pass_times(
        self, context: Sequence[int], tokens: Sequence[int], rows: Sequence[int], repeats: int
    ) -> dict[str, list[float]]: ...

    def prefill_times(self, tokens: Sequence[int], repeats: int) -> list[float]: ...

    def generate(
        self, prompt: Sequence[int], max_tokens: int, stop_ids: Sequence[int]
    ) -> dict[str, Any]: ...

    def close(self) -> None: ...


class LlamaCppEngine:
    """One model and one context, driven through llama.cpp's C API."""

    def __init__(
        self, model: str, n_ctx: int, n_threads: int, n_batch: int, flash_attn: str = "auto"
    ) -> None:
        import llama_cpp as lc
        import numpy as np

        self.lc, self.np = lc, np
        if flash_attn not in FLASH_ATTN:
            raise ValueError(
                f"flash_attn must be one of {', '.join(FLASH_ATTN)}, got {flash_attn!r}"
            )
        if not os.path.isfile(model):
            raise ValueError(f"no such model file: {model}")
        lc.llama_backend_init()
        t0 = time.perf_counter()
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(model.encode(), mparams)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {model} (see the worker log)")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_threads = cparams.n_threads_batch = n_threads
        cparams.flash_attn_type = FLASH_ATTN[flash_attn]
        cparams.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise ValueError(f"llama.cpp could not create a context of {n_ctx} tokens")
        self.load_seconds = time.perf_counter() - t0
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.mem = lc.llama_get_memory(self.ctx)
        self.n_ctx, self.n_batch, self.n_threads = n_ctx, n_batch, n_threads
        self.flash_attn = flash_attn
        self.batch = lc.llama_batch_init(n_batch, 0, 1)
        self.piece = ctypes.create_string_buffer(256)
        self.context: list[int] | None = None  # what the KV cache holds for pass_times

    def info(self) -> dict[str, Any]:
        lc = self.lc
        return {
            "llama_cpp_python": getattr(lc, "__version__", None),
            "system_info": lc.llama_print_system_info().decode("utf-8", "replace").strip(),
            "load_seconds": self.load_seconds,
            "n_vocab": self.n_vocab,
            "n_ctx": self.n_ctx,
            "n_batch": self.n_batch,
            "n_threads": self.n_threads,
            "flash_attn": self.flash_attn,
        }

    # -- decoding helpers

    def _fill(self, ids: Sequence[int], start: int, all_logits: bool) -> None:
        """Put ``ids`` at positions start.. into the batch (len(ids) <= n_batch)."""
        b = self.batch
        n = len(ids)
        for i, token in enumerate(ids):
            b.token[i] = token
            b.pos[i] = start + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1 if all_logits or i == n - 1 else 0
        b.n_tokens = n

    def _run(self) -> None:
        """Decode the batch in one llama_decode call and wait until it is done."""
        rc = self.lc.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for {self.batch.n_tokens} tokens")
        self.lc.llama_synchronize(self.ctx)

    def _decode(self, ids: Sequence[int], start: int, all_logits: bool) -> None:
        self._fill(ids, start, all_logits)
        self._run()

    def _prefill(self, ids: Sequence[int]) -> None:
        """Empty the KV cache and decode ``ids`` in n_batch chunks (logits for the last one only)."""
        if len(ids) + 1 > self.n_ctx:
            raise ValueError(f"{len(ids)} tokens do not fit a context of {self.n_ctx}")
        self.lc.llama_memory_clear(self.mem, True)
        self.context = None
        for s in range(0, len(ids), self.n_batch):
            self._decode(ids[s : s + self.n_batch], s, all_logits=False)

    def _argmax_last(self) -> int:
        ptr = self.lc.llama_get_logits_ith(self.ctx, -1)
        return int(self.np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def _to_text(self, token: int) -> bytes:
        n = self.lc.llama_token_to_piece(self.vocab, token, self.piece, len(self.piece), 0, False)
        return self.piece.raw[: max(n, 0)]

    # -- commands

    def pass_times(
        self, context: Sequence[int], tokens: Sequence[int], rows: Sequence[int], repeats: int
    ) -> dict[str, list[float]]:
        if max(rows) > min(len(tokens), self.n_batch):
            raise ValueError(f"{max(rows)} rows need as many tokens and n_batch >= {max(rows)}")
        if list(context) != self.context:
            self._prefill(context)
            self.context = list(context)
        n = len(context)
        out: dict[str, list[float]] = {str(r): [] for r in rows}
        for _ in range(repeats):
            for r in rows:
                self._fill(tokens[:r], n, all_logits=True)  # not timed: Python, not llama.cpp
                t0 = time.perf_counter()
                self._run()
                out[str(r)].append(time.perf_counter() - t0)
                self.lc.llama_memory_seq_rm(self.mem, 0, n, -1)  # back to the bare context
        return out

    def prefill_times(self, tokens: Sequence[int], repeats: int) -> list[float]:
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self._prefill(tokens)
            out.append(time.perf_counter() - t0)
        return out

    def generate(
        self, prompt: Sequence[int], max_tokens: int, stop_ids: Sequence[int]
    ) -> dict[str, Any]:
        if len(prompt) + max_tokens > self.n_ctx:
            raise ValueError(
                f"{len(prompt)} prompt + {max_tokens} new tokens exceed the context of {self.n_ctx}"
            )
        stops = set(stop_ids)
        t_start = time.perf_counter()
        self._prefill(prompt)
        tokens: list[int] = []
        times: list[float] = []
        finish = "length"
        while True:
            token = self._argmax_last()
            self._to_text(token)
            tokens.append(token)
            times.append(time.perf_counter() - t_start)
            if token in stops:
                finish = "stop"
                break
            if len(tokens) >= max_tokens:
                break
            self._decode([token], len(prompt) + len(tokens) - 1, all_logits=False)
        return {"token_ids": tokens, "token_times": times, "finish_reason": finish}

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)


# -- the protocol loop (pure: no llama_cpp needed)

EngineFactory = Callable[..., Engine]


def _ints(req: dict[str, Any], key: str) -> list[int]:
    value = req.get(key)
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise ValueError(f"{key!r} must be a list of integers")
    return value


def handle(req: dict[str, Any], state: dict[str, Any], factory: EngineFactory) -> dict[str, Any]:
    """Answer one request; ``state["engine"]`` holds the loaded engine between requests."""
    cmd = req.get("cmd")
    engine: Engine | None = state.get("engine")
    if cmd == "load":
        if engine is not None:
            engine.close()
            state["engine"] = None
        engine = factory(
            str(req["model"]),
            int(req["n_ctx"]),
            int(req["n_threads"]),
            int(req["n_batch"]),
            str(req.get("flash_attn", "auto")),
        )
        state["engine"] = engine
        return {"ok": True, "info": engine.info()}
    if cmd == "quit":
        if engine is not None:
            engine.close()
            state["engine"] = None
        state["quit"] = True
        return {"ok": True}
    if cmd not in ("pass_times", "prefill_times", "generate"):
        return {"ok": False, "error": f"unknown command {cmd!r}"}
    if engine is None:
        return {"ok": False, "error": f"{cmd!r} before 'load'"}
    if cmd == "pass_times":
        rows = _ints(req, "rows")
        if not rows or min(rows) < 1:
            raise ValueError("'rows' must be a non-empty list of positive integers")
        seconds = engine.pass_times(
            _ints(req, "context"), _ints(req, "tokens"), rows, int(req.get("repeats", 1))
        )
        return {"ok": True, "seconds": seconds}
    if cmd == "prefill_times":
        tokens = _ints(req, "tokens")
        if not tokens:
            raise ValueError("'tokens' must not be empty")
        return {"ok": True, "seconds": engine.prefill_times(tokens, int(req.get("repeats", 1)))}
    result = engine.generate(_ints(req, "prompt"), int(req["max_tokens"]), _ints(req, "stop_ids"))
    return {"ok": True, **result}


def serve(inp: IO[str], out: IO[str], factory: EngineFactory, hello: dict[str, Any]) -> int:
    """Answer requests line by line until 'quit' or the end of input; returns the exit status."""

    def send(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    send(hello)
    if not hello.get("ok"):
        return 1
    state: dict[str, Any] = {}
    for line in inp:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if not isinstance(req, dict):
                raise ValueError("a request must be a JSON object")
            reply = handle(req, state, factory)
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        send(reply)
        if state.get("quit"):
            return 0
    if state.get("engine") is not None:
        state["engine"].close()
    return 0


def main() -> int:
    # The protocol owns the real stdout; anything else printing to fd 1 (C code included) goes to
    # stderr instead, so it cannot corrupt the JSON lines.
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        import llama_cpp
        from llama_cpp._logger import set_verbose

        set_verbose(bool(os.environ.get("QUICKDRAFT_LLAMACPP_VERBOSE")))  # else errors only
        hello: dict[str, Any] = {
            "ok": True,
            "llama_cpp_python": getattr(llama_cpp, "__version__", None),
            "python": sys.version.split()[0],
        }
    except Exception as exc:  # an ImportError, or a shared library that does not load
        hello = {"ok": False, "error": f"cannot import llama_cpp: {type(exc).__name__}: {exc}"}
    return serve(sys.stdin, proto, LlamaCppEngine, hello)


if __name__ == "__main__":
    sys.exit(main())
