"""Guards of the weight sync that no other test could see fail (issue 37): the plan digest covers who sends
each balanced cut; a target refuses an offer of another version or another plan digest; a group whose ranks
computed different plans at formation refuses to form on every rank.

Each test changes one value a buggy or hostile rank would produce and leaves everything else real (the
planner, loopback sessions, a TCPStore)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import threading
from typing import Any

import numpy as np
import pytest

import tensorxfer as tx
from tensorxfer.sync import Piece, RankSpec, SourceTensor, TargetTensor, plan, replicate_box
from tests.helpers import sync_pair

plan_module = importlib.import_module("tensorxfer.sync.plan")   # the module (tensorxfer.sync.plan is the function)


# ---- the plan digest covers the holders of the balancing cuts ------------------------------------------------


def _replicas_to_one_target(shape: tuple[int, int]) -> tuple[list[RankSpec], list[RankSpec]]:
    """Two sources holding the whole tensor (replicas), one target wanting it whole: the planner cuts it in
    two and gives each replica one part."""
    whole = replicate_box(shape)
    sources = [RankSpec("source", r, [SourceTensor("w", shape, "F32", whole, 0)]) for r in range(2)]
    targets = [RankSpec("target", 0, [TargetTensor("w", shape, "F32", 0, (Piece("w", whole, (0, 0)),))])]
    return sources, targets


def _sent_by(p: Any) -> dict[int, list[tuple[int, int]]]:
    """Source rank -> the (target offset, bytes) it writes into target 0."""
    out: dict[int, list[tuple[int, int]]] = {}
    for (src, _), runs in p.pairs.items():
        _, dst, nbytes = runs.flat()
        out[src] = [(int(d), int(n)) for d, n in zip(dst, nbytes)]
    return out


def _holders_swapped(cells: Any) -> Any:
    """``cells`` with every multi-holder cell's holders in the opposite slot order (cut i to another rank)."""
    entries, ptr = cells.entries.copy(), cells.ptr
    for c in np.flatnonzero(np.diff(ptr) > 1).tolist():
        entries[ptr[c]:ptr[c + 1]] = entries[ptr[c]:ptr[c + 1]][::-1].copy()
    return dataclasses.replace(cells, entries=entries)


def test_plans_that_differ_only_in_who_sends_a_balanced_cut_have_different_digests(monkeypatch) -> None:
    """Same inputs, same cut, same cells: only the holder each part goes to differs.

    Every input is in the digest, so plans of different inputs differ anyway; what the holders guard is two
    ranks whose planners (another version, a bug) hand the parts of a holder set to its holders in another
    order.  The other-order planner is the real one with its holders read in the opposite slot order where
    it chooses them (the line and the runs), after the cells were hashed: nothing else changes."""
    shape = (8, 4)
    sources, targets = _replicas_to_one_target(shape)
    honest = plan(sources, targets)
    half = shape[0] * shape[1] * 4 // 2
    assert _sent_by(honest) == {0: [(0, half)], 1: [(half, half)]}, "the lower rank sends the first part"

    runs_module = plan_module._runs
    real_line, real_finish = runs_module.line, runs_module.finish
    monkeypatch.setattr(runs_module, "line", lambda g, cells, *a: real_line(g, _holders_swapped(cells), *a))
    monkeypatch.setattr(runs_module, "finish", lambda g, cells, *a: real_finish(g, _holders_swapped(cells), *a))
    other = plan(sources, targets)
    monkeypatch.undo()

    assert _sent_by(other) == {1: [(0, half)], 0: [(half, half)]}, "the same cut, its parts sent by the other rank"
    assert other.pair_bytes == honest.pair_bytes
    assert other.digest != honest.digest, "two plans that send the parts from different ranks share a digest"
    assert plan(sources, targets).digest == honest.digest


# ---- a target refuses an offer of another version or another plan ---------------------------------------------


def _step(port: Any, link: Any, src: Any, dst: Any, segments: Any, *, planned: str, step: int, offered: str,
          version: int) -> tuple[Any, BaseException | None]:
    """One step: the target expects ``step`` of the plan ``planned``, the source offers ``version`` as
    ``offered``.  (The target's outcome for source 3, the source's error or None.)"""
    got: dict[int, Any] = {}
    # no time limit on the offer (None means that whether step() takes a timeout or a deadline): it is sent next
    receiving = threading.Thread(target=lambda: got.update(port.step(dst, {3: segments}, None, planned, step)))
    receiving.start()
    error: BaseException | None = None
    try:
        link.push(src, segments, version, offered)
    except tx.TensorXferError as e:
        error = e
    receiving.join(10)
    assert not receiving.is_alive(), "the target hung"
    return got[3], error


