"""The resharding planner: every rank's shard description in, a static byte schedule out.

:func:`plan` is pure and deterministic (no I/O; the same descriptions in
any order give the same plan and the same digest).  For every (source rank,
target rank) pair it lists the byte runs to copy from the source's region
to the target's region so that every byte of every target tensor is
written exactly once.

How it works, in the order of the code (every step is vectorized with
numpy over all ranks at once; nothing loops over tensor x source x target):

0. **Replicas once.**  Target ranks with equal descriptions (the replicas
   of one TP rank: same tensors at the same offsets) are planned once and
   their runs copied per rank; only the choice among source replicas
   differs between them.
1. **Source index.**  Source boxes are grouped into *classes* (one box of
   one tensor; the ranks holding that same box are its replicas).  Where
   classes of a tensor overlap without being equal, that tensor's classes
   are cut into disjoint grid *cells*, each held by every rank whose box
   contains it.  Cells of a tensor are sorted along the dimension their
   offsets spread most (the sharded one), so a target piece finds the cells
   it touches by binary search, not by scanning all sources.
2. **Intersections.**  Each target piece is intersected with the cells it
   touches.  A piece not fully covered is a :class:`PlanError` naming the
   target rank, the tensor and an uncovered box.
3. **Byte geometry.**  Each intersection becomes runs in both C-contiguous
   layouts: trailing dimensions the intersection spans fully in both the
   source's local tensor and the target tensor merge into one run, so a
   full-row overlap is one run and a whole-tensor overlap one run.  The
   rows left over are kept as a *strided group* ``(src_off, dst_off,
   nbytes, count, src_stride, dst_stride)`` -- ``count`` runs, the i-th at
   ``src_off + i*src_stride`` / ``dst_off + i*dst_stride`` -- so a
   row-parallel shard costs one entry, not one per row (exactly a 2-D
   copy: ``cudaMemcpy2D``, a strided numpy view).  :meth:`Runs.flat`
   expands them into plain runs.
4. **Balancing.**  Bytes held by one rank go from that rank.  Bytes held by
   k ranks (Replicate, HSDP, expert replicas, overlapping shards) are
   balanced per *holder set* (the ranks that hold them).  First the bytes
   of each set are shared among its ranks by water-filling over all ranks'
   loads (what each rank sends anyway is counted; a set pours onto its
   least-loaded ranks up to a common level; repeated until nothing moves):
   ranks of disjoint sets get 1/k each, and a rank in many sets (a full
   replica beside shards) gets its fair part rather than 1/k of every set.
   Then all pieces of every tensor with the same holder set are laid end
   to end in (target rank, target offset) order and that line is cut into
   consecutive lengths of those shares, the i-th going to the holder with
   the i-th lowest rank: large contiguous parts, each holder feeding a few
   neighbouring targets rather than every target a little.  A cut falls
   on a row boundary of a strided group, or on an element boundary of a
   single run.
5. **Order and coalescing.**  Runs are sorted by (source, target, target
   offset); runs contiguous in both regions merge, across tensors too, so
   tensors laid out in the same order on both sides move as one run.
   Each source sends to its targets starting at the ``rank % n``-th of the
   ``n`` targets it feeds (in rank order, wrapping), so the sources feeding
   a target do not all start on the same one.
6. **Digest.**  sha256 over a version tag, every rank's description digest
   (rank + sha256 of its canonical encoding, sources then targets by rank),
   the template groups and source cells of steps 1-3, and the balancing
   cuts with their holders in slot order, as little-endian 64-bit values:
   every decision the runs follow from.

**One rank's part.**  ``plan(..., scope=(role, rank))`` makes every
decision above over the whole group (steps 1-4 are per template and per
block, never per target rank) but writes out only the runs of that rank's
pairs: the rows of its own target rank, or the rows on its stretch of each
holder set's line.  Its runs equal the whole plan's for those pairs, and its
digest is the same; the two ends of a pair compare the digest of the pair's
runs when they move bytes.  This is what a rank of a weight sync computes.

Scale (``benchmarks/bench_plan.py``): a Kimi-K2-shaped model (70k tensors)
from 256 trainer ranks to 128 inference ranks (16 x TP 8) is 1.4M strided
groups (113M plain runs) over 3k pairs.  On one core of the shared 2-core
development VM the whole plan takes 0.87 s (best 0.67 s), one rank's part
0.30 s (one target's 11k groups, one source's 4k), decoding the 384
descriptions 0.24 s more.  The cost grows with the source
entries (357k here) and, for the whole plan, its own size, not with tensors
x sources x targets.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, is_dataclass
from typing import Any

import numpy as np

from tensorxfer.errors import PlanError
from tensorxfer.quant.layout import SEP, describe, parse_derived
from tensorxfer.sync import _columns, _runs
from tensorxfer.sync._boxes import (
    I64,
    c_strides,
    expand_ranges,
    first_uncovered,
    format_box,
    intersect,
    numel,
    overlap_pairs,
    row_any,
    segment_starts,
)
from tensorxfer.sync._columns import ITEMSIZE, SourceColumns, TargetColumns
from tensorxfer.sync._grid import Cells, cells_of
from tensorxfer.sync.spec import FILLED, RankSpec

__all__ = ["Plan", "Runs", "SourceView", "TargetView", "plan"]

DIGEST_TAG = b"tensorxfer.sync.plan/2\0"
U64 = np.uint64


@dataclass(frozen=True, eq=False)
class Runs:
    """Strided groups of byte runs from one source region to one target region, sorted by ``dst_off``.

    Group i is ``count[i]`` runs of ``nbytes[i]`` bytes: run j copies source
    bytes ``src_off[i] + j*src_stride[i]`` to target bytes ``dst_off[i] +
    j*dst_stride[i]`` (strides are 0 where count is 1).  All arrays uint64.
    """

    src_off: np.ndarray
    dst_off: np.ndarray
    nbytes: np.ndarray
    count: np.ndarray
    src_stride: np.ndarray
    dst_stride: np.ndarray

    def __len__(self) -> int:
        return len(self.nbytes)

    @property
    def total_bytes(self) -> int:
        return int(np.dot(self.count, self.nbytes)) if len(self) else 0

    @property
    def num_runs(self) -> int:
        """Plain runs once the groups are expanded."""
        return int(self.count.sum()) if len(self) else 0

    def flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(src_off, dst_off, nbytes) with every group expanded, sorted by ``dst_off``."""
        counts = self.count.astype(I64)
        group, step = expand_ranges(np.zeros(len(counts), dtype=I64), counts)
        step_u = step.astype(U64)
        src = self.src_off[group] + step_u * self.src_stride[group]
        dst = self.dst_off[group] + step_u * self.dst_stride[group]
        nbytes = self.nbytes[group]
        order = np.argsort(dst, kind="stable")
        return src[order], dst[order], nbytes[order]


