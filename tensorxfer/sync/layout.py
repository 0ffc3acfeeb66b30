"""What a rank lays out in its region, and how it describes it to the group.

- A **source** reads the first targets' descriptions: each tensor goes into its region in the dtype the
  targets read it in (fp32 masters cast to bf16 at every push), and where targets want a tensor
  quantized (:mod:`tensorxfer.sync.quantizing`), its FP8 values and the scales of the blocks its shard
  touches go there too, described under their derived names (:func:`tensorxfer.quant.derived_name`).
  A tensor the targets want only quantized needs no plain copy: it is quantized from the trainer's own --
  unless the source's region is on a GPU that targets may share (``inputs``): then the trainer's shard
  (bf16 or float32, 2-D) is adopted into the region too, described as the tensor's ``input``, so that a
  pair on that GPU can quantize it on the way (:mod:`tensorxfer.sync.fusing`); adopted, it costs no memory.
  Such a tensor's blocks that straddle sources are quantized on the way too, each source's part with the
  amax the sources agreed: one float32 per block the shard touches, in one entry (:data:`AMAX_ENTRY`,
  4 bytes per block: ~0.5 MB for 4.5 GB of bf16), described as the tensor's ``amax`` (a box of its scale
  grid); the source writes the agreed ones there at every push (:mod:`tensorxfer.sync.quantizing`).
- A **target**'s region holds its live tensors; a quantized one's scales (``<name>_scale_inv``) beside
  its FP8 values.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tensorxfer import dtypes as _dt
from tensorxfer.binding import tensor_view
from tensorxfer.errors import PlanError
from tensorxfer.manifest import Manifest
from tensorxfer.quant.layout import SEP, Quantization, derived_name
from tensorxfer.sync.quantized_spec import quantized_target
from tensorxfer.sync.quantizing import QuantizedShard, requested
from tensorxfer.sync.shards import Source, Target
from tensorxfer.sync.spec import Box, RankSpec, SourceTensor, TargetTensor

__all__ = ["AMAX_ENTRY", "SourceLayout", "fill_padding", "quantized_shards", "source_layout", "target_description",
           "target_tensors"]

FLOATING = ("F32", "BF16", "F16", "F64")
AMAX_ENTRY = "#quantized.amax"      # the agreed amaxes of every input's blocks (float32, shard after shard)


@dataclass(frozen=True)
class SourceLayout:
    """A source's region layout: ``plain`` shards (name -> Source) at their manifest names, and the
    ``quantized`` ones (global name, layout, Source) at :meth:`local` names."""

    manifest: Manifest
    plain: dict[str, Source]
    quantized: list[tuple[str, Quantization, Source]]
    inputs: dict[str, str] = dataclasses.field(default_factory=dict)   # global name -> its input's entry (own,
    #                                                                    or its plain one)
    amax: dict[str, int] = dataclasses.field(default_factory=dict)     # global name -> its first cell in AMAX_ENTRY

    def amax_at(self, name: str) -> int:
        """The region offset of the agreed amax of global tensor ``name``'s first cell (an input's)."""
        return self.manifest[AMAX_ENTRY].offset + 4 * self.amax[name]

    @staticmethod
    def local(index: int, part: str) -> str:
        """The region entry of the ``index``-th quantized shard's ``part`` (a region's names hold no NUL)."""
        return f"#quantized.{index}.{part}"

    def describe(self, rank: int) -> RankSpec:
        m = self.manifest
        tensors = [SourceTensor(n, s.global_shape, m[n].dtype, s.box, m[n].offset) for n, s in self.plain.items()]
        for i, (n, q, s) in enumerate(self.quantized):
            grid = q.grid(s.global_shape)
            first, count = grid.cells(s.box.offsets, s.box.sizes)
            values, scales = m[self.local(i, "values")], m[self.local(i, "scales")]
            tensors += [SourceTensor(derived_name(n, q, "values"), s.global_shape, values.dtype, s.box, values.offset),
                        SourceTensor(derived_name(n, q, "scales"), grid.scale_shape, scales.dtype, Box(first, count),
                                     scales.offset)]
        asked: dict[str, tuple[Quantization, Source]] = {}     # an input is described under its first layout
        for n, q, s in self.quantized:
            asked.setdefault(n, (q, s))
        for n, entry in self.inputs.items():
            q, s = asked[n]
            tensors.append(SourceTensor(derived_name(n, q, "input"), s.global_shape, m[entry].dtype, s.box,
                                        m[entry].offset))
        for n in self.amax:
            q, s = asked[n]
            grid = q.grid(s.global_shape)
            first, count = grid.cells(s.box.offsets, s.box.sizes)
            tensors.append(SourceTensor(derived_name(n, q, "amax"), grid.scale_shape, "F32", Box(first, count),
                                        self.amax_at(n)))
        return RankSpec("source", rank, tensors)


def source_layout(shards: Mapping[str, Source], targets: list[RankSpec], inputs: bool = False) -> SourceLayout:
    """The region layout of a source holding ``shards``, for the ``targets`` that formed the group; with
    ``inputs``, the adoptable 2-D bf16 / float32 shards that targets want quantized get an input entry.

    Raises PlanError where targets disagree on a tensor's dtype, or ask FP8 of a tensor that cannot be
    (an integer one; blocks that do not fit its shape), naming it.
    """
    wire: dict[str, str] = {}
    for spec in targets:
        for t in spec.tensors:
            for piece in t.pieces:
                if SEP in piece.source_name:
                    continue        # a quantized tensor's values or scales (below)
                seen = wire.setdefault(piece.source_name, t.dtype)
                if seen != t.dtype:
                    raise PlanError(f"source tensor {piece.source_name!r} is wanted as {seen} by one target "
                                    f"tensor and as {t.dtype} by {t.name!r}: targets must agree on its dtype")
    asked = requested(targets)
    plain = {n: s for n, s in shards.items() if n in wire or n not in asked}
    entries = [(n, wire.get(n, _dt.from_torch(s.tensor.dtype).name), s.box.sizes) for n, s in plain.items()]
    quantized: list[tuple[str, Quantization, Source]] = []
    for n in sorted(set(asked) & set(shards)):
        s = shards[n]
        dtype = _dt.from_torch(s.tensor.dtype).name
        if dtype not in FLOATING:
            raise PlanError(f"source tensor {n!r} is {dtype}: targets ask it quantized to FP8, which needs a "
                            f"floating-point tensor")
        for q in sorted(asked[n], key=lambda q: q.tag):
            try:
                cells = q.grid(s.global_shape).cells(s.box.offsets, s.box.sizes)[1]
            except PlanError as e:
                raise PlanError(f"source tensor {n!r}: targets ask it as {q}: {e}") from None
            entries += [(SourceLayout.local(len(quantized), "values"), q.values_dtype, s.box.sizes),
                        (SourceLayout.local(len(quantized), "scales"), q.scale_dtype, cells)]
            quantized.append((n, q, s))
    names: dict[str, str] = {}
    if inputs:
        for n in dict.fromkeys(n for n, _, _ in quantized):
            s = shards[n]
            dtype = _dt.from_torch(s.tensor.dtype).name
            if not (s.adopt and dtype in ("BF16", "F32") and len(s.box.sizes) == 2):
                continue
            if n in plain:      # also served plain: its entry is the input where it holds the trainer's dtype
                if wire.get(n, dtype) == dtype:
                    names[n] = n
                continue
            names[n] = f"#quantized.input.{len(names)}"
            entries.append((names[n], dtype, s.box.sizes))
    amax: dict[str, int] = {}
    total = 0
    first_layout = {n: q for n, q, _ in reversed(quantized)}
    for n in names:
        s = shards[n]
        amax[n] = total
        total += math.prod(first_layout[n].grid(s.global_shape).cells(s.box.offsets, s.box.sizes)[1])
    if names:
        entries.append((AMAX_ENTRY, "F32", (total,)))
    return SourceLayout(Manifest.layout(entries), plain, quantized, names, amax)


def quantized_shards(layout: SourceLayout, region: Any) -> tuple[list[QuantizedShard], Any]:
    """A source's quantized shards over their entries of ``region`` (a TensorRegion laid out as ``layout``), an
    input's first layout with its place among the agreed amaxes; and their entry (a float32 view), or None."""
    m = layout.manifest
    shards = [QuantizedShard(n, s.global_shape, s.box.offsets, q, s.tensor,
                             tensor_view(region, m[layout.local(i, "values")]),
                             tensor_view(region, m[layout.local(i, "scales")]))
              for i, (n, q, s) in enumerate(layout.quantized)]
    firsts = dict(layout.amax)
    for shard in shards:
        shard.agreed_at = firsts.pop(shard.name, None)
    return shards, tensor_view(region, m[AMAX_ENTRY]) if AMAX_ENTRY in m else None


