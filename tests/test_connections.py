"""connections.listen: a failed bind keeps its errno and says what that errno means (one hint each)."""

from __future__ import annotations

import errno
import socket

import pytest

from tensorxfer.connections import listen


def test_port_in_use_keeps_errno_and_says_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError) as info:
            listen("127.0.0.1", port=port)
    assert info.value.errno == errno.EADDRINUSE and "in use by another process" in str(info.value)


def test_address_of_another_host_is_not_called_a_port_in_use():
    with pytest.raises(OSError) as info:
        listen("192.0.2.1")                         # TEST-NET-1: never an address of this host
    assert info.value.errno == errno.EADDRNOTAVAIL
    assert "192.0.2.1 is not an address of this host" in str(info.value) and "in use" not in str(info.value)


def test_unresolvable_name_stays_a_gaierror():
    with pytest.raises(socket.gaierror, match="cannot be resolved"):
        listen("no-such-host.invalid")


def test_unix_socket_errors_pass_through(tmp_path):
    with pytest.raises(OSError) as info:
        listen(str(tmp_path / "missing-dir" / "sock"), socket.AF_UNIX)
    assert info.value.errno == errno.ENOENT and "not an address" not in str(info.value)


def test_is_this_host_tells_this_hosts_addresses_from_others():
    from tensorxfer.connections import is_this_host

    assert is_this_host("127.0.0.1") and is_this_host("localhost") and is_this_host(socket.gethostname())
    assert not is_this_host("192.0.2.1")        # TEST-NET-1: never an address of this host
