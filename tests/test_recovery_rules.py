"""The small rules of recovery within an update: what a resumed stream still moves, what a given-up update
raises, and which resume frames a sender refuses (a receiver's frames are the peer's input)."""

from __future__ import annotations

import pytest

import tensorxfer as tx
from tensorxfer.errors import LinkDropped
from tensorxfer.session.recovery import RecoveryPolicy, Resumer
from tensorxfer.transport.base import TransferContext
from tensorxfer.transport.tcp import TcpSender
from tensorxfer.transport.tcp_streams import skip_bytes
from tests.helpers import region_of


@pytest.mark.parametrize("extents, start, rest", [
    ([(0, 10)], 0, [(0, 10)]),
    ([(0, 10)], 4, [(4, 6)]),
    ([(0, 10)], 10, []),
    ([(100, 5), (0, 5), (50, 10)], 5, [(0, 5), (50, 10)]),
    ([(100, 5), (0, 5), (50, 10)], 7, [(2, 3), (50, 10)]),
    ([(100, 5), (0, 5), (50, 10)], 19, [(59, 1)]),
])
def test_a_resumed_stream_moves_its_extents_without_the_landed_bytes(extents, start, rest) -> None:
    assert skip_bytes(extents, start) == rest


def test_a_given_up_update_raises_its_first_broken_streams_own_error() -> None:
    dropped = LinkDropped({2: tx.TransferTimeout("stream 2 stalled"), 1: tx.PeerLost("stream 1 reset")},
                          {1: 10, 2: 20}, 100)
    failure = dropped.give_up("2 reconnect attempt(s) spent")
    assert type(failure) is tx.PeerLost and str(failure) == "stream 1 reset; not resumed: 2 reconnect attempt(s) spent"
    assert failure.__cause__ is dropped.cause and isinstance(dropped, tx.TransferError)


@pytest.mark.parametrize("attempts, deadline", [(0, 10.0), (1, 0.0), (-1, 1.0)])
def test_a_policy_that_allows_nothing_is_refused(attempts: int, deadline: float) -> None:
    with pytest.raises(ValueError, match="attempts >= 1 and deadline > 0"):
        RecoveryPolicy(attempts, deadline)


def _resumer(policy: RecoveryPolicy | None) -> tuple[Resumer, TcpSender]:
    sender = TcpSender(TransferContext("127.0.0.1", "127.0.0.1", b"k" * 32, 1.0))
    return Resumer(sender, region_of(1 << 20), 3, policy, None), sender


@pytest.mark.parametrize("frame, policy, match", [
    ({"type": "resume", "seq": 3, "attempt": 1, "descriptors": {}}, None, "did not offer as resumable"),
    ({"type": "resume", "seq": 2, "attempt": 1, "descriptors": {}}, RecoveryPolicy(), "for update 2"),
    ({"type": "resume", "seq": 3, "attempt": 2, "descriptors": {}}, RecoveryPolicy(), "attempt 2"),
    ({"type": "resume", "seq": 3, "attempt": 2, "descriptors": {}}, RecoveryPolicy(attempts=1), "attempt 2"),
    ({"type": "resume", "seq": 3, "attempt": 1, "descriptors": {}}, RecoveryPolicy(),
     "resume\\(\\) for a region this sender is not sending"),
])
def test_a_sender_refuses_resume_frames_it_did_not_ask_for(frame, policy, match) -> None:
    resumer, sender = _resumer(policy)
    with resumer.region, sender:
        with pytest.raises(tx.ProtocolError, match=match):
            resumer.follow(frame)
        assert sender.landing is None       # never left set


def test_a_sender_whose_policy_is_spent_refuses_one_more_round() -> None:
    resumer, sender = _resumer(RecoveryPolicy(attempts=1))
    with resumer.region, sender:
        resumer.recovery.retries = 1
        with pytest.raises(tx.ProtocolError, match="allows 1"):
            resumer.follow({"type": "resume", "seq": 3, "attempt": 2, "descriptors": {}})
