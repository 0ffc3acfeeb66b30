"""How files travel in a manifest's metadata, and the receiver's check of it (hostile input).

Metadata keys (all values are strings, so they fit the manifest format)::

    "tensorxfer.files"          JSON list: {"name", "kind", "tensors", "chunks", "mode"}
                                kind: "safetensors" | "text" (UTF-8 file) | "base64" (any other file)
    "tensorxfer.file.<i>.<j>"   chunk j of file i's header JSON (or the whole file for "text"/"base64")

Chunks stay under the manifest's 64 KiB per-string limit.  :func:`plan_files`
checks every record, name, mode, header and base64 payload against the
tensors that arrived, before anything is allocated or written.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from tensorxfer.files.format import FileFormatError, Header, check_name, loads, parse_header
from tensorxfer.manifest import Manifest

CHUNK_BYTES = 60_000                # UTF-8 bytes per metadata string, under the manifest's 64 KiB limit
FILES_KEY = "tensorxfer.files"
#: JSON list, per file of the layout, ``[size, mtime_ns]`` of the sender's source (null for a side file): how a
#: resumed receiver tells a source that changed between two runs (tensorxfer.files.resume).
SOURCES_KEY = "tensorxfer.sources"
DEFAULT_MODE = 0o644
_KINDS = ("safetensors", "text", "base64")
_RECORD_KEYS = frozenset(("name", "kind", "tensors", "chunks"))


def split_chunks(text: str) -> list[str]:
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



@dataclass(frozen=True)
class FilePlan:
    """One file to write: its name, how it travelled, and what it holds."""

    name: str
    kind: str
    text: str
    header: Header | None
    first_tensor: int
    mode: int = DEFAULT_MODE
    data: bytes | None = None      # the whole file, for "text" and "base64" files

    @property
    def size(self) -> int:
        """The bytes of the file as written: a safetensors file's length prefix, header and data, or a side
        file's contents."""
        if self.header is None:
            assert self.data is not None
            return len(self.data)
        return 8 + len(self.text.encode("utf-8")) + self.header.data_bytes


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

