"""TensorRegion: many tensors packed into one region, described by a manifest.

One region means one registration with the NIC, paid once and reused for
every later update.  :meth:`TensorRegion.from_tensors` lays the tensors out
at aligned offsets (:meth:`Manifest.layout`), allocates one multi-handle
region and copies them in; :meth:`TensorRegion.tensors` hands back zero-copy
views; :meth:`TensorRegion.update_from` copies the next training step's
values into the same memory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tensorxfer import dtypes as _dt
from tensorxfer import memory as _memory
from tensorxfer.errors import CudaError, LayoutError, RegionClosed
from tensorxfer.manifest import DEFAULT_ALIGNMENT, Manifest
from tensorxfer.memory import HostRegion
from tensorxfer.sources import (
    DeviceSource,
    Source,
    TensorsLike,
    aliases_of,
    as_source,
    host_bytes,
    is_torch,
    items_of,
    parse_device,
    torch_module,
)
from tensorxfer.staging import write_from

__all__ = ["TensorRegion", "TensorsLike", "parse_device"]


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

    def __init__(self, region: Any, manifest: Manifest, device: str = "cpu",
                 source_files: Sequence[tuple[int, int, int]] | None = None) -> None:
        if manifest.nbytes > region.size:
            raise ValueError(f"manifest needs {manifest.nbytes} bytes, region has {region.size}")
        self.region = region
        #: ``(offset, length, fd)`` of regular files whose first ``length`` bytes the region maps at
        #: ``offset`` (:meth:`HostRegion.map_files`), or None.  The region owns the fds (:meth:`close` closes
        #: them): ipc passes them instead of memory handles, so a receiver on this host copies from the files
        #: in the kernel (``copy_file_range``, as ``cp`` does) rather than from mapped memory.
        self.source_files: tuple[tuple[int, int, int], ...] | None = (
            tuple((int(o), int(n), int(fd)) for o, n, fd in source_files) if source_files is not None else None)
        self.manifest = manifest
        self.device = device
        self.is_cuda = parse_device(device)[0] == "cuda"
        self._copier: Any = None
        #: CUDA only: queue device copies with one cuMemcpyBatchAsync call
        #: instead of one cuMemcpyDtoDAsync per tensor (measured on an H200,
        #: 820 tensors / 30.9 GB: update_from 19.5 ms vs 21.2 ms).
        self.batch_copies = True
        self._plan: tuple | None = None
        #: A module whose tensors are this region's views (:meth:`from_module`, or a receiver's
        #: ``receive(into=...)``): checked by :meth:`ensure_current` before the region is read.
        self.binding: Any = None

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
        items = items_of(tensors)
        if not items:
            raise ValueError("from_tensors needs at least one tensor")
        aliases = aliases_of(items)
        sources = [(name, as_source(name, obj, kind == "cuda")) for name, obj in items if name not in aliases]
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
    def from_module(cls, module: Any, device: str | None = None, chunk_size: int | None = None,
                    alignment: int | None = None, metadata: Mapping[str, str] | None = None) -> TensorRegion:
        """Move a torch module's weights into one new region: its parameters and buffers *become* the region.

        Every parameter and persistent buffer (``state_dict`` names; tied weights stored once) is copied into
        the region one at a time and re-pointed at its region view (``tensor.data = view``: the Parameter
        objects stay, so optimizers, hooks, ``forward``/``backward`` and ``state_dict()`` keep working), and
        its old storage is freed as it goes: memory peaks at about the model plus its largest tensor, not
        two models.  Afterwards sending the region sends the current weights -- no :meth:`update_from`.

        Parameters
        ----------
        module : torch.nn.Module
        device : str, optional
            Where the region lives (default: where the module's first parameter is).  Tensors elsewhere
            move there.
        chunk_size, alignment, metadata
            As for :meth:`from_tensors`.

        A tensor that is later replaced (``module.to(...)``, ``load_state_dict(assign=True)``, a new
        ``.data``) no longer lives in the region: :meth:`ensure_current` (every send calls it) raises
        :class:`~tensorxfer.errors.BindingError` naming it, so stale bytes are never sent.  On a GPU region
        sends also wait for the work queued on the device (the optimizer's step).

        Raises
        ------
        TypeError
            Not a module, or a tensor of an unsupported dtype (nothing was moved).
        CudaError
            A CUDA device was asked for and CUDA is not usable.

        If moving fails part way, the module keeps working: tensors already moved stay in the (closed)
        region's memory, which their views keep alive; the rest stay where they were.
        """
        from tensorxfer import binding

        return binding.adopt(cls, module, device, chunk_size, alignment, metadata)

    @classmethod
    def from_safetensors(cls, sources: Any, device: str = "cpu", progress: Any = None,
                         on_layout: Any = None, private: bool = False) -> TensorRegion:
        """Read safetensors files straight into one new region on ``device``.

        ``sources``: files, a model directory (its index, shards and side files -- config, tokenizer --
        which travel in the manifest's metadata, so a receiver can write the directory back byte for byte)
        or a :class:`~tensorxfer.files.Discovery`.  Headers are checked as hostile input (as the CLI does).
        Host regions are read into directly (no intermediate buffer); GPU regions through pinned buffers,
        the disk filling one while the copy engine drains the other.  ``on_layout(manifest)`` is called once
        the headers are read, ``progress(n)`` after every ``n`` bytes of tensors read.  ``private`` (host
        regions): as for :meth:`from_manifest`.

        Raises
        ------
        FileFormatError
            A file is malformed, or two files hold a tensor of the same name.
        CudaError
            ``device`` is a GPU this machine cannot use.
        OSError
            A file cannot be read.
        """
        region, loader = cls.for_safetensors(sources, device, progress, on_layout, private)
        try:
            loader.run()
        except BaseException:
            region.close()
            raise
        return region

    @classmethod
    def for_safetensors(cls, sources: Any, device: str = "cpu", progress: Any = None,
                        on_layout: Any = None, private: bool = False) -> tuple[TensorRegion, Any]:
        """The region for safetensors files (headers read and checked, memory allocated, nothing read yet)
        and the :class:`~tensorxfer.files.Loader` that fills it: ``loader.run()`` here, or ``loader.start()``
        to read in the background while a Sender sends what was read (``tensorxfer-send`` does).  The
        caller joins the loader before closing the region.  ``sources`` may also be the
        :class:`~tensorxfer.files.LoadPlan` of headers read already.  Raises as :meth:`from_safetensors`."""
        from tensorxfer.files import load

        plan = sources if isinstance(sources, load.LoadPlan) else \
            load.plan_load([sources] if isinstance(sources, str | os.PathLike) else sources)
        if parse_device(device)[0] == "cuda":
            self = cls.from_manifest(plan.manifest, device)         # zeroed: no stale device bytes between tensors
        else:
            # pages come as the reads fill them
            self = cls._allocate(plan.manifest, device, None, commit=False, private=private)
        try:
            if on_layout is not None:
                on_layout(plan.manifest)
        except BaseException:
            self.close()
            raise
        return self, load.Loader(self, plan.jobs, progress)

    def ensure_current(self) -> None:
        """Check, before reading the region (a send), that a bound module's tensors still live in it and
        that work queued on them finished.  A no-op for a region no module is bound to.

        Raises
        ------
        BindingError
            A bound tensor was replaced (named in the error).
        """
        if self.binding is not None:
            self.binding.check()

    @classmethod
    def from_manifest(cls, manifest: Manifest, device: str = "cpu", chunk_size: int | None = None,
                      commit: bool = True, private: bool = False) -> TensorRegion:
        """Allocate a zeroed region with ``manifest``'s layout (to receive into).  ``commit=False`` (host
        regions) leaves the pages to be committed as they are first written, by whoever writes them;
        ``private=True`` (host regions) backs it with this process's own memory, on huge pages where allowed:
        cheaper to fill and to free, but not sendable over ipc (:meth:`HostRegion.allocate`)."""
        self = cls._allocate(manifest, device, chunk_size, commit=commit, private=private)
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
    def _allocate(cls, manifest: Manifest, device: str, chunk_size: int | None,
                  commit: bool = True, private: bool = False) -> TensorRegion:
        kind, index = parse_device(device)
        size = max(manifest.nbytes, 1)
        region: Any
        if kind == "cuda":
            if _memory.CudaRegion is None:
                raise CudaError(f"device {device!r}: {_memory.CUDA_UNAVAILABLE}")
            region = _memory.CudaRegion.allocate(size, chunk_size, index)
            device = f"cuda:{index}"
        else:
            region = HostRegion.allocate(size, chunk_size, commit=commit, private=private)
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
            torch = torch_module()
            return {t.name: torch.from_dlpack(r).view(getattr(torch, _dt.DTYPES[t.dtype].torch_name)).reshape(t.shape)
                    for t, r in zip(specs, raws)}
        if framework == "numpy":
            raise ValueError(f"this region lives on {self.device}: use framework='torch' or 'cupy'")
        device_bytes = self.region.cuda_array(0, max(self.manifest.nbytes, 1))
        if framework == "torch":
            torch = torch_module()
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
        items = items_of(tensors)
        if self.is_cuda and self._replay_plan(items):
            return
        sources = [(name, as_source(name, obj, self.is_cuda)) for name, obj in items]
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
        if not all(isinstance(s, DeviceSource) and is_torch(s.keepalive) and s.keepalive is obj
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
        torch_module().cuda.synchronize()
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
        if any(isinstance(s, DeviceSource) and is_torch(s.keepalive) for _, s in sources):
            # Work queued on PyTorch's streams must land before our stream reads it.
            torch_module().cuda.synchronize()

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
                write_from(self, manifest[name].offset, host_bytes(src))
            return
        copier = self._get_copier()
        base = self.region.ptr
        dev = [(manifest[name], src) for name, src in sources if isinstance(src, DeviceSource)]
        dev = [(t, src) for t, src in dev if t.nbytes]
        if dev:
            copier.dtod_batch(np.fromiter((base + t.offset for t, _ in dev), np.uint64, len(dev)),
                              np.fromiter((src.ptr for _, src in dev), np.uint64, len(dev)),
                              np.fromiter((t.nbytes for t, _ in dev), np.uint64, len(dev)),
                              batch_api=self.batch_copies)
        for name, src in sources:
            if not isinstance(src, DeviceSource) and src.nbytes:
                write_from(self, manifest[name].offset, host_bytes(src), stager=copier)

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
        self.binding = None
        if self._copier is not None:
            self._copier.close()   # drains its stream before the memory can go
            self._copier = None
        files, self.source_files = self.source_files, None
        for _, _, fd in files or ():
            os.close(fd)
        self.region.close()

    def __enter__(self) -> TensorRegion:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.nbytes} bytes"
        return f"<TensorRegion {len(self.manifest)} tensors, {state}, device {self.device!r}>"
