from cuda.bindings cimport cydriver


# Shared by _cuda.pyx (CudaRegion) and _copy.pyx (Stager, Copier); defined in _driver.pyx.
cdef int check_cu(cydriver.CUresult result, const char* what) except -1 nogil
cdef cydriver.CUcontext bind_device(int device) except? NULL
cdef int _attr(cydriver.CUdevice_attribute attr, int device) except? -1
cdef void _fill_prop(cydriver.CUmemAllocationProp* prop, int device, bint shareable, bint gdr) noexcept nogil
