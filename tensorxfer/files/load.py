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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensorxfer.dtypes import DTYPES
from tensorxfer.files.format import Entry, FileFormatError, Header, read_header
from tensorxfer.files.layout import CHUNK_BYTES, FILES_KEY, split_chunks
from tensorxfer.files.sources import MAX_SIDE_FILE_BYTES, Discovery, discover
from tensorxfer.manifest import MAX_METADATA_ITEMS, MAX_METADATA_STR, Manifest
from tensorxfer.staging import open_stager, write_pieces

STAGE_BYTES = 32 << 20              # each of the two pinned buffers for GPU regions


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
            mode = stat.S_IMODE(src.path.stat().st_mode) & 0o777
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
    if len(meta) > MAX_METADATA_ITEMS or len(meta[FILES_KEY].encode("utf-8")) >= MAX_METADATA_STR:
        raise FileFormatError(f"{len(records)} files whose headers and side files need {len(meta)} metadata "
                              f"strings (limit {MAX_METADATA_ITEMS} of {CHUNK_BYTES} bytes, and one file list "
                              f"under {MAX_METADATA_STR} bytes): send fewer files at once")
    manifest = Manifest.layout(layout, metadata=meta)
    jobs, k = [], 0
    for path, data_at, header in plan:
        items = []
        for entry in header.entries:
            spec = manifest.tensors[k]
            k += 1
            items.append((data_at + entry.begin, spec.offset, spec.nbytes))
        jobs.append((path, items))
    return LoadPlan(manifest, jobs)


def fill(region: Any, jobs: list[tuple[Path, list[tuple[int, int, int]]]],
         progress: Callable[[int], None] | None = None) -> None:
    """Copy ``(file offset, region offset, n)`` pieces of each file into the region.

    Host regions are read into directly; GPU regions through one pair of pinned buffers (the file read
    into one while the other uploads) — :func:`tensorxfer.staging.write_pieces` either way.
    """
    stager = open_stager(region, STAGE_BYTES)
    try:
        for path, items in jobs:
            with open(path, "rb") as f:
                for file_off, off, n in items:
                    f.seek(file_off)
                    with write_pieces(region, off, n, STAGE_BYTES, stager=stager) as pieces:
                        for _, dst in pieces:
                            _read_exact(f, dst, path)
                            if progress is not None:
                                progress(len(dst))
    finally:
        if stager is not None:
            stager.close()


def _read_exact(f: Any, dst: memoryview, path: Path) -> None:
    got = 0
    while got < len(dst):
        with dst[got:] as rest:
            n = f.readinto(rest)
        if not n:
            raise FileFormatError(f"{path}: file shrank while being read")
        got += n

