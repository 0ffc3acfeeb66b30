"""WeightSync: N trainer ranks push resharded weights straight into M inference ranks' live weights.

The shape trainers and engines already use (vLLM's init / update / finish, SGLang's
``update_weights_from_*``)::

    # every trainer rank (FSDP2 shards: DTensors describe themselves)
    sync = tx.WeightSync(store, "policy", role="source", rank=r, world=(N, M), tensors=dict(model.named_parameters()))
    stats = sync.push()                    # after each optimizer step

    # every inference rank: its own (fused, TP-sharded) parameters, and where each piece comes from
    sync = tx.WeightSync(store, "policy", role="target", rank=t, world=(N, M),
                         tensors={"qkv_proj.weight": tx.sync.Target.fused(param, [("q", q_shape), ...], 0, t, M)})
    version = sync.wait(timeout=60)        # the update that landed, whole

Construction is the rendezvous: targets move their tensors into one region (their live weights stay the
same tensor objects, now views of it) and register its layout and their address; sources read the
targets' dtypes, lay their shards out in those dtypes and register -- a plain shard already in that
dtype is adopted the same way (moved in, re-pointed), the others (DTensors, fp32 masters cast to bf16)
are packed; the group forms once the ``world`` ranks registered; every rank computes the plan from what
the store holds and checks that all digests agree; each source connects to the targets it feeds (one
authenticated session per pair, its data path set up once).  A push packs the shards that are not
adopted into its region (at most one local copy of 1/N of the model) and sends each target its
segments in parallel; a target reports a version only when every source that feeds it delivered that
version.

Membership is elastic (``elastic=True``, the default; :mod:`tensorxfer.sync.membership`): before each
step the sources agree, through the store, on who is in it.  A target that starts later joins (the
next push includes it, planned anew; nobody else reconnects or registers memory again), one that
closes leaves, one that dies is named in the push's :attr:`SyncStats.failed` and left out of the next
step.  A source that dies fails the step for the targets it fed (their ``wait`` names it); the next
step runs with the remaining sources if their shards still cover every target byte, else every rank
gets a :class:`~tensorxfer.errors.PlanError` naming the uncovered boxes.  ``elastic=False`` keeps the
group as formed and skips the store between steps (a push is then only the data path).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from tensorxfer.binding import adopt_tensors, tensor_view
from tensorxfer.errors import (
    PlanError,
    ProtocolError,
    QuantizationError,
    RegionClosed,
    StoreError,
    TensorXferError,
    TransferError,
    TransferTimeout,
)
from tensorxfer.protocol import token_key
from tensorxfer.region import TensorRegion
from tensorxfer.session.control import DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_STALL_TIMEOUT, seconds
from tensorxfer.sync.copy_host import device_identity, elect
from tensorxfer.sync.fusing import Fusable, early, feeds, fusable, fuses_on, pairs_of
from tensorxfer.sync.fusing import segments_of as segments_of  # where it lived before sync.fusing
from tensorxfer.sync.layout import fill_padding, quantized_shards, source_layout, target_description, target_tensors
from tensorxfer.sync.link import PairStats, PairStep, Parts, SourceLink, TargetPort
from tensorxfer.sync.membership import Membership, StepRecord, group_status
from tensorxfer.sync.packing import LocalShards
from tensorxfer.sync.plan import Plan, plan
from tensorxfer.sync.quantizing import QuantStats, SourceQuantizer
from tensorxfer.sync.rendezvous import Rendezvous, TorchStoreRendezvous, connect
from tensorxfer.sync.shards import Target, source_of
from tensorxfer.sync.stats import SyncStats
from tensorxfer.sync.workers import Workers
from tensorxfer.transport.ipc.delegate import CopyHost
from tensorxfer.transport.ipc.identity import unavailable as ipc_unavailable
from tensorxfer.transport.ipc.lane import IN_DOUBT

log = logging.getLogger(__name__)

FOREVER = 1e9       # seconds: a wait without a timeout


class WeightSync:
    """One rank of a resharded weight sync (see the module docstring).

    Parameters
    ----------
    store : torch.distributed.Store, Rendezvous or str
        Where the group's ranks meet: a ``TCPStore`` (:func:`tensorxfer.sync.rendezvous.open_tcp_store`), an
        :class:`~tensorxfer.sync.rendezvous.EtcdRendezvous`, or a URL (``etcd://host:2379``,
        ``tcp://host:port``) opened here and closed with the sync.
    group : str
        The sync's name in the store.
    role : "source" or "target"
    rank : int
        This rank among the sources (or among the targets).
    world : (int, int)
        How many sources and how many targets form the group (the first step waits for all of them).  A
        target joining a group that has formed already may pass any rank not in use (``world`` is then
        only read by the sources).
    tensors : mapping
        Sources: name -> a DTensor (its mesh and placements give the box), or :class:`~tensorxfer.sync.Source`
        (a plain tensor with its global shape and box).  Targets: local name -> :class:`~tensorxfer.sync.Target`
        (a live tensor and the pieces of source tensors it is made of).
    token : str or bytes, optional
        The group's shared secret (every pair authenticates with it).
    transport : str
        ``"auto"`` (ipc on one host, else rdma, else tcp) or a name.
    listen_host : str
        Targets: where to listen for the sources (loopback unless told otherwise).
    device : str, optional
        Where this rank's region lives (default: where its tensors are).
    elastic : bool
        Agree on the members before every step (joins, leaves, deaths; see the module docstring).
    copy_host : bool, optional
        Targets: whether the targets on one device copy their ipc pairs through one of them
        (:mod:`tensorxfer.sync.copy_host`).  Default: on for GPU regions (one CUDA context instead of
        several time-slicing the GPU), off for host memory (each target copying on its own threads is as fast).
    """

    def __init__(self, store: Any, group: str, role: str, rank: int, world: tuple[int, int],
                 tensors: Mapping[str, Any], token: str | bytes | None = None, transport: str = "auto",
                 streams: int | None = None, listen_host: str = "127.0.0.1", device: str | None = None,
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT, timeout: float = 120.0, elastic: bool = True,
                 copy_host: bool | None = None) -> None:
        if role not in ("source", "target"):
            raise ValueError(f"role must be 'source' or 'target', got {role!r}")
        sources, targets = (int(x) for x in world)
        if sources < 1 or targets < 1 or rank < 0 or (role == "source" and rank >= sources):
            raise ValueError(f"world=({sources}, {targets}) has no {role} rank {rank}")
        if not tensors:
            raise ValueError("a weight sync needs at least one tensor")
        self.group, self.role, self.rank, self.world = group, role, rank, (sources, targets)
        self.stall_timeout, timeout = seconds(stall_timeout=stall_timeout, timeout=timeout)
        self.elastic = elastic
        self.version = 0
        self._timeout = float(timeout)
        self._token, self._transport, self._streams = token, transport, streams
        self._own_store = isinstance(store, str)
        self._rdv: Rendezvous = (connect(store) if isinstance(store, str) else
                                 store if isinstance(store, Rendezvous) else TorchStoreRendezvous(store))
        self.members = Membership(self._rdv, group, role, rank, self.stall_timeout, token_key(token))
        self.clock = self.members.clock
        self._lock = threading.Lock()
        self._links: dict[int, SourceLink] = {}
        self._workers = Workers(f"tensorxfer-sync-push-{rank}")     # one step's pairs at once
        self._segments: dict[int, Parts] = {}          # a source's runs to each target (a step's parts)
        self._feeds: dict[int, Parts] = {}             # a target's runs from each source
        self._addresses: dict[int, tuple[str, int]] = {}
        self._port: TargetPort | None = None
        self._copy_host: CopyHost | None = None         # targets: the copy host this rank runs for its device
        self._record: StepRecord | None = None         # the latest step record this rank followed
        self._planned = 0                              # the epoch self.plan is for
        self._next_step = 1                            # targets: the step wait() takes next
        self.plan: Plan | None = None
        self.region: TensorRegion | None = None
        self.adopted = 0                                # sources: local shards moved into the region
        self._quantizer: SourceQuantizer | None = None  # sources: the shards targets want in FP8
        self._quant_stats = QuantStats()
        self._device_id: str | None = None              # the GPU this rank's pairs there may quantize on
        self._fusable: dict[str, Fusable] = {}          # sources: the shards such pairs can quantize
        self.last_stats: SyncStats | None = None
        try:
            if role == "target":
                self._init_target(tensors, listen_host, device, copy_host)
            elif self.members.formed():     # refused before it registers: it never appears a member
                raise TransferError(f"sync {group!r}: source rank {rank} started after the group formed: sources "
                                    f"cannot join a running group (restart the group)")
            else:
                self._init_source(tensors, device, timeout)
            record = self.members.form(self.world, timeout)
            if record.holds(role, rank, self.members.uid):
                self._enter(record, timeout, agree=True)
            elif role == "source":
                raise TransferError(f"sync {group!r}: source rank {rank} registered after the group formed: "
                                    f"sources cannot join a running group (restart the group)")
            elif not elastic:
                raise TransferError(f"sync {group!r}: the group formed without target rank {rank}, and a fixed "
                                    f"group (elastic=False) takes no newcomers: construct it with elastic=True")
            else:       # joining a group that runs: a step decided after it registered includes this rank
                self._next_step = self._before_joining + 1
        except BaseException as e:
            self.members.fail(e)        # the ranks waiting for this one report why, not a timeout
            self.close()
            raise

    # ------------------------------------------------------------ rendezvous
    def _init_target(self, tensors: Mapping[str, Any], host: str, device: str | None,
                     copy_host: bool | None) -> None:
        shards = {name: t if isinstance(t, Target) else Target(*t) for name, t in tensors.items()}
        # (a tensor that shares its memory is refused, named: re-pointed, the engine's would keep the old bytes)
        self.region = adopt_tensors(TensorRegion, target_tensors(shards), device)
        fill_padding(shards)
        spec = target_description(shards, self.region.manifest, self.rank)
        self._port = TargetPort(host, self._token, self.group, self.rank, self.stall_timeout,
                                DEFAULT_HANDSHAKE_TIMEOUT)
        if (self.region.is_cuda if copy_host is None else copy_host) and self._transport in ("auto", "ipc") \
                and ipc_unavailable() is None:
            self._copy_host, self._port.copy_host = elect(self._rdv, self.members.key, self.rank, self.region,
                                                          token_key(self._token), self.stall_timeout)
        # the newest step before this rank registered: a later one may include it already (the group does not
        # wait for its constructor to end), and one it never read would leave it waiting for good
        self._before_joining = self.members.latest()
        if fuses_on(self.region.is_cuda, self._transport, run_tiles=True):
            self._device_id = device_identity(self.region)
        self.members.register(spec, self._port.address, self._timeout, device=self._device_id)

    def _init_source(self, tensors: Mapping[str, Any], device: str | None, timeout: float) -> None:
        shards = {name: source_of(t) for name, t in tensors.items()}
        where = device or next((f"cuda:{s.tensor.device.index or 0}" for s in shards.values()
                                if s.tensor.device.type == "cuda"), "cpu")
        fuses = fuses_on(where.startswith("cuda"), self._transport)
        layout = source_layout(shards, self.members.initial_targets(self.world[1], timeout), inputs=fuses)
        manifest = layout.manifest
        self.region = TensorRegion.from_manifest(manifest, device=where)
        # with a quantized tensor's input, where pairs on this GPU may quantize it on the way (sync.fusing)
        own = {n: entry for n, entry in layout.inputs.items() if entry not in layout.plain}
        self._local = LocalShards(
            [(s.tensor, tensor_view(self.region, manifest[n])) for n, s in layout.plain.items()] +
            [(shards[n].tensor, tensor_view(self.region, manifest[entry])) for n, entry in own.items()],
            [s.adopt for s in layout.plain.values()] + [True] * len(own), [*layout.plain, *own])
        self.adopted = self._local.adopted
        if layout.quantized:
            quantized, agreed = quantized_shards(layout, self.region)
            self._quantizer = SourceQuantizer(quantized, self.members.store, self.rank, self.stall_timeout, agreed)
        spec = layout.describe(self.rank)
        if fuses and layout.inputs:
            self._device_id = device_identity(self.region)
            self._fusable = fusable(spec)
        self.members.register(spec, timeout=timeout, device=self._device_id)

    def _enter(self, record: StepRecord, timeout: float, agree: bool = False) -> None:
        """Take part in ``record``'s step: plan its epoch if this rank has not yet (sources connect to new
        targets and close links no longer planned; targets admit new sources), else just follow it."""
        self._record = record
        if record.epoch == self._planned:
            return
        sources, targets, self._addresses = self.members.specs(record, timeout)
        if self._copy_host is not None:     # a lane maps no region larger than the group's largest
            self._copy_host.limit_bytes = max(spec.extent for spec in (*sources, *targets))
        p = plan(sources, targets, scope=(self.role, self.rank))   # this rank's runs only
        self.members.publish_digest(record.epoch, p.digest)
        if agree:
            self._agree(record, p, timeout)
        self.plan, self._planned = p, record.epoch
        devices = self.members.devices(record)
        if self.role == "source":
            order = p.send_order.get(self.rank, ())
            for t in [t for t in self._links if t not in order]:
                self._links.pop(t).close()
            self._segments, fused = pairs_of(p, self.rank, order, self._fusable, devices, self._device_id)
            if self._quantizer is not None:
                self._quantizer.plan(sources, fused)
            if agree:       # the group forms: a target it cannot reach fails the construction
                self._connect(order)
            # a later epoch connects as the push runs: a new target that cannot be reached fails its own pair
        else:
            assert self._port is not None
            self._feeds = feeds(p, self.rank, sources, devices, self._device_id)
            self._port.expect(set(self._feeds))
            self._port.admit(timeout)
        log.info("sync %r: %s rank %d planned epoch %d (%d sources, %d targets, digest %s)", self.group, self.role,
                 self.rank, record.epoch, len(record.sources), len(record.targets), p.digest[:12])

    def _agree(self, record: StepRecord, p: Plan, timeout: float) -> None:
        """Every member of ``record`` computed the same plan (the group's first epoch, when all are here)."""
        keys = [self.members.key("digest", record.epoch, role, r)
                for role, ranks in (("source", record.sources), ("target", record.targets)) for r in sorted(ranks)]
        differ = [k for k, d in zip(keys, self.members.store.get(keys, timeout)) if d != p.digest.encode()]
        if differ:
            raise PlanError(f"sync {self.group!r}: {len(differ)} rank(s) computed another plan ({differ[:4]}): their "
                            f"shard descriptions or planners differ")

    def _connect(self, order: tuple[int, ...]) -> None:
        for target in order:
            if target not in self._links:
                self._link(target)

    def _link(self, target: int) -> SourceLink:
        """A new session with ``target`` (kept in ``self._links``; a pair thread may call this)."""
        link = self._links[target] = SourceLink(
            self._addresses[target], self._token, self.group, self.rank, target, self._transport, self._streams,
            self.stall_timeout,
            # a live target answers at once; a stalled one costs its pair no more than the stall timeout
            min(self._timeout, DEFAULT_HANDSHAKE_TIMEOUT, max(self.stall_timeout, 1.0)))
        return link

    # ------------------------------------------------------------ steps
    def push(self) -> SyncStats:
        """Sources: pack this rank's shards into its region and send every target its segments, in parallel.

        Returns the step's stats; with ``elastic`` membership a target that failed is named in
        :attr:`SyncStats.failed` (the others have the version) and left out of the next step.

        Raises
        ------
        TransferError (PeerLost, TransferTimeout)
            Fixed membership: a target failed (named).  Elastic: the group left this source out of the step
            (it stalled past the stall timeout); it has joined again, and the group's next step includes it.
        PlanError
            The members' shards no longer cover every target byte (the message names the box).
        StoreError
            The store's record of this step is not one the group wrote (named); the next push goes on.
        """
        self._usable("source", "push")
        assert self.region is not None and self._record is not None
        with self._lock:
            t0 = time.perf_counter()
            version = self.version + 1
            with self.members.busy(version):
                if self.elastic:
                    self._take_part(version)
                results, packed_bytes, packed, pack_error = self._run_pairs(version, t0)
            failed = {t: r for t, r in results.items() if isinstance(r, BaseException)}
            for t in failed:
                link = self._links.pop(t, None)     # (None: its reconnect failed)
                if link is not None:
                    link.close()        # its session's state is unknown: reconnect if it stays
            if pack_error is not None:
                # Every offer went out unanswered (those links are closed above): the step is spent, and the
                # targets, which saw it fail, go on to the next one.
                self.version = version
                if self.elastic:
                    self.members.report(version, False, version - 1, {})
                raise pack_error
            poisoned = next((e for _, e in sorted(failed.items()) if isinstance(e, QuantizationError)), None)
            if poisoned is not None:
                # a pair that quantized on the way met a NaN or an infinity in this source's weights: the step
                # fails at the trainer, naming the tensor (the targets whose blocks hold it failed it too, and
                # report; they stay members)
                self.version = version
                if self.elastic:        # as a NaN found before the offers: the step is spent, nobody is named
                    self.members.report(version, False, version - 1, {})
                raise poisoned
            if failed and not self.elastic:
                first = failed[min(failed)]
                raise first if isinstance(first, TransferError) else TransferError(
                    f"sync: the push to target rank(s) {sorted(failed)} failed: {first!r}") from first
            self.version = version
            why = {t: f"{type(e).__name__}: {e}" for t, e in failed.items()}
            if failed:
                log.warning("sync %r: step %d failed for target rank(s) %s: %s", self.group, version, sorted(failed),
                            why)
            if self.elastic:
                self.members.report(version, not failed, version, why)
            pairs = tuple(r for _, r in sorted(results.items()) if not isinstance(r, BaseException))
            self.last_stats = SyncStats(version, sum(p.bytes for p in pairs), time.perf_counter() - t0, packed,
                                        pairs, packed_bytes, why, self._planned, self._quant_stats)
            return self.last_stats

    def _take_part(self, version: int) -> None:
        """Sources: decide (or read) the members of step ``version`` and enter it.  A step that cannot run
        (its record is not the group's, this source was left out, the members cannot be planned) is spent:
        the next push decides the next one."""
        assert self._record is not None
        try:
            record = self.members.decide(version, self._record)
        except StoreError:
            # nobody can read this step's members: it keeps the last ones, so that the next decision
            # waits for the reports of this step from them
            self._spend(version, dataclasses.replace(self._record, step=version))
            raise
        if not record.holds("source", self.rank, self.members.uid):
            self._left_out(record)
        try:
            self._enter(record, self.stall_timeout)     # a step's waits: the stall timeout (formation: timeout)
        except (PlanError, StoreError):
            self._spend(version, record)
            raise

    def _spend(self, version: int, record: StepRecord) -> None:
        self.version, self._record = version, record
        self.members.report(version, False, version - 1, {})

    def _left_out(self, record: StepRecord) -> None:
        """Sources: the group decided ``record`` without this source (it showed no sign of life for the stall
        timeout: it stalled).  It catches up with the group's newest step, joins again as a new incarnation
        (once: an incarnation that was never a member waits to be taken in) and closes its pair sessions,
        which the targets dropped; then raises (the next push that the group decides after now includes it)."""
        self.version, self._record = record.step, record
        latest = self.members.latest()
        if latest > record.step:        # the group went on without this rank: start from its newest step
            try:
                self._record = self.members.step_record(latest, self.clock.leader)
                self.version = latest
            except (StoreError, TransferTimeout):
                pass        # the next push catches up from here
        if self.members.was_member():
            self.members.rejoin()
        links, self._links = self._links, {}
        for link in links.values():
            link.close()
        raise TransferError(f"sync {self.group!r}: source rank {self.rank} was left out of step {record.step} (it "
                            f"showed no sign of life for {self.stall_timeout:g} s: it stalled, or its store was "
                            f"unreachable); it joined again, and the group's next step includes it")

    def _run_pairs(self, version: int, t0: float) -> tuple[dict[int, Any], int, float, BaseException | None]:
        """Pack the region and send every planned target its segments: (target -> PairStats or the exception
        that ended it, the bytes packed, seconds from ``t0`` until the pack ended, the pack's or the
        quantization's error, or None).

        This thread offers every target, packs while they take the offers in, and posts every warm ipc
        pair's data (:class:`~tensorxfer.sync.link.SourceLink`'s phases); only the waiting for the targets
        (and the data of other transports) runs on a thread per pair.  Handing each phase to the pair
        threads instead put the data out 0.74-0.83 ms into a step on the H200 machine, 0.46-0.52 ms this
        way.  A pack that fails leaves every offer unanswered: every pair then ends with an error too.

        The source quantizes (:class:`SourceQuantizer`) before it offers anything that reads what it makes; a
        pair whose first part needs none of it (a fused pair's tiles of whole blocks:
        :func:`~tensorxfer.sync.fusing.parts`) is offered, packed, its shared amaxes queued
        (:meth:`SourceQuantizer.launch`: after the pack, whose wait for the device would wait for them too) and
        then posted, and the round (those amaxes read back and published, the peers' merged and written where the
        shared blocks' tiles read them) runs while the tiles land.  Why the amaxes before the post: once the
        copy host's tiles run, any work of this process's on the GPU waits ~1.3-1.9 ms for a time slice and
        costs the tiles ~0.33 ms (``benchmarks/probe_timeslice.py`` on the H100); queued before the post, it
        runs before the tiles can start.  (In the 16 GB 4-to-2 bench on the H100 the step moved by less than
        its run-to-run spread: ``benchmarks/results/2026-12-07-fp8-source-work-before-the-tiles``.)  A
        quantization that fails is told to every target (:meth:`_refuse`), so pairs already landing a first
        part fail too.

        A target this source has no session with (new in this epoch, or its session failed) is connected on a
        pair thread of its own, after the pack: a target slow to let a session in (a process still starting,
        a stalled one) holds up its own pair only, never the others' offers."""
        assert self.plan is not None and self.region is not None
        results: dict[int, Any] = {}
        steps: dict[int, list[PairStep]] = {}
        fresh = [t for t in self._segments if t not in self._links]
        first = [t for t, ps in self._segments.items() if t not in fresh and early(ps)]
        region, digest = self.region, self.plan.digest

        def offer(targets: list[int], only_first: bool) -> list[tuple[int, PairStep]]:
            """Offer each target its parts not yet offered (``only_first``: its first part only)."""
            offered = []
            for target in [t for t in targets if t not in results]:
                mine, parts = steps.setdefault(target, []), self._segments[target]
                try:
                    for part in range(len(mine), 1 if only_first else len(parts)):
                        if mine and not mine[-1].early:
                            break       # its data goes after the accept: the next part follows its finish
                        mine.append(self._links[target].offer(region, parts[part], version, digest, part))
                        offered.append((target, mine[-1]))
                except Exception as e:
                    results[target] = e
            return offered

        def post(offered: list[tuple[int, PairStep]]) -> None:
            for target, step in offered:
                if target not in results:
                    try:
                        self._links[target].post(step)
                    except Exception as e:
                        results[target] = e

        def failed(why: str, error: BaseException) -> tuple[dict[int, Any], int, float, BaseException | None]:
            results.update({t: TransferError(f"{why}: {type(error).__name__}: {error}")
                            for t in self._segments if t not in results})
            return results, 0, time.perf_counter() - t0, error

        packed_bytes, packed, quantizer = 0, 0.0, self._quantizer
        try:
            if first:       # parts that read nothing the quantizer makes: offered, packed and posted first
                offered = offer(first, only_first=True)
                try:
                    packed_bytes, packed = self._pack(), time.perf_counter() - t0
                except Exception as e:
                    return failed("the source's pack failed before its data was posted", e)
                if quantizer is not None:   # its kernel queued (no wait) before the tiles can start
                    _, error = self._quantize(lambda: quantizer.launch(version))
                    if error is not None:
                        return failed("the source could not quantize its weights", error)
                post(offered)
            if quantizer is not None:
                made, error = self._quantize(lambda: quantizer.quantize(version))
                if error is not None:
                    return failed("the source could not quantize its weights", error)
                fused = [s.tiles for steps in self._segments.values() for s in steps if s.tiles is not None]
                self._quant_stats = dataclasses.replace(made, fused_bytes=sum(t.values_bytes for t in fused),
                                                        fused_input_bytes=sum(t.input_bytes for t in fused))
            offered = offer([t for t in self._segments if t not in fresh], only_first=False)
            if not first:
                try:
                    packed_bytes, packed = self._pack(), time.perf_counter() - t0
                except Exception as e:
                    return failed("the source's pack failed before its data was posted", e)
            post(offered)
        except BaseException:       # interrupted mid-step: the offered pairs are in no known state
            for target in steps:
                link = self._links.pop(target, None)
                if link is not None:
                    link.close()
            raise

        def finish(target: int) -> None:
            try:
                link, mine, parts = self._links[target], steps[target], self._segments[target]
                stats: PairStats | None = None
                for part, segments in enumerate(parts):
                    if part == len(mine):       # not offered: the part before it was not posted early
                        mine.append(link.offer(region, segments, version, digest, part))
                        link.post(mine[-1])
                    done = link.finish(mine[part])
                    stats = done if stats is None else stats.then(done, time.perf_counter() - mine[0].t0)
                results[target] = stats
            except BaseException as e:
                results[target] = e

        def connect_and_push(target: int) -> None:
            try:
                link = self._link(target)
                results[target] = link.push(region, self._segments[target], version, digest)
            except BaseException as e:
                results[target] = e
        jobs: list[Callable[[], None]] = [functools.partial(finish, t) for t in steps if steps[t] and t not in results]
        self._workers.run(jobs + [functools.partial(connect_and_push, t) for t in fresh])
        return results, packed_bytes, packed, None

    def _quantize(self, work: Callable[[], Any]) -> tuple[Any, Exception | None]:
        """``work`` (a part of this push's quantization: :class:`SourceQuantizer`): its result, or the error that
        stops the step (a NaN names its tensor), told to every connected target first (:meth:`_refuse`)."""
        try:
            return work(), None
        except Exception as e:
            self._refuse(e)
            return None, e

    def _refuse(self, error: Exception) -> None:
        """Tell every connected target why this step will not come (its wait raises the same error; a NaN
        names the tensor), instead of leaving it to time out."""
        tensor = getattr(error, "tensor", None)
        for link in self._links.values():
            link.refuse("quantization" if tensor is not None else "transfer", str(error), tensor)

    def _pack(self) -> int:
        """The local shards not in the region copied in (:meth:`LocalShards.pack`); the bytes copied."""
        assert self.region is not None
        return self._local.pack(self.region.device if self.region.is_cuda else None)

    def wait(self, timeout: float | None = None) -> int:
        """Targets: wait for the next update from every source that feeds this rank; return its version.

        ``timeout`` bounds the wait for the sources to begin a step (None: as long as the trainer takes).
        Once a step that includes this rank is decided, its offers must come within the stall timeout (a
        source that stalled before offering is named then, not when it resumes).

        Raises
        ------
        TransferError (PeerLost, TransferTimeout)
            A source died, stalled or failed (named); the region may hold a mix of versions and none is
            reported complete.
        PlanError
            The sources' shards no longer cover this rank's tensors (the box is named).
        StoreError
            The store's record of the step is not one the group wrote (named); the next wait goes on.
        BindingError
            A tensor given to this target was replaced since (named): nothing of the step was taken in.
        """
        self._usable("target", "wait")
        assert self._port is not None and self.region is not None
        with self._lock:
            t0 = time.perf_counter()
            deadline = time.monotonic() + (FOREVER if timeout is None else timeout)
            step = self._next_step
            if self.elastic:
                step = self._next_record(deadline)
                self._next_step = step + 1
            with self.members.busy(step):
                try:
                    self.region.binding.check_landing()     # the engine still reads where the steps land
                    results = self._receive(step, deadline, timeout is None)
                except BaseException as e:
                    # no offer of this step was taken.  A plan or store error is the group's: its sources failed
                    # the step before offering too, and their sessions stay.  Anything else (memory in doubt, a
                    # source that did not connect) is this rank's: the sources' sessions hold an offer unread (and
                    # fail their pairs), so drop them all -- the next step reads no stale offer (they reconnect)
                    if not isinstance(e, (PlanError, StoreError)):
                        for s in list(self._feeds):
                            self._port.drop(s)
                    if self.elastic:
                        self.members.report(step, False, self.version, {})
                    raise
            failed = {s: r for s, r in results.items() if isinstance(r, BaseException)}
            for s in failed:
                self._port.drop(s)      # its session's state is unknown: it reconnects
            versions = {r[0] for r in results.values() if not isinstance(r, BaseException)}
            if not failed and len(versions) != 1:
                failed = {s: ProtocolError(f"sent version {v} in a step with versions {sorted(versions)}: the "
                                           f"sources are out of step") for s, (v, _) in results.items()}
            if failed:
                if self.elastic:
                    self.members.report(step, False, self.version, {s: f"{type(e).__name__}: {e}"
                                                                     for s, e in failed.items()})
                first = failed[min(failed)]
                if isinstance(first, TensorXferError):
                    first.args = (f"sync: target {self.rank}: source rank {min(failed)} failed: {first}",
                                  *first.args[1:])
                raise first
            version = versions.pop()
            self.version = version
            if self.elastic:
                self.members.report(step, True, version, {})
            pairs = tuple(dataclasses.replace(st, source=s, target=self.rank) for s, (_, st) in sorted(results.items()))
            self.last_stats = SyncStats(version, sum(p.bytes for p in pairs), time.perf_counter() - t0, 0.0, pairs,
                                        epoch=self._planned)
            return version

    def _receive(self, step: int, deadline: float, unbounded: bool) -> dict[int, Any]:
        """Targets: take part in ``step``: plan its epoch if new, admit the sources, take every source's data;
        source rank -> (version, its stats) or the exception that ended its part."""
        assert self._port is not None and self.region is not None
        if self.elastic:        # the step's sources entered it first: they connect within the stall timeout
            self._enter(self._record, min(self._left(deadline), self.stall_timeout))      # type: ignore[arg-type]
        # a source whose session failed last step reconnects (one that died is named within the stall timeout)
        self._port.admit(min(self._left(deadline), self.stall_timeout))
        assert self.plan is not None
        # the step was decided before this rank entered it: its sources offer within the stall timeout
        # (a fixed group has no record: its first offer may take as long as the trainer does)
        offers = min(deadline, time.monotonic() + self.stall_timeout) if self.elastic else \
            None if unbounded else deadline
        # a copy host that took a step into this region and stalled may still write it: no pair of any
        # transport may land here (and no version be reported) until it cannot
        IN_DOUBT.wait_clear(self.region, min(self._left(deadline), self.stall_timeout))
        return self._port.step(self.region, self._feeds, offers, self.plan.digest, step if self.elastic else None)

    @staticmethod
    def _left(deadline: float) -> float:
        return max(0.0, deadline - time.monotonic())

    def _next_record(self, deadline: float) -> int:
        """Targets: the next step that includes this rank (steps decided before it joined are skipped; a
        rank the group dropped while it lived joins again).

        Raises
        ------
        StoreError
            The store's record of the next step is not the group's: that step is spent (reported failed).
        """
        step = self._next_step
        while True:
            try:
                record = self.members.step_record(step, self._left(deadline))
            except StoreError:
                self._next_step = step + 1
                self.members.report(step, False, self.version, {})
                raise
            if record.holds("target", self.rank, self.members.uid):
                self._record = record
                return step
            if self.members.was_member() and self._record is not None:
                log.warning("sync %r: target rank %d was left out of step %d while alive; joining again",
                            self.group, self.rank, step)
                self.members.rejoin()
                self._record = None
            step += 1

    # ------------------------------------------------------------ lifetime
    @property
    def step(self) -> int:
        """The newest step this rank took part in or gave up (sources: the last push's version; targets: the
        step the last wait() was for)."""
        return self.version if self.role == "source" else self._next_step - 1

    def status(self) -> dict[str, Any]:
        """The group as the store holds it (members, epoch, digests, last version per rank)."""
        return group_status(self._rdv, self.group, token_key(self._token))

    def _usable(self, role: str, call: str) -> None:
        if self.role != role:
            raise TypeError(f"{call}() is for {role} ranks; this is a {self.role} rank")
        if self.region is None:
            raise RegionClosed(f"sync {self.group!r}: {call}() on a closed WeightSync (close() or its with block "
                               f"ended); construct a new one to take part in the group again")

    def close(self) -> None:
        """Leave the group, close the pair sessions and the listener; the region's memory stays with the
        tensors viewing it.  Idempotent."""
        try:
            self.members.close()
        except Exception as e:      # the store is gone: there is nothing to leave
            log.debug("sync %r: leaving the group failed: %s", self.group, e)
        links, self._links = self._links, {}
        for link in links.values():
            link.close()
        self._workers.close()
        port, self._port = self._port, None
        if port is not None:
            port.close()
        copier, self._copy_host = self._copy_host, None
        if copier is not None:
            copier.close()      # the targets it copied for copy on their own from now on
        region, self.region = self.region, None
        if region is not None:
            region.close()
        if self._own_store:
            self._own_store = False
            self._rdv.close()

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
