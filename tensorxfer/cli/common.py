"""What tensorxfer-send and tensorxfer-recv share: flags, tokens, exit codes, progress, summaries.

The exit codes are :data:`EXIT_CODES_HELP` (shown by --help; docs/cli.md gives the same
table).  Help texts are plain text: they are read in a terminal, not rendered.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from tensorxfer.errors import (
    AuthError,
    CudaError,
    ManifestError,
    ProtocolError,
    TensorXferError,
    TransportUnavailable,
)
from tensorxfer.session import control

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12}
SIZE_HELP = "bytes, or with a unit: 512MiB, 1G (= 1GiB, 1024**3, as dd reads it), 1GB (10**9), 2e9"


def byte_size(text: str) -> int:
    """A byte count as people type it (``--max-bytes 1G``): a number (``2e9`` too) with an optional unit,
    K/M/G/T and KiB/MiB/GiB/TiB binary, KB/MB/GB/TB decimal; argparse's error (naming the forms) otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give {SIZE_HELP}")
    value = float(match.group(1)) * _UNITS[unit]
    if not 0 <= value < 2 ** 63:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range")
    return int(value)


EXIT_OK, EXIT_TRANSFER, EXIT_USAGE, EXIT_AUTH, EXIT_UNAVAILABLE, EXIT_PROTOCOL, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 5, 130
TOKEN_ENV = "TENSORXFER_TOKEN"
EXIT_CODES_HELP = """\
exit codes:
  0    success (send: the receiver wrote every file)
  1    the transfer failed: peer lost (or no receiver listening at --to within --connect-timeout),
       stalled, checksum mismatch, refused (e.g. --out holds
       another model's files and no --overwrite, or has no room), or the receiver could not
       write the files
  2    bad usage or input: arguments, malformed or unsafe files or names, a weight format
       other than safetensors, an --out that is not a usable directory or is in use
  3    authentication failed (wrong or missing token)
  4    the transport, device or listen address is not available (port in use, address not
       of this host, port below 1024 without privileges, no GPU for --device cuda:N)
  5    protocol error (the peer speaks another version, or garbage)
  130  interrupted (Ctrl-C)
"""


def seconds(text: str) -> float:
    """An argparse type: seconds > 0, as the API checks them (:func:`tensorxfer.session.control.seconds`;
    argparse names the flag in its error)."""
    try:
        return control.seconds(value=float(text))[0]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None


def new_parser(prog: str, description: str, exit_codes: bool = True) -> argparse.ArgumentParser:
    """An argument parser that shows ``description`` as written (plain text), the exit codes after the
    options, and answers ``--version``."""
    from tensorxfer import __version__

    p = argparse.ArgumentParser(prog=prog, description=description, epilog=EXIT_CODES_HELP if exit_codes else None,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"{prog} {__version__}")
    return p


def exit_code(error: BaseException) -> int:
    """The documented exit code for an error."""
    if isinstance(error, AuthError):
        return EXIT_AUTH
    if isinstance(error, (TransportUnavailable, CudaError)):
        return EXIT_UNAVAILABLE
    if isinstance(error, ProtocolError):
        return EXIT_PROTOCOL
    if isinstance(error, ManifestError):
        return EXIT_TRANSFER       # the receiver refused the offer
    if isinstance(error, (ValueError, FileNotFoundError, IsADirectoryError, PermissionError)):
        return EXIT_USAGE
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return EXIT_TRANSFER


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", metavar="PATH",
                   help=f"file holding the shared token (default: ${TOKEN_ENV}; none: no authentication)")
    p.add_argument("--transport", default="auto", help="auto (default), ipc, rdma or tcp; forced: never falls back")
    p.add_argument("--device", default="cpu",
                   help="where the region lives: cpu (default) or cuda:N (files are staged through pinned memory)")
    p.add_argument("--stall-timeout", type=seconds, default=30.0, metavar="S",
                   help="fail when no data moves for S seconds (default 30)")
    p.add_argument("--verify", action="store_true",
                   help="send: per-tensor xxh3_64 checksums, checked by the receiver; recv: accept only senders "
                        "that send them (others are refused before any byte moves)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON lines on stdout")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar and no summary line (recv: nor its 'listening on' line; --json gives the "
                        "address)")


