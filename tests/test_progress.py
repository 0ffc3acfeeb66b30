"""The CLI's progress display: one line per phase, the data phase's own rate, never still while waiting."""

from __future__ import annotations

import io
import logging
import re
import threading
import time

from tensorxfer.cli.progress import LogAboveBar, Phase, Progress


class Terminal(io.StringIO):
    """What the display draws on, read back as a person would see it."""

    def isatty(self) -> bool:
        return True

    def screen(self) -> list[str]:
        """The lines as they stand on screen: each carriage return redraws its line."""
        text = self.getvalue().replace("\x1b[K", "")
        return [line.rsplit("\r", 1)[-1] for line in text.split("\n")]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def transfer_bar(term: Terminal, clock: Clock) -> Progress:
    bar = Progress("send", True, stream=term, clock=clock, tick=None)
    bar.plan([Phase("setting up"), Phase("moving data", 2_000_000_000, "Gbps"), Phase("receiver writing the files")])
    return bar


def test_the_data_rate_counts_only_the_data_phase():
    """5 s of setup, then 2 GB: the first 0.25 GB reported at 5 s, the rest by 6.75 s: 1.75 GB in 1.75 s is
    8 Gbps; counted from the start (2 GB in 6.75 s) it would read 2.4 Gbps, as the old bar showed."""
    term, clock = Terminal(), Clock()
    bar = transfer_bar(term, clock)
    clock.now = 5.0
    bar(250_000_000)
    clock.now = 6.0
    bar(1_000_000_000)
    assert re.search(r"moving data +\[#+ *\] +62\.5% 1\.25/2\.00 GB 8\.0 Gbps$", term.screen()[-1]), term.screen()
    clock.now = 6.75
    bar(750_000_000)
    bar.finish()
    screen = term.screen()
    assert re.search(r"^send: setting up +done in 5\.00 s$", screen[0]), screen
    assert re.search(r"^send: moving data +\[#{24}\] 100\.0% 2\.00 GB at 8\.0 Gbps$", screen[1]), screen
    assert "2.4 Gbps" not in term.getvalue()


def test_waiting_after_the_last_byte_is_a_phase_of_its_own_that_ticks():
    """The old bar sat at 100 % for the seconds the receiver wrote and fsynced the files, saying nothing."""
    term, clock = Terminal(), Clock()
    bar = transfer_bar(term, clock)
    clock.now = 1.0
    bar(2_000_000_000)                      # everything in one report: the waiting phase begins at once
    clock.now = 3.5
    bar.refresh()                           # the ticker thread's call
    assert re.search(r"^send: receiver writing the files +. 2\.5 s$", term.screen()[-1]), term.screen()
    clock.now = 9.0
    bar.refresh()
    assert term.screen()[-1].endswith(" 8.0 s")
    bar.finish()
    assert re.search(r"^send: receiver writing the files +done in 8\.00 s$", term.screen()[-2]), term.screen()
    assert term.screen()[-1] == ""


def test_a_failed_transfer_says_where_it_stopped():
    term, clock = Terminal(), Clock()
    bar = transfer_bar(term, clock)
    clock.now = 2.0
    bar(100)
    clock.now = 4.0
    bar.finish(ok=False)
    assert re.search(r"^send: moving data +\[ *\] +0\.0% stopped after 2\.00 s$", term.screen()[-2]), term.screen()


def test_nothing_is_drawn_off_a_terminal():
    out, clock = io.StringIO(), Clock()
    bar = Progress("send", True, stream=out, clock=clock)
    bar.plan([Phase("setting up"), Phase("moving data", 10, "Gbps")])
    bar(10)
    bar.finish()
    assert out.getvalue() == "" and bar._ticker is None


def test_log_records_print_above_the_bar_not_into_it():
    term, clock = Terminal(), Clock()
    bar = Progress("recv", True, stream=term, clock=clock, tick=None)
    log = logging.getLogger("tensorxfer.test_progress")
    handler = LogAboveBar(bar)
    handler.setFormatter(logging.Formatter("recv: %(message)s"))
    log.addHandler(handler)
    try:
        bar.phase("setting up")
        clock.now = 1.0
        log.warning("session with sender 127.0.0.1:5000")
    finally:
        log.removeHandler(handler)
    screen = term.screen()
    assert screen[-2] == "recv: session with sender 127.0.0.1:5000", screen     # a clean line of its own
    assert re.search(r"^recv: setting up +. 1\.0 s$", screen[-1]), screen       # the bar, drawn again below


def test_the_ticker_redraws_while_waiting_and_stops_with_the_transfer():
    term = Terminal()
    bar = Progress("recv", True, stream=term, tick=0.01)
    for _ in range(2):                      # a receiver serves one transfer after another with one display
        bar.phase("setting up")
        time.sleep(0.2)
        draws = term.getvalue().count("setting up")
        bar.finish()
        assert draws >= 5, term.getvalue()
        assert not [t for t in threading.enumerate() if t.name == "tensorxfer-progress"]


def test_a_resumed_transfer_fills_the_bar_with_the_bytes_that_move():
    """A resume keeps 1.5 GB of the 2 GB planned: the data phase moves 0.5 GB and ends at 100 % when they
    landed, instead of sitting at 25 % until the next phase."""
    term, clock = Terminal(), Clock()
    bar = transfer_bar(term, clock)
    bar.moving(500_000_000)         # known once the sender confirmed the receiver's pieces
    clock.now = 1.0
    bar(100_000_000)
    clock.now = 2.0
    bar(400_000_000)
    screen = term.screen()
    assert re.search(r"^send: moving data +\[#{24}\] 100\.0% 0\.50 GB at 3\.2 Gbps$", screen[1]), screen
    assert screen[2].startswith("send: receiver writing the files"), screen
    bar.finish()
