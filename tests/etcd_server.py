"""A real etcd server (Debian's ``etcd-server``) on loopback ports in a temp dir, for tests and benchmarks."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def etcd_binary() -> str | None:
    return shutil.which("etcd") or next((p for p in ("/usr/bin/etcd", "/usr/sbin/etcd") if Path(p).exists()), None)


def need_etcd() -> None:
    """Skip the calling test where etcd or its client is missing; fail it instead under
    ``TENSORXFER_REQUIRE_ETCD=1`` (set by .ci/run, which installs both)."""
    import pytest

    missing = [what for what, ok in (("the etcd binary (apt-get install etcd-server)", etcd_binary()),
                                     ("etcd3gw (pip install 'tensorxfer[etcd]')",
                                      importlib.util.find_spec("etcd3gw"))) if not ok]
    if missing:
        if os.environ.get("TENSORXFER_REQUIRE_ETCD") == "1":
            pytest.fail(f"TENSORXFER_REQUIRE_ETCD=1 but {' and '.join(missing)} is missing")
        pytest.skip(f"{' and '.join(missing)} is missing")


@contextlib.contextmanager
def etcd_server(where: Path) -> Iterator[str]:
    """Start etcd with its data in ``where``; yield its client URL (``etcd://127.0.0.1:PORT``); stop it."""
    binary = etcd_binary()
    if binary is None:
        raise FileNotFoundError("etcd is not installed (Debian: apt-get install etcd-server)")
    client, peer = free_port(), free_port()
    log = open(where / "etcd.log", "wb")
    proc = subprocess.Popen([
        binary, "--name", "tx", "--data-dir", str(where / "etcd-data"),
        "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
        "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"tx=http://127.0.0.1:{peer}", "--log-level", "warn"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", client), timeout=0.5):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"etcd did not start: {(where / 'etcd.log').read_text()[-2000:]}") from None
                time.sleep(0.05)
        yield f"etcd://127.0.0.1:{client}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
