"""A trainer pushes fresh weights to an inference server every step.

The server keeps one Receiver open for its lifetime; the first step allocates
its region from the trainer's manifest, every later step lands in that same
region (nothing re-allocated or re-registered).  Run it as is (both sides in
one process, on loopback), or split the two functions across machines:

    python examples/trainer_pushes_weights.py --steps 5 --transport tcp
"""

from __future__ import annotations

import argparse
import threading

import numpy as np

import tensorxfer as tx

_print_lock = threading.Lock()


def say(line: str) -> None:
    with _print_lock:    # both sides print from their own threads: keep lines whole
        print(line, flush=True)


def inference_server(rx: tx.Receiver, steps: int) -> None:
    for _ in range(steps):
        region = rx.receive(timeout=60)          # the same region object every step
        weights = region.tensors()               # zero-copy views of what just landed
        say(f"  server: step weights landed, embed[0, :3] = {weights['embed'][0, :3]}")
        del weights                              # views pin the region; drop them before the next receive


def trainer(address: str, steps: int, transport: str) -> None:
    rng = np.random.default_rng(0)
    params = {"embed": rng.standard_normal((4096, 256), dtype=np.float32),
              "norm": np.ones(256, np.float32),
              "head": rng.standard_normal((256, 4096), dtype=np.float32)}
    with tx.TensorRegion.from_tensors(params) as region, tx.Sender(address, transport=transport) as sender:
        for step in range(steps):
            for p in params.values():            # an optimizer step, in place
                p += np.float32(0.01)
            region.update_from(params)           # copy into the registered region
            stats = sender.send(region, verify=True)
            say(f"trainer: step {step}: {stats.bytes / 1e6:.1f} MB in {stats.seconds * 1e3:.1f} ms over "
                  f"{stats.transport} ({stats.gbps:.2f} Gbps), re-allocated: {stats.reallocated}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--transport", default="auto", help="auto, tcp, ipc or rdma")
    args = ap.parse_args()
    with tx.Receiver("127.0.0.1:0") as rx:
        server = threading.Thread(target=inference_server, args=(rx, args.steps))
        server.start()
        trainer("{}:{}".format(*rx.address), args.steps, args.transport)
        server.join()


if __name__ == "__main__":
    main()
