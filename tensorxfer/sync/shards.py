"""What a rank hands a WeightSync: its local tensors and where each sits in the global tensors.

A source tensor is a DTensor (FSDP2's ``Shard(0)`` parameters, TP's placements: the mesh says which box
this rank holds) or a :class:`Source` (a plain tensor with its global shape and box).  A target tensor is
a :class:`Target`: the live tensor the update lands in, and the pieces of source tensors it is made of --
a plain shard, a replica, or a fused tensor (vLLM's ``qkv_proj``: q, k and v shards stacked).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tensorxfer import dtypes as _dt
from tensorxfer.errors import PlanError
from tensorxfer.sync.spec import Box, Piece, box_of_dtensor, chunk_box, fused_target, replicate_box


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
    """A target rank's live tensor and the source pieces that fill it (pieces tile it exactly)."""

    tensor: Any
    pieces: tuple[Piece, ...]

    @classmethod
    def shard(cls, tensor: Any, source: str, global_shape: Sequence[int], dim: int, rank: int, count: int) -> Target:
        """Shard ``rank`` of ``count`` of global tensor ``source`` along ``dim`` (column / row / vocab parallel)."""
        box = chunk_box(global_shape, dim, rank, count)
        return cls(tensor, (Piece(source, box, (0,) * len(box.sizes)),))

    @classmethod
    def whole(cls, tensor: Any, source: str) -> Target:
        """All of global tensor ``source`` (a replicated weight: norms, biases)."""
        box = replicate_box(tuple(tensor.shape))
        return cls(tensor, (Piece(source, box, (0,) * len(box.sizes)),))

    @classmethod
    def fused(cls, tensor: Any, parts: Sequence[tuple[str, Sequence[int]]], dim: int, rank: int, count: int,
              head_dim: int | None = None) -> Target:
        """Each part's shard, stacked along ``dim`` (see :func:`tensorxfer.sync.fused_target`)."""
        spec = fused_target("fused", parts, dim, rank, count, _dt.from_torch(tensor.dtype).name, 0, head_dim)
        if tuple(tensor.shape) != spec.local_shape:
            raise PlanError(f"fused target: the tensor has shape {tuple(tensor.shape)}, its parts make "
                            f"{spec.local_shape}")
        return cls(tensor, spec.pieces)


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
