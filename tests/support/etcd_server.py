"""A real etcd server for tests: :class:`kvsvc.testbed.etcd_launcher.LocalEtcd` (free loopback
client and peer ports, a temporary data directory, health-checked start, stop/restart on the
same ports and data, full cleanup), the skip-or-fail rule for a missing binary, and
:meth:`EtcdServer.paused` (SIGSTOP/SIGCONT), which makes every etcd request hang, for tests of
what a blocked thread does.

When ``etcd`` is missing, tests using it are skipped, except under CI (env ``CI`` set), where a
missing binary fails the test: CI must install ``etcd-server``.
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from typing import Iterator

import pytest

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
