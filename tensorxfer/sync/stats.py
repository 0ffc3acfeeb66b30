"""What one step of a weight sync did, as one rank saw it (:attr:`tensorxfer.WeightSync.last_stats`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tensorxfer.sync.link import PairStats
from tensorxfer.sync.quantizing import QuantStats

__all__ = ["SyncStats"]


@dataclass(frozen=True)
class SyncStats:
    """One step of a weight sync as this rank saw it: its pairs, and the totals.

    ``failed`` names the peers whose part of the step failed (rank -> why): on a source, targets that
    died or stalled (the step went on for the others); ``epoch`` is the group's membership epoch.
    """

    version: int
    bytes: int
    seconds: float
    pack_seconds: float         # sources: from push() until the pack ended (it runs once the offers are out)
    pairs: tuple[PairStats, ...]
    packed_bytes: int = 0       # sources: bytes copied into the region this push (0 when all are adopted)
    failed: dict[int, str] = field(default_factory=dict)
    epoch: int = 1
    quantized: QuantStats = field(default_factory=QuantStats)     # sources: FP8 written this push

    @property
    def gbps(self) -> float:
        return self.bytes * 8 / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def transport(self) -> str:
        return ",".join(sorted({p.transport for p in self.pairs}))

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.version, "epoch": self.epoch, "bytes": self.bytes, "seconds": self.seconds,
                "gbps": self.gbps, "pack_seconds": self.pack_seconds, "packed_bytes": self.packed_bytes,
                "transport": self.transport, "failed": dict(self.failed), "quantized": self.quantized.as_dict(),
                "pairs": [p.as_dict() for p in self.pairs]}
