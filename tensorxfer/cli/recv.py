"""``tensorxfer-recv --listen HOST:PORT --out DIR``: receive files sent by ``tensorxfer-send``.

Writes the same files, byte-identical, into ``DIR``: each under a temporary
name, fsynced, and renamed only after the whole transfer arrived (and, with
``--verify`` on the sender, was checked).  A failed transfer writes nothing.
File names from the peer are untrusted: anything but a plain name inside
``DIR`` is refused.  Binds 127.0.0.1 unless ``--listen`` names another
address; listening beyond loopback without a token prints a warning.

Without ``--once`` it keeps serving senders one after another, reporting
failed transfers and carrying on.  Exit codes are listed in
:mod:`tensorxfer.cli.common`.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys

from tensorxfer.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    Progress,
    add_common,
    emit_json,
    read_token,
    report_error,
    summary,
)

PROG = "tensorxfer-recv"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="address to listen on (default 127.0.0.1 and a free port, printed at start)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write the received files into")
    p.add_argument("--once", action="store_true", help="exit after one transfer (its exit code)")
    p.add_argument("--max-bytes", type=float, default=float(1 << 40),
                   help="refuse offers larger than this many bytes (default 1 TiB)")
    add_common(p)
    return p


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format=f"{PROG}: %(message)s")
    from tensorxfer import Receiver, TensorXferError
    from tensorxfer.protocol import parse_address
    from tensorxfer.safetensors_io import write_files

    try:
        token = read_token(args)
        host, _ = parse_address(args.listen)
        rx = Receiver(args.listen, token=token, device=args.device, max_region_bytes=int(args.max_bytes),
                      stall_timeout=args.stall_timeout)
    except (TensorXferError, OSError, ValueError) as e:
        return report_error(PROG, e, args.json)
    with rx:
        if token is None and not is_loopback(host):
            print(f"{PROG}: WARNING: listening on {host} without a token: anyone who can reach this port can "
                  f"write files into {args.out}; use --token-file", file=sys.stderr)
        lhost, lport = rx.address
        if args.json:
            emit_json({"event": "listening", "host": lhost, "port": lport})
        print(f"{PROG}: listening on {lhost}:{lport}", file=sys.stderr, flush=True)
        while True:
            bar = Progress(0, "recv", enabled=not args.quiet and not args.json)
            try:
                region = rx.receive(progress=bar, on_offer=bar.start)
                bar.finish()
                paths = write_files(region, args.out)
            except KeyboardInterrupt:
                return EXIT_INTERRUPTED
            except (TensorXferError, OSError, ValueError) as e:
                bar.finish()
                code = report_error(PROG, e, args.json)
                if args.once:
                    return code
                continue
            assert rx.last_stats is not None
            stats = rx.last_stats.as_dict()
            if args.json:
                emit_json({"event": "received", "files": [str(p) for p in paths], **stats})
            elif not args.quiet:
                print(summary("received", stats, f"; wrote {len(paths)} files to {args.out}"), flush=True)
            if args.once:
                return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
