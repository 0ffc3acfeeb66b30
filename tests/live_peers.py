"""The two processes of the live-weights tests: a trainer and an inference receiver, each a real process.

    python -m tests.live_peers receiver CONFIG_JSON --device cpu [--share] [--steps 3]
    python -m tests.live_peers trainer CONFIG_JSON --to HOST:PORT --transport tcp --optimizer foreach ...

Both build a Hugging Face ``LlamaForCausalLM`` from the same tiny config (no hub) with different seeds.
The trainer adopts its model (``TensorRegion.from_module``), trains it with AdamW and sends the region
after every step; the receiver binds its own model to what it receives (``receive(into=model)``).  Each
prints one JSON line per step: the logits on a fixed input and whether every parameter still is its
region view (no copy on either side).  The test compares the two.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from typing import Any

import torch

import tensorxfer as tx

TOKEN = "live-test"
INPUT_IDS = [[3, 14, 15, 92, 65, 35, 89, 79]]


def build(config: dict[str, Any], seed: int, device: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**config)).to(device)


def logits(model: Any, device: str) -> str:
    """The SHA-256 of the logits' bytes on a fixed input (equal digests: bit-identical logits)."""
    was = model.training
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor(INPUT_IDS, device=device)).logits.float().cpu().contiguous()
    model.train(was)
    return hashlib.sha256(out.numpy().tobytes()).hexdigest()


def views_hold(model: Any, region: tx.TensorRegion) -> bool:
    """Every parameter and persistent buffer of ``model`` is its view in ``region`` (same address)."""
    views = region.tensors(framework="torch")
    state = model.state_dict(keep_vars=True)
    return set(state) == set(views) and all(t.data_ptr() == views[n].data_ptr() for n, t in state.items())


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def receiver(args: argparse.Namespace) -> int:
    config = json.loads(args.config)
    model = build(config, seed=123, device=args.device)       # other weights: every byte must be replaced
    with tx.Receiver("127.0.0.1:0", token=TOKEN, device=args.device, share=args.share) as rx:
        say(address="{}:{}".format(*rx.address))
        for _ in range(args.steps):
            region = rx.receive(timeout=120, into=model)
            assert rx.version is not None and rx.last_stats is not None
            say(version=rx.version.update, views=views_hold(model, region), logits=logits(model, args.device),
                transport=rx.last_stats.transport, reallocated=rx.last_stats.reallocated)
    return 0


def trainer(args: argparse.Namespace) -> int:
    config = json.loads(args.config)
    model = build(config, seed=0, device=args.device)
    region = tx.TensorRegion.from_module(model)
    adopted = views_hold(model, region)
    kind = {"foreach": {"foreach": True}, "fused": {"fused": True}, "plain": {"foreach": False}}[args.optimizer]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **kind)
    ids = torch.tensor(INPUT_IDS, device=args.device)
    with tx.Sender(args.to, token=TOKEN, transport=args.transport) as sender:
        for step in range(1, args.steps + 1):
            model.train()
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            stats = sender.send(region)                      # no update_from: the region is the weights
            say(step=step, loss=float(loss), adopted=adopted, views=views_hold(model, region),
                logits=logits(model, args.device), transport=stats.transport, bytes=stats.bytes)
            if args.lockstep:
                # A sharing receiver reads this very memory: the next step must wait until it has looked.
                sys.stdin.readline()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["receiver", "trainer"])
    p.add_argument("config")
    p.add_argument("--device", default="cpu")
    p.add_argument("--share", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--to", default="")
    p.add_argument("--transport", default="auto")
    p.add_argument("--optimizer", default="foreach")
    p.add_argument("--lockstep", action="store_true", help="trainer: wait for a line on stdin after each step")
    args = p.parse_args(argv)
    torch.set_num_threads(1)        # one thread on both sides: the same reductions, bit-identical logits
    torch.use_deterministic_algorithms(True, warn_only=True)
    return receiver(args) if args.role == "receiver" else trainer(args)


if __name__ == "__main__":
    sys.exit(main())
