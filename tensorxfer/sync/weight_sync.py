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
same tensor objects, now views of it) and publish its layout and their address; sources read the targets'
dtypes, lay their shards out in those dtypes and publish -- a plain shard already in that dtype is adopted
the same way (moved in, re-pointed), the others (DTensors, fp32 masters cast to bf16) are packed; every
rank computes the plan from what the store holds and checks that all digests agree; each source connects
to the targets it feeds (one authenticated session per pair, its data path set up once).  A push packs
the shards that are not adopted into its region (at most one local copy of 1/N of the model) and sends
each target its segments in parallel; a target reports a version only when every source that feeds it
delivered that version.  A rank that dies is named in the error of the ranks paired with it within
``stall_timeout``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from tensorxfer import dtypes as _dt
from tensorxfer.binding import adopt_tensors, tensor_view
from tensorxfer.errors import PlanError, TransferError
from tensorxfer.manifest import Manifest
from tensorxfer.region import TensorRegion
from tensorxfer.session.control import DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_STALL_TIMEOUT
from tensorxfer.sync.link import PairStats, SourceLink, TargetPort
from tensorxfer.sync.plan import Plan, plan
from tensorxfer.sync.rendezvous import Rendezvous, TorchStoreRendezvous
from tensorxfer.sync.shards import Target, source_of
from tensorxfer.sync.spec import RankSpec, SourceTensor, TargetTensor
from tensorxfer.transport.segments import Segments

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncStats:
    """One step of a weight sync as this rank saw it: its pairs, and the totals."""

    version: int
    bytes: int
    seconds: float
    pack_seconds: float
    pairs: tuple[PairStats, ...]
    packed_bytes: int = 0       # sources: bytes copied into the region this push (0 when all are adopted)

    @property
    def gbps(self) -> float:
        return self.bytes * 8 / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def transport(self) -> str:
        return ",".join(sorted({p.transport for p in self.pairs}))

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.version, "bytes": self.bytes, "seconds": self.seconds, "gbps": self.gbps,
                "pack_seconds": self.pack_seconds, "packed_bytes": self.packed_bytes, "transport": self.transport,
                "pairs": [p.as_dict() for p in self.pairs]}


def _key(group: str, *parts: object) -> str:
    return "/".join(["tensorxfer.sync", group, *map(str, parts)])


def segments_of(p: Plan, source: int, target: int) -> Segments:
    runs = p.runs(source, target)
    return Segments(runs.src_off, runs.dst_off, runs.nbytes, runs.count, runs.src_stride, runs.dst_stride)


