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
from typing import Any, NamedTuple

import numpy as np

from tensorxfer import dtypes as _dt
from tensorxfer import memory as _memory
from tensorxfer.errors import CudaError, LayoutError, RegionClosed
from tensorxfer.manifest import DEFAULT_ALIGNMENT, Manifest
from tensorxfer.memory import HostRegion
from tensorxfer.staging import write_from

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

    Zero-copy where the source allows; device tensors are copied to the host.
    """
    if isinstance(obj, np.ndarray):
        _dt.from_numpy(obj.dtype)
        return obj
    if _is_torch(obj):
        d = _dt.from_torch(obj.dtype)
        t = obj.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        return t.reshape(-1).view(_torch().uint8).numpy().view(d.numpy).reshape(tuple(t.shape))
    if hasattr(obj, "__cuda_array_interface__") and hasattr(obj, "get"):
        return _as_numpy(name, obj.get())          # CuPy: copy to the host
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


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


class _DeviceSource(NamedTuple):
    """A tensor already in CUDA memory: copied device-to-device, never through the host."""

    dtype: np.dtype
    shape: tuple[int, ...]
    ptr: int
    nbytes: int
    keepalive: Any


Source = np.ndarray | _DeviceSource


def _as_source(name: str, obj: Any, to_device: bool) -> Source:
    """Where a tensor's bytes are: on a device (for a CUDA region) or as a host array."""
    if to_device and _is_torch(obj) and obj.is_cuda:
        d = _dt.from_torch(obj.dtype)
        t = obj if obj.is_contiguous() else obj.contiguous()     # data_ptr needs no detach
        return _DeviceSource(d.numpy, tuple(t.shape), t.data_ptr(), t.numel() * d.itemsize, t)
    if to_device and hasattr(obj, "__cuda_array_interface__"):
        cai = obj.__cuda_array_interface__
        dtype = np.dtype(cai["typestr"])
        _dt.from_numpy(dtype)
        shape = tuple(cai["shape"])
        contiguous = cai.get("strides") is None or tuple(cai["strides"]) == tuple(
            int(np.prod(shape[i + 1:])) * dtype.itemsize for i in range(len(shape)))
        if contiguous:
            return _DeviceSource(dtype, shape, cai["data"][0], int(np.prod(shape)) * dtype.itemsize, obj)
        if hasattr(obj, "copy"):
            return _as_source(name, obj.copy(), to_device)  # CuPy: a contiguous device copy
    return _as_numpy(name, obj)


