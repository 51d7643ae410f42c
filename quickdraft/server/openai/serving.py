"""The engine's steps as chat and text completions: queueing, whole answers, streamed chunks.

Every dialect serves through here: a request prepared (:mod:`.prepare`) is queued on the engine
thread (:func:`submit`), and its steps become OpenAI's chat completion (:func:`chat_response`)
or its stream of chunks (:func:`chat_chunks`), which the other dialects translate into theirs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from quickdraft import __version__
from quickdraft.detokenizer import IncrementalDetokenizer
from quickdraft.engine import RequestStats, StepOutput
from quickdraft.engine import TokenLogprob as EngineLogprob
from quickdraft.errors import QuickdraftError
from quickdraft.server.errors import ApiError
from quickdraft.server.model_server import ModelServer
from quickdraft.server.openai import protocol as p
from quickdraft.server.openai.prepare import Prepared
from quickdraft.server.tools import CallDelta, ToolStream, parse_output
from quickdraft.server.worker import Job

FINGERPRINT = f"quickdraft-{__version__}"
RETRY_AFTER_S = 1  # what a 429 for a full queue tells the client to wait
_LOGPROB_FLOOR = -9999.0  # JSON has no -inf


def submit(server: ModelServer, prepared: Prepared) -> Job:
    return submit_all(server, [prepared])[0]


def submit_all(server: ModelServer, choices: list[Prepared]) -> list[Job]:
    """Queue one job per choice (all or none: a full queue is a 429 with Retry-After)."""
    if server.worker.waiting_room() < len(choices):
        raise ApiError(
            429, "the server is busy: too many requests are waiting; retry shortly", kind="rate_limit_error",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    return [server.worker.submit(c.prompt_ids, c.params, c.constraint) for c in choices]


async def collect(request: Request, jobs: list[Job]) -> list[list[StepOutput]]:
    """All steps of each job, cancelling them if the client disconnects first."""

    async def steps(job: Job) -> list[StepOutput]:
        return [step async for step in job.steps()]

    async def gather() -> list[list[StepOutput]]:
        return list(await asyncio.gather(*(steps(job) for job in jobs)))

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    result = asyncio.ensure_future(gather())
    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not result.done():
            raise ApiError(499, "the client closed the request")  # nobody reads this
        outputs = _engine_result(result)
    finally:
        gone.cancel()
        result.cancel()
        for job in jobs:
            job.cancel()  # a no-op once finished
    return outputs


def _engine_result(task: asyncio.Future[list[list[StepOutput]]]) -> list[list[StepOutput]]:
    try:
        outputs = task.result()
    except QuickdraftError as exc:
        raise ApiError(400, str(exc)) from None
    if any(not steps or steps[-1].finish_reason is None for steps in outputs):
        raise ApiError(503, "the server is shutting down", kind="server_error")
    return outputs


def new_ids() -> tuple[str, int]:
    return uuid.uuid4().hex, int(time.time())


def chat_chunks(
    server: ModelServer, job: Job, prepared: Prepared, index: int = 0, stamp: tuple[str, int] | None = None
) -> AsyncIterator[p.ChatCompletionChunk]:
    """The streamed chat completion as chunk objects: the role first, then content (and logprobs)
    as generated, each tool call's id and name then its arguments, and a last chunk with the
    finish reason and usage. The Responses and Messages APIs translate these into their events.
    ``index``: the choice these chunks are of; ``stamp``: the response's (id, created). With
    ``prepared.provenance`` every chunk says which of the tokens it brings were accepted drafts."""
    rid, created = stamp or new_ids()
    provenance = _Provenance() if prepared.provenance else None

    def chunk(
        delta: p.Delta, logprobs: p.ChatLogprobs | None = None, finish: str | None = None, usage: p.Usage | None = None
    ) -> p.ChatCompletionChunk:
        return p.ChatCompletionChunk(
            id=f"chatcmpl-{rid}",
            created=created,
            model=server.name,
            system_fingerprint=FINGERPRINT,
            choices=[p.ChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)],
            usage=usage,
            quickdraft=None if provenance is None else provenance.take(),
        )

    async def chunks() -> AsyncIterator[p.ChatCompletionChunk]:
        yield chunk(p.Delta(role="assistant", content=""))
        last = None
        calls = _CallText(server, prepared) if prepared.tools is not None else None
        n_calls = 0
        async for step in job.steps():
            last = step
            if provenance is not None:
                provenance.add(step)
            logprobs = chat_logprobs(server, step.logprobs)
            if calls is None:
                if step.text or step.logprobs:
                    yield chunk(p.Delta(content=step.text), logprobs=logprobs)
                continue
            content, deltas = calls.push(step.token_ids, final=step.finish_reason is not None)
            if content or logprobs:
                yield chunk(p.Delta(content=content or None), logprobs=logprobs)
            for delta in deltas:
                yield chunk(_call_delta(delta))
                n_calls = max(n_calls, delta.index + 1)
        if last is None or last.finish_reason is None:
            raise QuickdraftError("the generation was cut short (the server is shutting down)")
        yield chunk(p.Delta(), finish=_finish_reason(last.finish_reason, n_calls), usage=usage_of(last.stats))

    return chunks()


class _Provenance:
    """The provenance of the steps a choice's next chunk brings: a step whose text is held back
    (part of a character, a possible stop string) goes with the next chunk sent."""

    def __init__(self) -> None:
        self.tokens = 0
        self.accepted = 0
        self.spans: list[tuple[int, int]] = []

    def add(self, step: StepOutput) -> None:
        self.tokens += len(step.token_ids)
        self.accepted += step.accepted
        start, end = step.accepted_text
        if end > start:
            self.spans.append((start, end))

    def take(self) -> p.ChunkProvenance:
        out = p.ChunkProvenance(tokens=self.tokens, accepted=self.accepted, accepted_text=self.spans)
        self.tokens, self.accepted, self.spans = 0, 0, []
        return out


def total_usage(usages: list[p.Usage]) -> p.Usage:
    """The usage of n choices of one prompt: the prompt counted once, every choice's tokens."""
    first = usages[0]
    completion = sum(u.completion_tokens for u in usages)
    return first.model_copy(update={"completion_tokens": completion,
                                    "total_tokens": first.prompt_tokens + completion})