@dataclass(frozen=True)
class SourceView:
    """What source ``rank`` executes: its targets in send order, and the runs to each."""

    rank: int
    send_order: tuple[int, ...]
    runs: Mapping[int, Runs]
    total_bytes: int


@dataclass(frozen=True)
class TargetView:
    """What target ``rank`` expects: the sources feeding it, their runs, and the bytes that complete it."""

    rank: int
    sources: tuple[int, ...]
    runs: Mapping[int, Runs]
    expected_bytes: int


class Plan:
    """A static schedule: runs per (source rank, target rank) pair, stats, and a digest.

    Built by :func:`plan`; immutable (its arrays are read-only).
    ``sources`` / ``targets`` are the ranks, ascending.  ``pairs`` maps
    ``(src, dst)`` to :class:`Runs` (built on first use; :meth:`runs` gives
    one pair); ``pair_bytes`` the bytes of each pair; ``send_order[src]``
    the targets a source feeds, in the order it should send;
    ``sources_of[dst]`` the sources feeding a target; ``bytes_per_source``
    / ``bytes_per_target`` the bytes each sends / receives (a target's is
    the total size of its tensors: what completes it); ``max_target_bytes``
    the largest of those (the bound on a sync's time at one link's rate).
    ``digest`` (hex sha256) covers the inputs and every decision of the
    plan: ranks compare it to know they computed the same schedule.

    A plan made with ``scope=(role, rank)`` holds that rank's pairs only:
    ``pairs``, ``pair_bytes`` and the per-rank maps cover that rank alone
    (``max_target_bytes`` still covers every target).
    """

    def __init__(self, source_ranks: tuple[int, ...], target_ranks: tuple[int, ...], arrays: dict[str, np.ndarray],
                 target_bytes: dict[int, int], digest: str, scope: tuple[str, int] | None = None) -> None:
        self.sources = source_ranks
        self.targets = target_ranks
        self.digest = digest
        self.scope = scope
        for value in arrays.values():
            value.flags.writeable = False  # Runs hand out views of these
        self._a = arrays
        key_src, key_dst = arrays["src_rank"], arrays["dst_rank"]
        starts = segment_starts(key_src * (max(target_ranks, default=0) + 1) + key_dst)
        ends = np.append(starts[1:], len(key_src)).astype(I64)
        self._index = {(int(key_src[s]), int(key_dst[s])): (int(s), int(e)) for s, e in zip(starts, ends)}
        nbytes = arrays["count"] * arrays["nbytes"]
        per_pair = np.add.reduceat(nbytes, starts) if len(starts) else np.zeros(0, dtype=U64)
        self.pair_bytes = {k: int(b) for k, b in zip(self._index, per_pair)}
        self.bytes_per_source = {r: 0 for r in source_ranks if scope in (None, ("source", r))}
        self.bytes_per_target = {r: 0 for r in target_ranks if scope in (None, ("target", r))}
        fed: dict[int, list[int]] = {r: [] for r in self.bytes_per_source}
        feeding: dict[int, list[int]] = {r: [] for r in self.bytes_per_target}
        for (s, t), b in self.pair_bytes.items():
            if s in fed:
                self.bytes_per_source[s] += b
                fed[s].append(t)
            if t in feeding:
                self.bytes_per_target[t] += b
                feeding[t].append(s)
        want = {t: target_bytes[t] for t in self.bytes_per_target}
        if self.bytes_per_target != want:  # guards the planner itself: a bug, not bad input
            raise AssertionError(f"planner bug: bytes per target {self.bytes_per_target} != {want}")
        self.send_order = {s: tuple(ts[s % len(ts):] + ts[:s % len(ts)]) if ts else () for s, ts in fed.items()}
        self.sources_of = {t: frozenset(ss) for t, ss in feeding.items()}
        self.max_target_bytes = max(target_bytes.values(), default=0)
        self._pairs: dict[tuple[int, int], Runs] | None = None

    @property
    def num_groups(self) -> int:
        return len(self._a["nbytes"])

    @property
    def num_runs(self) -> int:
        """Plain runs over all pairs once strided groups are expanded."""
        return int(self._a["count"].sum())

    def runs(self, src: int, dst: int) -> Runs:
        """The runs from source ``src`` to target ``dst`` (empty when it feeds nothing there)."""
        lo, hi = self._index.get((src, dst), (0, 0))
        a = self._a
        return Runs(*(a[k][lo:hi] for k in ("src_off", "dst_off", "nbytes", "count", "src_stride", "dst_stride")))

    @property
    def pairs(self) -> dict[tuple[int, int], Runs]:
        """Every (source, target) pair that moves bytes, with its runs."""
        if self._pairs is None:
            self._pairs = {k: self.runs(*k) for k in self._index}
        return self._pairs

    def for_source(self, rank: int) -> SourceView:
        """The part of the plan source ``rank`` executes."""
        if rank not in self.bytes_per_source:
            raise PlanError(self._absent("source", rank))
        order = self.send_order[rank]
        return SourceView(rank, order, {t: self.runs(rank, t) for t in order}, self.bytes_per_source[rank])

    def for_target(self, rank: int) -> TargetView:
        """The part of the plan target ``rank`` waits for."""
        if rank not in self.bytes_per_target:
            raise PlanError(self._absent("target", rank))
        sources = tuple(sorted(self.sources_of[rank]))
        return TargetView(rank, sources, {s: self.runs(s, rank) for s in sources}, self.bytes_per_target[rank])

    def _absent(self, role: str, rank: int) -> str:
        ranks = list(self.sources if role == "source" else self.targets)
        if rank in ranks and self.scope is not None:
            return (f"this plan holds the runs of {self.scope[0]} rank {self.scope[1]} only (made with scope=); "
                    f"plan without a scope for {role} rank {rank}'s")
        return f"rank {rank} is not a {role} of this plan ({role}s: {ranks})"

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self._index)

    def __repr__(self) -> str:
        return (f"Plan(sources={len(self.sources)}, targets={len(self.targets)}, pairs={len(self._index)}, "
                f"groups={self.num_groups}, bytes={sum(self.bytes_per_target.values())}, "
                f"digest={self.digest[:12]})")


