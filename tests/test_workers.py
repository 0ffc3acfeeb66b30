"""The threads a weight-sync rank keeps for its steps' pairs."""

from __future__ import annotations

import threading
import time

from tensorxfer.sync.workers import Workers


def test_jobs_run_at_once_on_threads_kept_between_steps_and_close_ends_them() -> None:
    workers = Workers("test-workers")
    before = threading.active_count()
    seen: list[set[str]] = []
    for _ in range(3):
        names: set[str] = set()
        barrier = threading.Barrier(4, timeout=10)     # passes only if all four jobs run at the same time

        def job(barrier: threading.Barrier = barrier, names: set[str] = names) -> None:
            barrier.wait()
            names.add(threading.current_thread().name)
        workers.run([job] * 4)
        seen.append(names)
        assert len(names) == 4
    assert seen[0] == seen[1] == seen[2], "the same threads serve every step"
    assert threading.active_count() == before + 3
    workers.close()
    workers.close()
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before


def test_a_job_that_raises_neither_hangs_the_step_nor_kills_its_thread() -> None:
    workers = Workers("test-workers")
    ran: list[int] = []

    def bad() -> None:
        raise RuntimeError("boom")
    try:
        workers.run([lambda: ran.append(0), bad])
        workers.run([lambda: ran.append(1), lambda: ran.append(2)])
        assert sorted(ran) == [0, 1, 2]
    finally:
        workers.close()
