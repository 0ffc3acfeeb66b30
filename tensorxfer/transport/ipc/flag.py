"""A pair's ready flag: one counter in shared host memory, set by the sender's GPU, waited on by the receiver's.

A warm weight-sync step on GPUs need not wait on any host for its bytes to be ready.  The receiver queues
its copy behind :meth:`ReadyFlag.wait_before` as soon as it takes the offer; the sender queues
:meth:`ReadyFlag.set_after` on the stream its pack ran on.  The copy then starts the moment the pack's
work is done, with no host round trip in between (measured before this: the copy launched ~1 ms into a
step, waiting for the sender's ``torch.cuda.synchronize`` and its chunk table).

The counter lives in one page of a memfd both processes map and register with CUDA (``cuMemHostRegister``):
host memory, so either end's CPU can read it, and the receiver can set it itself to release its queued copy
when the sender dies before its GPU set it (:meth:`ReadyFlag.release`; the copy then lands stale bytes in a
step that fails).  The sender creates it and passes the fd once per session; each step's value is the
pair's sequence number (a cyclic compare: it may wrap).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tensorxfer.errors import ProtocolError, TransferError

PAGE = 4096
_WRAP = 1 << 32


def gating_enabled() -> bool:
    """Whether a weight sync's GPU receivers ask their senders for a ready flag: ``TENSORXFER_IPC_GATE=1``.

    Opt-in: this path was written without a GPU to run it on (the device tool lent none that session);
    without it every GPU step waits on the host as before.  See benchmarks/results/README.md for where it
    was measured since."""
    return os.environ.get("TENSORXFER_IPC_GATE", "") == "1"


class ReadyFlag:
    """One 32-bit counter in a shared, CUDA-registered page (see the module docstring).  One owner; ``close()``
    is idempotent.  ``fd`` is taken over (closed with the flag)."""

    def __init__(self, fd: int, device: int) -> None:
        from tensorxfer.memory._copy import register_host

        self._fd = fd
        self._map: mmap.mmap | None = None
        self._word: Any = None
        self._addr = 0
        self._stream: int | None = None     # the stream of a set_after this end queued (waited for at close)
        try:
            if os.fstat(fd).st_size < PAGE:
                raise ProtocolError(f"ipc: the peer's ready flag is {os.fstat(fd).st_size} bytes, expected {PAGE}")
            self._map = mmap.mmap(fd, PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._word = np.frombuffer(self._map, dtype=np.uint32, count=1)
            self._device = device
            self._dptr = register_host(device, self._word.ctypes.data, PAGE)
            self._addr = self._word.ctypes.data
        except BaseException:
            self.close()
            raise

    @classmethod
    def create(cls, device: int) -> ReadyFlag:
        """A new flag at 0 (a sealed memfd of one page), registered on ``device``."""
        fd = os.memfd_create("tensorxfer-ready-flag", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, PAGE)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, device)

    @property
    def fd(self) -> int:
        return self._fd

    def set_after(self, stream: int, value: int) -> None:
        """Sender: queue setting the counter to ``value`` on ``stream``, behind the work queued there."""
        from tensorxfer.memory._copy import write_value

        write_value(self._device, stream, self._dptr, value % _WRAP)
        self._stream = stream

    def wait_before(self, copier: Any, value: int) -> None:
        """Receiver: queue on ``copier``'s stream a wait until the counter reached ``value``."""
        copier.wait_value(self._dptr, value % _WRAP)

    def reached(self, value: int) -> bool:
        """Whether the counter reached ``value`` (read by this CPU; the cyclic compare the GPU makes)."""
        word = self._word
        if word is None:
            raise TransferError("ipc: the transfer was aborted (its ready flag was closed)")
        return (int(word[0]) - value) % _WRAP < _WRAP // 2

    def await_value(self, value: int, timeout: float, sender_gone: Callable[[], None]) -> None:
        """Block until the counter reached ``value``; ``sender_gone()`` (checked every millisecond) raising, or
        ``timeout`` seconds passing, raises instead (the caller then releases).

        Raises
        ------
        PeerLost, TransferTimeout
            As ``sender_gone`` raises, or the counter stayed below ``value`` for ``timeout`` seconds.
        """
        from tensorxfer.errors import TransferTimeout

        deadline = time.monotonic() + timeout
        check = 0.0
        while not self.reached(value):
            now = time.monotonic()
            if now >= check:
                sender_gone()
                check = now + 0.001
            if now > deadline:
                raise TransferTimeout(f"ipc: the sender's GPU did not finish its step {value} (its ready flag "
                                      f"stayed below it) within {timeout} s")
            time.sleep(20e-6)

    def release(self, value: int) -> None:
        """Receiver: set the counter to ``value`` from this CPU (the sender is gone or failed), so a copy queued
        behind :meth:`wait_before` runs and the stream can be synchronized."""
        if self._word is not None and not self.reached(value):
            self._word[0] = value % _WRAP

    def close(self) -> None:
        from tensorxfer.memory._copy import stream_synchronize, unregister_host

        stream, self._stream = self._stream, None
        if self._addr:
            try:
                if stream is not None:      # a queued set_after must not land in unregistered memory
                    stream_synchronize(self._device, stream)
            finally:
                addr, self._addr = self._addr, 0
                unregister_host(self._device, addr)
        if self._map is not None:
            self._word = None       # the last view of the mapping: it can close
            m, self._map = self._map, None
            m.close()
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass    # at interpreter exit CUDA may be gone: the process's end frees the page
