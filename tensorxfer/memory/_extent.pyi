class Extent:
    ptr: int
    length: int
    offset: int
    request_ptr: int
    request_length: int
    segments: tuple[tuple[int, int], ...]
    def covers(self, ptr: int, length: int) -> bool: ...

class AllocationMap:
    def allocation_at(self, offset: int) -> tuple[int, int] | None: ...
    def resolve_extent(self, offset: int, length: int, whole_alloc: bool = ...) -> Extent: ...
