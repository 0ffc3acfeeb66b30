"""``tensorxfer doctor``'s first answer: which transports (and GPU regions) this machine can use, and for
each one it cannot, the one line that fixes it.

The verdict for a transport is the one a transfer would reach (:func:`tensorxfer.transport.unavailable_reason`,
what ``transport="auto"`` consults); the fix comes from the finer report :func:`tensorxfer.cli.doctor.collect`
already made (the verbs module, libibverbs, devices, ports; the CUDA module, cuda-bindings, the driver), so
a wheel installed on a machine without rdma-core is told to install rdma-core, not to rebuild anything.
"""

from __future__ import annotations

from typing import Any

#: the verbs module ships in every wheel; only a source build without libibverbs-dev lacks it
_BUILD_VERBS = ("install a tensorxfer wheel (every wheel has the verbs module), or apt-get install libibverbs-dev "
                "and reinstall from source with TENSORXFER_NO_VERBS unset")
_NO_DEVICE = ("install the NIC's driver (mlx5_ib for ConnectX) and ibverbs-providers; without a NIC, Soft-RoCE: "
              "`modprobe rdma_rxe && rdma link add rxe0 type rxe netdev ETH`")


def _rdma_fix(rd: dict[str, Any]) -> str:
    """The one thing to do first, from the RDMA section of the report (most basic missing piece first)."""
    if not rd.get("verbs_module", {}).get("ok"):
        return _BUILD_VERBS
    library = rd.get("library", {})
    if not library.get("ok", True):
        return str(library.get("fix"))
    if not rd.get("devices"):
        return _NO_DEVICE
    if not any(p["active"] for d in rd["devices"] for p in d["ports"]):
        return "bring a port up: check the cable/switch and `rdma link`; for RoCE bring the port's netdev up"
    return "see the problems below (`tensorxfer doctor --json` has the details)"


def _ipc_fix(reason: str) -> str:
    from tensorxfer.transport.ipc.identity import DISABLE_ENV

    if reason.startswith("disabled by"):
        return f"unset {DISABLE_ENV}"
    return "ipc needs Linux with /proc, memfd and Unix sockets, and Python >= 3.9 (socket.send_fds)"


def _cuda_line(cuda: dict[str, Any]) -> dict[str, Any]:
    if cuda.get("devices"):
        names = ", ".join(f"cuda:{d['device']} {d['name']}" for d in cuda["devices"])
        return {"name": "cuda", "usable": True, "detail": f"GPU regions on {names}", "fix": None}
    if not cuda.get("module"):
        return {"name": "cuda", "usable": False, "detail": cuda.get("error", "the CUDA module does not import"),
                "fix": cuda.get("fix", "")}
    return {"name": "cuda", "usable": False, "detail": cuda.get("error", "no CUDA device is visible"),
            "fix": "install the NVIDIA driver (a GPU machine), and check CUDA_VISIBLE_DEVICES"}


def transport_lines(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per transport (tcp, ipc, rdma) and one for GPU regions (cuda):
    ``{"name", "usable", "detail", "fix"}``; ``fix`` is None where usable."""
    from tensorxfer.transport import unavailable_reason

    out = []
    for name, what in (("tcp", "any two hosts"), ("ipc", "same host, same user"), ("rdma", "RDMA NIC")):
        reason = unavailable_reason(name)
        if reason is None:
            out.append({"name": name, "usable": True, "detail": what, "fix": None})
            continue
        fix = _rdma_fix(report["rdma"]) if name == "rdma" else _ipc_fix(reason) if name == "ipc" else reason
        # a reason that ends in its own fix (libibverbs missing) is printed once, as the fix
        out.append({"name": name, "usable": False, "detail": reason.replace(f"; {fix}", ""), "fix": fix})
    out.append(_cuda_line(report["cuda"]))
    return out


def print_lines(lines: list[dict[str, Any]]) -> None:
    print("Transports on this machine")
    for t in lines:
        if t["usable"]:
            print(f"  {t['name']:<5} yes   ({t['detail']})")
        else:
            print(f"  {t['name']:<5} NO    {t['detail']}\n        fix: {t['fix']}")
