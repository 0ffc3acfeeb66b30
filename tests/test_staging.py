"""staging.read_pieces / write_pieces / write_from / read_into on real host regions (memfd chunks).

The CUDA variants of these tests live in test_cuda.py (marked cuda).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import xxhash

from tensorxfer import ExtentError, HostRegion, RegionClosed, TensorRegion
from tensorxfer import checksum as _checksum
from tensorxfer.memory import page_size
from tensorxfer.staging import is_device, memory_of, open_stager, read_into, read_pieces, write_from, write_pieces

from .conftest import tensorxfer_mappings

PAGE = page_size()


def patterned(nchunks: int = 5) -> HostRegion:
    r = HostRegion._from_chunks([PAGE] * nchunks)
    with memoryview(r) as mv:
        mv[:] = (np.arange(len(mv), dtype=np.uint64) * 7 % 251).astype(np.uint8).tobytes()
    return r


def region_bytes(r: HostRegion) -> bytes:
    with memoryview(r) as mv:
        return bytes(mv)


# offsets and lengths that cross chunk boundaries; pieces of odd sizes
RANGES = [(0, 5 * PAGE), (1, PAGE), (PAGE - 3, 2 * PAGE + 7), (3 * PAGE + 1, 2 * PAGE - 1), (PAGE, 0)]
PIECES = [1, 7, PAGE - 1, PAGE + 1, 3 * PAGE + 5, 10 * PAGE]


@pytest.mark.parametrize("offset, length, piece",
                         [(o, n, p) for o, n in RANGES for p in PIECES if p >= 64 or n <= 2 * PAGE])  # fast
def test_read_pieces_cover_the_range_in_order_zero_copy(offset, length, piece):
    with patterned() as r:
        whole = region_bytes(r)
        got, expect_pos = [], offset
        with read_pieces(r, offset, length, piece) as pieces:
            for pos, view in pieces:
                assert pos == expect_pos and 0 < len(view) <= piece
                got.append(bytes(view))
                expect_pos += len(view)
        assert expect_pos == offset + length
        assert b"".join(got) == whole[offset:offset + length]
        assert r.views == 0, "every piece view was released"


def test_read_pieces_of_a_host_region_are_views_not_copies():
    with patterned(2) as r, read_pieces(r, PAGE - 2, 4, 4) as pieces:
        _, view = next(pieces)
        with memoryview(r) as mv:
            mv[PAGE - 2:PAGE + 2] = b"WXYZ"          # across the chunk boundary
        assert bytes(view) == b"WXYZ"


@pytest.mark.parametrize("offset, length, piece",
                         [(o, n, p) for o, n in RANGES for p in (1, PAGE - 1, PAGE + 1, 10 * PAGE)
                          if p > 1 or n <= 2 * PAGE])
def test_write_pieces_fill_exactly_the_range(offset, length, piece):
    with patterned() as r:
        before = region_bytes(r)
        fill = bytes((i * 13 + 5) % 256 for i in range(length))
        end = offset
        with write_pieces(r, offset, length, piece) as pieces:
            for pos, view in pieces:
                assert pos == end and not view.readonly and 0 < len(view) <= piece
                view[:] = fill[pos - offset:pos - offset + len(view)]
                end += len(view)
        assert end == offset + length
        after = region_bytes(r)
        assert after[offset:offset + length] == fill
        assert after[:offset] == before[:offset] and after[offset + length:] == before[offset + length:]
        assert r.views == 0


@pytest.mark.parametrize("staged", [read_pieces, write_pieces])
def test_an_exception_mid_iteration_propagates_and_leaks_nothing(staged):
    before = len(tensorxfer_mappings())
    r = patterned()
    with pytest.raises(KeyError, match="consumer"), staged(r, 5, 4 * PAGE, PAGE) as pieces:
        for n, (_, view) in enumerate(pieces):
            if n == 2:
                raise KeyError("consumer failed")
            assert len(view) == PAGE
    assert r.views == 0, "the region is not pinned by the abandoned iteration"
    r.close()
    assert r.released and len(tensorxfer_mappings()) == before    # released at close: nothing held it


def test_leaving_early_releases_the_pin_and_an_exported_piece_keeps_its_memory():
    before = len(tensorxfer_mappings())
    r = patterned(2)
    with read_pieces(r, 0, 2 * PAGE, PAGE) as pieces:
        _, view = next(pieces)
        kept = np.frombuffer(view, np.uint8)   # the consumer built on the piece: it keeps an export
    assert r.views == 1
    r.close()
    assert not r.released and kept[1] == 7    # host memory stays valid under the kept array
    del kept, view, pieces
    gc.collect()
    assert r.released and len(tensorxfer_mappings()) == before


def test_range_and_argument_errors_are_clear():
    with patterned(2) as r:
        with pytest.raises(ExtentError, match="not inside"):
            read_pieces(r, PAGE, PAGE + 1, 8)
        with pytest.raises(ExtentError):
            write_pieces(r, -1, 4, 8)
        with pytest.raises(ValueError, match="piece_bytes"):
            read_pieces(r, 0, 4, 0)
        with pytest.raises(TypeError, match="TensorRegion, HostRegion or CudaRegion"):
            read_pieces(bytearray(10), 0, 4, 4)
    with pytest.raises(RegionClosed):
        read_pieces(r, 0, 4, 4)


def test_read_only_regions_refuse_write_pieces():
    with HostRegion.allocate(PAGE) as owner:
        exported = owner.export_handles()
        try:
            with HostRegion.import_handles([(s, fd) for _, s, fd in exported]) as ro:
                with pytest.raises(ValueError, match="read-only"):
                    write_pieces(ro, 0, 4, 4)
                with read_pieces(ro, 0, 4, 4) as pieces:
                    assert [bytes(v) for _, v in pieces] == [bytes(4)]
        finally:
            import os

            for _, _, fd in exported:
                os.close(fd)


def test_tensor_regions_and_raw_regions_are_both_accepted():
    with TensorRegion.from_tensors({"a": np.arange(5, dtype=np.int32)}) as tr:
        assert memory_of(tr) is tr.region and not is_device(tr) and not is_device(tr.region)
        assert open_stager(tr, 1 << 20) is None          # host pieces are zero-copy: nothing to pin
        with read_pieces(tr, 0, 4, 4, stager=None) as pieces:
            assert [p for p, _ in pieces] == [0]
        with read_pieces(tr, 0, tr.nbytes, 8) as pieces:
            assert b"".join(bytes(v) for _, v in pieces) == np.arange(5, dtype=np.int32).tobytes()
        write_from(tr, 4, np.array([42], np.int32))
        out = bytearray(8)
        read_into(tr.region, 0, out)
        assert np.frombuffer(out, np.int32).tolist() == [0, 42]


@pytest.mark.parametrize("piece", [1, PAGE - 1, 3 * PAGE])
def test_write_from_and_read_into_round_trip_across_chunks(piece):
    data = np.random.default_rng(1).integers(0, 256, 3 * PAGE + 3, dtype=np.uint8)
    with HostRegion._from_chunks([PAGE] * 5) as r:
        write_from(r, PAGE - 1, data, piece_bytes=piece)
        back = np.zeros_like(data)
        read_into(r, PAGE - 1, back, piece_bytes=piece)
        assert np.array_equal(back, data)
        with pytest.raises(ValueError, match="contiguous"):
            write_from(r, 0, data[::2])
        with pytest.raises(ValueError, match="writable"):
            read_into(r, 0, b"read-only")
        assert r.views == 0


def test_checksums_stream_pieces_that_span_and_split_tensors(monkeypatch):
    rng = np.random.default_rng(2)
    sizes = [1, 3000, 0, 17, 9000, 256, 5]
    tensors = {f"t{i}": rng.integers(0, 256, n, dtype=np.uint8) for i, n in enumerate(sizes)}
    expect = [xxhash.xxh3_64_intdigest(a.tobytes()) for a in tensors.values()]
    with TensorRegion.from_tensors(tensors, chunk_size=PAGE) as r:
        for stage in (7, 1000, 4099, 1 << 20):     # pieces inside one tensor, across several, and all of it
            monkeypatch.setattr(_checksum, "STAGE_BYTES", stage)
            assert _checksum.tensor_checksums(r) == expect, stage
        views = r.tensors()
        views["t4"][100] ^= 1
        del views
        assert _checksum.first_mismatch(r, expect) == "t4"
