"""A source rank's quantized shards: FP8 values and scales written into its region at every push.

Targets that serve FP8 (:func:`tensorxfer.sync.spec.quantized_target`) ask for *derived* tensors: a global
tensor's FP8 values and its block scales (:mod:`tensorxfer.quant.layout`).  Each source makes them for
the shards it holds, so the wire carries FP8 (half the bytes of bf16) and the targets only land bytes:
no staging, no second pass, no bf16 copy on the inference side.

A block lies either wholly inside one source's shard -- that source knows its amax -- or across
shards (FSDP2's uneven ``Shard(0)`` cuts rows anywhere; a per-tensor scale spans every shard).  For
those, the sources agree on the amax in **one round through the group's store**: each publishes, in
one sealed record per step, its partial amaxes of the blocks it shares, and reads the records of the
sources it shares blocks with (found once per membership epoch from their descriptions).  Every
source then holds the same whole-block amax, so each quantizes its own rows of a shared block and the
scale of that block is the same wherever it is read; the planner takes it from one of them.  Why not
send those rows in bf16 and let the target finish the block?  It would need staging and a quantizer on
every target, two paths through every transport, and a target that sees a block only partly; the
round costs one small store record per source per step, taken before the step's offers go out (a
NaN anywhere then fails the step before a byte is offered, and every target fed by a source that
could not quantize gets the same error, naming the tensor); the shards that share no block are
quantized while the peers' records come, the others once the offers are out.

A NaN or an infinity in a shard is found while the amaxes are taken, before any offer goes out: the
push raises :class:`~tensorxfer.errors.QuantizationError` naming the tensor, and the targets it feeds
fail the step with the same error.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorxfer.errors import QuantizationError, StoreError
from tensorxfer.quant.layout import Grid, Quantization, derived_name, parse_derived
from tensorxfer.quant.quantize import _split, block_amax, check_finite, quantize_into
from tensorxfer.sync.records import Amaxes, GroupStore
from tensorxfer.sync.spec import Box, RankSpec

__all__ = ["QuantStats", "QuantizedShard", "SourceQuantizer"]


@dataclass(frozen=True)
class QuantStats:
    """One push's quantization on a source: FP8 bytes written, those of blocks shared with other sources
    (quantized after the amax round), blocks exchanged, seconds spent waiting for the peers' amaxes."""

    values_bytes: int = 0
    shared_bytes: int = 0
    shared_blocks: int = 0
    peers: int = 0
    wait_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"values_bytes": self.values_bytes, "shared_bytes": self.shared_bytes,
                "shared_blocks": self.shared_blocks, "peers": self.peers, "wait_seconds": self.wait_seconds}


class QuantizedShard:
    """One quantized shard of a source: the trainer's tensor ``local`` (a box of global tensor ``name`` at
    ``offsets``), and the region views it is quantized into (``values``; ``scales``: the blocks it
    touches)."""

    def __init__(self, name: str, shape: tuple[int, ...], offsets: tuple[int, ...], q: Quantization, local: Any,
                 values: Any, scales: Any) -> None:
        self.name, self.q, self.local, self.values, self.scales = name, q, local, values, scales
        self.offsets, self.sizes = offsets, tuple(int(s) for s in local.shape)
        self.grid: Grid = q.grid(shape)
        self.first, self.count = self.grid.cells(offsets, self.sizes)
        self.key = derived_name(name, q, "scales")
        self.values_name = derived_name(name, q, "values")
        self.empty = math.prod(self.sizes) == 0
        self._index: dict[Any, Any] = {}
        self._shared_cells()

    def _shared_cells(self) -> None:
        """The cells this shard touches but does not hold whole: their flat positions in its cells, and
        their flat indices in the global grid (sorted alike); the value bytes that lie in them."""
        if self.empty:
            self.shared_pos = self.shared_ids = np.zeros(0, np.int64)
            self.shared_bytes = 0
            return
        whole = self.grid.whole(self.offsets, self.sizes)
        count = self.count
        mask = np.zeros(count, dtype=bool)
        for d, (first_whole, last_whole) in enumerate(whole):
            index: list[Any] = [slice(None)] * len(count)
            if not first_whole:
                index[d] = 0
                mask[tuple(index)] = True
            if not last_whole:
                index[d] = count[d] - 1
                mask[tuple(index)] = True
        self.shared_pos = np.flatnonzero(mask).astype(np.int64)
        cells = np.stack(np.unravel_index(self.shared_pos, count), axis=-1) + np.array(self.first, np.int64)
        self.shared_ids = (np.ravel_multi_index(cells.T, self.grid.scale_shape).astype(np.int64)
                           if len(self.shared_pos) else np.zeros(0, np.int64))
        if self.grid.per_tensor:
            inner = 0 if len(self.shared_pos) else math.prod(self.sizes)
        else:
            inner = 1
            for (first_whole, last_whole), o, s, b in zip(whole, self.offsets, self.sizes, self.grid.block):
                lengths = _split(o, s, b)
                cut = (0 if first_whole else lengths[0]) + (0 if last_whole or len(lengths) == 1 else lengths[-1])
                inner *= max(s - cut, 0)
        self.shared_bytes = math.prod(self.sizes) - inner      # FP8: one byte per value

    def index_on(self, device: Any) -> Any:
        """:attr:`shared_pos` as a tensor on ``device`` (made once per device)."""
        import torch

        found = self._index.get(device)
        if found is None:
            found = self._index[device] = torch.from_numpy(self.shared_pos).to(device)
        return found

    def halo(self) -> Box:
        """The elements of the blocks this shard touches (its box grown to block edges)."""
        if self.grid.per_tensor:
            return Box((0,) * len(self.grid.shape), self.grid.shape)
        lo = tuple(f * b for f, b in zip(self.first, self.grid.block))
        hi = tuple(min((f + c) * b, n) for f, c, b, n in zip(self.first, self.count, self.grid.block, self.grid.shape))
        return Box(lo, tuple(h - low for low, h in zip(lo, hi)))


