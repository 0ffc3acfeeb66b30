"""The processes of the FSDP2 weight-sync test: trainer ranks (FSDP2 over gloo) and TP inference ranks.

    python -m tests.sync_peers trainer RANK STORE_PORT OUT_DIR TRANSPORT [DEVICE]
    python -m tests.sync_peers target RANK STORE_PORT OUT_DIR TRANSPORT [DEVICE]

Trainers build the same tiny Llama (no hub), shard it with ``fully_shard`` (Shard(0) DTensors, uneven
where torch.chunk cuts unevenly), train it with AdamW and push after every step; rank 0 writes the
model's logits on a fixed input.  Targets hold a TP=2 layout -- q/k/v fused into ``qkv_proj``, gate/up
into ``gate_up_proj`` (column parallel), o_proj and down_proj row parallel, the embedding and the head
vocab parallel, norms replicated -- and write what landed after every step, so the test can put the
model back together and compare its logits with the trainer's.  DEVICE (default ``cpu``) is where the
sync's regions live: on ``cuda:0`` all six processes share the one GPU -- the targets' weights are there,
and each trainer, still training on the host (FSDP2 over gloo on a host mesh), packs its shards into a
region on the GPU every step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

import tensorxfer as tx
from tensorxfer.sync import Target, chunk_box
from tensorxfer.sync.rendezvous import open_tcp_store

CONFIG = {"vocab_size": 96, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
          "tie_word_embeddings": False}
SOURCES, TARGETS, STEPS = 4, 2, 3
INPUT = [[5, 17, 33, 2, 71, 8, 40, 91]]


def build() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def tp_layout(shapes: dict[str, tuple[int, ...]], rank: int, device: str = "cpu") -> dict[str, Target]:
    """The inference rank's own tensors (TP=2, fused), zeroed: every byte must come from the sync."""
    def zeros(*size: int) -> torch.Tensor:
        return torch.zeros(*size, device=device)
    out: dict[str, Target] = {}
    head_dim = CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    for name, shape in shapes.items():
        if name.endswith("self_attn.q_proj.weight"):
            base = name[:-len("q_proj.weight")]
            parts = [(f"{base}{p}_proj.weight", shapes[f"{base}{p}_proj.weight"]) for p in "qkv"]
            rows = sum(chunk_box(s, 0, rank, TARGETS).sizes[0] for _, s in parts)
            out[f"{base}qkv_proj.weight"] = Target.fused(zeros(rows, shape[1]), parts, 0, rank, TARGETS,
                                                         head_dim=head_dim)
        elif name.endswith("mlp.gate_proj.weight"):
            up = name.replace("gate_proj", "up_proj")
            parts = [(name, shape), (up, shapes[up])]
            rows = sum(chunk_box(s, 0, rank, TARGETS).sizes[0] for _, s in parts)
            out[name.replace("gate_proj", "gate_up_proj")] = Target.fused(zeros(rows, shape[1]), parts, 0,
                                                                          rank, TARGETS)
        elif name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")):
            continue
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = Target.shard(zeros(*chunk_box(shape, 1, rank, TARGETS).sizes), name, shape, 1, rank,
                                     TARGETS)
        elif len(shape) == 1:
            out[name] = Target.whole(zeros(*shape), name)
        else:       # embed_tokens, lm_head: vocab parallel
            out[name] = Target.shard(zeros(*chunk_box(shape, 0, rank, TARGETS).sizes), name, shape, 0, rank,
                                     TARGETS)
    return out


def trainer(rank: int, port: int, out: Path, transport: str, device: str) -> int:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    store = open_tcp_store("127.0.0.1", port, False)
    dist.init_process_group("gloo", store=dist.PrefixStore("fsdp", store), rank=rank, world_size=SOURCES)
    from torch.distributed.device_mesh import init_device_mesh

    # The mesh on the host, named: with a GPU present, FSDP2's default mesh is "cuda" and its gloo
    # collectives on host parameters crashed the trainers (SIGSEGV on the H200).
    mesh = init_device_mesh("cpu", (SOURCES,))
    model = build()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = dict(model.named_parameters())
    sync = tx.WeightSync(store, "llama", "source", rank, (SOURCES, TARGETS), params, token="fsdp",
                         transport=transport, timeout=120, stall_timeout=20, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, foreach=True)
    ids = torch.tensor(INPUT)
    for step in range(1, STEPS + 1):
        model.train()
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        stats = sync.push()
        model.eval()
        with torch.no_grad():
            logits = model(ids).logits
        weights = {n: p.full_tensor().cpu() for n, p in params.items()}        # every rank gathers (gloo)
        if rank == 0:
            torch.save({"logits": logits, "weights": weights, "bytes": stats.bytes}, out / f"trainer-{step}.pt")
        dist.barrier()
    sync.close()
    dist.destroy_process_group()
    return 0


def target(rank: int, port: int, out: Path, transport: str, device: str) -> int:
    store = open_tcp_store("127.0.0.1", port, False)
    shapes = {n: tuple(p.shape) for n, p in build().named_parameters()}
    tensors = tp_layout(shapes, rank, device)
    sync = tx.WeightSync(store, "llama", "target", rank, (SOURCES, TARGETS), tensors, token="fsdp",
                         transport=transport, timeout=120, stall_timeout=20)
    for _ in range(STEPS):
        version = sync.wait(timeout=120)
        views = sync.region.tensors(framework="torch")
        live = all(t.tensor.data_ptr() == views[n].data_ptr() for n, t in tensors.items())
        torch.save({n: t.tensor.cpu().clone() for n, t in tensors.items()}, out / f"target{rank}-{version}.pt")
        print(json.dumps({"version": version, "live": live, "transport": sync.last_stats.transport,
                          "device": str(tensors[next(iter(tensors))].tensor.device)}), flush=True)
    sync.close()
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    role, rank, port, out, transport = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
    device = sys.argv[6] if len(sys.argv) > 6 else "cpu"
    run = trainer if role == "trainer" else target
    sys.exit(run(rank, port, out, transport, device))
