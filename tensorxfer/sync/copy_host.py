"""Which target of a sync copies for the others on its GPU: the copy host, elected through the store.

Targets whose regions share one GPU -- the same machine, user and mount namespace, the same GPU UUID (each
process may number its GPUs otherwise) -- publish-once a key naming that device; the first one's copy host
(:class:`~tensorxfer.transport.ipc.delegate.CopyHost`) wins, and the others hand it their ipc pairs' copies
(see that module for why: one CUDA context instead of several time-slicing the GPU).  A winner that is gone
(it closed and removed its socket, or its process is gone) is passed over to the key's next generation, so a target
started later still finds a live host; targets that were following a host that went copy locally instead.
Each election first removes the socket directories that hosts killed outright left on this machine
(:func:`~tensorxfer.transport.ipc.delegate.remove_dead_host_dirs`: only those provably a dead host's).
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

import msgpack

from tensorxfer.sync.rendezvous import Rendezvous
from tensorxfer.transport.ipc.delegate import CopyHost, remove_dead_host_dirs
from tensorxfer.transport.ipc.identity import host_identity

log = logging.getLogger(__name__)

GENERATIONS = 16        # hosts that came and went on one device before a new target gives up electing


def device_identity(region: Any) -> str:
    """The machine, user, mount namespace and device of a region (a GPU by its UUID), as a short digest."""
    ident = host_identity()
    device = "host"
    if region.is_cuda:
        import torch

        device = str(torch.cuda.get_device_properties(region.region.device_index).uuid)
    raw = "|".join([ident["boot_id"], str(ident["uid"]), ident["mnt_ns"], device])
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def _alive(pid: int, path: str) -> bool:
    """Whether a host recorded as ``pid`` listening at ``path`` may still serve: its socket is there (a host
    that closed removed it) and its process runs (a killed one leaves the socket file behind)."""
    if pid <= 0 or not os.path.exists(path):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # alive, as another user (the uid is part of the key: a recycled pid)
        return False
    return True


def elect(rdv: Rendezvous, key_of: Any, rank: int, region: Any, token_key: bytes | None,
          stall_timeout: float) -> tuple[CopyHost | None, tuple[str, bytes | None] | None]:
    """``(the copy host this rank runs, or None; (path, key) of the one it follows, or None)``.

    ``key_of(*parts)`` makes the group's store keys.  A rank that runs the host copies its own pairs itself.
    """
    remove_dead_host_dirs()     # a SIGKILLed host cannot remove its own (the record of it is passed over below)
    device = region.region.device_index if region.is_cuda else None
    mine = CopyHost(token_key, device, stall_timeout)
    ident = device_identity(region)
    try:
        for generation in range(GENERATIONS):
            record = msgpack.packb({"rank": rank, "pid": os.getpid(), "path": mine.path})
            won = rdv.publish_once(key_of("copy-host", ident, generation), record)
            if won == record:
                log.info("sync: target %d copies for the targets on its device (copy host %s)", rank, mine.path)
                return mine, None
            try:
                theirs = msgpack.unpackb(won)
                path = str(theirs["path"])
            except Exception:   # not ours to read: pass it over
                continue
            if _alive(int(theirs.get("pid", 0)), path):
                mine.close()
                log.info("sync: target %d hands its device copies to target %s (copy host %s)", rank,
                         theirs.get("rank"), path)
                return None, (path, token_key)
        mine.close()
        log.warning("sync: target %d found %d copy hosts gone on its device; it copies on its own", rank, GENERATIONS)
        return None, None
    except BaseException:
        mine.close()
        raise