def chat_response(server: ModelServer, outputs: list[list[StepOutput]], choices: list[Prepared]) -> p.ChatCompletion:
    """The whole answer: one choice per (steps, prepared) pair, usage over all of them."""
    rid, created = new_ids()
    out = []
    for index, (steps, prepared) in enumerate(zip(outputs, choices, strict=True)):
        logprobs = chat_logprobs(server, _all_logprobs(steps))
        finish = steps[-1].finish_reason
        if prepared.tools is None:
            message = p.ChatMessageOut(content="".join(s.text for s in steps))
        else:
            text = _CallText(server, prepared).text([t for s in steps for t in s.token_ids])
            parsed = parse_output(prepared.tools, text, prepared.tool_names)
            message = p.ChatMessageOut(
                content=parsed.content or (None if parsed.calls else ""),
                tool_calls=[p.ToolCallOut.model_validate(c.to_openai()) for c in parsed.calls]
                or None,
            )
            finish = _finish_reason(finish, len(parsed.calls))
        out.append(p.ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=finish))
    return p.ChatCompletion(
        id=f"chatcmpl-{rid}",
        created=created,
        model=server.name,
        system_fingerprint=FINGERPRINT,
        choices=out,
        usage=total_usage([usage_of(steps[-1].stats) for steps in outputs]),
    )


def completion_response(server: ModelServer, outputs: list[list[StepOutput]], echo: str) -> p.Completion:
    rid, created = new_ids()
    out = []
    for index, steps in enumerate(outputs):
        logprobs = completion_logprobs(server, _all_logprobs(steps), len(echo))
        text = echo + "".join(s.text for s in steps)
        out.append(p.CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=steps[-1].finish_reason))
    return p.Completion(
        id=f"cmpl-{rid}",
        created=created,
        model=server.name,
        system_fingerprint=FINGERPRINT,
        choices=out,
        usage=total_usage([usage_of(steps[-1].stats) for steps in outputs]),
    )


