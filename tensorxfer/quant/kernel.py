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
import math
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
                           for n in ("amax_cells", "quantize_cells", "quantize_tiles")}
            finally:
                _check(cu.cuCtxPopCurrent(), "cuCtxPopCurrent")
            found = _functions[device] = (ctx, kernels)
        return found


WIDTH = 17      # int64 columns of a table row (fp8_quantize.cu's Column)
_DTYPES = {"torch.bfloat16": 0, "torch.float32": 1}


def _launch(name: str, device: int, blocks: int, args: tuple, types: tuple) -> None:
    """One launch on torch's current stream, the context pushed for it: the calling thread (a sync's pair
    or push thread) may have none current (measured on the H100: CUDA_ERROR_INVALID_CONTEXT without)."""
    import torch

    cu = _driver()
    ctx, kernels = _context(device)
    stream = cu.CUstream(torch.cuda.current_stream(device).cuda_stream)
    _check(cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        _check(cu.cuLaunchKernel(kernels[name], blocks, 1, 1, THREADS, 1, 1, 0, stream, (args, types), 0),
               "cuLaunchKernel")
    finally:
        _check(cu.cuCtxPopCurrent(), "cuCtxPopCurrent")


class ShardTable:
    """Many 2-D shards of one device, quantized in two launches however many there are.

    ``entries``: per shard ``(x, grid, offsets, q, values, scales)`` (shards the kernels :func:`fits`,
    layouts they :func:`computes`; ``values`` and ``scales`` C-contiguous on the device, or None for a
    table that only takes amaxes); their cells are numbered one shard after the other from 0 in
    :attr:`amax` (float32, on the device).  The table (a few int64 per shard) is copied to the device
    once, and again only where a shard's storage moved (:meth:`refresh`).
    """

    def __init__(self, entries: list[tuple[Any, Grid, tuple[int, ...], Quantization, Any, Any]]) -> None:
        import torch

        self.entries = entries
        self.device = entries[0][0].device
        self.starts: list[int] = []
        total = 0
        for x, grid, offsets, *_ in entries:
            self.starts.append(total)
            total += math.prod(grid.cells(offsets, tuple(x.shape))[1])
        self.cells = total
        self.amax = torch.empty(total, dtype=torch.float32, device=self.device)
        self._inputs = [e[0] for e in entries]
        self._input_pointers: list[int] = []
        self._table: Any = None
        self.refresh()

    def view(self, i: int) -> Any:
        """Shard ``i``'s cells' amaxes, in the shape of its cells."""
        x, grid, offsets, *_ = self.entries[i]
        count = grid.cells(offsets, tuple(x.shape))[1]
        return self.amax[self.starts[i]:self.starts[i] + math.prod(count)].view(count)

    def refresh(self) -> None:
        """Copy the table to the device if a shard's storage moved since (a trainer may swap it; the values and
        scales are the caller's own tensors, and move only with it: checked once).  Each push: one C pass over
        the shards' inputs (it was a Python loop over their three pointers each, ~550 shards a source in the
        16 GB benchmark)."""
        import torch

        inputs = list(map(torch.Tensor.data_ptr, self._inputs))
        if inputs == self._input_pointers:
            return
        self._input_pointers = inputs
        pointers = [(px, 0 if v is None else v.data_ptr(), 0 if s is None else s.data_ptr())
                    for px, (_, _, _, _, v, s) in zip(inputs, self.entries)]
        rows = []
        for (x, grid, offsets, q, _, _), (px, pv, ps), start in zip(self.entries, pointers, self.starts):
            first, count = grid.cells(offsets, tuple(x.shape))
            if math.prod(count) == 0:
                continue
            rows.append([px, pv, ps, int(x.shape[0]), int(x.shape[1]), int(offsets[0]), int(offsets[1]),
                         first[0], first[1], count[1], grid.block[0], grid.block[1], grid.shape[0], grid.shape[1],
                         _DTYPES[str(x.dtype)], FORMULAS.get((q.formula, q.scale), 0), start])
        self._rows = len(rows)
        self._table = (torch.tensor(rows, dtype=torch.int64).reshape(-1, WIDTH).to(self.device)
                       if rows else None)

    def amaxes(self, cells: Any = None, quantize_whole: bool = False) -> None:
        """The amax of each cell listed in ``cells`` (int64 on the device, indices into :attr:`amax`; None:
        all) over the shard's part of it, into :attr:`amax` (NaN where it holds one); with
        ``quantize_whole``, those whose whole block the shard holds are quantized at once, unless their amax
        is not finite (the caller refuses the step)."""
        count = self.cells if cells is None else int(cells.numel())
        if self._table is None or count == 0:
            return
        _launch("amax_cells", self._index, count,
                (self._table.data_ptr(), self._rows, 0 if cells is None else cells.data_ptr(), self.amax.data_ptr(),
                 int(quantize_whole)), (_PTR, _I64, _PTR, _PTR, ctypes.c_int))

    def quantize(self, cells: Any = None) -> None:
        """Quantize the cells listed in ``cells`` (int64 on the device, indices into :attr:`amax`; None: all),
        given each one's amax over its whole block in :attr:`amax`."""
        count = self.cells if cells is None else int(cells.numel())
        if self._table is None or count == 0:
            return
        _launch("quantize_cells", self._index, count,
                (self._table.data_ptr(), self._rows, 0 if cells is None else cells.data_ptr(), self.amax.data_ptr()),
                (_PTR, _I64, _PTR, _PTR))

    @property
    def _index(self) -> int:
        import torch

        return self.device.index if self.device.index is not None else torch.cuda.current_device()


def block_amax(x: Any, grid: Grid, offsets: tuple[int, ...]) -> Any:
    """As :func:`tensorxfer.quant.quantize.block_amax`, in one launch (shards the kernels ``fits``)."""
    table = ShardTable([(x, grid, offsets, Quantization.blocks(), None, None)])
    table.amaxes()
    return table.view(0)


def quantize_into(x: Any, grid: Grid, offsets: tuple[int, ...], q: Quantization, amax: Any, values: Any,
                  scales: Any) -> None:
    """As :func:`tensorxfer.quant.quantize.quantize_into`, in one launch (shards the kernels ``fits``, layouts
    it ``computes``; ``values`` and ``scales`` C-contiguous on ``x``'s device)."""
    table = ShardTable([(x, grid, offsets, q, values, scales)])
    table.amax.copy_(amax.reshape(-1))
    table.quantize()
