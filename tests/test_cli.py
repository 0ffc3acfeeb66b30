"""tensorxfer-send / tensorxfer-recv / demo / bench as real processes."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import ROOT, Background, finish, line_within, small_filesystem

safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="cross-check needs the safetensors package")


def cli(module: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    e = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    e.pop("TENSORXFER_TOKEN", None) if not (env and "TENSORXFER_TOKEN" in env) else None
    return subprocess.Popen([sys.executable, "-m", f"tensorxfer.cli.{module}", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=e)


def start_recv(out: Path, *extra: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    proc = cli("recv", "--out", str(out), "--json", *extra, env=env)
    line = json.loads(line_within(proc, 60, "the receiver's listening event"))
    assert line["event"] == "listening"
    return proc, f"{line['host']}:{line['port']}"


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def model_dir(d: Path, shards: int = 3, rows: int = 1000) -> Path:
    d.mkdir()
    rng = np.random.default_rng(0)
    weight_map = {}
    for s in range(shards):
        t = {f"layers.{s}.{i}.weight": rng.standard_normal((rows, 64)).astype(np.float32) for i in range(4)}
        t[f"layers.{s}.norm"] = np.ones(64, np.float16)
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        safetensors_numpy.save_file(t, str(d / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(t, name))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0},
                                                                "weight_map": weight_map}, indent=2))
    return d


@pytest.mark.slow
def test_send_recv_model_dir_byte_identical(tmp_path):
    src = model_dir(tmp_path / "src")
    out = tmp_path / "out"
    recv, where = start_recv(out, "--once")
    send = cli("send", str(src), "--to", where, "--verify", "--json")
    rc_s, out_s, err_s = finish(send)
    rc_r, out_r, err_r = finish(recv)
    assert rc_s == 0, err_s
    assert rc_r == 0, err_r
    sent = json.loads(out_s)
    # auto picks ipc: both ends are on one host, as one user
    assert sent["event"] == "sent" and sent["verified"] and sent["transport"] == "ipc"
    assert sent["files"] == sorted(os.listdir(src)) and sent["side_files"] == ["model.safetensors.index.json"]
    got = json.loads(out_r.splitlines()[-1])
    assert got["event"] == "received" and got["bytes"] == sent["bytes"]
    # one convention on both ends: names relative to the model directory, bytes = the payload (the tensors),
    # file_bytes = the files' sizes
    file_bytes = sum(p.stat().st_size for p in src.iterdir())
    for key in ("files", "tensor_files", "side_files", "tensors", "bytes", "file_bytes"):
        assert got[key] == sent[key], key
    assert sent["file_bytes"] == file_bytes and got["out"] == str(out)
    for p in src.iterdir():
        assert sha(p) == sha(out / p.name), p.name
    assert sorted(os.listdir(out)) == sorted(os.listdir(src))


def test_send_single_file_with_token_and_summary(tmp_path):
    f = tmp_path / "one.safetensors"
    safetensors_numpy.save_file({"a": np.arange(10, dtype=np.int64)}, str(f))
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    out = tmp_path / "out"
    recv, where = start_recv(out, "--once", "--token-file", str(token))
    send = cli("send", str(f), "--to", where, env={"TENSORXFER_TOKEN": "s3cret"})
    rc_s, out_s, err_s = finish(send)
    assert rc_s == 0, err_s
    assert out_s.startswith("sent ") and "Gbps over ipc" in out_s   # auto on one host
    assert finish(recv)[0] == 0
    assert sha(f) == sha(out / f.name)


@pytest.mark.slow
def test_wrong_token_exit_code_and_no_files(tmp_path):
    f = tmp_path / "one.safetensors"
    safetensors_numpy.save_file({"a": np.arange(10, dtype=np.int64)}, str(f))
    out = tmp_path / "out"
    recv, where = start_recv(out, "--once", env={"TENSORXFER_TOKEN": "right"})
    send = cli("send", str(f), "--to", where, env={"TENSORXFER_TOKEN": "wrong"})
    rc_s, _, err_s = finish(send)
    assert rc_s == 3 and "AuthError" in err_s
    assert not out.exists() or not list(out.iterdir())
    # A wrong token is a stranger to the receiver: logged and dropped, never the end of --once.
    assert recv.poll() is None, "the receiver must keep listening"
    rc_s2, _, err_s2 = finish(cli("send", str(f), "--to", where, env={"TENSORXFER_TOKEN": "right"}))
    rc_r, _, err_r = finish(recv)
    assert rc_s2 == 0 and rc_r == 0, err_s2 + err_r
    assert "wrong token" in err_r and sha(f) == sha(out / f.name)


@pytest.mark.slow
def test_sender_killed_mid_transfer_writes_no_output(tmp_path):
    f = tmp_path / "big.safetensors"
    safetensors_numpy.save_file({"w": np.zeros(96 << 20, np.uint8)}, str(f))
    out = tmp_path / "out"
    recv, where = start_recv(out, "--once", "--quiet")
    # A tensorxfer-send that SIGKILLs itself once a quarter of the bytes are out.
    code = (
        "import os, signal, sys\n"
        "import tensorxfer.session as s\n"
        "real = s.Sender.send\n"
        "def send(self, region, verify=False, progress=None, **kw):\n"
        "    sent = [0]\n"
        "    def p(n):\n"
        "        sent[0] += n\n"
        "        if sent[0] > region.nbytes // 4: os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return real(self, region, verify, p, **kw)\n"
        "s.Sender.send = send\n"
        "from tensorxfer.cli.send import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    send = subprocess.Popen([sys.executable, "-c", code, str(f), "--to", where, "--quiet", "--streams", "2"],
                            env=dict(os.environ, PYTHONPATH=ROOT), stderr=subprocess.PIPE, text=True)
    rc_s, _, _ = finish(send)
    t0 = time.monotonic()
    rc_r, _, err_r = finish(recv)
    assert rc_s == -signal.SIGKILL
    assert rc_r == 1 and "PeerLost" in err_r, err_r
    assert time.monotonic() - t0 < 10
    # no output file: at most the hidden partial output a run of the same send resumes (test_cli_restart.py)
    assert not out.exists() or all(p.name.startswith(".tensorxfer-") for p in out.iterdir())


@pytest.mark.slow
def test_bad_source_is_usage_error(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 16)
    rc, _, err = finish(cli("send", str(bad), "--to", "127.0.0.1:1"))
    assert rc == 2 and "FileFormatError" in err
    rc, _, err = finish(cli("send", str(tmp_path / "missing"), "--to", "127.0.0.1:1"))
    assert rc == 2


@pytest.mark.parametrize("args", [("recv", "--out", "OUT", "--stall-timeout", "0"),
                                  ("send", "SRC", "--to", "127.0.0.1:1", "--stall-timeout", "-5"),
                                  ("send", "SRC", "--to", "127.0.0.1:1", "--connect-timeout", "nan")])
def test_a_timeout_that_is_not_seconds_above_zero_is_a_usage_error_naming_the_flag(tmp_path, args):
    args = [str(tmp_path / "out") if a == "OUT" else str(tmp_path) if a == "SRC" else a for a in args]
    rc, _, err = finish(cli(*args))
    flag = next(a for a in args if a.endswith("-timeout"))
    assert rc == 2 and f"argument {flag}: expected seconds > 0" in err, err


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "model.pth", "last.ckpt", "tf_model.h5",
                                  "model.gguf", "model.onnx"])
@pytest.mark.slow
def test_a_weight_file_in_another_format_is_refused_like_a_directory_of_them(tmp_path, name):
    """Named directly, it used to travel as a "side file": exit 0, "sent 0 bytes"."""
    (tmp_path / name).write_bytes(b"\0" * 64)
    rc, out, err = finish(cli("send", str(tmp_path / name), "--to", "127.0.0.1:1"))
    assert rc == 2 and out == "", (rc, out, err)
    assert f"{name}: " in err and "only safetensors files carry weights" in err and ".gguf" in err, err
    d = tmp_path / "only-other-formats"
    d.mkdir()
    (d / name).write_bytes(b"\0" * 64)
    (d / "config.json").write_text("{}")
    rc, _, err_dir = finish(cli("send", str(d), "--to", "127.0.0.1:1"))
    assert rc == 2 and "only safetensors files carry weights" in err_dir and name in err_dir, err_dir


@pytest.mark.slow
def test_side_files_alone_are_not_a_model(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    rc, _, err = finish(cli("send", str(tmp_path / "config.json"), "--to", "127.0.0.1:1"))
    assert rc == 2 and "no safetensors file" in err, err


@pytest.mark.slow
def test_unreachable_receiver_is_transfer_error(tmp_path):
    f = tmp_path / "one.safetensors"
    safetensors_numpy.save_file({"a": np.arange(3, dtype=np.int64)}, str(f))
    rc, _, err = finish(cli("send", str(f), "--to", "127.0.0.1:1"))
    assert rc == 1 and "PeerLost" in err


@pytest.mark.slow
def test_forced_unavailable_transport_exit_code(tmp_path):
    f = tmp_path / "one.safetensors"
    safetensors_numpy.save_file({"a": np.arange(3, dtype=np.int64)}, str(f))
    rc, _, err = finish(cli("send", str(f), "--to", "127.0.0.1:1", "--transport", "rdma"))
    assert rc == 4 and "TransportUnavailable" in err


@pytest.mark.slow
def test_listening_beyond_loopback_without_token_warns(tmp_path):
    proc, _ = start_recv(tmp_path / "o", "--listen", "0.0.0.0:0")
    try:
        time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        _, _, err = finish(proc)
    assert "WARNING" in err and "without a token" in err


@pytest.mark.slow
def test_recv_keeps_serving_after_a_failed_sender(tmp_path):
    src = model_dir(tmp_path / "src", shards=1, rows=10)
    out = tmp_path / "out"
    recv, where = start_recv(out, env={"TENSORXFER_TOKEN": "t"})
    try:
        assert finish(cli("send", str(src), "--to", where, env={"TENSORXFER_TOKEN": "x"}))[0] == 3
        assert finish(cli("send", str(src), "--to", where, env={"TENSORXFER_TOKEN": "t"}))[0] == 0
        # the sender exits 0 only after the receiver wrote the files; the "received" line follows the ack
        lines = Background(lambda: [recv.stdout.readline() for _ in range(1)]).result(timeout=20)
    finally:
        recv.send_signal(signal.SIGINT)
        rc, _, err = finish(recv)
    # the wrong token is a stranger: logged and dropped, not a failed transfer
    assert [json.loads(x)["event"] for x in lines] == ["received"] and "wrong token" in err
    assert rc == 130
    for p in src.iterdir():
        assert sha(p) == sha(out / p.name)


@pytest.mark.parametrize("module", ["main", "send", "recv", "bench"])
@pytest.mark.slow
def test_help_is_plain_text_and_version_works(module):
    """--help showed the module docstrings' RST (``x``, :mod:`...`); tensorxfer --version did not exist."""
    import tensorxfer

    env = dict(os.environ, PYTHONPATH=ROOT)
    helped = subprocess.run([sys.executable, "-m", f"tensorxfer.cli.{module}", "--help"], capture_output=True,
                            text=True, env=env, timeout=60)
    assert helped.returncode == 0, helped.stderr
    text = helped.stdout
    assert "``" not in text and not re.search(r":[a-z]+:`", text), text
    if module in ("send", "recv"):
        codes = text[text.index("exit codes:"):]
        for code, meaning in ((0, "success"), (1, "transfer failed"), (2, "bad usage"), (3, "authentication"),
                              (4, "not available"), (5, "protocol error"), (130, "interrupted")):
            assert re.search(rf"^ *{code} +.*{meaning}", codes, re.M), (code, codes)
    if module == "send":
        from tensorxfer.transport.tcp import DEFAULT_STREAMS

        flat = " ".join(text.split())
        assert re.search(rf"--streams N .*\(default: {DEFAULT_STREAMS} tcp streams", flat), flat
    version = subprocess.run([sys.executable, "-m", f"tensorxfer.cli.{module}", "--version"], capture_output=True,
                             text=True, env=env, timeout=60)
    prog = {"main": "tensorxfer", "send": "tensorxfer-send", "recv": "tensorxfer-recv", "bench": "tensorxfer-bench"}
    assert version.returncode == 0 and version.stdout.strip() == f"{prog[module]} {tensorxfer.__version__}", \
        version.stdout + version.stderr


