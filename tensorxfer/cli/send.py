"""tensorxfer-send SRC... --to HOST:PORT: send safetensors files or model directories.

Every file goes in one region, one transfer; the receiver (tensorxfer-recv)
writes byte-identical files.  A model directory also sends its side files
(config.json, generation_config.json, tokenizer files, the index: every
other regular top-level file, 32 MiB each and 48 MiB in all at most), so a
Hugging Face directory arrives loadable; hidden files, subdirectories and
other weight formats (.bin, .pt, ...) are left out and listed; a weight
file in another format named directly is refused (exit 2): only
safetensors files carry weights.  Exits 0 only once the receiver has
written and fsynced every file; if it cannot, the exit code is non-zero and
the message is the receiver's.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from tensorxfer.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TRANSFER,
    add_common,
    check_device,
    emit_json,
    files_record,
    new_parser,
    read_token,
    report_error,
    seconds,
    summary,
)
from tensorxfer.cli.progress import Phase, Progress, log_above
from tensorxfer.errors import UpstreamFailed
from tensorxfer.files.format import FileFormatError

PROG = "tensorxfer-send"
log = logging.getLogger(PROG)


def build_parser() -> argparse.ArgumentParser:
    from tensorxfer.transport.rdma import DEFAULT_QPS
    from tensorxfer.transport.tcp import DEFAULT_STREAMS

    p = new_parser(PROG, __doc__ or "")
    p.add_argument("sources", nargs="+", metavar="SRC", help="safetensors files or model directories")
    p.add_argument("--to", required=True, action="append", metavar="HOST:PORT",
                   help="the receiver's address; repeat it to fan out to several receivers, in chain order (each "
                        "receiver forwards to the next as the bytes land; every one must have the same token)")
    p.add_argument("--connect-timeout", type=seconds, default=10.0, metavar="S",
                   help="keep trying to reach a receiver that is not listening yet for S seconds (default 10)")
    p.add_argument("--streams", type=int, default=None, metavar="N",
                   help=f"parallel data streams (default: {DEFAULT_STREAMS} tcp streams, $TENSORXFER_TCP_STREAMS "
                        f"overrides; {DEFAULT_QPS} QPs for rdma; ipc copies with one)")
    add_common(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    bar = Progress("send", enabled=not args.quiet and not args.json)
    log_above(bar, f"{PROG}: %(message)s", logging.WARNING if args.quiet else logging.INFO)
    from tensorxfer import TensorRegion, TensorXferError
    from tensorxfer.fanout import FanoutSender
    from tensorxfer.files import discover, plan_files

    def reading(manifest: Any) -> None:
        bar.phase("reading files", sum(t.nbytes for t in manifest.tensors))

    try:
        token = read_token(args)
        check_device(args.device)
        found = discover(args.sources)
        for name, why in found.skipped:
            log.info("not sent: %s (%s)", name, why)
        if len(args.to) == 1:
            stats, region_manifest = send_while_reading(args, token, found, bar)
        else:
            with TensorRegion.from_safetensors(found, device=args.device, progress=bar, on_layout=reading) as region:
                bar.plan([Phase("setting up (connecting, preparing)"), Phase("moving data", region.nbytes, "Gbps"),
                          Phase("receiver writing the files")])
                with FanoutSender(args.to, token=token, transport=args.transport, streams=args.streams,
                                  stall_timeout=args.stall_timeout, connect_timeout=args.connect_timeout) as fan:
                    fanned = fan.send(region, verify=args.verify, progress=bar)
                stats = fanout_record(fanned)
                region_manifest = region.manifest
        bar.finish()
        files = files_record(plan_files(region_manifest), len(region_manifest))
    except KeyboardInterrupt:
        bar.finish(ok=False)
        why = ("interrupted (Ctrl-C) before the receiver confirmed the transfer: it keeps none of it (its output "
               "is written all or nothing; files of earlier transfers are untouched); run the send again")
        if args.json:
            emit_json({"event": "error", "error": "Interrupted", "message": why, "exit_code": EXIT_INTERRUPTED})
        print(f"{PROG}: {why}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except (TensorXferError, OSError, ValueError) as e:
        bar.finish(ok=False)
        return report_error(PROG, e, args.json)
    if args.json:
        emit_json({"event": "sent", **files, "skipped": [{"name": n, "reason": r} for n, r in found.skipped],
                   **stats})
    elif not args.quiet:
        if stats.get("kept_bytes"):
            print(f"{PROG}: resumed an interrupted transfer: the receiver kept {stats['kept_bytes']:,} bytes it "
                  f"already had (checked against these files); {stats['bytes']:,} bytes were sent", file=sys.stderr)
        print(summary("sent", stats, f"; {len(files['files'])} files ({len(files['tensor_files'])} safetensors, "
                                     f"{files['tensors']} tensors; side files: "
                                     f"{', '.join(files['side_files']) or 'none'})"))
        for r in stats.get("receivers", []):
            print(f"  {r['address']}: " + (f"ok, {r['bytes']:,} bytes in {r['seconds']:.3f} s over {r['transport']}"
                                           f"{', verified' if r['verified'] else ''} (from {r['via']})" if r["ok"]
                                           else f"FAILED, taken out of the chain: {r['error_type']}: {r['error']}"))
    failed = [r for r in stats.get("receivers", []) if not r["ok"]]
    if failed:
        print(f"{PROG}: {len(failed)} of {len(stats['receivers'])} receivers failed: "
              + "; ".join(f"{r['address']} ({r['error_type']})" for r in failed), file=sys.stderr)
        return EXIT_TRANSFER
    return EXIT_OK


def send_while_reading(args: argparse.Namespace, token: Any, found: Any, bar: Progress) -> tuple[dict[str, Any], Any]:
    """One receiver: send the files.  From a host, over tcp or ipc, the region *is* the files (mapped
    read-only, :func:`files_path`): over tcp the kernel sends from the page cache, over ipc the receiver is
    passed the files themselves and copies them into its output in the kernel, as ``cp`` does; nothing is
    read into memory of this process.  Otherwise each byte goes as soon as it was read (the loader is the
    send's ``landing``).  Returns the stats and the manifest."""
    from tensorxfer import Sender, TensorRegion
    from tensorxfer.cli.resume import SourcePieces
    from tensorxfer.files import load
    from tensorxfer.files.mapped import changed_files, map_sources, mirror
    from tensorxfer.session.hooks import ForwardHooks

    plan = load.plan_load(found)
    # setting up ends with the first bytes on the wire, the data phase with the last (its rate, when the files
    # are read meanwhile, is the slower of the disk and the wire); then the receiver syncs the files
    data = Phase("moving data", plan.manifest.nbytes, "Gbps")
    bar.plan([Phase("setting up (connecting, preparing)"), data, Phase("receiver writing the files")])
    with Sender(args.to[0], token=token, transport=args.transport, streams=args.streams,
                stall_timeout=args.stall_timeout, connect_timeout=args.connect_timeout) as sender:
        path = files_path(args, sender)
        mirrored = mirror(plan) if path else None
        if path and mirrored is None:
            log.info("%s: the files place a tensor less aligned than its element size, so the region cannot be "
                     "the files: reading them into memory", sender.transport)
        if mirrored is not None:
            plan, bases = mirrored
            region = map_sources(plan, bases, keep_files=path == "passed")
            try:
                stats = sender.send(region, verify=args.verify, progress=bar,
                                    pieces=SourcePieces(plan, log, bar.moving)).as_dict()
            except BaseException:
                changed = changed_files(plan)
                if changed:
                    raise FileFormatError(f"{changed[0]}: shrank or grew while being sent; send it again once it "
                                          f"is written") from None
                raise
            finally:
                region.close()
            return {**stats, "read": path}, region.manifest
        data.name = "reading and moving data"       # not drawn yet: it starts with the first bytes sent
        # A region no ipc receiver maps lives in this process's own memory, on huge pages: reading into it and
        # freeing it at exit cost a fraction of memfd pages (0.35 s to free 2 GB otherwise).
        region, loader = TensorRegion.for_safetensors(plan, device=args.device, private=sender.transport != "ipc")
        try:
            loader.start()
            try:
                stats = sender.send(region, verify=args.verify, progress=bar,
                                    forward=ForwardHooks(landing=loader, loading=True),
                                    pieces=SourcePieces(plan, log, bar.moving)).as_dict()
            except BaseException as e:
                read_error = loader.abandon()       # the readers stop before the region is closed
                if isinstance(e, UpstreamFailed) and read_error is not None:
                    raise read_error from None      # the files failed, not the receiver: say so
                raise
            loader.join()
            return {**stats, "read": "while sending"}, region.manifest
        finally:
            region.close()


def files_path(args: argparse.Namespace, sender: Any) -> str | None:
    """How a single send reads its files without a copy in this process, logged with the reason: ``mapped``
    (tcp: the kernel sends from the files mapped), ``passed`` (ipc: the receiver on this host is passed the
    files and copies them into its output with copy_file_range, one copy in the kernel as ``cp -r`` makes;
    measured on the 2-core dev VM with a 2 GB, 8-file model, benchmarks/results/2026-12-06-cli-files/, it is
    the fastest path there, where reading the files into shared memory for ipc's memory copy was the
    slowest), or None: the files are read into memory while they are sent (a GPU region; --verify, which
    hashes every byte here; rdma, whose NIC reads registered memory; a receiver whose ipc takes no files).
    Only the kernel reads the mapped files (a send, a copy_file_range, a pread): a file cut short meanwhile
    fails the send, where a read of the mapping in this process would die of SIGBUS."""
    if args.device != "cpu" or args.verify:
        if sender.transport in ("tcp", "ipc"):
            log.info("%s: %s, so the files are read into memory while they are sent", sender.transport,
                     "--verify hashes every byte here" if args.verify else f"the region is on {args.device}")
        return None
    if sender.transport == "tcp":
        return "mapped"
    if sender.transport == "ipc":
        if sender.peer_caps.get("files") is True:
            log.info("ipc: the receiver is on this host: it is passed the files themselves and copies them into "
                     "its output in the kernel (copy_file_range: one copy, as cp makes)")
            return "passed"
        log.info("ipc: the receiver (an older tensorxfer) cannot take the files themselves: reading them into "
                 "memory for it to copy")
    return None


def fanout_record(fanned: Any) -> dict[str, Any]:
    """A fan-out's FanoutStats in the shape of a single send's stats, plus the chain and every receiver."""
    head = fanned.head.as_dict() if fanned.head is not None else {}
    record = fanned.as_dict()
    return {**head, "bytes": fanned.bytes, "seconds": fanned.seconds, "gbps": fanned.gbps,
            "transport": head.get("transport", ""), "streams": head.get("streams", 0),
            "verified": all(r.verified for r in fanned.receivers if r.ok) and any(r.ok for r in fanned.receivers),
            "chain": record["chain"], "piece_bytes": record["piece_bytes"], "version": record["version"],
            "receivers": record["receivers"]}


if __name__ == "__main__":
    sys.exit(main())
