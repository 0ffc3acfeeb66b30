# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Cython data plane over libibverbs: device context, PD, CQ, RC QP, MR, and
the nogil RDMA WRITE loop.

Why not only pyverbs: pyverbs objects do not expose the raw ``ibv_qp*`` /
``ibv_cq*`` / ``ibv_mr*`` pointers a Cython loop needs, and its data path
posts one Python-built work request per ``post_send`` call with the GIL
held, so a 31 GB region cut into 1 MiB requests costs ~30,000 Python round
trips plus the completions.  Here the work requests are built and posted,
and the completion queue polled in batches, entirely inside ``with
nogil:``.  pyverbs remains the diagnostics companion (``tensorxfer
doctor``) and the independent peer in the tests.

Ownership: a :class:`Context` owns :class:`PD` and :class:`CQ` objects; a
``PD`` owns :class:`MR` and :class:`QP` objects; a ``QP`` also belongs to the
CQs it uses.  Every object keeps a strong reference to its parents (a parent
can never be freed under a child) and parents keep weak references to their
children, so ``close()`` on a parent closes its children first.  ``close()``
is idempotent; an object garbage-collected while still open releases its
handle in ``__dealloc__`` (never raising) and emits a ``ResourceWarning``.
"""

import warnings
import weakref

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyObject_GetBuffer, PyBuffer_Release, PyObject_CheckBuffer
from libc.errno cimport errno, ENODATA, EINTR, ELIBACC
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free
from libc.string cimport memset, memcpy, strerror
from posix.fcntl cimport fcntl, F_GETFL, F_SETFL, O_NONBLOCK
from posix.time cimport clock_gettime, nanosleep, timespec, CLOCK_MONOTONIC

from tensorxfer._lib.includes.libibverbs cimport *
from tensorxfer._lib.includes.posix cimport htonl, ntohl, poll, pollfd, POLLIN

from tensorxfer.errors import CompletionError, PeerLost, TransferError, TransferTimeout, VerbsError

ACCESS_LOCAL_WRITE = IBV_ACCESS_LOCAL_WRITE
ACCESS_REMOTE_WRITE = IBV_ACCESS_REMOTE_WRITE
ACCESS_REMOTE_READ = IBV_ACCESS_REMOTE_READ

#: ibv_wc_status values by their enum names (verbs.h order).
WC_STATUS_NAMES = (
    "IBV_WC_SUCCESS", "IBV_WC_LOC_LEN_ERR", "IBV_WC_LOC_QP_OP_ERR", "IBV_WC_LOC_EEC_OP_ERR",
    "IBV_WC_LOC_PROT_ERR", "IBV_WC_WR_FLUSH_ERR", "IBV_WC_MW_BIND_ERR", "IBV_WC_BAD_RESP_ERR",
    "IBV_WC_LOC_ACCESS_ERR", "IBV_WC_REM_INV_REQ_ERR", "IBV_WC_REM_ACCESS_ERR", "IBV_WC_REM_OP_ERR",
    "IBV_WC_RETRY_EXC_ERR", "IBV_WC_RNR_RETRY_EXC_ERR", "IBV_WC_LOC_RDD_VIOL_ERR",
    "IBV_WC_REM_INV_RD_REQ_ERR", "IBV_WC_REM_ABORT_ERR", "IBV_WC_INV_EECN_ERR",
    "IBV_WC_INV_EEC_STATE_ERR", "IBV_WC_FATAL_ERR", "IBV_WC_RESP_TIMEOUT_ERR", "IBV_WC_GENERAL_ERR",
    "IBV_WC_TM_ERR", "IBV_WC_TM_RNDV_INCOMPLETE",
)

_MTU_BYTES = {IBV_MTU_256: 256, IBV_MTU_512: 512, IBV_MTU_1024: 1024, IBV_MTU_2048: 2048,
              IBV_MTU_4096: 4096}
_MTU_ENUM = {v: k for k, v in _MTU_BYTES.items()}
_LINK_LAYERS = {IBV_LINK_LAYER_UNSPECIFIED: "unspecified", IBV_LINK_LAYER_INFINIBAND: "InfiniBand",
                IBV_LINK_LAYER_ETHERNET: "Ethernet"}
_GID_TYPES = {IBV_GID_TYPE_IB: "IB", IBV_GID_TYPE_ROCE_V1: "RoCE v1", IBV_GID_TYPE_ROCE_V2: "RoCE v2"}

cdef enum:
    WC_BATCH = 64          # completions taken per ibv_poll_cq call
    IDLE_SPINS = 64        # empty CQ polls before a waiter blocks on the CQ's completion channel
    BLOCK_MS = 10          # longest single block: deadlines and slices are checked at least this often
    IDLE_MIN_NS = 20000    # CQ without a channel: first sleep between empty polls (20 us), doubling ...
    IDLE_MAX_NS = 1000000  # ... up to 1 ms
    POST_BATCH = 32        # work requests chained per ibv_post_send call
    QP_SHIFT = 40          # wr_id = (qp index << QP_SHIFT) | sequence number on that QP
    GATE_SLEEP_NS = 200000 # a write gated by its relay's landed prefix, nothing in flight: sleep 0.2 ms

# Immediates: a piece mark carries MARK_BIT | its request's index on its QP; the final one per QP carries
# the update number & IMM_MASK, so the two can never be confused.
cdef uint32_t C_MARK_BIT = 0x80000000U
cdef uint32_t C_IMM_MASK = 0x7FFFFFFFU
MARK_BIT = C_MARK_BIT
IMM_MASK = C_IMM_MASK


def wc_status_name(int status):
    """The enum name of an ``ibv_wc_status`` value, e.g. ``IBV_WC_LOC_PROT_ERR``."""
    if 0 <= status < len(WC_STATUS_NAMES):
        return WC_STATUS_NAMES[status]
    return f"IBV_WC_STATUS_{status}"


def wc_status_str(int status):
    """libibverbs' own description of a completion status (``ibv_wc_status_str``)."""
    return ibv_wc_status_str(<ibv_wc_status>status).decode()


# --------------------------------------------------------------------- errors
cdef int check_rc(int rc, const char* what) except -1 nogil:
    """Raise VerbsError for a verbs call returning non-zero; GIL taken only on failure.

    libibverbs returns either an errno value or -1 with ``errno`` set,
    depending on the call and provider; both are handled.
    """
    cdef int err
    if rc != 0:
        err = rc if rc > 0 else errno
        with gil:
            raise VerbsError(err, f"{what.decode()} failed: {strerror(err).decode()}")
    return 0


cdef int check_ptr(const void* p, const char* what) except -1 nogil:
    """Raise VerbsError for a verbs call that returned NULL (errno says why)."""
    cdef int err
    if p == NULL:
        err = errno
        if err == 0:
            err = 5  # EIO: some providers return NULL without setting errno
        with gil:
            raise VerbsError(err, f"{what.decode()} failed: {strerror(err).decode()}")
    return 0


cdef double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef int _cq_block(ibv_cq* cq, ibv_comp_channel* ch, bint* armed, int timeout_ms) noexcept nogil:
    """After an empty poll of ``cq``: arm it and return at once (the caller polls again, since a
    completion may have landed before the arming), or, armed, block until its completion event or
    ``timeout_ms``.  Returns 0, or -1 when arming, waiting or taking the event failed."""
    cdef pollfd pfd
    cdef ibv_cq* ev_cq
    cdef void* ev_ctx
    cdef int rc
    if not armed[0]:
        if ibv_req_notify_cq(cq, 0) != 0:
            return -1
        armed[0] = True
        return 0
    pfd.fd = ch.fd
    pfd.events = POLLIN
    pfd.revents = 0
    rc = poll(&pfd, 1, timeout_ms)
    if rc < 0:
        return 0 if errno == EINTR else -1
    if rc > 0:
        if ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == 0:
            ibv_ack_cq_events(ev_cq, 1)
            armed[0] = False            # an event disarms the CQ
        # else EAGAIN: nothing to take after all; still armed
    return 0


def _warn_unclosed(what):
    try:
        warnings.warn(f"unclosed {what}; call close() (or use 'with')", ResourceWarning, stacklevel=2)
    except BaseException:
        pass


# --------------------------------------------------------------------- the library
#: What makes libibverbs loadable, for error messages and ``tensorxfer doctor``.
LIBRARY_FIX = ("install rdma-core's verbs library and providers: apt-get install libibverbs1 ibverbs-providers "
               "(Debian/Ubuntu), dnf install libibverbs (RHEL/Fedora)")


def library_error():
    """None when libibverbs.so.1 is loaded (the first call loads it), else why it cannot be.

    The module does not link libibverbs (see _lib/includes/verbs_dl.h): it imports on machines without
    rdma-core, where tcp and ipc work, and this says what RDMA lacks.
    """
    if txv_load() == 1:
        return None
    return (f"libibverbs could not be loaded ({txv_load_message().decode(errors='replace')}): the RDMA "
            f"transport needs rdma-core on this machine; {LIBRARY_FIX}")


