"""The rdma test fault's own logic (``rdma_breaks.Fault``), with a stand-in endpoint: pure logic, no verbs.

The real breaks run in ``tests/test_rdma_resume.py`` on Soft-RoCE; this pins the rule a flaky run there broke:
one break per QP per round, so ``times=2`` reaches the resume round.
"""

from __future__ import annotations

from typing import Any

from tensorxfer.transport.rdma_breaks import Fault


class _Endpoint:
    """A receiver endpoint as the fault sees it: landed requests per QP, QPs it broke until renewed."""

    def __init__(self, landed: list[int]) -> None:
        self.landed, self.broken = landed, set[int]()

    def landed_requests(self) -> list[int]:
        return list(self.landed)

    def break_qp(self, index: int) -> None:
        self.broken.add(index)

    def faulted(self, index: int) -> bool:
        return index in self.broken

    def renew(self) -> None:
        self.broken = set()


def test_a_receiver_fault_breaks_a_qp_once_a_round_and_again_in_the_resume_round() -> None:
    f = Fault("receiver", 1, qp=2, times=2)
    ep: Any = _Endpoint([4, 4, 4, 4])      # (stands in for an RdmaReceiverEndpoint)
    f.on_receiver(ep, 64 << 20)        # due: breaks QP 2
    f.on_receiver(ep, 64 << 20)        # polled again before the loop saw the break: not a second break
    assert len(f.fired) == 1 and ep.broken == {2}
    ep.renew()                          # the resume round's new QPs
    f.on_receiver(ep, 64 << 20)
    assert len(f.fired) == 2 and ep.broken == {2}
    ep.renew()
    f.on_receiver(ep, 64 << 20)         # spent
    assert len(f.fired) == 2 and not ep.broken
