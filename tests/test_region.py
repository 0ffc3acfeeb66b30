"""TensorRegion: many tensors in one multi-handle region, zero-copy views, in-place updates."""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest

from tensorxfer import LayoutError, Manifest, ManifestError, RegionClosed, TensorRegion
from tensorxfer.dtypes import DTYPES
from tensorxfer.memory import page_size

from .conftest import tensorxfer_mappings, torch_or_skip

rng = np.random.default_rng(7)


def random_array(dtype: np.dtype, shape) -> np.ndarray:
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    if dtype == np.bool_:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


def all_dtypes_tensors():
    return {f"t.{name}": random_array(d.numpy, (3, 5)) for name, d in DTYPES.items()}


def test_from_tensors_packs_every_dtype_and_views_are_zero_copy():
    src = all_dtypes_tensors()
    with TensorRegion.from_tensors(src, chunk_size=page_size()) as r:
        assert len(r.region.chunks) >= 1
        views = r.tensors()
        for name, a in src.items():
            assert views[name].dtype == a.dtype and views[name].shape == a.shape
            assert views[name].tobytes() == a.tobytes()
        # writes through a view land in the region
        views["t.F32"][0, 0] = 123.5
        assert r.tensors()["t.F32"][0, 0] == 123.5
        assert src["t.F32"][0, 0] != 123.5          # the input was copied, not aliased
        del views


def test_tensors_span_chunk_boundaries():
    page = page_size()
    big = random_array(np.dtype(np.float32), (3 * page,))      # 3 pages of float32 = 12 pages of bytes
    with TensorRegion.from_tensors([("small", np.ones(3, np.int8)), ("big", big)], chunk_size=page) as r:
        assert len(r.region.chunks) > 10
        assert r.tensors()["big"].tobytes() == big.tobytes()
        ext = r.resolve_extent()
        assert ext.length == r.nbytes and len(ext.segments) == len(r.region.chunks)


def test_non_contiguous_and_scalar_inputs():
    base = np.arange(100, dtype=np.int64).reshape(10, 10)
    src = {"strided": base[::2, 1::3], "transposed": base.T, "scalar": np.float32(2.5) * np.ones(())}
    with TensorRegion.from_tensors(src) as r:
        v = r.tensors()
        assert np.array_equal(v["strided"], base[::2, 1::3]) and v["strided"].flags.c_contiguous
        assert np.array_equal(v["transposed"], base.T)
        assert v["scalar"].shape == () and v["scalar"] == 2.5
        del v


def test_sequence_input_keeps_order_and_alignment():
    with TensorRegion.from_tensors([("b", np.zeros(3, np.uint8)), ("a", np.zeros(3, np.uint8))],
                                   alignment=4096) as r:
        assert r.manifest.names == ("b", "a")
        assert [t.offset for t in r.manifest] == [0, 4096]


def test_buffer_protocol_and_dlpack_inputs():
    src = {"bytes": bytearray(b"abcdef"), "mv": memoryview(np.arange(4, dtype=np.uint16))}
    with TensorRegion.from_tensors(src) as r:
        v = r.tensors()
        assert v["bytes"].tobytes() == b"abcdef" and v["mv"].tolist() == [0, 1, 2, 3]
        del v


def test_bad_inputs_are_clear_errors():
    with pytest.raises(TypeError, match="not an array"):
        TensorRegion.from_tensors({"x": object()})
    with pytest.raises(TypeError, match="unsupported numpy dtype"):
        TensorRegion.from_tensors({"x": np.zeros(3, np.complex64)})
    with pytest.raises(TypeError, match="mapping"):
        TensorRegion.from_tensors([("only-a-name",)])
    with pytest.raises(ManifestError, match="twice"):
        TensorRegion.from_tensors([("x", np.zeros(1)), ("x", np.zeros(1))])
    with pytest.raises(ValueError, match="at least one"):
        TensorRegion.from_tensors({})
    with pytest.raises(ValueError, match="device"):
        TensorRegion.from_tensors({"x": np.zeros(1)}, device="tpu")


