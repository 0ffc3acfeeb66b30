"""Pieces of a transfer's files: the unit a resumed ``tensorxfer-send`` / ``tensorxfer-recv`` keeps or sends again.

Each safetensors file's tensor data (the bytes after its header) is cut into :data:`PIECE_BYTES` pieces,
numbered across the files in the order the transfer lists them (side files carry no tensors: no pieces).
A piece is defined by the files, not by the region: the same file has the same pieces whatever region
layout a send picks (mapped or packed), so the receiver's journal (:mod:`tensorxfer.files.journal`) keeps
them across runs.  A piece's checksum is xxh3_64 over its tensor bytes in file order -- the sender hashes
them from its source file, the receiver from its temporary file or its region, and the two must agree
before a held piece is kept.

:class:`PieceMap` is the geometry (pure: no I/O): piece -> its byte runs in the file's data and in the
region, and a set of pieces -> the region ranges a partial update moves.  Both ends build it from the same
manifest, so they cut the same runs.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from tensorxfer.files.layout import FilePlan
from tensorxfer.manifest import Manifest

#: 2 MiB: a killed run loses at most the partly landed piece of each stream (and what was not journaled
#: yet); a 2 GB model is 1k pieces, a 600 GB checkpoint 300k (a journal of ~5 MB, a held frame of ~3.6 MB,
#: and ~a second of Python per run to match them).
PIECE_BYTES = 2 << 20
#: The most pieces one transfer may have: bounds the journal and the held/skip frames (2 PiB at 2 MiB).
MAX_PIECES = 1 << 30


@dataclass(frozen=True)
class Run:
    """Bytes of one tensor inside one piece: ``data_pos`` in its file's data section, ``region_off`` in the
    region, ``nbytes``."""

    data_pos: int
    region_off: int
    nbytes: int


class PieceMap:
    """The pieces of a transfer's safetensors files (see the module).

    ``files``: per file of the plan, ``(first piece id, piece count, data bytes, data offset in the file)``;
    side files have no pieces (count 0).
    """

    def __init__(self, manifest: Manifest, plans: Sequence[FilePlan], piece_bytes: int = PIECE_BYTES) -> None:
        self.piece_bytes = piece_bytes
        self.files: list[tuple[int, int, int, int]] = []
        # per file: its tensors' runs (data position, region offset, n), by data position
        self._tensors: list[list[tuple[int, int, int]]] = []
        first = 0
        for fp in plans:
            if fp.header is None:
                self.files.append((first, 0, 0, 0))
                self._tensors.append([])
                continue
            specs = manifest.tensors[fp.first_tensor:fp.first_tensor + len(fp.header.entries)]
            runs = sorted((e.begin, s.offset, s.nbytes) for e, s in zip(fp.header.entries, specs, strict=True)
                          if s.nbytes)
            data = fp.header.data_bytes
            count = -(-data // piece_bytes)
            self.files.append((first, count, data, 8 + len(fp.text.encode("utf-8"))))
            self._tensors.append(runs)
            first += count
        if first > MAX_PIECES:
            raise ValueError(f"{first} pieces of {piece_bytes} bytes are over the limit of {MAX_PIECES}")
        self.count = first
        self._starts = [[pos for pos, _, _ in runs] for runs in self._tensors]
        self._firsts = np.array([f[0] for f in self.files], dtype=np.int64)

    def file_of(self, piece: int) -> int:
        """The index (in the plan) of the file holding ``piece``."""
        if not 0 <= piece < self.count:
            raise ValueError(f"piece {piece} is not one of this transfer's {self.count}")
        i = int(np.searchsorted(self._firsts, piece, side="right")) - 1
        while self.files[i][1] == 0 or piece >= self.files[i][0] + self.files[i][1]:
            i -= 1      # files without pieces share their first id with the next file: step back past them
        return i

    def bounds(self, piece: int) -> tuple[int, int, int]:
        """``(file index, data start, data end)`` of ``piece``."""
        i = self.file_of(piece)
        first, _, data, _ = self.files[i]
        a = (piece - first) * self.piece_bytes
        return i, a, min(a + self.piece_bytes, data)

    def runs(self, piece: int) -> list[Run]:
        """The tensor bytes of ``piece``, in file order."""
        i, a, b = self.bounds(piece)
        out = []
        tensors = self._tensors[i]
        # tensors never overlap in a file's data: the first that can reach into [a, b) starts at or before a
        k = max(0, bisect.bisect_right(self._starts[i], a) - 1)
        for pos, off, n in tensors[k:]:
            if pos >= b:
                break
            lo, hi = max(pos, a), min(pos + n, b)
            if lo < hi:
                out.append(Run(lo, off + lo - pos, hi - lo))
        return out

    def nbytes(self, pieces: Iterable[int]) -> int:
        """Tensor bytes of ``pieces``."""
        return sum(r.nbytes for p in pieces for r in self.runs(p))

    def region_runs(self, pieces: Iterable[int]) -> list[tuple[int, int]]:
        """The region ranges ``(offset, nbytes)`` of ``pieces``, sorted, touching ones merged: what a partial
        update moves (as segments from and to the same offsets).  Both ends compute it from the same pieces."""
        runs = sorted((r.region_off, r.nbytes) for p in set(pieces) for r in self.runs(p))
        merged: list[list[int]] = []
        for off, n in runs:
            if merged and merged[-1][0] + merged[-1][1] >= off:
                end = max(merged[-1][0] + merged[-1][1], off + n)
                merged[-1][1] = end - merged[-1][0]
            else:
                merged.append([off, n])
        return [(off, n) for off, n in merged]

    def runs_without(self, kept: Iterable[int]) -> list[tuple[int, int]]:
        """The region ranges of every piece not in ``kept``: what a partial update moves.  The sender (its
        confirmed pieces) and the receiver (what it keeps) both call this, so they cut the same segments."""
        keep = set(kept)
        return self.region_runs(p for p in range(self.count) if p not in keep)

    def file_pieces(self, i: int) -> range:
        first, count, _, _ = self.files[i]
        return range(first, first + count)


def hash_runs(chunks: Iterable[bytes | memoryview]) -> int:
    """A piece's checksum from its tensor bytes, in file order."""
    h = xxhash.xxh3_64()
    for c in chunks:
        h.update(c)
    return h.intdigest()


def file_sums(fd: int, data_at: int, pmap: PieceMap, pieces: Sequence[int]) -> list[int | None]:
    """Checksums of ``pieces`` (all of one file, open as ``fd``, its data section at ``data_at``), read with
    ``pread`` -- never through a mapping, which a file cut short meanwhile would turn into SIGBUS.  A piece
    the file is too short for gets None (it cannot match)."""
    out: list[int | None] = []
    for p in pieces:
        chunks = []
        short = False
        for r in pmap.runs(p):
            data = os.pread(fd, r.nbytes, data_at + r.data_pos)
            if len(data) != r.nbytes:
                short = True
                break
            chunks.append(data)
        out.append(None if short else hash_runs(chunks))
    return out


__all__ = ["MAX_PIECES", "PIECE_BYTES", "PieceMap", "Run", "file_sums", "hash_runs"]
