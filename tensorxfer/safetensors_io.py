"""safetensors files in, the same files out — byte-identical — through one region.

A safetensors file is an 8-byte little-endian header length ``N``, ``N``
bytes of JSON (``{name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {str: str}}``), then the data bytes.  :func:`read_header`
treats all of it as hostile input: the length is bounded by the file size
and a 100 MB cap, the JSON must be UTF-8 with no duplicate keys, every entry
has exactly the expected fields with sane types, sizes agree with dtypes and
shapes, and the data offsets tile the data section exactly (no holes, no
overlaps, no trailing bytes — the format forbids them).

:func:`load_files` packs every tensor of every file into one region (one
transfer) and records, in the manifest metadata, which tensors belong to
which file and each file's original header text, so :func:`write_files`
can write back the exact bytes: the header verbatim, then the tensors in
data-offset order.  Names are validated so nothing can be written outside
the output directory, and output is atomic: temporary files in the target
directory, fsync, and renames only once every file is complete.

Metadata keys (all values are strings, so they fit the manifest format)::

    "tensorxfer.files"          JSON list: {"name", "kind": "safetensors"|"text", "tensors", "chunks"}
    "tensorxfer.file.<i>.<j>"   chunk j of file i's header JSON (or whole text for "text" files)

Files are chunked to stay under the manifest's 64 KiB per-string limit.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensorxfer.dtypes import DTYPES
from tensorxfer.errors import TensorXferError
from tensorxfer.manifest import Manifest
from tensorxfer.region import TensorRegion

MAX_HEADER_BYTES = 100_000_000     # the safetensors library's own cap
MAX_TEXT_FILE_BYTES = 16 << 20      # an index.json of a million tensors
CHUNK_CHARS = 16_000                # x 4 bytes per UTF-8 char < the manifest's 64 KiB string limit
FILES_KEY = "tensorxfer.files"
INDEX_NAME = "model.safetensors.index.json"
_DTYPE_NAME = re.compile(r"[A-Z][A-Z0-9_]{0,31}")
_LEN = struct.Struct("<Q")


class FileFormatError(TensorXferError, ValueError):
    """A safetensors file (or a received file layout) is malformed or unsafe."""


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


def parse_header(text: str, data_bytes: int, where: str) -> Header:
    """Validate header JSON text against a data section of ``data_bytes``.

    Raises
    ------
    FileFormatError
        Anything malformed, inconsistent or out of bounds (the message names ``where``).
    """
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as e:
        raise FileFormatError(f"{where}: header is not valid JSON: {e}") from None
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
    """A file name safe to create inside an output directory.

    Only plain names: no directories, no ``.``/``..``, no NUL, no
    backslashes, at most 255 bytes.

    Raises
    ------
    FileFormatError
        The name could escape (or is not a usable file name).
    """
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\0" in name or len(name.encode("utf-8", "surrogatepass")) > 255 or name != name.strip():
        raise FileFormatError(f"refusing unsafe file name {name!r}: only plain names inside the output "
                              f"directory are allowed")
    return name


def discover(sources: Sequence[str | os.PathLike[str]]) -> list[tuple[str, Path]]:
    """``(output name, path)`` for every file to send: files as given, directories expanded.

    A directory with ``model.safetensors.index.json`` sends the files its
    ``weight_map`` names plus the index itself; otherwise every
    ``*.safetensors`` in it, sorted.

    Raises
    ------
    FileFormatError
        No files, duplicate output names, or an index naming unsafe files.
    FileNotFoundError
        A source does not exist.
    """
    out: list[tuple[str, Path]] = []
    for src in sources:
        p = Path(src)
        if p.is_dir():
            index = p / INDEX_NAME
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text("utf-8"))["weight_map"]
                    names = sorted({check_name(v) for v in weight_map.values()})
                except (ValueError, KeyError, TypeError, AttributeError) as e:
                    raise FileFormatError(f"{index}: not a usable index ({type(e).__name__}: {e})") from None
                out += [(n, p / n) for n in names] + [(INDEX_NAME, index)]
            else:
                found = sorted(q for q in p.iterdir() if q.suffix == ".safetensors" and q.is_file())
                if not found:
                    raise FileFormatError(f"{p}: no *.safetensors files in this directory")
                out += [(q.name, q) for q in found]
        elif p.is_file():
            out.append((p.name, p))
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")
    names = [n for n, _ in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise FileFormatError(f"several sources would be written as {sorted(dup)}; send them separately")
    if not out:
        raise FileFormatError("nothing to send")
    return out


def _chunks(text: str) -> list[str]:
    return [text[i:i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS)] or [""]


def load_files(sources: Sequence[str | os.PathLike[str]], device: str = "cpu") -> TensorRegion:
    """Read safetensors files (and an index) into one new region.

    Raises
    ------
    FileFormatError
        A file is malformed, or two files hold a tensor of the same name.
    OSError
        A file cannot be read.
    """
    files = discover(sources)
    layout: list[tuple[str, str, tuple[int, ...]]] = []
    meta: dict[str, str] = {}
    records: list[dict[str, Any]] = []
    plan: list[tuple[Path, int, Header | None]] = []
    seen: dict[str, str] = {}
    for i, (name, path) in enumerate(files):
        entries: tuple[Entry, ...]
        if path.suffix == ".json":
            if path.stat().st_size > MAX_TEXT_FILE_BYTES:
                raise FileFormatError(f"{path}: over {MAX_TEXT_FILE_BYTES} bytes")
            try:
                text = path.read_bytes().decode("utf-8")
            except UnicodeDecodeError as e:
                raise FileFormatError(f"{path}: not UTF-8 text: {e}") from None
            kind, entries = "text", ()
            plan.append((path, 0, None))
        else:
            parsed, data_at = read_header(path)
            text, kind, entries = parsed.text, "safetensors", parsed.entries
            plan.append((path, data_at, parsed))
        for ent in entries:
            if ent.name in seen:
                raise FileFormatError(f"tensor {ent.name!r} is in both {seen[ent.name]} and {name}; "
                                      f"send them separately")
            seen[ent.name] = name
            # Dtypes the manifest does not know travel as raw bytes; the header written back keeps the real one.
            layout.append((ent.name, ent.dtype, ent.shape) if ent.dtype in DTYPES
                          else (ent.name, "U8", (ent.end - ent.begin,)))
        chunks = _chunks(text)
        records.append({"name": name, "kind": kind, "tensors": len(entries), "chunks": len(chunks)})
        meta.update({f"tensorxfer.file.{i}.{j}": c for j, c in enumerate(chunks)})
    meta[FILES_KEY] = json.dumps(records)
    manifest = Manifest.layout(layout, metadata=meta)
    region = TensorRegion.from_manifest(manifest, device=device)
    try:
        with memoryview(region.region).cast("B") as view:
            k = 0
            for path, data_at, header in plan:
                if header is None:
                    continue
                with open(path, "rb") as f:
                    for entry in header.entries:
                        spec = manifest.tensors[k]
                        k += 1
                        f.seek(data_at + entry.begin)
                        with view[spec.offset:spec.offset + spec.nbytes] as dst:
                            _read_exact(f, dst, path)
    except BaseException:
        region.close(defer=True)
        raise
    return region


def _read_exact(f: Any, dst: memoryview, path: Path) -> None:
    got = 0
    while got < len(dst):
        with dst[got:] as rest:
            n = f.readinto(rest)
        if not n:
            raise FileFormatError(f"{path}: file shrank while being read")
        got += n


@dataclass(frozen=True)
class FilePlan:
    name: str
    kind: str
    text: str
    header: Header | None
    first_tensor: int


def plan_files(manifest: Manifest) -> list[FilePlan]:
    """Validate a received manifest's file layout against its tensors (hostile input).

    Raises
    ------
    FileFormatError
        Missing or malformed file records, unsafe names, or headers that do
        not match the tensors that arrived.
    """
    raw = manifest.metadata.get(FILES_KEY)
    if raw is None:
        raise FileFormatError("the transfer carries no file layout (not sent by tensorxfer-send); nothing written")
    try:
        records = json.loads(raw)
    except ValueError as e:
        raise FileFormatError(f"file layout is not JSON: {e}") from None
    if not isinstance(records, list) or not records:
        raise FileFormatError("file layout must be a non-empty list")
    plans, k, names = [], 0, set()
    for i, r in enumerate(records):
        if not isinstance(r, dict) or set(r) != {"name", "kind", "tensors", "chunks"} \
                or r["kind"] not in ("safetensors", "text") or type(r["tensors"]) is not int \
                or type(r["chunks"]) is not int or not 0 < r["chunks"] <= len(manifest.metadata):
            raise FileFormatError(f"file record {i} is malformed: {str(r)[:200]}")
        name = check_name(r["name"])
        if name in names:
            raise FileFormatError(f"file {name!r} appears twice in the layout")
        names.add(name)
        try:
            text = "".join(manifest.metadata[f"tensorxfer.file.{i}.{j}"] for j in range(r["chunks"]))
        except KeyError:
            raise FileFormatError(f"file {name!r}: a header chunk is missing") from None
        header = None
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
            raise FileFormatError(f"text file {name!r} cannot hold tensors")
        plans.append(FilePlan(name, r["kind"], text, header, k))
        k += count
    if k != len(manifest):
        raise FileFormatError(f"file layout covers {k} of {len(manifest)} tensors")
    return plans


def write_files(region: TensorRegion, out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write the files a region carries into ``out_dir``, atomically; return their paths.

    Every file is first written under a temporary name in ``out_dir`` and
    fsynced; only when all are complete are they renamed into place (a
    rename replaces a symlink at the target name, it never follows it).  On
    any error the temporary files are removed and nothing is renamed.

    Raises
    ------
    FileFormatError
        The layout is malformed or names a file outside ``out_dir``.
    OSError
        Writing failed (e.g. the disk is full).
    """
    plans = plan_files(region.manifest)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    real = out.resolve()
    temps: list[tuple[str, Path]] = []
    try:
        with memoryview(region.region).cast("B") as view:
            for fp in plans:
                fd, tmp = tempfile.mkstemp(dir=real, prefix=".tensorxfer-", suffix=".part")
                temps.append((tmp, real / fp.name))
                with os.fdopen(fd, "wb") as f:
                    if fp.header is None:
                        f.write(fp.text.encode("utf-8"))
                    else:
                        head = fp.text.encode("utf-8")
                        f.write(_LEN.pack(len(head)))
                        f.write(head)
                        for spec in region.manifest.tensors[fp.first_tensor:fp.first_tensor + len(fp.header.entries)]:
                            with view[spec.offset:spec.offset + spec.nbytes] as piece:
                                f.write(piece)
                    f.flush()
                    os.fsync(f.fileno())
        for _, final in temps:
            if final.parent.resolve() != real:
                raise FileFormatError(f"{final}: would land outside {real}")
        for tmp, final in temps:
            os.replace(tmp, final)
        dfd = os.open(real, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        for tmp, _ in temps:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass   # already renamed into place or never created
        raise
    return [final for _, final in temps]


