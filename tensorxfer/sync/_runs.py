"""From box intersections to byte runs: geometry, holder choice (balancing), coalescing.

Every function takes and returns columns (dicts of equally long numpy
arrays, one row per strided group); :mod:`tensorxfer.sync.plan` strings
them together and documents the rules.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from tensorxfer.sync._boxes import I64, c_strides, expand_ranges, numel, row_any, row_sum, segment_starts
from tensorxfer.sync._grid import Cells

Columns = dict[str, np.ndarray]


def geometry(i_off: np.ndarray, i_size: np.ndarray, src_shape: np.ndarray, local_shape: np.ndarray,
             dst_coord: np.ndarray, dst_region: np.ndarray, item: np.ndarray) -> Columns:
    """Strided groups for intersections (one row each), target side resolved.

    ``src_shape`` is the source local shape the runs must be contiguous in
    (for several holders, the largest per dimension: see ``Cells``);
    ``dst_coord`` the intersection's first element in the target tensor.
    Trailing dimensions spanned fully in both layouts merge into the run;
    the innermost dimension left is the strided one; any further partial
    dimensions (3-D and up) are enumerated into separate groups.  Returns
    ``row`` (the intersection of each group), ``coord`` (global coordinates
    of the group's first element), ``dst``, ``dst_stride``, ``count``,
    ``nbytes``, ``sd`` (strided dimension, -1 for a single run), ``item``.
    """
    n, width = i_off.shape
    s_stride = c_strides(src_shape)
    t_stride = c_strides(local_shape)
    run = np.ones(n, dtype=I64)
    going = np.ones(n, dtype=bool)
    outer = np.zeros((n, width), dtype=bool)
    for d in range(width - 1, -1, -1):
        big = i_size[:, d] > 1
        extend = going & big & (s_stride[:, d] == run) & (t_stride[:, d] == run)
        run = np.where(extend, run * i_size[:, d], run)
        outer[:, d] = big & ~extend
        going &= ~outer[:, d]
    has_outer = row_any(outer)
    sd = np.where(has_outer, width - 1 - np.argmax(outer[:, ::-1], axis=1), -1)
    rows = np.arange(n)
    count = np.where(has_outer, i_size[rows, np.maximum(sd, 0)], 1)
    extra = outer.copy()
    extra[rows[has_outer], sd[has_outer]] = False
    per_row = numel(np.where(extra, i_size, 1))
    dst = dst_region + item * row_sum(dst_coord * t_stride)
    coord, row = i_off, rows
    if np.any(per_row > 1):
        row, k = expand_ranges(np.zeros(n, dtype=I64), per_row)
        coord = np.take(i_off, row, axis=0)
        dst = dst[row].copy()
        for d in range(width - 1, -1, -1):
            on = extra[row, d]
            step = np.where(on, k % i_size[row, d], 0)
            k = np.where(on, k // i_size[row, d], k)
            coord[:, d] += step
            dst += item[row] * step * t_stride[row, d]
    sd_r = sd[row]
    return {"row": row, "coord": coord, "dst": dst, "count": count[row], "nbytes": run[row] * item[row],
            "sd": sd_r, "dst_stride": np.where(sd_r >= 0, t_stride[row, np.maximum(sd_r, 0)], 0) * item[row],
            "item": item[row]}


def source_offsets(g: Columns, entry_off: np.ndarray, entry_stride: np.ndarray,
                   entry: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Byte offset of each group's first element inside source ``entry``'s local tensor, and the row stride."""
    stride = np.take(entry_stride, entry, axis=0)
    rel = g["item"] * row_sum((g["coord"] - np.take(entry_off, entry, axis=0)) * stride)
    sd = g["sd"]
    return rel, np.where(sd >= 0, stride[np.arange(len(sd)), np.maximum(sd, 0)], 0) * g["item"]


def members(g: Columns, ranks: list[list[int]], only: int | None = None,
            rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Template groups copied to every target rank sharing the template: (group, member index, rank) per row.

    Rows come in (target rank, target offset) order, so runs end up sorted
    by target offset without sorting anything the size of the plan.
    ``only``: the rows of that target rank alone; ``rows``: a mask of the
    template groups to copy (the others are left out).
    """
    template = g["template"]
    order = np.lexsort((g["dst"], template))
    if rows is not None:
        order = order[rows[order]]
    bounds = np.searchsorted(template[order], np.arange(len(ranks) + 1))
    pieces, member, rank = [], [], []
    for r, t, j in sorted((r, t, j) for t, m in enumerate(ranks) for j, r in enumerate(m) if only in (None, r)):
        pieces.append(order[bounds[t]:bounds[t + 1]])
        member.append(np.full(bounds[t + 1] - bounds[t], j, dtype=I64))
        rank.append(np.full(bounds[t + 1] - bounds[t], r, dtype=I64))
    if not pieces:
        return np.zeros(0, dtype=I64), np.zeros(0, dtype=I64), np.zeros(0, dtype=I64)
    return np.concatenate(pieces), np.concatenate(member), np.concatenate(rank)


@dataclass(frozen=True, eq=False)
class Line:
    """Where the bytes of every holder set are cut between its holders (see :func:`line`).

    A *block* is the groups of one template with one holder set; a *bm* is a
    block once per member rank of its template, laid on its set's line.
    """

    block_id: np.ndarray     # per template group: its block (-1: a cell with one holder)
    inblock: np.ndarray      # per template group: its byte position inside its block
    bm_first: np.ndarray     # per block: its first bm (the bm of member j is bm_first + j)
    pos: np.ndarray          # per bm: where it starts on the line (all sets' lines end to end)
    first_cut: np.ndarray    # per bm: the first cut after its start
    last_cut: np.ndarray     # per bm: the first cut at or after its end
    cut_base: np.ndarray     # per bm: its set's first cut
    bm_set: np.ndarray       # per bm: its set
    cuts: np.ndarray         # every set's k - 1 cut positions, set after set
    set_ranks: list[list[int]]   # per set: its holder ranks, in slot order

    def digest_parts(self) -> list[np.ndarray]:
        """The decisions (cut positions, holders in slot order) as arrays, for the plan digest."""
        flat = [r for ranks in self.set_ranks for r in ranks]
        return [self.cuts, np.array([len(r) for r in self.set_ranks], dtype=I64), np.array(flat, dtype=I64)]


def line(g: Columns, cells: Cells, ranks: list[list[int]], entry_rank: np.ndarray) -> Line:
    """Balance the groups of cells with k holders: each holder set's line and where it is cut.

    ``g`` holds the template groups (one copy per distinct target
    description); ``ranks`` the member ranks of each template.  The groups of
    each holder set are laid end to end, in (target rank, target offset)
    order, and that line is cut into k lengths (the holders' shares from
    :func:`shares`), the i-th going to the holder with the i-th lowest rank.
    Everything here is per block, never per target rank's group, so it costs
    the same for a plan of one rank as for the whole plan.
    """
    cell = g["cell"]
    k = cells.ptr[cell + 1] - cells.ptr[cell]
    length = g["count"] * g["nbytes"]
    n = len(cell)
    block_id = np.full(n, -1, dtype=I64)
    inblock = np.zeros(n, dtype=I64)
    mt = np.flatnonzero(k > 1)
    z = np.zeros(0, dtype=I64)
    if len(mt) == 0:
        return Line(block_id, inblock, z, z, z, z, z, z, z, [])
    hs = cells.holder_set[cell]
    count = np.array([len(m) for m in ranks], dtype=I64)
    flat = np.array([r for m in ranks for r in m], dtype=I64)
    # blocks of one template: its groups of one holder set, in target offset order
    bkey = hs[mt] * len(ranks) + g["template"][mt]
    border = np.lexsort((g["dst"][mt], bkey))
    order, bkey = mt[border], bkey[border]
    bstarts = segment_starts(bkey)
    size = length[order]
    cum = np.cumsum(size)
    block_of = np.repeat(np.arange(len(bstarts)), np.diff(np.append(bstarts, len(order))))
    inblock[order] = cum - size - (cum[bstarts] - size[bstarts])[block_of]
    block_id[order] = block_of
    b_total = np.add.reduceat(size, bstarts)
    b_hs, b_tpl = hs[order[bstarts]], g["template"][order[bstarts]]
    # each block once per member rank ("bm"), laid on its holder set's line in rank order
    bm_b, bm_j = expand_ranges(np.zeros(len(bstarts), dtype=I64), count[b_tpl])
    bm_first = np.cumsum(count[b_tpl]) - count[b_tpl]
    bm_rank = flat[(np.cumsum(count) - count)[b_tpl[bm_b]] + bm_j]
    bm_total, bm_hs = b_total[bm_b], b_hs[bm_b]
    on_line = np.lexsort((bm_rank, bm_hs))
    pos = np.zeros(len(bm_b), dtype=I64)
    pos[on_line] = np.cumsum(bm_total[on_line]) - bm_total[on_line]
    sets = segment_starts(bm_hs[on_line])
    set_hs = bm_hs[on_line][sets]
    set_total = np.add.reduceat(bm_total[on_line], sets)
    hs_k = np.zeros(int(hs.max()) + 1, dtype=I64)
    hs_k[hs[mt]] = k[mt]
    set_k = hs_k[set_hs]
    set_of_hs = np.zeros(len(hs_k), dtype=I64)
    set_of_hs[set_hs] = np.arange(len(sets))
    # the holder ranks of each set, in slot order, and the bytes that only one rank holds
    first_row = np.zeros(len(hs_k), dtype=I64)
    first_row[hs[mt][::-1]] = mt[::-1]
    set_cell = cell[first_row[set_hs]]
    set_ranks = [entry_rank[cells.entries[cells.ptr[c]:cells.ptr[c + 1]]].tolist() for c in set_cell.tolist()]
    one = np.flatnonzero(k == 1)
    fixed = np.bincount(entry_rank[cells.entries[cells.ptr[cell[one]]]],
                        weights=(length[one] * count[g["template"][one]]).astype(np.float64))
    # cut j of a set (j = 1..k-1) lies at its base + the shares of its first j holders
    within = [np.cumsum(x)[:-1] for x in shares(set_ranks, set_total.tolist(), fixed)]
    cuts = np.repeat(pos[on_line][sets], set_k - 1) + np.concatenate([*within, np.zeros(0, dtype=I64)]).astype(I64)
    bm_set = set_of_hs[bm_hs]
    cut_base = (np.cumsum(set_k - 1) - (set_k - 1))[bm_set]
    first_cut = np.searchsorted(cuts, pos, side="right")
    last_cut = np.searchsorted(cuts, pos + bm_total, side="left")
    return Line(block_id, inblock, bm_first, pos, first_cut, last_cut, cut_base, bm_set, cuts, set_ranks)


def source_members(g: Columns, cells: Cells, ln: Line, ranks: list[list[int]], entry_rank: np.ndarray,
                   source: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`members` for the rows source rank ``source`` may feed (a superset: cut to size later).

    Groups of cells with one holder: those it holds.  Groups of cells with k
    holders: those of the bms whose stretch of its set's line reaches its
    share.  Only template groups it holds at all are copied to the members.
    """
    cell = g["cell"]
    holds = np.zeros(len(cell), dtype=bool)
    one = np.flatnonzero(ln.block_id < 0)
    holds[one] = entry_rank[cells.entries[cells.ptr[cell[one]]]] == source
    slot = np.array([r.index(source) if source in r else -1 for r in ln.set_ranks], dtype=I64)
    shared = np.flatnonzero(ln.block_id >= 0)
    holds[shared] = slot[ln.bm_set[ln.bm_first[ln.block_id[shared]]]] >= 0
    row, member, rank = members(g, ranks, rows=holds)
    bm_slot = slot[ln.bm_set]
    reach = (bm_slot >= 0) & (ln.first_cut - ln.cut_base <= bm_slot) & (bm_slot <= ln.last_cut - ln.cut_base)
    block = ln.block_id[row]
    keep = np.ones(len(row), dtype=bool)
    multi = np.flatnonzero(block >= 0)
    keep[multi] = reach[ln.bm_first[block[multi]] + member[multi]]
    return row[keep], member[keep], rank[keep]


def assign(g: Columns, ln: Line, row: np.ndarray, member: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                               np.ndarray]:
    """Choose a holder for every group of every target rank, cutting groups of replicated bytes into parts.

    ``row``/``member`` expand the template groups to target ranks (all of
    them, or the rows one rank needs).  Returns parts in row order as (row,
    holder slot in the cell, byte offset into the group, bytes).  Groups of
    cells with one holder go whole to it; the others to the holder whose
    share of the line (``ln``) they lie on, cut at row boundaries (element
    boundaries for single runs) where a cut falls inside them -- only rows of
    bms a cut falls into are looked at one by one.
    """
    length = g["count"] * g["nbytes"]
    slot = np.zeros(len(row), dtype=I64)
    inside = np.zeros(len(row), dtype=I64)
    rows = np.flatnonzero(ln.block_id[row] >= 0)
    if len(rows) == 0:
        return row_parts(row, slot, inside, length, g, ln.cuts, np.zeros(0, dtype=I64))
    bm = ln.bm_first[ln.block_id[row[rows]]] + member[rows]
    slot[rows] = ln.first_cut[bm] - ln.cut_base[bm]
    hit = np.flatnonzero(ln.last_cut[bm] > ln.first_cut[bm])
    if len(hit):  # rows of bms a cut falls into: where exactly
        r, b = rows[hit], bm[hit]
        start = ln.pos[b] + ln.inblock[row[r]]
        first = np.searchsorted(ln.cuts, start, side="right")
        slot[r] = first - ln.cut_base[b]
        inside[r] = np.maximum(np.searchsorted(ln.cuts, start + length[row[r]], side="left") - first, 0)
        starts = np.zeros(len(row), dtype=I64)
        starts[r] = start
        return row_parts(row, slot, inside, length, g, ln.cuts, starts)
    return row_parts(row, slot, inside, length, g, ln.cuts, np.zeros(0, dtype=I64))


def shares(holders: list[list[int]], totals: list[int], fixed: np.ndarray, passes: int = 64) -> list[list[int]]:
    """Bytes each holder of each holder set carries: water-filling over the ranks' loads.

    ``holders[s]`` are the ranks of set s, ``totals[s]`` its bytes,
    ``fixed[r]`` what rank r sends anyway (bytes only it holds).  Sets are
    taken most constrained first (fewest holders, then most bytes, then
    ranks), each poured onto its least-loaded holders up to a common level;
    later passes take each set's bytes back and pour them again (until no
    share moves by a byte, at most ``passes`` times), so a rank that belongs
    to many sets (a full replica beside shards) ends up with its fair part,
    not 1/k of every set.  Sets of ranks that share no other set split
    evenly after one pass.  Deterministic; integer shares sum to each total.
    """
    load = {r: float(fixed[r]) if r < len(fixed) else 0.0 for h in holders for r in h}
    given: list[list[float]] = [[0.0] * len(h) for h in holders]
    order = sorted(range(len(holders)), key=lambda s: (len(holders[s]), -totals[s], holders[s]))
    for _ in range(passes):
        moved = 0.0
        for s in order:
            for r, x in zip(holders[s], given[s]):
                load[r] -= x
            before = given[s]
            level = [load[r] for r in holders[s]]
            pool, below, wet = float(totals[s]), 0.0, 0
            for height in sorted(level):  # raise the water over the lowest holders until it stops short
                if wet and (pool + below) / wet <= height:
                    break
                below += height
                wet += 1
            water = (pool + below) / wet
            given[s] = [max(0.0, water - h) for h in level]
            moved = max(moved, max(abs(x - y) for x, y in zip(given[s], before)))
            for r, x in zip(holders[s], given[s]):
                load[r] += x
        if moved < 1.0:
            break
    out = []
    for s, part in enumerate(given):
        marks = [0] + [min(totals[s], round(v)) for v in itertools.accumulate(part)]
        marks[-1] = totals[s]
        out.append([max(b - a, 0) for a, b in itertools.pairwise(marks)])
    return out


def row_parts(row: np.ndarray, slot: np.ndarray, inside: np.ndarray, length: np.ndarray, g: Columns,
              cuts: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(row, slot, skip, bytes) per part, in row order: one part per row, one more for each cut inside it."""
    size = length[row]
    if not inside.any():
        return np.arange(len(row), dtype=I64), slot, np.zeros(len(row), dtype=I64), size
    counts = inside + 1
    part = np.repeat(np.arange(len(row), dtype=I64), counts)
    out_slot, lo, hi = slot[part], np.zeros(len(part), dtype=I64), size[part]
    split = np.flatnonzero(inside)
    p, ts = expand_ranges(np.zeros(len(split), dtype=I64), counts[split])
    r = split[p]
    at = (np.cumsum(counts) - counts)[r] + ts     # where each part of a cut row sits in the output
    tr = row[r]
    grain = np.where(g["count"][tr] > 1, g["nbytes"][tr], g["item"][tr])
    s, span = start[r], size[r]
    first = np.searchsorted(cuts, s, side="right")

    def snapped(index: np.ndarray) -> np.ndarray:
        q = cuts[np.clip(index, 0, len(cuts) - 1)] - s
        return np.clip((q + grain // 2) // grain * grain, 0, span)

    lo[at] = np.where(ts == 0, 0, snapped(first + ts - 1))
    hi[at] = np.where(ts == inside[r], span, snapped(first + ts))
    out_slot[at] += ts
    if np.all(hi[at] > lo[at]):
        return part, out_slot, lo, hi - lo
    keep = np.flatnonzero(hi > lo)  # two cuts snapped onto one row boundary
    return part[keep], out_slot[keep], lo[keep], (hi - lo)[keep]


def finish(g: Columns, cells: Cells, row: np.ndarray, rank: np.ndarray, part: np.ndarray, slot: np.ndarray,
           skip: np.ndarray, size: np.ndarray, entry_rank: np.ndarray, entry_off: np.ndarray,
           entry_region: np.ndarray, entry_stride: np.ndarray, only: int | None = None) -> Columns:
    """Final runs sorted by (source, target, target offset): each part read from its holder's own local tensor.

    ``only``: the runs of that source rank alone.
    """
    first = cells.ptr[g["cell"]]
    src_rank = entry_rank[cells.entries[first[row[part]] + slot]]
    if only is not None:
        mine = np.flatnonzero(src_rank == only)
        part, slot, skip, size, src_rank = part[mine], slot[mine], skip[mine], size[mine], src_rank[mine]
    # parts come in (target, target offset) order: a stable sort by source finishes the job; then only the
    # part columns move, everything else is looked up again in the (small, cached) template columns
    top = int(src_rank.max()) if len(src_rank) else 0
    order = np.argsort(src_rank.astype(np.uint16) if top < 1 << 16 else src_rank, kind="stable")
    part, slot, skip, size = part[order], slot[order], skip[order], size[order]
    tr = row[part]
    cell = g["cell"][tr]
    entry = cells.entries[first[tr] + slot]
    src_rank = src_rank[order]
    rel, src_stride = g["src_rel"][tr], g["src_stride"][tr]
    odd = np.flatnonzero(~cells.uniform[cell])
    if len(odd):  # holders whose boxes differ: offsets from each one's own box
        sub = {key: g[key][tr[odd]] for key in ("item", "coord", "sd")}
        rel[odd], src_stride[odd] = source_offsets(sub, entry_off, entry_stride, entry[odd])
    nb = g["nbytes"][tr]
    strided = g["count"][tr] > 1
    rows_skip = np.where(strided, skip // np.maximum(nb, 1), 0)
    dst_stride = g["dst_stride"][tr]
    count = np.where(strided, size // np.maximum(nb, 1), 1)
    out = {
        "src_rank": src_rank,
        "dst_rank": rank[part],
        "src_off": entry_region[entry] + rel + np.where(strided, rows_skip * src_stride, skip),
        "dst_off": g["dst"][tr] + np.where(strided, rows_skip * dst_stride, skip),
        "nbytes": np.where(strided, nb, size),
        "count": count,
        "src_stride": np.where(count > 1, src_stride, 0),
        "dst_stride": np.where(count > 1, dst_stride, 0),
    }
    same = (out["src_rank"][1:] == out["src_rank"][:-1]) & (out["dst_rank"][1:] == out["dst_rank"][:-1])
    if np.any(same & (out["dst_off"][1:] < out["dst_off"][:-1])):
        # a strided group cut between holders starts its later rows past groups interleaved with it
        order = np.lexsort((out["dst_off"], out["dst_rank"], out["src_rank"]))
        out = {key: value[order] for key, value in out.items()}
    return out


def coalesce(p: Columns) -> Columns:
    """Merge neighbouring single runs of one pair that are contiguous in both regions (input sorted by pair)."""
    n = len(p["src_rank"])
    if n == 0:
        return p
    single = p["count"] == 1
    joins = np.zeros(n, dtype=bool)
    joins[1:] = ((p["src_rank"][1:] == p["src_rank"][:-1]) & (p["dst_rank"][1:] == p["dst_rank"][:-1])
                 & single[1:] & single[:-1]
                 & (p["src_off"][:-1] + p["nbytes"][:-1] == p["src_off"][1:])
                 & (p["dst_off"][:-1] + p["nbytes"][:-1] == p["dst_off"][1:]))
    if not joins.any():
        return p
    starts = np.flatnonzero(~joins)
    merged = {k: v[starts] for k, v in p.items()}
    merged["nbytes"] = np.add.reduceat(p["nbytes"], starts)
    return merged
