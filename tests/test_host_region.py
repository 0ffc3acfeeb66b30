"""HostRegion: memfd chunks mapped into one reservation, the host twin of CUDA VMM."""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tensorxfer import HandleError, HostRegion, RegionClosed, RegionError
from tensorxfer.memory import page_size
from tensorxfer.memory._host import DEFAULT_CHUNK_SIZE

from .conftest import tensorxfer_mappings, torch_or_skip

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
    with pytest.raises(RegionClosed):
        r.chunks  # noqa: B018


def _fd_alive(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:tensorxfer")
    except OSError:
        return False


def test_close_with_a_live_numpy_view_defers_release_to_the_last_view():
    before = len(tensorxfer_mappings())
    r = HostRegion.allocate(3 * PAGE, chunk_size=PAGE)
    fds = [fd for _, _, fd in r.chunks]
    view = np.frombuffer(r, dtype=np.uint8)
    view[:] = np.arange(view.size, dtype=np.uint64).astype(np.uint8)
    expect = view.copy()
    other = memoryview(r)[PAGE:2 * PAGE]
    assert r.views == 2
    r.close()                               # no BufferError: closed at once, memory kept for the views
    assert r.closed and not r.released
    with pytest.raises(RegionClosed, match="closed"):
        memoryview(r)                       # no new views
    with pytest.raises(RegionClosed):
        r.export_handles()
    assert np.array_equal(view, expect)     # the old ones still read the right bytes
    assert all(_fd_alive(fd) for fd in fds) and len(tensorxfer_mappings()) == before + 3
    other.release()
    assert not r.released and all(_fd_alive(fd) for fd in fds)
    del view                                # the last view: fds and mappings go now, not at gc
    assert r.released and r.views == 0
    assert not any(_fd_alive(fd) for fd in fds)
    assert len(tensorxfer_mappings()) == before
    r.close()                               # still idempotent


def test_close_with_a_live_torch_view_defers_release_to_the_last_view():
    torch = torch_or_skip()
    before = len(tensorxfer_mappings())
    r = HostRegion.allocate(2 * PAGE, chunk_size=PAGE)
    fds = [fd for _, _, fd in r.chunks]
    try:
        # from_dlpack over numpy keeps the buffer export (torch.frombuffer would not: it
        # releases the export at once and keeps only a reference, so nothing can pin the memory)
        t = torch.from_dlpack(np.frombuffer(r, dtype=np.int32))
        t[:] = torch.arange(t.numel(), dtype=torch.int32)
    finally:
        r.close()                           # the ordinary pattern, with a tensor still referenced
    assert r.closed and not r.released and int(t[-1]) == t.numel() - 1
    assert all(_fd_alive(fd) for fd in fds) and len(tensorxfer_mappings()) == before + 2
    del t
    gc.collect()
    assert r.released and not any(_fd_alive(fd) for fd in fds) and len(tensorxfer_mappings()) == before


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


# ---------------------------------------------------------------- handles: export, import, seals
def test_allocated_chunks_are_sealed_against_resizing_but_writable():
    import fcntl

    with HostRegion.allocate(2 * PAGE, chunk_size=PAGE) as r:
        for _, size, fd in r.chunks:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
            assert not seals & fcntl.F_SEAL_WRITE
            for new_size in (size // 2, 0, 2 * size):
                with pytest.raises(PermissionError) as e:
                    os.ftruncate(fd, new_size)
                assert e.value.errno == errno.EPERM
            assert os.pwrite(fd, b"w", 0) == 1          # writes stay allowed
        assert bytes(memoryview(r)[:1]) == b"w"


def test_export_handles_gives_fresh_fds_the_caller_owns():
    r = HostRegion.allocate(3 * PAGE, chunk_size=PAGE)
    with memoryview(r) as mv:
        mv[PAGE:PAGE + 3] = b"abc"
    exported = r.export_handles()
    try:
        own = [fd for _, _, fd in r.chunks]
        assert [(o, s) for o, s, _ in exported] == [(o, s) for o, s, _ in r.chunks]
        for (_, _, fd), mine in zip(exported, own):
            assert fd not in own and os.get_inheritable(fd) is False
            assert os.fstat(fd).st_ino == os.fstat(mine).st_ino       # the same memfd
        r.close()
        # the caller's fds keep the memory: closing the region did not close them
        assert os.pread(exported[1][2], 3, 0) == b"abc"
        with HostRegion.import_handles([(s, fd) for _, s, fd in exported]) as imp:
            assert bytes(memoryview(imp)[PAGE:PAGE + 3]) == b"abc"
            with pytest.raises(RegionError, match="no fd"):
                imp.export_handles()                  # imported: nothing of its own to export
    finally:
        for _, _, fd in exported:
            os.close(fd)


def test_export_handles_refuses_adopted_memory_and_holes():
    with HostRegion.adopt(bytearray(PAGE)) as r, pytest.raises(RegionError, match="adopted"):
        r.export_handles()
    with HostRegion._from_chunks([PAGE] * 3, holes={1}) as r:
        from tensorxfer import ExtentError

        with pytest.raises(ExtentError, match="chunk 1"):
            r.export_handles()


def _test_memfd(size: int, seals: int | None, allow_sealing: bool = True) -> int:
    import fcntl

    fd = os.memfd_create("tensorxfer-test", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if allow_sealing else 0))
    os.ftruncate(fd, size)
    if seals is not None:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


@pytest.mark.parametrize("kind, match", [
    ("unsealed", "lacks F_SEAL_SHRINK and F_SEAL_GROW"),
    ("grow-only-sealed", "lacks F_SEAL_SHRINK"),
    ("not-sealable", "lacks F_SEAL_SHRINK and F_SEAL_GROW"),   # born with F_SEAL_SEAL
    ("regular-file", "handle 1"),
    ("short", "less than its"),
    ("pipe", "not a memory file"),
    ("closed", "cannot be inspected"),
])
def test_import_handles_refuses_fds_that_could_fault(kind, match, tmp_path):
    import fcntl

    both = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    before = len(tensorxfer_mappings())
    good = _test_memfd(PAGE, both)
    extra: list[int] = []
    if kind == "unsealed":
        bad = _test_memfd(PAGE, None)
    elif kind == "grow-only-sealed":
        bad = _test_memfd(PAGE, fcntl.F_SEAL_GROW)
    elif kind == "not-sealable":
        bad = _test_memfd(PAGE, None, allow_sealing=False)
    elif kind == "regular-file":
        path = tmp_path / "f"
        path.write_bytes(bytes(PAGE))
        bad = os.open(path, os.O_RDONLY)
    elif kind == "short":
        bad = _test_memfd(PAGE // 2, both)
    elif kind == "pipe":
        bad, w = os.pipe()
        extra.append(w)
    else:
        bad = os.dup(good)
        os.close(bad)                 # a number that is no open fd
        bad = -2 if bad < 0 else bad
    try:
        with pytest.raises(HandleError, match=match) as e:
            HostRegion.import_handles([(PAGE, good), (PAGE, bad)])
        assert e.value.index == 1 and "handle 1" in str(e.value)
        assert isinstance(e.value, RegionError)
        assert len(tensorxfer_mappings()) == before                    # nothing was mapped
        with HostRegion.import_handles([(PAGE, good)]) as ok:         # the sealed one imports
            assert ok.readonly and ok.size == PAGE
    finally:
        for fd in [good, *extra] + ([] if kind == "closed" else [bad]):
            os.close(fd)


def test_import_fds_is_an_alias_of_import_handles():
    with HostRegion.allocate(PAGE) as r:
        exported = r.export_handles()
        try:
            with HostRegion.import_fds([(s, fd) for _, s, fd in exported], writable=True) as imp:
                assert not imp.readonly
                memoryview(imp)[:2] = b"hi"
            assert bytes(memoryview(r)[:2]) == b"hi"
            unsealed = _test_memfd(PAGE, None)
            try:
                with pytest.raises(HandleError):
                    HostRegion.import_fds([(PAGE, unsealed)])
            finally:
                os.close(unsealed)
        finally:
            for _, _, fd in exported:
                os.close(fd)


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


@pytest.mark.parametrize("commit", [True, False])
def test_a_private_region_is_this_process_memory_on_a_huge_page_boundary_with_no_handles(commit):
    # private=True: anonymous memory (transparent huge pages where allowed), no memfd per chunk, nothing to pass
    fds = len(os.listdir("/proc/self/fd"))
    r = HostRegion.allocate((5 << 20) - 1, chunk_size=2 << 20, commit=commit, private=True)
    try:
        assert r.private and "private" in repr(r)
        assert r.chunks == [(0, 2 << 20, -1), (2 << 20, 2 << 20, -1), (4 << 20, 1 << 20, -1)]
        assert len(os.listdir("/proc/self/fd")) == fds
        view = np.frombuffer(r, dtype=np.uint8)
        base = view.ctypes.data
        assert base % (2 << 20) == 0, "huge pages back only 2 MiB-aligned stretches"
        assert not view.any()
        view[:] = np.arange(view.size, dtype=np.uint64).astype(np.uint8)
        assert bytes(memoryview(r)[(3 << 20) - 2:(3 << 20) + 2]) == bytes(view[(3 << 20) - 2:(3 << 20) + 2])
        with pytest.raises(RegionError, match="private to its process"):
            r.export_handles()
        assert len(os.listdir("/proc/self/fd")) == fds
        del view
    finally:
        r.close()
        r.close()
    assert not _mapped(base) and not _mapped(base + (5 << 20) - 1)


def test_a_shareable_region_is_not_private():
    with HostRegion.allocate(PAGE) as r:
        assert not r.private


def _file(path, data: bytes, flags: int = os.O_RDONLY) -> int:
    path.write_bytes(data)
    return os.open(path, flags)


def test_map_files_maps_each_file_at_its_offset_with_zero_pages_between(tmp_path):
    # the region is the files themselves: no memory of its own but zero pages between them
    fds = len(os.listdir("/proc/self/fd"))
    a = _file(tmp_path / "a", b"A" * (PAGE + 10))
    b = _file(tmp_path / "b", b"B" * 10)
    try:
        r = HostRegion.map_files([(0, PAGE + 10, a), (4 * PAGE, 10, b)], 5 * PAGE + 3, populate=True)
    finally:
        os.close(a)
        os.close(b)
    try:
        assert len(os.listdir("/proc/self/fd")) == fds                     # the mappings need no fd
        assert r.size == 6 * PAGE and r.readonly and "files" in repr(r)
        assert r.chunks == [(0, 2 * PAGE, -1), (2 * PAGE, 2 * PAGE, -1), (4 * PAGE, PAGE, -1), (5 * PAGE, PAGE, -1)]
        view = np.frombuffer(r, dtype=np.uint8)
        assert view[:PAGE + 10].tobytes() == b"A" * (PAGE + 10) and not view[PAGE + 10:4 * PAGE].any()
        assert view[4 * PAGE:4 * PAGE + 10].tobytes() == b"B" * 10 and not view[4 * PAGE + 10:].any()
        assert not view.flags.writeable
        (tmp_path / "b").write_bytes(b"C" * 10)          # the page cache of the file, not a copy of it
        assert view[4 * PAGE:4 * PAGE + 10].tobytes() == b"C" * 10
        with pytest.raises(RegionError, match="files mapped into it"):
            r.export_handles()
        r.resolve_extent(0, r.size)                     # every page mapped: one extent, no hole
        base = view.ctypes.data
        del view
    finally:
        r.close()
        r.close()
    assert not _mapped(base) and not _mapped(base + 5 * PAGE)


def test_map_files_writable_writes_reach_the_files(tmp_path):
    fd = _file(tmp_path / "out", bytes(2 * PAGE + 1), os.O_RDWR)
    try:
        with HostRegion.map_files([(PAGE, 2 * PAGE + 1, fd)], 4 * PAGE, writable=True) as r:
            view = np.frombuffer(r, dtype=np.uint8)
            assert not r.readonly and view.flags.writeable
            view[:] = 7                                # the zero pages before and the file's pages alike
            del view
        data = (tmp_path / "out").read_bytes()
        assert data == bytes([7]) * (2 * PAGE + 1)       # the rest of its last page reached no file
    finally:
        os.close(fd)


def test_map_files_refuses_what_could_fault_or_overlap_before_mapping_anything(tmp_path):
    fd = _file(tmp_path / "f", b"x" * PAGE)
    rfd, wfd = os.pipe()
    def mappings() -> int:
        with open("/proc/self/maps") as f:
            return len(f.readlines())

    maps = mappings()
    try:
        for files, size, match in [
            ([], PAGE, "at least one"),
            ([(1, PAGE, fd)], 2 * PAGE, "multiple of"),
            ([(0, PAGE, fd), (0, PAGE, fd)], 2 * PAGE, "past the previous"),
            ([(PAGE, PAGE, fd)], PAGE, "past the region"),
            ([(0, 0, fd)], PAGE, "must be positive"),
        ]:
            with pytest.raises(ValueError, match=match):
                HostRegion.map_files(files, size)
        with pytest.raises(HandleError, match="less than the") as e:   # a short file: its last pages would fault
            HostRegion.map_files([(0, PAGE, fd), (2 * PAGE, PAGE + 1, fd)], 4 * PAGE)
        assert e.value.index == 1
        with pytest.raises(HandleError, match="not a regular file"):
            HostRegion.map_files([(0, 10, rfd)], PAGE)
        with pytest.raises(RegionError) as err:                        # writable, but the fd is read-only
            HostRegion.map_files([(0, PAGE, fd)], PAGE, writable=True)
        assert err.value.errno == errno.EACCES
        assert mappings() == maps                                      # nothing stayed mapped
    finally:
        for x in (fd, rfd, wfd):
            os.close(x)
