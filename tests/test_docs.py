"""Every ```python block of the README and of docs/*.md runs, as written.

Each block runs on its own in a fresh process, as a reader pastes it (the README tour's server and trainer
as two processes); the blocks that used to be the README's "Using it" also run in this process, with
assertions about what they leave behind.  A block is found by its page and the heading it sits under, so
moving text around a page does not move a test.
"""

from __future__ import annotations

import gc
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import tensorxfer_mappings
from .helpers import GPU_REASON, ROOT, server_and_trainer

DOCS = Path(ROOT) / "docs"
README = Path(ROOT) / "README.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

_HEADING = re.compile(r"^(#{1,6}) (.*)$")
_FENCE = re.compile(r"^```(\w*)\s*$")


def _blocks(page: Path) -> list[tuple[list[str], str]]:
    """``(headings above it, code)`` for every ```python block of ``page``; a ``#`` line inside a fenced block
    (a comment) is not a heading."""
    found: list[tuple[list[str], str]] = []
    headings: list[str] = []
    fence: str | None = None
    code: list[str] = []
    for line in page.read_text().splitlines():
        m = _FENCE.match(line)
        if fence is None:
            h = _HEADING.match(line)
            if h:
                headings = [*headings[:len(h.group(1)) - 1], h.group(2)]
            elif m:
                fence, code = m.group(1), []
        elif m and not m.group(1):
            if fence == "python":
                found.append((list(headings), "\n".join(code) + "\n"))
            fence = None
        else:
            code.append(line)
    assert fence is None, f"{page.name}: a code block is not closed"
    return found


def python_blocks(page: str | Path, heading: str | None = None) -> list[str]:
    """The ```python blocks of ``page`` (``README.md`` or a name under docs/), or only those under ``heading``
    (at any level, its subsections included)."""
    path = page if isinstance(page, Path) else (README if page == "README.md" else DOCS / page)
    blocks = [code for heads, code in _blocks(path) if heading is None or heading in heads]
    assert blocks, f"no ```python block in {path.name}" + (f" under {heading!r}" if heading else "")
    return blocks


def block(page: str, heading: str, contains: str) -> str:
    """The one block under ``heading`` of ``page`` that contains ``contains``."""
    found = [b for b in python_blocks(page, heading) if contains in b]
    assert len(found) == 1, f"{page} / {heading}: {len(found)} blocks contain {contains!r}"
    return found[0]


def run_block(code: str, page: str, ns: dict | None = None) -> dict:
    ns = {} if ns is None else ns
    exec(compile(code, str(DOCS / page), "exec"), ns)
    return ns


# Blocks run otherwise than alone in a fresh process, each with why.
TOUR = "One trainer, one server, two processes"      # README: a server and a trainer, run as two processes
SKETCHES = {
    # the endpoint API needs an RDMA device and a session's control channel: tests/test_rdma.py drives it
    ("rdma.md", "Endpoint API (what the session layer plugs in)"): "RdmaReceiverEndpoint(region",
}


def _alone() -> list:
    params = []
    for page in PAGES:
        for i, (heads, code) in enumerate(_blocks(page)):
            if page == README and TOUR in heads:
                continue
            if any(page.name == p and h in heads and text in code for (p, h), text in SKETCHES.items()):
                continue
            marks = [pytest.mark.slow]
            if "cuda:0" in code:
                marks.append(pytest.mark.cuda)
            params.append(pytest.param(page, code, id=f"{page.name}-{i}-{(heads or [''])[-1][:30]}", marks=marks))
    return params


ALONE = _alone()


def test_every_block_is_run_and_every_exception_still_holds():
    """No block goes untested: each runs alone in a fresh process, except the README tour's pair (run as two
    processes below) and the sketches named in SKETCHES, which must still exist."""
    total = sum(len(_blocks(p)) for p in PAGES)
    tour = python_blocks("README.md", TOUR)
    assert len(tour) == 2
    for (page, heading), text in SKETCHES.items():
        block(page, heading, text)
    assert len(ALONE) == total - len(tour) - len(SKETCHES)
    # the pages the README's topics moved to each carry runnable examples
    for page in ("regions.md", "gpu.md", "sending.md", "live-weights.md", "sync.md", "fp8.md", "elastic.md",
                 "ipc.md", "fanout.md", "doctor.md"):
        assert python_blocks(page), page


def test_readme_links_to_every_docs_page():
    text = README.read_text()
    for page in DOCS.glob("*.md"):
        assert f"(docs/{page.name})" in text, f"README's 'Where to go next' does not link docs/{page.name}"
    for target in re.findall(r"\]\((?!https?:)([^)#]+)", text):
        assert (Path(ROOT) / target).exists(), target
    for page in DOCS.glob("*.md"):
        for target in re.findall(r"\]\((?!https?:)([^)#]+)", page.read_text()):
            assert (DOCS / target).exists(), f"{page.name} links {target}, which does not exist"


def test_readme_stays_short():
    assert len(README.read_text().splitlines()) < 200


