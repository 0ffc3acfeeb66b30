# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
"""The CUDA driver layer shared by ``_cuda`` (CudaRegion) and ``_copy`` (Stager, Copier).

The driver is reached only through ``cuda.bindings.cydriver`` (cimported,
called without the GIL).  Nothing links libcuda: cuda.bindings loads it at
run time, so this module imports on machines without a GPU, and every call
there raises :class:`~tensorxfer.errors.CudaError` saying so.

Contexts: every call runs in the device's *primary* context (the one
PyTorch and CuPy use), made current on the calling thread first
(``bind_device``).  The primary-context cache lives here, once per process,
for both extension modules; they reach these helpers through ``_driver.pxd``
(cimport).  The device queries (``device_info`` & co.) are re-exported by
``_cuda``, where doctor, the tests and the benchmarks look for them.
"""

import threading

from cuda.bindings cimport cydriver
from libc.stdint cimport uintptr_t
from libc.string cimport memset

from tensorxfer.errors import CudaError


# ------------------------------------------------------------------ errors
def _error_name(int result):
    cdef const char* s = NULL
    try:
        if cydriver.cuGetErrorName(<cydriver.CUresult>result, &s) == cydriver.CUDA_SUCCESS and s != NULL:
            return s.decode()
    except Exception:
        pass
    return f"CUresult {result}"


cdef int check_cu(cydriver.CUresult result, const char* what) except -1 nogil:
    """Raise CudaError for a failed driver call; the GIL is taken only on failure."""
    if result == cydriver.CUDA_SUCCESS:
        return 0
    with gil:
        name = _error_name(<int>result)
        raise CudaError(f"{what.decode()} failed: {name}", <int>result, name)


# ------------------------------------------------------------------ driver / contexts
cdef bint _initialized = False
_contexts = {}                # device ordinal -> primary CUcontext (as int), retained for the process
_lock = threading.Lock()


cdef int ensure_driver() except -1:
    global _initialized
    if _initialized:
        return 0
    cdef cydriver.CUresult r
    try:
        with nogil:
            r = cydriver.cuInit(0)
    except CudaError:
        raise
    except Exception as e:       # cuda.bindings could not load libcuda
        raise CudaError(f"the CUDA driver is not available on this machine ({type(e).__name__}: {e}); "
                        f"use device='cpu', or install the NVIDIA driver") from None
    if r == cydriver.CUDA_ERROR_NO_DEVICE:
        raise CudaError("no CUDA device is visible (cuInit: CUDA_ERROR_NO_DEVICE); use device='cpu'",
                        <int>r, "CUDA_ERROR_NO_DEVICE")
    check_cu(r, b"cuInit")
    _initialized = True
    return 0


cdef cydriver.CUcontext bind_device(int device) except? NULL:
    """Make ``device``'s primary context current on this thread and return it."""
    cdef cydriver.CUdevice dev
    cdef cydriver.CUcontext ctx
    cdef int count = 0
    ensure_driver()
    cached = _contexts.get(device)
    if cached is None:
        with _lock:
            cached = _contexts.get(device)
            if cached is None:
                check_cu(cydriver.cuDeviceGetCount(&count), b"cuDeviceGetCount")
                if device < 0 or device >= count:
                    raise CudaError(f"CUDA device {device} does not exist ({count} visible)")
                check_cu(cydriver.cuDeviceGet(&dev, device), b"cuDeviceGet")
                check_cu(cydriver.cuDevicePrimaryCtxRetain(&ctx, dev), b"cuDevicePrimaryCtxRetain")
                cached = <uintptr_t>ctx
                _contexts[device] = cached
    ctx = <cydriver.CUcontext><uintptr_t>cached
    check_cu(cydriver.cuCtxSetCurrent(ctx), b"cuCtxSetCurrent")
    return ctx


cdef int _attr(cydriver.CUdevice_attribute attr, int device) except? -1:
    cdef int value = 0
    cdef cydriver.CUdevice dev
    check_cu(cydriver.cuDeviceGet(&dev, device), b"cuDeviceGet")
    check_cu(cydriver.cuDeviceGetAttribute(&value, attr, dev), b"cuDeviceGetAttribute")
    return value


