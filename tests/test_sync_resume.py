"""A weight sync step (2 sources -> 2 targets over tcp) in which one pair's data link is cut for real: the
kernel kills that pair's sockets (``SOCK_DESTROY``, as ``ss -K``: an RST to the peer, the local end aborted)
while the step is moving its bytes.  The pair resumes within the step, the step completes for both targets,
and no other pair sends anything again (from their stats)."""

from __future__ import annotations

import json
import os
import threading

import pytest

import tensorxfer as tx
from tensorxfer.sync import Source, Target
from tensorxfer.transport.tcp_streams import Streams
from tests.helpers import destroy_tcp_sockets
from tests.test_sync import Stores, run_ranks

torch = pytest.importorskip("torch", reason="the weight sync's examples are torch tensors")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="destroying sockets (SOCK_DESTROY) needs root")

ROWS, COLS = 8192, 8192         # 256 MiB of float32: 64 MiB per pair


def sources_of(step: int) -> list[dict[str, Source]]:
    g = torch.Generator().manual_seed(step)
    w = torch.randn(ROWS, COLS, generator=g)
    out = []
    for r in range(2):
        box = tx.sync.chunk_box((ROWS, COLS), 0, r, 2)
        out.append({"w": Source(w[box.offsets[0]:box.offsets[0] + box.sizes[0]].clone(), (ROWS, COLS), box)})
    return out


def test_one_pair_cut_mid_step_completes_and_no_other_pair_resends() -> None:
    stores = Stores()
    srcs = sources_of(0)
    tgts = [{"w": Target.shard(torch.zeros(ROWS, COLS // 2), "w", (ROWS, COLS), 1, r, 2)} for r in range(2)]
    syncs = run_ranks(
        [lambda r=r: tx.WeightSync(stores.client(), "cut", "source", r, (2, 2), srcs[r], token="k", transport="tcp",
                                   timeout=30, streams=2) for r in range(2)] +
        [lambda r=r: tx.WeightSync(stores.client(), "cut", "target", r, (2, 2), tgts[r], token="k", transport="tcp",
                                   timeout=30) for r in range(2)])
    sources, targets = syncs[:2], syncs[2:]
    try:
        run_ranks([s.push for s in sources] + [lambda t=t: t.wait(timeout=60) for t in targets])   # set up
        # the pair source 0 -> target 0: its data streams (set up once, reused by every step) on the target
        feed = targets[0]._port._feeds[0].transports["tcp"]
        socks = list(feed._streams.socks)
        pair_bytes = ROWS // 2 * COLS // 2 * 4
        fresh = sources_of(1)
        for r in range(2):
            srcs[r]["w"].tensor.copy_(fresh[r]["w"].tensor)
        cut: list[int] = []
        streams, once = feed._streams, threading.Lock()
        last = streams.moved            # the counts of the step before: a new list once this step begins

        def report(n: int) -> None:
            """Each stream's receive reports its bytes here, in its own thread: the first report past 1/16 of
            the pair has the kernel destroy the sockets before that stream reads on (no race with the step)."""
            Streams.report(streams, n)
            if streams.moved is not last and sum(streams.moved) >= pair_bytes // 16 and once.acquire(False):
                cut.extend(destroy_tcp_sockets(socks))
        streams.report = report  # type: ignore[method-assign]
        try:
            results = run_ranks([s.push for s in sources] + [lambda t=t: t.wait(timeout=60) for t in targets])
        finally:
            del streams.report
        assert cut == [0] * len(socks), cut         # the kernel destroyed every one of the pair's sockets
        assert results[2:] == [2, 2]            # the step completed, as one version, for both targets
        for r in range(2):
            want = torch.chunk(torch.cat([fresh[0]["w"].tensor, fresh[1]["w"].tensor]), 2, 1)[r]
            assert torch.equal(tgts[r]["w"].tensor, want), r
        pairs = {(p.source, p.target, "source"): p for s in results[:2] for p in s.pairs}
        pairs.update({(p.source, p.target, "target"): p for t in targets for p in t.last_stats.pairs})
        print(json.dumps({f"{s}->{t} ({side})": {"bytes": p.bytes, "retries": p.retries, "resent_bytes": p.resent_bytes,
                                                   "recovery_seconds": p.recovery_seconds}
                          for (s, t, side), p in sorted(pairs.items())}))
        assert len(pairs) == 8
        for (source, target, side), p in pairs.items():
            if (source, target) == (0, 0):
                assert p.retries >= 1 and p.bytes == pair_bytes, (side, p)
            else:
                assert p.retries == 0 and p.resent_bytes == 0, (source, target, side, p)
        assert pairs[(0, 0, "source")].resent_bytes <= 16 << 20     # what was in flight, not the pair's 64 MiB
    finally:
        for s in syncs:
            s.close()
