"""Partial updates through the session API (tensorxfer.session.partial): the receiver holds some ranges, the
sender confirms them, only the rest moves; a peer that lies in its held or skip frame is a protocol error."""

from __future__ import annotations

import numpy as np
import pytest

from tensorxfer import Receiver, Sender, TensorRegion
from tensorxfer.errors import ProtocolError, TensorXferError
from tensorxfer.transport.segments import Segments
from tests.helpers import Background

PIECE = 1 << 20
N = 16              # pieces of one 16 MiB tensor


def runs(pieces: set[int]) -> Segments | None:
    missing = [p for p in range(N) if p not in pieces]
    return Segments.of([p * PIECE for p in missing], [p * PIECE for p in missing], [PIECE] * len(missing))


class Holder:
    """Claims pieces ``held`` (their bytes put into the region as the sender has them)."""

    def __init__(self, held: dict[int, bytes], claim_extra: int = 0) -> None:
        self.held = held
        self.claim_extra = claim_extra
        self.kept: list[int] = []

    def claim(self, region):
        with memoryview(region.region) as mv:
            for p, data in self.held.items():
                mv[p * PIECE:(p + 1) * PIECE] = data
        ids = sorted(self.held) + list(range(N, N + self.claim_extra))
        return ids, [7] * len(ids)

    def keep(self, region, confirmed):
        self.kept = confirmed
        return runs(set(confirmed)) if confirmed else None


class Checker:
    def __init__(self, confirm_also: list[int] | None = None) -> None:
        self.extra = confirm_also or []

    def confirm(self, pieces, sums):
        return [p for p in pieces if p % 2 == 0] + self.extra      # even pieces "match" here

    def missing(self, confirmed):
        return runs(set(confirmed))


def source() -> TensorRegion:
    data = np.random.default_rng(1).integers(0, 256, N * PIECE, dtype=np.uint8)
    return TensorRegion.from_tensors({"w": data})


def test_only_unconfirmed_pieces_move_and_the_region_is_whole():
    with source() as src, Receiver() as rx:
        with memoryview(src.region) as mv:
            held = {p: bytes(mv[p * PIECE:(p + 1) * PIECE]) for p in range(6)}
        holder = Holder(held)
        job = Background(rx.receive, timeout=30, held=holder)
        with Sender(rx.address, transport="tcp") as s:
            stats = s.send(src, verify=True, pieces=Checker())
        region = job.result()
        assert holder.kept == [0, 2, 4]
        assert stats.kept_bytes == 3 * PIECE and stats.bytes == (N - 3) * PIECE
        assert rx.last_stats is not None and rx.last_stats.kept_bytes == 3 * PIECE
        with memoryview(src.region) as a, memoryview(region.region) as b:
            assert bytes(a[:src.nbytes]) == bytes(b[:src.nbytes])


def test_a_held_frame_larger_than_the_region_allows_is_refused():
    with source() as src, Receiver() as rx:
        job = Background(rx.receive, timeout=30, held=Holder({}, claim_extra=(N * PIECE >> 16) + 8))
        with Sender(rx.address, transport="tcp") as s, pytest.raises(ProtocolError, match="at most"):
            s.send(src, pieces=Checker())
        with pytest.raises(TensorXferError):
            job.result()


def test_a_sender_confirming_a_piece_not_held_is_refused():
    with source() as src, Receiver() as rx:
        job = Background(rx.receive, timeout=30, held=Holder({1: bytes(PIECE)}))
        with Sender(rx.address, transport="tcp") as s, pytest.raises(TensorXferError):
            s.send(src, pieces=Checker(confirm_also=[5]))
        with pytest.raises(ProtocolError, match="does not hold"):
            job.result()
