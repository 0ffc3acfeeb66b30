"""``tensorxfer-send SRC... --to HOST:PORT``: send safetensors files or model directories.

Every file goes in one region, one transfer; the receiver
(``tensorxfer-recv``) writes byte-identical files.  Exit codes are listed
in :mod:`tensorxfer.cli.common`.
"""

from __future__ import annotations

import argparse
import json
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

PROG = "tensorxfer-send"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="+", metavar="SRC", help="safetensors files or model directories")
    p.add_argument("--to", required=True, metavar="HOST:PORT", help="the receiver's address")
    p.add_argument("--streams", type=int, default=None, help="parallel data streams (default: measured default)")
    add_common(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format=f"{PROG}: %(message)s")
    from tensorxfer import Sender, TensorXferError
    from tensorxfer.safetensors_io import FILES_KEY, load_files

    try:
        token = read_token(args)
        with load_files(args.sources, device=args.device) as region:
            files = len(json.loads(region.manifest.metadata[FILES_KEY]))
            with Sender(args.to, token=token, transport=args.transport, streams=args.streams,
                        stall_timeout=args.stall_timeout) as sender:
                bar = Progress(region.nbytes, "send", enabled=not args.quiet and not args.json)
                try:
                    stats = sender.send(region, verify=args.verify, progress=bar).as_dict()
                finally:
                    bar.finish()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except (TensorXferError, OSError, ValueError) as e:
        return report_error(PROG, e, args.json)
    if args.json:
        emit_json({"event": "sent", "files": files, "tensors": len(region.manifest), **stats})
    elif not args.quiet:
        print(summary("sent", stats, f"; {files} files, {len(region.manifest)} tensors"))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
