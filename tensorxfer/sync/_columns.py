"""One rank's shard description as columns of numpy arrays: what the planner reads and the wire carries.

A model has tens of thousands of tensors and a cluster hundreds of ranks;
the planner must not walk Python objects for every one of them on every
rank.  Each :class:`~tensorxfer.sync.spec.RankSpec` keeps its tensors here
once, in canonical order (tensors by name, pieces by tensor then position),
as int64 arrays left-padded to the rank's widest tensor (offset 0, size 1 in
the padding), and checks in one vectorized pass what concerns that rank
alone: unique names, known dtypes, boxes inside shapes, regions that do not
overlap, pieces that tile their target tensor.  The wire form
(:func:`encode`) is the same columns, each array as little-endian bytes of
the narrowest width that holds it, so decoding ~10k tensors is a few
``np.frombuffer`` calls; it holds no rank, so the replicas of one TP rank
publish identical bytes, decoded once.  Decoded arrays are read-only and
may be shared between ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import numpy as np

from tensorxfer.dtypes import DTYPES
from tensorxfer.errors import PlanError
from tensorxfer.sync._boxes import I64, MAX_DIM, format_box, numel, overlap_pairs, row_any, segment_starts

DTYPE_NAMES: tuple[str, ...] = tuple(DTYPES)
ITEMSIZE = np.array([DTYPES[name].itemsize for name in DTYPE_NAMES], dtype=I64)
MAX_NDIM = 8
MAX_NAME = 1024
MAX_ROWS = 1 << 24
MAX_OFFSET = 1 << 62
WIRE_VERSION = 1


@dataclass(frozen=True, eq=False)
class SourceColumns:
    """A source rank's tensors: name, dtype code, global shape, held box, region offset."""

    names: tuple[str, ...]
    dtype: np.ndarray
    ndim: np.ndarray
    shape: np.ndarray
    box_off: np.ndarray
    box_size: np.ndarray
    region_offset: np.ndarray


@dataclass(frozen=True, eq=False)
class TargetColumns:
    """A target rank's tensors and their pieces (``piece_tensor`` indexes the tensors)."""

    names: tuple[str, ...]
    dtype: np.ndarray
    ndim: np.ndarray
    shape: np.ndarray
    region_offset: np.ndarray
    piece_tensor: np.ndarray
    piece_source: tuple[str, ...]
    piece_ndim: np.ndarray
    piece_off: np.ndarray
    piece_size: np.ndarray
    piece_at: np.ndarray


Columns = SourceColumns | TargetColumns


def _padded(rows: list[tuple[int, ...]], width: int, fill: int) -> np.ndarray:
    out = np.full((len(rows), width), fill, dtype=I64)
    for i, row in enumerate(rows):
        if row:
            out[i, width - len(row):] = row
    return out


def source_columns(
    rows: list[tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...], int]], rank: int
) -> SourceColumns:
    """Columns from (name, dtype, global_shape, box_offsets, box_sizes, region_offset) rows, checked."""
    rows = sorted(rows, key=lambda r: r[0])
    width = max((len(r[2]) for r in rows), default=0)
    cols = SourceColumns(
        names=tuple(r[0] for r in rows),
        dtype=np.array([DTYPE_NAMES.index(r[1]) for r in rows], dtype=np.uint8),
        ndim=np.array([len(r[2]) for r in rows], dtype=I64),
        shape=_padded([r[2] for r in rows], width, 1),
        box_off=_padded([r[3] for r in rows], width, 0),
        box_size=_padded([r[4] for r in rows], width, 1),
        region_offset=np.array([r[5] for r in rows], dtype=I64),
    )
    check_source(cols, rank)
    return freeze(cols)