def _ranks(specs: Sequence[RankSpec], role: str) -> list[RankSpec]:
    out = []
    for spec in specs:
        if not isinstance(spec, RankSpec):
            raise PlanError(f"plan() takes RankSpec objects, got {type(spec).__name__}")
        if spec.role != role:
            raise PlanError(f"rank {spec.rank} is described as a {spec.role} but was passed among the {role}s")
        out.append(spec)
    out.sort(key=lambda s: s.rank)
    for a, b in itertools.pairwise(out):
        if a.rank == b.rank:
            raise PlanError(f"{role} rank {a.rank} is described twice")
    return out


def _pad(array: np.ndarray, width: int, fill: int) -> np.ndarray:
    out = np.full((array.shape[0], width), fill, dtype=I64)
    if array.shape[1]:
        out[:, width - array.shape[1]:] = array
    return out


@dataclass
class _Sources:
    """All source ranks' entries in one table; tensors numbered in order of first appearance."""

    names: list[str]
    index: dict[str, int]
    shape: np.ndarray   # per tensor id, (ntensors, D)
    ndim: np.ndarray
    dtype: np.ndarray
    rank: np.ndarray    # per entry
    tid: np.ndarray
    off: np.ndarray
    size: np.ndarray
    region: np.ndarray


def _gather_sources(specs: list[RankSpec], width: int) -> _Sources:
    cols: list[SourceColumns] = [s.columns for s in specs]  # type: ignore[misc]
    # tensors numbered in order of first appearance (ranks ascending, names sorted): deterministic.  Ranks
    # often hold the very same names (FSDP: all of them; replicas), so each distinct list is numbered once;
    # dict/map/chain/zip run in C -- this touches every (rank, tensor) name
    lists = list(dict.fromkeys(c.names for c in cols))
    names = list(dict.fromkeys(itertools.chain.from_iterable(lists)))
    index = dict(zip(names, range(len(names))))
    numbered = {n: np.fromiter(map(index.__getitem__, n), dtype=I64, count=len(n)) for n in lists}
    counts = [len(c.names) for c in cols]
    tid = np.concatenate([numbered[c.names] for c in cols] or [np.zeros(0, dtype=I64)])
    rank = np.repeat(np.array([s.rank for s in specs], dtype=I64), counts)
    bounds = np.concatenate(([0], np.cumsum(counts))).astype(I64)

    def cat(field: str, fill: int) -> np.ndarray:
        out = np.full((int(bounds[-1]), width), fill, dtype=I64)
        for i, c in enumerate(cols):
            block = getattr(c, field)
            if block.shape[1]:
                out[bounds[i]:bounds[i + 1], width - block.shape[1]:] = block
        return out

    shape, off, size = cat("shape", 1), cat("box_off", 0), cat("box_size", 1)
    ndim = np.concatenate([c.ndim for c in cols] or [tid])
    dtype = np.concatenate([c.dtype.astype(I64) for c in cols] or [tid])
    region = np.concatenate([c.region_offset for c in cols] or [tid])
    # every tensor's shape and dtype come from its lowest rank; the others must agree
    by_tid = np.argsort(tid, kind="stable")
    first = by_tid[segment_starts(tid[by_tid])]
    t_shape, t_ndim, t_dtype = shape[first], ndim[first], dtype[first]
    bad = np.flatnonzero(row_any(shape != np.take(t_shape, tid, axis=0)) | (ndim != t_ndim[tid])
                         | (dtype != t_dtype[tid]))
    if len(bad):
        e = int(bad[0])
        f = int(first[tid[e]])
        dn = _columns.DTYPE_NAMES
        raise PlanError(
            f"source tensor {names[tid[e]]!r} is {dn[dtype[f]]} {_shape(shape[f], ndim[f])} on source rank "
            f"{int(rank[f])} but {dn[dtype[e]]} {_shape(shape[e], ndim[e])} on source rank {int(rank[e])}; "
            "every source must describe the same global tensor")
    return _Sources(names, index, t_shape, t_ndim, t_dtype, rank, tid, off, size, region)