def library_info():
    """``{'loaded': bool, 'library': soname or path, 'missing_optional': [names]}`` (for doctor)."""
    loaded = txv_load() == 1
    return {"loaded": loaded, "library": txv_load_message().decode(errors="replace") if loaded else None,
            "missing_optional": [txv_missing_name(i).decode() for i in range(txv_missing_count())]}


cdef int _require_library() except -1:
    """Load libibverbs before the first verbs call; VerbsError(ELIBACC) with the fix when it cannot be."""
    if txv_load() == 1:
        return 0
    raise VerbsError(ELIBACC, library_error())


# --------------------------------------------------------------------- devices
def device_names():
    """Names of the RDMA devices libibverbs sees (e.g. ``['mlx5_0', 'rxe0']``).

    Raises
    ------
    VerbsError
        libibverbs.so.1 cannot be loaded (errno ELIBACC; the message says how to install it).
    """
    cdef int n = 0, i
    _require_library()
    cdef ibv_device** lst = ibv_get_device_list(&n)
    if lst == NULL:
        return []
    try:
        return [ibv_get_device_name(lst[i]).decode() for i in range(n)]
    finally:
        ibv_free_device_list(lst)


cdef class _Owned:
    """Shared lifetime plumbing: weak refs to children, closed children-first."""
    cdef object __weakref__
    cdef list _children
    cdef bint _closed

    def __cinit__(self):
        self._children = []
        self._closed = True

    cdef _adopt_child(self, child):
        self._children = [r for r in self._children if r() is not None]
        self._children.append(weakref.ref(child))

    cdef object _close_children(self):
        """Close every child (a failing one must not leave the rest open); the first error, or None."""
        first = None
        for ref in reversed(self._children):
            child = ref()
            if child is not None:
                try:
                    child.close()
                except Exception as e:
                    if first is None:
                        first = e
        self._children = []
        return first

    cdef int _check_open(self) except -1:
        if self._closed:
            raise ValueError(f"operation on a closed {type(self).__name__}")
        return 0

    @property
    def closed(self):
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


cdef class Context(_Owned):
    """An open RDMA device (``ibv_open_device``).  Create with :meth:`open`."""
    cdef ibv_context* ctx
    cdef readonly str name

    def __cinit__(self):
        self.ctx = NULL

    @staticmethod
    def open(name=None):
        """Open device ``name`` (the first device when None).

        Raises
        ------
        VerbsError
            libibverbs cannot be loaded (ELIBACC), no RDMA device exists, ``name`` is not one of them,
            or opening failed.
        """
        cdef int n = 0, i, pick = -1
        cdef Context self
        _require_library()
        cdef ibv_device** lst = ibv_get_device_list(&n)
        if lst == NULL:
            raise VerbsError(errno, f"ibv_get_device_list failed: {strerror(errno).decode()} "
                             f"(is the ib_uverbs kernel module loaded?)")
        try:
            names = [ibv_get_device_name(lst[i]).decode() for i in range(n)]
            if not names:
                raise VerbsError(19, "no RDMA devices found (ENODEV): load a provider (rdma_rxe for "
                                 "Soft-RoCE) or check `ibv_devices`")
            if name is None:
                pick = 0
            elif name in names:
                pick = names.index(name)
            else:
                raise VerbsError(19, f"RDMA device {name!r} not found; devices here: {names}")
            self = Context.__new__(Context)
            self.ctx = ibv_open_device(lst[pick])
            check_ptr(self.ctx, b"ibv_open_device")
            self.name = names[pick]
            self._closed = False
            return self
        finally:
            ibv_free_device_list(lst)

    def close(self):
        """Close every PD, MR, QP and CQ made from this context, then the context."""
        cdef int rc
        if self._closed:
            return
        first = self._close_children()
        rc = ibv_close_device(self.ctx)
        self.ctx = NULL
        self._closed = True
        if first is not None:
            raise first
        check_rc(rc, b"ibv_close_device")

    def __dealloc__(self):
        if self.ctx != NULL:
            _warn_unclosed(f"RDMA Context {self.name!r}")
            ibv_close_device(self.ctx)
            self.ctx = NULL

    def query_device(self):
        """Device attributes as a dict (firmware, limits, port count)."""
        cdef ibv_device_attr a
        self._check_open()
        check_rc(ibv_query_device(self.ctx, &a), b"ibv_query_device")
        return {
            "name": self.name, "fw_ver": a.fw_ver.decode(errors="replace"), "node_guid": a.node_guid,
            "vendor_id": a.vendor_id, "vendor_part_id": a.vendor_part_id, "hw_ver": a.hw_ver,
            "max_qp": a.max_qp, "max_qp_wr": a.max_qp_wr, "max_sge": a.max_sge, "max_cq": a.max_cq,
            "max_cqe": a.max_cqe, "max_mr": a.max_mr, "max_mr_size": a.max_mr_size, "max_pd": a.max_pd,
            "max_qp_rd_atom": a.max_qp_rd_atom, "phys_port_cnt": a.phys_port_cnt,
        }

    def query_port(self, int port=1):
        """Port attributes: state, MTU, LID, link layer, GID table length, max message size."""
        cdef ibv_port_attr a
        self._check_open()
        memset(&a, 0, sizeof(a))
        check_rc(ibv_query_port(self.ctx, <uint8_t>port, &a), b"ibv_query_port")
        return {
            "port": port, "state": ibv_port_state_str(a.state).decode(), "active": a.state == IBV_PORT_ACTIVE,
            "active_mtu": _MTU_BYTES.get(a.active_mtu, 0), "max_mtu": _MTU_BYTES.get(a.max_mtu, 0),
            "lid": a.lid, "link_layer": _LINK_LAYERS.get(a.link_layer, str(a.link_layer)),
            "gid_tbl_len": a.gid_tbl_len, "max_msg_sz": a.max_msg_sz,
            "active_width": a.active_width, "active_speed": a.active_speed, "phys_state": a.phys_state,
        }

    def gid_entries(self, int port=1):
        """Populated GID table entries: ``[{'index', 'gid' (16 bytes), 'type'}]``."""
        cdef ibv_gid_entry e
        cdef int i, rc
        self._check_open()
        out = []
        n = self.query_port(port)["gid_tbl_len"]
        for i in range(n):
            memset(&e, 0, sizeof(e))
            rc = ibv_query_gid_ex(self.ctx, port, i, &e, 0)
            if rc == ENODATA or (rc < 0 and errno == ENODATA):
                continue            # an empty slot
            check_rc(rc, b"ibv_query_gid_ex")
            raw = bytes(e.gid.raw[:16])
            if raw == bytes(16):
                continue
            out.append({"index": i, "gid": raw, "type": _GID_TYPES.get(e.gid_type, str(e.gid_type))})
        return out

    def choose_gid(self, int port=1, gid_index=None):
        """The GID to address this port with: ``(index, gid bytes)``.

        InfiniBand ports use index 0 (the LID routes; the GID is sent anyway).
        Ethernet (RoCE) ports prefer a RoCE v2 entry with an IPv4-mapped
        address (routable over UDP/IP), then any RoCE v2 entry, then RoCE v1.
        An explicit ``gid_index`` is used as given.

        Raises
        ------
        VerbsError
            The port has no usable GID (no IP address on the netdev, for RoCE).
        """
        cdef ibv_gid g
        self._check_open()
        if gid_index is not None:
            check_rc(ibv_query_gid(self.ctx, <uint8_t>port, <int>gid_index, &g), b"ibv_query_gid")
            return int(gid_index), bytes(g.raw[:16])
        entries = self.gid_entries(port)
        if self.query_port(port)["link_layer"] != "Ethernet":
            for e in entries:
                if e["index"] == 0:
                    return 0, e["gid"]
            check_rc(ibv_query_gid(self.ctx, <uint8_t>port, 0, &g), b"ibv_query_gid")
            return 0, bytes(g.raw[:16])
        v4mapped = bytes(10) + b"\xff\xff"
        for want in (lambda e: e["type"] == "RoCE v2" and e["gid"][:12] == v4mapped,
                     lambda e: e["type"] == "RoCE v2",
                     lambda e: True):
            for e in entries:
                if want(e):
                    return e["index"], e["gid"]
        raise VerbsError(61, f"{self.name} port {port} has no GID: give its netdev an IP address "
                         f"(RoCE GIDs are derived from the interface's addresses)")

    def alloc_pd(self):
        """A new protection domain owned by this context."""
        self._check_open()
        cdef PD pd = PD.__new__(PD)
        pd.pd = ibv_alloc_pd(self.ctx)
        check_ptr(pd.pd, b"ibv_alloc_pd")
        pd.context = self
        pd._closed = False
        self._adopt_child(pd)
        return pd

    def create_cq(self, int cqe, bint events=True):
        """A completion queue of at least ``cqe`` entries owned by this context.

        With ``events`` (the default) the CQ gets its own completion channel,
        so the data path can block until a completion arrives instead of
        spinning (see :class:`CQ`).
        """
        self._check_open()
        if cqe <= 0:
            raise ValueError(f"cqe must be positive, got {cqe}")
        cdef CQ cq = CQ.__new__(CQ)
        cdef int flags
        if events:
            cq.channel = ibv_create_comp_channel(self.ctx)
            check_ptr(cq.channel, b"ibv_create_comp_channel")
            # non-blocking: a wakeup whose event someone else took must not block ibv_get_cq_event
            flags = fcntl(cq.channel.fd, F_GETFL)
            if flags < 0 or fcntl(cq.channel.fd, F_SETFL, flags | O_NONBLOCK) < 0:
                ibv_destroy_comp_channel(cq.channel)
                cq.channel = NULL
                check_rc(-1, b"fcntl(O_NONBLOCK) on the completion channel")
        cq.cq = ibv_create_cq(self.ctx, cqe, NULL, cq.channel, 0)
        if cq.cq == NULL and cq.channel != NULL:
            ibv_destroy_comp_channel(cq.channel)
            cq.channel = NULL
        check_ptr(cq.cq, b"ibv_create_cq")
        cq.context = self
        cq._closed = False
        self._adopt_child(cq)
        return cq

    def __repr__(self):
        return f"<Context {self.name!r}{' closed' if self._closed else ''}>"


