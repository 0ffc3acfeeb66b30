"""The rendezvous on etcd v3, the store clusters already run (NIXL and Mooncake keep their metadata there).

Client: ``etcd3gw`` (``pip install tensorxfer[etcd]``), chosen because it is maintained (OpenStack's,
regular releases) and talks to etcd's own HTTP/JSON gateway with ``requests`` only.  The gRPC clients
are either abandoned (``etcd3``, last release 2020, breaks on protobuf >= 4) or pin a grpcio/protobuf
that fights the one PyTorch brings.

Membership keys live under one lease per rendezvous, kept alive by a thread at a third of its TTL: a
process that dies (or hangs past the TTL) has its records deleted by etcd itself, so the others see it
gone without any session failing.  Many keys are read in one request (a transaction of ranges), and
``publish_once`` is a transaction on the key's create revision.
"""

from __future__ import annotations

import base64
import logging
import threading
from collections.abc import Sequence
from typing import Any

from tensorxfer.errors import TransferError
from tensorxfer.sync.rendezvous.base import Rendezvous

log = logging.getLogger(__name__)

MAX_TXN_OPS = 128           # etcd's default --max-txn-ops
DEFAULT_TTL = 10            # seconds a dead rank's membership outlives it
WATCH_SLICE = 1.0           # seconds one watch waits before the keys are read again


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(data: str) -> bytes:
    return base64.b64decode(data)


