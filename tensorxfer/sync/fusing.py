"""A weight-sync pair on one GPU quantizes on the way: its planned FP8 runs become quantizing tiles.

The planner moves FP8 bytes that a source quantized into its own region (:mod:`tensorxfer.sync.quantizing`).
Where the source and the target share a GPU, the pair's copy runs there anyway (:mod:`tensorxfer.transport.ipc`
maps the source's region), so for every block the source holds whole, the copy reads the source's input
(the trainer's bf16 or float32 shard, adopted into the source's region) and writes the FP8 values and the
scale straight into the target (:mod:`tensorxfer.quant.tiles`): the source never writes them, nothing reads
them back.  A block that straddles sources is a tile of each source's part of it, which takes the block's
amax from the source's region: the sources still agree on it in their store round, and each writes the
agreed amaxes there (one host-to-device copy, no kernel: :mod:`tensorxfer.sync.quantizing`) before it
offers those tiles (:func:`parts`).  Why there, and not by sending those rows in bf16 for the target to
finish: the target would need a staging buffer and a kernel of its own, in a process of its own -- the GPU
time-slices between processes, and every source kernel in a step measurably waited behind the copy host's
tiles (``benchmarks/results/2026-12-06-fp8-parts``); this way the copy host's context does all the GPU work.

:func:`fuse` is pure and runs on both ends of a pair, from the same plan and the same source description, so
both make the same tiles (the pair's runs digest covers them: a disagreement fails the step, never a byte).
A tensor whose runs in this pair do not map to boxes of the source's shard (never, for plans of 2-D shards)
stays whole on the source path; :attr:`FusedPair.fused` names the tensors a pair fused, and a source
quantizes a tensor only if some pair reading it did not fuse it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tensorxfer import dtypes as _dt
from tensorxfer.quant import kernel, tiles
from tensorxfer.quant.layout import Grid, Quantization, parse_derived
from tensorxfer.sync.plan import Plan
from tensorxfer.sync.spec import RankSpec, SourceTensor
from tensorxfer.transport.ipc.identity import unavailable as ipc_unavailable
from tensorxfer.transport.segments import Segments

__all__ = ["Fusable", "FusedPair", "early", "feeds", "fusable", "fuse", "fused_names", "fuses_on", "pairs_of", "parts",
           "segments_of"]

INPUT_DTYPES = {"BF16": 0, "F32": 1}


@dataclass(frozen=True)
class Fusable:
    """One quantized shard of a source whose blocks a pair on its GPU can quantize: where its input, FP8
    values, scales and agreed amaxes lie in the source's region, and its block grid."""

    values_name: str
    q: Quantization
    grid: Grid
    offsets: tuple[int, int]            # the shard's global offsets
    sizes: tuple[int, int]
    input_offset: int
    input_dtype: int                    # 0 bf16, 1 float32 (the tile's dtype column)
    values_offset: int
    scales_offset: int
    scale_bytes: int
    first: tuple[int, int]              # the first cell the shard touches (global cell coordinates)
    count: tuple[int, int]
    amax_offset: int                    # the agreed amax of its first cell (float32, cells row-major)

    @property
    def values_end(self) -> int:
        return self.values_offset + self.sizes[0] * self.sizes[1]

    @property
    def scales_end(self) -> int:
        return self.scales_offset + self.count[0] * self.count[1] * self.scale_bytes


