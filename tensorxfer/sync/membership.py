"""Who is in a weight sync group at each step, agreed through the rendezvous store.

A group is formed once (step 0: the ``world`` of sources and targets named at construction) and may
change before any later step: a target joins (it registers; the next step includes it), leaves (it
deregisters) or dies (it stops reporting; on etcd its lease also expires); a source dies.  A rank the
group left out while it was alive -- it stalled past the stall timeout -- joins again as a new
incarnation once it runs, source or target (a source that was merely slow comes back).  The membership
of step ``n`` is decided by the first source that proposes one (``publish_once``: every rank reads the
same record, whoever wrote it), once every member of step ``n - 1`` reported it or, by the one clock of
:mod:`tensorxfer.sync.clock`, showed no sign of life for the stall timeout.  A record whose members
differ from the previous step's starts a new *epoch*; every rank plans an epoch from the shard
descriptions the record names.

Every value (but a description body, which is content-addressed) is sealed with the group's token and
checked when read (:mod:`tensorxfer.sync.records`): a
bad member record or report is one rank's problem (passed over, said once); a bad step record fails that
step for every rank with a :class:`~tensorxfer.errors.StoreError` naming the key, and the next step
goes on; a description that differs from what its rank published is refused.

Keys (under ``tensorxfer.sync/<group>/``), all msgpack unless said, all but the bodies sealed:

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
``digest/<epoch>/<role>/<rank>``           the plan digest the rank computed for that epoch (hex)
``beat/<role>/<rank>``                     ``{uid, step, count}``: a rank busy in a step is alive
========================================  ==============================================================
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import secrets
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any

from tensorxfer.errors import PlanError, StoreError, TransferError, TransferTimeout
from tensorxfer.sync._columns import WIRE_VERSION
from tensorxfer.sync.clock import StepClock
from tensorxfer.sync.records import (
    Beat,
    Failure,
    GroupStore,
    Member,
    Report,
    SpecRef,
    StepRecord,
    decode_digest,
    decode_step,
    group_key,
    strip,
)
from tensorxfer.sync.rendezvous.base import Rendezvous
from tensorxfer.sync.spec import RankSpec

log = logging.getLogger(__name__)

__all__ = ["Membership", "Report", "StepRecord", "group_key", "group_status"]

ROLES = ("source", "target")
MAX_BODY = 1 << 28      # bytes a description body may inflate to (a store's value is not trusted)


class Membership:
    """One rank's side of the group's membership protocol (see the module docstring).

    ``token_key`` seals and checks every record (None: a public key, which detects corruption only).
    """

    def __init__(self, rdv: Rendezvous, group: str, role: str, rank: int, stall_timeout: float,
                 token_key: bytes | None = None) -> None:
        self.rdv, self.group, self.role, self.rank = rdv, group, role, rank
        self.store = GroupStore(rdv, group, token_key)
        self.clock = StepClock(float(stall_timeout))
        self.uid = secrets.token_hex(8)
        self._joined = False
        self._spec: RankSpec | None = None
        self._address: tuple[str, int] | None = None
        self._device: str | None = None
        self._specs: dict[tuple[str, int, str], tuple[RankSpec, tuple[str, int] | None, str | None]] = {}
        self._memo: dict[bytes, Any] = {}
        self._bodies: dict[str, bytes] = {}     # content digest -> description body
        self._live: dict[str, tuple[int, dict[int, str]]] = {}     # role -> (members version, members)
        self._records: dict[str, dict[int, bytes]] = {}            # role -> rank -> its sealed member record
        self._known: set[str] = set()      # every incarnation a record this rank read named (a dropped one
                                           # never comes back: a rank dropped alive rejoins under a new uid)
        self._beat = _Heartbeat(self)

    @property
    def stall_timeout(self) -> float:
        return self.clock.stall

    def key(self, *parts: object) -> str:
        return group_key(self.group, *parts)

    # ------------------------------------------------------------ this rank
    def register(self, spec: RankSpec, address: tuple[str, int] | None = None, timeout: float = 0.0,
                 device: str | None = None) -> None:
        """Publish this rank's shard description (and ``device``: see :class:`~tensorxfer.sync.records.SpecRef`)
        and join the group.

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
        self._spec, self._address, self._device = spec, address, device
        content = spec.content_digest.hex()
        body_key = self.key("body", content)
        if not self.store.has(body_key):                  # a replica may have put it already
            self.store.put_content(body_key, zlib.compress(spec.body, 3))
        self.store.put(self.key("spec", self.role, self.rank, self.uid), SpecRef(content, address, device).encode())
        self.store.join(self.key("member", self.role), str(self.rank), Member(self.uid, address).encode())
        self._joined = True

    def rejoin(self) -> None:
        """Join again as a new incarnation (a rank the group dropped while it was alive, e.g. one that did
        not report a step in time: the next step takes it in as a newcomer)."""
        assert self._spec is not None, "register() first"
        self.leave()
        self.uid = secrets.token_hex(8)
        self.register(self._spec, self._address, device=self._device)     # its own old incarnation just left

    def leave(self) -> None:
        """Deregister (a clean exit: the next step's membership leaves this rank out)."""
        if self._joined:
            self._joined = False
            self.store.leave(self.key("member", self.role), str(self.rank))

    def fail(self, error: BaseException) -> None:
        """Say in the store that this rank's constructor failed, and why (best effort: the store may be
        what failed): the ranks waiting for it to register report this instead of timing out."""
        try:
            self.store.put(self.key("failed", self.role, self.rank),
                           Failure(self.uid, type(error).__name__, str(error)).encode())
        except Exception as e:
            log.debug("sync %r: could not record this rank's failure: %s", self.group, e)

    def _failures(self, wanted: dict[str, list[int]]) -> dict[tuple[str, int], Failure]:
        keys = [(role, r) for role, ranks in wanted.items() for r in ranks]
        found = self.store.peek_valid([self.key("failed", role, r) for role, r in keys], Failure.decode)
        return {k: f for k, f in zip(keys, found) if f is not None}

    def _failed_meanwhile(self, wanted: dict[str, list[int]], before: dict[tuple[str, int], Failure]) -> None:
        """Raise the failure of a wanted rank recorded since ``before`` was read (older ones may be a
        previous run's, which a restarted rank is about to replace)."""
        for (role, rank), f in self._failures(wanted).items():
            if before.get((role, rank)) != f:
                raise TransferError(f"sync {self.group!r}: {role} rank {rank} failed as it started ({f.error}: "
                                    f"{f.message}); the group cannot form without it")

    def close(self) -> None:
        """Stop beating and leave the group; idempotent."""
        self._beat.close()
        self.leave()

    def report(self, step: int, ok: bool, version: int, failed: dict[int, str]) -> None:
        data = Report(ok, version, failed).encode()
        self.store.put_many({self.key("report", step, self.role, self.rank): data,
                             self.key("status", self.role, self.rank): data})

    def publish_digest(self, epoch: int, digest: str) -> None:
        self.store.put(self.key("digest", epoch, self.role, self.rank), digest.encode())

    def busy(self, step: int) -> contextlib.AbstractContextManager[None]:
        """A block in which this rank works on ``step``: it beats (says it is alive) every ``clock.beat``
        seconds, so that a decider waiting for its report does not take a long step for a stall."""
        return self._beat.during(step)

    # ------------------------------------------------------------ the group
    def live(self, role: str) -> dict[int, str]:
        """The ranks of ``role`` registered now: rank -> uid (listed again only when the store says the
        membership changed, where it can say).  Records that fail their checks are passed over."""
        prefix = self.key("member", role)
        version = self.rdv.members_version(prefix)
        cached = self._live.get(role)
        if version is not None and cached is not None and cached[0] == version:
            return cached[1]
        found = self.store.members(prefix)
        live = {r: m.uid for r, (m, _) in found.items()}
        self._records[role] = {r: sealed for r, (_, sealed) in found.items()}
        if version is not None:
            self._live[role] = (version, live)
        return live

    def was_member(self) -> bool:
        """Whether a step record named this incarnation (one left out after that was dropped for good)."""
        return self.uid in self._known

    def formed(self) -> bool:
        """Whether the group has formed (its step 0 was decided)."""
        return self.store.has(self.key("step", 0))

    def initial_targets(self, count: int, timeout: float) -> list[RankSpec]:
        """Sources: the shard descriptions of target ranks ``0 .. count-1``, once registered (a source lays its
        region out in the dtypes they want)."""
        live = self._registered({"target": range(count)}, timeout)
        assert live is not None
        specs, _ = self._read_specs([("target", r, live["target"][r]) for r in range(count)], timeout)
        return specs

    def form(self, world: tuple[int, int], timeout: float) -> StepRecord:
        """Step 0: the ``world`` ranks named at construction, once all registered (sources propose it).  A rank
        that finds step 0 decided meanwhile takes it, and so gets what the others got (their plan's error,
        say) instead of waiting for ranks that formed the group and left."""
        if self.role == "source" and not self.formed():
            live = self._registered({role: range(n) for role, n in zip(ROLES, world)}, timeout, formed=True)
            if live is not None:
                first = StepRecord(0, 1, *({r: live[role][r] for r in range(n)} for role, n in zip(ROLES, world)))
                self.store.put_once(self.key("step", 0), first.encode())
        elif self.role == "target":     # the sources decide step 0: wait for it, or for one of them to fail
            everyone = {role: list(range(n)) for role, n in zip(ROLES, world)}
            before = self._failures(everyone)
            deadline = time.monotonic() + timeout
            while not self.formed() and time.monotonic() < deadline:
                self._failed_meanwhile(everyone, before)
                time.sleep(0.05)
            timeout = max(0.0, deadline - time.monotonic())     # what is left of it, not a second one
        return self.step_record(0, timeout)

    def _registered(self, want: dict[str, range], timeout: float,
                    formed: bool = False) -> dict[str, dict[int, str]] | None:
        """The live members of each role in ``want`` (rank -> uid), once every wanted rank registered; None
        (with ``formed``) as soon as the group turns out to have formed meanwhile.

        Raises
        ------
        TransferTimeout
            Some wanted ranks did not register within ``timeout`` (named).
        """
        deadline = time.monotonic() + timeout
        everyone = {role: list(ranks) for role, ranks in want.items()}
        before = self._failures(everyone)
        polls = 0
        while True:
            live = {role: self.live(role) for role in want}
            missing = {role: [r for r in ranks if r not in live[role]] for role, ranks in want.items()}
            if not any(missing.values()):
                return live
            if formed and self.formed():
                return None
            polls += 1
            if polls % 10 == 0:         # every ~0.1 s: a rank that failed as it started says so
                self._failed_meanwhile(missing, before)
            if time.monotonic() >= deadline:
                self._failed_meanwhile(missing, before)
                named = {role: ranks for role, ranks in missing.items() if ranks}
                earlier = [f"{role} rank {r}: {f.error}: {f.message}" for (role, r), f in before.items()
                           if r in named.get(role, ())]
                raise TransferTimeout(f"sync {self.group!r}: rank(s) {named} did not register within "
                                      f"{timeout:.0f} s (they did not start, or use another store or group)" +
                                      (f"; before this rank waited, the store held failures of "
                                       f"{'; '.join(earlier)} (this run's, or a previous one's)" if earlier else ""))
            time.sleep(0.01)

    def step_record(self, step: int, timeout: float) -> StepRecord:
        """The members of ``step``, waiting up to ``timeout`` for the sources to decide it.

        Raises
        ------
        StoreError
            The store's record of that step is not one the group wrote (every rank gets this for the step).
        TransferTimeout
            Not decided in time.
        """
        key = self.key("step", step)
        return self._seen(StepRecord.decode(key, step, self.store.get([key], timeout)[0]))

    def _seen(self, record: StepRecord) -> StepRecord:
        self._known.update(record.sources.values(), record.targets.values())
        return record

    def latest(self) -> int:
        """The newest step decided so far (0: the group has only formed, or not even that, or the store's
        value is not usable)."""
        [latest] = self.store.peek_valid([self.key("latest")], decode_step)
        return latest or 0

    def specs(self, record: StepRecord, timeout: float) -> tuple[list[RankSpec], list[RankSpec],
                                                                 dict[int, tuple[str, int]]]:
        """The shard descriptions of a step's members, and the targets' addresses (each incarnation's read
        and decoded once: a join or a leave reads just the newcomer's; equal descriptions -- the replicas of
        a TP rank -- decode once).

        Raises
        ------
        StoreError
            A member's description is not what the group wrote, or this rank's is not what it published.
        PlanError
            A description is malformed (named).
        """
        wanted = [("source", r, u) for r, u in sorted(record.sources.items())] + \
                 [("target", r, u) for r, u in sorted(record.targets.items())]
        specs, addresses = self._read_specs(wanted, timeout)
        n = len(record.sources)
        targets = {}
        for (_, rank, _), where in zip(wanted[n:], addresses[n:]):
            if where is None:
                raise StoreError(f"sync {self.group!r}: target rank {rank}'s description names no address",
                                 self.key("spec", "target", rank))
            targets[rank] = where
        return specs[:n], specs[n:], targets

    def _read_specs(self, wanted: list[tuple[str, int, str]], timeout: float) -> tuple[list[RankSpec],
                                                                                     list[tuple[str, int] | None]]:
        new = [w for w in wanted if w not in self._specs]
        keys = [self.key("spec", *w) for w in new]
        values = self.store.rdv.read(keys, timeout)
        refs = []
        for w, k, v in zip(new, keys, values):
            mine = w == (self.role, self.rank, self.uid)
            try:
                ref = SpecRef.decode(k, self.store.seal.open(k, v))
                if mine and self._spec is not None and (ref.content != self._spec.content_digest.hex()
                                                        or ref.address != self._address or ref.device != self._device):
                    raise StoreError(f"the store's {k!r} is not the description this rank published", k)
            except StoreError as e:
                if not mine:
                    raise
                # someone rewrote this rank's own description: nobody may plan from it, and this rank comes
                # back under a fresh one (a new incarnation: the next step decided takes it in)
                self.rejoin()
                raise StoreError(f"sync {self.group!r}: {e}; this {self.role} rank joined again with a fresh "
                                 f"description (the group's next step takes it in)", k) from None
            refs.append(ref)
        contents = list(dict.fromkeys(r.content for r in refs if r.content not in self._bodies))
        body_keys = [self.key("body", c) for c in contents]
        for content, packed in zip(contents, self.store.get_content(body_keys, timeout)):
            body = self._inflate(content, packed)
            if hashlib.sha256(body).hexdigest() != content:
                raise PlanError(f"sync {self.group!r}: the store's description body {content[:16]} does not hash "
                                f"to its name (a corrupted or tampered store)")
            self._bodies[content] = body
        for w, ref in zip(new, refs):
            spec = RankSpec.from_wire({"v": WIRE_VERSION, "rank": w[1], "body": self._bodies[ref.content]},
                                      memo=self._memo, content_digest=bytes.fromhex(ref.content))   # checked
            if spec.role != w[0]:
                raise PlanError(f"sync {self.group!r}: {w[0]} rank {w[1]} registered a {spec.role}'s description")
            self._specs[w] = (spec, ref.address, ref.device)
        return [self._specs[w][0] for w in wanted], [self._specs[w][1] for w in wanted]

    def devices(self, record: StepRecord) -> dict[tuple[str, int], str | None]:
        """(role, rank) -> the GPU each member of ``record`` registered (after :meth:`specs` read them)."""
        out = {}
        for role, ranks in (("source", record.sources), ("target", record.targets)):
            for rank, uid in ranks.items():
                found = self._specs.get((role, rank, uid))
                out[(role, rank)] = found[2] if found is not None else None
        return out

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
        """Sources: the members of ``step``: the previous step's, less the dead, plus the ranks that joined
        (targets, and sources the group had left out while they were alive).

        A member of ``prev`` is dead when it did not report ``prev`` and showed no sign of life (a report or
        a beat) for the stall timeout, or sooner when a peer named it failed and it has not reported within
        the grace, or when its membership key is gone (it left; on etcd also: its lease expired).

        Raises
        ------
        StoreError
            The store holds a step record for ``step`` the group did not write (the step is spent).
        """
        key = self.key("step", step)
        existing = self.store.peek([key])[0]
        if existing is None and self.rank != min(prev.sources, default=self.rank):
            try:    # the lowest source of the previous step decides; the others take its record
                existing = self.store.get([key], self.clock.leader)[0]
            except TransferTimeout:
                existing = None     # it died or stalls: decide here (first writer wins either way)
        if existing is None:
            alive = self._reported(prev) if prev.step > 0 else (set(prev.sources), set(prev.targets))
            live = {role: self.live(role) for role in ROLES}
            chosen = []
            for role, was, up in (("source", prev.sources, alive[0]), ("target", prev.targets, alive[1])):
                kept = {r: u for r, u in was.items() if r in up and live[role].get(r) == u}
                for r, u in live[role].items():
                    if r not in kept and u not in self._known:       # joined, or rejoined as a new incarnation
                        kept[r] = u
                chosen.append(kept)
            sources, targets = chosen
            proposal = StepRecord(step, prev.epoch, sources, targets)
            if not proposal.same_members(prev):
                proposal = StepRecord(step, prev.epoch + 1, sources, targets)
            existing = self.store.put_once(key, proposal.encode())
            self.store.put(self.key("latest"), str(step).encode())
            if existing == proposal.encode():       # this rank decided: evict the dropped (a live one rejoins)
                for role, dropped, kept in (("source", prev.sources, sources), ("target", prev.targets, targets)):
                    for r, u in dropped.items():
                        record = self._records.get(role, {}).get(r)
                        if r not in kept and live[role].get(r) == u and record is not None:
                            self.store.evict(self.key("member", role), str(r), record)
        return self._seen(StepRecord.decode(key, step, existing))

    def _reported(self, prev: StepRecord) -> tuple[set[int], set[int]]:
        """The sources and targets of ``prev`` that reported it (waiting as the docstring of decide says)."""
        ranks = [("source", r) for r in sorted(prev.sources)] + [("target", r) for r in sorted(prev.targets)]
        uids = {("source", r): u for r, u in prev.sources.items()} | {("target", r): u for r, u in prev.targets.items()}
        keys = [self.key("report", prev.step, role, r) for role, r in ranks]
        beat_keys = [self.key("beat", role, r) for role, r in ranks]
        start = time.monotonic()
        heard = dict.fromkeys(ranks, start)     # when each rank last showed a sign of life
        beats: dict[tuple[str, int], Beat | None] = {}
        named_at: dict[tuple[str, int], float] = {}
        clock, pause = self.clock, 0.001
        while True:
            values = self.store.peek_valid(keys + beat_keys, _report_or_beat)
            now = time.monotonic()
            reports = {rr: v for rr, v in zip(ranks, values) if isinstance(v, Report)}
            for rr, b in zip(ranks, values[len(ranks):]):
                beat = b if isinstance(b, Beat) and b.uid == uids[rr] else None
                if rr in beats and beat is not None and beat != beats[rr]:
                    heard[rr] = now     # it beat since the last look
                beats[rr] = beat
            for (role, _), rep in reports.items():
                for peer in rep.failed:
                    named_at.setdefault(("target" if role == "source" else "source", peer), now)
            waiting = [rr for rr in ranks if rr not in reports and now - heard[rr] < clock.silence
                       and not (rr in named_at and now - named_at[rr] >= clock.grace)]
            if not waiting:
                break
            if pause >= 0.05:       # slow to report: perhaps gone; membership keys say so at once
                live = {role: self.live(role) for role in ROLES}
                if all(live[role].get(r) != uids[(role, r)] for role, r in waiting):
                    break
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return ({r for role, r in reports if role == "source"}, {r for role, r in reports if role == "target"})


