"""Memory: one virtual range, many physical handles.

``HostRegion`` (memfd chunks) is always available; ``CudaRegion`` (CUDA VMM)
is present where the CUDA extension was built.
"""

from tensorxfer.memory._extent import AllocationMap, Extent
from tensorxfer.memory._host import HostRegion, page_size

__all__ = ["AllocationMap", "Extent", "HostRegion", "page_size"]
