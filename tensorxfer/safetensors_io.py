"""safetensors files in, the same files out — byte-identical — through one region.

A safetensors file is an 8-byte little-endian header length ``N``, ``N``
bytes of JSON (``{name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {str: str}}``), then the data bytes.  :func:`read_header`
treats all of it as hostile input: the length is bounded by the file size
and a 100 MB cap, the JSON must be UTF-8 with no duplicate keys and at most
:data:`MAX_JSON_DEPTH` levels of nesting, every entry has exactly the
expected fields with sane types, sizes agree with dtypes and shapes, and the
data offsets tile the data section exactly (no holes, no overlaps, no
trailing bytes — the format forbids them).

:func:`load_files` packs every tensor of every file into one region (one
transfer) and records, in the manifest metadata, which tensors belong to
which file, each file's original header text and mode bits, so
:func:`write_files` can write back the exact bytes: the header verbatim,
then the tensors in data-offset order.  A model directory also carries its
*side files* (``config.json``, ``generation_config.json``, tokenizer files,
the index, ...: every other regular top-level file, bounded by
:data:`MAX_SIDE_FILE_BYTES` each and :data:`MAX_SIDE_TOTAL_BYTES` in all)
verbatim in the metadata, so a Hugging Face directory arrives loadable.

Regions on a GPU (``device="cuda:N"``) are filled from, and written to,
files through two pinned staging buffers (:mod:`tensorxfer.staging`, the same loop as host regions),
double-buffered: the disk works on one while the copy engine works on the other.

Output (:func:`write_files`) is all-or-nothing: every name and target is
validated first; every file is written under a temporary
``.tensorxfer-*.part`` name in the target directory and fsynced; only then
are they renamed into place, and if a rename fails the ones already renamed
are rolled back (files they replaced are restored).  :func:`clean_leftovers`
removes the temporary files a killed writer left behind.

Metadata keys (all values are strings, so they fit the manifest format)::

    "tensorxfer.files"          JSON list: {"name", "kind", "tensors", "chunks", "mode"}
                                kind: "safetensors" | "text" (UTF-8 file) | "base64" (any other file)
    "tensorxfer.file.<i>.<j>"   chunk j of file i's header JSON (or the whole file for "text"/"base64")

Chunks stay under the manifest's 64 KiB per-string limit.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import logging
import math
import os
import re
import secrets
import stat
import struct
import tempfile
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tensorxfer.dtypes import DTYPES
from tensorxfer.errors import TensorXferError
from tensorxfer.manifest import MAX_METADATA_ITEMS, MAX_METADATA_STR, Manifest
from tensorxfer.region import TensorRegion
from tensorxfer.staging import open_stager, read_pieces, write_pieces

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 100_000_000     # the safetensors library's own cap
MAX_INDEX_BYTES = 16 << 20          # model.safetensors.index.json of a million tensors
MAX_SIDE_FILE_BYTES = 32 << 20      # one side file (the largest tokenizer.json we know is ~17 MB)
MAX_SIDE_TOTAL_BYTES = 48 << 20     # all side files together (they travel in the manifest's metadata)
MAX_JSON_DEPTH = 32                 # safetensors headers need 3 levels, the file layout 2, an index 3
CHUNK_BYTES = 60_000                # UTF-8 bytes per metadata string, under the manifest's 64 KiB limit
STAGE_BYTES = 32 << 20              # each of the two pinned buffers for GPU regions
FILES_KEY = "tensorxfer.files"
INDEX_NAME = "model.safetensors.index.json"
TEMP_PREFIX = ".tensorxfer-"
DEFAULT_MODE = 0o644
#: Other serializations of the weights found beside safetensors files: not side files, never sent.
OTHER_WEIGHT_SUFFIXES = frozenset((".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".ot",
                                   ".tflite", ".pkl", ".npz", ".nemo"))
_DTYPE_NAME = re.compile(r"[A-Z][A-Z0-9_]{0,31}")
_LEN = struct.Struct("<Q")
_KINDS = ("safetensors", "text", "base64")
_RECORD_KEYS = frozenset(("name", "kind", "tensors", "chunks"))
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
        (n,) = _LEN.unpack(head)
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


# ---------------------------------------------------------------- sending side
@dataclass(frozen=True)
class Source:
    """One file to send: its name on the receiver, where it is here, and how it travels."""

    name: str
    path: Path
    kind: str          # "safetensors" (tensors in the region) or "side" (bytes in the metadata)


@dataclass
class Discovery:
    """What :func:`discover` found: the files to send, and what it left out (name, reason)."""

    files: list[Source]
    skipped: list[tuple[str, str]] = field(default_factory=list)


def _allowed_root(directory: Path) -> Path:
    """Where symlinks inside ``directory`` may point: the directory itself, or for a Hugging Face
    hub snapshot (``models--org--name/snapshots/<rev>``, whose files link to ``../../blobs``) the
    repository folder."""
    real = directory.resolve()
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        return real.parent.parent
    return real


def _inside(path: Path, root: Path) -> Path:
    real = path.resolve()
    if real != root and root not in real.parents:
        raise FileFormatError(f"{path} is a symlink to {real}, outside {root}: refusing to send it (copy the file "
                              f"into the directory, or remove the link)")
    return real


def _read_index(index: Path) -> list[str]:
    size = index.stat().st_size
    if size > MAX_INDEX_BYTES:
        raise FileFormatError(f"{index}: {size} bytes, over the {MAX_INDEX_BYTES}-byte limit for an index")
    try:
        text = index.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileFormatError(f"{index}: not UTF-8 text: {e}") from None
    obj = loads(text, str(index), "index")
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise FileFormatError(f"{index}: not a usable index (needs a non-empty \"weight_map\" object)")
    return sorted({check_name(v) for v in weight_map.values()})


def discover(sources: Sequence[str | os.PathLike[str]]) -> Discovery:
    """Every file to send: files as given, directories expanded.

    A directory sends its tensor files — those its
    ``model.safetensors.index.json`` ``weight_map`` names, or without an
    index every ``*.safetensors`` in it — and every other regular top-level
    file as a side file (configs, tokenizer files, the index itself).  Left
    out, and listed in :attr:`Discovery.skipped`: hidden files,
    subdirectories, other weight formats (``.bin``, ``.pt``, ...),
    ``*.safetensors`` the index does not name, and anything that is not a
    regular file.  A symlink is followed only when it stays inside the
    directory (for a Hugging Face hub snapshot: inside its repository
    folder).  A file given by name is a tensor file if it ends in
    ``.safetensors``, else a side file.

    Raises
    ------
    FileFormatError
        No files, duplicate output names, unsafe names, an unusable index,
        a symlink pointing outside the directory, or side files over
        :data:`MAX_SIDE_FILE_BYTES` / :data:`MAX_SIDE_TOTAL_BYTES`.
    FileNotFoundError
        A source does not exist.
    """
    found = Discovery([])
    for src in sources:
        p = Path(src)
        if p.is_dir():
            _discover_dir(p, found)
        elif p.is_file():
            name = check_name(p.name)
            found.files.append(Source(name, p, "safetensors" if p.suffix == ".safetensors" else "side"))
        elif p.exists() or p.is_symlink():
            raise FileFormatError(f"{p}: not a regular file or directory")
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")
    names = [s.name for s in found.files]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise FileFormatError(f"several sources would be written as {sorted(dup)}; send them separately")
    if not found.files:
        raise FileFormatError("nothing to send")
    side = [(s, s.path.stat().st_size) for s in found.files if s.kind == "side"]
    for s, size in side:
        if size > MAX_SIDE_FILE_BYTES:
            raise FileFormatError(f"{s.path}: {size} bytes, over the {MAX_SIDE_FILE_BYTES}-byte limit for a side "
                                  f"file (side files travel in the transfer's metadata); move it out of the "
                                  f"directory or send the *.safetensors files by name")
    total = sum(size for _, size in side)
    if total > MAX_SIDE_TOTAL_BYTES:
        raise FileFormatError(f"side files add up to {total} bytes, over the {MAX_SIDE_TOTAL_BYTES}-byte limit "
                              f"({', '.join(s.name for s, _ in side)}); move some out of the directory")
    return found


def _discover_dir(d: Path, found: Discovery) -> None:
    root = _allowed_root(d)
    index = d / INDEX_NAME
    tensor_names = _read_index(_inside(index, root)) if index.is_file() else None
    entries = sorted(d.iterdir(), key=lambda q: q.name)
    if tensor_names is None:
        tensor_names = [q.name for q in entries if q.suffix == ".safetensors" and q.is_file()]
        if not tensor_names:
            raise FileFormatError(f"{d}: no *.safetensors files in this directory")
    wanted = set(tensor_names)
    for n in tensor_names:
        q = d / n
        if not q.is_file():
            raise FileFormatError(f"{index}: names {n!r}, which is not a file in {d}")
        _inside(q, root)
        found.files.append(Source(check_name(n), q, "safetensors"))
    for q in entries:
        if q.name in wanted:
            continue
        if q.name.startswith("."):
            found.skipped.append((q.name, "hidden"))
        elif q.is_dir():
            found.skipped.append((q.name + "/", "subdirectory; only top-level files are sent"))
        elif q.suffix == ".safetensors":
            found.skipped.append((q.name, f"not named by {INDEX_NAME}"))
        elif q.suffix in OTHER_WEIGHT_SUFFIXES:
            found.skipped.append((q.name, "another weight format; the safetensors files carry the weights"))
        elif q.is_symlink() and not q.exists():
            found.skipped.append((q.name, "dangling symlink"))
        else:
            if not stat.S_ISREG(_inside(q, root).stat().st_mode):
                found.skipped.append((q.name, "not a regular file"))
                continue
            found.files.append(Source(check_name(q.name), q, "side"))


def _chunks(text: str) -> list[str]:
    """Cut ``text`` into strings of at most CHUNK_BYTES UTF-8 bytes, never inside a character."""
    data = text.encode("utf-8")
    out, i = [], 0
    while i < len(data):
        j = min(i + CHUNK_BYTES, len(data))
        while j < len(data) and data[j] & 0xC0 == 0x80:
            j -= 1
        out.append(data[i:j].decode("utf-8"))
        i = j
    return out or [""]


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


def load_files(sources: Sequence[str | os.PathLike[str]] | Discovery, device: str = "cpu") -> TensorRegion:
    """Read safetensors files (and side files) into one new region on ``device``.

    Returns a region the caller owns (close it).  On a GPU the tensors are
    read through pinned staging buffers.

    Raises
    ------
    FileFormatError
        A file is malformed, two files hold a tensor of the same name, or
        the headers and side files do not fit the manifest's metadata.
    CudaError
        ``device`` is a GPU this machine cannot use.
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
        chunks = _chunks(text)
        records.append({"name": src.name, "kind": kind, "tensors": len(entries), "chunks": len(chunks),
                        "mode": mode})
        meta.update({f"tensorxfer.file.{i}.{j}": c for j, c in enumerate(chunks)})
    meta[FILES_KEY] = json.dumps(records)
    if len(meta) > MAX_METADATA_ITEMS or len(meta[FILES_KEY].encode("utf-8")) >= MAX_METADATA_STR:
        raise FileFormatError(f"{len(records)} files whose headers and side files need {len(meta)} metadata "
                              f"strings (limit {MAX_METADATA_ITEMS} of {CHUNK_BYTES} bytes, and one file list "
                              f"under {MAX_METADATA_STR} bytes): send fewer files at once")
    manifest = Manifest.layout(layout, metadata=meta)
    region = TensorRegion.from_manifest(manifest, device=device)
    try:
        jobs, k = [], 0
        for path, data_at, header in plan:
            items = []
            for entry in header.entries:
                spec = manifest.tensors[k]
                k += 1
                items.append((data_at + entry.begin, spec.offset, spec.nbytes))
            jobs.append((path, items))
        _fill(region, jobs)
    except BaseException:
        region.close(defer=True)
        raise
    return region


