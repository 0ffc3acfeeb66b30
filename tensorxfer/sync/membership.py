"""Who is in a weight sync group at each step, agreed through the rendezvous store.

A group is formed once (step 0: the ``world`` of sources and targets named at construction) and may
change before any later step: a target joins (it registers; the next step includes it), leaves (it
deregisters) or dies (it stops reporting; on etcd its lease also expires); a source dies.  The
membership of step ``n`` is decided by the first source that proposes one (``publish_once``: every rank
reads the same record, whoever wrote it), after the reports of step ``n - 1`` are in or the stall
timeout passed for the ranks that never sent theirs.  A record whose members differ from the previous
step's starts a new *epoch*; every rank plans an epoch from the shard descriptions the record names.

Keys (under ``tensorxfer.sync/<group>/``), all msgpack:

========================================  ==============================================================
``member/<role>/<rank>``                   ``{uid, address}``: alive while the rank is (join / leave)
``spec/<role>/<rank>/<uid>``               ``{content, address}``: written once per incarnation, kept
``body/<content>``                         a description's body (no rank), zlib-compressed (names repeat:
                                           about 10x smaller), under the sha256 of the uncompressed body:
                                           the replicas of a TP rank share one; a rank reads each once
``step/<n>``                               ``{epoch, sources, targets}`` (rank -> uid): first writer wins
``latest``                                 the newest step decided (where a joining target starts)
``report/<n>/<role>/<rank>``               ``{ok, version, failed}`` after step ``n`` (failed: peer -> why)
``status/<role>/<rank>``                   the rank's latest report (the operator's view)
``digest/<epoch>/<role>/<rank>``           the plan digest the rank computed for that epoch
========================================  ==============================================================
"""

from __future__ import annotations

import hashlib
import secrets
import time
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack

from tensorxfer.errors import PlanError, TransferError, TransferTimeout
from tensorxfer.sync._columns import WIRE_VERSION
from tensorxfer.sync.rendezvous.base import Rendezvous
from tensorxfer.sync.spec import RankSpec

ROLES = ("source", "target")
LEADER_WAIT = 1.0       # seconds a source waits for the lowest source's step record before deciding itself
MAX_BODY = 1 << 28      # bytes a description body may inflate to (a store's value is not trusted)


def group_key(group: str, *parts: object) -> str:
    return "/".join(["tensorxfer.sync", group, *map(str, parts)])


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


@dataclass(frozen=True)
class StepRecord:
    """The members of one step: source and target ranks with the incarnation (uid) of each."""

    step: int
    epoch: int
    sources: dict[int, str]
    targets: dict[int, str]

    def to_bytes(self) -> bytes:
        return _pack({"epoch": self.epoch, "sources": sorted(self.sources.items()),
                      "targets": sorted(self.targets.items())})

    @classmethod
    def from_bytes(cls, step: int, data: bytes) -> StepRecord:
        d = _unpack(data)
        return cls(step, int(d["epoch"]), {int(r): str(u) for r, u in d["sources"]},
                   {int(r): str(u) for r, u in d["targets"]})

    def same_members(self, other: StepRecord) -> bool:
        return self.sources == other.sources and self.targets == other.targets

    def holds(self, role: str, rank: int, uid: str) -> bool:
        return (self.sources if role == "source" else self.targets).get(rank) == uid


@dataclass(frozen=True)
class Report:
    """What one rank says after a step: whether its part went through, the version it holds, who failed."""

    ok: bool
    version: int
    failed: dict[int, str]

    def to_bytes(self) -> bytes:
        return _pack({"ok": self.ok, "version": self.version, "failed": sorted(self.failed.items())})

    @classmethod
    def from_bytes(cls, data: bytes) -> Report:
        d = _unpack(data)
        return cls(bool(d["ok"]), int(d["version"]), {int(r): str(w) for r, w in d["failed"]})


