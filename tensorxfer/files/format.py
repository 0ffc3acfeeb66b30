"""The safetensors file format, read as hostile input; file names safe to write.

A safetensors file is an 8-byte little-endian header length ``N``, ``N``
bytes of JSON (``{name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {str: str}}``), then the data bytes.  :func:`read_header`
treats all of it as hostile input: the length is bounded by the file size
and a 100 MB cap, the JSON must be UTF-8 with no duplicate keys and at most
:data:`MAX_JSON_DEPTH` levels of nesting, every entry has exactly the
expected fields with sane types, sizes agree with dtypes and shapes, and the
data offsets tile the data section exactly (no holes, no overlaps, no
trailing bytes — the format forbids them).

:func:`check_name` is the one rule for file names, on both ends: plain,
printable names only; :func:`fsync_dir` makes names written in a directory
durable.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorxfer.dtypes import DTYPES
from tensorxfer.errors import TensorXferError

MAX_HEADER_BYTES = 100_000_000     # the safetensors library's own cap
MAX_JSON_DEPTH = 32                 # safetensors headers need 3 levels, the file layout 2, an index 3
TEMP_PREFIX = ".tensorxfer-"        # the receiver's temporary files; no received name may start with it
HEADER_LENGTH = struct.Struct("<Q")
_DTYPE_NAME = re.compile(r"[A-Z][A-Z0-9_]{0,31}")
# bidi embeddings/overrides/isolates and the bidi marks: they make a name display as another name
_BIDI = frozenset((0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)))
# JSON strings (and stray escapes) skipped, linearly, before brackets are counted
_JSON_SKIP = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|\\.', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


class FileFormatError(TensorXferError, ValueError):
    """A safetensors file, a source directory or a received file layout is malformed or unsafe."""


class OutputError(TensorXferError, OSError):
    """The received files cannot be written where asked (e.g. a directory at a target name)."""


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """One parsed safetensors header: the exact text and its entries in data-offset order."""

    text: str
    entries: tuple[Entry, ...]
    data_bytes: int


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise FileFormatError(f"duplicate key {k!r} in the header JSON")
        out[k] = v
    return out


def json_depth(text: str) -> int:
    """How deeply ``text``'s arrays and objects nest (strings skipped); linear time, no recursion."""
    brackets = _NOT_BRACKET.sub("", _JSON_SKIP.sub("", text)).encode("ascii")
    steps = np.where(np.isin(np.frombuffer(brackets, np.uint8), (0x5B, 0x7B)), 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max(initial=0))


