"""The manifest: the layout of many tensors inside one region.

A manifest names every tensor with its dtype, shape, byte offset and size,
plus free-form string metadata and, optionally, one checksum per tensor.  It
travels as msgpack — never pickle — and :meth:`Manifest.unpack` treats its
input as hostile: size limits apply before anything is allocated, and every
field is validated.

Wire format: one msgpack map, stored by column so that a 100,000-tensor
manifest decodes into a handful of objects instead of half a million, and
validates with vectorized numpy instead of a Python loop::

    {"format": "tensorxfer.manifest", "version": 1,
     "alignment": int,            # power of two; every offset is a multiple
     "nbytes": int,               # end of the last tensor = bytes to allocate
     "names": [str, ...],         # one per tensor, unique
     "dtype_names": [str, ...],   # the dtypes used, safetensors spelling
     "dtypes": bin,               # uint8 per tensor: index into dtype_names
     "ndims": bin,                # uint8 per tensor
     "dims": bin,                 # uint64 little-endian, all shapes concatenated
     "offsets": bin,              # uint64 little-endian per tensor
     "sizes": bin,                # uint64 little-endian per tensor (bytes)
     "metadata": {str: str},
     "checksums": null | [algorithm, bin],   # uint64 little-endian per tensor
     "aliases": bin}              # optional: uint64 little-endian (alias, target) index pairs

``nbytes`` must equal the end of the last tensor, so a peer cannot make a
receiver allocate more memory than its tensors need.

**Aliases** (tied weights: GPT-2's ``lm_head.weight`` *is* its
``wte.weight``): a tensor stored once under several names.  Every name has
its own row in the columns; an alias row repeats its target's dtype, shape,
offset and size, and ``aliases`` lists ``(alias index, target index)``
pairs in increasing alias order.  A target must be a tensor that is not
itself an alias.  Alias rows are exempt from the overlap check (they *are*
their target's bytes) and count nothing towards ``nbytes``.  The key is
absent when there are no aliases, so such manifests are byte-identical to
those of earlier versions; a receiver that predates aliases refuses a
manifest that has them (an unexpected key), never misreads it.
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np

from tensorxfer.dtypes import DTYPES
from tensorxfer.errors import ManifestError, ProtocolError
from tensorxfer.protocol import scan_msgpack

FORMAT = "tensorxfer.manifest"
VERSION = 1
DEFAULT_ALIGNMENT = 256          # CUDA's allocation alignment; enough for any vector copy
MAX_ALIGNMENT = 1 << 30
MAX_NAME_BYTES = 1024
MAX_NDIM = 64
MAX_METADATA_ITEMS = 1024
MAX_METADATA_STR = 1 << 16
MAX_CHECKSUM_NAME = 32
REGION_MEMORY_FRACTION = 2              # a default receiver takes at most 1/2 of the memory its region lives in
DEFAULT_MAX_TENSORS = 1 << 20
DEFAULT_MAX_MANIFEST_BYTES = 256 << 20
_LIMIT_ORIGINS: dict[int, str] = {}    # limits default_max_region_bytes() computed -> where they came from


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _host_memory() -> tuple[int, str]:
    """Physical memory this process may use, and where that number comes from."""
    total, origin = 0, ""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total, origin = int(line.split()[1]) * 1024, "MemTotal in /proc/meminfo"
                    break
    except OSError:
        pass
    if not total:
        total, origin = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "sysconf(SC_PHYS_PAGES)"
    # A container's memory limit is what the kernel enforces, whatever MemTotal says.
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total, origin = int(text), f"the cgroup memory limit in {path}"
        break
    return total, origin


def _gpu_memory(index: int) -> tuple[int, str] | None:
    """Total memory of CUDA device ``index`` (``None`` where the driver cannot say)."""
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return None
        err, dev = driver.cuDeviceGet(index)
        if err != driver.CUresult.CUDA_SUCCESS:
            return None
        err, total = driver.cuDeviceTotalMem(dev)
        if err != driver.CUresult.CUDA_SUCCESS:
            return None
    except Exception:     # no cuda-bindings, no libcuda, no such device: the host rule applies
        return None
    return int(total), f"cuDeviceTotalMem of cuda:{index}"


def default_max_region_bytes(device: str = "cpu") -> int:
    """The largest region a receiver on ``device`` accepts unless told otherwise.

    Half of the memory the region would live in: for ``"cpu"`` the
    machine's physical memory (``MemTotal``, or the cgroup limit where it is
    lower); for ``"cuda"`` / ``"cuda:N"`` that GPU's total memory (the host
    rule where the driver cannot be asked).  Physical rather than available
    memory, so the limit does not change from one offer to the next; the
    point is that a manifest of a few bytes cannot make a receiver commit
    more memory than the machine has (the old default was 1 TiB).  A
    refusal names this limit and its origin (see :meth:`Manifest.unpack`).
    """
    kind, _, index = device.partition(":")
    found = None
    if kind == "cuda":
        found = _gpu_memory(int(index) if index.isdigit() else 0)
        what = f"{device}'s"
    if found is None:
        total, source = _host_memory()
        what = "this machine's"
        if kind == "cuda":
            source += f"; the memory of {device} could not be queried"
    else:
        total, source = found
    limit = max(total // REGION_MEMORY_FRACTION, 1)
    _LIMIT_ORIGINS.setdefault(limit, f"the default: half of {what} {_gib(total)} of memory ({source})")
    return limit


DEFAULT_MAX_REGION_BYTES = default_max_region_bytes("cpu")
"""The host default of ``max_region_bytes`` at import (:func:`default_max_region_bytes`)."""

_KEYS = frozenset(("format", "version", "alignment", "nbytes", "names", "dtype_names", "dtypes",
                   "ndims", "dims", "offsets", "sizes", "metadata", "checksums"))
_OPTIONAL_KEYS = frozenset(("aliases",))
_U64 = np.dtype("<u8")
_DTYPE_NAMES = tuple(DTYPES)
_ITEMSIZE_BY_NAME = {k: v.itemsize for k, v in DTYPES.items()}


class TensorSpec(NamedTuple):
    """One tensor's place in a region."""

    name: str
    dtype: str          # safetensors spelling: "BF16", "F32", ...
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