def _shape(row: np.ndarray, ndim: int) -> tuple[int, ...]:
    return tuple(int(x) for x in row[len(row) - int(ndim):]) if ndim else ()


@dataclass
class _Pieces:
    """All target ranks' pieces (non-empty ones), with their target tensor's placement."""

    template: np.ndarray           # index of the (first) target spec the piece belongs to
    tid: np.ndarray
    off: np.ndarray
    size: np.ndarray
    at: np.ndarray
    local_shape: np.ndarray
    region: np.ndarray
    itemsize: np.ndarray
    owner: np.ndarray              # per piece: index into specs, and its row there (for messages)
    row: np.ndarray
    specs: list[RankSpec]
    total: list[int]               # bytes per target spec

    def where(self, j: int) -> tuple[int, str]:
        """(target rank, target tensor name) of piece j."""
        spec = self.specs[int(self.owner[j])]
        c: TargetColumns = spec.columns  # type: ignore[assignment]
        return spec.rank, c.names[c.piece_tensor[self.row[j]]]


def _gather_targets(specs: list[RankSpec], width: int, src: _Sources) -> _Pieces:
    ranks, tids, offs, sizes, ats, shapes, regions, items, owners, rows = [], [], [], [], [], [], [], [], [], []
    total = []
    for number, spec in enumerate(specs):
        c: TargetColumns = spec.columns  # type: ignore[assignment]
        pt = c.piece_tensor
        # padding the target fills itself: no source, no runs, not part of the bytes that complete the step
        filled = np.fromiter((name == FILLED for name in c.piece_source), dtype=bool, count=len(c.piece_source))
        total.append(int((numel(c.shape) * ITEMSIZE[c.dtype]).sum()
                         - (numel(c.piece_size[filled]) * ITEMSIZE[c.dtype[pt[filled]]]).sum()))
        tid = np.fromiter(map(src.index.get, c.piece_source, itertools.repeat(-1)), dtype=I64,
                          count=len(c.piece_source))
        if filled.any() and len(src.dtype):
            tid = np.where(filled, 0, tid)      # any source tensor: the checks below pass filled pieces over
        missing = np.flatnonzero(tid < 0)
        if len(missing):
            j = int(missing[0])
            made = _layouts_made(c.piece_source[j], src.names)
            raise PlanError(
                f"target rank {spec.rank} tensor {c.names[pt[j]]!r} needs "
                f"{format_box(*_unpadded(c.piece_off[j], c.piece_size[j], c.piece_ndim[j]))} of source tensor "
                f"{describe(c.piece_source[j])}, which no source rank holds" + (
                    f" (the sources make it as: {'; '.join(made)}: a target that joined later must ask a layout "
                    f"they make)" if made else ""))
        dtype = c.dtype[pt].astype(I64)
        bad = np.flatnonzero((dtype != src.dtype[tid]) & ~filled)
        if len(bad):
            j = int(bad[0])
            dn = _columns.DTYPE_NAMES
            raise PlanError(
                f"target rank {spec.rank} tensor {c.names[pt[j]]!r} is {dn[dtype[j]]} but its piece of source tensor "
                f"{c.piece_source[j]!r} is {dn[src.dtype[tid[j]]]}; the plan copies bytes and does not cast, so "
                "describe the source in the target's dtype")
        bad = np.flatnonzero((c.piece_ndim != src.ndim[tid]) & ~filled)
        if len(bad):
            j = int(bad[0])
            raise PlanError(
                f"target rank {spec.rank} tensor {c.names[pt[j]]!r} takes a {int(c.piece_ndim[j])}-D box of source "
                f"tensor {c.piece_source[j]!r}, which has {int(src.ndim[tid[j]])} dimensions")
        off, size = _pad(c.piece_off, width, 0), _pad(c.piece_size, width, 1)
        bad = np.flatnonzero(row_any(off + size > np.take(src.shape, tid, axis=0)) & ~filled)
        if len(bad):
            j = int(bad[0])
            raise PlanError(
                f"target rank {spec.rank} tensor {c.names[pt[j]]!r} takes box "
                f"{format_box(*_unpadded(c.piece_off[j], c.piece_size[j], c.piece_ndim[j]))} of source tensor "
                f"{c.piece_source[j]!r}, outside its global shape {_shape(src.shape[tid[j]], src.ndim[tid[j]])}")
        live = np.flatnonzero((numel(size) > 0) & ~filled)
        ranks.append(np.full(len(live), number, dtype=I64))
        tids.append(tid[live])
        offs.append(off[live])
        sizes.append(size[live])
        ats.append(_pad(c.piece_at, width, 0)[live])
        shapes.append(_pad(c.shape, width, 1)[pt[live]])
        regions.append(c.region_offset[pt[live]])
        items.append(ITEMSIZE[c.dtype[pt[live]]])
        owners.append(np.full(len(live), number, dtype=I64))
        rows.append(live)
    z1, z2 = np.zeros(0, dtype=I64), np.zeros((0, width), dtype=I64)
    return _Pieces(
        np.concatenate(ranks or [z1]), np.concatenate(tids or [z1]), np.concatenate(offs or [z2]),
        np.concatenate(sizes or [z2]), np.concatenate(ats or [z2]), np.concatenate(shapes or [z2]),
        np.concatenate(regions or [z1]), np.concatenate(items or [z1]), np.concatenate(owners or [z1]),
        np.concatenate(rows or [z1]), specs, total)


