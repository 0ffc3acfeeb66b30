"""``tensorxfer sync-status STORE GROUP``: a weight sync group as its store holds it.

Lists the live members (role, rank, address), the newest step with its membership epoch, and per rank
the plan digest it computed for that epoch and its latest report (the version it holds, whether its
last step went through, and which peers failed it).  Reads only; works while the group runs.

Given the group's token (``--token-file`` or ``$TENSORXFER_TOKEN``) every record is checked against it and the
ones that fail are left out; without it the records are shown as the store holds them, unverified.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("sync-status", help="list a weight sync group's members, epoch, plan digests and versions",
                       description=__doc__)
    p.add_argument("store", help="the group's store: etcd://HOST:PORT or tcp://HOST:PORT (a TCPStore)")
    p.add_argument("group", help="the group's name (WeightSync's group argument)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--token-file", metavar="PATH",
                   help="file holding the group's token, to check every record (default: $TENSORXFER_TOKEN)")
    p.set_defaults(func=main)


def render(status: dict[str, Any]) -> str:
    lines = [f"group {status['group']!r}: newest step {status['latest_step']}"
             + (f", epoch {status['epoch']}" if "epoch" in status else " (no step decided yet)")]
    members = status["members"]
    if "ranks" not in status:
        for role in ("source", "target"):
            for rank, rec in sorted(members[role].items()):
                lines.append(f"  {role} {rank}: registered{_address(rec)}")
        return "\n".join(lines)
    lines.append(f"  {'role':<7} {'rank':>4}  {'alive':<5} {'in step':<7} {'digest':<12}  {'version':>7}  last step")
    for r in status["ranks"]:
        rep = r["report"] or {}
        failed = ", ".join(f"{peer}: {why}" for peer, why in sorted(rep.get("failed", {}).items()))
        last = "-" if not rep else ("ok" if rep["ok"] else "failed" + (f" ({failed})" if failed else ""))
        rec = members[r["role"]].get(r["rank"])
        lines.append(f"  {r['role']:<7} {r['rank']:>4}  {'yes' if r['alive'] else 'no':<5} "
                     f"{'yes' if r['in_step'] else 'no':<7} {(r['digest'] or '-')[:12]:<12}  "
                     f"{rep.get('version', '-')!s:>7}  {last}{_address(rec) if rec else ''}")
    if not status.get("verified"):
        lines.append("  (records not verified: give the group's token to check them)")
    return "\n".join(lines)


def _address(rec: dict[str, Any]) -> str:
    where = rec.get("address")
    return f"  at {where[0]}:{where[1]}" if where else ""


def main(args: argparse.Namespace) -> int:
    from tensorxfer.cli.common import read_token
    from tensorxfer.protocol import token_key
    from tensorxfer.sync.membership import group_status
    from tensorxfer.sync.rendezvous import connect

    key = token_key(read_token(args))
    rdv = connect(args.store)
    try:
        status = group_status(rdv, args.group, key)
    finally:
        rdv.close()
    print(json.dumps(status, indent=2, default=str) if args.json else render(status))
    return 0
