"""Progress on a terminal, phase by phase: reading files, setting up, moving data, writing files.

One bar for a whole transfer misleads: its rate counted the seconds spent
setting up (a transfer whose bytes moved at 18 Gbps ended showing 3 Gbps),
and it sat at 100 % while the receiver wrote and fsynced the files.  So
every phase gets a line of its own.  A phase that moves bytes shows a bar
and its own rate, counted from its first bytes (the data phase's rate is
the wire's, not the setup's); a phase that waits (setting up, the receiver
checking and writing) shows a clock that keeps ticking, so the display is
never still while something is happening.  A finished phase's line stays on
screen with its bytes, time and rate, as huggingface_hub's per-file bars
do.

A transfer's phases follow each other without anyone announcing them:
:meth:`Progress.plan` queues them, the first bytes of a transfer end the
waiting phase before it, and the last byte starts the next one.  Drawn only
when the stream is a terminal; elsewhere nothing is drawn (the summary line
and ``--json`` say what happened).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from tensorxfer.manifest import Manifest

NAME_WIDTH = 36     # the longest phase name, so the bars line up
BAR_WIDTH = 24
SPINNER = "|/-\\"


@dataclass
class Phase:
    """One phase: ``total`` bytes to move (0: a phase that waits), shown with its rate in ``unit``."""

    name: str
    total: int = 0
    unit: str = "GB/s"          # "Gbps" for the network, "GB/s" for disks
    started: float = 0.0
    done: int = 0
    first_at: float | None = None     # when its first bytes were reported
    first_bytes: int = 0              # how many: they moved before first_at, so the rate leaves them out
    # started by its first bytes (the end of setting up is known only then): the time its first bytes took is
    # not known, so its line gives its rate, not a duration
    by_bytes: bool = False

    def rate(self, now: float) -> str:
        """The rate of this phase's bytes since its first report ('' until two reports are apart in time)."""
        if self.first_at is None or now <= self.first_at or self.done <= self.first_bytes:
            return ""
        per_s = (self.done - self.first_bytes) / (now - self.first_at)
        return f"{per_s * 8 / 1e9:.1f} Gbps" if self.unit == "Gbps" else f"{per_s / 1e9:.2f} GB/s"


