"""Where the ranks of a weight sync find each other: a small key-value interface over a store clusters run.

:class:`Rendezvous` is all the sync layer asks of a store (keys, first-writer-wins keys, membership);
:class:`TorchStoreRendezvous` implements it on any ``torch.distributed.Store`` (a ``TCPStore`` hosted by
source rank 0 by default) and :class:`EtcdRendezvous` on etcd v3, whose leases drop a dead rank on their
own.  The planner and the execution never see the store.  :func:`connect` opens one from a URL.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlsplit

from tensorxfer.sync.rendezvous.base import Rendezvous
from tensorxfer.sync.rendezvous.etcd import EtcdRendezvous
from tensorxfer.sync.rendezvous.torchstore import TorchStoreRendezvous, open_tcp_store

__all__ = ["EtcdRendezvous", "Rendezvous", "TorchStoreRendezvous", "connect", "open_tcp_store"]


def connect(url: str, **options: Any) -> Rendezvous:
    """A rendezvous from a URL: ``etcd://host:2379`` (etcd v3; ``?ttl=10`` sets the seconds a dead rank's
    membership outlives it) or ``tcp://host:port`` (a client of a running ``torch.distributed.TCPStore``).
    ``options`` (and the URL's query) go to the store's constructor (etcd: ``ttl``, ``timeout``).

    Raises
    ------
    ValueError
        The URL's scheme is neither, or it has no port.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("etcd", "tcp") or not parts.hostname or parts.port is None:
        raise ValueError(f"rendezvous URL {url!r}: expected etcd://HOST:PORT or tcp://HOST:PORT (a TCPStore)")
    for name, value in parse_qsl(parts.query):
        if name not in ("ttl", "timeout"):
            raise ValueError(f"rendezvous URL {url!r}: unknown option {name!r} (known: ttl, timeout)")
        options.setdefault(name, float(value))
    if parts.scheme == "etcd":
        if "ttl" in options:
            options["ttl"] = int(options["ttl"])
        return EtcdRendezvous(parts.hostname, parts.port, **options)
    return TorchStoreRendezvous(open_tcp_store(parts.hostname, parts.port, False, **options))
