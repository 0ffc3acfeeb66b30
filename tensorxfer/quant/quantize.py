"""The quantizer: a shard's block amaxes, and its FP8 values and scales once the amaxes are known.

Torch operations on the shard's own device (CPU or GPU), float32 throughout, so the bytes equal the
formula's reference (:mod:`tensorxfer.quant.layout`).  A shard is a box of its global tensor; blocks
are counted from the global origin, so the shard's first and last block along a dimension may be
*partial* (a neighbouring shard holds the rest).  Two steps, so that the sources sharing a block can
agree on its amax in between:

1. :func:`block_amax` -- per block the shard touches, the largest ``|x|`` over its part of it;
2. :func:`quantize_into` -- given every block's amax over the whole block (the shard's own where the
   block is whole in it, the maximum over the sharing shards where not), the FP8 values of the shard
   and the scales of its blocks, written into the caller's tensors.

Memory: a float32 copy of the shard and the scale expanded to it, transient (one tensor at a time).  On a
GPU, 2-D shards take two kernels instead (:mod:`tensorxfer.quant.kernel`: no transient memory, the same
bytes).  On a host torch's vectorized operations are the fast path: a C loop per weight (two passes, the
cast written out) measured 10.9 ns per weight on the dev VM's shards against torch's 2.1, and was dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tensorxfer.errors import QuantizationError
from tensorxfer.quant import kernel
from tensorxfer.quant.layout import FP8_MAX, Grid, Quantization

__all__ = ["block_amax", "check_finite", "quantize_into", "scales_of", "torch_block_amax", "torch_quantize_into"]

DEEPGEMM_AMAX_FLOOR = 1e-4      # DeepGEMM's clamp of a block's amax (an all-zero block's scale)


def _split(o: int, s: int, b: int) -> list[int]:
    """Lengths of the shard's pieces of consecutive blocks along one dimension: a partial first block,
    whole blocks, a partial last one."""
    front = min((b - o % b) % b, s)
    full, tail = divmod(s - front, b)
    return ([front] if front else []) + [b] * full + ([tail] if tail else [])


def _dims(grid: Grid, offsets: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    return [_split(o, s, b) for o, s, b in zip(offsets, sizes, grid.block)]


def block_amax(x: Any, grid: Grid, offsets: Sequence[int]) -> Any:
    """float32 tensor of the grid cells the shard ``x`` (a box at ``offsets``) touches: per cell, the
    largest ``|x|`` of the shard's part of it (NaN where a NaN is, inf where an infinity is)."""

    if kernel.fits(x, grid):
        return kernel.block_amax(x.detach(), grid, tuple(offsets))
    return torch_block_amax(x, grid, offsets)


def torch_block_amax(x: Any, grid: Grid, offsets: Sequence[int]) -> Any:
    """:func:`block_amax` in torch's operations (what any shard can take; what users write today)."""
    import torch

    a = x.detach().abs()
    for d, lengths in enumerate(_dims(grid, offsets, tuple(x.shape))):
        b = grid.block[d]
        if lengths == [a.shape[d]] and len(lengths) == 1:
            a = a.amax(dim=d, keepdim=True)
            continue
        parts, at = [], 0
        i = 0
        while i < len(lengths):
            if lengths[i] == b:          # a run of whole blocks: one reshape
                j = i
                while j < len(lengths) and lengths[j] == b:
                    j += 1
                n = j - i
                parts.append(a.narrow(d, at, n * b).unflatten(d, (n, b)).amax(dim=d + 1))
                at, i = at + n * b, j
            else:
                parts.append(a.narrow(d, at, lengths[i]).amax(dim=d, keepdim=True))
                at, i = at + lengths[i], i + 1
        a = torch.cat(parts, dim=d) if len(parts) > 1 else parts[0]
    out = a.float()
    return out.reshape(1) if grid.per_tensor else out


