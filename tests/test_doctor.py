"""``tensorxfer doctor``: runs everywhere; inside the Soft-RoCE VM it must see rxe0 and register an MR."""

from __future__ import annotations

import json

import pytest

from tensorxfer.cli.main import main
from tensorxfer.transport.rdma import rdma_available


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["doctor", "--json", *args]) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_doctor_reports_and_explains(capsys: pytest.CaptureFixture[str]) -> None:
    r = run_json(capsys)
    assert set(r) == {"rdma", "cuda", "problems", "transports"}
    lines = {t["name"]: t for t in r["transports"]}
    assert set(lines) == {"tcp", "ipc", "rdma", "cuda"} and lines["tcp"]["usable"]
    for t in lines.values():
        assert t["usable"] == (t["fix"] is None) and t["detail"]
    verbs = r["rdma"]["verbs_module"]
    if not verbs["ok"]:     # built without libibverbs-dev or with TENSORXFER_NO_VERBS=1: say so plainly
        assert "No module named 'tensorxfer.transport._verbs'" in verbs["error"], verbs
        assert any("_verbs" in p["what"] for p in r["problems"])
    assert r["cuda"]["module"] in (True, False)
    for p in r["problems"]:
        assert p["what"] and p["means"] and p["fix"]
    if not r["cuda"]["module"]:
        assert any("_cuda" in p["what"] for p in r["problems"])
    ok, _ = rdma_available()
    if not ok:
        assert r["rdma"]["devices"] == []
        no_library = not r["rdma"].get("library", {}).get("ok", True)    # a wheel without rdma-core here
        assert not verbs["ok"] or any(p["what"] == ("libibverbs.so.1 cannot be loaded (rdma-core is not installed)"
                                                    if no_library else "no RDMA devices") for p in r["problems"])
    main(["doctor"])
    text = capsys.readouterr().out
    assert "RDMA" in text and "CUDA" in text


@pytest.mark.rdma
def test_doctor_sees_the_device(capsys: pytest.CaptureFixture[str]) -> None:
    ok, why = rdma_available()
    if not ok:
        pytest.skip(f"no usable RDMA device: {why}")
    r = run_json(capsys)
    dev = r["rdma"]["devices"][0]
    port = dev["ports"][0]
    assert port["active"] and port["link_layer"] in ("Ethernet", "InfiniBand")
    assert port["gids"], "an active port has at least one GID"
    if port["link_layer"] == "Ethernet":
        assert any(g["type"].startswith("RoCE v2") for g in port["gids"])
    assert r["rdma"]["mr"] == {"ok": True, "handles": 3, "length": 3 << 20}
    assert r["rdma"]["dmabuf_mr"]["ok"] in (True, False, None)


def test_doctor_without_rdma_core_says_install_it() -> None:
    """A machine without rdma-core (libibverbs.so.1 made unloadable): the verbs module still imports (it
    does not link libibverbs), tcp and ipc are usable, rdma is not, with the line that installs it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TENSORXFER_LIBIBVERBS": "/nonexistent/libibverbs.so.1"}
    out = subprocess.run([sys.executable, "-m", "tensorxfer.cli.main", "doctor", "--json"], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    r = json.loads(out)
    if not r["rdma"]["verbs_module"]["ok"]:
        pytest.skip("this build has no verbs module")
    lines = {t["name"]: t for t in r["transports"]}
    assert lines["tcp"]["usable"] and lines["ipc"]["usable"] and not lines["rdma"]["usable"]
    assert "apt-get install libibverbs1" in lines["rdma"]["fix"]
    assert "cannot open shared object file" in lines["rdma"]["detail"]
    assert r["rdma"]["library"]["ok"] is False
    assert any("libibverbs.so.1 cannot be loaded" in p["what"] for p in r["problems"])
    assert not any(p["what"] == "no RDMA devices" for p in r["problems"])   # not the fix for this machine
    text = subprocess.run([sys.executable, "-m", "tensorxfer.cli.main", "doctor"], env=env, capture_output=True,
                          text=True, timeout=120, check=True).stdout
    assert "rdma  NO" in text and "fix: install rdma-core's verbs library" in text
