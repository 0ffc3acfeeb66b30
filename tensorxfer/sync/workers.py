"""Threads a rank keeps for its lifetime, to run one step's pairs at once.

A source pushes to its targets and a target receives from its sources in parallel, every step.  Starting a
thread per pair per step put ~0.1 ms per thread on the step's critical path (``Thread.start`` waits for the
new thread to run); handing a job to a thread that already waits costs a queue put.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

Job = Callable[[], None]


class Workers:
    """Daemon threads, made as a step first needs them and kept until :meth:`close`."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._inboxes: list[queue.SimpleQueue[tuple[Job, threading.Event] | None]] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def run(self, jobs: list[Job]) -> None:
        """Run every job at once (the first on this thread) and return once all ended.  A job keeps its own
        result and catches its own errors (one that escapes is dropped: the others still run)."""
        if not jobs:
            return
        batch = self.batch(len(jobs) - 1)
        for job in jobs[1:]:
            batch.submit(job)
        try:
            jobs[0]()
        finally:
            batch.join()

    def batch(self, size: int) -> Batch:
        """Up to ``size`` jobs, each started on a thread of its own as it is submitted (a step's pairs, as
        each becomes ready); :meth:`Batch.join` waits for them."""
        with self._lock:
            while len(self._inboxes) < size:
                inbox: queue.SimpleQueue[tuple[Job, threading.Event] | None] = queue.SimpleQueue()
                thread = threading.Thread(target=_serve, args=(inbox,), name=f"{self._name}-{len(self._inboxes)}",
                                          daemon=True)
                thread.start()
                self._inboxes.append(inbox)
                self._threads.append(thread)
            return Batch(self._inboxes[:size])

    def close(self, timeout: float = 30.0) -> None:
        """End the threads once their jobs did (close what a job waits on first), waiting up to ``timeout``
        seconds for them: a thread still running while the interpreter exits would meet its objects' (CUDA's)
        teardown.  Idempotent."""
        with self._lock:
            inboxes, self._inboxes = self._inboxes, []
            threads, self._threads = self._threads, []
        for inbox in inboxes:
            inbox.put(None)
        deadline = time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))


class Batch:
    """Jobs of one step on a :class:`Workers`' threads, one thread each (see :meth:`Workers.batch`)."""

    def __init__(self, inboxes: list[queue.SimpleQueue[tuple[Job, threading.Event] | None]]) -> None:
        self._free = list(inboxes)
        self._ended: list[threading.Event] = []

    def submit(self, job: Job) -> None:
        if not self._free:
            raise RuntimeError("a Batch takes as many jobs as it was made for")
        done = threading.Event()
        self._ended.append(done)
        self._free.pop(0).put((job, done))

    def join(self) -> None:
        for done in self._ended:
            done.wait()


def _serve(inbox: queue.SimpleQueue[tuple[Job, threading.Event] | None]) -> None:
    while True:
        item = inbox.get()
        if item is None:
            return
        job, done = item
        try:
            job()
        except BaseException:   # a job keeps its own errors; this thread must serve the next step
            pass
        finally:
            item = job = None   # type: ignore[assignment]  # hold nothing of a finished step (its sessions)
            done.set()
