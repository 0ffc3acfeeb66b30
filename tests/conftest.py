"""Shared fixtures: every test is checked for leaked tensorxfer resources."""

from __future__ import annotations

import faulthandler
import gc
import importlib
import os
import signal
import sys

import pytest


def resource_fds() -> dict[int, str]:
    """Open fds of the kinds tensorxfer creates: memfd chunks, sockets, dmabufs."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith(("/memfd:tensorxfer", "socket:", "anon_inode:dmabuf", "/dmabuf:")):
            out[int(name)] = target
    return out


def tensorxfer_mappings() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if "memfd:tensorxfer" in line]


def _start_cuda() -> None:
    """The CUDA runtime opens a socket of its own the first time a process uses a GPU (measured on the H100
    machine: a GPU test run alone "leaked" one, none when CUDA had started before the test), and keeps it
    for the process's life: start it before the fds are counted."""
    try:
        import torch
    except Exception:
        return
    if torch.cuda.is_available():
        torch.empty(1, device="cuda")


def pytest_collection_finish(session):
    """What collecting imported (torch, transformers, ...: ~370k objects) stays alive for the whole run: move
    it out of the cyclic collector's sight, so that the ``gc.collect()`` after every test (``no_leaks``) walks
    only what the tests made.  Measured on the 2-core dev VM: that collection took 0.2-0.7 s a test with
    torch and transformers loaded, a third of the full suite's time (553 s of teardown in 1706 s)."""
    gc.collect()
    gc.freeze()


#: Seconds any one phase of a test (setup, call, teardown) may take before it fails (``TENSORXFER_TEST_TIMEOUT``;
#: 0: no limit). The slowest tests take about a minute on the 2-core CI machine; a test that blocks for good
#: (a pipe read nobody answers) would otherwise hold CI until its 90 minutes are up and say nothing of where.
TEST_TIMEOUT = float(os.environ.get("TENSORXFER_TEST_TIMEOUT", "600"))


class TestTimeout(Exception):
    """A test phase ran past ``TEST_TIMEOUT``: raised in the main thread from SIGALRM."""


def _timed_out(signum, frame):
    sys.stderr.write(f"\n--- a test phase ran past {TEST_TIMEOUT:g} s; every thread's stack:\n")
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    raise TestTimeout(f"ran past {TEST_TIMEOUT:g} s (TENSORXFER_TEST_TIMEOUT); the stacks are on stderr")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _bounded())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _bounded())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _bounded())


def _bounded():
    """Run one phase with an alarm set: a blocked system call is interrupted and the phase fails, naming
    itself, and the run goes on to the next test."""
    if TEST_TIMEOUT <= 0:
        return (yield)
    previous = signal.signal(signal.SIGALRM, _timed_out)
    signal.setitimer(signal.ITIMER_REAL, TEST_TIMEOUT)
    try:
        return (yield)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Fail a test that leaves a memfd, socket or dmabuf fd, or a chunk mapping, behind."""
    if request.node.get_closest_marker("cuda") is not None:
        _start_cuda()
    before = resource_fds()
    maps_before = len(tensorxfer_mappings())
    yield
    gc.collect()
    leaked = {fd: t for fd, t in resource_fds().items() if before.get(fd) != t}
    assert not leaked, f"test leaked fds: {leaked}"
    assert len(tensorxfer_mappings()) <= maps_before, "test leaked memfd mappings"


#: Set by .ci/run: the torch and Hugging Face tests must run there, so a missing or broken PyTorch (or
#: transformers) fails the run instead of turning those tests into skips.
REQUIRE_TORCH = "TENSORXFER_REQUIRE_TORCH"
REQUIRED_WITH_TORCH = ("torch", "transformers", "tokenizers", "safetensors")


def pytest_sessionstart(session):
    if os.environ.get(REQUIRE_TORCH) != "1":
        return
    broken = []
    for name in REQUIRED_WITH_TORCH:
        try:
            importlib.import_module(name)
        except Exception as e:       # ImportError, or whatever a broken install raises on import
            broken.append(f"{name} ({type(e).__name__}: {e})")
    if broken:
        raise pytest.UsageError(f"{REQUIRE_TORCH}=1: the torch and Hugging Face tests must run here, but "
                                f"{'; '.join(broken)} cannot be imported; install CPU PyTorch "
                                f"(README, command 1) or unset {REQUIRE_TORCH}")


def torch_or_skip():
    return pytest.importorskip("torch", reason="PyTorch is not installed")
