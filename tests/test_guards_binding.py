"""Guards of module bindings that no other test could see fail (issue 37): a bound tensor set to None or
removed from its module is not current (on a sender: BindingError before anything is read; on a receiver:
a clear refusal, not a crash), and receive(into=module) refuses an offer of another dtype with the same
shape before any byte lands."""

from __future__ import annotations

import numpy as np
import pytest

import tensorxfer as tx
from tests.helpers import Background

torch = pytest.importorskip("torch", reason="live weights need PyTorch")
nn = torch.nn


def _gone(model: nn.Module, how: str) -> str:
    """Take ``model``'s ``1.bias`` away as ``how`` says; its state_dict name."""
    if how == "set_to_none":
        model[1].bias = None
    else:
        del model[1].bias
    return "1.bias"


@pytest.mark.parametrize("how", ["set_to_none", "removed"])
def test_a_bound_tensor_set_to_none_or_removed_is_not_current_and_nothing_is_sent(how: str) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    with tx.TensorRegion.from_module(model) as region, tx.Receiver() as rx, \
            tx.TensorRegion.from_tensors({"x": np.arange(4, dtype=np.float32)}) as other:
        region.ensure_current()                                  # bound, nothing replaced
        culprit = _gone(model, how)
        with pytest.raises(tx.BindingError, match="no longer lives in the region") as err:
            region.ensure_current()
        assert err.value.tensor == culprit
        got = Background(rx.receive, timeout=20)
        with tx.Sender("{}:{}".format(*rx.address)) as s:
            with pytest.raises(tx.BindingError, match=r"1\.bias"):
                s.send(region)
            s.send(other)                       # what the receiver gets is the next region, not the stale one
        assert list(got.result().tensors()) == ["x"]


def _second_receive_error(how: str) -> BaseException | None:
    """Receive into a module, take one of its bound tensors away, receive again: the second receive's error
    (its traceback dropped, so nothing it held outlives this call) or None."""
    src, dst = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    with tx.TensorRegion.from_module(src) as region, tx.Receiver() as rx:
        got = Background(rx.receive, timeout=20, into=dst)
        with tx.Sender("{}:{}".format(*rx.address)) as s:
            s.send(region)
            got.result()
            assert torch.equal(dst[1].weight, src[1].weight)
            _gone(dst, how)
            got = Background(rx.receive, timeout=20, into=dst)
            try:
                s.send(region)
            except tx.TensorXferError:
                pass                            # refused or cut off: what the receiver says is the point
            got.thread.join(20)
            assert not got.thread.is_alive(), "the receiver hung"
    error, got.error = got.error, None
    if error is not None:
        error.__traceback__ = error.__context__ = error.__cause__ = None
    return error


@pytest.mark.parametrize("how", ["set_to_none", "removed"])
def test_receive_into_a_module_that_lost_a_bound_tensor_refuses_it_by_name(how: str) -> None:
    error = _second_receive_error(how)
    if error is None:
        pytest.fail("the update was received into a module whose 1.bias is gone, as if it were bound")
    if not isinstance(error, (tx.LayoutError, tx.BindingError)):
        raise error
    assert "1.bias" in str(error), error


@pytest.mark.parametrize("theirs, mine, name", [(torch.float32, torch.float64, "F64"),
                                                 (torch.bfloat16, torch.float16, "F16")])   # the same itemsize
def test_receive_into_a_module_of_another_dtype_is_refused_before_any_byte_lands(theirs, mine, name) -> None:
    src = nn.Sequential(nn.Linear(4, 4)).to(theirs)
    dst = nn.Sequential(nn.Linear(4, 4)).to(mine)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with tx.TensorRegion.from_module(src) as region, tx.Receiver() as rx:
        got = Background(rx.receive, timeout=20, into=dst)
        with tx.Sender("{}:{}".format(*rx.address)) as s, pytest.raises(tx.ManifestError, match="does not fit"):
            s.send(region)
        with pytest.raises(tx.LayoutError, match=rf"0\.weight: the module has {name}\[4, 4\], the offer "):
            got.result()
        assert rx.region is None, "nothing may be allocated for an offer that does not fit"
    for k, v in dst.state_dict().items():
        assert v.dtype == mine and torch.equal(v, before[k]), k
