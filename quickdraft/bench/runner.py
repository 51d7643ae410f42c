"""Run the benchmark: every method on the same prompts, interleaved prompt by prompt.

A *contender* is one thing being measured: a drafting method on the in-process engine
(``none``, ``ngram``, ``draft``, ``auto``, or a simulated-acceptance drafter), or an
OpenAI-compatible streaming endpoint. Each turns a conversation into a :class:`Trace` of
timestamps (``time.perf_counter`` at every chunk that carries output); :mod:`.metrics` does the
arithmetic on those, so in-process and endpoint numbers mean the same thing.

Machine drift (thermal, other processes) hits all contenders alike because for each prompt every
contender runs before the next prompt starts; the order rotates from prompt to prompt so no
contender always runs right after another.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import resource
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import psutil
import torch
from tqdm import tqdm

from quickdraft import zoo
from quickdraft.assemble.drafters import DEFAULT_DRAFTS, build_drafter
from quickdraft.bench.datasets import Dataset, Item, Message
from quickdraft.bench.metrics import Record, request_metrics
from quickdraft.config import prefix_cache_bytes
from quickdraft.engine import Engine, RequestStats
from quickdraft.errors import QuickdraftError
from quickdraft.loading.load import LoadedModel, resolve
from quickdraft.options import EngineOptions
from quickdraft.prefix_cache import PrefixCache
from quickdraft.sampling import SamplingParams
from quickdraft.speculative.base import Drafter
from quickdraft.speculative.verify import Draft
from quickdraft.tokenizer import Tokenizer

METHODS = ("none", "ngram", "draft", "auto", "eagle3", "eagle3-chain")  # eagle3[-chain]=HEAD_PATH
EAGLE3, EAGLE3_CHAIN = "eagle3", "eagle3-chain"  # dynamic trees (cost model) / one chain per step
NOT_YET: tuple[str, ...] = ()  # accepted once implemented
WARMUP_TOKENS = 8
WARMUP_PROMPT = "Say hello in one word."


@dataclass
class Trace:
    """What one streamed request produced, with the raw timestamps."""

    text: str
    t_start: float  # perf_counter when the request was sent
    chunk_times: list[float]  # perf_counter at each chunk carrying output
    output_tokens: int
    prompt_tokens: int
    finish_reason: str | None
    token_ids: list[int] | None = None  # in-process only
    stats: RequestStats | None = None  # in-process only
    cached_tokens: int | None = None  # prompt tokens the server reused (where it says)
    peak_rss_mb: float | None = None  # in-process only
    extra: dict[str, Any] = field(default_factory=dict)


class Contender(Protocol):
    name: str

    def run(
        self, messages: list[Message], params: SamplingParams, reference: Trace | None
    ) -> Trace:
        """Stream one answer; ``reference`` is the baseline's trace of the same turn, if any."""

    def describe(self) -> dict[str, Any]:
        """What this contender is, for the report."""

    def new_conversation(self) -> None:
        """A conversation starts: nothing of another contender's run may be reused."""


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far: on Linux its own high-water mark (VmHWM; getrusage's
    ru_maxrss starts from the parent's peak, carried through fork and exec), elsewhere getrusage (bytes
    on macOS)."""
    with contextlib.suppress(OSError, StopIteration):
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


# --------------------------------------------------------------------------------------------
# In-process


class InProcessContender:
    """One drafting method on the shared engine (one target model, one KV cache for all)."""

    def __init__(
        self, name: str, engine: Engine, drafter: Drafter | None, k: int, setup_mb: float = 0.0
    ) -> None:
        self.name = name
        self.engine = engine
        self.drafter = drafter
        self.k = k
        self.setup_mb = setup_mb

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": "in-process",
            "drafter": "none" if self.drafter is None else self.drafter.name,
            "num_draft": self.k,
            "setup_rss_mb": round(self.setup_mb, 1),
            "prefix_cache_mb": self.engine.prefix_cache.budget_bytes >> 20,
        }

    def new_conversation(self) -> None:
        # All methods share one engine: a method must not reuse another's run of the same prompt.
        self.engine.prefix_cache.clear()

    def run(
        self, messages: list[Message], params: SamplingParams, reference: Trace | None
    ) -> Trace:
        ids = self.engine.tokenizer.encode_chat(messages, add_generation_prompt=True)
        usage = self.drafter.usage_counts() if self.drafter is not None else {}
        spent = self.drafter.drafting_seconds() if self.drafter is not None else {}
        text: list[str] = []
        token_ids: list[int] = []
        chunk_times: list[float] = []
        step = None
        t_start = time.perf_counter()
        for step in self.engine.generate(ids, params, self.drafter, self.k):
            if step.token_ids:
                chunk_times.append(time.perf_counter())
                token_ids += step.token_ids
            text.append(step.text)
        assert step is not None
        extra: dict[str, Any] = {}
        if self.drafter is not None and (after := self.drafter.usage_counts()):
            # the cost model's decisions: steps and drafting seconds by drafter, what it stood down
            extra["usage"] = {key: after[key] - usage.get(key, 0) for key in after}
            now = self.drafter.drafting_seconds()
            extra["drafting_seconds"] = {key: round(now[key] - spent.get(key, 0.0), 4) for key in now}
            extra["stand_downs"] = self.drafter.stood_down()
        return Trace(
            "".join(text),
            t_start,
            chunk_times,
            len(token_ids),
            len(ids),
            step.finish_reason,
            token_ids,
            step.stats,
            step.stats.cached_tokens,
            peak_rss_mb(),
            extra,
        )


class SimulatedAcceptanceDrafter(Drafter):
    """Drafts k tokens of which a controlled number are right, so tau averages a chosen value.

    It knows the target's greedy continuation (``truth``, from a plain run of the same prompt), so
    it can put exactly n right tokens before a wrong one. n per step follows tau - 1 by error
    diffusion: e.g. tau = 2.5 gives n = 1, 2, 1, 2, ... so every pass emits 2.5 tokens on average.
    This measures the pure overhead of speculation (drafting, k+1-row verify, rollback) at that tau.
    """

    name = "simulated"

    def __init__(self, tau: float, vocab_size: int) -> None:
        self.tau = tau
        self.vocab_size = vocab_size
        self.truth: list[int] = []
        self.diverged = 0  # emitted tokens that differ from truth (should stay 0: lossless greedy)
        self._pos = 0
        self._credit = 0.0

    def prefill(self, prompt_ids: torch.Tensor, params: SamplingParams, cached: int = 0) -> None:
        self._pos, self._credit, self.diverged = 0, 0.0, 0

    def propose(self, k: int) -> Draft:
        known = self.truth[self._pos : self._pos + k]
        want = self._credit + self.tau - 1
        n = min(math.floor(want + 1e-9), len(known))
        self._credit = want - n if n == math.floor(want + 1e-9) else 0.0
        tokens = list(known)
        if n < len(tokens):
            tokens[n] = (tokens[n] + 1) % self.vocab_size  # wrong on purpose: the target rejects it
        return Draft(tokens=torch.tensor(tokens, dtype=torch.long))

    def commit(self, tokens: torch.Tensor, num_accepted: int) -> None:
        emitted = tokens.tolist()
        expected = self.truth[self._pos : self._pos + len(emitted)]
        self.diverged += sum(a != b for a, b in zip(emitted, expected, strict=False))
        self._pos += len(emitted)

    def reset(self) -> None:
        self._pos = 0


class SimulatedContender(InProcessContender):
    """Runs after the baseline of each turn and drafts from its greedy output."""

    def run(
        self, messages: list[Message], params: SamplingParams, reference: Trace | None
    ) -> Trace:
        assert isinstance(self.drafter, SimulatedAcceptanceDrafter)
        if reference is None or reference.token_ids is None:
            raise QuickdraftError(
                "--simulate-acceptance needs the in-process 'none' method as its reference"
            )
        self.drafter.truth = reference.token_ids
        trace = super().run(messages, params, reference)
        trace.extra["diverged_tokens"] = self.drafter.diverged
        return trace


@dataclass(frozen=True)
class MethodOptions:
    """How the in-process methods run: the engine's options (each method's ``draft`` is its own;
    the prefix cache lets turn n of a conversation reuse turn n - 1) and the benchmark's own."""

    engine: EngineOptions = EngineOptions(prefix_cache_mb=0)
    draft_model: str | None = None  # for the 'draft' method; default: the zoo's pairing
    simulate_tau: float | None = None

    @property
    def num_draft(self) -> int | None:
        return self.engine.num_draft