def _layouts_made(wanted: str, names: Sequence[str]) -> list[str]:
    """The quantized layouts the sources make of the tensor ``wanted`` is derived from (none: not derived)."""
    found = parse_derived(wanted) if SEP in wanted else None
    if found is None:
        return []
    prefix, made = found[0] + SEP, set()
    for name in names:
        parsed = parse_derived(name) if name.startswith(prefix) else None
        if parsed is not None:
            made.add(str(parsed[1]))
    return sorted(made)


def _unpadded(off: np.ndarray, size: np.ndarray, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    k = len(off) - int(ndim)
    return tuple(int(x) for x in off[k:]), tuple(int(x) for x in size[k:])


def _check_coverage(pc: _Pieces, src: _Sources, cells: Cells, unit_piece: np.ndarray, unit_numel: np.ndarray) -> None:
    covered = np.zeros(len(pc.template), dtype=I64)
    if len(unit_piece):
        starts = segment_starts(unit_piece)
        covered[unit_piece[starts]] = np.add.reduceat(unit_numel, starts)
    short = np.flatnonzero(covered != numel(pc.size))
    if not len(short):
        return
    j = int(short[0])
    t = int(pc.tid[j])
    k = pc.off.shape[1] - int(src.ndim[t])
    mine = np.flatnonzero(cells.tid == t)
    covers = [(tuple(int(x) for x in cells.off[c, k:]), tuple(int(x) for x in cells.size[c, k:])) for c in mine]
    off, size = _unpadded(pc.off[j], pc.size[j], src.ndim[t])
    hole = first_uncovered(off, size, covers) or (off, size)
    rank, name = pc.where(j)
    raise PlanError(
        f"target rank {rank} tensor {name!r} needs box {format_box(*hole)} of source tensor {describe(src.names[t])}, "
        "which no source rank holds; add a source that holds it or fix the boxes")


class _LastSteps:
    """The planner's first steps for the most recent inputs, by what they depend on.

    A membership change re-plans with mostly the same inputs: a target that joins or leaves leaves the
    sources' index (steps 1) as it was, and a replica of a TP rank that is already planned leaves the
    templates' geometry (steps 2-3) as it was too.  Those results depend only on the descriptions'
    digests in the key, so reusing them keeps :func:`plan` a pure function of its inputs.  Their arrays
    are made read-only: a later step that wrote to one would fail loudly, not corrupt the next plan.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[str, tuple[Any, Any]] = {}    # kind -> (key, value): the last one of each kind

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()

    def get(self, key: tuple[Any, ...], build: Callable[[], Any]) -> Any:
        with self._lock:
            kept = self._kept.get(key[0])
            if kept is not None and kept[0] == key:
                return kept[1]
        value = build()
        _freeze(value)
        with self._lock:
            self._kept[key[0]] = (key, value)
        return value


def _freeze(value: Any) -> None:
    # arrays sit in tuples, dataclasses and dicts of arrays; lists and dicts of other values (names, specs, a
    # name index) are not walked: that costs 0.1 s at 70k tensors
    if isinstance(value, np.ndarray):
        value.flags.writeable = False
    elif isinstance(value, tuple):
        for item in value:
            _freeze(item)
    elif isinstance(value, dict):
        for item in [v for v in value.values() if type(v) is np.ndarray]:
            item.flags.writeable = False
    elif is_dataclass(value):
        for item in vars(value).values():
            _freeze(item)


_STEPS = _LastSteps()


def _index_sources(src_specs: list[RankSpec], width: int) -> tuple[_Sources, Cells]:
    """Step 1: the sources' entries in one table, cut into cells."""
    src = _gather_sources(src_specs, width)
    return src, cells_of(src)


def _template_geometry(templates: list[RankSpec], width: int, src: _Sources,
                       cells: Cells) -> tuple[Any, dict[str, np.ndarray], np.ndarray, bytes]:
    """Steps 2-3 for one description per template: intersections (coverage checked), byte geometry, and the
    digest of both (the template groups and the cells they read from)."""
    pc = _gather_targets(templates, width, src)
    ip, ic = overlap_pairs(pc.tid, pc.off, pc.size, cells.tid, cells.off, cells.size)
    p_off = np.take(pc.off, ip, axis=0)     # np.take: rows of a 2-D array, 4x faster than pc.off[ip]
    i_off, i_size = intersect(p_off, np.take(pc.size, ip, axis=0), np.take(cells.off, ic, axis=0),
                              np.take(cells.size, ic, axis=0))
    _check_coverage(pc, src, cells, ip, numel(i_size))
    g = _runs.geometry(i_off, i_size, np.take(cells.repr_size, ic, axis=0), np.take(pc.local_shape, ip, axis=0),
                       np.take(pc.at, ip, axis=0) + (i_off - p_off), pc.region[ip], pc.itemsize[ip])
    g["cell"] = ic[g["row"]]
    g["template"] = pc.template[ip[g.pop("row")]]
    entry_stride = c_strides(src.size)
    g["src_rel"], g["src_stride"] = _runs.source_offsets(g, src.off, entry_stride, cells.entries[cells.ptr[g["cell"]]])
    h = hashlib.sha256()
    _hash(h, [g[k] for k in ("template", "cell", "dst", "count", "nbytes", "dst_stride", "src_rel", "src_stride")])
    _hash(h, [cells.tid, cells.off, cells.size, cells.ptr, cells.entries])
    return pc, g, entry_stride, h.digest()


def _hash(h: Any, arrays: Sequence[np.ndarray]) -> None:
    """Feed integer arrays to ``h`` as little-endian 64-bit values (the same bytes on every machine)."""
    for a in arrays:
        h.update(np.ascontiguousarray(a).astype("<u8" if a.dtype.kind == "u" else "<i8", copy=False).data)


def plan(sources: Sequence[RankSpec], targets: Sequence[RankSpec], *, scope: tuple[str, int] | None = None) -> Plan:
    """The static schedule moving the sources' shards into the targets' tensors; see the module docstring.

    Parameters
    ----------
    sources, targets
        One :class:`~tensorxfer.sync.spec.RankSpec` per rank, in any order.
    scope : ("source", rank) or ("target", rank), optional
        Expand only the runs of that rank's pairs: what the rank executes.  Every decision (the index, the
        template geometry, the balancing cuts) is still made over the whole group, so these runs are exactly
        the whole plan's for those pairs and the digest is the same; what is skipped is writing out the
        other ranks' runs, most of the work at scale.

    Raises
    ------
    PlanError
        A rank described twice or in the wrong role; a source tensor whose
        global shape or dtype differs between ranks; a target piece whose
        source tensor no rank holds, whose dtype differs from the target's,
        or whose box falls outside the global tensor; target bytes held by
        no source (the message names the target rank, tensor and an
        uncovered box); a ``scope`` naming a rank that is not in the plan.
        Rank-local faults (duplicate names, overlapping pieces) are refused
        when each RankSpec is built.
    """
    src_specs = _ranks(sources, "source")
    tgt_specs = _ranks(targets, "target")
    if scope is not None and scope not in {(s.role, s.rank) for s in src_specs + tgt_specs}:
        raise PlanError(f"scope {scope!r} is not a rank of this plan: give ('source', rank) or ('target', rank) of "
                        "one of the described ranks")
    width = max([1] + [s.columns.shape.shape[1] for s in src_specs + tgt_specs])
    source_key = (width, tuple((s.rank, s.digest) for s in src_specs))
    src, cells = _STEPS.get(("sources", source_key), lambda: _index_sources(src_specs, width))
    # target ranks with equal descriptions (replicas of one TP rank) are planned once, then copied
    by_content: dict[bytes, list[RankSpec]] = {}
    for spec in tgt_specs:
        by_content.setdefault(spec.content_digest, []).append(spec)
    templates = list(by_content.values())
    pc, g, entry_stride, geometry_digest = _STEPS.get(
        ("templates", source_key, tuple(by_content)),
        lambda: _template_geometry([m[0] for m in templates], width, src, cells))
    member_ranks = [[s.rank for s in m] for m in templates]
    ln = _runs.line(g, cells, member_ranks, src.rank)
    h = hashlib.sha256(DIGEST_TAG)
    for spec in src_specs + tgt_specs:
        h.update(spec.digest)
    h.update(geometry_digest)
    _hash(h, ln.digest_parts())
    only_source = scope[1] if scope and scope[0] == "source" else None
    if only_source is not None:
        row, member, rank = _runs.source_members(g, cells, ln, member_ranks, src.rank, only_source)
    else:
        row, member, rank = _runs.members(g, member_ranks, scope[1] if scope else None)
    part, slot, skip, size = _runs.assign(g, ln, row, member)
    runs = _runs.coalesce(_runs.finish(g, cells, row, rank, part, slot, skip, size, src.rank, src.off,
                                       src.region, entry_stride, only_source))
    arrays = {k: (v.astype(I64) if k.endswith("rank") else v.astype(U64)) for k, v in runs.items()}
    total = {s.rank: t for m, t in zip(templates, pc.total) for s in m}
    return Plan(tuple(s.rank for s in src_specs), tuple(s.rank for s in tgt_specs), arrays, total, h.hexdigest(),
                scope)
