"""The tensorxfer exception tree.

Every error tensorxfer raises on purpose derives from :class:`TensorXferError`,
so ``except tensorxfer.TensorXferError`` catches all of them.  Where a standard
exception already means the same thing, ours derive from it too (a manifest
that fails validation is a ``ValueError``; a failed system call is an
``OSError`` carrying ``errno``), so generic handlers keep working.

Messages say what was asked, what happened and what to do about it.
"""

from __future__ import annotations


class TensorXferError(Exception):
    """Root of every error tensorxfer raises on purpose."""


class RegionError(TensorXferError, OSError):
    """Allocating, mapping or releasing region memory failed (carries ``errno``)."""


class RegionClosed(TensorXferError, ValueError):
    """The region was closed: it hands out no new views, handles or pointers.

    Views taken before :meth:`close` stay valid (the memory is released when
    the last of them is dropped); only new ones are refused.
    """


class HandleError(RegionError):
    """A memory handle offered for import is unusable; nothing was mapped.

    ``index`` is the handle's position in the list passed to
    ``import_handles``; the message says what is missing (not a memory file,
    shorter than its chunk, or not sealed against shrinking and growing).
    """

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


class ExtentError(TensorXferError, ValueError):
    """A byte range does not resolve to mapped, contiguous memory.

    ``address`` is the first address that is not usable (the start of a hole,
    or the end of the region for a request that runs past it).
    """

    def __init__(self, message: str, address: int | None = None) -> None:
        super().__init__(message)
        self.address = address


class CudaError(TensorXferError):
    """A CUDA driver call failed, or CUDA is not usable on this machine.

    ``result`` is the ``CUresult`` code (``None`` when CUDA is absent) and
    ``name`` its symbolic name, e.g. ``CUDA_ERROR_INVALID_VALUE``.
    """

    def __init__(self, message: str, result: int | None = None, name: str | None = None) -> None:
        super().__init__(message)
        self.result = result
        self.name = name


class VerbsError(TensorXferError, OSError):
    """A libibverbs call or an RDMA work completion failed.

    For completions ``status`` is the ``ibv_wc_status`` name, and ``qp_num``,
    ``offset`` and ``length`` locate the failed request in the region.
    """

    def __init__(
        self,
        *args: object,
        status: str | None = None,
        qp_num: int | None = None,
        offset: int | None = None,
        length: int | None = None,
    ) -> None:
        super().__init__(*args)
        self.status = status
        self.qp_num = qp_num
        self.offset = offset
        self.length = length


class ManifestError(TensorXferError, ValueError):
    """A manifest is malformed, inconsistent, or over a configured limit."""