def fusable(spec: RankSpec) -> dict[str, Fusable]:
    """The source's quantized shards (by their values' derived name) that quantizing tiles can make: 2-D, blocks
    of at least 8 rows, a formula the kernel computes, a bf16 or float32 input in the region, and their blocks'
    agreed amaxes there (float32, one per cell the shard touches)."""
    parts: dict[tuple[str, str], dict[str, SourceTensor]] = {}
    inputs: dict[str, SourceTensor] = {}
    for t in spec.tensors:
        found = parse_derived(t.name)
        if found is None:
            continue
        base, q, part = found
        if part == "input":
            inputs[base] = t
        else:
            parts.setdefault((base, q.tag), {})[part] = t
    out: dict[str, Fusable] = {}
    for (base, tag), got in parts.items():
        values, scales, amax, inp = got.get("values"), got.get("scales"), got.get("amax"), inputs.get(base)
        if values is None or scales is None or amax is None or inp is None:
            continue
        q = Quantization.from_tag(tag)
        shape = tuple(values.global_shape)
        if len(shape) != 2 or (q.formula, q.scale) not in kernel.FORMULAS or inp.dtype not in INPUT_DTYPES:
            continue
        grid = q.grid(shape)
        if grid.per_tensor or grid.block[0] < 8 or inp.box != values.box:
            continue
        box = values.box
        first, count = grid.cells(box.offsets, box.sizes)
        if amax.dtype != "F32" or amax.box.offsets != tuple(first) or amax.box.sizes != tuple(count):
            continue
        (o0, o1), (s0, s1) = box.offsets, box.sizes
        out[values.name] = Fusable(
            values.name, q, grid, (o0, o1), (s0, s1), inp.region_offset,
            INPUT_DTYPES[inp.dtype], values.region_offset, scales.region_offset,
            _dt.DTYPES[q.scale_dtype].itemsize, tuple(first), tuple(count),  # type: ignore[arg-type]
            amax.region_offset)
    return out


@dataclass(frozen=True)
class FusedPair:
    """A pair's segments with its quantizing tiles; the quantized tensors (values names) the pair reads,
    and those it fused (their whole blocks made by the tiles)."""

    segments: Segments
    read: frozenset[str]
    fused: frozenset[str]


# A box of a shard's values (or of its cells): rows [r, r + h) x columns [c, c + w), its first element at
# byte dst of the target, rows dst_pitch bytes apart.
_Box = tuple[int, int, int, int, int, int]


