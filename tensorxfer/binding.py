"""A torch module's weights as views of a region: the model's live parameters *are* the region.

:func:`adopt` moves a module's parameters and persistent buffers into a new region one tensor at a time
(each one's old storage freed as it goes, so memory peaks at the model plus about its largest tensor,
not two models) and re-points every tensor at its region view (``tensor.data = view``: the Parameter
objects stay, so optimizers, hooks and ``state_dict()`` keep working).  A :class:`ModuleBinding` records
where each tensor must live and notices when one was replaced (``module.to(...)``,
``load_state_dict(assign=True)``, a re-assigned ``.data``): :meth:`ModuleBinding.check` raises
:class:`~tensorxfer.errors.BindingError` naming it, so stale bytes are never sent.  On a receiver,
:meth:`ModuleBinding.attach` makes a module's tensors views of a received region (checked against the
offer's manifest before any byte moves), so every later update lands in the live weights.

Each view has a storage of its own (not one storage for the whole region): code that looks for shared
storage (``safetensors``, ``save_pretrained``) sees exactly the sharing the module had (tied weights).
This module imports no region: :meth:`TensorRegion.from_module` passes itself in.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tensorxfer import dtypes as _dt
from tensorxfer import memory as _memory
from tensorxfer.errors import BindingError, CudaError, LayoutError
from tensorxfer.manifest import DEFAULT_ALIGNMENT, Manifest, TensorSpec
from tensorxfer.memory import HostRegion
from tensorxfer.sources import aliases_of, parse_device, torch_module

log = logging.getLogger(__name__)

#: While adopting, freed memory goes back to the system every this many bytes (GPU:
#: ``torch.cuda.empty_cache``; host: ``malloc_trim``): the allocators would otherwise keep the old copies,
#: and the machine would hold two models.  Measured on the 2-core dev VM, a 397 MB model: peak RSS 1.03x
#: the model at 16 MiB, 1.07x at 64 MiB, 1.19x at 256 MiB; per tensor (0) 1.03x.
RELEASE_EVERY_BYTES = 16 << 20

Names = Mapping[str, str | None] | Callable[[str], str | None] | None
"""How a received manifest's names map to a module's: a mapping (sender name -> module name; names it
does not list stay as they are), a callable, or None (the same names).  A sender name mapped to None is
left out: its bytes land in the received region (``receiver.region``), no module tensor views them (a
head the module does not have, ``GPT2LMHeadModel``'s ``lm_head.weight`` into a ``GPT2Model``)."""


@dataclass(frozen=True)
class _Slot:
    """Where a module keeps one tensor: ``owner._parameters[attr]`` or ``owner._buffers[attr]``."""

    name: str
    owner: Any
    attr: str
    parameter: bool

    def get(self) -> Any:
        return (self.owner._parameters if self.parameter else self.owner._buffers).get(self.attr)


@dataclass(frozen=True)
class _Held:
    """A tensor the caller holds (no module): it is re-pointed in place, so every holder sees the region."""

    name: str
    tensor: Any

    def get(self) -> Any:
        return self.tensor


def module_slots(module: Any) -> list[_Slot]:
    """The module's parameters and persistent buffers by ``state_dict`` name, in ``state_dict`` order; a
    tensor shared by several modules (tied weights) appears under every name."""
    out = []
    for prefix, mod in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        out += [_Slot(dot + n, mod, n, True) for n, p in mod._parameters.items() if p is not None]
        out += [_Slot(dot + n, mod, n, False) for n, b in mod._buffers.items()
                if b is not None and n not in mod._non_persistent_buffers_set]
    return out


def _device_of(slots: list[Any]) -> str:
    t = slots[0].get()
    return "cpu" if t.device.type == "cpu" else f"cuda:{t.device.index or 0}"


def shares_memory(t: Any, others: bool = True) -> bool:
    """Whether another tensor holds ``t``'s memory too: ``t`` is a view (a slice, a transpose) or over part
    of a storage (a parameter over a flat buffer), or -- with ``others`` -- a view of it is alive or it is an
    alias such as a parameter's ``.data``.  Re-pointing ``t`` into a region then moves ``t`` alone: the other
    keeps the old memory, and whoever reads or writes through it (the optimizer stepping the parameter, the
    engine reading its weight) silently parts from what the region holds.  The count of tensors on a
    storage is torch's own (``_storage_Use_Count``: ``t`` and the storage object asked for; a torch without
    it is asked about ``t`` alone).  It also counts the views autograd saved for a backward still to come:
    harmless to move away from (that graph keeps its bytes), so a trainer's modules are asked without
    ``others``."""
    import torch

    if t.numel() == 0:
        return False    # no bytes to part on (and a region's view of none keeps one byte)
    if t._base is not None or t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return True     # a view, or over part of a storage (``param.data = flat[a:b].view(...)`` leaves no _base)
    count = getattr(torch._C, "_storage_Use_Count", None) if others else None
    return count is not None and count(t.untyped_storage()._cdata) > 2


def _refuse_shared(items: Sequence[tuple[str, Any]], others: bool) -> None:
    """BindingError naming the first tensor of ``items`` that shares its memory (:func:`shares_memory`): moved
    into a region and re-pointed, it would part from the other (the flat buffer an optimizer writes, the
    engine's own weight), silently."""
    for name, t in items:
        if shares_memory(t, others):
            raise BindingError(f"tensor {name!r} shares its memory with another tensor (it is a view or a "
                               f"parameter's .data{', or a view of it is alive' if others else ''}): moved into the "
                               f"region, the other would keep the old bytes; give the tensor that owns the memory "
                               f"(the nn.Parameter itself)", tensor=name)


def tensor_view(region: Any, spec: TensorSpec) -> Any:
    """A torch tensor over ``spec``'s bytes in ``region`` (a TensorRegion), with a storage of its own that
    keeps the region's memory mapped."""
    torch = torch_module()
    dtype = getattr(torch, _dt.DTYPES[spec.dtype].torch_name)
    mem = region.region
    if region.is_cuda:
        raw = torch.as_tensor(mem.cuda_array(spec.offset, max(spec.nbytes, 1)), device=region.device)
    else:
        import numpy as np

        raw = torch.from_dlpack(np.frombuffer(mem, dtype=np.uint8, count=max(spec.nbytes, 1), offset=spec.offset))
    return raw[:spec.nbytes].view(dtype).reshape(spec.shape)


class ModuleBinding:
    """Which tensor of a module lives where in a region, checked before every send (see the module).

    ``names`` maps the region's (manifest's) names to the module's (see :data:`Names`).
    """

    def __init__(self, module: Any, names: Names = None, slots: list[Any] | None = None) -> None:
        self.module = module
        self.names = names
        self._slots = {s.name: s for s in (module_slots(module) if slots is None else slots)}
        # (the dict holding the tensor or the tensor itself, its key, the data pointer it must have, its name)
        self._fast: list[tuple[Any, Any, int, str]] = []
        self._where: list[tuple[dict[str, Any], str]] = []     # the same, split for the one-pass check
        self._held: list[Any] = []
        self._ptrs: list[int] = []
        self.region: Any = None
        self._fits: Manifest | None = None              # the manifest last validated (manifests are immutable)

    def module_name(self, name: str) -> str | None:
        """The module's name for the sender's ``name`` (None: left out)."""
        names = self.names
        if names is None:
            return name
        return names(name) if callable(names) else names.get(name, name)

    # -------------------------------------------------------- receiving
    def validate(self, manifest: Manifest) -> None:
        """Check that ``manifest`` fits the module exactly, before any byte moves.

        Raises
        ------
        LayoutError
            A name the module does not have (or a tensor of the module the manifest lacks), or a shape or
            dtype that differs; the message names them.
        BindingError
            A module tensor is a view (of a flat buffer, say): named.
        """
        if manifest is self._fits and all(d.get(k) is not None for d, k in self._where):
            return      # a warm update offers the very same manifest object: checking 820 tensors again costs ms
        missing, wrong, gone, seen, shared = [], [], [], set(), []
        for spec in manifest:
            name = self.module_name(spec.name)
            if name is None:
                continue            # left out on purpose
            slot = self._slots.get(name)
            if slot is None:
                missing.append(spec.name if name == spec.name else f"{spec.name} (as {name})")
                continue
            seen.add(name)
            t = slot.get()
            if t is None:       # set to None or deleted since the module was bound
                gone.append(name)
                continue
            dt = _dt.from_torch(t.dtype).name
            if dt != spec.dtype or tuple(t.shape) != spec.shape:
                wrong.append(f"{name}: the module has {dt}{list(t.shape)}, the offer {spec.dtype}{list(spec.shape)}")
            shared.append((name, t))
        extra = [n for n in self._slots if n not in seen]
        if gone:
            raise LayoutError(f"module tensor(s) {gone[:5]} were set to None or deleted since the module was bound: "
                              f"nothing was received; give the module those tensors back, or receive into a "
                              f"module that has them")
        _refuse_shared(shared, others=False)    # re-pointed, the buffer it is a view of would keep the old bytes
        if missing or wrong or extra:
            parts = ([f"not in the module: {missing[:5]}"] if missing else []) + \
                    ([f"not in the offer: {extra[:5]}"] if extra else []) + wrong[:5]
            # a rename map fixes names; a dtype or shape needs the module (or the sender) to change
            fix = ("give a rename map with names=...; map a sender's name to None to leave it out" if not wrong else
                   "the module must hold the sender's dtypes and shapes (cast it, e.g. model.to(dtype), or send "
                   "in the module's dtype)" if not (missing or extra) else
                   "names differ (give a rename map with names=...) and dtypes or shapes differ (the module "
                   "must hold the sender's)")
            raise LayoutError(f"the offer does not fit the module ({fix}): " + "; ".join(parts))
        self._fits = manifest

    def attach(self, region: Any) -> None:
        """Make every bound tensor a view of its bytes in ``region`` (nothing is copied; the old storages are
        freed once nothing else holds them)."""
        bound = []
        views: dict[str, Any] = {}
        aliases = region.manifest.aliases
        for spec in region.manifest:
            name = self.module_name(spec.name)
            if name is None:
                continue
            target = aliases.get(spec.name, spec.name)
            view = views.get(target)
            if view is None:
                view = views[target] = tensor_view(region, region.manifest[target])
            slot = self._slots[name]
            slot.get().data = view
            bound.append((slot, view.data_ptr()))
        self._remember(bound)
        self.region = region

    def record(self, region: Any) -> None:
        """The module's tensors are views of ``region`` already (they were moved in): remember where."""
        self._remember([(slot, slot.get().data_ptr()) for slot in self._slots.values()])
        self.region = region

    def attached_to(self, region: Any) -> bool:
        """Whether every bound tensor still is its view of ``region``."""
        return self.region is region and self._stale() is None

    # -------------------------------------------------------- sending
    def check(self) -> None:
        """Before the region is read (sent): every bound tensor must still be its region view, and work queued
        on a GPU region's tensors (an optimizer step) must have finished.

        Raises
        ------
        BindingError
            A tensor was replaced; it names the tensor and what to do.
        """
        self._refuse_stale("module tensor {} no longer lives in the region it was adopted into (it was replaced: "
                           "module.to(), load_state_dict(assign=True) or a new .data): its region bytes are stale, "
                           "so nothing was sent; adopt the module again (TensorRegion.from_module) or copy it in "
                           "with update_from")
        if self.region is not None and self.region.is_cuda:
            torch_module().cuda.synchronize(self.region.device)    # the optimizer's kernels landed

    def check_landing(self) -> None:
        """Before a step's bytes land in the region (a weight-sync target's wait): every bound tensor must
        still be its region view -- an engine that replaced one (re-allocated or re-laid out its weight after
        the sync adopted it) would read its own memory while the steps land in the region, stale for good.

        Raises
        ------
        BindingError
            A tensor was replaced; it names the tensor and what to do.
        """
        self._refuse_stale("target tensor {} no longer lives in the sync's region (it was replaced after the "
                           "WeightSync adopted it: a new .data, module.to(), post-load processing), so a step would "
                           "land where it is not read: nothing was taken in; build the WeightSync from the tensors "
                           "as they are served (after the engine's processing)")

    def _refuse_stale(self, why: str) -> None:
        """BindingError naming the first bound tensor that is no longer its region view (``why``, its name
        in the braces)."""
        stale = self._stale()
        if stale is not None:
            raise BindingError(why.format(repr(stale)), tensor=stale)

    def _stale(self) -> str | None:
        # Every send (and every receive into a module) asks this of ~a thousand tensors: one comprehension
        # compared with the remembered pointers in C, and a second pass only to name what changed.
        try:
            now = [d[k].data_ptr() for d, k in self._where] + [t.data_ptr() for t in self._held]
        except (KeyError, AttributeError):      # removed from its module, or set to None
            now = None
        if now == self._ptrs:
            return None
        for holder, key, ptr, name in self._fast:
            t = holder.get(key) if key is not None else holder
            if t is None or t.data_ptr() != ptr:
                return name
        return None

    def _remember(self, bound: list[tuple[Any, int]]) -> None:
        self._fast = [((s.owner._parameters if s.parameter else s.owner._buffers), s.attr, ptr, s.name)
                      if isinstance(s, _Slot) else (s.tensor, None, ptr, s.name) for s, ptr in bound]
        self._where = [(holder, key) for holder, key, _, _ in self._fast if key is not None]
        self._held = [holder for holder, key, _, _ in self._fast if key is None]
        self._ptrs = [ptr for _, key, ptr, _ in self._fast if key is not None] + \
                     [ptr for _, key, ptr, _ in self._fast if key is None]


def adopt(cls: Any, module: Any, device: str | None = None, chunk_size: int | None = None,
          alignment: int | None = None, metadata: Mapping[str, str] | None = None) -> Any:
    """:meth:`TensorRegion.from_module` (see there); ``cls`` is the TensorRegion class."""
    torch = torch_module()
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"from_module needs a torch.nn.Module, got {type(module).__name__}")
    slots = module_slots(module)
    if not slots:
        raise ValueError("from_module: the module has no parameters or persistent buffers to adopt")
    return _adopt_slots(cls, module, slots, device, chunk_size, alignment, metadata)


