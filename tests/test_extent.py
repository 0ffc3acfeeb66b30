"""Extent resolution over multi-handle regions: the UCX bug and its rules.

Layouts are real HostRegions (memfd chunks in a PROT_NONE reservation) with
holes (unmapped chunks) and unmapped tails, the shapes a CUDA VMM
reservation can take.  The expected answer is computed independently from
the chunk table.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorxfer import ExtentError, HostRegion
from tensorxfer.memory import page_size

PAGE = page_size()


def ucx_answer(region, offset):
    """What UCX did: one cuMemGetAddressRange at the start, trusted as the whole extent."""
    return region.allocation_at(offset)


def covers(segment, start, length):
    base, size = segment
    return base <= start and start + length <= base + size


def test_ucx_shape_three_handles_queried_from_the_base():
    chunk = 4 * PAGE
    with HostRegion._from_chunks([chunk] * 3) as r:
        request = (r.ptr, 3 * chunk)
        # The bug: the allocation holding the base is one handle, not the request.
        old = ucx_answer(r, 0)
        assert old == (r.ptr, chunk)
        assert not covers(old, *request), "the first handle alone must not pass as the extent"
        ext = r.resolve_extent(0, 3 * chunk)
        assert ext.segments == tuple((r.ptr + i * chunk, chunk) for i in range(3))
        assert (ext.ptr, ext.length) == request and ext.covers(*request)
        # a query at base+chunk for one chunk is exactly that chunk
        mid = r.resolve_extent(chunk, chunk)
        assert mid.segments == ((r.ptr + chunk, chunk),) and (mid.ptr, mid.length) == (r.ptr + chunk, chunk)


def test_request_crossing_a_boundary_by_one_byte_spans_both_handles():
    with HostRegion._from_chunks([PAGE, PAGE]) as r:
        ext = r.resolve_extent(PAGE - 1, 2)
        assert len(ext.segments) == 2 and (ext.ptr, ext.length) == (r.ptr + PAGE - 1, 2)
        wide = r.resolve_extent(PAGE - 1, 2, whole_alloc=True)
        assert (wide.ptr, wide.length) == (r.ptr, 2 * PAGE)


def test_whole_alloc_never_widens_into_an_unmapped_tail():
    with HostRegion._from_chunks([PAGE, 2 * PAGE], unmapped_tail=8 * PAGE) as r:
        assert r.reserved_size == 11 * PAGE and r.size == 3 * PAGE
        ext = r.resolve_extent(PAGE, 10, whole_alloc=True)
        assert (ext.ptr, ext.length) == (r.ptr + PAGE, 2 * PAGE)
        with pytest.raises(ExtentError) as e:
            r.resolve_extent(0, 3 * PAGE + 1)
        assert e.value.address == r.ptr + 3 * PAGE


def test_hole_is_named():
    with HostRegion._from_chunks([PAGE] * 4, holes={2}) as r:
        assert r.allocation_at(2 * PAGE) is None
        with pytest.raises(ExtentError, match=f"offset {2 * PAGE}") as e:
            r.resolve_extent(PAGE, 3 * PAGE)
        assert e.value.address == r.ptr + 2 * PAGE
        assert r.resolve_extent(0, 2 * PAGE).length == 2 * PAGE


def test_unmapping_a_chunk_later_makes_a_hole():
    with HostRegion.allocate(4 * PAGE, chunk_size=PAGE) as r:
        r._unmap_chunk(1)
        assert r.chunks[1][2] == -1
        with pytest.raises(ExtentError):
            r.resolve_extent(0, 4 * PAGE)


@pytest.mark.parametrize("offset, length", [(0, 0), (0, 4 * PAGE + 1), (4 * PAGE, 1), (2**63, 1), (1, 2**64 - 1)])
def test_bad_requests(offset, length):
    with HostRegion.allocate(4 * PAGE, chunk_size=PAGE) as r, pytest.raises(ExtentError):
        r.resolve_extent(offset, length)


def test_many_handles_resolve_in_one_walk():
    with HostRegion.allocate(2000 * PAGE, chunk_size=PAGE) as r:
        ext = r.resolve_extent(0, r.size)
        assert len(ext.segments) == 2000 and ext.length == r.size


@st.composite
def layouts(draw):
    n = draw(st.integers(1, 12))
    pages = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    holes = draw(st.sets(st.integers(0, n - 1), max_size=n // 2))
    tail = draw(st.integers(0, 3))
    total = sum(pages) * PAGE
    offset = draw(st.integers(0, total + PAGE))
    length = draw(st.integers(0, total + PAGE))
    return pages, holes, tail, offset, length, draw(st.booleans())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_resolver_matches_the_chunk_table(layout):
    pages, holes, tail, offset, length, whole = layout
    sizes = [p * PAGE for p in pages]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    with HostRegion._from_chunks(sizes, unmapped_tail=tail * PAGE, holes=holes) as r:
        covering = [i for i, (s, z) in enumerate(zip(starts, sizes)) if s < offset + length and offset < s + z]
        if length == 0 or offset + length > sum(sizes):
            with pytest.raises(ExtentError):
                r.resolve_extent(offset, length, whole)
            return
        first_hole = next((i for i in covering if i in holes), None)
        if first_hole is not None:
            with pytest.raises(ExtentError) as e:
                r.resolve_extent(offset, length, whole)
            assert e.value.address == r.ptr + max(starts[first_hole], offset)
            return
        ext = r.resolve_extent(offset, length, whole)
        assert ext.segments == tuple((r.ptr + starts[i], sizes[i]) for i in covering)
        # never shrink below the request
        assert ext.covers(r.ptr + offset, length)
        if whole:
            # widened exactly to mapped handle bounds, never into holes or the tail
            assert ext.ptr == r.ptr + starts[covering[0]]
            assert ext.ptr + ext.length == r.ptr + starts[covering[-1]] + sizes[covering[-1]]
        else:
            assert (ext.ptr, ext.length) == (r.ptr + offset, length)
        # the UCX answer (one lookup) is accepted only when one handle really covers it
        assert covers(ucx_answer(r, offset), r.ptr + offset, length) == (len(covering) == 1)
