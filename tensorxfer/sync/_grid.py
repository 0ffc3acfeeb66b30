"""Who holds what: the source boxes of every tensor as disjoint cells, each with the ranks that hold it.

Ranks holding the very same box of a tensor (Replicate, HSDP, expert
replicas) form one cell with several holders.  Boxes of one tensor that
overlap without being equal (two shardings of the same tensor, a full
replica beside shards) are cut along every box boundary into a grid, and
each grid cell is held by every rank whose box contains it -- so every
source element belongs to exactly one cell, and the planner can pick one
holder per cell.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorxfer.errors import PlanError
from tensorxfer.sync._boxes import I64, crowded_groups, expand_ranges, numel, row_any

MAX_GRID_CELLS = 1 << 22


@dataclass
class Cells:
    """Disjoint boxes of source tensors; cell c is held by ``entries[ptr[c]:ptr[c+1]]`` (sorted by rank).

    ``repr_size`` is, per dimension, the largest size among the holders'
    boxes: where it equals the cell's size every holder's local tensor spans
    the cell fully, so runs may merge across that dimension for any holder.
    ``holder_set`` numbers the distinct sets of holder ranks (-1 for cells
    with one holder).  ``uniform`` marks cells whose holders all hold the
    same box (so a group's offset inside the local tensor is the same for
    every holder).
    """

    tid: np.ndarray
    off: np.ndarray
    size: np.ndarray
    repr_size: np.ndarray
    ptr: np.ndarray
    entries: np.ndarray
    holder_set: np.ndarray
    uniform: np.ndarray


def cells_of(src: Any) -> Cells:
    """The cells of every source tensor (``src`` is the planner's table of source entries)."""
    live = np.flatnonzero(numel(src.size) > 0)
    # group equal (tensor, box) rows by a 64-bit mix of them: a stable sort keeps each group in rank order.
    # Should two different boxes ever mix to the same value and interleave, one box shows up as two equal
    # classes; equal classes overlap, so that tensor takes the grid path below, which merges their holders.
    mixed = _mix(src.tid[live], np.take(src.off, live, axis=0), np.take(src.size, live, axis=0))
    by_mix, mixed = _stable_order(mixed)
    order = live[by_mix]
    # (np.take: 4x faster than fancy indexing for rows of a 2-D array)
    tid, off, size = src.tid[order], np.take(src.off, order, axis=0), np.take(src.size, order, axis=0)
    new = np.ones(len(order), dtype=bool)
    new[1:] = ((mixed[1:] != mixed[:-1]) | (tid[1:] != tid[:-1]) | row_any(off[1:] != off[:-1])
               | row_any(size[1:] != size[:-1]))
    starts = np.flatnonzero(new)
    c_tid, c_off, c_size = tid[starts], np.take(off, starts, axis=0), np.take(size, starts, axis=0)
    ptr = np.append(starts, len(order)).astype(I64)
    tangled = crowded_groups(c_tid, c_off, c_size)
    cells = Cells(c_tid, c_off, c_size, c_size.copy(), ptr, order, np.zeros(0, dtype=I64),
                  np.ones(len(c_tid), dtype=bool))
    if len(tangled):
        cells = _untangle(cells, tangled, src)
    cells.holder_set = _holder_sets(cells, src.rank)
    return cells


def _mix(tid: np.ndarray, off: np.ndarray, size: np.ndarray) -> np.ndarray:
    """A 64-bit mix of each (tensor, offsets, sizes) row (splitmix64 steps; uint64 arithmetic wraps)."""
    h = tid.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    for column in [off[:, d] for d in range(off.shape[1])] + [size[:, d] for d in range(size.shape[1])]:
        h ^= column.astype(np.uint64)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(31)
    return h


def _stable_order(mixed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(``np.argsort(mixed, kind="stable")``, the sorted values), where the values may lose low bits.

    The low bits give way to the row index, so the keys are unique and a plain sort is stable (twice as
    fast as a stable argsort of 64-bit keys); two boxes whose mixes agree in the bits left are told apart
    by the comparisons that follow, as for a full collision.
    """
    n = len(mixed)
    bits = max(n - 1, 1).bit_length()
    if bits > 32:
        order = np.argsort(mixed, kind="stable")
        return order, mixed[order]
    shift = np.uint64(bits)
    key = ((mixed >> shift) << shift) | np.arange(n, dtype=np.uint64)
    key.sort()
    return (key & np.uint64((1 << bits) - 1)).astype(I64), key >> shift


def _untangle(cells: Cells, tangled: np.ndarray, src: Any) -> Cells:
    """Replace the classes of tensors whose boxes overlap by the grid cells of those boxes."""
    keep = np.flatnonzero(~np.isin(cells.tid, tangled))
    counts = np.diff(cells.ptr)
    tids, offs, sizes, reprs = [cells.tid[keep]], [cells.off[keep]], [cells.size[keep]], [cells.size[keep]]
    _, taken = expand_ranges(cells.ptr[keep], cells.ptr[keep + 1])
    holders, holder_counts = [cells.entries[taken]], [counts[keep]]
    uniform = [np.ones(len(keep), dtype=bool)]
    by_tid = np.flatnonzero(np.isin(cells.tid, tangled))
    by_tid = by_tid[np.argsort(cells.tid[by_tid], kind="stable")]
    bounds = np.searchsorted(cells.tid[by_tid], np.append(tangled, tangled[-1] + 1))
    for i, t in enumerate(tangled.tolist()):
        mine = by_tid[bounds[i]:bounds[i + 1]]
        lo, hi = cells.off[mine], cells.off[mine] + cells.size[mine]
        cuts = [np.unique(np.concatenate((lo[:, d], hi[:, d]))) for d in range(lo.shape[1])]
        total = int(np.prod([len(c) - 1 for c in cuts], dtype=np.float64)) * len(mine)
        if total > MAX_GRID_CELLS:
            raise PlanError(f"the source boxes of tensor {src.names[t]!r} overlap in too many ways "
                            f"({total} grid cell x box checks, limit {MAX_GRID_CELLS}); describe fewer "
                            "overlapping shardings of it")
        grids = np.meshgrid(*[np.arange(len(c) - 1) for c in cuts], indexing="ij")
        index = np.stack([g.ravel() for g in grids], axis=1) if grids else np.zeros((1, 0), dtype=I64)
        g_lo = np.stack([cuts[d][index[:, d]] for d in range(len(cuts))], axis=1).astype(I64)
        g_hi = np.stack([cuts[d][index[:, d] + 1] for d in range(len(cuts))], axis=1).astype(I64)
        inside = np.all((lo[None, :, :] <= g_lo[:, None, :]) & (g_hi[:, None, :] <= hi[None, :, :]), axis=2)
        grid, cls = np.nonzero(inside)                     # (grid cell, box containing it), by grid cell
        which, entry_at = expand_ranges(cells.ptr[mine[cls]], cells.ptr[mine[cls] + 1])
        grid, entry = grid[which], cells.entries[entry_at]
        order = np.lexsort((src.rank[entry], grid))         # each cell's holders by rank
        grid, entry = grid[order], entry[order]
        starts = np.flatnonzero(np.append(True, grid[1:] != grid[:-1]))
        cell_of = grid[starts]
        boxes = np.bincount(np.nonzero(inside)[0], minlength=len(inside))[cell_of]
        tids.append(np.full(len(starts), t, dtype=I64))
        offs.append(g_lo[cell_of])
        sizes.append(g_hi[cell_of] - g_lo[cell_of])
        reprs.append(np.maximum.reduceat(src.size[entry], starts, axis=0))
        holders.append(entry)
        holder_counts.append(np.diff(np.append(starts, len(grid))))
        uniform.append(boxes == 1)  # inside one box only: every holder holds that same box
    tid = np.concatenate(tids)
    return Cells(tid, np.concatenate(offs), np.concatenate(sizes), np.concatenate(reprs),
                 np.concatenate(([0], np.cumsum(np.concatenate(holder_counts)))).astype(I64),
                 np.concatenate(holders).astype(I64), np.zeros(0, dtype=I64), np.concatenate(uniform))


def _holder_sets(cells: Cells, rank: np.ndarray) -> np.ndarray:
    """Number the distinct holder-rank sets of the cells with two or more holders (-1 elsewhere)."""
    k = np.diff(cells.ptr)
    out = np.full(len(k), -1, dtype=I64)
    next_id = 0
    for n in np.unique(k[k > 1]).tolist():
        which = np.flatnonzero(k == n)
        ranks = rank[cells.entries[cells.ptr[which][:, None] + np.arange(n)[None, :]]]
        # number the rank lists by a 64-bit mix of them; np.unique(axis=0) only if two lists mix alike
        mixed = _mix(ranks[:, 0], ranks[:, 1:], ranks[:, :0])
        _, first, inverse = np.unique(mixed, return_index=True, return_inverse=True)
        if not np.array_equal(ranks[first][inverse.reshape(-1)], ranks):
            _, inverse = np.unique(ranks, axis=0, return_inverse=True)
        out[which] = next_id + inverse.reshape(-1)
        next_id += int(inverse.max()) + 1
    return out
