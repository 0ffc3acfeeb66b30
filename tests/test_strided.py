"""Strided copies of a sync's groups: the tiles cover exactly the groups (pure, any machine), the kernel
copies them byte for byte on the GPU, aligned or not, and the host copy (``copy_groups``, a memcpy per row
without the GIL) does on the host, split over threads or not, refusing a group that reaches past a buffer."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorxfer.memory import strided
from tensorxfer.memory._hostcopy import copy_groups, stream_copy
from tensorxfer.transport.segments import Segments

SRC, DST = 1 << 20, 1 << 20


def random_groups(rng: np.random.Generator, groups: int = 30, max_rows: int = 200, max_width: int = 5000,
                  aligned: bool = False) -> Segments:
    """Disjoint destinations (a plan writes each target byte once); contiguous and strided groups mixed."""
    out, dst = [], 0
    for _ in range(groups):
        count = int(rng.integers(1, max_rows))
        n = int(rng.integers(1, max_width))
        if aligned:
            n = max(16, n // 16 * 16)
        contiguous = rng.random() < 0.3
        dst_stride = n if contiguous else n + int(rng.integers(0, 64)) * (16 if aligned else 1)
        src_stride = n if contiguous else n + int(rng.integers(0, 4096)) * (16 if aligned else 1)
        src = int(rng.integers(0, SRC - (count - 1) * src_stride - n)) if SRC > (count - 1) * src_stride + n else -1
        if src < 0 or dst + (count - 1) * dst_stride + n > DST:
            continue
        if aligned:
            src = src // 16 * 16
        out.append((src, dst, n, count, src_stride if count > 1 else 0, dst_stride if count > 1 else 0))
        dst += (count - 1) * dst_stride + n + int(rng.integers(0, 1000)) * (16 if aligned else 1)
    return Segments.of(*zip(*out))


def apply_groups(src: np.ndarray, dst: np.ndarray, seg: Segments) -> np.ndarray:
    """The reference: every row of every group, one slice assignment each."""
    out = dst.copy()
    for so, do, n, count, ss, ds in zip(*(c.tolist() for c in columns(seg))):
        for r in range(count):
            out[do + r * ds:do + r * ds + n] = src[so + r * ss:so + r * ss + n]
    return out


def apply_tiles(src: np.ndarray, dst: np.ndarray, tiles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the kernel does, in numpy; also how many times each destination byte was written."""
    out, writes = dst.copy(), np.zeros(len(dst), np.int32)
    for so, do, w, rows, sp, dp in tiles.tolist():
        for r in range(rows):
            out[do + r * dp:do + r * dp + w] = src[so + r * sp:so + r * sp + w]
            writes[do + r * dp:do + r * dp + w] += 1
    return out, writes


def columns(seg: Segments) -> tuple[np.ndarray, ...]:
    return seg.src_off, seg.dst_off, seg.nbytes, seg.count, seg.src_stride, seg.dst_stride


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), tile=st.sampled_from([256, 4096, 1 << 20]),
       row=st.sampled_from([64, 1000, 64 << 10]))
def test_tiles_copy_exactly_the_groups_each_byte_once(seed: int, tile: int, row: int) -> None:
    rng = np.random.default_rng(seed)
    seg = random_groups(rng, groups=12, max_rows=60, max_width=3000)
    src = rng.integers(0, 256, SRC, dtype=np.uint8)
    dst = rng.integers(0, 256, DST, dtype=np.uint8)
    t = strided.tiles(*columns(seg), tile_bytes=tile, row_bytes=row)
    got, writes = apply_tiles(src, dst, t)
    assert np.array_equal(got, apply_groups(src, dst, seg))
    assert writes.max() <= 1, "a byte written twice"
    assert int((t[:, 2] * t[:, 3]).sum()) == seg.total_bytes
    # every tile is at most one row or tile_bytes, and no row is wider than row_bytes (a warp's share)
    assert (t[:, 2] <= row).all()
    assert ((t[:, 3] == 1) | (t[:, 2] * t[:, 3] <= tile)).all()


def test_a_contiguous_run_becomes_even_rows_and_a_tail() -> None:
    t = strided.tiles(np.array([5]), np.array([7]), np.array([10_000]), np.array([1]), np.array([0]), np.array([0]),
                      tile_bytes=4096, row_bytes=1024)
    assert t[t[:, 2] == 1024, 3].sum() == 9 and (t[:, 2] == 10_000 - 9 * 1024).sum() == 1
    assert (t[:, 2] * t[:, 3] <= 4096).all()
    assert int((t[:, 2] * t[:, 3]).sum()) == 10_000


def test_empty_groups_make_no_tiles() -> None:
    z = np.zeros(0, np.uint64)
    assert strided.tiles(z, z, z, z, z, z).shape == (0, 6)
    one = np.ones(1, np.uint64)
    assert strided.tiles(one, one, np.zeros(1, np.uint64), one, one, one).shape == (0, 6)


