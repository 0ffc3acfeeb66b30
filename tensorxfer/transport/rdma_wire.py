"""What the two ends of the rdma transport must agree on, checked and computed without a device: the peer's
descriptors (:func:`check_peer`), and the stripe of a write over the QPs -- request ``i`` of a range on QP
``i % nq``, so QP ``q``'s ``k``-th request is request ``k * nq + q`` (:func:`qp_requests`,
:func:`share_bytes`: what a broken update's marks say landed), or a weight sync's explicit requests
(:func:`scatter_table`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tensorxfer.errors import ProtocolError
from tensorxfer.protocol import int_in

PROTOCOL_VERSION = 1


def check_peer(peer: Any, role: str) -> dict[str, Any]:
    """Validate a peer's descriptors dict; a malformed one is a ProtocolError."""
    if not isinstance(peer, dict):
        raise ProtocolError(f"RDMA {role} descriptors must be a dict, got {type(peer).__name__}")
    if peer.get("transport") != "rdma" or peer.get("version") != PROTOCOL_VERSION:
        raise ProtocolError(f"not RDMA v{PROTOCOL_VERSION} descriptors: transport={peer.get('transport')!r} "
                            f"version={peer.get('version')!r}")
    need: dict[str, type | tuple[type, ...]] = {"qps": list, "lid": int, "gid": bytes, "mtu": int,
                                               "link_layer": str, "role": str}
    for key, typ in need.items():
        if not isinstance(peer.get(key), typ):
            raise ProtocolError(f"RDMA descriptors: {key!r} missing or not {typ}")
    if peer["role"] != role:
        raise ProtocolError(f"expected {role} descriptors, got {peer['role']!r}")
    for q in peer["qps"]:
        if not (isinstance(q, dict) and int_in(q.get("qp_num"), 1, 1 << 24) and int_in(q.get("psn"), 0, 1 << 24)):
            raise ProtocolError("RDMA descriptors: every QP needs 'qp_num' in [1, 2^24) and 'psn' in [0, 2^24)")
    if len(peer["gid"]) != 16:
        raise ProtocolError("RDMA descriptors: 'gid' must be 16 bytes")
    if not int_in(peer["lid"], 0, 1 << 16):
        raise ProtocolError(f"RDMA descriptors: 'lid' must be in [0, 65536), got {peer['lid']}")
    if peer["mtu"] not in MTU_BYTES:
        raise ProtocolError(f"RDMA descriptors: 'mtu' must be one of {MTU_BYTES} (bytes), got {peer['mtu']}")
    if role == "receiver":
        for key, end in (("addr", 1 << 64), ("rkey", 1 << 32), ("length", 1 << 64)):
            if not int_in(peer.get(key), 0, end):
                raise ProtocolError(f"RDMA receiver descriptors: {key!r} missing or not an int in [0, {end:#x})")
        if peer["addr"] + peer["length"] > 1 << 64:
            raise ProtocolError("RDMA receiver descriptors: 'addr' + 'length' is past the end of the address space")
    return peer


#: Path MTUs a port can report (``ibv_mtu``), in bytes: what descriptors carry.
MTU_BYTES = (256, 512, 1024, 2048, 4096)


def qp_requests(q: int, nq: int, wr_size: int, length: int) -> int:
    """Requests QP ``q`` of ``nq`` carries in a striped write of ``length`` bytes (at least its final immediate)."""
    nwr = -(-length // wr_size)
    return max(1, (nwr - q + nq - 1) // nq if q < nwr else 0)


def share_bytes(q: int, k: int, nq: int, wr_size: int, length: int) -> int:
    """Bytes in the first ``k`` requests of QP ``q``'s share of a striped write (request ``i`` of the range is
    ``[i * wr_size, min((i + 1) * wr_size, length))``, on QP ``i % nq``; data-less final immediates carry 0)."""
    nwr = -(-length // wr_size)
    data = (nwr - q + nq - 1) // nq if q < nwr else 0
    n = min(k, data)
    out = n * wr_size
    if n and (nwr - 1) % nq == q and n == data:     # the region's last, short request is among them
        out -= nwr * wr_size - length
    return out


def scatter_table(runs: Any, wr_size: int, local_size: int, remote_size: int) -> tuple[np.ndarray, int]:
    """The write loop's request table for ``runs`` = (local offsets, remote offsets, bytes): each run cut into
    requests of at most ``wr_size``, as (local, remote, bytes) triples; and the byte count.

    Raises
    ------
    ValueError
        A run reaches past either region (the two ends planned different transfers).
    """
    src, dst, n = (np.asarray(a, dtype=np.uint64) for a in runs)
    keep = n > 0
    src, dst, n = src[keep], dst[keep], n[keep]
    if len(n) and (int((src + n).max()) > local_size or int((dst + n).max()) > remote_size):
        raise ValueError(f"a run reaches past the regions ({local_size} bytes here, {remote_size} there)")
    pieces = ((n + np.uint64(wr_size - 1)) // np.uint64(wr_size)).astype(np.int64)
    group = np.repeat(np.arange(len(n)), pieces)
    k = (np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)).astype(np.uint64)
    step = k * np.uint64(wr_size)
    table = np.empty((len(group), 3), dtype=np.uint64)
    table[:, 0] = src[group] + step
    table[:, 1] = dst[group] + step
    table[:, 2] = np.minimum(np.uint64(wr_size), n[group] - step)
    return np.ascontiguousarray(table.reshape(-1)), int(n.sum())


__all__ = ["MTU_BYTES", "PROTOCOL_VERSION", "check_peer", "qp_requests", "scatter_table", "share_bytes"]
