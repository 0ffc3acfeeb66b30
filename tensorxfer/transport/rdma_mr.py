"""One memory registration over a region's resolved extent (every backing handle), for the rdma transport."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from tensorxfer.errors import CudaError, VerbsError

log = logging.getLogger("tensorxfer.rdma")


def register_region(pd: Any, region: Any, nbytes: int, access: int, *, _first_chunk_only: bool = False) -> Any:
    """Register ONE MR over the resolved extent of ``region[0:nbytes]``.

    The extent comes from ``region.resolve_extent``, which walks every
    backing handle, so the MR covers all of them (the UCX bug registered
    only the handle holding the first address).  ``_first_chunk_only``
    reproduces that bug on purpose, for tests only.

    Device regions offering ``export_dmabuf()`` (returning an fd over the
    resolved extent) go through ``ibv_reg_dmabuf_mr`` first and fall back to
    ``ibv_reg_mr`` on the device address; the returned MR's ``path`` says
    which was used, and a fallback is logged with the dmabuf error.

    Raises
    ------
    ExtentError
        ``[0, nbytes)`` is not fully mapped.
    VerbsError
        Registration failed.
    """
    ext = region.resolve_extent(0, nbytes)
    ptr, length = int(ext.ptr), int(ext.length)
    if _first_chunk_only:
        base, size = region.allocation_at(0)
        length = min(length, base + size - ptr)
        log.warning("TEST SWITCH: registering only the first handle (%d of %d bytes), as UCX did", length, nbytes)
    export = getattr(region, "export_dmabuf", None)
    if export is not None and getattr(region, "device", "cpu") != "cpu":
        fd = -1
        try:
            fd = int(export(0, length)) if _accepts_range(export) else int(export())
            mr = pd.reg_dmabuf_mr(fd, 0, length, ptr, access, owner=region)
        except (VerbsError, CudaError, OSError, ValueError) as exc:   # CudaError: no dmabuf export here
            log.warning("dmabuf registration failed (%s); falling back to ibv_reg_mr on the device address "
                        "(needs nvidia-peermem)", exc)
        else:
            log.info("registered %d bytes with ibv_reg_dmabuf_mr", length)
            return mr
        finally:
            if fd >= 0:
                os.close(fd)  # the MR holds its own reference to the dmabuf
    mr = pd.reg_mr(ptr, length, access, owner=region)
    log.info("registered %d bytes over %d handle(s) with ibv_reg_mr", length, len(ext.segments))
    return mr


def _accepts_range(fn: Callable[..., Any]) -> bool:
    try:
        import inspect

        return len(inspect.signature(fn).parameters) >= 2
    except (TypeError, ValueError):
        return False


__all__ = ["register_region"]
