"""The rendezvous on ``torch.distributed``'s stores: TCPStore (embedded, the default) or any ``Store``."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

from tensorxfer.errors import TransferTimeout
from tensorxfer.sync.rendezvous.base import Rendezvous


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

    def read(self, keys: Sequence[str], timeout: float) -> list[bytes]:
        keys = list(keys)
        if not keys:
            return []
        try:
            self.store.wait(keys, datetime.timedelta(seconds=max(timeout, 1e-3)))
        except Exception as e:      # torch raises DistStoreError / RuntimeError on a timeout
            missing = [k for k in keys if not self.store.check([k])]
            if not missing:
                raise
            raise TransferTimeout(f"rendezvous: {len(missing)} key(s) not published within {timeout:.0f} s, e.g. "
                                  f"{missing[:4]} (the ranks that own them did not start, or died)") from e
        return [bytes(v) for v in self.store.multi_get(keys)]