def test_first_region_snippet_runs_verbatim():
    # it leaves the `with` block while `views` still references the region's memory:
    # that must neither raise nor free the memory under the views
    before = len(tensorxfer_mappings())
    code = python_blocks("regions.md", "Packing tensors into a region")[0]
    assert "region.tensors()" in code and "with tx.TensorRegion.from_tensors(weights) as region" in code
    ns = run_block(code, "regions.md")
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
    code = block("regions.md", "Region bytes and handles, the same on host and GPU", "read_pieces")
    assert "export_handles" in code
    ns = run_block(code, "regions.md")
    assert ns["src"].closed and ns["dst"].closed
    ns.clear()
    gc.collect()
    assert len(tensorxfer_mappings()) == before


def test_sending_snippet_runs_verbatim_on_its_own(capsys):
    ns = run_block(block("sending.md", "Sender and Receiver", "tx.Sender("), "sending.md")
    assert ns["stats"].update == 2 and not ns["stats"].setup and ns["rx"].closed and not ns["t"].is_alive()
    out = capsys.readouterr().out
    assert out.count("dict_keys(['embed', 'norm'])") == 2
    ns.clear()
    gc.collect()


@pytest.mark.slow
def test_live_weights_snippet_runs_verbatim():
    """The one-process live-weights block: a trainer's adopted module pushed into a server's module."""
    torch = pytest.importorskip("torch", reason="the live-weights snippet needs PyTorch")
    ns = run_block(block("live-weights.md", "In one process", "from_module"), "live-weights.md")
    region, server = ns["region"], ns["server"]
    views = region.tensors(framework="torch")
    assert all(t.data_ptr() == views[n].data_ptr() for n, t in ns["trainer"].state_dict(keep_vars=True).items())
    assert torch.equal(server(ns["x"]), ns["trainer"](ns["x"])) and ns["rx"].closed
    region.close()
    ns.clear()
    gc.collect()


def test_fanout_snippet_runs_verbatim_on_its_own(capsys):
    ns = run_block(block("fanout.md", "Three receivers", "tx.FanoutSender("), "fanout.md")
    assert [r.ok for r in ns["stats"].receivers] == [True, True, True]
    assert all(rx.closed for rx in ns["receivers"])
    assert capsys.readouterr().out.count(" ok\n") == 3
    ns.clear()
    gc.collect()


def test_ipc_share_snippet_runs_verbatim():
    before = len(tensorxfer_mappings())
    ns = run_block(block("ipc.md", "Sharing the trainer's memory", "share=True"), "ipc.md")
    assert ns["stats"].transport == "ipc" and ns["rx"].closed and ns["region"].closed
    ns.clear()
    gc.collect()
    assert len(tensorxfer_mappings()) == before


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=ROOT)


@pytest.mark.parametrize(("page", "code"), ALONE)
def test_every_block_runs_on_its_own_in_a_fresh_process(page, code):
    """As a reader pastes it: nothing defined before, and the process ends when the block does."""
    if "cuda:0" in code and GPU_REASON is not None:
        pytest.skip(f"needs a CUDA GPU: {GPU_REASON}")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env(),
                       cwd=ROOT)
    assert r.returncode == 0, f"{page.name}: {r.stderr}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_readme_tour_server_and_trainer_run_as_two_processes():
    """The tour's two blocks, as two processes: the server holds updates 1, 2, 3 (only the port changes, to a
    free one)."""
    pytest.importorskip("torch", reason="the tour's example needs PyTorch")
    server_code, trainer_code = python_blocks("README.md", TOUR)
    assert "tx.Receiver(" in server_code and "tx.Sender(" in trainer_code
    address = f"127.0.0.1:{_free_port()}"
    trainer, server = server_and_trainer(["-c", server_code.replace("127.0.0.1:7700", address)],
                                         ["-c", trainer_code.replace("127.0.0.1:7700", address)])
    assert trainer.returncode == 0, trainer.stderr
    assert server.returncode == 0, server.stderr
    out = server.stdout
    assert out.splitlines() == [f"server: holds update {n} over ipc" for n in (1, 2, 3)], out
    assert trainer.stdout.count(" bytes over ipc") == 3, trainer.stdout


@pytest.mark.slow
def test_a_mistake_in_the_sending_snippet_fails_at_once():
    """A wrong token (or any error) in the sending snippet used to leave a receiver thread waiting 60 s in
    receive() and keeping the process alive; now the process ends with the error."""
    code = block("sending.md", "Sender and Receiver", "tx.Sender(")
    assert code.count('token="s3cret") as sender') == 1
    code = code.replace('token="s3cret") as sender', 'token="wrong") as sender')
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env(),
                       cwd=ROOT)
    assert r.returncode != 0 and "AuthError" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 20, "the process outlived the mistake"


@pytest.mark.cuda
def test_gpu_snippet_runs_verbatim():
    """The GPU page's block, with its own small torch model on cuda:0 (skips without a GPU)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the device machine)")
    ns = run_block(block("gpu.md", "A module's parameters in one GPU region", 'device="cuda:0"'), "gpu.md")
    assert set(ns["views"]) == {n for n, _ in ns["model"].named_parameters()}
    assert ns["ext"].length >= ns["region"].nbytes
    os.close(ns["fd"])
    ns["region"].close()
