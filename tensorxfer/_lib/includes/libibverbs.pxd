# Declarations from libibverbs (rdma-core's infiniband/verbs.h), only what
# tensorxfer uses.  Struct declarations list only the fields we touch; C
# code accesses them by name, so layout comes from the real header.
# Several of these names are macros or static inlines in newer rdma-core
# (ibv_reg_mr, ibv_query_port, ibv_query_gid_ex): Cython emits plain calls,
# which the header resolves.
#
# The library itself is not linked: verbs_dl.h (beside this file) includes
# verbs.h and defines every libibverbs function the module calls as a
# trampoline through a table that txv_load() fills from dlopen("libibverbs.so.1"),
# so the module imports where rdma-core is absent and says so when used.

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t


cdef extern from "verbs_dl.h" nogil:
    # ------------------------------------------------------------- enums
    cdef enum ibv_node_type:
        IBV_NODE_UNKNOWN
        IBV_NODE_CA

    cdef enum ibv_port_state:
        IBV_PORT_NOP
        IBV_PORT_DOWN
        IBV_PORT_INIT
        IBV_PORT_ARMED
        IBV_PORT_ACTIVE
        IBV_PORT_ACTIVE_DEFER

    cdef enum:
        IBV_LINK_LAYER_UNSPECIFIED
        IBV_LINK_LAYER_INFINIBAND
        IBV_LINK_LAYER_ETHERNET

    cdef enum ibv_mtu:
        IBV_MTU_256
        IBV_MTU_512
        IBV_MTU_1024
        IBV_MTU_2048
        IBV_MTU_4096

    cdef enum ibv_gid_type:
        IBV_GID_TYPE_IB
        IBV_GID_TYPE_ROCE_V1
        IBV_GID_TYPE_ROCE_V2

    cdef enum ibv_access_flags:
        IBV_ACCESS_LOCAL_WRITE
        IBV_ACCESS_REMOTE_WRITE
        IBV_ACCESS_REMOTE_READ

    cdef enum ibv_qp_type:
        IBV_QPT_RC

    cdef enum ibv_qp_state:
        IBV_QPS_RESET
        IBV_QPS_INIT
        IBV_QPS_RTR
        IBV_QPS_RTS
        IBV_QPS_SQD
        IBV_QPS_SQE
        IBV_QPS_ERR

    cdef enum ibv_qp_attr_mask:
        IBV_QP_STATE
        IBV_QP_ACCESS_FLAGS
        IBV_QP_PKEY_INDEX
        IBV_QP_PORT
        IBV_QP_AV
        IBV_QP_PATH_MTU
        IBV_QP_TIMEOUT
        IBV_QP_RETRY_CNT
        IBV_QP_RNR_RETRY
        IBV_QP_RQ_PSN
        IBV_QP_MAX_QP_RD_ATOMIC
        IBV_QP_MIN_RNR_TIMER
        IBV_QP_SQ_PSN
        IBV_QP_MAX_DEST_RD_ATOMIC
        IBV_QP_DEST_QPN

    cdef enum ibv_wr_opcode:
        IBV_WR_RDMA_WRITE
        IBV_WR_RDMA_WRITE_WITH_IMM
        IBV_WR_SEND

    cdef enum ibv_send_flags:
        IBV_SEND_FENCE
        IBV_SEND_SIGNALED
        IBV_SEND_SOLICITED
        IBV_SEND_INLINE

    cdef enum ibv_wc_status:
        IBV_WC_SUCCESS
        IBV_WC_LOC_LEN_ERR
        IBV_WC_LOC_QP_OP_ERR
        IBV_WC_LOC_EEC_OP_ERR
        IBV_WC_LOC_PROT_ERR
        IBV_WC_WR_FLUSH_ERR
        IBV_WC_REM_ACCESS_ERR
        IBV_WC_RETRY_EXC_ERR
        IBV_WC_RNR_RETRY_EXC_ERR

    cdef enum ibv_wc_opcode:
        IBV_WC_SEND
        IBV_WC_RDMA_WRITE
        IBV_WC_RECV
        IBV_WC_RECV_RDMA_WITH_IMM

    cdef enum ibv_wc_flags:
        IBV_WC_WITH_IMM

    # ------------------------------------------------------------- structs
    cdef struct ibv_device:
        char name[64]

    cdef struct ibv_context:
        ibv_device* device

    cdef struct ibv_device_attr:
        char fw_ver[64]
        uint64_t node_guid
        uint64_t max_mr_size
        uint32_t vendor_id
        uint32_t vendor_part_id
        uint32_t hw_ver
        int max_qp
        int max_qp_wr
        int max_sge
        int max_cq
        int max_cqe
        int max_mr
        int max_pd
        int max_qp_rd_atom
        uint8_t phys_port_cnt

    cdef struct ibv_port_attr:
        ibv_port_state state
        ibv_mtu max_mtu
        ibv_mtu active_mtu
        int gid_tbl_len
        uint32_t max_msg_sz
        uint16_t lid
        uint8_t active_width
        uint8_t active_speed
        uint8_t phys_state
        uint8_t link_layer

    cdef union ibv_gid:
        uint8_t raw[16]

    cdef struct ibv_gid_entry:
        ibv_gid gid
        uint32_t gid_index
        uint32_t port_num
        uint32_t gid_type
        uint32_t ndev_ifindex

    cdef struct ibv_pd:
        ibv_context* context

    cdef struct ibv_mr:
        ibv_context* context
        ibv_pd* pd
        void* addr
        size_t length
        uint32_t lkey
        uint32_t rkey

    cdef struct ibv_comp_channel:
        int fd

    cdef struct ibv_cq:
        ibv_context* context
        int cqe

    cdef struct ibv_srq:
        pass

    cdef struct ibv_qp:
        ibv_context* context
        uint32_t qp_num
        ibv_qp_state state

    cdef struct ibv_qp_cap:
        uint32_t max_send_wr
        uint32_t max_recv_wr
        uint32_t max_send_sge
        uint32_t max_recv_sge
        uint32_t max_inline_data

    cdef struct ibv_qp_init_attr:
        void* qp_context
        ibv_cq* send_cq
        ibv_cq* recv_cq
        ibv_srq* srq
        ibv_qp_cap cap
        ibv_qp_type qp_type
        int sq_sig_all

    cdef struct ibv_global_route:
        ibv_gid dgid
        uint32_t flow_label
        uint8_t sgid_index
        uint8_t hop_limit
        uint8_t traffic_class

    cdef struct ibv_ah_attr:
        ibv_global_route grh
        uint16_t dlid
        uint8_t sl
        uint8_t src_path_bits
        uint8_t static_rate
        uint8_t is_global
        uint8_t port_num

    cdef struct ibv_qp_attr:
        ibv_qp_state qp_state
        ibv_mtu path_mtu
        uint32_t rq_psn
        uint32_t sq_psn
        uint32_t dest_qp_num
        unsigned int qp_access_flags
        ibv_qp_cap cap
        ibv_ah_attr ah_attr
        uint16_t pkey_index
        uint8_t max_rd_atomic
        uint8_t max_dest_rd_atomic
        uint8_t min_rnr_timer
        uint8_t port_num
        uint8_t timeout
        uint8_t retry_cnt
        uint8_t rnr_retry

    cdef struct ibv_sge:
        uint64_t addr
        uint32_t length
        uint32_t lkey

    # The anonymous/nested unions of ibv_send_wr, named here for Cython only;
    # generated C code spells ``wr.wr.rdma.remote_addr`` and ``wr.imm_data``.
    cdef struct _ibv_wr_rdma:
        uint64_t remote_addr
        uint32_t rkey

    cdef union _ibv_send_wr_wr:
        _ibv_wr_rdma rdma

    cdef struct ibv_send_wr:
        uint64_t wr_id
        ibv_send_wr* next
        ibv_sge* sg_list
        int num_sge
        ibv_wr_opcode opcode
        unsigned int send_flags
        uint32_t imm_data            # __be32: network byte order
        _ibv_send_wr_wr wr

    cdef struct ibv_recv_wr:
        uint64_t wr_id
        ibv_recv_wr* next
        ibv_sge* sg_list
        int num_sge

    cdef struct ibv_wc:
        uint64_t wr_id
        ibv_wc_status status
        ibv_wc_opcode opcode
        uint32_t vendor_err
        uint32_t byte_len
        uint32_t imm_data            # __be32: network byte order
        uint32_t qp_num
        uint32_t src_qp
        unsigned int wc_flags

    # ------------------------------------------------------------- loading (verbs_dl.h)
    # 1: libibverbs is loaded; -1: it is not (txv_load_message says why).  Called with the GIL.
    int txv_load()
    const char* txv_load_message()
    # optional functions this rdma-core lacks (their calls fail with EOPNOTSUPP)
    int txv_missing_count()
    const char* txv_missing_name(int i)

    # ------------------------------------------------------------- functions
    ibv_device** ibv_get_device_list(int* num_devices)
    void ibv_free_device_list(ibv_device** list)
    const char* ibv_get_device_name(ibv_device* device)
    ibv_context* ibv_open_device(ibv_device* device)
    int ibv_close_device(ibv_context* context)

    int ibv_query_device(ibv_context* context, ibv_device_attr* device_attr)
    int ibv_query_port(ibv_context* context, uint8_t port_num, ibv_port_attr* port_attr)
    int ibv_query_gid(ibv_context* context, uint8_t port_num, int index, ibv_gid* gid)
    int ibv_query_gid_ex(ibv_context* context, uint32_t port_num, uint32_t gid_index,
                         ibv_gid_entry* entry, uint32_t flags)

    ibv_pd* ibv_alloc_pd(ibv_context* context)
    int ibv_dealloc_pd(ibv_pd* pd)

    ibv_mr* ibv_reg_mr(ibv_pd* pd, void* addr, size_t length, int access)
    ibv_mr* ibv_reg_dmabuf_mr(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova,
                              int fd, int access)
    int ibv_dereg_mr(ibv_mr* mr)

    ibv_cq* ibv_create_cq(ibv_context* context, int cqe, void* cq_context,
                          ibv_comp_channel* channel, int comp_vector)
    int ibv_destroy_cq(ibv_cq* cq)
    int ibv_poll_cq(ibv_cq* cq, int num_entries, ibv_wc* wc)
    # Completion events: a CQ armed with ibv_req_notify_cq makes its channel's fd readable at the
    # next completion (once per arming); every event taken with ibv_get_cq_event must be acked.
    ibv_comp_channel* ibv_create_comp_channel(ibv_context* context)
    int ibv_destroy_comp_channel(ibv_comp_channel* channel)
    int ibv_req_notify_cq(ibv_cq* cq, int solicited_only)
    int ibv_get_cq_event(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context)
    void ibv_ack_cq_events(ibv_cq* cq, unsigned int nevents)

    ibv_qp* ibv_create_qp(ibv_pd* pd, ibv_qp_init_attr* qp_init_attr)
    int ibv_modify_qp(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask)
    int ibv_destroy_qp(ibv_qp* qp)
    int ibv_post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr)
    int ibv_post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr)

    const char* ibv_wc_status_str(ibv_wc_status status)
    const char* ibv_port_state_str(ibv_port_state port_state)
    const char* ibv_node_type_str(ibv_node_type node_type)