class WeightSync:
    """One rank of a resharded weight sync (see the module docstring).

    Parameters
    ----------
    store : torch.distributed.Store or Rendezvous
        Where the group's ranks meet (a ``TCPStore``: :func:`tensorxfer.sync.rendezvous.open_tcp_store`).
    group : str
        The sync's name in the store.
    role : "source" or "target"
    rank : int
        This rank among the sources (or among the targets).
    world : (int, int)
        How many sources and how many targets the group has.
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
    """

    def __init__(self, store: Any, group: str, role: str, rank: int, world: tuple[int, int],
                 tensors: Mapping[str, Any], token: str | bytes | None = None, transport: str = "auto",
                 streams: int | None = None, listen_host: str = "127.0.0.1", device: str | None = None,
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT, timeout: float = 120.0) -> None:
        if role not in ("source", "target"):
            raise ValueError(f"role must be 'source' or 'target', got {role!r}")
        sources, targets = (int(x) for x in world)
        if sources < 1 or targets < 1 or not 0 <= rank < (sources if role == "source" else targets):
            raise ValueError(f"world=({sources}, {targets}) has no {role} rank {rank}")
        if not tensors:
            raise ValueError("a weight sync needs at least one tensor")
        self.group, self.role, self.rank, self.world = group, role, rank, (sources, targets)
        self.stall_timeout = float(stall_timeout)
        self.version = 0
        self._rdv: Rendezvous = store if isinstance(store, Rendezvous) else TorchStoreRendezvous(store)
        self._lock = threading.Lock()
        self._links: dict[int, SourceLink] = {}
        self._segments: dict[int, Segments] = {}       # a source's runs to each target
        self._feeds: dict[int, Segments] = {}          # a target's runs from each source
        self._targets: list[RankSpec] | None = None
        self._target_addresses: dict[int, tuple[str, int]] = {}
        self._port: TargetPort | None = None
        self.region: TensorRegion | None = None
        self.adopted = 0                                # sources: local shards moved into the region
        try:
            if role == "target":
                self._init_target(tensors, token, listen_host, device, timeout)
            else:
                self._init_source(tensors, device, timeout)
            self.plan = self._agree(timeout)
            if role == "source":
                self._connect(token, transport, streams, timeout)
            else:
                assert self._port is not None
                self._feeds = {s: segments_of(self.plan, s, rank) for s in self.plan.sources_of.get(rank, ())}
                self._port.expect(self.plan.digest, set(self._feeds))
                self._port.admit(timeout)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ rendezvous
    def _init_target(self, tensors: Mapping[str, Any], token: Any, host: str, device: str | None,
                     timeout: float) -> None:
        shards = {name: t if isinstance(t, Target) else Target(*t) for name, t in tensors.items()}
        self.region = adopt_tensors(TensorRegion, {n: t.tensor for n, t in shards.items()}, device)
        manifest = self.region.manifest
        spec = RankSpec("target", self.rank, [
            TargetTensor(n, tuple(t.tensor.shape), manifest[n].dtype, manifest[n].offset, tuple(t.pieces))
            for n, t in shards.items()])
        self._port = TargetPort(host, token, self.group, self.rank, self.stall_timeout, DEFAULT_HANDSHAKE_TIMEOUT)
        self._rdv.publish(_key(self.group, "target", self.rank), msgpack.packb(
            {"spec": spec.to_bytes(), "address": list(self._port.address)}, use_bin_type=True))

    def _init_source(self, tensors: Mapping[str, Any], device: str | None, timeout: float) -> None:
        shards = {name: source_of(t) for name, t in tensors.items()}
        targets = self._read_targets(timeout)
        wire: dict[str, str] = {}
        for spec in targets:
            for t in spec.tensors:
                for piece in t.pieces:
                    seen = wire.setdefault(piece.source_name, t.dtype)
                    if seen != t.dtype:
                        raise PlanError(f"source tensor {piece.source_name!r} is wanted as {seen} by one target "
                                        f"tensor and as {t.dtype} by {t.name!r}: targets must agree on its dtype")
        layout = [(n, wire.get(n, _dt.from_torch(s.tensor.dtype).name), s.box.sizes) for n, s in shards.items()]
        manifest = Manifest.layout(layout)
        where = device or next((f"cuda:{s.tensor.device.index or 0}" for s in shards.values()
                                if s.tensor.device.type == "cuda"), "cpu")
        self.region = TensorRegion.from_manifest(manifest, device=where)
        self._shards = [(s.tensor, tensor_view(self.region, manifest[n])) for n, s in shards.items()]
        self.adopted = self._adopt([s.adopt for s in shards.values()])
        self._view_ptrs = [view.data_ptr() for _, view in self._shards]
        spec = RankSpec("source", self.rank, [
            SourceTensor(n, s.global_shape, manifest[n].dtype, s.box, manifest[n].offset) for n, s in shards.items()])
        self._rdv.publish(_key(self.group, "source", self.rank), msgpack.packb({"spec": spec.to_bytes()},
                                                                                use_bin_type=True))

    def _records(self, role: str, count: int, timeout: float) -> list[dict[str, Any]]:
        raw = self._rdv.read([_key(self.group, role, r) for r in range(count)], timeout)
        return [msgpack.unpackb(v, raw=False) for v in raw]

    def _read_targets(self, timeout: float) -> list[RankSpec]:
        """The targets' descriptions and addresses (read from the store once: sources need them before they
        lay out their region, and every rank again to plan)."""
        if self._targets is None:
            records = self._records("target", self.world[1], timeout)
            self._target_addresses = {i: (r["address"][0], int(r["address"][1])) for i, r in enumerate(records)}
            self._targets = [RankSpec.from_bytes(r["spec"]) for r in records]
        return self._targets

    def _agree(self, timeout: float) -> Plan:
        """Every rank plans from the store's descriptions and checks that all computed the same plan."""
        targets = self._read_targets(timeout)
        sources = [RankSpec.from_bytes(r["spec"]) for r in self._records("source", self.world[0], timeout)]
        p = plan(sources, targets)
        me = _key(self.group, "digest", self.role, self.rank)
        self._rdv.publish(me, p.digest.encode())
        keys = [_key(self.group, "digest", role, r) for role, n in (("source", self.world[0]),
                                                                      ("target", self.world[1])) for r in range(n)]
        differ = [k for k, d in zip(keys, self._rdv.read(keys, timeout)) if d != p.digest.encode()]
        if differ:
            raise PlanError(f"sync {self.group!r}: {len(differ)} rank(s) computed another plan ({differ[:4]}): their "
                            f"shard descriptions or planners differ")
        return p

    def _connect(self, token: Any, transport: str, streams: int | None, timeout: float) -> None:
        for target in self.plan.send_order.get(self.rank, ()):
            self._links[target] = SourceLink(self._target_addresses[target], token, self.group, self.rank, target,
                                             self.plan.digest, transport, streams, self.stall_timeout,
                                             min(timeout, DEFAULT_HANDSHAKE_TIMEOUT))
        self._segments = {t: segments_of(self.plan, self.rank, t) for t in self._links}

    # ------------------------------------------------------------ steps
    def push(self) -> SyncStats:
        """Sources: pack this rank's shards into its region and send every target its segments, in parallel.

        Raises
        ------
        TransferError (PeerLost, TransferTimeout)
            A target failed; the message names it.  The others may have the update; they report the version
            only if every source that feeds them delivered it.
        """
        if self.role != "source" or self.region is None:
            raise TypeError("push() is for source ranks")
        with self._lock:
            t0 = time.perf_counter()
            packed_bytes = self._pack()
            packed = time.perf_counter() - t0
            version = self.version + 1
            results: dict[int, Any] = {}

            def run(target: int, link: SourceLink) -> None:
                try:
                    results[target] = link.push(self.region, self._segments[target], version)  # type: ignore[arg-type]
                except BaseException as e:
                    results[target] = e
            threads = [threading.Thread(target=run, args=(t, link), name=f"tensorxfer-sync-push-{t}", daemon=True)
                       for t, link in self._links.items()]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            failed = {t: r for t, r in results.items() if isinstance(r, BaseException)}
            if failed:
                first = failed[min(failed)]
                raise first if isinstance(first, TransferError) else TransferError(
                    f"sync: the push to target rank(s) {sorted(failed)} failed: {first!r}") from first
            self.version = version
            pairs = tuple(results[t] for t in sorted(results))
            return SyncStats(version, sum(p.bytes for p in pairs), time.perf_counter() - t0, packed, pairs,
                             packed_bytes)

    def _adopt(self, allowed: list[bool]) -> int:
        """Move the adoptable local shards into the region and re-point them there (their old storage is
        freed with its last reference); the number adopted.  A push then copies only the others."""
        import torch

        adopted = 0
        with torch.no_grad():
            for (local, view), ok in zip(self._shards, allowed):
                if (ok and local.dtype == view.dtype and local.device == view.device and local.is_contiguous()
                        and tuple(local.shape) == tuple(view.shape)):
                    view.copy_(local)
                    local.data = view
                    adopted += 1
        return adopted

    def _pack(self) -> int:
        """Copy (and cast) the local shards that are not views of the region into it (each push: the trainer
        may have re-pointed an adopted one); the bytes copied."""
        import torch

        assert self.region is not None
        packed = 0
        locals_ = [local for local, _ in self._shards]
        if [t.data_ptr() for t in locals_] != self._view_ptrs:     # one pass; ~a thousand shards per push
            with torch.no_grad():
                for local, view in self._shards:
                    if local.data_ptr() != view.data_ptr():
                        view.copy_(local.reshape(view.shape))
                        packed += view.numel() * view.element_size()
        if self.region.is_cuda:
            torch.cuda.synchronize(self.region.device)     # the pack, and the optimizer's step on adopted shards
        return packed

    def wait(self, timeout: float | None = None) -> int:
        """Targets: wait for the next update from every source that feeds this rank; return its version.

        Raises
        ------
        TransferError (PeerLost, TransferTimeout)
            A source died, stalled or failed (named); the region may hold a mix of versions and none is
            reported complete.
        ProtocolError
            The sources sent different versions in one step.
        """
        if self.role != "target" or self._port is None or self.region is None:
            raise TypeError("wait() is for target ranks")
        with self._lock:
            t0 = time.perf_counter()
            results = self._port.step(self.region, self._feeds, timeout)
            failed = {s: r for s, r in results.items() if isinstance(r, BaseException)}
            for s in failed:
                self._port.drop(s)      # its session's state is unknown: it reconnects
            if failed:
                first = failed[min(failed)]
                if isinstance(first, TransferError):
                    first.args = (f"sync: target {self.rank}: source rank {min(failed)} failed: {first}",
                                  *first.args[1:])
                    raise first
                raise first
            versions = {v for v, _ in results.values()}
            if len(versions) != 1:
                raise TransferError(f"sync: target {self.rank} got versions {sorted(versions)} in one step: the "
                                    f"sources are out of step")
            version = versions.pop()
            self.version = version
            pairs = tuple(PairStats(s, self.rank, st.bytes, st.seconds, st.wire_seconds, st.runs, st.transport,
                                    st.setup) for s, (_, st) in sorted(results.items()))
            self.last_stats = SyncStats(version, sum(p.bytes for p in pairs), time.perf_counter() - t0, 0.0, pairs)
            return version

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the pair sessions and the listener; the region's memory stays with the tensors viewing it."""
        links, self._links = self._links, {}
        for link in links.values():
            link.close()
        port, self._port = self._port, None
        if port is not None:
            port.close()
        region, self.region = self.region, None
        if region is not None:
            region.close()

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

