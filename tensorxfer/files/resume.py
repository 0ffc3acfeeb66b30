"""The receiver's partial output across runs: what an interrupted transfer left, matched against a new offer,
and the journal of the transfer in progress.

:class:`PartialOutput` is made per offer (``tensorxfer-recv``'s on_offer) from the journal on disk
(:mod:`tensorxfer.files.journal`).  A file of the offer keeps the pieces an interrupted run journaled for it
only if it is the same file: same name, same header (sha256), same source size and mtime on the sender
(:data:`SOURCES_KEY`); otherwise they are discarded, with the reason.  Each kept piece is then read back
from its temporary file into the region and hashed: one that does not match its journal entry is
discarded (:meth:`claim`); the sender confirms the rest against its source, and what it does not confirm
is discarded too (:meth:`keep`).  So a piece is kept only if the journal, the temporary file and the
sender's source all agree; everything else is sent again, never mixed.

While the update lands, :meth:`written` (the :class:`~tensorxfer.files.write.ModelWriter`'s hook, in its
writer thread) counts each piece's bytes into the temporary files; a complete piece is hashed from the
region and, every :data:`FLUSH_BYTES` or :data:`FLUSH_SECONDS` (a timer thread flushes a stalled transfer's
last pieces too), the temporary files are fdatasynced and the pieces appended to the journal (fsynced): a
receiver killed then loses only what was not flushed, and what had landed in memory but was not yet in
its temporary files (the writer trails the network by the disk's rate: on the dev VM, 0.4 GB of 1.29 GB
landed 1.5 s before the kill; none after 6 s -- benchmarks/results/2026-12-06-resume-restart).  The data is
fdatasynced before its pieces are journaled (measured: journaling without it kept no more there, since the
writes themselves trail); the read-back check at the next start (:meth:`claim`) would catch it anyway.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensorxfer.files.format import FileFormatError, loads
from tensorxfer.files.journal import Journal, JournalFile, JournalWriter, remove_journal
from tensorxfer.files.layout import SOURCES_KEY, FilePlan
from tensorxfer.files.pieces import PIECE_BYTES, PieceMap, hash_runs
from tensorxfer.manifest import Manifest

log = logging.getLogger(__name__)

FLUSH_BYTES = 32 << 20
FLUSH_SECONDS = 1.0


@dataclass(frozen=True)
class Discarded:
    """Partial output not kept: which file, why, and how many bytes of pieces it held."""

    name: str
    reason: str
    nbytes: int

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "reason": self.reason, "bytes": self.nbytes}


def source_stats(manifest: Manifest, files: int) -> list[tuple[int, int]]:
    """Per file of the layout, the sender's ``(size, mtime_ns)`` of its source; ``(-1, -1)`` where the offer
    says nothing usable (a side file, an older sender, or a malformed entry: hostile input, never trusted)."""
    unknown = [(-1, -1)] * files
    raw = manifest.metadata.get(SOURCES_KEY)
    if raw is None:
        return unknown
    try:
        items = loads(raw, "the transfer's source list", max_depth=2)
    except FileFormatError:
        return unknown
    if not isinstance(items, list) or len(items) != files:
        return unknown
    return [(v[0], v[1]) if isinstance(v, list) and len(v) == 2 and all(type(x) is int and x >= 0 for x in v)
            else (-1, -1) for v in items]


def header_sha(fp: FilePlan) -> str:
    return hashlib.sha256(fp.text.encode("utf-8", "surrogatepass")).hexdigest()


class PartialOutput:
    """One offer's partial output on the receiver (see the module).  ``reuse``: file index -> the temporary
    file an interrupted run left for it (the writer reopens it); ``discarded``: what was not kept."""

    def __init__(self, out_dir: Path, manifest: Manifest, plans: list[FilePlan], journal: Journal | None) -> None:
        self.out = out_dir
        self.plans = plans
        self.pmap = PieceMap(manifest, plans, PIECE_BYTES)
        self.sources = source_stats(manifest, len(plans))
        self.reuse: dict[int, str] = {}
        self.discarded: list[Discarded] = []
        self.kept: list[int] = []
        self.kept_bytes = 0
        self._candidates: dict[int, int] = {}      # piece -> checksum the journal recorded
        self._claimed: dict[int, int] = {}         # piece -> checksum, read back from its temporary file
        self._writer: Any = None
        self._journal: JournalWriter | None = None
        self._left: dict[int, int] = {}            # piece -> tensor bytes not yet in its temporary file
        self._pending: list[tuple[int, int, int]] = []
        self._pending_files: set[int] = set()
        self._pending_bytes = 0
        self._flushed_at = time.monotonic()
        self.journaled_bytes = 0                   # tensor bytes the journal names (kept ones included)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        if journal is not None:
            self._match(journal)

    # ------------------------------------------------------------ before the data
    def _match(self, journal: Journal) -> None:
        held: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for (f, p), s in journal.pieces.items():
            held[f].append((p, s))
        by_name = {jf.name: (k, jf) for k, jf in enumerate(journal.files)}
        used: set[int] = set()
        for i, fp in enumerate(self.plans):
            hit = by_name.get(fp.name)
            if hit is None or fp.header is None:
                continue
            k, jf = hit
            used.add(k)
            why = self._why_not(i, fp, jf)
            first = self.pmap.files[i][0]
            nbytes = self.pmap.nbytes(first + p for p, _ in held[k]) if why is None else \
                min(len(held[k]) * journal.piece_bytes, jf.data_bytes)
            if why is not None:
                self._drop(jf.temp)
                if held[k]:
                    self.discarded.append(Discarded(fp.name, why, nbytes))
                continue
            self.reuse[i] = str(self.out / jf.temp)
            for p, s in held[k]:
                self._candidates[first + p] = s
        for k, jf in enumerate(journal.files):
            if k not in used:
                self._drop(jf.temp)
                if held[k]:
                    self.discarded.append(Discarded(jf.name, "not in this transfer",
                                                    min(len(held[k]) * journal.piece_bytes, jf.data_bytes)))

    def _why_not(self, i: int, fp: FilePlan, jf: JournalFile) -> str | None:
        assert fp.header is not None
        if jf.header_sha != header_sha(fp) or jf.data_bytes != fp.header.data_bytes:
            return "its tensors changed on the sender (another header)"
        size, mtime = self.sources[i]
        if (jf.src_size, jf.src_mtime_ns) != (size, mtime):
            return (f"its source changed on the sender since the interrupted run (size {jf.src_size:,} -> "
                    f"{size:,}, mtime {jf.src_mtime_ns} -> {mtime} ns)")
        try:
            mode = os.lstat(self.out / jf.temp).st_mode
        except FileNotFoundError:
            return "its temporary file is gone"
        if not stat.S_ISREG(mode):
            return "its temporary file is not a regular file"
        return None

    def _drop(self, temp: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISREG(os.lstat(self.out / temp).st_mode):
                os.unlink(self.out / temp)

    def attach(self, writer: Any) -> None:
        """The writer of this transfer (made with :attr:`reuse`); its temporary files are journaled."""
        self._writer = writer

    def claim(self, region: Any) -> tuple[list[int], list[int]]:
        """Read every candidate piece back from its temporary file into ``region`` and hash it; return the
        pieces that match their journal entries, and their checksums (a session's :class:`Holder` claim)."""
        bad: dict[int, int] = defaultdict(int)
        by_file: dict[int, list[int]] = defaultdict(list)
        for p in sorted(self._candidates):
            by_file[self.pmap.file_of(p)].append(p)
        with memoryview(region.region) as whole, whole.cast("B") as mem:
            for i, pieces in by_file.items():
                data_at = self.pmap.files[i][3]
                fd = os.open(self.reuse[i], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    for p in pieces:
                        runs = self.pmap.runs(p)
                        views = [mem[r.region_off:r.region_off + r.nbytes] for r in runs]
                        ok = all(os.preadv(fd, [v], data_at + r.data_pos) == r.nbytes
                                 for v, r in zip(views, runs, strict=True))
                        digest = hash_runs(views) if ok else None
                        for v in views:
                            v.release()
                        if digest is not None and digest == self._candidates[p]:
                            self._claimed[p] = digest
                        else:
                            bad[i] += 1
                finally:
                    os.close(fd)
        for i, n in bad.items():
            self.discarded.append(Discarded(self.plans[i].name, f"{n} piece(s) in its temporary file do not match "
                                                                f"the journal (edited, or torn by a crash)",
                                            n * self.pmap.piece_bytes))
        claimed = sorted(self._claimed)
        return claimed, [self._claimed[p] for p in claimed]

    def keep(self, confirmed: list[int]) -> list[tuple[int, int]] | None:
        """The sender confirmed ``confirmed`` (of the claim): keep those, journal the transfer now in
        progress, and return the region ranges still to move (None: everything moves)."""
        writer = self._writer
        assert writer is not None
        kept = set(confirmed)
        differ: dict[int, int] = defaultdict(int)
        for p in self._claimed:
            if p not in kept:
                differ[self.pmap.file_of(p)] += 1
        for i, n in differ.items():
            self.discarded.append(Discarded(self.plans[i].name, f"{n} piece(s) differ from the sender's source now",
                                            n * self.pmap.piece_bytes))
        self.kept = sorted(kept)
        for p in self.kept:
            for r in self.pmap.runs(p):
                writer.mark_written(r.region_off, r.nbytes)
        self.kept_bytes = self.pmap.nbytes(self.kept)
        self._left = {p: n for p in range(self.pmap.count) if p not in kept and (n := self.pmap.nbytes([p]))}
        files = [JournalFile(fp.name, os.path.basename(writer.temp_path(i)), header_sha(fp),
                             fp.header.data_bytes if fp.header is not None else 0, *self.sources[i])
                 for i, fp in enumerate(self.plans)]
        entries = []
        for p in self.kept:
            i = self.pmap.file_of(p)
            entries.append((i, p - self.pmap.files[i][0], self._claimed[p]))
        self._journal = JournalWriter.create(self.out, PIECE_BYTES, files, entries)
        self.journaled_bytes = self.kept_bytes
        self._timer = threading.Thread(target=self._flush_every, name="tensorxfer-journal", daemon=True)
        self._timer.start()
        if not kept:
            return None
        return self.pmap.runs_without(kept)

    # ------------------------------------------------------------ while landing
    def written(self, view: memoryview, i: int, file_pos: int, n: int) -> None:
        """``n`` tensor bytes of file ``i`` reached its temporary file at ``file_pos`` (the writer thread)."""
        if self._journal is None:
            return
        first, count, data, data_at = self.pmap.files[i]
        pb = self.pmap.piece_bytes
        d0, d1 = file_pos - data_at, file_pos - data_at + n
        with self._lock:
            for p in range(first + d0 // pb, first + min(count, -(-d1 // pb))):
                a = (p - first) * pb
                overlap = min(a + pb, data, d1) - max(a, d0)
                left = self._left.get(p)
                if left is None or overlap <= 0:
                    continue
                if left > overlap:
                    self._left[p] = left - overlap
                    continue
                del self._left[p]
                runs = self.pmap.runs(p)
                self._pending.append((i, p - first, hash_runs(view[r.region_off:r.region_off + r.nbytes]
                                                              for r in runs)))
                self._pending_files.add(i)
                self._pending_bytes += sum(r.nbytes for r in runs)
            if self._pending_bytes >= FLUSH_BYTES or time.monotonic() - self._flushed_at >= FLUSH_SECONDS:
                self._flush()

    def _flush_every(self) -> None:
        """Flush pieces that wait longer than FLUSH_SECONDS (the transfer stalled, or ends slowly).  A failed
        flush stops journaling (the writer's own error, if any, is the transfer's to report)."""
        wait = FLUSH_SECONDS
        while not self._stop.wait(wait):
            with self._lock:
                wait = self._flushed_at + FLUSH_SECONDS - time.monotonic()
                if wait > 0:        # flushed since: wake when that flush is FLUSH_SECONDS old
                    continue
                wait = FLUSH_SECONDS
                try:
                    self._flush()
                except OSError as e:
                    log.warning("journaling the partial output failed (%s): a restarted receiver resumes from "
                                "what was journaled before", e)
                    journal, self._journal = self._journal, None
                    if journal is not None:
                        journal.close()
                    return

    def _stop_timer(self) -> None:
        self._stop.set()
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.join()

    def _flush(self) -> None:
        if self._pending and self._journal is not None:
            for i in sorted(self._pending_files):
                self._writer.sync(i)         # the data first: the journal never names what is not on disk
            self._journal.append(self._pending)
            self.journaled_bytes += self._pending_bytes
        self._pending, self._pending_files, self._pending_bytes = [], set(), 0
        self._flushed_at = time.monotonic()

    # ------------------------------------------------------------ the end
    def suspend(self) -> None:
        """The transfer was interrupted (the writer thread has stopped): journal what reached the disk, close
        the journal; the temporary files stay for the next run (:attr:`journaled_bytes` says how much)."""
        self._stop_timer()
        with self._lock:
            try:
                self._flush()
            finally:
                journal, self._journal = self._journal, None
                if journal is not None:
                    journal.close()

    def close(self) -> None:
        """The transfer completed (its files are in place) or failed for good: the journal goes."""
        self._stop_timer()
        with self._lock:
            journal, self._journal = self._journal, None
            if journal is not None:
                journal.close()
        remove_journal(self.out)

    def report(self) -> dict[str, Any]:
        """What was kept and discarded, for the user."""
        return {"kept_pieces": len(self.kept), "kept_bytes": self.kept_bytes,
                "discarded": [d.as_dict() for d in self.discarded]}


__all__ = ["SOURCES_KEY", "Discarded", "PartialOutput", "source_stats"]
