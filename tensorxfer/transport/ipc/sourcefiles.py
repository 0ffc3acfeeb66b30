"""A sender's files as an ipc update's source: read with ``pread`` into the receiver's region.

A sender whose region is its model files mapped (``tensorxfer-send`` on one host) passes the files' fds
instead of memory handles (chunk table kind ``files``).  A receiver never maps them: a file cut short by
someone else while mapped would turn a read into SIGBUS, and the seals that rule that out for memfds do not
exist for regular files.  So bytes come out of them only through the kernel -- ``pread`` here into the
region, or ``copy_file_range`` straight into output files where the receiver's caller takes them
(:attr:`~tensorxfer.transport.base.ReceiverTransport.on_files`) -- and a short read is a
:class:`~tensorxfer.errors.TransferError` naming the file.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence

from tensorxfer.errors import TransferError

Files = Sequence[tuple[int, int, int]]      # (region offset, length, fd), increasing, not overlapping


def fill_from_files(view: memoryview, files: Files, off: int, n: int) -> None:
    """Fill ``view[off:off+n]`` (a writable byte view of the region) from ``files``; bytes no file covers
    (headers' gaps, alignment) are zeroed, so a reused region holds nothing of an earlier update there.

    Raises
    ------
    TransferError
        A file holds fewer bytes than its placement says (it shrank while being sent).
    """
    end = off + n
    k = max(0, bisect.bisect_right([f[0] for f in files], off) - 1)
    pos = off
    for index in range(k, len(files)):
        base, length, fd = files[index]
        if base >= end:
            break
        if base + length <= pos:
            continue
        if pos < base:
            view[pos:base] = bytes(base - pos)
            pos = base
        stop = min(end, base + length)
        while pos < stop:
            got = os.preadv(fd, [view[pos:stop]], pos - base)
            if got <= 0:
                raise TransferError(f"ipc: the sender's file {index} (placed at {base}, {length:,} bytes) "
                                    f"ended after {pos - base:,} bytes: it shrank while being sent; send it "
                                    f"again once it is written")
            pos += got
    if pos < end:
        view[pos:end] = bytes(end - pos)
