"""Files into one region: every tensor of every safetensors file, side files in the metadata.

:func:`plan_load` reads the headers (and side files) and lays every tensor of every file out in one
manifest; :func:`fill` reads the tensors into a region allocated from it (``TensorRegion.from_safetensors``
does both).  The manifest records, in the manifest metadata (:mod:`tensorxfer.files.layout`),
which tensors belong to which file, each file's original header text and mode
bits, so the receiver can write back the exact bytes: the header verbatim,
then the tensors in data-offset order.  Side files travel verbatim in the
metadata.

Regions on a GPU (``device="cuda:N"``) are filled from files through two
pinned staging buffers (:mod:`tensorxfer.staging`, the same loop as host
regions), double-buffered: the disk works on one while the copy engine works
on the other.
"""

from __future__ import annotations

import base64
import json
import os
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensorxfer.dtypes import DTYPES
from tensorxfer.errors import UpstreamFailed
from tensorxfer.files.format import Entry, FileFormatError, Header, read_header
from tensorxfer.files.layout import CHUNK_BYTES, FILES_KEY, SOURCES_KEY, split_chunks
from tensorxfer.files.sources import MAX_SIDE_FILE_BYTES, Discovery, discover
from tensorxfer.manifest import MAX_METADATA_ITEMS, MAX_METADATA_STR, Manifest
from tensorxfer.staging import open_stager, write_pieces

STAGE_BYTES = 16 << 20              # each of a reader thread's two pinned buffers, for GPU regions
UNIT_BYTES = 64 << 20               # what one reader thread takes at a time
#: Reader threads (each read releases the GIL); measured in benchmarks/bench_live.py --what load.
LOAD_THREADS = max(1, int(os.environ.get("TENSORXFER_LOAD_THREADS", "0")) or min(8, os.cpu_count() or 1))


