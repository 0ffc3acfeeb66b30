"""A pair's step in parts (``tensorxfer.sync.link.Parts``): a fused pair's tiles are offered before the source
quantizes, its byte runs after.  Here the parts are plain byte runs on host memory (tiles need a GPU), over
real loopback sessions (tcp) and real same-host ipc: each part lands where it goes and its transport is set up
once; a source that cuts the step otherwise, refuses between the parts or stalls there fails the step at the
target, naming it, with nothing of the missing part written."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import tensorxfer as tx
from tensorxfer.transport.segments import Segments
from tests.helpers import sync_pair

N = 64 * 1024
HALF = N // 2
FIRST = Segments.of([0], [HALF], [HALF])          # the source's first half lands in the target's second
SECOND = Segments.of([HALF], [0], [HALF])
STALL = 2.0


def _fill(region: Any, first: int, second: int) -> None:
    with memoryview(region.region) as mv:
        mv[:HALF] = bytes([first]) * HALF
        mv[HALF:N] = bytes([second]) * HALF


def _halves(region: Any) -> tuple[set[int], set[int]]:
    with memoryview(region.region) as mv:
        return set(bytes(mv[:HALF])), set(bytes(mv[HALF:N]))


def _receive(port: Any, dst: Any, parts: Any, step: int) -> tuple[dict[int, Any], threading.Thread]:
    got: dict[int, Any] = {}
    thread = threading.Thread(target=lambda: got.update(port.step(dst, {3: parts}, None, "d", step)), daemon=True)
    thread.start()
    return got, thread


def _step(port: Any, link: Any, src: Any, dst: Any, step: int, first: int, second: int) -> tuple[Any, list[Any], bool]:
    """One step of both parts, the source's halves filled with ``first`` and ``second``: the target's stats
    of the pair, the source's of each part, whether the second was offered before the first was acked; the
    target holds both halves where planned."""
    _fill(src, first, second)
    got, receiving = _receive(port, dst, (FIRST, SECOND), step)
    stats, overlapped = _send(link, src, step)
    receiving.join(20)
    assert not receiving.is_alive(), "the target hung"
    version, pair = got[3]
    assert version == step
    assert _halves(dst) == ({second}, {first}), f"step {step}: the parts did not land where planned"
    assert pair.bytes == N and [s.bytes for s in stats] == [HALF, HALF], (pair, stats)
    return pair, stats, overlapped


def _send(link: Any, src: Any, version: int) -> tuple[list[Any], bool]:
    """Both parts as a push sends them: the second offered before the first is acked where the first was
    posted early (a warm ipc pair), else after it finished (its data follows the accept).  (The parts' stats,
    whether the second went out before the first was acked.)"""
    first = link.offer(src, FIRST, version, "d", 0)
    link.post(first)
    done = [] if first.early else [link.finish(first)]
    second = link.offer(src, SECOND, version, "d", 1)
    link.post(second)
    return [*done, *([link.finish(first)] if first.early else []), link.finish(second)], first.early


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_a_step_in_two_parts_lands_both_and_sets_each_part_up_once(transport: str) -> None:
    """Three steps of two parts, the source's bytes changing each step: after each, the target holds both
    halves of that step; the first step sets both parts' data paths up, the later ones none (each part keeps
    its own transport: alternating parts would otherwise set one up again every step)."""
    with sync_pair(N, transport, STALL) as (port, link, src, dst):
        for step in (1, 2, 3):
            pair, stats, overlapped = _step(port, link, src, dst, step, 10 + step, 20 + step)
            assert pair.runs == 2, pair
            assert [s.setup for s in stats] == [step == 1] * 2, (step, stats)
            assert overlapped == (transport == "ipc" and step > 1), "a warm ipc step's parts overlap, no other's"
            assert pair.setup == (step == 1)
        # the target keeps one transport per part, the second under its own name
        assert sorted(port._feeds[3].transports) == [transport, f"{transport}#1"]


def test_a_warm_ipc_steps_second_part_lands_while_its_first_still_does(monkeypatch: Any) -> None:
    """The target takes a warm ipc pair's second part in while its first still lands (each part has its own
    transport; the second offer follows the first part's done at once) -- a first part slow to land (0.4 s
    here) no longer holds the second up -- and still answers in the order the source reads (part 0's accept
    and ack, then part 1's): every step lands whole.  A step that sets the data paths up lands its parts in
    turn."""
    from tensorxfer.sync.link import _Feed

    spans: list[tuple[int, int, float, float]] = []     # (step, part, data start, data end)
    landing = _Feed._data

    def slow_first(self: Any, fs: Any, tell: bool = True) -> Any:
        part = 0 if self.transports.get("ipc") is fs.transport else 1
        t0 = time.monotonic()
        try:
            if part == 0:
                time.sleep(0.4)
            return landing(self, fs, tell)
        finally:
            spans.append((fs.version, part, t0, time.monotonic()))
    monkeypatch.setattr(_Feed, "_data", slow_first)
    with sync_pair(N, "ipc", STALL) as (port, link, src, dst):
        for step in (1, 2, 3):
            _step(port, link, src, dst, step, 30 + step, 40 + step)
    (*_, a1), (*_, b0, _) = sorted(x for x in spans if x[0] == 1)
    assert b0 >= a1, "the step that set the data paths up took its second part in before its first landed"
    for step in (2, 3):
        (*_, a1), (*_, b0, _) = sorted(x for x in spans if x[0] == step)
        assert b0 < a1 - 0.2, f"step {step}: the second part waited for the first to land"


def test_push_runs_every_part_in_turn_and_adds_their_stats() -> None:
    with sync_pair(N, "tcp", STALL) as (port, link, src, dst):
        _fill(src, 5, 6)
        got, receiving = _receive(port, dst, (FIRST, SECOND), 1)
        stats = link.push(src, (FIRST, SECOND), 1, "d")
        receiving.join(20)
        assert got[3][0] == 1 and _halves(dst) == ({6}, {5})
        assert stats.bytes == N and stats.runs == 2 and stats.seconds >= 0
        # when each part ended, from the first part's offer: in order, the last at the step's end
        first, second = stats.part_seconds
        assert 0 < first <= second == stats.seconds, stats
        assert stats.as_dict()["part_seconds"] == [first, second]
        got, receiving = _receive(port, dst, (FIRST,), 2)
        one = link.push(src, FIRST, 2, "d")     # a step of one part says its end in ``seconds`` alone
        receiving.join(20)
        assert got[3][0] == 2 and one.part_seconds == () and one.bytes == N // 2


def test_a_source_that_cuts_the_step_otherwise_is_refused_before_its_part_lands() -> None:
    """The target expects two parts; the source offers the second half as part 0 (one cut of the step
    less): PlanError naming the part, and nothing of it written."""
    with sync_pair(N, "tcp", STALL) as (port, link, src, dst):
        _fill(src, 1, 2)
        got, receiving = _receive(port, dst, (FIRST, SECOND), 1)
        step = link.offer(src, FIRST, 1, "d", 1)
        link.post(step)
        with pytest.raises(tx.TensorXferError):
            link.finish(step)
        receiving.join(20)
        assert isinstance(got[3], tx.PlanError) and "part 1 of its step where this target expects part 0" in \
            str(got[3]), got[3]
        assert _halves(dst) == ({0}, {0})


def test_a_refusal_between_the_parts_fails_the_step_naming_the_tensor() -> None:
    """The first part lands; then the source cannot make the second (its quantization met a NaN): it
    refuses instead of offering, and the target's step ends with that QuantizationError, the second half
    untouched."""
    with sync_pair(N, "tcp", STALL) as (port, link, src, dst):
        _fill(src, 3, 4)
        got, receiving = _receive(port, dst, (FIRST, SECOND), 1)
        first = link.offer(src, FIRST, 1, "d", 0)
        link.post(first)
        link.finish(first)
        link.refuse("quantization", "a block of 'w' holds a NaN", "w")
        receiving.join(20)
        assert isinstance(got[3], tx.QuantizationError) and got[3].tensor == "w", got[3]
        assert _halves(dst) == ({0}, {3}), "the first part landed, nothing of the second"


def test_a_source_that_stalls_between_the_parts_is_named_within_the_stall_timeout() -> None:
    with sync_pair(N, "tcp", STALL) as (port, link, src, dst):
        _fill(src, 3, 4)
        t0 = time.monotonic()
        got, receiving = _receive(port, dst, (FIRST, SECOND), 1)
        first = link.offer(src, FIRST, 1, "d", 0)
        link.post(first)
        link.finish(first)
        receiving.join(STALL + 10)
        assert not receiving.is_alive(), "the target waited for the second part for good"
        assert isinstance(got[3], tx.TransferTimeout), got[3]
        assert time.monotonic() - t0 < STALL + 5


def test_a_target_refuses_a_second_part_of_another_version() -> None:
    """A fixed group (no step number to check against): part 0 as version 1, part 1 as version 2 -- the
    target refuses the step (ProtocolError naming both), instead of reporting either version."""
    with sync_pair(N, "tcp", STALL) as (port, link, src, dst):
        _fill(src, 3, 4)
        got: dict[int, Any] = {}
        receiving = threading.Thread(target=lambda: got.update(port.step(dst, {3: (FIRST, SECOND)}, None, "d", None)),
                                     daemon=True)
        receiving.start()
        first = link.offer(src, FIRST, 1, "d", 0)
        link.post(first)
        link.finish(first)
        second = link.offer(src, SECOND, 2, "d", 1)
        link.post(second)
        try:
            link.finish(second)
        except tx.TensorXferError:
            pass
        receiving.join(20)
        assert isinstance(got[3], tx.ProtocolError) and "as version 2, its part 0 as 1" in str(got[3]), got[3]


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_a_weight_sync_whose_pairs_come_in_parts_lands_every_step(monkeypatch: Any, transport: str) -> None:
    """The weight sync's own push and wait with every pair's step in two parts (on a GPU only a fused pair's
    are: its tiles, then its runs; here any pair of two groups or more is cut in half, and its first half
    offered as if it read nothing the source makes): after each of 3 steps every target holds the step's
    weights.  Over ipc (warm pairs post early) a pair's second part is offered before its first is acked;
    over tcp (the data follows the accept) only after the first finished."""
    torch = pytest.importorskip("torch", reason="the weight sync's tensors are torch tensors")
    from tensorxfer.sync import fusing, weight_sync
    from tensorxfer.sync.link import SourceLink
    from tests.test_sync import test_sources_sharded_one_way_land_in_targets_sharded_another as sync_three_steps

    columns = ("src_off", "dst_off", "nbytes", "count", "src_stride", "dst_stride")
    split: list[int] = []

    def halves(segments: Segments) -> tuple[Segments, ...]:
        if len(segments) < 2:
            return (segments,)
        k = len(segments) // 2
        split.append(k)
        return tuple(Segments(*(getattr(segments, c)[a:b] for c in columns)) for a, b in ((0, k), (k, len(segments))))
    monkeypatch.setattr(fusing, "parts", halves)
    monkeypatch.setattr(weight_sync, "early", lambda steps: len(steps) == 2)
    events: list[tuple[int, str, int, int]] = []       # (link, what, seq, part)
    offer, finish = SourceLink.offer, SourceLink.finish

    def offered(self: Any, *a: Any, **kw: Any) -> Any:
        step = offer(self, *a, **kw)
        events.append((id(self), "offer", step.seq, a[4] if len(a) > 4 else kw.get("part", 0)))
        return step

    def finished(self: Any, step: Any) -> Any:
        events.append((id(self), "finish", step.seq, -1))
        return finish(self, step)
    monkeypatch.setattr(SourceLink, "offer", offered)
    monkeypatch.setattr(SourceLink, "finish", finished)

    sync_three_steps(transport, 2, 2, torch.float32)
    assert split, "no pair was cut in parts"
    overlapped = 0
    for link in {e[0] for e in events}:
        mine = [e for e in events if e[0] == link]
        for i, (_, what, seq, part) in enumerate(mine):
            if what == "offer" and part == 1:
                first_done = any(e[1] == "finish" and e[2] == seq - 1 for e in mine[:i])
                assert first_done or transport == "ipc", "a tcp pair's second part offered before its first finished"
                overlapped += not first_done
    assert (overlapped > 0) == (transport == "ipc"), overlapped
