"""tensorxfer-recv --listen HOST:PORT --out DIR: receive files sent by tensorxfer-send.

Writes the same files, byte-identical and with the sender's permission bits
(masked by the umask; never setuid/setgid/sticky), into DIR, all or
nothing: every name and target is checked first, each file is written under
a temporary name, fsynced, and renamed only after the whole transfer arrived
(and, with --verify on the sender, was checked); if a rename fails the
files already renamed are rolled back.  The sender is acknowledged only
after that, so its exit code says whether the files were written.  File
names from the peer are untrusted: anything but a plain, printable name
inside DIR is refused.  DIR is created if missing and checked at
start; one tensorxfer-recv at a time may write into it, and the
.tensorxfer-*.part files a killed one left behind are removed.  An
offer is refused before any data moves when DIR has no room for its
files, or holds another model's files (weights, index, config, tokenizer
files) that the new model does not replace, unless --overwrite.  Binds
127.0.0.1 unless --listen names another address; listening beyond
loopback without a token prints a warning.

Without --once it keeps serving senders one after another, reporting
failed transfers and carrying on.  Connections that never become a
session — port scans, idle or trickling strangers, peers that are not
tensorxfer, wrong tokens — are dropped and counted by the Receiver (logged
with the reason) and never end --once; an authenticated sender that
leaves without an offer is reported as dropped and does not end it
either.  In a fan-out chain, an update lost because the relay feeding
this receiver died or stalled does not end --once either: the hop
before that relay sends the update again.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import ipaddress
import logging
import os
import sys
from pathlib import Path
from typing import Any

from tensorxfer.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    SIZE_HELP,
    add_common,
    byte_size,
    check_device,
    emit_json,
    files_record,
    mem_available,
    new_parser,
    read_token,
    report_error,
    summary,
)
from tensorxfer.cli.progress import Phase, Progress, log_above
from tensorxfer.errors import RegionError

PROG = "tensorxfer-recv"


def build_parser() -> argparse.ArgumentParser:
    p = new_parser(PROG, __doc__ or "")
    p.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="address to listen on (default 127.0.0.1 and a free port, printed at start)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write the received files into")
    p.add_argument("--once", action="store_true", help="exit after one transfer (its exit code)")
    p.add_argument("--overwrite", action="store_true",
                   help="let a transfer replace another model in --out: its model files (weights, index, config, "
                        "tokenizer files) that the new model does not have are removed once the new files are in "
                        "place, all or nothing (without it such a transfer is refused)")
    p.add_argument("--no-relay", action="store_true",
                   help="refuse to forward fan-out updates to the next receivers a sender names (with a token, "
                        "forwarding is allowed by default; without one it is always refused)")
    p.add_argument("--no-resume", action="store_true",
                   help="do not keep an interrupted transfer's partial output: by default its temporary files and a "
                        "journal of their verified pieces stay in DIR (hidden .tensorxfer-* files), and a sender "
                        "offering the same files again sends only what is missing; with this flag they are removed "
                        "at start and whenever a transfer fails, and every transfer moves every byte")
    p.add_argument("--max-bytes", type=byte_size, default=None, metavar="SIZE",
                   help=f"refuse offers larger than this ({SIZE_HELP}; default: half of this machine's memory, "
                        f"or of the GPU's with --device cuda:N)")
    add_common(p)
    return p


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def claim_output_dir(out: str, resume: bool = True) -> tuple[Path, int]:
    """Create/check ``out``, lock it against a second tensorxfer-recv, and remove a killed one's leftovers --
    except, with ``resume``, the temporary files a trusted resume journal names (see :func:`held_journal`).

    Returns the resolved directory and the locked fd (held for the life of the process).

    Raises
    ------
    OutputError
        ``out`` is not a directory or cannot be created.
    ValueError
        Another tensorxfer-recv is writing into it.
    """
    from tensorxfer.files import check_output_dir, clean_leftovers

    real = check_output_dir(out)
    fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"another tensorxfer-recv is writing into {real}; pick another --out") from None
    removed, backups = clean_leftovers(real, held_journal(real, resume))
    for p in removed:
        logging.getLogger(PROG).info("removed %s, left behind by an interrupted receiver", p.name)
    for p in backups:
        logging.getLogger(PROG).warning("kept %s: the previous content of a file an interrupted receiver was "
                                        "replacing; check it and remove it", p)
    return real, fd


def held_journal(real: Path, resume: bool) -> frozenset[str]:
    """The temporary files the resume journal in ``real`` names, if it is trusted and ``resume``; a journal
    that is not (malformed, edited, another version) is removed, saying why."""
    from tensorxfer.files.journal import JournalError, read_journal, remove_journal
    from tensorxfer.files.pieces import PIECE_BYTES

    log = logging.getLogger(PROG)
    if not resume:
        if remove_journal(real):
            log.info("--no-resume: removed the partial output an interrupted transfer left in %s", real)
        return frozenset()
    try:
        journal = read_journal(real, PIECE_BYTES)
    except JournalError as e:
        remove_journal(real)
        log.warning("discarded the resume journal in %s: %s; the partial output it described is removed and the "
                    "next transfer sends every byte", real, e)
        return frozenset()
    if journal is None:
        return frozenset()
    for note in journal.notes:
        log.warning("resume journal in %s: %s", real, note)
    held = sum(1 for _ in journal.pieces)
    log.info("kept the partial output of an interrupted transfer in %s (%d verified pieces of %d files); a sender "
             "offering the same files again sends only the rest", real, held, len(journal.files))
    return frozenset(f.temp for f in journal.files)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    bar = Progress("recv", enabled=not args.quiet and not args.json)
    log_above(bar, f"{PROG}: %(message)s", logging.WARNING if args.quiet else logging.INFO)
    from tensorxfer import Receiver, TensorXferError
    from tensorxfer.protocol import parse_address

    try:
        token = read_token(args)
        host, port = parse_address(args.listen)
        check_device(args.device)
        _, lock_fd = claim_output_dir(args.out, resume=not args.no_resume and args.device == "cpu")
    except (TensorXferError, OSError, ValueError) as e:
        # an --out that cannot be used is bad usage, found before anyone connects
        return report_error(PROG, e, args.json, EXIT_USAGE if isinstance(e, OSError) else None)
    try:
        limit = args.max_bytes
        # one-shot: the region's pages are committed by the receiving threads as the data lands (overlapped
        # with the network), not all before accepting; on_offer checks the memory is there.  Private memory:
        # a host region on huge pages fills and frees at a fraction of memfd pages' cost (0.35 s for 2 GB at
        # exit otherwise); nothing here passes it on over ipc (a relay's region stays shareable)
        rx = Receiver(args.listen, token=token, device=args.device, max_region_bytes=limit,
                      stall_timeout=args.stall_timeout, relay=False if args.no_relay else None,
                      require_verify=args.verify, prefault=False, private_memory=True)
    except OSError as e:
        os.close(lock_fd)
        if isinstance(e, TensorXferError):
            return report_error(PROG, e, args.json)
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        msg = f"cannot listen on {where}: {e.strerror or e}"
        if args.json:
            emit_json({"event": "error", "error": type(e).__name__, "message": msg, "exit_code": EXIT_UNAVAILABLE})
        print(f"{PROG}: {type(e).__name__}: {msg}", file=sys.stderr)      # strerror carries the errno's hint
        return EXIT_UNAVAILABLE
    except (TensorXferError, ValueError) as e:
        os.close(lock_fd)
        return report_error(PROG, e, args.json)
    with rx:
        try:
            return serve(args, rx, token is not None, host, bar)
        finally:
            os.close(lock_fd)


class _Transfer:
    """One receive: its progress bar, whether an offer came, and the files -- written while the bytes land
    (host regions), finished and renamed into place once all landed."""

    def __init__(self, args: argparse.Namespace, bar: Progress) -> None:
        self.args = args
        self.bar = bar
        self.offered = False
        self.written: list[Path] = []
        self.removed: list[Path] = []
        self.files: dict[str, Any] = {}
        self.writer: Any = None
        self.partial: Any = None        # the partial output this transfer resumes and journals (PartialOutput)
        self.held: Any = None           # the session's holder (cli.resume.HeldOutput), with resume on

    def on_offer(self, manifest: Any) -> None:
        from tensorxfer.files import ModelWriter, plan_files

        self.offered = True
        self.bar.start(manifest)
        self.abort()        # an earlier offer of this receive that failed after its offer
        available = mem_available()
        if self.args.device == "cpu" and available and manifest.nbytes > available:
            raise RegionError(errno.ENOMEM, f"the model needs {manifest.nbytes:,} bytes of host memory to "
                                            f"arrive in; {available:,} are available here (MemAvailable)")
        # refused before anything is allocated or moves: a hostile or unusable file layout, another model's
        # files in --out (unless --overwrite), a disk without room for the files
        plans = plan_files(manifest)
        partial = self._partial_output(manifest, plans)
        self.writer = ModelWriter(manifest, self.args.out, overwrite=self.args.overwrite, progress=self.bar,
                                  check_space=True, reuse=partial.reuse if partial else None,
                                  on_written=partial.written if partial else None)
        if partial is not None:
            from tensorxfer.cli.resume import HeldOutput

            partial.attach(self.writer)
            self.partial, self.held = partial, HeldOutput(partial, self._report_resume, self.bar.moving)
        self.removed = self.writer.others
        self.files = files_record(plans, len(manifest))

    def _partial_output(self, manifest: Any, plans: Any) -> Any:
        """What an interrupted transfer left in --out, matched against this offer (None: resume is off)."""
        from tensorxfer.files import check_output_dir, clean_leftovers
        from tensorxfer.files.journal import JournalError, read_journal, remove_journal
        from tensorxfer.files.pieces import PIECE_BYTES
        from tensorxfer.files.resume import PartialOutput

        if self.args.no_resume or self.args.device != "cpu":
            return None
        out = check_output_dir(self.args.out)
        try:
            journal = read_journal(out, PIECE_BYTES)
        except JournalError as e:
            remove_journal(out)
            clean_leftovers(out)        # the temporary files it named: no writer is open here
            logging.getLogger(PROG).warning("discarded the resume journal in %s: %s; this transfer sends every "
                                            "byte", out, e)
            journal = None
        return PartialOutput(out, manifest, plans, journal)

    # the session's holder (session.partial): known only once the offer came, so this receive delegates
    def claim(self, region: Any) -> tuple[list[int], list[int]]:
        return self.held.claim(region) if self.held is not None else ([], [])

    def keep(self, region: Any, confirmed: list[int]) -> Any:
        return self.held.keep(region, confirmed) if self.held is not None else None

    def _report_resume(self, record: dict[str, Any]) -> None:
        """Say what this transfer kept from an interrupted one, and what it discarded and why."""
        if self.args.json:
            emit_json({"event": "resume", **record})
        if not self.args.quiet:
            log = logging.getLogger(PROG)
            if record["kept_pieces"]:
                log.info("resuming an interrupted transfer: kept %d pieces (%s bytes) its journal, its temporary "
                         "files and the sender's source agree on; only the rest is sent",
                         record["kept_pieces"], f"{record['kept_bytes']:,}")
            for d in record["discarded"]:
                log.info("discarded the partial output of %s (%s bytes): %s", d["name"], f"{d['bytes']:,}",
                         d["reason"])

    def on_piece(self, region: Any, offset: int, length: int) -> None:
        if self.writer is not None:
            self.writer.land(region, offset, length)

    def on_files(self, files: Any, report: Any) -> None:
        # a sender on this host passed its files (ipc): copied straight into the temporary files, in the
        # kernel; the region stays unwritten and finish() below only fsyncs and renames
        if self.writer is not None:
            self.writer.copy_files(files, report)

    def on_landed(self, region: Any) -> None:
        # what did not reach the disk while landing, then the last fsync, the renames and the directory's fsync
        self.bar.plan([Phase("writing files", self.files["file_bytes"]), Phase("syncing, renaming into place")])
        writer, self.writer = self.writer, None
        partial, self.partial = self.partial, None
        if partial is not None:
            partial.suspend()       # journaling ends before the writer closes its files (killed here: resumable)
        # before the ack: the sender learns if this fails
        try:
            self.written = writer.finish(region)
        finally:
            if partial is not None:
                partial.close()     # in place, or failed for good (finish removed the temporary files)
        self.files["written_while_landing"] = writer.written_while_landing

    def abort(self, error: BaseException | None = None) -> None:
        """The update failed: its temporary files go -- unless it was interrupted (the sender or the link
        was lost, or Ctrl-C) and resume is on: then what landed is journaled and kept for the next run."""
        from tensorxfer.errors import LinkDropped, PeerLost, TransferTimeout, UpstreamFailed

        writer, self.writer = self.writer, None
        partial, self.partial = self.partial, None
        interrupted = isinstance(error, (PeerLost, TransferTimeout, LinkDropped, UpstreamFailed, KeyboardInterrupt))
        if writer is None:
            return
        if partial is None or not interrupted:
            writer.abort()
            if partial is not None:
                partial.close()
            return
        try:
            writer.drain()          # every landed range into the files, then journaled
            partial.suspend()
        except OSError as e:
            logging.getLogger(PROG).warning("could not journal the partial output (%s): it is removed", e)
            writer.abort()
            partial.close()
            return
        writer.abort(keep=True)
        if self.args.json:
            emit_json({"event": "partial_kept", "bytes": partial.journaled_bytes})
        if not self.args.quiet:
            logging.getLogger(PROG).warning(
                "kept %s bytes of this interrupted transfer in %s (hidden .tensorxfer-* files and a journal): "
                "send the same files again to this --out and only the rest moves (--no-resume drops them)",
                f"{partial.journaled_bytes:,}", self.args.out)


def upstream_failed(rx: Any, e: BaseException) -> bool:
    """Whether a failed transfer was lost by the fan-out relay feeding this receiver (it died, stalled or
    gave up), not by this receiver: then the chain is repaired and the update comes again."""
    from tensorxfer.errors import PeerLost, TransferTimeout, UpstreamFailed

    return isinstance(e, UpstreamFailed) or (rx.fed_by_relay and isinstance(e, (PeerLost, TransferTimeout)))


def serve(args: argparse.Namespace, rx: Any, has_token: bool, host: str, bar: Progress) -> int:
    """Receive transfers until ``--once`` is satisfied or Ctrl-C; returns the exit code."""
    from tensorxfer import TensorXferError

    if not has_token and not is_loopback(host):
        print(f"{PROG}: WARNING: listening on {host} without a token: anyone who can reach this port can "
              f"write files into {args.out}; use --token-file", file=sys.stderr)
    lhost, lport = rx.address
    if args.json:
        emit_json({"event": "listening", "host": lhost, "port": lport})
    if not args.quiet:          # (--json gives the address to scripts)
        print(f"{PROG}: listening on {lhost}:{lport}", file=sys.stderr, flush=True)
    while True:
        t = _Transfer(args, bar)
        try:
            rx.receive(progress=bar, on_offer=t.on_offer, on_landed=t.on_landed, on_piece=t.on_piece,
                       held=t, on_files=t.on_files)
            bar.finish()
        except KeyboardInterrupt as e:
            t.abort(e)
            bar.finish(ok=False)
            return EXIT_INTERRUPTED
        except (TensorXferError, OSError, ValueError) as e:
            t.abort(e)
            bar.finish(ok=False)
            if not t.offered:
                # An authenticated sender that made no offer.  Not a transfer; never ends --once.
                if args.json:
                    emit_json({"event": "dropped", "error": type(e).__name__, "message": str(e)})
                if not args.quiet:
                    print(f"{PROG}: dropped a connection that made no offer ({type(e).__name__}: {e})",
                          file=sys.stderr, flush=True)
                continue
            if args.once and upstream_failed(rx, e):
                # The relay feeding this receiver died or stalled: the hop before it takes it out of the
                # chain and sends the update here again.  Exiting would make this receiver fail too.
                if args.json:
                    emit_json({"event": "upstream_failed", "error": type(e).__name__, "message": str(e)})
                if not args.quiet:
                    print(f"{PROG}: the relay feeding this receiver failed ({type(e).__name__}: {e}); waiting for "
                          f"the repaired chain to send the update again", file=sys.stderr, flush=True)
                continue
            code = report_error(PROG, e, args.json)
            if args.once:
                return code
            continue
        assert rx.last_stats is not None
        stats = rx.last_stats.as_dict()
        if args.json:
            emit_json({"event": "received", "out": str(Path(args.out)), **t.files,
                       "removed": [p.name for p in t.removed], **stats})
        elif not args.quiet:
            gone = f"; removed the previous model's {', '.join(p.name for p in t.removed)}" if t.removed else ""
            print(summary("received", stats, f"; wrote {len(t.written)} files to {args.out}{gone}"), flush=True)
        if args.once:
            return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
