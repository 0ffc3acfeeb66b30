"""A pair on one GPU quantizes on the way: the tiles :func:`tensorxfer.sync.fusing.fuse` makes of a plan.

The planner's FP8 runs (the sources' quantized bytes) and the fused pair (byte runs left + quantizing
tiles, run here by a reference executor in torch's operations, the formula of the source path) must put the
same bytes into every target -- for uneven row cuts anywhere, column- and row-parallel targets, fused
targets, bf16 and float32 inputs, every formula the kernel computes.  The GPU kernel runs the same tiles on
the device (``tests/test_quant_gpu.py``, ``tests/test_sync_fp8.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="the sync's tensors are torch tensors")

from tensorxfer.errors import ProtocolError  # noqa: E402
from tensorxfer.manifest import Manifest  # noqa: E402
from tensorxfer.quant import kernel, tiles  # noqa: E402
from tensorxfer.quant.layout import FP8_MAX, Quantization  # noqa: E402
from tensorxfer.quant.quantize import block_amax, quantize_into, scales_of  # noqa: E402
from tensorxfer.sync import Box, Source, Target, chunk_box  # noqa: E402
from tensorxfer.sync.fusing import (  # noqa: E402
    early,
    fusable,
    fuse,
    fused_names,
    parts,
    segments_of,
)
from tensorxfer.sync.layout import AMAX_ENTRY, source_layout, target_description, target_tensors  # noqa: E402
from tensorxfer.sync.plan import plan  # noqa: E402
from tensorxfer.sync.quantizing import QuantizedShard, _AgreedAmaxes  # noqa: E402
from tensorxfer.transport.segments import Segments  # noqa: E402

FORMULA_OF = {code: pair for pair, code in kernel.FORMULAS.items()}
TORCH = {"BF16": torch.bfloat16, "F32": torch.float32}


def run_groups(s: Segments, src: np.ndarray, dst: np.ndarray) -> None:
    for a, b, n in s.runs():
        dst[b:b + n] = src[a:a + n]


def run_tiles(t: tiles.QuantTiles, src: np.ndarray, dst: np.ndarray, block: tuple[int, int]) -> list[int]:
    """The tiles in torch's operations on the host (what the kernel computes): the tiles that failed."""
    failed = []
    for i, row in enumerate(t.table.tolist()):
        size = tiles.INPUT_SIZES[row[tiles.DTYPE]]
        rows = [src[row[tiles.SRC] + r * row[tiles.SRC_PITCH]:][:row[tiles.COLS] * size]
                for r in range(row[tiles.ROWS])]
        x = torch.frombuffer(bytearray(np.concatenate(rows).tobytes()),
                             dtype=torch.bfloat16 if row[tiles.DTYPE] == 0 else torch.float32)
        x = x.reshape(row[tiles.ROWS], row[tiles.COLS]).float()
        amax = x.abs().max()
        if row[tiles.AMAX] >= 0:       # a shared block's part: the sources' agreed amax, from the source's region
            at = row[tiles.AMAX]
            agreed = torch.frombuffer(bytearray(src[at:at + 4].tobytes()), dtype=torch.float32)
            amax = torch.maximum(amax, agreed[0]) if torch.isfinite(agreed[0]) else agreed[0]
        if not torch.isfinite(amax):
            failed.append(i)
            continue
        formula, scale = FORMULA_OF[row[tiles.FORMULA]]
        mult, stored = scales_of(amax.reshape(1), Quantization(block, formula, scale))
        part = x[row[tiles.R0]:row[tiles.R1], row[tiles.C0]:row[tiles.C1]]
        fp8 = (part * mult).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        for r in range(fp8.shape[0]):
            at = row[tiles.DST] + r * row[tiles.DST_PITCH]
            dst[at:at + fp8.shape[1]] = fp8[r]
        if row[tiles.SCALE] >= 0:
            raw = stored.contiguous().view(torch.uint8).numpy()
            dst[row[tiles.SCALE]:row[tiles.SCALE] + len(raw)] = raw
    return failed


def reference(w: torch.Tensor, q: Quantization) -> tuple[torch.Tensor, torch.Tensor]:
    grid = q.grid(tuple(w.shape))
    values = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty(grid.scale_shape, dtype=torch.float8_e8m0fnu if q.scale == "e8m0" else torch.float32)
    quantize_into(w, grid, (0, 0), q, block_amax(w, grid, (0, 0)), values, scales)
    return values, scales


