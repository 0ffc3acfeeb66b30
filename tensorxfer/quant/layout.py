"""How a quantized weight is laid out: its blocks, its scales, and the formula that makes them.

A :class:`Quantization` says how an engine stores a weight: FP8 (``float8_e4m3fn``) values of the
weight's own shape, plus one scale per *block* of it, in a scale tensor laid out as the block grid.
The shapes FP8 checkpoints and engines use:

==============================  ===================  ==================================================
layout                          ``block``            scale tensor of a ``[N, K]`` weight
==============================  ===================  ==================================================
DeepSeek-V3 / Qwen3-FP8 blocks  ``(128, 128)``       ``weight_scale_inv`` F32 ``[ceil(N/128), ceil(K/128)]``
per token-group (1 x 128)       ``(1, 128)``         F32 ``[N, ceil(K/128)]``
per output channel              ``(1, None)``        F32 ``[N, 1]``
per tensor                      ``per_tensor()``     F32 ``[1]``
MXFP8 (power-of-two scales)     ``(1, 32)``, e8m0    F8_E8M0 (one byte, 2**(b-127)) ``[N, ceil(K/32)]``
==============================  ===================  ==================================================

``block`` covers the trailing dimensions (``None``: the whole dimension); leading ones (stacked
experts) are blocks of 1.  Blocks are counted from the global tensor's origin, so a shard whose
edges do not fall on block edges shares its edge blocks with the shard next to it.

The stored scale is the *inverse* scale (``weight = fp8 * scale_inv``), as those checkpoints and
vLLM / SGLang keep it.  Two formulas, each bit-identical to the code a user already trusts (all
arithmetic in float32; ``amax``: the largest ``|x|`` of the block, exact; the cast to FP8 rounds to
nearest, ties to even, after a clamp to +-448 so the result never depends on a torch version's
overflow rule):

- ``"transformers"`` (default) -- Hugging Face transformers' fine-grained FP8 quantizer
  (``integrations.finegrained_fp8.Fp8Quantize``): ``s = 448 / amax`` (1 for an all-zero block; torch
  evaluates a number over a tensor as ``448 * (1 / amax)``, two roundings, and so do we),
  ``fp8 = cast(clamp(x * s))``, ``scale_inv = 1 / s``.  With ``scale="e8m0"``:
  ``scale_inv = 2 ** ceil(log2(1 / s))``, ``s = 1 / scale_inv``.
- ``"deepgemm"`` -- DeepGEMM's ``per_block_cast_to_fp8`` (vLLM and SGLang use it):
  ``scale_inv = max(amax, 1e-4) / 448``, ``fp8 = cast(clamp(x * (1 / scale_inv)))``.  With
  ``scale="e8m0"``: ``scale_inv`` is rounded up to a power of two on its bits (``ceil_to_ue8m0``).

Where transformers refuses to quantize (a dimension that is not a multiple of its block: it leaves
the weight unquantized), both formulas quantize the partial edge blocks over the elements they have,
as DeepGEMM's zero padding does.  A NaN or an infinity in a weight is an error naming the tensor:
no formula gives an engine a usable value for it.  ``scale="e8m0"`` scales are powers of two at or
above ``amax / 448``, so nothing saturates (torchao's default MXFP8 rounding, FLOOR, saturates instead
and gives other bytes).

A quantized global tensor becomes two *derived* tensors that a sync plans like any other: its FP8
values (:func:`derived_name` ``(name, q, "values")``) and its scales (``"scales"``), in global block
coordinates.  Their names carry the layout, so a plan's digest covers it, and a target asking another
layout than the sources make finds no source for it (a refusal before any byte moves).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tensorxfer.errors import PlanError

__all__ = ["FORMULAS", "FP8_MAX", "SCALES", "Grid", "Quantization", "derived_name", "parse_derived"]

FP8_MAX = 448.0                 # float8_e4m3fn's largest finite value
FORMULAS = ("transformers", "deepgemm")
SCALES = {"float": "F32", "e8m0": "F8_E8M0"}    # scale encoding -> the scale tensor's dtype
SEP = "\x00"                    # derived names: never part of a name a user gives (spec refuses it)
# input: a source's shard in its region, for tiles (sync.fusing); amax: the amaxes it agreed of the blocks it shares
PARTS = ("values", "scales", "input", "amax")


def _block_size(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise PlanError(f"a block size is an int >= 1 or None (the whole dimension), got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise PlanError(f"a block size is an int >= 1 or None (the whole dimension), got {value!r}") from None
    if not 1 <= number <= 1 << 40:
        raise PlanError(f"a block size is an int >= 1 or None (the whole dimension), got {value!r}")
    return number


@dataclass(frozen=True)
class Quantization:
    """A weight stored as FP8 values plus one scale per block (see the module docstring).

    ``block``: sizes over the trailing dimensions (``None``: the whole dimension), or ``()`` for one
    scale per tensor.  ``formula``: ``"transformers"`` or ``"deepgemm"``.  ``scale``: ``"float"``
    (float32 ``scale_inv``) or ``"e8m0"`` (one byte, a power of two).
    """

    block: tuple[int | None, ...] = (128, 128)
    formula: str = "transformers"
    scale: str = "float"

    def __post_init__(self) -> None:
        try:
            block = tuple(self.block)
        except TypeError:
            raise PlanError(f"block must be a tuple of block sizes, got {self.block!r}") from None
        if len(block) > 8:
            raise PlanError(f"block {block} has more dimensions than a tensor may have (8)")
        object.__setattr__(self, "block", tuple(_block_size(b) for b in block))
        if self.formula not in FORMULAS:
            raise PlanError(f"quantization formula {self.formula!r} is not one of {', '.join(FORMULAS)}")
        if self.scale not in SCALES:
            raise PlanError(f"scale encoding {self.scale!r} is not one of {', '.join(SCALES)}")

    # the layouts of the module docstring's table
    @classmethod
    def blocks(cls, rows: int = 128, cols: int = 128, formula: str = "transformers") -> Quantization:
        """``rows x cols`` blocks over the last two dimensions, float32 ``scale_inv``."""
        return cls((rows, cols), formula)

    @classmethod
    def per_channel(cls, formula: str = "transformers") -> Quantization:
        """One scale per output channel (row): a ``[N, 1]`` scale tensor."""
        return cls((1, None), formula)

    @classmethod
    def per_tensor(cls, formula: str = "transformers") -> Quantization:
        """One scale for the whole global tensor (its sources agree on its amax within the step)."""
        return cls((), formula)

    @classmethod
    def mxfp8(cls, formula: str = "deepgemm") -> Quantization:
        """MXFP8: ``1 x 32`` blocks with power-of-two (e8m0) scales."""
        return cls((1, 32), formula, "e8m0")

    @property
    def values_dtype(self) -> str:
        return "F8_E4M3"

    @property
    def scale_dtype(self) -> str:
        return SCALES[self.scale]

    @property
    def tag(self) -> str:
        """A stable text naming the layout (part of derived names, hence of a plan's digest)."""
        block = "tensor" if not self.block else "x".join("all" if b is None else str(b) for b in self.block)
        return f"F8_E4M3/{block}/{self.formula}/{self.scale}"

    @classmethod
    def from_tag(cls, tag: str) -> Quantization:
        parts = tag.split("/")
        if len(parts) != 4 or parts[0] != "F8_E4M3":
            raise PlanError(f"not a quantization layout: {tag!r}")
        try:
            block = () if parts[1] == "tensor" else tuple(None if b == "all" else int(b) for b in parts[1].split("x"))
        except ValueError:
            raise PlanError(f"not a quantization layout: {tag!r}") from None
        found = cls(block, parts[2], parts[3])
        if found.tag != tag:
            raise PlanError(f"not a quantization layout in canonical form: {tag!r}")
        return found

    def __str__(self) -> str:
        block = ("one scale per tensor" if not self.block else
                 "x".join("all" if b is None else str(b) for b in self.block) + " blocks")
        return f"FP8 E4M3, {block}, {self.formula} formula, {self.scale} scales"

    def grid(self, shape: Sequence[int]) -> Grid:
        """The block grid of a global tensor of ``shape``; PlanError where the layout does not fit it."""
        shape = tuple(int(s) for s in shape)
        if not self.block:
            return Grid(shape, shape, per_tensor=True)
        if len(self.block) > len(shape):
            raise PlanError(f"{len(self.block)}-dimensional blocks {self.block} do not fit a tensor of shape {shape}")
        lead = len(shape) - len(self.block)
        blocks = (1,) * lead + tuple(s if b is None else min(b, s) if s else b
                                     for b, s in zip(self.block, shape[lead:]))
        return Grid(shape, tuple(max(b, 1) for b in blocks), per_tensor=False)


@dataclass(frozen=True)
class Grid:
    """The blocks of one global tensor: ``block[d]`` elements per block along dimension ``d``."""

    shape: tuple[int, ...]
    block: tuple[int, ...]
    per_tensor: bool = False

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """The scale tensor's shape: the grid's (``(1,)`` for one scale per tensor)."""
        if self.per_tensor:
            return (1,)
        return tuple(-(-s // b) for s, b in zip(self.shape, self.block))

    def cells(self, offsets: Sequence[int], sizes: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The blocks a box of the tensor touches: (first block, count) per dimension of the grid."""
        if any(s == 0 for s in sizes):
            return tuple(0 for _ in self.scale_shape), tuple(0 for _ in self.scale_shape)
        if self.per_tensor:
            return (0,), (1,)
        first = tuple(o // b for o, b in zip(offsets, self.block))
        last = tuple(-(-(o + s) // b) for o, s, b in zip(offsets, sizes, self.block))
        return first, tuple(e - f for f, e in zip(first, last))

    def whole(self, offsets: Sequence[int], sizes: Sequence[int]) -> tuple[tuple[bool, bool], ...]:
        """Per dimension, whether the box's first and last block lie wholly inside it (a block is
        clipped to the tensor's end: a shorter edge block is whole when the box reaches that end)."""
        if self.per_tensor:
            whole = all(o == 0 and s == n for o, s, n in zip(offsets, sizes, self.shape))
            return ((whole, whole),)
        return tuple((_inside(o // b, b, o, o + s, n), _inside((o + s - 1) // b, b, o, o + s, n))
                     for o, s, b, n in zip(offsets, sizes, self.block, self.shape))

    def aligned(self, offsets: Sequence[int], sizes: Sequence[int]) -> str | None:
        """Why a target piece of this box cannot hold whole blocks (None: it starts and ends on block
        edges, or at the tensor's end), so that its scales are a box of the scale grid."""
        if self.per_tensor:
            if tuple(offsets) == (0,) * len(self.shape) and tuple(sizes) == self.shape:
                return None
            return "one scale per tensor needs the whole tensor in one piece"
        for d, (o, s, b, n) in enumerate(zip(offsets, sizes, self.block, self.shape)):
            if o % b:
                return f"dimension {d} starts at {o}, not on a block edge (blocks of {b})"
            if (o + s) % b and o + s != n:
                return f"dimension {d} ends at {o + s}, neither on a block edge (blocks of {b}) nor at its end {n}"
        return None


def _inside(j: int, b: int, start: int, end: int, n: int) -> bool:
    """Whether block ``j`` (of ``b`` elements, clipped to ``n``) lies within ``[start, end)``."""
    return j * b >= start and min((j + 1) * b, n) <= end


def derived_name(name: str, q: Quantization, part: str) -> str:
    """The name of global tensor ``name``'s FP8 ``"values"`` or ``"scales"`` in layout ``q``."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    return f"{name}{SEP}{q.tag}{SEP}{part}"


def parse_derived(name: str) -> tuple[str, Quantization, str] | None:
    """``(global name, layout, part)`` of a derived name, None for a plain one."""
    if SEP not in name:
        return None
    base, tag, part = [*name.split(SEP), "", ""][:3]
    if part not in PARTS or name.count(SEP) != 2 or not base:
        raise PlanError(f"malformed quantized tensor name {name!r}")
    return base, Quantization.from_tag(tag), part


def describe(name: str) -> str:
    """A name for messages: a derived name as ``'w' (FP8 E4M3, 128x128 blocks, ...): its scales``."""
    try:
        found = parse_derived(name)
    except PlanError:
        return repr(name)
    if found is None:
        return repr(name)
    base, q, part = found
    what = {"values": "FP8 values", "input": "input", "amax": "agreed amaxes"}.get(part, part)
    return f"{base!r} ({q}): its {what}"
