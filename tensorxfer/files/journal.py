"""The receiver's resume journal: which pieces of an interrupted transfer are in its temporary files.

One file, ``.tensorxfer-resume.journal`` in the output directory (hidden; no received name may start with
``.tensorxfer-``, so it never is, nor collides with, an output file).  It is a magic line, then frames:
``>IQ`` (payload length, xxh3_64 of the payload) and a msgpack payload -- first a header (the piece size,
and per file of the transfer its name, its temporary file, the sha256 of its header, its data bytes and
the sender's size and mtime of its source), then any number of piece records (file index, piece index,
checksum), appended as pieces reach the disk.  A record is appended only after the temporary files it
names were fdatasynced, and each append is fsynced: what the journal names was on disk first.

The journal is hostile input (a user may edit it; a crash may tear its end; a disk may corrupt it):
:func:`read_journal` reads at most :data:`MAX_JOURNAL_BYTES`, checks every frame's checksum, bounds
msgpack before decoding it (never pickle), and checks every field: names are plain names, temporary
files are ``.tensorxfer-*.part`` names inside the output directory, indices are in range.  A frame torn
at the end (a writer killed mid-append) is dropped with a note; anything else wrong refuses the whole
journal (:class:`JournalError`) -- the caller then discards the partial output and starts over.  Even
an accepted journal is only a claim: every piece it names is checked against its temporary file, and
then against the sender's source, before it is kept (:mod:`tensorxfer.files.resume`).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import xxhash

from tensorxfer.files.format import TEMP_PREFIX, FileFormatError, check_name, fsync_dir
from tensorxfer.protocol import scan_msgpack

JOURNAL_NAME = f"{TEMP_PREFIX}resume.journal"
_NEW_NAME = f"{TEMP_PREFIX}resume.journal.new"
MAGIC = b"tensorxfer-resume-journal 1\n"
FRAME = struct.Struct(">IQ")                 # payload length, xxh3_64 of the payload
MAX_JOURNAL_BYTES = 64 << 20                # ~4M piece records: far beyond any transfer's 2 MiB pieces
MAX_HEADER_BYTES = 8 << 20
MAX_RECORD_FRAME = 1 << 20
MAX_FILES = 1 << 16
MAX_DATA_BYTES = 1 << 50                    # per file: a petabyte
TEMP_NAME = re.compile(rf"{re.escape(TEMP_PREFIX)}[A-Za-z0-9_]{{1,64}}\.part")
_SHA = re.compile(r"[0-9a-f]{64}")


class JournalError(FileFormatError):
    """The resume journal cannot be trusted (malformed, edited, or of another version); the message says
    why.  The partial output it describes is discarded and the transfer starts over."""


@dataclass(frozen=True)
class JournalFile:
    """One file of the interrupted transfer, as the journal records it."""

    name: str
    temp: str               # its temporary file's name in the output directory
    header_sha: str         # sha256 (hex) of its safetensors header text
    data_bytes: int
    src_size: int           # the sender's size and mtime of the source file (-1: not sent)
    src_mtime_ns: int

    def pieces(self, piece_bytes: int) -> int:
        return -(-self.data_bytes // piece_bytes)


@dataclass
class Journal:
    """A journal as read: its files, the pieces recorded for them (``(file, piece) -> checksum``), and notes
    for the user (a torn end dropped)."""

    piece_bytes: int
    files: list[JournalFile]
    pieces: dict[tuple[int, int], int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _unpack(payload: bytes, what: str) -> Any:
    try:
        scan_msgpack(payload, 8 * MAX_FILES + 64, 4, what)
        return msgpack.unpackb(payload, raw=False, strict_map_key=True, max_str_len=4096,
                               max_bin_len=len(payload), max_array_len=MAX_FILES, max_map_len=16, max_ext_len=0)
    except Exception as e:      # msgpack raises several types for bad input (ProtocolError from the scan)
        raise JournalError(f"{what} is not valid msgpack ({type(e).__name__}: {e})") from None


def _int(v: object, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def _header(obj: Any, piece_bytes_expected: int) -> tuple[int, list[JournalFile]]:
    if not isinstance(obj, dict) or set(obj) != {"v", "piece_bytes", "files"} or obj["v"] != 1:
        raise JournalError("its header is not a version 1 header")
    piece_bytes, raw = obj["piece_bytes"], obj["files"]
    if piece_bytes != piece_bytes_expected:
        raise JournalError(f"it was written with {piece_bytes!r}-byte pieces; this version uses "
                           f"{piece_bytes_expected}")
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_FILES:
        raise JournalError("its header lists no files, or too many")
    files, names, temps = [], set(), set()
    for i, r in enumerate(raw):
        if not (isinstance(r, list) and len(r) == 6 and all(isinstance(v, str) for v in r[:3])
                and _int(r[3], 0, MAX_DATA_BYTES) and _int(r[4], -1, MAX_DATA_BYTES) and _int(r[5], -1, 1 << 63)):
            raise JournalError(f"file {i} of its header is malformed")
        try:
            name = check_name(r[0])
        except FileFormatError as e:
            raise JournalError(f"file {i} of its header has an unsafe name ({e})") from None
        if not TEMP_NAME.fullmatch(r[1]) or not _SHA.fullmatch(r[2]):
            raise JournalError(f"file {name!r}: its temporary file {r[1][:80]!r} or header digest is not one "
                               f"this receiver writes")
        if name in names or r[1] in temps:
            raise JournalError(f"file {name!r} or its temporary file appears twice")
        names.add(name)
        temps.add(r[1])
        files.append(JournalFile(name, r[1], r[2], r[3], r[4], r[5]))
    return piece_bytes, files


def _records(obj: Any, j: Journal) -> None:
    if not isinstance(obj, dict) or set(obj) != {"f", "p", "s"} or not all(isinstance(v, bytes) for v in obj.values()):
        raise JournalError("a piece record is malformed")
    n = len(obj["f"]) // 4
    if len(obj["f"]) != 4 * n or len(obj["p"]) != 4 * n or len(obj["s"]) != 8 * n:
        raise JournalError("a piece record's columns differ in length")
    fs = np.frombuffer(obj["f"], "<u4").tolist()
    ps = np.frombuffer(obj["p"], "<u4").tolist()
    ss = np.frombuffer(obj["s"], "<u8").tolist()
    for f, p, s in zip(fs, ps, ss, strict=True):
        if f >= len(j.files) or p >= j.files[f].pieces(j.piece_bytes):
            raise JournalError(f"a piece record names piece {p} of file {f}, which the header does not have")
        if j.pieces.setdefault((f, p), s) != s:
            raise JournalError(f"piece {p} of {j.files[f].name!r} is recorded twice with different checksums")


def read_journal(out_dir: str | os.PathLike[str], piece_bytes: int) -> Journal | None:
    """The journal in ``out_dir``, checked (see the module); None when there is none.

    Raises
    ------
    JournalError
        It cannot be trusted; the message says why.
    """
    path = Path(out_dir) / JOURNAL_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise JournalError(f"cannot open it ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise JournalError("it is not a regular file")
        if st.st_size > MAX_JOURNAL_BYTES:
            raise JournalError(f"it is {st.st_size:,} bytes, over the limit of {MAX_JOURNAL_BYTES:,}")
        data = os.pread(fd, MAX_JOURNAL_BYTES + 1, 0)
    finally:
        os.close(fd)
    if not data.startswith(MAGIC):
        raise JournalError("it does not start with the journal's magic line (not a journal, or truncated)")
    pos, frames = len(MAGIC), list[bytes | None]()
    while pos < len(data):
        if pos + FRAME.size > len(data):
            frames.append(None)         # torn: the length was cut off
            break
        n, digest = FRAME.unpack_from(data, pos)
        limit = MAX_HEADER_BYTES if not frames else MAX_RECORD_FRAME
        if n > limit:
            raise JournalError(f"frame {len(frames)} claims {n:,} bytes, over the limit of {limit:,}")
        body = data[pos + FRAME.size:pos + FRAME.size + n]
        last = pos + FRAME.size + n >= len(data)
        if len(body) != n or xxhash.xxh3_64_intdigest(body) != digest:
            if last:
                frames.append(None)     # torn (or edited) last frame: what it held is not claimed
                break
            raise JournalError(f"frame {len(frames)} does not match its checksum (edited or corrupted)")
        frames.append(body)
        pos += FRAME.size + n
    if not frames or frames[0] is None:
        raise JournalError("its header is missing or torn")
    pb, files = _header(_unpack(frames[0], "its header"), piece_bytes)
    j = Journal(pb, files)
    for k, record in enumerate(frames[1:], 1):
        if record is None:
            j.notes.append("its last record was torn (the receiver was killed while writing it): the pieces "
                           "it named are not claimed")
            break
        _records(_unpack(record, f"record frame {k}"), j)
    return j


def _frame(obj: Any) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return FRAME.pack(len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


def _records_frame(entries: list[tuple[int, int, int]]) -> bytes:
    arr = np.array(entries, dtype=np.uint64).reshape(-1, 3)
    return _frame({"f": arr[:, 0].astype("<u4").tobytes(), "p": arr[:, 1].astype("<u4").tobytes(),
                   "s": arr[:, 2].astype("<u8").tobytes()})


class JournalWriter:
    """The journal of the transfer in progress: written whole (atomically) by :meth:`create`, then appended
    to.  One owner of its fd; :meth:`close` is idempotent."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd = fd
        self.path = path

    @classmethod
    def create(cls, out_dir: Path, piece_bytes: int, files: list[JournalFile],
               entries: list[tuple[int, int, int]]) -> JournalWriter:
        """Write a new journal (header and ``entries``: ``(file, piece, checksum)``) under a temporary name,
        fsync it, and rename it over the old one; the directory is fsynced.

        Raises
        ------
        OSError
            Writing failed (nothing replaced the old journal).
        """
        new = out_dir / _NEW_NAME
        header = {"v": 1, "piece_bytes": piece_bytes,
                  "files": [[f.name, f.temp, f.header_sha, f.data_bytes, f.src_size, f.src_mtime_ns] for f in files]}
        data = MAGIC + _frame(header)
        for k in range(0, len(entries), 1 << 15):
            data += _records_frame(entries[k:k + (1 << 15)])
        fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, data)
            os.fsync(fd)
            os.replace(new, out_dir / JOURNAL_NAME)
            fsync_dir(out_dir)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(new)
            raise
        return cls(fd, out_dir / JOURNAL_NAME)

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def append(self, entries: list[tuple[int, int, int]]) -> None:
        """Append piece records (their data must already be on disk) and fsync."""
        if self._fd < 0 or not entries:
            return
        for k in range(0, len(entries), 1 << 15):
            _write_all(self._fd, _records_frame(entries[k:k + (1 << 15)]))
        os.fsync(self._fd)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def remove_journal(out_dir: str | os.PathLike[str]) -> bool:
    """Remove the journal (and a half-written new one); whether there was one."""
    found = False
    for name in (JOURNAL_NAME, _NEW_NAME):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(Path(out_dir) / name)
            found = True
    return found


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


__all__ = ["JOURNAL_NAME", "Journal", "JournalError", "JournalFile", "JournalWriter", "read_journal",
           "remove_journal"]
