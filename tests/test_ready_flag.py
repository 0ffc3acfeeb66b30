"""The ipc ready flag's host side (tensorxfer/transport/ipc/flag.py): the shared counter, its cyclic compare,
the receiver's wait that notices a dead sender, its release, its lifetime.  The CUDA calls (registering
the page, the stream write and wait) are replaced by a stand-in that writes the counter at once, as a GPU
stream with nothing queued would; the real ones run in the GPU tests of test_sync.py on the device."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

import tensorxfer as tx
from tensorxfer.transport.ipc.flag import PAGE, ReadyFlag

# the CUDA module (built with the package) needs cuda-bindings to import, not a GPU
_copy = pytest.importorskip("tensorxfer.memory._copy", reason="tensorxfer's CUDA module needs cuda-bindings")


@pytest.fixture
def driver(monkeypatch) -> dict[str, Any]:
    """Registered pages by address; set_after writes the counter straight away (an idle stream)."""
    state: dict[str, Any] = {"registered": set(), "synced": []}

    def register_host(device: int, ptr: int, n: int) -> int:
        assert n == PAGE and ptr % PAGE == 0 and ptr not in state["registered"]
        state["registered"].add(ptr)
        return ptr

    def unregister_host(device: int, ptr: int) -> None:
        state["registered"].remove(ptr)

    def write_value(device: int, stream: int, addr: int, value: int) -> None:
        import ctypes

        assert addr in state["registered"]
        ctypes.c_uint32.from_address(addr).value = value

    monkeypatch.setattr(_copy, "register_host", register_host)
    monkeypatch.setattr(_copy, "unregister_host", unregister_host)
    monkeypatch.setattr(_copy, "write_value", write_value)
    monkeypatch.setattr(_copy, "stream_synchronize", lambda device, stream: state["synced"].append(stream))
    return state


def test_the_sender_sets_what_the_receiver_reads_through_one_shared_page(driver: dict[str, Any]) -> None:
    sender = ReadyFlag.create(0)
    receiver = ReadyFlag(os.dup(sender.fd), 0)      # as the "R" message passes it
    try:
        assert len(driver["registered"]) == 2 and receiver.reached(0) and not receiver.reached(1)
        sender.set_after(7, 1)
        assert receiver.reached(1) and not receiver.reached(2)
        sender.set_after(7, (1 << 32) + 3)     # a counter that wrapped still compares as later
        assert receiver.reached(1 << 32) and receiver.reached((1 << 32) + 3) and not receiver.reached((1 << 32) + 4)
        receiver.release(9)                     # a receiver releases only forward
        receiver.release(5)
        assert receiver.reached(9) and not receiver.reached(10)
    finally:
        sender.close()
        receiver.close()
    assert driver["synced"] == [7], "the sender's close must wait for its queued write first"
    assert not driver["registered"]
    sender.close()          # idempotent
    receiver.close()
    with pytest.raises(tx.TransferError, match="aborted"):     # a wait racing a close ends, named
        receiver.reached(1)


def test_the_receivers_wait_names_a_dead_sender_or_a_stall_and_a_set_flag_ends_it(driver: dict[str, Any]) -> None:
    sender = ReadyFlag.create(0)
    receiver = ReadyFlag(os.dup(sender.fd), 0)
    try:
        def gone() -> None:
            raise tx.PeerLost("the sender closed its connection")
        with pytest.raises(tx.PeerLost, match="closed its connection"):
            receiver.await_value(1, 5.0, gone)
        started = time.monotonic()
        with pytest.raises(tx.TransferTimeout, match="ready flag stayed below it"):
            receiver.await_value(1, 0.2, lambda: None)
        assert 0.2 <= time.monotonic() - started < 2
        later = threading.Timer(0.1, sender.set_after, args=(0, 2))
        later.start()
        receiver.await_value(2, 5.0, lambda: None)      # returns once the sender's GPU got there
        later.join()
    finally:
        sender.close()
        receiver.close()


def test_a_page_shorter_than_a_flag_is_refused_and_nothing_leaks(driver: dict[str, Any]) -> None:
    fd = os.memfd_create("short")
    os.ftruncate(fd, 16)
    with pytest.raises(tx.ProtocolError, match="16 bytes"):
        ReadyFlag(fd, 0)
    with pytest.raises(OSError):
        os.fstat(fd)        # taken over: closed with the refusal
    assert not driver["registered"]