PieceRow = tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def target_columns(rows: list[tuple[str, str, tuple[int, ...], int, list[PieceRow]]], rank: int) -> TargetColumns:
    """Columns from (name, dtype, local_shape, region_offset, [(source, off, size, at), ...]) rows, checked."""
    rows = sorted(rows, key=lambda r: r[0])
    width = max([len(r[2]) for r in rows] + [len(p[1]) for r in rows for p in r[4]], default=0)
    pieces = [(i, p) for i, r in enumerate(rows) for p in sorted(r[4], key=lambda p: (p[3], p[1]))]
    cols = TargetColumns(
        names=tuple(r[0] for r in rows),
        dtype=np.array([DTYPE_NAMES.index(r[1]) for r in rows], dtype=np.uint8),
        ndim=np.array([len(r[2]) for r in rows], dtype=I64),
        shape=_padded([r[2] for r in rows], width, 1),
        region_offset=np.array([r[3] for r in rows], dtype=I64),
        piece_tensor=np.array([i for i, _ in pieces], dtype=I64),
        piece_source=tuple(p[0] for _, p in pieces),
        piece_ndim=np.array([len(p[1]) for _, p in pieces], dtype=I64),
        piece_off=_padded([p[1] for _, p in pieces], width, 0),
        piece_size=_padded([p[2] for _, p in pieces], width, 1),
        piece_at=_padded([p[3] for _, p in pieces], width, 0),
    )
    check_target(cols, rank)
    return freeze(cols)


def _fail(message: str) -> None:
    raise PlanError(message)


def _check_strings(names: tuple[str, ...], what: str) -> None:
    # map/set/min/max run in C: this is called for every name of every rank
    if names and (set(map(type, names)) != {str} or min(map(len, names)) < 1 or max(map(len, names)) > MAX_NAME):
        bad = next(n for n in names if not isinstance(n, str) or not 0 < len(n) <= MAX_NAME)
        _fail(f"{what} must be non-empty strings of at most {MAX_NAME} characters, got {bad!r}")


def _check_names(names: tuple[str, ...], what: str) -> None:
    if len(set(names)) != len(names):   # in C (and the hashes it computes are kept for the planner's dicts)
        seen: set[str] = set()
        twice = next(n for n in names if n in seen or seen.add(n))  # type: ignore[func-returns-value]
        _fail(f"{what} holds tensor {twice!r} twice; every tensor name must appear once per rank")


def _check_padding(ndim: np.ndarray, arrays: list[tuple[np.ndarray, int, str]], what: str) -> None:
    """Dimensions left of a row's ndim must hold the padding value (wire input is not trusted)."""
    if not arrays:
        return
    width = arrays[0][0].shape[1]
    pad = np.arange(width)[None, :] < (width - ndim)[:, None]
    for array, fill, field in arrays:
        bad = np.flatnonzero(row_any(pad & (array != fill)))
        if len(bad):
            _fail(f"{what}: row {int(bad[0])} of {field} has values in its padding dimensions")


def _check_common(names: tuple[str, ...], dtype: np.ndarray, ndim: np.ndarray, shape: np.ndarray, what: str) -> None:
    n = len(names)
    if n > MAX_ROWS:
        _fail(f"{what} describes {n} tensors, more than the limit of {MAX_ROWS}")
    _check_strings(names, f"{what}: tensor names")
    if len(dtype) != n or len(ndim) != n or shape.shape[0] != n:
        _fail(f"{what}: column lengths disagree")
    if np.any(dtype >= len(DTYPE_NAMES)):
        _fail(f"{what}: unknown dtype code; known dtypes: {', '.join(DTYPE_NAMES)}")
    if np.any(ndim < 0) or np.any(ndim > min(MAX_NDIM, shape.shape[1])):
        _fail(f"{what}: tensors may have at most {MAX_NDIM} dimensions")
    if shape.shape[1] > MAX_NDIM:
        _fail(f"{what}: tensors may have at most {MAX_NDIM} dimensions")
    if np.any(shape < 0) or np.any(shape > MAX_DIM):
        _fail(f"{what}: every dimension must be between 0 and {MAX_DIM}")
    # float product: an int64 one could wrap before the comparison
    huge = np.flatnonzero(numel(shape.astype(np.float64)) * ITEMSIZE[dtype] >= MAX_OFFSET)
    if len(huge):
        _fail(f"{what}: tensor {names[int(huge[0])]!r} has 2**62 bytes or more")
    _check_names(names, what)