def _report_or_beat(key: str, value: bytes) -> Report | Beat:
    return Beat.decode(key, value) if "/beat/" in key else Report.decode(key, value)


class _Heartbeat:
    """Beats for a rank while it works on a step (:meth:`Membership.busy`): one thread, made on first use,
    that writes ``beat/<role>/<rank>`` every ``clock.beat`` seconds of a step (a step shorter than that writes
    nothing)."""

    def __init__(self, members: Membership) -> None:
        self._members = members
        self._cond = threading.Condition()
        self._step: int | None = None
        self._count = 0
        self._closed = False
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def during(self, step: int) -> Iterator[None]:
        with self._cond:
            if self._closed:
                yield
                return
            self._step = step
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tensorxfer-sync-beat", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._step = None
                self._cond.notify_all()

    def _run(self) -> None:
        m = self._members
        key = m.key("beat", m.role, m.rank)
        while True:
            with self._cond:
                while self._step is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                step = self._step
                assert step is not None
                self._cond.wait(m.clock.beat)
                if self._closed:
                    return
                if self._step != step:
                    continue        # the step ended (or another began) meanwhile
                self._count += 1
                beat = Beat(m.uid, step, self._count)
            try:
                m.store.put(key, beat.encode())
            except Exception as e:      # the store is gone for a moment: the next beat tries again
                m.store.warn(key, b"", e)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)