def put(region: np.ndarray, offset: int, t: torch.Tensor) -> None:
    raw = t.contiguous().view(torch.uint8).reshape(-1).numpy()
    region[offset:offset + len(raw)] = raw


def build(shapes: dict[str, tuple[int, int]], q: Quantization, cuts: list[int], dtype: str, m: int,
          split: dict[str, int], seed: int) -> dict[str, Any]:
    """Sources cut along rows at ``cuts`` (fractions of 1000), ``m`` targets split per tensor along ``split``."""
    g = torch.Generator().manual_seed(seed)
    full = {n: (torch.randn(s, generator=g) * 0.05).to(TORCH[dtype]) for n, s in shapes.items()}
    sources = []
    for a, b in zip([0, *cuts], [*cuts, 1000]):
        mine = {}
        for n, (rows, cols) in shapes.items():
            lo, hi = rows * a // 1000, rows * b // 1000
            mine[n] = Source(full[n][lo:hi].clone(), (rows, cols), Box((lo, 0), (hi - lo, cols)))
        sources.append(mine)
    targets = []
    for t in range(m):
        mine_t = {}
        for n, shape in shapes.items():
            d = split[n]
            box = chunk_box(shape, d, t, m)
            grid = q.grid(shape)
            cells = tuple(-(-box.sizes[k] // grid.block[k]) for k in range(2))
            scales = torch.zeros(cells, dtype=torch.float8_e8m0fnu if q.scale == "e8m0" else torch.float32)
            mine_t[n] = Target.shard(torch.zeros(box.sizes, dtype=torch.float8_e4m3fn), n, shape, d, t,
                                     m).quantized(q, scales)
        targets.append(mine_t)
    tmanifests = [Manifest.layout([(n, "F8_E4M3" if v.dtype == torch.float8_e4m3fn else
                                    ("F8_E8M0" if v.dtype == torch.float8_e8m0fnu else "F32"), tuple(v.shape))
                                   for n, v in target_tensors(tt).items()]) for tt in targets]
    tspecs = [target_description(tt, man, r) for r, (tt, man) in enumerate(zip(targets, tmanifests))]
    layouts = [source_layout(s, tspecs, inputs=True) for s in sources]
    sspecs = [lay.describe(r) for r, lay in enumerate(layouts)]
    return {"full": full, "sources": sources, "targets": targets, "tmanifests": tmanifests, "tspecs": tspecs,
            "layouts": layouts, "sspecs": sspecs}


def agreed_amaxes(full: torch.Tensor, q: Quantization, s: Source) -> tuple[QuantizedShard, np.ndarray]:
    """A source's shard as its quantizer holds it, and the agreed amaxes of the cells it shares with others
    (in its order): the global reference's."""
    shard = QuantizedShard("w", s.global_shape, s.box.offsets, q, s.tensor, None, None)
    amax = block_amax(full.float(), q.grid(s.global_shape), (0, 0))
    (f0, f1), (c0, c1) = shard.first, shard.count
    return shard, amax[f0:f0 + c0, f1:f1 + c1].reshape(-1)[torch.from_numpy(shard.shared_pos)].numpy()


def write_agreed(region: np.ndarray, lay: Any, full: dict[str, torch.Tensor], q: Quantization,
                 shards: dict[str, Source]) -> None:
    """The agreed amaxes of a source's shared blocks written into ``region`` by its quantizer's writer."""
    if AMAX_ENTRY not in lay.manifest or not lay.manifest[AMAX_ENTRY].nbytes:
        return
    entry = lay.manifest[AMAX_ENTRY]
    made = [agreed_amaxes(full[n], q, shards[n]) for n in lay.amax]
    for n, (shard, _) in zip(lay.amax, made):
        shard.agreed_at = lay.amax[n]
    view = torch.from_numpy(region[entry.offset:entry.offset + entry.nbytes]).view(torch.float32)
    _AgreedAmaxes(view, [m[0] for m in made]).write([m[1] for m in made])


def source_regions(case: dict[str, Any], q: Quantization) -> list[np.ndarray]:
    """Each source's region as the source path leaves it: its input, its FP8 values and scales (the agreed
    ones: the global reference's, cut to its shard), and the agreed amaxes of the blocks it shares, where its
    quantizer writes them (nothing else of that entry is written: a tile reading another place reads 0)."""
    out = []
    for lay, shards in zip(case["layouts"], case["sources"]):
        region = np.zeros(lay.manifest.nbytes, np.uint8)
        for n, entry in lay.inputs.items():
            put(region, lay.manifest[entry].offset, shards[n].tensor)
        write_agreed(region, lay, case["full"], q, shards)
        for i, (n, _, s) in enumerate(lay.quantized):
            values, scales = reference(case["full"][n], q)
            (r0, c0), (h, w) = s.box.offsets, s.box.sizes
            put(region, lay.manifest[lay.local(i, "values")].offset, values[r0:r0 + h, c0:c0 + w])
            grid = q.grid(s.global_shape)
            first, count = grid.cells(s.box.offsets, s.box.sizes)
            put(region, lay.manifest[lay.local(i, "scales")].offset,
                scales[first[0]:first[0] + count[0], first[1]:first[1] + count[1]])
        out.append(region)
    return out


@st.composite
def cases(draw: Any) -> tuple[Any, ...]:
    block = draw(st.sampled_from([(128, 128), (8, 16), (16, 8)]))
    pair = draw(st.sampled_from(sorted(kernel.FORMULAS)))
    q = Quantization(block, *pair)
    m = draw(st.integers(1, 3))
    shapes = {}
    split = {}
    for k in range(draw(st.integers(1, 3))):
        d = draw(st.integers(0, 1))
        whole = [draw(st.integers(1, 3)) * m * block[e] if e == d else
                 draw(st.integers(1, 3)) * block[e] - draw(st.sampled_from([0, 0, 3])) for e in range(2)]
        shapes[f"w{k}"] = (max(whole[0], 1), max(whole[1], 1))
        split[f"w{k}"] = d
    cuts = sorted(set(draw(st.lists(st.integers(1, 999), max_size=3))))
    return q, shapes, split, m, cuts, draw(st.sampled_from(["BF16", "F32"])), draw(st.integers(0, 1 << 16))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_fused_pairs_land_the_same_bytes_as_the_source_path(case: Any) -> None:
    fused_pairs_land_the_same_bytes(*case)


def test_a_replicated_scale_row_shared_between_two_sources_is_still_fused() -> None:
    # 3 row shards (torch.chunk), 2 TP targets: the planner takes w's block row 2 scales half from each of
    # sources 0 and 1, so source 0's run of scales ends mid-row (it was left on the source path: found on the H100)
    q, shapes, n, m = Quantization.blocks(), {"w": (1024, 512), "u": (512, 1536)}, 3, 2
    sources = [{k: Source(torch.zeros(chunk_box(s, 0, r, n).sizes, dtype=torch.bfloat16), s, chunk_box(s, 0, r, n))
                for k, s in shapes.items()} for r in range(n)]
    targets = [{k: Target.shard(torch.zeros(chunk_box(s, 0, t, m).sizes, dtype=torch.float8_e4m3fn), k, s, 0, t, m)
                .quantized(q, torch.zeros(s[0] // m // 128, -(-s[1] // 128))) for k, s in shapes.items()}
               for t in range(m)]
    mans = [Manifest.layout([(k, "F8_E4M3" if v.dtype == torch.float8_e4m3fn else "F32", tuple(v.shape))
                             for k, v in target_tensors(tt).items()]) for tt in targets]
    tspecs = [target_description(tt, man, r) for r, (tt, man) in enumerate(zip(targets, mans))]
    sspecs = [source_layout(src, tspecs, inputs=True).describe(r) for r, src in enumerate(sources)]
    p = plan(sspecs, tspecs)
    split = 0
    for s, spec in enumerate(sspecs):
        for t in range(m):
            segments = segments_of(p, s, t)
            split += int(((segments.nbytes % 16) != 0).sum())      # a run of float32 scales that ends mid-row
            pair = fuse(segments, fusable(spec))
            assert pair.fused == pair.read, (s, t)
    assert split        # the case this test is about


def test_a_run_across_rows_is_cut_into_its_rows() -> None:
    from tensorxfer.sync.fusing import _boxes

    # 11 float32 cells from cell (0, 2) of a 4-wide grid: the end of row 0, rows 1-2 whole, the start of row 3
    assert _boxes(8, 44, 1, 0, 1000, 0, 4, 4) == [(0, 2, 1, 2, 1000, 8), (1, 0, 2, 4, 1008, 16), (3, 0, 1, 1, 1040, 4)]
    assert _boxes(0, 32, 1, 0, 0, 0, 4, 4) == [(0, 0, 2, 4, 0, 16)]
    assert _boxes(2, 8, 1, 0, 0, 0, 4, 4) is None         # not on an element's edge


def fused_pairs_land_the_same_bytes(q: Quantization, shapes: dict[str, tuple[int, int]], split: dict[str, int],
                                    m: int, cuts: list[int], dtype: str, seed: int) -> None:
    c = build(shapes, q, cuts, dtype, m, split, seed)
    p = plan(c["sspecs"], c["tspecs"])
    srcs = source_regions(c, q)
    made = 0
    for t, man in enumerate(c["tmanifests"]):
        plain, fused = np.zeros(man.nbytes, np.uint8), np.zeros(man.nbytes, np.uint8)
        for s, spec in enumerate(c["sspecs"]):
            segments = segments_of(p, s, t)
            run_groups(segments, srcs[s], plain)
            pair = fuse(segments, fusable(spec))
            assert pair.fused == pair.read      # every run maps to boxes of the shards: nothing left behind
            pair.segments.check_within(len(srcs[s]), man.nbytes)
            run_groups(pair.segments, srcs[s], fused)
            if pair.segments.tiles is not None:
                assert not run_tiles(pair.segments.tiles, srcs[s], fused, q.block)   # type: ignore[arg-type]
                made += pair.segments.tiles.values_bytes
                assert pair.segments.total_bytes == segments.total_bytes
        assert np.array_equal(plain, fused), t
        for n in shapes:        # and both are the reference's bytes
            want_values, _ = reference(c["full"][n], q)
            box = chunk_box(shapes[n], split[n], t, m)
            got = torch.frombuffer(bytearray(fused[man[n].offset:man[n].offset + man[n].nbytes].tobytes()),
                                   dtype=torch.uint8).reshape(box.sizes)
            (r0, c0), (h, w) = box.offsets, box.sizes
            assert torch.equal(got, want_values[r0:r0 + h, c0:c0 + w].contiguous().view(torch.uint8)), (t, n)
    whole_rows = any(s.box.sizes[0] >= 2 * q.block[0] for src in c["sources"] for s in src.values())
    if whole_rows:
        assert made > 0


def test_a_tensor_every_pair_fuses_needs_no_whole_blocks_from_its_source() -> None:
    q = Quantization.blocks(8, 16)
    c = build({"w": (64, 48), "u": (40, 32)}, q, [300, 700], "BF16", 2, {"w": 0, "u": 1}, 1)
    p = plan(c["sspecs"], c["tspecs"])
    for s, spec in enumerate(c["sspecs"]):
        pairs = [fuse(segments_of(p, s, t), fusable(spec)) for t in range(2)]
        assert fused_names(pairs) == {pair for fp in pairs for pair in fp.read}
        # a target that does not fuse (another GPU) leaves every tensor it reads to the source
        mixed = [pairs[0], fuse(segments_of(p, s, 1), fusable(spec), enabled=False)]
        assert fused_names(mixed) == pairs[0].read - mixed[1].read
        assert mixed[1].segments.tiles is None and mixed[1].segments.digest == segments_of(p, s, 1).digest


def test_a_fused_pairs_step_is_its_whole_blocks_then_its_shared_blocks_and_runs() -> None:
    """``parts``: a fused pair is two parts -- the tiles of the blocks its source holds whole (offered before
    the source's amax round), then the tiles of the blocks it shares (they read the agreed amaxes) with its
    byte runs -- which together write what the pair did; any other pair is one part."""
    q = Quantization.blocks(8, 16)
    c = build({"w": (64, 48), "u": (40, 32), "v": (16, 32)}, q, [300, 700], "BF16", 2, {"w": 0, "u": 1, "v": 0}, 1)
    p = plan(c["sspecs"], c["tspecs"])
    split = 0
    for s, spec in enumerate(c["sspecs"]):
        for t in range(2):
            whole = fuse(segments_of(p, s, t), fusable(spec)).segments
            steps = parts(whole)
            assert whole.tiles is not None, (s, t)      # every tensor here is fused
            agreed = whole.tiles.agreed
            if agreed.all() or (not agreed.any() and not len(whole)):
                assert steps == (whole,) and early(steps) == (not agreed.any()), (s, t)
                continue
            split += 1
            first, rest = steps
            assert early(steps) and not early((rest,))
            assert len(first) == 0 and not first.tiles.agreed.any() and len(first.tiles) == (~agreed).sum()
            assert np.array_equal(first.tiles.table, whole.tiles.table[~agreed])
            assert rest.tiles is not None and np.array_equal(rest.tiles.table, whole.tiles.table[agreed])
            assert rest.tiles.agreed.all()
            assert all(np.array_equal(getattr(rest, f), getattr(whole, f)) for f in
                       ("src_off", "dst_off", "nbytes", "count", "src_stride", "dst_stride"))
            assert first.total_bytes + rest.total_bytes == whole.total_bytes
            assert len({first.digest, rest.digest, whole.digest}) == 3
    assert split, "no pair of the case had both whole and shared blocks"
    plain = segments_of(p, 0, 0)
    assert parts(plain) == (plain,) and not early((plain,))


def test_the_agreed_amaxes_a_source_writes_are_where_its_shared_blocks_tiles_read_them() -> None:
    """The contract between a source's quantizer and its pairs' tiles: every tile of a shared block reads its
    amax where the source's writer put that block's agreed amax, and no whole block's tile reads one."""
    q = Quantization.blocks(8, 16)
    c = build({"w": (64, 48), "u": (40, 32)}, q, [300, 550, 700], "F32", 2, {"w": 0, "u": 1}, 4)
    p = plan(c["sspecs"], c["tspecs"])
    read = 0
    for s, (spec, lay, shards) in enumerate(zip(c["sspecs"], c["layouts"], c["sources"])):
        region = np.zeros(lay.manifest.nbytes, np.uint8)
        write_agreed(region, lay, c["full"], q, shards)
        entry = lay.manifest[AMAX_ENTRY]
        written = {entry.offset + 4 * int(i) for i in np.flatnonzero(
            region[entry.offset:entry.offset + entry.nbytes].view(np.float32))}
        places: set[int] = set()
        for t in range(2):
            tl = fuse(segments_of(p, s, t), fusable(spec)).segments.tiles
            assert tl is not None
            table = tl.table
            whole = (table[:, tiles.ROWS] == q.block[0]) & (table[:, tiles.COLS] == q.block[1])
            assert not tl.agreed[whole].any(), (s, t)       # (the cases here: every whole block is a full one)
            places |= set(table[tl.agreed, tiles.AMAX].tolist())
        assert places == written, (s, sorted(places ^ written)[:4])     # the targets hold every block: all are read
        read += len(places)
    assert read


def test_the_tiles_change_the_pairs_runs_digest_and_a_nan_block_is_named() -> None:
    q = Quantization.blocks(8, 16)
    c = build({"w": (64, 48)}, q, [500], "F32", 1, {"w": 0}, 2)
    p = plan(c["sspecs"], c["tspecs"])
    spec = c["sspecs"][0]
    plain = segments_of(p, 0, 0)
    pair = fuse(plain, fusable(spec))
    assert pair.segments.tiles is not None and len(pair.segments.tiles)
    assert pair.segments.digest != plain.digest
    other = pair.segments.tiles.table.copy()      # the same runs, one tile written elsewhere: another digest
    other[0, tiles.DST] += 1
    s = pair.segments
    moved = Segments(s.src_off, s.dst_off, s.nbytes, s.count, s.src_stride, s.dst_stride,
                     tiles=tiles.QuantTiles(other, s.tiles.tensor, s.tiles.names))
    assert moved.digest != s.digest
    srcs = source_regions(c, q)
    lay = c["layouts"][0]
    entry = lay.manifest[lay.inputs["w"]]
    srcs[0][entry.offset + 4 * (48 * 9 + 5):][:4] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
    failed = run_tiles(pair.segments.tiles, srcs[0], np.zeros(c["tmanifests"][0].nbytes, np.uint8), q.block)
    assert failed and {pair.segments.tiles.tensor_of(i) for i in failed} == {"w"}


def test_a_tile_reaching_past_a_region_is_refused() -> None:
    q = Quantization.blocks(8, 16)
    c = build({"w": (64, 48)}, q, [500], "BF16", 1, {"w": 0}, 3)
    p = plan(c["sspecs"], c["tspecs"])
    pair = fuse(segments_of(p, 0, 0), fusable(c["sspecs"][0]))
    t = pair.segments.tiles
    assert t is not None
    t.check_within(c["layouts"][0].manifest.nbytes, c["tmanifests"][0].nbytes)
    # exactly at the ends of both regions: fits; a byte short of either: refused
    rows, cols = t.table[:, tiles.R1] - t.table[:, tiles.R0], t.table[:, tiles.C1] - t.table[:, tiles.C0]
    src_end = int((t.table[:, tiles.SRC] + (t.table[:, tiles.ROWS] - 1) * t.table[:, tiles.SRC_PITCH]
                   + t.table[:, tiles.COLS] * 2).max())
    dst_end = int(max((t.table[:, tiles.DST] + (rows - 1) * t.table[:, tiles.DST_PITCH] + cols).max(),
                      (t.table[:, tiles.SCALE] + 4).max()))
    t.check_within(src_end, dst_end)
    for sizes in ((src_end - 1, dst_end), (src_end, dst_end - 1)):
        with pytest.raises(ProtocolError, match="reaches past"):
            t.check_within(*sizes)
    with pytest.raises(ProtocolError, match="reaches past"):
        t.check_within(c["layouts"][0].manifest.nbytes, int(t.table[:, tiles.DST].max()))
    with pytest.raises(ProtocolError, match="reaches past"):
        pair.segments.check_within(int(t.table[:, tiles.SRC].max()), c["tmanifests"][0].nbytes)
    for column, value in ((tiles.SRC_PITCH, 1 << 62), (tiles.ROWS, 1 << 40), (tiles.DST, -8), (tiles.SCALE, -2),
                          (tiles.DTYPE, 7), (tiles.R1, 10**6),      # hostile columns: refused, never wrapped
                          (tiles.DST_PITCH, 0),                     # rows written over each other
                          (tiles.AMAX, -2), (tiles.AMAX, 6), (tiles.AMAX, 1 << 62)):   # an agreed amax: a float32
        bad = t.table.copy()
        bad[0, column] = value
        with pytest.raises(ProtocolError, match="reaches past"):
            tiles.QuantTiles(bad, t.tensor, t.names).check_within(1 << 62, 1 << 62)
    agreed = t.table.copy()         # a shared block's agreed amax is read from the source's region: inside it
    at = -(-src_end // 4) * 4       # (past every tile's elements)
    agreed[0, tiles.AMAX] = at
    tiles.QuantTiles(agreed, t.tensor, t.names).check_within(at + 4, dst_end)
    with pytest.raises(ProtocolError, match="reaches past"):
        tiles.QuantTiles(agreed, t.tensor, t.names).check_within(at + 3, dst_end)


def test_host_sources_and_tcp_never_carry_tiles() -> None:
    from tensorxfer.errors import TransportUnavailable

    q = Quantization.blocks(8, 16)
    c = build({"w": (64, 48)}, q, [500], "BF16", 1, {"w": 0}, 4)
    shards = c["sources"][0]
    assert not source_layout(shards, c["tspecs"]).inputs          # inputs only where pairs may fuse
    p = plan(c["sspecs"], c["tspecs"])
    pair = fuse(segments_of(p, 0, 0), fusable(c["sspecs"][0]))
    with pytest.raises(TransportUnavailable, match="ipc"):
        pair.segments.without_tiles()
    segments_of(p, 0, 0).without_tiles()


# ---- on the GPU: the kernel against the reference executor, and a sync that quantizes on the way ---------------


def _gpu() -> None:
    from tests.helpers import GPU_REASON

    if GPU_REASON is not None or not torch.cuda.is_available() or not tiles.available():
        pytest.skip(f"needs a CUDA GPU and the kernel image: {GPU_REASON or 'torch sees none, or no fatbin'}")


@pytest.mark.cuda
@pytest.mark.parametrize("block, shapes, dtype", [
    ((128, 128), {"w": (768, 384), "u": (300, 256)}, "BF16"),     # register tiles; a partial last block row
    ((128, 128), {"w": (512, 384)}, "F32"),
    ((8, 16), {"w": (64, 35), "u": (40, 96)}, "BF16"),            # small blocks; an odd width: the byte loops
    ((16, 8), {"w": (64, 45)}, "F32"),
], ids=["bf16-128", "f32-128", "bf16-small-odd", "f32-small"])
@pytest.mark.parametrize("formula", sorted(kernel.FORMULAS), ids=lambda f: "-".join(f))
def test_the_kernel_writes_the_reference_executors_bytes(block: Any, shapes: Any, dtype: str, formula: Any) -> None:
    _gpu()
    q = Quantization(block, *formula)
    c = build(shapes, q, [333, 700], dtype, 2, {n: i % 2 for i, n in enumerate(shapes)}, 5)
    p = plan(c["sspecs"], c["tspecs"])
    srcs = source_regions(c, q)
    stream = torch.cuda.current_stream()
    for s, spec in enumerate(c["sspecs"]):
        src = torch.from_numpy(srcs[s]).cuda()
        if s == 1:      # a NaN in one whole block, an infinity in another: both named, nothing of them written
            lay = c["layouts"][1]
            entry = lay.manifest[lay.inputs["w"]]
            size = 2 if dtype == "BF16" else 4
            bad = torch.tensor([float("nan"), float("inf")], dtype=TORCH[dtype]).view(torch.uint8).cuda()
            rows = c["sources"][1]["w"].box.sizes[0]
            src[entry.offset + size * (shapes["w"][1] * (rows // 2)):][:size] = bad[:size]
        for t in range(2):
            pair = fuse(segments_of(p, s, t), fusable(spec))
            if pair.segments.tiles is None:
                continue
            want = np.zeros(c["tmanifests"][t].nbytes, np.uint8)
            host_src = src.cpu().numpy()
            failed = run_tiles(pair.segments.tiles, host_src, want, block)
            got = torch.zeros(len(want), dtype=torch.uint8, device="cuda")
            dev = tiles.DeviceTiles(pair.segments.tiles, torch.cuda.current_device())
            dev.launch(stream.cuda_stream, got.data_ptr(), src.data_ptr())
            torch.cuda.synchronize()
            assert dev.failed() == (min(failed) if failed else None)
            assert np.array_equal(got.cpu().numpy(), want), (s, t)
            dev.close()


@pytest.mark.cuda
def test_adopted_gpu_sources_feed_fp8_targets_on_their_gpu_by_quantizing_on_the_way() -> None:
    _gpu()
    from tensorxfer.errors import QuantizationError
    from tests.test_sync import _catch, run_ranks
    from tests.test_sync_quantized import close, group, reference, same, step

    q = Quantization.blocks()
    shapes = {"w": (1024, 512), "u": (512, 1536)}
    n, m = 3, 2
    g = torch.Generator().manual_seed(7)
    w = {k: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}

    def shard(k: str, r: int) -> torch.Tensor:
        box = chunk_box(shapes[k], 0, r, n)
        return w[k][box.offsets[0]:box.offsets[0] + box.sizes[0]]
    sources = [{k: Source(shard(k, r).cuda(), shapes[k], chunk_box(shapes[k], 0, r, n)) for k in shapes}
               for r in range(n)]
    targets = [{k: Target.shard(torch.zeros(chunk_box(s, 0, t, m).sizes, dtype=torch.float8_e4m3fn, device="cuda"),
                                k, s, 0, t, m).quantized(q, torch.zeros(s[0] // m // 128, -(-s[1] // 128),
                                                                        device="cuda"))
                for k, s in shapes.items()} for t in range(m)]
    syncs = group(sources, targets, "ipc")

    def failing_step() -> list[Any]:
        """Every rank's outcome of a step expected to fail (the sources', then the targets')."""
        return [r[0] for r in run_ranks([lambda s=s: [_catch(s.push)] for s in syncs[:n]] +
                                        [lambda t=t: [_catch(lambda: t.wait(timeout=30))] for t in syncs[n:-1]])]

    def clean_step() -> None:
        """A step every target lands, with the reference's FP8 bytes and scales of the weights ``w``."""
        results = step(syncs, n)
        assert all(isinstance(v, int) for v in results[n:]), results
        for k in shapes:
            want_values, want_scales = reference(w[k], q)
            assert same(torch.cat([targets[t][k].tensor for t in range(m)]).cpu(), want_values)
            assert same(torch.cat([targets[t][k].scales for t in range(m)]).cpu(), want_scales)
    try:
        for version in (1, 2):
            if version == 2:
                for r in range(n):
                    for k in shapes:
                        sources[r][k].tensor.mul_(-1.5)
                w = {k: t * -1.5 for k, t in w.items()}
            results = step(syncs, n)
            assert results[n:] == [version] * m
            for k in shapes:
                want_values, want_scales = reference(w[k], q)
                assert same(torch.cat([targets[t][k].tensor for t in range(m)]).cpu(), want_values)
                assert same(torch.cat([targets[t][k].scales for t in range(m)]).cpu(), want_scales)
        for st in results[:n]:     # the sources made no FP8: the pairs made all of it, shared blocks too
            qs = st.quantized
            assert qs.fused_bytes > 0 and qs.values_bytes == 0 and qs.shared_blocks > 0, qs
        # a NaN in a whole block of source 1: the step fails naming the tensor, and the next push lands
        sources[1]["w"].tensor[200, 7] = float("nan")
        got = failing_step()
        assert any(isinstance(r, QuantizationError) and r.tensor == "w" for r in got), got
        sources[1]["w"].tensor.copy_(shard("w", 1).cuda())     # w is the step's weights already
        clean_step()
        # each fused pair's step is its whole blocks' tiles (offered before the sources' amax round), then the rest
        assert any(len(p) == 2 and early(p) for sync in syncs[:n] for p in sync._segments.values())
        # a NaN in a block source 0 shares with source 1 (rows 256-383; source 0 ends at row 342): found in the
        # round, after the tiles went out; the targets those sources feed fail naming it, the next push lands
        sources[0]["w"].tensor[300, 7] = float("nan")
        got = failing_step()
        assert isinstance(got[0], QuantizationError) and got[0].tensor == "w", got
        assert all(isinstance(r, QuantizationError) and r.tensor == "w" for r in got[n:]), got[n:]
        sources[0]["w"].tensor.copy_(shard("w", 0).cuda())
        clean_step()
    finally:
        close(syncs)


def test_a_tensor_also_served_plain_is_quantized_on_the_way_from_its_plain_entry() -> None:
    q = Quantization.blocks(8, 16)
    shape = (64, 48)
    w = torch.randn(shape).to(torch.bfloat16)
    sources = [{"w": Source(w[:40].clone(), shape, Box((0, 0), (40, 48)))},
               {"w": Source(w[40:].clone(), shape, Box((40, 0), (24, 48)))}]
    targets = [{"w": Target.shard(torch.zeros(32, 48, dtype=torch.float8_e4m3fn), "w", shape, 0, 0, 2)
                .quantized(q, torch.zeros(4, 3))},
               {"w": Target.shard(torch.zeros(64, 48, dtype=torch.bfloat16), "w", shape, 0, 0, 1)}]
    mans = [Manifest.layout([("w", "F8_E4M3", (32, 48)), ("w_scale_inv", "F32", (4, 3))]),
            Manifest.layout([("w", "BF16", (64, 48))])]
    tspecs = [target_description(t, m, r) for r, (t, m) in enumerate(zip(targets, mans))]
    lay = source_layout(sources[0], tspecs, inputs=True)
    assert lay.inputs == {"w": "w"} and "w" in lay.plain      # one entry, adopted once: the plain one
    found = fusable(lay.describe(0))
    assert len(found) == 1 and next(iter(found.values())).input_offset == lay.manifest["w"].offset


def test_a_member_record_carries_its_device_and_refuses_one_that_is_no_device_digest() -> None:
    from tensorxfer.errors import StoreError
    from tensorxfer.sync.records import SpecRef

    ref = SpecRef("ab" * 32, ("127.0.0.1", 5), "0123456789abcdef01234567")
    assert SpecRef.decode("k", ref.encode()) == ref
    assert SpecRef.decode("k", SpecRef("ab" * 32, None).encode()).device is None      # no GPU pair: none
    for device in ("0123", "../../etc", 7, "0123456789ABCDEF01234567"):
        with pytest.raises(StoreError, match="device"):
            SpecRef.decode("k", SpecRef("ab" * 32, None, device).encode())      # type: ignore[arg-type]
