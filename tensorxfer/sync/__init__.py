"""Resharded weight sync: N source ranks sharded one way, M target ranks sharded another.

- :mod:`tensorxfer.sync.spec` describes which box of which tensor each rank
  holds (sources) or needs (targets), with helpers for ``torch.chunk`` /
  FSDP2 shards, Replicate, DTensors and fused (qkv, gate_up) targets.
- :mod:`tensorxfer.sync.plan` turns all ranks' descriptions into a static
  schedule: byte runs per (source, target) pair, every target byte written
  once, balanced over replicas, with a digest every rank can compare.

Both are pure (no I/O); execution and rendezvous build on them:

- :mod:`tensorxfer.sync.shards` -- what a rank hands over: :class:`Source` / :class:`Target` (or DTensors).
- :mod:`tensorxfer.sync.rendezvous` -- where ranks meet (a ``torch.distributed`` store; etcd for clusters).
- :mod:`tensorxfer.sync.link` -- one (source, target) pair over the session transports.
- :mod:`tensorxfer.sync.quantizing` -- sources quantizing for FP8 targets (one amax round for shared blocks).
- :mod:`tensorxfer.sync.copy_host` -- which target copies for the others on its GPU (one CUDA context).
- :mod:`tensorxfer.sync.weight_sync` -- :class:`WeightSync`: rendezvous, plan, push / wait.
"""

from tensorxfer.quant.layout import Quantization
from tensorxfer.sync.plan import Plan, Runs, SourceView, TargetView, plan
from tensorxfer.sync.shards import Source, Target
from tensorxfer.sync.spec import (
    Box,
    Piece,
    RankSpec,
    SourceTensor,
    TargetTensor,
    box_of_dtensor,
    chunk_box,
    even_box,
    fused_target,
    replicate_box,
    source_tensor_of_dtensor,
)
from tensorxfer.sync.weight_sync import SyncStats, WeightSync

__all__ = [
    "Box",
    "Piece",
    "Plan",
    "Quantization",
    "RankSpec",
    "Runs",
    "Source",
    "SourceTensor",
    "SourceView",
    "SyncStats",
    "Target",
    "TargetTensor",
    "TargetView",
    "WeightSync",
    "box_of_dtensor",
    "chunk_box",
    "even_box",
    "fused_target",
    "plan",
    "replicate_box",
    "source_tensor_of_dtensor",
]
