"""Live weights, the inference side: a model whose parameters are replaced by every trainer step.

Start it first, then the trainer (two terminals, or two machines: listen on an address the trainer reaches):

    python examples/live_weights_server.py --listen 127.0.0.1:7700 --steps 5
    python examples/live_weights_trainer.py --to 127.0.0.1:7700 --steps 5 [--transport auto|ipc|tcp|rdma]

``receive(into=model)`` makes the model's own parameters views of the received region: the first update
allocates the region from the trainer's manifest, every later one lands in place (no copy, no
re-allocation), and returns only once every byte landed.  ``rx.version`` then says which update the model
holds and ``rx.last_stats`` how it came (the transport is the trainer's choice: ``Sender(transport=...)``).
Set ``TENSORXFER_TOKEN`` on both sides to authenticate the trainer.
"""

from __future__ import annotations

import argparse
import os

import torch
from live_weights_model import build_model, weights_digest  # beside this file

import tensorxfer as tx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", default="127.0.0.1:7700", help="HOST:PORT (port 0: any free port)")
    ap.add_argument("--steps", type=int, default=5, help="updates to receive before exiting")
    ap.add_argument("--timeout", type=float, default=60, help="seconds to wait for each update to start")
    args = ap.parse_args()

    model = build_model().eval()                 # random weights until the first update lands
    probe = torch.ones(1, 64)
    with tx.Receiver(args.listen, token=os.environ.get("TENSORXFER_TOKEN")) as rx:
        print("server: listening on {}:{}".format(*rx.address), flush=True)
        for _ in range(args.steps):
            rx.receive(timeout=args.timeout, into=model)     # the model's own tensors get the update
            version, stats = rx.version, rx.last_stats
            assert version is not None and stats is not None
            with torch.no_grad():
                out = model(probe)[0, :2].tolist()           # serving goes on with the new weights
            print(f"server: version {version.update} ({version.digest.hex()[:8]}) over {stats.transport}: "
                  f"{stats.bytes / 1e6:.2f} MB in {stats.seconds * 1e3:.1f} ms, re-allocated: "
                  f"{stats.reallocated}, weights {weights_digest(model)}, out[:2] = "
                  f"[{out[0]:.4f}, {out[1]:.4f}]", flush=True)


if __name__ == "__main__":
    main()