def loads(text: str, where: str, what: str = "JSON", max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` for hostile text: duplicate keys refused, nesting bounded before parsing.

    Raises
    ------
    FileFormatError
        Not JSON, duplicate keys, or nested deeper than ``max_depth``.
    """
    # cheap bound first: fewer opening brackets than the limit cannot nest deeper than it
    depth = 0 if text.count("[") + text.count("{") <= max_depth else json_depth(text)
    if depth > max_depth:
        raise FileFormatError(f"{where}: {what} nests {depth} levels deep, over the limit of {max_depth}; refused")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as e:   # FileFormatError (duplicates) is a ValueError
        if isinstance(e, FileFormatError):
            raise FileFormatError(f"{where}: {e}") from None
        raise FileFormatError(f"{where}: {what} is not valid JSON: {e}") from None


def parse_header(text: str, data_bytes: int, where: str) -> Header:
    """Validate header JSON text against a data section of ``data_bytes``.

    Raises
    ------
    FileFormatError
        Anything malformed, inconsistent or out of bounds (the message names ``where``).
    """
    obj = loads(text, where, "header")
    if not isinstance(obj, dict):
        raise FileFormatError(f"{where}: header must be a JSON object")
    meta = obj.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise FileFormatError(f"{where}: __metadata__ must map strings to strings")
    entries = []
    for name, rec in obj.items():
        if name == "__metadata__":
            continue
        if not isinstance(rec, dict) or set(rec) != {"dtype", "shape", "data_offsets"}:
            raise FileFormatError(f"{where}: tensor {name!r} must have exactly dtype, shape and data_offsets")
        dtype, shape, offs = rec["dtype"], rec["shape"], rec["data_offsets"]
        if not isinstance(dtype, str) or not _DTYPE_NAME.fullmatch(dtype):
            raise FileFormatError(f"{where}: tensor {name!r} has an invalid dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 1 << 62 for d in shape) \
                or len(shape) > 64:
            raise FileFormatError(f"{where}: tensor {name!r} has an invalid shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
                and 0 <= offs[0] <= offs[1] <= data_bytes):
            raise FileFormatError(f"{where}: tensor {name!r} has data_offsets {offs!r} outside the "
                                  f"{data_bytes}-byte data section")
        if dtype in DTYPES and math.prod(shape) * DTYPES[dtype].itemsize != offs[1] - offs[0]:
            raise FileFormatError(f"{where}: tensor {name!r}: {dtype}{shape} needs "
                                  f"{math.prod(shape) * DTYPES[dtype].itemsize} bytes, data_offsets give "
                                  f"{offs[1] - offs[0]}")
        entries.append(Entry(name, dtype, tuple(shape), offs[0], offs[1]))
    entries.sort(key=lambda x: (x.begin, x.end))
    pos = 0
    for x in entries:
        if x.begin != pos:
            raise FileFormatError(f"{where}: data section has a {'hole' if x.begin > pos else 'overlap'} at byte "
                                  f"{min(pos, x.begin)} (tensor {x.name!r})")
        pos = x.end
    if pos != data_bytes:
        raise FileFormatError(f"{where}: tensors cover {pos} bytes of a {data_bytes}-byte data section")
    return Header(text, tuple(entries), data_bytes)


def read_header(path: str | os.PathLike[str]) -> tuple[Header, int]:
    """Parse one file's header; returns it and the data section's file offset.

    Raises
    ------
    FileFormatError
        Malformed header, or a file size that does not match it.
    OSError
        The file cannot be read.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise FileFormatError(f"{path}: {size} bytes is too short for a safetensors file")
        (n,) = HEADER_LENGTH.unpack(head)
        if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
            raise FileFormatError(f"{path}: header length {n} is impossible for a {size}-byte file")
        raw = f.read(n)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileFormatError(f"{path}: header is not UTF-8: {e}") from None
    return parse_header(text, size - 8 - n, str(path)), 8 + n


def check_name(name: object) -> str:
    """A file name safe to create inside an output directory, and to show to a person.

    Only plain names: no directories, no ``.``/``..``, no NUL or other
    control characters (newlines included), no backslashes, no bidi
    overrides/isolates/marks (U+202A–U+202E, U+2066–U+2069, U+200E/F,
    U+061C), no lone surrogates (what Python makes of non-UTF-8 bytes in
    a file name), no leading/trailing whitespace, not our own temporary
    prefix ``.tensorxfer-``, at most 255 UTF-8 bytes.

    Raises
    ------
    FileFormatError
        The name could escape, could hide what it is, or is not a usable file name.
    """
    why = None
    if not isinstance(name, str) or not name:
        why = "not a non-empty string"
    elif name in (".", "..") or "/" in name or "\\" in name:
        why = "a path, not a plain name"
    elif name != name.strip():
        why = "leading or trailing whitespace"
    elif name.startswith(TEMP_PREFIX):
        why = f"the {TEMP_PREFIX}* prefix is reserved for temporary files"
    else:
        for ch in name:
            o = ord(ch)
            if o < 0x20 or 0x7F <= o < 0xA0:
                why = f"control character U+{o:04X}"
            elif 0xD800 <= o < 0xE000:
                why = f"lone surrogate U+{o:04X} (the name is not valid UTF-8)"
            elif o in _BIDI:
                why = f"bidirectional-text control U+{o:04X}"
            if why:
                break
        else:
            if len(name.encode("utf-8")) > 255:
                why = "longer than 255 bytes"
    if why:
        raise FileFormatError(f"refusing unsafe file name {name!r}: {why}; only plain names inside the output "
                              f"directory are allowed")
    assert isinstance(name, str)
    return name




def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the names written in directory ``path`` durable (a rename or a new file is in the directory's
    data, which a file's own fsync does not flush)."""
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