def _fill(region: TensorRegion, jobs: list[tuple[Path, list[tuple[int, int, int]]]]) -> None:
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


# ---------------------------------------------------------------- receiving side
@dataclass(frozen=True)
class FilePlan:
    name: str
    kind: str
    text: str
    header: Header | None
    first_tensor: int
    mode: int = DEFAULT_MODE
    data: bytes | None = None      # the whole file, for "text" and "base64" files


def plan_files(manifest: Manifest) -> list[FilePlan]:
    """Validate a received manifest's file layout against its tensors (hostile input).

    Raises
    ------
    FileFormatError
        Missing or malformed file records, unsafe names, bad mode bits,
        undecodable side files, or headers that do not match the tensors
        that arrived.
    """
    raw = manifest.metadata.get(FILES_KEY)
    if raw is None:
        raise FileFormatError("the transfer carries no file layout (not sent by tensorxfer-send); nothing written")
    records = loads(raw, "the transfer's file layout", max_depth=2)
    if not isinstance(records, list) or not records:
        raise FileFormatError("file layout must be a non-empty list")
    plans, k, names = [], 0, set()
    for i, r in enumerate(records):
        if not isinstance(r, dict) or not _RECORD_KEYS <= set(r) <= _RECORD_KEYS | {"mode"} \
                or r["kind"] not in _KINDS or type(r["tensors"]) is not int \
                or type(r["chunks"]) is not int or not 0 < r["chunks"] <= len(manifest.metadata) \
                or ("mode" in r and (type(r["mode"]) is not int or not 0 <= r["mode"] <= 0o7777)):
            raise FileFormatError(f"file record {i} is malformed: {str(r)[:200]}")
        name = check_name(r["name"])
        if name in names:
            raise FileFormatError(f"file {name!r} appears twice in the layout")
        names.add(name)
        try:
            text = "".join(manifest.metadata[f"tensorxfer.file.{i}.{j}"] for j in range(r["chunks"]))
        except KeyError:
            raise FileFormatError(f"file {name!r}: a header chunk is missing") from None
        header, data = None, None
        count = r["tensors"]
        if r["kind"] == "safetensors":
            specs = manifest.tensors[k:k + count]
            if count < 0 or len(specs) != count:
                raise FileFormatError(f"file {name!r} claims {count} tensors beyond the manifest's {len(manifest)}")
            header = parse_header(text, sum(s.nbytes for s in specs), name)
            got = [(e.name, e.end - e.begin) for e in header.entries]
            if got != [(s.name, s.nbytes) for s in specs]:
                raise FileFormatError(f"file {name!r}: its header does not match the tensors that arrived")
        elif count != 0:
            raise FileFormatError(f"side file {name!r} cannot hold tensors")
        elif r["kind"] == "text":
            data = text.encode("utf-8", "surrogatepass")
        else:
            try:
                data = base64.b64decode(text.encode("ascii", "replace"), validate=True)
            except (binascii.Error, ValueError) as e:
                raise FileFormatError(f"side file {name!r} is not valid base64: {e}") from None
        # never setuid/setgid/sticky: only permission bits travel
        plans.append(FilePlan(name, r["kind"], text, header, k, r.get("mode", DEFAULT_MODE) & 0o777, data))
        k += count
    if k != len(manifest):
        raise FileFormatError(f"file layout covers {k} of {len(manifest)} tensors")
    return plans


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)      # no /proc: read it by setting it (briefly process-wide)
    os.umask(mask)
    return mask


