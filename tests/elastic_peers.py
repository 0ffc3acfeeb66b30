"""The processes of the elastic weight-sync tests: sources driven step by step, targets that report.

    python -m tests.elastic_peers source RANK STORE_URL LAYOUT     # reads "push V" / "exit" lines on stdin
    python -m tests.elastic_peers target RANK STORE_URL            # waits for steps until SIGTERM

Every line they print is JSON.  The model is two tensors whose values depend only on the version, so the
test computes what a target must hold: ``a`` (8 x 6) and ``b`` (5,).  ``LAYOUT`` says what the two
sources hold: ``sharded`` (``a`` chunked along dim 0 over the sources, ``b`` on both) or ``replicated``
(both whole on both).  Every target holds the whole model (an inference replica), or with
``ELASTIC_PEERS_TARGETS=sharded`` only its chunk of ``a`` (target r is then fed by source r alone).

Other knobs (environment): ``ELASTIC_PEERS_TOKEN`` (``none``: a tokenless group), ``ELASTIC_PEERS_STALL``
(the stall timeout), ``ELASTIC_PEERS_WAIT`` (a target's wait timeout; ``none``: wait() without one),
``ELASTIC_PEERS_GROUP`` (the group's name).
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import signal
import sys
import time
from typing import Any

import torch

import tensorxfer as tx
from tensorxfer.sync import Source, Target

SOURCES, TARGETS = 2, 2
SHAPES = {"a": (8, 6), "b": (5,)}
STALL = float(os.environ.get("ELASTIC_PEERS_STALL", "5"))
TOKEN = None if os.environ.get("ELASTIC_PEERS_TOKEN") == "none" else os.environ.get("ELASTIC_PEERS_TOKEN", "el")
WAIT = os.environ.get("ELASTIC_PEERS_WAIT", "120")
GROUP = os.environ.get("ELASTIC_PEERS_GROUP", "elastic")
# ELASTIC_PEERS_COPY_HOST=1: the peers talk ipc and the targets copy through one of them (the copy host)
COPY_HOST = os.environ.get("ELASTIC_PEERS_COPY_HOST") == "1"
TRANSPORT = "ipc" if COPY_HOST else "tcp"


def model(version: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 + version)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def digests(tensors: dict[str, Any]) -> dict[str, str]:
    return {n: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest() for n, t in sorted(tensors.items())}


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def target_layout() -> str:
    """``whole`` or ``sharded`` (read when asked: a test sets it after importing this module)."""
    return os.environ.get("ELASTIC_PEERS_TARGETS", "whole")


def target_share(rank: int, tensors: dict[str, Any]) -> dict[str, Any]:
    """What target ``rank`` holds of the model ``tensors`` (the whole of it, or its chunk of ``a``)."""
    if target_layout() == "whole":
        return tensors
    box = tx.sync.chunk_box(SHAPES["a"], 0, rank, TARGETS)
    return {"a": tensors["a"][box.offsets[0]:box.offsets[0] + box.sizes[0]]}


def local_shards(rank: int, layout: str, version: int) -> dict[str, Any]:
    m = model(version)
    if layout == "replicated":
        return dict(m)
    box = tx.sync.chunk_box(SHAPES["a"], 0, rank, SOURCES)
    return {"a": m["a"][box.offsets[0]:box.offsets[0] + box.sizes[0]].clone(), "b": m["b"]}


def source(rank: int, url: str, layout: str) -> int:
    shards = local_shards(rank, layout, 0)
    tensors = {"a": Source.whole(shards["a"]) if layout == "replicated" else
               Source.shard(shards["a"], SHAPES["a"], 0, rank, SOURCES), "b": Source.whole(shards["b"])}
    sync = tx.WeightSync(url, GROUP, "source", rank, (SOURCES, TARGETS), tensors, token=TOKEN, transport=TRANSPORT,
                         stall_timeout=STALL, timeout=60)
    say(ready=True)
    try:
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "exit":
                break
            version = int(cmd[1])
            for name, value in local_shards(rank, layout, version).items():
                tensors[name].tensor.copy_(value)        # the trainer's step, in place
            try:
                stats = sync.push()
                say(version=stats.version, epoch=stats.epoch, failed=stats.failed, bytes=stats.bytes,
                    targets=sorted(p.target for p in stats.pairs))
            except tx.TensorXferError as e:
                say(error=type(e).__name__, message=str(e))
    finally:
        sync.close()
    return 0


def target(rank: int, url: str) -> int:
    if target_layout() == "whole":
        tensors = {n: Target.whole(torch.zeros(s), n) for n, s in SHAPES.items()}
    else:
        box = tx.sync.chunk_box(SHAPES["a"], 0, rank, TARGETS)
        tensors = {"a": Target.shard(torch.zeros(box.sizes), "a", SHAPES["a"], 0, rank, TARGETS)}
    sync = tx.WeightSync(url, GROUP, "target", rank, (SOURCES, TARGETS), tensors, token=TOKEN, transport=TRANSPORT,
                         stall_timeout=STALL, timeout=60, copy_host=COPY_HOST)
    host = sync._copy_host      # this target copies for the others on its device (COPY_HOST)
    say(ready=True, hosting=host is not None)
    try:
        while True:
            t0 = time.monotonic()
            try:
                version = sync.wait(timeout=None if WAIT == "none" else float(WAIT))
            except tx.TensorXferError as e:
                say(error=type(e).__name__, message=str(e), seconds=time.monotonic() - t0)
                continue
            views = sync.region.tensors(framework="torch")      # type: ignore[union-attr]
            live = all(views[n].data_ptr() == t.tensor.data_ptr() for n, t in tensors.items())
            say(version=version, epoch=sync.last_stats.epoch, live=live,       # type: ignore[union-attr]
                sha=digests({n: t.tensor for n, t in tensors.items()}), hosted=host.copies if host else 0)
    finally:
        sync.close()


def _stop(*_: Any) -> None:
    raise SystemExit(0)


if __name__ == "__main__":
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, _stop)
    faulthandler.register(signal.SIGUSR1)       # a test that sees a peer stuck dumps its threads to stderr
    role, rank, url = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    sys.exit(source(rank, url, sys.argv[4]) if role == "source" else target(rank, url))