class Membership:
    """One rank's side of the group's membership protocol (see the module docstring)."""

    def __init__(self, rdv: Rendezvous, group: str, role: str, rank: int, stall_timeout: float) -> None:
        self.rdv, self.group, self.role, self.rank = rdv, group, role, rank
        self.stall_timeout = stall_timeout
        self.uid = secrets.token_hex(8)
        self._joined = False
        self._specs: dict[tuple[str, int, str], tuple[RankSpec, tuple[str, int] | None]] = {}
        self._memo: dict[bytes, Any] = {}
        self._bodies: dict[str, bytes] = {}     # content digest -> description body
        self._live: dict[str, tuple[int, dict[int, str]]] = {}     # role -> (members version, members)
        self._records: dict[str, dict[int, bytes]] = {}            # role -> rank -> its member record
        self._known: set[str] = set()      # every incarnation a record this rank read named (a dropped one
                                           # never comes back: a rank dropped alive rejoins under a new uid)

    def key(self, *parts: object) -> str:
        return group_key(self.group, *parts)

    # ------------------------------------------------------------ this rank
    def register(self, spec: RankSpec, address: tuple[str, int] | None = None, timeout: float = 0.0) -> None:
        """Publish this rank's shard description and join the group.

        A rank another live process holds is waited for up to ``timeout`` seconds (a restarted rank whose
        old incarnation the group has not dropped yet: its lease expires, or the next step drops it).

        Raises
        ------
        TransferError
            The rank is still held after ``timeout`` (two processes were given one rank?).
        """
        deadline = time.monotonic() + timeout
        while (holder := self.live(self.role).get(self.rank)) not in (None, self.uid):
            if time.monotonic() >= deadline:
                raise TransferError(
                    f"sync {self.group!r}: {self.role} rank {self.rank} is held by another live member (uid "
                    f"{holder}) after {timeout:.0f} s: two processes were given this rank, or one that died "
                    f"is not dropped yet (a lease expires after its TTL; a TCPStore group drops it at its next "
                    f"step)")
            time.sleep(0.05)
        self._spec, self._address = spec, address
        where = list(address) if address is not None else None
        content = spec.content_digest.hex()
        body_key = self.key("body", content)
        if not self.rdv.has(body_key):                  # a replica may have put it already
            self.rdv.publish(body_key, zlib.compress(spec.body, 3))
        self.rdv.publish(self.key("spec", self.role, self.rank, self.uid),
                         _pack({"content": content, "address": where}))
        self.rdv.join(self.key("member", self.role), str(self.rank), _pack({"uid": self.uid, "address": where}))
        self._joined = True

    def rejoin(self) -> None:
        """Join again as a new incarnation (a rank the group dropped while it was alive, e.g. one that did
        not report a step in time: the next step takes it in as a newcomer)."""
        self.leave()
        self.uid = secrets.token_hex(8)
        self.register(self._spec, self._address)     # its own old incarnation just left

    def leave(self) -> None:
        """Deregister (a clean exit: the next step's membership leaves this rank out)."""
        if self._joined:
            self._joined = False
            self.rdv.leave(self.key("member", self.role), str(self.rank))

    def report(self, step: int, ok: bool, version: int, failed: dict[int, str]) -> None:
        data = Report(ok, version, failed).to_bytes()
        self.rdv.publish_many({self.key("report", step, self.role, self.rank): data,
                               self.key("status", self.role, self.rank): data})

    def publish_digest(self, epoch: int, digest: str) -> None:
        self.rdv.publish(self.key("digest", epoch, self.role, self.rank), digest.encode())

    # ------------------------------------------------------------ the group
    def live(self, role: str) -> dict[int, str]:
        """The ranks of ``role`` registered now: rank -> uid (listed again only when the store says the
        membership changed, where it can say)."""
        prefix = self.key("member", role)
        version = self.rdv.members_version(prefix)
        cached = self._live.get(role)
        if version is not None and cached is not None and cached[0] == version:
            return cached[1]
        raw = {int(name): v for name, v in self.rdv.members(prefix).items()}
        live = {r: str(_unpack(v)["uid"]) for r, v in raw.items()}
        self._records[role] = raw
        if version is not None:
            self._live[role] = (version, live)
        return live

    def initial_targets(self, count: int, timeout: float) -> list[RankSpec]:
        """Sources: the shard descriptions of target ranks ``0 .. count-1``, once registered (a source lays its
        region out in the dtypes they want)."""
        live = self._registered({"target": range(count)}, timeout)["target"]
        specs, _ = self._read_specs([("target", r, live[r]) for r in range(count)], timeout)
        return specs

    def form(self, world: tuple[int, int], timeout: float) -> StepRecord:
        """Step 0: the ``world`` ranks named at construction, once all registered (sources propose it)."""
        existing = self.rdv.peek([self.key("step", 0)])[0]
        if existing is None and self.role == "source":
            live = self._registered({role: range(n) for role, n in zip(ROLES, world)}, timeout)
            first = StepRecord(0, 1, *({r: live[role][r] for r in range(n)} for role, n in zip(ROLES, world)))
            self.rdv.publish_once(self.key("step", 0), first.to_bytes())
        return self.step_record(0, timeout)

    def _registered(self, want: dict[str, range], timeout: float) -> dict[str, dict[int, str]]:
        """The live members of each role in ``want`` (rank -> uid), once every wanted rank registered.

        Raises
        ------
        TransferTimeout
            Some wanted ranks did not register within ``timeout`` (named).
        """
        deadline = time.monotonic() + timeout
        while True:
            live = {role: self.live(role) for role in want}
            missing = {role: [r for r in ranks if r not in live[role]] for role, ranks in want.items()}
            if not any(missing.values()):
                return live
            if time.monotonic() >= deadline:
                named = {role: ranks for role, ranks in missing.items() if ranks}
                raise TransferTimeout(f"sync {self.group!r}: rank(s) {named} did not register within "
                                      f"{timeout:.0f} s (they did not start, or use another store or group)")
            time.sleep(0.01)

    def step_record(self, step: int, timeout: float) -> StepRecord:
        """The members of ``step``, waiting up to ``timeout`` for the sources to decide it."""
        return self._seen(StepRecord.from_bytes(step, self.rdv.read([self.key("step", step)], timeout)[0]))

    def _seen(self, record: StepRecord) -> StepRecord:
        self._known.update(record.sources.values(), record.targets.values())
        return record

    def latest(self) -> int:
        """The newest step decided so far (0: the group has only formed, or not even that)."""
        value = self.rdv.peek([self.key("latest")])[0]
        return int(value) if value else 0

    def specs(self, record: StepRecord, timeout: float) -> tuple[list[RankSpec], list[RankSpec],
                                                                 dict[int, tuple[str, int]]]:
        """The shard descriptions of a step's members, and the targets' addresses (each incarnation's read
        and decoded once: a join or a leave reads just the newcomer's; equal descriptions -- the replicas of
        a TP rank -- decode once)."""
        wanted = [("source", r, u) for r, u in sorted(record.sources.items())] + \
                 [("target", r, u) for r, u in sorted(record.targets.items())]
        specs, addresses = self._read_specs(wanted, timeout)
        n = len(record.sources)
        return specs[:n], specs[n:], {w[1]: a for w, a in zip(wanted[n:], addresses[n:])}   # type: ignore[misc]

    def _read_specs(self, wanted: list[tuple[str, int, str]], timeout: float) -> tuple[list[RankSpec],
                                                                                     list[tuple[str, int] | None]]:
        new = [w for w in wanted if w not in self._specs]
        records = [_unpack(v) for v in self.rdv.read([self.key("spec", *w) for w in new], timeout)]
        contents = list(dict.fromkeys(r["content"] for r in records if r["content"] not in self._bodies))
        for content, packed in zip(contents, self.rdv.read([self.key("body", c) for c in contents], timeout)):
            body = self._inflate(content, packed)
            if hashlib.sha256(body).hexdigest() != content:
                raise PlanError(f"sync {self.group!r}: the store's description body {content[:16]} does not hash "
                                f"to its name (a corrupted or tampered store)")
            self._bodies[content] = body
        for w, r in zip(new, records):
            where = r["address"]
            spec = RankSpec.from_wire({"v": WIRE_VERSION, "rank": w[1], "body": self._bodies[r["content"]]},
                                      memo=self._memo, content_digest=bytes.fromhex(r["content"]))   # checked
            if spec.role != w[0]:
                raise PlanError(f"sync {self.group!r}: {w[0]} rank {w[1]} registered a {spec.role}'s description")
            self._specs[w] = (spec, (where[0], int(where[1])) if where else None)
        return [self._specs[w][0] for w in wanted], [self._specs[w][1] for w in wanted]

    def _inflate(self, content: str, packed: bytes) -> bytes:
        inflate = zlib.decompressobj()
        try:
            body = inflate.decompress(packed, MAX_BODY)
        except zlib.error as e:
            raise PlanError(f"sync {self.group!r}: the store's description body {content[:16]} is not zlib data "
                            f"({e}): written by another tensorxfer version, or corrupted") from None
        if not inflate.eof:
            raise PlanError(f"sync {self.group!r}: the store's description body {content[:16]} is truncated or "
                            f"inflates past {MAX_BODY} bytes")
        return body

    def decide(self, step: int, prev: StepRecord) -> StepRecord:
        """Sources: the members of ``step`` (the previous step's, less the dead, plus the targets that joined).

        A member of ``prev`` is dead when it did not report ``prev`` within the stall timeout, or sooner
        when a peer named it failed and it has not reported, or when its membership key is gone (it
        left; on etcd also: its lease expired).
        """
        key = self.key("step", step)
        existing = self.rdv.peek([key])[0]
        if existing is None and self.role == "source" and self.rank != min(prev.sources, default=self.rank):
            try:    # the lowest source of the previous step decides; the others take its record
                existing = self.rdv.read([key], min(LEADER_WAIT, self.stall_timeout))[0]
            except TransferTimeout:
                existing = None     # it died or stalls: decide here (first writer wins either way)
        if existing is None:
            alive = self._reported(prev) if prev.step > 0 else (set(prev.sources), set(prev.targets))
            live = {role: self.live(role) for role in ROLES}
            sources = {r: u for r, u in prev.sources.items() if r in alive[0] and live["source"].get(r) == u}
            targets = {r: u for r, u in prev.targets.items() if r in alive[1] and live["target"].get(r) == u}
            for r, u in live["target"].items():
                if r not in targets and u not in self._known:       # joined
                    targets[r] = u
            proposal = StepRecord(step, prev.epoch, sources, targets)
            if not proposal.same_members(prev):
                proposal = StepRecord(step, prev.epoch + 1, sources, targets)
            existing = self.rdv.publish_once(key, proposal.to_bytes())
            self.rdv.publish(self.key("latest"), str(step).encode())
            if existing == proposal.to_bytes():       # this rank decided: evict the dropped (a live one rejoins)
                for role, dropped, kept in (("source", prev.sources, sources), ("target", prev.targets, targets)):
                    for r, u in dropped.items():
                        record = self._records.get(role, {}).get(r)
                        if r not in kept and live[role].get(r) == u and record is not None:
                            self.rdv.evict(self.key("member", role), str(r), record)
        return self._seen(StepRecord.from_bytes(step, existing))

    def _reported(self, prev: StepRecord) -> tuple[set[int], set[int]]:
        """The sources and targets of ``prev`` that reported it (waiting as the docstring of decide says)."""
        ranks = [("source", r) for r in sorted(prev.sources)] + [("target", r) for r in sorted(prev.targets)]
        keys = [self.key("report", prev.step, role, r) for role, r in ranks]
        start = time.monotonic()
        grace = min(1.0, self.stall_timeout)   # a rank named failed by a peer gets this long to report anyway
        pause = 0.001
        while True:
            reports = {rr: Report.from_bytes(v) for rr, v in zip(ranks, self.rdv.peek(keys)) if v is not None}
            named = {("target" if role == "source" else "source", peer)
                     for (role, _), rep in reports.items() for peer in rep.failed}
            waited = time.monotonic() - start
            waiting = [rr for rr in ranks if rr not in reports and not (rr in named and waited >= grace)]
            if not waiting or waited >= self.stall_timeout:
                break
            if pause >= 0.05:       # slow to report: perhaps gone; membership keys say so at once
                live = {role: self.live(role) for role in ROLES}
                members = {"source": prev.sources, "target": prev.targets}
                if all(live[role].get(r) != members[role][r] for role, r in waiting):
                    break
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return ({r for role, r in reports if role == "source"}, {r for role, r in reports if role == "target"})


