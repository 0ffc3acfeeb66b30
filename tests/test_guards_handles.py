"""Guards of imported memfds that no other test could see fail (issue 37): a chunk memfd must be sealed both
against shrinking and against growing; one sealed against only one of the two is refused naming the other."""

from __future__ import annotations

import fcntl
import os

import pytest

from tensorxfer import HandleError, HostRegion
from tensorxfer.memory import page_size

from .conftest import tensorxfer_mappings
from .test_host_region import _test_memfd

PAGE = page_size()


@pytest.mark.parametrize("seal, missing, present", [(fcntl.F_SEAL_SHRINK, "F_SEAL_GROW", "F_SEAL_SHRINK"),
                                                    (fcntl.F_SEAL_GROW, "F_SEAL_SHRINK", "F_SEAL_GROW")])
def test_a_memfd_sealed_against_only_one_resize_is_refused_naming_the_missing_seal(seal, missing, present) -> None:
    both = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    before = len(tensorxfer_mappings())
    good, half = _test_memfd(PAGE, both), _test_memfd(PAGE, seal)
    try:
        assert fcntl.fcntl(half, fcntl.F_GET_SEALS) & both == seal
        with pytest.raises(HandleError, match=f"handle 1: fd {half} lacks {missing};") as e:
            HostRegion.import_handles([(PAGE, good), (PAGE, half)])
        assert e.value.index == 1 and f"lacks {present}" not in str(e.value)
        assert len(tensorxfer_mappings()) == before, "nothing may be mapped"
        for writable in (False, True):
            with pytest.raises(HandleError, match=f"lacks {missing}"):
                HostRegion.import_handles([(PAGE, half)], writable=writable)
        with HostRegion.import_handles([(PAGE, good)]) as ok:     # the fully sealed one imports
            assert ok.size == PAGE
    finally:
        os.close(good)
        os.close(half)
