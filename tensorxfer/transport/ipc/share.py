"""The sharing ipc receiver (``Receiver(share=True)``): the received region *is* the sender's memory.

Nothing is allocated or copied: the sender's handles are mapped (host chunks read-only) and the mapping
becomes the region, with the offer's layout.  When the sender passes the very memory the previous shared
region maps, with the same layout, that region is handed back as is: it already shows the sender's
update, and nothing is mapped again (memfds are recognised by the sender's pid and region token, CUDA
handles by those and the device).  See the package docstring for the semantics.
"""

from __future__ import annotations

import socket
import weakref
from typing import TYPE_CHECKING, Any, ClassVar

from tensorxfer.errors import ProtocolError, TransportUnavailable
from tensorxfer.transport.base import Progress, ShareReceiverTransport
from tensorxfer.transport.ipc.messages import FILES, Watermark
from tensorxfer.transport.ipc.receiving import Handles, Incoming, IpcReceiving

if TYPE_CHECKING:
    from tensorxfer.manifest import Manifest
    from tensorxfer.region import TensorRegion
    from tensorxfer.transport.base import TransferContext

_SHARED_KEYS: weakref.WeakKeyDictionary[Any, tuple] = weakref.WeakKeyDictionary()   # shared region -> its memory


class IpcShareReceiver(IpcReceiving, ShareReceiverTransport):
    """Maps a same-host sender's memory as the received region (one per session)."""

    name: ClassVar[str] = "ipc"

    def __init__(self, ctx: TransferContext) -> None:
        super().__init__(ctx)
        self._manifest: Manifest | None = None
        self._device = "cpu"
        self._shared: TensorRegion | None = None
        self._previous: TensorRegion | None = None      # the region the last transfer returned

    def prepare_share(self, manifest: Manifest, device: str, seq: int, fresh: bool,
                      previous: TensorRegion | None = None) -> dict[str, Any]:
        """Get ready to map update ``seq``: nothing is allocated; :meth:`take_shared` returns the sender's
        memory as a region with ``manifest``'s layout after :meth:`wait` (``previous`` itself when the
        sender passes the memory it maps).  Descriptors as the copy receiver's, with ``share`` true."""
        self._manifest, self._device, self._previous = manifest, device, previous
        return self._begin(seq, fresh, share=True)

    def _expected_nbytes(self) -> int:
        return self._manifest.nbytes if self._manifest is not None else -1

    def _empty(self) -> int:
        from tensorxfer.region import TensorRegion

        assert self._manifest is not None
        self._shared = TensorRegion.from_manifest(self._manifest, device=self._device)
        return 0

    def _land(self, conn: socket.socket, incoming: Incoming, handles: Handles, fds: list[int],
              watermark: Watermark, progress: Progress | None) -> int:
        if incoming.kind == FILES:
            # the sender checks the share flag of the accept first; this is a sender that did not
            raise TransportUnavailable("ipc: the sender's region is files mapped in its process; a sharing "
                                       "receiver maps only memory handles (memfds, CUDA): send with "
                                       "transport='tcp' or read the files into a region first")
        watermark.wait(incoming.nbytes)     # the sender's memory is the region, once all of it is there
        if incoming.kind == "host":
            key, device, on = incoming.key(), "cpu", None
        else:
            on = self._cuda_device(incoming, self._device)
            key, device = incoming.key(on), f"cuda:{on}"
        if handles:
            # copy-on-write: a write into a module's shared weights (an in-place op) stays in this process,
            # where a read-only mapping killed it (SIGSEGV) and a shared writable one would reach the trainer
            src = self._import(incoming, handles, fds, on, copy_on_write=True)
        elif self._reusable_previous(key):
            src = self._previous
        else:
            raise ProtocolError("ipc: the sender says this region's handles were passed before, but this "
                                "session holds no mapping of them")
        return self._adopt(src, device, key)

    def _reusable_previous(self, key: tuple) -> bool:
        """Does the previous shared region map the very memory the sender names, with this layout?"""
        prev = self._previous
        return (self._manifest is not None and prev is not None and not prev.closed
                and _SHARED_KEYS.get(prev) == key and prev.manifest.same_layout(self._manifest))

    def _adopt(self, src: Any, device: str, key: tuple) -> int:
        from tensorxfer.region import TensorRegion

        assert self._manifest is not None
        if src is self._previous:       # the same memory again: the region is reused as is
            self._shared = src
            return self._manifest.nbytes
        try:
            self._shared = TensorRegion(src, self._manifest, device=device)
        except BaseException:
            src.close()
            raise
        _SHARED_KEYS[self._shared] = key
        return self._manifest.nbytes

    def take_shared(self) -> TensorRegion:
        """The region backed by the sender's memory (now the caller's to close)."""
        region, self._shared = self._shared, None
        if region is None:
            raise ProtocolError("ipc: take_shared() before a successful shared wait()")
        return region

    def close(self) -> None:
        """Close the socket, remove the private directory, release a mapping nobody took; idempotent."""
        super().close()
        shared, self._shared = self._shared, None
        if shared is not None and shared is not self._previous:     # the previous one is its owner's
            shared.close(defer=True)
        self._previous = None