def _check_region(names: tuple[str, ...], offset: np.ndarray, nbytes: np.ndarray, what: str, exclusive: bool) -> None:
    if np.any(offset < 0) or np.any(offset + nbytes > MAX_OFFSET):
        i = int(np.flatnonzero((offset < 0) | (offset + nbytes > MAX_OFFSET))[0])
        _fail(f"{what}: tensor {names[i]!r} has region offset {int(offset[i])}, outside [0, 2**62)")
    if not exclusive:
        return
    live = np.flatnonzero(nbytes > 0)
    order = live[np.argsort(offset[live], kind="stable")]
    clash = np.flatnonzero(offset[order[:-1]] + nbytes[order[:-1]] > offset[order[1:]])
    if len(clash):
        a, b = order[clash[0]], order[clash[0] + 1]
        _fail(
            f"{what}: tensors {names[a]!r} (bytes {int(offset[a])}..{int(offset[a] + nbytes[a])}) and "
            f"{names[b]!r} (from byte {int(offset[b])}) overlap in the region; each target byte must belong "
            "to one tensor"
        )


def check_source(cols: SourceColumns, rank: int) -> None:
    """Rank-local checks of a source description; PlanError naming the rank and tensor."""
    what = f"source rank {rank}"
    _check_common(cols.names, cols.dtype, cols.ndim, cols.shape, what)
    n = len(cols.names)
    if cols.box_off.shape != cols.shape.shape or cols.box_size.shape != cols.shape.shape \
            or len(cols.region_offset) != n:
        _fail(f"{what}: column lengths disagree")
    _check_padding(cols.ndim, [(cols.shape, 1, "shape"), (cols.box_off, 0, "box offsets"),
                               (cols.box_size, 1, "box sizes")], what)
    outside = np.flatnonzero(row_any((cols.box_off < 0) | (cols.box_size < 0)
                                     | (cols.box_off + cols.box_size > cols.shape)))
    if len(outside):
        i = int(outside[0])
        _fail(f"{what}: tensor {cols.names[i]!r} holds box {format_box(cols.box_off[i], cols.box_size[i])}, "
              f"outside its global shape {tuple(int(x) for x in cols.shape[i, cols.shape.shape[1] - cols.ndim[i]:])}")
    _check_region(cols.names, cols.region_offset, numel(cols.box_size) * ITEMSIZE[cols.dtype], what, exclusive=False)


