"""Recovery within one update: broken data streams reconnected, and only what did not land sent again.

A transport that can (``can_resume``: tcp, rdma) is told per update that it may resume (its ``resumable``
hook, set on a receiver before ``prepare``); a stream that then loses its connection -- reset, closed, or no
progress for ``stall_timeout`` -- breaks, and the transport raises :class:`~tensorxfer.errors.LinkDropped`
naming the broken streams and how many bytes of each stream's share had landed.  tcp: a stream is a
connection, it breaks alone and the others finish.  rdma: a stream is a QP; a resumable update carries a mark
on every request, so the receiver knows per QP which requests landed, and a QP that breaks (a completion
error, the error state, no mark for ``stall_timeout``) stops them all: the end that saw it tells the other on
the side connection, the receiver counts what landed, and the resume round connects new QPs under the same
memory registration and writes each QP's share from the request where it stopped.

The receiver decides (it alone knows what landed): :func:`receive` opens a listener for replacement
streams and sends a ``resume`` frame (update number, attempt, the transport's descriptors: where to
connect, and per broken stream where it resumes: a byte over tcp, a request per QP over rdma); the sender
(:class:`Resumer`, inside its wait for the ack) reconnects exactly those streams and sends each share from
there.  That repeats, bounded
by :class:`RecoveryPolicy` (reconnect rounds and a deadline from the first break); the update then
completes as the same version, with the same checks (the done frame's byte count, checksums when
verified).  When recovery is off, spent, past its deadline, or the peer's control connection is gone,
the first broken stream's own error (:class:`~tensorxfer.errors.PeerLost` or
:class:`~tensorxfer.errors.TransferTimeout`) is raised, saying why it was not resumed: the rules of a
failed update hold (nothing partial is reported, the session ends, the receiver serves the next sender).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tensorxfer.errors import LinkDropped, ProtocolError, TensorXferError, TransferError
from tensorxfer.protocol import Channel, field
from tensorxfer.session import control

if TYPE_CHECKING:
    from tensorxfer.region import TensorRegion
    from tensorxfer.transport.base import Landing, Progress, ReceiverTransport, SenderTransport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveryPolicy:
    """How hard one update tries to recover from broken data streams.

    ``attempts``: reconnect rounds per update (a round replaces every stream broken so far);
    ``deadline``: seconds from the first break after which no new round starts.
    """

    attempts: int = 3
    deadline: float = 60.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or not self.deadline > 0:
            raise ValueError(f"RecoveryPolicy needs attempts >= 1 and deadline > 0, got {self.attempts}, "
                             f"{self.deadline}")


DEFAULT_POLICY = RecoveryPolicy()


@dataclass
class Recovery:
    """What recovery did in one update: ``retries`` (reconnect rounds), ``resent_bytes`` (the sender's count
    of bytes it sent twice: handed to the kernel before the break, not landed; 0 on a receiver, which never
    takes a landed byte again), ``seconds`` (from the start of the first round -- every stream that did not
    break has finished -- to the last byte of the last round: what recovering added to the update)."""

    retries: int = 0
    resent_bytes: int = 0
    seconds: float = 0.0


def receive(transport: ReceiverTransport, ch: Channel, seq: int, policy: RecoveryPolicy | None,
            progress: Progress | None) -> tuple[int, Recovery]:
    """``transport.wait()``, recovering broken streams (see the module); return the bytes and what recovery did.

    Raises
    ------
    PeerLost, TransferTimeout
        A stream broke and the update could not be resumed (the message says why).
    """
    rec = Recovery()
    try:
        return transport.wait(progress), rec
    except LinkDropped as e:
        dropped = e
    began = time.monotonic()
    while True:
        why = _why_not(policy, rec.retries, began, ch)
        if why is not None:
            failure = dropped.give_up(why)
            ch.send_error("transfer", str(failure))
            raise failure
        rec.retries += 1
        # str(): a log record keeps its args, and the error's traceback would keep this update's frames alive
        log.warning("update %d: %s; resuming (attempt %d): %s", seq, str(dropped), rec.retries,
                    ", ".join(f"stream {i} from byte {n}" for i, n in sorted(dropped.landed.items())))
        descriptors = transport.prepare_resume(dropped)
        try:
            ch.send("resume", seq=seq, attempt=rec.retries, descriptors=descriptors)
            transport.wait_resume(progress)
            break
        except LinkDropped as again:
            dropped = again
        except ProtocolError:
            raise
        except TransferError as e:      # the sender did not reconnect (gone, or not in time)
            failure = dropped.give_up(f"the sender did not reconnect ({e})")
            ch.send_error("transfer", str(failure))
            raise failure from None
    rec.seconds = time.monotonic() - began
    log.warning("update %d: resumed after %d attempt(s) in %.2f s", seq, rec.retries, rec.seconds)
    return dropped.nbytes, rec


def _why_not(policy: RecoveryPolicy | None, retries: int, began: float, ch: Channel) -> str | None:
    if policy is None:
        return "recovery is off on this receiver"
    if retries >= policy.attempts:
        return f"{policy.attempts} reconnect attempt(s) spent"
    if time.monotonic() - began > policy.deadline:
        return f"past the recovery deadline of {policy.deadline:g} s"
    if control.control_lost(ch):
        return "the sender closed its control connection"
    return None


class Resumer:
    """The sender's side of recovery in one update: keeps the break, follows the receiver's ``resume`` frames.

    ``policy`` bounds what this sender follows (a receiver asking more often or later is refused).  ``landing``:
    the region is still landing (a relay's copy, files still being read): a resumed stream, like the first
    pass, sends only what landed.
    """

    def __init__(self, transport: SenderTransport, region: TensorRegion, seq: int, policy: RecoveryPolicy | None,
                 progress: Progress | None, landing: Landing | None = None) -> None:
        self.transport, self.region, self.seq, self.policy, self.progress = transport, region, seq, policy, progress
        self.landing = landing
        self.enabled = policy is not None and transport.can_resume
        self.dropped: LinkDropped | None = None
        self.recovery = Recovery()
        self._began = 0.0

    def broke(self, dropped: LinkDropped) -> int:
        """The payload send broke some streams: keep it (the done frame goes out; the receiver asks for the rest);
        return the update's byte count."""
        self.dropped = dropped
        log.warning("update %d: %s; waiting for the receiver to ask for the rest", self.seq, str(dropped))
        return dropped.nbytes

    def wait_limit(self, limit: float, stall_timeout: float) -> float:
        """How long the next control wait may take: while streams are broken, only as long as a live receiver
        takes to notice (its stall timeout, about ours) and ask to resume."""
        return min(limit, 2 * stall_timeout + 1.0) if self.dropped is not None else limit

    def failed(self, error: BaseException) -> BaseException:
        """What to raise when the control wait failed with ``error``: while streams are broken, their own error."""
        if self.dropped is None or not isinstance(error, TensorXferError):
            return error
        return self.dropped.give_up(f"the receiver did not resume the update ({error})")

    def follow(self, frame: dict[str, Any]) -> None:
        """Act on a ``resume`` frame: reconnect the streams it names and send their shares from where they landed.

        Raises
        ------
        ProtocolError
            For another update, or more attempts (or later) than this sender's policy allows.
        """
        if not self.enabled or self.policy is None:
            raise ProtocolError("the receiver asked to resume an update this sender did not offer as resumable")
        attempt = field(frame, "attempt", int)
        if field(frame, "seq", int) != self.seq or attempt != self.recovery.retries + 1:
            raise ProtocolError(f"resume frame for update {frame.get('seq')} attempt {attempt}; this is update "
                                f"{self.seq}, attempt {self.recovery.retries + 1}")
        if attempt > self.policy.attempts:
            raise ProtocolError(f"the receiver asked for resume attempt {attempt}; this sender allows "
                                f"{self.policy.attempts}")
        if not self._began:
            self._began = time.monotonic()      # recovery is timed from the first resume frame, as on the receiver
        self.recovery.retries = attempt
        self.transport.landing = self.landing
        try:
            _, again = self.transport.resume(self.region, field(frame, "descriptors", dict), self.progress)
            self.recovery.resent_bytes += again
            self.dropped = None
        except LinkDropped as e:        # broke again: the receiver asks for the rest once more
            self.dropped = e
            self.recovery.resent_bytes += e.resent
        finally:
            self.transport.landing = None
        self.recovery.seconds = time.monotonic() - self._began


__all__ = ["DEFAULT_POLICY", "Recovery", "RecoveryPolicy", "Resumer", "receive"]
