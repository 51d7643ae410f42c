"""OpenAI's streams: chat and text completion chunks as ``data: {...}`` events, then
``data: [DONE]``; an error mid-stream is an error object in a data event, then [DONE]."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TypeVar

from pydantic import BaseModel

from quickdraft.errors import QuickdraftError
from quickdraft.server.model_server import ModelServer
from quickdraft.server.openai import protocol as p
from quickdraft.server.openai.prepare import Prepared
from quickdraft.server.openai.serving import (
    FINGERPRINT,
    chat_chunks,
    completion_logprobs,
    new_ids,
    total_usage,
    usage_of,
)
from quickdraft.server.streaming import StreamFailure, guarded, sse
from quickdraft.server.worker import Job

DONE = sse("[DONE]")


def chunk_event(chunk: BaseModel, usage_key: bool = True) -> str:
    """One chunk's event. OpenAI's chunks carry a ``usage`` key only under include_usage (null
    until the last); ours also put usage on the chunk that finishes the choice."""
    return sse(chunk.model_dump_json(exclude=None if usage_key else {"usage"}))


def failure_events(failure: StreamFailure) -> list[str]:
    """How an OpenAI stream that failed ends: the error object, then [DONE]."""
    kind = "server_error" if failure.internal else "invalid_request_error"
    return [sse(json.dumps(p.error_body(failure.message, kind))), DONE]


def chat_events(
    server: ModelServer, jobs: list[Job], include_usage: bool, choices: list[Prepared]
) -> AsyncIterator[str]:
    """The chat chunks of every choice as OpenAI's server-sent events, in the order they are
    generated; usage on each choice's last one (and, under stream_options.include_usage, one
    usage-only chunk for all choices after them), then [DONE]."""
    stamp = new_ids()
    streams = [chat_chunks(server, job, prep, i, stamp) for i, (job, prep) in enumerate(zip(jobs, choices, strict=True))]

    async def events() -> AsyncIterator[str]:
        usages = []
        last = None
        async for chunk in merged(streams):
            yield chunk_event(chunk, usage_key=include_usage or chunk.usage is not None)
            if chunk.usage is not None:
                usages.append(chunk.usage)
                last = chunk
        if include_usage and last is not None:  # OpenAI's include_usage chunk
            totals = {"choices": [], "usage": total_usage(usages), "quickdraft": None}
            yield chunk_event(last.model_copy(update=totals))
        yield DONE

    return guarded(events(), jobs, failure_events)


def completion_events(
    server: ModelServer, jobs: list[Job], echo: str, include_usage: bool
) -> AsyncIterator[str]:
    """The text completion of every choice as OpenAI's server-sent events (``echo``: the prompt
    text first), usage as for chat, then [DONE]."""
    rid, created = new_ids()

    def chunk(
        text: str,
        index: int = 0,
        logprobs: p.CompletionLogprobs | None = None,
        finish: str | None = None,
        usage: p.Usage | None = None,
        choices: bool = True,
    ) -> p.Completion:
        choice = p.CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish)
        return p.Completion(
            id=f"cmpl-{rid}",
            created=created,
            model=server.name,
            system_fingerprint=FINGERPRINT,
            choices=[choice] if choices else [],
            usage=usage,
        )

    async def one(index: int, job: Job) -> AsyncIterator[p.Completion]:
        offset = len(echo)
        if echo:
            yield chunk(echo, index)
        last = None
        async for step in job.steps():
            last = step
            if step.text or step.logprobs:
                yield chunk(step.text, index, completion_logprobs(server, step.logprobs, offset))
            offset += len(step.text)
        if last is None or last.finish_reason is None:
            raise QuickdraftError("the generation was cut short (the server is shutting down)")
        yield chunk("", index, finish=last.finish_reason, usage=usage_of(last.stats))

    async def events() -> AsyncIterator[str]:
        usages = []
        async for c in merged([one(i, job) for i, job in enumerate(jobs)]):
            if c.usage is not None:
                usages.append(c.usage)
            yield chunk_event(c, usage_key=include_usage or c.usage is not None)
        if include_usage and usages:
            yield chunk_event(chunk("", usage=total_usage(usages), choices=False))
        yield DONE

    return guarded(events(), jobs, failure_events)


T = TypeVar("T")


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of several streams as they come (one stream: itself); an error in any ends all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue[tuple[int, T | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except BaseException as exc:
            await queue.put((i, exc))
            return
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            _, got = await queue.get()
            if got is None:
                running -= 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield got
    finally:
        for task in tasks:
            task.cancel()

