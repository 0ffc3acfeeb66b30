"""The description of a quantized target: its FP8 values and its scales, as two target tensors whose
pieces name the derived tensors the sources quantize (:func:`tensorxfer.quant.derived_name`).  Pure,
like :mod:`tensorxfer.sync.spec`, which it builds on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tensorxfer.errors import PlanError
from tensorxfer.quant.layout import Quantization, derived_name
from tensorxfer.sync.spec import Box, Piece, TargetTensor, _ints

__all__ = ["quantized_target"]


def quantized_target(values: TargetTensor, global_shapes: Sequence[Sequence[int]], q: Quantization, scale_name: str,
                     scale_shape: Sequence[int], scale_offset: int) -> tuple[TargetTensor, TargetTensor]:
    """The two tensors of an FP8 target: its values (``values``, dtype F8_E4M3, whose pieces name plain
    source tensors of ``global_shapes``, one per piece) and its scales (``scale_name``, of ``scale_shape``
    in the layout's scale dtype, at ``scale_offset``), each piece renamed to the derived tensor the
    sources quantize (:func:`tensorxfer.quant.derived_name`).

    The scale tensor is the values' block grid: the layout's blocks over the trailing dimensions of the
    target tensor (leading ones: blocks of 1), so a piece must start on a block edge, both in its source
    tensor and in the target, and end on one or at its source's end (vLLM refuses other TP splits of
    block-quantized weights too); along a whole-dimension block (per channel) any split is fine.  With
    one scale per tensor, ``scale_shape`` holds one scale per piece, in piece order.

    Raises
    ------
    PlanError
        Naming the tensor and what does not fit (a misaligned piece, a scale tensor of the wrong shape or
        dtype, FP8 values of another dtype).
    """
    if not isinstance(q, Quantization):
        raise PlanError(f"target tensor {values.name!r}: the quantization must be a Quantization, got {q!r}")
    if values.dtype != q.values_dtype:
        raise PlanError(f"target tensor {values.name!r} is {values.dtype}; {q} values are {q.values_dtype}")
    shapes = [_ints(s, f"global shape of a piece of {values.name!r}") for s in global_shapes]
    if len(shapes) != len(values.pieces):
        raise PlanError(f"target tensor {values.name!r}: {len(values.pieces)} pieces but {len(shapes)} global shapes")
    if any(p.is_filled for p in values.pieces):
        raise PlanError(f"target tensor {values.name!r}: padding (a filled piece) in a quantized target is not "
                        f"supported: serve padded tensors (vocab-parallel embeddings, heads) unquantized")
    scale_shape = _ints(scale_shape, f"scale shape of {values.name!r}")
    local = values.local_shape
    if not q.block:
        if math.prod(scale_shape) != len(values.pieces):
            raise PlanError(f"target tensor {values.name!r}: one scale per tensor needs a scale tensor of "
                            f"{len(values.pieces)} element(s) (one per piece), not {scale_shape}")
        cells = [(Box((0,), (1,)), tuple(int(i) for i in _unravel(k, scale_shape)))
                 for k in range(len(values.pieces))]
    else:
        if len(q.block) > len(local):
            raise PlanError(f"target tensor {values.name!r} of shape {local} has fewer dimensions than the "
                            f"{len(q.block)}-dimensional blocks of {q}")
        lead = len(local) - len(q.block)
        # the target's own blocks: the layout's over its trailing dimensions, a whole-dimension block (None)
        # is the target's whole dimension
        target_block = (1,) * lead + tuple(n if b is None else b for b, n in zip(q.block, local[lead:]))
        want = tuple(-(-n // b) if n else 0 for n, b in zip(local, target_block))
        if scale_shape != want:
            raise PlanError(f"target tensor {values.name!r}: its scale tensor has shape {scale_shape}; {q} of its "
                            f"{local} values needs {want}")
        cells = []
        for piece, shape in zip(values.pieces, shapes):
            box = piece.source_box
            if not box.within(shape):
                raise PlanError(f"target tensor {values.name!r}: piece {box} is outside {piece.source_name!r}'s "
                                f"global shape {shape}")
            grid = q.grid(shape)
            lead_src = box.ndim - len(q.block)
            for d, (o, n, b) in enumerate(zip(box.offsets, box.sizes, grid.block)):
                if d >= lead_src and q.block[d - lead_src] is None:
                    continue        # a whole-dimension block: one scale across it, any split
                t = len(local) - box.ndim + d
                if o % b or piece.at[t] % target_block[t] or ((o + n) % b and o + n != shape[d]):
                    raise PlanError(
                        f"target tensor {values.name!r}: the piece of {piece.source_name!r} at {box} placed at "
                        f"{piece.at} does not hold whole blocks along dimension {d} (blocks of {b}; {q}): "
                        f"shard it on block edges, as engines do")
            first, count = grid.cells(box.offsets, box.sizes)
            at = tuple(a // b for a, b in zip(piece.at, target_block))
            cells.append((Box(first, count), at))
    renamed = tuple(Piece(derived_name(p.source_name, q, "values"), p.source_box, p.at) for p in values.pieces)
    scale_pieces = tuple(Piece(derived_name(p.source_name, q, "scales"), box, at)
                         for p, (box, at) in zip(values.pieces, cells))
    return (TargetTensor(values.name, local, values.dtype, values.region_offset, renamed),
            TargetTensor(scale_name, scale_shape, q.scale_dtype, scale_offset, scale_pieces))


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        index, r = divmod(index, n)
        out.append(r)
    return tuple(reversed(out))
