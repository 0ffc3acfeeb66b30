"""Per-tensor checksums for ``verify=True`` transfers.

The algorithm is xxh3_64 (the ``xxhash`` package, a dependency).  Measured on
the 2-core development VM over a 256 MiB buffer: xxh3_64 22.1 GB/s, crc32c
7.2 GB/s, zlib.crc32 2.1 GB/s — only xxh3 stays well above the loopback
transfer rate, so verifying costs a fraction of the transfer instead of
dominating it.  It detects accidental corruption (flipped bits, torn or
misplaced writes); it is not a cryptographic MAC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from tensorxfer.region import TensorRegion

ALGORITHM = "xxh3_64"


STAGE_BYTES = 8 << 20


def tensor_checksums(region: TensorRegion) -> list[int]:
    """xxh3_64 of every tensor's bytes, in manifest order.

    Host regions are hashed in place (zero-copy); CUDA regions stream through
    a pinned staging buffer, the next piece's copy queued while the current
    one is hashed.
    """
    if region.is_cuda:
        return _device_checksums(region)
    out = []
    with memoryview(region.region).cast("B") as view:
        for off, size in zip(region.manifest.offsets.tolist(), region.manifest.sizes.tolist()):
            with view[off:off + size] as piece:
                out.append(xxhash.xxh3_64_intdigest(piece))
    return out


def first_mismatch(region: TensorRegion, expected: list[int]) -> str | None:
    """The name of the first tensor whose checksum differs from ``expected`` (None if all match)."""
    for name, got, want in zip(region.manifest.names, tensor_checksums(region), expected):
        if got != want:
            return name
    return None


def _device_checksums(region: TensorRegion) -> list[int]:
    from tensorxfer.memory._cuda import Stager

    base = region.region.ptr
    pieces = []        # (tensor index, region offset, length): every tensor cut into staging-sized pieces
    for i, (off, size) in enumerate(zip(region.manifest.offsets.tolist(), region.manifest.sizes.tolist())):
        pieces += [(i, p, min(STAGE_BYTES, off + size - p)) for p in range(off, off + size, STAGE_BYTES)]
    hashers = [xxhash.xxh3_64() for _ in region.manifest.names]
    with Stager(region.region.device_index, STAGE_BYTES) as st:
        if pieces:
            st.start_dtoh(0, base + pieces[0][1], pieces[0][2])
        for k, (i, _, n) in enumerate(pieces):
            b = k & 1
            if k + 1 < len(pieces):
                st.start_dtoh(b ^ 1, base + pieces[k + 1][1], pieces[k + 1][2])
            st.wait(b)
            with st.view(b)[:n] as piece:
                hashers[i].update(piece)
    return [h.intdigest() for h in hashers]