def test_update_from_copies_in_place_and_rejects_mismatches():
    src = {"w": random_array(np.dtype(ml_dtypes.bfloat16), (4, 4)), "b": np.zeros(4, np.float32)}
    with TensorRegion.from_tensors(src) as r:
        ptr = r.region.ptr
        step2 = {"w": random_array(np.dtype(ml_dtypes.bfloat16), (4, 4)), "b": np.ones(4, np.float32)}
        r.update_from(step2)
        assert r.region.ptr == ptr
        assert r.tensors()["w"].tobytes() == step2["w"].tobytes()
        before = r.region  # nothing is copied when the update does not match
        snapshot = bytes(memoryview(before))
        with pytest.raises(LayoutError, match="missing"):
            r.update_from({"w": step2["w"]})
        with pytest.raises(LayoutError, match="unexpected"):
            r.update_from({**step2, "extra": np.zeros(1)})
        with pytest.raises(LayoutError, match=r"F32\[4\].*BF16\[4, 4\]"):
            r.update_from({"w": np.zeros(4, np.float32), "b": step2["b"]})
        with pytest.raises(LayoutError, match=r"\[5\]"):
            r.update_from({"w": step2["w"], "b": np.zeros(5, np.float32)})
        assert bytes(memoryview(before)) == snapshot


def test_from_manifest_allocates_the_same_layout_zeroed():
    with TensorRegion.from_tensors(all_dtypes_tensors()) as r:
        m = Manifest.unpack(r.manifest.pack())
        with TensorRegion.from_manifest(m) as dst:
            assert dst.manifest.same_layout(r.manifest)
            assert not np.frombuffer(dst.region, np.uint8).any()
            dst.update_from(r.tensors())
            assert bytes(memoryview(dst.region))[: r.nbytes] == bytes(memoryview(r.region))[: r.nbytes]


def test_exit_with_an_exception_keeps_memory_for_the_views_in_flight():
    kept = []
    with pytest.raises(KeyError), TensorRegion.from_tensors({"x": np.arange(10)}) as r:
        kept.append(r.tensors()["x"])
        raise KeyError("boom")       # not masked by an error from __exit__
    assert r.closed and not r.region.released and kept[0][3] == 3
    kept.clear()
    assert r.region.released


def test_close_with_live_views_never_raises_refuses_new_views_and_releases_with_the_last():
    before = len(tensorxfer_mappings())
    r = TensorRegion.from_tensors({"x": np.arange(10), "y": np.ones(3, np.float32)}, chunk_size=page_size())
    v = r.tensors()
    x = v["x"]
    del v
    r.close()
    assert r.closed and not r.region.released
    with pytest.raises(RegionClosed, match="closed"):
        r.tensors()
    with pytest.raises(RegionClosed):
        r.tensors(framework="torch")
    with pytest.raises(RegionClosed):
        r.update_from({"x": np.arange(10), "y": np.ones(3, np.float32)})
    assert x.tolist() == list(range(10))               # the live view still reads the right bytes
    assert len(tensorxfer_mappings()) > before
    del x                                              # the last view: released now
    assert r.region.released and len(tensorxfer_mappings()) == before
    r.close()
    assert r.closed


def test_close_with_a_live_torch_view_releases_when_it_goes():
    torch = torch_or_skip()
    before = len(tensorxfer_mappings())
    r = TensorRegion.from_tensors({"w": np.arange(12, dtype=np.float32).reshape(3, 4)})
    try:
        t = r.tensors(framework="torch")["w"]
    finally:
        r.close()
    assert not r.region.released and torch.equal(t, torch.arange(12, dtype=torch.float32).reshape(3, 4))
    del t
    gc.collect()
    assert r.region.released and len(tensorxfer_mappings()) == before


def test_no_internal_view_outlives_close():
    # tensors() and update_from() used to cache a byte view that kept the memory mapped forever
    before = len(tensorxfer_mappings())
    r = TensorRegion.from_tensors({"x": np.arange(10)})
    r.update_from({"x": np.arange(10) * 2})
    assert r.tensors()["x"][3] == 6
    assert r.region.views == 0
    r.close()
    assert r.region.released and len(tensorxfer_mappings()) == before


def test_torch_views_and_inputs_all_dtypes():
    torch = torch_or_skip()
    src = {
        "bf16": torch.randn(8, 16, dtype=torch.bfloat16),
        "f8a": torch.randn(4, 4).to(torch.float8_e4m3fn),
        "f8b": torch.randn(4, 4).to(torch.float8_e5m2),
        "bool": torch.rand(5) > 0.5,
        "strided": torch.arange(30, dtype=torch.int32).reshape(5, 6).t(),
        "scalar": torch.tensor(3.0, dtype=torch.float64),
    }
    with TensorRegion.from_tensors(src) as r:
        views = r.tensors(framework="torch")
        for name, t in src.items():
            assert views[name].dtype == t.dtype and views[name].shape == t.shape
            assert torch.equal(views[name].view(torch.uint8) if t.dim() else views[name], t.contiguous().view(
                torch.uint8) if t.dim() else t)
        views["bf16"][0, 0] = 7.0
        assert r.tensors()["bf16"][0, 0] == 7.0          # numpy (ml_dtypes) view sees the torch write
        r.update_from({k: v.clone() for k, v in views.items()})
        del views
