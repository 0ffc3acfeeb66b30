r"""The same-host data path: memory handles passed over a Unix socket.

When sender and receiver run on one machine as one user, nothing needs to
cross a network stack: the sender passes the *handles* of its region — one
memfd per ``HostRegion`` chunk, one POSIX-fd shareable handle per
``CudaRegion`` chunk — over a Unix domain socket with ``SCM_RIGHTS``, and the
receiver maps them and copies (one memcpy / device-to-device copy), or, with
``share=True``, keeps the mapping as its region without copying.

Security
--------
- The socket lives in a fresh private directory (``mkdtemp``, mode 0700), so
  only our uid (and root) can even connect.
- Both ends check the peer's credentials (``SO_PEERCRED``): the peer's uid
  must be ours, otherwise the connection is refused with an ``E`` message
  naming both uids (:func:`check_peer`).
- The sender proves it holds the session key: its first message is an HMAC
  over the accept descriptors' nonce and the transfer id, as the TCP stream
  header does.  A connection that fails either check is dropped and the
  receiver keeps waiting for the real sender (until ``stall_timeout``);
  strangers are identified concurrently (:class:`~tensorxfer.connections.Gate`),
  so idle ones cannot hold the real sender up.
- The receiver maps only sealed memfds (``F_SEAL_SHRINK | F_SEAL_GROW``,
  set by ``HostRegion.allocate``) at least as long as their chunk, checked
  before anything is mapped (``HostRegion.import_handles``): the sender can
  never shrink a file under the receiver's mapping, which would turn a read
  into ``SIGBUS``.  No chunk may end past the payload rounded up to
  ``CHUNK_TAIL``, so a small update cannot make the receiver map a huge file.

A sender's files
----------------
A region that is regular files mapped read-only (``TensorRegion.source_files``: ``tensorxfer-send``'s)
passes the files' fds instead (chunk table kind ``files``, :mod:`.sourcefiles`), to receivers whose
hello lists ``files`` in their ipc capabilities.  They are never mapped on the receiving side (a file
cut short under a mapping raises SIGBUS, and regular files take no seals): the receiver's caller copies
them into output files with ``copy_file_range`` (``on_files``), or the receiver ``pread``\ s them into its
region.

Same host
---------
Both ends advertise :func:`host_identity` (boot id, uid, hostname, mount
namespace) in ``hello``; a sender uses ipc only when the receiver's identity
equals its own (:meth:`IpcSender.peer_reason`), so ``auto`` never picks ipc
across machines or containers, and a forced ``ipc`` raises
:class:`TransportUnavailable` saying which part differs.  Set
``TENSORXFER_DISABLE_IPC=1`` to take ipc out of this process's capabilities
(``auto`` then picks the next transport, and says so).

Messages (``SOCK_SEQPACKET``: boundaries are kept, fds travel with one message)
----------------------------------------------------------------------------
The Unix socket is connected once per session (the setup update) and
carries every later update; the private directory is removed as soon as the
sender is connected.  Handles are exported and passed once per region: a
later update of the same region says ``cached`` and passes nothing, and the
receiver copies from the mapping it kept. ::

    setup:
    sender -> receiver  "TXI1" u64be(seq) proof(32)    proof = M(S, "ipc", nonce, u64be(seq))
    receiver -> sender  "K"  |  "E" utf-8 reason       (then the receiver closes)
    every update:
    sender -> receiver  msgpack {kind: "host"|"cuda", device: int, nbytes: int, token: bin16, count: int,
                                 cached: bool, seq: int, ready: int}
    sender -> receiver  "F" msgpack [[offset, size], ...] + as many fds (SCM_RIGHTS, at most 250),
                        in chunk order, until ``count`` chunks have arrived (none when cached)
    sender -> receiver  "W" u64be(ready)  ... while ready < nbytes: the watermark grew ...
                        |  "E" utf-8 reason  (the sender gives up: a relay whose upstream failed)
    receiver -> sender  "P" u64be(bytes)  ... progress while copying ...
    receiver -> sender  "D" u64be(nbytes)  |  "E" utf-8 reason

``send()`` returns only after ``D``: the receiver has finished copying (or,
sharing, has mapped the memory), so the sender may reuse or free its region.

Watermark (fan-out relays)
--------------------------
The receiver copies (pulls) from the sender's memory, so a fan-out relay
(:mod:`tensorxfer.fanout`) that forwards an update while its own copy is
still landing must say how far its region is ready: ``ready`` in the chunk
table is the payload prefix the receiver may copy now, and each ``W`` raises
it (strictly growing, at most ``nbytes``; anything else is a
:class:`ProtocolError`).  The receiver copies a piece only once the
watermark covers it; if it stands still for ``stall_timeout`` the update
fails with :class:`TransferTimeout`.  A plain sender says ``ready = nbytes``
in the chunk table: no extra message, no wait (an absent ``ready`` means the
same).  A relay sends ``ready = 0`` and raises it as its own copy lands; a
relay's receiver reports a piece as landed only once its bytes are there
(device copies: once the stream finished them, seen through stream marks
while the next piece copies).  Relayed copies use smaller pieces
(``RELAY_PIECE_BYTES`` host, ``RELAY_CUDA_PIECE_BYTES`` device), the same
on both ends of a hop: a piece is the chain's delay per hop.  The receiver
advertises that it reads ``W`` (``watermark: true`` in its accept
descriptors); to a receiver that does not, or to a share-mode one, a relay
sends only complete regions.

Share mode (``Receiver(share=True)``)
-------------------------------------
The received :class:`TensorRegion` *is* the sender's memory: host chunks are
mapped ``PROT_READ`` (numpy views are read-only; a write faults instead of
corrupting the sender), CUDA chunks are imported read-write (the driver's
import has no read-only mode) and the receiver must not write them.  The
sender's later writes to its region (e.g. ``update_from`` for the next
training step) are visible in place; sending the same region again is then
only a notification: the receiver gets the same region object back, nothing
is mapped again (memfds are recognised by inode, CUDA handles by the
sender's pid and region token).  New memory on the sender gives a new
mapping, and the previous region is released.  The mapping keeps the memory alive by
itself: if the sender frees its region, the receiver still reads the last
contents.  The region lives where the sender's does (host memory, or the
sender's GPU imported on the receiver's device index), whatever the
receiver's ``device``.  The receiver owns the mapping and releases it when it
closes the region (``Receiver.close()`` or the next ``receive``); the passed
fds are closed as soon as they are mapped.

Modules: :mod:`.identity` (who may use ipc), :mod:`.messages` (the wire above and its checks),
:mod:`.sender` (:class:`IpcSender`), :mod:`.receiving` (what both receivers share: the socket, the
sender's admission, the handles), :mod:`.copy` (:class:`IpcReceiver`, copy mode), :mod:`.share`
(:class:`IpcShareReceiver`, share mode), :mod:`.pairs` (a weight-sync pair's copy, host or device) and
:mod:`.delegate` (a weight sync's targets on one GPU copying through one process: the copy host and its
lanes).
"""

from tensorxfer.transport.ipc.copy import COPY_THREADS, IpcReceiver
from tensorxfer.transport.ipc.identity import (
    DISABLE_ENV,
    check_peer,
    host_identity,
    identity_mismatch,
    peer_credentials,
)
from tensorxfer.transport.ipc.messages import (
    CUDA_PIECE_BYTES,
    PIECE_BYTES,
    RELAY_CUDA_PIECE_BYTES,
    RELAY_PIECE_BYTES,
)
from tensorxfer.transport.ipc.sender import IpcSender
from tensorxfer.transport.ipc.share import IpcShareReceiver

__all__ = ["COPY_THREADS", "CUDA_PIECE_BYTES", "DISABLE_ENV", "PIECE_BYTES", "RELAY_CUDA_PIECE_BYTES",
           "RELAY_PIECE_BYTES", "IpcReceiver", "IpcSender", "IpcShareReceiver", "check_peer", "host_identity",
           "identity_mismatch", "peer_credentials"]
