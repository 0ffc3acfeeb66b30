"""Tied weights: one tensor under several names is stored and sent once, and comes back as aliases."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensorxfer as tx
from tensorxfer import Manifest, ManifestError, TensorRegion
from tests.conftest import torch_or_skip
from tests.helpers import Background


def addr(rx: tx.Receiver) -> str:
    host, port = rx.address
    return f"{host}:{port}"


def test_numpy_tied_tensors_are_stored_once_and_view_the_same_memory():
    w = np.arange(1000, dtype=np.float32).reshape(100, 10)
    other = np.ones(7, np.float16)
    with TensorRegion.from_tensors({"embed": w, "norm": other, "head": w}) as r, \
            TensorRegion.from_tensors({"embed": w, "norm": other}) as untied:
        assert r.manifest.aliases == {"head": "embed"}
        assert r.nbytes == untied.nbytes, "the shared storage counts once"
        assert r.manifest["head"] == r.manifest["embed"]._replace(name="head")
        views = r.tensors()
        assert list(views) == ["embed", "norm", "head"]
        np.testing.assert_array_equal(views["head"], w)
        assert np.shares_memory(views["embed"], views["head"])
        views["embed"][0, 0] = -1
        assert views["head"][0, 0] == -1
        del views


def test_only_identical_views_are_aliases():
    w = np.arange(64, dtype=np.float32).reshape(8, 8)
    same = w[:]                       # another ndarray object, same pointer/dtype/shape/strides
    tensors = {"w": w, "same": same, "rows": w[1:], "t": w.T, "as_int": w.view(np.int32),
               "flat": w.reshape(-1), "copy": w.copy(), "empty": w[:0], "empty2": w[:0]}
    with TensorRegion.from_tensors(tensors) as r:
        assert r.manifest.aliases == {"same": "w"}
        views = r.tensors()
        for name, src in tensors.items():
            np.testing.assert_array_equal(views[name], src)
        del views


def test_torch_tied_parameters_and_a_numpy_view_of_them_are_one_tensor():
    torch = torch_or_skip()
    emb = torch.nn.Embedding(50, 16)
    head = torch.nn.Linear(16, 50, bias=False)
    head.weight = emb.weight                            # how transformers ties lm_head to the embedding
    sd = {"emb.weight": emb.weight.detach(), "head.weight": head.weight.detach(),
          "np.weight": emb.weight.detach().numpy(), "other": torch.zeros(3)}
    with TensorRegion.from_tensors(sd) as r:
        assert r.manifest.aliases == {"head.weight": "emb.weight", "np.weight": "emb.weight"}
        assert r.nbytes == r.manifest["other"].offset + 12
        v = r.tensors(framework="torch")
        assert torch.equal(v["head.weight"], emb.weight.detach())
        assert v["head.weight"].data_ptr() == v["emb.weight"].data_ptr() == v["np.weight"].data_ptr()
        del v


def test_tied_tensors_travel_once_and_land_as_aliases():
    w = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
    with TensorRegion.from_tensors({"a": w, "b": np.zeros(5, np.int64), "c": w}) as r, tx.Receiver() as rx:
        job = Background(rx.receive, timeout=30)
        with tx.Sender(addr(rx), transport="tcp") as s:
            stats = s.send(r, verify=True)
        got = job.result()
        assert stats.bytes == r.nbytes == got.nbytes == w.nbytes + 5 * 8    # w once, then b
        assert got.manifest.aliases == {"c": "a"} and got.manifest == r.manifest
        views = got.tensors()
        np.testing.assert_array_equal(views["c"], w)
        assert np.shares_memory(views["a"], views["c"])
        del views


def test_gpt2_state_dict_sends_the_tied_embedding_once_and_loads_with_identical_logits():
    torch = torch_or_skip()
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=512, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config).eval()
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr(), "GPT-2 ties them"
    once = sum(t.nbytes for n, t in sd.items() if n != "lm_head.weight")
    with TensorRegion.from_tensors(sd) as r, tx.Receiver() as rx:
        assert r.manifest.aliases == {"lm_head.weight": "transformer.wte.weight"}
        assert r.nbytes < once + 256 * len(sd), "the 128 KiB embedding is stored once"
        job = Background(rx.receive, timeout=60)
        with tx.Sender(addr(rx), transport="tcp") as s:
            s.send(r)
        got = job.result()
        views = got.tensors(framework="torch")
        assert views["lm_head.weight"].data_ptr() == views["transformer.wte.weight"].data_ptr()
        clone = transformers.GPT2LMHeadModel(config).eval()
        clone.load_state_dict(views)
        ids = torch.arange(16).reshape(1, 16)
        with torch.no_grad():
            assert torch.equal(clone(ids).logits, model(ids).logits)
        del views, clone


# ------------------------------------------------------------ aliases as hostile input
def tied() -> Manifest:
    return Manifest.layout([("a", "F32", (4, 4)), ("b", "U8", (3,)), ("c", "F32", (4, 4)), ("d", "U8", (3,))],
                           aliases={"c": "a", "d": "b"})


def raw(m: Manifest) -> dict:
    return msgpack.unpackb(m.pack(), raw=False)


def pairs(*p: int) -> bytes:
    return np.array(p, dtype="<u8").tobytes()


def test_manifests_without_aliases_keep_the_old_format():
    m = Manifest.layout([("a", "F32", (4,))])
    assert "aliases" not in raw(m) and m.aliases == {}
    assert Manifest.unpack(tied().pack()) == tied() and tied().aliases == {"c": "a", "d": "b"}


@pytest.mark.parametrize("aliases, message", [
    (pairs(2, 0, 3), "pairs of little-endian uint64"),
    (b"", "pairs of little-endian uint64"),
    ("x", "pairs of little-endian uint64"),
    (pairs(0, 1, 1, 0, 2, 0, 3, 0), "pairs of little-endian uint64"),  # as many aliases as tensors
    (pairs(2, 9), "tensor index 9"),
    (pairs(3, 1, 2, 0), "strictly increasing"),
    (pairs(2, 0, 2, 0), "strictly increasing"),
    (pairs(2, 2), "itself an alias"),
    (pairs(2, 0, 3, 2), "itself an alias"),
    (pairs(1, 0), "differs"),                                          # U8[3] is not F32[4, 4]
    (pairs(2, 0, 3, 0), "differs"),
])
def test_hostile_aliases_are_refused(aliases, message):
    obj = raw(tied())
    obj["aliases"] = aliases
    with pytest.raises(ManifestError, match=message):
        Manifest.unpack(msgpack.packb(obj, use_bin_type=True))


def test_an_alias_row_that_does_not_repeat_its_target_is_refused():
    obj = raw(tied())
    offsets = np.frombuffer(obj["offsets"], "<u8").copy()
    offsets[2] = offsets[3] = obj["nbytes"] + 256 - (obj["nbytes"] % 256)
    obj["offsets"] = offsets.tobytes()
    obj.pop("aliases")      # without aliases these rows are ordinary tensors placed elsewhere
    obj["nbytes"] = int(offsets[2]) + 64
    with pytest.raises(ManifestError, match=r"overlap|agree"):
        Manifest.unpack(msgpack.packb(obj, use_bin_type=True))
    obj["aliases"] = pairs(2, 0)
    with pytest.raises(ManifestError):
        Manifest.unpack(msgpack.packb(obj, use_bin_type=True))


def test_layout_refuses_an_alias_of_nothing():
    with pytest.raises(ManifestError, match="not a stored tensor"):
        Manifest.layout([("a", "U8", (3,))], aliases={"a": "zz"})
    with pytest.raises(ManifestError):
        Manifest.layout([("a", "U8", (3,)), ("b", "U8", (4,))], aliases={"b": "a"})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=80) | st.lists(st.integers(0, 6), max_size=10).map(lambda v: pairs(*v)))
def test_fuzz_alias_columns_are_refused_or_consistent(aliases):
    obj = raw(tied())
    obj["aliases"] = aliases
    try:
        m = Manifest.unpack(msgpack.packb(obj, use_bin_type=True))
    except ManifestError:
        return
    for alias, target in m.aliases.items():
        assert m[alias]._replace(name=target) == m[target] and target not in m.aliases
