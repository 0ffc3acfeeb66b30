"""TensorRegion: many tensors packed into one region, described by a manifest.

One region means one registration with the NIC, paid once and reused for
every later update.  :meth:`TensorRegion.from_tensors` lays the tensors out
at aligned offsets (:meth:`Manifest.layout`), allocates one multi-handle
region and copies them in; :meth:`TensorRegion.tensors` hands back zero-copy
views; :meth:`TensorRegion.update_from` copies the next training step's
values into the same memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from tensorxfer import dtypes as _dt
from tensorxfer.errors import LayoutError
from tensorxfer.manifest import DEFAULT_ALIGNMENT, Manifest
from tensorxfer.memory import HostRegion

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


def _items(tensors: TensorsLike) -> list[tuple[str, Any]]:
    items = list(tensors.items()) if isinstance(tensors, Mapping) else [tuple(t) for t in tensors]
    for item in items:
        if len(item) != 2 or not isinstance(item[0], str):
            raise TypeError("tensors must be a mapping name -> array or a sequence of (name, array) pairs")
    return items


def _as_numpy(name: str, obj: Any) -> np.ndarray:
    """A host numpy array with the tensor's own dtype (ml_dtypes for bf16/fp8).

    Zero-copy where the source allows; a CUDA tensor is copied to the host.
    """
    if isinstance(obj, np.ndarray):
        _dt.from_numpy(obj.dtype)
        return obj
    mod = type(obj).__module__
    if mod.startswith("torch"):
        d = _dt.from_torch(obj.dtype)
        t = obj.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        return t.reshape(-1).view(_torch().uint8).numpy().view(d.numpy).reshape(tuple(t.shape))
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


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ImportError("framework='torch' needs PyTorch installed") from None
    return torch


class TensorRegion:
    """Named tensors laid out in one multi-handle memory region.

    Use :meth:`from_tensors` to pack existing tensors, or
    :meth:`from_manifest` to allocate the same layout for receiving.  The
    region owns its memory; :meth:`close` releases it (refusing, with
    ``BufferError``, while views returned by :meth:`tensors` are alive).
    """

    def __init__(self, region: HostRegion, manifest: Manifest, device: str = "cpu") -> None:
        if manifest.nbytes > region.size:
            raise ValueError(f"manifest needs {manifest.nbytes} bytes, region has {region.size}")
        self.region = region
        self.manifest = manifest
        self.device = device
        self._bytes: np.ndarray | None = None

    # ------------------------------------------------------------ factories
    @classmethod
    def from_tensors(
        cls,
        tensors: TensorsLike,
        device: str = "cpu",
        chunk_size: int | None = None,
        alignment: int | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> TensorRegion:
        """Pack tensors into one new region.

        Parameters
        ----------
        tensors
            A mapping name → array, or a sequence of (name, array) pairs.
            Arrays: numpy (bf16/fp8 through ml_dtypes), torch tensors,
            anything with DLPack or the buffer protocol.  Non-contiguous
            inputs are copied contiguously; inputs are never modified.
        device : str
            ``"cpu"`` for a memfd-backed region.
        chunk_size : int, optional
            Bytes per physical handle (default: see ``HostRegion.allocate``).
        alignment : int, optional
            Offset alignment of every tensor (default 256, a power of two).
        metadata : mapping of str to str, optional
            Carried in the manifest.

        Raises
        ------
        TypeError
            An input is not an array, or its dtype is not supported.
        ManifestError
            Names are not unique, or the layout is invalid.
        """
        kind, _ = parse_device(device)
        items = _items(tensors)
        if not items:
            raise ValueError("from_tensors needs at least one tensor")
        arrays = [(name, _as_numpy(name, obj)) for name, obj in items]
        manifest = Manifest.layout(
            ((name, _dt.from_numpy(a.dtype).name, a.shape) for name, a in arrays),
            alignment=alignment or DEFAULT_ALIGNMENT, metadata=metadata,
        )
        self = cls._allocate(manifest, kind, device, chunk_size)
        try:
            self._copy_in(arrays)
        except BaseException:
            self.close()
            raise
        return self

    @classmethod
    def from_manifest(cls, manifest: Manifest, device: str = "cpu", chunk_size: int | None = None) -> TensorRegion:
        """Allocate a zeroed region with ``manifest``'s layout (to receive into)."""
        kind, _ = parse_device(device)
        return cls._allocate(manifest, kind, device, chunk_size)

    @classmethod
    def _allocate(cls, manifest: Manifest, kind: str, device: str, chunk_size: int | None) -> TensorRegion:
        if kind != "cpu":
            from tensorxfer.errors import CudaError
            raise CudaError(f"device {device!r}: CUDA regions are not available in this build")
        region = HostRegion.allocate(max(manifest.nbytes, 1), chunk_size)
        return cls(region, manifest, device)

    # ------------------------------------------------------------ access
    def _byte_view(self) -> np.ndarray:
        if self._bytes is None:
            self._bytes = np.frombuffer(self.region, dtype=np.uint8)
        return self._bytes

    def tensors(self, framework: str = "numpy") -> dict[str, Any]:
        """Zero-copy views of every tensor, by name.

        ``framework="numpy"`` (bf16/fp8 as ml_dtypes dtypes) or ``"torch"``.
        Writing through a view writes the region.  Views keep the region's
        memory mapped: :meth:`close` refuses while any is alive.
        """
        if framework not in ("numpy", "torch"):
            raise ValueError(f"framework must be 'numpy' or 'torch', got {framework!r}")
        buf = self._byte_view()
        torch = _torch() if framework == "torch" else None
        out: dict[str, Any] = {}
        for t in self.manifest.tensors:
            raw = buf[t.offset:t.offset + t.nbytes]
            if torch is None:
                out[t.name] = raw.view(_dt.DTYPES[t.dtype].numpy).reshape(t.shape)
            else:
                tt = torch.from_dlpack(raw).view(getattr(torch, _dt.DTYPES[t.dtype].torch_name))
                out[t.name] = tt.reshape(t.shape)
        return out

    def update_from(self, tensors: TensorsLike) -> None:
        """Copy a new step's values into the region, in place.

        The names, dtypes and shapes must be exactly those of the manifest.

        Raises
        ------
        LayoutError
            Names are missing or extra, or a dtype or shape differs; nothing
            is copied in that case.
        """
        arrays = [(name, _as_numpy(name, obj)) for name, obj in _items(tensors)]
        given = {name for name, _ in arrays}
        missing = [n for n in self.manifest.names if n not in given]
        extra = [n for n in given if n not in self.manifest]
        if missing or extra or len(arrays) != len(given):
            raise LayoutError(f"update does not match the region: missing {missing[:5]}, unexpected "
                              f"{extra[:5]}{', duplicate names' if len(arrays) != len(given) else ''}")
        for name, a in arrays:
            spec = self.manifest[name]
            dt = _dt.from_numpy(a.dtype).name
            if dt != spec.dtype or tuple(a.shape) != spec.shape:
                raise LayoutError(f"tensor {name!r}: got {dt}{list(a.shape)}, the region holds "
                                  f"{spec.dtype}{list(spec.shape)}")
        self._copy_in(arrays)

    def _copy_in(self, arrays: list[tuple[str, np.ndarray]]) -> None:
        buf = self._byte_view()
        for name, a in arrays:
            t = self.manifest[name]
            dst = buf[t.offset:t.offset + t.nbytes].view(a.dtype).reshape(a.shape)
            np.copyto(dst, a, casting="no")

    def resolve_extent(self, whole_alloc: bool = False):
        """The registration extent of the whole payload (see ``AllocationMap.resolve_extent``)."""
        return self.region.resolve_extent(0, max(self.manifest.nbytes, 1), whole_alloc)

    # ------------------------------------------------------------ lifetime
    @property
    def nbytes(self) -> int:
        """Payload bytes (the end of the last tensor)."""
        return self.manifest.nbytes

    @property
    def closed(self) -> bool:
        return self.region.closed

    def close(self, defer: bool = False) -> None:
        """Release the region; idempotent.

        Raises ``BufferError`` while views from :meth:`tensors` are alive,
        unless ``defer`` is true: then the memory is released when the last
        view is dropped.
        """
        self._bytes = None
        self.region.close(defer=defer)

    def __enter__(self) -> TensorRegion:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # With an exception in flight its traceback may still hold views;
        # defer instead of masking the real error with a BufferError.
        self.close(defer=exc_type is not None)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.nbytes} bytes"
        return f"<TensorRegion {len(self.manifest)} tensors, {state}, device {self.device!r}>"
