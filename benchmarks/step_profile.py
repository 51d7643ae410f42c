"""Where a decode step's time goes: every native kernel call timed by name, the family's one-call layer
stack (where it runs) as one line, the rest (Python and torch ops between the kernels) by difference.

    .venv/bin/python benchmarks/step_profile.py MODEL [--tokens 32]

MODEL: any model quickdraft loads (a .gguf, a folder, a zoo name). Plain greedy decoding of
``--tokens`` tokens after a 64-token prompt, after a warm-up request; prints ms a step per kernel
(with calls a step) and the share the kernels take. Wrapping each call costs ~1 us: a profile, not a
benchmark (see benchmarks/gguf_archs.py for speed against llama.cpp).
"""

from __future__ import annotations

import argparse
import collections
import time
import types
from typing import Any
from unittest import mock

from quickdraft.engine import Engine
from quickdraft.loading.load import load_model
from quickdraft.models.native import NativePass, NativeStack
from quickdraft.quant import ggml
from quickdraft.sampling import SamplingParams


class Timed(types.ModuleType):
    """The kernel module with every public function's wall time summed by name."""

    def __init__(self, module: types.ModuleType) -> None:
        super().__init__(module.__name__)
        self.module = module
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.module, name)
        if not callable(fn) or name.startswith("_"):
            return fn

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1
        return timed


STACK = "layer stack (one call)"


class TimedPass:
    """A native layer stack whose ``run`` calls add to ``timed`` (under STACK)."""

    def __init__(self, stack: NativePass, timed: Timed) -> None:
        self.stack, self.timed = stack, timed

    def run(self, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.stack.run(*args)
        finally:
            self.timed.seconds[STACK] += time.perf_counter() - t0
            self.timed.calls[STACK] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    loaded = load_model(args.model, max_context=1024)
    module = ggml.active_kernels()
    if module is None:
        raise SystemExit("the native kernels are not built here (or QUICKDRAFT_KERNELS=ref): nothing to profile")
    timed = Timed(module)
    ggml._kernels.load = lambda: timed  # every caller reaches the kernels through this
    stack_of = NativeStack.get

    def timed_stack(self: NativeStack, x: Any) -> TimedPass | None:
        stack = stack_of(self, x)
        return None if stack is None else TimedPass(stack, timed)

    with mock.patch.object(NativeStack, "get", timed_stack):  # (a profiler's wrapper, for this run only)
        profile(Engine(loaded.model, loaded.tokenizer), timed, args)


def profile(engine: Engine, timed: Timed, args: argparse.Namespace) -> None:
    """Times ``--tokens`` greedy steps after a 64-token prompt (and a 4-token warm-up) and prints where
    they went."""
    prompt = list(range(10, 74))

    def run(n: int) -> tuple[float, int]:
        steps = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n + 1, ignore_eos=True), None, 0)
        next(steps)
        timed.seconds.clear()
        timed.calls.clear()
        t0, k = time.perf_counter(), 0
        for s in steps:
            k += len(s.token_ids)
        return (time.perf_counter() - t0) / k, k

    run(4)
    step, k = run(args.tokens)
    print(f"{args.model}: {step * 1e3:.2f} ms a step ({k} tokens)")
    total = 0.0
    for name, sec in sorted(timed.seconds.items(), key=lambda kv: -kv[1]):
        print(f"  {name:22s} {sec / k * 1e3:7.2f} ms  {timed.calls[name] / k:5.1f} calls")
        total += sec
    print(f"  {'kernels':22s} {total / k * 1e3:7.2f} ms = {total / k / step:.0%};  the rest {(step - total / k) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
