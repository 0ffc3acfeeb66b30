"""Where a receiver's updates land: its region slot, and the two ways an update lands in it.

The :class:`RegionSlot` holds the region a :class:`~tensorxfer.session.Receiver` lands updates in, across
its senders.  A :class:`CopyTarget` lands an update by copy into the slot's region (allocated from the
offer's manifest, reused while the layout stays the same); a :class:`ShareTarget` makes the sender's own
memory the slot's region (same host, ``share=True``).  The server session runs one update sequence for
both and calls the target at its points: :meth:`begin` (before accept), :meth:`prepare` (the
transport's descriptors), :meth:`while_landing` (the transport has the data on its way and only waits),
:meth:`landed` (every byte is there; before the ack).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Protocol

from tensorxfer.binding import ModuleBinding, Names
from tensorxfer.errors import SharedWeightsWarning
from tensorxfer.manifest import Manifest
from tensorxfer.region import TensorRegion
from tensorxfer.transport.base import ReceiverTransport, ShareReceiverTransport
from tensorxfer.transport.segments import Segments

log = logging.getLogger(__name__)


class RegionSlot:
    """The region a receiver's updates land in (reused for a same-layout offer), or None; and the module
    bound to it, if the caller asked for its updates to land in a module's tensors (``receive(into=...)``)."""

    def __init__(self, device: str, prefault: bool = True, private: bool = False) -> None:
        self.device = device
        self.prefault = prefault
        self.private = private      # host regions in this process's own memory (none to pass over ipc)
        self.region: TensorRegion | None = None
        self.binding: ModuleBinding | None = None
        self._warned = False        # SharedWeightsWarning: once per receiver

    def bind(self, module: Any, names: Names = None, copies_files: bool = False) -> None:
        """Land the next update in ``module``'s tensors (None: in the region alone).  ``copies_files``: the
        caller copies a same-host sender's files itself (``receive(on_files=)``), leaving the region -- and
        so a module's tensors -- unwritten: refused with a module (ValueError)."""
        if module is not None and copies_files:
            raise ValueError("receive(): give on_files= (files copied, region unwritten) or into=, not both")
        if module is None:
            self.binding = None
        elif self.binding is None or self.binding.module is not module or self.binding.names is not names:
            self.binding = ModuleBinding(module, names)

    def check_fit(self, manifest: Manifest) -> None:
        """Raise :class:`~tensorxfer.errors.LayoutError` if ``manifest`` does not fit the bound module."""
        if self.binding is not None:
            self.binding.validate(manifest)

    def attached(self, region: TensorRegion) -> bool:
        """Whether the bound module's tensors are all views of ``region`` (or no module is bound)."""
        return self.binding is None or self.binding.attached_to(region)

    def attach(self, region: TensorRegion) -> None:
        """Make the bound module's tensors views of ``region`` (again, if one was replaced meanwhile)."""
        if self.binding is not None and not self.binding.attached_to(region):
            if not region.is_cuda and region.region.readonly and not self._warned:
                self._warned = True
                warnings.warn(
                    "the module's weights are now the sender's memory, mapped copy-on-write: an in-place write into "
                    "them stays in this process (the sender never sees it), and the pages it touched no longer "
                    "follow the sender's updates; to write into received weights, receive without share=True",
                    SharedWeightsWarning, stacklevel=2)
            self.binding.attach(region)

    def for_manifest(self, manifest: Manifest, shareable: bool = False) -> tuple[TensorRegion, bool]:
        """The region ``manifest``'s update lands in, and whether it was re-allocated for a new layout.
        ``shareable``: its memory must have handles to pass on (a fan-out relay's), even in a private slot.

        Raises
        ------
        CudaError, RegionError, MemoryError
            The device cannot hold the region (the slot is then empty).
        """
        old = self.region
        if old is not None and not old.closed and old.manifest.same_layout(manifest) \
                and not (shareable and getattr(old.region, "private", False)):
            old.manifest = manifest     # same layout; metadata and checksums may be new
            return old, False
        if old is not None:
            log.info("offer changes the layout (%d -> %d tensors, %d -> %d bytes): re-allocating the region",
                     len(old.manifest), len(manifest), old.nbytes, manifest.nbytes)
            self.release()
        self.region = TensorRegion.from_manifest(manifest, device=self.device, commit=self.prefault,
                                                 private=self.private and not shareable)
        return self.region, old is not None

    def put(self, region: TensorRegion) -> bool:
        """Make ``region`` the slot's; the previous one is released unless it is the same.  Whether it changed."""
        old, self.region = self.region, region
        if old is not None and old is not region:
            old.close(defer=True)       # views the caller still holds keep the old memory alive
        return old is not region

    def release(self) -> None:
        """Empty the slot; the region is closed once no view of it is alive."""
        region, self.region = self.region, None
        if region is not None:
            region.close(defer=True)


