"""Where a weight sync's step spends its time, across its processes: a timeline of one step's phases.

``bench_sync.py --trace DIR`` calls :func:`install` in every rank process: it wraps a fixed list of the
library's functions (the push and wait, the pack, each control frame sent and received, the ipc chunk
table, the device copy's launch and the whole copy) so that each call records its wall-clock start and end
(``time.time()``: one clock for every process on the host) and its thread.  :func:`dump` writes a rank's
events; :func:`summarize` lines every warm step up on its first source's push() and prints, per rank and
phase, the median start and end in milliseconds from there.

This is a measuring aid, not part of the library: the wrappers cost a few microseconds per call, so the
traced step is slightly slower than the untraced one the bench reports.
"""

from __future__ import annotations

import functools
import json
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

EVENTS: list[tuple[str, str, float, float]] = []      # (phase, thread, start, end)


def _wrap(owner: Any, attr: str, label: Any) -> None:
    """Replace ``owner.attr`` by a wrapper recording each call; ``label(args)`` names the event."""
    fn = getattr(owner, attr, None)
    if fn is None:      # an older tree (an A/B run) without this phase
        return

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        t0 = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            EVENTS.append((label(args), threading.current_thread().name, t0, time.time()))
    setattr(owner, attr, traced)


class _TracedKernel:
    """A pair's device copy whose launch is recorded (the strided-copy class is Cython's: its methods cannot be
    replaced)."""

    def __init__(self, kernel: Any) -> None:
        self._kernel = kernel

    def launch(self, *args: Any) -> Any:
        t0 = time.time()
        try:
            return self._kernel.launch(*args)
        finally:
            EVENTS.append(("copy-launch", threading.current_thread().name, t0, time.time()))

    def __getattr__(self, name: str) -> Any:      # anything else the copy asks of it (check_quantized, ...)
        return getattr(self._kernel, name)


def install() -> None:
    from tensorxfer.protocol import Channel
    from tensorxfer.sync import link, weight_sync
    from tensorxfer.transport.ipc import copy, delegate, receiving, sender

    def named(name: str) -> Any:
        return lambda args: name

    for cls, attr in ((weight_sync.WeightSync, "push"), (weight_sync.WeightSync, "wait"),
                      (weight_sync.WeightSync, "_pack"), (link.SourceLink, "offer"), (link.SourceLink, "post"),
                      (link.SourceLink, "finish"), (link._Feed, "step"),
                      (sender.IpcSender, "_post"), (sender.IpcSender, "collect"), (copy.IpcReceiver, "prepare"),
                      (receiving.IpcReceiving, "wait"), (copy.IpcReceiver, "_copy_segments"),
                      (link._Feed, "take_offer"), (link._Feed, "land"), (delegate.CopyLane, "copy"),
                      (delegate._HostedPair, "copy")):
        _wrap(cls, attr, named(f"{cls.__name__}.{attr}"))
    from tensorxfer import binding
    from tensorxfer.quant import tiles
    from tensorxfer.sync import quantizing
    from tensorxfer.transport.ipc import lane

    for cls, attr in ((quantizing.SourceQuantizer, "launch"), (quantizing.SourceQuantizer, "begin"),
                      (quantizing.SourceQuantizer, "finish"), (quantizing.SourceQuantizer, "_merge"),
                      (quantizing._AgreedAmaxes, "write"), (quantizing._DeviceShards, "shared_host"),
                      (link._Feed, "land_parts"), (link._Feed, "_data"), (delegate._HostedPair, "step"),
                      (tiles.DeviceTiles, "launch"), (weight_sync.WeightSync, "_receive"),
                      (link.TargetPort, "admit"), (link.TargetPort, "step"), (lane.InDoubt, "wait_clear"),
                      (binding.ModuleBinding, "check_landing"), (link.SourceLink, "refuse")):
        _wrap(cls, attr, named(f"{cls.__name__}.{attr}"))
    import torch

    _wrap(torch.cuda, "synchronize", named("torch.cuda.synchronize"))     # the pack's, looked up per call
    _wrap(Channel, "send", lambda args: f"send {args[1]}")
    _wrap(Channel, "recv", lambda args: f"recv {'/'.join(args[1:])}")
    _wrap(receiving, "recv_message", lambda args: f"ipc recv {args[1]}")
    strided = copy.IpcReceiver._strided_copy

    def traced_strided(self: Any, *args: Any) -> Any:
        kernel = strided(self, *args)
        return None if kernel is None else _TracedKernel(kernel)
    copy.IpcReceiver._strided_copy = traced_strided     # type: ignore[method-assign]


def dump(path: Path, role: str, rank: int, steps: list[tuple[float, float]]) -> None:
    """Write this rank's events, with each step's (start, end) as the bench saw it."""
    path.mkdir(parents=True, exist_ok=True)
    (path / f"trace-{role}{rank}.json").write_text(json.dumps({"role": role, "rank": rank, "steps": steps,
                                                               "events": EVENTS}))


def summarize(path: Path, skip: int = 1) -> str:
    """Per rank and phase, the median (start, end) in ms from each warm step's first source push()."""
    ranks = [json.loads(p.read_text()) for p in sorted(path.glob("trace-*.json"))]
    sources = [r for r in ranks if r["role"] == "source"]
    steps = len(sources[0]["steps"])
    origins = [min(r["steps"][i][0] for r in sources) for i in range(steps)]
    ends = [max(r["steps"][i][1] for r in ranks) for i in range(steps)]
    rows: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for r in ranks:
        who = f"{r['role']}{r['rank']}"
        for phase, thread, t0, t1 in r["events"]:
            for i in range(skip, steps):
                if origins[i] - 0.002 <= t0 <= ends[i]:
                    rows[(who, phase if thread == "MainThread" else f"  {phase} [{thread[-1]}]")].append(
                        ((t0 - origins[i]) * 1e3, (t1 - origins[i]) * 1e3))
                    break
    span = statistics.median(e - o for e, o in zip(ends[skip:], origins[skip:])) * 1e3
    lines = [f"median step {span:.2f} ms from the first push() to the last rank's end; per phase: "
             f"median start .. end (ms), calls per step"]
    for (who, phase), times in sorted(rows.items(), key=lambda kv: (kv[0][0], statistics.median(
            t for t, _ in kv[1]))):
        lines.append(f"{who:8} {phase:48} {statistics.median(t for t, _ in times):7.3f} .. "
                     f"{statistics.median(t for _, t in times):7.3f}  x{len(times) / (steps - skip):.1f}")
    return "\n".join(lines)


def last_step(path: Path) -> str:
    """Every event of the last step, every rank's, in the order they began (ms from its first source push())."""
    ranks = [json.loads(p.read_text()) for p in sorted(path.glob("trace-*.json"))]
    origin = min(r["steps"][-1][0] for r in ranks if r["role"] == "source")
    end = max(r["steps"][-1][1] for r in ranks)
    rows = sorted((t0, t1, f"{r['role']}{r['rank']}", thread, phase) for r in ranks
                  for phase, thread, t0, t1 in r["events"] if origin - 0.002 <= t0 <= end)
    return "\n".join(f"{(t0 - origin) * 1e3:7.3f} .. {(t1 - origin) * 1e3:7.3f}  {who:8} {thread[-12:]:12} {phase}"
                     for t0, t1, who, thread, phase in rows)


if __name__ == "__main__":
    import sys

    print(last_step(Path(sys.argv[2])) if sys.argv[1] == "--last" else summarize(Path(sys.argv[1])))
