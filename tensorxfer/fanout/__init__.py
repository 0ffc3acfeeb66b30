"""Fan-out: one update to N receivers by chain pipelining.

:class:`FanoutSender` sends a region to a list of receivers ``[R1, ..., RN]``
by sending it to ``R1`` only, and telling ``R1`` (in the authenticated
``offer``) the rest of the chain.  ``R1`` opens its own session to ``R2``
(a plain :class:`~tensorxfer.session.Sender`, kept for as long as the chain
keeps that hop: connected and set up once) and *forwards bytes as they
land*: over tcp the receiving stream threads report every range that landed
(the receiving transport's ``on_piece`` hook) and the forwarding stream threads
wait for each piece before sending it (the sending transport's ``landing``:
:meth:`Landed.wait_range`), so ``R1`` sends piece
k-1 to ``R2`` while piece k arrives from the sender.  Over ipc the receiver
pulls: ``R1``'s copy reports each piece once its bytes are in the region
(``on_piece``; device pieces once the stream finished them), and ``R1``'s
sender raises ``R2``'s *watermark* as the contiguous landed prefix grows
(``landing``: :meth:`Landed.wait_prefix`),
so ``R2`` copies piece k-1 from ``R1`` while ``R1`` copies piece k.  Over
rdma one-sided writes tell ``R1`` nothing until the last immediate per QP,
so ``R1``'s receiver asks its sender for *piece marks* (an immediate every
few requests per QP: ``RdmaReceiver.on_piece`` reports the contiguous
prefix they prove), and ``R1``'s sender posts no request past that prefix
(``landing``: :meth:`Landed.wait_prefix`, feeding the nogil write loop's
gate).  The hooks are declared in :mod:`tensorxfer.transport.base` and the
session's :class:`~tensorxfer.session.ForwardHooks` /
:class:`~tensorxfer.session.Forwarder`; this package fills them.  The total time is about one transfer plus (N-1)
pieces (:attr:`FanoutStats.piece_bytes`: ``tcp.FORWARD_PIECE_BYTES`` per
stream, ``ipc.RELAY_PIECE_BYTES`` / ``RELAY_CUDA_PIECE_BYTES``,
``rdma_engine.RELAY_PIECE_BYTES`` rounded to whole requests per QP), not N
transfers.  tcp for GPU regions forwards once the whole update landed
(store and forward: correct, not pipelined).

Trust: a receiver forwards only to the addresses the *authenticated* sender
named in its offer, with the token it was itself authenticated with, so the
next hop must share the token; a receiver without a token refuses to relay
unless built with ``Receiver(relay=True)``, and ``relay=False`` refuses
always.  A chain holds at most :data:`MAX_CHAIN` addresses, no duplicates.

Versions: every offer carries its :class:`Version` (the origin's update
number and the SHA-256 of the packed manifest); the receiver checks the
digest against the manifest it unpacked, clears :attr:`Receiver.version`
while a region is being written, and sets it only once every byte landed
(and verified, with ``verify``).  A relay sends ``done`` downstream (and so
lets the next hop acknowledge) only once every byte of its own copy landed
and its upstream said ``done``; with ``verify`` the ``done`` carries the
*origin's* checksums, so every hop checks its own copy against the source
(in parallel, not one hop after another).  A relay whose upstream fails
aborts its forward, so the next hop never acknowledges a half-written
version.

Failures: when a hop fails (killed: ``PeerLost``; stalled for
``stall_timeout``: ``TransferTimeout``; refused), the hop *before* it takes
it out of the chain and sends to the next address instead, with the rest of
the chain (pipelined from what has landed when it is a relay, whole when it
is the origin).  The failed receiver is named in the result with its error
type and message; the others complete.  A receiver downstream of the failed
one sees its own session end (its ``receive()`` raises) and receives the
update again over the repaired chain on its next ``receive()``.  The
:class:`FanoutSender` leaves failed receivers out of later updates
(:attr:`FanoutSender.chain`).

Slow receivers: the hop feeding a receiver measures, on its own clock, how
long after its own copy was complete that receiver's last byte went out or
landed (``ReceiverResult.lag_seconds``; the origin's copy is complete from
the start).  A receiver whose lag stands out while the ones after it follow
it closely is the one holding the chain back (:func:`slowest_hop`).
:class:`FanoutSender` names it (:attr:`FanoutStats.slow`, logged) and, once
it held the chain back :data:`SLOW_STRIKES` updates in a row, moves it to
the tail, where it delays no one else's bytes.  A relay's ``receive()``
returns as soon as its own copy is complete and checked; its ack, which
carries the results of the hops after it, goes out once they finished
(:meth:`~tensorxfer.session.Receiver.wait_relayed`).

Modules: :mod:`.chain` (sessions to the next hop, landed ranges, results),
:mod:`.relay` (a receiver's forwarding), :mod:`.sender` (the origin,
:func:`send_on`), :mod:`.receiver` (the relaying :class:`Receiver`).

Results: every hop's ``ack`` carries the results of the hops after it, so
:class:`FanoutStats` has one :class:`ReceiverResult` per receiver (bytes,
seconds, transport, verified, which hop fed it, or the error).
"""

from tensorxfer.fanout.chain import ORIGIN, Chain, Landed, ReceiverResult, chain_allowance
from tensorxfer.fanout.receiver import Receiver
from tensorxfer.fanout.relay import Relay, RelayJob
from tensorxfer.fanout.sender import (
    SLOW_LAG,
    SLOW_MIN_LAG,
    SLOW_STRIKES,
    FanoutSender,
    FanoutStats,
    send_on,
    slowest_hop,
)
from tensorxfer.protocol import MAX_CHAIN, Version, manifest_digest, packed_digest, parse_chain

__all__ = ["MAX_CHAIN", "ORIGIN", "SLOW_LAG", "SLOW_MIN_LAG", "SLOW_STRIKES", "Chain", "FanoutSender", "FanoutStats",
           "Landed", "Receiver", "ReceiverResult", "Relay", "RelayJob", "Version", "chain_allowance",
           "manifest_digest", "packed_digest", "parse_chain", "send_on", "slowest_hop"]
