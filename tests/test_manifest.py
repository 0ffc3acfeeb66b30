"""Manifest: msgpack layout, validated as hostile input, fuzzed."""

from __future__ import annotations

import itertools
import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorxfer import Manifest, ManifestError, TensorSpec
from tensorxfer.dtypes import DTYPES

SAMPLE = [("embed", "BF16", (1000, 64)), ("norm", "F32", (64,)), ("scale", "F64", ()), ("mask", "BOOL", (7,)),
          ("q", "F8_E4M3", (3, 5)), ("r", "F8_E5M2", (2,)), ("empty", "I32", (0, 4)), ("idx", "U64", (9,))]


def sample() -> Manifest:
    return Manifest.layout(SAMPLE, metadata={"step": "7"})


def raw(m: Manifest) -> dict:
    return msgpack.unpackb(m.pack(), raw=False)


def repack(obj: dict) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_layout_places_aligned_non_overlapping_offsets():
    m = sample()
    assert [t.name for t in m] == [e[0] for e in SAMPLE]
    assert all(t.offset % 256 == 0 for t in m)
    assert m["embed"] == TensorSpec("embed", "BF16", (1000, 64), 0, 128000)
    assert m["scale"].nbytes == 8 and m["empty"].nbytes == 0
    assert m.nbytes == max(t.offset + t.nbytes for t in m)


def test_round_trip_is_exact():
    m = sample().with_checksums("xxh3", range(len(SAMPLE)))
    m2 = Manifest.unpack(m.pack())
    assert m2 == m and m2.tensors == m.tensors and m2.metadata == {"step": "7"}
    assert m2.checksums == ("xxh3", tuple(range(len(SAMPLE))))


def test_every_safetensors_dtype_is_known():
    assert set(DTYPES) == {"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F16", "BF16",
                           "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E8M0"}


def u64(*values):
    return np.array(values, dtype="<u8").tobytes()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda o: o.update(version=2), "version 2 is not supported"),
        (lambda o: o.update(format="safetensors"), "not a tensorxfer manifest"),
        (lambda o: o.pop("metadata"), "missing"),
        (lambda o: o.update(extra=1), "unexpected"),
        (lambda o: o["names"].__setitem__(1, "embed"), "appears twice"),
        (lambda o: o["names"].__setitem__(1, ""), "empty"),
        (lambda o: o["names"].__setitem__(1, "x" * 1025), "longer than 1024"),
        (lambda o: o["names"].__setitem__(1, "é" * 600), "longer than 1024"),
        (lambda o: o["names"].__setitem__(1, "a\x00b"), "NUL"),
        (lambda o: o["names"].__setitem__(1, 5), "string"),
        (lambda o: o.update(dtype_names=["F32", "XX"]), "known dtypes"),
        (lambda o: o.update(dtypes=b"\x09" * 8), "outside dtype_names"),
        (lambda o: o.update(sizes=u64(1, 2, 3, 4, 5, 6, 7, 8)), "prod"),
        (lambda o: o.update(offsets=u64(0, 128000 + 1, 0, 0, 0, 0, 0, 0)), "alignment"),
        (lambda o: o.update(nbytes=o["nbytes"] + 256), "must agree"),
        (lambda o: o.update(nbytes=2**50), "limit"),
        (lambda o: o.update(offsets=o["offsets"][:8] + u64(256) + o["offsets"][16:]), "overlap"),
        (lambda o: o.update(offsets=b"\x00" * 7), "uint64"),
        (lambda o: o.update(ndims=b"\x41" * 8), "dimensions"),
        (lambda o: o.update(alignment=3), "power of two"),
        (lambda o: o.update(alignment=True), "power of two"),
        (lambda o: o.update(metadata={"k": 1}), "strings"),
        (lambda o: o.update(checksums=["xxh3", u64(1)]), "uint64"),
        (lambda o: o.update(checksums=["", u64(*range(8))]), "checksums"),
    ],
)
def test_violations_are_manifest_errors_that_say_what(change, message):
    obj = raw(sample())
    change(obj)
    with pytest.raises(ManifestError, match=message):
        Manifest.unpack(repack(obj), max_region_bytes=1 << 40)


def test_impossible_shapes_do_not_wrap_around():
    # 2**32 * 2**32 wraps to 0 in uint64; the float check catches it first.
    obj = raw(Manifest.layout([("a", "U8", (0,))]))
    obj.update(ndims=b"\x02", dims=u64(2**32, 2**32), sizes=u64(0))
    with pytest.raises(ManifestError, match="impossibly large"):
        Manifest.unpack(repack(obj))