def adopt_tensors(cls: Any, tensors: Mapping[str, Any], device: str | None = None,
                  chunk_size: int | None = None) -> Any:
    """Like :func:`adopt` for named torch tensors the caller holds (an inference engine's weights, say):
    each is moved into the region and re-pointed in place (``tensor.data = view``).

    Raises
    ------
    TypeError
        A value is not a torch tensor, or of an unsupported dtype (nothing was moved).
    """
    torch = torch_module()
    bad = [n for n, t in tensors.items() if not isinstance(t, torch.Tensor)]
    if bad or not tensors:
        raise TypeError(f"adopt needs named torch tensors; not tensors: {bad[:5]}" if bad else "nothing to adopt")
    slots = [_Held(n, t) for n, t in tensors.items()]
    return _adopt_slots(cls, None, slots, device, chunk_size, None, None)


def _adopt_slots(cls: Any, module: Any, slots: list[Any], device: str | None, chunk_size: int | None,
                 alignment: int | None, metadata: Mapping[str, str] | None) -> Any:
    kind, index = parse_device(device or _device_of(slots))
    items = [(s.name, s.get()) for s in slots]
    for name, t in items:
        try:
            _dt.from_torch(t.dtype)
        except TypeError as e:
            raise TypeError(f"module tensor {name!r}: {e}") from None
    _refuse_shared(items, others=module is None)     # held tensors: an engine's, never under a backward
    aliases = aliases_of(items)
    manifest = Manifest.layout([(name, _dt.from_torch(t.dtype).name, tuple(t.shape)) for name, t in items],
                               alignment=alignment or DEFAULT_ALIGNMENT, metadata=metadata, aliases=aliases)
    if kind == "cuda":
        if _memory.CudaRegion is None:
            raise CudaError(f"device 'cuda:{index}': {_memory.CUDA_UNAVAILABLE}")
        mem = _memory.CudaRegion.reserve(max(manifest.nbytes, 1), chunk_size, index)   # mapped as tensors move in
        region = cls(mem, manifest, f"cuda:{index}")
    else:
        region = cls(HostRegion.allocate(max(manifest.nbytes, 1), chunk_size, commit=False), manifest, "cpu")
    binding = ModuleBinding(module, slots=slots)
    try:
        _move_in(region, slots, aliases)
        binding.record(region)
    except BaseException:
        # Tensors already moved keep working: their views hold the (closed) region's memory.
        region.close()
        raise
    region.binding = binding
    return region


