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
round costs one small store record per source per step.  The order of a push (all of it before the
step's offers go out): the shared cells' amaxes first (a small part of the cells), published at once;
then the cells no other source shares, amax and values in one kernel launch, while the peers' records
come; then the shared cells with the agreed amaxes.  A source whose own cells are done posts its data
while the others still quantize (measured on the H100, 16 GB from 4 sources: ~30 ms a step when every
source waited for all the amaxes before quantizing anything).

Where a target shares the source's GPU, the pair quantizes on the way instead (:mod:`tensorxfer.sync.fusing`):
its tiles read the source's input and write the FP8 values and scales straight into the target -- the blocks
the source holds whole from the step's start, the blocks it shares after this round, with the agreed amaxes
this source wrote into its region (:class:`_AgreedAmaxes`: one host-to-device copy).  A tensor every pair
reading it fuses is then made here not at all (:meth:`SourceQuantizer.plan`): the source takes only its
shared blocks' amaxes for the round, one kernel.  The order of such a push: the whole blocks' tiles offered,
that kernel launched (before the tiles can run: the GPU time-slices between processes, and a kernel of this one's
amid the copy host's tiles costs them ~0.3 ms), the tiles posted, the amaxes read back and published, the peers'
merged and written, the shared blocks' tiles offered.

A NaN or an infinity in a shard is found before any offer goes out: the push raises
:class:`~tensorxfer.errors.QuantizationError` naming the tensor, and the targets it feeds fail the step
with the same error; in a shared block, the peers sharing it fail too (a poisoned record).  In a block a pair
quantizes on the way, the pair finds it (writing nothing of that block): that target's step fails with the
error, and so does this source's push; targets whose blocks hold none land the step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorxfer.errors import QuantizationError, StoreError
from tensorxfer.quant import kernel
from tensorxfer.quant.kernel import ShardTable
from tensorxfer.quant.layout import Grid, Quantization, derived_name, parse_derived
from tensorxfer.quant.quantize import _split as _block_lengths
from tensorxfer.quant.quantize import check_finite, torch_block_amax, torch_quantize_into
from tensorxfer.sync.records import Amaxes, GroupStore
from tensorxfer.sync.spec import Box, RankSpec

__all__ = ["QuantStats", "QuantizedShard", "SourceQuantizer"]


@dataclass(frozen=True)
class QuantStats:
    """One push's quantization on a source: FP8 bytes it wrote, those of blocks shared with other sources
    (quantized after the amax round, here or by the pairs), blocks exchanged, seconds spent waiting for the
    peers' amaxes, and seconds the whole quantization took (before anything that reads what it makes was
    offered; a fused pair's tiles of whole blocks were offered before its first half, which ended
    ``begin_seconds`` in: the shared amaxes read back and published); and the FP8 bytes its pairs on its GPU
    made on the way from its input instead (``fused_bytes``, reading ``fused_input_bytes`` of the input:
    :mod:`tensorxfer.sync.fusing`)."""

    values_bytes: int = 0
    shared_bytes: int = 0
    shared_blocks: int = 0
    peers: int = 0
    wait_seconds: float = 0.0
    seconds: float = 0.0
    fused_bytes: int = 0
    fused_input_bytes: int = 0
    begin_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"values_bytes": self.values_bytes, "shared_bytes": self.shared_bytes,
                "shared_blocks": self.shared_blocks, "peers": self.peers, "wait_seconds": self.wait_seconds,
                "seconds": self.seconds, "fused_bytes": self.fused_bytes,
                "fused_input_bytes": self.fused_input_bytes, "begin_seconds": self.begin_seconds}


@dataclass(frozen=True)
class _Round:
    """A push's quantization between :meth:`SourceQuantizer.begin` and :meth:`SourceQuantizer.finish`: the
    step, when it began, the shards with shared cells and their own amaxes of those (on the host), and the
    seconds the first half took."""

    version: int
    t0: float
    shared: list[QuantizedShard]
    seconds: float
    flat: np.ndarray            # the shared cells' amaxes, shard after shard (:class:`_RoundIndex`)


class _RoundIndex:
    """A source's shared cells in the round's order (``shards``: those with shared cells, device after device), as
    one flat array: where each shard's lie in it, its record entry's ids (encoded once), and every cell as a
    sorted code ``(shard << 40) | cell id`` (at its place in the flat array), so that a peer's whole record
    folds in with a few array operations (one search, one maximum) instead of a dozen per shard and peer:
    ~6 ms of Python per source in the 16 GB bench's round, which held up the shared blocks' offers."""

    SHIFT = 40      # cell ids of one scale grid: far below 2**40

    def __init__(self, shards: list[QuantizedShard]) -> None:
        self.shards = shards
        lengths = [len(s.shared_ids) for s in shards]
        self.starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.ids_bytes = [s.shared_ids.astype("<i8").tobytes() for s in shards]
        self.by_key: dict[str, list[int]] = {}
        for k, s in enumerate(shards):
            self.by_key.setdefault(s.key, []).append(k)
        # sorted as they stand: a shard's shared ids ascend (its cells row-major in a box of the row-major grid)
        self.codes = np.concatenate([(np.int64(k) << self.SHIFT) | s.shared_ids.astype(np.int64) for k, s in
                                     enumerate(shards)] or [np.zeros(0, np.int64)])

    def split(self, flat: np.ndarray) -> list[np.ndarray]:
        """Each shard's part of ``flat`` (views)."""
        return [flat[a:b] for a, b in zip(self.starts[:-1], self.starts[1:])]

    def record(self, flat: np.ndarray) -> Amaxes:
        """This source's record of the round: each shard's shared cells' ids and amaxes (``flat``)."""
        raw = flat.astype("<f4", copy=False).tobytes()
        return Amaxes({s.key: (self.ids_bytes[k], raw[4 * int(self.starts[k]):4 * int(self.starts[k + 1])])
                       for k, s in enumerate(self.shards)})

    def fold(self, flat: np.ndarray, record: Amaxes, key: str) -> None:
        """A peer's ``record`` (read from store key ``key``) folded into ``flat``: the maximum, cell by cell, of
        every amax it holds for a cell of ours (the rest of it is not ours to read).

        Raises
        ------
        StoreError
            An amax of a tensor we share is negative or not finite: the record is not one a source wrote.
        """
        entries = [(k, part) for name, part in record.parts.items() for k in self.by_key.get(name, ())]
        if not entries:
            return
        ids = np.frombuffer(b"".join(part[0] for _, part in entries), "<i8")
        theirs = np.frombuffer(b"".join(part[1] for _, part in entries), "<f4")
        counts = np.fromiter((len(part[0]) // 8 for _, part in entries), np.int64, len(entries))
        shard = np.repeat(np.fromiter((k for k, _ in entries), np.int64, len(entries)), counts)
        bad = ~np.isfinite(theirs) | (theirs < 0)
        if bad.any():
            name = self.shards[int(shard[int(np.argmax(bad))])].name
            raise StoreError(f"the store's {key!r} holds amaxes of {name!r} that are no amaxes", key)
        ours = (ids >= 0) & (ids < (1 << self.SHIFT))       # any other id is no cell of ours
        codes = (shard[ours] << self.SHIFT) | ids[ours]
        at = np.searchsorted(self.codes, codes)
        hit = at < len(self.codes)
        hit[hit] = self.codes[at[hit]] == codes[hit]
        np.maximum.at(flat, at[hit], theirs[ours][hit])


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
        self.agreed_at: int | None = None   # its first cell's place among the agreed amaxes (an input's: fusing)
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
                lengths = _block_lengths(o, s, b)
                cut = (0 if first_whole else lengths[0]) + (0 if last_whole or len(lengths) == 1 else lengths[-1])
                inner *= max(s - cut, 0)
        self.shared_bytes = math.prod(self.sizes) - inner      # FP8: one byte per value

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


class _DeviceShards:
    """A source's quantized shards on one device, and their cells' amaxes in one flat float32 tensor there.

    The shards the kernels take come first, in a :class:`~tensorxfer.quant.kernel.ShardTable` (two launches a
    step for all of them); the others (a CPU, 1-D or 3-D shards, one-row blocks) run torch's operations one
    by one, their amaxes copied into their slice of the flat tensor.  So checking the amaxes, reading the
    shared ones out and writing the agreed ones back are one operation each per device, not per shard.
    """

    def __init__(self, shards: list[QuantizedShard]) -> None:
        import torch

        fast = [s for s in shards if _takes_kernel(s)]
        self.shards = fast + [s for s in shards if not _takes_kernel(s)]
        self.table = (ShardTable([(s.local, s.grid, s.offsets, s.q, s.values, s.scales) for s in fast])
                      if fast else None)
        self.fast = len(fast)
        device = self.shards[0].local.device
        starts = np.concatenate([[0], np.cumsum([math.prod(s.count) for s in self.shards])]).astype(np.int64)
        self._starts = starts
        # zeros: the cells a pair quantizes on the way are never taken here, and stay finite
        self.amax = torch.zeros(int(starts[-1]), dtype=torch.float32, device=device)
        if self.table is not None:
            self.table.amax = self.amax[:self.table.cells]     # the kernels write into the flat tensor
        self.views = [self.amax[starts[i]:starts[i + 1]].view(s.count) for i, s in enumerate(self.shards)]
        # the shared cells' places in the flat tensor, shard after shard (the order of the amax records)
        self.shared_shards = [i for i, s in enumerate(self.shards) if not s.empty and len(s.shared_pos)]
        self.shared = _positions([starts[i] + self.shards[i].shared_pos for i in self.shared_shards], device)
        self.fast_shared = _positions([starts[i] + self.shards[i].shared_pos for i in self.shared_shards
                                       if i < self.fast], device)
        # the shared cells' amaxes, read back without a wait (launch_shared, then shared_host)
        cuda = self.amax.is_cuda
        self._host = torch.zeros(int(self.shared.numel()), dtype=torch.float32, pin_memory=cuda)
        self._ready = torch.cuda.Event() if cuda else None
        self.skipped: frozenset[str] = frozenset()
        self.skip(frozenset())

    def skip(self, fused: frozenset[str]) -> None:
        """Make nothing of the kernels' shards named in ``fused`` (values names): pairs on this GPU quantize them
        on the way (:mod:`tensorxfer.sync.fusing`); their shared cells' amaxes are still taken, for the round."""
        if fused == self.skipped and hasattr(self, "fast_whole"):
            return
        self.skipped = fused
        self.amax.zero_()       # no amax of an earlier epoch's cells is checked again
        made = [i for i, s in enumerate(self.shards[:self.fast]) if s.values_name not in fused]
        self.fast_whole = _positions([self._starts[i] + np.setdiff1d(np.arange(math.prod(self.shards[i].count)),
                                                                     self.shards[i].shared_pos) for i in made],
                                     self.amax.device)
        self.fast_shared_made = _positions([self._starts[i] + self.shards[i].shared_pos for i in made],
                                           self.amax.device)
        # whether this device quantizes anything here (else a push waits for it once: the shared amaxes)
        self.makes = bool(made) or self.fast < len(self.shards)

    def launch_shared(self) -> None:
        """:meth:`shared_amaxes`, and their copy to the host queued after them (:meth:`shared_host` waits)."""
        self.shared_amaxes()
        if self._ready is not None and len(self._host):
            self._host.copy_(self.amax[self.shared], non_blocking=True)
            self._ready.record()

    def shared_host(self) -> np.ndarray:
        """The shared cells' amaxes launched last (:meth:`launch_shared`), on the host (a wait for them)."""
        if self._ready is None:
            return self.amax[self.shared].numpy().copy()
        if len(self._host):
            self._ready.synchronize()
        return self._host.numpy().copy()

    def shared_amaxes(self) -> None:
        """The amaxes of the cells other sources share (the kernels' shards), and every amax of the torch ones."""
        if self.table is not None:
            self.table.refresh()
            self.table.amaxes(self.fast_shared)
        for s, view in zip(self.shards[self.fast:], self.views[self.fast:]):
            if not s.empty:
                view.copy_(torch_block_amax(s.local, s.grid, s.offsets).reshape(view.shape))

    def quantize_whole(self) -> None:
        """The cells no other source shares: the kernels' take their amaxes and quantize them in one launch
        (left running), the torch shards that share nothing are quantized."""
        if self.table is not None:
            self.table.amaxes(self.fast_whole, quantize_whole=True)
        for i in range(self.fast, len(self.shards)):
            s = self.shards[i]
            if not s.empty and not len(s.shared_pos):
                torch_quantize_into(s.local, s.grid, s.offsets, s.q, self.views[i], s.values, s.scales)

    def quantize_shared(self) -> None:
        """The cells shared with other sources, their agreed amaxes in :attr:`amax`: the kernels' in one
        launch (but those of the shards pairs quantize on the way), the torch shards that share any one by one."""
        if self.table is not None:
            self.table.quantize(self.fast_shared_made)
        for i in range(self.fast, len(self.shards)):
            s = self.shards[i]
            if not s.empty and len(s.shared_pos):
                torch_quantize_into(s.local, s.grid, s.offsets, s.q, self.views[i], s.values, s.scales)

    def finite(self) -> bool:
        """Whether every amax is finite (a wait for the device's work so far)."""
        import torch

        return bool(torch.isfinite(self.amax).all())


def _refuse_shared(s: QuantizedShard, amax: np.ndarray) -> None:
    """QuantizationError naming ``s`` and its first shared block whose amax (``amax``, the shared cells')
    is a NaN or an infinity."""
    import torch

    cells = torch.zeros(math.prod(s.count), dtype=torch.float32)
    cells[torch.from_numpy(s.shared_pos)] = torch.from_numpy(np.ascontiguousarray(amax, np.float32))
    check_finite(cells.view(s.count), s.name, s.grid, s.first)


def _positions(parts: list[np.ndarray], device: Any) -> Any:
    """int64 indices, concatenated, as a tensor on ``device``."""
    import torch

    return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64)).to(device)


def _takes_kernel(s: QuantizedShard) -> bool:
    return (not s.empty and kernel.fits(s.local, s.grid) and kernel.computes(s.q)
            and s.values.device == s.local.device and s.values.is_contiguous()
            and s.scales.device == s.local.device and s.scales.is_contiguous())


class SourceQuantizer:
    """Quantizes a source's shards at every push, agreeing on shared blocks with the other sources.

    :meth:`agree` (before the offers: a step that cannot be quantized offers nothing) takes every shard's
    block amaxes, checks them and agrees on the shared ones, quantizing the blocks no other source shares
    while the peers' amaxes come; :meth:`quantize` (after the offers, while the targets take them in)
    writes the rest.  The device is waited for a fixed number of times a step, and the kernels launched
    twice, however many shards there are (:class:`_DeviceShards`).
    """

    def __init__(self, shards: list[QuantizedShard], store: GroupStore, rank: int, stall_timeout: float,
                 agreed: Any = None) -> None:
        self.shards, self.store, self.rank, self.stall_timeout = shards, store, rank, stall_timeout
        by_device: dict[Any, list[QuantizedShard]] = {}
        for s in shards:
            by_device.setdefault(s.local.device, []).append(s)
        self._devices = [_DeviceShards(group) for group in by_device.values()]
        shared = [d.shards[i] for d in self._devices for i in d.shared_shards]      # the round's order
        self._round = _RoundIndex(shared)
        self._agreed = _AgreedAmaxes(agreed, shared) if agreed is not None else None
        self._peers: tuple[int, ...] = ()
        self._made_bytes = sum(s.values.numel() for s in shards if not s.empty)
        self._launched: tuple[int, float] | None = None

    def plan(self, sources: list[RankSpec], fused: set[str] | frozenset[str] = frozenset()) -> None:
        """Find the peers of this epoch's members: sources whose shard of a tensor reaches into a block
        that one of ours shares; and leave the whole blocks of the ``fused`` tensors (values names: every
        pair reading them quantizes them on the way) to those pairs."""
        for d in self._devices:
            d.skip(frozenset(fused))
        # the FP8 bytes a push writes here: all of a shard's, none of a left-out one's
        self._made_bytes = sum(0 if i < d.fast and s.values_name in d.skipped else s.values.numel()
                               for d in self._devices for i, s in enumerate(d.shards) if not s.empty)
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

    def quantize(self, version: int) -> QuantStats:
        """Quantize every shard into the region for step ``version``: the shared cells' amaxes first,
        published at once; the rest quantized while the peers' records come; then the shared cells with the
        agreed amaxes (:meth:`begin`, then :meth:`finish`).  Runs before the offers of what it makes go out,
        so that nothing reading it is offered for a step that cannot be quantized: QuantizationError for a
        NaN or an infinity here (naming the tensor) or, in a block this source shares, at a peer.  One wait
        for the device at the start (the shared amaxes) and one at the end (every amax checked)."""
        return self.finish(self.begin(version))

    def launch(self, version: int) -> None:
        """Queue the shared cells' amaxes of step ``version`` and their copy to the host, without waiting: a
        source whose pairs quantize on the way calls it right before it posts their first tiles (so that they
        run before the tiles, not in a time slice of their own amid them), then :meth:`begin`."""
        self._launched = (version, time.perf_counter())
        for d in self._devices:
            d.launch_shared()

    def begin(self, version: int) -> _Round:
        """The first half of :meth:`quantize`: the shared cells' amaxes taken (:meth:`launch`, unless it
        was), checked and published, the cells no other source shares launched.

        Raises
        ------
        QuantizationError
            A NaN or an infinity in a shared block of this source's (the peers are told: a poisoned record).
        """
        if self._launched is None or self._launched[0] != version:
            self.launch(version)
        assert self._launched is not None
        t0, self._launched = self._launched[1], None
        shared = self._round.shards
        flat = np.zeros(0, np.float32)
        if shared:
            flat = np.concatenate([d.shared_host() for d in self._devices if d.shared_shards]).astype(
                np.float32, copy=False)
            try:
                if not np.all(np.isfinite(flat)):
                    for s, m in zip(shared, self._round.split(flat)):
                        if not np.all(np.isfinite(m)):
                            _refuse_shared(s, m)
            except QuantizationError as e:      # the peers would wait for amaxes that will not come
                self.store.put(self._key(version, self.rank), Amaxes({}, str(e), e.tensor).encode())
                raise
            self.store.put(self._key(version, self.rank), self._round.record(flat).encode())
        for d in self._devices:             # while the peers' records come (GPU kernels run on meanwhile)
            d.quantize_whole()
        return _Round(version, t0, shared, time.perf_counter() - t0, flat)

    def finish(self, begun: _Round) -> QuantStats:
        """The second half of :meth:`quantize`: the peers' amaxes merged, the shared cells quantized, every
        amax checked (raises as :meth:`quantize`); the push's stats."""
        wait = 0.0
        if begun.shared:
            t1 = time.perf_counter()
            self._merge(begun.version, begun.flat)
            wait = time.perf_counter() - t1
            if self._agreed is not None:        # where the pairs' tiles of these blocks read them
                self._agreed.write(self._round.split(begun.flat))
        for d in self._devices:
            d.quantize_shared()
        self._check_finite()
        live = [s for s in self.shards if not s.empty]
        return QuantStats(self._made_bytes, sum(s.shared_bytes for s in live),
                          sum(len(s.shared_pos) for s in live), len(self._peers), wait,
                          time.perf_counter() - begun.t0, begin_seconds=begun.seconds)

    def _check_finite(self) -> None:
        """QuantizationError naming the first shard with a NaN or an infinity: one wait per device."""
        for d in self._devices:
            if not d.makes or d.finite():       # (the shared amaxes were checked on the host)
                continue
            for s, amax in zip(d.shards, d.views):
                if not s.empty:
                    check_finite(amax, s.name, s.grid, s.first)

    def _merge(self, version: int, flat: np.ndarray) -> None:
        """The peers' partial amaxes of step ``version`` folded into ours (``flat``, the shared cells' own, on
        the host, in place); then written back into the devices' amaxes, one copy per device (each device's
        shards are a run of ``flat``)."""
        import torch

        keys = [self._key(version, r) for r in self._peers]
        records = [Amaxes.decode(k, v) for k, v in zip(keys, self.store.get(keys, self.stall_timeout))]
        for rank, record in zip(self._peers, records):
            if record.error is not None:
                raise QuantizationError(f"source rank {rank} shares blocks with this one and could not quantize: "
                                        f"{record.error}", record.tensor)
        for key, record in zip(keys, records):
            self._round.fold(flat, record, key)
        start = 0
        for d in self._devices:
            n = len(d.shared_shards)
            if n and d.makes:
                agreed = torch.from_numpy(flat[self._round.starts[start]:self._round.starts[start + n]])
                if d.amax.is_cuda:      # queued, not waited for: the GPU may be busy with other processes' pairs,
                    agreed = agreed.pin_memory().to(d.amax.device, non_blocking=True)   # one wait a push suffices
                d.amax[d.shared] = agreed
            start += n

    def _key(self, version: int, rank: int) -> str:
        return self.store.key("amax", version, rank)


class _AgreedAmaxes:
    """The agreed amaxes of a source's shared blocks where its pairs' tiles read them: the region's amax entry
    (:data:`tensorxfer.sync.layout.AMAX_ENTRY`, ``entry``: a float32 view), written from a host copy of it in one
    host-to-device copy on a stream of its own (no kernel: a kernel of this process would wait for a time
    slice behind the tiles of the copy host), waited for before the tiles that read it are offered.  ``shards``:
    the shards with shared cells, in the order of the round's amaxes."""

    def __init__(self, entry: Any, shards: list[QuantizedShard]) -> None:
        import torch

        self.entry = entry
        self._host = torch.zeros(entry.numel(), dtype=torch.float32, pin_memory=entry.is_cuda)
        self._stream = torch.cuda.Stream(entry.device) if entry.is_cuda else None
        firsts = [(k, s.agreed_at) for k, s in enumerate(shards) if s.agreed_at is not None]   # (inputs' first layouts)
        self._written = [k for k, _ in firsts]
        self._at = np.concatenate([at + shards[k].shared_pos for k, at in firsts] or [np.zeros(0, np.int64)])

    def write(self, agreed: list[np.ndarray]) -> None:
        """Write the shards' ``agreed`` amaxes (each one's shared cells', in order) where their tiles read them."""
        import torch

        if not len(self._at):
            return
        self._host.numpy()[self._at] = np.concatenate([agreed[k] for k in self._written])
        if self._stream is None:
            self.entry.copy_(self._host)
            return
        with torch.cuda.stream(self._stream):
            self.entry.copy_(self._host, non_blocking=True)
        self._stream.synchronize()


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