def _host_bytes(a: np.ndarray) -> np.ndarray:
    """A host array's bytes, flat and C-contiguous (copied only if the array is strided)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _storage_key(obj: Any) -> tuple | None:
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
    if _is_torch(obj):
        if obj.numel() == 0:
            return None
        try:
            d = _dt.from_torch(obj.dtype)
        except TypeError:
            return None          # unsupported dtype: _as_source raises the real error
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


def _aliases(items: list[tuple[str, Any]]) -> dict[str, str]:
    """alias name -> the first name holding the same tensor (see :func:`_storage_key`)."""
    first: dict[tuple, str] = {}
    out = {}
    for name, obj in items:
        key = _storage_key(obj)
        if key is None:
            continue
        if key in first:
            out[name] = first[key]
        else:
            first[key] = name
    return out


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ImportError("framework='torch' needs PyTorch installed") from None
    return torch


class TensorRegion:
    """Named tensors laid out in one multi-handle memory region.

    Use :meth:`from_tensors` to pack existing tensors, or
    :meth:`from_manifest` to allocate the same layout for receiving.  On
    ``device="cpu"`` the region is a :class:`HostRegion` (memfd chunks); on
    ``"cuda:N"`` a ``CudaRegion`` (VMM handles).  The region owns its memory.
    :meth:`close` (or leaving a ``with`` block) never raises because views
    are alive: the region is closed at once (:meth:`tensors` refuses) and its
    memory is released when the last view returned by :meth:`tensors` is
    dropped, never under a live view.
    """

    def __init__(self, region: Any, manifest: Manifest, device: str = "cpu") -> None:
        if manifest.nbytes > region.size:
            raise ValueError(f"manifest needs {manifest.nbytes} bytes, region has {region.size}")
        self.region = region
        self.manifest = manifest
        self.device = device
        self.is_cuda = parse_device(device)[0] == "cuda"
        self._copier: Any = None
        #: CUDA only: queue device copies with one cuMemcpyBatchAsync call
        #: instead of one cuMemcpyDtoDAsync per tensor (measured on an H200,
        #: 820 tensors / 30.9 GB: update_from 19.5 ms vs 21.2 ms).
        self.batch_copies = True
        self._plan: tuple | None = None

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
            Arrays: numpy (bf16/fp8 through ml_dtypes), torch tensors (CPU
            or CUDA), CuPy arrays, anything with DLPack or the buffer
            protocol.  Non-contiguous inputs are copied contiguously; inputs
            are never modified.
        device : str
            ``"cpu"`` (memfd-backed region) or ``"cuda"`` / ``"cuda:N"``
            (VMM-backed).  CUDA tensors reach a CUDA region device-to-device
            on a stream; host tensors through pinned staging buffers.
        chunk_size : int, optional
            Bytes per physical handle (default: see the region's ``allocate``).
        alignment : int, optional
            Offset alignment of every tensor (default 256, a power of two).
        metadata : mapping of str to str, optional
            Carried in the manifest.

        Tensors that are the same tensor under several names (tied weights:
        same data pointer, dtype, shape and strides — torch, numpy or CuPy)
        are stored once; the manifest records the other names as aliases,
        and :meth:`tensors` returns every name, viewing the same memory (on
        the receiver too).

        Raises
        ------
        TypeError
            An input is not an array, or its dtype is not supported.
        ManifestError
            Names are not unique, or the layout is invalid.
        CudaError
            A CUDA device was asked for and CUDA is not usable.
        """
        kind, _ = parse_device(device)
        items = _items(tensors)
        if not items:
            raise ValueError("from_tensors needs at least one tensor")
        aliases = _aliases(items)
        sources = [(name, _as_source(name, obj, kind == "cuda")) for name, obj in items if name not in aliases]
        entry = {name: (_dt.from_numpy(src.dtype).name, src.shape) for name, src in sources}
        manifest = Manifest.layout(
            ((name, *entry[aliases.get(name, name)]) for name, _ in items),
            alignment=alignment or DEFAULT_ALIGNMENT, metadata=metadata, aliases=aliases,
        )
        if kind == "cuda":
            return cls._from_sources_cuda(manifest, sources, device, chunk_size)
        self = cls._allocate(manifest, device, chunk_size)
        try:
            self._copy_in(sources)
        except BaseException:
            self.close()
            raise
        return self

    @classmethod
    def _from_sources_cuda(cls, manifest: Manifest, sources: list[tuple[str, Source]], device: str,
                           chunk_size: int | None) -> TensorRegion:
        # Allocation overlaps the copy-in: the region is reserved, then mapped
        # one handle at a time, and each tensor's copy is queued as soon as
        # the mapped prefix covers it, while the CPU creates the next handle.
        _, index = parse_device(device)
        if _memory.CudaRegion is None:
            raise CudaError(f"device {device!r}: {_memory.CUDA_UNAVAILABLE}")
        region = _memory.CudaRegion.reserve(max(manifest.nbytes, 1), chunk_size, index)
        self = cls(region, manifest, f"cuda:{index}")
        try:
            self._sync_producers(sources)
            specs = [self.manifest[name] for name, _ in sources]     # aliases have no source of their own
            ordered = sorted(range(len(sources)), key=lambda i: specs[i].offset)
            done = 0
            while region.mapped_size < region.size:
                # One handle at a time: measured on an H200 (30.9 GB, 116
                # handles) 26.8 ms, against 34.1 ms when mapping geometric
                # groups of 1, 2, 4 ... 32 handles per call.
                end = region.map_next()
                ready = done
                while ready < len(ordered) and specs[ordered[ready]].offset + specs[ordered[ready]].nbytes <= end:
                    ready += 1
                self._issue_copies([sources[i] for i in ordered[done:ready]])
                done = ready
            self._get_copier().synchronize()
        except BaseException:
            self.close()       # closes the copier first: its stream is drained before memory goes
            raise
        return self

    @classmethod
    def from_manifest(cls, manifest: Manifest, device: str = "cpu", chunk_size: int | None = None) -> TensorRegion:
        """Allocate a zeroed region with ``manifest``'s layout (to receive into)."""
        self = cls._allocate(manifest, device, chunk_size)
        if self.is_cuda:
            try:
                copier = self._get_copier()
                copier.memset(self.region.ptr, self.region.size)
                copier.synchronize()
            except BaseException:
                self.close()
                raise
        return self

    @classmethod
    def _allocate(cls, manifest: Manifest, device: str, chunk_size: int | None) -> TensorRegion:
        kind, index = parse_device(device)
        size = max(manifest.nbytes, 1)
        region: Any
        if kind == "cuda":
            if _memory.CudaRegion is None:
                raise CudaError(f"device {device!r}: {_memory.CUDA_UNAVAILABLE}")
            region = _memory.CudaRegion.allocate(size, chunk_size, index)
            device = f"cuda:{index}"
        else:
            region = HostRegion.allocate(size, chunk_size)
        return cls(region, manifest, device)

    # ------------------------------------------------------------ access
    def _check_open(self) -> None:
        if self.region.closed:
            raise RegionClosed("this TensorRegion is closed: it hands out no new views (views taken before "
                               "close() stay valid until dropped)")

    def _byte_view(self) -> np.ndarray:
        # Never cached: a cached array would hold a buffer export on the
        # region for as long as this object lives, so a closed region's
        # memory could never be released.  Each call's array (and the views
        # cut from it) pins the memory only while the caller keeps them.
        if self.is_cuda:
            raise ValueError(f"this region lives on {self.device}: use tensors(framework='torch') or 'cupy'")
        self._check_open()
        return np.frombuffer(self.region, dtype=np.uint8)

    def _get_copier(self) -> Any:
        if self._copier is None:
            from tensorxfer.memory._copy import Copier

            self._copier = Copier(self.region.device_index)
        return self._copier

    def tensors(self, framework: str | None = None) -> dict[str, Any]:
        """Zero-copy views of every tensor, by name.

        ``framework``: ``"numpy"`` (host regions; bf16/fp8 as ml_dtypes
        dtypes), ``"torch"`` (host or CUDA), ``"cupy"`` (CUDA).  Default:
        numpy for host regions, torch for CUDA regions.  Writing through a
        view writes the region.  Views keep the region's memory mapped:
        after :meth:`close` it is released when the last view is dropped.

        Raises
        ------
        RegionClosed
            The region was closed.
        """
        self._check_open()
        framework = framework or ("torch" if self.is_cuda else "numpy")
        if framework not in ("numpy", "torch", "cupy"):
            raise ValueError(f"framework must be 'numpy', 'torch' or 'cupy', got {framework!r}")
        specs = self.manifest.tensors
        if not self.is_cuda:
            if framework == "cupy":
                raise ValueError("framework='cupy' needs a CUDA region (device='cuda:N')")
            buf = self._byte_view()
            raws = [buf[t.offset:t.offset + t.nbytes] for t in specs]
            if framework == "numpy":
                return {t.name: r.view(_dt.DTYPES[t.dtype].numpy).reshape(t.shape) for t, r in zip(specs, raws)}
            torch = _torch()
            return {t.name: torch.from_dlpack(r).view(getattr(torch, _dt.DTYPES[t.dtype].torch_name)).reshape(t.shape)
                    for t, r in zip(specs, raws)}
        if framework == "numpy":
            raise ValueError(f"this region lives on {self.device}: use framework='torch' or 'cupy'")
        device_bytes = self.region.cuda_array(0, max(self.manifest.nbytes, 1))
        if framework == "torch":
            torch = _torch()
            base = torch.as_tensor(device_bytes, device=self.device)
            return {t.name: base[t.offset:t.offset + t.nbytes].view(getattr(torch, _dt.DTYPES[t.dtype].torch_name))
                    .reshape(t.shape) for t in specs}
        try:
            import cupy
        except ImportError:
            raise ImportError("framework='cupy' needs CuPy installed") from None
        with cupy.cuda.Device(self.region.device_index):
            base = cupy.asarray(device_bytes)
            return {t.name: base[t.offset:t.offset + t.nbytes].view(_dt.DTYPES[t.dtype].numpy).reshape(t.shape)
                    for t in specs}

    def update_from(self, tensors: TensorsLike) -> None:
        """Copy a new step's values into the region, in place.

        The names, dtypes and shapes must be exactly those of the manifest.

        Raises
        ------
        LayoutError
            Names are missing or extra, or a dtype or shape differs; nothing
            is copied in that case.
        """
        items = _items(tensors)
        if self.is_cuda and self._replay_plan(items):
            return
        sources = [(name, _as_source(name, obj, self.is_cuda)) for name, obj in items]
        given = {name for name, _ in sources}
        missing = [n for n in self.manifest.names if n not in given]
        extra = [n for n in given if n not in self.manifest]
        if missing or extra or len(sources) != len(given):
            raise LayoutError(f"update does not match the region: missing {missing[:5]}, unexpected "
                              f"{extra[:5]}{', duplicate names' if len(sources) != len(given) else ''}")
        for name, src in sources:
            spec = self.manifest[name]
            dt = _dt.from_numpy(src.dtype).name
            if dt != spec.dtype or tuple(src.shape) != spec.shape:
                raise LayoutError(f"tensor {name!r}: got {dt}{list(src.shape)}, the region holds "
                                  f"{spec.dtype}{list(spec.shape)}")
        self._copy_in(sources)
        if self.is_cuda:
            self._remember_plan(items, sources)

    # A trainer calls update_from with the same parameter tensors every step.
    # Validating and converting 820 of them costs a few ms of Python, as much
    # as a fifth of the copy itself; when every tensor is the same object
    # with the same storage, shape and dtype as last time, the batched copy
    # is replayed from the remembered pointer arrays instead.
    def _remember_plan(self, items: list[tuple[str, Any]], sources: list[tuple[str, Source]]) -> None:
        if not all(isinstance(s, _DeviceSource) and _is_torch(s.keepalive) and s.keepalive is obj
                   for (_, obj), (_, s) in zip(items, sources)):
            self._plan = None
            return
        manifest, base = self.manifest, self.region.ptr
        keep = [(name, obj, obj.data_ptr(), tuple(obj.shape), obj.dtype) for name, obj in items]
        rows = [(base + manifest[name].offset, ptr, manifest[name].nbytes) for name, _, ptr, _, _ in keep
                if manifest[name].nbytes]
        dsts, srcs, sizes = (np.array([r[i] for r in rows], dtype=np.uint64) for i in range(3))
        self._plan = (keep, dsts, srcs, sizes)

    def _replay_plan(self, items: list[tuple[str, Any]]) -> bool:
        plan = self._plan
        if plan is None or len(items) != len(plan[0]):
            return False
        for (name, obj), (pname, pobj, ptr, shape, dtype) in zip(items, plan[0]):
            if (obj is not pobj or name != pname or obj.data_ptr() != ptr or obj.dtype is not dtype
                    or obj.shape != shape or not obj.is_contiguous()):
                return False
        _torch().cuda.synchronize()
        copier = self._get_copier()
        copier.dtod_batch(plan[1], plan[2], plan[3], batch_api=self.batch_copies)
        copier.synchronize()
        return True

    def _copy_in(self, sources: list[tuple[str, Source]]) -> None:
        self._check_open()
        if not self.is_cuda:
            self._issue_copies(sources)        # host sources only: each lands before write_from returns
            return
        self._sync_producers(sources)
        self._issue_copies(sources)
        self._get_copier().synchronize()

    @staticmethod
    def _sync_producers(sources: list[tuple[str, Source]]) -> None:
        if any(isinstance(s, _DeviceSource) and _is_torch(s.keepalive) for _, s in sources):
            # Work queued on PyTorch's streams must land before our stream reads it.
            _torch().cuda.synchronize()

    def _issue_copies(self, sources: list[tuple[str, Source]]) -> None:
        """Copy sources in: device sources in one batched call (queued), host ones through staging.

        Host sources go through :func:`~tensorxfer.staging.write_from`: a
        slice copy on host regions, the Copier's pinned buffers on its one
        stream for CUDA regions (so they stay ordered after the batch).
        """
        manifest = self.manifest
        if not self.is_cuda:
            for name, src in sources:
                assert isinstance(src, np.ndarray)   # host regions get host sources only
                write_from(self, manifest[name].offset, _host_bytes(src))
            return
        copier = self._get_copier()
        base = self.region.ptr
        dev = [(manifest[name], src) for name, src in sources if isinstance(src, _DeviceSource)]
        dev = [(t, src) for t, src in dev if t.nbytes]
        if dev:
            copier.dtod_batch(np.fromiter((base + t.offset for t, _ in dev), np.uint64, len(dev)),
                              np.fromiter((src.ptr for _, src in dev), np.uint64, len(dev)),
                              np.fromiter((t.nbytes for t, _ in dev), np.uint64, len(dev)),
                              batch_api=self.batch_copies)
        for name, src in sources:
            if not isinstance(src, _DeviceSource) and src.nbytes:
                write_from(self, manifest[name].offset, _host_bytes(src), stager=copier)

    def resolve_extent(self, whole_alloc: bool = False) -> Any:
        """The registration extent of the whole payload (see ``AllocationMap.resolve_extent``)."""
        return self.region.resolve_extent(0, max(self.manifest.nbytes, 1), whole_alloc)

    # ------------------------------------------------------------ lifetime
    @property
    def nbytes(self) -> int:
        """Payload bytes (the end of the last tensor)."""
        return self.manifest.nbytes

    @property
    def closed(self) -> bool:
        return bool(self.region.closed)

    def close(self, defer: object = None) -> None:
        """Close the region; never raises because views are alive; idempotent.

        The region is closed at once (:meth:`tensors` and :meth:`update_from`
        refuse).  Its memory is released now if no view from :meth:`tensors`
        is alive, else when the last one is dropped.  ``defer`` is ignored
        (kept for compatibility: every close now waits for the last view).
        """
        self._plan = None          # it references the caller's tensors
        if self._copier is not None:
            self._copier.close()   # drains its stream before the memory can go
            self._copier = None
        self.region.close()

    def __enter__(self) -> TensorRegion:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.nbytes} bytes"
        return f"<TensorRegion {len(self.manifest)} tensors, {state}, device {self.device!r}>"