class OfferRefused(ManifestError):
    """The receiver refused an update before any byte moved: its size limit, its output folder (full, holding
    another model, not writable), a verify-only receiver, a module the tensors do not fit.  ``reason``: the
    receiver's words; ``receiver_error``: the type of the error it raised (``OutputError``, ...), or None."""

    def __init__(self, message: str, reason: str | None = None, receiver_error: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason if reason is not None else message
        self.receiver_error = receiver_error


class LayoutError(TensorXferError, ValueError):
    """Tensors do not match a region's layout (names, dtypes or shapes differ)."""


class BindingError(TensorXferError, ValueError):
    """A module tensor bound to a region (``TensorRegion.from_module``) was replaced, so the region no longer
    holds it: ``tensor`` names it.  Raised before anything is sent."""

    def __init__(self, message: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


class PlanError(TensorXferError, ValueError):
    """Shard descriptions for a weight sync are invalid or cannot be planned.

    The message names the rank, the tensor and, where bytes are missing or
    claimed twice, the box (offsets and sizes per dimension) at fault.
    """


class ProtocolError(TensorXferError):
    """A peer sent a frame that is malformed, oversized, truncated or out of order."""


class AuthError(ProtocolError):
    """The peer failed authentication (wrong or missing token)."""


class StoreError(TensorXferError):
    """A record in a weight sync's rendezvous store is malformed, fails the group's authentication, or says
    something about this rank that it did not publish: ``key`` names the record.

    A store is shared (a torch TCPStore authenticates nobody; an etcd may serve others), so every record
    that steers bytes or membership is sealed with the group's token: a writer without it can make a
    step fail with this error, never steer a byte.
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class TransportUnavailable(TensorXferError):
    """A requested transport cannot run here; the message says why."""


class TransferError(TensorXferError):
    """A transfer did not complete."""


class QuantizationError(TransferError, ValueError):
    """A weight cannot be quantized as asked: ``tensor`` names it (a NaN or an infinity in a trainer's
    weights, found before any byte of the step was offered).  The step fails on the source and on every
    target it feeds; fix the weights, and the next push goes on.
    """

    def __init__(self, message: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor
        self.tile: int | None = None    # found as a pair quantized on the way: its quantizing tile (sync.fusing)


class PeerLost(TransferError, ConnectionError):
    """The peer closed the connection or died before the transfer completed."""


class TransferTimeout(TransferError, TimeoutError):
    """The peer stalled for longer than the configured timeout."""


class LinkDropped(TransferError):
    """Some data streams of an update broke (reset, closed, stalled); every other stream finished.

    Raised by a transport half only while the session allows the update to resume
    (``resumable`` set for it); the session then reconnects the broken streams and sends what did not
    land, or, when it cannot, raises :attr:`cause` -- the first stream's own :class:`PeerLost` or
    :class:`TransferTimeout` -- so a caller sees what it saw before recovery existed.

    ``errors`` maps each broken stream's index to its error; ``landed`` maps it to the bytes of its
    share of the update that were in place when it broke (a receiver's count: exact; a sender's:
    what it handed to the kernel); ``nbytes`` is the update's byte count; ``resent``: the bytes a sender's
    resume round had sent again before it broke too.
    """

    resent = 0

    def __init__(self, errors: dict[int, BaseException], landed: dict[int, int], nbytes: int) -> None:
        first = errors[min(errors)]
        super().__init__(f"{len(errors)} data stream(s) broke: {first}")
        self.errors, self.landed, self.nbytes = errors, landed, nbytes

    @property
    def cause(self) -> BaseException:
        return self.errors[min(self.errors)]

    def give_up(self, why: str) -> BaseException:
        """The first stream's error (its own type), saying why the update was not resumed."""
        cause = self.cause
        try:
            out = type(cause)(f"{cause}; not resumed: {why}")
        except TypeError:       # an error type that takes other arguments: raise it as it was
            return cause
        out.__cause__ = cause
        return out


class UpstreamFailed(TransferError):
    """A fan-out relay stopped forwarding: its own upstream transfer failed or stalled.

    Deliberately not an ``OSError``: a transport must not mistake it for the next hop's socket failing.
    """


class CompletionError(VerbsError, TransferError):
    """An RDMA work completion failed: the transfer did not complete, and the status says why.

    ``status`` names the ``ibv_wc_status`` (``IBV_WC_LOC_PROT_ERR``: the local
    MR does not cover the request; ``IBV_WC_REM_ACCESS_ERR``: the receiver's
    MR is gone or too small), ``qp_num``, ``offset`` and ``length`` locate
    the failed request in the region.  Never reported as :class:`PeerLost`:
    a completion error is a fact about the memory or the QP, not a guess
    about the peer.
    """


class ChecksumMismatch(TransferError):
    """Verified data differed from what the sender checksummed (``tensor`` names it)."""

    def __init__(self, message: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


__all__ = [
    "AuthError",
    "BindingError",
    "ChecksumMismatch",
    "CompletionError",
    "CudaError",
    "ExtentError",
    "HandleError",
    "LayoutError",
    "LinkDropped",
    "ManifestError",
    "OfferRefused",
    "PeerLost",
    "PlanError",
    "ProtocolError",
    "QuantizationError",
    "RegionClosed",
    "RegionError",
    "SharedWeightsWarning",
    "StoreError",
    "TensorXferError",
    "TransferError",
    "TransferTimeout",
    "TransportUnavailable",
    "VerbsError",
]


class SharedWeightsWarning(UserWarning):
    """A module's weights became another process's memory (``Receiver(share=True)`` with ``into=``), mapped
    copy-on-write: its numpy views are read-only; its torch tensors may be written in place, but the write
    stays in this process (the sender never sees it) and the pages it touched stop following the sender's
    updates.  Why not read-only, as before: torch has no read-only tensors, and one ``add_`` killed the
    process (SIGSEGV).  Why not detect the written pages at every update: ``/proc/self/smaps`` took 38 ms to
    read in a torch process on the dev VM, and ``pagemap`` grows with the model."""
