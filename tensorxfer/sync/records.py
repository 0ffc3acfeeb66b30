"""What a weight sync keeps in its rendezvous store: every record sealed with the group's token, and checked.

The store is shared and may be written by others: a torch ``TCPStore`` authenticates nobody (any process
that reaches its port can set any key), and an etcd may serve other users.  Every record that steers
bytes or membership -- descriptions, member records, step records, reports, plan digests, heartbeats --
is therefore *sealed*: its value ends with an HMAC-SHA256, under the group's token key, over the record's
key and value.  Binding the key means a valid record cannot be replayed under another key (one rank's
description as another's, step 3's members as step 4's).  A writer without the token can then delete a
record, overwrite it with garbage or replay an older value of the same key: each of which a reader
detects (:class:`~tensorxfer.errors.StoreError`, naming the key) or which, at worst, stops a step; it can
never make a rank write a byte anywhere the group's own ranks did not plan.  Description bodies are
content-addressed (the sealed reference names their sha256), so they are covered too.

A group without a token seals with a public key: corruption is still detected, forgery is not (say so
where a token is missing; the pair sessions are unauthenticated then as well).

Every record kind has one decoder here that checks types and ranges and names the key and what is wrong:
a malformed value is an error a person can act on, never a bare ``FormatError`` or a ``ValueError`` from
``int()``.  Readers choose what a bad record means (see :class:`~tensorxfer.sync.membership.Membership`):
a bad member record or report is one rank's problem and is passed over; a bad step record fails that step
for every rank.
"""

from __future__ import annotations

import hmac
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from tensorxfer.errors import StoreError
from tensorxfer.protocol import mac
from tensorxfer.sync.rendezvous.base import Rendezvous

log = logging.getLogger(__name__)

TAG_BYTES = 32                      # HMAC-SHA256
MAX_RANK = 1 << 20                  # ranks a record may name
MAX_TEXT = 4096                     # characters of a reason in a report
MAX_TENSORS = 1 << 20               # tensors a record of amaxes may name
_PUBLIC_KEY = b"tensorxfer-sync-store-without-token"      # a tokenless group: detects corruption, not forgery
_UID = re.compile(r"[0-9a-f]{16}\Z")
_DIGEST = re.compile(r"[0-9a-f]{64}\Z")
_DEVICE = re.compile(r"[0-9a-f]{24}\Z")       # sync.copy_host.device_identity


def group_key(group: str, *parts: object) -> str:
    return "/".join(["tensorxfer.sync", group, *map(str, parts)])


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


class Seal:
    """Seals values with the group's token key and opens them again (see the module docstring)."""

    def __init__(self, token_key: bytes | None) -> None:
        self.authenticated = token_key is not None
        self._key = token_key or _PUBLIC_KEY

    def _tag(self, key: str, value: bytes) -> bytes:
        return mac(self._key, b"tensorxfer-sync-store", key.encode(), value)

    def seal(self, key: str, value: bytes) -> bytes:
        return value + self._tag(key, value)

    def open(self, key: str, data: bytes) -> bytes:
        """``data``'s value, once its seal proves it was written for ``key`` by a holder of the token.

        Raises
        ------
        StoreError
            It was not (named).
        """
        value = data[:-TAG_BYTES]
        if len(data) < TAG_BYTES or not hmac.compare_digest(data[-TAG_BYTES:], self._tag(key, value)):
            raise StoreError(f"the store's {key!r} is not sealed with this group's token "
                             f"({'written by a process without it' if self.authenticated else 'corrupted'}, "
                             f"or by another tensorxfer version): refused", key)
        return value


def strip(data: bytes) -> bytes:
    """A sealed value without checking its seal (an operator's view, read without the token)."""
    return data[:-TAG_BYTES] if len(data) >= TAG_BYTES else b""


# ---------------------------------------------------------------- checked decoding
def _bad(key: str, what: str) -> StoreError:
    return StoreError(f"the store's {key!r} {what} (a corrupted store, or written by another tensorxfer version)",
                      key)