def _intersects(a: Box, b: Box) -> Box | None:
    lo = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a.offsets, a.sizes, b.offsets, b.sizes))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return Box(lo, tuple(h - low for low, h in zip(lo, hi)))


def _inside(a: Box, b: Box) -> bool:
    return all(x >= y and x + s <= y + t for x, s, y, t in zip(a.offsets, a.sizes, b.offsets, b.sizes))


class SourceQuantizer:
    """Quantizes a source's shards at every push, agreeing on shared blocks with the other sources.

    :meth:`agree` (before the offers: a step that cannot be quantized offers nothing) takes every shard's
    block amaxes, checks them and agrees on the shared ones, quantizing the shards that share nothing while
    the peers' amaxes come; :meth:`quantize` (after the offers, while the targets take them in) writes the
    rest.
    """

    def __init__(self, shards: list[QuantizedShard], store: GroupStore, rank: int, stall_timeout: float) -> None:
        self.shards, self.store, self.rank, self.stall_timeout = shards, store, rank, stall_timeout
        self._peers: tuple[int, ...] = ()
        self._amax: list[Any] = []
        self._done: list[bool] = []
        self._wait = 0.0

    def plan(self, sources: list[RankSpec]) -> None:
        """Find the peers of this epoch's members: sources whose shard of a tensor reaches into a block
        that one of ours shares."""
        wanted = {s.values_name: s for s in self.shards if len(s.shared_ids)}
        peers: set[int] = set()
        for spec in sources:
            if spec.rank == self.rank:
                continue
            for t in spec.tensors:
                mine = wanted.get(t.name)
                if mine is None or t.box.empty:
                    continue
                own = Box(mine.offsets, mine.sizes)
                met = _intersects(t.box, mine.halo())
                if met is not None and not _inside(met, own):
                    peers.add(spec.rank)
                    break
        self._peers = tuple(sorted(peers))

    def agree(self, version: int) -> None:
        """Every shard's block amaxes for step ``version``, the shared ones agreed with the peers (published,
        then theirs folded in).  Runs before the offers go out, so that nothing is offered for a step that
        cannot be quantized: QuantizationError for a NaN or an infinity here or at a peer, naming the tensor.

        The device is waited for a fixed number of times a step, not per shard (measured on the H100: two
        to four synchronizations per shard of ~550, in six processes sharing the GPU, cost ~1 s a step)."""
        self._amax = [None if s.empty else block_amax(s.local, s.grid, s.offsets) for s in self.shards]
        try:
            self._check_finite()
        except QuantizationError as e:
            if self._peers:     # they would wait for amaxes that will not come: they fail with this
                self.store.put(self._key(version, self.rank), Amaxes({}, str(e), e.tensor).encode())
            raise
        self._wait = 0.0
        self._done = [False] * len(self.shards)
        later = [(s, a) for s, a in zip(self.shards, self._amax) if a is not None and len(s.shared_pos)]
        if not later:
            return
        mine = _to_host([a.reshape(-1)[s.index_on(a.device)] for s, a in later])
        self.store.put(self._key(version, self.rank), Amaxes({
            s.key: (s.shared_ids.astype("<i8").tobytes(), m.astype("<f4").tobytes())
            for (s, _), m in zip(later, mine)}).encode())
        # while the peers' records come: the shards that share nothing (GPU kernels run on meanwhile)
        for i, (s, amax) in enumerate(zip(self.shards, self._amax)):
            if amax is not None and not len(s.shared_pos):
                quantize_into(s.local, s.grid, s.offsets, s.q, amax, s.values, s.scales)
                self._done[i] = True
        t0 = time.perf_counter()
        self._merge(version, later, mine)
        self._wait = time.perf_counter() - t0

    def _check_finite(self) -> None:
        """QuantizationError naming the first shard with a NaN or an infinity: one wait per device."""
        import torch

        live = [amax for amax in self._amax if amax is not None]
        if all(bool(torch.isfinite(torch.cat([live[j].reshape(-1) for j in js])).all())
               for js in _by_device(live).values()):
            return
        for s, amax in zip(self.shards, self._amax):
            if amax is not None:
                check_finite(amax, s.name, s.grid, s.first)

    def quantize(self) -> QuantStats:
        """Quantize every shard :meth:`agree` left into the region, with the amaxes it found."""
        values_bytes = shared_bytes = blocks = 0
        for s, amax, done in zip(self.shards, self._amax, self._done):
            if amax is None:
                continue
            values_bytes += s.values.numel()
            shared_bytes += s.shared_bytes
            blocks += len(s.shared_pos)
            if not done:
                quantize_into(s.local, s.grid, s.offsets, s.q, amax, s.values, s.scales)
        return QuantStats(values_bytes, shared_bytes, blocks, len(self._peers), self._wait)

    def _merge(self, version: int, later: list[tuple[QuantizedShard, Any]], mine: list[np.ndarray]) -> None:
        """The peers' partial amaxes of step ``version`` folded into ours (``mine``: the shared cells' own, on
        the host; then each block's amax over all of it, written back into the shards' amaxes)."""
        import torch

        keys = [self._key(version, r) for r in self._peers]
        records = [Amaxes.decode(k, v) for k, v in zip(keys, self.store.get(keys, self.stall_timeout))]
        for rank, record in zip(self._peers, records):
            if record.error is not None:
                raise QuantizationError(f"source rank {rank} shares blocks with this one and could not quantize: "
                                        f"{record.error}", record.tensor)
        for (s, _), merged in zip(later, mine):
            for key, record in zip(keys, records):
                part = record.parts.get(s.key)
                if part is None:
                    continue
                ids = np.frombuffer(part[0], "<i8")
                theirs = np.frombuffer(part[1], "<f4")
                if not np.all(np.isfinite(theirs)) or np.any(theirs < 0):
                    raise StoreError(f"the store's {key!r} holds amaxes of {s.name!r} that are no amaxes", key)
                at = np.searchsorted(s.shared_ids, ids)
                hit = at < len(s.shared_ids)
                hit[hit] = s.shared_ids[at[hit]] == ids[hit]
                np.maximum.at(merged, at[hit], theirs[hit])
        # back where the amaxes live: one copy per device, then a scatter per shard on the device
        for device, js in _by_device([amax for _, amax in later]).items():
            back = torch.from_numpy(np.concatenate([mine[j] for j in js])).to(device)
            start = 0
            for j in js:
                s, amax = later[j]
                n = len(s.shared_pos)
                amax.reshape(-1)[s.index_on(device)] = back[start:start + n]
                start += n

    def _key(self, version: int, rank: int) -> str:
        return self.store.key("amax", version, rank)


def _by_device(tensors: list[Any]) -> dict[Any, list[int]]:
    """The tensors' positions, grouped by the device each lives on (one transfer or wait per device)."""
    out: dict[Any, list[int]] = {}
    for j, t in enumerate(tensors):
        out.setdefault(t.device, []).append(j)
    return out


def _to_host(parts: list[Any]) -> list[np.ndarray]:
    """Small device tensors as float32 numpy arrays: one copy (one wait) per device."""
    import torch

    out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(parts)
    for js in _by_device(parts).values():
        host = torch.cat([parts[j].float() for j in js]).cpu().numpy()
        at = 0
        for j in js:
            n = parts[j].numel()
            out[j] = host[at:at + n].copy()
            at += n
    return out


def requested(targets: list[RankSpec]) -> dict[str, set[Quantization]]:
    """Global tensor name -> the layouts the targets ask it in."""
    out: dict[str, set[Quantization]] = {}
    for spec in targets:
        for t in spec.tensors:
            for piece in t.pieces:
                found = None if piece.is_filled else parse_derived(piece.source_name)
                if found is not None:
                    out.setdefault(found[0], set()).add(found[1])
    return out
