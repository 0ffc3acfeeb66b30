"""Acceptance: an fp32 FSDP2 trainer on 3 processes (gloo, uneven shards) feeds 2 TP inference processes that
serve FP8 (128 x 128 blocks with ``weight_scale_inv``; embeddings, head and norms in bf16).

After each of 3 AdamW steps: every FP8 byte and every scale the targets hold equals the reference
quantization of the trainer's full weights (transformers' formula, itself checked byte for byte against
transformers in test_quant), the bf16 tensors equal the trainer's weights cast, and a forward that
dequantizes the targets' weights gives the same logits as the same forward over the reference-quantized
weights.  The sources quantized on the way: the targets received FP8, not bf16.
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

from tensorxfer.quant.quantize import block_amax, quantize_into  # noqa: E402
from tensorxfer.sync.rendezvous import open_tcp_store  # noqa: E402
from tests import fp8_peers  # noqa: E402


def spawn(role: str, rank: int, port: int, out: str, transport: str, device: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.fp8_peers", role, str(rank), str(port), out, transport,
                             device],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))


def quantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grid = fp8_peers.Q.grid(tuple(w.shape))
    values = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty(grid.scale_shape)
    quantize_into(w, grid, (0, 0), fp8_peers.Q, block_amax(w, grid, (0, 0)), values, scales)
    return values, scales


def dequantized(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows, cols = values.shape
    return values.float() * scales.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]


def reassemble(parts: list[dict[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The global tensors from both targets: FP8 values (as bytes), their scales, and the bf16 tensors, each
    piece put back where the TP layout took it from."""
    full: dict[str, torch.Tensor] = {}
    for rank, got in enumerate(parts):
        for name, target in fp8_peers.tp_layout(shapes, rank).items():
            for piece in target.pieces:
                box, shape = piece.source_box, shapes[piece.source_name]
                src = got[name][tuple(slice(a, a + k) for a, k in zip(piece.at, box.sizes))]
                dst = full.setdefault(piece.source_name, torch.zeros(shape, dtype=src.dtype))
                dst[tuple(slice(o, o + k) for o, k in zip(box.offsets, box.sizes))] = src
                if target.quantization is None:
                    continue
                grid = target.quantization.grid(shape)
                first, count = grid.cells(box.offsets, box.sizes)
                at = tuple(a // 128 for a in piece.at)
                scale = got[f"{name}_scale_inv"][tuple(slice(a, a + c) for a, c in zip(at, count))]
                dst = full.setdefault(f"{piece.source_name}_scale_inv", torch.full(grid.scale_shape, float("nan")))
                dst[tuple(slice(f, f + c) for f, c in zip(first, count))] = scale
    return full


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
@pytest.mark.slow
def test_fp32_fsdp2_trainer_to_fp8_tp_inference_bytes_scales_and_logits_after_each_step(tmp_path,
                                                                                      transport: str) -> None:
    fsdp2_to_fp8(tmp_path, transport, "cpu")


@pytest.mark.cuda
def test_fp32_fsdp2_trainer_to_fp8_tp_inference_on_one_gpu_over_ipc(tmp_path) -> None:
    """The five processes' regions on the one GPU: the trainers (FSDP2 on a host mesh) quantize their host
    shards into their GPU regions; the targets' FP8 weights are on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    fsdp2_to_fp8(tmp_path, "ipc", "cuda:0")


def fsdp2_to_fp8(tmp_path, transport: str, device: str) -> None:
    store = open_tcp_store("127.0.0.1", 0, True)
    out = str(tmp_path)
    procs = [spawn("target", t, store.port, out, transport, device) for t in range(fp8_peers.TARGETS)] + \
        [spawn("trainer", r, store.port, out, transport, device) for r in range(fp8_peers.SOURCES)]
    try:
        results = [finish(p, timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    targets = fp8_peers.TARGETS
    for t in range(targets):
        reports = [json.loads(line) for line in results[t][1].splitlines()]
        assert [r["version"] for r in reports] == [1, 2, 3]
        assert all(r["live"] and r["transport"] == transport for r in reports), reports
    pushes = [json.loads(line) for _, out_, _ in results[targets:] for line in out_.splitlines()]
    # the block rows the uneven shards cut were agreed between neighbours, and FP8 went on the wire
    assert all(p["quantized"]["shared_blocks"] > 0 and p["quantized"]["peers"] >= 1 for p in pushes), pushes
    model = fp8_peers.build()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    fp8_names = {n for n in shapes if n.endswith("proj.weight")}
    # FP8 went on the wire: every byte the targets hold (FP8 values, scales, bf16 tensors) sent once, no more
    layouts = [fp8_peers.tp_layout(shapes, t) for t in range(targets)]
    held = sum(t.tensor.numel() * t.tensor.element_size() + (t.scales.numel() * 4 if t.scales is not None else 0)
               for layout in layouts for t in layout.values())
    for step in (1, 2, 3):
        assert sum(p["bytes"] for p in pushes if p["step"] == step) == held
    assert held < 0.56 * sum(t.tensor.numel() * 2 for layout in layouts for t in layout.values())   # bf16's
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        previous = None
        for step in range(1, fp8_peers.STEPS + 1):
            trained = torch.load(tmp_path / f"trainer-{step}.pt")["weights"]
            got = reassemble([torch.load(tmp_path / f"target{t}-{step}.pt") for t in range(targets)], shapes)
            served, reference = {}, {}
            for name, w in trained.items():
                if name in fp8_names:
                    values, scales = quantized(w)
                    assert torch.equal(got[name].view(torch.uint8), values.view(torch.uint8)), (step, name)
                    assert torch.equal(got[f"{name}_scale_inv"], scales), (step, name)
                    served[name] = dequantized(got[name], got[f"{name}_scale_inv"])
                    reference[name] = dequantized(values, scales)
                else:
                    assert torch.equal(got[name], w.to(torch.bfloat16)), (step, name)
                    served[name] = reference[name] = got[name].float()
            logits = []
            for weights in (served, reference):
                model.load_state_dict(weights)
                model.eval()
                with torch.no_grad():
                    logits.append(model(torch.tensor(fp8_peers.INPUT)).logits)
            assert torch.equal(logits[0], logits[1]), f"step {step}: the served FP8 model's logits differ"
            assert previous is None or not torch.equal(logits[0], previous), "the weights did not change"
            previous = logits[0]
    finally:
        torch.set_num_threads(threads)
