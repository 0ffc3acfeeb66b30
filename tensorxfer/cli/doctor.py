"""``tensorxfer doctor``: what this machine can do for transfers, and why not.

First the verdict (doctor_transports.py): tcp, ipc, rdma and GPU regions, usable or not, each missing
one with the line that fixes it (a wheel on a machine without rdma-core: install rdma-core).

RDMA: devices, ports (state, link layer, MTU, LID), GID tables, whether an MR
over a multi-handle region registers, whether a dmabuf MR registers.  Device
and port discovery goes through pyverbs when this interpreter can import it
(rdma-core's own bindings: an independent view), otherwise through
tensorxfer's Cython verbs module.  CUDA: whether the CUDA module imports;
:func:`cuda_report` asks the CUDA module for the driver and each device's VMM, IPC handle, dmabuf and
GPUDirect-RDMA-with-VMM support.

Every missing piece is reported with what it means and how to fix it.
``--json`` prints the same as one JSON document.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib
import ipaddress
import json
import os
import struct
from typing import Any

from tensorxfer.cli.doctor_transports import print_lines, transport_lines

Problem = dict[str, str]


def _problem(what: str, means: str, fix: str) -> Problem:
    return {"what": what, "means": means, "fix": fix}


def _gid_str(raw: bytes) -> str:
    return str(ipaddress.IPv6Address(raw))


def _devices_pyverbs(pyverbs: Any) -> list[dict[str, Any]]:
    from pyverbs import device as pd_device
    from pyverbs import enums as e

    states = {e.IBV_PORT_ACTIVE: "active", e.IBV_PORT_DOWN: "down", e.IBV_PORT_INIT: "init",
              e.IBV_PORT_ARMED: "armed"}
    layers = {e.IBV_LINK_LAYER_ETHERNET: "Ethernet", e.IBV_LINK_LAYER_INFINIBAND: "InfiniBand"}
    out = []
    for dev in pd_device.get_device_list():
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        with pd_device.Context(name=name) as ctx:
            attr = ctx.query_device()
            ports = []
            for p in range(1, attr.phys_port_cnt + 1):
                pa = ctx.query_port(p)
                gids = []
                for i in range(min(pa.gid_tbl_len, 64)):
                    try:
                        g = ctx.query_gid(p, i).gid
                    except Exception:  # empty slots raise in pyverbs
                        continue
                    if g.strip("0:"):
                        gids.append({"index": i, "gid": _gid_str(bytes.fromhex(g.replace(":", ""))),
                                     "type": _gid_type_sysfs(name, p, i)})
                ports.append({"port": p, "state": states.get(pa.state, str(pa.state)),
                              "active": pa.state == e.IBV_PORT_ACTIVE,
                              "link_layer": layers.get(pa.link_layer, str(pa.link_layer)),
                              "active_mtu": 128 << pa.active_mtu, "lid": pa.lid, "gids": gids})
            out.append({"name": name, "fw_ver": attr.fw_ver.decode() if isinstance(attr.fw_ver, bytes)
                        else str(attr.fw_ver), "vendor_id": attr.vendor_id, "max_qp": attr.max_qp,
                        "max_mr_size": attr.max_mr_size, "ports": ports})
    return out


def _gid_type_sysfs(dev: str, port: int, index: int) -> str:
    try:
        with open(f"/sys/class/infiniband/{dev}/ports/{port}/gid_attrs/types/{index}") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def _devices_verbs(verbs: Any) -> list[dict[str, Any]]:
    out = []
    for name in verbs.device_names():
        with verbs.Context.open(name) as ctx:
            attr = ctx.query_device()
            ports = []
            for p in range(1, attr["phys_port_cnt"] + 1):
                pa = ctx.query_port(p)
                pa["gids"] = [{"index": g["index"], "gid": _gid_str(g["gid"]), "type": g["type"]}
                              for g in ctx.gid_entries(p)]
                ports.append(pa)
            out.append({"name": name, "fw_ver": attr["fw_ver"], "vendor_id": attr["vendor_id"],
                        "max_qp": attr["max_qp"], "max_mr_size": attr["max_mr_size"], "ports": ports})
    return out


_UDMABUF_CREATE = 0x40187542      # _IOW('u', 0x42, struct udmabuf_create)
_UDMABUF_FLAGS_CLOEXEC = 0x01


def _udmabuf(size: int) -> tuple[int, int]:
    """(memfd, dmabuf fd) over ``size`` bytes of host memory via /dev/udmabuf."""
    memfd = os.memfd_create("tensorxfer-doctor", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    try:
        os.ftruncate(memfd, size)
        fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        dev = os.open("/dev/udmabuf", os.O_RDWR | os.O_CLOEXEC)
        try:
            buf = bytearray(struct.pack("=IIQQ", memfd, _UDMABUF_FLAGS_CLOEXEC, 0, size))
            fd = fcntl.ioctl(dev, _UDMABUF_CREATE, buf, True)
        finally:
            os.close(dev)
    except BaseException:
        os.close(memfd)
        raise
    return memfd, fd


def _registration(verbs: Any, device: str | None) -> tuple[dict[str, Any], list[Problem]]:
    """Try one MR over a 3-handle region, and one dmabuf MR."""
    from tensorxfer.memory import HostRegion

    res: dict[str, Any] = {}
    problems: list[Problem] = []
    with HostRegion.allocate(3 << 20, 1 << 20) as region, verbs.Context.open(device) as ctx:
        pd = ctx.alloc_pd()
        ext = region.resolve_extent(0, region.size)
        try:
            mr = pd.reg_mr(ext.ptr, ext.length, verbs.ACCESS_LOCAL_WRITE | verbs.ACCESS_REMOTE_WRITE, owner=region)
        except OSError as exc:
            res["mr"] = {"ok": False, "error": str(exc)}
            problems.append(_problem(
                "ibv_reg_mr failed", "no region can be registered: the RDMA transport cannot run",
                "raise the locked-memory limit (`ulimit -l unlimited`, or LimitMEMLOCK=infinity for services); "
                "in containers add --ulimit memlock=-1 and --cap-add IPC_LOCK"))
        else:
            res["mr"] = {"ok": True, "handles": len(ext.segments), "length": mr.length}
            mr.close()
        if not os.path.exists("/dev/udmabuf"):
            res["dmabuf_mr"] = {"ok": None, "error": "not tested: no dmabuf exporter here (/dev/udmabuf is "
                                "missing; CUDA regions export their own dmabuf)"}
        else:
            memfd = dmabuf = -1
            try:
                memfd, dmabuf = _udmabuf(1 << 20)
                mr = pd.reg_dmabuf_mr(dmabuf, 0, 1 << 20, 0, verbs.ACCESS_LOCAL_WRITE)
                mr.close()
                res["dmabuf_mr"] = {"ok": True, "exporter": "udmabuf"}
            except OSError as exc:
                res["dmabuf_mr"] = {"ok": False, "error": str(exc)}
            finally:
                for fd in (dmabuf, memfd):
                    if fd >= 0:
                        os.close(fd)
        if res["dmabuf_mr"]["ok"] is False:
            problems.append(_problem(
                "dmabuf MR registration failed",
                "GPU regions will register with ibv_reg_mr on the device address instead, which needs the "
                "nvidia-peermem module (tensorxfer falls back automatically and logs it)",
                "use a kernel ≥ 5.12 with a provider that supports dmabuf MRs (mlx5 does; Soft-RoCE does not), "
                "rdma-core ≥ 34, and for GPUs the open NVIDIA kernel modules"))
        pd.close()
    return res, problems


def cuda_report() -> dict[str, Any]:
    """CUDA section: the module, the driver, and per device what tensorxfer relies on."""
    try:
        from tensorxfer.memory import _cuda
    except ImportError as exc:
        if (getattr(exc, "name", None) or "").startswith("cuda"):   # built (every wheel is), cuda-bindings absent
            what, fix = "cuda-bindings is not installed", "pip install 'tensorxfer[cuda]' (cuda-bindings 13.0)"
        else:
            what, fix = "tensorxfer.memory._cuda is not built", (
                "install cuda-bindings and the CUDA headers (cuda.h; set CUDA_HOME), then reinstall tensorxfer")
        error = f"{what} ({exc})" if what.startswith("cuda-bindings") else str(exc)
        return {"module": False, "error": error, "fix": fix,
                "problems": [_problem(what, "GPU regions (CUDA VMM, dmabuf export) are unavailable", fix)]}
    from tensorxfer.errors import CudaError

    try:
        count = _cuda.device_count()
        out: dict[str, Any] = {"module": True, "driver_version": _cuda.driver_version(), "devices": []}
        for i in range(count):
            out["devices"].append(_cuda.device_info(i))
    except CudaError as exc:
        return {"module": True, "driver": False, "error": str(exc),
                "problems": [_problem("no usable CUDA driver or device",
                                      "device='cuda:N' regions are unavailable; host regions and every transport "
                                      "still work", "install the NVIDIA driver on a machine with a GPU")]}
    problems = []
    for d in out["devices"]:
        for key, means in (("vmm", "no multi-handle VMM regions on this device"),
                           ("posix_fd_handles", "CUDA regions cannot be shared over ipc"),
                           ("dmabuf", "no dmabuf export: RDMA must register the GPU address (nvidia-peermem)"),
                           ("gpudirect_rdma_with_vmm", "the NIC cannot DMA into VMM memory (GPUDirect RDMA)")):
            if not d.get(key):
                problems.append(_problem(f"cuda:{d['device']} lacks {key}", means,
                                         "check the driver version and the GPU model (see docs/rdma.md)"))
    if not count:
        problems.append(_problem("no CUDA device is visible", "device='cuda:N' regions are unavailable",
                                 "check CUDA_VISIBLE_DEVICES and the driver"))
    out["problems"] = problems
    return out


def collect(device: str | None = None) -> dict[str, Any]:
    """Everything doctor knows, as a JSON-able dict (``problems`` lists what is missing)."""
    report: dict[str, Any] = {"rdma": {}, "cuda": {}, "problems": []}
    rd = report["rdma"]
    problems: list[Problem] = report["problems"]
    verbs: Any = None
    try:
        from tensorxfer.transport import _verbs as verbs
    except ImportError as exc:
        rd["verbs_module"] = {"ok": False, "error": str(exc)}
        problems.append(_problem("tensorxfer.transport._verbs is not built",
                                 "the RDMA transport is unavailable (tcp/ipc still work)",
                                 "apt-get install libibverbs-dev, then reinstall tensorxfer "
                                 "(unset TENSORXFER_NO_VERBS)"))
    else:
        rd["verbs_module"] = {"ok": True}
        missing = verbs.library_error()     # the module loads libibverbs.so.1 at run time, not at import
        rd["library"] = verbs.library_info()
        rd["library"]["ok"] = missing is None
        if missing is not None:
            rd["library"].update(error=missing, fix=verbs.LIBRARY_FIX)
            problems.append(_problem("libibverbs.so.1 cannot be loaded (rdma-core is not installed)",
                                     "the RDMA transport is unavailable (tcp/ipc still work)", verbs.LIBRARY_FIX))
            verbs = None                    # nothing below can ask libibverbs anything
    pyverbs: Any
    try:
        pyverbs = importlib.import_module("pyverbs")
    except ImportError:
        pyverbs = None
    rd["pyverbs"] = pyverbs is not None
    devices: list[dict[str, Any]] = []
    try:
        if pyverbs is not None:
            devices, rd["source"] = _devices_pyverbs(pyverbs), "pyverbs"
        elif verbs is not None:
            devices, rd["source"] = _devices_verbs(verbs), "tensorxfer._verbs"
    except Exception as exc:  # a broken provider must not stop the report
        rd["error"] = f"device discovery failed: {exc}"
    rd["devices"] = devices
    if (verbs is not None or pyverbs is not None) and rd.get("library", {}).get("ok", True):
        if not devices:
            problems.append(_problem(
                "no RDMA devices", "the RDMA transport cannot run on this machine",
                "install the NIC's driver (mlx5_ib) and rdma-core/ibverbs-providers; without a NIC, Soft-RoCE: "
                "`modprobe rdma_rxe && rdma link add rxe0 type rxe netdev <eth>`"))
        for d in devices:
            for p in d["ports"]:
                if not p["active"]:
                    problems.append(_problem(f"{d['name']} port {p['port']} is {p['state']}",
                                             "this port cannot carry traffic",
                                             "check the cable/switch and `rdma link`; for RoCE bring the netdev up"))
                elif p["link_layer"] == "Ethernet" and not any(g["type"].startswith("RoCE v2") for g in p["gids"]):
                    problems.append(_problem(f"{d['name']} port {p['port']} has no RoCE v2 GID",
                                             "peers on other subnets cannot be reached (RoCE v1 is L2 only)",
                                             "assign an IP address to the port's netdev"))
    if verbs is not None and devices:
        try:
            res, probs = _registration(verbs, device)
            rd.update(res)
            problems.extend(probs)
        except Exception as exc:
            rd["registration_error"] = str(exc)
    report["cuda"] = cuda_report()
    problems.extend(report["cuda"].pop("problems", []))
    report["transports"] = transport_lines(report)
    return report


def _print_text(r: dict[str, Any]) -> None:
    print_lines(r["transports"])
    rd = r["rdma"]
    print("RDMA")
    print(f"  verbs module: {'built' if rd['verbs_module']['ok'] else 'missing: ' + rd['verbs_module']['error']}")
    if "library" in rd:
        lib = rd["library"]
        print(f"  libibverbs: {'loaded (' + lib['library'] + ')' if lib['ok'] else 'NOT loadable: ' + lib['error']}"
              + (f"; lacks {', '.join(lib['missing_optional'])}" if lib.get("missing_optional") else ""))
    print(f"  pyverbs importable: {'yes' if rd['pyverbs'] else 'no'}"
          + (f"  (discovery via {rd['source']})" if "source" in rd else ""))
    for d in rd["devices"]:
        print(f"  device {d['name']}  fw {d['fw_ver']}  vendor {d['vendor_id']:#x}  max_qp {d['max_qp']}")
        for p in d["ports"]:
            print(f"    port {p['port']}: {p['state']}, {p['link_layer']}, MTU {p['active_mtu']}, LID {p['lid']}")
            for g in p["gids"]:
                print(f"      GID[{g['index']}] {g['gid']}  ({g['type']})")
    for key, label in (("mr", "MR over a 3-handle region"), ("dmabuf_mr", "dmabuf MR")):
        if key in rd:
            v = rd[key]
            state = "ok" if v["ok"] else ("not tested" if v["ok"] is None else "FAILED")
            print(f"  {label}: {state}" + (f" — {v['error']}" if v.get("error") else ""))
    print("CUDA")
    c = r["cuda"]
    print(f"  tensorxfer.memory._cuda: {'imports' if c['module'] else 'missing: ' + c.get('error', '')}")
    if c.get("error") and c["module"]:
        print(f"  driver: {c['error']}")
    if "driver_version" in c:
        print(f"  driver version {c['driver_version']}, {len(c['devices'])} device(s)")
    for d in c.get("devices", []):
        flags = ", ".join(f"{k} {'yes' if d[k] else 'NO'}" for k in ("vmm", "posix_fd_handles", "dmabuf",
                                                                     "gpudirect_rdma_with_vmm"))
        print(f"  cuda:{d['device']} {d['name']}: {flags}, granularity {d['granularity'] >> 20} MiB")
    if r["problems"]:
        print("Problems")
        for p in r["problems"]:
            print(f"  - {p['what']}\n      means: {p['means']}\n      fix:   {p['fix']}")
    else:
        print("No problems found.")


def main(args: argparse.Namespace) -> int:
    """Entry point of ``tensorxfer doctor``; exit status 0 always (it is a report)."""
    report = collect(getattr(args, "device", None))
    if getattr(args, "json", False):
        print(json.dumps(report, indent=1, default=str))
    else:
        _print_text(report)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("doctor", help="report RDMA devices, ports, GIDs, MR/dmabuf registration, CUDA")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--device", default=None, help="RDMA device for the registration checks (default: first)")
    p.set_defaults(func=main)
