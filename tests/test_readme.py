"""Every README snippet under "Using it" runs verbatim (the GPU one on the device machine)."""

from __future__ import annotations

import gc
import os
import re
from pathlib import Path

import pytest

from .conftest import tensorxfer_mappings

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks(section: str) -> list[str]:
    text = README.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end if end != -1 else len(text)], re.S)


def test_first_snippet_under_using_it_runs_verbatim():
    # it leaves the `with` block while `views` still references the region's memory:
    # that must neither raise nor free the memory under the views
    before = len(tensorxfer_mappings())
    code = python_blocks("Using it")[0]
    assert "region.tensors()" in code and "with tx.TensorRegion.from_tensors(weights) as region" in code
    ns: dict = {}
    exec(compile(code, str(README), "exec"), ns)
    region, views, weights = ns["region"], ns["views"], ns["weights"]
    assert region.closed and not region.region.released
    assert all((views[k] == weights[k]).all() for k in weights)      # update_from(weights) landed in the views
    assert ns["layout"].names == ("embed", "norm")
    del region, views, weights
    ns.clear()
    gc.collect()
    assert len(tensorxfer_mappings()) == before


def test_staging_and_handles_snippet_runs_verbatim():
    before = len(tensorxfer_mappings())
    code = python_blocks("Using it")[1]
    assert "read_pieces" in code and "export_handles" in code
    ns: dict = {}
    exec(compile(code, str(README), "exec"), ns)
    assert ns["src"].closed and ns["dst"].closed
    ns.clear()
    gc.collect()
    assert len(tensorxfer_mappings()) == before


def test_sending_snippet_runs_verbatim(capsys):
    """The Sender/Receiver block, with `weights` from the first block (as a reader runs them in order)."""
    import numpy as np

    blocks = python_blocks("Using it")
    code = next(b for b in blocks if "tx.Sender(" in b)
    ns: dict = {"weights": {"embed": np.random.rand(1000, 64).astype(np.float32), "norm": np.ones(64, np.float32)}}
    exec(compile(code, str(README), "exec"), ns)
    assert ns["stats"].update == 2 and not ns["stats"].setup and ns["rx"].closed
    out = capsys.readouterr().out
    assert out.count("dict_keys(['embed', 'norm'])") == 2
    ns.clear()
    gc.collect()


def test_live_weights_snippet_runs_verbatim():
    """The "Weights that live in the region" block: a trainer's adopted module pushed into a server's module."""
    torch = pytest.importorskip("torch", reason="the live-weights snippet needs PyTorch")
    code = next(b for b in python_blocks("Using it") if "from_module" in b)
    ns: dict = {}
    exec(compile(code, str(README), "exec"), ns)
    region, server = ns["region"], ns["server"]
    views = region.tensors(framework="torch")
    assert all(t.data_ptr() == views[n].data_ptr() for n, t in ns["trainer"].state_dict(keep_vars=True).items())
    assert torch.equal(server(ns["x"]), ns["trainer"](ns["x"])) and ns["rx"].closed
    region.close()
    ns.clear()
    gc.collect()


@pytest.mark.cuda
def test_gpu_snippet_runs_verbatim():
    """The "On the GPU" block with a small torch model on cuda:0 (skips without a GPU)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the device machine)")
    code = next(b for b in python_blocks("Using it") if 'device="cuda:0"' in b)
    ns: dict = {"model": torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 8)).cuda()}
    exec(compile(code, str(README), "exec"), ns)
    assert set(ns["views"]) == {n for n, _ in ns["model"].named_parameters()}
    assert ns["ext"].length >= ns["region"].nbytes
    os.close(ns["fd"])
    ns["region"].close()
