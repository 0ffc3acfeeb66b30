"""The rendezvous interface: what a weight sync needs of a store, and nothing more."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class Rendezvous(ABC):
    """A key-value store shared by every rank of a sync group (keys are already namespaced by the caller).

    Values are bytes.  Every wait is bounded: a rank that never publishes is named in a
    :class:`~tensorxfer.errors.TransferTimeout`, never a hang.
    """

    @abstractmethod
    def publish(self, key: str, value: bytes) -> None:
        """Set ``key`` (overwriting)."""

    @abstractmethod
    def read(self, keys: Sequence[str], timeout: float) -> list[bytes]:
        """The values of ``keys``, waiting up to ``timeout`` seconds for all of them.

        Raises
        ------
        TransferTimeout
            Some keys were still missing; the message names them.
        """

    def close(self) -> None:  # noqa: B027 -- a store that holds nothing of its own needs no close
        """Release the connection to the store (idempotent)."""
