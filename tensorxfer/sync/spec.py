"""Shard descriptions for a resharded weight sync: which box of which tensor each rank holds or needs.

Every rank keeps its local tensors in ONE region (a byte buffer); each local
tensor is C-contiguous at a byte offset of that region.

- A **source** rank (a trainer rank) holds, for each tensor it has, one box
  of the *global* tensor: :class:`SourceTensor`.
- A **target** rank (an inference rank) has local tensors, each assembled
  from one or more :class:`Piece` s: "this box of global source tensor X
  lands at these local coordinates": :class:`TargetTensor`.  A plain sharded
  target has one piece at the origin; a fused one (``qkv_proj`` =
  cat(q_r, k_r, v_r)) has several, stacked along the fused dimension.  A
  piece's box may have fewer dimensions than its target tensor: it is
  aligned to the target's trailing dimensions (leading ones are size 1), so
  2-D per-expert weights stack into a 3-D ``w13`` of a fused MoE layer.
- :class:`RankSpec` is one rank's description; the planner
  (:mod:`tensorxfer.sync.plan`) takes all of them.

Helpers build boxes for what users have: :func:`chunk_box` (``torch.chunk``
semantics: FSDP2's ``Shard(dim)``), :func:`even_box`, :func:`replicate_box`,
:func:`box_of_dtensor` (a torch ``DTensor``'s mesh and placements) and
:func:`fused_target` (vLLM-style fused, column-parallel tensors).

Dtypes are tensorxfer's names (safetensors spelling: ``"F32"``, ``"BF16"``,
see :mod:`tensorxfer.dtypes`); a target piece must have its source's dtype
(the plan copies bytes; casting is not part of it yet).  Every description
is validated when built and converts to msgpack-ready values with
``to_wire`` / ``from_wire``.  Invalid input raises
:class:`~tensorxfer.errors.PlanError`.

Limits: at most 8 dimensions, each below 2**40 elements; region offsets
and tensor sizes below 2**62 bytes.  A target tensor's pieces must tile
it exactly; padding that no source holds (vLLM pads a vocab-parallel
embedding and head to a multiple of 64 rows) is a :meth:`Piece.filled`
piece: the target zeroes it once, the planner leaves it out.
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from tensorxfer.dtypes import DTYPES, from_torch
from tensorxfer.errors import PlanError
from tensorxfer.quant.layout import SEP, parse_derived
from tensorxfer.sync import _columns
from tensorxfer.sync._boxes import MAX_DIM

MAX_NDIM = _columns.MAX_NDIM
FILLED = SEP + "filled"     # a piece no source holds: the target fills it once (padding), nothing plans it

__all__ = [
    "Box",
    "Piece",
    "RankSpec",
    "SourceTensor",
    "TargetTensor",
    "box_of_dtensor",
    "chunk_box",
    "even_box",
    "fused_target",
    "replicate_box",
    "source_tensor_of_dtensor",
]


def _ints(value: Any, what: str, low: int = 0) -> tuple[int, ...]:
    """A tuple of ints >= low (numpy ints accepted, bools and floats refused)."""
    try:
        items = tuple(value)
    except TypeError:
        raise PlanError(f"{what} must be a sequence of ints, got {value!r}") from None
    out = []
    for item in items:
        if isinstance(item, bool):
            raise PlanError(f"{what} must hold ints, got {value!r}")
        try:
            number = operator.index(item)
        except TypeError:
            raise PlanError(f"{what} must hold ints, got {value!r}") from None
        if not low <= number <= MAX_DIM:
            raise PlanError(f"{what} must hold ints in [{low}, {MAX_DIM}], got {value!r}")
        out.append(number)
    if len(out) > MAX_NDIM:
        raise PlanError(f"{what} has {len(out)} dimensions; at most {MAX_NDIM} are supported")
    return tuple(out)


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= _columns.MAX_NAME:
        raise PlanError(f"{what} must be a non-empty string of at most {_columns.MAX_NAME} characters, got {value!r}")
    if SEP in value and value != FILLED:    # else only the derived names of quantized tensors hold one
        parse_derived(value)
    return value


def _dtype(value: Any, what: str) -> str:
    if value not in DTYPES:
        raise PlanError(f"{what} has dtype {value!r}; use one of {', '.join(DTYPES)}")
    return str(value)


def _offset(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise PlanError(f"{what} must be an int, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise PlanError(f"{what} must be an int, got {value!r}") from None
    if not 0 <= number < _columns.MAX_OFFSET:
        raise PlanError(f"{what} must be in [0, 2**62), got {number}")
    return number


@dataclass(frozen=True)
class Box:
    """A box of a tensor in global element coordinates: ``offsets[d]`` to ``offsets[d] + sizes[d]``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        offsets = _ints(self.offsets, "Box offsets")
        sizes = _ints(self.sizes, "Box sizes")
        if len(offsets) != len(sizes):
            raise PlanError(f"Box offsets {offsets} and sizes {sizes} have different lengths")
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "sizes", sizes)

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def empty(self) -> bool:
        return self.numel == 0

    def within(self, shape: Sequence[int]) -> bool:
        """Whether the box lies inside a tensor of this shape."""
        return len(shape) == self.ndim and all(o + s <= n for o, s, n in zip(self.offsets, self.sizes, shape))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes)) + "]"

    def to_wire(self) -> list[list[int]]:
        return [list(self.offsets), list(self.sizes)]

    @classmethod
    def from_wire(cls, obj: Any) -> Box:
        if not isinstance(obj, list | tuple) or len(obj) != 2:
            raise PlanError(f"a Box on the wire is [offsets, sizes], got {obj!r}")
        return cls(obj[0], obj[1])


