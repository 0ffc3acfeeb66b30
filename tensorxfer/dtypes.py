"""Element types, named as safetensors names them.

One table maps each name to its item size and to the matching numpy and
torch dtypes.  numpy has no bfloat16 or float8 of its own; ``ml_dtypes``
(a dependency) supplies them, so every type has a true numpy view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class DType:
    name: str          # safetensors spelling, e.g. "BF16"
    itemsize: int
    numpy: np.dtype
    torch_name: str    # attribute of the torch module, e.g. "bfloat16"


def _d(name: str, np_dtype: Any, torch_name: str) -> DType:
    dt = np.dtype(np_dtype)
    return DType(name, dt.itemsize, dt, torch_name)


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        _d("BOOL", np.bool_, "bool"),
        _d("U8", np.uint8, "uint8"),
        _d("I8", np.int8, "int8"),
        _d("U16", np.uint16, "uint16"),
        _d("I16", np.int16, "int16"),
        _d("U32", np.uint32, "uint32"),
        _d("I32", np.int32, "int32"),
        _d("U64", np.uint64, "uint64"),
        _d("I64", np.int64, "int64"),
        _d("F16", np.float16, "float16"),
        _d("BF16", ml_dtypes.bfloat16, "bfloat16"),
        _d("F32", np.float32, "float32"),
        _d("F64", np.float64, "float64"),
        _d("F8_E4M3", ml_dtypes.float8_e4m3fn, "float8_e4m3fn"),
        _d("F8_E5M2", ml_dtypes.float8_e5m2, "float8_e5m2"),
    )
}

_BY_NUMPY = {d.numpy: d for d in DTYPES.values()}
_BY_TORCH = {d.torch_name: d for d in DTYPES.values()}


def from_numpy(dtype: np.dtype) -> DType:
    """The DType of a numpy dtype; TypeError for one we cannot carry."""
    try:
        return _BY_NUMPY[np.dtype(dtype)]
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
