"""The FP8 quantize kernels on the GPU give torch's bytes (the CPU reference of test_quant), shard by shard.

Also run under ``compute-sanitizer --tool memcheck`` on the device machine (benchmarks/results).
"""

from __future__ import annotations

import itertools

import pytest

from tests.helpers import GPU_REASON

torch = pytest.importorskip("torch", reason="the quantizer runs on torch")

from tensorxfer.errors import QuantizationError  # noqa: E402
from tensorxfer.quant import Quantization, kernel  # noqa: E402
from tensorxfer.quant.quantize import block_amax, check_finite, quantize_into  # noqa: E402
from tests.test_quant import quantize, same_bytes, weight  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(GPU_REASON is not None or not torch.cuda.is_available(),
                                                   reason=f"needs a CUDA GPU: {GPU_REASON or 'torch sees none'}")]


@pytest.mark.parametrize("q", [Quantization.blocks(), Quantization.blocks(128, 128, "deepgemm"),
                               Quantization((128, 128), "deepgemm", "e8m0"), Quantization((64, 32), "deepgemm")],
                         ids=lambda q: q.tag.replace("/", "-"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape, cuts", [((512, 384), (171, 342)), ((300, 200), (97,)), ((1000, 4096), (333, 667))])
def test_the_kernels_give_torchs_bytes_shard_by_shard(q, dtype, shape, cuts) -> None:
    w = weight(shape, dtype, seed=4)
    want_values, want_scales = quantize(w, q, cuts)          # torch's operations on the CPU
    grid = q.grid(shape)
    assert kernel.fits(w.cuda(), grid) and kernel.computes(q), "the kernel path is not taken"
    got_values, got_scales = quantize(w.cuda(), q, cuts)
    assert same_bytes(got_values.cpu(), want_values)
    assert same_bytes(got_scales.cpu(), want_scales)


def test_the_kernels_amax_flags_a_nan_and_an_infinity() -> None:
    q = Quantization.blocks()
    grid = q.grid((512, 256))
    for bad in (float("nan"), float("inf")):
        w = weight((512, 256), torch.bfloat16).cuda()
        w[300, 200] = bad
        amax = block_amax(w, grid, (0, 0))
        with pytest.raises(QuantizationError, match=r"\[256:384, 128:256\]"):
            check_finite(amax, "w", grid, (0, 0))


def test_a_huge_tensor_quantizes_without_a_float32_copy() -> None:
    """The kernels allocate nothing the size of the shard (torch's path allocates 3 float32 copies of it)."""
    q = Quantization.blocks()
    w = torch.randn(8192, 8192, device="cuda").to(torch.bfloat16)
    grid = q.grid(tuple(w.shape))
    values = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device="cuda")
    scales = torch.empty(grid.scale_shape, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    quantize_into(w, grid, (0, 0), q, block_amax(w, grid, (0, 0)), values, scales)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 4 << 20


def test_one_table_of_many_mixed_shards_gives_torchs_bytes_in_two_launches() -> None:
    """A source's table: bf16 and fp32 shards, three formulas, cut along rows and columns anywhere (columns at
    odd offsets take the kernels' one-element path, the rest 16-byte loads).  The amax launch quantizes the
    cells a shard holds whole; the quantize launch, given the merged amaxes, the listed shared ones."""
    from tensorxfer.quant.kernel import ShardTable
    from tensorxfer.quant.quantize import torch_block_amax
    from tensorxfer.sync.quantizing import QuantizedShard

    cases = [((1000, 4096), torch.bfloat16, Quantization.blocks(), (333, 667), (0, 2048, 3001)),
             ((512, 384), torch.float32, Quantization.blocks(128, 128, "deepgemm"), (171,), (0, 128, 200)),
             ((300, 200), torch.bfloat16, Quantization((128, 128), "deepgemm", "e8m0"), (97,), (0,)),
             ((640, 256), torch.bfloat16, Quantization((64, 32), "deepgemm"), (100, 101), (0, 37))]
    shards, wanted = [], []
    for n, (shape, dtype, q, row_cuts, col_starts) in enumerate(cases):
        w = weight(shape, dtype, seed=n)
        wanted.append(quantize(w, q))           # the whole tensor, torch's operations on the CPU
        grid = q.grid(shape)
        rows = [0, *row_cuts, shape[0]]
        cols = [*col_starts, shape[1]]
        for r0, r1 in itertools.pairwise(rows):
            for c0, c1 in itertools.pairwise(cols):
                x = w[r0:r1, c0:c1].contiguous().cuda()
                count = grid.cells((r0, c0), tuple(x.shape))[1]
                values = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda")
                scales = torch.empty(count, dtype=torch.uint8 if q.scale == "e8m0" else torch.float32, device="cuda")
                shards.append((n, QuantizedShard(f"w{n}", shape, (r0, c0), q, x, values, scales)))
    table = ShardTable([(s.local, s.grid, s.offsets, s.q, s.values, s.scales) for _, s in shards])
    table.amaxes(quantize_whole=True)
    torch.cuda.synchronize()
    shared = []
    for i, (n, s) in enumerate(shards):
        assert torch.equal(table.view(i).cpu(), torch_block_amax(s.local.cpu(), s.grid, s.offsets)), s.offsets
        whole = torch_block_amax(weight(cases[n][0], cases[n][1], seed=n), s.grid, (0, 0))
        index = tuple(slice(f, f + c) for f, c in zip(s.first, s.count))
        table.view(i).copy_(whole[index])       # every block's amax over the whole block (the agreed ones)
        shared += [table.starts[i] + int(p) for p in s.shared_pos]
    table.quantize(torch.tensor(shared, dtype=torch.int64, device="cuda"))
    assert shared and len(shared) < table.cells       # both launches had work
    for n, s in shards:
        want_values, want_scales = wanted[n]
        (r0, c0), (h, w) = s.offsets, s.sizes
        assert same_bytes(s.values.cpu(), want_values[r0:r0 + h, c0:c0 + w]), (n, s.offsets)
        index = tuple(slice(f, f + c) for f, c in zip(s.first, s.count))
        assert same_bytes(s.scales.cpu(), want_scales[index].contiguous().view(s.scales.dtype)), (n, s.offsets)