def parse_methods(text: str) -> list[str]:
    """Validate a comma-separated method list (may be empty when only endpoints are measured)."""
    methods = [_method_token(m) for m in text.split(",") if m.strip()]
    for m in methods:
        if method_name(m) in (EAGLE3, EAGLE3_CHAIN) and "=" in m:
            if not m.split("=", 1)[1]:
                raise QuickdraftError(f"method '{method_name(m)}=' needs a head path after '=': {method_name(m)}=PATH")
            continue
        if m in (EAGLE3, EAGLE3_CHAIN):
            raise QuickdraftError(
                "method 'eagle3' takes the EAGLE-3 head to run: write eagle3=PATH (a head folder or .safetensors)"
            )
        if m in NOT_YET:
            raise QuickdraftError(
                f"method {m!r} is not available yet; choose from {', '.join(METHODS)}"
            )
        if m not in METHODS:
            raise QuickdraftError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    if len(set(methods)) != len(methods):
        raise QuickdraftError(f"--methods lists a method twice: {text!r}")
    return methods


def _method_token(text: str) -> str:
    """A method name, lower-cased; an ``eagle3=PATH`` keeps its path as written."""
    name, sep, path = text.strip().partition("=")
    return name.strip().lower() + (sep + path.strip() if sep else "")


