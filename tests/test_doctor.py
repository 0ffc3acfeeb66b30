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
    assert set(r) == {"rdma", "cuda", "problems"}
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
        assert not verbs["ok"] or any(p["what"] == "no RDMA devices" for p in r["problems"])
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