def clean_leftovers(out_dir: str | os.PathLike[str]) -> tuple[list[Path], list[Path]]:
    """Remove the ``.tensorxfer-*.part`` files a killed writer left in ``out_dir``.

    Only regular files with that name are removed (never symlinks or
    directories).  ``.tensorxfer-*.bak`` files — what a file being replaced
    held, left only if a writer died in the middle of its renames or a
    rollback failed — are kept: they may be the only copy.  Returns
    ``(removed, kept backups)``; a missing directory has nothing to clean.
    """
    removed: list[Path] = []
    backups: list[Path] = []
    try:
        names = sorted(os.listdir(out_dir))
    except FileNotFoundError:
        return removed, backups
    for n in names:
        if not n.startswith(TEMP_PREFIX):
            continue
        p = Path(out_dir) / n
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISREG(os.lstat(p).st_mode):
                continue
            if n.endswith(".part"):
                os.unlink(p)
                removed.append(p)
            elif n.endswith(".bak"):
                backups.append(p)
    return removed, backups


def check_output_dir(out_dir: str | os.PathLike[str]) -> Path:
    """Create ``out_dir`` if needed and return it resolved.

    Raises
    ------
    OutputError
        It exists and is not a directory, or it cannot be created.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OutputError(f"output directory {out} exists and is not a directory; pick another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create output directory {out}: {e.strerror or e}") from None
    return out.resolve()


def _check_target(path: Path) -> bool:
    """Whether a file already exists at ``path`` (to be replaced); raise if nothing may be put there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{path} is a directory; nothing was written (move it away and send again)")
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        raise OutputError(f"{path} exists and is not a regular file; nothing was written")
    return True


