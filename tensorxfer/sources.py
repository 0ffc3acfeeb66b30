"""Tensor-likes as sources of bytes: what can be packed into a region, where its bytes are, and which
inputs are the same tensor (tied weights).

numpy arrays (bf16/fp8 through ml_dtypes), torch tensors on the host or a GPU, CuPy arrays, anything
with DLPack or the buffer protocol.  A tensor already in CUDA memory is a :class:`DeviceSource` (copied
device to device, never through the host); everything else becomes a host numpy array.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np

from tensorxfer import dtypes as _dt

TensorsLike = Mapping[str, Any] | Iterable[tuple[str, Any]]


def parse_device(device: str) -> tuple[str, int]:
    """``"cpu"`` → ("cpu", 0); ``"cuda"`` / ``"cuda:N"`` → ("cuda", N); ValueError otherwise."""
    if device == "cpu":
        return "cpu", 0
    if device == "cuda":
        return "cuda", 0
    kind, _, index = device.partition(":")
    if kind == "cuda" and index.isdigit():
        return "cuda", int(index)
    raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def items_of(tensors: TensorsLike) -> list[tuple[str, Any]]:
    items = list(tensors.items()) if isinstance(tensors, Mapping) else [tuple(t) for t in tensors]
    for item in items:
        if len(item) != 2 or not isinstance(item[0], str):
            raise TypeError("tensors must be a mapping name -> array or a sequence of (name, array) pairs")
    return items


def as_numpy(name: str, obj: Any) -> np.ndarray:
    """A host numpy array with the tensor's own dtype (ml_dtypes for bf16/fp8).

    Zero-copy where the source allows; device tensors are copied to the host.
    """
    if isinstance(obj, np.ndarray):
        _dt.from_numpy(obj.dtype)
        return obj
    if is_torch(obj):
        d = _dt.from_torch(obj.dtype)
        t = obj.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        return t.reshape(-1).view(torch_module().uint8).numpy().view(d.numpy).reshape(tuple(t.shape))
    if hasattr(obj, "__cuda_array_interface__") and hasattr(obj, "get"):
        return as_numpy(name, obj.get())          # CuPy: copy to the host
    if hasattr(obj, "__dlpack__"):
        try:
            return np.from_dlpack(obj)
        except (TypeError, BufferError, RuntimeError) as e:
            raise TypeError(f"tensor {name!r}: cannot read it through DLPack on the host ({e})") from None
    try:
        arr = np.asarray(memoryview(obj))
    except TypeError:
        raise TypeError(f"tensor {name!r}: {type(obj).__name__} is not an array (numpy, torch, DLPack or "
                        f"buffer protocol)") from None
    _dt.from_numpy(arr.dtype)
    return arr


def is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


class DeviceSource(NamedTuple):
    """A tensor already in CUDA memory: copied device-to-device, never through the host."""

    dtype: np.dtype
    shape: tuple[int, ...]
    ptr: int
    nbytes: int
    keepalive: Any


Source = np.ndarray | DeviceSource


def as_source(name: str, obj: Any, to_device: bool) -> Source:
    """Where a tensor's bytes are: on a device (for a CUDA region) or as a host array."""
    if to_device and is_torch(obj) and obj.is_cuda:
        d = _dt.from_torch(obj.dtype)
        t = obj if obj.is_contiguous() else obj.contiguous()     # data_ptr needs no detach
        return DeviceSource(d.numpy, tuple(t.shape), t.data_ptr(), t.numel() * d.itemsize, t)
    if to_device and hasattr(obj, "__cuda_array_interface__"):
        cai = obj.__cuda_array_interface__
        dtype = np.dtype(cai["typestr"])
        _dt.from_numpy(dtype)
        shape = tuple(cai["shape"])
        contiguous = cai.get("strides") is None or tuple(cai["strides"]) == tuple(
            int(np.prod(shape[i + 1:])) * dtype.itemsize for i in range(len(shape)))
        if contiguous:
            return DeviceSource(dtype, shape, cai["data"][0], int(np.prod(shape)) * dtype.itemsize, obj)
        if hasattr(obj, "copy"):
            return as_source(name, obj.copy(), to_device)  # CuPy: a contiguous device copy
    return as_numpy(name, obj)


def host_bytes(a: np.ndarray) -> np.ndarray:
    """A host array's bytes, flat and C-contiguous (copied only if the array is strided)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def storage_key(obj: Any) -> tuple | None:
    """What makes two inputs the *same* tensor: memory space, data pointer, dtype, shape, byte strides.

    Tied weights (GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``)
    are one tensor under two names; equal keys mean every element lives at
    the same address, so the bytes are stored once.  Views that merely
    overlap (a slice of another tensor) get different keys and are stored
    separately.  ``None`` for empty tensors and for sources with no stable
    address (DLPack / buffer-protocol objects other than the ones below).
    """
    if isinstance(obj, np.ndarray):
        if obj.size == 0:
            return None
        return ("host", obj.__array_interface__["data"][0], obj.dtype, obj.shape, obj.strides)
    if is_torch(obj):
        if obj.numel() == 0:
            return None
        try:
            d = _dt.from_torch(obj.dtype)
        except TypeError:
            return None          # unsupported dtype: as_source raises the real error
        space = "host" if obj.device.type == "cpu" else obj.device.type   # CUDA pointers are unique (UVA)
        return (space, obj.data_ptr(), np.dtype(d.numpy), tuple(obj.shape),
                tuple(st * d.itemsize for st in obj.stride()))
    if hasattr(obj, "__cuda_array_interface__"):
        cai = obj.__cuda_array_interface__
        dtype, shape = np.dtype(cai["typestr"]), tuple(cai["shape"])
        if 0 in shape:
            return None
        strides = cai.get("strides") or tuple(int(np.prod(shape[i + 1:])) * dtype.itemsize
                                              for i in range(len(shape)))
        return ("cuda", cai["data"][0], dtype, shape, tuple(strides))
    return None


def aliases_of(items: list[tuple[str, Any]]) -> dict[str, str]:
    """alias name -> the first name holding the same tensor (see :func:`storage_key`)."""
    first: dict[tuple, str] = {}
    out = {}
    for name, obj in items:
        key = storage_key(obj)
        if key is None:
            continue
        if key in first:
            out[name] = first[key]
        else:
            first[key] = name
    return out


def torch_module() -> Any:
    try:
        import torch
    except ImportError:
        raise ImportError("framework='torch' needs PyTorch installed") from None
    return torch