def group_status(rdv: Rendezvous, group: str, token_key: bytes | None = None) -> dict[str, Any]:
    """The operator's view of a group, from the store alone: its live members, the newest step with its
    epoch and members, and per rank the plan digest it computed for that epoch and its latest report.

    With the group's ``token_key`` every record is checked and the ones that fail are left out
    (``verified`` is True); without it the records are read as they are (``verified`` False)."""
    store = GroupStore(rdv, group, token_key)

    def read(key: str, data: bytes | None, decode: Any) -> Any:
        if data is None:
            return None
        if token_key is not None:
            return store.valid(key, data, decode)
        try:
            return decode(key, strip(data))
        except StoreError:
            return None

    def key(*parts: object) -> str:
        return group_key(group, *parts)

    latest = read(key("latest"), rdv.peek([key("latest")])[0], decode_step) or 0
    out: dict[str, Any] = {"group": group, "members": {}, "latest_step": latest, "verified": token_key is not None}
    for role in ROLES:
        prefix = key("member", role)
        members = {}
        for name, data in rdv.members(prefix).items():
            member = read(f"{prefix}/{name}", data, Member.decode) if name.isdecimal() else None
            if member is not None:
                members[int(name)] = {"uid": member.uid, "address": list(member.address) if member.address else None}
        out["members"][role] = members
    step = out["latest_step"]
    record = read(key("step", step), rdv.peek([key("step", step)])[0],
                  lambda k, v: StepRecord.decode(k, step, v))
    if record is None:
        return out
    out["epoch"] = record.epoch
    out["step_members"] = {"source": sorted(record.sources), "target": sorted(record.targets)}
    ranks = [(role, r) for role, rs in zip(ROLES, (record.sources, record.targets)) for r in sorted(rs)]
    ranks += [(role, r) for role in ROLES for r in sorted(out["members"][role]) if (role, r) not in ranks]
    digest_keys = [key("digest", record.epoch, role, r) for role, r in ranks]
    status_keys = [key("status", role, r) for role, r in ranks]
    digests = [read(k, v, decode_digest) for k, v in zip(digest_keys, rdv.peek(digest_keys))]
    reports = [read(k, v, Report.decode) for k, v in zip(status_keys, rdv.peek(status_keys))]
    out["ranks"] = [{"role": role, "rank": r, "alive": r in out["members"][role],
                     "in_step": r in (record.sources if role == "source" else record.targets),
                     "digest": d, "report": vars(rep) if rep else None}
                    for (role, r), d, rep in zip(ranks, digests, reports)]
    return out
