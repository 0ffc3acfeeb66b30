"""tensorxfer-send / tensorxfer-recv (separate processes) over tcp through a relay process that cuts the
data connections for real: the update resumes within the transfer and the files come out byte-identical."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

from tests.helpers import finish
from tests.test_cli import cli, sha, start_recv
from tests.test_resume import start_relay, stop_relay

safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="needs the safetensors package")


def random_model_dir(d, shards: int, shard_bytes: int, seed: int = 0):
    """A sharded model directory of incompressible tensors (several per shard) and its index."""
    d.mkdir()
    rng = np.random.default_rng(seed)
    weight_map = {}
    for s in range(shards):
        t = {f"layers.{s}.{i}.weight": rng.integers(0, 256, shard_bytes // 4, dtype=np.uint8) for i in range(4)}
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        safetensors_numpy.save_file(t, str(d / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(t, name))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


# 1 GiB by default; TENSORXFER_RESUME_SHARD_MB=512 makes it the 2 GiB (benchmarks/results/2026-12-06-resume)
SHARD_BYTES = int(os.environ.get("TENSORXFER_RESUME_SHARD_MB", "256")) << 20


@pytest.mark.slow
def test_model_dir_cut_three_times_completes_byte_identical(tmp_path):
    src = random_model_dir(tmp_path / "src", shards=4, shard_bytes=SHARD_BYTES)
    payload = 4 * SHARD_BYTES
    out = tmp_path / "out"
    recv, where = start_recv(out, "--once", "--stall-timeout", "10")
    cuts = sorted(random.Random(7).sample(range(payload // 20, payload * 19 // 20), 3))
    host, port = where.rsplit(":", 1)
    relay, via = start_relay((host, int(port)), cuts)
    send = cli("send", str(src), "--to", via, "--transport", "tcp", "--verify", "--json", "--stall-timeout", "10")
    rc_s, out_s, err_s = finish(send, timeout=180)
    rc_r, out_r, err_r = finish(recv, timeout=60)
    wire = stop_relay(relay)
    print(json.dumps({"payload": payload, "wire": wire, "sender": out_s.splitlines()[-1:]}))
    assert rc_s == 0, err_s
    assert rc_r == 0, err_r
    sent = json.loads(out_s.splitlines()[-1])
    got = json.loads(out_r.splitlines()[-1])
    assert wire["cuts"] == cuts, wire
    assert sent["retries"] >= 1 and got["retries"] == sent["retries"], (sent, got)
    # Every byte the sender handed to its kernel, cuts and resumes included (the bytes in the sockets' and the
    # relay's buffers when a cut came were lost: a few MB per cut), against the payload; the relay's own count
    # of what it carried sees fewer of them (what sat in its receive buffer never left it).
    assert sent["bytes"] + sent["resent_bytes"] <= 1.15 * sent["bytes"], sent
    assert sent["bytes"] <= wire["data_bytes"] <= sent["bytes"] + sent["resent_bytes"] + 64 * 1024, (wire, sent)
    for p in src.iterdir():
        assert sha(p) == sha(out / p.name), p.name
    assert not [p for p in out.iterdir() if p.name.startswith(".tensorxfer")]
