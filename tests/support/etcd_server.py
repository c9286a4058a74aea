"""A real etcd server for tests: :class:`kvsvc.testbed.etcd_launcher.LocalEtcd` (free loopback
client and peer ports, a temporary data directory, health-checked start, stop/restart on the
same ports and data, full cleanup), the skip-or-fail rule for a missing binary, and
:meth:`EtcdServer.paused` (SIGSTOP/SIGCONT), which makes every etcd request hang, for tests of
what a blocked thread does.

When ``etcd`` is missing, tests using it are skipped, except under CI (env ``CI`` set), where a
missing binary fails the test: CI must install ``etcd-server``.

Most tests need only a clean keyspace: they share one etcd per session through
:class:`SharedEtcd` (every key and lease removed before and after each test). A test that stops,
pauses or restarts etcd is marked ``etcd_fresh`` and gets an :class:`EtcdServer` of its own.
"""

from __future__ import annotations

import base64
import os
import signal
from contextlib import contextmanager
from typing import Iterator

import pytest
import requests

from kvsvc.testbed.etcd_launcher import INSTALL_HINT, LocalEtcd, etcd_binary


def require_etcd_binary() -> str:
    """The etcd binary; skips (or fails under ``CI``) when it is not installed."""
    path = etcd_binary()
    if path is None:
        message = f"etcd binary not found ({INSTALL_HINT})"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


class EtcdServer(LocalEtcd):
    """One single-member etcd on 127.0.0.1 for a test (``addr`` is the ``--etcd_addr`` form)."""

    def __init__(self, binary: str) -> None:
        super().__init__(binary, name="kvsvc-test")
        self._paused = False

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Stop the etcd process (SIGSTOP) for the block, then continue it (SIGCONT). Meanwhile
        connections are still accepted by the kernel but no request is answered: every client
        call blocks until its own timeout."""
        proc = self._proc
        assert proc is not None and proc.poll() is None, "etcd is not running"
        os.kill(proc.pid, signal.SIGSTOP)
        self._paused = True
        try:
            yield
        finally:
            self._resume()

    def _resume(self) -> None:
        proc = self._proc
        if self._paused and proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        self._paused = False

    def stop(self, timeout_s: float = 10.0) -> None:
        """As :meth:`LocalEtcd.stop`, continuing a paused process first (SIGTERM waits on it)."""
        self._resume()
        super().stop(timeout_s)



@contextmanager
def fresh_etcd() -> Iterator[EtcdServer]:
    """A real etcd of its own on free loopback ports, started, then stopped and its data dir
    removed (:func:`require_etcd_binary` decides skip or fail when the binary is missing)."""
    server = EtcdServer(require_etcd_binary())
    try:
        server.start()
        yield server
    finally:
        server.cleanup()

class SharedEtcd:
    """The session's etcd as one test sees it (the ``etcd_server`` fixture without the
    ``etcd_fresh`` marker): the same ``addr``, and a clean keyspace — :meth:`reset` deletes
    every key and revokes every lease, before the test and after it.

    It cannot be stopped, paused or restarted (the next test would inherit it): those raise,
    naming the marker that gives the test an etcd of its own.
    """

    def __init__(self, server: EtcdServer) -> None:
        self._server = server
        self.addr = server.addr

    def reset(self, timeout_s: float = 5.0) -> None:
        """Delete every key (the range ``\\0``..``\\0``) and revoke every lease, over etcd's v3
        JSON gateway; restart the server first if a test left it dead.

        :raises AssertionError: the keyspace is not empty afterwards.
        """
        if not self._server.running:
            self._server.start()
        base = f"http://{self.addr}/v3"
        everything = {"key": _b64(b"\0"), "range_end": _b64(b"\0")}
        with requests.Session() as http:
            http.post(f"{base}/kv/deleterange", json=everything, timeout=timeout_s)
            leases = http.post(f"{base}/lease/leases", json={}, timeout=timeout_s).json()
            for lease in leases.get("leases", []):
                http.post(f"{base}/lease/revoke", json={"ID": lease["ID"]}, timeout=timeout_s)
            left = http.post(f"{base}/kv/range", json={**everything, "count_only": True},
                             timeout=timeout_s).json()
        assert int(left.get("count", 0)) == 0, f"shared etcd not clean: {left}"

    @property
    def running(self) -> bool:
        """True while the session's etcd process is alive."""
        return self._server.running

    def log_tail(self, n_bytes: int = 2000) -> str:
        """The end of the session etcd's output."""
        return self._server.log_tail(n_bytes)

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("this test shares the session's etcd; mark it "
                             "@pytest.mark.etcd_fresh to stop, pause or restart an etcd of its own")

    stop = start = restart = cleanup = paused = _refuse


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