def check_device(device: str) -> None:
    """Fail at start, not at the first transfer, when ``device`` cannot be used here.

    Raises
    ------
    ValueError
        Not ``cpu``, ``cuda`` or ``cuda:N``.
    CudaError
        A GPU was asked for and this machine has no usable one (exit code 4).
    """
    from tensorxfer.region import parse_device

    kind, index = parse_device(device)
    if kind != "cuda":
        return
    from tensorxfer import memory

    if memory.CudaRegion is None:
        raise CudaError(f"--device {device}: {memory.CUDA_UNAVAILABLE}; use --device cpu")
    from tensorxfer.memory import _cuda

    try:
        count = _cuda.device_count()
    except CudaError as e:                # no driver: say which flag asked for it
        raise CudaError(f"--device {device}: {e}") from None
    if index >= count:
        raise CudaError(f"--device {device}: this machine has {count} CUDA device(s); use cuda:0..cuda:{count - 1} "
                        f"or --device cpu")


def read_token(args: argparse.Namespace) -> str | None:
    """The token from ``--token-file`` or ``$TENSORXFER_TOKEN`` (never from the command line).

    Raises
    ------
    ValueError
        The token file is unreadable or empty.
    """
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise ValueError(f"cannot read --token-file: {e}") from None
        if not token:
            raise ValueError(f"--token-file {args.token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def streams(n: int) -> str:
    return f"{n} stream" if n == 1 else f"{n} streams"


def summary(verb: str, stats: dict[str, Any], extra: str = "") -> str:
    """One line for a person: offer to ack (everything), then the data phase's own rate when measured."""
    wire = (f"; on the wire {stats['wire_seconds']:.3f} s = {stats['wire_gbps']:.2f} Gbps"
            if stats.get("wire_seconds") else "")
    return (f"{verb} {stats['bytes']:,} bytes in {stats['seconds']:.3f} s = {stats['gbps']:.2f} Gbps over "
            f"{stats['transport']} ({streams(stats['streams'])}){', verified' if stats['verified'] else ''}{wire}"
            f"{extra}")


def files_record(plans: Sequence[Any], tensors: int) -> dict[str, Any]:
    """What a transfer's files are (``plans``: :func:`tensorxfer.files.plan_files` of its manifest), the same
    for the sender's and the receiver's ``--json`` record: names relative to the model directory (``files``,
    ``tensor_files``, ``side_files``), ``tensors``, and ``file_bytes`` (the files' sizes; ``bytes`` in the
    stats is the payload that moved)."""
    return {"files": [fp.name for fp in plans],
            "tensor_files": [fp.name for fp in plans if fp.kind == "safetensors"],
            "side_files": [fp.name for fp in plans if fp.kind != "safetensors"],
            "tensors": tensors, "file_bytes": sum(fp.size for fp in plans)}


def emit_json(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def report_error(prog: str, error: BaseException, as_json: bool, code: int | None = None) -> int:
    """Print (and with ``--json`` emit) an error; returns its exit code (``code`` overrides the default)."""
    code = exit_code(error) if code is None else code
    if as_json:
        emit_json({"event": "error", "error": type(error).__name__, "message": str(error), "exit_code": code})
    print(f"{prog}: {type(error).__name__}: {error}", file=sys.stderr)
    return code


__all__ = ["EXIT_CODES_HELP", "EXIT_OK", "TensorXferError", "add_common", "check_device", "exit_code", "files_record",
           "new_parser", "read_token", "report_error", "summary"]


def mem_available() -> int:
    """MemAvailable from /proc/meminfo in bytes (0 if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass   # not Linux: the caller skips the check
    return 0