@pytest.mark.parametrize("shape", [(0, 2**64 - 1), (0, 2**63), (2**40, 0, 2**40), (0, 2**61, 4), (0,) + (2**8,) * 8])
def test_zero_sized_shapes_that_numpy_cannot_represent_are_refused(shape):
    """A zero dim made the size 0, so (0, 2**64-1) passed and tensors() later raised a plain ValueError."""
    with pytest.raises(ValueError, match=r"too big|Maximum allowed dimension"):
        np.zeros(0, np.uint8).reshape(shape)     # what a receiver's view would do
    obj = raw(Manifest.layout([("a", "U8", (0,))]))
    obj.update(ndims=bytes([len(shape)]), dims=u64(*shape), sizes=u64(0))
    with pytest.raises(ManifestError, match=r"impossibly large.*2\*\*62"):
        Manifest.unpack(repack(obj))
    with pytest.raises(ManifestError, match="impossibly large"):
        Manifest.layout([("a", "U8", shape)])


def assert_viewable(m: Manifest) -> None:
    """Every tensor of a manifest that passed validation can be viewed with its shape."""
    for t in m:
        if t.nbytes <= 1 << 20:
            np.zeros(t.nbytes, np.uint8).view(DTYPES[t.dtype].numpy).reshape(t.shape)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 2**20) | st.just(0), min_size=1, max_size=6),
       st.sampled_from(sorted(DTYPES)))
@pytest.mark.slow
def test_fuzz_shapes_are_refused_or_viewable(shape, dtype):
    obj = raw(Manifest.layout([("a", "U8", (0,))]))
    size = int(np.prod([float(d) for d in shape])) * DTYPES[dtype].itemsize if 0 not in shape else 0
    if size >= 1 << 62:
        size = 0
    obj.update(dtype_names=[dtype], ndims=bytes([len(shape)]), dims=u64(*shape), sizes=u64(size), nbytes=size)
    try:
        m = Manifest.unpack(repack(obj))
    except ManifestError:
        return
    assert_viewable(m)


def test_limits():
    data = sample().pack()
    with pytest.raises(ManifestError, match="max_region_bytes"):
        Manifest.unpack(data, max_region_bytes=1000)
    with pytest.raises(ManifestError, match="max_tensors"):
        Manifest.unpack(data, max_tensors=3)
    with pytest.raises(ManifestError, match="max_manifest_bytes"):
        Manifest.unpack(data, max_manifest_bytes=100)
    with pytest.raises(ManifestError, match="bytes"):
        Manifest.unpack("not bytes")  # type: ignore[arg-type]


def test_constructor_validates_too():
    with pytest.raises(ManifestError, match="overlap"):
        Manifest([TensorSpec("a", "U8", (512,), 0, 512), TensorSpec("b", "U8", (4,), 256, 4)])
    with pytest.raises(ManifestError):
        Manifest([("a", "U8", ("x",), 0, 1)])
    with pytest.raises(ManifestError, match="unknown dtype"):
        Manifest.layout([("a", "Q7", (1,))])


def test_one_byte_overlap_is_refused_and_touching_tensors_are_accepted():
    """The overlap check's boundary: ``U8[257]@0`` ends at byte 257, so a tensor at 256 shares one byte."""
    with pytest.raises(ManifestError, match="'a' and 'b' overlap at offset 256"):
        Manifest([TensorSpec("a", "U8", (257,), 0, 257), TensorSpec("b", "U8", (4,), 256, 4)])
    touching = Manifest([TensorSpec("a", "U8", (256,), 0, 256), TensorSpec("b", "U8", (4,), 256, 4)])
    assert Manifest.unpack(touching.pack()).tensors == touching.tensors
    obj = raw(touching)                                   # the same boundary, as hostile input off the wire
    obj.update(dims=u64(257, 4), sizes=u64(257, 4))
    with pytest.raises(ManifestError, match="overlap at offset 256"):
        Manifest.unpack(repack(obj))


def assert_disjoint(m: Manifest) -> None:
    """No two stored (non-alias, non-empty) tensors of a manifest that passed validation share a byte."""
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in m if t.nbytes and t.name not in m.aliases)
    for (_, end, a), (begin, _, b) in itertools.pairwise(spans):
        assert begin >= end, f"{a!r} and {b!r} overlap: [{begin}, {end})"


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 600) | st.just(0), st.integers(-3, 3) | st.integers(-700, 700)),
                min_size=2, max_size=6))
