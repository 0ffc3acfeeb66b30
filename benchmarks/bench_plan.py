"""Benchmark: the resharding planner at cluster scale (Kimi-K2-shaped model, 256 trainer -> 128 inference ranks).

What every rank of a weight-sync group does once per membership epoch, timed
(medians over --repeat runs, and the best run for plan and total: on a
shared machine the best run is the one other processes disturbed least),
printed as JSON:

- ``decode_s``: unpack every rank's description from msgpack bytes (what the
  store hands out), checking each one (equal bodies -- the replicas of a TP
  rank -- once, through ``RankSpec.from_bytes(..., memo=...)``);
- ``spec_digest_s``: the sha256 of every description (cached on the spec);
- ``plan_s``: :func:`tensorxfer.sync.plan` from the decoded descriptions,
  including its digest over inputs and plan;
- ``total_s``: the three together, on a cold start (fresh descriptions, and
  the planner's cache of its last inputs emptied);
- ``rank_plan_s`` / ``rank_total_s``: the same for one rank's part
  (``plan(..., scope=(role, rank))``, what a weight-sync rank computes),
  target 0 and source 0 in turn, with ``rank_groups`` its size;
- ``*_cpu_s``: the same as process CPU time (the planner is single-threaded,
  so on a shared machine this is the number that does not count other
  processes' turns).

Model (DeepSeek-V3 / Kimi-K2 shapes, HF tensor names, BF16): hidden 7168,
vocab 163840, 61 layers (layer 0 dense MLP 18432, layers 1-60 MoE with 384
experts of 2048 plus one shared expert), MLA attention (q_a 1536, kv_a 576,
q_b 12288, kv_b 16384, o 7168x8192): 70k tensors, ~1.03T parameters.

Sources (trainer, 256 ranks): non-expert tensors HSDP -- ``Shard(0)`` over
the 8 ranks of a node (torch.chunk-uneven), replicated across the 32 nodes;
experts expert-parallel over 128 ranks (a block of 3 whole experts per layer each),
replicated twice (ranks r and r+128), so the planner balances replicas.
Targets (inference, 128 ranks = 16 replicas of TP 8, vLLM layout): norms,
router and the MLA down-projections replicated (``fused_qkv_a_proj`` =
cat(q_a, kv_a)); q_b, kv_b column-parallel; o_proj and down_proj
row-parallel; gate_up_proj fused column-parallel; embedding and lm_head
vocab-parallel; experts expert-parallel within the TP group (48 per rank)
as fused 3-D ``w13`` [48, 4096, 7168] (gate, up stacked per expert) and
``w2`` [48, 7168, 2048], one piece per expert weight.

    python benchmarks/bench_plan.py                      # full scale
    python benchmarks/bench_plan.py --layers 4 --experts 16 --sources 16 --targets 8 --repeat 1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time

import numpy as np

from tensorxfer.sync import (
    Piece,
    RankSpec,
    SourceTensor,
    TargetTensor,
    chunk_box,
    fused_target,
    plan,
    replicate_box,
)
from tensorxfer.sync.plan import _STEPS  # the planner's cache of its last inputs (emptied per run)

H, VOCAB, DENSE_I, MOE_I = 7168, 163840, 18432, 2048
Q_A, KV_A, Q_B, KV_B, O_IN = 1536, 576, 12288, 16384, 8192
ITEM = 2  # BF16


def model(layers: int, experts: int) -> tuple[list[tuple[str, tuple[int, ...]]], list[tuple[str, tuple[int, ...]]]]:
    """(dense tensors, expert tensors) as (name, shape), in checkpoint order."""
    dense = [("model.embed_tokens.weight", (VOCAB, H))]
    moe = []
    for i in range(layers):
        p = f"model.layers.{i}."
        dense += [(p + "input_layernorm.weight", (H,)), (p + "post_attention_layernorm.weight", (H,)),
                  (p + "self_attn.q_a_proj.weight", (Q_A, H)), (p + "self_attn.q_a_layernorm.weight", (Q_A,)),
                  (p + "self_attn.q_b_proj.weight", (Q_B, Q_A)),
                  (p + "self_attn.kv_a_proj_with_mqa.weight", (KV_A, H)),
                  (p + "self_attn.kv_a_layernorm.weight", (512,)), (p + "self_attn.kv_b_proj.weight", (KV_B, 512)),
                  (p + "self_attn.o_proj.weight", (H, O_IN))]
        if i == 0:
            dense += [(p + "mlp.gate_proj.weight", (DENSE_I, H)), (p + "mlp.up_proj.weight", (DENSE_I, H)),
                      (p + "mlp.down_proj.weight", (H, DENSE_I))]
            continue
        dense += [(p + "mlp.gate.weight", (experts, H)), (p + "mlp.gate.e_score_correction_bias", (experts,)),
                  (p + "mlp.shared_experts.gate_proj.weight", (MOE_I, H)),
                  (p + "mlp.shared_experts.up_proj.weight", (MOE_I, H)),
                  (p + "mlp.shared_experts.down_proj.weight", (H, MOE_I))]
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            moe += [(q + "gate_proj.weight", (MOE_I, H)), (q + "up_proj.weight", (MOE_I, H)),
                    (q + "down_proj.weight", (H, MOE_I))]
    dense += [("model.norm.weight", (H,)), ("lm_head.weight", (VOCAB, H))]
    return dense, moe


def sources(n: int, shard: int, ep: int, layers: int, experts: int) -> list[RankSpec]:
    dense, moe = model(layers, experts)
    specs = []
    for r in range(n):
        off, tensors = 0, []
        for name, shape in dense:
            box = chunk_box(shape, 0, r % shard, shard)
            tensors.append(SourceTensor(name, shape, "BF16", box, off))
            off += box.numel * ITEM
        mine = chunk_box((experts,), 0, r % ep, ep)  # a contiguous block of experts per EP rank
        first, last = mine.offsets[0], mine.offsets[0] + mine.sizes[0]
        for name, shape in moe:
            if first <= int(name.split(".experts.")[1].split(".")[0]) < last:
                tensors.append(SourceTensor(name, shape, "BF16", replicate_box(shape), off))
                off += MOE_I * H * ITEM
        specs.append(RankSpec("source", r, tensors))
    return specs


def target_template(tp: int, rank: int, layers: int, experts: int) -> RankSpec:
    """TP rank ``rank`` of ``tp``: a vLLM-style DeepSeek-V3 layout."""
    off, tensors = 0, []

    def add(t: TargetTensor) -> None:
        nonlocal off
        tensors.append(t)
        off += t.nbytes

    def plain(name: str, shape: tuple[int, ...], dim: int | None, local_name: str | None = None) -> None:
        box = replicate_box(shape) if dim is None else chunk_box(shape, dim, rank, tp)
        add(TargetTensor(local_name or name, box.sizes, "BF16", off, (Piece(name, box, (0,) * len(shape)),)))

    per = experts // tp
    plain("model.embed_tokens.weight", (VOCAB, H), 0)
    for i in range(layers):
        p = f"model.layers.{i}."
        for norm, n in (("input_layernorm", H), ("post_attention_layernorm", H),
                        ("self_attn.q_a_layernorm", Q_A), ("self_attn.kv_a_layernorm", 512)):
            plain(p + norm + ".weight", (n,), None)
        add(fused_target(p + "self_attn.fused_qkv_a_proj.weight", [(p + "self_attn.q_a_proj.weight", (Q_A, H)),
            (p + "self_attn.kv_a_proj_with_mqa.weight", (KV_A, H))], 0, 0, 1, "BF16", off))
        plain(p + "self_attn.q_b_proj.weight", (Q_B, Q_A), 0)
        plain(p + "self_attn.kv_b_proj.weight", (KV_B, 512), 0)
        plain(p + "self_attn.o_proj.weight", (H, O_IN), 1)
        mlp, inter = (p + "mlp.", DENSE_I) if i == 0 else (p + "mlp.shared_experts.", MOE_I)
        add(fused_target(mlp + "gate_up_proj.weight", [(mlp + "gate_proj.weight", (inter, H)),
                                                       (mlp + "up_proj.weight", (inter, H))], 0, rank, tp, "BF16", off))
        plain(mlp + "down_proj.weight", (H, inter), 1)
        if i == 0:
            continue
        plain(p + "mlp.gate.weight", (experts, H), None)
        plain(p + "mlp.gate.e_score_correction_bias", (experts,), None)
        w13, w2 = [], []
        for j in range(per):
            q = f"{p}mlp.experts.{rank * per + j}."
            w13 += [Piece(q + "gate_proj.weight", replicate_box((MOE_I, H)), (j, 0, 0)),
                    Piece(q + "up_proj.weight", replicate_box((MOE_I, H)), (j, MOE_I, 0))]
            w2.append(Piece(q + "down_proj.weight", replicate_box((H, MOE_I)), (j, 0, 0)))
        add(TargetTensor(p + "mlp.experts.w13_weight", (per, 2 * MOE_I, H), "BF16", off, tuple(w13)))
        add(TargetTensor(p + "mlp.experts.w2_weight", (per, H, MOE_I), "BF16", off, tuple(w2)))
    plain("model.norm.weight", (H,), None)
    plain("lm_head.weight", (VOCAB, H), 0)
    return RankSpec("target", rank, tensors)


def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    """The model and group shape flags (shared with bench_elastic.py)."""
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--sources", type=int, default=256)
    ap.add_argument("--targets", type=int, default=128)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--shard", type=int, default=8, help="HSDP shard group size of the non-expert tensors")
    ap.add_argument("--ep", type=int, default=128, help="expert-parallel size of the trainer (replicated above it)")


def check_model_arguments(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.experts % args.tp or args.targets % args.tp or args.sources % args.ep or args.sources % args.shard:
        ap.error("experts and targets must be multiples of tp; sources a multiple of ep and of shard")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ap)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    check_model_arguments(ap, args)

    t0 = time.perf_counter()
    templates = [target_template(args.tp, r, args.layers, args.experts) for r in range(args.tp)]
    wires = [t.to_wire() for t in templates]
    blobs = [s.to_bytes() for s in sources(args.sources, args.shard, args.ep, args.layers, args.experts)]
    blobs += [RankSpec.from_wire(dict(wires[r % args.tp], rank=r)).to_bytes() for r in range(args.targets)]
    build_s = time.perf_counter() - t0

    runs: dict[str, list[float]] = {k: [] for k in ("decode_s", "spec_digest_s", "plan_s", "total_s",
                                                   "plan_cpu_s", "total_cpu_s", "rank_plan_s", "rank_total_s",
                                                   "rank_plan_cpu_s")}
    result = None
    rank_groups: dict[str, int] = {}
    for i in range(args.repeat * 3):
        scope = (None, ("target", 0), ("source", 0))[i % 3]
        prefix = "rank_" if scope else ""
        if scope is None:
            del result
        _STEPS.clear()      # a cold start: nothing kept from the last run's inputs
        gc.collect()
        t, c = time.perf_counter(), time.process_time()
        memo: dict[bytes, object] = {}  # replicas with equal descriptions decode once
        specs = [RankSpec.from_bytes(b, memo=memo) for b in blobs]
        t1 = time.perf_counter()
        for s in specs:
            _ = s.digest
        t2, c2 = time.perf_counter(), time.process_time()
        p = plan(specs[:args.sources], specs[args.sources:], scope=scope)
        t3, c3 = time.perf_counter(), time.process_time()
        if scope is None:
            result = p
            runs["decode_s"].append(t1 - t)
            runs["spec_digest_s"].append(t2 - t1)
            runs["total_cpu_s"].append(c3 - c)
        else:
            assert p.digest == result.digest, "a rank's part has another digest than the whole plan"
            rank_groups[f"{scope[0]} {scope[1]}"] = p.num_groups
        runs[prefix + "plan_s"].append(t3 - t2)
        runs[prefix + "total_s"].append(t3 - t)
        runs[prefix + "plan_cpu_s"].append(c3 - c2)
        del specs, memo, p
    assert result is not None
    per_source = list(result.bytes_per_source.values())
    per_target = list(result.bytes_per_target.values())
    n_dense, n_moe = (len(x) for x in model(args.layers, args.experts))
    print(json.dumps({
        "benchmark": "sync.plan",
        "command": "python benchmarks/bench_plan.py " + " ".join(
            f"--{k} {v}" for k, v in vars(args).items()),
        "host": platform.node(), "python": platform.python_version(), "numpy": np.__version__,
        "cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2),
        "tensors": n_dense + n_moe, "sources": args.sources, "targets": args.targets,
        "spec_bytes_total": sum(len(b) for b in blobs),
        "spec_bytes_max": max(len(b) for b in blobs),
        "build_specs_s": round(build_s, 3),
        **{k: round(statistics.median(v), 3) for k, v in runs.items()},
        **{k.replace("_s", "_min_s"): round(min(v), 3) for k, v in runs.items()
           if k in ("plan_s", "total_s", "rank_plan_s", "rank_total_s")},
        "rank_groups": rank_groups,
        "pairs": sum(1 for _ in result), "groups": result.num_groups, "plain_runs": result.num_runs,
        "bytes_total": sum(per_target), "max_target_bytes": result.max_target_bytes,
        "source_bytes_min_max": [min(per_source), max(per_source)],
        "targets_per_source_max": max(len(v) for v in result.send_order.values()),
        "sources_per_target_max": max(len(v) for v in result.sources_of.values()),
        "digest": result.digest,
    }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
