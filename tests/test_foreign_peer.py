"""A Sender or Receiver whose other end is not tensorxfer at all is told so, quoting what it said."""

from __future__ import annotations

import http.server
import socket
import threading

import pytest

import tensorxfer as tx
from tests.helpers import Background


class Quiet(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass    # keep the test output clean


@pytest.fixture
def http_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_sender_to_an_http_server_is_told_it_is_not_a_tensorxfer_receiver(http_server):
    host, port = http_server
    with pytest.raises(tx.ProtocolError) as e:
        tx.Sender(f"{host}:{port}", connect_timeout=5)
    msg = str(e.value)
    # http.server answers a request line it cannot parse HTTP/0.9-style: an error page, no status line
    assert f"the peer at {host}:{port} is not a tensorxfer receiver (it answered '" in msg, msg
    assert "<!DOCTYPE HTML>" in msg or "HTTP/" in msg, msg


@pytest.mark.slow
def test_receiver_reached_by_an_http_client_names_it(caplog):
    # A stranger to the receiver: dropped and counted (never an error of receive()), and the log names it.
    with tx.Receiver() as rx:
        job = Background(rx.receive, timeout=2)
        with socket.create_connection(rx.address, timeout=5) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            with pytest.raises(tx.TransferTimeout, match=r"1 connection\(s\) dropped"):
                job.result()
        assert rx.dropped_connections == 1
    assert any("is not a tensorxfer sender (it sent 'GET / HTTP/1.1" in r.getMessage() for r in caplog.records)


def test_sender_to_a_server_that_hangs_up_or_stays_silent_is_asked_whether_it_is_a_receiver():
    with socket.create_server(("127.0.0.1", 0)) as lst:
        port = lst.getsockname()[1]

        def hang_up() -> None:
            conn, _ = lst.accept()
            conn.recv(100)
            conn.close()
        job = Background(hang_up)
        with pytest.raises(tx.PeerLost, match=f"is 127.0.0.1:{port} a tensorxfer receiver"):
            tx.Sender(f"127.0.0.1:{port}", connect_timeout=5)
        job.result()

        held: list[socket.socket] = []
        job = Background(lambda: held.append(lst.accept()[0]))
        with pytest.raises(tx.TransferTimeout, match="did not answer the hello; is it a tensorxfer receiver"):
            tx.Sender(f"127.0.0.1:{port}", connect_timeout=0.5)
        job.result()
        held[0].close()
