"""Partial updates: the receiver already holds some pieces of the offered region (a resumed
``tensorxfer-recv``), the sender confirms them, and only the rest moves.

An offer with ``partial: true`` says the sender can check pieces.  Before its accept the receiver sends
``held{seq, pieces, sums}`` -- the piece ids it holds (``<u4`` bytes) and their checksums (``<u8`` bytes);
what a piece is, is the caller's (``tensorxfer.files.pieces``: 2 MiB of a file's tensor data) -- and the
sender answers ``skip{seq, pieces, bytes, runs}``: the held pieces whose checksums match its own bytes
(the others are sent again), and the byte count and digest of the segments that then move, which the
receiver must have computed alike.  Both ends turn the confirmed pieces into the same
:class:`~tensorxfer.transport.segments.Segments` (the caller's hooks), the transport moves only those, and
the done frame's byte count is theirs.  A held piece is never trusted on the receiver's word: the sender
keeps it only when its checksum matches the sender's own bytes now.

The hooks are the callers': a receiver passes a :class:`Holder` (``claim`` what it holds, ``keep`` what
was confirmed, returning what must move), a sender a :class:`Checker` (``confirm`` held pieces against
its bytes, ``missing`` turning confirmed pieces into what must move).  A receiver without a holder
answers a partial offer with an empty ``held``: everything moves, as without this.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from tensorxfer.errors import ProtocolError
from tensorxfer.protocol import Channel, field
from tensorxfer.session import control

if TYPE_CHECKING:
    from tensorxfer.region import TensorRegion
    from tensorxfer.transport.segments import Segments

#: A held frame may name at most one piece per this many bytes of the region (pieces are larger): a peer
#: cannot make the other end build more numbers than the region justifies.
MIN_PIECE_BYTES = 64 << 10
#: Transports a sender offers partial updates over.  rdma takes segments too (weight syncs), but a partial
#: update over it has not run yet (only Soft-RoCE in a VM here): over rdma the whole region moves.
PARTIAL_TRANSPORTS = ("tcp", "ipc")
#: Slowest rate at which a live peer is assumed to hash pieces it reads back from disk.
CHECK_FLOOR_BYTES_PER_S = 50e6


class Holder(Protocol):
    """A receiver's pieces (see the module)."""

    def claim(self, region: TensorRegion) -> tuple[list[int], list[int]]:
        """The pieces this receiver holds for the offered region, and their checksums; the held bytes are
        put into ``region`` (only a partial offer asks)."""
        ...

    def keep(self, region: TensorRegion, confirmed: list[int]) -> Segments | None:
        """The sender confirmed ``confirmed`` (a subset of the claim; empty for an offer that was not
        partial): keep them, and return what must move (None: the whole region)."""
        ...


class Checker(Protocol):
    """A sender's check of held pieces (see the module)."""

    def confirm(self, pieces: list[int], sums: list[int]) -> list[int]:
        """The held ``pieces`` whose checksum is this sender's (raises ProtocolError for a piece that does
        not exist)."""
        ...

    def missing(self, confirmed: list[int]) -> Segments | None:
        """What moves when the receiver keeps ``confirmed`` (None: the whole region)."""
        ...


def _ids(frame: dict[str, object], name: str, dtype: str, most: int) -> list[int]:
    raw = field(frame, name, bytes)
    size = np.dtype(dtype).itemsize
    if len(raw) % size or len(raw) // size > most:
        raise ProtocolError(f"{frame.get('type')} frame: {name} must be {size}-byte values, at most {most}")
    return np.frombuffer(raw, dtype).tolist()


