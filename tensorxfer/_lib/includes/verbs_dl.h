/* libibverbs, loaded at run time instead of linked.
 *
 * Why: a wheel whose verbs module links libibverbs.so.1 fails to import on a
 * machine without rdma-core, and a wheel may not bundle libibverbs either (it
 * and its providers must match the machine's kernel and NIC).  So the module
 * is compiled against verbs.h as usual but does not link the library: every
 * function of libibverbs it calls is defined below as a small trampoline with
 * the library's own name, calling through a pointer that txv_load() fills with
 * dlopen("libibverbs.so.1") + dlvsym.  The verbs.h static inlines (ibv_post_send,
 * ibv_poll_cq, ibv_req_notify_cq, ...) go through ctx->ops and need no symbol;
 * the ones that do call the library (__ibv_reg_mr, ___ibv_query_port,
 * ibv_query_gid_ex) reach these trampolines like any other caller.
 *
 * Each trampoline is compiled with the declaration from verbs.h in scope, so a
 * signature that drifts from rdma-core's is a compile error.  Symbols are
 * looked up with the version the linker bound when the module was linked
 * (objdump -T on a linked build), the ABI this code was written for.  The
 * module is built with -fvisibility=hidden: these names never leave it, so
 * they neither clash with nor interpose a libibverbs another library loaded.
 *
 * Included by exactly one translation unit (tensorxfer.transport._verbs, via
 * _lib/includes/libibverbs.pxd).  txv_load() runs with the GIL held.
 */
#ifndef TENSORXFER_VERBS_DL_H
#define TENSORXFER_VERBS_DL_H

#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <infiniband/verbs.h>

#define TXV_SONAME "libibverbs.so.1"

/* X(return type, name, (parameters), (arguments), symbol version, required, value when absent)
 * required = 0: newer than the oldest rdma-core we run on; absent, the call fails with EOPNOTSUPP. */
#define TXV_FUNCTIONS(X)                                                                             \
    X(struct ibv_device **, ibv_get_device_list, (int *num_devices), (num_devices), "IBVERBS_1.1", 1, NULL) \
    X(const char *, ibv_get_device_name, (struct ibv_device *device), (device), "IBVERBS_1.1", 1, NULL) \
    X(struct ibv_context *, ibv_open_device, (struct ibv_device *device), (device), "IBVERBS_1.1", 1, NULL) \
    X(int, ibv_close_device, (struct ibv_context *context), (context), "IBVERBS_1.1", 1, EOPNOTSUPP) \
    X(int, ibv_query_device, (struct ibv_context *context, struct ibv_device_attr *device_attr),     \
      (context, device_attr), "IBVERBS_1.1", 1, EOPNOTSUPP)                                           \
    X(int, ibv_query_port, (struct ibv_context *context, uint8_t port_num,                           \
                            struct _compat_ibv_port_attr *port_attr),                                \
      (context, port_num, port_attr), "IBVERBS_1.1", 1, EOPNOTSUPP)                                   \
    X(int, ibv_query_gid, (struct ibv_context *context, uint8_t port_num, int index, union ibv_gid *gid), \
      (context, port_num, index, gid), "IBVERBS_1.1", 1, EOPNOTSUPP)                                  \
    X(int, _ibv_query_gid_ex, (struct ibv_context *context, uint32_t port_num, uint32_t gid_index,   \
                               struct ibv_gid_entry *entry, uint32_t flags, size_t entry_size),      \
      (context, port_num, gid_index, entry, flags, entry_size), "IBVERBS_1.11", 0, EOPNOTSUPP)        \
    X(struct ibv_pd *, ibv_alloc_pd, (struct ibv_context *context), (context), "IBVERBS_1.1", 1, NULL) \
    X(int, ibv_dealloc_pd, (struct ibv_pd *pd), (pd), "IBVERBS_1.1", 1, EOPNOTSUPP)                   \
    X(struct ibv_mr *, ibv_reg_mr, (struct ibv_pd *pd, void *addr, size_t length, int access),      \
      (pd, addr, length, access), "IBVERBS_1.1", 1, NULL)                                             \
    X(struct ibv_mr *, ibv_reg_mr_iova2, (struct ibv_pd *pd, void *addr, size_t length, uint64_t iova, \
                                         unsigned int access),                                       \
      (pd, addr, length, iova, access), "IBVERBS_1.8", 0, NULL)                                       \
    X(struct ibv_mr *, ibv_reg_dmabuf_mr, (struct ibv_pd *pd, uint64_t offset, size_t length,        \
                                          uint64_t iova, int fd, int access),                        \
      (pd, offset, length, iova, fd, access), "IBVERBS_1.12", 0, NULL)                                \
    X(int, ibv_dereg_mr, (struct ibv_mr *mr), (mr), "IBVERBS_1.1", 1, EOPNOTSUPP)                     \
    X(struct ibv_cq *, ibv_create_cq, (struct ibv_context *context, int cqe, void *cq_context,      \
                                      struct ibv_comp_channel *channel, int comp_vector),            \
      (context, cqe, cq_context, channel, comp_vector), "IBVERBS_1.1", 1, NULL)                       \
    X(int, ibv_destroy_cq, (struct ibv_cq *cq), (cq), "IBVERBS_1.1", 1, EOPNOTSUPP)                   \
    X(struct ibv_comp_channel *, ibv_create_comp_channel, (struct ibv_context *context), (context),  \
      "IBVERBS_1.0", 1, NULL)                                                                         \
    X(int, ibv_destroy_comp_channel, (struct ibv_comp_channel *channel), (channel), "IBVERBS_1.0", 1, \
      EOPNOTSUPP)                                                                                     \
    X(int, ibv_get_cq_event, (struct ibv_comp_channel *channel, struct ibv_cq **cq, void **cq_context), \
      (channel, cq, cq_context), "IBVERBS_1.1", 1, -1)                                                \
    X(struct ibv_qp *, ibv_create_qp, (struct ibv_pd *pd, struct ibv_qp_init_attr *qp_init_attr),  \
      (pd, qp_init_attr), "IBVERBS_1.1", 1, NULL)                                                     \
    X(int, ibv_modify_qp, (struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask),             \
      (qp, attr, attr_mask), "IBVERBS_1.1", 1, EOPNOTSUPP)                                            \
    X(int, ibv_destroy_qp, (struct ibv_qp *qp), (qp), "IBVERBS_1.1", 1, EOPNOTSUPP)                   \
    X(const char *, ibv_wc_status_str, (enum ibv_wc_status status), (status), "IBVERBS_1.1", 1, NULL) \
    X(const char *, ibv_port_state_str, (enum ibv_port_state port_state), (port_state), "IBVERBS_1.1", \
      1, NULL)

