"""CudaRegion on a real GPU: VMM handles, extents against the driver, dmabuf, IPC handles, GPU views.

Marked ``cuda``: these run on the device machine (an H200); elsewhere they
skip with the reason.  ``test_without_a_driver_*`` runs where the extension
is built but no driver exists (CI), and proves the clear error there.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import tensorxfer as tx
from tensorxfer import CudaError, ExtentError, LayoutError, RegionClosed, TensorRegion
from tensorxfer import memory as mem
from tensorxfer.dtypes import DTYPES

from .helpers import GPU_REASON, needs_gpu


def test_without_a_driver_cuda_calls_raise_a_clear_cuda_error():
    if mem.CudaRegion is None:
        pytest.skip(mem.CUDA_UNAVAILABLE)
    if GPU_REASON is None:
        pytest.skip("a GPU is present: this test is for machines without one")
    with pytest.raises(CudaError, match="use device='cpu'"):
        mem.CudaRegion.allocate(1 << 20)
    with pytest.raises(CudaError):
        TensorRegion.from_tensors({"x": np.zeros(4)}, device="cuda:0")


def test_top_level_cuda_region_exists_everywhere():
    assert "CudaRegion" in tx.__all__
    if mem.CudaRegion is not None:
        assert tx.CudaRegion is mem.CudaRegion
    # the stand-in used where the extension cannot be imported: every use is a clear CudaError
    with pytest.raises(CudaError, match="allocate"):
        mem.UnavailableCudaRegion.allocate(1 << 20)
    with pytest.raises(CudaError, match="not usable"):
        mem.UnavailableCudaRegion()
    assert not isinstance(object(), mem.UnavailableCudaRegion)


cuda = pytest.mark.cuda


@pytest.fixture(scope="module")
def gran():
    from tensorxfer.memory import _cuda

    return _cuda.device_info(0)["granularity"]


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@cuda
@needs_gpu
def test_device_info_reports_what_we_use():
    from tensorxfer.memory import _cuda

    info = _cuda.device_info(0)
    print(json.dumps(info))
    assert info["vmm"] and info["granularity"] > 0


@cuda
@needs_gpu
def test_ucx_shape_three_handles_against_the_driver(gran):
    from tensorxfer.memory._cuda import pointer_range

    with mem.CudaRegion._from_chunks([gran] * 3) as r:
        assert [c[1] for c in r.chunks] == [gran] * 3
        # What UCX trusted: the driver's answer at the base is ONE handle.
        one = pointer_range(r.ptr)["address_range"]
        assert one == (r.ptr, gran)
        assert r.allocation_at(0) == one
        assert not (one[0] <= r.ptr and r.ptr + 3 * gran <= one[0] + one[1]), "one handle must not cover the request"
        ext = r.resolve_extent(0, 3 * gran)
        assert ext.segments == tuple((r.ptr + i * gran, gran) for i in range(3))
        assert (ext.ptr, ext.length) == (r.ptr, 3 * gran)
        mid = r.resolve_extent(gran, gran)
        assert mid.segments == ((r.ptr + gran, gran),)
        # a request crossing a handle boundary by a few bytes spans both
        assert len(r.resolve_extent(gran - 8, 16).segments) == 2


@cuda
@needs_gpu
def test_unmapped_tail_is_never_widened_into_and_range_size_attribute_is_wrong(gran):
    from tensorxfer.memory._cuda import pointer_range

    with mem.CudaRegion._from_chunks([gran] * 3, unmapped_tail=4 * gran) as r:
        start, rsize = pointer_range(r.ptr)["range_size_attribute"]
        # The attribute answers with the whole reservation, unmapped tail
        # included: registering from it would cover memory that is not there.
        assert start == r.ptr and rsize == 7 * gran and rsize > r.size
        ext = r.resolve_extent(gran, 10, whole_alloc=True)
        assert (ext.ptr, ext.length) == (r.ptr + gran, gran)
        whole = r.resolve_extent(0, 3 * gran, whole_alloc=True)
        assert whole.length == 3 * gran
        with pytest.raises(ExtentError) as e:
            r.resolve_extent(0, 3 * gran + 1)
        assert e.value.address == r.ptr + 3 * gran


@cuda
@needs_gpu
def test_holes_are_named(gran):
    with mem.CudaRegion._from_chunks([gran] * 4, holes={2}) as r:
        with pytest.raises(ExtentError, match=f"offset {2 * gran}") as e:
            r.resolve_extent(0, 4 * gran)
        assert e.value.address == r.ptr + 2 * gran
        # a dmabuf over the hole is refused before the driver is asked
        with pytest.raises(ExtentError):
            r.export_dmabuf(0, 4 * gran)
        assert r.resolve_extent(0, 2 * gran).length == 2 * gran
    with mem.CudaRegion.allocate(3 * gran, chunk_size=gran) as r:
        r._unmap_chunk(1)
        with pytest.raises(ExtentError):
            r.resolve_extent(0, 3 * gran)


@cuda
@needs_gpu
@pytest.mark.parametrize("handles", [1, 3, 120])
def test_dmabuf_spans_every_handle(gran, handles):
    with mem.CudaRegion.allocate(handles * gran, chunk_size=gran) as r:
        assert len(r.chunks) == handles
        fd = r.export_dmabuf()
        try:
            assert os.lseek(fd, 0, os.SEEK_END) == handles * gran
            assert os.readlink(f"/proc/self/fd/{fd}").startswith(("anon_inode:dmabuf", "/dmabuf:"))
        finally:
            os.close(fd)
        if handles > 1:
            fd = r.export_dmabuf(gran, gran)
            try:
                assert os.lseek(fd, 0, os.SEEK_END) == gran
            finally:
                os.close(fd)


CHILD_EXPANDABLE = """
import json, torch
from tensorxfer.memory import CudaRegion
from tensorxfer.memory._cuda import pointer_range, is_vmm
t = torch.empty(200 << 20, dtype=torch.uint8, device="cuda")
r = CudaRegion.from_tensor(t)
ext = r.resolve_extent(0, t.numel())
out = {"segments": len(ext.segments), "length": ext.length, "nbytes": t.numel(),
       "one_handle": pointer_range(t.data_ptr())["address_range"][1], "vmm": is_vmm(t.data_ptr()),
       "sizes": sorted({s for _, s in ext.segments})}
