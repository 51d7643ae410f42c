"""One engine thread behind a fair FIFO queue, bridged to asyncio.

The engine holds one KV cache, so one generation runs at a time: requests wait in arrival order
(first come, first served; none can starve another) and the engine thread runs them one by one.
Each request gets an asyncio queue of :class:`StepOutput` that the thread fills with
``loop.call_soon_threadsafe``; the event loop never blocks on the engine. A request is cancelled
with a flag that the thread checks between engine steps, so a client that goes away stops its
generation after the step in flight (a fraction of a second), not at max_tokens.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Generator, Sequence
from dataclasses import dataclass, field

from quickdraft.constraints import Constraint
from quickdraft.engine import Engine, StepOutput
from quickdraft.sampling import SamplingParams
from quickdraft.server.metrics import ServerMetrics
from quickdraft.speculative.base import Drafter

log = logging.getLogger("quickdraft.server")


class _End:
    """Marks the end of a job's step stream."""


_END = _End()
_Item = StepOutput | BaseException | _End


@dataclass
class Job:
    """One queued request and the asyncio side of its step stream."""

    prompt_ids: list[int]
    params: SamplingParams
    constraint: Constraint | None
    loop: asyncio.AbstractEventLoop
    arrived: float = field(default_factory=time.perf_counter)
    items: asyncio.Queue[_Item] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop this request's generation (or drop it from the queue); safe from any thread."""
        self.cancelled.set()

    def push(self, item: _Item) -> None:
        """From the engine thread: hand one item to the event loop."""
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel()

    async def steps(self) -> AsyncIterator[StepOutput]:
        """The steps as the engine yields them; an engine error is raised here."""
        while True:
            item = await self.items.get()
            if isinstance(item, _End):
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class EngineWorker:
    """Runs queued jobs one at a time on a dedicated thread."""

    def __init__(
        self,
        engine: Engine,
        drafter: Drafter | None,
        num_draft: int,
        metrics: ServerMetrics,
        max_waiting: int = 1024,
    ) -> None:
        self.engine = engine
        self.drafter = drafter
        self.num_draft = num_draft
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._current: Job | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="quickdraft-engine", daemon=True)
            self._thread.start()

    def cancel_all(self) -> None:
        """Cancel the running job and every queued one (their streams end at once)."""
        for job in [self._current, *list(self._queue.queue)]:
            if job is not None:
                job.cancel()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is queued or running and end the thread."""
        if self._thread is None:
            return
        self.cancel_all()
        self._queue.put(None)
        self._thread.join(timeout)
        self._thread = None

    def is_full(self) -> bool:
        return self._queue.qsize() >= self.max_waiting

    def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, constraint: Constraint | None
    ) -> Job:
        """Queue a request; call from the event loop."""
        job = Job(list(prompt_ids), params, constraint, asyncio.get_running_loop())
        self._queue.put(job)
        self.metrics.waiting.set(self._queue.qsize())
        return job

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            self.metrics.waiting.set(self._queue.qsize())
            if job is None:
                return
            self.metrics.running.set(1)
            self._current = job
            try:
                self._serve(job)
            finally:
                self._current = None
                self.metrics.running.set(0)
                job.push(_END)

    def _serve(self, job: Job) -> None:
        if job.cancelled.is_set():  # the client left while waiting
            self.metrics.cancelled.inc()
            return
        steps = self.engine.generate(
            job.prompt_ids, job.params, self.drafter, self.num_draft, job.constraint
        )
        timer = self.metrics.request_timer(job.arrived)
        step: StepOutput | None = None
        try:
            for step in steps:
                timer.step(len(step.token_ids))
                job.push(step)
                if step.finished:
                    break
                if job.cancelled.is_set():  # checked between engine steps
                    self.metrics.cancelled.inc()
                    break
        except Exception as exc:  # reported to the client; the worker keeps serving
            log.exception("generation failed")
            self.metrics.failed.inc()
            job.push(exc)
        finally:
            if isinstance(steps, Generator):
                steps.close()  # runs the engine's cleanup now, not at garbage collection
        if step is not None:
            timer.finish(step.stats, step.finish_reason)
