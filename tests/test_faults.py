"""Faults between real processes: a peer killed, a peer that stops, leaks over many updates."""

from __future__ import annotations

import gc
import os
import signal
import time

import numpy as np
import psutil
import pytest

import tensorxfer as tx
from tensorxfer import Receiver, Sender, TensorRegion
from tests.helpers import Background, child, finish, region_of

SIZE = 256 << 20

# A sender process that kills (or stops) itself once a quarter of the payload is out.
SELF_HARMING_SENDER = """
import os, signal, sys
from tensorxfer import Manifest, Sender, TensorRegion
region = TensorRegion.from_manifest(Manifest.layout([("w", "U8", (int(sys.argv[2]),))]))
sent = 0
def progress(n):
    global sent
    sent += n
    if sent >= region.nbytes // 4:
        os.kill(os.getpid(), getattr(signal, sys.argv[3]))
with Sender(sys.argv[1], streams=2, transport="tcp") as s:
    s.send(region, progress=progress)
"""

# A receiver process that kills (or stops) itself once a quarter of the payload landed.
SELF_HARMING_RECEIVER = """
import os, signal, sys
from tensorxfer import Receiver
got = 0
def progress(n):
    global got
    got += n
    if got >= int(sys.argv[1]) // 4:
        os.kill(os.getpid(), getattr(signal, sys.argv[2]))
with Receiver("127.0.0.1:0") as rx:
    print(rx.address[1], flush=True)
    rx.receive(timeout=30, progress=progress)
"""


def start_receiver_child(sig: str):
    proc = child(SELF_HARMING_RECEIVER, str(SIZE), sig)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    return proc, f"127.0.0.1:{port}"


@pytest.mark.slow
def test_sender_killed_mid_transfer_receiver_raises_peer_lost_promptly():
    with Receiver(stall_timeout=30) as rx:
        proc = child(SELF_HARMING_SENDER, "{}:{}".format(*rx.address), str(SIZE), "SIGKILL")
        t0 = time.monotonic()
        try:
            with pytest.raises(tx.PeerLost, match=r"sender closed|lost"):
                rx.receive(timeout=20)
            assert time.monotonic() - t0 < 10, "PeerLost must come promptly, not after the stall timeout"
        finally:
            rc, _, _ = finish(proc)
        assert rc == -signal.SIGKILL


@pytest.mark.slow
def test_receiver_killed_mid_transfer_sender_raises_peer_lost():
    proc, where = start_receiver_child("SIGKILL")
    try:
        with region_of(SIZE) as r, Sender(where, stall_timeout=30) as s:
            t0 = time.monotonic()
            with pytest.raises(tx.PeerLost):
                s.send(r)
            assert time.monotonic() - t0 < 10
    finally:
        rc, _, _ = finish(proc)
    assert rc == -signal.SIGKILL


@pytest.mark.slow
def test_receiver_that_stops_reading_times_out_the_sender():
    proc, where = start_receiver_child("SIGSTOP")
    try:
        with region_of(SIZE) as r, Sender(where, stall_timeout=1.0, transport="tcp") as s:
            t0 = time.monotonic()
            with pytest.raises(tx.TransferTimeout, match="stopped reading"):
                s.send(r)
            assert time.monotonic() - t0 < 8
    finally:
        proc.kill()
        finish(proc)


@pytest.mark.slow
def test_sender_that_stops_sending_times_out_the_receiver():
    with Receiver(stall_timeout=1.0) as rx:
        proc = child(SELF_HARMING_SENDER, "{}:{}".format(*rx.address), str(SIZE), "SIGSTOP")
        try:
            t0 = time.monotonic()
            with pytest.raises(tx.TransferTimeout, match=r"stalled|no data"):
                rx.receive(timeout=20)
            assert time.monotonic() - t0 < 10
        finally:
            proc.kill()
            finish(proc)


@pytest.mark.slow
def test_wrong_token_between_processes_is_auth_error():
    # The sender is told; for the receiver it is a stranger, dropped and counted, and receive() goes on waiting.
    code = """
import sys
from tensorxfer import Receiver
with Receiver("127.0.0.1:0", token="right") as rx:
    print(rx.address[1], flush=True)
    try:
        rx.receive(timeout=3)
    except Exception as e:
        print(type(e).__name__, rx.region is None, rx.dropped_connections, flush=True)
"""
    proc = child(code)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    with pytest.raises(tx.AuthError):
        Sender(f"127.0.0.1:{port}", token="wrong")
    _, out, _ = finish(proc)
    assert out.split() == ["TransferTimeout", "True", "1"]


@pytest.mark.slow
def test_200_updates_keep_fds_and_rss_flat():
    me = psutil.Process()
    rng = np.random.default_rng(0)
    weights = {f"t{i}": rng.standard_normal(20_000, dtype=np.float32) for i in range(60)}
    with TensorRegion.from_tensors(weights) as region, Receiver() as rx:
        job = Background(lambda: [rx.receive(timeout=10) and None for _ in range(200)])
        samples = []
        with Sender("{}:{}".format(*rx.address), streams=2) as s:
            for i in range(200):
                region.update_from({k: v + i for k, v in weights.items()})
                s.send(region, verify=(i % 10 == 0))
                if i in (20, 199):
                    gc.collect()
                    samples.append((me.num_fds(), me.memory_info().rss))
        job.result(timeout=60)
    (fds0, rss0), (fds1, rss1) = samples
    assert fds1 == fds0, f"fds grew over 180 updates: {fds0} -> {fds1}"
    assert rss1 - rss0 < 16 << 20, f"RSS grew by {(rss1 - rss0) >> 20} MiB over 180 updates"


def test_no_threads_left_behind():
    import threading
    with region_of(9 << 20) as r, Receiver() as rx:
        job = Background(rx.receive, timeout=10)
        with Sender("{}:{}".format(*rx.address), streams=3) as s:
            s.send(r)
        job.result()
    time.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name.startswith("tensorxfer-")]


def test_child_env_uses_this_checkout():
    proc = child("import tensorxfer, os; print(os.path.dirname(tensorxfer.__file__))")
    _, out, _ = finish(proc)
    assert os.path.samefile(out.strip(), os.path.dirname(tx.__file__))
