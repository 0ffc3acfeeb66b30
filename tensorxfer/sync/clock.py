"""Every wait of a weight sync, derived from one number: the stall timeout ``S``.

A group decides who is in each step from what its ranks say in the store, so every rank must measure the
same things with the same clock; otherwise one rank gives up on a peer that another still waits for (a
source waiting 10 s for a stalled target while the other source dropped it after 5 s, for good).  So:

==============================================  ===============================================================
a pair's peer (accept, data, done, ack)          ``S`` of silence (data: no progress for ``S``); an offer that
                                                 sets the data path up gets at least the control timeout
a target's offers, once it entered its step      ``S`` after it entered it (the sources entered it first)
a member's report of the previous step           while it *beats* (a rank busy in a step says so every
                                                 ``S/4``) and until ``S`` of silence: a rank that was slow,
                                                 not gone, is never passed over
a member a peer named as failed                  ``GRACE`` more, to say otherwise
a source for the lowest source's step record     ``LEADER`` (it then decides itself: first writer wins)
==============================================  ===============================================================

Hence a step with a stalled rank ends for everyone else within about ``S + GRACE`` of the stall, the stalled
rank is left out of the next step, and it comes back by itself (it rejoins) once it runs again.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorxfer.session.control import control_timeout


@dataclass(frozen=True)
class StepClock:
    """The bounds above for a stall timeout of ``stall`` seconds."""

    stall: float

    @property
    def beat(self) -> float:
        """How often a rank busy in a step says it is alive."""
        return self.stall / 4

    @property
    def silence(self) -> float:
        """How long a member may say nothing (no report, no beat) before a step is decided without it."""
        return self.stall

    @property
    def grace(self) -> float:
        """How long a member a peer named as failed may still say otherwise."""
        return min(1.0, self.stall)

    @property
    def leader(self) -> float:
        """How long a source waits for the lowest source's step record before deciding itself."""
        return min(1.0, self.stall)

    def reply(self, setup: bool) -> float:
        """How long a pair waits for its peer's next control frame; a step that sets the data path up
        (registration, allocation) gets at least the session's control timeout."""
        return control_timeout(self.stall) if setup else self.stall
