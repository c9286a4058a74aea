"""``kvsvc serve`` on a listen address it cannot bind fails at once with the configuration exit
code (2) and the address named, before gunicorn starts (which would retry five times and exit
1 after about 8 s, and systemd would restart it); a port whose old connections are in
TIME_WAIT is not refused (gunicorn binds with SO_REUSEADDR)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from kvsvc.cli import EXIT_CONFIG, check_bind
from kvsvc.errors import ConfigError
from tests.support.util import free_port


def _serve(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kvsvc", "serve", *args],
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=60)
    return proc.returncode, proc.stderr, time.monotonic() - t0


@pytest.fixture
def listener():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s
    s.close()


def test_busy_port_fails_at_once_with_the_config_exit_code(listener):
    port = listener.getsockname()[1]
    code, err, elapsed = _serve("--host", "127.0.0.1", "--port", str(port))
    assert code == EXIT_CONFIG, err
    assert f"kvsvc: invalid configuration: --port: cannot listen on 127.0.0.1:{port}: " \
           "already in use" in err
    # Refused before gunicorn starts: none of its bind retries (about 8 s) ran. Said by the
    # output, not by a time bound (the machine's load decides the time).
    assert "gunicorn" not in err.lower() and "Retrying" not in err
    del elapsed


def test_busy_port_from_the_environment_names_the_variable(listener):
    port = listener.getsockname()[1]
    code, err, _ = _serve("--host", "127.0.0.1", env={"KVSVC_PORT": str(port)})
    assert code == EXIT_CONFIG
    assert f"KVSVC_PORT: cannot listen on 127.0.0.1:{port}" in err


def test_a_port_in_time_wait_is_accepted():
    port = free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(1)
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()            # the side that closes first keeps TIME_WAIT on 127.0.0.1:port
    client.recv(1)          # the peer's FIN arrived
    client.close()
    server.close()
    plain = socket.socket()
    try:
        with pytest.raises(OSError):  # the TIME_WAIT is there: a bind without SO_REUSEADDR fails
            plain.bind(("127.0.0.1", port))
    finally:
        plain.close()
    check_bind("127.0.0.1", port)  # as gunicorn binds: accepted


def test_an_address_that_is_not_local_is_refused():
    with pytest.raises(ConfigError, match=r"--port: cannot listen on 192\.0\.2\.1:"):
        check_bind("192.0.2.1", free_port())
    with pytest.raises(ConfigError, match="cannot listen on no-such-host.invalid:"):
        check_bind("no-such-host.invalid", 8888)


def test_busy_baidu_std_port_fails_at_once(listener):
    """The baidu_std port (§13, bound by the worker after the fork) is probed before gunicorn
    starts too; it is probed only when served (with --etcd_addr)."""
    port = listener.getsockname()[1]
    code, err, _ = _serve("--host", "127.0.0.1", "--port", str(free_port()), "--etcd_addr",
                          "127.0.0.1:1", "--rpc_host", "127.0.0.1", "--rpc_port", str(port))
    assert code == EXIT_CONFIG, err
    assert f"--rpc_port: cannot listen on 127.0.0.1:{port}: already in use" in err
