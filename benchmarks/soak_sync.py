"""Soak: a weight-sync group under a random fault every few steps, checked byte for byte.

Two source processes (each ``torch.chunk`` shard 0/1 of ``a`` and ``c``, ``b`` whole on both) push to two target
processes (every target holds the whole model) for ``--steps`` steps over ``--transport`` (tcp, or ipc with
the targets copying through a copy host), on a real store (a TCPStore hosted here, or an etcd server started
here).  Every ``--fault-every`` steps one fault, drawn at random (``--seed``):

- ``stall``: SIGSTOP of a random rank (source or target) for 1-10 s, then SIGCONT; the steps go on meanwhile;
- ``kill``: SIGKILL of a random target and a new process for its rank (elastic: it joins again);
- ``garbage``: an unsealed or malformed value written into the group's store by a writer without its token
  (a member record at an unused rank, ``latest``, a report, a heartbeat, a future step's record, ...).

Checked, and written to ``--out`` (``soak-<transport>-<store>-<UTC>.json`` and a ``.log`` of every event):

- every version a target reports is byte-exact (the model's values depend only on the version: the
  checker computes what the sources held);
- the longest any rank was blocked: a source's ``push()``; a target's ``wait()`` from the moment the driver
  told the sources to push that step (the stalled rank's own time while stopped is not counted); stated as
  ``stall_timeout`` + a margin;
- recovery: after each fault ends (SIGCONT, the new process ready, the value written), how many steps until
  every running target reports a step's version byte-exact; must be at most 2.  Faults overlap (a 10 s stall
  spans many fast steps, and the next faults come during it): the steps are then counted from the end of
  the last of them.

    python benchmarks/soak_sync.py --steps 300 --transport tcp --out benchmarks/results/2026-12-05-soak
    python benchmarks/soak_sync.py --steps 300 --transport ipc --store etcd --out benchmarks/results/2026-12-05-soak
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import faulthandler
import hashlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GROUP = "soak"
TOKEN = "soak-token"
SHAPES = {"a": (64, 256), "b": (1000,), "c": (32, 128)}     # a and c sharded over the sources, b whole on both
SOURCES, TARGETS = 2, 2
TAIL = 40               # steps at most after the last, half a second apart, for the last fault's recovery


# ---------------------------------------------------------------- the model and the peers
def model(version: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(7000 + version)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def digest(tensors: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for n in sorted(tensors):
        h.update(n.encode())
        h.update(tensors[n].contiguous().numpy().tobytes())
    return h.hexdigest()


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def source_peer(rank: int, url: str, transport: str, stall: float) -> None:
    import torch

    import tensorxfer as tx
    from tensorxfer.sync import Source, chunk_box

    def shard(version: int) -> dict[str, Any]:
        m = model(version)
        out = {"b": m["b"]}
        for n in ("a", "c"):
            box = chunk_box(SHAPES[n], 0, rank, SOURCES)
            out[n] = m[n][box.offsets[0]:box.offsets[0] + box.sizes[0]].clone()
        return out
    local = shard(0)
    tensors = {n: Source.whole(t) if n == "b" else Source.shard(t, SHAPES[n], 0, rank, SOURCES)
               for n, t in local.items()}
    with tx.WeightSync(url, GROUP, "source", rank, (SOURCES, TARGETS), tensors, token=TOKEN, transport=transport,
                       stall_timeout=stall, timeout=120) as sync:
        say(ready=True, pid=os.getpid())
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "exit":
                break
            version = int(cmd[1])
            with torch.no_grad():
                for name, value in shard(version).items():
                    tensors[name].tensor.copy_(value)        # the trainer's step, in place
            t0 = time.monotonic()
            try:
                stats = sync.push()
                say(step=sync.step, version=stats.version, failed=sorted(stats.failed), seconds=time.monotonic() - t0,
                    targets=sorted(p.target for p in stats.pairs), epoch=stats.epoch, at=time.monotonic())
            except tx.TensorXferError as e:
                say(step=sync.step, error=type(e).__name__, message=str(e)[:300], seconds=time.monotonic() - t0,
                    at=time.monotonic())


def target_peer(rank: int, url: str, transport: str, stall: float) -> None:
    import torch

    import tensorxfer as tx
    from tensorxfer.sync import Target

    tensors = {n: Target.whole(torch.zeros(s), n) for n, s in SHAPES.items()}
    with tx.WeightSync(url, GROUP, "target", rank, (SOURCES, TARGETS), tensors, token=TOKEN, transport=transport,
                       stall_timeout=stall, timeout=120, copy_host=transport == "ipc") as sync:
        say(ready=True, pid=os.getpid(), hosting=sync._copy_host is not None)
        while True:
            try:
                version = sync.wait()
                say(step=sync.step, version=version, sha=digest({n: t.tensor for n, t in tensors.items()}),
                    at=time.monotonic())
            except tx.TensorXferError as e:
                say(step=sync.step, error=type(e).__name__, message=str(e)[:300], at=time.monotonic())


# ---------------------------------------------------------------- the driver
class Peer:
    """One peer process, its JSON lines (timestamped on arrival) and its stderr."""

    def __init__(self, role: str, rank: int, url: str, args: argparse.Namespace, log: Any) -> None:
        self.role, self.rank = role, rank
        self.proc = subprocess.Popen([sys.executable, __file__, "peer", role, str(rank), url, "--transport",
                                      args.transport, "--stall-timeout", str(args.stall_timeout)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                     cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.stopped_from = self.stopped_until = 0.0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:       # type: ignore[union-attr]
            with contextlib.suppress(ValueError):
                self.lines.put(json.loads(line))

    def next(self, timeout: float) -> dict[str, Any] | None:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    @property
    def name(self) -> str:
        return f"{self.role}{self.rank}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(self.proc.pid, signal.SIGCONT)
                self.send("exit")
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def store(kind: str, where: Path) -> Iterator[str]:
    if kind == "etcd":
        from tests.etcd_server import etcd_server

        with etcd_server(where) as url:
            yield url + "?ttl=3"
    else:
        from tensorxfer.sync.rendezvous import open_tcp_store

        server = open_tcp_store("127.0.0.1", 0, True)
        yield f"tcp://127.0.0.1:{server.port}"


def garbage(rdv: Any, rng: random.Random, step: int) -> str:
    """Write one value a writer without the token could write; what was written, in words."""
    import msgpack

    key = "/".join(["tensorxfer.sync", GROUP])
    choice = rng.choice(["member", "member-name", "latest", "report", "beat", "future-step", "status", "digest"])
    junk = rng.choice([b"\xc1", b"\x93\x01\x02", msgpack.packb({"uid": "zz", "address": ["h", "port"]}),
                       os.urandom(rng.randint(1, 64))])
    if choice == "member":
        rdv.join(f"{key}/member/target", str(rng.randint(5, 99)), junk or b"x")
        return f"a garbage member record at an unused target rank ({junk[:16]!r})"
    if choice == "member-name":
        rdv.join(f"{key}/member/source", "x", junk or b"x")
        return "a member named 'x'"
    if choice == "latest":
        rdv.publish(f"{key}/latest", junk)
        return "a garbage 'latest'"
    if choice == "report":
        role, rank = rng.choice([("source", 0), ("source", 1), ("target", 0), ("target", 1)])
        rdv.publish(f"{key}/report/{step}/{role}/{rank}", junk)
        return f"a garbage report of step {step} for {role} {rank} (written before the rank's own)"
    if choice == "beat":
        rdv.publish(f"{key}/beat/target/{rng.randint(0, 1)}", junk)
        return "a garbage heartbeat"
    if choice == "future-step":
        rdv.publish(f"{key}/step/{step + 1}", junk)
        return f"a forged record of step {step + 1} (that step fails for every rank, named)"
    if choice == "status":
        rdv.publish(f"{key}/status/target/{rng.randint(0, 1)}", junk)
        return "a garbage status"
    rdv.publish(f"{key}/digest/1/target/{rng.randint(0, 1)}", junk)
    return "a garbage plan digest of epoch 1"


def drive(args: argparse.Namespace) -> dict[str, Any]:
    from tensorxfer.sync.rendezvous import connect

    rng = random.Random(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    base = out / f"soak-{args.transport}-{args.store}-{stamp}"
    events = open(f"{base}.log", "w")
    stderr_log = open(f"{base}.stderr", "w")
    t_start = time.monotonic()

    def event(name: str, **fields: Any) -> None:
        line = {"t": round(time.monotonic() - t_start, 3), "event": name, **fields}
        events.write(json.dumps(line) + "\n")
        events.flush()
        if not args.quiet:
            print(json.dumps(line), flush=True)

    want = {v: digest(model(v)) for v in range(args.steps + TAIL + 1)}
    stall = args.stall_timeout
    results: dict[str, Any] = {"faults": [], "corrupt": [], "blocks": [], "recoveries": []}
    with tempfile.TemporaryDirectory() as tmp, store(args.store, Path(tmp)) as url:
        rdv = connect(url)
        targets = [Peer("target", r, url, args, stderr_log) for r in range(TARGETS)]
        sources = [Peer("source", r, url, args, stderr_log) for r in range(SOURCES)]
        everyone = [*targets, *sources]
        try:
            for p in everyone:
                ready = p.next(180)
                if not ready or not ready.get("ready"):
                    raise SystemExit(f"{p.name} did not start: {ready}")
                event("ready", peer=p.name, hosting=ready.get("hosting"))
            sent: dict[int, float] = {}         # step -> when the driver told the sources to push it
            pending: list[dict[str, Any]] = []  # faults not yet recovered from: {kind, ended_step}
            timers: list[threading.Timer] = []
            current = [0]                       # the step being pushed (a SIGCONT's fault ends at the next one)

            def resume(p: Peer) -> None:
                os.kill(p.proc.pid, signal.SIGCONT)
                event("cont", peer=p.name)
                pending.append({"kind": "stall", "peer": p.name, "ended_step": current[0] + 1})
            seen: dict[str, dict[int, dict[str, Any]]] = {"target0": {}, "target1": {}}

            def collect(p: Peer, line: dict[str, Any]) -> None:
                if "sha" in line:
                    ok = line["sha"] == want.get(line["version"])
                    if not ok:
                        results["corrupt"].append({"peer": p.name, **line})
                    event("version", peer=p.name, step=line["step"], version=line["version"], exact=ok)
                else:
                    event("error", peer=p.name, step=line.get("step"), error=line.get("error"),
                          message=line.get("message"))
                step = int(line.get("step", 0))
                seen[p.name][step] = line
                if step in sent and line.get("at", 0) > p.stopped_until:
                    results["blocks"].append({"peer": p.name, "step": step,
                                              "seconds": line["at"] - max(sent[step], p.stopped_until)})

            step = 0
            while step < args.steps or (pending and step < args.steps + TAIL):
                step += 1       # past --steps: steps without faults, for the last fault's recovery
                if step == args.steps + 1:
                    for timer in timers:
                        timer.join()        # the last stall ends before the steps that show its recovery
                if step > args.steps:
                    time.sleep(0.5)         # a killed target's new process may still be starting
                now = time.monotonic()
                current[0] = step
                if step % args.fault_every == 0 and step <= args.steps:
                    kind = rng.choice(["stall", "kill", "garbage"])
                    if kind == "stall":
                        p = rng.choice([q for q in everyone if q.proc.poll() is None and q.stopped_until < now])
                        seconds = rng.uniform(1, 10)
                        os.kill(p.proc.pid, signal.SIGSTOP)
                        p.stopped_from, p.stopped_until = now, now + seconds
                        timers.append(threading.Timer(seconds, resume, (p,)))
                        timers[-1].start()
                        results["faults"].append({"step": step, "kind": kind, "peer": p.name, "seconds": seconds})
                        event("stop", peer=p.name, seconds=round(seconds, 2), step=step)
                    elif kind == "kill":
                        live = [q for q in targets if q.stopped_until < now]
                        victim = rng.choice(live)
                        victim.proc.kill()
                        victim.proc.wait()
                        new = Peer("target", victim.rank, url, args, stderr_log)
                        targets[targets.index(victim)] = new
                        everyone[everyone.index(victim)] = new
                        results["faults"].append({"step": step, "kind": kind, "peer": victim.name})
                        event("kill", peer=victim.name, step=step)
                        pending.append({"kind": "kill", "peer": new.name, "ended_step": None, "proc": new})
                    else:
                        what = garbage(rdv, rng, step)
                        results["faults"].append({"step": step, "kind": kind, "what": what})
                        event("garbage", what=what, step=step)
                        pending.append({"kind": "garbage", "what": what, "ended_step": step})
                sent[step] = time.monotonic()
                for s in sources:
                    s.send(f"push {step}")
                expected: set[int] = set()
                for s in sources:
                    line = s.next(args.step_timeout)
                    if line is None:        # wedged: every peer's threads to the stderr log, then stop
                        for p in everyone:
                            with contextlib.suppress(OSError):
                                os.kill(p.proc.pid, signal.SIGUSR1)
                        time.sleep(2)
                        raise SystemExit(f"{s.name} did not answer step {step} within {args.step_timeout} s "
                                         f"(the peers' threads: {stderr_log.name})")
                    if "error" in line:
                        event("error", peer=s.name, step=step, error=line["error"], message=line["message"])
                        expected |= set(range(TARGETS))     # the targets fail the step too (a store error, a plan)
                    else:
                        expected |= set(line["targets"]) | {int(t) for t in line["failed"]}
                        event("pushed", peer=s.name, step=step, failed=line["failed"], targets=line["targets"],
                              seconds=round(line["seconds"], 3), epoch=line["epoch"])
                    if not s.stopped_from < s.stopped_until or s.stopped_until < sent[step]:    # not its own stop
                        results["blocks"].append({"peer": s.name, "step": step, "seconds": line["seconds"]})
                # the targets' lines for this step: each running target says something within the stall bound
                deadline = time.monotonic() + stall + 3
                for t in targets:
                    while (t.rank in expected and time.monotonic() < deadline) or not t.lines.empty():
                        if t.stopped_until > time.monotonic() and t.lines.empty():
                            break
                        line = t.next(max(0.0, min(0.2, deadline - time.monotonic())))
                        if line is None:
                            if t.proc.poll() is not None or time.monotonic() >= deadline:
                                break
                            continue
                        if line.get("ready"):
                            event("ready", peer=t.name, hosting=line.get("hosting"))
                            for f in pending:
                                if f.get("proc") is t:
                                    f["ended_step"] = step + 1
                            continue
                        collect(t, line)
                        if int(line.get("step", 0)) >= step:
                            break
                # a step is healthy when every target not stopped reported its version, byte-exact
                running = [t for t in targets if t.stopped_until <= time.monotonic() and t.proc.poll() is None]
                healthy = all(seen[t.name].get(step, {}).get("version") == step and
                              seen[t.name][step]["sha"] == want[step] for t in running) and len(running) == TARGETS
                event("step", step=step, healthy=healthy)
                # faults overlap (a 10 s stall spans many steps): a step counts from the end of the last one
                ended = [f for f in pending if f["ended_step"] is not None and f["ended_step"] <= step]
                if healthy and ended:
                    last = max(f["ended_step"] for f in ended)
                    for f in ended:
                        results["recoveries"].append({"kind": f["kind"], "steps": step - last,
                                                      "overlapped": len(ended) > 1,
                                                      **{k: v for k, v in f.items() if k in ("peer", "what")}})
                        pending.remove(f)
                        event("recovered", kind=f["kind"], steps=step - last, overlapped=len(ended) > 1)
            for timer in timers:
                timer.join()
            results["unrecovered"] = [{k: v for k, v in f.items() if k != "proc"} for f in pending]
        finally:
            for p in everyone:
                p.stop()
            rdv.close()
    longest = max(results["blocks"], key=lambda b: b["seconds"])
    summary = {
        "steps": args.steps, "transport": args.transport, "store": args.store, "stall_timeout": stall,
        "seed": args.seed, "fault_every": args.fault_every, "seconds": round(time.monotonic() - t_start, 1),
        "faults": {k: sum(1 for f in results["faults"] if f["kind"] == k) for k in ("stall", "kill", "garbage")},
        "versions_checked": sum(1 for name in seen for line in seen[name].values() if "sha" in line),
        "corrupt": results["corrupt"],
        "recovered": len(results["recoveries"]),
        "recovery_steps_max": max((r["steps"] for r in results["recoveries"]), default=0),
        "recovery_steps": sorted(r["steps"] for r in results["recoveries"]),
        "unrecovered": results["unrecovered"],
        "longest_block_s": round(longest["seconds"], 3), "longest_block": longest,
        "margin_over_stall_timeout_s": round(longest["seconds"] - stall, 3),
        "command": " ".join(["python3", "benchmarks/soak_sync.py", *sys.argv[1:]]),
        "faults_injected": results["faults"], "recoveries": results["recoveries"],
    }
    Path(f"{base}.json").write_text(json.dumps(summary, indent=2, default=str))
    events.close()
    stderr_log.close()
    return summary


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "peer":
        p = argparse.ArgumentParser()
        p.add_argument("_peer")
        p.add_argument("role")
        p.add_argument("rank", type=int)
        p.add_argument("url")
        p.add_argument("--transport", default="tcp")
        p.add_argument("--stall-timeout", type=float, default=4.0)
        a = p.parse_args()
        import torch

        torch.set_num_threads(1)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        faulthandler.register(signal.SIGUSR1)       # `kill -USR1 PID`: where a peer is, on its stderr
        (source_peer if a.role == "source" else target_peer)(a.rank, a.url, a.transport, a.stall_timeout)
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--fault-every", type=int, default=10)
    p.add_argument("--transport", choices=["tcp", "ipc"], default="tcp")
    p.add_argument("--store", choices=["tcpstore", "etcd"], default="tcpstore")
    p.add_argument("--stall-timeout", type=float, default=4.0)
    p.add_argument("--step-timeout", type=float, default=120.0, help="the driver gives up on a source after this")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/soak")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args()
    summary = drive(args)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("faults_injected", "recoveries")}, indent=2,
                     default=str))
    ok = not summary["corrupt"] and not summary["unrecovered"] and summary["recovery_steps_max"] <= 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