def _boxes(off: int, nbytes: int, count: int, src_stride: int, dst: int, dst_stride: int, cols: int,
           size: int) -> list[_Box] | None:
    """The boxes a group covers in an entry of ``cols`` columns of ``size``-byte elements (``off``: bytes from
    its start): a plain run is cut into its partial first row, its whole rows and its partial last row (the
    planner shares a replicated row of scales between sources anywhere); None if the group is no such thing."""
    if off % size or nbytes % size or (count > 1 and src_stride % size):
        return None
    r, c = divmod(off // size, cols)
    n = nbytes // size
    if count > 1:
        if c + n <= cols and src_stride == cols * size:
            return [(r, c, count, n, dst, dst_stride)]
        if c == 0 and n % cols == 0 and src_stride == nbytes and dst_stride == nbytes:
            return [(r, 0, n // cols * count, cols, dst, cols * size)]
        return None
    out = []
    if c:       # the partial first row
        k = min(n, cols - c)
        out.append((r, c, 1, k, dst, k * size))
        r, n, dst = r + 1, n - k, dst + k * size
    if n >= cols:
        out.append((r, 0, n // cols, cols, dst, cols * size))
        r, dst, n = r + n // cols, dst + n // cols * cols * size, n % cols
    if n:
        out.append((r, 0, 1, n, dst, n * size))
    return out


def _block_tiles(f: Fusable, index: int, gi: np.ndarray,
                 gj: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tiles of cells (``gi``, ``gj``: global cell coordinates) that write nothing yet: each reads the shard's
    part of its block -- all of it, or of a block the shard shares with other sources its own rows and
    columns, with the agreed amax; plus, past the table's columns, the cell's flat local index and the
    tensor's index.  Also the global row and column of each part's first element."""
    (bm, bn), (o0, o1), (n0, n1), (s0, s1) = f.grid.block, f.offsets, f.grid.shape, f.sizes
    end0, end1 = np.minimum(gi * bm + bm, n0), np.minimum(gj * bn + bn, n1)      # the blocks, clipped to the tensor
    whole = (gi * bm >= o0) & (end0 <= o0 + s0) & (gj * bn >= o1) & (end1 <= o1 + s1)
    top, left = np.maximum(gi * bm, o0), np.maximum(gj * bn, o1)                  # ... and to the shard
    bottom, right = np.minimum(end0, o0 + s0), np.minimum(end1, o1 + s1)
    size = tiles.INPUT_SIZES[f.input_dtype]
    cell = (gi - f.first[0]) * f.count[1] + (gj - f.first[1])
    t = np.zeros((len(gi), tiles.WIDTH + 2), np.int64)
    t[:, tiles.SRC] = f.input_offset + ((top - o0) * s1 + (left - o1)) * size
    t[:, tiles.SRC_PITCH] = s1 * size
    t[:, tiles.ROWS], t[:, tiles.COLS] = bottom - top, right - left
    t[:, tiles.SCALE] = -1
    t[:, tiles.DTYPE] = f.input_dtype
    t[:, tiles.FORMULA] = kernel.FORMULAS[(f.q.formula, f.q.scale)]
    t[:, tiles.AMAX] = np.where(whole, -1, f.amax_offset + 4 * cell)
    t[:, tiles.WIDTH] = cell
    t[:, tiles.WIDTH + 1] = index
    return t, top, left


def _value_tiles(f: Fusable, index: int, b: _Box) -> np.ndarray:
    """The tiles of box ``b`` (local elements): each writes the part of its block inside ``b``."""
    r, c, h, w, dst, pitch = b
    (bm, bn), (o0, o1) = f.grid.block, f.offsets
    gi = np.arange((o0 + r) // bm, (o0 + r + h - 1) // bm + 1, dtype=np.int64)
    gj = np.arange((o1 + c) // bn, (o1 + c + w - 1) // bn + 1, dtype=np.int64)
    gi, gj = (a.reshape(-1) for a in np.meshgrid(gi, gj, indexing="ij"))
    t, top, left = _block_tiles(f, index, gi, gj)
    lr0 = np.maximum(o0 + r, top)                # the clip's first global row / column
    lc0 = np.maximum(o1 + c, left)
    lr1 = np.minimum(o0 + r + h, top + t[:, tiles.ROWS])
    lc1 = np.minimum(o1 + c + w, left + t[:, tiles.COLS])
    t[:, tiles.DST] = dst + (lr0 - o0 - r) * pitch + (lc0 - o1 - c)
    t[:, tiles.DST_PITCH] = pitch
    t[:, tiles.R0], t[:, tiles.R1] = lr0 - top, lr1 - top
    t[:, tiles.C0], t[:, tiles.C1] = lc0 - left, lc1 - left
    return t


def _scale_only(f: Fusable, index: int, cells: np.ndarray) -> np.ndarray:
    """Tiles that write only the scale of ``cells`` (flat local indices): the block's part read for its amax."""
    return _block_tiles(f, index, cells // f.count[1] + f.first[0], cells % f.count[1] + f.first[1])[0]


def _cut_at(segments: Segments, edges: np.ndarray) -> tuple[np.ndarray, ...]:
    """The groups' columns (int64), each plain run that crosses one of ``edges`` (source offsets) cut there:
    the planner merges runs contiguous in both regions, across tensors too (a tensor's FP8 values and its
    scales, laid end to end on both sides, are one run)."""
    cols = [a.astype(np.int64) for a in (segments.src_off, segments.dst_off, segments.nbytes, segments.count,
                                         segments.src_stride, segments.dst_stride)]
    so, do, nb, ct = cols[:4]
    first = np.searchsorted(edges, so, side="right")
    last = np.searchsorted(edges, so + nb, side="left")
    crossing = np.flatnonzero((ct == 1) & (last > first))
    if not len(crossing):
        return tuple(cols)
    keep = np.ones(len(so), bool)
    keep[crossing] = False
    pieces = []
    for i in crossing:
        cut = [int(so[i]), *edges[first[i]:last[i]].tolist(), int(so[i] + nb[i])]
        for a, b in itertools.pairwise(cut):
            pieces.append((a, int(do[i]) + a - int(so[i]), b - a, 1, 0, 0))
    extra = np.array(pieces, np.int64).T
    return tuple(np.concatenate([c[keep], e]) for c, e in zip(cols, extra))


def fuse(segments: Segments, found: dict[str, Fusable], enabled: bool = True) -> FusedPair:
    """Pair ``segments`` (source region -> target region) with the runs of the fusable shards ``found``
    (:func:`fusable` of the pair's source) that fall in whole blocks turned into quantizing tiles (not
    ``enabled``: the segments as they are, and which of ``found`` they read)."""
    entries = sorted([(f.values_offset, f.values_end, f, "values") for f in found.values()] +
                     [(f.scales_offset, f.scales_end, f, "scales") for f in found.values()], key=lambda e: e[0])
    if not entries or not len(segments):
        return FusedPair(segments, frozenset(), frozenset())
    starts = np.array([e[0] for e in entries], np.int64)
    ends = np.array([e[1] for e in entries], np.int64)
    so, do, nb, ct, ss, ds = _cut_at(segments, np.unique(np.concatenate([starts, ends])))
    last = so + (ct - 1) * ss + nb
    at = np.searchsorted(starts, so, side="right") - 1
    inside = (at >= 0) & (last <= ends[np.maximum(at, 0)])
    nxt = np.searchsorted(starts, so, side="right")
    touches = inside | ((at >= 0) & (so < ends[np.maximum(at, 0)])) | \
        ((nxt < len(starts)) & (last > starts[np.minimum(nxt, len(starts) - 1)]))
    read: set[str] = set()
    broken: set[str] = set()
    boxes: dict[str, dict[str, list[_Box]]] = {}
    for i in np.flatnonzero(touches):
        if not inside[i]:       # a run across an entry's edge: every entry it touches stays on the source path
            for k in range(len(entries)):
                if so[i] < ends[k] and last[i] > starts[k]:
                    read.add(entries[k][2].values_name)
                    broken.add(entries[k][2].values_name)
            continue
        start, _, f, part = entries[int(at[i])]
        read.add(f.values_name)
        cols, size = (f.sizes[1], 1) if part == "values" else (f.count[1], f.scale_bytes)
        found_boxes = _boxes(int(so[i] - start), int(nb[i]), int(ct[i]), int(ss[i]), int(do[i]), int(ds[i]), cols,
                             size)
        if found_boxes is None:
            broken.add(f.values_name)
        else:
            boxes.setdefault(f.values_name, {"values": [], "scales": []})[part].extend(found_boxes)
    fused = sorted(set(boxes) - broken) if enabled else []
    if not fused:
        return FusedPair(segments, frozenset(read), frozenset())
    keep = ~touches
    for i in np.flatnonzero(touches):       # the groups of tensors left on the source path stay as they were
        if inside[i] and entries[int(at[i])][2].values_name in broken:
            keep[i] = True
    keep |= touches & ~inside
    made: list[np.ndarray] = []
    names = tuple(fused)
    for index, name in enumerate(names):
        f = found[name]
        mine = [_value_tiles(f, index, b) for b in boxes[name]["values"]]
        t = np.concatenate(mine) if mine else np.zeros((0, tiles.WIDTH + 2), np.int64)
        for r, c, h, w, dst, pitch in boxes[name]["scales"]:
            ci, cj = (a.reshape(-1) for a in np.meshgrid(np.arange(r, r + h), np.arange(c, c + w), indexing="ij"))
            cells = ci * f.count[1] + cj
            where = dst + (ci - r) * pitch + (cj - c) * f.scale_bytes
            order = np.argsort(t[:, tiles.WIDTH], kind="stable")
            pos = np.searchsorted(t[order, tiles.WIDTH], cells)
            hit = pos < len(t)
            hit[hit] = t[order[pos[hit]], tiles.WIDTH] == cells[hit]
            hit[hit] = t[order[pos[hit]], tiles.SCALE] < 0      # one scale per tile (a repeat makes its own)
            t[order[pos[hit]], tiles.SCALE] = where[hit]
            if (~hit).any():
                extra = _scale_only(f, index, cells[~hit])
                extra[:, tiles.SCALE] = where[~hit]
                t = np.concatenate([t, extra])
        made.append(t)
    table = np.concatenate(made)
    kept = [a[keep] for a in (so, do, nb, ct, ss, ds)]
    bases = tuple(str(parse_derived(n)[0]) for n in names)     # type: ignore[index]
    qt = tiles.QuantTiles(np.ascontiguousarray(table[:, :tiles.WIDTH]), table[:, tiles.WIDTH + 1].astype(np.int32),
                          bases)
    final = [np.ascontiguousarray(k.astype(np.uint64)) for k in kept]
    out = Segments(final[0], final[1], final[2], final[3], final[4], final[5], tiles=qt)
    return FusedPair(out, frozenset(read), frozenset(fused))


def fused_names(pairs: Sequence[FusedPair]) -> set[str]:
    """The tensors (values names) every pair that reads them fused: the source makes none of their FP8."""
    read: set[str] = set()
    unfused: set[str] = set()
    for p in pairs:
        read |= p.read
        unfused |= p.read - p.fused
    return read - unfused


def fuses_on(cuda: bool, transport: str, run_tiles: bool = False) -> bool:
    """Whether a rank's pairs may quantize on the way on its GPU: a GPU region, ipc allowed and working (such a
    pair needs a device-local ipc copy), and with ``run_tiles`` (a target: it runs them) the kernel here."""
    return (cuda and transport in ("auto", "ipc") and ipc_unavailable() is None
            and (not run_tiles or tiles.available()))


def segments_of(p: Plan, source: int, target: int) -> Segments:
    """A pair's runs in plan ``p``, as the transports take them."""
    runs = p.runs(source, target)
    return Segments(runs.src_off, runs.dst_off, runs.nbytes, runs.count, runs.src_stride, runs.dst_stride)


def parts(segments: Segments) -> tuple[Segments, ...]:
    """A pair's step in parts (:data:`tensorxfer.sync.link.Parts`): a fused pair's tiles of the blocks its source
    holds whole first -- they read only the trainer's shard, ready when the push begins -- then the tiles of the
    blocks it shares with other sources (they read the amaxes the sources agree on in their store round) and
    its byte runs (the tensors it sends as they are); any other pair's step is one part.  So the GPU quantizes
    from the step's start, while the sources agree (before, every pair waited for that round: 4.6-7.8 ms of a
    16.6 ms step on the H100), and a source makes no FP8 itself."""
    tiles = segments.tiles
    if tiles is None or not len(tiles) or tiles.agreed.all():
        return (segments,)
    empty = np.zeros(0, np.uint64)
    first = Segments(empty, empty, empty, empty, empty, empty, tiles=tiles.where(~tiles.agreed))
    if not tiles.agreed.any() and not len(segments):
        return (first,)
    return first, dataclasses.replace(segments, tiles=tiles.where(tiles.agreed) if tiles.agreed.any() else None)


def early(steps: tuple[Segments, ...]) -> bool:
    """Whether a pair's first part needs nothing the source makes at push time (tiles of whole blocks only): it
    is offered before the source quantizes."""
    first = steps[0]
    return first.tiles is not None and len(first.tiles) > 0 and not first.tiles.agreed.any() and not len(first)


def pairs_of(p: Plan, source: int, order: Sequence[int], found: dict[str, Fusable],
             devices: dict[tuple[str, int], str | None],
             mine: str | None) -> tuple[dict[int, tuple[Segments, ...]], set[str]]:
    """A source's step parts to each target in ``order`` (fused where the target registered this source's GPU,
    ``mine``), and the tensors every pair reading them fused (the source makes none of their FP8)."""
    pairs = {t: fuse(segments_of(p, source, t), found, mine is not None and devices.get(("target", t)) == mine)
             for t in order}
    return {t: parts(fp.segments) for t, fp in pairs.items()}, fused_names(list(pairs.values()))


def feeds(p: Plan, target: int, sources: Sequence[RankSpec], devices: dict[tuple[str, int], str | None],
          mine: str | None) -> dict[int, tuple[Segments, ...]]:
    """A target's step parts from each source that feeds it, fused from those on its GPU (``mine``)."""
    by_rank = {spec.rank: spec for spec in sources}
    out = {}
    for s in p.sources_of.get(target, ()):
        segments = segments_of(p, s, target)
        if mine is not None and devices.get(("source", s)) == mine:
            segments = fuse(segments, fusable(by_rank[s])).segments
        out[s] = parts(segments)
    return out