def target_tensors(shards: Mapping[str, Target]) -> dict[str, Any]:
    """The live tensors a target's region adopts: its tensors, and a quantized one's scales as
    ``<name>_scale_inv``."""
    live = {n: t.tensor for n, t in shards.items()}
    for n, t in shards.items():
        if t.quantization is not None:
            if f"{n}_scale_inv" in live:
                raise PlanError(f"target tensor {n!r}: its scales are named {n + '_scale_inv'!r}, which is another "
                                f"target tensor's name")
            live[f"{n}_scale_inv"] = t.scales
    return live


def fill_padding(shards: Mapping[str, Target]) -> None:
    """Zero every filled piece (padding no source holds) of the targets' tensors, once."""
    for t in shards.values():
        for piece in t.pieces:
            if piece.is_filled:
                t.tensor[tuple(slice(a, a + k) for a, k in zip(piece.at, piece.local_sizes))].zero_()


def target_description(shards: Mapping[str, Target], manifest: Manifest, rank: int) -> RankSpec:
    """A target's description, once its region (:func:`target_tensors`) holds its tensors."""
    described: list[TargetTensor] = []
    for n, t in shards.items():
        values = TargetTensor(n, tuple(t.tensor.shape), manifest[n].dtype, manifest[n].offset, tuple(t.pieces))
        if t.quantization is None:
            described.append(values)
            continue
        assert t.global_shapes is not None
        scales = manifest[f"{n}_scale_inv"]
        described.extend(quantized_target(values, t.global_shapes, t.quantization, scales.name, scales.shape,
                                          scales.offset))
    return RankSpec("target", rank, described)
