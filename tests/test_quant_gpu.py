"""The FP8 quantize kernels on the GPU give torch's bytes (the CPU reference of test_quant), shard by shard.

Also run under ``compute-sanitizer --tool memcheck`` on the device machine (benchmarks/results).
"""

from __future__ import annotations

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
