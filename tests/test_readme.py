"""Every README snippet under "Using it" runs verbatim and on its own (the GPU one on the device machine)."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import tensorxfer_mappings
from .helpers import GPU_REASON, ROOT

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


def test_sending_snippet_runs_verbatim_on_its_own(capsys):
    code = next(b for b in python_blocks("Using it") if "tx.Sender(" in b)
    ns: dict = {}
    exec(compile(code, str(README), "exec"), ns)
    assert ns["stats"].update == 2 and not ns["stats"].setup and ns["rx"].closed and not ns["t"].is_alive()
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


def test_fanout_snippet_runs_verbatim_on_its_own(capsys):
    code = next(b for b in python_blocks("Using it") if "tx.FanoutSender(" in b)
    ns: dict = {}
    exec(compile(code, str(README), "exec"), ns)
    assert [r.ok for r in ns["stats"].receivers] == [True, True, True]
    assert all(rx.closed for rx in ns["receivers"])
    assert capsys.readouterr().out.count(" ok\n") == 3
    ns.clear()
    gc.collect()


@pytest.mark.parametrize("index", range(len(python_blocks("Using it"))))
def test_every_snippet_runs_on_its_own_in_a_fresh_process(index):
    """As a reader pastes it: nothing defined before, and the process ends when the snippet does."""
    code = python_blocks("Using it")[index]
    if "cuda:0" in code and GPU_REASON is not None:
        pytest.skip(f"needs a CUDA GPU: {GPU_REASON}")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_a_mistake_in_the_sending_snippet_fails_at_once():
    """A wrong token (or any error) in the sending snippet used to leave a receiver thread waiting 60 s in
    receive() and keeping the process alive; now the process ends with the error."""
    code = next(b for b in python_blocks("Using it") if "tx.Sender(" in b)
    assert code.count('token="s3cret") as sender') == 1
    code = code.replace('token="s3cret") as sender', 'token="wrong") as sender')
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    assert r.returncode != 0 and "AuthError" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 20, "the process outlived the mistake"


@pytest.mark.cuda
def test_gpu_snippet_runs_verbatim():
    """The "On the GPU" block, with its own small torch model on cuda:0 (skips without a GPU)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the device machine)")
    code = next(b for b in python_blocks("Using it") if 'device="cuda:0"' in b)
    ns: dict = {}
    exec(compile(code, str(README), "exec"), ns)
    assert set(ns["views"]) == {n for n, _ in ns["model"].named_parameters()}
    assert ns["ext"].length >= ns["region"].nbytes
    os.close(ns["fd"])
    ns["region"].close()