def _read_side_file(path: Path) -> tuple[bytes, int]:
    """The bytes and permission bits of a side file (a regular file, at most MAX_SIDE_FILE_BYTES)."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise FileFormatError(f"{path}: not a regular file")
        data = f.read(MAX_SIDE_FILE_BYTES + 1)
    if len(data) > MAX_SIDE_FILE_BYTES:
        raise FileFormatError(f"{path}: grew over the {MAX_SIDE_FILE_BYTES}-byte limit for a side file")
    return data, stat.S_IMODE(st.st_mode) & 0o777


@dataclass(frozen=True)
class LoadPlan:
    """What :func:`plan_load` found: the manifest of every tensor, and where each lives in its file."""

    manifest: Manifest
    jobs: list[tuple[Path, list[tuple[int, int, int]]]]     # per file: (file offset, region offset, bytes)
    sizes: tuple[int, ...] = ()                             # per file of jobs: its length in bytes

    @property
    def nbytes(self) -> int:
        return sum(n for _, items in self.jobs for _, _, n in items)


def plan_load(sources: Sequence[str | os.PathLike[str]] | Discovery) -> LoadPlan:
    """Read the headers of safetensors files (and the side files) and lay their tensors out in one manifest.

    Raises
    ------
    FileFormatError
        A file is malformed, two files hold a tensor of the same name, or the headers and side files do
        not fit the manifest's metadata.
    OSError
        A file cannot be read.
    """
    found = sources if isinstance(sources, Discovery) else discover(sources)
    layout: list[tuple[str, str, tuple[int, ...]]] = []
    meta: dict[str, str] = {}
    records: list[dict[str, Any]] = []
    source_stats: list[list[int] | None] = [None] * len(found.files)
    plan: list[tuple[Path, int, Header]] = []
    seen: dict[str, str] = {}
    for i, src in enumerate(found.files):
        entries: tuple[Entry, ...] = ()
        if src.kind == "side":
            data, mode = _read_side_file(src.path)
            try:
                text, kind = data.decode("utf-8"), "text"
            except UnicodeDecodeError:
                text, kind = base64.b64encode(data).decode("ascii"), "base64"
        else:
            parsed, data_at = read_header(src.path)
            st = src.path.stat()
            mode = stat.S_IMODE(st.st_mode) & 0o777
            source_stats[i] = [st.st_size, st.st_mtime_ns]       # a resumed receiver tells a changed source by them
            text, kind, entries = parsed.text, "safetensors", parsed.entries
            plan.append((src.path, data_at, parsed))
        for ent in entries:
            if ent.name in seen:
                raise FileFormatError(f"tensor {ent.name!r} is in both {seen[ent.name]} and {src.name}; "
                                      f"send them separately")
            seen[ent.name] = src.name
            # Dtypes the manifest does not know travel as raw bytes; the header written back keeps the real one.
            layout.append((ent.name, ent.dtype, ent.shape) if ent.dtype in DTYPES
                          else (ent.name, "U8", (ent.end - ent.begin,)))
        chunks = split_chunks(text)
        records.append({"name": src.name, "kind": kind, "tensors": len(entries), "chunks": len(chunks),
                        "mode": mode})
        meta.update({f"tensorxfer.file.{i}.{j}": c for j, c in enumerate(chunks)})
    meta[FILES_KEY] = json.dumps(records)
    meta[SOURCES_KEY] = json.dumps(source_stats)
    if len(meta) > MAX_METADATA_ITEMS or len(meta[FILES_KEY].encode("utf-8")) >= MAX_METADATA_STR \
            or len(meta[SOURCES_KEY]) >= MAX_METADATA_STR:
        raise FileFormatError(f"{len(records)} files whose headers and side files need {len(meta)} metadata "
                              f"strings (limit {MAX_METADATA_ITEMS} of {CHUNK_BYTES} bytes, and one file list "
                              f"under {MAX_METADATA_STR} bytes): send fewer files at once")
    manifest = Manifest.layout(layout, metadata=meta)
    jobs, k = [], 0
    sizes = tuple(data_at + header.data_bytes for _, data_at, header in plan)
    for path, data_at, header in plan:
        items = []
        for entry in header.entries:
            spec = manifest.tensors[k]
            k += 1
            items.append((data_at + entry.begin, spec.offset, spec.nbytes))
        jobs.append((path, items))
    return LoadPlan(manifest, jobs, sizes)


def fill(region: Any, jobs: list[tuple[Path, list[tuple[int, int, int]]]],
         progress: Callable[[int], None] | None = None, threads: int | None = None) -> None:
    """Copy ``(file offset, region offset, n)`` pieces of each file into the region, on ``threads`` threads;
    return once every byte is there (see :class:`Loader`, which does it in the background)."""
    Loader(region, jobs, progress, threads).run()


class Loader:
    """Reads the files' pieces into the region on ``threads`` threads, and says how far it got.

    The pieces are cut into units of :data:`UNIT_BYTES` that the threads take in region order.  Host regions
    are read into directly; GPU regions through a pair of pinned buffers per thread (the file read into one
    while the other uploads) -- :func:`tensorxfer.staging.write_pieces` either way.  One reader copies
    page-cache bytes at a few GB/s; several keep the memory and the copy engine busy.  ``progress`` is called
    from the threads, one call at a time.

    :meth:`start` runs it in the background: the object is then a
    :class:`~tensorxfer.transport.base.Landing` (``wait_range`` / ``wait_prefix``), so a Sender can send the
    region while it fills -- each byte goes out once the units before it were read (bytes between units are
    alignment padding, zero from the allocation).  :meth:`join` waits and raises what a reader raised.
    """

    def __init__(self, region: Any, jobs: list[tuple[Path, list[tuple[int, int, int]]]],
                 progress: Callable[[int], None] | None = None, threads: int | None = None) -> None:
        self.region = region
        self._units = sorted(((path, file_off + k, off + k, min(UNIT_BYTES, n - k))
                              for path, items in jobs for file_off, off, n in items for k in range(0, n, UNIT_BYTES)),
                             key=lambda u: u[2])
        self._threads = max(1, min(threads or LOAD_THREADS, len(self._units)))
        self._progress = progress
        self._cond = threading.Condition()
        self._next = 0
        self._finished = [False] * len(self._units)
        self._landed = 0            # units 0..landed-1 are in the region
        self.error: BaseException | None = None
        self._workers: list[threading.Thread] = []

    # ---------------------------------------------------------------- running
    def run(self) -> None:
        """Fill the region in this thread (and ``threads - 1`` more); raise what a reader raised."""
        workers = [threading.Thread(target=self._work, name=f"tensorxfer-load-{k}", daemon=True)
                   for k in range(self._threads - 1)]
        for t in workers:
            t.start()
        self._work()
        for t in workers:
            t.join()
        if self.error is not None:
            raise self.error

    def start(self) -> Loader:
        """Fill the region in the background; :meth:`join` for the outcome."""
        self._workers = [threading.Thread(target=self._work, name=f"tensorxfer-load-{k}", daemon=True)
                         for k in range(self._threads)]
        for t in self._workers:
            t.start()
        return self

    def join(self) -> None:
        """Wait for the readers; raise what one raised."""
        for t in self._workers:
            t.join()
        if self.error is not None:
            raise self.error

    def abandon(self) -> BaseException | None:
        """Stop the readers after their current unit and wait for them (a failed send); return what a reader
        raised on its own, if anything (then the files, not the receiver, failed the send)."""
        self.stop()
        for t in self._workers:
            t.join()
        return None if isinstance(self.error, _Stopped) else self.error

    def stop(self) -> None:
        """Make the readers stop after their current unit (a failed send); :meth:`join` then returns."""
        with self._cond:
            self.error = self.error or _Stopped("the load was stopped")
            self._cond.notify_all()

    def _work(self) -> None:
        files: dict[Path, Any] = {}
        stager = None
        try:
            stager = open_stager(self.region, STAGE_BYTES)
            while True:
                with self._cond:
                    i = self._next
                    if i >= len(self._units) or self.error is not None:
                        return
                    self._next = i + 1
                path, file_off, off, n = self._units[i]
                f = files.get(path)
                if f is None:
                    f = files[path] = open(path, "rb")
                f.seek(file_off)
                with write_pieces(self.region, off, n, STAGE_BYTES, stager=stager) as pieces:
                    for _, dst in pieces:
                        _read_exact(f, dst, path)
                        if self._progress is not None:
                            with self._cond:
                                self._progress(len(dst))
                with self._cond:
                    self._finished[i] = True
                    while self._landed < len(self._units) and self._finished[self._landed]:
                        self._landed += 1
                    self._cond.notify_all()
        except BaseException as e:
            with self._cond:
                self.error = self.error or e
                self._cond.notify_all()
        finally:
            for f in files.values():
                f.close()
            if stager is not None:
                stager.close()

    # ---------------------------------------------------------------- Landing
    def _prefix(self) -> int:
        """The end of the landed prefix (the caller holds the condition)."""
        if self._landed >= len(self._units):
            return int(self.region.nbytes)
        return int(self._units[self._landed][2])

    def wait_prefix(self, after: int) -> int:
        """Return once the landed prefix reaches past ``after`` (or is the whole region); where it ends.

        Raises
        ------
        UpstreamFailed
            A reader failed (its error is the cause).
        """
        with self._cond:
            while True:
                end = self._prefix()
                if end > after or end >= self.region.nbytes:
                    return end
                if self.error is not None:
                    raise UpstreamFailed(f"reading the files failed: {type(self.error).__name__}: "
                                         f"{self.error}") from self.error
                self._cond.wait(1.0)

    def wait_range(self, offset: int, length: int) -> None:
        """Return once ``[offset, offset+length)`` was read."""
        end = offset + length
        pos = 0
        while pos < end and pos < self.region.nbytes:
            pos = self.wait_prefix(pos)


class _Stopped(Exception):
    """The load was stopped from outside (a failed send)."""


def _read_exact(f: Any, dst: memoryview, path: Path) -> None:
    got = 0
    while got < len(dst):
        with dst[got:] as rest:
            n = f.readinto(rest)
        if not n:
            raise FileFormatError(f"{path}: file shrank while being read")
        got += n

