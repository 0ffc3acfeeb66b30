"""Live weights, the training side: every optimizer step is pushed into a server's model.

Start the server first (``examples/live_weights_server.py``), then:

    python examples/live_weights_trainer.py --to 127.0.0.1:7700 --steps 5 [--transport auto|ipc|tcp|rdma]

``TensorRegion.from_module(model)`` moves the model's parameters into one region once and re-points them
at it: training goes on unchanged, and ``sender.send(region)`` sends the current weights (no copy into a
staging buffer).  The transport is chosen once, when the ``Sender`` connects: ``auto`` takes ipc when the
server runs on this host as the same user, rdma when both ends have a usable RDMA device, else tcp (logged
at INFO, with why a faster one was not usable at WARNING); ``--transport`` forces one, and one that cannot
run fails with ``TransportUnavailable`` instead of falling back.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
from live_weights_model import build_model, weights_digest  # beside this file

import tensorxfer as tx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--to", default="127.0.0.1:7700", help="the server's HOST:PORT")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--transport", default="auto", choices=["auto", "ipc", "tcp", "rdma"])
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="trainer: %(name)s: %(message)s")   # shows auto's pick

    torch.manual_seed(0)
    model = build_model()
    region = tx.TensorRegion.from_module(model)      # the parameters ARE the region from now on
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    # connect_timeout: keep trying while the server is still starting
    with tx.Sender(args.to, token=os.environ.get("TENSORXFER_TOKEN"), transport=args.transport,
                   connect_timeout=30) as sender:
        print(f"trainer: connected to {args.to}, transport {sender.transport} (asked for {args.transport})",
              flush=True)
        for step in range(1, args.steps + 1):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            stats = sender.send(region)              # returns once the server's model holds these weights
            print(f"trainer: step {step}: loss {loss.item():.4f}, update {stats.update} over {stats.transport} "
                  f"({stats.bytes / 1e6:.2f} MB in {stats.seconds * 1e3:.1f} ms), weights "
                  f"{weights_digest(model)}", flush=True)
    region.close()


if __name__ == "__main__":
    main()
