"""TensorRegion.from_module and receive(into=module), in one process: the module keeps working, its
tensors are region views, replaced tensors are caught, mismatched offers are refused before bytes move."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import tensorxfer as tx
from tests.helpers import Background

torch = pytest.importorskip("torch", reason="live weights need PyTorch")
nn = torch.nn


class Tiny(nn.Module):
    """Parameters, a tied weight, a persistent int64 buffer (BatchNorm) and a non-persistent one."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight                    # tied
        self.register_buffer("scratch", torch.zeros(4), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


def region_views(region: tx.TensorRegion) -> dict[str, torch.Tensor]:
    return region.tensors(framework="torch")


@pytest.mark.slow
def test_an_adopted_module_is_its_region_and_keeps_working() -> None:
    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([1, 2, 3, 4])
    model.eval()
    out_before = model(ids)
    with tx.TensorRegion.from_module(model) as region:
        assert set(region.manifest.names) == set(before)       # params + persistent buffers, tied under both names
        assert "scratch" not in region.manifest
        assert region.manifest.aliases == {"head.weight": "embed.weight"}       # stored once
        views = region_views(region)
        for name, t in model.state_dict(keep_vars=True).items():
            assert t.data_ptr() == views[name].data_ptr(), name
            assert torch.equal(t, before[name]), name
        assert model.head.weight is model.embed.weight
        assert torch.equal(model(ids), out_before)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model(ids).sum().backward()
        opt.step()
        views = region_views(region)
        assert not torch.equal(views["body.0.weight"], before["body.0.weight"]), "the step must write the region"
        assert torch.equal(views["body.0.weight"], model.body[0].weight)
        assert int(views["body.1.num_batches_tracked"]) == 1       # the buffer is updated in place too
        region.ensure_current()                                  # nothing replaced


def test_each_view_has_a_storage_of_its_own_so_safetensors_can_save_the_state_dict(tmp_path) -> None:
    st = pytest.importorskip("safetensors.torch")
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    with tx.TensorRegion.from_module(model):
        st.save_file(model.state_dict(), str(tmp_path / "m.safetensors"))     # refuses tensors sharing storage
        back = st.load_file(str(tmp_path / "m.safetensors"))
        assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("replace", ["data", "parameter", "load_state_dict_assign", "to_float64"])
def test_a_replaced_tensor_is_named_before_anything_is_sent_and_the_session_stays_usable(replace: str) -> None:
    model = Tiny()
    region = tx.TensorRegion.from_module(model)
    if replace == "data":
        model.body[0].weight.data = model.body[0].weight.data.clone()
        culprit = "body.0.weight"
    elif replace == "parameter":
        model.body[3].bias = nn.Parameter(torch.zeros(16))
        culprit = "body.3.bias"
    elif replace == "load_state_dict_assign":
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        culprit = "embed.weight"
    else:
        model.to(torch.float64)
        culprit = "embed.weight"
    with region, tx.Receiver() as rx, \
            tx.TensorRegion.from_tensors({"x": np.arange(8, dtype=np.float32)}) as other:
        got = Background(rx.receive, timeout=20)
        with tx.Sender("{}:{}".format(*rx.address)) as s:
            with pytest.raises(tx.BindingError, match=culprit) as err:
                s.send(region)
            assert err.value.tensor == culprit
            s.send(other)                                       # the session was not broken by the refusal
        assert np.array_equal(got.result().tensors()["x"], np.arange(8, dtype=np.float32))


def test_receive_into_a_module_binds_it_and_refuses_a_layout_that_does_not_fit() -> None:
    src, dst = Tiny(seed=0), Tiny(seed=1)
    with tx.TensorRegion.from_module(src) as region, tx.Receiver() as rx:
        got = Background(rx.receive, timeout=20, into=dst)
        with tx.Sender("{}:{}".format(*rx.address)) as s:
            s.send(region)
            landed = got.result()
            for name, t in dst.state_dict(keep_vars=True).items():
                assert torch.equal(t, src.state_dict()[name]), name
                assert t.data_ptr() == region_views(landed)[name].data_ptr(), name
            assert dst.head.weight is dst.embed.weight
            # the next update lands in the live weights, in place
            with torch.no_grad():
                src.body[0].bias.add_(1.0)
            ptr = dst.body[0].bias.data_ptr()
            got = Background(rx.receive, timeout=20, into=dst)
            s.send(region)
            got.result()
            assert dst.body[0].bias.data_ptr() == ptr and torch.equal(dst.body[0].bias, src.body[0].bias)

    other = nn.Sequential(nn.Linear(16, 32))           # names and shapes that do not fit
    with tx.TensorRegion.from_module(Tiny()) as region, tx.Receiver() as rx:
        got = Background(rx.receive, timeout=20, into=other)
        with tx.Sender("{}:{}".format(*rx.address)) as s, pytest.raises(tx.ManifestError, match="does not fit"):
            s.send(region)
        with pytest.raises(tx.LayoutError, match="not in the module"):
            got.result()
        assert rx.region is None, "nothing may be allocated for an offer that does not fit"


def test_a_dtype_mismatch_says_to_cast_not_to_rename() -> None:
    """A rename map cannot fix a dtype: the message says what can (issue 38)."""
    src = nn.Linear(4, 4)
    dst = nn.Linear(4, 4).to(torch.bfloat16)
    with tx.TensorRegion.from_module(src) as region, tx.Receiver() as rx:
        got = Background(rx.receive, timeout=20, into=dst)
        with tx.Sender("{}:{}".format(*rx.address)) as s, pytest.raises(tx.ManifestError, match="does not fit"):
            s.send(region)
        with pytest.raises(tx.LayoutError) as info:
            got.result()
    assert "names=" not in str(info.value) and "model.to(dtype)" in str(info.value), info.value
    assert "weight: the module has BF16[4, 4], the offer F32[4, 4]" in str(info.value)


def test_a_rename_map_binds_a_module_with_other_names() -> None:
    src = nn.Sequential(nn.Linear(4, 4))
    dst = nn.Module()
    dst.proj = nn.Linear(4, 4)
    with tx.TensorRegion.from_module(src) as region, tx.Receiver() as rx:
        got = Background(rx.receive, timeout=20, into=dst, names={"0.weight": "proj.weight", "0.bias": "proj.bias"})
        with tx.Sender("{}:{}".format(*rx.address)) as s:
            s.send(region)
        got.result()
        assert torch.equal(dst.proj.weight, src[0].weight) and torch.equal(dst.proj.bias, src[0].bias)


@pytest.mark.slow
def test_a_tensor_mapped_to_none_is_left_out_of_the_module_and_still_lands_in_the_region() -> None:
    """GPT2LMHeadModel into GPT2Model needed a hand-made map for the tied head, and mapping to None was refused."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    torch.manual_seed(0)
    src = transformers.GPT2LMHeadModel(config).eval()
    dst = transformers.GPT2Model(config).eval()
    names = {n: None if n == "lm_head.weight" else n.removeprefix("transformer.") for n in src.state_dict()}
    with tx.TensorRegion.from_module(src) as region, tx.Receiver() as rx:
        with pytest.raises(tx.LayoutError, match=r"lm_head\.weight"):     # without the None: refused, named
            got = Background(rx.receive, timeout=20, into=dst, names={**names, "lm_head.weight": "lm_head.weight"})
            with tx.Sender("{}:{}".format(*rx.address)) as s:
                with pytest.raises(tx.OfferRefused):
                    s.send(region)
            got.result()
        got = Background(rx.receive, timeout=20, into=dst, names=names)
        with tx.Sender("{}:{}".format(*rx.address)) as s:
            s.send(region)
        got.result()
        ids = torch.tensor([[1, 2, 3, 4]])
        with torch.no_grad():
            assert torch.equal(dst(ids).last_hidden_state, src.transformer(ids).last_hidden_state)
        landed = rx.region.tensors(framework="torch")
        assert torch.equal(landed["transformer.wte.weight"], src.lm_head.weight)     # the head's bytes landed


def test_an_unsupported_dtype_is_refused_before_anything_moves() -> None:
    model = nn.Linear(2, 2)
    model.register_buffer("c", torch.zeros(2, dtype=torch.complex64))
    ptr = model.weight.data_ptr()
    with pytest.raises(TypeError, match="'c'"):
        tx.TensorRegion.from_module(model)
    assert model.weight.data_ptr() == ptr


def test_a_module_tensor_that_is_a_view_is_refused_before_anything_moves() -> None:
    """A module whose parameter is a view of a larger tensor (a flat buffer that an optimizer or a
    distributed wrapper writes) would lose it when the parameter moves into a region and is re-pointed: the
    writer stepping one, the forward reading the other, silently.  ``from_module`` and ``receive(into=)``
    refuse it, naming the tensor; nothing moves.  A view autograd saved for a backward does not count."""
    flat = torch.zeros(4 * 4 + 4)
    model = nn.Linear(4, 4)
    model.weight.data = flat[:16].view(4, 4)        # the parameter over the flat buffer
    ptr = model.weight.data_ptr()
    with pytest.raises(tx.BindingError, match="'weight' shares its memory") as caught:
        tx.TensorRegion.from_module(model)
    assert caught.value.tensor == "weight" and model.weight.data_ptr() == ptr

    held = nn.Module()          # adopted twice: a region's views own their storage (an empty one keeps a byte)
    held.w, held.none = nn.Parameter(torch.ones(3)), nn.Parameter(torch.zeros(0, 4))
    with tx.TensorRegion.from_module(held), tx.TensorRegion.from_module(held):
        assert torch.equal(held.w, torch.ones(3))

    out = nn.Linear(4, 4)(torch.ones(2, 4))     # a graph alive, holding what it saved of the weight
    trained = nn.Linear(4, 4)
    kept = trained(torch.ones(2, 4))
    with tx.TensorRegion.from_module(trained):
        assert torch.equal(trained(torch.ones(2, 4)), kept.detach())
    del out

    src, dst = nn.Linear(4, 4), nn.Linear(4, 4)
    dst.weight.data = flat[:16].view(4, 4)
    with tx.TensorRegion.from_module(src) as region, tx.Receiver() as rx:
        got = Background(rx.receive, timeout=20, into=dst)
        with tx.Sender("{}:{}".format(*rx.address)) as s, pytest.raises(tx.ManifestError, match="'weight'"):
            s.send(region)          # refused before any byte moves
        with pytest.raises(tx.BindingError, match="'weight' shares its memory"):
            got.result()
        assert dst.weight.data_ptr() == flat.data_ptr(), "left over its buffer"
        assert rx.region is None, "nothing allocated for an offer it cannot take"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_adopting_frees_as_it_goes_so_memory_peaks_near_one_model() -> None:
    n, size = 24, 16 << 20                  # 384 MiB of float32 in 24 tensors of 16 MiB
    model = nn.ParameterList([nn.Parameter(torch.full((size // 4,), float(i))) for i in range(n)])
    base = _rss()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)
    t = threading.Thread(target=sample)
    t.start()
    try:
        region = tx.TensorRegion.from_module(model)
    finally:
        stop.set()
        t.join()
    with region:
        grown = peak[0] - base
        # two models would be +384 MiB; the model plus its largest tensor (and a sampling slack) is far less
        assert grown < 0.35 * n * size, f"adopting grew RSS by {grown >> 20} MiB for a {n * size >> 20} MiB model"
        assert float(model[7].detach()[0]) == 7.0


def test_a_write_into_weights_shared_with_the_sender_stays_here_instead_of_crashing() -> None:
    """``Receiver(share=True)`` + ``receive(into=)``, then an in-place ``add_``: SIGSEGV (a read-only mapping).
    Now copy-on-write: no crash, the sender's weights untouched, a warning when bound; the pages not written
    keep following the sender's updates."""
    src = nn.Linear(1024, 1024)                 # weight 4 MiB, bias on a page of its own
    dst = nn.Linear(1024, 1024)
    with tx.TensorRegion.from_module(src) as region, tx.Receiver(share=True) as rx:
        where = "{}:{}".format(*rx.address)
        got = Background(rx.receive, timeout=20, into=dst)
        with tx.Sender(where, transport="ipc") as s, pytest.warns(tx.SharedWeightsWarning, match="copy-on-write"):
            s.send(region)
            got.result()
        before = src.weight.detach().clone()
        with torch.no_grad():
            dst.weight.add_(1.0)                # the process lives
        assert torch.equal(src.weight, before)  # and the trainer never sees it
        assert torch.equal(dst.weight, before + 1.0)
        with torch.no_grad():
            src.bias.mul_(2.0)                  # the next step, in place on the trainer's side
        got = Background(rx.receive, timeout=20, into=dst)
        with tx.Sender(where, transport="ipc") as s:
            s.send(region)
        got.result()
        assert torch.equal(dst.bias, src.bias)  # a page the receiver did not write follows the sender
