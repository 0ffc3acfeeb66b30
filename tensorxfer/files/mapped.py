"""A sender's region that is its model files: a model sent over tcp or ipc without a copy of it in memory.

The files are in the page cache already (or one read away).  When every safetensors file sits in the region at
a page-aligned base -- each byte of the file at ``base + its position in the file`` -- the region can *be* the
files, mapped read-only (:meth:`HostRegion.map_files`): ``tensorxfer-send`` then sends from the page cache
(tcp), or passes the files themselves to a receiver on its host (ipc: :func:`map_sources` ``keep_files``),
and nothing is read into memory of its own first.  On a machine whose fresh memory is slow to touch (a VM that
hands freed memory back to its host) that saves the most: the dev VM's first touch of 2 GB costs 0.4-2.5 s.

The layout (:func:`mirror`): file ``i`` at ``base_i``, the first at 0, each next one where the previous file
ends, rounded up to FILE_ALIGN (64 KiB: a page multiple with 4, 16 and 64 KiB pages).  Tensors are then only
as aligned as the files place them: the manifest's ``alignment`` says how much (any power of two is a valid
manifest), and the layout is used only when that is at least every tensor's element size (safetensors pads
its header to 8 bytes, so only a tensor after one of an odd size can miss it); otherwise the sender reads the
files into a packed region.  The receiver lands the bytes as from any sender (the headers and the padding
between files travel too; it writes the headers it derives from the manifest's file layout itself).

The receiver's twin -- landing in its temporary files mapped writable -- was built and measured on the dev VM's
ext4 and dropped: write faults into a shared file mapping from four receiving streams made the transfer
2-5x slower than landing in memory and writing the pieces with ``pwrite`` (benchmarks/results/README.md).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from tensorxfer.dtypes import DTYPES
from tensorxfer.files.format import FileFormatError
from tensorxfer.files.load import LoadPlan
from tensorxfer.manifest import DEFAULT_ALIGNMENT, Manifest, align_up
from tensorxfer.memory import HostRegion
from tensorxfer.region import TensorRegion

FILE_ALIGN = 64 << 10


def mirror(plan: LoadPlan) -> tuple[LoadPlan, list[int]] | None:
    """``plan`` with every tensor where its file puts it (file ``i`` at ``bases[i]``), and the bases; None when
    the files place some tensor less aligned than its element size."""
    if plan.manifest.aliases or len(plan.sizes) != len(plan.jobs):     # tied tensors; a plan without file sizes
        return None
    bases, end = [], 0
    for size in plan.sizes:
        bases.append(align_up(end, FILE_ALIGN))
        end = bases[-1] + size
    specs, jobs, k = [], [], 0
    for base, (path, items) in zip(bases, plan.jobs, strict=True):
        jobs.append((path, [(file_offset, base + file_offset, n) for file_offset, _, n in items]))
        for file_offset, _, _ in items:
            specs.append(plan.manifest.tensors[k]._replace(offset=base + file_offset))
            k += 1
    if k != len(plan.manifest):
        return None
    alignment = DEFAULT_ALIGNMENT
    for s in specs:
        while s.offset % alignment:
            alignment //= 2
    if alignment < max((DTYPES[s.dtype].itemsize for s in specs), default=1):
        return None
    manifest = Manifest(specs, alignment=alignment, metadata=plan.manifest.metadata)
    return LoadPlan(manifest, jobs, plan.sizes), bases


def map_sources(plan: LoadPlan, bases: Sequence[int], keep_files: bool = False) -> TensorRegion:
    """A read-only region whose memory is the files of a :func:`mirror`-ed ``plan``, file ``i`` at
    ``bases[i]``.  Only for a transport that reads it in the kernel: tcp (a file cut short meanwhile then
    fails the send, EFAULT, where a read of the mapping in this process would die of SIGBUS), or ipc with
    ``keep_files``: the region then also owns the files' fds (:attr:`TensorRegion.source_files`), which ipc
    passes to the receiver instead of memory handles; the receiver copies from them with ``copy_file_range``
    (a file cut short meanwhile fails the transfer there, with a short copy, never a SIGBUS).

    Raises
    ------
    FileFormatError
        A file's length changed since its header was read.
    OSError
        A file cannot be opened.
    """
    fds: list[int] = []
    try:
        for (path, _), size in zip(plan.jobs, plan.sizes, strict=True):
            fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
            now = os.fstat(fds[-1]).st_size
            if now != size:
                raise FileFormatError(f"{path}: {'shrank' if now < size else 'grew'} while being read ({size:,} "
                                      f"bytes, now {now:,}); send it again once it is written")
        end = max((b + s for b, s in zip(bases, plan.sizes, strict=True)), default=0)   # every tensor lies before
        # not populated: the transport's reads fault the pages in as it goes, so files not in the page cache
        # are read while they are sent (measured on the dev VM, 2 GB from a cold cache: 3.8 s end to end
        # against 4.0-5.4 s when MAP_POPULATE read them all first; the same warm)
        region = HostRegion.map_files(list(zip(bases, plan.sizes, fds, strict=True)), end)
        try:
            kept = list(zip(bases, plan.sizes, fds, strict=True)) if keep_files else None
            out = TensorRegion(region, plan.manifest, source_files=kept)
        except BaseException:
            region.close()
            raise
        if keep_files:
            fds = []            # the region owns them now
        return out
    finally:
        for fd in fds:
            os.close(fd)


def changed_files(plan: LoadPlan) -> list[str]:
    """The files of ``plan`` whose length is no longer the one their header was read with (a send from them
    failed: this names why)."""
    changed = []
    for (path, _), size in zip(plan.jobs, plan.sizes, strict=True):
        try:
            if os.stat(path).st_size != size:
                changed.append(str(path))
        except OSError:
            changed.append(str(path))
    return changed