@dataclass(frozen=True)
class SourceTensor:
    """A source rank holds ``box`` of global tensor ``name`` as a C-contiguous local tensor at ``region_offset``.

    The local tensor's shape is ``box.sizes``; an empty box (FSDP2 gives
    trailing ranks empty shards) holds nothing.
    """

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    box: Box
    region_offset: int

    def __post_init__(self) -> None:
        _name(self.name, "SourceTensor name")
        shape = _ints(self.global_shape, f"global shape of {self.name!r}")
        object.__setattr__(self, "global_shape", shape)
        _dtype(self.dtype, f"source tensor {self.name!r}")
        if not isinstance(self.box, Box):
            raise PlanError(f"source tensor {self.name!r}: box must be a Box, got {type(self.box).__name__}")
        if not self.box.within(shape):
            raise PlanError(f"source tensor {self.name!r}: box {self.box} is outside its global shape {shape}")
        object.__setattr__(self, "region_offset", _offset(self.region_offset, f"region offset of {self.name!r}"))

    @property
    def nbytes(self) -> int:
        return self.box.numel * DTYPES[self.dtype].itemsize

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "global_shape": list(self.global_shape), "dtype": self.dtype,
                "box": self.box.to_wire(), "region_offset": self.region_offset}

    @classmethod
    def from_wire(cls, obj: Any) -> SourceTensor:
        if not isinstance(obj, dict) or set(obj) != {"name", "global_shape", "dtype", "box", "region_offset"}:
            raise PlanError(f"not a SourceTensor on the wire: {obj!r}")
        return cls(obj["name"], obj["global_shape"], obj["dtype"], Box.from_wire(obj["box"]), obj["region_offset"])


