"""Memory: one virtual range, many physical handles.

``HostRegion`` (memfd chunks) is always available.  ``CudaRegion`` (CUDA
VMM) exists where the CUDA extension was built and cuda-bindings imports;
otherwise ``CudaRegion`` is None and ``CUDA_UNAVAILABLE`` says why.  Where it
exists but no driver or GPU is present, its calls raise ``CudaError``.
"""

from tensorxfer.memory._extent import AllocationMap, Extent
from tensorxfer.memory._host import HostRegion, page_size

try:
    from tensorxfer.memory._cuda import CudaRegion
    CUDA_UNAVAILABLE: str | None = None
except ImportError as _e:  # extension not built, or cuda-bindings missing
    CudaRegion = None  # type: ignore[assignment,misc]
    CUDA_UNAVAILABLE = f"tensorxfer.memory._cuda cannot be imported ({_e}); pip install 'tensorxfer[cuda]'"

__all__ = ["CUDA_UNAVAILABLE", "AllocationMap", "CudaRegion", "Extent", "HostRegion", "page_size"]
