"""tensorxfer: the umbrella command (demo, doctor, sync-status); tensorxfer-send, -recv, -bench stand alone."""

from __future__ import annotations

import argparse
import sys
import time


def demo(args: argparse.Namespace) -> int:
    """Send a synthetic 820-tensor model to a receiver in another process over loopback, twice, and check it."""
    from tensorxfer import Manifest, Sender, TensorRegion, synthetic
    from tensorxfer.checksum import tensor_checksums
    from tensorxfer.cli import _loopback
    from tensorxfer.cli.bench import fill
    from tensorxfer.cli.common import streams

    size = int(args.size)
    t0 = time.perf_counter()
    with TensorRegion.from_manifest(Manifest.layout(synthetic.layout(size))) as region:
        fill(region)
        print(f"packed {len(region.manifest)} tensors, {region.nbytes / 1e6:.1f} MB into one region of "
              f"{len(region.region.chunks)} memfd chunks in {time.perf_counter() - t0:.2f} s")
        proc, port = _loopback.start(2, digest=True)
        print(f"started a receiver process (pid {proc.pid}) on 127.0.0.1:{port}")
        try:
            with Sender(f"127.0.0.1:{port}") as tx:
                first = tx.send(region)
                print(f"sent it over {first.transport} ({streams(first.streams)}): {first.bytes / 1e6:.1f} MB in "
                      f"{first.seconds:.3f} s = {first.gbps:.2f} Gbps (first transfer: the receiver allocates)")
                views = region.tensors()
                for v in views.values():
                    v.view("u1")[:1] ^= 0xFF          # a "training step": change every tensor in place
                del views, v
                second = tx.send(region, verify=True)
                print(f"updated every tensor in place and sent again with --verify: {second.seconds:.3f} s = "
                      f"{second.gbps:.2f} Gbps, same receiver region (re-allocated: {second.reallocated})")
            records = _loopback.results(proc, timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        ok = len(records) == 2 and records[1]["digests"] == tensor_checksums(region)
    print(f"receiver's per-tensor xxh3 digests match the sender's: {ok}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    from tensorxfer.cli.common import SIZE_HELP, byte_size, new_parser

    parser = new_parser("tensorxfer", __doc__ or "", exit_codes=False)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="send a synthetic 820-tensor model to another process over loopback")
    p.add_argument("--size", default=256 << 20, type=byte_size, metavar="SIZE",
                   help=f"model bytes (default 256MiB; {SIZE_HELP})")
    p.set_defaults(func=demo)
    from tensorxfer.cli import doctor, sync_status

    doctor.add_parser(sub)
    sync_status.add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