cdef class PD(_Owned):
    """A protection domain (``ibv_alloc_pd``); parent of its MRs and QPs."""
    cdef ibv_pd* pd
    cdef readonly Context context

    def __cinit__(self):
        self.pd = NULL

    def close(self):
        """Close this PD's QPs and MRs, then deallocate it."""
        cdef int rc
        if self._closed:
            return
        first = self._close_children()
        rc = ibv_dealloc_pd(self.pd)
        self.pd = NULL
        self._closed = True
        if first is not None:
            raise first
        check_rc(rc, b"ibv_dealloc_pd")

    def __dealloc__(self):
        if self.pd != NULL:
            _warn_unclosed("RDMA PD")
            ibv_dealloc_pd(self.pd)
            self.pd = NULL

    def reg_mr(self, uintptr_t addr, size_t length, int access, owner=None):
        """Register ``[addr, addr+length)`` (``ibv_reg_mr``).

        ``owner`` is the object whose memory this is; the MR keeps it
        referenced (and, if it exports a buffer, holds that export, so a
        ``HostRegion`` cannot be closed under a live registration).

        Raises
        ------
        VerbsError
            The registration failed (``errno``: EFAULT for unmapped memory,
            ENOMEM for pinned-memory limits — see ``ulimit -l``).
        """
        self._check_open()
        if length == 0:
            raise ValueError("cannot register an empty range")
        cdef MR mr = MR.__new__(MR)
        mr._hold(owner)
        try:
            with nogil:
                mr.mr = ibv_reg_mr(self.pd, <void*>addr, length, access)
            check_ptr(mr.mr, b"ibv_reg_mr")
        except BaseException:
            mr._unhold()
            raise
        mr._finish(self, "reg_mr")
        return mr

    def reg_dmabuf_mr(self, int fd, uint64_t offset, size_t length, uint64_t iova, int access, owner=None):
        """Register ``length`` bytes at ``offset`` of dmabuf ``fd``, addressed as ``iova``.

        The GPU path: a CUDA region exports one dmabuf over its resolved
        extent and registers it here with ``iova`` = its device address, so
        work requests use the same addresses as ``ibv_reg_mr`` would.  The
        caller keeps ``fd`` open until the MR is closed.

        Raises
        ------
        VerbsError
            The provider or kernel does not support dmabuf MRs (EOPNOTSUPP,
            EINVAL on Soft-RoCE), or the fd is not a dmabuf.
        """
        self._check_open()
        if length == 0:
            raise ValueError("cannot register an empty range")
        cdef MR mr = MR.__new__(MR)
        mr.owner = owner
        with nogil:
            mr.mr = ibv_reg_dmabuf_mr(self.pd, offset, length, iova, fd, access)
        check_ptr(mr.mr, b"ibv_reg_dmabuf_mr")
        mr._finish(self, "reg_dmabuf_mr")
        return mr

    def create_qp(self, CQ send_cq, CQ recv_cq, uint32_t max_send_wr, uint32_t max_recv_wr):
        """A reliable-connected QP in RESET state (one SGE per request)."""
        cdef ibv_qp_init_attr attr
        self._check_open()
        send_cq._check_open()
        recv_cq._check_open()
        memset(&attr, 0, sizeof(attr))
        attr.send_cq = send_cq.cq
        attr.recv_cq = recv_cq.cq
        attr.cap.max_send_wr = max_send_wr
        attr.cap.max_recv_wr = max_recv_wr
        attr.cap.max_send_sge = 1
        attr.cap.max_recv_sge = 1
        attr.qp_type = IBV_QPT_RC
        attr.sq_sig_all = 0            # selective signaling
        cdef QP qp = QP.__new__(QP)
        qp.qp = ibv_create_qp(self.pd, &attr)
        check_ptr(qp.qp, b"ibv_create_qp")
        qp.pd = self
        qp.send_cq = send_cq
        qp.recv_cq = recv_cq
        qp.max_send_wr = attr.cap.max_send_wr
        qp.max_recv_wr = attr.cap.max_recv_wr
        qp._closed = False
        self._adopt_child(qp)
        send_cq._adopt_child(qp)       # a CQ cannot be destroyed while a QP uses it
        if recv_cq is not send_cq:
            recv_cq._adopt_child(qp)
        return qp


cdef class MR(_Owned):
    """A memory registration; ``addr``, ``length``, ``lkey``, ``rkey``, ``path``."""
    cdef ibv_mr* mr
    cdef readonly PD pd
    cdef readonly str path           # "reg_mr" or "reg_dmabuf_mr"
    cdef object owner
    cdef Py_buffer view
    cdef bint has_view

    def __cinit__(self):
        self.mr = NULL
        self.has_view = False

    cdef _hold(self, owner):
        self.owner = owner
        if owner is not None and PyObject_CheckBuffer(owner):
            PyObject_GetBuffer(owner, &self.view, PyBUF_SIMPLE)
            self.has_view = True

    cdef void _unhold(self) noexcept:
        if self.has_view:
            PyBuffer_Release(&self.view)
            self.has_view = False
        self.owner = None

    cdef _finish(self, PD pd, str path):
        self.pd = pd
        self.path = path
        self._closed = False
        pd._adopt_child(self)

    def close(self):
        """Deregister (``ibv_dereg_mr``); remote keys stop working at once."""
        cdef int rc
        if self._closed:
            return
        rc = ibv_dereg_mr(self.mr)
        if rc != 0:
            # Still registered: the memory must stay pinned (and the MR open), or freed pages would remain
            # reachable by remote keys.
            check_rc(rc, b"ibv_dereg_mr")
        self.mr = NULL
        self._closed = True
        self._unhold()

    def __dealloc__(self):
        if self.mr != NULL:
            _warn_unclosed("RDMA MR")
            ibv_dereg_mr(self.mr)
            self.mr = NULL
        self._unhold()

    @property
    def addr(self):
        self._check_open()
        return <uintptr_t>self.mr.addr

    @property
    def length(self):
        self._check_open()
        return self.mr.length

    @property
    def lkey(self):
        self._check_open()
        return self.mr.lkey

    @property
    def rkey(self):
        self._check_open()
        return self.mr.rkey

    def __repr__(self):
        if self._closed:
            return "<MR closed>"
        return f"<MR {self.path} addr={<uintptr_t>self.mr.addr:#x} length={self.mr.length} rkey={self.mr.rkey:#x}>"


