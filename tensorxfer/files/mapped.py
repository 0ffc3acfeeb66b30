"""Regions whose memory is the model files themselves: a model moves without a copy of it in memory.

A sender's files are in the page cache already (or one read away); a receiver's output files will be.  When
every safetensors file of a transfer sits in the region at a page-aligned base -- each byte of the file at
``base + its position in the file`` -- the region can *be* the files (:meth:`HostRegion.map_files`):

- ``tensorxfer-send`` maps the files it sends, read-only (:func:`map_sources`): nothing is read into memory
  of its own, the transport sends from the page cache;
- ``tensorxfer-recv`` maps its temporary output files, writable (:func:`file_bases`, then
  :meth:`ModelWriter.landing_region <tensorxfer.files.ModelWriter.landing_region>`): the bytes land in the
  files' pages, and writing them is the kernel's writeback.

On a machine whose fresh memory is slow to touch (a VM that hands freed memory back to its host) this is
the difference between touching the model's bytes once, as ``dd`` does, and three times.

The layout (:func:`mirror`): file ``i`` at ``base_i``, the first at 0, each next one where the previous file
ends, rounded up to FILE_ALIGN (64 KiB: a page multiple with 4, 16 and 64 KiB pages).  Tensors are then only
as aligned as the files place them: the manifest's ``alignment`` says how much, and the layout is used only
when that is at least every tensor's element size (safetensors pads its header to 8 bytes, so only a tensor
after one of an odd size can miss it); otherwise the sender reads the files into an aligned region as before.
A receiver trusts none of it: :func:`file_bases` derives each file's base from the manifest, and the files
are mapped only when every tensor of a file sits at one page-aligned base plus its position there and no two
files' pages meet.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

from tensorxfer.dtypes import DTYPES
from tensorxfer.files.format import FileFormatError
from tensorxfer.files.layout import FilePlan
from tensorxfer.files.load import LoadPlan
from tensorxfer.manifest import DEFAULT_ALIGNMENT, Manifest, align_up
from tensorxfer.memory import HostRegion, page_size
from tensorxfer.region import TensorRegion

FILE_ALIGN = 64 << 10


def mirror(plan: LoadPlan) -> tuple[LoadPlan, list[int]] | None:
    """``plan`` with every tensor where its file puts it (file ``i`` at ``bases[i]``), and the bases; None when
    the files place some tensor less aligned than its element size.  A region of this layout
    lets the receiver land the bytes in its files, whether or not the sender's region is its files."""
    bases, end = [], 0
    for size in plan.sizes:
        bases.append(align_up(end, FILE_ALIGN))
        end = bases[-1] + size
    if plan.manifest.aliases:
        return None
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


def map_sources(plan: LoadPlan, bases: Sequence[int]) -> TensorRegion:
    """A read-only region whose memory is the files of a :func:`mirror`-ed ``plan``, file ``i`` at
    ``bases[i]``.  Only for a transport that reads it in the kernel (tcp): a file cut short meanwhile then fails
    the send (EFAULT), where a read of the mapping in this process would die of SIGBUS.

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
        end = max((b + s for b, s in zip(bases, plan.sizes, strict=True)), default=0)
        region = HostRegion.map_files([(b, s, fd) for b, s, fd in zip(bases, plan.sizes, fds, strict=True)
                                       if s > 0], max(end, plan.manifest.nbytes, 1), populate=True)
    finally:
        for fd in fds:
            os.close(fd)
    return TensorRegion(region, plan.manifest)


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


def file_bases(manifest: Manifest, plans: Sequence[FilePlan]) -> list[int | None] | None:
    """Where each file of ``plans`` would sit in a region with ``manifest``'s layout if the region were the
    files (None for a file that holds no tensor bytes), or None when the layout does not mirror the files:
    some file's tensors at more than one base, or a base that is not a page multiple, or two files' pages
    overlapping.  ``manifest`` is hostile input: nothing here trusts the sender."""
    page = page_size()
    bases: list[int | None] = []
    for fp in plans:
        if fp.header is None:
            bases.append(None)
            continue
        pos = 8 + len(fp.text.encode("utf-8"))
        base = None
        for spec in manifest.tensors[fp.first_tensor:fp.first_tensor + len(fp.header.entries)]:
            if spec.nbytes and base is None:
                base = spec.offset - pos
            if spec.nbytes and spec.offset - pos != base:
                return None
            pos += spec.nbytes
        if base is not None and (base < 0 or base % page):
            return None
        bases.append(base)
    placed = sorted((b, b + align_up(fp.size, page)) for b, fp in zip(bases, plans, strict=True) if b is not None)
    if not placed or any(a_end > b for (_, a_end), (b, _) in itertools.pairwise(placed)):
        return None
    return bases


def map_outputs(files: Sequence[tuple[int, int, int]], nbytes: int, manifest: Manifest) -> TensorRegion:
    """A writable region with ``manifest``'s layout whose memory is ``files`` (``(base, length, fd)``, blocks
    allocated), anonymous pages between them (raises as :meth:`HostRegion.map_files`)."""
    ordered = sorted(files)
    end = max(b + n for b, n, _ in ordered)
    region: Any = HostRegion.map_files(ordered, max(end, nbytes, 1), writable=True)
    return TensorRegion(region, manifest)
