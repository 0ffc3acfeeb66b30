"""Memory: one virtual range, many physical handles.

``HostRegion`` (memfd chunks) is always available.  ``CudaRegion`` (CUDA
VMM) exists where the CUDA extensions were built and cuda-bindings imports;
otherwise ``CudaRegion`` is None and ``CUDA_UNAVAILABLE`` says why (the
top-level ``tensorxfer.CudaRegion`` is then :class:`UnavailableCudaRegion`,
whose every use raises ``CudaError`` with that reason).  Where it exists but
no driver or GPU is present, its calls raise ``CudaError``.
"""

from typing import Any, NoReturn

from tensorxfer.errors import CudaError
from tensorxfer.memory._extent import AllocationMap, Extent
from tensorxfer.memory._host import HostRegion, page_size

try:
    from tensorxfer.memory._cuda import CudaRegion
    CUDA_UNAVAILABLE: str | None = None
except ImportError as _e:  # extension not built, or cuda-bindings missing
    CudaRegion = None  # type: ignore[assignment,misc]
    CUDA_UNAVAILABLE = f"tensorxfer.memory._cuda cannot be imported ({_e}); pip install 'tensorxfer[cuda]'"



class _Unavailable(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args: object, **kwargs: object) -> NoReturn:
            raise CudaError(f"CudaRegion.{name}: CUDA is not usable in this installation: {CUDA_UNAVAILABLE}")

        return unavailable


class UnavailableCudaRegion(metaclass=_Unavailable):
    """``tensorxfer.CudaRegion`` where the CUDA extensions cannot be imported.

    The name exists so code and type annotations import everywhere; calling
    any factory (``CudaRegion.allocate(...)``) or constructing one raises
    :class:`~tensorxfer.errors.CudaError` saying why CUDA is unavailable.
    ``isinstance(x, UnavailableCudaRegion)`` is never true.
    """

    def __new__(cls, *args: object, **kwargs: object) -> NoReturn:
        raise CudaError(f"CudaRegion: CUDA is not usable in this installation: {CUDA_UNAVAILABLE}")


__all__ = ["CUDA_UNAVAILABLE", "AllocationMap", "CudaRegion", "Extent", "HostRegion", "UnavailableCudaRegion",
           "page_size"]
