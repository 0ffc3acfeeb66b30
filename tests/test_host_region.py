"""HostRegion: memfd chunks mapped into one reservation, the host twin of CUDA VMM."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tensorxfer import HostRegion
from tensorxfer.memory import page_size
from tensorxfer.memory._host import DEFAULT_CHUNK_SIZE

from .conftest import tensorxfer_mappings

PAGE = page_size()


def test_allocate_maps_one_memfd_per_chunk_contiguously():
    with HostRegion.allocate(10 * PAGE, chunk_size=3 * PAGE) as r:
        chunks = r.chunks
        assert [(o, s) for o, s, _ in chunks] == [(0, 3 * PAGE), (3 * PAGE, 3 * PAGE), (6 * PAGE, 3 * PAGE),
                                                   (9 * PAGE, PAGE)]
        fds = [fd for _, _, fd in chunks]
        assert len(set(fds)) == 4
        for fd in fds:
            assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:tensorxfer")
            assert os.get_inheritable(fd) is False          # MFD_CLOEXEC
        # each chunk's memfd backs exactly its slice of the one virtual range
        view = np.frombuffer(r, dtype=np.uint8)
        view[:] = np.arange(view.size, dtype=np.uint64).astype(np.uint8)
        for off, size, fd in chunks:
            assert os.pread(fd, size, 0) == view[off:off + size].tobytes()
        assert len(tensorxfer_mappings()) >= 4
        del view


def test_default_chunk_size_gives_several_chunks():
    size = 3 * DEFAULT_CHUNK_SIZE + PAGE
    with HostRegion.allocate(size) as r:
        assert len(r.chunks) == 4
        assert r.size == size


def test_default_chunk_size_grows_to_bound_the_handle_count():
    from tensorxfer.memory._host import MAX_DEFAULT_CHUNKS, _default_chunk_size

    assert _default_chunk_size(31_200_000_000) * MAX_DEFAULT_CHUNKS >= 31_200_000_000
    assert _default_chunk_size(1 << 20) == DEFAULT_CHUNK_SIZE


def test_size_rounds_up_to_pages_and_memory_starts_zeroed():
    with HostRegion.allocate(PAGE + 1, chunk_size=1) as r:
        assert r.size == 2 * PAGE
        assert [s for _, s, _ in r.chunks] == [PAGE, PAGE]
        assert not np.frombuffer(r, dtype=np.uint8).any()


@pytest.mark.parametrize("size, chunk", [(0, None), (-1, None), (PAGE, 0), (PAGE, -5)])
def test_bad_sizes_raise_value_error(size, chunk):
    with pytest.raises(ValueError):
        HostRegion.allocate(size, chunk)


def test_close_is_idempotent_and_later_use_is_an_error():
    r = HostRegion.allocate(PAGE)
    assert not r.closed
    r.close()
    r.close()
    assert r.closed
    with pytest.raises(ValueError, match="closed"):
        r.ptr  # noqa: B018
    with pytest.raises(ValueError, match="closed"):
        memoryview(r)
    with pytest.raises(ValueError, match="closed"):
        r.resolve_extent(0, 1)


def test_close_refuses_while_views_are_alive():
    r = HostRegion.allocate(PAGE)
    view = np.frombuffer(r, dtype=np.uint8)
    with pytest.raises(BufferError, match="view"):
        r.close()
    assert not r.closed
    view[0] = 1
    del view
    r.close()


def test_unclosed_region_is_released_with_a_resource_warning():
    r = HostRegion.allocate(2 * PAGE, chunk_size=PAGE)
    fds = [fd for _, _, fd in r.chunks]
    with pytest.warns(ResourceWarning, match="unclosed HostRegion"):
        del r
        gc.collect()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_adopt_wraps_foreign_memory_without_owning_it():
    data = bytearray(b"x" * 100)
    r = HostRegion.adopt(data)
    assert not r.owner and r.size == 100 and r.chunks == [(0, 100, -1)]
    memoryview(r)[0:1] = b"y"
    assert data[0:1] == b"y"
    with pytest.raises(BufferError):
        data.extend(b"more")          # the held export pins the buffer's size
    assert r.resolve_extent(10, 20).segments == ((r.ptr, 100),)
    r.close()
    data.extend(b"more")              # released: the caller's object is intact and usable
    assert data[:2] == b"yx"


def test_adopt_read_only_and_numpy():
    with pytest.raises(BufferError):
        HostRegion.adopt(b"immutable")
    with HostRegion.adopt(b"immutable", writable=False) as r:
        assert r.readonly and bytes(memoryview(r)) == b"immutable"
    a = np.arange(8, dtype=np.int32)
    with HostRegion.adopt(a) as r:
        assert r.ptr == a.ctypes.data and r.size == 32
    with pytest.raises(ValueError, match="empty"):
        HostRegion.adopt(bytearray())
    with pytest.raises(TypeError):
        HostRegion.adopt(12345)


def _run_child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60)


def test_failed_allocate_rolls_back_every_fd_and_mapping():
    # memfd_create fails part-way (fd limit): the chunks made so far are closed
    # and the reservation is unmapped before RegionError reaches the caller.
    r = _run_child("""
        import os, resource
        from tensorxfer import HostRegion, RegionError
        def ours():
            fds = []
            for n in os.listdir("/proc/self/fd"):
                try:
                    fds.append(os.readlink(f"/proc/self/fd/{n}"))
                except OSError:
                    pass   # the directory fd listdir itself used
            maps = [l for l in open("/proc/self/maps") if "memfd:tensorxfer" in l]
            return sum(f.startswith("/memfd:tensorxfer") for f in fds), len(maps)
        nfds = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (nfds + 6, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        try:
            HostRegion.allocate(40 * 4096, chunk_size=4096)
        except RegionError as e:
            print("errno", e.errno, ours())
        """)
    assert r.returncode == 0, r.stderr
    assert "errno 24 (0, 0)" in r.stdout, r.stdout + r.stderr


def test_failed_reservation_raises_region_error():
    r = _run_child("""
        import resource
        from tensorxfer import HostRegion, RegionError
        resource.setrlimit(resource.RLIMIT_AS, (1 << 34, resource.RLIM_INFINITY))
        try:
            HostRegion.allocate(1 << 35)
        except RegionError as e:
            print("errno", e.errno, "mmap" in str(e))
        """)
    assert r.returncode == 0, r.stderr
    assert "errno 12 True" in r.stdout, r.stdout + r.stderr