cdef class CQ(_Owned):
    """A completion queue (``ibv_create_cq``), usually with its own completion channel.

    Waiting on a CQ polls it a few times (:data:`IDLE_SPINS`), then arms it
    (``ibv_req_notify_cq``), polls once more (a completion may have landed
    before the arming) and blocks in ``poll(2)`` on the channel's fd until
    the next completion event.  A waiter that spins takes a core from
    whatever moves the bytes -- on Soft-RoCE that is the kernel on the same
    cores -- and a real NIC keeps ``max_outstanding`` requests queued, so a
    wakeup of a few microseconds never starves it.  Every event taken is
    acked at once, so ``ibv_destroy_cq`` never waits.
    """
    cdef ibv_cq* cq
    cdef ibv_comp_channel* channel
    cdef bint armed              # an arming is outstanding (or its event not yet taken)
    cdef readonly Context context

    def __cinit__(self):
        self.cq = NULL
        self.channel = NULL
        self.armed = False

    def close(self):
        """Destroy the QPs using this CQ, then the CQ and its channel."""
        cdef int rc, rc2 = 0
        if self._closed:
            return
        first = self._close_children()
        rc = ibv_destroy_cq(self.cq)
        self.cq = NULL
        if self.channel != NULL:
            rc2 = ibv_destroy_comp_channel(self.channel)
            self.channel = NULL
        self._closed = True
        if first is not None:
            raise first
        check_rc(rc, b"ibv_destroy_cq")
        check_rc(rc2, b"ibv_destroy_comp_channel")

    def __dealloc__(self):
        if self.cq != NULL:
            _warn_unclosed("RDMA CQ")
            ibv_destroy_cq(self.cq)
            self.cq = NULL
        if self.channel != NULL:
            ibv_destroy_comp_channel(self.channel)
            self.channel = NULL

    @property
    def events(self):
        """Whether this CQ has a completion channel (waiters block instead of spinning)."""
        return self.channel != NULL

    def poll(self, int max_entries=16):
        """Poll once (no wait) and return the completions as dicts; for diagnostics."""
        cdef ibv_wc wc[16]
        cdef int n, i
        self._check_open()
        n = ibv_poll_cq(self.cq, min(max(max_entries, 1), 16), wc)
        if n < 0:
            raise VerbsError(5, "ibv_poll_cq failed")
        return [{"wr_id": wc[i].wr_id, "status": wc_status_name(wc[i].status), "opcode": wc[i].opcode,
                 "byte_len": wc[i].byte_len, "qp_num": wc[i].qp_num,
                 "imm": ntohl(wc[i].imm_data) if wc[i].wc_flags & IBV_WC_WITH_IMM else None}
                for i in range(n)]


cdef class QP(_Owned):
    """A reliable-connected queue pair (``ibv_create_qp``, ``IBV_QPT_RC``)."""
    cdef ibv_qp* qp
    cdef readonly PD pd
    cdef readonly CQ send_cq
    cdef readonly CQ recv_cq
    cdef readonly uint32_t max_send_wr
    cdef readonly uint32_t max_recv_wr
    cdef readonly str state

    def __cinit__(self):
        self.qp = NULL
        self.state = "RESET"

    def close(self):
        """Destroy the QP (outstanding requests are dropped)."""
        cdef int rc
        if self._closed:
            return
        rc = ibv_destroy_qp(self.qp)
        self.qp = NULL
        self._closed = True
        self.state = "CLOSED"
        check_rc(rc, b"ibv_destroy_qp")

    def __dealloc__(self):
        if self.qp != NULL:
            _warn_unclosed("RDMA QP")
            ibv_destroy_qp(self.qp)
            self.qp = NULL

    @property
    def qp_num(self):
        self._check_open()
        return self.qp.qp_num

    def to_init(self, int port, int access):
        """RESET → INIT on ``port`` with remote ``access`` flags for incoming requests."""
        cdef ibv_qp_attr a
        self._check_open()
        memset(&a, 0, sizeof(a))
        a.qp_state = IBV_QPS_INIT
        a.pkey_index = 0
        a.port_num = <uint8_t>port
        a.qp_access_flags = access
        check_rc(ibv_modify_qp(self.qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                               IBV_QP_ACCESS_FLAGS), b"ibv_modify_qp(INIT)")
        self.state = "INIT"

    def to_rtr(self, int port, uint32_t dest_qp_num, uint32_t rq_psn, int mtu, int dlid,
               bytes dgid, int sgid_index, bint is_global):
        """INIT → RTR towards the peer QP ``dest_qp_num`` (``mtu`` in bytes).

        ``is_global`` (RoCE always; InfiniBand across subnets) addresses the
        peer by ``dgid`` from our ``sgid_index``; otherwise by ``dlid``.
        """
        cdef ibv_qp_attr a
        self._check_open()
        if mtu not in _MTU_ENUM:
            raise ValueError(f"path MTU must be one of {sorted(_MTU_ENUM)}, got {mtu}")
        memset(&a, 0, sizeof(a))
        a.qp_state = IBV_QPS_RTR
        a.path_mtu = <ibv_mtu>_MTU_ENUM[mtu]
        a.dest_qp_num = dest_qp_num
        a.rq_psn = rq_psn & 0xFFFFFF
        a.max_dest_rd_atomic = 1
        a.min_rnr_timer = 12            # 0.64 ms between receiver-not-ready retries
        a.ah_attr.port_num = <uint8_t>port
        a.ah_attr.dlid = <uint16_t>dlid
        if is_global:
            if len(dgid) != 16:
                raise ValueError(f"a GID is 16 bytes, got {len(dgid)}")
            a.ah_attr.is_global = 1
            memcpy(a.ah_attr.grh.dgid.raw, <const char*>dgid, 16)
            a.ah_attr.grh.sgid_index = <uint8_t>sgid_index
            a.ah_attr.grh.hop_limit = 64
        check_rc(ibv_modify_qp(self.qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                               IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER),
                 b"ibv_modify_qp(RTR)")
        self.state = "RTR"

    def to_rts(self, uint32_t sq_psn, int timeout=14, int retry_cnt=7, int rnr_retry=7):
        """RTR → RTS.  ``timeout`` is 4.096 µs × 2^timeout per retry (14 ≈ 67 ms),
        so a dead peer surfaces as ``IBV_WC_RETRY_EXC_ERR`` after about
        ``retry_cnt`` × that; ``rnr_retry=7`` retries receiver-not-ready forever
        (the caller's timeout bounds it)."""
        cdef ibv_qp_attr a
        self._check_open()
        memset(&a, 0, sizeof(a))
        a.qp_state = IBV_QPS_RTS
        a.sq_psn = sq_psn & 0xFFFFFF
        a.timeout = <uint8_t>timeout
        a.retry_cnt = <uint8_t>retry_cnt
        a.rnr_retry = <uint8_t>rnr_retry
        a.max_rd_atomic = 1
        check_rc(ibv_modify_qp(self.qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT |
                               IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC),
                 b"ibv_modify_qp(RTS)")
        self.state = "RTS"

    def to_error(self):
        """Any state → ERR: outstanding requests and receives complete with ``IBV_WC_WR_FLUSH_ERR`` and nothing
        more is sent or accepted on this QP.  A broken update stops its QPs this way before it counts what
        landed (a resumed update then connects new QPs); tests use it to break a QP mid-update for real."""
        cdef ibv_qp_attr a
        self._check_open()
        memset(&a, 0, sizeof(a))
        a.qp_state = IBV_QPS_ERR
        check_rc(ibv_modify_qp(self.qp, &a, IBV_QP_STATE), b"ibv_modify_qp(ERR)")
        self.state = "ERR"

    def post_recv(self, int count, uint64_t wr_id):
        """Post ``count`` zero-SGE receives (what WRITE_WITH_IMM consumes)."""
        cdef ibv_recv_wr wr
        cdef ibv_recv_wr* bad
        cdef int i
        self._check_open()
        memset(&wr, 0, sizeof(wr))
        wr.wr_id = wr_id
        for i in range(count):
            check_rc(ibv_post_recv(self.qp, &wr, &bad), b"ibv_post_recv")

    def __repr__(self):
        if self._closed:
            return "<QP closed>"
        return f"<QP {self.qp.qp_num:#x} {self.state}>"


# --------------------------------------------------------------------- data path
cdef struct QPState:
    ibv_qp* qp
    uint64_t total        # work requests this QP carries (>= 1: the last is WITH_IMM)
    uint64_t posted
    uint64_t completed


cdef struct LoopState:   # survives between slices of one write
    int done              # QPs whose last request completed
    double last           # time of the last completion (stall detection)
    uint64_t polls
    uint64_t empty


cdef struct WriteError:
    int kind              # 0 none, 1 completion error, 2 post/poll error, 3 stall timeout, 4 channel error
    int status
    uint32_t vendor_err
    uint32_t qp_num
    uint64_t wr_index     # global index of the failed request
    int post_rc


cdef uint64_t _gated(uint64_t first, uint64_t nb, int q, int nq, uint64_t wr_size, uint64_t length,
                     uint64_t lim) noexcept nogil:
    """How many of QP ``q``'s requests ``first .. first+nb-1`` end within the first ``lim`` bytes."""
    cdef uint64_t k, off, end
    for k in range(nb):
        off = ((first + k) * nq + q) * wr_size
        if off >= length:
            end = 0                  # a data-less final immediate: nothing to wait for
        else:
            end = off + wr_size if length - off > wr_size else length
        if end > lim:
            return k
    return nb


cdef bint _nothing_in_flight(QPState* qs, int nq) noexcept nogil:
    cdef int q
    for q in range(nq):
        if qs[q].posted != qs[q].completed:
            return False
    return True


