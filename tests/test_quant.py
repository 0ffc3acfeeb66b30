"""The quantization contract: FP8 values and scales bit-identical to the references each formula names.

``transformers``: Hugging Face transformers' own fine-grained FP8 quantizer is run here and compared byte
for byte.  ``deepgemm``: DeepGEMM's ``per_block_cast_to_fp8`` (vLLM and SGLang use it) is not installed;
its formula is transcribed below from its source (deep_gemm/utils/math.py) as an independent reference.
Shards are quantized piecewise with their shared blocks' amaxes merged, as sync sources do, and must
give the same bytes as the whole tensor at once.
"""

from __future__ import annotations

import itertools
import types

import pytest

torch = pytest.importorskip("torch", reason="the quantizer runs on torch")

from tensorxfer.errors import PlanError, QuantizationError  # noqa: E402
from tensorxfer.quant import Quantization, derived_name, parse_derived  # noqa: E402
from tensorxfer.quant.quantize import block_amax, quantize_into  # noqa: E402
from tensorxfer.sync import Box, Piece, TargetTensor  # noqa: E402
from tensorxfer.sync.quantized_spec import quantized_target  # noqa: E402


def quantize(w: torch.Tensor, q: Quantization, cuts: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` quantized as row shards cut at ``cuts`` would be: each shard's amaxes, merged, then each
    shard quantized on its own (the scales written by every shard that touches a block)."""
    grid = q.grid(tuple(w.shape))
    values = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scales = torch.empty(grid.scale_shape, dtype=torch.float8_e8m0fnu if q.scale == "e8m0" else torch.float32,
                         device=w.device)
    edges = [0, *cuts, w.shape[0]]
    shards = [(a, w[a:b]) for a, b in itertools.pairwise(edges) if b > a]
    offsets = [(a,) + (0,) * (w.dim() - 1) for a, _ in shards]
    whole = block_amax(w, grid, (0,) * w.dim())
    merged = torch.zeros_like(whole)
    for (_, shard), off in zip(shards, offsets):
        first, count = grid.cells(off, tuple(shard.shape))
        part = block_amax(shard, grid, off)
        index = tuple(slice(f, f + c) for f, c in zip(first, count))
        merged[index] = torch.maximum(merged[index], part)
    assert torch.equal(merged, whole)
    for (a, shard), off in zip(shards, offsets):
        first, count = grid.cells(off, tuple(shard.shape))
        index = tuple(slice(f, f + c) for f, c in zip(first, count))
        quantize_into(shard, grid, off, q, merged[index].clone(), values[a:a + shard.shape[0]], scales[index])
    return values, scales


def transformers_reference(w: torch.Tensor, scale_fmt: str, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor,
                                                                                                        torch.Tensor]:
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    extra = {} if scale_fmt == "float" else {"scale_fmt": "ue8m0"}
    config = FineGrainedFP8Config(weight_block_size=list(block), **extra)
    out = Fp8Quantize(types.SimpleNamespace(quantization_config=config)).convert({"w.weight": w})
    return out["w.weight"], out["w.weight_scale_inv"]


def deepgemm_reference(w: torch.Tensor, bm: int, bn: int, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's per_block_cast_to_fp8, transcribed: zero-pad to whole blocks, amax in float32 clamped
    at 1e-4, sf = amax / 448 (rounded up to a power of two on its bits for ue8m0), x * (1 / sf)."""
    m, n = w.shape
    pm, pn = -(-m // bm) * bm, -(-n // bn) * bn
    padded = torch.zeros(pm, pn, dtype=w.dtype)
    padded[:m, :n] = w
    view = padded.view(pm // bm, bm, pn // bn, bn)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = amax / 448.0
    if ue8m0:
        bits = sf.view(torch.int32)
        exponent = ((bits >> 23) & 0xFF) + (bits & 0x7FFFFF).bool().int()
        sf = (exponent.clamp(1, 254) << 23).view(torch.float32)
    scaled = (view * (1.0 / sf)).to(torch.float8_e4m3fn)
    return scaled.view(pm, pn)[:m, :n].contiguous(), sf.view(pm // bm, pn // bn)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def weight(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.03
    w[:128, :128] = 0                       # an all-zero block
    w[130, 7] = 3.0                         # an outlier: its block's other values shrink to subnormals
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale", ["float", "e8m0"])
@pytest.mark.parametrize("block, cuts", [((128, 128), ()), ((128, 128), (171, 342)), ((128, 128), (100, 101, 300)),
                                         ((1, 128), (171, 342))])        # 1536 blocks: every scale's rounding
def test_transformers_formula_is_transformers_own_quantizer_byte_for_byte(dtype, scale, block, cuts) -> None:
    w = weight((512, 384), dtype)
    want_values, want_scales = transformers_reference(w, "float" if scale == "float" else "ue8m0", block)
    values, scales = quantize(w, Quantization(block, "transformers", scale), cuts)
    assert same_bytes(values, want_values)
    assert same_bytes(scales, want_scales)
    if scale == "float":        # an all-zero block: scale 1, zero bytes (transformers' rule)
        assert scales[0, 0].item() == 1.0 and not values[:128, :128].view(torch.uint8).any()


@pytest.mark.parametrize("shape", [(512, 384), (300, 200)])      # the second: partial edge blocks
@pytest.mark.parametrize("block", [(128, 128), (1, 128)])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_deepgemm_formula_is_per_block_cast_to_fp8_byte_for_byte(shape, block, ue8m0) -> None:
    w = weight(shape, torch.bfloat16, seed=1)
    want_values, want_scales = deepgemm_reference(w, *block, ue8m0)
    values, scales = quantize(w, Quantization(block, "deepgemm", "e8m0" if ue8m0 else "float"), (97, 211))
    assert same_bytes(values, want_values)
    if ue8m0:
        assert torch.equal(scales.float(), want_scales)
    else:
        assert same_bytes(scales, want_scales)


@pytest.mark.parametrize("q, scale_shape", [(Quantization.per_tensor(), (1,)), (Quantization.per_channel(), (300, 1)),
                                            (Quantization.mxfp8(), (300, 7))])
def test_per_tensor_per_channel_and_mxfp8_follow_the_same_formula_over_their_blocks(q, scale_shape) -> None:
    w = weight((300, 200), torch.float32, seed=2)
    values, scales = quantize(w, q, (150,))
    assert tuple(scales.shape) == scale_shape
    if q.scale == "e8m0":       # MXFP8: deepgemm's rule over 1 x 32 blocks
        want_values, want_scales = deepgemm_reference(w, 1, 32, True)
        assert same_bytes(values, want_values) and torch.equal(scales.float(), want_scales)
        return
    # transformers' rule over the whole tensor / each row: s = 448 / amax, x * s, scale_inv = 1 / s
    amax = w.abs().amax() if q.block == () else w.abs().amax(dim=1, keepdim=True)
    s = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
    assert same_bytes(values, (w * s).clamp(-448, 448).to(torch.float8_e4m3fn))
    assert torch.equal(scales, (1.0 / s).reshape(scale_shape))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nan_or_an_infinity_is_an_error_naming_the_tensor_and_its_block(bad) -> None:
    w = weight((256, 256), torch.bfloat16)
    w[200, 140] = bad
    grid = Quantization.blocks().grid((256, 256))
    with pytest.raises(QuantizationError, match=r"'layers.0.w'.*\[128:256, 128:256\]") as info:
        from tensorxfer.quant.quantize import check_finite
        check_finite(block_amax(w, grid, (0, 0)), "layers.0.w", grid, (0, 0))
    assert info.value.tensor == "layers.0.w"


def test_layouts_have_one_canonical_name_and_refuse_what_is_not_one() -> None:
    for q in (Quantization.blocks(), Quantization.blocks(1, 128, "deepgemm"), Quantization.per_channel(),
              Quantization.per_tensor(), Quantization.mxfp8()):
        assert Quantization.from_tag(q.tag) == q
        assert parse_derived(derived_name("model.w", q, "scales")) == ("model.w", q, "scales")
    assert parse_derived("model.w") is None
    for bad in ("F8_E4M3/128x128/transformers", "F8_E4M3/0128x128/transformers/float", "F8_E5M2/1x1/deepgemm/float",
                "F8_E4M3/128x128/mine/float", "F8_E4M3/-1x128/transformers/float"):
        with pytest.raises(PlanError):
            Quantization.from_tag(bad)
    for bad_q in [dict(block=(0, 128)), dict(formula="torchao"), dict(scale="e4m3"), dict(block=(1.5,))]:
        with pytest.raises(PlanError):
            Quantization(**bad_q)
    with pytest.raises(PlanError, match="do not fit"):
        Quantization((1, 128, 128)).grid((256, 256))


def test_every_value_a_bf16_weight_can_scale_to_rounds_as_torch_casts_it() -> None:
    """All 65536 bf16 patterns times scales that land them on and between every FP8 value, subnormals and
    ties included, quantized shard-wise, against torch's own cast (test_quant_gpu runs the kernels on it)."""
    from tensorxfer.quant.quantize import quantize_into

    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    every = every[torch.isfinite(every)]
    q = Quantization((1, 128), "deepgemm")
    for amax in (448.0, 1.0, 3e-3, 2.0 ** -7, 1e-30):
        rows = every.clamp(-amax, amax)
        rows = torch.nn.functional.pad(rows, (0, -len(rows) % 128)).reshape(-1, 128)
        rows[:, 0] = amax                       # every row's amax: one scale for all
        grid = q.grid(tuple(rows.shape))
        values = torch.empty(rows.shape, dtype=torch.float8_e4m3fn)
        scales = torch.empty(grid.scale_shape)
        quantize_into(rows, grid, (0, 0), q, block_amax(rows, grid, (0, 0)), values, scales)
        want = (rows * (1.0 / scales)).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert same_bytes(values, want), amax


def fp8_target(pieces: list[Piece], shape: tuple[int, ...], q: Quantization, scale_shape: tuple[int, ...],
               shapes: list[tuple[int, ...]]) -> tuple[TargetTensor, TargetTensor]:
    return quantized_target(TargetTensor("qkv", shape, "F8_E4M3", 0, tuple(pieces)), shapes, q, "qkv_scale_inv",
                            scale_shape, 1 << 20)


def test_a_fused_target_maps_each_parts_blocks_into_its_own_scale_grid() -> None:
    q = Quantization.blocks()
    pieces = [Piece("q", Box((256, 0), (256, 512)), (0, 0)), Piece("k", Box((128, 0), (128, 512)), (256, 0))]
    values, scales = fp8_target(pieces, (384, 512), q, (3, 4), [(512, 512), (256, 512)])
    assert [p.source_name for p in values.pieces] == [derived_name("q", q, "values"), derived_name("k", q, "values")]
    assert [(p.source_box, p.at) for p in scales.pieces] == [(Box((2, 0), (2, 4)), (0, 0)),
                                                            (Box((1, 0), (1, 4)), (2, 0))]
    assert scales.dtype == "F32" and scales.local_shape == (3, 4)


@pytest.mark.parametrize("pieces, shapes, scale_shape, match", [
    ([Piece("w", Box((64, 0), (128, 256)), (0, 0))], [(512, 256)], (1, 2), "does not hold whole blocks"),
    ([Piece("w", Box((0, 0), (100, 256)), (0, 0))], [(512, 256)], (1, 2), "does not hold whole blocks"),
    ([Piece("w", Box((0, 0), (128, 256)), (0, 0))], [(512, 256)], (1, 3), r"needs \(1, 2\)"),
    ([Piece("w", Box((0, 0), (128, 256)), (0, 0))], [(64, 256)], (1, 2), "outside"),
])
def test_a_target_whose_layout_cannot_hold_its_blocks_is_refused_naming_what(pieces, shapes, scale_shape,
                                                                           match) -> None:
    with pytest.raises(PlanError, match=match):
        fp8_target(pieces, (128, 256), Quantization.blocks(), scale_shape, shapes)


def test_a_row_parallel_shard_of_per_channel_scales_holds_every_rows_one_scale() -> None:
    q = Quantization.per_channel()
    _values, scales = quantized_target(
        TargetTensor("o", (512, 100), "F8_E4M3", 0, (Piece("o", Box((0, 100), (512, 100)), (0, 0)),)),
        [(512, 200)], q, "o_scale_inv", (512, 1), 1 << 20)
    assert [(p.source_box, p.at) for p in scales.pieces] == [(Box((0, 0), (512, 1)), (0, 0))]
