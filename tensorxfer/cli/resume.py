"""Resuming an interrupted ``tensorxfer-send`` / ``tensorxfer-recv`` across restarts: the two CLI halves of a
partial update (:mod:`tensorxfer.session.partial`).

The receiver's :class:`HeldOutput` is the session's holder: it claims the pieces its journal and temporary
files agree on (:class:`~tensorxfer.files.resume.PartialOutput`) and keeps what the sender confirmed.  The
sender's :class:`SourcePieces` is the session's checker: it hashes each held piece from its source file
(read with ``pread``, never through the send's mapping) and confirms those that match.  Both turn the
confirmed pieces into the same segments: the region ranges of every other piece.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from tensorxfer.errors import ProtocolError
from tensorxfer.files.layout import plan_files
from tensorxfer.files.load import LoadPlan
from tensorxfer.files.pieces import PieceMap, file_sums
from tensorxfer.files.resume import PartialOutput, source_stats
from tensorxfer.transport.segments import Segments


def _moving_segments(runs: list[tuple[int, int]], moving: Callable[[int], None]) -> Segments:
    """The segments a partial update moves (region ``runs``, the same offsets on both ends); ``moving`` (the
    progress bar) is told their bytes."""
    offsets = [off for off, _ in runs]
    segments = Segments.of(offsets, offsets, [n for _, n in runs])
    moving(segments.total_bytes)
    return segments


class HeldOutput:
    """The receiver's holder for one offer: ``report(record)`` is told what was kept and discarded,
    ``moving(nbytes)`` how many bytes move (the progress bar's data phase)."""

    def __init__(self, partial: PartialOutput, report: Callable[[dict[str, Any]], None],
                 moving: Callable[[int], None]) -> None:
        self.partial = partial
        self._report, self._moving = report, moving

    def claim(self, region: Any) -> tuple[list[int], list[int]]:
        return self.partial.claim(region)

    def keep(self, region: Any, confirmed: list[int]) -> Segments | None:
        runs = self.partial.keep(confirmed)
        if self.partial.kept or self.partial.discarded:
            self._report(self.partial.report())
        return _moving_segments(runs, self._moving) if runs is not None else None


class SourcePieces:
    """The sender's checker: held pieces against the source files of ``plan`` (whose manifest was offered);
    ``moving(nbytes)`` is told how many bytes move once the confirmed pieces are known."""

    def __init__(self, plan: LoadPlan, log: logging.Logger, moving: Callable[[int], None]) -> None:
        self.manifest, self._moving = plan.manifest, moving
        plans = plan_files(plan.manifest)
        self.pmap = PieceMap(plan.manifest, plans)
        self.sources = source_stats(plan.manifest, len(plans))
        # file index in the layout -> (path, data offset in the file), for the safetensors files (the plan's jobs)
        tensor_files = [i for i, fp in enumerate(plans) if fp.header is not None]
        self.paths: dict[int, tuple[str, int]] = {}
        for i, (path, _), size in zip(tensor_files, plan.jobs, plan.sizes, strict=True):
            header = plans[i].header
            assert header is not None
            self.paths[i] = (str(path), size - header.data_bytes)
        self.log = log
        self.differ = 0

    def confirm(self, pieces: list[int], sums: list[int]) -> list[int]:
        by_file: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for p, s in zip(pieces, sums, strict=True):
            if not 0 <= p < self.pmap.count:
                raise ProtocolError(f"held frame: piece {p} is not one of this transfer's {self.pmap.count}")
            by_file[self.pmap.file_of(p)].append((p, s))
        confirmed = []
        for i, held in by_file.items():
            path, data_at = self.paths[i]
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if (st.st_size, st.st_mtime_ns) != self.sources[i]:
                    self.log.warning("%s changed since this send read it: none of its pieces is kept", path)
                    self.differ += len(held)
                    continue
                mine = file_sums(fd, data_at, self.pmap, [p for p, _ in held])
            finally:
                os.close(fd)
            for (p, s), m in zip(held, mine, strict=True):
                if m == s:
                    confirmed.append(p)
                else:
                    self.differ += 1
        if self.differ:
            self.log.info("%d piece(s) the receiver holds differ from the source now: sent again", self.differ)
        return sorted(confirmed)

    def missing(self, confirmed: list[int]) -> Segments | None:
        return _moving_segments(self.pmap.runs_without(confirmed), self._moving)


__all__ = ["HeldOutput", "SourcePieces"]