def check_target(cols: TargetColumns, rank: int) -> None:
    """Rank-local checks of a target description: pieces inside, disjoint, tiling each tensor."""
    what = f"target rank {rank}"
    _check_common(cols.names, cols.dtype, cols.ndim, cols.shape, what)
    n, p = len(cols.names), len(cols.piece_tensor)
    if len(cols.region_offset) != n:
        _fail(f"{what}: column lengths disagree")
    if p > MAX_ROWS or len(cols.piece_source) != p or len(cols.piece_ndim) != p or any(
        a.shape != (p, cols.shape.shape[1]) for a in (cols.piece_off, cols.piece_size, cols.piece_at)
    ):
        _fail(f"{what}: piece column lengths disagree")
    _check_strings(cols.piece_source, f"{what}: piece source names")
    if p and (np.any(cols.piece_tensor < 0) or np.any(cols.piece_tensor >= n)
              or np.any(np.diff(cols.piece_tensor) < 0)):
        _fail(f"{what}: pieces must name their tensors in order")
    tensor_ndim = cols.ndim[cols.piece_tensor]
    if np.any(cols.piece_ndim < 0) or np.any(cols.piece_ndim > tensor_ndim):
        i = int(np.flatnonzero((cols.piece_ndim < 0) | (cols.piece_ndim > tensor_ndim))[0])
        _fail(f"{what}: a piece of {cols.piece_source[i]!r} in {cols.names[cols.piece_tensor[i]]!r} has more "
              "dimensions than its target tensor")
    _check_padding(cols.ndim, [(cols.shape, 1, "local shape")], what)
    _check_padding(cols.piece_ndim, [(cols.piece_off, 0, "piece offsets"), (cols.piece_size, 1, "piece sizes")], what)
    _check_padding(tensor_ndim, [(cols.piece_at, 0, "piece positions")], what)
    local = np.take(cols.shape, cols.piece_tensor, axis=0)
    bad = row_any((cols.piece_off < 0) | (cols.piece_size < 0) | (cols.piece_off > MAX_DIM) | (cols.piece_at < 0)
                  | (cols.piece_at + cols.piece_size > local))
    if np.any(bad):
        i = int(np.flatnonzero(bad)[0])
        t = int(cols.piece_tensor[i])
        _fail(f"{what}: tensor {cols.names[t]!r} places a piece of {cols.piece_source[i]!r} at "
              f"{format_box(cols.piece_at[i], cols.piece_size[i])}, outside its local shape "
              f"{tuple(int(x) for x in cols.shape[t, cols.shape.shape[1] - cols.ndim[t]:])}")
    nbytes = numel(cols.shape) * ITEMSIZE[cols.dtype]
    _check_region(cols.names, cols.region_offset, nbytes, what, exclusive=True)
    live = np.flatnonzero(numel(cols.piece_size) > 0)
    ia, ib = overlap_pairs(cols.piece_tensor[live], cols.piece_at[live], cols.piece_size[live],
                           cols.piece_tensor[live], cols.piece_at[live], cols.piece_size[live])
    clash = np.flatnonzero(ia != ib)
    if len(clash):
        a, b = live[ia[clash[0]]], live[ib[clash[0]]]
        _fail(f"{what}: in tensor {cols.names[cols.piece_tensor[a]]!r} the piece of {cols.piece_source[a]!r} at "
              f"{format_box(cols.piece_at[a], cols.piece_size[a])} overlaps the piece of {cols.piece_source[b]!r} "
              f"at {format_box(cols.piece_at[b], cols.piece_size[b])}; every target byte must come from one piece")
    placed = np.zeros(n, dtype=I64)
    if p:
        starts = segment_starts(cols.piece_tensor)
        placed[cols.piece_tensor[starts]] = np.add.reduceat(numel(cols.piece_size), starts)
    gap = np.flatnonzero(placed != numel(cols.shape))
    if len(gap):
        t = int(gap[0])
        _fail(f"{what}: the pieces of tensor {cols.names[t]!r} cover {int(placed[t])} of its "
              f"{int(numel(cols.shape[t:t + 1])[0])} elements; describe where every element comes from")


# ---- wire form -------------------------------------------------------------------------------------------

_WIDTHS = ("<u1", "<u2", "<u4", "<u8", "<i8")


def _pack(array: np.ndarray) -> list[Any]:
    a = np.ascontiguousarray(array)
    if a.size and a.min() < 0:
        kind = "<i8"
    else:
        top = int(a.max()) if a.size else 0
        kind = next(k for k in _WIDTHS if top <= np.iinfo(np.dtype(k)).max)
    return [kind, list(a.shape), a.astype(kind).tobytes()]


def _unpack(value: Any, ndim: int, field: str) -> np.ndarray:
    if not (isinstance(value, list) and len(value) == 3 and value[0] in _WIDTHS and isinstance(value[2], bytes)
            and isinstance(value[1], list) and len(value[1]) == ndim
            and all(isinstance(x, int) and 0 <= x <= MAX_ROWS for x in value[1])):
        _fail(f"rank description field {field!r} is not a packed {ndim}-D integer array")
    kind, shape, data = value
    count = int(np.prod(shape, dtype=np.int64))
    if len(data) != count * np.dtype(kind).itemsize:
        _fail(f"rank description field {field!r} holds {len(data)} bytes for shape {shape}")
    out = np.frombuffer(data, dtype=kind).astype(I64).reshape(shape)
    if kind == "<u8" and count and np.any(out < 0):
        _fail(f"rank description field {field!r} holds values beyond 2**63")
    return out


def _names(value: Any, field: str) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or len(value) > MAX_ROWS:
        _fail(f"rank description field {field!r} must be a list of names")
    return tuple(value)


