"""Recovery within one update over tcp: real connections cut by a real relay process, never mocked.

The relay (``tests/cutting_relay.py``) sits between a sender process and a Receiver in this process and
resets (RST) a data connection at a chosen byte count; the update must complete as the same version,
verified, byte-identical, with only what did not land sent again.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys

import numpy as np
import psutil
import pytest

import tensorxfer as tx
from tensorxfer import Receiver, Sender
from tensorxfer.session.recovery import DEFAULT_POLICY, RecoveryPolicy
from tests.helpers import ROOT, Background, child, finish, line_within, region_of

PATTERN = 0x9E3779B97F4A7C15

# A sender process: a region of argv[2] bytes in 64 tensors, filled with a pattern the receiver can check
# without a copy; sends it once (verified) over tcp through argv[1]; prints its stats as JSON.
SENDER = """
import json, sys
import numpy as np
from tensorxfer import Manifest, Sender, TensorRegion
from tensorxfer.session.recovery import RecoveryPolicy
n = int(sys.argv[2])
region = TensorRegion.from_manifest(Manifest.layout([(f"t{i}", "U8", (n // 64,)) for i in range(64)]))
with memoryview(region.region) as mv:
    words = np.frombuffer(mv, dtype=np.uint64, count=region.nbytes // 8)
    words[:] = np.arange(len(words), dtype=np.uint64) * np.uint64(%d)
    del words
policy = RecoveryPolicy() if sys.argv[3] == "on" else None
try:
    with Sender(sys.argv[1], transport="tcp", streams=4, stall_timeout=float(sys.argv[4]), recovery=policy) as s:
        st = s.send(region, verify=True)
    print(json.dumps(st.as_dict()), flush=True)
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}), flush=True)
""".replace("%d", str(PATTERN))


def start_relay(to: tuple[str, int], cuts: list[int], stall: bool = False,
                pause_at: int | None = None) -> tuple[subprocess.Popen, str]:
    """A ``tests.cutting_relay`` process to ``to`` (see there for ``cuts``, ``stall`` and ``pause_at``), and the
    address it listens on."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.cutting_relay", "--to", "{}:{}".format(*to),
                             "--cut", ",".join(map(str, cuts)), *(["--stall"] if stall else []),
                             *(["--pause-at", str(pause_at)] if pause_at is not None else [])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    return proc, line_within(proc, 30, "the relay's address").strip()


def stop_relay(proc: subprocess.Popen) -> dict:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=10)
    return json.loads(out.strip().splitlines()[-1])


def payload_matches(region: tx.TensorRegion) -> bool:
    with memoryview(region.region) as mv:
        words = np.frombuffer(mv, dtype=np.uint64, count=region.nbytes // 8)
        ok = bool(np.array_equal(words, np.arange(len(words), dtype=np.uint64) * np.uint64(PATTERN)))
        del words
    return ok


def run_update(nbytes: int, cuts: list[int], sender_recovery: str = "on",
               recovery: RecoveryPolicy | None = DEFAULT_POLICY, stall: float = 0.0,
               ) -> tuple[dict, dict, Receiver, Background]:
    """One update of ``nbytes`` from a sender process through the relay, cut (or, with ``stall``, silenced:
    both ends then use that stall timeout) at ``cuts``."""
    rx = Receiver(stall_timeout=stall or 10, recovery=recovery)
    relay, where = start_relay(rx.address, cuts, stall=bool(stall))
    job = Background(rx.receive, timeout=60)
    proc = child(SENDER, where, str(nbytes), sender_recovery, str(stall or 10))
    rc, out, err = finish(proc, timeout=120)
    assert rc == 0, err
    wire = stop_relay(relay)
    return json.loads(out.strip().splitlines()[-1]), wire, rx, job


@pytest.mark.parametrize("nbytes", [256 << 20])
def test_one_cut_resumes_only_what_did_not_land(nbytes: int) -> None:
    cut = int(nbytes * 0.55)
    sent, wire, rx, job = run_update(nbytes, [cut])
    with rx:
        region = job.result(timeout=60)
        assert "error" not in sent, sent
        assert wire["cuts"] == [cut], wire
        got = rx.last_stats
        assert got is not None and got.update == 1 and sent["update"] == 1     # one update, the same version
        assert rx.version is not None and rx.version.update == 1
        assert got.retries == 1 and sent["retries"] == 1, (got, sent)
        assert payload_matches(region) and got.verified
        # Bytes the relay carried from the sender: the payload once, plus what was on the wire past the cut and
        # never landed (sent again), plus stream headers.  A restart from zero would carry ~1.55x.
        excess = wire["data_bytes"] - nbytes
        assert 0 <= sent["resent_bytes"] <= 64 << 20, sent
        assert excess <= sent["resent_bytes"] + 4096, (excess, sent)
        assert wire["data_bytes"] < 1.2 * nbytes


@pytest.mark.slow
def test_a_link_gone_silent_is_noticed_by_the_stall_timeouts_and_resumed() -> None:
    nbytes = 64 << 20
    sent, wire, rx, job = run_update(nbytes, [nbytes // 2], stall=1.5)
    with rx:
        region = job.result(timeout=60)
        assert "error" not in sent and sent["retries"] == 1 and wire["cuts"] == [nbytes // 2], (sent, wire)
        assert payload_matches(region) and rx.last_stats is not None and rx.last_stats.retries == 1


@pytest.mark.slow
def test_recovery_off_fails_typed_and_the_receiver_serves_the_next_sender() -> None:
    nbytes = 64 << 20
    sent, _, rx, job = run_update(nbytes, [nbytes // 2], recovery=None)
    with rx:
        with pytest.raises(tx.PeerLost, match=r"closed the connection|reset|lost"):     # as before recovery existed
            job.result(timeout=30)
        assert rx.version is None and sent["error"] in ("PeerLost", "TransferError"), sent
        # the receiver is usable afterwards: a clean update through no relay
        job = Background(rx.receive, timeout=60)
        proc = child(SENDER, "{}:{}".format(*rx.address), str(nbytes), "on", "10")
        rc, _, err = finish(proc, timeout=60)
        assert rc == 0, err
        assert payload_matches(job.result(timeout=30)) and rx.version is not None


def test_a_sender_without_recovery_is_not_asked_to_resume() -> None:
    nbytes = 64 << 20
    sent, _, rx, job = run_update(nbytes, [nbytes // 3], sender_recovery="off")
    with rx:
        with pytest.raises(tx.PeerLost):
            job.result(timeout=30)
        assert sent["error"] == "PeerLost" and rx.version is None


def test_cuts_past_the_attempts_fail_typed() -> None:
    nbytes = 64 << 20
    # The first cut breaks one of 4 streams at ~10 %: the first pass carries ~80 % of the bytes, so the second
    # cut (at 90 %) falls into the resume round, which the policy does not allow to be repeated.
    cuts = [nbytes // 10, 9 * nbytes // 10]
    sent, _, rx, job = run_update(nbytes, cuts, recovery=RecoveryPolicy(attempts=1))
    with rx:
        with pytest.raises(tx.PeerLost, match="1 reconnect attempt"):
            job.result(timeout=30)
        assert rx.version is None and "error" in sent


def test_a_resumed_stream_cut_again_is_resumed_again() -> None:
    nbytes = 128 << 20
    sent, wire, rx, job = run_update(nbytes, [nbytes // 10, 9 * nbytes // 10])
    with rx:
        region = job.result(timeout=60)
        assert "error" not in sent and sent["retries"] == 2 and len(wire["cuts"]) == 2, (sent, wire)
        assert payload_matches(region) and rx.last_stats is not None and rx.last_stats.retries == 2
        assert wire["data_bytes"] - nbytes <= sent["resent_bytes"] + 8192, (sent, wire)


@pytest.mark.slow
def test_100_updates_with_a_cut_every_10th_keep_fds_and_rss_flat() -> None:
    me = psutil.Process()
    size = 16 << 20
    # the relay counts every data byte it carried: a cut in the middle of every 10th update (resent bytes shift
    # the later ones by a little, never out of their update)
    cuts = [(10 * k + 5) * size + size // 2 for k in range(10)]
    with region_of(size) as region, Receiver(stall_timeout=10) as rx:
        relay, where = start_relay(rx.address, cuts)
        job = Background(lambda: [rx.receive(timeout=20) and rx.last_stats for _ in range(100)])
        samples, retries = [], 0
        try:
            with Sender(where, transport="tcp", streams=4, stall_timeout=10) as s:
                for i in range(100):
                    with memoryview(region.region) as mv:
                        mv[i * 4096:(i + 1) * 4096] = bytes([i]) * 4096
                    retries += s.send(region, verify=(i % 10 == 0)).retries
                    if i in (19, 99):
                        gc.collect()
                        samples.append((me.num_fds(), me.memory_info().rss))
            got = job.result(timeout=60)
        finally:
            wire = stop_relay(relay)
    assert len(wire["cuts"]) == 10 and retries >= 10, (wire, retries)
    assert sum(st.retries for st in got) == retries
    (fds0, rss0), (fds1, rss1) = samples
    print(json.dumps({"fds": [fds0, fds1], "rss": [rss0, rss1], "retries": retries, "cuts": wire["cuts"]}))
    assert fds1 == fds0, f"fds grew over 80 updates with 8 cuts: {fds0} -> {fds1}"
    assert rss1 - rss0 < 16 << 20, f"RSS grew by {(rss1 - rss0) >> 20} MiB over 80 updates with 8 cuts"