r.close()
print(json.dumps(out))
"""


@cuda
@needs_gpu
def test_torch_expandable_segments_resolve_to_the_full_tensor(torch):
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    p = subprocess.run([sys.executable, "-c", CHILD_EXPANDABLE], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    print(out)
    assert out["vmm"]
    assert out["segments"] >= 5, out
    assert out["length"] == out["nbytes"]
    assert out["one_handle"] < out["nbytes"], "the driver's one-shot answer must be shown too small"


@cuda
@needs_gpu
def test_plain_cudamalloc_memory_adopts_as_one_allocation(torch):
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    code = ("import torch, json\nfrom tensorxfer.memory import CudaRegion\nfrom tensorxfer.memory._cuda import is_vmm\n"
            "t = torch.empty(64 << 20, dtype=torch.uint8, device='cuda')\n"
            "r = CudaRegion.from_tensor(t); e = r.resolve_extent(0, t.numel())\n"
            "print(json.dumps([is_vmm(t.data_ptr()), len(e.segments), e.length == t.numel()])); r.close()")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1]) == [False, 1, True]


CHILD_IMPORT = """
import hashlib, json, sys
import numpy as np
from tensorxfer.memory import CudaRegion
from tensorxfer.memory._copy import Copier
from tensorxfer.staging import dtoh
handles = json.loads(sys.argv[1])
with CudaRegion.import_handles([(s, fd) for s, fd in handles], device=0) as r, Copier(0) as c:
    host = np.empty(r.size, np.uint8)
    dtoh(c, host, r.ptr)
    ext = r.resolve_extent(0, r.size)
    print(json.dumps({"sha": hashlib.sha256(host).hexdigest(), "segments": len(ext.segments)}))
