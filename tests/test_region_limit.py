"""The receiver's default region limit: half of the memory the region would live in, and a
refusal that says what the limit is, where it comes from and how to raise it."""

from __future__ import annotations

import socket

import psutil
import pytest

import tensorxfer as tx
from tensorxfer import Manifest, ManifestError
from tensorxfer import protocol as P
from tensorxfer.manifest import DEFAULT_MAX_REGION_BYTES, default_max_region_bytes
from tests.helpers import Background

PHYSICAL = psutil.virtual_memory().total


def test_host_default_is_half_of_this_machines_memory():
    limit = default_max_region_bytes("cpu")
    assert limit == DEFAULT_MAX_REGION_BYTES
    assert 0 < limit <= PHYSICAL // 2      # lower where a cgroup limits this process


def test_a_manifest_larger_than_half_the_memory_is_refused_by_default_and_says_how_to_raise_it():
    huge = Manifest.layout([("a", "U8", (PHYSICAL,))]).pack()      # 40 bytes of manifest, all of RAM
    with pytest.raises(ManifestError) as e:
        Manifest.unpack(huge)
    msg = str(e.value)
    assert f"limit of {default_max_region_bytes()} bytes" in msg
    assert "half of this machine's" in msg and ("MemTotal" in msg or "cgroup" in msg)
    assert "max_region_bytes=" in msg and "--max-bytes" in msg
    assert Manifest.unpack(huge, max_region_bytes=PHYSICAL).nbytes == PHYSICAL
    with pytest.raises(ManifestError, match="set with max_region_bytes / --max-bytes"):
        Manifest.unpack(huge, max_region_bytes=12345)


def test_a_default_receiver_refuses_an_offer_of_all_the_memory_before_allocating():
    """A 176-byte manifest used to make a receiver commit 3 GiB (the default limit was 1 TiB)."""
    with tx.Receiver() as rx:
        job = Background(rx.receive, timeout=20)
        with P.Channel(socket.create_connection(rx.address, timeout=10)) as ch:
            P.client_handshake(ch, None, {"transports": ["tcp"]}, 10)
            manifest = Manifest.layout([("a", "U8", (PHYSICAL,))]).pack()
            ch.send("offer", seq=1, manifest=manifest, transport="tcp", streams=1, verify=False)
            with pytest.raises(ManifestError, match=r"half of this machine's.*Receiver\(max_region_bytes=N\)"):
                ch.recv("accept", timeout=10)
        with pytest.raises(ManifestError, match="over this receiver's limit"):
            job.result()
        assert rx.region is None


@pytest.mark.cuda
def test_device_default_is_half_of_the_gpus_memory():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    total = torch.cuda.get_device_properties(0).total_memory
    assert default_max_region_bytes("cuda:0") == total // 2
    huge = Manifest.layout([("a", "U8", (total,))]).pack()
    with pytest.raises(ManifestError, match=r"half of cuda:0's .* \(cuDeviceTotalMem of cuda:0\)"):
        Manifest.unpack(huge, max_region_bytes=default_max_region_bytes("cuda:0"))


def test_device_default_falls_back_to_the_host_rule_without_a_driver():
    try:
        import torch
        if torch.cuda.is_available():
            pytest.skip("a GPU is present (the cuda-marked test covers it)")
    except ImportError:
        pass
    assert default_max_region_bytes("cuda:0") == default_max_region_bytes("cpu")
