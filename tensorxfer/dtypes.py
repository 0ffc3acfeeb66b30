"""Element types, named as safetensors names them.

One table maps each name to its item size and to the matching numpy and
torch dtypes.  numpy has no bfloat16 or float8 of its own; ``ml_dtypes``
(a dependency) supplies them, so every type has a true numpy view.  It is imported on first use of a
numpy dtype: importing it costs ~1 s on a small VM, which every CLI start would pay for nothing.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str          # safetensors spelling, e.g. "BF16"
    itemsize: int
    numpy_type: str    # "uint8" (numpy's) or "ml_dtypes.bfloat16"
    torch_name: str    # attribute of the torch module, e.g. "bfloat16"

    @functools.cached_property
    def numpy(self) -> np.dtype:
        module, _, attr = self.numpy_type.rpartition(".")
        return np.dtype(getattr(importlib.import_module(module), attr) if module else attr)


def _d(name: str, itemsize: int, numpy_type: str, torch_name: str) -> DType:
    return DType(name, itemsize, numpy_type, torch_name)


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        _d("BOOL", 1, "bool", "bool"),
        _d("U8", 1, "uint8", "uint8"),
        _d("I8", 1, "int8", "int8"),
        _d("U16", 2, "uint16", "uint16"),
        _d("I16", 2, "int16", "int16"),
        _d("U32", 4, "uint32", "uint32"),
        _d("I32", 4, "int32", "int32"),
        _d("U64", 8, "uint64", "uint64"),
        _d("I64", 8, "int64", "int64"),
        _d("F16", 2, "float16", "float16"),
        _d("BF16", 2, "ml_dtypes.bfloat16", "bfloat16"),
        _d("F32", 4, "float32", "float32"),
        _d("F64", 8, "float64", "float64"),
        _d("F8_E4M3", 1, "ml_dtypes.float8_e4m3fn", "float8_e4m3fn"),
        _d("F8_E5M2", 1, "ml_dtypes.float8_e5m2", "float8_e5m2"),
        _d("F8_E8M0", 1, "ml_dtypes.float8_e8m0fnu", "float8_e8m0fnu"),     # power-of-two scales (MXFP8)
    )
}

@functools.cache
def _by_numpy() -> dict[np.dtype, DType]:
    return {d.numpy: d for d in DTYPES.values()}

_BY_TORCH = {d.torch_name: d for d in DTYPES.values()}


def from_numpy(dtype: np.dtype) -> DType:
    """The DType of a numpy dtype; TypeError for one we cannot carry."""
    try:
        return _by_numpy()[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise TypeError(
            f"unsupported numpy dtype {dtype!r}; supported: {', '.join(str(d.numpy) for d in DTYPES.values())}"
        ) from None


_BY_TORCH_OBJECT: dict[Any, DType] = {}


def from_torch(dtype: Any) -> DType:
    """The DType of a torch dtype (``torch.bfloat16`` ...); TypeError otherwise."""
    found = _BY_TORCH_OBJECT.get(dtype)
    if found is not None:
        return found
    name = str(dtype).removeprefix("torch.")
    try:
        found = _BY_TORCH_OBJECT[dtype] = _BY_TORCH[name]
        return found
    except KeyError:
        raise TypeError(
            f"unsupported torch dtype {dtype}; supported: {', '.join(sorted(_BY_TORCH))}"
        ) from None
