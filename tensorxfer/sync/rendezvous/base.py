"""The rendezvous interface: what a weight sync needs of a store, and nothing more.

Two kinds of keys: plain ones (published once or overwritten, read by everyone) and *membership* keys
(``join`` / ``leave`` / ``members``): a rank's record that says it is alive.  On a store with leases
(etcd) a membership key dies with its process; on one without (``torch.distributed`` stores) it stays
until the rank leaves or another rank evicts it, and a dead rank is found by its session failing.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from tensorxfer.errors import TransferTimeout

_POLL = (0.002, 0.05)       # first and longest pause between polls of a key that is not there yet


def not_published(missing: Sequence[str], timeout: float) -> TransferTimeout:
    """The error of a read whose ``missing`` keys no rank published within ``timeout`` seconds."""
    return TransferTimeout(f"rendezvous: {len(missing)} key(s) not published within {timeout:.0f} s, e.g. "
                           f"{list(missing[:4])} (the ranks that own them did not start, or died)")


class Rendezvous(ABC):
    """A key-value store shared by every rank of a sync group (keys are already namespaced by the caller).

    Values are bytes.  Every wait is bounded: a rank that never publishes is named in a
    :class:`~tensorxfer.errors.TransferTimeout`, never a hang.
    """

    has_leases = False      # True where a dead process's membership keys expire on their own

    @abstractmethod
    def publish(self, key: str, value: bytes) -> None:
        """Set ``key`` (overwriting)."""

    @abstractmethod
    def peek(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values of ``keys`` now (None where a key is not set), without waiting."""

    def publish_many(self, items: dict[str, bytes]) -> None:
        """Set several keys (one request where the store allows)."""
        for key, value in items.items():
            self.publish(key, value)

    def members_version(self, prefix: str) -> int | None:
        """A number that changes whenever a member under ``prefix`` joins or leaves, if the store keeps one
        (None: it does not, list the members to know); lets a caller skip listing an unchanged group."""
        return None

    def has(self, key: str) -> bool:
        """Whether ``key`` is set (without moving its value where the store allows)."""
        return self.peek([key])[0] is not None

    @abstractmethod
    def publish_once(self, key: str, value: bytes) -> bytes:
        """Set ``key`` unless it is set already; return what it holds (the first writer's value wins)."""

    @abstractmethod
    def join(self, prefix: str, name: str, value: bytes) -> None:
        """Make ``prefix/name`` a member record, alive while this rendezvous holds it (see the module doc)."""

    @abstractmethod
    def leave(self, prefix: str, name: str) -> None:
        """Remove the member ``prefix/name`` (this rank leaving, or evicting a dead one); idempotent."""

    @abstractmethod
    def evict(self, prefix: str, name: str, value: bytes) -> bool:
        """Remove the member ``prefix/name`` only if its record is still ``value`` (another rank dropping a
        dead one must not remove the record a new incarnation just wrote); whether it was removed."""

    @abstractmethod
    def members(self, prefix: str) -> dict[str, bytes]:
        """The live member records under ``prefix``: name -> value."""

    def read(self, keys: Sequence[str], timeout: float) -> list[bytes]:
        """The values of ``keys``, waiting up to ``timeout`` seconds for all of them: read them, and while
        some are missing, wait for the first missing one (:meth:`_await`) and read again.

        Raises
        ------
        TransferTimeout
            Some keys were still missing; the message names them.
        """
        keys = list(keys)
        deadline = time.monotonic() + timeout
        attempt = 0
        while True:
            values, cursor = self._peek_at(keys)
            missing = [k for k, v in zip(keys, values) if v is None]
            if not missing:
                return values       # type: ignore[return-value]
            left = deadline - time.monotonic()
            if left <= 0:
                raise not_published(missing, timeout)
            self._await(missing[0], cursor, left, attempt)
            attempt += 1

    def _peek_at(self, keys: Sequence[str]) -> tuple[list[bytes | None], Any]:
        """:meth:`peek`, and where the store can say so, the point in its history the values were read at
        (handed to :meth:`_await`)."""
        return self.peek(keys), None

    def _await(self, key: str, cursor: Any, left: float, attempt: int) -> None:
        """Wait, at most ``left`` seconds, for ``key`` to be set after ``cursor`` (here: a pause that
        doubles with each ``attempt``; a store that can watch a key wakes when it is put)."""
        time.sleep(min(left, _POLL[0] * 2 ** min(attempt, 16), _POLL[1]))

    def close(self) -> None:  # noqa: B027 -- a store that holds nothing of its own needs no close
        """Release the connection to the store (idempotent)."""
