"""``--device cuda:N`` for tensorxfer-send / tensorxfer-recv and the GPU paths of tensorxfer.files.

Marked ``cuda``: these run on the device machine (an H200); elsewhere they
skip with the reason.  ``tests/test_cli.py::test_gpu_device_without_a_gpu_fails_cleanly_at_start``
covers machines without a GPU.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.helpers import GPU_REASON, finish
from tests.test_cli import cli, model_dir, sha, start_recv

safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="cross-check needs the safetensors package")

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(GPU_REASON is not None, reason=f"needs a CUDA GPU: {GPU_REASON}")]


@pytest.mark.parametrize("transport", ["auto", "tcp"])     # auto: ipc on one host (CUDA handles); tcp: staged
def test_send_recv_model_dir_on_the_gpu_byte_identical(tmp_path, transport):
    src = model_dir(tmp_path / "src", shards=3, rows=20_000)        # ~15 MB of tensors over 3 files
    (src / "config.json").write_text('{"model_type": "test"}\n')
    out = tmp_path / "out"
    recv, where = start_recv(out, "--once", "--device", "cuda:0")
    rc_s, out_s, err_s = finish(cli("send", str(src), "--to", where, "--device", "cuda:0", "--verify", "--json",
                                    "--transport", transport), timeout=120)
    rc_r, out_r, err_r = finish(recv, timeout=120)
    print(out_s, out_r)                   # the lead commits this output from the H200 run
    assert rc_s == 0, err_s
    assert rc_r == 0, err_r
    sent = json.loads(out_s)
    assert sent["verified"] and (transport == "auto" or sent["transport"] == transport)
    assert sorted(os.listdir(out)) == sorted(os.listdir(src))
    for p in src.iterdir():
        assert sha(p) == sha(out / p.name), p.name


def test_files_gpu_roundtrip_through_small_staging_buffers(tmp_path, monkeypatch):
    from tensorxfer import TensorRegion
    from tensorxfer.files import load, write, write_files

    monkeypatch.setattr(load, "STAGE_BYTES", 1 << 20)    # tensors span several staging pieces, files share a stager
    monkeypatch.setattr(write, "STAGE_BYTES", 1 << 20)
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(3)
    for f in range(2):
        t = {f"f{f}.big": rng.standard_normal(900_001).astype(np.float32),     # 3.6 MB: 4 pieces
             f"f{f}.odd": rng.integers(0, 255, 12_345, dtype=np.uint8),
             f"f{f}.empty": np.zeros((0, 3), np.float16)}
        safetensors_numpy.save_file(t, str(src / f"m{f}.safetensors"))
    with TensorRegion.from_safetensors([src], device="cuda:0") as region:
        assert region.is_cuda
        write_files(region, tmp_path / "out")      # files -> GPU -> files: every byte went through the device
    for p in src.iterdir():
        assert sha(p) == sha(tmp_path / "out" / p.name), p.name
