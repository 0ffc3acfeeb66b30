"""The FP8 quantize kernels (``fp8_quantize.cu``) on torch's current CUDA stream, through cuda-bindings.

:func:`fits` and :func:`computes` say whether a shard takes the kernel path: a 2-D bf16 or fp32 CUDA
tensor, C-contiguous, blocks of at least 8 rows (a one-row block is a few hundred bytes: torch's operations
serve those, and one scale per tensor, as well), a formula the kernel computes exactly as torch does
(transformers' power-of-two scales take a log2 whose last bit a GPU's and a CPU's library may round apart:
torch serves them), and the kernel image built (setup.py with nvcc) with cuda-bindings importable.
Otherwise :mod:`tensorxfer.quant.quantize` runs torch's operations; both give the same bytes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from pathlib import Path
from typing import Any

from tensorxfer.memory.strided import read_image
from tensorxfer.quant.layout import Grid, Quantization

THREADS = 256
FORMULAS = {("transformers", "float"): 0, ("deepgemm", "float"): 1, ("deepgemm", "e8m0"): 2}
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_lock = threading.Lock()
_functions: dict[int, tuple[Any, dict[str, Any]]] = {}     # device -> (primary context, name -> CUfunction)


@functools.cache
def _image() -> bytes | None:
    return read_image(Path(__file__).with_name("fp8_quantize.fatbin"), "FP8 quantization runs torch's operations",
                      logging.INFO)


@functools.cache
def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    return driver


def fits(x: Any, grid: Grid) -> bool:
    """Whether shard ``x`` of a tensor with this block grid takes the kernels (see the module docstring)."""
    import torch

    return (x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float32) and x.is_contiguous()
            and not grid.per_tensor and grid.block[0] >= 8 and _image() is not None and _driver() is not None)


def computes(q: Quantization) -> bool:
    """Whether the kernel computes layout ``q``'s formula exactly as torch does."""
    return (q.formula, q.scale) in FORMULAS


def _check(result: Any, what: str) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"tensorxfer: {what} failed: CUDA error {int(err)}")
    return rest[0] if len(rest) == 1 else rest


def _context(device: int) -> tuple[Any, dict[str, Any]]:
    """The device's primary context (torch's; retained once for the process's life) and the kernels loaded
    into it."""
    cu = _driver()
    with _lock:
        found = _functions.get(device)
        if found is None:
            _check(cu.cuInit(0), "cuInit")
            ctx = _check(cu.cuDevicePrimaryCtxRetain(_check(cu.cuDeviceGet(device), "cuDeviceGet")),
                         "cuDevicePrimaryCtxRetain")
            _check(cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
            try:
                module = _check(cu.cuModuleLoadData(_image()), "cuModuleLoadData")
                kernels = {n: _check(cu.cuModuleGetFunction(module, n.encode()), "cuModuleGetFunction")
                           for n in ("amax_bf16", "quantize_bf16", "amax_f32", "quantize_f32")}
            finally:
                _check(cu.cuCtxPopCurrent(), "cuCtxPopCurrent")
            found = _functions[device] = (ctx, kernels)
        return found


def _launch(name: str, x: Any, cells: int, args: tuple, types: tuple) -> None:
    """One launch on torch's current stream, the context pushed for it: the calling thread (a sync's pair
    or push thread) may have none current (measured on the H100: CUDA_ERROR_INVALID_CONTEXT without)."""
    import torch

    cu = _driver()
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    ctx, kernels = _context(device)
    func = kernels[f"{name}_{'bf16' if x.dtype == torch.bfloat16 else 'f32'}"]
    stream = cu.CUstream(torch.cuda.current_stream(device).cuda_stream)
    _check(cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        _check(cu.cuLaunchKernel(func, cells, 1, 1, THREADS, 1, 1, 0, stream, (args, types), 0), "cuLaunchKernel")
    finally:
        _check(cu.cuCtxPopCurrent(), "cuCtxPopCurrent")


def _geometry(x: Any, grid: Grid, offsets: tuple[int, ...]) -> tuple[tuple, tuple[int, ...], int]:
    """The kernels' shard arguments, the cells it touches (per dimension) and how many."""
    first, count = grid.cells(offsets, tuple(x.shape))
    return ((int(x.shape[0]), int(x.shape[1]), int(offsets[0]), int(offsets[1]), int(first[0]), int(first[1]),
             int(count[1]), int(grid.block[0]), int(grid.block[1])), count, int(count[0]) * int(count[1]))


def block_amax(x: Any, grid: Grid, offsets: tuple[int, ...]) -> Any:
    """As :func:`tensorxfer.quant.quantize.block_amax`, in one launch (shards the kernels ``fits``)."""
    import torch

    geometry, count, cells = _geometry(x, grid, offsets)
    out = torch.empty(tuple(count), dtype=torch.float32, device=x.device)
    if cells:
        _launch("amax", x, cells, (x.data_ptr(), *geometry, out.data_ptr()), (_PTR,) + (_I64,) * 9 + (_PTR,))
    return out


def quantize_into(x: Any, grid: Grid, offsets: tuple[int, ...], q: Quantization, amax: Any, values: Any,
                  scales: Any) -> None:
    """As :func:`tensorxfer.quant.quantize.quantize_into`, in one launch (shards the kernels ``fits``, layouts
    it ``computes``; ``values`` and ``scales`` C-contiguous on ``x``'s device)."""
    geometry, _, cells = _geometry(x, grid, offsets)
    if not cells:
        return
    amax = amax.float().contiguous()
    _launch("quantize", x, cells, (x.data_ptr(), values.data_ptr(), *geometry, amax.data_ptr(), scales.data_ptr(),
                                   FORMULAS[(q.formula, q.scale)]),
            (_PTR, _PTR) + (_I64,) * 9 + (_PTR, _PTR, ctypes.c_int))
