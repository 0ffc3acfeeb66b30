"""The processes of the FP8 weight-sync acceptance: fp32 FSDP2 trainer ranks and TP inference ranks serving FP8.

    python -m tests.fp8_peers trainer RANK STORE_PORT OUT_DIR TRANSPORT [DEVICE]
    python -m tests.fp8_peers target RANK STORE_PORT OUT_DIR TRANSPORT [DEVICE]

Trainers build the same tiny Llama with grouped-query attention (2 query heads, 1 kv head of 128), shard
it with ``fully_shard`` over 3 ranks (Shard(0) rows cut at 86 / 171 of 256 and 512: block rows shared by
two ranks), train it in fp32 with AdamW and push after each step; rank 0 writes the full weights.
Targets hold a TP=2 layout the way an FP8 engine (vLLM, SGLang) serves a DeepSeek-style checkpoint: q/k/v
fused into ``qkv_proj`` (the kv head replicated on both ranks), gate/up into ``gate_up_proj``, o_proj and
down_proj row parallel -- all ``float8_e4m3fn`` with ``weight_scale_inv`` of 128 x 128 blocks -- and the
embedding, the head and the norms in bf16.  After each step they write what landed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

import tensorxfer as tx
from tensorxfer.sync import Quantization, Target, chunk_box, fused_target
from tensorxfer.sync.rendezvous import open_tcp_store

CONFIG = {"vocab_size": 96, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128, "max_position_embeddings": 32,
          "tie_word_embeddings": False}
SOURCES, TARGETS, STEPS = 3, 2, 3
INPUT = [[5, 17, 33, 2, 71, 8, 40, 91]]
Q = Quantization.blocks(128, 128)
HEAD_DIM = 128


def build() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def fp8(rows: int, cols: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """An engine's FP8 weight and its weight_scale_inv, zeroed: every byte must come from the sync."""
    return (torch.zeros(rows, cols, dtype=torch.float8_e4m3fn, device=device),
            torch.zeros(-(-rows // 128), -(-cols // 128), device=device))


def tp_layout(shapes: dict[str, tuple[int, ...]], rank: int, device: str = "cpu") -> dict[str, Target]:
    out: dict[str, Target] = {}
    for name, shape in shapes.items():
        if name.endswith("self_attn.q_proj.weight"):
            base = name[:-len("q_proj.weight")]
            parts = [(f"{base}{p}_proj.weight", shapes[f"{base}{p}_proj.weight"]) for p in "qkv"]
            rows = fused_target("qkv", parts, 0, rank, TARGETS, "F8_E4M3", 0, HEAD_DIM).local_shape[0]
            values, scales = fp8(rows, shape[1], device)
            out[f"{base}qkv_proj.weight"] = Target.fused(values, parts, 0, rank, TARGETS,
                                                         head_dim=HEAD_DIM).quantized(Q, scales)
        elif name.endswith("mlp.gate_proj.weight"):
            up = name.replace("gate_proj", "up_proj")
            parts = [(name, shape), (up, shapes[up])]
            rows = sum(chunk_box(s, 0, rank, TARGETS).sizes[0] for _, s in parts)
            values, scales = fp8(rows, shape[1], device)
            out[name.replace("gate_proj", "gate_up_proj")] = Target.fused(values, parts, 0, rank,
                                                                          TARGETS).quantized(Q, scales)
        elif name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")):
            continue
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            values, scales = fp8(*chunk_box(shape, 1, rank, TARGETS).sizes, device)
            out[name] = Target.shard(values, name, shape, 1, rank, TARGETS).quantized(Q, scales)
        elif len(shape) == 1:
            out[name] = Target.whole(torch.zeros(*shape, dtype=torch.bfloat16, device=device), name)
        else:       # embed_tokens, lm_head: vocab parallel, bf16
            out[name] = Target.shard(torch.zeros(*chunk_box(shape, 0, rank, TARGETS).sizes, dtype=torch.bfloat16,
                                                 device=device), name, shape, 0, rank, TARGETS)
    return out


def trainer(rank: int, port: int, out: Path, transport: str, device: str) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    store = open_tcp_store("127.0.0.1", port, False)
    dist.init_process_group("gloo", store=dist.PrefixStore("fsdp", store), rank=rank, world_size=SOURCES)
    mesh = init_device_mesh("cpu", (SOURCES,))     # host mesh: see tests/sync_peers.py
    model = build()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = dict(model.named_parameters())
    sync = tx.WeightSync(store, "llama-fp8", "source", rank, (SOURCES, TARGETS), params, token="fp8",
                         transport=transport, timeout=120, stall_timeout=20, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, foreach=True)
    ids = torch.tensor(INPUT)
    for step in range(1, STEPS + 1):
        model.train()
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        stats = sync.push()
        weights = {n: p.full_tensor().cpu() for n, p in params.items()}        # every rank gathers (gloo)
        if rank == 0:
            torch.save({"weights": weights}, out / f"trainer-{step}.pt")
        print(json.dumps({"rank": rank, "step": step, "bytes": stats.bytes, "packed": stats.packed_bytes,
                          "quantized": stats.quantized.as_dict()}), flush=True)
        dist.barrier()
    sync.close()
    dist.destroy_process_group()
    return 0


def target(rank: int, port: int, out: Path, transport: str, device: str) -> int:
    store = open_tcp_store("127.0.0.1", port, False)
    shapes = {n: tuple(p.shape) for n, p in build().named_parameters()}
    tensors = tp_layout(shapes, rank, device)
    sync = tx.WeightSync(store, "llama-fp8", "target", rank, (SOURCES, TARGETS), tensors, token="fp8",
                         transport=transport, timeout=120, stall_timeout=20)
    for _ in range(STEPS):
        version = sync.wait(timeout=120)
        views = sync.region.tensors(framework="torch")
        live = all(t.tensor.data_ptr() == views[n].data_ptr() for n, t in tensors.items())
        got = {n: t.tensor.cpu().clone() for n, t in tensors.items()}
        got.update({f"{n}_scale_inv": t.scales.cpu().clone() for n, t in tensors.items() if t.scales is not None})
        torch.save(got, out / f"target{rank}-{version}.pt")
        print(json.dumps({"version": version, "live": live, "bytes": sync.last_stats.bytes,
                          "transport": sync.last_stats.transport}), flush=True)
    sync.close()
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    role, rank, port, out, transport = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
    device = sys.argv[6] if len(sys.argv) > 6 else "cpu"
    run = trainer if role == "trainer" else target
    sys.exit(run(rank, port, out, transport, device))
