"""A local single-member etcd for ``kvsvc demo`` and the tests (Debian's ``etcd-server``
package, ``/usr/bin/etcd``): free loopback client and peer ports outside the ephemeral range
(:mod:`kvsvc.testbed.ports`), a temporary data directory,
a health-checked start, stop/restart on the same ports and data, full cleanup.

Errors: :class:`~kvsvc.errors.LifecycleError` when the binary is missing, the process exits
or it does not become healthy in time.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
from typing import Optional

import requests

from kvsvc.errors import LifecycleError
from kvsvc.testbed.ports import free_ports

log = logging.getLogger(__name__)

#: Where Debian's ``etcd-server`` installs the server.
DEBIAN_ETCD = "/usr/bin/etcd"
INSTALL_HINT = "apt-get install etcd-server"


def etcd_binary() -> Optional[str]:
    """Path of the etcd server binary (``etcd`` on PATH, else Debian's), or ``None``."""
    found = shutil.which("etcd")
    if found:
        return found
    return DEBIAN_ETCD if os.access(DEBIAN_ETCD, os.X_OK) else None


class LocalEtcd:
    """One etcd member on 127.0.0.1 with its own data directory.

    :param binary: the etcd executable; ``None`` finds it (:func:`etcd_binary`).
    :param name: member name.
    :ivar addr: ``127.0.0.1:<client port>``, the ``--etcd_addr`` form.
    :raises LifecycleError: no binary given or found (the message says how to install it).
    """

    def __init__(self, binary: Optional[str] = None, name: str = "kvsvc") -> None:
        binary = binary or etcd_binary()
        if binary is None:
            raise LifecycleError(f"etcd not found; install it: {INSTALL_HINT}")
        self.binary = binary
        self.name = name
        # Outside the ephemeral range: a restart re-binds them while clients reconnect.
        self.client_port, self.peer_port = free_ports(2)
        self.addr = f"127.0.0.1:{self.client_port}"
        self.data_dir = tempfile.mkdtemp(prefix="kvsvc-etcd-")
        self.log_path = os.path.join(self.data_dir, "etcd.log")
        self._proc: Optional[subprocess.Popen[bytes]] = None

    @property
    def running(self) -> bool:
        """True while the etcd process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> Optional[int]:
        """The etcd process's pid while started."""
        return self._proc.pid if self._proc is not None else None

    def start(self, timeout_s: float = 15.0) -> None:
        """Start etcd and return once ``GET /health`` says healthy.

        :param timeout_s: bound of the wait, seconds.
        :raises LifecycleError: already running, exited, or not healthy in time (log tail in
            the message; the process is stopped).
        """
        if self._proc is not None:
            raise LifecycleError("etcd already running")
        client_url = f"http://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        with open(self.log_path, "ab") as out:
            self._proc = subprocess.Popen(
                [self.binary, "--name", self.name,
                 "--data-dir", os.path.join(self.data_dir, "data"),
                 "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                 "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                 "--initial-cluster", f"{self.name}={peer_url}",
                 "--log-level", "error", "--logger", "zap"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                # Its own session: a terminal's Ctrl-C reaches only the parent, which stops
                # etcd last (engines revoke their leases first).
                start_new_session=True)
        deadline = time.monotonic() + timeout_s
        with requests.Session() as http:
            while True:
                if self._proc.poll() is not None:
                    code = self._proc.returncode
                    self._proc = None
                    raise LifecycleError(f"etcd exited with {code}: {self.log_tail()}")
                try:
                    reply = http.get(f"{client_url}/health", timeout=0.5)
                    if reply.status_code == 200 and reply.json().get("health") == "true":
                        break
                except (requests.RequestException, ValueError):
                    pass
                if time.monotonic() >= deadline:
                    self.stop()
                    raise LifecycleError(f"etcd not healthy within {timeout_s:.0f} s: "
                                         f"{self.log_tail()}")
                time.sleep(0.05)  # polling another process's readiness, bounded by deadline
        log.info("etcd %s started on %s (pid %d)", self.name, self.addr, self._proc.pid)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, SIGKILL after ``timeout_s``; keeps the data directory. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)
        log.info("etcd %s on %s stopped", self.name, self.addr)

    def restart(self, timeout_s: float = 15.0) -> None:
        """Stop, then start on the same ports with the same data (keys and leases survive)."""
        self.stop()
        self.start(timeout_s)

    def cleanup(self) -> None:
        """Stop etcd and remove its data directory. Idempotent."""
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "LocalEtcd":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def log_tail(self, n_bytes: int = 2000) -> str:
        """The end of etcd's output."""
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n_bytes:].decode("utf-8", "replace")
        except OSError:
            return "(no log)"