@pytest.fixture(scope="module")
def torch_gpu() -> object:
    """torch with its CUDA context up, made before the leak check's window (the driver keeps a socket open
    for the process once initialised)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    torch.zeros(1, device="cuda:0")
    return torch


@pytest.mark.cuda
@pytest.mark.parametrize("aligned", [True, False])
def test_the_kernel_copies_every_tile_on_the_gpu(aligned: bool, torch_gpu: object) -> None:
    torch: Any = torch_gpu
    from tensorxfer.memory._copy import Copier, StridedCopy

    image = strided.kernel_image()
    assert image is not None, "strided_copy.fatbin was not built (nvcc missing at build time)"
    rng = np.random.default_rng(7 if aligned else 8)
    seg = random_groups(rng, groups=60, max_rows=300, max_width=20_000, aligned=aligned)
    src = rng.integers(0, 256, SRC, dtype=np.uint8)
    dst = rng.integers(0, 256, DST, dtype=np.uint8)
    d_src, d_dst = torch.from_numpy(src).cuda(), torch.from_numpy(dst).cuda()
    with Copier(0) as copier, StridedCopy(0, strided.tiles(*columns(seg)), image) as kernel:
        for _ in range(2):          # the uploaded table is reused
            kernel.launch(copier, d_dst.data_ptr(), d_src.data_ptr())
            copier.synchronize()
            assert np.array_equal(d_dst.cpu().numpy(), apply_groups(src, dst, seg))
        kernel.close()
        kernel.close()              # idempotent
        with pytest.raises(ValueError, match="closed"):
            kernel.launch(copier, d_dst.data_ptr(), d_src.data_ptr())


@pytest.mark.parametrize("seed", range(6))
def test_the_host_copy_copies_exactly_the_groups_split_or_not(seed: int) -> None:
    rng = np.random.default_rng(seed)
    seg = random_groups(rng, aligned=bool(seed % 2))
    src = rng.integers(0, 256, SRC, dtype=np.uint8)
    dst = rng.integers(0, 256, DST, dtype=np.uint8)
    want = apply_groups(src, dst, seg)
    whole = dst.copy()
    assert copy_groups(src, whole, *columns(seg)) == seg.total_bytes
    assert np.array_equal(whole, want)
    split = dst.copy()
    assert sum(copy_groups(src, split, *columns(seg), k, 3) for k in range(3)) == seg.total_bytes
    assert np.array_equal(split, want)


def test_the_host_copy_streams_whole_lines_at_every_alignment_and_nothing_past_a_row() -> None:
    """Rows are copied with plain stores up to the first 64-byte line of the destination, streamed stores
    for whole lines, plain stores for the rest (a strided group's rows under 1280 bytes: plain stores
    only): every start alignment and widths around those cuts."""
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    # 6 strided rows: past 1280 bytes a row's lines also prefetch the row ceil(4096 / width) later, so
    # rows with and without a row that far ahead are both copied
    for width in (1, 63, 64, 127, 128, 191, 192, 193, 255, 256, 1000, 1279, 1280, 2049, 4097):
        for shift in range(64):
            for src_shift in (0, 5):
                seg = Segments.of([src_shift, 2 * width + src_shift], [shift, shift + width + 3], [width, width],
                                  [1, 6], [0, 2 * width + 7], [0, width + 1])
                dst = rng.integers(0, 256, 1 << 15, dtype=np.uint8)
                want = apply_groups(src, dst, seg)
                assert copy_groups(src, dst, *columns(seg)) == 7 * width
                assert np.array_equal(dst, want), (width, shift, src_shift)

def test_a_streamed_copy_copies_every_byte_at_every_alignment_and_nothing_past_the_end() -> None:
    """``stream_copy`` (an ipc transfer's host pieces): plain stores up to the destination's first line,
    streamed whole lines, plain stores after, the source's lines 512 bytes on prefetched (at the very end
    past the buffer, which must not fault); from read-only memory; unequal lengths refused untouched."""
    rng = np.random.default_rng(11)
    src = rng.integers(0, 256, 1 << 14, dtype=np.uint8)
    src.flags.writeable = False
    for n in (0, 1, 63, 64, 127, 128, 129, 191, 192, 1000, 4097, 9000):
        for shift in (0, 1, 17, 63):
            for src_shift in (0, 5):
                dst = rng.integers(0, 256, n + 128, dtype=np.uint8)
                want = dst.copy()
                want[shift:shift + n] = src[src_shift:src_shift + n]
                assert stream_copy(dst[shift:shift + n], src[src_shift:src_shift + n]) == n
                assert np.array_equal(dst, want), (n, shift, src_shift)
    tail = np.frombuffer(memoryview(src)[-100:], dtype=np.uint8)    # prefetches run past the source's end
    out = np.zeros(100, dtype=np.uint8)
    assert stream_copy(out, tail) == 100 and np.array_equal(out, src[-100:])
    dst = np.zeros(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="lengths must be equal"):
        stream_copy(dst, src[:65])
    assert not dst.any()


def test_the_host_copy_refuses_a_group_past_either_buffer_and_copies_from_read_only_memory() -> None:
    src = np.arange(256, dtype=np.uint8)
    src.flags.writeable = False         # an imported mapping of the sender's memory is read-only
    dst = np.zeros(256, dtype=np.uint8)
    ok = Segments.of([0], [128], [16], [4], [32], [16])     # 4 rows of 16 bytes, every 32nd source byte
    assert copy_groups(src, dst, *columns(ok)) == 64
    assert np.array_equal(dst[128:192].reshape(4, 16), src[:128].reshape(4, 32)[:, :16])
    for bad in (Segments.of([250], [0], [16]),                      # past the source's end
                Segments.of([0], [0], [16], [2], [1 << 62], [16]),  # the second row's stride wraps
                Segments.of([0], [250], [16]),                      # past the destination's end
                Segments.of([0], [0], [16], [17], [0], [16])):      # 17 rows of 16 fill 272 > 256 bytes
        before = dst.copy()
        with pytest.raises(ValueError, match="reaches past"):
            copy_groups(src, dst, *columns(bad))
        assert np.array_equal(dst, before)
    with pytest.raises(ValueError):
        copy_groups(src, dst, *columns(ok), 0, 0)
    with pytest.raises(ValueError):
        copy_groups(src, dst, ok.src_off, ok.dst_off[:0], ok.nbytes, ok.count, ok.src_stride, ok.dst_stride)