@pytest.mark.slow
def test_fuzz_placements_are_accepted_exactly_when_disjoint(placements):
    """Tensors placed at, just before and just after the end of the one before them (alignment 1): the
    manifest is accepted if and only if no two non-empty tensors share a byte (an off-by-one either way in
    the overlap check fails this)."""
    sizes, offsets, end = [], [], 0
    for size, delta in placements:
        offsets.append(max(0, end + delta))
        sizes.append(size)
        end = offsets[-1] + size
    spans = [(o, o + n) for o, n in zip(offsets, sizes) if n]
    disjoint = all(b1 <= a2 or b2 <= a1 for i, (a1, b1) in enumerate(spans) for a2, b2 in spans[i + 1:])
    obj = raw(Manifest.layout([(f"t{i}", "U8", (n,)) for i, n in enumerate(sizes)], alignment=1))
    obj.update(offsets=u64(*offsets), nbytes=max(o + n for o, n in zip(offsets, sizes)))
    try:
        m = Manifest.unpack(repack(obj))
    except ManifestError as e:
        assert not disjoint, f"disjoint tensors refused: {e}"
        assert "overlap" in str(e)
        return
    assert disjoint, f"overlapping tensors accepted: {list(zip(offsets, sizes))}"
    assert_disjoint(m)


def test_hostile_array_header_allocates_nothing_large():
    # An array header claiming 2**32-1 elements in five bytes must not make
    # the decoder reserve memory for them.
    bomb = b"\xdd\xff\xff\xff\xff"
    tracemalloc.start()
    with pytest.raises(ManifestError):
        Manifest.unpack(bomb)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_fuzz_random_bytes_only_raise_manifest_error(data):
    try:
        Manifest.unpack(data)
    except ManifestError:
        pass


VALID = sample().with_checksums("crc32c", range(len(SAMPLE))).pack()


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8),
       st.integers(0, len(VALID)))
@pytest.mark.slow
def test_fuzz_mutated_valid_manifests(flips, cut):
    data = bytearray(VALID)
    for pos, value in flips:
        data[pos] = value
    for candidate in (bytes(data), bytes(data[:cut])):
        try:
            m = Manifest.unpack(candidate)
        except ManifestError:
            continue
        # whatever survives validation must be self-consistent
        assert m.nbytes == max((t.offset + t.nbytes for t in m), default=0)
        assert_viewable(m)
        assert_disjoint(m)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=20,
)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(raw(sample()))), msgpack_values)
@pytest.mark.slow
def test_fuzz_fields_replaced_by_arbitrary_values(key, value):
    obj = raw(sample())
    obj[key] = value
    try:
        m = Manifest.unpack(repack(obj))
    except ManifestError:
        return
    assert_viewable(m)
    assert_disjoint(m)


@pytest.mark.slow
def test_large_manifest_round_trips():
    n = 100_000
    m = Manifest.layout((f"layers.{i}.w", "F16", (i % 7, 3)) for i in range(n))
    m2 = Manifest.unpack(m.pack())
    assert len(m2) == n and m2.same_layout(m)


def test_nested_empty_maps_are_refused_before_decoding():
    """Per-container limits let 4 arrays of a million empty maps through: 4 million dicts (~300 MiB)
    from a 4 MiB manifest.  The header walk refuses it while allocating nothing of that size."""
    inner = b"\xdd" + (1 << 20).to_bytes(4, "big") + b"\x80" * (1 << 20)
    obj = raw(sample())
    obj["names"] = []
    body = repack(obj)
    key = msgpack.packb("names")
    at = body.index(key) + len(key)
    assert body[at] == 0x90               # the empty names list, replaced by 4 lists of 1M empty maps
    data = body[:at] + b"\x94" + inner * 4 + body[at + 1:]
    tracemalloc.start()
    with pytest.raises(ManifestError, match=r"more than \d+ msgpack objects|deeper than"):
        Manifest.unpack(data)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < len(data), f"peak {peak} bytes while refusing a {len(data)}-byte manifest"
    with pytest.raises(ManifestError, match="deeper than 3"):
        Manifest.unpack(body[:at] + b"\x91\x91\x91\x90" + body[at + 1:])
    flat = body[:at] + b"\xdd" + (4 << 20).to_bytes(4, "big") + b"\x80" * (4 << 20) + body[at + 1:]
    with pytest.raises(ManifestError, match=r"more than \d+ msgpack objects"):
        Manifest.unpack(flat)
