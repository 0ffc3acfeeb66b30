"""Acceptance: an FSDP2 trainer on 4 processes (gloo) pushes to 2 TP inference processes every step.

After each of 3 AdamW steps, the two targets' tensors (fused qkv and gate_up, row-parallel o_proj and
down_proj, vocab-parallel embedding and head) put back together give the trainer's logits exactly; every
target tensor is still its view of the target's region (the bytes landed in the live weights).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, finish

torch = pytest.importorskip("torch", reason="FSDP2 needs PyTorch")
pytest.importorskip("transformers", reason="the trainer is a Hugging Face Llama (pip install 'tensorxfer[test]')")
fsdp = pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (fully_shard) needs torch >= 2.6")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)", allow_module_level=True)

from tensorxfer.sync.rendezvous import open_tcp_store  # noqa: E402
from tests import sync_peers  # noqa: E402


def spawn(role: str, rank: int, port: int, out: str, transport: str, device: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.sync_peers", role, str(rank), str(port), out, transport,
                             device],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))


def reassemble(parts: list[dict[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The global weights from both targets' tensors, each piece put back where the TP layout took it from."""
    full = {n: torch.full(s, float("nan")) for n, s in shapes.items()}
    for rank, got in enumerate(parts):
        for name, target in sync_peers.tp_layout(shapes, rank).items():
            for piece in target.pieces:
                box = piece.source_box
                src = got[name][tuple(slice(a, a + k) for a, k in zip(piece.at, box.sizes))]
                full[piece.source_name][tuple(slice(o, o + k) for o, k in zip(box.offsets, box.sizes))] = src
    assert not any(torch.isnan(t).any() for t in full.values()), "a global weight byte was never received"
    return full


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
@pytest.mark.slow
def test_fsdp2_trainer_to_tp_inference_logits_equal_after_each_step(tmp_path, transport: str) -> None:
    fsdp2_to_tp(tmp_path, transport, "cpu")


@pytest.mark.cuda
def test_fsdp2_trainer_to_tp_inference_on_one_gpu_over_ipc(tmp_path) -> None:
    """The six processes' regions on the one GPU: 4 source processes (training on the host, packing into
    their GPU regions) to 2 target processes whose weights are on the GPU, over ipc (the targets' device
    copies out of the sources' memory)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    fsdp2_to_tp(tmp_path, "ipc", "cuda:0")


def fsdp2_to_tp(tmp_path, transport: str, device: str) -> None:
    store = open_tcp_store("127.0.0.1", 0, True)
    out = str(tmp_path)
    procs = [spawn("target", t, store.port, out, transport, device) for t in range(2)] + \
        [spawn("trainer", r, store.port, out, transport, device) for r in range(4)]
    try:
        results = [finish(p, timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    for t in range(2):
        reports = [json.loads(line) for line in results[t][1].splitlines()]
        assert [r["version"] for r in reports] == [1, 2, 3]
        assert all(r["live"] and r["transport"] == transport and r["device"] == device for r in reports), reports
    model = sync_peers.build()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        previous = None
        for step in range(1, 4):
            trained = torch.load(tmp_path / f"trainer-{step}.pt")
            parts = [torch.load(tmp_path / f"target{t}-{step}.pt") for t in range(2)]
            weights = reassemble(parts, shapes)
            for name, w in trained["weights"].items():
                assert torch.equal(weights[name], w), f"step {step}: {name} differs from the trainer's"
            model.load_state_dict(weights)
            model.eval()
            with torch.no_grad():
                logits = model(torch.tensor(sync_peers.INPUT)).logits
            assert torch.equal(logits, trained["logits"]), f"step {step}: the targets' logits differ from the trainer's"
            assert previous is None or not torch.equal(logits, previous), "the weights did not change"
            previous = logits
    finally:
        torch.set_num_threads(threads)