def method_name(method: str) -> str:
    """The method without its argument: ``eagle3=PATH`` -> eagle3."""
    return method.partition("=")[0]


def default_draft(model_spec: str) -> str | None:
    """The zoo's draft model for a target named or located by ``model_spec``, else None."""
    entry = zoo.lookup(model_spec)
    if entry is not None:
        return DEFAULT_DRAFTS.get(entry.name)
    path = Path(model_spec).expanduser()
    for target, draft in DEFAULT_DRAFTS.items():
        if path.exists() and path.resolve() == zoo.cached_path(target).resolve():
            return draft
    return None


def draft_model_for(model_spec: str, opts: MethodOptions) -> str:
    spec = opts.draft_model or default_draft(model_spec)
    if spec is None:
        pairs = ", ".join(f"{t} -> {d}" for t, d in DEFAULT_DRAFTS.items())
        raise QuickdraftError(
            f"method 'draft' needs a draft model and {model_spec!r} has no default one (known pairs: "
            f"{pairs}); pass --draft-model (a zoo name, .gguf or folder sharing the target's tokenizer)"
        )
    return spec


def simulated_k(tau: float, num_draft: int | None) -> int:
    """The k the simulated drafter offers: the fixed --num-draft, else enough for tau (at least 4)."""
    k = num_draft if num_draft is not None else max(4, math.ceil(tau - 1))
    if not 1.0 <= tau <= k + 1:
        raise QuickdraftError(
            f"--simulate-acceptance must be between 1 and k + 1 = {k + 1}, got {tau}"
        )
    return k


def build_in_process(
    methods: Sequence[str],
    model_spec: str,
    target: LoadedModel,
    opts: MethodOptions,
    say: Callable[[str], None],
) -> list[InProcessContender]:
    """One contender per method over ONE loaded target (draft models are loaded per method)."""
    budget = prefix_cache_bytes(opts.engine.prefix_cache_mb, psutil.virtual_memory().total)
    engine = Engine(target.model, target.tokenizer, cuda_graphs=opts.engine.cuda_graphs, prefix_cache=PrefixCache(budget))
    proc = psutil.Process()
    out: list[InProcessContender] = []
    for m in methods:
        rss = proc.memory_info().rss
        drafter: Drafter | None
        if method_name(m) in (EAGLE3, EAGLE3_CHAIN):  # reported under its full name: =PATH says which head
            drafter, k = _eagle3_contender(m.split("=", 1)[1], target, opts, say, chain=method_name(m) == EAGLE3_CHAIN)
        else:
            draft = draft_model_for(model_spec, opts) if m == "draft" else m
            drafter, k = build_drafter(opts.engine.replace(draft=draft), target, say)
        out.append(
            InProcessContender(m, engine, drafter, k, (proc.memory_info().rss - rss) / 2**20)
        )
    if opts.simulate_tau is not None:
        tau = opts.simulate_tau
        sim = SimulatedAcceptanceDrafter(tau, target.config.vocab_size)
        out.append(
            SimulatedContender(
                f"simulated(tau={tau:g})", engine, sim, simulated_k(tau, opts.num_draft)
            )
        )
    return out


def _eagle3_contender(
    head: str, target: LoadedModel, opts: MethodOptions, say: Callable[[str], None], chain: bool = False
) -> tuple[Drafter, int]:
    """The EAGLE-3 head alone (no n-gram beside it), trees sized by its cost model unless
    --num-draft fixes them. No canary: measuring the head, good or bad, is the point."""
    from quickdraft.assemble.drafters import build_eagle3_drafter

    if not Path(head).expanduser().exists():
        raise QuickdraftError(f"no such EAGLE-3 head: {head}")
    drafter = build_eagle3_drafter(head, target, opts.num_draft, say, canary=False, mode="chain" if chain else "auto")
    assert drafter is not None  # only the canary refuses a head
    return drafter, opts.num_draft or drafter.shape.max_nodes


