"""A real etcd server for tests: free loopback client and peer ports, a temporary data
directory, health-checked start, stop/restart (same ports and data) and full cleanup.

When ``/usr/bin/etcd`` (or ``etcd`` on PATH) is missing, tests using it are skipped, except
under CI (env ``CI`` set), where a missing binary fails the test: CI must install ``etcd-server``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from typing import Optional

import pytest
import requests

from tests.util import free_ports


def etcd_binary() -> Optional[str]:
    """Path of the etcd binary, or None."""
    return shutil.which("etcd") or (os.path.exists("/usr/bin/etcd") and "/usr/bin/etcd") or None


def require_etcd_binary() -> str:
    """The etcd binary; skips (or fails under ``CI``) when it is not installed."""
    path = etcd_binary()
    if path is None:
        message = "etcd binary not found (apt-get install etcd-server)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


class EtcdServer:
    """One single-member etcd on 127.0.0.1.

    :param binary: path of the etcd executable.
    :ivar addr: ``127.0.0.1:<client port>`` (the ``--etcd_addr`` form).
    """

    def __init__(self, binary: str) -> None:
        self._binary = binary
        self.client_port, self.peer_port = free_ports(2)
        self.addr = f"127.0.0.1:{self.client_port}"
        self._data_dir = tempfile.mkdtemp(prefix="kvsvc-etcd-")
        self._proc: Optional[subprocess.Popen] = None
        self._log_path = os.path.join(self._data_dir, "etcd.log")

    def start(self, timeout_s: float = 15.0) -> None:
        """Start etcd and wait until ``/health`` answers healthy.

        :raises RuntimeError: when it does not become healthy within ``timeout_s``.
        """
        assert self._proc is None, "already running"
        client_url = f"http://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        log_file = open(self._log_path, "ab")
        try:
            self._proc = subprocess.Popen(
                [self._binary, "--name", "kvsvc-test",
                 "--data-dir", os.path.join(self._data_dir, "data"),
                 "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                 "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                 "--initial-cluster", f"kvsvc-test={peer_url}",
                 "--log-level", "error", "--logger", "zap"],
                stdout=log_file, stderr=subprocess.STDOUT)
        finally:
            log_file.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self._proc.returncode}: {self._log_tail()}")
            try:
                reply = requests.get(f"{client_url}/health", timeout=0.5)
                if reply.status_code == 200 and reply.json().get("health") == "true":
                    return
            except (requests.RequestException, ValueError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"etcd not healthy after {timeout_s}s: {self._log_tail()}")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop etcd (SIGTERM, SIGKILL after ``timeout_s``); keeps the data dir (idempotent)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)

    def restart(self) -> None:
        """Stop then start on the same ports with the same data (keys and leases survive)."""
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        """True while the etcd process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def cleanup(self) -> None:
        """Stop etcd and remove its data directory."""
        self.stop()
        shutil.rmtree(self._data_dir, ignore_errors=True)

    def _log_tail(self) -> str:
        try:
            with open(self._log_path, "rb") as f:
                return f.read()[-2000:].decode("utf-8", "replace")
        except OSError:
            return ""