@dataclass(frozen=True)
class Piece:
    """``source_box`` of global source tensor ``source_name`` lands at local coordinates ``at`` of a target tensor.

    ``at`` has the target tensor's dimensions; a box with fewer dimensions is
    aligned to the trailing ones (the leading ones have size 1).
    """

    source_name: str
    source_box: Box
    at: tuple[int, ...]

    def __post_init__(self) -> None:
        _name(self.source_name, "Piece source_name")
        if not isinstance(self.source_box, Box):
            raise PlanError(f"piece of {self.source_name!r}: source_box must be a Box")
        at = _ints(self.at, f"position of the piece of {self.source_name!r}")
        if len(at) < self.source_box.ndim:
            raise PlanError(f"piece of {self.source_name!r}: position {at} has fewer dimensions than its box "
                            f"{self.source_box}")
        object.__setattr__(self, "at", at)

    @classmethod
    def filled(cls, sizes: Sequence[int], at: Sequence[int]) -> Piece:
        """Elements of the target that no source holds (an engine's padding: vLLM pads a vocab-parallel
        embedding and head to a multiple of 64 rows): zeroed once by the target, never planned or sent."""
        return cls(FILLED, Box((0,) * len(tuple(sizes)), tuple(sizes)), tuple(at))

    @property
    def is_filled(self) -> bool:
        return self.source_name == FILLED

    @property
    def local_sizes(self) -> tuple[int, ...]:
        """The box's sizes in the target tensor's dimensions."""
        return (1,) * (len(self.at) - self.source_box.ndim) + self.source_box.sizes

    def to_wire(self) -> dict[str, Any]:
        return {"source_name": self.source_name, "source_box": self.source_box.to_wire(), "at": list(self.at)}

    @classmethod
    def from_wire(cls, obj: Any) -> Piece:
        if not isinstance(obj, dict) or set(obj) != {"source_name", "source_box", "at"}:
            raise PlanError(f"not a Piece on the wire: {obj!r}")
        return cls(obj["source_name"], Box.from_wire(obj["source_box"]), obj["at"])


@dataclass(frozen=True)
class TargetTensor:
    """A target rank's local tensor of ``local_shape`` at ``region_offset``, assembled from ``pieces``.

    The pieces must tile the local tensor (inside it, not overlapping, every
    element covered); :class:`RankSpec` checks the overlap and the tiling.
    """

    name: str
    local_shape: tuple[int, ...]
    dtype: str
    region_offset: int
    pieces: tuple[Piece, ...]

    def __post_init__(self) -> None:
        _name(self.name, "TargetTensor name")
        shape = _ints(self.local_shape, f"local shape of {self.name!r}")
        object.__setattr__(self, "local_shape", shape)
        _dtype(self.dtype, f"target tensor {self.name!r}")
        object.__setattr__(self, "region_offset", _offset(self.region_offset, f"region offset of {self.name!r}"))
        pieces = tuple(self.pieces)
        for piece in pieces:
            if not isinstance(piece, Piece):
                raise PlanError(f"target tensor {self.name!r}: pieces must be Piece objects, got {piece!r}")
            if len(piece.at) != len(shape):
                raise PlanError(f"target tensor {self.name!r}: piece of {piece.source_name!r} is placed at "
                                f"{piece.at}, which does not have the {len(shape)} dimensions of {shape}")
            if any(a + s > n for a, s, n in zip(piece.at, piece.local_sizes, shape)):
                raise PlanError(f"target tensor {self.name!r}: piece {piece.source_box} of {piece.source_name!r} "
                                f"placed at {piece.at} reaches outside its local shape {shape}")
        object.__setattr__(self, "pieces", pieces)

    @property
    def nbytes(self) -> int:
        return math.prod(self.local_shape) * DTYPES[self.dtype].itemsize

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "local_shape": list(self.local_shape), "dtype": self.dtype,
                "region_offset": self.region_offset, "pieces": [p.to_wire() for p in self.pieces]}

    @classmethod
    def from_wire(cls, obj: Any) -> TargetTensor:
        if not isinstance(obj, dict) or set(obj) != {"name", "local_shape", "dtype", "region_offset", "pieces"}:
            raise PlanError(f"not a TargetTensor on the wire: {obj!r}")
        if not isinstance(obj["pieces"], list | tuple):
            raise PlanError("TargetTensor pieces on the wire must be a list")
        return cls(obj["name"], obj["local_shape"], obj["dtype"], obj["region_offset"],
                   tuple(Piece.from_wire(p) for p in obj["pieces"]))