def load_tokenizer(model_spec: str) -> Tokenizer:
    """The target's tokenizer alone (for endpoint-only runs: no weights loaded)."""
    path = resolve(model_spec)
    return Tokenizer.from_hf_dir(path) if path.is_dir() else Tokenizer.from_gguf(path)


# --------------------------------------------------------------------------------------------
# OpenAI-compatible endpoint


def chat_completions_url(url: str) -> str:
    """Accept a server root, a .../v1 base URL, or the full .../chat/completions URL."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


def parse_sse_line(line: str) -> tuple[str, str | None, bool]:
    """(content delta, finish_reason, done) of one server-sent-events line of a chat stream."""
    obj = sse_object(line)
    if obj is None:
        return "", None, line.startswith("data:") and line[5:].strip() == "[DONE]"
    choices = obj.get("choices") or []
    if not choices:
        return "", None, False  # e.g. a usage-only chunk
    delta = choices[0].get("delta") or {}
    return delta.get("content") or "", choices[0].get("finish_reason"), False


def sse_object(line: str) -> dict[str, Any] | None:
    """The JSON object of one ``data:`` line (None for other lines and ``[DONE]``)."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return None
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        raise QuickdraftError(
            f"the endpoint sent a malformed stream line: {line[:200]!r}"
        ) from None
    if "error" in obj:
        raise QuickdraftError(f"the endpoint reported an error: {obj['error']}")
    return obj


def cached_tokens_of(obj: dict[str, Any]) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a chunk (OpenAI's field), if present."""
    details = (obj.get("usage") or {}).get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return int(value) if isinstance(value, int) else None


class EndpointContender:
    """An OpenAI-compatible streaming server; output tokens counted with the target's tokenizer."""

    def __init__(
        self,
        url: str,
        served_model: str,
        tokenizer: Tokenizer,
        api_key: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        import httpx  # imported here: in-process benchmarks do not need it

        self.url = chat_completions_url(url)
        self.served_model = served_model
        self.name = f"{served_model}@{urlsplit(self.url).netloc}"
        self.tokenizer = tokenizer
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0))

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": "endpoint",
            "url": self.url,
            "served_model": self.served_model,
        }

    def new_conversation(self) -> None:
        pass  # a server keeps what it keeps (e.g. llama.cpp's slot); we cannot and need not clear it

    def body(self, messages: list[Message], params: SamplingParams) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.served_model,
            "messages": messages,
            "stream": True,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "stream_options": {"include_usage": True},
        }
        if params.seed is not None:
            body["seed"] = params.seed
        if params.top_p != 1.0:
            body["top_p"] = params.top_p
        if params.ignore_eos:
            body["ignore_eos"] = True  # not OpenAI's, but vLLM, SGLang and llama.cpp accept it
        return body

    def run(
        self, messages: list[Message], params: SamplingParams, reference: Trace | None
    ) -> Trace:
        parts: list[str] = []
        chunk_times: list[float] = []
        finish: str | None = None
        t_start = time.perf_counter()
        self._cached = None
        for content, reason in self._stream(self.body(messages, params)):
            if content:
                chunk_times.append(time.perf_counter())
                parts.append(content)
            finish = reason or finish
        text = "".join(parts)
        n_out = len(self.tokenizer.encode(text, add_special_tokens=False)) if text else 0
        n_prompt = len(self.tokenizer.encode_chat(messages, add_generation_prompt=True))
        return Trace(text, t_start, chunk_times, n_out, n_prompt, finish, cached_tokens=self._cached)

    _cached: int | None = None

    def _stream(self, body: dict[str, Any]) -> Iterator[tuple[str, str | None]]:
        import httpx

        try:
            with self.client.stream("POST", self.url, json=body) as resp:
                if resp.status_code != 200:
                    detail = resp.read().decode("utf-8", "replace")[:300]
                    raise QuickdraftError(f"{self.url} answered HTTP {resp.status_code}: {detail}")
                for line in resp.iter_lines():
                    content, reason, done = parse_sse_line(line)
                    obj = sse_object(line) if "prompt_tokens_details" in line else None
                    if obj is not None:
                        self._cached = cached_tokens_of(obj)
                    if done:
                        return
                    yield content, reason
        except httpx.ConnectError as exc:
            raise QuickdraftError(
                f"cannot reach the endpoint {self.url} ({exc}); is the server running?"
            ) from exc
        except httpx.HTTPError as exc:
            raise QuickdraftError(
                f"request to {self.url} failed: {type(exc).__name__}: {exc}"
            ) from exc