class EtcdRendezvous(Rendezvous):
    """:class:`Rendezvous` on an etcd v3 server at ``host:port`` (its client URL, e.g. 2379).

    Parameters
    ----------
    ttl : int
        Seconds this rank's membership outlives it (the lease's TTL, refreshed every ``ttl/3``).
    timeout : float
        Seconds one request to etcd may take.

    Raises
    ------
    TransferError
        etcd cannot be reached (the message names the address).
    """

    has_leases = True

    def __init__(self, host: str = "127.0.0.1", port: int = 2379, ttl: int = DEFAULT_TTL,
                 timeout: float = 10.0) -> None:
        try:
            import etcd3gw
        except ImportError:
            raise ImportError("the etcd rendezvous needs etcd3gw: pip install 'tensorxfer[etcd]'") from None
        self.address = f"{host}:{port}"
        self.ttl = max(2, int(ttl))
        self._client = etcd3gw.client(host=host, port=port, timeout=timeout, api_path="/v3/")
        self._lock = threading.Lock()
        self._lease: Any = None
        self._joined: dict[str, bytes] = {}        # key -> value, put again if the lease was lost
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self._call(self._client.status)            # fail now, with the address, if etcd is not there

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from etcd3gw.exceptions import Etcd3Exception

        try:
            return fn(*args, **kwargs)
        except Etcd3Exception as e:
            raise TransferError(f"etcd at {self.address}: {type(e).__name__}: {e} (is etcd running there? "
                                f"start one with `etcd --listen-client-urls http://{self.address} ...`)") from None

    def _txn(self, success: list[dict[str, Any]], compare: list[dict[str, Any]] | None = None,
             failure: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return self._call(self._client.transaction, {"compare": compare or [], "success": success,
                                                     "failure": failure or []})

    def publish(self, key: str, value: bytes) -> None:
        self._call(self._client.put, key, value)

    def peek(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._peek_at(keys)[0]

    def _peek_at(self, keys: Sequence[str]) -> tuple[list[bytes | None], int]:
        """The values of ``keys`` and the store revision they were read at (the earliest, over chunks)."""
        keys = list(keys)
        out: list[bytes | None] = []
        revision = 0
        for i in range(0, len(keys), MAX_TXN_OPS):
            chunk = keys[i:i + MAX_TXN_OPS]
            reply = self._txn([{"request_range": {"key": _b64(k)}} for k in chunk])
            rev = int(reply.get("header", {}).get("revision", 0))
            revision = rev if not revision else min(revision, rev)
            for r in reply.get("responses", [{}] * len(chunk)):
                kvs = r.get("response_range", {}).get("kvs", [])
                out.append(_unb64(kvs[0].get("value", "")) if kvs else None)
        return out, revision

    def _await(self, key: str, cursor: Any, left: float, attempt: int) -> None:
        """An etcd watch on ``key`` from the revision the keys were read at (nothing put in between is
        missed), not polling: a step record reaches every waiting rank at once, and hundreds of waiting
        ranks do not poll the store.  A slice's timeout only makes :meth:`read` look at every key again."""
        from etcd3gw.exceptions import Etcd3Exception, WatchTimedOut

        try:
            self._client.watch_once(key, timeout=min(left, WATCH_SLICE), start_revision=cursor + 1 if cursor else None)
        except WatchTimedOut:
            pass
        except Etcd3Exception as e:
            raise TransferError(f"etcd at {self.address}: watching {key!r} failed: {e}") from None

    def publish_many(self, items: dict[str, bytes]) -> None:
        keys = list(items)
        for i in range(0, len(keys), MAX_TXN_OPS):
            self._txn([{"request_put": {"key": _b64(k), "value": _b64(items[k])}} for k in keys[i:i + MAX_TXN_OPS]])

    def has(self, key: str) -> bool:
        reply = self._call(self._client.post, self._client.get_url("/kv/range"),
                           json={"key": _b64(key), "count_only": True})
        return int(reply.get("count", 0)) > 0

    def publish_once(self, key: str, value: bytes) -> bytes:
        k = _b64(key)
        reply = self._txn([{"request_put": {"key": k, "value": _b64(value)}}],
                          compare=[{"key": k, "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
                          failure=[{"request_range": {"key": k}}])
        if reply.get("succeeded"):
            return value
        kvs = reply["responses"][0].get("response_range", {}).get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else self.publish_once(key, value)   # deleted meanwhile

    # ------------------------------------------------------------ membership (under this rank's lease)
    def join(self, prefix: str, name: str, value: bytes) -> None:
        key = f"{prefix}/{name}"
        with self._lock:
            if self._lease is None:
                self._lease = self._call(self._client.lease, self.ttl)
            self._call(self._client.put, key, value, lease=self._lease)
            self._joined[key] = value
            if self._keeper is None:
                self._keeper = threading.Thread(target=self._keep_alive, name="tensorxfer-etcd-lease", daemon=True)
                self._keeper.start()

    def leave(self, prefix: str, name: str) -> None:
        key = f"{prefix}/{name}"
        with self._lock:
            self._joined.pop(key, None)
        self._call(self._client.delete, key)

    def evict(self, prefix: str, name: str, value: bytes) -> bool:
        k = _b64(f"{prefix}/{name}")
        reply = self._txn([{"request_delete_range": {"key": k}}],
                          compare=[{"key": k, "result": "EQUAL", "target": "VALUE", "value": _b64(value)}])
        return bool(reply.get("succeeded"))

    def members(self, prefix: str) -> dict[str, bytes]:
        start = f"{prefix}/"
        items = self._call(self._client.get_prefix, start)
        return {meta["key"].decode(errors="replace")[len(start):]: value for value, meta in items if value}

    def _keep_alive(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                with self._lock:
                    lease, joined = self._lease, dict(self._joined)
                if lease is None:
                    continue
                if lease.refresh() > 0:
                    continue
                # the lease expired (this process was stopped past its TTL): its keys are gone; come back
                log.warning("etcd at %s: this rank's lease expired; joining again", self.address)
                with self._lock:
                    self._lease = self._client.lease(self.ttl)
                    for key, value in joined.items():
                        self._client.put(key, value, lease=self._lease)
            except Exception as e:      # etcd unreachable for a moment: the next tick tries again
                log.warning("etcd at %s: keeping the lease alive failed: %s", self.address, e)

    def close(self) -> None:
        """Stop the keep-alive and revoke the lease (this rank's membership keys go with it); idempotent."""
        self._stop.set()
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.join(5)
        with self._lock:
            lease, self._lease = self._lease, None
            self._joined.clear()
        if lease is not None:
            try:
                lease.revoke()
            except Exception as e:      # etcd gone: the lease expires on its own
                log.debug("etcd at %s: revoking the lease failed: %s", self.address, e)
        session = getattr(self._client, "session", None)
        if session is not None:
            session.close()