class Manifest:
    """An immutable, validated layout of named tensors in one region.

    Build one with :meth:`layout` (from names, dtypes and shapes), from
    :class:`TensorSpec` records, or with :meth:`unpack` (bytes from a peer).
    Every path goes through the same validation, so every Manifest object is
    consistent.  Columns (``offsets``, ``sizes``) are read-only numpy arrays;
    ``tensors`` gives the same data as :class:`TensorSpec` records.
    """

    __slots__ = ("_alias_pairs", "_by_name", "_dims", "_dtype_idx", "_dtype_names", "_ndims", "_specs",
                 "aliases", "alignment", "checksums", "metadata", "names", "nbytes", "offsets", "sizes")
    names: tuple[str, ...]
    nbytes: int
    alignment: int
    metadata: dict[str, str]
    checksums: tuple[str, tuple[int, ...]] | None
    offsets: np.ndarray          # uint64, read-only
    sizes: np.ndarray            # uint64, read-only
    _dtype_names: tuple[str, ...]
    _dtype_idx: np.ndarray
    _ndims: np.ndarray
    _dims: np.ndarray
    _by_name: dict[str, int]
    _specs: tuple[TensorSpec, ...] | None
    aliases: dict[str, str]      # alias name -> the name of the tensor whose bytes it shares
    _alias_pairs: np.ndarray     # uint64 (k, 2): (alias index, target index), sorted by alias index

    def __init__(
        self,
        tensors: Iterable[TensorSpec | Sequence[Any]],
        *,
        alignment: int = DEFAULT_ALIGNMENT,
        metadata: Mapping[str, str] | None = None,
        checksums: tuple[str, Sequence[int]] | None = None,
        max_region_bytes: int = 1 << 62,     # tensors this process holds: the receiver's limit applies on unpack
        max_tensors: int = DEFAULT_MAX_TENSORS,
        aliases: Mapping[str, str] | None = None,
    ) -> None:
        specs = [TensorSpec(*t) for t in tensors]
        try:
            used = sorted({s.dtype for s in specs}, key=lambda d: _DTYPE_NAMES.index(d) if d in DTYPES else 99)
            index = {d: i for i, d in enumerate(used)}
            obj = {
                "format": FORMAT, "version": VERSION, "alignment": alignment,
                "nbytes": max((s.offset + s.nbytes for s in specs), default=0),
                "names": [s.name for s in specs],
                "dtype_names": used,
                "dtypes": bytes(index[s.dtype] for s in specs),
                "ndims": bytes(len(s.shape) for s in specs),
                "dims": np.array([d for s in specs for d in s.shape], dtype=_U64).tobytes(),
                "offsets": np.array([s.offset for s in specs], dtype=_U64).tobytes(),
                "sizes": np.array([s.nbytes for s in specs], dtype=_U64).tobytes(),
                "metadata": dict(metadata or {}),
                "checksums": None if checksums is None else
                [checksums[0], np.array(checksums[1], dtype=_U64).tobytes()],
            }
            if aliases:
                position = {s.name: i for i, s in enumerate(specs)}
                missing = [n for pair in aliases.items() for n in pair if n not in position]
                if missing:
                    raise ManifestError(f"alias names a tensor that is not in the manifest: {missing[0]!r}")
                pairs = sorted((position[a], position[t]) for a, t in aliases.items())
                obj["aliases"] = np.array(pairs, dtype=_U64).tobytes()
        except (TypeError, ValueError, OverflowError) as e:
            if isinstance(e, ManifestError):
                raise
            raise ManifestError(f"invalid tensor records: {e}") from None
        _validate(obj, self, max_region_bytes, max_tensors)

    # ------------------------------------------------------------ construction
    @classmethod
    def layout(
        cls,
        entries: Iterable[tuple[str, str, Sequence[int]]],
        *,
        alignment: int = DEFAULT_ALIGNMENT,
        metadata: Mapping[str, str] | None = None,
        aliases: Mapping[str, str] | None = None,
    ) -> Manifest:
        """Place ``(name, dtype, shape)`` entries at aligned offsets, in order.

        ``aliases`` maps a name to the name of the tensor whose bytes it
        shares (tied weights): the alias takes no space of its own, it is
        placed at its target's offset (dtype and shape must be the target's).
        """
        aliases = dict(aliases or {})
        specs: list[TensorSpec] = []
        placed: dict[str, TensorSpec] = {}
        offset = 0
        rows = list(entries)
        for name, dtype, shape in rows:
            if dtype not in DTYPES:
                raise ManifestError(f"tensor {name!r}: unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
            if name in aliases:
                continue
            shape = tuple(int(d) for d in shape)
            nbytes = math.prod(shape) * DTYPES[dtype].itemsize
            placed[name] = TensorSpec(name, dtype, shape, offset, nbytes)
            offset = align_up(offset + nbytes, alignment)
        for name, dtype, shape in rows:
            if name in aliases:
                target = placed.get(aliases[name])
                if target is None:
                    raise ManifestError(f"tensor {name!r} is an alias of {aliases[name]!r}, which is not a "
                                        f"stored tensor of this layout")
                specs.append(TensorSpec(name, dtype, tuple(int(d) for d in shape), target.offset, target.nbytes))
            else:
                specs.append(placed[name])
        return cls(specs, alignment=alignment, metadata=metadata, aliases=aliases)

    def pack(self) -> bytes:
        """Serialize to msgpack bytes (the module docstring gives the format)."""
        obj: dict[str, Any] = {
            "format": FORMAT, "version": VERSION, "alignment": self.alignment, "nbytes": self.nbytes,
            "names": list(self.names), "dtype_names": list(self._dtype_names),
            "dtypes": self._dtype_idx.tobytes(), "ndims": self._ndims.tobytes(),
            "dims": self._dims.tobytes(), "offsets": self.offsets.tobytes(), "sizes": self.sizes.tobytes(),
            "metadata": dict(self.metadata),
            "checksums": None if self.checksums is None else
            [self.checksums[0], np.asarray(self.checksums[1], dtype=_U64).tobytes()],
        }
        if len(self._alias_pairs):
            obj["aliases"] = self._alias_pairs.tobytes()      # absent otherwise: readable by older versions
        return msgpack.packb(obj, use_bin_type=True)

    @classmethod
    def unpack(
        cls,
        data: bytes | bytearray | memoryview,
        *,
        max_region_bytes: int = DEFAULT_MAX_REGION_BYTES,
        max_tensors: int = DEFAULT_MAX_TENSORS,
        max_manifest_bytes: int = DEFAULT_MAX_MANIFEST_BYTES,
    ) -> Manifest:
        """Parse and validate a packed manifest from an untrusted peer.

        Checks, in order: the input size; msgpack's per-object limits (no
        header can make the decoder allocate more than the input could
        hold); the exact key set, format name and version; unique, non-empty
        UTF-8 names of at most 1024 bytes without NUL; known dtypes; column
        lengths that agree; ``prod(shape) * itemsize == size`` per tensor;
        offsets that are aligned, in bounds and non-overlapping; ``nbytes``
        equal to the end of the last tensor and at most ``max_region_bytes``;
        the shapes of metadata and checksums.

        Raises
        ------
        ManifestError
            For any violation, saying which; never another exception.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ManifestError(f"manifest must be bytes, got {type(data).__name__}")
        size = len(data)
        if size > max_manifest_bytes:
            raise ManifestError(f"manifest is {size} bytes, over the limit of {max_manifest_bytes}; "
                                f"raise max_manifest_bytes if this is expected")
        # Every msgpack element takes at least one byte, so no honest header
        # declares more elements than the input has bytes: bounding the
        # limits by `size` keeps a lying header from allocating memory.
        lim = max(size, 1)
        # Per-container limits do not bound the number of containers: 4 MiB of nested empty maps
        # decoded into 4 million dicts (~300 MiB).  A manifest is one map of a few fixed keys, the
        # names (one str each), the metadata (<= 1024 pairs) and a 2-item checksums list, at most
        # 3 levels deep: walk the headers first and refuse anything bigger or deeper.
        try:
            scan_msgpack(data, max_tensors + 2 * MAX_METADATA_ITEMS + 64, 3, what="manifest")
        except ProtocolError as e:
            raise ManifestError(str(e)) from None
        gc_was_enabled = gc.isenabled()
        gc.disable()     # msgpack's advice for large inputs: no GC passes over half-built lists
        try:
            obj = msgpack.unpackb(
                data, raw=False, strict_map_key=True, use_list=True,
                max_str_len=min(lim, MAX_METADATA_STR), max_bin_len=lim, max_ext_len=0,
                max_array_len=min(lim, max(max_tensors, len(DTYPES) + 1)), max_map_len=min(lim, MAX_METADATA_ITEMS),
            )
        except Exception as e:   # msgpack raises many types for bad input; all mean the same here
            raise ManifestError(f"manifest is not valid msgpack: {type(e).__name__}: {e}") from None
        finally:
            if gc_was_enabled:
                gc.enable()
        self = cls.__new__(cls)
        _validate(obj, self, max_region_bytes, max_tensors)
        return self

    # ------------------------------------------------------------ queries
    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        """Every tensor as a :class:`TensorSpec`, in manifest order (built once, on first use)."""
        if self._specs is None:
            dims = self._dims.tolist()
            starts = np.concatenate(([0], np.cumsum(self._ndims, dtype=np.int64))).tolist()
            dt = [self._dtype_names[i] for i in self._dtype_idx.tolist()]
            self._specs = tuple(
                TensorSpec(n, d, tuple(dims[a:b]), o, s)
                for n, d, a, b, o, s in zip(self.names, dt, starts, starts[1:],
                                            self.offsets.tolist(), self.sizes.tolist())
            )
        return self._specs

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[TensorSpec]:
        return iter(self.tensors)

    def __getitem__(self, name: str) -> TensorSpec:
        try:
            return self.tensors[self._by_name[name]]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in this manifest") from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def index(self, name: str) -> int:
        return self._by_name[name]

    def same_layout(self, other: Manifest) -> bool:
        """True if ``other`` places the same tensors, dtypes and shapes at the same offsets (and aliases)."""
        if other is self:
            return True     # a warm update offers the very manifest object it offered last time
        return self.nbytes == other.nbytes and self.tensors == other.tensors and self.aliases == other.aliases

    def with_checksums(self, algorithm: str, values: Sequence[int]) -> Manifest:
        """A copy carrying one checksum per tensor (aliases included), in manifest order."""
        return Manifest(self.tensors, alignment=self.alignment, metadata=self.metadata,
                        checksums=(algorithm, list(values)), aliases=self.aliases)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Manifest) and self.same_layout(other) and self.alignment == other.alignment
                and self.metadata == other.metadata and self.checksums == other.checksums)

    def __hash__(self) -> int:
        return hash((self.nbytes, len(self.names)))

    def __repr__(self) -> str:
        return f"<Manifest {len(self.names)} tensors, {self.nbytes} bytes, alignment {self.alignment}>"


def _u64_column(obj: dict, key: str, count: int) -> np.ndarray:
    raw = obj[key]
    if not isinstance(raw, bytes) or len(raw) != 8 * count:
        raise ManifestError(f"{key} must be {count} little-endian uint64 values ({8 * count} bytes)")
    return np.frombuffer(raw, dtype=_U64)


def _u8_column(obj: dict, key: str, count: int) -> np.ndarray:
    raw = obj[key]
    if not isinstance(raw, bytes) or len(raw) != count:
        raise ManifestError(f"{key} must be {count} bytes, one per tensor")
    return np.frombuffer(raw, dtype=np.uint8)


def _validate_aliases(raw: Any, names: list[str], dtype_idx: np.ndarray, ndims: np.ndarray,
                      padded: np.ndarray | None, offsets: np.ndarray,
                      sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Check the optional alias column; return the (alias, target) pairs and an is-alias mask."""
    n = len(names)
    is_alias = np.zeros(n, dtype=bool)
    if raw is None:
        return np.zeros((0, 2), dtype=_U64), is_alias
    if not isinstance(raw, bytes) or len(raw) % 16 or not 0 < len(raw) // 16 < max(n, 1):
        raise ManifestError(f"aliases must be 1 to {max(n - 1, 0)} pairs of little-endian uint64 "
                            f"(alias index, target index), 16 bytes each")
    pairs = np.frombuffer(raw, dtype=_U64).reshape(-1, 2)
    alias, target = pairs[:, 0], pairs[:, 1]
    if int(pairs.max()) >= n:
        raise ManifestError(f"an alias pair names tensor index {int(pairs.max())}; there are {n} tensors")
    if len(alias) > 1 and not bool(np.all(alias[1:] > alias[:-1])):
        raise ManifestError("alias indices must be strictly increasing (each tensor is an alias at most once)")
    a, t = alias.astype(np.intp), target.astype(np.intp)
    is_alias[a] = True
    if is_alias[t].any():
        i = int(np.flatnonzero(is_alias[t])[0])
        raise ManifestError(f"tensor {names[a[i]]!r} is an alias of {names[t[i]]!r}, which is itself an alias "
                            f"(or the same tensor); an alias must point to a stored tensor")
    assert padded is not None      # n > 0 here
    differs = ((dtype_idx[a] != dtype_idx[t]) | (ndims[a] != ndims[t]) | (padded[a] != padded[t]).any(axis=1)
               | (offsets[a] != offsets[t]) | (sizes[a] != sizes[t]))
    if differs.any():
        i = int(np.flatnonzero(differs)[0])
        raise ManifestError(f"tensor {names[a[i]]!r} is an alias of {names[t[i]]!r} but its dtype, shape, offset "
                            f"or size differs; an alias repeats its target's exactly")
    pairs.flags.writeable = False
    return pairs, is_alias


def _validate(obj: Any, out: Manifest, max_region_bytes: int, max_tensors: int) -> None:
    """Validate a decoded manifest and fill ``out``; ManifestError on any violation."""
    fail = ManifestError
    if not isinstance(obj, dict):
        raise fail(f"manifest must be a map, got {type(obj).__name__}")
    if not _KEYS <= obj.keys() <= _KEYS | _OPTIONAL_KEYS:
        missing, extra = _KEYS - obj.keys(), obj.keys() - _KEYS - _OPTIONAL_KEYS
        raise fail(f"manifest keys wrong: missing {sorted(missing)}, unexpected {sorted(map(repr, extra))}")
    if obj["format"] != FORMAT:
        raise fail(f"not a tensorxfer manifest (format {obj['format']!r:.80})")
    version = obj["version"]
    if type(version) is not int or version != VERSION:
        raise fail(f"manifest version {version!r:.40} is not supported (this tensorxfer speaks {VERSION})")
    alignment = obj["alignment"]
    if type(alignment) is not int or not 0 < alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
        raise fail(f"alignment must be a power of two up to {MAX_ALIGNMENT}, got {alignment!r:.40}")
    nbytes = obj["nbytes"]
    if type(nbytes) is not int or nbytes < 0:
        raise fail(f"nbytes must be a non-negative integer, got {nbytes!r:.40}")
    if nbytes > max_region_bytes:
        origin = _LIMIT_ORIGINS.get(max_region_bytes, "set with max_region_bytes / --max-bytes")
        raise fail(f"manifest needs {nbytes} bytes ({_gib(nbytes)}), over this receiver's limit of "
                   f"{max_region_bytes} bytes ({_gib(max_region_bytes)}; {origin}); to accept it, raise the "
                   f"limit on the receiver: Receiver(max_region_bytes=N) or tensorxfer-recv --max-bytes N")

    # ---- names
    names = obj["names"]
    if not isinstance(names, list):
        raise fail("names must be a list of strings")
    n = len(names)
    if n > max_tensors:
        raise fail(f"{n} tensors, over the limit of {max_tensors} (max_tensors)")
    if not all(type(x) is str for x in names):
        raise fail("every tensor name must be a string")
    if n and min(map(len, names)) == 0:
        raise fail("tensor names must not be empty")
    if n and max(map(len, names)) * 4 > MAX_NAME_BYTES:      # only then can UTF-8 exceed the limit
        long = [x for x in names if len(x.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES]
        if long:
            raise fail(f"tensor name {long[0][:60]!r}... is longer than {MAX_NAME_BYTES} bytes")
    if "\x00" in "".join(names):
        raise fail("a tensor name contains a NUL character")
    by_name = {x: i for i, x in enumerate(names)}
    if len(by_name) != n:
        seen: set[str] = set()
        dup = next(x for x in names if x in seen or seen.add(x))  # type: ignore[func-returns-value]
        raise fail(f"tensor name {dup!r} appears twice")

    # ---- dtypes
    dtype_names = obj["dtype_names"]
    if (not isinstance(dtype_names, list) or len(dtype_names) > len(DTYPES)
            or not all(isinstance(d, str) and d in DTYPES for d in dtype_names)
            or len(set(dtype_names)) != len(dtype_names)):
        raise fail(f"dtype_names must list distinct known dtypes ({', '.join(DTYPES)}), "
                   f"got {dtype_names!r:.200}")
    dtype_idx = _u8_column(obj, "dtypes", n)
    if n and int(dtype_idx.max()) >= len(dtype_names):
        raise fail("a tensor's dtype index is outside dtype_names")
    itemsizes = np.array([_ITEMSIZE_BY_NAME[d] for d in dtype_names] or [1], dtype=np.uint64)[dtype_idx]

    # ---- shapes, sizes, offsets
    ndims = _u8_column(obj, "ndims", n)
    if n and int(ndims.max()) > MAX_NDIM:
        raise fail(f"a tensor has more than {MAX_NDIM} dimensions")
    total_dims = int(ndims.sum(dtype=np.int64))
    dims = _u64_column(obj, "dims", total_dims)
    offsets = _u64_column(obj, "offsets", n)
    sizes = _u64_column(obj, "sizes", n)
    if n:
        # Element counts: pad each shape to the widest with ones, then multiply
        # exactly in uint64 and approximately in float64; a float product
        # beyond 2**62 cannot be a valid size (it exceeds any region limit)
        # and would make the exact product wrap.
        width = int(ndims.max())
        padded = np.ones((n, max(width, 1)), dtype=np.uint64)
        if total_dims:
            rows = np.repeat(np.arange(n), ndims)
            starts = np.repeat(np.cumsum(ndims, dtype=np.int64) - ndims, ndims)
            padded[rows, np.arange(total_dims) - starts] = dims
        # numpy and torch compute a shape's extent in int64 *ignoring zero dims* (numpy refuses
        # (0, 2**63) with "array is too big"), so a zero-sized tensor with a huge other dim is as
        # unrepresentable as a huge one: bound the product with zeros counted as ones.
        approx = np.prod(np.maximum(padded, 1).astype(np.float64), axis=1) * itemsizes
        if approx.max() >= 2.0**62:
            bad = int(np.argmax(approx >= 2.0**62))
            a, b = int(np.cumsum(ndims)[bad] - ndims[bad]), int(np.cumsum(ndims)[bad])
            raise fail(f"tensor {names[bad]!r}: shape {tuple(dims[a:b].tolist())} is impossibly large: its "
                       f"non-zero dimensions times the item size must stay below 2**62 (numpy and torch "
                       f"index in int64, zero dimensions or not)")
        exact = np.prod(padded, axis=1, dtype=np.uint64) * itemsizes
        wrong = np.flatnonzero(exact != sizes)
        if wrong.size:
            i = int(wrong[0])
            raise fail(f"tensor {names[i]!r}: size {int(sizes[i])} != prod(shape) * itemsize = {int(exact[i])}")
        misaligned = np.flatnonzero(offsets % np.uint64(alignment))
        if misaligned.size:
            i = int(misaligned[0])
            raise fail(f"tensor {names[i]!r}: offset {int(offsets[i])} is not a multiple of the alignment "
                       f"{alignment}")
        if offsets.max() >= np.uint64(1 << 62):
            i = int(np.argmax(offsets))
            raise fail(f"tensor {names[i]!r}: offset {int(offsets[i])} is impossibly large")
        ends = offsets + sizes
        end = int(ends.max())
    else:
        end = 0
    if end != nbytes:
        raise fail(f"nbytes is {nbytes} but the tensors end at {end}; they must agree")
    pairs, is_alias = _validate_aliases(obj.get("aliases"), names, dtype_idx, ndims, padded if n else None,
                                        offsets, sizes)
    nonempty = np.flatnonzero(sizes * ~is_alias)      # an alias row *is* its target's bytes: no overlap check
    if nonempty.size > 1:
        order = nonempty[np.argsort(offsets[nonempty], kind="stable")]
        clash = np.flatnonzero(offsets[order][1:] < (offsets + sizes)[order][:-1])
        if clash.size:
            a, b = int(order[clash[0]]), int(order[clash[0] + 1])
            raise fail(f"tensors {names[a]!r} and {names[b]!r} overlap at offset {int(offsets[b])}")

    # ---- metadata, checksums
    metadata = obj["metadata"]
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_ITEMS:
        raise fail(f"metadata must be a map of at most {MAX_METADATA_ITEMS} items")
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise fail(f"metadata must map strings to strings (key {k!r:.60})")
    checksums = obj["checksums"]
    if checksums is not None:
        if (not isinstance(checksums, list) or len(checksums) != 2 or not isinstance(checksums[0], str)
                or not 0 < len(checksums[0]) <= MAX_CHECKSUM_NAME):
            raise fail("checksums must be null or [algorithm, uint64 column]")
        checksums = (checksums[0], tuple(_u64_column({"checksums": checksums[1]}, "checksums", n).tolist()))

    out.names = tuple(names)
    out.nbytes = nbytes
    out.alignment = alignment
    out.metadata = dict(metadata)
    out.checksums = checksums
    out.offsets = offsets
    out.sizes = sizes
    out._dtype_names = tuple(dtype_names)
    out._dtype_idx = dtype_idx
    out._ndims = ndims
    out._dims = dims
    out._by_name = by_name
    out._specs = None
    out._alias_pairs = pairs
    out.aliases = {names[a]: names[t] for a, t in pairs.tolist()}