cdef int _write_loop(QPState* qs, int nq, int q0, int ntot, ibv_cq* cq, ibv_comp_channel* ch, bint* armed,
                     uint64_t local_addr, uint32_t lkey,
                     uint64_t remote_addr, uint32_t rkey, uint64_t length, uint64_t wr_size,
                     uint64_t max_out, uint64_t signal_every, uint32_t imm_be, double timeout, uint64_t post_batch,
                     ibv_send_wr* wrs, ibv_sge* sges, ibv_wc* wcs, WriteError* err,
                     LoopState* st, double slice_s, uint64_t marks, const uint64_t* ready,
                     const uint64_t* table, uint64_t nreq) noexcept nogil:
    """Stripe ``length`` bytes over the QPs and wait for all of them; no GIL, no Python.

    ``qs`` are QPs ``q0 .. q0+nq-1`` of a stripe over ``ntot`` QPs (request ``i`` on QP ``i % ntot``):
    several posting threads, each with its own group and CQ, write one update together.

    Returns 0 when every QP's last request completed, -1 on an error (``err``
    says which), 1 when ``slice_s`` (> 0) elapsed first: call again to go on.
    With a completion channel ``ch``, a CQ that stays empty (every QP has
    ``max_out`` requests in flight or nothing left to post) is waited on
    blocked, not spun on (:class:`CQ` says why).

    ``marks`` > 0: every ``marks``-th request per QP (but the last) is a WRITE_WITH_IMM carrying
    ``MARK_BIT | its index on the QP``, so a relaying receiver learns which prefix landed.  ``ready``
    (not NULL): ``ready[0]`` is how many bytes from ``local_addr`` on may be sent (a relay's landed prefix,
    raised by another thread); no request reaching past it is posted, and the last request before it
    is signaled (its completion is what the loop waits for).  While every QP waits for it with nothing
    in flight, no completion can come: the loop sleeps instead, and that wait is the upstream's, not a
    stall of the receiver.

    ``table`` (not NULL; then ``ready`` is NULL and ``marks`` 0): ``nreq`` requests given explicitly, request
    ``i`` writing ``table[3i+2]`` bytes from ``local_addr + table[3i]`` to ``remote_addr + table[3i+1]`` (a
    weight sync's runs, scattered over the receiver's region); the stripe over the QPs is the same.
    """
    cdef int q, k, n, i
    cdef uint64_t j, gi, off, room, nb, lim = 0
    cdef ibv_send_wr* bad
    cdef ibv_send_wr* w
    cdef double t_start = _now(), now
    cdef int rc
    cdef timespec pause
    pause.tv_sec = 0
    pause.tv_nsec = GATE_SLEEP_NS
    while st.done < nq:
        for q in range(nq):
            if ready != NULL:
                lim = (<volatile uint64_t*>ready)[0]    # raised by another thread: read it afresh
            while qs[q].posted < qs[q].total and qs[q].posted - qs[q].completed < max_out:
                room = max_out - (qs[q].posted - qs[q].completed)
                nb = qs[q].total - qs[q].posted
                if nb > room:
                    nb = room
                if nb > post_batch:
                    nb = post_batch
                if ready != NULL:
                    nb = _gated(qs[q].posted, nb, q0 + q, ntot, wr_size, length, lim)
                    if nb == 0:
                        break
                for k in range(<int>nb):
                    j = qs[q].posted + k
                    gi = j * ntot + q0 + q
                    off = gi * wr_size
                    w = &wrs[k]
                    w.wr_id = (<uint64_t>q << QP_SHIFT) | j
                    w.next = &wrs[k + 1] if k + 1 < <int>nb else NULL
                    if table != NULL:
                        if gi < nreq:
                            sges[k].addr = local_addr + table[3 * gi]
                            sges[k].length = <uint32_t>table[3 * gi + 2]
                            sges[k].lkey = lkey
                            w.sg_list = &sges[k]
                            w.num_sge = 1
                            w.wr.rdma.remote_addr = remote_addr + table[3 * gi + 1]
                        else:                  # a QP with no data still carries an immediate
                            w.sg_list = NULL
                            w.num_sge = 0
                            w.wr.rdma.remote_addr = remote_addr
                    elif off < length:
                        sges[k].addr = local_addr + off
                        sges[k].length = <uint32_t>(wr_size if length - off > wr_size else length - off)
                        sges[k].lkey = lkey
                        w.sg_list = &sges[k]
                        w.num_sge = 1
                        w.wr.rdma.remote_addr = remote_addr + off
                    else:                      # a QP with no data still carries an immediate
                        w.sg_list = NULL
                        w.num_sge = 0
                        w.wr.rdma.remote_addr = remote_addr + length
                    w.wr.rdma.rkey = rkey
                    if j + 1 == qs[q].total:
                        w.opcode = IBV_WR_RDMA_WRITE_WITH_IMM
                        w.imm_data = imm_be
                        w.send_flags = IBV_SEND_SIGNALED
                    else:
                        if marks != 0 and (j + 1) % marks == 0:
                            w.opcode = IBV_WR_RDMA_WRITE_WITH_IMM
                            w.imm_data = htonl(C_MARK_BIT | <uint32_t>j)
                        else:
                            w.opcode = IBV_WR_RDMA_WRITE
                        w.send_flags = IBV_SEND_SIGNALED if (j + 1) % signal_every == 0 else 0
                        if ready != NULL and k + 1 == <int>nb and _gated(j + 1, 1, q0 + q, ntot, wr_size, length, lim) == 0:
                            w.send_flags = IBV_SEND_SIGNALED    # the gate stops here: its completion must come
                rc = ibv_post_send(qs[q].qp, wrs, &bad)
                if rc != 0:
                    err.kind = 2
                    err.post_rc = rc if rc > 0 else errno
                    err.qp_num = qs[q].qp.qp_num
                    err.wr_index = (bad.wr_id & ((<uint64_t>1 << QP_SHIFT) - 1)) * ntot + q0 + q if bad != NULL \
                        else qs[q].posted * ntot + q0 + q
                    return -1
                qs[q].posted += nb
        n = ibv_poll_cq(cq, WC_BATCH, wcs)
        st.polls += 1
        if n < 0:
            err.kind = 2
            err.post_rc = 5
            return -1
        for i in range(n):
            q = <int>(wcs[i].wr_id >> QP_SHIFT)
            j = wcs[i].wr_id & ((<uint64_t>1 << QP_SHIFT) - 1)
            if wcs[i].status != IBV_WC_SUCCESS:
                # keep the first real error; a flush only reports that an earlier one happened
                if err.kind == 0 or (err.status == IBV_WC_WR_FLUSH_ERR and wcs[i].status != IBV_WC_WR_FLUSH_ERR):
                    err.kind = 1
                    err.status = wcs[i].status
                    err.vendor_err = wcs[i].vendor_err
                    err.qp_num = wcs[i].qp_num
                    err.wr_index = j * ntot + q0 + q
                continue
            if q < nq and j + 1 > qs[q].completed:
                qs[q].completed = j + 1      # RC completes in order: everything before j is done
                if qs[q].completed == qs[q].total:
                    st.done += 1
        if err.kind != 0:
            return -1
        if n > 0:
            st.empty = 0
            st.last = _now()
            # a busy CQ must not keep the caller's slice from ending (its peer check, a relay's gate): on
            # Soft-RoCE every post runs the device inline, so completions are there at nearly every poll
            if slice_s > 0 and st.last - t_start > slice_s:
                return 1
        else:
            st.empty += 1
            if ready != NULL and _nothing_in_flight(qs, nq):
                # Every QP waits for the relay's upstream and no completion can come: sleep, not block on
                # the CQ.  The time is the upstream's (its relay notices a stall there), not this receiver's.
                nanosleep(&pause, NULL)
                now = _now()
                st.last = now
                if slice_s > 0 and now - t_start > slice_s:
                    return 1
                continue
            if ch != NULL and st.empty > IDLE_SPINS:
                # nothing can be posted until a completion frees room: sleep until one comes
                if _cq_block(cq, ch, armed, BLOCK_MS) != 0:
                    err.kind = 4
                    err.post_rc = errno if errno != 0 else 5
                    return -1
            if st.empty % 256 == 0 or (ch != NULL and st.empty > IDLE_SPINS):
                now = _now()
                if now - st.last > timeout:
                    err.kind = 3
                    return -1
                if slice_s > 0 and now - t_start > slice_s:
                    return 1
    return 0


cdef void _save_state(QPState* qs, int nq, uint64_t* out) noexcept nogil:
    cdef int q
    if out == NULL:
        return
    for q in range(nq):
        out[2 * q] = qs[q].posted
        out[2 * q + 1] = qs[q].completed


