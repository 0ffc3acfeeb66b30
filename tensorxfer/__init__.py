"""tensorxfer: move whole models between processes and machines at line rate.

Public API (everything else is private):

- :class:`TensorRegion` — many tensors packed into one region, one manifest.
- :class:`Manifest` / :class:`TensorSpec` — the validated msgpack layout.
- :class:`Sender` / :class:`Receiver` — sessions moving regions (TCP today).
- :class:`HostRegion` — one virtual range backed by many memfd chunks.
- the exception tree in :mod:`tensorxfer.errors`.
"""

from tensorxfer.errors import (
    AuthError,
    ChecksumMismatch,
    CudaError,
    ExtentError,
    LayoutError,
    ManifestError,
    PeerLost,
    ProtocolError,
    RegionError,
    TensorXferError,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
    VerbsError,
)
from tensorxfer.manifest import Manifest, TensorSpec
from tensorxfer.memory import Extent, HostRegion
from tensorxfer.region import TensorRegion
from tensorxfer.session import Receiver, Sender, TransferStats

__version__ = "0.1.0"

__all__ = [
    "AuthError",
    "ChecksumMismatch",
    "CudaError",
    "Extent",
    "ExtentError",
    "HostRegion",
    "LayoutError",
    "Manifest",
    "ManifestError",
    "PeerLost",
    "ProtocolError",
    "Receiver",
    "RegionError",
    "Sender",
    "TensorRegion",
    "TensorSpec",
    "TensorXferError",
    "TransferError",
    "TransferStats",
    "TransferTimeout",
    "TransportUnavailable",
    "VerbsError",
    "__version__",
]