def _fields(key: str, value: bytes, names: Sequence[str]) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(value, raw=False, strict_map_key=False)
    except Exception as e:
        raise _bad(key, f"is not msgpack ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise _bad(key, f"is a {type(obj).__name__}, not a map")
    missing = [n for n in names if n not in obj]
    if missing:
        raise _bad(key, f"lacks {missing}")
    return obj


def _int(key: str, what: str, v: Any, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(v) is not int or not lo <= v < hi:
        raise _bad(key, f"has {what} {v!r}, not an integer in [{lo}, {hi})")
    return v


def _uid(key: str, v: Any) -> str:
    if not isinstance(v, str) or not _UID.match(v):
        raise _bad(key, f"has uid {v!r}, not 16 hex digits")
    return v


def _address(key: str, v: Any) -> tuple[str, int] | None:
    if v is None:
        return None
    if not isinstance(v, list) or len(v) != 2 or not isinstance(v[0], str) or not 0 < len(v[0]) <= 255:
        raise _bad(key, f"has address {v!r}, not [host, port]")
    return v[0], _int(key, "port", v[1], 1, 65536)


def _rank_map(key: str, what: str, v: Any, value: Any) -> dict[int, Any]:
    if not isinstance(v, list) or len(v) > MAX_RANK:
        raise _bad(key, f"has {what} that are not a list of [rank, ...] pairs")
    out: dict[int, Any] = {}
    for item in v:
        if not isinstance(item, list) or len(item) != 2:
            raise _bad(key, f"has {what} entry {item!r}, not [rank, value]")
        rank = _int(key, f"a rank in {what}", item[0], 0, MAX_RANK)
        if rank in out:
            raise _bad(key, f"names rank {rank} twice in {what}")
        out[rank] = value(item[1])
    return out


def rank_name(key: str, name: str) -> int:
    """A member's rank from its key's last part (``member/<role>/<rank>``)."""
    if not name.isdecimal() or len(name) > 7 or int(name) >= MAX_RANK:
        raise _bad(key, f"is a member named {name!r}, not a rank")
    return int(name)


@dataclass(frozen=True)
class Member:
    """``member/<role>/<rank>``: the incarnation (uid) holding the rank now, and where a target listens."""

    uid: str
    address: tuple[str, int] | None

    def encode(self) -> bytes:
        return pack({"uid": self.uid, "address": list(self.address) if self.address else None})

    @classmethod
    def decode(cls, key: str, value: bytes) -> Member:
        d = _fields(key, value, ("uid", "address"))
        return cls(_uid(key, d["uid"]), _address(key, d["address"]))


@dataclass(frozen=True)
class SpecRef:
    """``spec/<role>/<rank>/<uid>``: an incarnation's description (by the sha256 of its body), address, and the
    GPU its region is on where pairs on that GPU may quantize on the way (``device``: a digest of the machine,
    user, mount namespace and GPU, :func:`tensorxfer.sync.copy_host.device_identity`; None: no such pair)."""

    content: str
    address: tuple[str, int] | None
    device: str | None = None

    def encode(self) -> bytes:
        return pack({"content": self.content, "address": list(self.address) if self.address else None,
                     "device": self.device})

    @classmethod
    def decode(cls, key: str, value: bytes) -> SpecRef:
        d = _fields(key, value, ("content", "address"))
        if not isinstance(d["content"], str) or not _DIGEST.match(d["content"]):
            raise _bad(key, f"names body {d['content']!r}, not a sha256")
        device = d.get("device")
        if device is not None and (not isinstance(device, str) or not _DEVICE.match(device)):
            raise _bad(key, f"names device {device!r}, not a device digest")
        return cls(d["content"], _address(key, d["address"]), device)


@dataclass(frozen=True)
class StepRecord:
    """``step/<n>``: the members of one step, source and target ranks with the incarnation (uid) of each."""

    step: int
    epoch: int
    sources: dict[int, str]
    targets: dict[int, str]

    def encode(self) -> bytes:
        return pack({"epoch": self.epoch, "sources": sorted(self.sources.items()),
                     "targets": sorted(self.targets.items())})

    @classmethod
    def decode(cls, key: str, step: int, value: bytes) -> StepRecord:
        d = _fields(key, value, ("epoch", "sources", "targets"))
        return cls(step, _int(key, "epoch", d["epoch"], 1),
                   *(_rank_map(key, role, d[role], lambda u: _uid(key, u)) for role in ("sources", "targets")))

    def same_members(self, other: StepRecord) -> bool:
        return self.sources == other.sources and self.targets == other.targets

    def holds(self, role: str, rank: int, uid: str) -> bool:
        return (self.sources if role == "source" else self.targets).get(rank) == uid


@dataclass(frozen=True)
class Report:
    """``report/<n>/<role>/<rank>``: whether a rank's part of step ``n`` went through, the version it holds,
    the peers that failed it (rank -> why)."""

    ok: bool
    version: int
    failed: dict[int, str]

    def encode(self) -> bytes:
        return pack({"ok": self.ok, "version": self.version, "failed": sorted(self.failed.items())})

    @classmethod
    def decode(cls, key: str, value: bytes) -> Report:
        d = _fields(key, value, ("ok", "version", "failed"))
        if type(d["ok"]) is not bool:
            raise _bad(key, f"has ok {d['ok']!r}, not a boolean")

        def why(w: Any) -> str:
            if not isinstance(w, str):
                raise _bad(key, f"gives a reason {w!r} that is not text")
            return w[:MAX_TEXT]
        return cls(d["ok"], _int(key, "version", d["version"]), _rank_map(key, "failed", d["failed"], why))


@dataclass(frozen=True)
class Beat:
    """``beat/<role>/<rank>``: a rank busy in a step says it is alive (see :mod:`tensorxfer.sync.clock`)."""

    uid: str
    step: int
    count: int

    def encode(self) -> bytes:
        return pack({"uid": self.uid, "step": self.step, "count": self.count})

    @classmethod
    def decode(cls, key: str, value: bytes) -> Beat:
        d = _fields(key, value, ("uid", "step", "count"))
        return cls(_uid(key, d["uid"]), _int(key, "step", d["step"]), _int(key, "count", d["count"]))


@dataclass(frozen=True)
class Failure:
    """``failed/<role>/<rank>``: a rank's constructor failed (its error's type and message), so that the
    ranks waiting for it to register report that error instead of waiting out their timeout."""

    uid: str
    error: str
    message: str

    def encode(self) -> bytes:
        return pack({"uid": self.uid, "error": self.error, "message": self.message[:MAX_TEXT]})

    @classmethod
    def decode(cls, key: str, value: bytes) -> Failure:
        d = _fields(key, value, ("uid", "error", "message"))
        if not isinstance(d["error"], str) or not isinstance(d["message"], str) or len(d["error"]) > 100 \
                or len(d["message"]) > MAX_TEXT:
            raise _bad(key, "has an error that is not a short type name and a message")
        return cls(_uid(key, d["uid"]), d["error"], d["message"])


@dataclass(frozen=True)
class Amaxes:
    """A source's partial block amaxes of one step (the blocks it shares with other sources): per derived
    scales tensor, the blocks' flat indices in its scale grid and their amaxes over this source's part.
    ``error``/``tensor``: the source could not take them (a NaN in ``tensor``): its peers fail the step
    with the same error at once instead of waiting for amaxes that will not come."""

    parts: dict[str, tuple[bytes, bytes]]       # name -> (int64 LE block indices, float32 LE amaxes)
    error: str | None = None
    tensor: str | None = None

    def encode(self) -> bytes:
        return pack({"parts": {name: list(p) for name, p in self.parts.items()}, "error": self.error,
                     "tensor": self.tensor})

    @classmethod
    def decode(cls, key: str, value: bytes) -> Amaxes:
        obj = _fields(key, value, ("parts", "error", "tensor"))
        parts, error, tensor = obj["parts"], obj["error"], obj["tensor"]
        if not isinstance(parts, dict) or len(parts) > MAX_TENSORS:
            raise _bad(key, "has parts that are not a map of tensor -> [indices, amaxes]")
        for what, text in (("error", error), ("tensor", tensor)):
            if text is not None and (not isinstance(text, str) or len(text) > MAX_TEXT):
                raise _bad(key, f"has an {what} that is not a text of at most {MAX_TEXT} characters")
        out: dict[str, tuple[bytes, bytes]] = {}
        for name, item in parts.items():
            if (not isinstance(name, str) or not isinstance(item, list) or len(item) != 2
                    or not all(isinstance(x, bytes) for x in item) or len(item[0]) % 8
                    or len(item[0]) // 8 != len(item[1]) // 4 or len(item[1]) % 4):
                raise _bad(key, f"has an entry for {name!r} that is not [int64 indices, as many float32 amaxes]")
            out[name] = (item[0], item[1])
        return cls(out, error, tensor)


def decode_digest(key: str, value: bytes) -> str:
    """``digest/<epoch>/<role>/<rank>``: the plan digest a rank computed (hex sha256)."""
    text = value.decode("ascii", "replace")
    if not _DIGEST.match(text):
        raise _bad(key, f"holds {value[:20]!r}, not a plan digest")
    return text


def decode_step(key: str, value: bytes) -> int:
    """``latest``: the newest step decided."""
    text = value.decode("ascii", "replace")
    if not text.isdecimal() or len(text) > 18:
        raise _bad(key, f"holds {value[:20]!r}, not a step number")
    return int(text)


class GroupStore:
    """One group's records in a rendezvous: keys namespaced, values sealed on the way in and opened on the way out.

    ``get`` and ``peek`` raise :class:`~tensorxfer.errors.StoreError` for a record whose seal fails;
    ``peek_valid`` passes such records over (as absent), saying so once per value.
    """

    def __init__(self, rdv: Rendezvous, group: str, token_key: bytes | None) -> None:
        self.rdv, self.group = rdv, group
        self.seal = Seal(token_key)
        self._warned: set[tuple[str, bytes]] = set()

    def key(self, *parts: object) -> str:
        return group_key(self.group, *parts)

    def put(self, key: str, value: bytes) -> None:
        self.rdv.publish(key, self.seal.seal(key, value))

    def put_many(self, items: dict[str, bytes]) -> None:
        self.rdv.publish_many({k: self.seal.seal(k, v) for k, v in items.items()})

    def put_once(self, key: str, value: bytes) -> bytes:
        """Set ``key`` unless it is set; what it holds, opened (raises :class:`StoreError` where the value
        another writer put first is not sealed for it)."""
        return self.seal.open(key, self.rdv.publish_once(key, self.seal.seal(key, value)))

    def has(self, key: str) -> bool:
        return self.rdv.has(key)

    def put_content(self, key: str, value: bytes) -> None:
        """Set a content-addressed value (a description body: its name is the sha256 a sealed record gives,
        which the reader checks), as it is."""
        self.rdv.publish(key, value)

    def get_content(self, keys: Sequence[str], timeout: float) -> list[bytes]:
        return self.rdv.read(keys, timeout)

    def get(self, keys: Sequence[str], timeout: float) -> list[bytes]:
        return [self.seal.open(k, v) for k, v in zip(keys, self.rdv.read(keys, timeout))]

    def peek(self, keys: Sequence[str]) -> list[bytes | None]:
        return [None if v is None else self.seal.open(k, v) for k, v in zip(keys, self.rdv.peek(keys))]

    def peek_valid(self, keys: Sequence[str], decode: Any) -> list[Any]:
        """``decode(key, value)`` of each key now; None where it is not set, not sealed or malformed (said once)."""
        return [None if v is None else self.valid(k, v, decode) for k, v in zip(keys, self.rdv.peek(keys))]

    def valid(self, key: str, data: bytes, decode: Any) -> Any:
        """``decode(key, opened data)``, or None (logged once per value) where the record is not usable."""
        try:
            return decode(key, self.seal.open(key, data))
        except StoreError as e:
            self.warn(key, data, e)
            return None

    def warn(self, key: str, data: bytes, e: Exception) -> None:
        if (key, data) not in self._warned and len(self._warned) < 10_000:
            self._warned.add((key, data))
            log.warning("sync %r: passed over a record: %s", self.group, e)

    def join(self, prefix: str, name: str, value: bytes) -> bytes:
        """Become member ``prefix/name``; the sealed record (what :meth:`evict` compares)."""
        sealed = self.seal.seal(f"{prefix}/{name}", value)
        self.rdv.join(prefix, name, sealed)
        return sealed

    def leave(self, prefix: str, name: str) -> None:
        self.rdv.leave(prefix, name)

    def evict(self, prefix: str, name: str, sealed: bytes) -> bool:
        return self.rdv.evict(prefix, name, sealed)

    def members(self, prefix: str) -> dict[int, tuple[Member, bytes]]:
        """The usable member records under ``prefix``: rank -> (the record, its sealed bytes); records that are
        not (a name that is no rank, a bad seal, a malformed value) are passed over, said once each."""
        out: dict[int, tuple[Member, bytes]] = {}
        for name, data in self.rdv.members(prefix).items():
            key = f"{prefix}/{name}"
            try:
                rank = rank_name(key, name)
            except StoreError as e:
                self.warn(key, data, e)
                continue
            member = self.valid(key, data, Member.decode)
            if member is not None:
                out[rank] = (member, data)
        return out