class RankSpec:
    """One rank's description: ``role`` ("source" or "target"), ``rank`` and its tensors.

    Immutable.  Checked when built: tensors of the role's kind, unique names;
    on targets, tensors that do not overlap in the region and pieces that
    tile each tensor.  Internally the tensors are kept as read-only numpy
    columns in canonical order (what the planner and the wire use), so a
    description decoded with :meth:`from_wire` builds its ``tensors``
    objects only when asked.  Two specs are equal when their canonical
    encodings are.

    Raises
    ------
    PlanError
        Naming the rank and the tensor at fault.
    """

    __slots__ = ("_body", "_cols", "_content", "_digest", "_rank", "_role", "_tensors")
    _role: str
    _rank: int
    _cols: _columns.Columns
    _tensors: tuple[Any, ...] | None
    _body: bytes | None
    _content: bytes | None
    _digest: bytes | None

    def __init__(self, role: str, rank: int, tensors: Iterable[SourceTensor | TargetTensor]) -> None:
        if role not in ("source", "target"):
            raise PlanError(f"role must be 'source' or 'target', got {role!r}")
        _check_rank(rank)
        items = tuple(tensors)
        kind = SourceTensor if role == "source" else TargetTensor
        for t in items:
            if not isinstance(t, kind):
                raise PlanError(f"{role} rank {rank}: tensors must be {kind.__name__} objects, got {t!r}")
        cols: _columns.Columns
        if role == "source":
            cols = _columns.source_columns(
                [(t.name, t.dtype, t.global_shape, t.box.offsets, t.box.sizes, t.region_offset)
                 for t in items if isinstance(t, SourceTensor)], rank)
        else:
            cols = _columns.target_columns(
                [(t.name, t.dtype, t.local_shape, t.region_offset,
                  [(p.source_name, p.source_box.offsets, p.source_box.sizes, p.at) for p in t.pieces])
                 for t in items if isinstance(t, TargetTensor)], rank)
        self._set(role, rank, cols, items, None, None)

    def _set(self, role: str, rank: int, cols: _columns.Columns, items: tuple[Any, ...] | None,
             body: bytes | None, content: bytes | None) -> None:
        for name, value in (("_role", role), ("_rank", rank), ("_cols", cols), ("_tensors", items),
                            ("_body", body), ("_content", content), ("_digest", None)):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("RankSpec is immutable")

    @property
    def role(self) -> str:
        return self._role

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def columns(self) -> _columns.Columns:
        """The canonical columns (internal to tensorxfer.sync; read-only arrays)."""
        return self._cols

    @property
    def extent(self) -> int:
        """Bytes of the rank's region its tensors reach (the end of the last one: the region's payload)."""
        cols = self._cols
        sizes = cols.box_size if isinstance(cols, _columns.SourceColumns) else cols.shape
        ends = cols.region_offset + _columns.numel(sizes) * _columns.ITEMSIZE[cols.dtype]
        return int(ends.max()) if len(ends) else 0

    @property
    def tensors(self) -> tuple[Any, ...]:
        """The tensors as :class:`SourceTensor` / :class:`TargetTensor` objects."""
        tensors = self._tensors
        if tensors is None:
            tensors = _materialize(self._cols)
            object.__setattr__(self, "_tensors", tensors)
        return tensors

    @property
    def body(self) -> bytes:
        """The description without its rank, as canonical msgpack bytes."""
        body = self._body
        if body is None:
            body = _columns.encode(self._role, self._cols)
            object.__setattr__(self, "_body", body)
        return body

    @property
    def content_digest(self) -> bytes:
        """sha256 of :attr:`body`: equal for ranks that hold or need the same things at the same offsets."""
        found = self._content
        if found is None:
            found = hashlib.sha256(self.body).digest()
            object.__setattr__(self, "_content", found)
        return found

    @property
    def digest(self) -> bytes:
        """sha256 of rank and content (independent of the order the tensors were given in)."""
        found = self._digest
        if found is None:
            found = hashlib.sha256(b"tensorxfer.sync.rank/1\0%d\0" % self._rank + self.content_digest).digest()
            object.__setattr__(self, "_digest", found)
        return found

    def to_wire(self) -> dict[str, Any]:
        """msgpack-ready dict: ``{"v": 1, "rank": rank, "body": canonical msgpack of the columns}``."""
        return {"v": _columns.WIRE_VERSION, "rank": self._rank, "body": self.body}

    @classmethod
    def from_wire(cls, obj: Any, memo: dict[bytes, Any] | None = None,
                  content_digest: bytes | None = None) -> RankSpec:
        """The spec :meth:`to_wire` encoded, fully re-checked (wire input is not trusted).

        Pass the same ``memo`` dict when decoding many ranks: ranks with
        identical bodies (the replicas of an inference group) are decoded
        and checked once and share one read-only columns object.
        ``content_digest``: the sha256 of the body where the caller checked
        it already (a store names bodies by it), so it is not hashed again.
        """
        if not isinstance(obj, dict) or set(obj) != {"v", "rank", "body"} or obj["v"] != _columns.WIRE_VERSION:
            raise PlanError(f"not a version {_columns.WIRE_VERSION} rank description "
                            "({'v': 1, 'rank': int, 'body': bytes})")
        rank, body = obj["rank"], obj["body"]
        _check_rank(rank)
        if not isinstance(body, bytes):
            raise PlanError(f"rank {rank} description body must be bytes, got {type(body).__name__}")
        found = memo.get(body) if memo is not None else None
        if found is None:
            role, cols = _columns.decode(body, rank)
            found = (role, cols, content_digest or hashlib.sha256(body).digest())
            if memo is not None:
                memo[body] = found
        spec = cls.__new__(cls)
        spec._set(found[0], rank, found[1], None, body, found[2])
        return spec

    def to_bytes(self) -> bytes:
        """:meth:`to_wire` packed with msgpack."""
        return msgpack.packb(self.to_wire(), use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes, max_bytes: int = 1 << 30, memo: dict[bytes, Any] | None = None) -> RankSpec:
        """Unpack :meth:`to_bytes` output; PlanError for anything but a valid description (``memo``: see from_wire)."""
        if len(data) > max_bytes:
            raise PlanError(f"rank description of {len(data)} bytes is over the limit of {max_bytes}")
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except (ValueError, msgpack.UnpackException) as exc:
            raise PlanError(f"rank description is not valid msgpack: {exc}") from None
        return cls.from_wire(obj, memo)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RankSpec):
            return NotImplemented
        return self.digest == other.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"RankSpec(role={self._role!r}, rank={self._rank}, tensors={len(self._cols.names)})"


