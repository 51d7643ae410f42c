"""One engine thread that generates many requests at once, behind a fair FIFO queue, bridged to asyncio.

The engine steps every running generation in one target pass (continuous batching): between
steps the thread admits queued requests while the engine has a free lane (first come, first
served; none can starve another, and a running request is never stalled by a new one's prompt for
more than one pass's share), and removes those that finished or were cancelled. Each request gets
an asyncio queue of :class:`StepOutput` that the thread fills with ``loop.call_soon_threadsafe``;
the event loop never blocks on the engine. A request is cancelled with a flag that the thread
checks between engine steps, so a client that goes away frees its lane after the step in flight.
Every answer is bitwise the one it gets alone: the engine's passes are batch-invariant.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from quickdraft.constraints import Constraint
from quickdraft.engine import Engine, Generation, StepOutput
from quickdraft.hardware import hand_over_compute_threads
from quickdraft.sampling import SamplingParams
from quickdraft.server.metrics import RequestTimer, ServerMetrics
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


@dataclass(eq=False)
class _Active:
    """A job the engine is generating."""

    job: Job
    drafter: Drafter | None
    timer: RequestTimer
    last: StepOutput | None = None


class EngineWorker:
    """Runs queued jobs on a dedicated thread, up to the engine's ``max_sequences`` at once."""

    def __init__(
        self,
        engine: Engine,
        drafter: Drafter | None,
        num_draft: int,
        metrics: ServerMetrics,
        max_waiting: int = 1024,
    ) -> None:
        self.engine = engine
        self.num_draft = num_draft
        self.metrics = metrics
        self.max_waiting = max_waiting
        # one drafter instance per sequence that can run at once (drafters keep per-sequence state)
        self._drafters: list[Drafter | None] = [drafter]
        if drafter is not None:
            self._drafters += drafter.forks(engine.max_sequences - 1)
        else:
            self._drafters *= engine.max_sequences
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._active: dict[Generation, _Active] = {}
        metrics.max_running.set(engine.max_sequences)

    def start(self) -> None:
        """Run the engine on a thread of its own from now on; the calling thread's compute
        threads end (:func:`~quickdraft.hardware.hand_over_compute_threads`)."""
        if self._thread is None:
            hand_over_compute_threads()
            self._thread = threading.Thread(target=self._run, name="quickdraft-engine", daemon=True)
            self._thread.start()

    def cancel_all(self) -> None:
        """Cancel the running jobs and every queued one (their streams end at once)."""
        for job in [*(a.job for a in list(self._active.values())), *list(self._queue.queue)]:
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

    def waiting_room(self) -> int:
        """How many more requests may wait in the queue."""
        return max(0, self.max_waiting - self._queue.qsize())

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
            if not self._admit():
                break
            if not self._active:
                continue
            for gen, active in list(self._active.items()):
                if active.job.cancelled.is_set():  # checked between engine steps
                    self.metrics.cancelled.inc()
                    self._end(gen)
            if not self._active:
                continue
            self.metrics.batch_sequences.observe(len(self._active))
            try:
                results = self.engine.step()
            except Exception as exc:  # the pass itself failed: every generation in it ends with the error
                log.exception("generation failed")
                for gen, active in list(self._active.items()):
                    self.metrics.failed.inc()
                    active.job.push(exc)
                    self._end(gen)
                continue
            self.metrics.batch_rows.observe(self.engine.last_pass_rows)
            for gen, out in results:
                active = self._active[gen]
                if isinstance(out, Exception):  # reported to the client; the others go on
                    log.error("generation failed: %s", out, exc_info=out)
                    self.metrics.failed.inc()
                    active.job.push(out)
                    self._end(gen)
                    continue
                active.timer.step(len(out.token_ids))
                active.last = out
                active.job.push(out)
                if out.finished:
                    self._end(gen)
        for gen in list(self._active):
            self._end(gen)

    def _admit(self) -> bool:
        """Start queued jobs while the engine has room (waiting for one when nothing runs);
        False once stop() was called."""
        while self.engine.has_room():
            try:
                job = self._queue.get(block=not self._active)
            except queue.Empty:
                break
            self.metrics.waiting.set(self._queue.qsize())
            if job is None:
                return False
            if job.cancelled.is_set():  # the client left while waiting
                self.metrics.cancelled.inc()
                job.push(_END)
                continue
            drafter = self._drafters.pop()
            try:
                gen = self.engine.add(job.prompt_ids, job.params, drafter, self.num_draft, job.constraint)
            except Exception as exc:  # a request that cannot run: reported to its client only
                log.info("request refused: %s", exc)
                self.metrics.failed.inc()
                self._drafters.append(drafter)
                job.push(exc)
                job.push(_END)
                continue
            self._active[gen] = _Active(job, drafter, self.metrics.request_timer(job.arrived))
        self.metrics.running.set(len(self._active))
        return True

    def _end(self, gen: Generation) -> None:
        active = self._active.pop(gen)
        self.engine.remove(gen)
        self._drafters.append(active.drafter)
        if active.last is not None:
            active.timer.finish(active.last.stats, active.last.finish_reason)
        active.job.push(_END)
        self.metrics.running.set(len(self._active))