# --------------------------------------------------------------------------------------------
# The benchmark loop


@dataclass(frozen=True)
class BenchSettings:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    warmup: bool = True
    baseline: str = (
        "none"  # the contender speedups are relative to, and the simulated one drafts from
    )

    def params(self, index: int) -> SamplingParams:
        """Sampling for prompt ``index``: its seed is the base seed + index."""
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed + index,
            ignore_eos=self.ignore_eos,
        )


def run_bench(
    contenders: Sequence[Contender],
    dataset: Dataset,
    settings: BenchSettings,
    progress: bool = True,
) -> list[Record]:
    """Warm up, then every contender on every turn of every prompt, prompt by prompt."""
    if settings.warmup:
        warm_up(contenders, settings)
    total = len(contenders) * dataset.requests_per_method
    records: list[Record] = []
    with tqdm(
        total=total,
        desc="bench",
        unit="req",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    ) as bar:
        for index, item in enumerate(dataset.items):
            for record in run_item(contenders, index, item, settings):
                records.append(record)
                bar.update(1)
                tps = (
                    f"{record.tokens_per_second:.1f}"
                    if record.tokens_per_second is not None
                    else "-"
                )
                bar.set_postfix_str(f"{record.method}: {tps} tok/s", refresh=True)
    return records


def run_order(contenders: Sequence[Contender], index: int, baseline: str) -> list[Contender]:
    """Rotate the order per prompt. With a simulated drafter, which drafts from the baseline's
    output of the same turn, the baseline goes first, the others rotate, the simulated ones last."""
    sims = [c for c in contenders if isinstance(c, SimulatedContender)]
    rest = [c for c in contenders if not isinstance(c, SimulatedContender)]
    head = [c for c in rest if c.name == baseline] if sims else []
    rest = [c for c in rest if c not in head]
    shift = index % len(rest) if rest else 0
    return head + rest[shift:] + rest[:shift] + sims


def run_item(
    contenders: Sequence[Contender], index: int, item: Item, settings: BenchSettings
) -> Iterator[Record]:
    """Every contender through the whole conversation of one prompt, one contender after another:
    each turn follows that contender's own answers, as a user's next message follows the last
    answer (so turn n may reuse what turn n - 1 computed)."""
    params = settings.params(index)
    references: list[Trace] = []  # the baseline's trace of each turn
    for c in run_order(contenders, index, settings.baseline):
        c.new_conversation()
        answers: list[str] = []
        for turn in range(len(item.turns)):
            gc.collect()  # outside the timed region, so a collection does not land inside it
            reference = references[turn] if turn < len(references) else None
            trace = c.run(item.messages(answers), params, reference)
            answers.append(trace.text)
            if c.name == settings.baseline:
                references.append(trace)
            yield make_record(c.name, index, item, turn, params.seed, trace)


def warm_up(contenders: Sequence[Contender], settings: BenchSettings) -> None:
    """One short request per contender (not recorded): first-call allocations, connections. Not a
    measured prompt: a server with a prompt cache (llama.cpp's) would answer that one warm."""
    short = replace(settings, max_tokens=min(WARMUP_TOKENS, settings.max_tokens))
    list(run_item(contenders, 0, Item("warmup", (WARMUP_PROMPT,)), short))


def make_record(
    method: str, index: int, item: Item, turn: int, seed: int | None, trace: Trace
) -> Record:
    m = request_metrics(trace.t_start, trace.chunk_times, trace.output_tokens)
    record = Record(
        method=method,
        item_index=index,
        item_id=item.id,
        turn=turn,
        seed=seed,
        prompt_tokens=trace.prompt_tokens,
        output_tokens=m.output_tokens,
        ttft=m.ttft,
        e2e=m.e2e,
        decode_seconds=m.decode_seconds,
        tokens_per_second=m.tokens_per_second,
        finish_reason=trace.finish_reason,
        peak_rss_mb=trace.peak_rss_mb,
        cached_tokens=trace.cached_tokens,
        extra=trace.extra,
        text=trace.text,
    )
    s = trace.stats
    if s is not None:
        record.tau = s.tau if s.target_passes else None
        record.target_passes, record.drafted, record.accepted = (
            s.target_passes,
            s.drafted,
            s.accepted,
        )
        record.drafted_per_position = list(s.drafted_per_position)
        record.accepted_per_position = list(s.accepted_per_position)
        record.draft_seconds, record.verify_seconds = s.draft_seconds, s.verify_seconds
    return record
