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

from tensorxfer.staging import read_pieces

if TYPE_CHECKING:
    from tensorxfer.region import TensorRegion

ALGORITHM = "xxh3_64"


#: Piece size for hashing: CUDA regions stage pieces this large through
#: pinned memory (the copy of the next overlaps hashing this one); host
#: regions are hashed in place, piece by piece, at no extra cost.
STAGE_BYTES = 8 << 20


def tensor_checksums(region: TensorRegion) -> list[int]:
    """xxh3_64 of every tensor's bytes, in manifest order.

    The payload is read once, in order, through
    :func:`~tensorxfer.staging.read_pieces` (zero-copy on host regions,
    double-buffered pinned staging on CUDA regions); each piece feeds the
    hashers of the tensors it overlaps.  Streaming xxh3 gives the same digest
    as hashing each tensor in one call.
    """
    offsets = region.manifest.offsets.tolist()
    sizes = region.manifest.sizes.tolist()
    hashers = [xxhash.xxh3_64() for _ in offsets]
    # tensors by offset (validated manifests never overlap, so their ends are in order too)
    order = sorted((i for i in range(len(offsets)) if sizes[i]), key=offsets.__getitem__)
    first = 0              # order[first:] are the tensors not yet hashed to their end
    with read_pieces(region, 0, region.nbytes, STAGE_BYTES) as pieces:
        for pos, view in pieces:
            end = pos + len(view)
            j = first
            while j < len(order) and offsets[order[j]] < end:
                t = order[j]
                lo, hi = max(offsets[t], pos), min(offsets[t] + sizes[t], end)
                if lo < hi:
                    hashers[t].update(view[lo - pos:hi - pos])
                j += 1
            while first < len(order) and offsets[order[first]] + sizes[order[first]] <= end:
                first += 1
    return [h.intdigest() for h in hashers]


def first_mismatch(region: TensorRegion, expected: list[int]) -> str | None:
    """The name of the first tensor whose checksum differs from ``expected`` (None if all match)."""
    for name, got, want in zip(region.manifest.names, tensor_checksums(region), expected):
        if got != want:
            return name
    return None