def check_finite(amax: Any, name: str, grid: Grid, first: Sequence[int]) -> None:
    """QuantizationError naming ``name`` and its first block holding a NaN or an infinity."""
    import torch

    bad = ~torch.isfinite(amax)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        cell = tuple(f + w for f, w in zip(first, where))
        rows = ", ".join(f"{c * b}:{min((c + 1) * b, n)}" for c, b, n in zip(cell, grid.block, grid.shape))
        what = "a NaN" if bool(torch.isnan(amax).any()) else "an infinity"
        raise QuantizationError(
            f"tensor {name!r} holds {what} (first in its block [{rows}]): FP8 cannot carry it, so the step is "
            f"refused before any of its bytes were sent; fix the trainer's weights (the next push goes on)", name)


def _ceil_pow2_bits(x: Any) -> Any:
    """DeepGEMM's ``ceil_to_ue8m0``: the power of two at or above ``x`` (> 0), from its float32 bits."""
    import torch

    bits = x.float().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent.clamp(1, 254) << 23).view(torch.float32)


def scales_of(amax: Any, q: Quantization) -> tuple[Any, Any]:
    """``(multiplier, stored)`` from whole-block amaxes: the float32 factor the values are multiplied by,
    and the scale as stored (float32 ``scale_inv``, or e8m0 bytes as ``torch.float8_e8m0fnu``)."""
    import torch

    amax = amax.float()
    if q.formula == "transformers":
        positive = amax > 0
        s = torch.where(positive, FP8_MAX / torch.where(positive, amax, torch.ones_like(amax)),
                        torch.ones_like(amax))
        inv = 1.0 / s
        if q.scale == "e8m0":
            inv = torch.pow(2.0, torch.ceil(torch.log2(inv.clamp(min=torch.finfo(torch.float32).tiny))))
            stored = inv.to(torch.float8_e8m0fnu)
            return 1.0 / stored.float(), stored
        return s, inv
    sf = amax.clamp(min=DEEPGEMM_AMAX_FLOOR) / FP8_MAX
    if q.scale == "e8m0":
        sf = _ceil_pow2_bits(sf)
        return 1.0 / sf, sf.to(torch.float8_e8m0fnu)
    return 1.0 / sf, sf


def quantize_into(x: Any, grid: Grid, offsets: Sequence[int], q: Quantization, amax: Any, values: Any,
                  scales: Any | None = None) -> None:
    """Write shard ``x``'s FP8 values into ``values`` (``x``'s shape, float8_e4m3fn) and its cells'
    scales into ``scales`` (the cells' shape, the layout's scale dtype; None: not wanted), given
    ``amax``: each cell's amax over its WHOLE block (:func:`block_amax`'s shape)."""
    import torch

    if (kernel.fits(x, grid) and kernel.computes(q) and values.device == x.device and values.is_contiguous()
            and (scales is None or (scales.device == x.device and scales.is_contiguous()))):
        if scales is None:
            scales = torch.empty(amax.shape, dtype=torch.float32 if q.scale == "float" else torch.uint8,
                                 device=x.device)
        kernel.quantize_into(x.detach(), grid, tuple(offsets), q, amax, values, scales)
        return
    torch_quantize_into(x, grid, offsets, q, amax, values, scales)


def torch_quantize_into(x: Any, grid: Grid, offsets: Sequence[int], q: Quantization, amax: Any, values: Any,
                        scales: Any | None = None) -> None:
    """:func:`quantize_into` in torch's operations."""
    import torch

    mult, stored = scales_of(amax, q)
    if scales is not None:
        stored = stored.reshape(scales.shape)
        if stored.dtype != scales.dtype and stored.element_size() == scales.element_size():
            stored = stored.view(scales.dtype)      # e8m0 bytes into a uint8 tensor
        scales.copy_(stored)
    if grid.per_tensor:
        factor = mult.reshape((1,) * x.dim())
    else:
        factor = mult
        for d, lengths in enumerate(_dims(grid, offsets, tuple(x.shape))):
            if len(lengths) > 1 or lengths[0] != x.shape[d]:
                factor = factor.repeat_interleave(torch.tensor(lengths, device=factor.device), dim=d)
    scaled = x.detach().float() * factor
    values.copy_(scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