def test_the_version_is_the_packages():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    import tensorxfer

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["version"] == tensorxfer.__version__


def on_terminal(*args: str) -> tuple[subprocess.Popen, Background]:
    """A CLI process whose stderr is a terminal (a pty), as a person runs it; the Background's result is
    everything it drew there."""
    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=slave, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    os.close(slave)

    def read_all() -> str:
        chunks = []
        try:
            while True:
                try:
                    data = os.read(master, 1 << 16)
                except OSError:             # EIO: the process closed its end
                    break
                if not data:
                    break
                chunks.append(data)
        finally:
            os.close(master)
        return b"".join(chunks).decode(errors="replace")
    return proc, Background(read_all)


def screen(drawn: str) -> list[str]:
    """The lines left on a terminal: each carriage return redraws its line."""
    return [line.rsplit("\r", 1)[-1] for line in drawn.replace("\x1b[K", "").replace("\r\n", "\n").split("\n")]


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.slow
def test_progress_shows_each_phase_with_its_own_progress(tmp_path, transport):
    """The bar's rate counted setup time, it showed nothing while files loaded and sat at 100 % while the
    receiver wrote: now each phase has a line of its own."""
    src = model_dir(tmp_path / "src", shards=2, rows=20_000)        # 41 MB: several pieces over tcp
    out = tmp_path / "out"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    recv, recv_drawn = on_terminal("tensorxfer.cli.recv", "--out", str(out), "--once", "--listen",
                                   f"127.0.0.1:{port}")
    deadline = time.monotonic() + 20
    while True:                                                     # listening? (no JSON line to read here)
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        assert time.monotonic() < deadline and recv.poll() is None, "the receiver did not start listening"
        time.sleep(0.05)
    send, send_drawn = on_terminal("tensorxfer.cli.send", str(src), "--to", f"127.0.0.1:{port}", "--transport",
                                   transport)
    rc_s, out_s, _ = finish(send, timeout=60)
    rc_r, _, _ = finish(recv, timeout=60)
    sent, got = screen(send_drawn.result()), screen(recv_drawn.result())
    assert rc_s == 0 and rc_r == 0, (sent, got)

    def phases(lines: list[str], label: str) -> list[str]:
        return [m.group(1) for m in (re.match(rf"{label}: (\S.*?)  +(\[.*|done in .*)$", x) for x in lines) if m]

    # one receiver: over tcp the region is the files, mapped (nothing to read); over ipc (auto, one host) the
    # receiver is passed the files and copies them into its output: nothing is read here either
    moving = "moving data"
    assert phases(sent, "send") == ["setting up (connecting, preparing)", moving,
                                    "receiver writing the files"], sent
    assert phases(got, "recv") == ["setting up (allocating, connecting)", "receiving data", "checking the data",
                                   "writing files", "syncing, renaming into place"], got
    data = next(x for x in sent if x.startswith(f"send: {moving}"))
    assert "100.0% 0.04 GB" in data, data
    if transport == "tcp":                                          # 8 MiB pieces: a rate can be measured
        assert re.search(r" GB at \d+\.\d Gbps$", data), data
    written = next(x for x in got if x.startswith("recv: writing files"))
    assert "100.0%" in written and f"{sum(p.stat().st_size for p in src.iterdir()) / 1e9:.2f} GB" in written
    assert "on the wire" in out_s, out_s                            # the summary gives the data phase's rate