class Progress:
    """Phases of a transfer on ``stream`` (stderr), one line each; ``progress(n)`` reports ``n`` bytes moved.

    Parameters
    ----------
    label : str
        What the line belongs to (``send``, ``recv``).
    enabled : bool
        Draw at all (the CLI passes ``not --quiet and not --json``); nothing is drawn unless ``stream`` is a
        terminal either way.
    stream : file, optional
        Where to draw (default: ``sys.stderr``).
    clock : callable
        Seconds, monotonic (a test passes its own).
    tick : float or None
        Redraw this often from a thread of its own, so waiting phases tick (None: no thread; call
        :meth:`refresh`).

    Notes
    -----
    Thread-safe: transports report bytes from their own threads.  :meth:`finish` ends the last phase and
    stops the thread; call it once the transfer ended (a second call does nothing; a later :meth:`plan`
    starts over, as a receiver serving one transfer after another does).
    """

    def __init__(self, label: str, enabled: bool, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.perf_counter, tick: float | None = 0.1) -> None:
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled and self.stream.isatty()
        self._clock = clock
        self._tick = tick
        self._lock = threading.Lock()
        self._phase: Phase | None = None
        self._queue: deque[Phase] = deque()
        self._drawn_at = float("-inf")
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    # ---------------------------------------------------------------- announcing phases
    def phase(self, name: str, total: int = 0, unit: str = "GB/s") -> None:
        """End the current phase and start ``name`` now (``total`` bytes to move; 0: a waiting phase)."""
        self.plan([Phase(name, total, unit)])

    def plan(self, phases: Iterable[Phase]) -> None:
        """End the current phase and run ``phases`` in turn: the first starts now; a waiting phase ends when
        bytes are reported, a phase moving bytes when all its bytes were reported."""
        with self._lock:
            now = self._clock()
            self._end(now)
            self._queue = deque(phases)
            self._next(now)
            self._draw(now, force=True)
        with self._lock:
            if not self.enabled or self._tick is None or self._ticker is not None:
                return
            self._stop = threading.Event()
            self._ticker = threading.Thread(target=self._run_ticker, args=(self._stop,), name="tensorxfer-progress",
                                            daemon=True)
            self._ticker.start()

    def start(self, manifest: Manifest) -> None:
        """An offer arrived (receivers learn the size only then): setting up, then receiving its bytes, then
        the checks after the last byte."""
        self.plan([Phase("setting up (allocating, connecting)"), Phase("receiving data", manifest.nbytes, "Gbps"),
                   Phase("checking the data")])

    def moving(self, nbytes: int) -> None:
        """The phase moving bytes (the one running, else the next) moves ``nbytes`` rather than what it was
        planned with: a resumed transfer, whose kept pieces do not move."""
        with self._lock:
            for p in ([self._phase] if self._phase is not None else []) + list(self._queue):
                if p.total:
                    p.total = max(nbytes, p.done, 1)
                    break

    # ---------------------------------------------------------------- bytes
    def __call__(self, n: int) -> None:
        with self._lock:
            now = self._clock()
            p = self._phase
            if p is None:
                return
            if p.total == 0 and self._queue and n > 0:
                self._end(now)                   # the first bytes: the waiting phase before them is over
                self._next(now)
                p = self._phase
                assert p is not None
                p.by_bytes = True
            p.done += n
            if p.first_at is None:
                p.first_at, p.first_bytes = now, p.done
            if p.total and p.done >= p.total:
                p.done = p.total
                self._end(now)
                self._next(now)
                self._draw(now, force=True)
            else:
                self._draw(now, force=False)

    # ---------------------------------------------------------------- drawing
    def above(self, write: Callable[[], None]) -> None:
        """Run ``write`` (which prints a line of its own, e.g. a log record) above the bar: the bar's line is
        erased first and drawn again after."""
        with self._lock:
            if self.enabled and self._phase is not None:
                self.stream.write("\r\x1b[K")
            write()
            self._draw(self._clock(), force=True)

    def refresh(self) -> None:
        """Redraw the current phase (its clock or rate moved on); the ticker thread calls this."""
        with self._lock:
            self._draw(self._clock(), force=True)

    def finish(self, ok: bool = True) -> None:
        """End the last phase (``ok=False``: it stopped, it did not complete) and stop the ticker; idempotent.
        A later :meth:`plan` starts over (a receiver serving one transfer after another)."""
        with self._lock:
            self._end(self._clock(), ok)
            self._queue.clear()
            ticker, self._ticker = self._ticker, None
            self._stop.set()
        if ticker is not None:
            ticker.join()

    def _run_ticker(self, stop: threading.Event) -> None:
        assert self._tick is not None
        while not stop.wait(self._tick):
            self.refresh()

    def _next(self, now: float) -> None:
        self._phase = self._queue.popleft() if self._queue else None
        if self._phase is not None:
            self._phase.started = now

    def _end(self, now: float, ok: bool = True) -> None:
        """Leave the current phase's final line on screen (caller holds the lock)."""
        p, self._phase = self._phase, None
        if p is None or not self.enabled:
            return
        secs = now - p.started
        if not ok:
            tail = f"stopped after {secs:.2f} s"
        elif p.total and p.by_bytes:
            rate = p.rate(now)
            tail = f"{p.total / 1e9:.2f} GB" + (f" at {rate}" if rate else "")
        elif p.total:
            rate = p.rate(now)
            tail = f"{p.total / 1e9:.2f} GB in {secs:.2f} s" + (f", {rate}" if rate else "")
        else:
            tail = f"done in {secs:.2f} s"
        bar = self._bar(p) + " " if p.total else ""
        self._write(f"{self.label}: {p.name:<{NAME_WIDTH}} {bar}{tail}\n")

    def _draw(self, now: float, force: bool) -> None:
        """Redraw the current phase's line, at most every tick unless ``force`` (caller holds the lock)."""
        p = self._phase
        if p is None or not self.enabled or (not force and now - self._drawn_at < (self._tick or 0.1)):
            return
        self._drawn_at = now
        if p.total:
            rate = p.rate(now)
            tail = (f"{self._bar(p)} {p.done / 1e9:.2f}/{p.total / 1e9:.2f} GB" + (f" {rate}" if rate else ""))
        else:
            secs = now - p.started
            tail = f"{SPINNER[int(secs / 0.25) % len(SPINNER)]} {secs:.1f} s"
        self._write(f"{self.label}: {p.name:<{NAME_WIDTH}} {tail}")

    @staticmethod
    def _bar(p: Phase) -> str:
        frac = min(p.done / p.total, 1.0) if p.total else 1.0
        return f"[{'#' * int(frac * BAR_WIDTH):<{BAR_WIDTH}}] {frac:6.1%}"

    def _write(self, line: str) -> None:
        # \r and erase-to-end-of-line: the line is redrawn in place; a final line ends with a newline
        self.stream.write(f"\r{line}\x1b[K" if not line.endswith("\n") else f"\r{line[:-1]}\x1b[K\n")
        self.stream.flush()


class LogAboveBar(logging.StreamHandler):
    """A log handler for the stream a :class:`Progress` draws on: records go above the bar, not into it."""

    def __init__(self, progress: Progress) -> None:
        super().__init__(progress.stream)
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        self.progress.above(lambda: super(LogAboveBar, self).emit(record))


def log_above(progress: Progress, fmt: str, level: int) -> None:
    """Configure logging (as ``logging.basicConfig(level, format)`` would) so records print above the bar."""
    handler = LogAboveBar(progress)
    handler.setFormatter(logging.Formatter(fmt))
    logging.basicConfig(level=level, handlers=[handler])
