"""A real etcd server for tests: :class:`kvsvc.testbed.etcd_launcher.LocalEtcd` (free loopback client
and peer ports, a temporary data directory, health-checked start, stop/restart on the same ports
and data, full cleanup) plus the skip-or-fail rule for a missing binary.

When ``etcd`` is missing, tests using it are skipped, except under CI (env ``CI`` set), where a
missing binary fails the test: CI must install ``etcd-server``.
"""

from __future__ import annotations

import os

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