def _fsync_dir(path: Path) -> None:
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def write_files(region: TensorRegion, out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write the files a region carries into ``out_dir``, all or nothing; return their paths.

    Every name and target is validated first (a directory or a special file
    at a target name refuses the whole set).  Every file is then written
    under a temporary name in ``out_dir``, given the sender's permission
    bits (masked by this process's umask; never setuid/setgid/sticky), and
    fsynced.  Only then are they renamed into place (a rename replaces a
    symlink at the target name, it never follows it); if a rename fails,
    the files already renamed are rolled back — a file they replaced is
    restored.  On any error nothing new is left in ``out_dir``.

    Raises
    ------
    FileFormatError
        The layout is malformed or names a file outside ``out_dir``.
    OutputError
        A target cannot be written (a directory is in the way, ``out_dir``
        is not a directory).
    OSError
        Writing failed (e.g. the disk is full).
    """
    plans = plan_files(region.manifest)
    real = check_output_dir(out_dir)
    targets = [real / fp.name for fp in plans]
    for t in targets:
        if t.parent != real:
            raise FileFormatError(f"{t}: would land outside {real}")
        _check_target(t)
    umask = _umask()
    temps: list[str] = []
    # per target being committed: (target, backup of what it replaces, whether undoing must restore the backup
    # — i.e. the target no longer holds the old file — or just drop the backup)
    undo: list[tuple[Path, str | None, bool]] = []
    try:
        with _Drain(region) as drain:
            for fp in plans:
                fd, tmp = tempfile.mkstemp(dir=real, prefix=TEMP_PREFIX, suffix=".part")
                temps.append(tmp)
                with os.fdopen(fd, "wb") as f:
                    os.fchmod(f.fileno(), fp.mode & ~umask)
                    if fp.header is None:
                        assert fp.data is not None
                        f.write(fp.data)
                    else:
                        head = fp.text.encode("utf-8")
                        f.write(_LEN.pack(len(head)))
                        f.write(head)
                        specs = region.manifest.tensors[fp.first_tensor:fp.first_tensor + len(fp.header.entries)]
                        pieces = drain.pieces([(s.offset, s.nbytes) for s in specs])
                        with contextlib.closing(pieces):     # a failed write releases the view at once
                            for piece in pieces:
                                f.write(piece)
                    f.flush()
                    os.fsync(f.fileno())
        for tmp, target in zip(temps, targets):
            backup = None
            if _check_target(target):
                backup = str(real / f"{TEMP_PREFIX}{secrets.token_hex(8)}.bak")
                try:
                    os.link(target, backup, follow_symlinks=False)   # the old file stays in place meanwhile
                    undo.append((target, backup, False))
                except OSError:
                    os.rename(target, backup)                       # no hard links here: move it aside
                    undo.append((target, backup, True))
            if backup is None:
                undo.append((target, None, False))
            os.replace(tmp, target)
            undo[-1] = (target, backup, True)                       # renamed: undoing restores the backup
        for _, backup, _ in undo:
            if backup is not None:
                os.unlink(backup)
        _fsync_dir(real)
    except BaseException as e:
        lost = _roll_back(undo)
        for tmp in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        with contextlib.suppress(OSError):
            _fsync_dir(real)
        if lost:
            raise OutputError(f"writing the files failed ({type(e).__name__}: {e}) and rolling back failed too: "
                              f"the previous contents are kept in {'; '.join(lost)}") from e
        raise
    return targets


def _roll_back(undo: list[tuple[Path, str | None, bool]]) -> list[str]:
    """Undo a partial commit, newest first; returns "target <- backup" for backups that could not be restored
    (they are kept, never deleted)."""
    lost = []
    for target, backup, restore in reversed(undo):
        try:
            if backup is None:
                if restore:
                    os.unlink(target)        # a new file where there was none
            elif restore:
                os.replace(backup, target)
            else:
                os.unlink(backup)            # the target still holds the old file
        except FileNotFoundError:
            pass
        except OSError:
            if backup is not None and restore:
                lost.append(f"{target} <- {backup}")
    return lost


class _Drain:
    """Reads region bytes in order, for writing files: zero-copy slices of a host region, pinned
    staging buffers (double-buffered device-to-host copies) for a GPU region — one
    :func:`tensorxfer.staging.read_pieces` loop either way, one stager for all the files."""

    def __init__(self, region: TensorRegion) -> None:
        self.region = region
        self._stager: Any = None

    def __enter__(self) -> _Drain:
        self._stager = open_stager(self.region, STAGE_BYTES)
        return self

    def __exit__(self, *exc: object) -> None:
        stager, self._stager = self._stager, None
        if stager is not None:
            stager.close()

    def pieces(self, spans: list[tuple[int, int]]) -> Generator[memoryview, None, None]:
        """Memoryviews of the bytes of ``(offset, n)`` spans, in order; each valid until the next."""
        for off, n in spans:
            with read_pieces(self.region, off, n, STAGE_BYTES, stager=self._stager) as pieces:
                for _, view in pieces:
                    yield view
