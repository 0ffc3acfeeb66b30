"""Sessions that move whole regions, repeatedly: :class:`Sender` and :class:`Receiver`.

A :class:`Sender` opens one control connection to a :class:`Receiver` (hello, mutual HMAC
authentication when a token is set) and keeps it for its lifetime; every :meth:`Sender.send` is one
offer -> accept -> data -> done -> ack exchange (``docs/protocol.md``).  The receiver allocates a region
from the first offer's manifest and lands every later offer with the same layout in that same region,
and both ends keep their transport for the session: it is set up (registered with the NIC, connected,
handles exported) on the first update and reused by every later one -- a training step's update
allocates, registers and connects nothing, and :class:`TransferStats` shows it (``setup``,
``setup_seconds`` vs ``wire_seconds``, the transport's ``counters``).  An offer with a *different*
layout is re-allocated explicitly: the old region is closed (deferred while views of it are alive) and a
new one allocated; the ``accept`` frame and :attr:`Receiver.last_stats` say so.

A receiver serves senders one after another: when a sender closes its session, :meth:`Receiver.receive`
accepts the next.  Connections are authenticated concurrently, each within ``handshake_timeout`` in all
(:class:`~tensorxfer.connections.Gate`): idle or trickling strangers are dropped and counted
(:attr:`Receiver.dropped_connections`), never fatal, and never hold a legitimate sender up.  Everything
is plain blocking code usable from threads; no event loop is needed.

Ownership: the receiver owns the region it returns and reuses it for the next offer; copy what you need
to keep before calling ``receive()`` again.  ``close()`` on either side is idempotent and releases every
socket.

Modules, in the order a reader needs them: :mod:`.control` (timeouts, keep-alive, transport context),
:mod:`.stats` (:class:`TransferStats` and its one builder), :mod:`.hooks` (what the layers above plug
in: forward hooks, a forwarder), :mod:`.offer` (an offer parsed once), :mod:`.targets` (the region slot
and where an update lands: copy or share), :mod:`.server` (one admitted sender, its update sequence),
:mod:`.receiver` and :mod:`.sender`.
"""

from tensorxfer.session.control import DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_STALL_TIMEOUT
from tensorxfer.session.hooks import Forwarder, ForwardHooks, ForwardJob
from tensorxfer.session.receiver import Receiver
from tensorxfer.session.sender import Sender
from tensorxfer.session.server import ServerSession, State
from tensorxfer.session.stats import TransferStats

__all__ = ["DEFAULT_HANDSHAKE_TIMEOUT", "DEFAULT_STALL_TIMEOUT", "ForwardHooks", "ForwardJob",
           "Forwarder", "Receiver", "Sender", "ServerSession", "State", "TransferStats"]