/* the two that return nothing */
#define TXV_VOID_FUNCTIONS(X)                                                                        \
    X(ibv_free_device_list, (struct ibv_device **list), (list), "IBVERBS_1.1")                       \
    X(ibv_ack_cq_events, (struct ibv_cq *cq, unsigned int nevents), (cq, nevents), "IBVERBS_1.1")

#define TXV_POINTER(ret, name, params, args, version, required, absent) static ret (*txv_p_##name) params;
#define TXV_VOID_POINTER(name, params, args, version) static void (*txv_p_##name) params;
TXV_FUNCTIONS(TXV_POINTER)
TXV_VOID_FUNCTIONS(TXV_VOID_POINTER)

/* (name) in parentheses: verbs.h defines function-like macros of the same names
 * (ibv_reg_mr, ibv_query_port, ibv_get_device_list), which must not expand here. */
#define TXV_TRAMPOLINE(ret, name, params, args, version, required, absent)                         \
    ret (name) params {                                                                              \
        if (txv_p_##name == NULL) {                                                                  \
            errno = EOPNOTSUPP;                                                                      \
            return absent;                                                                           \
        }                                                                                            \
        return txv_p_##name args;                                                                    \
    }
#define TXV_VOID_TRAMPOLINE(name, params, args, version)                                            \
    void (name) params {                                                                             \
        if (txv_p_##name != NULL)                                                                    \
            txv_p_##name args;                                                                       \
    }
TXV_FUNCTIONS(TXV_TRAMPOLINE)
TXV_VOID_FUNCTIONS(TXV_VOID_TRAMPOLINE)

static int txv_state;            /* 0: not tried yet, 1: loaded, -1: failed (txv_message says why) */
static char txv_message[768];
static const char *txv_missing_optional[8];
static int txv_n_missing_optional;

/* A required symbol, or NULL with txv_message set.  The versioned lookup first; a library
 * built without symbol versions (a static-provider or vendor build) has only the plain name. */
static void *txv_symbol(void *handle, const char *name, const char *version) {
    void *p = dlvsym(handle, name, version);
    return p != NULL ? p : dlsym(handle, name);
}

/* Load libibverbs once: 1 when usable, -1 when not (txv_message says why).  The library's
 * name can be overridden with TENSORXFER_LIBIBVERBS (a path, or another soname). */
static int txv_load(void) {
    const char *soname;
    void *handle;
    if (txv_state != 0)
        return txv_state;
    soname = getenv("TENSORXFER_LIBIBVERBS");
    if (soname == NULL || soname[0] == '\0')
        soname = TXV_SONAME;
    handle = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) {
        const char *why = dlerror();
        snprintf(txv_message, sizeof txv_message, "%s", why != NULL ? why : soname);
        txv_state = -1;
        return -1;
    }
#define TXV_RESOLVE(ret, name, params, args, version, required, absent)                             \
    txv_p_##name = (ret (*) params) txv_symbol(handle, #name, version);                              \
    if (txv_p_##name == NULL) {                                                                      \
        if (required) {                                                                              \
            snprintf(txv_message, sizeof txv_message, "%s has no %s (%s): rdma-core is too old",    \
                     soname, #name, version);                                                        \
            txv_state = -1;                                                                          \
            return -1; /* handle stays open: a failed state is final, and dlclose buys nothing */    \
        }                                                                                            \
        if (txv_n_missing_optional < 8)                                                              \
            txv_missing_optional[txv_n_missing_optional++] = #name;                                  \
    }
#define TXV_VOID_RESOLVE(name, params, args, version)                                               \
    txv_p_##name = (void (*) params) txv_symbol(handle, #name, version);                             \
    if (txv_p_##name == NULL) {                                                                      \
        snprintf(txv_message, sizeof txv_message, "%s has no %s (%s): rdma-core is too old", soname, \
                 #name, version);                                                                    \
        txv_state = -1;                                                                              \
        return -1;                                                                                   \
    }
    TXV_FUNCTIONS(TXV_RESOLVE)
    TXV_VOID_FUNCTIONS(TXV_VOID_RESOLVE)
#undef TXV_RESOLVE
#undef TXV_VOID_RESOLVE
    snprintf(txv_message, sizeof txv_message, "%s", soname);
    txv_state = 1;
    return 1;
}

static const char *txv_load_message(void) { return txv_message; }
static int txv_missing_count(void) { return txv_n_missing_optional; }
static const char *txv_missing_name(int i) {
    return (i >= 0 && i < txv_n_missing_optional) ? txv_missing_optional[i] : "";
}

#endif /* TENSORXFER_VERBS_DL_H */