cdef void _fill_prop(cydriver.CUmemAllocationProp* prop, int device, bint shareable, bint gdr) noexcept nogil:
    memset(prop, 0, sizeof(cydriver.CUmemAllocationProp))
    prop.type = cydriver.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cydriver.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = (cydriver.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if shareable
                                 else cydriver.CU_MEM_HANDLE_TYPE_NONE)
    prop.allocFlags.gpuDirectRDMACapable = 1 if gdr else 0


def driver_version():
    """The CUDA driver's version as an int (e.g. 13000); CudaError without a driver."""
    cdef int v = 0
    ensure_driver()
    check_cu(cydriver.cuDriverGetVersion(&v), b"cuDriverGetVersion")
    return v


def device_count():
    cdef int n = 0
    ensure_driver()
    check_cu(cydriver.cuDeviceGetCount(&n), b"cuDeviceGetCount")
    return n


def device_info(int device=0):
    """What this device supports that tensorxfer uses (for ``doctor`` and for choices here)."""
    cdef char name[256]
    cdef cydriver.CUdevice dev
    cdef cydriver.CUmemAllocationProp prop
    cdef size_t gran = 0
    bind_device(device)
    check_cu(cydriver.cuDeviceGet(&dev, device), b"cuDeviceGet")
    check_cu(cydriver.cuDeviceGetName(name, 256, dev), b"cuDeviceGetName")
    info = {
        "device": device,
        "name": name.decode(errors="replace"),
        "driver_version": driver_version(),
        "vmm": bool(_attr(cydriver.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device)),
        "posix_fd_handles": bool(_attr(cydriver.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                                       device)),
        "gpudirect_rdma_with_vmm": bool(_attr(cydriver.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                                              device)),
        "dmabuf": bool(_attr(cydriver.CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, device)),
    }
    _fill_prop(&prop, device, False, False)
    check_cu(cydriver.cuMemGetAllocationGranularity(&gran, &prop, cydriver.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
             b"cuMemGetAllocationGranularity")
    info["granularity"] = gran
    return info


def pointer_range(uintptr_t ptr):
    """The driver's two one-shot answers for ``ptr``, for diagnostics and tests.

    Returns ``{"address_range": (base, size) | None, "range_size_attribute":
    (start, size) | None}``: ``cuMemGetAddressRange`` (the one handle holding
    ``ptr`` on VMM memory — too small to register from) and
    ``CU_POINTER_ATTRIBUTE_RANGE_START_ADDR/RANGE_SIZE`` (the whole
    reservation, unmapped parts included — too large).  tensorxfer uses
    neither alone: see ``AllocationMap.resolve_extent``.
    """
    cdef cydriver.CUdeviceptr base = 0, start = 0
    cdef size_t size = 0, rsize = 0
    ensure_driver()
    out = {"address_range": None, "range_size_attribute": None}
    if cydriver.cuMemGetAddressRange(&base, &size, <cydriver.CUdeviceptr>ptr) == cydriver.CUDA_SUCCESS:
        out["address_range"] = (<uintptr_t>base, size)
    if (cydriver.cuPointerGetAttribute(&start, cydriver.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                       <cydriver.CUdeviceptr>ptr) == cydriver.CUDA_SUCCESS and
            cydriver.cuPointerGetAttribute(&rsize, cydriver.CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                           <cydriver.CUdeviceptr>ptr) == cydriver.CUDA_SUCCESS):
        out["range_size_attribute"] = (<uintptr_t>start, rsize)
    return out


def is_vmm(uintptr_t ptr):
    """True if ``ptr`` lies in VMM memory (cuMemCreate+cuMemMap), False for cudaMalloc memory."""
    cdef cydriver.CUmemGenericAllocationHandle h
    ensure_driver()
    if cydriver.cuMemRetainAllocationHandle(&h, <void*>ptr) != cydriver.CUDA_SUCCESS:
        return False
    cydriver.cuMemRelease(h)          # drop the reference Retain took
    return True
