"""The rendezvous on ``torch.distributed``'s stores: TCPStore (embedded, the default) or any ``Store``.

These stores have no leases and no listing, so membership is kept by hand: a member's record at
``prefix/name`` and its name in a slot ``prefix#/<n>`` numbered by the store's atomic ``add``; leaving
writes an empty record (a tombstone: a key is never deleted, so no reader can block on a key that went
away between looking and reading).  A rank that dies keeps its record; the sync finds it by its session
failing and by its missing step reports.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from typing import Any

from tensorxfer.sync.rendezvous.base import Rendezvous, not_published

#: the longest one wait on the store blocks: how long Ctrl-C may take to stop a rank waiting for a key
WAIT_SLICE = 0.25


def open_tcp_store(host: str, port: int, is_master: bool, timeout: float = 60.0) -> Any:
    """A ``torch.distributed.TCPStore`` at ``host:port`` (``is_master``: this process hosts it; port 0 picks a
    free one, read it back from ``store.port``)."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=is_master, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))


class TorchStoreRendezvous(Rendezvous):
    """:class:`Rendezvous` over a ``torch.distributed.Store`` the caller owns (TCPStore, FileStore, ...)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def publish(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def peek(self, keys: Sequence[str]) -> list[bytes | None]:
        keys = list(keys)
        if not keys:
            return []
        if self.store.check(keys):      # the usual case, one round trip
            return [bytes(v) for v in self.store.multi_get(keys)]
        present = [k for k in keys if self.store.check([k])]
        got = dict(zip(present, self.store.multi_get(present))) if present else {}
        return [bytes(got[k]) if k in got else None for k in keys]

    def publish_many(self, items: dict[str, bytes]) -> None:
        self.store.multi_set(list(items), list(items.values()))

    def members_version(self, prefix: str) -> int | None:
        return int(self.store.add(f"{prefix}#/version", 0))

    def has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def publish_once(self, key: str, value: bytes) -> bytes:
        return bytes(self.store.compare_set(key, b"", value))

    def read(self, keys: Sequence[str], timeout: float) -> list[bytes]:
        keys = list(keys)
        if not keys:
            return []
        deadline = time.monotonic() + max(timeout, 1e-3)
        while True:
            # in slices: c10d's wait is C++ that no signal interrupts, so a process waiting here for a whole
            # timeout ignored Ctrl-C (SIGINT) until it ended; between slices Python's handlers run
            left = deadline - time.monotonic()
            try:
                self.store.wait(keys, datetime.timedelta(seconds=max(min(left, WAIT_SLICE), 1e-3)))
                break
            except Exception as e:      # torch raises DistStoreError / RuntimeError on a timeout
                missing = [k for k in keys if not self.store.check([k])]
                if not missing:
                    # every key was published just as the wait timed out (a source's leader deciding its step
                    # at LEADER_WAIT): read them; a store that failed otherwise fails the read too
                    break
                if time.monotonic() >= deadline:
                    raise not_published(missing, timeout) from e
        return [bytes(v) for v in self.store.multi_get(keys)]

    def join(self, prefix: str, name: str, value: bytes) -> None:
        if not value:
            raise ValueError("a member record cannot be empty (empty marks a member that left)")
        self.store.set(f"{prefix}/{name}", value)
        slot = self.store.add(f"{prefix}#/count", 1)
        self.store.set(f"{prefix}#/{slot}", name.encode())
        self.store.add(f"{prefix}#/version", 1)

    def leave(self, prefix: str, name: str) -> None:
        if self.store.check([f"{prefix}/{name}"]):
            self.store.set(f"{prefix}/{name}", b"")
            self.store.add(f"{prefix}#/version", 1)

    def evict(self, prefix: str, name: str, value: bytes) -> bool:
        if not value or bytes(self.store.compare_set(f"{prefix}/{name}", value, b"")) != b"":
            return False
        self.store.add(f"{prefix}#/version", 1)
        return True

    def members(self, prefix: str) -> dict[str, bytes]:
        count = int(self.store.add(f"{prefix}#/count", 0))
        slots = self.peek([f"{prefix}#/{i}" for i in range(1, count + 1)])
        # a name another writer put there may be any bytes: kept as text the caller can check and name
        names = list(dict.fromkeys(s.decode(errors="replace") for s in slots if s))
        values = self.peek([f"{prefix}/{n}" for n in names])
        return {n: v for n, v in zip(names, values) if v}