class _CallText:
    """The output as text for the tool-call parser: decoded with special tokens kept (some
    formats open calls with one) and end-of-sequence tokens left out."""

    def __init__(self, server: ModelServer, prepared: Prepared) -> None:
        assert prepared.tools is not None
        tokenizer = server.llm.tokenizer
        self.eos = set(tokenizer.eos_ids)
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
        self.stream = ToolStream(prepared.tools, prepared.tool_names)

    def text(self, ids: list[int]) -> str:
        return self.detok.push([t for t in ids if t not in self.eos]) + self.detok.flush()

    def push(self, ids: list[int], final: bool) -> tuple[str, list[CallDelta]]:
        """Content to stream now and the pieces of calls these tokens made (see ToolStream)."""
        text = self.detok.push([t for t in ids if t not in self.eos])
        if final:
            text += self.detok.flush()
        content, _ = self.stream.push(text)
        if final:
            more, _ = self.stream.finish()
            content += more
        return content, self.stream.take_deltas()


def _call_delta(delta: CallDelta) -> p.Delta:
    """OpenAI's streamed form of a call piece: index, id, type and name (arguments "") first,
    then index and a piece of the arguments."""
    if delta.id is not None:
        call = p.ToolCallDelta(
            index=delta.index, id=delta.id, type="function",
            function=p.FunctionDelta(name=delta.name, arguments=delta.arguments),
        )
    else:
        call = p.ToolCallDelta(index=delta.index, function=p.FunctionDelta(arguments=delta.arguments))
    return p.Delta(tool_calls=[call])


def _finish_reason(engine_reason: str | None, n_calls: int) -> str | None:
    return "tool_calls" if n_calls and engine_reason == "stop" else engine_reason


def usage_of(stats: RequestStats) -> p.Usage:
    spec = p.SpecUsage(
        drafted=stats.drafted,
        accepted=stats.accepted,
        tau=stats.tau,
        tokens_per_second=stats.tokens_per_second,
        ttft_s=round(stats.ttft, 4),
    )
    return p.Usage(
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=stats.output_tokens,
        total_tokens=stats.prompt_tokens + stats.output_tokens,
        prompt_tokens_details=p.PromptTokensDetails(cached_tokens=stats.cached_tokens),
        quickdraft=spec,
    )


# -------------------------------------------------------------------------------------- logprobs


def _all_logprobs(steps: list[StepOutput]) -> list[EngineLogprob] | None:
    if steps[0].logprobs is None:
        return None
    return [lp for s in steps for lp in s.logprobs or []]


def _token_text(server: ModelServer, token: int) -> tuple[str, bytes]:
    return server.grammar.token_text(token)


def _finite(logprob: float) -> float:
    return logprob if logprob >= _LOGPROB_FLOOR else _LOGPROB_FLOOR  # also maps NaN to the floor


def chat_logprobs(server: ModelServer, lps: list[EngineLogprob] | None) -> p.ChatLogprobs | None:
    if lps is None:
        return None

    def top(token: int, logprob: float) -> p.TopLogprob:
        text, raw = _token_text(server, token)
        return p.TopLogprob(token=text, logprob=_finite(logprob), bytes=list(raw))

    content = [
        p.TokenLogprob(
            **top(lp.token, lp.logprob).model_dump(), top_logprobs=[top(t, v) for t, v in lp.top]
        )
        for lp in lps
    ]
    return p.ChatLogprobs(content=content)


def completion_logprobs(
    server: ModelServer, lps: list[EngineLogprob] | None, offset: int
) -> p.CompletionLogprobs | None:
    if lps is None:
        return None
    out = p.CompletionLogprobs()
    for lp in lps:
        text = _token_text(server, lp.token)[0]
        out.tokens.append(text)
        out.token_logprobs.append(_finite(lp.logprob))
        out.top_logprobs.append({_token_text(server, t)[0]: _finite(v) for t, v in lp.top})
        out.text_offset.append(offset)
        offset += len(text)
    return out
