"""Who may use ipc: the same machine, user and mount namespace, checked before and at connection time."""

from __future__ import annotations

import os
import socket
import struct
import sys
from typing import Any

from tensorxfer.errors import AuthError

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
DISABLE_ENV = "TENSORXFER_DISABLE_IPC"


def host_identity() -> dict[str, Any]:
    """What a peer must share with us for ipc: machine (boot id, hostname), user and mount namespace.

    Raises
    ------
    OSError
        The boot id cannot be read (not Linux, or ``/proc`` is missing).
    """
    with open(BOOT_ID_PATH) as f:
        boot_id = f.read().strip()
    try:
        mnt_ns = os.readlink("/proc/self/ns/mnt")
    except OSError:
        mnt_ns = ""
    return {"boot_id": boot_id, "uid": os.getuid(), "hostname": socket.gethostname(), "mnt_ns": mnt_ns}


def identity_mismatch(peer: Any) -> str | None:
    """Why a peer advertising ``peer`` (its :func:`host_identity`) is not on our host as our user; None if it is."""
    if not isinstance(peer, dict):
        return "the receiver did not advertise a host identity"
    try:
        mine = host_identity()
    except OSError as e:
        return f"cannot read this host's identity: {e}"
    labels = {"boot_id": "another machine (boot id differs)", "hostname": "another host (hostname differs)",
              "uid": "another user", "mnt_ns": "another mount namespace (container)"}
    for key, what in labels.items():
        if peer.get(key) != mine[key]:
            return f"the receiver runs on {what}: {key} {peer.get(key)!r} != ours {mine[key]!r}"
    return None


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a connected Unix socket (``SO_PEERCRED``)."""
    fmt = struct.Struct("3i")
    pid, uid, gid = fmt.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, fmt.size))
    return pid, uid, gid


def check_peer(sock: socket.socket) -> int:
    """Refuse a peer of another uid; return its pid.

    Raises
    ------
    AuthError
        The peer process runs as another user (the message names both uids).
    """
    pid, uid, _ = peer_credentials(sock)
    if uid != os.getuid():
        raise AuthError(f"ipc: the peer process (pid {pid}) runs as uid {uid}, this process as uid "
                        f"{os.getuid()}; ipc only connects processes of the same user — run both as one user "
                        f"or use transport='tcp'")
    return pid


def unavailable() -> str | None:
    """Why ipc cannot run in this process (None when it can)."""
    if os.environ.get(DISABLE_ENV, "").lower() in ("1", "true", "yes", "on"):
        return f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
    if not sys.platform.startswith("linux"):
        return f"needs Linux (memfd, SO_PEERCRED), this is {sys.platform}"
    if not hasattr(socket, "send_fds") or not hasattr(socket, "SO_PEERCRED"):
        return "this Python lacks socket.send_fds / SO_PEERCRED"
    try:
        host_identity()
    except OSError as e:
        return f"cannot read the host identity ({e})"
    return None