def _fill(region: Any, value: int) -> None:
    mv = memoryview(region.region)
    mv[:16] = bytes([value]) * 16
    mv.release()


def _first16(region: Any) -> bytes:
    mv = memoryview(region.region)
    try:
        return bytes(mv[:16])
    finally:
        mv.release()


@pytest.mark.parametrize("wrong", ["version", "stale_version", "digest"])
def test_an_offer_of_another_version_or_another_plan_is_refused_before_any_byte_moves(wrong: str) -> None:
    """Step 1 goes through; step 2's offer carries the right segments (bytes and runs digest) but either a
    version other than the step the target waits for, or another plan's digest: a PlanError on the target,
    an error on the source, and the target's bytes untouched."""
    from tensorxfer.transport.segments import Segments

    segments = Segments.of([0, 8], [0, 8], [8, 8])
    with sync_pair(16, src_fill=7) as (port, link, src, dst):
        outcome, error = _step(port, link, src, dst, segments, planned="d", step=1, offered="d", version=1)
        assert error is None and outcome[0] == 1, outcome
        assert _first16(dst) == bytes([7]) * 16, "the honest step lands"

        _fill(src, 9)
        if wrong == "version":      # a source ahead of the step: it sends version 3 while the targets wait for 2
            outcome, error = _step(port, link, src, dst, segments, planned="d", step=2, offered="d", version=3)
            message = "source 3 sends version 3 for step 2"
        elif wrong == "stale_version":  # a source behind: it sends version 1 again
            outcome, error = _step(port, link, src, dst, segments, planned="d", step=2, offered="d", version=1)
            message = "source 3 sends version 1 for step 2"
        else:                       # a source that planned the step otherwise (the same runs for this pair)
            outcome, error = _step(port, link, src, dst, segments, planned="d", step=2, offered="e", version=2)
            message = "source 3 planned this step as e, this target as d"
        assert isinstance(outcome, tx.PlanError) and message in str(outcome), outcome
        assert isinstance(error, tx.TensorXferError) and message in str(error), error
        assert _first16(dst) == bytes([7]) * 16, "bytes moved despite the refusal"


# ---- a group whose ranks computed different plans refuses to form ---------------------------------------------


def _form_group(group: str, torch: Any) -> list[BaseException | None]:
    """Source 0 and targets 0 and 1 construct their WeightSync at once (threads, one TCPStore): what each
    constructor raised, or None (a sync that formed is closed here, so nothing outlives this call)."""
    from tensorxfer.sync import Source, Target
    from tests.test_sync import Stores

    stores = Stores()
    w = torch.randn(4, 4)
    makers = [lambda: tx.WeightSync(stores.client(), group, "source", 0, (1, 2), {"w": Source.whole(w)},
                                    transport="tcp", timeout=20, elastic=False)]
    makers += [lambda r=r: tx.WeightSync(stores.client(), group, "target", r, (1, 2),
                                         {"w": Target.whole(torch.zeros(4, 4), "w")}, transport="tcp", timeout=20,
                                         elastic=False) for r in range(2)]
    results: list[Any] = [None] * len(makers)

    def run(i: int) -> None:
        try:
            results[i] = makers[i]()
        except BaseException as e:
            results[i] = e
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(makers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    for r in results:
        if isinstance(r, tx.WeightSync):
            r.close()
    return [r if isinstance(r, BaseException) else None for r in results]


def test_ranks_that_computed_another_plan_at_formation_are_refused_on_every_rank(monkeypatch) -> None:
    """Target rank 1's planner comes out with another digest (as a rank with another planner or other shard
    descriptions would): every rank of the group -- the source, the other target and rank 1 itself -- raises
    PlanError "computed another plan" from its constructor instead of forming the group."""
    torch = pytest.importorskip("torch", reason="the weight sync's tensors are torch tensors")
    from tensorxfer.sync import weight_sync as weight_sync_module

    real_plan = weight_sync_module.plan

    def planner(sources: Any, targets: Any, *, scope: Any = None) -> Any:
        p = real_plan(sources, targets, scope=scope)
        if scope == ("target", 1):
            p.digest = hashlib.sha256(b"another planner").hexdigest()
        return p
    monkeypatch.setattr(weight_sync_module, "plan", planner)

    outcomes = _form_group("agree", torch)
    for who, error in zip(["source 0", "target 0", "target 1"], outcomes, strict=True):
        assert isinstance(error, tx.PlanError) and "computed another plan" in str(error), \
            f"{who}: {error!r}" if error is not None else f"{who} formed the group with a rank that planned otherwise"