"""


@cuda
@needs_gpu
def test_export_and_import_handles_between_two_processes(gran):
    from tensorxfer.memory._copy import Copier
    from tensorxfer.staging import htod

    data = np.random.default_rng(3).integers(0, 256, 3 * gran, dtype=np.uint8)
    with mem.CudaRegion.allocate(3 * gran, chunk_size=gran) as r, Copier(0) as c:
        htod(c, r.ptr, data)
        c.synchronize()
        exported = r.export_handles()
        try:
            assert len(exported) == 3
            fds = [fd for _, _, fd in exported]
            arg = json.dumps([[size, fd] for _, size, fd in exported])
            p = subprocess.run([sys.executable, "-c", CHILD_IMPORT, arg], pass_fds=fds, capture_output=True,
                               text=True, timeout=120)
        finally:
            for _, _, fd in exported:
                os.close(fd)
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout.strip().splitlines()[-1])
        assert out == {"sha": hashlib.sha256(data).hexdigest(), "segments": 3}


@cuda
@needs_gpu
def test_staged_copies_round_trip_larger_than_the_staging_buffers():
    from tensorxfer.memory._copy import Copier
    from tensorxfer.staging import dtoh, htod

    n = (150 << 20) + 12345
    data = np.random.default_rng(4).integers(0, 256, n, dtype=np.uint8)
    with mem.CudaRegion.allocate(n) as r, Copier(0, buffer_bytes=16 << 20) as c:
        htod(c, r.ptr, data)
        c.synchronize()
        back = np.empty_like(data)
        dtoh(c, back, r.ptr)
        assert np.array_equal(back, data)


def _random_torch(torch, dtype, shape, device):
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


@cuda
@needs_gpu
def test_tensor_region_on_gpu_all_dtypes_torch_and_cupy_views(torch):
    src = {f"{name}": _random_torch(torch, getattr(torch, d.torch_name), (7, 33), "cuda") for name, d in DTYPES.items()}
    src["host.f32"] = np.random.default_rng(5).standard_normal((100, 10)).astype(np.float32)
    src["strided"] = torch.arange(600, device="cuda", dtype=torch.int32).reshape(20, 30).t()
    with TensorRegion.from_tensors(src, device="cuda:0", chunk_size=2 << 20) as r:
        assert r.device == "cuda:0" and r.region.size >= r.nbytes
        views = r.tensors(framework="torch")
        for name, t in src.items():
            v = views[name]
            assert v.is_cuda and v.shape == tuple(t.shape)
            expect = torch.as_tensor(t) if isinstance(t, np.ndarray) else t.contiguous()
            assert torch.equal(v.cpu().view(torch.uint8) if v.dim() else v.cpu(),
                               expect.cpu().view(torch.uint8) if expect.dim() else expect.cpu()), name
        # a write through a view is visible in the region (and through another framework)
        views["F32"][0, 0] = 1234.5
        cp = pytest.importorskip("cupy")
        cviews = r.tensors(framework="cupy")
        assert float(cviews["F32"][0, 0]) == 1234.5
        bf16 = cviews["BF16"]
        print("cupy bf16 view dtype:", bf16.dtype)
        assert bf16.dtype.itemsize == 2 and bf16.shape == (7, 33)
        assert cp.asnumpy(bf16).view(np.uint16).tobytes() == views["BF16"].cpu().view(torch.uint16).numpy().tobytes()
        r.close()                              # views alive: no error, the region is closed at once
        assert r.closed and not r.region.released
        with pytest.raises(RegionClosed):
            r.tensors()
        assert float(views["F32"][0, 0]) == 1234.5 and float(cviews["F32"][0, 0]) == 1234.5   # still mapped
        del views, cviews, bf16, v
        gc.collect()
        assert r.region.released               # the last view went: unmapped then


@cuda
@needs_gpu
def test_update_from_and_from_manifest_on_gpu(torch):
    src = {"w": _random_torch(torch, torch.bfloat16, (256, 256), "cuda"), "b": torch.zeros(256, device="cuda")}
    with TensorRegion.from_tensors(src, device="cuda") as r:
        step = {"w": _random_torch(torch, torch.bfloat16, (256, 256), "cuda"), "b": torch.ones(256)}   # b from host
        ptr = r.region.ptr
        r.update_from(step)
        assert r.region.ptr == ptr
        v = r.tensors()
        # compare bits: random bf16 bits include NaNs, which never compare equal
        assert torch.equal(v["w"].view(torch.int16), step["w"].view(torch.int16))
        assert torch.equal(v["b"].cpu(), step["b"])
        del v
        with pytest.raises(LayoutError):
            r.update_from({"w": step["w"]})
        with TensorRegion.from_manifest(r.manifest, device="cuda:0") as dst:
            dv = dst.tensors()
            assert int(dv["w"].view(torch.int16).count_nonzero()) == 0
            del dv
            dst.update_from(r.tensors())
            assert torch.equal(dst.tensors()["w"].view(torch.int16), step["w"].view(torch.int16))
        ext = r.resolve_extent()
        assert ext.length == r.nbytes


@cuda
@needs_gpu
def test_unclosed_cuda_region_is_released_with_a_resource_warning(gran):
    r = mem.CudaRegion.allocate(gran)
    with pytest.warns(ResourceWarning, match="unclosed CudaRegion"):
        del r
        gc.collect()


@cuda
@needs_gpu
def test_close_is_idempotent_and_rollback_leaves_nothing(gran):
    r = mem.CudaRegion.allocate(2 * gran, chunk_size=gran)
    r.close()
    r.close()
    assert r.closed
    with pytest.raises(ValueError, match="closed"):
        r.resolve_extent(0, 1)
    # an impossible allocation fails cleanly (CUDA_ERROR_OUT_OF_MEMORY), leaving nothing behind
    from tensorxfer.memory._cuda import device_info

    free_before = _free_mem()
    with pytest.raises(CudaError, match=r"OUT_OF_MEMORY|cuMemCreate|cuMemAddressReserve"):
        mem.CudaRegion.allocate(1 << 48, chunk_size=1 << 30)
    assert abs(_free_mem() - free_before) < (64 << 20)
    assert device_info(0)["vmm"]


def _free_mem() -> int:
    torch = pytest.importorskip("torch")
    return int(torch.cuda.mem_get_info(0)[0])


@cuda
@needs_gpu
def test_reserve_then_map_next_exposes_only_the_mapped_prefix(gran):
    with mem.CudaRegion.reserve(3 * gran, chunk_size=gran) as r:
        assert r.mapped_size == 0
        with pytest.raises(ExtentError):
            r.resolve_extent(0, 1)
        assert r.map_next() == gran
        assert r.resolve_extent(0, gran).length == gran
        with pytest.raises(ExtentError) as e:
            r.resolve_extent(0, gran + 1)
        assert e.value.address == r.ptr + gran
        assert r.map_next(5) == 3 * gran
        assert len(r.resolve_extent(0, 3 * gran).segments) == 3


@cuda
@needs_gpu
@pytest.mark.parametrize("batch_api", [False, True])
def test_pipelined_from_tensors_and_batched_copies_across_many_handles(torch, gran, batch_api):
    # tensors larger than a handle, smaller ones between them: every copy
    # lands in a prefix mapped just before it was queued
    shapes = [(3 * gran // 2,), (7,), (5 * gran // 2,), (gran // 2 + 3,), (11, 13)]
    src = {f"t{i}": _random_torch(torch, torch.bfloat16, s, "cuda") for i, s in enumerate(shapes)}
    with TensorRegion.from_tensors(src, device="cuda:0", chunk_size=gran) as r:
        assert len(r.region.chunks) >= 8
        r.batch_copies = batch_api
        v = r.tensors()
        for k, t in src.items():
            assert torch.equal(v[k].view(torch.int16), t.view(torch.int16)), k
        step = {k: _random_torch(torch, torch.bfloat16, t.shape, "cuda") for k, t in src.items()}
        r.update_from(step)
        for k, t in step.items():
            assert torch.equal(v[k].view(torch.int16), t.view(torch.int16)), k
        del v


@cuda
@needs_gpu
def test_repeated_updates_replay_the_plan_and_notice_changed_storage(torch):
    params = {f"p{i}": _random_torch(torch, torch.bfloat16, (64, 33), "cuda") for i in range(20)}
    with TensorRegion.from_tensors(params, device="cuda:0") as r:
        r.update_from(params)
        assert r._plan is not None
        for step in range(3):
            for t in params.values():
                t.add_(1)                          # an optimizer step, in place
            r.update_from(params)
            v = r.tensors()
            assert all(torch.equal(v[k].view(torch.int16), t.view(torch.int16)) for k, t in params.items()), step
            del v
        params["p3"].data = torch.zeros(64, 33, dtype=torch.bfloat16, device="cuda")   # new storage
        r.update_from(params)
        assert int(r.tensors()["p3"].view(torch.int16).count_nonzero()) == 0
        params["p4"].data = torch.zeros(3, dtype=torch.bfloat16, device="cuda")        # new shape: refused
        with pytest.raises(LayoutError):
            r.update_from(params)


@cuda
@needs_gpu
@pytest.mark.parametrize("src_device, dst_device", [("cuda:0", "cuda:0"), ("cpu", "cuda:0"), ("cuda:0", "cpu")])
def test_tcp_transfer_stages_gpu_regions_through_pinned_buffers(torch, src_device, dst_device):
    from tensorxfer import Receiver, Sender
    from tests.helpers import Background

    # 3 streams, pieces of 8 MiB: slices span many pieces and handles
    tensors = {f"w{i}": _random_torch(torch, torch.bfloat16, (1024, 1024 + i), "cuda") for i in range(24)}
    tensors["odd"] = _random_torch(torch, torch.uint8, (12345,), "cuda")
    with TensorRegion.from_tensors(tensors, device=src_device, chunk_size=16 << 20) as region, \
            Receiver(device=dst_device) as rx:
        job = Background(lambda: [rx.receive(timeout=60) for _ in range(2)])
        with Sender("{}:{}".format(*rx.address), streams=3, transport="tcp") as s:   # auto would pick ipc here
            st1 = s.send(region, verify=True)
            region.update_from({k: v.add(1) if v.dtype != torch.uint8 else v for k, v in tensors.items()})
            st2 = s.send(region, verify=True)
        got = job.result()
        assert got[0] is got[1] and st1.verified and st2.verified and st2.transport == "tcp"
        a = region.tensors(framework="torch")
        b = got[1].tensors(framework="torch")
        assert all(torch.equal(a[k].view(torch.uint8).cpu(), b[k].view(torch.uint8).cpu()) for k in tensors)
        print(f"tcp {src_device} -> {dst_device}: {st2.bytes / 1e6:.1f} MB at {st2.gbps:.2f} Gbps")
        del a, b, got


# ---------------------------------------------------------------- staging (the CUDA half of test_staging.py)
def _gpu_pattern(torch, n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)


def _region_bytes(torch, r):
    return torch.as_tensor(r.cuda_array(0, r.size), device=f"cuda:{r.device_index}").cpu().numpy().tobytes()


@cuda
@needs_gpu
@pytest.mark.parametrize("piece", [1 << 20, (1 << 20) + 3, 7 << 20, 64 << 20])
def test_staged_pieces_round_trip_across_handles(torch, gran, piece):
    from tensorxfer.staging import read_pieces, write_pieces

    with mem.CudaRegion.allocate(4 * gran, chunk_size=gran) as r:
        assert len(r.chunks) == 4 and all(fd == -1 for _, _, fd in r.chunks)
        offset, length = gran - 12345, 3 * gran + 777        # starts in handle 0, ends in handle 3
        data = np.random.default_rng(6).integers(0, 256, length, dtype=np.uint8).tobytes()
        before = _region_bytes(torch, r)
        end = offset
        with write_pieces(r, offset, length, piece) as pieces:
            for pos, view in pieces:
                assert pos == end and 0 < len(view) <= piece
                view[:] = data[pos - offset:pos - offset + len(view)]
                end += len(view)
        assert end == offset + length
        after = _region_bytes(torch, r)                      # the normal exit waited for every copy
        assert after[offset:offset + length] == data
        assert after[:offset] == before[:offset] and after[offset + length:] == before[offset + length:]
        got, end = [], offset
        with read_pieces(r, offset, length, piece) as pieces:
            for pos, view in pieces:
                assert pos == end and 0 < len(view) <= piece
                got.append(bytes(view))
                end += len(view)
        assert b"".join(got) == data and r.views == 0


@cuda
@needs_gpu
@pytest.mark.parametrize("direction", ["read", "write"])
def test_staging_exception_mid_iteration_waits_cleans_up_and_leaks_nothing(torch, gran, direction):
    from tensorxfer.staging import read_pieces, write_pieces

    staged = read_pieces if direction == "read" else write_pieces
    free0 = _free_mem()
    r = mem.CudaRegion.allocate(2 * gran, chunk_size=gran)
    with pytest.raises(KeyError, match="consumer") as e, staged(r, 0, 2 * gran, 1 << 20) as pieces:
        for n, (_, view) in enumerate(pieces):
            if direction == "write":
                view[:1] = b"x"
            if n == 1:                                       # pieces 2 and 3 never requested
                raise KeyError("consumer failed")
    assert not getattr(e.value, "__notes__", None), "cleanup raised nothing of its own"
    assert r.views == 0
    r.close()
    assert r.released and abs(_free_mem() - free0) < (64 << 20)


@cuda
@needs_gpu
def test_staging_reuses_a_callers_stager_and_leaves_it_idle(torch, gran):
    from tensorxfer.memory._copy import Stager
    from tensorxfer.staging import open_stager, read_into, read_pieces, write_from, write_pieces

    data = np.random.default_rng(8).integers(0, 256, gran + 99, dtype=np.uint8)
    with mem.CudaRegion.allocate(2 * gran, chunk_size=gran) as r, open_stager(r, 1 << 20) as st:
        assert isinstance(st, Stager) and st.buffer_bytes == 1 << 20
        write_from(r, 5, data, stager=st)
        back = np.zeros_like(data)
        read_into(r, 5, back, stager=st)
        assert np.array_equal(back, data)
        with read_pieces(r, 0, 3 << 20, 64 << 20, stager=st) as pieces:
            assert [len(v) for _, v in pieces] == [1 << 20] * 3      # capped at the stager's buffers
        # a consumer that stops early: the pieces it filled land, the others are not written
        with write_pieces(r, 0, 4 << 20, 1 << 20, stager=st) as pieces:
            for n, (_, view) in enumerate(pieces):
                view[:] = bytes([n + 1]) * len(view)
                if n == 1:
                    break
        head = _region_bytes(torch, r)[:3 << 20]
        assert head[:1 << 20] == b"\x01" * (1 << 20) and head[1 << 20:2 << 20] == b"\x02" * (1 << 20)
        # never handed out, so not written: still what write_from put there (region offset 2 MiB = data[2 MiB - 5])
        assert head[2 << 20:(2 << 20) + 5] == data[(2 << 20) - 5:2 << 20].tobytes()


@cuda
@needs_gpu
def test_copier_htod_dtoh_use_the_staging_loop(torch, gran):
    from tensorxfer.memory._copy import Copier
    from tensorxfer.staging import dtoh, htod

    data = np.random.default_rng(9).integers(0, 256, 3 * (1 << 20) + 5, dtype=np.uint8)
    with mem.CudaRegion.allocate(4 * gran) as r, Copier(0, buffer_bytes=1 << 20) as c:
        htod(c, r.ptr + 3, data)
        back = np.empty_like(data)
        dtoh(c, back, r.ptr + 3)
        assert np.array_equal(back, data)
        with pytest.raises(ValueError, match="writable"):
            dtoh(c, b"read-only", r.ptr)


@cuda
@needs_gpu
def test_device_checksums_match_the_host_ones(torch, monkeypatch):
    from tensorxfer import checksum

    src = {f"t{i}": _gpu_pattern(torch, n, i) for i, n in enumerate([1, 3 << 20, 17, (9 << 20) + 1, 0, 256])}
    with TensorRegion.from_tensors(src, device="cuda:0", chunk_size=2 << 20) as g, \
            TensorRegion.from_tensors({k: v.cpu() for k, v in src.items()}) as h:
        expect = checksum.tensor_checksums(h)
        for stage in (1 << 20, (1 << 20) + 7, 8 << 20):
            monkeypatch.setattr(checksum, "STAGE_BYTES", stage)
            assert checksum.tensor_checksums(g) == expect, stage


@cuda
@needs_gpu
def test_cuda_region_close_with_a_live_torch_view_releases_with_it(torch, gran):
    free0 = _free_mem()
    r = mem.CudaRegion.allocate(64 * gran, chunk_size=gran)
    try:
        t = torch.as_tensor(r.cuda_array(0, r.size), device="cuda:0")
        t.fill_(7)
    finally:
        r.close()                                  # no BufferError with t alive
    assert r.closed and not r.released and r.views == 1
    with pytest.raises(RegionClosed):
        r.cuda_array()
    with pytest.raises(RegionClosed):
        r.export_handles()
    torch.cuda.synchronize()
    assert int(t[0]) == 7 and int(t[-1]) == 7    # the memory under t is still there
    assert _free_mem() < free0 - 32 * gran         # still mapped for t
    del t
    gc.collect()
    assert r.released and abs(_free_mem() - free0) < (64 << 20)