def receiver_settle(ch: Channel, seq: int, partial: bool, holder: Holder | None, region: TensorRegion | None,
                    stall_timeout: float) -> tuple[Segments | None, int]:
    """The receiver's side, before its accept: claim, learn what the sender confirmed, keep it.  Returns the
    segments to move (None: the whole region) and the bytes kept.

    Raises
    ------
    ProtocolError
        The sender confirmed a piece that was not held, or moves other segments than this receiver would.
    """
    if not partial:
        segments = holder.keep(region, []) if holder is not None and region is not None else None
        return segments, 0
    claimed: tuple[list[int], list[int]] = ([], [])
    if holder is not None and region is not None and not region.is_cuda:
        claimed = holder.claim(region)
    ids = np.asarray(claimed[0], dtype="<u4")
    ch.send("held", seq=seq, pieces=ids.tobytes(), sums=np.asarray(claimed[1], dtype="<u8").tobytes())
    # the sender reads and hashes every held piece of its source before it answers
    held_bytes = region.nbytes if region is not None and len(ids) else 0
    skip = ch.recv("skip", timeout=control.control_timeout(stall_timeout) + held_bytes / CHECK_FLOOR_BYTES_PER_S)
    confirmed = _ids(skip, "pieces", "<u4", len(ids))
    if field(skip, "seq", int) != seq:
        raise ProtocolError(f"skip frame for update {skip.get('seq')}; this is update {seq}")
    if len(set(confirmed)) != len(confirmed) or not set(confirmed) <= set(claimed[0]):
        raise ProtocolError("skip frame: the sender confirmed pieces this receiver does not hold")
    segments = holder.keep(region, confirmed) if holder is not None and region is not None else None
    if not confirmed:
        segments = None     # nothing kept: the whole region moves, as the sender does then
    moved = segments.total_bytes if segments is not None else None
    runs = segments.digest if segments is not None else ""
    if field(skip, "bytes", int, optional=True) != moved or field(skip, "runs", str) != runs:
        raise ProtocolError(f"skip frame: the sender moves {skip.get('bytes')} bytes in runs "
                            f"{str(skip.get('runs'))[:16]}; this receiver expects {moved} in {runs[:16]} "
                            f"(the two ends cut the pieces differently)")
    kept = max(0, _tensor_bytes(region) - moved) if region is not None and moved is not None else 0
    return segments, kept


def _tensor_bytes(region: TensorRegion) -> int:
    """The bytes of the region's tensors (not the padding between them): what kept bytes are counted of."""
    return int(region.manifest.sizes.sum())


def sender_settle(ch: Channel, seq: int, checker: Checker, region: TensorRegion, stall_timeout: float
                  ) -> tuple[Segments | None, int]:
    """The sender's side, after a partial offer: confirm what the receiver holds, say so.  Returns the
    segments to move (None: the whole region) and the tensor bytes the receiver keeps.

    Raises
    ------
    ProtocolError
        A malformed held frame, or one naming pieces that do not exist.
    """
    # the receiver reads back and hashes what it holds before it answers
    held = ch.recv("held", timeout=control.control_timeout(stall_timeout) + region.nbytes / CHECK_FLOOR_BYTES_PER_S)
    if field(held, "seq", int) != seq:
        raise ProtocolError(f"held frame for update {held.get('seq')}; this is update {seq}")
    most = region.nbytes // MIN_PIECE_BYTES + 1
    pieces, sums = _ids(held, "pieces", "<u4", most), _ids(held, "sums", "<u8", most)
    if len(pieces) != len(sums) or len(set(pieces)) != len(pieces):
        raise ProtocolError("held frame: pieces and checksums differ in number, or a piece appears twice")
    confirmed = checker.confirm(pieces, sums) if pieces else []
    segments = checker.missing(confirmed) if confirmed else None
    ch.send("skip", seq=seq, pieces=np.asarray(confirmed, dtype="<u4").tobytes(),
            bytes=segments.total_bytes if segments is not None else None,
            runs=segments.digest if segments is not None else "")
    return segments, (max(0, _tensor_bytes(region) - segments.total_bytes) if segments is not None else 0)


__all__ = ["PARTIAL_TRANSPORTS", "Checker", "Holder", "receiver_settle", "sender_settle"]