def write_striped(list qps, CQ cq, uint64_t local_addr, uint32_t lkey, uint64_t remote_addr, uint32_t rkey,
                  uint64_t length, uint64_t wr_size, uint64_t max_outstanding, uint64_t signal_every,
                  uint32_t imm, double timeout, uint64_t post_batch=POST_BATCH, peer_alive=None,
                  uint64_t marks=0, ready=None, int first_qp=0, int stripe_qps=0, table=None, starts=None,
                  state=None):
    """RDMA-WRITE ``length`` bytes from ``local_addr`` to ``remote_addr`` over ``qps``.

    The range is cut into ``wr_size`` requests; request ``i`` goes to QP
    ``i % len(qps)``.  Each QP has at most ``max_outstanding`` requests in
    flight, every ``signal_every``-th is signaled, and its last request is
    RDMA_WRITE_WITH_IMM carrying ``imm`` (a QP with no data sends a
    zero-length one), so the receiver learns that every byte on every QP
    landed.  Up to ``post_batch`` (≤ 32) requests are chained per
    ``ibv_post_send`` call.  Posting and polling run without the GIL; with
    ``peer_alive`` (a callable, e.g. a check of the control connection) the
    loop comes back every 50 ms to call it, and False raises ``PeerLost``.

    Returns
    -------
    dict
        ``bytes``, ``wrs``, ``polls``.

    Raises
    ------
    VerbsError
        A work completion failed (``status`` = its ``ibv_wc_status`` name,
        ``qp_num``, ``offset``/``length`` = the failed request's range
        relative to ``local_addr``), or posting failed.
    TransferTimeout
        No completion arrived for ``timeout`` seconds.
    PeerLost
        ``peer_alive()`` returned False; requests may still be in flight, so
        the QPs must not be reused.

    Relays (see :class:`ImmWaiter`): ``marks`` > 0 makes every ``marks``-th request per QP (but the last)
    a WRITE_WITH_IMM carrying ``MARK_BIT | its index on the QP``; ``imm`` must then fit in ``IMM_MASK``.
    ``ready`` (a buffer of one native uint64, e.g. ``array('Q', [0])``) gates the write: no request
    reaching past ``ready[0]`` bytes from ``local_addr`` is posted until another thread raises it; the
    loop then also comes back every 50 ms, so ``peer_alive`` may raise to abort (an upstream failure).

    Scatter (a weight sync): ``table`` (a C-contiguous uint64 buffer of 3 x N entries) lists N requests as
    (local offset, remote offset, bytes) from ``local_addr`` / ``remote_addr``, each at most ``wr_size``;
    they replace the cut of ``length`` (which is then only the byte count reported).  Not with ``marks`` or
    ``ready``.

    Resumed (an update that broke): ``starts`` (a sequence of one int per QP in ``qps``) is the first request
    of each QP's share to write -- its earlier ones landed -- in the same numbering as a whole write (request
    ``j`` of QP ``q`` is request ``j * stripe + first_qp + q`` of the range), so marks name the same
    requests and a QP whose share all landed posts nothing.  ``state`` (a writable buffer of 2 x len(qps)
    native uint64) receives, per QP, the requests posted and known completed (this call's ``starts``
    included): refreshed every slice and when the call returns or raises, so a broken write says what it
    had handed to the NIC.

    Several posting threads: ``qps`` may be QPs ``first_qp ..`` of a stripe over ``stripe_qps`` QPs
    (default: ``qps`` alone); this call then posts only their requests of the stripe (``wrs`` counts
    those), and waits on ``cq``, which only they may use.  Each thread calls it with its own group
    and CQ.
    """
    cdef int nq = len(qps), q
    cdef int ntot = stripe_qps if stripe_qps != 0 else nq
    cdef int g
    cdef Py_buffer view
    cdef Py_buffer tview
    cdef Py_buffer sview
    cdef bint have_view = False
    cdef bint have_tview = False
    cdef bint have_sview = False
    cdef uint64_t* out = NULL
    cdef const uint64_t* gate = NULL
    cdef const uint64_t* tab = NULL
    cdef uint64_t nreq = 0
    cdef QPState* qs = NULL
    cdef ibv_send_wr* wrs = NULL
    cdef ibv_sge* sges = NULL
    cdef ibv_wc* wcs = NULL
    cdef WriteError err
    cdef LoopState st
    cdef double slice_s = 0.05 if peer_alive is not None or ready is not None else 0.0
    cdef uint64_t nwr, mine = 0, gi
    cdef int rc
    cdef QP qp
    cq._check_open()
    if nq == 0:
        raise ValueError("need at least one QP")
    if ntot >= 1 << 16:
        raise ValueError(f"too many QPs ({ntot})")
    if first_qp < 0 or first_qp + nq > ntot:
        raise ValueError(f"QPs {first_qp}..{first_qp + nq - 1} are not within a stripe of {ntot}")
    if starts is not None and len(starts) != nq:
        raise ValueError(f"starts needs one request index per QP ({nq}), got {len(starts)}")
    if wr_size == 0 or wr_size > 0x80000000:
        raise ValueError(f"wr_size must be in [1, 2 GiB], got {wr_size}")
    if post_batch == 0 or post_batch > POST_BATCH:
        raise ValueError(f"post_batch must be in [1, {POST_BATCH}], got {post_batch}")
    if max_outstanding == 0 or signal_every == 0 or signal_every > max_outstanding:
        raise ValueError(f"need 1 <= signal_every ({signal_every}) <= max_outstanding ({max_outstanding})")
    for o in qps:
        qp = <QP?>o
        qp._check_open()
        if qp.state != "RTS":
            raise ValueError(f"QP {qp.qp.qp_num:#x} is {qp.state}, not RTS: connect it first")
        if max_outstanding > qp.max_send_wr:
            raise ValueError(f"max_outstanding {max_outstanding} exceeds the QP's send queue "
                             f"({qp.max_send_wr})")
    nwr = (length + wr_size - 1) // wr_size
    if table is not None:
        if marks != 0 or ready is not None:
            raise ValueError("a scatter table cannot be combined with marks or a ready gate")
        PyObject_GetBuffer(table, &tview, PyBUF_SIMPLE)
        have_tview = True
        if tview.len % 24 != 0 or (<uintptr_t>tview.buf) % 8 != 0:
            PyBuffer_Release(&tview)
            raise ValueError("table must be an aligned uint64 buffer of (local offset, remote offset, bytes) triples")
        tab = <const uint64_t*>tview.buf
        nreq = <uint64_t>(tview.len // 24)
        nwr = nreq
        for gi in range(nreq):
            if tab[3 * gi + 2] == 0 or tab[3 * gi + 2] > wr_size:
                PyBuffer_Release(&tview)
                raise ValueError(f"scatter request {gi} has {tab[3 * gi + 2]} bytes; each must be 1..{wr_size}")
    if marks != 0 and ((nwr + ntot - 1) // ntot > C_IMM_MASK or imm > C_IMM_MASK):
        raise ValueError(f"with marks, the update number ({imm}) and the requests per QP must fit in 31 bits")
    if ready is not None:
        PyObject_GetBuffer(ready, &view, PyBUF_SIMPLE)
        have_view = True
        if view.len < 8 or (<uintptr_t>view.buf) % 8 != 0:
            PyBuffer_Release(&view)
            raise ValueError("ready must be an aligned buffer of one uint64 (e.g. array('Q', [0]))")
        gate = <const uint64_t*>view.buf
    if state is not None:
        PyObject_GetBuffer(state, &sview, PyBUF_WRITABLE)
        have_sview = True
        if sview.len < 16 * nq or (<uintptr_t>sview.buf) % 8 != 0:
            PyBuffer_Release(&sview)
            if have_view:
                PyBuffer_Release(&view)
            if have_tview:
                PyBuffer_Release(&tview)
            raise ValueError("state must be an aligned writable buffer of 2 x len(qps) uint64")
        out = <uint64_t*>sview.buf
    memset(&err, 0, sizeof(err))
    memset(&st, 0, sizeof(st))
    try:
        qs = <QPState*>calloc(nq, sizeof(QPState))
        wrs = <ibv_send_wr*>calloc(POST_BATCH, sizeof(ibv_send_wr))
        sges = <ibv_sge*>calloc(POST_BATCH, sizeof(ibv_sge))
        wcs = <ibv_wc*>calloc(WC_BATCH, sizeof(ibv_wc))
        if qs == NULL or wrs == NULL or sges == NULL or wcs == NULL:
            raise MemoryError()
        for q in range(nq):
            qs[q].qp = (<QP>qps[q]).qp
            g = first_qp + q
            qs[q].total = (nwr - g + ntot - 1) // ntot if <uint64_t>g < nwr else 0
            mine += qs[q].total
            if qs[q].total == 0:
                qs[q].total = 1
            if starts is not None:
                if starts[q] < 0 or starts[q] > qs[q].total:
                    raise ValueError(f"QP {g} resumes at request {starts[q]}; its share has {qs[q].total}")
                qs[q].posted = qs[q].completed = <uint64_t>starts[q]
                mine -= min(<uint64_t>starts[q], mine)
                if qs[q].completed == qs[q].total:
                    st.done += 1        # all of it landed before: nothing to post, not even the immediate
        _save_state(qs, nq, out)
        st.last = _now()
        while True:
            with nogil:
                rc = _write_loop(qs, nq, first_qp, ntot, cq.cq, cq.channel, &cq.armed, local_addr, lkey, remote_addr, rkey,
                                 length, wr_size, max_outstanding, signal_every, htonl(imm), timeout, post_batch, wrs, sges, wcs,
                                 &err, &st, slice_s, marks, gate, tab, nreq)
            _save_state(qs, nq, out)
            if rc != 1:
                break
            if peer_alive is not None and not peer_alive():
                done = sum(min(qs[q].completed, qs[q].total) for q in range(nq))
                raise PeerLost(f"receiver lost during the RDMA write ({done} of "
                               f"{sum(qs[q].total for q in range(nq))} requests completed)")
        if rc == 0:
            return {"bytes": length, "wrs": mine, "polls": st.polls}
        off = err.wr_index * wr_size
        if off > length:
            off = length
        ln = min(wr_size, length - off)
        if tab != NULL and err.wr_index < nreq:
            off, ln = int(tab[3 * err.wr_index]), int(tab[3 * err.wr_index + 2])
        if err.kind == 1:
            name = wc_status_name(err.status)
            raise CompletionError(
                5, f"RDMA write failed: {name} ({wc_status_str(err.status)}, vendor_err {err.vendor_err:#x}) "
                f"on QP {err.qp_num:#x} for region bytes [{off}, {off + ln}) ({ln} bytes)",
                status=name, qp_num=err.qp_num, offset=off, length=ln)
        if err.kind == 4:
            raise VerbsError(err.post_rc, f"waiting on the send CQ's completion channel failed: "
                             f"{strerror(err.post_rc).decode()}")
        if err.kind == 2:
            raise VerbsError(err.post_rc, f"ibv_post_send failed on QP {err.qp_num:#x} at region offset "
                             f"{off}: {strerror(err.post_rc).decode()}", qp_num=err.qp_num, offset=off, length=ln)
        done = sum(min(qs[q].completed, qs[q].total) for q in range(nq))
        raise TransferTimeout(f"RDMA write stalled: no completion for {timeout:.1f} s "
                              f"({done} of {sum(qs[q].total for q in range(nq))} requests completed); "
                              f"the peer may be gone")
    finally:
        if qs != NULL:
            _save_state(qs, nq, out)
        if have_view:
            PyBuffer_Release(&view)
        if have_tview:
            PyBuffer_Release(&tview)
        if have_sview:
            PyBuffer_Release(&sview)
        free(qs)
        free(wrs)
        free(sges)
        free(wcs)


cdef class ImmWaiter:
    """Receiver side: wait until every QP's WRITE_WITH_IMM for one update arrived.

    Each QP keeps ``depth`` zero-SGE receives posted; every consumed receive
    is re-posted at once (without the GIL) so back-to-back updates never hit
    receiver-not-ready.  ``poll`` runs for at most ``slice`` seconds, so the
    caller can check deadlines and peer liveness between slices.

    Piece marks (a relay, see :func:`write_striped`): after ``reset(imm, marks, wr_size, length)`` every
    ``marks``-th request per QP also lands an immediate ``MARK_BIT | index``.  RC delivers in order per
    QP, so a mark for request ``j`` on QP ``q`` means every request ``<= j`` on ``q`` landed; with request
    ``i`` of the region on QP ``i % nq``, :meth:`prefix` is the contiguous landed prefix.  ``poll``
    returns early when marks arrived.  A mark that is not the next one expected on its QP (out of range,
    going backwards, skipping, after the QP's final immediate, or when none were asked for) is a
    :class:`TransferError`.
    """
    cdef list _qps
    cdef CQ cq
    cdef int nq
    cdef ibv_qp** qpp
    cdef uint32_t* qpn
    cdef uint8_t* got
    cdef uint8_t* flushed     # a QP whose receives were seen completing in error (it broke): drain stops there
    cdef int ngot
    cdef uint32_t expect
    cdef ibv_wc* wcs
    cdef uint64_t* total      # requests per QP this update (marks only)
    cdef uint64_t* prog       # requests per QP known to have landed
    cdef uint64_t marks, wr_size, length, nwr
    cdef uint64_t pending     # immediates of this update not yet taken from the CQ

    def __cinit__(self):
        self.qpp = NULL
        self.qpn = NULL
        self.got = NULL
        self.flushed = NULL
        self.wcs = NULL
        self.total = NULL
        self.prog = NULL

    def __init__(self, list qps, CQ cq):
        cdef int i
        cdef QP qp
        self._qps = list(qps)
        self.cq = cq
        self.nq = len(qps)
        self.qpp = <ibv_qp**>calloc(self.nq, sizeof(ibv_qp*))
        self.qpn = <uint32_t*>calloc(self.nq, sizeof(uint32_t))
        self.got = <uint8_t*>calloc(self.nq, 1)
        self.flushed = <uint8_t*>calloc(self.nq, 1)
        self.wcs = <ibv_wc*>calloc(WC_BATCH, sizeof(ibv_wc))
        self.total = <uint64_t*>calloc(self.nq, sizeof(uint64_t))
        self.prog = <uint64_t*>calloc(self.nq, sizeof(uint64_t))
        if self.qpp == NULL or self.qpn == NULL or self.got == NULL or self.wcs == NULL or self.total == NULL \
                or self.prog == NULL or self.flushed == NULL:
            raise MemoryError()
        for i in range(self.nq):
            qp = <QP?>qps[i]
            self.qpp[i] = qp.qp
            self.qpn[i] = qp.qp.qp_num

    def __dealloc__(self):
        free(self.qpp)
        free(self.qpn)
        free(self.got)
        free(self.flushed)
        free(self.wcs)
        free(self.total)
        free(self.prog)

    def reset(self, uint32_t imm, uint64_t marks=0, uint64_t wr_size=0, uint64_t length=0, starts=None):
        """Start waiting for the update whose immediate is ``imm``; with ``marks`` > 0, also for a mark every
        ``marks``-th request per QP of ``length`` bytes written in ``wr_size`` requests.

        ``starts`` (marks only; one int per QP): the update resumes after a break, and QP ``q``'s first
        ``starts[q]`` requests landed before (what :meth:`landed` said then); a QP whose share all landed
        (its final immediate included) waits for nothing more."""
        cdef int q
        cdef uint64_t s0
        if marks != 0 and wr_size == 0:
            raise ValueError("marks need the sender's wr_size")
        if starts is not None and (marks == 0 or len(starts) != self.nq):
            raise ValueError(f"starts need marks and one request index per QP ({self.nq})")
        memset(self.got, 0, self.nq)
        memset(self.flushed, 0, self.nq)
        memset(self.prog, 0, self.nq * sizeof(uint64_t))
        self.ngot = 0
        self.expect = imm
        self.marks, self.wr_size, self.length = marks, wr_size, length
        self.nwr = (length + wr_size - 1) // wr_size if marks != 0 else 0
        self.pending = self.nq
        for q in range(self.nq):
            # as write_striped stripes: request i on QP i % nq, at least the final one per QP
            self.total[q] = (self.nwr - q + self.nq - 1) // self.nq if <uint64_t>q < self.nwr else 0
            if self.total[q] == 0:
                self.total[q] = 1
            if marks != 0:
                self.pending += (self.total[q] - 1) // marks
            if starts is not None:
                s0 = <uint64_t>starts[q]
                if s0 > self.total[q] or s0 % marks != 0 and s0 != self.total[q]:
                    raise ValueError(f"QP {q} resumes at request {s0}: not a mark of its {self.total[q]}")
                self.prog[q] = s0
                if s0 == self.total[q]:
                    self.got[q] = 1
                    self.ngot += 1
                    self.pending -= 1 + (self.total[q] - 1) // marks
                else:
                    self.pending -= s0 // marks

    def landed(self):
        """Per QP, how many of its requests are known to have landed (marks, or its final immediate)."""
        return [int(self.prog[q]) for q in range(self.nq)]

    def drain(self, double timeout):
        """After every QP was moved to the error state: take what is left in the CQ, so :meth:`landed` is final.

        Receives complete in order per QP, so once a QP's first flushed receive is taken every immediate that
        landed before its error is counted.  Nothing is re-posted.  Returns True when every QP showed its
        flush within ``timeout`` seconds (else :meth:`landed` is still a lower bound: resuming from it sends
        some landed bytes again, never skips one).
        """
        cdef int n, i, q, left
        cdef uint32_t imm
        cdef uint64_t j
        cdef double t0
        cdef timespec pause
        cdef uint8_t* flushed = self.flushed
        pause.tv_sec = 0
        pause.tv_nsec = IDLE_MAX_NS
        self.cq._check_open()
        left = self.nq
        for q in range(self.nq):
            left -= flushed[q]       # its error already taken (by poll): everything before it was counted
        if True:
            with nogil:
                t0 = _now()
                while left > 0 and _now() - t0 < timeout:
                    n = ibv_poll_cq(self.cq.cq, WC_BATCH, self.wcs)
                    if n < 0:
                        break
                    if n == 0:
                        nanosleep(&pause, NULL)
                        continue
                    for i in range(n):
                        q = <int>self.wcs[i].wr_id
                        if q < 0 or q >= self.nq:
                            continue
                        if self.wcs[i].status != IBV_WC_SUCCESS:
                            if not flushed[q]:
                                flushed[q] = 1
                                left -= 1
                            continue
                        if flushed[q] or not (self.wcs[i].wc_flags & IBV_WC_WITH_IMM):
                            continue
                        imm = ntohl(self.wcs[i].imm_data)
                        if imm & C_MARK_BIT:
                            j = imm & C_IMM_MASK
                            if self.marks != 0 and not self.got[q] and j + 1 < self.total[q] \
                                    and j + 1 == self.prog[q] + self.marks:
                                self.prog[q] = j + 1
                        elif imm == self.expect and not self.got[q]:
                            self.got[q] = 1
                            self.ngot += 1
                            self.prog[q] = self.total[q]
        return left == 0

    def prefix(self):
        """Bytes landed contiguously from offset 0 (the whole ``length`` once complete; 0 without marks)."""
        cdef int q
        cdef uint64_t reqs
        if self.ngot == self.nq:
            return self.length
        reqs = self.nwr
        for q in range(self.nq):
            if self.prog[q] < self.total[q] and self.prog[q] * self.nq + q < reqs:
                reqs = self.prog[q] * self.nq + q     # the first request not known to have landed
        return min(reqs * self.wr_size, self.length)

    def missing(self):
        """QP numbers whose immediate has not arrived yet."""
        return [self.qpn[i] for i in range(self.nq) if not self.got[i]]

    def poll(self, double slice):
        """Poll for up to ``slice`` seconds; True once every QP's immediate arrived.

        Raises
        ------
        VerbsError
            A receive completed with an error (the QP broke: peer gone or a
            protection fault), naming the status and QP.
        TransferError
            An immediate carried another update's number (protocol confusion).
        """
        cdef int n, i, q, bad_q = -1, rc = 0, post_rc = 0
        cdef uint32_t imm = 0, bad_status = 0, bad_qpn = 0, bad_imm = 0
        cdef uint64_t bad_prog = 0
        cdef int bad_got = 0
        cdef int kind = 0
        cdef int idle = 0
        cdef int block_ms, block_err = 0
        cdef bint marked = False
        cdef uint64_t j
        cdef double t0, left
        cdef timespec pause
        cdef ibv_recv_wr rwr
        cdef ibv_recv_wr* rbad
        pause.tv_sec = 0
        pause.tv_nsec = IDLE_MIN_NS
        for o in self._qps:
            (<QP?>o)._check_open()
        self.cq._check_open()
        memset(&rwr, 0, sizeof(rwr))
        with nogil:
            t0 = _now()
            while self.ngot < self.nq:
                # Take at most as many completions as immediates are missing: the
                # sender may already be writing the next update, whose immediates
                # follow ours in the CQ, and they must stay there for the next wait.
                n = ibv_poll_cq(self.cq.cq, <int>min(<uint64_t>WC_BATCH, self.pending), self.wcs)
                if n < 0:
                    kind = 3
                    break
                for i in range(n):
                    if self.wcs[i].status != IBV_WC_SUCCESS:
                        if kind == 0:
                            kind = 1
                            bad_status = self.wcs[i].status
                            bad_qpn = self.wcs[i].qp_num
                        q = <int>self.wcs[i].wr_id
                        if 0 <= q < self.nq:
                            self.flushed[q] = 1    # receives complete in order: none of its marks is still to come
                        continue
                    q = <int>self.wcs[i].wr_id
                    if q < 0 or q >= self.nq:
                        continue
                    rwr.wr_id = q
                    rc = ibv_post_recv(self.qpp[q], &rwr, &rbad)
                    if rc != 0 and kind == 0:
                        kind = 4
                        post_rc = rc        # later posts in this batch may succeed and reset rc
                        bad_qpn = self.qpn[q]
                    imm = ntohl(self.wcs[i].imm_data)
                    if (self.wcs[i].wc_flags & IBV_WC_WITH_IMM) and (imm & C_MARK_BIT):
                        j = imm & C_IMM_MASK
                        # RC delivers in order: the only valid mark is the next one on its QP
                        if self.marks == 0 or self.got[q] or j + 1 >= self.total[q] \
                                or j + 1 != self.prog[q] + self.marks:
                            if kind == 0:
                                kind = 6
                                bad_qpn = self.qpn[q]
                                bad_imm = imm
                                # what was expected when it came: later completions of the batch move on
                                bad_prog, bad_got = self.prog[q], self.got[q]
                            continue
                        self.prog[q] = j + 1
                        self.pending -= 1
                        marked = True
                        continue
                    if not (self.wcs[i].wc_flags & IBV_WC_WITH_IMM) or imm != self.expect:
                        if kind == 0:
                            kind = 2
                            bad_qpn = self.qpn[q]
                            bad_imm = imm
                        continue
                    if self.got[q]:
                        # A QP's final immediate comes once per update (the next update waits for our ack):
                        # a second one is a sender flooding the CQ, which would keep this loop from ever
                        # reaching its deadline checks.
                        if kind == 0:
                            kind = 7
                            bad_qpn = self.qpn[q]
                            bad_imm = imm
                        continue
                    self.got[q] = 1
                    self.ngot += 1
                    self.prog[q] = self.total[q]
                    self.pending -= 1
                if kind != 0 or marked:
                    break           # marks: the caller reports the new prefix now
                if n > 0 and _now() - t0 > slice:
                    break           # busy or not, the caller checks its deadline and the peer every slice
                if n == 0:
                    left = slice - (_now() - t0)
                    if left <= 0:
                        break
                    # The receiver has nothing to do until the last immediates arrive, so it must not
                    # spin: a spinning receiver takes a core from whatever moves the bytes (measured on
                    # Soft-RoCE, where the kernel does: the engine's warm updates ran at 0.2-0.3 of
                    # ib_write_bw while both ends spun).  It blocks on the CQ's completion channel (woken
                    # by the first immediate that lands), or without one backs off to sleeps doubling
                    # from IDLE_MIN_NS to IDLE_MAX_NS.
                    idle += 1
                    if idle > IDLE_SPINS:
                        if self.cq.channel != NULL:
                            block_ms = <int>(left * 1000) + 1
                            if _cq_block(self.cq.cq, self.cq.channel, &self.cq.armed,
                                         block_ms if block_ms < BLOCK_MS else BLOCK_MS) != 0:
                                kind = 5
                                block_err = errno
                                break
                        else:
                            nanosleep(&pause, NULL)
                            if pause.tv_nsec < IDLE_MAX_NS:
                                pause.tv_nsec = min(2 * pause.tv_nsec, <long>IDLE_MAX_NS)
                else:
                    idle = 0
                    pause.tv_nsec = IDLE_MIN_NS
        if kind == 1:
            name = wc_status_name(bad_status)
            raise CompletionError(5, f"RDMA receive failed: {name} ({wc_status_str(bad_status)}) on QP {bad_qpn:#x}; "
                             f"the sender's QP is gone or broken", status=name, qp_num=bad_qpn)
        if kind == 2:
            raise TransferError(f"QP {bad_qpn:#x} delivered immediate {bad_imm:#x}, expected {self.expect:#x}: "
                                f"sender and receiver disagree on the update number")
        if kind == 3:
            raise VerbsError(5, "ibv_poll_cq failed on the receive CQ")
        if kind == 4:
            raise VerbsError(post_rc if post_rc > 0 else 5, f"ibv_post_recv failed on QP {bad_qpn:#x}",
                             qp_num=bad_qpn)
        if kind == 5:
            raise VerbsError(block_err or 5, f"waiting on the receive CQ's completion channel failed: "
                             f"{strerror(block_err or 5).decode()}")
        if kind == 7:
            raise TransferError(f"QP {bad_qpn:#x} delivered its final immediate ({bad_imm:#x}) twice in one "
                                f"update: the sender does not follow the protocol; end the session")
        if kind == 6:
            raise TransferError(f"QP {bad_qpn:#x} delivered piece mark {bad_imm & C_IMM_MASK} (immediate "
                                f"{bad_imm:#x}), but {self._expected_mark(bad_qpn, bad_prog, bad_got)}: the sender "
                                f"does not stripe as this receiver asked; end the session")
        return self.ngot == self.nq

    cdef str _expected_mark(self, uint32_t qpn, uint64_t prog, int got):
        """What the QP expected when the bad mark came (``prog``, ``got``: its state then)."""
        cdef int q
        if self.marks == 0:
            return "no marks were asked for"
        for q in range(self.nq):
            if self.qpn[q] == qpn:
                if got or prog + self.marks >= self.total[q]:
                    return f"no more marks are expected there (its last request is {self.total[q] - 1})"
                return (f"the next mark expected there is request {prog + self.marks - 1} of "
                        f"{self.total[q]} (every {self.marks}-th)")
        return "the QP is not one of this receiver's"
