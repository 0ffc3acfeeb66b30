"""tensorxfer: move whole models between processes and machines at line rate.

Public API (everything else is private):

- :class:`TensorRegion` — many tensors packed into one region, one manifest.
- :class:`Manifest` / :class:`TensorSpec` — the validated msgpack layout.
- :class:`Sender` / :class:`Receiver` — sessions moving regions (ipc, rdma, tcp);
  the Receiver is the session's with fan-out relaying plugged in
  (:class:`tensorxfer.fanout.Receiver`).
- :class:`FanoutSender` — one update to N receivers by chain pipelining
  (:class:`FanoutStats`, one :class:`ReceiverResult` each; :class:`Version`).
- :class:`HostRegion` — one virtual range backed by many memfd chunks.
- :class:`CudaRegion` — the same on a GPU (CUDA VMM handles); where the CUDA
  extension is not importable it is a stand-in whose every use raises
  :class:`CudaError` saying why.
- :mod:`tensorxfer.staging` — any region's bytes as host-visible pieces.
- the exception tree in :mod:`tensorxfer.errors`.
"""

from typing import TYPE_CHECKING, Any

from tensorxfer import memory as _memory
from tensorxfer.errors import (
    AuthError,
    BindingError,
    ChecksumMismatch,
    CudaError,
    ExtentError,
    HandleError,
    LayoutError,
    ManifestError,
    OfferRefused,
    PeerLost,
    PlanError,
    ProtocolError,
    QuantizationError,
    RegionClosed,
    RegionError,
    SharedWeightsWarning,
    StoreError,
    TensorXferError,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
    UpstreamFailed,
    VerbsError,
)
from tensorxfer.fanout import FanoutSender, FanoutStats, Receiver, ReceiverResult
from tensorxfer.manifest import Manifest, TensorSpec
from tensorxfer.memory import Extent, HostRegion
from tensorxfer.protocol import Version
from tensorxfer.region import TensorRegion
from tensorxfer.session import Sender, TransferStats

if TYPE_CHECKING:
    from tensorxfer import sync
    from tensorxfer.memory._cuda import CudaRegion
    from tensorxfer.sync import WeightSync
else:
    CudaRegion = _memory.CudaRegion if _memory.CudaRegion is not None else _memory.UnavailableCudaRegion


def __getattr__(name: str) -> Any:
    # The weight sync (its planner, store clients) is loaded on first use: sending and receiving need none
    # of it, and each tensorxfer-send / -recv process starts without it (~50 ms of imports on the dev VM).
    if name in ("sync", "WeightSync"):
        import importlib

        sync = importlib.import_module("tensorxfer.sync")   # also binds tensorxfer.sync
        globals()["WeightSync"] = sync.WeightSync
        return globals()[name]
    raise AttributeError(f"module 'tensorxfer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"sync", "WeightSync"})

__version__ = "0.1.0"

__all__ = [
    "AuthError",
    "BindingError",
    "ChecksumMismatch",
    "CudaError",
    "CudaRegion",
    "Extent",
    "ExtentError",
    "FanoutSender",
    "FanoutStats",
    "HandleError",
    "HostRegion",
    "LayoutError",
    "Manifest",
    "ManifestError",
    "OfferRefused",
    "PeerLost",
    "PlanError",
    "ProtocolError",
    "QuantizationError",
    "Receiver",
    "ReceiverResult",
    "RegionClosed",
    "RegionError",
    "Sender",
    "SharedWeightsWarning",
    "StoreError",
    "TensorRegion",
    "TensorSpec",
    "TensorXferError",
    "TransferError",
    "TransferStats",
    "TransferTimeout",
    "TransportUnavailable",
    "UpstreamFailed",
    "VerbsError",
    "Version",
    "WeightSync",
    "__version__",
    "sync",
]
