"""Server-sent events: the one encoder, the one guard every streaming route answers through.

Once a stream's 200 and headers are sent, nothing can turn into an HTTP error any more: the
guard ends a stream that fails (the engine raised, or a bug) with the dialect's error event
instead, and it cancels the stream's generations however the stream ends (done, failed, or the
client gone: Starlette cancels the generator at its ``await``, and the ``finally`` runs), so a
disconnected client frees its engine lanes at once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from quickdraft.errors import QuickdraftError
from quickdraft.server.worker import Job

log = logging.getLogger("quickdraft.server")


def sse(data: str, event: str | None = None) -> str:
    """One event on the wire: its ``event:`` line when it is named, its data, a blank line."""
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {data}\n\n"


def typed_sse(event: dict[str, Any]) -> str:
    """An event of a typed stream (Anthropic's, the Responses API's): named by its ``type``."""
    return sse(json.dumps(event), event["type"])


@dataclass(frozen=True)
class StreamFailure:
    """Why a stream ended early: ``internal`` is a bug or unexpected failure (logged, the
    message names only its type), otherwise the engine refused or stopped the generation."""

    message: str
    internal: bool


async def guarded(
    events: AsyncIterator[str],
    jobs: Sequence[Job],
    failed: Callable[[StreamFailure], list[str]],
) -> AsyncIterator[str]:
    """``events`` as they come; a failure mid-stream ends it with ``failed``'s events (the
    dialect's error event); however it ends, ``jobs`` are cancelled (a no-op once finished)."""
    try:
        async for event in events:
            yield event
    except QuickdraftError as exc:
        for event in failed(StreamFailure(str(exc), internal=False)):
            yield event
    except Exception as exc:
        log.error("stream failed", exc_info=exc)
        for event in failed(StreamFailure(f"internal server error ({type(exc).__name__})", internal=True)):
            yield event
    finally:
        for job in jobs:
            job.cancel()


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """The streaming answer: ``text/event-stream``, neither cached nor buffered by proxies."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)