def _move_in(region: Any, slots: list[Any], aliases: dict[str, str]) -> None:
    """Copy each tensor into its region view and re-point it there, freeing its old storage as it goes."""
    torch = torch_module()
    manifest = region.manifest
    by_name = {s.name: s for s in slots}
    holders: dict[str, list[Any]] = {}
    for s in slots:
        holders.setdefault(aliases.get(s.name, s.name), []).append(s)
    order = sorted(holders, key=lambda n: manifest[n].offset)
    freed = 0
    for name in order:
        spec = manifest[name]
        if region.is_cuda:
            need = min(spec.offset + spec.nbytes, region.region.size)
            while region.region.mapped_size < need:
                region.region.map_next()
        view = tensor_view(region, spec)
        with torch.no_grad():
            view.copy_(by_name[name].get().detach())
        for slot in holders[name]:
            slot.get().data = view      # the old storage is freed here, once nothing else holds it
        freed += spec.nbytes
        if freed >= RELEASE_EVERY_BYTES:
            _release(region)
            freed = 0
    if region.is_cuda:
        while region.region.mapped_size < region.region.size:
            region.region.map_next()
    _release(region)


def _release(region: Any) -> None:
    """Give the memory of the storages freed so far back to the system (not to an allocator's cache)."""
    if region.is_cuda:
        torch_module().cuda.empty_cache()       # synchronizes first: no copy still reads a freed block
    else:
        _malloc_trim()


def _malloc_trim() -> None:
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


_LIBC: list[Any] = []


def _libc() -> Any:
    if not _LIBC:
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name) if name else None
            _LIBC.append(lib if lib is not None and hasattr(lib, "malloc_trim") else None)
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]
