"""The receiver users get as :class:`tensorxfer.Receiver`: the session's receiver with fan-out plugged in.

It relays (a :class:`~.relay.Relay` as the session's forwarder) and sends on what it holds
(:func:`~.sender.send_on`); the session layer itself knows nothing about chains.
"""

from __future__ import annotations

from tensorxfer import session
from tensorxfer.fanout.relay import Relay
from tensorxfer.fanout.sender import FanoutStats, send_on
from tensorxfer.session.recovery import DEFAULT_POLICY, RecoveryPolicy


class Receiver(session.Receiver):
    """The session's :class:`~tensorxfer.session.Receiver`, able to relay: a fan-out sender may name further
    receivers in its offer, and this one forwards each update to them as it lands.

    Parameters
    ----------
    relay : bool, optional
        Whether to forward to the receivers an authenticated sender names.  Default: only with a token
        (a relay authenticates to the next hop with its own token); ``True`` allows it without one,
        ``False`` refuses always.  A share-mode receiver never relays.
    listen, token, device, max_region_bytes, stall_timeout, handshake_timeout, share, require_verify, recovery
        As for :class:`tensorxfer.session.Receiver`.
    """

    def __init__(self, listen: str | tuple[str, int] = "127.0.0.1:0", token: str | bytes | None = None,
                 device: str = "cpu",
                 max_region_bytes: int | None = None, stall_timeout: float = session.DEFAULT_STALL_TIMEOUT,
                 handshake_timeout: float = session.DEFAULT_HANDSHAKE_TIMEOUT, share: bool = False,
                 relay: bool | None = None, require_verify: bool = False, prefault: bool = True,
                 private_memory: bool = False, recovery: RecoveryPolicy | None = DEFAULT_POLICY) -> None:
        allowed = (relay if relay is not None else token is not None) and not share
        why = "this receiver does not relay " + ("(Receiver(relay=False))" if relay is False else
                                                 "(it has no token; Receiver(relay=True) allows it)")
        forwarder = Relay(token, float(stall_timeout), float(handshake_timeout)) if allowed else None
        super().__init__(listen, token, device, max_region_bytes, stall_timeout, handshake_timeout, share,
                         forwarder=forwarder, no_forward=why, require_verify=require_verify, prefault=prefault,
                         private_memory=private_memory, recovery=recovery)

    def send_on(self, to: str | list[str], verify: bool = False, transport: str = "auto",
                streams: int | None = None) -> FanoutStats:
        """Send the complete update this receiver holds to other receivers (:func:`tensorxfer.fanout.send_on`)."""
        return send_on(self, to, verify=verify, transport=transport, streams=streams)