def _check_rank(rank: Any) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 1 << 31:
        raise PlanError(f"rank must be an int in [0, 2**31), got {rank!r}")


def _unpad(row: Any, ndim: int) -> tuple[int, ...]:
    return tuple(int(x) for x in row[len(row) - ndim:]) if ndim else ()


def _materialize(cols: _columns.Columns) -> tuple[Any, ...]:
    names = _columns.DTYPE_NAMES
    if isinstance(cols, _columns.SourceColumns):
        return tuple(
            SourceTensor(name, _unpad(cols.shape[i], int(cols.ndim[i])), names[cols.dtype[i]],
                         Box(_unpad(cols.box_off[i], int(cols.ndim[i])), _unpad(cols.box_size[i], int(cols.ndim[i]))),
                         int(cols.region_offset[i]))
            for i, name in enumerate(cols.names))
    pieces: list[list[Piece]] = [[] for _ in cols.names]
    for j, t in enumerate(cols.piece_tensor):
        k, m = int(cols.ndim[t]), int(cols.piece_ndim[j])
        box = Box(_unpad(cols.piece_off[j], m), _unpad(cols.piece_size[j], m))
        pieces[int(t)].append(Piece(cols.piece_source[j], box, _unpad(cols.piece_at[j], k)))
    return tuple(
        TargetTensor(name, _unpad(cols.shape[i], int(cols.ndim[i])), names[cols.dtype[i]],
                     int(cols.region_offset[i]), tuple(pieces[i]))
        for i, name in enumerate(cols.names))


