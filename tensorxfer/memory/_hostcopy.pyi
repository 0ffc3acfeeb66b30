from typing import Any

def copy_groups(src: Any, dst: Any, src_off: Any, dst_off: Any, nbytes: Any, count: Any, src_stride: Any,
                dst_stride: Any, start: int = ..., step: int = ...) -> int: ...
