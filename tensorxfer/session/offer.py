"""An ``offer`` frame, parsed and checked once, before anything is allocated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tensorxfer.errors import ProtocolError
from tensorxfer.manifest import Manifest
from tensorxfer.protocol import Version, field, manifest_digest, parse_chain
from tensorxfer.transport import TRANSPORTS
from tensorxfer.transport.base import MAX_STREAMS


class ManifestCache:
    """The last offered manifest, unpacked and validated, with its digest.

    An update with the same bytes as the last reuses both (the manifest is immutable): checking an
    820-tensor layout and packing it again to hash it on every warm update would cost more than a small
    update's data.
    """

    def __init__(self) -> None:
        self._last: tuple[int, bytes, Manifest, bytes] | None = None    # (limit, packed, parsed, digest)

    def unpack(self, packed: bytes, max_region_bytes: int) -> tuple[Manifest, bytes]:
        """The manifest and its digest.

        Raises
        ------
        ManifestError
            Malformed, or over ``max_region_bytes``.
        """
        last = self._last
        if last is not None and last[0] == max_region_bytes and last[1] == packed:
            return last[2], last[3]
        manifest = Manifest.unpack(packed, max_region_bytes=max_region_bytes)
        digest = manifest_digest(manifest)
        self._last = (max_region_bytes, packed, manifest, digest)
        return manifest, digest


@dataclass(frozen=True)
class Offer:
    """What a sender offers for one update (``docs/protocol.md``, "offer")."""

    seq: int
    transport: str
    streams: int | None
    verify: bool
    fresh: bool                 # the sender asks for a new setup of the data path
    manifest: Manifest
    version: Version | None     # the origin's update and the manifest's digest
    chain: list[str]            # receivers to forward to (fan-out); empty for a plain update
    chain_transport: str        # how the next hops choose their transport
    relayed: bool               # sent by a relay: a repaired chain may send this update again
    resume: bool = False        # the sender follows resume frames if data streams break (session.recovery)
    partial: bool = False       # the sender confirms pieces the receiver holds (session.partial)

    @property
    def nbytes(self) -> int:
        return self.manifest.nbytes

    @classmethod
    def parse(cls, frame: dict[str, Any], manifests: ManifestCache, max_region_bytes: int) -> Offer:
        """The offer in ``frame``, checked.

        Raises
        ------
        ProtocolError
            A field is missing, of another type or out of range; the version's digest is not the
            manifest's; a chain without a version.
        ManifestError
            The manifest is malformed or over ``max_region_bytes``.
        """
        seq = field(frame, "seq", int)
        transport = field(frame, "transport", str)
        streams = field(frame, "streams", int, optional=True)
        verify = field(frame, "verify", bool)
        if streams is not None and not 1 <= streams <= MAX_STREAMS:
            raise ProtocolError(f"offer: streams must be between 1 and {MAX_STREAMS}, got {streams}")
        manifest, digest = manifests.unpack(field(frame, "manifest", bytes), max_region_bytes)
        raw = frame.get("version")
        version = None if raw is None else Version.from_wire(raw)
        if version is not None and version.digest != digest:
            raise ProtocolError("offer: the version's digest is not the digest of the offered manifest")
        chain = parse_chain(frame.get("chain", []))
        if chain and version is None:
            raise ProtocolError("offer: a chain needs a version")
        fresh = field(frame, "fresh", bool)     # after the manifest: a refusal of the layout comes first
        return cls(seq, transport, streams, verify, fresh, manifest, version, chain,
                   _chain_transport(frame, transport) if chain else transport, frame.get("relayed") is True,
                   frame.get("resume") is True, frame.get("partial") is True and not chain)


def _chain_transport(frame: dict[str, Any], used: str) -> str:
    """How a relay picks the transport to the next hop: as the origin asked (``auto``: each hop chooses what
    it and its next hop share, e.g. ipc on one host and tcp to another), not what the hop before it used.
    An offer without the field (older senders) keeps the old behaviour: the hop's own transport."""
    wanted = field(frame, "chain_transport", str, optional=True)
    if wanted is None:
        return used
    if wanted != "auto" and wanted not in TRANSPORTS:
        raise ProtocolError(f"offer: chain_transport must be 'auto' or one of {sorted(TRANSPORTS)}, got {wanted!r}")
    return wanted