class Target(Protocol):
    """How one update lands (see the module docstring)."""

    device: str
    region: TensorRegion | None     # where it lands, once known (a copy: after begin; shared: once landed)
    reallocated: bool
    verb: str                       # what happens to the bytes, for messages ("landed", "mapped")

    def begin(self, manifest: Manifest, shareable: bool = False) -> None: ...

    def prepare(self, transport: Any, seq: int, fresh: bool, segments: Segments | None = None) -> dict[str, Any]: ...

    def while_landing(self) -> None: ...

    def landed(self, transport: Any) -> TensorRegion: ...

    def failed(self) -> bool: ...

    def discard(self) -> None: ...


class CopyTarget:
    """An update lands by copy into the slot's region."""

    verb = "landed"

    def __init__(self, slot: RegionSlot) -> None:
        self._slot = slot
        self.device = slot.device
        self._previous: TensorRegion | None = None
        self.region: TensorRegion | None = None
        self.reallocated = False
        self._attached = False      # the bound module was found to be the region's views while it landed

    def begin(self, manifest: Manifest, shareable: bool = False) -> None:
        """Allocate (or reuse) the region (raises as :meth:`RegionSlot.for_manifest`; LayoutError before
        anything is allocated when the manifest does not fit a bound module)."""
        self._previous = self._slot.region
        self._attached = False
        self._slot.check_fit(manifest)
        self.region, self.reallocated = self._slot.for_manifest(manifest, shareable)

    def prepare(self, transport: ReceiverTransport, seq: int, fresh: bool,
                segments: Segments | None = None) -> dict[str, Any]:
        """The transport's descriptors; ``segments``: only those move (a partial update, session.partial)."""
        assert self.region is not None
        if segments is None:
            return transport.prepare(self.region, seq, fresh)
        return transport.prepare(self.region, seq, fresh, segments=segments)

    def while_landing(self) -> None:
        """Check, while the device copies run, that the bound module still is the region's views: that
        check of ~a thousand tensors then costs the update nothing (measured on the H200: it delayed a
        31.2 GB update's ack by ~0.7 ms when it ran after the copy).  Nothing is re-pointed here: a module
        that is not attached (the first update) must not show a half-landed region."""
        if self.region is not None:
            try:
                self._attached = self._slot.attached(self.region)
            except Exception:       # device copies may still run: any error is landed()'s to raise, after them
                self._attached = False

    def landed(self, transport: ReceiverTransport) -> TensorRegion:
        """The region the update landed in, the bound module's tensors its views.

        The module is (re)attached here, not in :meth:`begin`: the update lands in the region either way,
        and the check of ~a thousand tensors would delay every update's data there.  Not after the ack
        either: a sender that got it may rely on the receiver's module holding the update."""
        assert self.region is not None
        if not self._attached:          # unchecked (or found stale) while landing
            self._slot.attach(self.region)
        self._attached = False
        return self.region

    def failed(self) -> bool:
        """The update failed: whether memory allocated for it must be freed (after the session's transports
        are closed: an MR over GPU memory holds no reference to it, so remote write must end first)."""
        return self.region is not None and self.region is not self._previous

    def discard(self) -> None:
        """Free the region allocated for the failed update (a vanished sender leaves none behind)."""
        if self.region is not None and self._slot.region is self.region:
            self._slot.release()


class ShareTarget:
    """The sender's memory becomes the slot's region (nothing is allocated or copied)."""

    verb = "mapped"

    def __init__(self, slot: RegionSlot) -> None:
        self._slot = slot
        self.device = slot.device
        self._manifest: Manifest | None = None
        self.region: TensorRegion | None = None
        self.reallocated = True

    def begin(self, manifest: Manifest, shareable: bool = False) -> None:
        self._slot.check_fit(manifest)
        self._manifest = manifest

    def prepare(self, transport: ShareReceiverTransport, seq: int, fresh: bool,
                segments: Segments | None = None) -> dict[str, Any]:
        assert self._manifest is not None and segments is None     # nothing is held where nothing is copied
        return transport.prepare_share(self._manifest, self._slot.device, seq, fresh, previous=self._slot.region)

    def while_landing(self) -> None:
        pass        # the region is only known once the sender's memory is mapped

    def landed(self, transport: ShareReceiverTransport) -> TensorRegion:
        assert self._manifest is not None
        region = self.region = transport.take_shared()
        self.reallocated = self._slot.put(region)   # the same memory again: the region is reused as is
        region.manifest = self._manifest            # same layout when reused; metadata and checksums may be new
        self._slot.attach(region)
        return region

    def failed(self) -> bool:
        return False

    def discard(self) -> None:
        pass