# ---- helpers for the boxes users have ----------------------------------------------------------------------


def _check_split(global_shape: Sequence[int], dim: int, index: int, count: int) -> tuple[int, ...]:
    shape = _ints(global_shape, "global shape")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise PlanError(f"count must be an int >= 1, got {count!r}")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise PlanError(f"index must be an int in [0, {count}), got {index!r}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
        raise PlanError(f"dim {dim!r} is not a dimension of shape {shape}")
    return shape


def chunk_box(global_shape: Sequence[int], dim: int, index: int, count: int) -> Box:
    """Box of ``torch.chunk(t, count, dim)[index]``, or an empty box where torch.chunk gives fewer chunks.

    Chunks have ``ceil(n / count)`` elements along ``dim``; the last non-empty
    one may be shorter and trailing ones empty (FSDP2's ``Shard(dim)`` does
    exactly this).  An empty box sits at offset ``n``, as DTensor reports it.
    """
    shape = _check_split(global_shape, dim, index, count)
    dim %= len(shape)
    n = shape[dim]
    chunk = -(-n // count)
    start = min(index * chunk, n)
    size = min(chunk, n - start)
    return Box(tuple(start if d == dim else 0 for d in range(len(shape))),
               tuple(size if d == dim else s for d, s in enumerate(shape)))


def even_box(global_shape: Sequence[int], dim: int, index: int, count: int) -> Box:
    """Box of shard ``index`` of ``count`` equal shards along ``dim``; PlanError unless ``count`` divides it."""
    shape = _check_split(global_shape, dim, index, count)
    if shape[dim] % count:
        raise PlanError(f"dimension {dim} of {shape} ({shape[dim]}) does not split evenly into {count} shards; "
                        "use chunk_box for torch.chunk-style uneven shards")
    return chunk_box(shape, dim, index, count)


def replicate_box(global_shape: Sequence[int]) -> Box:
    """The whole tensor (a ``Replicate`` placement)."""
    shape = _ints(global_shape, "global shape")
    return Box((0,) * len(shape), shape)


def _head_box(shape: tuple[int, ...], dim: int, rank: int, count: int, head_dim: int, name: str) -> Box:
    if shape[dim] % head_dim:
        raise PlanError(f"fused part {name!r}: dimension {dim} of {shape} is not a multiple of head_dim {head_dim}")
    heads = shape[dim] // head_dim
    if heads >= count and heads % count == 0:
        first, n = rank * (heads // count), heads // count
    elif heads and heads < count and count % heads == 0:
        first, n = rank // (count // heads), 1   # replicated head (GQA: fewer kv heads than ranks)
    else:
        raise PlanError(f"fused part {name!r} has {heads} heads, which neither split evenly over {count} ranks "
                        f"nor replicate evenly onto them")
    return Box(tuple(first * head_dim if d == dim else 0 for d in range(len(shape))),
               tuple(n * head_dim if d == dim else s for d, s in enumerate(shape)))


def fused_target(
    name: str,
    parts: Sequence[tuple[str, Sequence[int]]],
    dim: int,
    rank: int,
    count: int,
    dtype: str,
    region_offset: int,
    head_dim: int | None = None,
) -> TargetTensor:
    """Target tensor of TP rank ``rank`` of ``count``: each part's shard, concatenated along ``dim``.

    ``parts`` are ``(source_name, global_shape)`` (e.g. q, k, v for vLLM's
    ``qkv_proj``; gate, up for ``gate_up_proj``).  Without ``head_dim`` each
    part is split like :func:`chunk_box` along ``dim``.  With ``head_dim``
    each part is split in whole heads of ``head_dim`` rows: ``heads / count``
    per rank when ``count`` divides the part's heads, or, when the part has
    fewer heads than ranks and ``heads`` divides ``count`` (grouped-query
    attention), one head per rank, head ``rank // (count // heads)``,
    replicated on ``count // heads`` ranks, as vLLM's ``QKVParallelLinear``
    does.  Other head counts raise PlanError.  Parts must agree on every
    dimension but ``dim``.
    """
    if not parts:
        raise PlanError(f"fused target {name!r} needs at least one part")
    shapes = [_ints(shape, f"global shape of fused part {part!r}") for part, shape in parts]
    ndim = len(shapes[0])
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise PlanError(f"fused target {name!r}: dim {dim!r} is not a dimension of {shapes[0]}")
    dim %= ndim
    for (part, _), shape in zip(parts, shapes):
        if len(shape) != ndim or any(s != shapes[0][d] for d, s in enumerate(shape) if d != dim):
            raise PlanError(f"fused target {name!r}: part {part!r} has shape {shape}, which does not match "
                            f"{shapes[0]} outside dimension {dim}")
    if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1):
        raise PlanError(f"head_dim must be an int >= 1, got {head_dim!r}")
    pieces = []
    at = 0
    for (part, _), shape in zip(parts, shapes):
        if head_dim is None:
            box = chunk_box(shape, dim, rank, count)
        else:
            _check_split(shape, dim, rank, count)
            box = _head_box(shape, dim, rank, count, head_dim, part)
        pieces.append(Piece(part, box, tuple(at if d == dim else 0 for d in range(ndim))))
        at += box.sizes[dim]
    local_shape = tuple(at if d == dim else s for d, s in enumerate(shapes[0]))
    return TargetTensor(name, local_shape, dtype, region_offset, tuple(pieces))


def box_of_dtensor(dt: Any) -> Box:
    """The box of the global tensor that this rank's shard of DTensor ``dt`` holds.

    Reads ``dt``'s device mesh and placements with torch's own
    ``compute_local_shape_and_global_offset``.  ``Shard(d)`` and
    ``Replicate`` on any mesh dimensions are supported (uneven shards
    included); ``Partial`` (a pending reduction) and strided shards (FSDP2
    composed with TP on the same dimension: the local rows are not one box)
    raise PlanError.  The caller's process must be part of the mesh.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(dt, DTensor):
        raise PlanError(f"box_of_dtensor needs a torch DTensor, got {type(dt).__name__}")
    for placement in dt.placements:
        if type(placement) not in (Shard, Replicate):
            raise PlanError(f"DTensor placement {placement} is not supported: only Shard(dim) and Replicate "
                            "describe a box (reduce a Partial first; strided shards are not one box)")
    shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    if len(offset) != len(dt.shape):
        raise PlanError("this process is not part of the DTensor's device mesh, so it holds no shard")
    local = tuple(dt.to_local().shape)
    if tuple(shape) != local:
        raise PlanError(f"DTensor local shard has shape {local} but its placements give {tuple(shape)}")
    return Box(tuple(int(o) for o in offset), tuple(int(s) for s in shape))


def source_tensor_of_dtensor(name: str, dt: Any, region_offset: int) -> SourceTensor:
    """A :class:`SourceTensor` for this rank's shard of DTensor ``dt`` stored at ``region_offset``."""
    try:
        dtype = from_torch(dt.dtype).name
    except TypeError as exc:
        raise PlanError(f"DTensor {name!r}: {exc}") from None
    return SourceTensor(name, tuple(int(s) for s in dt.shape), dtype, box_of_dtensor(dt), region_offset)

