"""The Python API, in the spirit of vLLM's ``LLM(...).generate(prompts, SamplingParams(...))``.

    from quickdraft import LLM, SamplingParams
    llm = LLM("qwen2.5-coder-1.5b-instruct")
    out = llm.generate(["def fib(n):"], SamplingParams(max_tokens=64))[0]
    for step in llm.stream_chat([{"role": "user", "content": "Hi"}]):
        print(step.text, end="", flush=True)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from quickdraft.assemble.drafters import build_drafter
from quickdraft.config import (
    DEFAULT_MAX_CONCURRENCY,
    prefix_cache_bytes,
    resolve_device,
)
from quickdraft.engine import Engine, RequestStats, StepOutput, runtime_warning
from quickdraft.errors import QuickdraftError
from quickdraft.kernels.tuning import tune as tune_kernels
from quickdraft.loading.load import LoadedModel, load_model
from quickdraft.models.causal_lm import CausalLM
from quickdraft.options import EngineOptions
from quickdraft.prefix_cache import PrefixCache
from quickdraft.sampling import SamplingParams

Prompt = str | Sequence[int]
Messages = list[dict[str, str]]


@dataclass
class RequestOutput:
    prompt: Prompt | Messages
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: RequestStats


def configure_threads(threads: int | None) -> int:
    """Use ``threads`` compute threads, else OMP_NUM_THREADS (as torch itself does: a caller that
    runs several processes side by side gives each its share), else one per physical core
    (hyper-threads slow matmuls down); set once."""
    n = threads or _omp_threads() or psutil.cpu_count(logical=False) or torch.get_num_threads()
    if n < 1:
        raise QuickdraftError(f"--threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    return n


def _omp_threads() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise QuickdraftError(f"OMP_NUM_THREADS must be a whole number >= 1, got {value!r} (or unset it)")
    return int(value)


class LLM:
    """A loaded target model (and drafter) ready to generate, one request at a time."""

    def __init__(
        self,
        model: str = "qwen2.5-coder-1.5b-instruct",
        options: EngineOptions | None = None,
        *,
        log: Callable[[str], None] | None = None,
        **changes: Any,
    ) -> None:
        """Load ``model`` (zoo name, .gguf, folder or hub id) and its drafter with ``options``
        (:class:`~quickdraft.options.EngineOptions`; default: its defaults), changed by any of its
        fields given as keywords: ``LLM(model, draft="ngram", max_context=4096)``. ``log``: where
        progress and the start-up lines go (None: nowhere)."""
        opts = (options or EngineOptions()).replace(**changes)  # checked before loading anything
        self.options = opts
        self.threads = configure_threads(opts.threads)
        budget = prefix_cache_bytes(opts.prefix_cache_mb, psutil.virtual_memory().total)
        where = resolve_device(opts.device)
        if opts.tensor_parallel > 1:  # ranks share the cores; under torchrun, ranks > 0 stay in here
            from quickdraft.parallel.launch import load_tensor_parallel

            self.threads = configure_threads(max(1, self.threads // opts.tensor_parallel))
            self.target: LoadedModel = load_tensor_parallel(
                model, opts.tensor_parallel, opts.dtype, max_context=opts.max_context, threads=self.threads
            )
        else:
            self.target = load_model(model, dtype=opts.dtype, device=str(where), max_context=opts.max_context,
                                     kv_dtype=opts.kv_dtype)
        self.tokenizer = self.target.tokenizer
        self.prefix_cache = PrefixCache(budget)
        lanes = opts.max_concurrency
        if lanes is None:
            lanes = 1 if opts.tensor_parallel > 1 else auto_concurrency(self.target.model, psutil.virtual_memory().total)
        self.engine = Engine(self.target.model, self.tokenizer, cuda_graphs=opts.cuda_graphs,
                             warn=log or runtime_warning, prefix_cache=self.prefix_cache, max_sequences=lanes)
        if log is not None:
            log(describe_memory(self.engine, self.prefix_cache))
        if opts.tensor_parallel == 1:
            self.engine.warm_up()
            if where.type == "cpu":  # this machine's fastest exact kernels, before pass costs are measured
                choice = tune_kernels(self.target.model, self.target.path, log or (lambda _msg: None))
                if choice is not None and log is not None:
                    log(choice.line())
        self.drafter, self.num_draft = build_drafter(opts, self.target, log or (lambda _msg: None))

    def encode(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StepOutput]:
        """Yield steps as they are generated; ``step.text`` is the new text of each."""
        return self._generate(self.encode(prompt), params)

    def stream_chat(self, messages: Messages, params: SamplingParams | None = None) -> Iterator[StepOutput]:
        """Apply the model's chat template to ``messages`` and stream the assistant's answer."""
        ids = self.tokenizer.encode_chat(messages, add_generation_prompt=True)
        return self._generate(ids, params)

    def _generate(self, ids: list[int], params: SamplingParams | None) -> Iterator[StepOutput]:
        return self.engine.generate(ids, params or SamplingParams(), self.drafter, self.num_draft)

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Complete each prompt (text or token ids) in turn; returns one output per prompt."""
        batch: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [prompts]  # type: ignore[list-item]
        else:
            batch = list(prompts)  # type: ignore[arg-type]
        return [_collect(p, self.stream(p, params)) for p in batch]

    def chat(self, messages: Messages, params: SamplingParams | None = None) -> RequestOutput:
        return _collect(messages, self.stream_chat(messages, params))


def auto_concurrency(model: CausalLM, memory: int) -> int:
    """--max-concurrency auto: up to DEFAULT_MAX_CONCURRENCY sequences, as many whose KV regions
    (the context length each) fit a quarter of ``memory``, at least 1."""
    lane = model.max_len * model.make_cache(1).bytes_per_token
    return max(1, min(DEFAULT_MAX_CONCURRENCY, memory // 4 // max(lane, 1)))


def describe_memory(engine: Engine, prefix: PrefixCache) -> str:
    """One start-up line: the KV cache's size per token and in all, and the prefix cache's budget."""
    cache = engine.cache
    per_token = cache.bytes_per_token
    lanes = f"{engine.max_sequences} sequences x " if engine.max_sequences > 1 else ""
    line = (f"KV cache: {lanes}{cache.max_len} tokens x {per_token / 1024:.1f} KB ({cache.attention.kind}) = "
            f"{engine.kv_bytes / 2**20:.0f} MB; ")
    if not prefix.enabled:
        return line + "prefix cache: off"
    if not cache.copyable:
        return line + "prefix cache: the working sequence only (tensor parallel: no stored copies)"
    return (line + f"prefix cache: up to {prefix.budget_bytes >> 20} MB of earlier sequences "
            f"(~{prefix.budget_bytes // per_token} tokens of the target's; --prefix-cache-mb)")


def _collect(prompt: Prompt | Messages, steps: Iterator[StepOutput]) -> RequestOutput:
    text, ids = [], []
    step = None
    for step in steps:
        text.append(step.text)
        ids.extend(step.token_ids)
    assert step is not None
    return RequestOutput(prompt, "".join(text), ids, step.finish_reason, step.stats)