def encode(role: str, cols: Columns) -> bytes:
    """The columns as msgpack bytes (canonical: equal descriptions give equal bytes); no rank inside."""
    out: dict[str, Any] = {"v": WIRE_VERSION, "role": role, "names": list(cols.names),
                           "dtype": _pack(cols.dtype), "ndim": _pack(cols.ndim), "shape": _pack(cols.shape),
                           "region_offset": _pack(cols.region_offset)}
    if isinstance(cols, SourceColumns):
        out.update(box_off=_pack(cols.box_off), box_size=_pack(cols.box_size))
    else:
        out.update(piece_tensor=_pack(cols.piece_tensor), piece_source=list(cols.piece_source),
                   piece_ndim=_pack(cols.piece_ndim), piece_off=_pack(cols.piece_off),
                   piece_size=_pack(cols.piece_size), piece_at=_pack(cols.piece_at))
    return msgpack.packb(out, use_bin_type=True)


def decode(body: bytes, rank: int) -> tuple[str, Columns]:
    """(role, columns) from :func:`encode` output, fully checked; PlanError on anything malformed."""
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise PlanError(f"rank {rank} description is not valid msgpack: {exc}") from None
    if not isinstance(obj, dict) or obj.get("v") != WIRE_VERSION:
        _fail(f"rank {rank}: not a version {WIRE_VERSION} rank description")
    role = obj.get("role")
    if role not in ("source", "target"):
        _fail(f"rank {rank} description has role {role!r}; want 'source' or 'target'")
    expected = {"v", "role", "names", "dtype", "ndim", "shape", "region_offset"}
    expected |= {"box_off", "box_size"} if role == "source" else {
        "piece_tensor", "piece_source", "piece_ndim", "piece_off", "piece_size", "piece_at"}
    if set(obj) != expected:
        _fail(f"{role} rank {rank} description has fields {sorted(obj)}, want {sorted(expected)}")
    names = _names(obj["names"], "names")
    dtype = _unpack(obj["dtype"], 1, "dtype")
    if np.any(dtype >= len(DTYPE_NAMES)):
        _fail(f"{role} rank {rank}: unknown dtype code; known dtypes: {', '.join(DTYPE_NAMES)}")
    common: dict[str, Any] = dict(names=names, dtype=dtype.astype(np.uint8),
                                  ndim=_unpack(obj["ndim"], 1, "ndim"), shape=_unpack(obj["shape"], 2, "shape"),
                                  region_offset=_unpack(obj["region_offset"], 1, "region_offset"))
    cols: Columns
    if role == "source":
        source = SourceColumns(**common, box_off=_unpack(obj["box_off"], 2, "box_off"),
                               box_size=_unpack(obj["box_size"], 2, "box_size"))
        _check_sorted(names, f"source rank {rank}")
        check_source(source, rank)
        cols = freeze(source)
    else:
        target = TargetColumns(**common, piece_tensor=_unpack(obj["piece_tensor"], 1, "piece_tensor"),
                               piece_source=_names(obj["piece_source"], "piece_source"),
                               piece_ndim=_unpack(obj["piece_ndim"], 1, "piece_ndim"),
                               piece_off=_unpack(obj["piece_off"], 2, "piece_off"),
                               piece_size=_unpack(obj["piece_size"], 2, "piece_size"),
                               piece_at=_unpack(obj["piece_at"], 2, "piece_at"))
        _check_sorted(names, f"target rank {rank}")
        check_target(target, rank)
        cols = freeze(target)
    return role, cols


ColumnsT = TypeVar("ColumnsT", SourceColumns, TargetColumns)


def freeze(cols: ColumnsT) -> ColumnsT:
    """Make the column arrays read-only: ranks with equal descriptions share one columns object."""
    for value in vars(cols).values():
        if isinstance(value, np.ndarray):
            value.flags.writeable = False
    return cols


def _check_sorted(names: tuple[str, ...], what: str) -> None:
    # the wire form is canonical (sorted names); anything else was not written by to_wire
    if set(map(type, names)) - {str} or list(names) != sorted(names):
        _fail(f"{what}: tensor names on the wire must be strings in sorted order")