def group_status(rdv: Rendezvous, group: str) -> dict[str, Any]:
    """The operator's view of a group, from the store alone: its live members, the newest step with its
    epoch and members, and per rank the plan digest it computed for that epoch and its latest report."""
    def key(*parts: object) -> str:
        return group_key(group, *parts)

    latest = rdv.peek([key("latest")])[0]
    out: dict[str, Any] = {"group": group, "members": {}, "latest_step": int(latest) if latest else 0}
    for role in ROLES:
        out["members"][role] = {int(n): _unpack(v) for n, v in rdv.members(key("member", role)).items()}
    step = out["latest_step"]
    record_bytes = rdv.peek([key("step", step)])[0]
    if record_bytes is None:
        return out
    record = StepRecord.from_bytes(step, record_bytes)
    out["epoch"] = record.epoch
    out["step_members"] = {"source": sorted(record.sources), "target": sorted(record.targets)}
    ranks = [(role, r) for role, rs in zip(ROLES, (record.sources, record.targets)) for r in sorted(rs)]
    ranks += [(role, r) for role in ROLES for r in sorted(out["members"][role]) if (role, r) not in ranks]
    digests = rdv.peek([key("digest", record.epoch, role, r) for role, r in ranks])
    reports = rdv.peek([key("status", role, r) for role, r in ranks])
    out["ranks"] = [{"role": role, "rank": r, "alive": r in out["members"][role],
                     "in_step": r in (record.sources if role == "source" else record.targets),
                     "digest": d.decode() if d else None,
                     "report": vars(Report.from_bytes(rep)) if rep else None}
                    for (role, r), d, rep in zip(ranks, digests, reports)]
    return out