@pytest.mark.slow
def test_demo_runs():
    proc = subprocess.run([sys.executable, "-m", "tensorxfer.cli.main", "demo", "--size", str(32 << 20)],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "digests match the sender's: True" in proc.stdout


@pytest.mark.slow
def test_bench_small(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tensorxfer.cli.bench", "--size", "5e7", "--repeat", "2", "--json",
                           "--no-iperf"], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(proc.stdout)
    assert rec["tensors"] == 820 and len(rec["runs"]) == 2 and rec["gbps_warm_median"] > 0 and rec["cold"]["bytes"]


def test_bench_refuses_what_does_not_fit():
    proc = subprocess.run([sys.executable, "-m", "tensorxfer.cli.bench", "--size", "1e15"], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    assert proc.returncode == 2 and "--size" in proc.stderr


# ---------------------------------------------------------------- what a user is told must be true
def test_sender_fails_when_the_receiver_cannot_write(tmp_path):
    src = model_dir(tmp_path / "src", shards=2, rows=10)
    out = tmp_path / "out"
    (out / "model-00002-of-00002.safetensors").mkdir(parents=True)     # in the way of the second file
    recv, where = start_recv(out, "--once")
    rc_s, _, err_s = finish(cli("send", str(src), "--to", where, "--verify"))
    rc_r, _, err_r = finish(recv)
    assert rc_s == 1 and "is a directory" in err_s, err_s          # the receiver's error, at the sender
    assert rc_r == 1 and "OutputError" in err_r, err_r
    assert os.listdir(out) == ["model-00002-of-00002.safetensors"]  # nothing else landed


@pytest.mark.slow
def test_a_disk_too_small_is_refused_at_offer_time_with_the_numbers(tmp_path):
    """Disk full used to be reported only after every byte moved, as a bare ENOSPC."""
    src = model_dir(tmp_path / "src", shards=2, rows=2000)             # ~4 MB of files
    total = sum(p.stat().st_size for p in src.iterdir())
    with small_filesystem(tmp_path / "fs", 1 << 20) as fs:
        out = fs / "out"
        recv, where = start_recv(out, "--once")
        rc_s, _, err_s = finish(cli("send", str(src), "--to", where))
        rc_r, out_r, err_r = finish(recv)
        left = os.listdir(out)
    assert rc_s == 1 and "refused the offer" in err_s, err_s             # up front, not after the data moved
    assert "not enough free space" in err_s and f"{total:,} bytes" in err_s and str(out) in err_s, err_s
    assert rc_r == 1 and "not enough free space" in err_r, err_r
    event = json.loads(out_r.splitlines()[-1])
    assert event["event"] == "error" and event["exit_code"] == 1
    assert left == []


@pytest.mark.slow
def test_out_holding_another_model_is_refused_unless_overwrite(tmp_path):
    """Receiving into an --out of another model silently mixed them (config.json replaced, old shards and
    index kept)."""
    old = model_dir(tmp_path / "old", shards=3, rows=10)
    new = model_dir(tmp_path / "new", shards=1, rows=20)
    (new / "config.json").write_text('{"model_type": "new"}')
    out = tmp_path / "out"
    shutil.copytree(old, out)
    (out / "NOTES.txt").write_text("mine")
    before = {p.name: sha(p) for p in out.iterdir()}
    recv, where = start_recv(out, "--once")
    rc_s, _, err_s = finish(cli("send", str(new), "--to", where))
    rc_r, _, err_r = finish(recv)
    assert rc_s == 1 and "refused the offer" in err_s and "another model" in err_s and "--overwrite" in err_s
    assert "(overwrite=True)" not in err_s       # the CLI's flag, then the API's, each named as such
    assert "model-00002-of-00003.safetensors" in err_s, err_s
    assert rc_r == 1 and "another model" in err_r, err_r
    assert {p.name: sha(p) for p in out.iterdir()} == before              # nothing mixed in
    recv, where = start_recv(out, "--once", "--overwrite")
    rc_s, _, err_s = finish(cli("send", str(new), "--to", where))
    rc_r, out_r, err_r = finish(recv)
    assert rc_s == 0 and rc_r == 0, err_s + err_r
    assert sorted(os.listdir(out)) == sorted([*os.listdir(new), "NOTES.txt"])    # the user's file stays
    for p in new.iterdir():
        assert sha(p) == sha(out / p.name), p.name
    got = json.loads(out_r.splitlines()[-1])
    assert got["removed"] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


RECV_KILLED_WHILE_WRITING = """
import os, signal, sys
real, calls = os.fsync, [0]
def fsync(fd):
    calls[0] += 1
    if calls[0] == 2:                     # the first file is written, the second is being written
        os.kill(os.getpid(), signal.SIGKILL)
    return real(fd)
os.fsync = fsync
from tensorxfer.cli.recv import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_receiver_killed_while_writing_fails_the_sender_and_the_next_run_cleans_up(tmp_path):
    src = model_dir(tmp_path / "src", shards=2, rows=10)
    out = tmp_path / "out"
    recv = subprocess.Popen([sys.executable, "-c", RECV_KILLED_WHILE_WRITING, "--out", str(out), "--json", "--once"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    assert recv.stdout is not None
    line = json.loads(recv.stdout.readline())
    rc_s, _, err_s = finish(cli("send", str(src), "--to", f"{line['host']}:{line['port']}"))
    rc_r, _, _ = finish(recv)
    assert rc_r == -signal.SIGKILL
    assert rc_s == 1 and "PeerLost" in err_s, err_s
    left = os.listdir(out)
    assert left and all(n.startswith(".tensorxfer-") for n in left), left
    assert any(n.endswith(".part") for n in left), left     # kept for a resumed run (test_cli_restart.py)
    again, _ = start_recv(out, "--no-resume")
    try:
        assert os.listdir(out) == []            # --no-resume: cleaned before listening
    finally:
        again.send_signal(signal.SIGINT)
        finish(again)


@pytest.mark.slow
def test_files_keep_the_senders_mode_bits(tmp_path):
    src = model_dir(tmp_path / "src", shards=1, rows=10)
    os.chmod(src / "model-00001-of-00001.safetensors", 0o640)
    os.chmod(src / "model.safetensors.index.json", 0o604)
    out = tmp_path / "out"
    recv, where = start_recv(out, "--once")
    assert finish(cli("send", str(src), "--to", where))[0] == 0
    assert finish(recv)[0] == 0
    umask = os.umask(0)
    os.umask(umask)
    for p in src.iterdir():
        assert (out / p.name).stat().st_mode & 0o7777 == p.stat().st_mode & 0o777 & ~umask, p.name


def test_out_that_is_a_file_is_refused_at_start(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    rc, _, err = finish(cli("recv", "--out", str(f)))           # no --once: it would otherwise wait forever
    assert rc == 2 and "not a directory" in err, err


@pytest.mark.slow
def test_second_receiver_on_the_same_out_is_refused(tmp_path):
    first, _ = start_recv(tmp_path / "out")
    try:
        rc, _, err = finish(cli("recv", "--out", str(tmp_path / "out")))
        assert rc == 2 and "another tensorxfer-recv" in err, err
    finally:
        first.send_signal(signal.SIGINT)
        finish(first)


def test_port_in_use_is_exit_4_naming_the_address(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, _, err = finish(cli("recv", "--out", str(tmp_path / "o"), "--listen", f"127.0.0.1:{port}"))
    assert rc == 4 and f"127.0.0.1:{port}" in err and "in use by another process" in err, err


def test_listen_address_not_of_this_host_says_so(tmp_path):
    """EADDRNOTAVAIL used to say "is another process using the port?"."""
    rc, out, err = finish(cli("recv", "--out", str(tmp_path / "o"), "--listen", "192.0.2.1:7700", "--json"))
    assert rc == 4 and "192.0.2.1:7700" in err and "not an address of this host" in err, err
    assert "another process" not in err and json.loads(out)["exit_code"] == 4      # 192.0.2.1: TEST-NET-1
    rc, _, err = finish(cli("recv", "--out", str(tmp_path / "o"), "--listen", "no-such-host.invalid:7700"))
    assert rc == 4 and "no-such-host.invalid" in err and "cannot be resolved" in err, err
    assert "another process" not in err


def test_privileged_port_says_it_needs_privileges(tmp_path):
    """EACCES (a port below 1024 without privileges) used to say "is another process using the port?"."""
    with open("/proc/sys/net/ipv4/ip_unprivileged_port_start") as f:
        if int(f.read()) <= 80:
            pytest.skip("this host lets anyone bind port 80 (net.ipv4.ip_unprivileged_port_start)")
    drop = None
    if os.geteuid() == 0:
        # root binds port 80 through CAP_NET_BIND_SERVICE: take it out of the receiver's bounding set
        # (prctl PR_CAPBSET_DROP), so the receiver runs as root without it, as an unprivileged user would
        libc = ctypes.CDLL(None, use_errno=True)
        pr_capbset_drop, cap_net_bind_service = 24, 10

        def drop():
            if libc.prctl(pr_capbset_drop, cap_net_bind_service, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_NET_BIND_SERVICE)")
    proc = subprocess.run([sys.executable, "-m", "tensorxfer.cli.recv", "--out", str(tmp_path / "o"), "--listen",
                           "127.0.0.1:80"], capture_output=True, text=True, timeout=60, preexec_fn=drop,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 4, proc.stderr
    assert "127.0.0.1:80" in proc.stderr and "ports below 1024 need privileges" in proc.stderr, proc.stderr
    assert "another process" not in proc.stderr


@pytest.mark.slow
def test_port_scan_does_not_end_once(tmp_path):
    src = model_dir(tmp_path / "src", shards=1, rows=10)
    out = tmp_path / "out"
    recv, where = start_recv(out, "--once")
    host, port = where.rsplit(":", 1)
    for _ in range(3):
        with socket.create_connection((host, int(port))):
            pass                                   # connect + close, as a port scanner does
    rc_s, _, err_s = finish(cli("send", str(src), "--to", where))
    rc_r, out_r, err_r = finish(recv)
    assert rc_s == 0, err_s
    assert rc_r == 0, err_r
    assert json.loads(out_r.splitlines()[-1])["event"] == "received"
    for p in src.iterdir():
        assert sha(p) == sha(out / p.name)


def test_hostile_file_layout_does_not_kill_a_long_running_receiver(tmp_path):
    from tensorxfer import Manifest, ManifestError, Sender, TensorRegion
    from tensorxfer.files import FILES_KEY

    src = model_dir(tmp_path / "src", shards=1, rows=10)
    out = tmp_path / "out"
    recv, where = start_recv(out)
    try:
        hostile = Manifest.layout([("w", "U8", (8,))], metadata={FILES_KEY: "[" * 50000})
        with TensorRegion.from_manifest(hostile) as region, Sender(where, transport="tcp") as sender, \
                pytest.raises(ManifestError, match="refused"):
            sender.send(region)
        assert finish(cli("send", str(src), "--to", where))[0] == 0      # still serving
    finally:
        recv.send_signal(signal.SIGINT)
        rc, out_r, err_r = finish(recv)
    assert rc == 130, err_r
    assert "levels deep" in err_r and "RecursionError" not in err_r
    assert [json.loads(x)["event"] for x in out_r.splitlines()] == ["error", "received"], out_r


def test_deeply_nested_index_is_a_usage_error_for_send(tmp_path):
    src = model_dir(tmp_path / "src", shards=1, rows=10)
    (src / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 50000 + "]" * 50000 + "}")
    rc, _, err = finish(cli("send", str(src), "--to", "127.0.0.1:1"))
    assert rc == 2 and "FileFormatError" in err and "Traceback" not in err, err


@pytest.mark.slow
def test_side_files_arrive_and_are_listed(tmp_path):
    src = model_dir(tmp_path / "src", shards=1, rows=10)
    (src / "config.json").write_text('{"model_type": "gpt2"}\n')
    (src / "tokenizer.model").write_bytes(bytes(range(256)))
    (src / "pytorch_model.bin").write_bytes(b"\0" * 10)
    out = tmp_path / "out"
    recv, where = start_recv(out, "--once")
    rc_s, out_s, err_s = finish(cli("send", str(src), "--to", where, "--json"))
    assert rc_s == 0, err_s
    assert finish(recv)[0] == 0
    sent = json.loads(out_s)
    assert sent["side_files"] == ["config.json", "model.safetensors.index.json", "tokenizer.model"]
    assert sent["skipped"] == [{"name": "pytorch_model.bin",
                                "reason": "another weight format; the safetensors files carry the weights"}]
    assert sorted(os.listdir(out)) == sorted(sent["files"])
    for n in sent["files"]:
        assert sha(src / n) == sha(out / n), n
    recv, where = start_recv(tmp_path / "out2", "--once")
    rc_s, text, err_s = finish(cli("send", str(src), "--to", where))     # the summary line names them too
    assert finish(recv)[0] == 0
    assert rc_s == 0 and "side files: config.json, model.safetensors.index.json, tokenizer.model" in text, text
    assert "not sent: pytorch_model.bin" in err_s, err_s


@pytest.mark.slow
def test_gpu_device_without_a_gpu_fails_cleanly_at_start(tmp_path):
    from tests.helpers import GPU_REASON

    if GPU_REASON is None:
        pytest.skip("a GPU is present: see tests/test_cli_cuda.py")
    f = tmp_path / "one.safetensors"
    safetensors_numpy.save_file({"a": np.arange(3, dtype=np.int64)}, str(f))
    rc, _, err = finish(cli("recv", "--out", str(tmp_path / "o"), "--device", "cuda:0"))   # no --once: must not wait
    assert rc == 4 and "CudaError: --device cuda:0" in err and "cpu" in err, err
    rc, _, err = finish(cli("send", str(f), "--to", "127.0.0.1:1", "--device", "cuda:0"))
    assert rc == 4 and "CudaError" in err and "Traceback" not in err, err
    rc, _, err = finish(cli("send", str(f), "--to", "127.0.0.1:1", "--device", "tpu"))
    assert rc == 2 and "device must be" in err, err


@pytest.mark.parametrize("text, value", [("1G", 1 << 30), ("512MiB", 512 << 20), ("1GB", 10 ** 9), ("2e9", 2 * 10 ** 9),
                                         ("1.5k", 1536), ("4096", 4096), (" 3 TiB ", 3 << 40), ("10b", 10)])
def test_sizes_are_read_as_people_type_them(text: str, value: int) -> None:
    from tensorxfer.cli.common import byte_size

    assert byte_size(text) == value


@pytest.mark.parametrize("text", ["1X", "G", "-1G", "1e400", "", "1 2"])
def test_a_size_that_is_no_size_names_the_forms_that_are(text: str) -> None:
    import argparse

    from tensorxfer.cli.common import byte_size

    with pytest.raises(argparse.ArgumentTypeError, match=r"not a size|out of range"):
        byte_size(text)


def test_recv_takes_max_bytes_with_units_and_says_so_in_help() -> None:
    from tensorxfer.cli.recv import build_parser

    p = build_parser()
    assert p.parse_args(["--out", "received", "--max-bytes", "1G"]).max_bytes == 1 << 30
    assert "512MiB" in p.format_help()


@pytest.mark.slow
def test_recv_quiet_prints_nothing_while_it_listens(tmp_path):
    recv, _ = start_recv(tmp_path / "out", "--quiet")
    try:
        time.sleep(0.3)
    finally:
        recv.send_signal(signal.SIGINT)
    _, err = recv.communicate(timeout=20)
    assert "listening on" not in err, err
    loud, _ = start_recv(tmp_path / "out2")
    time.sleep(0.3)         # its JSON line comes before the stderr line
    loud.send_signal(signal.SIGINT)
    assert "listening on" in loud.communicate(timeout=20)[1]


def test_one_stream_is_one_stream() -> None:
    from tensorxfer.cli.common import summary

    stats = {"bytes": 10, "seconds": 1.0, "gbps": 0.0, "transport": "tcp", "verified": False}
    assert "(1 stream)" in summary("sent", {**stats, "streams": 1})
    assert "(4 streams)" in summary("sent", {**stats, "streams": 4})


@pytest.mark.slow
def test_ctrl_c_on_the_sender_says_what_was_interrupted_and_what_the_receiver_kept(tmp_path):
    src = model_dir(tmp_path / "model", shards=1, rows=10)
    with socket.socket() as s:          # a peer that never answers: the sender waits in its handshake
        s.bind(("127.0.0.1", 0))
        s.listen()
        s.settimeout(60)
        send = cli("send", str(src), "--to", f"127.0.0.1:{s.getsockname()[1]}", "--connect-timeout", "30")
        conn, _ = s.accept()            # it connected: it is well inside the send (not still starting up)
        with conn:
            send.send_signal(signal.SIGINT)
            rc, _, err = finish(send, timeout=30)
    assert rc == 130, err
    assert "interrupted (Ctrl-C)" in err and "keeps none of it" in err, err
