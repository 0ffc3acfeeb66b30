"""What a rank hands a WeightSync: its local tensors and where each sits in the global tensors.

A source tensor is a DTensor (FSDP2's ``Shard(0)`` parameters, TP's placements: the mesh says which box
this rank holds) or a :class:`Source` (a plain tensor with its global shape and box).  A target tensor is
a :class:`Target`: the live tensor the update lands in, and the pieces of source tensors it is made of --
a plain shard, a replica, or a fused tensor (vLLM's ``qkv_proj``: q, k and v shards stacked).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tensorxfer import dtypes as _dt
from tensorxfer.errors import PlanError
from tensorxfer.quant.layout import Quantization
from tensorxfer.sync.quantized_spec import quantized_target
from tensorxfer.sync.spec import (
    Box,
    Piece,
    TargetTensor,
    box_of_dtensor,
    chunk_box,
    fused_target,
    replicate_box,
)


@dataclass(frozen=True)
class Source:
    """A source rank's local tensor: ``box`` of a global tensor of ``global_shape``.

    ``adopt`` (the default for plain tensors) lets the sync move the tensor into its region and re-point it
    there (``tensor.data = view``), so a push sends it with no copy; where the wire dtype differs, or for a
    DTensor's local shard (FSDP2 keeps its own storage behind it), the tensor is copied in at every push.
    """

    tensor: Any
    global_shape: tuple[int, ...]
    box: Box
    adopt: bool = True

    @classmethod
    def shard(cls, tensor: Any, global_shape: Sequence[int], dim: int, rank: int, count: int) -> Source:
        """Shard ``rank`` of ``count`` along ``dim``, as ``torch.chunk`` cuts it."""
        return cls(tensor, tuple(global_shape), chunk_box(global_shape, dim, rank, count))

    @classmethod
    def whole(cls, tensor: Any) -> Source:
        """The whole tensor (a replica)."""
        return cls(tensor, tuple(tensor.shape), replicate_box(tuple(tensor.shape)))


@dataclass(frozen=True)
class Target:
    """A target rank's live tensor and the source pieces that fill it (pieces tile it exactly).

    A quantized target (:meth:`quantized`) holds FP8 values in ``tensor`` and their block scales in
    ``scales``: the sources quantize on the way (:mod:`tensorxfer.sync.quantizing`).  ``global_shapes``:
    each piece's source tensor's global shape (the block grid needs it; the factories fill it in).
    """

    tensor: Any
    pieces: tuple[Piece, ...]
    global_shapes: tuple[tuple[int, ...], ...] | None = None
    quantization: Quantization | None = None
    scales: Any = None

    @classmethod
    def shard(cls, tensor: Any, source: str, global_shape: Sequence[int], dim: int, rank: int, count: int) -> Target:
        """Shard ``rank`` of ``count`` of global tensor ``source`` along ``dim`` (column / row / vocab parallel)."""
        box = chunk_box(global_shape, dim, rank, count)
        return cls(tensor, (Piece(source, box, (0,) * len(box.sizes)),), (tuple(global_shape),))

    @classmethod
    def whole(cls, tensor: Any, source: str) -> Target:
        """All of global tensor ``source`` (a replicated weight: norms, biases)."""
        box = replicate_box(tuple(tensor.shape))
        return cls(tensor, (Piece(source, box, (0,) * len(box.sizes)),), (tuple(tensor.shape),))

    @classmethod
    def vocab_parallel(cls, tensor: Any, source: str, global_shape: Sequence[int], rank: int, count: int,
                       pad_to: int = 64) -> Target:
        """Rank ``rank`` of ``count`` of a vocab-parallel embedding or head as vLLM lays it out: the vocabulary
        padded to a multiple of ``pad_to`` rows, then cut in ``count`` equal row ranges; rows past the real
        vocabulary (the last ranks' tails) are padding the target zeroes once (:meth:`Piece.filled`), never
        sent.  ``tensor`` has ``padded // count`` rows."""
        shape = tuple(int(s) for s in global_shape)
        if not shape or isinstance(pad_to, bool) or not isinstance(pad_to, int) or pad_to < 1:
            raise PlanError(f"vocab_parallel needs a global shape with rows and pad_to >= 1, got {shape}, {pad_to!r}")
        padded = -(-shape[0] // pad_to) * pad_to
        if padded % count:
            raise PlanError(f"a vocabulary of {shape[0]} rows padded to {padded} does not split into {count} ranks")
        per = padded // count
        if tuple(tensor.shape) != (per, *shape[1:]):
            raise PlanError(f"vocab-parallel rank {rank}: the tensor has shape {tuple(tensor.shape)}, its padded "
                            f"rows need {(per, *shape[1:])}")
        start = min(rank * per, shape[0])
        real = min(per, shape[0] - start)
        rest = (0,) * (len(shape) - 1)
        pieces = ([Piece(source, Box((start, *rest), (real, *shape[1:])), (0, *rest))] if real else []) + \
            ([Piece.filled((per - real, *shape[1:]), (real, *rest))] if real < per else [])
        return cls(tensor, tuple(pieces), tuple(shape for _ in pieces))

    def quantized(self, q: Quantization, scales: Any, global_shapes: Sequence[Sequence[int]] | None = None) -> Target:
        """This target served quantized: ``tensor`` (``torch.float8_e4m3fn``) receives the FP8 values and
        ``scales`` the scales, both as layout ``q`` makes them (``scales``: float32 ``scale_inv`` of the
        block grid's shape, or e8m0 bytes as ``float8_e8m0fnu`` / ``uint8``; see
        :func:`tensorxfer.sync.spec.quantized_target` for the shapes).  ``global_shapes``: the pieces'
        source shapes where this target was built from its pieces directly.

        Raises PlanError, naming what does not fit, before anything is registered.
        """
        shapes = tuple(tuple(int(d) for d in s) for s in global_shapes) if global_shapes is not None \
            else self.global_shapes
        if shapes is None:
            raise PlanError("a quantized target needs the global shape of each piece's source tensor: build it "
                            "with Target.shard / whole / fused, or pass global_shapes")
        for what, t, want in (("values", self.tensor, (q.values_dtype,)),
                              ("scales", scales, (q.scale_dtype, "U8") if q.scale == "e8m0" else (q.scale_dtype,))):
            try:
                if not type(t).__module__.startswith("torch"):      # (a numpy array has a dtype too)
                    raise TypeError
                dtype = _dt.from_torch(t.dtype).name
            except (TypeError, AttributeError):
                raise PlanError(f"a quantized target's {what} must be a torch tensor (the engine's own), got "
                                f"{type(t).__name__}") from None
            if dtype not in want:
                raise PlanError(f"a quantized target's {what} tensor is {dtype}; {q} keeps them as "
                                f"{' or '.join(want)}")
        # named by what it serves (its own name comes with the WeightSync's dict)
        name = "+".join(dict.fromkeys(p.source_name for p in self.pieces if not p.is_filled)) or "(quantized)"
        values = TargetTensor(name, tuple(self.tensor.shape), q.values_dtype, 0, self.pieces)
        quantized_target(values, shapes, q, f"{name} scales", tuple(scales.shape), 0)  # refuses what does not fit
        return dataclasses.replace(self, global_shapes=shapes, quantization=q, scales=scales)

    @classmethod
    def fused(cls, tensor: Any, parts: Sequence[tuple[str, Sequence[int]]], dim: int, rank: int, count: int,
              head_dim: int | None = None) -> Target:
        """Each part's shard, stacked along ``dim`` (see :func:`tensorxfer.sync.fused_target`)."""
        spec = fused_target("fused", parts, dim, rank, count, _dt.from_torch(tensor.dtype).name, 0, head_dim)
        if tuple(tensor.shape) != spec.local_shape:
            raise PlanError(f"fused target: the tensor has shape {tuple(tensor.shape)}, its parts make "
                            f"{spec.local_shape}")
        return cls(tensor, spec.pieces, tuple(tuple(int(d) for d in shape) for _, shape in parts))


def source_of(value: Any) -> Source:
    """A :class:`Source` for a DTensor, a :class:`Source`, or a ``(tensor, global_shape, box)`` triple."""
    if isinstance(value, Source):
        return value
    if isinstance(value, tuple):
        return Source(*value)
    if type(value).__name__ == "DTensor" or hasattr(value, "device_mesh"):
        # never re-pointed: FSDP2's all-gather reads its own padded storage behind the local shard
        return Source(value.to_local(), tuple(int(s) for s in value.shape), box_of_dtensor(value), adopt=False)
    raise TypeError(f"a source tensor must be a DTensor or a tensorxfer.sync.Source, got {type(value).__name__}")
